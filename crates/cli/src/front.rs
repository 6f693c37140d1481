//! The front door of `sandpit serve`: one listener, optionally TLS
//! (rustls, ALPN h2 and http/1.1), HTTP/1.1 and HTTP/2 on every connection,
//! and one decision per request: a preview host goes to the preview proxy,
//! anything else to the API router.
//!
//! Why one listener: preview URLs must work on a machine with nothing but
//! this server (`http://8000-sbx_x.localhost:8080`), so they share its port;
//! the host name tells them apart ([`sandpit_core::preview::parse_host`]).

use crate::proxy::{error_page, Proxy};
use anyhow::{Context, Result};
use axum::body::Body;
use axum::Router;
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use sandpit_core::preview::{parse_host, HostKind, PreviewError};
use std::convert::Infallible;
use std::future::Future;
use std::net::IpAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio_rustls::rustls;
use tokio_rustls::TlsAcceptor;
use tower::ServiceExt;

/// How long a TLS handshake may take.
const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(15);
/// How long shutdown waits for requests in flight.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(20);

/// Where requests go.
pub struct Front {
    pub api: Router,
    pub proxy: Proxy,
    pub preview_domain: String,
    pub preview_scheme: String,
}

impl Front {
    async fn handle(self: Arc<Self>, req: Request<Incoming>, peer: IpAddr) -> Response<Body> {
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
        match kind {
            HostKind::Api => match self.api.clone().oneshot(req.map(Body::new)).await {
                Ok(r) => r,
                Err(never) => match never {},
            },
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

/// Accept connections until `shutdown` resolves, then let requests in
/// flight finish (up to a grace period).
pub async fn serve(
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    front: Arc<Front>,
    shutdown: impl Future<Output = ()>,
) -> Result<()> {
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut conns = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        while conns.try_join_next().is_some() {}
        let (tcp, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    // Out of descriptors and the like: wait, do not spin.
                    tracing::warn!("accept: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let _ = tcp.set_nodelay(true);
        let (front, tls, stop) = (front.clone(), tls.clone(), stop_rx.clone());
        conns.spawn(async move {
            match tls {
                None => serve_conn(TokioIo::new(tcp), peer.ip(), front, stop).await,
                Some(tls) => {
                    match tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, tls.accept(tcp)).await {
                        Ok(Ok(stream)) => {
                            serve_conn(TokioIo::new(stream), peer.ip(), front, stop).await
                        }
                        Ok(Err(e)) => tracing::debug!("TLS handshake: {e}"),
                        Err(_) => tracing::debug!("TLS handshake timed out"),
                    }
                }
            }
        });
    }
    drop(listener);
    let _ = stop_tx.send(true);
    let drained = async { while conns.join_next().await.is_some() {} };
    if tokio::time::timeout(SHUTDOWN_GRACE, drained).await.is_err() {
        conns.abort_all();
    }
    Ok(())
}

async fn serve_conn<I>(io: I, peer: IpAddr, front: Arc<Front>, mut stop: watch::Receiver<bool>)
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let service = hyper::service::service_fn(move |req| {
        let front = front.clone();
        async move { Ok::<_, Infallible>(front.handle(req, peer).await) }
    });
    let builder = auto::Builder::new(TokioExecutor::new());
    let conn = builder
        .serve_connection_with_upgrades(io, service)
        .into_owned();
    tokio::pin!(conn);
    let stopped = async move {
        let _ = stop.wait_for(|s| *s).await;
    };
    let r = tokio::select! {
        r = conn.as_mut() => r,
        _ = stopped => {
            conn.as_mut().graceful_shutdown();
            conn.await
        }
    };
    if let Err(e) = r {
        tracing::debug!("connection: {e}");
    }
}
