//! Sandboxes: creation with its reservation, status changes, extension,
//! the end with its settlement, listing, expiry and usage.

use crate::accounts::balance_in;
use crate::error::{Result, StoreError};
use crate::states::{live_statuses, SandboxStatus};
use crate::util::{
    format_ts, get_i64, get_opt_str, get_opt_ts, get_str, get_ts, get_u32, now, parse_ts,
};
use crate::{lock_account, row_lock, Store};
use sha2::Digest;
use sqlx::any::AnyRow;
use sqlx::{Any, Row, Transaction};
use time::OffsetDateTime;

/// A sandbox as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxRow {
    pub id: String,
    pub account_id: String,
    pub name: Option<String>,
    pub size: String,
    pub vcpus: u32,
    pub memory_mb: u32,
    pub disk_gb: u32,
    pub timeout_minutes: u32,
    pub status: SandboxStatus,
    /// The price it was created at (a later price change does not apply).
    pub price_micros_per_hour: i64,
    /// Which host runs (ran) its VM.
    pub host: String,
    pub created_at: OffsetDateTime,
    pub ready_at: Option<OffsetDateTime>,
    pub expires_at: OffsetDateTime,
    pub deleted_at: Option<OffsetDateTime>,
    /// `destroyed`, `expired`, `failed: <cause>`, as the caller said.
    pub deleted_reason: Option<String>,
    /// What its disk takes on its host, as last measured
    /// ([`Store::set_disk_use`]).
    pub disk_used_bytes: u64,
    /// The snapshot it was started from (`None`: the image).
    pub snapshot_id: Option<String>,
    /// Since when it is paused (its status then is `Paused`).
    pub paused_at: Option<OffsetDateTime>,
    /// Seconds it spent paused before `paused_at` (billed at the paused
    /// rate).
    pub paused_seconds: u64,
}

impl SandboxRow {
    /// Seconds it has been paused in all, up to `until`.
    pub fn paused_seconds_until(&self, until: OffsetDateTime) -> u64 {
        let now = self
            .paused_at
            .map(|at| (until - at).whole_seconds().max(0) as u64)
            .unwrap_or(0);
        self.paused_seconds + now
    }

    /// Whether it still holds (or is about to hold) a VM and a reservation.
    pub fn is_live(&self) -> bool {
        self.status.is_live()
    }
}

/// Input of [`Store::create_sandbox`]: the sandbox's fields plus what the
/// creation must check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewSandbox {
    /// Chosen by the caller, e.g. [`crate::new_id`]`("sbx")`.
    pub id: String,
    pub account_id: String,
    pub name: Option<String>,
    pub size: String,
    pub vcpus: u32,
    pub memory_mb: u32,
    pub disk_gb: u32,
    pub timeout_minutes: u32,
    pub price_micros_per_hour: i64,
    pub host: String,
    pub created_at: OffsetDateTime,
    pub expires_at: OffsetDateTime,
    /// What to hold back from the balance (the cost of the whole timeout).
    pub reserve_micros: i64,
    /// The live-sandbox limit to enforce; `None` means the account's own
    /// `max_concurrent`.
    pub max_concurrent: Option<u32>,
    /// What the account's live sandboxes' disks may take together (as last
    /// measured, see [`Store::set_disk_use`]); at it, no new sandbox.
    pub disk_limit_bytes: Option<u64>,
    /// `(Idempotency-Key, hash of the request body)`, if the request had a key.
    pub idempotency: Option<(String, String)>,
    /// On a shared database: the epoch `host` must be `up` at, within its
    /// lease (see [`Store::register_node`]), and it must have room (its
    /// `max_sandboxes`), checked in the create's transaction under the
    /// node's row lock, so a node that was declared lost (whose sandboxes
    /// were settled) adds none, and two creates never both take its last
    /// place.
    pub host_epoch: Option<i64>,
    /// The snapshot it starts from (`None`: the image).
    pub snapshot_id: Option<String>,
}

/// What [`Store::create_sandbox`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CreateOutcome {
    /// A new sandbox, status `provisioning`, its reservation made.
    Created(SandboxRow),
    /// The idempotency key was used before with the same request: the
    /// sandbox that request created (in whatever state it is now). Nothing
    /// was reserved.
    Replay(SandboxRow),
    /// The idempotency key was used before with a different request.
    IdempotencyConflict,
    /// The balance does not cover the reservation.
    InsufficientCredits { balance: i64, needed: i64 },
    /// The account already has `limit` live sandboxes.
    TooManySandboxes { live: u32, limit: u32 },
    /// The account's live sandboxes' disks take `used` bytes, at or over
    /// its `limit`.
    OverDiskLimit { used: u64, limit: u64 },
    /// `host` is not `up` at `host_epoch` within its lease: it was declared
    /// lost, started again elsewhere, or is silent now.
    HostUnavailable,
    /// `host` already holds `limit` live sandboxes, its most.
    HostFull { live: u32, limit: u32 },
    /// A sandbox with this id exists: another create took the same warm
    /// VM (a node's published pool is read by every control plane).
    /// Nothing was written; retry under another id.
    IdTaken,
}

/// What [`Store::extend_sandbox`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExtendOutcome {
    /// The new expiry and timeout are stored and the extra reserved.
    Extended(SandboxRow),
    /// The balance does not cover the extra reservation.
    InsufficientCredits { balance: i64, needed: i64 },
    /// The sandbox is not `provisioning` or `running` (it is being deleted
    /// or has ended): the row as it is.
    NotLive(SandboxRow),
}

/// One status change of a sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventRow {
    pub id: i64,
    pub sandbox_id: String,
    pub status: SandboxStatus,
    pub reason: Option<String>,
    pub at: OffsetDateTime,
}

/// A page of [`Store::list_sandboxes`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxPage {
    /// Newest first.
    pub data: Vec<SandboxRow>,
    /// More rows follow the last one; pass its id as `starting_after`.
    pub has_more: bool,
}

/// A sandbox in a usage report, with what has been charged for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageRow {
    pub sandbox: SandboxRow,
    /// Sum of its `charge` rows, as a positive number. 0 while it is live
    /// (the caller computes the running cost from `created_at` and the
    /// price).
    pub charged_micros: i64,
    /// Bytes clients sent to it through its preview URLs.
    pub preview_bytes_in: i64,
    /// Bytes it sent back through its preview URLs.
    pub preview_bytes_out: i64,
}

pub(crate) fn sandbox_from(row: &AnyRow) -> Result<SandboxRow> {
    Ok(SandboxRow {
        id: get_str(row, "id")?,
        account_id: get_str(row, "account_id")?,
        name: get_opt_str(row, "name")?,
        size: get_str(row, "size")?,
        vcpus: get_u32(row, "vcpus")?,
        memory_mb: get_u32(row, "memory_mb")?,
        disk_gb: get_u32(row, "disk_gb")?,
        timeout_minutes: get_u32(row, "timeout_minutes")?,
        status: match (
            SandboxStatus::stored(&get_str(row, "status")?)?,
            get_opt_str(row, "paused_at")?,
        ) {
            (SandboxStatus::Running, Some(_)) => SandboxStatus::Paused,
            (status, _) => status,
        },
        price_micros_per_hour: get_i64(row, "price_micros_per_hour")?,
        host: get_str(row, "host")?,
        created_at: get_ts(row, "created_at")?,
        ready_at: get_opt_ts(row, "ready_at")?,
        expires_at: get_ts(row, "expires_at")?,
        deleted_at: get_opt_ts(row, "deleted_at")?,
        deleted_reason: get_opt_str(row, "deleted_reason")?,
        disk_used_bytes: get_i64(row, "disk_used_bytes")?.max(0) as u64,
        snapshot_id: get_opt_str(row, "snapshot_id")?,
        paused_at: get_opt_ts(row, "paused_at")?,
        paused_seconds: get_i64(row, "paused_seconds")?.max(0) as u64,
    })
}

fn event_from(row: &AnyRow) -> Result<EventRow> {
    Ok(EventRow {
        id: get_i64(row, "id")?,
        sandbox_id: get_str(row, "sandbox_id")?,
        status: SandboxStatus::stored(&get_str(row, "status")?)?,
        reason: get_opt_str(row, "reason")?,
        at: get_ts(row, "at")?,
    })
}

/// The sandbox, read under its row lock (see [`crate::row_lock`]).
pub(crate) async fn sandbox_in(
    tx: &mut Transaction<'static, Any>,
    id: &str,
) -> Result<Option<SandboxRow>> {
    let sql = format!("SELECT * FROM sandboxes WHERE id = $1{}", row_lock(tx));
    sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(id)
        .fetch_optional(&mut **tx)
        .await?
        .as_ref()
        .map(sandbox_from)
        .transpose()
}

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

/// What [`Store::set_status`] does with a row that is not live or already
/// has the status: the row itself if nothing is to change, the refusal if
/// it ended; `None` if the change is to be made.
fn unchanged(row: SandboxRow, new_status: SandboxStatus) -> Result<Option<SandboxRow>> {
    if !row.is_live() {
        return Err(StoreError::Conflict(format!(
            "sandbox {} is {}, it cannot become {new_status}",
            row.id, row.status
        )));
    }
    Ok((row.status == new_status).then_some(row))
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
    let query = bind_create(
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
        SandboxStatus::Provisioning,
        None,
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
           snapshot_id) \
         SELECT $1, $2, $3, $4, $5, $6, $7, $8, 'provisioning', $9, $10, $11, $12, $18 \
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
             e AS (INSERT INTO sandbox_events (sandbox_id, status, reason, at) \
                   SELECT id, status, NULL, created_at FROM s), \
             l AS (INSERT INTO ledger (account_id, sandbox_id, kind, amount_micros, note, at) \
                   SELECT account_id, id, 'reserve', -$15, 'create', created_at FROM s \
                   WHERE $15 > 0), \
             i AS (INSERT INTO idempotency (account_id, key, request_hash, sandbox_id, \
                     created_at) \
                   SELECT account_id, $13, $19, id, created_at FROM s WHERE $13 IS NOT NULL) \
             SELECT * FROM s"
        ),
        false => sandbox,
    }
}

/// The statement that takes a create's locks: the account's row lock (see
/// `lock_account`), and the node's: creates on one node take turns (they
/// count its places), and the sweep that would declare it lost waits for
/// the sandbox to exist, and then settles it with the others. The
/// account's first. `host_max` is `NULL` when the node is not up at that
/// epoch within its lease. Its parameters are named by the caller.
fn lock_sql(engine: crate::Engine, account: &str, node: &str, epoch: &str) -> String {
    let lock = match engine {
        crate::Engine::Postgres => " FOR NO KEY UPDATE",
        crate::Engine::Sqlite => "",
    };
    format!(
        "SELECT (SELECT 1 FROM accounts WHERE id = {account}{lock}) AS account, \
           (SELECT max_sandboxes FROM nodes WHERE name = {node} AND epoch = {epoch} \
              AND state = 'up' AND lease_until_ms > {}{lock}) AS host_max",
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
                 bigint, bigint, text, text, text, text, bigint, bigint, bigint, bigint, text, text) \
             RETURNS SETOF sandboxes LANGUAGE plpgsql AS $create$ {body} $create$"
        );
        (name, definition)
    })
}

/// Defines [`create_function`] in the database unless it is there (once,
/// whoever starts at the same time: under an advisory lock).
pub(crate) async fn install_create_function(pool: &sqlx::AnyPool) -> Result<()> {
    let (name, definition) = create_function();
    let defined = "SELECT CAST(COUNT(*) AS BIGINT) FROM pg_proc WHERE proname = $1";
    let found: i64 = sqlx::query_scalar(defined)
        .bind(name)
        .fetch_one(pool)
        .await?;
    if found > 0 {
        return Ok(());
    }
    let mut tx = pool.begin().await?;
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
    postgres: bool,
) -> sqlx::query::Query<'q, Any, sqlx::any::AnyArguments> {
    let query = query
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
        .bind(&new.snapshot_id);
    match postgres {
        true => query.bind(new.idempotency.as_ref().map(|(_, hash)| hash.clone())),
        false => query,
    }
}

async fn insert_event(
    tx: &mut Transaction<'static, Any>,
    sandbox_id: &str,
    status: SandboxStatus,
    reason: Option<&str>,
    at: OffsetDateTime,
) -> Result<()> {
    sqlx::query(
        "INSERT INTO sandbox_events (sandbox_id, status, reason, at) VALUES ($1, $2, $3, $4)",
    )
    .bind(sandbox_id)
    .bind(status.as_str())
    .bind(reason)
    .bind(format_ts(at))
    .execute(&mut **tx)
    .await?;
    Ok(())
}

async fn insert_ledger(
    tx: &mut Transaction<'static, Any>,
    account_id: &str,
    sandbox_id: &str,
    kind: &str,
    amount: i64,
    note: Option<&str>,
    at: OffsetDateTime,
) -> Result<()> {
    sqlx::query(
        "INSERT INTO ledger (account_id, sandbox_id, kind, amount_micros, note, at) \
         VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind(account_id)
    .bind(sandbox_id)
    .bind(kind)
    .bind(amount)
    .bind(note)
    .bind(format_ts(at))
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Ends a live sandbox inside a write transaction that holds its row lock
/// (see [`Store::finish_sandbox`]); `None` if it had already ended.
pub(crate) async fn finish_in(
    tx: &mut Transaction<'static, Any>,
    row: &SandboxRow,
    end_status: SandboxStatus,
    reason: &str,
    ended_at: OffsetDateTime,
    charge_micros: i64,
) -> Result<Option<SandboxRow>> {
    if !row.is_live() {
        return Ok(None);
    }
    let id = row.id.as_str();
    let (reserved, released, charged): (i64, i64, i64) = sqlx::query_as(
        "SELECT \
             CAST(COALESCE(SUM(CASE WHEN kind = 'reserve' THEN -amount_micros ELSE 0 END), 0) AS BIGINT), \
             CAST(COALESCE(SUM(CASE WHEN kind = 'release' THEN amount_micros ELSE 0 END), 0) AS BIGINT), \
             CAST(COALESCE(SUM(CASE WHEN kind = 'charge' THEN -amount_micros ELSE 0 END), 0) AS BIGINT) \
         FROM ledger WHERE sandbox_id = $1",
    )
    .bind(id)
    .fetch_one(&mut **tx)
    .await?;
    let release = (reserved - released).max(0);
    let charge = charge_micros.clamp(0, (reserved - released - charged).max(0));
    if release > 0 {
        insert_ledger(
            tx,
            &row.account_id,
            id,
            "release",
            release,
            Some(reason),
            ended_at,
        )
        .await?;
    }
    if charge > 0 {
        insert_ledger(
            tx,
            &row.account_id,
            id,
            "charge",
            -charge,
            Some(reason),
            ended_at,
        )
        .await?;
    }
    let updated = sqlx::query(
        "UPDATE sandboxes SET status = $2, deleted_at = $3, deleted_reason = $4 \
         WHERE id = $1 RETURNING *",
    )
    .bind(id)
    .bind(end_status.as_str())
    .bind(format_ts(ended_at))
    .bind(reason)
    .fetch_one(&mut **tx)
    .await?;
    let updated = sandbox_from(&updated)?;
    insert_event(tx, id, end_status, Some(reason), ended_at).await?;
    sqlx::query("UPDATE ports SET closed_at = $2 WHERE sandbox_id = $1 AND closed_at IS NULL")
        .bind(id)
        .bind(format_ts(ended_at))
        .execute(&mut **tx)
        .await?;
    Ok(Some(updated))
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
        self.create_sandbox_named(new, async { Some(id) }).await
    }

    /// [`Store::create_sandbox`] for a sandbox whose id is still on its
    /// way (`new.id` is not used): a warm VM taken from a node over the
    /// network names it. The transaction begins meanwhile, and nothing is
    /// locked or read until `id` is known. `None` from `id` abandons the
    /// create: [`CreateOutcome::HostUnavailable`].
    pub async fn create_sandbox_named(
        &self,
        mut new: NewSandbox,
        id: impl std::future::Future<Output = Option<String>>,
    ) -> Result<CreateOutcome> {
        if new.reserve_micros < 0 {
            return Err(StoreError::Invalid(format!(
                "reserve_micros must not be negative, not {}",
                new.reserve_micros
            )));
        }
        if self.engine == crate::Engine::Postgres {
            let Some(id) = id.await else {
                return Ok(CreateOutcome::HostUnavailable);
            };
            new.id = id;
            // The common case in one round trip (see `create_function`).
            let sql = format!(
                "SELECT * FROM {}($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, \
                 $14, $15, $16, $17, $18, $19)",
                create_function().0
            );
            let query = bind_create(
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
        let Some(id) = id else {
            return Ok(CreateOutcome::HostUnavailable);
        };
        new.id = id;
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

    /// Moves a live sandbox to another live status (`provisioning`,
    /// `running`, `deleting`) and records the event; sets `ready_at` the
    /// first time it becomes `running`. Setting the status it already has
    /// changes nothing and records nothing.
    ///
    /// An ended sandbox is never revived: that is [`StoreError::Conflict`]
    /// (e.g. the VM came up after the sandbox expired). Ending is
    /// [`Store::finish_sandbox`]'s job, since it settles the money.
    pub async fn set_status(
        &self,
        id: &str,
        new_status: SandboxStatus,
        reason: Option<&str>,
    ) -> Result<SandboxRow> {
        if !new_status.is_live() || new_status == SandboxStatus::Paused {
            return Err(StoreError::Invalid(format!(
                "set_status takes a stored live status, not {new_status} (use finish_sandbox, \
                 pause_sandbox)"
            )));
        }
        if self.engine == crate::Engine::Postgres {
            return self.set_status_at_once(id, new_status, reason).await;
        }
        let mut tx = self.write_tx().await?;
        let row = sandbox_in(&mut tx, id)
            .await?
            .ok_or_else(|| StoreError::NotFound(format!("sandbox {id}")))?;
        if let Some(same) = unchanged(row, new_status)? {
            return Ok(same);
        }
        let at = now();
        let updated = sqlx::query(
            "UPDATE sandboxes SET status = $2, \
                 ready_at = CASE WHEN $2 = 'running' AND ready_at IS NULL THEN $3 ELSE ready_at END \
             WHERE id = $1 RETURNING *",
        )
        .bind(id)
        .bind(new_status.as_str())
        .bind(format_ts(at))
        .fetch_one(&mut *tx)
        .await?;
        let updated = sandbox_from(&updated)?;
        insert_event(&mut tx, id, new_status, reason, at).await?;
        tx.commit().await?;
        Ok(updated)
    }

    /// [`Store::set_status`] on PostgreSQL: the change and its event in one
    /// statement (one round trip, its own transaction), whose `UPDATE`
    /// takes the row lock and sees the row as the last writer left it.
    async fn set_status_at_once(
        &self,
        id: &str,
        new_status: SandboxStatus,
        reason: Option<&str>,
    ) -> Result<SandboxRow> {
        let updated = sqlx::query(concat!(
            "WITH u AS (UPDATE sandboxes SET status = $2, \
                   ready_at = CASE WHEN $2 = 'running' AND ready_at IS NULL THEN $3 \
                              ELSE ready_at END \
                 WHERE id = $1 AND status IN ",
            live_statuses!(),
            " \
                   AND status <> $2 \
                 RETURNING *), \
             e AS (INSERT INTO sandbox_events (sandbox_id, status, reason, at) \
                   SELECT id, $2, $4, $3 FROM u) \
             SELECT * FROM u"
        ))
        .bind(id)
        .bind(new_status.as_str())
        .bind(format_ts(now()))
        .bind(reason)
        .fetch_optional(&self.pool)
        .await?;
        if let Some(updated) = updated {
            return sandbox_from(&updated);
        }
        // Not changed: it has that status already, has ended, or is not there.
        let row = self
            .sandbox(id)
            .await?
            .ok_or_else(|| StoreError::NotFound(format!("sandbox {id}")))?;
        unchanged(row, new_status)?.ok_or_else(|| {
            StoreError::Conflict(format!("sandbox {id} changed while it became {new_status}"))
        })
    }

    /// Records that the VM of sandbox `id` runs on `host`: `provisioning`
    /// there becomes `running` (`ready_at` set, its event recorded). `None`,
    /// with nothing changed, when the sandbox is not `provisioning` on
    /// `host` (not there, placed elsewhere, ended, or running already). On
    /// PostgreSQL one statement, so a node's start costs one round trip.
    pub async fn record_start(&self, id: &str, host: &str) -> Result<Option<SandboxRow>> {
        let at = now();
        if self.engine == crate::Engine::Postgres {
            let updated = sqlx::query(
                "WITH u AS (UPDATE sandboxes SET status = 'running', ready_at = $3 \
                     WHERE id = $1 AND host = $2 AND status = 'provisioning' RETURNING *), \
                 e AS (INSERT INTO sandbox_events (sandbox_id, status, reason, at) \
                       SELECT id, 'running', NULL, $3 FROM u) \
                 SELECT * FROM u",
            )
            .bind(id)
            .bind(host)
            .bind(format_ts(at))
            .fetch_optional(&self.pool)
            .await?;
            return updated.as_ref().map(sandbox_from).transpose();
        }
        let mut tx = self.write_tx().await?;
        let updated = sqlx::query(
            "UPDATE sandboxes SET status = 'running', ready_at = $3 \
             WHERE id = $1 AND host = $2 AND status = 'provisioning' RETURNING *",
        )
        .bind(id)
        .bind(host)
        .bind(format_ts(at))
        .fetch_optional(&mut *tx)
        .await?;
        let Some(updated) = updated else {
            return Ok(None);
        };
        let updated = sandbox_from(&updated)?;
        insert_event(&mut tx, id, SandboxStatus::Running, None, at).await?;
        tx.commit().await?;
        Ok(Some(updated))
    }

    /// Extends a `provisioning` or `running` sandbox of `account_id`: stores
    /// the new expiry and timeout and reserves `extra_reserve_micros` more,
    /// if the balance covers it. Same transaction discipline as
    /// [`Store::create_sandbox`]. A sandbox of another account is
    /// [`StoreError::NotFound`]; an expiry earlier than the current one is
    /// [`StoreError::Invalid`].
    pub async fn extend_sandbox(
        &self,
        id: &str,
        account_id: &str,
        new_expires_at: OffsetDateTime,
        new_timeout_minutes: u32,
        extra_reserve_micros: i64,
    ) -> Result<ExtendOutcome> {
        if extra_reserve_micros < 0 {
            return Err(StoreError::Invalid(format!(
                "extra_reserve_micros must not be negative, not {extra_reserve_micros}"
            )));
        }
        let mut tx = self.write_tx().await?;
        lock_account(&mut tx, account_id).await?;
        let row = sandbox_in(&mut tx, id)
            .await?
            .filter(|r| r.account_id == account_id)
            .ok_or_else(|| StoreError::NotFound(format!("sandbox {id}")))?;
        if !matches!(
            row.status,
            SandboxStatus::Provisioning | SandboxStatus::Running | SandboxStatus::Paused
        ) {
            return Ok(ExtendOutcome::NotLive(row));
        }
        if new_expires_at < row.expires_at {
            return Err(StoreError::Invalid(format!(
                "new expiry {} is before the current {}",
                format_ts(new_expires_at),
                format_ts(row.expires_at)
            )));
        }
        let balance = balance_in(&mut *tx, account_id).await?;
        if balance < extra_reserve_micros {
            return Ok(ExtendOutcome::InsufficientCredits {
                balance,
                needed: extra_reserve_micros,
            });
        }
        let updated = sqlx::query(
            "UPDATE sandboxes SET expires_at = $2, timeout_minutes = $3 WHERE id = $1 RETURNING *",
        )
        .bind(id)
        .bind(format_ts(new_expires_at))
        .bind(i64::from(new_timeout_minutes))
        .fetch_one(&mut *tx)
        .await?;
        let updated = sandbox_from(&updated)?;
        if extra_reserve_micros > 0 {
            insert_ledger(
                &mut tx,
                account_id,
                id,
                "reserve",
                -extra_reserve_micros,
                Some("extend"),
                now(),
            )
            .await?;
        }
        tx.commit().await?;
        Ok(ExtendOutcome::Extended(updated))
    }

    /// A running sandbox whose VM was saved and stopped is `paused` from
    /// now. `None` if it is not running (or already paused).
    pub async fn pause_sandbox(&self, id: &str) -> Result<Option<SandboxRow>> {
        let mut tx = self.write_tx().await?;
        let at = now();
        let row = sqlx::query(
            "UPDATE sandboxes SET paused_at = $2 \
             WHERE id = $1 AND status = 'running' AND paused_at IS NULL RETURNING *",
        )
        .bind(id)
        .bind(format_ts(at))
        .fetch_optional(&mut *tx)
        .await?;
        let Some(row) = row.as_ref().map(sandbox_from).transpose()? else {
            return Ok(None);
        };
        insert_event(&mut tx, id, SandboxStatus::Paused, None, at).await?;
        tx.commit().await?;
        Ok(Some(row))
    }

    /// A paused sandbox runs again: the pause's seconds are added to its
    /// paused time. `None` if it was not paused.
    pub async fn resume_sandbox(&self, id: &str) -> Result<Option<SandboxRow>> {
        let mut tx = self.write_tx().await?;
        let Some(row) = sandbox_in(&mut tx, id).await? else {
            return Err(StoreError::NotFound(format!("sandbox {id}")));
        };
        if row.status != SandboxStatus::Paused {
            return Ok(None);
        }
        let at = now();
        let row = sqlx::query(
            "UPDATE sandboxes SET paused_at = NULL, paused_seconds = $2 WHERE id = $1 \
             RETURNING *",
        )
        .bind(id)
        .bind(i64::try_from(row.paused_seconds_until(at)).unwrap_or(i64::MAX))
        .fetch_one(&mut *tx)
        .await?;
        let row = sandbox_from(&row)?;
        insert_event(&mut tx, id, SandboxStatus::Running, Some("resumed"), at).await?;
        tx.commit().await?;
        Ok(Some(row))
    }

    /// Ends a live sandbox as `deleted` or `failed` and settles its money,
    /// atomically: releases what is still reserved for it (`release` row,
    /// +), charges `charge_micros` (`charge` row, −) but never more than was
    /// reserved — so the balance cannot go negative — sets `status`,
    /// `deleted_at` = `ended_at`, `deleted_reason` = `reason`, records the
    /// event and closes its open ports.
    ///
    /// `None` if the sandbox had already ended: nothing is changed, so
    /// calling this twice never charges twice. An unknown id is
    /// [`StoreError::NotFound`].
    pub async fn finish_sandbox(
        &self,
        id: &str,
        end_status: SandboxStatus,
        reason: &str,
        ended_at: OffsetDateTime,
        charge_micros: i64,
    ) -> Result<Option<SandboxRow>> {
        if !end_status.is_ended() {
            return Err(StoreError::Invalid(format!(
                "finish_sandbox ends as deleted or failed, not {end_status}"
            )));
        }
        let mut tx = self.write_tx().await?;
        let Some(row) = sandbox_in(&mut tx, id).await? else {
            return Err(StoreError::NotFound(format!("sandbox {id}")));
        };
        let updated = finish_in(&mut tx, &row, end_status, reason, ended_at, charge_micros).await?;
        tx.commit().await?;
        Ok(updated)
    }

    /// The sandbox with this id, of any account (compare `account_id`, or
    /// use [`Store::sandbox_of`]).
    pub async fn sandbox(&self, id: &str) -> Result<Option<SandboxRow>> {
        sqlx::query("SELECT * FROM sandboxes WHERE id = $1")
            .bind(id)
            .fetch_optional(&self.pool)
            .await?
            .as_ref()
            .map(sandbox_from)
            .transpose()
    }

    /// The sandbox an earlier create of `account_id` with Idempotency-Key
    /// `key` made, and that create's request hash.
    pub async fn created_with_key(
        &self,
        account_id: &str,
        key: &str,
    ) -> Result<Option<(String, SandboxRow)>> {
        let Some(seen) = sqlx::query(
            "SELECT request_hash, sandbox_id FROM idempotency WHERE account_id = $1 AND key = $2",
        )
        .bind(account_id)
        .bind(key)
        .fetch_optional(&self.pool)
        .await?
        else {
            return Ok(None);
        };
        let (hash, id) = (
            get_str(&seen, "request_hash")?,
            get_str(&seen, "sandbox_id")?,
        );
        let row = self
            .sandbox(&id)
            .await?
            .ok_or_else(|| StoreError::Corrupt(format!("idempotency row names missing {id}")))?;
        Ok(Some((hash, row)))
    }

    /// The sandbox with this id if it belongs to `account_id`.
    pub async fn sandbox_of(&self, account_id: &str, id: &str) -> Result<Option<SandboxRow>> {
        sqlx::query("SELECT * FROM sandboxes WHERE id = $1 AND account_id = $2")
            .bind(id)
            .bind(account_id)
            .fetch_optional(&self.pool)
            .await?
            .as_ref()
            .map(sandbox_from)
            .transpose()
    }

    /// A page of an account's sandboxes, newest first (equal `created_at`
    /// ordered by id, descending). `starting_after` is the id of the last
    /// sandbox of the previous page; it must be a sandbox of this account
    /// ([`StoreError::NotFound`] otherwise), in any status. Without
    /// `include_deleted` only live sandboxes are listed.
    pub async fn list_sandboxes(
        &self,
        account_id: &str,
        limit: u32,
        starting_after: Option<&str>,
        include_deleted: bool,
    ) -> Result<SandboxPage> {
        if limit == 0 {
            return Err(StoreError::Invalid("limit must be at least 1".into()));
        }
        let cursor = match starting_after {
            None => None,
            Some(c) => {
                let at: Option<String> = sqlx::query_scalar(
                    "SELECT created_at FROM sandboxes WHERE id = $1 AND account_id = $2",
                )
                .bind(c)
                .bind(account_id)
                .fetch_optional(&self.pool)
                .await?;
                Some((
                    at.ok_or_else(|| StoreError::NotFound(format!("sandbox {c}")))?,
                    c,
                ))
            }
        };
        let (c_at, c_id) = match &cursor {
            Some((at, id)) => (Some(at.as_str()), Some(*id)),
            None => (None, None),
        };
        let rows = sqlx::query(concat!(
            "SELECT * FROM sandboxes WHERE account_id = $1 \
               AND ($2 = 1 OR status IN ",
            live_statuses!(),
            ") \
               AND ($3 IS NULL OR created_at < $3 OR (created_at = $3 AND id < $4)) \
             ORDER BY created_at DESC, id DESC LIMIT $5"
        ))
        .bind(account_id)
        .bind(i64::from(include_deleted))
        .bind(c_at)
        .bind(c_id)
        .bind(i64::from(limit) + 1)
        .fetch_all(&self.pool)
        .await?;
        let mut data = rows.iter().map(sandbox_from).collect::<Result<Vec<_>>>()?;
        let has_more = data.len() > limit as usize;
        data.truncate(limit as usize);
        Ok(SandboxPage { data, has_more })
    }

    /// Every live sandbox of every account on `host`, oldest first: what
    /// that host should be running (for reconciliation after a restart).
    /// Sandboxes of other hosts sharing the database are theirs.
    pub async fn live_sandboxes(&self, host: &str) -> Result<Vec<SandboxRow>> {
        sqlx::query(concat!(
            "SELECT * FROM sandboxes WHERE status IN ",
            live_statuses!(),
            " \
               AND host = $1 ORDER BY created_at, id"
        ))
        .bind(host)
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(sandbox_from)
        .collect()
    }

    /// Live sandboxes on `host` whose `expires_at` ≤ `now`, soonest first.
    pub async fn expired_sandboxes(
        &self,
        host: &str,
        now: OffsetDateTime,
    ) -> Result<Vec<SandboxRow>> {
        sqlx::query(concat!(
            "SELECT * FROM sandboxes WHERE status IN ",
            live_statuses!(),
            " \
               AND expires_at <= $1 AND host = $2 ORDER BY expires_at, id"
        ))
        .bind(format_ts(now))
        .bind(host)
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(sandbox_from)
        .collect()
    }

    /// The earliest `expires_at` of any live sandbox: when the expiry
    /// sweeper next has work.
    pub async fn next_expiry(&self, host: &str) -> Result<Option<OffsetDateTime>> {
        let at: Option<String> = sqlx::query_scalar(concat!(
            "SELECT MIN(expires_at) FROM sandboxes \
             WHERE status IN ",
            live_statuses!(),
            " AND host = $1"
        ))
        .bind(host)
        .fetch_one(&self.pool)
        .await?;
        at.as_deref().map(parse_ts).transpose()
    }

    /// A sandbox's status history, oldest first.
    pub async fn events(&self, sandbox_id: &str) -> Result<Vec<EventRow>> {
        sqlx::query("SELECT * FROM sandbox_events WHERE sandbox_id = $1 ORDER BY id")
            .bind(sandbox_id)
            .fetch_all(&self.pool)
            .await?
            .iter()
            .map(event_from)
            .collect()
    }

    /// The account's sandboxes created at or after `since`, or alive at or
    /// after it (live, or ended at/after it), newest first, each with what
    /// has been charged for it.
    pub async fn usage(&self, account_id: &str, since: OffsetDateTime) -> Result<Vec<UsageRow>> {
        let rows = sqlx::query(
            "SELECT s.*, CAST(COALESCE((SELECT -SUM(l.amount_micros) FROM ledger l \
                                   WHERE l.sandbox_id = s.id AND l.kind = 'charge'), 0) AS BIGINT) \
                         AS charged_micros \
             FROM sandboxes s WHERE s.account_id = $1 \
               AND (s.created_at >= $2 OR s.deleted_at IS NULL OR s.deleted_at >= $2) \
             ORDER BY s.created_at DESC, s.id DESC",
        )
        .bind(account_id)
        .bind(format_ts(since))
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| {
                Ok(UsageRow {
                    sandbox: sandbox_from(r)?,
                    charged_micros: get_i64(r, "charged_micros")?,
                    preview_bytes_in: get_i64(r, "preview_bytes_in")?,
                    preview_bytes_out: get_i64(r, "preview_bytes_out")?,
                })
            })
            .collect()
    }

    /// Record what each sandbox's disk takes now (`(sandbox id, bytes)`),
    /// in one transaction. Sandboxes that ended keep their last figure.
    pub async fn set_disk_use(&self, uses: &[(String, u64)]) -> Result<()> {
        if uses.is_empty() {
            return Ok(());
        }
        let mut tx = self.write_tx().await?;
        for (id, bytes) in uses {
            sqlx::query(concat!(
                "UPDATE sandboxes SET disk_used_bytes = $2 \
                 WHERE id = $1 AND status IN ",
                live_statuses!()
            ))
            .bind(id)
            .bind(i64::try_from(*bytes).unwrap_or(i64::MAX))
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// What the account's live sandboxes' disks take together, as last
    /// measured.
    pub async fn account_disk_use(&self, account_id: &str) -> Result<u64> {
        let total: i64 = sqlx::query_scalar(concat!(
            "SELECT CAST(COALESCE(SUM(disk_used_bytes), 0) AS BIGINT) FROM sandboxes \
             WHERE account_id = $1 AND status IN ",
            live_statuses!()
        ))
        .bind(account_id)
        .fetch_one(&self.pool)
        .await?;
        Ok(total.max(0) as u64)
    }

    /// Adds preview traffic to a sandbox's counters.
    pub async fn add_preview_traffic(
        &self,
        sandbox_id: &str,
        bytes_in: u64,
        bytes_out: u64,
    ) -> Result<()> {
        sqlx::query(
            "UPDATE sandboxes SET preview_bytes_in = preview_bytes_in + $2, \
                                  preview_bytes_out = preview_bytes_out + $3 \
             WHERE id = $1",
        )
        .bind(sandbox_id)
        .bind(bytes_in as i64)
        .bind(bytes_out as i64)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Forgets idempotency keys recorded before `before` (keys are meant
    /// for retries within hours, not forever). Returns how many went.
    pub async fn purge_idempotency(&self, before: OffsetDateTime) -> Result<u64> {
        Ok(sqlx::query("DELETE FROM idempotency WHERE created_at < $1")
            .bind(format_ts(before))
            .execute(&self.pool)
            .await?
            .rows_affected())
    }
}
