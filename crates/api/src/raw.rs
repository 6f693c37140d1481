//! File bodies as themselves, streamed: `PUT /v1/sandboxes/{id}/files?path=P`
//! with `Content-Type: application/octet-stream` takes the file as the
//! request body, and `GET /v1/sandboxes/{id}/files?path=P` with
//! `Accept: application/octet-stream` answers with it.
//!
//! The JSON forms (the public API's) carry the file inside JSON, so the
//! server holds the body, its parsed string and its decoded bytes at once.
//! These forms hold one piece of the file at a time: an upload is sent to
//! the guest as its body arrives (waiting while the guest has more than
//! `STREAM_HIGH_WATER` bytes to read), a download is passed on as the guest
//! sends it. So a raw upload takes nothing from the body budget.

use axum::body::{Body, BodyDataStream};
use axum::extract::Request;
use axum::http::{header, HeaderMap, HeaderValue, Method};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use sandpit_core::api::{ByteSource, FileDownload};

/// The media type of a raw file body.
pub const OCTET_STREAM: &str = "application/octet-stream";

/// The header that names the resolved path of a raw download.
pub const PATH_HEADER: &str = "x-sandpit-path";

fn media_type(v: &str) -> &str {
    v.split(';').next().unwrap_or("").trim()
}

/// The request's body is a file itself.
pub fn sends_raw(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| media_type(v).eq_ignore_ascii_case(OCTET_STREAM))
}

/// The client asks for a file itself.
pub fn wants_raw(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|m| media_type(m).eq_ignore_ascii_case(OCTET_STREAM))
}

/// A request whose body is streamed to a guest or a volume, not held: the
/// body budget leaves it alone (a sandbox's or a volume's raw upload, and
/// E2B's volume upload, whose body is always the file).
pub fn streams_body(req: &Request) -> bool {
    let path = req.uri().path();
    req.method() == Method::PUT
        && ((path.ends_with("/files") && sends_raw(req.headers()))
            || (path.contains("/volumecontent/") && path.ends_with("/file")))
}

/// A request body as an upload's source.
pub struct RequestBody(BodyDataStream);

impl RequestBody {
    pub fn new(body: Body) -> RequestBody {
        RequestBody(body.into_data_stream())
    }
}

#[async_trait::async_trait]
impl ByteSource for RequestBody {
    async fn next_chunk(&mut self) -> Option<std::io::Result<Vec<u8>>> {
        loop {
            match self.0.next().await? {
                Ok(b) if b.is_empty() => continue,
                Ok(b) => return Some(Ok(b.to_vec())),
                Err(e) => return Some(Err(std::io::Error::other(e))),
            }
        }
    }
}

/// A download as a response: its length, its resolved path, then its
/// content as the guest sends it. A failure midway cuts the response
/// short (the client sees fewer bytes than `Content-Length`).
pub fn download_response(file: FileDownload) -> Response {
    let FileDownload { path, size, chunks } = file;
    let stream = futures::stream::unfold(chunks, |mut chunks| async move {
        let piece = chunks.recv().await?;
        let piece = piece.map_err(|e| {
            tracing::warn!("a download failed midway: {e}");
            std::io::Error::other(e.message)
        });
        Some((piece, chunks))
    });
    let mut res = Body::from_stream(stream).into_response();
    let h = res.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(OCTET_STREAM));
    h.insert(header::CONTENT_LENGTH, HeaderValue::from(size));
    if let Ok(v) = HeaderValue::from_str(&path) {
        h.insert(PATH_HEADER, v);
    }
    res
}
