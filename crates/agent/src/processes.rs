//! The commands running now, by pid, and who follows each one's output.
//!
//! Why: a command is usually its request's (the host cancels it, or goes
//! away, and it is killed), but E2B's process API, which Sandpit speaks,
//! has commands that outlive the call that started them: a server started
//! in the background, followed later by another client (`commands.connect`
//! by pid), fed through its stdin, listed, signalled. Those are asked for
//! with `ExecRequest::keep_running`. The table lives here, in the guest,
//! because this is the one place that sees every command whichever host
//! process (a replica, a restarted server) asks about it, and where a pid
//! means something.
//!
//! Every command is in the table while it runs (so any of them can be
//! listed, attached to and signalled); what `keep_running` changes is only
//! what a `Cancel` of its request, or its session ending, does: it stops
//! that request following the output instead of killing the command.
//! Output nobody follows is read and dropped, so the command never blocks
//! on a full pipe.

use crate::channel::Reply;
use crate::sys::{self, lock, EventFd};
use sandpit_protocol::{
    AgentError, DoneResult, ErrorKind, ExecResult, Message, ProcessCall, ProcessInfo, RequestId,
    TerminalSize,
};
use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long input waits for a command to read it before the call fails
/// (its pipe is full: the command is not reading its stdin).
const INPUT_DEADLINE: Duration = Duration::from_secs(10);

/// One request following a command's output.
struct Follower {
    id: RequestId,
    reply: Reply,
}

#[derive(Default)]
struct FollowState {
    followers: Vec<Follower>,
    /// The command's end was sent: nobody may follow it any more.
    ended: bool,
}

/// Who gets a command's output and its end. Shared by the thread that
/// runs the command and the table.
#[derive(Default)]
pub struct Followers {
    state: Mutex<FollowState>,
}

impl Followers {
    /// Followed by the request that started the command.
    pub fn first(id: RequestId, reply: Reply) -> Arc<Self> {
        Arc::new(Followers {
            state: Mutex::new(FollowState {
                followers: vec![Follower { id, reply }],
                ended: false,
            }),
        })
    }

    /// Send a piece of output to everyone following.
    pub fn output(&self, stderr: bool, bytes: &[u8]) {
        // Each follower's frame is sent under the lock, so a follower that
        // attaches meanwhile gets what comes after, never a piece twice.
        let state = lock(&self.state);
        for f in &state.followers {
            let msg = if stderr {
                Message::Stderr { id: f.id }
            } else {
                Message::Stdout { id: f.id }
            };
            f.reply.send(&msg, bytes);
        }
    }

    /// The command ended: its result goes to everyone following, the last
    /// message for each.
    pub fn end(&self, result: &ExecResult) {
        let mut state = lock(&self.state);
        state.ended = true;
        for f in state.followers.drain(..) {
            f.reply.send(
                &Message::Exited {
                    id: f.id,
                    result: result.clone(),
                },
                &[],
            );
        }
    }

    /// Start following; false when the command has ended.
    fn add(&self, id: RequestId, reply: Reply, pid: u32) -> bool {
        let mut state = lock(&self.state);
        if state.ended {
            return false;
        }
        // Its first message, before any output it follows.
        reply.send(&Message::Started { id, pid }, &[]);
        state.followers.push(Follower { id, reply });
        true
    }

    /// Stop request `id` following; false when it did not.
    pub fn remove(&self, id: RequestId) -> bool {
        let mut state = lock(&self.state);
        let before = state.followers.len();
        state.followers.retain(|f| f.id != id);
        state.followers.len() < before
    }

    /// Forget the followers of sessions before `gen` (nobody reads them).
    fn forget_sessions_before(&self, gen: u64) {
        lock(&self.state)
            .followers
            .retain(|f| f.reply.generation() >= gen);
    }
}

/// A running command.
pub struct Process {
    pub info: ProcessInfo,
    pub followers: Arc<Followers>,
    /// The write end of its stdin, while open.
    stdin: Mutex<Option<OwnedFd>>,
    /// Tells the command's thread to kill it (SIGKILL to its process group
    /// and its cgroup, which catches what left the group).
    kill: Arc<EventFd>,
    /// The master side of its terminal, when it runs on one.
    terminal: Option<OwnedFd>,
}

impl Process {
    pub fn new(
        info: ProcessInfo,
        followers: Arc<Followers>,
        stdin: Option<OwnedFd>,
        kill: Arc<EventFd>,
        terminal: Option<OwnedFd>,
    ) -> Arc<Self> {
        if let Some(fd) = &stdin {
            // Writes never block the agent: a full pipe is waited for with
            // a deadline (see `write_input`).
            let _ = sys::set_nonblocking(fd.as_raw_fd(), true);
        }
        Arc::new(Process {
            info,
            followers,
            stdin: Mutex::new(stdin),
            kill,
            terminal,
        })
    }
}

/// Running commands by pid.
static TABLE: Mutex<BTreeMap<u32, Arc<Process>>> = Mutex::new(BTreeMap::new());

/// Requests following a command they did not start, by request id.
static ATTACHED: Mutex<BTreeMap<RequestId, Arc<Followers>>> = Mutex::new(BTreeMap::new());

/// Put a started command in the table.
pub fn register(process: Arc<Process>) {
    lock(&TABLE).insert(process.info.pid, process);
}

/// Take an ended command out of the table (before its end is sent, so a
/// list that comes after the end never shows it).
pub fn unregister(pid: u32) {
    // The table's lock is let go first: input being written may hold the
    // stdin's for seconds, and every new command registers in the table.
    let removed = lock(&TABLE).remove(&pid);
    if let Some(p) = removed {
        // Its stdin closes with it; the attached requests' entries go once
        // their end is sent.
        lock(&p.stdin).take();
        lock(&ATTACHED).retain(|_, f| !Arc::ptr_eq(f, &p.followers));
    }
}

fn find(pid: u32) -> Result<Arc<Process>, AgentError> {
    lock(&TABLE).get(&pid).cloned().ok_or_else(|| {
        AgentError::new(
            ErrorKind::NotFound,
            format!("no running command has pid {pid}"),
        )
    })
}

/// `ProcessAttach`: request `id` follows the command `pid` from now on.
pub fn attach(reply: Reply, id: RequestId, pid: u32) {
    let process = match find(pid) {
        Ok(p) => p,
        Err(e) => return reply.error(id, e),
    };
    // Registered first, so a Cancel right after the Started finds it.
    lock(&ATTACHED).insert(id, process.followers.clone());
    if !process.followers.add(id, reply.clone(), pid) {
        lock(&ATTACHED).remove(&id);
        reply.error(
            id,
            AgentError::new(ErrorKind::NotFound, format!("command {pid} has ended")),
        );
    }
}

/// A `Cancel` of an attached request: it stops following. False when `id`
/// is not one.
pub fn detach(id: RequestId) -> bool {
    match lock(&ATTACHED).remove(&id) {
        Some(followers) => {
            followers.remove(id);
            true
        }
        None => false,
    }
}

/// A session ended: its requests stop following every command.
pub fn forget_sessions_before(gen: u64) {
    let processes: Vec<Arc<Process>> = lock(&TABLE).values().cloned().collect();
    for p in processes {
        p.followers.forget_sessions_before(gen);
    }
    lock(&ATTACHED).retain(|_, f| {
        // Entries whose request is gone from its followers go too.
        let state = lock(&f.state);
        !state.ended && !state.followers.is_empty()
    });
}

/// `ProcessList`: the commands running now, oldest (lowest serial) first.
pub fn list() -> DoneResult {
    let table = lock(&TABLE);
    let mut processes: Vec<ProcessInfo> = table
        .values()
        .map(|p| {
            let mut info = p.info.clone();
            info.stdin = lock(&p.stdin).is_some();
            info
        })
        .collect();
    processes.sort_by_key(|p| p.pid);
    DoneResult::Processes { processes }
}

/// `ProcessCall`: feed, close or signal command `pid`. Runs on a worker
/// thread (input may wait for the command to read).
pub fn call(pid: u32, call: ProcessCall, input: &[u8]) -> Result<DoneResult, AgentError> {
    let process = find(pid)?;
    match call {
        ProcessCall::Input => write_input(&process, input)?,
        ProcessCall::CloseStdin => {
            lock(&process.stdin).take();
        }
        ProcessCall::Signal { signal } => send_signal(&process, signal)?,
        ProcessCall::Resize { rows, cols } => resize(&process, TerminalSize { rows, cols })?,
    }
    Ok(DoneResult::ProcessCalled { pid })
}

fn write_input(process: &Process, mut input: &[u8]) -> Result<(), AgentError> {
    let stdin = lock(&process.stdin);
    let Some(fd) = stdin.as_ref() else {
        return Err(AgentError::new(
            ErrorKind::InvalidRequest,
            format!(
                "command {} has no stdin open (start it with stdin, and do not close it first)",
                process.info.pid
            ),
        ));
    };
    let deadline = Instant::now() + INPUT_DEADLINE;
    while !input.is_empty() {
        // SAFETY: writing from a live slice to our descriptor.
        let n = unsafe { libc::write(fd.as_raw_fd(), input.as_ptr().cast(), input.len()) };
        if n >= 0 {
            input = &input[n as usize..];
            continue;
        }
        let e = std::io::Error::last_os_error();
        match sys::errno(&e) {
            libc::EINTR => continue,
            libc::EAGAIN => {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(AgentError::new(
                        ErrorKind::TimedOut,
                        format!(
                            "command {} has not read its stdin for {} s",
                            process.info.pid,
                            INPUT_DEADLINE.as_secs()
                        ),
                    ));
                }
                let mut fds = [libc::pollfd {
                    fd: fd.as_raw_fd(),
                    events: libc::POLLOUT,
                    revents: 0,
                }];
                let _ = sys::poll(&mut fds, Some(left.min(Duration::from_millis(500))));
            }
            libc::EPIPE => {
                return Err(AgentError::new(
                    ErrorKind::InvalidRequest,
                    format!("command {} closed its stdin", process.info.pid),
                ))
            }
            _ => {
                return Err(AgentError::new(
                    ErrorKind::Io,
                    format!("writing to command {}'s stdin: {e}", process.info.pid),
                ))
            }
        }
    }
    Ok(())
}

fn resize(process: &Process, size: TerminalSize) -> Result<(), AgentError> {
    let Some(terminal) = process.terminal.as_ref() else {
        return Err(AgentError::new(
            ErrorKind::InvalidRequest,
            format!(
                "command {} has no terminal to resize (start it with a pty)",
                process.info.pid
            ),
        ));
    };
    crate::pty::check_size(size)?;
    crate::pty::set_size(terminal.as_raw_fd(), size)
        .map_err(|e| AgentError::new(ErrorKind::Io, format!("resizing the terminal: {e}")))
}

fn send_signal(process: &Process, signal: i32) -> Result<(), AgentError> {
    if !(1..=31).contains(&signal) {
        return Err(AgentError::new(
            ErrorKind::InvalidRequest,
            format!("signal {signal} is not one of 1 to 31"),
        ));
    }
    if signal == libc::SIGKILL {
        // The command's thread kills its group and its cgroup, and waits
        // until nothing of it is left before it reports the end.
        process.kill.signal();
        return Ok(());
    }
    // SAFETY: plain syscall. The shell's pid is its process group's id
    // (it starts its own session); the table holds it until its thread saw
    // it exit, and a pid reused in that moment would have to lead a group
    // of its own to be hit.
    let rc = unsafe { libc::kill(-(process.info.pid as libc::pid_t), signal) };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        return Err(AgentError::new(
            ErrorKind::Io,
            format!("signalling command {}: {e}", process.info.pid),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::channel::Outbox;
    use std::sync::mpsc;

    fn reply(gen: u64) -> (Reply, mpsc::Receiver<(u64, Vec<u8>)>) {
        let (tx, rx) = mpsc::sync_channel(64);
        (Reply::new(gen, Outbox::for_test(tx)), rx)
    }

    fn messages(rx: &mpsc::Receiver<(u64, Vec<u8>)>) -> Vec<Message> {
        let mut decoder = sandpit_protocol::FrameDecoder::new();
        let mut out = Vec::new();
        while let Ok((_, bytes)) = rx.try_recv() {
            decoder.push(&bytes);
            while let Some(frame) = decoder.next_frame().unwrap() {
                out.push(frame.message);
            }
        }
        out
    }

    #[test]
    fn a_follower_gets_what_comes_after_it_and_the_end_once() {
        let (first, first_rx) = reply(u64::MAX);
        let followers = Followers::first(1, first);
        followers.output(false, b"before");
        let (late, late_rx) = reply(u64::MAX);
        assert!(followers.add(2, late, 77));
        followers.output(true, b"after");
        assert!(followers.remove(1));
        assert!(!followers.remove(1));
        followers.output(false, b"only the late one");
        followers.end(&ExecResult {
            exit_code: Some(0),
            signal: None,
            timed_out: false,
            cancelled: false,
            stdout_bytes: 0,
            stderr_bytes: 0,
            stdout_truncated: false,
            stderr_truncated: false,
            duration_ms: 1,
            duration_us: None,
        });
        let (third, third_rx) = reply(u64::MAX);
        assert!(
            !followers.add(3, third, 77),
            "an ended command is not followed"
        );
        assert!(messages(&third_rx).is_empty());

        let first = messages(&first_rx);
        assert_eq!(first.len(), 2, "{first:?}");
        assert!(matches!(first[0], Message::Stdout { id: 1 }));
        assert!(matches!(first[1], Message::Stderr { id: 1 }));
        let late = messages(&late_rx);
        assert!(matches!(late[0], Message::Started { id: 2, pid: 77 }));
        assert!(matches!(late[1], Message::Stderr { id: 2 }));
        assert!(matches!(late[2], Message::Stdout { id: 2 }));
        assert!(matches!(late[3], Message::Exited { id: 2, .. }));
        assert_eq!(late.len(), 4);
    }

    #[test]
    fn a_sessions_end_drops_its_followers_only() {
        let (old, old_rx) = reply(3);
        let (new, new_rx) = reply(u64::MAX);
        let followers = Followers::first(1, old);
        assert!(followers.add(2, new, 5));
        followers.forget_sessions_before(4);
        followers.output(false, b"x");
        assert!(!followers.remove(1), "the old session's follower stayed");
        assert!(messages(&old_rx).is_empty());
        let new = messages(&new_rx);
        assert!(matches!(
            new[..],
            [
                Message::Started { id: 2, pid: 5 },
                Message::Stdout { id: 2 }
            ]
        ));
    }

    #[test]
    fn an_unknown_pid_is_not_found() {
        let e = call(4_000_000, ProcessCall::CloseStdin, &[]).unwrap_err();
        assert_eq!(e.kind, ErrorKind::NotFound);
        assert!(!detach(987_654_321));
    }
}
