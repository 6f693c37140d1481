//! The account's secrets: listed by name, the hosts each may be sent to,
//! where it goes in a request and when it was last used (never its value),
//! stored or replaced with a form (the value typed in a password field and
//! never shown again) and deleted. A sandbox gets them at its create (this
//! dashboard's form, `secrets` in the API); how they stay out of the VM is
//! `sandpit_core::service::secrets`'.

use crate::session::{CsrfOnly, Signed};
use crate::view::{ago, page, Failure, PageForm, Section};
use crate::Web;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Redirect, Response};
use maud::html;
use sandpit_core::PutSecret;
use serde::Deserialize;

type PageResult = Result<Response, Failure>;

/// `/secrets`.
pub(crate) async fn list(State(web): State<Web>, signed: Signed) -> PageResult {
    render(&web, &signed, None, StatusCode::OK).await
}

/// The page; after a form that failed, what went wrong and the form as it
/// was sent (all but the value).
async fn render(
    web: &Web,
    signed: &Signed,
    failed: Option<(&str, &PutForm)>,
    status: StatusCode,
) -> PageResult {
    let error = failed.map(|(e, _)| e);
    let sent = failed.map(|(_, f)| f);
    let kept = |field: fn(&PutForm) -> &str, default: &'static str| {
        sent.map_or(default.to_string(), |f| field(f).to_string())
    };
    let secrets = web.api.list_secrets(&signed.caller).await?.data;
    let csrf = signed.csrf();
    let body = html! {
        h1 { "Secrets" }
        p class="muted" {
            "A secret is a credential your sandboxes use without holding it. A sandbox created "
            "with one sees only a placeholder in the environment variable of its name; the host "
            "puts the value in place of the placeholder in HTTPS requests to the secret's hosts, "
            "and nowhere else. A value is never shown again once saved."
        }
        @if let Some(e) = error {
            p class="error" role="alert" { (e) }
        }
        section class="card" aria-labelledby="put-h" {
            h2 id="put-h" { "Save a secret" }
            p class="muted" { "A name already saved is replaced; sandboxes using it get the new value for their next requests." }
            form class="row" method="post" action="/secrets" {
                input type="hidden" name="csrf" value=(csrf);
                div {
                    label for="secret-name" { "Name (an environment variable)" }
                    input id="secret-name" name="name" type="text" required pattern="[A-Za-z_][A-Za-z0-9_]*"
                        maxlength="64" autocomplete="off" spellcheck="false" placeholder="OPENAI_API_KEY"
                        value=(kept(|f| &f.name, ""));
                }
                div {
                    label for="secret-value" { "Value" }
                    input id="secret-value" name="value" type="password" required autocomplete="new-password";
                }
                div {
                    label for="secret-hosts" { "Hosts it may be sent to" }
                    input id="secret-hosts" name="hosts" type="text" required spellcheck="false"
                        placeholder="api.openai.com, *.example.com" value=(kept(|f| &f.hosts, ""));
                }
                div {
                    label for="secret-header" { "Header" }
                    input id="secret-header" name="header" type="text" spellcheck="false"
                        value=(kept(|f| &f.header, "Authorization"));
                }
                div {
                    label for="secret-format" { "Header's value ({value}: the secret)" }
                    input id="secret-format" name="format" type="text" spellcheck="false"
                        value=(kept(|f| &f.format, "Bearer {value}"));
                }
                div { button type="submit" { "Save secret" } }
            }
        }
        section aria-labelledby="list-h" {
            h2 id="list-h" { "Saved (" (secrets.len()) ")" }
            @if secrets.is_empty() {
                p class="muted" { "No secrets yet." }
            } @else {
                div class="scroll" { table {
                    thead { tr {
                        th scope="col" { "Name" } th scope="col" { "Hosts" } th scope="col" { "Sent as" }
                        th scope="col" { "Updated" } th scope="col" { "Last used" } th scope="col" { "" }
                    } }
                    tbody {
                        @for s in &secrets {
                            tr {
                                td { code { (s.name) } }
                                td {
                                    @if s.hosts.is_empty() { span class="muted" { "none" } }
                                    @for (i, h) in s.hosts.iter().enumerate() {
                                        @if i > 0 { ", " }
                                        code { (h) }
                                    }
                                }
                                td { code { (s.header) ": " (s.format) } }
                                td { (ago(&s.updated_at)) }
                                td { @match &s.last_used_at { Some(t) => (ago(t)), None => span class="muted" { "never" } } }
                                td {
                                    form class="inline" method="post" action={ "/secrets/" (s.name) "/delete" } {
                                        input type="hidden" name="csrf" value=(csrf);
                                        button type="submit" class="danger" aria-label={ "Delete " (s.name) } { "Delete" }
                                    }
                                }
                            }
                        }
                    }
                } }
            }
        }
    };
    let page = page("Secrets", Some(&signed.session), Section::Secrets, body);
    // The form's fields are not kept by a cache (the value is a password
    // field's, but the page is the account's own).
    Ok((
        status,
        [(axum::http::header::CACHE_CONTROL, "no-store")],
        page,
    )
        .into_response())
}

#[derive(Deserialize)]
pub(crate) struct PutForm {
    /// Absent: refused as a wrong token is (403), not as a malformed form.
    #[serde(default)]
    csrf: String,
    name: String,
    value: String,
    /// Entries apart by commas, spaces or lines.
    hosts: String,
    #[serde(default)]
    header: String,
    #[serde(default)]
    format: String,
}

/// `POST /secrets`: saved, then the list; or the page again saying why not.
pub(crate) async fn put(
    State(web): State<Web>,
    signed: Signed,
    PageForm(mut f): PageForm<PutForm>,
) -> PageResult {
    signed.check_csrf(&f.csrf)?;
    let hosts = f
        .hosts
        .split(|c: char| c == ',' || c.is_whitespace())
        .filter(|h| !h.is_empty())
        .map(str::to_string)
        .collect();
    let given = |s: &str| Some(s.trim().to_string()).filter(|s| !s.is_empty());
    let req = PutSecret {
        value: std::mem::take(&mut f.value),
        hosts,
        header: given(&f.header),
        format: given(&f.format),
    };
    match web.api.put_secret(&signed.caller, f.name.trim(), req).await {
        Ok(_) => Ok(Redirect::to("/secrets").into_response()),
        Err(e) => {
            let status = crate::view::refused_status(&e);
            render(&web, &signed, Some((&e.message, &f)), status).await
        }
    }
}

/// `POST /secrets/{name}/delete`.
pub(crate) async fn delete(
    State(web): State<Web>,
    signed: Signed,
    Path(name): Path<String>,
    PageForm(f): PageForm<CsrfOnly>,
) -> PageResult {
    signed.check_csrf(&f.csrf)?;
    web.api.delete_secret(&signed.caller, &name).await?;
    Ok(Redirect::to("/secrets").into_response())
}
