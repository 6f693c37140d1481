//! Outbound network for a guest: one `passt` process per VM (user-mode NAT, no
//! bridges, no root-only set-up), connected to QEMU over a unix socket.
//!
//! The guest gets a fixed private address; passt makes each connection from
//! the host's own sockets. `--no-map-gw` stops the gateway address from
//! reaching the host's loopback services (the control plane, the database).
//! Everything else on the deny list (link-local metadata, private ranges, the
//! host's own addresses) is rejected by the guest's packet filter, which the
//! agent installs before any user command runs, and again on the host by
//! passt's uid (see `guard`); see docs/threat-model.md.
//!
//! Name resolution: the guest's resolver is [`GUEST_DNS_FORWARD`], which
//! passt answers by forwarding each query to the host's resolver, so guests
//! resolve names as the host does without reaching the host's resolver
//! themselves (it is often on a denied address: systemd-resolved's
//! 127.0.0.53, a cloud VPC resolver on a private or link-local address).
//! Which resolver is passt's own choice, made at its start, and it is not
//! what `--dns` says: measured with Debian 12's passt (0.0~git20230309),
//! queries go to the first IPv4 `nameserver` of the host's
//! `/etc/resolv.conf`, loopback included (also with `--no-map-gw`), and
//! only when no `--dns` is given; with `--dns ADDR` they went to 0.0.0.0
//! (the host itself), which is why `--dns 10.0.2.3` left guests without
//! names. So passt gets `--dns-forward` and no `--dns`, and
//! [`host_resolver`] reads the same line for the log.
//!
//! Behind an operator's TLS-inspecting proxy, guests get the proxy
//! ([`resolve_proxy`]) and its CA certificates ([`read_ca_certificates`]),
//! both read once at start; the agent exports them to every command and
//! lets exactly the proxy's address and port through the deny list.

use crate::{Result, RuntimeError};
use sandpit_protocol::ProxyConfig;
use std::net::{IpAddr, Ipv4Addr, ToSocketAddrs};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::Stdio;

/// Guest-side addressing, the same in every sandbox (each has its own NAT).
pub const GUEST_ADDRESS: &str = "10.0.2.15/24";
pub const GUEST_GATEWAY: &str = "10.0.2.2";
/// The guest's name server: passt forwards DNS sent here (UDP) to the host's
/// resolver (see the module docs).
pub const GUEST_DNS_FORWARD: &str = "10.0.2.3";
pub const GUEST_MTU: u32 = 65520;

/// The descriptor number at which QEMU and passt find their ends of the
/// network socket pair.
pub const NET_FD: i32 = 3;

/// Start passt for a VM on one end of a fresh socket pair; the other end is
/// returned for QEMU (`-netdev stream,addr.type=fd`). No socket file, no
/// waiting for one: both processes start at once, and passt (`--one-off`)
/// exits by itself when QEMU's end closes.
/// With `merge_pages`, passt's memory is offered to KSM (see `ksm`).
/// With `run_as`, passt drops to that uid (and gid) after its set-up, the
/// uid the host's guard filters by (see `guard`).
pub fn start_passt(
    passt: &Path,
    dir: &Path,
    merge_pages: bool,
    run_as: Option<u32>,
) -> Result<(u32, OwnedFd)> {
    let (ours, theirs) =
        UnixStream::pair().map_err(RuntimeError::io("creating the network socket pair"))?;
    let log = dir.join("passt.log");
    let mut cmd = tokio::process::Command::new(passt);
    cmd.args(["--foreground", "--quiet", "--one-off", "--ipv4-only"])
        .args(["--fd", &NET_FD.to_string()])
        .args(["--address", "10.0.2.15", "--netmask", "24"])
        .args(["--gateway", GUEST_GATEWAY, "--no-map-gw"])
        // No `--dns`: with one, passt no longer forwards to the host's resolver.
        .args(["--dns-forward", GUEST_DNS_FORWARD])
        .args(["--tcp-ports", "none", "--udp-ports", "none"])
        .args(["--no-dhcpv6", "--no-ndp", "--no-ra"])
        .arg("--log-file")
        .arg(&log)
        .args(run_as.map(|uid| format!("--runas={uid}:{uid}")))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(false);
    let fd = theirs.as_raw_fd();
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            libc::setsid();
            if merge_pages {
                crate::host::ksm::opt_in_self();
            }
            pass_fd(fd, NET_FD)
        });
    }
    let child = cmd.spawn().map_err(RuntimeError::spawn(
        passt.display().to_string(),
        "passt",
        "starting passt",
    ))?;
    drop(theirs);
    Ok((child.id().unwrap_or(0), ours.into()))
}

/// In a child between fork and exec: make `fd` available, inheritable, as `target`.
pub(crate) fn pass_fd(fd: i32, target: i32) -> std::io::Result<()> {
    // SAFETY: plain descriptor syscalls in the child.
    unsafe {
        if fd == target {
            let flags = libc::fcntl(fd, libc::F_GETFD);
            if flags < 0 || libc::fcntl(fd, libc::F_SETFD, flags & !libc::FD_CLOEXEC) < 0 {
                return Err(std::io::Error::last_os_error());
            }
        } else if libc::dup2(fd, target) < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// The resolver passt forwards the guests' queries to, read from
/// `resolv_conf` (the host's `/etc/resolv.conf`) as passt reads it: the
/// first `nameserver` line whose address is IPv4 (a `%` suffix cut off).
pub fn host_resolver(resolv_conf: &str) -> Option<Ipv4Addr> {
    resolv_conf.lines().find_map(|line| {
        let rest = line.strip_prefix("nameserver ")?;
        let addr = rest.rsplit(' ').next()?;
        addr.split('%').next()?.trim_end().parse().ok()
    })
}

/// Destinations the guest always reaches without the proxy: its own.
const ALWAYS_DIRECT: &[&str] = &["localhost", "127.0.0.1", "::1"];

/// The operator's proxy as guests use it: `url` is `http://[USER:PASSWORD@]HOST:PORT`
/// (a trailing `/` allowed). The host name is resolved here, once, and
/// guests get its first IPv4 address in the URL, so what they connect to is
/// exactly what their filter lets through. The port must be given: tools
/// disagree on a proxy's default port (curl takes 1080).
pub fn resolve_proxy(url: &str, no_proxy: &[String]) -> Result<ProxyConfig> {
    // Errors show the URL without its password.
    let shown = match url.split_once('@') {
        Some((before, after)) => match before.rsplit_once(':') {
            Some((user, _)) if user != "http" => format!("{user}:***@{after}"),
            _ => url.to_string(),
        },
        None => url.to_string(),
    };
    let bad = |why: &str| RuntimeError::Config(format!("[network] proxy {shown:?}: {why}"));
    let rest = url.strip_prefix("http://").ok_or_else(|| {
        bad("must start with http:// (guests speak plain HTTP to it, CONNECT for https)")
    })?;
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    if rest.is_empty()
        || !rest.chars().all(|c| c.is_ascii_graphic())
        || rest.contains(['/', '?', '#'])
    {
        return Err(bad("expected http://HOST:PORT"));
    }
    let (userinfo, host_port) = match rest.rsplit_once('@') {
        Some((u, h)) => (Some(u), h),
        None => (None, rest),
    };
    let (host, port) = host_port
        .rsplit_once(':')
        .ok_or_else(|| bad("needs a port (http://HOST:PORT)"))?;
    let port: u16 = port
        .parse()
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| bad("the port is not a port number"))?;
    if host.is_empty() || host.starts_with('[') {
        return Err(bad(
            "needs a host name or an IPv4 address (guests have IPv4 only)",
        ));
    }
    let address = (host, port)
        .to_socket_addrs()
        .map_err(|e| bad(&format!("cannot resolve {host}: {e}")))?
        .map(|a| a.ip())
        .find(IpAddr::is_ipv4)
        .ok_or_else(|| bad(&format!("{host} has no IPv4 address")))?;
    if address.is_loopback() {
        return Err(bad(
            "guests cannot reach the host's loopback; let the proxy listen on another address of the host",
        ));
    }
    let mut direct: Vec<String> = ALWAYS_DIRECT.iter().map(|s| s.to_string()).collect();
    for n in no_proxy {
        if n.is_empty() || !n.chars().all(|c| c.is_ascii_graphic() && c != ',') {
            return Err(RuntimeError::Config(format!(
                "[network] no_proxy entry {n:?}: one host, domain or address per entry"
            )));
        }
        if !direct.contains(n) {
            direct.push(n.clone());
        }
    }
    let userinfo = userinfo.map(|u| format!("{u}@")).unwrap_or_default();
    Ok(ProxyConfig {
        url: format!("http://{userinfo}{address}:{port}"),
        address: address.to_string(),
        port,
        no_proxy: direct,
    })
}

/// The certificates of these PEM files, one `CERTIFICATE` block each, as
/// every guest will trust them. Anything else in the files (a private key
/// saved alongside) is left out, never sent to a guest; a file without any
/// certificate is an error, as is one that cannot be read.
pub fn read_ca_certificates(paths: &[std::path::PathBuf]) -> Result<Vec<String>> {
    const BEGIN: &str = "-----BEGIN CERTIFICATE-----";
    const END: &str = "-----END CERTIFICATE-----";
    let mut out = Vec::new();
    for path in paths {
        let text = std::fs::read_to_string(path).map_err(|e| {
            RuntimeError::Config(format!(
                "[network] ca_certificates: reading {}: {e}",
                path.display()
            ))
        })?;
        let before = out.len();
        let mut lines = text.lines().map(str::trim);
        while let Some(line) = lines.next() {
            if line != BEGIN {
                continue;
            }
            let mut pem = format!("{BEGIN}\n");
            let mut complete = false;
            for line in lines.by_ref() {
                if line == END {
                    complete = true;
                    break;
                }
                if line.is_empty()
                    || !line
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '/' | '='))
                {
                    break;
                }
                pem.push_str(line);
                pem.push('\n');
            }
            if complete && pem.len() > BEGIN.len() + 1 {
                pem.push_str(END);
                pem.push('\n');
                out.push(pem);
            } else {
                return Err(RuntimeError::Config(format!(
                    "[network] ca_certificates: {} holds a broken PEM certificate",
                    path.display()
                )));
            }
        }
        if out.len() == before {
            return Err(RuntimeError::Config(format!(
                "[network] ca_certificates: {} holds no PEM certificate",
                path.display()
            )));
        }
    }
    Ok(out)
}

/// The host's own IPv4 addresses (added to the guest's deny list).
pub fn host_addresses() -> Vec<String> {
    let mut out = Vec::new();
    // SAFETY: getifaddrs fills a linked list we walk and free.
    unsafe {
        let mut ifap: *mut libc::ifaddrs = std::ptr::null_mut();
        if libc::getifaddrs(&mut ifap) != 0 {
            return out;
        }
        let mut p = ifap;
        while !p.is_null() {
            let a = (*p).ifa_addr;
            if !a.is_null() && (*a).sa_family as i32 == libc::AF_INET {
                let sin = a as *const libc::sockaddr_in;
                let ip = std::net::Ipv4Addr::from(u32::from_be((*sin).sin_addr.s_addr));
                out.push(format!("{ip}/32"));
            }
            p = (*p).ifa_next;
        }
        libc::freeifaddrs(ifap);
    }
    out.sort();
    out.dedup();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_host_resolver_is_the_first_ipv4_nameserver() {
        let conf = "# generated\nsearch example.internal\nnameserver fe80::1%eth0\n\
                    nameserver 127.0.0.53\nnameserver 10.255.255.53\noptions edns0\n";
        assert_eq!(host_resolver(conf), Some([127, 0, 0, 53].into()));
        assert_eq!(
            host_resolver("nameserver 10.255.255.53\n"),
            Some([10, 255, 255, 53].into())
        );
        assert_eq!(host_resolver("search x\n#nameserver 1.1.1.1\n"), None);
        assert_eq!(host_resolver(""), None);
    }

    #[test]
    fn proxies_are_resolved_once_with_an_explicit_port() {
        let p = resolve_proxy("http://10.1.2.3:3128/", &["corp.example".into()]).unwrap();
        assert_eq!(p.url, "http://10.1.2.3:3128");
        assert_eq!((p.address.as_str(), p.port), ("10.1.2.3", 3128));
        assert_eq!(
            p.no_proxy,
            ["localhost", "127.0.0.1", "::1", "corp.example"]
        );
        let p = resolve_proxy("http://me:s3cret@10.1.2.3:8080", &["localhost".into()]).unwrap();
        assert_eq!(p.url, "http://me:s3cret@10.1.2.3:8080");
        assert_eq!(p.no_proxy, ["localhost", "127.0.0.1", "::1"]);
        // A name becomes the address guests are let through to.
        let p = resolve_proxy("http://localhost.:3128", &[]);
        assert!(p.is_err(), "the host's loopback is out of guests' reach");
        for bad in [
            "10.1.2.3:3128",
            "https://10.1.2.3:3128",
            "http://10.1.2.3",
            "http://10.1.2.3:0",
            "http://10.1.2.3:99999",
            "http://10.1.2.3:3128/path",
            "http://[fd00::1]:3128",
            "http://127.0.0.1:3128",
            "http://a b:3128",
            "http://",
        ] {
            let e = resolve_proxy(bad, &[]).unwrap_err();
            assert!(matches!(e, RuntimeError::Config(_)), "{bad}: {e}");
        }
        for bad in ["a,b", "", "a b"] {
            assert!(resolve_proxy("http://10.1.2.3:3128", &[bad.into()]).is_err());
        }
        let e = resolve_proxy("http://me:s3cret@10.1.2.3", &[]).unwrap_err();
        assert!(!e.to_string().contains("s3cret"), "{e}");
        assert!(e.to_string().contains("http://me:***@10.1.2.3"), "{e}");
    }

    #[test]
    fn ca_files_give_their_certificates_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let two = dir.path().join("two.pem");
        std::fs::write(
            &two,
            "subject=CN=corp\n-----BEGIN CERTIFICATE-----\r\nMIIBxTCC\r\nAbC+/9==\r\n\
             -----END CERTIFICATE-----\r\n-----BEGIN PRIVATE KEY-----\nSECRET\n\
             -----END PRIVATE KEY-----\n-----BEGIN CERTIFICATE-----\nMIIC\n\
             -----END CERTIFICATE-----",
        )
        .unwrap();
        let certs = read_ca_certificates(std::slice::from_ref(&two)).unwrap();
        assert_eq!(
            certs,
            [
                "-----BEGIN CERTIFICATE-----\nMIIBxTCC\nAbC+/9==\n-----END CERTIFICATE-----\n",
                "-----BEGIN CERTIFICATE-----\nMIIC\n-----END CERTIFICATE-----\n",
            ]
        );
        let key = dir.path().join("key.pem");
        std::fs::write(
            &key,
            "-----BEGIN PRIVATE KEY-----\nSECRET\n-----END PRIVATE KEY-----\n",
        )
        .unwrap();
        let broken = dir.path().join("broken.pem");
        std::fs::write(&broken, "-----BEGIN CERTIFICATE-----\nMIIC\n").unwrap();
        for bad in [key, broken, dir.path().join("missing.pem")] {
            let e = read_ca_certificates(&[two.clone(), bad.clone()]).unwrap_err();
            assert!(e.to_string().contains(&bad.display().to_string()), "{e}");
        }
        assert!(read_ca_certificates(&[]).unwrap().is_empty());
    }
}
