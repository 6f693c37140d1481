//! The Debian package as an operator meets it: `scripts/package.sh` builds
//! it; a clean Debian 12 root (debootstrap, with bookworm-backports as the
//! README says) boots systemd in `systemd-nspawn`; `apt-get install
//! ./sandpit_*.deb` there pulls in every dependency and starts
//! `sandpit.service` with its hardening; `sandpit doctor` in that root
//! finds the host ready; the key the first start printed is in the unit's
//! journal; a sandbox made through the service answers, survives a
//! `systemctl restart` and a SIGKILL of the server (restarted by systemd),
//! and is destroyed; a second one, restored from the snapshot template the
//! service built, is forked, paused and resumed under the unit's
//! hardening. The guest image the test script built is bound into the root
//! (the packaged agent is the same binary, so the image is the same):
//! building it again would only repeat `image build`'s own tests.
//! The container shares the host's network (apt needs the mirror); the
//! test checks that the host's routes, links and firewall are as they were.

use crate::common::netns::HostNetworkLock;
use crate::common::serve::Rest;
use crate::common::*;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The host's package cache, shared with the root (debootstrap and apt in
/// the container): packages the host already fetched (QEMU from backports,
/// among them) are not downloaded again on every run.
const APT_ARCHIVES: &str = "/var/cache/apt/archives";

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn need(tool: &str, package: &str) {
    let found = Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    assert!(
        found,
        "{tool} is missing: apt-get install {package} (scripts/install-deps.sh does)"
    );
}

/// A booted container; killed (and with it every process in it) when
/// dropped, whatever the test did.
struct Container {
    nspawn: Child,
    leader: u32,
    /// The container's PID namespace (`pid:[N]`).
    pid_ns: PathBuf,
}

impl Container {
    /// Boots `root`, with the test script's `images` under an overlay
    /// (the service writes its own `current.json`, naming its paths, which
    /// must not reach the other tests' copy) whose writes go to `upper`.
    fn boot(root: &Path, images: &Path, upper: &Path, log: &Path) -> Container {
        std::fs::create_dir_all(upper).unwrap();
        let nspawn = Command::new("systemd-nspawn")
            .args(["--register=no", "--keep-unit", "--quiet", "-b", "-D"])
            .arg(root)
            // The guard of the guests' network is an nftables table.
            .arg("--capability=CAP_NET_ADMIN")
            .arg(format!("--bind={APT_ARCHIVES}"))
            .arg(format!(
                "--overlay={}:{}:/var/lib/sandpit/images",
                images.display(),
                upper.display()
            ))
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(log).unwrap())
            .stderr(Stdio::from(
                std::fs::File::options().append(true).open(log).unwrap(),
            ))
            .spawn()
            .expect("systemd-nspawn (apt-get install systemd-container)");
        // The container's PID 1 is the descendant of nspawn that runs
        // systemd (nspawn forks and execs on its way there).
        let t = Instant::now();
        let leader = loop {
            let found = descendants(nspawn.id()).into_iter().find(|pid| {
                std::fs::read_to_string(format!("/proc/{pid}/comm"))
                    .is_ok_and(|c| c.trim() == "systemd")
            });
            if let Some(pid) = found {
                break pid;
            }
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "systemd did not start in the container: {}",
                std::fs::read_to_string(log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(200));
        };
        let c = Container {
            nspawn,
            leader,
            pid_ns: std::fs::read_link(format!("/proc/{leader}/ns/pid")).unwrap(),
        };
        // `--wait` waits while systemd starts; before it listens, it says
        // "offline".
        let mut state = String::new();
        while t.elapsed() < Duration::from_secs(120) {
            state = c.sh("systemctl is-system-running --wait || true");
            if state.contains("running") || state.contains("degraded") {
                return c;
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        panic!("systemd in the container: {state}");
    }

    /// Runs `script` in the container (its mount, PID, UTS and IPC
    /// namespaces; the network is the host's); returns its stdout, panics
    /// on failure.
    fn sh(&self, script: &str) -> String {
        let out = Command::new("nsenter")
            .args(["-t", &self.leader.to_string(), "-m", "-u", "-i", "-p", "--"])
            .args(["sh", "-c", script])
            // Nothing of the test's environment (its images directory,
            // its agent) leaks into the operator's shell.
            .env_clear()
            .env("DEBIAN_FRONTEND", "noninteractive")
            .env("LANG", "C.UTF-8")
            .env(
                "PATH",
                "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            )
            .output()
            .expect("nsenter (util-linux)");
        assert!(
            out.status.success(),
            "in the container: {script}\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

/// Every process of the host, with its parent.
fn process_parents() -> Vec<(u32, u32)> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| {
            let pid: u32 = e.ok()?.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            // `PID (COMM) STATE PPID …`: COMM may hold spaces and parens.
            let ppid = stat
                .rsplit_once(')')?
                .1
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()?;
            Some((pid, ppid))
        })
        .collect()
}

/// `pid`'s descendants.
fn descendants(pid: u32) -> Vec<u32> {
    let all = process_parents();
    let mut out = vec![pid];
    let mut i = 0;
    while i < out.len() {
        let parent = out[i];
        out.extend(all.iter().filter(|(_, pp)| *pp == parent).map(|(p, _)| *p));
        i += 1;
    }
    out.remove(0);
    out
}

/// The host's processes in PID namespace `pid_ns`.
fn processes_in(pid_ns: &Path) -> Vec<u32> {
    process_parents()
        .into_iter()
        .map(|(pid, _)| pid)
        .filter(|pid| {
            std::fs::read_link(format!("/proc/{pid}/ns/pid")).is_ok_and(|ns| ns == pid_ns)
        })
        .collect()
}

impl Drop for Container {
    fn drop(&mut self) {
        // The leader is the container's PID 1: when it dies, the kernel
        // kills every process of its PID namespace.
        unsafe { libc::kill(self.leader as i32, libc::SIGKILL) };
        let _ = self.nspawn.wait();
    }
}

/// What of the host's network a booted Debian root could change, since the
/// container shares it (with `CAP_NET_ADMIN`, for the guests' guard): the
/// routes, the links, forwarding, and the nftables tables but the guard's
/// own (shared by design: each server touches only its VMs' chains).
fn host_network() -> String {
    let run = |program: &str, args: &[&str]| {
        let out = Command::new(program).args(args).output().unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let tables: Vec<String> = run("nft", &["list", "tables"])
        .lines()
        .filter(|t| !t.contains(sandpit_runtime::vm::guard::TABLE))
        .map(str::to_string)
        .collect();
    format!(
        "routes:\n{}links:\n{}ip_forward: {}tables: {tables:?}",
        run("ip", &["route", "show", "table", "all"]),
        run("ip", &["-br", "link"]),
        std::fs::read_to_string("/proc/sys/net/ipv4/ip_forward").unwrap(),
    )
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn wait_for_http(url: &str, bound: Duration) {
    wait_until("the service answers", bound, || {
        std::net::TcpStream::connect(url.trim_start_matches("http://")).is_ok()
    });
}

#[test]
fn the_package_installs_in_a_clean_debian_root_and_its_service_serves_sandboxes() {
    for (tool, package) in [
        ("debootstrap", "debootstrap"),
        ("systemd-nspawn", "systemd-container"),
        ("nsenter", "util-linux"),
        ("dpkg-deb", "dpkg"),
    ] {
        need(tool, package);
    }
    // Built as an operator would, by the project's script.
    let out = Command::new(workspace().join("scripts/package.sh"))
        .current_dir(workspace())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "scripts/package.sh: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let deb = PathBuf::from(
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .last()
            .unwrap()
            .trim(),
    );
    let fields = Command::new("dpkg-deb")
        .args(["-f"])
        .arg(&deb)
        .args(["Depends", "Version"])
        .output()
        .unwrap();
    let fields = String::from_utf8_lossy(&fields.stdout).into_owned();
    for dep in ["qemu-system-x86", "passt", "nftables", "libnss-myhostname"] {
        assert!(fields.contains(dep), "Depends lacks {dep}: {fields}");
    }

    // A clean Debian 12 root with systemd, and backports for QEMU 10.
    let dir = tempfile::Builder::new()
        .prefix("sandpit-package-")
        .tempdir_in(workspace().join("target"))
        .unwrap();
    let root = dir.path().join("root");
    let strap = Command::new("debootstrap")
        .args([
            "--variant=minbase",
            "--include=systemd,systemd-sysv,dbus,curl,ca-certificates",
            &format!("--cache-dir={APT_ARCHIVES}"),
            "bookworm",
        ])
        .arg(&root)
        .arg(sandpit_runtime::image::DEFAULT_MIRROR)
        .output()
        .unwrap();
    assert!(
        strap.status.success(),
        "debootstrap: {}",
        String::from_utf8_lossy(&strap.stderr)
    );
    std::fs::write(
        root.join("etc/apt/sources.list.d/bookworm-backports.list"),
        format!(
            "deb {} bookworm-backports main\n",
            sandpit_runtime::image::DEFAULT_MIRROR
        ),
    )
    .unwrap();
    std::fs::copy(&deb, root.join("root/sandpit.deb")).unwrap();
    // The operator's own settings, as a drop-in: a free port and a warm
    // pool of one (its refill builds the snapshot template that snapshots,
    // forks and pauses save against).
    let port = free_port();
    let dropin = root.join("etc/systemd/system/sandpit.service.d");
    std::fs::create_dir_all(&dropin).unwrap();
    std::fs::write(
        dropin.join("local.conf"),
        format!("[Service]\nEnvironment=SANDPIT_LISTEN=127.0.0.1:{port} SANDPIT_POOL=small=1\n"),
    )
    .unwrap();
    std::fs::create_dir_all(root.join("var/lib/sandpit/images")).unwrap();

    let pointer = std::fs::read(images_dir().join("current.json")).unwrap();
    // No other test's change to the host's network may come or go until
    // the check at the end (test binaries can run at once).
    let _checking = HostNetworkLock::checking();
    let network = host_network();
    let c = Container::boot(
        &root,
        &images_dir(),
        &dir.path().join("images-upper"),
        &dir.path().join("console.log"),
    );
    // The whole set-up: apt-get install of the package.
    c.sh("apt-get update -q >/dev/null && \
         apt-get install -y -q -t bookworm-backports /root/sandpit.deb >/tmp/apt.log 2>&1 \
         || { cat /tmp/apt.log; exit 1; }");
    assert_eq!(c.sh("systemctl is-enabled sandpit").trim(), "enabled");
    let url = format!("http://127.0.0.1:{port}");
    wait_for_http(&url, Duration::from_secs(60));
    let version = c.sh("sandpit --version");
    assert!(version.contains(&head_commit()), "{version}");

    // The doctor, in the root the package set up, finds it ready.
    let doctor = c.sh("sandpit --config /etc/sandpit/sandpit.toml doctor --json || true");
    let lines: Vec<Value> = doctor
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.last().unwrap()["ready"], true, "{doctor}");
    let line = |check: &str| lines.iter().find(|l| l["check"] == check).unwrap();
    assert!(
        line("qemu")["found"]
            .as_str()
            .unwrap()
            .contains("version 10."),
        "{doctor}"
    );
    for check in [
        "guest image",
        "preview names",
        "nftables",
        "passt",
        "data directory",
    ] {
        assert_eq!(line(check)["verdict"], "ok", "{doctor}");
    }

    // The first start's key, where the unit file says it is.
    let journal = c.sh("journalctl -u sandpit --no-pager -o cat");
    let key = journal
        .split_whitespace()
        .find(|w| w.starts_with("sp_"))
        .unwrap_or_else(|| panic!("no API key in the journal:\n{journal}"))
        .to_string();
    let rest = Rest {
        http: reqwest::Client::new(),
        url: url.clone(),
        key,
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    let exec = |id: &str, command: &str| -> Value {
        rt.block_on(async {
            let (st, r) = rest
                .post(
                    &format!("/sandboxes/{id}/exec"),
                    json!({"command": command}),
                )
                .await;
            assert_eq!(st, 200, "{r}");
            r
        })
    };
    // A first create waits for the warm pool, which shows the snapshot
    // template is built: a create before it boots cold beside the build,
    // which on CI's loaded host took over the service's 60 s boot bound
    // (the service then answers 503 "retry", as it should). Sandboxes
    // restored from the template are also the ones that can be saved. The
    // template's boot has three times the bound (a guest kernel was 12 s
    // into its boot after a minute there), so this waits up to ten.
    let t = std::time::Instant::now();
    loop {
        let (_, info) = rt.block_on(rest.get("/service"));
        let pool = &info["fast_start"]["warm_pool"];
        if pool
            .as_array()
            .is_some_and(|sizes| sizes.iter().any(|s| s["ready"].as_u64() > Some(0)))
        {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(600),
            "no warm VM from a template within 600 s: {pool}\n{}",
            c.sh("journalctl -u sandpit --no-pager -o cat | tail -n 40")
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    let (st, sandbox) = rt.block_on(rest.post("/sandboxes", json!({"timeout_minutes": 30})));
    assert_eq!(st, 201, "{sandbox}");
    let id = sandbox["id"].as_str().unwrap().to_string();
    let r = exec(&id, "grep PRETTY_NAME /etc/os-release; id -un");
    assert_eq!(r["exit_code"], 0, "{r}");
    assert!(
        r["stdout"]
            .as_str()
            .unwrap()
            .contains("Debian GNU/Linux 12"),
        "{r}"
    );

    // A restart (an upgrade's, a configuration change's) keeps the sandbox.
    let boot_id = exec(&id, "cat /proc/sys/kernel/random/boot_id")["stdout"].clone();
    c.sh("systemctl restart sandpit");
    wait_for_http(&url, Duration::from_secs(60));
    assert_eq!(
        exec(&id, "cat /proc/sys/kernel/random/boot_id")["stdout"],
        boot_id,
        "the same VM, not a new one"
    );
    // A server that dies is started again, and finds its sandbox.
    let main_pid = c.sh("systemctl show -p MainPID --value sandpit");
    c.sh("systemctl kill --kill-who=main -s KILL sandpit");
    wait_until(
        "systemd starts the server again",
        Duration::from_secs(30),
        || {
            let now = c.sh("systemctl show -p MainPID --value sandpit");
            now != main_pid && now.trim() != "0"
        },
    );
    wait_for_http(&url, Duration::from_secs(60));
    assert_eq!(
        exec(&id, "cat /proc/sys/kernel/random/boot_id")["stdout"],
        boot_id
    );

    // Saves work under the unit's hardening (its data directory is the only
    // writable place; the saved memory is mounted detached): a fork copies
    // a sandbox, and a pause and a resume bring it back as it was.
    let (st, saved) = rt.block_on(rest.post("/sandboxes", json!({"timeout_minutes": 30})));
    assert_eq!(st, 201, "{saved}");
    let saved = saved["id"].as_str().unwrap().to_string();
    let r = exec(&saved, "echo unit > /workspace/marker; cat /etc/machine-id");
    assert_eq!(r["exit_code"], 0, "{r}");
    let machine_id = r["stdout"].clone();
    let (st, fork) =
        rt.block_on(rest.post(&format!("/sandboxes/{saved}/fork"), json!({"count": 1})));
    assert_eq!(st, 201, "{fork}");
    let copy = fork["sandboxes"][0]["id"].as_str().unwrap().to_string();
    let r = exec(&copy, "cat /workspace/marker; cat /etc/machine-id");
    assert_eq!(r["exit_code"], 0, "{r}");
    let out = r["stdout"].as_str().unwrap();
    assert!(out.starts_with("unit\n"), "{r}");
    assert!(
        !out.ends_with(machine_id.as_str().unwrap()),
        "the copy is not a machine of its own: {r}"
    );
    for (verb, status) in [("pause", "paused"), ("resume", "running")] {
        let (st, s) = rt.block_on(rest.post(&format!("/sandboxes/{saved}/{verb}"), json!({})));
        assert_eq!(
            (st, s["status"].as_str()),
            (200, Some(status)),
            "{verb}: {s}"
        );
    }
    assert_eq!(exec(&saved, "cat /workspace/marker")["stdout"], "unit\n");
    for path in [
        format!("/sandboxes/{copy}"),
        format!("/snapshots/{}", fork["snapshot"]["id"].as_str().unwrap()),
        format!("/sandboxes/{saved}"),
        format!("/sandboxes/{id}"),
    ] {
        let (st, gone) = rt.block_on(rest.call(reqwest::Method::DELETE, &path, None));
        assert_eq!(st, 200, "{path}: {gone}");
    }
    // Nothing of the destroyed VMs is left in the container (QEMU, passt
    // and the watchdog each name their VM); the pool's VM lives on.
    let destroyed = [&id, &saved, &copy];
    let vm_processes = |pid_ns: &Path| -> Vec<String> {
        processes_in(pid_ns)
            .into_iter()
            .filter_map(|pid| std::fs::read(format!("/proc/{pid}/cmdline")).ok())
            .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
            .filter(|c| destroyed.iter().any(|id| c.contains(id.as_str())))
            .collect()
    };
    wait_until("the VMs' processes gone", Duration::from_secs(30), || {
        vm_processes(&c.pid_ns).is_empty()
    });
    assert!(!processes_in(&c.pid_ns).is_empty());
    let pid_ns = c.pid_ns.clone();
    drop(c);
    let left = processes_in(&pid_ns);
    assert!(
        left.is_empty(),
        "processes outlived the container: {left:?}"
    );
    assert_eq!(
        std::fs::read(images_dir().join("current.json")).unwrap(),
        pointer,
        "the test script's images are as they were"
    );
    assert_eq!(host_network(), network, "the host's network is as it was");
}
