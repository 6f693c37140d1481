//! envd's `/files`: a file's bytes down (`GET`), and files up (`POST`), as
//! a multipart form (one part named `file` per file, written to the `path`
//! of the query when there is one, else to its filename) or as a raw body
//! (`application/octet-stream`, the path in the query). Raw bodies with a
//! length are streamed to the guest a piece at a time (see
//! `sandpit_api::raw`); multipart parts are held whole, within the body
//! limit. Paths that are not absolute are under the user's home, as in E2B.
//!
//! **Signed URLs.** The SDKs' `download_url`/`upload_url` give a URL that a
//! browser or `curl` opens without the SDK's headers: no token, and no
//! sandbox id (with `E2B_SANDBOX_URL` every sandbox has the same URL). It
//! carries a signature instead: `v1_` and the unpadded base64 of the
//! SHA-256 of `path:operation:user:token[:expiration]`, made with the
//! sandbox's own token (`envdAccessToken`). The server finds the live
//! sandbox whose token makes that signature (see
//! `SandboxApi::authenticate_sandbox_by_proof`), refuses one past its
//! `signature_expiration` (as envd: 401, "signature is already expired"),
//! and lets it do only what it names: `read` for `GET`, `write` for
//! `POST`, on its own path.
//!
//! A body of unknown length (chunked) is held in memory, up to the
//! server's `max_body_bytes` (then 413): a write to the guest names its
//! size first. So is a gzip body (`Content-Encoding: gzip`, the SDKs'
//! `gzip=True`), decompressed as it comes: what it decompresses to is known
//! only at its end, and both what comes in and what it makes are held to
//! `max_body_bytes`, so a small bomb is refused as soon as it passes the
//! limit. A refused body is still read, and dropped, for a while before
//! the 413 goes (`drain`): a client still sending when the server answers
//! and closes gets a reset instead of the answer (the Python SDK's write
//! failed with "broken pipe" and never saw the 413). Not yet:
//! `X-Metadata-*`.

use super::{check_user, guest_path, ForSandbox};
use crate::error::HttpError;
use crate::E2b;
use axum::extract::{FromRequest, Multipart, Query, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use sandpit_api::raw::{download_response, RequestBody};
use sandpit_core::api::ByteSource;
use sandpit_core::{Caller, FileWritten};
use serde::Deserialize;

#[derive(Debug, Deserialize)]
pub struct FileQuery {
    path: Option<String>,
    username: Option<String>,
    signature: Option<String>,
    /// Unix seconds after which the signature is refused.
    signature_expiration: Option<i64>,
}

/// What a signed URL was signed for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Operation {
    Read,
    Write,
}

impl Operation {
    fn as_str(self) -> &'static str {
        match self {
            Operation::Read => "read",
            Operation::Write => "write",
        }
    }
}

/// E2B's v1 signature of a file URL made with `token`.
fn signature(
    path: &str,
    operation: Operation,
    user: &str,
    token: &str,
    expiration: Option<i64>,
) -> String {
    use base64::Engine;
    use sha2::{Digest, Sha256};
    let op = operation.as_str();
    let raw = match expiration {
        Some(at) => format!("{path}:{op}:{user}:{token}:{at}"),
        None => format!("{path}:{op}:{user}:{token}"),
    };
    let digest = Sha256::digest(raw.as_bytes());
    format!(
        "v1_{}",
        base64::engine::general_purpose::STANDARD_NO_PAD.encode(digest)
    )
}

/// The sandbox a `/files` call is for, and the user it names checked: by
/// the SDK's headers and the sandbox's token, or, for a signed URL opened
/// without them, by its signature (module docs).
async fn file_caller(
    e2b: &E2b,
    headers: &HeaderMap,
    q: &FileQuery,
    operation: Operation,
) -> Result<ForSandbox, HttpError> {
    check_user(q.username.as_deref())
        .map_err(|e| HttpError::new(StatusCode::FORBIDDEN, e.message))?;
    let signed = q
        .signature
        .as_deref()
        .filter(|_| !headers.contains_key("x-access-token"));
    let Some(given) = signed else {
        return ForSandbox::from_headers(headers, e2b).await;
    };
    let path = q
        .path
        .as_deref()
        .ok_or_else(|| HttpError::bad_request("path is required"))?;
    if let Some(at) = q.signature_expiration {
        if at < time::OffsetDateTime::now_utc().unix_timestamp() {
            return Err(HttpError::new(
                StatusCode::UNAUTHORIZED,
                "signature is already expired",
            ));
        }
    }
    let user = q.username.as_deref().unwrap_or_default();
    let expiration = q.signature_expiration;
    let proof = move |token: &str| {
        sandpit_core::metrics::token_matches(
            &signature(path, operation, user, token, expiration),
            given,
        )
    };
    match e2b.api.authenticate_sandbox_by_proof(&proof).await {
        Ok((id, caller)) => Ok(ForSandbox { id, caller }),
        Err(e) if e.kind == sandpit_core::ErrorType::Unauthorized => Err(HttpError::new(
            StatusCode::UNAUTHORIZED,
            format!(
                "the signature is not valid for {} of {path:?} by any running sandbox's token",
                operation.as_str()
            ),
        )),
        Err(e) => Err(e.into()),
    }
}

/// `GET /files?path=`.
pub async fn download(
    State(e2b): State<E2b>,
    headers: HeaderMap,
    Query(q): Query<FileQuery>,
) -> Result<Response, HttpError> {
    let sandbox = file_caller(&e2b, &headers, &q, Operation::Read).await?;
    let path = q
        .path
        .as_deref()
        .ok_or_else(|| HttpError::bad_request("path is required"))?;
    let file = e2b
        .api
        .download_file(&sandbox.caller, &sandbox.id, &guest_path(path))
        .await?;
    Ok(download_response(file))
}

/// One written file, as the SDKs read the answer.
#[derive(Debug, serde::Serialize)]
struct Written {
    name: String,
    path: String,
    r#type: &'static str,
}

impl From<FileWritten> for Written {
    fn from(w: FileWritten) -> Self {
        let name = w.path.rsplit('/').next().unwrap_or_default().to_string();
        Written {
            name,
            path: w.path,
            r#type: "file",
        }
    }
}

/// `POST /files[?path=]`.
pub async fn upload(
    State(e2b): State<E2b>,
    Query(q): Query<FileQuery>,
    req: Request,
) -> Result<Response, HttpError> {
    let sandbox = file_caller(&e2b, req.headers(), &q, Operation::Write).await?;
    let content_type = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    let gzipped = match req
        .headers()
        .get(header::CONTENT_ENCODING)
        .map(|v| v.to_str().unwrap_or_default().trim().to_ascii_lowercase())
    {
        None => false,
        Some(e) if e == "identity" => false,
        Some(e) if e == "gzip" => true,
        Some(e) => {
            return Err(HttpError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                format!("Content-Encoding {e:?}: uploads may be gzip-compressed, or not at all"),
            ))
        }
    };
    let mut written = Vec::new();
    if gzipped {
        if content_type.starts_with("multipart/form-data") {
            return Err(HttpError::bad_request(
                "a gzip-compressed upload is a raw body (application/octet-stream), not a form",
            ));
        }
        let dest = q
            .path
            .clone()
            .ok_or_else(|| HttpError::bad_request("path is required"))?;
        let bytes = gunzip(req.into_body(), e2b.max_body_bytes).await?;
        let size = bytes.len() as u64;
        let source = Box::new(Whole(Some(bytes)));
        written.push(write(&e2b, &sandbox.caller, &sandbox.id, &dest, size, source).await?);
    } else if content_type.starts_with("multipart/form-data") {
        let mut form = Multipart::from_request(req, &())
            .await
            .map_err(|e| HttpError::bad_request(format!("the multipart form: {e}")))?;
        while let Some(field) = form
            .next_field()
            .await
            .map_err(|e| HttpError::bad_request(format!("the multipart form: {e}")))?
        {
            if field.name() != Some("file") {
                continue;
            }
            // The query's path wins (a signed URL's is the one signed; the
            // SDKs send it only for a single file), else the part's name.
            let dest = q
                .path
                .clone()
                .or_else(|| field.file_name().map(str::to_string))
                .ok_or_else(|| HttpError::bad_request("a file part without a filename or path"))?;
            let bytes = field
                .bytes()
                .await
                .map_err(|e| HttpError::bad_request(format!("the multipart form: {e}")))?;
            let body = Box::new(Whole(Some(bytes.to_vec())));
            written.push(
                write(
                    &e2b,
                    &sandbox.caller,
                    &sandbox.id,
                    &dest,
                    bytes.len() as u64,
                    body,
                )
                .await?,
            );
        }
    } else {
        let dest = q
            .path
            .clone()
            .ok_or_else(|| HttpError::bad_request("path is required"))?;
        let (size, source) = raw_upload(req, e2b.max_body_bytes).await?;
        written.push(write(&e2b, &sandbox.caller, &sandbox.id, &dest, size, source).await?);
    }
    if written.is_empty() {
        return Err(HttpError::bad_request("no file in the request"));
    }
    Ok((StatusCode::OK, Json(written)).into_response())
}

async fn write(
    e2b: &E2b,
    caller: &Caller,
    id: &str,
    dest: &str,
    size: u64,
    body: Box<dyn ByteSource>,
) -> Result<Written, HttpError> {
    let done = e2b
        .api
        .upload_file(caller, id, &guest_path(dest), size, body)
        .await?;
    Ok(done.into())
}

/// A gzip body decompressed as it comes, each of what comes in and what it
/// makes held to `limit` bytes (413 past it); concatenated members are one
/// file, as `gzip -d` makes them.
/// How much of a refused body is still read (and dropped) before the
/// refusal is sent, and for how long at most (see the module's docs).
const DRAIN_BYTES: usize = 64 << 20;
const DRAIN_TIME: std::time::Duration = std::time::Duration::from_secs(10);

/// Reads what is left of a refused body, within [`DRAIN_BYTES`] and
/// [`DRAIN_TIME`], so the client gets to read the refusal.
async fn drain(mut body: axum::body::BodyDataStream) {
    use futures::StreamExt;
    let deadline = tokio::time::Instant::now() + DRAIN_TIME;
    let mut drained = 0usize;
    while drained < DRAIN_BYTES {
        match tokio::time::timeout_at(deadline, body.next()).await {
            Ok(Some(Ok(chunk))) => drained += chunk.len(),
            _ => return,
        }
    }
}

/// A raw upload's length and bytes: streamed as they come when it says
/// its length, else held whole, up to `limit` bytes (then 413).
pub(crate) async fn raw_upload(
    req: Request,
    limit: usize,
) -> Result<(u64, Box<dyn ByteSource>), HttpError> {
    let length = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let body = req.into_body();
    if let Some(size) = length {
        return Ok((size, Box::new(RequestBody::new(body))));
    }
    let bytes = held_whole(body, limit).await?.ok_or_else(|| {
        HttpError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "an upload without Content-Length is held in memory, up to {limit} bytes (the \
                 server's max_body_bytes): send its length to stream a larger file"
            ),
        )
    })?;
    Ok((bytes.len() as u64, Box::new(Whole(Some(bytes)))))
}

/// The whole body, when it is at most `limit` bytes; `None` past it (what
/// is left of it drained).
pub(crate) async fn held_whole(
    body: axum::body::Body,
    limit: usize,
) -> Result<Option<Vec<u8>>, HttpError> {
    use futures::StreamExt;
    let (mut stream, mut out) = (body.into_data_stream(), Vec::new());
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| HttpError::bad_request(format!("the body: {e}")))?;
        if out.len() + chunk.len() > limit {
            drain(stream).await;
            return Ok(None);
        }
        out.extend_from_slice(&chunk);
    }
    Ok(Some(out))
}

async fn gunzip(body: axum::body::Body, limit: usize) -> Result<Vec<u8>, HttpError> {
    use futures::StreamExt;
    use std::io::Write;
    let too_large = || {
        HttpError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "a gzip-compressed upload is decompressed in memory, up to {limit} bytes (the \
                 server's max_body_bytes): send a larger file uncompressed, with its length"
            ),
        )
    };
    let broken = |e: std::io::Error| match e.get_ref().is_some_and(|i| i.is::<PastLimit>()) {
        true => too_large(),
        false => HttpError::bad_request(format!("the body is not valid gzip: {e}")),
    };
    let mut decoder = flate2::write::MultiGzDecoder::new(Bounded {
        out: Vec::new(),
        limit,
    });
    let (mut body, mut taken) = (body.into_data_stream(), 0usize);
    while let Some(chunk) = body.next().await {
        let chunk = chunk.map_err(|e| HttpError::bad_request(format!("the body: {e}")))?;
        taken += chunk.len();
        if taken > limit {
            drain(body).await;
            return Err(too_large());
        }
        if let Err(e) = decoder.write_all(&chunk) {
            drain(body).await;
            return Err(broken(e));
        }
    }
    Ok(decoder.finish().map_err(broken)?.out)
}

/// What a gzip body decompresses to, held to `limit` bytes.
struct Bounded {
    out: Vec<u8>,
    limit: usize,
}

/// The error a [`Bounded`] writer gives past its limit.
#[derive(Debug)]
struct PastLimit;

impl std::fmt::Display for PastLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("past the limit")
    }
}

impl std::error::Error for PastLimit {}

impl std::io::Write for Bounded {
    fn write(&mut self, piece: &[u8]) -> std::io::Result<usize> {
        if self.out.len() + piece.len() > self.limit {
            return Err(std::io::Error::other(PastLimit));
        }
        self.out.extend_from_slice(piece);
        Ok(piece.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Bytes already held, as an upload's source.
struct Whole(Option<Vec<u8>>);

#[async_trait::async_trait]
impl ByteSource for Whole {
    async fn next_chunk(&mut self) -> Option<std::io::Result<Vec<u8>>> {
        self.0.take().map(Ok)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gzip(data: &[u8]) -> Vec<u8> {
        use std::io::Write;
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        e.write_all(data).unwrap();
        e.finish().unwrap()
    }

    #[tokio::test]
    async fn a_gzip_body_is_decompressed_within_the_limit_and_a_bomb_is_not() {
        let text = b"hello, sandbox\n".repeat(1000);
        // Two members, as a writer that flushed between them makes.
        let mut two = gzip(&text[..7000]);
        two.extend(gzip(&text[7000..]));
        let out = gunzip(axum::body::Body::from(two), 1 << 20).await.unwrap();
        assert_eq!(out, text);
        // 64 MiB of zeros is ~64 KiB compressed: refused at the limit.
        let bomb = gzip(&vec![0u8; 64 << 20]);
        assert!(bomb.len() < 1 << 20, "{}", bomb.len());
        let e = gunzip(axum::body::Body::from(bomb), 1 << 20)
            .await
            .unwrap_err();
        assert_eq!(e.status, StatusCode::PAYLOAD_TOO_LARGE);
        // What comes in is held to the limit too.
        let e = gunzip(axum::body::Body::from(vec![0u8; 2 << 20]), 1 << 20)
            .await
            .unwrap_err();
        assert_eq!(e.status, StatusCode::PAYLOAD_TOO_LARGE);
        let e = gunzip(axum::body::Body::from(b"not gzip at all".to_vec()), 1 << 20)
            .await
            .unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert!(e.message.contains("gzip"), "{}", e.message);
    }

    /// Signatures as E2B's Python SDK makes them (`e2b.sandbox.signature`,
    /// run once to get these).
    #[test]
    fn signatures_are_the_sdks() {
        assert_eq!(
            signature("hello.txt", Operation::Read, "", "3f2a", None),
            "v1_KEcfCpH9zTsHCOavO+aRpiUp/MbGOshK47T9/JcWjqM"
        );
        assert_eq!(
            signature(
                "/tmp/a.txt",
                Operation::Write,
                "user",
                "3f2a",
                Some(1_700_000_120)
            ),
            "v1_yo1SaFFX2aoFqtDxJMYGkC69tLNKnweG4Eh8Ry7zljQ"
        );
    }
}
