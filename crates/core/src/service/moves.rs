//! Sandboxes moved to another node with their memory: what drains a node
//! for its operator (`sandpit node drain`) with no sandbox noticing more
//! than a pause.
//!
//! A move of sandbox S from node A to node B:
//! 1. is taken in S's row (`Store::begin_move`): no other member moves S,
//!    and calls that need S's VM wait for the move ([`MOVE_WAIT`]) rather
//!    than fail; those already under way when it begins are told to retry
//!    (the VM-replacing mark, as during a restore);
//! 2. closes S's preview connections and terminals (they reconnect; the
//!    event says so), and pauses S's VM on A (saved whole, then stopped);
//! 3. carries the pause's save to B as a template's save is carried (the
//!    parts B holds already left out, see `fetch::carry`);
//! 4. switches S's `host` to B in the transaction that logs
//!    `sandbox.moved`, only while S is live on A and B is up: a node lost
//!    meanwhile has failed S with it (never both);
//! 5. resumes S on B, where it was (a sandbox paused before its move stays
//!    paused, now on B), lets the calls go, and removes the save from A.
//!
//! Anything that fails before the switch leaves S where it was, running
//! again on A. A member lost mid-move lets its hold lapse ([`MOVE_BOUND`]);
//! another member then puts S right on the node its row names
//! ([`Service::settle_lapsed_move`]), and a drain moves it again.
//!
//! Every control plane linked to the nodes drains: each heartbeat, one
//! drainer per member takes the draining nodes' sandboxes one at a time
//! ([`Service::drain_nodes`]). A sandbox with volumes stays: a volume's
//! file lives on its node's disk (move it with `sandpit volume move` once
//! its sandboxes end).

use crate::error::{CoreError, ErrorType, Result};
use crate::service::errors::runtime_error;
use crate::service::fetch::carry;
use crate::service::Service;
use sandpit_host::local::paused_name;
use sandpit_host::machines::Machines;
use sandpit_store::{Cause, SandboxRow, SandboxStatus};
use std::sync::Arc;
use std::time::Duration;
use time::OffsetDateTime;

/// How long a member holds a move at most: should it be lost mid-way,
/// another puts the sandbox right after this.
const MOVE_BOUND: time::Duration = time::Duration::minutes(10);
/// How long a call that needs a moving sandbox's VM waits for the move.
const MOVE_WAIT: Duration = Duration::from_secs(180);
/// How often a waiting call looks again.
const MOVE_POLL: Duration = Duration::from_millis(200);

/// What a move's event says of the connections it cut.
const CUT: &str = "its preview connections and terminals were closed: reconnect";

/// Who moves a drained node's sandboxes: `drain of node <name>`.
fn drain_actor(node: &str) -> String {
    format!("drain of node {node}")
}

impl Service {
    /// Makes this member (a control plane, linked to the nodes) one that
    /// moves draining nodes' sandboxes.
    pub fn drain_for_the_cluster(&self) {
        self.drains
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Starts this member's drainer if draining nodes hold sandboxes (or
    /// moves lapsed) and none runs here: it moves them one at a time, then
    /// ends. Only a member that reaches other nodes drains.
    pub(crate) async fn drain_nodes(&self) -> Result<()> {
        if self.membership().is_none()
            || self.node_link.get().is_none()
            || !self.drains.load(std::sync::atomic::Ordering::Relaxed)
        {
            return Ok(());
        }
        let Ok(one) = self.draining.clone().try_lock_owned() else {
            return Ok(());
        };
        let now = OffsetDateTime::now_utc();
        let lapsed = self.store.lapsed_moves(now).await?;
        let mut draining = Vec::new();
        for node in self.store.nodes().await? {
            // A node that is not live is the lost-node sweep's.
            if node.draining && node.is_live() {
                draining.push(node.name);
            }
        }
        if lapsed.is_empty() && draining.is_empty() {
            return Ok(());
        }
        let Some(me) = self.arc_self() else {
            return Ok(());
        };
        tokio::spawn(async move {
            let _one = one;
            for row in lapsed {
                me.settle_lapsed_move(&row).await;
            }
            for node in draining {
                if let Err(e) = me.drain(&node).await {
                    tracing::warn!(%node, "draining: {e}");
                }
            }
        });
        Ok(())
    }

    /// Moves node `node`'s sandboxes away, one at a time, each to the best
    /// other node with room.
    async fn drain(&self, node: &str) -> Result<()> {
        let now = OffsetDateTime::now_utc();
        for row in self.store.live_sandboxes(node).await? {
            // Starting (its node records it) or ending: not yet, or never.
            if !matches!(row.status, SandboxStatus::Running | SandboxStatus::Paused)
                || row.is_moving(now)
            {
                continue;
            }
            if !self.vm_volumes(&row).await?.is_empty() {
                tracing::warn!(
                    id = %row.id,
                    %node,
                    "not moved by the drain: it has volumes, whose files are on its node"
                );
                continue;
            }
            let Some(to) = self
                .placement(&row.size)
                .await?
                .into_iter()
                .map(|p| p.host)
                .find(|host| host != node)
            else {
                tracing::warn!(%node, id = %row.id, "no other node has room for it: it waits");
                return Ok(());
            };
            match self.move_sandbox(&row, &to, &drain_actor(node)).await {
                Ok(_) => tracing::info!(id = %row.id, from = %node, %to, "moved"),
                Err(e) => tracing::warn!(id = %row.id, from = %node, %to, "moving: {e}"),
            }
        }
        Ok(())
    }

    /// Moves live sandbox `row` to node `to`, as `actor` asked (see the
    /// module's steps); its row as it is then.
    pub(crate) async fn move_sandbox(
        &self,
        row: &SandboxRow,
        to: &str,
        actor: &str,
    ) -> Result<SandboxRow> {
        let until = OffsetDateTime::now_utc() + MOVE_BOUND;
        let Some(row) = self.store.begin_move(&row.id, &row.host, to, until).await? else {
            return Err(CoreError::conflict(format!(
                "sandbox {} is no longer live on node {}, or is being moved already",
                row.id, row.host
            )));
        };
        let _turn = self.turns.take(&row.id).await;
        let replacing = self.restoring(&row.id).await;
        let moved = self.carry_sandbox(&row, to, actor).await;
        if let Err(e) = self.store.end_move(&row.id, to).await {
            // It lapses on its own, and is then settled.
            tracing::warn!(id = %row.id, "letting go of the move: {e}");
        }
        drop(replacing);
        moved
    }

    async fn carry_sandbox(&self, row: &SandboxRow, to: &str, actor: &str) -> Result<SandboxRow> {
        let (id, from) = (row.id.as_str(), row.host.as_str());
        let source = self.machines_on(from, id).await?;
        let target = self.machines_on(to, id).await?;
        let save = paused_name(id);
        let started = std::time::Instant::now();
        self.previews.close(id, None);
        self.terminals.close(id);
        if matches!(
            source.state(id).await,
            Ok(Some(sandpit_runtime::VmState::Running))
        ) {
            self.note_secrets_used_by(row).await;
            if let Err(e) = source.pause(id).await {
                self.run_again_on(row, &source).await;
                return Err(runtime_error(e));
            }
        }
        let saved = started.elapsed();
        let bytes = match carry(source.clone(), save.clone(), target.clone(), save.clone()).await {
            Ok(bytes) => bytes,
            Err(e) => {
                let _ = target.delete_snapshot(&save).await;
                self.run_again_on(row, &source).await;
                return Err(runtime_error(e));
            }
        };
        let cause = Cause::by(actor)
            .with("from", from)
            .with("to", to)
            .with("bytes", bytes)
            .with("cut", CUT);
        let Some(moved) = self.store.finish_move(id, from, to, &cause).await? else {
            let _ = target.delete_snapshot(&save).await;
            let now = self.store.sandbox(id).await?;
            if let Some(now) = now.filter(|r| r.is_live() && r.host == from) {
                self.run_again_on(&now, &source).await;
            }
            return Err(CoreError::conflict(format!(
                "sandbox {id} ended, or node {to} was lost, during its move"
            )));
        };
        if moved.status == SandboxStatus::Running {
            let resumed = target
                .resume(id, moved.expires_at, self.egress(&moved).await, Vec::new())
                .await;
            if let Err(e) = resumed {
                // Its save is there: it stays paused on `to`, and the next
                // call that needs it wakes it.
                tracing::warn!(id, %to, "resuming the moved sandbox: {e}");
                let _ = self.store.pause_sandbox(id, &Cause::by(actor)).await;
            }
        }
        if let Err(e) = source.delete_snapshot(&save).await {
            tracing::warn!(id, %from, "removing the moved sandbox's save: {e}");
        }
        tracing::info!(
            id,
            %from,
            %to,
            bytes,
            saved_ms = saved.as_millis() as u64,
            total_ms = started.elapsed().as_millis() as u64,
            "a sandbox moved"
        );
        self.store
            .sandbox(id)
            .await?
            .ok_or_else(|| CoreError::not_found("sandbox", id))
    }

    /// Sandbox `row`, whose move did not happen, running again on its node
    /// (one paused before stays paused).
    async fn run_again_on(&self, row: &SandboxRow, machines: &Arc<dyn Machines>) {
        if row.status != SandboxStatus::Running {
            return;
        }
        let volumes = self.vm_volumes(row).await.unwrap_or_default();
        let egress = self.egress(row).await;
        if let Err(e) = machines
            .resume(&row.id, row.expires_at, egress, volumes)
            .await
        {
            tracing::warn!(id = %row.id, "running it again where it was: {e}");
        }
    }

    /// A move whose member was lost, put right: the sandbox runs on the
    /// node its row names (the one it left if the switch had not been
    /// made, else the one it went to), from the pause's save there.
    async fn settle_lapsed_move(&self, row: &SandboxRow) {
        let until = OffsetDateTime::now_utc() + MOVE_BOUND;
        let row = match self.store.take_over_move(&row.id, until).await {
            Ok(Some(row)) => row,
            Ok(None) => return,
            Err(e) => {
                tracing::warn!(id = %row.id, "taking over a lapsed move: {e}");
                return;
            }
        };
        let to = row.moving_to.clone().unwrap_or_default();
        tracing::warn!(id = %row.id, host = %row.host, %to, "settling a move whose member was lost");
        let _turn = self.turns.take(&row.id).await;
        if let Ok(machines) = self.machines_for(&row).await {
            if !matches!(
                machines.state(&row.id).await,
                Ok(Some(sandpit_runtime::VmState::Running))
            ) {
                self.run_again_on(&row, &machines).await;
            }
        }
        if let Err(e) = self.store.end_move(&row.id, &to).await {
            tracing::warn!(id = %row.id, "letting go of a settled move: {e}");
        }
    }

    /// Sandbox `row` once the move under way finishes (a call that needs
    /// its VM waits for it), or why not: a move that takes longer than
    /// [`MOVE_WAIT`] says retry.
    pub(crate) async fn after_move(&self, row: SandboxRow) -> Result<SandboxRow> {
        let deadline = tokio::time::Instant::now() + MOVE_WAIT;
        let mut row = row;
        while row.is_moving(OffsetDateTime::now_utc()) {
            if tokio::time::Instant::now() >= deadline {
                return Err(CoreError::new(
                    ErrorType::ServiceUnavailable,
                    format!(
                        "sandbox {} is being moved to node {}; retry",
                        row.id,
                        row.moving_to.as_deref().unwrap_or("another node")
                    ),
                )
                .with_retry_after(2));
            }
            tokio::time::sleep(MOVE_POLL).await;
            row = self
                .store
                .sandbox(&row.id)
                .await?
                .ok_or_else(|| CoreError::not_found("sandbox", &row.id))?;
        }
        Ok(row)
    }
}
