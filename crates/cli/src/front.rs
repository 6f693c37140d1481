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
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
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

/// The loopback addresses a client on this machine may reach `addr` by,
/// beyond `addr` itself: `localhost` and every `*.localhost` resolve to
/// both `::1` and `127.0.0.1` (nss-myhostname, browsers), and clients try
/// `::1` first. So a server on the IPv4 loopback or wildcard also listens
/// on `::1`, and one on `::1` on `127.0.0.1`; the IPv6 wildcard already
/// covers both, and a specific address is the operator's choice.
pub fn loopback_companions(addr: SocketAddr) -> Vec<SocketAddr> {
    let port = addr.port();
    match addr.ip() {
        IpAddr::V4(ip) if ip.is_loopback() || ip.is_unspecified() => {
            vec![SocketAddr::from((Ipv6Addr::LOCALHOST, port))]
        }
        IpAddr::V6(ip) if ip.is_loopback() => vec![SocketAddr::from((Ipv4Addr::LOCALHOST, port))],
        _ => Vec::new(),
    }
}

/// Bind `listen` and its [`loopback_companions`] (on the port `listen` got).
/// A companion that cannot be bound (no IPv6 on this host, the port taken
/// there) is logged, not fatal: the main address works.
pub async fn bind(listen: &str) -> Result<Vec<TcpListener>> {
    let first = TcpListener::bind(listen)
        .await
        .with_context(|| format!("listening on {listen}"))?;
    let addr = first.local_addr()?;
    let mut listeners = vec![first];
    for other in loopback_companions(addr) {
        match TcpListener::bind(other).await {
            Ok(l) => listeners.push(l),
            Err(e) => tracing::warn!(
                "also listening on {other} failed ({e}): clients that resolve \
                 `localhost` names to it will not reach this server"
            ),
        }
    }
    Ok(listeners)
}

/// Accept connections on every listener until `shutdown` resolves, then let
/// requests in flight finish (up to a grace period).
pub async fn serve(
    listeners: Vec<TcpListener>,
    tls: Option<TlsAcceptor>,
    front: Arc<Front>,
    shutdown: impl Future<Output = ()>,
) -> Result<()> {
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut conns = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        while conns.try_join_next().is_some() {}
        // Accepting is cancel-safe: the accepts not chosen lose nothing.
        let accept_any =
            futures::future::select_all(listeners.iter().map(|l| Box::pin(l.accept())));
        let (tcp, peer) = tokio::select! {
            (r, _, _) = accept_any => match r {
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
    drop(listeners);
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

/// A preview host name of `domain` (which may carry `:PORT`), and the port
/// its URLs use: what the start-up check resolves.
fn probe_name(domain: &str, scheme: &str) -> (String, u16) {
    let default_port = if scheme == "https" { 443 } else { 80 };
    let (host, port) = match domain.rsplit_once(':') {
        Some((h, p)) if p.parse::<u16>().is_ok() => (h, p.parse().unwrap_or(default_port)),
        _ => (domain, default_port),
    };
    (format!("8000-sbx_resolvecheck.{host}"), port)
}

/// Does a listener on `on` take connections to `ip`?
fn listens_for(on: SocketAddr, ip: IpAddr) -> bool {
    on.ip() == ip || (on.ip().is_unspecified() && on.is_ipv4() == ip.is_ipv4())
}

/// What an operator must do so that programs on this machine, which ask the
/// system resolver (Python, Node, Go, wget; not browsers or curl, which
/// resolve `*.localhost` themselves), can open preview URLs; `None` when
/// nothing. `resolved` is what the resolver answered for `name`.
pub fn preview_name_advice(
    name: &str,
    resolved: &std::io::Result<Vec<IpAddr>>,
    listening: &[SocketAddr],
) -> Option<String> {
    let local = name.ends_with(".localhost");
    let addrs = match resolved {
        Err(e) if local => {
            return Some(format!(
                "preview host names such as {name} do not resolve on this machine ({e}): programs \
                 that use the system resolver (Python, Node, Go, wget) cannot open preview URLs, \
                 though browsers and curl can. Install libnss-myhostname (`apt-get install \
                 libnss-myhostname`) and make sure the `hosts:` line of /etc/nsswitch.conf lists \
                 `myhostname`, or configure [preview] domain with a wildcard DNS record"
            ))
        }
        Err(e) => {
            let domain = name.split_once('.').map_or(name, |(_, d)| d);
            return Some(format!(
                "preview host names such as {name} do not resolve ({e}): point a wildcard DNS \
                 record *.{domain} at this server"
            ));
        }
        Ok(addrs) => addrs,
    };
    // Only loopback answers can be checked from here (a public name may
    // reach us through NAT or a load balancer).
    let unserved: Vec<String> = addrs
        .iter()
        .filter(|ip| ip.is_loopback() && !listening.iter().any(|l| listens_for(*l, **ip)))
        .map(IpAddr::to_string)
        .collect();
    if unserved.is_empty() {
        None
    } else {
        Some(format!(
            "preview host names such as {name} resolve to {}, where this server does not \
             listen (it listens on {}): clients that try those addresses will not reach it",
            unserved.join(", "),
            listening
                .iter()
                .map(SocketAddr::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ))
    }
}

/// Resolve a preview host name the way clients on this machine will, and
/// log what to fix if they cannot reach this server by it. In the
/// background: a slow resolver delays nothing.
pub fn check_preview_names(domain: &str, scheme: &str, listening: Vec<SocketAddr>) {
    let (name, port) = probe_name(domain, scheme);
    tokio::spawn(async move {
        let lookup = tokio::net::lookup_host((name.as_str(), port));
        let resolved = match tokio::time::timeout(Duration::from_secs(10), lookup).await {
            Ok(r) => r.map(|a| a.map(|s| s.ip()).collect::<Vec<_>>()),
            Err(_) => Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "no answer within 10 s",
            )),
        };
        match preview_name_advice(&name, &resolved, &listening) {
            Some(advice) => tracing::warn!("{advice}"),
            None => tracing::debug!(name, "preview host names resolve to this server"),
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn a_loopback_or_wildcard_listener_also_takes_the_other_loopback() {
        assert_eq!(
            loopback_companions(addr("127.0.0.1:8080")),
            vec![addr("[::1]:8080")]
        );
        assert_eq!(
            loopback_companions(addr("0.0.0.0:8080")),
            vec![addr("[::1]:8080")]
        );
        assert_eq!(
            loopback_companions(addr("[::1]:9")),
            vec![addr("127.0.0.1:9")]
        );
        assert!(loopback_companions(addr("[::]:8080")).is_empty());
        assert!(loopback_companions(addr("192.0.2.7:8080")).is_empty());
    }

    #[test]
    fn the_probe_name_is_a_preview_host_of_the_domain() {
        assert_eq!(
            probe_name("localhost:8080", "http"),
            ("8000-sbx_resolvecheck.localhost".into(), 8080)
        );
        assert_eq!(
            probe_name("preview.example.com", "https"),
            ("8000-sbx_resolvecheck.preview.example.com".into(), 443)
        );
    }

    #[test]
    fn advice_says_what_to_install_or_configure() {
        let listening = [addr("127.0.0.1:8080"), addr("[::1]:8080")];
        let unknown = || Err(std::io::Error::other("Name or service not known"));
        let a = preview_name_advice("8000-x.localhost", &unknown(), &listening).unwrap();
        assert!(
            a.contains("libnss-myhostname") && a.contains("nsswitch.conf"),
            "{a}"
        );
        let a = preview_name_advice("8000-x.p.example.com", &unknown(), &listening).unwrap();
        assert!(a.contains("*.p.example.com"), "{a}");
        let both = Ok(vec!["::1".parse().unwrap(), "127.0.0.1".parse().unwrap()]);
        assert_eq!(
            preview_name_advice("8000-x.localhost", &both, &listening),
            None
        );
        assert_eq!(
            preview_name_advice(
                "8000-x.localhost",
                &both,
                &[addr("0.0.0.0:1"), addr("[::1]:1")]
            ),
            None
        );
        let a = preview_name_advice("8000-x.localhost", &both, &listening[..1]).unwrap();
        assert!(
            a.contains("resolve to ::1,") && !a.contains("127.0.0.1,"),
            "{a}"
        );
        // A public name may reach us through NAT: not judged.
        let public = Ok(vec!["203.0.113.9".parse().unwrap()]);
        assert_eq!(
            preview_name_advice("8000-x.example.com", &public, &listening),
            None
        );
    }
}
