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
//! directory the next start's sweep destroys, chain and all. (A chain left
//! anyway is harmless: no process has its uid, and it is replaced when the
//! uid is used again.)

use crate::{Result, RuntimeError};
use std::io::Write;
use std::net::IpAddr;
use std::process::{Command, Stdio};

/// The nftables table of the host's guards.
pub const TABLE: &str = "sandpit_guests";

/// What a VM's passt may not reach, and the exemptions before that.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuardPlan {
    /// Denied prefixes and addresses, as nft reads them (`10.0.0.0/8`,
    /// `169.254.169.254`, `fd00::/8`).
    pub deny: Vec<String>,
    /// Name servers reached on port 53 although denied.
    pub dns: Vec<IpAddr>,
    /// The operator's proxy, reached on its TCP port although denied.
    pub proxy: Option<(IpAddr, u16)>,
}

/// The chain of the VM whose passt runs as `uid`.
fn chain(uid: u32) -> String {
    format!("vm_{uid}")
}

/// The transaction that makes (or remakes) the guard of `uid`.
pub fn script(uid: u32, plan: &GuardPlan) -> String {
    let c = chain(uid);
    let family = |a: &IpAddr| if a.is_ipv4() { "ip" } else { "ip6" };
    let mut s = format!(
        "table inet {TABLE} {{\n\
         \tmap guests {{ type uid : verdict; }}\n\
         \tchain output {{ type filter hook output priority 0; policy accept; }}\n\
         \tchain {c} {{ }}\n\
         }}\n\
         flush chain inet {TABLE} output\n\
         add rule inet {TABLE} output meta skuid vmap @guests\n\
         flush chain inet {TABLE} {c}\n"
    );
    let rule = |s: &mut String, r: &str| s.push_str(&format!("add rule inet {TABLE} {c} {r}\n"));
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
    for d in &plan.deny {
        let (f, icmp) = if d.contains(':') {
            ("ip6", "icmpv6")
        } else {
            ("ip", "icmp")
        };
        rule(
            &mut s,
            &format!("{f} daddr {d} meta l4proto tcp reject with tcp reset"),
        );
        rule(
            &mut s,
            &format!("{f} daddr {d} reject with {icmp} type admin-prohibited"),
        );
    }
    rule(
        &mut s,
        "fib daddr type local meta l4proto tcp reject with tcp reset",
    );
    rule(&mut s, "fib daddr type local reject");
    rule(&mut s, "meta nfproto ipv6 reject");
    s.push_str(&format!(
        "add element inet {TABLE} guests {{ {uid} : jump {c} }}\n"
    ));
    s
}

/// Make the guard of the VM whose passt runs as `uid`.
pub fn install(uid: u32, plan: &GuardPlan) -> Result<()> {
    nft(&script(uid, plan)).map_err(|e| {
        RuntimeError::Launch(format!(
            "installing the host's network guard for uid {uid}: {e}"
        ))
    })
}

/// Remove the guard of `uid` (nothing if there is none).
pub fn remove(uid: u32) {
    let c = chain(uid);
    // Two transactions: the element may be gone while the chain is not.
    let _ = nft(&format!("delete element inet {TABLE} guests {{ {uid} }}\n"));
    let _ = nft(&format!("delete chain inet {TABLE} {c}\n"));
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
        }
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
        at("vm_3000123 meta nfproto ipv6 reject");
        at("guests { 3000123 : jump vm_3000123 }");
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
            .write_all(script(3_000_123, &plan()).as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "nft rejected the script: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
