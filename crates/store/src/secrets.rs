//! Secrets (see migrations 0020 and 0021): an account's credentials by
//! name (and by id, E2B's), and what a sandbox that uses them keeps (its
//! CA, a placeholder for each, its network rules).
//!
//! The store holds values and the CA's key only as the service sealed
//! them: it never sees one in clear, and a value never leaves here except
//! to the service that unseals it for a VM's egress proxy. A listing
//! carries no value at all ([`SecretRow`]); only [`Store::secrets_named`]
//! reads them, for the sandboxes that use them.

use crate::error::{Result, StoreError};
use crate::states::live_statuses;
use crate::util::{format_ts, get_i64, get_opt_str, get_opt_ts, get_str, get_ts, new_id, now};
use crate::Store;
use sqlx::any::AnyRow;
use sqlx::Row;
use time::OffsetDateTime;

/// A secret as listed: everything but its value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SecretRow {
    pub account_id: String,
    /// Its stable id (`sec_…`, E2B's `secretID`).
    pub id: String,
    /// The guest's environment variable.
    pub name: String,
    /// Host name rules it may be sent to; none for one made through E2B
    /// (its network rules put it in requests).
    pub hosts: Vec<String>,
    /// The request header it goes in.
    pub header: String,
    /// That header's value, `{value}` standing for the secret's.
    pub format: String,
    /// 1 at its create, one more at each new value.
    pub version: i64,
    /// Its owner's metadata (E2B's), as JSON: an object of strings.
    pub metadata: String,
    pub created_at: OffsetDateTime,
    /// The last put.
    pub updated_at: OffsetDateTime,
    /// When a sandbox's egress last put it into a request, as far as
    /// the service has written it ([`Store::note_secret_used`]).
    pub last_used_at: Option<OffsetDateTime>,
}

/// What [`Store::put_secret`] stores.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewSecret {
    pub account_id: String,
    pub name: String,
    pub hosts: Vec<String>,
    pub header: String,
    pub format: String,
    /// The value as the service sealed it.
    pub sealed_value: Vec<u8>,
}

/// What [`Store::update_secret_value`] changes: a secret's value (a new
/// version), and its metadata when given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SecretValue {
    /// The value as the service sealed it.
    pub sealed_value: Vec<u8>,
    /// The new metadata (JSON), or `None` to keep it.
    pub metadata: Option<String>,
}

/// A sandbox's brokered secrets: its own CA and the placeholders its guest
/// has (see [`Store::set_sandbox_broker`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxBroker {
    /// The CA's certificate (PEM).
    pub ca_cert: String,
    /// Its key, as the service sealed it.
    pub ca_key_sealed: Vec<u8>,
    /// `(name, placeholder)`, by name.
    pub secrets: Vec<(String, String)>,
    /// Its network rules (see migration 0021), as JSON, if it has any.
    pub rules: Option<String>,
}

/// The columns of a [`SecretRow`].
const SECRET_COLUMNS: &str = "account_id, id, name, hosts, header, format, version, metadata, \
                              created_at, updated_at, last_used_at";

fn secret_from(row: &AnyRow) -> Result<SecretRow> {
    let hosts = get_str(row, "hosts")?;
    Ok(SecretRow {
        account_id: get_str(row, "account_id")?,
        id: get_str(row, "id")?,
        name: get_str(row, "name")?,
        hosts: serde_json::from_str(&hosts)
            .map_err(|e| StoreError::Corrupt(format!("a secret's hosts {hosts:?}: {e}")))?,
        header: get_str(row, "header")?,
        format: get_str(row, "format")?,
        version: get_i64(row, "version")?,
        metadata: get_str(row, "metadata")?,
        created_at: get_ts(row, "created_at")?,
        updated_at: get_ts(row, "updated_at")?,
        last_used_at: get_opt_ts(row, "last_used_at")?,
    })
}

impl Store {
    /// Stores `secret`, replacing the account's secret of that name if it
    /// has one (whose id, `created_at` and metadata are kept, its version
    /// one more): the row as stored.
    pub async fn put_secret(&self, secret: &NewSecret) -> Result<SecretRow> {
        let at = format_ts(now());
        let row = sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO secrets (account_id, id, name, hosts, header, format, sealed_value, \
             created_at, updated_at) VALUES ($1, $8, $2, $3, $4, $5, $6, $7, $7) \
             ON CONFLICT (account_id, name) DO UPDATE SET hosts = excluded.hosts, \
             header = excluded.header, format = excluded.format, \
             sealed_value = excluded.sealed_value, updated_at = excluded.updated_at, \
             version = secrets.version + 1 \
             RETURNING {SECRET_COLUMNS}"
        )))
        .bind(&secret.account_id)
        .bind(&secret.name)
        .bind(serde_json::to_string(&secret.hosts).expect("strings serialize"))
        .bind(&secret.header)
        .bind(&secret.format)
        .bind(secret.sealed_value.clone())
        .bind(at)
        .bind(new_id("sec"))
        .fetch_one(&self.pool)
        .await?;
        secret_from(&row)
    }

    /// Stores `secret` as a new one (version 1) with `metadata` (JSON):
    /// `None` when the account has a secret of that name already.
    pub async fn create_secret(
        &self,
        secret: &NewSecret,
        metadata: &str,
    ) -> Result<Option<SecretRow>> {
        let at = format_ts(now());
        let row = sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO secrets (account_id, id, name, hosts, header, format, sealed_value, \
             metadata, created_at, updated_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $9) \
             ON CONFLICT (account_id, name) DO NOTHING RETURNING {SECRET_COLUMNS}"
        )))
        .bind(&secret.account_id)
        .bind(new_id("sec"))
        .bind(&secret.name)
        .bind(serde_json::to_string(&secret.hosts).expect("strings serialize"))
        .bind(&secret.header)
        .bind(&secret.format)
        .bind(secret.sealed_value.clone())
        .bind(metadata)
        .bind(at)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(secret_from).transpose()
    }

    /// The account's secret `name`, without its value.
    pub async fn secret(&self, account_id: &str, name: &str) -> Result<Option<SecretRow>> {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {SECRET_COLUMNS} FROM secrets WHERE account_id = $1 AND name = $2"
        )))
        .bind(account_id)
        .bind(name)
        .fetch_optional(&self.pool)
        .await?
        .as_ref()
        .map(secret_from)
        .transpose()
    }

    /// The account's secret of id `id`, without its value.
    pub async fn secret_by_id(&self, account_id: &str, id: &str) -> Result<Option<SecretRow>> {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {SECRET_COLUMNS} FROM secrets WHERE account_id = $1 AND id = $2"
        )))
        .bind(account_id)
        .bind(id)
        .fetch_optional(&self.pool)
        .await?
        .as_ref()
        .map(secret_from)
        .transpose()
    }

    /// Gives the account's secret `name` a new value (its version one
    /// more) and, when `change` says, new metadata; its hosts, header and
    /// format stay. `None` when it has no secret of that name.
    pub async fn update_secret_value(
        &self,
        account_id: &str,
        name: &str,
        change: &SecretValue,
    ) -> Result<Option<SecretRow>> {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE secrets SET sealed_value = $3, metadata = COALESCE($4, metadata), \
             version = version + 1, updated_at = $5 WHERE account_id = $1 AND name = $2 \
             RETURNING {SECRET_COLUMNS}"
        )))
        .bind(account_id)
        .bind(name)
        .bind(change.sealed_value.clone())
        .bind(change.metadata.as_deref())
        .bind(format_ts(now()))
        .fetch_optional(&self.pool)
        .await?
        .as_ref()
        .map(secret_from)
        .transpose()
    }

    /// An account's secrets, by name, without their values.
    pub async fn list_secrets(&self, account_id: &str) -> Result<Vec<SecretRow>> {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {SECRET_COLUMNS} FROM secrets WHERE account_id = $1 ORDER BY name"
        )))
        .bind(account_id)
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(secret_from)
        .collect()
    }

    /// Those of `names` the account has, by name, each with its sealed
    /// value; a name it has not is left out.
    pub async fn secrets_named(
        &self,
        account_id: &str,
        names: &[String],
    ) -> Result<Vec<(SecretRow, Vec<u8>)>> {
        if names.is_empty() {
            return Ok(Vec::new());
        }
        // One placeholder per name: `$2, $3, …` (names are few, at most a
        // create's 32).
        let list = (0..names.len())
            .map(|i| format!("${}", i + 2))
            .collect::<Vec<_>>()
            .join(", ");
        let mut query = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {SECRET_COLUMNS}, sealed_value FROM secrets \
             WHERE account_id = $1 AND name IN ({list}) ORDER BY name"
        )))
        .bind(account_id);
        for name in names {
            query = query.bind(name);
        }
        query
            .fetch_all(&self.pool)
            .await?
            .iter()
            .map(|row| {
                Ok((
                    secret_from(row)?,
                    row.try_get::<Vec<u8>, _>("sealed_value")?,
                ))
            })
            .collect()
    }

    /// Deletes the account's secret `name`: what it was, or `None` when it
    /// has none of that name. Sandboxes that use it keep their placeholder,
    /// which nothing replaces from then on.
    pub async fn delete_secret(&self, account_id: &str, name: &str) -> Result<Option<SecretRow>> {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DELETE FROM secrets WHERE account_id = $1 AND name = $2 RETURNING {SECRET_COLUMNS}"
        )))
        .bind(account_id)
        .bind(name)
        .fetch_optional(&self.pool)
        .await?
        .as_ref()
        .map(secret_from)
        .transpose()
    }

    /// Gives sandbox `sandbox_id` its broker: its CA, a placeholder for
    /// each secret it uses (`(name, placeholder)`) and its network rules,
    /// in one transaction. A
    /// fork's is its origin's, read with [`Store::sandbox_broker`] and given
    /// here (its CA's key sealed anew for it).
    pub async fn set_sandbox_broker(&self, sandbox_id: &str, broker: &SandboxBroker) -> Result<()> {
        let mut tx = self.write_tx().await?;
        let done = sqlx::query(
            "UPDATE sandboxes SET broker_ca_cert = $2, broker_ca_key = $3, network_rules = $4 \
             WHERE id = $1",
        )
        .bind(sandbox_id)
        .bind(&broker.ca_cert)
        .bind(broker.ca_key_sealed.clone())
        .bind(broker.rules.as_deref())
        .execute(&mut *tx)
        .await?;
        if done.rows_affected() == 0 {
            return Err(StoreError::NotFound(format!("sandbox {sandbox_id}")));
        }
        for (name, placeholder) in &broker.secrets {
            sqlx::query(
                "INSERT INTO sandbox_secrets (sandbox_id, name, placeholder) VALUES ($1, $2, $3)",
            )
            .bind(sandbox_id)
            .bind(name)
            .bind(placeholder)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// Sandbox `sandbox_id`'s broker, if it has one.
    pub async fn sandbox_broker(&self, sandbox_id: &str) -> Result<Option<SandboxBroker>> {
        let Some(row) = sqlx::query(
            "SELECT broker_ca_cert, broker_ca_key, network_rules FROM sandboxes \
             WHERE id = $1 AND broker_ca_cert IS NOT NULL",
        )
        .bind(sandbox_id)
        .fetch_optional(&self.pool)
        .await?
        else {
            return Ok(None);
        };
        let secrets = sqlx::query(
            "SELECT name, placeholder FROM sandbox_secrets WHERE sandbox_id = $1 ORDER BY name",
        )
        .bind(sandbox_id)
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(|r| Ok((get_str(r, "name")?, get_str(r, "placeholder")?)))
        .collect::<Result<Vec<_>>>()?;
        Ok(Some(SandboxBroker {
            ca_cert: get_str(&row, "broker_ca_cert")?,
            ca_key_sealed: row
                .try_get::<Option<Vec<u8>>, _>("broker_ca_key")?
                .unwrap_or_default(),
            secrets,
            rules: get_opt_str(&row, "network_rules")?,
        }))
    }

    /// The ids of the account's live sandboxes that use its secret `name`
    /// (by a placeholder), or may (they have network rules, which name
    /// secrets): those whose egress changes when it does.
    pub async fn live_sandboxes_using_secret(
        &self,
        account_id: &str,
        name: &str,
    ) -> Result<Vec<String>> {
        let rows = sqlx::query(concat!(
            "SELECT s.id FROM sandboxes s WHERE s.account_id = $1 AND s.status IN ",
            live_statuses!(),
            " AND (s.network_rules IS NOT NULL OR EXISTS (SELECT 1 FROM sandbox_secrets u \
             WHERE u.sandbox_id = s.id AND u.name = $2)) ORDER BY s.id"
        ))
        .bind(account_id)
        .bind(name)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(|r| get_str(r, "id")).collect()
    }

    /// The ids of `host`'s live sandboxes that have a broker: those whose
    /// egress proxies need their values again after this process restarts.
    pub async fn live_brokered_sandboxes(&self, host: &str) -> Result<Vec<String>> {
        let rows = sqlx::query(concat!(
            "SELECT id FROM sandboxes WHERE host = $1 AND broker_ca_cert IS NOT NULL \
             AND status IN ",
            live_statuses!(),
            " ORDER BY id"
        ))
        .bind(host)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(|r| get_str(r, "id")).collect()
    }

    /// Secret `name` of the account was put into a request at `at` (kept
    /// when it is later than the one known).
    pub async fn note_secret_used(
        &self,
        account_id: &str,
        name: &str,
        at: OffsetDateTime,
    ) -> Result<()> {
        let at = format_ts(at);
        sqlx::query(
            "UPDATE secrets SET last_used_at = $3 WHERE account_id = $1 AND name = $2 \
             AND (last_used_at IS NULL OR last_used_at < $3)",
        )
        .bind(account_id)
        .bind(name)
        .bind(&at)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// The ids of the account's running sandboxes with a broker: those
    /// whose egress proxies know when its secrets were last used.
    pub async fn running_brokered_sandboxes(&self, account_id: &str) -> Result<Vec<String>> {
        let rows = sqlx::query(
            "SELECT id FROM sandboxes WHERE account_id = $1 AND broker_ca_cert IS NOT NULL \
             AND status = 'running' ORDER BY id",
        )
        .bind(account_id)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(|r| get_str(r, "id")).collect()
    }
}
