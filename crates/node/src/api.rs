//! The node's internal API: HTTP/2 over mutual TLS (see [`crate::tls`]),
//! served by a node to the control plane.
//!
//! Every call names the epoch of the node it means (`x-sandpit-node-epoch`,
//! as the database shows it): a node answers only calls for the epoch it
//! holds now, so a call routed by a replica that read the database before
//! the node restarted, or a node that was fenced (declared lost while it
//! was stopped or cut off) and has not joined again, changes nothing. The
//! routes grow with the cluster (create, destroy, exec, files, tunnels);
//! `GET /node/v1/health` is the first.

use crate::{tls, wire};
use bytes::{Bytes, BytesMut};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::{Frame, Incoming};
use hyper::{Request, Response, StatusCode};
use sandpit_protocol::ExecRequest;
use sandpit_runtime::{ExecEvent, ExecHandle, RuntimeError};
use serde::{Deserialize, Serialize};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::rustls;

/// The header that names the epoch a call is meant for.
pub const EPOCH_HEADER: &str = "x-sandpit-node-epoch";

/// How long a call may take to connect (TCP and TLS).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a call waits for the head of the node's answer (a command's
/// events stream after it without a bound but the command's own).
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(15);

/// What a node says about itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Health {
    pub name: String,
    pub epoch: i64,
}

/// What the API needs to know of the node that serves it.
pub trait NodeState: Send + Sync + 'static {
    /// The node's name.
    fn name(&self) -> &str;
    /// The epoch it holds now; `None` while it is fenced (it lost its lease
    /// and has not joined again).
    fn epoch(&self) -> Option<i64>;
    /// Starts `request` in the sandbox `id`'s VM on this node.
    fn exec(
        &self,
        id: String,
        request: ExecRequest,
    ) -> Pin<Box<dyn std::future::Future<Output = Result<ExecHandle, Refusal>> + Send + '_>>;
}

/// Why a node does not do what it was asked: an HTTP status, a stable type
/// and a message for people.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub status: u16,
    pub kind: String,
    pub message: String,
}

type Body = BoxBody<Bytes, std::convert::Infallible>;

/// A body fed by a channel: a streamed answer, or a request body the caller
/// keeps writing to.
pub struct ChannelBody(mpsc::Receiver<Bytes>);

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

fn full(b: Bytes) -> Body {
    Full::new(b).map_err(|never| match never {}).boxed()
}

/// The error body of the API: `{"error": {"type": …, "message": …}}`.
#[derive(Debug, Serialize, Deserialize)]
struct ErrorBody {
    error: ErrorDetail,
}

#[derive(Debug, Serialize, Deserialize)]
struct ErrorDetail {
    r#type: String,
    message: String,
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

fn error(status: StatusCode, kind: &str, message: String) -> Response<Body> {
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

/// One request, after TLS has admitted its sender.
async fn handle(state: Arc<dyn NodeState>, req: Request<Incoming>) -> Response<Body> {
    let Some(epoch) = state.epoch() else {
        return error(
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
        return error(
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
    match (req.method(), segments.as_slice()) {
        (&hyper::Method::GET, ["node", "v1", "health"]) => json(
            StatusCode::OK,
            &Health {
                name: state.name().to_string(),
                epoch,
            },
        ),
        (&hyper::Method::POST, ["node", "v1", "sandboxes", id, "exec"]) => {
            let id = id.to_string();
            exec(state, id, req.into_body()).await
        }
        _ => error(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no route {} {path}", req.method()),
        ),
    }
}

/// The longest command line (JSON) an exec call may start with.
const MAX_EXEC_REQUEST: usize = 4 << 20;

async fn exec(state: Arc<dyn NodeState>, id: String, mut body: Incoming) -> Response<Body> {
    // The first line is the command.
    let mut buf = BytesMut::new();
    let line = loop {
        if let Some(i) = buf.iter().position(|&b| b == b'\n') {
            break buf.split_to(i + 1);
        }
        if buf.len() > MAX_EXEC_REQUEST {
            return error(
                StatusCode::BAD_REQUEST,
                "invalid_request",
                "the command line is too long".into(),
            );
        }
        match body.frame().await {
            Some(Ok(f)) => {
                if let Ok(d) = f.into_data() {
                    buf.extend_from_slice(&d);
                }
            }
            _ => {
                return error(
                    StatusCode::BAD_REQUEST,
                    "invalid_request",
                    "the body ended before the command".into(),
                )
            }
        }
    };
    let request: ExecRequest = match serde_json::from_slice(&line) {
        Ok(r) => r,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                "invalid_request",
                format!("the command: {e}"),
            )
        }
    };
    let mut handle = match state.exec(id, request).await {
        Ok(h) => h,
        Err(r) => {
            return error(
                StatusCode::from_u16(r.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
                &r.kind,
                r.message,
            )
        }
    };
    let (tx, rx) = mpsc::channel::<Bytes>(16);
    tokio::spawn(async move {
        let mut upstream_open = true;
        loop {
            let event = tokio::select! {
                ev = handle.next() => ev,
                f = body.frame(), if upstream_open => {
                    match f {
                        Some(Ok(f)) => {
                            if let Ok(d) = f.into_data() {
                                buf.extend_from_slice(&d);
                            }
                            if buf.windows(7).any(|w| w == b"cancel\n") {
                                handle.cancel();
                                buf.clear();
                            }
                        }
                        // The caller finished writing (or went: then the
                        // answer's sends below fail too).
                        _ => upstream_open = false,
                    }
                    continue;
                }
            };
            let last = !matches!(event, Ok(ExecEvent::Stdout(_)) | Ok(ExecEvent::Stderr(_)));
            if tx.send(wire::encode(&event)).await.is_err() {
                // The caller went: dropping the handle kills the command.
                return;
            }
            if last {
                return;
            }
        }
    });
    let mut r = Response::new(ChannelBody(rx).boxed());
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/x-sandpit-exec"),
    );
    r
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
    /// Any other answer.
    #[error("node answered {status}: {message}")]
    Failed { status: u16, message: String },
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

    /// `GET /node/v1/health` of the node at `address` (`host:port`, the
    /// host as in its certificate), meant for `epoch`.
    pub async fn health(&self, address: &str, epoch: i64) -> Result<Health, NodeError> {
        let (status, body) = self.call(address, epoch, "/node/v1/health").await?;
        if status != 200 {
            return Err(answer_error(status, &body));
        }
        serde_json::from_slice(&body).map_err(|e| NodeError::Failed {
            status,
            message: format!("unreadable health: {e}"),
        })
    }

    /// Sends `req` and waits for the answer's head (not its body) for
    /// [`RESPONSE_TIMEOUT`] at most. A connection that fails or times out
    /// is dropped, so the next call makes a new one.
    async fn send(
        &self,
        address: &str,
        sender: &mut Sender,
        req: Request<Body>,
    ) -> Result<Response<Incoming>, NodeError> {
        let outcome = tokio::time::timeout(RESPONSE_TIMEOUT, sender.send_request(req)).await;
        let message = match outcome {
            Ok(Ok(resp)) => return Ok(resp),
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("no answer within {RESPONSE_TIMEOUT:?}"),
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
        let stream = tokio::time::timeout(CONNECT_TIMEOUT, connect)
            .await
            .map_err(|_| unreachable(format!("no connection within {CONNECT_TIMEOUT:?}")))?
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

    async fn call(&self, address: &str, epoch: i64, path: &str) -> Result<(u16, Bytes), NodeError> {
        let mut sender = self.sender(address).await?;
        let req = Request::get(format!("https://{address}{path}"))
            .header(EPOCH_HEADER, epoch.to_string())
            .body(full(Bytes::new()))
            .expect("a valid request");
        let resp = self.send(address, &mut sender, req).await?;
        let status = resp.status().as_u16();
        Ok((status, read_body(address, resp).await?))
    }

    /// Starts `request` in sandbox `id` on the node at `address`, meant for
    /// `epoch`; its events come from [`RemoteExec::next`].
    pub async fn exec(
        &self,
        address: &str,
        epoch: i64,
        id: &str,
        request: &ExecRequest,
    ) -> Result<RemoteExec, NodeError> {
        let mut sender = self.sender(address).await?;
        let (upstream, rx) = mpsc::channel::<Bytes>(2);
        let mut line = serde_json::to_vec(request).expect("json");
        line.push(b'\n');
        upstream
            .send(Bytes::from(line))
            .await
            .expect("the receiver is here");
        let req = Request::post(format!("https://{address}/node/v1/sandboxes/{id}/exec"))
            .header(EPOCH_HEADER, epoch.to_string())
            .body(ChannelBody(rx).boxed())
            .expect("a valid request");
        let resp = self.send(address, &mut sender, req).await?;
        let status = resp.status().as_u16();
        if status != 200 {
            return Err(answer_error(status, &read_body(address, resp).await?));
        }
        let deadline = tokio::time::Instant::now()
            + Duration::from_millis(request.timeout_ms)
            + sandpit_runtime::channel::EXEC_GRACE;
        Ok(RemoteExec {
            address: address.to_string(),
            body: resp.into_body(),
            buf: BytesMut::new(),
            upstream: Some(upstream),
            _connection: sender,
            deadline,
        })
    }
}

/// A command running on another node. Dropping it before its end resets
/// its stream, and the node kills the command.
pub struct RemoteExec {
    address: String,
    body: Incoming,
    buf: BytesMut,
    upstream: Option<mpsc::Sender<Bytes>>,
    _connection: Sender,
    /// The command's own timeout plus the runtime's grace: a node that went
    /// silent (cut off, frozen) does not hold the caller past it.
    deadline: tokio::time::Instant,
}

impl RemoteExec {
    /// The next event; `Exited` (or an error) is the last.
    pub async fn next(&mut self) -> Result<ExecEvent, RuntimeError> {
        loop {
            match wire::decode(&mut self.buf) {
                Ok(Some(event)) => {
                    if !matches!(event, Ok(ExecEvent::Stdout(_)) | Ok(ExecEvent::Stderr(_))) {
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

    /// Asks the node to kill the command; its end follows, cancelled.
    pub fn cancel(&self) {
        if let Some(up) = &self.upstream {
            let _ = up.try_send(Bytes::from_static(b"cancel\n"));
        }
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

fn answer_error(status: u16, body: &[u8]) -> NodeError {
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
