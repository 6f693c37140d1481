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
use async_trait::async_trait;
use sandpit_protocol::ExecRequest;
use sandpit_runtime::{ExecEvent, ExecHandle, RuntimeError};
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

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
}

impl Default for ClusterConfig {
    fn default() -> Self {
        ClusterConfig {
            lease_secs: 10,
            lost_after_secs: 20,
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

/// A command running in a sandbox of another node.
#[async_trait]
pub trait RemoteCommand: Send {
    /// The next event; `Exited` (or an error) is the last.
    async fn next(&mut self) -> std::result::Result<ExecEvent, RuntimeError>;
    /// Asks the node to kill the command; its end follows, cancelled.
    fn cancel(&self);
}

/// How this member reaches the other nodes of the cluster.
#[async_trait]
pub trait NodeLink: Send + Sync {
    /// Starts `request` in sandbox `sandbox_id` on the node at `address`,
    /// which the database shows at `epoch`.
    async fn exec(
        &self,
        address: &str,
        epoch: i64,
        sandbox_id: &str,
        request: &ExecRequest,
    ) -> Result<Box<dyn RemoteCommand>>;
}

/// A command in a sandbox: on this node's VM, or through another node.
pub(crate) enum Command {
    Local(ExecHandle),
    Remote(Box<dyn RemoteCommand>),
}

impl Command {
    pub(crate) async fn next(&mut self) -> std::result::Result<ExecEvent, RuntimeError> {
        match self {
            Command::Local(h) => h.next().await,
            Command::Remote(r) => r.next().await,
        }
    }

    pub(crate) fn cancel(&self) {
        match self {
            Command::Local(h) => h.cancel(),
            Command::Remote(r) => r.cancel(),
        }
    }
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
        let node = sandpit_store::NewNode {
            name: self.config().host_name.clone(),
            address: address.to_string(),
            vcpus: std::thread::available_parallelism().map_or(1, |n| n.get() as u32),
            memory_mb: host_memory_mb(),
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

    /// Starts a command in `row`'s sandbox: on this node's VM, or through
    /// the node that holds it.
    pub(crate) async fn start_command(
        &self,
        row: &sandpit_store::SandboxRow,
        request: ExecRequest,
    ) -> Result<Command> {
        if row.host == self.config().host_name {
            let agent = self.agent(row).await?;
            return agent
                .exec(request)
                .map(Command::Local)
                .map_err(crate::service::runtime_error);
        }
        let unavailable = |m: String| CoreError::new(ErrorType::ServiceUnavailable, m);
        let Some(link) = self.node_link.get() else {
            return Err(unavailable(format!(
                "sandbox {} runs on node {}, and this server has no link to other nodes \
                 (serve --cluster-dir)",
                row.id, row.host
            )));
        };
        let node = self
            .store()
            .node(&row.host)
            .await?
            .filter(|n| n.is_live() && !n.address.is_empty());
        let Some(node) = node else {
            return Err(unavailable(format!(
                "node {} that holds sandbox {} is unreachable (no heartbeat within its lease); \
                 retry: if it does not come back, its sandboxes fail",
                row.host, row.id
            ))
            .with_retry_after(5));
        };
        let remote = link
            .exec(&node.address, node.epoch, &row.id, &request)
            .await?;
        Ok(Command::Remote(remote))
    }

    /// For the node API: starts `request` in the VM of sandbox `id`, which
    /// must be running on this node. The caller (a member of the cluster)
    /// checked the account and records the execution.
    pub async fn node_exec(&self, id: &str, request: ExecRequest) -> Result<ExecHandle> {
        let row = self
            .store()
            .sandbox(id)
            .await?
            .ok_or_else(|| CoreError::not_found("sandbox", id))?;
        if row.host != self.config().host_name {
            return Err(CoreError::conflict(format!(
                "sandbox {id} is on node {}, not on {}",
                row.host,
                self.config().host_name
            )));
        }
        if row.status != sandpit_store::status::RUNNING {
            return Err(CoreError::conflict(format!(
                "sandbox {id} is {}",
                row.status
            )));
        }
        self.agent(&row)
            .await?
            .exec(request)
            .map_err(crate::service::runtime_error)
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
            .renew_lease(&m.node.name, m.epoch(), m.config.lease())
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
                if row.state == sandpit_store::node_state::UP && row.epoch > m.epoch() {
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
            tracing::info!(node = %row.name, epoch = row.epoch, "joined the cluster again");
            return Ok(());
        }
        self.drop_ended_vms().await
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
            .declare_lost_nodes(m.config.lost_after(), |row, until| {
                crate::config::cost(
                    row.price_micros_per_hour,
                    crate::service::lived_seconds(row.created_at, until),
                )
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
        for vm in self.vms().list() {
            let Some(row) = self.store().sandbox(&vm.id).await? else {
                continue;
            };
            if !row.is_live() {
                tracing::info!(id = %row.id, "removing the VM of a sandbox that ended elsewhere");
                self.end_here(&row).await;
            } else if self
                .vms()
                .manager()
                .expiry(&row.id)
                .is_some_and(|at| at < row.expires_at)
            {
                if let Err(e) = self.vms().set_expiry(&row.id, row.expires_at) {
                    tracing::warn!(id = %row.id, "moving the VM's expiry: {e}");
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
