//! Streaming a command's stdout and stderr to the host.
//!
//! The thread that waits for a command polls both pipes along with the
//! shell's pidfd (and its cancel eventfd), and forwards each read as a frame
//! at once (no buffering to the end). Past `max_output_bytes` a stream is still read, so
//! the command never blocks on a full pipe, but the bytes are only counted.
//!
//! A command is over when its shell exits, even if a background child
//! (`server &`) still holds the pipes. Then the pump takes what is already in
//! the pipes without blocking and hands the still-open pipes to one shared
//! discard thread, which reads and drops until EOF, so the background process
//! neither blocks on a full pipe nor dies of SIGPIPE.

use crate::processes::Followers;
use crate::sys::{self, lock, EventFd};
use sandpit_protocol::{RequestId, CHUNK_LEN};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

/// Byte accounting of one output stream.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StreamAcct {
    /// Bytes the command wrote (forwarded or not).
    pub total: u64,
    /// Some bytes were dropped past the limit.
    pub truncated: bool,
    max: u64,
}

impl StreamAcct {
    pub fn new(max: u64) -> Self {
        StreamAcct {
            total: 0,
            truncated: false,
            max,
        }
    }

    /// Account `n` new bytes; returns how many of them to forward.
    pub fn accept(&mut self, n: usize) -> usize {
        let room = self.max.saturating_sub(self.total);
        let forward = (n as u64).min(room) as usize;
        self.total = self.total.saturating_add(n as u64);
        if forward < n {
            self.truncated = true;
        }
        forward
    }
}

/// Most bytes taken from one pipe after the shell exited, before what is left
/// goes to the discard thread (a background process may write forever).
const FINAL_DRAIN_LIMIT: usize = 4 * 1024 * 1024;

struct Stream {
    fd: Option<OwnedFd>,
    acct: StreamAcct,
    stderr: bool,
}

/// A command's two output streams, forwarded by the thread that waits for
/// the command (see `exec`).
pub struct Output {
    fwd: Forwarder,
    streams: [Stream; 2],
    buf: Vec<u8>,
}

impl Output {
    pub fn new(
        id: RequestId,
        followers: Arc<Followers>,
        stdout: OwnedFd,
        stderr: Option<OwnedFd>,
        max_output_bytes: u64,
    ) -> Self {
        let stream = |fd, stderr| Stream {
            fd,
            acct: StreamAcct::new(max_output_bytes),
            stderr,
        };
        Output {
            fwd: Forwarder { id, followers },
            streams: [stream(Some(stdout), false), stream(stderr, true)],
            buf: vec![0u8; CHUNK_LEN],
        }
    }

    /// Forward output until one of `wake` is readable or `timeout` passes
    /// (`None`: no timeout); returns which of `wake` are readable. Returns
    /// early, with none, when a signal interrupts the wait. The timeout holds
    /// even while output never stops coming.
    pub fn pump<const N: usize>(
        &mut self,
        wake: [RawFd; N],
        timeout: Option<Duration>,
    ) -> io::Result<[bool; N]> {
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        loop {
            let open: Vec<usize> = (0..2).filter(|&i| self.streams[i].fd.is_some()).collect();
            let mut fds: Vec<libc::pollfd> = open
                .iter()
                .map(|&i| sys::pollin(self.streams[i].fd.as_ref().unwrap().as_raw_fd()))
                .chain(wake.iter().map(|&fd| sys::pollin(fd)))
                .collect();
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if sys::poll(&mut fds, left)? == 0 {
                // Timed out or interrupted.
                return Ok([false; N]);
            }
            for (k, &i) in open.iter().enumerate() {
                if sys::ready(&fds[k]) {
                    self.fwd.read_once(&mut self.streams[i], &mut self.buf);
                }
            }
            let woken: [bool; N] = std::array::from_fn(|k| sys::ready(&fds[open.len() + k]));
            if woken.contains(&true) || deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok(woken);
            }
        }
    }

    /// The shell has exited: take what is in the pipes now, hand pipes still
    /// held open (by a background process) to the discard thread, and return
    /// the stdout and stderr accounting.
    pub fn finish(mut self) -> (StreamAcct, StreamAcct) {
        for s in self.streams.iter_mut() {
            self.fwd.finish(s, &mut self.buf);
        }
        (self.streams[0].acct, self.streams[1].acct)
    }
}

/// Sends what is read to whoever follows the command (see `processes`).
struct Forwarder {
    /// The request that started it, for the log.
    id: RequestId,
    followers: Arc<Followers>,
}

impl Forwarder {
    /// One read; returns false when the stream is done (EOF or error) or has
    /// nothing right now (EAGAIN).
    fn read_once(&self, s: &mut Stream, buf: &mut [u8]) -> bool {
        let Some(fd) = s.fd.as_ref() else {
            return false;
        };
        match sys::read_fd(fd.as_raw_fd(), buf) {
            Ok(0) => {
                s.fd = None;
                false
            }
            Ok(n) => {
                let forward = s.acct.accept(n);
                if forward > 0 {
                    self.followers.output(s.stderr, &buf[..forward]);
                }
                true
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => false,
            // A terminal's master side once nothing holds the other: its
            // end of file.
            Err(e) if e.raw_os_error() == Some(libc::EIO) => {
                s.fd = None;
                false
            }
            Err(e) => {
                crate::error!("exec {}: reading output: {e}", self.id);
                s.fd = None;
                false
            }
        }
    }

    /// The shell exited: take what is buffered now, leave the rest to the
    /// discard thread.
    fn finish(&self, s: &mut Stream, buf: &mut [u8]) {
        let Some(fd) = s.fd.as_ref() else { return };
        if sys::set_nonblocking(fd.as_raw_fd(), true).is_err() {
            // Cannot read without risking a block: leave it all to discard.
            discard(s.fd.take().unwrap());
            return;
        }
        let before = s.acct.total;
        while s.fd.is_some() && s.acct.total - before < FINAL_DRAIN_LIMIT as u64 {
            if !self.read_once(s, buf) {
                break;
            }
        }
        if let Some(fd) = s.fd.take() {
            discard(fd);
        }
    }
}

struct Discarder {
    tx: Sender<OwnedFd>,
    wake: Arc<EventFd>,
}

static DISCARDER: Mutex<Option<Discarder>> = Mutex::new(None);

/// Read and drop everything from `fd` until EOF, on the shared discard thread.
pub fn discard(fd: OwnedFd) {
    let mut d = lock(&DISCARDER);
    if d.is_none() {
        match start_discarder() {
            Ok(new) => *d = Some(new),
            Err(e) => {
                // Closing the pipe is the only option left.
                crate::error!("cannot start the discard thread: {e}");
                return;
            }
        }
    }
    let d = d.as_ref().unwrap();
    if d.tx.send(fd).is_ok() {
        d.wake.signal();
    }
}

fn start_discarder() -> io::Result<Discarder> {
    let wake = Arc::new(EventFd::new()?);
    let (tx, rx) = mpsc::channel::<OwnedFd>();
    let w = wake.clone();
    thread::Builder::new()
        .name("discard".into())
        .spawn(move || {
            let mut fds: Vec<OwnedFd> = Vec::new();
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                w.clear();
                while let Ok(fd) = rx.try_recv() {
                    let _ = sys::set_nonblocking(fd.as_raw_fd(), true);
                    fds.push(fd);
                }
                let mut polls: Vec<libc::pollfd> =
                    fds.iter().map(|f| sys::pollin(f.as_raw_fd())).collect();
                polls.push(sys::pollin(w.raw()));
                if sys::poll_forever(&mut polls).is_err() {
                    continue;
                }
                let mut closed = vec![false; fds.len()];
                for (i, p) in polls[..fds.len()].iter().enumerate() {
                    if !sys::ready(p) {
                        continue;
                    }
                    // A bounded number of reads per wake-up keeps it fair.
                    for _ in 0..16 {
                        match sys::read_fd(fds[i].as_raw_fd(), &mut buf) {
                            Ok(0) => {
                                closed[i] = true;
                                break;
                            }
                            Ok(_) => {}
                            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                            Err(_) => {
                                closed[i] = true;
                                break;
                            }
                        }
                    }
                }
                let mut i = 0;
                fds.retain(|_| {
                    let keep = !closed[i];
                    i += 1;
                    keep
                });
            }
        })?;
    Ok(Discarder { tx, wake })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::channel::{Outbox, Reply};
    use sandpit_protocol::Message;
    use std::io::Write;
    use std::os::fd::FromRawFd;

    #[test]
    fn accounting_truncates_at_the_limit() {
        let mut a = StreamAcct::new(10);
        assert_eq!(a.accept(4), 4);
        assert_eq!(a.accept(4), 4);
        assert!(!a.truncated);
        assert_eq!(a.accept(4), 2);
        assert!(a.truncated);
        assert_eq!(a.accept(100), 0);
        assert_eq!(a.total, 112);
        let mut z = StreamAcct::new(0);
        assert_eq!(z.accept(0), 0);
        assert!(!z.truncated);
        assert_eq!(z.accept(1), 0);
        assert!(z.truncated);
    }

    fn pipe() -> (OwnedFd, std::fs::File) {
        let mut fds = [0; 2];
        // SAFETY: valid array for pipe2.
        assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
        // SAFETY: both descriptors are new and owned here.
        unsafe {
            (
                OwnedFd::from_raw_fd(fds[0]),
                std::fs::File::from_raw_fd(fds[1]),
            )
        }
    }

    #[test]
    fn the_timeout_holds_while_output_never_stops() {
        // /dev/zero: always readable, never at EOF, like a command that
        // writes faster than it is read.
        let flood: OwnedFd = std::fs::File::open("/dev/zero").unwrap().into();
        let (err_r, _err_w) = pipe();
        let (tx, rx) = mpsc::sync_channel(1 << 10);
        let reply = Reply::new(u64::MAX, Outbox::for_test(tx));
        let mut output = Output::new(9, Followers::first(9, reply), flood, Some(err_r), 100_000);
        let (done_tx, done_rx) = mpsc::channel();
        thread::spawn(move || {
            let wake = EventFd::new().unwrap();
            let ready = output.pump([wake.raw()], Some(Duration::from_millis(200)));
            let _ = done_tx.send(ready.unwrap());
        });
        let ready = done_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("pump ran on past its 200 ms timeout");
        assert_eq!(ready, [false]);
        assert!(rx.try_iter().count() > 0, "output was forwarded meanwhile");
    }

    #[test]
    fn output_is_forwarded_counted_and_open_pipes_handed_off() {
        let (out_r, mut out_w) = pipe();
        let (err_r, mut err_w) = pipe();
        let (tx, rx) = mpsc::sync_channel(64);
        let reply = Reply::new(u64::MAX, Outbox::for_test(tx));
        let exited = Arc::new(EventFd::new().unwrap());
        let mut output = Output::new(9, Followers::first(9, reply), out_r, Some(err_r), 5);
        let wake = exited.clone();
        let h = thread::spawn(move || {
            // Nothing to wake for within the timeout: output is forwarded.
            let idle = output.pump([wake.raw()], Some(Duration::from_millis(50)));
            assert_eq!(idle.unwrap(), [false]);
            loop {
                match output.pump([wake.raw()], None).unwrap() {
                    [true] => return output.finish(),
                    [false] => continue,
                }
            }
        });
        out_w.write_all(b"hello world").unwrap();
        err_w.write_all(b"e").unwrap();
        drop(err_w);
        // stdout stays open, like a background process holding it.
        std::thread::sleep(std::time::Duration::from_millis(100));
        out_w.write_all(b"!").unwrap();
        exited.signal();
        let (o, e) = h.join().unwrap();
        assert_eq!(o.total, 12);
        assert!(o.truncated);
        assert_eq!(e.total, 1);
        assert!(!e.truncated);
        let mut stdout = Vec::new();
        let mut stderr = Vec::new();
        while let Ok((_, frame)) = rx.try_recv() {
            let mut d = sandpit_protocol::FrameDecoder::new();
            d.push(&frame);
            let f = d.next_frame().unwrap().unwrap();
            match f.message {
                Message::Stdout { id: 9 } => stdout.extend(f.body),
                Message::Stderr { id: 9 } => stderr.extend(f.body),
                m => panic!("unexpected {m:?}"),
            }
        }
        assert_eq!(stdout, b"hello");
        assert_eq!(stderr, b"e");
        // The writer can keep writing: the discard thread drains the pipe.
        for _ in 0..64 {
            out_w.write_all(&[0u8; 4096]).unwrap();
        }
    }
}
