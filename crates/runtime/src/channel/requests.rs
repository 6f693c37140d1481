//! The handles of requests in flight on the agent channel: a command
//! running ([`ExecHandle`]), a file going up ([`FileUpload`]) or coming down
//! ([`GuestDownload`]). Each holds its request's id and the receiving end
//! of its frames; dropped before its answer, it cancels the request.

use super::{next_frame, unexpected, Inner, EXEC_GRACE, REPLY_DEADLINE};
use crate::{Result, RuntimeError};
use sandpit_protocol::{
    AgentError, DoneResult, ErrorKind, ExecResult, Frame, Message, RequestId, CHUNK_LEN,
};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use tokio::sync::mpsc;

/// Most output of one command held in the host for a follower that has not
/// taken it yet. A command that keeps running streams all it writes (the
/// agent holds back nothing), so a follower slower than the command would
/// otherwise let it pile up here without end; past this much waiting, the
/// reader drops what comes and the command's end says its output was cut.
pub const OUTPUT_BACKLOG_BYTES: u64 = 16 * 1024 * 1024;

/// The output of one followed command waiting in its queue: counted by the
/// connection's reader as it queues a piece, and by the [`ExecHandle`] as
/// it takes it.
#[derive(Default)]
pub(crate) struct OutputBacklog {
    bytes: AtomicU64,
    /// Pieces of stdout (or of a watch's events), and of stderr, dropped.
    dropped: [AtomicBool; 2],
}

impl OutputBacklog {
    /// Whether a piece of `len` bytes may be queued for stream `stream`
    /// (0: stdout, or a watch's events; 1: stderr); counts it if so, notes
    /// the loss if not.
    pub(crate) fn admit(&self, len: usize, stream: usize) -> bool {
        let len = len as u64;
        let admitted = self
            .bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |queued| {
                (queued.saturating_add(len) <= OUTPUT_BACKLOG_BYTES).then(|| queued + len)
            })
            .is_ok();
        if !admitted {
            self.dropped[stream.min(1)].store(true, Ordering::Release);
        }
        admitted
    }

    /// A piece of `len` bytes was taken from the queue.
    pub(super) fn taken(&self, len: usize) {
        let _ = self
            .bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |queued| {
                Some(queued.saturating_sub(len as u64))
            });
    }

    /// Whether stdout and stderr lost pieces here.
    pub(super) fn dropped(&self) -> (bool, bool) {
        (
            self.dropped[0].load(Ordering::Acquire),
            self.dropped[1].load(Ordering::Acquire),
        )
    }
}

/// An event of a running command.
#[derive(Debug, Clone, PartialEq)]
pub enum GuestExecEvent {
    /// The command's pid: the first event of a command that keeps running
    /// ([`ExecRequest::keep_running`]) and of one attached to
    /// ([`AgentClient::attach`]); other commands do not give it.
    Started(u32),
    Stdout(Vec<u8>),
    Stderr(Vec<u8>),
    Exited(ExecResult),
}

/// A command running in the guest. Dropping it before it exits cancels it
/// (one that keeps running, or was attached to, is only no longer followed).
pub struct ExecHandle {
    pub(super) id: RequestId,
    pub(super) inner: Arc<Inner>,
    pub(super) rx: mpsc::UnboundedReceiver<Frame>,
    pub(super) finished: bool,
    /// Its first event is its pid ([`GuestExecEvent::Started`]).
    pub(super) announced: bool,
    /// Output still to be taken, per stream (`max_output_bytes` of the
    /// request): the guest's agent keeps to it, and the host holds a guest
    /// that does not to it as well.
    pub(super) stdout_left: u64,
    pub(super) stderr_left: u64,
    /// Output the guest sent past those.
    pub(super) cut: (bool, bool),
    /// Its output waiting to be taken (see [`OUTPUT_BACKLOG_BYTES`]).
    pub(super) backlog: Arc<OutputBacklog>,
    /// The command's own timeout plus [`EXEC_GRACE`].
    pub(super) deadline: tokio::time::Instant,
}

impl ExecHandle {
    /// The next event; `Exited` is the last one.
    pub async fn next(&mut self) -> Result<GuestExecEvent> {
        if self.finished {
            return Err(RuntimeError::Disconnected(
                "the command already exited".into(),
            ));
        }
        let frame = loop {
            let frame = match tokio::time::timeout_at(self.deadline, self.rx.recv()).await {
                Ok(Some(frame)) => frame,
                Ok(None) => {
                    return Err(RuntimeError::Disconnected(
                        "the agent connection closed while the command ran".into(),
                    ))
                }
                Err(_) => {
                    // The guest never reported the end: give up on it (and
                    // ask it once more to kill the command).
                    self.cancel();
                    self.finished = true;
                    return Err(RuntimeError::AgentTimeout {
                        what: "the end of a command past its timeout".into(),
                        secs: EXEC_GRACE.as_secs(),
                    });
                }
            };
            // Agents of older builds announce every start; only one asked
            // for is passed on.
            if self.announced || !matches!(frame.message, Message::Started { .. }) {
                break frame;
            }
        };
        if matches!(
            frame.message,
            Message::Stdout { .. } | Message::Stderr { .. }
        ) {
            self.backlog.taken(frame.body.len());
        }
        match frame.message {
            Message::Started { pid, .. } => Ok(GuestExecEvent::Started(pid)),
            Message::Stdout { .. } => Ok(GuestExecEvent::Stdout(take_within(
                frame.body,
                &mut self.stdout_left,
                &mut self.cut.0,
            ))),
            Message::Stderr { .. } => Ok(GuestExecEvent::Stderr(take_within(
                frame.body,
                &mut self.stderr_left,
                &mut self.cut.1,
            ))),
            Message::Exited { mut result, .. } => {
                self.finished = true;
                let dropped = self.backlog.dropped();
                result.stdout_truncated |= self.cut.0 || dropped.0;
                result.stderr_truncated |= self.cut.1 || dropped.1;
                Ok(GuestExecEvent::Exited(result))
            }
            Message::Error { error, .. } => {
                self.finished = true;
                Err(RuntimeError::Agent(error))
            }
            other => Err(RuntimeError::Disconnected(format!(
                "unexpected message for a command: {other:?}"
            ))),
        }
    }

    /// Ask the guest to kill the command; its `Exited` follows with `cancelled`.
    pub fn cancel(&self) {
        let _ = self.inner.send(&Message::Cancel { id: self.id }, &[]);
    }
}

/// What of `body` fits in `left` bytes (which it uses up); `cut` is set when
/// anything was left out.
fn take_within(mut body: Vec<u8>, left: &mut u64, cut: &mut bool) -> Vec<u8> {
    if body.len() as u64 > *left {
        body.truncate(*left as usize);
        *cut = true;
    }
    *left -= body.len() as u64;
    body
}

impl Drop for ExecHandle {
    fn drop(&mut self) {
        if !self.finished {
            self.cancel();
        }
        self.inner.forget(self.id);
    }
}

/// A file being written to the guest a piece at a time (see
/// [`AgentClient::upload`]). Dropped before its answer, it is cancelled: the
/// guest discards what it had.
pub struct FileUpload {
    pub(super) id: RequestId,
    pub(super) inner: Arc<Inner>,
    pub(super) rx: mpsc::UnboundedReceiver<Frame>,
    pub(super) size: u64,
    pub(super) sent: u64,
    pub(super) answered: bool,
}

impl FileUpload {
    /// Send the next piece. Waits while the guest has more than
    /// [`STREAM_HIGH_WATER`] bytes to read, so the host holds one piece of
    /// an upload however big the file. Fails at once when the guest has
    /// already refused the write (a directory, no permission).
    pub async fn send(&mut self, data: &[u8]) -> Result<()> {
        if self.sent + data.len() as u64 > self.size {
            return Err(RuntimeError::Agent(AgentError::new(
                ErrorKind::InvalidRequest,
                format!("more than the announced {} bytes", self.size),
            )));
        }
        for chunk in data.chunks(CHUNK_LEN) {
            if let Ok(frame) = self.rx.try_recv() {
                self.answered = true;
                return Err(match frame.message {
                    Message::Error { error, .. } => RuntimeError::Agent(error),
                    other => unexpected(other),
                });
            }
            self.inner.room().await?;
            self.inner.send(&Message::FileData { id: self.id }, chunk)?;
            self.sent += chunk.len() as u64;
        }
        Ok(())
    }

    /// All of it was sent: wait for the guest's answer. Returns the
    /// resolved path and the byte count.
    pub async fn finish(mut self) -> Result<(String, u64)> {
        if self.sent != self.size {
            return Err(RuntimeError::Agent(AgentError::new(
                ErrorKind::InvalidRequest,
                format!(
                    "the upload ended after {} of its {} bytes",
                    self.sent, self.size
                ),
            )));
        }
        let deadline = tokio::time::Instant::now() + REPLY_DEADLINE;
        let frame = next_frame(&mut self.rx, deadline, "a file write").await?;
        self.answered = true;
        match frame.message {
            Message::Done {
                result: DoneResult::Written { path, bytes },
                ..
            } => Ok((path, bytes)),
            Message::Error { error, .. } => Err(RuntimeError::Agent(error)),
            other => Err(unexpected(other)),
        }
    }
}

impl Drop for FileUpload {
    fn drop(&mut self) {
        if !self.answered {
            let _ = self.inner.send(&Message::Cancel { id: self.id }, &[]);
        }
        self.inner.pending.lock().unwrap().remove(&self.id);
    }
}

/// A file being read from the guest (see [`AgentClient::download`]).
pub struct GuestDownload {
    pub(super) id: RequestId,
    pub(super) inner: Arc<Inner>,
    pub(super) rx: mpsc::UnboundedReceiver<Frame>,
    pub(super) path: String,
    pub(super) size: u64,
    pub(super) received: u64,
    pub(super) max_bytes: u64,
    pub(super) ended: bool,
}

impl GuestDownload {
    /// The file's resolved path.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// Its size when the guest opened it.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Each frame is owed within the deadline: a big file that keeps
    /// coming is fine, a guest that stops sending is not.
    pub(super) async fn next_frame(&mut self) -> Result<Frame> {
        let deadline = tokio::time::Instant::now() + REPLY_DEADLINE;
        next_frame(&mut self.rx, deadline, "a file read").await
    }

    /// The next piece of the content; `None` after the last.
    pub async fn next_chunk(&mut self) -> Result<Option<Vec<u8>>> {
        if self.ended {
            return Ok(None);
        }
        let frame = self.next_frame().await.inspect_err(|_| self.ended = true)?;
        match frame.message {
            Message::FileData { .. } => {
                self.received += frame.body.len() as u64;
                // Taken: the guest may send as much again.
                let ack = Message::FileAck {
                    id: self.id,
                    bytes: frame.body.len() as u32,
                };
                let _ = self.inner.send(&ack, &[]);
                if self.received > self.max_bytes {
                    self.ended = true;
                    return Err(RuntimeError::Agent(AgentError::new(
                        ErrorKind::TooLarge,
                        format!(
                            "the file grew past the {}-byte read limit while being read",
                            self.max_bytes
                        ),
                    )));
                }
                Ok(Some(frame.body))
            }
            Message::Done {
                result: DoneResult::Read { .. },
                ..
            } => {
                self.ended = true;
                Ok(None)
            }
            Message::Error { error, .. } => {
                self.ended = true;
                Err(RuntimeError::Agent(error))
            }
            other => {
                self.ended = true;
                Err(unexpected(other))
            }
        }
    }
}

impl Drop for GuestDownload {
    fn drop(&mut self) {
        if !self.ended {
            // Nobody takes the rest: the guest stops sending it.
            let _ = self.inner.send(&Message::Cancel { id: self.id }, &[]);
        }
        self.inner.pending.lock().unwrap().remove(&self.id);
    }
}

/// Output of a command collected whole.
#[derive(Debug, Clone)]
pub struct ExecOutput {
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub result: ExecResult,
}
