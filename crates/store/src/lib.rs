//! Sandpit's persistence: accounts, API keys, the credit ledger, sandboxes
//! and their status history, executions, exposed ports, idempotency keys.
//!
//! # Why it looks like this
//!
//! * **One SQLite file by default.** A single-host Sandpit needs no database
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
//! * Statuses are the API's lower-case strings (see [`status`] and
//!   [`exec_status`]); the store checks them but does not depend on
//!   `sandpit-core`, so that core can depend on the store.
//! * Ids are `prefix_` + 24 random base32 characters (120 bits, see
//!   [`new_id`]): `acct_` and `key_` are made here, `sbx_` and `exec_` by the
//!   caller (it needs the id before the row exists, e.g. for the VM).
//!
//! # PostgreSQL later
//!
//! The SQL is written to carry over: numbered `$1` placeholders, no SQLite
//! date functions, `RETURNING`, `ON CONFLICT ... DO UPDATE ... WHERE`,
//! `COALESCE(SUM(..), 0)`, BIGINT money, TEXT timestamps that sort. What a
//! Postgres backend will need:
//!
//! * its own migrations directory, identical but for the autoincrement
//!   columns (`BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY` instead of
//!   `INTEGER PRIMARY KEY AUTOINCREMENT`);
//! * instead of `BEGIN IMMEDIATE` (which Postgres does not have): a plain
//!   `BEGIN` followed by `SELECT id FROM accounts WHERE id = $1 FOR UPDATE`
//!   in every transaction that checks an account's balance or sandbox count
//!   (create, extend) and `SELECT ... FROM sandboxes WHERE id = $1 FOR
//!   UPDATE` in the ones that change a sandbox (finish, set_status). That
//!   serialises per account rather than globally, which is better;
//! * a pool type other than `SqlitePool`: either `sqlx::Any` or a second
//!   `Store` variant. Rows are decoded by column name with `i64`/`String`
//!   only, which both drivers support;
//! * `truncated` is an integer 0/1 here; Postgres can keep it `BIGINT` or
//!   move to `BOOLEAN` with a cast in the two queries that touch it.

mod accounts;
mod error;
mod executions;
mod sandboxes;
mod util;

pub use accounts::{AccountRow, KeyRow, LedgerRow};
pub use error::{Result, StoreError};
pub use executions::{ExecutionResult, ExecutionRow, PortRow};
pub use sandboxes::{
    CreateOutcome, EventRow, ExtendOutcome, NewSandbox, SandboxPage, SandboxRow, UsageRow,
};
pub use util::{format_ts, hash_key, new_id, parse_ts};

use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};
use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

/// The sandbox statuses, as stored and as the API spells them.
pub mod status {
    pub const PROVISIONING: &str = "provisioning";
    pub const RUNNING: &str = "running";
    pub const DELETING: &str = "deleting";
    pub const DELETED: &str = "deleted";
    pub const FAILED: &str = "failed";
    /// Statuses of a sandbox that holds (or is about to hold, or is still
    /// releasing) a VM and a reservation.
    pub const LIVE: [&str; 3] = [PROVISIONING, RUNNING, DELETING];
    /// Statuses a sandbox ends in; only [`crate::Store::finish_sandbox`]
    /// sets them.
    pub const ENDED: [&str; 2] = [DELETED, FAILED];

    /// Whether `s` is a live status.
    pub fn is_live(s: &str) -> bool {
        LIVE.contains(&s)
    }
}

/// The execution statuses, as stored and as the API spells them
/// (`running` is the store's own: the command has not ended yet).
pub mod exec_status {
    pub const RUNNING: &str = "running";
    pub const COMPLETED: &str = "completed";
    pub const TIMED_OUT: &str = "timed_out";
    pub const CANCELLED: &str = "cancelled";
    pub const FAILED: &str = "failed";
    pub const ALL: [&str; 5] = [RUNNING, COMPLETED, TIMED_OUT, CANCELLED, FAILED];
}

/// How long a writer waits for SQLite's lock before giving up.
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// The embedded schema migrations (`crates/store/migrations`).
static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// Handle to the database. Cheap to clone (it wraps a connection pool);
/// share one per process.
#[derive(Clone, Debug)]
pub struct Store {
    pool: SqlitePool,
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
    fn start(pool: SqlitePool) -> Checkpointer {
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
        let opts = SqliteConnectOptions::new().filename(path);
        let store = Store::from_sqlite_options(opts, false).await?;
        restrict_to_owner(path);
        Ok(store)
    }

    /// Opens a database by URL and brings its schema up to date. Only
    /// `sqlite:` URLs are supported so far (`sqlite://path/to/file.db`,
    /// `sqlite::memory:`); an in-memory database gets a single connection,
    /// since each connection would otherwise see a database of its own.
    pub async fn connect(url: &str) -> Result<Store> {
        if !url.starts_with("sqlite:") {
            return Err(StoreError::Invalid(format!(
                "unsupported database URL {url:?}: only sqlite: is built in"
            )));
        }
        let opts = SqliteConnectOptions::from_str(url)?;
        let memory = url.contains(":memory:") || url.contains("mode=memory");
        Store::from_sqlite_options(opts, memory).await
    }

    async fn from_sqlite_options(opts: SqliteConnectOptions, memory: bool) -> Result<Store> {
        let opts = opts
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            // With WAL, NORMAL loses at most the last transactions on power
            // loss, never consistency; FULL would fsync every commit.
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(BUSY_TIMEOUT)
            .foreign_keys(true)
            // A file database is checkpointed by `Checkpointer`, not by commits.
            .pragma("wal_autocheckpoint", if memory { "1000" } else { "0" });
        let pool = SqlitePoolOptions::new()
            .max_connections(if memory { 1 } else { 8 })
            .connect_with(opts)
            .await?;
        MIGRATOR.run(&pool).await?;
        let checkpointer = (!memory).then(|| Arc::new(Checkpointer::start(pool.clone())));
        Ok(Store {
            pool,
            _checkpointer: checkpointer,
        })
    }

    /// The underlying pool, for tests and one-off queries.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// Waits for open connections to finish and closes the pool.
    pub async fn close(&self) {
        self.pool.close().await;
    }

    /// Starts a write transaction that holds the database's write lock from
    /// its first statement (see the crate docs for why).
    async fn write_tx(&self) -> Result<sqlx::Transaction<'static, sqlx::Sqlite>> {
        Ok(self.pool.begin_with("BEGIN IMMEDIATE").await?)
    }
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
