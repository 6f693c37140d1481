//! A key's second spelling, for E2B's SDKs.
//!
//! A Sandpit key is `sp_` and 40 base32 characters (200 random bits). E2B's
//! SDKs from 2.24 to 2.45 refuse, before sending anything, a key that is not
//! `e2b_` followed by lowercase hex; the pinned ones check nothing. So every
//! key has a second spelling: `e2b_` and the same bits in hex (50
//! characters). Both spellings are the same key: authenticating either
//! hashes the `sp_` one, so nothing new is stored, keys made before this
//! existed have it too, and revoking one revokes both.

/// The alphabet of a key's random part (see `util::random_base32`).
const BASE32: &[u8; 32] = b"abcdefghijklmnopqrstuvwxyz234567";

/// The `e2b_` spelling of `key`, or `None` when `key` is not a Sandpit key.
pub fn e2b_spelling(key: &str) -> Option<String> {
    let random = key.strip_prefix("sp_")?;
    // Whole bytes only: 40 characters are 200 bits, 25 bytes.
    if random.is_empty() || random.len() % 8 != 0 {
        return None;
    }
    let mut bits: u64 = 0;
    let mut held = 0u32;
    let mut out = String::from("e2b_");
    for c in random.bytes() {
        let value = BASE32.iter().position(|&b| b == c)? as u64;
        bits = (bits << 5) | value;
        held += 5;
        while held >= 8 {
            held -= 8;
            out.push_str(&format!("{:02x}", (bits >> held) & 0xff));
        }
    }
    Some(out)
}

/// The `sp_` spelling of `key` when it is the `e2b_` spelling of one; any
/// other string comes back as it is (it is then looked up as given).
pub fn canonical_key(key: &str) -> std::borrow::Cow<'_, str> {
    match sp_spelling(key) {
        Some(sp) => std::borrow::Cow::Owned(sp),
        None => std::borrow::Cow::Borrowed(key),
    }
}

fn sp_spelling(key: &str) -> Option<String> {
    let hex = key.strip_prefix("e2b_")?;
    // Whole groups of five bytes (eight base32 characters each).
    if hex.is_empty() || hex.len() % 10 != 0 {
        return None;
    }
    let bytes = hex::decode(hex).ok()?;
    if hex.bytes().any(|b| b.is_ascii_uppercase()) {
        return None;
    }
    let mut bits: u64 = 0;
    let mut held = 0u32;
    let mut out = String::from("sp_");
    for byte in bytes {
        bits = (bits << 8) | u64::from(byte);
        held += 8;
        while held >= 5 {
            held -= 5;
            out.push(BASE32[((bits >> held) & 31) as usize] as char);
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_spellings_are_one_key() {
        for _ in 0..200 {
            let key = format!("sp_{}", crate::util::random_base32(40));
            let e2b = e2b_spelling(&key).unwrap();
            assert_eq!(e2b.len(), 4 + 50, "{e2b}");
            assert!(e2b[4..]
                .bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
            assert_eq!(canonical_key(&e2b), key);
            assert_eq!(canonical_key(&key), key);
        }
    }

    #[test]
    fn what_is_not_a_spelling_stays_as_given() {
        for other in [
            "e2b_",
            "e2b_abc",
            "e2b_ZZZZZZZZZZ",
            "e2b_ABCDEF0123",
            "sp_x",
            "bearer",
        ] {
            assert_eq!(canonical_key(other), other);
        }
        assert_eq!(e2b_spelling("sp_abc"), None);
        assert_eq!(e2b_spelling("sp_ABCDEFGH"), None);
        assert_eq!(e2b_spelling("key"), None);
    }
}
