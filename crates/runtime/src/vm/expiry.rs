//! Expiry that holds while no `sandpit` process does.
//!
//! A sandbox must be gone when it expires "whether or not anything remembered
//! to ask", and that includes the server: killed, crash-looping, stopped for
//! a bad upgrade. So every VM has a watchdog of its own on the host, started
//! with its QEMU and independent of the process that started it: a few lines
//! of bash (Debian always has it; 0.3 MiB private memory, no process of ours
//! to upgrade or crash) in its own session, that kills the VM at its expiry
//! and removes its directory.
//!
//! - The expiry is a file in the VM's directory ([`EXPIRES_FILE`], unix
//!   seconds), written atomically by [`write_expiry`] before QEMU starts and
//!   again on every extension; the watchdog rereads it whenever it wakes, so
//!   an extension needs no signal; if the file is lost, the last expiry read
//!   holds. It only ever moves later; a VM without a
//!   sandbox yet (warm pool, template in the making) has a short lease that
//!   its owner keeps renewing, so it dies soon after its owner does.
//! - It sleeps in bash's own `read -t` on a pipe whose only writer is QEMU:
//!   no process per wake-up, and QEMU's exit (a destroy, a crash) closes the
//!   pipe and ends the watchdog at once. While the pipe is open QEMU is alive
//!   (not merely a reused pid), so the kill needs no identity check; passt is
//!   checked by pid and start time. It wakes at least once a minute, so a
//!   wall clock that jumps is caught up with.
//! - The file says [`GRACE_SECS`] past the sandbox's own expiry, so a running
//!   server's reaper, which also settles the bill, normally goes first.
//! - Its command line carries `sandpit-expiry-<id>`, never QEMU's marker nor
//!   the VM's path (which identify QEMU); it runs in the VM's directory.
//!   SIGTERM and SIGHUP are ignored (a `pkill -f sandpit` meant for the
//!   server must not disarm it); destroy SIGKILLs it first.

use crate::{vm::process, Result, RuntimeError};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;
use std::process::Stdio;
use time::OffsetDateTime;

/// The file in a VM's directory that holds when its watchdog kills it.
pub const EXPIRES_FILE: &str = "expires";
/// Seconds the watchdog waits past the expiry it was given.
pub const GRACE_SECS: i64 = 1;
/// The descriptor at which QEMU holds the watchdog pipe's write end.
pub(crate) const QEMU_LIFE_FD: i32 = 4;
/// The descriptor at which the watchdog reads that pipe.
const WATCHDOG_FD: i32 = 3;

/// What the watchdog does once the VM is dead at its expiry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AtExpiry {
    /// Remove the VM's directory (`<vms>/<id>`): nothing of it is left.
    Remove,
    /// Leave the directory to its owner (a template being built).
    Keep,
}

/// The watchdog, as `bash -c SCRIPT sandpit-expiry-<id> QEMU PASST PASST_START ACTION`.
const SCRIPT: &str = r#"
trap '' TERM HUP INT
id=${0#sandpit-expiry-} qemu=$1 passt=$2 passt_started=$3 at_expiry=$4 dir=$PWD expires=
while :; do
    # The last expiry read holds if the file goes (a destroy kills us first).
    IFS= read -r e < expires && expires=$e
    [[ $expires ]] || exit 0
    printf -v now '%(%s)T' -1
    left=$((expires - now))
    ((left > 0)) || break
    ((left > 60)) && left=60
    read -r -t "$left" -u 3 _
    (($? > 128)) || exit 0                      # QEMU is gone: not ours to clean
done
read -r -t 0 -u 3 && exit 0                     # QEMU ended just now
kill -KILL "$qemu" 2>/dev/null
read -r -t 10 -u 3 _                            # until its end of the pipe closes
if ((passt > 0)) && IFS= read -r stat < "/proc/$passt/stat" 2>/dev/null; then
    set -- ${stat##*) }
    [[ ${20:-} == "$passt_started" ]] && kill -KILL "$passt" 2>/dev/null
fi
if [[ $at_expiry == remove && $dir == */vms/"$id" ]]; then
    cd / && rm -rf -- "$dir"
fi
"#;

/// The marker in a watchdog's command line.
pub fn watchdog_marker(id: &str) -> String {
    format!("sandpit-expiry-{id}")
}

/// Set when the VM in `dir` expires: the watchdog kills it [`GRACE_SECS`]
/// after `at`. Atomic (a watchdog never reads half a file).
pub fn write_expiry(dir: &Path, at: OffsetDateTime) -> Result<()> {
    // Rounded up: never before `at`.
    let secs = at.unix_timestamp() + i64::from(at.nanosecond() > 0) + GRACE_SECS;
    let tmp = dir.join("expires.tmp");
    std::fs::write(&tmp, format!("{secs}\n")).map_err(RuntimeError::io("writing the expiry"))?;
    std::fs::rename(&tmp, dir.join(EXPIRES_FILE)).map_err(RuntimeError::io("writing the expiry"))
}

/// When the VM in `dir` expires, as its watchdog reads it.
pub fn read_expiry(dir: &Path) -> Option<OffsetDateTime> {
    let text = std::fs::read_to_string(dir.join(EXPIRES_FILE)).ok()?;
    let secs: i64 = text.trim().parse().ok()?;
    OffsetDateTime::from_unix_timestamp(secs - GRACE_SECS).ok()
}

/// The pipe between a VM's QEMU and its watchdog: `(read end, write end)`,
/// both close-on-exec (each child gets its end by [`crate::vm::net::pass_fd`]).
pub(crate) fn life_pipe() -> Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0i32; 2];
    // SAFETY: pipe2 fills two fresh descriptors that we then own.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(RuntimeError::io("creating the watchdog pipe")(
            std::io::Error::last_os_error(),
        ));
    }
    // SAFETY: both are fresh descriptors owned by no one else.
    let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    Ok((above_targets(r)?, above_targets(w)?))
}

/// The same open file at a descriptor number above every fixed number a
/// child is given (`NET_FD`, [`QEMU_LIFE_FD`], [`WATCHDOG_FD`], the RAM
/// image's), so moving one descriptor into place in the child never closes
/// another.
pub(crate) fn above_targets(fd: OwnedFd) -> Result<OwnedFd> {
    const FLOOR: i32 = 10;
    if fd.as_raw_fd() >= FLOOR {
        return Ok(fd);
    }
    // SAFETY: F_DUPFD_CLOEXEC returns a new descriptor that we then own.
    let dup = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, FLOOR) };
    if dup < 0 {
        return Err(RuntimeError::io("creating the watchdog pipe")(
            std::io::Error::last_os_error(),
        ));
    }
    // SAFETY: a fresh descriptor from the kernel.
    Ok(unsafe { OwnedFd::from_raw_fd(dup) })
}

/// Start the watchdog of VM `id` in `dir`, whose QEMU (`qemu_pid`) holds the
/// write end of the pipe whose read end is `life`. Returns its pid and start
/// time (its identity, see [`process::start_time`]).
pub(crate) fn start_watchdog(
    dir: &Path,
    id: &str,
    qemu_pid: u32,
    passt: Option<(u32, u64)>,
    at_expiry: AtExpiry,
    life: OwnedFd,
) -> Result<(u32, u64)> {
    let (passt_pid, passt_started) = passt.unwrap_or((0, 0));
    // tokio's, so that its exit is reaped (no zombie per destroyed VM); it
    // is never killed on drop.
    let mut cmd = tokio::process::Command::new("/bin/bash");
    cmd.arg("--noprofile")
        .arg("--norc")
        .arg("-c")
        .arg(SCRIPT)
        .arg(watchdog_marker(id))
        .arg(qemu_pid.to_string())
        .arg(passt_pid.to_string())
        .arg(passt_started.to_string())
        .arg(match at_expiry {
            AtExpiry::Remove => "remove",
            AtExpiry::Keep => "keep",
        })
        .current_dir(dir)
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(false);
    let fd = life.as_raw_fd();
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            libc::setsid();
            crate::vm::net::pass_fd(fd, WATCHDOG_FD)
        });
    }
    let child = cmd.spawn().map_err(RuntimeError::spawn(
        "/bin/bash",
        "bash",
        "starting the expiry watchdog",
    ))?;
    drop(life);
    let pid = child.id().unwrap_or(0);
    // Dropped, not killed: tokio reaps it if it exits while we live, init
    // after that; we track it by pid and start time.
    drop(child);
    Ok((pid, process::start_time(pid).unwrap_or(0)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    /// A stand-in "VM": a sleeping process holding the pipe's write end, in
    /// a directory named like a VM's.
    fn fake_vm(root: &Path, id: &str) -> (std::path::PathBuf, std::process::Child, OwnedFd) {
        use std::os::unix::process::CommandExt;
        let dir = root.join("vms").join(id);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("disk.qcow2"), b"disk").unwrap();
        let (r, w) = life_pipe().unwrap();
        let wfd = w.as_raw_fd();
        let mut cmd = std::process::Command::new("sleep");
        cmd.arg("300");
        // SAFETY: dup2 between fork and exec.
        unsafe {
            cmd.pre_exec(move || crate::vm::net::pass_fd(wfd, QEMU_LIFE_FD));
        }
        let child = cmd.spawn().unwrap();
        drop(w);
        (dir, child, r)
    }

    fn wait_until(what: &str, bound: Duration, mut f: impl FnMut() -> bool) {
        let deadline = Instant::now() + bound;
        while !f() {
            assert!(Instant::now() < deadline, "timed out waiting until {what}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn gone(pid: u32) -> bool {
        // A zombie (our unreaped child) counts as gone.
        std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |s| {
            s.rsplit_once(')')
                .is_some_and(|(_, r)| r.trim_start().starts_with('Z'))
        })
    }

    #[test]
    fn the_expiry_round_trips_and_is_never_early() {
        let tmp = tempfile::tempdir().unwrap();
        let at = OffsetDateTime::from_unix_timestamp(1_900_000_000).unwrap()
            + time::Duration::milliseconds(300);
        write_expiry(tmp.path(), at).unwrap();
        let text = std::fs::read_to_string(tmp.path().join(EXPIRES_FILE)).unwrap();
        assert_eq!(text, format!("{}\n", 1_900_000_001 + GRACE_SECS));
        assert!(read_expiry(tmp.path()).unwrap() >= at);
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    #[test]
    fn the_watchdog_kills_at_the_expiry_as_extended_and_removes_the_directory() {
        let rt = runtime();
        let _in = rt.enter();
        let tmp = tempfile::tempdir().unwrap();
        let (dir, mut vm, life) = fake_vm(tmp.path(), "sbx_expiring");
        let now = OffsetDateTime::now_utc();
        write_expiry(&dir, now + time::Duration::seconds(1)).unwrap();
        let (wd, _) =
            start_watchdog(&dir, "sbx_expiring", vm.id(), None, AtExpiry::Remove, life).unwrap();
        // Extended before it was due: the watchdog rereads the file.
        write_expiry(&dir, now + time::Duration::seconds(4)).unwrap();
        std::thread::sleep(Duration::from_millis(3500));
        assert!(
            vm.try_wait().unwrap().is_none(),
            "killed before its extended expiry"
        );
        let started = Instant::now();
        let status = vm.wait().unwrap();
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(libc::SIGKILL)
        );
        assert!(started.elapsed() < Duration::from_secs(5));
        wait_until("the directory is removed", Duration::from_secs(5), || {
            !dir.exists()
        });
        wait_until("the watchdog exits", Duration::from_secs(5), || gone(wd));
    }

    #[test]
    fn the_watchdog_ends_with_its_vm_and_ignores_sigterm() {
        let rt = runtime();
        let _in = rt.enter();
        let tmp = tempfile::tempdir().unwrap();
        let (dir, mut vm, life) = fake_vm(tmp.path(), "sbx_destroyed");
        write_expiry(&dir, OffsetDateTime::now_utc() + time::Duration::hours(1)).unwrap();
        let (wd, _) =
            start_watchdog(&dir, "sbx_destroyed", vm.id(), None, AtExpiry::Remove, life).unwrap();
        wait_until(
            "the watchdog runs its script",
            Duration::from_secs(5),
            || {
                std::fs::read(format!("/proc/{wd}/cmdline")).is_ok_and(|c| {
                    String::from_utf8_lossy(&c).contains("sandpit-expiry-sbx_destroyed")
                })
            },
        );
        std::thread::sleep(Duration::from_millis(200));
        // SAFETY: a plain signal to our own child.
        unsafe { libc::kill(wd as i32, libc::SIGTERM) };
        std::thread::sleep(Duration::from_millis(300));
        assert!(!gone(wd), "SIGTERM disarmed the watchdog");
        vm.kill().unwrap();
        vm.wait().unwrap();
        wait_until(
            "the watchdog sees its VM gone",
            Duration::from_secs(5),
            || gone(wd),
        );
        assert!(
            dir.join("disk.qcow2").exists(),
            "a VM that ended otherwise is its owner's to clean"
        );
    }
}
