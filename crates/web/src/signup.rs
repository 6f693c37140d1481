//! Sign-up, as the service offers it ("new accounts start with free credit
//! and no card"): off unless an operator turns it on, open to anyone or to
//! holders of an invitation code (`sandpit invite create`). A new account
//! gets the configured free credit, its first API key on the page that
//! answers (shown once, with the MCP configuration), and a session.
//!
//! Sign-ups are counted per client address ([`SignupConfig::per_address_per_hour`]),
//! in this process: past the limit the page says so, and when to try
//! again, with 429.

use crate::session;
use crate::view::PageForm;
use crate::view::{self, page, Failure, Section};
use crate::Web;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use maud::{html, Markup};
use serde::Deserialize;
use std::net::IpAddr;

/// Who may make an account from the dashboard.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SignupMode {
    /// Only operators make accounts (`sandpit account create`).
    #[default]
    Off,
    /// Anyone who reaches the dashboard.
    Open,
    /// Holders of an invitation code.
    Invite,
}

/// `[signup]` in the configuration.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SignupConfig {
    pub mode: SignupMode,
    /// Credit a new account starts with, in USD.
    pub free_credit_usd: f64,
    /// Sign-ups one client address may make in an hour.
    pub per_address_per_hour: u32,
}

impl Default for SignupConfig {
    fn default() -> Self {
        SignupConfig {
            mode: SignupMode::Off,
            free_credit_usd: 5.0,
            per_address_per_hour: 3,
        }
    }
}

/// The address a request came from (put there by the server's front).
#[derive(Debug, Clone, Copy)]
pub struct ClientAddr(pub IpAddr);

/// The hour the per-address limit counts sign-ups in.
const WINDOW: time::Duration = time::Duration::hours(1);

fn form(web: &Web, error: Option<&str>, name: &str) -> Markup {
    let invite = web.config.signup.mode == SignupMode::Invite;
    page(
        "Sign up",
        None,
        Section::None,
        html! {
            section class="card narrow" {
                h1 { "Sign up" }
                p { "A new account starts with " (view::usd(web.config.signup.free_credit_usd))
                    " of free credit, and no card." }
                @if let Some(e) = error { p class="error" role="alert" { (e) } }
                form method="post" action="/sign-up" {
                    label for="name" { "Account name" }
                    input id="name" name="name" type="text" required minlength="3" maxlength="40"
                        pattern="[a-z0-9][a-z0-9._-]{2,39}" value=(name) autocomplete="username"
                        aria-describedby="name-help";
                    p id="name-help" class="muted small" { "3 to 40 characters: lower-case letters, digits, dot, dash, underscore." }
                    @if invite {
                        label for="invite" { "Invitation code" }
                        input id="invite" name="invite" type="text" required spellcheck="false" placeholder="spi_...";
                    }
                    button type="submit" { "Create account" }
                }
                p { "Have a key? " a href="/" { "Sign in" } }
            }
        },
    )
}

fn closed() -> Failure {
    Failure::new(
        StatusCode::NOT_FOUND,
        "Sign-up is off on this server: ask its operator for an account.",
    )
}

/// `GET /sign-up`.
pub(crate) async fn page_get(State(web): State<Web>) -> Result<Response, Failure> {
    if web.config.signup.mode == SignupMode::Off {
        return Err(closed());
    }
    Ok(form(&web, None, "").into_response())
}

#[derive(Deserialize)]
pub(crate) struct SignUp {
    name: String,
    #[serde(default)]
    invite: Option<String>,
}

fn valid_name(name: &str) -> bool {
    let b = name.as_bytes();
    (3..=40).contains(&b.len())
        && b[0].is_ascii_lowercase() | b[0].is_ascii_digit()
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || b"._-".contains(c))
}

/// `POST /sign-up`.
pub(crate) async fn submit(
    State(web): State<Web>,
    addr: Option<Extension<ClientAddr>>,
    headers: axum::http::HeaderMap,
    PageForm(f): PageForm<SignUp>,
) -> Result<Response, Failure> {
    let cfg = &web.config.signup;
    if cfg.mode == SignupMode::Off {
        return Err(closed());
    }
    if !session::same_origin(&headers) {
        return Err(Failure::new(
            StatusCode::FORBIDDEN,
            "This sign-up came from another site's page and was refused.",
        ));
    }
    let name = f.name.trim().to_string();
    let again = |status: StatusCode, message: &str| {
        (status, form(&web, Some(message), &name)).into_response()
    };
    if !valid_name(&name) {
        return Ok(again(
            StatusCode::BAD_REQUEST,
            "An account name is 3 to 40 characters: lower-case letters, digits, dot, dash, underscore.",
        ));
    }
    let ip = addr.map_or(IpAddr::from([0, 0, 0, 0]), |Extension(ClientAddr(ip))| ip);
    // Counted in the store, so every replica behind a balancer counts the
    // same sign-ups.
    let admitted = web
        .svc
        .store()
        .admit_signup(
            &ip.to_string(),
            cfg.per_address_per_hour,
            WINDOW,
            time::OffsetDateTime::now_utc(),
        )
        .await?;
    if let Err(wait) = admitted {
        let wait = std::time::Duration::from_secs(wait.whole_seconds().max(0) as u64);
        let minutes = wait.as_secs().div_ceil(60).max(1);
        let message = format!(
            "Too many sign-ups from your address ({} an hour at most): try again in {minutes} min.",
            cfg.per_address_per_hour
        );
        let mut r = again(StatusCode::TOO_MANY_REQUESTS, &message);
        r.headers_mut()
            .insert(header::RETRY_AFTER, wait.as_secs().max(1).into());
        return Ok(r);
    }
    let store = web.svc.store();
    let invite = f.invite.as_deref().map(str::trim).unwrap_or("");
    if cfg.mode == SignupMode::Invite && !store.take_invite(invite).await? {
        return Ok(again(
            StatusCode::FORBIDDEN,
            "That invitation code is unknown, used up or expired.",
        ));
    }
    let account = match sandpit_core::admin::create_account(
        store,
        web.svc.config(),
        &name,
        cfg.free_credit_usd,
    )
    .await
    {
        Ok(a) => a,
        Err(e) => {
            if cfg.mode == SignupMode::Invite {
                let _ = store.return_invite(invite).await;
            }
            let message = if e.kind == sandpit_core::ErrorType::Conflict {
                format!("The name {name:?} is taken: choose another.")
            } else {
                e.message
            };
            return Ok(again(StatusCode::CONFLICT, &message));
        }
    };
    tracing::info!(account = %account.id, %ip, "signed up");
    let (key, _) = store.create_key(&account.id).await?;
    let (token, session) = store
        .create_web_session(&account.id, web.config.session_ttl)
        .await?;
    let body = crate::keys::new_key_page(&web, &session, &key, "Welcome to Sandpit");
    Ok((
        [
            (header::SET_COOKIE, session::cookie(&web.config, &token)),
            (header::CACHE_CONTROL, "no-store".to_string()),
        ],
        body,
    )
        .into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_plain() {
        for ok in ["ada", "team-7", "a.b_c"] {
            assert!(valid_name(ok), "{ok}");
        }
        for bad in ["ab", "Ada", "-ada", "a b", "ädа", &"a".repeat(41)] {
            assert!(!valid_name(bad), "{bad}");
        }
    }
}
