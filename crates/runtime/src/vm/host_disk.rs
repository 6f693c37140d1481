//! The host's disk under the guests: the reserve kept free for them, and
//! what happens to a guest when the host's disk fills anyway.
//!
//! Guests' overlays are thin, so the host's free space is shared by every
//! running guest. Below `disk_reserve_mb` no new VM starts (the running
//! ones need that room to grow into). If the guests fill it regardless, a
//! write QEMU cannot complete for want of host space stops that VM
//! (`werror=enospc` on the drive, QEMU's default, set explicitly): the write
//! is kept and retried when the VM is resumed, so nothing is lost and the
//! guest's filesystem never sees an error it would have to recover from.
//! The other choice, passing the error into the guest (`werror=report`),
//! gives the guest EIO, not ENOSPC (a virtio disk has no "full" status),
//! and ext4 takes a failed journal write as corruption and goes read-only
//! until the next boot.
//!
//! The service sees such stops ([`VmManager::stopped_on_full_disk`]), says
//! so in the sandbox's events, and resumes each VM once the host has its
//! reserve free again ([`VmManager::resume_after_full_disk`]).

use super::qmp::Qmp;
use super::{validate_id, VmManager};
use crate::{Result, RuntimeError};
use std::time::Duration;

/// How long a question to one VM's QEMU may take: a QEMU that does not
/// answer is reported, and the next sample asks again.
const QMP_BOUND: Duration = Duration::from_secs(5);

/// The `-drive` options that say what a failed write does: stop the VM on
/// "no space" (and retry the write on resume), report any other error to
/// the guest.
pub(crate) const WRITE_ERRORS: &str = "werror=enospc,rerror=report";

impl VmManager {
    /// MiB free for unprivileged writers on the filesystem of the VMs'
    /// overlays.
    pub fn disk_free_mb(&self) -> Result<u64> {
        let dir = self.config.vms_dir();
        let st = nix::sys::statvfs::statvfs(&dir)
            .map_err(|e| RuntimeError::Launch(format!("statvfs {}: {e}", dir.display())))?;
        Ok((st.blocks_available() as u64 * st.fragment_size() as u64) >> 20)
    }

    /// The free space kept for running guests, in MiB.
    pub fn disk_reserve_mb(&self) -> u64 {
        self.config.disk_reserve_mb
    }

    /// Refuse a new VM while the VMs' filesystem has less free than its
    /// reserve: the guests already running need that room to grow into.
    pub(super) fn check_disk_reserve(&self) -> Result<()> {
        let free_mb = self.disk_free_mb()?;
        if free_mb < self.config.disk_reserve_mb {
            return Err(RuntimeError::Busy(format!(
                "the host's disk has {free_mb} MiB free for sandboxes, under its reserve of {} MiB; \
                 no new sandbox starts until space is freed",
                self.config.disk_reserve_mb
            )));
        }
        Ok(())
    }

    /// Whether VM `id` stands stopped because a disk write found the host's
    /// disk full (QEMU's run state `io-error`).
    pub async fn stopped_on_full_disk(&self, id: &str) -> Result<bool> {
        let status = self.run_state(id).await?;
        Ok(status == "io-error")
    }

    /// Resume VM `id` if a full host disk stopped it; its held write is
    /// retried first. Returns whether it was stopped so.
    pub async fn resume_after_full_disk(&self, id: &str) -> Result<bool> {
        if !self.stopped_on_full_disk(id).await? {
            return Ok(false);
        }
        self.qmp_bounded(id, "cont", |mut qmp| async move {
            qmp.execute("cont", serde_json::json!({})).await
        })
        .await?;
        Ok(true)
    }

    /// QEMU's run state of VM `id` (`running`, `paused`, `io-error`, …).
    async fn run_state(&self, id: &str) -> Result<String> {
        let answer = self
            .qmp_bounded(id, "query-status", |mut qmp| async move {
                qmp.execute("query-status", serde_json::json!({})).await
            })
            .await?;
        Ok(answer
            .get("status")
            .and_then(|s| s.as_str())
            .unwrap_or_default()
            .to_string())
    }

    /// Run `ask` on a QMP connection to VM `id`, within [`QMP_BOUND`].
    pub(super) async fn qmp_bounded<F, T>(
        &self,
        id: &str,
        what: &str,
        ask: impl FnOnce(Qmp) -> F,
    ) -> Result<T>
    where
        F: std::future::Future<Output = Result<T>>,
    {
        validate_id(id)?;
        let socket = self.paths(id).qmp_socket();
        let asked = async {
            let qmp = Qmp::connect(&socket).await?;
            ask(qmp).await
        };
        match tokio::time::timeout(QMP_BOUND, asked).await {
            Ok(answer) => answer,
            Err(_) => Err(RuntimeError::Disconnected(format!(
                "QEMU of {id} did not answer {what} within {} s",
                QMP_BOUND.as_secs()
            ))),
        }
    }
}
