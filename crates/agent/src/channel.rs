//! The virtio-serial port to the host: finding it, reading frames, writing
//! frames, and noticing the host come and go.
//!
//! The port is opened once (a second open fails with EBUSY). One reader thread
//! owns reads. Writes go through the [`Outbox`]: one frame at a time, so
//! frames never interleave. A small frame is written by its sender at once
//! when nothing is queued or being written and the port can take it without
//! blocking; every other frame waits in a bounded queue for the writer
//! thread, which back-pressures a chatty command onto its own pipe instead of
//! into memory. Writing at once saves the hand-off to the writer thread,
//! ~0.15 ms under emulation, on every short answer (a command's `Exited`).
//!
//! Sessions: each host connection (opened by `Hello`, or ended by EOF) gets a
//! new generation number; frames are tagged with the generation of the request
//! they answer, and the writer drops frames of older generations, so a new host
//! never sees answers meant for an old one.
//!
//! A session ends with a new `Hello`, or when the host side stays closed for
//! [`HOST_GONE_GRACE`]. When the host side is closed, read() returns 0 at once and poll() reports
//! POLLHUP forever, so waiting must not spin: the port is set to raise SIGIO
//! (F_SETOWN + O_ASYNC) when the host reconnects or data arrives, and the
//! reader sleeps in `sigtimedwait(SIGIO, 1 s)` between attempts.

use crate::sys::lock;
use sandpit_protocol::{
    encode_frame, AgentError, DoneResult, Frame, FrameDecoder, FrameError, Message, RequestId,
};
use std::collections::VecDeque;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
#[cfg(test)]
use std::sync::mpsc::SyncSender;
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

/// How long the host side must stay closed before its session ends.
///
/// An EOF alone does not prove the host left: the guest learns of a host
/// connecting or leaving from control messages handled in a kernel work item,
/// while data is delivered at once, so when a host reconnects quickly the
/// reader can see the new connection's `Hello` *before* the old connection's
/// close, and then a momentary EOF. Ending the session on that EOF would cancel
/// the new session and drop its `HelloAck`. A new `Hello` always ends the
/// previous session at once; a silent departure ends it after this grace.
const HOST_GONE_GRACE: Duration = Duration::from_secs(2);

/// Frames queued for the writer before senders block.
const OUTBOX_FRAMES: usize = 64;

/// The largest frame a sender writes itself: one write to a virtio port
/// takes up to 32 KiB, so a frame this size goes whole or not at all.
const DIRECT_FRAME_MAX: usize = 4096;

static GENERATION: AtomicU64 = AtomicU64::new(1);

/// The current session generation.
pub fn generation() -> u64 {
    GENERATION.load(Ordering::SeqCst)
}

/// Start a new session; returns its generation.
pub fn new_session() -> u64 {
    GENERATION.fetch_add(1, Ordering::SeqCst) + 1
}

/// Where frames go (cheap to clone).
#[derive(Clone)]
pub struct Outbox {
    inner: Arc<OutboxInner>,
}

struct OutboxInner {
    port: Arc<File>,
    /// Unit tests: frames go to this channel instead.
    #[cfg(test)]
    test_tx: Option<SyncSender<(u64, Vec<u8>)>>,
    state: Mutex<OutboxState>,
    /// Signalled when a frame is queued, taken, or a write ends.
    changed: Condvar,
}

#[derive(Default)]
struct OutboxState {
    queue: VecDeque<(u64, Vec<u8>)>,
    /// A frame is being written (by the writer thread or a sender).
    writing: bool,
}

impl Outbox {
    #[cfg(test)]
    pub fn for_test(tx: SyncSender<(u64, Vec<u8>)>) -> Self {
        Outbox {
            inner: Arc::new(OutboxInner {
                port: Arc::new(File::open("/dev/null").expect("/dev/null")),
                test_tx: Some(tx),
                state: Mutex::new(OutboxState::default()),
                changed: Condvar::new(),
            }),
        }
    }

    fn new(port: Arc<File>) -> Self {
        Outbox {
            inner: Arc::new(OutboxInner {
                port,
                #[cfg(test)]
                test_tx: None,
                state: Mutex::new(OutboxState::default()),
                changed: Condvar::new(),
            }),
        }
    }

    /// Send one frame of session `gen`: written at once when it can be
    /// without waiting, else queued; blocks while the queue is full.
    fn push(&self, gen: u64, frame: Vec<u8>) {
        let inner = &*self.inner;
        #[cfg(test)]
        if let Some(tx) = &inner.test_tx {
            if gen >= generation() {
                let _ = tx.send((gen, frame));
            }
            return;
        }
        let mut st = lock(&inner.state);
        if !st.writing && st.queue.is_empty() && frame.len() <= DIRECT_FRAME_MAX {
            st.writing = true;
            drop(st);
            let done = gen < generation() || write_now(&inner.port, &frame);
            let mut st = lock(&inner.state);
            st.writing = false;
            if !done {
                // Nothing of it was written: the writer takes it first.
                st.queue.push_front((gen, frame));
            }
            if !st.queue.is_empty() {
                inner.changed.notify_all();
            }
            return;
        }
        while st.queue.len() >= OUTBOX_FRAMES {
            st = inner
                .changed
                .wait(st)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
        st.queue.push_back((gen, frame));
        inner.changed.notify_all();
    }

    /// The writer thread's next frame, marked as being written.
    fn take(&self) -> (u64, Vec<u8>) {
        let inner = &*self.inner;
        let mut st = lock(&inner.state);
        loop {
            if !st.writing {
                if let Some(next) = st.queue.pop_front() {
                    st.writing = true;
                    inner.changed.notify_all();
                    return next;
                }
            }
            st = inner
                .changed
                .wait(st)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
    }

    fn written(&self) {
        lock(&self.inner.state).writing = false;
    }
}

/// Write a small frame if the port takes it now; false if nothing was
/// written (the host is away or the port is full).
fn write_now(port: &File, frame: &[u8]) -> bool {
    let fd = port.as_raw_fd();
    let mut p = [libc::pollfd {
        fd,
        events: libc::POLLOUT,
        revents: 0,
    }];
    // SAFETY: one valid pollfd; zero timeout.
    let n = unsafe { libc::poll(p.as_mut_ptr(), 1, 0) };
    if n != 1 || p[0].revents & (libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0 {
        return false;
    }
    if p[0].revents & libc::POLLOUT == 0 {
        return false;
    }
    // SAFETY: valid buffer.
    let n = unsafe { libc::write(fd, frame.as_ptr().cast(), frame.len()) };
    if n <= 0 {
        return false;
    }
    let n = n as usize;
    if n < frame.len() {
        // Not expected for a frame this small. Finish it, but never wait for
        // a host that left: the rest of a frame must not reach the next one.
        let _ = write_frame(port, &frame[n..], || false);
    }
    true
}

/// Where answers to one request go: the outbox plus the request's session.
#[derive(Clone)]
pub struct Reply {
    gen: u64,
    out: Outbox,
}

impl Reply {
    pub fn new(gen: u64, out: Outbox) -> Self {
        Reply { gen, out }
    }

    /// The session this request came from.
    pub fn generation(&self) -> u64 {
        self.gen
    }

    /// True while the session this request came from is still current.
    pub fn is_current(&self) -> bool {
        self.gen >= generation()
    }

    /// Send one frame (see [`Outbox`]); blocks while the outbox is full.
    /// Frames of a session that has ended are dropped right here.
    pub fn send(&self, message: &Message, body: &[u8]) {
        if !self.is_current() {
            return;
        }
        self.out.push(self.gen, encode_frame(message, body));
    }

    pub fn done(&self, id: RequestId, result: DoneResult) {
        self.send(&Message::Done { id, result }, &[]);
    }

    pub fn error(&self, id: RequestId, error: AgentError) {
        self.send(&Message::Error { id, error }, &[]);
    }
}

/// The device node of the virtio port named `name`, per sysfs under `sys`.
pub fn find_port(sys: &Path, dev: &Path, name: &str) -> Option<(PathBuf, String)> {
    let mut found = Vec::new();
    for entry in fs::read_dir(sys).ok()?.flatten() {
        let Ok(n) = fs::read_to_string(entry.path().join("name")) else {
            continue;
        };
        if n.trim_end_matches(['\n', '\0']) == name {
            let devnum = fs::read_to_string(entry.path().join("dev")).unwrap_or_default();
            found.push((dev.join(entry.file_name()), devnum.trim().to_string()));
        }
    }
    found.sort();
    found.into_iter().next()
}

/// Create the device node from sysfs' `major:minor` when devtmpfs lacks it.
fn mknod_port(path: &Path, devnum: &str) -> io::Result<()> {
    let (major, minor) = devnum
        .split_once(':')
        .and_then(|(a, b)| Some((a.parse::<u32>().ok()?, b.parse::<u32>().ok()?)))
        .ok_or_else(|| io::Error::other(format!("bad device number {devnum:?}")))?;
    let c = crate::sys::cstring(&path.to_string_lossy())?;
    // SAFETY: valid C path; makedev is pure arithmetic.
    crate::sys::cvt(unsafe {
        libc::mknod(
            c.as_ptr(),
            libc::S_IFCHR | 0o600,
            libc::makedev(major, minor),
        )
    })?;
    Ok(())
}

/// Find and open the agent port, waiting for it as long as it takes.
pub fn open_port() -> File {
    if std::process::id() != 1 {
        // Development: serve a descriptor handed over by a test harness.
        if let Some(fd) = std::env::var("SANDPIT_AGENT_FD")
            .ok()
            .and_then(|s| s.parse::<i32>().ok())
        {
            crate::info!("serving inherited fd {fd}");
            // SAFETY: the harness passed us this descriptor to own.
            return unsafe { File::from_raw_fd(fd) };
        }
    }
    let name = sandpit_protocol::AGENT_PORT_NAME;
    let mut attempt: u64 = 0;
    loop {
        if let Some((path, devnum)) = find_port(
            Path::new("/sys/class/virtio-ports"),
            Path::new("/dev"),
            name,
        ) {
            if !path.exists() {
                let _ = mknod_port(&path, &devnum);
            }
            match OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(libc::O_CLOEXEC | libc::O_NOCTTY)
                .open(&path)
            {
                Ok(f) => {
                    crate::info!("serving on {} ({name})", path.display());
                    return f;
                }
                Err(e) => {
                    if attempt.is_multiple_of(50) {
                        crate::error!("cannot open {}: {e}", path.display());
                    }
                }
            }
        } else if attempt == 50 || (attempt > 0 && attempt.is_multiple_of(600)) {
            crate::error!("virtio port {name} not found yet; still waiting");
        }
        attempt += 1;
        // Fast retries while the device is being probed, then slowly.
        let pause = if attempt < 100 { 100 } else { 1000 };
        thread::sleep(Duration::from_millis(pause));
    }
}

/// Ask the kernel for SIGIO when the host (re)connects or sends data.
fn enable_sigio(port: &File) {
    let fd = port.as_raw_fd();
    // SAFETY: fcntl on our own descriptor.
    unsafe {
        libc::fcntl(fd, libc::F_SETOWN, libc::getpid());
        let flags = libc::fcntl(fd, libc::F_GETFL);
        if flags >= 0 && libc::fcntl(fd, libc::F_SETFL, flags | libc::O_ASYNC) < 0 {
            crate::error!("O_ASYNC on the port: {}", io::Error::last_os_error());
        }
    }
}

/// Start the writer thread for `port`.
pub fn start_writer(port: Arc<File>) -> io::Result<Outbox> {
    let out = Outbox::new(port);
    let writer = out.clone();
    thread::Builder::new()
        .name("writer".into())
        .spawn(move || write_frames(&writer))?;
    Ok(out)
}

fn write_frames(out: &Outbox) {
    let mut failures: u64 = 0;
    loop {
        let (gen, frame) = out.take();
        let result = if gen < generation() {
            Ok(false)
        } else {
            write_frame(&out.inner.port, &frame, || gen >= generation())
        };
        out.written();
        match result {
            Ok(_) => failures = 0,
            Err(e) => {
                failures += 1;
                if failures.is_power_of_two() {
                    crate::error!("writing to the host: {e} ({failures} failures)");
                }
                if failures > 1 {
                    thread::sleep(Duration::from_millis(100));
                }
            }
        }
    }
}

/// Write one frame whole, or drop it once nobody can read it.
///
/// A write to a virtio port blocks while the host is disconnected and resumes
/// on the next connection, which would then receive the tail of a frame meant
/// for the previous one. poll() says POLLHUP instead. POLLHUP alone does not
/// mean the frame is stale, though: QEMU delivers a new connection's first
/// bytes (its `Hello`) on the data queue and the "host connected" event on the
/// control queue, and the data can win, so the `HelloAck` may be written
/// while the port still looks closed. So while `current()` says the frame
/// belongs to the live session, the writer waits (briefly, in 2 ms naps) for
/// the port to open; once the session has moved on (EOF or a new `Hello`), the
/// frame (or the rest of one cut short) is dropped. Returns whether the frame
/// was written.
fn write_frame(port: &File, frame: &[u8], current: impl Fn() -> bool) -> io::Result<bool> {
    let fd = port.as_raw_fd();
    let mut off = 0;
    let mut naps = 0u32;
    while off < frame.len() {
        let mut p = [libc::pollfd {
            fd,
            events: libc::POLLOUT,
            revents: 0,
        }];
        crate::sys::poll_forever(&mut p)?;
        if p[0].revents & (libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0 {
            // The host is not there (yet).
            if off == 0 && current() && p[0].revents & libc::POLLNVAL == 0 {
                // Short naps first (a connection being opened), longer ones
                // once it looks like the host really left.
                naps += 1;
                thread::sleep(Duration::from_millis(if naps < 100 { 2 } else { 50 }));
                continue;
            }
            return Ok(false);
        }
        let rest = &frame[off..];
        // SAFETY: rest is a valid buffer.
        let n = unsafe { libc::write(fd, rest.as_ptr().cast(), rest.len()) };
        if n < 0 {
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::Interrupted | io::ErrorKind::WouldBlock => continue,
                io::ErrorKind::BrokenPipe => return Ok(false),
                _ => return Err(e),
            }
        }
        off += n as usize;
    }
    Ok(true)
}

/// True when `chunk` begins with a complete `Hello` frame.
///
/// Every host connection opens with `Hello`, and QEMU never puts bytes of two
/// connections in one virtio buffer, so such a chunk marks a new connection
/// even when the disconnect itself went unseen (the host left and came back
/// before the reader ran). Whatever the decoder still holds is then the
/// unfinished frame of the old connection and must be dropped, or it would
/// swallow the new Hello.
pub fn starts_with_hello(chunk: &[u8]) -> bool {
    if !chunk.starts_with(&sandpit_protocol::FRAME_MAGIC) || chunk.len() < 12 {
        return false;
    }
    let header_len = u32::from_be_bytes([chunk[4], chunk[5], chunk[6], chunk[7]]) as usize;
    let body_len = u32::from_be_bytes([chunk[8], chunk[9], chunk[10], chunk[11]]);
    if body_len != 0 || header_len > 1024 || chunk.len() < 12 + header_len {
        return false;
    }
    matches!(
        serde_json::from_slice::<Message>(&chunk[12..12 + header_len]),
        Ok(Message::Hello { .. })
    )
}

/// What the reader tells the server.
pub trait Handler {
    /// A complete frame arrived.
    fn frame(&mut self, frame: Frame);
    /// Bytes that were not a valid frame.
    fn bad_frame(&mut self, error: FrameError);
    /// The host closed its end.
    fn disconnected(&mut self);
}

/// Read frames forever (only returns by panicking out of a handler).
pub fn read_frames(port: &File, handler: &mut dyn Handler) {
    enable_sigio(port);
    let sigio = crate::sys::sigset(&[libc::SIGIO]);
    let mut decoder = FrameDecoder::new();
    let mut buf = vec![0u8; 64 * 1024];
    let mut connected = false;
    let mut gone_since: Option<Instant> = None;
    let mut failures: u64 = 0;
    loop {
        match (&*port).read(&mut buf) {
            Ok(0) => {
                if connected {
                    connected = false;
                    gone_since = Some(Instant::now());
                }
                let mut nap = Duration::from_secs(1);
                if let Some(since) = gone_since {
                    let gone_for = since.elapsed();
                    if gone_for >= HOST_GONE_GRACE {
                        gone_since = None;
                        decoder.reset();
                        handler.disconnected();
                    } else {
                        nap = HOST_GONE_GRACE - gone_for;
                    }
                }
                crate::sys::wait_signal(&sigio, Some(nap));
            }
            Ok(n) => {
                connected = true;
                gone_since = None;
                failures = 0;
                if starts_with_hello(&buf[..n]) {
                    decoder.reset();
                }
                decoder.push(&buf[..n]);
                loop {
                    match decoder.next_frame() {
                        Ok(Some(frame)) => handler.frame(frame),
                        Ok(None) => break,
                        Err(e) => handler.bad_frame(e),
                    }
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                failures += 1;
                if failures.is_power_of_two() {
                    crate::error!("reading from the host: {e} ({failures} failures)");
                }
                crate::sys::wait_signal(&sigio, Some(Duration::from_secs(1)));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;
    use std::sync::mpsc;

    /// An outbox writing to a socket, and the socket's other end.
    fn socket_outbox() -> (Outbox, UnixStream) {
        let (a, b) = UnixStream::pair().unwrap();
        let port = Arc::new(File::from(std::os::fd::OwnedFd::from(a)));
        (start_writer(port).unwrap(), b)
    }

    /// Decode `n` frames from `peer`: (request id, body length) each.
    fn read_frames_from(peer: &mut UnixStream, n: usize) -> Vec<(u64, usize)> {
        let mut d = FrameDecoder::new();
        let mut got = Vec::new();
        let mut buf = vec![0u8; 64 * 1024];
        while got.len() < n {
            while let Some(f) = d.next_frame().unwrap() {
                match f.message {
                    Message::Stdout { id } => got.push((id, f.body.len())),
                    m => panic!("unexpected {m:?}"),
                }
            }
            if got.len() < n {
                let k = peer.read(&mut buf).unwrap();
                assert!(k > 0, "the outbox's end closed");
                d.push(&buf[..k]);
            }
        }
        got
    }

    #[test]
    fn frames_of_concurrent_senders_arrive_whole_and_in_each_senders_order() {
        let (out, mut peer) = socket_outbox();
        let senders: Vec<_> = (0..4u64)
            .map(|t| {
                let reply = Reply::new(u64::MAX, out.clone());
                thread::spawn(move || {
                    for i in 0..50u64 {
                        // Small frames (written at once) and large ones
                        // (queued), mixed.
                        let len = if i % 3 == 0 { 20_000 } else { 10 };
                        let body = vec![t as u8; len];
                        reply.send(&Message::Stdout { id: t * 1000 + i }, &body);
                    }
                })
            })
            .collect();
        let got = read_frames_from(&mut peer, 200);
        for s in senders {
            s.join().unwrap();
        }
        for t in 0..4u64 {
            let mine: Vec<u64> = got
                .iter()
                .filter(|(id, _)| id / 1000 == t)
                .map(|(id, _)| id % 1000)
                .collect();
            assert_eq!(mine, (0..50).collect::<Vec<_>>(), "sender {t}");
        }
        for (id, len) in got {
            assert_eq!(len, if id % 1000 % 3 == 0 { 20_000 } else { 10 });
        }
    }

    #[test]
    fn a_full_port_queues_small_frames_instead_of_blocking_the_sender() {
        let (out, mut peer) = socket_outbox();
        let reply = Reply::new(u64::MAX, out.clone());
        // Fill the socket: the writer thread blocks inside a large frame.
        let big = vec![1u8; 1 << 20];
        reply.send(&Message::Stdout { id: 0 }, &big);
        thread::sleep(Duration::from_millis(100));
        let (done_tx, done_rx) = mpsc::channel();
        let r = reply.clone();
        thread::spawn(move || {
            for i in 1..=10 {
                r.send(&Message::Stdout { id: i }, b"x");
            }
            done_tx.send(()).unwrap();
        });
        done_rx
            .recv_timeout(Duration::from_secs(5))
            .expect("small frames were queued, not blocked on");
        let got = read_frames_from(&mut peer, 11);
        let ids: Vec<u64> = got.iter().map(|(id, _)| *id).collect();
        assert_eq!(ids, (0..=10).collect::<Vec<_>>());
        assert_eq!(got[0].1, 1 << 20);
        // Once drained, a small frame is written by its sender.
        reply.send(&Message::Stdout { id: 11 }, b"y");
        assert_eq!(read_frames_from(&mut peer, 1), vec![(11, 1)]);
    }

    fn scratch(name: &str) -> PathBuf {
        let d =
            std::env::temp_dir().join(format!("sandpit-agent-test-{}-{name}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn finds_the_named_port() {
        let sys = scratch("ports");
        for (dir, name) in [
            ("vport0p0", "org.qemu.guest_agent.0"),
            ("vport1p1", "sandpit.agent.0"),
        ] {
            fs::create_dir(sys.join(dir)).unwrap();
            fs::write(sys.join(dir).join("name"), format!("{name}\n")).unwrap();
            fs::write(sys.join(dir).join("dev"), "244:1\n").unwrap();
        }
        fs::create_dir(sys.join("vport2p0")).unwrap(); // unnamed port
        let (path, dev) = find_port(&sys, Path::new("/dev"), "sandpit.agent.0").unwrap();
        assert_eq!(path, Path::new("/dev/vport1p1"));
        assert_eq!(dev, "244:1");
        assert!(find_port(&sys, Path::new("/dev"), "other").is_none());
        fs::remove_dir_all(sys).unwrap();
    }

    #[test]
    fn recognises_a_new_connection_by_its_hello() {
        let hello = encode_frame(
            &Message::Hello {
                protocol: 1,
                nonce: 5,
            },
            b"",
        );
        assert!(starts_with_hello(&hello));
        let mut more = hello.clone();
        more.extend(encode_frame(&Message::Ping { id: 1 }, b""));
        assert!(starts_with_hello(&more));
        assert!(!starts_with_hello(&hello[..hello.len() - 1]));
        assert!(!starts_with_hello(&hello[1..]));
        assert!(!starts_with_hello(&encode_frame(
            &Message::Ping { id: 1 },
            b""
        )));
        assert!(!starts_with_hello(&encode_frame(
            &Message::Hello {
                protocol: 1,
                nonce: 5
            },
            b"x"
        )));

        // An old connection's unfinished frame does not swallow the new Hello.
        let mut d = FrameDecoder::new();
        let big = encode_frame(&Message::FileData { id: 3 }, &[7u8; 1000]);
        d.push(&big[..500]);
        assert!(d.next_frame().unwrap().is_none());
        if starts_with_hello(&hello) {
            d.reset();
        }
        d.push(&hello);
        assert!(matches!(
            d.next_frame().unwrap().unwrap().message,
            Message::Hello { nonce: 5, .. }
        ));
    }

    #[test]
    fn frames_to_an_absent_host_are_dropped_not_blocked_on() {
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let file = File::from(std::os::fd::OwnedFd::from(a));
        assert!(write_frame(&file, b"hello", || false).unwrap());
        drop(b);
        // The peer is gone: POLLHUP, the frame is dropped, nothing blocks.
        assert!(!write_frame(&file, &[0u8; 1 << 20], || false).unwrap());
    }

    #[test]
    fn stale_replies_are_dropped() {
        let (tx, rx) = mpsc::sync_channel(4);
        let out = Outbox::for_test(tx);
        let old = Reply::new(generation(), out.clone());
        old.send(&Message::Ping { id: 1 }, b"");
        assert!(rx.try_recv().is_ok());
        let g = new_session();
        old.send(&Message::Ping { id: 2 }, b"");
        assert!(rx.try_recv().is_err());
        Reply::new(g, out).send(&Message::Ping { id: 3 }, b"");
        assert!(rx.try_recv().is_ok());
    }
}
