//! The agent's side of a file process: start one for a request, feed it,
//! read its frames, kill it when the request is over.
//!
//! The process is the agent's own binary (opened once, executed through its
//! descriptor, so no directory on the way need be the user's to enter),
//! started as the guest user exactly as the user's commands are (uid, gid
//! and groups, no capabilities; see `spawn`), in a session of its own. The
//! credential change leaves it non-dumpable, so the user's processes cannot
//! attach to it or read its memory; they can signal it, which only fails
//! the request it serves.
//!
//! Every wait on it is bounded: a process the user stopped, or one stuck on
//! a file that never answers, fails its request after its patience and is
//! killed; the agent's thread never waits forever.

use super::link::{self, Frame, Request};
use super::serve;
use crate::spawn::{self, Sandbox};
use crate::sys;
use sandpit_protocol::{AgentError, ErrorKind, GUEST_UID};
use std::ffi::CString;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::thread;
use std::time::{Duration, Instant};

/// Whether requests run in processes of the guest user's (set once by
/// `main` when the agent is root); otherwise on threads of the agent.
static IN_USER_PROCESSES: AtomicBool = AtomicBool::new(false);

/// From now on, each file request runs in a process of the guest user's.
pub fn run_in_user_processes() {
    IN_USER_PROCESSES.store(true, Ordering::SeqCst);
}

/// How long a process may take between its `clone` and its `execve` (the
/// user can stop it there; the reaper kills it at this deadline).
const START_PATIENCE: Duration = Duration::from_secs(30);

/// A running file request.
pub struct UserProcess {
    input: Option<File>,
    output: File,
    /// Killed when dropped; `None` for a request served on a thread.
    pidfd: Option<OwnedFd>,
}

impl UserProcess {
    /// Start `request`: its line is written before this returns.
    pub fn start(request: &Request) -> Result<UserProcess, AgentError> {
        let mut process = if IN_USER_PROCESSES.load(Ordering::SeqCst) {
            Self::spawn()?
        } else {
            Self::on_thread()?
        };
        process
            .write_input(&link::encode_request(request), START_PATIENCE)
            .map_err(|e| io_error(&e))?;
        if !matches!(request, Request::Write { .. }) {
            process.end_input();
        }
        Ok(process)
    }

    fn spawn() -> Result<UserProcess, AgentError> {
        let (program, _) = agent_binary()
            .map_err(|e| AgentError::new(ErrorKind::Io, format!("the agent's binary: {e}")))?;
        let argv = [
            CString::new("sandpit-files").expect("no NUL"),
            CString::new(serve::PROCESS_ARG).expect("no NUL"),
        ];
        let sandbox = Sandbox {
            uid: GUEST_UID,
            gid: GUEST_UID,
            cwd: c"/",
            // The agent's cgroup, not the user's: it runs nothing but the
            // request, and a user at their cgroup's limits still reaches
            // their files.
            cgroup: None,
            // The agent's (unlimited): a user at their process limit can
            // still reach their files.
            nproc: None,
            deadline: Some(Instant::now() + START_PATIENCE),
        };
        let spawned =
            spawn::spawn(program, &argv, &[], &sandbox, true, Box::new(|_| {})).map_err(|e| {
                AgentError::new(
                    ErrorKind::Io,
                    format!("cannot start a file process ({:?}): {}", e.step, e.error),
                )
            })?;
        let input = spawned.stdin.expect("asked for a stdin pipe");
        sys::set_nonblocking(input.as_raw_fd(), true).map_err(|e| io_error(&e))?;
        Ok(UserProcess {
            input: Some(File::from(input)),
            output: File::from(spawned.stdout),
            pidfd: Some(spawned.pidfd),
        })
    }

    fn on_thread() -> Result<UserProcess, AgentError> {
        let (input_r, input_w) = io::pipe().map_err(|e| io_error(&e))?;
        let (output_r, output_w) = io::pipe().map_err(|e| io_error(&e))?;
        let input_w = OwnedFd::from(input_w);
        sys::set_nonblocking(input_w.as_raw_fd(), true).map_err(|e| io_error(&e))?;
        thread::Builder::new()
            .name("file-request".into())
            .spawn(move || {
                let mut input = io::BufReader::new(input_r);
                let mut output = io::BufWriter::new(output_w);
                let _ = serve::serve(&mut input, &mut output);
            })
            .map_err(|e| io_error(&e))?;
        Ok(UserProcess {
            input: Some(File::from(input_w)),
            output: File::from(OwnedFd::from(output_r)),
            pidfd: None,
        })
    }

    /// Give the process `bytes` of its input, waiting at most `patience`
    /// for it to take each part. Fails when the process is gone (it may
    /// have answered: read its frame).
    pub fn write_input(&mut self, mut bytes: &[u8], patience: Duration) -> io::Result<()> {
        let Some(input) = self.input.as_mut() else {
            return Err(io::Error::from(io::ErrorKind::BrokenPipe));
        };
        while !bytes.is_empty() {
            match input.write(bytes) {
                Ok(n) => bytes = &bytes[n..],
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    wait_for(input.as_raw_fd(), libc::POLLOUT, patience)?
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// No more input: a write given less than its size ends as cut.
    pub fn end_input(&mut self) {
        self.input = None;
    }

    /// The process's answers, for polling beside other descriptors.
    pub fn output_fd(&self) -> RawFd {
        self.output.as_raw_fd()
    }

    /// The next frame, waiting at most `patience` for each part of it; the
    /// process ending before its [`Frame::Done`] is an error.
    pub fn next_frame(&mut self, patience: Duration) -> Result<Frame, AgentError> {
        let mut patient = Patient {
            output: &mut self.output,
            patience,
        };
        match link::read_frame(&mut patient)? {
            Some(frame) => Ok(frame),
            None => Err(AgentError::new(
                ErrorKind::Io,
                "the file request's process ended before answering (was it killed?)",
            )),
        }
    }

    /// Wait at most `patience` for the process to end (its output closes),
    /// e.g. for a cut write to remove its temporary file.
    pub fn wait_end(&mut self, patience: Duration) {
        let deadline = Instant::now() + patience;
        let mut sink = [0u8; 4096];
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || wait_for(self.output.as_raw_fd(), libc::POLLIN, left).is_err() {
                return;
            }
            match sys::read_fd(self.output.as_raw_fd(), &mut sink) {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    }
}

impl Drop for UserProcess {
    fn drop(&mut self) {
        if let Some(pidfd) = &self.pidfd {
            // SAFETY: a signal through our own pidfd; the reaper collects
            // the process, whose pid cannot be reused before then.
            unsafe {
                libc::syscall(
                    libc::SYS_pidfd_send_signal,
                    pidfd.as_raw_fd(),
                    libc::SIGKILL,
                    std::ptr::null::<libc::siginfo_t>(),
                    0,
                )
            };
        }
    }
}

/// The process's output, each read waiting at most `patience`.
struct Patient<'a> {
    output: &'a mut File,
    patience: Duration,
}

impl Read for Patient<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        wait_for(self.output.as_raw_fd(), libc::POLLIN, self.patience)?;
        self.output.read(buf)
    }
}

/// Wait at most `patience` for `fd` to be ready for `events` (or hung up).
fn wait_for(fd: RawFd, events: libc::c_short, patience: Duration) -> io::Result<()> {
    let deadline = Instant::now() + patience;
    loop {
        let mut fds = [libc::pollfd {
            fd,
            events,
            revents: 0,
        }];
        let left = deadline.saturating_duration_since(Instant::now());
        if sys::poll(&mut fds, Some(left))? > 0 {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "no progress in {} s (stopped, or stuck on a file that does not answer)",
                    patience.as_secs()
                ),
            ));
        }
    }
}

fn io_error(e: &io::Error) -> AgentError {
    super::io_error(e, "the file request's process")
}

/// The agent's binary as a path `execve` takes (`/proc/self/fd/N`), and
/// the `O_PATH` descriptor behind it, opened once.
fn agent_binary() -> Result<(&'static CString, RawFd), String> {
    static BINARY: OnceLock<Result<(CString, OwnedFd), String>> = OnceLock::new();
    let opened = BINARY.get_or_init(|| {
        // SAFETY: open(2) of a NUL-terminated path; the result is checked.
        let fd = unsafe { libc::open(c"/proc/self/exe".as_ptr(), libc::O_PATH | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error().to_string());
        }
        // SAFETY: a new descriptor owned by nothing else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let path = CString::new(format!("/proc/self/fd/{}", fd.as_raw_fd())).expect("no NUL");
        Ok((path, fd))
    });
    match opened {
        Ok((path, fd)) => Ok((path, fd.as_raw_fd())),
        Err(e) => Err(e.clone()),
    }
}
