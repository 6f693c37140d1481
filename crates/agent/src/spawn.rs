//! Starting the user's shell without copying the agent.
//!
//! `std::process::Command` with a `pre_exec` closure forks: the kernel copies
//! the agent's page tables (a multi-threaded process with a thread stack per
//! request), then every page either side writes before the child execs is a
//! copy-on-write fault, and joining the command's cgroup is a write to
//! `cgroup.procs`, a cgroup migration. Under emulation each of those is
//! costly: fork plus exec of the agent's child was 5–7 ms of a `true`'s
//! round trip.
//!
//! So the shell is started the way `posix_spawn` starts programs, with
//! `clone3(CLONE_VM | CLONE_VFORK)`: the child runs on a small stack of its
//! own in the agent's memory, the calling thread sleeps until the child has
//! exec'd (or failed to), and nothing is copied. `CLONE_INTO_CGROUP` makes
//! the child in its command's cgroup in the first place. glibc has no
//! wrapper for a `clone3` with `CLONE_VM` (the child must not return into
//! the caller's frame), hence the few lines of assembly in [`clone3`].
//!
//! The child shares the agent's memory until exec, so it only makes raw
//! syscalls on data prepared before the clone: no allocation, no locks, no
//! panics. Signals are blocked around the clone so that no agent handler can
//! run in the child; the child resets SIGPIPE (ignored by Rust's runtime,
//! and an ignored signal stays ignored across exec) and unblocks everything
//! as its last step before `execve`. A failure in the child is reported
//! through shared memory, as its errno.
//!
//! The child also reports which step failed: a `chdir` that fails is the
//! request's working directory (missing, not a directory, not the user's to
//! enter), told apart from a shell that cannot be executed, with no `stat` of
//! the directory beforehand.
//!
//! The descriptors a command needs are made ahead of it: `/dev/null` is
//! opened once, and the next command's two pipes are made once the previous
//! command has answered ([`prepare_spare_pipes`]). Each of those syscalls
//! allocates kernel objects, tens of microseconds apiece under emulation.
//!
//! `CLONE_PIDFD` gives the caller a descriptor that becomes readable when the
//! shell exits, so the thread that waits for the command wakes up directly
//! (see `exec`) instead of through the reaper.
//!
//! Between its `setuid` and its `execve` the child is the user's and still
//! shares the agent's memory. The credential change marks that memory
//! non-dumpable (`fs.suid_dumpable` is 0), and the kernel lets no process
//! without `CAP_SYS_PTRACE` attach to, or read or write through `/proc`,
//! memory that is not dumpable: the user's processes cannot reach the
//! agent through that window. They can signal the child, though, and a
//! child stopped there keeps the spawning thread asleep: the reaper's
//! midwife continues it, or kills it at the command's deadline.

use crate::reaper::{self, ExitCallback, ExitStatus};
use crate::sys;
use std::ffi::{c_void, CStr, CString};
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicI32, AtomicU8, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

/// Who the shell runs as, where, and in which cgroup.
pub struct Sandbox<'a> {
    /// The effective (and filesystem) uid: whose rights the process has.
    pub uid: u32,
    /// The real and saved uid, when not `uid`: who may signal the process
    /// (see `files`). Never 0: the process could become root again.
    pub real_uid: Option<u32>,
    pub gid: u32,
    /// The working directory, entered after dropping to the user (so the
    /// user's permissions decide).
    pub cwd: &'a CStr,
    /// An open descriptor of the command's cgroup directory.
    pub cgroup: Option<RawFd>,
    /// RLIMIT_NPROC (0 = unlimited); `None` keeps the agent's.
    pub nproc: Option<u32>,
    /// When the command's time is up: a shell the user keeps stopping
    /// before its `execve` is killed then (see `reaper`).
    pub deadline: Option<Instant>,
}

/// A started shell: its pid, a pidfd, the read ends of its stdout and
/// stderr, and the write end of its stdin when it was given a pipe. On a
/// terminal, stdout and stdin are the terminal's master side, there is no
/// separate stderr, and `terminal` is kept for its size.
pub struct Spawned {
    pub pid: u32,
    /// Readable once the shell has exited (see [`exit_status`]).
    pub pidfd: OwnedFd,
    pub stdout: OwnedFd,
    pub stderr: Option<OwnedFd>,
    pub stdin: Option<OwnedFd>,
    pub terminal: Option<OwnedFd>,
}

/// The step of the child's set-up that failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Before the clone, the clone itself, or the child's set-up.
    Start,
    /// Entering the working directory, as the user.
    Chdir,
    /// Executing the program.
    Exec,
}

/// A failed spawn: the step and its error.
#[derive(Debug)]
pub struct SpawnError {
    pub step: Step,
    pub error: io::Error,
}

impl From<io::Error> for SpawnError {
    fn from(error: io::Error) -> Self {
        SpawnError {
            step: Step::Start,
            error,
        }
    }
}

/// Everything the child reads, prepared before the clone.
struct ChildArgs<'a> {
    program: &'a CStr,
    argv: &'a [*const libc::c_char],
    envp: &'a [*const libc::c_char],
    stdio: Stdio,
    sandbox: &'a Sandbox<'a>,
    /// Set by the child when a step fails; read by the parent once the
    /// child has exec'd or exited.
    errno: AtomicI32,
    /// Which step failed (a [`Step`] as u8).
    step: AtomicU8,
}

/// The kernel's `struct clone_args` (version 2, with `cgroup`).
#[repr(C)]
#[derive(Default)]
struct CloneArgs {
    flags: u64,
    pidfd: u64,
    child_tid: u64,
    parent_tid: u64,
    exit_signal: u64,
    stack: u64,
    stack_size: u64,
    tls: u64,
    set_tid: u64,
    set_tid_size: u64,
    cgroup: u64,
}

const CLONE_INTO_CGROUP: u64 = 0x2_0000_0000;
const CLONE_PIDFD: u64 = 0x1000;
const CLONE_PARENT_SETTID: u64 = 0x0010_0000;

/// The child's stack. Its work is a dozen syscalls; 64 KiB leaves room for
/// glibc's wrappers and for stack probes.
const CHILD_STACK_WORDS: usize = 64 * 1024 / 16;

/// Start `program` with `argv` (its first item the name it is called by)
/// and exactly `env`, as `sandbox` says, stdin from /dev/null (or, with
/// `stdin`, from a new pipe), stdout and stderr into new pipes; the reaper
/// hands its wait status to `on_exit`.
pub fn spawn(
    program: &CStr,
    argv: &[CString],
    env: &[CString],
    sandbox: &Sandbox<'_>,
    stdin: bool,
    on_exit: ExitCallback,
) -> Result<Spawned, SpawnError> {
    let devnull = devnull()?;
    let Pipes {
        out: (out_r, out_w),
        err: (err_r, err_w),
    } = take_pipes()?;
    let input = if stdin { Some(pipe()?) } else { None };
    let stdin_fd = match &input {
        Some((r, _)) => r.as_raw_fd(),
        None => devnull.as_raw_fd(),
    };
    let stdio = Stdio {
        fds: [stdin_fd, out_w.as_raw_fd(), err_w.as_raw_fd()],
        terminal: false,
    };
    let (pid, pidfd) = start(program, argv, env, sandbox, stdio, on_exit)?;
    drop((out_w, err_w));
    Ok(Spawned {
        pid,
        pidfd,
        stdout: out_r,
        stderr: Some(err_r),
        stdin: input.map(|(_, w)| w),
        terminal: None,
    })
}

/// Start `program` as [`spawn`] does, with `stdin` (a descriptor the caller
/// keeps, e.g. a socket) as its stdin and /dev/null as its stdout and
/// stderr. Returns its pid and a pidfd.
pub fn spawn_on(
    program: &CStr,
    argv: &[CString],
    env: &[CString],
    sandbox: &Sandbox<'_>,
    stdin: RawFd,
    on_exit: ExitCallback,
) -> Result<(u32, OwnedFd), SpawnError> {
    let devnull = devnull()?.as_raw_fd();
    let stdio = Stdio {
        fds: [stdin, devnull, devnull],
        terminal: false,
    };
    start(program, argv, env, sandbox, stdio, on_exit)
}

/// Start `program` as [`spawn`] does, on the terminal whose slave end is
/// `terminal`: its stdin, stdout and stderr, and the controlling terminal
/// of its new session. Returns its pid and a pidfd.
pub fn spawn_on_terminal(
    program: &CStr,
    argv: &[CString],
    env: &[CString],
    sandbox: &Sandbox<'_>,
    terminal: RawFd,
    on_exit: ExitCallback,
) -> Result<(u32, OwnedFd), SpawnError> {
    let stdio = Stdio {
        fds: [terminal; 3],
        terminal: true,
    };
    start(program, argv, env, sandbox, stdio, on_exit)
}

/// The child's standard descriptors, and whether they are a terminal to
/// make its controlling one.
struct Stdio {
    fds: [RawFd; 3],
    terminal: bool,
}

fn start(
    program: &CStr,
    argv: &[CString],
    env: &[CString],
    sandbox: &Sandbox<'_>,
    stdio: Stdio,
    on_exit: ExitCallback,
) -> Result<(u32, OwnedFd), SpawnError> {
    let argv = null_terminated(argv.iter().map(|a| a.as_c_str()));
    let envp = null_terminated(env.iter().map(|e| e.as_c_str()));
    let child = ChildArgs {
        program,
        argv: &argv,
        envp: &envp,
        stdio,
        sandbox,
        errno: AtomicI32::new(0),
        step: AtomicU8::new(Step::Start as u8),
    };
    let mut pidfd: libc::c_int = -1;
    // Not initialised: only the child writes it, from the top down.
    let mut stack: Vec<MaybeUninit<u128>> = Vec::with_capacity(CHILD_STACK_WORDS);
    let mut args = CloneArgs {
        flags: (libc::CLONE_VM | libc::CLONE_VFORK) as u64 | CLONE_PIDFD,
        pidfd: &mut pidfd as *mut libc::c_int as u64,
        exit_signal: libc::SIGCHLD as u64,
        stack: stack.as_mut_ptr() as u64,
        stack_size: (stack.capacity() * std::mem::size_of::<u128>()) as u64,
        ..CloneArgs::default()
    };
    if let Some(fd) = sandbox.cgroup {
        args.flags |= CLONE_INTO_CGROUP;
        args.cgroup = fd as u64;
    }

    let pid = reaper::register(on_exit, sandbox.deadline, |pending| {
        // The kernel writes the child's pid there before the child runs,
        // so the reaper can match a status that comes before registration.
        args.flags |= CLONE_PARENT_SETTID;
        args.parent_tid = pending.tid_ptr() as u64;
        let all = SignalsBlocked::all()?;
        // SAFETY: `args` describes a valid stack owned by this frame; the
        // child only runs `child_main` on `child`, which outlives it
        // (CLONE_VFORK: this thread sleeps until the child exec'd or exited).
        let rc = unsafe {
            clone3(
                &args,
                child_main,
                &child as *const ChildArgs<'_> as *mut c_void,
            )
        };
        drop(all);
        if rc < 0 {
            return Err(io::Error::from_raw_os_error(-rc as i32));
        }
        Ok(rc as u32)
    })?;
    // SAFETY: the kernel wrote a new descriptor (CLONE_PIDFD) when the clone
    // succeeded, which it did: `pid` is its result.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd) };
    match child.errno.load(Ordering::SeqCst) {
        // It exited; the reaper collects it (its status goes unread).
        e if e != 0 => Err(SpawnError {
            step: match child.step.load(Ordering::SeqCst) {
                s if s == Step::Chdir as u8 => Step::Chdir,
                s if s == Step::Exec as u8 => Step::Exec,
                _ => Step::Start,
            },
            error: io::Error::from_raw_os_error(e),
        }),
        _ => Ok((pid, pidfd)),
    }
}

/// The exit status of a shell whose pidfd is readable, left for the reaper
/// to collect (`WNOWAIT`). `None` once the reaper has collected it: its
/// status then comes through the reaper's callback.
pub fn exit_status(pidfd: &OwnedFd) -> Option<ExitStatus> {
    // SAFETY: zeroed siginfo is a valid out-parameter for waitid.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: plain syscall on our descriptor and out-parameter.
    let rc = unsafe {
        libc::waitid(
            libc::P_PIDFD,
            pidfd.as_raw_fd() as libc::id_t,
            &mut info,
            libc::WEXITED | libc::WNOWAIT | libc::WNOHANG,
        )
    };
    // SAFETY: waitid filled `info` for an exited child (si_pid 0 means
    // none was ready).
    let (pid, status) = unsafe { (info.si_pid(), info.si_status()) };
    if rc != 0 || pid == 0 {
        return None;
    }
    match info.si_code {
        libc::CLD_EXITED => Some(ExitStatus::Code(status)),
        libc::CLD_KILLED | libc::CLD_DUMPED => Some(ExitStatus::Signal(status)),
        _ => None,
    }
}

/// Pointers to `items`, then a null: an argv or envp.
fn null_terminated<'a>(items: impl Iterator<Item = &'a CStr>) -> Vec<*const libc::c_char> {
    items
        .map(CStr::as_ptr)
        .chain(std::iter::once(std::ptr::null()))
        .collect()
}

/// A command's stdout and stderr pipes: (read end, write end) each.
struct Pipes {
    out: (OwnedFd, OwnedFd),
    err: (OwnedFd, OwnedFd),
}

/// The next command's pipes, made before it is asked for.
static SPARE_PIPES: Mutex<Option<Pipes>> = Mutex::new(None);

/// The spare pipes, or new ones when another command took them.
fn take_pipes() -> io::Result<Pipes> {
    match sys::lock(&SPARE_PIPES).take() {
        Some(p) => Ok(p),
        None => make_pipes(),
    }
}

fn make_pipes() -> io::Result<Pipes> {
    Ok(Pipes {
        out: pipe()?,
        err: pipe()?,
    })
}

/// Make the next command's pipes, if there are none yet. Called once a
/// command has answered, off the path of any request.
pub fn prepare_spare_pipes() {
    let mut spare = sys::lock(&SPARE_PIPES);
    if spare.is_none() {
        match make_pipes() {
            Ok(p) => *spare = Some(p),
            Err(e) => crate::error!("cannot make the next command's pipes: {e}"),
        }
    }
}

fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: valid array of two ints.
    sys::cvt(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) })?;
    // SAFETY: both descriptors are new and ours.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// `/dev/null`, opened once: every command's stdin.
fn devnull() -> io::Result<&'static OwnedFd> {
    static DEVNULL: OnceLock<OwnedFd> = OnceLock::new();
    if let Some(fd) = DEVNULL.get() {
        return Ok(fd);
    }
    // SAFETY: valid C path; the descriptor is new and ours.
    let fd =
        sys::cvt(unsafe { libc::open(c"/dev/null".as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) })?;
    // SAFETY: new descriptor. Two threads may both open it; one keeps its.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    Ok(DEVNULL.get_or_init(|| fd))
}

/// All signals blocked in this thread until dropped.
struct SignalsBlocked(libc::sigset_t);

impl SignalsBlocked {
    fn all() -> io::Result<Self> {
        // SAFETY: sigfillset initialises the set; pthread_sigmask writes the
        // old mask into `old`.
        unsafe {
            let mut all: libc::sigset_t = std::mem::zeroed();
            libc::sigfillset(&mut all);
            let mut old: libc::sigset_t = std::mem::zeroed();
            let rc = libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old);
            if rc != 0 {
                return Err(io::Error::from_raw_os_error(rc));
            }
            Ok(Self(old))
        }
    }
}

impl Drop for SignalsBlocked {
    fn drop(&mut self) {
        // SAFETY: restores the mask saved by `all`.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &self.0, std::ptr::null_mut()) };
    }
}

/// `clone3(args)`; in the child, `child(arg)` on the new stack, never
/// returning. Returns the child's pid, or `-errno`.
///
/// # Safety
/// `args` must hold a valid stack for the child (16-byte aligned top) and
/// `arg` must stay valid until the child execs or exits: pass CLONE_VFORK.
unsafe fn clone3(
    args: &CloneArgs,
    child: extern "C" fn(*mut c_void) -> !,
    arg: *mut c_void,
) -> libc::c_long {
    let rc: libc::c_long;
    // SAFETY: the syscall returns in both processes. The parent continues
    // after the label with rax = pid or -errno. The child (rax = 0) is on
    // its own stack, so it calls `child`, which never returns; the call
    // keeps the ABI's alignment because the stack's top is 16-aligned.
    unsafe {
        std::arch::asm!(
            "syscall",
            "test rax, rax",
            "jnz 2f",
            "xor ebp, ebp",
            "mov rdi, r12",
            "call r13",
            "ud2",
            "2:",
            inlateout("rax") libc::SYS_clone3 => rc,
            in("rdi") args as *const CloneArgs,
            in("rsi") std::mem::size_of::<CloneArgs>(),
            in("r12") arg,
            in("r13") child,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    rc
}

/// The child: put itself into its sandbox, then exec. Only raw syscalls on
/// the prepared `ChildArgs`; on failure its errno is stored and it exits 127.
extern "C" fn child_main(arg: *mut c_void) -> ! {
    // SAFETY: `arg` is the parent's `ChildArgs`, alive until we exec or exit.
    let a = unsafe { &*(arg as *const ChildArgs<'_>) };
    let errno = match enter_and_exec(a) {
        Err(e) => e,
        Ok(()) => libc::EINVAL,
    };
    a.errno.store(errno, Ordering::SeqCst);
    // SAFETY: exit without running anything of the parent's.
    unsafe { libc::_exit(127) }
}

/// Each step in order; the errno of the first that fails. Only returns on
/// failure.
fn enter_and_exec(a: &ChildArgs<'_>) -> Result<(), i32> {
    let check = |rc: libc::c_long| {
        if rc < 0 {
            // SAFETY: reads this thread's errno.
            Err(unsafe { *libc::__errno_location() })
        } else {
            Ok(())
        }
    };
    let s = a.sandbox;
    // SAFETY: raw syscalls on valid descriptors, paths and arrays prepared
    // by the parent; nothing here allocates or takes a lock.
    unsafe {
        for (to, &from) in a.stdio.fds.iter().enumerate() {
            let to = to as RawFd;
            if from == to {
                // dup2 onto itself would keep O_CLOEXEC.
                check(libc::fcntl(from, libc::F_SETFD, 0) as libc::c_long)?;
            } else {
                check(libc::dup2(from, to) as libc::c_long)?;
            }
        }
        // A new session, so the whole process group can be killed.
        check(libc::setsid() as libc::c_long)?;
        if a.stdio.terminal {
            // The session's controlling terminal: job control, ^C, SIGWINCH
            // and the hang-up reach its processes.
            check(libc::ioctl(0, libc::TIOCSCTTY, 0) as libc::c_long)?;
        }
        // The agent runs at a raised priority; the user's commands do not.
        // (Nor are they exempt from the OOM killer: only the agent is, as
        // the global init.)
        libc::setpriority(libc::PRIO_PROCESS, 0, 0);
        if let Some(nproc) = s.nproc {
            let lim = if nproc == 0 {
                libc::RLIM_INFINITY
            } else {
                libc::rlim_t::from(nproc)
            };
            let rl = libc::rlimit {
                rlim_cur: lim,
                rlim_max: lim,
            };
            check(libc::setrlimit(libc::RLIMIT_NPROC, &rl) as libc::c_long)?;
        }
        // Raw syscalls: glibc's setuid would broadcast to "all threads",
        // and this child is one thread sharing the agent's memory.
        let groups = [s.gid as libc::gid_t];
        check(libc::syscall(
            libc::SYS_setgroups,
            1 as libc::c_long,
            groups.as_ptr(),
        ))?;
        check(libc::syscall(libc::SYS_setgid, s.gid as libc::c_long))?;
        match s.real_uid {
            None => check(libc::syscall(libc::SYS_setuid, s.uid as libc::c_long))?,
            Some(real) => check(libc::syscall(
                libc::SYS_setresuid,
                real as libc::c_long,
                s.uid as libc::c_long,
                real as libc::c_long,
            ))?,
        }
        a.step.store(Step::Chdir as u8, Ordering::SeqCst);
        check(libc::chdir(s.cwd.as_ptr()) as libc::c_long)?;
        a.step.store(Step::Start as u8, Ordering::SeqCst);
        let mut dfl: libc::sigaction = std::mem::zeroed();
        dfl.sa_sigaction = libc::SIG_DFL;
        check(libc::sigaction(libc::SIGPIPE, &dfl, std::ptr::null_mut()) as libc::c_long)?;
        // The kernel's 64-bit mask, raw: glibc's wrapper would keep its own
        // internal signals as they are.
        let empty = [0u64; 1];
        check(libc::syscall(
            libc::SYS_rt_sigprocmask,
            libc::SIG_SETMASK as libc::c_long,
            empty.as_ptr(),
            std::ptr::null_mut::<u64>(),
            8 as libc::c_long,
        ))?;
        a.step.store(Step::Exec as u8, Ordering::SeqCst);
        libc::execve(a.program.as_ptr(), a.argv.as_ptr(), a.envp.as_ptr());
        check(-1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    fn pidfd_of(pid: u32) -> OwnedFd {
        // SAFETY: plain syscall; the descriptor is new and ours.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
        assert!(fd >= 0, "pidfd_open: {}", io::Error::last_os_error());
        // SAFETY: new descriptor.
        unsafe { OwnedFd::from_raw_fd(fd as RawFd) }
    }

    fn wait_readable(fd: &OwnedFd) {
        let mut p = [sys::pollin(fd.as_raw_fd())];
        assert_eq!(
            sys::poll(&mut p, Some(std::time::Duration::from_secs(10))).unwrap(),
            1
        );
    }

    #[test]
    fn exit_status_reads_without_reaping_and_is_none_once_reaped() {
        let mut child = Command::new("sh").args(["-c", "exit 3"]).spawn().unwrap();
        let fd = pidfd_of(child.id());
        wait_readable(&fd);
        assert_eq!(exit_status(&fd), Some(ExitStatus::Code(3)));
        // Still there to be reaped, with the same status.
        assert_eq!(exit_status(&fd), Some(ExitStatus::Code(3)));
        assert_eq!(child.wait().unwrap().code(), Some(3));
        assert_eq!(exit_status(&fd), None);

        let mut child = Command::new("sh")
            .args(["-c", "kill -9 $$"])
            .spawn()
            .unwrap();
        let fd = pidfd_of(child.id());
        wait_readable(&fd);
        assert_eq!(exit_status(&fd), Some(ExitStatus::Signal(9)));
        child.wait().unwrap();
    }
}
