//! MCP over Streamable HTTP, stateless: every POST is answered on its own
//! (a JSON body, or an SSE stream when the tool sends progress first), no
//! `Mcp-Session-Id` is handed out, and so any instance behind a load balancer
//! can answer any request. rmcp's `StreamableHttpService` does the protocol
//! work (with `NeverSessionManager`, `legacy_session_mode = false`); this
//! module configures it and adds what Sandpit's contract asks on top.
//!
//! - DNS-rebinding protection: `Host` and `Origin` are checked against
//!   allow-lists before anything else happens (403 otherwise). A browser page
//!   on another site can reach a server on localhost; these checks are what
//!   stop it from driving the sandboxes of whoever runs that server.
//! - A plain GET is answered 405 (`Allow: POST`): a stateless server has no
//!   stream to offer, which the spec allows.
//! - `MCP-Protocol-Version`, when present, must name one of the
//!   [`SUPPORTED_PROTOCOL_VERSIONS`](crate::SUPPORTED_PROTOCOL_VERSIONS).
//!   rmcp alone would accept every revision it knows, including ones this
//!   server does not negotiate. Any other value is answered with HTTP 400
//!   and the JSON-RPC error 2026-07-28 defines for it,
//!   `UnsupportedProtocolVersionError`: code `-32022`, `data` =
//!   `{"supported": [the revisions], "requested": "<the header's value>"}`
//!   (the 2026-07-28 `schema.ts`, and rmcp 3.11; early drafts of that
//!   revision numbered it `-32004`). Built with rmcp's own
//!   `ErrorData::unsupported_protocol_version`, so it is the same error rmcp
//!   gives in-band. The `supported` list is how a client that speaks several
//!   revisions picks one and retries; it includes the revisions with an
//!   `initialize` handshake, so a client that also speaks those can fall
//!   back to them. The same answer goes to every request, whatever revision
//!   its body follows: the 2025 revisions ask only for a 400, and a JSON-RPC
//!   body with one is allowed there too.

use crate::server::{CallerSource, SandpitMcp, SUPPORTED_PROTOCOL_VERSIONS};
use axum::{
    extract::{Request, State},
    middleware::{from_fn_with_state, Next},
    response::{IntoResponse, Response},
    Router,
};
use rmcp::{
    model::{ErrorData, JsonRpcError, ProtocolVersion, RequestId},
    transport::streamable_http_server::{
        session::never::NeverSessionManager, StreamableHttpServerConfig, StreamableHttpService,
    },
};
use sandpit_core::SandboxApi;
use serde::Deserialize;
use serde_json::Value;
use std::{sync::Arc, time::Duration};
use tokio_util::sync::CancellationToken;

/// How the HTTP endpoint checks and answers requests.
#[derive(Debug, Clone)]
pub struct HttpConfig {
    /// Accepted `Host` values: `name` (any port) or `name:port`; IPv6 as
    /// `::1` or `[::1]`. Default: `localhost`, `127.0.0.1`, `::1`, any port.
    /// A public deployment lists its own names. Empty accepts every `Host`
    /// (only behind a proxy that checks it).
    pub allowed_hosts: Vec<String>,
    /// Accepted `Origin` values when the header is present (requests without
    /// one, i.e. non-browser clients, always pass): `scheme://host:port`, or
    /// `scheme://host:*` for any port; `null` matches `Origin: null`. Default:
    /// http and https on localhost, 127.0.0.1 and `[::1]`, any port. Empty
    /// refuses every request that carries an `Origin`.
    pub allowed_origins: Vec<String>,
    /// Answer a tool call that sends no notification with
    /// `Content-Type: application/json` rather than a one-event SSE stream.
    /// Calls that stream progress always answer with SSE. Default true.
    pub json_response: bool,
    /// SSE keep-alive comment interval (default 15 s).
    pub sse_keep_alive: Option<Duration>,
    /// Largest POST body accepted (default 16 MiB: `write_file` content travels inline).
    pub max_request_body_bytes: usize,
    /// Cancelled on shutdown: open SSE streams end and new requests are refused.
    pub shutdown: CancellationToken,
    /// The service's limits, which the tools' schemas advertise (default:
    /// the default configuration's).
    pub limits: sandpit_core::Limits,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            allowed_hosts: vec!["localhost".into(), "127.0.0.1".into(), "::1".into()],
            allowed_origins: ["http", "https"]
                .iter()
                .flat_map(|scheme| {
                    ["localhost", "127.0.0.1", "[::1]"]
                        .iter()
                        .map(move |host| format!("{scheme}://{host}:*"))
                })
                .collect(),
            json_response: true,
            sse_keep_alive: Some(Duration::from_secs(15)),
            max_request_body_bytes: 16 * 1024 * 1024,
            shutdown: CancellationToken::new(),
            limits: sandpit_core::Limits::default(),
        }
    }
}

/// The Streamable HTTP endpoint as an axum router, to be mounted where the
/// contract puts it: `app.nest_service("/v1/mcp", http_service(api, config))`.
/// Each tool call acts for the account of the API key on its own request
/// ([`CallerSource::RequestApiKey`]).
pub fn http_service(api: Arc<dyn SandboxApi>, config: HttpConfig) -> Router {
    let max_body = config.max_request_body_bytes;
    let rmcp_config = StreamableHttpServerConfig::default()
        .with_legacy_session_mode(false)
        .with_json_response(config.json_response)
        .with_sse_keep_alive(config.sse_keep_alive)
        .with_cancellation_token(config.shutdown)
        .with_max_request_body_bytes(config.max_request_body_bytes)
        .with_allowed_hosts(config.allowed_hosts)
        .with_allowed_origins(config.allowed_origins)
        // An empty list must refuse every Origin, not switch the check off.
        .enforce_origin_validation();
    let server = SandpitMcp::new(api, CallerSource::RequestApiKey).with_limits(&config.limits);
    let service = StreamableHttpService::new(
        move || Ok(server.clone()),
        Arc::new(NeverSessionManager::default()),
        rmcp_config,
    );
    Router::new()
        .fallback_service(service)
        .layer(from_fn_with_state(max_body, check_protocol_version_header))
}

/// Refuse a request whose `MCP-Protocol-Version` names a revision this
/// server does not support (see the module documentation for the answer's
/// shape). The body is read only then, for the request's `id`.
async fn check_protocol_version_header(
    State(max_body): State<usize>,
    request: Request,
    next: Next,
) -> Response {
    let Some(value) = request.headers().get("mcp-protocol-version") else {
        return next.run(request).await;
    };
    if value
        .to_str()
        .is_ok_and(|v| SUPPORTED_PROTOCOL_VERSIONS.iter().any(|s| s.as_str() == v))
    {
        return next.run(request).await;
    }
    let requested = String::from_utf8_lossy(value.as_bytes()).into_owned();
    // A body that is too large, not JSON or not one request leaves the id out,
    // as JSON-RPC does when it cannot tell which request it answers.
    let id = axum::body::to_bytes(request.into_body(), max_body)
        .await
        .ok()
        .and_then(|body| serde_json::from_slice::<Value>(&body).ok())
        .and_then(|message| serde_json::from_value::<RequestId>(message.get("id")?.clone()).ok());
    let list: Vec<&str> = SUPPORTED_PROTOCOL_VERSIONS
        .iter()
        .map(|v| v.as_str())
        .collect();
    let mut error = ErrorData::unsupported_protocol_version(
        ProtocolVersion::deserialize(Value::String(requested.clone()))
            .expect("any string is a ProtocolVersion"),
        SUPPORTED_PROTOCOL_VERSIONS,
    );
    error.message = format!(
        "Unsupported protocol version {requested:?} (MCP-Protocol-Version); this server supports {}",
        list.join(", ")
    )
    .into();
    let body = serde_json::to_vec(&JsonRpcError::new(id, error)).expect("an error serializes");
    (
        http::StatusCode::BAD_REQUEST,
        [(http::header::CONTENT_TYPE, "application/json")],
        body,
    )
        .into_response()
}
