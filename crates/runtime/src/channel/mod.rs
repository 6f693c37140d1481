//! The host end of the agent channel: one connection to a guest's agent over
//! QEMU's virtio-serial chardev socket, multiplexing many requests at once.
//!
//! A reader task decodes frames and routes each to the request it answers (by
//! id); a writer task owns the socket's write half, so callers never block one
//! another and a request dropped half-way can still queue its `Cancel`. The
//! session starts with `Hello{nonce}`; everything before the `HelloAck` that
//! echoes our nonce is discarded, because the port may hold bytes an earlier
//! host connection left behind.
//!
//! Nothing the guest does (or fails to do) can hold a caller for ever: every
//! request has a deadline ([`REPLY_DEADLINE`] for each answer it waits for; a
//! command its own timeout plus [`EXEC_GRACE`]), after which it fails with
//! [`RuntimeError::AgentTimeout`] and its late answer is dropped. And nothing
//! is sent that the agent would refuse unread: a message over the frame
//! limits fails here, typed, before it is queued.

pub mod clock;
mod requests;
pub mod terminal;
pub mod tunnel;
pub mod volumes;
pub mod watch;

pub(crate) use requests::OutputBacklog;
pub use requests::{ExecHandle, ExecOutput, FileUpload, GuestDownload, GuestExecEvent};

use crate::{Result, RuntimeError};
use sandpit_protocol::{
    encode_frame, AgentError, DoneResult, ErrorKind, ExecRequest, FileEntry, Frame, FrameDecoder,
    GuestConfig, GuestStats, Message, PathCall, PathEntry, ProcessCall, ProcessInfo, RequestId,
    CHUNK_LEN, FRAME_MAGIC, HEADER_PREFIX_LEN, MAX_BODY_LEN, MAX_HEADER_LEN, PROTOCOL_GENERATION,
};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::sync::mpsc;

/// How long the host waits for each answer the agent owes it (a reply, the
/// next chunk of a file).
pub const REPLY_DEADLINE: Duration = Duration::from_secs(30);
/// How long past its own timeout a command may take to report its exit.
pub const EXEC_GRACE: Duration = Duration::from_secs(30);

/// Wait for the next frame of a request, until `deadline`.
pub(crate) async fn next_frame(
    rx: &mut mpsc::UnboundedReceiver<Frame>,
    deadline: tokio::time::Instant,
    what: &str,
) -> Result<Frame> {
    match tokio::time::timeout_at(deadline, rx.recv()).await {
        Ok(Some(frame)) => Ok(frame),
        Ok(None) => Err(RuntimeError::Disconnected(format!(
            "the agent connection closed during {what}"
        ))),
        Err(_) => Err(RuntimeError::AgentTimeout {
            what: what.to_string(),
            secs: REPLY_DEADLINE.as_secs(),
        }),
    }
}

/// Connect to a unix socket QEMU serves. QEMU binds it a moment before it
/// listens, and a connect in between is refused: that is retried for up to
/// a second.
///
/// The socket is named through a descriptor of its directory
/// ([`short_socket_name`]), never by its whole path: a socket's address
/// holds at most 107 bytes, and a data directory's path may be longer.
pub(crate) async fn connect_qemu_socket(path: &Path) -> std::io::Result<UnixStream> {
    let (_dir, short) = short_socket_name(path)?;
    let mut refused = 0;
    loop {
        match UnixStream::connect(&short).await {
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused && refused < 200 => {
                refused += 1;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            other => return other,
        }
    }
}

/// A name of the socket at `path` that fits a socket address whatever the
/// length of `path`: `/proc/self/fd/N/NAME`, where N is the returned
/// descriptor of the socket's directory (`O_PATH`), valid while it is open.
/// A socket is reached by the file it is bound to (its inode), so any name
/// that resolves to that file connects to it.
pub(crate) fn short_socket_name(path: &Path) -> std::io::Result<(std::fs::File, PathBuf)> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{} names no socket in a directory", path.display()),
        ));
    };
    let dir = match dir.as_os_str().is_empty() {
        true => Path::new("."),
        false => dir,
    };
    let dir = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC)
        .open(dir)?;
    let short = PathBuf::from(format!("/proc/self/fd/{}", dir.as_raw_fd())).join(name);
    Ok((dir, short))
}

/// What the agent said about itself in the handshake.
#[derive(Debug, Clone)]
pub struct AgentInfo {
    pub protocol: u32,
    pub agent_version: String,
    pub kernel_release: String,
    pub hostname: String,
    /// What it can do beyond generation 1 as first frozen
    /// ([`sandpit_protocol::FEATURES`]).
    pub features: Vec<String>,
}

/// Bytes queued for a guest that is not reading them, at most: past it a
/// send fails (`Busy`) instead of the host holding more and more for it.
pub const OUT_QUEUE_LIMIT: u64 = 96 * 1024 * 1024;

/// Bytes queued for the guest past which a streamed upload
/// ([`FileUpload`]) waits for the guest to read before it sends more: what
/// an upload holds in the host is its chunk, whatever the file's size.
pub const STREAM_HIGH_WATER: u64 = 4 * 1024 * 1024;

/// Bytes of a file read the guest may send before the host acknowledges
/// them ([`Message::FileAck`], sent as [`GuestDownload::next_chunk`] hands
/// pieces on): what waits in the host for a slow reader of one download.
pub const READ_WINDOW: u32 = 1024 * 1024;

/// Frames this small (cancels, acks, closes, most requests) are queued
/// whatever is already queued, so a full queue never loses a cancel.
const ALWAYS_QUEUED: u64 = 4096;

pub(crate) struct Inner {
    out: mpsc::UnboundedSender<Vec<u8>>,
    /// Bytes in `out` not yet written to the guest.
    queued: Arc<AtomicU64>,
    /// Told whenever the writer wrote something (or the connection ended).
    drained: Arc<tokio::sync::Notify>,
    pub(crate) pending: Mutex<HashMap<RequestId, mpsc::UnboundedSender<Frame>>>,
    /// The send windows of open tunnel streams; `TunnelAck`s go here directly, so
    /// a writer learns its window grew even while nobody reads its stream.
    pub(crate) windows: Mutex<HashMap<RequestId, Arc<crate::channel::tunnel::SendWindow>>>,
    /// The output queued for each command followed ([`ExecHandle`]), so the
    /// reader drops what a slow follower would let pile up in the host.
    pub(crate) backlogs: Mutex<HashMap<RequestId, Arc<OutputBacklog>>>,
    next_id: AtomicU64,
    pub(crate) closed: AtomicBool,
    /// The reader and writer tasks, so `close` can end the connection while
    /// clones of the client still exist.
    tasks: Mutex<Vec<tokio::task::AbortHandle>>,
}

impl Inner {
    /// The connection is over: every request and tunnel stream fails now.
    fn hang_up(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.drained.notify_waiters();
        self.pending.lock().unwrap().clear();
        for (_, c) in self.windows.lock().unwrap().drain() {
            c.close();
        }
        self.backlogs.lock().unwrap().clear();
    }

    /// Request `id` is over: its frames and its backlog go.
    pub(crate) fn forget(&self, id: RequestId) {
        self.pending.lock().unwrap().remove(&id);
        self.backlogs.lock().unwrap().remove(&id);
    }

    pub(crate) fn send(&self, message: &Message, body: &[u8]) -> Result<()> {
        self.send_all(vec![Self::frame(message, body)?])
    }

    /// Queue `frames` together, or none of them when the guest has more
    /// than [`OUT_QUEUE_LIMIT`] waiting already.
    pub(crate) fn send_all(&self, frames: Vec<Vec<u8>>) -> Result<()> {
        let total: u64 = frames.iter().map(|f| f.len() as u64).sum();
        let queued = self.queued.fetch_add(total, Ordering::SeqCst) + total;
        if total > ALWAYS_QUEUED && queued > OUT_QUEUE_LIMIT {
            self.queued.fetch_sub(total, Ordering::SeqCst);
            return Err(RuntimeError::Busy(format!(
                "the sandbox is not reading what it is sent ({} MiB are waiting for it); \
                 try again later",
                (queued - total) >> 20
            )));
        }
        for frame in frames {
            if self.out.send(frame).is_err() {
                return Err(RuntimeError::Disconnected(
                    "the connection is closed".into(),
                ));
            }
        }
        Ok(())
    }

    /// Wait until fewer than [`STREAM_HIGH_WATER`] bytes wait for the
    /// guest. A guest that reads nothing for [`REPLY_DEADLINE`] fails it.
    async fn room(&self) -> Result<()> {
        let deadline = tokio::time::Instant::now() + REPLY_DEADLINE;
        loop {
            let drained = self.drained.notified();
            tokio::pin!(drained);
            drained.as_mut().enable();
            if self.closed.load(Ordering::SeqCst) {
                return Err(RuntimeError::Disconnected(
                    "the connection is closed".into(),
                ));
            }
            if self.queued.load(Ordering::SeqCst) < STREAM_HIGH_WATER {
                return Ok(());
            }
            if tokio::time::timeout_at(deadline, drained).await.is_err() {
                return Err(RuntimeError::AgentTimeout {
                    what: "the sandbox to take more of a file".into(),
                    secs: REPLY_DEADLINE.as_secs(),
                });
            }
        }
    }

    /// One frame of `message` and `body`, checked against the frame limits.
    pub(crate) fn frame(message: &Message, body: &[u8]) -> Result<Vec<u8>> {
        let frame = encode_frame(message, body);
        let header_len = frame.len() - HEADER_PREFIX_LEN - body.len();
        if header_len > MAX_HEADER_LEN || body.len() > MAX_BODY_LEN {
            return Err(RuntimeError::Agent(AgentError::new(
                ErrorKind::TooLarge,
                format!(
                    "the request is {} bytes, over the {MAX_HEADER_LEN}-byte limit of one message to the sandbox",
                    header_len.max(body.len())
                ),
            )));
        }
        Ok(frame)
    }
}

/// A live connection to one guest agent. Cheap to clone.
#[derive(Clone)]
pub struct AgentClient {
    inner: Arc<Inner>,
    info: Arc<AgentInfo>,
}

impl AgentClient {
    /// Connect to the agent socket and complete the handshake within `timeout`
    /// (which is also how long a booting guest has to come up).
    pub async fn connect(socket: &Path, timeout: Duration) -> Result<AgentClient> {
        let stream = connect_qemu_socket(socket)
            .await
            .map_err(RuntimeError::io(format!(
                "connecting to the agent socket {}",
                socket.display()
            )))?;
        let (mut rd, mut wr) = stream.into_split();
        let nonce: u64 = rand::random();
        wr.write_all(&encode_frame(
            &Message::Hello {
                protocol: PROTOCOL_GENERATION,
                nonce,
            },
            &[],
        ))
        .await
        .map_err(RuntimeError::io("sending the handshake"))?;

        let mut decoder = FrameDecoder::new();
        let mut buf = vec![0u8; 64 * 1024];
        let handshake = async {
            // Leftovers of an earlier connection come first, maybe a frame
            // cut short: the ack is looked for at every frame start, not
            // after what their lengths claim (the agent sends it once).
            let mut before = Vec::new();
            loop {
                if let Some((message, end)) = find_ack(&before, nonce) {
                    // What came after the ack is the session's.
                    decoder.push(&before[end..]);
                    if let Message::HelloAck {
                        protocol,
                        agent_version,
                        kernel_release,
                        hostname,
                        features,
                        ..
                    } = message
                    {
                        return Ok(AgentInfo {
                            protocol,
                            agent_version,
                            kernel_release,
                            hostname,
                            features,
                        });
                    }
                }
                let n = rd.read(&mut buf).await.map_err(|e| {
                    RuntimeError::Disconnected(format!("reading the handshake: {e}"))
                })?;
                if n == 0 {
                    return Err(RuntimeError::Disconnected(
                        "the VM closed the agent channel during the handshake".into(),
                    ));
                }
                before.extend_from_slice(&buf[..n]);
                // The ack is not larger than this; older bytes are leftovers.
                let keep = HEADER_PREFIX_LEN + MAX_HEADER_LEN;
                if before.len() > 2 * keep {
                    before.drain(..before.len() - keep);
                }
            }
        };
        let info = match tokio::time::timeout(timeout, handshake).await {
            Ok(r) => r?,
            Err(_) => {
                return Err(RuntimeError::BootTimeout {
                    secs: timeout.as_secs(),
                    console_tail: String::new(),
                })
            }
        };
        if info.protocol != PROTOCOL_GENERATION {
            return Err(RuntimeError::ProtocolMismatch {
                host: PROTOCOL_GENERATION,
                guest: info.protocol,
            });
        }

        let (out_tx, mut out_rx) = mpsc::unbounded_channel::<Vec<u8>>();
        let queued = Arc::new(AtomicU64::new(0));
        let written = queued.clone();
        let drained = Arc::new(tokio::sync::Notify::new());
        let told = drained.clone();
        let inner = Arc::new(Inner {
            out: out_tx,
            queued,
            drained,
            pending: Mutex::new(HashMap::new()),
            backlogs: Mutex::new(HashMap::new()),
            windows: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            closed: AtomicBool::new(false),
            tasks: Mutex::new(Vec::new()),
        });
        let writer = tokio::spawn(async move {
            while let Some(bytes) = out_rx.recv().await {
                if wr.write_all(&bytes).await.is_err() {
                    break;
                }
                written.fetch_sub(bytes.len() as u64, Ordering::SeqCst);
                told.notify_waiters();
            }
        });
        let reader_inner = inner.clone();
        let reader = tokio::spawn(async move {
            loop {
                loop {
                    match decoder.next_frame() {
                        Ok(Some(frame)) => route(&reader_inner, frame),
                        Ok(None) => break,
                        Err(e) => tracing::warn!("bad frame from the agent: {e}"),
                    }
                }
                match rd.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => decoder.push(&buf[..n]),
                }
            }
            reader_inner.hang_up();
        });
        *inner.tasks.lock().unwrap() = vec![writer.abort_handle(), reader.abort_handle()];
        Ok(AgentClient {
            inner,
            info: Arc::new(info),
        })
    }

    /// What the agent reported in the handshake.
    pub fn info(&self) -> &AgentInfo {
        &self.info
    }

    /// Run a login shell's `true` as the guest user and check it
    /// succeeded: a VM prepared ahead of use runs it so its QEMU has
    /// already translated the shell's code (and the guest has it in its
    /// page cache) when the first real command comes. A login shell, as
    /// E2B's SDKs run every command (`bash -l -c`): it covers the plain
    /// shell too, and a login shell's first start in a new QEMU costs
    /// ~250 ms more under emulation (its profile's files and processes),
    /// measured, which a first `commands.run` otherwise paid.
    pub async fn warm_up(&self) -> Result<()> {
        let out = self
            .exec_collect(ExecRequest {
                command: "bash -l -c true".into(),
                cwd: None,
                env: Default::default(),
                timeout_ms: 60_000,
                max_output_bytes: 1024,
                ..Default::default()
            })
            .await?;
        if out.result.exit_code != Some(0) {
            return Err(RuntimeError::Launch(format!(
                "the warm-up command failed: {:?}",
                out.result
            )));
        }
        Ok(())
    }

    /// Hang up: the socket closes now, for every clone; requests in flight
    /// fail as disconnected.
    pub fn close(&self) {
        for t in self.inner.tasks.lock().unwrap().drain(..) {
            t.abort();
        }
        self.inner.hang_up();
    }

    /// Has the connection closed (VM gone or agent unreachable)?
    pub fn is_closed(&self) -> bool {
        self.inner.closed.load(Ordering::SeqCst)
    }

    pub(crate) fn inner(&self) -> &Arc<Inner> {
        &self.inner
    }

    pub(crate) fn register(&self) -> Result<(RequestId, mpsc::UnboundedReceiver<Frame>)> {
        if self.is_closed() {
            return Err(RuntimeError::Disconnected(
                "the connection is closed".into(),
            ));
        }
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::unbounded_channel();
        self.inner.pending.lock().unwrap().insert(id, tx);
        Ok((id, rx))
    }

    /// [`AgentClient::register`] for a request whose pieces (a command's
    /// output, a watch's events) stream until it ends: what waits for its
    /// reader is counted against [`OutputBacklog`]'s bound.
    pub(crate) fn register_followed(
        &self,
    ) -> Result<(
        RequestId,
        mpsc::UnboundedReceiver<Frame>,
        Arc<OutputBacklog>,
    )> {
        let (id, rx) = self.register()?;
        let backlog = Arc::new(OutputBacklog::default());
        self.inner
            .backlogs
            .lock()
            .unwrap()
            .insert(id, backlog.clone());
        Ok((id, rx, backlog))
    }

    async fn finish(
        &self,
        id: RequestId,
        rx: &mut mpsc::UnboundedReceiver<Frame>,
        what: &str,
        within: Duration,
    ) -> Result<Frame> {
        let deadline = tokio::time::Instant::now() + within;
        let r = next_frame(rx, deadline, what).await;
        self.inner.pending.lock().unwrap().remove(&id);
        let frame = r.map_err(|e| match e {
            RuntimeError::AgentTimeout { what, .. } => RuntimeError::AgentTimeout {
                what,
                secs: within.as_secs(),
            },
            other => other,
        })?;
        match frame.message {
            Message::Error { error, .. } => Err(RuntimeError::Agent(error)),
            _ => Ok(frame),
        }
    }

    async fn simple(
        &self,
        what: &str,
        make: impl FnOnce(RequestId) -> Message,
        body: &[u8],
    ) -> Result<DoneResult> {
        self.simple_within(what, make, body, REPLY_DEADLINE).await
    }

    /// [`AgentClient::simple`], answered `within` instead.
    async fn simple_within(
        &self,
        what: &str,
        make: impl FnOnce(RequestId) -> Message,
        body: &[u8],
        within: Duration,
    ) -> Result<DoneResult> {
        let (id, mut rx) = self.register()?;
        if let Err(e) = self.inner.send(&make(id), body) {
            self.inner.pending.lock().unwrap().remove(&id);
            return Err(e);
        }
        let frame = self.finish(id, &mut rx, what, within).await?;
        match frame.message {
            Message::Done { result, .. } => Ok(result),
            other => Err(unexpected(other)),
        }
    }

    /// Round trip through the agent.
    pub async fn ping(&self) -> Result<()> {
        self.simple("a ping", |id| Message::Ping { id }, &[])
            .await
            .map(|_| ())
    }

    /// Give the guest its identity, clock, limits and network (and fresh
    /// entropy), answered `within` (a boot's configuration is part of the
    /// boot, and has what is left of its bound).
    pub async fn configure(
        &self,
        config: GuestConfig,
        entropy: &[u8],
        within: Duration,
    ) -> Result<()> {
        self.simple_within(
            "its configuration",
            |id| Message::Configure { id, config },
            entropy,
            within,
        )
        .await
        .map(|_| ())
    }

    /// Start a command; read its events from the handle.
    pub fn exec(&self, request: ExecRequest) -> Result<ExecHandle> {
        if request.pty.is_some() {
            self.needs("pty", "commands on a terminal")?;
        }
        if request.as_root {
            // An older agent would run it as the user.
            self.needs("root_exec", "a template's build steps (run as root)")?;
        }
        let longest = Duration::from_millis(request.timeout_ms);
        let limit = request.max_output_bytes;
        let announced = request.keep_running;
        self.follow(
            |id| Message::Exec { id, request },
            announced,
            limit,
            longest,
        )
    }

    /// Follow the running command `pid` from now on: its pid first, then
    /// its output (at most `max_output_bytes` a stream) and its end, for
    /// at most `longest` (plus [`EXEC_GRACE`]). Dropping the handle stops
    /// following it; the command goes on.
    pub fn attach(&self, pid: u32, max_output_bytes: u64, longest: Duration) -> Result<ExecHandle> {
        self.follow(
            |id| Message::ProcessAttach { id, pid },
            true,
            max_output_bytes,
            longest,
        )
    }

    /// Send the request `make` builds and hand back the handle its
    /// command's events come to, for at most `longest` plus [`EXEC_GRACE`].
    fn follow(
        &self,
        make: impl FnOnce(RequestId) -> Message,
        announced: bool,
        limit: u64,
        longest: Duration,
    ) -> Result<ExecHandle> {
        let (id, rx, backlog) = self.register_followed()?;
        let deadline = tokio::time::Instant::now() + longest + EXEC_GRACE;
        if let Err(e) = self.inner.send(&make(id), &[]) {
            self.inner.forget(id);
            return Err(e);
        }
        Ok(ExecHandle {
            id,
            inner: self.inner.clone(),
            rx,
            finished: false,
            announced,
            stdout_left: limit,
            stderr_left: limit,
            cut: (false, false),
            backlog,
            deadline,
        })
    }

    /// The commands running in the guest now.
    pub async fn processes(&self) -> Result<Vec<ProcessInfo>> {
        match self
            .simple("its commands", |id| Message::ProcessList { id }, &[])
            .await?
        {
            DoneResult::Processes { processes } => Ok(processes),
            other => Err(RuntimeError::Disconnected(format!(
                "unexpected answer to a list of commands: {other:?}"
            ))),
        }
    }

    /// `Unsupported`, naming `what`, when the agent does not list
    /// `feature` (an older image's agent: see [`AgentInfo::features`]).
    fn needs(&self, feature: &str, what: &str) -> Result<()> {
        if self.info.features.iter().any(|f| f == feature) {
            return Ok(());
        }
        Err(RuntimeError::Agent(AgentError::new(
            ErrorKind::Unsupported,
            format!(
                "this sandbox's guest agent ({}) predates {what}: sandboxes started \
                 since the server's upgrade have it",
                self.info.agent_version
            ),
        )))
    }

    /// The guest's CPU, memory and disk now, as its kernel counts them.
    pub async fn stats(&self) -> Result<GuestStats> {
        self.needs("stats", "reading its resources")?;
        match self
            .simple("its resources", |id| Message::Stats { id }, &[])
            .await?
        {
            DoneResult::Stats { stats } => Ok(stats),
            other => Err(RuntimeError::Disconnected(format!(
                "unexpected answer to a reading of resources: {other:?}"
            ))),
        }
    }

    /// Feed (`input`, for [`ProcessCall::Input`], in pieces of at most a
    /// frame), close or signal the running command `pid`.
    pub async fn process_call(&self, pid: u32, call: ProcessCall, input: &[u8]) -> Result<()> {
        if matches!(call, ProcessCall::Resize { .. }) {
            self.needs("pty", "resizing a command's terminal")?;
        }
        let pieces: Vec<&[u8]> = if input.len() > CHUNK_LEN {
            input.chunks(CHUNK_LEN).collect()
        } else {
            vec![input]
        };
        for piece in pieces {
            let call = call.clone();
            match self
                .simple(
                    "a call on a command",
                    |id| Message::ProcessCall { id, pid, call },
                    piece,
                )
                .await?
            {
                DoneResult::ProcessCalled { .. } => {}
                other => {
                    return Err(RuntimeError::Disconnected(format!(
                        "unexpected answer to a call on a command: {other:?}"
                    )))
                }
            }
        }
        Ok(())
    }

    /// Run a command and collect its whole output.
    pub async fn exec_collect(&self, request: ExecRequest) -> Result<ExecOutput> {
        let mut h = self.exec(request)?;
        let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
        loop {
            match h.next().await? {
                GuestExecEvent::Started(_) => {}
                GuestExecEvent::Stdout(b) => stdout.extend_from_slice(&b),
                GuestExecEvent::Stderr(b) => stderr.extend_from_slice(&b),
                GuestExecEvent::Exited(result) => {
                    return Ok(ExecOutput {
                        stdout,
                        stderr,
                        result,
                    })
                }
            }
        }
    }

    /// Write a whole file (binary-exact; parents created; owned by the user),
    /// as an [`AgentClient::upload`] of one piece. Returns the resolved
    /// path and the byte count.
    pub async fn write_file(
        &self,
        path: &str,
        content: &[u8],
        mode: Option<u32>,
    ) -> Result<(String, u64)> {
        let mut upload = self.upload(path, content.len() as u64, mode)?;
        upload.send(content).await?;
        upload.finish().await
    }

    /// Start writing a file of exactly `size` bytes, sent a piece at a time
    /// with [`FileUpload::send`] (binary-exact; parents created; owned by
    /// the user). The guest writes a temporary file and renames it into
    /// place at the end, so a write cut short leaves nothing.
    pub fn upload(&self, path: &str, size: u64, mode: Option<u32>) -> Result<FileUpload> {
        let (id, rx) = self.register()?;
        let upload = FileUpload {
            id,
            inner: self.inner.clone(),
            rx,
            size,
            sent: 0,
            answered: false,
        };
        let head = Message::WriteFile {
            id,
            path: path.to_string(),
            size,
            mode,
        };
        self.inner.send(&head, &[])?;
        Ok(upload)
    }

    /// Start reading a file of at most `max_bytes`: its resolved path and
    /// size, then its content a chunk at a time ([`GuestDownload::next_chunk`]).
    pub async fn download(&self, path: &str, max_bytes: u64) -> Result<GuestDownload> {
        let (id, rx) = self.register()?;
        let mut download = GuestDownload {
            id,
            inner: self.inner.clone(),
            rx,
            path: String::new(),
            size: 0,
            received: 0,
            max_bytes,
            ended: false,
        };
        self.inner.send(
            &Message::ReadFile {
                id,
                path: path.to_string(),
                max_bytes,
                window: Some(READ_WINDOW),
            },
            &[],
        )?;
        match download.next_frame().await?.message {
            Message::FileInfo { path, size, .. } => {
                download.path = path;
                download.size = size;
                Ok(download)
            }
            Message::Error { error, .. } => Err(RuntimeError::Agent(error)),
            other => Err(unexpected(other)),
        }
    }

    /// Read a whole file of at most `max_bytes`. Returns the resolved path and content.
    pub async fn read_file(&self, path: &str, max_bytes: u64) -> Result<(String, Vec<u8>)> {
        let mut download = self.download(path, max_bytes).await?;
        let mut content = Vec::with_capacity(download.size().min(max_bytes) as usize);
        while let Some(chunk) = download.next_chunk().await? {
            content.extend_from_slice(&chunk);
        }
        Ok((std::mem::take(&mut download.path), content))
    }

    /// List a directory tree.
    pub async fn list_files(
        &self,
        path: &str,
        recursive: bool,
        max_entries: u64,
    ) -> Result<(String, Vec<FileEntry>, bool)> {
        match self
            .simple(
                "a listing",
                |id| Message::ListFiles {
                    id,
                    path: path.to_string(),
                    recursive,
                    max_entries,
                },
                &[],
            )
            .await?
        {
            DoneResult::Listing {
                path,
                entries,
                truncated,
            } => Ok((path, entries, truncated)),
            other => Err(RuntimeError::Disconnected(format!(
                "unexpected answer to a listing: {other:?}"
            ))),
        }
    }

    /// Delete a file or (recursive) a tree. Returns the resolved path.
    pub async fn delete_file(&self, path: &str, recursive: bool) -> Result<String> {
        match self
            .simple(
                "a delete",
                |id| Message::DeleteFile {
                    id,
                    path: path.to_string(),
                    recursive,
                },
                &[],
            )
            .await?
        {
            DoneResult::Deleted { path } => Ok(path),
            other => Err(RuntimeError::Disconnected(format!(
                "unexpected answer to a delete: {other:?}"
            ))),
        }
    }

    /// A call on a path or two ([`PathCall`]); what it leaves at its path.
    pub async fn path_call(&self, call: PathCall) -> Result<PathEntry> {
        match self
            .simple("a call on a path", |id| Message::PathCall { id, call }, &[])
            .await?
        {
            DoneResult::PathInfo { entry } => Ok(entry),
            other => Err(RuntimeError::Disconnected(format!(
                "unexpected answer to a call on a path: {other:?}"
            ))),
        }
    }

    /// Ask the guest to power itself off (it does not answer).
    pub fn power_off(&self) -> Result<()> {
        let (id, _rx) = self.register()?;
        self.inner.send(&Message::PowerOff { id }, &[])
    }
}

fn route(inner: &Inner, frame: Frame) {
    let Some(id) = frame.message.request_id() else {
        return;
    };
    match frame.message {
        Message::TunnelAck { bytes, .. } => {
            if let Some(c) = inner.windows.lock().unwrap().get(&id) {
                c.add(bytes as u64);
            }
            return;
        }
        Message::Stdout { .. } | Message::Stderr { .. } | Message::WatchEvents { .. } => {
            let (len, stream) = match &frame.message {
                Message::Stderr { .. } => (frame.body.len(), 1),
                Message::WatchEvents { events, .. } => (watch::queued_size(events), 0),
                _ => (frame.body.len(), 0),
            };
            let backlog = inner.backlogs.lock().unwrap().get(&id).cloned();
            if backlog.is_some_and(|b| !b.admit(len, stream)) {
                return;
            }
        }
        Message::TunnelData { .. } => {
            let within = inner
                .windows
                .lock()
                .unwrap()
                .get(&id)
                .is_none_or(|c| c.receive(frame.body.len() as u64));
            if !within {
                crate::channel::tunnel::violated(inner, id);
                return;
            }
        }
        _ => {}
    }
    let pending = inner.pending.lock().unwrap();
    if let Some(tx) = pending.get(&id) {
        let _ = tx.send(frame);
    }
}

pub(crate) fn unexpected(m: Message) -> RuntimeError {
    RuntimeError::Disconnected(format!("unexpected message from the agent: {m:?}"))
}

/// The `HelloAck` answering `nonce` in `bytes`, and where it ends: a frame
/// is tried at every magic, rather than after the lengths of what comes
/// before it, which an earlier connection may have left cut short (its
/// lengths then promise a body that never came, and trusting them would
/// take the ack for part of it).
fn find_ack(bytes: &[u8], nonce: u64) -> Option<(Message, usize)> {
    let mut from = 0;
    while let Some(at) = bytes[from..]
        .windows(FRAME_MAGIC.len())
        .position(|w| w == FRAME_MAGIC)
        .map(|i| i + from)
    {
        from = at + 1;
        let frame = &bytes[at..];
        if frame.len() < HEADER_PREFIX_LEN {
            continue;
        }
        let header_len = u32::from_be_bytes(frame[4..8].try_into().unwrap()) as usize;
        let body_len = u32::from_be_bytes(frame[8..12].try_into().unwrap()) as usize;
        if header_len > MAX_HEADER_LEN || body_len > MAX_BODY_LEN {
            continue;
        }
        let total = HEADER_PREFIX_LEN + header_len + body_len;
        if frame.len() < total {
            continue;
        }
        let header = &frame[HEADER_PREFIX_LEN..HEADER_PREFIX_LEN + header_len];
        match serde_json::from_slice::<Message>(header) {
            Ok(m @ Message::HelloAck { nonce: n, .. }) if n == nonce => {
                return Some((m, at + total))
            }
            _ => continue,
        }
    }
    None
}

#[cfg(test)]
pub(crate) mod fake;

#[cfg(test)]
mod tests;
