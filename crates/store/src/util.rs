//! Timestamps, random ids and key hashing: the few conventions every table
//! shares.

use crate::error::{Result, StoreError};
use rand::rngs::OsRng;
use rand::Rng;
use sha2::{Digest, Sha256};
use sqlx::any::AnyRow;
use sqlx::Row;
use time::format_description::FormatItem;
use time::macros::format_description;
use time::{OffsetDateTime, PrimitiveDateTime, UtcOffset};

/// Timestamps are stored as TEXT in exactly this shape (always UTC, always
/// six fractional digits), so that string order is time order in SQL — in
/// SQLite and in PostgreSQL alike — and `MIN`/`MAX`/`<=` need no date
/// functions.
const TS_FORMAT: &[FormatItem<'static>] =
    format_description!("[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond digits:6]Z");

/// A timestamp as stored: fixed-width RFC 3339 UTC with microseconds, e.g.
/// `2026-01-02T03:04:05.678901Z`. Also valid RFC 3339 for the API.
pub fn format_ts(t: OffsetDateTime) -> String {
    t.to_offset(UtcOffset::UTC)
        .format(TS_FORMAT)
        .expect("a UTC timestamp with a 4-digit year formats")
}

/// Reads back what [`format_ts`] wrote.
pub fn parse_ts(s: &str) -> Result<OffsetDateTime> {
    PrimitiveDateTime::parse(s, TS_FORMAT)
        .map(PrimitiveDateTime::assume_utc)
        .map_err(|e| StoreError::Corrupt(format!("timestamp {s:?}: {e}")))
}

/// Now, at the precision that is stored (microseconds), so a value handed
/// back to a caller equals the one read later.
pub(crate) fn now() -> OffsetDateTime {
    let t = OffsetDateTime::now_utc();
    t.replace_nanosecond(t.nanosecond() / 1000 * 1000)
        .expect("a truncated nanosecond is in range")
}

/// RFC 4648 base32 alphabet, lower case: no padding, no ambiguity between
/// upper and lower case when people read keys aloud or paste them.
const BASE32: &[u8; 32] = b"abcdefghijklmnopqrstuvwxyz234567";

/// `n` random base32 characters (5 bits each) from the OS's CSPRNG.
pub(crate) fn random_base32(n: usize) -> String {
    let mut rng = OsRng;
    (0..n)
        .map(|_| BASE32[rng.gen_range(0..32)] as char)
        .collect()
}

/// A new opaque id: `prefix` + `_` + 24 base32 characters (120 random
/// bits; the API asks for at least 96). Use it for ids the caller chooses,
/// such as `sbx` and `exec`.
pub fn new_id(prefix: &str) -> String {
    format!("{prefix}_{}", random_base32(24))
}

/// SHA-256 of an API key, lower-case hex: what `api_keys.hash` holds.
/// Keys carry 200 random bits, so an unsalted fast hash is enough: there is
/// nothing to brute-force.
pub fn hash_key(key: &str) -> String {
    hex::encode(Sha256::digest(key.as_bytes()))
}

// ---- row decoding helpers ----

pub(crate) fn get_str(row: &AnyRow, col: &str) -> Result<String> {
    Ok(row.try_get::<String, _>(col)?)
}

pub(crate) fn get_opt_str(row: &AnyRow, col: &str) -> Result<Option<String>> {
    Ok(row.try_get::<Option<String>, _>(col)?)
}

pub(crate) fn get_i64(row: &AnyRow, col: &str) -> Result<i64> {
    Ok(row.try_get::<i64, _>(col)?)
}

pub(crate) fn get_opt_i64(row: &AnyRow, col: &str) -> Result<Option<i64>> {
    Ok(row.try_get::<Option<i64>, _>(col)?)
}

pub(crate) fn get_u32(row: &AnyRow, col: &str) -> Result<u32> {
    let v = get_i64(row, col)?;
    u32::try_from(v).map_err(|_| StoreError::Corrupt(format!("{col} = {v} is not a u32")))
}

pub(crate) fn get_ts(row: &AnyRow, col: &str) -> Result<OffsetDateTime> {
    parse_ts(&get_str(row, col)?)
}

pub(crate) fn get_opt_ts(row: &AnyRow, col: &str) -> Result<Option<OffsetDateTime>> {
    get_opt_str(row, col)?.as_deref().map(parse_ts).transpose()
}

/// RFC 3339 UTC, as the API writes times.
pub fn format_rfc3339(t: OffsetDateTime) -> String {
    t.to_offset(UtcOffset::UTC)
        .format(&time::format_description::well_known::Rfc3339)
        .expect("a UTC timestamp formats as RFC 3339")
}

#[cfg(test)]
mod tests {
    use super::*;
    use time::macros::datetime;

    #[test]
    fn timestamps_are_fixed_width_utc_and_round_trip() {
        let t = datetime!(2026-01-02 03:04:05.678_901_234 +02:00);
        let s = format_ts(t);
        assert_eq!(s, "2026-01-02T01:04:05.678901Z");
        assert_eq!(format_ts(datetime!(2026-01-02 03:04:05 UTC)).len(), s.len());
        assert_eq!(
            parse_ts(&s).unwrap(),
            datetime!(2026-01-02 01:04:05.678_901 UTC)
        );
        assert!(parse_ts("2026-01-02").is_err());
    }

    #[test]
    fn ids_are_random_base32() {
        let a = new_id("sbx");
        assert_eq!(a.len(), 4 + 24);
        assert!(a[4..].bytes().all(|b| BASE32.contains(&b)));
        assert_ne!(a, new_id("sbx"));
    }

    #[test]
    fn now_is_stored_precision() {
        let t = now();
        assert_eq!(parse_ts(&format_ts(t)).unwrap(), t);
    }
}
