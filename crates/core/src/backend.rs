//! The VMs of this host, as the core service sees them: create, destroy, a
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
//! empty restore (or boot) a VM themselves; at most `max_concurrent_starts`
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
};
use async_trait::async_trait;
use sandpit_protocol::ExecRequest;
use sandpit_runtime::process::Priority;
use sandpit_runtime::{
    AfterSave, AgentClient, CreateVm, RuntimeError, VmManager, VmRecord, VmState,
};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use time::OffsetDateTime;
use tokio::sync::{Mutex, Notify, Semaphore};

/// The warm pool and the bound on VM starts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PoolConfig {
    /// Restored, never-used VMs kept ready, per size name.
    pub sizes: BTreeMap<String, usize>,
    /// VM starts (restores or cold boots) for creates running at once.
    pub max_concurrent_starts: usize,
    /// Creates that may wait for a start; past that a create is refused
    /// (503, retry) instead of queueing without bound.
    pub max_waiting_starts: usize,
    /// The most ready VMs a size's pool grows to ahead of demand: after a
    /// burst of creates, the pool of that size is kept as deep as the
    /// burst was (at least its `sizes` target), so the next burst finds
    /// its VMs ready. 0: the pool stays at `sizes`.
    pub burst_max: usize,
    /// How long a burst is remembered, seconds; then the pool shrinks
    /// back to `sizes`.
    pub burst_memory_secs: u64,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            sizes: BTreeMap::from([("small".to_string(), 2)]),
            max_concurrent_starts: 8,
            max_waiting_starts: 128,
            burst_max: 24,
            burst_memory_secs: 900,
        }
    }
}

impl PoolConfig {
    /// No pool (VMs start on demand only).
    pub fn none() -> Self {
        PoolConfig {
            sizes: BTreeMap::new(),
            ..PoolConfig::default()
        }
    }
}

/// The saved state of a paused VM is the save named this, then its id.
const PAUSED: &str = "paused-";

fn paused_name(id: &str) -> String {
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
}

/// Creates that arrive within this span of each other are one burst.
const BURST_SPAN: Duration = Duration::from_secs(5);

/// When the creates of one size arrived (each needed a VM, warm or not),
/// for as long as bursts are remembered.
#[derive(Default)]
struct Demand(VecDeque<Instant>);

impl Demand {
    fn record(&mut self, at: Instant, memory: Duration) {
        self.0.push_back(at);
        self.forget(at, memory);
    }

    fn forget(&mut self, now: Instant, memory: Duration) {
        while self
            .0
            .front()
            .is_some_and(|t| now.duration_since(*t) > memory)
        {
            self.0.pop_front();
        }
    }

    /// The most creates that arrived within [`BURST_SPAN`] of each other.
    fn peak(&self) -> usize {
        let (mut best, mut start) = (0, 0);
        for end in 0..self.0.len() {
            while self.0[end].duration_since(self.0[start]) > BURST_SPAN {
                start += 1;
            }
            best = best.max(end + 1 - start);
        }
        best
    }
}

/// A pool VM has no sandbox, so no expiry of its own: it expires this long
/// after it was last renewed (every [`POOL_NAP`]), so if this process dies,
/// its pool VMs follow (see [`sandpit_runtime::expiry`]).
const POOL_LEASE: time::Duration = time::Duration::minutes(3);
/// The pool task's longest sleep when the pool is full, and how often pool
/// VMs' leases are renewed.
const POOL_NAP: Duration = Duration::from_secs(30);

/// A refill waits this long after a create took a pool VM, so that create
/// answers (and its first command starts) before a VM start competes with
/// it for the CPU.
const REFILL_DELAY: Duration = Duration::from_millis(100);

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

    /// The VM of a new sandbox: the pool VM taken for it (see
    /// [`LocalVms::take_warm`]), or one restored or booted now, and keep its
    /// agent connection.
    pub async fn create(
        &self,
        id: &str,
        size: &str,
        expires_at: OffsetDateTime,
    ) -> Result<VmRecord, RuntimeError> {
        if self.claimed.lock().unwrap().remove(id) {
            // From a pool lease to the sandbox's own expiry.
            self.manager.set_expiry(id, expires_at)?;
            let record = self.manager.record(id)?;
            // It was made at background priority; now it is live.
            sandpit_runtime::process::set_priority(record.qemu_pid, Priority::Normal);
            return Ok(record);
        }
        // Someone waits for this one: a refill in flight gives way.
        let _live = self.manager.hold_background();
        let _slot = self.start_slot().await?;
        let _charged = self.admit_start()?;
        self.start_vm(id, size, BTreeMap::new(), expires_at, Priority::Normal)
            .await
    }

    /// The VM of a new sandbox started from snapshot `snapshot` (a save of
    /// this host's), and keep its agent connection.
    async fn create_from_snapshot(
        &self,
        id: &str,
        size: &str,
        snapshot: &str,
        expires_at: OffsetDateTime,
    ) -> Result<VmRecord, RuntimeError> {
        let saved = self.manager.saved(snapshot)?;
        let _live = self.manager.hold_background();
        let _slot = self.start_slot().await?;
        let _charged = self.admit_start()?;
        let vm = self
            .manager
            .create_from_saved(
                CreateVm {
                    id: id.to_string(),
                    size: size.to_string(),
                    metadata: BTreeMap::new(),
                    expires_at,
                },
                &saved,
            )
            .await?;
        self.agents
            .lock()
            .await
            .insert(id.to_string(), Arc::new(Mutex::new(Some(vm.agent.clone()))));
        Ok(vm.record)
    }

    /// Saves VM `id` as snapshot `snapshot`; what the snapshot alone takes
    /// on disk.
    pub async fn snapshot(&self, id: &str, snapshot: &str) -> Result<u64, RuntimeError> {
        let _one_at_a_time = self.saving.lock().await;
        let _live = self.manager.hold_background();
        Ok(self
            .manager
            .save(id, snapshot, AfterSave::Run)
            .await?
            .bytes())
    }

    /// Replaces VM `id` by one from snapshot `snapshot`, same id. The old
    /// VM goes only once the snapshot is known to be startable here.
    pub async fn restore(
        &self,
        id: &str,
        snapshot: &str,
        expires_at: OffsetDateTime,
    ) -> Result<(), RuntimeError> {
        let _one_at_a_time = self.saving.lock().await;
        let saved = self.manager.saved(snapshot)?;
        LocalVms::destroy(self, id).await?;
        self.create_from_snapshot(id, &saved.record.size, snapshot, expires_at)
            .await
            .map(drop)
    }

    /// The snapshots this host holds (not the saved state of paused VMs).
    pub fn snapshots(&self) -> Vec<String> {
        self.manager
            .list_saved()
            .into_iter()
            .filter(|name| !name.starts_with(PAUSED))
            .collect()
    }

    /// Saves VM `id` and stops it (see [`Machines::pause`]).
    pub async fn pause(&self, id: &str) -> Result<(), RuntimeError> {
        let _one_at_a_time = self.saving.lock().await;
        let _live = self.manager.hold_background();
        let name = paused_name(id);
        // A pause that failed half-way left its save: it is stale.
        self.manager.delete_saved(&name).await?;
        self.manager.save(id, &name, AfterSave::Stay).await?;
        self.agents.lock().await.remove(id);
        match self.manager.destroy(id).await {
            Ok(()) | Err(RuntimeError::NotFound(_)) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Starts paused VM `id` again (see [`Machines::resume`]).
    pub async fn resume(&self, id: &str, expires_at: OffsetDateTime) -> Result<(), RuntimeError> {
        let _one_at_a_time = self.saving.lock().await;
        if matches!(LocalVms::state(self, id), Some(VmState::Running)) {
            return self.manager.set_expiry(id, expires_at);
        }
        let name = paused_name(id);
        let saved = self.manager.saved(&name)?;
        // What is left of a VM that died is no obstacle (but its saved
        // state is what resumes: not `LocalVms::destroy`).
        self.agents.lock().await.remove(id);
        match self.manager.destroy(id).await {
            Ok(()) | Err(RuntimeError::NotFound(_)) => {}
            Err(e) => return Err(e),
        }
        self.create_from_snapshot(id, &saved.record.size, &name, expires_at)
            .await?;
        self.manager.delete_saved(&name).await
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

    /// Move a sandbox's expiry (see [`sandpit_runtime::expiry`]).
    pub fn set_expiry(&self, id: &str, at: OffsetDateTime) -> Result<(), RuntimeError> {
        self.manager.set_expiry(id, at)
    }

    async fn start_vm(
        &self,
        id: &str,
        size: &str,
        metadata: BTreeMap<String, String>,
        expires_at: OffsetDateTime,
        priority: Priority,
    ) -> Result<VmRecord, RuntimeError> {
        let vm = self
            .manager
            .create_with_priority(
                CreateVm {
                    id: id.to_string(),
                    size: size.to_string(),
                    metadata,
                    expires_at,
                },
                priority,
            )
            .await?;
        self.agents
            .lock()
            .await
            .insert(id.to_string(), Arc::new(Mutex::new(Some(vm.agent.clone()))));
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

    /// Take a ready pool VM of `size` for a new sandbox; its id becomes the
    /// sandbox's id. `None` when the pool is empty.
    pub fn take_warm(&self, size: &str) -> Option<String> {
        loop {
            let id = self.ready.lock().unwrap().get_mut(size)?.pop_front()?;
            *self.last_take.lock().unwrap() = Some(Instant::now());
            self.refill.notify_one();
            if matches!(self.state(&id), Some(VmState::Running)) {
                self.claimed.lock().unwrap().insert(id.clone());
                return Some(id);
            }
            tracing::warn!(id, "a pool VM died while it waited; discarding it");
            self.discard_soon(id);
        }
    }

    /// Take the ready pool VM `id` for the sandbox of that id (a create that
    /// found it in this node's published pool, see [`LocalVms::ready_ids`]);
    /// `false` if it is not ready: taken since, or dead (then removed, so
    /// that a VM of that id can be started in its place).
    async fn take_ready(&self, id: &str) -> bool {
        let found = self.ready.lock().unwrap().iter_mut().find_map(|(size, q)| {
            let at = q.iter().position(|x| x == id)?;
            q.remove(at).map(|_| size.clone())
        });
        let Some(size) = found else {
            return false;
        };
        self.record_demand(&size);
        *self.last_take.lock().unwrap() = Some(Instant::now());
        self.refill.notify_one();
        if matches!(self.state(id), Some(VmState::Running)) {
            self.claimed.lock().unwrap().insert(id.to_string());
            return true;
        }
        tracing::warn!(id, "a pool VM died while it waited; discarding it");
        let _ = self.destroy(id).await;
        false
    }

    /// Put back a VM taken with [`LocalVms::take_warm`] whose create did not
    /// happen; nothing ever ran in it.
    pub fn return_warm(&self, id: &str, size: &str) {
        if self.claimed.lock().unwrap().remove(id) {
            self.ready
                .lock()
                .unwrap()
                .entry(size.to_string())
                .or_default()
                .push_front(id.to_string());
        }
    }

    /// How many ready VMs the pool holds for `size`.
    pub fn warm_count(&self, size: &str) -> usize {
        self.ready
            .lock()
            .unwrap()
            .get(size)
            .map_or(0, VecDeque::len)
    }

    /// The pool's target per size (sizes without a pool left out).
    pub fn pool_targets(&self) -> Vec<(String, usize)> {
        self.pool
            .sizes
            .keys()
            .map(|s| (s.clone(), self.pool_target(s)))
            .filter(|(_, n)| *n > 0)
            .collect()
    }

    /// The ready pool VMs' ids per pool size, oldest first.
    pub fn ready_ids(&self) -> BTreeMap<String, Vec<String>> {
        let ready = self.ready.lock().unwrap();
        self.pool_targets()
            .into_iter()
            .map(|(size, _)| {
                let ids = ready
                    .get(&size)
                    .map_or_else(Vec::new, |q| q.iter().cloned().collect());
                (size, ids)
            })
            .collect()
    }

    /// Ids of every ready pool VM.
    pub fn warm_ids(&self) -> Vec<String> {
        self.ready
            .lock()
            .unwrap()
            .values()
            .flat_map(|q| q.iter().cloned())
            .collect()
    }

    /// Leave a dead pool VM to the refill task to remove.
    fn discard_soon(&self, id: String) {
        self.dead.lock().unwrap().push(id);
        self.refill.notify_one();
    }

    /// Run `tick` every `period` until this host's VMs stop being served;
    /// between ticks the task holds no reference to them.
    fn every<F, Fut>(self: &Arc<Self>, period: Duration, tick: F)
    where
        F: Fn(Arc<LocalVms>) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send,
    {
        let me = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                let Some(vms) = me.upgrade() else { return };
                if vms.stopping.load(Ordering::SeqCst) {
                    return;
                }
                tick(vms).await;
                tokio::time::sleep(period).await;
            }
        });
    }

    /// Start the background tasks: the sampler of the VMs' CPU use (for
    /// admission), and those that keep the pool full and its leases
    /// renewed (when there is a pool).
    pub fn start_tasks(self: &Arc<Self>) {
        self.every(crate::capacity::SAMPLE_EVERY, |vms| async move {
            let _ = tokio::task::spawn_blocking(move || {
                let pids: Vec<u32> = vms
                    .manager
                    .list()
                    .iter()
                    .flat_map(|r| std::iter::once(r.qemu_pid).chain(r.passt_pid))
                    .collect();
                vms.capacity.sample(&pids);
                if vms.manager.config().ksm {
                    sandpit_runtime::ksm::pace();
                }
            })
            .await;
        });
        if self.pool.sizes.values().all(|n| *n == 0) {
            return;
        }
        // Leases are renewed on a clock of their own: a refill held up (a
        // template build on a busy host) must not let ready VMs lapse.
        self.every(POOL_NAP, |vms| async move { vms.renew_leases() });
        let me = Arc::downgrade(self);
        let wake = self.refill.clone();
        tokio::spawn(async move {
            let mut backoff = Duration::from_secs(1);
            loop {
                let Some(vms) = me.upgrade() else { return };
                if vms.stopping.load(Ordering::SeqCst) {
                    return;
                }
                let woken = wake.notified();
                tokio::pin!(woken);
                woken.as_mut().enable();
                let nap = match vms.refill_one().await {
                    Ok(true) => {
                        backoff = Duration::from_secs(1);
                        continue;
                    }
                    // A pool deeper than its sizes shrinks when its burst
                    // is forgotten: looked at again by then.
                    Ok(false) => {
                        POOL_NAP.min(Duration::from_secs(vms.pool.burst_memory_secs.max(1)))
                    }
                    Err(e) => {
                        tracing::warn!("refilling the warm pool: {e}; retrying in {backoff:?}");
                        let nap = backoff;
                        backoff = (backoff * 2).min(Duration::from_secs(60));
                        nap
                    }
                };
                drop(vms);
                tokio::select! {
                    _ = tokio::time::sleep(nap) => {}
                    _ = woken => {}
                }
            }
        });
    }

    /// Add one VM to the emptiest size below its target; `false` when every
    /// size is full. Dead pool VMs are dropped on the way.
    async fn refill_one(&self) -> Result<bool, RuntimeError> {
        let _refilling = self.refilling.lock().await;
        if self.stopping.load(Ordering::SeqCst) {
            return Ok(false);
        }
        let mut want: Option<(String, usize)> = None;
        // Deeper than a burst no longer remembered: the surplus goes.
        let mut surplus = Vec::new();
        let targets = self.pool_targets();
        {
            let mut ready = self.ready.lock().unwrap();
            for (size, target) in &targets {
                let q = ready.entry(size.clone()).or_default();
                let missing = target.saturating_sub(q.len());
                if missing > 0 && want.as_ref().is_none_or(|(_, m)| missing > *m) {
                    want = Some((size.clone(), missing));
                }
                while q.len() > *target {
                    surplus.extend(q.pop_back());
                }
            }
        }
        for id in surplus {
            tracing::debug!(id, "the pool shrinks: destroying a ready VM");
            let _ = self.destroy(&id).await;
        }
        let mut dead: Vec<String> = self
            .warm_ids()
            .into_iter()
            .filter(|id| !matches!(self.state(id), Some(VmState::Running)))
            .collect();
        for id in &dead {
            tracing::warn!(id, "a pool VM died while it waited; discarding it");
            for q in self.ready.lock().unwrap().values_mut() {
                q.retain(|x| x != id);
            }
        }
        dead.append(&mut self.dead.lock().unwrap());
        for id in dead {
            let _ = self.destroy(&id).await;
        }
        let Some((size, _)) = want else {
            return Ok(false);
        };
        if self.paused.load(Ordering::SeqCst) {
            return Ok(false);
        }
        if self.manager.snapshots_supported() && self.manager.template(&size).is_none() {
            self.manager.ensure_template(&size).await?;
        }
        let taken = self.last_take.lock().unwrap().map(|t| t.elapsed());
        if let Some(wait) = taken.and_then(|t| REFILL_DELAY.checked_sub(t)) {
            tokio::time::sleep(wait).await;
        }
        // Warm VMs never take the room creates need.
        let _charged = match self.admit_start() {
            Ok(charge) => charge,
            Err(e) => {
                tracing::debug!("the warm pool waits for room: {e}");
                return Ok(false);
            }
        };
        let id = new_id("sbx_");
        // Made with only the CPU nothing else wants: live sandboxes first.
        let record = self
            .start_vm(
                &id,
                &size,
                BTreeMap::from([(POOL_LABEL.to_string(), size.clone())]),
                OffsetDateTime::now_utc() + POOL_LEASE,
                Priority::Background,
            )
            .await?;
        if self.stopping.load(Ordering::SeqCst) || self.paused.load(Ordering::SeqCst) {
            let _ = self.destroy(&id).await;
            return Ok(false);
        }
        tracing::debug!(
            id,
            size,
            restored = record.template.is_some(),
            "pool VM ready"
        );
        self.ready
            .lock()
            .unwrap()
            .entry(size)
            .or_default()
            .push_back(id);
        Ok(true)
    }

    /// Push the expiry of every ready pool VM [`POOL_LEASE`] out: they live
    /// while this process does, and not much longer.
    ///
    /// The pool's lock is held while the leases are written: a VM taken in
    /// between (its sandbox's expiry written by [`LocalVms::create`]) would
    /// otherwise get a pool lease instead, and die 3 minutes after the
    /// renewal whatever its sandbox paid for (or outlive a shorter one).
    fn renew_leases(&self) {
        let until = OffsetDateTime::now_utc() + POOL_LEASE;
        let ready = self.ready.lock().unwrap();
        for id in ready.values().flatten() {
            if let Err(e) = self.manager.set_expiry(id, until) {
                tracing::debug!(id, "renewing a pool VM's lease: {e}");
            }
        }
    }

    /// Pause the pool (empty it and stop refilling) or resume it. For
    /// operators and the benchmark's empty-pool measurements.
    pub async fn pause_pool(&self, paused: bool) {
        self.paused.store(paused, Ordering::SeqCst);
        self.refill.notify_one();
        if paused {
            let _refilling = self.refilling.lock().await;
            self.empty_pool().await;
        }
    }

    /// Stop refilling and destroy every ready pool VM (server shutdown).
    pub async fn drain_pool(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        self.refill.notify_one();
        // A refill in flight finishes (and removes its VM) first.
        let _refilling = self.refilling.lock().await;
        self.empty_pool().await;
    }

    async fn empty_pool(&self) {
        let ids: Vec<String> = self
            .ready
            .lock()
            .unwrap()
            .values_mut()
            .flat_map(|q| q.drain(..))
            .collect();
        for id in ids {
            let _ = self.destroy(&id).await;
        }
    }

    /// The agent of a running VM (reconnecting if needed).
    pub async fn agent(&self, id: &str) -> Result<AgentClient, RuntimeError> {
        // One slot per VM: the map lock is held only to find the slot, and a
        // slow (re)attach holds only its own VM's slot, so a dead VM never
        // stalls other sandboxes, and two requests never attach twice (QEMU
        // serves one client per agent socket).
        let slot = self
            .agents
            .lock()
            .await
            .entry(id.to_string())
            .or_default()
            .clone();
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
        self.agents.lock().await.remove(id);
        match self.manager.destroy(id).await {
            Ok(()) | Err(RuntimeError::NotFound(_)) => {}
            Err(e) => return Err(e),
        }
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
            sandpit_runtime::process::kill_and_wait(
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

/// A command in a local guest; the warm pool's refills give way while it
/// runs.
struct LocalCommand {
    handle: sandpit_runtime::ExecHandle,
    _live: sandpit_runtime::Held,
}

#[async_trait]
impl Command for LocalCommand {
    async fn next(&mut self) -> VmResult<sandpit_runtime::ExecEvent> {
        self.handle.next().await
    }

    fn cancel(&self) {
        self.handle.cancel()
    }
}

struct LocalUpload {
    upload: sandpit_runtime::FileUpload,
    _live: sandpit_runtime::Held,
}

#[async_trait]
impl Upload for LocalUpload {
    async fn send(&mut self, data: &[u8]) -> VmResult<()> {
        self.upload.send(data).await
    }

    async fn finish(self: Box<Self>) -> VmResult<(String, u64)> {
        self.upload.finish().await
    }
}

struct LocalDownload {
    download: sandpit_runtime::FileDownload,
    _live: sandpit_runtime::Held,
}

#[async_trait]
impl Download for LocalDownload {
    fn path(&self) -> &str {
        self.download.path()
    }

    fn size(&self) -> u64 {
        self.download.size()
    }

    async fn next_chunk(&mut self) -> VmResult<Option<Vec<u8>>> {
        self.download.next_chunk().await
    }
}

#[async_trait]
impl Machines for LocalVms {
    async fn take_warm(&self, size: &str) -> VmResult<Option<String>> {
        self.record_demand(size);
        if self.warm_count(size) > 0 {
            self.capacity.admit_warm().map_err(RuntimeError::HostFull)?;
            if let Some(id) = LocalVms::take_warm(self, size) {
                return Ok(Some(id));
            }
        }
        // A start would be refused: refuse now, before anything is recorded.
        let room = self.capacity.report();
        if let (false, Some(why)) = (room.accepting, room.reason) {
            return Err(RuntimeError::HostFull(why));
        }
        // No warm VM: the start will boot one, in the start queue. A full
        // queue refuses now, before anything is recorded, so that a
        // cluster's create tries another node instead.
        if self.starts.available_permits() == 0
            && self.waiting.load(Ordering::SeqCst) >= self.pool.max_waiting_starts
        {
            return Err(self.queue_full());
        }
        Ok(None)
    }

    async fn return_warm(&self, id: &str, size: &str) -> VmResult<()> {
        LocalVms::return_warm(self, id, size);
        Ok(())
    }

    async fn start(
        &self,
        id: &str,
        size: &str,
        snapshot: Option<&str>,
        expires_at: OffsetDateTime,
    ) -> VmResult<Started> {
        if let Some(snapshot) = snapshot {
            match LocalVms::state(self, id) {
                Some(VmState::Running) => self.manager.set_expiry(id, expires_at)?,
                _ => drop(
                    self.create_from_snapshot(id, size, snapshot, expires_at)
                        .await?,
                ),
            }
            return Ok(Started::Booted);
        }
        let claimed = self.claimed.lock().unwrap().contains(id);
        let claimed = claimed || self.take_ready(id).await;
        if !claimed && matches!(LocalVms::state(self, id), Some(VmState::Running)) {
            self.manager.set_expiry(id, expires_at)?;
        } else {
            self.create(id, size, expires_at).await?;
        }
        Ok(Started::Booted)
    }

    async fn destroy(&self, id: &str) -> VmResult<Option<u64>> {
        let used = self.manager.disk_use(id).ok();
        LocalVms::destroy(self, id).await?;
        Ok(used)
    }

    async fn set_expiry(&self, id: &str, at: OffsetDateTime) -> VmResult<()> {
        self.manager.set_expiry(id, at)
    }

    async fn snapshot(&self, id: &str, snapshot: &str) -> VmResult<u64> {
        LocalVms::snapshot(self, id, snapshot).await
    }

    async fn delete_snapshot(&self, snapshot: &str) -> VmResult<()> {
        self.manager.delete_saved(snapshot).await
    }

    async fn restore(&self, id: &str, snapshot: &str, expires_at: OffsetDateTime) -> VmResult<()> {
        LocalVms::restore(self, id, snapshot, expires_at).await
    }

    async fn pause(&self, id: &str) -> VmResult<()> {
        LocalVms::pause(self, id).await
    }

    async fn resume(&self, id: &str, expires_at: OffsetDateTime) -> VmResult<()> {
        LocalVms::resume(self, id, expires_at).await
    }

    async fn state(&self, id: &str) -> VmResult<Option<VmState>> {
        Ok(LocalVms::state(self, id))
    }

    async fn exec(&self, id: &str, request: ExecRequest) -> VmResult<Box<dyn Command>> {
        let live = self.manager.hold_background();
        let handle = self.agent(id).await?.exec(request)?;
        Ok(Box::new(LocalCommand {
            handle,
            _live: live,
        }))
    }

    async fn upload(&self, id: &str, path: &str, size: u64) -> VmResult<Box<dyn Upload>> {
        let live = self.manager.hold_background();
        let upload = self.agent(id).await?.upload(path, size, None)?;
        Ok(Box::new(LocalUpload {
            upload,
            _live: live,
        }))
    }

    async fn download(&self, id: &str, path: &str, max_bytes: u64) -> VmResult<Box<dyn Download>> {
        let live = self.manager.hold_background();
        let download = self.agent(id).await?.download(path, max_bytes).await?;
        Ok(Box::new(LocalDownload {
            download,
            _live: live,
        }))
    }

    async fn write_file(&self, id: &str, path: &str, bytes: Vec<u8>) -> VmResult<(String, u64)> {
        let _live = self.manager.hold_background();
        self.agent(id).await?.write_file(path, &bytes, None).await
    }

    async fn read_file(&self, id: &str, path: &str, max_bytes: u64) -> VmResult<(String, Vec<u8>)> {
        let _live = self.manager.hold_background();
        self.agent(id).await?.read_file(path, max_bytes).await
    }

    async fn list_files(
        &self,
        id: &str,
        path: &str,
        recursive: bool,
        max_entries: u64,
    ) -> VmResult<Listing> {
        let (path, entries, truncated) = self
            .agent(id)
            .await?
            .list_files(path, recursive, max_entries)
            .await?;
        Ok(Listing {
            path,
            entries,
            truncated,
        })
    }

    async fn delete_file(&self, id: &str, path: &str, recursive: bool) -> VmResult<String> {
        self.agent(id).await?.delete_file(path, recursive).await
    }

    async fn open_tunnel(&self, id: &str, port: u16) -> VmResult<Tunnel> {
        let stream = self.agent(id).await?.open_tunnel(port).await?;
        let closer = stream.closer();
        Ok(Tunnel {
            stream: Box::new(stream),
            closer: Arc::new(move || closer.close()),
        })
    }

    async fn open_pty(&self, id: &str, size: PtySize) -> VmResult<Terminal> {
        let pty = self.agent(id).await?.open_pty(size).await?;
        Ok(Terminal::over(pty))
    }
}

#[cfg(test)]
mod demand_tests {
    use super::*;

    #[test]
    fn a_burst_is_the_most_creates_within_its_span_and_is_forgotten() {
        let t0 = Instant::now();
        let memory = Duration::from_secs(60);
        let mut d = Demand::default();
        assert_eq!(d.peak(), 0);
        // Three at once, then two spread out, then four within the span.
        for ms in [0, 5, 10, 20_000, 40_000, 50_000, 51_000, 52_000, 55_000] {
            d.record(t0 + Duration::from_millis(ms), memory);
        }
        assert_eq!(d.peak(), 4);
        // A minute after the first ones, they are forgotten.
        d.forget(t0 + Duration::from_millis(61_000), memory);
        assert_eq!(d.0.len(), 6);
        assert_eq!(d.peak(), 4);
        d.forget(t0 + Duration::from_millis(200_000), memory);
        assert_eq!(d.peak(), 0);
    }
}
