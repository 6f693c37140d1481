//! Errors as E2B's SDKs read them: the control plane's and `/files`'
//! `{"code": <HTTP status>, "message": …}` (the Python SDK fails with a
//! decoding error on any other body, and the JavaScript one tells "not
//! found" by the body's `code`), and the Connect protocol's string codes.

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use sandpit_core::{CoreError, ErrorType};

/// An error of the control plane or of `/files`.
#[derive(Debug)]
pub struct HttpError {
    pub status: StatusCode,
    pub message: String,
    pub retry_after: Option<u64>,
    /// See [`CoreError::lasting`]: the SDKs are told not to retry it.
    pub lasting: bool,
}

impl HttpError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        HttpError {
            status,
            message: message.into(),
            retry_after: None,
            lasting: false,
        }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    /// What E2B's own edge answers for a sandbox that is not running: the
    /// SDKs look for "was not found" in a 502.
    pub fn sandbox_gone(id: &str) -> Self {
        Self::new(
            StatusCode::BAD_GATEWAY,
            format!("The sandbox {id} was not found: it ended, expired or is paused"),
        )
    }
}

/// A JSON request body whose refusal (not JSON, not E2B's shape) is
/// E2B's error body, saying what did not fit: axum's own `Json` answers
/// those in plain text, which the SDKs cannot decode.
pub struct Body<T>(pub T);

impl<T, S> axum::extract::FromRequest<S> for Body<T>
where
    T: serde::de::DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = HttpError;

    async fn from_request(request: axum::extract::Request, state: &S) -> Result<Self, HttpError> {
        match axum::Json::<T>::from_request(request, state).await {
            Ok(axum::Json(body)) => Ok(Body(body)),
            // E2B says 400 of any body it cannot take (axum: 415 without
            // a JSON type, 422 for a shape that does not fit), but too
            // large is too large.
            Err(rejection) => Err(HttpError::new(
                match rejection.status() {
                    StatusCode::PAYLOAD_TOO_LARGE => StatusCode::PAYLOAD_TOO_LARGE,
                    _ => StatusCode::BAD_REQUEST,
                },
                rejection.body_text(),
            )),
        }
    }
}

impl From<CoreError> for HttpError {
    fn from(e: CoreError) -> Self {
        HttpError {
            status: status_of(e.kind),
            message: e.message,
            retry_after: e.retry_after,
            lasting: e.lasting,
        }
    }
}

impl IntoResponse for HttpError {
    fn into_response(self) -> Response {
        let body = serde_json::json!({"code": self.status.as_u16(), "message": self.message});
        let mut response = (self.status, axum::Json(body)).into_response();
        if self.lasting {
            // The SDKs retry a 429 unless told not to: the Python SDK three
            // times (each after Retry-After) without `Should-Retry: false`,
            // the JavaScript one whenever it carries a Retry-After. An
            // account at its limit would wait half a minute for the same
            // answer.
            response
                .headers_mut()
                .insert("should-retry", HeaderValue::from_static("false"));
        } else if let Some(seconds) = self.retry_after {
            response
                .headers_mut()
                .insert("retry-after", HeaderValue::from(seconds));
        } else if self.status == StatusCode::PAYLOAD_TOO_LARGE {
            // The request's body was not read to its end, so the connection
            // cannot carry another request: said, so a client's pool does
            // not send its next one down it as hyper closes it (the Python
            // SDK's next call once failed "connection closed before message
            // completed").
            response
                .headers_mut()
                .insert("connection", HeaderValue::from_static("close"));
        } else if self.status.is_server_error() {
            // The Python SDK retries a 502, 503 or 504 unless told not to.
            response
                .headers_mut()
                .insert("should-retry", HeaderValue::from_static("false"));
        }
        response
    }
}

/// The HTTP status of each of the core's error types.
pub fn status_of(kind: ErrorType) -> StatusCode {
    match kind {
        ErrorType::InvalidRequest => StatusCode::BAD_REQUEST,
        ErrorType::Unauthorized => StatusCode::UNAUTHORIZED,
        ErrorType::InsufficientCredits => StatusCode::PAYMENT_REQUIRED,
        ErrorType::Forbidden => StatusCode::FORBIDDEN,
        ErrorType::NotFound => StatusCode::NOT_FOUND,
        ErrorType::Conflict => StatusCode::CONFLICT,
        ErrorType::RateLimited => StatusCode::TOO_MANY_REQUESTS,
        ErrorType::ServiceUnavailable => StatusCode::SERVICE_UNAVAILABLE,
        ErrorType::InternalError => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

/// An error in the Connect protocol's terms.
#[derive(Debug, Clone)]
pub struct RpcError {
    /// One of the protocol's codes (`not_found`, `unimplemented`, …).
    pub code: &'static str,
    pub message: String,
}

impl RpcError {
    pub fn new(code: &'static str, message: impl Into<String>) -> Self {
        RpcError {
            code,
            message: message.into(),
        }
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new("invalid_argument", message)
    }

    /// What is not built: a 4xx for a unary call (see [`Self::status`]).
    pub fn unimplemented(what: &str) -> Self {
        Self::new(
            "unimplemented",
            format!("{what} is not available in Sandpit's E2B API yet"),
        )
    }

    /// The JSON of the error, as a unary body or inside an end-of-stream.
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({"code": self.code, "message": self.message})
    }

    /// The HTTP status of a unary answer. `unimplemented` is 404 rather
    /// than the protocol's 501: clients read the code from the body, and a
    /// refusal is the client's to fix, never a server fault.
    pub fn status(&self) -> StatusCode {
        match self.code {
            "invalid_argument" | "out_of_range" | "failed_precondition" => StatusCode::BAD_REQUEST,
            "unauthenticated" => StatusCode::UNAUTHORIZED,
            "permission_denied" => StatusCode::FORBIDDEN,
            "not_found" | "unimplemented" => StatusCode::NOT_FOUND,
            "already_exists" | "aborted" => StatusCode::CONFLICT,
            "resource_exhausted" => StatusCode::TOO_MANY_REQUESTS,
            "unavailable" => StatusCode::SERVICE_UNAVAILABLE,
            "deadline_exceeded" => StatusCode::GATEWAY_TIMEOUT,
            "canceled" => StatusCode::from_u16(499).expect("a valid status"),
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}

impl From<CoreError> for RpcError {
    fn from(e: CoreError) -> Self {
        let code = match e.kind {
            ErrorType::InvalidRequest => "invalid_argument",
            ErrorType::Unauthorized => "unauthenticated",
            ErrorType::InsufficientCredits | ErrorType::Forbidden => "permission_denied",
            ErrorType::NotFound => "not_found",
            ErrorType::Conflict => "failed_precondition",
            ErrorType::RateLimited => "resource_exhausted",
            ErrorType::ServiceUnavailable => "unavailable",
            ErrorType::InternalError => "internal",
        };
        RpcError::new(code, e.message)
    }
}

impl IntoResponse for RpcError {
    fn into_response(self) -> Response {
        (self.status(), axum::Json(self.json())).into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lasting_limit_tells_the_sdks_not_to_retry_and_a_passing_one_does_not() {
        let lasting = CoreError::new(ErrorType::RateLimited, "the account has 1 live sandboxes")
            .with_retry_after(10)
            .lasting();
        let r = HttpError::from(lasting).into_response();
        assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(r.headers()["should-retry"], "false");
        assert!(
            r.headers().get("retry-after").is_none(),
            "{:?}",
            r.headers()
        );
        let passing = CoreError::new(ErrorType::RateLimited, "4 file transfers in flight")
            .with_retry_after(2);
        let r = HttpError::from(passing).into_response();
        assert_eq!(r.headers()["retry-after"], "2");
        assert!(
            r.headers().get("should-retry").is_none(),
            "{:?}",
            r.headers()
        );
    }
}
