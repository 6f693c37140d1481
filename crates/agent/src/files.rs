//! File requests: write, read, list, delete, stat, make and move, and the
//! watches (see `watch`), each carried out by the guest user's own process.
//!
//! The agent is PID 1 and root; what a file request does must be exactly
//! what the sandbox's user could do, decided by the kernel and nothing else.
//! Switching a thread's filesystem credentials to the user is not enough:
//! the thread is still in the agent's thread group, and the kernel lets a
//! process read its own `/proc/<pid>` files (memory maps, descriptors, its
//! binary) whatever its credentials, so `/proc/1/…` and `/proc/self/…`
//! answered for the agent. So each request runs in a process of its own,
//! started as the user as the user's commands are (`user_process`); that
//! process opens, lists, reads, writes and removes (`ops`, `serve`), and
//! the agent relays what it answers (`link`): a read's data under the
//! host's send window, a write's data from the host, the outcome.
//!
//! Paths are resolved here first (relative to the workspace, `..` folded:
//! `resolve_guest_path`), so a malformed one is refused without a process.

pub(crate) mod link;
mod ops;
mod serve;
mod user_process;

pub use serve::{main as process_main, PROCESS_ARG};
pub use user_process::run_in_user_processes;

use crate::channel::Reply;
use crate::sys::{self, lock};
use crate::window::SendWindow;
use link::{Frame, Request};
use sandpit_protocol::{
    resolve_guest_path, AgentError, DoneResult, ErrorKind, Message, PathCall, RequestId,
};
use std::collections::HashMap;
use std::fs;
use std::io;
use std::path::Path;
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use user_process::UserProcess;

/// The text of an OS error without std's " (os error N)" suffix.
fn strerror(e: &io::Error) -> String {
    let s = e.to_string();
    match s.find(" (os error ") {
        Some(i) => s[..i].to_string(),
        None => s,
    }
}

/// Map an I/O error on `what` (usually a path) to a protocol error.
pub fn io_error(e: &io::Error, what: &str) -> AgentError {
    let kind = match sys::errno(e) {
        libc::ENOENT => ErrorKind::NotFound,
        libc::EISDIR => ErrorKind::IsADirectory,
        libc::ENOTDIR => ErrorKind::NotADirectory,
        libc::EACCES | libc::EPERM => ErrorKind::PermissionDenied,
        libc::EEXIST => ErrorKind::AlreadyExists,
        _ => ErrorKind::Io,
    };
    AgentError::new(kind, format!("{what}: {}", strerror(e)))
}

/// How long a request's process may go without answering anything: a
/// listing, a stat or a removal (a large tree takes a while under
/// emulation), or the next piece of a read.
const PATIENCE: Duration = Duration::from_secs(600);

/// How long a read waits for the host to acknowledge data before it gives
/// up (the host consumes as its client reads; a host gone for good never
/// acks), and a write for its process to take the next piece.
const ACK_PATIENCE: Duration = Duration::from_secs(120);

/// How long a cut write's process gets to remove its temporary file.
const CUT_PATIENCE: Duration = Duration::from_secs(10);

/// A frame no request of this kind answers with.
pub(crate) fn unexpected(frame: &Frame) -> AgentError {
    let what = match frame {
        Frame::Started { .. } => "its start",
        Frame::Info { .. } | Frame::Opened { .. } => "a file's size",
        Frame::Data(_) => "data",
        Frame::Watching { .. } | Frame::Events(_) => "a watch's frames",
        Frame::Done(_) => "an outcome",
    };
    AgentError::new(
        ErrorKind::Io,
        format!("the file request's process answered with {what} out of turn"),
    )
}

/// Run a request that answers with its outcome alone.
fn call(request: Request) -> Result<DoneResult, AgentError> {
    let mut process = UserProcess::start(&request)?;
    match process.next_frame(PATIENCE)? {
        Frame::Done(outcome) => outcome,
        other => Err(unexpected(&other)),
    }
}

// ---- write ------------------------------------------------------------

/// Write `size` bytes arriving on `data` to `path`. `Ok(None)` means the
/// session ended before all data arrived (nothing is written, nobody to tell).
pub fn write_file(
    path: &str,
    size: u64,
    mode: Option<u32>,
    data: Receiver<Vec<u8>>,
) -> Result<Option<DoneResult>, AgentError> {
    let path = resolve_guest_path(path)?;
    // On a volume, written means on its device: it outlives this VM.
    let sync = crate::volumes::holds(Path::new(&path));
    let mut process = UserProcess::start(&Request::Write {
        path,
        size,
        mode,
        sync,
    })?;
    let mut written: u64 = 0;
    while written < size {
        let Ok(chunk) = data.recv() else {
            process.end_input();
            process.wait_end(CUT_PATIENCE);
            return Ok(None);
        };
        written += chunk.len() as u64;
        if written > size {
            process.end_input();
            process.wait_end(CUT_PATIENCE);
            return Err(AgentError::new(
                ErrorKind::InvalidRequest,
                format!("received more than the announced {size} bytes"),
            ));
        }
        if process.write_input(&chunk, ACK_PATIENCE).is_err() {
            // It stopped taking data: its answer says why.
            break;
        }
    }
    process.end_input();
    match process.next_frame(PATIENCE)? {
        Frame::Done(outcome) => outcome.map(Some),
        other => Err(unexpected(&other)),
    }
}

// ---- read -------------------------------------------------------------

/// The send window of each read the host gave one (see
/// [`Message::ReadFile`]).
static READS: Mutex<Option<HashMap<RequestId, Arc<SendWindow>>>> = Mutex::new(None);

/// Registers a read whose send window starts at `window` bytes.
pub fn open_read(id: RequestId, window: u32) -> Arc<SendWindow> {
    let send_window = Arc::new(SendWindow::new(window.into()));
    lock(&READS)
        .get_or_insert_with(HashMap::new)
        .insert(id, send_window.clone());
    send_window
}

/// The host consumed `bytes` of read `id`.
pub fn ack_read(id: RequestId, bytes: u32) {
    if let Some(c) = lock(&READS).as_ref().and_then(|r| r.get(&id)) {
        c.add(bytes.into());
    }
}

/// Read `id` is over (done, or cancelled by the host: it stops sending).
/// Whether it was still open.
pub fn close_read(id: RequestId) -> bool {
    match lock(&READS).as_mut().and_then(|r| r.remove(&id)) {
        Some(c) => {
            c.close();
            true
        }
        None => false,
    }
}

/// Send a file: `FileInfo`, `FileData` chunks, `Done{Read}`; with `send_window`,
/// never more data than the host granted and has not acknowledged.
pub fn read_file(
    reply: &Reply,
    id: RequestId,
    path: &str,
    max_bytes: u64,
    send_window: Option<&SendWindow>,
) -> Result<(), AgentError> {
    let path = resolve_guest_path(path)?;
    let mut process = UserProcess::start(&Request::Read { path, max_bytes })?;
    loop {
        if !reply.is_current() {
            return Ok(()); // the session ended: nobody to send to
        }
        match process.next_frame(PATIENCE)? {
            Frame::Info { path, size } => {
                reply.send(&Message::FileInfo { id, path, size }, &[]);
            }
            Frame::Data(bytes) => {
                let mut rest = &bytes[..];
                while !rest.is_empty() {
                    let n = match send_window {
                        Some(w) => match w.take_within(rest.len(), Some(ACK_PATIENCE)) {
                            Some(n) => n,
                            // Cancelled, or the host stopped taking it.
                            None => return Ok(()),
                        },
                        None => rest.len(),
                    };
                    reply.send(&Message::FileData { id }, &rest[..n]);
                    rest = &rest[n..];
                }
            }
            Frame::Opened { path, size } => {
                let file = process.take_descriptor().ok_or_else(|| {
                    AgentError::new(ErrorKind::Io, "the file process's descriptor did not come")
                })?;
                return send_opened(reply, id, path, size, fs::File::from(file), send_window);
            }
            Frame::Done(outcome) => {
                reply.done(id, outcome?);
                return Ok(());
            }
            other => return Err(unexpected(&other)),
        }
    }
}

/// Send a file the user's process opened and handed over: `FileInfo`,
/// `FileData` chunks under the send window, `Done{Read}`.
fn send_opened(
    reply: &Reply,
    id: RequestId,
    path: String,
    size: u64,
    mut file: fs::File,
    send_window: Option<&SendWindow>,
) -> Result<(), AgentError> {
    use std::io::Read;
    reply.send(
        &Message::FileInfo {
            id,
            path: path.clone(),
            size,
        },
        &[],
    );
    let mut buf = vec![0u8; sandpit_protocol::CHUNK_LEN.min(size as usize).max(1)];
    let mut sent: u64 = 0;
    while sent < size {
        if !reply.is_current() {
            return Ok(()); // the session ended: nobody to send to
        }
        let mut want = (size - sent).min(buf.len() as u64) as usize;
        if let Some(w) = send_window {
            match w.take_within(want, Some(ACK_PATIENCE)) {
                Some(n) => want = n,
                // Cancelled, or the host stopped taking it.
                None => return Ok(()),
            }
        }
        let n = match file.read(&mut buf[..want]) {
            Ok(0) => break, // the file shrank meanwhile
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {
                if let Some(w) = send_window {
                    w.add(want as u64);
                }
                continue;
            }
            Err(e) => return Err(io_error(&e, &path)),
        };
        if let Some(w) = send_window {
            // Window taken for bytes the file did not have goes back.
            w.add((want - n) as u64);
        }
        reply.send(&Message::FileData { id }, &buf[..n]);
        sent += n as u64;
    }
    reply.done(id, DoneResult::Read { path, bytes: sent });
    Ok(())
}

// ---- list, delete, calls on paths --------------------------------------

/// List a directory, or describe a single non-directory.
pub fn list(path: &str, recursive: bool, max_entries: u64) -> Result<DoneResult, AgentError> {
    call(Request::List {
        path: resolve_guest_path(path)?,
        recursive,
        max_entries,
    })
}

/// Delete a file, symlink, empty directory, or (recursive) a whole tree.
pub fn delete(path: &str, recursive: bool) -> Result<DoneResult, AgentError> {
    call(Request::Delete {
        path: resolve_guest_path(path)?,
        recursive,
    })
}

/// A [`PathCall`]: the kernel decides what the user may see, make and move.
pub fn path_call(call_: PathCall) -> Result<DoneResult, AgentError> {
    let call_ = match call_ {
        PathCall::Stat { path } => PathCall::Stat {
            path: resolve_guest_path(&path)?,
        },
        PathCall::MakeDir { path } => PathCall::MakeDir {
            path: resolve_guest_path(&path)?,
        },
        PathCall::Move { from, to } => PathCall::Move {
            from: resolve_guest_path(&from)?,
            to: resolve_guest_path(&to)?,
        },
    };
    call(Request::Path { call: call_ })
}

/// A watch's process: its frames until it is killed (see `watch`).
pub fn start_watch(path: &str, recursive: bool) -> Result<WatchProcess, AgentError> {
    let process = UserProcess::start(&Request::Watch {
        path: resolve_guest_path(path)?,
        recursive,
    })?;
    Ok(WatchProcess(process))
}

/// What a watch's process says.
pub enum WatchFrame {
    Watching { path: String },
    Events(Vec<sandpit_protocol::WatchEvent>),
}

/// A running watch's process; killed when dropped.
pub struct WatchProcess(UserProcess);

impl WatchProcess {
    /// Its answers, for polling beside the watch's stop.
    pub fn fd(&self) -> std::os::fd::RawFd {
        self.0.output_fd()
    }

    /// The next frame, once [`Self::fd`] is readable; the watch's end is an
    /// error saying why.
    pub fn next(&mut self) -> Result<WatchFrame, AgentError> {
        match self.0.next_frame(PATIENCE)? {
            Frame::Watching { path } => Ok(WatchFrame::Watching { path }),
            Frame::Events(events) => Ok(WatchFrame::Events(events)),
            Frame::Done(Err(e)) => Err(e),
            other => Err(unexpected(&other)),
        }
    }
}

#[cfg(test)]
mod tests;
