//! Secrets (see migration 0020): an account's credentials by name, and
//! what a sandbox that uses them keeps (its CA, a placeholder for each).
//!
//! The store holds values and the CA's key only as the service sealed
//! them: it never sees one in clear, and a value never leaves here except
//! to the service that unseals it for a VM's egress proxy. A listing
//! carries no value at all ([`SecretRow`]); only [`Store::secrets_named`]
//! reads them, for the sandboxes that use them.

use crate::error::{Result, StoreError};
use crate::states::live_statuses;
use crate::util::{format_ts, get_opt_ts, get_str, get_ts, now};
use crate::Store;
use sqlx::any::AnyRow;
use sqlx::Row;
use time::OffsetDateTime;

/// A secret as listed: everything but its value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SecretRow {
    pub account_id: String,
    /// The guest's environment variable.
    pub name: String,
    /// Host name rules it may be sent to.
    pub hosts: Vec<String>,
    /// The request header it goes in.
    pub header: String,
    /// That header's value, `{value}` standing for the secret's.
    pub format: String,
    pub created_at: OffsetDateTime,
    /// The last put.
    pub updated_at: OffsetDateTime,
    /// Not kept yet: always `None`.
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
}

/// The columns of a [`SecretRow`].
const SECRET_COLUMNS: &str = "account_id, name, hosts, header, format, created_at, updated_at, \
                              last_used_at";

fn secret_from(row: &AnyRow) -> Result<SecretRow> {
    let hosts = get_str(row, "hosts")?;
    Ok(SecretRow {
        account_id: get_str(row, "account_id")?,
        name: get_str(row, "name")?,
        hosts: serde_json::from_str(&hosts)
            .map_err(|e| StoreError::Corrupt(format!("a secret's hosts {hosts:?}: {e}")))?,
        header: get_str(row, "header")?,
        format: get_str(row, "format")?,
        created_at: get_ts(row, "created_at")?,
        updated_at: get_ts(row, "updated_at")?,
        last_used_at: get_opt_ts(row, "last_used_at")?,
    })
}

impl Store {
    /// Stores `secret`, replacing the account's secret of that name if it
    /// has one (whose `created_at` is kept): the row as stored.
    pub async fn put_secret(&self, secret: &NewSecret) -> Result<SecretRow> {
        let at = format_ts(now());
        let row = sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO secrets (account_id, name, hosts, header, format, sealed_value, \
             created_at, updated_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $7) \
             ON CONFLICT (account_id, name) DO UPDATE SET hosts = excluded.hosts, \
             header = excluded.header, format = excluded.format, \
             sealed_value = excluded.sealed_value, updated_at = excluded.updated_at \
             RETURNING {SECRET_COLUMNS}"
        )))
        .bind(&secret.account_id)
        .bind(&secret.name)
        .bind(serde_json::to_string(&secret.hosts).expect("strings serialize"))
        .bind(&secret.header)
        .bind(&secret.format)
        .bind(secret.sealed_value.clone())
        .bind(at)
        .fetch_one(&self.pool)
        .await?;
        secret_from(&row)
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

    /// Gives sandbox `sandbox_id` its broker: its CA, and a placeholder for
    /// each secret it uses (`(name, placeholder)`), in one transaction. A
    /// fork's is its origin's, read with [`Store::sandbox_broker`] and given
    /// here (its CA's key sealed anew for it).
    pub async fn set_sandbox_broker(&self, sandbox_id: &str, broker: &SandboxBroker) -> Result<()> {
        let mut tx = self.write_tx().await?;
        let done = sqlx::query(
            "UPDATE sandboxes SET broker_ca_cert = $2, broker_ca_key = $3 WHERE id = $1",
        )
        .bind(sandbox_id)
        .bind(&broker.ca_cert)
        .bind(broker.ca_key_sealed.clone())
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
            "SELECT broker_ca_cert, broker_ca_key FROM sandboxes \
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
        }))
    }

    /// The ids of the account's live sandboxes that use its secret `name`:
    /// those whose egress changes when it does.
    pub async fn live_sandboxes_using_secret(
        &self,
        account_id: &str,
        name: &str,
    ) -> Result<Vec<String>> {
        let rows = sqlx::query(concat!(
            "SELECT s.id FROM sandboxes s JOIN sandbox_secrets u ON u.sandbox_id = s.id \
             WHERE s.account_id = $1 AND u.name = $2 AND s.status IN ",
            live_statuses!(),
            " ORDER BY s.id"
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
}
