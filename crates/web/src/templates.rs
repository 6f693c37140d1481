//! The dashboard's templates: what the account may start sandboxes from
//! (each `name:tag`'s newest ready build, with a button that starts one),
//! every build with its status, a build's page with its log and steps, and
//! a rebuild. Builds are described elsewhere (a Dockerfile with `sandpit
//! template build`, E2B's `Template.build`, REST): a page cannot hold a
//! build context, so a rebuild sends a build's own steps again, from
//! scratch (with the cache nothing would change).

use crate::session::{CsrfOnly, Signed};
use crate::view::{action_button, ago, bytes, page, Failure, PageForm, Section};
use crate::Web;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Redirect, Response};
use maud::{html, Markup};
use sandpit_core::{usable_templates, BuildTemplate, Template};

type PageResult = Result<Response, Failure>;

fn status_badge(t: &Template) -> Markup {
    html! { span class={ "badge " (t.status) } { (t.status) } }
}

/// "3 steps (2 cached)".
fn steps(t: &Template) -> String {
    let word = if t.steps == 1 { "step" } else { "steps" };
    match t.cached_steps {
        0 => format!("{} {word}", t.steps),
        n => format!("{} {word} ({n} cached)", t.steps),
    }
}

/// `/templates`: the templates to start from, then every build.
pub(crate) async fn list(State(web): State<Web>, signed: Signed) -> PageResult {
    let builds = web.api.list_templates(&signed.caller).await?.data;
    let usable = usable_templates(&builds);
    let info = web.api.service_info().await?;
    let csrf = signed.csrf();
    let body = html! {
        h1 { "Templates" }
        p class="muted" {
            "A template is an environment built once (packages, files, a server already running); "
            "a sandbox from it starts in the time of a restore. Build one with "
            code { "sandpit template build NAME -f Dockerfile" } ", E2B's "
            code { "Template.build" } " or " code { "POST /v1/templates" } "."
        }
        section aria-labelledby="usable-h" {
            h2 id="usable-h" { "Ready to use (" (usable.len()) ")" }
            @if usable.is_empty() {
                p class="muted" { "No templates yet." }
            } @else {
                div class="scroll" { table {
                    thead { tr { th scope="col" { "Template" } th scope="col" { "" } } }
                    tbody {
                        @for t in &usable {
                            @let reference = format!("{}:{}", t.name, t.tag);
                            tr {
                                td {
                                    a href={ "/templates/" (t.id) } { (reference) }
                                    @if t.public { " " span class="badge public" { "public" } }
                                    br;
                                    span class="muted small" {
                                        (t.size) " · " (steps(t)) " · " (bytes(t.size_bytes))
                                        " · built " (ago(t.finished_at.as_deref().unwrap_or(&t.created_at)))
                                    }
                                }
                                td {
                                    form class="inline" method="post" action="/sandboxes" {
                                        input type="hidden" name="csrf" value=(csrf);
                                        input type="hidden" name="template" value=(reference);
                                        input type="hidden" name="size" value=(t.size);
                                        input type="hidden" name="timeout_minutes" value=(info.default_timeout_minutes);
                                        button type="submit" aria-label={ "New sandbox from " (reference) } { "New sandbox" }
                                    }
                                }
                            }
                        }
                    }
                } }
            }
        }
        @if !builds.is_empty() {
            section aria-labelledby="builds-h" {
                h2 id="builds-h" { "Builds" }
                div class="scroll" { table {
                    thead { tr {
                        th scope="col" { "Build" } th scope="col" { "Status" }
                        th scope="col" { "Started" } th scope="col" { "" }
                    } }
                    tbody {
                        @for t in &builds {
                            tr {
                                td {
                                    a href={ "/templates/" (t.id) } { (t.name) ":" (t.tag) }
                                    br; code class="small" { (t.id) }
                                }
                                td { (status_badge(t)) br; span class="muted small" { (steps(t)) } }
                                td { (ago(&t.created_at)) }
                                td {
                                    @if !t.public && t.status != "building" && t.status != "waiting" {
                                        (action_button(&format!("/templates/{}/delete", t.id), csrf, "Delete", "danger"))
                                    }
                                }
                            }
                        }
                    }
                } }
            }
        }
    };
    Ok(page("Templates", Some(&signed.session), Section::Templates, body).into_response())
}

/// `/templates/{id}`: one build, its log and its steps.
pub(crate) async fn build(
    State(web): State<Web>,
    signed: Signed,
    Path(id): Path<String>,
) -> PageResult {
    let t = web.api.get_template(&signed.caller, &id).await?;
    let csrf = signed.csrf();
    let going = t.status == "building" || t.status == "waiting";
    let spec = t
        .spec
        .as_ref()
        .map(|s| serde_json::to_string_pretty(s).unwrap_or_default());
    let body = html! {
        h1 { (t.name) ":" (t.tag) }
        p {
            (status_badge(&t)) " "
            code class="small" { (t.id) } " · " (t.size) " · " (steps(&t)) " · "
            (bytes(t.size_bytes)) " stored · started " (ago(&t.created_at))
        }
        @if let Some(e) = &t.error {
            p class="error" role="alert" { (e) }
        }
        @if going {
            p class="muted" { "Building: " a href={ "/templates/" (t.id) } { "reload" } " to follow its log." }
        }
        div class="row" {
            @if !going {
                (action_button(&format!("/templates/{}/rebuild", t.id), csrf, "Rebuild from scratch", ""))
            }
            a href="/templates" { "All templates" }
        }
        section aria-labelledby="log-h" {
            h2 id="log-h" { "Log" }
            pre class="log" { (t.log.as_deref().unwrap_or_default()) }
        }
        @if let Some(spec) = spec {
            details {
                summary { "Steps (as " code { "spec" } " in POST /v1/templates)" }
                pre { (spec) }
            }
        }
    };
    Ok(page("Template", Some(&signed.session), Section::Templates, body).into_response())
}

/// `POST /templates/{id}/rebuild`: the build's steps again, every one
/// run; then the new build's page.
pub(crate) async fn rebuild(
    State(web): State<Web>,
    signed: Signed,
    Path(id): Path<String>,
    PageForm(f): PageForm<CsrfOnly>,
) -> PageResult {
    signed.check_csrf(&f.csrf)?;
    let t = web.api.get_template(&signed.caller, &id).await?;
    let again = BuildTemplate {
        name: format!("{}:{}", t.name, t.tag),
        size: Some(t.size.clone()),
        spec: t.spec.clone(),
        no_cache: true,
        ..BuildTemplate::default()
    };
    let started = web.api.build_template(&signed.caller, again).await?;
    Ok(Redirect::to(&format!("/templates/{}", started.id)).into_response())
}

pub(crate) async fn delete(
    State(web): State<Web>,
    signed: Signed,
    Path(id): Path<String>,
    PageForm(f): PageForm<CsrfOnly>,
) -> PageResult {
    signed.check_csrf(&f.csrf)?;
    web.api.delete_template(&signed.caller, &id).await?;
    Ok(Redirect::to("/templates").into_response())
}
