//! What every surface says about E2B's SDKs (see `sandpit-e2b`, which
//! speaks their API): the three variables that point them at this server.

/// The lines to export for E2B's SDKs to use this server with `key` (its
/// `e2b_` spelling, which every SDK version accepts).
pub fn environment(public_url: &str, key: &str) -> String {
    let base = public_url.trim_end_matches('/');
    let key = sandpit_store::e2b_spelling(key).unwrap_or_else(|| key.to_string());
    format!(
        "export E2B_API_URL={base}/e2b\n\
         export E2B_SANDBOX_URL={base}\n\
         export E2B_API_KEY={key}\n"
    )
}
