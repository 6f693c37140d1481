//! The host end of a port tunnel: a TCP connection to a server on the
//! guest's loopback, as a tokio `AsyncRead + AsyncWrite`, so hyper (or
//! anything else) can speak over it as over a socket.
//!
//! Many streams share the one agent connection with commands and file
//! transfers, so each direction is credit-based (see the agent's `tunnel`
//! module): this side sends at most the window the guest granted and waits
//! for its `TunnelAck`s; it acknowledges what it has handed to its reader,
//! so a reader that stops reading stops the guest from sending on that
//! stream, and no stream buffers without bound.

use crate::channel::{unexpected, AgentClient, Inner};
use crate::{Result, RuntimeError};
use sandpit_protocol::{Frame, Message, RequestId};
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::mpsc;

/// Bytes the guest may send on one stream before this side acknowledges them.
pub const WINDOW: u32 = 1024 * 1024;
/// Largest piece of a stream sent in one frame.
const CHUNK: usize = 64 * 1024;

/// How many bytes this side may still send on a stream.
pub(crate) struct SendCredit {
    state: Mutex<CreditState>,
}

#[derive(Default)]
struct CreditState {
    available: u64,
    closed: bool,
    waker: Option<Waker>,
}

impl SendCredit {
    fn new() -> Self {
        SendCredit {
            state: Mutex::new(CreditState::default()),
        }
    }

    pub(crate) fn add(&self, n: u64) {
        let mut s = self.state.lock().unwrap();
        s.available += n;
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
    credit: Arc<SendCredit>,
    /// The frame being read, and how much of it was handed out.
    buf: Vec<u8>,
    pos: usize,
    read_eof: bool,
    write_shut: bool,
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

fn close_stream(inner: &Inner, id: RequestId) {
    let had = inner.pending.lock().unwrap().remove(&id).is_some();
    if let Some(c) = inner.credits.lock().unwrap().remove(&id) {
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
        let (id, rx) = self.register()?;
        let inner = self.inner().clone();
        let credit = Arc::new(SendCredit::new());
        inner.credits.lock().unwrap().insert(id, credit.clone());
        // From here on, dropping `stream` (also mid-open) closes the stream.
        let mut stream = TunnelStream {
            id,
            inner: inner.clone(),
            rx,
            credit,
            buf: Vec::new(),
            pos: 0,
            read_eof: false,
            write_shut: false,
        };
        inner.send(
            &Message::TunnelOpen {
                id,
                port,
                window: WINDOW,
            },
            &[],
        )?;
        let frame = stream.rx.recv().await.ok_or_else(|| {
            RuntimeError::Disconnected("the agent connection closed while opening a tunnel".into())
        })?;
        match frame.message {
            Message::TunnelOpened { window, .. } => {
                stream.credit.add(window as u64);
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
                        this.credit.close();
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
            let mut s = self.credit.state.lock().unwrap();
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
