//! Accounts, their API keys, and the money ledger's plain entry points
//! (credit and balance; reservations and charges live with the sandboxes
//! they belong to).

use crate::error::{Result, StoreError};
use crate::util::{
    format_ts, get_i64, get_opt_str, get_opt_ts, get_str, get_ts, get_u32, hash_key, new_id, now,
    random_base32,
};
use crate::Store;

/// The advisory lock that orders first starts on one PostgreSQL database.
const FIRST_ADMIN_LOCK: i64 = 7_320_551_130_146_542;
use sqlx::any::AnyRow;
use time::{Duration, OffsetDateTime};

/// An account: who owns sandboxes and pays for them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccountRow {
    /// `acct_` + 24 base32 characters.
    pub id: String,
    /// Unique, chosen by the operator.
    pub name: String,
    /// How many live sandboxes the account may have at once.
    pub max_concurrent: u32,
    pub created_at: OffsetDateTime,
}

/// An API key as stored: everything but the key (only its hash is kept,
/// and not exposed here).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyRow {
    /// `key_` + 24 base32 characters; what operators revoke by.
    pub id: String,
    pub account_id: String,
    /// The key's first 12 characters (`sp_` + 9), safe to show.
    pub prefix: String,
    pub created_at: OffsetDateTime,
    /// Updated by [`Store::authenticate`], at most once a minute.
    pub last_used_at: Option<OffsetDateTime>,
    pub revoked_at: Option<OffsetDateTime>,
}

/// One movement of money.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LedgerRow {
    pub id: i64,
    pub account_id: String,
    pub sandbox_id: Option<String>,
    /// `credit`, `reserve`, `release` or `charge`.
    pub kind: String,
    /// Signed micro-dollars: credit and release ≥ 0, reserve and charge ≤ 0.
    pub amount_micros: i64,
    pub note: Option<String>,
    pub at: OffsetDateTime,
}

/// How often `last_used_at` is written at most, per key: often enough to
/// tell a dead key from a live one, rare enough that authenticating is not
/// a database write per request.
const LAST_USED_GRANULARITY: Duration = Duration::minutes(1);

/// Length of a key's random part: 40 base32 characters, 200 bits.
const KEY_RANDOM_CHARS: usize = 40;
/// Length of the visible prefix.
const KEY_PREFIX_CHARS: usize = 12;

fn account_from(row: &AnyRow) -> Result<AccountRow> {
    Ok(AccountRow {
        id: get_str(row, "id")?,
        name: get_str(row, "name")?,
        max_concurrent: get_u32(row, "max_concurrent")?,
        created_at: get_ts(row, "created_at")?,
    })
}

fn key_from(row: &AnyRow) -> Result<KeyRow> {
    Ok(KeyRow {
        id: get_str(row, "id")?,
        account_id: get_str(row, "account_id")?,
        prefix: get_str(row, "prefix")?,
        created_at: get_ts(row, "created_at")?,
        last_used_at: get_opt_ts(row, "last_used_at")?,
        revoked_at: get_opt_ts(row, "revoked_at")?,
    })
}

pub(crate) fn ledger_from(row: &AnyRow) -> Result<LedgerRow> {
    Ok(LedgerRow {
        id: get_i64(row, "id")?,
        account_id: get_str(row, "account_id")?,
        sandbox_id: get_opt_str(row, "sandbox_id")?,
        kind: get_str(row, "kind")?,
        amount_micros: get_i64(row, "amount_micros")?,
        note: get_opt_str(row, "note")?,
        at: get_ts(row, "at")?,
    })
}

impl Store {
    /// Creates an account. A taken name is [`StoreError::Conflict`].
    pub async fn create_account(&self, name: &str, max_concurrent: u32) -> Result<AccountRow> {
        if name.trim().is_empty() {
            return Err(StoreError::Invalid("account name is empty".into()));
        }
        let row = AccountRow {
            id: new_id("acct"),
            name: name.to_string(),
            max_concurrent,
            created_at: now(),
        };
        let res = sqlx::query(
            "INSERT INTO accounts (id, name, max_concurrent, created_at) VALUES ($1, $2, $3, $4)",
        )
        .bind(&row.id)
        .bind(&row.name)
        .bind(i64::from(row.max_concurrent))
        .bind(format_ts(row.created_at))
        .execute(&self.pool)
        .await
        .map_err(StoreError::from);
        match res {
            Ok(_) => Ok(row),
            Err(e) if e.is_unique_violation() => Err(StoreError::Conflict(format!(
                "an account named {name:?} exists"
            ))),
            Err(e) => Err(e),
        }
    }

    /// The operator's account of a store that has none yet: made, as an
    /// administrator, only if no account exists, under the store's write
    /// lock (PostgreSQL: an advisory lock), so servers started together on
    /// an empty database make exactly one. `None`: there were accounts.
    pub async fn create_first_admin(
        &self,
        name: &str,
        max_concurrent: u32,
    ) -> Result<Option<AccountRow>> {
        let mut tx = self.write_tx().await?;
        if crate::is_postgres(&tx) {
            sqlx::query("SELECT CAST(pg_advisory_xact_lock($1) AS TEXT)")
                .bind(FIRST_ADMIN_LOCK)
                .execute(&mut *tx)
                .await?;
        }
        let accounts: i64 = sqlx::query_scalar("SELECT CAST(COUNT(*) AS BIGINT) FROM accounts")
            .fetch_one(&mut *tx)
            .await?;
        if accounts > 0 {
            return Ok(None);
        }
        let row = AccountRow {
            id: new_id("acct"),
            name: name.to_string(),
            max_concurrent,
            created_at: now(),
        };
        sqlx::query(
            "INSERT INTO accounts (id, name, max_concurrent, created_at, admin) \
             VALUES ($1, $2, $3, $4, 1)",
        )
        .bind(&row.id)
        .bind(&row.name)
        .bind(i64::from(row.max_concurrent))
        .bind(format_ts(row.created_at))
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(Some(row))
    }

    /// The account with this id.
    pub async fn account(&self, id: &str) -> Result<Option<AccountRow>> {
        sqlx::query("SELECT * FROM accounts WHERE id = $1")
            .bind(id)
            .fetch_optional(&self.pool)
            .await?
            .as_ref()
            .map(account_from)
            .transpose()
    }

    /// The account with this name.
    pub async fn account_by_name(&self, name: &str) -> Result<Option<AccountRow>> {
        sqlx::query("SELECT * FROM accounts WHERE name = $1")
            .bind(name)
            .fetch_optional(&self.pool)
            .await?
            .as_ref()
            .map(account_from)
            .transpose()
    }

    /// Every account, oldest first.
    pub async fn list_accounts(&self) -> Result<Vec<AccountRow>> {
        sqlx::query("SELECT * FROM accounts ORDER BY created_at, id")
            .fetch_all(&self.pool)
            .await?
            .iter()
            .map(account_from)
            .collect()
    }

    /// Makes a new API key for an account. Returns the full key — the only
    /// time it exists outside its holder's hands — and the stored row.
    ///
    /// The key is `sp_` + 40 random base32 characters (200 bits).
    pub async fn create_key(&self, account_id: &str) -> Result<(String, KeyRow)> {
        if self.account(account_id).await?.is_none() {
            return Err(StoreError::NotFound(format!("account {account_id}")));
        }
        let key = format!("sp_{}", random_base32(KEY_RANDOM_CHARS));
        let row = KeyRow {
            id: new_id("key"),
            account_id: account_id.to_string(),
            prefix: key[..KEY_PREFIX_CHARS].to_string(),
            created_at: now(),
            last_used_at: None,
            revoked_at: None,
        };
        sqlx::query(
            "INSERT INTO api_keys (id, account_id, prefix, hash, created_at) \
             VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(&row.id)
        .bind(&row.account_id)
        .bind(&row.prefix)
        .bind(hash_key(&key))
        .bind(format_ts(row.created_at))
        .execute(&self.pool)
        .await?;
        Ok((key, row))
    }

    /// The key and its account, if `key` is a known, unrevoked key.
    ///
    /// Looks the key up by its hash. Records the use in `last_used_at`, but
    /// writes at most once a minute per key.
    pub async fn authenticate(&self, key: &str) -> Result<Option<(KeyRow, AccountRow)>> {
        let row = sqlx::query(
            "SELECT k.id, k.account_id, k.prefix, k.created_at, k.last_used_at, k.revoked_at, \
                    a.name AS a_name, a.max_concurrent AS a_max_concurrent, \
                    a.created_at AS a_created_at \
             FROM api_keys k JOIN accounts a ON a.id = k.account_id \
             WHERE k.hash = $1 AND k.revoked_at IS NULL",
        )
        .bind(hash_key(&crate::canonical_key(key)))
        .fetch_optional(&self.pool)
        .await?;
        let Some(row) = row else { return Ok(None) };
        let mut k = key_from(&row)?;
        let account = AccountRow {
            id: k.account_id.clone(),
            name: get_str(&row, "a_name")?,
            max_concurrent: get_u32(&row, "a_max_concurrent")?,
            created_at: get_ts(&row, "a_created_at")?,
        };
        let t = now();
        let stale = t - LAST_USED_GRANULARITY;
        if k.last_used_at.is_none_or(|u| u < stale) {
            // Conditional, so that concurrent requests with the same key
            // write once between them.
            let done = sqlx::query(
                "UPDATE api_keys SET last_used_at = $2 \
                 WHERE id = $1 AND (last_used_at IS NULL OR last_used_at < $3)",
            )
            .bind(&k.id)
            .bind(format_ts(t))
            .bind(format_ts(stale))
            .execute(&self.pool)
            .await?;
            if done.rows_affected() > 0 {
                k.last_used_at = Some(t);
            }
        }
        Ok(Some((k, account)))
    }

    /// Keys, oldest first: of one account, or of all.
    pub async fn list_keys(&self, account_id: Option<&str>) -> Result<Vec<KeyRow>> {
        sqlx::query(
            "SELECT * FROM api_keys WHERE ($1 IS NULL OR account_id = $1) \
             ORDER BY created_at, id",
        )
        .bind(account_id)
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(key_from)
        .collect()
    }

    /// Revokes the unrevoked key named by its id, its visible prefix or the
    /// full key. `false` if there is no such key (or it is already
    /// revoked); [`StoreError::Conflict`] if a prefix matches more than one
    /// key (then use the id).
    pub async fn revoke_key(&self, id_or_prefix: &str) -> Result<bool> {
        let mut tx = self.write_tx().await?;
        let ids: Vec<String> = sqlx::query_scalar(
            "SELECT id FROM api_keys \
             WHERE (id = $1 OR prefix = $1 OR hash = $2) AND revoked_at IS NULL",
        )
        .bind(id_or_prefix)
        .bind(hash_key(id_or_prefix))
        .fetch_all(&mut *tx)
        .await?;
        match ids.as_slice() {
            [] => Ok(false),
            [id] => {
                sqlx::query("UPDATE api_keys SET revoked_at = $2 WHERE id = $1")
                    .bind(id)
                    .bind(format_ts(now()))
                    .execute(&mut *tx)
                    .await?;
                tx.commit().await?;
                Ok(true)
            }
            _ => Err(StoreError::Conflict(format!(
                "{id_or_prefix:?} matches {} keys; revoke by id",
                ids.len()
            ))),
        }
    }

    /// Adds credit (`micros` > 0) to an account. Returns the ledger row.
    pub async fn add_credit(
        &self,
        account_id: &str,
        micros: i64,
        note: Option<&str>,
    ) -> Result<LedgerRow> {
        if micros <= 0 {
            return Err(StoreError::Invalid(format!(
                "a credit must be positive, not {micros}"
            )));
        }
        let at = now();
        let res = sqlx::query(
            "INSERT INTO ledger (account_id, sandbox_id, kind, amount_micros, note, at) \
             VALUES ($1, NULL, 'credit', $2, $3, $4) RETURNING *",
        )
        .bind(account_id)
        .bind(micros)
        .bind(note)
        .bind(format_ts(at))
        .fetch_one(&self.pool)
        .await;
        match res {
            Ok(row) => ledger_from(&row),
            Err(e)
                if e.as_database_error()
                    .is_some_and(|d| d.is_foreign_key_violation()) =>
            {
                Err(StoreError::NotFound(format!("account {account_id}")))
            }
            Err(e) => Err(e.into()),
        }
    }

    /// The account's balance in micro-dollars: the sum of its ledger (0 for
    /// an unknown account). Reserved money is already subtracted.
    pub async fn balance(&self, account_id: &str) -> Result<i64> {
        balance_in(&self.pool, account_id).await
    }

    /// The account's ledger, in the order it was written.
    pub async fn ledger(&self, account_id: &str) -> Result<Vec<LedgerRow>> {
        sqlx::query("SELECT * FROM ledger WHERE account_id = $1 ORDER BY id")
            .bind(account_id)
            .fetch_all(&self.pool)
            .await?
            .iter()
            .map(ledger_from)
            .collect()
    }
}

/// `SUM(amount_micros)` of an account, on any executor (so a transaction
/// can read it under its lock).
pub(crate) async fn balance_in<'e, E>(exec: E, account_id: &str) -> Result<i64>
where
    E: sqlx::Executor<'e, Database = sqlx::Any>,
{
    Ok(sqlx::query_scalar(
        "SELECT CAST(COALESCE(SUM(amount_micros), 0) AS BIGINT) FROM ledger WHERE account_id = $1",
    )
    .bind(account_id)
    .fetch_one(exec)
    .await?)
}
