//! Signing in and out, and who a request is.
//!
//! A sign-in checks the API key through the service (as REST does) and
//! starts a session in the store; the browser gets only the session's
//! random token, in a cookie that scripts cannot read (`HttpOnly`), that
//! other sites' forms do not send (`SameSite=Lax`), and that travels only
//! over TLS when the server speaks it (`Secure`). Each session has a CSRF
//! token that every form carries and every `POST` must match; a `POST`
//! whose `Origin` is another site's is refused before that. Signing out
//! deletes the session, so the cookie opens nothing even if it was copied.

use crate::view;
use crate::view::PageForm;
use crate::Web;
use axum::extract::{FromRequestParts, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use sandpit_core::Caller;
use sandpit_store::WebSession;
use serde::Deserialize;

/// The session cookie's name.
pub(crate) const COOKIE: &str = "sandpit_session";

/// A signed-in request: its session, and the account as the API's caller.
pub(crate) struct Signed {
    pub session: WebSession,
    pub caller: Caller,
}

impl Signed {
    /// Refuses a form whose CSRF token is not the session's.
    pub fn check_csrf(&self, token: &str) -> Result<(), view::Failure> {
        if sandpit_host::ids::constant_time_eq(token.as_bytes(), self.session.csrf.as_bytes()) {
            Ok(())
        } else {
            Err(view::Failure::new(
                StatusCode::FORBIDDEN,
                "This form is stale or did not come from this dashboard: reload the page and try again.",
            ))
        }
    }

    pub fn csrf(&self) -> &str {
        &self.session.csrf
    }
}

/// The session token the request's cookie carries.
pub(crate) fn token_of(headers: &HeaderMap) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|c| c.trim().split_once('='))
        .find(|(name, _)| *name == COOKIE)
        .map(|(_, value)| value.to_string())
}

/// A `POST` from a page of another site (its `Origin` is not this host).
/// Browsers send `Origin` with every cross-site `POST`; a request without
/// one (curl, an old browser's same-site form) is left to the CSRF token.
fn cross_site(parts: &Parts) -> bool {
    if parts.method != Method::POST {
        return false;
    }
    let Some(origin) = parts
        .headers
        .get(header::ORIGIN)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let host = parts
        .headers
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .or_else(|| parts.uri.authority().map(|a| a.as_str()));
    let origin_host = origin.split_once("://").map(|(_, h)| h);
    origin_host.is_none() || origin_host != host
}

impl FromRequestParts<Web> for Signed {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, web: &Web) -> Result<Self, Response> {
        if cross_site(parts) {
            return Err(view::Failure::new(
                StatusCode::FORBIDDEN,
                "This request came from another site's page and was refused.",
            )
            .into_response());
        }
        let session = match token_of(&parts.headers) {
            Some(token) => web.svc.store().web_session(&token).await.map_err(|e| {
                view::Failure::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!("The dashboard cannot read its sessions now ({e}); try again."),
                )
                .into_response()
            })?,
            None => None,
        };
        match session {
            Some(session) => Ok(Signed {
                caller: Caller::new(session.account_id.clone(), "dashboard"),
                session,
            }),
            // A page asked for without a session: the sign-in, which comes
            // back here after.
            None if parts.method == Method::GET => {
                let back = parts.uri.path_and_query().map_or("/", |p| p.as_str());
                Err(Redirect::to(&format!("/?next={}", view::url_encode(back))).into_response())
            }
            None => Err(view::Failure::new(
                StatusCode::UNAUTHORIZED,
                "You are signed out (the session ended): sign in again.",
            )
            .into_response()),
        }
    }
}

#[derive(Deserialize)]
pub(crate) struct SignIn {
    key: String,
    #[serde(default)]
    next: Option<String>,
}

/// Only a path of this site is a place to go back to after signing in.
pub(crate) fn safe_next(next: Option<&str>) -> &str {
    match next {
        Some(n) if n.starts_with('/') && !n.starts_with("//") && !n.contains('\\') => n,
        _ => "/sandboxes",
    }
}

/// A `POST` whose `Origin`, if it names one, is this host (see
/// [`cross_site`]); for the forms that come before a session.
pub(crate) fn same_origin(headers: &HeaderMap) -> bool {
    headers
        .get(header::ORIGIN)
        .and_then(|v| v.to_str().ok())
        .is_none_or(|o| {
            let host = headers.get(header::HOST).and_then(|v| v.to_str().ok());
            o.split_once("://").map(|(_, h)| h) == host
        })
}

/// The `Set-Cookie` value that hands the browser session `token`.
pub(crate) fn cookie(config: &crate::WebConfig, token: &str) -> String {
    format!(
        "{COOKIE}={token}; Path=/; HttpOnly; SameSite=Lax; Max-Age={}{}",
        config.session_ttl.whole_seconds(),
        if config.secure_cookies {
            "; Secure"
        } else {
            ""
        }
    )
}

pub(crate) async fn sign_in(
    State(web): State<Web>,
    headers: HeaderMap,
    PageForm(form): PageForm<SignIn>,
) -> Response {
    if !same_origin(&headers) {
        return view::Failure::new(
            StatusCode::FORBIDDEN,
            "This sign-in came from another site's page and was refused.",
        )
        .into_response();
    }
    let next = safe_next(form.next.as_deref()).to_string();
    let signup = web.config.signup.mode != crate::SignupMode::Off;
    let caller = match web.api.authenticate(form.key.trim()).await {
        Ok(c) => c,
        Err(e) => {
            let status =
                StatusCode::from_u16(e.kind.http_status()).unwrap_or(StatusCode::UNAUTHORIZED);
            let message = match e.kind {
                sandpit_core::ErrorType::Unauthorized => {
                    "That is not a valid API key (or it was revoked).".to_string()
                }
                _ => e.message,
            };
            return (
                status,
                view::sign_in_page(view::SignInNote::Error(&message), &next, signup),
            )
                .into_response();
        }
    };
    let ttl = web.config.session_ttl;
    match web
        .svc
        .store()
        .create_web_session(&caller.account_id, ttl)
        .await
    {
        Ok((token, _)) => (
            [(header::SET_COOKIE, cookie(&web.config, &token))],
            Redirect::to(&next),
        )
            .into_response(),
        Err(e) => view::Failure::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("Cannot start a session now ({e}); try again."),
        )
        .into_response(),
    }
}

#[derive(Deserialize)]
pub(crate) struct CsrfOnly {
    /// Absent: refused as a wrong token is (403), not as a malformed form.
    #[serde(default)]
    pub csrf: String,
}

pub(crate) async fn sign_out(
    State(web): State<Web>,
    signed: Signed,
    headers: HeaderMap,
    PageForm(form): PageForm<CsrfOnly>,
) -> Result<Response, view::Failure> {
    signed.check_csrf(&form.csrf)?;
    if let Some(token) = token_of(&headers) {
        let _ = web.svc.store().end_web_session(&token).await;
    }
    let gone = format!(
        "{COOKIE}=; Path=/; HttpOnly; SameSite=Lax; Max-Age=0{}",
        if web.config.secure_cookies {
            "; Secure"
        } else {
            ""
        }
    );
    Ok(([(header::SET_COOKIE, gone)], Redirect::to("/?signed_out=1")).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_this_sites_paths_are_gone_back_to() {
        assert_eq!(safe_next(Some("/sandboxes/sbx_1")), "/sandboxes/sbx_1");
        for bad in [
            "//evil.example/x",
            "https://evil.example",
            "/\\evil",
            "sandboxes",
        ] {
            assert_eq!(safe_next(Some(bad)), "/sandboxes", "{bad}");
        }
        assert_eq!(safe_next(None), "/sandboxes");
    }

    #[test]
    fn the_session_cookie_is_http_only_lax_and_secure_over_tls() {
        let mut config = crate::WebConfig::default();
        let plain = cookie(&config, "sps_x");
        assert_eq!(
            plain,
            "sandpit_session=sps_x; Path=/; HttpOnly; SameSite=Lax; Max-Age=43200"
        );
        config.secure_cookies = true;
        assert!(cookie(&config, "sps_x").ends_with("; Secure"));
    }

    #[test]
    fn the_cookie_is_found_among_others() {
        let mut h = HeaderMap::new();
        h.insert(
            header::COOKIE,
            "a=1; sandpit_session=sps_x; b=2".parse().unwrap(),
        );
        assert_eq!(token_of(&h).as_deref(), Some("sps_x"));
        assert!(sandpit_host::ids::constant_time_eq(b"abc", b"abc"));
        assert!(!sandpit_host::ids::constant_time_eq(b"abc", b"abd"));
        assert!(!sandpit_host::ids::constant_time_eq(b"abc", b"ab"));
    }
}
