//! cgroup v2 limits for the guest user.
//!
//! Every user command lives in `/sys/fs/cgroup/user/exec-N`; `user` carries
//! the limits (pids.max against fork bombs, memory.max so the agent and
//! kernel always keep `reserved_memory_mb`), the agent itself stays in the
//! root cgroup. Commands share the CPU per command, not per process (the cpu
//! controller is on in `user`'s subtree). One cgroup per command gives a reliable "kill everything this
//! command started" (`cgroup.kill`), even processes that left the process
//! group with setsid.
//!
//! A command's shell is created inside its cgroup (`CLONE_INTO_CGROUP`, see
//! `spawn`), through a descriptor of the cgroup's directory opened when the
//! cgroup was made.
//!
//! A command's cgroup that is empty when the command ends becomes the next
//! command's: nothing of the old command is left in it, and no per-command
//! statistic is ever read, so a new one would only cost a `mkdir` and a
//! `rmdir` (a memory cgroup's set-up and tear-down, a millisecond or two
//! under emulation). Not one that was killed, though (see `ExecCgroup`'s
//! `Drop`). One still busy (background processes) is removed once empty,
//! retried at the start of each later exec: no timers, so an idle sandbox
//! costs nothing. When there is no spare, one is made once a command has
//! answered, off the path of the next one.

use crate::sys::{self, lock};
use std::collections::BTreeSet;
use std::fs;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Mutex;

const ROOT: &str = "/sys/fs/cgroup";
const USER: &str = "/sys/fs/cgroup/user";

/// pids.max before the host's Configure arrives.
pub const DEFAULT_PIDS_MAX: u32 = 4096;
/// Memory kept back before the host's Configure arrives, MiB.
pub const DEFAULT_RESERVED_MB: u32 = 64;
/// The user never gets less than this, whatever the reservation says.
const MIN_USER_MEMORY: u64 = 32 * 1024 * 1024;

static ENABLED: AtomicBool = AtomicBool::new(false);
static PIDS_MAX: AtomicU32 = AtomicU32::new(DEFAULT_PIDS_MAX);

/// A made, empty cgroup for the next command.
struct Spare {
    n: u64,
    /// The pids.max cap written into it.
    cap: Option<u32>,
    dir: OwnedFd,
}

struct State {
    next: u64,
    spare: Option<Spare>,
    /// Ended commands' cgroups that still held processes.
    busy: BTreeSet<u64>,
}

static STATE: Mutex<State> = Mutex::new(State {
    next: 1,
    spare: None,
    busy: BTreeSet::new(),
});

fn exec_path(n: u64) -> PathBuf {
    PathBuf::from(format!("{USER}/exec-{n}"))
}

/// Enable the controllers and create the user cgroup (PID 1 only).
pub fn setup() {
    for c in ["+pids", "+memory", "+cpu"] {
        if let Err(e) = sys::write_kernel_file(format!("{ROOT}/cgroup.subtree_control"), c) {
            crate::error!("cgroup: cannot enable {c} at the root: {e}");
        }
    }
    if let Err(e) = fs::create_dir(USER) {
        if e.kind() != io::ErrorKind::AlreadyExists {
            crate::error!("cgroup: cannot create {USER}: {e}; running without limits");
            return;
        }
    }
    // cpu in the user's subtree: every command's cgroup gets an equal share,
    // so one command's thousand busy processes cannot starve the next command.
    for c in ["+pids", "+memory", "+cpu"] {
        if let Err(e) = sys::write_kernel_file(format!("{USER}/cgroup.subtree_control"), c) {
            crate::error!("cgroup: cannot enable {c} for {USER}: {e}");
        }
    }
    ENABLED.store(true, Ordering::SeqCst);
    if let Err(e) = apply_limits(DEFAULT_PIDS_MAX, DEFAULT_RESERVED_MB) {
        crate::error!("cgroup: default limits: {e}");
    }
}

/// Most processes the user may have; also used for RLIMIT_NPROC. 0 = unlimited.
pub fn pids_max() -> u32 {
    PIDS_MAX.load(Ordering::SeqCst)
}

/// Set the user's limits (idempotent).
pub fn apply_limits(pids_max: u32, reserved_mb: u32) -> io::Result<()> {
    PIDS_MAX.store(pids_max, Ordering::SeqCst);
    if !ENABLED.load(Ordering::SeqCst) {
        return Ok(());
    }
    let pids = if pids_max == 0 {
        "max".to_string()
    } else {
        pids_max.to_string()
    };
    sys::write_kernel_file(format!("{USER}/pids.max"), &pids)
        .map_err(|e| io::Error::new(e.kind(), format!("pids.max: {e}")))?;
    let meminfo = fs::read_to_string("/proc/meminfo")?;
    let total = parse_mem_total(&meminfo)
        .ok_or_else(|| io::Error::other("no MemTotal in /proc/meminfo"))?;
    let limit = user_memory_limit(total, reserved_mb);
    sys::write_kernel_file(format!("{USER}/memory.max"), &limit.to_string())
        .map_err(|e| io::Error::new(e.kind(), format!("memory.max: {e}")))?;
    Ok(())
}

/// MemTotal in bytes.
pub fn parse_mem_total(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// memory.max for the user: total minus the reservation, page-aligned, and
/// never absurdly small.
pub fn user_memory_limit(total: u64, reserved_mb: u32) -> u64 {
    let limit = total.saturating_sub(u64::from(reserved_mb) * 1024 * 1024);
    let limit = limit.max(MIN_USER_MEMORY.min(total));
    limit & !4095
}

/// The cgroup of one command; when dropped, kept as the next command's if
/// it can be, else removed once empty.
#[derive(Debug)]
pub struct ExecCgroup {
    n: u64,
    cap: Option<u32>,
    path: PathBuf,
    dir: Option<OwnedFd>,
    /// `cgroup.kill` was written: never reuse it (see `Drop`).
    killed: AtomicBool,
}

impl ExecCgroup {
    /// A descriptor of the cgroup's directory, for `CLONE_INTO_CGROUP`.
    pub fn dir_fd(&self) -> RawFd {
        self.dir.as_ref().map_or(-1, |d| d.as_raw_fd())
    }

    fn is_empty(&self) -> bool {
        fs::read_to_string(self.path.join("cgroup.events"))
            .is_ok_and(|text| text.lines().any(|l| l == "populated 0"))
    }

    /// Kill every process in the cgroup (kernel 5.14+).
    pub fn kill(&self) {
        self.killed.store(true, Ordering::SeqCst);
        if let Err(e) = sys::write_kernel_file(self.path.join("cgroup.kill"), "1") {
            if sys::errno(&e) != libc::ENOENT {
                crate::error!("cgroup.kill {}: {e}", self.path.display());
            }
        }
    }
}

impl ExecCgroup {
    /// Wait (bounded) until no process is left in the cgroup, re-killing
    /// stragglers. Only on the kill path: the idle agent never polls.
    pub fn wait_empty(&self, bound: std::time::Duration) {
        let deadline = std::time::Instant::now() + bound;
        let events = self.path.join("cgroup.events");
        loop {
            match fs::read_to_string(&events) {
                Ok(text) if text.lines().any(|l| l == "populated 0") => return,
                Ok(_) => {}
                Err(_) => return,
            }
            if std::time::Instant::now() >= deadline {
                crate::error!("cgroup {} still populated after kill", self.path.display());
                return;
            }
            self.kill();
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }
}

impl Drop for ExecCgroup {
    fn drop(&mut self) {
        let mut st = lock(&STATE);
        // Never one that was killed: the guest's kernel (6.1) compares the
        // cgroup's kill count with the parent cgroup's when a process is
        // cloned into it, so every later shell there would die at birth.
        let reusable = !self.killed.load(Ordering::SeqCst) && self.is_empty();
        if st.spare.is_none() && reusable {
            if let Some(dir) = self.dir.take() {
                st.spare = Some(Spare {
                    n: self.n,
                    cap: self.cap,
                    dir,
                });
                return;
            }
        }
        if let Err(e) = fs::remove_dir(&self.path) {
            if e.kind() != io::ErrorKind::NotFound {
                st.busy.insert(self.n);
            }
        }
    }
}

/// The most processes one command (with everything it started) may have:
/// the user's limit minus a reserve, so a fork bomb left running in the
/// background cannot stop the next command from starting (or from killing it).
pub fn per_command_pids_max(user_pids_max: u32) -> Option<u32> {
    if user_pids_max == 0 {
        return None;
    }
    let reserve = (user_pids_max / 4).min(256);
    Some(user_pids_max - reserve)
}

/// The cgroup for a new command: the spare one made ahead when there is one.
/// `None` when cgroups are unavailable (development, or setup failed).
pub fn create_exec() -> Option<ExecCgroup> {
    if !ENABLED.load(Ordering::SeqCst) {
        return None;
    }
    let mut st = lock(&STATE);
    sweep(&mut st);
    let cap = per_command_pids_max(pids_max());
    let spare = match st.spare.take() {
        Some(spare) => spare,
        None => make(&mut st, cap)?,
    };
    let path = exec_path(spare.n);
    // The limits may have changed (Configure) since it was made.
    if spare.cap != cap && !write_cap(&path, cap) {
        let _ = fs::remove_dir(&path);
        return None;
    }
    Some(ExecCgroup {
        n: spare.n,
        cap,
        path,
        dir: Some(spare.dir),
        killed: AtomicBool::new(false),
    })
}

/// Make the cgroup the next command will use, if there is none yet. Called
/// once a command has answered, off the path of any request.
pub fn prepare_spare() {
    if !ENABLED.load(Ordering::SeqCst) {
        return;
    }
    let mut st = lock(&STATE);
    if st.spare.is_none() {
        let cap = per_command_pids_max(pids_max());
        st.spare = make(&mut st, cap);
    }
}

/// mkdir a new exec cgroup with its pids.max, and open it.
fn make(st: &mut State, cap: Option<u32>) -> Option<Spare> {
    for _ in 0..16 {
        let n = st.next;
        st.next += 1;
        let path = exec_path(n);
        match fs::create_dir(&path) {
            Ok(()) => {
                // A new cgroup starts at "max".
                if cap.is_some() {
                    write_cap(&path, cap);
                }
                let dir = fs::OpenOptions::new()
                    .read(true)
                    .custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC)
                    .open(&path);
                return match dir {
                    Ok(dir) => Some(Spare {
                        n,
                        cap,
                        dir: dir.into(),
                    }),
                    Err(e) => {
                        crate::error!("cgroup: cannot open {}: {e}", path.display());
                        let _ = fs::remove_dir(&path);
                        None
                    }
                };
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(e) => {
                crate::error!("cgroup: cannot create {}: {e}", path.display());
                return None;
            }
        }
    }
    None
}

fn write_cap(path: &std::path::Path, cap: Option<u32>) -> bool {
    let value = cap.map_or_else(|| "max".to_string(), |c| c.to_string());
    match sys::write_kernel_file(path.join("pids.max"), &value) {
        Ok(()) => true,
        Err(e) => {
            crate::error!("cgroup: pids.max of {}: {e}", path.display());
            false
        }
    }
}

/// rmdir the cgroups of ended commands whose background processes have
/// exited since; those still busy fail with EBUSY and stay listed.
fn sweep(st: &mut State) {
    st.busy.retain(|n| match fs::remove_dir(exec_path(*n)) {
        Ok(()) => false,
        Err(e) => e.kind() != io::ErrorKind::NotFound,
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_command_leaves_room_for_another() {
        assert_eq!(per_command_pids_max(4096), Some(3840));
        assert_eq!(per_command_pids_max(100), Some(75));
        assert_eq!(per_command_pids_max(0), None);
    }

    #[test]
    fn parses_meminfo() {
        let m = "MemTotal:        2030000 kB\nMemFree:  100 kB\n";
        assert_eq!(parse_mem_total(m), Some(2_030_000 * 1024));
        assert_eq!(parse_mem_total("nothing"), None);
    }

    #[test]
    fn memory_limit_keeps_the_reservation() {
        let gib = 1024 * 1024 * 1024;
        assert_eq!(user_memory_limit(gib, 64), gib - 64 * 1024 * 1024);
        // A reservation larger than memory leaves the user a minimum.
        assert_eq!(user_memory_limit(gib, 4096), MIN_USER_MEMORY);
        // ... but never more than there is.
        assert_eq!(user_memory_limit(16 * 1024 * 1024, 64), 16 * 1024 * 1024);
        assert_eq!(user_memory_limit(gib + 123, 0) % 4096, 0);
    }
}
