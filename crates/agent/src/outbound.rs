//! What commands need to reach the outside from behind an operator's
//! TLS-inspecting HTTP proxy: the proxy's CA certificates in the guest's trust
//! store, and the variables that point every tool at the proxy and at that
//! store.
//!
//! The certificates are appended to the system bundle that OpenSSL, curl,
//! git and apt read, after a marker line, so applying a configuration again
//! replaces what an earlier one appended instead of adding to it (no
//! `update-ca-certificates`: a shell script and an openssl process per
//! certificate cost seconds under emulation). The image's own Python, pip,
//! Node and curl read the system bundle already (measured: Debian builds
//! them so); the variables point at it what a user installs with a trust
//! store of its own: pip and requests in a virtualenv (their vendored
//! certifi), a Node from nodejs.org (its built-in roots, to which it adds
//! `NODE_EXTRA_CA_CERTS`), a static curl.
//!
//! The variables are kept here and added to every command's environment by
//! `exec`; a VM restored from a snapshot template has them (and the bundle)
//! from the template, which was made with the same settings.

use crate::sys;
use sandpit_protocol::{AgentError, ErrorKind, ProxyConfig};
use std::path::Path;
use std::sync::RwLock;

/// The system CA bundle of Debian's `ca-certificates`.
pub const CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";

/// Everything after this line in the bundle is the operator's.
const MARKER: &str = "# sandpit: the operator's extra CA certificates follow\n";

/// The variables that make tools with their own trust store use the bundle.
const CA_VARIABLES: &[&str] = &[
    "SSL_CERT_FILE",
    "REQUESTS_CA_BUNDLE",
    "PIP_CERT",
    "NODE_EXTRA_CA_CERTS",
    "CURL_CA_BUNDLE",
];

fn invalid(what: &str, value: &str) -> AgentError {
    AgentError::new(
        ErrorKind::InvalidRequest,
        format!("outbound: invalid {what} {value:?}"),
    )
}

/// A validated set of extra CAs and proxy, ready to apply.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Outbound {
    ca_certificates: Vec<String>,
    proxy_url: Option<String>,
    no_proxy: Vec<String>,
}

/// One PEM certificate: the BEGIN and END lines around base64 lines, nothing
/// else, so the bundle stays a PEM file whatever the host sends.
fn check_certificate(pem: &str) -> Result<(), AgentError> {
    let bad = || invalid("CA certificate", pem.get(..80).unwrap_or(pem));
    let body = pem
        .trim_end_matches('\n')
        .strip_prefix("-----BEGIN CERTIFICATE-----\n")
        .and_then(|b| b.strip_suffix("-----END CERTIFICATE-----"))
        .ok_or_else(bad)?;
    let base64 = |c: char| c.is_ascii_alphanumeric() || matches!(c, '+' | '/' | '=' | '\n');
    if body.is_empty() || !body.chars().all(base64) {
        return Err(bad());
    }
    Ok(())
}

/// Something that goes into an environment variable's value as it is: no
/// whitespace, control characters or (in a list) commas.
fn plain(s: &str, list_item: bool) -> bool {
    !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_graphic() && !(list_item && c == ','))
}

impl Outbound {
    pub fn new(
        ca_certificates: &[String],
        proxy: Option<&ProxyConfig>,
    ) -> Result<Self, AgentError> {
        for pem in ca_certificates {
            check_certificate(pem)?;
        }
        let (proxy_url, no_proxy) = match proxy {
            Some(p) => {
                if !p.url.starts_with("http://") || !plain(&p.url, false) {
                    return Err(invalid("proxy URL", &p.url));
                }
                if let Some(n) = p.no_proxy.iter().find(|n| !plain(n, true)) {
                    return Err(invalid("no_proxy entry", n));
                }
                (Some(p.url.clone()), p.no_proxy.clone())
            }
            None => (None, Vec::new()),
        };
        Ok(Outbound {
            ca_certificates: ca_certificates
                .iter()
                .map(|c| format!("{}\n", c.trim_end_matches('\n')))
                .collect(),
            proxy_url,
            no_proxy,
        })
    }

    /// The variables every command gets.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        let mut env = Vec::new();
        if !self.ca_certificates.is_empty() {
            env.extend(CA_VARIABLES.iter().map(|v| (*v, CA_BUNDLE.to_string())));
        }
        if let Some(url) = &self.proxy_url {
            for v in ["http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"] {
                env.push((v, url.clone()));
            }
            let no_proxy = self.no_proxy.join(",");
            env.push(("no_proxy", no_proxy.clone()));
            env.push(("NO_PROXY", no_proxy));
        }
        env
    }
}

/// `bundle` (the system bundle's text) with exactly `extra` after the marker;
/// `None` when that is what it already holds.
pub fn bundle_with(bundle: &str, extra: &[String]) -> Option<String> {
    let base = match bundle.find(MARKER) {
        Some(at) => &bundle[..at],
        None if extra.is_empty() => return None,
        None => bundle,
    };
    let mut out = base.to_string();
    if !extra.is_empty() {
        if !out.is_empty() && !out.ends_with('\n') {
            out.push('\n');
        }
        out.push_str(MARKER);
        for pem in extra {
            out.push_str(pem);
        }
    }
    (out != bundle).then_some(out)
}

/// The variables of the outbound settings in force, for every command.
static ENV: RwLock<Vec<(&'static str, String)>> = RwLock::new(Vec::new());

/// Run `f` with the variables every command gets from these settings.
pub fn with_env<R>(f: impl FnOnce(&[(&'static str, String)]) -> R) -> R {
    let env = ENV.read().unwrap_or_else(|e| e.into_inner());
    f(&env)
}

/// Apply validated settings: the bundle first, then the variables that point
/// at it.
pub fn apply(o: &Outbound) -> Result<(), AgentError> {
    let fail = |e: std::io::Error| AgentError::new(ErrorKind::Io, format!("{CA_BUNDLE}: {e}"));
    let path = Path::new(CA_BUNDLE);
    let bundle = match std::fs::read_to_string(path) {
        Ok(b) => b,
        // An image without ca-certificates: the operator's are the bundle.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(fail(e)),
    };
    if let Some(new) = bundle_with(&bundle, &o.ca_certificates) {
        sys::replace_file(path, new.as_bytes(), 0o644).map_err(fail)?;
    }
    *ENV.write().unwrap_or_else(|e| e.into_inner()) = o.env();
    if !o.ca_certificates.is_empty() || o.proxy_url.is_some() {
        crate::info!(
            "outbound: {} extra CA certificate(s), proxy {}",
            o.ca_certificates.len(),
            o.proxy_url.as_deref().unwrap_or("none")
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const PEM: &str =
        "-----BEGIN CERTIFICATE-----\nMIIBxTCCAWugAwIBAgIU\nAbC+/9==\n-----END CERTIFICATE-----\n";

    fn proxy() -> ProxyConfig {
        ProxyConfig {
            url: "http://10.1.2.3:3128".into(),
            address: "10.1.2.3".into(),
            port: 3128,
            no_proxy: vec!["localhost".into(), ".corp.example".into()],
        }
    }

    #[test]
    fn certificates_and_proxy_are_validated() {
        assert!(Outbound::new(&[PEM.into()], Some(&proxy())).is_ok());
        // Without the final newline too.
        assert!(Outbound::new(&[PEM.trim_end().into()], None).is_ok());
        for bad in [
            "",
            "-----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----\n",
            "-----BEGIN PRIVATE KEY-----\nMIIB\n-----END PRIVATE KEY-----\n",
            "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\nnot pem\n",
            "-----BEGIN CERTIFICATE-----\nMI IB\n-----END CERTIFICATE-----\n",
        ] {
            let e = Outbound::new(&[bad.into()], None).unwrap_err();
            assert_eq!(e.kind, ErrorKind::InvalidRequest, "{bad:?}");
        }
        for url in [
            "https://10.1.2.3:3128",
            "http://a b:1",
            "http://x:1\nexport A=b",
        ] {
            let p = ProxyConfig {
                url: url.into(),
                ..proxy()
            };
            assert!(Outbound::new(&[], Some(&p)).is_err(), "{url:?}");
        }
        for n in ["a,b", "", "a b"] {
            let p = ProxyConfig {
                no_proxy: vec![n.into()],
                ..proxy()
            };
            assert!(Outbound::new(&[], Some(&p)).is_err(), "{n:?}");
        }
    }

    #[test]
    fn every_command_gets_the_variables() {
        let env: std::collections::BTreeMap<_, _> = Outbound::new(&[PEM.into()], Some(&proxy()))
            .unwrap()
            .env()
            .into_iter()
            .collect();
        for v in CA_VARIABLES {
            assert_eq!(env[v], CA_BUNDLE);
        }
        for v in ["http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"] {
            assert_eq!(env[v], "http://10.1.2.3:3128");
        }
        assert_eq!(env["no_proxy"], "localhost,.corp.example");
        assert_eq!(env["NO_PROXY"], env["no_proxy"]);
        assert_eq!(env.len(), CA_VARIABLES.len() + 6);
        assert!(Outbound::new(&[], None).unwrap().env().is_empty());
        let ca_only = Outbound::new(&[PEM.into()], None).unwrap().env();
        assert_eq!(ca_only.len(), CA_VARIABLES.len());
    }

    #[test]
    fn the_bundle_gets_the_certificates_once() {
        let system = "-----BEGIN CERTIFICATE-----\nSYS\n-----END CERTIFICATE-----\n";
        let extra = vec![PEM.to_string(), PEM.replace("MIIB", "MIIC")];
        let once = bundle_with(system, &extra).unwrap();
        assert!(once.starts_with(system));
        assert!(once.ends_with(&extra[1]));
        assert_eq!(once.matches(MARKER).count(), 1);
        // Applying the same again changes nothing; other ones replace them.
        assert_eq!(bundle_with(&once, &extra), None);
        let other = bundle_with(&once, &extra[..1]).unwrap();
        assert_eq!(other, format!("{system}{MARKER}{PEM}"));
        // None: back to the system's own, and nothing to do on a clean one.
        assert_eq!(bundle_with(&other, &[]).as_deref(), Some(system));
        assert_eq!(bundle_with(system, &[]), None);
        // A bundle without a final newline still gets whole lines.
        let joined = bundle_with(system.trim_end(), &extra[..1]).unwrap();
        assert!(joined.contains(&format!("-----END CERTIFICATE-----\n{MARKER}")));
    }
}
