//! Port tunnels: TCP connections to servers on the guest's loopback, carried
//! over the agent channel, so preview URLs reach a server in the sandbox
//! without any inbound port on the VM.
//!
//! Each stream (named by the id of its `TunnelOpen`) has two threads: the
//! *up* thread connects, then writes what the host sends into the socket and
//! acknowledges it; the *down* thread reads the socket and sends it to the
//! host. Both directions are send_window-based: the down thread sends only as many
//! bytes as the host granted and not yet acknowledged, so a slow browser
//! stalls its own stream and nothing else, and the host sends no more than
//! the window this side granted, so the up thread's queue is bounded too and
//! the reader thread never blocks on it.
//!
//! A stream ends when the host says `TunnelClose` (it is done, or gave up), when
//! the session ends, or when the socket fails (then this side says
//! `TunnelClose`). A half-close travels as `TunnelShutdown` either way.

use crate::channel::Reply;
use crate::sys::lock;
use crate::window::SendWindow;
use sandpit_protocol::{AgentError, ErrorKind, Message, RequestId};
use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

/// Bytes the host may send on one stream before this side acknowledges them.
pub const WINDOW: u32 = 1024 * 1024;
/// Largest piece of a stream in one frame.
const CHUNK: usize = 64 * 1024;
/// How long a connect to the guest's own loopback may take (generous: a
/// SYN dropped by a full listen backlog is retried after a second or more).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// What the reader thread hands a stream's thread.
pub(crate) enum Event {
    Data(Vec<u8>),
    Ack(u32),
    Shutdown,
    Close,
    /// A terminal's new size (see `pty`); tunnels ignore it.
    Resize {
        rows: u16,
        cols: u16,
    },
}

struct Entry {
    gen: u64,
    serial: u64,
    tx: Sender<Event>,
}

/// Open streams by id: port tunnels and terminals (`pty`), which share the
/// stream messages.
static TUNNELS: Mutex<Option<HashMap<RequestId, Entry>>> = Mutex::new(None);
static SERIAL: AtomicU64 = AtomicU64::new(1);

fn with_tunnels<R>(f: impl FnOnce(&mut HashMap<RequestId, Entry>) -> R) -> R {
    let mut g = lock(&TUNNELS);
    f(g.get_or_insert_with(HashMap::new))
}

/// A registered stream: its serial (to unregister exactly it) and what the
/// reader routes to it.
pub(crate) struct Registered {
    pub serial: u64,
    pub events: Receiver<Event>,
}

/// Register stream `id` (on the reader thread, before anything else about
/// it can arrive). `None`, with the error answered, when the id is taken.
pub(crate) fn register(reply: &Reply, id: RequestId) -> Option<Registered> {
    let (tx, events) = mpsc::channel();
    let serial = SERIAL.fetch_add(1, Ordering::SeqCst);
    let taken = with_tunnels(|t| {
        if t.contains_key(&id) {
            return true;
        }
        t.insert(
            id,
            Entry {
                gen: reply.generation(),
                serial,
                tx,
            },
        );
        false
    });
    if taken {
        reply.error(
            id,
            AgentError::new(
                ErrorKind::InvalidRequest,
                format!("a stream with id {id} is already open"),
            ),
        );
        return None;
    }
    Some(Registered { serial, events })
}

/// Forget stream `id` if it is still the one registered as `serial`: its
/// thread's event channel ends.
pub(crate) fn unregister(id: RequestId, serial: u64) {
    with_tunnels(|t| {
        if t.get(&id).is_some_and(|e| e.serial == serial) {
            t.remove(&id);
        }
    });
}

/// Handle a `TunnelOpen` (on the reader thread: registers the stream before
/// anything else about it can arrive).
pub fn open(reply: Reply, id: RequestId, port: u16, window: u32) {
    let Some(Registered { serial, events }) = register(&reply, id) else {
        return;
    };
    let r = reply.clone();
    let spawned = thread::Builder::new()
        .name("tunnel-up".into())
        .spawn(move || {
            up(&r, id, port, window, events);
            unregister(id, serial);
        });
    if let Err(e) = spawned {
        unregister(id, serial);
        reply.error(
            id,
            AgentError::new(ErrorKind::Io, format!("cannot start a thread: {e}")),
        );
    }
}

/// Route a host message about an open stream; unknown ids (streams already
/// over) are ignored.
pub fn data(id: RequestId, body: Vec<u8>) {
    deliver(id, Event::Data(body));
}
pub fn ack(id: RequestId, bytes: u32) {
    deliver(id, Event::Ack(bytes));
}
pub fn shutdown(id: RequestId) {
    deliver(id, Event::Shutdown);
}
pub fn close(id: RequestId) {
    deliver(id, Event::Close);
}
pub fn resize(id: RequestId, rows: u16, cols: u16) {
    deliver(id, Event::Resize { rows, cols });
}

fn deliver(id: RequestId, ev: Event) {
    with_tunnels(|t| {
        if let Some(e) = t.get(&id) {
            let _ = e.tx.send(ev);
        }
    });
}

/// Close every stream of sessions before `gen`.
pub fn close_sessions_before(gen: u64) {
    let n = with_tunnels(|t| {
        let before = t.len();
        t.retain(|_, e| {
            if e.gen < gen {
                let _ = e.tx.send(Event::Close);
                false
            } else {
                true
            }
        });
        before - t.len()
    });
    if n > 0 {
        crate::info!("closed {n} stream(s) of an ended session");
    }
}

/// Connect to `port` on the loopback, IPv4 first, then IPv6.
fn connect(port: u16) -> Result<TcpStream, AgentError> {
    let mut refused = None;
    for ip in [Ipv4Addr::LOCALHOST.into(), Ipv6Addr::LOCALHOST.into()] {
        match TcpStream::connect_timeout(&SocketAddr::new(ip, port), CONNECT_TIMEOUT) {
            Ok(s) => return Ok(s),
            Err(e)
                if e.kind() == io::ErrorKind::TimedOut || e.kind() == io::ErrorKind::WouldBlock =>
            {
                return Err(AgentError::new(
                    ErrorKind::TimedOut,
                    format!(
                        "connecting to port {port} timed out after {} s",
                        CONNECT_TIMEOUT.as_secs()
                    ),
                ))
            }
            Err(e) => refused = Some(e),
        }
    }
    let e = refused.expect("tried at least one address");
    let kind = match e.kind() {
        io::ErrorKind::ConnectionRefused | io::ErrorKind::AddrNotAvailable => {
            ErrorKind::ConnectionRefused
        }
        _ => ErrorKind::Io,
    };
    Err(AgentError::new(
        kind,
        format!("nothing is listening on port {port} in the sandbox ({e})"),
    ))
}

fn up(reply: &Reply, id: RequestId, port: u16, window: u32, rx: Receiver<Event>) {
    let sock = match connect(port) {
        Ok(s) => s,
        Err(e) => {
            reply.error(id, e);
            return;
        }
    };
    let _ = sock.set_nodelay(true);
    let send_window = Arc::new(SendWindow::new(window as u64));
    let down_sock = match sock.try_clone() {
        Ok(s) => s,
        Err(e) => {
            reply.error(
                id,
                AgentError::new(ErrorKind::Io, format!("cannot clone the socket: {e}")),
            );
            return;
        }
    };
    reply.send(&Message::TunnelOpened { id, window: WINDOW }, &[]);
    let down_thread = {
        let (r, c) = (reply.clone(), send_window.clone());
        thread::Builder::new()
            .name("tunnel-down".into())
            .spawn(move || down(&r, id, down_sock, &c))
    };
    if down_thread.is_err() {
        reply.send(&Message::TunnelClose { id }, &[]);
        return;
    }
    let mut sock = sock;
    let mut writable = true;
    for ev in rx.iter() {
        match ev {
            Event::Data(bytes) => {
                let n = bytes.len() as u32;
                if writable && sock.write_all(&bytes).is_err() {
                    // The server closed its read side or reset: the stream is
                    // over for the host too.
                    writable = false;
                    reply.send(&Message::TunnelClose { id }, &[]);
                    let _ = sock.shutdown(Shutdown::Both);
                }
                // Acknowledge even dropped bytes, so the host's writer never
                // waits on send_window that cannot come.
                reply.send(&Message::TunnelAck { id, bytes: n }, &[]);
            }
            Event::Ack(n) => send_window.add(n as u64),
            Event::Shutdown => {
                writable = false;
                let _ = sock.shutdown(Shutdown::Write);
            }
            Event::Close => break,
            Event::Resize { .. } => {}
        }
    }
    send_window.close();
    let _ = sock.shutdown(Shutdown::Both);
    if let Ok(h) = down_thread {
        let _ = h.join();
    }
}

fn down(reply: &Reply, id: RequestId, mut sock: TcpStream, send_window: &SendWindow) {
    let mut buf = vec![0u8; CHUNK];
    loop {
        let Some(allowed) = send_window.take(CHUNK) else {
            return;
        };
        match sock.read(&mut buf[..allowed]) {
            Ok(0) => {
                reply.send(&Message::TunnelShutdown { id }, &[]);
                return;
            }
            Ok(n) => {
                if n < allowed {
                    send_window.add((allowed - n) as u64);
                }
                reply.send(&Message::TunnelData { id }, &buf[..n]);
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => send_window.add(allowed as u64),
            Err(_) => {
                reply.send(&Message::TunnelClose { id }, &[]);
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::channel::{self, Outbox};
    use sandpit_protocol::{Frame, FrameDecoder};
    use std::net::TcpListener;
    use std::sync::mpsc::sync_channel;

    fn frames(rx: &mpsc::Receiver<(u64, Vec<u8>)>, want: impl Fn(&Message) -> bool) -> Frame {
        loop {
            let (_, bytes) = rx.recv_timeout(Duration::from_secs(10)).expect("a frame");
            let mut d = FrameDecoder::new();
            d.push(&bytes);
            let f = d.next_frame().unwrap().unwrap();
            if want(&f.message) {
                return f;
            }
        }
    }

    #[test]
    fn refused_port_is_reported_as_not_listening() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        drop(l);
        let e = connect(port).unwrap_err();
        assert_eq!(e.kind, ErrorKind::ConnectionRefused);
    }

    #[test]
    fn a_stream_echoes_within_its_window_and_half_closes() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let server = thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut got = Vec::new();
            s.read_to_end(&mut got).unwrap();
            s.write_all(&got).unwrap();
        });
        let (tx, rx) = sync_channel(64);
        let reply = Reply::new(channel::generation(), Outbox::for_test(tx));
        let id = 1_000_001;
        // A window of 3 bytes: the answer comes back in pieces of at most 3,
        // each only after an ack.
        open(reply, id, port, 3);
        frames(&rx, |m| matches!(m, Message::TunnelOpened { .. }));
        data(id, b"hello".to_vec());
        frames(&rx, |m| matches!(m, Message::TunnelAck { bytes: 5, .. }));
        shutdown(id);
        let mut echoed = Vec::new();
        while echoed.len() < 5 {
            let f = frames(&rx, |m| matches!(m, Message::TunnelData { .. }));
            assert!(f.body.len() <= 3);
            echoed.extend_from_slice(&f.body);
            ack(id, f.body.len() as u32);
        }
        assert_eq!(echoed, b"hello");
        frames(&rx, |m| matches!(m, Message::TunnelShutdown { .. }));
        close(id);
        server.join().unwrap();
    }
}
