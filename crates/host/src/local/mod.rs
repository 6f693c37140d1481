//! The VMs of this host, as every caller sees them: create, destroy, a
//! long-lived connection to each guest agent, and a warm pool.
//!
//! The server keeps one agent connection per sandbox and multiplexes every
//! command and file transfer over it (QEMU serves one client per agent
//! socket). A connection that dropped (server restart, agent hiccup) is
//! re-established on the next use.
//!
//! The warm pool keeps a few restored, configured, never-used VMs per size.
//! A pooled VM already carries the id of the sandbox it will become (ids are
//! random and never shown before), so a create that finds one just takes it
//! off the queue: no boot, no restore, no rename. Taking is a pop under a
//! lock, so no VM is ever handed out twice; a VM taken for a create that then
//! fails its checks (credit, limits) goes back, still never used. One
//! background task refills the pool, one VM at a time, so refilling never
//! takes more than one core from live sandboxes. Creates that find the pool
//! empty restore a VM themselves (a size's first builds its snapshot
//! template: only a restored VM can be saved); at most `max_concurrent_starts`
//! run at once and `max_waiting_starts` more wait their turn, past which a
//! create is refused as busy rather than left to time out.
//!
//! The pool's depth follows demand: after a burst of creates it keeps as
//! many ready VMs as the burst took (up to `burst_max`), and shrinks back
//! once the burst is forgotten. Every start, the refill's included, is
//! admitted by the host's budget first (see [`crate::capacity`]).

use crate::capacity::{Capacity, CapacityConfig, CapacityReport};
use crate::ids::new_id;
use crate::machines::{
    Command, Download, Listing, Machines, PtySize, Started, Terminal, Tunnel, Upload, VmResult,
    Watch,
};
use async_trait::async_trait;
use sandpit_protocol::ExecRequest;
use sandpit_runtime::vm::process::Priority;
use sandpit_runtime::vm::volumes::{sync_volume_files, VmVolume};
use sandpit_runtime::{
    AfterSave, AgentClient, CreateVm, Egress, RuntimeError, VmManager, VmRecord, VmState,
};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use time::OffsetDateTime;
use tokio::sync::{Mutex, Notify, Semaphore};

mod machines;
mod pool;
mod volume_content;

use volume_content::{VolumeDownloading, VolumeReceiving, VolumeSending, VolumeUploading};

use pool::Demand;
pub use pool::PoolConfig;

/// How long the guest of a VM that stops may take to write its volumes'
/// cache out (a command may have left gigabytes dirty; a hostile guest may
/// never answer).
const VOLUME_SYNC_BOUND: Duration = Duration::from_secs(120);

/// The saved state of a paused VM is the save named this, then its id.
const PAUSED: &str = "paused-";

/// The save that holds paused VM `id` on its node: what a move of the
/// sandbox to another node carries there (as a snapshot is carried, see
/// `Machines::send_snapshot`), and what [`Machines::resume`] starts from.
///
/// [`Machines::resume`]: crate::machines::Machines::resume
pub fn paused_name(id: &str) -> String {
    format!("{PAUSED}{id}")
}

/// Metadata key that marks a VM as made for the pool.
const POOL_LABEL: &str = "pool";

/// This host's VMs.
pub struct LocalVms {
    manager: VmManager,
    agents: Mutex<HashMap<String, Arc<Mutex<Option<AgentClient>>>>>,
    pool: PoolConfig,
    /// Ready VMs per size, oldest first.
    ready: std::sync::Mutex<HashMap<String, VecDeque<String>>>,
    /// Pool VMs taken for a create that has not finished yet.
    claimed: std::sync::Mutex<HashSet<String>>,
    /// Pool VMs found dead, to remove.
    dead: std::sync::Mutex<Vec<String>>,
    refill: Arc<Notify>,
    stopping: AtomicBool,
    paused: AtomicBool,
    /// Held while a refill runs, so shutdown can wait for it to finish
    /// rather than cut a VM start in half.
    refilling: Mutex<()>,
    starts: Semaphore,
    waiting: AtomicUsize,
    /// When a create last took a pool VM (see [`REFILL_DELAY`]).
    last_take: std::sync::Mutex<Option<Instant>>,
    /// Held while a VM is saved or replaced by a snapshot: one at a time
    /// per host (two saves of one VM would fight over its QMP monitor, and
    /// saves are disk-bound anyway).
    saving: Mutex<()>,
    /// Whether the host has room for another VM (see [`crate::capacity`]).
    capacity: Capacity,
    /// Recent creates per size, which the pool learns its depth from.
    demand: std::sync::Mutex<HashMap<String, Demand>>,
    /// When a size's template build last failed (see
    /// [`LocalVms::ensure_template`]).
    template_failed: std::sync::Mutex<HashMap<String, Instant>>,
}

/// How long after a failed template build a size's starts boot cold
/// without trying another build.
const TEMPLATE_RETRY: Duration = Duration::from_secs(600);

impl LocalVms {
    /// VMs started on demand only.
    pub fn new(manager: VmManager) -> Arc<LocalVms> {
        LocalVms::with_pool(manager, PoolConfig::none())
    }

    /// VMs with a warm pool (started by [`LocalVms::start_tasks`]).
    pub fn with_pool(manager: VmManager, pool: PoolConfig) -> Arc<LocalVms> {
        LocalVms::with_budget(manager, pool, CapacityConfig::default())
    }

    /// VMs with a warm pool, admitted within the budget `capacity`.
    pub fn with_budget(
        manager: VmManager,
        pool: PoolConfig,
        capacity: CapacityConfig,
    ) -> Arc<LocalVms> {
        let starts = Semaphore::new(pool.max_concurrent_starts.max(1));
        Arc::new(LocalVms {
            manager,
            agents: Mutex::new(HashMap::new()),
            pool,
            ready: std::sync::Mutex::new(HashMap::new()),
            claimed: std::sync::Mutex::new(HashSet::new()),
            dead: std::sync::Mutex::new(Vec::new()),
            refill: Arc::new(Notify::new()),
            stopping: AtomicBool::new(false),
            paused: AtomicBool::new(false),
            refilling: Mutex::new(()),
            starts,
            waiting: AtomicUsize::new(0),
            last_take: std::sync::Mutex::new(None),
            saving: Mutex::new(()),
            capacity: Capacity::new(capacity),
            demand: std::sync::Mutex::new(HashMap::new()),
            template_failed: std::sync::Mutex::new(HashMap::new()),
        })
    }

    /// A create of `size` needs a VM now: remembered for the pool's depth.
    fn record_demand(&self, size: &str) {
        if self.pool.sizes.get(size).copied().unwrap_or(0) == 0 {
            return;
        }
        let memory = Duration::from_secs(self.pool.burst_memory_secs);
        self.demand
            .lock()
            .unwrap()
            .entry(size.to_string())
            .or_default()
            .record(Instant::now(), memory);
    }

    /// How many ready VMs the pool keeps for `size` now: its configured
    /// target, or as many as the largest recent burst took, up to
    /// `burst_max`.
    fn pool_target(&self, size: &str) -> usize {
        let base = self.pool.sizes.get(size).copied().unwrap_or(0);
        if base == 0 {
            return 0;
        }
        let memory = Duration::from_secs(self.pool.burst_memory_secs);
        let mut demand = self.demand.lock().unwrap();
        let peak = demand.get_mut(size).map_or(0, |d| {
            d.forget(Instant::now(), memory);
            d.peak()
        });
        base.max(peak.min(self.pool.burst_max))
    }

    /// This host's admission figures (`get_service_info`).
    pub fn capacity(&self) -> CapacityReport {
        self.capacity.report()
    }

    /// Charge a VM start to the host's budget, or refuse it.
    fn admit_start(&self) -> Result<crate::capacity::StartCharge<'_>, RuntimeError> {
        self.capacity.admit_start().map_err(RuntimeError::HostFull)
    }

    pub fn manager(&self) -> &VmManager {
        &self.manager
    }

    /// This host's volumes' files.
    pub fn volume_files(&self) -> sandpit_runtime::volume_files::VolumeFiles {
        sandpit_runtime::volume_files::VolumeFiles::new(self.manager.config().volumes_dir())
    }

    /// The VM of a new sandbox: the pool VM taken for it (see
    /// [`LocalVms::take_warm`]), or one restored or booted now, and keep its
    /// agent connection.
    pub async fn create(
        &self,
        id: &str,
        size: &str,
        expires_at: OffsetDateTime,
        egress: Egress,
        volumes: Vec<VmVolume>,
    ) -> Result<VmRecord, RuntimeError> {
        if self.claimed.lock().unwrap().remove(id) {
            // From a pool lease to the sandbox's own expiry.
            self.manager.set_expiry(id, expires_at)?;
            // Made for any sandbox: it gets this one's network before
            // anything of the sandbox's runs in it, and its volumes.
            self.ensure_egress(id, egress).await?;
            self.ensure_volumes(id, &volumes).await?;
            let record = self.manager.record(id)?;
            // It was made at background priority; now it is live.
            sandpit_runtime::vm::process::set_priority(record.qemu_pid, Priority::Normal);
            // Its clock was set at idle priority, perhaps late, and it may
            // have waited since: made right now that the guest runs.
            if let Ok(agent) = self.agent(id).await {
                agent.settle_clock(id).await;
            }
            return Ok(record);
        }
        // Someone waits for this one: a refill in flight gives way.
        let _live = self.manager.hold_background();
        let _slot = self.start_slot().await?;
        let _charged = self.admit_start()?;
        self.ensure_template(size).await;
        let req = CreateVm {
            id: id.to_string(),
            size: size.to_string(),
            metadata: BTreeMap::new(),
            expires_at,
            egress,
            volumes,
        };
        self.start_vm(req, Priority::Normal).await
    }

    /// Gives running VM `id` the volumes `volumes` it does not hold yet
    /// (see [`VmManager::mount_volumes`]).
    pub async fn ensure_volumes(&self, id: &str, volumes: &[VmVolume]) -> Result<(), RuntimeError> {
        if self.manager.record(id)?.volumes == volumes {
            return Ok(());
        }
        let agent = self.agent(id).await?;
        self.manager.mount_volumes(id, &agent, volumes).await
    }

    /// Before running VM `id` stops: what its guest caches of its volumes
    /// written to them, within [`VOLUME_SYNC_BOUND`] (a guest that stalls
    /// its agent gets no longer). The volumes it held, for
    /// [`sync_volume_files`] once its QEMU is gone.
    async fn sync_volumes(&self, id: &str) -> Vec<VmVolume> {
        let Ok(record) = self.manager.record(id) else {
            return Vec::new();
        };
        if record.volumes.is_empty() || self.manager.state(&record) != VmState::Running {
            return record.volumes;
        }
        let synced = async {
            let agent = self.agent(id).await?;
            self.manager.sync_volumes(id, &agent, false).await
        };
        match tokio::time::timeout(VOLUME_SYNC_BOUND, synced).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(id, "syncing its volumes before it stops: {e}"),
            Err(_) => tracing::warn!(
                id,
                "its volumes were not synced within {} s; it stops anyway",
                VOLUME_SYNC_BOUND.as_secs()
            ),
        }
        record.volumes
    }

    /// Gives running VM `id` the egress its sandbox has, if it has another
    /// (see [`VmManager::set_egress`]).
    pub async fn ensure_egress(&self, id: &str, egress: Egress) -> Result<(), RuntimeError> {
        if self.manager.record(id)?.egress == egress {
            return Ok(());
        }
        let agent = self.agent(id).await?;
        self.manager.set_egress(id, &agent, egress).await
    }

    /// The size's template, made now if it has none (see
    /// [`Machines::prepare`]): as a start, it waits its turn in the start
    /// queue and is admitted by the host's budget. Whether a template was
    /// made (or waited for) now.
    pub async fn prepare(&self, size: &str) -> Result<bool, RuntimeError> {
        if !self.manager.snapshots_supported() || self.manager.template(size).is_some() {
            return Ok(false);
        }
        let _live = self.manager.hold_background();
        let _slot = self.start_slot().await?;
        let _charged = self.admit_start()?;
        self.ensure_template(size).await;
        Ok(true)
    }

    /// Only a VM restored from its size's snapshot template can be saved
    /// (snapshot, fork, pause, idle sleep), and a size without a warm pool
    /// gets no template from the refill: its first start builds it (about
    /// a cold boot and three seconds more, once per size, image and QEMU;
    /// a build in flight, in this process or another on the data
    /// directory, is waited for) and then restores from it, rather than
    /// boot a sandbox that could never be saved. A failed build is not
    /// tried again for [`TEMPLATE_RETRY`]: meanwhile that size's starts
    /// boot cold, as they did before.
    async fn ensure_template(&self, size: &str) {
        if !self.manager.snapshots_supported() || self.manager.template(size).is_some() {
            return;
        }
        let failed = self.template_failed.lock().unwrap().get(size).copied();
        if failed.is_some_and(|at| at.elapsed() < TEMPLATE_RETRY) {
            return;
        }
        match self.manager.ensure_template(size).await {
            Ok(_) => {
                self.template_failed.lock().unwrap().remove(size);
            }
            Err(e) => {
                tracing::warn!(
                    size,
                    "no snapshot template for this size: its sandboxes boot cold and cannot be \
                     saved, paused or forked until one is built: {e}"
                );
                self.template_failed
                    .lock()
                    .unwrap()
                    .insert(size.to_string(), Instant::now());
            }
        }
    }

    /// The VM of a new sandbox started from snapshot `snapshot` (a save of
    /// this host's), and keep its agent connection.
    async fn create_from_snapshot(
        &self,
        id: &str,
        size: &str,
        snapshot: &str,
        expires_at: OffsetDateTime,
        egress: Egress,
        volumes: Vec<VmVolume>,
    ) -> Result<VmRecord, RuntimeError> {
        let vm = self
            .start_from_snapshot(id, size, snapshot, expires_at, egress, volumes)
            .await?;
        self.agents
            .lock()
            .await
            .insert(id.to_string(), Arc::new(Mutex::new(Some(vm.agent.clone()))));
        Ok(vm.record)
    }

    /// Replaces VM `id` by the one `snapshot` (a save of this host's)
    /// starts, while calls that need its agent wait for the new VM's: a
    /// call that attached to the new VM while it starts would take its
    /// agent socket from the start's own connection (QEMU serves one
    /// client per socket), and the start would time out. The old VM's
    /// pause save goes unless it is what starts.
    async fn replace_from_snapshot(
        &self,
        id: &str,
        size: &str,
        snapshot: &str,
        expires_at: OffsetDateTime,
        egress: Egress,
        volumes: Vec<VmVolume>,
    ) -> Result<(), RuntimeError> {
        let held_volumes = self.sync_volumes(id).await;
        let slot = self.agent_slot(id).await;
        let mut held = slot.lock().await;
        *held = None;
        match self.manager.destroy(id).await {
            Ok(()) | Err(RuntimeError::NotFound(_)) => {}
            Err(e) => return Err(e),
        }
        sync_volume_files(&self.manager.config().volumes_dir(), &held_volumes).await;
        if snapshot != paused_name(id) {
            self.manager.delete_saved(&paused_name(id)).await?;
        }
        let vm = self
            .start_from_snapshot(id, size, snapshot, expires_at, egress, volumes)
            .await?;
        *held = Some(vm.agent);
        Ok(())
    }

    /// A VM for sandbox `id` started from `snapshot`, within the host's
    /// start slots and budget.
    async fn start_from_snapshot(
        &self,
        id: &str,
        size: &str,
        snapshot: &str,
        expires_at: OffsetDateTime,
        egress: Egress,
        volumes: Vec<VmVolume>,
    ) -> Result<sandpit_runtime::Vm, RuntimeError> {
        let saved = self.manager.saved(snapshot)?;
        let _live = self.manager.hold_background();
        let _slot = self.start_slot().await?;
        let _charged = self.admit_start()?;
        self.manager
            .create_from_saved(
                CreateVm {
                    id: id.to_string(),
                    size: size.to_string(),
                    metadata: BTreeMap::new(),
                    expires_at,
                    egress,
                    volumes,
                },
                &saved,
            )
            .await
    }

    /// Saves VM `id` as snapshot `snapshot`; what the snapshot alone takes
    /// on disk.
    pub async fn snapshot(&self, id: &str, snapshot: &str) -> Result<u64, RuntimeError> {
        let _one_at_a_time = self.saving.lock().await;
        let _live = self.manager.hold_background();
        if self.manager.record(id)?.volumes.is_empty() {
            return Ok(self
                .manager
                .save(id, snapshot, AfterSave::Run)
                .await?
                .bytes());
        }
        // A snapshot holds no volume: its memory must not have one
        // mounted, whose cache would not match the volume it is started
        // with later (see `sandpit_runtime::vm::volumes`).
        let agent = self.agent(id).await?;
        if let Err(e) = self.manager.sync_volumes(id, &agent, true).await {
            // Those unmounted before the one that failed come back.
            let _ = self.manager.remount_volumes(id, &agent).await;
            return Err(match e {
                RuntimeError::Agent(e) => RuntimeError::Busy(format!(
                    "a snapshot unmounts the sandbox's volumes for a moment, and one could not \
                     be: {}",
                    e.message
                )),
                other => other,
            });
        }
        let saved = self.manager.save(id, snapshot, AfterSave::Run).await;
        let remounted = self.manager.remount_volumes(id, &agent).await;
        let bytes = saved?.bytes();
        remounted?;
        Ok(bytes)
    }

    /// Replaces VM `id` by one from snapshot `snapshot`, same id. The old
    /// VM goes only once the snapshot is known to be startable here.
    pub async fn restore(
        &self,
        id: &str,
        snapshot: &str,
        expires_at: OffsetDateTime,
        egress: Egress,
        volumes: Vec<VmVolume>,
    ) -> Result<(), RuntimeError> {
        let _one_at_a_time = self.saving.lock().await;
        let saved = self.manager.saved(snapshot)?;
        self.replace_from_snapshot(
            id,
            &saved.record.size,
            snapshot,
            expires_at,
            egress,
            volumes,
        )
        .await
    }

    /// The snapshots this host holds (not the saved state of paused VMs).
    pub fn snapshots(&self) -> Vec<String> {
        self.manager
            .list_saved()
            .into_iter()
            .filter(|name| !name.starts_with(PAUSED))
            .collect()
    }

    /// Whether VM `id` is paused here (its state saved, no VM running).
    pub fn is_paused(&self, id: &str) -> bool {
        self.manager.saved(&paused_name(id)).is_ok()
    }

    /// The ids of the VMs paused here.
    pub fn paused(&self) -> Vec<String> {
        self.manager
            .list_saved()
            .into_iter()
            .filter_map(|name| name.strip_prefix(PAUSED).map(str::to_string))
            .collect()
    }

    /// Move a sandbox's expiry (see [`sandpit_runtime::vm::expiry`]).
    pub fn set_expiry(&self, id: &str, at: OffsetDateTime) -> Result<(), RuntimeError> {
        self.manager.set_expiry(id, at)
    }

    /// Starts the VM `req` asks for, at CPU `priority`, and keeps its
    /// agent connection.
    async fn start_vm(&self, req: CreateVm, priority: Priority) -> Result<VmRecord, RuntimeError> {
        let id = req.id.clone();
        let vm = self.manager.create_with_priority(req, priority).await?;
        self.agents
            .lock()
            .await
            .insert(id, Arc::new(Mutex::new(Some(vm.agent.clone()))));
        Ok(vm.record)
    }

    /// A turn to start a VM, waiting in a bounded queue.
    /// The refusal of a start past the queue (`max_waiting_starts`).
    fn queue_full(&self) -> RuntimeError {
        RuntimeError::Busy(format!(
            "{} sandboxes are already waiting to start on this host; retry shortly",
            self.pool.max_waiting_starts
        ))
    }

    async fn start_slot(&self) -> Result<tokio::sync::SemaphorePermit<'_>, RuntimeError> {
        if let Ok(p) = self.starts.try_acquire() {
            return Ok(p);
        }
        if self.waiting.fetch_add(1, Ordering::SeqCst) >= self.pool.max_waiting_starts {
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(self.queue_full());
        }
        let permit = self.starts.acquire().await;
        self.waiting.fetch_sub(1, Ordering::SeqCst);
        permit.map_err(|_| RuntimeError::Busy("the host is shutting down".into()))
    }

    /// VM `id`'s agent slot, made if it has none: who holds its lock is
    /// the one attaching to (or replacing) that VM.
    async fn agent_slot(&self, id: &str) -> Arc<Mutex<Option<AgentClient>>> {
        self.agents
            .lock()
            .await
            .entry(id.to_string())
            .or_default()
            .clone()
    }

    /// The agent of a running VM (reconnecting if needed).
    pub async fn agent(&self, id: &str) -> Result<AgentClient, RuntimeError> {
        // One slot per VM: the map lock is held only to find the slot, and a
        // slow (re)attach holds only its own VM's slot, so a dead VM never
        // stalls other sandboxes, and two requests never attach twice (QEMU
        // serves one client per agent socket).
        let slot = self.agent_slot(id).await;
        let mut slot = slot.lock().await;
        if let Some(a) = slot.as_ref() {
            if !a.is_closed() {
                return Ok(a.clone());
            }
        }
        let vm = self.manager.attach(id).await?;
        *slot = Some(vm.agent.clone());
        Ok(vm.agent)
    }

    /// Kill the VM and remove its files. A VM that is already gone is fine.
    pub async fn destroy(&self, id: &str) -> Result<(), RuntimeError> {
        let volumes = self.sync_volumes(id).await;
        self.agents.lock().await.remove(id);
        match self.manager.destroy(id).await {
            Ok(()) | Err(RuntimeError::NotFound(_)) => {}
            Err(e) => return Err(e),
        }
        sync_volume_files(&self.manager.config().volumes_dir(), &volumes).await;
        // A paused VM's saved state goes with it.
        self.manager.delete_saved(&paused_name(id)).await
    }

    /// Is the VM running, or why not (`None`: no such VM on this host).
    pub fn state(&self, id: &str) -> Option<VmState> {
        let record = self.manager.record(id).ok()?;
        Some(self.manager.state(&record))
    }

    /// Every VM directory on this host.
    pub fn list(&self) -> Vec<VmRecord> {
        self.manager.list()
    }

    /// Kill QEMU processes of this data directory whose VM is not in `keep`
    /// (their directory is gone, or was never finished).
    pub async fn kill_orphan_qemus(&self, keep: &[String]) {
        let vms_dir = self.manager.config().vms_dir().display().to_string();
        let Ok(rd) = std::fs::read_dir("/proc") else {
            return;
        };
        for e in rd.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
                continue;
            };
            let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
                continue;
            };
            let cmdline = String::from_utf8_lossy(&cmdline);
            // Ours: a QEMU of a VM under this data directory.
            let Some(id) = cmdline
                .split('\0')
                .find_map(|a| a.strip_prefix("sandpit-vm-"))
                .and_then(|rest| rest.split(',').next())
            else {
                continue;
            };
            if !cmdline.contains(&vms_dir) || keep.iter().any(|k| k == id) {
                continue;
            }
            let marker = format!("sandpit-vm-{id}");
            tracing::info!(id, pid, "killing a QEMU no live sandbox owns");
            sandpit_runtime::vm::process::kill_and_wait(
                pid,
                &marker,
                std::time::Duration::from_secs(5),
            )
            .await;
        }
    }

    /// VM directories whose record is unreadable (a create that crashed early).
    pub fn stray_dirs(&self) -> Vec<String> {
        let known: Vec<String> = self.list().into_iter().map(|r| r.id).collect();
        let Ok(rd) = std::fs::read_dir(self.manager.config().vms_dir()) else {
            return Vec::new();
        };
        rd.flatten()
            .filter_map(|e| e.file_name().to_str().map(str::to_string))
            .filter(|n| !known.contains(n))
            .collect()
    }
}
