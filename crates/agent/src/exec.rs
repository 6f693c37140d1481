//! Running a shell command as the guest user.
//!
//! Each `Exec` gets a thread that starts `bash -c` (see `spawn`; its status
//! comes from the reaper, so PID 1's orphan reaping cannot steal it), a pump
//! thread for its output (see `output`), and then waits for one of: the
//! shell's exit status, a cancel, or its deadline. Commands never wait for
//! each other.
//!
//! The shell starts in its own cgroup and session (so the whole process group
//! can be killed), with normal OOM score and priority, RLIMIT_NPROC, the
//! user's groups/gid/uid, and only then chdir, so the user's permissions
//! apply to the working directory.
//!
//! Killing (timeout, cancel, host gone) is SIGKILL to the process group plus
//! `cgroup.kill`, which also catches processes that called setsid.

use crate::cgroup::{self, ExecCgroup};
use crate::channel::Reply;
use crate::files;
use crate::output::{Pump, StreamAcct};
use crate::reaper::ExitStatus;
use crate::spawn::{self, Sandbox};
use crate::sys::{self, lock, EventFd};
use crate::workers;
use sandpit_protocol::{
    resolve_guest_path, AgentError, ErrorKind, ExecRequest, ExecResult, Message, RequestId,
    GUEST_HOME, GUEST_UID, GUEST_USER, WORKSPACE,
};
use std::collections::BTreeMap;
use std::ffi::{CStr, CString};
use std::fs;
use std::io;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What an exec thread waits for.
enum Event {
    /// The shell's raw wait status, from the reaper.
    Exited(i32),
    /// Kill it: the host cancelled, or its session ended.
    Cancel,
}

struct Running {
    gen: u64,
    serial: u64,
    tx: Sender<Event>,
}

/// Running commands by request id.
static RUNNING: Mutex<BTreeMap<RequestId, Running>> = Mutex::new(BTreeMap::new());
static SERIAL: AtomicU64 = AtomicU64::new(1);

/// Start an `Exec` (called on the reader thread, so a `Cancel` that follows
/// always finds it).
pub fn start(reply: Reply, id: RequestId, request: ExecRequest) {
    let (tx, rx) = mpsc::channel();
    let serial = SERIAL.fetch_add(1, Ordering::SeqCst);
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
                tx: tx.clone(),
            },
        );
    }
    let r = reply.clone();
    let spawned = workers::COMMANDS.run(move || {
        let outcome = catch_unwind(AssertUnwindSafe(|| run(&r, id, serial, &request, tx, rx)));
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

/// Cancel a running command; false if there is none with that id.
pub fn cancel(id: RequestId) -> bool {
    match lock(&RUNNING).get(&id) {
        Some(r) => {
            let _ = r.tx.send(Event::Cancel);
            true
        }
        None => false,
    }
}

/// Kill every command started in a session before `gen` (their answers are
/// dropped: nobody is listening any more).
pub fn cancel_sessions_before(gen: u64) {
    let mut n = 0;
    lock(&RUNNING).retain(|_, r| {
        if r.gen < gen {
            let _ = r.tx.send(Event::Cancel);
            n += 1;
            false
        } else {
            true
        }
    });
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
    tx: Sender<Event>,
    rx: Receiver<Event>,
) {
    let fail = |e: AgentError| {
        unregister(id, serial);
        reply.error(id, e);
    };
    let cwd = match resolve_cwd(req.cwd.as_deref()) {
        Ok(c) => c,
        Err(e) => return fail(e),
    };
    if let Err(e) = check_request(req) {
        return fail(e);
    }
    let exited = match EventFd::new() {
        Ok(e) => Arc::new(e),
        Err(e) => return fail(AgentError::new(ErrorKind::Io, format!("eventfd: {e}"))),
    };
    let shell = match shell_command(req, &cwd) {
        Ok(c) => c,
        Err(e) => return fail(e),
    };
    let c_cwd = match sys::cstring(&cwd) {
        Ok(c) => c,
        Err(e) => return fail(AgentError::new(ErrorKind::InvalidPath, e.to_string())),
    };
    let cg = cgroup::create_exec();
    let sandbox = Sandbox {
        uid: GUEST_UID,
        gid: GUEST_UID,
        cwd: &c_cwd,
        cgroup: cg.as_ref().map(ExecCgroup::dir_fd),
        nproc: cgroup::pids_max(),
    };
    let on_exit = tx.clone();
    let start = Instant::now();
    let child = match spawn::spawn(
        shell.program,
        &shell.argv,
        &shell.env,
        &sandbox,
        Box::new(move |status| {
            let _ = on_exit.send(Event::Exited(status));
        }),
    ) {
        Ok(c) => c,
        Err(e) => return fail(spawn_error(&e, &cwd)),
    };
    let pid = child.pid;
    reply.send(&Message::Started { id, pid }, &[]);

    let pump = Pump {
        id,
        reply: reply.clone(),
        stdout: child.stdout,
        stderr: child.stderr,
        exited: exited.clone(),
        max_output_bytes: req.max_output_bytes,
    };
    let (pumped_tx, pumped) = mpsc::sync_channel(1);
    let pump = workers::COMMANDS.run(move || {
        let _ = pumped_tx.send(pump.run());
    });
    if pump.is_err() {
        // Without a reader the command would block on its pipes: stop it.
        kill(pid, cg.as_ref());
    }

    let deadline = match req.timeout_ms {
        0 => None,
        ms => start.checked_add(Duration::from_millis(ms)),
    };
    let (mut timed_out, mut cancelled) = (false, pump.is_err());
    let status = loop {
        let event = match deadline {
            Some(d) if !timed_out && !cancelled => {
                match rx.recv_timeout(d.saturating_duration_since(Instant::now())) {
                    Ok(ev) => Some(ev),
                    Err(RecvTimeoutError::Timeout) => None,
                    Err(RecvTimeoutError::Disconnected) => unreachable!("tx is held here"),
                }
            }
            _ => Some(rx.recv().expect("tx is held here")),
        };
        match event {
            Some(Event::Exited(status)) => break status,
            Some(Event::Cancel) => {
                if !timed_out && !cancelled {
                    cancelled = true;
                    kill(pid, cg.as_ref());
                }
            }
            None => {
                timed_out = true;
                kill(pid, cg.as_ref());
            }
        }
    };
    drop(tx);
    if timed_out || cancelled {
        // A killed command is reported only once nothing of it is left, so
        // "timed out" means every process it started is gone. Killing a
        // few thousand forks takes seconds under emulation on a busy host,
        // hence the generous bound.
        if let Some(cg) = cg.as_ref() {
            cg.wait_empty(Duration::from_secs(60));
        }
    }
    let duration_ms = start.elapsed().as_millis() as u64;
    exited.signal();
    let (out, err) = match pump {
        Ok(()) => pumped.recv().unwrap_or_default(),
        Err(e) => {
            return fail(AgentError::new(
                ErrorKind::Io,
                format!("cannot start the output thread: {e}"),
            ))
        }
    };
    unregister(id, serial);
    reply.send(
        &Message::Exited {
            id,
            result: exec_result(
                ExitStatus::from_raw(status),
                timed_out,
                cancelled,
                out,
                err,
                duration_ms,
            ),
        },
        &[],
    );
    drop(cg);
    // The next command's cgroup, made now that this one has its answer.
    cgroup::prepare_spare();
}

fn exec_result(
    status: ExitStatus,
    timed_out: bool,
    cancelled: bool,
    out: StreamAcct,
    err: StreamAcct,
    duration_ms: u64,
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
        duration_ms,
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

/// The working directory, resolved and checked to exist (as root: whether
/// the user may enter it is decided by chdir in the child).
fn resolve_cwd(cwd: Option<&str>) -> Result<String, AgentError> {
    let cwd = cwd.filter(|c| !c.is_empty()).unwrap_or(WORKSPACE);
    let path = resolve_guest_path(cwd)?;
    match fs::metadata(&path) {
        Ok(m) if m.is_dir() => Ok(path),
        Ok(_) => Err(AgentError::new(
            ErrorKind::NotADirectory,
            format!("cwd {path} is not a directory"),
        )),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Err(AgentError::new(
            ErrorKind::NotFound,
            format!("cwd {path} does not exist"),
        )),
        Err(e) => Err(files::io_error(&e, &format!("cwd {path}"))),
    }
}

/// Reject what exec(2) cannot carry, before forking.
fn check_request(req: &ExecRequest) -> Result<(), AgentError> {
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

/// The environment every command starts from (the request's env goes on top).
pub fn base_env(cwd: &str) -> Vec<(&'static str, String)> {
    vec![
        ("HOME", GUEST_HOME.to_string()),
        ("USER", GUEST_USER.to_string()),
        ("LOGNAME", GUEST_USER.to_string()),
        ("SHELL", "/bin/bash".to_string()),
        (
            "PATH",
            format!("{GUEST_HOME}/.local/bin:/usr/local/bin:/usr/bin:/bin"),
        ),
        ("LANG", "C.UTF-8".to_string()),
        ("PWD", cwd.to_string()),
        ("TERM", "dumb".to_string()),
    ]
}

/// The shell, its argv and environment, as C strings.
struct ShellCommand {
    program: &'static CStr,
    argv: [CString; 3],
    env: Vec<CString>,
}

/// Which shell runs commands: bash, as `/bin/bash`; `sh` where there is no
/// bash. Debian's `bash-static` (in the image) is the same bash, version and
/// build options, linked statically: under emulation it starts about 3 ms
/// sooner than the dynamically linked one (no loader, no relocations). It is
/// called by the name `/bin/bash`, so `$0` and `$BASH` are what scripts
/// expect; what it lacks is `enable -f` (loadable builtins).
fn shell() -> (&'static CStr, &'static CStr) {
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
    // The request's variables replace the base ones of the same name.
    let mut env: BTreeMap<&str, &str> = BTreeMap::new();
    let base = base_env(cwd);
    for (k, v) in &base {
        env.insert(k, v);
    }
    for (k, v) in &req.env {
        env.insert(k, v);
    }
    Ok(ShellCommand {
        program,
        argv: [
            name.to_owned(),
            c"-c".to_owned(),
            sys::cstring(&req.command).map_err(invalid)?,
        ],
        env: env
            .into_iter()
            .map(|(k, v)| sys::cstring(&format!("{k}={v}")))
            .collect::<io::Result<_>>()
            .map_err(invalid)?,
    })
}

/// Map a failed spawn to an error for the host.
fn spawn_error(e: &io::Error, cwd: &str) -> AgentError {
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
        }
    }

    #[test]
    fn cwd_must_exist_and_be_a_directory() {
        assert_eq!(resolve_cwd(Some("/")).unwrap(), "/");
        assert_eq!(resolve_cwd(Some("/tmp/../tmp")).unwrap(), "/tmp");
        let e = resolve_cwd(Some("/no/such/dir")).unwrap_err();
        assert_eq!(e.kind, ErrorKind::NotFound);
        assert_eq!(e.message, "cwd /no/such/dir does not exist");
        let e = resolve_cwd(Some("/proc/self/status")).unwrap_err();
        assert_eq!(e.kind, ErrorKind::NotADirectory);
        assert_eq!(
            resolve_cwd(Some("a\0")).unwrap_err().kind,
            ErrorKind::InvalidPath
        );
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
        let env: BTreeMap<_, _> = base_env("/workspace/x").into_iter().collect();
        assert_eq!(env["HOME"], "/home/user");
        assert_eq!(env["PWD"], "/workspace/x");
        assert_eq!(
            env["PATH"],
            "/home/user/.local/bin:/usr/local/bin:/usr/bin:/bin"
        );
        assert_eq!(env.len(), 8);
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
            5,
        );
        assert_eq!((r.exit_code, r.signal), (None, Some(9)));
        assert!(r.timed_out && r.stdout_truncated && !r.stderr_truncated);
        assert_eq!((r.stdout_bytes, r.duration_ms), (3, 5));
    }

    #[test]
    fn cancel_of_unknown_id_is_false() {
        assert!(!cancel(987_654_321));
    }
}
