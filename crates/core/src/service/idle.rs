//! The idle sweep: sandboxes nobody used for `idle_pause_secs` sleep.
//!
//! Separate from the reaper because it decides on use, not on time: what
//! counts as use is in [`crate::idle`] (calls, preview requests), plus what
//! the guest did on its own, read here from its host processes (QEMU's CPU
//! time, the bytes passt moved), plus open preview connections and
//! terminals. A sandbox idle on all of these is paused as its owner would
//! pause it (`pause_row`); the next call that needs it resumes it.

use crate::idle::GuestUse;
use crate::model::SandboxStatus;
use crate::service::Service;
use sandpit_runtime::host;
use std::collections::HashSet;
use std::time::Duration;

/// Above this share of one core between two sweeps, the guest is busy
/// (an idle guest takes about 0.2 %; a guest running anything, far more).
const BUSY_CPU_PERCENT: f64 = 2.0;
/// Above this many bytes through passt between two sweeps, the guest is
/// busy on the network (a download, a connection it serves).
const BUSY_NET_BYTES: u64 = 64 * 1024;

impl Service {
    /// How often the idle sweep runs (`None`: it does not).
    pub(super) fn idle_sweep_every(&self) -> Option<Duration> {
        let quarter = self.config.idle_pause_secs / 4;
        self.activity
            .tracking()
            .then(|| Duration::from_secs(quarter.clamp(1, 30)))
    }

    /// Pause the sandboxes of this host that were idle for
    /// `idle_pause_secs`; `every` is the time since the sweep before.
    pub(super) async fn pause_idle_once(&self, every: Duration) {
        // Replicas of a cluster see only their own calls.
        if self.membership.get().is_some() {
            return;
        }
        let idle = Duration::from_secs(self.config.idle_pause_secs);
        let rows = match self.store.live_sandboxes(&self.config.host_name).await {
            Ok(rows) => rows,
            Err(e) => {
                tracing::warn!("idle sweep: {e}");
                return;
            }
        };
        let threshold = GuestUse {
            cpu_ticks: (host::clock_ticks_per_second() * every.as_secs_f64() * BUSY_CPU_PERCENT
                / 100.0) as u64,
            net_bytes: BUSY_NET_BYTES,
        };
        let live: HashSet<&str> = rows.iter().map(|r| r.id.as_str()).collect();
        for row in &rows {
            if row.status != SandboxStatus::Running {
                continue;
            }
            // Only a VM restored from a template can be saved (a cold boot
            // has no base to save against).
            let Some(record) = self.vm_record(&row.id) else {
                continue;
            };
            if record.template.is_none() {
                continue;
            }
            let guest = GuestUse {
                cpu_ticks: host::cpu_ticks(record.qemu_pid).unwrap_or(0),
                net_bytes: record.passt_pid.and_then(host::io_bytes).unwrap_or(0),
            };
            self.activity.guest_used(&row.id, guest, threshold);
            if self.previews.has_open(&row.id) || self.terminals.has_open(&row.id) {
                self.activity.touch(&row.id);
                continue;
            }
            if !self.activity.claim_idle(&row.id, idle) {
                continue;
            }
            let paused = self
                .pause_row(&row.id, crate::service::events::IDLE_SWEEP)
                .await;
            self.activity.release(&row.id);
            match paused {
                Ok(_) => tracing::info!(id = %row.id, "paused after {idle:?} idle"),
                Err(e) => tracing::warn!(id = %row.id, "pausing an idle sandbox: {}", e.message),
            }
        }
        for id in self.activity.known() {
            if !live.contains(id.as_str()) {
                self.activity.forget(&id);
            }
        }
    }
}
