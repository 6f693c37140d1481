//! The pages' frame and the small pieces every page uses: the layout with
//! its navigation, an error page (framed with the navigation of whoever
//! is signed in, by [`frame_failures`]), a form that fails as a page, and
//! how times, money and sizes read.

use crate::assets;
use crate::Web;
use axum::extract::{FromRequest, Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Form;
use maud::{html, Markup, DOCTYPE};
use sandpit_store::WebSession;
use time::OffsetDateTime;

/// What a page is part of, for the navigation's current item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Section {
    Sandboxes,
    Snapshots,
    Templates,
    Usage,
    Keys,
    Secrets,
    Volumes,
    Events,
    Webhooks,
    Accounts,
    None,
}

/// A whole page: `title`, the signed-in navigation (with the sign-out
/// form, which needs the session's CSRF token), then `body`.
pub(crate) fn page(
    title: &str,
    session: Option<&WebSession>,
    section: Section,
    body: Markup,
) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · Sandpit" }
                link rel="stylesheet" href=(assets::url("app.css"));
                script src=(assets::url("app.js")) defer {}
            }
            body {
                a class="skip" href="#main" { "Skip to content" }
                header class="top" {
                    a class="brand" href="/" { "Sandpit" }
                    @if let Some(s) = session {
                        nav aria-label="Main" {
                            ul {
                                (nav_item("/sandboxes", "Sandboxes", section == Section::Sandboxes))
                                (nav_item("/snapshots", "Snapshots", section == Section::Snapshots))
                                (nav_item("/templates", "Templates", section == Section::Templates))
                                (nav_item("/events", "Events", section == Section::Events))
                                (nav_item("/usage", "Usage", section == Section::Usage))
                                (nav_item("/keys", "API keys", section == Section::Keys))
                                (nav_item("/secrets", "Secrets", section == Section::Secrets))
                                (nav_item("/volumes", "Volumes", section == Section::Volumes))
                                (nav_item("/webhooks", "Webhooks", section == Section::Webhooks))
                                @if s.admin {
                                    (nav_item("/accounts", "Accounts", section == Section::Accounts))
                                }
                            }
                        }
                        form class="signout" method="post" action="/sign-out" {
                            input type="hidden" name="csrf" value=(s.csrf);
                            span class="who" { (s.account_name) }
                            button type="submit" { "Sign out" }
                        }
                    }
                }
                main id="main" { (body) }
            }
        }
    }
}

fn nav_item(href: &str, label: &str, current: bool) -> Markup {
    html! {
        li {
            @if current {
                a href=(href) aria-current="page" { (label) }
            } @else {
                a href=(href) { (label) }
            }
        }
    }
}

/// What the sign-in page says above its form: nothing, a notice (signed
/// out) or what went wrong last time.
pub(crate) enum SignInNote<'a> {
    None,
    Notice(&'a str),
    Error(&'a str),
}

/// The sign-in page.
pub(crate) fn sign_in_page(note: SignInNote<'_>, next: &str, signup: bool) -> Markup {
    page(
        "Sign in",
        None,
        Section::None,
        html! {
            section class="card narrow" {
                h1 { "Sign in" }
                p { "Paste an API key of your account. The first start of " code { "sandpit serve" }
                    " prints one; more are made under API keys, or by " code { "sandpit key create" } "." }
                @match note {
                    SignInNote::None => {}
                    SignInNote::Notice(n) => p class="notice" role="status" { (n) },
                    SignInNote::Error(e) => p class="error" role="alert" { (e) },
                }
                form method="post" action="/sign-in" {
                    input type="hidden" name="next" value=(next);
                    label for="key" { "API key" }
                    input id="key" name="key" type="password" autocomplete="off" required
                        placeholder="sp_..." spellcheck="false";
                    button type="submit" { "Sign in" }
                }
                @if signup {
                    p { "No account yet? " a href="/sign-up" { "Sign up" } }
                }
            }
        },
    )
}

/// A failure shown as a page with its status.
#[derive(Debug, Clone)]
pub(crate) struct Failure {
    status: StatusCode,
    message: String,
}

impl Failure {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Failure {
            status,
            message: message.into(),
        }
    }

    /// The page, with the navigation and "Sign out" of `session`'s
    /// account when there is one.
    fn page(&self, session: Option<&WebSession>) -> Response {
        let reason = self.status.canonical_reason().unwrap_or("Error");
        let body = page(
            reason,
            session,
            Section::None,
            html! {
                section class="card narrow" {
                    h1 { (reason) }
                    p class="error" role="alert" { (self.message) }
                    p { a href="javascript:history.back()" { "Back" } " · " a href="/sandboxes" { "Sandboxes" } }
                }
            },
        );
        (self.status, body).into_response()
    }
}

impl From<sandpit_core::CoreError> for Failure {
    fn from(e: sandpit_core::CoreError) -> Self {
        let status =
            StatusCode::from_u16(e.kind.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        Failure::new(status, e.message)
    }
}

impl From<sandpit_store::StoreError> for Failure {
    fn from(e: sandpit_store::StoreError) -> Self {
        Failure::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("The store failed: {e}"),
        )
    }
}

/// The page without navigation (a handler does not know who is signed in);
/// the failure rides along for [`frame_failures`] to frame it.
impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        let mut response = self.page(None);
        response.extensions_mut().insert(self);
        response
    }
}

/// Middleware: a failure page for a signed-in browser keeps the
/// navigation and "Sign out", so a 404 or a 409 is not a dead end. The
/// session is looked up only for a failure.
pub(crate) async fn frame_failures(
    State(web): State<Web>,
    request: Request,
    next: Next,
) -> Response {
    let token = crate::session::token_of(request.headers());
    let response = next.run(request).await;
    let (Some(failure), Some(token)) = (response.extensions().get::<Failure>(), token) else {
        return response;
    };
    match web.svc.store().web_session(&token).await {
        Ok(Some(session)) => failure.page(Some(&session)),
        _ => response,
    }
}

/// A posted form's fields, or the dashboard's 400 page saying what was
/// wrong with it (not axum's plain-text 422). Forms that carry a CSRF token
/// default it to empty, so a form without one is refused as a wrong token
/// is (403).
pub(crate) struct PageForm<T>(pub T);

impl<T, S> FromRequest<S> for PageForm<T>
where
    T: serde::de::DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = Failure;

    async fn from_request(request: Request, state: &S) -> Result<Self, Failure> {
        match Form::<T>::from_request(request, state).await {
            Ok(Form(fields)) => Ok(PageForm(fields)),
            Err(e) => Err(Failure::new(
                StatusCode::BAD_REQUEST,
                format!(
                    "This form could not be read ({}): reload the page and try again.",
                    e.body_text()
                ),
            )),
        }
    }
}

/// `s` for a URL's query or path segment.
/// The status a page shows a refused form with: the API's for `e`.
pub(crate) fn refused_status(e: &sandpit_core::CoreError) -> StatusCode {
    StatusCode::from_u16(e.kind.http_status()).unwrap_or(StatusCode::BAD_REQUEST)
}

pub(crate) fn url_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' | b'/' => {
                out.push(b as char)
            }
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

/// An RFC 3339 time as a `<time>` that says how long ago it was.
pub(crate) fn ago(rfc3339: &str) -> Markup {
    let text = OffsetDateTime::parse(rfc3339, &time::format_description::well_known::Rfc3339)
        .map(|t| {
            let secs = (OffsetDateTime::now_utc() - t).whole_seconds().max(0);
            format!("{} ago", span(secs))
        })
        .unwrap_or_else(|_| rfc3339.to_string());
    html! { time datetime=(rfc3339) title=(rfc3339) { (text) } }
}

/// A countdown to `rfc3339` that the page's script keeps live.
pub(crate) fn countdown(rfc3339: &str) -> Markup {
    let text = OffsetDateTime::parse(rfc3339, &time::format_description::well_known::Rfc3339)
        .map(|t| {
            let secs = (t - OffsetDateTime::now_utc()).whole_seconds();
            if secs <= 0 {
                "now".to_string()
            } else {
                format!("in {}", span(secs))
            }
        })
        .unwrap_or_else(|_| rfc3339.to_string());
    html! { time class="countdown" datetime=(rfc3339) title=(rfc3339) { (text) } }
}

/// A span of seconds as people say it: `45 s`, `12 min`, `3 h 5 min`, `2 d`.
pub(crate) fn span(secs: i64) -> String {
    match secs {
        s if s < 60 => format!("{s} s"),
        s if s < 3600 => format!("{} min {} s", s / 60, s % 60),
        s if s < 86_400 => format!("{} h {} min", s / 3600, (s % 3600) / 60),
        s => format!("{} d {} h", s / 86_400, (s % 86_400) / 3600),
    }
}

pub(crate) fn usd(amount: f64) -> String {
    if amount != 0.0 && amount.abs() < 0.01 {
        format!("${amount:.4}")
    } else {
        format!("${amount:.2}")
    }
}

pub(crate) fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

/// A small form that posts to `action` with the CSRF token: one button.
pub(crate) fn action_button(action: &str, csrf: &str, label: &str, class: &str) -> Markup {
    html! {
        form class="inline" method="post" action=(action) {
            input type="hidden" name="csrf" value=(csrf);
            button type="submit" class=(class) { (label) }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn amounts_and_spans_read_as_people_say_them() {
        assert_eq!(span(45), "45 s");
        assert_eq!(span(3599), "59 min 59 s");
        assert_eq!(span(3600 * 3 + 300), "3 h 5 min");
        assert_eq!(usd(1.5), "$1.50");
        assert_eq!(usd(0.0025), "$0.0025");
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes(3 << 20), "3.0 MiB");
        assert_eq!(url_encode("/a b&c"), "/a%20b%26c");
    }
}
