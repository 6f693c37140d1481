//! Sandpit's persistence: accounts, API keys, the credit ledger, sandboxes
//! and their status history, executions, exposed ports, idempotency keys,
//! secrets (sealed by the service), volumes and their mounts.
//!
//! # Why it looks like this
//!
//! * **One SQLite file by default**, PostgreSQL to share (see "Two engines"
//!   below). A single-host Sandpit needs no database
//!   server; WAL mode lets readers run beside the one writer, a ~5 s busy
//!   timeout turns lock contention into waiting instead of errors, and
//!   foreign keys are on so a row can never point at nothing. Commits
//!   never checkpoint the WAL: a background task does it every second, so
//!   no request pays for the checkpoint's fsync.
//! * **Money is a ledger, never a balance column.** Every movement is an
//!   append-only `ledger` row (`credit` +, `reserve` −, `release` +,
//!   `charge` −, in integer micro-dollars); an account's balance is
//!   `SUM(amount_micros)` and is stored nowhere else, so it cannot drift
//!   from its history and every cent can be explained.
//! * **Reserve, then settle.** Creating a sandbox reserves the cost of its
//!   whole timeout; ending it releases the reservation and charges what it
//!   actually cost, capped at what was reserved. Together with the balance
//!   check at reservation this is what keeps a balance from ever going
//!   below zero.
//! * **Decisions that read and then write happen in one write
//!   transaction.** [`Store::create_sandbox`] checks the idempotency key,
//!   the balance and the concurrency limit and then inserts the sandbox,
//!   its first event, its reservation and the idempotency row — all inside
//!   one `BEGIN IMMEDIATE` transaction, which takes SQLite's write lock
//!   up front. Concurrent creates therefore run one after another and can
//!   never both see the same balance (a plain `BEGIN` would let two of them
//!   read, then race to write). [`Store::extend_sandbox`],
//!   [`Store::finish_sandbox`] and [`Store::set_status`] do the same. Taking
//!   the lock first also avoids SQLite's "deferred transaction cannot
//!   upgrade to a write lock" failure, which the busy timeout cannot wait
//!   out.
//! * **Ending is idempotent.** [`Store::finish_sandbox`] acts only on a live
//!   sandbox (`provisioning`, `running`, `deleting`) and flips it to
//!   `deleted`/`failed` in the same transaction as the release and the
//!   charge: a second call (a retried DELETE, the expiry sweeper racing a
//!   user's delete) finds it ended and changes nothing, so nothing is ever
//!   charged twice.
//! * **Every status change is a row** in `sandbox_events`, so "why did my
//!   sandbox die" has an answer after the fact.
//! * **API keys are stored as SHA-256 only**, with a short visible prefix
//!   for people to tell keys apart. A leaked database does not leak keys;
//!   the keys carry 200 random bits, so a fast unsalted hash suffices.
//!
//! # Conventions
//!
//! * Timestamps are [`time::OffsetDateTime`] in the API and TEXT in the
//!   database, formatted by [`format_ts`] as fixed-width RFC 3339 UTC with
//!   microseconds (`2026-01-02T03:04:05.678901Z`), so string order is time
//!   order and SQL needs no date functions. Values are truncated to
//!   microseconds when stored.
//! * Money is `i64` micro-dollars (`sandpit_core::model::Micros`).
//! * Statuses are typed ([`SandboxStatus`], [`ExecutionState`]) and stored
//!   as the API's lower-case words. The enums live here, below the core
//!   that re-exports them, so a row is decoded once and nothing above
//!   compares strings.
//! * Ids are `prefix_` + 24 random base32 characters (120 bits, see
//!   [`new_id`]): `acct_` and `key_` are made here, `sbx_` and `exec_` by the
//!   caller (it needs the id before the row exists, e.g. for the VM).
//!
//! # Two engines
//!
//! The same SQL runs on SQLite (the embedded default: one file in the data
//! directory) and on PostgreSQL (`postgres://…`: one database that the
//! processes of a cluster share), through sqlx's `Any` driver. Rows are
//! decoded by column name as `i64` and `String` only, which both support.
//! What differs, and where:
//!
//! * **Migrations**: `migrations/sqlite` and `migrations/postgres`, the same
//!   versions with the same meaning. PostgreSQL's spell autoincrement as
//!   identity columns, compare TEXT with the "C" collation (byte order is
//!   time order for the timestamps, whatever the database's locale), and
//!   keep a command and its outputs in BYTEA, since PostgreSQL's TEXT
//!   cannot hold the NUL a command may print.
//! * **Serialising decisions**: SQLite's `BEGIN IMMEDIATE` takes the one
//!   write lock; PostgreSQL's plain `BEGIN` (READ COMMITTED) is followed by
//!   row locks — the account's (`FOR NO KEY UPDATE`) in every transaction
//!   that checks its balance, sandbox count or budgets (create, extend,
//!   trim), the sandbox's in every one that changes its status (set_status,
//!   finish), the execution's when it finishes. So settlement happens once
//!   however many processes race to end the same sandbox, and transactions
//!   of different accounts run side by side.
//! * **Sums**: `SUM` of a BIGINT is NUMERIC in PostgreSQL, so every sum is
//!   cast back to BIGINT.
//! * **Hosts**: a shared database holds the sandboxes of many machines,
//!   each row naming its `host`; what a machine reconciles, expires and
//!   fails after a restart is its own host's only.

mod accounts;
mod error;
mod events;
mod executions;
mod key_spelling;
mod moves;
mod nodes;
mod sandboxes;
mod secrets;
mod snapshots;
mod states;
mod tally;
mod templates;
mod tokens;
mod util;
mod volumes;
mod web;

pub use accounts::{AccountRow, KeyRow, LedgerRow};
pub use error::{Result, StoreError};
pub use events::{
    AttemptOutcome, AttemptRow, Cause, DeliveryRow, DeliveryStatus, DueDelivery, EventRow,
    WebhookRow,
};
pub use executions::{ExecutionPage, ExecutionResult, ExecutionRow, PortRow};
pub use key_spelling::{canonical_key, e2b_spelling};
pub use nodes::{ms_to_time, Candidate, LostNode, NewNode, NodeRow};
pub use sandboxes::{CreateOutcome, ExtendOutcome, NewSandbox, SandboxPage, SandboxRow, UsageRow};
pub use secrets::{NewSecret, SandboxBroker, SecretRow, SecretValue};
pub use snapshots::{NewSnapshot, SnapshotOutcome, SnapshotPage, SnapshotRow, SnapshotStatus};
pub use states::{ExecutionState, ExecutionStatus, NodeState, SandboxStatus};
pub use tally::SandboxTally;
pub use templates::{LayerRow, TemplateRow, TemplateStatus, MAX_LOG_BYTES};
pub use tokens::TerminalGrant;
pub use util::{format_ts, hash_key, new_id, parse_ts};
pub use volumes::{
    NewVolume, UnbilledVolume, VolumeChange, VolumeCreated, VolumeLeased, VolumeMountRow,
    VolumeRow, VolumeStatus, VolumesHeld,
};
pub use web::WebSession;

use sqlx::any::AnyPoolOptions;
use sqlx::AnyConnection;
use sqlx::AnyPool;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// How long a writer waits for SQLite's lock before giving up.
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// Connections one process keeps to PostgreSQL. Each replica and node has
/// its own pool, so a cluster of N processes needs N times this in the
/// server's `max_connections` (default 100).
const POSTGRES_CONNECTIONS: u32 = 10;

/// How long a query waits for a free PostgreSQL connection (or for a new
/// one to connect) before failing as unavailable.
pub(crate) const POSTGRES_ACQUIRE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a PostgreSQL statement waits for a row lock before it fails
/// (as unavailable: the API says retry). Locks here are held for a few
/// milliseconds; one held longer belongs to a process that stopped in its
/// transaction, and a call must not wait on it without end.
pub(crate) const POSTGRES_LOCK_TIMEOUT: Duration = Duration::from_secs(5);

/// How long one PostgreSQL statement may run before the server cancels
/// it: every statement here takes milliseconds, so one that runs on is
/// stuck (a server starved of I/O, a plan gone wrong), and must not hold
/// a request and its connection for ever. Migrations run on a connection
/// of their own, without it.
pub(crate) const POSTGRES_STATEMENT_TIMEOUT: Duration = Duration::from_secs(30);

/// How long PostgreSQL lets one of our sessions sit idle in a transaction
/// before it ends the session and so frees its locks: a process frozen
/// (stopped, swapped, cut off) in the middle of one holds them otherwise
/// until the server notices its connection is gone.
const POSTGRES_IDLE_IN_TRANSACTION: Duration = Duration::from_secs(60);

/// The embedded schema migrations of each engine
/// (`crates/store/migrations/{sqlite,postgres}`): the same versions with the
/// same meaning, each in its engine's dialect.
static SQLITE_MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations/sqlite");
static POSTGRES_MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations/postgres");

/// Which database engine a [`Store`] runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Engine {
    /// One file, one process: the embedded default.
    Sqlite,
    /// A server shared by every process of a cluster.
    Postgres,
}

impl Engine {
    /// The engine a database URL names: `sqlite:…` or `postgres://…` /
    /// `postgresql://…`.
    pub fn of_url(url: &str) -> Result<Engine> {
        if url.starts_with("sqlite:") {
            Ok(Engine::Sqlite)
        } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Ok(Engine::Postgres)
        } else {
            Err(StoreError::Invalid(format!(
                "unsupported database URL {:?}: use sqlite:PATH or postgres://USER@HOST/DB",
                redact_url(url)
            )))
        }
    }
}

/// A database URL with its password replaced by `***`, for messages and logs.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let (authority, tail) = match rest.find(['/', '?']) {
        Some(i) => rest.split_at(i),
        None => (rest, ""),
    };
    match authority.rsplit_once('@') {
        Some((userinfo, host)) => match userinfo.split_once(':') {
            Some((user, _password)) => format!("{scheme}://{user}:***@{host}{tail}"),
            None => url.to_string(),
        },
        None => url.to_string(),
    }
}

/// Whether a connection (or a transaction's) talks to PostgreSQL.
pub(crate) fn is_postgres(conn: &AnyConnection) -> bool {
    conn.backend_name() == "PostgreSQL"
}

/// What a `SELECT` that reads a row it is about to change ends with: on
/// PostgreSQL a row lock (`FOR NO KEY UPDATE`, which still lets other
/// transactions insert rows that refer to it); an account's lock is taken
/// before its sandbox's, so two transactions never wait for each other.
/// Nothing on SQLite, whose `BEGIN IMMEDIATE` already holds the database's
/// one write lock.
pub(crate) fn row_lock(conn: &AnyConnection) -> &'static str {
    if is_postgres(conn) {
        " FOR NO KEY UPDATE"
    } else {
        ""
    }
}

/// Takes the account's row lock (see [`row_lock`]) in a write transaction:
/// what every decision about an account's money, sandbox count or budgets
/// starts with, so two such decisions on PostgreSQL never both pass on the
/// same reading.
pub(crate) async fn lock_account(conn: &mut AnyConnection, account_id: &str) -> Result<()> {
    if is_postgres(conn) {
        sqlx::query("SELECT id FROM accounts WHERE id = $1 FOR NO KEY UPDATE")
            .bind(account_id)
            .fetch_optional(conn)
            .await?;
    }
    Ok(())
}

/// Handle to the database. Cheap to clone (it wraps a connection pool);
/// share one per process.
#[derive(Clone, Debug)]
pub struct Store {
    pool: AnyPool,
    engine: Engine,
    /// The WAL checkpointer of a database file (none in memory); stops when
    /// the last clone of the store goes.
    _checkpointer: Option<Arc<Checkpointer>>,
}

/// How often the WAL is copied back into the database file.
const CHECKPOINT_EVERY: Duration = Duration::from_secs(1);

/// Checkpoints the WAL in the background. SQLite would otherwise do it inside
/// whichever commit crosses 1000 WAL pages, with an fsync: a request that
/// happened to make that commit took a few ms more (the warm create's p99).
#[derive(Debug)]
struct Checkpointer(tokio::task::JoinHandle<()>);

impl Drop for Checkpointer {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Checkpointer {
    fn start(pool: AnyPool) -> Checkpointer {
        Checkpointer(tokio::spawn(async move {
            let mut tick = tokio::time::interval(CHECKPOINT_EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                if pool.is_closed() {
                    return;
                }
                // PASSIVE: copies what it can without waiting for, or
                // blocking, readers and writers.
                if let Err(e) = sqlx::query("PRAGMA wal_checkpoint(PASSIVE)")
                    .execute(&pool)
                    .await
                {
                    tracing::warn!("WAL checkpoint failed: {e}");
                }
            }
        }))
    }
}

impl Store {
    /// Opens (creating if needed) the SQLite database file at `path` and
    /// brings its schema up to date.
    ///
    /// The database holds every tenant's commands and outputs and the keys'
    /// hashes: its file and SQLite's `-wal` and `-shm` beside it are the
    /// owner's alone (0600), whatever the umask (SQLite gives the two the
    /// database file's mode, so the file is made 0600 before SQLite opens
    /// it), and files an older version left readable are tightened.
    pub async fn open_sqlite(path: impl AsRef<Path>) -> Result<Store> {
        let path = path.as_ref();
        {
            use std::os::unix::fs::OpenOptionsExt;
            let _ = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .mode(0o600)
                .open(path);
        }
        restrict_to_owner(path);
        let url = format!("sqlite://{}?mode=rwc", sqlite_url_path(path)?);
        let store = Store::open_sqlite_url(&url, false).await?;
        restrict_to_owner(path);
        Ok(store)
    }

    /// Opens a database by URL and brings its schema up to date:
    /// `sqlite://path/to/file.db`, `sqlite::memory:` (one connection, since
    /// each would otherwise see a database of its own), or
    /// `postgres://user:password@host:port/database` (a database many
    /// processes share; migrations take PostgreSQL's advisory lock, so
    /// processes that start together migrate once).
    pub async fn connect(url: &str) -> Result<Store> {
        match Engine::of_url(url)? {
            Engine::Sqlite => {
                let memory = url.contains(":memory:") || url.contains("mode=memory");
                let url = if memory || url.contains("mode=") {
                    url.to_string()
                } else if url.contains('?') {
                    format!("{url}&mode=rwc")
                } else {
                    format!("{url}?mode=rwc")
                };
                Store::open_sqlite_url(&url, memory).await
            }
            Engine::Postgres => Store::open_postgres(url).await,
        }
    }

    async fn open_sqlite_url(url: &str, memory: bool) -> Result<Store> {
        sqlx::any::install_default_drivers();
        let pool = AnyPoolOptions::new()
            .max_connections(if memory { 1 } else { 8 })
            .after_connect(move |conn, _meta| {
                Box::pin(async move {
                    // WAL lets readers run beside the writer. With WAL,
                    // NORMAL loses at most the last transactions on power
                    // loss, never consistency; FULL would fsync every
                    // commit. A file database is checkpointed by
                    // `Checkpointer`, not by commits.
                    let pragmas = format!(
                        "PRAGMA journal_mode = WAL; PRAGMA synchronous = NORMAL; \
                         PRAGMA busy_timeout = {}; PRAGMA foreign_keys = ON; \
                         PRAGMA wal_autocheckpoint = {};",
                        BUSY_TIMEOUT.as_millis(),
                        if memory { 1000 } else { 0 }
                    );
                    sqlx::raw_sql(sqlx::AssertSqlSafe(pragmas))
                        .execute(&mut *conn)
                        .await?;
                    Ok(())
                })
            })
            .connect(url)
            .await?;
        SQLITE_MIGRATOR.run(&pool).await?;
        let checkpointer = (!memory).then(|| Arc::new(Checkpointer::start(pool.clone())));
        Ok(Store {
            pool,
            engine: Engine::Sqlite,
            _checkpointer: checkpointer,
        })
    }

    async fn open_postgres(url: &str) -> Result<Store> {
        sqlx::any::install_default_drivers();
        let pool = AnyPoolOptions::new()
            .max_connections(POSTGRES_CONNECTIONS)
            .acquire_timeout(POSTGRES_ACQUIRE_TIMEOUT)
            // No ping before each use: it would double the round trips of
            // every query. A connection the server dropped fails its next
            // query (an `Unavailable`, which the API answers as "retry")
            // and is closed.
            .test_before_acquire(false)
            .after_connect(|conn, _meta| {
                Box::pin(async move {
                    let settings = format!(
                        "SET lock_timeout = {}; SET idle_in_transaction_session_timeout = {}; \
                         SET statement_timeout = {};",
                        POSTGRES_LOCK_TIMEOUT.as_millis(),
                        POSTGRES_IDLE_IN_TRANSACTION.as_millis(),
                        POSTGRES_STATEMENT_TIMEOUT.as_millis()
                    );
                    sqlx::raw_sql(sqlx::AssertSqlSafe(settings))
                        .execute(&mut *conn)
                        .await?;
                    Ok(())
                })
            })
            .connect(url)
            .await
            .map_err(|e| {
                StoreError::Unavailable(format!(
                    "cannot reach the database {}: {e}",
                    redact_url(url)
                ))
            })?;
        // A migration may take long on a big table: its own connection,
        // without the pool's statement timeout.
        let mut unbounded = <AnyConnection as sqlx::Connection>::connect(url)
            .await
            .map_err(|e| {
                StoreError::Unavailable(format!(
                    "cannot reach the database {}: {e}",
                    redact_url(url)
                ))
            })?;
        POSTGRES_MIGRATOR.run(&mut unbounded).await?;
        sandboxes::install_create_function(&mut unbounded).await?;
        let _ = sqlx::Connection::close(unbounded).await;
        Ok(Store {
            pool,
            engine: Engine::Postgres,
            _checkpointer: None,
        })
    }

    /// Which engine this store runs on.
    pub fn engine(&self) -> Engine {
        self.engine
    }

    /// The underlying pool, for tests and one-off queries.
    pub fn pool(&self) -> &AnyPool {
        &self.pool
    }

    /// Waits for open connections to finish and closes the pool.
    pub async fn close(&self) {
        self.pool.close().await;
    }

    /// Starts a write transaction that holds the database's write lock from
    /// its first statement (see the crate docs for why).
    ///
    /// On PostgreSQL a plain `BEGIN` (READ COMMITTED): what must not
    /// interleave takes row locks instead ([`lock_account`], [`row_lock`]),
    /// so transactions of different accounts run side by side.
    async fn write_tx(&self) -> Result<sqlx::Transaction<'static, sqlx::Any>> {
        Ok(match self.engine {
            Engine::Sqlite => self.pool.begin_with("BEGIN IMMEDIATE").await?,
            Engine::Postgres => self.pool.begin().await?,
        })
    }
}

/// The path of a SQLite file as a URL path (percent-encoded where a URL
/// needs it), absolute or relative as given.
fn sqlite_url_path(path: &Path) -> Result<String> {
    let s = path
        .to_str()
        .ok_or_else(|| StoreError::Invalid(format!("database path {path:?} is not UTF-8")))?;
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'/' | b'-' | b'_' | b'.' | b'~' => {
                out.push(b as char)
            }
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    Ok(out)
}

/// Mode 0600 for a SQLite database and its `-wal` and `-shm` files, where
/// they exist.
fn restrict_to_owner(db: &Path) {
    use std::os::unix::fs::PermissionsExt;
    for suffix in ["", "-wal", "-shm"] {
        let mut name = db.as_os_str().to_owned();
        name.push(suffix);
        let file = Path::new(&name);
        if let Ok(meta) = std::fs::metadata(file) {
            if meta.permissions().mode() & 0o077 != 0 {
                let _ = std::fs::set_permissions(file, std::fs::Permissions::from_mode(0o600));
            }
        }
    }
}
