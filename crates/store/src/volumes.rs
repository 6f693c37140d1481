//! Volumes (see migration 0022): an account's named file systems, each a
//! file on one node's disk, and which sandboxes mount them.
//!
//! Every decision that reads and then writes is one write transaction
//! with the volume's row locked (PostgreSQL; SQLite's `BEGIN IMMEDIATE`
//! serialises all writers anyway), so that two of them never pass on the
//! same reading: a create against the account's quota, a mount against
//! another sandbox's read-write hold, a resize or a delete against any
//! hold. A volume is *held* while a live sandbox (see `live_statuses!`)
//! has a row of it in `sandbox_volumes`; rows of ended sandboxes hold
//! nothing.

use crate::error::{Result, StoreError};
use crate::states::live_statuses;
use crate::util::{format_ts, get_i64, get_opt_str, get_opt_ts, get_str, get_ts, now};
use crate::{lock_account, row_lock, Store};
use sqlx::any::AnyRow;
use sqlx::{Any, Transaction};
use time::OffsetDateTime;

/// Where a volume is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VolumeStatus {
    /// Its node is making its file.
    Creating,
    Ready,
    /// Its node is growing its file: no sandbox may take it meanwhile.
    Resizing,
    /// Gone (its row stays as history and for billing).
    Deleted,
}

impl VolumeStatus {
    /// The word stored for it.
    pub fn as_str(self) -> &'static str {
        match self {
            VolumeStatus::Creating => "creating",
            VolumeStatus::Ready => "ready",
            VolumeStatus::Resizing => "resizing",
            VolumeStatus::Deleted => "deleted",
        }
    }

    fn stored(s: &str) -> Result<Self> {
        [
            VolumeStatus::Creating,
            VolumeStatus::Ready,
            VolumeStatus::Resizing,
            VolumeStatus::Deleted,
        ]
        .into_iter()
        .find(|v| v.as_str() == s)
        .ok_or_else(|| StoreError::Corrupt(format!("volume status {s:?}")))
    }
}

/// A volume as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeRow {
    /// `vol_…`.
    pub id: String,
    pub account_id: String,
    pub name: String,
    pub size_bytes: u64,
    /// The node whose disk holds its file.
    pub host: String,
    pub status: VolumeStatus,
    pub created_at: OffsetDateTime,
    pub deleted_at: Option<OffsetDateTime>,
}

/// What [`Store::create_volume`] stores (as `creating`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewVolume {
    pub id: String,
    pub account_id: String,
    pub name: String,
    pub size_bytes: u64,
    pub host: String,
    /// The most volumes (not deleted) the account may have.
    pub max_count: u32,
    /// The most bytes its volumes (not deleted) may have together.
    pub max_bytes: u64,
    /// The create's `Idempotency-Key` and a hash of what it asked.
    pub idempotency: Option<(String, String)>,
}

/// What [`Store::create_volume`] came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VolumeCreated {
    Created(VolumeRow),
    /// An earlier create with the same key and request made this one (as
    /// it is now: still `creating`, or deleted since).
    Replay(VolumeRow),
    /// An earlier create used the key for another request.
    IdempotencyConflict,
    /// The account has a volume of that name (not deleted).
    NameTaken,
    /// The account has `count` volumes already, its limit.
    TooMany {
        count: u32,
        limit: u32,
    },
    /// Its volumes have `used` bytes; this one would take them past `limit`.
    OverBytes {
        used: u64,
        limit: u64,
    },
}

/// A sandbox's mount of a volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeMountRow {
    pub sandbox_id: String,
    pub volume_id: String,
    /// Where the guest mounts it (absolute, normalized).
    pub path: String,
    pub read_only: bool,
}

/// What [`Store::hold_volumes`] came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VolumesHeld {
    /// Every mount recorded.
    Held,
    /// The account has no such volume (or it is deleted): nothing recorded.
    Missing { volume_id: String },
    /// The volume is being made or resized: nothing recorded.
    NotReady {
        volume_id: String,
        status: VolumeStatus,
    },
    /// Live sandbox `sandbox_id` holds the volume read-write: nothing
    /// recorded.
    HeldReadWrite {
        volume_id: String,
        sandbox_id: String,
    },
    /// The host is reading or writing the volume's files until `until`
    /// at the latest (see [`Store::lease_volume`]): nothing recorded.
    Leased {
        volume_id: String,
        until: OffsetDateTime,
    },
}

/// What [`Store::lease_volume`] came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VolumeLeased {
    /// Granted: the volume's row.
    Leased(VolumeRow),
    /// The account has no such volume (not deleted).
    Missing,
    /// It is being made or resized.
    Busy(VolumeStatus),
    /// These live sandboxes (by id) mount it read-write, or for a
    /// writing lease at all.
    Held(Vec<String>),
}

/// What [`Store::begin_volume_resize`] and [`Store::delete_volume`] came
/// to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VolumeChange {
    /// Done: the row as it is now.
    Changed(VolumeRow),
    /// The account has no such volume (not deleted).
    Missing,
    /// Live sandboxes hold it (their ids, by id): nothing changed.
    Held(Vec<String>),
    /// It is being made or resized: nothing changed.
    Busy(VolumeStatus),
    /// The host is reading or writing its files until `until` at the
    /// latest: nothing changed.
    Leased(OffsetDateTime),
    /// The account's volumes have `used` bytes; the new size would take
    /// them past `limit` (resize only).
    OverBytes { used: u64, limit: u64 },
}

const VOLUME_COLUMNS: &str = "id, account_id, name, size_bytes, host, status, created_at, \
                              deleted_at";

fn volume_from(row: &AnyRow) -> Result<VolumeRow> {
    Ok(VolumeRow {
        id: get_str(row, "id")?,
        account_id: get_str(row, "account_id")?,
        name: get_str(row, "name")?,
        size_bytes: get_i64(row, "size_bytes")?.max(0) as u64,
        host: get_str(row, "host")?,
        status: VolumeStatus::stored(&get_str(row, "status")?)?,
        created_at: get_ts(row, "created_at")?,
        deleted_at: get_opt_ts(row, "deleted_at")?,
    })
}

fn bytes_i64(bytes: u64) -> i64 {
    i64::try_from(bytes).unwrap_or(i64::MAX)
}

/// The account's volume `id` (not deleted), its row locked for the rest
/// of transaction `tx`.
async fn locked_volume(
    tx: &mut Transaction<'static, Any>,
    account_id: &str,
    id: &str,
) -> Result<Option<VolumeRow>> {
    let lock = row_lock(tx);
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {VOLUME_COLUMNS} FROM volumes WHERE id = $1 AND account_id = $2 \
         AND status <> 'deleted'{lock}"
    )))
    .bind(id)
    .bind(account_id)
    .fetch_optional(&mut **tx)
    .await?
    .as_ref()
    .map(volume_from)
    .transpose()
}

/// The live sandboxes that hold volume `id` (read-write ones only when
/// `read_write`), other than `except`, by id.
async fn holders_in(
    tx: &mut Transaction<'static, Any>,
    id: &str,
    read_write: bool,
    except: &str,
) -> Result<Vec<String>> {
    let rows = sqlx::query(concat!(
        "SELECT DISTINCT v.sandbox_id AS sandbox_id FROM sandbox_volumes v \
         JOIN sandboxes s ON s.id = v.sandbox_id \
         WHERE v.volume_id = $1 AND v.sandbox_id <> $3 AND ($2 = 0 OR v.read_only = 0) \
         AND s.status IN ",
        live_statuses!(),
        " ORDER BY sandbox_id"
    ))
    .bind(id)
    .bind(i64::from(read_write))
    .bind(except)
    .fetch_all(&mut **tx)
    .await?;
    rows.iter().map(|r| get_str(r, "sandbox_id")).collect()
}

/// Until when the host reads or writes volume `id`'s files, if it does
/// (the latest of its live leases).
async fn leased_in(tx: &mut Transaction<'static, Any>, id: &str) -> Result<Option<OffsetDateTime>> {
    let row = sqlx::query(
        "SELECT MAX(until) AS until FROM volume_leases WHERE volume_id = $1 AND until > $2",
    )
    .bind(id)
    .bind(format_ts(now()))
    .fetch_one(&mut **tx)
    .await?;
    get_opt_ts(&row, "until")
}

/// The number and the bytes of the account's volumes not deleted, other
/// than `except`.
async fn account_volumes_in(
    tx: &mut Transaction<'static, Any>,
    account_id: &str,
    except: &str,
) -> Result<(u64, u64)> {
    let row = sqlx::query(
        "SELECT CAST(COUNT(*) AS BIGINT) AS n, \
         CAST(COALESCE(SUM(size_bytes), 0) AS BIGINT) AS bytes FROM volumes \
         WHERE account_id = $1 AND status <> 'deleted' AND id <> $2",
    )
    .bind(account_id)
    .bind(except)
    .fetch_one(&mut **tx)
    .await?;
    Ok((
        get_i64(&row, "n")?.max(0) as u64,
        get_i64(&row, "bytes")?.max(0) as u64,
    ))
}

impl Store {
    /// Stores a new volume as `creating`, unless its key replays an
    /// earlier create, or the account has one of that name, or as many
    /// volumes or bytes as it may: checked and written in one transaction
    /// under the account's lock, so creates that race never pass the quota
    /// together.
    pub async fn create_volume(&self, new: &NewVolume) -> Result<VolumeCreated> {
        let mut tx = self.write_tx().await?;
        lock_account(&mut tx, &new.account_id).await?;
        if let Some((key, hash)) = &new.idempotency {
            let earlier = sqlx::query(sqlx::AssertSqlSafe(format!(
                "SELECT {VOLUME_COLUMNS}, request_hash FROM volumes \
                 WHERE account_id = $1 AND idempotency_key = $2"
            )))
            .bind(&new.account_id)
            .bind(key)
            .fetch_optional(&mut *tx)
            .await?;
            if let Some(earlier) = earlier {
                let same = get_opt_str(&earlier, "request_hash")?.as_deref() == Some(hash);
                return Ok(match same {
                    true => VolumeCreated::Replay(volume_from(&earlier)?),
                    false => VolumeCreated::IdempotencyConflict,
                });
            }
        }
        let (count, used) = account_volumes_in(&mut tx, &new.account_id, "").await?;
        if count >= u64::from(new.max_count) {
            return Ok(VolumeCreated::TooMany {
                count: u32::try_from(count).unwrap_or(u32::MAX),
                limit: new.max_count,
            });
        }
        if used.saturating_add(new.size_bytes) > new.max_bytes {
            return Ok(VolumeCreated::OverBytes {
                used,
                limit: new.max_bytes,
            });
        }
        let inserted = sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO volumes (id, account_id, name, size_bytes, host, status, created_at, \
             changed_at, idempotency_key, request_hash) \
             VALUES ($1, $2, $3, $4, $5, 'creating', $6, $6, $7, $8) RETURNING {VOLUME_COLUMNS}"
        )))
        .bind(&new.id)
        .bind(&new.account_id)
        .bind(&new.name)
        .bind(bytes_i64(new.size_bytes))
        .bind(&new.host)
        .bind(format_ts(now()))
        .bind(new.idempotency.as_ref().map(|(key, _)| key.clone()))
        .bind(new.idempotency.as_ref().map(|(_, hash)| hash.clone()))
        .fetch_one(&mut *tx)
        .await;
        let row = match inserted {
            Ok(row) => volume_from(&row)?,
            Err(e) => {
                let e = StoreError::from(e);
                if e.is_unique_violation() {
                    return Ok(VolumeCreated::NameTaken);
                }
                return Err(e);
            }
        };
        tx.commit().await?;
        Ok(VolumeCreated::Created(row))
    }

    /// Volume `id`, `creating` or `resizing`, is `ready` (at `size_bytes`
    /// after a resize): its node finished its file. The row as it is now.
    pub async fn volume_ready(&self, id: &str, size_bytes: u64) -> Result<Option<VolumeRow>> {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE volumes SET status = 'ready', size_bytes = $2, changed_at = $3 \
             WHERE id = $1 AND status IN ('creating', 'resizing') RETURNING {VOLUME_COLUMNS}"
        )))
        .bind(id)
        .bind(bytes_i64(size_bytes))
        .bind(format_ts(now()))
        .fetch_optional(&self.pool)
        .await?
        .as_ref()
        .map(volume_from)
        .transpose()
    }

    /// Removes volume `id` whose file could not be made (`creating`): as
    /// if it had never been, its name and key free again and nothing
    /// billed.
    pub async fn forget_volume(&self, id: &str) -> Result<()> {
        sqlx::query("DELETE FROM volumes WHERE id = $1 AND status = 'creating'")
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// The volumes (of every account) `creating` or `resizing` since before
    /// `before`: the process that was making or growing their files is
    /// gone (see the service's sweep).
    pub async fn stuck_volumes(&self, before: OffsetDateTime) -> Result<Vec<VolumeRow>> {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {VOLUME_COLUMNS} FROM volumes WHERE status IN ('creating', 'resizing') \
             AND changed_at < $1 ORDER BY id"
        )))
        .bind(format_ts(before))
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(volume_from)
        .collect()
    }

    /// Volume `id`, whoever's, deleted ones too: what a node's sweep of its
    /// volumes' files asks of each file.
    pub async fn volume_by_id(&self, id: &str) -> Result<Option<VolumeRow>> {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {VOLUME_COLUMNS} FROM volumes WHERE id = $1"
        )))
        .bind(id)
        .fetch_optional(&self.pool)
        .await?
        .as_ref()
        .map(volume_from)
        .transpose()
    }

    /// The account's volume of id `id`, deleted ones too.
    pub async fn volume(&self, account_id: &str, id: &str) -> Result<Option<VolumeRow>> {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {VOLUME_COLUMNS} FROM volumes WHERE account_id = $1 AND id = $2"
        )))
        .bind(account_id)
        .bind(id)
        .fetch_optional(&self.pool)
        .await?
        .as_ref()
        .map(volume_from)
        .transpose()
    }

    /// The account's volume named `name`, not deleted.
    pub async fn volume_named(&self, account_id: &str, name: &str) -> Result<Option<VolumeRow>> {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {VOLUME_COLUMNS} FROM volumes WHERE account_id = $1 AND name = $2 \
             AND status <> 'deleted'"
        )))
        .bind(account_id)
        .bind(name)
        .fetch_optional(&self.pool)
        .await?
        .as_ref()
        .map(volume_from)
        .transpose()
    }

    /// The account's volumes not deleted, by name.
    pub async fn list_volumes(&self, account_id: &str) -> Result<Vec<VolumeRow>> {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {VOLUME_COLUMNS} FROM volumes WHERE account_id = $1 \
             AND status <> 'deleted' ORDER BY name"
        )))
        .bind(account_id)
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(volume_from)
        .collect()
    }

    /// The account's volumes that existed at some time since `since`
    /// (deleted ones too), oldest first: what its usage report bills.
    pub async fn volumes_since(
        &self,
        account_id: &str,
        since: OffsetDateTime,
    ) -> Result<Vec<VolumeRow>> {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {VOLUME_COLUMNS} FROM volumes WHERE account_id = $1 \
             AND (deleted_at IS NULL OR deleted_at >= $2) ORDER BY created_at, id"
        )))
        .bind(account_id)
        .bind(format_ts(since))
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(volume_from)
        .collect()
    }

    /// The live sandboxes' mounts of volume `id`, by sandbox and path.
    pub async fn volume_holders(&self, id: &str) -> Result<Vec<VolumeMountRow>> {
        let rows = sqlx::query(concat!(
            "SELECT v.sandbox_id, v.volume_id, v.path, v.read_only FROM sandbox_volumes v \
             JOIN sandboxes s ON s.id = v.sandbox_id WHERE v.volume_id = $1 AND s.status IN ",
            live_statuses!(),
            " ORDER BY v.sandbox_id, v.path"
        ))
        .bind(id)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(mount_from).collect()
    }

    /// Sandbox `sandbox_id`'s mounts, by path: what the start of its VM
    /// attaches.
    pub async fn sandbox_volume_mounts(&self, sandbox_id: &str) -> Result<Vec<VolumeMountRow>> {
        let rows = sqlx::query(
            "SELECT sandbox_id, volume_id, path, read_only FROM sandbox_volumes \
             WHERE sandbox_id = $1 ORDER BY path",
        )
        .bind(sandbox_id)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(mount_from).collect()
    }

    /// Records sandbox `sandbox_id`'s `mounts` (each a volume of account
    /// `account_id`), all or none: in one transaction that locks each
    /// volume's row first, checks it is ready and, for a read-write mount,
    /// that no other live sandbox holds it read-write. Two sandboxes that
    /// ask for one volume read-write at once take turns on its lock, and
    /// the second sees the first's row.
    pub async fn hold_volumes(
        &self,
        account_id: &str,
        sandbox_id: &str,
        mounts: &[VolumeMountRow],
    ) -> Result<VolumesHeld> {
        let mut tx = self.write_tx().await?;
        // Locked in id order, so two holds of the same volumes never wait
        // for each other.
        let mut ids: Vec<&str> = mounts.iter().map(|m| m.volume_id.as_str()).collect();
        ids.sort_unstable();
        ids.dedup();
        for id in ids {
            let Some(volume) = locked_volume(&mut tx, account_id, id).await? else {
                return Ok(VolumesHeld::Missing {
                    volume_id: id.to_string(),
                });
            };
            if volume.status != VolumeStatus::Ready {
                return Ok(VolumesHeld::NotReady {
                    volume_id: id.to_string(),
                    status: volume.status,
                });
            }
            if let Some(until) = leased_in(&mut tx, id).await? {
                return Ok(VolumesHeld::Leased {
                    volume_id: id.to_string(),
                    until,
                });
            }
            let read_write = mounts.iter().any(|m| m.volume_id == id && !m.read_only);
            if read_write {
                if let Some(by) = holders_in(&mut tx, id, true, sandbox_id)
                    .await?
                    .into_iter()
                    .next()
                {
                    return Ok(VolumesHeld::HeldReadWrite {
                        volume_id: id.to_string(),
                        sandbox_id: by,
                    });
                }
            }
        }
        for m in mounts {
            sqlx::query(
                "INSERT INTO sandbox_volumes (sandbox_id, volume_id, path, read_only) \
                 VALUES ($1, $2, $3, $4)",
            )
            .bind(sandbox_id)
            .bind(&m.volume_id)
            .bind(&m.path)
            .bind(i64::from(m.read_only))
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(VolumesHeld::Held)
    }

    /// Marks the account's volume `id` `resizing` to `size_bytes`, if no
    /// live sandbox holds it and the account's bytes allow (at most
    /// `max_bytes` together): its node then grows the file, and
    /// [`Store::volume_ready`] (or [`Store::volume_resize_failed`]) ends
    /// it. No sandbox can take it meanwhile.
    pub async fn begin_volume_resize(
        &self,
        account_id: &str,
        id: &str,
        size_bytes: u64,
        max_bytes: u64,
    ) -> Result<VolumeChange> {
        let mut tx = self.write_tx().await?;
        lock_account(&mut tx, account_id).await?;
        let Some(volume) = locked_volume(&mut tx, account_id, id).await? else {
            return Ok(VolumeChange::Missing);
        };
        if volume.status != VolumeStatus::Ready {
            return Ok(VolumeChange::Busy(volume.status));
        }
        if let Some(until) = leased_in(&mut tx, id).await? {
            return Ok(VolumeChange::Leased(until));
        }
        let holders = holders_in(&mut tx, id, false, "").await?;
        if !holders.is_empty() {
            return Ok(VolumeChange::Held(holders));
        }
        let (_, others) = account_volumes_in(&mut tx, account_id, id).await?;
        if others.saturating_add(size_bytes) > max_bytes {
            return Ok(VolumeChange::OverBytes {
                used: others.saturating_add(volume.size_bytes),
                limit: max_bytes,
            });
        }
        let row = sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE volumes SET status = 'resizing', changed_at = $2 WHERE id = $1 \
             RETURNING {VOLUME_COLUMNS}"
        )))
        .bind(id)
        .bind(format_ts(now()))
        .fetch_one(&mut *tx)
        .await?;
        let row = volume_from(&row)?;
        tx.commit().await?;
        Ok(VolumeChange::Changed(row))
    }

    /// Volume `id`'s resize failed: `ready` again at its old size.
    pub async fn volume_resize_failed(&self, id: &str) -> Result<()> {
        sqlx::query(
            "UPDATE volumes SET status = 'ready', changed_at = $2 \
             WHERE id = $1 AND status = 'resizing'",
        )
        .bind(id)
        .bind(format_ts(now()))
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Marks the account's volume `id` deleted (its billing ends now, its
    /// name is free), if no live sandbox holds it. Its file is its node's
    /// to remove.
    pub async fn delete_volume(&self, account_id: &str, id: &str) -> Result<VolumeChange> {
        let mut tx = self.write_tx().await?;
        let Some(volume) = locked_volume(&mut tx, account_id, id).await? else {
            return Ok(VolumeChange::Missing);
        };
        if volume.status != VolumeStatus::Ready {
            return Ok(VolumeChange::Busy(volume.status));
        }
        if let Some(until) = leased_in(&mut tx, id).await? {
            return Ok(VolumeChange::Leased(until));
        }
        let holders = holders_in(&mut tx, id, false, "").await?;
        if !holders.is_empty() {
            return Ok(VolumeChange::Held(holders));
        }
        let row = sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE volumes SET status = 'deleted', deleted_at = $2, changed_at = $2 \
             WHERE id = $1 RETURNING {VOLUME_COLUMNS}"
        )))
        .bind(id)
        .bind(format_ts(now()))
        .fetch_one(&mut *tx)
        .await?;
        let row = volume_from(&row)?;
        tx.commit().await?;
        Ok(VolumeChange::Changed(row))
    }
}

impl Store {
    /// Leases the account's volume `id` to the host until `until`, as
    /// `lease_id`, for a call on its files: granted if it is ready and no
    /// live sandbox mounts it read-write (`writing`: mounts it at all).
    /// No sandbox takes the volume while the lease is live, nor is it
    /// resized or deleted (see [`Store::hold_volumes`]). Leases of
    /// volumes that lapsed are forgotten here.
    pub async fn lease_volume(
        &self,
        account_id: &str,
        id: &str,
        lease_id: &str,
        writing: bool,
        until: OffsetDateTime,
    ) -> Result<VolumeLeased> {
        let mut tx = self.write_tx().await?;
        let Some(volume) = locked_volume(&mut tx, account_id, id).await? else {
            return Ok(VolumeLeased::Missing);
        };
        if volume.status != VolumeStatus::Ready {
            return Ok(VolumeLeased::Busy(volume.status));
        }
        let holders = holders_in(&mut tx, id, !writing, "").await?;
        if !holders.is_empty() {
            return Ok(VolumeLeased::Held(holders));
        }
        sqlx::query("DELETE FROM volume_leases WHERE volume_id = $1 AND until <= $2")
            .bind(id)
            .bind(format_ts(now()))
            .execute(&mut *tx)
            .await?;
        sqlx::query(
            "INSERT INTO volume_leases (id, volume_id, writing, until) VALUES ($1, $2, $3, $4)",
        )
        .bind(lease_id)
        .bind(id)
        .bind(i64::from(writing))
        .bind(format_ts(until))
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(VolumeLeased::Leased(volume))
    }

    /// Moves lease `lease_id` on to `until` (a long call renews its lease
    /// as it goes, so that one of a lost process lapses soon). False when
    /// it lapsed or ended already.
    pub async fn renew_volume_lease(&self, lease_id: &str, until: OffsetDateTime) -> Result<bool> {
        let done = sqlx::query("UPDATE volume_leases SET until = $2 WHERE id = $1 AND until > $3")
            .bind(lease_id)
            .bind(format_ts(until))
            .bind(format_ts(now()))
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    /// Records that volume `id`'s file is on node `to` now, not `from`
    /// (`sandpit volume move`), while lease `lease_id` is live: false (and
    /// nothing changed) otherwise, or if the volume is not `ready` on
    /// `from` any more.
    pub async fn move_volume(
        &self,
        id: &str,
        from: &str,
        to: &str,
        lease_id: &str,
    ) -> Result<bool> {
        let done = sqlx::query(
            "UPDATE volumes SET host = $3, changed_at = $5 WHERE id = $1 AND host = $2 \
             AND status = 'ready' AND EXISTS (SELECT 1 FROM volume_leases \
             WHERE id = $4 AND volume_id = $1 AND until > $5)",
        )
        .bind(id)
        .bind(from)
        .bind(to)
        .bind(lease_id)
        .bind(format_ts(now()))
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    /// Ends lease `lease_id` (one lapsed or ended already is fine).
    pub async fn end_volume_lease(&self, lease_id: &str) -> Result<()> {
        sqlx::query("DELETE FROM volume_leases WHERE id = $1")
            .bind(lease_id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }
}

fn mount_from(row: &AnyRow) -> Result<VolumeMountRow> {
    Ok(VolumeMountRow {
        sandbox_id: get_str(row, "sandbox_id")?,
        volume_id: get_str(row, "volume_id")?,
        path: get_str(row, "path")?,
        read_only: get_i64(row, "read_only")? != 0,
    })
}

/// A volume with storage not charged yet ([`Store::unbilled_volumes`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnbilledVolume {
    pub volume: VolumeRow,
    /// Charged up to here (its `created_at` when never).
    pub billed_until: OffsetDateTime,
}

impl Store {
    /// The volumes whose storage is charged up to before `upto` (and
    /// before their delete, once deleted): what the billing sweep charges.
    pub async fn unbilled_volumes(&self, upto: OffsetDateTime) -> Result<Vec<UnbilledVolume>> {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {VOLUME_COLUMNS}, billed_until FROM volumes \
             WHERE status <> 'creating' \
             AND COALESCE(billed_until, created_at) < COALESCE(deleted_at, $1) \
             AND COALESCE(billed_until, created_at) < $1 ORDER BY id"
        )))
        .bind(format_ts(upto))
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(|row| {
            let volume = volume_from(row)?;
            let billed_until = get_opt_ts(row, "billed_until")?.unwrap_or(volume.created_at);
            Ok(UnbilledVolume {
                volume,
                billed_until,
            })
        })
        .collect()
    }

    /// Charges volume `unbilled`'s account `amount_micros` for its storage
    /// up to `to`, saying so in `note`: the ledger's charge and the
    /// volume's `billed_until` in one transaction, which moves it only
    /// from where `unbilled` read it. `false`: another charge (a replica's
    /// sweep) moved it first, and nothing was charged.
    pub async fn charge_volume(
        &self,
        unbilled: &UnbilledVolume,
        to: OffsetDateTime,
        amount_micros: i64,
        note: &str,
    ) -> Result<bool> {
        let mut tx = self.write_tx().await?;
        let moved = sqlx::query(
            "UPDATE volumes SET billed_until = $1 \
             WHERE id = $2 AND COALESCE(billed_until, created_at) = $3",
        )
        .bind(format_ts(to))
        .bind(&unbilled.volume.id)
        .bind(format_ts(unbilled.billed_until))
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if moved != 1 {
            return Ok(false);
        }
        sqlx::query(
            "INSERT INTO ledger (account_id, sandbox_id, kind, amount_micros, note, at) \
             VALUES ($1, NULL, 'charge', $2, $3, $4)",
        )
        .bind(&unbilled.volume.account_id)
        .bind(-amount_micros.abs())
        .bind(note)
        .bind(format_ts(now()))
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(true)
    }
}
