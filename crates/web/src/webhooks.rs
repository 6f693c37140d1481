//! The account's webhooks: listed with the events each gets and how its
//! deliveries went, made with a form (the URL, the event types, a
//! description; its signing secret shown once on the page that answers),
//! deleted, and each on a page of its own with its last deliveries, every
//! attempt of each, and a button to send one again. How events are
//! delivered, signed and retried is `sandpit_core::service::events`'.

use crate::session::{CsrfOnly, Signed};
use crate::view::{ago, countdown, page, Failure, PageForm, Section};
use crate::Web;
use axum::extract::{Path, Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use maud::{html, Markup};
use sandpit_core::{CreateWebhook, ListDeliveries, Webhook, WebhookDelivery, EVENT_TYPES};
use serde::Deserialize;

type PageResult = Result<Response, Failure>;

/// Deliveries on a webhook's page.
const DELIVERIES: u32 = 20;

/// `/webhooks`.
pub(crate) async fn list(State(web): State<Web>, signed: Signed) -> PageResult {
    render(&web, &signed, None, StatusCode::OK).await
}

/// The create form as it was posted.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct CreateForm {
    csrf: String,
    url: String,
    description: String,
    /// The event types ticked.
    events: Vec<String>,
}

impl CreateForm {
    /// The form's fields (a checkbox per event type, so `events` comes
    /// once per ticked type, which a struct cannot be read from).
    fn from_fields(fields: Vec<(String, String)>) -> CreateForm {
        let mut f = CreateForm::default();
        for (name, value) in fields {
            match name.as_str() {
                "csrf" => f.csrf = value,
                "url" => f.url = value,
                "description" => f.description = value,
                "events" if !f.events.contains(&value) => f.events.push(value),
                _ => {}
            }
        }
        f
    }

    /// What the API is asked for: the ticked types, or all when none is
    /// (ticking a type means only the ticked ones, whatever "All events"
    /// says, which a page without script cannot untick for the person).
    fn request(&self) -> CreateWebhook {
        CreateWebhook {
            url: self.url.trim().to_string(),
            events: self.events.clone(),
            description: Some(self.description.trim().to_string()).filter(|d| !d.is_empty()),
        }
    }
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
    let hooks = web.api.list_webhooks(&signed.caller).await?.data;
    let csrf = signed.csrf();
    let body = html! {
        h1 { "Webhooks" }
        p class="muted" {
            "A webhook is an address of yours that Sandpit POSTs your sandboxes' "
            a href="/events" { "events" } " to as they happen, as JSON, signed with the webhook's "
            "secret (Standard Webhooks). An answer other than 2xx is tried again, for up to a day."
        }
        @if let Some(e) = error {
            p class="error" role="alert" { (e) }
        }
        section class="card" aria-labelledby="make-h" {
            h2 id="make-h" { "New webhook" }
            (create_form(csrf, sent))
        }
        section aria-labelledby="list-h" {
            h2 id="list-h" { "Webhooks (" (hooks.len()) ")" }
            @if hooks.is_empty() {
                p class="muted" { "No webhooks yet." }
            } @else {
                div class="scroll" { table {
                    thead { tr {
                        th scope="col" { "Address" } th scope="col" { "Events" }
                        th scope="col" { "Deliveries" } th scope="col" { "Created" } th scope="col" { "" }
                    } }
                    tbody {
                        @for h in &hooks {
                            tr {
                                td {
                                    a href={ "/webhooks/" (h.id) } { code { (h.url) } }
                                    @if let Some(d) = &h.description { br; (d) }
                                    br; span class="muted small" { (h.id) }
                                }
                                td { (event_types(h)) }
                                td { (counts(h)) }
                                td { (ago(&h.created_at)) }
                                td {
                                    form class="inline" method="post" action={ "/webhooks/" (h.id) "/delete" } {
                                        input type="hidden" name="csrf" value=(csrf);
                                        button type="submit" class="danger" aria-label={ "Delete " (h.url) } { "Delete" }
                                    }
                                }
                            }
                        }
                    }
                } }
            }
        }
    };
    let page = page("Webhooks", Some(&signed.session), Section::Webhooks, body);
    Ok((status, page).into_response())
}

/// The create form, filled in as `sent` was.
fn create_form(csrf: &str, sent: Option<&CreateForm>) -> Markup {
    let ticked = |t: &str| sent.is_some_and(|f| f.events.iter().any(|e| e == t));
    let all = sent.is_none_or(|f| f.events.is_empty());
    html! {
        form method="post" action="/webhooks" class="webhook" {
            input type="hidden" name="csrf" value=(csrf);
            div class="row" {
                div class="grow" {
                    label for="webhook-url" { "URL" }
                    input id="webhook-url" name="url" type="url" required maxlength="2000"
                        autocomplete="off" spellcheck="false" placeholder="https://example.com/hooks/sandpit"
                        value=(sent.map_or("", |f| f.url.as_str()));
                }
                div class="grow" {
                    label for="webhook-description" { "Description (optional)" }
                    input id="webhook-description" name="description" type="text" maxlength="200"
                        value=(sent.map_or("", |f| f.description.as_str()));
                }
            }
            fieldset class="checks" {
                legend { "Events to send" }
                div class="check" {
                    input id="events-all" name="all" type="checkbox" value="on" checked[all]
                        data-all-events;
                    label for="events-all" { "All events" }
                }
                @for t in EVENT_TYPES {
                    @let id = format!("event-{}", t.trim_start_matches("sandbox."));
                    div class="check" {
                        input id=(id) name="events" type="checkbox" value=(t) checked[ticked(t)]
                            data-event-type;
                        label for=(id) { code { (t) } }
                    }
                }
                p class="muted small" { "Tick types to get only those; with none ticked, every event." }
            }
            button type="submit" { "Create webhook" }
        }
    }
}

/// The event types a webhook gets, as they read.
fn event_types(h: &Webhook) -> Markup {
    html! {
        @if h.events.is_empty() || h.events.iter().any(|e| e == "*") {
            "all"
        } @else {
            @for (i, e) in h.events.iter().enumerate() {
                @if i > 0 { ", " }
                code { (e) }
            }
        }
    }
}

/// Its deliveries by state.
fn counts(h: &Webhook) -> Markup {
    html! {
        span class="counts" {
            span { (h.pending) " pending" } " · "
            span { (h.delivered) " delivered" } " · "
            span class=[(h.failed > 0).then_some("error")] { (h.failed) " failed" }
        }
    }
}

/// `POST /webhooks`: made, and its secret shown this once; or the page
/// again saying why not, the form as it was.
pub(crate) async fn create(
    State(web): State<Web>,
    signed: Signed,
    PageForm(fields): PageForm<Vec<(String, String)>>,
) -> PageResult {
    let f = CreateForm::from_fields(fields);
    signed.check_csrf(&f.csrf)?;
    match web.api.create_webhook(&signed.caller, f.request()).await {
        Ok(h) => {
            let body = created_page(&signed, &h);
            // Not cached anywhere: the page holds the secret.
            Ok(([(header::CACHE_CONTROL, "no-store")], body).into_response())
        }
        Err(e) => {
            let status = crate::view::refused_status(&e);
            render(&web, &signed, Some((&e.message, Some(&f))), status).await
        }
    }
}

/// The page that answers a create: the webhook, and its secret, once.
fn created_page(signed: &Signed, h: &Webhook) -> Markup {
    let body = html! {
        p class="crumbs" { a href="/webhooks" { "Webhooks" } " / " (h.id) }
        h1 { "New webhook" }
        section class="card" {
            p { "Events now go to " code { (h.url) } " (" (event_types(h)) ")." }
            @match &h.secret {
                Some(secret) => {
                    p role="status" class="notice" {
                        strong { "Its signing secret — copy it now: it is not shown again." }
                    }
                    label for="webhook-secret" { "Signing secret" }
                    input id="webhook-secret" type="text" readonly value=(secret) class="mono wide";
                    p class="muted" {
                        "Each delivery carries the headers " code { "webhook-id" } " (the event's id, "
                        "the same in every retry), " code { "webhook-timestamp" } " and "
                        code { "webhook-signature" } ": any Standard Webhooks library checks them "
                        "with this secret."
                    }
                }
                None => p class="error" role="alert" { "The service gave no secret for this webhook." },
            }
            p { a href={ "/webhooks/" (h.id) } { "Its deliveries" } " · " a href="/webhooks" { "Webhooks" } }
        }
    };
    page(
        "New webhook",
        Some(&signed.session),
        Section::Webhooks,
        body,
    )
}

/// `POST /webhooks/{id}/delete`: gone (its pending deliveries with it),
/// or the page saying why not.
pub(crate) async fn delete(
    State(web): State<Web>,
    signed: Signed,
    Path(id): Path<String>,
    PageForm(f): PageForm<CsrfOnly>,
) -> PageResult {
    signed.check_csrf(&f.csrf)?;
    match web.api.delete_webhook(&signed.caller, &id).await {
        Ok(_) => Ok(Redirect::to("/webhooks").into_response()),
        Err(e) => {
            let status = crate::view::refused_status(&e);
            render(&web, &signed, Some((&e.message, None)), status).await
        }
    }
}

#[derive(Deserialize, Default)]
pub(crate) struct DeliveriesQuery {
    /// Older than this delivery.
    #[serde(default)]
    older_than: Option<String>,
}

/// `/webhooks/{id}`: the webhook and its last deliveries.
pub(crate) async fn show(
    State(web): State<Web>,
    signed: Signed,
    Path(id): Path<String>,
    Query(q): Query<DeliveriesQuery>,
) -> PageResult {
    render_one(&web, &signed, &id, q.older_than, None, StatusCode::OK).await
}

async fn render_one(
    web: &Web,
    signed: &Signed,
    id: &str,
    older_than: Option<String>,
    error: Option<&str>,
    status: StatusCode,
) -> PageResult {
    let c = &signed.caller;
    let h = web.api.get_webhook(c, id).await?;
    let older_than = older_than.filter(|o| !o.is_empty());
    let paged = older_than.is_some();
    let deliveries = web
        .api
        .list_deliveries(
            c,
            id,
            ListDeliveries {
                limit: Some(DELIVERIES),
                starting_after: older_than,
            },
        )
        .await?;
    let csrf = signed.csrf();
    let body = html! {
        p class="crumbs" { a href="/webhooks" { "Webhooks" } " / " (h.id) }
        h1 { code { (h.url) } }
        @if let Some(e) = error {
            p class="error" role="alert" { (e) }
        }
        dl class="facts" {
            dt { "Id" } dd { code { (h.id) } }
            @if let Some(d) = &h.description { dt { "Description" } dd { (d) } }
            dt { "Events" } dd { (event_types(&h)) }
            dt { "Deliveries" } dd { (counts(&h)) }
            dt { "Created" } dd { (ago(&h.created_at)) }
        }
        div class="actions" {
            form class="inline" method="post" action={ "/webhooks/" (h.id) "/delete" } {
                input type="hidden" name="csrf" value=(csrf);
                button type="submit" class="danger" aria-label={ "Delete " (h.url) } { "Delete" }
            }
        }
        section id="deliveries" aria-labelledby="deliveries-h" {
            h2 id="deliveries-h" {
                @if paged { "Older deliveries" } @else { "Last deliveries" }
            }
            @if deliveries.data.is_empty() {
                p class="muted" { "No deliveries yet: one is made for each event it gets." }
            }
            @for d in &deliveries.data {
                (delivery(&h, d, csrf))
            }
            nav class="pager" aria-label="Pages of deliveries" {
                @if paged { a href={ "/webhooks/" (h.id) } { "Last deliveries" } }
                @if deliveries.has_more {
                    @if let Some(next) = &deliveries.next_cursor {
                        a href={ "/webhooks/" (h.id) "?older_than=" (crate::view::url_encode(next)) } { "Older deliveries" }
                    }
                }
            }
        }
    };
    let page = page(&h.url, Some(&signed.session), Section::Webhooks, body);
    Ok((status, page).into_response())
}

/// One delivery: its event, state, every attempt, and Redeliver.
fn delivery(h: &Webhook, d: &WebhookDelivery, csrf: &str) -> Markup {
    html! {
        article class="card delivery" id={ "delivery-" (d.id) } aria-labelledby={ "delivery-h-" (d.id) } {
            h3 id={ "delivery-h-" (d.id) } {
                code { (d.event_type) } " "
                span class={ "badge " (d.status) } { (d.status) }
            }
            p class="small" {
                "Event " code { (d.id) } " of "
                a href={ "/sandboxes/" (d.sandbox_id) } { (d.sandbox_id) } ", " (ago(&d.created_at))
                @if let Some(at) = &d.delivered_at { "; delivered " (ago(at)) }
                @if d.status == "pending" {
                    @if let Some(next) = &d.next_attempt_at { "; next try " (countdown(next)) }
                }
            }
            @if d.attempts.is_empty() {
                p class="muted small" { "Not tried yet." }
            } @else {
                ol class="attempts" {
                    @for a in &d.attempts {
                        li {
                            (ago(&a.at)) ": "
                            @match (a.status_code, &a.error) {
                                (Some(code), None) => span class="ok" { "HTTP " (code) },
                                (Some(code), Some(e)) => span class="error" { "HTTP " (code) " — " (e) },
                                (None, Some(e)) => span class="error" { (e) },
                                (None, None) => span class="muted" { "no answer" },
                            }
                            span class="muted" { " (" (a.duration_ms) " ms)" }
                        }
                    }
                }
            }
            form class="inline" method="post"
                action={ "/webhooks/" (h.id) "/deliveries/" (d.id) "/redeliver" } {
                input type="hidden" name="csrf" value=(csrf);
                button type="submit" class="small" aria-label={ "Redeliver " (d.id) } { "Redeliver" }
            }
        }
    }
}

/// `POST /webhooks/{id}/deliveries/{delivery}/redeliver`: sent again now,
/// then the webhook's page with the new attempt; or that page saying why
/// not.
pub(crate) async fn redeliver(
    State(web): State<Web>,
    signed: Signed,
    Path((id, delivery)): Path<(String, String)>,
    PageForm(f): PageForm<CsrfOnly>,
) -> PageResult {
    signed.check_csrf(&f.csrf)?;
    match web.api.redeliver(&signed.caller, &id, &delivery).await {
        Ok(_) => Ok(Redirect::to(&format!("/webhooks/{id}#delivery-{delivery}")).into_response()),
        Err(e) => {
            let status = crate::view::refused_status(&e);
            render_one(&web, &signed, &id, None, Some(&e.message), status).await
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn ticked_types_are_the_ones_asked_for_and_none_means_all() {
        let f = CreateForm::from_fields(fields(&[
            ("csrf", "t"),
            ("url", " https://example.com/h "),
            ("description", "  "),
            ("all", "on"),
            ("events", "sandbox.created"),
            ("events", "sandbox.failed"),
            ("events", "sandbox.created"),
        ]));
        assert_eq!(f.csrf, "t");
        let req = f.request();
        assert_eq!(req.url, "https://example.com/h");
        assert_eq!(req.events, ["sandbox.created", "sandbox.failed"]);
        assert_eq!(req.description, None);
        let f = CreateForm::from_fields(fields(&[
            ("url", "https://example.com/h"),
            ("all", "on"),
            ("description", "ci"),
        ]));
        assert!(f.request().events.is_empty(), "all");
        assert_eq!(f.request().description.as_deref(), Some("ci"));
    }

    #[test]
    fn the_form_comes_back_as_it_was_sent() {
        let sent = CreateForm::from_fields(fields(&[
            ("url", "http://127.0.0.1:9/hook"),
            ("description", "mine"),
            ("events", "sandbox.paused"),
        ]));
        let html = create_form("t", Some(&sent)).into_string();
        assert!(html.contains("value=\"http://127.0.0.1:9/hook\""), "{html}");
        assert!(html.contains("value=\"mine\""), "{html}");
        assert!(html.contains("value=\"sandbox.paused\" checked"), "{html}");
        assert!(
            !html.contains("value=\"sandbox.resumed\" checked"),
            "{html}"
        );
        assert!(
            !html.contains("id=\"events-all\" name=\"all\" type=\"checkbox\" value=\"on\" checked"),
            "{html}"
        );
        // A fresh form: all events.
        let html = create_form("t", None).into_string();
        assert!(html.contains("value=\"on\" checked"), "{html}");
        assert_eq!(html.matches(" checked").count(), 1, "{html}");
    }
}
