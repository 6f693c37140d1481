//! A sandbox's resources as its guest counts them (E2B's `get_metrics`).
//!
//! Each call reads the guest now (its agent reads `/proc` and `statvfs`: a
//! few milliseconds, nothing the user runs) and keeps the reading, so a
//! caller that asks every few seconds gets the series since it began,
//! as E2B's sampled history would give it. The CPU share of a reading is
//! the guest's busy ticks since the reading before, over at least a
//! quarter of a second (the first call reads twice; a call that follows
//! another closer than that waits out the rest). Readings are kept
//! in this process's memory for an hour, at most [`KEPT`] a sandbox: a
//! restart or another replica starts a new series. A paused sandbox is not
//! woken for it (its kept readings are the answer), and a reading is not
//! use: it keeps no sandbox from its idle sleep.

use super::*;
use crate::model::SandboxMetric;
use sandpit_protocol::GuestStats;
use std::collections::{HashMap, VecDeque};
use std::time::Duration;
use time::OffsetDateTime;

/// Readings kept per sandbox (an hour of one every 5 s).
const KEPT: usize = 720;
/// How long a reading is kept.
const KEPT_FOR: Duration = Duration::from_secs(3600);
/// The shortest interval a CPU share is taken over.
const CPU_WINDOW: Duration = Duration::from_millis(250);

/// The kept readings of every sandbox this process read.
#[derive(Default)]
pub(crate) struct Readings(std::sync::Mutex<HashMap<String, Series>>);

#[derive(Default)]
struct Series {
    /// The last raw reading, for the next one's CPU share.
    last: Option<(std::time::Instant, GuestStats)>,
    kept: VecDeque<SandboxMetric>,
}

impl Readings {
    fn kept(&self, id: &str) -> Vec<SandboxMetric> {
        let all = self.0.lock().unwrap_or_else(|p| p.into_inner());
        all.get(id)
            .map(|s| s.kept.iter().cloned().collect())
            .unwrap_or_default()
    }

    fn last(&self, id: &str) -> Option<(std::time::Instant, GuestStats)> {
        let all = self.0.lock().unwrap_or_else(|p| p.into_inner());
        all.get(id).and_then(|s| s.last.clone())
    }

    /// Keep `now`, read at `at`, after `before` (the reading its CPU share
    /// is taken against).
    fn keep(&self, id: &str, before: &GuestStats, now: GuestStats, at: std::time::Instant) {
        let metric = metric(before, &now, OffsetDateTime::now_utc());
        let mut all = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let cutoff = OffsetDateTime::now_utc() - KEPT_FOR;
        let cutoff_ms = (cutoff.unix_timestamp_nanos() / 1_000_000) as i64;
        // Series nobody read for an hour (ended sandboxes among them) go.
        all.retain(|_, s| s.kept.back().is_some_and(|m| m.at_unix_ms >= cutoff_ms));
        let series = all.entry(id.to_string()).or_default();
        series.kept.push_back(metric);
        while series.kept.len() > KEPT
            || series
                .kept
                .front()
                .is_some_and(|m| m.at_unix_ms < cutoff_ms)
        {
            series.kept.pop_front();
        }
        series.last = Some((at, now));
    }
}

/// The metric of reading `now` after `before`.
fn metric(before: &GuestStats, now: &GuestStats, at: OffsetDateTime) -> SandboxMetric {
    let busy = now.cpu_busy_ticks.saturating_sub(before.cpu_busy_ticks);
    let total = now.cpu_total_ticks.saturating_sub(before.cpu_total_ticks);
    let cpu_used_pct = if total == 0 {
        0.0
    } else {
        (busy as f64 * 100.0 / total as f64).clamp(0.0, 100.0)
    };
    SandboxMetric {
        at_unix_ms: (at.unix_timestamp_nanos() / 1_000_000) as i64,
        cpu_count: now.cpu_count,
        cpu_used_pct,
        mem_used_bytes: now.mem_total_bytes.saturating_sub(now.mem_available_bytes),
        mem_total_bytes: now.mem_total_bytes,
        mem_cache_bytes: now.mem_cache_bytes,
        disk_used_bytes: now.disk_used_bytes,
        disk_total_bytes: now.disk_total_bytes,
    }
}

impl Service {
    /// The API's `sandbox_metrics`.
    pub(super) async fn read_metrics(
        &self,
        caller: &Caller,
        id: &str,
    ) -> Result<Vec<SandboxMetric>> {
        let row = self.owned(caller, id).await?;
        if row.status == SandboxStatus::Paused {
            return Ok(self.readings.kept(&row.id));
        }
        if row.status != SandboxStatus::Running {
            return Err(not_running(&row));
        }
        let machines = self.machines_for(&row).await?;
        let read = || async {
            match machines.stats(&row.id).await {
                Ok(s) => Ok((std::time::Instant::now(), s)),
                Err(e) => Err(self.agent_failure(&row, e).await),
            }
        };
        // The reading this one's CPU share is taken against, at least
        // CPU_WINDOW before it.
        let before = match self.readings.last(&row.id) {
            Some(last) => last,
            None => read().await?,
        };
        if let Some(wait) = CPU_WINDOW.checked_sub(before.0.elapsed()) {
            tokio::time::sleep(wait).await;
        }
        let (at, now) = read().await?;
        self.readings.keep(&row.id, &before.1, now, at);
        Ok(self.readings.kept(&row.id))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(busy: u64, total: u64) -> GuestStats {
        GuestStats {
            cpu_count: 2,
            cpu_busy_ticks: busy,
            cpu_total_ticks: total,
            mem_total_bytes: 1000,
            mem_available_bytes: 600,
            mem_cache_bytes: 200,
            disk_total_bytes: 4000,
            disk_used_bytes: 1500,
        }
    }

    #[test]
    fn the_cpu_share_is_of_the_ticks_between_two_readings() {
        let at = OffsetDateTime::from_unix_timestamp(1_765_000_000).unwrap();
        let m = metric(&stats(100, 1000), &stats(150, 1200), at);
        assert_eq!(m.cpu_used_pct, 25.0);
        assert_eq!(m.mem_used_bytes, 400);
        assert_eq!(m.at_unix_ms, 1_765_000_000_000);
        // No ticks between them (the same reading): nothing busy, not NaN.
        assert_eq!(metric(&stats(1, 2), &stats(1, 2), at).cpu_used_pct, 0.0);
    }

    #[test]
    fn a_series_keeps_its_latest_readings() {
        let r = Readings::default();
        let t = std::time::Instant::now();
        for i in 0..(KEPT as u64 + 5) {
            r.keep("sbx_a", &stats(0, 0), stats(i, i * 2), t);
        }
        let kept = r.kept("sbx_a");
        assert_eq!(kept.len(), KEPT);
        assert!(r.kept("sbx_b").is_empty());
        assert_eq!(r.last("sbx_a").unwrap().1.cpu_busy_ticks, KEPT as u64 + 4);
    }
}
