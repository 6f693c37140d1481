//! Host processes the runtime owns (QEMU, passt), found again by pid across
//! CLI invocations and server restarts.
//!
//! A pid alone is not an identity (pids are reused), so a process counts as
//! ours only while its command line still carries the marker we gave it.

use std::os::fd::{FromRawFd, OwnedFd};
use std::time::Duration;

/// Is `pid` alive (not a zombie) with `marker` in its command line?
pub fn alive_with_marker(pid: u32, marker: &str) -> bool {
    if pid == 0 {
        return false;
    }
    let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    if !String::from_utf8_lossy(&cmdline).contains(marker) {
        return false;
    }
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            // state is the field after the parenthesised comm
            let state = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().next())
                .unwrap_or("?");
            state != "Z" && state != "X"
        }
        Err(_) => false,
    }
}

/// Pids of the processes, other than this one, whose command line contains
/// `needle` (a marker, or a data directory's path), zombies included.
pub fn pids_mentioning(needle: &str) -> Vec<u32> {
    let me = std::process::id();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    procs
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| pid != me)
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains(needle))
        })
        .collect()
}

/// SIGKILL every process [`pids_mentioning`] `needle`, without waiting.
pub fn kill_mentioning(needle: &str) {
    for pid in pids_mentioning(needle) {
        // SAFETY: a plain signal.
        unsafe {
            libc::kill(pid as libc::pid_t, libc::SIGKILL);
        }
    }
}

/// When a process started (clock ticks since boot, field 22 of its stat):
/// with the pid, a unique identity even across exec (passt re-executes
/// itself into a CPU-specific binary, changing its command line).
pub fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    if fields.first() == Some(&"Z") {
        return None;
    }
    fields.get(19)?.parse().ok()
}

/// SIGKILL the process `(pid, started)` if it still is that process, and wait
/// (bounded) until it is gone.
pub async fn kill_identified(pid: u32, started: u64, bound: Duration) -> bool {
    if start_time(pid) != Some(started) {
        return true;
    }
    let fd = pidfd_open(pid);
    if start_time(pid) != Some(started) {
        return true;
    }
    // SAFETY: the pidfd pins the process; its start time proves it is ours.
    unsafe {
        libc::kill(pid as libc::pid_t, libc::SIGKILL);
    }
    match fd {
        Some(fd) => tokio::time::timeout(bound, wait_pidfd(fd)).await.is_ok(),
        None => false,
    }
}

/// Open a pidfd (Linux ≥ 5.3): readable once the process exits.
pub fn pidfd_open(pid: u32) -> Option<OwnedFd> {
    // SAFETY: plain syscall; a non-negative result is a new fd we own.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        None
    } else {
        // SAFETY: fd is a fresh descriptor returned by the kernel.
        Some(unsafe { OwnedFd::from_raw_fd(fd as i32) })
    }
}

/// Wait until the process behind a pidfd exits.
pub async fn wait_pidfd(fd: OwnedFd) {
    // SAFETY: the OwnedFd is moved into the AsyncFd and stays open, unchanged,
    // for its whole lifetime.
    match unsafe {
        tokio::io::unix::AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE)
    } {
        Ok(afd) => {
            let _ = afd.readable().await;
        }
        Err(_) => std::future::pending::<()>().await,
    }
}

/// SIGKILL a process that is ours and wait (bounded) until it is gone.
pub async fn kill_and_wait(pid: u32, marker: &str, bound: Duration) -> bool {
    if !alive_with_marker(pid, marker) {
        return true;
    }
    let fd = pidfd_open(pid);
    // SAFETY: signalling a pid we just verified carries our marker.
    unsafe {
        libc::kill(pid as libc::pid_t, libc::SIGKILL);
    }
    match fd {
        Some(fd) => tokio::time::timeout(bound, wait_pidfd(fd)).await.is_ok(),
        None => {
            let deadline = std::time::Instant::now() + bound;
            while alive_with_marker(pid, marker) && std::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            !alive_with_marker(pid, marker)
        }
    }
}

/// How much CPU a VM's processes may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Priority {
    /// Like any other process.
    Normal,
    /// Only what nothing else wants (`SCHED_IDLE`, nice 19): for VMs made
    /// ahead of demand, so they never slow live sandboxes down.
    Background,
}

/// Apply `priority` to the calling thread (between fork and exec: only
/// async-signal-safe calls).
pub fn apply_priority_to_self(priority: Priority) {
    set_thread_priority(0, priority);
}

/// Apply `priority` to every thread of process `pid` (scheduling policy and
/// nice are per thread on Linux; QEMU's vCPU threads inherit them only when
/// they are created).
pub fn set_priority(pid: u32, priority: Priority) {
    let Ok(rd) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return;
    };
    for t in rd.flatten() {
        if let Some(tid) = t.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) {
            set_thread_priority(tid, priority);
        }
    }
}

fn set_thread_priority(tid: i32, priority: Priority) {
    let (policy, nice) = match priority {
        Priority::Normal => (libc::SCHED_OTHER, 0),
        Priority::Background => (libc::SCHED_IDLE, 19),
    };
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: plain syscalls on a thread id; a failure leaves it as it was.
    unsafe {
        libc::sched_setscheduler(tid, policy, &param);
        libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, nice);
    }
}

/// Find a process whose command line carries `marker`.
pub fn find_by_marker(marker: &str) -> Option<u32> {
    let rd = std::fs::read_dir("/proc").ok()?;
    for e in rd.flatten() {
        if let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) {
            if alive_with_marker(pid, marker) {
                return Some(pid);
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn processes_are_found_and_killed_by_what_their_command_line_mentions() {
        let marker = format!("sandpit-test-marker-{}", std::process::id());
        let mut child = std::process::Command::new("sh")
            // A builtin waiting on a pipe: the shell neither forks (a
            // child would mention the marker too until it exec'd) nor
            // execs (the marker, its `$0`, would leave the command line).
            .args(["-c", "read line", &marker])
            .stdin(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // Until the child has exec'd, its command line is this test's.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while pids_mentioning(&marker).is_empty() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(pids_mentioning(&marker), vec![child.id()]);
        kill_mentioning(&marker);
        let status = child.wait().unwrap();
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(libc::SIGKILL)
        );
        assert!(pids_mentioning(&marker).is_empty());
    }
}
