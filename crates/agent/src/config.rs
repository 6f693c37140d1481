//! `Configure`: turn the generic guest image into one particular sandbox
//! (identity, clock, entropy, limits, network, the operator's proxy and CAs).
//!
//! It runs at first boot and again after every snapshot restore, where the
//! clock has jumped and the RNG state is a copy shared with every other clone
//! of the snapshot, so the host's entropy is mixed in and the CRNG reseeded
//! right away. Every step is idempotent; the network, the limits and the
//! outbound settings, which a restored VM already has from its template, are
//! skipped when unchanged.
//! The request is validated before anything changes; a failing step is named
//! in the error.

use crate::{cgroup, net, outbound, sys};
use sandpit_protocol::{AgentError, ErrorKind, GuestConfig};
use std::fs::OpenOptions;
use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;

/// `_IOW('R', 0x03, int[2])`: add entropy and credit it.
const RNDADDENTROPY: libc::c_ulong = 0x4008_5203;
/// `_IO('R', 0x07)`: reseed the CRNG now.
const RNDRESEEDCRNG: libc::c_ulong = 0x5207;

fn invalid(msg: String) -> AgentError {
    AgentError::new(ErrorKind::InvalidRequest, msg)
}

/// A hostname the kernel and /etc/hosts accept: 1-64 of `[A-Za-z0-9.-]`,
/// not starting with a dot or dash.
pub fn check_hostname(h: &str) -> Result<(), AgentError> {
    let ok = !h.is_empty()
        && h.len() <= 64
        && h.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
        && !h.starts_with(['-', '.']);
    if ok {
        Ok(())
    } else {
        Err(invalid(format!("invalid hostname {h:?}")))
    }
}

/// 32 lowercase hex digits.
pub fn check_machine_id(id: &str) -> Result<(), AgentError> {
    if id.len() == 32
        && id
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    {
        Ok(())
    } else {
        Err(invalid(format!("invalid machine id {id:?}")))
    }
}

/// Set the kernel hostname.
pub fn set_hostname(name: &str) -> io::Result<()> {
    // SAFETY: pointer and length of a valid buffer.
    sys::cvt(unsafe { libc::sethostname(name.as_ptr().cast(), name.len()) }).map(drop)
}

fn set_clock(unix_ms: u64) -> io::Result<()> {
    let ts = libc::timespec {
        tv_sec: (unix_ms / 1000) as libc::time_t,
        tv_nsec: ((unix_ms % 1000) * 1_000_000) as libc::c_long,
    };
    // SAFETY: valid timespec.
    sys::cvt(unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &ts) }).map(drop)
}

/// The `struct rand_pool_info` for RNDADDENTROPY: entropy_count (bits),
/// buf_size (bytes), then the bytes, in native-endian 32-bit words.
pub fn rand_pool_info(bytes: &[u8]) -> Vec<u32> {
    let mut words = vec![0u32; 2 + bytes.len().div_ceil(4)];
    let bits = (bytes.len() as u64 * 8).min(i32::MAX as u64);
    words[0] = bits as u32;
    words[1] = bytes.len() as u32;
    for (i, chunk) in bytes.chunks(4).enumerate() {
        let mut w = [0u8; 4];
        w[..chunk.len()].copy_from_slice(chunk);
        words[2 + i] = u32::from_ne_bytes(w);
    }
    words
}

/// Mix the host's bytes into the kernel pool and reseed the CRNG.
fn add_entropy(bytes: &[u8]) -> io::Result<()> {
    if bytes.is_empty() {
        return Ok(());
    }
    let f = OpenOptions::new().write(true).open("/dev/urandom")?;
    let info = rand_pool_info(bytes);
    // SAFETY: info is a valid rand_pool_info of the advertised size.
    sys::cvt(unsafe { libc::ioctl(f.as_raw_fd(), RNDADDENTROPY, info.as_ptr()) })?;
    // Crediting alone does not reseed a CRNG that is already initialised;
    // ENODATA here just means it was not initialised yet (then the credit
    // above did it).
    // SAFETY: argument-less ioctl.
    unsafe { libc::ioctl(f.as_raw_fd(), RNDRESEEDCRNG) };
    Ok(())
}

/// Apply a whole configuration. `entropy` is the frame body.
pub fn configure(cfg: &GuestConfig, entropy: &[u8]) -> Result<(), AgentError> {
    // The host read its clock just before sending: what this call spends
    // before the guest's clock is set (checks, a lock, on a busy host under
    // emulation up to a second) is added to it.
    let received = std::time::Instant::now();
    check_hostname(&cfg.hostname)?;
    check_machine_id(&cfg.machine_id)?;
    let plan = cfg.network.as_ref().map(net::Plan::new).transpose()?;
    let outbound = outbound::Outbound::new(
        &cfg.ca_certificates,
        cfg.network.as_ref().and_then(|n| n.proxy.as_ref()),
    )?;
    if !crate::is_pid1() {
        crate::info!("configure: development mode, validated but not applied");
        return Ok(());
    }
    // Two Configures at once would interleave their ip/nft steps.
    static APPLYING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _applying = sys::lock(&APPLYING);
    let step = |name: &'static str| {
        move |e: io::Error| AgentError::new(ErrorKind::Io, format!("{name}: {e}"))
    };
    if cfg.time_unix_ms > 0 {
        let late = u64::try_from(received.elapsed().as_millis()).unwrap_or(0);
        set_clock(cfg.time_unix_ms + late).map_err(step("clock"))?;
    }

    // After a restore, every file this step creates runs kernel code the new
    // QEMU has not translated yet (~15 ms each under emulation): the image
    // keeps the identity where no file has to be made. /etc/hostname links
    // to the kernel's hostname and nss-myhostname resolves it, so /etc/hosts
    // needs no line per sandbox; machine-id is rewritten in place.
    set_hostname(&cfg.hostname).map_err(step("hostname"))?;
    let hostname = Path::new("/etc/hostname");
    if !hostname.is_symlink() {
        sys::replace_file(hostname, format!("{}\n", cfg.hostname).as_bytes(), 0o644)
            .map_err(step("/etc/hostname"))?;
    }
    sys::overwrite_file(
        Path::new("/etc/machine-id"),
        format!("{}\n", cfg.machine_id).as_bytes(),
        0o444,
    )
    .map_err(step("/etc/machine-id"))?;
    add_entropy(entropy).map_err(step("entropy"))?;
    // Like the network below: a restored VM already has the template's
    // limits, which are this host's.
    static LIMITS: std::sync::Mutex<Option<(u32, u32)>> = std::sync::Mutex::new(None);
    let limits = (cfg.user_pids_max, cfg.reserved_memory_mb);
    let mut applied_limits = sys::lock(&LIMITS);
    if *applied_limits != Some(limits) {
        *applied_limits = None;
        cgroup::apply_limits(limits.0, limits.1).map_err(step("cgroup limits"))?;
        *applied_limits = Some(limits);
    }
    if let Some(plan) = &plan {
        // A VM restored from a template already carries the template's
        // network, which is the same plan on the same host: applying it again
        // would only spend a few hundred milliseconds of emulated process
        // starts. Anything else is applied in full.
        static APPLIED: std::sync::Mutex<Option<net::Plan>> = std::sync::Mutex::new(None);
        let mut applied = sys::lock(&APPLIED);
        if applied.as_ref() != Some(plan) {
            *applied = None;
            net::apply(plan)?;
            *applied = Some(plan.clone());
        }
    }
    // Likewise: a restored VM has the template's bundle and variables, made
    // with the same settings (they are part of the template's key).
    static OUTBOUND: std::sync::Mutex<Option<outbound::Outbound>> = std::sync::Mutex::new(None);
    let mut applied_outbound = sys::lock(&OUTBOUND);
    if applied_outbound.as_ref() != Some(&outbound) {
        *applied_outbound = None;
        outbound::apply(&outbound)?;
        *applied_outbound = Some(outbound);
    }
    // The first command's cgroup and pipes (a template carries them into
    // its clones).
    crate::exec::prepare_next();
    crate::info!("configured as {}", cfg.hostname);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostnames() {
        assert!(check_hostname("sandpit-1a.example").is_ok());
        for bad in ["", "-x", ".x", "a b", "a\nb", &"x".repeat(65)] {
            assert!(check_hostname(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn machine_ids() {
        assert!(check_machine_id("0123456789abcdef0123456789abcdef").is_ok());
        assert!(check_machine_id("0123456789ABCDEF0123456789abcdef").is_err());
        assert!(check_machine_id("0123").is_err());
    }

    #[test]
    fn rand_pool_info_layout() {
        let w = rand_pool_info(&[1, 2, 3, 4, 5]);
        assert_eq!(w.len(), 4);
        assert_eq!((w[0], w[1]), (40, 5));
        assert_eq!(w[2], u32::from_ne_bytes([1, 2, 3, 4]));
        assert_eq!(w[3], u32::from_ne_bytes([5, 0, 0, 0]));
    }
}
