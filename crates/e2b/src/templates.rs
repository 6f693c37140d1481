//! E2B's template builder on Sandpit's templates: `Template.build(…)` in
//! either SDK, unchanged.
//!
//! The SDKs build in four calls, and so does this module:
//! 1. `POST /v3/templates` asks for a build of `name[:tag]` (its size from
//!    `cpuCount`/`memoryMB`): a Sandpit build, `waiting` for its steps.
//!    E2B's `templateID` is the template's name (what `Sandbox.create`
//!    takes); its `buildID` is the build's id (`tpl_…`).
//! 2. `GET /templates/{name}/files/{hash}` for each `copy`: whether the
//!    account holds that context (`present`), else where to `PUT` it: a
//!    URL on this server carrying the waiting build's upload secret, since
//!    the SDKs send no API key there (they expect a presigned bucket URL).
//! 3. `POST /v2/templates/{name}/builds/{build}` with the steps: read into
//!    a `Spec` (`sandpit_templates::e2b`), checked, and the build started.
//! 4. `GET /templates/{name}/builds/{build}/status?logsOffset=N`, polled:
//!    the build's status and its log's lines from line `N`, which the
//!    SDKs hand to `on_build_logs`.
//!
//! `GET /templates/aliases/{name}` answers `Template.exists`.

use crate::control::Authed;
use crate::error::{Body, HttpError};
use crate::E2b;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use sandpit_core::{Caller, Template, MAX_TEMPLATE_FILES_BYTES};
use sandpit_templates::e2b::{to_spec, BuildStart};
use serde::{Deserialize, Serialize};
use serde_json::json;

type Answer = Result<Response, HttpError>;
type HttpResult<T> = Result<T, HttpError>;

/// The most log lines one status answer carries (E2B's own bound).
const MOST_LOG_ENTRIES: usize = 100;

/// The builder's routes (merged into the control plane).
pub fn routes() -> Router<E2b> {
    Router::new()
        .route("/v3/templates", post(request_build))
        .route("/templates/{template}/files/{hash}", get(file_link))
        .route(
            "/template-files/{build}/{hash}",
            put(upload).layer(DefaultBodyLimit::max(MAX_TEMPLATE_FILES_BYTES)),
        )
        .route("/v2/templates/{template}/builds/{build}", post(start_build))
        .route(
            "/templates/{template}/builds/{build}/status",
            get(build_status),
        )
        .route("/templates/aliases/{alias}", get(alias))
}

/// `POST /v3/templates` (E2B's `TemplateBuildRequestV3`).
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct BuildRequest {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    alias: Option<String>,
    #[serde(default)]
    tags: Option<Vec<String>>,
    #[serde(default)]
    cpu_count: Option<u32>,
    #[serde(default, rename = "memoryMB")]
    memory_mb: Option<u32>,
}

/// E2B's `TemplateRequestResponseV3`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct BuildRequested {
    #[serde(rename = "templateID")]
    template_id: String,
    #[serde(rename = "buildID")]
    build_id: String,
    public: bool,
    names: Vec<String>,
    tags: Vec<String>,
    aliases: Vec<String>,
}

/// `name:tag` from E2B's name (which may carry a tag) and its `tags`:
/// Sandpit gives a build one tag.
fn reference(req: &BuildRequest) -> Result<String, HttpError> {
    let name = req
        .name
        .as_deref()
        .or(req.alias.as_deref())
        .filter(|n| !n.is_empty())
        .ok_or_else(|| HttpError::bad_request("a template build needs a name"))?;
    let tags = req.tags.as_deref().unwrap_or_default();
    match (name.split_once(':'), tags) {
        (_, []) => Ok(name.to_string()),
        (None, [tag]) => Ok(format!("{name}:{tag}")),
        (Some((_, tag)), [other]) if tag == other => Ok(name.to_string()),
        _ => Err(HttpError::bad_request(format!(
            "a Sandpit build has one tag: {name:?} with tags {tags:?} names more; \
             build it once per tag"
        ))),
    }
}

/// The smallest of the service's sizes with at least `cpus` and
/// `memory_mb` (the default size when neither is asked for).
async fn size_for(e2b: &E2b, cpus: Option<u32>, memory_mb: Option<u32>) -> HttpResult<String> {
    if cpus.is_none() && memory_mb.is_none() {
        return Ok(e2b.default_size.clone());
    }
    let info = e2b.api.service_info().await?;
    let mut fits: Vec<_> = info
        .sizes
        .iter()
        .filter(|s| {
            s.resources.vcpus >= cpus.unwrap_or(0)
                && s.resources.memory_mb >= memory_mb.unwrap_or(0)
        })
        .collect();
    fits.sort_by_key(|s| (s.resources.vcpus, s.resources.memory_mb));
    fits.first().map(|s| s.name.clone()).ok_or_else(|| {
        HttpError::bad_request(format!(
            "no size has {} vCPUs and {} MB: the sizes are {}",
            cpus.unwrap_or(0),
            memory_mb.unwrap_or(0),
            info.sizes
                .iter()
                .map(|s| format!(
                    "{} ({} vCPUs, {} MB)",
                    s.name, s.resources.vcpus, s.resources.memory_mb
                ))
                .collect::<Vec<_>>()
                .join(", ")
        ))
    })
}

async fn request_build(
    State(e2b): State<E2b>,
    Authed(caller): Authed,
    Body(req): Body<BuildRequest>,
) -> Answer {
    let reference = reference(&req)?;
    let size = size_for(&e2b, req.cpu_count, req.memory_mb).await?;
    let reserved = e2b
        .api
        .reserve_template_build(&caller, &reference, Some(size))
        .await?;
    let t = &reserved.template;
    let body = BuildRequested {
        template_id: t.name.clone(),
        build_id: t.id.clone(),
        public: t.public,
        names: vec![t.name.clone()],
        tags: vec![t.tag.clone()],
        aliases: vec![t.name.clone()],
    };
    Ok((StatusCode::ACCEPTED, Json(body)).into_response())
}

/// The account's newest build of `name` waiting for its steps: the one
/// whose upload secret a files link carries.
async fn waiting_build(e2b: &E2b, caller: &Caller, name: &str) -> HttpResult<Template> {
    let builds = e2b.api.list_templates(caller).await?;
    builds
        .data
        .into_iter()
        .find(|t| t.name == name && t.status == "waiting")
        .ok_or_else(|| {
            HttpError::new(
                StatusCode::NOT_FOUND,
                format!("no build of template {name:?} is waiting for its files: ask for one first (POST /v3/templates)"),
            )
        })
}

async fn file_link(
    State(e2b): State<E2b>,
    Authed(caller): Authed,
    Path((template, hash)): Path<(String, String)>,
) -> Answer {
    if hash.len() != 64 || !hash.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(HttpError::bad_request(format!(
            "{hash:?} is not a files hash (64 hex digits)"
        )));
    }
    if e2b.api.has_template_files(&caller, &hash).await? {
        return Ok((StatusCode::CREATED, Json(json!({"present": true}))).into_response());
    }
    let build = waiting_build(&e2b, &caller, &template).await?;
    let token = e2b.api.template_upload_token(&caller, &build.id).await?;
    let url = format!(
        "{}/e2b/template-files/{}/{}?token={token}",
        e2b.public_url.trim_end_matches('/'),
        build.id,
        hash.to_ascii_lowercase()
    );
    Ok((
        StatusCode::CREATED,
        Json(json!({"present": false, "url": url})),
    )
        .into_response())
}

#[derive(Debug, Deserialize)]
struct UploadQuery {
    #[serde(default)]
    token: String,
}

/// The upload a files link names: let in by its secret, not a key.
async fn upload(
    State(e2b): State<E2b>,
    Path((build, hash)): Path<(String, String)>,
    Query(q): Query<UploadQuery>,
    body: Bytes,
) -> Answer {
    e2b.api
        .upload_template_context(&build, &q.token, &hash, body.to_vec())
        .await?;
    Ok(StatusCode::OK.into_response())
}

async fn start_build(
    State(e2b): State<E2b>,
    Authed(caller): Authed,
    Path((_template, build)): Path<(String, String)>,
    Body(body): Body<BuildStart>,
) -> Answer {
    e2b.api
        .start_template_build(&caller, &build, to_spec(&body))
        .await?;
    Ok(StatusCode::ACCEPTED.into_response())
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct StatusQuery {
    #[serde(default)]
    logs_offset: Option<usize>,
    #[serde(default)]
    limit: Option<usize>,
}

/// E2B's status of a Sandpit build's.
fn status_of(t: &Template) -> &'static str {
    match t.status.as_str() {
        "waiting" => "waiting",
        "building" => "building",
        "ready" => "ready",
        _ => "error",
    }
}

/// The lines of a build's log a status answer may give: every whole line
/// (the last one too once the build is over; while it runs, a line still
/// being written waits for its end).
fn log_lines(t: &Template) -> Vec<&str> {
    let log = t.log.as_deref().unwrap_or_default();
    let mut lines: Vec<&str> = log.split('\n').collect();
    // What follows the last newline: nothing, or a line not ended yet.
    let last = lines.pop().unwrap_or_default();
    if !last.is_empty() && !matches!(t.status.as_str(), "building" | "waiting") {
        lines.push(last);
    }
    lines
}

async fn build_status(
    State(e2b): State<E2b>,
    Authed(caller): Authed,
    Path((template, build)): Path<(String, String)>,
    Query(q): Query<StatusQuery>,
) -> Answer {
    let t = e2b.api.get_template(&caller, &build).await?;
    if t.name != template {
        return Err(HttpError::new(
            StatusCode::NOT_FOUND,
            format!("build {build} is not one of template {template:?}"),
        ));
    }
    let lines = log_lines(&t);
    let from = q.logs_offset.unwrap_or(0).min(lines.len());
    let limit = q.limit.unwrap_or(MOST_LOG_ENTRIES).min(MOST_LOG_ENTRIES);
    let now = time::OffsetDateTime::now_utc()
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default();
    let entry = |line: &str| json!({"timestamp": now, "level": "info", "message": line});
    let entries: Vec<_> = lines[from..].iter().take(limit).map(|l| entry(l)).collect();
    let status = status_of(&t);
    let mut body = json!({
        "templateID": t.name,
        "buildID": t.id,
        "status": status,
        "logs": lines[from..].iter().take(limit).collect::<Vec<_>>(),
        "logEntries": entries,
    });
    if status == "error" {
        let message = match t.status.as_str() {
            "deleted" => format!("build {} was deleted", t.id),
            _ => t.error.clone().unwrap_or_else(|| "the build failed".into()),
        };
        let tail: Vec<_> = lines
            .iter()
            .rev()
            .take(10)
            .rev()
            .map(|l| entry(l))
            .collect();
        body["reason"] = json!({"message": message, "logEntries": tail});
    }
    Ok(Json(body).into_response())
}

async fn alias(
    State(e2b): State<E2b>,
    Authed(caller): Authed,
    Path(alias): Path<String>,
) -> Answer {
    let t = e2b.api.get_template(&caller, &alias).await?;
    Ok(Json(json!({"templateID": t.name, "public": t.public})).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(name: &str, tags: &[&str]) -> BuildRequest {
        BuildRequest {
            name: Some(name.into()),
            alias: None,
            tags: Some(tags.iter().map(|t| t.to_string()).collect()),
            cpu_count: None,
            memory_mb: None,
        }
    }

    #[test]
    fn a_build_has_one_tag_from_its_name_or_its_tags() {
        assert_eq!(reference(&req("web", &[])).unwrap(), "web");
        assert_eq!(reference(&req("web:v1", &[])).unwrap(), "web:v1");
        assert_eq!(reference(&req("web", &["v2"])).unwrap(), "web:v2");
        assert_eq!(reference(&req("web:v2", &["v2"])).unwrap(), "web:v2");
        let e = reference(&req("web", &["v1", "stable"])).unwrap_err();
        assert!(e.message.contains("one tag"), "{}", e.message);
        assert!(reference(&req("", &[])).is_err());
    }

    #[test]
    fn a_line_still_being_written_waits_for_its_end() {
        let t = |status: &str, log: &str| Template {
            id: "tpl_x".into(),
            object: "template".into(),
            name: "web".into(),
            tag: "latest".into(),
            size: "small".into(),
            status: status.into(),
            public: false,
            steps: 1,
            cached_steps: 0,
            error: None,
            size_bytes: 0,
            created_at: String::new(),
            finished_at: None,
            log: Some(log.into()),
            spec: None,
        };
        assert_eq!(log_lines(&t("building", "a\nb\nhalf")), ["a", "b"]);
        assert_eq!(log_lines(&t("building", "a\n")), ["a"]);
        assert_eq!(log_lines(&t("ready", "a\nlast")), ["a", "last"]);
        assert!(log_lines(&t("waiting", "")).is_empty());
    }
}
