//! Disk use: what each sandbox's disk takes on its host, and each account's
//! live sandboxes held to a total.
//!
//! A sandbox's disk is a copy-on-write overlay over the shared base image,
//! and thin: its size (`disk_gb`) bounds what one guest can write, but
//! twenty sandboxes of 40 GB are more than most hosts hold, and a tenant's
//! guests could fill the disk every tenant's VMs write to. So what each
//! overlay takes is measured every [`DISK_SAMPLE`] (one `stat` a sandbox,
//! cheap for hundreds), recorded on the sandbox (`disk_used_bytes`, kept
//! after it ends as what it used) and summed per account.
//!
//! An account at its limit (`[limits] account_disk_mb`) starts no new
//! sandbox (`forbidden`, saying what to do), and its running sandboxes'
//! disk writes are held to [`OVER_LIMIT_WRITE_BPS`] by QEMU's block
//! throttling: nothing in the guest fails and nothing is lost, but it can
//! no longer grow the host's disk faster than that. Deleting files inside
//! its guests (the guest's filesystem passes what it frees down, and QEMU
//! punches it out of the overlay) or destroying sandboxes brings the account
//! back under, which lifts the hold at the next sample.
//!
//! What the service last set on each VM is remembered; a VM it knows
//! nothing of (a restart) gets its state set once, so a hold left by an
//! earlier process is lifted when it no longer applies.

use crate::config::OVER_LIMIT_WRITE_BPS;
use crate::error::{CoreError, ErrorType, Result};
use crate::service::Service;
use sandpit_store::SandboxStatus;
use std::collections::{HashMap, HashSet};
use std::time::Duration;

/// How often every running sandbox's disk is measured.
pub const DISK_SAMPLE: Duration = Duration::from_secs(5);

/// What this process last did to its VMs' disks: whether each VM's writes
/// are held, and which VMs a full host disk stopped.
#[derive(Debug, Default)]
pub(crate) struct DiskHolds {
    held: std::sync::Mutex<HashMap<String, bool>>,
    full: std::sync::Mutex<FullDiskStops>,
}

/// The VMs a full host disk stopped, as this process knows them (see
/// [`Service::watch_full_disk`]).
#[derive(Debug, Default)]
struct FullDiskStops {
    stopped: HashSet<String>,
    /// Whether every running VM was asked once: a VM a full disk stopped
    /// before this process started is found by the first sample.
    asked_all: bool,
}

impl DiskHolds {
    /// How many of this host's VMs a full disk stops now.
    pub(crate) fn stopped_on_full_disk(&self) -> usize {
        self.full.lock().unwrap().stopped.len()
    }
}

/// The refusal of a create by an account at its disk limit.
pub(crate) fn over_limit(used: u64, limit: u64) -> CoreError {
    const MIB: u64 = 1024 * 1024;
    CoreError::new(
        ErrorType::Forbidden,
        format!(
            "the account's sandboxes take {} MiB of disk, its limit is {} MiB; \
             delete files inside its sandboxes or destroy one it no longer needs",
            used.div_ceil(MIB),
            limit / MIB
        ),
    )
}

impl Service {
    /// Measure every running sandbox's disk on this host, record it, and
    /// hold (or release) the writes of each account's sandboxes by whether
    /// the account is at its limit. Returns the accounts at their limit.
    pub async fn sample_disks(&self) -> Result<Vec<String>> {
        let config = self.config();
        let rows = self
            .store()
            .live_sandboxes(&self.config().host_name)
            .await?;
        let Some(vms) = self.vms() else {
            return Ok(Vec::new());
        };
        let manager = vms.manager();
        let mut uses = Vec::new();
        let mut per_account: HashMap<&str, u64> = HashMap::new();
        let mut running = Vec::new();
        for row in &rows {
            if row.host != config.host_name || row.status != SandboxStatus::Running {
                continue;
            }
            // Gone meanwhile (an end in progress): its last figure stays.
            let Ok(bytes) = manager.disk_use(&row.id) else {
                continue;
            };
            // Only changes are written: an idle sandbox costs no write
            // lock every sample (creates wait for that lock).
            if bytes != row.disk_used_bytes {
                uses.push((row.id.clone(), bytes));
            }
            *per_account.entry(&row.account_id).or_default() += bytes;
            running.push(row);
        }
        self.store().set_disk_use(&uses).await?;
        let limit = config.account_disk_bytes;
        let over: HashSet<&str> = per_account
            .iter()
            .filter(|(_, used)| **used >= limit)
            .map(|(account, _)| *account)
            .collect();
        let live: HashSet<&str> = running.iter().map(|r| r.id.as_str()).collect();
        self.disk_holds()
            .held
            .lock()
            .unwrap()
            .retain(|id, _| live.contains(id.as_str()));
        let running_ids: Vec<String> = running.iter().map(|r| r.id.clone()).collect();
        for row in running {
            let hold = over.contains(row.account_id.as_str());
            let known = self.disk_holds().held.lock().unwrap().get(&row.id).copied();
            if known == Some(hold) {
                continue;
            }
            let rate = hold.then_some(OVER_LIMIT_WRITE_BPS);
            match manager.limit_disk_writes(&row.id, rate).await {
                Ok(()) => {
                    if hold {
                        tracing::info!(id = %row.id, account = %row.account_id,
                            "the account is at its disk limit: disk writes held to {OVER_LIMIT_WRITE_BPS} B/s");
                    } else if known.is_some() {
                        tracing::info!(id = %row.id, "disk writes no longer held");
                    }
                    self.disk_holds()
                        .held
                        .lock()
                        .unwrap()
                        .insert(row.id.clone(), hold);
                }
                Err(e) => {
                    // A sandbox that ended meanwhile (its QEMU quit under
                    // the call) needs no limit and is no fault.
                    let still_running = matches!(
                        self.store().sandbox(&row.id).await,
                        Ok(Some(now)) if now.status == SandboxStatus::Running
                    );
                    if still_running {
                        tracing::warn!(id = %row.id, "setting the disk write limit: {e}");
                    }
                }
            }
        }
        self.watch_full_disk(manager, &running_ids).await;
        Ok(over.into_iter().map(String::from).collect())
    }

    /// Find the VMs among `running` that a full host disk stopped (see
    /// `sandpit_runtime`'s `host_disk`: the write that found no room waits
    /// in QEMU, nothing is lost): say so in each one's events, and resume
    /// them once the host has its reserve free again. VMs are asked only
    /// while the host is under its reserve (no VM stops on a full disk
    /// otherwise), when one is known stopped, and once after a start.
    async fn watch_full_disk(&self, manager: &sandpit_runtime::VmManager, running: &[String]) {
        let free_mb = match manager.disk_free_mb() {
            Ok(free) => free,
            Err(e) => {
                tracing::warn!("measuring the host's free disk: {e}");
                return;
            }
        };
        let reserve_mb = manager.disk_reserve_mb();
        let short = free_mb < reserve_mb;
        let (known, ask_all) = {
            let full = self.disk_holds().full.lock().unwrap();
            (full.stopped.clone(), short || !full.asked_all)
        };
        let mut stopped = HashSet::new();
        for id in running {
            if !ask_all && !known.contains(id) {
                continue;
            }
            match manager.stopped_on_full_disk(id).await {
                Ok(true) => {}
                Ok(false) => continue,
                // Gone meanwhile, or a QEMU that did not answer: asked
                // again at the next sample if it is still known stopped.
                Err(e) => {
                    if known.contains(id) {
                        tracing::debug!(%id, "asking QEMU whether a full disk stopped it: {e}");
                        stopped.insert(id.clone());
                    }
                    continue;
                }
            }
            if short {
                if !known.contains(id) {
                    tracing::warn!(%id, free_mb, reserve_mb,
                        "the host's disk is full: the VM stopped on a write it could not make");
                    self.note_event(
                        id,
                        &format!(
                            "stopped: the host's disk is full; its pending write is kept, and it                              goes on once the host has {reserve_mb} MiB free again"
                        ),
                    )
                    .await;
                }
                stopped.insert(id.clone());
                continue;
            }
            match manager.resume_after_full_disk(id).await {
                Ok(_) => {
                    tracing::info!(%id, free_mb, "the host's disk has room again: the VM goes on");
                    self.note_event(id, "resumed: the host's disk has room again")
                        .await;
                }
                Err(e) => {
                    tracing::warn!(%id, "resuming a VM a full disk stopped: {e}");
                    stopped.insert(id.clone());
                }
            }
        }
        let mut full = self.disk_holds().full.lock().unwrap();
        full.stopped = stopped;
        full.asked_all = true;
    }

    /// Add `reason` to sandbox `id`'s events (its status unchanged).
    async fn note_event(&self, id: &str, reason: &str) {
        if let Err(e) = self
            .store()
            .record_event(
                id,
                "sandbox.noted",
                Some(reason),
                &sandpit_store::Cause::by(crate::service::events::SANDPIT),
            )
            .await
        {
            tracing::warn!(%id, "recording a sandbox event: {e}");
        }
    }

    /// Record what `id`'s disk took (measured just before its VM went).
    pub(crate) async fn record_disk_use(&self, id: &str, bytes: u64) {
        if let Err(e) = self.store().set_disk_use(&[(id.to_string(), bytes)]).await {
            tracing::warn!(%id, "recording the disk use: {e}");
        }
    }
}
