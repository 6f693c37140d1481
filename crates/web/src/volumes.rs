//! The account's volumes: listed with their size, state and the live
//! sandboxes that mount each, made with a form (name and size), grown
//! and deleted. A sandbox mounts them at its create (this dashboard's
//! form, `volumes` in the API); what a volume is and how it reaches a VM
//! is `sandpit_core::service::volumes`'.

use crate::session::{CsrfOnly, Signed};
use crate::view::{ago, page, Failure, PageForm, Section};
use crate::Web;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Redirect, Response};
use maud::html;
use sandpit_core::{CreateVolume, ResizeVolume};
use serde::Deserialize;

type PageResult = Result<Response, Failure>;

/// `/volumes`.
pub(crate) async fn list(State(web): State<Web>, signed: Signed) -> PageResult {
    render(&web, &signed, None, StatusCode::OK).await
}

/// The page; after a form that failed, what went wrong and the create
/// form as it was sent.
async fn render(
    web: &Web,
    signed: &Signed,
    failed: Option<(&str, Option<&CreateForm>)>,
    status: StatusCode,
) -> PageResult {
    let error = failed.map(|(e, _)| e);
    let sent = failed.and_then(|(_, f)| f);
    let volumes = web.api.list_volumes(&signed.caller).await?.data;
    let csrf = signed.csrf();
    let body = html! {
        h1 { "Volumes" }
        p class="muted" {
            "A volume is storage your sandboxes share and that outlives them: a repository, a "
            "dataset, a cache. Mount one when you create a sandbox (one sandbox writes it at a "
            "time, any number read it); what is written there stays when the sandbox ends. Its "
            "size is billed per second while it exists."
        }
        @if let Some(e) = error {
            p class="error" role="alert" { (e) }
        }
        section class="card" aria-labelledby="make-h" {
            h2 id="make-h" { "New volume" }
            form class="row" method="post" action="/volumes" {
                input type="hidden" name="csrf" value=(csrf);
                div {
                    label for="volume-name" { "Name" }
                    input id="volume-name" name="name" type="text" required pattern="[A-Za-z0-9_-]+"
                        maxlength="64" autocomplete="off" spellcheck="false" placeholder="data"
                        value=(sent.map_or("", |f| f.name.as_str()));
                }
                div {
                    label for="volume-size" { "Size (GiB)" }
                    input id="volume-size" name="size_gb" type="number" min="1" required
                        value=(sent.map_or(1, |f| f.size_gb));
                }
                div { button type="submit" { "Create volume" } }
            }
        }
        section aria-labelledby="list-h" {
            h2 id="list-h" { "Volumes (" (volumes.len()) ")" }
            @if volumes.is_empty() {
                p class="muted" { "No volumes yet." }
            } @else {
                div class="scroll" { table {
                    thead { tr {
                        th scope="col" { "Name" } th scope="col" { "Size" } th scope="col" { "State" }
                        th scope="col" { "Mounted by" } th scope="col" { "Created" } th scope="col" { "" }
                    } }
                    tbody {
                        @for v in &volumes {
                            tr {
                                td { code { (v.name) } br; span class="muted" { (v.id) } }
                                td { (v.size_gb) " GiB" }
                                td { (v.status) }
                                td {
                                    @if v.mounted_by.is_empty() { span class="muted" { "none" } }
                                    @for (i, m) in v.mounted_by.iter().enumerate() {
                                        @if i > 0 { br; }
                                        a href={ "/sandboxes/" (m.sandbox_id) } { (m.sandbox_id) }
                                        " at " code { (m.path) }
                                        @if m.read_only { " (read-only)" }
                                    }
                                }
                                td { (ago(&v.created_at)) }
                                td {
                                    form class="inline" method="post" action={ "/volumes/" (v.id) "/resize" } {
                                        input type="hidden" name="csrf" value=(csrf);
                                        input id={ "grow-" (v.id) } name="size_gb" type="number" min=(v.size_gb)
                                            value=(v.size_gb) required aria-label={ "New size of " (v.name) " (GiB)" };
                                        button type="submit" aria-label={ "Grow " (v.name) } { "Grow" }
                                    }
                                    form class="inline" method="post" action={ "/volumes/" (v.id) "/delete" } {
                                        input type="hidden" name="csrf" value=(csrf);
                                        button type="submit" class="danger" aria-label={ "Delete " (v.name) } { "Delete" }
                                    }
                                }
                            }
                        }
                    }
                } }
            }
        }
    };
    let page = page("Volumes", Some(&signed.session), Section::Volumes, body);
    Ok((status, page).into_response())
}

#[derive(Deserialize)]
pub(crate) struct CreateForm {
    /// Absent: refused as a wrong token is (403), not as a malformed form.
    #[serde(default)]
    csrf: String,
    name: String,
    size_gb: u32,
}

/// `POST /volumes`: made, then the list; or the page again saying why not.
pub(crate) async fn create(
    State(web): State<Web>,
    signed: Signed,
    PageForm(f): PageForm<CreateForm>,
) -> PageResult {
    signed.check_csrf(&f.csrf)?;
    let req = CreateVolume {
        name: f.name.trim().to_string(),
        size_gb: Some(f.size_gb),
    };
    match web.api.create_volume(&signed.caller, req, None).await {
        Ok(_) => Ok(Redirect::to("/volumes").into_response()),
        Err(e) => {
            let status = crate::view::refused_status(&e);
            render(&web, &signed, Some((&e.message, Some(&f))), status).await
        }
    }
}

#[derive(Deserialize)]
pub(crate) struct ResizeForm {
    #[serde(default)]
    csrf: String,
    size_gb: u32,
}

/// `POST /volumes/{id}/resize`.
pub(crate) async fn resize(
    State(web): State<Web>,
    signed: Signed,
    Path(id): Path<String>,
    PageForm(f): PageForm<ResizeForm>,
) -> PageResult {
    signed.check_csrf(&f.csrf)?;
    let req = ResizeVolume { size_gb: f.size_gb };
    match web.api.resize_volume(&signed.caller, &id, req).await {
        Ok(_) => Ok(Redirect::to("/volumes").into_response()),
        Err(e) => {
            let status = crate::view::refused_status(&e);
            render(&web, &signed, Some((&e.message, None)), status).await
        }
    }
}

/// `POST /volumes/{id}/delete`: gone, or the page saying why not (a
/// sandbox mounts it).
pub(crate) async fn delete(
    State(web): State<Web>,
    signed: Signed,
    Path(id): Path<String>,
    PageForm(f): PageForm<CsrfOnly>,
) -> PageResult {
    signed.check_csrf(&f.csrf)?;
    match web.api.delete_volume(&signed.caller, &id).await {
        Ok(_) => Ok(Redirect::to("/volumes").into_response()),
        Err(e) => {
            let status = crate::view::refused_status(&e);
            render(&web, &signed, Some((&e.message, None)), status).await
        }
    }
}
