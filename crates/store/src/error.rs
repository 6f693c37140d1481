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
    /// The database failed (I/O, lock time-out, constraint).
    #[error("database: {0}")]
    Db(#[from] sqlx::Error),
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

/// Shorthand for `Result<T, StoreError>`.
pub type Result<T, E = StoreError> = std::result::Result<T, E>;
