//! Executions (commands run in a sandbox, kept so `GET /executions/{id}`
//! can answer later) and exposed ports.

use crate::error::{Result, StoreError};
use crate::states::{ended_statuses, ExecutionState, ExecutionStatus};
use crate::util::{format_ts, get_i64, get_opt_ts, get_str, get_ts, now};
use crate::{lock_account, row_lock, Engine, Store};
use sqlx::any::AnyArguments;
use sqlx::any::AnyRow;
use sqlx::Any;
use time::OffsetDateTime;

/// A command run in a sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecutionRow {
    /// Chosen by the caller, e.g. [`crate::new_id`]`("exec")`.
    pub id: String,
    pub sandbox_id: String,
    /// The sandbox's account, so look-ups can be scoped without a join.
    pub account_id: String,
    pub command: String,
    /// `Running` until finished.
    pub status: ExecutionState,
    pub exit_code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    pub truncated: bool,
    pub duration_ms: u64,
    pub started_at: OffsetDateTime,
    pub finished_at: Option<OffsetDateTime>,
}

/// How a command ended: the input of [`Store::finish_execution`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecutionResult {
    pub status: ExecutionStatus,
    pub exit_code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    pub truncated: bool,
    pub duration_ms: u64,
    pub finished_at: OffsetDateTime,
}

/// An exposed port of a sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortRow {
    pub sandbox_id: String,
    pub port: u16,
    pub url: String,
    /// When it was (last) opened.
    pub created_at: OffsetDateTime,
    pub closed_at: Option<OffsetDateTime>,
    /// Served only with the sandbox's traffic token (see migration 0019).
    pub private: bool,
}

/// A page of a sandbox's executions, newest first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecutionPage {
    pub data: Vec<ExecutionRow>,
    pub has_more: bool,
}

fn execution_from(row: &AnyRow) -> Result<ExecutionRow> {
    let exit_code = row_opt_i64(row, "exit_code")?
        .map(|c| i32::try_from(c).map_err(|_| StoreError::Corrupt(format!("exit_code {c}"))))
        .transpose()?;
    let duration = get_i64(row, "duration_ms")?;
    Ok(ExecutionRow {
        id: get_str(row, "id")?,
        sandbox_id: get_str(row, "sandbox_id")?,
        account_id: get_str(row, "account_id")?,
        command: get_text(row, "command")?,
        status: ExecutionState::stored(&get_str(row, "status")?)?,
        exit_code,
        stdout: get_text(row, "stdout")?,
        stderr: get_text(row, "stderr")?,
        truncated: get_i64(row, "truncated")? != 0,
        duration_ms: u64::try_from(duration)
            .map_err(|_| StoreError::Corrupt(format!("duration_ms {duration}")))?,
        started_at: get_ts(row, "started_at")?,
        finished_at: get_opt_ts(row, "finished_at")?,
    })
}

/// A command or an output: TEXT on SQLite, BYTEA (UTF-8) on PostgreSQL,
/// whose TEXT cannot hold the NUL character a command's output may have.
fn get_text(row: &AnyRow, col: &str) -> Result<String> {
    use sqlx::Row;
    match row.try_get::<String, _>(col) {
        Ok(s) => Ok(s),
        Err(_) => String::from_utf8(row.try_get::<Vec<u8>, _>(col)?)
            .map_err(|_| StoreError::Corrupt(format!("{col} is not UTF-8"))),
    }
}

/// Binds a command or an output the way [`get_text`] reads it back.
fn bind_text<'q>(
    query: sqlx::query::Query<'q, Any, AnyArguments>,
    engine: Engine,
    text: &'q str,
) -> sqlx::query::Query<'q, Any, AnyArguments> {
    match engine {
        Engine::Sqlite => query.bind(text),
        Engine::Postgres => query.bind(text.as_bytes()),
    }
}

fn row_opt_i64(row: &AnyRow, col: &str) -> Result<Option<i64>> {
    use sqlx::Row;
    Ok(row.try_get::<Option<i64>, _>(col)?)
}

fn port_from(row: &AnyRow) -> Result<PortRow> {
    let port = get_i64(row, "port")?;
    Ok(PortRow {
        sandbox_id: get_str(row, "sandbox_id")?,
        port: u16::try_from(port).map_err(|_| StoreError::Corrupt(format!("port {port}")))?,
        url: get_str(row, "url")?,
        created_at: get_ts(row, "created_at")?,
        closed_at: get_opt_ts(row, "closed_at")?,
        private: get_i64(row, "private")? != 0,
    })
}

/// Bytes an execution is counted for: its command, its outputs, and a fixed
/// overhead for the rest of its row.
fn stored_bytes(command: &str, stdout: &str, stderr: &str) -> i64 {
    (command.len() + stdout.len() + stderr.len()) as i64 + ROW_OVERHEAD
}

/// What an execution row takes besides its command and outputs.
const ROW_OVERHEAD: i64 = 256;

/// Executions deleted per transaction while trimming.
const TRIM_BATCH: i64 = 100;

/// Returns what the account's executions take after it (0 for an account
/// that is gone).
async fn add_execution_bytes(
    tx: &mut sqlx::Transaction<'_, sqlx::Any>,
    account_id: &str,
    bytes: i64,
) -> Result<u64> {
    let row = sqlx::query(
        "UPDATE accounts SET execution_bytes = execution_bytes + $2 WHERE id = $1 \
         RETURNING execution_bytes",
    )
    .bind(account_id)
    .bind(bytes)
    .fetch_optional(&mut **tx)
    .await?;
    Ok(match row {
        Some(r) => get_i64(&r, "execution_bytes")?.max(0) as u64,
        None => 0,
    })
}

fn duration_i64(ms: u64) -> Result<i64> {
    i64::try_from(ms).map_err(|_| StoreError::Invalid(format!("duration_ms {ms}")))
}

impl Store {
    /// Records an execution (usually as `running`, before it starts). A
    /// duplicate id is [`StoreError::Conflict`]; an unknown sandbox
    /// [`StoreError::NotFound`].
    pub async fn insert_execution(&self, row: &ExecutionRow) -> Result<()> {
        self.insert_execution_by(row, None).await
    }

    /// [`Store::insert_execution`], recorded as run by the cluster member
    /// `runner` (see [`Store::fail_all_running_executions`]).
    pub async fn insert_execution_by(
        &self,
        row: &ExecutionRow,
        runner: Option<&str>,
    ) -> Result<()> {
        let size = stored_bytes(&row.command, &row.stdout, &row.stderr);
        let mut tx = self.write_tx().await?;
        let query = sqlx::query(
            "INSERT INTO executions (id, sandbox_id, account_id, command, status, exit_code, \
                 stdout, stderr, truncated, duration_ms, started_at, finished_at, stored_bytes, \
                 runner) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)",
        )
        .bind(&row.id)
        .bind(&row.sandbox_id)
        .bind(&row.account_id);
        let query = bind_text(query, self.engine, &row.command)
            .bind(row.status.as_str())
            .bind(row.exit_code.map(i64::from));
        let query = bind_text(query, self.engine, &row.stdout);
        let res = bind_text(query, self.engine, &row.stderr)
            .bind(i64::from(row.truncated))
            .bind(duration_i64(row.duration_ms)?)
            .bind(format_ts(row.started_at))
            .bind(row.finished_at.map(format_ts))
            .bind(size)
            .bind(runner)
            .execute(&mut *tx)
            .await;
        match res {
            Ok(_) => {
                add_execution_bytes(&mut tx, &row.account_id, size).await?;
                tx.commit().await?;
                Ok(())
            }
            Err(e) => match e.as_database_error() {
                Some(d) if d.is_unique_violation() => {
                    Err(StoreError::Conflict(format!("execution {} exists", row.id)))
                }
                Some(d) if d.is_foreign_key_violation() => Err(StoreError::NotFound(format!(
                    "sandbox {} or account {}",
                    row.sandbox_id, row.account_id
                ))),
                _ => Err(e.into()),
            },
        }
    }

    /// Stores how a `running` execution ended, and returns what its
    /// account's executions take now (the figure
    /// [`Store::trim_executions`] holds to a budget), so that a command's
    /// end needs no second read to know whether to trim. `None` if it had
    /// already ended (the first result stays); [`StoreError::NotFound`] if
    /// there is no such execution.
    pub async fn finish_execution(
        &self,
        id: &str,
        result: &ExecutionResult,
    ) -> Result<Option<u64>> {
        let mut tx = self.write_tx().await?;
        let sql = format!(
            "SELECT account_id, command, stored_bytes FROM executions \
             WHERE id = $1 AND status = 'running'{}",
            row_lock(&tx)
        );
        let before = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(id)
            .fetch_optional(&mut *tx)
            .await?;
        let Some(before) = before else {
            drop(tx);
            return match self.execution(id).await? {
                Some(_) => Ok(None),
                None => Err(StoreError::NotFound(format!("execution {id}"))),
            };
        };
        let account = get_str(&before, "account_id")?;
        let size = stored_bytes(
            &get_text(&before, "command")?,
            &result.stdout,
            &result.stderr,
        );
        let grown = size - get_i64(&before, "stored_bytes")?;
        let query = sqlx::query(
            "UPDATE executions SET status = $2, exit_code = $3, stdout = $4, stderr = $5, \
                 truncated = $6, duration_ms = $7, finished_at = $8, stored_bytes = $9 \
             WHERE id = $1 AND status = 'running'",
        )
        .bind(id)
        .bind(result.status.as_str())
        .bind(result.exit_code.map(i64::from));
        let query = bind_text(query, self.engine, &result.stdout);
        bind_text(query, self.engine, &result.stderr)
            .bind(i64::from(result.truncated))
            .bind(duration_i64(result.duration_ms)?)
            .bind(format_ts(result.finished_at))
            .bind(size)
            .execute(&mut *tx)
            .await?;
        let stored = add_execution_bytes(&mut tx, &account, grown).await?;
        tx.commit().await?;
        Ok(Some(stored))
    }

    /// What an account's executions take in the store, in bytes (see
    /// [`Store::trim_executions`]).
    pub async fn execution_bytes(&self, account_id: &str) -> Result<u64> {
        let row = sqlx::query("SELECT execution_bytes FROM accounts WHERE id = $1")
            .bind(account_id)
            .fetch_optional(&self.pool)
            .await?
            .ok_or_else(|| StoreError::NotFound(format!("account {account_id}")))?;
        Ok(get_i64(&row, "execution_bytes")?.max(0) as u64)
    }

    /// Deletes an account's oldest ended executions until what its
    /// executions take is at most `budget` bytes (running ones stay).
    /// Returns how many were deleted.
    pub async fn trim_executions(&self, account_id: &str, budget: u64) -> Result<u64> {
        // Every command ends with this call: under budget (nearly always),
        // one read and no write lock.
        if self.execution_bytes(account_id).await.unwrap_or(0) <= budget {
            return Ok(0);
        }
        let budget = i64::try_from(budget).unwrap_or(i64::MAX);
        let mut deleted = 0;
        loop {
            let mut tx = self.write_tx().await?;
            lock_account(&mut tx, account_id).await?;
            let used: i64 = sqlx::query("SELECT execution_bytes FROM accounts WHERE id = $1")
                .bind(account_id)
                .fetch_optional(&mut *tx)
                .await?
                .map(|r| get_i64(&r, "execution_bytes"))
                .transpose()?
                .unwrap_or(0);
            if used <= budget {
                return Ok(deleted);
            }
            let oldest = sqlx::query(
                "SELECT id, stored_bytes FROM executions \
                 WHERE account_id = $1 AND status <> 'running' \
                 ORDER BY started_at, id LIMIT $2",
            )
            .bind(account_id)
            .bind(TRIM_BATCH)
            .fetch_all(&mut *tx)
            .await?;
            if oldest.is_empty() {
                return Ok(deleted);
            }
            let mut freed = 0;
            for row in &oldest {
                if used - freed <= budget {
                    break;
                }
                sqlx::query("DELETE FROM executions WHERE id = $1")
                    .bind(get_str(row, "id")?)
                    .execute(&mut *tx)
                    .await?;
                freed += get_i64(row, "stored_bytes")?;
                deleted += 1;
            }
            add_execution_bytes(&mut tx, account_id, -freed).await?;
            tx.commit().await?;
        }
    }

    /// Deletes the executions of every sandbox that ended before `before`.
    /// Returns how many.
    pub async fn drop_ended_executions(&self, before: OffsetDateTime) -> Result<u64> {
        let mut tx = self.write_tx().await?;
        let gone = sqlx::query(concat!(
            "DELETE FROM executions WHERE sandbox_id IN ( \
                 SELECT id FROM sandboxes WHERE status IN ",
            ended_statuses!(),
            " \
                 AND COALESCE(deleted_at, created_at) < $1) \
             RETURNING account_id, stored_bytes"
        ))
        .bind(format_ts(before))
        .fetch_all(&mut *tx)
        .await?;
        let mut freed: std::collections::BTreeMap<String, i64> = Default::default();
        for r in &gone {
            *freed.entry(get_str(r, "account_id")?).or_default() += get_i64(r, "stored_bytes")?;
        }
        for (account, bytes) in freed {
            add_execution_bytes(&mut tx, &account, -bytes).await?;
        }
        tx.commit().await?;
        Ok(gone.len() as u64)
    }

    /// The execution with this id (of any account: compare `account_id`).
    pub async fn execution(&self, id: &str) -> Result<Option<ExecutionRow>> {
        sqlx::query("SELECT * FROM executions WHERE id = $1")
            .bind(id)
            .fetch_optional(&self.pool)
            .await?
            .as_ref()
            .map(execution_from)
            .transpose()
    }

    /// A page of a sandbox's executions, newest first: `limit` at most,
    /// started before `starting_after` (an execution of the same sandbox,
    /// else [`StoreError::NotFound`]).
    pub async fn list_executions(
        &self,
        sandbox_id: &str,
        limit: u32,
        starting_after: Option<&str>,
    ) -> Result<ExecutionPage> {
        let cursor = match starting_after {
            None => None,
            Some(c) => {
                let at: Option<String> = sqlx::query_scalar(
                    "SELECT started_at FROM executions WHERE id = $1 AND sandbox_id = $2",
                )
                .bind(c)
                .bind(sandbox_id)
                .fetch_optional(&self.pool)
                .await?;
                Some((
                    at.ok_or_else(|| StoreError::NotFound(format!("execution {c}")))?,
                    c,
                ))
            }
        };
        let (c_at, c_id) = cursor.unzip();
        let limit = limit.max(1);
        let rows = sqlx::query(
            "SELECT * FROM executions WHERE sandbox_id = $1 \
               AND ($2 IS NULL OR started_at < $2 OR (started_at = $2 AND id < $3)) \
             ORDER BY started_at DESC, id DESC LIMIT $4",
        )
        .bind(sandbox_id)
        .bind(c_at)
        .bind(c_id)
        .bind(i64::from(limit) + 1)
        .fetch_all(&self.pool)
        .await?;
        let mut data = rows
            .iter()
            .map(execution_from)
            .collect::<Result<Vec<_>>>()?;
        let has_more = data.len() > limit as usize;
        data.truncate(limit as usize);
        Ok(ExecutionPage { data, has_more })
    }

    /// A sandbox's executions, newest first, `limit` at most.
    pub async fn sandbox_executions(
        &self,
        sandbox_id: &str,
        limit: u32,
    ) -> Result<Vec<ExecutionRow>> {
        sqlx::query(
            "SELECT * FROM executions WHERE sandbox_id = $1 \
             ORDER BY started_at DESC, id DESC LIMIT $2",
        )
        .bind(sandbox_id)
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(execution_from)
        .collect()
    }

    /// Marks every still-`running` execution of a sandbox as `failed`
    /// (its sandbox ended, or the server restarted and lost the command).
    /// Returns how many.
    pub async fn fail_running_executions(
        &self,
        sandbox_id: &str,
        finished_at: OffsetDateTime,
    ) -> Result<u64> {
        Ok(sqlx::query(
            "UPDATE executions SET status = 'failed', finished_at = $2 \
             WHERE sandbox_id = $1 AND status = 'running'",
        )
        .bind(sandbox_id)
        .bind(format_ts(finished_at))
        .execute(&self.pool)
        .await?
        .rows_affected())
    }

    /// Marks every execution still `running` that member `host` recorded
    /// (or, recorded without a runner, in a sandbox of `host`) as `failed`:
    /// for that member's start, or when it is declared lost, since the
    /// process that ran them is gone (and a guest agent, or a node, cancels
    /// the commands of a connection that closed). Other members' commands
    /// run on. Returns how many.
    pub async fn fail_all_running_executions(
        &self,
        host: &str,
        finished_at: OffsetDateTime,
    ) -> Result<u64> {
        let mut conn = self.pool.acquire().await?;
        fail_running_executions_of(&mut conn, host, finished_at).await
    }

    /// Opens a port of a sandbox, `private` or not. If it is already open,
    /// returns that row with the same URL and `created_at` (and `private` as
    /// asked now); a closed one is reopened with `url`.
    pub async fn upsert_port(
        &self,
        sandbox_id: &str,
        port: u16,
        url: &str,
        private: bool,
    ) -> Result<PortRow> {
        if port == 0 {
            return Err(StoreError::Invalid("port 0".into()));
        }
        let mut tx = self.write_tx().await?;
        // An open port keeps its URL and time; whether it is private is
        // what the last expose said.
        let res = sqlx::query(
            "INSERT INTO ports (sandbox_id, port, url, created_at, private) \
             VALUES ($1, $2, $3, $4, $5) \
             ON CONFLICT (sandbox_id, port) DO UPDATE SET \
                 url = CASE WHEN ports.closed_at IS NULL THEN ports.url ELSE excluded.url END, \
                 created_at = CASE WHEN ports.closed_at IS NULL THEN ports.created_at \
                     ELSE excluded.created_at END, \
                 closed_at = NULL, private = excluded.private",
        )
        .bind(sandbox_id)
        .bind(i64::from(port))
        .bind(url)
        .bind(format_ts(now()))
        .bind(i64::from(private))
        .execute(&mut *tx)
        .await;
        if let Err(e) = res {
            if e.as_database_error()
                .is_some_and(|d| d.is_foreign_key_violation())
            {
                return Err(StoreError::NotFound(format!("sandbox {sandbox_id}")));
            }
            return Err(e.into());
        }
        let row = sqlx::query("SELECT * FROM ports WHERE sandbox_id = $1 AND port = $2")
            .bind(sandbox_id)
            .bind(i64::from(port))
            .fetch_one(&mut *tx)
            .await?;
        tx.commit().await?;
        port_from(&row)
    }

    /// A sandbox's open ports, by port number.
    pub async fn list_ports(&self, sandbox_id: &str) -> Result<Vec<PortRow>> {
        sqlx::query("SELECT * FROM ports WHERE sandbox_id = $1 AND closed_at IS NULL ORDER BY port")
            .bind(sandbox_id)
            .fetch_all(&self.pool)
            .await?
            .iter()
            .map(port_from)
            .collect()
    }

    /// Closes an open port. `false` if it was not open.
    pub async fn close_port(&self, sandbox_id: &str, port: u16) -> Result<bool> {
        Ok(sqlx::query(
            "UPDATE ports SET closed_at = $3 \
             WHERE sandbox_id = $1 AND port = $2 AND closed_at IS NULL",
        )
        .bind(sandbox_id)
        .bind(i64::from(port))
        .bind(format_ts(now()))
        .execute(&self.pool)
        .await?
        .rows_affected()
            > 0)
    }

    /// Closes every open port of a sandbox. Returns how many.
    /// ([`Store::finish_sandbox`] does this itself.)
    pub async fn close_all_ports(&self, sandbox_id: &str) -> Result<u64> {
        Ok(sqlx::query(
            "UPDATE ports SET closed_at = $2 WHERE sandbox_id = $1 AND closed_at IS NULL",
        )
        .bind(sandbox_id)
        .bind(format_ts(now()))
        .execute(&self.pool)
        .await?
        .rows_affected())
    }
}

/// [`Store::fail_all_running_executions`] on a connection (or in a
/// transaction).
pub(crate) async fn fail_running_executions_of(
    conn: &mut sqlx::AnyConnection,
    host: &str,
    finished_at: OffsetDateTime,
) -> Result<u64> {
    Ok(sqlx::query(
        "UPDATE executions SET status = 'failed', finished_at = $1 WHERE status = 'running' \
           AND (runner = $2 OR (runner IS NULL \
                AND sandbox_id IN (SELECT id FROM sandboxes WHERE host = $2)))",
    )
    .bind(format_ts(finished_at))
    .bind(host)
    .execute(conn)
    .await?
    .rows_affected())
}
