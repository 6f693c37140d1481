//! The one error shape and the request id.
//!
//! Handlers and extractors fail with [`ApiError`], which only sets the status
//! (from [`ErrorType::http_status`], the single mapping) and parks the error
//! in the response's extensions. The outermost middleware, [`finish`], which
//! also minted the request id, writes the JSON body with that id, so no
//! handler needs to carry the id around. The same middleware turns any other
//! non-2xx response (axum's built-in 405, a caught panic, a rejection that
//! slipped through) into the same JSON shape, so clients never see plain text.
//! Being the one place every REST error passes, it also counts them by type
//! (`sandpit_errors_total`, see `sandpit_core::metrics`).

use axum::body::Body;
use axum::extract::Request;
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sandpit_core::{CoreError, ErrorType};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The body of every non-2xx response.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[schemars(rename = "Error")]
pub struct ErrorBody {
    pub error: ErrorObject,
    /// The same id as the `x-request-id` response header; quote it when reporting a problem.
    pub request_id: String,
}

/// What went wrong: a stable type to branch on and a message for people.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ErrorObject {
    #[serde(rename = "type")]
    pub kind: ErrorType,
    pub message: String,
}

impl ErrorBody {
    pub fn new(err: &CoreError, request_id: &str) -> Self {
        ErrorBody {
            error: ErrorObject {
                kind: err.kind,
                message: err.message.clone(),
            },
            request_id: request_id.to_owned(),
        }
    }
}

/// The id of one request: `req_` and 24 hex digits (96 random bits).
#[derive(Debug, Clone)]
pub(crate) struct RequestId(pub String);

impl RequestId {
    fn generate() -> Self {
        RequestId(format!("req_{}", hex::encode(rand::random::<[u8; 12]>())))
    }
}

/// The status of an error type; the one place that turns the core's
/// `http_status()` into an HTTP status.
pub(crate) fn status_of(kind: ErrorType) -> StatusCode {
    StatusCode::from_u16(kind.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
}

/// The error type a bare status stands for (responses we did not make
/// ourselves, and error bodies a remote server sent without a known type).
pub(crate) fn kind_for_status(status: u16) -> ErrorType {
    match status {
        401 => ErrorType::Unauthorized,
        402 => ErrorType::InsufficientCredits,
        403 => ErrorType::Forbidden,
        404 => ErrorType::NotFound,
        409 => ErrorType::Conflict,
        429 => ErrorType::RateLimited,
        502..=504 => ErrorType::ServiceUnavailable,
        s if s >= 500 => ErrorType::InternalError,
        _ => ErrorType::InvalidRequest,
    }
}

/// Retry-After for 429 and 503 when the core did not say: one second.
const DEFAULT_RETRY_AFTER_SECS: u64 = 1;

/// A failed request, as handlers and extractors return it.
#[derive(Debug)]
pub(crate) struct ApiError {
    pub err: CoreError,
    /// Only for the few statuses that are not an error type's own:
    /// 413 (`invalid_request`, body too large) and 405 (`invalid_request`).
    pub status: Option<StatusCode>,
}

impl ApiError {
    pub fn invalid(message: impl Into<String>) -> Self {
        CoreError::invalid(message).into()
    }
    pub fn with_status(mut self, status: StatusCode) -> Self {
        self.status = Some(status);
        self
    }
}

impl From<CoreError> for ApiError {
    fn from(err: CoreError) -> Self {
        ApiError { err, status: None }
    }
}

/// Parked in a response's extensions for [`finish`] to render.
#[derive(Clone)]
struct PendingError(CoreError);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status.unwrap_or_else(|| status_of(self.err.kind));
        let mut resp = status.into_response();
        if matches!(status.as_u16(), 429 | 503) {
            let secs = self.err.retry_after.unwrap_or(DEFAULT_RETRY_AFTER_SECS);
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        resp.extensions_mut().insert(PendingError(self.err));
        resp
    }
}

/// Largest foreign error body read to build a message from.
const FOREIGN_BODY_LIMIT: usize = 16 * 1024;

/// Outermost middleware: mint the request id, and give every response the
/// `x-request-id` header and every non-2xx response the JSON error body.
/// For a service nested beside the REST routes that speaks its own error
/// format (MCP's JSON-RPC): the request id on the request and the response,
/// as REST has it, and the body left as it is.
pub(crate) async fn tag_request(mut req: Request, next: Next) -> Response {
    let id = RequestId::generate();
    req.extensions_mut().insert(id.clone());
    let mut resp = next.run(req).await;
    if let Ok(v) = HeaderValue::from_str(&id.0) {
        resp.headers_mut().insert("x-request-id", v);
    }
    resp
}

pub(crate) async fn finish(mut req: Request, next: Next) -> Response {
    let id = RequestId::generate();
    req.extensions_mut().insert(id.clone());
    let resp = next.run(req).await;
    let (mut parts, body) = resp.into_parts();

    let err = match parts.extensions.remove::<PendingError>() {
        Some(PendingError(err)) if err.kind == ErrorType::InternalError => {
            tracing::warn!(request_id = %id.0, error = %err.message, "internal error");
            err
        }
        Some(PendingError(err)) => err,
        None if parts.status.is_client_error() || parts.status.is_server_error() => {
            // Not ours (axum's 405, a caught panic, ...): keep the status, say it in JSON.
            let text = axum::body::to_bytes(body, FOREIGN_BODY_LIMIT)
                .await
                .map(|b| String::from_utf8_lossy(&b).trim().to_owned())
                .unwrap_or_default();
            if parts.status.is_server_error() {
                tracing::warn!(request_id = %id.0, status = %parts.status, body = %text, "server error");
            }
            foreign_error(parts.status, text)
        }
        None => {
            parts.headers.insert("x-request-id", header_value(&id.0));
            return Response::from_parts(parts, body);
        }
    };
    sandpit_core::metrics::record_error(err.kind);

    let json = serde_json::to_vec(&ErrorBody::new(&err, &id.0)).expect("serializable");
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    parts.headers.insert("x-request-id", header_value(&id.0));
    Response::from_parts(parts, Body::from(json))
}

fn foreign_error(status: StatusCode, text: String) -> CoreError {
    let kind = kind_for_status(status.as_u16());
    let message = match status {
        StatusCode::METHOD_NOT_ALLOWED => {
            "this method is not allowed on this path (see the `Allow` header)".to_owned()
        }
        StatusCode::INTERNAL_SERVER_ERROR => {
            "internal error: the server failed while handling this request".to_owned()
        }
        _ if !text.is_empty() && text.len() < 1024 => text,
        _ => status
            .canonical_reason()
            .unwrap_or("request failed")
            .to_owned(),
    };
    CoreError::new(kind, message)
}

fn header_value(id: &str) -> HeaderValue {
    HeaderValue::from_str(id).expect("request ids are ASCII")
}
