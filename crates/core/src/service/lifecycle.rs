//! A sandbox's life, from its create to its end: where money moves and
//! where expiry is enforced.
//!
//! Money: creating and extending reserve the cost of the whole timeout in
//! the same store transaction that checks the balance and the concurrency
//! limit; ending a sandbox releases the reservation and charges the seconds
//! it lived (never more than was reserved), exactly once. Lifetime: the
//! reaper ends every sandbox whose `expires_at` has passed; on start,
//! `reconcile` settles what happened while the server was down.
//!
//! Separate because every way a sandbox comes and goes (create, whose steps
//! are `create`'s, the boot, the replay of an idempotent retry, extend,
//! destroy, expiry, failure) has to keep those two rules together, and
//! `end` is the one way out for all of them. Owns get, list, extend and
//! destroy, the start of a sandbox's VM (one at a time per sandbox), the
//! end of a sandbox and its billing, the reaper and `reconcile`.

use crate::api::Caller;
use crate::api::Sandboxes;
use crate::config::cost;
use crate::error::{CoreError, ErrorType, Result};
use crate::metrics::CreatePath;
use crate::model::*;
use crate::service::checks::{extension_minutes, page_limit, unknown_cursor};
use crate::service::errors::{not_running, runtime_error};
use crate::service::events::{EXPIRY, SANDPIT};
use crate::service::Service;
use sandpit_host::ids::rfc3339;
use sandpit_host::machines::{Machines, Started};
use sandpit_runtime::{RuntimeError, VmState};
use sandpit_store::{Cause, ExtendOutcome, SandboxRow};
use std::sync::Arc;
use std::time::Duration;
use time::OffsetDateTime;

/// How long an idempotent retry of a create waits for the first call's
/// start to finish.
const REPLAY_WAIT: Duration = Duration::from_secs(60);

/// Why [`Service::boot`] did not give a running sandbox.
pub(crate) struct StartFailed {
    pub error: CoreError,
    /// The VM's node could not be reached: the sandbox failed before any
    /// VM ran, and another node may take it.
    pub unreachable: bool,
}

impl From<CoreError> for StartFailed {
    fn from(error: CoreError) -> Self {
        StartFailed {
            error,
            unreachable: false,
        }
    }
}

impl From<sandpit_store::StoreError> for StartFailed {
    fn from(e: sandpit_store::StoreError) -> Self {
        CoreError::from(e).into()
    }
}

impl From<StartFailed> for CoreError {
    fn from(f: StartFailed) -> Self {
        f.error
    }
}

/// A sandbox whose VM [`Service::boot`] started: its row, running, and
/// whether the VM was restored from a template when the node that started
/// it said (`None`: this host's own VM, or not said).
pub(crate) struct Booted {
    pub row: SandboxRow,
    pub restored: Option<bool>,
}

impl Service {
    /// How the VM of a sandbox started for its create came (not a pool
    /// VM's): what the node that started it said (`restored`), else what
    /// this host's runtime knows of its own VMs.
    pub(super) fn how_started(&self, booted: &Booted) -> CreatePath {
        match booted.restored {
            Some(true) => return CreatePath::restore,
            Some(false) => return CreatePath::cold,
            None => {}
        }
        let row = &booted.row;
        if row.host != self.config.host_name {
            return CreatePath::new;
        }
        match self.vm_record(&row.id) {
            Some(vm) if vm.template.is_some() => CreatePath::restore,
            Some(_) => CreatePath::cold,
            None => CreatePath::new,
        }
    }

    /// The sandbox an idempotent retry of a create finds, once its start
    /// is over: the first call may still be starting it, or may have been
    /// lost with its server (a replica killed mid-create), in which case
    /// the node that starts it records the outcome (see
    /// [`crate::cluster`]). Waits [`REPLAY_WAIT`] at most.
    pub(super) async fn replayed(&self, mut row: SandboxRow) -> Result<SandboxRow> {
        if row.status == SandboxStatus::Provisioning {
            // The first call may have been lost before its start reached
            // the node: start it (one in flight there is joined, not
            // repeated; see `boot`), in a task that a client who hangs up
            // does not cut short.
            if let (Ok(machines), Some(me)) = (self.machines_for(&row).await, self.arc_self()) {
                let first = row.clone();
                let volumes = self.vm_volumes(&row).await?;
                let local = row.host == self.config.host_name && self.vms.is_some();
                let started = tokio::spawn(async move {
                    match local {
                        true => me
                            .boot(first, machines)
                            .await
                            .map(|_| ())
                            .map_err(|f| f.error),
                        false => machines
                            .start(
                                &first.id,
                                &first.size,
                                first.snapshot_id.as_deref(),
                                first.expires_at,
                                me.egress(&first).await,
                                volumes,
                            )
                            .await
                            .map(|_| ())
                            .map_err(runtime_error),
                    }
                })
                .await;
                if let Ok(Err(e)) = started {
                    tracing::warn!(id = %row.id, "starting a replayed create: {e}");
                }
            }
        }
        let deadline = tokio::time::Instant::now() + REPLAY_WAIT;
        while row.status == SandboxStatus::Provisioning {
            if tokio::time::Instant::now() >= deadline {
                return Err(CoreError::new(
                    ErrorType::ServiceUnavailable,
                    format!("sandbox {} is still starting; retry", row.id),
                )
                .with_retry_after(2));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            row = self
                .store
                .sandbox(&row.id)
                .await?
                .ok_or_else(|| CoreError::internal("the replayed sandbox vanished"))?;
        }
        Ok(row)
    }

    /// Boot the VM of a sandbox row in `provisioning`; running, or failed
    /// (and refunded) with the cause.
    pub(crate) async fn boot(
        &self,
        row: SandboxRow,
        machines: Arc<dyn Machines>,
    ) -> std::result::Result<Booted, StartFailed> {
        // A second start of the same sandbox (a create retried while its
        // first call, or the replica that made it, is still at it or was
        // lost) waits for the first and takes its outcome.
        let turn = self.turns.take(&row.id).await;
        if turn.waited() {
            let now = self.store.sandbox(&row.id).await?;
            let now = now.ok_or_else(|| CoreError::not_found("sandbox", &row.id))?;
            if now.status != SandboxStatus::Provisioning {
                return match now.is_live() {
                    true => Ok(Booted {
                        row: now,
                        restored: None,
                    }),
                    false => Err(not_running(&now).into()),
                };
            }
        }
        self.start_vm(row, machines).await
    }
}

impl Service {
    /// [`Service::boot`]'s start itself.
    async fn start_vm(
        &self,
        row: SandboxRow,
        machines: Arc<dyn Machines>,
    ) -> std::result::Result<Booted, StartFailed> {
        match machines
            .start(
                &row.id,
                &row.size,
                row.snapshot_id.as_deref(),
                row.expires_at,
                self.egress(&row).await,
                self.vm_volumes(&row).await?,
            )
            .await
        {
            Ok(Started::Booted) => {
                let running = self
                    .store
                    .set_status(
                        &row.id,
                        SandboxStatus::Running,
                        None,
                        &Cause::by(format!("node {}", row.host)),
                    )
                    .await?;
                // Extended while it booted: the VM's watchdog has the old
                // expiry.
                if running.expires_at != row.expires_at {
                    let _ = machines.set_expiry(&row.id, running.expires_at).await;
                }
                Ok(Booted {
                    row: running,
                    restored: None,
                })
            }
            // A node records its start itself (see `crate::cluster`).
            Ok(Started::Recorded {
                ready_at,
                expires_at,
                restored,
            }) => Ok(Booted {
                row: SandboxRow {
                    status: SandboxStatus::Running,
                    ready_at: Some(ready_at),
                    expires_at,
                    ..row
                },
                restored,
            }),
            Err(e) => {
                tracing::warn!(id = %row.id, host = %row.host, "create failed: {e}");
                let unreachable = matches!(e, RuntimeError::Disconnected(_));
                let _ = machines.destroy(&row.id).await;
                let _ = self
                    .store
                    .finish_sandbox(
                        &row.id,
                        SandboxStatus::Failed,
                        &format!("failed: {e}"),
                        OffsetDateTime::now_utc(),
                        0,
                        &Cause::by(format!("node {}", row.host)),
                    )
                    .await;
                let now = OffsetDateTime::now_utc();
                // Its watchdog ends a VM at its expiry, started or not: on a
                // host busy enough, a short lifetime runs out in the start.
                let message = if now >= row.expires_at {
                    format!(
                        "the sandbox's lifetime ({} min) ran out while its VM was being \
                         started ({} s on a busy host; {e}); nothing was charged, retry or \
                         ask for a longer timeout",
                        row.timeout_minutes,
                        (now - row.created_at).whole_seconds()
                    )
                } else {
                    format!(
                        "the sandbox's VM could not be started ({e}); nothing was charged, retry"
                    )
                };
                Err(StartFailed {
                    error: CoreError::new(ErrorType::ServiceUnavailable, message)
                        .with_retry_after(5),
                    unreachable,
                })
            }
        }
    }

    /// End a live sandbox: destroy its VM, release its reservation, charge
    /// what it used (up to its expiry at most; nothing if it failed), record
    /// why. Idempotent.
    pub(super) async fn end(
        &self,
        row: &SandboxRow,
        end_status: SandboxStatus,
        reason: &str,
        cause: Cause,
    ) -> Result<Option<SandboxRow>> {
        self.end_here(row).await;
        let now = OffsetDateTime::now_utc();
        let billed_until = now.min(row.expires_at);
        // A VM found dead after its expiry ended on time (its watchdog
        // killed it, see `sandpit_runtime::vm::expiry`): expired, not failed.
        // One found dead while its sandbox is being destroyed (a command
        // or a look-up saw the destroy's kill) was destroyed, not lost: the
        // destroy ends it, charged, whichever of the two gets here first.
        let destroying = end_status == SandboxStatus::Failed
            && matches!(self.store.sandbox(&row.id).await, Ok(Some(r)) if r.status == SandboxStatus::Deleting);
        let (end_status, reason, cause) =
            if end_status == SandboxStatus::Failed && row.expires_at <= now {
                (SandboxStatus::Deleted, "expired", Cause::by(EXPIRY))
            } else if destroying {
                (SandboxStatus::Deleted, "destroyed", cause)
            } else {
                (end_status, reason, cause)
            };
        // A sandbox the platform lost (its VM died, it never came up) is
        // not charged at all: the whole reservation comes back. Its time
        // paused (as the row is now: paused or resumed since `row` was
        // read) is billed at the paused rate.
        let charge = if end_status == SandboxStatus::Failed {
            0
        } else {
            let now_row = match self.store.sandbox(&row.id).await {
                Ok(Some(r)) => r,
                _ => row.clone(),
            };
            cost_until(&now_row, billed_until, self.config.paused_price_percent)
        };
        Ok(self
            .store
            .finish_sandbox(&row.id, end_status, reason, now, charge, &cause)
            .await?)
    }

    /// What ending a sandbox takes besides its row: its preview URLs here
    /// stop (before anything else), its VM goes with its last disk use
    /// recorded, its preview traffic is written. A VM on a node out of
    /// reach is removed by that node when it finds the sandbox ended (see
    /// `crate::cluster`).
    pub(crate) async fn end_here(&self, row: &SandboxRow) {
        self.previews.close(&row.id, None);
        self.terminals.close(&row.id);
        self.activity.forget(&row.id);
        self.note_secrets_used_by(row).await;
        let destroyed = match self.machines_for(row).await {
            Ok(machines) => machines.destroy(&row.id).await.map_err(|e| e.to_string()),
            Err(e) => Err(e.message),
        };
        match destroyed {
            Ok(Some(bytes)) => self.record_disk_use(&row.id, bytes).await,
            Ok(None) => {}
            Err(e) => tracing::warn!(id = %row.id, host = %row.host, "destroying the VM: {e}"),
        }
        self.flush_traffic(Some(&row.id)).await;
        self.previews.forget(&row.id);
    }

    /// Wake the reaper (an expiry moved earlier).
    pub(super) fn wake_reaper(&self) {
        self.reaper.notify_one();
    }

    /// End every expired sandbox; returns how long to sleep until the next expiry.
    pub(super) async fn reap_once(&self) -> Duration {
        let now = OffsetDateTime::now_utc();
        match self
            .store
            .expired_sandboxes(&self.config.host_name, now)
            .await
        {
            Ok(rows) => {
                for row in rows {
                    if let Err(e) = self
                        .end(&row, SandboxStatus::Deleted, "expired", Cause::by(EXPIRY))
                        .await
                    {
                        tracing::warn!(id = %row.id, "expiring: {e}");
                    }
                }
            }
            Err(e) => tracing::warn!("reaper: {e}"),
        }
        let next_snapshot = self.sweep_snapshots().await;
        // Template builds whose server went away stop moving, and builds asked
        // for whose steps never came: failed.
        let ago = |d: std::time::Duration| {
            OffsetDateTime::now_utc() - time::Duration::seconds(d.as_secs() as i64)
        };
        match self
            .store
            .fail_stalled_templates(
                ago(super::templates::STALLED_AFTER),
                ago(super::templates::WAITING_AFTER),
            )
            .await
        {
            Ok(0) => {}
            Ok(n) => tracing::warn!("{n} template build(s) stopped moving: failed"),
            Err(e) => tracing::warn!("reaper: template builds: {e}"),
        }
        // Template layers are a cache: one unused for as long as a snapshot
        // is kept, that no template starts from, goes (its save with the
        // next sweep).
        let unused = time::Duration::days(i64::from(self.config.snapshot_retention_days));
        match self
            .store
            .drop_stale_template_layers(OffsetDateTime::now_utc() - unused)
            .await
        {
            Ok(0) => {}
            Ok(n) => tracing::info!("{n} template layer(s) unused for {unused}: dropped"),
            Err(e) => tracing::warn!("reaper: template layers: {e}"),
        }
        let next_sandbox = self.store.next_expiry(&self.config.host_name).await;
        let next = next_sandbox.map(|n| match (n, next_snapshot) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        });
        match next {
            Ok(Some(next)) => {
                let d = next - OffsetDateTime::now_utc();
                if d.is_negative() {
                    Duration::from_millis(50)
                } else {
                    Duration::from_secs_f64(d.as_seconds_f64().min(60.0))
                        + Duration::from_millis(20)
                }
            }
            _ => Duration::from_secs(60),
        }
    }

    /// After a restart: expired sandboxes are destroyed, sandboxes whose VM
    /// vanished are failed (and refunded), half-created ones are failed,
    /// VM directories or QEMU processes that no live sandbox owns are
    /// removed, executions left `running` by the process that ran them
    /// are failed, and snapshots left half written (or whose files are
    /// gone) are deleted. Like all of it, that last assumes this process is the
    /// only service on its data directory.
    pub async fn reconcile(&self) -> Result<()> {
        let now = OffsetDateTime::now_utc();
        // A server killed mid-command never finished its record; its guest
        // (or the node it reached) cancelled the command when the
        // connection closed.
        let lost = self
            .store
            .fail_all_running_executions(&self.config.host_name, now)
            .await?;
        if lost > 0 {
            tracing::info!("{lost} commands were cut by the previous server's end: failed");
        }
        let Some(vms) = self.vms.clone() else {
            return Ok(());
        };
        let live = self.store.live_sandboxes(&self.config.host_name).await?;
        let mut keep = Vec::new();
        for row in &live {
            if row.expires_at <= now {
                self.end(row, SandboxStatus::Deleted, "expired", Cause::by(EXPIRY))
                    .await?;
                continue;
            }
            match row.status {
                SandboxStatus::Provisioning => {
                    self.end(
                        row,
                        SandboxStatus::Failed,
                        "failed: the server stopped while it was being created",
                        Cause::by(SANDPIT),
                    )
                    .await?;
                }
                SandboxStatus::Deleting => {
                    self.end(row, SandboxStatus::Deleted, "destroyed", Cause::by(SANDPIT))
                        .await?;
                }
                // `live_sandboxes` returns none that ended.
                SandboxStatus::Deleted | SandboxStatus::Failed => {}
                // Its VM is saved on disk, or it was lost.
                SandboxStatus::Paused => match vms.is_paused(&row.id) {
                    true => keep.push(row.id.clone()),
                    false => {
                        self.end(
                            row,
                            SandboxStatus::Failed,
                            "failed: its paused state vanished while the server was down",
                            Cause::by(SANDPIT),
                        )
                        .await?;
                    }
                },
                SandboxStatus::Running => match vms.state(&row.id) {
                    Some(VmState::Running) => keep.push(row.id.clone()),
                    Some(VmState::Exited { cause }) => {
                        self.end(
                            row,
                            SandboxStatus::Failed,
                            &format!("failed: {cause}"),
                            Cause::by(SANDPIT),
                        )
                        .await?;
                    }
                    None => {
                        self.end(
                            row,
                            SandboxStatus::Failed,
                            "failed: its VM vanished while the server was down",
                            Cause::by(SANDPIT),
                        )
                        .await?;
                    }
                },
            }
        }
        for vm in vms.list() {
            if !keep.contains(&vm.id) {
                tracing::info!(id = %vm.id, "removing a VM no live sandbox owns");
                let _ = vms.destroy(&vm.id).await;
            }
        }
        for dir in vms.stray_dirs() {
            if !keep.contains(&dir) {
                let _ = vms.destroy(&dir).await;
            }
        }
        vms.kill_orphan_qemus(&keep).await;
        // A snapshot the previous server was writing never finished (its
        // half save was removed when the VMs were opened), and one whose
        // files are gone cannot be started from: neither is kept.
        let on_disk = vms.snapshots();
        for snap in self.store.snapshots_on(&self.config.host_name).await? {
            let written = snap.status == sandpit_store::SnapshotStatus::Ready;
            if !written || !on_disk.contains(&snap.id) {
                tracing::info!(snapshot = %snap.id, "a snapshot with no files: deleted");
                self.store.delete_snapshot(&snap.id).await?;
            }
        }
        Ok(())
    }
}

pub(super) fn to_sandbox(r: &SandboxRow) -> Sandbox {
    Sandbox {
        id: r.id.clone(),
        object: "sandbox".into(),
        name: r.name.clone(),
        status: r.status,
        size: r.size.clone(),
        resources: Resources {
            vcpus: r.vcpus,
            memory_mb: r.memory_mb,
            disk_gb: r.disk_gb,
        },
        timeout_minutes: r.timeout_minutes,
        created_at: rfc3339(r.created_at),
        ready_at: r.ready_at.map(rfc3339),
        expires_at: rfc3339(r.expires_at),
        deleted_at: r.deleted_at.map(rfc3339),
        deleted_reason: r.deleted_reason.clone(),
        disk_used_bytes: r.disk_used_bytes,
        metadata: r.metadata.clone(),
        access_token: r.access_token.clone(),
        internet_access: r.internet_access,
        template_id: r.template_id.clone(),
        network: r
            .network
            .as_deref()
            .and_then(|n| serde_json::from_str(n).ok()),
        traffic_token: r
            .access_token
            .as_deref()
            .map(crate::private_preview::traffic_token),
        private_traffic: r.private_traffic,
    }
}

/// What sandbox `row` has cost from its creation to `until`: its seconds
/// paused at `paused_percent` of its price, the rest at its price.
pub(crate) fn cost_until(row: &SandboxRow, until: OffsetDateTime, paused_percent: u32) -> i64 {
    let lived = lived_seconds(row.created_at, until);
    let paused = row.paused_seconds_until(until).min(lived);
    cost(row.price_micros_per_hour, lived - paused)
        + cost(
            row.price_micros_per_hour * i64::from(paused_percent) / 100,
            paused,
        )
}

/// Seconds a sandbox lived from creation to `end` (rounded up), for billing.
pub(crate) fn lived_seconds(created: OffsetDateTime, end: OffsetDateTime) -> u64 {
    let d = end - created;
    if d.is_negative() {
        return 0;
    }
    let ms = d.whole_milliseconds() as u64;
    ms.div_ceil(1000)
}

#[async_trait::async_trait]
impl Sandboxes for Service {
    async fn create_sandbox(
        &self,
        caller: &Caller,
        req: CreateSandbox,
        idempotency_key: Option<String>,
    ) -> Result<(Sandbox, bool)> {
        self.create(caller, req, idempotency_key).await
    }

    /// The API's `get_sandbox`.
    async fn get_sandbox(&self, caller: &Caller, id: &str) -> Result<Sandbox> {
        Ok(to_sandbox(&self.owned(caller, id).await?))
    }

    /// The API's `list_sandboxes`.
    async fn list_sandboxes(&self, caller: &Caller, q: ListSandboxes) -> Result<List<Sandbox>> {
        let limit = page_limit(q.limit)?;
        if let Some(c) = &q.starting_after {
            if self
                .store
                .sandbox_of(&caller.account_id, c)
                .await?
                .is_none()
            {
                return Err(unknown_cursor("sandbox", c));
            }
        }
        let page = self
            .store
            .list_sandboxes(
                &caller.account_id,
                limit,
                q.starting_after.as_deref(),
                q.include_deleted.unwrap_or(false),
            )
            .await?;
        let data = page.data.iter().map(to_sandbox).collect();
        Ok(List::page(data, page.has_more, |s| s.id.clone()))
    }

    async fn update_network(
        &self,
        caller: &Caller,
        id: &str,
        lists: NetworkLists,
        internet_access: Option<bool>,
    ) -> Result<Sandbox> {
        self.replace_network(caller, id, lists, internet_access, None)
            .await
    }

    async fn update_network_and_rules(
        &self,
        caller: &Caller,
        id: &str,
        lists: NetworkLists,
        internet_access: Option<bool>,
        rules: NetworkRules,
    ) -> Result<Sandbox> {
        self.replace_network(caller, id, lists, internet_access, Some(rules))
            .await
    }

    /// The API's `extend_sandbox`.
    async fn extend_sandbox(
        &self,
        caller: &Caller,
        id: &str,
        additional_minutes: Option<u32>,
    ) -> Result<Sandbox> {
        let add = extension_minutes(&self.config, additional_minutes)?;
        let _one_at_a_time = self.extending.lock().await;
        let row = self.owned(caller, id).await?;
        let total = row.timeout_minutes as u64 + add as u64;
        if total > self.config.max_lifetime_minutes as u64 {
            return Err(CoreError::invalid(format!(
                "a sandbox may live at most {} minutes from creation; it has {} and asked for {add} more",
                self.config.max_lifetime_minutes, row.timeout_minutes
            )));
        }
        let extra = cost(row.price_micros_per_hour, add as u64 * 60);
        let new_expires = row.created_at + time::Duration::minutes(total as i64);
        // The VM's own watchdog learns the new expiry first: were it second,
        // a crash in between would kill a VM its owner had paid to keep.
        // Refused below, it goes back.
        // A node out of reach learns it at its next heartbeat (see
        // `crate::cluster`); its watchdog holds the old expiry until then.
        let machines = match row.is_live() {
            true => self.machines_for(&row).await.ok(),
            false => None,
        };
        let vm_expiry = match &machines {
            Some(m) => Some(m.set_expiry(id, new_expires).await),
            None => None,
        };
        let outcome = self
            .store
            .extend_sandbox(
                id,
                &caller.account_id,
                new_expires,
                total as u32,
                extra,
                &Cause::by(&caller.actor),
            )
            .await;
        if !matches!(outcome, Ok(ExtendOutcome::Extended(_))) && matches!(vm_expiry, Some(Ok(()))) {
            if let Some(m) = &machines {
                let _ = m.set_expiry(id, row.expires_at).await;
            }
        }
        match outcome? {
            ExtendOutcome::Extended(row) => Ok(to_sandbox(&row)),
            ExtendOutcome::InsufficientCredits { balance, needed } => Err(CoreError::new(
                ErrorType::InsufficientCredits,
                format!(
                    "{add} more minutes reserve ${:.6}, but the account has ${:.6} left",
                    usd(needed),
                    usd(balance)
                ),
            )),
            ExtendOutcome::NotLive(row) => Err(CoreError::conflict(format!(
                "sandbox {id} is {}; only a running sandbox can be extended",
                row.status
            ))),
        }
    }

    /// The API's `shorten_sandbox`: the store first (the reservation given
    /// back with the earlier expiry, in one transaction), then the VM's
    /// watchdog. Were the watchdog to miss it (a crash in between, a node
    /// out of reach), it would only kill later than asked: the reaper ends
    /// the sandbox on time by its row.
    async fn shorten_sandbox(
        &self,
        caller: &Caller,
        id: &str,
        timeout_minutes: u32,
    ) -> Result<Sandbox> {
        let _one_at_a_time = self.extending.lock().await;
        let row = self.owned(caller, id).await?;
        if !row.is_live() || row.status == SandboxStatus::Deleting {
            return Err(CoreError::conflict(format!(
                "sandbox {id} is {}; only a live sandbox's life can be shortened",
                row.status
            )));
        }
        if timeout_minutes == 0 || timeout_minutes >= row.timeout_minutes {
            return Err(CoreError::invalid(format!(
                "a shorter life is fewer minutes than its {}, and at least 1, not {timeout_minutes}",
                row.timeout_minutes
            )));
        }
        let new_expires = row.created_at + time::Duration::minutes(i64::from(timeout_minutes));
        let now = OffsetDateTime::now_utc();
        if new_expires <= now {
            return Err(CoreError::invalid(format!(
                "{timeout_minutes} minutes from its creation are over already ({} s ago)",
                (now - new_expires).whole_seconds()
            )));
        }
        let release = cost(
            row.price_micros_per_hour,
            u64::from(row.timeout_minutes) * 60,
        ) - cost(row.price_micros_per_hour, u64::from(timeout_minutes) * 60);
        let shortened = self
            .store
            .shorten_sandbox(
                id,
                &caller.account_id,
                new_expires,
                timeout_minutes,
                release.max(0),
                &Cause::by(&caller.actor),
            )
            .await?
            .ok_or_else(|| {
                CoreError::conflict(format!(
                    "sandbox {id} ended meanwhile; only a live sandbox's life can be shortened"
                ))
            })?;
        if let Ok(machines) = self.machines_for(&shortened).await {
            if let Err(e) = machines.set_expiry(id, new_expires).await {
                tracing::warn!(id, "the VM's watchdog keeps its later expiry: {e}");
            }
        }
        Ok(to_sandbox(&shortened))
    }

    /// The API's `destroy_sandbox`.
    async fn destroy_sandbox(&self, caller: &Caller, id: &str) -> Result<Sandbox> {
        let row = self.owned(caller, id).await?;
        if !row.is_live() {
            return Ok(to_sandbox(&row));
        }
        let _ = self
            .store
            .set_status(id, SandboxStatus::Deleting, None, &Cause::by(&caller.actor))
            .await;
        // As for create: a client that hangs up does not stop the teardown.
        let me = self
            .arc_self()
            .ok_or_else(|| CoreError::internal("the service is shutting down"))?;
        let cause = Cause::by(&caller.actor);
        let ended = tokio::spawn(async move {
            me.end(&row, SandboxStatus::Deleted, "destroyed", cause)
                .await
        })
        .await
        .map_err(|e| CoreError::internal(format!("the destroy task failed: {e}")))??;
        match ended {
            Some(row) => Ok(to_sandbox(&row)),
            None => Ok(to_sandbox(&self.owned(caller, id).await?)),
        }
    }

    async fn pause_sandbox(&self, caller: &Caller, id: &str) -> Result<Sandbox> {
        self.pause(caller, id).await
    }

    async fn resume_sandbox(&self, caller: &Caller, id: &str) -> Result<Sandbox> {
        self.resume(caller, id).await
    }

    async fn sandbox_metrics(&self, caller: &Caller, id: &str) -> Result<Vec<SandboxMetric>> {
        self.read_metrics(caller, id).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use time::macros::datetime;

    fn row(paused_at: Option<OffsetDateTime>, paused_seconds: u64) -> SandboxRow {
        let t0 = datetime!(2026-03-01 12:00:00 UTC);
        SandboxRow {
            id: "sbx_x".into(),
            account_id: "acct_x".into(),
            name: None,
            size: "small".into(),
            vcpus: 2,
            memory_mb: 1024,
            disk_gb: 4,
            timeout_minutes: 60,
            status: match paused_at {
                Some(_) => SandboxStatus::Paused,
                None => SandboxStatus::Running,
            },
            price_micros_per_hour: 90_000,
            host: "h".into(),
            created_at: t0,
            ready_at: Some(t0),
            expires_at: t0 + time::Duration::hours(1),
            deleted_at: None,
            deleted_reason: None,
            disk_used_bytes: 0,
            snapshot_id: None,
            paused_at,
            paused_seconds,
            metadata: Default::default(),
            env: Default::default(),
            access_token: None,
            every_port_public: false,
            internet_access: None,
            network: None,
            private_traffic: false,
            template_id: None,
            workdir: None,
            moving_to: None,
            moving_until: None,
        }
    }

    #[test]
    fn paused_time_is_billed_at_the_paused_rate() {
        let t0 = datetime!(2026-03-01 12:00:00 UTC);
        let hour = t0 + time::Duration::hours(1);
        // Never paused: the whole price (25 µ$/s for $0.09/h).
        assert_eq!(cost_until(&row(None, 0), hour, 10), 90_000);
        // Paused 20 minutes before, and since 10 minutes to the hour: 30
        // minutes at 10%.
        let r = row(Some(t0 + time::Duration::minutes(50)), 20 * 60);
        assert_eq!(r.paused_seconds_until(hour), 30 * 60);
        assert_eq!(cost_until(&r, hour, 10), 45_000 + 4_500);
        // At 100% a pause saves nothing; at 0% it is free.
        assert_eq!(cost_until(&r, hour, 100), 90_000);
        assert_eq!(cost_until(&r, hour, 0), 45_000);
        // Paused time never exceeds the time lived.
        assert_eq!(cost_until(&row(None, 10_000), hour, 0), 0);
    }
}
