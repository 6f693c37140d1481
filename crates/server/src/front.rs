//! The front door of `sandpit serve`: one listener, optionally TLS
//! (rustls, ALPN h2 and http/1.1), HTTP/1.1 and HTTP/2 on every connection,
//! and one decision per request: a preview host goes to the preview proxy,
//! a request naming a sandbox in `E2b-Sandbox-Id` to E2B's data plane,
//! anything else to the API router.
//!
//! Why one listener: preview URLs must work on a machine with nothing but
//! this server (`http://8000-sbx_x.localhost:8080`), so they share its port;
//! the host name tells them apart ([`sandpit_core::preview::parse_host`]).
//! How connections are accepted and bounded is `listener`'s business.

use crate::proxy::{error_page, Proxy};
use anyhow::{Context, Result};
use axum::body::Body;
use axum::Router;
use hyper::body::Incoming;
use hyper::{Request, Response};
use sandpit_core::preview::{parse_host, HostKind, PreviewError};
use std::net::IpAddr;
use std::path::Path;
use std::sync::Arc;
use tokio_rustls::rustls;
use tokio_rustls::TlsAcceptor;
use tower::ServiceExt;

/// Where requests go.
pub struct Front {
    pub api: Router,
    /// E2B's data plane, for requests that name a sandbox in
    /// `E2b-Sandbox-Id` (see `sandpit_e2b`).
    pub e2b_data: Router,
    pub proxy: Proxy,
    pub preview_domain: String,
    pub preview_scheme: String,
}

impl Front {
    pub(crate) async fn handle(
        self: Arc<Self>,
        req: Request<Incoming>,
        peer: IpAddr,
    ) -> Response<Body> {
        // HTTP/2 names the host in `:authority` (the URI); HTTP/1.1 in `Host`
        // (an absolute-form URI wins, as RFC 9112 says).
        let authority = req
            .uri()
            .authority()
            .map(|a| a.as_str().to_string())
            .or_else(|| {
                req.headers()
                    .get(hyper::header::HOST)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_string)
            });
        let kind = match &authority {
            Some(a) => parse_host(a, &self.preview_domain, &self.preview_scheme),
            None => HostKind::Api,
        };
        // E2B's SDKs name a sandbox's own server (not envd) by headers on
        // the data plane's URL: it is reached as its preview URL would be.
        let kind = match (kind, sandpit_e2b::sandbox_port(req.headers())) {
            (HostKind::Api, Some((sandbox_id, port))) => HostKind::Preview { port, sandbox_id },
            (kind, _) => kind,
        };
        match kind {
            HostKind::Api => {
                let mut req = req.map(Body::new);
                // The dashboard counts sign-ups per client address.
                req.extensions_mut().insert(sandpit_web::ClientAddr(peer));
                let router = match sandpit_e2b::is_data_plane(req.headers(), req.uri()) {
                    true => &self.e2b_data,
                    false => &self.api,
                };
                match router.clone().oneshot(req).await {
                    Ok(r) => r,
                    Err(never) => match never {},
                }
            }
            HostKind::Invalid => error_page(&PreviewError::UnknownHost),
            HostKind::Preview { port, sandbox_id } => {
                let authority = authority.unwrap_or_default();
                self.proxy
                    .serve(req, &sandbox_id, port, &authority, peer)
                    .await
            }
        }
    }
}

/// A TLS acceptor from PEM files (certificate chain, private key).
pub fn tls_acceptor(cert: &Path, key: &Path) -> Result<TlsAcceptor> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let certs = CertificateDer::pem_file_iter(cert)
        .with_context(|| format!("reading the certificate {}", cert.display()))?
        .collect::<std::result::Result<Vec<_>, _>>()
        .with_context(|| format!("parsing the certificate {}", cert.display()))?;
    let key = PrivateKeyDer::from_pem_file(key)
        .with_context(|| format!("reading the private key {}", key.display()))?;
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .context("TLS protocol versions")?
    .with_no_client_auth()
    .with_single_cert(certs, key)
    .context("the TLS certificate and key do not fit together")?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}
