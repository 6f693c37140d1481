//! Name rules: `example.com` (that name) and `*.example.com` (any name
//! below it, not the name itself), compared as DNS compares names: ASCII
//! case folded, a trailing dot ignored. A name outside ASCII is refused
//! with its punycode form to use instead of being guessed at.

/// One name rule of an egress list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NameRule {
    /// The name (for a wildcard, the part after `*.`), lower case, no
    /// trailing dot.
    name: String,
    wildcard: bool,
}

/// The longest name DNS carries.
const MAX_NAME: usize = 253;

impl NameRule {
    /// `rule` as a name rule, or why it is not one.
    pub fn parse(rule: &str) -> Result<NameRule, String> {
        let trimmed = rule.trim();
        let (wildcard, rest) = match trimmed.strip_prefix("*.") {
            Some(rest) => (true, rest),
            None => (false, trimmed),
        };
        let name = normalise(rest).map_err(|why| format!("{rule:?} is not a host name: {why}"))?;
        if wildcard && !name.contains('.') {
            return Err(format!(
                "{rule:?} would match every name under a top-level domain"
            ));
        }
        Ok(NameRule { name, wildcard })
    }

    /// Whether `host` (as a client named it) is what this rule names.
    pub fn matches(&self, host: &str) -> bool {
        let Ok(host) = normalise(host) else {
            return false;
        };
        match self.wildcard {
            false => host == self.name,
            true => host
                .strip_suffix(&self.name)
                .is_some_and(|head| head.len() > 1 && head.ends_with('.')),
        }
    }
}

impl std::fmt::Display for NameRule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.wildcard {
            f.write_str("*.")?;
        }
        f.write_str(&self.name)
    }
}

/// `name` lower-cased without its trailing dot, if it is a host name
/// (labels of letters, digits and inner hyphens, 1 to 63 long, 253 in all;
/// not an IP address).
fn normalise(name: &str) -> Result<String, String> {
    let name = name.strip_suffix('.').unwrap_or(name);
    if name.is_empty() {
        return Err("it is empty".into());
    }
    if !name.is_ascii() {
        return Err("it is not ASCII: write its punycode form (xn--…)".into());
    }
    if name.len() > MAX_NAME {
        return Err(format!("it is longer than {MAX_NAME} characters"));
    }
    if name.parse::<std::net::IpAddr>().is_ok() {
        return Err("it is an address".into());
    }
    let name = name.to_ascii_lowercase();
    for label in name.split('.') {
        let fine = (1..=63).contains(&label.len())
            && label
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-')
            && !label.starts_with('-')
            && !label.ends_with('-');
        if !fine {
            return Err(format!("its label {label:?} is not one DNS allows"));
        }
    }
    if name
        .rsplit('.')
        .next()
        .is_some_and(|tld| tld.bytes().all(|b| b.is_ascii_digit()))
    {
        return Err("its last label is all digits".into());
    }
    Ok(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_matches_itself_whatever_its_case_and_trailing_dot() {
        let r = NameRule::parse("API.Example.com.").unwrap();
        assert_eq!(r.to_string(), "api.example.com");
        assert!(r.matches("api.example.com"));
        assert!(r.matches("API.EXAMPLE.COM."));
        assert!(!r.matches("example.com"));
        assert!(!r.matches("x.api.example.com"));
        assert!(!r.matches("api.example.com.evil.test"));
        assert!(!r.matches("evilapi.example.com"));
    }

    #[test]
    fn a_wildcard_matches_the_names_below_only() {
        let r = NameRule::parse("*.example.com").unwrap();
        assert!(r.matches("a.example.com"));
        assert!(r.matches("a.b.example.com"));
        assert!(!r.matches("example.com"));
        assert!(!r.matches("badexample.com"));
        assert!(!r.matches(".example.com"));
        assert!(!r.matches("a.example.com.evil.test"));
    }

    #[test]
    fn what_is_not_a_host_name_is_refused_saying_why() {
        for (bad, says) in [
            ("", "empty"),
            ("*.", "empty"),
            ("*.com", "top-level"),
            ("exämple.com", "punycode"),
            ("1.2.3.4", "address"),
            ("::1", "address"),
            ("-a.example.com", "label"),
            ("a..example.com", "label"),
            ("a_b.example.com", "label"),
            ("example.123", "digits"),
            ("*.*.example.com", "label"),
            ("a.example.com/path", "label"),
        ] {
            let e = NameRule::parse(bad).unwrap_err();
            assert!(e.contains(says), "{bad:?}: {e}");
        }
        let long = format!("{}.com", "a.".repeat(130));
        assert!(NameRule::parse(&long).unwrap_err().contains("longer"));
        assert!(NameRule::parse("localhost").is_ok());
        assert!(NameRule::parse("xn--exmple-cua.com").is_ok());
    }
}
