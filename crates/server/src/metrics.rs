//! Where `sandpit serve` and `sandpit node` serve their Prometheus metrics
//! (the families themselves are `sandpit_core::metrics`'s).
//!
//! Off unless configured, because what they tell (how many sandboxes, how
//! much credit is held, how busy the host is) is the operator's business,
//! not the API's clients'. Two ways, either or both:
//!
//! - `[metrics] listen = "127.0.0.1:9464"` (`--metrics-listen`): a listener
//!   of their own that serves `/metrics` to whoever reaches it, so it is
//!   protected by where it binds (loopback, a private network), as
//!   Prometheus exporters usually are.
//! - `[metrics] token = "…"` (`--metrics-token`, `SANDPIT_METRICS_TOKEN`):
//!   `/metrics` on serve's public listener, for requests that bear
//!   `Authorization: Bearer <token>` (compared in constant time); anything
//!   else is 401. Without a token the public listener has no `/metrics`
//!   (the API's JSON 404).

use anyhow::{bail, Context, Result};
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use clap::Args;
use sandpit_core::metrics::{token_matches, Exporter, CONTENT_TYPE};
use sandpit_core::{CoreError, ErrorType, Service};
use serde::Deserialize;
use std::sync::Arc;

/// `[metrics]` of the config file.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricsSection {
    /// Serve `/metrics` on a listener of its own at this address.
    pub listen: Option<String>,
    /// Serve `/metrics` on the public listener to requests bearing it.
    pub token: Option<String>,
}

/// The metrics flags of `serve` and `node` (over `[metrics]`).
#[derive(Args, Default)]
pub struct MetricsArgs {
    /// Serve Prometheus metrics at /metrics on a listener of their own at
    /// ADDR (keep it off the public network) [config `[metrics] listen`]
    #[arg(long, value_name = "ADDR")]
    metrics_listen: Option<String>,
    /// Serve /metrics on the public listener too, to requests with
    /// `Authorization: Bearer TOKEN` [config `[metrics] token`]
    #[arg(
        long,
        value_name = "TOKEN",
        env = "SANDPIT_METRICS_TOKEN",
        hide_env_values = true
    )]
    metrics_token: Option<String>,
}

impl MetricsArgs {
    /// The flags over the config file's `[metrics]`.
    fn over(self, file: &MetricsSection) -> MetricsSection {
        MetricsSection {
            listen: self.metrics_listen.or_else(|| file.listen.clone()),
            token: self
                .metrics_token
                .filter(|t| !t.is_empty())
                .or_else(|| file.token.clone()),
        }
    }
}

/// What serves a member's metrics, once its service runs.
pub struct Metrics {
    exporter: Arc<Exporter>,
    token: Option<String>,
}

/// Starts the metrics' own listener when one is configured, and returns
/// what mounts the token route on the public listener (see [`Metrics::mount`]).
/// `public_listener`: whether this command has one (`node` has none).
/// `node`: the name every sample carries as its `node` label.
pub async fn start(
    svc: &Arc<Service>,
    configured: &MetricsSection,
    node: String,
    args: MetricsArgs,
    public_listener: bool,
) -> Result<Metrics> {
    let config = args.over(configured);
    if let Some(token) = &config.token {
        if !public_listener {
            bail!(
                "sandpit node has no public listener to serve /metrics behind a token on: \
                 give [metrics] listen (--metrics-listen) instead"
            );
        }
        if token.len() < 16 {
            bail!("[metrics] token is too short to guess at: give at least 16 characters");
        }
    }
    let exporter = Arc::new(Exporter::new(svc.clone(), node));
    if let Some(listen) = &config.listen {
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .with_context(|| format!("binding the metrics listener to {listen}"))?;
        let addr = listener.local_addr()?;
        let app = Router::new()
            .route("/metrics", get(open_scrape))
            .with_state(exporter.clone());
        tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                tracing::error!("the metrics listener stopped: {e}");
            }
        });
        eprintln!("metrics at http://{addr}/metrics");
    }
    Ok(Metrics {
        exporter,
        token: config.token,
    })
}

impl Metrics {
    /// `app` with `/metrics` behind the token, when one is configured.
    pub fn mount(&self, app: Router) -> Router {
        let Some(token) = &self.token else {
            return app;
        };
        let guarded = Router::new()
            .route("/metrics", get(guarded_scrape))
            .with_state(Guarded {
                exporter: self.exporter.clone(),
                token: Arc::from(token.as_str()),
            });
        app.merge(guarded)
    }
}

#[derive(Clone)]
struct Guarded {
    exporter: Arc<Exporter>,
    token: Arc<str>,
}

async fn open_scrape(State(exporter): State<Arc<Exporter>>) -> Response {
    scrape(&exporter).await
}

async fn guarded_scrape(State(guarded): State<Guarded>, headers: HeaderMap) -> Response {
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or_default();
    if !token_matches(&guarded.token, given.trim()) {
        let err = CoreError::new(
            ErrorType::Unauthorized,
            "/metrics needs the metrics token: send `Authorization: Bearer <token>`",
        );
        return error_response(StatusCode::UNAUTHORIZED, &err);
    }
    scrape(&guarded.exporter).await
}

async fn scrape(exporter: &Exporter) -> Response {
    match exporter.render().await {
        Ok(text) => ([(header::CONTENT_TYPE, CONTENT_TYPE)], text).into_response(),
        Err(e) => {
            tracing::warn!("rendering the metrics: {e}");
            error_response(StatusCode::SERVICE_UNAVAILABLE, &e)
        }
    }
}

/// The API's error shape (with a request id of its own), so the public
/// listener answers `/metrics` as it answers everything else.
fn error_response(status: StatusCode, err: &CoreError) -> Response {
    sandpit_core::metrics::record_error(err.kind);
    let id = format!(
        "req_{}",
        rand::random::<[u8; 12]>()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    );
    let body = serde_json::to_string(&sandpit_api::ErrorBody::new(err, &id))
        .unwrap_or_else(|_| "{}".to_string());
    let mut resp = (status, [(header::CONTENT_TYPE, "application/json")], body).into_response();
    if let Ok(v) = HeaderValue::from_str(&id) {
        resp.headers_mut().insert("x-request-id", v);
    }
    if status == StatusCode::UNAUTHORIZED {
        resp.headers_mut()
            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    }
    resp
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::Settings;

    #[test]
    fn the_flags_go_over_the_config_file() {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("config.toml");
        std::fs::write(
            &config,
            "[metrics]\nlisten = \"127.0.0.1:9464\"\ntoken = \"from-the-file-0123456789\"\n",
        )
        .unwrap();
        let s = Settings::load(Some(dir.path().into()), None, Some(&config)).unwrap();
        let none = MetricsArgs::default().over(&s.metrics);
        assert_eq!(none.listen.as_deref(), Some("127.0.0.1:9464"));
        assert_eq!(none.token.as_deref(), Some("from-the-file-0123456789"));
        let flags = MetricsArgs {
            metrics_listen: Some("0.0.0.0:9000".into()),
            metrics_token: Some("from-the-flag-0123456789".into()),
        };
        let both = flags.over(&s.metrics);
        assert_eq!(both.listen.as_deref(), Some("0.0.0.0:9000"));
        assert_eq!(both.token.as_deref(), Some("from-the-flag-0123456789"));

        std::fs::write(&config, "[metrics]\nport = 9464\n").unwrap();
        let e = Settings::load(Some(dir.path().into()), None, Some(&config)).unwrap_err();
        assert!(format!("{e:#}").contains("port"), "{e:#}");
        let s = Settings::load(Some(dir.path().into()), None, None).unwrap();
        let off = MetricsArgs::default().over(&s.metrics);
        assert_eq!((off.listen, off.token), (None, None), "off by default");
    }
}
