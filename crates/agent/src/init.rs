//! PID 1 duties: make the root filesystem a usable system before serving.
//!
//! The initramfs has moved /dev, /proc and /sys into the new root; everything
//! else (devpts, /dev/shm, cgroup2, /dev/fd links, hostname, quiet console,
//! loopback) is ours. Each step is best effort and logged: a sandbox with one
//! missing mount is more useful than a kernel panic.

use crate::{cgroup, reaper, sys};
use std::fs;
use std::io;
use std::os::unix::fs::{symlink, MetadataExt, PermissionsExt};
use std::path::Path;
use std::thread;
use std::time::Duration;

/// Mount `fstype` on `target` unless something is mounted there already.
/// Each of `options` is tried in turn (a newer kernel's option first, what
/// every kernel takes last); only the last failure is logged.
fn ensure_mount(source: &str, target: &str, fstype: &str, flags: libc::c_ulong, options: &[&str]) {
    let _ = fs::create_dir_all(target);
    if is_mountpoint(Path::new(target)) {
        return;
    }
    let mount = |data: &str| -> io::Result<()> {
        let (s, t, f, d) = (
            sys::cstring(source)?,
            sys::cstring(target)?,
            sys::cstring(fstype)?,
            sys::cstring(data)?,
        );
        // SAFETY: valid C strings.
        sys::cvt(unsafe {
            libc::mount(s.as_ptr(), t.as_ptr(), f.as_ptr(), flags, d.as_ptr().cast())
        })
        .map(drop)
    };
    let mut result = Ok(());
    for data in options {
        result = mount(data);
        if result.is_ok() {
            break;
        }
    }
    if let Err(e) = result {
        if sys::errno(&e) != libc::EBUSY {
            crate::error!("mount {fstype} on {target}: {e}");
        }
    }
}

/// A directory is a mount point when its device differs from its parent's.
fn is_mountpoint(p: &Path) -> bool {
    match (fs::metadata(p), fs::metadata(p.join(".."))) {
        (Ok(a), Ok(b)) => a.dev() != b.dev() || a.ino() == b.ino(),
        _ => false,
    }
}

fn mount_all() {
    let nse = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
    ensure_mount("proc", "/proc", "proc", nse, &[""]);
    ensure_mount("sysfs", "/sys", "sysfs", nse, &[""]);
    ensure_mount(
        "devtmpfs",
        "/dev",
        "devtmpfs",
        libc::MS_NOSUID,
        &["mode=0755"],
    );
    ensure_mount(
        "devpts",
        "/dev/pts",
        "devpts",
        libc::MS_NOSUID | libc::MS_NOEXEC,
        &["gid=5,mode=0620,ptmxmode=0666"],
    );
    ensure_mount(
        "shm",
        "/dev/shm",
        "tmpfs",
        libc::MS_NOSUID | libc::MS_NODEV,
        &["mode=1777"],
    );
    ensure_mount(
        "tmpfs",
        "/run",
        "tmpfs",
        libc::MS_NOSUID | libc::MS_NODEV,
        &["mode=0755"],
    );
    // Every command is moved into its own cgroup. By default that move
    // waits for an RCU grace period: about 15 ms of a 33 ms `true` under
    // emulation. `favordynmods` (Linux 6.0+) makes it cheap.
    ensure_mount(
        "cgroup2",
        "/sys/fs/cgroup",
        "cgroup2",
        nse,
        &["favordynmods", ""],
    );
    // devtmpfs has no /dev/fd: bash's <(...) and many scripts need it.
    for (link, target) in [
        ("/dev/fd", "/proc/self/fd"),
        ("/dev/stdin", "/proc/self/fd/0"),
        ("/dev/stdout", "/proc/self/fd/1"),
        ("/dev/stderr", "/proc/self/fd/2"),
    ] {
        if fs::symlink_metadata(link).is_err() {
            let _ = symlink(target, link);
        }
    }
}

/// Where the kernel's fault-around size is set (debugfs only).
const FAULT_AROUND: &str = "/sys/kernel/debug/fault_around_bytes";

/// Map up to a whole page table (2 MiB) of already cached file pages on a
/// read fault, instead of 64 KiB. Under emulation a page fault costs tens of
/// microseconds, and every command starts with a shell whose code is in the
/// page cache but mapped anew: `bash -c true` takes 59 faults instead of 94
/// with this. Nothing is read from disk for it (only cached pages are
/// mapped). debugfs is mounted for the write and unmounted again.
fn fault_around_whole_tables() {
    const DEBUGFS: &str = "/sys/kernel/debug";
    let mounted_here = !is_mountpoint(Path::new(DEBUGFS));
    ensure_mount(
        "debugfs",
        DEBUGFS,
        "debugfs",
        libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        &[""],
    );
    if let Err(e) = sys::write_kernel_file(FAULT_AROUND, "2097152") {
        crate::error!("{FAULT_AROUND}: {e}");
    }
    if mounted_here {
        if let Ok(target) = sys::cstring(DEBUGFS) {
            // SAFETY: valid C path.
            unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
        }
    }
}

/// Bring a network interface up (SIOCSIFFLAGS), without spawning `ip`.
fn link_up(name: &str) -> io::Result<()> {
    // SAFETY: a socket we close again, and an ifreq we fully initialise.
    unsafe {
        let fd = sys::cvt(libc::socket(
            libc::AF_INET,
            libc::SOCK_DGRAM | libc::SOCK_CLOEXEC,
            0,
        ))?;
        let mut ifr: libc::ifreq = std::mem::zeroed();
        for (dst, src) in ifr
            .ifr_name
            .iter_mut()
            .zip(name.bytes().take(libc::IFNAMSIZ - 1))
        {
            *dst = src as libc::c_char;
        }
        let mut result = sys::cvt(libc::ioctl(fd, libc::SIOCGIFFLAGS, &mut ifr));
        if result.is_ok() {
            ifr.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
            result = sys::cvt(libc::ioctl(fd, libc::SIOCSIFFLAGS, &ifr));
        }
        libc::close(fd);
        result.map(drop)
    }
}

/// Everything PID 1 does before it can serve.
pub fn early() {
    mount_all();
    crate::log::use_kmsg();
    // Only emergencies (panics) reach the console; the rest is in dmesg.
    let _ = sys::write_kernel_file("/proc/sys/kernel/printk", "1 4 1 7");
    // Our own /dev/kmsg lines are not rate-limited away.
    let _ = sys::write_kernel_file("/proc/sys/kernel/printk_devkmsg", "on");
    // The link protections Debian's systemd would have set (no systemd here).
    for (knob, value) in [
        ("protected_symlinks", "1"),
        ("protected_hardlinks", "1"),
        ("protected_fifos", "1"),
        ("protected_regular", "2"),
    ] {
        let _ = sys::write_kernel_file(format!("/proc/sys/fs/{knob}"), value);
    }
    // An idle sandbox should cost its host next to nothing, and under
    // emulation each wake-up of the guest costs the host a good tenth of a
    // millisecond. Most of an idle guest's wake-ups are the kernel's own
    // housekeeping: proactive compaction (kcompactd, twice a second), the
    // per-CPU statistics (every second on each CPU) and the flusher (every
    // 5 s). A sandbox's memory is small and short-lived, its statistics
    // need not be fresh to the second, and its disk outlives no crash of
    // its VM anyway.
    for (knob, value) in [
        ("vm/compaction_proactiveness", "0"),
        ("vm/stat_interval", "10"),
        ("vm/dirty_writeback_centisecs", "3000"),
    ] {
        let _ = sys::write_kernel_file(format!("/proc/sys/{knob}"), value);
    }
    // No `oom_score_adj`: the OOM killer never picks the global init (the
    // kernel's `oom_unkillable_task`), and a -1000 here would be inherited
    // by every command, each then writing it back to 0 (~0.3 ms per command
    // under emulation: procfs instantiates a new pid's directory).
    let _ = fs::create_dir_all("/tmp");
    if let Err(e) = fs::set_permissions("/tmp", fs::Permissions::from_mode(0o1777)) {
        crate::error!("chmod /tmp: {e}");
    }
    if let Err(e) = crate::config::set_hostname("sandpit") {
        crate::error!("hostname: {e}");
    }
    if let Err(e) = link_up("lo") {
        crate::error!("bringing lo up: {e}");
    }
    cgroup::setup();
    fault_around_whole_tables();
    let (release, _) = sys::uname();
    crate::info!(
        "sandpit-agent {} up on Linux {release}",
        env!("CARGO_PKG_VERSION")
    );
}

/// Grow the root filesystem to the disk, once, in the background (the disk
/// may have been enlarged since the image was built).
pub fn grow_root_fs() {
    if !Path::new("/dev/vda").exists() {
        return;
    }
    let spawned = thread::Builder::new().name("resize2fs".into()).spawn(|| {
        // Nice values are per thread and inherited by children: resize2fs
        // gets a low priority instead of the agent's high one.
        // SAFETY: plain syscall on the calling thread.
        unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, 10) };
        match reaper::run("resize2fs", &["/dev/vda"], None, Duration::from_secs(1800)) {
            Ok(out) if out.status.success() => {
                crate::info!("resize2fs /dev/vda: {}", out.diagnostics())
            }
            Ok(out) => crate::error!("resize2fs /dev/vda: {}: {}", out.status, out.diagnostics()),
            Err(e) => crate::error!("resize2fs /dev/vda: {e}"),
        }
    });
    if let Err(e) = spawned {
        crate::error!("cannot start resize2fs: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detects_mount_points() {
        assert!(is_mountpoint(Path::new("/")));
        assert!(is_mountpoint(Path::new("/proc")));
        assert!(!is_mountpoint(Path::new("/proc/self")));
    }
}
