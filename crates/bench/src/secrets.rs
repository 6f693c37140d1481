//! `sandpit bench secrets`: what the secret-injecting egress path costs
//! over the plain one, judged by the targets: an HTTPS request
//! through it adds ≤ 5 ms over the plain path, and it carries ≥ 50 MB/s.
//!
//! Both paths are the runtime's own [`EgressProxy`], one without a broker
//! (the plain path: the guest's TLS is spliced end to end to the server)
//! and one with a broker holding a secret for the server's name (the
//! secret path: the proxy reaches and verifies the server itself, ends the
//! guest's TLS with a certificate of the sandbox's CA, puts the value in
//! place of the placeholder and sends the request on over its own TLS).
//!
//! Everything runs in this process on loopback, with no VM: a guest's
//! connection reaches its proxy through the same tap, passt or nftables
//! redirect whichever path it then takes, so that part is the same in both
//! and would only add noise to a difference measured in milliseconds. What
//! differs (the proxy's second TLS connection, ending and re-encrypting
//! the guest's TLS, reading and writing HTTP) is all here. The server is
//! a local HTTPS server (tokio-rustls and hyper, HTTP/1.1, keep-alive) with
//! a certificate for [`HOST`] from a CA made for the run; the client speaks
//! to a proxy's address as a guest's connection redirected to it would.
//! The direct path (the client straight to the server) is a reference row.
//!
//! A new connection's time is also split where the client's handshake
//! ends: a stall there (the proxy's own connection to the server, its
//! certificate for the host) is the handshake's, one after it is the
//! first request's (a small write held back by Nagle's algorithm until
//! the peer's delayed ACK, 40 ms on Linux, shows up there).
//!
//! Each measurement takes the paths in turn, round by round, after a
//! warm-up, so they share the machine's noise; the ratios secret/plain are
//! what hold from one run to the next. Every answer is checked: the value
//! must have reached the server on the secret path, the placeholder
//! untouched on the others; a check that fails fails the bench (exit 1),
//! a target missed does not.

use crate::{median, percentile};
use anyhow::{anyhow, ensure, Context, Result};
use bytes::Bytes;
use clap::Args;
use http_body_util::{combinators::BoxBody, BodyExt, Empty, Full};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper_util::rt::TokioIo;
use sandpit_runtime::egress::proxy::{EgressProxy, Resolve, Upstream};
use sandpit_runtime::egress::rules::Rules;
use sandpit_runtime::{Broker, BrokerCa, BrokeredSecret, Sensitive};
use std::convert::Infallible;
use std::io;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context as TaskContext, Poll};
use std::time::Instant;
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::rustls;

#[derive(Args)]
pub struct SecretsBenchArgs {
    /// Requests on a new connection timed on each path
    #[arg(long, default_value_t = 200)]
    connections: usize,
    /// Requests on one kept connection timed on each path
    #[arg(long, default_value_t = 200)]
    requests: usize,
    /// Downloads of the big body timed on each path
    #[arg(long, default_value_t = 5)]
    downloads: usize,
    /// Size of the big body, MiB
    #[arg(long, default_value_t = 256)]
    big_mib: u64,
}

/// The secret's host, the server's certificate's name and the SNI.
const HOST: &str = "api.bench.test";
/// What the guest holds instead of the value.
const PLACEHOLDER: &str = "sandpit-secret-5e1f0b3c9a7d2e4f6081a3b5c7d9e1f20413a6b8";
/// The value the proxy puts in.
const VALUE: &str = "sk-bench-4f9c2e7a1d";
/// Requests of each kind made on each path before anything is timed.
const WARM_UP: usize = 10;
/// Chunks the big body is sent in.
const CHUNK: usize = 64 * 1024;

/// Where every connection to a proxy was going: the server.
static SERVER: OnceLock<SocketAddrV4> = OnceLock::new();

/// The proxies' `original_of`: each connection was dialled to the server
/// (as the host's redirect would say of a guest's).
fn to_server(_: &TcpStream) -> io::Result<SocketAddrV4> {
    SERVER
        .get()
        .copied()
        .ok_or_else(|| io::Error::other("the server is not running"))
}

/// The ways to the server, in the order each round takes them.
#[derive(Clone, Copy, PartialEq)]
enum Path {
    Direct,
    Plain,
    Secret,
}

const PATHS: [Path; 3] = [Path::Direct, Path::Plain, Path::Secret];

impl Path {
    fn name(self) -> &'static str {
        match self {
            Path::Direct => "direct (no proxy)",
            Path::Plain => "plain path (spliced)",
            Path::Secret => "secret path (brokered)",
        }
    }
}

/// Where a client connects for a path and what it trusts there.
struct Way {
    path: Path,
    addr: SocketAddr,
    tls: Arc<rustls::ClientConfig>,
}

fn ring() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A certificate authority for the run, and a server configuration with a
/// certificate it signed for [`HOST`]: (the CA's PEM, the server's config).
fn server_tls() -> Result<(String, Arc<rustls::ServerConfig>)> {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair, KeyUsagePurpose};
    let ca_key = KeyPair::generate()?;
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "sandpit bench secrets CA");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_pem = params.self_signed(&ca_key)?.pem();
    let issuer = Issuer::new(params, ca_key);
    let key = KeyPair::generate()?;
    let cert = CertificateParams::new(vec![HOST.to_string()])?.signed_by(&key, &issuer)?;
    let key = rustls::pki_types::PrivateKeyDer::try_from(key.serialize_der())
        .map_err(|e| anyhow!("the server's key: {e}"))?;
    let mut config = rustls::ServerConfig::builder_with_provider(ring())
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(vec![cert.der().clone()], key)?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok((ca_pem, Arc::new(config)))
}

/// A client configuration trusting `ca_pem` alone, offering HTTP/1.1 (as a
/// guest trusting its sandbox's CA, or the server's, would).
fn client_tls(ca_pem: &str) -> Result<Arc<rustls::ClientConfig>> {
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls::pki_types::CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(cert.map_err(|e| anyhow!("a CA's PEM: {e}"))?)?;
    }
    let mut config = rustls::ClientConfig::builder_with_provider(ring())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// The big body: `left` bytes of one repeated chunk, never held whole.
struct Repeated {
    chunk: Bytes,
    left: u64,
}

impl Body for Repeated {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut TaskContext<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.left == 0 {
            return Poll::Ready(None);
        }
        let n = self.left.min(self.chunk.len() as u64) as usize;
        self.left -= n as u64;
        Poll::Ready(Some(Ok(Frame::data(self.chunk.slice(..n)))))
    }

    fn is_end_stream(&self) -> bool {
        self.left == 0
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.left)
    }
}

type Reply = hyper::Response<BoxBody<Bytes, Infallible>>;

/// The server's answers: `GET /small` says which Authorization it saw,
/// `GET /big` sends `big` bytes.
fn answer(request: &hyper::Request<Incoming>, big: u64, chunk: &Bytes) -> Reply {
    let reply = |status: u16, body: BoxBody<Bytes, Infallible>, len: u64| {
        hyper::Response::builder()
            .status(status)
            .header(http::header::CONTENT_LENGTH, len)
            .body(body)
            .expect("a well-formed answer")
    };
    match (request.method(), request.uri().path()) {
        (&http::Method::GET, "/small") => {
            let seen = request
                .headers()
                .get(http::header::AUTHORIZATION)
                .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
                .unwrap_or_default();
            let text = format!("ok; authorization: {seen}\n");
            let len = text.len() as u64;
            reply(200, Full::new(Bytes::from(text)).boxed(), len)
        }
        (&http::Method::GET, "/big") => {
            let body = Repeated {
                chunk: chunk.clone(),
                left: big,
            };
            reply(200, body.boxed(), big)
        }
        _ => reply(404, Full::new(Bytes::from_static(b"no\n")).boxed(), 3),
    }
}

/// The server: HTTPS on 127.0.0.1, HTTP/1.1 with keep-alive. Runs until the
/// process ends.
async fn serve_upstream(config: Arc<rustls::ServerConfig>, big: u64) -> Result<SocketAddrV4> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let SocketAddr::V4(addr) = listener.local_addr()? else {
        return Err(anyhow!("the server is not on IPv4"));
    };
    let chunk: Bytes = (0..CHUNK)
        .map(|i| (i * 7 + 3) as u8)
        .collect::<Vec<u8>>()
        .into();
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                continue;
            };
            let (acceptor, chunk) = (acceptor.clone(), chunk.clone());
            tokio::spawn(async move {
                let _ = tcp.set_nodelay(true);
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let service = hyper::service::service_fn(move |request| {
                    let reply = answer(&request, big, &chunk);
                    async move { Ok::<_, Infallible>(reply) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(tls), service)
                    .await;
            });
        }
    });
    Ok(addr)
}

/// A client's connection, as a guest's HTTPS client makes it: TCP to
/// `way`'s address, TLS for [`HOST`], HTTP/1.1.
struct Client {
    sender: hyper::client::conn::http1::SendRequest<Empty<Bytes>>,
}

impl Client {
    async fn connect(way: &Way) -> Result<Client> {
        let tcp = TcpStream::connect(way.addr).await?;
        tcp.set_nodelay(true)?;
        let name = rustls::pki_types::ServerName::try_from(HOST)?;
        let tls = tokio_rustls::TlsConnector::from(way.tls.clone())
            .connect(name, tcp)
            .await
            .with_context(|| format!("the TLS handshake on the {}", way.path.name()))?;
        let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(tls)).await?;
        tokio::spawn(async move {
            let _ = connection.await;
        });
        Ok(Client { sender })
    }

    async fn get(&mut self, path: &str) -> Result<hyper::Response<Incoming>> {
        self.sender.ready().await?;
        let request = hyper::Request::get(path)
            .header(http::header::HOST, HOST)
            .header(http::header::AUTHORIZATION, format!("Bearer {PLACEHOLDER}"))
            .body(Empty::new())?;
        let response = self.sender.send_request(request).await?;
        ensure!(
            response.status() == 200,
            "GET {path}: {}",
            response.status()
        );
        Ok(response)
    }

    /// `GET /small`, its answer checked: the value put in on the secret
    /// path, the placeholder as the client sent it on the others.
    async fn small(&mut self, path: Path) -> Result<()> {
        let body = self.get("/small").await?.into_body().collect().await?;
        let text = String::from_utf8_lossy(&body.to_bytes()).into_owned();
        let seen = text.trim_end().trim_start_matches("ok; authorization: ");
        let expected = match path {
            Path::Secret => format!("Bearer {VALUE}"),
            Path::Direct | Path::Plain => format!("Bearer {PLACEHOLDER}"),
        };
        ensure!(
            seen == expected,
            "on the {}, the server saw `Authorization: {seen}`, not `{expected}`",
            path.name()
        );
        Ok(())
    }

    /// `GET /big`, read to its end and not kept: the bytes it had.
    async fn big(&mut self) -> Result<u64> {
        let mut body = self.get("/big").await?.into_body();
        let mut n = 0u64;
        while let Some(frame) = body.frame().await {
            if let Ok(data) = frame?.into_data() {
                n += data.len() as u64;
            }
        }
        Ok(n)
    }
}

/// One request on a new connection: connect, handshake, `GET /small`.
/// Returns when the handshake was done (for the client).
async fn fresh(way: &Way) -> Result<Instant> {
    let mut client = Client::connect(way).await?;
    let shaken = Instant::now();
    client.small(way.path).await?;
    Ok(shaken)
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1000.0
}

/// Samples per path, in [`PATHS`]' order.
type Samples = [Vec<f64>; 3];

/// `f` over the paths in turn, `rounds` times (each round starting on the
/// next path, so none is always first).
async fn interleaved<F>(ways: &[Way], rounds: usize, mut f: F) -> Result<Samples>
where
    F: AsyncFnMut(usize) -> Result<f64>,
{
    let mut samples: Samples = Default::default();
    for round in 0..rounds {
        for k in 0..ways.len() {
            let i = (round + k) % ways.len();
            samples[i].push(f(i).await?);
        }
    }
    Ok(samples)
}

pub async fn run(a: SecretsBenchArgs) -> Result<i32> {
    match bench(&a).await {
        Ok(()) => Ok(0),
        Err(e) => {
            eprintln!("sandpit bench secrets failed: {e:#}");
            Ok(1)
        }
    }
}

async fn bench(a: &SecretsBenchArgs) -> Result<()> {
    ensure!(
        a.connections > 0 && a.requests > 0 && a.downloads > 0,
        "nothing to time"
    );
    let big = a.big_mib << 20;
    let (server_ca, server_config) = server_tls()?;
    let server = serve_upstream(server_config, big).await?;
    SERVER
        .set(server)
        .map_err(|_| anyhow!("the bench's server was already set"))?;

    // What the host's egress path is given: names resolve to the server's
    // address, nothing is forbidden, the server's CA is trusted as an
    // operator's `[network] upstream_ca_certificates` would be.
    let resolve: Resolve =
        Arc::new(|_name: String| Box::pin(async { Ok(vec![Ipv4Addr::LOCALHOST]) }));
    let upstream = Upstream {
        resolve,
        name_servers: Vec::new(),
        forbidden: Arc::new(|_| false),
        tls: sandpit_runtime::egress::terminate::client_config(std::slice::from_ref(&server_ca)),
    };
    let rules = || Rules::new(&[], &[]).map_err(|e| anyhow!("rules: {e}"));
    let plain = EgressProxy::serve(
        TcpListener::bind("127.0.0.1:0").await?,
        "sbx_bench",
        rules()?,
        to_server,
        upstream.clone(),
    );
    let secret = EgressProxy::serve(
        TcpListener::bind("127.0.0.1:0").await?,
        "sbx_bench",
        rules()?,
        to_server,
        upstream,
    );
    let broker = Broker {
        ca: BrokerCa::generate("sbx_bench").map_err(|e| anyhow!("the broker's CA: {e}"))?,
        secrets: vec![BrokeredSecret {
            name: "BENCH_API_KEY".into(),
            placeholder: PLACEHOLDER.into(),
            hosts: vec![HOST.into()],
            header: "Authorization".into(),
            format: "Bearer {value}".into(),
            value: Sensitive::new(VALUE),
        }],
        headers: vec![],
    }
    .checked()
    .map_err(|e| anyhow!("the broker: {e}"))?;
    secret.set_broker(Some(&broker));

    let ways = [
        Way {
            path: Path::Direct,
            addr: SocketAddr::V4(server),
            tls: client_tls(&server_ca)?,
        },
        Way {
            path: Path::Plain,
            addr: plain.addr(),
            tls: client_tls(&server_ca)?,
        },
        Way {
            path: Path::Secret,
            addr: secret.addr(),
            tls: client_tls(&broker.ca.cert_pem)?,
        },
    ];
    debug_assert!(ways.iter().zip(PATHS).all(|(w, p)| w.path == p));
    eprintln!(
        "server at {server}; plain proxy at {}, secret proxy at {}; no VM: everything on loopback in this process",
        plain.addr(),
        secret.addr()
    );

    // Warm-up: the broker's certificate for the host is made at the first
    // brokered connection, the code paths and allocator are warmed.
    for way in &ways {
        for _ in 0..WARM_UP {
            fresh(way).await?;
        }
    }

    eprintln!(
        "timing {} requests on a new connection per path",
        a.connections
    );
    // And, of each, the part until the client's handshake was done.
    let mut shake_ms: Samples = Default::default();
    let fresh_ms = interleaved(&ways, a.connections, async |i| {
        let t = Instant::now();
        let shaken = fresh(&ways[i]).await?;
        shake_ms[i].push((shaken - t).as_secs_f64() * 1000.0);
        Ok(ms(t))
    })
    .await?;

    eprintln!(
        "timing {} requests on a kept connection per path",
        a.requests
    );
    let mut kept = Vec::new();
    for way in &ways {
        let mut c = Client::connect(way).await?;
        for _ in 0..WARM_UP {
            c.small(way.path).await?;
        }
        kept.push(c);
    }
    let kept_ms = interleaved(&ways, a.requests, async |i| {
        let t = Instant::now();
        kept[i].small(ways[i].path).await?;
        Ok(ms(t))
    })
    .await?;

    eprintln!(
        "timing {} downloads of {} MiB per path",
        a.downloads, a.big_mib
    );
    // One download each first, to warm the buffers of each path's
    // connection (not timed).
    for (c, way) in kept.iter_mut().zip(&ways) {
        let n = c.big().await?;
        ensure!(n == big, "{}: {n} bytes of {big}", way.path.name());
    }
    let mb_s = interleaved(&ways, a.downloads, async |i| {
        let t = Instant::now();
        let n = kept[i].big().await?;
        let secs = t.elapsed().as_secs_f64();
        ensure!(n == big, "{}: {n} bytes of {big}", ways[i].path.name());
        Ok(n as f64 / 1e6 / secs)
    })
    .await?;
    // The last checks: the placeholder still untouched, the value still
    // put in, after all that.
    for (c, way) in kept.iter_mut().zip(&ways) {
        c.small(way.path).await?;
    }
    let used = secret.secrets_last_used();
    ensure!(
        used.contains_key("BENCH_API_KEY"),
        "the secret proxy says it never put the secret in"
    );
    ensure!(
        plain.secrets_last_used().is_empty(),
        "the plain proxy says it put a secret in"
    );

    report(a, &fresh_ms, &shake_ms, &kept_ms, &mb_s);
    Ok(())
}

const PLAIN: usize = 1;
const SECRET: usize = 2;

fn report(a: &SecretsBenchArgs, fresh: &Samples, shake: &Samples, kept: &Samples, mb_s: &Samples) {
    let med = |s: &Samples, i: usize| median(s[i].clone());
    let p90 = |s: &Samples, i: usize| percentile(&s[i], 0.9);
    // The first request's own part of a new connection's time.
    let first: Samples = std::array::from_fn(|i| {
        fresh[i]
            .iter()
            .zip(&shake[i])
            .map(|(all, shake)| all - shake)
            .collect()
    });
    let mut rows: Vec<(String, String, String, String)> = Vec::new();
    for (i, path) in PATHS.iter().enumerate() {
        rows.push((
            format!(
                "HTTPS request on a new connection, {} (connect, handshake, GET /small; {} runs)",
                path.name(),
                fresh[i].len()
            ),
            format!("{:.2} ms", med(fresh, i)),
            format!("{:.2} ms", p90(fresh, i)),
            ratio(med(fresh, i), med(fresh, PLAIN), i),
        ));
    }
    for (i, path) in PATHS.iter().enumerate() {
        rows.push((
            format!("  of which connect and TLS handshake, {}", path.name()),
            format!("{:.2} ms", med(shake, i)),
            format!("{:.2} ms", p90(shake, i)),
            ratio(med(shake, i), med(shake, PLAIN), i),
        ));
    }
    for (i, path) in PATHS.iter().enumerate() {
        rows.push((
            format!("  of which the first GET /small, {}", path.name()),
            format!("{:.2} ms", med(&first, i)),
            format!("{:.2} ms", p90(&first, i)),
            ratio(med(&first, i), med(&first, PLAIN), i),
        ));
    }
    for (i, path) in PATHS.iter().enumerate() {
        rows.push((
            format!(
                "GET /small on a kept connection, {} ({} runs)",
                path.name(),
                kept[i].len()
            ),
            format!("{:.3} ms", med(kept, i)),
            format!("{:.3} ms", p90(kept, i)),
            ratio(med(kept, i), med(kept, PLAIN), i),
        ));
    }
    for (i, path) in PATHS.iter().enumerate() {
        let min = mb_s[i].iter().cloned().fold(f64::NAN, f64::min);
        rows.push((
            format!(
                "GET /big ({} MiB) throughput, {} ({} runs)",
                a.big_mib,
                path.name(),
                mb_s[i].len()
            ),
            format!("{:.0} MB/s", med(mb_s, i)),
            format!("slowest {min:.0} MB/s"),
            ratio(med(mb_s, i), med(mb_s, PLAIN), i),
        ));
    }
    let added = med(fresh, SECRET) - med(fresh, PLAIN);
    let added_p90 = p90(fresh, SECRET) - p90(fresh, PLAIN);
    let added_shake = med(shake, SECRET) - med(shake, PLAIN);
    let added_first = med(&first, SECRET) - med(&first, PLAIN);
    let added_kept = med(kept, SECRET) - med(kept, PLAIN);
    let through = med(mb_s, SECRET);
    let verdict = |met: bool| if met { "target met" } else { "target MISSED" };
    let targets = [
        (
            "an HTTPS request on a new connection: secret path − plain path".to_string(),
            format!(
                "{added:+.2} ms (p90 {added_p90:+.2} ms; the handshake {added_shake:+.2} ms, \
                 the first GET {added_first:+.2} ms; a GET on a kept connection {added_kept:+.3} ms)"
            ),
            "≤ 5 ms",
            verdict(added <= 5.0),
        ),
        (
            format!(
                "throughput through the secret path (GET /big, {} MiB)",
                a.big_mib
            ),
            format!(
                "{through:.0} MB/s ({:.2}x the plain path)",
                through / med(mb_s, PLAIN)
            ),
            "≥ 50 MB/s",
            verdict(through >= 50.0),
        ),
    ];
    for (what, measured, target, verdict) in &targets {
        eprintln!("target: {what}: {measured} (target {target}) {verdict}");
    }
    println!();
    println!(
        "| measurement (loopback, one process, no VM: the guest's side is the same on both paths) | median | p90 | ÷ plain path |"
    );
    println!("|---|---|---|---|");
    for (what, median, p90, ratio) in rows {
        println!("| {what} | {median} | {p90} | {ratio} |");
    }
    println!();
    println!("| target (loopback, no VM) | measured | target | |");
    println!("|---|---|---|---|");
    for (what, measured, target, verdict) in targets {
        println!("| {what} | {measured} | {target} | {verdict} |");
    }
}

/// A row's ratio to the plain path's (none on the plain path's own).
fn ratio(value: f64, plain: f64, i: usize) -> String {
    if i == PLAIN {
        String::new()
    } else {
        format!("{:.2}x", value / plain)
    }
}
