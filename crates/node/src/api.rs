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

use crate::tls;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, Response, StatusCode};
use serde::{Deserialize, Serialize};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::rustls;

/// The header that names the epoch a call is meant for.
pub const EPOCH_HEADER: &str = "x-sandpit-node-epoch";

/// How long a call may take to connect (TCP and TLS).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

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

fn json<T: Serialize>(status: StatusCode, body: &T) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(
        serde_json::to_vec(body).expect("serialisable"),
    )));
    *r.status_mut() = status;
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    r
}

fn error(status: StatusCode, kind: &str, message: String) -> Response<Full<Bytes>> {
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
fn handle<B>(state: &dyn NodeState, req: &Request<B>) -> Response<Full<Bytes>> {
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
    match (req.method(), req.uri().path()) {
        (&hyper::Method::GET, "/node/v1/health") => json(
            StatusCode::OK,
            &Health {
                name: state.name().to_string(),
                epoch,
            },
        ),
        _ => error(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no route {} {}", req.method(), req.uri().path()),
        ),
    }
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
            let service = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                let state = state.clone();
                async move { Ok::<_, std::convert::Infallible>(handle(&*state, &req)) }
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
}

impl NodeClient {
    pub fn new(tls: Arc<rustls::ClientConfig>) -> NodeClient {
        NodeClient {
            tls: tokio_rustls::TlsConnector::from(tls),
        }
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

    async fn call(&self, address: &str, epoch: i64, path: &str) -> Result<(u16, Bytes), NodeError> {
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
        let (mut sender, conn) = hyper::client::conn::http2::handshake(
            hyper_util::rt::TokioExecutor::new(),
            hyper_util::rt::TokioIo::new(stream),
        )
        .await
        .map_err(|e| unreachable(e.to_string()))?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        let req = Request::get(format!("https://{address}{path}"))
            .header(EPOCH_HEADER, epoch.to_string())
            .body(Full::new(Bytes::new()))
            .expect("a valid request");
        let resp = sender
            .send_request(req)
            .await
            .map_err(|e| unreachable(e.to_string()))?;
        let status = resp.status().as_u16();
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| unreachable(e.to_string()))?
            .to_bytes();
        Ok((status, body))
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
