//! Identifiers and timestamps as the API shows them.
//!
//! Ids are opaque, never sequential: a prefix and 120 random bits in
//! lowercase base32 (24 characters), so they are safe in host names
//! (`{port}-{id}.{domain}`) and directory names.

use time::OffsetDateTime;

const ALPHABET: &[u8; 32] = b"abcdefghijklmnopqrstuvwxyz234567";

/// Whether two secrets are equal, in a time that does not say where they
/// differ (a guesser learns nothing from how fast a wrong one is refused).
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// `prefix` + 24 random base32 characters (120 bits).
pub fn new_id(prefix: &str) -> String {
    let mut s = String::with_capacity(prefix.len() + 24);
    s.push_str(prefix);
    let bytes: [u8; 24] = rand::random();
    for b in bytes {
        s.push(ALPHABET[(b & 31) as usize] as char);
    }
    s
}

/// RFC 3339 UTC with whole seconds (`2026-11-30T01:02:03Z`).
pub fn rfc3339(t: OffsetDateTime) -> String {
    let t = t.to_offset(time::UtcOffset::UTC);
    format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}Z",
        t.year(),
        t.month() as u8,
        t.day(),
        t.hour(),
        t.minute(),
        t.second()
    )
}

/// Parse an RFC 3339 timestamp.
pub fn parse_rfc3339(s: &str) -> Option<OffsetDateTime> {
    OffsetDateTime::parse(s, &time::format_description::well_known::Rfc3339).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_long_random_and_host_name_safe() {
        let a = new_id("sbx_");
        let b = new_id("sbx_");
        assert_ne!(a, b);
        assert_eq!(a.len(), 28);
        assert!(a[4..]
            .bytes()
            .all(|c| c.is_ascii_lowercase() || (b'2'..=b'7').contains(&c)));
    }

    #[test]
    fn timestamps_round_trip() {
        let t = OffsetDateTime::from_unix_timestamp(1_800_000_000).unwrap();
        let s = rfc3339(t);
        assert_eq!(s, "2027-01-15T08:00:00Z");
        assert_eq!(parse_rfc3339(&s), Some(t));
    }
}
