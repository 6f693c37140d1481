//! A start that a node records itself: when another member of a cluster
//! asks this node (over the node API) to start the VM of a sandbox it
//! recorded here, the node starts the VM and then records the outcome on
//! the sandbox, so a create whose caller was lost mid-way (a replica
//! killed) still ends in a state its retry finds.
//!
//! The node records through [`StartRecords`], three calls on one
//! sandbox's record and nothing else: it cannot reach an account, a
//! balance or a price, because this crate knows none. The program that
//! wires a node implements the trait over its database (what a failed
//! start refunds is decided there).

use crate::machines::{Machines, Started, VmResult};
use crate::turns::Turns;
use async_trait::async_trait;
use sandpit_runtime::{RuntimeError, VmState};
use std::sync::Arc;
use time::OffsetDateTime;

/// Where a sandbox's record says it stands, as far as its start goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Phase {
    /// Its VM is being started.
    Provisioning,
    /// Its VM runs.
    Running,
    /// Anything else (paused, deleting, ended), by its status's name.
    Other(String),
}

/// What a node reads of a sandbox's record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxRecord {
    pub id: String,
    pub phase: Phase,
    /// The node the sandbox was placed on.
    pub node: String,
    /// When it started running (when it was created, if it has not).
    pub ready_at: OffsetDateTime,
    pub expires_at: OffsetDateTime,
}

/// The records a node keeps of the starts asked of it. Failures read as
/// [`RuntimeError::Busy`] (the caller retries), like a node out of reach.
#[async_trait]
pub trait StartRecords: Send + Sync {
    /// Sandbox `id`'s record now; `None` when there is none.
    async fn sandbox(&self, id: &str) -> VmResult<Option<SandboxRecord>>;

    /// Records that sandbox `id` runs, if it is still provisioning on
    /// `node`; its record then, or `None` when it was not.
    async fn record_start(&self, id: &str, node: &str) -> VmResult<Option<SandboxRecord>>;

    /// Records that sandbox `id` failed to start, with `cause`, if it is
    /// still provisioning on `node`.
    async fn record_failure(&self, id: &str, node: &str, cause: &str) -> VmResult<()>;
}

/// The starts this node serves to the other members: its VMs, the turns
/// it shares with its own service, and the records it keeps.
pub struct RecordedStarts {
    node: String,
    vms: Arc<dyn Machines>,
    turns: Arc<Turns>,
    records: Arc<dyn StartRecords>,
}

impl RecordedStarts {
    /// The starts of node `node`'s `vms`, taking the same `turns` as every
    /// other start on this machine.
    pub fn new(
        node: &str,
        vms: Arc<dyn Machines>,
        turns: Arc<Turns>,
        records: Arc<dyn StartRecords>,
    ) -> RecordedStarts {
        RecordedStarts {
            node: node.to_string(),
            vms,
            turns,
            records,
        }
    }

    /// The VMs it starts.
    pub fn machines(&self) -> Arc<dyn Machines> {
        self.vms.clone()
    }

    /// Starts sandbox `id`'s VM (see [`Machines::start`]) and records the
    /// outcome: the VM first (the pool VM taken for it is handed over),
    /// then its record, in one statement that changes it only if it is
    /// still provisioning on this node, so a start costs the node one
    /// database round trip. A VM started for a sandbox that ended, or lives
    /// elsewhere, is removed again. A start asked again finds the outcome
    /// of the first.
    pub async fn start(
        &self,
        id: &str,
        size: &str,
        snapshot: Option<&str>,
        expires_at: OffsetDateTime,
        egress: crate::machines::Egress,
        volumes: Vec<crate::machines::VmVolume>,
    ) -> VmResult<Started> {
        let turn = self.turns.take(id).await;
        // A start that waited for another finds the outcome recorded.
        let known = match turn.waited() {
            true => self.records.sandbox(id).await?,
            false => None,
        };
        if let Some(record) = known.filter(|r| r.phase != Phase::Provisioning) {
            return self.started_before(&record).await;
        }
        if let Err(e) = self
            .vms
            .start(id, size, snapshot, expires_at, egress, volumes)
            .await
        {
            tracing::warn!(id, "create failed: {e}");
            let _ = self.vms.destroy(id).await;
            let _ = self
                .records
                .record_failure(id, &self.node, &format!("failed: {e}"))
                .await;
            return Err(e);
        }
        match self.records.record_start(id, &self.node).await? {
            Some(record) => {
                // Extended while it started: the VM's watchdog learns it.
                if record.expires_at != expires_at {
                    self.vms.set_expiry(id, record.expires_at).await?;
                }
                Ok(started(&record, self.vms.restored(id)))
            }
            None => match self.records.sandbox(id).await? {
                Some(record) => self.started_before(&record).await,
                None => {
                    let _ = self.vms.destroy(id).await;
                    Err(RuntimeError::NotFound(id.to_string()))
                }
            },
        }
    }

    /// A start's answer when the record was not provisioning here: a
    /// sandbox running here keeps the VM that runs it (a start asked
    /// again); any other has no VM here to keep (one being deleted may have
    /// been destroyed before this start made it).
    async fn started_before(&self, record: &SandboxRecord) -> VmResult<Started> {
        if record.node == self.node
            && record.phase == Phase::Running
            && self.vms.state(&record.id).await? == Some(VmState::Running)
        {
            self.vms.set_expiry(&record.id, record.expires_at).await?;
            return Ok(started(record, self.vms.restored(&record.id)));
        }
        let _ = self.vms.destroy(&record.id).await;
        let status = match &record.phase {
            Phase::Provisioning => "provisioning",
            Phase::Running => "running",
            Phase::Other(status) => status,
        };
        Err(RuntimeError::Launch(format!(
            "sandbox {} is {status} on node {}",
            record.id, record.node
        )))
    }
}

/// The start of a running sandbox as its record has it.
fn started(record: &SandboxRecord, restored: Option<bool>) -> Started {
    Started::Recorded {
        ready_at: record.ready_at,
        expires_at: record.expires_at,
        restored,
    }
}
