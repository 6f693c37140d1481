//! E2B's volumes: `Volume.create`, `list`, `get_info`, `destroy` (the
//! control plane's `/volumes`, by the account's key) and the volume
//! content API (`/volumecontent/{volumeID}/…`, by the volume's own token),
//! over Sandpit's volumes (`sandpit_core::api::Volumes`).
//!
//! E2B hands every volume a token at its create (and its `get_info`) that
//! opens its files alone; the SDKs send it as `Authorization: Bearer` to
//! `E2B_VOLUME_API_URL` (or `https://api.<domain>`, which a self-hosted
//! server is not: set `E2B_VOLUME_API_URL=<server>/e2b`). Sandpit's token
//! is signed, not stored (`Volumes::volume_token`). A volume's files are
//! the host's to serve while no sandbox writes the volume (see
//! `sandpit_core`'s `volume_files`): otherwise 409, saying which.
//!
//! The content API's errors are `{"code": "<status>", "message": …}`, its
//! spec's `Error` (code a string); the SDKs act on the status.

use crate::control::Authed;
use crate::error::{Body, HttpError};
use crate::E2b;
use axum::extract::{FromRequestParts, Path, Query, Request, State};
use axum::http::request::Parts;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, put};
use axum::{Json, Router};
use sandpit_core::{Caller, CreateVolume, ErrorType, VolumeCall, VolumeFile, VolumeOwnership};
use serde::{Deserialize, Serialize};

/// The routes (merged into the control plane's).
pub fn routes() -> Router<E2b> {
    Router::new()
        .route("/volumes", get(list).post(create))
        .route("/volumes/{id}", get(info).delete(destroy))
        .route(
            "/volumecontent/{id}/path",
            get(stat).patch(set_meta).delete(remove),
        )
        .route("/volumecontent/{id}/dir", get(list_dir).post(make_dir))
        .route("/volumecontent/{id}/file", put(upload).get(download))
}

/// `NewVolume`.
#[derive(Debug, Deserialize)]
struct NewVolume {
    name: String,
}

/// `Volume`, and `VolumeAndToken` with its token.
#[derive(Debug, Serialize)]
struct VolumeInfo {
    #[serde(rename = "volumeID")]
    volume_id: String,
    name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    token: Option<String>,
}

async fn create(
    State(e2b): State<E2b>,
    Authed(caller): Authed,
    Body(body): Body<NewVolume>,
) -> Result<Response, HttpError> {
    let req = CreateVolume {
        name: body.name,
        size_gb: None,
    };
    let (volume, _) = e2b.api.create_volume(&caller, req, None).await?;
    let token = e2b.api.volume_token(&caller, &volume.id).await?;
    let info = VolumeInfo {
        volume_id: volume.id,
        name: volume.name,
        token: Some(token),
    };
    Ok((StatusCode::CREATED, Json(info)).into_response())
}

async fn list(State(e2b): State<E2b>, Authed(caller): Authed) -> Result<Response, HttpError> {
    let volumes = e2b.api.list_volumes(&caller).await?;
    let out: Vec<VolumeInfo> = volumes
        .data
        .into_iter()
        .map(|v| VolumeInfo {
            volume_id: v.id,
            name: v.name,
            token: None,
        })
        .collect();
    Ok(Json(out).into_response())
}

/// E2B's 404 for a volume: "Volume … not found".
fn volume_not_found(id: &str) -> impl Fn(sandpit_core::CoreError) -> HttpError + '_ {
    move |e| match e.kind {
        ErrorType::NotFound => {
            HttpError::new(StatusCode::NOT_FOUND, format!("Volume {id} not found"))
        }
        _ => e.into(),
    }
}

async fn info(
    State(e2b): State<E2b>,
    Authed(caller): Authed,
    Path(id): Path<String>,
) -> Result<Response, HttpError> {
    let volume = e2b
        .api
        .get_volume(&caller, &id)
        .await
        .map_err(volume_not_found(&id))?;
    let token = e2b.api.volume_token(&caller, &volume.id).await?;
    Ok(Json(VolumeInfo {
        volume_id: volume.id,
        name: volume.name,
        token: Some(token),
    })
    .into_response())
}

async fn destroy(
    State(e2b): State<E2b>,
    Authed(caller): Authed,
    Path(id): Path<String>,
) -> Result<Response, HttpError> {
    e2b.api
        .delete_volume(&caller, &id)
        .await
        .map_err(volume_not_found(&id))?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// The content API's error: its spec's `Error`, `code` a string.
struct ContentError(HttpError);

impl From<HttpError> for ContentError {
    fn from(e: HttpError) -> Self {
        ContentError(e)
    }
}

impl From<sandpit_core::CoreError> for ContentError {
    fn from(e: sandpit_core::CoreError) -> Self {
        ContentError(e.into())
    }
}

impl IntoResponse for ContentError {
    fn into_response(self) -> Response {
        let e = self.0;
        let body = serde_json::json!({"code": e.status.as_u16().to_string(), "message": e.message});
        let mut response = (e.status, Json(body)).into_response();
        if let Some(seconds) = e.retry_after {
            response
                .headers_mut()
                .insert("retry-after", header::HeaderValue::from(seconds));
        }
        response
    }
}

type ContentAnswer = Result<Response, ContentError>;

/// The volume a content call is on, and its account, by the volume's token
/// (`Authorization: Bearer`).
struct VolumeAuthed {
    caller: Caller,
    volume_id: String,
}

impl FromRequestParts<E2b> for VolumeAuthed {
    type Rejection = ContentError;

    async fn from_request_parts(parts: &mut Parts, e2b: &E2b) -> Result<Self, ContentError> {
        let Path(params): Path<Vec<(String, String)>> = Path::from_request_parts(parts, e2b)
            .await
            .map_err(|e| HttpError::bad_request(format!("the path: {e}")))?;
        let volume_id = params
            .into_iter()
            .find(|(k, _)| k == "id")
            .map(|(_, v)| v)
            .ok_or_else(|| HttpError::bad_request("no volume in the path"))?;
        let token = parts
            .headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|a| a.strip_prefix("Bearer ").or(a.strip_prefix("bearer ")))
            .map(str::trim)
            .ok_or_else(|| {
                HttpError::new(
                    StatusCode::UNAUTHORIZED,
                    "the volume's token is required (Authorization: Bearer, from Volume.create or get_info)",
                )
            })?;
        let caller = e2b
            .api
            .authenticate_volume(&volume_id, token)
            .await
            .map_err(|e| match e.kind {
                ErrorType::Unauthorized => HttpError::new(
                    StatusCode::UNAUTHORIZED,
                    format!("the token does not open volume {volume_id}"),
                ),
                _ => e.into(),
            })?;
        Ok(VolumeAuthed { caller, volume_id })
    }
}

#[derive(Debug, Deserialize)]
struct PathQuery {
    path: String,
    depth: Option<u32>,
    uid: Option<u32>,
    gid: Option<u32>,
    mode: Option<u32>,
    force: Option<bool>,
}

impl PathQuery {
    fn owner(&self) -> VolumeOwnership {
        VolumeOwnership {
            uid: self.uid,
            gid: self.gid,
            // E2B's mode may carry the type's bits (Go's file modes do not,
            // Unix ones do): the permission bits are what is set.
            mode: self.mode.map(|m| m & 0o7777),
        }
    }
}

/// `VolumeEntryStat`.
#[derive(Debug, Serialize)]
struct EntryStat {
    name: String,
    #[serde(rename = "type")]
    kind: &'static str,
    path: String,
    size: u64,
    mode: u32,
    uid: u32,
    gid: u32,
    atime: String,
    mtime: String,
    ctime: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    target: Option<String>,
}

fn stat_of(f: VolumeFile) -> EntryStat {
    EntryStat {
        kind: match f.kind.as_str() {
            "file" => "file",
            "directory" => "directory",
            "symlink" => "symlink",
            _ => "unknown",
        },
        name: f.name,
        path: f.path,
        size: f.size,
        mode: f.mode,
        uid: f.uid,
        gid: f.gid,
        atime: f.atime,
        mtime: f.mtime,
        ctime: f.ctime,
        target: f.target,
    }
}

async fn one(e2b: &E2b, v: &VolumeAuthed, call: VolumeCall) -> Result<EntryStat, ContentError> {
    let mut out = e2b.api.volume_files(&v.caller, &v.volume_id, call).await?;
    out.pop().map(stat_of).ok_or_else(|| {
        HttpError::new(StatusCode::INTERNAL_SERVER_ERROR, "nothing described").into()
    })
}

async fn stat(
    State(e2b): State<E2b>,
    v: VolumeAuthed,
    Query(q): Query<PathQuery>,
) -> ContentAnswer {
    Ok(Json(one(&e2b, &v, VolumeCall::Stat { path: q.path }).await?).into_response())
}

#[derive(Debug, Deserialize)]
struct Meta {
    uid: Option<u32>,
    gid: Option<u32>,
    mode: Option<u32>,
}

async fn set_meta(
    State(e2b): State<E2b>,
    v: VolumeAuthed,
    Query(q): Query<PathQuery>,
    Body(meta): Body<Meta>,
) -> ContentAnswer {
    let call = VolumeCall::SetMeta {
        path: q.path,
        owner: VolumeOwnership {
            uid: meta.uid,
            gid: meta.gid,
            mode: meta.mode.map(|m| m & 0o7777),
        },
    };
    Ok(Json(one(&e2b, &v, call).await?).into_response())
}

async fn remove(
    State(e2b): State<E2b>,
    v: VolumeAuthed,
    Query(q): Query<PathQuery>,
) -> ContentAnswer {
    e2b.api
        .volume_files(&v.caller, &v.volume_id, VolumeCall::Remove { path: q.path })
        .await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

async fn list_dir(
    State(e2b): State<E2b>,
    v: VolumeAuthed,
    Query(q): Query<PathQuery>,
) -> ContentAnswer {
    let call = VolumeCall::List {
        path: q.path,
        depth: q.depth.unwrap_or(1),
    };
    let entries = e2b.api.volume_files(&v.caller, &v.volume_id, call).await?;
    let out: Vec<EntryStat> = entries.into_iter().map(stat_of).collect();
    Ok(Json(out).into_response())
}

async fn make_dir(
    State(e2b): State<E2b>,
    v: VolumeAuthed,
    Query(q): Query<PathQuery>,
) -> ContentAnswer {
    let call = VolumeCall::MakeDir {
        owner: q.owner(),
        parents: q.force.unwrap_or(false),
        path: q.path,
    };
    Ok((StatusCode::CREATED, Json(one(&e2b, &v, call).await?)).into_response())
}

async fn upload(
    State(e2b): State<E2b>,
    v: VolumeAuthed,
    Query(q): Query<PathQuery>,
    req: Request,
) -> ContentAnswer {
    let (size, source) = crate::envd::raw_upload(req, e2b.max_body_bytes).await?;
    let made = e2b
        .api
        .upload_volume_file(
            &v.caller,
            &v.volume_id,
            &q.path,
            size,
            q.owner(),
            q.force.unwrap_or(false),
            source,
        )
        .await?;
    Ok((StatusCode::CREATED, Json(stat_of(made))).into_response())
}

async fn download(
    State(e2b): State<E2b>,
    v: VolumeAuthed,
    Query(q): Query<PathQuery>,
) -> ContentAnswer {
    let file = e2b
        .api
        .download_volume_file(&v.caller, &v.volume_id, &q.path)
        .await?;
    Ok(sandpit_api::raw::download_response(file))
}
