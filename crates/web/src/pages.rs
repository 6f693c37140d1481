//! The dashboard's pages and the actions their forms post: sandboxes (the
//! list, one sandbox with its events, its terminal), snapshots, usage, and
//! an operator's accounts. Keys, files, events and the rest have modules of
//! their own.

use crate::assets;
use crate::session::{safe_next, CsrfOnly, Signed};
use crate::view::{self, action_button, ago, countdown, page, usd, Failure, PageForm, Section};
use crate::Web;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use axum::Json;
use maud::{html, Markup};
use sandpit_core::{
    usable_templates, CreateSandbox, CreateSnapshot, EntryType, ExecParams, ForkSandbox,
    ListSandboxes, ListSnapshots, NetworkLists, Sandbox, SandboxStatus,
};
use serde::Deserialize;

type PageResult = Result<Response, Failure>;

#[derive(Deserialize)]
pub(crate) struct HomeQuery {
    #[serde(default)]
    next: Option<String>,
    #[serde(default)]
    signed_out: Option<String>,
}

/// `/`: the sign-in, or the sandboxes for a signed-in browser.
pub(crate) async fn home(
    State(web): State<Web>,
    headers: HeaderMap,
    Query(q): Query<HomeQuery>,
) -> Response {
    let signed_in = match crate::session::token_of(&headers) {
        Some(t) => matches!(web.svc.store().web_session(&t).await, Ok(Some(_))),
        None => false,
    };
    if signed_in {
        return Redirect::to(safe_next(q.next.as_deref())).into_response();
    }
    let note = match q.signed_out {
        Some(_) => view::SignInNote::Notice("You are signed out."),
        None => view::SignInNote::None,
    };
    let next = safe_next(q.next.as_deref()).to_string();
    let signup = web.config.signup.mode != crate::SignupMode::Off;
    view::sign_in_page(note, &next, signup).into_response()
}

/// A sandbox's status as a badge.
fn status_badge(s: &Sandbox) -> Markup {
    let word = s.status.as_str();
    html! { span class={ "badge " (word) } { (word) } }
}

fn live(s: &Sandbox) -> bool {
    !matches!(s.status, SandboxStatus::Deleted | SandboxStatus::Failed)
}

/// `/sandboxes`: the account's sandboxes, live first, and the create form.
pub(crate) async fn sandboxes(State(web): State<Web>, signed: Signed) -> PageResult {
    render_sandboxes(&web, &signed, None, StatusCode::OK).await
}

async fn render_sandboxes(
    web: &Web,
    signed: &Signed,
    error: Option<&str>,
    status: StatusCode,
) -> PageResult {
    let list = web
        .api
        .list_sandboxes(
            &signed.caller,
            ListSandboxes {
                limit: Some(100),
                include_deleted: Some(true),
                ..Default::default()
            },
        )
        .await?;
    let info = web.api.service_info().await?;
    let snapshots = web
        .api
        .list_snapshots(
            &signed.caller,
            ListSnapshots {
                limit: Some(100),
                ..Default::default()
            },
        )
        .await?;
    let templates = usable_templates(&web.api.list_templates(&signed.caller).await?.data);
    let secrets = web.api.list_secrets(&signed.caller).await?.data;
    let volumes = web.api.list_volumes(&signed.caller).await?.data;
    let (live_ones, ended): (Vec<&Sandbox>, Vec<&Sandbox>) =
        list.data.iter().partition(|s| live(s));
    let csrf = signed.csrf();
    let body = html! {
        h1 { "Sandboxes" }
        @if let Some(e) = error {
            p class="error" role="alert" { (e) }
        }
        section class="card" aria-labelledby="new-h" {
            h2 id="new-h" { "New sandbox" }
            form class="row" method="post" action="/sandboxes" {
                input type="hidden" name="csrf" value=(csrf);
                div {
                    label for="size" { "Size" }
                    select id="size" name="size" {
                        // Cheapest first, the service's default selected:
                        // a create left alone gets what the API would give.
                        @for s in &info.sizes {
                            option value=(s.name) selected[s.name == info.default_size] {
                                (s.name) " — " (s.resources.vcpus) " vCPU, "
                                (s.resources.memory_mb) " MiB, " (usd(s.price_usd_per_hour)) "/h"
                            }
                        }
                    }
                }
                div {
                    label for="timeout" { "Lifetime (minutes)" }
                    input id="timeout" name="timeout_minutes" type="number" min="1"
                        max=(info.max_timeout_minutes) value=(info.default_timeout_minutes) required;
                }
                div {
                    label for="name" { "Name (optional)" }
                    input id="name" name="name" type="text" maxlength="100";
                }
                div {
                    label for="snapshot" { "From a snapshot" }
                    select id="snapshot" name="snapshot_id" {
                        option value="" { "— none: a fresh machine —" }
                        @for s in snapshots.data.iter().filter(|s| s.status == "ready") {
                            option value=(s.id) {
                                (s.name.as_deref().unwrap_or(&s.id)) " (" (s.size) ")"
                            }
                        }
                    }
                }
                div {
                    label for="template" { "From a template" }
                    select id="template" name="template" {
                        option value="" { "— none —" }
                        @for t in &templates {
                            option value={ (t.name) ":" (t.tag) } {
                                (t.name) ":" (t.tag) " (" (t.size) ")"
                            }
                        }
                    }
                }
                @if !secrets.is_empty() {
                    div {
                        label for="secrets" { "Secrets (names, optional)" }
                        input id="secrets" name="secrets" type="text" spellcheck="false"
                            list="secret-names" autocomplete="off";
                        datalist id="secret-names" {
                            @for s in &secrets { option value=(s.name) {} }
                        }
                    }
                }
                @if !volumes.is_empty() {
                    div {
                        label for="volumes" { "Volumes (name:/path, :ro to read only; optional)" }
                        input id="volumes" name="volumes" type="text" spellcheck="false"
                            autocomplete="off" placeholder={ (volumes[0].name) ":/data" };
                    }
                }
                div { button type="submit" { "Create sandbox" } }
            }
        }
        section aria-labelledby="live-h" {
            h2 id="live-h" { "Live (" (live_ones.len()) ")" }
            @if live_ones.is_empty() {
                p class="muted" { "No live sandboxes." }
            } @else {
                (sandbox_table(&live_ones, csrf, true))
            }
        }
        @if !ended.is_empty() {
            section aria-labelledby="ended-h" {
                h2 id="ended-h" { "Ended" }
                (sandbox_table(&ended, csrf, false))
            }
        }
    };
    Ok((
        status,
        page("Sandboxes", Some(&signed.session), Section::Sandboxes, body),
    )
        .into_response())
}

fn sandbox_table(list: &[&Sandbox], csrf: &str, live: bool) -> Markup {
    html! {
        div class="scroll" {
            table {
                thead { tr {
                    th scope="col" { "Sandbox" } th scope="col" { "Status" } th scope="col" { "Size" }
                    th scope="col" { "Created" }
                    @if live { th scope="col" { "Expires" } th scope="col" { "Actions" } }
                    @else { th scope="col" { "Ended" } th scope="col" { "Why" } }
                } }
                tbody {
                    @for s in list {
                        tr {
                            td { a href={ "/sandboxes/" (s.id) } { (s.name.as_deref().unwrap_or(&s.id)) } }
                            td { (status_badge(s)) }
                            td { (s.size) }
                            td { (ago(&s.created_at)) }
                            @if live {
                                td { (countdown(&s.expires_at)) }
                                td class="actions" { (sandbox_actions(s, csrf)) }
                            } @else {
                                td { @if let Some(d) = &s.deleted_at { (ago(d)) } }
                                td { (s.deleted_reason.as_deref().unwrap_or("")) }
                            }
                        }
                    }
                }
            }
        }
    }
}

fn sandbox_actions(s: &Sandbox, csrf: &str) -> Markup {
    let act = |a: &str| format!("/sandboxes/{}/act/{a}", s.id);
    html! {
        @if s.status == SandboxStatus::Running {
            a class="button" href={ "/sandboxes/" (s.id) "/terminal" } { "Terminal" }
            (action_button(&act("extend"), csrf, "+15 min", ""))
            (action_button(&act("pause"), csrf, "Pause", ""))
            (action_button(&act("snapshot"), csrf, "Snapshot", ""))
            (action_button(&act("fork"), csrf, "Fork", ""))
        }
        @if s.status == SandboxStatus::Paused {
            (action_button(&act("extend"), csrf, "+15 min", ""))
            (action_button(&act("resume"), csrf, "Resume", ""))
        }
        (action_button(&act("destroy"), csrf, "Destroy", "danger"))
    }
}

#[derive(Deserialize)]
pub(crate) struct CreateForm {
    /// Absent: refused as a wrong token is (403), not as a malformed form.
    #[serde(default)]
    csrf: String,
    size: String,
    timeout_minutes: u32,
    #[serde(default)]
    name: String,
    #[serde(default)]
    snapshot_id: String,
    #[serde(default)]
    template: String,
    /// Secret names apart by commas or spaces.
    #[serde(default)]
    secrets: String,
    /// Volume mounts apart by commas or spaces, each `name:/path`, with
    /// `:ro` after it to mount it read-only.
    #[serde(default)]
    volumes: String,
}

/// The create form's volume mounts (see [`CreateForm::volumes`]).
fn volume_mounts(field: &str) -> Result<Vec<sandpit_core::VolumeMount>, String> {
    entries(Some(field))
        .into_iter()
        .map(|entry| {
            let (rest, read_only) = match entry.strip_suffix(":ro") {
                Some(rest) => (rest, true),
                None => (entry.as_str(), false),
            };
            match rest.split_once(':') {
                Some((volume, path)) if !volume.is_empty() && !path.is_empty() => {
                    Ok(sandpit_core::VolumeMount {
                        volume: volume.to_string(),
                        path: path.to_string(),
                        read_only,
                    })
                }
                _ => Err(format!(
                    "volume mount {entry:?} is not name:/path (or name:/path:ro)"
                )),
            }
        })
        .collect()
}

/// `POST /sandboxes`: create, then show it.
pub(crate) async fn create(
    State(web): State<Web>,
    signed: Signed,
    PageForm(f): PageForm<CreateForm>,
) -> PageResult {
    signed.check_csrf(&f.csrf)?;
    let volumes = match volume_mounts(&f.volumes) {
        Ok(v) => v,
        Err(why) => {
            return render_sandboxes(&web, &signed, Some(&why), StatusCode::BAD_REQUEST).await
        }
    };
    let from_snapshot = !f.snapshot_id.is_empty();
    let from_template = !f.template.is_empty();
    let req = CreateSandbox {
        // A snapshot or a template decides the size.
        size: (!from_snapshot && !from_template).then_some(f.size),
        name: Some(f.name.trim().to_string()).filter(|n| !n.is_empty()),
        timeout_minutes: Some(f.timeout_minutes),
        snapshot_id: from_snapshot.then_some(f.snapshot_id),
        template: from_template.then_some(f.template),
        secrets: entries(Some(&f.secrets)),
        volumes,
        ..CreateSandbox::default()
    };
    match web.api.create_sandbox(&signed.caller, req, None).await {
        Ok((s, _)) => Ok(Redirect::to(&format!("/sandboxes/{}", s.id)).into_response()),
        Err(e) => {
            let status = crate::view::refused_status(&e);
            render_sandboxes(&web, &signed, Some(&e.message), status).await
        }
    }
}

#[derive(Deserialize)]
pub(crate) struct ActForm {
    /// Absent: refused as a wrong token is (403), not as a malformed form.
    #[serde(default)]
    csrf: String,
    /// `fork`: how many copies.
    #[serde(default)]
    count: Option<u32>,
    /// `exec`: the command.
    #[serde(default)]
    command: Option<String>,
    /// `expose`: the port.
    #[serde(default)]
    port: Option<u16>,
    /// `expose`: the checkbox that makes it private (`on` when ticked).
    #[serde(default)]
    private: Option<String>,
    /// `snapshot`: its label.
    #[serde(default)]
    name: Option<String>,
    /// `network`: the allow list, entries apart by commas or spaces.
    #[serde(default)]
    allow_out: Option<String>,
    /// `network`: the deny list, as `allow_out`.
    #[serde(default)]
    deny_out: Option<String>,
}

/// A list typed in one field: entries apart by commas, spaces or lines.
fn entries(field: Option<&str>) -> Vec<String> {
    field
        .unwrap_or_default()
        .split(|c: char| c == ',' || c.is_whitespace())
        .filter(|e| !e.is_empty())
        .map(str::to_string)
        .collect()
}

/// `POST /sandboxes/{id}/act/{action}`: one of a sandbox's actions, then
/// the page that shows what it did.
pub(crate) async fn act(
    State(web): State<Web>,
    signed: Signed,
    Path((id, action)): Path<(String, String)>,
    PageForm(f): PageForm<ActForm>,
) -> PageResult {
    signed.check_csrf(&f.csrf)?;
    let c = &signed.caller;
    let back = format!("/sandboxes/{id}");
    let to = match action.as_str() {
        "destroy" => {
            web.api.destroy_sandbox(c, &id).await?;
            "/sandboxes".to_string()
        }
        "extend" => {
            web.api.extend_sandbox(c, &id, Some(15)).await?;
            back
        }
        "pause" => {
            web.api.pause_sandbox(c, &id).await?;
            back
        }
        "resume" => {
            web.api.resume_sandbox(c, &id).await?;
            back
        }
        "snapshot" => {
            let name = f.name.filter(|n| !n.trim().is_empty());
            web.api
                .snapshot_sandbox(c, &id, CreateSnapshot { name }, None)
                .await?;
            "/snapshots".to_string()
        }
        "fork" => {
            let fork = ForkSandbox {
                count: Some(f.count.unwrap_or(1)),
                timeout_minutes: None,
            };
            web.api.fork_sandbox(c, &id, fork).await?;
            "/sandboxes".to_string()
        }
        "exec" => {
            let command = f.command.unwrap_or_default();
            let params = ExecParams {
                command,
                ..Default::default()
            };
            web.api.exec(c, &id, params).await?;
            format!("{back}#executions")
        }
        "network" => {
            let lists = NetworkLists {
                allow_out: entries(f.allow_out.as_deref()),
                deny_out: entries(f.deny_out.as_deref()),
            };
            web.api.update_network(c, &id, lists, None).await?;
            format!("{back}#network")
        }
        "expose" => {
            let port = f
                .port
                .ok_or_else(|| Failure::new(StatusCode::BAD_REQUEST, "Which port?"))?;
            web.api
                .expose_port(c, &id, port, f.private.is_some())
                .await?;
            format!("{back}#ports")
        }
        other => {
            return Err(Failure::new(
                StatusCode::NOT_FOUND,
                format!("There is no action {other:?}."),
            ))
        }
    };
    Ok(Redirect::to(&to).into_response())
}

#[derive(Deserialize)]
pub(crate) struct SandboxQuery {
    /// The directory the file browser shows.
    #[serde(default)]
    path: Option<String>,
}

/// `/sandboxes/{id}`: one sandbox, its ports, files, executions and events.
pub(crate) async fn sandbox(
    State(web): State<Web>,
    signed: Signed,
    Path(id): Path<String>,
    Query(q): Query<SandboxQuery>,
) -> PageResult {
    let c = &signed.caller;
    let s = web.api.get_sandbox(c, &id).await?;
    let csrf = signed.csrf();
    let running = s.status == SandboxStatus::Running;
    let ports = if running {
        web.api
            .list_ports(c, &id)
            .await
            .map(|l| l.data)
            .unwrap_or_default()
    } else {
        Vec::new()
    };
    let dir = q.path.unwrap_or_else(|| "/workspace".into());
    let listing = if running {
        Some(web.api.list_files(c, &id, Some(&dir), false).await)
    } else {
        None
    };
    let executions = web.svc.store().sandbox_executions(&id, 20).await?;
    let events = crate::events::sandbox_section(&web, c, &id).await;
    let act = |a: &str| format!("/sandboxes/{id}/act/{a}");
    let body = html! {
        p class="crumbs" { a href="/sandboxes" { "Sandboxes" } " / " (id) }
        h1 { (s.name.as_deref().unwrap_or(&s.id)) " " (status_badge(&s)) }
        dl class="facts" {
            dt { "Id" } dd { code { (s.id) } }
            dt { "Size" } dd { (s.size) " — " (s.resources.vcpus) " vCPU, " (s.resources.memory_mb) " MiB, " (s.resources.disk_gb) " GB disk" }
            dt { "Created" } dd { (ago(&s.created_at)) }
            @if live(&s) {
                dt { "Expires" } dd { (countdown(&s.expires_at)) }
            } @else {
                dt { "Ended" } dd { @if let Some(d) = &s.deleted_at { (ago(d)) } }
                dt { "Why" } dd { (s.deleted_reason.as_deref().unwrap_or("")) }
            }
            dt { "Disk used" } dd { (view::bytes(s.disk_used_bytes)) }
        }
        @if live(&s) {
            div class="actions" { (sandbox_actions(&s, csrf)) }
        }
        @if running {
            section class="card" id="ports" aria-labelledby="ports-h" {
                h2 id="ports-h" { "Preview ports" }
                @if ports.is_empty() { p class="muted" { "No port is exposed." } }
                ul {
                    @for p in &ports {
                        li {
                            "Port " (p.port) ": "
                            @if let Some(signed) = &p.signed_url {
                                a href=(signed) target="_blank" rel="noopener" { (p.url) }
                                " " span class="badge" { "private" }
                                " (this link works for an hour; others need the sandbox's traffic token)"
                            } @else {
                                a href=(p.url) target="_blank" rel="noopener" { (p.url) }
                            }
                        }
                    }
                }
                form class="row" method="post" action=(act("expose")) {
                    input type="hidden" name="csrf" value=(csrf);
                    div {
                        label for="port" { "Port" }
                        input id="port" name="port" type="number" min="1" max="65535" required;
                    }
                    div class="check" {
                        input id="private" name="private" type="checkbox";
                        label for="private" { "Private (token or signed link only)" }
                    }
                    div { button type="submit" { "Expose port" } }
                }
            }
            section class="card" id="files" aria-labelledby="files-h" {
                h2 id="files-h" { "Files" }
                @match &listing {
                    Some(Ok(list)) => (crate::files::browser(&id, list, csrf)),
                    Some(Err(e)) => p class="error" role="alert" { (e.message) },
                    None => {},
                }
            }
            section class="card" id="run" aria-labelledby="run-h" {
                h2 id="run-h" { "Run a command" }
                form class="row" method="post" action=(act("exec")) {
                    input type="hidden" name="csrf" value=(csrf);
                    div class="grow" {
                        label for="command" { "Command" }
                        input id="command" name="command" type="text" required spellcheck="false"
                            placeholder="uname -a";
                    }
                    div { button type="submit" { "Run" } }
                }
            }
        }
        @if live(&s) {
            section class="card" id="network" aria-labelledby="network-h" {
                h2 id="network-h" { "Network" }
                @let lists = s.network.clone().unwrap_or_default();
                @if s.internet_access == Some(false) {
                    p { "No internet: nothing beyond the sandbox itself." }
                } @else if lists.allow_out.is_empty() && lists.deny_out.is_empty() {
                    p class="muted" { "The service's usual network: no lists of its own." }
                }
                p class="muted" {
                    "IPv4 addresses and prefixes, apart by commas or spaces. An allowed "
                    "destination is reached even inside a denied prefix (deny 0.0.0.0/0 "
                    "to reach the allowed ones only); a denied connect is refused at once."
                }
                form class="row" method="post" action=(act("network")) {
                    input type="hidden" name="csrf" value=(csrf);
                    div class="grow" {
                        label for="allow-out" { "Allowed" }
                        input id="allow-out" name="allow_out" type="text" spellcheck="false"
                            value=(lists.allow_out.join(", ")) placeholder="203.0.113.7";
                    }
                    div class="grow" {
                        label for="deny-out" { "Denied" }
                        input id="deny-out" name="deny_out" type="text" spellcheck="false"
                            value=(lists.deny_out.join(", ")) placeholder="0.0.0.0/0";
                    }
                    div { button type="submit" { "Save network" } }
                }
            }
        }
        section id="executions" aria-labelledby="exec-h" {
            h2 id="exec-h" { "Executions" }
            @if executions.is_empty() { p class="muted" { "No commands yet." } }
            @for e in &executions {
                details class="execution" {
                    summary {
                        code { (e.command) }
                        " — " span class={ "badge " (e.status.as_str()) } { (e.status.as_str()) }
                        @if let Some(code) = e.exit_code { " exit " (code) }
                        " · " (e.duration_ms) " ms"
                    }
                    @if !e.stdout.is_empty() { h3 { "stdout" } pre { (e.stdout) } }
                    @if !e.stderr.is_empty() { h3 { "stderr" } pre class="stderr" { (e.stderr) } }
                    @if e.truncated { p class="muted" { "Output past 1 MiB per stream was dropped." } }
                }
            }
        }
        (events)
    };
    Ok(page(&s.id, Some(&signed.session), Section::Sandboxes, body).into_response())
}

/// `/sandboxes/{id}/terminal`: a full-page terminal.
pub(crate) async fn terminal(
    State(web): State<Web>,
    signed: Signed,
    Path(id): Path<String>,
) -> PageResult {
    let s = web.api.get_sandbox(&signed.caller, &id).await?;
    if !live(&s) {
        return Err(Failure::new(
            StatusCode::CONFLICT,
            format!("Sandbox {id} has ended: it has no terminal."),
        ));
    }
    let body = html! {
        p class="crumbs" { a href="/sandboxes" { "Sandboxes" } " / " a href={ "/sandboxes/" (id) } { (id) } " / terminal" }
        div class="terminal-bar" {
            span id="term-status" role="status" aria-live="polite" { "Connecting…" }
            button type="button" id="term-reconnect" hidden { "Reconnect" }
        }
        div id="terminal" class="terminal" data-sandbox=(id) data-csrf=(signed.csrf())
            aria-label="Terminal" {}
        link rel="stylesheet" href=(assets::url("xterm.css"));
        script src=(assets::url("xterm.js")) {}
        script src=(assets::url("addon-fit.js")) {}
        script src=(assets::url("terminal.js")) {}
    };
    Ok(page("Terminal", Some(&signed.session), Section::Sandboxes, body).into_response())
}

/// `POST /sandboxes/{id}/terminal-token` (from the terminal page's script,
/// its CSRF token in `x-csrf-token`): a one-use token for the terminal's
/// WebSocket, which the browser cannot open with a key.
pub(crate) async fn terminal_token(
    State(web): State<Web>,
    signed: Signed,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> PageResult {
    let sent = headers
        .get("x-csrf-token")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    signed.check_csrf(sent)?;
    let token = web.api.terminal_token(&signed.caller, &id).await?;
    Ok(Json(token).into_response())
}

/// `/snapshots`: the account's snapshots.
pub(crate) async fn snapshots(State(web): State<Web>, signed: Signed) -> PageResult {
    let list = web
        .api
        .list_snapshots(
            &signed.caller,
            ListSnapshots {
                limit: Some(100),
                ..Default::default()
            },
        )
        .await?;
    let csrf = signed.csrf();
    let body = html! {
        h1 { "Snapshots" }
        p class="muted" { "A snapshot keeps a sandbox's disk, memory and running processes. Start new sandboxes from one on the Sandboxes page." }
        @if list.data.is_empty() { p class="muted" { "No snapshots yet." } }
        @else {
            div class="scroll" { table {
                thead { tr { th scope="col" { "Snapshot" } th scope="col" { "Of" } th scope="col" { "Size" }
                    th scope="col" { "Status" } th scope="col" { "Stored" } th scope="col" { "Taken" } th scope="col" { "Expires" } th scope="col" { "" } } }
                tbody {
                    @for s in &list.data {
                        tr {
                            td { (s.name.as_deref().unwrap_or(&s.id)) br; code class="small" { (s.id) } }
                            td { a href={ "/sandboxes/" (s.sandbox_id) } { (s.sandbox_id) } }
                            td { (s.size) }
                            td { span class={ "badge " (s.status) } { (s.status) } }
                            td { (view::bytes(s.size_bytes)) }
                            td { (ago(&s.created_at)) }
                            td { (countdown(&s.expires_at)) }
                            td { (action_button(&format!("/snapshots/{}/delete", s.id), csrf, "Delete", "danger")) }
                        }
                    }
                }
            } }
        }
    };
    Ok(page("Snapshots", Some(&signed.session), Section::Snapshots, body).into_response())
}

pub(crate) async fn delete_snapshot(
    State(web): State<Web>,
    signed: Signed,
    Path(id): Path<String>,
    PageForm(f): PageForm<CsrfOnly>,
) -> PageResult {
    signed.check_csrf(&f.csrf)?;
    web.api.delete_snapshot(&signed.caller, &id).await?;
    Ok(Redirect::to("/snapshots").into_response())
}

/// `/usage`: credit, spending by day (a bar chart), cost per sandbox.
pub(crate) async fn usage(State(web): State<Web>, signed: Signed) -> PageResult {
    const DAYS: i64 = 30;
    let usage = web.api.usage(&signed.caller, Some(DAYS as u32)).await?;
    let today = time::OffsetDateTime::now_utc().date();
    let first = today - time::Duration::days(DAYS - 1);
    // Each sandbox's cost (what it was charged, or has run up so far if it
    // still runs) on the day it was made: the chart adds up to the total.
    let mut per_day: Vec<(String, f64)> = Vec::new();
    for s in &usage.sandboxes {
        let day = s.created_at.get(..10).unwrap_or_default().to_string();
        match per_day.iter_mut().find(|(d, _)| *d == day) {
            Some((_, v)) => *v += s.cost_usd,
            None => per_day.push((day, s.cost_usd)),
        }
    }
    let body = html! {
        h1 { "Usage" }
        div class="tiles" {
            div class="tile" { span class="label" { "Credit left" } span class="value" id="credit" { (usd(usage.credit_remaining_usd)) } }
            div class="tile" { span class="label" { "Spent, last " (DAYS) " days" } span class="value" { (usd(usage.total_cost_usd)) } }
        }
        section class="card" aria-labelledby="chart-h" {
            h2 id="chart-h" { "Spending per day" }
            (chart(first, DAYS, &per_day))
            p class="muted small" { "Each sandbox counts on the day it was created; a running one with what it has run up so far." }
        }
        section aria-labelledby="per-h" {
            h2 id="per-h" { "Cost per sandbox" }
            @if usage.sandboxes.is_empty() { p class="muted" { "Nothing yet." } }
            @else {
                div class="scroll" { table {
                    thead { tr { th scope="col" { "Sandbox" } th scope="col" { "Size" } th scope="col" { "Ran" } th scope="col" { "Cost" } th scope="col" { "Created" } } }
                    tbody {
                        @for s in &usage.sandboxes {
                            tr {
                                td { a href={ "/sandboxes/" (s.id) } { (s.id) } }
                                td { (s.size) }
                                td { (view::span(s.seconds as i64)) }
                                td class="num" { (usd(s.cost_usd)) }
                                td { (ago(&s.created_at)) }
                            }
                        }
                    }
                } }
            }
        }
    };
    Ok(page("Usage", Some(&signed.session), Section::Usage, body).into_response())
}

/// A bar per day from `first` for `days` days, as SVG with a text
/// alternative (a table for screen readers).
fn chart(first: time::Date, days: i64, spent: &[(String, f64)]) -> Markup {
    let per_day: Vec<(String, f64)> = (0..days)
        .map(|i| {
            let day = (first + time::Duration::days(i)).to_string();
            let usd = spent
                .iter()
                .find(|(d, _)| *d == day)
                .map_or(0.0, |(_, v)| *v);
            (day, usd)
        })
        .collect();
    let top = per_day.iter().map(|(_, v)| *v).fold(0.0, f64::max);
    let (w, h, bar) = (days as f64 * 12.0, 120.0, 10.0);
    html! {
        figure class="chart" {
            svg viewBox={ "0 0 " (w) " " (h + 20.0) } role="img"
                aria-label={ "Spending per day over " (days) " days, at most " (usd(top)) " a day" } {
                @for (i, (day, v)) in per_day.iter().enumerate() {
                    @let height = if top > 0.0 { (v / top * h).max(if *v > 0.0 { 1.0 } else { 0.0 }) } else { 0.0 };
                    rect x=(i as f64 * 12.0 + 1.0) y=(h - height) width=(bar) height=(height) {
                        title { (day) ": " (usd(*v)) }
                    }
                }
                line x1="0" y1=(h) x2=(w) y2=(h) class="axis" {}
                text x="0" y=(h + 15.0) { (per_day.first().map_or("", |d| d.0.as_str())) }
                text x=(w) y=(h + 15.0) text-anchor="end" { (per_day.last().map_or("", |d| d.0.as_str())) }
            }
            figcaption class="sr-only" {
                table {
                    @for (day, v) in per_day.iter().filter(|(_, v)| *v > 0.0) {
                        tr { td { (day) } td { (usd(*v)) } }
                    }
                }
            }
        }
    }
}

/// `/accounts`: an operator's view of every account, with credit to add.
pub(crate) async fn accounts(State(web): State<Web>, signed: Signed) -> PageResult {
    require_admin(&signed)?;
    let accounts = sandpit_core::admin::list_accounts(web.svc.store()).await?;
    let csrf = signed.csrf();
    let body = html! {
        h1 { "Accounts" }
        div class="scroll" { table {
            thead { tr { th scope="col" { "Account" } th scope="col" { "Credit" } th scope="col" { "Concurrent" }
                th scope="col" { "Created" } th scope="col" { "Add credit" } } }
            tbody {
                @for a in &accounts {
                    tr {
                        td { (a.name) br; code class="small" { (a.id) } }
                        td class="num" { (usd(a.credit_remaining_usd)) }
                        td class="num" { (a.max_concurrent_sandboxes) }
                        td { (ago(&a.created_at)) }
                        td {
                            form class="inline" method="post" action={ "/accounts/" (a.id) "/credit" } {
                                input type="hidden" name="csrf" value=(csrf);
                                label class="sr-only" for={ "usd-" (a.id) } { "USD to add to " (a.name) }
                                input id={ "usd-" (a.id) } name="usd" type="number" min="0.01" step="0.01" required class="short";
                                button type="submit" aria-label={ "Add credit to " (a.name) } { "Add" }
                            }
                        }
                    }
                }
            }
        } }
    };
    Ok(page("Accounts", Some(&signed.session), Section::Accounts, body).into_response())
}

fn require_admin(signed: &Signed) -> Result<(), Failure> {
    if signed.session.admin {
        Ok(())
    } else {
        Err(Failure::new(
            StatusCode::FORBIDDEN,
            "Only an operator's account sees every account.",
        ))
    }
}

#[derive(Deserialize)]
pub(crate) struct CreditForm {
    /// Absent: refused as a wrong token is (403), not as a malformed form.
    #[serde(default)]
    csrf: String,
    usd: f64,
}

pub(crate) async fn add_credit(
    State(web): State<Web>,
    signed: Signed,
    Path(id): Path<String>,
    PageForm(f): PageForm<CreditForm>,
) -> PageResult {
    signed.check_csrf(&f.csrf)?;
    require_admin(&signed)?;
    let store = web.svc.store();
    let account = store
        .account(&id)
        .await?
        .ok_or_else(|| Failure::new(StatusCode::NOT_FOUND, format!("No account {id}.")))?;
    sandpit_core::admin::add_credit(store, &account.name, f.usd).await?;
    Ok(Redirect::to("/accounts").into_response())
}

/// What a directory entry's kind reads as.
pub(crate) fn kind_word(k: &EntryType) -> &'static str {
    match k {
        EntryType::File => "file",
        EntryType::Dir => "directory",
        EntryType::Symlink => "link",
        EntryType::Other => "other",
    }
}
