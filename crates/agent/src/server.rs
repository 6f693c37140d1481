//! Dispatch: what the reader thread does with each frame.
//!
//! The reader never blocks on slow work: quick requests (Ping, Cancel, Hello)
//! are answered inline, everything else gets a thread of its own (tunnel
//! frames are queued to their stream's thread; send_window bounds that queue). The reader
//! only keeps the upload table (WriteFile id -> channel to its thread), since
//! it is the one routing FileData frames.
//!
//! A panic in a handler is caught and reported as an `Io` error: PID 1 must
//! never die.

use crate::channel::{self, Handler, Outbox, Reply};
use crate::{config, exec, files, processes, pty, sys, tunnel, volumes, watch};
use sandpit_protocol::{
    AgentError, DoneResult, ErrorKind, Frame, FrameError, Message, RequestId, PROTOCOL_GENERATION,
};
use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{self, SyncSender};
use std::thread;

/// FileData chunks queued per upload before the reader waits for the disk.
const UPLOAD_QUEUE: usize = 16;

struct Upload {
    tx: SyncSender<Vec<u8>>,
    remaining: u64,
}

pub struct Server {
    out: Outbox,
    uploads: HashMap<RequestId, Upload>,
}

/// Run `work` on a new thread; a panic or a failure to start becomes an error
/// reply.
fn spawn_worker<F>(reply: Reply, id: RequestId, name: &str, work: F)
where
    F: FnOnce(&Reply) -> Result<(), AgentError> + Send + 'static,
{
    let r = reply.clone();
    let spawned = thread::Builder::new().name(name.into()).spawn(move || {
        let outcome = catch_unwind(AssertUnwindSafe(|| work(&r)));
        match outcome {
            Ok(Ok(())) => {}
            Ok(Err(e)) => r.error(id, e),
            Err(_) => r.error(id, AgentError::new(ErrorKind::Io, "internal error")),
        }
    });
    if let Err(e) = spawned {
        reply.error(
            id,
            AgentError::new(ErrorKind::Io, format!("cannot start a thread: {e}")),
        );
    }
}

impl Server {
    pub fn new(out: Outbox) -> Self {
        Server {
            out,
            uploads: HashMap::new(),
        }
    }

    /// Forget the requests of ended sessions.
    fn end_sessions_before(&mut self, gen: u64) {
        exec::cancel_sessions_before(gen);
        tunnel::close_sessions_before(gen);
        watch::stop_sessions_before(gen);
        // Dropping the senders makes the upload threads give up.
        self.uploads.clear();
    }

    fn dispatch(&mut self, frame: Frame) {
        let reply = Reply::new(channel::generation(), self.out.clone());
        let Frame { message, body } = frame;
        match message {
            Message::Hello { protocol, nonce } => {
                let gen = channel::new_session();
                self.end_sessions_before(gen);
                let (kernel_release, hostname) = sys::uname();
                crate::info!("session {gen}: host speaks protocol {protocol}");
                Reply::new(gen, self.out.clone()).send(
                    &Message::HelloAck {
                        protocol: PROTOCOL_GENERATION,
                        nonce,
                        agent_version: env!("CARGO_PKG_VERSION").to_string(),
                        kernel_release,
                        hostname,
                        features: sandpit_protocol::FEATURES
                            .iter()
                            .map(|f| f.to_string())
                            .collect(),
                    },
                    &[],
                );
            }
            Message::Ping { id } => reply.done(id, DoneResult::Pong),
            Message::Configure { id, config } => {
                spawn_worker(reply, id, "configure", move |r| {
                    config::configure(&config, &body)?;
                    r.done(id, DoneResult::Configured);
                    Ok(())
                });
            }
            Message::Exec { id, request } => exec::start(reply, id, request),
            Message::Cancel { id } => {
                // A write the host gave up on: its thread sees the data
                // end, removes its temporary file and answers nothing.
                if self.uploads.remove(&id).is_some() || files::close_read(id) {
                    return;
                }
                // A watch answers `Cancelled` itself.
                if watch::stop(id) {
                    return;
                }
                // The Exited of the command is the answer.
                if !exec::cancel(id) {
                    reply.error(
                        id,
                        AgentError::new(
                            ErrorKind::NotFound,
                            format!("no running command with id {id}"),
                        ),
                    );
                }
            }
            Message::WriteFile {
                id,
                path,
                size,
                mode,
            } => self.write_file(reply, id, path, size, mode),
            Message::FileData { id } => self.file_data(id, body),
            Message::ReadFile {
                id,
                path,
                max_bytes,
                window,
            } => {
                // Registered here, on the reader thread, before any ack
                // or cancel for it can arrive.
                let send_window = window.map(|w| files::open_read(id, w));
                spawn_worker(reply, id, "read-file", move |r| {
                    let read = files::read_file(r, id, &path, max_bytes, send_window.as_deref());
                    if send_window.is_some() {
                        files::close_read(id);
                    }
                    read
                });
            }
            Message::FileAck { id, bytes } => files::ack_read(id, bytes),
            Message::ListFiles {
                id,
                path,
                recursive,
                max_entries,
            } => {
                spawn_worker(reply, id, "list-files", move |r| {
                    r.done(id, files::list(&path, recursive, max_entries)?);
                    Ok(())
                });
            }
            Message::DeleteFile {
                id,
                path,
                recursive,
            } => {
                spawn_worker(reply, id, "delete-file", move |r| {
                    r.done(id, files::delete(&path, recursive)?);
                    Ok(())
                });
            }
            Message::PathCall { id, call } => {
                spawn_worker(reply, id, "path-call", move |r| {
                    r.done(id, files::path_call(call)?);
                    Ok(())
                });
            }
            Message::ProcessAttach { id, pid } => processes::attach(reply, id, pid),
            Message::ProcessList { id } => reply.done(id, processes::list()),
            Message::Stats { id } => match crate::stats::read() {
                Ok(stats) => reply.done(id, DoneResult::Stats { stats }),
                Err(e) => reply.error(id, e),
            },
            Message::Clock { id, step_ns } => match crate::clock::step_and_read(step_ns) {
                Ok(unix_ns) => reply.done(id, DoneResult::Clock { unix_ns }),
                Err(e) => reply.error(id, e),
            },
            Message::ProcessCall { id, pid, call } => {
                // Input may wait for the command to read it.
                spawn_worker(reply, id, "process-call", move |r| {
                    r.done(id, processes::call(pid, call, &body)?);
                    Ok(())
                });
            }
            Message::WatchDir {
                id,
                path,
                recursive,
            } => {
                // Registered here, on the reader thread, before a cancel
                // for it can arrive.
                let stop = match watch::register(id, reply.generation()) {
                    Ok(stop) => stop,
                    Err(e) => return reply.error(id, e),
                };
                spawn_worker(reply, id, "watch-dir", move |r| {
                    let watched = watch::run(r, id, &path, recursive, &stop);
                    watch::unregister(id);
                    watched
                });
            }
            Message::MountVolume {
                id,
                serial,
                path,
                read_only,
            } => {
                // As root: mounting is the host's to ask, not the user's.
                spawn_worker(reply, id, "mount-volume", move |r| {
                    r.done(id, volumes::mount(&serial, &path, read_only)?);
                    Ok(())
                });
            }
            Message::SyncVolume { id, path, unmount } => {
                spawn_worker(reply, id, "sync-volume", move |r| {
                    r.done(id, volumes::sync(&path, unmount)?);
                    Ok(())
                });
            }
            Message::PowerOff { id } => power_off(&reply, id),
            Message::TunnelOpen { id, port, window } => tunnel::open(reply, id, port, window),
            Message::TunnelData { id } => tunnel::data(id, body),
            Message::TunnelAck { id, bytes } => tunnel::ack(id, bytes),
            Message::TunnelShutdown { id } => tunnel::shutdown(id),
            Message::TunnelClose { id } => tunnel::close(id),
            Message::PtyOpen {
                id,
                rows,
                cols,
                window,
            } => pty::open(reply, id, rows, cols, window),
            Message::PtyResize { id, rows, cols } => tunnel::resize(id, rows, cols),
            other => {
                let id = other.request_id().unwrap_or(0);
                reply.error(
                    id,
                    AgentError::new(ErrorKind::InvalidRequest, "not a host-to-guest message"),
                );
            }
        }
    }

    fn write_file(
        &mut self,
        reply: Reply,
        id: RequestId,
        path: String,
        size: u64,
        mode: Option<u32>,
    ) {
        if self.uploads.contains_key(&id) {
            reply.error(
                id,
                AgentError::new(
                    ErrorKind::InvalidRequest,
                    format!("a write with id {id} is already open"),
                ),
            );
            return;
        }
        let (tx, rx) = mpsc::sync_channel(UPLOAD_QUEUE);
        if size > 0 {
            self.uploads.insert(
                id,
                Upload {
                    tx,
                    remaining: size,
                },
            );
        }
        let spawned_ok = {
            let r = reply.clone();
            thread::Builder::new()
                .name("write-file".into())
                .spawn(move || {
                    let outcome = catch_unwind(AssertUnwindSafe(|| {
                        files::write_file(&path, size, mode, rx)
                    }));
                    match outcome {
                        Ok(Ok(Some(done))) => r.done(id, done),
                        Ok(Ok(None)) => {} // session ended midway
                        Ok(Err(e)) => r.error(id, e),
                        Err(_) => r.error(id, AgentError::new(ErrorKind::Io, "internal error")),
                    }
                })
                .map_err(|e| {
                    reply.error(
                        id,
                        AgentError::new(ErrorKind::Io, format!("cannot start a thread: {e}")),
                    )
                })
                .is_ok()
        };
        if !spawned_ok {
            self.uploads.remove(&id);
        }
    }

    /// Route a FileData body to its upload. Data for an upload that already
    /// failed (and answered) is dropped quietly.
    fn file_data(&mut self, id: RequestId, body: Vec<u8>) {
        let Some(up) = self.uploads.get_mut(&id) else {
            return;
        };
        let len = body.len() as u64;
        let finished = len >= up.remaining;
        up.remaining = up.remaining.saturating_sub(len);
        // Blocks when the disk is slower than the host: back-pressure.
        let gone = up.tx.send(body).is_err();
        if finished || gone {
            self.uploads.remove(&id);
        }
    }
}

fn power_off(reply: &Reply, id: RequestId) {
    crate::info!("powering off");
    // SAFETY: plain syscalls.
    unsafe { libc::sync() };
    if !crate::is_pid1() {
        reply.error(
            id,
            AgentError::new(ErrorKind::Unsupported, "not PID 1; not powering off"),
        );
        return;
    }
    // SAFETY: plain syscall; only returns on failure.
    unsafe { libc::reboot(libc::RB_POWER_OFF) };
    let e = std::io::Error::last_os_error();
    crate::error!("power off failed: {e}");
    reply.error(
        id,
        AgentError::new(ErrorKind::Io, format!("power off failed: {e}")),
    );
}

/// How an undecodable frame is answered: a message type this generation does
/// not know is `Unsupported` (the protocol's versioning rule); anything else
/// is `InvalidRequest`.
pub fn bad_frame_error(e: &FrameError) -> AgentError {
    let kind = match e {
        FrameError::BadHeader(j) if j.to_string().contains("unknown variant") => {
            ErrorKind::Unsupported
        }
        _ => ErrorKind::InvalidRequest,
    };
    AgentError::new(kind, e.to_string())
}

impl Handler for Server {
    fn frame(&mut self, frame: Frame) {
        if catch_unwind(AssertUnwindSafe(|| self.dispatch(frame))).is_err() {
            crate::error!("a request handler panicked; serving on");
        }
    }

    fn bad_frame(&mut self, e: FrameError) {
        crate::error!("bad frame: {e}");
        Reply::new(channel::generation(), self.out.clone()).error(0, bad_frame_error(&e));
    }

    fn disconnected(&mut self) {
        let gen = channel::new_session();
        crate::info!("host disconnected");
        self.end_sessions_before(gen);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sandpit_protocol::FrameDecoder;

    fn frame_error(header: &str) -> FrameError {
        let mut bytes = sandpit_protocol::FRAME_MAGIC.to_vec();
        bytes.extend_from_slice(&(header.len() as u32).to_be_bytes());
        bytes.extend_from_slice(&0u32.to_be_bytes());
        bytes.extend_from_slice(header.as_bytes());
        let mut d = FrameDecoder::new();
        d.push(&bytes);
        d.next_frame().unwrap_err()
    }

    #[test]
    fn undecodable_frames_are_classified() {
        let e = bad_frame_error(&frame_error(r#"{"type":"teleport","id":3}"#));
        assert_eq!(e.kind, ErrorKind::Unsupported);
        let e = bad_frame_error(&frame_error(r#"{"type":"ping"}"#));
        assert_eq!(e.kind, ErrorKind::InvalidRequest);
        let e = bad_frame_error(&frame_error("not json"));
        assert_eq!(e.kind, ErrorKind::InvalidRequest);
    }

    #[test]
    fn file_data_is_routed_until_the_announced_size() {
        let (tx, _rx) = mpsc::sync_channel(64);
        let mut s = Server::new(Outbox::for_test(tx));
        let (up_tx, up_rx) = mpsc::sync_channel(16);
        s.uploads.insert(
            1,
            Upload {
                tx: up_tx,
                remaining: 5,
            },
        );
        s.file_data(1, vec![1, 2]);
        assert!(s.uploads.contains_key(&1));
        s.file_data(1, vec![3, 4, 5]);
        assert!(!s.uploads.contains_key(&1));
        s.file_data(1, vec![6]); // dropped quietly
        let got: Vec<u8> = up_rx.iter().flatten().collect();
        assert_eq!(got, vec![1, 2, 3, 4, 5]);
    }
}
