//! Where Sandpit keeps its state and how the runtime is configured: data
//! directory, images directory, and the optional TOML config file.
//!
//! Precedence: command-line flag, then environment variable, then config
//! file, then the built-in default.

use anyhow::{Context, Result};
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
    pub sizes: Option<BTreeMap<String, SizeSpec>>,
    pub accel: Option<AccelChoice>,
    pub boot_timeout_secs: Option<u64>,
    pub network: Option<NetworkSection>,
    pub user_pids_max: Option<u32>,
    pub reserved_memory_mb: Option<u32>,
    pub tcg_tb_size_mb: Option<u32>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetworkSection {
    pub enabled: Option<bool>,
    /// Replaces the default deny list.
    pub deny: Option<Vec<String>>,
    pub dns: Option<Vec<String>>,
}

/// Resolved settings of one invocation.
#[derive(Debug, Clone)]
pub struct Settings {
    pub data_dir: PathBuf,
    pub images_dir: PathBuf,
    pub runtime: RuntimeConfig,
}

impl Settings {
    pub fn load(
        data_dir: Option<PathBuf>,
        images_dir: Option<PathBuf>,
        config: Option<&Path>,
    ) -> Result<Settings> {
        let data_dir = data_dir.unwrap_or_else(default_data_dir);
        let images_dir = images_dir.unwrap_or_else(|| data_dir.join("images"));
        let file: FileConfig = match config {
            Some(p) => {
                let text = std::fs::read_to_string(p)
                    .with_context(|| format!("reading config {}", p.display()))?;
                toml::from_str(&text).with_context(|| format!("parsing config {}", p.display()))?
            }
            None => FileConfig::default(),
        };
        let mut rt = RuntimeConfig::new(&data_dir);
        if let Some(s) = file.sizes {
            rt.sizes = s;
        }
        if let Some(a) = file.accel {
            rt.accel = a;
        }
        if let Some(s) = file.boot_timeout_secs {
            rt.boot_timeout = Duration::from_secs(s);
        }
        if let Some(n) = file.network {
            if let Some(e) = n.enabled {
                rt.network.enabled = e;
            }
            if let Some(d) = n.deny {
                rt.network.deny = d;
            }
            if n.dns.is_some() {
                rt.network.dns = n.dns;
            }
        }
        if let Some(v) = file.user_pids_max {
            rt.user_pids_max = v;
        }
        if let Some(v) = file.reserved_memory_mb {
            rt.reserved_memory_mb = v;
        }
        if let Some(v) = file.tcg_tb_size_mb {
            rt.tcg_tb_size_mb = v;
        }
        Ok(Settings {
            data_dir,
            images_dir,
            runtime: rt,
        })
    }
}
