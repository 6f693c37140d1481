//! One VM's egress proxy: a listener on the host's loopback to which the
//! host redirects that VM's connections to ports 80 and 443 when its lists
//! name hosts (see `vm::guard`). Each connection is looked at
//! ([`super::peek`]), decided ([`super::rules`]), then either refused with
//! a reset, counted and logged with the rule that refused it, or connected
//! and spliced: to the address the guest dialled, or, when its name let it
//! through, to that name's addresses as [`Upstream::resolve`] finds them.
//! An address the operator denies or one of the host's own is never
//! connected to ([`Upstream::forbidden`]): a name an allowed rule matches
//! may well resolve to one.

use super::broker::Broker;
use super::peek::{peek, Peeked, MAX_PEEK};
use super::rules::{Decision, Rules};
use super::terminate::{self, BrokerPath};
use std::future::Future;
use std::io;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// How long a connection may take to say which host it is for; one that
/// says nothing by then (a protocol where the server speaks first) is
/// decided by its address alone.
const PEEK_TIMEOUT: Duration = Duration::from_secs(5);
/// How long connecting to the destination may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

/// Where a redirected connection was going.
pub type OriginalOf = fn(&TcpStream) -> io::Result<SocketAddrV4>;

/// A name's IPv4 addresses, looked up.
pub type Resolve = Arc<
    dyn Fn(String) -> Pin<Box<dyn Future<Output = io::Result<Vec<Ipv4Addr>>> + Send>> + Send + Sync,
>;

/// What the proxy connects with: how names resolve (as the guests' own
/// name servers answer them), which addresses it must never reach, and
/// what it trusts when it reaches a secret's server (see
/// [`terminate::client_config`]).
#[derive(Clone)]
pub struct Upstream {
    pub resolve: Resolve,
    pub forbidden: Arc<dyn Fn(Ipv4Addr) -> bool + Send + Sync>,
    pub tls: Arc<tokio_rustls::rustls::ClientConfig>,
}

/// What a proxy decides and brokers by; replaced whole when the VM's
/// egress changes.
struct Policy {
    rules: Rules,
    broker: Option<Arc<BrokerPath>>,
}

/// A running egress proxy; stops when dropped.
pub struct EgressProxy {
    addr: SocketAddr,
    policy: Arc<RwLock<Policy>>,
    refused: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl EgressProxy {
    /// A proxy for sandbox `sandbox` with `rules` and `broker`'s secrets,
    /// on a free loopback port, for connections the host redirected to it.
    pub async fn start(
        sandbox: &str,
        rules: Rules,
        broker: Option<&Broker>,
        upstream: Upstream,
    ) -> io::Result<EgressProxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let proxy = EgressProxy::serve(listener, sandbox, rules, original_destination, upstream);
        proxy.set_broker(broker);
        Ok(proxy)
    }

    /// A proxy on `listener`, learning each connection's destination with
    /// `original_of`.
    pub fn serve(
        listener: TcpListener,
        sandbox: &str,
        rules: Rules,
        original_of: OriginalOf,
        upstream: Upstream,
    ) -> EgressProxy {
        let addr = listener
            .local_addr()
            .expect("a bound listener has an address");
        let policy = Arc::new(RwLock::new(Policy {
            rules,
            broker: None,
        }));
        let refused = Arc::new(AtomicU64::new(0));
        let (r, n, sandbox) = (policy.clone(), refused.clone(), sandbox.to_string());
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let (r, n, sandbox, up) = (r.clone(), n.clone(), sandbox.clone(), upstream.clone());
                tokio::spawn(async move {
                    if let Err(e) = handle(stream, &r, &n, &sandbox, original_of, &up).await {
                        tracing::debug!(%sandbox, "egress connection: {e}");
                    }
                });
            }
        });
        EgressProxy {
            addr,
            policy,
            refused,
            task,
        }
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// New rules, for the connections from now on.
    pub fn set_rules(&self, rules: Rules) {
        self.policy.write().unwrap().rules = rules;
    }

    /// New secrets to broker (none: `None`, or a broker without its
    /// values), for the connections from now on.
    pub fn set_broker(&self, broker: Option<&Broker>) {
        self.policy.write().unwrap().broker = broker.and_then(BrokerPath::new).map(Arc::new);
    }

    /// When each of its secrets was last put into a request (by name).
    pub fn secrets_last_used(&self) -> std::collections::HashMap<String, time::OffsetDateTime> {
        let broker = self.policy.read().unwrap().broker.clone();
        broker.map(|b| b.last_used()).unwrap_or_default()
    }

    /// Connections refused so far.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }
}

impl Drop for EgressProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn handle(
    mut guest: TcpStream,
    policy: &RwLock<Policy>,
    refused: &AtomicU64,
    sandbox: &str,
    original_of: OriginalOf,
    upstream: &Upstream,
) -> io::Result<()> {
    let to = original_of(&guest)?;
    // What the proxy writes goes at once (a brokered TLS handshake's small
    // records would otherwise wait 40 ms on a delayed ACK).
    guest.set_nodelay(true)?;
    let mut first = Vec::with_capacity(4096);
    let peeked = tokio::time::timeout(PEEK_TIMEOUT, async {
        let mut chunk = [0u8; 4096];
        loop {
            let n = guest.read(&mut chunk).await?;
            if n == 0 {
                return Ok::<_, io::Error>(Peeked::Unnamed);
            }
            first.extend_from_slice(&chunk[..n]);
            match peek(&first) {
                Peeked::NeedMore if first.len() < MAX_PEEK => continue,
                Peeked::NeedMore => return Ok(Peeked::Unnamed),
                other => return Ok(other),
            }
        }
    })
    .await
    .unwrap_or(Ok(Peeked::Unnamed))?;
    let (decision, broker) = {
        let policy = policy.read().unwrap();
        (
            policy.rules.decide(*to.ip(), &peeked),
            policy.broker.clone(),
        )
    };
    let refuse = |rule: &str| {
        refused.fetch_add(1, Ordering::Relaxed);
        tracing::info!(%sandbox, %to, host = ?peeked.name(), %rule, "egress refused");
        // A reset, so the guest's client fails at once.
        guest.set_zero_linger()
    };
    let target = match decision {
        Decision::Refuse { rule } => return refuse(&rule),
        Decision::Allow => to,
        Decision::AllowName(name) => match name_target(&name, to, upstream).await {
            Ok(t) => t,
            Err(rule) => return refuse(&rule),
        },
    };
    if (upstream.forbidden)(*target.ip()) {
        return refuse(&format!(
            "{} (the host's own, or denied by the operator)",
            target.ip()
        ));
    }
    // A secret's host over TLS: ended here, its secrets put in.
    if let (
        Some(broker),
        Peeked::Tls {
            server_name: Some(host),
        },
    ) = (broker, &peeked)
    {
        if !broker.secrets_for(host).is_empty() {
            let server = match terminate::reach(host, target, upstream.tls.clone()).await {
                Ok(s) => s,
                Err(rule) => return refuse(&rule),
            };
            return broker.serve(guest, first, host, server, sandbox).await;
        }
    }
    let mut up = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(target))
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "connecting timed out"))??;
    up.set_nodelay(true)?;
    up.write_all(&first).await?;
    tokio::io::copy_bidirectional(&mut guest, &mut up).await?;
    Ok(())
}

/// Where a connection let through for `name` goes: the address the guest
/// dialled when it is one of the name's, else the name's first one that
/// may be reached; `Err` (the rule to log) when there is none.
async fn name_target(
    name: &str,
    to: SocketAddrV4,
    upstream: &Upstream,
) -> Result<SocketAddrV4, String> {
    let addresses = (upstream.resolve)(name.to_string())
        .await
        .map_err(|e| format!("{name} (it does not resolve: {e})"))?;
    let usable: Vec<Ipv4Addr> = addresses
        .into_iter()
        .filter(|a| !(upstream.forbidden)(*a))
        .collect();
    match usable.iter().find(|a| *a == to.ip()).or(usable.first()) {
        Some(a) => Ok(SocketAddrV4::new(*a, to.port())),
        None => Err(format!("{name} (none of its addresses may be reached)")),
    }
}

/// The destination a connection had before the host's `redirect` sent it
/// here (`SO_ORIGINAL_DST`).
pub fn original_destination(stream: &TcpStream) -> io::Result<SocketAddrV4> {
    use std::os::fd::AsRawFd;
    // SAFETY: getsockopt(2) into a sockaddr_in of the size we pass, on a
    // descriptor the stream owns for the call's duration.
    unsafe {
        let mut addr: libc::sockaddr_in = std::mem::zeroed();
        let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        let rc = libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_IP,
            libc::SO_ORIGINAL_DST,
            (&mut addr as *mut libc::sockaddr_in).cast(),
            &mut len,
        );
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(SocketAddrV4::new(
            std::net::Ipv4Addr::from(u32::from_be(addr.sin_addr.s_addr)),
            u16::from_be(addr.sin_port),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::OnceLock;

    /// The test's upstream, on 127.0.0.1 and 127.0.0.3 at one port: it
    /// answers `<address it was reached at> saw: <first line>`.
    static UPSTREAM: OnceLock<u16> = OnceLock::new();

    /// The guest dialled 127.0.0.1 (at the upstream's port).
    fn dialled(_: &TcpStream) -> io::Result<SocketAddrV4> {
        let port = *UPSTREAM.get().expect("the upstream runs");
        Ok(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port))
    }

    fn upstream_port() -> u16 {
        *UPSTREAM.get_or_init(|| {
            let first = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let port = first.local_addr().unwrap().port();
            let second = std::net::TcpListener::bind(("127.0.0.3", port)).unwrap();
            for l in [first, second] {
                std::thread::spawn(move || {
                    for mut s in l.incoming().flatten() {
                        use std::io::{Read, Write};
                        let mut buf = vec![0u8; 65536];
                        let n = s.read(&mut buf).unwrap_or(0);
                        let text = String::from_utf8_lossy(&buf[..n]);
                        let line = text.lines().next().unwrap_or("").to_string();
                        let at = s.local_addr().unwrap().ip();
                        let _ = s.write_all(format!("{at} saw: {line}").as_bytes());
                    }
                });
            }
            port
        })
    }

    /// Names resolve to 127.0.0.3, but `metadata.site.example` to the
    /// link-local metadata address and `nowhere.site.example` to nothing;
    /// 169.254.0.0/16 is forbidden.
    fn upstream() -> Upstream {
        upstream_port();
        Upstream {
            resolve: Arc::new(|name: String| {
                Box::pin(async move {
                    match name.as_str() {
                        "nowhere.site.example" => Err(io::Error::other("NXDOMAIN")),
                        "metadata.site.example" => Ok(vec![Ipv4Addr::new(169, 254, 169, 254)]),
                        _ => Ok(vec![Ipv4Addr::new(127, 0, 0, 3)]),
                    }
                })
            }),
            forbidden: Arc::new(|a: Ipv4Addr| a.octets()[..2] == [169, 254]),
            tls: terminate::client_config(&[]),
        }
    }

    fn rules(allow: &[&str], deny: &[&str]) -> Rules {
        let v = |l: &[&str]| l.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        Rules::new(&v(allow), &v(deny)).unwrap()
    }

    async fn proxy(allow: &[&str], deny: &[&str]) -> EgressProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        EgressProxy::serve(
            listener,
            "sbx_test",
            rules(allow, deny),
            dialled,
            upstream(),
        )
    }

    async fn ask(proxy: &EgressProxy, request: &str) -> io::Result<String> {
        let mut s = TcpStream::connect(proxy.addr()).await?;
        s.write_all(request.as_bytes()).await?;
        let mut answer = String::new();
        s.read_to_string(&mut answer).await?;
        Ok(answer)
    }

    fn get(host: &str) -> String {
        format!("GET /{host} HTTP/1.1\r\nHost: {host}\r\n\r\n")
    }

    fn reset(answer: io::Result<String>) -> bool {
        matches!(answer, Err(e) if e.kind() == io::ErrorKind::ConnectionReset)
    }

    #[tokio::test]
    async fn an_allowed_name_reaches_its_own_address_and_another_is_reset_and_counted() {
        let p = proxy(&["web.example"], &["0.0.0.0/0"]).await;
        // To the name's address (127.0.0.3), not to the one dialled.
        let answer = ask(&p, &get("web.example")).await.unwrap();
        assert_eq!(answer, "127.0.0.3 saw: GET /web.example HTTP/1.1");
        assert!(reset(ask(&p, &get("other.example")).await));
        assert_eq!(p.refused(), 1);
        // New rules hold for the next connection.
        p.set_rules(rules(&["other.example"], &["0.0.0.0/0"]));
        let answer = ask(&p, &get("other.example")).await.unwrap();
        assert_eq!(answer, "127.0.0.3 saw: GET /other.example HTTP/1.1");
    }

    #[tokio::test]
    async fn an_allowed_name_that_resolves_nowhere_or_somewhere_forbidden_is_reset() {
        let p = proxy(&["*.site.example"], &["0.0.0.0/0"]).await;
        assert!(reset(ask(&p, &get("nowhere.site.example")).await));
        assert!(reset(ask(&p, &get("metadata.site.example")).await));
        assert_eq!(p.refused(), 2);
    }

    #[tokio::test]
    async fn a_connection_that_names_nothing_is_decided_by_its_address() {
        let open = proxy(&["web.example"], &[]).await;
        let connect = "CONNECT web.example:443 HTTP/1.1\r\n\r\n";
        let answer = ask(&open, connect).await.unwrap();
        assert_eq!(answer, "127.0.0.1 saw: CONNECT web.example:443 HTTP/1.1");
        let closed = proxy(&["web.example"], &["127.0.0.0/8"]).await;
        assert!(reset(ask(&closed, connect).await));
        assert_eq!(closed.refused(), 1);
    }
}
