//! Sandboxes: creation with its reservation (`create`), status changes,
//! the lifetime's changes (`lifetime`: extend, shorten, pause, resume), the
//! end with its settlement, listing, expiry and usage.

use crate::accounts::balance_in;
use crate::error::{Result, StoreError};
use crate::events::{event_from, insert_event, kind_of, Cause, EventRow, EVENT_COLUMNS};
use crate::states::{live_statuses, SandboxStatus};
use crate::util::{
    format_ts, get_i64, get_opt_i64, get_opt_str, get_opt_ts, get_str, get_ts, get_u32, now,
    parse_ts,
};
use crate::{lock_account, row_lock, Store};
use sha2::Digest;
use sqlx::any::AnyRow;
use sqlx::{Any, Row, Transaction};
use time::OffsetDateTime;

mod create;
mod lifetime;

pub(crate) use create::install_create_function;

/// A sandbox as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxRow {
    pub id: String,
    pub account_id: String,
    pub name: Option<String>,
    pub size: String,
    pub vcpus: u32,
    pub memory_mb: u32,
    pub disk_gb: u32,
    pub timeout_minutes: u32,
    pub status: SandboxStatus,
    /// The price it was created at (a later price change does not apply).
    pub price_micros_per_hour: i64,
    /// Which host runs (ran) its VM.
    pub host: String,
    pub created_at: OffsetDateTime,
    pub ready_at: Option<OffsetDateTime>,
    pub expires_at: OffsetDateTime,
    pub deleted_at: Option<OffsetDateTime>,
    /// `destroyed`, `expired`, `failed: <cause>`, as the caller said.
    pub deleted_reason: Option<String>,
    /// What its disk takes on its host, as last measured
    /// ([`Store::set_disk_use`]).
    pub disk_used_bytes: u64,
    /// The snapshot it was started from (`None`: the image).
    pub snapshot_id: Option<String>,
    /// Since when it is paused (its status then is `Paused`).
    pub paused_at: Option<OffsetDateTime>,
    /// Seconds it spent paused before `paused_at` (billed at the paused
    /// rate).
    pub paused_seconds: u64,
    /// See [`NewSandbox::metadata`].
    pub metadata: std::collections::BTreeMap<String, String>,
    pub env: std::collections::BTreeMap<String, String>,
    pub access_token: Option<String>,
    /// See [`NewSandbox::every_port_public`].
    pub every_port_public: bool,
    /// See [`NewSandbox::internet_access`].
    pub internet_access: Option<bool>,
    /// See [`NewSandbox::network`].
    pub network: Option<String>,
    /// Every port of it needs the traffic token (see migration 0019; set
    /// after the create by [`Store::set_private_traffic`]).
    pub private_traffic: bool,
    /// See [`NewSandbox::template_id`].
    pub template_id: Option<String>,
    /// See [`NewSandbox::workdir`].
    pub workdir: Option<String>,
    /// Being moved to this node (see [`Store::begin_move`]), by a member
    /// that holds the move until `moving_until`.
    pub moving_to: Option<String>,
    pub moving_until: Option<OffsetDateTime>,
}

impl SandboxRow {
    /// Whether a move of it is under way at `now` (one whose holder was
    /// lost lapses; see [`Store::lapsed_moves`]).
    pub fn is_moving(&self, now: OffsetDateTime) -> bool {
        self.moving_until.is_some_and(|until| until > now)
    }

    /// Seconds it has been paused in all, up to `until`.
    pub fn paused_seconds_until(&self, until: OffsetDateTime) -> u64 {
        let now = self
            .paused_at
            .map(|at| (until - at).whole_seconds().max(0) as u64)
            .unwrap_or(0);
        self.paused_seconds + now
    }

    /// Whether it still holds (or is about to hold) a VM and a reservation.
    pub fn is_live(&self) -> bool {
        self.status.is_live()
    }
}

/// Input of [`Store::create_sandbox`]: the sandbox's fields plus what the
/// creation must check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewSandbox {
    /// Chosen by the caller, e.g. [`crate::new_id`]`("sbx")`.
    pub id: String,
    pub account_id: String,
    pub name: Option<String>,
    pub size: String,
    pub vcpus: u32,
    pub memory_mb: u32,
    pub disk_gb: u32,
    pub timeout_minutes: u32,
    pub price_micros_per_hour: i64,
    pub host: String,
    pub created_at: OffsetDateTime,
    pub expires_at: OffsetDateTime,
    /// What to hold back from the balance (the cost of the whole timeout).
    pub reserve_micros: i64,
    /// The live-sandbox limit to enforce; `None` means the account's own
    /// `max_concurrent`.
    pub max_concurrent: Option<u32>,
    /// What the account's live sandboxes' disks may take together (as last
    /// measured, see [`Store::set_disk_use`]); at it, no new sandbox.
    pub disk_limit_bytes: Option<u64>,
    /// `(Idempotency-Key, hash of the request body)`, if the request had a key.
    pub idempotency: Option<(String, String)>,
    /// E2B's metadata, the environment of every command, and the data
    /// plane's token (see migration 0013); empty and `None` elsewhere.
    pub metadata: std::collections::BTreeMap<String, String>,
    pub env: std::collections::BTreeMap<String, String>,
    pub access_token: Option<String>,
    /// Every port is reached through the preview URL without being exposed
    /// (E2B's sandboxes, see migration 0014); `false`: only exposed ports.
    pub every_port_public: bool,
    /// Whether its guest may reach the network beyond itself, as its
    /// creator said (see migration 0015): `Some(false)` nothing, `None` not
    /// said (the operator's network, as `Some(true)`).
    pub internet_access: Option<bool>,
    /// Its own egress lists, as the service's JSON (see migration 0018);
    /// `None`: none.
    pub network: Option<String>,
    /// The template build it starts from (see migration 0016), and the
    /// working directory its commands get by default (the template's
    /// `WORKDIR`; `None`: `/workspace`).
    pub template_id: Option<String>,
    pub workdir: Option<String>,
    /// On a shared database: the epoch `host` must be `up` at, within its
    /// lease (see [`Store::register_node`]), and it must have room (its
    /// `max_sandboxes`), checked in the create's transaction under the
    /// node's row lock, so a node that was declared lost (whose sandboxes
    /// were settled) adds none, and two creates never both take its last
    /// place.
    pub host_epoch: Option<i64>,
    /// The snapshot it starts from (`None`: the image).
    pub snapshot_id: Option<String>,
    /// How its VM is to start (`pool`, `snapshot`, `template`, `cold`),
    /// which its `started` event tells.
    pub start_from: Option<String>,
    /// Who creates it, and what its `created` event carries.
    pub cause: Cause,
}

/// What [`Store::create_sandbox`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CreateOutcome {
    /// A new sandbox, status `provisioning`, its reservation made.
    Created(SandboxRow),
    /// The idempotency key was used before with the same request: the
    /// sandbox that request created (in whatever state it is now). Nothing
    /// was reserved.
    Replay(SandboxRow),
    /// The idempotency key was used before with a different request.
    IdempotencyConflict,
    /// The balance does not cover the reservation.
    InsufficientCredits { balance: i64, needed: i64 },
    /// The account already has `limit` live sandboxes.
    TooManySandboxes { live: u32, limit: u32 },
    /// The account's live sandboxes' disks take `used` bytes, at or over
    /// its `limit`.
    OverDiskLimit { used: u64, limit: u64 },
    /// `host` is not `up` at `host_epoch` within its lease: it was declared
    /// lost, started again elsewhere, or is silent now.
    HostUnavailable,
    /// `host` already holds `limit` live sandboxes, its most.
    HostFull { live: u32, limit: u32 },
    /// A sandbox with this id exists: another create took the same warm
    /// VM (a node's published pool is read by every control plane).
    /// Nothing was written; retry under another id.
    IdTaken,
}

/// What [`Store::extend_sandbox`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExtendOutcome {
    /// The new expiry and timeout are stored and the extra reserved.
    Extended(SandboxRow),
    /// The balance does not cover the extra reservation.
    InsufficientCredits { balance: i64, needed: i64 },
    /// The sandbox is not `provisioning` or `running` (it is being deleted
    /// or has ended): the row as it is.
    NotLive(SandboxRow),
}

/// A page of [`Store::list_sandboxes`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxPage {
    /// Newest first.
    pub data: Vec<SandboxRow>,
    /// More rows follow the last one; pass its id as `starting_after`.
    pub has_more: bool,
}

/// A sandbox in a usage report, with what has been charged for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageRow {
    pub sandbox: SandboxRow,
    /// Sum of its `charge` rows, as a positive number. 0 while it is live
    /// (the caller computes the running cost from `created_at` and the
    /// price).
    pub charged_micros: i64,
    /// Bytes clients sent to it through its preview URLs.
    pub preview_bytes_in: i64,
    /// Bytes it sent back through its preview URLs.
    pub preview_bytes_out: i64,
}

pub(crate) fn sandbox_from(row: &AnyRow) -> Result<SandboxRow> {
    Ok(SandboxRow {
        id: get_str(row, "id")?,
        account_id: get_str(row, "account_id")?,
        name: get_opt_str(row, "name")?,
        size: get_str(row, "size")?,
        vcpus: get_u32(row, "vcpus")?,
        memory_mb: get_u32(row, "memory_mb")?,
        disk_gb: get_u32(row, "disk_gb")?,
        timeout_minutes: get_u32(row, "timeout_minutes")?,
        status: match (
            SandboxStatus::stored(&get_str(row, "status")?)?,
            get_opt_str(row, "paused_at")?,
        ) {
            (SandboxStatus::Running, Some(_)) => SandboxStatus::Paused,
            (status, _) => status,
        },
        price_micros_per_hour: get_i64(row, "price_micros_per_hour")?,
        host: get_str(row, "host")?,
        created_at: get_ts(row, "created_at")?,
        ready_at: get_opt_ts(row, "ready_at")?,
        expires_at: get_ts(row, "expires_at")?,
        deleted_at: get_opt_ts(row, "deleted_at")?,
        deleted_reason: get_opt_str(row, "deleted_reason")?,
        disk_used_bytes: get_i64(row, "disk_used_bytes")?.max(0) as u64,
        snapshot_id: get_opt_str(row, "snapshot_id")?,
        paused_at: get_opt_ts(row, "paused_at")?,
        paused_seconds: get_i64(row, "paused_seconds")?.max(0) as u64,
        metadata: get_json_map(row, "metadata")?,
        env: get_json_map(row, "env")?,
        access_token: get_opt_str(row, "access_token")?,
        every_port_public: get_i64(row, "every_port_public")? != 0,
        internet_access: get_opt_i64(row, "internet_access")?.map(|v| v != 0),
        network: get_opt_str(row, "network")?,
        private_traffic: get_i64(row, "private_traffic")? != 0,
        template_id: get_opt_str(row, "template_id")?,
        workdir: get_opt_str(row, "workdir")?,
        moving_to: get_opt_str(row, "moving_to")?,
        moving_until: get_opt_ts(row, "moving_until")?,
    })
}

/// A JSON object of strings stored as text (NULL: empty).
fn get_json_map(row: &AnyRow, column: &str) -> Result<std::collections::BTreeMap<String, String>> {
    match get_opt_str(row, column)? {
        None => Ok(Default::default()),
        Some(text) => serde_json::from_str(&text)
            .map_err(|e| crate::StoreError::Corrupt(format!("sandbox {column}: {e}"))),
    }
}

/// The text [`get_json_map`] reads: NULL for an empty map.
pub(crate) fn json_map_text(map: &std::collections::BTreeMap<String, String>) -> Option<String> {
    (!map.is_empty()).then(|| serde_json::to_string(map).expect("a map of strings serializes"))
}

/// The sandbox, read under its row lock (see [`crate::row_lock`]).
pub(crate) async fn sandbox_in(
    tx: &mut Transaction<'static, Any>,
    id: &str,
) -> Result<Option<SandboxRow>> {
    let sql = format!("SELECT * FROM sandboxes WHERE id = $1{}", row_lock(tx));
    sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(id)
        .fetch_optional(&mut **tx)
        .await?
        .as_ref()
        .map(sandbox_from)
        .transpose()
}

/// What [`Store::set_status`] does with a row that is not live or already
/// has the status: the row itself if nothing is to change, the refusal if
/// it ended; `None` if the change is to be made.
fn unchanged(row: SandboxRow, new_status: SandboxStatus) -> Result<Option<SandboxRow>> {
    if !row.is_live() {
        return Err(StoreError::Conflict(format!(
            "sandbox {} is {}, it cannot become {new_status}",
            row.id, row.status
        )));
    }
    Ok((row.status == new_status).then_some(row))
}

/// Ends a live sandbox inside a write transaction that holds its row lock
/// (see [`Store::finish_sandbox`]); `None` if it had already ended.
pub(crate) async fn finish_in(
    tx: &mut Transaction<'static, Any>,
    row: &SandboxRow,
    end_status: SandboxStatus,
    reason: &str,
    ended_at: OffsetDateTime,
    charge_micros: i64,
    cause: &Cause,
) -> Result<Option<SandboxRow>> {
    if !row.is_live() {
        return Ok(None);
    }
    let id = row.id.as_str();
    let (reserved, released, charged): (i64, i64, i64) = sqlx::query_as(
        "SELECT \
             CAST(COALESCE(SUM(CASE WHEN kind = 'reserve' THEN -amount_micros ELSE 0 END), 0) AS BIGINT), \
             CAST(COALESCE(SUM(CASE WHEN kind = 'release' THEN amount_micros ELSE 0 END), 0) AS BIGINT), \
             CAST(COALESCE(SUM(CASE WHEN kind = 'charge' THEN -amount_micros ELSE 0 END), 0) AS BIGINT) \
         FROM ledger WHERE sandbox_id = $1",
    )
    .bind(id)
    .fetch_one(&mut **tx)
    .await?;
    let release = (reserved - released).max(0);
    let charge = charge_micros.clamp(0, (reserved - released - charged).max(0));
    if release > 0 {
        insert_ledger(
            tx,
            &row.account_id,
            id,
            "release",
            release,
            Some(reason),
            ended_at,
        )
        .await?;
    }
    if charge > 0 {
        insert_ledger(
            tx,
            &row.account_id,
            id,
            "charge",
            -charge,
            Some(reason),
            ended_at,
        )
        .await?;
    }
    let updated = sqlx::query(
        "UPDATE sandboxes SET status = $2, deleted_at = $3, deleted_reason = $4 \
         WHERE id = $1 RETURNING *",
    )
    .bind(id)
    .bind(end_status.as_str())
    .bind(format_ts(ended_at))
    .bind(reason)
    .fetch_one(&mut **tx)
    .await?;
    let updated = sandbox_from(&updated)?;
    insert_event(
        tx,
        id,
        &row.account_id,
        end_status,
        kind_of(end_status, Some(reason)),
        Some(reason),
        cause,
        ended_at,
    )
    .await?;
    sqlx::query("UPDATE ports SET closed_at = $2 WHERE sandbox_id = $1 AND closed_at IS NULL")
        .bind(id)
        .bind(format_ts(ended_at))
        .execute(&mut **tx)
        .await?;
    Ok(Some(updated))
}

impl Store {
    /// Moves a live sandbox to another live status (`provisioning`,
    /// `running`, `deleting`) and records the event; sets `ready_at` the
    /// first time it becomes `running`. Setting the status it already has
    /// changes nothing and records nothing.
    ///
    /// An ended sandbox is never revived: that is [`StoreError::Conflict`]
    /// (e.g. the VM came up after the sandbox expired). Ending is
    /// [`Store::finish_sandbox`]'s job, since it settles the money.
    pub async fn set_status(
        &self,
        id: &str,
        new_status: SandboxStatus,
        reason: Option<&str>,
        cause: &Cause,
    ) -> Result<SandboxRow> {
        if !new_status.is_live() || new_status == SandboxStatus::Paused {
            return Err(StoreError::Invalid(format!(
                "set_status takes a stored live status, not {new_status} (use finish_sandbox, \
                 pause_sandbox)"
            )));
        }
        if self.engine == crate::Engine::Postgres {
            return self.set_status_at_once(id, new_status, reason, cause).await;
        }
        let mut tx = self.write_tx().await?;
        let row = sandbox_in(&mut tx, id)
            .await?
            .ok_or_else(|| StoreError::NotFound(format!("sandbox {id}")))?;
        if let Some(same) = unchanged(row, new_status)? {
            return Ok(same);
        }
        let at = now();
        let updated = sqlx::query(
            "UPDATE sandboxes SET status = $2, \
                 ready_at = CASE WHEN $2 = 'running' AND ready_at IS NULL THEN $3 ELSE ready_at END \
             WHERE id = $1 RETURNING *",
        )
        .bind(id)
        .bind(new_status.as_str())
        .bind(format_ts(at))
        .fetch_one(&mut *tx)
        .await?;
        let kind = kind_of(new_status, reason);
        let cause = with_start_from(cause, kind, &updated)?;
        let updated = sandbox_from(&updated)?;
        insert_event(
            &mut tx,
            id,
            &updated.account_id,
            new_status,
            kind,
            reason,
            &cause,
            at,
        )
        .await?;
        tx.commit().await?;
        Ok(updated)
    }

    /// [`Store::set_status`] on PostgreSQL: the change and its event in one
    /// statement (one round trip, its own transaction), whose `UPDATE`
    /// takes the row lock and sees the row as the last writer left it.
    async fn set_status_at_once(
        &self,
        id: &str,
        new_status: SandboxStatus,
        reason: Option<&str>,
        cause: &Cause,
    ) -> Result<SandboxRow> {
        let sql = format!(
            concat!(
                "WITH u AS (UPDATE sandboxes SET status = $2, \
                       ready_at = CASE WHEN $2 = 'running' AND ready_at IS NULL THEN $3 \
                                  ELSE ready_at END \
                     WHERE id = $1 AND status IN ",
                live_statuses!(),
                " \
                       AND status <> $2 \
                     RETURNING *), \
                 e AS (INSERT INTO {events} \
                       SELECT id, account_id, $2, $5, $6, $4, {detail}, $3 FROM u) \
                 SELECT * FROM u"
            ),
            events = EVENT_COLUMNS,
            detail = START_FROM_DETAIL,
        );
        let updated = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(id)
            .bind(new_status.as_str())
            .bind(format_ts(now()))
            .bind(reason)
            .bind(kind_of(new_status, reason))
            .bind(&cause.actor)
            .bind(cause.detail_text())
            .fetch_optional(&self.pool)
            .await?;
        if let Some(updated) = updated {
            return sandbox_from(&updated);
        }
        // Not changed: it has that status already, has ended, or is not there.
        let row = self
            .sandbox(id)
            .await?
            .ok_or_else(|| StoreError::NotFound(format!("sandbox {id}")))?;
        unchanged(row, new_status)?.ok_or_else(|| {
            StoreError::Conflict(format!("sandbox {id} changed while it became {new_status}"))
        })
    }

    /// Records that the VM of sandbox `id` runs on `host`: `provisioning`
    /// there becomes `running` (`ready_at` set, its event recorded). `None`,
    /// with nothing changed, when the sandbox is not `provisioning` on
    /// `host` (not there, placed elsewhere, ended, or running already). On
    /// PostgreSQL one statement, so a node's start costs one round trip.
    pub async fn record_start(
        &self,
        id: &str,
        host: &str,
        cause: &Cause,
    ) -> Result<Option<SandboxRow>> {
        let at = now();
        if self.engine == crate::Engine::Postgres {
            let sql = format!(
                "WITH u AS (UPDATE sandboxes SET status = 'running', ready_at = $3 \
                     WHERE id = $1 AND host = $2 AND status = 'provisioning' RETURNING *), \
                 e AS (INSERT INTO {EVENT_COLUMNS} \
                       SELECT id, account_id, 'running', $5, $6, $4, {START_FROM_DETAIL}, $3 \
                       FROM u) \
                 SELECT * FROM u"
            );
            let updated = sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(id)
                .bind(host)
                .bind(format_ts(at))
                .bind(Option::<String>::None)
                .bind("sandbox.started")
                .bind(&cause.actor)
                .bind(cause.detail_text())
                .fetch_optional(&self.pool)
                .await?;
            return updated.as_ref().map(sandbox_from).transpose();
        }
        let mut tx = self.write_tx().await?;
        let updated = sqlx::query(
            "UPDATE sandboxes SET status = 'running', ready_at = $3 \
             WHERE id = $1 AND host = $2 AND status = 'provisioning' RETURNING *",
        )
        .bind(id)
        .bind(host)
        .bind(format_ts(at))
        .fetch_optional(&mut *tx)
        .await?;
        let Some(updated) = updated else {
            return Ok(None);
        };
        let cause = with_start_from(cause, "sandbox.started", &updated)?;
        let updated = sandbox_from(&updated)?;
        insert_event(
            &mut tx,
            id,
            &updated.account_id,
            SandboxStatus::Running,
            "sandbox.started",
            None,
            &cause,
            at,
        )
        .await?;
        tx.commit().await?;
        Ok(Some(updated))
    }

    /// Ends a live sandbox as `deleted` or `failed` and settles its money,
    /// atomically: releases what is still reserved for it (`release` row,
    /// +), charges `charge_micros` (`charge` row, −) but never more than was
    /// reserved — so the balance cannot go negative — sets `status`,
    /// `deleted_at` = `ended_at`, `deleted_reason` = `reason`, records the
    /// event and closes its open ports.
    ///
    /// `None` if the sandbox had already ended: nothing is changed, so
    /// calling this twice never charges twice. An unknown id is
    /// [`StoreError::NotFound`].
    pub async fn finish_sandbox(
        &self,
        id: &str,
        end_status: SandboxStatus,
        reason: &str,
        ended_at: OffsetDateTime,
        charge_micros: i64,
        cause: &Cause,
    ) -> Result<Option<SandboxRow>> {
        if !end_status.is_ended() {
            return Err(StoreError::Invalid(format!(
                "finish_sandbox ends as deleted or failed, not {end_status}"
            )));
        }
        let mut tx = self.write_tx().await?;
        let Some(row) = sandbox_in(&mut tx, id).await? else {
            return Err(StoreError::NotFound(format!("sandbox {id}")));
        };
        let updated = finish_in(
            &mut tx,
            &row,
            end_status,
            reason,
            ended_at,
            charge_micros,
            cause,
        )
        .await?;
        tx.commit().await?;
        Ok(updated)
    }

    /// The sandbox with this id, of any account (compare `account_id`, or
    /// use [`Store::sandbox_of`]).
    pub async fn sandbox(&self, id: &str) -> Result<Option<SandboxRow>> {
        sqlx::query("SELECT * FROM sandboxes WHERE id = $1")
            .bind(id)
            .fetch_optional(&self.pool)
            .await?
            .as_ref()
            .map(sandbox_from)
            .transpose()
    }

    /// The sandbox an earlier create of `account_id` with Idempotency-Key
    /// `key` made, and that create's request hash.
    pub async fn created_with_key(
        &self,
        account_id: &str,
        key: &str,
    ) -> Result<Option<(String, SandboxRow)>> {
        let Some(seen) = sqlx::query(
            "SELECT request_hash, sandbox_id FROM idempotency WHERE account_id = $1 AND key = $2",
        )
        .bind(account_id)
        .bind(key)
        .fetch_optional(&self.pool)
        .await?
        else {
            return Ok(None);
        };
        let (hash, id) = (
            get_str(&seen, "request_hash")?,
            get_str(&seen, "sandbox_id")?,
        );
        let row = self
            .sandbox(&id)
            .await?
            .ok_or_else(|| StoreError::Corrupt(format!("idempotency row names missing {id}")))?;
        Ok(Some((hash, row)))
    }

    /// The sandbox with this id if it belongs to `account_id`.
    pub async fn sandbox_of(&self, account_id: &str, id: &str) -> Result<Option<SandboxRow>> {
        sqlx::query("SELECT * FROM sandboxes WHERE id = $1 AND account_id = $2")
            .bind(id)
            .bind(account_id)
            .fetch_optional(&self.pool)
            .await?
            .as_ref()
            .map(sandbox_from)
            .transpose()
    }

    /// A page of an account's sandboxes, newest first (equal `created_at`
    /// ordered by id, descending). `starting_after` is the id of the last
    /// sandbox of the previous page; it must be a sandbox of this account
    /// ([`StoreError::NotFound`] otherwise), in any status. Without
    /// `include_deleted` only live sandboxes are listed.
    pub async fn list_sandboxes(
        &self,
        account_id: &str,
        limit: u32,
        starting_after: Option<&str>,
        include_deleted: bool,
    ) -> Result<SandboxPage> {
        if limit == 0 {
            return Err(StoreError::Invalid("limit must be at least 1".into()));
        }
        let cursor = match starting_after {
            None => None,
            Some(c) => {
                let at: Option<String> = sqlx::query_scalar(
                    "SELECT created_at FROM sandboxes WHERE id = $1 AND account_id = $2",
                )
                .bind(c)
                .bind(account_id)
                .fetch_optional(&self.pool)
                .await?;
                Some((
                    at.ok_or_else(|| StoreError::NotFound(format!("sandbox {c}")))?,
                    c,
                ))
            }
        };
        let (c_at, c_id) = match &cursor {
            Some((at, id)) => (Some(at.as_str()), Some(*id)),
            None => (None, None),
        };
        let rows = sqlx::query(concat!(
            "SELECT * FROM sandboxes WHERE account_id = $1 \
               AND ($2 = 1 OR status IN ",
            live_statuses!(),
            ") \
               AND ($3 IS NULL OR created_at < $3 OR (created_at = $3 AND id < $4)) \
             ORDER BY created_at DESC, id DESC LIMIT $5"
        ))
        .bind(account_id)
        .bind(i64::from(include_deleted))
        .bind(c_at)
        .bind(c_id)
        .bind(i64::from(limit) + 1)
        .fetch_all(&self.pool)
        .await?;
        let mut data = rows.iter().map(sandbox_from).collect::<Result<Vec<_>>>()?;
        let has_more = data.len() > limit as usize;
        data.truncate(limit as usize);
        Ok(SandboxPage { data, has_more })
    }

    /// Every live sandbox of every account on `host`, oldest first: what
    /// that host should be running (for reconciliation after a restart).
    /// Sandboxes of other hosts sharing the database are theirs.
    pub async fn live_sandboxes(&self, host: &str) -> Result<Vec<SandboxRow>> {
        sqlx::query(concat!(
            "SELECT * FROM sandboxes WHERE status IN ",
            live_statuses!(),
            " \
               AND host = $1 ORDER BY created_at, id"
        ))
        .bind(host)
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(sandbox_from)
        .collect()
    }

    /// Every live sandbox that has a data-plane token, of every account and
    /// host, as (id, account id, token): for a request that names no
    /// sandbox but proves it knows one's token (E2B's signed file URLs carry
    /// a signature made with it, and no sandbox id).
    pub async fn live_sandbox_tokens(&self) -> Result<Vec<(String, String, String)>> {
        sqlx::query(concat!(
            "SELECT id, account_id, access_token FROM sandboxes WHERE status IN ",
            live_statuses!(),
            " AND access_token IS NOT NULL ORDER BY id"
        ))
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(|row| {
            Ok((
                get_str(row, "id")?,
                get_str(row, "account_id")?,
                get_str(row, "access_token")?,
            ))
        })
        .collect()
    }

    /// Live sandboxes on `host` whose `expires_at` ≤ `now`, soonest first.
    pub async fn expired_sandboxes(
        &self,
        host: &str,
        now: OffsetDateTime,
    ) -> Result<Vec<SandboxRow>> {
        sqlx::query(concat!(
            "SELECT * FROM sandboxes WHERE status IN ",
            live_statuses!(),
            " \
               AND expires_at <= $1 AND host = $2 ORDER BY expires_at, id"
        ))
        .bind(format_ts(now))
        .bind(host)
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(sandbox_from)
        .collect()
    }

    /// The earliest `expires_at` of any live sandbox: when the expiry
    /// sweeper next has work.
    pub async fn next_expiry(&self, host: &str) -> Result<Option<OffsetDateTime>> {
        let at: Option<String> = sqlx::query_scalar(concat!(
            "SELECT MIN(expires_at) FROM sandboxes \
             WHERE status IN ",
            live_statuses!(),
            " AND host = $1"
        ))
        .bind(host)
        .fetch_one(&self.pool)
        .await?;
        at.as_deref().map(parse_ts).transpose()
    }

    /// A sandbox's status history, oldest first.
    pub async fn events(&self, sandbox_id: &str) -> Result<Vec<EventRow>> {
        sqlx::query(
            "SELECT e.*, s.size FROM sandbox_events e JOIN sandboxes s ON s.id = e.sandbox_id \
             WHERE e.sandbox_id = $1 ORDER BY e.id",
        )
        .bind(sandbox_id)
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(event_from)
        .collect()
    }

    /// The account's sandboxes created at or after `since`, or alive at or
    /// after it (live, or ended at/after it), newest first, each with what
    /// has been charged for it.
    pub async fn usage(&self, account_id: &str, since: OffsetDateTime) -> Result<Vec<UsageRow>> {
        let rows = sqlx::query(
            "SELECT s.*, CAST(COALESCE((SELECT -SUM(l.amount_micros) FROM ledger l \
                                   WHERE l.sandbox_id = s.id AND l.kind = 'charge'), 0) AS BIGINT) \
                         AS charged_micros \
             FROM sandboxes s WHERE s.account_id = $1 \
               AND (s.created_at >= $2 OR s.deleted_at IS NULL OR s.deleted_at >= $2) \
             ORDER BY s.created_at DESC, s.id DESC",
        )
        .bind(account_id)
        .bind(format_ts(since))
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| {
                Ok(UsageRow {
                    sandbox: sandbox_from(r)?,
                    charged_micros: get_i64(r, "charged_micros")?,
                    preview_bytes_in: get_i64(r, "preview_bytes_in")?,
                    preview_bytes_out: get_i64(r, "preview_bytes_out")?,
                })
            })
            .collect()
    }

    /// Record what each sandbox's disk takes now (`(sandbox id, bytes)`),
    /// in one transaction. Sandboxes that ended keep their last figure.
    /// Replaces a live sandbox's egress: whether it may reach the network
    /// at all, and its own lists (see migration 0018). `false` when no live
    /// sandbox has that id.
    pub async fn set_sandbox_network(
        &self,
        id: &str,
        internet_access: Option<bool>,
        network: Option<&str>,
    ) -> Result<bool> {
        let done = sqlx::query(concat!(
            "UPDATE sandboxes SET internet_access = $2, network = $3 \
             WHERE id = $1 AND status IN ",
            live_statuses!()
        ))
        .bind(id)
        .bind(internet_access.map(i64::from))
        .bind(network)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() > 0)
    }

    /// Replaces a live sandbox's network rules (see migration 0021; `None`:
    /// none). `false` when no live sandbox has that id.
    pub async fn set_sandbox_rules(&self, id: &str, rules: Option<&str>) -> Result<bool> {
        let done = sqlx::query(concat!(
            "UPDATE sandboxes SET network_rules = $2 WHERE id = $1 AND status IN ",
            live_statuses!()
        ))
        .bind(id)
        .bind(rules)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() > 0)
    }

    /// Makes every port of live sandbox `id` private (or not): see
    /// migration 0019. `false` when no live sandbox has that id.
    pub async fn set_private_traffic(&self, id: &str, private: bool) -> Result<bool> {
        let done = sqlx::query(concat!(
            "UPDATE sandboxes SET private_traffic = $2 WHERE id = $1 AND status IN ",
            live_statuses!()
        ))
        .bind(id)
        .bind(i64::from(private))
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() > 0)
    }

    pub async fn set_disk_use(&self, uses: &[(String, u64)]) -> Result<()> {
        if uses.is_empty() {
            return Ok(());
        }
        let mut tx = self.write_tx().await?;
        for (id, bytes) in uses {
            sqlx::query(concat!(
                "UPDATE sandboxes SET disk_used_bytes = $2 \
                 WHERE id = $1 AND status IN ",
                live_statuses!()
            ))
            .bind(id)
            .bind(i64::try_from(*bytes).unwrap_or(i64::MAX))
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// What the account's live sandboxes' disks take together, as last
    /// measured.
    pub async fn account_disk_use(&self, account_id: &str) -> Result<u64> {
        let total: i64 = sqlx::query_scalar(concat!(
            "SELECT CAST(COALESCE(SUM(disk_used_bytes), 0) AS BIGINT) FROM sandboxes \
             WHERE account_id = $1 AND status IN ",
            live_statuses!()
        ))
        .bind(account_id)
        .fetch_one(&self.pool)
        .await?;
        Ok(total.max(0) as u64)
    }

    /// Adds preview traffic to a sandbox's counters.
    pub async fn add_preview_traffic(
        &self,
        sandbox_id: &str,
        bytes_in: u64,
        bytes_out: u64,
    ) -> Result<()> {
        sqlx::query(
            "UPDATE sandboxes SET preview_bytes_in = preview_bytes_in + $2, \
                                  preview_bytes_out = preview_bytes_out + $3 \
             WHERE id = $1",
        )
        .bind(sandbox_id)
        .bind(bytes_in as i64)
        .bind(bytes_out as i64)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Marks sandbox `id`'s VM as being replaced until `until`, or clears
    /// the mark (`None`), for every replica to see (migration 0012).
    pub async fn mark_vm_replacing(&self, id: &str, until: Option<OffsetDateTime>) -> Result<()> {
        sqlx::query("UPDATE sandboxes SET vm_replacing_until = $2 WHERE id = $1")
            .bind(id)
            .bind(until.map(format_ts))
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Whether sandbox `id`'s VM is marked as being replaced at `now`.
    pub async fn vm_replacing(&self, id: &str, now: OffsetDateTime) -> Result<bool> {
        let until: Option<Option<String>> =
            sqlx::query_scalar("SELECT vm_replacing_until FROM sandboxes WHERE id = $1")
                .bind(id)
                .fetch_optional(&self.pool)
                .await?;
        match until.flatten() {
            Some(until) => Ok(crate::util::parse_ts(&until)? > now),
            None => Ok(false),
        }
    }

    /// Forgets the idempotency key that names sandbox `id`, so a retry with
    /// it creates anew: for a sandbox that failed before it was ever handed
    /// out (its create answered an error, which says "retry").
    pub async fn forget_idempotency_of(&self, id: &str) -> Result<()> {
        sqlx::query("DELETE FROM idempotency WHERE sandbox_id = $1")
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Forgets idempotency keys recorded before `before` (keys are meant
    /// for retries within hours, not forever). Returns how many went.
    pub async fn purge_idempotency(&self, before: OffsetDateTime) -> Result<u64> {
        Ok(sqlx::query("DELETE FROM idempotency WHERE created_at < $1")
            .bind(format_ts(before))
            .execute(&self.pool)
            .await?
            .rows_affected())
    }
}

/// A `started` event's detail on PostgreSQL, in SQL over the updated row
/// `u` and the statement's `$5` (kind) and `$7` (the cause's detail): how
/// its VM started (`sandboxes.start_from`, one of a few plain words).
const START_FROM_DETAIL: &str = "CASE WHEN $5 = 'sandbox.started' AND start_from IS NOT NULL \
     THEN '{\"from\":\"' || start_from || '\"}' ELSE $7 END";

/// The cause of a `started` event with how its VM started (the updated
/// row's `start_from`); any other event's cause as it is.
fn with_start_from(cause: &Cause, kind: &str, updated: &AnyRow) -> Result<Cause> {
    let mut cause = cause.clone();
    if kind == "sandbox.started" {
        if let Some(from) = get_opt_str(updated, "start_from")? {
            cause.detail.insert("from".into(), from.into());
        }
    }
    Ok(cause)
}

async fn insert_ledger(
    tx: &mut Transaction<'static, Any>,
    account_id: &str,
    sandbox_id: &str,
    kind: &str,
    amount: i64,
    note: Option<&str>,
    at: OffsetDateTime,
) -> Result<()> {
    sqlx::query(
        "INSERT INTO ledger (account_id, sandbox_id, kind, amount_micros, note, at) \
         VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind(account_id)
    .bind(sandbox_id)
    .bind(kind)
    .bind(amount)
    .bind(note)
    .bind(format_ts(at))
    .execute(&mut **tx)
    .await?;
    Ok(())
}
