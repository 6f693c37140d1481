//! The node's internal API: HTTP/2 over mutual TLS (see [`crate::tls`]),
//! served by a node to the other members of its cluster. It is the core's
//! [`Machines`] trait over the network, one route per method, so a member
//! reaches another node's VMs exactly as its own.
//!
//! Every call names the epoch of the node it means (`x-sandpit-node-epoch`,
//! as the database shows it): a node answers only calls for the epoch it
//! holds now, so a call routed by a member that read the database before
//! the node restarted, or a node that was fenced (declared lost while it
//! was stopped or cut off) and has not joined again, changes nothing.
//!
//! Arguments travel as JSON: the whole body, or its first line when bytes
//! follow (a command's cancel, a file's content). A runtime failure is
//! HTTP 422 with the error's kind ([`wire::WireError`]); the node's own
//! refusals (epoch, route) carry `{"error": {"type", "message"}}`.

use crate::wire::{self, time_of, DownloadMeta, WatchFrame};
use bytes::{Bytes, BytesMut};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::{Frame, Incoming};
use hyper::{Request, Response, StatusCode};
use sandpit_host::machines::{
    Command, Download, Machines, PtySize, Started, Terminal, Upload, VmResult, Watch,
    TERMINAL_QUEUE,
};
use sandpit_protocol::ExecRequest;
use sandpit_runtime::vm::volumes::VmVolume;
use sandpit_runtime::{GuestExecEvent, RuntimeError};
use serde::{Deserialize, Serialize};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_rustls::rustls;

/// The header that names the epoch a call is meant for.
pub const EPOCH_HEADER: &str = "x-sandpit-node-epoch";

/// How long a TLS handshake may take.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The longest JSON head a call may start with (a command line is up to
/// the API's own limit, well under this).
const MAX_HEAD: usize = 4 << 20;

/// What a node says about itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Health {
    pub name: String,
    pub epoch: i64,
}

/// What the API needs of the node that serves it.
#[async_trait::async_trait]
pub trait NodeState: Send + Sync + 'static {
    /// The node's name.
    fn name(&self) -> &str;
    /// The epoch it holds now; `None` while it is fenced (it lost its lease
    /// and has not joined again).
    fn epoch(&self) -> Option<i64>;
    /// Its VMs.
    fn machines(&self) -> Arc<dyn Machines>;
    /// Starts the VM of sandbox `id`, which a member recorded on this node,
    /// and records the outcome so that it survives a caller lost mid-way
    /// (a node does it with [`sandpit_host::recording::RecordedStarts`]).
    async fn start(
        &self,
        id: &str,
        size: &str,
        snapshot: Option<&str>,
        expires_at: time::OffsetDateTime,
        egress: sandpit_runtime::Egress,
        volumes: Vec<VmVolume>,
    ) -> Result<Started, RuntimeError>;
}

pub(crate) type Body = BoxBody<Bytes, std::convert::Infallible>;

/// A body fed by a channel: a streamed answer, or a request body the caller
/// keeps writing to.
pub struct ChannelBody(pub(crate) mpsc::Receiver<Bytes>);

impl hyper::body::Body for ChannelBody {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        self.0.poll_recv(cx).map(|b| b.map(|b| Ok(Frame::data(b))))
    }
}

pub(crate) fn full(b: Bytes) -> Body {
    Full::new(b).map_err(|never| match never {}).boxed()
}

/// The error body of the node's own refusals.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct ErrorBody {
    pub(crate) error: ErrorDetail,
}

#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct ErrorDetail {
    pub(crate) r#type: String,
    pub(crate) message: String,
}

fn json<T: Serialize>(status: StatusCode, body: &T) -> Response<Body> {
    let mut r = Response::new(full(Bytes::from(
        serde_json::to_vec(body).expect("serialisable"),
    )));
    *r.status_mut() = status;
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    r
}

fn refusal(status: StatusCode, kind: &str, message: String) -> Response<Body> {
    json(
        status,
        &ErrorBody {
            error: ErrorDetail {
                r#type: kind.into(),
                message,
            },
        },
    )
}

fn bad_request(message: String) -> Response<Body> {
    refusal(StatusCode::BAD_REQUEST, "invalid_request", message)
}

/// A runtime failure, with its kind.
fn failed(e: &RuntimeError) -> Response<Body> {
    json(
        StatusCode::UNPROCESSABLE_ENTITY,
        &wire::Failure { runtime: e.into() },
    )
}

/// The answer of a call that gives back `T`.
fn answer<T: Serialize>(outcome: Result<T, RuntimeError>) -> Response<Body> {
    match outcome {
        Ok(v) => json(StatusCode::OK, &v),
        Err(e) => failed(&e),
    }
}

/// One request, after TLS has admitted its sender.
async fn handle(state: Arc<dyn NodeState>, req: Request<Incoming>) -> Response<Body> {
    let Some(epoch) = state.epoch() else {
        return refusal(
            StatusCode::SERVICE_UNAVAILABLE,
            "fenced",
            format!(
                "node {} lost its lease and is joining again; nothing it held is served",
                state.name()
            ),
        );
    };
    let asked = req
        .headers()
        .get(EPOCH_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<i64>().ok());
    if asked != Some(epoch) {
        return refusal(
            StatusCode::CONFLICT,
            "stale_epoch",
            format!(
                "node {} is at epoch {epoch}, this call is for {}: read the node again",
                state.name(),
                asked.map_or_else(|| "none".to_string(), |e| e.to_string())
            ),
        );
    }
    let path = req.uri().path().to_string();
    let segments: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let method = req.method().clone();
    let vms = state.machines();
    let mut body = Head::new(req.into_body());
    match (&method, segments.as_slice()) {
        (&hyper::Method::GET, ["node", "v1", "health"]) => json(
            StatusCode::OK,
            &Health {
                name: state.name().to_string(),
                epoch,
            },
        ),
        (&hyper::Method::POST, ["node", "v1", "snapshots", snapshot, "delete"]) => {
            let snapshot = snapshot.to_string();
            answer(detached(async move { vms.delete_snapshot(&snapshot).await }).await)
        }
        (&hyper::Method::POST, ["node", "v1", "snapshots", "held"]) => {
            answer(vms.held_parts().await.map(|parts| wire::Held { parts }))
        }
        (&hyper::Method::POST, ["node", "v1", "snapshots", snapshot, "send"]) => {
            match body.json::<wire::Held>().await {
                Ok(a) => send_from(vms.send_snapshot(snapshot, a.parts).await),
                Err(r) => r,
            }
        }
        // A snapshot another node sends: the caller relays it.
        (&hyper::Method::POST, ["node", "v1", "snapshots", snapshot, "receive"]) => {
            match body.json::<wire::FileArgs>().await {
                Ok(a) => {
                    receive_into(vms.receive_snapshot(snapshot, a.size).await, a.size, body).await
                }
                Err(r) => r,
            }
        }
        // A volume's file is made, grown or removed even if its caller
        // goes: the caller's row says what became of it.
        (&hyper::Method::POST, ["node", "v1", "volumes", id, "create"]) => {
            match body.json::<wire::VolumeArgs>().await {
                Ok(a) => {
                    let id = id.to_string();
                    answer(detached(async move { vms.create_volume(&id, a.bytes).await }).await)
                }
                Err(r) => r,
            }
        }
        (&hyper::Method::POST, ["node", "v1", "volumes", id, "resize"]) => {
            match body.json::<wire::VolumeArgs>().await {
                Ok(a) => {
                    let id = id.to_string();
                    answer(detached(async move { vms.resize_volume(&id, a.bytes).await }).await)
                }
                Err(r) => r,
            }
        }
        (&hyper::Method::POST, ["node", "v1", "volumes", id, "delete"]) => {
            let id = id.to_string();
            answer(detached(async move { vms.delete_volume(&id).await }).await)
        }
        // A call on a volume's files runs to its end even if its caller
        // goes (a change half made is worse than one unasked for).
        (&hyper::Method::POST, ["node", "v1", "volumes", id, "call"]) => {
            match body
                .json::<sandpit_runtime::volume_content::VolumeCall>()
                .await
            {
                Ok(call) => {
                    let id = id.to_string();
                    answer(detached(async move { vms.volume_call(&id, call).await }).await)
                }
                Err(r) => r,
            }
        }
        (&hyper::Method::POST, ["node", "v1", "volumes", id, "upload"]) => {
            match body.json::<wire::VolumeUploadArgs>().await {
                Ok(a) => {
                    let upload = vms
                        .volume_upload(id, &a.path, a.size, a.owner, a.overwrite)
                        .await;
                    receive_into(upload, a.size, body).await
                }
                Err(r) => r,
            }
        }
        (&hyper::Method::POST, ["node", "v1", "volumes", id, "send"]) => {
            send_from(vms.send_volume(id).await)
        }
        // A volume another node sends (`sandpit volume move`): the caller
        // relays it.
        (&hyper::Method::POST, ["node", "v1", "volumes", id, "receive"]) => {
            match body.json::<wire::FileArgs>().await {
                Ok(a) => receive_into(vms.receive_volume(id, a.size).await, a.size, body).await,
                Err(r) => r,
            }
        }
        (&hyper::Method::POST, ["node", "v1", "volumes", id, "download"]) => {
            match body.json::<wire::FileArgs>().await {
                Ok(a) => send_from(vms.volume_download(id, &a.path).await),
                Err(r) => r,
            }
        }
        (&hyper::Method::POST, ["node", "v1", "warm", size, "take"]) => {
            answer(vms.take_warm(size).await.map(|id| wire::Warm { id }))
        }
        (&hyper::Method::POST, ["node", "v1", "warm", size, "return", id]) => {
            answer(vms.return_warm(id, size).await)
        }
        // A template build finishes even if its caller goes: the next
        // create of the size finds it.
        (&hyper::Method::POST, ["node", "v1", "sizes", size, "prepare"]) => {
            let size = size.to_string();
            answer(detached(async move { vms.prepare(&size).await }).await)
        }
        (&hyper::Method::POST, ["node", "v1", "sandboxes", id, op]) => {
            let id = id.to_string();
            match *op {
                // A start and a destroy finish even if their caller goes
                // (a replica killed mid-create): each runs in a task of its
                // own, and the outcome is recorded where a retry finds it.
                "start" => match body.json::<wire::StartArgs>().await {
                    Ok(a) => answer(
                        detached(async move {
                            state
                                .start(
                                    &id,
                                    &a.size,
                                    a.snapshot.as_deref(),
                                    time_of(a.expires_at_ms),
                                    a.egress,
                                    a.volumes,
                                )
                                .await
                        })
                        .await,
                    ),
                    Err(r) => r,
                },
                // Like a start, a snapshot or a restore finishes (or
                // cleans up after itself) even if its caller goes.
                "snapshot" => match body.json::<wire::SnapshotArgs>().await {
                    Ok(a) => answer(
                        detached(async move { vms.snapshot(&id, &a.snapshot).await })
                            .await
                            .map(|bytes| wire::SnapshotTaken { bytes }),
                    ),
                    Err(r) => r,
                },
                "pause" => answer(detached(async move { vms.pause(&id).await }).await),
                "resume" => match body.json::<wire::ResumeArgs>().await {
                    Ok(a) => answer(
                        detached(async move {
                            vms.resume(&id, time_of(a.at_ms), a.egress, a.volumes).await
                        })
                        .await,
                    ),
                    Err(r) => r,
                },
                "restore" => match body.json::<wire::SnapshotArgs>().await {
                    Ok(a) => answer(
                        detached(async move {
                            vms.restore(
                                &id,
                                &a.snapshot,
                                time_of(a.expires_at_ms),
                                a.egress,
                                a.volumes,
                            )
                            .await
                        })
                        .await,
                    ),
                    Err(r) => r,
                },
                "destroy" => answer(
                    detached(async move { vms.destroy(&id).await })
                        .await
                        .map(|disk_used_bytes| wire::Destroyed { disk_used_bytes }),
                ),
                "egress" => match body.json::<wire::EgressArgs>().await {
                    Ok(a) => answer(vms.set_egress(&id, a.egress).await),
                    Err(r) => r,
                },
                "expiry" => match body.json::<wire::ExpiryArgs>().await {
                    Ok(a) => answer(vms.set_expiry(&id, time_of(a.at_ms)).await),
                    Err(r) => r,
                },
                "state" => answer(vms.state(&id).await.map(|vm| wire::State { vm })),
                "exec" => match body.json::<ExecRequest>().await {
                    Ok(request) => follow(vms.exec(&id, request).await, body),
                    Err(r) => r,
                },
                "attach" => match body.json::<wire::AttachArgs>().await {
                    Ok(a) => follow(
                        vms.attach(
                            &id,
                            a.pid,
                            a.max_output_bytes,
                            std::time::Duration::from_millis(a.longest_ms),
                        )
                        .await,
                        body,
                    ),
                    Err(r) => r,
                },
                "processes" => answer(vms.processes(&id).await),
                "stats" => answer(vms.stats(&id).await),
                "secrets-used" => answer(vms.secrets_used(&id).await),
                "process" => match body.json::<wire::ProcessArgs>().await {
                    Ok(a) => answer(vms.process_call(&id, a.pid, a.call, a.input).await),
                    Err(r) => r,
                },
                "upload" => upload(vms, id, body).await,
                "download" => match body.json::<wire::FileArgs>().await {
                    Ok(a) => download(vms, id, a).await,
                    Err(r) => r,
                },
                "pty" => terminal(vms, id, body).await,
                "watch" => match body.json::<wire::WatchArgs>().await {
                    Ok(a) => watch(vms.watch_dir(&id, &a.path, a.recursive).await, body),
                    Err(r) => r,
                },
                "list" => match body.json::<wire::FileArgs>().await {
                    Ok(a) => answer(
                        vms.list_files(&id, &a.path, a.recursive, a.max_entries)
                            .await,
                    ),
                    Err(r) => r,
                },
                "path" => match body.json::<sandpit_protocol::PathCall>().await {
                    Ok(call) => answer(vms.path_call(&id, call).await),
                    Err(r) => r,
                },
                "delete" => match body.json::<wire::FileArgs>().await {
                    Ok(a) => answer(
                        vms.delete_file(&id, &a.path, a.recursive)
                            .await
                            .map(|path| wire::Written { path, bytes: 0 }),
                    ),
                    Err(r) => r,
                },
                _ => not_found(&method, &path),
            }
        }
        (&hyper::Method::POST, ["node", "v1", "sandboxes", id, "tunnel", port]) => {
            match port.parse::<u16>() {
                Ok(port) => tunnel(vms, id.to_string(), port, body).await,
                Err(_) => bad_request(format!("port {port:?}")),
            }
        }
        _ => not_found(&method, &path),
    }
}

/// Runs `work` to its end whether or not the call that asked for it is
/// still there.
async fn detached<T: Send + 'static>(
    work: impl Future<Output = Result<T, RuntimeError>> + Send + 'static,
) -> Result<T, RuntimeError> {
    tokio::spawn(work)
        .await
        .unwrap_or_else(|e| Err(RuntimeError::Launch(format!("the node's task failed: {e}"))))
}

fn not_found(method: &hyper::Method, path: &str) -> Response<Body> {
    refusal(
        StatusCode::NOT_FOUND,
        "not_found",
        format!("no route {method} {path}"),
    )
}

/// A request body read as a JSON head (its first line) and the bytes that
/// follow it.
pub(crate) struct Head {
    body: Incoming,
    /// Read past the head, not yet handed out.
    buf: BytesMut,
    ended: bool,
}

impl Head {
    fn new(body: Incoming) -> Head {
        Head {
            body,
            buf: BytesMut::new(),
            ended: false,
        }
    }

    /// The JSON head: the first line, or the whole body if it has no
    /// newline.
    async fn json<T: serde::de::DeserializeOwned>(&mut self) -> Result<T, Response<Body>> {
        let line = loop {
            if let Some(i) = self.buf.iter().position(|&b| b == b'\n') {
                break self.buf.split_to(i + 1);
            }
            if self.buf.len() > MAX_HEAD {
                return Err(bad_request("the call's arguments are too long".into()));
            }
            match self.more().await {
                Some(()) => {}
                None if !self.buf.is_empty() => break self.buf.split(),
                None => return Err(bad_request("the body ended before the arguments".into())),
            }
        };
        serde_json::from_slice(&line).map_err(|e| bad_request(format!("the arguments: {e}")))
    }

    /// Reads one more frame into the buffer; `None` at the body's end.
    async fn more(&mut self) -> Option<()> {
        if self.ended {
            return None;
        }
        loop {
            match self.body.frame().await {
                Some(Ok(f)) => {
                    if let Ok(d) = f.into_data() {
                        self.buf.extend_from_slice(&d);
                        return Some(());
                    }
                }
                _ => {
                    self.ended = true;
                    return None;
                }
            }
        }
    }

    /// The next bytes after the head; `None` at the body's end.
    async fn next(&mut self) -> Option<Bytes> {
        if self.buf.is_empty() {
            self.more().await?;
        }
        Some(self.buf.split().freeze())
    }
}

fn streamed(rx: mpsc::Receiver<Bytes>, content_type: &'static str) -> Response<Body> {
    let mut r = Response::new(ChannelBody(rx).boxed());
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static(content_type),
    );
    r
}

/// A command started or attached to: its events stream back as frames;
/// `cancel\n` on the request body cancels it (kills it, or for one that
/// keeps running stops following it), and so does the caller going away.
fn follow(command: VmResult<Box<dyn Command>>, mut body: Head) -> Response<Body> {
    let mut command = match command {
        Ok(c) => c,
        Err(e) => return failed(&e),
    };
    let (tx, rx) = mpsc::channel::<Bytes>(16);
    tokio::spawn(async move {
        let mut upstream_open = true;
        let mut pending = BytesMut::new();
        loop {
            let event = tokio::select! {
                ev = command.next() => ev,
                more = body.next(), if upstream_open => {
                    match more {
                        Some(b) => {
                            pending.extend_from_slice(&b);
                            if pending.windows(7).any(|w| w == b"cancel\n") {
                                command.cancel();
                                pending.clear();
                            }
                        }
                        // The caller writes until the command's end: a
                        // body that ends first is a caller that went (a
                        // replica killed): the command goes too.
                        None => {
                            upstream_open = false;
                            command.cancel();
                        }
                    }
                    continue;
                }
            };
            let last = !matches!(
                event,
                Ok(GuestExecEvent::Started(_))
                    | Ok(GuestExecEvent::Stdout(_))
                    | Ok(GuestExecEvent::Stderr(_))
            );
            if tx.send(wire::encode(&event)).await.is_err() {
                // The caller went: dropping the command kills it.
                return;
            }
            if last {
                return;
            }
        }
    });
    streamed(rx, "application/x-sandpit-exec")
}

/// A directory watched: its resolved path, then its events stream back as
/// frames until it ends; the caller's body ending (the caller went) stops
/// it.
fn watch(watched: VmResult<Box<dyn Watch>>, mut body: Head) -> Response<Body> {
    let mut watched = match watched {
        Ok(w) => w,
        Err(e) => return failed(&e),
    };
    let (tx, rx) = mpsc::channel::<Bytes>(16);
    let start = wire::encode_watch(&Ok(WatchFrame::Watching(watched.path().to_string())));
    tokio::spawn(async move {
        if tx.send(start).await.is_err() {
            return;
        }
        loop {
            let next = tokio::select! {
                next = watched.next() => next,
                more = body.next() => match more {
                    Some(_) => continue,
                    None => return,
                },
            };
            let frame = match next {
                Ok(Some(events)) => Ok(WatchFrame::Events(events)),
                Ok(None) => Ok(WatchFrame::Ended),
                Err(e) => Err(e),
            };
            let last = !matches!(frame, Ok(WatchFrame::Events(_)));
            if tx.send(wire::encode_watch(&frame)).await.is_err() || last {
                return;
            }
        }
    });
    streamed(rx, "application/x-sandpit-watch")
}

/// A file written from the bytes after the head; the answer comes once
/// the guest has it all.
async fn upload(vms: Arc<dyn Machines>, id: String, mut body: Head) -> Response<Body> {
    let args: wire::FileArgs = match body.json().await {
        Ok(a) => a,
        Err(r) => return r,
    };
    receive_into(
        vms.upload(&id, &args.path, args.size).await,
        args.size,
        body,
    )
    .await
}

/// The `size` bytes after the head written to `upload`; the answer comes
/// once it has them all.
async fn receive_into(
    upload: VmResult<Box<dyn Upload>>,
    size: u64,
    mut body: Head,
) -> Response<Body> {
    let mut upload = match upload {
        Ok(u) => u,
        Err(e) => return failed(&e),
    };
    let mut got = 0u64;
    while let Some(piece) = body.next().await {
        got += piece.len() as u64;
        if got > size {
            return bad_request(format!("more than the {size} bytes announced"));
        }
        if let Err(e) = upload.send(&piece).await {
            return failed(&e);
        }
    }
    if got != size {
        // The caller went mid-way: dropping the upload discards it.
        return bad_request(format!("{got} bytes of the {size} announced"));
    }
    answer(
        upload
            .finish()
            .await
            .map(|(path, bytes)| wire::Written { path, bytes }),
    )
}

/// A file read: its head, then its pieces, as frames.
async fn download(vms: Arc<dyn Machines>, id: String, args: wire::FileArgs) -> Response<Body> {
    send_from(vms.download(&id, &args.path, args.max_bytes).await)
}

/// A stream read: its head (name and size), then its pieces, as frames.
fn send_from(download: VmResult<Box<dyn Download>>) -> Response<Body> {
    let mut download = match download {
        Ok(d) => d,
        Err(e) => return failed(&e),
    };
    let (tx, rx) = mpsc::channel::<Bytes>(4);
    let meta = wire::encode_meta(&DownloadMeta {
        path: download.path().to_string(),
        size: download.size(),
    });
    tokio::spawn(async move {
        if tx.send(meta).await.is_err() {
            return;
        }
        loop {
            let (frame, last) = match download.next_chunk().await {
                Ok(Some(piece)) => (wire::encode(&Ok(GuestExecEvent::Stdout(piece))), false),
                Ok(None) => return,
                Err(e) => (wire::encode(&Err(e)), true),
            };
            if tx.send(frame).await.is_err() || last {
                return;
            }
        }
    });
    streamed(rx, "application/x-sandpit-download")
}

/// A TCP connection to a port in the guest: the request body carries the
/// caller's bytes, the answer's body the guest's; the end of either is the
/// end of that direction.
async fn tunnel(vms: Arc<dyn Machines>, id: String, port: u16, mut body: Head) -> Response<Body> {
    let tunnel = match vms.open_tunnel(&id, port).await {
        Ok(t) => t,
        Err(e) => return failed(&e),
    };
    let (mut reader, mut writer) = tokio::io::split(tunnel.stream);
    let (tx, rx) = mpsc::channel::<Bytes>(4);
    let closer = tunnel.closer;
    let inbound = tokio::spawn(async move {
        while let Some(piece) = body.next().await {
            if writer.write_all(&piece).await.is_err() {
                return;
            }
        }
        let _ = writer.shutdown().await;
    });
    tokio::spawn(async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match reader.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if tx.send(Bytes::copy_from_slice(&buf[..n])).await.is_err() {
                        break;
                    }
                }
            }
        }
        // Either side gone: the guest's connection goes too.
        inbound.abort();
        closer();
    });
    streamed(rx, "application/octet-stream")
}

/// A terminal: its size is the head, its keystrokes and sizes follow on
/// the request body, its output comes back on the answer's; the end of the
/// request body hangs it up.
async fn terminal(vms: Arc<dyn Machines>, id: String, mut body: Head) -> Response<Body> {
    let size: PtySize = match body.json().await {
        Ok(s) => s,
        Err(r) => return r,
    };
    let Terminal {
        input,
        mut output,
        closer,
    } = match vms.open_pty(&id, size).await {
        Ok(t) => t,
        Err(e) => return failed(&e),
    };
    let (tx, rx) = mpsc::channel::<Bytes>(TERMINAL_QUEUE);
    let typing = tokio::spawn(async move {
        let mut pending = BytesMut::new();
        loop {
            loop {
                match wire::decode_pty_input(&mut pending) {
                    Ok(Some(item)) => {
                        if input.send(item).await.is_err() {
                            return;
                        }
                    }
                    Ok(None) => break,
                    Err(e) => {
                        tracing::warn!("a terminal's input: {e}");
                        return;
                    }
                }
            }
            match body.next().await {
                Some(piece) => pending.extend_from_slice(&piece),
                // The caller hung up: so does the terminal (`input` drops).
                None => return,
            }
        }
    });
    tokio::spawn(async move {
        while let Some(item) = output.recv().await {
            if tx.send(wire::encode_pty_output(&item)).await.is_err() {
                break;
            }
        }
        // The terminal ended, or the caller is gone.
        typing.abort();
        closer();
    });
    streamed(rx, "application/x-sandpit-pty")
}

/// Serves the API on `listener` until `shutdown` completes. A peer that
/// shows no certificate of the cluster CA fails the TLS handshake and is
/// never read from.
pub async fn serve(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    state: Arc<dyn NodeState>,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    tokio::pin!(shutdown);
    loop {
        let (tcp, peer) = tokio::select! {
            _ = &mut shutdown => return Ok(()),
            accepted = listener.accept() => accepted?,
        };
        let acceptor = acceptor.clone();
        let state = state.clone();
        tokio::spawn(async move {
            let _ = tcp.set_nodelay(true);
            let tls = match tokio::time::timeout(CONNECT_TIMEOUT, acceptor.accept(tcp)).await {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => {
                    tracing::warn!(%peer, "refused a connection to the node API: {e}");
                    return;
                }
                Err(_) => return,
            };
            let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                let state = state.clone();
                async move { Ok::<_, std::convert::Infallible>(handle(state, req).await) }
            });
            let io = hyper_util::rt::TokioIo::new(tls);
            let conn =
                hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                    .serve_connection(io, service);
            if let Err(e) = conn.await {
                tracing::debug!(%peer, "node API connection: {e}");
            }
        });
    }
}
