//! The core service: every behaviour of the API in one place.
//!
//! Ownership: every look-up is scoped to the calling account; another
//! account's sandbox is `not_found`, always. Money: creating and extending
//! reserve the whole timeout's cost, and ending a sandbox charges the
//! seconds it lived, exactly once. Lifetime: the reaper ends every sandbox
//! whose `expires_at` has passed; on start, `reconcile` settles what
//! happened while the server was down. (Money and lifetime in full are in
//! `lifecycle`, where they are kept.)
//!
//! This file holds the [`Service`] itself (its state, construction,
//! accessors, start and shutdown, this host's VM pool as operators and
//! tests see it) and the look-ups scoped to the calling account that every
//! call goes through. Each of the API's traits (see [`crate::api`]) is
//! implemented in the module of its subject:
//!
//! - `create`: a create, in its steps (order, placement, the store's
//!   outcome, the start).
//! - `lifecycle`: `Sandboxes` (get, list, extend, destroy; create, pause
//!   and resume handed to their modules); a sandbox's boot and its end; the
//!   reaper and `reconcile`.
//! - `disk`: what accounts' sandboxes take on the host's disk, and the
//!   sweep that holds an account's disk writes at its limit.
//! - `exec`: `Commands`: commands and their stored executions.
//! - `files`: `Files`: file transfers and their per-account slots.
//! - `ports`: `Ports`: exposed ports and preview URLs (the connections
//!   themselves are [`crate::preview`]'s).
//! - `snapshots`: `Snapshots`: snapshots, fork and restore, and the
//!   snapshot sweep.
//! - `pause`: pause, resume, and the resume a call needing the VM does.
//! - `account`: `Accounts`: authentication, usage, the account, the
//!   service's info.
//! - `terminals`: `Terminals`: interactive shells for people, their tokens,
//!   and hanging them up when their sandbox ends.
//! - `secrets`: `Secrets`: an account's secrets, and the broker of them a
//!   sandbox's VM gets (its egress: `network`).
//! - `checks`: the pure request checks, public for the fuzz targets and
//!   the fake.
//! - `errors`: how store and runtime failures read as API errors.
//! - `gauges`: what this member's world looks like now, for the metrics.

mod account;
mod checks;
mod create;
mod disk;
mod errors;
mod events;
mod exec;
mod fetch;
mod files;
mod gauges;
mod idle;
mod lifecycle;
mod moves;
mod network;
mod pause;
mod ports;
mod readings;
mod secrets;
pub use secrets::MAX_SANDBOX_SECRETS;
mod snapshots;
mod templates;
pub use templates::{parse_reference as parse_template_reference, MAX_TEMPLATE_FILES_BYTES};
mod terminals;
mod volume_files;
mod volumes;

pub use events::{check_webhooks_config, refused_range, signature, RETRY_AFTER};
pub use terminals::{check_terminal_size, MAX_TERMINALS, MAX_TERMINAL_CELLS, TERMINAL_TOKEN_TTL};
pub use volumes::{check_mount_path, check_volume_name, MAX_SANDBOX_VOLUMES, VOLUME_STUCK_AFTER};

pub use checks::{
    check_create, check_path, check_port, check_write_size, extension_minutes, page_limit,
    unknown_cursor, validate_exec, write_content,
};
pub use files::TRANSFER_WAIT;
pub(crate) use lifecycle::cost_until;

use crate::api::Caller;
use crate::config::ServiceConfig;
use crate::error::{CoreError, Result};
use crate::idle::{Activity, Busy};
use crate::model::*;
use crate::preview::{PreviewLimits, Previews};
use errors::not_running;
use sandpit_host::local::LocalVms;
use sandpit_host::machines::Machines;
use sandpit_store::{SandboxRow, Store};
use std::sync::{Arc, Weak};
use std::time::Duration;
use tokio::sync::Notify;

/// The core service over this host's VMs and one store.
pub struct Service {
    config: ServiceConfig,
    store: Store,
    /// This machine's VMs; none on a control-plane replica
    /// (`serve --no-vms`), which reaches every VM through the nodes.
    vms: Option<Arc<LocalVms>>,
    reaper: Arc<Notify>,
    /// Webhook deliveries being POSTed by this process (see `events`).
    deliveries_in_flight: Arc<tokio::sync::Semaphore>,
    /// Held through an extension, from reading the sandbox to setting its
    /// VM's expiry: two extensions that read the same row would each
    /// store `timeout + add` (one of them lost, though both reserved), and
    /// one that read a row an earlier one had since extended would move
    /// the VM's watchdog back before the stored expiry, killing a sandbox
    /// its owner had paid to keep. Extensions are rare and quick.
    extending: tokio::sync::Mutex<()>,
    /// Open preview connections and their unflushed traffic.
    previews: Arc<Previews>,
    /// Open terminals, so a sandbox's end hangs them up.
    terminals: Arc<terminals::OpenTerminals>,
    /// Each account's file transfers in flight (see [`Service::transfer_slot`]).
    transfers: std::sync::Mutex<std::collections::HashMap<String, Arc<tokio::sync::Semaphore>>>,
    /// Whose disk writes are held now (see [`disk`]).
    disk_holds: disk::DiskHolds,
    /// Itself, for tasks that outlive a call (streaming exec).
    me: Weak<Service>,
    /// One start, pause or resume at a time per sandbox (see
    /// [`Service::boot`]), shared with the node API's starts.
    pub(crate) turns: Arc<sandpit_host::turns::Turns>,
    /// This node's place in a cluster sharing the database (see
    /// [`crate::cluster`]); unset on a database of its own.
    pub(crate) membership: std::sync::OnceLock<crate::cluster::Membership>,
    /// How this member reaches other nodes' sandboxes, when it can.
    pub(crate) node_link: std::sync::OnceLock<Arc<dyn sandpit_host::machines::NodeLink>>,
    /// What it read of the nodes lately.
    pub(crate) routes: crate::cluster::Routes,
    /// Sandboxes whose VM is being replaced here (a restore, a pause, a
    /// resume): a call that finds it gone meanwhile is told to retry, and
    /// does not fail the sandbox.
    restoring: std::sync::Mutex<std::collections::HashSet<String>>,
    /// Held by this member's drainer while it moves sandboxes away from
    /// draining nodes (see `service/moves.rs`): one at a time.
    draining: Arc<tokio::sync::Mutex<()>>,
    /// Whether this member moves draining nodes' sandboxes: a control
    /// plane does ([`Service::drain_for_the_cluster`]); a node alone does
    /// not (it may not reach the others).
    drains: std::sync::atomic::AtomicBool,
    /// Templates being fetched to a node by this member, one at a time
    /// per node and layer (see [`fetch`]).
    fetching: Arc<sandpit_host::turns::Turns>,
    /// Which sandboxes are in use, for the idle sweep (see [`crate::idle`]).
    activity: Arc<Activity>,
    /// Guests' resources read lately (see [`readings`]).
    readings: readings::Readings,
}

/// A VM being replaced (see [`Service::restoring`]); over when dropped.
pub(crate) struct Restoring<'a> {
    service: &'a Service,
    id: String,
    /// The mark every replica sees was written (in a cluster).
    shared: bool,
}

impl Drop for Restoring<'_> {
    fn drop(&mut self) {
        self.service.restoring.lock().unwrap().remove(&self.id);
        if self.shared {
            let (store, id) = (self.service.store.clone(), self.id.clone());
            tokio::spawn(async move {
                if let Err(e) = store.mark_vm_replacing(&id, None).await {
                    // It lapses on its own.
                    tracing::warn!(%id, "clearing the VM-replacing mark: {e}");
                }
            });
        }
    }
}

/// How long a VM-replacing mark holds at most, should the replica that
/// wrote it die before it clears it.
const REPLACING_BOUND: time::Duration = time::Duration::minutes(10);

/// How often preview traffic counters are written to the store.
const TRAFFIC_FLUSH: Duration = Duration::from_secs(2);
/// How often the executions of long-ended sandboxes are looked for.
const RETENTION_SWEEP: Duration = Duration::from_secs(3600);

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
        // Use is kept where the idle sweep runs (see `service/idle.rs`).
        let tracking = config.idle_pause_secs > 0 && vms.is_some();
        Arc::new_cyclic(|me| Service {
            config,
            store,
            vms,
            reaper: Arc::new(Notify::new()),
            deliveries_in_flight: Arc::new(tokio::sync::Semaphore::new(events::MOST_IN_FLIGHT)),
            extending: tokio::sync::Mutex::new(()),
            previews: Arc::new(Previews::new(limits)),
            terminals: Default::default(),
            transfers: Default::default(),
            disk_holds: Default::default(),
            me: me.clone(),
            turns: Default::default(),
            membership: std::sync::OnceLock::new(),
            node_link: std::sync::OnceLock::new(),
            routes: Default::default(),
            restoring: Default::default(),
            draining: Default::default(),
            drains: Default::default(),
            fetching: Default::default(),
            activity: Arc::new(Activity::new(tracking)),
            readings: Default::default(),
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

    pub(crate) fn disk_holds(&self) -> &disk::DiskHolds {
        &self.disk_holds
    }

    /// Settle what happened while no server ran, then start the reaper.
    pub async fn start(self: &Arc<Self>) -> Result<()> {
        self.reconcile().await?;
        if let Some(vms) = &self.vms {
            vms.start_tasks();
        }
        // The values its VMs' egress proxies lost with the last process.
        let me = self.clone();
        tokio::spawn(async move { me.resend_brokered_egress().await });
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
                if let Err(e) = svc.sweep_stuck_volumes(VOLUME_STUCK_AFTER).await {
                    tracing::warn!("settling stuck volumes: {e}");
                }
                if let Err(e) = svc.sweep_volume_files(VOLUME_STUCK_AFTER).await {
                    tracing::warn!("sweeping volumes' files: {e}");
                }
                if let Err(e) = svc.charge_volumes(time::OffsetDateTime::now_utc()).await {
                    tracing::warn!("charging volumes' storage: {e}");
                }
                if let Err(e) = svc.drop_old_events().await {
                    tracing::warn!("dropping old events: {e}");
                }
                drop(svc);
                tokio::time::sleep(RETENTION_SWEEP).await;
            }
        });
        let me = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(disk::DISK_SAMPLE).await;
                let Some(svc) = me.upgrade() else { return };
                if let Err(e) = svc.sample_disks().await {
                    tracing::warn!("measuring disk use: {e}");
                }
            }
        });
        // Webhook deliveries, on every control plane: each takes what is
        // due with a lease, so none is POSTed by two at once.
        let me = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                let Some(svc) = me.upgrade() else { return };
                let taken = svc.deliver_due().await;
                drop(svc);
                if taken == 0 {
                    tokio::time::sleep(events::DELIVERY_POLL).await;
                }
            }
        });
        if let Some(every) = self.idle_sweep_every() {
            let me = Arc::downgrade(self);
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(every).await;
                    let Some(svc) = me.upgrade() else { return };
                    svc.pause_idle_once(every).await;
                }
            });
        }
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

    /// The server is stopping: remove the warm pool's VMs (no sandbox owns
    /// them). Sandboxes keep running; the next start takes them over.
    pub async fn shutdown(&self) {
        if let Some(vms) = &self.vms {
            vms.drain_pool().await;
        }
    }

    /// Marks sandbox `id`'s VM as being replaced, until dropped.
    /// In a cluster the mark is also written to the store, where every
    /// replica's calls see it: a restore through one replica while another
    /// serves calls must not fail the sandbox there.
    async fn restoring(&self, id: &str) -> Restoring<'_> {
        self.restoring.lock().unwrap().insert(id.to_string());
        let mut shared = false;
        if self.membership().is_some() {
            let until = time::OffsetDateTime::now_utc() + REPLACING_BOUND;
            match self.store.mark_vm_replacing(id, Some(until)).await {
                Ok(()) => shared = true,
                Err(e) => tracing::warn!(id, "marking the VM as being replaced: {e}"),
            }
        }
        Restoring {
            service: self,
            id: id.to_string(),
            shared,
        }
    }

    /// Whether sandbox `id`'s VM is being replaced (a restore, a pause, a
    /// resume), here or, in a cluster, through any replica.
    async fn is_restoring(&self, id: &str) -> bool {
        if self.restoring.lock().unwrap().contains(id) {
            return true;
        }
        self.membership().is_some()
            && self
                .store
                .vm_replacing(id, time::OffsetDateTime::now_utc())
                .await
                .unwrap_or(false)
    }

    fn arc_self(&self) -> Option<Arc<Service>> {
        self.me.upgrade()
    }

    /// A sandbox of the caller's account; any other is `not_found`.
    async fn owned(&self, caller: &Caller, id: &str) -> Result<SandboxRow> {
        self.store
            .sandbox_of(&caller.account_id, id)
            .await?
            .ok_or_else(|| CoreError::not_found("sandbox", id))
    }

    /// A running sandbox of the caller (a paused one is resumed first), or
    /// why it cannot be used; not paused for idleness while the [`Busy`]
    /// mark lives (see [`crate::idle`]), so the caller holds it for as long
    /// as it uses the VM.
    async fn running(&self, caller: &Caller, id: &str) -> Result<(SandboxRow, Busy)> {
        // Marked before the row is read: a row read first could be stale by
        // a pause that began and ended in between.
        let busy = self.activity.begin(id).await;
        let row = match self.owned(caller, id).await {
            Ok(row) => row,
            Err(e) => {
                drop(busy);
                self.activity.forget(id);
                return Err(e);
            }
        };
        // A move under way: the call waits for it, then goes to the node
        // the sandbox is on.
        let row = if row.is_moving(time::OffsetDateTime::now_utc()) {
            match self.after_move(row).await {
                Ok(row) => row,
                Err(e) => {
                    drop(busy);
                    self.activity.forget(id);
                    return Err(e);
                }
            }
        } else {
            row
        };
        if row.status == SandboxStatus::Paused {
            return Ok((self.wake(&row, &caller.actor).await?, busy));
        }
        if row.status != SandboxStatus::Running {
            return Err(not_running(&row));
        }
        Ok((row, busy))
    }
}

/// This host's VMs and warm pool, for operators and tests.
impl Service {
    /// The accelerator this host's VMs use (`None`: it runs none).
    pub fn vms_accel(&self) -> Option<sandpit_runtime::Accel> {
        self.vms.as_ref().map(|vms| vms.manager().accel())
    }

    /// Ready VMs in the warm pool for `size`.
    pub fn warm_count(&self, size: &str) -> usize {
        self.vms.as_ref().map_or(0, |vms| vms.warm_count(size))
    }

    /// How many ready VMs the pool keeps for `size` now (its configured
    /// target, or deeper after a burst).
    pub fn pool_target(&self, size: &str) -> usize {
        self.vms.as_ref().map_or(0, |vms| {
            vms.pool_targets()
                .into_iter()
                .find(|(s, _)| s == size)
                .map_or(0, |(_, n)| n)
        })
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
}
