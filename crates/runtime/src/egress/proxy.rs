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
//!
//! When the lists name hosts, the guest's DNS comes here too, on the same
//! port number over UDP and TCP, and is answered as [`super::dns`] says.

use super::broker::Broker;
use super::dns::{self, Verdict};
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
use tokio::net::{TcpListener, TcpStream, UdpSocket};

/// How long a connection may take to say which host it is for; one that
/// says nothing by then (a protocol where the server speaks first) is
/// decided by its address alone.
const PEEK_TIMEOUT: Duration = Duration::from_secs(5);
/// How long connecting to the destination may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);
/// The most DNS queries over UDP one proxy answers at once; more are
/// dropped (the guest's resolver asks again), so a guest that floods its
/// name server holds a bounded share of the host.
const MAX_DNS_IN_FLIGHT: usize = 64;
/// How long a DNS connection over TCP may stay idle between queries.
const DNS_TCP_IDLE: Duration = Duration::from_secs(10);

/// Refusals of every proxy of this process: connections, then lookups.
static REFUSED: [AtomicU64; 2] = [AtomicU64::new(0), AtomicU64::new(0)];

/// Connections and lookups the egress proxies of this process refused so
/// far (the metric `sandpit_egress_refused_total`).
pub fn refused_total() -> (u64, u64) {
    let read = |n: &AtomicU64| n.load(Ordering::Relaxed);
    (read(&REFUSED[0]), read(&REFUSED[1]))
}

/// Where a redirected connection was going.
pub type OriginalOf = fn(&TcpStream) -> io::Result<SocketAddrV4>;

/// A name's IPv4 addresses, looked up.
pub type Resolve = Arc<
    dyn Fn(String) -> Pin<Box<dyn Future<Output = io::Result<Vec<Ipv4Addr>>> + Send>> + Send + Sync,
>;

/// What the proxy connects with: how names resolve (as the guests' own
/// name servers answer them), those name servers (which the guests' DNS
/// is asked of), which addresses it must never reach, and what it trusts
/// when it reaches a secret's server (see [`terminate::client_config`]).
#[derive(Clone)]
pub struct Upstream {
    pub resolve: Resolve,
    pub name_servers: Vec<SocketAddr>,
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
    dns: Arc<DnsFilter>,
    secrets_used: terminate::LastUsed,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl EgressProxy {
    /// A proxy for sandbox `sandbox` with `rules` and `broker`'s secrets,
    /// on a free loopback port (the same number over TCP and UDP), for
    /// connections and DNS queries the host redirected to it.
    pub async fn start(
        sandbox: &str,
        rules: Rules,
        broker: Option<&Broker>,
        upstream: Upstream,
    ) -> io::Result<EgressProxy> {
        let (listener, dns) = bind_both().await?;
        let mut proxy =
            EgressProxy::serve(listener, sandbox, rules, original_destination, upstream);
        proxy.answer_dns(dns);
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
        let dns = Arc::new(DnsFilter {
            sandbox: sandbox.clone(),
            policy: policy.clone(),
            refused: refused.clone(),
            name_servers: upstream.name_servers.clone(),
        });
        let tcp_dns = dns.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let (r, n, sandbox, up) = (r.clone(), n.clone(), sandbox.clone(), upstream.clone());
                let dns = tcp_dns.clone();
                tokio::spawn(async move {
                    let to = match original_of(&stream) {
                        Ok(to) => to,
                        Err(e) => return tracing::debug!(%sandbox, "egress connection: {e}"),
                    };
                    let handled = match to.port() {
                        53 => dns.serve_tcp(stream).await,
                        _ => handle(stream, to, &r, &n, &sandbox, &up).await,
                    };
                    if let Err(e) = handled {
                        tracing::debug!(%sandbox, "egress connection: {e}");
                    }
                });
            }
        });
        EgressProxy {
            addr,
            policy,
            refused,
            dns,
            secrets_used: terminate::LastUsed::default(),
            tasks: vec![task],
        }
    }

    /// Answer the DNS queries that come to `socket` (the UDP side of its
    /// port).
    pub fn answer_dns(&mut self, socket: UdpSocket) {
        let dns = self.dns.clone();
        self.tasks.push(tokio::spawn(dns.serve_udp(socket)));
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
        let path = broker.and_then(BrokerPath::new);
        self.policy.write().unwrap().broker =
            path.map(|p| Arc::new(p.noting_use_in(self.secrets_used.clone())));
    }

    /// When each of its secrets was last put into a request (by name),
    /// since it started, whatever brokers it was given since.
    pub fn secrets_last_used(&self) -> std::collections::HashMap<String, time::OffsetDateTime> {
        self.secrets_used.lock().unwrap().clone()
    }

    /// Connections refused so far.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }
}

impl Drop for EgressProxy {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// A TCP listener and a UDP socket on one free loopback port.
async fn bind_both() -> io::Result<(TcpListener, UdpSocket)> {
    let mut last = None;
    for _ in 0..16 {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        match UdpSocket::bind(listener.local_addr()?).await {
            Ok(udp) => return Ok((listener, udp)),
            // That number is taken over UDP: another one.
            Err(e) => last = Some(e),
        }
    }
    Err(last.expect("tried at least once"))
}

/// A proxy's DNS side (see [`super::dns`]).
struct DnsFilter {
    sandbox: String,
    policy: Arc<RwLock<Policy>>,
    refused: Arc<AtomicU64>,
    name_servers: Vec<SocketAddr>,
}

impl DnsFilter {
    /// The answer to `query`, asked upstream with `ask` when the lists let
    /// it be.
    async fn answer<F, Fut>(&self, query: &[u8], ask: F) -> Option<Vec<u8>>
    where
        F: FnOnce(Vec<SocketAddr>, Vec<u8>) -> Fut,
        Fut: Future<Output = io::Result<Vec<u8>>>,
    {
        let verdict = dns::verdict(&self.policy.read().unwrap().rules, query);
        let (answer, rule, name) = match verdict {
            Verdict::Answer { message, rule } => (message, rule, None),
            Verdict::Ask { name } => {
                let asked = ask(self.name_servers.clone(), query.to_vec()).await;
                let answer = match asked {
                    Ok(answer) => answer,
                    Err(e) => {
                        tracing::debug!(sandbox = %self.sandbox, %name, "DNS upstream: {e}");
                        return None;
                    }
                };
                let rules = self.policy.read().unwrap().rules.clone();
                let (answer, rule) = dns::filter_answer(&rules, &name, &answer);
                (answer, rule, Some(name))
            }
        };
        if let Some(rule) = rule {
            self.refused.fetch_add(1, Ordering::Relaxed);
            REFUSED[1].fetch_add(1, Ordering::Relaxed);
            let name = name.unwrap_or_else(|| "(the query)".into());
            tracing::info!(sandbox = %self.sandbox, host = %name, %rule, "egress refused (DNS)");
        }
        Some(answer)
    }

    /// Queries over UDP, each answered by a task of its own (at most
    /// [`MAX_DNS_IN_FLIGHT`] at once).
    async fn serve_udp(self: Arc<Self>, socket: UdpSocket) {
        let socket = Arc::new(socket);
        let in_flight = Arc::new(tokio::sync::Semaphore::new(MAX_DNS_IN_FLIGHT));
        let mut buf = vec![0u8; dns::MAX_UDP_MESSAGE];
        loop {
            let Ok((n, from)) = socket.recv_from(&mut buf).await else {
                continue;
            };
            let Ok(permit) = in_flight.clone().try_acquire_owned() else {
                continue;
            };
            let (me, socket, query) = (self.clone(), socket.clone(), buf[..n].to_vec());
            tokio::spawn(async move {
                let ask = |servers: Vec<SocketAddr>, q: Vec<u8>| async move {
                    dns::ask_udp(&servers, &q).await
                };
                if let Some(answer) = me.answer(&query, ask).await {
                    let _ = socket.send_to(&answer, from).await;
                }
                drop(permit);
            });
        }
    }

    /// Queries over TCP (length-prefixed), one after another, until the
    /// guest closes or is idle for [`DNS_TCP_IDLE`].
    async fn serve_tcp(&self, mut guest: TcpStream) -> io::Result<()> {
        while let Ok(Some(query)) = tokio::time::timeout(DNS_TCP_IDLE, dns::read_framed(&mut guest))
            .await
            .unwrap_or(Ok(None))
        {
            let ask = |servers: Vec<SocketAddr>, q: Vec<u8>| async move {
                dns::ask_tcp(&servers, &q).await
            };
            let Some(answer) = self.answer(&query, ask).await else {
                return Ok(());
            };
            let length = u16::try_from(answer.len()).map_err(io::Error::other)?;
            guest.write_all(&length.to_be_bytes()).await?;
            guest.write_all(&answer).await?;
        }
        Ok(())
    }
}

async fn handle(
    mut guest: TcpStream,
    to: SocketAddrV4,
    policy: &RwLock<Policy>,
    refused: &AtomicU64,
    sandbox: &str,
    upstream: &Upstream,
) -> io::Result<()> {
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
        REFUSED[0].fetch_add(1, Ordering::Relaxed);
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
    // A secret's host (or a header rule's) over TLS: ended here, its
    // secrets put in.
    if let (
        Some(broker),
        Peeked::Tls {
            server_name: Some(host),
        },
    ) = (broker, &peeked)
    {
        if broker.brokers_for(host) {
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
            name_servers: Vec::new(),
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

    /// A name server on loopback that answers every query with its own
    /// bytes turned into an answer of one A record, 127.0.0.3.
    async fn name_server() -> SocketAddr {
        let socket = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = socket.local_addr().unwrap();
        tokio::spawn(async move {
            let mut buf = [0u8; 512];
            while let Ok((n, from)) = socket.recv_from(&mut buf).await {
                let mut answer = buf[..n].to_vec();
                answer[2] |= 0x80; // a response
                answer[7] = 1; // one answer
                answer.extend_from_slice(&[0xc0, 12, 0, 1, 0, 1, 0, 0, 0, 60, 0, 4, 127, 0, 0, 3]);
                let _ = socket.send_to(&answer, from).await;
            }
        });
        addr
    }

    fn a_query(name: &str) -> Vec<u8> {
        let mut q = vec![0x42, 0x42, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0];
        for label in name.split('.') {
            q.push(label.len() as u8);
            q.extend_from_slice(label.as_bytes());
        }
        q.extend_from_slice(&[0, 0, 1, 0, 1]);
        q
    }

    #[tokio::test]
    async fn lookups_over_udp_and_tcp_are_answered_by_the_lists() {
        let (listener, udp) = bind_both().await.unwrap();
        let up = Upstream {
            name_servers: vec![name_server().await],
            ..upstream()
        };
        let dns_port = |_: &TcpStream| Ok(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 53));
        let mut p = EgressProxy::serve(
            listener,
            "sbx_test",
            rules(&["web.example"], &["0.0.0.0/0"]),
            dns_port,
            up,
        );
        p.answer_dns(udp);
        let guest = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let rcode_and_count = |a: &[u8]| (a[3] & 15, a[7]);
        let mut buf = [0u8; 512];
        for (name, expected) in [("web.example", (0, 1)), ("other.example", (3, 0))] {
            guest.send_to(&a_query(name), p.addr()).await.unwrap();
            let n = guest.recv(&mut buf).await.unwrap();
            assert_eq!(rcode_and_count(&buf[..n]), expected, "{name}");
        }
        // Over TCP (the name server here speaks UDP only: a refused name
        // is answered without it).
        let mut tcp = TcpStream::connect(p.addr()).await.unwrap();
        let q = a_query("other.example");
        tcp.write_all(&(q.len() as u16).to_be_bytes())
            .await
            .unwrap();
        tcp.write_all(&q).await.unwrap();
        let answer = dns::read_framed(&mut tcp).await.unwrap().unwrap();
        assert_eq!(rcode_and_count(&answer), (3, 0));
        assert_eq!(p.refused(), 2);
    }
}
