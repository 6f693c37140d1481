//! The one place that waits for children.
//!
//! As PID 1 the agent inherits every orphan in the VM, so something must
//! `waitpid(-1)` or zombies pile up; but a `waitpid(-1)` also steals the
//! statuses of our own commands from whoever waits for them specifically.
//! So nothing else waits: one reaper thread sleeps in `sigwait(SIGCHLD)`
//! (SIGCHLD is blocked in every thread, set in `main` before any thread
//! starts), then reaps everything with `waitpid(-1, WNOHANG)` and hands each
//! status to the callback registered for that pid; orphans' statuses are
//! dropped.
//!
//! The race "child exits before its pid is registered" is closed two ways.
//! Root's own tools ([`spawn`]) are started with the registry locked, which
//! also makes std's own `waitpid` in `Command::spawn`'s failure path (exec
//! failed) safe. The user's shells ([`register`]) are not: the user can stop
//! a shell between its `setuid` and its `execve` (`kill -STOP -1` in a loop),
//! and the spawning thread sleeps until that `execve` (`CLONE_VFORK`); with
//! the lock held, every later command and the reaper froze behind it. So a
//! shell is announced beforehand as a [`Pending`] spawn, whose pid the kernel
//! writes into it at the clone (`CLONE_PARENT_SETTID`, before the child can
//! run, let alone exit); a status reaped before the shell's registration is
//! kept there and handed over at registration.
//!
//! A pending spawn that takes long is looked after by the midwife thread: it
//! sends the child SIGCONT every few milliseconds (a stopped child makes one
//! step per SIGCONT, and it has only a few steps to go), and SIGKILL once the
//! command's deadline has passed, so that the command fails by its timeout
//! whatever the user keeps doing. Its signals are sent with the registry
//! locked, and only to a child not yet reaped: its pid cannot have been
//! reused.
//!
//! Children get a clean signal state (empty mask, default SIGPIPE): std
//! nowadays lets a child inherit the parent's mask, and ours blocks SIGCHLD
//! and SIGIO, which would confuse shells and every program they start.

use crate::sys::{self, lock};
use std::collections::BTreeMap;
use std::io::{self, Read, Write};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicI32, AtomicI64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

/// Called with the raw wait status, on the reaper thread with the registry
/// locked (or on the spawning thread): it must be quick and never block
/// (send on an unbounded channel).
pub type ExitCallback = Box<dyn FnOnce(i32) + Send>;

/// Who waits for which child, and the spawns whose pid is not known yet.
struct Registry {
    waiters: BTreeMap<libc::pid_t, ExitCallback>,
    pending: Vec<Arc<Pending>>,
}

static REGISTRY: Mutex<Registry> = Mutex::new(Registry {
    waiters: BTreeMap::new(),
    pending: Vec::new(),
});

/// Woken when a spawn becomes pending.
static MIDWIFE: Condvar = Condvar::new();

/// A spawn under way whose child may not have exec'd yet.
pub struct Pending {
    /// The child's pid, written by the kernel (`CLONE_PARENT_SETTID`); 0
    /// before the clone.
    tid: AtomicI32,
    /// A wait status the reaper collected before the child was registered;
    /// -1 for none.
    status: AtomicI64,
    since: Instant,
    /// When the command's time is up: the midwife kills the child then.
    deadline: Option<Instant>,
}

impl Pending {
    /// Where the kernel writes the child's pid.
    pub fn tid_ptr(&self) -> *const AtomicI32 {
        &self.tid
    }

    fn reaped(&self) -> Option<i32> {
        match self.status.load(Ordering::SeqCst) {
            -1 => None,
            s => Some(s as i32),
        }
    }
}

/// How long a spawn may take before the midwife steps in, and how often it
/// looks again.
const MIDWIFE_AFTER: Duration = Duration::from_millis(20);
const MIDWIFE_EVERY: Duration = Duration::from_millis(5);

/// Start the reaper and midwife threads. SIGCHLD must already be blocked.
pub fn start() -> io::Result<()> {
    thread::Builder::new()
        .name("reaper".into())
        .stack_size(128 * 1024)
        .spawn(reap_forever)?;
    thread::Builder::new()
        .name("midwife".into())
        .stack_size(64 * 1024)
        .spawn(midwife_forever)?;
    Ok(())
}

fn midwife_forever() {
    let mut registry = lock(&REGISTRY);
    loop {
        if registry.pending.is_empty() {
            registry = MIDWIFE
                .wait(registry)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            continue;
        }
        let now = Instant::now();
        for p in &registry.pending {
            let pid = p.tid.load(Ordering::SeqCst);
            if pid <= 0 || p.reaped().is_some() || now < p.since + MIDWIFE_AFTER {
                continue;
            }
            let signal = match p.deadline {
                Some(d) if now >= d => libc::SIGKILL,
                _ => libc::SIGCONT,
            };
            // SAFETY: plain syscall; the child has not been reaped (the
            // registry is locked and holds no status for it), so `pid` is
            // still the child's.
            unsafe { libc::kill(pid, signal) };
        }
        registry = MIDWIFE
            .wait_timeout(registry, MIDWIFE_EVERY)
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .0;
    }
}

fn reap_forever() {
    let set = sys::sigset(&[libc::SIGCHLD]);
    loop {
        // Reap first: a SIGCHLD that arrived before this thread started (or
        // while it was busy) is coalesced into the one pending signal.
        reap_all();
        sys::wait_signal(&set, None);
    }
}

fn reap_all() {
    let mut registry = lock(&REGISTRY);
    loop {
        let mut status = 0;
        // SAFETY: plain syscall with a valid status pointer.
        let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
        if pid > 0 {
            if let Some(callback) = registry.waiters.remove(&pid) {
                callback(status);
            } else if let Some(p) = registry
                .pending
                .iter()
                .find(|p| p.tid.load(Ordering::SeqCst) == pid)
            {
                p.status.store(i64::from(status), Ordering::SeqCst);
            }
            continue;
        }
        if pid < 0 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
            continue;
        }
        // 0: children remain but none has exited; -1/ECHILD: no children.
        return;
    }
}

/// Restore a normal signal state in a forked child (async-signal-safe).
fn reset_child_signals() -> io::Result<()> {
    // SAFETY: only async-signal-safe calls, in the single-threaded child.
    unsafe {
        let mut empty: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut empty);
        libc::sigprocmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    Ok(())
}

/// Start a child with `start` and register `on_exit` for its status, without
/// holding the registry meanwhile (see the module docs). `start` gets the
/// [`Pending`] spawn, whose [`Pending::tid_ptr`] the clone must fill with the
/// child's pid (`CLONE_PARENT_SETTID`), and returns that pid. The midwife
/// kills the child at `deadline` if it has not exec'd by then.
pub fn register(
    on_exit: ExitCallback,
    deadline: Option<Instant>,
    start: impl FnOnce(&Pending) -> io::Result<u32>,
) -> io::Result<u32> {
    let pending = Arc::new(Pending {
        tid: AtomicI32::new(0),
        status: AtomicI64::new(-1),
        since: Instant::now(),
        deadline,
    });
    lock(&REGISTRY).pending.push(pending.clone());
    MIDWIFE.notify_one();
    let started = start(&pending);
    let mut registry = lock(&REGISTRY);
    registry.pending.retain(|p| !Arc::ptr_eq(p, &pending));
    let pid = started?;
    match pending.reaped() {
        Some(status) => {
            drop(registry);
            on_exit(status);
        }
        None => {
            registry.waiters.insert(pid as libc::pid_t, on_exit);
        }
    }
    Ok(pid)
}

/// Spawn `cmd` and register `on_exit` for its status, atomically with respect
/// to the reaper. Never call `wait` on the returned `Child`.
pub fn spawn(cmd: &mut Command, on_exit: ExitCallback) -> io::Result<Child> {
    // SAFETY: reset_child_signals is async-signal-safe.
    unsafe { cmd.pre_exec(reset_child_signals) };
    let mut registry = lock(&REGISTRY);
    let child = cmd.spawn()?;
    registry.waiters.insert(child.id() as libc::pid_t, on_exit);
    Ok(child)
}

/// Spawn `cmd`; its wait status arrives on the returned channel.
pub fn spawn_waitable(cmd: &mut Command) -> io::Result<(Child, mpsc::Receiver<i32>)> {
    let (tx, rx) = mpsc::channel();
    let child = spawn(
        cmd,
        Box::new(move |status| {
            let _ = tx.send(status);
        }),
    )?;
    Ok((child, rx))
}

/// How a process ended, decoded from a wait status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitStatus {
    Code(i32),
    Signal(i32),
}

impl ExitStatus {
    pub fn from_raw(status: i32) -> Self {
        if libc::WIFSIGNALED(status) {
            ExitStatus::Signal(libc::WTERMSIG(status))
        } else {
            ExitStatus::Code(libc::WEXITSTATUS(status))
        }
    }

    pub fn success(self) -> bool {
        self == ExitStatus::Code(0)
    }
}

impl std::fmt::Display for ExitStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ExitStatus::Code(c) => write!(f, "exit code {c}"),
            ExitStatus::Signal(s) => write!(f, "killed by signal {s}"),
        }
    }
}

/// Result of [`run`].
#[derive(Debug)]
pub struct Output {
    pub status: ExitStatus,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
}

impl Output {
    /// stderr (or stdout when stderr is empty) as trimmed text, for messages.
    pub fn diagnostics(&self) -> String {
        let text = if self.stderr.iter().all(u8::is_ascii_whitespace) {
            &self.stdout
        } else {
            &self.stderr
        };
        String::from_utf8_lossy(text).trim().to_string()
    }
}

/// Where system tools live; also the PATH they run with.
const SYSTEM_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Find a system tool by name in [`SYSTEM_PATH`].
pub fn find_program(name: &str) -> Option<String> {
    SYSTEM_PATH
        .split(':')
        .map(|dir| format!("{dir}/{name}"))
        .find(|p| Path::new(p).is_file())
}

/// Most output kept from a helper tool.
const MAX_CAPTURE: u64 = 256 * 1024;

/// Run a system tool as root (`ip`, `nft`, `resize2fs`) through the reaper,
/// feed it `stdin`, capture its output, kill it after `timeout`.
pub fn run(
    program: &str,
    args: &[&str],
    stdin: Option<Vec<u8>>,
    timeout: Duration,
) -> io::Result<Output> {
    let path = find_program(program).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::NotFound,
            format!("{program}: command not found"),
        )
    })?;
    let mut cmd = Command::new(path);
    cmd.args(args)
        .env_clear()
        .env("PATH", SYSTEM_PATH)
        .env("LANG", "C.UTF-8")
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let (mut child, exited) = spawn_waitable(&mut cmd)?;
    let pid = child.id() as libc::pid_t;

    let feeder = match (child.stdin.take(), stdin) {
        (Some(mut pipe), Some(bytes)) => Some(thread::Builder::new().spawn(move || {
            let _ = pipe.write_all(&bytes);
        })?),
        _ => None,
    };
    let capture = |pipe: Option<Box<dyn Read + Send>>| -> io::Result<_> {
        thread::Builder::new().spawn(move || {
            let mut out = Vec::new();
            if let Some(p) = pipe {
                let mut limited = p.take(MAX_CAPTURE);
                let _ = limited.read_to_end(&mut out);
                // Keep draining so the tool never blocks on a full pipe.
                let _ = io::copy(&mut limited.into_inner(), &mut io::sink());
            }
            out
        })
    };
    let out_reader = capture(
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    )?;
    let err_reader = capture(
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    )?;
    drop(child);

    let status = match exited.recv_timeout(timeout) {
        Ok(s) => s,
        Err(_) => {
            // SAFETY: the pid is still ours: it has not been reaped yet.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            exited
                .recv()
                .map_err(|_| io::Error::other("lost the exit status"))?
        }
    };
    if let Some(f) = feeder {
        let _ = f.join();
    }
    let stdout = out_reader.join().unwrap_or_default();
    let stderr = err_reader.join().unwrap_or_default();
    Ok(Output {
        status: ExitStatus::from_raw(status),
        stdout,
        stderr,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_wait_statuses() {
        assert_eq!(ExitStatus::from_raw(0), ExitStatus::Code(0));
        assert_eq!(ExitStatus::from_raw(3 << 8), ExitStatus::Code(3));
        assert_eq!(ExitStatus::from_raw(9), ExitStatus::Signal(9));
        assert!(ExitStatus::Code(0).success());
        assert!(!ExitStatus::Signal(9).success());
    }

    #[test]
    fn finds_programs_on_the_system_path() {
        assert!(find_program("sh").is_some());
        assert!(find_program("definitely-not-a-program-xyz").is_none());
    }

    #[test]
    fn diagnostics_prefer_stderr() {
        let o = Output {
            status: ExitStatus::Code(1),
            stdout: b"out\n".to_vec(),
            stderr: b"  err\n".to_vec(),
        };
        assert_eq!(o.diagnostics(), "err");
        let o = Output {
            stderr: b"\n".to_vec(),
            ..o
        };
        assert_eq!(o.diagnostics(), "out");
    }
}
