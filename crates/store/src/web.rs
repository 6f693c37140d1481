//! The dashboard's records (see migrations 0010 and 0011): who is an
//! operator, who is signed in, invitations to sign up, and recent sign-ups
//! by address.

use crate::error::Result;
use crate::util::{format_ts, get_i64, get_str, get_ts, hash_key, now, random_base32};
use crate::Store;
use time::{Duration, OffsetDateTime};

/// Random characters of a session token after its `sps_` (200 bits), and
/// of a session's CSRF token.
const SESSION_RANDOM_CHARS: usize = 40;

/// A signed-in session, as its cookie's token finds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WebSession {
    pub account_id: String,
    pub account_name: String,
    /// An operator's: sees every account.
    pub admin: bool,
    /// What the session's forms must carry.
    pub csrf: String,
    pub expires_at: OffsetDateTime,
}

impl Store {
    /// A new session for `account_id`, valid for `ttl`: its token (the only
    /// time it exists in clear) and the session. Expired sessions are
    /// removed on the way.
    pub async fn create_web_session(
        &self,
        account_id: &str,
        ttl: Duration,
    ) -> Result<(String, WebSession)> {
        let account = sqlx::query("SELECT name, admin FROM accounts WHERE id = $1")
            .bind(account_id)
            .fetch_optional(&self.pool)
            .await?
            .ok_or_else(|| crate::StoreError::NotFound(format!("account {account_id}")))?;
        let token = format!("sps_{}", random_base32(SESSION_RANDOM_CHARS));
        let created = now();
        let session = WebSession {
            account_id: account_id.to_string(),
            account_name: get_str(&account, "name")?,
            admin: get_i64(&account, "admin")? != 0,
            csrf: random_base32(SESSION_RANDOM_CHARS),
            expires_at: created + ttl,
        };
        sqlx::query("DELETE FROM web_sessions WHERE expires_at < $1")
            .bind(format_ts(created))
            .execute(&self.pool)
            .await?;
        sqlx::query(
            "INSERT INTO web_sessions (hash, account_id, csrf, created_at, expires_at) \
             VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(hash_key(&token))
        .bind(account_id)
        .bind(&session.csrf)
        .bind(format_ts(created))
        .bind(format_ts(session.expires_at))
        .execute(&self.pool)
        .await?;
        Ok((token, session))
    }

    /// The live session a cookie's token names, if any.
    pub async fn web_session(&self, token: &str) -> Result<Option<WebSession>> {
        let row = sqlx::query(
            "SELECT s.account_id, s.csrf, s.expires_at, a.name, a.admin \
             FROM web_sessions s JOIN accounts a ON a.id = s.account_id \
             WHERE s.hash = $1 AND s.expires_at > $2",
        )
        .bind(hash_key(token))
        .bind(format_ts(now()))
        .fetch_optional(&self.pool)
        .await?;
        let Some(row) = row else { return Ok(None) };
        Ok(Some(WebSession {
            account_id: get_str(&row, "account_id")?,
            account_name: get_str(&row, "name")?,
            admin: get_i64(&row, "admin")? != 0,
            csrf: get_str(&row, "csrf")?,
            expires_at: get_ts(&row, "expires_at")?,
        }))
    }

    /// Ends the session `token` names (signing out); false if there was none.
    pub async fn end_web_session(&self, token: &str) -> Result<bool> {
        let done = sqlx::query("DELETE FROM web_sessions WHERE hash = $1")
            .bind(hash_key(token))
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected() > 0)
    }

    /// Whether `account_id` is an operator's.
    pub async fn is_admin(&self, account_id: &str) -> Result<bool> {
        let row = sqlx::query("SELECT admin FROM accounts WHERE id = $1")
            .bind(account_id)
            .fetch_optional(&self.pool)
            .await?;
        Ok(match row {
            Some(r) => get_i64(&r, "admin")? != 0,
            None => false,
        })
    }

    /// Makes `account_id` an operator's, or not; false if no such account.
    pub async fn set_admin(&self, account_id: &str, admin: bool) -> Result<bool> {
        let done = sqlx::query("UPDATE accounts SET admin = $2 WHERE id = $1")
            .bind(account_id)
            .bind(i64::from(admin))
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected() > 0)
    }

    /// A new invitation good for `uses` sign-ups within `ttl`: its code
    /// (the only time it exists in clear) and its expiry.
    pub async fn create_invite(
        &self,
        uses: u32,
        ttl: Duration,
    ) -> Result<(String, OffsetDateTime)> {
        let code = format!("spi_{}", random_base32(SESSION_RANDOM_CHARS));
        let created = now();
        let expires = created + ttl;
        sqlx::query(
            "INSERT INTO invites (hash, uses_left, created_at, expires_at) VALUES ($1, $2, $3, $4)",
        )
        .bind(hash_key(&code))
        .bind(i64::from(uses))
        .bind(format_ts(created))
        .bind(format_ts(expires))
        .execute(&self.pool)
        .await?;
        Ok((code, expires))
    }

    /// Counts one sign-up from `address` if fewer than `per_window` came
    /// from it within `window` before `at`; else how long until one more
    /// may. Under the store's write lock (PostgreSQL: an advisory lock per
    /// address), so replicas sharing the database share the count and two
    /// racing sign-ups cannot both take the last place.
    pub async fn admit_signup(
        &self,
        address: &str,
        per_window: u32,
        window: Duration,
        at: OffsetDateTime,
    ) -> Result<std::result::Result<(), Duration>> {
        let mut tx = self.write_tx().await?;
        if crate::is_postgres(&tx) {
            sqlx::query("SELECT CAST(pg_advisory_xact_lock(hashtext($1)) AS TEXT)")
                .bind(format!("signup {address}"))
                .execute(&mut *tx)
                .await?;
        }
        let since = format_ts(at - window);
        sqlx::query("DELETE FROM signups WHERE at <= $1")
            .bind(&since)
            .execute(&mut *tx)
            .await?;
        let recent: Vec<String> =
            sqlx::query_scalar("SELECT at FROM signups WHERE address = $1 AND at > $2 ORDER BY at")
                .bind(address)
                .bind(&since)
                .fetch_all(&mut *tx)
                .await?;
        if recent.len() >= per_window as usize {
            let oldest = crate::util::parse_ts(&recent[0])?;
            return Ok(Err((oldest + window - at).max(Duration::ZERO)));
        }
        sqlx::query("INSERT INTO signups (address, at) VALUES ($1, $2)")
            .bind(address)
            .bind(format_ts(at))
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(Ok(()))
    }

    /// Uses up one sign-up of invitation `code`; false when it is unknown,
    /// used up or expired. One statement, so two sign-ups racing for its
    /// last use cannot both have it.
    pub async fn take_invite(&self, code: &str) -> Result<bool> {
        let done = sqlx::query(
            "UPDATE invites SET uses_left = uses_left - 1 \
             WHERE hash = $1 AND uses_left > 0 AND expires_at > $2",
        )
        .bind(hash_key(code))
        .bind(format_ts(now()))
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    /// Gives back a use taken by [`Store::take_invite`] for a sign-up that
    /// then failed (its name was taken).
    pub async fn return_invite(&self, code: &str) -> Result<()> {
        sqlx::query("UPDATE invites SET uses_left = uses_left + 1 WHERE hash = $1")
            .bind(hash_key(code))
            .execute(&self.pool)
            .await?;
        Ok(())
    }
}
