//! The guest's network: static address, default route, DNS, and the egress
//! filter, applied with the distribution's `ip` and `nft` (run through the
//! reaper like everything else).
//!
//! Everything is validated before anything is changed, and every step is
//! idempotent (replace, flush-then-add, delete-then-create), because the host
//! sends Configure again after restoring a snapshot.
//!
//! The filter is an nftables table `inet sandpit` of our own (other tables are
//! left alone) with an output hook, so it applies to every local process,
//! root included. Denied destinations are rejected, not dropped: TCP gets a
//! reset and everything else ICMP admin-prohibited, so a denied connect fails
//! at once instead of hanging until a timeout.
//!
//! With an IPv4 configuration, IPv6 is disabled on the interface: otherwise
//! router advertisements (QEMU's user network sends them) would open a second,
//! unfiltered path to the same hosts the deny list is about.

use crate::reaper;
use crate::sys;
use sandpit_protocol::{AgentError, ErrorKind, NetworkConfig};
use std::fs;
use std::net::IpAddr;
use std::path::Path;
use std::time::Duration;

/// A network prefix: address and prefix length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    pub addr: IpAddr,
    pub prefix: u8,
}

impl Cidr {
    /// Parse `a.b.c.d/n`, `a.b.c.d` (a /32), or the IPv6 equivalents.
    pub fn parse(s: &str) -> Option<Cidr> {
        let (addr, prefix) = match s.trim().split_once('/') {
            Some((a, p)) => (a.parse::<IpAddr>().ok()?, Some(p.parse::<u8>().ok()?)),
            None => (s.trim().parse::<IpAddr>().ok()?, None),
        };
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = prefix.unwrap_or(max);
        (prefix <= max).then_some(Cidr { addr, prefix })
    }

    /// The same prefix with the host bits cleared (what nft wants).
    pub fn network(self) -> Cidr {
        let addr = match self.addr {
            IpAddr::V4(a) => {
                let mask = u32::MAX
                    .checked_shl(32 - u32::from(self.prefix))
                    .unwrap_or(0);
                IpAddr::V4((u32::from(a) & mask).into())
            }
            IpAddr::V6(a) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.prefix))
                    .unwrap_or(0);
                IpAddr::V6((u128::from(a) & mask).into())
            }
        };
        Cidr { addr, ..self }
    }
}

impl std::fmt::Display for Cidr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

/// A validated network configuration, ready to apply.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    address: Cidr,
    gateway: IpAddr,
    dns: Vec<IpAddr>,
    deny: Vec<Cidr>,
    /// The sandbox's own allow list, after `deny`.
    allow: Vec<Cidr>,
    /// The sandbox's own deny list when it has an allow list, after `allow`.
    then_deny: Vec<Cidr>,
    /// TCP ports the host's egress proxy decides, let through after `deny`.
    proxied_ports: Vec<u16>,
    /// The operator's HTTP proxy: address and TCP port.
    proxy: Option<(IpAddr, u16)>,
    mtu: u32,
}

fn invalid(what: &str, value: &str) -> AgentError {
    AgentError::new(
        ErrorKind::InvalidRequest,
        format!("network: invalid {what} {value:?}"),
    )
}

impl Plan {
    pub fn new(net: &NetworkConfig) -> Result<Plan, AgentError> {
        let address = Cidr::parse(&net.address)
            .filter(|c| net.address.contains('/') && c.prefix > 0)
            .ok_or_else(|| invalid("address", &net.address))?;
        let gateway = net
            .gateway
            .trim()
            .parse::<IpAddr>()
            .map_err(|_| invalid("gateway", &net.gateway))?;
        let dns = net
            .dns
            .iter()
            .map(|d| {
                d.trim()
                    .parse::<IpAddr>()
                    .map_err(|_| invalid("name server", d))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let cidrs = |list: &[String], what: &str| {
            list.iter()
                .map(|d| {
                    Cidr::parse(d)
                        .map(Cidr::network)
                        .ok_or_else(|| invalid(what, d))
                })
                .collect::<Result<Vec<_>, _>>()
        };
        let deny = cidrs(&net.deny, "deny CIDR")?;
        let allow = cidrs(&net.allow, "allow CIDR")?;
        let then_deny = cidrs(&net.then_deny, "deny CIDR")?;
        if !(68..=65535).contains(&net.mtu) {
            return Err(invalid("mtu", &net.mtu.to_string()));
        }
        let proxy = match &net.proxy {
            Some(p) => {
                let address = p
                    .address
                    .trim()
                    .parse::<IpAddr>()
                    .map_err(|_| invalid("proxy address", &p.address))?;
                if p.port == 0 {
                    return Err(invalid("proxy port", "0"));
                }
                Some((address, p.port))
            }
            None => None,
        };
        Ok(Plan {
            address,
            gateway,
            dns,
            deny,
            allow,
            then_deny,
            proxied_ports: net
                .proxied_ports
                .iter()
                .copied()
                .filter(|p| *p != 0)
                .collect(),
            proxy,
            mtu: net.mtu,
        })
    }
}

/// The nftables script: (re)create table `inet sandpit` with one reject pair
/// per denied prefix, then the sandbox's own allow list (accepted) and the
/// deny list that follows it. Declaring the table before deleting it makes
/// the delete succeed whether or not it existed; all of it is one atomic
/// transaction.
///
/// The sandbox's lists are enforced by the host's guard too (the guest is
/// the agent's to break); they are here so that a denied connect fails at
/// once: passt drops a guest's connection whose host-side connect is
/// refused later than at once, and the guest would wait out its timeout.
///
/// Three exemptions come first:
/// - loopback: traffic to the guest's own addresses is not egress, and the
///   TCP resets that `reject` sends back to local sockets travel over `lo`;
///   with the guest's own subnet denied (the default list denies 10.0.0.0/8
///   and 127.0.0.0/8) they would be rejected in turn, and a denied connect
///   would hang instead of failing at once;
/// - DNS (port 53) to the configured name servers, which the host may well
///   place inside a denied range (passt's forwarder is 10.0.2.3);
/// - the operator's HTTP proxy, its address and TCP port only: a corporate
///   proxy usually sits on a private address.
pub fn ruleset(plan: &Plan) -> String {
    let family = |a: &IpAddr| if a.is_ipv4() { "ip" } else { "ip6" };
    let mut s = String::from(
        "table inet sandpit\n\
         delete table inet sandpit\n\
         table inet sandpit {\n\
         \tchain output {\n\
         \t\ttype filter hook output priority 0; policy accept;\n\
         \t\toifname \"lo\" accept\n",
    );
    for d in &plan.dns {
        let f = family(d);
        s.push_str(&format!(
            "\t\t{f} daddr {d} udp dport 53 accept\n\
             \t\t{f} daddr {d} tcp dport 53 accept\n"
        ));
    }
    if let Some((a, port)) = plan.proxy {
        let f = family(&a);
        s.push_str(&format!("\t\t{f} daddr {a} tcp dport {port} accept\n"));
    }
    let reject = |s: &mut String, c: &Cidr| {
        let f = family(&c.addr);
        let icmp = if c.addr.is_ipv4() { "icmp" } else { "icmpv6" };
        s.push_str(&format!(
            "\t\t{f} daddr {c} meta l4proto tcp reject with tcp reset\n\
             \t\t{f} daddr {c} reject with {icmp} type admin-prohibited\n"
        ));
    };
    for c in &plan.deny {
        reject(&mut s, c);
    }
    if !plan.proxied_ports.is_empty() {
        let ports: Vec<String> = plan.proxied_ports.iter().map(u16::to_string).collect();
        s.push_str(&format!(
            "\t\ttcp dport {{ {} }} accept\n",
            ports.join(", ")
        ));
    }
    for c in &plan.allow {
        s.push_str(&format!("\t\t{} daddr {c} accept\n", family(&c.addr)));
    }
    for c in &plan.then_deny {
        reject(&mut s, c);
    }
    s.push_str("\t}\n}\n");
    s
}

/// /etc/resolv.conf for these servers.
pub fn resolv_conf(dns: &[IpAddr]) -> String {
    let mut s = String::from("# written by sandpit-agent\n");
    for d in dns {
        s.push_str(&format!("nameserver {d}\n"));
    }
    s
}

/// The first interface in `/sys/class/net` other than `lo`, by name.
pub fn first_interface(class_net: &Path) -> Option<String> {
    let mut names: Vec<String> = fs::read_dir(class_net)
        .ok()?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n != "lo")
        .collect();
    names.sort();
    names.into_iter().next()
}

const TOOL_TIMEOUT: Duration = Duration::from_secs(60);

/// Run a tool; a failure names the step and carries the tool's stderr.
fn tool(
    step: &str,
    program: &str,
    args: &[&str],
    stdin: Option<Vec<u8>>,
) -> Result<(), AgentError> {
    let fail =
        |detail: String| AgentError::new(ErrorKind::Io, format!("network: {step}: {detail}"));
    let out = reaper::run(program, args, stdin, TOOL_TIMEOUT).map_err(|e| fail(e.to_string()))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(fail(format!(
            "{program} failed ({}): {}",
            out.status,
            out.diagnostics()
        )))
    }
}

/// Apply a validated plan.
pub fn apply(plan: &Plan) -> Result<(), AgentError> {
    let ifname = first_interface(Path::new("/sys/class/net"))
        .ok_or_else(|| AgentError::new(ErrorKind::Io, "network: no network interface found"))?;
    // The filter first: no packet leaves before it is in place.
    tool(
        "egress filter",
        "nft",
        &["-f", "-"],
        Some(ruleset(plan).into_bytes()),
    )?;
    if plan.address.addr.is_ipv4() {
        let knob = format!("/proc/sys/net/ipv6/conf/{ifname}/disable_ipv6");
        if Path::new(&knob).exists() {
            sys::write_kernel_file(&knob, "1").map_err(|e| {
                AgentError::new(ErrorKind::Io, format!("network: disabling IPv6: {e}"))
            })?;
        }
    }
    let mtu = plan.mtu.to_string();
    let address = plan.address.to_string();
    let gateway = plan.gateway.to_string();
    tool(
        "link up",
        "ip",
        &["link", "set", "dev", &ifname, "up", "mtu", &mtu],
        None,
    )?;
    tool(
        "flush addresses",
        "ip",
        &["addr", "flush", "dev", &ifname, "scope", "global"],
        None,
    )?;
    tool(
        "add address",
        "ip",
        &["addr", "add", &address, "dev", &ifname],
        None,
    )?;
    tool(
        "default route",
        "ip",
        &[
            "route", "replace", "default", "via", &gateway, "dev", &ifname,
        ],
        None,
    )?;
    sys::replace_file(
        Path::new("/etc/resolv.conf"),
        resolv_conf(&plan.dns).as_bytes(),
        0o644,
    )
    .map_err(|e| AgentError::new(ErrorKind::Io, format!("network: /etc/resolv.conf: {e}")))?;
    crate::info!(
        "network: {address} via {gateway} on {ifname}, {} denied prefix(es), {} allowed before {} more",
        plan.deny.len(),
        plan.allow.len(),
        plan.then_deny.len()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use sandpit_protocol::ProxyConfig;

    fn net() -> NetworkConfig {
        NetworkConfig {
            address: "10.0.2.15/24".into(),
            gateway: "10.0.2.2".into(),
            dns: vec!["10.0.2.3".into()],
            deny: vec![
                "169.254.169.254".into(),
                "10.0.0.1/8".into(),
                "fd00::1/8".into(),
            ],
            allow: vec![],
            then_deny: vec![],
            proxied_ports: vec![],
            mtu: 1500,
            proxy: Some(ProxyConfig {
                url: "http://10.1.2.3:3128".into(),
                address: "10.1.2.3".into(),
                port: 3128,
                no_proxy: vec![],
            }),
        }
    }

    #[test]
    fn cidrs_parse_and_normalise() {
        let c = Cidr::parse("10.1.2.3/8").unwrap();
        assert_eq!(c.to_string(), "10.1.2.3/8");
        assert_eq!(c.network().to_string(), "10.0.0.0/8");
        assert_eq!(Cidr::parse("1.2.3.4").unwrap().to_string(), "1.2.3.4/32");
        assert_eq!(
            Cidr::parse("0.0.0.0/0").unwrap().network().to_string(),
            "0.0.0.0/0"
        );
        assert_eq!(
            Cidr::parse("fd00::1/8").unwrap().network().to_string(),
            "fd00::/8"
        );
        assert!(Cidr::parse("1.2.3.4/33").is_none());
        assert!(Cidr::parse("1.2.3/8").is_none());
        assert!(Cidr::parse("1.2.3.4/8; flush ruleset").is_none());
        assert!(Cidr::parse("").is_none());
    }

    #[test]
    fn plans_validate_everything_first() {
        let p = Plan::new(&net()).unwrap();
        assert_eq!(p.deny.len(), 3);
        assert_eq!(p.deny[1].to_string(), "10.0.0.0/8");
        for bad in [
            NetworkConfig {
                address: "10.0.2.15".into(),
                ..net()
            },
            NetworkConfig {
                gateway: "gw".into(),
                ..net()
            },
            NetworkConfig {
                dns: vec!["1.1.1.1\nnameserver 6.6.6.6".into()],
                ..net()
            },
            NetworkConfig {
                deny: vec!["10/8".into()],
                ..net()
            },
            NetworkConfig { mtu: 20, ..net() },
            NetworkConfig {
                proxy: Some(ProxyConfig {
                    address: "10.1.2.3; flush ruleset".into(),
                    ..net().proxy.unwrap()
                }),
                ..net()
            },
            NetworkConfig {
                proxy: Some(ProxyConfig {
                    port: 0,
                    ..net().proxy.unwrap()
                }),
                ..net()
            },
        ] {
            assert_eq!(Plan::new(&bad).unwrap_err().kind, ErrorKind::InvalidRequest);
        }
    }

    #[test]
    fn ruleset_rejects_each_prefix() {
        let p = Plan::new(&net()).unwrap();
        let r = ruleset(&p);
        assert!(r.starts_with("table inet sandpit\ndelete table inet sandpit\n"));
        assert!(r.contains("policy accept;\n\t\toifname \"lo\" accept\n"));
        assert!(r.contains("ip daddr 10.0.0.0/8 meta l4proto tcp reject with tcp reset\n"));
        assert!(r.contains("ip daddr 10.0.0.0/8 reject with icmp type admin-prohibited\n"));
        assert!(r.contains("ip6 daddr fd00::/8 reject with icmpv6 type admin-prohibited\n"));
        assert!(r.contains("ip daddr 10.0.2.3 udp dport 53 accept\n"));
        let dns_at = r.find("dport 53").unwrap();
        assert!(
            dns_at < r.find("reject").unwrap(),
            "DNS exemption must come first"
        );
        let proxy_at = r
            .find("ip daddr 10.1.2.3 tcp dport 3128 accept\n")
            .expect("the proxy is exempted");
        assert!(
            proxy_at < r.find("reject").unwrap(),
            "the proxy's exemption must come before the rejects"
        );
        assert_eq!(r.matches("10.1.2.3").count(), 1, "the proxy only: {r}");
        let bare = Plan {
            deny: vec![],
            dns: vec![],
            proxy: None,
            ..p.clone()
        };
        assert!(ruleset(&bare).contains("policy accept;"));
        assert!(!ruleset(&Plan { proxy: None, ..p }).contains("3128"));
    }

    fn with_lists() -> NetworkConfig {
        NetworkConfig {
            allow: vec!["198.51.100.7".into(), "203.0.113.0/24".into()],
            then_deny: vec!["0.0.0.0/0".into()],
            proxied_ports: vec![80, 443],
            ..net()
        }
    }

    #[test]
    fn the_sandbox_lists_come_after_the_operators_rejects_allow_first() {
        let r = ruleset(&Plan::new(&with_lists()).unwrap());
        let at = |needle: &str| r.find(needle).unwrap_or_else(|| panic!("{needle}: {r}"));
        let allowed = at("ip daddr 198.51.100.7/32 accept\n");
        assert!(at("ip daddr 10.0.0.0/8 meta l4proto tcp reject") < allowed);
        assert!(allowed < at("ip daddr 203.0.113.0/24 accept\n"));
        assert!(
            at("ip daddr 203.0.113.0/24 accept") < at("ip daddr 0.0.0.0/0 meta l4proto tcp reject")
        );
        assert!(r.contains("ip daddr 0.0.0.0/0 reject with icmp type admin-prohibited\n"));
        // The host's egress proxy's ports pass the sandbox's lists, never
        // the operator's.
        let proxied = at("tcp dport { 80, 443 } accept\n");
        assert!(at("ip daddr 10.0.0.0/8 meta l4proto tcp reject") < proxied);
        assert!(proxied < at("ip daddr 0.0.0.0/0 meta l4proto tcp reject"));
        let bad = NetworkConfig {
            allow: vec!["1.2.3.4/8; flush ruleset".into()],
            ..net()
        };
        assert_eq!(Plan::new(&bad).unwrap_err().kind, ErrorKind::InvalidRequest);
    }

    /// Let the real nft parse the ruleset in check mode (nothing is applied).
    #[test]
    fn nft_accepts_the_ruleset() {
        assert!(
            reaper::find_program("nft").is_some(),
            "nft is missing: apt-get install nftables (scripts/install-deps.sh does)"
        );
        let p = Plan::new(&with_lists()).unwrap();
        let out = std::process::Command::new(reaper::find_program("nft").unwrap())
            .args(["-c", "-f", "-"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .and_then(|mut c| {
                use std::io::Write;
                c.stdin.take().unwrap().write_all(ruleset(&p).as_bytes())?;
                c.wait_with_output()
            })
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "nft rejected the ruleset: {stderr}");
    }

    #[test]
    fn resolv_conf_lists_servers() {
        let r = resolv_conf(&["10.0.2.3".parse().unwrap(), "::1".parse().unwrap()]);
        assert!(r.ends_with("nameserver 10.0.2.3\nnameserver ::1\n"));
    }

    #[test]
    fn picks_the_first_non_loopback_interface() {
        let d = std::env::temp_dir().join(format!("sandpit-agent-net-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        for n in ["lo", "eth1", "eth0"] {
            fs::create_dir_all(d.join(n)).unwrap();
        }
        assert_eq!(first_interface(&d).as_deref(), Some("eth0"));
        fs::remove_dir_all(&d).unwrap();
        assert_eq!(first_interface(&d), None);
    }
}
