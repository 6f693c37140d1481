//! Outbound network for a guest: one `passt` process per VM (user-mode NAT, no
//! bridges, no root-only set-up), connected to QEMU over a unix socket.
//!
//! The guest gets a fixed private address; passt makes each connection from
//! the host's own sockets. `--no-map-gw` stops the gateway address from
//! reaching the host's loopback services (the control plane, the database).
//! Everything else on the deny list (link-local metadata, private ranges, the
//! host's own addresses) is rejected by the guest's packet filter, which the
//! agent installs before any user command runs; see docs/threat-model.md.

use crate::{Result, RuntimeError};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

/// Guest-side addressing, the same in every sandbox (each has its own NAT).
pub const GUEST_ADDRESS: &str = "10.0.2.15/24";
pub const GUEST_GATEWAY: &str = "10.0.2.2";
/// passt answers DNS sent here with the host's resolver.
pub const GUEST_DNS_FORWARD: &str = "10.0.2.3";
pub const GUEST_MTU: u32 = 65520;

/// Start passt for a VM and wait until its socket exists. Returns its pid.
pub async fn start_passt(passt: &Path, dir: &Path) -> Result<(u32, PathBuf)> {
    let sock = dir.join("passt.sock");
    let log = dir.join("passt.log");
    let mut cmd = tokio::process::Command::new(passt);
    cmd.args(["--foreground", "--quiet", "--one-off", "--ipv4-only"])
        .arg("--socket")
        .arg(&sock)
        .args(["--address", "10.0.2.15", "--netmask", "24"])
        .args(["--gateway", GUEST_GATEWAY, "--no-map-gw"])
        .args([
            "--dns",
            GUEST_DNS_FORWARD,
            "--dns-forward",
            GUEST_DNS_FORWARD,
        ])
        .args(["--tcp-ports", "none", "--udp-ports", "none"])
        .args(["--no-dhcpv6", "--no-ndp", "--no-ra"])
        .arg("--log-file")
        .arg(&log)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(false);
    detach(&mut cmd);
    let mut child = cmd.spawn().map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            RuntimeError::MissingTool {
                tool: passt.display().to_string(),
                package: "passt".into(),
            }
        } else {
            RuntimeError::Launch(format!("starting passt: {e}"))
        }
    })?;
    let pid = child.id().unwrap_or(0);
    let deadline = Instant::now() + Duration::from_secs(5);
    while !sock.exists() {
        if let Ok(Some(status)) = child.try_wait() {
            return Err(RuntimeError::Launch(format!(
                "passt exited ({status}) before creating its socket: {}",
                crate::console::tail_lines(&log, 5)
            )));
        }
        if Instant::now() > deadline {
            let _ = child.start_kill();
            return Err(RuntimeError::Launch(
                "passt did not create its socket within 5 s".into(),
            ));
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    Ok((pid, sock))
}

/// Put a helper process in its own session so it outlives the CLI that started
/// it and no terminal signal reaches it.
pub(crate) fn detach(cmd: &mut tokio::process::Command) {
    // SAFETY: setsid is async-signal-safe and touches no memory of the parent.
    unsafe {
        cmd.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
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
