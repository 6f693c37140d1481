//! The listeners of `sandpit serve`, and what bounds their connections.
//!
//! One server is the API, MCP and every preview URL of every tenant, on a
//! public port, so what a client holds open must be bounded, or a few
//! thousand idle or half-sent connections take the process to its
//! descriptor limit and everything stops at once:
//! - a request's head must arrive within `header_timeout_secs` of its
//!   first byte (a connection that sends nothing at all gets no longer
//!   either);
//! - a connection with no request in flight and no byte either way for
//!   `idle_timeout_secs` is closed (HTTP/2 included; a command that runs
//!   silently keeps its request in flight). An HTTP/1.1 connection waits
//!   that long for its next request, longer than clients keep one in their
//!   pools (reqwest and hyper: 90 s), so a client is the one to let go of
//!   an idle connection: a server that closes first races the client's
//!   next request on it, which then fails ("connection closed before
//!   message completed"), as hyper's own header timeout did, since it runs
//!   while a connection waits idle too;
//! - at most `max_connections` are open; one more is answered `503` with
//!   the standard error body (plain HTTP) and closed, so a client learns why,
//!   and the process raises its descriptor limit to fit.
//!
//! The listeners: the configured address, plus the other loopback where
//! `localhost` names can resolve to it ([`loopback_companions`]); at start
//! a preview host name is resolved as clients on this machine will, and what
//! to fix is logged ([`check_preview_names`]).

use crate::front::Front;
use anyhow::{Context, Result};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use serde::Deserialize;
use std::convert::Infallible;
use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;

/// How long a TLS handshake may take.
const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(15);
/// How long shutdown waits for requests in flight.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(20);
/// Descriptors kept for everything but client connections (VM sockets,
/// agent channels, the database, files).
const RESERVED_DESCRIPTORS: u64 = 4096;

/// `[server]` in the config: what bounds client connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ConnectionLimits {
    /// Open client connections at most; one more gets 503 and is closed.
    pub max_connections: usize,
    /// A request's head must arrive within this many seconds of its first
    /// byte.
    pub header_timeout_secs: u64,
    /// A connection with no request in flight and no traffic for this many
    /// seconds is closed (an idle HTTP/1.1 connection waits this long for
    /// its next request).
    pub idle_timeout_secs: u64,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits {
            max_connections: 10_000,
            header_timeout_secs: 30,
            idle_timeout_secs: 120,
        }
    }
}

impl ConnectionLimits {
    /// Raise this process's descriptor limit to its hard limit, and lower
    /// `max_connections` if even that cannot hold them (each is one
    /// descriptor, and a preview connection a tunnel besides).
    pub fn fit_descriptors(mut self) -> Self {
        let limit = raise_descriptor_limit();
        let fits = (limit.saturating_sub(RESERVED_DESCRIPTORS) / 2) as usize;
        if self.max_connections > fits {
            tracing::warn!(
                "[server] max_connections = {} does not fit this process's descriptor limit \
                 ({}); using {fits}",
                self.max_connections,
                limit
            );
            self.max_connections = fits.max(1);
        }
        self
    }
}

pub use sandpit_runtime::host::raise_descriptor_limit;

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
    limits: ConnectionLimits,
    shutdown: impl Future<Output = ()>,
) -> Result<()> {
    let (stop_tx, stop_rx) = watch::channel(false);
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let mut last_refusal_logged: Option<Instant> = None;
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
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            if last_refusal_logged.is_none_or(|t| t.elapsed() > Duration::from_secs(10)) {
                tracing::warn!(
                    "{} client connections are open ([server] max_connections); refusing more",
                    limits.max_connections
                );
                last_refusal_logged = Some(Instant::now());
            }
            if tls.is_none() {
                tokio::spawn(refuse(tcp, limits.max_connections));
            }
            continue;
        };
        let (front, tls, stop) = (front.clone(), tls.clone(), stop_rx.clone());
        conns.spawn(async move {
            let _slot = slot;
            match tls {
                None => serve_conn(tcp, peer.ip(), front, limits, stop).await,
                Some(tls) => {
                    match tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, tls.accept(tcp)).await {
                        Ok(Ok(stream)) => serve_conn(stream, peer.ip(), front, limits, stop).await,
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

/// The answer to a connection past the limit: a 503 with the API's error
/// body, then close. Bounded in time: a client that does not read is dropped.
async fn refuse(mut tcp: TcpStream, limit: usize) {
    let body = serde_json::json!({
        "error": {
            "type": "service_unavailable",
            "message": format!(
                "this server has {limit} connections open, its limit; retry shortly"
            ),
        },
        "request_id": sandpit_host::ids::new_id("req_"),
    })
    .to_string();
    let response = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         retry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let write = async {
        tcp.write_all(response.as_bytes()).await?;
        tcp.shutdown().await
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), write).await;
}

/// A connection's last traffic, in milliseconds since `since` (+1: zero
/// means "nothing yet"); when the head of its next request began to arrive
/// (bytes read with no request in flight, not HTTP/2), likewise; and its
/// requests in flight.
struct Activity {
    since: Instant,
    last_ms: AtomicU64,
    head_ms: AtomicU64,
    in_flight: AtomicUsize,
    http2: std::sync::atomic::AtomicBool,
}

impl Activity {
    fn new() -> Activity {
        Activity {
            since: Instant::now(),
            last_ms: AtomicU64::new(0),
            head_ms: AtomicU64::new(0),
            in_flight: AtomicUsize::new(0),
            http2: std::sync::atomic::AtomicBool::new(false),
        }
    }
    fn now_ms(&self) -> u64 {
        self.since.elapsed().as_millis() as u64 + 1
    }
    fn touch(&self) {
        self.last_ms.store(self.now_ms(), Ordering::Relaxed);
    }
    /// Bytes `read` came in (the connection's first, when `first`).
    fn read(&self, read: &[u8], first: bool) {
        if first && read.starts_with(b"PRI ") {
            self.http2.store(true, Ordering::Relaxed);
        }
        self.touch();
        let waiting = self.in_flight.load(Ordering::SeqCst) == 0;
        if waiting && !self.http2.load(Ordering::Relaxed) {
            let _ =
                self.head_ms
                    .compare_exchange(0, self.now_ms(), Ordering::SeqCst, Ordering::SeqCst);
        }
    }
    /// A request's head arrived: it is in flight.
    fn request_started(&self) {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        self.head_ms.store(0, Ordering::SeqCst);
    }
    fn request_answered(&self) {
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
    /// How long the head of a next request has been arriving, if one is.
    fn head_for(&self) -> Option<Duration> {
        match self.head_ms.load(Ordering::SeqCst) {
            0 => None,
            began => Some(Duration::from_millis(self.now_ms().saturating_sub(began))),
        }
    }
    fn quiet_for(&self) -> Duration {
        let last = Duration::from_millis(self.last_ms.load(Ordering::Relaxed));
        self.since.elapsed().saturating_sub(last)
    }
    fn silent(&self) -> bool {
        self.last_ms.load(Ordering::Relaxed) == 0
    }
}

/// An I/O stream that notes when bytes last moved.
struct Watched<S> {
    inner: S,
    activity: Arc<Activity>,
}

impl<S: AsyncRead + Unpin> AsyncRead for Watched<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            let first = self.activity.silent();
            self.activity.read(&buf.filled()[before..], first);
        }
        r
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Watched<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        r
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        r
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(
        mut self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Serve one connection until it ends, the server stops (graceful), or it
/// has been idle too long (see [`ConnectionLimits`]).
async fn serve_conn<S>(
    stream: S,
    peer: IpAddr,
    front: Arc<Front>,
    limits: ConnectionLimits,
    mut stop: watch::Receiver<bool>,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let activity = Arc::new(Activity::new());
    let io = TokioIo::new(Watched {
        inner: stream,
        activity: activity.clone(),
    });
    let requests = activity.clone();
    let service = hyper::service::service_fn(move |req| {
        let front = front.clone();
        let requests = requests.clone();
        async move {
            requests.request_started();
            let response = front.handle(req, peer).await;
            requests.request_answered();
            Ok::<_, Infallible>(response)
        }
    });
    let mut builder = auto::Builder::new(TokioExecutor::new());
    // Not hyper's header timeout: it runs while a connection waits idle
    // for its next request too (see the module's docs); the loop below
    // times a head from its first byte.
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(None);
    builder.http2().timer(TokioTimer::new());
    let conn = builder
        .serve_connection_with_upgrades(io, service)
        .into_owned();
    tokio::pin!(conn);
    let idle_limit = Duration::from_secs(limits.idle_timeout_secs.max(1));
    let header_limit = Duration::from_secs(limits.header_timeout_secs.max(1));
    let idle = async {
        loop {
            let waiting = activity.in_flight.load(Ordering::SeqCst) == 0;
            // A head that takes too long from its first byte; a client
            // that never sends one gets no longer.
            let head = match activity.head_for() {
                Some(_) if !waiting => None,
                Some(taken) => Some(taken),
                None if activity.silent() => Some(activity.quiet_for()),
                None => None,
            };
            if head.is_some_and(|taken| taken >= header_limit) {
                return;
            }
            let quiet = activity.quiet_for();
            if quiet >= idle_limit && waiting {
                return;
            }
            let next = match head {
                Some(taken) => header_limit.saturating_sub(taken),
                None => idle_limit.saturating_sub(quiet),
            };
            tokio::time::sleep(next.max(Duration::from_millis(100))).await;
        }
    };
    let stopped = async move {
        let _ = stop.wait_for(|s| *s).await;
    };
    let r = tokio::select! {
        r = conn.as_mut() => r,
        _ = stopped => {
            conn.as_mut().graceful_shutdown();
            conn.await
        }
        _ = idle => {
            // Nothing in flight: the connection just ends (HTTP/2 gets a
            // GOAWAY, HTTP/1.1 a close after no request).
            conn.as_mut().graceful_shutdown();
            tokio::time::timeout(Duration::from_secs(5), conn).await.unwrap_or(Ok(()))
        }
    };
    if let Err(e) = r {
        tracing::debug!("connection: {e}");
    }
}

/// A preview host name of `domain` (which may carry `:PORT`), and the port
/// its URLs use: what the start-up check resolves.
pub fn probe_name(domain: &str, scheme: &str) -> (String, u16) {
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
