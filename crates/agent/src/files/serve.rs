//! The user's side: the file server, and one request's process.
//!
//! In a VM the file server is the agent's binary started as the guest user
//! with [`PROCESS_ARG`]: one small single-threaded process whose stdin is a
//! socket from the agent. Each message on it carries one request's socket;
//! the server forks a process for it (a fork of a small single-threaded
//! process, no `execve`: a millisecond, where starting the binary anew took
//! tens under emulation), which reads the request, carries it out, answers
//! on the socket and exits. The server's children are reaped by the kernel
//! (SIGCHLD ignored); the server exits when the agent closes its socket.
//!
//! Where the agent is not root (in development, and in unit tests) a
//! request is served on a thread of the agent, as whoever the agent is.

use super::link::{self, Frame, Request};
use super::ops;
use nix::sys::socket::{recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags};
use sandpit_protocol::{AgentError, ErrorKind, CHUNK_LEN};
use std::io::{self, BufRead, BufReader, BufWriter, IoSlice, IoSliceMut, Write};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::net::UnixStream;

/// The argument that makes the agent's binary the file server.
pub const PROCESS_ARG: &str = "--file-server";

/// The longest request line taken (paths are at most 4 KiB each).
const MAX_REQUEST_LINE: u64 = 64 * 1024;

/// The file server's `main`: stdin is the agent's socket.
pub fn main() -> ! {
    // SAFETY: prctl with a NUL-terminated name of at most 16 bytes, and
    // signal() setting a disposition: plain syscalls.
    unsafe {
        // Its name in `ps` (exec'd through a descriptor, it would be the
        // descriptor's number).
        libc::prctl(libc::PR_SET_NAME, c"sandpit-files".as_ptr());
        // Its children are reaped by the kernel.
        libc::signal(libc::SIGCHLD, libc::SIG_IGN);
        // `execve` made the saved uid the effective one, the user's: back
        // to the real one, so that the user's processes may not signal
        // this one (see `user_process`).
        let real = libc::getuid();
        if real != libc::geteuid() {
            libc::setresuid(libc::uid_t::MAX, libc::uid_t::MAX, real);
            // Unequal uids left it non-dumpable, its `/proc` entries root's:
            // then a request could not read its own `/proc/self`, as any
            // process of the user's does. Dumpable, they are its effective
            // uid's, the user's; the kernel still lets nothing of the user's
            // attach to it or read its memory (that needs the real and saved
            // uids to be the user's too).
            libc::prctl(libc::PR_SET_DUMPABLE, 1);
        }
    }
    loop {
        let mut byte = [0u8; 1];
        let mut iov = [IoSliceMut::new(&mut byte)];
        let mut space = nix::cmsg_space!([RawFd; 1]);
        let received = recvmsg::<()>(0, &mut iov, Some(&mut space), MsgFlags::MSG_CMSG_CLOEXEC);
        let message = match received {
            Ok(m) => m,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(_) => std::process::exit(1),
        };
        if message.bytes == 0 {
            std::process::exit(0); // the agent closed its end
        }
        let Ok(cmsgs) = message.cmsgs() else {
            continue;
        };
        for cmsg in cmsgs {
            if let ControlMessageOwned::ScmRights(fds) = cmsg {
                for fd in fds {
                    // SAFETY: a descriptor this message gave us, owned by
                    // nothing else.
                    fork_for(unsafe { UnixStream::from_raw_fd(fd) });
                }
            }
        }
    }
}

/// Serve one request's socket in a child of its own.
fn fork_for(socket: UnixStream) {
    // SAFETY: the server is single-threaded: the child may do anything.
    match unsafe { nix::unistd::fork() } {
        Ok(nix::unistd::ForkResult::Child) => {
            // SAFETY: the server's socket, not this request's to hold.
            unsafe { libc::close(0) };
            let code = match serve(socket, Some(std::process::id())) {
                Ok(()) => 0,
                Err(_) => 1, // the agent's end is gone: nobody to tell
            };
            std::process::exit(code)
        }
        // The parent drops its copy; a failed fork drops the only one, and
        // the agent, hearing nothing, says so.
        Ok(nix::unistd::ForkResult::Parent { .. }) | Err(_) => drop(socket),
    }
}

/// Answer the one request that comes on `socket`: [`Frame::Started`]
/// (with `pid`, this process's), then what the request makes.
pub fn serve(socket: UnixStream, pid: Option<u32>) -> io::Result<()> {
    let peer = socket.as_raw_fd();
    let mut output = BufWriter::with_capacity(CHUNK_LEN + 64, socket.try_clone()?);
    link::write_frame(&mut output, &Frame::Started { pid })?;
    let mut input = BufReader::with_capacity(CHUNK_LEN, socket);
    let mut line = Vec::new();
    io::Read::take(&mut input, MAX_REQUEST_LINE).read_until(b'\n', &mut line)?;
    let request: Request = match serde_json::from_slice(line.trim_ascii_end()) {
        Ok(r) => r,
        Err(e) => {
            let refused = AgentError::new(
                ErrorKind::InvalidRequest,
                format!("the file process cannot read its request: {e}"),
            );
            return link::write_frame(&mut output, &Frame::Done(Err(refused)));
        }
    };
    let outcome = match request {
        Request::Read { path, max_bytes } => match ops::read_file(&mut output, &path, max_bytes) {
            Ok(ops::ReadOutcome::Sent(done)) => Ok(done),
            Ok(ops::ReadOutcome::Opened { file, size }) => {
                output.flush()?;
                return hand_over(peer, &Frame::Opened { path, size }, &file);
            }
            Err(e) => Err(e),
        },
        Request::Write {
            path,
            size,
            mode,
            sync,
        } => match ops::write_file(&path, size, mode, sync, &mut input) {
            // The upload was cut: its temporary file is gone, nobody waits.
            Ok(None) => return Ok(()),
            Ok(Some(done)) => Ok(done),
            Err(e) => Err(e),
        },
        Request::List {
            path,
            recursive,
            max_entries,
        } => ops::list(&path, recursive, max_entries),
        Request::Delete { path, recursive } => ops::delete(&path, recursive),
        Request::Path { call } => ops::path_call(call),
        Request::Watch { path, recursive } => {
            crate::watch::serve(&mut output, peer, &path, recursive)
        }
    };
    link::write_frame(&mut output, &Frame::Done(outcome))
}

/// Send `frame` on `socket` with `file`'s descriptor beside it.
fn hand_over(socket: RawFd, frame: &Frame, file: &std::fs::File) -> io::Result<()> {
    let bytes = link::encode_frame(frame);
    let fds = [file.as_raw_fd()];
    let mut sent = 0;
    while sent < bytes.len() {
        // The descriptor goes with the first piece only.
        let rights = [ControlMessage::ScmRights(&fds)];
        let cmsgs: &[ControlMessage<'_>] = if sent == 0 { &rights } else { &[] };
        match sendmsg::<()>(
            socket,
            &[IoSlice::new(&bytes[sent..])],
            cmsgs,
            MsgFlags::MSG_NOSIGNAL,
            None,
        ) {
            Ok(n) => sent += n,
            Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(io::Error::from(e)),
        }
    }
    Ok(())
}
