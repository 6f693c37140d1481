//! The errors every adapter shows: a stable type (the API's `error.type`) and
//! a message that says what to do next.

use serde::{Deserialize, Serialize};

/// The stable error types of the public API.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ErrorType {
    InvalidRequest,
    Unauthorized,
    InsufficientCredits,
    Forbidden,
    NotFound,
    Conflict,
    RateLimited,
    ServiceUnavailable,
    /// A bug or an unexpected failure of the platform (HTTP 500).
    InternalError,
}

impl ErrorType {
    /// Every type.
    pub const ALL: [ErrorType; 9] = [
        ErrorType::InvalidRequest,
        ErrorType::Unauthorized,
        ErrorType::InsufficientCredits,
        ErrorType::Forbidden,
        ErrorType::NotFound,
        ErrorType::Conflict,
        ErrorType::RateLimited,
        ErrorType::ServiceUnavailable,
        ErrorType::InternalError,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ErrorType::InvalidRequest => "invalid_request",
            ErrorType::Unauthorized => "unauthorized",
            ErrorType::InsufficientCredits => "insufficient_credits",
            ErrorType::Forbidden => "forbidden",
            ErrorType::NotFound => "not_found",
            ErrorType::Conflict => "conflict",
            ErrorType::RateLimited => "rate_limited",
            ErrorType::ServiceUnavailable => "service_unavailable",
            ErrorType::InternalError => "internal_error",
        }
    }

    /// The HTTP status of this type (the one mapping, used by every adapter).
    pub fn http_status(self) -> u16 {
        match self {
            ErrorType::InvalidRequest => 400,
            ErrorType::Unauthorized => 401,
            ErrorType::InsufficientCredits => 402,
            ErrorType::Forbidden => 403,
            ErrorType::NotFound => 404,
            ErrorType::Conflict => 409,
            ErrorType::RateLimited => 429,
            ErrorType::ServiceUnavailable => 503,
            ErrorType::InternalError => 500,
        }
    }
}

impl std::fmt::Display for ErrorType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A failure of a core operation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct CoreError {
    pub kind: ErrorType,
    pub message: String,
    /// Seconds after which a retry may succeed (rate limits, capacity).
    pub retry_after: Option<u64>,
    /// A limit that stays until the caller acts (the account's live
    /// sandboxes, its snapshot quota): the same call retried soon fails
    /// the same way, so a client that retries by itself (E2B's SDKs) is
    /// told not to.
    pub lasting: bool,
}

impl CoreError {
    pub fn new(kind: ErrorType, message: impl Into<String>) -> Self {
        CoreError {
            kind,
            message: message.into(),
            retry_after: None,
            lasting: false,
        }
    }
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorType::InvalidRequest, message)
    }
    pub fn not_found(what: &str, id: &str) -> Self {
        Self::new(ErrorType::NotFound, format!("no {what} with id {id:?}"))
    }
    pub fn unauthorized() -> Self {
        Self::new(
            ErrorType::Unauthorized,
            "a valid API key is required: send `Authorization: Bearer <key>` or `x-api-key: <key>`",
        )
    }
    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(ErrorType::Conflict, message)
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ErrorType::InternalError, message)
    }
    pub fn with_retry_after(mut self, secs: u64) -> Self {
        self.retry_after = Some(secs);
        self
    }
    /// See [`CoreError::lasting`].
    pub fn lasting(mut self) -> Self {
        self.lasting = true;
        self
    }
}

pub type Result<T, E = CoreError> = std::result::Result<T, E>;

/// An upload's body failed before its end (the client went away).
pub(crate) fn body_failed(e: std::io::Error) -> CoreError {
    CoreError::invalid(format!("the request body ended early: {e}"))
}

/// An upload's body was not as long as it said.
pub(crate) fn body_length(got: u64, announced: u64) -> CoreError {
    CoreError::invalid(format!(
        "the request body carried {got} bytes, not the {announced} its Content-Length announced"
    ))
}
