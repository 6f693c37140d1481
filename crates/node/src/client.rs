//! The calling side of the node API: [`NodeClient`] keeps one HTTP/2
//! connection per node, and [`RemoteNode`] is a node's VMs as the core's
//! [`Machines`], so the service reaches them exactly as its own.
//!
//! Failures of the link itself (no connection, a stale epoch, a fenced
//! node) reach the core as [`RuntimeError::Disconnected`]: "retry", which
//! is what helps; the runtime's own failures arrive with their kind.

use crate::server::{full, Body, ChannelBody, ErrorBody, Health, EPOCH_HEADER};
use crate::tls;
use crate::wire::{self, ms, DownloadFrame, WatchFrame};
use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::{Request, Response};
use sandpit_host::machines::{
    Command, Download, Duplex, Listing, Machines, Ownership, PtyInput, PtyOutput, PtySize, Started,
    Terminal, Tunnel, Upload, VmResult, VolumeCall, VolumeEntry, Watch, TERMINAL_QUEUE,
};
use sandpit_protocol::ExecRequest;
use sandpit_runtime::vm::volumes::VmVolume;
use sandpit_runtime::{Egress, GuestExecEvent, RuntimeError, VmState};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::sync::Arc;
use std::time::Duration;
use time::OffsetDateTime;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio_rustls::rustls;

/// How long a call waits for the head of the node's answer, unless it
/// says otherwise (a command's events and a download's pieces stream after
/// it, bounded by their own deadlines).
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(15);

/// How long a start may take on the node (it bounds the boot itself).
const START_TIMEOUT: Duration = Duration::from_secs(300);

/// How long the guest may take to answer a file call once it has the
/// whole request (the runtime's own deadline, and some).
const FILE_TIMEOUT: Duration =
    Duration::from_secs(sandpit_runtime::channel::REPLY_DEADLINE.as_secs() + 15);

/// What a call to a node can fail with.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// No connection (refused, timed out, the TLS handshake failed: a
    /// certificate that is not the cluster's, on either side).
    #[error("node {address} unreachable: {message}")]
    Unreachable { address: String, message: String },
    /// The node holds another epoch than the caller read.
    #[error("{0}")]
    StaleEpoch(String),
    /// The node lost its lease and serves nothing until it joins again.
    #[error("{0}")]
    Fenced(String),
    /// The runtime on the node failed.
    #[error("{0}")]
    Runtime(RuntimeError),
    /// Any other answer.
    #[error("node answered {status}: {message}")]
    Failed { status: u16, message: String },
}

impl From<NodeError> for RuntimeError {
    fn from(e: NodeError) -> Self {
        match e {
            NodeError::Runtime(e) => e,
            other => RuntimeError::Disconnected(other.to_string()),
        }
    }
}

/// A member's client of nodes' APIs.
#[derive(Clone)]
pub struct NodeClient {
    tls: tokio_rustls::TlsConnector,
    /// One HTTP/2 connection per node, shared by every call to it (streams
    /// are multiplexed), so a call pays for no handshake; a closed one is
    /// replaced at the next call.
    connections: Arc<std::sync::Mutex<std::collections::HashMap<String, Sender>>>,
}

type Sender = hyper::client::conn::http2::SendRequest<Body>;

impl NodeClient {
    pub fn new(tls: Arc<rustls::ClientConfig>) -> NodeClient {
        NodeClient {
            tls: tokio_rustls::TlsConnector::from(tls),
            connections: Default::default(),
        }
    }

    /// The VMs of the node at `address` (`host:port`, the host as in its
    /// certificate), called at `epoch`.
    pub fn node(&self, address: &str, epoch: i64) -> RemoteNode {
        RemoteNode {
            client: self.clone(),
            address: address.to_string(),
            epoch,
        }
    }

    /// The connection to `address`: the open one, or a new one.
    async fn sender(&self, address: &str) -> Result<Sender, NodeError> {
        let open = self
            .connections
            .lock()
            .expect("not poisoned")
            .get(address)
            .filter(|s| !s.is_closed())
            .cloned();
        if let Some(mut s) = open {
            if s.ready().await.is_ok() {
                return Ok(s);
            }
        }
        let s = self.connect(address).await?;
        self.connections
            .lock()
            .expect("not poisoned")
            .insert(address.to_string(), s.clone());
        Ok(s)
    }

    /// `GET /node/v1/health` of the node at `address`, meant for `epoch`.
    pub async fn health(&self, address: &str, epoch: i64) -> Result<Health, NodeError> {
        let req = Request::get(format!("https://{address}/node/v1/health"))
            .header(EPOCH_HEADER, epoch.to_string())
            .body(full(Bytes::new()))
            .expect("a valid request");
        let resp = self.send(address, req, RESPONSE_TIMEOUT).await?;
        parse(address, resp).await
    }

    /// Sends `req` and waits for the answer's head (not its body) for
    /// `timeout` at most. A connection that fails or times out is dropped,
    /// so the next call makes a new one.
    async fn send(
        &self,
        address: &str,
        req: Request<Body>,
        timeout: Duration,
    ) -> Result<Response<Incoming>, NodeError> {
        let mut sender = self.sender(address).await?;
        let outcome = tokio::time::timeout(timeout, sender.send_request(req)).await;
        let message = match outcome {
            Ok(Ok(resp)) => return Ok(resp),
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("no answer within {timeout:?}"),
        };
        self.connections
            .lock()
            .expect("not poisoned")
            .remove(address);
        Err(NodeError::Unreachable {
            address: address.to_string(),
            message,
        })
    }

    /// An HTTP/2 connection to the node at `address`, after both ends
    /// showed the cluster's certificates.
    async fn connect(&self, address: &str) -> Result<Sender, NodeError> {
        let unreachable = |message: String| NodeError::Unreachable {
            address: address.to_string(),
            message,
        };
        let name = tls::server_name(address).map_err(|e| unreachable(e.to_string()))?;
        let connect = async {
            let tcp = TcpStream::connect(address).await?;
            tcp.set_nodelay(true)?;
            self.tls.connect(name, tcp).await
        };
        let stream = tokio::time::timeout(crate::server::CONNECT_TIMEOUT, connect)
            .await
            .map_err(|_| {
                unreachable(format!(
                    "no connection within {:?}",
                    crate::server::CONNECT_TIMEOUT
                ))
            })?
            .map_err(|e| unreachable(e.to_string()))?;
        let (sender, conn) = hyper::client::conn::http2::handshake(
            hyper_util::rt::TokioExecutor::new(),
            hyper_util::rt::TokioIo::new(stream),
        )
        .await
        .map_err(|e| unreachable(e.to_string()))?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(sender)
    }
}

/// The whole body of a node's answer.
async fn read_body(address: &str, resp: Response<Incoming>) -> Result<Bytes, NodeError> {
    match resp.into_body().collect().await {
        Ok(b) => Ok(b.to_bytes()),
        Err(e) => Err(NodeError::Unreachable {
            address: address.to_string(),
            message: e.to_string(),
        }),
    }
}

/// What a node answered that is not a success.
fn answer_error(status: u16, body: &[u8]) -> NodeError {
    if status == 422 {
        if let Ok(f) = serde_json::from_slice::<wire::Failure>(body) {
            return NodeError::Runtime(f.runtime.into());
        }
    }
    let (kind, message) = match serde_json::from_slice::<ErrorBody>(body) {
        Ok(b) => (b.error.r#type, b.error.message),
        Err(_) => (String::new(), String::from_utf8_lossy(body).into_owned()),
    };
    match kind.as_str() {
        "stale_epoch" => NodeError::StaleEpoch(message),
        "fenced" => NodeError::Fenced(message),
        _ => NodeError::Failed { status, message },
    }
}

/// A success's JSON, or the failure it is.
async fn parse<T: DeserializeOwned>(
    address: &str,
    resp: Response<Incoming>,
) -> Result<T, NodeError> {
    let status = resp.status().as_u16();
    let body = read_body(address, resp).await?;
    if status != 200 {
        return Err(answer_error(status, &body));
    }
    serde_json::from_slice(&body).map_err(|e| NodeError::Failed {
        status,
        message: format!("an unreadable answer: {e}"),
    })
}

/// Fails with the answer's error unless it is a success.
async fn ok(address: &str, resp: Response<Incoming>) -> Result<Response<Incoming>, NodeError> {
    let status = resp.status().as_u16();
    if status == 200 {
        return Ok(resp);
    }
    Err(answer_error(status, &read_body(address, resp).await?))
}

/// The VMs of another node, reached over its API at one epoch.
#[derive(Clone)]
pub struct RemoteNode {
    client: NodeClient,
    address: String,
    epoch: i64,
}

impl RemoteNode {
    fn request(&self, path: &str, body: Body) -> Request<Body> {
        Request::post(format!("https://{}/node/v1/{path}", self.address))
            .header(EPOCH_HEADER, self.epoch.to_string())
            .body(body)
            .expect("a valid request")
    }

    /// A call with a JSON body and a JSON answer.
    async fn call<A: Serialize, T: DeserializeOwned>(
        &self,
        path: &str,
        args: &A,
        timeout: Duration,
    ) -> VmResult<T> {
        let body = full(Bytes::from(serde_json::to_vec(args).expect("json")));
        let resp = self
            .client
            .send(&self.address, self.request(path, body), timeout)
            .await?;
        Ok(parse(&self.address, resp).await?)
    }

    /// A request whose body is `head` as a JSON line, then what is sent
    /// on the returned sender.
    async fn headed<A: Serialize>(
        &self,
        path: &str,
        head: &A,
    ) -> (mpsc::Sender<Bytes>, Request<Body>) {
        let (upstream, rx) = mpsc::channel::<Bytes>(4);
        let mut line = serde_json::to_vec(head).expect("json");
        line.push(b'\n');
        upstream
            .send(Bytes::from(line))
            .await
            .expect("the receiver is here");
        (upstream, self.request(path, ChannelBody(rx).boxed()))
    }

    /// A call whose body is a JSON head, then bytes the caller keeps
    /// writing to the returned sender.
    async fn open<A: Serialize>(
        &self,
        path: &str,
        head: &A,
        timeout: Duration,
    ) -> VmResult<(mpsc::Sender<Bytes>, Response<Incoming>)> {
        let (upstream, req) = self.headed(path, head).await;
        let resp = self.client.send(&self.address, req, timeout).await?;
        Ok((upstream, ok(&self.address, resp).await?))
    }

    /// A command started or attached to on the node (`path` with `head`),
    /// followed for at most `longest` plus the runtime's grace.
    async fn follow<A: Serialize>(
        &self,
        path: &str,
        head: &A,
        longest: Duration,
    ) -> VmResult<Box<dyn Command>> {
        let deadline = tokio::time::Instant::now() + longest + sandpit_runtime::channel::EXEC_GRACE;
        let (upstream, resp) = self.open(path, head, RESPONSE_TIMEOUT).await?;
        Ok(Box::new(RemoteCommand {
            address: self.address.clone(),
            body: resp.into_body(),
            buf: BytesMut::new(),
            upstream: Some(upstream),
            deadline,
        }))
    }

    fn disconnected(&self, e: impl std::fmt::Display) -> RuntimeError {
        RuntimeError::Disconnected(format!("node {}: {e}", self.address))
    }
}

/// No arguments.
#[derive(Serialize)]
struct Nothing {}

#[async_trait]
impl Machines for RemoteNode {
    async fn take_warm(&self, size: &str) -> VmResult<Option<String>> {
        let warm: wire::Warm = self
            .call(&format!("warm/{size}/take"), &Nothing {}, RESPONSE_TIMEOUT)
            .await?;
        Ok(warm.id)
    }

    async fn return_warm(&self, id: &str, size: &str) -> VmResult<()> {
        self.call(
            &format!("warm/{size}/return/{id}"),
            &Nothing {},
            RESPONSE_TIMEOUT,
        )
        .await
    }

    async fn prepare(&self, size: &str) -> VmResult<bool> {
        self.call(&format!("sizes/{size}/prepare"), &Nothing {}, START_TIMEOUT)
            .await
    }

    async fn start(
        &self,
        id: &str,
        size: &str,
        snapshot: Option<&str>,
        expires_at: OffsetDateTime,
        egress: Egress,
        volumes: Vec<VmVolume>,
    ) -> VmResult<Started> {
        let args = wire::StartArgs {
            size: size.to_string(),
            snapshot: snapshot.map(str::to_string),
            expires_at_ms: ms(expires_at),
            egress,
            volumes,
        };
        self.call(&format!("sandboxes/{id}/start"), &args, START_TIMEOUT)
            .await
    }

    async fn snapshot(&self, id: &str, snapshot: &str) -> VmResult<u64> {
        let args = wire::SnapshotArgs {
            snapshot: snapshot.to_string(),
            expires_at_ms: 0,
            egress: Egress::default(),
            volumes: Vec::new(),
        };
        let taken: wire::SnapshotTaken = self
            .call(&format!("sandboxes/{id}/snapshot"), &args, START_TIMEOUT)
            .await?;
        Ok(taken.bytes)
    }

    async fn delete_snapshot(&self, snapshot: &str) -> VmResult<()> {
        self.call(
            &format!("snapshots/{snapshot}/delete"),
            &Nothing {},
            FILE_TIMEOUT,
        )
        .await
    }

    async fn pause(&self, id: &str) -> VmResult<()> {
        self.call(&format!("sandboxes/{id}/pause"), &Nothing {}, START_TIMEOUT)
            .await
    }

    async fn resume(
        &self,
        id: &str,
        expires_at: OffsetDateTime,
        egress: Egress,
        volumes: Vec<VmVolume>,
    ) -> VmResult<()> {
        let args = wire::ResumeArgs {
            at_ms: ms(expires_at),
            egress,
            volumes,
        };
        self.call(&format!("sandboxes/{id}/resume"), &args, START_TIMEOUT)
            .await
    }

    async fn restore(
        &self,
        id: &str,
        snapshot: &str,
        expires_at: OffsetDateTime,
        egress: Egress,
        volumes: Vec<VmVolume>,
    ) -> VmResult<()> {
        let args = wire::SnapshotArgs {
            snapshot: snapshot.to_string(),
            expires_at_ms: ms(expires_at),
            egress,
            volumes,
        };
        self.call(&format!("sandboxes/{id}/restore"), &args, START_TIMEOUT)
            .await
    }

    async fn destroy(&self, id: &str) -> VmResult<Option<u64>> {
        let done: wire::Destroyed = self
            .call(
                &format!("sandboxes/{id}/destroy"),
                &Nothing {},
                FILE_TIMEOUT,
            )
            .await?;
        Ok(done.disk_used_bytes)
    }

    async fn set_egress(&self, id: &str, egress: Egress) -> VmResult<()> {
        let args = wire::EgressArgs { egress };
        self.call(&format!("sandboxes/{id}/egress"), &args, FILE_TIMEOUT)
            .await
    }

    async fn create_volume(&self, id: &str, bytes: u64) -> VmResult<()> {
        let args = wire::VolumeArgs { bytes };
        self.call(&format!("volumes/{id}/create"), &args, START_TIMEOUT)
            .await
    }

    async fn resize_volume(&self, id: &str, bytes: u64) -> VmResult<()> {
        let args = wire::VolumeArgs { bytes };
        self.call(&format!("volumes/{id}/resize"), &args, START_TIMEOUT)
            .await
    }

    async fn delete_volume(&self, id: &str) -> VmResult<()> {
        self.call(&format!("volumes/{id}/delete"), &Nothing {}, FILE_TIMEOUT)
            .await
    }

    async fn volume_call(&self, id: &str, call: VolumeCall) -> VmResult<Vec<VolumeEntry>> {
        self.call(&format!("volumes/{id}/call"), &call, START_TIMEOUT)
            .await
    }

    async fn volume_upload(
        &self,
        id: &str,
        path: &str,
        size: u64,
        owner: Ownership,
        overwrite: bool,
    ) -> VmResult<Box<dyn Upload>> {
        let head = wire::VolumeUploadArgs {
            path: path.to_string(),
            size,
            owner,
            overwrite,
        };
        self.upload_to(&format!("volumes/{id}/upload"), &head).await
    }

    async fn send_volume(&self, id: &str) -> VmResult<Box<dyn Download>> {
        self.download_from(&format!("volumes/{id}/send"), &Nothing {})
            .await
    }

    async fn receive_volume(&self, id: &str, size: u64) -> VmResult<Box<dyn Upload>> {
        let head = wire::FileArgs {
            size,
            ..Default::default()
        };
        self.upload_to(&format!("volumes/{id}/receive"), &head)
            .await
    }

    async fn volume_download(&self, id: &str, path: &str) -> VmResult<Box<dyn Download>> {
        let args = wire::FileArgs {
            path: path.to_string(),
            ..Default::default()
        };
        self.download_from(&format!("volumes/{id}/download"), &args)
            .await
    }

    async fn set_expiry(&self, id: &str, at: OffsetDateTime) -> VmResult<()> {
        let args = wire::ExpiryArgs { at_ms: ms(at) };
        self.call(&format!("sandboxes/{id}/expiry"), &args, RESPONSE_TIMEOUT)
            .await
    }

    async fn state(&self, id: &str) -> VmResult<Option<VmState>> {
        let state: wire::State = self
            .call(
                &format!("sandboxes/{id}/state"),
                &Nothing {},
                RESPONSE_TIMEOUT,
            )
            .await?;
        Ok(state.vm)
    }

    async fn exec(&self, id: &str, request: ExecRequest) -> VmResult<Box<dyn Command>> {
        let longest = Duration::from_millis(request.timeout_ms);
        self.follow(&format!("sandboxes/{id}/exec"), &request, longest)
            .await
    }

    async fn attach(
        &self,
        id: &str,
        pid: u32,
        max_output_bytes: u64,
        longest: Duration,
    ) -> VmResult<Box<dyn Command>> {
        let args = wire::AttachArgs {
            pid,
            max_output_bytes,
            longest_ms: longest.as_millis() as u64,
        };
        self.follow(&format!("sandboxes/{id}/attach"), &args, longest)
            .await
    }

    async fn processes(&self, id: &str) -> VmResult<Vec<sandpit_protocol::ProcessInfo>> {
        self.call(
            &format!("sandboxes/{id}/processes"),
            &Nothing {},
            RESPONSE_TIMEOUT,
        )
        .await
    }

    async fn secrets_used(&self, id: &str) -> VmResult<std::collections::BTreeMap<String, String>> {
        self.call(
            &format!("sandboxes/{id}/secrets-used"),
            &Nothing {},
            RESPONSE_TIMEOUT,
        )
        .await
    }

    async fn stats(&self, id: &str) -> VmResult<sandpit_protocol::GuestStats> {
        self.call(
            &format!("sandboxes/{id}/stats"),
            &Nothing {},
            RESPONSE_TIMEOUT,
        )
        .await
    }

    async fn process_call(
        &self,
        id: &str,
        pid: u32,
        call: sandpit_protocol::ProcessCall,
        input: Vec<u8>,
    ) -> VmResult<()> {
        let args = wire::ProcessArgs { pid, call, input };
        self.call(&format!("sandboxes/{id}/process"), &args, FILE_TIMEOUT)
            .await
    }

    async fn upload(&self, id: &str, path: &str, size: u64) -> VmResult<Box<dyn Upload>> {
        let head = wire::FileArgs {
            path: path.to_string(),
            size,
            ..Default::default()
        };
        self.upload_to(&format!("sandboxes/{id}/upload"), &head)
            .await
    }

    async fn download(&self, id: &str, path: &str, max_bytes: u64) -> VmResult<Box<dyn Download>> {
        let args = wire::FileArgs {
            path: path.to_string(),
            max_bytes,
            ..Default::default()
        };
        self.download_from(&format!("sandboxes/{id}/download"), &args)
            .await
    }

    async fn held_parts(&self) -> VmResult<Vec<String>> {
        let held: wire::Held = self.call("snapshots/held", &(), RESPONSE_TIMEOUT).await?;
        Ok(held.parts)
    }

    async fn send_snapshot(
        &self,
        snapshot: &str,
        held: Vec<String>,
    ) -> VmResult<Box<dyn Download>> {
        self.download_from(
            &format!("snapshots/{snapshot}/send"),
            &wire::Held { parts: held },
        )
        .await
    }

    async fn receive_snapshot(&self, snapshot: &str, size: u64) -> VmResult<Box<dyn Upload>> {
        let head = wire::FileArgs {
            size,
            ..Default::default()
        };
        self.upload_to(&format!("snapshots/{snapshot}/receive"), &head)
            .await
    }

    async fn list_files(
        &self,
        id: &str,
        path: &str,
        recursive: bool,
        max_entries: u64,
    ) -> VmResult<Listing> {
        let args = wire::FileArgs {
            path: path.to_string(),
            recursive,
            max_entries,
            ..Default::default()
        };
        self.call(&format!("sandboxes/{id}/list"), &args, FILE_TIMEOUT)
            .await
    }

    async fn delete_file(&self, id: &str, path: &str, recursive: bool) -> VmResult<String> {
        let args = wire::FileArgs {
            path: path.to_string(),
            recursive,
            ..Default::default()
        };
        let done: wire::Written = self
            .call(&format!("sandboxes/{id}/delete"), &args, FILE_TIMEOUT)
            .await?;
        Ok(done.path)
    }

    async fn path_call(
        &self,
        id: &str,
        call: sandpit_protocol::PathCall,
    ) -> VmResult<sandpit_protocol::PathEntry> {
        self.call(&format!("sandboxes/{id}/path"), &call, FILE_TIMEOUT)
            .await
    }

    async fn watch_dir(&self, id: &str, path: &str, recursive: bool) -> VmResult<Box<dyn Watch>> {
        let args = wire::WatchArgs {
            path: path.to_string(),
            recursive,
        };
        let (upstream, resp) = self
            .open(&format!("sandboxes/{id}/watch"), &args, FILE_TIMEOUT)
            .await?;
        let mut watch = RemoteWatch {
            address: self.address.clone(),
            body: resp.into_body(),
            buf: BytesMut::new(),
            _upstream: upstream,
            path: String::new(),
            ended: false,
        };
        match watch.frame().await? {
            WatchFrame::Watching(path) => watch.path = path,
            other => {
                return Err(self.disconnected(format!("a watch began with {other:?}")));
            }
        }
        Ok(Box::new(watch))
    }

    async fn open_tunnel(&self, id: &str, port: u16) -> VmResult<Tunnel> {
        let (upstream, rx) = mpsc::channel::<Bytes>(4);
        let req = self.request(
            &format!("sandboxes/{id}/tunnel/{port}"),
            ChannelBody(rx).boxed(),
        );
        let resp = self
            .client
            .send(&self.address, req, RESPONSE_TIMEOUT)
            .await?;
        let mut body = ok(&self.address, resp).await?.into_body();
        // The caller's end, and a pump between the other end and the
        // call's two bodies; cutting the tunnel stops the pump, which
        // ends both.
        let (mine, theirs) = tokio::io::duplex(64 * 1024);
        let (mut from_caller, mut to_caller) = tokio::io::split(theirs);
        let pump = tokio::spawn(async move {
            // Each direction owns its halves: the request body ends (the
            // guest sees the caller's half-close) when `upstream` drops.
            let outbound = async move {
                let mut buf = vec![0u8; 64 * 1024];
                loop {
                    match from_caller.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => {
                            if upstream
                                .send(Bytes::copy_from_slice(&buf[..n]))
                                .await
                                .is_err()
                            {
                                return;
                            }
                        }
                    }
                }
            };
            let inbound = async move {
                while let Some(Ok(frame)) = body.frame().await {
                    if let Ok(d) = frame.into_data() {
                        if to_caller.write_all(&d).await.is_err() {
                            return;
                        }
                    }
                }
                let _ = to_caller.shutdown().await;
            };
            tokio::join!(outbound, inbound);
        });
        let abort = pump.abort_handle();
        Ok(Tunnel {
            stream: Box::new(mine) as Box<dyn Duplex>,
            closer: Arc::new(move || abort.abort()),
        })
    }

    async fn open_pty(&self, id: &str, size: PtySize) -> VmResult<Terminal> {
        let (upstream, resp) = self
            .open(&format!("sandboxes/{id}/pty"), &size, RESPONSE_TIMEOUT)
            .await?;
        Ok(self.terminal_over(upstream, resp.into_body()))
    }
}

impl RemoteNode {
    /// A terminal over a call whose request body carries the input frames
    /// and whose answer carries the output frames (see the node's
    /// `terminal`); cutting it ends both bodies.
    fn terminal_over(&self, upstream: mpsc::Sender<Bytes>, mut body: Incoming) -> Terminal {
        let (input, mut typed) = mpsc::channel::<PtyInput>(TERMINAL_QUEUE);
        let (shown, output) = mpsc::channel::<PtyOutput>(TERMINAL_QUEUE);
        let typing = tokio::spawn(async move {
            while let Some(item) = typed.recv().await {
                if upstream.send(wire::encode_pty_input(&item)).await.is_err() {
                    return;
                }
            }
        });
        let address = self.address.clone();
        let showing = tokio::spawn(async move {
            let mut buf = BytesMut::new();
            while let Some(Ok(frame)) = body.frame().await {
                let Ok(data) = frame.into_data() else {
                    continue;
                };
                buf.extend_from_slice(&data);
                loop {
                    match wire::decode_pty_output(&mut buf) {
                        Ok(Some(item)) => {
                            if shown.send(item).await.is_err() {
                                return;
                            }
                        }
                        Ok(None) => break,
                        Err(e) => {
                            tracing::warn!(node = %address, "a terminal's output: {e}");
                            return;
                        }
                    }
                }
            }
        });
        let (typing, showing) = (typing.abort_handle(), showing.abort_handle());
        Terminal {
            input,
            output,
            closer: Arc::new(move || {
                typing.abort();
                showing.abort();
            }),
        }
    }
}

/// A command running on another node. Dropping it before its end resets
/// its stream, and the node kills the command.
/// A directory watched on a node: its frames come on the answer's body;
/// dropping it ends the request's body, and the node stops the watch.
struct RemoteWatch {
    address: String,
    body: Incoming,
    buf: BytesMut,
    _upstream: mpsc::Sender<Bytes>,
    path: String,
    ended: bool,
}

impl RemoteWatch {
    /// The next frame; waits as long as the watch is quiet.
    async fn frame(&mut self) -> VmResult<WatchFrame> {
        let broken = |e: String| RuntimeError::Disconnected(format!("node {}: {e}", self.address));
        loop {
            match wire::decode_watch(&mut self.buf) {
                Ok(Some(frame)) => return frame,
                Ok(None) => {}
                Err(e) => return Err(broken(e)),
            }
            match self.body.frame().await {
                Some(Ok(f)) => {
                    if let Ok(d) = f.into_data() {
                        self.buf.extend_from_slice(&d);
                    }
                }
                Some(Err(e)) => return Err(broken(e.to_string())),
                None => return Err(broken("the watch's stream ended before the watch".into())),
            }
        }
    }
}

#[async_trait]
impl Watch for RemoteWatch {
    fn path(&self) -> &str {
        &self.path
    }

    async fn next(&mut self) -> VmResult<Option<Vec<sandpit_protocol::WatchEvent>>> {
        if self.ended {
            return Ok(None);
        }
        let frame = self.frame().await;
        self.ended = !matches!(frame, Ok(WatchFrame::Events(_)));
        match frame? {
            WatchFrame::Events(events) => Ok(Some(events)),
            WatchFrame::Ended => Ok(None),
            WatchFrame::Watching(_) => Err(RuntimeError::Disconnected(format!(
                "node {}: a watch began twice",
                self.address
            ))),
        }
    }
}

struct RemoteCommand {
    address: String,
    body: Incoming,
    buf: BytesMut,
    upstream: Option<mpsc::Sender<Bytes>>,
    /// The command's own timeout plus the runtime's grace: a node that went
    /// silent (cut off, frozen) does not hold the caller past it.
    deadline: tokio::time::Instant,
}

#[async_trait]
impl Command for RemoteCommand {
    async fn next(&mut self) -> VmResult<GuestExecEvent> {
        loop {
            match wire::decode(&mut self.buf) {
                Ok(Some(event)) => {
                    if !matches!(
                        event,
                        Ok(GuestExecEvent::Started(_))
                            | Ok(GuestExecEvent::Stdout(_))
                            | Ok(GuestExecEvent::Stderr(_))
                    ) {
                        self.upstream = None;
                    }
                    return event;
                }
                Ok(None) => {}
                Err(e) => {
                    return Err(RuntimeError::Disconnected(format!(
                        "node {}: {e}",
                        self.address
                    )))
                }
            }
            let frame = tokio::time::timeout_at(self.deadline, self.body.frame())
                .await
                .map_err(|_| RuntimeError::AgentTimeout {
                    what: format!("the end of a command on node {}", self.address),
                    secs: sandpit_runtime::channel::EXEC_GRACE.as_secs(),
                })?;
            match frame {
                Some(Ok(f)) => {
                    if let Ok(d) = f.into_data() {
                        self.buf.extend_from_slice(&d);
                    }
                }
                Some(Err(e)) => {
                    return Err(RuntimeError::Disconnected(format!(
                        "node {}: {e}",
                        self.address
                    )))
                }
                None => {
                    return Err(RuntimeError::Disconnected(format!(
                        "node {} ended the command's stream before its end",
                        self.address
                    )))
                }
            }
        }
    }

    fn cancel(&self) {
        if let Some(up) = &self.upstream {
            let _ = up.try_send(Bytes::from_static(b"cancel\n"));
        }
    }
}

impl RemoteNode {
    /// A call whose head is `head` and whose bytes follow from the
    /// returned [`Upload`]; the node answers once it has them all.
    async fn upload_to<H: Serialize>(&self, route: &str, head: &H) -> VmResult<Box<dyn Upload>> {
        let (upstream, req) = self.headed(route, head).await;
        // The answer comes once the node has every byte: it is awaited
        // when the upload finishes, while the bytes go.
        let me = self.clone();
        let answer = tokio::spawn(async move {
            let resp = me.client.send(&me.address, req, START_TIMEOUT).await?;
            parse::<wire::Written>(&me.address, resp).await
        });
        Ok(Box::new(RemoteUpload {
            node: self.clone(),
            upstream: Some(upstream),
            answer,
        }))
    }

    /// A call with JSON `args` answered by a stream: its head (a name and
    /// a size), then its pieces.
    async fn download_from<A: Serialize>(
        &self,
        route: &str,
        args: &A,
    ) -> VmResult<Box<dyn Download>> {
        let body = full(Bytes::from(serde_json::to_vec(args).expect("json")));
        let req = self.request(route, body);
        let resp = self.client.send(&self.address, req, FILE_TIMEOUT).await?;
        let resp = ok(&self.address, resp).await?;
        let mut download = RemoteDownload {
            node: self.clone(),
            body: resp.into_body(),
            buf: BytesMut::new(),
            path: String::new(),
            size: 0,
        };
        match download.frame().await? {
            Some(DownloadFrame::Meta(meta)) => {
                download.path = meta.path;
                download.size = meta.size;
                Ok(Box::new(download))
            }
            Some(DownloadFrame::Event(Err(e))) => Err(e),
            _ => Err(self.disconnected("a download without its head")),
        }
    }
}

/// A file being written on another node.
struct RemoteUpload {
    node: RemoteNode,
    upstream: Option<mpsc::Sender<Bytes>>,
    answer: tokio::task::JoinHandle<Result<wire::Written, NodeError>>,
}

impl Drop for RemoteUpload {
    fn drop(&mut self) {
        // Unfinished: the call goes, and the node discards what it had.
        self.answer.abort();
    }
}

#[async_trait]
impl Upload for RemoteUpload {
    async fn send(&mut self, data: &[u8]) -> VmResult<()> {
        let up = self
            .upstream
            .as_ref()
            .ok_or_else(|| self.node.disconnected("the upload was finished"))?;
        if up.send(Bytes::copy_from_slice(data)).await.is_err() {
            // The node answered early: its answer says why.
            let e = match (&mut self.answer).await {
                Ok(Err(e)) => e.into(),
                _ => self.node.disconnected("the upload broke off"),
            };
            return Err(e);
        }
        Ok(())
    }

    async fn finish(mut self: Box<Self>) -> VmResult<(String, u64)> {
        self.upstream = None;
        match (&mut self.answer).await {
            Ok(Ok(w)) => Ok((w.path, w.bytes)),
            Ok(Err(e)) => Err(e.into()),
            Err(e) => Err(self.node.disconnected(e)),
        }
    }
}

/// A file being read from another node.
struct RemoteDownload {
    node: RemoteNode,
    body: Incoming,
    buf: BytesMut,
    path: String,
    size: u64,
}

impl RemoteDownload {
    async fn frame(&mut self) -> VmResult<Option<DownloadFrame>> {
        loop {
            match wire::decode_download(&mut self.buf) {
                Ok(Some(f)) => return Ok(Some(f)),
                Ok(None) => {}
                Err(e) => return Err(self.node.disconnected(e)),
            }
            let frame = tokio::time::timeout(FILE_TIMEOUT, self.body.frame())
                .await
                .map_err(|_| RuntimeError::AgentTimeout {
                    what: format!("a file's next piece from node {}", self.node.address),
                    secs: FILE_TIMEOUT.as_secs(),
                })?;
            match frame {
                Some(Ok(f)) => {
                    if let Ok(d) = f.into_data() {
                        self.buf.extend_from_slice(&d);
                    }
                }
                Some(Err(e)) => return Err(self.node.disconnected(e)),
                None if self.buf.is_empty() => return Ok(None),
                None => return Err(self.node.disconnected("a download cut mid-frame")),
            }
        }
    }
}

#[async_trait]
impl Download for RemoteDownload {
    fn path(&self) -> &str {
        &self.path
    }

    fn size(&self) -> u64 {
        self.size
    }

    async fn next_chunk(&mut self) -> VmResult<Option<Vec<u8>>> {
        match self.frame().await? {
            None => Ok(None),
            Some(DownloadFrame::Event(Ok(GuestExecEvent::Stdout(piece)))) => Ok(Some(piece)),
            Some(DownloadFrame::Event(Err(e))) => Err(e),
            Some(_) => Err(self.node.disconnected("an unexpected frame in a download")),
        }
    }
}

/// A member reaches other nodes through a [`NodeClient`].
impl sandpit_host::machines::NodeLink for NodeClient {
    fn machines(&self, address: &str, epoch: i64) -> Arc<dyn Machines> {
        Arc::new(self.node(address, epoch))
    }
}
