//! A sandbox's creation: the checks (idempotency key, balance, limits, the
//! node's room) and the rows it writes, in one transaction on SQLite and
//! one round trip on PostgreSQL; why a create wrote nothing.

use super::*;

/// Why [`Store::create_sandbox`] wrote nothing: the checks read again,
/// under the same locks, in the order the API reports them.
async fn refusal(
    tx: &mut Transaction<'static, Any>,
    new: &NewSandbox,
    host_max: Option<i64>,
) -> Result<CreateOutcome> {
    // Everything the decision reads, in one statement (one round trip
    // to a PostgreSQL server), taken under the locks above.
    let checks = sqlx::query(concat!(
        "SELECT a.max_concurrent AS max_concurrent, \
           (SELECT CAST(COALESCE(SUM(amount_micros), 0) AS BIGINT) FROM ledger \
              WHERE account_id = a.id) AS balance, \
           (SELECT COUNT(*) FROM sandboxes WHERE account_id = a.id \
              AND status IN ",
        live_statuses!(),
        ") AS live, \
           (SELECT CAST(COALESCE(SUM(disk_used_bytes), 0) AS BIGINT) FROM sandboxes \
              WHERE account_id = a.id \
              AND status IN ",
        live_statuses!(),
        ") AS disk_used, \
           (SELECT COUNT(*) FROM sandboxes WHERE host = $2 \
              AND status IN ",
        live_statuses!(),
        ") AS host_live, \
           (SELECT request_hash FROM idempotency WHERE account_id = a.id AND key = $3) \
              AS seen_hash, \
           (SELECT sandbox_id FROM idempotency WHERE account_id = a.id AND key = $3) \
              AS seen_sandbox \
         FROM accounts a WHERE a.id = $1"
    ))
    .bind(&new.account_id)
    .bind(&new.host)
    .bind(new.idempotency.as_ref().map(|(key, _)| key.as_str()))
    .fetch_optional(&mut **tx)
    .await?
    .ok_or_else(|| StoreError::NotFound(format!("account {}", new.account_id)))?;

    if let Some((_, hash)) = &new.idempotency {
        if let Some(seen_hash) = get_opt_str(&checks, "seen_hash")? {
            if &seen_hash != hash {
                return Ok(CreateOutcome::IdempotencyConflict);
            }
            let sandbox_id = get_str(&checks, "seen_sandbox")?;
            let row = sandbox_in(tx, &sandbox_id).await?.ok_or_else(|| {
                StoreError::Corrupt(format!("idempotency row names missing {sandbox_id}"))
            })?;
            return Ok(CreateOutcome::Replay(row));
        }
    }
    if new.host_epoch.is_some() {
        let Some(max) = host_max else {
            return Ok(CreateOutcome::HostUnavailable);
        };
        let live = get_i64(&checks, "host_live")?;
        if live >= max {
            return Ok(CreateOutcome::HostFull {
                live: u32::try_from(live).unwrap_or(u32::MAX),
                limit: u32::try_from(max).unwrap_or(u32::MAX),
            });
        }
    }
    let limit = match new.max_concurrent {
        Some(l) => l,
        None => get_u32(&checks, "max_concurrent")?,
    };
    let balance = get_i64(&checks, "balance")?;
    if balance < new.reserve_micros {
        return Ok(CreateOutcome::InsufficientCredits {
            balance,
            needed: new.reserve_micros,
        });
    }
    let live = u32::try_from(get_i64(&checks, "live")?).unwrap_or(u32::MAX);
    if live >= limit {
        return Ok(CreateOutcome::TooManySandboxes { live, limit });
    }
    if let Some(limit) = new.disk_limit_bytes {
        let used = get_i64(&checks, "disk_used")?.max(0) as u64;
        if used >= limit {
            return Ok(CreateOutcome::OverDiskLimit { used, limit });
        }
    }
    if sandbox_in(tx, &new.id).await?.is_some() {
        return Ok(CreateOutcome::IdTaken);
    }

    Err(StoreError::Corrupt(format!(
        "the create of {} passed every check, yet its row was not written",
        new.id
    )))
}

/// The rows a create writes, if every check passes (the same checks as
/// [`refusal`], in SQL): the sandbox (`provisioning`), its first event,
/// its reservation in the ledger, its idempotency key. `None`: a check
/// failed, nothing was written. On PostgreSQL one statement (one round
/// trip: a data-modifying CTE); on SQLite, in the process, one statement
/// each.
async fn insert_sandbox(
    tx: &mut Transaction<'static, Any>,
    new: &NewSandbox,
    host_max: Option<i64>,
    postgres: bool,
) -> Result<Option<SandboxRow>> {
    let sql = insert_sql(postgres, "$14");
    let query = bind_create_event(
        sqlx::query(sqlx::AssertSqlSafe(sql)),
        new,
        new.host_epoch.and(host_max),
        postgres,
    );
    let Some(row) = inserted(query.fetch_optional(&mut **tx).await, new)? else {
        return Ok(None);
    };
    if postgres {
        return Ok(Some(row));
    }
    insert_event(
        tx,
        &row.id,
        &row.account_id,
        SandboxStatus::Provisioning,
        "sandbox.created",
        None,
        &new.cause,
        row.created_at,
    )
    .await?;
    if new.reserve_micros > 0 {
        insert_ledger(
            tx,
            &row.account_id,
            &row.id,
            "reserve",
            -new.reserve_micros,
            Some("create"),
            row.created_at,
        )
        .await?;
    }
    if let Some((key, hash)) = &new.idempotency {
        sqlx::query(
            "INSERT INTO idempotency (account_id, key, request_hash, sandbox_id, created_at) \
             VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(&row.account_id)
        .bind(key)
        .bind(hash)
        .bind(&row.id)
        .bind(format_ts(row.created_at))
        .execute(&mut **tx)
        .await?;
    }
    Ok(Some(row))
}

/// The row a create's insert returned, if any (a sandbox of that id
/// already there is a conflict).
fn inserted(
    outcome: std::result::Result<Option<AnyRow>, sqlx::Error>,
    new: &NewSandbox,
) -> Result<Option<SandboxRow>> {
    match outcome {
        Ok(row) => row.as_ref().map(sandbox_from).transpose(),
        Err(e) => {
            let e = StoreError::from(e);
            if e.is_unique_violation() {
                return Err(StoreError::Conflict(format!("sandbox {} exists", new.id)));
            }
            Err(e)
        }
    }
}

/// [`insert_sandbox`]'s statement. `host_max` is the SQL of the node's
/// room (`NULL`: not counted): a parameter, or in [`create_function`] a
/// variable.
fn insert_sql(postgres: bool, host_max: &str) -> String {
    const LIVE: &str = concat!("status IN ", live_statuses!());
    let sandbox = format!(
        "INSERT INTO sandboxes (id, account_id, name, size, vcpus, memory_mb, disk_gb, \
           timeout_minutes, status, price_micros_per_hour, host, created_at, expires_at, \
           snapshot_id, metadata, env, access_token, every_port_public, internet_access, \
           template_id, workdir, network, start_from) \
         SELECT $1, $2, $3, $4, $5, $6, $7, $8, 'provisioning', $9, $10, $11, $12, $18, \
           $20, $21, $22, $23, $24, $25, $26, $27, $28 \
         FROM accounts a WHERE a.id = $2 \
           AND NOT EXISTS (SELECT 1 FROM idempotency WHERE account_id = a.id AND key = $13) \
           AND ({host_max} IS NULL OR (SELECT COUNT(*) FROM sandboxes \
                WHERE host = $10 AND {LIVE}) < {host_max}) \
           AND (SELECT COALESCE(SUM(amount_micros), 0) FROM ledger WHERE account_id = a.id) \
                >= $15 \
           AND (SELECT COUNT(*) FROM sandboxes WHERE account_id = a.id AND {LIVE}) \
                < COALESCE($16, a.max_concurrent) \
           AND ($17 IS NULL OR (SELECT COALESCE(SUM(disk_used_bytes), 0) FROM sandboxes \
                WHERE account_id = a.id AND {LIVE}) < $17) \
         ON CONFLICT (id) DO NOTHING \
         RETURNING *"
    );
    match postgres {
        true => format!(
            "WITH s AS ({sandbox}), \
             e AS (INSERT INTO {events} \
                   SELECT id, account_id, status, 'sandbox.created', $29, NULL, $30, created_at \
                   FROM s), \
             l AS (INSERT INTO ledger (account_id, sandbox_id, kind, amount_micros, note, at) \
                   SELECT account_id, id, 'reserve', -$15, 'create', created_at FROM s \
                   WHERE $15 > 0), \
             i AS (INSERT INTO idempotency (account_id, key, request_hash, sandbox_id, \
                     created_at) \
                   SELECT account_id, $13, $19, id, created_at FROM s WHERE $13 IS NOT NULL) \
             SELECT * FROM s",
            events = crate::events::EVENT_COLUMNS
        ),
        false => sandbox,
    }
}

/// The statement that takes a create's locks: the account's row lock (see
/// `lock_account`), and the node's: creates on one node take turns (they
/// count its places), and the sweep that would declare it lost waits for
/// the sandbox to exist, and then settles it with the others. The
/// account's first. `host_max` is `NULL` when the node is not up at that
/// epoch within its lease, or is draining. Its parameters are named by the caller.
fn lock_sql(engine: crate::Engine, account: &str, node: &str, epoch: &str) -> String {
    let lock = match engine {
        crate::Engine::Postgres => " FOR NO KEY UPDATE",
        crate::Engine::Sqlite => "",
    };
    format!(
        "SELECT (SELECT 1 FROM accounts WHERE id = {account}{lock}) AS account, \
           (SELECT max_sandboxes FROM nodes WHERE name = {node} AND epoch = {epoch} \
              AND state = 'up' AND draining = 0 AND lease_until_ms > {}{lock}) AS host_max",
        crate::nodes::now_ms_sql(engine)
    )
}

/// A create on PostgreSQL in one round trip: a function that takes the
/// locks ([`lock_sql`]), then writes the sandbox if every check passes
/// ([`insert_sql`], a statement of its own, so that it reads what the
/// transactions it waited for committed), and returns the row, or nothing
/// when a check failed (the reason is then read in a transaction, as on
/// SQLite). Its parameters are [`bind_create`]'s, the node's epoch
/// fourteenth. Made from the same statements as the transaction's, and
/// named by a hash of its text, so each build calls its own: `(name,
/// definition)`.
pub(crate) fn create_function() -> &'static (String, String) {
    static FUNCTION: std::sync::OnceLock<(String, String)> = std::sync::OnceLock::new();
    FUNCTION.get_or_init(|| {
        let lock = lock_sql(crate::Engine::Postgres, "$2", "$10", "$14");
        let insert = insert_sql(true, "v_host_max");
        let body = format!(
            "DECLARE v_account integer; v_host_max bigint; v_row sandboxes%ROWTYPE; \
             BEGIN \
               {lock} INTO v_account, v_host_max; \
               IF v_account IS NULL OR ($14 IS NOT NULL AND v_host_max IS NULL) THEN \
                 RETURN; \
               END IF; \
               {insert} INTO v_row; \
               IF FOUND THEN RETURN NEXT v_row; END IF; \
             END"
        );
        let hash = hex::encode(&sha2::Sha256::digest(body.as_bytes())[..6]);
        let name = format!("sandpit_create_sandbox_{hash}");
        let definition = format!(
            "CREATE OR REPLACE FUNCTION {name}(text, text, text, text, bigint, bigint, bigint, \
                 bigint, bigint, text, text, text, text, bigint, bigint, bigint, bigint, text, text, \
                 text, text, text, bigint, bigint, text, text, text, text, text, text) \
             RETURNS SETOF sandboxes LANGUAGE plpgsql AS $create$ {body} $create$"
        );
        (name, definition)
    })
}

/// Defines [`create_function`] in the database unless it is there (once,
/// whoever starts at the same time: under an advisory lock).
pub(crate) async fn install_create_function(conn: &mut sqlx::AnyConnection) -> Result<()> {
    use sqlx::Connection;
    let (name, definition) = create_function();
    let defined = "SELECT CAST(COUNT(*) AS BIGINT) FROM pg_proc WHERE proname = $1";
    let found: i64 = sqlx::query_scalar(defined)
        .bind(name)
        .fetch_one(&mut *conn)
        .await?;
    if found > 0 {
        return Ok(());
    }
    let mut tx = conn.begin().await?;
    sqlx::query("SELECT CAST(pg_advisory_xact_lock(7320551130146541) AS TEXT)")
        .execute(&mut *tx)
        .await?;
    let found: i64 = sqlx::query_scalar(defined)
        .bind(name)
        .fetch_one(&mut *tx)
        .await?;
    if found == 0 {
        sqlx::raw_sql(sqlx::AssertSqlSafe(definition.clone()))
            .execute(&mut *tx)
            .await?;
    }
    tx.commit().await?;
    Ok(())
}

/// Binds a create's values to [`insert_sql`] (or [`create_function`]):
/// `fourteenth` is the node's room (its epoch, for the function).
fn bind_create<'q>(
    query: sqlx::query::Query<'q, Any, sqlx::any::AnyArguments>,
    new: &'q NewSandbox,
    fourteenth: Option<i64>,
) -> sqlx::query::Query<'q, Any, sqlx::any::AnyArguments> {
    query
        .bind(&new.id)
        .bind(&new.account_id)
        .bind(&new.name)
        .bind(&new.size)
        .bind(i64::from(new.vcpus))
        .bind(i64::from(new.memory_mb))
        .bind(i64::from(new.disk_gb))
        .bind(i64::from(new.timeout_minutes))
        .bind(new.price_micros_per_hour)
        .bind(&new.host)
        .bind(format_ts(new.created_at))
        .bind(format_ts(new.expires_at))
        .bind(new.idempotency.as_ref().map(|(key, _)| key.clone()))
        .bind(fourteenth)
        .bind(new.reserve_micros)
        .bind(new.max_concurrent.map(i64::from))
        .bind(
            new.disk_limit_bytes
                .map(|l| i64::try_from(l).unwrap_or(i64::MAX)),
        )
        .bind(&new.snapshot_id)
        // Bound on SQLite too (its statement does not use it), so that the
        // ones after keep their numbers.
        .bind(new.idempotency.as_ref().map(|(_, hash)| hash.clone()))
        .bind(super::json_map_text(&new.metadata))
        .bind(super::json_map_text(&new.env))
        .bind(&new.access_token)
        .bind(i64::from(new.every_port_public))
        .bind(new.internet_access.map(i64::from))
        .bind(&new.template_id)
        .bind(&new.workdir)
        .bind(&new.network)
        .bind(&new.start_from)
}

/// [`bind_create`], then what only PostgreSQL's statement writes itself:
/// the `created` event's actor and detail (on SQLite `insert_event` does).
fn bind_create_event<'q>(
    query: sqlx::query::Query<'q, Any, sqlx::any::AnyArguments>,
    new: &'q NewSandbox,
    fourteenth: Option<i64>,
    postgres: bool,
) -> sqlx::query::Query<'q, Any, sqlx::any::AnyArguments> {
    let query = bind_create(query, new, fourteenth);
    match postgres {
        true => query.bind(&new.cause.actor).bind(new.cause.detail_text()),
        false => query,
    }
}

impl Store {
    /// Creates a sandbox row in `provisioning`, with its first event, its
    /// reservation (`reserve` ledger row of −`reserve_micros`) and its
    /// idempotency row, after checking — in this order — the idempotency
    /// key, the balance and the live-sandbox limit.
    ///
    /// All in one `BEGIN IMMEDIATE` transaction: concurrent creates (of any
    /// account) run one after another, so reservations that together exceed
    /// the balance can never all pass the check.
    pub async fn create_sandbox(&self, new: NewSandbox) -> Result<CreateOutcome> {
        let id = new.id.clone();
        self.create_sandbox_named(new, async { Some((id, None)) })
            .await
    }

    /// [`Store::create_sandbox`] for a sandbox whose id is still on its
    /// way (`new.id` is not used): a warm VM taken from a node over the
    /// network names it. The transaction begins meanwhile, and nothing is
    /// locked or read until `id` is known. `None` from `id` abandons the
    /// create: [`CreateOutcome::HostUnavailable`]. With the id may come how
    /// its VM starts (a warm VM was taken: `pool`), replacing
    /// `new.start_from`.
    pub async fn create_sandbox_named(
        &self,
        mut new: NewSandbox,
        id: impl std::future::Future<Output = Option<(String, Option<&'static str>)>>,
    ) -> Result<CreateOutcome> {
        if new.reserve_micros < 0 {
            return Err(StoreError::Invalid(format!(
                "reserve_micros must not be negative, not {}",
                new.reserve_micros
            )));
        }
        if self.engine == crate::Engine::Postgres {
            let Some((id, from)) = id.await else {
                return Ok(CreateOutcome::HostUnavailable);
            };
            new.id = id;
            if let Some(from) = from {
                new.start_from = Some(from.into());
            }
            // The common case in one round trip (see `create_function`).
            let sql = format!(
                "SELECT * FROM {}($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, \
                 $14, $15, $16, $17, $18, $19, $20, $21, $22, $23, $24, $25, $26, $27, $28, $29, \
                 $30)",
                create_function().0
            );
            let query = bind_create_event(
                sqlx::query(sqlx::AssertSqlSafe(sql)),
                &new,
                new.host_epoch,
                true,
            );
            if let Some(row) = inserted(query.fetch_optional(&self.pool).await, &new)? {
                return Ok(CreateOutcome::Created(row));
            }
            // Refused: the reason, read in a transaction under the same
            // locks (which also creates it, had the checks passed since).
            let tx = self.write_tx().await?;
            return self.create_in(tx, new).await;
        }
        let (tx, id) = tokio::join!(self.write_tx(), id);
        let tx = tx?;
        let Some((id, from)) = id else {
            return Ok(CreateOutcome::HostUnavailable);
        };
        new.id = id;
        if let Some(from) = from {
            new.start_from = Some(from.into());
        }
        self.create_in(tx, new).await
    }

    /// [`Store::create_sandbox`] in transaction `tx`: the locks, the checks
    /// and the writes, or the reason for a refusal.
    async fn create_in(
        &self,
        mut tx: Transaction<'static, Any>,
        new: NewSandbox,
    ) -> Result<CreateOutcome> {
        let postgres = crate::is_postgres(&tx);
        let engine = match postgres {
            true => crate::Engine::Postgres,
            false => crate::Engine::Sqlite,
        };
        let sql = lock_sql(engine, "$1", "$2", "$3");
        let locked = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(&new.account_id)
            .bind(&new.host)
            .bind(new.host_epoch)
            .fetch_one(&mut *tx)
            .await?;
        let host_max: Option<i64> = locked.try_get("host_max")?;
        if locked.try_get::<Option<i64>, _>("account")?.is_none() {
            return Err(StoreError::NotFound(format!("account {}", new.account_id)));
        }

        // The common case in one statement: the row (and on PostgreSQL its
        // event, reservation and key) written only if every check passes,
        // read under the locks above. A node not up at that epoch is not
        // tried: only the reason is left to find.
        let inserted = match (new.host_epoch, host_max) {
            (Some(_), None) => None,
            _ => insert_sandbox(&mut tx, &new, host_max, postgres).await?,
        };
        if let Some(row) = inserted {
            tx.commit().await?;
            return Ok(CreateOutcome::Created(row));
        }
        refusal(&mut tx, &new, host_max).await
    }
}
