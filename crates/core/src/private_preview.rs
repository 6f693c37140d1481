//! Private preview URLs: a port served only to requests that carry the
//! sandbox's traffic token.
//!
//! A request is let through by one of three proofs, checked by the preview
//! proxy before a byte reaches the guest: the token itself in a header
//! (`x-sandpit-traffic-token`, or E2B's `e2b-traffic-access-token`); a
//! signed URL, `?sandpit_expires=UNIX&sandpit_signature=HEX`, an HMAC of
//! the sandbox, the port and the expiry under the token, good until the
//! expiry its owner chose; or the cookie a signed URL leaves for that
//! preview host, so that the page's own links and assets load too. The
//! proofs are taken off the request before it is passed on: the guest's
//! server sees its own URL and headers.
//!
//! The token is derived from the sandbox's own random secret (its access
//! token, stored with it), so nothing more is stored and a sandbox's token
//! proves nothing for another.

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

/// The header a client sends the traffic token in.
pub const TOKEN_HEADER: &str = "x-sandpit-traffic-token";
/// E2B's name for it (`Sandbox.traffic_access_token`).
pub const E2B_TOKEN_HEADER: &str = "e2b-traffic-access-token";
/// The cookie a signed URL leaves.
pub const COOKIE: &str = "sandpit_traffic";
const EXPIRES_PARAM: &str = "sandpit_expires";
const SIGNATURE_PARAM: &str = "sandpit_signature";

/// The longest a signed URL may be good for.
pub const MAX_SIGNED_SECONDS: u64 = 7 * 24 * 3600;
/// How long a signed URL made without saying is good for.
pub const DEFAULT_SIGNED_SECONDS: u64 = 3600;

/// Who may use a port's preview URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PreviewAccess {
    /// Anyone with the URL (the default).
    Public,
    /// Only a request with a proof of `token`; anything else gets
    /// `refusal` (401, or 403 for an E2B sandbox made private whole, as
    /// E2B answers).
    Private { token: String, refusal: u16 },
}

/// The traffic token of a sandbox whose access token is `access_token`.
pub fn traffic_token(access_token: &str) -> String {
    let digest = Sha256::digest(format!("sandpit traffic token\n{access_token}").as_bytes());
    format!("tt_{}", &hex::encode(digest)[..40])
}

fn signature(token: &str, sandbox_id: &str, port: u16, expires_unix: u64) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(token.as_bytes()).expect("any key length");
    mac.update(format!("{sandbox_id}\n{port}\n{expires_unix}").as_bytes());
    hex::encode(mac.finalize().into_bytes())
}

fn signature_matches(
    token: &str,
    sandbox_id: &str,
    port: u16,
    expires_unix: u64,
    sig: &str,
) -> bool {
    let Ok(given) = hex::decode(sig) else {
        return false;
    };
    let mut mac = Hmac::<Sha256>::new_from_slice(token.as_bytes()).expect("any key length");
    mac.update(format!("{sandbox_id}\n{port}\n{expires_unix}").as_bytes());
    mac.verify_slice(&given).is_ok()
}

/// `url` (a port's preview URL) signed until `expires_unix`.
pub fn signed_url(
    url: &str,
    token: &str,
    sandbox_id: &str,
    port: u16,
    expires_unix: u64,
) -> String {
    let sig = signature(token, sandbox_id, port, expires_unix);
    format!("{url}/?{EXPIRES_PARAM}={expires_unix}&{SIGNATURE_PARAM}={sig}")
}

/// What let a request through.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Grant {
    /// The token in a header.
    Token,
    /// The cookie of an earlier signed URL.
    Cookie,
    /// A signed URL good until `expires_unix`: the proxy leaves its cookie.
    Signed { expires_unix: u64, cookie: String },
}

/// A request to a private port, as far as its proofs go.
pub struct Proofs<'r> {
    /// The token headers' values.
    pub headers: Vec<&'r str>,
    /// The request's query string.
    pub query: Option<&'r str>,
    /// Its `Cookie` headers' values.
    pub cookies: Vec<&'r str>,
}

/// Does a request with `proofs` get to `port` of sandbox `sandbox_id`,
/// whose traffic token is `token`, at `now_unix`?
pub fn admit(
    token: &str,
    sandbox_id: &str,
    port: u16,
    proofs: &Proofs<'_>,
    now_unix: u64,
) -> Option<Grant> {
    let token_digest = Sha256::digest(token.as_bytes());
    if proofs
        .headers
        .iter()
        .any(|h| Sha256::digest(h.trim().as_bytes()) == token_digest)
    {
        return Some(Grant::Token);
    }
    let signed = |expires: &str, sig: &str| {
        let expires_unix: u64 = expires.parse().ok()?;
        (expires_unix > now_unix && signature_matches(token, sandbox_id, port, expires_unix, sig))
            .then_some(expires_unix)
    };
    if let Some(query) = proofs.query {
        let mut expires = None;
        let mut sig = None;
        for (k, v) in form_urlencoded::parse(query.as_bytes()) {
            match k.as_ref() {
                EXPIRES_PARAM => expires = Some(v.into_owned()),
                SIGNATURE_PARAM => sig = Some(v.into_owned()),
                _ => {}
            }
        }
        if let (Some(e), Some(s)) = (expires, sig) {
            if let Some(expires_unix) = signed(&e, &s) {
                return Some(Grant::Signed {
                    expires_unix,
                    cookie: format!("{expires_unix}.{s}"),
                });
            }
        }
    }
    let from_cookie = proofs
        .cookies
        .iter()
        .flat_map(|c| c.split(';'))
        .filter_map(|c| c.trim().split_once('='))
        .filter(|(name, _)| *name == COOKIE)
        .any(|(_, value)| {
            value
                .split_once('.')
                .and_then(|(e, s)| signed(e, s))
                .is_some()
        });
    from_cookie.then_some(Grant::Cookie)
}

/// `query` without the signed URL's parameters (`None`: nothing left).
pub fn strip_query(query: &str) -> Option<String> {
    let kept: Vec<&str> = query
        .split('&')
        .filter(|pair| {
            let name = pair.split('=').next().unwrap_or_default();
            name != EXPIRES_PARAM && name != SIGNATURE_PARAM
        })
        .collect();
    (!kept.is_empty() && kept.iter().any(|p| !p.is_empty())).then(|| kept.join("&"))
}

/// A `Cookie` header's value without the traffic cookie (`None`: nothing left).
pub fn strip_cookie(value: &str) -> Option<String> {
    let kept: Vec<&str> = value
        .split(';')
        .map(str::trim)
        .filter(|c| !c.is_empty() && c.split('=').next() != Some(COOKIE))
        .collect();
    (!kept.is_empty()).then(|| kept.join("; "))
}

/// The `Set-Cookie` value that keeps a signed URL's grant for the pages it
/// leads to (on that preview host only, until the URL's expiry).
pub fn set_cookie(cookie: &str, expires_unix: u64, now_unix: u64, secure: bool) -> String {
    let max_age = expires_unix.saturating_sub(now_unix);
    let secure = if secure { "; Secure" } else { "" };
    format!("{COOKIE}={cookie}; Max-Age={max_age}; Path=/; HttpOnly; SameSite=Lax{secure}")
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "sbx_a";
    fn proofs<'r>(headers: &[&'r str], query: Option<&'r str>, cookies: &[&'r str]) -> Proofs<'r> {
        Proofs {
            headers: headers.to_vec(),
            query,
            cookies: cookies.to_vec(),
        }
    }

    #[test]
    fn a_token_is_the_sandboxs_own() {
        let t = traffic_token("secret-a");
        assert!(t.starts_with("tt_") && t.len() == 43, "{t}");
        assert_eq!(t, traffic_token("secret-a"));
        assert_ne!(t, traffic_token("secret-b"));
        let other = traffic_token("secret-b");
        assert_eq!(
            admit(&t, ID, 80, &proofs(&[&t], None, &[]), 0),
            Some(Grant::Token)
        );
        assert_eq!(admit(&t, ID, 80, &proofs(&[&other], None, &[]), 0), None);
        assert_eq!(admit(&t, ID, 80, &proofs(&[], None, &[]), 0), None);
    }

    #[test]
    fn a_signed_url_holds_for_its_port_until_its_expiry_and_leaves_a_cookie() {
        let t = traffic_token("secret-a");
        let url = signed_url("http://80-sbx_a.localhost", &t, ID, 80, 1000);
        let query = url.split_once('?').unwrap().1;
        let Some(Grant::Signed {
            expires_unix,
            cookie,
        }) = admit(&t, ID, 80, &proofs(&[], Some(query), &[]), 999)
        else {
            panic!("{url} refused");
        };
        assert_eq!(expires_unix, 1000);
        assert_eq!(
            admit(&t, ID, 80, &proofs(&[], Some(query), &[]), 1000),
            None,
            "expired"
        );
        assert_eq!(
            admit(&t, ID, 81, &proofs(&[], Some(query), &[]), 999),
            None,
            "another port"
        );
        assert_eq!(
            admit(&t, "sbx_b", 80, &proofs(&[], Some(query), &[]), 999),
            None
        );
        let other = traffic_token("secret-b");
        assert_eq!(
            admit(&other, ID, 80, &proofs(&[], Some(query), &[]), 999),
            None
        );
        let tampered = query.replace("expires=1000", "expires=2000");
        assert_eq!(
            admit(&t, ID, 80, &proofs(&[], Some(&tampered), &[]), 999),
            None
        );
        let jar = format!("theme=dark; {COOKIE}={cookie}");
        assert_eq!(
            admit(&t, ID, 80, &proofs(&[], None, &[&jar]), 999),
            Some(Grant::Cookie)
        );
        assert_eq!(admit(&t, ID, 80, &proofs(&[], None, &[&jar]), 1001), None);
        assert_eq!(
            set_cookie(&cookie, 1000, 400, true),
            format!("{COOKIE}={cookie}; Max-Age=600; Path=/; HttpOnly; SameSite=Lax; Secure")
        );
    }

    #[test]
    fn the_proofs_are_taken_off_what_the_guest_sees() {
        assert_eq!(strip_query("sandpit_expires=1&sandpit_signature=ab"), None);
        assert_eq!(
            strip_query("a=1&sandpit_expires=1&b=2&sandpit_signature=ab").as_deref(),
            Some("a=1&b=2")
        );
        assert_eq!(strip_cookie(&format!("{COOKIE}=1.ab")), None);
        assert_eq!(
            strip_cookie(&format!("a=1; {COOKIE}=1.ab; b=2")).as_deref(),
            Some("a=1; b=2")
        );
    }
}
