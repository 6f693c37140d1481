//! Sandpit's dashboard, served by `sandpit serve` at `/` beside the API.
//!
//! Pages are rendered on the server (maud) and work as plain HTML forms:
//! every action is a `POST` of a form that carries the session's CSRF
//! token, answered with a redirect to the page that shows its result (or
//! the page again with what went wrong). Script is there only where a page
//! is live: expiry countdowns (`static/app.js`) and the terminal
//! (xterm.js, fetched from the npm registry by `scripts/web-assets.sh` and
//! embedded in the binary, so the server needs no CDN).
//!
//! People sign in with an API key; the key is checked once and never kept.
//! What the browser holds is a session (`session`): a random token in an
//! HttpOnly, SameSite=Lax cookie (Secure when served over TLS), stored
//! hashed with its CSRF token and expiry. Everything a page shows or does
//! goes through the same [`SandboxApi`] as REST and MCP, as the signed-in
//! account, so ownership, validation and billing are the service's, once.
//! Keys, the usage chart and an operator's view of every account read the
//! store directly.

mod assets;
mod events;
mod files;
mod keys;
mod pages;
mod secrets;
mod session;
mod signup;
mod templates;
mod view;
mod volumes;
mod webhooks;

pub use signup::{ClientAddr, SignupConfig, SignupMode};

use axum::routing::{get, post};
use axum::Router;
use sandpit_core::{SandboxApi, Service};
use std::sync::Arc;

/// How the dashboard is served.
#[derive(Debug, Clone)]
pub struct WebConfig {
    /// Mark the session cookie `Secure` (the listener speaks TLS).
    pub secure_cookies: bool,
    /// The server's public base URL, for the MCP client configuration a new
    /// key is shown with.
    pub public_url: String,
    /// How long a sign-in lasts.
    pub session_ttl: time::Duration,
    /// Who may make an account here.
    pub signup: SignupConfig,
}

impl Default for WebConfig {
    fn default() -> Self {
        WebConfig {
            secure_cookies: false,
            public_url: "http://127.0.0.1:8080".into(),
            session_ttl: time::Duration::hours(12),
            signup: SignupConfig::default(),
        }
    }
}

/// What every handler has.
#[derive(Clone)]
pub(crate) struct Web {
    pub svc: Arc<Service>,
    pub api: Arc<dyn SandboxApi>,
    pub config: Arc<WebConfig>,
}

/// The dashboard's routes (no fallback: merge it with the API's router,
/// whose fallback answers every other path).
pub fn router(svc: Arc<Service>, config: WebConfig) -> Router {
    let web = Web {
        api: svc.clone() as Arc<dyn SandboxApi>,
        svc,
        config: Arc::new(config),
    };
    Router::new()
        .route("/", get(pages::home))
        .route("/sign-in", post(session::sign_in))
        .route("/sign-out", post(session::sign_out))
        .route("/sign-up", get(signup::page_get).post(signup::submit))
        .route("/sandboxes", get(pages::sandboxes).post(pages::create))
        .route("/sandboxes/{id}", get(pages::sandbox))
        .route("/sandboxes/{id}/terminal", get(pages::terminal))
        .route(
            "/sandboxes/{id}/terminal-token",
            post(pages::terminal_token),
        )
        .route("/sandboxes/{id}/act/{action}", post(pages::act))
        .route("/sandboxes/{id}/files/download", get(files::download))
        .route("/sandboxes/{id}/files/upload", post(files::upload))
        .route("/sandboxes/{id}/files/delete", post(files::delete))
        .route("/snapshots", get(pages::snapshots))
        .route("/snapshots/{id}/delete", post(pages::delete_snapshot))
        .route("/templates", get(templates::list))
        .route("/templates/{id}", get(templates::build))
        .route("/templates/{id}/rebuild", post(templates::rebuild))
        .route("/templates/{id}/delete", post(templates::delete))
        .route("/usage", get(pages::usage))
        .route("/keys", get(keys::list).post(keys::create))
        .route("/keys/{id}/revoke", post(keys::revoke))
        .route("/secrets", get(secrets::list).post(secrets::put))
        .route("/secrets/{name}/delete", post(secrets::delete))
        .route("/volumes", get(volumes::list).post(volumes::create))
        .route("/volumes/{id}/resize", post(volumes::resize))
        .route("/volumes/{id}/delete", post(volumes::delete))
        .route("/events", get(events::list))
        .route("/webhooks", get(webhooks::list).post(webhooks::create))
        .route("/webhooks/{id}", get(webhooks::show))
        .route("/webhooks/{id}/delete", post(webhooks::delete))
        .route(
            "/webhooks/{id}/deliveries/{delivery}/redeliver",
            post(webhooks::redeliver),
        )
        .route("/accounts", get(pages::accounts))
        .route("/accounts/{id}/credit", post(pages::add_credit))
        .route("/assets/{file}", get(assets::serve))
        // An upload's form: the file and a little more.
        .layer(axum::extract::DefaultBodyLimit::max(
            files::MAX_UPLOAD + (1 << 20),
        ))
        .layer(axum::middleware::from_fn_with_state(
            web.clone(),
            view::frame_failures,
        ))
        .with_state(web)
}
