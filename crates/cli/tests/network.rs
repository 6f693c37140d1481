//! Outbound network, tested without the internet: a test host in a network
//! namespace plays "the internet" (an HTTP server and a DNS server the guest
//! must reach) and a server on the host plays the control plane, which the
//! guest must not reach: not through the gateway, not through the host's
//! addresses, and nothing link-local (169.254.169.254).
//!
//! Name resolution with the default configuration (no `[network] dns`): the
//! guest asks passt, which asks the resolver the host's `/etc/resolv.conf`
//! names. These tests give `sandpit sandbox create` (and so passt) a mount
//! namespace of its own in which `/etc/resolv.conf` names the test's
//! resolver: one on a private address of a test host (a cloud VPC's
//! resolver), one on the host's loopback (systemd-resolved's kind).

mod common;

use common::cli::Cli;
use common::*;
use std::io::{Read, Write};
use std::net::TcpListener;
use std::os::unix::fs::PermissionsExt;
use std::process::{Child, Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

const HOST_SIDE: &str = "198.51.100.1";
const INTERNET: &str = "198.51.100.2";

fn ip(args: &[&str]) {
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
struct TestHost {
    ns: String,
    veth: String,
    address: &'static str,
    servers: Vec<Child>,
}

impl TestHost {
    /// `name` tells apart the test hosts of one test binary (at most 5 bytes).
    fn start(name: &str, host_side: &str, address: &'static str) -> TestHost {
        let tag = std::process::id() % 100_000;
        let ns = format!("sp{name}{tag}");
        let veth = format!("sv{name}{tag}");
        let peer = format!("sp{name}{tag}p");
        // Leftovers of an earlier run that died (quietly: usually none).
        for args in [["netns", "del", &ns], ["link", "del", &veth]] {
            let _ = Command::new("ip")
                .args(args)
                .stderr(std::process::Stdio::null())
                .status();
        }
        ip(&["netns", "add", &ns]);
        let host = TestHost {
            ns: ns.clone(),
            veth: veth.clone(),
            address,
            servers: Vec::new(),
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

    fn exec_ip(&self, args: &[&str]) {
        let mut all = vec!["netns", "exec", &self.ns, "ip"];
        all.extend_from_slice(args);
        ip(&all);
    }

    /// One more address of the test host, routed to it from the host.
    fn add_address(&self, extra: &str) {
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
    fn serve_http(&mut self, www: &std::path::Path) {
        let http = Command::new("ip")
            .args(["netns", "exec", &self.ns, "python3", "-m", "http.server"])
            .args(["8080", "--bind", self.address, "--directory"])
            .arg(www)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("python3 (install python3)");
        self.servers.push(http);
        for _ in 0..100 {
            if std::net::TcpStream::connect((self.address, 8080)).is_ok() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        panic!("the test host's HTTP server did not start");
    }

    /// A DNS server on `bind` (an address of the test host) that answers
    /// every A query with `answer`.
    fn serve_dns(&mut self, bind: &str, answer: &str) {
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

/// A DNS server on `argv[1]`, port 53, that answers every A query with the
/// address `argv[2]`.
const DNS_SERVER: &str = r#"
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
fn dns_query() -> Vec<u8> {
    let mut q = vec![0x12, 0x34, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0];
    for label in ["probe", "example", "test"] {
        q.push(label.len() as u8);
        q.extend_from_slice(label.as_bytes());
    }
    q.extend_from_slice(&[0, 0, 1, 0, 1]);
    q
}

/// Wait until the DNS server on `server` answers with `answer`.
fn wait_for_dns(server: &str, answer: &str) {
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

#[test]
fn the_guest_reaches_the_internet_but_not_the_host() {
    let www = data_dir();
    std::fs::write(www.join("hello.txt"), "hello from the internet\n").unwrap();
    let mut host = TestHost::start("net", HOST_SIDE, INTERNET);
    host.serve_http(&www);
    host.serve_dns(INTERNET, INTERNET);

    // The "control plane": listens on every host address and counts connections.
    let cp = TcpListener::bind("0.0.0.0:0").unwrap();
    let port = cp.local_addr().unwrap().port();
    let hits = Arc::new(AtomicUsize::new(0));
    let h = hits.clone();
    std::thread::spawn(move || {
        for mut c in cp.incoming().flatten() {
            h.fetch_add(1, Ordering::SeqCst);
            let mut buf = [0u8; 512];
            let _ = c.read(&mut buf);
            let _ = c.write_all(b"HTTP/1.0 200 OK\r\n\r\nsecret");
        }
    });

    let dir = data_dir();
    let mut c = config(&dir);
    c.network.dns = Some(vec![INTERNET.to_string()]);
    let s = shared("sbx_net", || c);
    s.rt.block_on(async {
        // The internet, by address and by name.
        let body = sh(
            &s.vm,
            &format!("curl -sS -m 20 http://{INTERNET}:8080/hello.txt"),
        )
        .await;
        assert_eq!(body, "hello from the internet");
        let body = sh(
            &s.vm,
            "curl -sS -m 20 http://pypi.example.test:8080/hello.txt",
        )
        .await;
        assert_eq!(body, "hello from the internet");

        // Not the host: every address of it, the gateway, link-local metadata.
        let mut targets = vec![
            format!("http://10.0.2.2:{port}/"),
            "http://169.254.169.254/latest/meta-data/".to_string(),
            format!("http://127.0.0.1:{port}/"),
            format!("http://{HOST_SIDE}:{port}/"),
        ];
        for a in sandpit_runtime::net::host_addresses() {
            let a = a.trim_end_matches("/32");
            if !a.starts_with("127.") {
                targets.push(format!("http://{a}:{port}/"));
            }
        }
        for t in &targets {
            let out = run(&s.vm, req_timeout(&format!("curl -sS -m 10 {t}"), 30_000)).await;
            assert_ne!(
                out.result.exit_code,
                Some(0),
                "the guest reached {t}: {}",
                String::from_utf8_lossy(&out.stdout)
            );
        }
        assert_eq!(
            hits.load(Ordering::SeqCst),
            0,
            "the control plane was reached"
        );
        // The user cannot lift the filter.
        let out = run(&s.vm, req("nft flush ruleset")).await;
        assert_ne!(out.result.exit_code, Some(0));
        s.manager.destroy(&s.vm.record.id).await.unwrap();
    });
}

/// The test host of the default-DNS tests, and the private address of its
/// resolver.
const DNS_HOST_SIDE: &str = "198.18.53.1";
const DNS_INTERNET: &str = "198.18.53.2";
const VPC_RESOLVER: &str = "172.31.253.53";

/// `sandpit sandbox create` in a mount namespace of its own, where
/// `/etc/resolv.conf` is `resolv_conf`: what passt, started by the create,
/// reads. Prints the sandbox id.
fn create_with_resolv_conf(cli: &Cli, resolv_conf: &str) -> String {
    let file = tempfile::Builder::new()
        .prefix("resolv.conf")
        .tempfile_in(&cli.data)
        .unwrap()
        .into_temp_path()
        .keep()
        .unwrap();
    std::fs::write(&file, resolv_conf).unwrap();
    // passt reads it after dropping root (to nobody), as it reads the real one.
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let out = Command::new("unshare")
        .args([
            "-m",
            "sh",
            "-c",
            r#"mount --bind "$0" /etc/resolv.conf && exec "$@""#,
        ])
        .arg(&file)
        .arg(Cli::program())
        .args(cli.base_args())
        .args(["sandbox", "create", "--timeout", "15m"])
        .env_remove("SANDPIT_AGENT_BIN")
        .output()
        .unwrap_or_else(|e| panic!("unshare is missing ({e}); install util-linux"));
    assert!(
        out.status.success(),
        "sandbox create with its own resolv.conf failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// The default-DNS tests share a data directory, so the snapshot template
/// is built once.
fn dns_cli() -> &'static Cli {
    static CLI: std::sync::OnceLock<Cli> = std::sync::OnceLock::new();
    CLI.get_or_init(Cli::new)
}

fn exec(cli: &Cli, id: &str, command: &str) -> Output {
    cli.run(&[
        "sandbox",
        "exec",
        id,
        "--timeout-ms",
        "60000",
        "--",
        command,
    ])
}

fn exec_ok(cli: &Cli, id: &str, command: &str) -> String {
    cli.ok(&[
        "sandbox",
        "exec",
        id,
        "--timeout-ms",
        "60000",
        "--",
        command,
    ])
}

/// The address the guest resolves `name` to (`getent hosts`, as glibc
/// programs resolve).
fn resolve(cli: &Cli, id: &str, name: &str, resolver: &str) -> String {
    let out = exec(cli, id, &format!("getent hosts {name}"));
    assert!(
        out.status.success(),
        "the guest could not resolve {name} ({}): its resolver {} should have \
         forwarded the query to {resolver}, the host's resolver",
        out.status,
        sandpit_runtime::net::GUEST_DNS_FORWARD
    );
    let hosts = String::from_utf8(out.stdout).unwrap();
    hosts
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string()
}

#[test]
fn by_default_the_guest_resolves_names_with_the_hosts_private_resolver() {
    let www = data_dir();
    std::fs::write(www.join("hello.txt"), "hello by name\n").unwrap();
    let mut host = TestHost::start("dns", DNS_HOST_SIDE, DNS_INTERNET);
    host.serve_http(&www);
    host.add_address(VPC_RESOLVER);
    host.serve_dns(VPC_RESOLVER, DNS_INTERNET);

    let cli = dns_cli();
    let id = create_with_resolv_conf(
        cli,
        &format!("# as on a cloud VM\nsearch ec2.internal\nnameserver {VPC_RESOLVER}\n"),
    );
    assert_eq!(
        resolve(cli, &id, "pypi.example.test", VPC_RESOLVER),
        DNS_INTERNET
    );
    assert_eq!(
        exec_ok(
            cli,
            &id,
            "curl -sS -m 20 http://pypi.example.test:8080/hello.txt"
        ),
        "hello by name\n"
    );
    // The resolver itself is on a private address, out of the guest's reach:
    // only passt, on the host, talks to it.
    let direct = format!(
        "python3 -c 'import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); \
         s.settimeout(5); s.connect((\"{VPC_RESOLVER}\", 53)); \
         s.send(bytes.fromhex(\"{}\")); print(s.recv(512).hex())'",
        hex::encode(dns_query())
    );
    let out = exec(cli, &id, &direct);
    assert!(
        !out.status.success(),
        "the guest queried the private resolver directly: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    cli.ok(&["sandbox", "rm", &id]);
}

/// A DNS server on the host's loopback, stopped on drop.
struct LoopbackResolver {
    address: String,
    server: Child,
}

impl LoopbackResolver {
    fn start(answer: &str) -> LoopbackResolver {
        // Not 127.0.0.53: a host may run systemd-resolved there.
        let address = format!("127.53.{}.1", std::process::id() % 250 + 1);
        let server = Command::new("python3")
            .args(["-c", DNS_SERVER, &address, answer])
            .spawn()
            .expect("python3 (install python3)");
        wait_for_dns(&address, answer);
        LoopbackResolver { address, server }
    }
}

impl Drop for LoopbackResolver {
    fn drop(&mut self) {
        let _ = self.server.kill();
        let _ = self.server.wait();
    }
}

#[test]
fn by_default_the_guest_resolves_names_with_the_hosts_loopback_resolver() {
    let answer = "198.51.100.53";
    let resolver = LoopbackResolver::start(answer);
    let cli = dns_cli();
    let id = create_with_resolv_conf(
        cli,
        &format!(
            "# as systemd-resolved writes it\nnameserver {}\noptions edns0 trust-ad\nsearch .\n",
            resolver.address
        ),
    );
    // The guest asks passt's forwarder, which asks the host's loopback.
    assert_eq!(
        exec_ok(cli, &id, "grep ^nameserver /etc/resolv.conf"),
        format!("nameserver {}\n", sandpit_runtime::net::GUEST_DNS_FORWARD)
    );
    assert_eq!(
        resolve(cli, &id, "registry.example.test", &resolver.address),
        answer
    );
    cli.ok(&["sandbox", "rm", &id]);
}
