//! The host end of a port tunnel: a TCP connection to a server on the
//! guest's loopback, as a tokio `AsyncRead + AsyncWrite`, so hyper (or
//! anything else) can speak over it as over a socket.
//!
//! Many streams share the one agent connection with commands and file
//! transfers, so each direction is send_window-based (see the agent's `tunnel`
//! module): this side sends at most the window the guest granted and waits
//! for its `TunnelAck`s; it acknowledges what it has handed to its reader,
//! so a reader that stops reading stops the guest from sending on that
//! stream, and no stream buffers without bound.

use crate::channel::{unexpected, AgentClient, Inner};
use crate::{Result, RuntimeError};
use sandpit_protocol::{Frame, Message, RequestId};
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::mpsc;

/// Bytes the guest may send on one stream before this side acknowledges them.
pub const WINDOW: u32 = 1024 * 1024;
/// Largest piece of a stream sent in one frame.
const CHUNK: usize = 64 * 1024;

/// How many bytes this side may still send on a stream, and how many the
/// guest sent that this side has not acknowledged yet.
pub(crate) struct SendWindow {
    state: Mutex<CreditState>,
    unacked: AtomicU64,
}

#[derive(Default)]
struct CreditState {
    available: u64,
    closed: bool,
    waker: Option<Waker>,
}

impl SendWindow {
    fn new() -> Self {
        SendWindow {
            state: Mutex::new(CreditState::default()),
            unacked: AtomicU64::new(0),
        }
    }

    /// Count `n` bytes arriving from the guest; false if that exceeds the
    /// window this side granted (a guest that ignores flow control).
    pub(crate) fn receive(&self, n: u64) -> bool {
        self.unacked.fetch_add(n, Ordering::SeqCst) + n <= WINDOW as u64
    }

    /// SendWindow from the guest (its window, its acks), never past [`WINDOW`]:
    /// a guest granting more, or acking what it never got, cannot make the
    /// host queue more than that per stream.
    pub(crate) fn add(&self, n: u64) {
        let mut s = self.state.lock().unwrap();
        s.available = (s.available + n).min(WINDOW as u64);
        if let Some(w) = s.waker.take() {
            w.wake();
        }
    }

    pub(crate) fn close(&self) {
        let mut s = self.state.lock().unwrap();
        s.closed = true;
        if let Some(w) = s.waker.take() {
            w.wake();
        }
    }
}

/// A TCP connection to a port in the guest. Dropping it closes the stream.
pub struct TunnelStream {
    id: RequestId,
    inner: Arc<Inner>,
    rx: mpsc::UnboundedReceiver<Frame>,
    send_window: Arc<SendWindow>,
    /// The frame being read, and how much of it was handed out.
    buf: Vec<u8>,
    pos: usize,
    read_eof: bool,
    write_shut: bool,
    /// A terminal's end, once the guest reported it (see `terminal`).
    pub(crate) exit: Arc<Mutex<Option<PtyExit>>>,
}

/// How a terminal's shell ended: its exit code, or the signal that killed
/// it (neither when the guest could not tell).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PtyExit {
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
}

/// Closes a stream from elsewhere (the port was closed, the sandbox ended):
/// its reads fail, its writes fail, the guest drops the connection.
#[derive(Clone)]
pub struct TunnelCloser {
    id: RequestId,
    inner: Arc<Inner>,
}

impl TunnelCloser {
    pub fn close(&self) {
        close_stream(&self.inner, self.id);
    }
}

/// Close a stream whose guest side broke the protocol (sent past its window):
/// the guest is not trusted to bound what the host buffers.
pub(crate) fn violated(inner: &Inner, id: RequestId) {
    tracing::warn!(id, "a tunnel stream sent past its window; closing it");
    close_stream(inner, id);
}

fn close_stream(inner: &Inner, id: RequestId) {
    let had = inner.pending.lock().unwrap().remove(&id).is_some();
    if let Some(c) = inner.windows.lock().unwrap().remove(&id) {
        c.close();
    }
    if had {
        let _ = inner.send(&Message::TunnelClose { id }, &[]);
    }
}

impl AgentClient {
    /// Connect to `port` on the guest's loopback. An agent error of kind
    /// `ConnectionRefused` means nothing listens there; `TimedOut`, that the
    /// connect took too long. The caller bounds the wait for an answer.
    pub async fn open_tunnel(&self, port: u16) -> Result<TunnelStream> {
        self.open_stream("opening a tunnel", |id| Message::TunnelOpen {
            id,
            port,
            window: WINDOW,
        })
        .await
    }

    /// Open a stream with the request `open` makes for its id, and wait for
    /// the guest's `TunnelOpened` (see also `terminal`).
    pub(crate) async fn open_stream(
        &self,
        what: &str,
        open: impl FnOnce(RequestId) -> Message,
    ) -> Result<TunnelStream> {
        let (id, rx) = self.register()?;
        let inner = self.inner().clone();
        let send_window = Arc::new(SendWindow::new());
        inner
            .windows
            .lock()
            .unwrap()
            .insert(id, send_window.clone());
        // From here on, dropping `stream` (also mid-open) closes the stream.
        let mut stream = TunnelStream {
            id,
            inner: inner.clone(),
            rx,
            send_window,
            buf: Vec::new(),
            pos: 0,
            read_eof: false,
            write_shut: false,
            exit: Arc::default(),
        };
        inner.send(&open(id), &[])?;
        let deadline = tokio::time::Instant::now() + crate::channel::REPLY_DEADLINE;
        let frame = crate::channel::next_frame(&mut stream.rx, deadline, what).await?;
        match frame.message {
            Message::TunnelOpened { window, .. } => {
                stream.send_window.add(window as u64);
                Ok(stream)
            }
            Message::Error { error, .. } => {
                // The guest already forgot the stream.
                inner.pending.lock().unwrap().remove(&id);
                Err(RuntimeError::Agent(error))
            }
            other => Err(unexpected(other)),
        }
    }
}

impl TunnelStream {
    pub(crate) fn id(&self) -> RequestId {
        self.id
    }

    /// A handle that closes this stream from another task.
    pub fn closer(&self) -> TunnelCloser {
        TunnelCloser {
            id: self.id,
            inner: self.inner.clone(),
        }
    }
}

fn broken(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::BrokenPipe, what.to_string())
}

impl AsyncRead for TunnelStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        loop {
            if this.pos < this.buf.len() {
                let n = out.remaining().min(this.buf.len() - this.pos);
                out.put_slice(&this.buf[this.pos..this.pos + n]);
                this.pos += n;
                if this.pos == this.buf.len() {
                    let bytes = this.buf.len() as u32;
                    this.buf.clear();
                    this.pos = 0;
                    this.send_window
                        .unacked
                        .fetch_sub(bytes as u64, Ordering::SeqCst);
                    let _ = this
                        .inner
                        .send(&Message::TunnelAck { id: this.id, bytes }, &[]);
                }
                return Poll::Ready(Ok(()));
            }
            if this.read_eof {
                return Poll::Ready(Ok(()));
            }
            match this.rx.poll_recv(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(None) => return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::ConnectionAborted,
                    "the tunnel was closed (port closed, sandbox gone, or agent connection lost)",
                ))),
                Poll::Ready(Some(frame)) => match frame.message {
                    Message::TunnelData { .. } => {
                        this.buf = frame.body;
                        this.pos = 0;
                    }
                    Message::TunnelShutdown { .. } => this.read_eof = true,
                    Message::TunnelClose { .. } => {
                        // The guest's socket failed: no more either way.
                        this.read_eof = true;
                        this.send_window.close();
                    }
                    Message::PtyExited {
                        exit_code, signal, ..
                    } => {
                        // A terminal's shell ended, after its last output;
                        // the guest forgot the stream.
                        *this.exit.lock().unwrap() = Some(PtyExit { exit_code, signal });
                        this.read_eof = true;
                        this.send_window.close();
                        this.inner.pending.lock().unwrap().remove(&this.id);
                    }
                    Message::Error { error, .. } => {
                        return Poll::Ready(Err(io::Error::other(error)));
                    }
                    _ => {}
                },
            }
        }
    }
}

impl AsyncWrite for TunnelStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if self.write_shut {
            return Poll::Ready(Err(broken("the tunnel's write side is shut")));
        }
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        let n = {
            let mut s = self.send_window.state.lock().unwrap();
            if s.closed {
                return Poll::Ready(Err(broken("the tunnel is closed")));
            }
            if s.available == 0 {
                s.waker = Some(cx.waker().clone());
                return Poll::Pending;
            }
            let n = (s.available as usize).min(buf.len()).min(CHUNK);
            s.available -= n as u64;
            n
        };
        match self
            .inner
            .send(&Message::TunnelData { id: self.id }, &buf[..n])
        {
            Ok(()) => Poll::Ready(Ok(n)),
            Err(_) => Poll::Ready(Err(broken("the agent connection is closed"))),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if !self.write_shut {
            self.write_shut = true;
            let _ = self
                .inner
                .send(&Message::TunnelShutdown { id: self.id }, &[]);
        }
        Poll::Ready(Ok(()))
    }
}

impl Drop for TunnelStream {
    fn drop(&mut self) {
        close_stream(&self.inner, self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sandpit_protocol::{encode_frame, FrameDecoder};
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A scripted guest (see `channel::fake`): answers the handshake and one
    /// `TunnelOpen` (granting `window`), then runs `then` on the socket.
    async fn fake_guest<F, Fut>(window: u32, then: F) -> (AgentClient, tempfile::TempDir)
    where
        F: FnOnce(tokio::net::UnixStream, FrameDecoder, RequestId) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send,
    {
        crate::channel::fake::agent(move |mut s, mut d| async move {
            let f = crate::channel::fake::next(&mut s, &mut d).await;
            let Message::TunnelOpen { id, .. } = f.message else {
                panic!("{:?}", f.message);
            };
            s.write_all(&encode_frame(&Message::TunnelOpened { id, window }, b""))
                .await
                .unwrap();
            then(s, d, id).await;
        })
        .await
    }

    #[tokio::test]
    async fn a_guest_cannot_make_the_host_queue_past_its_own_window() {
        let (tx, mut rx) = mpsc::unbounded_channel::<u64>();
        // Grants the largest window there is, and acks a GiB it never got.
        let (client, _dir) = fake_guest(u32::MAX, move |mut s, mut d, id| async move {
            let ack = Message::TunnelAck { id, bytes: 1 << 30 };
            s.write_all(&encode_frame(&ack, b"")).await.unwrap();
            let mut total = 0u64;
            loop {
                let f = crate::channel::fake::next(&mut s, &mut d).await;
                if let Message::TunnelData { .. } = f.message {
                    total += f.body.len() as u64;
                    let _ = tx.send(total);
                }
            }
        })
        .await;
        let mut t = client.open_tunnel(80).await.unwrap();
        let writer = tokio::spawn(async move { t.write_all(&vec![7u8; 8 << 20]).await });
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let mut seen = 0;
        while let Ok(n) = rx.try_recv() {
            seen = n;
        }
        assert_eq!(seen, WINDOW as u64, "the host sent {seen} bytes");
        assert!(
            !writer.is_finished(),
            "8 MiB went to a guest granting 1 MiB"
        );
        writer.abort();
    }

    #[tokio::test]
    async fn writes_stay_within_the_window_until_acked() {
        let (tx, mut rx) = mpsc::unbounded_channel::<u64>();
        let (client, _dir) = fake_guest(1000, move |mut s, mut d, id| async move {
            let mut buf = vec![0u8; 1 << 16];
            let (mut total, mut granted) = (0u64, false);
            loop {
                while let Some(f) = d.next_frame().unwrap() {
                    if let Message::TunnelData { .. } = f.message {
                        total += f.body.len() as u64;
                        let _ = tx.send(total);
                    }
                }
                if total == 1000 && !granted {
                    // Grant the rest only now.
                    granted = true;
                    let ack = Message::TunnelAck { id, bytes: 4000 };
                    s.write_all(&encode_frame(&ack, b"")).await.unwrap();
                }
                let n = s.read(&mut buf).await.unwrap();
                if n == 0 {
                    return;
                }
                d.push(&buf[..n]);
            }
        })
        .await;
        let mut t = client.open_tunnel(80).await.unwrap();
        // 5000 bytes: the first 1000 go at once, the rest after the ack.
        tokio::time::timeout(Duration::from_secs(10), t.write_all(&[7u8; 5000]))
            .await
            .expect("the writer was never given send_window")
            .unwrap();
        let mut seen = Vec::new();
        while let Ok(Some(n)) = tokio::time::timeout(Duration::from_millis(500), rx.recv()).await {
            seen.push(n);
        }
        assert_eq!(seen.first(), Some(&1000), "{seen:?}");
        assert_eq!(seen.last(), Some(&5000), "{seen:?}");
    }

    #[tokio::test]
    async fn a_guest_that_ignores_the_window_loses_the_stream() {
        let (client, _dir) = fake_guest(1000, move |mut s, _d, id| async move {
            // Past the host's window, never waiting for an ack.
            for _ in 0..(WINDOW as usize / CHUNK + 2) {
                let f = encode_frame(&Message::TunnelData { id }, &vec![1u8; CHUNK]);
                if s.write_all(&f).await.is_err() {
                    return;
                }
            }
            tokio::time::sleep(Duration::from_secs(30)).await;
        })
        .await;
        let mut t = client.open_tunnel(80).await.unwrap();
        tokio::time::sleep(Duration::from_millis(500)).await;
        let mut sink = Vec::new();
        let r = tokio::time::timeout(Duration::from_secs(10), t.read_to_end(&mut sink))
            .await
            .expect("reading a flooded stream hung");
        assert!(r.is_err(), "the stream survived a flood");
        assert!(sink.len() <= WINDOW as usize);
    }
}
