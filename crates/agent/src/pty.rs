//! Terminals: an interactive login shell as the guest user on a
//! pseudo-terminal, for a person at a browser or a CLI (`PtyOpen`).
//!
//! A terminal is a stream like a port tunnel (see `tunnel`, whose table
//! routes its messages): `TunnelData` carries keystrokes in and output out,
//! each direction within its send_window window, `TunnelClose` from the host
//! hangs it up, and `PtyResize` sets its size. Three threads serve one:
//!
//! - the *control* thread takes the host's events: input goes to the
//!   typist's queue, acks to the output send_window, sizes to the terminal;
//! - the *typist* writes input into the terminal as the shell reads it (a
//!   program that reads nothing fills the terminal's buffer; only this
//!   thread then waits, and the host's window bounds its queue);
//! - the *reader* sends output within its send_window and watches the shell's
//!   pidfd: when the shell exits it sends what is left, then `PtyExited`.
//!
//! The shell starts as a command does (see `spawn`): its own cgroup under
//! the user's (so the user's memory and process limits hold for a terminal
//! too), its own session, the user's uid, /workspace; the terminal is its
//! controlling one, so `^C`, job control and `SIGWINCH` work as on any
//! Linux console. The terminal's slave end is the user's (as `login` makes
//! it), so programs that check or reopen their terminal work.
//!
//! A hang-up (the host closed the stream, or its session ended) stops the
//! threads, then closes the master side: the kernel sends SIGHUP to the
//! terminal's session, as when an ssh connection drops. A shell still there
//! after [`HANGUP_GRACE`] is killed with its process group. What the user
//! started with `nohup` or `setsid` keeps running, as it would over ssh.

use crate::cgroup::{self, ExecCgroup};
use crate::channel::Reply;
use crate::reaper::ExitStatus;
use crate::spawn::{self, Sandbox};
use crate::sys::{self, EventFd};
use crate::tunnel::{self, Event, Registered};
use crate::window::SendWindow;
use sandpit_protocol::{AgentError, ErrorKind, Message, RequestId, GUEST_UID, WORKSPACE};
use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

/// Bytes the host may send to one terminal before this side acknowledges
/// them.
pub const WINDOW: u32 = tunnel::WINDOW;
/// Largest piece of output in one frame.
const CHUNK: usize = 16 * 1024;
/// How long a hung-up shell has to exit before it is killed.
pub const HANGUP_GRACE: Duration = Duration::from_secs(2);
/// The group that owns terminals (Debian's `tty`).
const TTY_GID: libc::gid_t = 5;
/// What every terminal's programs are told they draw on.
pub(crate) const TERM: &str = "xterm-256color";

/// Handle a `PtyOpen` (on the reader thread: registers the stream before
/// anything else about it can arrive).
pub fn open(reply: Reply, id: RequestId, rows: u16, cols: u16, window: u32) {
    let Some(Registered { serial, events }) = tunnel::register(&reply, id) else {
        return;
    };
    let r = reply.clone();
    let spawned = thread::Builder::new()
        .name("pty-control".into())
        .spawn(move || {
            serve(&r, id, serial, Size { rows, cols }, window, events);
            tunnel::unregister(id, serial);
        });
    if let Err(e) = spawned {
        tunnel::unregister(id, serial);
        reply.error(
            id,
            AgentError::new(ErrorKind::Io, format!("cannot start a thread: {e}")),
        );
    }
}

type Size = sandpit_protocol::TerminalSize;

/// A started terminal: the master side, the shell on it, and its cgroup.
struct Terminal {
    master: OwnedFd,
    pid: u32,
    pidfd: OwnedFd,
    /// Where the reaper sends the shell's status when it collects it first.
    status: Mutex<Receiver<i32>>,
    _cgroup: Option<ExecCgroup>,
}

/// The control thread: start the shell, then route the host's events until
/// it hangs up or the shell's end unregisters the stream.
fn serve(
    reply: &Reply,
    id: RequestId,
    serial: u64,
    size: Size,
    window: u32,
    events: Receiver<Event>,
) {
    let term = match Terminal::start(size) {
        Ok(t) => Arc::new(t),
        Err(e) => return reply.error(id, e),
    };
    let stop = match EventFd::new() {
        Ok(e) => Arc::new(e),
        Err(e) => {
            term.kill();
            return reply.error(id, AgentError::new(ErrorKind::Io, format!("eventfd: {e}")));
        }
    };
    let send_window = Arc::new(SendWindow::new(window as u64));
    let (input_tx, input_rx) = mpsc::channel::<Vec<u8>>();
    reply.send(&Message::TunnelOpened { id, window: WINDOW }, &[]);
    let typist = {
        let (r, t, s) = (reply.clone(), term.clone(), stop.clone());
        thread::Builder::new()
            .name("pty-typist".into())
            .spawn(move || type_input(&r, id, &t, &s, input_rx))
    };
    let reader = {
        let (r, t, s, c) = (
            reply.clone(),
            term.clone(),
            stop.clone(),
            send_window.clone(),
        );
        thread::Builder::new()
            .name("pty-reader".into())
            .spawn(move || read_output(&r, id, serial, &t, &s, &c))
    };
    if typist.is_ok() && reader.is_ok() {
        route(&term, &send_window, &input_tx, events);
    } else {
        reply.send(&Message::TunnelClose { id }, &[]);
    }
    drop(input_tx);
    stop.signal();
    send_window.close();
    for handle in [typist, reader].into_iter().flatten() {
        let _ = handle.join();
    }
    match Arc::try_unwrap(term) {
        Ok(term) => term.hang_up(),
        Err(term) => term.kill(),
    }
}

/// Route the host's events until it closes the stream or the stream is
/// unregistered (the shell ended).
fn route(
    term: &Terminal,
    send_window: &SendWindow,
    input: &Sender<Vec<u8>>,
    events: Receiver<Event>,
) {
    for event in events.iter() {
        match event {
            Event::Data(bytes) => {
                if input.send(bytes).is_err() {
                    return;
                }
            }
            Event::Ack(n) => send_window.add(n as u64),
            Event::Resize { rows, cols } => {
                if let Err(e) = set_size(term.master.as_raw_fd(), Size { rows, cols }) {
                    crate::error!("terminal resize: {e}");
                }
            }
            // A terminal has no half-close: input ends with ^D, as typed.
            Event::Shutdown => {}
            Event::Close => return,
        }
    }
}

/// The typist: write input into the terminal as it takes it, acknowledging
/// each piece once written (or dropped: after the shell's end nothing reads
/// it, and the host's writer must not wait on send_window that cannot come).
fn type_input(
    reply: &Reply,
    id: RequestId,
    term: &Terminal,
    stop: &EventFd,
    input: Receiver<Vec<u8>>,
) {
    let fd = term.master.as_raw_fd();
    let mut writable = true;
    for bytes in input.iter() {
        if writable {
            writable = write_all(fd, &bytes, stop);
        }
        reply.send(
            &Message::TunnelAck {
                id,
                bytes: bytes.len() as u32,
            },
            &[],
        );
    }
}

/// Write `bytes` to the non-blocking master, waiting for room; false when
/// the terminal is gone or `stop` was signalled.
fn write_all(fd: RawFd, mut bytes: &[u8], stop: &EventFd) -> bool {
    while !bytes.is_empty() {
        // SAFETY: writes from a valid slice to our descriptor.
        let n = unsafe { libc::write(fd, bytes.as_ptr().cast(), bytes.len()) };
        if n >= 0 {
            bytes = &bytes[n as usize..];
            continue;
        }
        let e = io::Error::last_os_error();
        match e.kind() {
            io::ErrorKind::Interrupted => {}
            io::ErrorKind::WouldBlock => {
                let mut fds = [
                    libc::pollfd {
                        fd,
                        events: libc::POLLOUT,
                        revents: 0,
                    },
                    sys::pollin(stop.raw()),
                ];
                if sys::poll_forever(&mut fds).is_err() || sys::ready(&fds[1]) {
                    return false;
                }
            }
            _ => return false,
        }
    }
    true
}

/// The reader: send output within the host's send_window until the shell exits,
/// then the rest of it and `PtyExited`, and end the stream.
fn read_output(
    reply: &Reply,
    id: RequestId,
    serial: u64,
    term: &Terminal,
    stop: &EventFd,
    send_window: &SendWindow,
) {
    let fd = term.master.as_raw_fd();
    let mut buf = vec![0u8; CHUNK];
    // False once every slave end closed (reads say EIO): only the shell's
    // end is left to wait for.
    let mut open = true;
    loop {
        let mut fds = [
            sys::pollin(term.pidfd.as_raw_fd()),
            sys::pollin(stop.raw()),
            sys::pollin(if open { fd } else { -1 }),
        ];
        if sys::poll_forever(&mut fds).is_err() || sys::ready(&fds[1]) {
            return;
        }
        if sys::ready(&fds[0]) {
            break;
        }
        if sys::ready(&fds[2]) {
            match send_output(reply, id, fd, &mut buf, send_window) {
                Output::Sent | Output::Nothing => {}
                Output::Closed => open = false,
                Output::Stopped => return,
            }
        }
    }
    // The shell exited: what it wrote is in the terminal (a read flushes the
    // kernel's pending input before it says there is none); send it all,
    // then its status.
    while open {
        match send_output(reply, id, fd, &mut buf, send_window) {
            Output::Sent => {}
            Output::Nothing | Output::Closed => open = false,
            Output::Stopped => return,
        }
    }
    let (exit_code, signal) = match term.exit_status() {
        Some(ExitStatus::Code(c)) => (Some(c), None),
        Some(ExitStatus::Signal(s)) => (None, Some(s)),
        None => (None, None),
    };
    reply.send(
        &Message::PtyExited {
            id,
            exit_code,
            signal,
        },
        &[],
    );
    // The stream is over: the control thread's events end.
    tunnel::unregister(id, serial);
}

/// What one read of the terminal's output came to.
enum Output {
    Sent,
    /// Nothing to read right now.
    Nothing,
    /// Every slave end is closed.
    Closed,
    /// The host stopped granting send_window (a hang-up).
    Stopped,
}

/// One read of output, sent within send_window.
fn send_output(
    reply: &Reply,
    id: RequestId,
    fd: RawFd,
    buf: &mut [u8],
    send_window: &SendWindow,
) -> Output {
    let Some(allowed) = send_window.take(buf.len()) else {
        return Output::Stopped;
    };
    let read = sys::read_fd(fd, &mut buf[..allowed]);
    let n = *read.as_ref().unwrap_or(&0);
    if n < allowed {
        send_window.add((allowed - n) as u64);
    }
    match read {
        Ok(0) => Output::Closed,
        Ok(n) => {
            reply.send(&Message::TunnelData { id }, &buf[..n]);
            Output::Sent
        }
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Output::Nothing,
        Err(_) => Output::Closed,
    }
}

impl Terminal {
    /// A new terminal of `size` with a login shell on it.
    fn start(size: Size) -> Result<Self, AgentError> {
        let io_err = |what: &str, e: io::Error| {
            AgentError::new(
                ErrorKind::Io,
                format!("cannot open a terminal ({what}): {e}"),
            )
        };
        let (master, slave) = open_pair().map_err(|e| io_err("openpt", e))?;
        set_size(master.as_raw_fd(), size).map_err(|e| io_err("size", e))?;
        sys::set_nonblocking(master.as_raw_fd(), true).map_err(|e| io_err("fcntl", e))?;
        let (program, argv) = login_shell();
        let env = crate::exec::environment(WORKSPACE, false, [("TERM", TERM)].into_iter())
            .map_err(|e| AgentError::new(ErrorKind::InvalidRequest, e.to_string()))?;
        let cwd = sys::cstring(WORKSPACE).map_err(|e| io_err("cwd", e))?;
        let cgroup = cgroup::create_exec();
        let sandbox = Sandbox {
            uid: GUEST_UID,
            real_uid: None,
            gid: GUEST_UID,
            cwd: &cwd,
            cgroup: cgroup.as_ref().map(ExecCgroup::dir_fd),
            nproc: Some(cgroup::pids_max()),
            deadline: None,
        };
        let (status_tx, status) = mpsc::channel();
        let on_exit = Box::new(move |s| {
            let _ = status_tx.send(s);
        });
        let (pid, pidfd) =
            spawn::spawn_on_terminal(program, &argv, &env, &sandbox, slave.as_raw_fd(), on_exit)
                .map_err(|e| io_err("shell", e.error))?;
        // Only the shell (and what it starts) holds the slave end now, so
        // the master reads EIO once they all closed it.
        drop(slave);
        Ok(Terminal {
            master,
            pid,
            pidfd,
            status: Mutex::new(status),
            _cgroup: cgroup,
        })
    }

    /// The shell's status once its pidfd is readable: read without reaping,
    /// or from the reaper when it collected the shell first.
    fn exit_status(&self) -> Option<ExitStatus> {
        spawn::exit_status(&self.pidfd).or_else(|| {
            sys::lock(&self.status)
                .recv_timeout(Duration::from_secs(5))
                .ok()
                .map(ExitStatus::from_raw)
        })
    }

    fn exited(&self, within: Duration) -> bool {
        let mut fds = [sys::pollin(self.pidfd.as_raw_fd())];
        matches!(sys::poll(&mut fds, Some(within)), Ok(n) if n > 0)
    }

    /// Close the master side (the kernel hangs up the terminal's session),
    /// then kill the shell's process group if the shell outlives the grace.
    fn hang_up(self) {
        let Terminal {
            master, pid, pidfd, ..
        } = self;
        drop(master);
        let mut fds = [sys::pollin(pidfd.as_raw_fd())];
        if !matches!(sys::poll(&mut fds, Some(HANGUP_GRACE)), Ok(n) if n > 0) {
            kill_group(pid);
        }
    }

    /// Kill the shell's process group now (the terminal could not be served).
    fn kill(&self) {
        if !self.exited(Duration::ZERO) {
            kill_group(self.pid);
        }
    }
}

/// SIGKILL a shell's process group. The shell is not reaped before its
/// pidfd was seen readable (its status is read without reaping, or taken
/// from the reaper's channel), so the id is still its own.
fn kill_group(pid: u32) {
    // SAFETY: plain syscall.
    unsafe { libc::kill(-(pid as libc::pid_t), libc::SIGKILL) };
}

/// A new pseudo-terminal: its master side and its slave side, the slave
/// owned by the guest user and group `tty` (mode 0620), as `login` leaves
/// it.
pub(crate) fn open_pair() -> io::Result<(OwnedFd, OwnedFd)> {
    // SAFETY: plain syscalls; every descriptor made is wrapped at once.
    unsafe {
        let m = sys::cvt(libc::posix_openpt(
            libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC,
        ))?;
        let master = OwnedFd::from_raw_fd(m);
        sys::cvt(libc::unlockpt(m))?;
        let s = sys::cvt(libc::ioctl(
            m,
            libc::TIOCGPTPEER,
            libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC,
        ))?;
        let slave = OwnedFd::from_raw_fd(s);
        sys::cvt(libc::fchown(s, GUEST_UID, TTY_GID))?;
        sys::cvt(libc::fchmod(s, 0o620))?;
        Ok((master, slave))
    }
}

/// A size a terminal can have: at least one row and one column.
pub(crate) fn check_size(size: Size) -> Result<(), AgentError> {
    if size.rows == 0 || size.cols == 0 {
        return Err(AgentError::new(
            ErrorKind::InvalidRequest,
            format!(
                "a terminal of {} rows and {} columns: it needs at least one of each",
                size.rows, size.cols
            ),
        ));
    }
    Ok(())
}

pub(crate) fn set_size(master: RawFd, size: Size) -> io::Result<()> {
    let ws = libc::winsize {
        ws_row: size.rows,
        ws_col: size.cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCSWINSZ reads a winsize from a valid pointer.
    sys::cvt(unsafe { libc::ioctl(master, libc::TIOCSWINSZ, &ws) }).map(drop)
}

/// bash as a login shell (`-bash`, so it reads the profile and, through
/// Debian's `~/.profile`, `~/.bashrc`: prompt, colours, aliases); `sh`
/// where there is no bash.
fn login_shell() -> (&'static std::ffi::CStr, Vec<CString>) {
    if std::path::Path::new("/bin/bash").exists() {
        (c"/bin/bash", vec![c"-bash".to_owned()])
    } else {
        (c"/bin/sh", vec![c"-sh".to_owned()])
    }
}

// Terminals need root (the slave's owner) and a cgroup tree; the guest
// tests (`crates/cli/tests/e2e/terminal.rs`) cover them in a VM. What runs
// anywhere is checked here.
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_terminal_pair_takes_its_size() {
        // SAFETY: plain syscalls on our descriptors.
        let m = unsafe { libc::posix_openpt(libc::O_RDWR | libc::O_NOCTTY) };
        assert!(m >= 0);
        // SAFETY: new descriptor.
        let master = unsafe { OwnedFd::from_raw_fd(m) };
        set_size(
            master.as_raw_fd(),
            Size {
                rows: 33,
                cols: 101,
            },
        )
        .unwrap();
        let mut ws: libc::winsize = unsafe { std::mem::zeroed() };
        // SAFETY: TIOCGWINSZ writes a winsize.
        assert_eq!(unsafe { libc::ioctl(m, libc::TIOCGWINSZ, &mut ws) }, 0);
        assert_eq!((ws.ws_row, ws.ws_col), (33, 101));
    }
}
