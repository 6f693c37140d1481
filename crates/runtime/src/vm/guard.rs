//! The host's own enforcement of a guest's deny list.
//!
//! The agent's packet filter in the guest (see `sandpit-agent`'s `net`)
//! is the first fence, but it is the guest's: a user who becomes root in
//! the guest (an old guest kernel, a setuid bug) can flush it. Every packet
//! a guest sends to the world leaves the host from its passt, though, and
//! each VM's passt runs as that VM's own unprivileged uid (the same as its
//! QEMU's; `--runas`). So the host filters by socket owner: table
//! `inet sandpit_guests` has one base chain on the output hook that jumps,
//! through the map `guests` (uid -> verdict), to the VM's own chain
//! `vm_<uid>`, which rejects what its guest may not reach:
//!
//! - every denied prefix, as the guest's filter does (with its DNS and
//!   proxy exemptions first: port 53 of the resolver passt forwards to, or
//!   of the configured name servers, and the proxy's address and port);
//! - every address of the host itself, matched when each packet is sent
//!   (`fib daddr type local`), so an address the host gains after the VM
//!   started is covered too, loopback included;
//! - all of IPv6 (passt runs `--ipv4-only`).
//!
//! Each VM's chain is (re)made in one atomic `nft` transaction before its
//! passt starts, together with the table and the base chain's one rule
//! (declared, then flushed and refilled: idempotent, and safe when several
//! `sandpit` processes share the host, since each only touches its VMs'
//! chains). The chain goes when the VM is destroyed, or when its start
//! fails. The VM's uid is written in its directory before its chain goes in,
//! so a start that died before its record was written (a crash) leaves a
//! directory the next start's sweep destroys, chain and all.
//!
//! A chain can still outlive its VM: a data directory deleted by hand, a
//! VM killed with its server and never destroyed by a later one. Such a
//! chain is harmless (no process has its uid, and it is replaced when the
//! uid is used again), but they add up: a test host once held 69. So every
//! VM manager [`sweep`]s at its start: a chain whose uid runs no process and
//! whose last rule says it was made over ten minutes ago goes. Installing
//! and sweeping take one host-wide lock, so a sweep never removes a chain
//! another process has just remade for a VM it is starting.

use crate::{Result, RuntimeError};
use nix::fcntl::{Flock, FlockArg};
use std::io::Write;
use std::net::IpAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The nftables table of the host's guards.
pub const TABLE: &str = "sandpit_guests";

/// What a VM's passt may not reach, and the exemptions before that.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GuardPlan {
    /// Denied prefixes and addresses, as nft reads them (`10.0.0.0/8`,
    /// `169.254.169.254`, `fd00::/8`).
    pub deny: Vec<String>,
    /// Name servers reached on port 53 although denied.
    pub dns: Vec<IpAddr>,
    /// The operator's proxy, reached on its TCP port although denied.
    pub proxy: Option<(IpAddr, u16)>,
    /// A sandbox's own prefixes let through after `deny` and the host's
    /// addresses (never past them)…
    pub then_allow: Vec<String>,
    /// …and its own refused after that.
    pub then_deny: Vec<String>,
    /// The loopback port of the VM's egress proxy, when its lists name
    /// hosts: its connections to TCP ports 80 and 443 go there instead
    /// (those to what `deny` refuses or to the host's own addresses are
    /// not redirected, and are refused as ever), and the proxy decides.
    pub redirect: Option<u16>,
    /// Whether its DNS (UDP and TCP port 53, to any server, the host's
    /// own included) goes to the proxy's port too, to be answered by the
    /// lists' names (see `egress::dns`).
    pub filter_dns: bool,
}

/// The ports whose connections the egress proxy looks at.
pub const PROXIED_PORTS: [u16; 2] = [80, 443];

/// The chain of the VM whose passt runs as `uid`.
fn chain(uid: u32) -> String {
    format!("vm_{uid}")
}

/// Its chain on the NAT hook (the egress proxy's redirect).
fn nat_chain(uid: u32) -> String {
    format!("vmnat_{uid}")
}

/// The transaction that makes (or remakes) the guard of `uid`.
pub fn script(uid: u32, plan: &GuardPlan) -> String {
    let c = chain(uid);
    let n = nat_chain(uid);
    let family = |a: &IpAddr| if a.is_ipv4() { "ip" } else { "ip6" };
    let mut s = format!(
        "table inet {TABLE} {{\n\
         \tmap guests {{ type uid : verdict; }}\n\
         \tmap nat_guests {{ type uid : verdict; }}\n\
         \tchain output {{ type filter hook output priority 0; policy accept; }}\n\
         \tchain nat_output {{ type nat hook output priority -100; policy accept; }}\n\
         \tchain {c} {{ }}\n\
         \tchain {n} {{ }}\n\
         }}\n\
         flush chain inet {TABLE} output\n\
         add rule inet {TABLE} output meta skuid vmap @guests\n\
         flush chain inet {TABLE} nat_output\n\
         add rule inet {TABLE} nat_output meta skuid vmap @nat_guests\n\
         flush chain inet {TABLE} {c}\n\
         flush chain inet {TABLE} {n}\n"
    );
    let rule = |s: &mut String, r: &str| s.push_str(&format!("add rule inet {TABLE} {c} {r}\n"));
    let nat_rule =
        |s: &mut String, r: &str| s.push_str(&format!("add rule inet {TABLE} {n} {r}\n"));
    let ports = PROXIED_PORTS.map(|p| p.to_string()).join(", ");
    if let Some(port) = plan.redirect.filter(|_| plan.filter_dns) {
        // Every lookup, whichever server it is for: the proxy asks the
        // guests' own name servers (a denied one too: that is the
        // resolver the operator configured).
        nat_rule(
            &mut s,
            &format!(
                "meta nfproto ipv4 meta l4proto {{ tcp, udp }} th dport 53 redirect to :{port}"
            ),
        );
    }
    if let Some(port) = plan.redirect {
        // What the guard refuses is not redirected: it is refused below.
        for d in &plan.deny {
            let f = if d.contains(':') { "ip6" } else { "ip" };
            nat_rule(&mut s, &format!("{f} daddr {d} return"));
        }
        nat_rule(&mut s, "fib daddr type local return");
        nat_rule(
            &mut s,
            &format!("meta nfproto ipv4 tcp dport {{ {ports} }} redirect to :{port}"),
        );
    }
    for d in &plan.dns {
        let f = family(d);
        rule(&mut s, &format!("{f} daddr {d} udp dport 53 accept"));
        rule(&mut s, &format!("{f} daddr {d} tcp dport 53 accept"));
    }
    if let Some((a, port)) = plan.proxy {
        rule(
            &mut s,
            &format!("{} daddr {a} tcp dport {port} accept", family(&a)),
        );
    }
    if let Some(port) = plan.redirect {
        // Only what the NAT chain redirected reaches the proxy's port.
        rule(
            &mut s,
            &format!(
                "ct status dnat ip daddr 127.0.0.1 meta l4proto {{ tcp, udp }} th dport {port} accept"
            ),
        );
    }
    let reject = |s: &mut String, d: &str| {
        let (f, icmp) = if d.contains(':') {
            ("ip6", "icmpv6")
        } else {
            ("ip", "icmp")
        };
        rule(
            s,
            &format!("{f} daddr {d} meta l4proto tcp reject with tcp reset"),
        );
        rule(
            s,
            &format!("{f} daddr {d} reject with {icmp} type admin-prohibited"),
        );
    };
    for d in &plan.deny {
        reject(&mut s, d);
    }
    rule(
        &mut s,
        "fib daddr type local meta l4proto tcp reject with tcp reset",
    );
    rule(&mut s, "fib daddr type local reject");
    for a in &plan.then_allow {
        rule(&mut s, &format!("ip daddr {a} accept"));
    }
    for d in &plan.then_deny {
        reject(&mut s, d);
    }
    let made = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs();
    rule(
        &mut s,
        &format!("meta nfproto ipv6 reject comment \"{MADE}{made}\""),
    );
    s.push_str(&format!(
        "add element inet {TABLE} guests {{ {uid} : jump {c} }}\n"
    ));
    if plan.redirect.is_some() {
        s.push_str(&format!(
            "add element inet {TABLE} nat_guests {{ {uid} : jump {n} }}\n"
        ));
    } else {
        // Declared and deleted: gone whether or not it was there.
        s.push_str(&format!(
            "add element inet {TABLE} nat_guests {{ {uid} : jump {n} }}\n\
             delete element inet {TABLE} nat_guests {{ {uid} }}\n"
        ));
    }
    s
}

/// How old a chain with no process of its uid must be for [`sweep`] to
/// remove it: far longer than a start takes from its guard to its passt.
pub const SWEEP_AFTER: Duration = Duration::from_secs(600);

/// The comment on a chain's last rule, before the second it was made.
const MADE: &str = "sandpit guard made at ";

/// The lock every install and sweep on this host takes (see the module
/// docs); `None` when it cannot be opened, which only a sweep minds.
fn host_lock() -> Option<Flock<std::fs::File>> {
    let path = "/run/lock/sandpit-guards.lock";
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .map_err(|e| tracing::debug!("opening {path}: {e}"))
        .ok()?;
    Flock::lock(file, FlockArg::LockExclusive)
        .map_err(|(_, e)| tracing::debug!("locking {path}: {e}"))
        .ok()
}

/// Make the guard of the VM whose passt runs as `uid`.
pub fn install(uid: u32, plan: &GuardPlan) -> Result<()> {
    let _lock = host_lock();
    nft(&script(uid, plan)).map_err(|e| {
        RuntimeError::Launch(format!(
            "installing the host's network guard for uid {uid}: {e}"
        ))
    })
}

/// Remove the guard of `uid` (nothing if there is none).
pub fn remove(uid: u32) {
    let c = chain(uid);
    let n = nat_chain(uid);
    // Apart: an element may be gone while its chain is not.
    let _ = nft(&format!("delete element inet {TABLE} guests {{ {uid} }}\n"));
    let _ = nft(&format!(
        "delete element inet {TABLE} nat_guests {{ {uid} }}\n"
    ));
    let _ = nft(&format!("delete chain inet {TABLE} {c}\n"));
    let _ = nft(&format!("delete chain inet {TABLE} {n}\n"));
}

/// Remove the guards of uids no process runs as, made over `min_age` ago
/// (see the module docs); returns how many went. Chains of an older
/// Sandpit, with no time on them, count as old.
pub fn sweep(min_age: Duration) -> usize {
    let Some(_lock) = host_lock() else {
        return 0;
    };
    let Ok(out) = Command::new("nft")
        .args(["-j", "list", "table", "inet", TABLE])
        .stderr(Stdio::null())
        .output()
    else {
        return 0;
    };
    if !out.status.success() {
        return 0; // no table: nothing to sweep
    }
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs();
    let running = uids_running();
    let mut gone = 0;
    for (uid, made) in chains(&out.stdout) {
        let young = made.is_some_and(|t| now.saturating_sub(t) < min_age.as_secs());
        if young || running.contains(&uid) {
            continue;
        }
        remove(uid);
        gone += 1;
    }
    if gone > 0 {
        tracing::info!("removed {gone} network guards whose VMs are gone");
    }
    gone
}

/// The VM chains in `nft -j list table` output: uid, and the second the
/// chain was made when its rules say.
fn chains(json: &[u8]) -> Vec<(u32, Option<u64>)> {
    let Ok(doc) = serde_json::from_slice::<serde_json::Value>(json) else {
        return Vec::new();
    };
    let items = doc["nftables"].as_array().cloned().unwrap_or_default();
    let uid_of = |name: &serde_json::Value| name.as_str()?.strip_prefix("vm_")?.parse().ok();
    let mut out: Vec<(u32, Option<u64>)> = items
        .iter()
        .filter_map(|i| uid_of(&i["chain"]["name"]).map(|uid| (uid, None)))
        .collect();
    for rule in items.iter().map(|i| &i["rule"]) {
        let (Some(uid), Some(made)) = (
            uid_of(&rule["chain"]),
            rule["comment"]
                .as_str()
                .and_then(|c| c.strip_prefix(MADE)?.parse::<u64>().ok()),
        ) else {
            continue;
        };
        if let Some(entry) = out.iter_mut().find(|(u, _)| *u == uid) {
            entry.1 = Some(made);
        }
    }
    out
}

/// The real uids of every process on the host. (`/proc/<pid>`'s owner is
/// not one: a process that changed its uid is not dumpable, and its
/// directory is root's.)
fn uids_running() -> std::collections::HashSet<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Default::default();
    };
    dir.flatten()
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .bytes()
                .all(|b| b.is_ascii_digit())
        })
        .filter_map(|e| {
            let status = std::fs::read_to_string(e.path().join("status")).ok()?;
            let line = status.lines().find(|l| l.starts_with("Uid:"))?;
            line.split_whitespace().nth(1)?.parse().ok()
        })
        .collect()
}

/// Is there a guard for `uid`?
pub fn installed(uid: u32) -> bool {
    Command::new("nft")
        .args(["list", "chain", "inet", TABLE, &chain(uid)])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Run `nft -f -` on `script`.
fn nft(script: &str) -> std::result::Result<(), String> {
    let mut child = Command::new("nft")
        .args(["-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run nft ({e}); install Debian's nftables package"))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(script.as_bytes())
            .map_err(|e| format!("writing to nft: {e}"))?;
    }
    let out = child
        .wait_with_output()
        .map_err(|e| format!("waiting for nft: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).trim().to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan() -> GuardPlan {
        GuardPlan {
            deny: vec!["10.0.0.0/8".into(), "203.0.113.7".into(), "fd00::/8".into()],
            dns: vec!["127.0.0.53".parse().unwrap()],
            proxy: Some(("10.1.2.3".parse().unwrap(), 3128)),
            then_allow: vec!["198.51.100.0/24".into()],
            then_deny: vec!["0.0.0.0/0".into()],
            redirect: None,
            filter_dns: false,
        }
    }

    #[test]
    fn named_lists_send_web_ports_to_the_proxy_past_what_the_guard_refuses() {
        let s = script(
            3_000_123,
            &GuardPlan {
                redirect: Some(43_210),
                filter_dns: true,
                ..plan()
            },
        );
        let at = |needle: &str| {
            s.find(needle)
                .unwrap_or_else(|| panic!("{needle:?} missing from:\n{s}"))
        };
        // Not redirected: what the operator denies and the host's own
        // addresses (refused by the filter chain as ever).
        let redirect =
            at("vmnat_3000123 meta nfproto ipv4 tcp dport { 80, 443 } redirect to :43210");
        assert!(at("vmnat_3000123 ip daddr 10.0.0.0/8 return") < redirect);
        assert!(at("vmnat_3000123 fib daddr type local return") < redirect);
        // Every lookup, to a denied server or the host's own resolver too.
        let lookups = at(
            "vmnat_3000123 meta nfproto ipv4 meta l4proto { tcp, udp } th dport 53 redirect to :43210",
        );
        assert!(lookups < at("vmnat_3000123 ip daddr 10.0.0.0/8 return"));
        at("nat_guests { 3000123 : jump vmnat_3000123 }");
        // The redirected flows pass the filter before its rejects.
        let accepted = at("vm_3000123 ct status dnat ip daddr 127.0.0.1 meta l4proto { tcp, udp } th dport 43210 accept");
        assert!(accepted < at("vm_3000123 ip daddr 10.0.0.0/8 meta l4proto tcp reject"));
        // Without names: no redirect, and the element goes.
        let plain = script(3_000_123, &plan());
        assert!(!plain.contains("redirect"), "{plain}");
        // A proxy for secrets alone leaves lookups alone.
        let secrets = script(
            3_000_123,
            &GuardPlan {
                redirect: Some(43_210),
                ..plan()
            },
        );
        assert!(!secrets.contains("dport 53 redirect"), "{secrets}");
        assert!(plain.contains("delete element inet sandpit_guests nat_guests { 3000123 }"));
    }

    #[test]
    fn exemptions_come_before_the_rejects_and_the_host_is_always_denied() {
        let s = script(3_000_123, &plan());
        let at = |needle: &str| {
            s.find(needle)
                .unwrap_or_else(|| panic!("{needle:?} missing from:\n{s}"))
        };
        let first_reject = at("reject");
        assert!(at("ip daddr 127.0.0.53 udp dport 53 accept") < first_reject);
        assert!(at("ip daddr 10.1.2.3 tcp dport 3128 accept") < first_reject);
        at("vm_3000123 ip daddr 10.0.0.0/8 meta l4proto tcp reject with tcp reset");
        at("vm_3000123 ip daddr 203.0.113.7 reject with icmp type admin-prohibited");
        at("vm_3000123 ip6 daddr fd00::/8 reject with icmpv6 type admin-prohibited");
        at("vm_3000123 fib daddr type local reject");
        at("vm_3000123 meta nfproto ipv6 reject comment \"sandpit guard made at ");
        at("guests { 3000123 : jump vm_3000123 }");
        // A sandbox's own lists come after the operator's and the host's
        // rejects (an allow never opens those), its allow before its deny.
        let allowed = at("vm_3000123 ip daddr 198.51.100.0/24 accept");
        assert!(at("vm_3000123 fib daddr type local reject") < allowed);
        assert!(at("ip6 daddr fd00::/8 reject") < allowed);
        assert!(allowed < at("vm_3000123 ip daddr 0.0.0.0/0 meta l4proto tcp reject"));
    }

    #[test]
    fn a_chains_age_is_read_from_its_last_rule() {
        let listing = br#"{"nftables": [{"metainfo": {"version": "1.0.6"}},
            {"table": {"family": "inet", "name": "sandpit_guests"}},
            {"chain": {"family": "inet", "table": "sandpit_guests", "name": "output"}},
            {"chain": {"family": "inet", "table": "sandpit_guests", "name": "vm_3000001"}},
            {"chain": {"family": "inet", "table": "sandpit_guests", "name": "vm_3000002"}},
            {"rule": {"family": "inet", "table": "sandpit_guests", "chain": "vm_3000001",
                      "expr": [], "comment": "sandpit guard made at 1733450000"}},
            {"rule": {"family": "inet", "table": "sandpit_guests", "chain": "vm_3000002",
                      "expr": []}}]}"#;
        assert_eq!(
            chains(listing),
            vec![(3_000_001, Some(1_733_450_000)), (3_000_002, None)]
        );
        assert!(chains(b"not json").is_empty());
    }

    #[test]
    fn nft_accepts_the_script() {
        // `nft -c` checks a script against the kernel without applying it.
        let have_nft = Command::new("nft").arg("--version").output().is_ok();
        assert!(
            have_nft,
            "nft is missing: install Debian's nftables package"
        );
        let mut child = Command::new("nft")
            .args(["-c", "-f", "-"])
            .stdin(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(
                script(
                    3_000_123,
                    &GuardPlan {
                        redirect: Some(43_210),
                        filter_dns: true,
                        ..plan()
                    },
                )
                .as_bytes(),
            )
            .unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "nft rejected the script: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
