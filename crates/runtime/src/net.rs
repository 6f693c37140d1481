//! Outbound network for a guest: one `passt` process per VM (user-mode NAT, no
//! bridges, no root-only set-up), connected to QEMU over a unix socket.
//!
//! The guest gets a fixed private address; passt makes each connection from
//! the host's own sockets. `--no-map-gw` stops the gateway address from
//! reaching the host's loopback services (the control plane, the database).
//! Everything else on the deny list (link-local metadata, private ranges, the
//! host's own addresses) is rejected by the guest's packet filter, which the
//! agent installs before any user command runs; see docs/threat-model.md.
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

use crate::{Result, RuntimeError};
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
pub fn start_passt(passt: &Path, dir: &Path, merge_pages: bool) -> Result<(u32, OwnedFd)> {
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
                crate::ksm::opt_in_self();
            }
            pass_fd(fd, NET_FD)
        });
    }
    let child = cmd.spawn().map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            RuntimeError::MissingTool {
                tool: passt.display().to_string(),
                package: "passt".into(),
            }
        } else {
            RuntimeError::Launch(format!("starting passt: {e}"))
        }
    })?;
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
pub fn host_resolver(resolv_conf: &str) -> Option<std::net::Ipv4Addr> {
    resolv_conf.lines().find_map(|line| {
        let rest = line.strip_prefix("nameserver ")?;
        let addr = rest.rsplit(' ').next()?;
        addr.split('%').next()?.trim_end().parse().ok()
    })
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
}
