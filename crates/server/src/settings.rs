//! Where Sandpit keeps its state and how the runtime is configured: data
//! directory, images directory, and the optional TOML config file.
//!
//! Precedence: command-line flag, then environment variable, then config
//! file, then the built-in default.

use anyhow::{bail, Context, Result};
use sandpit_core::config::{ServiceConfig, SizeConfig};
use sandpit_runtime::config::{AccelChoice, SizeSpec};
use sandpit_runtime::RuntimeConfig;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The default data directory: `/var/lib/sandpit` for root, else
/// `$XDG_DATA_HOME/sandpit` or `~/.local/share/sandpit`.
pub fn default_data_dir() -> PathBuf {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        return PathBuf::from("/var/lib/sandpit");
    }
    if let Some(x) = std::env::var_os("XDG_DATA_HOME") {
        return PathBuf::from(x).join("sandpit");
    }
    let home = std::env::var_os("HOME").unwrap_or_else(|| "/tmp".into());
    PathBuf::from(home).join(".local/share/sandpit")
}

/// The config file (all fields optional).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    /// `sandpit serve` listens here (default 127.0.0.1:8080).
    pub listen: Option<String>,
    /// The URL clients reach the server at (shown in the MCP configuration).
    pub public_url: Option<String>,
    pub sizes: Option<BTreeMap<String, SizeEntry>>,
    pub limits: Option<LimitsSection>,
    pub mcp: Option<McpSection>,
    pub preview: Option<PreviewSection>,
    pub accel: Option<AccelChoice>,
    pub boot_timeout_secs: Option<u64>,
    pub network: Option<NetworkSection>,
    pub user_pids_max: Option<u32>,
    pub reserved_memory_mb: Option<u32>,
    pub tcg_tb_size_mb: Option<u32>,
    /// Start VMs from snapshot templates (default true).
    pub snapshots: Option<bool>,
    /// Merge the network helpers' identical pages with KSM (default true).
    pub ksm: Option<bool>,
    /// The warm pool: `[pool] sizes = { small = 2 }`, start limits.
    pub pool: Option<sandpit_host::local::PoolConfig>,
    /// The host's admission budget: memory reserve, CPU budget.
    pub capacity: Option<sandpit_host::capacity::CapacityConfig>,
    /// `sandpit serve`'s client connections: how many, how long.
    pub server: Option<crate::listener::ConnectionLimits>,
    /// On a shared database: the node lease and when a silent node is lost.
    pub cluster: Option<sandpit_core::cluster::ClusterConfig>,
    /// Prometheus metrics: their own listener, or a token on the public one.
    pub metrics: Option<crate::metrics::MetricsSection>,
    /// Sign-up on the dashboard: off, open or by invitation, and the free
    /// credit of a new account.
    pub signup: Option<sandpit_web::SignupConfig>,
    /// Secrets at rest: the file of the key they are sealed with.
    pub secrets: Option<SecretsSection>,
    /// Volumes: quotas per account, sizes and price.
    pub volumes: Option<sandpit_core::config::VolumesConfig>,
    /// `[webhooks]`: ranges deliveries may reach despite the deny list,
    /// an attempt's timeout, the events log's retention.
    pub webhooks: Option<sandpit_core::config::WebhooksConfig>,
}

/// A size: resources and (for the server) its price.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SizeEntry {
    pub vcpus: u32,
    pub memory_mb: u32,
    pub disk_gb: u32,
    pub price_usd_per_hour: Option<f64>,
}

/// Limits of the service.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitsSection {
    pub default_timeout_minutes: Option<u32>,
    pub max_timeout_minutes: Option<u32>,
    pub max_lifetime_minutes: Option<u32>,
    pub max_concurrent_sandboxes: Option<u32>,
    pub max_output_bytes: Option<u64>,
    pub max_read_bytes: Option<u64>,
    pub max_write_bytes: Option<u64>,
    pub max_body_bytes: Option<usize>,
    /// Request bodies the server holds at once, in MiB (default 512); a
    /// request that cannot fit waits, then gets 503.
    pub body_budget_mb: Option<usize>,
    /// Free space kept on the VMs' filesystem, in MiB; no new sandbox
    /// starts below it (default 2048).
    pub disk_reserve_mb: Option<u64>,
    /// Concurrent file reads and writes of one account (default 4); more
    /// wait, then get 429.
    pub max_concurrent_transfers: Option<u32>,
    /// What one account's stored executions may take, in MiB (default
    /// 1024); past it, its oldest ended ones are deleted.
    pub execution_storage_mb: Option<u64>,
    /// Days the executions of an ended sandbox are kept (default 7).
    pub execution_retention_days: Option<u32>,
    /// What one account's live sandboxes' disks may take together on the
    /// host, in MiB (default 102400); at it, no new sandbox starts and its
    /// sandboxes' disk writes slow down until it is back under.
    pub account_disk_mb: Option<u64>,
    /// Days a snapshot is kept unless deleted before (default 7).
    pub snapshot_retention_days: Option<u32>,
    /// Snapshots one account may hold (default 20); past it, 429.
    pub max_snapshots: Option<u32>,
    /// What one account's snapshots may take on disk together, in MiB
    /// (default 51200); at it, no new snapshot (429).
    pub snapshot_storage_mb: Option<u64>,
    /// Templates one account may hold (default 20); a build of one more
    /// is refused (429).
    pub max_templates: Option<u32>,
    /// What one account's template layers and uploaded files may take
    /// together, in MiB (default 51200); at it, no new build (429).
    pub template_storage_mb: Option<u64>,
    /// What a paused sandbox costs, in percent of its running price
    /// (default 10).
    pub paused_price_percent: Option<u32>,
    /// A sandbox unused this long (no call, preview request or terminal)
    /// whose guest is idle too is paused, and resumed by the next call
    /// that needs it (default 0: never).
    pub idle_pause_seconds: Option<u64>,
}

/// MCP over HTTP: DNS-rebinding protection.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct McpSection {
    pub allowed_hosts: Option<Vec<String>>,
    pub allowed_origins: Option<Vec<String>>,
}

/// Preview URLs.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PreviewSection {
    /// Preview URLs are `{scheme}://{port}-{id}.{domain}`; the domain may
    /// carry a port. Default: `localhost:{the port serve listens on}`.
    pub domain: Option<String>,
    /// Default: `https` with a TLS certificate, else `http`.
    pub scheme: Option<String>,
    /// PEM certificate chain for TLS on serve's listener (a wildcard for
    /// `*.{domain}`, plus the API's name if it shares the listener).
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of `tls_cert`.
    pub tls_key: Option<PathBuf>,
    /// Connections to the guest one sandbox's previews hold open at most
    /// (default 64); more requests wait for one, then get 503.
    pub max_connections: Option<u32>,
    /// Requests a second one sandbox's previews take (default 100, twice
    /// as many in a burst); past it, 429.
    pub requests_per_second: Option<u32>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetworkSection {
    pub enabled: Option<bool>,
    /// Added to the default deny list (an operator listing two ranges must
    /// not reopen the rest).
    pub deny: Option<Vec<String>>,
    /// `false` drops the default deny list, leaving only `deny` (and the
    /// host's own addresses, which are always denied).
    pub default_deny: Option<bool>,
    pub dns: Option<Vec<String>>,
    /// `http://HOST:PORT`: the HTTP proxy guests use (see `RuntimeConfig`).
    pub proxy: Option<String>,
    pub no_proxy: Option<Vec<String>>,
    /// PEM files of CA certificates every guest trusts.
    pub ca_certificates: Option<Vec<PathBuf>>,
    /// PEM files of CA certificates the host trusts, besides its own trust
    /// store, when it sends a brokered secret on to its server.
    pub upstream_ca_certificates: Option<Vec<PathBuf>>,
}

/// `[secrets]`: what accounts' secrets are sealed with at rest.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SecretsSection {
    /// A file holding the key (64 hex characters), its owner's alone
    /// (mode 0600). Default: `<data_dir>/secrets.key`, made at the first
    /// start. Every member of a cluster on one database must have the
    /// same key: a secret sealed by one opens on the others only so.
    pub key_file: Option<PathBuf>,
}

/// Resolved settings of one invocation.
#[derive(Debug, Clone)]
pub struct Settings {
    pub data_dir: PathBuf,
    pub images_dir: PathBuf,
    pub config_file: Option<PathBuf>,
    pub runtime: RuntimeConfig,
    pub service: ServiceConfig,
    pub listen: String,
    pub public_url: Option<String>,
    pub mcp_allowed_hosts: Option<Vec<String>>,
    pub mcp_allowed_origins: Option<Vec<String>>,
    pub max_body_bytes: Option<usize>,
    pub body_budget_bytes: Option<usize>,
    /// The preview domain was configured (else serve derives it from its port).
    pub preview_domain_set: bool,
    /// The preview scheme was configured (else serve derives it from TLS).
    pub preview_scheme_set: bool,
    /// TLS certificate and key (PEM) for serve's listener.
    pub tls: Option<(PathBuf, PathBuf)>,
    /// The warm pool of `serve` and `mcp`.
    pub pool: sandpit_host::local::PoolConfig,
    /// `[capacity]`: when this host refuses new VMs.
    pub capacity: sandpit_host::capacity::CapacityConfig,
    /// What bounds `serve`'s client connections.
    pub connections: crate::listener::ConnectionLimits,
    /// The shared database (`--database`, `SANDPIT_DATABASE_URL`), if not
    /// the data directory's SQLite file.
    pub database_url: Option<String>,
    /// `[cluster]`: used on a shared database.
    pub cluster: sandpit_core::cluster::ClusterConfig,
    /// Where the other members reach this node's API, when it serves one.
    pub node_address: Option<String>,
    /// A control-plane replica: no VMs here (`serve --no-vms`).
    pub no_vms: bool,
    /// `[metrics]` (the flags of `serve` and `node` go over it).
    pub metrics: crate::metrics::MetricsSection,
    /// `[signup]`.
    pub signup: sandpit_web::SignupConfig,
    /// `[secrets] key_file`, when set (else the data directory's
    /// `secrets.key`; see [`Settings::secrets_key`]).
    pub secrets_key_file: Option<PathBuf>,
}

impl Settings {
    /// The SQLite file of the control plane.
    pub fn database(&self) -> PathBuf {
        self.data_dir.join("sandpit.db")
    }

    /// The key secrets are sealed with: `[secrets] key_file`'s, or the
    /// data directory's `secrets.key`, made (random, 0600) at the first
    /// start. A key that is not 64 hex characters, or that others can
    /// read, is refused, saying what to do.
    pub fn secrets_key(&self) -> Result<sandpit_core::secrets_key::SecretsKey> {
        use sandpit_core::secrets_key::SecretsKey;
        let key = match &self.secrets_key_file {
            Some(path) => SecretsKey::load(path),
            None => SecretsKey::load_or_create(&self.data_dir.join("secrets.key")),
        };
        key.map_err(anyhow::Error::msg)
    }
}

impl Settings {
    /// A VM manager over this machine's guest image, which is built first
    /// if it is missing.
    pub fn vm_manager(&self) -> Result<sandpit_runtime::VmManager> {
        let image = crate::images::current(&self.images_dir, None)?;
        Ok(sandpit_runtime::VmManager::new(
            self.runtime.clone(),
            image,
        )?)
    }
}

fn env_or(name: &str, v: Option<String>) -> Option<String> {
    std::env::var(name).ok().filter(|s| !s.is_empty()).or(v)
}

impl Settings {
    pub fn load(
        data_dir: Option<PathBuf>,
        images_dir: Option<PathBuf>,
        config: Option<&Path>,
    ) -> Result<Settings> {
        // Absolute: QEMU and qemu-img are given paths inside it (a disk's
        // backing template among them), which they read relative to other
        // files, not to this process's working directory.
        let data_dir = std::path::absolute(data_dir.unwrap_or_else(default_data_dir))
            .context("the data directory's path")?;
        let images_dir = std::path::absolute(images_dir.unwrap_or_else(|| data_dir.join("images")))
            .context("the images directory's path")?;
        let file: FileConfig = match config {
            Some(p) => {
                let text = std::fs::read_to_string(p)
                    .with_context(|| format!("reading config {}", p.display()))?;
                toml::from_str(&text).with_context(|| format!("parsing config {}", p.display()))?
            }
            None => FileConfig::default(),
        };
        let mut rt = RuntimeConfig::new(&data_dir);
        let mut service = ServiceConfig::default();
        if let Some(sizes) = &file.sizes {
            let defaults = ServiceConfig::default().sizes;
            rt.sizes = sizes
                .iter()
                .map(|(n, s)| {
                    (
                        n.clone(),
                        SizeSpec {
                            vcpus: s.vcpus,
                            memory_mb: s.memory_mb,
                            disk_gb: s.disk_gb,
                        },
                    )
                })
                .collect();
            service.sizes = sizes
                .iter()
                .map(|(n, s)| {
                    let price = s
                        .price_usd_per_hour
                        .or_else(|| defaults.get(n).map(|d| d.price_usd_per_hour))
                        .unwrap_or(0.09);
                    (
                        n.clone(),
                        SizeConfig {
                            vcpus: s.vcpus,
                            memory_mb: s.memory_mb,
                            disk_gb: s.disk_gb,
                            price_usd_per_hour: price,
                        },
                    )
                })
                .collect();
            if !service.sizes.contains_key(&service.default_size) {
                if let Some(first) = service.sizes.keys().next() {
                    service.default_size = first.clone();
                }
            }
        }
        if let Some(l) = &file.limits {
            let set = |dst: &mut u32, v: Option<u32>| {
                if let Some(v) = v {
                    *dst = v
                }
            };
            set(
                &mut service.default_timeout_minutes,
                l.default_timeout_minutes,
            );
            set(&mut service.max_timeout_minutes, l.max_timeout_minutes);
            set(&mut service.max_lifetime_minutes, l.max_lifetime_minutes);
            set(
                &mut service.default_max_concurrent_sandboxes,
                l.max_concurrent_sandboxes,
            );
            if let Some(v) = l.max_output_bytes {
                service.max_output_bytes = v;
            }
            if let Some(v) = l.max_read_bytes {
                service.max_read_bytes = v;
            }
            if let Some(v) = l.max_write_bytes {
                service.max_write_bytes = v;
            }
            match l.max_concurrent_transfers {
                Some(0) => bail!("[limits] max_concurrent_transfers must be at least 1"),
                Some(n) => service.max_concurrent_transfers = n,
                None => {}
            }
            if let Some(mb) = l.execution_storage_mb {
                service.execution_storage_bytes = mb.saturating_mul(1024 * 1024);
            }
            if let Some(days) = l.execution_retention_days {
                service.execution_retention_days = days;
            }
            if let Some(mb) = l.account_disk_mb {
                service.account_disk_bytes = mb.saturating_mul(1024 * 1024);
            }
            if let Some(days) = l.snapshot_retention_days {
                service.snapshot_retention_days = days;
            }
            if let Some(n) = l.max_snapshots {
                service.max_snapshots_per_account = n;
            }
            if let Some(mb) = l.snapshot_storage_mb {
                service.snapshot_bytes_per_account = mb.saturating_mul(1024 * 1024);
            }
            if let Some(n) = l.max_templates {
                service.max_templates_per_account = n;
            }
            if let Some(mb) = l.template_storage_mb {
                service.template_bytes_per_account = mb.saturating_mul(1024 * 1024);
            }
            if let Some(p) = l.paused_price_percent {
                service.paused_price_percent = p.min(100);
            }
            if let Some(secs) = l.idle_pause_seconds {
                service.idle_pause_secs = secs;
            }
        }
        if let Some(v) = &file.volumes {
            if v.default_size_gb == 0 || v.default_size_gb > v.max_size_gb {
                bail!(
                    "[volumes] default_size_gb ({}) must be between 1 and max_size_gb ({})",
                    v.default_size_gb,
                    v.max_size_gb
                );
            }
            service.volumes = v.clone();
        }
        let listen = env_or("SANDPIT_LISTEN", file.listen.clone())
            .unwrap_or_else(|| "127.0.0.1:8080".into());
        let public_url = env_or("SANDPIT_PUBLIC_URL", file.public_url.clone());
        let (mut preview_domain_set, mut preview_scheme_set, mut tls) = (false, false, None);
        if let Some(p) = &file.preview {
            for (name, value, dst) in [
                (
                    "max_connections",
                    p.max_connections,
                    &mut service.preview_max_connections,
                ),
                (
                    "requests_per_second",
                    p.requests_per_second,
                    &mut service.preview_requests_per_second,
                ),
            ] {
                match value {
                    Some(0) => bail!("[preview] {name} must be at least 1"),
                    Some(v) => *dst = v,
                    None => {}
                }
            }
            if let Some(d) = &p.domain {
                if let Err(e) = sandpit_core::preview::check_domain(d) {
                    bail!("[preview] domain {d:?}: {e}");
                }
                service.preview_domain = d.clone();
                preview_domain_set = true;
            }
            if let Some(s) = &p.scheme {
                if s != "http" && s != "https" {
                    bail!("[preview] scheme must be \"http\" or \"https\", not {s:?}");
                }
                service.preview_scheme = s.clone();
                preview_scheme_set = true;
            }
            match (&p.tls_cert, &p.tls_key) {
                (Some(c), Some(k)) => tls = Some((c.clone(), k.clone())),
                (None, None) => {}
                _ => bail!("[preview] needs both tls_cert and tls_key, or neither"),
            }
        }
        if let Some(a) = file.accel {
            rt.accel = a;
        }
        if let Some(s) = file.boot_timeout_secs {
            rt.boot_timeout = Duration::from_secs(s);
        }
        let default_deny = file
            .network
            .as_ref()
            .is_none_or(|n| n.default_deny != Some(false));
        if let Some(n) = file.network {
            if let Some(e) = n.enabled {
                rt.network.enabled = e;
            }
            if n.default_deny == Some(false) {
                rt.network.deny.clear();
            }
            for d in n.deny.unwrap_or_default() {
                if !rt.network.deny.contains(&d) {
                    rt.network.deny.push(d);
                }
            }
            if n.dns.is_some() {
                rt.network.dns = n.dns;
            }
            rt.network.proxy = n.proxy;
            rt.network.no_proxy = n.no_proxy.unwrap_or_default();
            rt.network.ca_certificates = n.ca_certificates.unwrap_or_default();
            rt.network.upstream_ca_certificates = n.upstream_ca_certificates.unwrap_or_default();
        }
        // Deliveries leave from the control plane: what the guests may not
        // reach, they may not either (and IPv6's kin of it), unless the
        // operator allows a range in `[webhooks] allow`.
        if let Some(w) = &file.webhooks {
            service.webhooks = w.clone();
        }
        let mut deny: Vec<String> = match default_deny {
            true => sandpit_core::config::webhook_default_deny(),
            false => Vec::new(),
        };
        for d in &rt.network.deny {
            if !deny.contains(d) {
                deny.push(d.clone());
            }
        }
        service.webhooks.deny = deny;
        sandpit_core::service::check_webhooks_config(&service.webhooks)
            .map_err(anyhow::Error::msg)?;
        if let Some(v) = file.user_pids_max {
            rt.user_pids_max = v;
        }
        if let Some(v) = file.reserved_memory_mb {
            rt.reserved_memory_mb = v;
        }
        if let Some(v) = file.limits.as_ref().and_then(|l| l.disk_reserve_mb) {
            rt.disk_reserve_mb = v;
        }
        if let Some(v) = file.tcg_tb_size_mb {
            rt.tcg_tb_size_mb = v;
        }
        if let Some(v) = file.snapshots {
            rt.snapshots = v;
        }
        if let Some(v) = file.ksm {
            rt.ksm = v;
        }
        if let Some(a) = env_or("SANDPIT_ACCEL", None) {
            rt.accel = match a.as_str() {
                "kvm" => AccelChoice::Kvm,
                "tcg" => AccelChoice::Tcg,
                "auto" => AccelChoice::Auto,
                other => anyhow::bail!("SANDPIT_ACCEL must be auto, kvm or tcg, not {other:?}"),
            };
        }
        let mut pool = file.pool.unwrap_or_default();
        if let Some(v) = env_or("SANDPIT_POOL", None) {
            pool.sizes = parse_pool_sizes(&v)?;
        }
        if let Some(unknown) = pool.sizes.keys().find(|s| !rt.sizes.contains_key(*s)) {
            anyhow::bail!(
                "the warm pool names size {unknown:?}, which is not in the size table ({})",
                rt.sizes.keys().cloned().collect::<Vec<_>>().join(", ")
            );
        }
        let (mcp_allowed_hosts, mcp_allowed_origins) = match file.mcp {
            Some(m) => (m.allowed_hosts, m.allowed_origins),
            None => (None, None),
        };
        Ok(Settings {
            database_url: None,
            cluster: file.cluster.clone().unwrap_or_default(),
            node_address: None,
            no_vms: false,
            data_dir,
            images_dir,
            config_file: config.map(Path::to_path_buf),
            runtime: rt,
            service,
            listen,
            public_url,
            mcp_allowed_hosts,
            mcp_allowed_origins,
            max_body_bytes: file.limits.as_ref().and_then(|l| l.max_body_bytes),
            body_budget_bytes: file
                .limits
                .as_ref()
                .and_then(|l| l.body_budget_mb)
                .map(|mb| mb.saturating_mul(1024 * 1024)),
            preview_domain_set,
            preview_scheme_set,
            tls,
            pool,
            capacity: file.capacity.unwrap_or_default(),
            connections: file.server.unwrap_or_default(),
            metrics: file.metrics.unwrap_or_default(),
            signup: file.signup.unwrap_or_default(),
            secrets_key_file: file.secrets.and_then(|s| s.key_file),
        })
    }
}

/// `SANDPIT_POOL`: `small=2,medium=1`, or `none` (also `0` or empty) for no pool.
fn parse_pool_sizes(v: &str) -> Result<BTreeMap<String, usize>> {
    let v = v.trim();
    if v == "none" || v == "0" {
        return Ok(BTreeMap::new());
    }
    v.split(',')
        .map(|kv| {
            let (k, n) = kv
                .split_once('=')
                .with_context(|| format!("SANDPIT_POOL: expected size=count, got {kv:?}"))?;
            let n: usize = n
                .trim()
                .parse()
                .with_context(|| format!("SANDPIT_POOL: {n:?} is not a count"))?;
            Ok((k.trim().to_string(), n))
        })
        .collect()
}

#[cfg(test)]
mod pool_tests {
    use super::parse_pool_sizes;

    #[test]
    fn pool_sizes_parse() {
        assert!(parse_pool_sizes("none").unwrap().is_empty());
        assert!(parse_pool_sizes("0").unwrap().is_empty());
        let m = parse_pool_sizes("small=2, medium=1").unwrap();
        assert_eq!(m["small"], 2);
        assert_eq!(m["medium"], 1);
        assert!(parse_pool_sizes("small").is_err());
        assert!(parse_pool_sizes("small=x").is_err());
    }
}

#[cfg(test)]
mod volumes_tests {
    use super::Settings;

    #[test]
    fn volumes_are_configured_by_their_section_and_a_bad_default_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        std::fs::create_dir(&data).unwrap();
        let s = Settings::load(Some(data.clone()), None, None).unwrap();
        assert_eq!(s.service.volumes, Default::default());
        let config = dir.path().join("config.toml");
        std::fs::write(
            &config,
            "[volumes]\nmax_per_account = 3\nmax_size_gb = 5\ndefault_size_gb = 2\n\
             price_usd_per_gb_month = 0.5\n",
        )
        .unwrap();
        let s = Settings::load(Some(data.clone()), None, Some(&config)).unwrap();
        let v = &s.service.volumes;
        assert_eq!(
            (v.max_per_account, v.max_size_gb, v.default_size_gb),
            (3, 5, 2)
        );
        assert_eq!(v.price_usd_per_gb_month, 0.5);
        assert_eq!(v.max_bytes_per_account, 100 * 1024 * 1024 * 1024);
        std::fs::write(&config, "[volumes]\nmax_size_gb = 5\n").unwrap();
        let e = Settings::load(Some(data.clone()), None, Some(&config))
            .unwrap_err()
            .to_string();
        assert!(e.contains("default_size_gb"), "{e}");
        std::fs::write(&config, "[volumes]\nsize = 5\n").unwrap();
        assert!(Settings::load(Some(data), None, Some(&config)).is_err());
    }
}

#[cfg(test)]
mod secrets_tests {
    use super::Settings;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn the_secrets_key_is_the_configured_files_or_one_made_in_the_data_directory() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        std::fs::create_dir(&data).unwrap();
        let s = Settings::load(Some(data.clone()), None, None).unwrap();
        assert_eq!(s.secrets_key_file, None);
        s.secrets_key().unwrap();
        let made = data.join("secrets.key");
        let mode = std::fs::metadata(&made).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);

        let config = dir.path().join("config.toml");
        let key = dir.path().join("shared.key");
        std::fs::write(
            &config,
            format!("[secrets]\nkey_file = \"{}\"\n", key.display()),
        )
        .unwrap();
        let s = Settings::load(Some(data.clone()), None, Some(&config)).unwrap();
        assert_eq!(s.secrets_key_file.as_deref(), Some(key.as_path()));
        // A configured file is not made: it is the operator's.
        let e = s.secrets_key().unwrap_err().to_string();
        assert!(e.contains("key_file"), "{e}");
        std::fs::write(&key, format!("{}\n", "0f".repeat(32))).unwrap();
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o640)).unwrap();
        let e = s.secrets_key().unwrap_err().to_string();
        assert!(e.contains("chmod 600"), "{e}");
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
        s.secrets_key().unwrap();

        std::fs::write(&config, "[secrets]\nkey = \"x\"\n").unwrap();
        let e = Settings::load(Some(data), None, Some(&config)).unwrap_err();
        assert!(format!("{e:#}").contains("key"), "{e:#}");
    }
}

#[cfg(test)]
mod network_tests {
    use super::Settings;

    #[test]
    fn the_proxy_and_ca_settings_reach_the_runtime() {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("config.toml");
        std::fs::write(
            &config,
            "[network]\nproxy = \"http://proxy.corp.example:3128\"\n\
             no_proxy = [\".corp.example\"]\n\
             ca_certificates = [\"/etc/sandpit/corp-root.pem\"]\n\
             upstream_ca_certificates = [\"/etc/sandpit/internal-ca.pem\"]\n",
        )
        .unwrap();
        let s = Settings::load(Some(dir.path().into()), None, Some(&config)).unwrap();
        let n = &s.runtime.network;
        assert_eq!(n.proxy.as_deref(), Some("http://proxy.corp.example:3128"));
        assert_eq!(n.no_proxy, [".corp.example"]);
        assert_eq!(
            n.ca_certificates,
            [std::path::Path::new("/etc/sandpit/corp-root.pem")]
        );
        assert_eq!(
            n.upstream_ca_certificates,
            [std::path::Path::new("/etc/sandpit/internal-ca.pem")]
        );
        assert_eq!(n.dns, None, "the guests' DNS stays passt's forwarder");

        // A configured deny list extends the default one; dropping the
        // default takes saying so.
        std::fs::write(&config, "[preview]\ndomain = \"https://*.example.com\"\n").unwrap();
        let e = Settings::load(Some(dir.path().into()), None, Some(&config)).unwrap_err();
        assert!(e.to_string().contains("[preview] domain"), "{e}");

        std::fs::write(&config, "[network]\ndeny = [\"203.0.113.0/24\"]\n").unwrap();
        let s = Settings::load(Some(dir.path().into()), None, Some(&config)).unwrap();
        let deny = &s.runtime.network.deny;
        for cidr in [
            "10.0.0.0/8",
            "169.254.0.0/16",
            "168.63.129.16/32",
            "203.0.113.0/24",
        ] {
            assert!(deny.iter().any(|d| d == cidr), "{cidr} not in {deny:?}");
        }
        std::fs::write(
            &config,
            "[network]\ndefault_deny = false\ndeny = [\"203.0.113.0/24\"]\n",
        )
        .unwrap();
        let s = Settings::load(Some(dir.path().into()), None, Some(&config)).unwrap();
        assert_eq!(s.runtime.network.deny, ["203.0.113.0/24"]);

        std::fs::write(&config, "[network]\nhttps_proxy = \"http://p:1\"\n").unwrap();
        let e = Settings::load(Some(dir.path().into()), None, Some(&config)).unwrap_err();
        assert!(format!("{e:#}").contains("https_proxy"), "{e:#}");
    }
}
