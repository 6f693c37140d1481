//! Preview URLs: which host names are preview URLs, and the connections
//! behind them.
//!
//! A preview URL is `{scheme}://{port}-{sandbox_id}.{domain}`. Anyone who has
//! it can open it, so the host name is the only input that picks a sandbox,
//! and [`parse_host`] is the one place that reads it: strict (one label, a
//! canonical port number, an id of id characters, the configured domain and
//! port, nothing else), so no odd spelling reaches another sandbox or the
//! API by accident. [`preview_url`] is the one place that writes it.
//!
//! A connection ([`PreviewConn`]) is a tunnel over the sandbox's agent
//! channel, counted (bytes in and out, per sandbox, flushed to the store by
//! the service) and registered, so closing the port or ending the sandbox
//! cuts every connection at once.
//!
//! Anyone with a URL can also flood it, so each sandbox's previews are
//! bounded ([`PreviewLimits`]): open connections to the guest (each holds a
//! tunnel and two threads of the agent; past the bound a request waits a
//! few seconds for one, then gets 503) and requests
//! per second (a token bucket; past it, 429 with `Retry-After`). A request's
//! check (the sandbox runs, the port is exposed) is remembered for a second
//! ([`CHECK_REMEMBERED`]), so a busy preview does not cost a query per
//! request; closing the port or ending the sandbox forgets it at once.

use sandpit_host::machines::{Closer, Duplex, Tunnel};
use std::collections::HashMap;
use std::io;
use std::net::Ipv4Addr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use time::OffsetDateTime;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// What the preview proxy needs of the service: the way into a sandbox by
/// its URL, which involves no account (anyone who has the URL may use it).
#[async_trait::async_trait]
pub trait PreviewGate: Send + Sync {
    /// Can `port` of sandbox `id` be served through its preview URL now,
    /// and to whom? Returns the node that holds the sandbox and the port's
    /// access.
    async fn check_preview(&self, id: &str, port: u16) -> Result<Admitted, PreviewError>;

    /// Takes one request of the allowance of sandbox `id`'s preview URLs
    /// (after [`PreviewGate::check_preview`]: only live sandboxes have one).
    fn admit_preview_request(&self, id: &str) -> Result<(), PreviewError>;

    /// A connection to `port` of sandbox `id` for its preview URL: checked
    /// as [`PreviewGate::check_preview`], bounded in time, counted as the
    /// sandbox's preview traffic, and cut when the port is closed or the
    /// sandbox ends.
    async fn open_preview(&self, id: &str, port: u16) -> Result<PreviewConn, PreviewError>;
}

/// The URL of `port` of sandbox `id`.
pub fn preview_url(scheme: &str, domain: &str, port: u16, id: &str) -> String {
    format!("{scheme}://{port}-{id}.{domain}")
}

/// What a request's host names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostKind {
    /// Not under the preview domain: the API.
    Api,
    /// A preview URL: this port of this sandbox.
    Preview { port: u16, sandbox_id: String },
    /// Under the preview domain, but not a preview URL (answer 404).
    Invalid,
}

/// Longest sandbox id accepted in a host name.
const MAX_ID_LEN: usize = 64;

/// Split `host[:port]` (IPv6 literals in brackets) into name and port text.
fn split_port(s: &str) -> (&str, Option<&str>) {
    if s.starts_with('[') {
        return match s.find(']') {
            Some(end) => match s[end + 1..].strip_prefix(':') {
                Some(p) => (&s[..=end], Some(p)),
                None => (&s[..=end], None),
            },
            None => (s, None),
        };
    }
    match s.rsplit_once(':') {
        Some((h, p)) => (h, Some(p)),
        None => (s, None),
    }
}

/// A port as written canonically: 1 to 65535, no sign, no leading zero.
fn canonical_port(s: &str) -> Option<u16> {
    if s.is_empty() || s.len() > 5 || s.starts_with('0') || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse::<u16>().ok()
}

/// Whether `domain` can be a preview domain: a DNS name (URLs are
/// `{port}-{id}.{domain}`, so no IP address, scheme or path), with an
/// optional canonical `:port`. Says what is wrong, for a configuration error.
pub fn check_domain(domain: &str) -> Result<(), String> {
    let (name, port) = split_port(domain);
    if let Some(p) = port {
        if canonical_port(p).is_none() {
            return Err(format!("{p:?} is not a port (1-65535, no leading zero)"));
        }
    }
    let name = name.strip_suffix('.').unwrap_or(name);
    if name.starts_with('[') || name.parse::<Ipv4Addr>().is_ok() {
        return Err("an IP address cannot have names under it; use a DNS name \
                    (`localhost` for this machine)"
            .into());
    }
    if name.is_empty() || name.len() > 253 {
        return Err("a DNS name is 1 to 253 characters".into());
    }
    for label in name.split('.') {
        let ok = (1..=63).contains(&label.len())
            && label
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-')
            && !label.starts_with('-')
            && !label.ends_with('-');
        if !ok {
            return Err(format!(
                "{label:?} is not a DNS label (letters, digits and inner hyphens, 1 to 63; \
                 no scheme, path or wildcard: `previews.example.com`, not `https://*.previews.example.com/`)"
            ));
        }
    }
    Ok(())
}

/// Classify the `Host` header (or HTTP/2 `:authority`) of a request.
///
/// `domain` is the configured preview domain, with a `:port` when URLs
/// carry one (`localhost:8080`); `scheme` gives the port a host without one
/// means (80 or 443). Case does not matter; one trailing dot on the name is
/// allowed (it is the same DNS name). The port must be the domain's.
pub fn parse_host(host: &str, domain: &str, scheme: &str) -> HostKind {
    let default_port = if scheme.eq_ignore_ascii_case("https") {
        "443"
    } else {
        "80"
    };
    let host = host.to_ascii_lowercase();
    let domain = domain.to_ascii_lowercase();
    let (name, port) = split_port(&host);
    let (dname, dport) = split_port(&domain);
    let name = name.strip_suffix('.').unwrap_or(name);
    let dname = dname.strip_suffix('.').unwrap_or(dname);
    if name.is_empty() || name.starts_with('[') || name.parse::<Ipv4Addr>().is_ok() {
        return HostKind::Api;
    }
    let Some(label) = name
        .strip_suffix(dname)
        .and_then(|rest| rest.strip_suffix('.'))
    else {
        return HostKind::Api;
    };
    // Under the preview domain from here on: anything wrong is a 404.
    let port_ok = match port {
        Some(p) => {
            canonical_port(p).map(|p| p.to_string())
                == Some(dport.unwrap_or(default_port).to_string())
        }
        None => dport.is_none_or(|d| d == default_port),
    };
    if !port_ok {
        return HostKind::Invalid;
    }
    let Some((p, id)) = label.split_once('-') else {
        return HostKind::Invalid;
    };
    let id_ok = !id.is_empty()
        && id.len() <= MAX_ID_LEN
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    match (canonical_port(p), id_ok) {
        (Some(port), true) => HostKind::Preview {
            port,
            sandbox_id: id.to_string(),
        },
        _ => HostKind::Invalid,
    }
}

/// Why a preview request cannot be served, each with its own page.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PreviewError {
    /// not a preview URL of this server
    #[error("there is no preview at this address")]
    UnknownHost,
    /// no sandbox has this id
    #[error("there is no sandbox {0}")]
    NoSuchSandbox(String),
    /// the sandbox ended; its URLs stopped with it
    #[error("sandbox {id} is gone ({reason})")]
    Gone { id: String, reason: String },
    /// the port is not exposed (never was, or was closed)
    #[error("port {port} of sandbox {id} is not exposed")]
    PortClosed { id: String, port: u16 },
    /// nothing listens on the port in the guest
    #[error("port {port} in sandbox {id} is not listening yet")]
    NotListening { id: String, port: u16 },
    /// the connection to the guest's server took too long
    #[error("connecting to port {port} in sandbox {id} timed out")]
    Timeout { id: String, port: u16 },
    /// the sandbox cannot be reached right now
    #[error("sandbox {id} cannot be reached right now: {message}")]
    Unavailable { id: String, message: String },
    /// the sandbox's previews are taking more requests than they may
    #[error("sandbox {id} takes at most {per_second} preview requests a second")]
    TooManyRequests { id: String, per_second: u32 },
    /// the sandbox's previews hold as many connections as they may
    #[error("sandbox {id} has {max} preview connections open, its most")]
    TooManyConnections { id: String, max: u32 },
    /// the port is private and the request proved no right to it (401, or
    /// 403 for an E2B sandbox made private whole)
    #[error("port {port} of sandbox {id} is private")]
    Private { id: String, port: u16, status: u16 },
}

impl PreviewError {
    /// The HTTP status of this error (the one mapping).
    pub fn http_status(&self) -> u16 {
        match self {
            PreviewError::UnknownHost
            | PreviewError::NoSuchSandbox(_)
            | PreviewError::PortClosed { .. } => 404,
            PreviewError::Gone { .. } => 410,
            PreviewError::NotListening { .. } => 502,
            PreviewError::Timeout { .. } => 504,
            PreviewError::Unavailable { .. } | PreviewError::TooManyConnections { .. } => 503,
            PreviewError::TooManyRequests { .. } => 429,
            PreviewError::Private { status, .. } => *status,
        }
    }

    /// A sentence for a person reading the page, saying what to do.
    pub fn advice(&self) -> &'static str {
        match self {
            PreviewError::UnknownHost | PreviewError::NoSuchSandbox(_) => {
                "Check the address: a preview URL looks like PORT-SANDBOX_ID.DOMAIN."
            }
            PreviewError::Gone { .. } => {
                "A sandbox's preview URLs stop when it is destroyed or expires."
            }
            PreviewError::PortClosed { .. } => "Expose the port (expose_port) to get its URL.",
            PreviewError::NotListening { .. } => {
                "Start the server inside the sandbox (on 127.0.0.1 or 0.0.0.0), then reload."
            }
            PreviewError::Timeout { .. } => {
                "The server inside the sandbox did not accept the connection in time; reload."
            }
            PreviewError::Unavailable { .. }
            | PreviewError::TooManyRequests { .. }
            | PreviewError::TooManyConnections { .. } => "Try again in a moment.",
            PreviewError::Private { .. } => {
                "Send the sandbox's traffic token in the x-sandpit-traffic-token header, or open \
                 a signed URL of the port (its owner makes one)."
            }
        }
    }
}

/// Bytes carried through one sandbox's preview URLs and not yet stored.
#[derive(Debug, Default)]
pub(crate) struct Traffic {
    pub(crate) bytes_in: AtomicU64,
    pub(crate) bytes_out: AtomicU64,
}

/// A passed preview check: when, the sandbox's expiry, what was found.
type Checked = (Instant, OffsetDateTime, Admitted);

/// What a passed preview check found: the sandbox's node, and who may use
/// the port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admitted {
    pub host: String,
    pub access: crate::private_preview::PreviewAccess,
}

/// A sandbox's open preview connections: serial -> (port, closer).
type OpenConns = HashMap<u64, (u16, Closer)>;

/// How much of the preview proxy one sandbox may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PreviewLimits {
    /// Connections to the guest open at once (pooled idle ones included).
    pub max_connections: u32,
    /// Requests per second, on average; twice as many may come in a burst.
    pub requests_per_second: u32,
}

/// How long a new connection waits for one of its sandbox's to be free.
pub const CONNECTION_WAIT: Duration = Duration::from_secs(5);

/// How long a passed check of a (sandbox, port) is trusted.
pub const CHECK_REMEMBERED: Duration = Duration::from_secs(1);

/// A token bucket: `rate` tokens a second, at most `2 * rate` kept.
#[derive(Debug)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl Bucket {
    fn new(rate: u32) -> Bucket {
        Bucket {
            tokens: 2.0 * f64::from(rate),
            at: Instant::now(),
        }
    }

    fn take(&mut self, rate: u32) -> bool {
        let now = Instant::now();
        let rate = f64::from(rate);
        self.tokens =
            (self.tokens + now.duration_since(self.at).as_secs_f64() * rate).min(2.0 * rate);
        self.at = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// What one live sandbox's previews may still take.
struct Allowance {
    requests: Bucket,
    connections: Arc<Semaphore>,
}

/// Open preview connections and unflushed traffic, per sandbox.
pub(crate) struct Previews {
    limits: PreviewLimits,
    traffic: Mutex<HashMap<String, Arc<Traffic>>>,
    open: Mutex<HashMap<String, OpenConns>>,
    /// Per live sandbox whose previews were used.
    allowances: Mutex<HashMap<String, Allowance>>,
    /// Passed checks: (sandbox, port) -> (when, the sandbox's expiry, the
    /// node that holds it).
    checked: Mutex<HashMap<(String, u16), Checked>>,
    /// Bumped by every close: a check that began before a close must not be
    /// remembered after it.
    closes: AtomicU64,
    /// Connection attempts in flight per (sandbox, port) are limited: a
    /// burst of new connections would overflow a small server's listen
    /// backlog (Python's is 5), and a dropped SYN costs a second or more.
    connecting: Mutex<HashMap<(String, u16), Arc<Semaphore>>>,
    serial: AtomicU64,
}

/// Connection attempts in flight per (sandbox, port).
const CONNECTS_IN_FLIGHT: usize = 4;

impl Previews {
    pub(crate) fn new(limits: PreviewLimits) -> Previews {
        Previews {
            limits,
            traffic: Mutex::default(),
            open: Mutex::default(),
            allowances: Mutex::default(),
            checked: Mutex::default(),
            closes: AtomicU64::new(0),
            connecting: Mutex::default(),
            serial: AtomicU64::new(0),
        }
    }

    /// A number to give [`Previews::remember_check`]: read it before the
    /// check's queries.
    pub(crate) fn check_epoch(&self) -> u64 {
        self.closes.load(Ordering::SeqCst)
    }

    /// Did `port` of `id` pass its check less than [`CHECK_REMEMBERED`] ago
    /// (and has the sandbox not expired since)?
    /// The node of a sandbox whose `port` passed a check lately.
    pub(crate) fn recently_checked(&self, id: &str, port: u16) -> Option<Admitted> {
        let checked = self.checked.lock().unwrap();
        checked
            .get(&(id.to_string(), port))
            .filter(|(at, expires, _)| {
                at.elapsed() < CHECK_REMEMBERED && *expires > OffsetDateTime::now_utc()
            })
            .map(|(_, _, admitted)| admitted.clone())
    }

    /// Remember that `port` of `id` passed a check that began at `epoch`,
    /// unless something was closed since.
    pub(crate) fn remember_check(
        &self,
        id: &str,
        port: u16,
        expires: OffsetDateTime,
        admitted: &Admitted,
        epoch: u64,
    ) {
        let mut checked = self.checked.lock().unwrap();
        if self.closes.load(Ordering::SeqCst) == epoch {
            checked.insert(
                (id.to_string(), port),
                (Instant::now(), expires, admitted.clone()),
            );
        }
    }

    /// Take one request of `id`'s allowance.
    pub(crate) fn admit_request(&self, id: &str) -> Result<(), PreviewError> {
        let rate = self.limits.requests_per_second;
        let mut allowances = self.allowances.lock().unwrap();
        let a = allowances
            .entry(id.to_string())
            .or_insert_with(|| self.allowance());
        if a.requests.take(rate) {
            Ok(())
        } else {
            Err(PreviewError::TooManyRequests {
                id: id.to_string(),
                per_second: rate,
            })
        }
    }

    /// Take one of `id`'s connections, given back when the permit drops;
    /// wait [`CONNECTION_WAIT`] at most for one. (Meanwhile the proxy's
    /// pool hands the request any connection that becomes idle.)
    pub(crate) async fn admit_connection(
        &self,
        id: &str,
    ) -> Result<OwnedSemaphorePermit, PreviewError> {
        let connections = self
            .allowances
            .lock()
            .unwrap()
            .entry(id.to_string())
            .or_insert_with(|| self.allowance())
            .connections
            .clone();
        let busy = || PreviewError::TooManyConnections {
            id: id.to_string(),
            max: self.limits.max_connections,
        };
        match tokio::time::timeout(CONNECTION_WAIT, connections.acquire_owned()).await {
            Ok(Ok(permit)) => Ok(permit),
            _ => Err(busy()),
        }
    }

    fn allowance(&self) -> Allowance {
        Allowance {
            requests: Bucket::new(self.limits.requests_per_second),
            connections: Arc::new(Semaphore::new(self.limits.max_connections as usize)),
        }
    }

    pub(crate) fn traffic(&self, id: &str) -> Arc<Traffic> {
        self.traffic
            .lock()
            .unwrap()
            .entry(id.to_string())
            .or_default()
            .clone()
    }

    /// Unflushed traffic of a sandbox (in, out), without taking it.
    pub(crate) fn pending(&self, id: &str) -> (u64, u64) {
        self.traffic
            .lock()
            .unwrap()
            .get(id)
            .map(|t| {
                (
                    t.bytes_in.load(Ordering::Relaxed),
                    t.bytes_out.load(Ordering::Relaxed),
                )
            })
            .unwrap_or_default()
    }

    /// Take every sandbox's unflushed traffic.
    pub(crate) fn take_all(&self) -> Vec<(String, u64, u64)> {
        self.traffic
            .lock()
            .unwrap()
            .iter()
            .map(|(id, t)| {
                (
                    id.clone(),
                    t.bytes_in.swap(0, Ordering::Relaxed),
                    t.bytes_out.swap(0, Ordering::Relaxed),
                )
            })
            .filter(|(_, i, o)| *i > 0 || *o > 0)
            .collect()
    }

    /// Give back traffic that could not be stored.
    pub(crate) fn restore(&self, id: &str, bytes_in: u64, bytes_out: u64) {
        let t = self.traffic(id);
        t.bytes_in.fetch_add(bytes_in, Ordering::Relaxed);
        t.bytes_out.fetch_add(bytes_out, Ordering::Relaxed);
    }

    /// Forget a sandbox's counters (after its last flush) and gates.
    pub(crate) fn forget(&self, id: &str) {
        self.traffic.lock().unwrap().remove(id);
        self.connecting.lock().unwrap().retain(|(s, _), _| s != id);
        self.allowances.lock().unwrap().remove(id);
        self.forget_checks(id, None);
    }

    fn forget_checks(&self, id: &str, port: Option<u16>) {
        let mut checked = self.checked.lock().unwrap();
        self.closes.fetch_add(1, Ordering::SeqCst);
        checked.retain(|(s, p), _| s != id || port.is_some_and(|want| *p != want));
    }

    /// The gate connection attempts to `port` of sandbox `id` pass.
    pub(crate) fn connect_gate(&self, id: &str, port: u16) -> Arc<Semaphore> {
        self.connecting
            .lock()
            .unwrap()
            .entry((id.to_string(), port))
            .or_insert_with(|| Arc::new(Semaphore::new(CONNECTS_IN_FLIGHT)))
            .clone()
    }

    pub(crate) fn register(
        self: &Arc<Self>,
        id: &str,
        port: u16,
        tunnel: Tunnel,
        slot: OwnedSemaphorePermit,
    ) -> PreviewConn {
        let serial = self.serial.fetch_add(1, Ordering::Relaxed);
        self.open
            .lock()
            .unwrap()
            .entry(id.to_string())
            .or_default()
            .insert(serial, (port, tunnel.closer));
        PreviewConn {
            stream: tunnel.stream,
            traffic: self.traffic(id),
            registry: Arc::downgrade(self),
            sandbox_id: id.to_string(),
            serial,
            _slot: slot,
        }
    }

    /// Preview connections open now, and opened since the start.
    pub(crate) fn connection_counts(&self) -> (usize, u64) {
        let open = self.open.lock().unwrap().values().map(HashMap::len).sum();
        (open, self.serial.load(Ordering::Relaxed))
    }

    /// Whether sandbox `id` has preview connections open.
    pub(crate) fn has_open(&self, id: &str) -> bool {
        self.open.lock().unwrap().contains_key(id)
    }

    /// Cut the open connections of a sandbox (`port`: of that port only).
    pub(crate) fn close(&self, id: &str, port: Option<u16>) -> usize {
        self.forget_checks(id, port);
        let closers: Vec<Closer> = {
            let mut open = self.open.lock().unwrap();
            let Some(conns) = open.get_mut(id) else {
                return 0;
            };
            let keys: Vec<u64> = conns
                .iter()
                .filter(|(_, (p, _))| port.is_none_or(|want| *p == want))
                .map(|(k, _)| *k)
                .collect();
            let taken = keys
                .iter()
                .filter_map(|k| conns.remove(k))
                .map(|(_, c)| c)
                .collect();
            if conns.is_empty() {
                open.remove(id);
            }
            taken
        };
        for close in &closers {
            close();
        }
        closers.len()
    }

    fn unregister(&self, id: &str, serial: u64) {
        let mut open = self.open.lock().unwrap();
        if let Some(conns) = open.get_mut(id) {
            conns.remove(&serial);
            if conns.is_empty() {
                open.remove(id);
            }
        }
    }
}

/// A connection to a port of a sandbox through its preview URL: a byte
/// stream to the server in the guest, counted as preview traffic.
pub struct PreviewConn {
    stream: Box<dyn Duplex>,
    traffic: Arc<Traffic>,
    registry: std::sync::Weak<Previews>,
    sandbox_id: String,
    serial: u64,
    /// One of the sandbox's preview connections, while this one is open.
    _slot: OwnedSemaphorePermit,
}

impl Drop for PreviewConn {
    fn drop(&mut self) {
        if let Some(r) = self.registry.upgrade() {
            r.unregister(&self.sandbox_id, self.serial);
        }
    }
}

impl AsyncRead for PreviewConn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.stream).poll_read(cx, buf);
        let n = buf.filled().len() - before;
        self.traffic
            .bytes_out
            .fetch_add(n as u64, Ordering::Relaxed);
        r
    }
}

impl AsyncWrite for PreviewConn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.stream).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = r {
            self.traffic.bytes_in.fetch_add(n as u64, Ordering::Relaxed);
        }
        r
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const D: &str = "localhost:8080";

    fn preview(port: u16, id: &str) -> HostKind {
        HostKind::Preview {
            port,
            sandbox_id: id.into(),
        }
    }

    #[test]
    fn preview_domains_are_dns_names_with_an_optional_port() {
        for ok in [
            "localhost:8080",
            "localhost",
            "previews.example.com",
            "a-b.example.",
            "x.y:443",
        ] {
            assert_eq!(check_domain(ok), Ok(()), "{ok}");
        }
        for (bad, why) in [
            ("127.0.0.1:8080", "IP address"),
            ("[::1]:8080", "IP address"),
            ("https://previews.example.com", "not a port"),
            ("*.previews.example.com", "not a DNS label"),
            ("previews.example.com/x", "not a DNS label"),
            ("localhost:08080", "not a port"),
            ("localhost:", "not a port"),
            ("-a.example.com", "not a DNS label"),
            ("a..b", "not a DNS label"),
            ("", "1 to 253"),
        ] {
            let e = check_domain(bad).unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }

    #[test]
    fn a_bucket_takes_a_burst_of_twice_its_rate_then_refills() {
        let mut b = Bucket::new(5);
        assert_eq!((0..20).filter(|_| b.take(5)).count(), 10);
        b.at -= Duration::from_millis(400);
        assert!(b.take(5), "two tokens came back in 400 ms");
        b.at -= Duration::from_secs(10);
        assert_eq!(
            (0..20).filter(|_| b.take(5)).count(),
            10,
            "at most a burst kept"
        );
    }

    #[test]
    fn reads_the_urls_it_writes() {
        let url = preview_url("http", D, 8000, "sbx_abc");
        assert_eq!(url, "http://8000-sbx_abc.localhost:8080");
        let host = url.strip_prefix("http://").unwrap();
        assert_eq!(parse_host(host, D, "http"), preview(8000, "sbx_abc"));
    }

    #[test]
    fn tells_api_from_preview_from_nonsense() {
        let p = |h| parse_host(h, D, "http");
        assert_eq!(p("localhost:8080"), HostKind::Api);
        assert_eq!(p("127.0.0.1:8080"), HostKind::Api);
        assert_eq!(p("[::1]:8080"), HostKind::Api);
        assert_eq!(p("example.com"), HostKind::Api);
        assert_eq!(p("8000-sbx_a.localhostx:8080"), HostKind::Api);
        assert_eq!(p("8000-sbx_a.xlocalhost:8080"), HostKind::Api);
        // Not a DNS name under the domain at all.
        assert_eq!(p("8000-sbx_a.localhost..:8080"), HostKind::Api);
        assert_eq!(p("8000-SBX_A.LocalHost:8080"), preview(8000, "sbx_a"));
        assert_eq!(p("8000-sbx_a.localhost.:8080"), preview(8000, "sbx_a"));
        assert_eq!(p("65535-sbx_a.localhost:8080"), preview(65535, "sbx_a"));
        for bad in [
            "8000-sbx_a.localhost:8081",
            "8000-sbx_a.localhost",
            "8000-sbx_a.localhost:08080",
            "8000-sbx_a.localhost:",
            "08000-sbx_a.localhost:8080",
            "0-sbx_a.localhost:8080",
            "65536-sbx_a.localhost:8080",
            "+80-sbx_a.localhost:8080",
            "8000-.localhost:8080",
            "-sbx_a.localhost:8080",
            "8000sbx_a.localhost:8080",
            "8000-sbx_a..localhost:8080",
            ".localhost:8080",
            "8000-sbx_b.8000-sbx_a.localhost:8080",
            "8000-sbx-a.localhost:8080",
            "8000-sbx_a%2e.localhost:8080",
            "u@8000-sbx_a.localhost:8080",
        ] {
            assert_eq!(p(bad), HostKind::Invalid, "{bad}");
        }
        // Without a port in the domain, the scheme's default port.
        assert_eq!(
            parse_host("80-sbx_a.p.example.com:443", "p.example.com", "https"),
            preview(80, "sbx_a")
        );
        assert_eq!(
            parse_host("80-sbx_a.p.example.com", "p.example.com", "https"),
            preview(80, "sbx_a")
        );
        assert_eq!(
            parse_host("80-sbx_a.p.example.com:80", "p.example.com", "https"),
            HostKind::Invalid
        );
        // An IP literal is never a preview, even with a numeric domain.
        assert_eq!(parse_host("1.2.3.4", "3.4", "http"), HostKind::Api);
    }

    fn id() -> impl Strategy<Value = String> {
        "sbx_[a-z2-7]{24}"
    }

    proptest! {
        /// Every URL expose_port hands out leads back to its port and sandbox,
        /// whatever the case and with or without a trailing dot.
        #[test]
        fn every_url_parses_back(port in 1u16.., id in id(), upper in any::<bool>(), dot in any::<bool>()) {
            let url = preview_url("http", D, port, &id);
            let mut host = url.strip_prefix("http://").unwrap().to_string();
            if dot { host = host.replace("localhost:", "localhost.:"); }
            if upper { host = host.to_uppercase(); }
            prop_assert_eq!(parse_host(&host, D, "http"), preview(port, &id));
        }

        /// Whatever the host, a preview it names is the one canonical
        /// spelling of that name: no other text reaches a sandbox.
        #[test]
        fn only_canonical_names_reach_a_sandbox(host in prop_oneof![
            "[0-9a-zA-Z_.:@%\\[\\]-]{0,40}",
            "[0-9]{1,6}-[a-zA-Z0-9_.-]{1,30}\\.(localhost|LOCALHOST|localhost\\.|localhost\\.\\.)(:[0-9]{0,6})?",
        ]) {
            if let HostKind::Preview { port, sandbox_id } = parse_host(&host, D, "http") {
                let canonical = format!("{port}-{sandbox_id}.{D}");
                let normal = host.to_ascii_lowercase().replace("localhost.:", "localhost:");
                prop_assert_eq!(normal, canonical);
            }
        }

        /// Another domain (or a domain merely ending like ours) is never a preview.
        #[test]
        fn other_domains_are_not_previews(port in 1u16.., id in id(), other in "[a-z]{1,10}") {
            prop_assume!(other != "localhost");
            let host = format!("{port}-{id}.{other}:8080");
            prop_assert_eq!(parse_host(&host, D, "http"), HostKind::Api);
            let host = format!("{port}-{id}.{other}localhost:8080");
            prop_assert_eq!(parse_host(&host, D, "http"), HostKind::Api);
        }

        /// Ports with leading zeros, out of range, or odd are never a preview.
        #[test]
        fn odd_ports_are_rejected(n in 65536u32..1_000_000, z in 1u16.., id in id()) {
            let host = format!("{n}-{id}.{D}");
            prop_assert_eq!(parse_host(&host, D, "http"), HostKind::Invalid);
            let host = format!("0{z}-{id}.{D}");
            prop_assert_eq!(parse_host(&host, D, "http"), HostKind::Invalid);
        }
    }
}
