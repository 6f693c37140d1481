//! Runtime configuration: sizes, accelerator, network policy, limits.
//!
//! Defaults follow the public API's size table; operators change them in the
//! server's config file (and tests shrink them so a disk filler finishes).

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Resources of one sandbox size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SizeSpec {
    pub vcpus: u32,
    pub memory_mb: u32,
    pub disk_gb: u32,
}

/// Which accelerator QEMU uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum AccelChoice {
    /// KVM when it is really usable, otherwise TCG.
    #[default]
    Auto,
    Kvm,
    Tcg,
}

/// Outbound network of sandboxes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetworkPolicy {
    /// Give sandboxes a network at all.
    pub enabled: bool,
    /// IPv4 CIDRs the guest may never reach. The host's own addresses are added
    /// at start-up.
    pub deny: Vec<String>,
    /// Name servers the guest uses; default: passt forwards to the host's resolver.
    pub dns: Option<Vec<String>>,
    /// An HTTP proxy every guest command is told to use (`http_proxy`,
    /// `https_proxy`): `http://HOST:PORT`, resolved at start; guests may
    /// reach that address and port even inside a denied prefix.
    #[serde(default)]
    pub proxy: Option<String>,
    /// Hosts and domains reached without the proxy (`no_proxy`), besides the
    /// guest's own `localhost`.
    #[serde(default)]
    pub no_proxy: Vec<String>,
    /// PEM files of CA certificates every guest trusts besides its own (a
    /// TLS-inspecting proxy's), read at start.
    #[serde(default)]
    pub ca_certificates: Vec<PathBuf>,
    /// PEM files of CA certificates the host trusts, besides its own trust
    /// store, when it sends a brokered secret on to its server (an
    /// internal API with a private CA), read at start.
    #[serde(default)]
    pub upstream_ca_certificates: Vec<PathBuf>,
}

/// The safe default deny list: link-local (cloud metadata at 169.254.169.254),
/// private ranges (the operator's own network), carrier-grade NAT (some clouds'
/// metadata, Alibaba's 100.100.100.200), Azure's host endpoint 168.63.129.16
/// (a public address), loopback and "this network", multicast and reserved
/// space. A configured `deny` adds to it.
pub const DEFAULT_DENY: &[&str] = &[
    "0.0.0.0/8",
    "10.0.0.0/8",
    "100.64.0.0/10",
    "127.0.0.0/8",
    "168.63.129.16/32",
    "169.254.0.0/16",
    "172.16.0.0/12",
    "192.0.0.0/24",
    "192.168.0.0/16",
    "224.0.0.0/4",
    "240.0.0.0/4",
];

impl Default for NetworkPolicy {
    fn default() -> Self {
        NetworkPolicy {
            enabled: true,
            deny: DEFAULT_DENY.iter().map(|s| s.to_string()).collect(),
            dns: None,
            proxy: None,
            no_proxy: Vec::new(),
            ca_certificates: Vec::new(),
            upstream_ca_certificates: Vec::new(),
        }
    }
}

/// The longest data directory path the runtime takes, in bytes. No socket
/// path depends on it (see [`crate::vm::AGENT_SOCKET`]), but every path
/// under it must stay within the system's limit on a path (4,096 bytes with
/// its end, `PATH_MAX`), and the runtime names files up to 1,024 bytes
/// below it (a VM's, a template's, a save's, a volume's).
pub const MAX_DATA_DIR_BYTES: usize = 3072;

/// Why the runtime cannot keep its files in `data_dir` (an absolute path),
/// if it cannot: `serve`, `node`, `mcp` and `doctor` refuse such a
/// directory at their start, never later.
pub fn check_data_dir(data_dir: &Path) -> std::result::Result<(), String> {
    let len = data_dir.as_os_str().len();
    if len > MAX_DATA_DIR_BYTES {
        return Err(format!(
            "the data directory's path is {len} bytes long, longer than the {MAX_DATA_DIR_BYTES} \
             bytes taken: the files under it would pass the system's limit of 4,096 bytes on a \
             path; use a shorter --data-dir"
        ));
    }
    Ok(())
}

/// Everything the runtime needs to know.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RuntimeConfig {
    /// Where VM directories live (`<data_dir>/vms/<id>`).
    pub data_dir: PathBuf,
    /// Size table.
    pub sizes: BTreeMap<String, SizeSpec>,
    pub accel: AccelChoice,
    /// A VM whose agent does not answer within this bound is a failed create.
    #[serde(with = "humantime_secs")]
    pub boot_timeout: Duration,
    pub network: NetworkPolicy,
    /// Most processes the guest user may have at once.
    pub user_pids_max: u32,
    /// Guest memory kept from the user for the agent and kernel.
    pub reserved_memory_mb: u32,
    /// TCG translation cache per VM, MiB (host memory per sandbox).
    pub tcg_tb_size_mb: u32,
    /// Free space kept on the VMs' filesystem: no new VM starts below it
    /// (overlays grow as guests write, up to their size's disk each).
    pub disk_reserve_mb: u64,
    /// Start VMs by restoring a snapshot template of their size (built on
    /// first use) rather than booting them.
    #[serde(default = "yes")]
    pub snapshots: bool,
    /// Merge the network helpers' identical pages with KSM, turning the
    /// host's KSM daemon on if it is off and pacing it to the sandboxes on
    /// the host (see `ksm`). Guest RAM is never merged either way.
    #[serde(default = "yes")]
    pub ksm: bool,
    pub qemu_binary: PathBuf,
    pub passt_binary: PathBuf,
}

fn yes() -> bool {
    true
}

mod humantime_secs {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;
    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(d.as_secs())
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        Ok(Duration::from_secs(u64::deserialize(d)?))
    }
}

/// The public API's default size table.
pub fn default_sizes() -> BTreeMap<String, SizeSpec> {
    let mut m = BTreeMap::new();
    m.insert(
        "small".into(),
        SizeSpec {
            vcpus: 2,
            memory_mb: 4096,
            disk_gb: 40,
        },
    );
    m.insert(
        "medium".into(),
        SizeSpec {
            vcpus: 4,
            memory_mb: 8192,
            disk_gb: 40,
        },
    );
    m.insert(
        "large".into(),
        SizeSpec {
            vcpus: 8,
            memory_mb: 16384,
            disk_gb: 40,
        },
    );
    m
}

impl RuntimeConfig {
    pub fn new(data_dir: impl Into<PathBuf>) -> Self {
        RuntimeConfig {
            data_dir: data_dir.into(),
            sizes: default_sizes(),
            accel: AccelChoice::Auto,
            boot_timeout: Duration::from_secs(60),
            network: NetworkPolicy::default(),
            user_pids_max: 4096,
            reserved_memory_mb: 96,
            tcg_tb_size_mb: 64,
            disk_reserve_mb: 2048,
            snapshots: true,
            ksm: true,
            qemu_binary: "qemu-system-x86_64".into(),
            passt_binary: "passt".into(),
        }
    }

    pub fn vms_dir(&self) -> PathBuf {
        self.data_dir.join("vms")
    }

    /// Where this host keeps volumes' files (see [`crate::volume_files`]).
    pub fn volumes_dir(&self) -> PathBuf {
        self.data_dir.join("volumes")
    }

    pub fn size(&self, name: &str) -> crate::Result<SizeSpec> {
        self.sizes.get(name).copied().ok_or_else(|| {
            crate::RuntimeError::UnknownSize(
                name.to_string(),
                self.sizes.keys().cloned().collect::<Vec<_>>().join(", "),
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_data_directory_is_refused_only_past_the_path_limit() {
        let long = format!("/{}", "d/".repeat(100));
        assert_eq!(check_data_dir(Path::new(&long)), Ok(()));
        let at_limit = format!("/{}", "d".repeat(MAX_DATA_DIR_BYTES - 1));
        assert_eq!(check_data_dir(Path::new(&at_limit)), Ok(()));
        let why = check_data_dir(Path::new(&format!("{at_limit}d"))).unwrap_err();
        assert!(why.contains("3073 bytes long"), "{why}");
        assert!(why.contains("4,096"), "{why}");
    }
}
