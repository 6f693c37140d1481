//! The warm pool: restored, configured, never-used VMs kept ready per size,
//! taken by creates under a lock (never twice), refilled one at a time in
//! the background, deep as the last burst of creates (see the module above).

use super::*;

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

/// Creates that arrive within this span of each other are one burst.
const BURST_SPAN: Duration = Duration::from_secs(5);

/// When the creates of one size arrived (each needed a VM, warm or not),
/// for as long as bursts are remembered.
#[derive(Default)]
pub(super) struct Demand(VecDeque<Instant>);

impl Demand {
    pub(super) fn record(&mut self, at: Instant, memory: Duration) {
        self.0.push_back(at);
        self.forget(at, memory);
    }

    pub(super) fn forget(&mut self, now: Instant, memory: Duration) {
        while self
            .0
            .front()
            .is_some_and(|t| now.duration_since(*t) > memory)
        {
            self.0.pop_front();
        }
    }

    /// The most creates that arrived within [`BURST_SPAN`] of each other.
    pub(super) fn peak(&self) -> usize {
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
/// its pool VMs follow (see [`sandpit_runtime::vm::expiry`]).
const POOL_LEASE: time::Duration = time::Duration::minutes(3);
/// The pool task's longest sleep when the pool is full, and how often pool
/// VMs' leases are renewed.
const POOL_NAP: Duration = Duration::from_secs(30);

/// A refill waits this long after a create took a pool VM, so that create
/// answers (and its first command starts) before a VM start competes with
/// it for the CPU.
const REFILL_DELAY: Duration = Duration::from_millis(100);

impl LocalVms {
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
    pub(super) async fn take_ready(&self, id: &str) -> bool {
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
        // VMs that outlived the last process: their egress proxies anew.
        let vms = self.clone();
        tokio::spawn(async move { vms.manager.restart_egress_proxies().await });
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
                    sandpit_runtime::host::ksm::pace();
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
                CreateVm {
                    id: id.clone(),
                    size: size.clone(),
                    metadata: BTreeMap::from([(POOL_LABEL.to_string(), size.clone())]),
                    expires_at: OffsetDateTime::now_utc() + POOL_LEASE,
                    // The operator's network; a sandbox that has another
                    // gets it when it takes the VM (`LocalVms::create`),
                    // and its volumes.
                    egress: sandpit_runtime::Egress::open(),
                    volumes: Vec::new(),
                },
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
}

#[cfg(test)]
mod demand_tests;
