//! One-use terminal tokens (see migration 0009): made for an account's
//! sandbox, taken once, gone after their minute.

use crate::error::Result;
use crate::util::{format_ts, get_str, get_ts, hash_key, now, random_base32};
use crate::Store;
use time::{Duration, OffsetDateTime};

/// Random characters of a terminal token after its `spt_` (200 bits).
const TOKEN_RANDOM_CHARS: usize = 40;

/// What a taken token opens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TerminalGrant {
    pub account_id: String,
    pub sandbox_id: String,
}

impl Store {
    /// A new token for `account_id`'s sandbox `sandbox_id`, valid for
    /// `ttl`: the token (the only time it exists in clear) and its expiry.
    /// Tokens that expired are removed on the way.
    pub async fn create_terminal_token(
        &self,
        account_id: &str,
        sandbox_id: &str,
        ttl: Duration,
    ) -> Result<(String, OffsetDateTime)> {
        let token = format!("spt_{}", random_base32(TOKEN_RANDOM_CHARS));
        let created = now();
        let expires = created + ttl;
        sqlx::query("DELETE FROM terminal_tokens WHERE expires_at < $1")
            .bind(format_ts(created))
            .execute(&self.pool)
            .await?;
        sqlx::query(
            "INSERT INTO terminal_tokens (hash, account_id, sandbox_id, created_at, expires_at) \
             VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(hash_key(&token))
        .bind(account_id)
        .bind(sandbox_id)
        .bind(format_ts(created))
        .bind(format_ts(expires))
        .execute(&self.pool)
        .await?;
        Ok((token, expires))
    }

    /// Takes `token`: what it opens, if it exists and has not expired. It
    /// is deleted either way, in one statement, so two requests racing
    /// with the same token cannot both have it.
    pub async fn take_terminal_token(&self, token: &str) -> Result<Option<TerminalGrant>> {
        let row = sqlx::query(
            "DELETE FROM terminal_tokens WHERE hash = $1 \
             RETURNING account_id, sandbox_id, expires_at",
        )
        .bind(hash_key(token))
        .fetch_optional(&self.pool)
        .await?;
        let Some(row) = row else { return Ok(None) };
        if get_ts(&row, "expires_at")? <= now() {
            return Ok(None);
        }
        Ok(Some(TerminalGrant {
            account_id: get_str(&row, "account_id")?,
            sandbox_id: get_str(&row, "sandbox_id")?,
        }))
    }
}
