//! Service configuration: sizes and prices, limits, and where the service is
//! reachable. Loaded from the server's TOML (see `sandpit serve --config`).

use crate::model::{micros, Limits, Micros, Resources, SizeInfo, MAX_COMMAND_BYTES, MAX_ENV_BYTES};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// One size: resources and price.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SizeConfig {
    pub vcpus: u32,
    pub memory_mb: u32,
    pub disk_gb: u32,
    pub price_usd_per_hour: f64,
}

impl SizeConfig {
    pub fn resources(&self) -> Resources {
        Resources {
            vcpus: self.vcpus,
            memory_mb: self.memory_mb,
            disk_gb: self.disk_gb,
        }
    }
    pub fn price_micros_per_hour(&self) -> Micros {
        micros(self.price_usd_per_hour)
    }
}

/// Limits and defaults of the service.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct ServiceConfig {
    pub sizes: BTreeMap<String, SizeConfig>,
    pub default_size: String,
    pub default_timeout_minutes: u32,
    pub max_timeout_minutes: u32,
    /// A sandbox may not live longer than this from creation, extensions included.
    pub max_lifetime_minutes: u32,
    pub default_extend_minutes: u32,
    /// New accounts' concurrency limit.
    pub default_max_concurrent_sandboxes: u32,
    pub exec_default_timeout_ms: u64,
    pub exec_min_timeout_ms: u64,
    pub exec_max_timeout_ms: u64,
    /// Output kept per stream of a command.
    pub max_output_bytes: u64,
    /// Largest file read back.
    pub max_read_bytes: u64,
    /// Largest file written.
    pub max_write_bytes: u64,
    /// Entries in one listing.
    pub max_list_entries: u64,
    /// Scheme of preview URLs (`http` or `https`).
    pub preview_scheme: String,
    /// Domain of preview URLs: `{port}-{id}.{preview_domain}`.
    pub preview_domain: String,
    /// This host's name, shown in service info.
    pub host_name: String,
    /// Connections to the guest one sandbox's preview URLs may hold open.
    pub preview_max_connections: u32,
    /// Requests a second one sandbox's preview URLs take (twice as many in
    /// a burst); past it, 429.
    pub preview_requests_per_second: u32,
    /// File reads and writes one account runs at once; more wait (see
    /// `TRANSFER_WAIT`), then get `rate_limited`.
    pub max_concurrent_transfers: u32,
    /// What one account's stored executions (commands and outputs) may
    /// take; past it, its oldest ended ones are deleted.
    pub execution_storage_bytes: u64,
    /// Days the executions of an ended sandbox are kept.
    pub execution_retention_days: u32,
    /// What one account's live sandboxes' disks may take together on the
    /// host (see the disk sweep, `service::disk`).
    pub account_disk_bytes: u64,
    /// Days a snapshot is kept unless deleted before.
    pub snapshot_retention_days: u32,
    /// Snapshots one account may hold at once; past it, 429.
    pub max_snapshots_per_account: u32,
    /// What one account's snapshots may take on disk together; at it, no
    /// new one (429).
    pub snapshot_bytes_per_account: u64,
    /// Templates (`name:tag`s with a build not failed or deleted) one
    /// account may hold; past it, a build of a new one is refused (429).
    pub max_templates_per_account: u32,
    /// What one account's template layers and uploaded files may take
    /// together; at it, no new build (429).
    pub template_bytes_per_account: u64,
    /// What a paused sandbox costs, in percent of its running price.
    pub paused_price_percent: u32,
    /// A sandbox that nobody used for this long (no call, no preview
    /// request, no terminal) and whose guest did nothing either (CPU,
    /// network) is paused, to be resumed by the next call that needs it;
    /// 0: never (see `crate::idle`). Only where this process runs the VMs
    /// itself (not on a cluster's replicas).
    pub idle_pause_secs: u64,
    /// `[volumes]`: quotas, sizes and price of accounts' volumes.
    pub volumes: VolumesConfig,
    /// `[webhooks]`: where deliveries may go, and how long an attempt and
    /// the events log last.
    pub webhooks: WebhooksConfig,
    /// The commit the running binary was built from, which service info
    /// shows (`unknown` unless the binary says; not a setting).
    #[serde(skip)]
    pub commit: String,
    /// What secrets are sealed with at rest (`[secrets] key_file`; not a
    /// setting of its own here: the server reads the file). A default
    /// configuration has a random key of its own.
    #[serde(skip)]
    pub secrets_key: crate::secrets_key::SecretsKey,
}

impl ServiceConfig {
    /// The size table as clients are shown it: cheapest first (by price,
    /// then vCPUs, memory and disk, then name), not the map's alphabetical
    /// order, which would put `large` before `medium` and `small`.
    pub fn sizes_cheapest_first(&self) -> Vec<SizeInfo> {
        let mut sizes: Vec<SizeInfo> = self
            .sizes
            .iter()
            .map(|(name, s)| SizeInfo {
                name: name.clone(),
                resources: s.resources(),
                price_usd_per_hour: s.price_usd_per_hour,
            })
            .collect();
        sizes.sort_by(|a, b| {
            let key = |s: &SizeInfo| {
                (
                    s.resources.vcpus,
                    s.resources.memory_mb,
                    s.resources.disk_gb,
                )
            };
            a.price_usd_per_hour
                .total_cmp(&b.price_usd_per_hour)
                .then_with(|| key(a).cmp(&key(b)))
                .then_with(|| a.name.cmp(&b.name))
        });
        sizes
    }
}

impl Default for ServiceConfig {
    fn default() -> Self {
        let size = |vcpus, memory_mb, price| SizeConfig {
            vcpus,
            memory_mb,
            disk_gb: 40,
            price_usd_per_hour: price,
        };
        let mut sizes = BTreeMap::new();
        sizes.insert("small".into(), size(2, 4096, 0.09));
        sizes.insert("medium".into(), size(4, 8192, 0.28));
        sizes.insert("large".into(), size(8, 16384, 0.55));
        ServiceConfig {
            sizes,
            default_size: "small".into(),
            default_timeout_minutes: 15,
            max_timeout_minutes: 1440,
            max_lifetime_minutes: 1440,
            default_extend_minutes: 15,
            default_max_concurrent_sandboxes: 20,
            exec_default_timeout_ms: 60_000,
            exec_min_timeout_ms: 1_000,
            exec_max_timeout_ms: 600_000,
            max_output_bytes: 1024 * 1024,
            max_read_bytes: 32 * 1024 * 1024,
            max_write_bytes: 32 * 1024 * 1024,
            max_list_entries: 10_000,
            preview_scheme: "http".into(),
            preview_domain: "localhost:8080".into(),
            host_name: "localhost".into(),
            preview_max_connections: 64,
            preview_requests_per_second: 100,
            max_concurrent_transfers: 4,
            execution_storage_bytes: 1024 * 1024 * 1024,
            execution_retention_days: 7,
            account_disk_bytes: 100 * 1024 * 1024 * 1024,
            snapshot_retention_days: 7,
            max_snapshots_per_account: 20,
            snapshot_bytes_per_account: 50 * 1024 * 1024 * 1024,
            max_templates_per_account: 20,
            template_bytes_per_account: 50 * 1024 * 1024 * 1024,
            paused_price_percent: 10,
            idle_pause_secs: 0,
            volumes: VolumesConfig::default(),
            webhooks: WebhooksConfig::default(),
            commit: "unknown".into(),
            secrets_key: Default::default(),
        }
    }
}

/// `[webhooks]`: where deliveries may go, and how long things last.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WebhooksConfig {
    /// Address ranges (IPv4 or IPv6 CIDR) no delivery may reach: by
    /// default the guests' deny list (`[network] deny`, with its defaults:
    /// private, loopback, link-local, carrier-grade NAT…) and their IPv6
    /// kin (loopback, link-local, unique local, IPv4-mapped, multicast).
    /// Filled by the server from `[network]`; not a setting of its own.
    #[serde(skip)]
    pub deny: Vec<String>,
    /// Ranges the operator allows despite `deny` (e.g. a receiver on the
    /// operator's own private network).
    pub allow: Vec<String>,
    /// One attempt's bound: connecting, sending, and the answer's status.
    pub timeout_secs: u64,
    /// Webhooks one account may have.
    pub max_per_account: u32,
    /// How long the events log keeps an event (and its deliveries), in days.
    pub event_retention_days: u32,
}

impl Default for WebhooksConfig {
    fn default() -> Self {
        WebhooksConfig {
            deny: webhook_default_deny(),
            allow: Vec::new(),
            timeout_secs: 10,
            max_per_account: 20,
            event_retention_days: 30,
        }
    }
}

/// What no webhook delivery reaches unless the operator allows it: the
/// guests' default deny list (`sandpit_runtime`'s) and the IPv6 ranges of
/// the same kinds.
pub fn webhook_default_deny() -> Vec<String> {
    sandpit_runtime::config::DEFAULT_DENY
        .iter()
        .chain(WEBHOOK_IPV6_DENY)
        .map(|s| s.to_string())
        .collect()
}

/// IPv6's unspecified, loopback, IPv4-mapped, NAT64, unique local,
/// link-local and multicast ranges.
const WEBHOOK_IPV6_DENY: &[&str] = &[
    "::/128",
    "::1/128",
    "::ffff:0:0/96",
    "64:ff9b::/96",
    "fc00::/7",
    "fe80::/10",
    "ff00::/8",
];

/// `[volumes]`: what an account may keep in volumes, and what it costs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct VolumesConfig {
    /// Volumes (not deleted) one account may have; one more is refused.
    pub max_per_account: u32,
    /// What one account's volumes may be together, in bytes (their sizes,
    /// not what they hold); past it, a create or a resize is refused.
    pub max_bytes_per_account: u64,
    /// A new volume's size unless its create says, in GiB.
    pub default_size_gb: u32,
    /// The largest volume, in GiB.
    pub max_size_gb: u32,
    /// What a GiB stored for a month (30 days) costs, in USD: a volume's
    /// size is billed per second from its create to its delete, whatever
    /// it holds and whether a sandbox mounts it.
    pub price_usd_per_gb_month: f64,
}

impl Default for VolumesConfig {
    fn default() -> Self {
        VolumesConfig {
            max_per_account: 20,
            max_bytes_per_account: 100 * 1024 * 1024 * 1024,
            default_size_gb: 10,
            max_size_gb: 100,
            // A block store's going rate.
            price_usd_per_gb_month: 0.10,
        }
    }
}

/// The seconds in the month of [`VolumesConfig::price_usd_per_gb_month`].
pub const SECONDS_PER_MONTH: u64 = 30 * 24 * 3600;

/// What `bytes` stored for `seconds` costs at `price_usd_per_gb_month`,
/// rounded up to the next micro-dollar.
pub fn storage_cost(price_usd_per_gb_month: f64, bytes: u64, seconds: u64) -> Micros {
    const GIB: i128 = 1024 * 1024 * 1024;
    let per_gib_month = micros(price_usd_per_gb_month) as i128;
    let num = per_gib_month * bytes as i128 * seconds as i128;
    let den = GIB * SECONDS_PER_MONTH as i128;
    ((num + den - 1) / den) as Micros
}

/// What `seconds` of a size costs, rounded up to the next micro-dollar.
pub fn cost(price_micros_per_hour: Micros, seconds: u64) -> Micros {
    let num = price_micros_per_hour as i128 * seconds as i128;
    ((num + 3599) / 3600) as Micros
}

/// The disk write rate of an account's sandboxes while it is at its limit.
pub const OVER_LIMIT_WRITE_BPS: u64 = 256 * 1024;

impl Default for Limits {
    fn default() -> Self {
        Limits::of(&ServiceConfig::default(), 30)
    }
}

impl Limits {
    /// The limits of a service configured with `c`, whose sandboxes owe each
    /// answer within `reply_deadline_secs`.
    pub fn of(c: &ServiceConfig, reply_deadline_secs: u64) -> Limits {
        Limits {
            default_timeout_minutes: c.default_timeout_minutes,
            max_timeout_minutes: c.max_timeout_minutes,
            max_lifetime_minutes: c.max_lifetime_minutes,
            exec_default_timeout_ms: c.exec_default_timeout_ms,
            exec_min_timeout_ms: c.exec_min_timeout_ms,
            exec_max_timeout_ms: c.exec_max_timeout_ms,
            max_command_bytes: MAX_COMMAND_BYTES,
            max_env_bytes: MAX_ENV_BYTES,
            max_output_bytes: c.max_output_bytes,
            max_read_bytes: c.max_read_bytes,
            max_write_bytes: c.max_write_bytes,
            max_list_entries: c.max_list_entries,
            reply_deadline_secs,
            preview_max_connections: c.preview_max_connections,
            preview_requests_per_second: c.preview_requests_per_second,
            max_concurrent_transfers: c.max_concurrent_transfers,
            execution_storage_bytes: c.execution_storage_bytes,
            execution_retention_days: c.execution_retention_days,
            account_disk_bytes: c.account_disk_bytes,
            over_disk_limit_write_bytes_per_second: OVER_LIMIT_WRITE_BPS,
            idle_pause_seconds: c.idle_pause_secs,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn costs_are_per_second_and_round_up() {
        // small: $0.09/h = 90_000 µ$/h = 25 µ$/s
        assert_eq!(cost(90_000, 1), 25);
        assert_eq!(cost(90_000, 3600), 90_000);
        assert_eq!(cost(90_000, 15 * 60), 22_500);
        // medium: $0.28/h is not a whole number of µ$ per second: round up
        assert_eq!(cost(280_000, 1), 78);
        assert_eq!(cost(280_000, 3600), 280_000);
        assert_eq!(cost(280_000, 0), 0);
    }

    #[test]
    fn storage_is_billed_per_byte_second_and_rounds_up() {
        const GIB: u64 = 1024 * 1024 * 1024;
        // 10 GiB for a month at $0.10: $1.
        assert_eq!(storage_cost(0.10, 10 * GIB, SECONDS_PER_MONTH), 1_000_000);
        // A second of it: a fraction of a micro-dollar, rounded up.
        assert_eq!(storage_cost(0.10, 10 * GIB, 1), 1);
        assert_eq!(storage_cost(0.10, 10 * GIB, 0), 0);
        // An hour of 1 GiB: 100_000 / 720 = 138.9 µ$.
        assert_eq!(storage_cost(0.10, GIB, 3600), 139);
        assert_eq!(storage_cost(0.0, GIB, 3600), 0);
    }

    #[test]
    fn sizes_are_shown_cheapest_first() {
        let names = |c: &ServiceConfig| -> Vec<String> {
            c.sizes_cheapest_first()
                .into_iter()
                .map(|s| s.name)
                .collect()
        };
        let mut c = ServiceConfig::default();
        assert_eq!(names(&c), ["small", "medium", "large"]);
        // An operator's table: a free tiny size, and two at one price told
        // apart by what they give.
        c.sizes.insert(
            "a-free".into(),
            SizeConfig {
                vcpus: 1,
                memory_mb: 512,
                disk_gb: 10,
                price_usd_per_hour: 0.0,
            },
        );
        c.sizes.insert(
            "b-wide".into(),
            SizeConfig {
                vcpus: 4,
                memory_mb: 8192,
                disk_gb: 40,
                price_usd_per_hour: 0.09,
            },
        );
        assert_eq!(names(&c), ["a-free", "small", "b-wide", "medium", "large"]);
    }
}
