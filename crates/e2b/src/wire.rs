//! The control plane's JSON, as E2B's SDKs send and read it (field names
//! are E2B's: camelCase, with `templateID`, `sandboxID` and the one
//! snake_case `allow_internet_access`).

use crate::{E2b, ENVD_VERSION};
use sandpit_core::{Sandbox, SandboxStatus};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// `POST /v2/sandboxes`. Fields the SDKs send that Sandpit cannot honour
/// yet are read so that a create asking for them is refused, saying so.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NewSandbox {
    #[serde(rename = "templateID")]
    pub template_id: Option<String>,
    /// Seconds.
    pub timeout: Option<u64>,
    pub metadata: Option<BTreeMap<String, String>>,
    pub env_vars: Option<BTreeMap<String, String>>,
    #[serde(rename = "allow_internet_access")]
    pub allow_internet_access: Option<bool>,
    pub auto_pause: Option<bool>,
    pub network: Option<Network>,
    pub mcp: Option<serde_json::Value>,
    pub volume_mounts: Option<Vec<VolumeMount>>,
}

/// A create's `volumeMounts` entry (`SandboxVolumeMount`): the account's
/// volume `name` mounted read-write at `path`.
#[derive(Debug, Deserialize)]
pub struct VolumeMount {
    pub name: String,
    pub path: String,
}

/// `network` of a create (E2B's `SandboxNetworkConfig`). Sandpit serves
/// every port of an E2B sandbox on its preview host (`get_host(port)`);
/// what else may be asked is read so that it is refused, saying so.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Network {
    pub allow_public_traffic: Option<bool>,
    pub allow_out: Option<Vec<String>>,
    pub deny_out: Option<Vec<String>>,
    pub mask_request_host: Option<String>,
    pub rules: Option<Rules>,
    /// Whatever else (the egress proxy): refused when present.
    #[serde(flatten)]
    pub other: BTreeMap<String, serde_json::Value>,
}

/// `network.rules` (E2B's `SandboxNetworkConfig.rules`): per host, rules
/// in order, each a transform setting headers.
pub type Rules = BTreeMap<String, Vec<Rule>>;

/// `SandboxNetworkRule`.
#[derive(Debug, Default, Deserialize)]
pub struct Rule {
    pub transform: Option<Transform>,
}

/// `SandboxNetworkTransform`.
#[derive(Debug, Default, Deserialize)]
pub struct Transform {
    pub headers: Option<BTreeMap<String, String>>,
}

/// Rules as the service has them: per host, the headers set (a later
/// rule's header over an earlier one's of the same name); a host whose
/// rules set none is left out.
pub fn network_rules(rules: Option<&Rules>) -> sandpit_core::NetworkRules {
    let mut out = sandpit_core::NetworkRules::new();
    for (host, list) in rules.into_iter().flatten() {
        let set = out.entry(host.trim().to_ascii_lowercase()).or_default();
        let headers = list
            .iter()
            .filter_map(|r| r.transform.as_ref()?.headers.as_ref())
            .flatten();
        for (name, value) in headers {
            set.retain(|k: &String, _| !k.eq_ignore_ascii_case(name));
            set.insert(name.clone(), value.clone());
        }
    }
    out.retain(|_, set| !set.is_empty());
    out
}

/// `PUT /sandboxes/{id}/network` (E2B's `SandboxNetworkUpdateConfig`):
/// the sandbox's egress replaced whole, an omitted field cleared.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NetworkUpdate {
    pub allow_out: Option<Vec<String>>,
    pub deny_out: Option<Vec<String>>,
    #[serde(rename = "allow_internet_access")]
    pub allow_internet_access: Option<bool>,
    pub rules: Option<Rules>,
    /// Whatever else (the egress proxy, name servers): refused when
    /// present.
    #[serde(flatten)]
    pub other: BTreeMap<String, serde_json::Value>,
}

/// A sandbox's own lists as get_info shows them (`SandboxNetworkConfig`).
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NetworkInfo {
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub allow_out: Vec<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub deny_out: Vec<String>,
}

/// `POST /sandboxes/{id}/timeout`.
#[derive(Debug, Deserialize)]
pub struct Timeout {
    /// Seconds from now.
    pub timeout: u64,
}

/// `POST /v2/sandboxes/{id}/connect`.
#[derive(Debug, Default, Deserialize)]
pub struct Connect {
    /// Seconds from now, if longer than what the sandbox has left.
    pub timeout: Option<u64>,
}

/// `POST /sandboxes/{id}/fork`.
#[derive(Debug, Default, Deserialize)]
pub struct Fork {
    /// Seconds, for each new sandbox.
    pub timeout: Option<u64>,
    pub count: Option<u32>,
}

/// `POST /sandboxes/{id}/snapshots`. (`memory: false`, a snapshot of the
/// disk alone, is answered with the whole state: Sandpit keeps both.)
#[derive(Debug, Default, Deserialize)]
pub struct NewSnapshot {
    pub name: Option<String>,
}

/// A snapshot as E2B names it: its id is the template sandboxes are
/// created from.
pub fn snapshot_info(snap: &sandpit_core::Snapshot) -> serde_json::Value {
    let names = match &snap.name {
        Some(name) => vec![name.clone(), snap.id.clone()],
        None => vec![snap.id.clone()],
    };
    serde_json::json!({"snapshotID": snap.id, "names": names})
}

/// A sandbox as create and connect answer it.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CreatedSandbox {
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    #[serde(rename = "clientID")]
    pub client_id: &'static str,
    pub envd_version: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub envd_access_token: Option<String>,
    pub domain: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub alias: Option<String>,
    /// What its ports want when they are private (`allowPublicTraffic=false`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub traffic_access_token: Option<String>,
}

/// A sandbox as get_info (`detail`) and list answer it.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxInfo {
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    #[serde(rename = "clientID")]
    pub client_id: &'static str,
    pub started_at: String,
    pub end_at: String,
    pub envd_version: &'static str,
    pub cpu_count: u32,
    #[serde(rename = "memoryMB")]
    pub memory_mb: u32,
    #[serde(rename = "diskSizeMB")]
    pub disk_size_mb: u64,
    pub state: &'static str,
    pub metadata: BTreeMap<String, String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub alias: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub domain: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub envd_access_token: Option<String>,
    /// Whether its create said `allow_internet_access` (absent: it did not).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub allow_internet_access: Option<bool>,
    /// Its own egress lists, if it has any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkInfo>,
}

/// A reading of a sandbox's resources (`SandboxMetric`).
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Metric {
    /// RFC 3339 (deprecated by E2B, still required by its Python SDK).
    pub timestamp: String,
    pub timestamp_unix: i64,
    pub cpu_count: u32,
    pub cpu_used_pct: f64,
    pub mem_used: u64,
    pub mem_total: u64,
    pub mem_cache: u64,
    pub disk_used: u64,
    pub disk_total: u64,
}

impl From<&sandpit_core::SandboxMetric> for Metric {
    fn from(m: &sandpit_core::SandboxMetric) -> Metric {
        let at = time::OffsetDateTime::from_unix_timestamp_nanos(m.at_unix_ms as i128 * 1_000_000)
            .unwrap_or(time::OffsetDateTime::UNIX_EPOCH);
        Metric {
            timestamp: at
                .format(&time::format_description::well_known::Rfc3339)
                .unwrap_or_default(),
            timestamp_unix: at.unix_timestamp(),
            cpu_count: m.cpu_count,
            cpu_used_pct: m.cpu_used_pct,
            mem_used: m.mem_used_bytes,
            mem_total: m.mem_total_bytes,
            mem_cache: m.mem_cache_bytes,
            disk_used: m.disk_used_bytes,
            disk_total: m.disk_total_bytes,
        }
    }
}

/// Any string: the SDKs keep it, nothing reads it.
const CLIENT_ID: &str = "sandpit";

/// The template a sandbox stands for, as E2B names it: `base` for the
/// default size, else the size's name (see `control::size_of_template`).
pub fn template_of(sandbox: &Sandbox, default_size: &str) -> String {
    match sandbox.size == default_size {
        true => "base".into(),
        false => sandbox.size.clone(),
    }
}

/// E2B's two states; `None` for one no list shows (ending or ended).
pub fn state_of(status: SandboxStatus) -> Option<&'static str> {
    match status {
        SandboxStatus::Provisioning | SandboxStatus::Running => Some("running"),
        SandboxStatus::Paused => Some("paused"),
        SandboxStatus::Deleting | SandboxStatus::Deleted | SandboxStatus::Failed => None,
    }
}

impl E2b {
    pub fn created(&self, sandbox: &Sandbox) -> CreatedSandbox {
        CreatedSandbox {
            template_id: template_of(sandbox, &self.default_size),
            sandbox_id: sandbox.id.clone(),
            client_id: CLIENT_ID,
            envd_version: ENVD_VERSION,
            envd_access_token: sandbox.access_token.clone(),
            domain: self.domain.clone(),
            alias: sandbox.name.clone(),
            traffic_access_token: sandbox
                .traffic_token
                .clone()
                .filter(|_| sandbox.private_traffic),
        }
    }

    /// `detail` adds what get_info shows beyond a list's entry.
    pub fn info(&self, sandbox: &Sandbox, detail: bool) -> SandboxInfo {
        SandboxInfo {
            template_id: template_of(sandbox, &self.default_size),
            sandbox_id: sandbox.id.clone(),
            client_id: CLIENT_ID,
            started_at: sandbox.created_at.clone(),
            end_at: sandbox.expires_at.clone(),
            envd_version: ENVD_VERSION,
            cpu_count: sandbox.resources.vcpus,
            memory_mb: sandbox.resources.memory_mb,
            disk_size_mb: u64::from(sandbox.resources.disk_gb) * 1024,
            state: state_of(sandbox.status).unwrap_or("running"),
            metadata: sandbox.metadata.clone(),
            alias: sandbox.name.clone(),
            domain: detail.then(|| self.domain.clone()),
            envd_access_token: detail.then(|| sandbox.access_token.clone()).flatten(),
            allow_internet_access: detail.then_some(sandbox.internet_access).flatten(),
            network: detail
                .then(|| sandbox.network.clone())
                .flatten()
                .map(|n| NetworkInfo {
                    allow_out: n.allow_out,
                    deny_out: n.deny_out,
                }),
        }
    }
}
