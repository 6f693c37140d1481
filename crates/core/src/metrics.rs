//! The service's Prometheus metrics: every family in one place (the list,
//! with what each means, is `docs/metrics.md`).
//!
//! Two kinds, kept two ways. **Events** (creates and their latency by how
//! the VM came, commands and theirs, API errors by type, preview bytes) are
//! counted where they happen, in counters and histograms that live as long
//! as the process: Prometheus counts a process, and one set lets REST and
//! MCP record their errors where each maps them, once, without a handle
//! threaded through [`crate::SandboxApi`]. **States of the world**
//! (sandboxes by state and size, credit reserved, the warm pool, open
//! preview connections, what the VMs take of the host) are read at scrape
//! time, from the store (one grouped query) and this host's runtime, never
//! kept in step by hand, so they cannot drift from what is true.
//!
//! Every sample carries the member's name as `node`, so the scrapes of a
//! cluster's machines add up without colliding.

use crate::error::{CoreError, ErrorType, Result};
use crate::service::Service;
use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Registry, Unit};
use sandpit_store::ExecutionStatus;
use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

/// The `Content-Type` of a scrape's answer (Prometheus text format 0.0.4).
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// How a create's VM came to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum CreatePath {
    /// A ready VM taken from a warm pool.
    pool,
    /// Restored from this host's snapshot template.
    restore,
    /// Booted from the kernel.
    cold,
    /// Started from a user's snapshot.
    snapshot,
    /// Started for it, restored or booted: a start that failed, or one
    /// an older node made without saying which.
    new,
}

/// Whether a create that reached its start ended with a running sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum Outcome {
    ok,
    failed,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct CreateLabels {
    path: CreatePath,
    outcome: Outcome,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct PathLabels {
    path: CreatePath,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct StatusLabels {
    status: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ErrorLabels {
    r#type: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ViaLabels {
    via: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct DirectionLabels {
    direction: &'static str,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

/// The event counters of this process (see the module doc).
struct Events {
    creates: Family<CreateLabels, Counter>,
    create_seconds: HistogramFamily<PathLabels>,
    execs: Family<StatusLabels, Counter>,
    exec_seconds: HistogramFamily<StatusLabels>,
    errors: Family<ErrorLabels, Counter>,
    preview_bytes: Family<DirectionLabels, Counter>,
}

/// A create takes from milliseconds (a warm VM) to a minute (a cold boot
/// on a busy host): 5 ms to 41 s, doubling.
fn create_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.005, 2.0, 14))
}

/// A command takes from milliseconds to its timeout: 5 ms to 164 s, doubling.
fn exec_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.005, 2.0, 16))
}

static EVENTS: LazyLock<Events> = LazyLock::new(|| Events {
    creates: Family::default(),
    create_seconds: Family::new_with_constructor(create_histogram),
    execs: Family::default(),
    exec_seconds: Family::new_with_constructor(exec_histogram),
    errors: Family::default(),
    preview_bytes: Family::default(),
});

/// A create that reached its VM's start: how the VM came, whether the
/// sandbox runs, and how long the call took.
pub fn record_create(path: CreatePath, outcome: Outcome, took: Duration) {
    EVENTS
        .creates
        .get_or_create(&CreateLabels { path, outcome })
        .inc();
    if outcome == Outcome::ok {
        EVENTS
            .create_seconds
            .get_or_create(&PathLabels { path })
            .observe(took.as_secs_f64());
    }
}

/// A command that ended (`status`) after `took`.
pub fn record_exec(status: ExecutionStatus, took: Duration) {
    let labels = StatusLabels {
        status: status.as_str(),
    };
    EVENTS.execs.get_or_create(&labels).inc();
    EVENTS
        .exec_seconds
        .get_or_create(&labels)
        .observe(took.as_secs_f64());
}

/// An error an adapter answered a request with (REST, or an MCP tool call).
pub fn record_error(kind: ErrorType) {
    EVENTS
        .errors
        .get_or_create(&ErrorLabels {
            r#type: kind.as_str(),
        })
        .inc();
}

/// Bytes carried through preview URLs: to the guest (`bytes_in`) and back.
pub(crate) fn record_preview_bytes(bytes_in: u64, bytes_out: u64) {
    for (direction, bytes) in [("in", bytes_in), ("out", bytes_out)] {
        EVENTS
            .preview_bytes
            .get_or_create(&DirectionLabels { direction })
            .inc_by(bytes);
    }
}

/// What this member's part of the world looks like now (read by
/// [`Service::world`] at each scrape).
#[derive(Debug, Default)]
pub(crate) struct World {
    /// The configured sizes, so every state of each has a series, at 0 too.
    pub sizes: Vec<String>,
    pub sandboxes: Vec<sandpit_store::SandboxTally>,
    /// Per pool size: ready VMs and the target.
    pub pool: Vec<(String, usize, usize)>,
    /// This host's VMs (warm pool ones too): id and QEMU pid.
    pub vms: Vec<(String, u32)>,
    pub preview_connections_open: usize,
    pub preview_connections_opened: u64,
    /// This host's VMs a full disk stopped (see `service::disk`).
    pub vms_stopped_on_full_disk: usize,
}

/// A member's `/metrics`: the event families and the states of its world,
/// labelled with its name.
pub struct Exporter {
    service: Arc<Service>,
    node: String,
    /// Held from listing the VMs to adding up their CPU time, so that two
    /// scrapes at once cannot make the counter go back (nor count a VM the
    /// other did not list as ended).
    cpu: tokio::sync::Mutex<CpuTally>,
}

impl Exporter {
    /// The metrics of `service`, every sample labelled `node="{node}"`.
    pub fn new(service: Arc<Service>, node: impl Into<String>) -> Exporter {
        Exporter {
            service,
            node: node.into(),
            cpu: tokio::sync::Mutex::default(),
        }
    }

    /// Every family in the Prometheus text format.
    pub async fn render(&self) -> Result<String> {
        let mut cpu = self.cpu.lock().await;
        let world = self.service.world().await?;
        let usage = tokio::task::spawn_blocking({
            let vms = world.vms.clone();
            move || vms_usage(&vms)
        })
        .await
        .map_err(|e| CoreError::internal(format!("reading the VMs' usage: {e}")))?;
        let cpu_seconds = cpu.total(&usage);
        drop(cpu);
        let mut registry = Registry::with_labels(
            [(Cow::Borrowed("node"), Cow::Owned(self.node.clone()))].into_iter(),
        );
        register_events(&mut registry);
        register_world(&mut registry, &world);
        register_vms(&mut registry, &usage, cpu_seconds);
        let mut text = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut text, &registry)
            .map_err(|e| CoreError::internal(format!("encoding the metrics: {e}")))?;
        Ok(text)
    }
}

fn register_events(registry: &mut Registry) {
    let events = &*EVENTS;
    registry.register(
        "sandpit_sandbox_creates",
        "Creates that reached their VM's start, by how the VM came and whether the sandbox runs",
        events.creates.clone(),
    );
    registry.register_with_unit(
        "sandpit_sandbox_create_duration",
        "Time from a create's request to its running sandbox, by how the VM came",
        Unit::Seconds,
        events.create_seconds.clone(),
    );
    registry.register(
        "sandpit_execs",
        "Commands run to their end, by final status",
        events.execs.clone(),
    );
    registry.register_with_unit(
        "sandpit_exec_duration",
        "Time from a command's start to its end, by final status",
        Unit::Seconds,
        events.exec_seconds.clone(),
    );
    registry.register(
        "sandpit_errors",
        "Requests answered with an error (REST and MCP tool calls), by the API's error type",
        events.errors.clone(),
    );
    registry.register_with_unit(
        "sandpit_preview",
        "Bytes carried through preview URLs, to the guest (in) and back (out)",
        Unit::Bytes,
        events.preview_bytes.clone(),
    );
    // Every series a dashboard sums is there from the start, at 0.
    // Every type's series exists before its first error.
    for kind in ErrorType::ALL {
        let labels = ErrorLabels {
            r#type: kind.as_str(),
        };
        events.errors.get_or_create(&labels).inc_by(0);
    }
    for direction in ["in", "out"] {
        let labels = DirectionLabels { direction };
        events.preview_bytes.get_or_create(&labels).inc_by(0);
    }
    let (built, failed) = sandpit_runtime::save::template::builds();
    let template_builds: Family<StatusLabels, Counter> = Family::default();
    for (status, n) in [("ok", built), ("failed", failed)] {
        template_builds
            .get_or_create(&StatusLabels { status })
            .inc_by(n);
    }
    registry.register(
        "sandpit_template_builds",
        "Snapshot template builds this process made, by outcome",
        template_builds,
    );
    let (connections, lookups) = sandpit_runtime::egress::proxy::refused_total();
    let egress_refused: Family<ViaLabels, Counter> = Family::default();
    for (via, n) in [("connection", connections), ("dns", lookups)] {
        egress_refused.get_or_create(&ViaLabels { via }).inc_by(n);
    }
    registry.register(
        "sandpit_egress_refused",
        "Connections and name lookups of sandboxes that their network policy refused \
         (each logged with its sandbox and rule), by how they were refused",
        egress_refused,
    );
}

/// A gauge of whole numbers; one of fractions.
type IntGauge = Gauge<i64>;
type FloatGauge = Gauge<f64, AtomicU64>;

/// The states of a live sandbox, as the API words them.
const LIVE_STATES: [&str; 4] = ["provisioning", "running", "paused", "deleting"];

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct SandboxLabels {
    state: String,
    size: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct SizeLabels {
    size: String,
}

fn register_world(registry: &mut Registry, world: &World) {
    let sandboxes: Family<SandboxLabels, IntGauge> = Family::default();
    let reserved: FloatGauge = Gauge::default();
    for size in &world.sizes {
        for state in LIVE_STATES {
            let labels = SandboxLabels {
                state: state.to_string(),
                size: size.clone(),
            };
            sandboxes.get_or_create(&labels).set(0);
        }
    }
    for t in &world.sandboxes {
        let labels = SandboxLabels {
            state: t.state.clone(),
            size: t.size.clone(),
        };
        sandboxes.get_or_create(&labels).set(t.count);
        reserved.inc_by(t.reserved_micros as f64 / 1e6);
    }
    registry.register(
        "sandpit_sandboxes",
        "Live sandboxes on this node, by state and size",
        sandboxes,
    );
    registry.register(
        "sandpit_credit_reserved_usd",
        "Credit held reserved by this node's live sandboxes, in US dollars",
        reserved,
    );
    let ready: Family<SizeLabels, IntGauge> = Family::default();
    let target: Family<SizeLabels, IntGauge> = Family::default();
    for (size, now, want) in &world.pool {
        let labels = SizeLabels { size: size.clone() };
        ready.get_or_create(&labels).set(*now as i64);
        target.get_or_create(&labels).set(*want as i64);
    }
    registry.register(
        "sandpit_pool_ready",
        "Warm pool VMs ready to be taken, by size",
        ready,
    );
    registry.register(
        "sandpit_pool_target",
        "Warm pool VMs the pool keeps ready, by size",
        target,
    );
    let open: IntGauge = Gauge::default();
    open.set(world.preview_connections_open as i64);
    registry.register(
        "sandpit_preview_connections_open",
        "Preview connections to guests open now",
        open,
    );
    let stopped: IntGauge = Gauge::default();
    stopped.set(world.vms_stopped_on_full_disk as i64);
    registry.register(
        "sandpit_vms_stopped_disk_full",
        "VMs on this node stopped because the host's disk is full (they go on once it has its reserve free)",
        stopped,
    );
    let opened: Counter = Counter::default();
    opened.inc_by(world.preview_connections_opened);
    registry.register(
        "sandpit_preview_connections",
        "Preview connections to guests opened since the process started",
        opened,
    );
}

fn register_vms(registry: &mut Registry, usage: &VmsUsage, cpu_seconds: f64) {
    let vms: IntGauge = Gauge::default();
    vms.set(usage.vms as i64);
    registry.register(
        "sandpit_vms",
        "QEMU processes on this node (sandboxes' and the warm pool's)",
        vms,
    );
    let cpu: Counter<f64, AtomicU64> = Counter::default();
    cpu.inc_by(cpu_seconds);
    registry.register_with_unit(
        "sandpit_vm_cpu",
        "CPU time (user and system) this node's QEMU processes used, the ended ones' included",
        Unit::Seconds,
        cpu,
    );
    let rss: IntGauge = Gauge::default();
    rss.set(usage.rss_bytes as i64);
    registry.register_with_unit(
        "sandpit_vm_memory_rss",
        "Resident memory of this node's QEMU processes, summed (shared pages counted in each)",
        Unit::Bytes,
        rss,
    );
    let pss: IntGauge = Gauge::default();
    pss.set(usage.pss_bytes as i64);
    registry.register_with_unit(
        "sandpit_vm_memory_pss",
        "Proportional memory of this node's QEMU processes, summed (shared pages divided among their users)",
        Unit::Bytes,
        pss,
    );
}

/// What this host's QEMU processes take now, read from `/proc`.
#[derive(Debug, Default)]
struct VmsUsage {
    /// VMs whose process could be read.
    vms: usize,
    /// CPU seconds of each VM's process so far, by (VM id, pid).
    cpu: HashMap<(String, u32), f64>,
    rss_bytes: u64,
    pss_bytes: u64,
}

/// Reads each VM's `/proc/PID/stat` (CPU time) and `smaps_rollup`
/// (memory); a process that just ended is left out.
fn vms_usage(vms: &[(String, u32)]) -> VmsUsage {
    let ticks = sandpit_runtime::host::clock_ticks_per_second();
    let mut usage = VmsUsage::default();
    for (id, pid) in vms {
        let Some(cpu_ticks) = sandpit_runtime::host::cpu_ticks(*pid) else {
            continue;
        };
        usage.vms += 1;
        usage
            .cpu
            .insert((id.clone(), *pid), cpu_ticks as f64 / ticks);
        if let Some((rss, pss)) = sandpit_runtime::host::process_memory(*pid) {
            usage.rss_bytes += rss;
            usage.pss_bytes += pss;
        }
    }
    usage
}

/// CPU time is a counter, so it must never go back when a VM ends: the
/// last time read of each VM that is gone is kept in `ended`.
#[derive(Debug, Default)]
struct CpuTally {
    last: HashMap<(String, u32), f64>,
    ended: f64,
}

impl CpuTally {
    /// The CPU seconds of every VM seen so far, the ended ones' included.
    fn total(&mut self, usage: &VmsUsage) -> f64 {
        for (vm, seconds) in self.last.drain() {
            if !usage.cpu.contains_key(&vm) {
                self.ended += seconds;
            }
        }
        self.last.clone_from(&usage.cpu);
        self.ended + self.last.values().sum::<f64>()
    }
}

/// Whether `given` is the metrics token `expected`, compared in constant
/// time: both are hashed first, so neither their bytes nor their lengths
/// show in how long the comparison takes.
pub fn token_matches(expected: &str, given: &str) -> bool {
    use sha2::{Digest, Sha256};
    let (a, b) = (Sha256::digest(expected), Sha256::digest(given));
    a.iter()
        .zip(b.iter())
        .fold(0u8, |acc, (x, y)| acc | (x ^ y))
        == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vm_cpu_never_goes_back_when_a_vm_ends() {
        let mut tally = CpuTally::default();
        let usage = |vms: &[(&str, f64)]| VmsUsage {
            cpu: vms
                .iter()
                .map(|(id, s)| ((id.to_string(), 1), *s))
                .collect(),
            ..VmsUsage::default()
        };
        assert_eq!(tally.total(&usage(&[("a", 2.0), ("b", 3.0)])), 5.0);
        assert_eq!(tally.total(&usage(&[("b", 4.0)])), 6.0);
        assert_eq!(tally.total(&usage(&[])), 6.0);
    }

    #[test]
    fn tokens_match_only_themselves() {
        assert!(token_matches("s3cret", "s3cret"));
        assert!(!token_matches("s3cret", "s3cre"));
        assert!(!token_matches("s3cret", ""));
    }
}

#[cfg(test)]
mod exporter_tests {
    use super::*;

    #[tokio::test]
    async fn every_family_is_rendered_with_the_node_label() {
        let dir = tempfile::tempdir().unwrap();
        let store = sandpit_store::Store::open_sqlite(dir.path().join("sandpit.db"))
            .await
            .unwrap();
        let service = Service::without_vms(crate::config::ServiceConfig::default(), store);
        record_create(CreatePath::pool, Outcome::ok, Duration::from_millis(20));
        record_exec(ExecutionStatus::Completed, Duration::from_millis(5));
        record_error(ErrorType::NotFound);
        let text = Exporter::new(service, "node-a").render().await.unwrap();
        for family in [
            "sandpit_sandboxes",
            "sandpit_sandbox_creates_total",
            "sandpit_sandbox_create_duration_seconds",
            "sandpit_execs_total",
            "sandpit_exec_duration_seconds",
            "sandpit_errors_total",
            "sandpit_preview_bytes_total",
            "sandpit_preview_connections_total",
            "sandpit_preview_connections_open",
            "sandpit_template_builds_total",
            "sandpit_egress_refused_total",
            "sandpit_credit_reserved_usd",
            "sandpit_vms",
            "sandpit_vm_cpu_seconds_total",
            "sandpit_vm_memory_rss_bytes",
            "sandpit_vm_memory_pss_bytes",
        ] {
            assert!(
                text.contains(&format!("# TYPE {family} ")),
                "{family}:\n{text}"
            );
        }
        let samples = text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty());
        for line in samples {
            assert!(line.contains("node=\"node-a\""), "{line}");
        }
        let pool_creates =
            "sandpit_sandbox_create_duration_seconds_count{node=\"node-a\",path=\"pool\"}";
        assert!(text.contains(pool_creates), "{text}");
        let running = "sandpit_sandboxes{node=\"node-a\",state=\"running\",size=\"small\"} 0";
        assert!(text.contains(running), "{text}");
        // A replica has no pool.
        assert!(!text.contains("sandpit_pool_ready"), "{text}");
        the_docs_name_what_is_rendered(&text);
    }

    /// `docs/metrics.md` lists every family rendered, and it and the
    /// Grafana dashboard name no other (the pool's exist where VMs run).
    fn the_docs_name_what_is_rendered(text: &str) {
        let docs = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/");
        let rendered: std::collections::BTreeSet<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .filter_map(|l| l.split(' ').next())
            .chain(["sandpit_pool_ready", "sandpit_pool_target"])
            .collect();
        for file in ["metrics.md", "grafana-dashboard.json"] {
            let doc = std::fs::read_to_string(format!("{docs}{file}")).unwrap();
            let named = names_in(&doc);
            for name in &named {
                assert!(
                    rendered.contains(name.as_str()),
                    "{file} names {name}, which is not rendered"
                );
            }
            if file == "metrics.md" {
                for name in &rendered {
                    assert!(named.contains(*name), "{name} is not in docs/metrics.md");
                }
            }
        }
    }

    /// The metric names in a text, a histogram's series by its family's.
    fn names_in(doc: &str) -> std::collections::BTreeSet<String> {
        let mut names = std::collections::BTreeSet::new();
        for (at, _) in doc.match_indices("sandpit_") {
            let name: String = doc[at..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            let name = name.strip_suffix("_bucket").unwrap_or(&name).to_string();
            names.insert(name);
        }
        names
    }
}
