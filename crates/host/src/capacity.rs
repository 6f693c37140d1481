//! Admission: whether this host can start one more VM, decided before it
//! starts, so that a full machine refuses a create with `503` and a
//! `Retry-After` rather than admitting a VM that fails later, or one that
//! pushes the host into its OOM killer.
//!
//! Guests' memory is overcommitted (an idle `small` sandbox of 4 GiB costs
//! the host a few dozen MiB), so admission goes by what the host has now,
//! not by what guests were promised:
//! - **memory**: the kernel's `MemAvailable`, less what the starts under
//!   way will take (the kernel does not see them yet), must stay above a
//!   reserve kept for the host and for the running guests to grow into;
//! - **CPU**: what the VMs' processes used over the last minute must stay
//!   under a share of the host's CPUs (idle sandboxes cost a little each,
//!   and hundreds of them add up; busy ones more);
//! - **kernel limits**: tasks against `pid_max`/`threads-max`, and this
//!   process's file descriptors against its limit, each with room for
//!   one more VM.
//!
//! The pool's refill is held to the same budget, so warm VMs never eat the
//! room creates need. The figures are read from `/proc`
//! ([`sandpit_runtime::host`]): memory and tasks at each decision (a small
//! file each), the VMs' CPU and the descriptors by a sampler every few
//! seconds (they cost a read per VM).

use serde::{Deserialize, Serialize};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// `[capacity]`: this host's admission budget.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CapacityConfig {
    /// Memory kept for the host and for running guests to grow into, MiB:
    /// no VM starts when the memory left would fall below it. Unset: an
    /// eighth of the host's memory, at least 1 GiB.
    pub memory_reserve_mb: Option<u64>,
    /// Host memory charged for each VM start under way, MiB, until the
    /// kernel's own figure shows it (a restored idle VM settles at a few
    /// dozen MiB; a start briefly takes more).
    pub memory_per_start_mb: u64,
    /// The VMs may use at most this share of the host's CPUs (percent of
    /// all of them), averaged over `cpu_window_secs`; past it creates are
    /// refused. 0: no CPU budget.
    pub cpu_budget_percent: u32,
    /// The window the VMs' CPU use is averaged over, seconds.
    pub cpu_window_secs: u64,
}

impl CapacityConfig {
    /// The memory kept on a host of `total_mb`, MiB.
    pub fn reserve_mb(&self, total_mb: u64) -> u64 {
        self.memory_reserve_mb
            .unwrap_or_else(|| (total_mb / 8).max(1024))
    }
}

impl Default for CapacityConfig {
    fn default() -> Self {
        CapacityConfig {
            memory_reserve_mb: None,
            memory_per_start_mb: 192,
            cpu_budget_percent: 90,
            cpu_window_secs: 60,
        }
    }
}

/// Tasks one VM adds (QEMU's threads, passt, the expiry watchdog), with
/// room to spare.
const TASKS_PER_VM: u64 = 32;
/// This process's descriptors one VM adds (agent connection, pidfds,
/// pipes), with room to spare; and those kept for everything else.
const DESCRIPTORS_PER_VM: u64 = 16;
const DESCRIPTORS_KEPT: u64 = 256;
/// How often the sampler reads the VMs' CPU time and the descriptors.
pub const SAMPLE_EVERY: Duration = Duration::from_secs(5);
/// How long a refused create is told to wait.
pub const RETRY_AFTER_SECS: u64 = 15;

/// What limits this host now, if anything (the `limited_by` of
/// [`CapacityReport`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Limit {
    Memory,
    Cpu,
    Tasks,
    Descriptors,
}

/// This host's admission figures, as `get_service_info` shows them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct CapacityReport {
    /// Whether a create that needs a new VM would be admitted now.
    pub accepting: bool,
    /// The budget that refuses it, when one does.
    pub limited_by: Option<Limit>,
    /// Why, in words (absent while accepting).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    pub memory_total_mb: u64,
    /// What the kernel can still give (`MemAvailable`).
    pub memory_available_mb: u64,
    pub memory_reserve_mb: u64,
    pub memory_per_start_mb: u64,
    /// VM starts under way, each charged `memory_per_start_mb`.
    pub starting: u64,
    /// How many more VMs the memory budget admits now, at
    /// `memory_per_start_mb` each.
    pub room_by_memory: u64,
    /// The VMs' CPU use over the window, percent of all the host's CPUs.
    pub cpu_used_percent: f64,
    /// 0: no CPU budget.
    pub cpu_budget_percent: u32,
    pub cpu_window_secs: u64,
    pub cpus: u32,
    pub tasks: u64,
    pub tasks_max: u64,
    pub descriptors: u64,
    pub descriptors_max: u64,
}

/// The admission state of one host.
pub struct Capacity {
    config: CapacityConfig,
    starting: AtomicU64,
    samples: Mutex<Samples>,
}

/// The VMs' CPU time as the sampler found it.
#[derive(Default)]
struct Samples {
    /// CPU ticks each VM process had at the last sample.
    last: HashMap<u32, u64>,
    /// Ticks used by VM processes since the first sample, and when.
    history: VecDeque<(Instant, u64)>,
    used: u64,
    descriptors: Option<sandpit_runtime::host::Descriptors>,
}

/// A VM start charged to the memory budget until it is dropped (the start
/// ended: its VM now shows in the kernel's figures, or it failed).
pub struct StartCharge<'a>(&'a Capacity);

impl Drop for StartCharge<'_> {
    fn drop(&mut self) {
        self.0.starting.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Capacity {
    pub fn new(config: CapacityConfig) -> Capacity {
        Capacity {
            config,
            starting: AtomicU64::new(0),
            samples: Mutex::new(Samples::default()),
        }
    }

    pub fn config(&self) -> &CapacityConfig {
        &self.config
    }

    /// Admit one VM start, charged until the returned guard drops; `Err`
    /// says which budget refuses it.
    pub fn admit_start(&self) -> Result<StartCharge<'_>, String> {
        // Charged first, so two starts deciding at once both count the other.
        self.starting.fetch_add(1, Ordering::SeqCst);
        let charge = StartCharge(self);
        let report = self.report_with(0);
        match report.reason {
            Some(why) if !report.accepting => Err(why),
            _ => Ok(charge),
        }
    }

    /// Whether a ready pool VM may become a sandbox: it takes no more
    /// memory than it already does, but a sandbox more on a host whose CPU
    /// budget or kernel limits are spent would not be served well.
    pub fn admit_warm(&self) -> Result<(), String> {
        match self
            .assess(0)
            .1
            .into_iter()
            .find(|(l, _)| *l != Limit::Memory)
        {
            Some((_, why)) => Err(why),
            None => Ok(()),
        }
    }

    /// The figures now, and whether one more VM start would be admitted.
    pub fn report(&self) -> CapacityReport {
        self.report_with(1)
    }

    /// The figures, with `extra` starts charged beyond those under way;
    /// the first budget spent (if any) is what limits the host.
    fn report_with(&self, extra: u64) -> CapacityReport {
        let (mut report, limits) = self.assess(extra);
        if let Some((limit, why)) = limits.into_iter().next() {
            report.accepting = false;
            report.limited_by = Some(limit);
            report.reason = Some(why);
        }
        report
    }

    /// The figures, and every budget spent, memory first.
    fn assess(&self, extra: u64) -> (CapacityReport, Vec<(Limit, String)>) {
        let memory = sandpit_runtime::host::memory().unwrap_or_default();
        let tasks = sandpit_runtime::host::tasks().unwrap_or_default();
        let reserve = self.memory_reserve_mb(memory.total_mb);
        let per_start = self.config.memory_per_start_mb.max(1);
        let starting = self.starting.load(Ordering::SeqCst);
        let free_after =
            memory.available_mb as i64 - (starting * per_start) as i64 - reserve as i64;
        let room_by_memory = (free_after.max(0) as u64) / per_start;
        let cpus = sandpit_runtime::host::cores() as u32;
        let (cpu_used_percent, descriptors) = {
            let s = self.samples.lock().unwrap();
            (
                self.cpu_percent(&s, cpus),
                s.descriptors.unwrap_or_default(),
            )
        };
        let budget = self.config.cpu_budget_percent;
        let mut limits = Vec::new();
        let charged = (starting + extra) * per_start;
        if memory.total_mb > 0 && (memory.available_mb as i64 - charged as i64) < reserve as i64 {
            limits.push((
                Limit::Memory,
                format!(
                    "this host is out of memory for sandboxes: {} MiB available, {} MiB \
                     taken by {} starts under way, {reserve} MiB kept in reserve",
                    memory.available_mb,
                    starting * per_start,
                    starting
                ),
            ));
        }
        if budget > 0 && cpu_used_percent >= f64::from(budget) {
            limits.push((
                Limit::Cpu,
                format!(
                    "this host's sandboxes use {cpu_used_percent:.0} % of its CPUs (over the \
                     last {} s), at its budget of {budget} %",
                    self.config.cpu_window_secs
                ),
            ));
        }
        if tasks.max > 0 && tasks.now + TASKS_PER_VM > tasks.max {
            limits.push((
                Limit::Tasks,
                format!(
                    "this host runs {} tasks, near the kernel's limit of {}",
                    tasks.now, tasks.max
                ),
            ));
        }
        if descriptors.limit > 0
            && descriptors.open + DESCRIPTORS_PER_VM + DESCRIPTORS_KEPT > descriptors.limit
        {
            limits.push((
                Limit::Descriptors,
                format!(
                    "the server holds {} file descriptors, near its limit of {}",
                    descriptors.open, descriptors.limit
                ),
            ));
        }
        let report = CapacityReport {
            accepting: true,
            limited_by: None,
            reason: None,
            memory_total_mb: memory.total_mb,
            memory_available_mb: memory.available_mb,
            memory_reserve_mb: reserve,
            memory_per_start_mb: per_start,
            starting,
            room_by_memory,
            cpu_used_percent: (cpu_used_percent * 10.0).round() / 10.0,
            cpu_budget_percent: budget,
            cpu_window_secs: self.config.cpu_window_secs,
            cpus,
            tasks: tasks.now,
            tasks_max: tasks.max,
            descriptors: descriptors.open,
            descriptors_max: descriptors.limit,
        };
        (report, limits)
    }

    fn memory_reserve_mb(&self, total_mb: u64) -> u64 {
        self.config.reserve_mb(total_mb)
    }

    /// The VMs' CPU use over the window (or since the first sample, if
    /// that is shorter), percent of all `cpus`.
    fn cpu_percent(&self, s: &Samples, cpus: u32) -> f64 {
        let (Some(first), Some(last)) = (s.history.front(), s.history.back()) else {
            return 0.0;
        };
        let secs = last.0.duration_since(first.0).as_secs_f64();
        if secs < 1.0 {
            return 0.0;
        }
        let ticks = (last.1 - first.1) as f64;
        ticks / sandpit_runtime::host::clock_ticks_per_second() / secs / f64::from(cpus.max(1))
            * 100.0
    }

    /// Reads the CPU time of the VMs' processes `pids` (and this process's
    /// descriptors); called every [`SAMPLE_EVERY`]. A process seen for the
    /// first time counts from then on: a start's own work is not the
    /// steady use the budget is about.
    pub fn sample(&self, pids: &[u32]) {
        let now: HashMap<u32, u64> = pids
            .iter()
            .filter_map(|p| Some((*p, sandpit_runtime::host::cpu_ticks(*p)?)))
            .collect();
        let descriptors = sandpit_runtime::host::descriptors();
        let mut s = self.samples.lock().unwrap();
        let used: u64 = now
            .iter()
            .filter_map(|(pid, t)| Some(t.saturating_sub(*s.last.get(pid)?)))
            .sum();
        s.used += used;
        s.last = now;
        let at = Instant::now();
        let total = s.used;
        s.history.push_back((at, total));
        let window = Duration::from_secs(self.config.cpu_window_secs.max(1));
        while s
            .history
            .get(1)
            .is_some_and(|(t, _)| at.duration_since(*t) >= window)
        {
            s.history.pop_front();
        }
        s.descriptors = descriptors;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reserve_above_the_host_refuses_every_start_and_says_why() {
        let c = Capacity::new(CapacityConfig {
            memory_reserve_mb: Some(u64::MAX / 4),
            ..CapacityConfig::default()
        });
        let why = c.admit_start().err().expect("refused");
        assert!(why.contains("out of memory"), "{why}");
        let r = c.report();
        assert!(!r.accepting);
        assert_eq!(r.limited_by, Some(Limit::Memory));
        assert_eq!(r.starting, 0, "a refused start is not left charged");
        assert_eq!(r.room_by_memory, 0);
        // A ready VM takes no more memory: it may still be handed out.
        assert!(c.admit_warm().is_ok());
    }

    #[test]
    fn starts_under_way_are_charged_until_they_end() {
        let c = Capacity::new(CapacityConfig {
            memory_reserve_mb: Some(0),
            memory_per_start_mb: 1,
            cpu_budget_percent: 0,
            ..CapacityConfig::default()
        });
        let a = c.admit_start().unwrap();
        let b = c.admit_start().unwrap();
        assert_eq!(c.report().starting, 2);
        drop((a, b));
        assert_eq!(c.report().starting, 0);
        assert!(c.report().accepting, "{:?}", c.report());
        assert!(c.report().room_by_memory > 0);
    }

    #[test]
    fn the_cpu_budget_counts_the_vms_use_over_the_window() {
        let c = Capacity::new(CapacityConfig {
            memory_reserve_mb: Some(0),
            cpu_budget_percent: 1,
            ..CapacityConfig::default()
        });
        // This test's own process stands for a busy VM.
        let me = std::process::id();
        c.sample(&[me]);
        let t = Instant::now();
        while t.elapsed() < Duration::from_millis(1500) {
            std::hint::black_box((0..1000u64).sum::<u64>());
        }
        c.sample(&[me]);
        let r = c.report();
        assert!(r.cpu_used_percent > 1.0, "{r:?}");
        assert_eq!(r.limited_by, Some(Limit::Cpu), "{r:?}");
        assert!(c.admit_warm().is_err());
        // With memory spent too, memory is what limits a start, and the
        // CPU budget still refuses a warm VM.
        let both = Capacity::new(CapacityConfig {
            memory_reserve_mb: Some(u64::MAX / 4),
            cpu_budget_percent: 1,
            ..CapacityConfig::default()
        });
        both.sample(&[me]);
        let t = Instant::now();
        while t.elapsed() < Duration::from_millis(1500) {
            std::hint::black_box((0..1000u64).sum::<u64>());
        }
        both.sample(&[me]);
        assert_eq!(both.report().limited_by, Some(Limit::Memory));
        assert!(both.admit_warm().unwrap_err().contains("CPUs"));
        // A process seen once has not used anything yet.
        let fresh = Capacity::new(CapacityConfig::default());
        fresh.sample(&[me]);
        assert_eq!(fresh.report().cpu_used_percent, 0.0);
    }
}
