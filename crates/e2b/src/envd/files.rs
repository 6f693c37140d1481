//! envd's `/files`: a file's bytes down (`GET`), and files up (`POST`), as
//! a multipart form (one part named `file` per file, its filename the
//! destination) or as a raw body (`application/octet-stream`, the path in
//! the query). Raw bodies with a length are streamed to the guest a piece
//! at a time (see `sandpit_api::raw`); multipart parts are held whole,
//! within the body limit. Paths that are not absolute are under the
//! user's home, as in E2B.
//!
//! Not yet: signed URLs (`download_url`/`upload_url` used without the
//! token), gzip bodies, and `X-Metadata-*`.

use super::{check_user, guest_path, ForSandbox};
use crate::error::HttpError;
use crate::E2b;
use axum::extract::{FromRequest, Multipart, Query, Request, State};
use axum::http::{header, StatusCode};
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
}

fn checked(q: &FileQuery) -> Result<(), HttpError> {
    if q.signature.is_some() {
        return Err(HttpError::new(
            StatusCode::UNAUTHORIZED,
            "signed file URLs are not supported by Sandpit's E2B API yet: send X-Access-Token",
        ));
    }
    check_user(q.username.as_deref()).map_err(|e| HttpError::new(StatusCode::FORBIDDEN, e.message))
}

/// `GET /files?path=`.
pub async fn download(
    State(e2b): State<E2b>,
    sandbox: ForSandbox,
    Query(q): Query<FileQuery>,
) -> Result<Response, HttpError> {
    checked(&q)?;
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
    sandbox: ForSandbox,
    Query(q): Query<FileQuery>,
    req: Request,
) -> Result<Response, HttpError> {
    checked(&q)?;
    let content_type = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    if req.headers().contains_key(header::CONTENT_ENCODING) {
        return Err(HttpError::bad_request(
            "compressed uploads (gzip) are not supported by Sandpit's E2B API yet",
        ));
    }
    let mut written = Vec::new();
    if content_type.starts_with("multipart/form-data") {
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
            let dest = field
                .file_name()
                .map(str::to_string)
                .or_else(|| q.path.clone())
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
        let length = req
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        let body = req.into_body();
        let (size, source): (u64, Box<dyn ByteSource>) = match length {
            Some(size) => (size, Box::new(RequestBody::new(body))),
            None => {
                let bytes = axum::body::to_bytes(body, usize::MAX)
                    .await
                    .map_err(|e| HttpError::bad_request(format!("the body: {e}")))?;
                (bytes.len() as u64, Box::new(Whole(Some(bytes.to_vec()))))
            }
        };
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

/// Bytes already held, as an upload's source.
struct Whole(Option<Vec<u8>>);

#[async_trait::async_trait]
impl ByteSource for Whole {
    async fn next_chunk(&mut self) -> Option<std::io::Result<Vec<u8>>> {
        self.0.take().map(Ok)
    }
}
