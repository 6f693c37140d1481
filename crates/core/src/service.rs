//! The core service: every behaviour of the API in one place.
//!
//! Ownership: every look-up is scoped to the calling account; another
//! account's sandbox is `not_found`, always. Money: creating and extending
//! reserve the cost of the whole timeout in the same store transaction that
//! checks the balance and the concurrency limit; ending a sandbox releases
//! the reservation and charges the seconds it lived (never more than was
//! reserved), exactly once. Lifetime: the reaper ends every sandbox whose
//! `expires_at` has passed; on start, `reconcile` settles what happened while
//! the server was down.

use crate::api::{Caller, ExecEvent, ExecStream, SandboxApi};
use crate::backend::LocalVms;
use crate::config::{cost, ServiceConfig, SizeConfig};
use crate::error::{CoreError, ErrorType, Result};
use crate::ids::{new_id, rfc3339};
use crate::machines::{Command, Listing, Machines, Started};
use crate::model::*;
use crate::preview::{preview_url, PreviewConn, PreviewError, PreviewLimits, Previews};
use crate::utf8::Utf8Chunker;
use async_trait::async_trait;
use base64::Engine;
use sandpit_protocol::{ErrorKind, ExecRequest};
use sandpit_runtime::{ExecEvent as VmEvent, RuntimeError, VmState};
use sandpit_store::{
    exec_status, status, CreateOutcome, ExecutionResult, ExecutionRow, ExtendOutcome, SandboxRow,
    Store, StoreError,
};
use sha2::Digest;
use std::sync::{Arc, Weak};
use std::time::Duration;
use time::OffsetDateTime;
use tokio::sync::{mpsc, oneshot, Notify};

/// The core service over this host's VMs and one store.
pub struct Service {
    config: ServiceConfig,
    store: Store,
    /// This machine's VMs; none on a control-plane replica
    /// (`serve --no-vms`), which reaches every VM through the nodes.
    vms: Option<Arc<LocalVms>>,
    reaper: Arc<Notify>,
    /// Held through an extension, from reading the sandbox to setting its
    /// VM's expiry: two extensions that read the same row would each
    /// store `timeout + add` (one of them lost, though both reserved), and
    /// one that read a row an earlier one had since extended would move
    /// the VM's watchdog back before the stored expiry, killing a sandbox
    /// its owner had paid to keep. Extensions are rare and quick.
    extending: tokio::sync::Mutex<()>,
    /// Open preview connections and their unflushed traffic.
    previews: Arc<Previews>,
    /// Each account's file transfers in flight (see [`Service::transfer_slot`]).
    transfers: std::sync::Mutex<std::collections::HashMap<String, Arc<tokio::sync::Semaphore>>>,
    /// Whose disk writes are held now (see [`crate::disk`]).
    disk_holds: crate::disk::DiskHolds,
    /// Itself, for tasks that outlive a call (streaming exec).
    me: Weak<Service>,
    /// One start at a time per sandbox (see [`Service::boot`]).
    booting: std::sync::Mutex<std::collections::HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// This node's place in a cluster sharing the database (see
    /// [`crate::cluster`]); unset on a database of its own.
    pub(crate) membership: std::sync::OnceLock<crate::cluster::Membership>,
    /// How this member reaches other nodes' sandboxes, when it can.
    pub(crate) node_link: std::sync::OnceLock<Arc<dyn crate::cluster::NodeLink>>,
    /// What it read of the nodes lately.
    pub(crate) routes: crate::cluster::Routes,
}

/// How often preview traffic counters are written to the store.
const TRAFFIC_FLUSH: Duration = Duration::from_secs(2);
/// How long opening a preview connection may take, end to end.
const PREVIEW_CONNECT_TIMEOUT: Duration = Duration::from_secs(15);
/// How long a file transfer waits for one of its account's slots.
pub const TRANSFER_WAIT: Duration = Duration::from_secs(30);
/// How long an idempotent retry of a create waits for the first call's
/// start to finish.
const REPLAY_WAIT: Duration = Duration::from_secs(60);
/// How often the executions of long-ended sandboxes are looked for.
const RETENTION_SWEEP: Duration = Duration::from_secs(3600);

impl From<StoreError> for CoreError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::NotFound(what) => {
                CoreError::new(ErrorType::NotFound, format!("{what} not found"))
            }
            StoreError::Conflict(m) => CoreError::conflict(m),
            StoreError::Invalid(m) => CoreError::invalid(m),
            other => {
                tracing::error!("store: {other}");
                CoreError::new(
                    ErrorType::ServiceUnavailable,
                    "the database is unavailable; retry shortly",
                )
                .with_retry_after(1)
            }
        }
    }
}

/// A runtime failure as the API reports it.
pub(crate) fn runtime_error(e: RuntimeError) -> CoreError {
    match e {
        RuntimeError::Agent(a) => {
            let kind = match a.kind {
                ErrorKind::NotFound => ErrorType::NotFound,
                ErrorKind::PermissionDenied => ErrorType::Forbidden,
                ErrorKind::IsADirectory
                | ErrorKind::NotADirectory
                | ErrorKind::TooLarge
                | ErrorKind::InvalidPath
                | ErrorKind::InvalidRequest
                | ErrorKind::Unsupported => ErrorType::InvalidRequest,
                // Disk full, nothing listening and the like: the sandbox's
                // state prevents it.
                ErrorKind::Io | ErrorKind::ConnectionRefused | ErrorKind::TimedOut => {
                    ErrorType::Conflict
                }
            };
            CoreError::new(kind, a.message)
        }
        RuntimeError::VmExited { cause } => CoreError::conflict(format!(
            "the sandbox's VM has stopped ({cause}); create a new sandbox"
        )),
        RuntimeError::Disconnected(m) => CoreError::new(
            ErrorType::ServiceUnavailable,
            format!("lost the connection to the sandbox ({m}); retry"),
        )
        .with_retry_after(1),
        RuntimeError::Busy(m) => {
            CoreError::new(ErrorType::ServiceUnavailable, m).with_retry_after(2)
        }
        RuntimeError::AgentTimeout { what, secs } => CoreError::new(
            ErrorType::ServiceUnavailable,
            format!(
                "the sandbox did not answer {what} within {secs} s (it may be overloaded); \
                 it is still usable, retry"
            ),
        )
        .with_retry_after(1),
        RuntimeError::BootTimeout { secs, .. } => CoreError::new(
            ErrorType::ServiceUnavailable,
            format!("the VM did not boot within {secs} s; retry"),
        )
        .with_retry_after(1),
        other => {
            tracing::error!("runtime: {other}");
            CoreError::new(
                ErrorType::ServiceUnavailable,
                format!("the host cannot run this now: {other}"),
            )
            .with_retry_after(5)
        }
    }
}

fn to_sandbox(r: &SandboxRow) -> Sandbox {
    Sandbox {
        id: r.id.clone(),
        object: "sandbox".into(),
        name: r.name.clone(),
        status: SandboxStatus::parse(&r.status).unwrap_or(SandboxStatus::Failed),
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
    }
}

fn to_execution(r: &ExecutionRow) -> Execution {
    let status = match r.status.as_str() {
        exec_status::COMPLETED => ExecutionStatus::Completed,
        exec_status::TIMED_OUT => ExecutionStatus::TimedOut,
        exec_status::CANCELLED => ExecutionStatus::Cancelled,
        _ => ExecutionStatus::Failed,
    };
    Execution {
        id: r.id.clone(),
        object: "execution".into(),
        sandbox_id: r.sandbox_id.clone(),
        status,
        exit_code: r.exit_code,
        stdout: r.stdout.clone(),
        stderr: r.stderr.clone(),
        truncated: r.truncated,
        duration_ms: r.duration_ms,
        started_at: rfc3339(r.started_at),
        finished_at: r.finished_at.map(rfc3339),
    }
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

impl Service {
    /// A service over `store` and `vms`; call [`Service::start`] to reconcile
    /// and run the reaper.
    pub fn new(config: ServiceConfig, store: Store, vms: Arc<LocalVms>) -> Arc<Service> {
        Service::with_vms(config, store, Some(vms))
    }

    /// A service with no VMs of its own: a control-plane replica of a
    /// cluster, whose sandboxes all run on nodes (see [`crate::cluster`]).
    pub fn without_vms(config: ServiceConfig, store: Store) -> Arc<Service> {
        Service::with_vms(config, store, None)
    }

    fn with_vms(config: ServiceConfig, store: Store, vms: Option<Arc<LocalVms>>) -> Arc<Service> {
        let limits = PreviewLimits {
            max_connections: config.preview_max_connections,
            requests_per_second: config.preview_requests_per_second,
        };
        Arc::new_cyclic(|me| Service {
            config,
            store,
            vms,
            reaper: Arc::new(Notify::new()),
            extending: tokio::sync::Mutex::new(()),
            previews: Arc::new(Previews::new(limits)),
            transfers: Default::default(),
            disk_holds: Default::default(),
            me: me.clone(),
            booting: Default::default(),
            membership: std::sync::OnceLock::new(),
            node_link: std::sync::OnceLock::new(),
            routes: Default::default(),
        })
    }

    pub fn config(&self) -> &ServiceConfig {
        &self.config
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    /// This machine's VMs, when it runs any.
    pub(crate) fn vms(&self) -> Option<&Arc<LocalVms>> {
        self.vms.as_ref()
    }

    /// This machine's VMs as the service reaches any node's.
    pub(crate) fn local_vms(&self) -> Option<Arc<dyn Machines>> {
        self.vms.clone().map(|vms| vms as Arc<dyn Machines>)
    }

    pub(crate) fn disk_holds(&self) -> &crate::disk::DiskHolds {
        &self.disk_holds
    }

    /// Create an account with `credit_usd` (see [`crate::admin`]).
    pub async fn create_account(&self, name: &str, credit_usd: f64) -> Result<Account> {
        crate::admin::create_account(&self.store, &self.config, name, credit_usd).await
    }

    /// Settle what happened while no server ran, then start the reaper.
    pub async fn start(self: &Arc<Self>) -> Result<()> {
        self.reconcile().await?;
        if let Some(vms) = &self.vms {
            vms.start_pool();
        }
        let me = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(TRAFFIC_FLUSH).await;
                let Some(svc) = me.upgrade() else { return };
                svc.flush_traffic(None).await;
            }
        });
        let me = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                let Some(svc) = me.upgrade() else { return };
                if let Err(e) = svc.drop_old_executions().await {
                    tracing::warn!("dropping old executions: {e}");
                }
                drop(svc);
                tokio::time::sleep(RETENTION_SWEEP).await;
            }
        });
        let me = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(crate::disk::DISK_SAMPLE).await;
                let Some(svc) = me.upgrade() else { return };
                if let Err(e) = svc.sample_disks().await {
                    tracing::warn!("measuring disk use: {e}");
                }
            }
        });
        let me = Arc::downgrade(self);
        let wake = self.reaper.clone();
        tokio::spawn(async move {
            loop {
                let Some(svc) = me.upgrade() else { return };
                let woken = wake.notified();
                tokio::pin!(woken);
                woken.as_mut().enable();
                let nap = svc.reap_once().await;
                drop(svc);
                tokio::select! {
                    _ = tokio::time::sleep(nap) => {}
                    _ = woken => {}
                }
            }
        });
        Ok(())
    }

    /// The error for a call to `row`'s guest that failed with `e`: when
    /// the sandbox ended meanwhile (a destroy, the expiry), that it is no
    /// longer running, rather than "retry", which cannot help.
    async fn agent_failure(&self, row: &SandboxRow, e: RuntimeError) -> CoreError {
        // The VM is gone under a running sandbox: the sandbox failed.
        if let RuntimeError::VmExited { cause } | RuntimeError::NotFound(cause) = &e {
            if row.status == status::RUNNING {
                let _ = self
                    .end(row, status::FAILED, &format!("failed: {cause}"))
                    .await;
                return CoreError::conflict(format!(
                    "the sandbox's VM has stopped ({cause}); create a new sandbox"
                ));
            }
        }
        if !matches!(e, RuntimeError::Agent(_)) {
            if let Ok(Some(now)) = self.store.sandbox(&row.id).await {
                if now.status != status::RUNNING {
                    return not_running(&now);
                }
            }
        }
        runtime_error(e)
    }

    /// The error for a read of `row`'s guest that failed with `e`: a file
    /// over the read limit says the limit.
    async fn read_failure(&self, row: &SandboxRow, e: RuntimeError) -> CoreError {
        match e {
            RuntimeError::Agent(a) if a.kind == ErrorKind::TooLarge => CoreError::invalid(format!(
                "{}; the read limit is {} bytes",
                a.message, self.config.max_read_bytes
            )),
            e => self.agent_failure(row, e).await,
        }
    }

    /// One of the account's `max_concurrent_transfers` slots for a file
    /// read or write: its content, decoded and in flight, is in memory
    /// until it ends. Waits [`TRANSFER_WAIT`] at most.
    async fn transfer_slot(&self, caller: &Caller) -> Result<tokio::sync::OwnedSemaphorePermit> {
        let max = self.config.max_concurrent_transfers;
        let slots = {
            let mut all = self.transfers.lock().unwrap();
            // Entries nobody holds (no transfer, no waiter) go, so the map
            // stays as small as the number of accounts transferring now.
            all.retain(|_, s| Arc::strong_count(s) > 1);
            all.entry(caller.account_id.clone())
                .or_insert_with(|| Arc::new(tokio::sync::Semaphore::new(max as usize)))
                .clone()
        };
        match tokio::time::timeout(TRANSFER_WAIT, slots.acquire_owned()).await {
            Ok(Ok(permit)) => Ok(permit),
            _ => Err(CoreError::new(
                ErrorType::RateLimited,
                format!(
                    "this account has {max} file transfers in flight, its most; retry when one ends"
                ),
            )),
        }
    }

    /// Hold an account's stored executions to its budget (its oldest ended
    /// ones go first).
    async fn trim_executions(&self, account_id: &str) {
        let budget = self.config.execution_storage_bytes;
        match self.store.trim_executions(account_id, budget).await {
            Ok(0) => {}
            Ok(n) => tracing::debug!(%account_id, "deleted {n} old executions over the budget"),
            Err(e) => tracing::warn!(%account_id, "trimming executions: {e}"),
        }
    }

    /// Delete the executions of sandboxes that ended more than
    /// `execution_retention_days` ago. Returns how many went.
    pub async fn drop_old_executions(&self) -> Result<u64> {
        let keep = time::Duration::days(i64::from(self.config.execution_retention_days));
        let n = self
            .store
            .drop_ended_executions(OffsetDateTime::now_utc() - keep)
            .await?;
        if n > 0 {
            tracing::info!("deleted {n} executions of sandboxes ended over {keep} ago");
        }
        Ok(n)
    }

    /// The server is stopping: remove the warm pool's VMs (no sandbox owns
    /// them). Sandboxes keep running; the next start takes them over.
    pub async fn shutdown(&self) {
        if let Some(vms) = &self.vms {
            vms.drain_pool().await;
        }
    }

    /// End every expired sandbox; returns how long to sleep until the next expiry.
    async fn reap_once(&self) -> Duration {
        let now = OffsetDateTime::now_utc();
        match self
            .store
            .expired_sandboxes(&self.config.host_name, now)
            .await
        {
            Ok(rows) => {
                for row in rows {
                    if let Err(e) = self.end(&row, status::DELETED, "expired").await {
                        tracing::warn!(id = %row.id, "expiring: {e}");
                    }
                }
            }
            Err(e) => tracing::warn!("reaper: {e}"),
        }
        match self.store.next_expiry(&self.config.host_name).await {
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
    /// removed, and executions left `running` by the process that ran them
    /// are failed. Like all of it, that last assumes this process is the
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
                self.end(row, status::DELETED, "expired").await?;
                continue;
            }
            match row.status.as_str() {
                status::PROVISIONING => {
                    self.end(
                        row,
                        status::FAILED,
                        "failed: the server stopped while it was being created",
                    )
                    .await?;
                }
                status::DELETING => {
                    self.end(row, status::DELETED, "destroyed").await?;
                }
                _ => match vms.state(&row.id) {
                    Some(VmState::Running) => keep.push(row.id.clone()),
                    Some(VmState::Exited { cause }) => {
                        self.end(row, status::FAILED, &format!("failed: {cause}"))
                            .await?;
                    }
                    None => {
                        self.end(
                            row,
                            status::FAILED,
                            "failed: its VM vanished while the server was down",
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
        Ok(())
    }

    /// End a live sandbox: destroy its VM, release its reservation, charge
    /// what it used (up to its expiry at most; nothing if it failed), record
    /// why. Idempotent.
    async fn end(
        &self,
        row: &SandboxRow,
        end_status: &str,
        reason: &str,
    ) -> Result<Option<SandboxRow>> {
        self.end_here(row).await;
        let now = OffsetDateTime::now_utc();
        let billed_until = now.min(row.expires_at);
        // A VM found dead after its expiry ended on time (its watchdog
        // killed it, see `sandpit_runtime::expiry`): expired, not failed.
        // One found dead while its sandbox is being destroyed (a command
        // or a look-up saw the destroy's kill) was destroyed, not lost: the
        // destroy ends it, charged, whichever of the two gets here first.
        let destroying = end_status == status::FAILED
            && matches!(self.store.sandbox(&row.id).await, Ok(Some(r)) if r.status == status::DELETING);
        let (end_status, reason) = if end_status == status::FAILED && row.expires_at <= now {
            (status::DELETED, "expired")
        } else if destroying {
            (status::DELETED, "destroyed")
        } else {
            (end_status, reason)
        };
        // A sandbox the platform lost (its VM died, it never came up) is
        // not charged at all: the whole reservation comes back.
        let charge = if end_status == status::FAILED {
            0
        } else {
            cost(
                row.price_micros_per_hour,
                lived_seconds(row.created_at, billed_until),
            )
        };
        Ok(self
            .store
            .finish_sandbox(&row.id, end_status, reason, now, charge)
            .await?)
    }

    /// What ending a sandbox takes besides its row: its preview URLs here
    /// stop (before anything else), its VM goes with its last disk use
    /// recorded, its preview traffic is written. A VM on a node out of
    /// reach is removed by that node when it finds the sandbox ended (see
    /// `crate::cluster`).
    pub(crate) async fn end_here(&self, row: &SandboxRow) {
        self.previews.close(&row.id, None);
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

    async fn owned(&self, caller: &Caller, id: &str) -> Result<SandboxRow> {
        self.store
            .sandbox_of(&caller.account_id, id)
            .await?
            .ok_or_else(|| CoreError::not_found("sandbox", id))
    }

    /// A running sandbox of the caller, or why it cannot be used.
    async fn running(&self, caller: &Caller, id: &str) -> Result<SandboxRow> {
        let row = self.owned(caller, id).await?;
        if row.status != status::RUNNING {
            return Err(not_running(&row));
        }
        Ok(row)
    }

    /// Starts `req` in `row`'s sandbox, wherever its VM runs.
    async fn start_command(&self, row: &SandboxRow, req: ExecRequest) -> Result<Box<dyn Command>> {
        let machines = self.machines_for(row).await?;
        match machines.exec(&row.id, req).await {
            Ok(command) => Ok(command),
            Err(e) => Err(self.agent_failure(row, e).await),
        }
    }

    /// Start a command and feed its events to `tx`; returns the final execution.
    async fn run_exec(
        &self,
        row: &SandboxRow,
        command: String,
        mut handle: Box<dyn Command>,
        tx: Option<mpsc::Sender<ExecEvent>>,
        mut cancel: oneshot::Receiver<()>,
    ) -> Result<Execution> {
        let exec_id = new_id("exec_");
        let started = OffsetDateTime::now_utc();
        let mut record = ExecutionRow {
            id: exec_id.clone(),
            sandbox_id: row.id.clone(),
            account_id: row.account_id.clone(),
            command,
            status: exec_status::RUNNING.into(),
            exit_code: None,
            stdout: String::new(),
            stderr: String::new(),
            truncated: false,
            duration_ms: 0,
            started_at: started,
            finished_at: None,
        };
        // The command started first and its record is written while it
        // runs: the store's write is then off a short command's round trip.
        // A record that cannot be written stops the command (it is killed
        // with its process group) and the call fails.
        if let Err(e) = self
            .store
            .insert_execution_by(&record, Some(&self.config.host_name))
            .await
        {
            handle.cancel();
            return Err(e.into());
        }
        let (mut out, mut err) = (Utf8Chunker::new(), Utf8Chunker::new());
        let (mut stdout, mut stderr) = (String::new(), String::new());
        // The agent drops output past the limit itself; the host holds it to
        // that too, so a guest whose agent does not (a guest root that
        // replaced it) cannot fill the host's memory or the database.
        let limit = self.config.max_output_bytes as usize;
        let mut cut_here = false;
        let mut cancelled_by_client = false;
        let outcome = loop {
            let ev = tokio::select! {
                ev = handle.next() => ev,
                _ = &mut cancel, if !cancelled_by_client => {
                    cancelled_by_client = true;
                    handle.cancel();
                    continue;
                }
            };
            match ev {
                Ok(VmEvent::Stdout(b)) => {
                    let s = within(&stdout, out.push(&b), limit, &mut cut_here);
                    stdout.push_str(&s);
                    if let (Some(tx), false) = (&tx, s.is_empty()) {
                        let _ = tx.send(ExecEvent::Stdout(s)).await;
                    }
                }
                Ok(VmEvent::Stderr(b)) => {
                    let s = within(&stderr, err.push(&b), limit, &mut cut_here);
                    stderr.push_str(&s);
                    if let (Some(tx), false) = (&tx, s.is_empty()) {
                        let _ = tx.send(ExecEvent::Stderr(s)).await;
                    }
                }
                Ok(VmEvent::Exited(r)) => break Ok(r),
                Err(e) => break Err(e),
            }
        };
        let rest = within(&stdout, out.finish(), limit, &mut cut_here);
        stdout.push_str(&rest);
        let rest = within(&stderr, err.finish(), limit, &mut cut_here);
        stderr.push_str(&rest);
        let finished = OffsetDateTime::now_utc();
        let result = match outcome {
            Ok(r) => {
                let st = if r.timed_out {
                    exec_status::TIMED_OUT
                } else if r.cancelled || cancelled_by_client {
                    exec_status::CANCELLED
                } else {
                    exec_status::COMPLETED
                };
                ExecutionResult {
                    status: st.into(),
                    exit_code: r.exit_code.or(r.signal.map(|s| 128 + s)),
                    stdout,
                    stderr,
                    truncated: r.stdout_truncated || r.stderr_truncated || cut_here,
                    duration_ms: r.duration_ms,
                    finished_at: finished,
                }
            }
            Err(e) => {
                let _ = self
                    .store
                    .finish_execution(
                        &exec_id,
                        &ExecutionResult {
                            status: exec_status::FAILED.into(),
                            exit_code: None,
                            stdout,
                            stderr,
                            truncated: cut_here,
                            duration_ms: (finished - started).whole_milliseconds() as u64,
                            finished_at: finished,
                        },
                    )
                    .await;
                if let RuntimeError::Agent(_) = e {
                    return Err(runtime_error(e));
                }
                // The VM may have died under the command.
                let died = match self.machines_for(row).await {
                    Ok(machines) => machines.state(&row.id).await.ok().flatten(),
                    Err(_) => None,
                };
                if let Some(VmState::Exited { cause }) = died {
                    return Err(self
                        .agent_failure(row, RuntimeError::VmExited { cause })
                        .await);
                }
                return Err(self.agent_failure(row, e).await);
            }
        };
        let finished = self.store.finish_execution(&exec_id, &result).await?;
        self.trim_executions(&row.account_id).await;
        if finished {
            // Exactly what was written, so no need to read it back.
            record.status = result.status;
            record.exit_code = result.exit_code;
            record.stdout = result.stdout;
            record.stderr = result.stderr;
            record.truncated = result.truncated;
            record.duration_ms = result.duration_ms;
            record.finished_at = Some(result.finished_at);
            return Ok(to_execution(&record));
        }
        // Finished by someone else meanwhile (the sandbox ended): as stored.
        let row = self
            .store
            .execution(&exec_id)
            .await?
            .ok_or_else(|| CoreError::internal("the execution vanished"))?;
        Ok(to_execution(&row))
    }

    /// The accelerator this host's VMs use (`None`: it runs none).
    pub fn vms_accel(&self) -> Option<sandpit_runtime::Accel> {
        self.vms.as_ref().map(|vms| vms.manager().accel())
    }

    /// Boot the VM of a sandbox row in `provisioning`; running, or failed
    /// (and refunded) with the cause.
    pub(crate) async fn boot(
        &self,
        row: SandboxRow,
        machines: Arc<dyn Machines>,
    ) -> Result<SandboxRow> {
        // A second start of the same sandbox (a create retried while its
        // first call, or the replica that made it, is still at it or was
        // lost) waits for the first and takes its outcome.
        let id = row.id.clone();
        let turn = self
            .booting
            .lock()
            .unwrap()
            .entry(id.clone())
            .or_default()
            .clone();
        let held = match turn.clone().try_lock_owned() {
            Ok(t) => t,
            Err(_) => {
                let t = turn.clone().lock_owned().await;
                let now = self.store.sandbox(&id).await?;
                let now = now.ok_or_else(|| CoreError::not_found("sandbox", &id))?;
                if now.status != status::PROVISIONING {
                    drop(t);
                    drop(turn);
                    self.forget_boot(&id);
                    return match now.is_live() {
                        true => Ok(now),
                        false => Err(not_running(&now)),
                    };
                }
                t
            }
        };
        let outcome = self.start_vm(row, machines).await;
        drop(held);
        drop(turn);
        self.forget_boot(&id);
        outcome
    }

    /// Drops the start lock of a sandbox nobody waits on.
    fn forget_boot(&self, id: &str) {
        let mut booting = self.booting.lock().unwrap();
        if booting.get(id).is_some_and(|l| Arc::strong_count(l) == 1) {
            booting.remove(id);
        }
    }

    /// [`Service::boot`]'s start itself.
    async fn start_vm(&self, row: SandboxRow, machines: Arc<dyn Machines>) -> Result<SandboxRow> {
        match machines.start(&row.id, &row.size, row.expires_at).await {
            Ok(Started::Booted) => {
                let running = self
                    .store
                    .set_status(&row.id, status::RUNNING, None)
                    .await?;
                // Extended while it booted: the VM's watchdog has the old
                // expiry.
                if running.expires_at != row.expires_at {
                    let _ = machines.set_expiry(&row.id, running.expires_at).await;
                }
                Ok(running)
            }
            // A node records its start itself (see `crate::cluster`).
            Ok(Started::Recorded {
                ready_at,
                expires_at,
            }) => Ok(SandboxRow {
                status: status::RUNNING.into(),
                ready_at: Some(ready_at),
                expires_at,
                ..row
            }),
            Err(e) => {
                tracing::warn!(id = %row.id, host = %row.host, "create failed: {e}");
                let _ = machines.destroy(&row.id).await;
                let _ = self
                    .store
                    .finish_sandbox(
                        &row.id,
                        status::FAILED,
                        &format!("failed: {e}"),
                        OffsetDateTime::now_utc(),
                        0,
                    )
                    .await;
                Err(CoreError::new(
                    ErrorType::ServiceUnavailable,
                    format!(
                        "the sandbox's VM could not be started ({e}); nothing was charged, retry"
                    ),
                )
                .with_retry_after(5))
            }
        }
    }

    /// The sandbox an idempotent retry of a create finds, once its start
    /// is over: the first call may still be starting it, or may have been
    /// lost with its server (a replica killed mid-create), in which case
    /// the node that starts it records the outcome (see
    /// [`crate::cluster`]). Waits [`REPLAY_WAIT`] at most.
    async fn replayed(&self, mut row: SandboxRow) -> Result<SandboxRow> {
        if row.status == status::PROVISIONING {
            // The first call may have been lost before its start reached
            // the node: start it (one in flight there is joined, not
            // repeated; see `boot`), in a task that a client who hangs up
            // does not cut short.
            if let (Ok(machines), Some(me)) = (self.machines_for(&row).await, self.arc_self()) {
                let first = row.clone();
                let local = row.host == self.config.host_name && self.vms.is_some();
                let started = tokio::spawn(async move {
                    match local {
                        true => me.boot(first, machines).await.map(|_| ()),
                        false => machines
                            .start(&first.id, &first.size, first.expires_at)
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
        while row.status == status::PROVISIONING {
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

    /// Ready VMs in the warm pool for `size`.
    pub fn warm_count(&self, size: &str) -> usize {
        self.vms.as_ref().map_or(0, |vms| vms.warm_count(size))
    }

    /// Ids of the warm pool's ready VMs (for tests and operators).
    pub fn warm_ids(&self) -> Vec<String> {
        self.vms.as_ref().map_or(Vec::new(), |vms| vms.warm_ids())
    }

    /// Pool VMs being started now, and how many of those are stopped while
    /// live work runs (for tests and operators).
    pub fn background_starts(&self) -> (usize, usize) {
        self.vms
            .as_ref()
            .map_or((0, 0), |vms| vms.manager().background_starts())
    }

    /// Empty the warm pool and stop refilling it, or resume it.
    pub async fn set_pool_paused(&self, paused: bool) {
        if let Some(vms) = &self.vms {
            vms.pause_pool(paused).await;
        }
    }

    /// The runtime's record of a sandbox's VM on this host.
    pub fn vm_record(&self, id: &str) -> Option<sandpit_runtime::VmRecord> {
        self.vms.as_ref()?.manager().record(id).ok()
    }

    /// Ids of the VMs on this host (for tests and operators).
    pub fn vms_on_host(&self) -> Vec<String> {
        self.vms.as_ref().map_or(Vec::new(), |vms| {
            vms.list().into_iter().map(|r| r.id).collect()
        })
    }

    fn arc_self(&self) -> Option<Arc<Service>> {
        self.me.upgrade()
    }

    /// Write preview traffic counters to the store (of one sandbox, or all).
    async fn flush_traffic(&self, only: Option<&str>) {
        for (id, bytes_in, bytes_out) in self.previews.take_all() {
            if only.is_some_and(|o| o != id) {
                self.previews.restore(&id, bytes_in, bytes_out);
                continue;
            }
            if let Err(e) = self
                .store
                .add_preview_traffic(&id, bytes_in, bytes_out)
                .await
            {
                tracing::warn!(%id, "storing preview traffic: {e}");
                self.previews.restore(&id, bytes_in, bytes_out);
            }
        }
    }

    /// Can `port` of sandbox `id` be served through its preview URL now?
    /// Anyone with the URL may ask: no account is involved.
    /// Returns the node that holds the sandbox.
    pub async fn check_preview(&self, id: &str, port: u16) -> Result<String, PreviewError> {
        if let Some(host) = self.previews.recently_checked(id, port) {
            return Ok(host);
        }
        let epoch = self.previews.check_epoch();
        let unavailable = |e: StoreError| PreviewError::Unavailable {
            id: id.to_string(),
            message: e.to_string(),
        };
        let row = self
            .store
            .sandbox(id)
            .await
            .map_err(unavailable)?
            .ok_or_else(|| PreviewError::NoSuchSandbox(id.to_string()))?;
        // Gone from the moment it expires or its destroy starts, even while
        // the reaper or the destroy is still at work.
        let gone = |reason: &str| PreviewError::Gone {
            id: id.to_string(),
            reason: reason.to_string(),
        };
        if !row.is_live() {
            return Err(gone(row.deleted_reason.as_deref().unwrap_or(&row.status)));
        }
        if row.expires_at <= OffsetDateTime::now_utc() {
            return Err(gone("expired"));
        }
        if row.status == status::DELETING {
            return Err(gone("destroyed"));
        }
        if row.status != status::RUNNING {
            return Err(PreviewError::Unavailable {
                id: id.to_string(),
                message: format!("it is {}", row.status),
            });
        }
        let ports = self.store.list_ports(id).await.map_err(unavailable)?;
        if !ports.iter().any(|p| p.port == port) {
            return Err(PreviewError::PortClosed {
                id: id.to_string(),
                port,
            });
        }
        self.previews
            .remember_check(id, port, row.expires_at, &row.host, epoch);
        Ok(row.host)
    }

    /// Take one request of the allowance of sandbox `id`'s preview URLs
    /// (after [`Service::check_preview`]: only live sandboxes have one).
    pub fn admit_preview_request(&self, id: &str) -> Result<(), PreviewError> {
        self.previews.admit_request(id)
    }

    /// Open a connection to `port` of sandbox `id` for its preview URL:
    /// checked as [`Service::check_preview`], bounded in time, counted as
    /// the sandbox's preview traffic, and cut when the port is closed or the
    /// sandbox ends.
    pub async fn open_preview(&self, id: &str, port: u16) -> Result<PreviewConn, PreviewError> {
        let host = self.check_preview(id, port).await?;
        let slot = self.previews.admit_connection(id).await?;
        let (sid, p) = (id.to_string(), port);
        let gate = self.previews.connect_gate(id, port);
        let open = async {
            let _permit = gate.acquire().await;
            let machines =
                self.machines_on(&host, id)
                    .await
                    .map_err(|e| PreviewError::Unavailable {
                        id: sid.clone(),
                        message: e.message,
                    })?;
            machines.open_tunnel(id, port).await.map_err(|e| match e {
                RuntimeError::Agent(a) if a.kind == ErrorKind::ConnectionRefused => {
                    PreviewError::NotListening {
                        id: sid.clone(),
                        port: p,
                    }
                }
                RuntimeError::Agent(a) if a.kind == ErrorKind::TimedOut => PreviewError::Timeout {
                    id: sid.clone(),
                    port: p,
                },
                other => PreviewError::Unavailable {
                    id: sid.clone(),
                    message: other.to_string(),
                },
            })
        };
        let tunnel = tokio::time::timeout(PREVIEW_CONNECT_TIMEOUT, open)
            .await
            .map_err(|_| PreviewError::Timeout {
                id: id.to_string(),
                port,
            })??;
        let conn = self.previews.register(id, port, tunnel, slot);
        // Closed or ended while connecting: cut it now rather than serve it.
        if let Err(e) = self.check_preview(id, port).await {
            self.previews.close(id, Some(port));
            return Err(e);
        }
        Ok(conn)
    }

    /// Wake the reaper (an expiry moved earlier).
    fn wake_reaper(&self) {
        self.reaper.notify_one();
    }
}

#[async_trait]
impl SandboxApi for Service {
    async fn authenticate(&self, api_key: &str) -> Result<Caller> {
        match self.store.authenticate(api_key).await? {
            Some((_, acct)) => Ok(Caller {
                account_id: acct.id,
            }),
            None => Err(CoreError::unauthorized()),
        }
    }

    async fn create_sandbox(
        &self,
        caller: &Caller,
        req: CreateSandbox,
        idempotency_key: Option<String>,
    ) -> Result<(Sandbox, bool)> {
        let (size_name, size, timeout) =
            check_create(&self.config, &req, idempotency_key.as_deref())?;
        let price = size.price_micros_per_hour();
        let reserve = cost(price, timeout as u64 * 60);
        let now = OffsetDateTime::now_utc();
        let request_hash = hex::encode(sha2::Sha256::digest(
            serde_json::to_vec(&(&size_name, &req.name, timeout)).expect("json"),
        ));
        let mut refused = None;
        let mut placed = None;
        for target in self.placement(&size_name).await? {
            // A warm pool VM already carries the id its sandbox will have.
            // Taking it (a call to the node) overlaps the transaction's
            // start.
            let taken = std::sync::Mutex::new(None);
            let id = async {
                let warm = target.machines.take_warm(&size_name).await;
                let id = match &warm {
                    Ok(warm) => Some(warm.clone().unwrap_or_else(|| new_id("sbx_"))),
                    Err(e) => {
                        tracing::warn!(node = %target.host, "taking a warm VM: {e}");
                        None
                    }
                };
                *taken.lock().unwrap() = Some(warm);
                id
            };
            let new = sandpit_store::NewSandbox {
                id: String::new(),
                account_id: caller.account_id.clone(),
                name: req.name.clone(),
                size: size_name.clone(),
                vcpus: size.vcpus,
                memory_mb: size.memory_mb,
                disk_gb: size.disk_gb,
                timeout_minutes: timeout,
                price_micros_per_hour: price,
                host: target.host.clone(),
                host_epoch: target.epoch,
                created_at: now,
                expires_at: now + time::Duration::minutes(timeout as i64),
                reserve_micros: reserve,
                max_concurrent: None,
                disk_limit_bytes: Some(self.config.account_disk_bytes),
                idempotency: idempotency_key.clone().map(|k| (k, request_hash.clone())),
            };
            let outcome = self.store.create_sandbox_named(new, id).await;
            let warm = match taken.into_inner().unwrap() {
                Some(Err(e)) => {
                    refused = Some(format!("node {} is out of reach ({e})", target.host));
                    continue;
                }
                Some(Ok(warm)) => warm,
                None => None,
            };
            // A pool VM whose sandbox was not created goes back, never used.
            if let Some(id) = &warm {
                if !matches!(outcome, Ok(CreateOutcome::Created(_))) {
                    let _ = target.machines.return_warm(id, &size_name).await;
                }
            }
            match outcome? {
                // The node filled up or went silent since it was ranked:
                // the next one.
                CreateOutcome::HostFull { live, limit } => {
                    self.routes.refused();
                    refused = Some(format!("node {} is full ({live} of {limit})", target.host));
                }
                CreateOutcome::HostUnavailable => {
                    self.routes.refused();
                    refused = Some(format!("node {} left the cluster", target.host));
                }
                outcome => {
                    if matches!(outcome, CreateOutcome::Created(_)) {
                        self.routes.placed(&target.host);
                    }
                    placed = Some((outcome, target.machines));
                    break;
                }
            }
        }
        let Some((outcome, machines)) = placed else {
            return Err(CoreError::new(
                ErrorType::ServiceUnavailable,
                match refused {
                    Some(why) => format!(
                        "no node can take a {size_name} sandbox now (the last one tried: {why}); \
                         retry"
                    ),
                    None => "no node can take a sandbox now: none is up with room; retry".into(),
                },
            )
            .with_retry_after(5));
        };
        let row = match outcome {
            CreateOutcome::Created(row) => row,
            CreateOutcome::Replay(row) => return Ok((to_sandbox(&self.replayed(row).await?), true)),
            CreateOutcome::IdempotencyConflict => {
                return Err(CoreError::conflict(
                    "this Idempotency-Key was already used with a different request body",
                ))
            }
            CreateOutcome::InsufficientCredits { balance, needed } => {
                return Err(CoreError::new(
                    ErrorType::InsufficientCredits,
                    format!(
                        "a {size_name} sandbox for {timeout} minutes reserves ${:.6}, but the account has ${:.6} left; add credit or ask for a shorter timeout",
                        usd(needed),
                        usd(balance)
                    ),
                ))
            }
            CreateOutcome::TooManySandboxes { live, limit } => {
                return Err(CoreError::new(
                    ErrorType::RateLimited,
                    format!(
                        "the account has {live} live sandboxes, its limit is {limit}; destroy one first"
                    ),
                )
                .with_retry_after(10))
            }
            CreateOutcome::OverDiskLimit { used, limit } => {
                return Err(crate::disk::over_limit(used, limit))
            }
            CreateOutcome::HostUnavailable | CreateOutcome::HostFull { .. } => {
                return Err(CoreError::internal("placement refused after it was taken"))
            }
        };
        self.wake_reaper();
        // Boot in a task of its own: a client that hangs up mid-create must
        // not cancel the boot half-way (that would leave a VM and a
        // "provisioning" row behind). The sandbox is finished either way; the
        // client finds it with list_sandboxes or an idempotent retry.
        let me = self
            .arc_self()
            .ok_or_else(|| CoreError::internal("the service is shutting down"))?;
        tokio::spawn(async move { me.boot(row, machines).await })
            .await
            .map_err(|e| CoreError::internal(format!("the create task failed: {e}")))?
            .map(|row| (to_sandbox(&row), false))
    }

    async fn get_sandbox(&self, caller: &Caller, id: &str) -> Result<Sandbox> {
        Ok(to_sandbox(&self.owned(caller, id).await?))
    }

    async fn list_sandboxes(&self, caller: &Caller, q: ListSandboxes) -> Result<List<Sandbox>> {
        let limit = q.limit.unwrap_or(20);
        if !(1..=100).contains(&limit) {
            return Err(CoreError::invalid(format!(
                "limit must be between 1 and 100, not {limit}"
            )));
        }
        if let Some(c) = &q.starting_after {
            if self
                .store
                .sandbox_of(&caller.account_id, c)
                .await?
                .is_none()
            {
                return Err(CoreError::invalid(format!(
                    "starting_after {c:?} is not a sandbox of this account"
                )));
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
        let next = if page.has_more {
            page.data.last().map(|r| r.id.clone())
        } else {
            None
        };
        Ok(List::new(
            page.data.iter().map(to_sandbox).collect(),
            page.has_more,
            next,
        ))
    }

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
            .extend_sandbox(id, &caller.account_id, new_expires, total as u32, extra)
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

    async fn destroy_sandbox(&self, caller: &Caller, id: &str) -> Result<Sandbox> {
        let row = self.owned(caller, id).await?;
        if !row.is_live() {
            return Ok(to_sandbox(&row));
        }
        let _ = self.store.set_status(id, status::DELETING, None).await;
        // As for create: a client that hangs up does not stop the teardown.
        let me = self
            .arc_self()
            .ok_or_else(|| CoreError::internal("the service is shutting down"))?;
        let ended = tokio::spawn(async move { me.end(&row, status::DELETED, "destroyed").await })
            .await
            .map_err(|e| CoreError::internal(format!("the destroy task failed: {e}")))??;
        match ended {
            Some(row) => Ok(to_sandbox(&row)),
            None => Ok(to_sandbox(&self.owned(caller, id).await?)),
        }
    }

    async fn exec(&self, caller: &Caller, id: &str, params: ExecParams) -> Result<Execution> {
        let req = validate_exec(&self.config, &params)?;
        let row = self.running(caller, id).await?;
        // The command runs in a task of its own; if this call is dropped (the
        // client hung up), the cancel sender goes with it, the task kills the
        // command and records the execution as cancelled.
        let (cancel_tx, cancel) = oneshot::channel::<()>();
        let me = self
            .arc_self()
            .ok_or_else(|| CoreError::internal("the service is shutting down"))?;
        let task = tokio::spawn(async move {
            let command = req.command.clone();
            let handle = me.start_command(&row, req).await?;
            me.run_exec(&row, command, handle, None, cancel).await
        });
        let result = task
            .await
            .map_err(|e| CoreError::internal(format!("the exec task failed: {e}")))?;
        drop(cancel_tx);
        result
    }

    async fn exec_stream(
        &self,
        caller: &Caller,
        id: &str,
        params: ExecParams,
    ) -> Result<ExecStream> {
        let req = validate_exec(&self.config, &params)?;
        let row = self.running(caller, id).await?;
        // Started before the stream: a VM out of reach fails the call.
        let command = req.command.clone();
        let handle = self.start_command(&row, req).await?;
        let (tx, rx) = mpsc::channel(64);
        let (cancel_tx, cancel_rx) = oneshot::channel();
        let me = self.arc_self();
        tokio::spawn(async move {
            let Some(me) = me else { return };
            let last = match me
                .run_exec(&row, command, handle, Some(tx.clone()), cancel_rx)
                .await
            {
                Ok(exec) => ExecEvent::Exit(exec),
                Err(e) => ExecEvent::Error(e),
            };
            let _ = tx.send(last).await;
        });
        Ok(ExecStream {
            events: rx,
            cancel: Some(cancel_tx),
        })
    }

    async fn get_execution(&self, caller: &Caller, exec_id: &str) -> Result<Execution> {
        match self.store.execution(exec_id).await? {
            Some(r) if r.account_id == caller.account_id => Ok(to_execution(&r)),
            _ => Err(CoreError::not_found("execution", exec_id)),
        }
    }

    async fn write_file(&self, caller: &Caller, id: &str, req: WriteFile) -> Result<FileWritten> {
        let _slot = self.transfer_slot(caller).await?;
        let (path, bytes) = write_content(&self.config, req)?;
        let row = self.running(caller, id).await?;
        let machines = self.machines_for(&row).await?;
        let (path, n) = match machines.write_file(&row.id, &path, bytes).await {
            Ok(done) => done,
            Err(e) => return Err(self.agent_failure(&row, e).await),
        };
        Ok(FileWritten { path, bytes: n })
    }

    async fn upload_file(
        &self,
        caller: &Caller,
        id: &str,
        path: &str,
        size: u64,
        mut body: Box<dyn crate::api::ByteSource>,
    ) -> Result<FileWritten> {
        check_path(path)?;
        check_write_size(&self.config, size)?;
        let _slot = self.transfer_slot(caller).await?;
        let row = self.running(caller, id).await?;
        let machines = self.machines_for(&row).await?;
        // Dropped on any early return: the guest discards what it had.
        let mut upload = match machines.upload(&row.id, path, size).await {
            Ok(u) => u,
            Err(e) => return Err(self.agent_failure(&row, e).await),
        };
        let mut got = 0u64;
        while let Some(chunk) = body.next_chunk().await {
            let chunk = chunk.map_err(body_failed)?;
            got += chunk.len() as u64;
            if got > size {
                return Err(body_length(got, size));
            }
            if let Err(e) = upload.send(&chunk).await {
                return Err(self.agent_failure(&row, e).await);
            }
        }
        if got != size {
            return Err(body_length(got, size));
        }
        match upload.finish().await {
            Ok((path, bytes)) => Ok(FileWritten { path, bytes }),
            Err(e) => Err(self.agent_failure(&row, e).await),
        }
    }

    async fn download_file(
        &self,
        caller: &Caller,
        id: &str,
        path: &str,
    ) -> Result<crate::api::FileDownload> {
        check_path(path)?;
        let slot = self.transfer_slot(caller).await?;
        let row = self.running(caller, id).await?;
        let machines = self.machines_for(&row).await?;
        let limit = self.config.max_read_bytes;
        let mut download = match machines.download(&row.id, path, limit).await {
            Ok(d) => d,
            Err(e) => return Err(self.read_failure(&row, e).await),
        };
        let (tx, chunks) = mpsc::channel(4);
        let (path, size) = (download.path().to_string(), download.size());
        let me = self.arc_self();
        // Pieces go as fast as the client takes them (four at most wait);
        // the transfer slot is held until the last one went.
        tokio::spawn(async move {
            let _held = slot;
            loop {
                let piece = match download.next_chunk().await {
                    Ok(Some(piece)) => Ok(piece),
                    Ok(None) => return,
                    Err(e) => Err(match &me {
                        Some(svc) => svc.read_failure(&row, e).await,
                        None => runtime_error(e),
                    }),
                };
                let failed = piece.is_err();
                if tx.send(piece).await.is_err() || failed {
                    return;
                }
            }
        });
        Ok(crate::api::FileDownload { path, size, chunks })
    }

    async fn read_file(
        &self,
        caller: &Caller,
        id: &str,
        path: &str,
        encoding: Encoding,
    ) -> Result<FileContent> {
        check_path(path)?;
        let _slot = self.transfer_slot(caller).await?;
        let row = self.running(caller, id).await?;
        let machines = self.machines_for(&row).await?;
        let (path, bytes) = match machines
            .read_file(&row.id, path, self.config.max_read_bytes)
            .await
        {
            Ok(read) => read,
            Err(e) => return Err(self.read_failure(&row, e).await),
        };
        let n = bytes.len() as u64;
        let content = match encoding {
            Encoding::Utf8 => String::from_utf8(bytes).map_err(|_| {
                CoreError::invalid(format!(
                    "{path} is not valid UTF-8 text; read it with encoding \"base64\""
                ))
            })?,
            Encoding::Base64 => base64::engine::general_purpose::STANDARD.encode(&bytes),
        };
        Ok(FileContent {
            path,
            content,
            bytes: n,
            encoding,
        })
    }

    async fn list_files(
        &self,
        caller: &Caller,
        id: &str,
        path: Option<&str>,
        recursive: bool,
    ) -> Result<FileList> {
        let path = path.unwrap_or(sandpit_protocol::WORKSPACE);
        check_path(path)?;
        let row = self.running(caller, id).await?;
        let machines = self.machines_for(&row).await?;
        let Listing {
            path,
            entries,
            truncated,
        } = match machines
            .list_files(&row.id, path, recursive, self.config.max_list_entries)
            .await
        {
            Ok(listed) => listed,
            Err(e) => return Err(self.agent_failure(&row, e).await),
        };
        Ok(FileList {
            path,
            entries: entries
                .into_iter()
                .map(|e| FileEntry {
                    name: e.name,
                    kind: match e.kind {
                        sandpit_protocol::FileKind::File => EntryType::File,
                        sandpit_protocol::FileKind::Dir => EntryType::Dir,
                        sandpit_protocol::FileKind::Symlink => EntryType::Symlink,
                        sandpit_protocol::FileKind::Other => EntryType::Other,
                    },
                    size_bytes: e.size_bytes,
                })
                .collect(),
            truncated,
        })
    }

    async fn delete_file(
        &self,
        caller: &Caller,
        id: &str,
        path: &str,
        recursive: bool,
    ) -> Result<FileDeleted> {
        check_path(path)?;
        let row = self.running(caller, id).await?;
        let machines = self.machines_for(&row).await?;
        let path = match machines.delete_file(&row.id, path, recursive).await {
            Ok(path) => path,
            Err(e) => return Err(self.agent_failure(&row, e).await),
        };
        Ok(FileDeleted {
            path,
            deleted: true,
        })
    }

    async fn expose_port(&self, caller: &Caller, id: &str, port: u16) -> Result<Port> {
        check_port(port)?;
        let row = self.running(caller, id).await?;
        let url = preview_url(
            &self.config.preview_scheme,
            &self.config.preview_domain,
            port,
            &row.id,
        );
        let p = self.store.upsert_port(&row.id, port, &url).await?;
        Ok(Port {
            port: p.port,
            url: p.url,
            created_at: rfc3339(p.created_at),
        })
    }

    async fn list_ports(&self, caller: &Caller, id: &str) -> Result<List<Port>> {
        let row = self.owned(caller, id).await?;
        let ports = self.store.list_ports(&row.id).await?;
        Ok(List::new(
            ports
                .into_iter()
                .filter(|p| p.closed_at.is_none())
                .map(|p| Port {
                    port: p.port,
                    url: p.url,
                    created_at: rfc3339(p.created_at),
                })
                .collect(),
            false,
            None,
        ))
    }

    async fn close_port(&self, caller: &Caller, id: &str, port: u16) -> Result<()> {
        let row = self.owned(caller, id).await?;
        if self.store.close_port(&row.id, port).await? {
            self.previews.close(&row.id, Some(port));
            Ok(())
        } else {
            Err(CoreError::not_found("exposed port", &port.to_string()))
        }
    }

    async fn usage(&self, caller: &Caller, days: Option<u32>) -> Result<Usage> {
        let days = days.unwrap_or(30);
        if !(1..=366).contains(&days) {
            return Err(CoreError::invalid(format!(
                "days must be between 1 and 366, not {days}"
            )));
        }
        let now = OffsetDateTime::now_utc();
        let rows = self
            .store
            .usage(&caller.account_id, now - time::Duration::days(days as i64))
            .await?;
        let mut total = 0;
        let sandboxes = rows
            .iter()
            .map(|u| {
                let r = &u.sandbox;
                let end = r.deleted_at.unwrap_or(now).min(r.expires_at);
                let seconds = lived_seconds(r.created_at, end);
                let cost_micros = if r.is_live() {
                    cost(r.price_micros_per_hour, seconds)
                } else {
                    u.charged_micros
                };
                total += cost_micros;
                let (pending_in, pending_out) = self.previews.pending(&r.id);
                SandboxUsage {
                    preview_bytes_in: u.preview_bytes_in as u64 + pending_in,
                    preview_bytes_out: u.preview_bytes_out as u64 + pending_out,
                    id: r.id.clone(),
                    size: r.size.clone(),
                    seconds,
                    cost_usd: usd(cost_micros),
                    created_at: rfc3339(r.created_at),
                    deleted_at: r.deleted_at.map(rfc3339),
                    disk_used_bytes: r.disk_used_bytes,
                }
            })
            .collect();
        let balance = self.store.balance(&caller.account_id).await?;
        Ok(Usage {
            object: "usage".into(),
            credit_remaining_usd: usd(balance),
            period_days: days,
            total_cost_usd: usd(total),
            sandboxes,
        })
    }

    async fn account(&self, caller: &Caller) -> Result<Account> {
        let acct = self
            .store
            .account(&caller.account_id)
            .await?
            .ok_or_else(CoreError::unauthorized)?;
        crate::admin::account_object(&self.store, acct).await
    }

    async fn service_info(&self) -> Result<ServiceInfo> {
        // A replica without VMs describes its nodes' (they run the same
        // release and image).
        let m = self.vms.as_ref().map(|vms| vms.manager());
        let hosts = match self.membership() {
            Some(_) => self
                .store
                .placement_candidates()
                .await?
                .into_iter()
                .map(|c| c.node.name)
                .collect(),
            None => vec![self.config.host_name.clone()],
        };
        Ok(ServiceInfo {
            name: "Sandpit".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            sizes: self
                .config
                .sizes
                .iter()
                .map(|(name, s)| SizeInfo {
                    name: name.clone(),
                    resources: s.resources(),
                    price_usd_per_hour: s.price_usd_per_hour,
                })
                .collect(),
            default_timeout_minutes: self.config.default_timeout_minutes,
            max_timeout_minutes: self.config.max_timeout_minutes,
            max_lifetime_minutes: self.config.max_lifetime_minutes,
            max_concurrent_sandboxes: self.config.default_max_concurrent_sandboxes,
            acceleration: m.map_or("on the nodes".into(), |m| m.accel().to_string()),
            hosts,
            authentication: "send the account's API key as `Authorization: Bearer <key>` or `x-api-key: <key>`; over stdio (`sandpit mcp`) no key is needed".into(),
            guest: GuestInfo {
                os: "Debian GNU/Linux 12 (bookworm)".into(),
                kernel: m.map_or(String::new(), |m| m.image().kernel_release.clone()),
                user: format!("{} (uid {}), no sudo", sandpit_protocol::GUEST_USER, sandpit_protocol::GUEST_UID),
                workdir: sandpit_protocol::WORKSPACE.into(),
            },
            fast_start: crate::model::FastStartInfo {
                snapshots: m.is_some_and(|m| m.snapshots_supported()),
                warm_pool: self
                    .vms
                    .iter()
                    .flat_map(|vms| {
                        vms.pool_targets()
                            .into_iter()
                            .map(|(size, target)| crate::model::WarmPoolInfo {
                                ready: vms.warm_count(&size),
                                size,
                                target,
                            })
                    })
                    .collect(),
            },
            limits: crate::model::Limits::of(
                &self.config,
                sandpit_runtime::channel::REPLY_DEADLINE.as_secs(),
            ),
        })
    }
}

/// Why a sandbox that is not running cannot be used.
fn not_running(row: &SandboxRow) -> CoreError {
    let why = row
        .deleted_reason
        .as_deref()
        .map(|r| format!(" ({r})"))
        .unwrap_or_default();
    CoreError::conflict(format!(
        "sandbox {} is {}{why}; create a new one",
        row.id, row.status
    ))
}

/// What of `more` fits after `kept` within `limit` bytes (cut at a character
/// boundary); `cut` is set when anything was left out.
fn within(kept: &str, mut more: String, limit: usize, cut: &mut bool) -> String {
    let room = limit.saturating_sub(kept.len());
    if more.len() > room {
        let mut end = room;
        while !more.is_char_boundary(end) {
            end -= 1;
        }
        more.truncate(end);
        *cut = true;
    }
    more
}

// ---- request checks -------------------------------------------------------
//
// What the service checks of a request before it touches the store or a VM:
// functions of the configuration and the request only, public so that the
// fuzz targets (`fuzz/`) run exactly these.

/// What [`SandboxApi::create_sandbox`] checks of a request before anything
/// else: the size (its name and configuration) and the timeout it asks for.
pub fn check_create<'c>(
    config: &'c ServiceConfig,
    req: &CreateSandbox,
    idempotency_key: Option<&str>,
) -> Result<(String, &'c SizeConfig, u32)> {
    let size_name = req
        .size
        .clone()
        .unwrap_or_else(|| config.default_size.clone());
    let size = config.sizes.get(&size_name).ok_or_else(|| {
        CoreError::invalid(format!(
            "unknown size {size_name:?}; use one of: {}",
            config.sizes.keys().cloned().collect::<Vec<_>>().join(", ")
        ))
    })?;
    let timeout = req
        .timeout_minutes
        .unwrap_or(config.default_timeout_minutes);
    if timeout < 1 || timeout > config.max_timeout_minutes {
        return Err(CoreError::invalid(format!(
            "timeout_minutes must be between 1 and {}, not {timeout}",
            config.max_timeout_minutes
        )));
    }
    if let Some(n) = &req.name {
        if n.chars().count() > 200 {
            return Err(CoreError::invalid("name is at most 200 characters"));
        }
    }
    if let Some(k) = idempotency_key {
        if k.is_empty() || k.len() > 255 {
            return Err(CoreError::invalid(
                "Idempotency-Key must be 1 to 255 characters",
            ));
        }
    }
    Ok((size_name, size, timeout))
}

/// What [`SandboxApi::exec`] and [`SandboxApi::exec_stream`] check of a
/// command, and the agent request it becomes (defaults filled in).
pub fn validate_exec(config: &ServiceConfig, p: &ExecParams) -> Result<ExecRequest> {
    if p.command.trim().is_empty() {
        return Err(CoreError::invalid("command must not be empty"));
    }
    let timeout = p.timeout_ms.unwrap_or(config.exec_default_timeout_ms);
    if timeout < config.exec_min_timeout_ms || timeout > config.exec_max_timeout_ms {
        return Err(CoreError::invalid(format!(
            "timeout_ms must be between {} and {}, not {timeout}",
            config.exec_min_timeout_ms, config.exec_max_timeout_ms
        )));
    }
    const MAX_ARG: usize = crate::model::MAX_COMMAND_BYTES as usize;
    if p.command.len() > MAX_ARG {
        return Err(CoreError::invalid(format!(
            "command is {} bytes; a command can be at most {MAX_ARG} bytes (Linux's limit \
             on one argument): write a longer script with write_file and run that",
            p.command.len()
        )));
    }
    if p.cwd.as_ref().is_some_and(|c| c.len() > 4095) {
        return Err(CoreError::invalid("cwd is longer than 4095 bytes"));
    }
    let env = p.env.clone().unwrap_or_default();
    let mut env_bytes = 0usize;
    for (k, v) in &env {
        let len = k.len() + 1 + v.len();
        if len > MAX_ARG {
            return Err(CoreError::invalid(format!(
                "env {k} is {len} bytes; one variable can be at most {MAX_ARG} bytes"
            )));
        }
        env_bytes += len;
    }
    const MAX_ENV: usize = crate::model::MAX_ENV_BYTES as usize;
    if env_bytes > MAX_ENV {
        return Err(CoreError::invalid(format!(
            "env is {env_bytes} bytes in all; the limit is {MAX_ENV} bytes"
        )));
    }
    for k in env.keys() {
        let ok = !k.is_empty()
            && !k.as_bytes()[0].is_ascii_digit()
            && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
        if !ok {
            return Err(CoreError::invalid(format!(
                "env name {k:?} is not a valid variable name (letters, digits, _)"
            )));
        }
    }
    Ok(ExecRequest {
        command: p.command.clone(),
        cwd: p.cwd.clone(),
        env,
        timeout_ms: timeout,
        max_output_bytes: config.max_output_bytes,
    })
}

/// What [`SandboxApi::write_file`] checks of a request before it reaches a
/// sandbox: the path, and the content decoded and within the limit. Returns
/// the path as given and the bytes to write.
pub fn write_content(config: &ServiceConfig, req: WriteFile) -> Result<(String, Vec<u8>)> {
    let bytes = match req.encoding.unwrap_or_default() {
        Encoding::Utf8 => req.content.into_bytes(),
        Encoding::Base64 => base64::engine::general_purpose::STANDARD
            .decode(req.content.trim())
            .map_err(|e| CoreError::invalid(format!("content is not valid base64: {e}")))?,
    };
    check_write_size(config, bytes.len() as u64)?;
    check_path(&req.path)?;
    Ok((req.path, bytes))
}

/// A file of `size` bytes is within the write limit.
pub fn check_write_size(config: &ServiceConfig, size: u64) -> Result<()> {
    if size > config.max_write_bytes {
        return Err(CoreError::invalid(format!(
            "the file is {size} bytes; the limit is {} bytes",
            config.max_write_bytes
        )));
    }
    Ok(())
}

/// An upload's body failed before its end (the client went away).
pub(crate) fn body_failed(e: std::io::Error) -> CoreError {
    CoreError::invalid(format!("the request body ended early: {e}"))
}

/// An upload's body was not as long as it said.
pub(crate) fn body_length(got: u64, announced: u64) -> CoreError {
    CoreError::invalid(format!(
        "the request body carried {got} bytes, not the {announced} its Content-Length announced"
    ))
}

/// The minutes [`SandboxApi::extend_sandbox`] adds (checked before the
/// sandbox is looked up; the lifetime limit is checked against it after).
pub fn extension_minutes(config: &ServiceConfig, additional_minutes: Option<u32>) -> Result<u32> {
    let add = additional_minutes.unwrap_or(config.default_extend_minutes);
    if add < 1 {
        return Err(CoreError::invalid("additional_minutes must be at least 1"));
    }
    Ok(add)
}

/// A port [`SandboxApi::expose_port`] accepts.
pub fn check_port(port: u16) -> Result<()> {
    if port == 0 {
        return Err(CoreError::invalid("port must be between 1 and 65535"));
    }
    Ok(())
}

/// Paths are checked here only for what the guest cannot judge; permissions
/// are the guest user's own.
pub fn check_path(path: &str) -> Result<()> {
    sandpit_protocol::resolve_guest_path(path)
        .map(|_| ())
        .map_err(|e| CoreError::invalid(format!("bad path {path:?}: {}", e.message)))
}

#[cfg(test)]
mod output_cap_tests {
    use super::within;

    #[test]
    fn output_is_kept_up_to_the_limit_at_a_character_boundary() {
        let mut cut = false;
        assert_eq!(within("", "abc".into(), 10, &mut cut), "abc");
        assert!(!cut);
        assert_eq!(within("abcdefgh", "ijk".into(), 10, &mut cut), "ij");
        assert!(cut);
        let mut cut = false;
        // "é" is two bytes: one byte of room keeps none of it.
        assert_eq!(within("123456789", "é".into(), 10, &mut cut), "");
        assert!(cut);
        let mut cut = false;
        assert_eq!(within("0123456789", String::new(), 10, &mut cut), "");
        assert!(!cut);
    }
}
