//! One error type for every store call, so callers map it to API errors in
//! one place (`NotFound` → 404, `Conflict` → 409, `Invalid` → 400, the rest
//! → 500/503).

/// What a store call can fail with. Business outcomes that an API reports
/// as ordinary answers (not enough credit, too many sandboxes, an
/// idempotency clash) are *not* errors: they are variants of
/// [`crate::CreateOutcome`] and [`crate::ExtendOutcome`].
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The named thing does not exist (or, for account-scoped look-ups,
    /// belongs to another account: the two are deliberately the same).
    #[error("{0} not found")]
    NotFound(String),
    /// A uniqueness rule or a state rule forbids this (a taken account name,
    /// a status change of a sandbox that has already ended, an ambiguous
    /// key prefix).
    #[error("conflict: {0}")]
    Conflict(String),
    /// The caller passed a value the store does not accept (an unknown
    /// status, a negative amount, an unsupported database URL).
    #[error("invalid: {0}")]
    Invalid(String),
    /// A stored value could not be read back (a malformed timestamp, a
    /// number out of range): the database was written by something else.
    #[error("corrupt row: {0}")]
    Corrupt(String),
    /// The database cannot be reached (a PostgreSQL server down or
    /// refusing); the message names it, without its password.
    #[error("database unavailable: {0}")]
    Unavailable(String),
    /// The database failed (I/O, constraint).
    #[error("database: {0}")]
    Db(sqlx::Error),
    /// Applying the embedded migrations failed.
    #[error("migration: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
}

impl StoreError {
    /// Whether the database said a UNIQUE constraint was violated.
    pub(crate) fn is_unique_violation(&self) -> bool {
        match self {
            StoreError::Db(e) => e
                .as_database_error()
                .is_some_and(|d| d.is_unique_violation()),
            _ => false,
        }
    }
}

/// PostgreSQL's code for a statement cancelled at `statement_timeout`.
const QUERY_CANCELED: &str = "57014";
/// PostgreSQL's code for a lock not granted within `lock_timeout`.
const LOCK_NOT_AVAILABLE: &str = "55P03";

/// A bound that ran out is the database being unavailable for now (the
/// API says retry), and says which bound it was: a caller then knows a
/// stuck statement from a held lock from a pool with no free connection.
impl From<sqlx::Error> for StoreError {
    fn from(e: sqlx::Error) -> Self {
        let code = e
            .as_database_error()
            .and_then(|d| d.code().map(|c| c.into_owned()));
        match (code.as_deref(), &e) {
            (Some(QUERY_CANCELED), _) => StoreError::Unavailable(format!(
                "a database statement ran past its limit of {} s (statement_timeout) and was \
                 cancelled",
                crate::POSTGRES_STATEMENT_TIMEOUT.as_secs()
            )),
            (Some(LOCK_NOT_AVAILABLE), _) => StoreError::Unavailable(format!(
                "a database statement waited over {} s for a row another session holds \
                 (lock_timeout)",
                crate::POSTGRES_LOCK_TIMEOUT.as_secs()
            )),
            (_, sqlx::Error::PoolTimedOut) => StoreError::Unavailable(format!(
                "no database connection came free within {} s (all are busy, or the server \
                 does not answer)",
                crate::POSTGRES_ACQUIRE_TIMEOUT.as_secs()
            )),
            _ => StoreError::Db(e),
        }
    }
}

/// Shorthand for `Result<T, StoreError>`.
pub type Result<T, E = StoreError> = std::result::Result<T, E>;
