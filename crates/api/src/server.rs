//! The `/v1` handlers: each authenticates, extracts, calls one
//! [`SandboxApi`] method and serializes its answer. Nothing is decided here.
//! Which path and method each serves is the table's (`operations`).

use crate::bodies::*;
use crate::budget::BodyBudget;
use crate::error::ApiError;
use crate::extract::{Authed, JsonBody, QueryParams, ReqId};
use crate::sse;
use crate::state::AppState;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use sandpit_core::{
    BuildTemplate, CoreError, CreateSandbox, CreateSnapshot, CreateVolume, ExecParams, ForkSandbox,
    ListExecutions, ListSandboxes, ListSnapshots, NetworkLists, PutSecret, ResizeVolume,
    RestoreSandbox, WriteFile,
};
use sandpit_core::{CreateWebhook, ListDeliveries, ListEvents};
use sandpit_core::{
    FileDeleted, List, MoveVolume, VolumeCall, VolumeFile, VolumeFileMeta, VolumeOwnership,
};
use serde::Serialize;

#[cfg(doc)]
use sandpit_core::SandboxApi;

/// `service` (MCP's Streamable HTTP endpoint) as it is mounted beside the
/// REST routes: with their request ids and their panic guard (a panic is a
/// 500, not a dropped connection). Its errors keep its own format, and its
/// body limit is its own (`HttpConfig::max_request_body_bytes`); its bodies
/// count against `budget`, the REST routes' (`RestConfig::body_budget`).
pub fn with_request_layers(service: Router, budget: &BodyBudget) -> Router {
    service
        .layer(axum::middleware::from_fn_with_state(
            budget.clone(),
            crate::budget::hold,
        ))
        .layer(tower_http::catch_panic::CatchPanicLayer::new())
        .layer(axum::middleware::from_fn(crate::error::tag_request))
}

type ApiResult<T = Response> = Result<T, ApiError>;

fn ok<T: Serialize>(value: T) -> ApiResult {
    Ok(Json(value).into_response())
}

pub(crate) async fn not_found() -> ApiError {
    CoreError::new(
        sandpit_core::ErrorType::NotFound,
        "no such route: every path is under /v1 (see GET /v1/openapi.json)",
    )
    .into()
}

pub(crate) async fn service(State(st): State<AppState>) -> ApiResult {
    ok(st.api.service_info().await?)
}

pub(crate) async fn openapi_doc(State(st): State<AppState>) -> ApiResult {
    Ok(Json(st.openapi.as_ref().clone()).into_response())
}

pub(crate) async fn account(State(st): State<AppState>, Authed(c): Authed) -> ApiResult {
    ok(st.api.account(&c).await?)
}

pub(crate) async fn usage(
    State(st): State<AppState>,
    Authed(c): Authed,
    QueryParams(q): QueryParams<UsageQuery>,
) -> ApiResult {
    ok(st.api.usage(&c, q.days).await?)
}

pub(crate) async fn create_sandbox(
    State(st): State<AppState>,
    Authed(c): Authed,
    headers: HeaderMap,
    JsonBody(body): JsonBody<CreateSandbox>,
) -> ApiResult {
    let key = idempotency_key(&headers)?;
    let (sandbox, replayed) = st.api.create_sandbox(&c, body, key).await?;
    Ok((created_or_replayed(replayed), Json(sandbox)).into_response())
}

/// The `Idempotency-Key` header, if sent.
fn idempotency_key(headers: &HeaderMap) -> ApiResult<Option<String>> {
    match headers.get("idempotency-key") {
        None => Ok(None),
        Some(v) => Ok(Some(
            v.to_str()
                .map_err(|_| ApiError::invalid("Idempotency-Key must be printable ASCII"))?
                .to_owned(),
        )),
    }
}

/// 201 for a new resource, 200 for an idempotent replay of one.
fn created_or_replayed(replayed: bool) -> StatusCode {
    if replayed {
        StatusCode::OK
    } else {
        StatusCode::CREATED
    }
}

pub(crate) async fn list_sandboxes(
    State(st): State<AppState>,
    Authed(c): Authed,
    QueryParams(q): QueryParams<ListSandboxes>,
) -> ApiResult {
    ok(st.api.list_sandboxes(&c, q).await?)
}

pub(crate) async fn get_sandbox(
    State(st): State<AppState>,
    Authed(c): Authed,
    Path(id): Path<String>,
) -> ApiResult {
    ok(st.api.get_sandbox(&c, &id).await?)
}

pub(crate) async fn destroy_sandbox(
    State(st): State<AppState>,
    Authed(c): Authed,
    Path(id): Path<String>,
) -> ApiResult {
    ok(st.api.destroy_sandbox(&c, &id).await?)
}

pub(crate) async fn extend_sandbox(
    State(st): State<AppState>,
    Authed(c): Authed,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<ExtendBody>,
) -> ApiResult {
    ok(st
        .api
        .extend_sandbox(&c, &id, body.additional_minutes)
        .await?)
}

pub(crate) async fn update_network(
    State(st): State<AppState>,
    Authed(c): Authed,
    Path(id): Path<String>,
    JsonBody(lists): JsonBody<NetworkLists>,
) -> ApiResult {
    ok(st.api.update_network(&c, &id, lists, None).await?)
}

pub(crate) async fn snapshot_sandbox(
    State(st): State<AppState>,
    Authed(c): Authed,
    Path(id): Path<String>,
    headers: HeaderMap,
    JsonBody(body): JsonBody<CreateSnapshot>,
) -> ApiResult {
    let key = idempotency_key(&headers)?;
    let (snapshot, replayed) = st.api.snapshot_sandbox(&c, &id, body, key).await?;
    Ok((created_or_replayed(replayed), Json(snapshot)).into_response())
}

pub(crate) async fn list_snapshots(
    State(st): State<AppState>,
    Authed(c): Authed,
    QueryParams(q): QueryParams<ListSnapshots>,
) -> ApiResult {
    ok(st.api.list_snapshots(&c, q).await?)
}

pub(crate) async fn get_snapshot(
    State(st): State<AppState>,
    Authed(c): Authed,
    Path(id): Path<String>,
) -> ApiResult {
    ok(st.api.get_snapshot(&c, &id).await?)
}

pub(crate) async fn delete_snapshot(
    State(st): State<AppState>,
    Authed(c): Authed,
    Path(id): Path<String>,
) -> ApiResult {
    ok(st.api.delete_snapshot(&c, &id).await?)
}

pub(crate) async fn build_template(
    State(st): State<AppState>,
    Authed(c): Authed,
    JsonBody(body): JsonBody<BuildTemplate>,
) -> ApiResult {
    let template = st.api.build_template(&c, body).await?;
    Ok((StatusCode::ACCEPTED, Json(template)).into_response())
}

pub(crate) async fn list_secrets(State(st): State<AppState>, Authed(c): Authed) -> ApiResult {
    ok(st.api.list_secrets(&c).await?)
}

pub(crate) async fn put_secret(
    State(st): State<AppState>,
    Authed(c): Authed,
    Path(name): Path<String>,
    JsonBody(body): JsonBody<PutSecret>,
) -> ApiResult {
    ok(st.api.put_secret(&c, &name, body).await?)
}

pub(crate) async fn delete_secret(
    State(st): State<AppState>,
    Authed(c): Authed,
    Path(name): Path<String>,
) -> ApiResult {
    ok(st.api.delete_secret(&c, &name).await?)
}

pub(crate) async fn create_volume(
    State(st): State<AppState>,
    Authed(c): Authed,
    headers: HeaderMap,
    JsonBody(body): JsonBody<CreateVolume>,
) -> ApiResult {
    let key = idempotency_key(&headers)?;
    let (volume, replayed) = st.api.create_volume(&c, body, key).await?;
    Ok((created_or_replayed(replayed), Json(volume)).into_response())
}

pub(crate) async fn list_volumes(State(st): State<AppState>, Authed(c): Authed) -> ApiResult {
    ok(st.api.list_volumes(&c).await?)
}

pub(crate) async fn get_volume(
    State(st): State<AppState>,
    Authed(c): Authed,
    Path(volume): Path<String>,
) -> ApiResult {
    ok(st.api.get_volume(&c, &volume).await?)
}

pub(crate) async fn resize_volume(
    State(st): State<AppState>,
    Authed(c): Authed,
    Path(volume): Path<String>,
    JsonBody(body): JsonBody<ResizeVolume>,
) -> ApiResult {
    ok(st.api.resize_volume(&c, &volume, body).await?)
}

pub(crate) async fn delete_volume(
    State(st): State<AppState>,
    Authed(c): Authed,
    Path(volume): Path<String>,
) -> ApiResult {
    ok(st.api.delete_volume(&c, &volume).await?)
}

pub(crate) async fn move_volume(
    State(st): State<AppState>,
    Authed(c): Authed,
    Path(volume): Path<String>,
    JsonBody(body): JsonBody<MoveVolume>,
) -> ApiResult {
    ok(st.api.move_volume(&c, &volume, &body.node).await?)
}

/// `mode` as a query gives it: decimal, or octal with a leading 0.
fn mode_of(q: &VolumeFilesQuery) -> ApiResult<Option<u32>> {
    let Some(m) = q.mode.as_deref() else {
        return Ok(None);
    };
    let parsed = match m.strip_prefix("0o").or_else(|| m.strip_prefix('0')) {
        Some("") => Ok(0),
        Some(octal) => u32::from_str_radix(octal, 8),
        None => m.parse::<u32>(),
    };
    match parsed {
        Ok(mode) if mode <= 0o7777 => Ok(Some(mode)),
        _ => Err(ApiError::invalid(format!(
            "mode {m:?} is not permission bits: decimal, or octal with a leading 0 (0644), \
             at most 07777"
        ))),
    }
}

fn owner_of(q: &VolumeFilesQuery) -> ApiResult<VolumeOwnership> {
    Ok(VolumeOwnership {
        uid: q.uid,
        gid: q.gid,
        mode: mode_of(q)?,
    })
}

fn volume_path(q: &VolumeFilesQuery) -> ApiResult<String> {
    q.path
        .clone()
        .ok_or_else(|| ApiError::invalid("query parameter `path` is required"))
}

/// One description from a call that makes one.
fn one(mut described: Vec<VolumeFile>) -> ApiResult<VolumeFile> {
    described.pop().ok_or_else(|| {
        ApiError::from(sandpit_core::CoreError::internal(
            "a volume call described nothing",
        ))
    })
}

pub(crate) async fn get_volume_files(
    State(st): State<AppState>,
    Authed(c): Authed,
    Path(volume): Path<String>,
    QueryParams(q): QueryParams<VolumeFilesQuery>,
) -> ApiResult {
    if q.list == Some(true) {
        let call = VolumeCall::List {
            path: q.path.clone().unwrap_or_else(|| "/".into()),
            depth: q.depth.unwrap_or(1),
        };
        let entries = st.api.volume_files(&c, &volume, call).await?;
        return ok(List::new(entries, false, None));
    }
    let path = volume_path(&q)?;
    if q.stat == Some(true) {
        let call = VolumeCall::Stat { path };
        return ok(one(st.api.volume_files(&c, &volume, call).await?)?);
    }
    let file = st.api.download_volume_file(&c, &volume, &path).await?;
    Ok(crate::raw::download_response(file))
}

pub(crate) async fn put_volume_file(
    State(st): State<AppState>,
    Authed(c): Authed,
    Path(volume): Path<String>,
    QueryParams(q): QueryParams<VolumeFilesQuery>,
    req: axum::extract::Request,
) -> ApiResult {
    let path = volume_path(&q)?;
    let size = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
        .ok_or_else(|| ApiError::invalid("a file's upload needs a Content-Length"))?;
    let body = Box::new(crate::raw::RequestBody::new(req.into_body()));
    let made = st
        .api
        .upload_volume_file(
            &c,
            &volume,
            &path,
            size,
            owner_of(&q)?,
            q.overwrite.unwrap_or(false),
            body,
        )
        .await?;
    Ok((StatusCode::CREATED, Json(made)).into_response())
}

pub(crate) async fn make_volume_dir(
    State(st): State<AppState>,
    Authed(c): Authed,
    Path(volume): Path<String>,
    QueryParams(q): QueryParams<VolumeFilesQuery>,
) -> ApiResult {
    let call = VolumeCall::MakeDir {
        path: volume_path(&q)?,
        owner: owner_of(&q)?,
        parents: q.parents.unwrap_or(false),
    };
    let made = one(st.api.volume_files(&c, &volume, call).await?)?;
    Ok((StatusCode::CREATED, Json(made)).into_response())
}

pub(crate) async fn patch_volume_file(
    State(st): State<AppState>,
    Authed(c): Authed,
    Path(volume): Path<String>,
    QueryParams(q): QueryParams<VolumeFilesQuery>,
    JsonBody(body): JsonBody<VolumeFileMeta>,
) -> ApiResult {
    let call = VolumeCall::SetMeta {
        path: volume_path(&q)?,
        owner: VolumeOwnership {
            uid: body.uid,
            gid: body.gid,
            mode: body.mode,
        },
    };
    ok(one(st.api.volume_files(&c, &volume, call).await?)?)
}

pub(crate) async fn delete_volume_file(
    State(st): State<AppState>,
    Authed(c): Authed,
    Path(volume): Path<String>,
    QueryParams(q): QueryParams<VolumeFilesQuery>,
) -> ApiResult {
    let path = volume_path(&q)?;
    let call = VolumeCall::Remove { path: path.clone() };
    st.api.volume_files(&c, &volume, call).await?;
    ok(FileDeleted {
        path,
        deleted: true,
    })
}

pub(crate) async fn list_templates(State(st): State<AppState>, Authed(c): Authed) -> ApiResult {
    ok(st.api.list_templates(&c).await?)
}

pub(crate) async fn get_template(
    State(st): State<AppState>,
    Authed(c): Authed,
    Path(id): Path<String>,
) -> ApiResult {
    ok(st.api.get_template(&c, &id).await?)
}

pub(crate) async fn delete_template(
    State(st): State<AppState>,
    Authed(c): Authed,
    Path(id): Path<String>,
) -> ApiResult {
    ok(st.api.delete_template(&c, &id).await?)
}

/// A copy step's files: the request's body, a tar of at most
/// [`sandpit_core::MAX_TEMPLATE_FILES_BYTES`].
pub(crate) async fn upload_template_files(
    State(st): State<AppState>,
    Authed(c): Authed,
    Path(sha256): Path<String>,
    req: axum::extract::Request,
) -> ApiResult {
    let max = sandpit_core::MAX_TEMPLATE_FILES_BYTES;
    let tar = axum::body::to_bytes(req.into_body(), max)
        .await
        .map_err(|_| {
            ApiError::invalid(format!(
                "a copy step's files are at most {max} bytes (or the upload was cut)"
            ))
        })?;
    st.api
        .upload_template_files(&c, &sha256, tar.to_vec())
        .await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

pub(crate) async fn fork_sandbox(
    State(st): State<AppState>,
    Authed(c): Authed,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<ForkSandbox>,
) -> ApiResult {
    let fork = st.api.fork_sandbox(&c, &id, body).await?;
    Ok((StatusCode::CREATED, Json(fork)).into_response())
}

pub(crate) async fn restore_sandbox(
    State(st): State<AppState>,
    Authed(c): Authed,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<RestoreSandbox>,
) -> ApiResult {
    ok(st.api.restore_sandbox(&c, &id, body).await?)
}

pub(crate) async fn pause_sandbox(
    State(st): State<AppState>,
    Authed(c): Authed,
    Path(id): Path<String>,
) -> ApiResult {
    ok(st.api.pause_sandbox(&c, &id).await?)
}

pub(crate) async fn resume_sandbox(
    State(st): State<AppState>,
    Authed(c): Authed,
    Path(id): Path<String>,
) -> ApiResult {
    ok(st.api.resume_sandbox(&c, &id).await?)
}

fn wants_event_stream(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|m| {
            m.split(';')
                .next()
                .unwrap_or("")
                .trim()
                .eq_ignore_ascii_case("text/event-stream")
        })
}

pub(crate) async fn exec(
    State(st): State<AppState>,
    Authed(c): Authed,
    ReqId(rid): ReqId,
    Path(id): Path<String>,
    headers: HeaderMap,
    JsonBody(params): JsonBody<ExecParams>,
) -> ApiResult {
    if params.stream == Some(true) || wants_event_stream(&headers) {
        let stream = st.api.exec_stream(&c, &id, params).await?;
        return Ok(sse::respond(stream, rid, st.cfg.sse_ping_interval));
    }
    ok(st.api.exec(&c, &id, params).await?)
}

pub(crate) async fn list_executions(
    State(st): State<AppState>,
    Authed(c): Authed,
    Path(id): Path<String>,
    QueryParams(q): QueryParams<ListExecutions>,
) -> ApiResult {
    ok(st.api.list_executions(&c, &id, q).await?)
}

pub(crate) async fn get_execution(
    State(st): State<AppState>,
    Authed(c): Authed,
    Path(id): Path<String>,
) -> ApiResult {
    ok(st.api.get_execution(&c, &id).await?)
}

pub(crate) async fn write_file(
    State(st): State<AppState>,
    Authed(c): Authed,
    Path(id): Path<String>,
    QueryParams(q): QueryParams<FilesQuery>,
    req: axum::extract::Request,
) -> ApiResult {
    if crate::raw::sends_raw(req.headers()) {
        let path = required_path(&q)?;
        let size = req
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
            .ok_or_else(|| {
                ApiError::invalid(
                    "a raw upload (Content-Type: application/octet-stream) needs a Content-Length",
                )
            })?;
        let body = Box::new(crate::raw::RequestBody::new(req.into_body()));
        return ok(st.api.upload_file(&c, &id, path, size, body).await?);
    }
    let JsonBody(body) =
        <JsonBody<WriteFile> as axum::extract::FromRequest<AppState>>::from_request(req, &st)
            .await?;
    ok(st.api.write_file(&c, &id, body).await?)
}

fn required_path(q: &FilesQuery) -> ApiResult<&str> {
    q.path
        .as_deref()
        .ok_or_else(|| ApiError::invalid("query parameter `path` is required"))
}

pub(crate) async fn get_files(
    State(st): State<AppState>,
    Authed(c): Authed,
    Path(id): Path<String>,
    QueryParams(q): QueryParams<FilesQuery>,
    headers: HeaderMap,
) -> ApiResult {
    if q.list == Some(true) {
        return ok(st
            .api
            .list_files(&c, &id, q.path.as_deref(), q.recursive.unwrap_or(false))
            .await?);
    }
    let path = required_path(&q)?;
    if q.encoding.is_none() && crate::raw::wants_raw(&headers) {
        let file = st.api.download_file(&c, &id, path).await?;
        return Ok(crate::raw::download_response(file));
    }
    ok(st
        .api
        .read_file(&c, &id, path, q.encoding.unwrap_or_default())
        .await?)
}

pub(crate) async fn delete_file(
    State(st): State<AppState>,
    Authed(c): Authed,
    Path(id): Path<String>,
    QueryParams(q): QueryParams<FilesQuery>,
) -> ApiResult {
    let path = required_path(&q)?;
    ok(st
        .api
        .delete_file(&c, &id, path, q.recursive.unwrap_or(false))
        .await?)
}

pub(crate) async fn expose_port(
    State(st): State<AppState>,
    Authed(c): Authed,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<ExposePortBody>,
) -> ApiResult {
    ok(st.api.expose_port(&c, &id, body.port, body.private).await?)
}

pub(crate) async fn sign_preview_url(
    State(st): State<AppState>,
    Authed(c): Authed,
    Path((id, port)): Path<(String, u16)>,
    JsonBody(body): JsonBody<SignUrlBody>,
) -> ApiResult {
    ok(st
        .api
        .sign_preview_url(&c, &id, port, body.expires_in_seconds)
        .await?)
}

pub(crate) async fn list_ports(
    State(st): State<AppState>,
    Authed(c): Authed,
    Path(id): Path<String>,
) -> ApiResult {
    ok(st.api.list_ports(&c, &id).await?)
}

pub(crate) async fn close_port(
    State(st): State<AppState>,
    Authed(c): Authed,
    Path((id, port)): Path<(String, String)>,
) -> ApiResult {
    let port: u16 = port.parse().map_err(|_| {
        ApiError::invalid(format!(
            "invalid port {port:?}: expected an integer 1..65535"
        ))
    })?;
    st.api.close_port(&c, &id, port).await?;
    ok(PortClosed { port, closed: true })
}

pub(crate) async fn list_events(
    State(st): State<AppState>,
    Authed(c): Authed,
    QueryParams(q): QueryParams<ListEvents>,
) -> ApiResult {
    ok(st.api.list_events(&c, q).await?)
}

pub(crate) async fn list_sandbox_events(
    State(st): State<AppState>,
    Authed(c): Authed,
    Path(id): Path<String>,
    QueryParams(q): QueryParams<SandboxEventsQuery>,
) -> ApiResult {
    let q = ListEvents {
        limit: q.limit,
        after: q.after,
        sandbox_id: Some(id),
    };
    ok(st.api.list_events(&c, q).await?)
}

pub(crate) async fn create_webhook(
    State(st): State<AppState>,
    Authed(c): Authed,
    JsonBody(body): JsonBody<CreateWebhook>,
) -> ApiResult {
    let webhook = st.api.create_webhook(&c, body).await?;
    Ok((StatusCode::CREATED, Json(webhook)).into_response())
}

pub(crate) async fn list_webhooks(State(st): State<AppState>, Authed(c): Authed) -> ApiResult {
    ok(st.api.list_webhooks(&c).await?)
}

pub(crate) async fn get_webhook(
    State(st): State<AppState>,
    Authed(c): Authed,
    Path(id): Path<String>,
) -> ApiResult {
    ok(st.api.get_webhook(&c, &id).await?)
}

pub(crate) async fn delete_webhook(
    State(st): State<AppState>,
    Authed(c): Authed,
    Path(id): Path<String>,
) -> ApiResult {
    ok(st.api.delete_webhook(&c, &id).await?)
}

pub(crate) async fn list_deliveries(
    State(st): State<AppState>,
    Authed(c): Authed,
    Path(id): Path<String>,
    QueryParams(q): QueryParams<ListDeliveries>,
) -> ApiResult {
    ok(st.api.list_deliveries(&c, &id, q).await?)
}

pub(crate) async fn redeliver(
    State(st): State<AppState>,
    Authed(c): Authed,
    Path((id, delivery_id)): Path<(String, String)>,
) -> ApiResult {
    ok(st.api.redeliver(&c, &id, &delivery_id).await?)
}
