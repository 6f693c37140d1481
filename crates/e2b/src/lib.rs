//! E2B's API, spoken by Sandpit, so that E2B's official SDKs (Python and
//! JavaScript) drive Sandpit's sandboxes with nothing changed but three
//! environment variables (see the README's "Using the E2B SDKs").
//!
//! E2B splits its API in two, and so does this crate:
//! - **The control plane** ([`control_plane`], nested under `/e2b` on the
//!   server's own port): create, list, inspect, time out, pause, connect to
//!   and kill sandboxes; REST and JSON, authenticated by the account's API
//!   key (`X-API-KEY`, either spelling of it: see `sandpit_store`'s
//!   `key_spelling`).
//! - **The data plane** ([`data_plane`]): what E2B's in-sandbox daemon
//!   (envd) answers: processes and files over the Connect protocol (JSON),
//!   and `/files` over plain HTTP. The SDKs send it to `E2B_SANDBOX_URL`
//!   with the sandbox named in the `E2b-Sandbox-Id` header (see
//!   [`is_data_plane`]), authenticated by the sandbox's own token
//!   (`X-Access-Token`, the create's `envdAccessToken`).
//!
//! Both are one more adapter over [`SandboxApi`], like REST, MCP and the
//! dashboard: billing, limits, expiry, idle sleep and placement are the
//! core's, and a sandbox made through one surface is seen and used through
//! the others. The wire contract, as the pinned SDKs expect it, is written
//! down in `docs/e2b-contract.md`.

mod control;
mod envd;
mod error;
mod templates;
mod wire;

use axum::http::{HeaderMap, Uri};
use sandpit_core::SandboxApi;
use std::sync::Arc;

pub use control::control_plane;
pub use envd::{data_plane, Watchers};

/// The header E2B's SDKs name the sandbox in, on every data-plane request.
pub const SANDBOX_ID_HEADER: &str = "e2b-sandbox-id";

/// The envd version this data plane answers as. The SDKs turn features on
/// by it (uploads as raw bodies from 0.5.7; below 0.4.0 they name the user
/// `user` on every call); what is not built yet is refused by the server,
/// saying so.
pub const ENVD_VERSION: &str = "0.5.7";

/// What both planes need.
#[derive(Clone)]
pub struct E2b {
    pub api: Arc<dyn SandboxApi>,
    /// The domain preview hosts are under (`preview_domain`, with its port),
    /// given to the SDKs as the sandboxes' `domain`: their `get_host(port)`
    /// is then `<port>-<id>.<domain>`, Sandpit's preview host.
    pub domain: String,
    /// Where this server's API is reached from outside (`public_url`):
    /// the base of the upload links a template build's files are sent to.
    pub public_url: String,
    /// The size template `base` stands for (the service's default).
    pub default_size: String,
    /// The most bytes of one request body held in memory: a multipart
    /// form, or a raw upload that gives no length (chunked), which cannot
    /// be streamed to the guest as it comes (a write names its size first).
    /// The server's `max_body_bytes`.
    pub max_body_bytes: usize,
    /// The directory watches the sync SDK polls (`CreateWatcher`); they
    /// live in this process, so its polls must reach this server.
    pub watchers: Watchers,
}

/// Whether a request is for a sandbox's data plane: it names one in
/// [`SANDBOX_ID_HEADER`], or it is a signed file URL
/// (`/files?…&signature=…`, which a browser or `curl` opens without the
/// SDK's headers: the signature, made with one sandbox's token, says which).
pub fn is_data_plane(headers: &HeaderMap, uri: &Uri) -> bool {
    headers.contains_key(SANDBOX_ID_HEADER)
        || (uri.path() == "/files"
            && uri.query().is_some_and(|q| {
                form_urlencoded::parse(q.as_bytes()).any(|(name, _)| name == "signature")
            }))
}
