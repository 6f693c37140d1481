//! A test host in a network namespace of its own, reachable from the host
//! over a veth pair: "the internet" of the network tests (HTTP and DNS
//! servers run inside it), or a place for a listener the guest may reach
//! only at one address.

use std::path::Path;
use std::process::{Child, Command};

pub fn ip(args: &[&str]) {
    let st = Command::new("ip").args(args).status().unwrap_or_else(|e| {
        panic!("`ip` is missing ({e}); install iproute2 (scripts/install-deps.sh does)")
    });
    assert!(
        st.success(),
        "ip {args:?} failed (the network tests need root)"
    );
}

/// A host in its own network namespace, reachable from the host over a veth
/// pair: the host side has `host_side`/24, the test host `address`/24.
pub struct TestHost {
    pub ns: String,
    veth: String,
    pub address: &'static str,
    servers: Vec<Child>,
    /// Released after `drop` removed the veth pair and the namespace.
    _changing: HostNetworkLock,
}

/// Tests of several binaries change the host's network (a test host's veth
/// pair and routes, an address on `lo`), and binaries can run at once
/// (`scripts/test.sh` runs some tests beside the main run), while the
/// package test checks that the host's network is as it was after its
/// container ran. Tests hold this lock shared for as long as a change of
/// theirs lives; the package test holds it exclusively around its check.
pub struct HostNetworkLock(std::fs::File);

impl HostNetworkLock {
    const PATH: &'static str = "/tmp/sandpit-tests-host-network.lock";

    /// Held while a change to the host's network lives.
    pub fn changing() -> HostNetworkLock {
        HostNetworkLock::take(false)
    }

    /// Held while nothing else may change the host's network.
    pub fn checking() -> HostNetworkLock {
        HostNetworkLock::take(true)
    }

    fn take(exclusive: bool) -> HostNetworkLock {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(Self::PATH)
            .unwrap_or_else(|e| panic!("{}: {e}", Self::PATH));
        let locked = if exclusive {
            file.lock()
        } else {
            file.lock_shared()
        };
        locked.unwrap_or_else(|e| panic!("locking {}: {e}", Self::PATH));
        HostNetworkLock(file)
    }
}

impl TestHost {
    /// `name` tells apart the test hosts of one test binary (at most 5 bytes).
    pub fn start(name: &str, host_side: &str, address: &'static str) -> TestHost {
        assert!(name.len() <= 5, "a test host's name has at most 5 bytes");
        // The whole pid (at most 7 digits): "sv" + name + pid fits the
        // kernel's 15 bytes, and a leftover names the process it was for.
        let tag = std::process::id();
        let ns = format!("sp{name}{tag}");
        let veth = format!("sv{name}{tag}");
        let peer = format!("sp{name}{tag}p");
        let changing = HostNetworkLock::changing();
        remove_leftovers_on(host_side);
        ip(&["netns", "add", &ns]);
        let host = TestHost {
            ns: ns.clone(),
            veth: veth.clone(),
            address,
            servers: Vec::new(),
            _changing: changing,
        };
        ip(&["link", "add", &veth, "type", "veth", "peer", "name", &peer]);
        ip(&["link", "set", &peer, "netns", &ns]);
        ip(&["addr", "add", &format!("{host_side}/24"), "dev", &veth]);
        ip(&["link", "set", &veth, "up"]);
        host.exec_ip(&["addr", "add", &format!("{address}/24"), "dev", &peer]);
        host.exec_ip(&["link", "set", &peer, "up"]);
        host.exec_ip(&["link", "set", "lo", "up"]);
        host
    }

    /// The namespace's file, for `setns(2)`.
    pub fn netns_path(&self) -> std::path::PathBuf {
        std::path::Path::new("/var/run/netns").join(&self.ns)
    }

    pub fn exec_ip(&self, args: &[&str]) {
        let mut all = vec!["netns", "exec", &self.ns, "ip"];
        all.extend_from_slice(args);
        ip(&all);
    }

    /// One more address of the test host, routed to it from the host.
    pub fn add_address(&self, extra: &str) {
        let peer = format!("{}p", self.ns);
        self.exec_ip(&["addr", "add", &format!("{extra}/32"), "dev", &peer]);
        ip(&[
            "route",
            "add",
            &format!("{extra}/32"),
            "via",
            self.address,
            "dev",
            &self.veth,
        ]);
    }

    /// Serve `www` over HTTP on port 8080 of the test host's address.
    pub fn serve_http(&mut self, www: &Path) {
        self.serve_http_on(8080, www);
    }

    /// Serve `www` over HTTP on `port` of the test host's address.
    pub fn serve_http_on(&mut self, port: u16, www: &Path) {
        let http = Command::new("ip")
            .args(["netns", "exec", &self.ns, "python3", "-m", "http.server"])
            .arg(port.to_string())
            .args(["--bind", self.address, "--directory"])
            .arg(www)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("python3 (install python3)");
        self.servers.push(http);
        for _ in 0..100 {
            if std::net::TcpStream::connect((self.address, port)).is_ok() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        panic!("the test host's HTTP server did not start");
    }

    /// Serve `body` over HTTPS on `port` of the test host's address, with
    /// this certificate chain and key (PEM files); `{headers}` answers each
    /// request with its own headers (see `HTTPS_SERVER` for
    /// `{headers-masking:S}`).
    pub fn serve_https(&mut self, port: u16, cert: &Path, key: &Path, body: &str) {
        let https = Command::new("ip")
            .args(["netns", "exec", &self.ns, "python3", "-c", HTTPS_SERVER])
            .args([self.address, &port.to_string()])
            .args([cert, key])
            .arg(body)
            .spawn()
            .expect("python3 (install python3)");
        self.servers.push(https);
        for _ in 0..100 {
            if std::net::TcpStream::connect((self.address, port)).is_ok() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        panic!("the test host's HTTPS server did not start");
    }

    /// A DNS server on `bind` (an address of the test host) that answers
    /// every A query with `answer`.
    pub fn serve_dns(&mut self, bind: &str, answer: &str) {
        let dns = Command::new("ip")
            .args(["netns", "exec", &self.ns, "python3", "-c", DNS_SERVER])
            .args([bind, answer])
            .spawn()
            .expect("python3 (install python3)");
        self.servers.push(dns);
        wait_for_dns(bind, answer);
    }
}

impl Drop for TestHost {
    fn drop(&mut self) {
        for s in &mut self.servers {
            let _ = s.kill();
            let _ = s.wait();
        }
        let _ = Command::new("ip")
            .args(["link", "del", &self.veth])
            .status();
        let _ = Command::new("ip").args(["netns", "del", &self.ns]).status();
    }
}

/// Removes what a test run killed before its clean-up left on `host_side`'s
/// network: the host's end of its veth pair and its namespace. Otherwise the
/// host would hold two routes to one /24 and send this run's traffic into
/// the dead run's namespace (every connection timing out). A leftover whose
/// process still runs a test binary is another run's: that is an error.
fn remove_leftovers_on(host_side: &str) {
    let network = |a: &str| a.rsplit_once('.').map(|(n, _)| n.to_string());
    let wanted = network(host_side).expect("an IPv4 address");
    let out = Command::new("ip")
        .args(["-o", "-4", "addr", "show"])
        .output()
        .expect("`ip` (install iproute2)");
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        // "26: svpx27362    inet 172.30.253.1/24 scope global svpx27362"
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (Some(link), Some(addr)) = (fields.get(1), fields.get(3)) else {
            continue;
        };
        let addr = addr.split('/').next().unwrap_or_default();
        if network(addr).as_deref() != Some(wanted.as_str()) {
            continue;
        }
        let Some(rest) = link.strip_prefix("sv") else {
            panic!("{host_side}/24 is already on {link}, not a test host's link: remove it");
        };
        let pid = &rest[rest.trim_end_matches(|c: char| c.is_ascii_digit()).len()..];
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let live_test = pid.parse::<u32>().ok() != Some(std::process::id())
            && String::from_utf8_lossy(&cmdline).contains("/deps/");
        assert!(
            !live_test,
            "{host_side}/24 is in use by {link}, a test host of the running test process {pid}"
        );
        eprintln!("removing {link} and its namespace, left by a test run that died");
        let _ = Command::new("ip").args(["link", "del", link]).status();
        let _ = Command::new("ip")
            .args(["netns", "del", &format!("sp{rest}")])
            .status();
    }
}

/// An HTTPS server on `argv[1]`, port `argv[2]`, with the certificate chain
/// `argv[3]` and key `argv[4]`, answering every GET with `argv[5]`, or with
/// the request's headers when that is `{headers}`, or with them and each
/// `S` in them shown as `<the secret>` when it is `{headers-masking:S}` (so
/// a test sees that the server got `S` without `S` reaching the client).
const HTTPS_SERVER: &str = r#"
import http.server, ssl, sys
addr, port, cert, key, body = sys.argv[1:6]
class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = 'HTTP/1.1'
    def do_GET(self):
        data = body
        if body == '{headers}':
            data = str(self.headers)
        elif body.startswith('{headers-masking:'):
            data = str(self.headers).replace(body[len('{headers-masking:'):-1], '<the secret>')
        data = data.encode()
        self.send_response(200)
        self.send_header('Content-Length', str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def log_message(self, *args):
        pass
server = http.server.ThreadingHTTPServer((addr, int(port)), Handler)
tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
tls.load_cert_chain(cert, key)
server.socket = tls.wrap_socket(server.socket, server_side=True)
server.serve_forever()
"#;

/// A DNS server on `argv[1]`, port 53, that answers every A query with the
/// address `argv[2]`.
pub const DNS_SERVER: &str = r#"
import socket, struct, sys
addr = socket.inet_aton(sys.argv[2])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((sys.argv[1], 53))
while True:
    q, peer = s.recvfrom(512)
    qid = q[:2]
    end = 12
    while q[end] != 0:
        end += q[end] + 1
    question = q[12:end + 5]
    qtype = struct.unpack('>H', q[end + 1:end + 3])[0]
    answers = b''
    count = 0
    if qtype == 1:
        answers = b'\xc0\x0c' + struct.pack('>HHIH', 1, 1, 60, 4) + addr
        count = 1
    header = qid + struct.pack('>HHHHH', 0x8180, 1, count, 0, 0)
    s.sendto(header + question + answers, peer)
"#;

/// A DNS query for `probe.example.test`, type A.
pub fn dns_query() -> Vec<u8> {
    let mut q = vec![0x12, 0x34, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0];
    for label in ["probe", "example", "test"] {
        q.push(label.len() as u8);
        q.extend_from_slice(label.as_bytes());
    }
    q.extend_from_slice(&[0, 0, 1, 0, 1]);
    q
}

/// Wait until the DNS server on `server` answers with `answer`.
pub fn wait_for_dns(server: &str, answer: &str) {
    let sock = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
    sock.set_read_timeout(Some(std::time::Duration::from_millis(200)))
        .unwrap();
    let want: std::net::Ipv4Addr = answer.parse().unwrap();
    for _ in 0..50 {
        let _ = sock.send_to(&dns_query(), (server, 53));
        let mut buf = [0u8; 512];
        if let Ok(n) = sock.recv(&mut buf) {
            if n >= 4 && buf[n - 4..n] == want.octets() {
                return;
            }
        }
    }
    panic!("the test's DNS server on {server} did not answer");
}
