//! The preview proxy: a request to `{port}-{id}.{preview_domain}` is
//! forwarded to that port in the sandbox, over a tunnel on the agent channel.
//!
//! Requests go to the guest as HTTP/1.1 whatever the client spoke (HTTP/1.1
//! or HTTP/2), through a pooled hyper client whose "connector" opens tunnels
//! (`PreviewGate::open_preview`), so keep-alive connections to the guest are
//! reused across requests and clients. Bodies stream both ways (uploads,
//! downloads, SSE, chunked). An `Upgrade` (WebSocket) is passed through:
//! when the guest answers 101, the client's and the guest's connections are
//! spliced byte for byte.
//!
//! Every request is checked first (`PreviewGate::check_preview`: the sandbox
//! runs, the port is exposed), and failures become small HTML pages a person
//! can act on (404 unknown or closed, 410 gone, 502 not listening yet, 504
//! connect timeout, 429 and 503 past the sandbox's preview limits); the
//! status codes come from `PreviewError` alone.

use axum::body::Body;
use hyper::body::Incoming;
use hyper::header::{self, HeaderMap, HeaderName, HeaderValue};
use hyper::{Request, Response, StatusCode, Uri, Version};
use hyper_util::client::legacy::connect::{Connected, Connection};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use sandpit_core::preview::{PreviewConn, PreviewError, PreviewGate};
use sandpit_core::private_preview::{self, Grant, PreviewAccess};
use std::future::Future;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// How long an idle connection to a guest server stays pooled.
const POOL_IDLE: Duration = Duration::from_secs(30);

/// The preview proxy of one server.
pub struct Proxy {
    svc: Arc<dyn PreviewGate>,
    client: Client<Connector, Body>,
    scheme: String,
}

impl Proxy {
    /// The proxy to the previews `svc` lets through, whose URLs are of
    /// `scheme` (`http` or `https`, as the clients reach this server).
    pub fn new(svc: Arc<dyn PreviewGate>, scheme: &str) -> Proxy {
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(POOL_IDLE)
            .build(Connector { svc: svc.clone() });
        let scheme = scheme.to_string();
        Proxy {
            svc,
            client,
            scheme,
        }
    }

    /// Serve one request for `port` of sandbox `id`; `authority` is the
    /// host the client asked for (passed on as `Host`).
    pub async fn serve(
        &self,
        mut req: Request<Incoming>,
        id: &str,
        port: u16,
        authority: &str,
        peer: IpAddr,
    ) -> Response<Body> {
        let admitted = match self.svc.check_preview(id, port).await {
            Ok(a) => a,
            Err(e) => return error_page(&e),
        };
        // A private port: nothing reaches the guest without a proof, and
        // the proofs do not reach it either.
        let mut keep_grant = None;
        if let PreviewAccess::Private { token, refusal } = &admitted.access {
            match private_preview_grant(&req, token, id, port) {
                Some(grant) => keep_grant = grant,
                None => {
                    return error_page(&PreviewError::Private {
                        id: id.to_string(),
                        port,
                        status: *refusal,
                    })
                }
            }
            take_proofs(&mut req);
        }
        if let Err(e) = self.svc.admit_preview_request(id) {
            return error_page(&e);
        }
        let upgrade = req.version() == Version::HTTP_11 && wants_upgrade(req.headers());
        let client_upgrade = upgrade.then(|| hyper::upgrade::on(&mut req));
        let (mut parts, body) = req.into_parts();
        let path = parts
            .uri
            .path_and_query()
            .map(|p| p.as_str())
            .unwrap_or("/");
        parts.uri = match format!("http://{id}.invalid:{port}{path}").parse::<Uri>() {
            Ok(u) => u,
            Err(_) => return error_page(&PreviewError::UnknownHost),
        };
        parts.version = Version::HTTP_11;
        strip_hop_by_hop(&mut parts.headers, upgrade);
        if let Ok(v) = HeaderValue::from_str(authority) {
            parts.headers.insert(header::HOST, v.clone());
            parts
                .headers
                .insert(HeaderName::from_static("x-forwarded-host"), v);
        }
        // This server is the edge: what the client claims is replaced.
        if let Ok(v) = HeaderValue::from_str(&peer.to_string()) {
            parts
                .headers
                .insert(HeaderName::from_static("x-forwarded-for"), v);
        }
        if let Ok(v) = HeaderValue::from_str(&self.scheme) {
            parts
                .headers
                .insert(HeaderName::from_static("x-forwarded-proto"), v);
        }
        let mut resp = match self
            .client
            .request(Request::from_parts(parts, Body::new(body)))
            .await
        {
            Ok(r) => r,
            Err(e) => return error_page(&client_error(e, id, port)),
        };
        if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
            if let Some(client_upgrade) = client_upgrade {
                let guest_upgrade = hyper::upgrade::on(&mut resp);
                tokio::spawn(async move {
                    let (Ok(client), Ok(guest)) = tokio::join!(client_upgrade, guest_upgrade)
                    else {
                        return;
                    };
                    let _ = tokio::io::copy_bidirectional(
                        &mut TokioIo::new(client),
                        &mut TokioIo::new(guest),
                    )
                    .await;
                });
            }
        } else {
            strip_hop_by_hop(resp.headers_mut(), false);
            // Our side of the connection speaks HTTP/1.1 (or 2) whatever the
            // guest's server answered with (Python's says 1.0), so the
            // client's connection stays open.
            *resp.version_mut() = Version::HTTP_11;
        }
        if let Some((cookie, expires_unix)) = keep_grant {
            let set = private_preview::set_cookie(
                &cookie,
                expires_unix,
                unix_now(),
                self.scheme == "https",
            );
            if let Ok(v) = HeaderValue::from_str(&set) {
                resp.headers_mut().append(header::SET_COOKIE, v);
            }
        }
        resp.map(Body::new)
    }
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Whether `req` may reach private port `port` of sandbox `id` (whose
/// traffic token is `token`): `None` if not; `Some(Some((cookie,
/// expiry)))` when a signed URL let it in and its cookie is to be left.
fn private_preview_grant(
    req: &Request<Incoming>,
    token: &str,
    id: &str,
    port: u16,
) -> Option<Option<(String, u64)>> {
    let values = |name: &str| -> Vec<&str> {
        req.headers()
            .get_all(name)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .collect()
    };
    let mut headers = values(private_preview::TOKEN_HEADER);
    headers.extend(values(private_preview::E2B_TOKEN_HEADER));
    let proofs = private_preview::Proofs {
        headers,
        query: req.uri().query(),
        cookies: values(header::COOKIE.as_str()),
    };
    match private_preview::admit(token, id, port, &proofs, unix_now())? {
        Grant::Signed {
            expires_unix,
            cookie,
        } => Some(Some((cookie, expires_unix))),
        Grant::Token | Grant::Cookie => Some(None),
    }
}

/// Takes a private port's proofs off `req`: the token headers, the signed
/// URL's parameters and the cookie.
fn take_proofs(req: &mut Request<Incoming>) {
    let headers = req.headers_mut();
    headers.remove(private_preview::TOKEN_HEADER);
    headers.remove(private_preview::E2B_TOKEN_HEADER);
    let cookies: Vec<String> = headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .filter_map(private_preview::strip_cookie)
        .collect();
    headers.remove(header::COOKIE);
    for c in cookies {
        if let Ok(v) = HeaderValue::from_str(&c) {
            headers.append(header::COOKIE, v);
        }
    }
    if let Some(query) = req.uri().query() {
        let path = req.uri().path().to_string();
        let rest = private_preview::strip_query(query);
        let path_and_query = match rest {
            Some(q) => format!("{path}?{q}"),
            None => path,
        };
        if let Ok(uri) = path_and_query.parse::<Uri>() {
            *req.uri_mut() = uri;
        }
    }
}

/// Does the request ask for a protocol upgrade (WebSocket)?
fn wants_upgrade(h: &HeaderMap) -> bool {
    h.contains_key(header::UPGRADE)
        && h.get_all(header::CONNECTION).iter().any(|v| {
            v.to_str().is_ok_and(|s| {
                s.split(',')
                    .any(|t| t.trim().eq_ignore_ascii_case("upgrade"))
            })
        })
}

/// Remove the headers that describe one hop (RFC 9110 7.6.1), keeping
/// `Connection: upgrade` and `Upgrade` on an upgrade request.
fn strip_hop_by_hop(h: &mut HeaderMap, keep_upgrade: bool) {
    let named: Vec<String> = h
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|s| s.split(','))
        .map(|t| t.trim().to_ascii_lowercase())
        .filter(|t| !(t.is_empty() || (keep_upgrade && t == "upgrade")))
        .collect();
    for n in named {
        h.remove(n.as_str());
    }
    for n in [
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
    ] {
        h.remove(n);
    }
    if keep_upgrade {
        h.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    } else {
        h.remove(header::CONNECTION);
        h.remove(header::UPGRADE);
    }
}

/// The preview error behind a client failure (a failed connect carries it).
fn client_error(e: hyper_util::client::legacy::Error, id: &str, port: u16) -> PreviewError {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&e);
    while let Some(s) = source {
        if let Some(p) = s.downcast_ref::<PreviewError>() {
            return p.clone();
        }
        source = s.source();
    }
    tracing::debug!(id, port, "preview request failed: {e:?}");
    PreviewError::Unavailable {
        id: id.to_string(),
        message: "the server in the sandbox closed the connection without answering".into(),
    }
}

/// A page for a person, with the status the error calls for.
pub fn error_page(e: &PreviewError) -> Response<Body> {
    let status = StatusCode::from_u16(e.http_status()).unwrap_or(StatusCode::BAD_GATEWAY);
    let title = format!(
        "{} {}",
        status.as_u16(),
        status.canonical_reason().unwrap_or("Error")
    );
    let html = format!(
        "<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>{title}</title></head>\n\
         <body style=\"font-family:sans-serif;max-width:40em;margin:3em auto\">\n\
         <h1>{title}</h1>\n<p>{}.</p>\n<p>{}</p>\n<hr><p><small>Sandpit preview</small></p>\n\
         </body></html>\n",
        escape(&capitalise(&e.to_string())),
        escape(e.advice()),
    );
    let mut resp = Response::new(Body::from(html));
    *resp.status_mut() = status;
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    if status == StatusCode::SERVICE_UNAVAILABLE || status == StatusCode::TOO_MANY_REQUESTS {
        h.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    resp
}

fn capitalise(s: &str) -> String {
    let mut c = s.chars();
    match c.next() {
        Some(f) => f.to_uppercase().chain(c).collect(),
        None => String::new(),
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Opens tunnels for the pooled client: the URI is `http://{id}.invalid:{port}`.
#[derive(Clone)]
struct Connector {
    svc: Arc<dyn PreviewGate>,
}

impl tower_service::Service<Uri> for Connector {
    type Response = TokioIo<GuestIo>;
    type Error = PreviewError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, PreviewError>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), PreviewError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let svc = self.svc.clone();
        Box::pin(async move {
            let id = uri
                .host()
                .and_then(|h| h.strip_suffix(".invalid"))
                .ok_or(PreviewError::UnknownHost)?
                .to_string();
            let port = uri.port_u16().ok_or(PreviewError::UnknownHost)?;
            let conn = svc.open_preview(&id, port).await?;
            Ok(TokioIo::new(GuestIo(conn)))
        })
    }
}

/// A tunnel as the hyper client's connection.
pub struct GuestIo(PreviewConn);

impl Connection for GuestIo {
    fn connected(&self) -> Connected {
        Connected::new()
    }
}

impl AsyncRead for GuestIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for GuestIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_headers_go_and_upgrades_stay() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, x-secret"),
        );
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        h.insert("x-other", HeaderValue::from_static("kept"));
        strip_hop_by_hop(&mut h, false);
        assert!(h.get("x-secret").is_none());
        assert!(h.get(header::CONNECTION).is_none());
        assert!(h.get(header::UPGRADE).is_none());
        assert_eq!(h.get("x-other").unwrap(), "kept");

        let mut h = HeaderMap::new();
        h.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
        h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        assert!(wants_upgrade(&h));
        strip_hop_by_hop(&mut h, true);
        assert_eq!(h.get(header::CONNECTION).unwrap(), "upgrade");
        assert_eq!(h.get(header::UPGRADE).unwrap(), "websocket");
    }

    #[test]
    fn error_pages_say_what_happened() {
        let r = error_page(&PreviewError::NotListening {
            id: "sbx_a".into(),
            port: 8000,
        });
        assert_eq!(r.status(), 502);
        let r = error_page(&PreviewError::Gone {
            id: "sbx_a".into(),
            reason: "<destroyed>".into(),
        });
        assert_eq!(r.status(), 410);
        assert_eq!(escape("<destroyed>"), "&lt;destroyed&gt;");
    }
}
