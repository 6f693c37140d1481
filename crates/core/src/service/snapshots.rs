//! Snapshots, fork and restore: a sandbox's whole state (disk, memory,
//! processes) saved by the node that runs it, and sandboxes started from it.
//!
//! A snapshot's files stay on the node that took it (see `docs/design.md`:
//! a sandbox from a snapshot is placed on that node, and a restore needs
//! the sandbox to be there). The row is written first (`creating`, counted
//! against the account's quota), then the node saves, then the row is
//! `ready`; a save that fails marks the row deleted and removes whatever the
//! node wrote, so a failed snapshot leaves nothing and costs nothing.
//! Deleted and expired snapshots' rows are marked first and their files
//! removed by their node: at once when it can be reached, else by its sweep
//! (every reaper pass), which removes every save no live row names.
//!
//! Owns the snapshot calls of the API, fork (a snapshot and sandboxes from
//! it, all or nothing), restore (same sandbox, rolled back), what a create
//! from a snapshot checks, and the snapshot sweep.

use crate::api::Caller;
use crate::api::Snapshots;
use crate::config::cost;
use crate::error::{CoreError, ErrorType, Result};
use crate::model::*;
use crate::service::checks::{page_limit, unknown_cursor};
use crate::service::errors::{not_running, runtime_error};
use crate::service::Service;
use sandpit_host::ids::rfc3339;
use sandpit_store::{Cause, NewSnapshot, SandboxRow, SnapshotOutcome, SnapshotRow, SnapshotStatus};
use sha2::Digest;
use std::time::Duration;
use time::OffsetDateTime;

/// Copies one fork makes at most.
pub const MAX_FORKS: u32 = 10;

/// How long a replayed snapshot call waits for the first call's save.
const REPLAY_WAIT: Duration = Duration::from_secs(120);

/// How far up a sandbox's line of snapshots a restore looks.
const MAX_ANCESTRY: usize = 64;

impl Service {
    /// Saves running sandbox `row` as a new snapshot (or replays the one an
    /// earlier call with the same key made).
    async fn save(
        &self,
        row: &SandboxRow,
        name: Option<String>,
        idempotency_key: Option<String>,
        actor: &str,
    ) -> Result<(SnapshotRow, bool)> {
        if row.status != SandboxStatus::Running {
            return Err(not_running(row));
        }
        let hash = hex::encode(sha2::Sha256::digest(
            serde_json::to_vec(&(&row.id, &name)).expect("json"),
        ));
        let new = NewSnapshot {
            id: sandpit_host::ids::new_id("snap_"),
            account_id: row.account_id.clone(),
            name,
            sandbox_id: row.id.clone(),
            size: row.size.clone(),
            host: row.host.clone(),
            expires_at: OffsetDateTime::now_utc()
                + time::Duration::days(i64::from(self.config.snapshot_retention_days)),
            max_count: self.config.max_snapshots_per_account,
            max_bytes: self.config.snapshot_bytes_per_account,
            idempotency: idempotency_key.map(|k| (k, hash)),
        };
        let snap = match self.store.create_snapshot(new).await? {
            SnapshotOutcome::Created(snap) => snap,
            SnapshotOutcome::Replay(snap) => {
                return Ok((self.replayed_snapshot(snap).await?, true))
            }
            SnapshotOutcome::IdempotencyConflict => {
                return Err(CoreError::conflict(super::create::KEY_REUSED))
            }
            SnapshotOutcome::OverQuota {
                count,
                bytes,
                max_count,
                max_bytes,
            } => {
                return Err(CoreError::new(
                    ErrorType::RateLimited,
                    format!(
                        "the account holds {count} snapshots taking {bytes} bytes; its quota is \
                         {max_count} snapshots and {max_bytes} bytes: delete one first"
                    ),
                )
                .lasting())
            }
        };
        // In a task of its own: a client that hangs up does not leave a
        // half-written snapshot behind.
        let me = self
            .arc_self()
            .ok_or_else(|| CoreError::internal("the service is shutting down"))?;
        let row = row.clone();
        let cause = Cause::by(actor);
        tokio::spawn(async move { me.write_snapshot(&row, snap, &cause).await })
            .await
            .map_err(|e| CoreError::internal(format!("the snapshot task failed: {e}")))?
            .map(|snap| (snap, false))
    }

    /// The node saves `row`'s VM as `snap`; the row is `ready`, or deleted
    /// with whatever the node wrote.
    async fn write_snapshot(
        &self,
        row: &SandboxRow,
        snap: SnapshotRow,
        cause: &Cause,
    ) -> Result<SnapshotRow> {
        let machines = match self.machines_for(row).await {
            Ok(m) => m,
            Err(e) => {
                let _ = self.store.delete_snapshot(&snap.id).await;
                return Err(e);
            }
        };
        let started = std::time::Instant::now();
        match machines.snapshot(&row.id, &snap.id).await {
            Ok(bytes) => {
                tracing::info!(
                    id = %row.id, snapshot = %snap.id,
                    "snapshot taken in {} ms, {bytes} bytes", started.elapsed().as_millis()
                );
                match self.store.snapshot_ready(&snap.id, bytes, cause).await {
                    Ok(Some(ready)) => {
                        // Its expiry may be the next one.
                        self.wake_reaper();
                        Ok(ready)
                    }
                    // Deleted while it was written.
                    Ok(None) => {
                        let _ = machines.delete_snapshot(&snap.id).await;
                        Err(CoreError::not_found("snapshot", &snap.id))
                    }
                    Err(e) => {
                        let _ = self.store.delete_snapshot(&snap.id).await;
                        let _ = machines.delete_snapshot(&snap.id).await;
                        Err(e.into())
                    }
                }
            }
            Err(e) => {
                tracing::warn!(id = %row.id, snapshot = %snap.id, "snapshot failed: {e}");
                let _ = self.store.delete_snapshot(&snap.id).await;
                let _ = machines.delete_snapshot(&snap.id).await;
                Err(match e {
                    sandpit_runtime::RuntimeError::Launch(m) => CoreError::conflict(format!(
                        "sandbox {} cannot be snapshotted: {m}",
                        row.id
                    )),
                    e => self.agent_failure(row, e).await,
                })
            }
        }
    }

    /// A replayed snapshot, once the first call's save is over.
    async fn replayed_snapshot(&self, mut snap: SnapshotRow) -> Result<SnapshotRow> {
        let deadline = tokio::time::Instant::now() + REPLAY_WAIT;
        while snap.status == SnapshotStatus::Creating {
            if tokio::time::Instant::now() >= deadline {
                return Err(CoreError::new(
                    ErrorType::ServiceUnavailable,
                    format!("snapshot {} is still being written; retry", snap.id),
                )
                .with_retry_after(2));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            snap = self
                .store
                .snapshot(&snap.id)
                .await?
                .ok_or_else(|| CoreError::internal("the replayed snapshot vanished"))?;
        }
        match snap.status {
            SnapshotStatus::Deleted => Err(CoreError::not_found("snapshot", &snap.id)),
            _ => Ok(snap),
        }
    }

    /// A snapshot of the caller's account; any other (or a deleted one) is
    /// `not_found`, exactly like a missing one.
    async fn owned_snapshot(&self, caller: &Caller, id: &str) -> Result<SnapshotRow> {
        self.store
            .snapshot_of(&caller.account_id, id)
            .await?
            .ok_or_else(|| CoreError::not_found("snapshot", id))
    }

    /// A snapshot of the caller's that sandboxes can start from now.
    pub(super) async fn startable_snapshot(
        &self,
        caller: &Caller,
        id: &str,
    ) -> Result<SnapshotRow> {
        let snap = self.owned_snapshot(caller, id).await?;
        if snap.status != SnapshotStatus::Ready {
            return Err(CoreError::conflict(format!(
                "snapshot {id} is still being written; retry when it is ready"
            ))
            .with_retry_after(1));
        }
        Ok(snap)
    }

    /// Removes a deleted snapshot's files on its node, if it can be
    /// reached (else its sweep does).
    async fn delete_snapshot_files(&self, snap: &SnapshotRow) {
        match self.machines_on(&snap.host, &snap.sandbox_id).await {
            Ok(m) => {
                if let Err(e) = m.delete_snapshot(&snap.id).await {
                    tracing::warn!(snapshot = %snap.id, "deleting its files: {e}");
                }
            }
            Err(e) => tracing::info!(
                snapshot = %snap.id,
                "its node will delete its files: {}", e.message
            ),
        }
    }

    /// Whether sandbox `ancestor` is `row`'s sandbox or one it descends
    /// from (through the snapshots each was started from).
    async fn is_ancestor(&self, ancestor: &str, row: &SandboxRow) -> Result<bool> {
        let mut at = row.clone();
        for _ in 0..MAX_ANCESTRY {
            if at.id == ancestor {
                return Ok(true);
            }
            let Some(from) = &at.snapshot_id else {
                return Ok(false);
            };
            let Some(snap) = self.store.snapshot(from).await? else {
                return Ok(false);
            };
            let Some(parent) = self.store.sandbox(&snap.sandbox_id).await? else {
                return Ok(false);
            };
            at = parent;
        }
        Ok(false)
    }

    /// Expired snapshots of this host are deleted, and saves on its disk
    /// that no live snapshot names (deleted while it was out of reach, or
    /// left by a crash) are removed, as are the paused states of sandboxes
    /// that ended (elsewhere: by a sweep that found this node lost).
    /// Returns when the next snapshot expires.
    pub(super) async fn sweep_snapshots(&self) -> Option<OffsetDateTime> {
        let vms = self.vms()?;
        let host = &self.config.host_name;
        // The files first, then the rows: a save complete by the listing
        // had its row written before it began.
        let on_disk = vms.snapshots();
        let now = OffsetDateTime::now_utc();
        match self.store.expired_snapshots(host, now).await {
            Ok(expired) => {
                for snap in expired {
                    if let Ok(Some(_)) = self.store.delete_snapshot(&snap.id).await {
                        tracing::info!(snapshot = %snap.id, "snapshot expired");
                    }
                }
            }
            Err(e) => tracing::warn!("snapshot sweep: {e}"),
        }
        let live = match self.store.snapshots_on(host).await {
            Ok(live) => live,
            Err(e) => {
                tracing::warn!("snapshot sweep: {e}");
                return None;
            }
        };
        // Templates' saves (their layers, their last saves) are kept too.
        let templates = match self.store.template_saves_on(host).await {
            Ok(saves) => saves,
            Err(e) => {
                tracing::warn!("snapshot sweep: {e}");
                return None;
            }
        };
        for id in vms.paused() {
            if let Ok(row) = self.store.sandbox(&id).await {
                if row.is_none_or(|r| r.status.is_ended()) {
                    tracing::info!(id, "removing the paused state of a sandbox that ended");
                    let _ = vms.destroy(&id).await;
                }
            }
        }
        for name in on_disk {
            if !live.iter().any(|s| s.id == name) && !templates.contains(&name) {
                if let Err(e) = vms.manager().delete_saved(&name).await {
                    tracing::warn!(snapshot = %name, "removing its files: {e}");
                }
            }
        }
        live.iter().map(|s| s.expires_at).min()
    }
}

/// A snapshot's name: as a sandbox's.
fn check_name(name: Option<&str>) -> Result<()> {
    match name {
        Some(n) if n.chars().count() > 200 => {
            Err(CoreError::invalid("name is at most 200 characters"))
        }
        _ => Ok(()),
    }
}

pub(super) fn to_snapshot(s: &SnapshotRow) -> Snapshot {
    Snapshot {
        id: s.id.clone(),
        object: "snapshot".into(),
        name: s.name.clone(),
        sandbox_id: s.sandbox_id.clone(),
        size: s.size.clone(),
        status: s.status.as_str().into(),
        size_bytes: s.bytes,
        created_at: rfc3339(s.created_at),
        expires_at: rfc3339(s.expires_at),
    }
}

#[async_trait::async_trait]
impl Snapshots for Service {
    /// The API's `snapshot_sandbox`.
    async fn snapshot_sandbox(
        &self,
        caller: &Caller,
        id: &str,
        req: CreateSnapshot,
        idempotency_key: Option<String>,
    ) -> Result<(Snapshot, bool)> {
        check_name(req.name.as_deref())?;
        if let Some(k) = &idempotency_key {
            if k.is_empty() || k.len() > 255 {
                return Err(CoreError::invalid(
                    "Idempotency-Key must be 1 to 255 characters",
                ));
            }
        }
        let (row, _busy) = self.running(caller, id).await?;
        let (snap, replayed) = self
            .save(&row, req.name, idempotency_key, &caller.actor)
            .await?;
        Ok((to_snapshot(&snap), replayed))
    }

    /// The API's `get_snapshot`.
    async fn get_snapshot(&self, caller: &Caller, id: &str) -> Result<Snapshot> {
        Ok(to_snapshot(&self.owned_snapshot(caller, id).await?))
    }

    /// The API's `list_snapshots`.
    async fn list_snapshots(&self, caller: &Caller, q: ListSnapshots) -> Result<List<Snapshot>> {
        let limit = page_limit(q.limit)?;
        let page = self
            .store
            .list_snapshots(&caller.account_id, limit, q.starting_after.as_deref())
            .await
            .map_err(|e| match e {
                sandpit_store::StoreError::NotFound(_) => {
                    unknown_cursor("snapshot", q.starting_after.as_deref().unwrap_or_default())
                }
                e => e.into(),
            })?;
        let data = page.data.iter().map(to_snapshot).collect();
        Ok(List::page(data, page.has_more, |s| s.id.clone()))
    }

    /// The API's `delete_snapshot`: the row at once, the files by their
    /// node (now, or by its sweep when it is out of reach).
    async fn delete_snapshot(&self, caller: &Caller, id: &str) -> Result<Snapshot> {
        let snap = self.owned_snapshot(caller, id).await?;
        let Some(before) = self.store.delete_snapshot(&snap.id).await? else {
            return Err(CoreError::not_found("snapshot", id));
        };
        self.delete_snapshot_files(&before).await;
        let mut shown = to_snapshot(&before);
        shown.status = SnapshotStatus::Deleted.as_str().into();
        Ok(shown)
    }

    /// The API's `fork_sandbox`: a snapshot, then `count` sandboxes from
    /// it. The credit for all of them is checked before anything is done,
    /// and if any of them cannot be made, those made are ended uncharged
    /// and the snapshot deleted: the call is refused whole.
    async fn fork_sandbox(&self, caller: &Caller, id: &str, req: ForkSandbox) -> Result<Fork> {
        let count = req.count.unwrap_or(1);
        if !(1..=MAX_FORKS).contains(&count) {
            return Err(CoreError::invalid(format!(
                "count must be between 1 and {MAX_FORKS}, not {count}"
            )));
        }
        let (row, _busy) = self.running(caller, id).await?;
        let copy = CreateSandbox {
            size: Some(row.size.clone()),
            name: None,
            timeout_minutes: req.timeout_minutes,
            snapshot_id: None,
            // A fork keeps its origin's labels, environment, ports and
            // network.
            metadata: row.metadata.clone(),
            env: row.env.clone(),
            every_port_public: row.every_port_public,
            internet_access: row.internet_access,
            network: row
                .network
                .as_deref()
                .and_then(|n| serde_json::from_str(n).ok()),
            // A copy of a sandbox whose every port is private is so too.
            private_traffic: row.private_traffic,
            // From the snapshot: its origin's template and directory.
            template: None,
            layer: None,
            // Its origin's secrets: the snapshot's guest has their
            // placeholders (in `env` too) and trusts their CA.
            secrets: Vec::new(),
            secrets_of: Some(row.id.clone()),
            // Its origin's too, with its secrets.
            network_rules: Default::default(),
            // Its origin's, read-only (see `Service::fork_mounts`).
            volumes: Vec::new(),
        };
        let (_, size, timeout) = crate::service::checks::check_create(&self.config, &copy, None)?;
        let needed = cost(size.price_micros_per_hour(), u64::from(timeout) * 60) * i64::from(count);
        let balance = self.store.balance(&caller.account_id).await?;
        if balance < needed {
            return Err(CoreError::new(
                ErrorType::InsufficientCredits,
                format!(
                    "{count} {} sandboxes for {timeout} minutes reserve ${:.6}, but the account \
                     has ${:.6} left; nothing was made",
                    row.size,
                    usd(needed),
                    usd(balance)
                ),
            ));
        }
        let (snap, _) = self.save(&row, None, None, &caller.actor).await?;
        let copy = CreateSandbox {
            snapshot_id: Some(snap.id.clone()),
            ..copy
        };
        // Started side by side (the node's start queue orders them).
        let me = self
            .arc_self()
            .ok_or_else(|| CoreError::internal("the service is shutting down"))?;
        let mut starts = tokio::task::JoinSet::new();
        for _ in 0..count {
            let (me, caller, copy) = (me.clone(), caller.clone(), copy.clone());
            starts.spawn(async move { me.create(&caller, copy, None).await });
        }
        let mut made = Vec::new();
        while let Some(m) = starts.join_next().await {
            made.push(m.unwrap_or_else(|e| {
                Err(CoreError::internal(format!("a fork's start failed: {e}")))
            }));
        }
        if made.iter().all(|m| m.is_ok()) {
            let forks: Vec<String> = made
                .iter()
                .filter_map(|m| m.as_ref().ok().map(|(s, _)| s.id.clone()))
                .collect();
            let cause = Cause::by(&caller.actor)
                .with("snapshot_id", snap.id.as_str())
                .with("forks", forks);
            if let Err(e) = self
                .store
                .record_event(&row.id, "sandbox.forked", None, &cause)
                .await
            {
                tracing::warn!(id = %row.id, "recording its fork: {e}");
            }
            return Ok(Fork {
                snapshot: to_snapshot(&snap),
                sandboxes: made.into_iter().map(|m| m.expect("ok").0).collect(),
            });
        }
        let mut first_error = None;
        for m in made {
            match m {
                Ok((sandbox, _)) => {
                    if let Ok(Some(row)) = self.store.sandbox(&sandbox.id).await {
                        let _ = self
                            .end(
                                &row,
                                SandboxStatus::Failed,
                                "failed: the fork it was part of failed",
                                Cause::by(&caller.actor),
                            )
                            .await;
                    }
                }
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        if let Ok(Some(before)) = self.store.delete_snapshot(&snap.id).await {
            self.delete_snapshot_files(&before).await;
        }
        let e = first_error.expect("one failed");
        Err(CoreError {
            message: format!("the fork was undone, nothing is charged: {}", e.message),
            ..e
        })
    }

    /// The API's `restore_sandbox`: the same sandbox (id, preview URLs,
    /// expiry) with the snapshot's disk, memory and processes.
    async fn restore_sandbox(
        &self,
        caller: &Caller,
        id: &str,
        req: RestoreSandbox,
    ) -> Result<Sandbox> {
        let (row, _busy) = self.running(caller, id).await?;
        let snap = self.startable_snapshot(caller, &req.snapshot_id).await?;
        if !self.is_ancestor(&snap.sandbox_id, &row).await? {
            return Err(CoreError::invalid(format!(
                "snapshot {} was taken of sandbox {}, which is neither {id} nor one it was \
                 started from; start a new sandbox from it instead",
                snap.id, snap.sandbox_id
            )));
        }
        if snap.size != row.size {
            return Err(CoreError::invalid(format!(
                "snapshot {} is of size {}, sandbox {id} of size {}",
                snap.id, snap.size, row.size
            )));
        }
        if snap.host != row.host {
            return Err(CoreError::conflict(format!(
                "snapshot {} is kept on node {}, sandbox {id} runs on node {}; start a new \
                 sandbox from it instead",
                snap.id, snap.host, row.host
            )));
        }
        let machines = self.machines_for(&row).await?;
        // Its preview connections reach the VM being replaced: cut them.
        // The URLs themselves stay and serve the restored VM.
        self.previews.close(id, None);
        self.terminals.close(id);
        let restoring = self.restoring(id).await;
        let restored = machines
            .restore(
                id,
                &snap.id,
                row.expires_at,
                self.egress(&row).await,
                self.vm_volumes(&row).await?,
            )
            .await;
        drop(restoring);
        if let Err(e) = restored {
            // The old VM may be gone already: the sandbox failed.
            if !matches!(
                machines.state(id).await,
                Ok(Some(sandpit_runtime::VmState::Running))
            ) {
                let _ = self
                    .end(
                        &row,
                        SandboxStatus::Failed,
                        &format!("failed: restoring snapshot {}: {e}", snap.id),
                        Cause::by(&caller.actor),
                    )
                    .await;
            }
            return Err(runtime_error(e));
        }
        let cause = Cause::by(&caller.actor).with("snapshot_id", snap.id.as_str());
        if let Err(e) = self
            .store
            .record_event(id, "sandbox.restored", None, &cause)
            .await
        {
            tracing::warn!(id, "recording its restore: {e}");
        }
        let now = self.owned(caller, id).await?;
        // Extended while it was restored: the new VM's watchdog learns it.
        if now.expires_at != row.expires_at {
            let _ = machines.set_expiry(id, now.expires_at).await;
        }
        Ok(super::lifecycle::to_sandbox(&now))
    }
}
