//! `sandpit bench`: one command that measures what users feel, on this
//! machine, and prints medians. Times are noisy here (2 shared cores, TCG), so
//! every figure is a median of several runs taken in the same invocation.

use sandpit_core::prelude::*;
use sandpit_server::settings::Settings;
mod cluster;
mod control_plane;
mod load;
mod preview;
mod secrets;
mod snapshots;
mod volumes;

use anyhow::Result;
use clap::Args;
use control_plane::control_plane;
use sandpit_protocol::ExecRequest;
use sandpit_runtime::CreateVm;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// Output kept per stream of a command the bench runs (what `sandpit
/// sandbox exec` keeps by default).
const MAX_OUTPUT: u64 = 1024 * 1024;

#[derive(Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    mode: Option<BenchMode>,
    /// Cold boots and restores to time
    #[arg(long, default_value_t = 5)]
    creates: usize,
    /// Creates over MCP to time, with a warm pool and with none
    #[arg(long, default_value_t = 100)]
    mcp_creates: usize,
    /// Concurrent creates in the burst
    #[arg(long, default_value_t = 20)]
    burst: usize,
    /// Idle sandboxes alive for the density measurement
    #[arg(long, default_value_t = 50)]
    idle: usize,
    /// `true` round trips to time
    #[arg(long, default_value_t = 50)]
    execs: usize,
    /// 16 MiB transfers to time in each direction
    #[arg(long, default_value_t = 5)]
    transfers: usize,
    /// Sandbox size to use
    #[arg(long, default_value = "small")]
    size: String,
    /// Measure only the runtime, not the server's REST and MCP paths
    #[arg(long)]
    skip_control_plane: bool,
    /// After the idle sandboxes, keep creating until the host refuses one
    /// (admission) or a create fails, and say which limit it was
    #[arg(long)]
    fill: bool,
    /// Let idle sandboxes sleep (`[limits] idle_pause_seconds`) after this
    /// many seconds: the idle crowd is then measured once it slept, with
    /// the first command in a slept sandbox timed
    #[arg(long)]
    idle_pause: Option<u64>,
    /// The python of an environment with E2B's SDK, which E2B's figures
    /// are measured through (`scripts/e2b-sdks.sh` makes one and prints
    /// its path)
    #[arg(long, env = "SANDPIT_E2B_PYTHON")]
    e2b_python: Option<std::path::PathBuf>,
}

/// Other measurements than the default table.
#[derive(clap::Subcommand)]
pub enum BenchMode {
    /// Many concurrent MCP clients (tools/list, get_usage, run_command)
    /// against a running `sandpit serve`: errors and latency percentiles
    Load(crate::load::LoadArgs),
    /// What running as a cluster adds: create, `run_command` and a preview
    /// GET through a replica to a `sandpit node` beside the embedded single
    /// process (a throwaway PostgreSQL is started), and how long a killed
    /// node takes to settle
    Cluster(crate::cluster::ClusterBenchArgs),
    /// Snapshots, fork, restore, pause and resume of a sandbox that touched
    /// memory, each as a ratio to a template restore in the same run
    Snapshots(crate::snapshots::SnapshotBenchArgs),
    /// What the secret-injecting egress path adds over the plain one: an
    /// HTTPS request on a new and on a kept connection, and throughput,
    /// through the runtime's proxy on loopback (no VM, no root)
    Secrets(crate::secrets::SecretsBenchArgs),
    /// Sequential write and read in a guest on a volume, against its own
    /// disk in the same VM and run
    Volumes(crate::volumes::VolumeBenchArgs),
}

/// Refills timed with a live sandbox's commands running.
const REFILL_ROUNDS: usize = 3;
/// The live sandbox's commands at rest before each of those refills.
const REST_CALLS_PER_ROUND: usize = 40;

/// The lifetime of the idle crowd's and `--fill`'s sandboxes.
const IDLE_LIFETIME_MINUTES: u32 = 180;

/// How long the idle crowd and `--fill` keep retrying a create that the
/// host refused for want of room (its memory catches up as KSM merges the
/// newest sandboxes' pages) before taking the refusal as the end.
const ADMISSION_PATIENCE: Duration = Duration::from_secs(180);

/// Refusals met by [`create_admitted`].
#[derive(Default)]
struct Admission {
    /// Sandboxes alive at the first refusal.
    first_refused_at: Option<usize>,
    retries: usize,
    waited: Duration,
}

/// `create`, as a client that honours `Retry-After` calls it: a refusal
/// while the host reports a spent budget (`capacity.limited_by`) is retried
/// after `Retry-After` seconds, until [`ADMISSION_PATIENCE`] has passed;
/// any other error, or a refusal past that, is returned. `alive`: the
/// sandboxes alive now, recorded at the first refusal.
async fn create_admitted<F, Fut>(
    create: &F,
    svc: &sandpit_core::Service,
    alive: usize,
    admission: &mut Admission,
) -> Result<serde_json::Value>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<serde_json::Value>>,
{
    let since = Instant::now();
    loop {
        let err = match create().await {
            Ok(v) => return Ok(v),
            Err(e) => e,
        };
        let limited = svc
            .service_info()
            .await?
            .capacity
            .is_some_and(|c| c.limited_by.is_some());
        if !limited || since.elapsed() >= ADMISSION_PATIENCE {
            return Err(err);
        }
        admission.first_refused_at.get_or_insert(alive);
        admission.retries += 1;
        let pause = Duration::from_secs(sandpit_host::capacity::RETRY_AFTER_SECS);
        tokio::time::sleep(pause).await;
        admission.waited += pause;
    }
}

/// Interleaved timings, one row per round (milliseconds), in these columns.
#[derive(Default)]
struct Laps(Vec<[f64; 7]>);

/// `run_command` through rmcp's client over HTTP.
const LAP_MCP: usize = 0;
/// The shell's own time, as the MCP answer gives it.
const LAP_MCP_SHELL: usize = 1;
/// The service's `exec`, in process (no HTTP, no MCP).
const LAP_SERVICE: usize = 2;
/// The shell's own time, as the service's answer gives it.
const LAP_SERVICE_SHELL: usize = 3;
/// The agent alone.
const LAP_DIRECT: usize = 4;
/// The shell's own time, as the agent timed it.
const LAP_SHELL: usize = 5;
/// The same `tools/call` as one plain JSON-RPC POST (no SDK).
const LAP_PLAIN_POST: usize = 6;

impl Laps {
    fn push(&mut self, lap: [f64; 7]) {
        self.0.push(lap);
    }

    fn column(&self, i: usize) -> Vec<f64> {
        self.0.iter().map(|l| l[i]).collect()
    }

    /// Median of `outer - inner`, round by round.
    fn overhead(&self, outer: usize, inner: usize) -> f64 {
        median(self.0.iter().map(|l| l[outer] - l[inner]).collect())
    }
}

/// What one burst of agents saw.
#[derive(Default)]
struct Burst {
    ids: Vec<String>,
    /// Each create's answer, ms after the burst began.
    creates_ms: Vec<f64>,
    /// When the last first command answered, s after the burst began.
    last_s: f64,
    errors: usize,
}

impl Burst {
    fn describe(&self, cold_s: f64) -> String {
        let med = median(self.creates_ms.clone());
        let p99 = percentile(&self.creates_ms, 0.99);
        format!(
            "all done in {:.2} s ({:.2}x a cold boot), {} errors; creates median {med:.0} ms, p99 {p99:.0} ms ({:.1}x p99/median)",
            self.last_s,
            self.last_s / cold_s,
            self.errors,
            p99 / med
        )
    }
}

pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let n = v.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// The nearest-rank percentile `q` (0..=1) of the samples.
pub(crate) fn percentile(v: &[f64], q: f64) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    if v.is_empty() {
        return f64::NAN;
    }
    let rank = (q * v.len() as f64).ceil() as usize;
    v[rank.clamp(1, v.len()) - 1]
}

/// The shell's own time, as the agent timed it (to the microsecond where
/// the agent says), ms.
fn shell_ms(r: &sandpit_protocol::ExecResult) -> f64 {
    r.duration_us
        .map_or(r.duration_ms as f64, |us| us as f64 / 1000.0)
}

fn true_cmd() -> ExecRequest {
    ExecRequest {
        command: "true".into(),
        cwd: None,
        env: BTreeMap::new(),
        timeout_ms: 60_000,
        max_output_bytes: MAX_OUTPUT,
        ..Default::default()
    }
}

/// Proportional set size of a process, KiB.
fn pss_kib(pid: u32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
    text.lines()
        .find(|l| l.starts_with("Pss:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}

/// CPU time (user+system) of a process, in clock ticks.
fn cpu_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

/// The host's KSM daemon: when it merges idle sandboxes' pages, its CPU
/// time is part of what they cost.
fn ksmd_pid() -> Option<u32> {
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let comm = std::fs::read_to_string(e.path().join("comm")).ok()?;
        (comm.trim() == "ksmd").then_some(pid)
    })
}

fn ksm_counter(name: &str) -> Option<u64> {
    std::fs::read_to_string(format!("/sys/kernel/mm/ksm/{name}"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Wait, at most `limit`, until KSM has made three full passes from now, so
/// idle memory is measured as it stays: a process that has just opted in is
/// queued behind the pass in progress, its first pass only notes each page's
/// checksum, and the next one merges. `None` when KSM is not running.
async fn ksm_settle(limit: Duration) -> Option<Duration> {
    if ksm_counter("run")? != 1 {
        return None;
    }
    let start = ksm_counter("full_scans")?;
    let t = Instant::now();
    while t.elapsed() < limit && ksm_counter("full_scans")? < start + 3 {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Some(t.elapsed())
}

/// Median and the largest sample (the p99 of the small runs used here).
fn median_max(v: &[f64]) -> (f64, f64) {
    (
        median(v.to_vec()),
        v.iter().cloned().fold(f64::NAN, f64::max),
    )
}

/// What idle VMs cost the host, measured by [`idle_cost`].
struct IdleCost {
    /// PSS per sandbox, MiB.
    pss: f64,
    /// CPU per sandbox, KSM's daemon's share included, % of one core.
    cpu: f64,
    /// KSM's daemon alone, % of one core (its pace follows the number of
    /// sandboxes: see `sandpit_runtime::host::ksm`).
    ksmd: f64,
    /// How long KSM took to settle, or that it is off.
    ksm: String,
}

/// Host PSS (MiB) and CPU (% of one core, over `window`) of VMs' QEMU and
/// passt processes and expiry watchdog, per sandbox (`per` of them: those
/// asleep have none), once KSM has merged what it will. The CPU includes KSM's daemon, also given alone. Also says how long
/// KSM took to settle.
async fn idle_cost(
    records: &[sandpit_runtime::VmRecord],
    per: usize,
    window: Duration,
) -> IdleCost {
    let per = per.max(1) as f64;
    let ksm = match ksm_settle(Duration::from_secs(300)).await {
        Some(d) => format!("KSM settled {:.0} s after", d.as_secs_f64()),
        None => "KSM off".to_string(),
    };
    let pids: Vec<u32> = records
        .iter()
        .flat_map(|r| {
            std::iter::once(r.qemu_pid)
                .chain(r.passt_pid)
                .chain(r.watchdog.map(|(pid, _)| pid))
        })
        .collect();
    let mut pss = Vec::new();
    for _ in 0..3 {
        let total: u64 = pids.iter().filter_map(|p| pss_kib(*p)).sum();
        pss.push(total as f64 / 1024.0 / per);
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let ksmd = ksmd_pid();
    let ticks = || {
        (
            pids.iter().filter_map(|p| cpu_ticks(*p)).sum::<u64>(),
            ksmd.and_then(cpu_ticks).unwrap_or(0),
        )
    };
    let (vms0, ksmd0) = ticks();
    tokio::time::sleep(window).await;
    let (vms1, ksmd1) = ticks();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let percent = |t: u64| t as f64 / hz / window.as_secs_f64() * 100.0;
    let ksmd = percent(ksmd1.saturating_sub(ksmd0));
    IdleCost {
        pss: median(pss),
        cpu: (percent(vms1.saturating_sub(vms0)) + ksmd) / per,
        ksmd,
        ksm,
    }
}

/// Waits until every one of `ids` is paused (`--idle-pause`), at most
/// `bound`: how many are, and how long it took.
async fn slept(
    svc: &sandpit_core::Service,
    ids: &[String],
    bound: Duration,
) -> Result<(usize, Duration)> {
    let t = Instant::now();
    loop {
        let mut asleep = 0;
        for id in ids {
            let row = svc.store().sandbox(id).await?;
            if row.is_some_and(|r| r.status == sandpit_core::SandboxStatus::Paused) {
                asleep += 1;
            }
        }
        if asleep == ids.len() || t.elapsed() >= bound {
            return Ok((asleep, t.elapsed()));
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

/// Bytes the files under `dir` take on disk (allocated blocks: saves are
/// sparse).
fn allocated_bytes(dir: &std::path::Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => allocated_bytes(&e.path()),
            Ok(m) => m.blocks() * 512,
            Err(_) => 0,
        })
        .sum()
}

pub(crate) struct Row(pub(crate) String, pub(crate) String);

/// One of the targets the bench is judged by: what was measured, the
/// target, and the figure it is judged on (a ratio taken in the same run,
/// where the target is one).
pub(crate) struct Target {
    what: String,
    measured: String,
    target: String,
    judged: String,
    met: bool,
}

fn target(
    targets: &mut Vec<Target>,
    what: impl Into<String>,
    measured: impl Into<String>,
    target: impl Into<String>,
    judged: impl Into<String>,
    met: bool,
) {
    let t = Target {
        what: what.into(),
        measured: measured.into(),
        target: target.into(),
        judged: judged.into(),
        met,
    };
    eprintln!(
        "target: {}: {} (target {}; {}) {}",
        t.what,
        t.measured,
        t.target,
        t.judged,
        if t.met { "met" } else { "NOT met" }
    );
    targets.push(t);
}

pub(crate) fn row(rows: &mut Vec<Row>, what: impl Into<String>, value: impl Into<String>) {
    let (what, value) = (what.into(), value.into());
    eprintln!("{what}: {value}");
    rows.push(Row(what, value));
}

pub async fn run(settings: &Settings, a: BenchArgs) -> Result<i32> {
    match a.mode {
        Some(BenchMode::Load(load)) => return crate::load::run(load).await,
        Some(BenchMode::Cluster(c)) => return crate::cluster::run(settings, c).await,
        Some(BenchMode::Snapshots(s)) => return crate::snapshots::run(settings, s).await,
        Some(BenchMode::Secrets(s)) => return crate::secrets::run(s).await,
        Some(BenchMode::Volumes(v)) => return crate::volumes::run(settings, v).await,
        None => {}
    }
    let _owner = sandpit_server::serve::own(settings, sandpit_server::owner::Role::Bench)?;
    let m = settings.vm_manager()?;
    eprintln!("accelerator: {}; size {}", m.accel(), a.size);
    let new = |id: String| CreateVm {
        id,
        size: a.size.clone(),
        metadata: BTreeMap::new(),
        // The bench destroys its VMs; should it die, they go within the hour.
        expires_at: time::OffsetDateTime::now_utc() + time::Duration::hours(1),
        egress: sandpit_runtime::Egress::open(),
        volumes: Vec::new(),
    };
    let mut rows = Vec::new();

    let mut cold = Vec::new();
    for _ in 0..a.creates {
        let id = sandpit_host::ids::new_id("sbx_");
        let t = Instant::now();
        let vm = m.create_cold(new(id.clone())).await?;
        vm.agent.exec_collect(true_cmd()).await?;
        cold.push(t.elapsed().as_secs_f64());
        m.destroy(&id).await?;
    }
    let cold_s = median(cold.clone());
    row(
        &mut rows,
        format!("cold boot to first command ({} runs)", cold.len()),
        format!("{:.2} s", cold_s),
    );

    let snapshots = m.snapshots_supported();
    let mut restore_s = f64::NAN;
    if snapshots {
        let template = m.ensure_template(&a.size).await?;
        row(
            &mut rows,
            "snapshot template build (once per image, size and QEMU)",
            format!("{:.2} s", template.record.build_secs),
        );
        let mut restores = Vec::new();
        // Each restore's phases (ms): set-up, then from QEMU's spawn the
        // state loaded, the agent's first answer, configured; then the
        // first command's round trip and its shell's own time.
        let mut phases: Vec<[f64; 6]> = Vec::new();
        for _ in 0..a.creates {
            let id = sandpit_host::ids::new_id("sbx_");
            let t = Instant::now();
            let vm = m.create(new(id.clone())).await?;
            let created = t.elapsed();
            let out = vm.agent.exec_collect(true_cmd()).await?;
            restores.push(t.elapsed().as_secs_f64());
            anyhow::ensure!(vm.record.template.is_some(), "the create booted cold");
            if let Some(s) = vm.start_times {
                let ms = |d: Duration| d.as_secs_f64() * 1000.0;
                phases.push([
                    ms(s.set_up),
                    ms(s.state_loaded),
                    ms(s.agent_answered),
                    ms(s.configured),
                    ms(t.elapsed() - created),
                    shell_ms(&out.result),
                ]);
            }
            m.destroy(&id).await?;
        }
        restore_s = median(restores.clone());
        row(
            &mut rows,
            format!(
                "restore from template to first command ({} runs)",
                restores.len()
            ),
            format!(
                "{:.0} ms ({:.1}x faster than cold)",
                restore_s * 1000.0,
                cold_s / restore_s
            ),
        );
        let phase = |i: usize| median(phases.iter().map(|p| p[i]).collect());
        row(
            &mut rows,
            format!(
                "where a restore to first command spends its time ({} runs)",
                phases.len()
            ),
            format!(
                "set-up before QEMU {:.0} ms; from QEMU's start: state loaded at {:.0} ms, the agent's first answer at {:.0} ms, configured at {:.0} ms; then the first `true` {:.0} ms (its shell, timed by the agent: {:.0} ms)",
                phase(0),
                phase(1),
                phase(2),
                phase(3),
                phase(4),
                phase(5)
            ),
        );
    }

    let id = sandpit_host::ids::new_id("sbx_");
    let vm = m.create(new(id.clone())).await?;
    let result = async {
        for _ in 0..3 {
            vm.agent.exec_collect(true_cmd()).await?;
        }
        let mut pings = Vec::new();
        for _ in 0..a.execs {
            let t = Instant::now();
            vm.agent.ping().await?;
            pings.push(t.elapsed().as_secs_f64() * 1000.0);
        }
        let (mut execs, mut in_guest) = (Vec::new(), Vec::new());
        for _ in 0..a.execs {
            let t = Instant::now();
            let out = vm.agent.exec_collect(true_cmd()).await?;
            execs.push(t.elapsed().as_secs_f64() * 1000.0);
            in_guest.push(shell_ms(&out.result));
        }
        // Small files: each call is a process of the guest user's in the
        // guest (see the agent's `files`), so their round trips are
        // measured against the empty request's.
        let small = vec![b'x'; 1024];
        let (mut small_writes, mut small_reads, mut stats) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..a.execs {
            let t = Instant::now();
            vm.agent.write_file("small.txt", &small, None).await?;
            small_writes.push(t.elapsed().as_secs_f64() * 1000.0);
            let t = Instant::now();
            let (_, back) = vm.agent.read_file("small.txt", 4096).await?;
            small_reads.push(t.elapsed().as_secs_f64() * 1000.0);
            anyhow::ensure!(back == small, "a small file read back differs");
            let t = Instant::now();
            vm.agent
                .path_call(sandpit_protocol::PathCall::Stat {
                    path: "small.txt".into(),
                })
                .await?;
            stats.push(t.elapsed().as_secs_f64() * 1000.0);
        }
        let payload: Vec<u8> = (0..16 * 1024 * 1024u32)
            .map(|i| (i * 7 + 3) as u8)
            .collect();
        let mb = payload.len() as f64 / 1e6;
        let (mut writes, mut reads) = (Vec::new(), Vec::new());
        for _ in 0..a.transfers {
            let t = Instant::now();
            vm.agent.write_file("bench.bin", &payload, None).await?;
            writes.push(mb / t.elapsed().as_secs_f64());
            let t = Instant::now();
            let (_, back) = vm.agent.read_file("bench.bin", 64 << 20).await?;
            reads.push(mb / t.elapsed().as_secs_f64());
            anyhow::ensure!(back == payload, "read back differs from what was written");
        }
        anyhow::Ok((
            pings,
            execs,
            in_guest,
            writes,
            reads,
            [small_writes, small_reads, stats],
        ))
    }
    .await;
    m.destroy(&id).await?;
    let (pings, execs, in_guest, writes, reads, small) = result?;
    let ping_ms = median(pings.clone());
    for (what, times) in ["write 1 KiB", "read 1 KiB", "stat"].iter().zip(small) {
        let ms = median(times.clone());
        row(
            &mut rows,
            format!("{what} round trip, direct ({} runs)", times.len()),
            format!(
                "{ms:.2} ms ({:.1}x an empty request to the agent; p90 {:.2} ms)",
                ms / ping_ms,
                percentile(&times, 0.9)
            ),
        );
    }
    let exec_ms = median(execs.clone());
    row(
        &mut rows,
        format!("`true` exec round trip, direct ({} runs)", execs.len()),
        format!(
            "{:.2} ms (the shell itself, timed by the agent: {:.2} ms; an empty request to the agent: {:.2} ms; p90 {:.2} ms)",
            exec_ms,
            median(in_guest),
            median(pings),
            percentile(&execs, 0.9)
        ),
    );
    row(
        &mut rows,
        format!("write 16 MiB ({} runs)", writes.len()),
        format!("{:.1} MB/s", median(writes)),
    );
    row(
        &mut rows,
        format!("read 16 MiB ({} runs)", reads.len()),
        format!("{:.1} MB/s", median(reads)),
    );

    // Idle cost of one fresh sandbox, as it is started (restored if it can be).
    let id = sandpit_host::ids::new_id("sbx_");
    let vm = m.create(new(id.clone())).await?;
    vm.agent.exec_collect(true_cmd()).await?;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let IdleCost { pss, cpu, ksm, .. } =
        idle_cost(std::slice::from_ref(&vm.record), 1, Duration::from_secs(10)).await;
    m.destroy(&id).await?;
    let how = if vm.record.template.is_some() {
        "restored"
    } else {
        "cold"
    };
    row(
        &mut rows,
        format!("host PSS of one idle sandbox ({how}; QEMU + passt + expiry watchdog; {ksm})"),
        format!("{pss:.1} MiB"),
    );
    row(
        &mut rows,
        format!("host CPU of one idle sandbox ({how}; 10 s)"),
        format!("{cpu:.2} % of one core"),
    );

    let mut targets = Vec::new();
    if snapshots {
        target(
            &mut targets,
            "template restore to first command",
            format!("{:.0} ms", restore_s * 1000.0),
            "≤ 150 ms",
            format!("{:.2}x a cold boot", restore_s / cold_s),
            restore_s <= 0.150,
        );
    }
    if !a.skip_control_plane {
        let report = control_plane::Report {
            rows: &mut rows,
            targets: &mut targets,
        };
        let base = control_plane::Baseline {
            exec_ms,
            cold_s,
            restore_s,
        };
        control_plane(settings, &a, report, base).await?;
    }
    println!();
    println!("| measurement ({}, size {}) | median |", m.accel(), a.size);
    println!("|---|---|");
    for Row(what, value) in rows {
        println!("| {what} | {value} |");
    }
    println!();
    println!(
        "| target ({}, size {}) | measured | target | judged by | |",
        m.accel(),
        a.size
    );
    println!("|---|---|---|---|---|");
    for t in &targets {
        println!(
            "| {} | {} | {} | {} | {} |",
            t.what,
            t.measured,
            t.target,
            t.judged,
            if t.met { "✓" } else { "✗" }
        );
    }
    Ok(0)
}
