//! The preview host parser (`sandpit_core::preview::parse_host`) on arbitrary
//! host names, domains and schemes.
//!
//! The `Host` header (or `:authority`) is the only input that picks which
//! sandbox a preview request reaches, and anyone can send any. The input is
//! text, `host`, `host\ndomain` or `host\ndomain\nscheme` (defaults: the
//! server's own `localhost:8080` and `http`).
//!
//! Checked, for any input: no panic; a preview names a port of 1 to 65535
//! and an id of 1 to 64 id characters (`a-z`, `0-9`, `_`), and the host,
//! lower-cased, starts with `{port}-{id}.`. For a well-formed domain (a DNS
//! name with an optional canonical port, what an operator configures) also:
//! a preview's host is the one canonical spelling `{port}-{id}.{domain}`
//! but for case, one trailing dot and the domain's port written or left out
//! where it is the scheme's default (so no other text reaches a sandbox), and
//! every URL `preview_url` writes, in any case and with a trailing dot, parses
//! back to its port and sandbox.

#![no_main]

use libfuzzer_sys::fuzz_target;
use sandpit_core::preview::{parse_host, preview_url, HostKind};

/// A domain as an operator writes one: `name[:port]`, the name of DNS
/// characters (one trailing dot allowed), the port canonical. Returns the
/// name without its dot and the port.
fn plain_domain(domain: &str) -> Option<(String, Option<u16>)> {
    let domain = domain.to_ascii_lowercase();
    let (name, port) = match domain.split_once(':') {
        Some((n, p)) => {
            let canonical = !p.is_empty()
                && !p.starts_with('0')
                && p.len() <= 5
                && p.bytes().all(|b| b.is_ascii_digit());
            (n, Some(canonical.then(|| p.parse::<u16>().ok()).flatten()?))
        }
        None => (domain.as_str(), None),
    };
    let name = name.strip_suffix('.').unwrap_or(name);
    let dns = |b: u8| b.is_ascii_alphanumeric() || b == b'-' || b == b'.';
    (!name.is_empty() && name.bytes().all(dns)).then(|| (name.to_string(), port))
}

fn id_ok(id: &str) -> bool {
    (1..=64).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let mut parts = text.splitn(3, '\n');
    let host = parts.next().unwrap_or("");
    let domain = parts.next().unwrap_or("localhost:8080");
    let scheme = parts.next().unwrap_or("http");

    let kind = parse_host(host, domain, scheme);
    let plain = plain_domain(domain);
    let default_port = if scheme.eq_ignore_ascii_case("https") {
        443
    } else {
        80
    };

    if let HostKind::Preview { port, sandbox_id } = &kind {
        assert!(*port >= 1);
        assert!(id_ok(sandbox_id), "{sandbox_id:?}");
        let h = host.to_ascii_lowercase();
        assert!(
            h.starts_with(&format!("{port}-{sandbox_id}.")),
            "{host:?} -> {kind:?}"
        );

        if let Some((dname, dport)) = &plain {
            let name = format!("{port}-{sandbox_id}.{dname}");
            let port_text = dport.unwrap_or(default_port).to_string();
            let mut spellings = vec![
                format!("{name}:{port_text}"),
                format!("{name}.:{port_text}"),
            ];
            if dport.is_none_or(|p| p == default_port) {
                spellings.push(name.clone());
                spellings.push(format!("{name}."));
            }
            assert!(
                spellings.contains(&h),
                "{host:?} reaches {kind:?} under {domain:?} but is none of {spellings:?}"
            );
        }
    }

    // Every URL handed out leads back. The id and port come from the input
    // (what a host with a preview would have named), so both vary.
    if plain.is_some() {
        let (port, id) = match &kind {
            HostKind::Preview { port, sandbox_id } => (*port, sandbox_id.clone()),
            _ => (
                data.iter()
                    .fold(0u16, |a, &b| a.wrapping_mul(31).wrapping_add(b.into()))
                    .max(1),
                host.bytes()
                    .filter(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'_')
                    .take(64)
                    .map(char::from)
                    .collect(),
            ),
        };
        if id_ok(&id) {
            let url = preview_url(scheme, domain, port, &id);
            let written = &url[scheme.len() + 3..];
            let want = HostKind::Preview {
                port,
                sandbox_id: id.clone(),
            };
            assert_eq!(parse_host(written, domain, scheme), want, "{url:?}");
            let upper = written.to_ascii_uppercase();
            assert_eq!(parse_host(&upper, domain, scheme), want, "{upper:?}");
            // A trailing dot on the name (before any port).
            let dotted = match written.rsplit_once(':') {
                Some((n, p)) if !n.ends_with('.') => format!("{n}.:{p}"),
                None if !written.ends_with('.') => format!("{written}."),
                _ => written.to_string(),
            };
            assert_eq!(parse_host(&dotted, domain, scheme), want, "{dotted:?}");
        }
    }
});
