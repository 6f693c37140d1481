//! The control plane: E2B's `/sandboxes` REST API over [`SandboxApi`],
//! nested under `/e2b` (`E2B_API_URL=<server>/e2b`).
//!
//! How E2B's terms map onto Sandpit's:
//! - **Templates are sizes.** `base` (the SDKs' default) is the service's
//!   default size; a size's name (`small`, `medium`, `large`) picks that
//!   size; a snapshot's id (`snap_…`) starts from that snapshot. Templates
//!   built from images are not (yet) Sandpit's.
//! - **Timeouts are in seconds** on E2B's wire and in whole minutes in
//!   Sandpit: a timeout is rounded up to the next minute (at least one).
//! - **Metadata and `envVars`** are kept on the sandbox; every command in
//!   it gets the variables, under its own.

use crate::error::{Body, HttpError};
use crate::wire::{self, Connect, NewSandbox, Timeout};
use crate::E2b;
use axum::extract::{FromRequestParts, Path, Query, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::StreamExt;
use sandpit_core::{Caller, CoreError, CreateSandbox, ErrorType, ListSandboxes, SandboxStatus};
use std::collections::{BTreeMap, BTreeSet};
use time::OffsetDateTime;

type Answer = Result<Response, HttpError>;

/// The control plane's routes (to nest under `/e2b`).
pub fn control_plane(e2b: E2b) -> Router {
    Router::new()
        .route("/v2/sandboxes", post(create).get(list))
        .route("/sandboxes", post(create).get(list))
        .route("/sandboxes/metrics", get(metrics_of_many))
        .route("/sandboxes/{id}", get(get_info).delete(kill))
        .route("/sandboxes/{id}/metrics", get(metrics))
        .route("/sandboxes/{id}/timeout", post(set_timeout))
        .route(
            "/sandboxes/{id}/network",
            axum::routing::put(update_network),
        )
        .route("/sandboxes/{id}/pause", post(pause))
        .route("/v2/sandboxes/{id}/connect", post(connect))
        .route("/sandboxes/{id}/connect", post(connect))
        .route("/sandboxes/{id}/resume", post(connect))
        .route("/sandboxes/{id}/fork", post(fork))
        .route("/sandboxes/{id}/snapshots", post(snapshot))
        .route("/snapshots", get(list_snapshots))
        .route("/templates/{id}", axum::routing::delete(delete_snapshot))
        .merge(crate::templates::routes())
        .merge(crate::secrets::routes())
        .merge(crate::volumes::routes())
        .fallback(not_built)
        .with_state(e2b)
}

/// The caller, by its API key: `X-API-KEY` (E2B's header) or
/// `Authorization: Bearer`.
pub struct Authed(pub Caller);

impl FromRequestParts<E2b> for Authed {
    type Rejection = HttpError;

    async fn from_request_parts(parts: &mut Parts, e2b: &E2b) -> Result<Self, HttpError> {
        let header = |name: &str| {
            parts
                .headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::trim)
        };
        let key = header("x-api-key").filter(|k| !k.is_empty()).or_else(|| {
            header("authorization")
                .and_then(|a| a.strip_prefix("Bearer ").or(a.strip_prefix("bearer ")))
                .map(str::trim)
        });
        let Some(key) = key else {
            return Err(HttpError::new(
                StatusCode::UNAUTHORIZED,
                "an API key is required: set E2B_API_KEY to a Sandpit key (either spelling)",
            ));
        };
        Ok(Authed(e2b.api.authenticate(key).await?))
    }
}

/// What is not built answers 404 with its name, never a hang or a 500.
async fn not_built(method: axum::http::Method, uri: axum::http::Uri) -> HttpError {
    HttpError::new(
        StatusCode::NOT_FOUND,
        format!(
            "{method} {} is not part of Sandpit's E2B API (see the README's \"Using the E2B SDKs\" for what is)",
            uri.path()
        ),
    )
}

/// A size by E2B template name (see the module doc); `Err` says what is.
fn size_of_template(
    e2b: &E2b,
    template: &str,
    sizes: &[String],
) -> Result<CreateSandbox, HttpError> {
    if template == "base" {
        return Ok(CreateSandbox {
            size: Some(e2b.default_size.clone()),
            ..CreateSandbox::default()
        });
    }
    if sizes.iter().any(|s| s == template) {
        return Ok(CreateSandbox {
            size: Some(template.to_string()),
            ..CreateSandbox::default()
        });
    }
    if template.starts_with("snap_") {
        return Ok(CreateSandbox {
            snapshot_id: Some(template.to_string()),
            ..CreateSandbox::default()
        });
    }
    // A template the account built (or an operator published): `name` or
    // `name:tag`; the create says if there is none.
    if sandpit_core::parse_template_reference(template).is_ok() {
        return Ok(CreateSandbox {
            template: Some(template.to_string()),
            ..CreateSandbox::default()
        });
    }
    Err(HttpError::bad_request(format!(
        "template {template:?} is not one of Sandpit's: its templates are \"base\" (the default \
         size, {}), the sizes {}, snapshot ids (snap_…) and the account's templates (name or \
         name:tag)",
        e2b.default_size,
        sizes.join(", ")
    )))
}

/// The template `e2b_code_interpreter`'s `Sandbox.create()` asks for.
const CODE_INTERPRETER_DEFAULT: &str = "code-interpreter-v1";

/// Seconds to Sandpit's whole minutes, rounded up, at least one.
fn minutes(seconds: u64) -> u32 {
    u32::try_from(seconds.div_ceil(60).max(1)).unwrap_or(u32::MAX)
}

async fn create(
    State(e2b): State<E2b>,
    Authed(caller): Authed,
    headers: HeaderMap,
    Body(body): Body<NewSandbox>,
) -> Answer {
    refuse_unsupported(&body)?;
    let info = e2b.api.service_info().await?;
    let sizes: Vec<String> = info.sizes.iter().map(|s| s.name.clone()).collect();
    let mut template = body.template_id.as_deref().unwrap_or("base");
    // The code-interpreter SDK's default template: the operator's
    // `code-interpreter` (`sandpit template build code-interpreter
    // --preset code-interpreter`), unless the account has one of that name.
    if template == CODE_INTERPRETER_DEFAULT
        && e2b.api.get_template(&caller, template).await.is_err()
    {
        template = "code-interpreter";
    }
    let mut req = size_of_template(&e2b, template, &sizes)?;
    // E2B's default life is 300 s.
    req.timeout_minutes = Some(minutes(body.timeout.unwrap_or(300)));
    req.metadata = body.metadata.unwrap_or_default();
    // E2B's mounts are read-write, by the volume's name.
    req.volumes = body
        .volume_mounts
        .unwrap_or_default()
        .into_iter()
        .map(|m| sandpit_core::VolumeMount {
            volume: m.name,
            path: m.path,
            read_only: false,
        })
        .collect();
    req.env = body.env_vars.unwrap_or_default();
    // `get_host(port)` names any port: E2B's sandboxes need no expose.
    req.every_port_public = true;
    let network = body.network.as_ref();
    let (internet_access, lists) = egress(
        body.allow_internet_access,
        network.and_then(|n| n.allow_out.as_deref()),
        network.and_then(|n| n.deny_out.as_deref()),
    );
    req.internet_access = internet_access;
    req.network = Some(lists).filter(|l| !l.allow_out.is_empty() || !l.deny_out.is_empty());
    req.network_rules = wire::network_rules(network.and_then(|n| n.rules.as_ref()));
    // Every port then wants the traffic token (E2B's
    // `e2b-traffic-access-token` header; 403 without, as E2B answers).
    req.private_traffic = network.and_then(|n| n.allow_public_traffic) == Some(false);
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let (sandbox, _) = e2b.api.create_sandbox(&caller, req, key).await?;
    Ok((StatusCode::CREATED, Json(e2b.created(&sandbox))).into_response())
}

/// A create asking for what Sandpit does not do yet is refused, saying so.
fn refuse_unsupported(body: &NewSandbox) -> Result<(), HttpError> {
    let refuse = |what: &str| {
        Err(HttpError::bad_request(format!(
            "{what} is not supported by Sandpit's E2B API yet"
        )))
    };
    if body.auto_pause == Some(true) {
        return refuse("auto-pause on timeout");
    }
    if let Some(network) = &body.network {
        if network.mask_request_host.is_some() {
            return refuse("network mask_request_host");
        }
        if let Some(what) = network.other.iter().find(|(_, v)| !v.is_null()) {
            return refuse(&format!("network {}", what.0));
        }
    }
    if body.mcp.as_ref().is_some_and(|m| !m.is_null()) {
        return refuse("the MCP gateway (mcp=…)");
    }
    Ok(())
}

/// A create's or an update's egress as the service has it: whether the
/// sandbox may reach the network at all, and its own lists (IPv4 addresses
/// and prefixes: the service refuses anything else, a domain name
/// included, with the reason). E2B defines `allow_internet_access=False`
/// as `denyOut: ["0.0.0.0/0"]`: with nothing allowed that is Sandpit's
/// sandbox without internet (no name server either); with an allow list it
/// is the lists.
fn egress(
    allow_internet_access: Option<bool>,
    allow_out: Option<&[String]>,
    deny_out: Option<&[String]>,
) -> (Option<bool>, sandpit_core::NetworkLists) {
    let list = |l: Option<&[String]>| -> Vec<String> {
        l.unwrap_or_default()
            .iter()
            .map(|e| e.trim().to_string())
            .collect()
    };
    let (allow_out, mut deny_out) = (list(allow_out), list(deny_out));
    let everything = |d: &String| d == "0.0.0.0/0";
    let denies_everything = !deny_out.is_empty() && deny_out.iter().all(everything);
    if allow_out.is_empty() && (denies_everything || allow_internet_access == Some(false)) {
        return (Some(false), sandpit_core::NetworkLists::default());
    }
    let mut internet_access = allow_internet_access;
    if allow_internet_access == Some(false) {
        internet_access = None;
        if !deny_out.iter().any(everything) {
            deny_out.push("0.0.0.0/0".into());
        }
    }
    (
        internet_access,
        sandpit_core::NetworkLists {
            allow_out,
            deny_out,
        },
    )
}

/// E2B's `update_network`: the sandbox's egress replaced whole (see
/// [`egress`]), its network rules with it, in effect when this answers.
async fn update_network(
    State(e2b): State<E2b>,
    Authed(caller): Authed,
    Path(id): Path<String>,
    Body(body): Body<wire::NetworkUpdate>,
) -> Answer {
    if let Some(what) = body.other.iter().find(|(_, v)| !v.is_null()) {
        return Err(HttpError::bad_request(format!(
            "network {} is not supported by Sandpit's E2B API yet",
            what.0
        )));
    }
    live(&e2b, &caller, &id).await?;
    let (internet_access, lists) = egress(
        body.allow_internet_access,
        body.allow_out.as_deref(),
        body.deny_out.as_deref(),
    );
    let rules = wire::network_rules(body.rules.as_ref());
    e2b.api
        .update_network_and_rules(&caller, &id, lists, internet_access, rules)
        .await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// A live sandbox of the caller's, or E2B's 404.
async fn live(e2b: &E2b, caller: &Caller, id: &str) -> Result<sandpit_core::Sandbox, HttpError> {
    let not_found = || HttpError::new(StatusCode::NOT_FOUND, format!("Sandbox {id} not found"));
    match e2b.api.get_sandbox(caller, id).await {
        Ok(s) if wire::state_of(s.status).is_some() => Ok(s),
        Ok(_) => Err(not_found()),
        Err(e) if e.kind == ErrorType::NotFound => Err(not_found()),
        Err(e) => Err(e.into()),
    }
}

async fn get_info(
    State(e2b): State<E2b>,
    Authed(caller): Authed,
    Path(id): Path<String>,
) -> Answer {
    let sandbox = live(&e2b, &caller, &id).await?;
    Ok(Json(e2b.info(&sandbox, true)).into_response())
}

/// `start` and `end` of a metrics query: Unix seconds, both optional.
#[derive(Debug, Default, serde::Deserialize)]
struct Interval {
    start: Option<i64>,
    end: Option<i64>,
}

/// E2B's `get_metrics`: the sandbox's readings between `start` and `end`
/// (see `sandpit_core`'s `readings`: one is taken at each call).
async fn metrics(
    State(e2b): State<E2b>,
    Authed(caller): Authed,
    Path(id): Path<String>,
    Query(interval): Query<Interval>,
) -> Answer {
    if let (Some(start), Some(end)) = (interval.start, interval.end) {
        if start > end {
            return Err(HttpError::new(
                StatusCode::BAD_REQUEST,
                format!("start ({start}) is after end ({end})"),
            ));
        }
    }
    live(&e2b, &caller, &id).await?;
    let readings = e2b.api.sandbox_metrics(&caller, &id).await?;
    let within = |at_ms: i64| {
        let at = at_ms.div_euclid(1000);
        interval.start.is_none_or(|s| at >= s) && interval.end.is_none_or(|e| at <= e)
    };
    let out: Vec<wire::Metric> = readings
        .iter()
        .filter(|m| within(m.at_unix_ms))
        .map(wire::Metric::from)
        .collect();
    Ok(Json(out).into_response())
}

/// Sandboxes `GET /sandboxes/metrics` reads at once.
const READ_AT_ONCE: usize = 16;

/// E2B's metrics of several sandboxes (`sandbox_ids=a,b`, at most 100):
/// each running one's latest reading, by id; ids not found are left out.
async fn metrics_of_many(
    State(e2b): State<E2b>,
    Authed(caller): Authed,
    Query(q): Query<BTreeMap<String, String>>,
) -> Answer {
    let ids: Vec<&str> = q
        .get("sandbox_ids")
        .map(|s| {
            s.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .collect()
        })
        .unwrap_or_default();
    if ids.is_empty() || ids.len() > 100 {
        return Err(HttpError::new(
            StatusCode::BAD_REQUEST,
            "sandbox_ids: from 1 to 100 comma-separated sandbox ids".to_string(),
        ));
    }
    // Read side by side: a sandbox's first reading waits a moment to
    // measure its CPU, so a hundred read in turn took half a minute.
    let ids: BTreeSet<&str> = ids.into_iter().collect();
    let read = |id: &str| {
        let (e2b, caller, id) = (&e2b, &caller, id.to_string());
        async move {
            let readings = e2b.api.sandbox_metrics(caller, &id).await;
            (id, readings)
        }
    };
    let mut answers = futures::stream::iter(ids)
        .map(read)
        .buffer_unordered(READ_AT_ONCE);
    let mut sandboxes = BTreeMap::new();
    while let Some((id, answer)) = answers.next().await {
        match answer {
            Ok(readings) => {
                if let Some(last) = readings.last() {
                    sandboxes.insert(id, wire::Metric::from(last));
                }
            }
            Err(e) if matches!(e.kind, ErrorType::NotFound | ErrorType::Conflict) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(Json(serde_json::json!({ "sandboxes": sandboxes })).into_response())
}

async fn kill(State(e2b): State<E2b>, Authed(caller): Authed, Path(id): Path<String>) -> Answer {
    live(&e2b, &caller, &id).await?;
    match e2b.api.destroy_sandbox(&caller, &id).await {
        Ok(_) => Ok(StatusCode::NO_CONTENT.into_response()),
        Err(e) if e.kind == ErrorType::NotFound => Err(HttpError::new(
            StatusCode::NOT_FOUND,
            format!("Sandbox {id} not found"),
        )),
        Err(e) => Err(e.into()),
    }
}

/// E2B's `set_timeout`: the sandbox ends `timeout` seconds from now,
/// sooner or later than it would have (in Sandpit's whole minutes from
/// its creation, rounded up).
async fn set_timeout(
    State(e2b): State<E2b>,
    Authed(caller): Authed,
    Path(id): Path<String>,
    Body(body): Body<Timeout>,
) -> Answer {
    let sandbox = live(&e2b, &caller, &id).await?;
    let wanted = minutes_from_creation(&sandbox, body.timeout)?;
    if wanted < sandbox.timeout_minutes {
        e2b.api.shorten_sandbox(&caller, &id, wanted).await?;
    } else {
        lengthen(&e2b, &caller, &sandbox, body.timeout).await?;
    }
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// The whole minutes from `sandbox`'s creation to `seconds` from now,
/// rounded up: the lifetime that ends it then.
fn minutes_from_creation(sandbox: &sandpit_core::Sandbox, seconds: u64) -> Result<u32, HttpError> {
    let created = OffsetDateTime::parse(
        &sandbox.created_at,
        &time::format_description::well_known::Rfc3339,
    )
    .map_err(|e| CoreError::internal(format!("the sandbox's creation time: {e}")))?;
    let lived = (OffsetDateTime::now_utc() - created).whole_seconds().max(0) as u64;
    Ok(minutes(lived.saturating_add(seconds)))
}

/// Make `sandbox` live at least `seconds` from now.
async fn lengthen(
    e2b: &E2b,
    caller: &Caller,
    sandbox: &sandpit_core::Sandbox,
    seconds: u64,
) -> Result<(), HttpError> {
    let expires = OffsetDateTime::parse(
        &sandbox.expires_at,
        &time::format_description::well_known::Rfc3339,
    )
    .map_err(|e| CoreError::internal(format!("the sandbox's expiry: {e}")))?;
    let left = (expires - OffsetDateTime::now_utc()).whole_seconds().max(0) as u64;
    if seconds > left {
        let more = minutes(seconds - left);
        e2b.api
            .extend_sandbox(caller, &sandbox.id, Some(more))
            .await?;
    }
    Ok(())
}

async fn pause(State(e2b): State<E2b>, Authed(caller): Authed, Path(id): Path<String>) -> Answer {
    let sandbox = live(&e2b, &caller, &id).await?;
    if sandbox.status == SandboxStatus::Paused {
        return Err(HttpError::new(
            StatusCode::CONFLICT,
            format!("Sandbox {id} is already paused"),
        ));
    }
    e2b.api.pause_sandbox(&caller, &id).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// E2B's `connect`: a paused sandbox is resumed; a running one is
/// answered as it is, its life lengthened to `timeout` if that is longer.
async fn connect(
    State(e2b): State<E2b>,
    Authed(caller): Authed,
    Path(id): Path<String>,
    body: Option<Json<Connect>>,
) -> Answer {
    let mut sandbox = live(&e2b, &caller, &id).await?;
    if sandbox.status == SandboxStatus::Paused {
        sandbox = e2b.api.resume_sandbox(&caller, &id).await?;
    }
    if let Some(seconds) = body.and_then(|Json(b)| b.timeout) {
        lengthen(&e2b, &caller, &sandbox, seconds).await?;
    }
    Ok(Json(e2b.created(&sandbox)).into_response())
}

/// `POST /sandboxes/{id}/fork`: a snapshot of the sandbox (which runs on)
/// and `count` new sandboxes from it, each answered as a create is.
async fn fork(
    State(e2b): State<E2b>,
    Authed(caller): Authed,
    Path(id): Path<String>,
    body: Option<Json<wire::Fork>>,
) -> Answer {
    live(&e2b, &caller, &id).await?;
    let body = body.map(|Json(b)| b).unwrap_or_default();
    let req = sandpit_core::ForkSandbox {
        count: body.count,
        timeout_minutes: body.timeout.map(minutes),
    };
    let fork = e2b.api.fork_sandbox(&caller, &id, req).await?;
    let made: Vec<_> = fork
        .sandboxes
        .iter()
        .map(|s| serde_json::json!({"sandbox": e2b.created(s)}))
        .collect();
    Ok((StatusCode::CREATED, Json(made)).into_response())
}

/// `POST /sandboxes/{id}/snapshots`: its whole state, memory included
/// (Sandpit's snapshots always keep it), to create sandboxes from.
async fn snapshot(
    State(e2b): State<E2b>,
    Authed(caller): Authed,
    Path(id): Path<String>,
    body: Option<Json<wire::NewSnapshot>>,
) -> Answer {
    live(&e2b, &caller, &id).await?;
    let name = body.and_then(|Json(b)| b.name);
    let req = sandpit_core::CreateSnapshot { name };
    let (snap, _) = e2b.api.snapshot_sandbox(&caller, &id, req, None).await?;
    Ok((StatusCode::CREATED, Json(wire::snapshot_info(&snap))).into_response())
}

#[derive(Debug, Default, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct SnapshotQuery {
    #[serde(rename = "sandboxID")]
    sandbox_id: Option<String>,
    limit: Option<u32>,
    next_token: Option<String>,
}

/// `GET /snapshots`: the account's snapshots (of one sandbox), newest first.
async fn list_snapshots(
    State(e2b): State<E2b>,
    Authed(caller): Authed,
    Query(q): Query<SnapshotQuery>,
) -> Answer {
    let limit = q.limit.unwrap_or(100).clamp(1, 100) as usize;
    let mut found = Vec::new();
    let mut cursor = q.next_token.clone();
    let mut next = None;
    'pages: loop {
        let page = e2b
            .api
            .list_snapshots(
                &caller,
                sandpit_core::ListSnapshots {
                    limit: Some(100),
                    starting_after: cursor.clone(),
                },
            )
            .await?;
        for snap in &page.data {
            if q.sandbox_id.as_ref().is_some_and(|s| *s != snap.sandbox_id) {
                continue;
            }
            if found.len() == limit {
                next = cursor.clone();
                break 'pages;
            }
            found.push(wire::snapshot_info(snap));
            cursor = Some(snap.id.clone());
        }
        match (page.has_more, page.data.last()) {
            (true, Some(last)) => cursor = Some(last.id.clone()),
            _ => break,
        }
    }
    Ok(paged(found, next))
}

/// `DELETE /templates/{id}`: a snapshot (the only templates a user makes).
async fn delete_snapshot(
    State(e2b): State<E2b>,
    Authed(caller): Authed,
    Path(id): Path<String>,
) -> Answer {
    let not_found = || HttpError::new(StatusCode::NOT_FOUND, format!("Template {id} not found"));
    if !id.starts_with("snap_") {
        return Err(not_found());
    }
    match e2b.api.delete_snapshot(&caller, &id).await {
        Ok(_) => Ok(StatusCode::NO_CONTENT.into_response()),
        Err(e) if e.kind == ErrorType::NotFound => Err(not_found()),
        Err(e) => Err(e.into()),
    }
}

/// `GET /v2/sandboxes`' query.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct ListQuery {
    /// `running`, `paused` or both, comma-separated.
    state: Option<String>,
    /// Form-encoded pairs of percent-encoded keys and values.
    metadata: Option<String>,
    limit: Option<u32>,
    next_token: Option<String>,
}

/// E2B's list: live sandboxes, filtered by state and metadata, a page at
/// a time (`X-Next-Token` names where the next page starts).
async fn list(
    State(e2b): State<E2b>,
    Authed(caller): Authed,
    Query(q): Query<ListQuery>,
) -> Answer {
    let limit = q.limit.unwrap_or(100).clamp(1, 100) as usize;
    let states: Vec<String> = match &q.state {
        Some(s) => s.split(',').map(|s| s.trim().to_string()).collect(),
        None => vec!["running".into(), "paused".into()],
    };
    let wanted = metadata_filter(q.metadata.as_deref());
    let mut found = Vec::new();
    let mut cursor = q.next_token.clone();
    let mut next = None;
    'pages: loop {
        let page = e2b
            .api
            .list_sandboxes(
                &caller,
                ListSandboxes {
                    limit: Some(100),
                    starting_after: cursor.clone(),
                    include_deleted: Some(false),
                },
            )
            .await?;
        for sandbox in &page.data {
            let Some(state) = wire::state_of(sandbox.status) else {
                continue;
            };
            let matches = states.iter().any(|s| s == state)
                && wanted
                    .iter()
                    .all(|(k, v)| sandbox.metadata.get(k) == Some(v));
            if !matches {
                continue;
            }
            if found.len() == limit {
                next = cursor.clone();
                break 'pages;
            }
            found.push(e2b.info(sandbox, false));
            cursor = Some(sandbox.id.clone());
        }
        match (page.has_more, page.data.last()) {
            (true, Some(last)) => cursor = Some(last.id.clone()),
            _ => break,
        }
    }
    Ok(paged(found, next))
}

/// The SDKs' metadata filter: `k=v&k2=v2` with each key and value
/// percent-encoded once more inside (so decoded twice in all).
fn metadata_filter(encoded: Option<&str>) -> BTreeMap<String, String> {
    let decode = |s: &str| {
        percent_encoding::percent_decode_str(s)
            .decode_utf8_lossy()
            .into_owned()
    };
    encoded
        .map(|text| {
            form_urlencoded::parse(text.as_bytes())
                .map(|(k, v)| (decode(&k), decode(&v)))
                .collect()
        })
        .unwrap_or_default()
}

/// A page of a list as E2B answers it: the items, and the token of the
/// next page in `X-Next-Token` when there is one.
pub(crate) fn paged<T: serde::Serialize>(items: T, next: Option<String>) -> Response {
    let mut response = Json(items).into_response();
    if let Some(token) = next.and_then(|t| HeaderValue::from_str(&t).ok()) {
        response.headers_mut().insert("x-next-token", token);
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_round_up_to_whole_minutes() {
        assert_eq!(minutes(0), 1);
        assert_eq!(minutes(1), 1);
        assert_eq!(minutes(60), 1);
        assert_eq!(minutes(61), 2);
        assert_eq!(minutes(300), 5);
    }

    #[test]
    fn the_metadata_filter_is_decoded_as_the_sdks_encode_it() {
        // {"user id": "a b", "k": "v&w"}: each part percent-encoded, then
        // form-encoded together (the query's own decoding is axum's).
        let filter = metadata_filter(Some("user%2520id=a%2520b&k=v%2526w"));
        assert_eq!(filter["user id"], "a b");
        assert_eq!(filter["k"], "v&w");
        assert!(metadata_filter(None).is_empty());
    }

    #[test]
    fn e2bs_egress_is_no_internet_or_lists() {
        let v = |l: &[&str]| l.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let lists = |a: &[&str], d: &[&str]| sandpit_core::NetworkLists {
            allow_out: v(a),
            deny_out: v(d),
        };
        // Nothing said: the operator's network.
        assert_eq!(egress(None, None, None), (None, lists(&[], &[])));
        // E2B's two spellings of no internet.
        assert_eq!(
            egress(Some(false), None, None),
            (Some(false), lists(&[], &[]))
        );
        let all = v(&["0.0.0.0/0"]);
        assert_eq!(
            egress(None, None, Some(&all)),
            (Some(false), lists(&[], &[]))
        );
        // An allow list through no internet: the lists, names resolving.
        let one = v(&[" 198.51.100.7 "]);
        assert_eq!(
            egress(Some(false), Some(&one), None),
            (None, lists(&["198.51.100.7"], &["0.0.0.0/0"]))
        );
        assert_eq!(
            egress(Some(true), Some(&one), Some(&all)),
            (Some(true), lists(&["198.51.100.7"], &["0.0.0.0/0"]))
        );
        let private = v(&["10.0.0.0/8"]);
        assert_eq!(
            egress(None, None, Some(&private)),
            (None, lists(&[], &["10.0.0.0/8"]))
        );
    }

    #[test]
    fn e2bs_rules_are_the_headers_each_host_gets_the_last_one_winning() {
        let rules: wire::Rules = serde_json::from_value(serde_json::json!({
            "API.example.com": [
                {"transform": {"headers": {"Authorization": "Bearer ${e2b.secrets.a}", "X-A": "1"}}},
                {},
                {"transform": {"headers": {"authorization": "Bearer ${e2b.secrets.b}"}}}
            ],
            "other.example.com": []
        }))
        .unwrap();
        let got = wire::network_rules(Some(&rules));
        assert_eq!(got.len(), 1);
        let api = &got["api.example.com"];
        assert_eq!(api.len(), 2);
        assert_eq!(api["authorization"], "Bearer ${e2b.secrets.b}");
        assert_eq!(api["X-A"], "1");
        assert!(wire::network_rules(None).is_empty());
    }

    #[test]
    fn a_network_asking_for_what_sandpit_does_not_do_is_refused_by_name_and_lists_pass() {
        let create = |network: serde_json::Value| -> NewSandbox {
            serde_json::from_value(serde_json::json!({"templateID": "base", "network": network}))
                .unwrap()
        };
        for fine in [
            serde_json::Value::Null,
            serde_json::json!({}),
            serde_json::json!({"allowPublicTraffic": true, "allowOut": [], "denyOut": []}),
            // E2B's definition of no internet access.
            serde_json::json!({"denyOut": ["0.0.0.0/0"]}),
            // Lists of its own (the service checks their entries).
            serde_json::json!({"allowOut": ["8.8.8.8"]}),
            serde_json::json!({"denyOut": ["10.0.0.0/8"]}),
            serde_json::json!({"denyOut": ["0.0.0.0/0"], "allowOut": ["1.1.1.1"]}),
            // Ports wanting the traffic token.
            serde_json::json!({"allowPublicTraffic": false}),
            // Transform rules (the service checks them).
            serde_json::json!({"rules": {"api.example.com": [{"transform": {"headers": {"A": "b"}}}]}}),
        ] {
            assert!(refuse_unsupported(&create(fine.clone())).is_ok(), "{fine}");
        }
        for (network, says) in [
            (
                serde_json::json!({"maskRequestHost": "x.example"}),
                "mask_request_host",
            ),
            (
                serde_json::json!({"egressProxy": {"url": "x"}}),
                "egressProxy",
            ),
        ] {
            let e = refuse_unsupported(&create(network.clone())).unwrap_err();
            assert!(e.message.contains(says), "{network}: {}", e.message);
            assert!(e.message.contains("not supported"), "{}", e.message);
        }
    }
}
