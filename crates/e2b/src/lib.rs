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
mod secrets;
mod templates;
mod volumes;
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

/// The port envd listens on in E2B's sandboxes: a data-plane request that
/// names it (or no port) is envd's.
pub const ENVD_PORT: u16 = 49983;

/// The sandbox and port a request names for a server of the sandbox's own
/// (`E2b-Sandbox-Id` and `E2b-Sandbox-Port` other than envd's): what the
/// SDKs send when `E2B_SANDBOX_URL` is set, e.g. the code interpreter's
/// `run_code` to port 49999. Such a request goes to that port as a preview
/// URL's would.
pub fn sandbox_port(headers: &HeaderMap) -> Option<(String, u16)> {
    let id = headers.get(SANDBOX_ID_HEADER)?.to_str().ok()?.trim();
    let port: u16 = headers
        .get("e2b-sandbox-port")?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()?;
    (port != ENVD_PORT && !id.is_empty()).then(|| (id.to_string(), port))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_port_other_than_envds_goes_to_the_sandboxs_own_server() {
        let headers = |port: Option<&str>| {
            let mut h = HeaderMap::new();
            h.insert(SANDBOX_ID_HEADER, "sbx_1".parse().unwrap());
            if let Some(p) = port {
                h.insert("e2b-sandbox-port", p.parse().unwrap());
            }
            h
        };
        assert_eq!(
            sandbox_port(&headers(Some("49999"))),
            Some(("sbx_1".into(), 49999))
        );
        assert_eq!(sandbox_port(&headers(Some("49983"))), None, "envd's");
        assert_eq!(sandbox_port(&headers(None)), None);
        assert_eq!(sandbox_port(&headers(Some("x"))), None);
    }
}
