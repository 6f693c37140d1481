//! What a sandbox's lists say of one connection the host looked at: its
//! address (the one the guest dialled) and the host it named (see
//! [`super::peek`]). Allowed entries come first, as E2B defines them: an
//! address in an allowed prefix, or a name an allowed rule matches, is let
//! through whatever the deny list says; then a denied name or prefix
//! refuses it; anything else goes through. The operator's deny list and
//! the host's own addresses are not here: the host's guard refuses those
//! before any of this (an allow never opens them), and the proxy checks
//! the addresses it connects to against them ([`Prefixes`]).
//!
//! A connection let through for its name goes to that name's addresses as
//! the host resolves them, not to the address the guest dialled: the name
//! is the guest's word, and a guest that named an allowed host while
//! dialling another would otherwise reach the other. A denied name is the
//! weaker rule: it stops a client that names the host; one that dials the
//! host's address under another name is stopped only by address entries.

use super::names::NameRule;
use super::peek::Peeked;
use std::net::Ipv4Addr;

/// An IPv4 prefix of a list.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Prefix {
    network: u32,
    mask: u32,
    text: String,
}

impl Prefix {
    fn parse(entry: &str) -> Option<Prefix> {
        let (address, bits) = match entry.split_once('/') {
            Some((a, b)) => (a, b.parse::<u32>().ok().filter(|b| *b <= 32)?),
            None => (entry, 32),
        };
        let address: Ipv4Addr = address.parse().ok()?;
        let mask = u32::MAX.checked_shl(32 - bits).unwrap_or(0);
        Some(Prefix {
            network: u32::from(address) & mask,
            mask,
            text: entry.to_string(),
        })
    }

    fn contains(&self, a: Ipv4Addr) -> bool {
        u32::from(a) & self.mask == self.network
    }
}

/// A sandbox's lists, entries sorted into prefixes and names.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Rules {
    allow_prefixes: Vec<Prefix>,
    allow_names: Vec<NameRule>,
    deny_prefixes: Vec<Prefix>,
    deny_names: Vec<NameRule>,
}

/// What becomes of a connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Connected to the address the guest dialled.
    Allow,
    /// Allowed for the name it carries: connected to that name's addresses.
    AllowName(String),
    /// Refused at once (a reset), for this entry of the deny list.
    Refuse { rule: String },
}

impl Rules {
    /// `allow` and `deny` (each entry an IPv4 address or prefix, or a host
    /// name rule), or why an entry is neither.
    pub fn new(allow: &[String], deny: &[String]) -> Result<Rules, String> {
        let mut rules = Rules::default();
        for (entries, prefixes, names) in [
            (allow, &mut rules.allow_prefixes, &mut rules.allow_names),
            (deny, &mut rules.deny_prefixes, &mut rules.deny_names),
        ] {
            for entry in entries {
                let entry = entry.trim();
                match Prefix::parse(entry) {
                    Some(p) => prefixes.push(p),
                    None if looks_like_an_address(entry) => {
                        return Err(format!("{entry:?} is not an IPv4 address or prefix"))
                    }
                    None => names.push(NameRule::parse(entry)?),
                }
            }
        }
        Ok(rules)
    }

    /// Whether any entry names a host (then the host must look at
    /// connections, not only at addresses).
    pub fn has_names(&self) -> bool {
        !self.allow_names.is_empty() || !self.deny_names.is_empty()
    }

    /// The fate of a connection to `to` that `peeked` says is for a host.
    pub fn decide(&self, to: Ipv4Addr, peeked: &Peeked) -> Decision {
        let named = peeked.name();
        if self.allow_prefixes.iter().any(|p| p.contains(to)) {
            return Decision::Allow;
        }
        if let Some(name) = named {
            if self.allow_names.iter().any(|r| r.matches(name)) {
                return Decision::AllowName(name.to_ascii_lowercase());
            }
            if let Some(r) = self.deny_names.iter().find(|r| r.matches(name)) {
                return Decision::Refuse {
                    rule: r.to_string(),
                };
            }
        }
        match self.deny_prefixes.iter().find(|p| p.contains(to)) {
            Some(p) => Decision::Refuse {
                rule: p.text.clone(),
            },
            None => Decision::Allow,
        }
    }
}

impl Rules {
    /// The rule that refuses every connection under `name`, whatever the
    /// name's addresses (a lookup of it is answered "no such name"): a
    /// denied name, or a deny of everything, when neither an allowed name
    /// nor an allowed prefix could let it through.
    pub fn refuses_name(&self, name: &str) -> Option<String> {
        if self.allow_names.iter().any(|r| r.matches(name)) || !self.allow_prefixes.is_empty() {
            return None;
        }
        if let Some(r) = self.deny_names.iter().find(|r| r.matches(name)) {
            return Some(r.to_string());
        }
        self.deny_prefixes
            .iter()
            .find(|p| p.mask == 0)
            .map(|p| p.text.clone())
    }

    /// The rule that refuses a connection to `address` under `name` (an
    /// address a lookup of `name` found is left out of its answer).
    pub fn refuses_address(&self, name: &str, address: Ipv4Addr) -> Option<String> {
        let named = Peeked::Tls {
            server_name: Some(name.to_string()),
        };
        match self.decide(address, &named) {
            Decision::Refuse { rule } => Some(rule),
            Decision::Allow | Decision::AllowName(_) => None,
        }
    }
}

/// A list of prefixes an address is checked against (the operator's deny
/// list, for the addresses the proxy connects to).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Prefixes(Vec<Prefix>);

impl Prefixes {
    /// The IPv4 entries of `entries` (others, IPv6 ones included, are left
    /// out: the proxy connects over IPv4 only).
    pub fn new(entries: &[String]) -> Prefixes {
        Prefixes(
            entries
                .iter()
                .filter_map(|e| Prefix::parse(e.trim()))
                .collect(),
        )
    }

    /// Whether `a` is in one of them.
    pub fn contains(&self, a: Ipv4Addr) -> bool {
        self.0.iter().any(|p| p.contains(a))
    }
}

/// Digits, dots, a slash: meant as an address, not a name.
pub(crate) fn looks_like_an_address(entry: &str) -> bool {
    entry.contains('/') || entry.bytes().all(|b| b.is_ascii_digit() || b == b'.')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(allow: &[&str], deny: &[&str]) -> Rules {
        let v = |l: &[&str]| l.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        Rules::new(&v(allow), &v(deny)).unwrap()
    }
    fn tls(name: &str) -> Peeked {
        Peeked::Tls {
            server_name: Some(name.into()),
        }
    }
    const WEB: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 7);

    #[test]
    fn an_allowed_name_passes_a_deny_of_everything_and_nothing_else_does() {
        let r = rules(&["*.example.com", "pypi.org"], &["0.0.0.0/0"]);
        assert!(r.has_names());
        assert_eq!(
            r.decide(WEB, &tls("api.example.com")),
            Decision::AllowName("api.example.com".into())
        );
        let http = Peeked::Http {
            host: Some("PyPI.org".into()),
        };
        assert_eq!(r.decide(WEB, &http), Decision::AllowName("pypi.org".into()));
        let refused = Decision::Refuse {
            rule: "0.0.0.0/0".into(),
        };
        assert_eq!(r.decide(WEB, &tls("evil.test")), refused);
        // A name that says nothing, or an address given directly.
        assert_eq!(r.decide(WEB, &Peeked::Unnamed), refused);
        assert_eq!(r.decide(WEB, &Peeked::Tls { server_name: None }), refused);
    }

    #[test]
    fn an_allowed_prefix_needs_no_name_and_a_denied_name_is_refused_by_its_rule() {
        let r = rules(&["198.51.100.0/24"], &["*.tracker.test", "10.0.0.0/8"]);
        assert_eq!(r.decide(WEB, &Peeked::Unnamed), Decision::Allow);
        assert_eq!(
            r.decide(WEB, &tls("a.tracker.test")),
            Decision::Allow,
            "allow first"
        );
        let other = Ipv4Addr::new(203, 0, 113, 9);
        assert_eq!(
            r.decide(other, &tls("a.tracker.test")),
            Decision::Refuse {
                rule: "*.tracker.test".into()
            }
        );
        assert_eq!(r.decide(other, &tls("fine.test")), Decision::Allow);
        assert_eq!(
            r.decide(Ipv4Addr::new(10, 1, 2, 3), &tls("fine.test")),
            Decision::Refuse {
                rule: "10.0.0.0/8".into()
            }
        );
    }

    #[test]
    fn entries_are_prefixes_or_names_and_nothing_in_between() {
        let v = |l: &[&str]| l.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert!(!rules(&["1.2.3.4"], &["0.0.0.0/0"]).has_names());
        let never = Prefixes::new(&v(&["10.0.0.0/8", "169.254.169.254", "fd00::/8"]));
        assert!(never.contains(Ipv4Addr::new(10, 9, 8, 7)));
        assert!(never.contains(Ipv4Addr::new(169, 254, 169, 254)));
        assert!(!never.contains(WEB));
        for bad in ["1.2.3.4/33", "1.2.3", "300.1.1.1", "exa mple.com"] {
            assert!(Rules::new(&v(&[bad]), &[]).is_err(), "{bad}");
        }
    }
}
