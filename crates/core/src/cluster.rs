//! Membership of machines that share one database (PostgreSQL).
//!
//! Each `sandpit serve --database postgres://…` runs the VMs of its machine
//! as a node: it registers under its name with a lease on the database's
//! clock and renews it every third of the lease. Every member also sweeps:
//! a node whose lease ran out more than `lost_after` ago is declared lost,
//! and its sandboxes are failed ("its node … was lost") and settled — billed
//! until its last heartbeat, the rest of their reservations released — in
//! the same transaction, so exactly once whoever sweeps (see
//! `Store::declare_lost_nodes`).
//!
//! Fencing: a node's epoch grows at each registration, and its renewal names
//! the epoch it holds. A node that finds its renewal refused (it was stopped,
//! or cut from the database, past its lease and the grace) knows its
//! sandboxes were failed: it ends them here too (their VMs go, their preview
//! URLs close) and joins again under a new epoch. A create checks the epoch
//! in its transaction, so a fenced node adds no sandbox meanwhile.
//!
//! The database down (or this member cut from it) stops every heartbeat, so
//! every lease lapses meanwhile. When it returns, a member sweeps only once
//! it has renewed its own lease steadily for a whole lease period: by then
//! every member that is alive has renewed too, and only the ones that are
//! really gone are declared lost.
//!
//! A sandbox ended by another member (a destroy or an expiry it served) has
//! its VM removed by its node at the next heartbeat.
//!
//! Routing: a command for a sandbox of another node goes there through the
//! [`NodeLink`] the program gave the service (`sandpit serve` with the
//! cluster's certificates: the node API over mutual TLS), at the epoch the
//! database shows for that node, and only while its lease is live. This
//! member records the execution as for its own; the node runs it.

use crate::error::{CoreError, ErrorType, Result};
use crate::Service;
use sandpit_host::machines::{Machines, NodeLink, VmResult};
use sandpit_host::recording::{Phase, RecordedStarts, SandboxRecord, StartRecords};
use sandpit_runtime::RuntimeError;
use sandpit_store::NodeRow;
use sandpit_store::SandboxStatus;
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use time::OffsetDateTime;

/// `[cluster]` in the config: the lease and when a silent node is lost.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClusterConfig {
    /// How long a node's lease lasts; it is renewed every third of it, so a
    /// node that stops is unroutable within this.
    pub lease_secs: u64,
    /// How long past its lease a silent node's sandboxes wait before they
    /// are failed and settled (a node back within it keeps them).
    pub lost_after_secs: u64,
    /// Live sandboxes this node takes at most; unset, one per 64 MiB of
    /// the machine's memory (an idle `small` sandbox takes about 40 MiB
    /// once KSM has merged its pages). A member without VMs takes none.
    pub max_sandboxes: Option<u32>,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        ClusterConfig {
            lease_secs: 10,
            lost_after_secs: 20,
            max_sandboxes: None,
        }
    }
}

impl ClusterConfig {
    fn lease(&self) -> Duration {
        Duration::from_secs(self.lease_secs.max(1))
    }

    fn heartbeat(&self) -> Duration {
        self.lease() / 3
    }

    fn lost_after(&self) -> Duration {
        Duration::from_secs(self.lost_after_secs)
    }
}

/// How long what a member read of a node serves its routing: a call
/// needs the node's address and epoch, and reading them for every call
/// would add a database round trip to each. Well inside a lease: a node
/// that stops is unroutable within its lease and this. Placement uses what
/// the last heartbeat read (fresh for a heartbeat and this); a create's
/// transaction checks its node again, whatever was read.
const ROUTES_FRESH: Duration = Duration::from_secs(1);

/// What this member read of the nodes lately (see [`ROUTES_FRESH`]).
#[derive(Default)]
pub(crate) struct Routes {
    nodes: std::sync::Mutex<std::collections::HashMap<String, (NodeRow, Instant)>>,
    candidates: std::sync::Mutex<Option<(Vec<sandpit_store::Candidate>, Instant)>>,
    /// Published pool VMs this member handed out lately (see
    /// [`Routes::take_published`]): a node publishes at its heartbeats,
    /// so what it published may still name them for a while.
    handed_out: std::sync::Mutex<std::collections::VecDeque<(String, Instant)>>,
}

/// How long [`Routes::handed_out`] remembers an id: longer than a node's
/// heartbeat and this member's read of it, with room to spare.
const HANDED_OUT_FOR: Duration = Duration::from_secs(60);

impl Routes {
    /// Node `name`, as read within [`ROUTES_FRESH`].
    async fn node(&self, store: &sandpit_store::Store, name: &str) -> Result<Option<NodeRow>> {
        if let Some((row, at)) = self.nodes.lock().expect("not poisoned").get(name) {
            if at.elapsed() < ROUTES_FRESH {
                return Ok(Some(row.clone()));
            }
        }
        let row = store.node(name).await?;
        if let Some(row) = &row {
            self.nodes
                .lock()
                .expect("not poisoned")
                .insert(name.to_string(), (row.clone(), Instant::now()));
        }
        Ok(row)
    }

    /// The placement candidates, as read within `fresh` and counting the
    /// sandboxes this member placed since. Each heartbeat reads them again
    /// ([`Routes::refresh`]), so a create finds them read already.
    async fn candidates(
        &self,
        store: &sandpit_store::Store,
        fresh: Duration,
    ) -> Result<Vec<sandpit_store::Candidate>> {
        if let Some((c, at)) = &*self.candidates.lock().expect("not poisoned") {
            if at.elapsed() < fresh {
                return Ok(c.clone());
            }
        }
        self.refresh(store).await
    }

    /// Reads the placement candidates (and their node rows) again.
    pub(crate) async fn refresh(
        &self,
        store: &sandpit_store::Store,
    ) -> Result<Vec<sandpit_store::Candidate>> {
        let c = store.placement_candidates().await?;
        let now = Instant::now();
        // The first calls to a new sandbox go where it was placed.
        let mut nodes = self.nodes.lock().expect("not poisoned");
        for candidate in &c {
            nodes.insert(candidate.node.name.clone(), (candidate.node.clone(), now));
        }
        drop(nodes);
        *self.candidates.lock().expect("not poisoned") = Some((c.clone(), now));
        Ok(c)
    }

    /// A ready pool VM of `size` that node `name` published, for this
    /// member's next create there (each id is handed out once here; another
    /// member may hand it out too, and the create's insert settles which
    /// gets it: [`sandpit_store::CreateOutcome::IdTaken`] for the other).
    pub(crate) fn take_published(&self, name: &str, size: &str) -> Option<String> {
        let mut candidates = self.candidates.lock().expect("not poisoned");
        let (c, _) = candidates.as_mut()?;
        let node = &mut c.iter_mut().find(|c| c.node.name == name)?.node;
        let ids = node.warm.get_mut(size)?;
        let mut handed_out = self.handed_out.lock().expect("not poisoned");
        while handed_out
            .front()
            .is_some_and(|(_, at)| at.elapsed() > HANDED_OUT_FOR)
        {
            handed_out.pop_front();
        }
        // The newest: the node's own takes start from the oldest.
        while let Some(id) = ids.pop() {
            if !handed_out.iter().any(|(h, _)| *h == id) {
                handed_out.push_back((id.clone(), Instant::now()));
                return Some(id);
            }
        }
        None
    }

    /// A sandbox was placed on `name`.
    pub(crate) fn placed(&self, name: &str) {
        if let Some((c, _)) = &mut *self.candidates.lock().expect("not poisoned") {
            if let Some(c) = c.iter_mut().find(|c| c.node.name == name) {
                c.live += 1;
            }
        }
    }

    /// A node refused a sandbox (full, or gone): read them all again.
    pub(crate) fn refused(&self) {
        *self.candidates.lock().expect("not poisoned") = None;
    }
}

/// A node a new sandbox may go to.
pub(crate) struct Placement {
    pub(crate) host: String,
    /// The epoch its create must find (`None` outside a cluster).
    pub(crate) epoch: Option<i64>,
    pub(crate) machines: Arc<dyn Machines>,
}

/// This process's membership, once it joined.
#[derive(Debug)]
pub(crate) struct Membership {
    config: ClusterConfig,
    node: sandpit_store::NewNode,
    epoch: AtomicI64,
    /// Renewals of this node's lease: see [`Steady`].
    steady: std::sync::Mutex<Steady>,
    /// Another process took this node's name (see [`Service::heartbeat`]).
    displaced: std::sync::atomic::AtomicBool,
}

/// Whether this member's own renewals have been steady: a member sweeps
/// only after a whole lease of them, so one that was cut from the database
/// (an error, or a call that hung) does not declare lost the members that
/// were cut off with it before they had their turn to renew.
#[derive(Debug)]
struct Steady {
    /// Since when every renewal worked, each within a lease of the last.
    since: Option<std::time::Instant>,
    /// The last renewal that worked.
    last: std::time::Instant,
}

impl Membership {
    /// The epoch a create on this node must find.
    pub(crate) fn epoch(&self) -> i64 {
        self.epoch.load(Ordering::SeqCst)
    }
}

impl Service {
    /// Joins the cluster of the shared database as the node
    /// `config.host_name`, reachable at `address`; starts the heartbeat and
    /// the lost-node sweep. Call before [`Service::start`].
    pub async fn join_cluster(
        self: &Arc<Self>,
        config: ClusterConfig,
        address: &str,
    ) -> Result<i64> {
        let memory_mb = host_memory_mb();
        let max_sandboxes = match self.vms() {
            Some(_) => config.max_sandboxes.unwrap_or((memory_mb / 64).max(1)),
            None => 0,
        };
        let node = sandpit_store::NewNode {
            name: self.config().host_name.clone(),
            address: address.to_string(),
            vcpus: std::thread::available_parallelism().map_or(1, |n| n.get() as u32),
            memory_mb,
            max_sandboxes,
        };
        let row = self.store().register_node(&node, config.lease()).await?;
        let membership = Membership {
            config,
            node,
            epoch: AtomicI64::new(row.epoch),
            displaced: std::sync::atomic::AtomicBool::new(false),
            steady: std::sync::Mutex::new(Steady {
                since: Some(std::time::Instant::now()),
                last: std::time::Instant::now(),
            }),
        };
        if self.membership.set(membership).is_err() {
            return Err(CoreError::internal("joined the cluster twice"));
        }
        tracing::info!(node = %row.name, epoch = row.epoch, "joined the cluster");
        let me = Arc::downgrade(self);
        let heartbeat = self.membership().map(|m| m.config.heartbeat());
        tokio::spawn(async move {
            let every = heartbeat.unwrap_or(Duration::from_secs(3));
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(svc) = me.upgrade() else { return };
                if let Err(e) = svc.heartbeat().await {
                    tracing::warn!("cluster heartbeat: {e}");
                }
                if let Err(e) = svc.sweep_lost_nodes().await {
                    tracing::warn!("sweeping lost nodes: {e}");
                }
                if let Err(e) = svc.routes.refresh(svc.store()).await {
                    tracing::warn!("reading the cluster's nodes: {e}");
                }
                if let Err(e) = svc.drain_nodes().await {
                    tracing::warn!("draining nodes: {e}");
                }
            }
        });
        Ok(row.epoch)
    }

    pub(crate) fn membership(&self) -> Option<&Membership> {
        self.membership.get()
    }

    /// Gives the service its way to other nodes (once).
    pub fn set_node_link(&self, link: std::sync::Arc<dyn NodeLink>) {
        let _ = self.node_link.set(link);
    }

    /// The VMs of the node that holds `row`'s sandbox.
    pub(crate) async fn machines_for(
        &self,
        row: &sandpit_store::SandboxRow,
    ) -> Result<Arc<dyn Machines>> {
        self.machines_on(&row.host, &row.id).await
    }

    /// The VMs of node `host` (which holds sandbox `id`): this machine's
    /// own, or another node's through the link while its lease is live.
    pub(crate) async fn machines_on(&self, host: &str, id: &str) -> Result<Arc<dyn Machines>> {
        if host == self.config().host_name {
            if let Some(vms) = self.local_vms() {
                return Ok(vms);
            }
        }
        let unavailable = |m: String| CoreError::new(ErrorType::ServiceUnavailable, m);
        let Some(link) = self.node_link.get() else {
            return Err(unavailable(format!(
                "sandbox {id} runs on node {host}, and this server has no link to other nodes \
                 (serve --cluster-dir)"
            )));
        };
        let node = self
            .routes
            .node(self.store(), host)
            .await?
            .filter(|n| n.is_live() && !n.address.is_empty());
        let Some(node) = node else {
            return Err(unavailable(format!(
                "node {host} that holds sandbox {id} is unreachable (no heartbeat within its \
                 lease); retry: if it does not come back, its sandboxes fail"
            ))
            .with_retry_after(5));
        };
        Ok(link.machines(&node.address, node.epoch))
    }

    /// Where a new sandbox of `size` may go, best first: this machine alone
    /// outside a cluster; in one, the live nodes with room, those with a
    /// warm VM of the size first (a start in milliseconds), then the least
    /// full. The create's transaction checks the chosen node again.
    pub(crate) async fn placement(&self, size: &str) -> Result<Vec<Placement>> {
        let Some(m) = self.membership() else {
            let vms = self.local_vms().ok_or_else(|| {
                CoreError::internal("a server without VMs of its own must be in a cluster")
            })?;
            return Ok(vec![Placement {
                host: self.config().host_name.clone(),
                epoch: None,
                machines: vms,
            }]);
        };
        // What the last heartbeat read: a node full or gone since is found
        // by the create's transaction, which then reads them all again.
        let fresh = m.config.heartbeat() + ROUTES_FRESH;
        let mut candidates: Vec<_> = self
            .routes
            .candidates(self.store(), fresh)
            .await?
            .into_iter()
            // Its own name at another epoch is another process (see
            // `heartbeat`): never this machine's VMs.
            .filter(|c| c.node.name != m.node.name || c.node.epoch == m.epoch())
            .filter(|c| c.live < c.node.max_sandboxes)
            .collect();
        // This node knows its own pool now, not as of its last heartbeat.
        let warm_of = |c: &sandpit_store::Candidate| -> u32 {
            match (c.node.name == m.node.name, self.vms()) {
                (true, Some(vms)) => vms.warm_count(size) as u32,
                _ => c.node.warm.get(size).map_or(0, |ids| ids.len() as u32),
            }
        };
        candidates.sort_by(|a, b| {
            let fill = |c: &sandpit_store::Candidate| {
                u64::from(c.live) * 1_000_000 / u64::from(c.node.max_sandboxes.max(1))
            };
            (warm_of(b) > 0)
                .cmp(&(warm_of(a) > 0))
                .then(fill(a).cmp(&fill(b)))
                .then(a.node.name.cmp(&b.node.name))
        });
        let mut out = Vec::new();
        for c in candidates {
            let machines = if c.node.name == self.config().host_name {
                match self.local_vms() {
                    Some(vms) => vms,
                    None => continue,
                }
            } else {
                match self.node_link.get() {
                    Some(link) if !c.node.address.is_empty() => {
                        link.machines(&c.node.address, c.node.epoch)
                    }
                    _ => continue,
                }
            };
            out.push(Placement {
                host: c.node.name,
                epoch: Some(c.node.epoch),
                machines,
            });
        }
        Ok(out)
    }

    /// Reads the cluster's nodes again now, as each heartbeat does (their
    /// room and their published pools, for placement).
    pub async fn read_cluster_again(&self) -> Result<()> {
        self.routes.refresh(self.store()).await.map(|_| ())
    }

    /// The epoch this node holds in the cluster (`None` outside one).
    pub fn cluster_epoch(&self) -> Option<i64> {
        self.membership().map(Membership::epoch)
    }

    /// Renews this node's lease; when it was fenced, ends what it held and
    /// joins again. Then removes the VMs of sandboxes others ended.
    async fn heartbeat(&self) -> Result<()> {
        let Some(m) = self.membership() else {
            return Ok(());
        };
        let renewed = match self
            .store()
            .renew_lease(&m.node.name, m.epoch(), m.config.lease(), &self.ready_ids())
            .await
        {
            Ok(r) => {
                let now = std::time::Instant::now();
                let mut steady = m.steady.lock().expect("not poisoned");
                if now.duration_since(steady.last) > m.config.lease() {
                    steady.since = Some(now);
                } else {
                    steady.since.get_or_insert(now);
                }
                steady.last = now;
                r
            }
            Err(e) => {
                m.steady.lock().expect("not poisoned").since = None;
                return Err(e.into());
            }
        };
        if !renewed {
            // Another process registered under this name since (a second
            // machine given the same --name): joining again would fence it
            // in turn, and the two would take the name from each other at
            // every heartbeat. This one stays out (its creates are refused)
            // and says why.
            if let Some(row) = self.store().node(&m.node.name).await? {
                if row.state == sandpit_store::NodeState::Up && row.epoch > m.epoch() {
                    if !m.displaced.swap(true, Ordering::SeqCst) {
                        tracing::error!(
                            node = %m.node.name,
                            epoch = m.epoch(),
                            "another process registered as node {} (epoch {}): two machines \
                             have the same name; this one takes no new sandboxes until it is \
                             restarted with a name of its own",
                            row.name,
                            row.epoch
                        );
                    }
                    return Ok(());
                }
            }
            tracing::error!(
                node = %m.node.name,
                epoch = m.epoch(),
                "this node lost its lease and was declared lost: its sandboxes were failed; \
                 removing their VMs and joining again"
            );
            self.drop_ended_vms().await?;
            let row = self
                .store()
                .register_node(&m.node, m.config.lease())
                .await?;
            m.epoch.store(row.epoch, Ordering::SeqCst);
            // Placement reads its own row at the new epoch before this says
            // it is back: a create that follows the line finds the node.
            self.routes.refresh(self.store()).await?;
            // At the level of the error above, so that a log at the default
            // level shows the recovery too.
            tracing::warn!(node = %row.name, epoch = row.epoch, "joined the cluster again");
            return Ok(());
        }
        self.drop_ended_vms().await
    }

    /// This node's ready pool VMs per size, published for placement.
    fn ready_ids(&self) -> std::collections::BTreeMap<String, Vec<String>> {
        self.vms()
            .map_or_else(Default::default, |vms| vms.ready_ids())
    }

    /// Declares lost the nodes silent past their lease and the grace, and
    /// settles their sandboxes (once, whoever sweeps).
    async fn sweep_lost_nodes(&self) -> Result<()> {
        let Some(m) = self.membership() else {
            return Ok(());
        };
        let since = m.steady.lock().expect("not poisoned").since;
        if since.is_none_or(|t| t.elapsed() < m.config.lease()) {
            // Back from a database outage (or just joined): the others have
            // not had a lease's time to renew theirs yet.
            return Ok(());
        }
        let lost = self
            .store()
            .declare_lost_nodes(m.config.lost_after(), &m.node.name, |row, until| {
                crate::service::cost_until(row, until, self.config().paused_price_percent)
            })
            .await?;
        for l in lost {
            tracing::warn!(
                node = %l.node.name,
                sandboxes = l.sandboxes.len(),
                "declared a node lost: its sandboxes failed and were settled"
            );
        }
        Ok(())
    }

    /// Brings this node's VMs in line with what other members did to their
    /// sandboxes: ends here (VM, preview URLs) the ones the store says have
    /// ended (failed with the node, destroyed or expired through another
    /// member), and moves a VM's own expiry to its sandbox's when another
    /// member extended it (until then the VM's watchdog holds the old one:
    /// an extension through another member reaches the VM within a
    /// heartbeat).
    async fn drop_ended_vms(&self) -> Result<()> {
        let Some(vms) = self.vms() else {
            return Ok(());
        };
        for vm in vms.list() {
            let Some(row) = self.store().sandbox(&vm.id).await? else {
                continue;
            };
            if !row.is_live() {
                tracing::info!(id = %row.id, "removing the VM of a sandbox that ended elsewhere");
                self.end_here(&row).await;
            } else if row.host != self.config().host_name
                && !row.is_moving(OffsetDateTime::now_utc())
            {
                // Moved to another node, which runs it: never two copies.
                tracing::warn!(id = %row.id, host = %row.host, "removing the VM of a sandbox now on another node");
                if let Err(e) = vms.destroy(&row.id).await {
                    tracing::warn!(id = %row.id, "removing it: {e}");
                }
            } else if vms
                .manager()
                .expiry(&row.id)
                .is_some_and(|at| at < row.expires_at)
            {
                if let Err(e) = vms.set_expiry(&row.id, row.expires_at) {
                    tracing::warn!(id = %row.id, "moving the VM's expiry: {e}");
                }
            }
        }
        // The saves of paused VMs whose sandbox is another node's (a move
        // that was cut before its switch left its copy; one after it left
        // the source's) or ended: nothing here will resume them.
        let now = OffsetDateTime::now_utc();
        for id in vms.paused() {
            let stray = match self.store().sandbox(&id).await? {
                Some(row) => {
                    !row.is_moving(now) && (!row.is_live() || row.host != self.config().host_name)
                }
                None => false,
            };
            if stray {
                tracing::info!(%id, "removing the paused save of a sandbox not on this node");
                if let Err(e) = vms
                    .manager()
                    .delete_saved(&sandpit_host::local::paused_name(&id))
                    .await
                {
                    tracing::warn!(%id, "removing it: {e}");
                }
            }
        }
        Ok(())
    }
}

/// This machine's memory, from /proc/meminfo (0 if unreadable).
fn host_memory_mb() -> u32 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kb| (kb / 1024).min(u64::from(u32::MAX)) as u32)
}

/// The records a node keeps of the starts other members ask of it (see
/// [`sandpit_host::recording`]): its sandboxes' rows, nothing else. A
/// failed start is settled as any failed create: nothing charged, its
/// reservation released.
struct StoreStarts {
    store: sandpit_store::Store,
}

fn record_of(row: &sandpit_store::SandboxRow) -> SandboxRecord {
    SandboxRecord {
        id: row.id.clone(),
        phase: match row.status {
            SandboxStatus::Provisioning => Phase::Provisioning,
            SandboxStatus::Running => Phase::Running,
            other => Phase::Other(other.to_string()),
        },
        node: row.host.clone(),
        ready_at: row.ready_at.unwrap_or(row.created_at),
        expires_at: row.expires_at,
    }
}

fn database(e: sandpit_store::StoreError) -> RuntimeError {
    RuntimeError::Busy(format!("the database: {e}"))
}

#[async_trait::async_trait]
impl StartRecords for StoreStarts {
    async fn sandbox(&self, id: &str) -> VmResult<Option<SandboxRecord>> {
        let row = self.store.sandbox(id).await.map_err(database)?;
        Ok(row.as_ref().map(record_of))
    }

    async fn record_start(&self, id: &str, node: &str) -> VmResult<Option<SandboxRecord>> {
        let cause = sandpit_store::Cause::by(format!("node {node}"));
        let row = self
            .store
            .record_start(id, node, &cause)
            .await
            .map_err(database)?;
        Ok(row.as_ref().map(record_of))
    }

    async fn record_failure(&self, id: &str, node: &str, cause: &str) -> VmResult<()> {
        let row = self.store.sandbox(id).await.map_err(database)?;
        if row.is_some_and(|r| r.host == node && r.status == SandboxStatus::Provisioning) {
            self.store
                .finish_sandbox(
                    id,
                    SandboxStatus::Failed,
                    cause,
                    OffsetDateTime::now_utc(),
                    0,
                    &sandpit_store::Cause::by(format!("node {node}")),
                )
                .await
                .map_err(database)?;
        }
        Ok(())
    }
}

impl Service {
    /// The starts this node serves on the node API (`None`: it runs no
    /// VMs): its VMs, taking the same turns as this service's own starts,
    /// recording each outcome on the sandbox's row.
    pub fn node_starts(&self) -> Option<Arc<RecordedStarts>> {
        let vms: Arc<dyn Machines> = self.vms()?.clone();
        let records = Arc::new(StoreStarts {
            store: self.store().clone(),
        });
        Some(Arc::new(RecordedStarts::new(
            &self.config().host_name,
            vms,
            self.turns.clone(),
            records,
        )))
    }
}
