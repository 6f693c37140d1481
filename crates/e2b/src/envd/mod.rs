//! The data plane: what E2B's in-sandbox daemon, envd, answers, for the
//! sandbox named in the `E2b-Sandbox-Id` header, by that sandbox's token
//! (`X-Access-Token`). Processes and files are the core's commands and
//! files (see [`process`] and [`files`]), run as the guest's unprivileged
//! user, which is E2B's default user too (`user`, home `/home/user`).

mod connect;
mod files;
mod filesystem;
mod process;
mod watch;

pub(crate) use files::raw_upload;
pub use watch::Watchers;

use crate::error::{HttpError, RpcError};
use crate::{E2b, SANDBOX_ID_HEADER};
use axum::extract::{FromRequestParts, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use sandpit_core::{Caller, ErrorType, SandboxStatus};

/// The data plane's routes (for requests [`crate::is_data_plane`] picks).
pub fn data_plane(e2b: E2b) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/files", get(files::download).post(files::upload))
        .route("/process.Process/Start", post(process::start))
        .route("/process.Process/Connect", post(process::connect))
        .route("/process.Process/StreamInput", post(process::stream_input))
        .route("/process.Process/{method}", post(process::unary))
        .route("/filesystem.Filesystem/WatchDir", post(watch::watch_dir))
        .route("/filesystem.Filesystem/{method}", post(filesystem::call))
        .route("/{service}/{method}", post(not_built_rpc))
        .fallback(not_built)
        .with_state(e2b)
}

/// The sandbox a request is for, and its account, by the sandbox's token.
pub struct ForSandbox {
    pub id: String,
    pub caller: Caller,
}

impl FromRequestParts<E2b> for ForSandbox {
    type Rejection = HttpError;

    async fn from_request_parts(parts: &mut Parts, e2b: &E2b) -> Result<Self, HttpError> {
        ForSandbox::from_headers(&parts.headers, e2b).await
    }
}

impl ForSandbox {
    /// The sandbox `headers` name, if their token is its own.
    pub async fn from_headers(headers: &HeaderMap, e2b: &E2b) -> Result<Self, HttpError> {
        let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
        let id = header(SANDBOX_ID_HEADER).unwrap_or_default().to_string();
        let Some(token) = header("x-access-token") else {
            return Err(HttpError::new(
                StatusCode::UNAUTHORIZED,
                "X-Access-Token is required: the sandbox's envdAccessToken",
            ));
        };
        match e2b.api.authenticate_sandbox(&id, token).await {
            Ok(caller) => Ok(ForSandbox { id, caller }),
            Err(e) if e.kind == ErrorType::NotFound => Err(HttpError::sandbox_gone(&id)),
            Err(e) => Err(e.into()),
        }
    }
}

/// `GET /health`: 204 while the sandbox runs; the 502 E2B's edge gives a
/// sandbox that does not (the SDKs' `is_running` is then false).
async fn health(State(e2b): State<E2b>, sandbox: ForSandbox) -> Result<Response, HttpError> {
    let s = e2b.api.get_sandbox(&sandbox.caller, &sandbox.id).await?;
    match s.status {
        SandboxStatus::Running | SandboxStatus::Provisioning => {
            Ok(StatusCode::NO_CONTENT.into_response())
        }
        _ => Err(HttpError::sandbox_gone(&sandbox.id)),
    }
}

/// An RPC that is not built: refused with the protocol's `unimplemented`,
/// naming it, after the sandbox and token were checked.
async fn not_built_rpc(
    _sandbox: ForSandbox,
    axum::extract::Path((service, method)): axum::extract::Path<(String, String)>,
) -> Response {
    RpcError::unimplemented(&format!("{service}/{method}")).into_response()
}

async fn not_built(_sandbox: ForSandbox, uri: axum::http::Uri) -> HttpError {
    HttpError::new(
        StatusCode::NOT_FOUND,
        format!(
            "{} is not part of envd's API as Sandpit speaks it",
            uri.path()
        ),
    )
}

/// A path as E2B gives it: relative ones are under the user's home.
pub fn guest_path(path: &str) -> String {
    if path.starts_with('/') {
        path.to_string()
    } else {
        format!("{}/{path}", sandpit_protocol::GUEST_HOME)
    }
}

/// The user a call names (`Authorization: Basic base64("<user>:")`), if any.
pub fn named_user(headers: &axum::http::HeaderMap) -> Option<String> {
    use base64::Engine;
    let value = headers.get("authorization")?.to_str().ok()?;
    let encoded = value
        .strip_prefix("Basic ")
        .or(value.strip_prefix("basic "))?;
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(encoded.trim())
        .ok()?;
    let text = String::from_utf8(decoded).ok()?;
    Some(text.split(':').next().unwrap_or_default().to_string())
}

/// Commands and files are the guest user's: another user is refused.
pub fn check_user(user: Option<&str>) -> Result<(), RpcError> {
    match user {
        None | Some("") => Ok(()),
        Some(u) if u == sandpit_protocol::GUEST_USER => Ok(()),
        Some(u) => Err(RpcError::new(
            "permission_denied",
            format!(
                "Sandpit runs commands and file calls as the unprivileged user {:?}, not {u:?} \
                 (no root, no sudo: the VM is the boundary)",
                sandpit_protocol::GUEST_USER
            ),
        )),
    }
}
