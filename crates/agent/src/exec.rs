//! Running a shell command as the guest user.
//!
//! Each `Exec` gets a thread that starts `bash -c` (see `spawn`), then
//! forwards its output (see `output`) while it waits for one of: the shell's
//! pidfd saying it exited, a cancel, or its deadline. The exit status is read
//! without reaping (`WNOWAIT`): the reaper, which PID 1 needs for orphans
//! anyway, collects the shell, and hands the status over itself when it got
//! there first, so its `waitpid(-1)` cannot steal it. Commands never wait
//! for each other.
//!
//! The shell starts in its own cgroup and session (so the whole process group
//! can be killed), with normal OOM score and priority, RLIMIT_NPROC, the
//! user's groups/gid/uid, and only then chdir, so the user's permissions
//! apply to the working directory.
//!
//! Killing (timeout, cancel, host gone) is SIGKILL to the process group plus
//! `cgroup.kill`, which also catches processes that called setsid.
//!
//! Every command is in the table of `processes` while it runs, its output
//! going to whoever follows it. A command that is its request's (the
//! usual) is killed when the request is cancelled or its session ends; one
//! that asked to `keep_running` only loses that follower.

use crate::cgroup::{self, ExecCgroup};
use crate::channel::Reply;
use crate::files;
use crate::outbound;
use crate::output::{Output, StreamAcct};
use crate::processes::{self, Followers, Process};
use crate::reaper::ExitStatus;
use crate::spawn::{self, Sandbox, SpawnError, Spawned, Step};
use crate::sys::{self, lock, EventFd};
use crate::workers;
use sandpit_protocol::{
    resolve_guest_path, AgentError, ErrorKind, ExecRequest, ExecResult, Message, ProcessInfo,
    RequestId, GUEST_HOME, GUEST_UID, GUEST_USER, WORKSPACE,
};
use std::collections::BTreeMap;
use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::AsRawFd;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

struct Running {
    gen: u64,
    serial: u64,
    /// Signalled to kill the command (the host cancelled, or its session
    /// ended, or a SIGKILL was asked for by pid).
    cancel: Arc<EventFd>,
    /// It outlives its request: a cancel or the session's end only stops
    /// the request following it.
    keep_running: bool,
    /// Who gets its output and end, the request first.
    followers: Arc<Followers>,
}

/// Running commands by request id.
static RUNNING: Mutex<BTreeMap<RequestId, Running>> = Mutex::new(BTreeMap::new());
static SERIAL: AtomicU64 = AtomicU64::new(1);

/// Start an `Exec` (called on the reader thread, so a `Cancel` that follows
/// always finds it).
pub fn start(reply: Reply, id: RequestId, request: ExecRequest) {
    let cancel = match EventFd::new() {
        Ok(e) => Arc::new(e),
        Err(e) => return reply.error(id, AgentError::new(ErrorKind::Io, format!("eventfd: {e}"))),
    };
    let serial = SERIAL.fetch_add(1, Ordering::SeqCst);
    let followers = Followers::first(id, reply.clone());
    {
        let mut running = lock(&RUNNING);
        if running.contains_key(&id) {
            drop(running);
            reply.error(
                id,
                AgentError::new(
                    ErrorKind::InvalidRequest,
                    format!("a command with id {id} is already running"),
                ),
            );
            return;
        }
        running.insert(
            id,
            Running {
                gen: reply.generation(),
                serial,
                cancel: cancel.clone(),
                keep_running: request.keep_running,
                followers: followers.clone(),
            },
        );
    }
    let r = reply.clone();
    let spawned = workers::COMMANDS.run(move || {
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            run(&r, id, serial, &request, &cancel, followers)
        }));
        if outcome.is_err() {
            unregister(id, serial);
            r.error(
                id,
                AgentError::new(ErrorKind::Io, "internal error while running the command"),
            );
        }
    });
    if let Err(e) = spawned {
        unregister(id, serial);
        reply.error(
            id,
            AgentError::new(ErrorKind::Io, format!("cannot start a thread: {e}")),
        );
    }
}

/// Cancel request `id`: kill the command it started, or, when that keeps
/// running or `id` only follows a command, stop following it. False if no
/// command has anything to do with `id`.
pub fn cancel(id: RequestId) -> bool {
    let mut running = lock(&RUNNING);
    match running.get(&id) {
        Some(r) if r.keep_running => {
            r.followers.remove(id);
            running.remove(&id);
            true
        }
        Some(r) => {
            r.cancel.signal();
            true
        }
        None => {
            drop(running);
            processes::detach(id)
        }
    }
}

/// Kill every command started in a session before `gen` that is its
/// request's, and stop that session following the others (their answers
/// are dropped: nobody is listening any more).
pub fn cancel_sessions_before(gen: u64) {
    let mut n = 0;
    lock(&RUNNING).retain(|_, r| {
        if r.gen < gen {
            if !r.keep_running {
                r.cancel.signal();
                n += 1;
            }
            false
        } else {
            true
        }
    });
    processes::forget_sessions_before(gen);
    if n > 0 {
        crate::info!("cancelled {n} command(s) of an ended session");
    }
}

fn unregister(id: RequestId, serial: u64) {
    let mut running = lock(&RUNNING);
    if running.get(&id).is_some_and(|r| r.serial == serial) {
        running.remove(&id);
    }
}

fn run(
    reply: &Reply,
    id: RequestId,
    serial: u64,
    req: &ExecRequest,
    cancel: &Arc<EventFd>,
    followers: Arc<Followers>,
) {
    let fail = |e: AgentError| {
        unregister(id, serial);
        reply.error(id, e);
    };
    let cwd = match cwd_path(req.cwd.as_deref()) {
        Ok(c) => c,
        Err(e) => return fail(e),
    };
    if let Err(e) = check_request(req) {
        return fail(e);
    }
    let c_cwd = match sys::cstring(&cwd) {
        Ok(c) => c,
        Err(e) => return fail(AgentError::new(ErrorKind::InvalidPath, e.to_string())),
    };
    let cg = cgroup::create_exec();
    let start = Instant::now();
    let deadline = match req.timeout_ms {
        0 => None,
        ms => start.checked_add(Duration::from_millis(ms)),
    };
    let uid = if req.as_root { 0 } else { GUEST_UID };
    let sandbox = Sandbox {
        uid,
        real_uid: None,
        gid: uid,
        cwd: &c_cwd,
        cgroup: cg.as_ref().map(ExecCgroup::dir_fd),
        nproc: Some(cgroup::pids_max()),
        deadline,
    };
    let (status_tx, status_rx) = mpsc::channel();
    let mut child = match spawn_shell(req, &cwd, &sandbox, status_tx) {
        Ok(c) => c,
        Err(e) => return fail(e),
    };
    let pid = child.pid;
    // In the table before its pid is told: a client that lists the
    // commands, or feeds this one, as soon as it has the pid must find it
    // (a busy guest once answered such a list with nothing).
    processes::register(Process::new(
        ProcessInfo {
            pid,
            command: req.command.clone(),
            cwd: cwd.clone(),
            env: req.env.clone(),
            keep_running: req.keep_running,
            stdin: child.stdin.is_some(),
            pty: child.terminal.is_some(),
        },
        followers.clone(),
        child.stdin.take(),
        cancel.clone(),
        child.terminal.take(),
    ));
    if req.keep_running {
        // Its pid, before any output: the host names it by that from now on.
        reply.send(&Message::Started { id, pid }, &[]);
    }

    // Output is forwarded as it comes while waiting for the shell's exit
    // (its pidfd), a cancel, or the deadline.
    let mut output = Output::new(
        id,
        followers.clone(),
        child.stdout,
        child.stderr,
        req.max_output_bytes,
    );
    // Time may be up already: the user kept the shell from starting, and
    // the midwife killed it (see `reaper`).
    let mut timed_out = deadline.is_some_and(|d| Instant::now() >= d);
    if timed_out {
        kill(pid, cg.as_ref());
    }
    let mut cancelled = false;
    // The status, when it had to come from the reaper.
    let mut reaped = None;
    loop {
        let timeout = match deadline {
            Some(d) if !timed_out && !cancelled => {
                Some(d.saturating_duration_since(Instant::now()))
            }
            _ => None,
        };
        let [exited, cancel_now] =
            match output.pump([child.pidfd.as_raw_fd(), cancel.raw()], timeout) {
                Ok(ready) => ready,
                Err(e) => {
                    // Cannot wait on descriptors: stop the command and take its
                    // status from the reaper.
                    crate::error!("exec {id}: poll: {e}");
                    cancelled = true;
                    kill(pid, cg.as_ref());
                    reaped = status_rx.recv().ok();
                    [true, false]
                }
            };
        if exited {
            break;
        }
        if cancel_now {
            cancel.clear();
            if !timed_out && !cancelled {
                cancelled = true;
                kill(pid, cg.as_ref());
            }
        }
        if !timed_out && !cancelled && deadline.is_some_and(|d| Instant::now() >= d) {
            timed_out = true;
            kill(pid, cg.as_ref());
        }
    }
    // Read without reaping: the reaper collects the shell. When it already
    // has, the status is in its callback's channel.
    let status = match reaped {
        Some(raw) => ExitStatus::from_raw(raw),
        None => spawn::exit_status(&child.pidfd).unwrap_or_else(|| {
            ExitStatus::from_raw(status_rx.recv().expect("the reaper reaped the shell"))
        }),
    };
    if timed_out || cancelled {
        // A killed command is reported only once nothing of it is left, so
        // "timed out" means every process it started is gone. Killing a
        // few thousand forks takes seconds under emulation on a busy host,
        // hence the generous bound.
        if let Some(cg) = cg.as_ref() {
            cg.wait_empty(Duration::from_secs(60));
        }
    }
    let took = start.elapsed();
    let (out, err) = output.finish();
    unregister(id, serial);
    processes::unregister(pid);
    followers.end(&exec_result(status, timed_out, cancelled, out, err, took));
    drop(cg);
    // The next command's cgroup and pipes, made now that this one has its
    // answer.
    prepare_next();
}

/// Make what the next command needs before it is asked for: its cgroup and
/// its pipes.
pub fn prepare_next() {
    cgroup::prepare_spare();
    spawn::prepare_spare_pipes();
}

/// Start the shell for `req`; its wait status also goes to `status_tx`.
fn spawn_shell(
    req: &ExecRequest,
    cwd: &str,
    sandbox: &Sandbox<'_>,
    status_tx: mpsc::Sender<i32>,
) -> Result<Spawned, AgentError> {
    let shell = shell_command(req, cwd)?;
    let on_exit = Box::new(move |status| {
        let _ = status_tx.send(status);
    });
    let Some(size) = req.pty else {
        return spawn::spawn(
            shell.program,
            &shell.argv,
            &shell.env,
            sandbox,
            req.stdin,
            on_exit,
        )
        .map_err(|e| spawn_error(&e, cwd));
    };
    // On a terminal: the slave side is the shell's stdin, stdout, stderr
    // and controlling terminal; the master side is read for its output,
    // written for its input and kept for its size.
    let io = |what: &'static str| {
        move |e: io::Error| AgentError::new(ErrorKind::Io, format!("the terminal: {what}: {e}"))
    };
    let (master, slave) = crate::pty::open_pair().map_err(io("open"))?;
    crate::pty::set_size(master.as_raw_fd(), size).map_err(io("size"))?;
    let (pid, pidfd) = spawn::spawn_on_terminal(
        shell.program,
        &shell.argv,
        &shell.env,
        sandbox,
        slave.as_raw_fd(),
        on_exit,
    )
    .map_err(|e| spawn_error(&e, cwd))?;
    drop(slave);
    Ok(Spawned {
        pid,
        pidfd,
        stdout: master.try_clone().map_err(io("dup"))?,
        stderr: None,
        stdin: Some(master.try_clone().map_err(io("dup"))?),
        terminal: Some(master),
    })
}

fn exec_result(
    status: ExitStatus,
    timed_out: bool,
    cancelled: bool,
    out: StreamAcct,
    err: StreamAcct,
    took: Duration,
) -> ExecResult {
    let (exit_code, signal) = match status {
        ExitStatus::Code(c) => (Some(c), None),
        ExitStatus::Signal(s) => (None, Some(s)),
    };
    ExecResult {
        exit_code,
        signal,
        timed_out,
        cancelled,
        stdout_bytes: out.total,
        stderr_bytes: err.total,
        stdout_truncated: out.truncated,
        stderr_truncated: err.truncated,
        duration_ms: took.as_millis() as u64,
        duration_us: Some(took.as_micros() as u64),
    }
}

/// SIGKILL the command's process group and everything in its cgroup.
fn kill(pid: u32, cg: Option<&ExecCgroup>) {
    // SAFETY: plain syscall. The shell has not been reaped yet (we are still
    // waiting for its status), so its pid, which is also its process group
    // id after setsid, cannot have been reused.
    unsafe { libc::kill(-(pid as libc::pid_t), libc::SIGKILL) };
    if let Some(cg) = cg {
        cg.kill();
    }
}

/// The working directory, resolved. Whether it exists, is a directory and
/// may be entered by the user is decided by the shell's own `chdir` (see
/// `spawn`), which saves a `stat` per command.
fn cwd_path(cwd: Option<&str>) -> Result<String, AgentError> {
    let cwd = cwd.filter(|c| !c.is_empty()).unwrap_or(WORKSPACE);
    resolve_guest_path(cwd)
}

/// Reject what exec(2) cannot carry, before forking.
fn check_request(req: &ExecRequest) -> Result<(), AgentError> {
    if let Some(size) = req.pty {
        crate::pty::check_size(size)?;
    }
    if req.command.contains('\0') {
        return Err(AgentError::new(
            ErrorKind::InvalidRequest,
            "command contains a NUL byte",
        ));
    }
    for (k, v) in &req.env {
        if k.is_empty() || k.contains(['=', '\0']) || v.contains('\0') {
            return Err(AgentError::new(
                ErrorKind::InvalidRequest,
                format!("invalid environment variable {k:?}"),
            ));
        }
    }
    Ok(())
}

/// The environment every command starts from (the request's env goes on
/// top): the guest user's, or root's (`as_root`, a template's build step).
pub fn base_env(cwd: &str, as_root: bool) -> Vec<(&'static str, String)> {
    let (home, user, path) = if as_root {
        (
            "/root",
            "root",
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".to_string(),
        )
    } else {
        (
            GUEST_HOME,
            GUEST_USER,
            format!("{GUEST_HOME}/.local/bin:/usr/local/bin:/usr/bin:/bin"),
        )
    };
    vec![
        ("HOME", home.to_string()),
        ("USER", user.to_string()),
        ("LOGNAME", user.to_string()),
        ("SHELL", "/bin/bash".to_string()),
        ("PATH", path),
        ("LANG", "C.UTF-8".to_string()),
        ("PWD", cwd.to_string()),
        ("TERM", "dumb".to_string()),
    ]
}

/// A process's environment: the base variables, then the operator's proxy
/// and CA ones (see `outbound`); `extra` replaces any of them with the same
/// name.
pub fn environment<'a>(
    cwd: &str,
    as_root: bool,
    extra: impl Iterator<Item = (&'a str, &'a str)>,
) -> io::Result<Vec<CString>> {
    let base = base_env(cwd, as_root);
    outbound::with_env(|outbound| {
        let mut env: BTreeMap<&str, &str> = BTreeMap::new();
        for (k, v) in base.iter().chain(outbound) {
            env.insert(k, v);
        }
        for (k, v) in extra {
            env.insert(k, v);
        }
        env.into_iter()
            .map(|(k, v)| sys::cstring(&format!("{k}={v}")))
            .collect::<io::Result<Vec<_>>>()
    })
}

/// The shell, its argv and environment, as C strings.
struct ShellCommand {
    program: &'static CStr,
    argv: Vec<CString>,
    env: Vec<CString>,
}

/// Which shell runs commands: bash, as `/bin/bash`; `sh` where there is no
/// bash. Debian's `bash-static` (in the image) is the same bash, version and
/// build options, linked statically: under emulation it starts about 3 ms
/// sooner than the dynamically linked one (no loader, no relocations). It is
/// called by the name `/bin/bash`, so `$0` and `$BASH` are what scripts
/// expect; what it lacks is `enable -f` (loadable builtins).
///
/// The choice is made once: the shells are root's files, which the user
/// cannot remove or replace, and two lookups per command would cost a tenth
/// of a millisecond under emulation.
fn shell() -> (&'static CStr, &'static CStr) {
    static SHELL: OnceLock<(&'static CStr, &'static CStr)> = OnceLock::new();
    *SHELL.get_or_init(choose_shell)
}

fn choose_shell() -> (&'static CStr, &'static CStr) {
    if !Path::new("/bin/bash").exists() {
        (c"/bin/sh", c"/bin/sh")
    } else if is_executable(c"/bin/bash-static") {
        (c"/bin/bash-static", c"/bin/bash")
    } else {
        (c"/bin/bash", c"/bin/bash")
    }
}

fn is_executable(path: &CStr) -> bool {
    // SAFETY: valid C path.
    unsafe { libc::access(path.as_ptr(), libc::X_OK) == 0 }
}

fn shell_command(req: &ExecRequest, cwd: &str) -> Result<ShellCommand, AgentError> {
    let (program, name) = shell();
    let invalid = |e: io::Error| AgentError::new(ErrorKind::InvalidRequest, e.to_string());
    // On a terminal, programs are told what it is unless the caller said.
    let term = req
        .pty
        .is_some()
        .then_some(("TERM", crate::pty::TERM))
        .filter(|_| !req.env.contains_key("TERM"));
    let extra = term
        .into_iter()
        .chain(req.env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    let env = environment(cwd, req.as_root, extra).map_err(invalid)?;
    let argv = match login_shell(&req.command).filter(|_| program != c"/bin/sh") {
        Some((name, script)) => vec![
            sys::cstring(name).map_err(invalid)?,
            c"-l".to_owned(),
            c"-c".to_owned(),
            sys::cstring(&script).map_err(invalid)?,
        ],
        None => vec![
            name.to_owned(),
            c"-c".to_owned(),
            sys::cstring(&req.command).map_err(invalid)?,
        ],
    };
    Ok(ShellCommand { program, argv, env })
}

/// A command that only starts a login bash on a script, `/bin/bash -l -c
/// SCRIPT` as E2B's SDKs send every command: bash would parse it and exec
/// `/bin/bash`, a second start (and the dynamic loader's work, ~5 ms under
/// emulation); the shell is started as that login shell itself instead,
/// under the name given. Only the exact quoting the host writes
/// (`shell_words::join`) is taken: there every word is literal, so bash's
/// own parse would give the same four words; anything else goes to bash.
fn login_shell(command: &str) -> Option<(&'static str, String)> {
    // Every command comes here: one that does not start so is not parsed.
    let name = ["/bin/bash", "/usr/bin/bash", "bash"]
        .into_iter()
        .find(|n| {
            command
                .strip_prefix(n)
                .is_some_and(|rest| rest.starts_with(" -l -c "))
        })?;
    let words = shell_words::split(command).ok()?;
    if words.len() != 4 || words[0] != name || shell_words::join(&words) != command {
        return None;
    }
    words.into_iter().nth(3).map(|script| (name, script))
}

/// Map a failed spawn to an error for the host.
fn spawn_error(e: &SpawnError, cwd: &str) -> AgentError {
    if e.step == Step::Chdir {
        return cwd_error(&e.error, cwd);
    }
    let e = &e.error;
    match sys::errno(e) {
        libc::EACCES | libc::EPERM => AgentError::new(
            ErrorKind::PermissionDenied,
            format!("cannot run the command in {cwd}: {e}"),
        ),
        libc::ENOENT => {
            AgentError::new(ErrorKind::NotFound, format!("cannot run the command: {e}"))
        }
        libc::EAGAIN => AgentError::new(
            ErrorKind::Io,
            format!("cannot start the command, too many processes: {e}"),
        ),
        _ => AgentError::new(ErrorKind::Io, format!("cannot start the command: {e}")),
    }
}

/// Why the user's `chdir` into the working directory failed.
fn cwd_error(e: &io::Error, cwd: &str) -> AgentError {
    match sys::errno(e) {
        libc::ENOENT => AgentError::new(ErrorKind::NotFound, format!("cwd {cwd} does not exist")),
        libc::ENOTDIR => AgentError::new(
            ErrorKind::NotADirectory,
            format!("cwd {cwd} is not a directory"),
        ),
        libc::EACCES | libc::EPERM => AgentError::new(
            ErrorKind::PermissionDenied,
            format!("cannot run the command in {cwd}: {e}"),
        ),
        _ => files::io_error(e, &format!("cwd {cwd}")),
    }
}

// The (cgroup + uid + pipes) path needs root and a VM; what can be checked on
// any machine is checked here.
#[cfg(test)]
mod tests {
    use super::*;

    fn req(command: &str) -> ExecRequest {
        ExecRequest {
            command: command.into(),
            cwd: None,
            env: BTreeMap::new(),
            timeout_ms: 1000,
            max_output_bytes: 10,
            ..Default::default()
        }
    }

    #[test]
    fn only_the_hosts_exact_login_shell_command_starts_one_directly() {
        assert_eq!(
            login_shell("/bin/bash -l -c true"),
            Some(("/bin/bash", "true".to_string()))
        );
        assert_eq!(
            login_shell("bash -l -c 'echo \"$HOME\" | wc -c'"),
            Some(("bash", "echo \"$HOME\" | wc -c".to_string()))
        );
        for other in [
            // bash would expand these: the words are not all literal.
            "/bin/bash -l -c $SCRIPT",
            "/bin/bash -l -c \"echo x\"",
            "/bin/bash -l -c true; rm -rf x",
            "/bin/bash -c true",
            "/bin/bash -l -c true extra",
            "/bin/sh -l -c true",
            "/tmp/bash -l -c true",
            "true",
        ] {
            assert_eq!(login_shell(other), None, "{other}");
        }
        // Started as that shell: its name, -l, -c, the script.
        let shell = shell_command(&req("/bin/bash -l -c 'echo x'"), "/").unwrap();
        if shell.program != c"/bin/sh" {
            let argv: Vec<_> = shell.argv.iter().map(|a| a.to_str().unwrap()).collect();
            assert_eq!(argv, ["/bin/bash", "-l", "-c", "echo x"]);
        }
    }

    #[test]
    fn cwd_is_resolved_and_its_chdir_errors_explained() {
        assert_eq!(cwd_path(Some("/")).unwrap(), "/");
        assert_eq!(cwd_path(Some("/tmp/../tmp")).unwrap(), "/tmp");
        assert_eq!(cwd_path(None).unwrap(), WORKSPACE);
        assert_eq!(
            cwd_path(Some("a\0")).unwrap_err().kind,
            ErrorKind::InvalidPath
        );
        let chdir = |path: &str| {
            let c = sys::cstring(path).unwrap();
            // SAFETY: valid C path.
            assert_eq!(unsafe { libc::chdir(c.as_ptr()) }, -1);
            cwd_error(&io::Error::last_os_error(), path)
        };
        let e = chdir("/no/such/dir");
        assert_eq!(e.kind, ErrorKind::NotFound);
        assert_eq!(e.message, "cwd /no/such/dir does not exist");
        let e = chdir("/proc/self/status");
        assert_eq!(e.kind, ErrorKind::NotADirectory);
        assert_eq!(e.message, "cwd /proc/self/status is not a directory");
        let e = cwd_error(&io::Error::from_raw_os_error(libc::EACCES), "/root");
        assert_eq!(e.kind, ErrorKind::PermissionDenied);
    }

    #[test]
    fn requests_exec_cannot_carry_are_rejected() {
        assert!(check_request(&req("echo hi")).is_ok());
        assert!(check_request(&req("echo \0")).is_err());
        let mut r = req("true");
        r.env.insert("A=B".into(), "x".into());
        assert_eq!(
            check_request(&r).unwrap_err().kind,
            ErrorKind::InvalidRequest
        );
        let mut r = req("true");
        r.env.insert("A".into(), "x\0".into());
        assert!(check_request(&r).is_err());
    }

    #[test]
    fn base_environment() {
        let env: BTreeMap<_, _> = base_env("/workspace/x", false).into_iter().collect();
        assert_eq!(env["HOME"], "/home/user");
        assert_eq!(env["PWD"], "/workspace/x");
        assert_eq!(
            env["PATH"],
            "/home/user/.local/bin:/usr/local/bin:/usr/bin:/bin"
        );
        assert_eq!(env.len(), 8);
        let root: BTreeMap<_, _> = base_env("/", true).into_iter().collect();
        assert_eq!(root["HOME"], "/root");
        assert_eq!(root["USER"], "root");
        assert!(
            root["PATH"].starts_with("/usr/local/sbin:"),
            "{}",
            root["PATH"]
        );
    }

    #[test]
    fn results_carry_status_and_counts() {
        let mut out = StreamAcct::new(1);
        out.accept(3);
        let r = exec_result(
            ExitStatus::Signal(9),
            true,
            false,
            out,
            StreamAcct::default(),
            Duration::from_micros(5_250),
        );
        assert_eq!((r.exit_code, r.signal), (None, Some(9)));
        assert!(r.timed_out && r.stdout_truncated && !r.stderr_truncated);
        assert_eq!((r.stdout_bytes, r.duration_ms), (3, 5));
        assert_eq!(r.duration_us, Some(5_250));
    }

    #[test]
    fn cancel_of_unknown_id_is_false() {
        assert!(!cancel(987_654_321));
    }
}
