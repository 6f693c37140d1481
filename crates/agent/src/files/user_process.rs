//! The agent's side of a file request: hand its socket to the user's file
//! server, feed it, read its frames, end it.
//!
//! The file server (see `serve`) is the agent's own binary (opened once,
//! executed through its descriptor, so no directory on the way need be the
//! user's to enter), started with the guest user's rights: the user's
//! effective (and so filesystem) uid, gid and groups, no capabilities (see
//! `spawn`), in a session of its own, in the agent's cgroup with the
//! agent's process limit (a user at their limits still reaches their
//! files). Every permission the kernel checks on a file, or on another
//! process's `/proc` entries, is checked against those. Its real and saved
//! uid are [`FILE_SERVER_UID`], neither the user's nor root's: the user's
//! processes may not signal it (the kernel lets a process signal only those
//! whose real or saved uid is its own), so a user who kills or stops all
//! their processes still reaches their files, and it has no way back to
//! root. Nothing of the user's can attach to it or to the processes it
//! forks, or read their memory (that needs all three uids to be the
//! user's). It is started at the first request and again whenever it is
//! found gone.
//!
//! Every wait is bounded: a server that does not start a request's process
//! within [`START_PATIENCE`] is killed and the request tried once more on a
//! new one; a request's process that stops answering fails its request
//! after its patience; and a request's process is killed when its request
//! ends first (a cancelled read, a session gone).

use super::link::{self, Frame, Request};
use super::serve;
use crate::spawn::{self, Sandbox};
use crate::sys::{self, lock};
use nix::sys::socket::{self, ControlMessage, MsgFlags, SockFlag, SockType};
use sandpit_protocol::{AgentError, ErrorKind, GUEST_UID};
use std::ffi::CString;
use std::io::{self, IoSlice, Read, Write};
use std::net::Shutdown;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::thread;
use std::time::{Duration, Instant};

/// Whether requests go to the guest user's file server (set once by
/// `main` when the agent is root); otherwise to threads of the agent.
static TO_USER_SERVER: AtomicBool = AtomicBool::new(false);

/// From now on, each file request runs in a process of the guest user's.
pub fn run_in_user_processes() {
    TO_USER_SERVER.store(true, Ordering::SeqCst);
}

/// The real and saved uid of the file server and its processes: no
/// account of the guest's (Debian's system users and the sandbox's user
/// are below it), so nothing in the guest may signal them.
pub const FILE_SERVER_UID: u32 = 60_001;

/// How long the file server may take to start a request's process (the
/// user can stop it; under emulation, on a loaded host, a fork and its
/// first frame take milliseconds).
const START_PATIENCE: Duration = Duration::from_secs(20);

/// A running file request.
pub struct UserProcess {
    socket: UnixStream,
    /// Descriptors that came with its frames, oldest first.
    received: std::collections::VecDeque<OwnedFd>,
    /// Killed when dropped; `None` for a request served on a thread.
    pidfd: Option<OwnedFd>,
}

impl UserProcess {
    /// Start `request`: its process has started and has its request line.
    pub fn start(request: &Request) -> Result<UserProcess, AgentError> {
        let line = link::encode_request(request);
        let to_server = TO_USER_SERVER.load(Ordering::SeqCst);
        let mut attempt = 0;
        loop {
            attempt += 1;
            let (ours, theirs) = UnixStream::pair().map_err(|e| io_error(&e))?;
            let server = if to_server {
                Some(FileServer::hand(theirs)?)
            } else {
                thread::Builder::new()
                    .name("file-request".into())
                    .spawn(move || serve::serve(theirs, None))
                    .map_err(|e| io_error(&e))?;
                None
            };
            ours.set_nonblocking(true).map_err(|e| io_error(&e))?;
            let mut process = UserProcess {
                socket: ours,
                received: Default::default(),
                pidfd: None,
            };
            let started = process
                .write_input(&line, START_PATIENCE)
                .map_err(|e| io_error(&e))
                .and_then(|()| process.next_frame(START_PATIENCE));
            match started {
                Ok(Frame::Started { pid }) => {
                    process.pidfd = pid.and_then(pidfd_open);
                    if !matches!(request, Request::Write { .. }) {
                        process.end_input();
                    }
                    return Ok(process);
                }
                Ok(other) => return Err(super::unexpected(&other)),
                // The server is stopped or gone: a new one, once.
                Err(_) if server.is_some() && attempt == 1 => {
                    FileServer::replace(server.expect("checked"));
                }
                Err(e) => {
                    return Err(AgentError::new(
                        ErrorKind::Io,
                        format!(
                            "the user's file server did not start the request: {}",
                            e.message
                        ),
                    ))
                }
            }
        }
    }

    /// Give the process `bytes` of its input, waiting at most `patience`
    /// for it to take each part. Fails when the process is gone (it may
    /// have answered: read its frame).
    pub fn write_input(&mut self, mut bytes: &[u8], patience: Duration) -> io::Result<()> {
        while !bytes.is_empty() {
            match self.socket.write(bytes) {
                Ok(n) => bytes = &bytes[n..],
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    wait_for(self.socket.as_raw_fd(), libc::POLLOUT, patience)?
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// No more input: a write given less than its size ends as cut.
    pub fn end_input(&mut self) {
        let _ = self.socket.shutdown(Shutdown::Write);
    }

    /// The process's answers, for polling beside other descriptors.
    pub fn output_fd(&self) -> RawFd {
        self.socket.as_raw_fd()
    }

    /// The next frame, waiting at most `patience` for each part of it; the
    /// process ending before its [`Frame::Done`] is an error.
    pub fn next_frame(&mut self, patience: Duration) -> Result<Frame, AgentError> {
        let mut patient = Patient {
            socket: &mut self.socket,
            received: &mut self.received,
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

    /// The oldest descriptor that came with a frame (a read's file with
    /// [`Frame::Opened`]).
    pub fn take_descriptor(&mut self) -> Option<OwnedFd> {
        self.received.pop_front()
    }

    /// Wait at most `patience` for the process to end (its socket closes),
    /// e.g. for a cut write to remove its temporary file.
    pub fn wait_end(&mut self, patience: Duration) {
        let deadline = Instant::now() + patience;
        let mut sink = [0u8; 4096];
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || wait_for(self.socket.as_raw_fd(), libc::POLLIN, left).is_err() {
                return;
            }
            match self.socket.read(&mut sink) {
                Ok(0) => return,
                Err(e) if e.kind() != io::ErrorKind::WouldBlock => return,
                _ => {}
            }
        }
    }
}

impl Drop for UserProcess {
    fn drop(&mut self) {
        if let Some(pidfd) = &self.pidfd {
            kill(pidfd);
        }
    }
}

/// The process's answers, each read waiting at most `patience`; the
/// descriptors that come with them are kept in `received`.
struct Patient<'a> {
    socket: &'a mut UnixStream,
    received: &'a mut std::collections::VecDeque<OwnedFd>,
    patience: Duration,
}

impl Read for Patient<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            let mut iov = [io::IoSliceMut::new(buf)];
            let mut space = nix::cmsg_space!([RawFd; 4]);
            let got = socket::recvmsg::<()>(
                self.socket.as_raw_fd(),
                &mut iov,
                Some(&mut space),
                MsgFlags::MSG_CMSG_CLOEXEC,
            );
            match got {
                Ok(message) => {
                    let n = message.bytes;
                    for cmsg in message.cmsgs().into_iter().flatten() {
                        if let socket::ControlMessageOwned::ScmRights(fds) = cmsg {
                            // SAFETY: descriptors this message gave us,
                            // owned by nothing else.
                            self.received.extend(
                                fds.into_iter()
                                    .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
                            );
                        }
                    }
                    return Ok(n);
                }
                Err(nix::errno::Errno::EAGAIN) => {
                    wait_for(self.socket.as_raw_fd(), libc::POLLIN, self.patience)?
                }
                Err(nix::errno::Errno::EINTR) => {}
                Err(e) => return Err(io::Error::from(e)),
            }
        }
    }
}

/// The guest user's file server: the agent's end of its socket, and its
/// pidfd. One at a time; `generation` tells a replaced one from the next.
struct FileServer {
    control: OwnedFd,
    pidfd: OwnedFd,
    generation: u64,
}

static SERVER: Mutex<Option<FileServer>> = Mutex::new(None);
static GENERATIONS: AtomicU64 = AtomicU64::new(0);

impl FileServer {
    /// Give `request` (its socket's other end) to the server, started
    /// first when there is none or it has exited. Returns the generation
    /// of the server that has it.
    fn hand(request: UnixStream) -> Result<u64, AgentError> {
        let mut server = lock(&SERVER);
        if server.as_ref().is_some_and(|s| exited(&s.pidfd)) {
            *server = None;
        }
        for fresh in [false, true] {
            if server.is_none() {
                *server = Some(FileServer::start()?);
            }
            let s = server.as_ref().expect("just made");
            let fds = [request.as_raw_fd()];
            let sent = socket::sendmsg::<()>(
                s.control.as_raw_fd(),
                &[IoSlice::new(&[0])],
                &[ControlMessage::ScmRights(&fds)],
                MsgFlags::MSG_NOSIGNAL,
                None,
            );
            match sent {
                Ok(_) => return Ok(s.generation),
                // Gone since (killed by the user): a new one, once.
                Err(_) if !fresh => {
                    kill(&s.pidfd);
                    *server = None;
                }
                Err(e) => {
                    return Err(AgentError::new(
                        ErrorKind::Io,
                        format!("cannot reach the user's file server: {e}"),
                    ))
                }
            }
        }
        unreachable!("the second round returns")
    }

    /// The server of `generation` did not start a request: kill it, so the
    /// next request starts a new one.
    fn replace(generation: u64) {
        let mut server = lock(&SERVER);
        if server.as_ref().is_some_and(|s| s.generation == generation) {
            if let Some(s) = server.take() {
                kill(&s.pidfd);
            }
        }
    }

    fn start() -> Result<FileServer, AgentError> {
        let (program, _) = agent_binary()
            .map_err(|e| AgentError::new(ErrorKind::Io, format!("the agent's binary: {e}")))?;
        let (control, theirs) = socket::socketpair(
            socket::AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_CLOEXEC,
        )
        .map_err(|e| io_error(&io::Error::from(e)))?;
        let argv = [
            CString::new("sandpit-files").expect("no NUL"),
            CString::new(serve::PROCESS_ARG).expect("no NUL"),
        ];
        let sandbox = Sandbox {
            uid: GUEST_UID,
            real_uid: Some(FILE_SERVER_UID),
            gid: GUEST_UID,
            cwd: c"/",
            // The agent's cgroup and process limit, not the user's.
            cgroup: None,
            nproc: None,
            deadline: Some(Instant::now() + START_PATIENCE),
        };
        let (_, pidfd) = spawn::spawn_on(
            program,
            &argv,
            &[],
            &sandbox,
            theirs.as_raw_fd(),
            Box::new(|_| {}),
        )
        .map_err(|e| {
            AgentError::new(
                ErrorKind::Io,
                format!("cannot start the user's file server: {}", e.error),
            )
        })?;
        Ok(FileServer {
            control,
            pidfd,
            generation: GENERATIONS.fetch_add(1, Ordering::SeqCst),
        })
    }
}

/// Whether the process behind `pidfd` has exited (its pidfd is readable).
fn exited(pidfd: &OwnedFd) -> bool {
    let mut fds = [sys::pollin(pidfd.as_raw_fd())];
    sys::poll(&mut fds, Some(Duration::ZERO)).is_ok_and(|n| n > 0)
}

fn kill(pidfd: &OwnedFd) {
    // SAFETY: a signal through a pidfd we own: it reaches that process or
    // none, never one that reused its pid.
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

/// A pidfd of the request's process `pid` (which just said it started; the
/// file server reaps it, so it is this process or none).
fn pidfd_open(pid: u32) -> Option<OwnedFd> {
    // SAFETY: pidfd_open returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::c_long, 0) };
    // SAFETY: a new descriptor owned by nothing else.
    (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
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
