//! Snapshots: the rows that say which saved states of sandboxes exist,
//! whose they are, where their files are and until when they are kept.
//!
//! A snapshot's files live on the host that took it (`host`); the row is
//! the only record the API reads. Its life: `creating` while the host
//! writes it (counted against the account's quota from the start, so two
//! snapshots taken at once cannot both slip under it), `ready` once it can
//! be started from, `deleted` once its files are gone or going (deleted by
//! its owner, expired, or failed). The row stays, as history and so that a
//! sandbox started from it still names where it came from.

use crate::error::{Result, StoreError};
use crate::util::{format_ts, get_i64, get_opt_str, get_opt_ts, get_str, get_ts, now};
use crate::{lock_account, Store};
use sqlx::any::AnyRow;
use time::OffsetDateTime;

/// Where a snapshot is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SnapshotStatus {
    Creating,
    Ready,
    Deleted,
}

impl SnapshotStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            SnapshotStatus::Creating => "creating",
            SnapshotStatus::Ready => "ready",
            SnapshotStatus::Deleted => "deleted",
        }
    }

    fn stored(s: &str) -> Result<SnapshotStatus> {
        match s {
            "creating" => Ok(SnapshotStatus::Creating),
            "ready" => Ok(SnapshotStatus::Ready),
            "deleted" => Ok(SnapshotStatus::Deleted),
            other => Err(StoreError::Corrupt(format!(
                "unknown snapshot status {other:?}"
            ))),
        }
    }
}

/// A snapshot as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotRow {
    pub id: String,
    pub account_id: String,
    pub name: Option<String>,
    /// The sandbox it was taken of.
    pub sandbox_id: String,
    /// That sandbox's size: a sandbox started from it has the same.
    pub size: String,
    /// The host whose disk holds its files.
    pub host: String,
    pub status: SnapshotStatus,
    /// What its files alone take on that disk (0 until `ready`).
    pub bytes: u64,
    pub created_at: OffsetDateTime,
    pub expires_at: OffsetDateTime,
    pub deleted_at: Option<OffsetDateTime>,
}

/// Input of [`Store::create_snapshot`]: the row plus the quota to hold it
/// to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewSnapshot {
    pub id: String,
    pub account_id: String,
    pub name: Option<String>,
    pub sandbox_id: String,
    pub size: String,
    pub host: String,
    pub expires_at: OffsetDateTime,
    /// How many snapshots (creating or ready) the account may hold.
    pub max_count: u32,
    /// How many bytes its ready snapshots may take together: at it, no
    /// new one.
    pub max_bytes: u64,
    /// `(Idempotency-Key, hash of the request)`.
    pub idempotency: Option<(String, String)>,
}

/// What [`Store::create_snapshot`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SnapshotOutcome {
    /// A new row, `creating`.
    Created(SnapshotRow),
    /// The key was used before with the same request: that snapshot.
    Replay(SnapshotRow),
    /// The key was used before with another request.
    IdempotencyConflict,
    /// The account holds `count` snapshots taking `bytes`, at its quota.
    OverQuota {
        count: u32,
        bytes: u64,
        max_count: u32,
        max_bytes: u64,
    },
}

/// A page of snapshots, newest first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotPage {
    pub data: Vec<SnapshotRow>,
    pub has_more: bool,
}

fn snapshot_from(row: &AnyRow) -> Result<SnapshotRow> {
    Ok(SnapshotRow {
        id: get_str(row, "id")?,
        account_id: get_str(row, "account_id")?,
        name: get_opt_str(row, "name")?,
        sandbox_id: get_str(row, "sandbox_id")?,
        size: get_str(row, "size")?,
        host: get_str(row, "host")?,
        status: SnapshotStatus::stored(&get_str(row, "status")?)?,
        bytes: get_i64(row, "bytes")?.max(0) as u64,
        created_at: get_ts(row, "created_at")?,
        expires_at: get_ts(row, "expires_at")?,
        deleted_at: get_opt_ts(row, "deleted_at")?,
    })
}

impl Store {
    /// Records a new snapshot as `creating`, unless the key replays an
    /// earlier one or the account is at its quota. Under the account's
    /// lock, so concurrent snapshots count each other.
    pub async fn create_snapshot(&self, new: NewSnapshot) -> Result<SnapshotOutcome> {
        let mut tx = self.write_tx().await?;
        lock_account(&mut tx, &new.account_id).await?;
        if let Some((key, hash)) = &new.idempotency {
            let earlier = sqlx::query(
                "SELECT * FROM snapshots WHERE account_id = $1 AND idempotency_key = $2",
            )
            .bind(&new.account_id)
            .bind(key)
            .fetch_optional(&mut *tx)
            .await?;
            if let Some(earlier) = earlier {
                let same = get_opt_str(&earlier, "request_hash")?.as_deref() == Some(hash);
                return Ok(match same {
                    true => SnapshotOutcome::Replay(snapshot_from(&earlier)?),
                    false => SnapshotOutcome::IdempotencyConflict,
                });
            }
        }
        let held = sqlx::query(
            "SELECT CAST(COUNT(*) AS BIGINT) AS n, CAST(COALESCE(SUM(bytes), 0) AS BIGINT) AS b \
             FROM snapshots WHERE account_id = $1 AND status <> 'deleted'",
        )
        .bind(&new.account_id)
        .fetch_one(&mut *tx)
        .await?;
        let count = get_i64(&held, "n")?.max(0) as u32;
        let bytes = get_i64(&held, "b")?.max(0) as u64;
        if count >= new.max_count || bytes >= new.max_bytes {
            return Ok(SnapshotOutcome::OverQuota {
                count,
                bytes,
                max_count: new.max_count,
                max_bytes: new.max_bytes,
            });
        }
        let (key, hash) = new.idempotency.clone().unzip();
        let row = sqlx::query(
            "INSERT INTO snapshots (id, account_id, name, sandbox_id, size, host, status, bytes, \
               created_at, expires_at, idempotency_key, request_hash) \
             VALUES ($1, $2, $3, $4, $5, $6, 'creating', 0, $7, $8, $9, $10) RETURNING *",
        )
        .bind(&new.id)
        .bind(&new.account_id)
        .bind(&new.name)
        .bind(&new.sandbox_id)
        .bind(&new.size)
        .bind(&new.host)
        .bind(format_ts(now()))
        .bind(format_ts(new.expires_at))
        .bind(key)
        .bind(hash)
        .fetch_one(&mut *tx)
        .await?;
        let row = snapshot_from(&row)?;
        tx.commit().await?;
        Ok(SnapshotOutcome::Created(row))
    }

    /// A `creating` snapshot is `ready`, taking `bytes`, and its sandbox's
    /// log tells it (`sandbox.snapshotted`, if the sandbox is live), in one
    /// transaction. `None` if it is not `creating` any more (deleted while
    /// it was written).
    pub async fn snapshot_ready(
        &self,
        id: &str,
        bytes: u64,
        cause: &crate::Cause,
    ) -> Result<Option<SnapshotRow>> {
        let mut tx = self.write_tx().await?;
        let row = sqlx::query(
            "UPDATE snapshots SET status = 'ready', bytes = $2 \
             WHERE id = $1 AND status = 'creating' RETURNING *",
        )
        .bind(id)
        .bind(i64::try_from(bytes).unwrap_or(i64::MAX))
        .fetch_optional(&mut *tx)
        .await?;
        let Some(snap) = row.as_ref().map(snapshot_from).transpose()? else {
            return Ok(None);
        };
        if let Some(sandbox) = crate::sandboxes::sandbox_in(&mut tx, &snap.sandbox_id).await? {
            if sandbox.is_live() {
                let cause = cause.clone().with("snapshot_id", snap.id.as_str());
                crate::events::insert_event(
                    &mut tx,
                    &sandbox.id,
                    &sandbox.account_id,
                    sandbox.status,
                    "sandbox.snapshotted",
                    None,
                    &cause,
                    now(),
                )
                .await?;
            }
        }
        tx.commit().await?;
        Ok(Some(snap))
    }

    /// Marks a snapshot `deleted` (its files are to go); the row as it was
    /// before, or `None` if it was deleted already.
    pub async fn delete_snapshot(&self, id: &str) -> Result<Option<SnapshotRow>> {
        let mut tx = self.write_tx().await?;
        let sql = format!(
            "SELECT * FROM snapshots WHERE id = $1 AND status <> 'deleted'{}",
            crate::row_lock(&tx)
        );
        let before = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(id)
            .fetch_optional(&mut *tx)
            .await?;
        let Some(before) = before.as_ref().map(snapshot_from).transpose()? else {
            return Ok(None);
        };
        sqlx::query("UPDATE snapshots SET status = 'deleted', deleted_at = $2 WHERE id = $1")
            .bind(id)
            .bind(format_ts(now()))
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(Some(before))
    }

    /// A snapshot by id, in any status.
    pub async fn snapshot(&self, id: &str) -> Result<Option<SnapshotRow>> {
        let row = sqlx::query("SELECT * FROM snapshots WHERE id = $1")
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(snapshot_from).transpose()
    }

    /// A snapshot of `account_id` that is not deleted: another account's,
    /// or a deleted one, is `None`, exactly like a missing one.
    pub async fn snapshot_of(&self, account_id: &str, id: &str) -> Result<Option<SnapshotRow>> {
        let row = sqlx::query(
            "SELECT * FROM snapshots WHERE id = $1 AND account_id = $2 AND status <> 'deleted'",
        )
        .bind(id)
        .bind(account_id)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(snapshot_from).transpose()
    }

    /// A page of an account's snapshots that are not deleted, newest first
    /// (equal `created_at` by id, descending); `starting_after` is the last
    /// id of the previous page ([`StoreError::NotFound`] if it is not one of
    /// the account's).
    pub async fn list_snapshots(
        &self,
        account_id: &str,
        limit: u32,
        starting_after: Option<&str>,
    ) -> Result<SnapshotPage> {
        let cursor = match starting_after {
            None => None,
            Some(c) => {
                let at: Option<String> = sqlx::query_scalar(
                    "SELECT created_at FROM snapshots WHERE id = $1 AND account_id = $2",
                )
                .bind(c)
                .bind(account_id)
                .fetch_optional(&self.pool)
                .await?;
                Some((
                    at.ok_or_else(|| StoreError::NotFound(format!("snapshot {c}")))?,
                    c,
                ))
            }
        };
        let (c_at, c_id) = cursor.unzip();
        let rows = sqlx::query(
            "SELECT * FROM snapshots WHERE account_id = $1 AND status <> 'deleted' \
               AND ($2 IS NULL OR created_at < $2 OR (created_at = $2 AND id < $3)) \
             ORDER BY created_at DESC, id DESC LIMIT $4",
        )
        .bind(account_id)
        .bind(c_at)
        .bind(c_id)
        .bind(i64::from(limit.max(1)) + 1)
        .fetch_all(&self.pool)
        .await?;
        let mut data = rows.iter().map(snapshot_from).collect::<Result<Vec<_>>>()?;
        let has_more = data.len() > limit.max(1) as usize;
        data.truncate(limit.max(1) as usize);
        Ok(SnapshotPage { data, has_more })
    }

    /// The snapshots on `host` that are not deleted (what its disk should
    /// hold).
    pub async fn snapshots_on(&self, host: &str) -> Result<Vec<SnapshotRow>> {
        let rows = sqlx::query("SELECT * FROM snapshots WHERE host = $1 AND status <> 'deleted'")
            .bind(host)
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(snapshot_from).collect()
    }

    /// The snapshots on `host` whose `expires_at` has passed and that are
    /// not deleted.
    pub async fn expired_snapshots(
        &self,
        host: &str,
        now: OffsetDateTime,
    ) -> Result<Vec<SnapshotRow>> {
        let rows = sqlx::query(
            "SELECT * FROM snapshots WHERE host = $1 AND status <> 'deleted' \
               AND expires_at <= $2",
        )
        .bind(host)
        .bind(format_ts(now))
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(snapshot_from).collect()
    }

    /// When the next snapshot on `host` expires.
    pub async fn next_snapshot_expiry(&self, host: &str) -> Result<Option<OffsetDateTime>> {
        let at: Option<String> = sqlx::query_scalar(
            "SELECT MIN(expires_at) FROM snapshots WHERE host = $1 AND status <> 'deleted'",
        )
        .bind(host)
        .fetch_one(&self.pool)
        .await?;
        at.as_deref().map(crate::util::parse_ts).transpose()
    }
}
