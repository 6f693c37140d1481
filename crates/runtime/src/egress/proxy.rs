//! One VM's egress proxy: a listener on the host's loopback to which the
//! host redirects that VM's connections to ports 80 and 443 when its lists
//! name hosts. Each connection is looked at ([`super::peek`]), decided
//! ([`super::rules`]), then either refused with a reset, counted and
//! logged with the rule that refused it, or connected to the address the
//! guest dialled (never to another: the name only decides) and spliced.
//!
//! The redirect itself (an nftables `redirect` for the VM's uid, and the
//! guard's rejects matching the original destination) is issue 45's next
//! step; this part is exercised on the loopback by its tests.

use super::peek::{peek, Peeked, MAX_PEEK};
use super::rules::{Decision, Rules};
use std::io;
use std::net::{SocketAddr, SocketAddrV4};
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

/// A running egress proxy; stops when dropped.
pub struct EgressProxy {
    addr: SocketAddr,
    rules: Arc<RwLock<Rules>>,
    refused: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl EgressProxy {
    /// A proxy for sandbox `sandbox` with `rules`, on a free loopback port,
    /// for connections the host redirected to it.
    pub async fn start(sandbox: &str, rules: Rules) -> io::Result<EgressProxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        Ok(EgressProxy::serve(
            listener,
            sandbox,
            rules,
            original_destination,
        ))
    }

    /// A proxy on `listener`, learning each connection's destination with
    /// `original_of`.
    pub fn serve(
        listener: TcpListener,
        sandbox: &str,
        rules: Rules,
        original_of: OriginalOf,
    ) -> EgressProxy {
        let addr = listener
            .local_addr()
            .expect("a bound listener has an address");
        let rules = Arc::new(RwLock::new(rules));
        let refused = Arc::new(AtomicU64::new(0));
        let (r, n, sandbox) = (rules.clone(), refused.clone(), sandbox.to_string());
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let (r, n, sandbox) = (r.clone(), n.clone(), sandbox.clone());
                tokio::spawn(async move {
                    if let Err(e) = handle(stream, &r, &n, &sandbox, original_of).await {
                        tracing::debug!(%sandbox, "egress connection: {e}");
                    }
                });
            }
        });
        EgressProxy {
            addr,
            rules,
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
        *self.rules.write().unwrap() = rules;
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
    rules: &RwLock<Rules>,
    refused: &AtomicU64,
    sandbox: &str,
    original_of: OriginalOf,
) -> io::Result<()> {
    let to = original_of(&guest)?;
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
    let decision = rules.read().unwrap().decide(*to.ip(), &peeked);
    match decision {
        Decision::Refuse { rule } => {
            refused.fetch_add(1, Ordering::Relaxed);
            tracing::info!(%sandbox, %to, host = ?named(&peeked), %rule, "egress refused");
            // A reset, so the guest's connect fails at once.
            guest.set_zero_linger()?;
            Ok(())
        }
        Decision::Allow => {
            let mut upstream = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(to))
                .await
                .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "connecting timed out"))??;
            upstream.write_all(&first).await?;
            tokio::io::copy_bidirectional(&mut guest, &mut upstream).await?;
            Ok(())
        }
    }
}

fn named(peeked: &Peeked) -> Option<&str> {
    match peeked {
        Peeked::Tls { server_name } => server_name.as_deref(),
        Peeked::Http { host } => host.as_deref(),
        Peeked::NeedMore | Peeked::Unnamed => None,
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

    /// The test's upstream: answers `upstream saw: <first line>`.
    static UPSTREAM: OnceLock<SocketAddrV4> = OnceLock::new();

    fn to_upstream(_: &TcpStream) -> io::Result<SocketAddrV4> {
        Ok(*UPSTREAM.get().expect("the upstream runs"))
    }

    async fn upstream() -> SocketAddrV4 {
        if let Some(a) = UPSTREAM.get() {
            return *a;
        }
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let SocketAddr::V4(a) = l.local_addr().unwrap() else {
            unreachable!()
        };
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                loop {
                    let (mut s, _) = l.accept().await.unwrap();
                    tokio::spawn(async move {
                        let mut buf = vec![0u8; 65536];
                        let n = s.read(&mut buf).await.unwrap_or(0);
                        let line = String::from_utf8_lossy(&buf[..n]);
                        let first = line.lines().next().unwrap_or("").to_string();
                        let _ = s
                            .write_all(format!("upstream saw: {first}").as_bytes())
                            .await;
                    });
                }
            });
        });
        *UPSTREAM.get_or_init(|| a)
    }

    fn rules(allow: &[&str], deny: &[&str]) -> Rules {
        let v = |l: &[&str]| l.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        Rules::new(&v(allow), &v(deny)).unwrap()
    }

    async fn ask(proxy: &EgressProxy, request: &str) -> io::Result<String> {
        let mut s = TcpStream::connect(proxy.addr()).await?;
        s.write_all(request.as_bytes()).await?;
        let mut answer = String::new();
        s.read_to_string(&mut answer).await?;
        Ok(answer)
    }

    #[tokio::test]
    async fn an_allowed_host_is_reached_and_another_is_reset_and_counted() {
        upstream().await;
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let proxy = EgressProxy::serve(
            listener,
            "sbx_test",
            rules(&["web.example"], &["0.0.0.0/0"]),
            to_upstream,
        );
        let answer = ask(&proxy, "GET /a HTTP/1.1\r\nHost: web.example\r\n\r\n")
            .await
            .unwrap();
        assert_eq!(answer, "upstream saw: GET /a HTTP/1.1");
        let refused = ask(&proxy, "GET /b HTTP/1.1\r\nHost: other.example\r\n\r\n").await;
        match refused {
            Err(e) => assert_eq!(e.kind(), io::ErrorKind::ConnectionReset, "{e}"),
            Ok(a) => panic!("a refused host was answered: {a:?}"),
        }
        assert_eq!(proxy.refused(), 1);
        // New rules hold for the next connection.
        proxy.set_rules(rules(&["other.example"], &["0.0.0.0/0"]));
        let answer = ask(&proxy, "GET /c HTTP/1.1\r\nHost: other.example\r\n\r\n")
            .await
            .unwrap();
        assert_eq!(answer, "upstream saw: GET /c HTTP/1.1");
    }

    #[tokio::test]
    async fn a_connection_that_names_nothing_is_decided_by_its_address() {
        upstream().await;
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let open = EgressProxy::serve(
            listener,
            "sbx_test",
            rules(&["web.example"], &[]),
            to_upstream,
        );
        let answer = ask(&open, "CONNECT web.example:443 HTTP/1.1\r\n\r\n")
            .await
            .unwrap();
        assert_eq!(answer, "upstream saw: CONNECT web.example:443 HTTP/1.1");
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let closed = EgressProxy::serve(
            listener,
            "sbx_test",
            rules(&["web.example"], &["127.0.0.0/8"]),
            to_upstream,
        );
        assert!(ask(&closed, "CONNECT web.example:443 HTTP/1.1\r\n\r\n")
            .await
            .is_err());
        assert_eq!(closed.refused(), 1);
    }
}
