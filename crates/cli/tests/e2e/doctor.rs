//! `sandpit doctor` as an operator runs it: on this machine (set up by the
//! test script, so ready), and on the same machine broken the way hosts
//! are found broken (no `*.localhost` resolver module, no nameserver, a
//! data directory others can write, another program on the port, also
//! while this data directory's server runs elsewhere), in a
//! mount namespace of the test's own so the machine itself is untouched.

use crate::common::cli::Cli;
use crate::common::*;
use serde_json::Value;
use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::process::{Command, Output};

const CHECKS: [&str; 15] = [
    "root",
    "kvm",
    "qemu",
    "passt",
    "nftables",
    "ksm",
    "preview names",
    "guest dns",
    "data directory",
    "disk",
    "memory",
    "guest image",
    "snapshot memory",
    "listen",
    "clock",
];

/// The `--json` report: each check's line by name, and the summary.
fn report(out: &Output) -> (BTreeMap<String, Value>, Value) {
    let text = String::from_utf8_lossy(&out.stdout);
    let mut lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l:?}")))
        .collect();
    let summary = lines.pop().expect("a summary line");
    let checks = lines
        .into_iter()
        .map(|l| (l["check"].as_str().unwrap().to_string(), l))
        .collect();
    (checks, summary)
}

/// An address no program listens on now.
fn free_address() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().to_string()
}

/// `sandpit doctor --json` (in a mount namespace that `wrap` sets up), for
/// a server that would listen on `listen`.
fn doctor(cli: &Cli, wrap: Option<&str>, listen: &str) -> Output {
    let mut cmd = match wrap {
        None => Command::new(Cli::program()),
        Some(script) => {
            let mut c = Command::new("unshare");
            // `sh -c SCRIPT doctor PROGRAM ARGS…`: the script ends with
            // `exec "$@"`.
            c.args(["--mount", "--propagation", "private", "sh", "-c", script])
                .arg("doctor")
                .arg(Cli::program());
            c
        }
    };
    cmd.args(cli.base_args())
        .args(["doctor", "--json"])
        .env_remove("SANDPIT_AGENT_BIN")
        .env("SANDPIT_LISTEN", listen)
        .output()
        .expect("unshare (util-linux) and the sandpit binary")
}

#[test]
fn this_host_is_ready_and_the_report_says_why_kvm_is_or_is_not_used() {
    let cli = Cli::new();
    let out = doctor(&cli, None, &free_address());
    let (checks, summary) = report(&out);
    assert_eq!(checks.len(), CHECKS.len(), "{checks:#?}");
    for name in CHECKS {
        assert!(checks.contains_key(name), "no {name} line: {checks:#?}");
    }
    assert_eq!(out.status.code(), Some(0), "{checks:#?}");
    assert_eq!(summary["ready"], true, "{summary}");
    for name in [
        "root",
        "qemu",
        "passt",
        "nftables",
        "preview names",
        "guest dns",
        "data directory",
        "guest image",
        "listen",
    ] {
        assert_eq!(checks[name]["verdict"], "ok", "{:#}", checks[name]);
    }
    // passt's own `--version` says "unknown version" on Debian: the line
    // gives its package's.
    let packaged = Command::new("dpkg-query")
        .args(["-W", "-f", "${Version}", "passt"])
        .output()
        .unwrap();
    let packaged = String::from_utf8_lossy(&packaged.stdout);
    assert!(!packaged.is_empty(), "passt is not a Debian package here");
    let passt = checks["passt"]["found"].as_str().unwrap();
    assert!(
        passt.contains(packaged.trim()),
        "{passt} (package {packaged})"
    );
    // Starts from a save share its memory where the kernel can compose
    // files (Linux 6.12), as the saved-VM tests prove it can here.
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    let version: Vec<u32> = release
        .split(|c: char| !c.is_ascii_digit())
        .take(2)
        .map(|n| n.parse().unwrap())
        .collect();
    let memory = &checks["snapshot memory"];
    let want = if version >= vec![6, 12] { "ok" } else { "warn" };
    assert_eq!(memory["verdict"], want, "{memory:#}");
    // The KVM line agrees with what the machine shows, read here apart.
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap();
    let flagged = cpuinfo
        .lines()
        .filter(|l| l.starts_with("flags"))
        .any(|l| l.split_whitespace().any(|f| f == "vmx" || f == "svm"));
    let opens = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_ok();
    let kvm = &checks["kvm"];
    let found = kvm["found"].as_str().unwrap();
    if flagged && opens {
        assert_eq!(kvm["verdict"], "ok", "{kvm:#}");
    } else {
        assert_eq!(kvm["verdict"], "warn", "{kvm:#}");
        let why = if flagged { "/dev/kvm" } else { "vmx/svm" };
        assert!(found.contains(why), "{kvm:#}");
        assert!(kvm["fix"].as_str().unwrap().contains("TCG"), "{kvm:#}");
    }
    // Its human form says the same, line by line.
    let human = Command::new(Cli::program())
        .args(cli.base_args())
        .arg("doctor")
        .env_remove("SANDPIT_AGENT_BIN")
        .env("SANDPIT_LISTEN", free_address())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&human.stdout);
    assert_eq!(human.status.code(), Some(0), "{text}");
    assert!(
        text.lines().next().unwrap().contains(&head_commit()),
        "{text}"
    );
    assert!(text.trim_end().ends_with("fine"), "{text}");
    assert!(text.contains("ready: 0 failed"), "{text}");
}

#[test]
fn a_broken_host_fails_and_each_broken_line_says_what_to_do() {
    let cli = Cli::new();
    let before = report(&doctor(&cli, None, &free_address())).0;
    // Another program listens where the server would.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken_addr = taken.local_addr().unwrap().to_string();
    // Others may write the data directory.
    std::fs::set_permissions(&cli.data, std::fs::Permissions::from_mode(0o777)).unwrap();
    // No nss-myhostname, and no nameserver, seen only by this process.
    let broken = cli.data.join("broken-etc");
    std::fs::create_dir_all(&broken).unwrap();
    std::fs::write(broken.join("nsswitch.conf"), "hosts: files\n").unwrap();
    std::fs::write(broken.join("resolv.conf"), "# no nameserver\n").unwrap();
    let script = format!(
        "mount --bind {0}/nsswitch.conf /etc/nsswitch.conf && \
         mount --bind {0}/resolv.conf /etc/resolv.conf && exec \"$@\"",
        broken.display()
    );
    let out = doctor(&cli, Some(&script), &taken_addr);
    drop(taken);
    std::fs::set_permissions(&cli.data, std::fs::Permissions::from_mode(0o700)).unwrap();
    let (checks, summary) = report(&out);
    assert_eq!(
        out.status.code(),
        Some(1),
        "{checks:#?}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(summary["ready"], false);
    assert_eq!(summary["failed"], 4, "{checks:#?}");
    let fix = |name: &str| -> String {
        assert_eq!(checks[name]["verdict"], "fail", "{:#}", checks[name]);
        checks[name]["fix"].as_str().unwrap().to_string()
    };
    assert!(fix("preview names").contains("libnss-myhostname"));
    assert!(fix("guest dns").contains("nameserver"));
    assert!(fix("data directory").contains("chmod go-w"));
    assert!(fix("listen").contains("SANDPIT_LISTEN"));
    assert!(checks["listen"]["found"]
        .as_str()
        .unwrap()
        .contains(&taken_addr));
    // Nothing else changed its mind.
    for name in CHECKS {
        if !["preview names", "guest dns", "data directory", "listen"].contains(&name) {
            assert_eq!(
                checks[name]["verdict"], before[name]["verdict"],
                "{name}: {:#} then {:#}",
                before[name], checks[name]
            );
        }
    }
}

/// A running server of this data directory makes its own port fine, and
/// only its own: another program on the configured port, while the server
/// listens elsewhere, is still a failure.
#[test]
fn a_port_is_the_servers_only_if_its_socket_is() {
    let cli = Cli::new();
    let server = crate::common::serve::Server::start_with(&cli.data, "[pool]\nsizes = {}\n");
    let own = server.url.trim_start_matches("http://").to_string();
    let (checks, _) = report(&doctor(&cli, None, &own));
    assert_eq!(checks["listen"]["verdict"], "ok", "{:#}", checks["listen"]);
    assert!(
        checks["listen"]["found"]
            .as_str()
            .unwrap()
            .contains("this data directory's sandpit serve"),
        "{:#}",
        checks["listen"]
    );
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let other = taken.local_addr().unwrap().to_string();
    let (checks, _) = report(&doctor(&cli, None, &other));
    drop(taken);
    assert_eq!(
        checks["listen"]["verdict"], "fail",
        "{:#}",
        checks["listen"]
    );
    assert!(
        checks["listen"]["found"]
            .as_str()
            .unwrap()
            .contains("another program"),
        "{:#}",
        checks["listen"]
    );
    drop(server);
}

/// A QEMU of another series than the one whose RAM block table the save
/// path reads is a warning that says what is refused and why.
#[test]
fn a_qemu_outside_the_known_series_is_a_warning_naming_the_unstable_command() {
    use std::os::unix::fs::PermissionsExt;
    let cli = Cli::new();
    let bin = cli.data.join("qemu-11");
    std::fs::create_dir_all(&bin).unwrap();
    let qemu = bin.join("qemu-system-x86_64");
    std::fs::write(&qemu, "#!/bin/sh\necho 'QEMU emulator version 11.0.0'\n").unwrap();
    std::fs::set_permissions(&qemu, std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap());
    let out = Command::new(Cli::program())
        .args(cli.base_args())
        .args(["doctor", "--json"])
        .env_remove("SANDPIT_AGENT_BIN")
        .env("SANDPIT_LISTEN", free_address())
        .env("PATH", path)
        .output()
        .unwrap();
    let (checks, _) = report(&out);
    let qemu = &checks["qemu"];
    assert_eq!(qemu["verdict"], "warn", "{qemu:#}");
    assert!(
        qemu["found"].as_str().unwrap().contains("11.0.0"),
        "{qemu:#}"
    );
    assert!(
        qemu["fix"].as_str().unwrap().contains("x-query-ramblock"),
        "{qemu:#}"
    );
}
