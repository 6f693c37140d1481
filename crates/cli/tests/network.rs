//! Outbound network, tested without the internet: a test host in a network
//! namespace plays "the internet" (an HTTP server and a DNS server the guest
//! must reach) and a server on the host plays the control plane, which the
//! guest must not reach: not through the gateway, not through the host's
//! addresses, and nothing link-local (169.254.169.254).

mod common;

use common::*;
use std::io::{Read, Write};
use std::net::TcpListener;
use std::process::{Child, Command};
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

/// A host in its own network namespace, reachable from the host over a veth pair.
struct TestHost {
    ns: String,
    veth: String,
    servers: Vec<Child>,
}

impl TestHost {
    fn start(www: &std::path::Path) -> TestHost {
        let tag = std::process::id() % 100_000;
        let ns = format!("spnet{tag}");
        let veth = format!("spv{tag}");
        let peer = format!("spp{tag}");
        // Leftovers of an earlier run that died (quietly: usually none).
        for args in [["netns", "del", &ns], ["link", "del", &veth]] {
            let _ = Command::new("ip")
                .args(args)
                .stderr(std::process::Stdio::null())
                .status();
        }
        ip(&["netns", "add", &ns]);
        ip(&["link", "add", &veth, "type", "veth", "peer", "name", &peer]);
        ip(&["link", "set", &peer, "netns", &ns]);
        ip(&["addr", "add", &format!("{HOST_SIDE}/24"), "dev", &veth]);
        ip(&["link", "set", &veth, "up"]);
        ip(&[
            "netns",
            "exec",
            &ns,
            "ip",
            "addr",
            "add",
            &format!("{INTERNET}/24"),
            "dev",
            &peer,
        ]);
        ip(&["netns", "exec", &ns, "ip", "link", "set", &peer, "up"]);
        ip(&["netns", "exec", &ns, "ip", "link", "set", "lo", "up"]);
        let http = Command::new("ip")
            .args([
                "netns",
                "exec",
                &ns,
                "python3",
                "-m",
                "http.server",
                "8080",
                "--bind",
                INTERNET,
                "--directory",
            ])
            .arg(www)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("python3 (install python3)");
        let dns = Command::new("ip")
            .args(["netns", "exec", &ns, "python3", "-c", DNS_SERVER, INTERNET])
            .spawn()
            .unwrap();
        let host = TestHost {
            ns,
            veth,
            servers: vec![http, dns],
        };
        // Wait until the HTTP server answers.
        for _ in 0..100 {
            if std::net::TcpStream::connect((INTERNET, 8080)).is_ok() {
                return host;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        panic!("the test host's HTTP server did not start");
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

/// A DNS server that answers every A query with the test host's address.
const DNS_SERVER: &str = r#"
import socket, struct, sys
addr = socket.inet_aton(sys.argv[1])
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

#[test]
fn the_guest_reaches_the_internet_but_not_the_host() {
    let www = data_dir();
    std::fs::write(www.join("hello.txt"), "hello from the internet\n").unwrap();
    let _host = TestHost::start(&www);

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
