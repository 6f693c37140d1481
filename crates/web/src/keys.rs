//! The account's API keys: listed by their visible prefix and last use,
//! made (the key shown once, with the MCP client configuration to paste,
//! as `sandpit serve` prints it at first start) and revoked.

use crate::session::{CsrfOnly, Signed};
use crate::view::PageForm;
use crate::view::{self, page, Failure, Section};
use crate::Web;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Redirect, Response};
use maud::html;
use sandpit_store::format_ts;

/// `/keys`.
pub(crate) async fn list(State(web): State<Web>, signed: Signed) -> Result<Response, Failure> {
    let keys = web
        .svc
        .store()
        .list_keys(Some(&signed.caller.account_id))
        .await?;
    let csrf = signed.csrf();
    let body = html! {
        h1 { "API keys" }
        p { "A key lets an agent or a program act as this account (REST, MCP). Keep it secret; revoke one that leaked." }
        form method="post" action="/keys" {
            input type="hidden" name="csrf" value=(csrf);
            button type="submit" { "Create a key" }
        }
        div class="scroll" { table {
            thead { tr { th scope="col" { "Key" } th scope="col" { "Created" } th scope="col" { "Last used" } th scope="col" { "Status" } th scope="col" { "" } } }
            tbody {
                @for k in &keys {
                    tr {
                        td { code { (k.prefix) "…" } }
                        td { (view::ago(&format_ts(k.created_at))) }
                        td { @match k.last_used_at { Some(t) => (view::ago(&format_ts(t))), None => span class="muted" { "never" } } }
                        td { @if k.revoked_at.is_some() { span class="badge failed" { "revoked" } } @else { span class="badge running" { "active" } } }
                        td {
                            @if k.revoked_at.is_none() {
                                form class="inline" method="post" action={ "/keys/" (k.id) "/revoke" } {
                                    input type="hidden" name="csrf" value=(csrf);
                                    button type="submit" class="danger" aria-label={ "Revoke " (k.prefix) } { "Revoke" }
                                }
                            }
                        }
                    }
                }
            }
        } }
    };
    Ok(page("API keys", Some(&signed.session), Section::Keys, body).into_response())
}

/// `POST /keys`: a new key, shown once on the page that answers.
pub(crate) async fn create(
    State(web): State<Web>,
    signed: Signed,
    PageForm(f): PageForm<CsrfOnly>,
) -> Result<Response, Failure> {
    signed.check_csrf(&f.csrf)?;
    let (key, _) = web
        .svc
        .store()
        .create_key(&signed.caller.account_id)
        .await?;
    let body = new_key_page(&web, &signed.session, &key, "New API key");
    // Not cached anywhere: the page holds the key.
    Ok(([(axum::http::header::CACHE_CONTROL, "no-store")], body).into_response())
}

/// The page that shows a new key, once, with the MCP client configuration
/// to paste (as `sandpit serve` prints it at first start).
pub(crate) fn new_key_page(
    web: &Web,
    session: &sandpit_store::WebSession,
    key: &str,
    title: &str,
) -> maud::Markup {
    let mcp = serde_json::json!({
        "mcpServers": {"sandbox": {
            "type": "http",
            "url": format!("{}/v1/mcp", web.config.public_url),
            "headers": {"Authorization": format!("Bearer {key}")}
        }}
    });
    let mcp = serde_json::to_string_pretty(&mcp).unwrap_or_default();
    let e2b_env = sandpit_core::e2b::environment(&web.config.public_url, key);
    let body = html! {
        h1 { (title) }
        section class="card" {
            p role="status" { "Your new API key — copy it now: it is shown only this once." }
            label for="new-key" { "API key" }
            input id="new-key" type="text" readonly value=(key) class="mono wide";
            h2 { "MCP client configuration" }
            p { "For Claude Code, Claude Desktop or any MCP client over Streamable HTTP:" }
            pre id="mcp-config" { (mcp) }
            h2 { "E2B SDKs" }
            p { "E2B's Python and JavaScript SDKs work unchanged with these three variables (the key's E2B spelling is the same key):" }
            pre id="e2b-env" { (e2b_env) }
            p { a href="/keys" { "API keys" } " · " a href="/sandboxes" { "Sandboxes" } }
        }
    };
    page(title, Some(session), Section::Keys, body)
}

/// `POST /keys/{id}/revoke`: only a key of this account.
pub(crate) async fn revoke(
    State(web): State<Web>,
    signed: Signed,
    Path(id): Path<String>,
    PageForm(f): PageForm<CsrfOnly>,
) -> Result<Response, Failure> {
    signed.check_csrf(&f.csrf)?;
    let store = web.svc.store();
    let mine = store
        .list_keys(Some(&signed.caller.account_id))
        .await?
        .into_iter()
        .any(|k| k.id == id);
    if !mine {
        return Err(Failure::new(
            StatusCode::NOT_FOUND,
            format!("No key {id} in this account."),
        ));
    }
    store.revoke_key(&id).await?;
    Ok(Redirect::to("/keys").into_response())
}
