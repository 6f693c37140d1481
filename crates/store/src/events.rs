//! The account's log of what happened to its sandboxes, and the webhooks it
//! is POSTed to.
//!
//! * **An event is written in the transaction of the change it records**
//!   (`insert_event`, and the same columns in the PostgreSQL statements that
//!   change a sandbox in one round trip), so no event is lost or invented
//!   across crashes, replicas and node loss.
//! * **The log is read in `seq` order**, given to committed rows by one
//!   sequencer at a time ([`Store::sequence_events`]): a reader paging with
//!   a cursor never passes a row that commits later (identity values are
//!   taken when a row is written, not when it commits).
//! * **Deliveries are an outbox**: a trigger (migration 0025) writes one row
//!   per matching webhook in the event's own transaction. Workers on every
//!   replica take due rows with a lease ([`Store::claim_deliveries`]), none
//!   while an earlier event of the same sandbox waits for the same webhook,
//!   so each webhook gets a sandbox's events in order, at least once.

use crate::error::{Result, StoreError};
use crate::states::SandboxStatus;
use crate::util::{format_ts, get_i64, get_opt_i64, get_opt_str, get_str, get_ts, parse_ts};
use crate::{Engine, Store};
use sqlx::any::AnyRow;
use sqlx::{Any, Transaction};
use time::OffsetDateTime;

/// Who caused a change, and what its event carries besides.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Cause {
    /// `key sp_…`, `dashboard`, `the expiry`, `replica <name>`…
    pub actor: String,
    /// The event's `detail`: a JSON object.
    pub detail: serde_json::Map<String, serde_json::Value>,
}

impl Cause {
    pub fn by(actor: impl Into<String>) -> Self {
        Cause {
            actor: actor.into(),
            detail: Default::default(),
        }
    }

    /// With `key` set to `value` in its detail.
    pub fn with(mut self, key: &str, value: impl Into<serde_json::Value>) -> Self {
        self.detail.insert(key.to_string(), value.into());
        self
    }

    /// Its detail as stored: `NULL` when empty.
    pub(crate) fn detail_text(&self) -> Option<String> {
        (!self.detail.is_empty())
            .then(|| serde_json::Value::Object(self.detail.clone()).to_string())
    }
}

/// One event, as the account's log holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventRow {
    pub id: i64,
    /// Its place in the account's log; `None` until the sequencer gives it
    /// one ([`Store::sequence_events`]).
    pub seq: Option<i64>,
    pub sandbox_id: String,
    pub account_id: Option<String>,
    /// The sandbox's status right after it (`paused` for a pause).
    pub status: SandboxStatus,
    /// `sandbox.created`, `sandbox.started`…
    pub kind: String,
    pub actor: String,
    pub reason: Option<String>,
    pub detail: serde_json::Map<String, serde_json::Value>,
    pub at: OffsetDateTime,
    /// The sandbox's size (read with it).
    pub size: String,
}

pub(crate) fn event_from(row: &AnyRow) -> Result<EventRow> {
    let detail = match get_opt_str(row, "detail")? {
        None => Default::default(),
        Some(text) => serde_json::from_str(&text)
            .map_err(|e| StoreError::Corrupt(format!("event detail: {e}")))?,
    };
    Ok(EventRow {
        id: get_i64(row, "id")?,
        seq: get_opt_i64(row, "seq")?,
        sandbox_id: get_str(row, "sandbox_id")?,
        account_id: get_opt_str(row, "account_id")?,
        status: SandboxStatus::stored(&get_str(row, "status")?)?,
        kind: get_opt_str(row, "kind")?.unwrap_or_else(|| "sandbox.noted".into()),
        actor: get_opt_str(row, "actor")?.unwrap_or_default(),
        reason: get_opt_str(row, "reason")?,
        detail,
        at: get_ts(row, "at")?,
        size: get_opt_str(row, "size")?.unwrap_or_default(),
    })
}

/// The kind of event that a status change to `status` for `reason` is.
pub(crate) fn kind_of(status: SandboxStatus, reason: Option<&str>) -> &'static str {
    match (status, reason) {
        (SandboxStatus::Provisioning, _) => "sandbox.created",
        (SandboxStatus::Running, _) => "sandbox.started",
        (SandboxStatus::Paused, _) => "sandbox.paused",
        (SandboxStatus::Deleting, _) => "sandbox.destroying",
        (SandboxStatus::Failed, _) => "sandbox.failed",
        (SandboxStatus::Deleted, Some("expired")) => "sandbox.expired",
        (SandboxStatus::Deleted, _) => "sandbox.killed",
    }
}

/// The columns every event insert names, in this order.
pub(crate) const EVENT_COLUMNS: &str =
    "sandbox_events (sandbox_id, account_id, status, kind, actor, reason, detail, at)";

/// Writes an event of sandbox `sandbox_id` (of `account_id`) in `tx`, which
/// makes the change it records.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn insert_event(
    tx: &mut Transaction<'static, Any>,
    sandbox_id: &str,
    account_id: &str,
    status: SandboxStatus,
    kind: &str,
    reason: Option<&str>,
    cause: &Cause,
    at: OffsetDateTime,
) -> Result<()> {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {EVENT_COLUMNS} VALUES ($1, $2, $3, $4, $5, $6, $7, $8)"
    )))
    .bind(sandbox_id)
    .bind(account_id)
    .bind(status.as_str())
    .bind(kind)
    .bind(&cause.actor)
    .bind(reason)
    .bind(cause.detail_text())
    .bind(format_ts(at))
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// A webhook as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WebhookRow {
    pub id: String,
    pub account_id: String,
    pub url: String,
    /// Empty: every type.
    pub events: Vec<String>,
    pub description: Option<String>,
    pub secret: String,
    pub created_at: OffsetDateTime,
    pub deleted_at: Option<OffsetDateTime>,
    /// Its deliveries by status (pending, delivered, failed).
    pub counts: [u64; 3],
}

fn webhook_from(row: &AnyRow) -> Result<WebhookRow> {
    let events = get_str(row, "events")?;
    let count = |c: &str| -> Result<u64> { Ok(get_opt_i64(row, c)?.unwrap_or(0).max(0) as u64) };
    Ok(WebhookRow {
        id: get_str(row, "id")?,
        account_id: get_str(row, "account_id")?,
        url: get_str(row, "url")?,
        events: match events.as_str() {
            "*" => Vec::new(),
            list => list
                .split(',')
                .filter(|t| !t.is_empty())
                .map(String::from)
                .collect(),
        },
        description: get_opt_str(row, "description")?,
        secret: get_str(row, "secret")?,
        created_at: get_ts(row, "created_at")?,
        deleted_at: crate::util::get_opt_ts(row, "deleted_at")?,
        counts: [count("pending")?, count("delivered")?, count("failed")?],
    })
}

/// The webhook's columns with its delivery counts.
const WEBHOOK_SELECT: &str = "SELECT w.*, \
     (SELECT CAST(COUNT(*) AS BIGINT) FROM webhook_deliveries d \
        WHERE d.webhook_id = w.id AND d.status = 'pending') AS pending, \
     (SELECT CAST(COUNT(*) AS BIGINT) FROM webhook_deliveries d \
        WHERE d.webhook_id = w.id AND d.status = 'delivered') AS delivered, \
     (SELECT CAST(COUNT(*) AS BIGINT) FROM webhook_deliveries d \
        WHERE d.webhook_id = w.id AND d.status = 'failed') AS failed \
   FROM webhooks w";

/// How a delivery stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeliveryStatus {
    Pending,
    Delivered,
    Failed,
}

impl DeliveryStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            DeliveryStatus::Pending => "pending",
            DeliveryStatus::Delivered => "delivered",
            DeliveryStatus::Failed => "failed",
        }
    }

    fn stored(s: &str) -> Result<Self> {
        [Self::Pending, Self::Delivered, Self::Failed]
            .into_iter()
            .find(|d| d.as_str() == s)
            .ok_or_else(|| StoreError::Corrupt(format!("delivery status {s:?}")))
    }
}

/// One event's delivery to one webhook.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeliveryRow {
    pub webhook_id: String,
    pub event_id: i64,
    pub sandbox_id: String,
    pub status: DeliveryStatus,
    /// Attempts since it was (re)queued.
    pub attempts: u32,
    pub next_attempt_at: OffsetDateTime,
    pub created_at: OffsetDateTime,
    pub delivered_at: Option<OffsetDateTime>,
    /// The event's type.
    pub kind: String,
}

fn delivery_from(row: &AnyRow) -> Result<DeliveryRow> {
    Ok(DeliveryRow {
        webhook_id: get_str(row, "webhook_id")?,
        event_id: get_i64(row, "event_id")?,
        sandbox_id: get_str(row, "sandbox_id")?,
        status: DeliveryStatus::stored(&get_str(row, "status")?)?,
        attempts: get_i64(row, "attempts")?.clamp(0, u32::MAX as i64) as u32,
        next_attempt_at: get_ts(row, "next_attempt_at")?,
        created_at: get_ts(row, "created_at")?,
        delivered_at: crate::util::get_opt_ts(row, "delivered_at")?,
        kind: get_opt_str(row, "kind")?.unwrap_or_default(),
    })
}

/// One POST of a delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttemptRow {
    pub n: u32,
    pub at: OffsetDateTime,
    pub status_code: Option<u16>,
    pub error: Option<String>,
    pub duration_ms: u64,
}

/// A delivery a worker took ([`Store::claim_deliveries`]): what to POST
/// where, and the lease it holds until it records the attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DueDelivery {
    pub webhook_id: String,
    pub url: String,
    pub secret: String,
    pub event: EventRow,
    /// Attempts before this one since it was (re)queued.
    pub attempts: u32,
    /// The lease's end as written: the worker's proof it still holds it.
    pub lease_until: String,
}

/// What an attempt came to ([`Store::record_attempt`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttemptOutcome {
    Delivered,
    /// Not delivered: tried again at this time.
    RetryAt(OffsetDateTime),
    /// Not delivered, and no more tries.
    GaveUp,
}

impl Store {
    /// Gives the log's order (`seq`) to every committed event that has none,
    /// in the order of their ids, one sequencer at a time (PostgreSQL: an
    /// advisory lock held to its commit; SQLite: the write lock). A row that
    /// commits after this ran gets a larger `seq` from the next run, so a
    /// reader that pages by `seq` never passes one. Called before every read
    /// of the log; cheap when nothing waits (a partial index).
    pub async fn sequence_events(&self) -> Result<u64> {
        let mut tx = self.write_tx().await?;
        if self.engine == Engine::Postgres {
            sqlx::query("SELECT CAST(pg_advisory_xact_lock(7320551130146547) AS TEXT)")
                .execute(&mut *tx)
                .await?;
        }
        // SQLite has one writer at a time, so its rows commit in the order
        // of their ids.
        let sql = match self.engine {
            Engine::Sqlite => "UPDATE sandbox_events SET seq = id WHERE seq IS NULL",
            Engine::Postgres => {
                "UPDATE sandbox_events e SET seq = n.top + n.rank \
                 FROM (SELECT id, ROW_NUMBER() OVER (ORDER BY id) AS rank, \
                         (SELECT COALESCE(MAX(seq), 0) FROM sandbox_events) AS top \
                       FROM sandbox_events WHERE seq IS NULL) n \
                 WHERE e.id = n.id"
            }
        };
        let done = sqlx::query(sql).execute(&mut *tx).await?.rows_affected();
        tx.commit().await?;
        Ok(done)
    }

    /// The account's events (or one sandbox's) with `seq` > `after`, in
    /// order, at most `limit`, each with its sandbox's size. Runs the
    /// sequencer first.
    pub async fn account_events(
        &self,
        account_id: &str,
        after: i64,
        limit: u32,
        sandbox_id: Option<&str>,
    ) -> Result<Vec<EventRow>> {
        self.sequence_events().await?;
        sqlx::query(
            "SELECT e.*, s.size FROM sandbox_events e JOIN sandboxes s ON s.id = e.sandbox_id \
             WHERE e.account_id = $1 AND e.seq > $2 AND ($3 IS NULL OR e.sandbox_id = $3) \
             ORDER BY e.seq LIMIT $4",
        )
        .bind(account_id)
        .bind(after)
        .bind(sandbox_id)
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(event_from)
        .collect()
    }

    /// Forgets events written before `before`, with their deliveries and
    /// attempts. Returns how many events went.
    pub async fn purge_events(&self, before: OffsetDateTime) -> Result<u64> {
        let before = format_ts(before);
        let mut tx = self.write_tx().await?;
        for table in ["webhook_attempts", "webhook_deliveries"] {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "DELETE FROM {table} WHERE event_id IN \
                   (SELECT id FROM sandbox_events WHERE at < $1)"
            )))
            .bind(&before)
            .execute(&mut *tx)
            .await?;
        }
        let gone = sqlx::query("DELETE FROM sandbox_events WHERE at < $1")
            .bind(&before)
            .execute(&mut *tx)
            .await?
            .rows_affected();
        tx.commit().await?;
        Ok(gone)
    }

    /// Adds to a live sandbox's log something that happened to it without
    /// changing its status (a snapshot, a restore, a fork, a full host disk
    /// that stopped its VM), under the status it has now, with its row
    /// locked so it keeps its place among the sandbox's events. Returns
    /// whether the sandbox was live (nothing is added to an ended one's).
    pub async fn record_event(
        &self,
        sandbox_id: &str,
        kind: &str,
        reason: Option<&str>,
        cause: &Cause,
    ) -> Result<bool> {
        let mut tx = self.write_tx().await?;
        let Some(row) = crate::sandboxes::sandbox_in(&mut tx, sandbox_id).await? else {
            return Ok(false);
        };
        if !row.is_live() {
            return Ok(false);
        }
        insert_event(
            &mut tx,
            sandbox_id,
            &row.account_id,
            row.status,
            kind,
            reason,
            cause,
            crate::util::now(),
        )
        .await?;
        tx.commit().await?;
        Ok(true)
    }

    /// Registers a webhook (`events` empty: every type).
    pub async fn create_webhook(
        &self,
        id: &str,
        account_id: &str,
        url: &str,
        events: &[String],
        description: Option<&str>,
        secret: &str,
    ) -> Result<WebhookRow> {
        let events = match events.is_empty() {
            true => "*".to_string(),
            false => format!(",{},", events.join(",")),
        };
        sqlx::query(
            "INSERT INTO webhooks (id, account_id, url, events, description, secret, created_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7)",
        )
        .bind(id)
        .bind(account_id)
        .bind(url)
        .bind(events)
        .bind(description)
        .bind(secret)
        .bind(format_ts(crate::util::now()))
        .execute(&self.pool)
        .await?;
        self.webhook_of(account_id, id)
            .await?
            .ok_or_else(|| StoreError::Corrupt(format!("webhook {id} vanished")))
    }

    /// The account's webhook `id`, unless deleted.
    pub async fn webhook_of(&self, account_id: &str, id: &str) -> Result<Option<WebhookRow>> {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "{WEBHOOK_SELECT} WHERE w.id = $1 AND w.account_id = $2 AND w.deleted_at IS NULL"
        )))
        .bind(id)
        .bind(account_id)
        .fetch_optional(&self.pool)
        .await?
        .as_ref()
        .map(webhook_from)
        .transpose()
    }

    /// The account's webhooks, oldest first.
    pub async fn webhooks(&self, account_id: &str) -> Result<Vec<WebhookRow>> {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "{WEBHOOK_SELECT} WHERE w.account_id = $1 AND w.deleted_at IS NULL \
             ORDER BY w.created_at, w.id"
        )))
        .bind(account_id)
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(webhook_from)
        .collect()
    }

    /// Deletes the account's webhook `id`: no event is queued for it any
    /// more and its pending deliveries are dropped (the others are kept
    /// with it). The webhook as it was, or `None`.
    pub async fn delete_webhook(&self, account_id: &str, id: &str) -> Result<Option<WebhookRow>> {
        let Some(before) = self.webhook_of(account_id, id).await? else {
            return Ok(None);
        };
        let mut tx = self.write_tx().await?;
        let done = sqlx::query(
            "UPDATE webhooks SET deleted_at = $3 \
             WHERE id = $1 AND account_id = $2 AND deleted_at IS NULL",
        )
        .bind(id)
        .bind(account_id)
        .bind(format_ts(crate::util::now()))
        .execute(&mut *tx)
        .await?;
        sqlx::query("DELETE FROM webhook_deliveries WHERE webhook_id = $1 AND status = 'pending'")
            .bind(id)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok((done.rows_affected() > 0).then_some(before))
    }

    /// Takes up to `limit` deliveries whose time has come and whose lease
    /// (if any) has lapsed, none while an earlier event of the same sandbox
    /// waits for the same webhook, and leases them until `lease_until`.
    /// On PostgreSQL rows another replica is taking are skipped.
    pub async fn claim_deliveries(
        &self,
        now: OffsetDateTime,
        lease_until: OffsetDateTime,
        limit: u32,
    ) -> Result<Vec<DueDelivery>> {
        let now_text = format_ts(now);
        let lease_text = format_ts(lease_until);
        let skip_locked = match self.engine {
            Engine::Postgres => " FOR UPDATE OF d SKIP LOCKED",
            Engine::Sqlite => "",
        };
        let mut tx = self.write_tx().await?;
        let due = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT d.webhook_id, d.event_id, d.attempts FROM webhook_deliveries d \
             WHERE d.status = 'pending' AND d.next_attempt_at <= $1 \
               AND (d.lease_until IS NULL OR d.lease_until <= $1) \
               AND NOT EXISTS (SELECT 1 FROM webhook_deliveries p \
                   WHERE p.webhook_id = d.webhook_id AND p.sandbox_id = d.sandbox_id \
                     AND p.status = 'pending' AND p.event_id < d.event_id) \
             ORDER BY d.next_attempt_at, d.event_id LIMIT $2{skip_locked}"
        )))
        .bind(&now_text)
        .bind(i64::from(limit))
        .fetch_all(&mut *tx)
        .await?;
        let mut taken = Vec::with_capacity(due.len());
        for row in &due {
            let webhook_id = get_str(row, "webhook_id")?;
            let event_id = get_i64(row, "event_id")?;
            sqlx::query(
                "UPDATE webhook_deliveries SET lease_until = $3 \
                 WHERE webhook_id = $1 AND event_id = $2",
            )
            .bind(&webhook_id)
            .bind(event_id)
            .bind(&lease_text)
            .execute(&mut *tx)
            .await?;
            let full = sqlx::query(
                "SELECT e.*, s.size, w.url, w.secret FROM sandbox_events e \
                   JOIN sandboxes s ON s.id = e.sandbox_id \
                   JOIN webhooks w ON w.id = $1 \
                 WHERE e.id = $2",
            )
            .bind(&webhook_id)
            .bind(event_id)
            .fetch_one(&mut *tx)
            .await?;
            taken.push(DueDelivery {
                url: get_str(&full, "url")?,
                secret: get_str(&full, "secret")?,
                event: event_from(&full)?,
                webhook_id,
                attempts: get_i64(row, "attempts")?.clamp(0, u32::MAX as i64) as u32,
                lease_until: lease_text.clone(),
            });
        }
        tx.commit().await?;
        Ok(taken)
    }

    /// Records an attempt of a delivery this worker leased (`lease_until`
    /// as [`DueDelivery::lease_until`]) and what follows from it. `false`
    /// when the lease was no longer its (lapsed and taken, redelivered,
    /// the webhook deleted): the attempt is still recorded.
    #[allow(clippy::too_many_arguments)]
    pub async fn record_attempt(
        &self,
        webhook_id: &str,
        event_id: i64,
        lease_until: &str,
        at: OffsetDateTime,
        status_code: Option<u16>,
        error: Option<&str>,
        duration_ms: u64,
        outcome: &AttemptOutcome,
    ) -> Result<bool> {
        let mut tx = self.write_tx().await?;
        sqlx::query(
            "INSERT INTO webhook_attempts (webhook_id, event_id, n, at, status_code, error, \
                 duration_ms) \
             SELECT $1, $2, COALESCE(MAX(n), 0) + 1, $3, $4, $5, $6 FROM webhook_attempts \
             WHERE webhook_id = $1 AND event_id = $2",
        )
        .bind(webhook_id)
        .bind(event_id)
        .bind(format_ts(at))
        .bind(status_code.map(i64::from))
        .bind(error)
        .bind(i64::try_from(duration_ms).unwrap_or(i64::MAX))
        .execute(&mut *tx)
        .await?;
        let (status, next, delivered_at) = match outcome {
            AttemptOutcome::Delivered => ("delivered", at, Some(format_ts(at))),
            AttemptOutcome::RetryAt(next) => ("pending", *next, None),
            AttemptOutcome::GaveUp => ("failed", at, None),
        };
        let done = sqlx::query(
            "UPDATE webhook_deliveries SET status = $4, attempts = attempts + 1, \
                 next_attempt_at = $5, delivered_at = $6, lease_until = NULL \
             WHERE webhook_id = $1 AND event_id = $2 AND lease_until = $3 AND status = 'pending'",
        )
        .bind(webhook_id)
        .bind(event_id)
        .bind(lease_until)
        .bind(status)
        .bind(format_ts(next))
        .bind(delivered_at)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(done.rows_affected() > 0)
    }

    /// A webhook's deliveries, newest event first, after event
    /// `starting_after` (exclusive), at most `limit`.
    pub async fn deliveries(
        &self,
        webhook_id: &str,
        limit: u32,
        starting_after: Option<i64>,
    ) -> Result<Vec<DeliveryRow>> {
        sqlx::query(
            "SELECT d.*, e.kind FROM webhook_deliveries d \
               JOIN sandbox_events e ON e.id = d.event_id \
             WHERE d.webhook_id = $1 AND ($2 IS NULL OR d.event_id < $2) \
             ORDER BY d.event_id DESC LIMIT $3",
        )
        .bind(webhook_id)
        .bind(starting_after)
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(delivery_from)
        .collect()
    }

    /// One delivery.
    pub async fn delivery(&self, webhook_id: &str, event_id: i64) -> Result<Option<DeliveryRow>> {
        sqlx::query(
            "SELECT d.*, e.kind FROM webhook_deliveries d \
               JOIN sandbox_events e ON e.id = d.event_id \
             WHERE d.webhook_id = $1 AND d.event_id = $2",
        )
        .bind(webhook_id)
        .bind(event_id)
        .fetch_optional(&self.pool)
        .await?
        .as_ref()
        .map(delivery_from)
        .transpose()
    }

    /// A delivery's attempts, oldest first.
    pub async fn attempts(&self, webhook_id: &str, event_id: i64) -> Result<Vec<AttemptRow>> {
        sqlx::query(
            "SELECT * FROM webhook_attempts WHERE webhook_id = $1 AND event_id = $2 ORDER BY n",
        )
        .bind(webhook_id)
        .bind(event_id)
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(|row| {
            Ok(AttemptRow {
                n: get_i64(row, "n")?.clamp(0, u32::MAX as i64) as u32,
                at: get_ts(row, "at")?,
                status_code: get_opt_i64(row, "status_code")?.and_then(|c| u16::try_from(c).ok()),
                error: get_opt_str(row, "error")?,
                duration_ms: get_i64(row, "duration_ms")?.max(0) as u64,
            })
        })
        .collect()
    }

    /// Queues a delivery again, due now, its attempts counted anew (the
    /// earlier ones kept). `None` when there is no such delivery.
    pub async fn redeliver(&self, webhook_id: &str, event_id: i64) -> Result<Option<DeliveryRow>> {
        sqlx::query(
            "UPDATE webhook_deliveries SET status = 'pending', attempts = 0, \
                 next_attempt_at = $3, lease_until = NULL, delivered_at = NULL \
             WHERE webhook_id = $1 AND event_id = $2",
        )
        .bind(webhook_id)
        .bind(event_id)
        .bind(format_ts(crate::util::now()))
        .execute(&self.pool)
        .await?;
        self.delivery(webhook_id, event_id).await
    }

    /// When the next pending delivery is due (leased ones at their lease's
    /// end): when a delivery worker next has work.
    pub async fn next_delivery_at(&self) -> Result<Option<OffsetDateTime>> {
        let at: Option<String> = sqlx::query_scalar(
            "SELECT MIN(CASE WHEN lease_until IS NOT NULL AND lease_until > next_attempt_at \
                        THEN lease_until ELSE next_attempt_at END) \
             FROM webhook_deliveries WHERE status = 'pending'",
        )
        .fetch_one(&self.pool)
        .await?;
        at.as_deref().map(parse_ts).transpose()
    }
}
