//! The public objects, field for field as in `docs/spec/rest-api.md`. They
//! are what REST returns and what MCP tools put in `structuredContent`.
//!
//! Money is kept as integer micro-dollars inside Sandpit ([`Micros`]) and
//! shown as USD (`f64`) only at the edge.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// A call on a volume's files (`Volumes::volume_files`) and the owner and
/// mode of what a call makes: the runtime's own words, which the node API
/// carries too.
pub use sandpit_host::machines::{Ownership as VolumeOwnership, VolumeCall};
/// The lifecycle states: the store's types, since a row stores the word
/// the API shows.
pub use sandpit_store::SandboxStatus;

/// Where an execution is: still running, or how it ended (the store's
/// [`sandpit_store::ExecutionStatus`], the same words).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ExecutionStatus {
    /// Not ended yet: what `GET /v1/executions/{id}` shows while it runs,
    /// and the streaming answer's first event.
    Running,
    /// It exited (any exit code) or was killed by a signal of its own.
    Completed,
    /// Killed at its timeout.
    TimedOut,
    /// Killed because its caller cancelled it (or hung up on its stream).
    Cancelled,
    /// The platform could not run it to its end (the VM or its agent failed).
    Failed,
}

impl From<sandpit_store::ExecutionStatus> for ExecutionStatus {
    fn from(ended: sandpit_store::ExecutionStatus) -> Self {
        match ended {
            sandpit_store::ExecutionStatus::Completed => ExecutionStatus::Completed,
            sandpit_store::ExecutionStatus::TimedOut => ExecutionStatus::TimedOut,
            sandpit_store::ExecutionStatus::Cancelled => ExecutionStatus::Cancelled,
            sandpit_store::ExecutionStatus::Failed => ExecutionStatus::Failed,
        }
    }
}

impl From<sandpit_store::ExecutionState> for ExecutionStatus {
    fn from(state: sandpit_store::ExecutionState) -> Self {
        match state {
            sandpit_store::ExecutionState::Running => ExecutionStatus::Running,
            sandpit_store::ExecutionState::Ended(ended) => ended.into(),
        }
    }
}

/// Millionths of a US dollar.
pub type Micros = i64;

/// Micro-dollars as USD for display.
pub fn usd(m: Micros) -> f64 {
    m as f64 / 1_000_000.0
}

/// USD (as typed by an operator) to micro-dollars, rounded to the nearest micro.
pub fn micros(usd: f64) -> Micros {
    (usd * 1_000_000.0).round() as Micros
}

/// vCPUs, memory and disk of a sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Resources {
    pub vcpus: u32,
    pub memory_mb: u32,
    pub disk_gb: u32,
}

/// A sandbox's resources at one moment, as its guest's kernel counts them
/// (E2B's `SandboxMetric`; not part of the REST contract).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SandboxMetric {
    /// When it was read, in milliseconds since the Unix epoch.
    pub at_unix_ms: i64,
    pub cpu_count: u32,
    /// The guest's CPUs' busy share since the reading before, in percent
    /// of all of them (0 to 100).
    pub cpu_used_pct: f64,
    /// `MemTotal` less `MemAvailable`: what programs hold.
    pub mem_used_bytes: u64,
    pub mem_total_bytes: u64,
    /// The page cache.
    pub mem_cache_bytes: u64,
    /// The root file system, as `df /` counts it.
    pub disk_used_bytes: u64,
    pub disk_total_bytes: u64,
}

/// The sandbox object.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Sandbox {
    pub id: String,
    /// Always `"sandbox"`.
    pub object: String,
    pub name: Option<String>,
    pub status: SandboxStatus,
    pub size: String,
    pub resources: Resources,
    pub timeout_minutes: u32,
    /// RFC 3339 UTC.
    pub created_at: String,
    pub ready_at: Option<String>,
    pub expires_at: String,
    pub deleted_at: Option<String>,
    /// Why it ended: `destroyed`, `expired` or `failed: <cause>`.
    pub deleted_reason: Option<String>,
    /// What its disk takes on the host, in bytes: what the guest wrote,
    /// measured every few seconds (for an ended sandbox, its last figure).
    /// An account's live sandboxes together are held to `account_disk_bytes`.
    #[serde(default)]
    pub disk_used_bytes: u64,
    /// See [`CreateSandbox::metadata`] (not part of the REST API).
    #[serde(skip)]
    #[schemars(skip)]
    pub metadata: BTreeMap<String, String>,
    /// The token E2B's data plane (envd's API) is reached with, for this
    /// sandbox only (not part of the REST API).
    #[serde(skip)]
    #[schemars(skip)]
    pub access_token: Option<String>,
    /// See [`CreateSandbox::internet_access`] (not part of the REST API).
    #[serde(skip)]
    #[schemars(skip)]
    pub internet_access: Option<bool>,
    /// The template build it started from (`tpl_…`), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template_id: Option<String>,
    /// Its own egress lists, if it has any (see [`NetworkLists`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkLists>,
    /// The token its private ports want (the `x-sandpit-traffic-token`
    /// header); shown to its owner only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traffic_token: Option<String>,
    /// Every port of it is private (E2B's `allowPublicTraffic=false`; not
    /// part of the REST API).
    #[serde(skip)]
    #[schemars(skip)]
    pub private_traffic: bool,
}

/// `POST /sandboxes` body and `create_sandbox` input.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateSandbox {
    /// `small` (default), `medium` or `large`.
    #[serde(default)]
    pub size: Option<String>,
    /// A label of your own.
    #[serde(default)]
    pub name: Option<String>,
    /// Lifetime in minutes, 1..1440 (default 15). The sandbox is destroyed when it runs out.
    #[serde(default)]
    pub timeout_minutes: Option<u32>,
    /// Start from this snapshot (`snap_…`): its disk, memory and running
    /// processes, with a fresh identity. The size is the snapshot's (a
    /// different `size` is refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_id: Option<String>,
    /// Start from this template (`name` or `name:tag`, tag `latest` by
    /// default): the newest ready build the account owns, or one an
    /// operator published; its start command already running. The size is
    /// the template's (a different `size` is refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<String>,
    /// A template build's own start: the cached layer (a save on a node)
    /// its next step runs on (not part of any API).
    #[serde(skip)]
    #[schemars(skip)]
    pub layer: Option<LayerStart>,
    /// E2B's labels, which its lists filter by (not part of the REST API).
    #[serde(skip)]
    #[schemars(skip)]
    pub metadata: BTreeMap<String, String>,
    /// Environment variables every command in the sandbox gets, under the
    /// command's own (E2B's `envVars`; not part of the REST API).
    #[serde(skip)]
    #[schemars(skip)]
    pub env: BTreeMap<String, String>,
    /// Every port of the sandbox is reached through its preview URL without
    /// `expose_port` first, as E2B's `get_host(port)` expects (not part of
    /// the REST API, where ports are exposed one by one).
    #[serde(skip)]
    #[schemars(skip)]
    pub every_port_public: bool,
    /// Whether the guest may reach the network beyond itself: `false` is
    /// E2B's `allow_internet_access=False` (nothing but its own loopback;
    /// commands, files and preview URLs work as ever); `None` (not said)
    /// and `true` are the operator's network. Not part of the REST API yet.
    #[serde(skip)]
    #[schemars(skip)]
    pub internet_access: Option<bool>,
    /// The sandbox's own egress lists (E2B's `allowOut` and `denyOut`),
    /// on top of what the operator lets every sandbox reach. Omitted: the
    /// operator's network as it is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkLists>,
    /// Every port of it private (E2B's `allowPublicTraffic=false`; not part
    /// of the REST API, whose ports are private one by one).
    #[serde(skip)]
    #[schemars(skip)]
    pub private_traffic: bool,
    /// The account's secrets (by name, at most 32) the sandbox uses: each
    /// is an environment variable of its commands holding a placeholder,
    /// which the host replaces with the value in HTTPS requests to the
    /// secret's hosts only. The value never enters the sandbox.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub secrets: Vec<String>,
    /// A fork's: the sandbox whose secrets (its CA and placeholders, which
    /// the snapshot's guest already has) it takes on (not part of any API).
    #[serde(skip)]
    #[schemars(skip)]
    pub secrets_of: Option<String>,
    /// Its network rules (E2B's; not part of the REST API).
    #[serde(skip)]
    #[schemars(skip)]
    pub network_rules: NetworkRules,
    /// The account's volumes it mounts (at most 4), each at a path of its
    /// own. A volume is mounted read-write by one live sandbox at a time
    /// and read-only by any number.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<VolumeMount>,
}

/// A volume a sandbox mounts (`CreateSandbox::volumes`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct VolumeMount {
    /// The volume's name or id (`vol_…`).
    pub volume: String,
    /// Where the guest sees it: an absolute path, not `/` and not under
    /// `/proc`, `/sys`, `/dev`, `/etc`, `/usr`, `/bin`, `/lib`, `/sbin`,
    /// `/boot` or `/run`.
    pub path: String,
    /// Mounted read-only (default `false`: read-write).
    #[serde(default)]
    pub read_only: bool,
}

/// A volume of the account (`GET /v1/volumes/{volume}`): an ext4 file
/// system its sandboxes mount, kept until it is deleted whatever becomes
/// of them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Volume {
    /// Always `"volume"`.
    pub object: String,
    /// `vol_…`.
    pub id: String,
    /// The account's own name for it (unique among its volumes).
    pub name: String,
    /// Its size in GiB (1 GiB = 2^30 bytes).
    pub size_gb: u32,
    /// `creating`, `ready`, `resizing` or `deleted`.
    pub status: String,
    /// RFC 3339 UTC.
    pub created_at: String,
    /// The live sandboxes that mount it.
    pub mounted_by: Vec<VolumeHolder>,
}

/// A live sandbox that mounts a volume.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct VolumeHolder {
    pub sandbox_id: String,
    pub path: String,
    pub read_only: bool,
}

/// A path in a volume, described (`/v1/volumes/{volume}/files`): read
/// from the volume's file by the host, while no sandbox mounts it
/// read-write.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct VolumeFile {
    /// Always `"volume_file"`.
    pub object: String,
    /// Its last component (`/` for the volume's root).
    pub name: String,
    /// Absolute in the volume (`/` is its root, whatever path sandboxes
    /// mount it at).
    pub path: String,
    /// `file`, `directory`, `symlink`, or `other` (a device, FIFO or
    /// socket).
    #[serde(rename = "type")]
    pub kind: String,
    /// In bytes.
    pub size: u64,
    /// Permission bits, as a number (`0o644` is 420).
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    /// RFC 3339 UTC, to the nanosecond.
    pub atime: String,
    pub mtime: String,
    pub ctime: String,
    /// A symbolic link's target (when short enough to be kept in its
    /// inode, the common case).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
}

/// `PATCH /v1/volumes/{volume}/files` body: what to change of a path's
/// owner and permission bits (absent: kept).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct VolumeFileMeta {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gid: Option<u32>,
    /// Permission bits (at most `0o7777`, 4095).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<u32>,
}

/// `POST /v1/volumes` body and `create_volume` input.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateVolume {
    /// 1 to 64 letters, digits, `-` and `_`; unique among the account's
    /// volumes.
    pub name: String,
    /// Its size in GiB: by default 10, at most 100 (an operator's
    /// `[volumes]` may say otherwise).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size_gb: Option<u32>,
}

/// `POST /v1/volumes/{volume}/move` body: where the volume goes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct MoveVolume {
    /// The cluster node (its name) that is to keep the volume.
    pub node: String,
}

/// `PATCH /v1/volumes/{volume}` body: a volume grown.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ResizeVolume {
    /// Its new size in GiB: larger than it is (a volume never shrinks).
    pub size_gb: u32,
}

/// A secret of the account (`GET /v1/secrets`): a credential its sandboxes
/// use without holding it. Its value is never shown again once stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Secret {
    /// Always `"secret"`.
    pub object: String,
    /// The environment variable a sandbox created with it gets.
    pub name: String,
    /// The hosts it is sent to (`api.example.com`, `*.example.com`).
    pub hosts: Vec<String>,
    /// The request header it goes in.
    pub header: String,
    /// The header's value, `{value}` standing for the secret.
    pub format: String,
    /// RFC 3339 UTC.
    pub created_at: String,
    /// The last time it was stored (RFC 3339 UTC).
    pub updated_at: String,
    /// When a sandbox last had it put into a request (RFC 3339 UTC;
    /// `null`: never), as its host last reported.
    pub last_used_at: Option<String>,
    /// Its stable id (`sec_…`; E2B's `secretID`; not part of the REST API).
    #[serde(skip)]
    #[schemars(skip)]
    pub id: String,
    /// 1 at its create, one more at each new value (E2B's
    /// `currentVersion`; not part of the REST API).
    #[serde(skip)]
    #[schemars(skip)]
    pub version: i64,
    /// Its owner's metadata (E2B's; not part of the REST API).
    #[serde(skip)]
    #[schemars(skip)]
    pub metadata: BTreeMap<String, String>,
}

/// A sandbox's network rules (E2B's `network.rules`): per host name
/// (`api.example.com`, `*.example.com`), the headers set on its HTTPS
/// requests, each value a template in which `${e2b.secrets.NAME}` stands
/// for the account's secret `NAME`, resolved on the host: the value never
/// enters the sandbox.
pub type NetworkRules = BTreeMap<String, BTreeMap<String, String>>;

/// `PUT /v1/secrets/{name}` body: a secret stored, or replaced.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PutSecret {
    /// The value (at most 8 KiB; no CR, LF or NUL). Never shown again.
    pub value: String,
    /// The hosts it may be sent to, 1 to 32: `api.example.com` or
    /// `*.example.com` (any name under it).
    pub hosts: Vec<String>,
    /// The request header it goes in (default `Authorization`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
    /// The header's value, with `{value}` once where the secret goes
    /// (default `Bearer {value}`; `{value}` for a header such as
    /// `x-api-key`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<String>,
}

/// Its value is never shown, in a log either.
impl std::fmt::Debug for PutSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PutSecret")
            .field("value", &"<redacted>")
            .field("hosts", &self.hosts)
            .field("header", &self.header)
            .field("format", &self.format)
            .finish()
    }
}

/// A sandbox's own egress lists: IPv4 addresses and prefixes (`8.8.8.8`,
/// `10.0.0.0/8`; at most 256 each). A destination in `allow_out` is
/// reached even inside a prefix of `deny_out`; nothing reaches what the
/// operator denies or the host's own addresses. A denied connect is
/// refused at once. `deny_out: ["0.0.0.0/0"]` with an `allow_out` list
/// lets the sandbox reach those destinations only (names still resolve).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NetworkLists {
    /// Reached, even inside a denied prefix.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow_out: Vec<String>,
    /// Refused at once, unless in `allow_out`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub deny_out: Vec<String>,
}

/// Where a template build's sandbox starts: a layer's save on its host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerStart {
    pub save_id: String,
    pub host: String,
}

/// The template object: one build of a named environment (the standard
/// image plus steps), which sandboxes start from with its start command
/// already running.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Template {
    /// `tpl_…`: this build.
    pub id: String,
    /// Always `"template"`.
    pub object: String,
    pub name: String,
    pub tag: String,
    /// The size it was built for; its sandboxes have it.
    pub size: String,
    /// `building`, then `ready` or `failed` (`waiting` first when E2B's
    /// builder asked for it before sending its steps).
    pub status: String,
    /// Published by the operator for every account.
    pub public: bool,
    /// Its build steps, and how many a cached layer spared.
    pub steps: u32,
    pub cached_steps: u32,
    /// Why the build failed.
    pub error: Option<String>,
    /// What its layers take on the host's disk.
    pub size_bytes: u64,
    /// RFC 3339 UTC.
    pub created_at: String,
    pub finished_at: Option<String>,
    /// The build's output (its last 256 KiB); in `GET /v1/templates/{id}`
    /// alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub log: Option<String>,
    /// What it was built from: its steps and start command, as `spec` in
    /// `POST /v1/templates` takes them (a rebuild sends them again); in
    /// `GET /v1/templates/{id}` alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<serde_json::Value>")]
    pub spec: Option<serde_json::Value>,
}

/// The templates a sandbox can start from, out of a list of builds (newest
/// first, as `list_templates` gives them): each `name:tag`'s newest ready
/// build, in the list's order. What `create`'s `template` picks by name.
pub fn usable_templates(builds: &[Template]) -> Vec<Template> {
    let mut seen = std::collections::BTreeSet::new();
    builds
        .iter()
        .filter(|t| t.status == "ready")
        .filter(|t| seen.insert((t.name.clone(), t.tag.clone())))
        .cloned()
        .collect()
}

/// `POST /v1/templates` body: a build of template `name`, described by a
/// Dockerfile (without `COPY`: files are sent by `sandpit template build`)
/// or by its steps.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct BuildTemplate {
    /// `name` or `name:tag` (tag `latest` by default): lower-case letters,
    /// digits, `-`, `_` and `.`.
    pub name: String,
    /// `small` (default), `medium` or `large`: its sandboxes' size.
    #[serde(default)]
    pub size: Option<String>,
    /// The Dockerfile subset: `FROM sandpit` (or `debian:bookworm`), `RUN`,
    /// `ENV`, `WORKDIR`, `USER`, `ARG`, `CMD`/`ENTRYPOINT` (the start
    /// command), `HEALTHCHECK CMD` (its ready check).
    #[serde(default)]
    pub dockerfile: Option<String>,
    /// Values of the Dockerfile's `ARG`s.
    #[serde(default)]
    pub build_args: BTreeMap<String, String>,
    /// The steps instead of a Dockerfile: `{"steps": [{"type": "run",
    /// "command": "…"}, {"type": "copy", "files": "<sha256>", "dest":
    /// "/app"}, {"type": "env", "vars": {…}}, {"type": "workdir", "path":
    /// "…"}, {"type": "user", "user": "root"|"user"}], "start": {"command":
    /// "…", "ready": "…"}}`.
    #[serde(default)]
    #[schemars(with = "Option<serde_json::Value>")]
    pub spec: Option<serde_json::Value>,
    /// The ready check (over the Dockerfile's `HEALTHCHECK`).
    #[serde(default)]
    pub ready_cmd: Option<String>,
    /// How long the ready check may take to pass (default 300 s).
    #[serde(default)]
    pub ready_timeout_seconds: Option<u32>,
    /// Run every step again, whatever the cache holds.
    #[serde(default)]
    pub no_cache: bool,
}

/// The snapshot object: the whole state of a running sandbox at one
/// moment (disk, memory, processes), kept until `expires_at`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Snapshot {
    /// `snap_…`.
    pub id: String,
    /// Always `"snapshot"`.
    pub object: String,
    pub name: Option<String>,
    /// The sandbox it was taken of.
    pub sandbox_id: String,
    /// That sandbox's size; sandboxes started from it have the same.
    pub size: String,
    /// `creating` while it is written, then `ready`.
    pub status: String,
    /// What it alone takes on the host's disk (what it shares with the
    /// image and other snapshots is not counted).
    pub size_bytes: u64,
    /// RFC 3339 UTC.
    pub created_at: String,
    /// When it is deleted unless deleted before.
    pub expires_at: String,
}

/// `POST /sandboxes/{id}/snapshots` body and `snapshot_sandbox` input.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateSnapshot {
    /// A label of your own.
    #[serde(default)]
    pub name: Option<String>,
}

/// `GET /snapshots` query and `list_snapshots` input.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ListSnapshots {
    /// 1..100, default 20.
    #[serde(default)]
    pub limit: Option<u32>,
    /// A snapshot id: list those taken before it (the previous page's `next_cursor`).
    #[serde(default)]
    pub starting_after: Option<String>,
}

/// `GET /sandboxes/{id}/executions` query and `list_executions` input.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ListExecutions {
    /// 1..100, default 20.
    #[serde(default)]
    pub limit: Option<u32>,
    /// An execution id: list those started before it (the previous page's `next_cursor`).
    #[serde(default)]
    pub starting_after: Option<String>,
}

/// `POST /sandboxes/{id}/fork` body and `fork_sandbox` input.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ForkSandbox {
    /// How many copies, 1..10 (default 1).
    #[serde(default)]
    pub count: Option<u32>,
    /// Lifetime of each copy in minutes (default: the service's default).
    #[serde(default)]
    pub timeout_minutes: Option<u32>,
}

/// What a fork made: the snapshot, and the sandboxes started from it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Fork {
    pub snapshot: Snapshot,
    pub sandboxes: Vec<Sandbox>,
}

/// `POST /sandboxes/{id}/restore` body and `restore_sandbox` input.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RestoreSandbox {
    /// A snapshot of this sandbox, or of a sandbox it was started from.
    pub snapshot_id: String,
}

/// `GET /sandboxes` query and `list_sandboxes` input.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ListSandboxes {
    /// 1..100, default 20.
    #[serde(default)]
    pub limit: Option<u32>,
    /// A sandbox id: list those created before it (the previous page's `next_cursor`).
    #[serde(default)]
    pub starting_after: Option<String>,
    /// Also list deleted and failed sandboxes.
    #[serde(default)]
    pub include_deleted: Option<bool>,
}

/// A page of a list.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct List<T> {
    /// Always `"list"`.
    pub object: String,
    pub data: Vec<T>,
    pub has_more: bool,
    pub next_cursor: Option<String>,
}

impl<T> List<T> {
    pub fn new(data: Vec<T>, has_more: bool, next_cursor: Option<String>) -> Self {
        List {
            object: "list".into(),
            data,
            has_more,
            next_cursor,
        }
    }

    /// A page of `data`, followed by more when `has_more`: its cursor is
    /// then the last item's (`cursor_of`), which `starting_after` takes.
    pub fn page(data: Vec<T>, has_more: bool, cursor_of: impl Fn(&T) -> String) -> Self {
        let next = match has_more {
            true => data.last().map(cursor_of),
            false => None,
        };
        List::new(data, has_more, next)
    }
}

/// `POST /sandboxes/{id}/exec` body and `run_command` input (minus the sandbox id).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ExecParams {
    /// Shell command line, run with `bash -c` as the unprivileged user.
    pub command: String,
    /// Kill the command (its whole process group) after this many ms; 1000..600000, default 60000.
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    /// Working directory, relative to /workspace or absolute; default /workspace.
    #[serde(default)]
    pub cwd: Option<String>,
    /// Environment variables exported before the command runs.
    #[serde(default)]
    pub env: Option<BTreeMap<String, String>>,
    /// REST only: answer as a server-sent event stream.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<bool>,
    /// E2B's processes (not part of the REST contract): the command goes
    /// on when its stream is dropped, until it exits, its timeout, or a
    /// signal, and can be listed, attached to and signalled by its pid.
    #[serde(skip)]
    pub keep_running: bool,
    /// E2B's processes: the command gets a stdin pipe (see
    /// `Commands::process_call`) instead of `/dev/null`.
    #[serde(skip)]
    pub stdin: bool,
    /// E2B's terminals: the command runs on a pseudo-terminal of this size
    /// (its output all comes as stdout; input and resizing through
    /// `Commands::process_call`).
    #[serde(skip)]
    pub pty: Option<sandpit_protocol::TerminalSize>,
    /// E2B's processes: where the command runs when it names no `cwd` and
    /// the sandbox's template sets no working directory (E2B's home,
    /// where Sandpit's own default is `/workspace`).
    #[serde(skip)]
    pub default_cwd: Option<String>,
}

/// The execution object.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Execution {
    pub id: String,
    /// Always `"execution"`.
    pub object: String,
    pub sandbox_id: String,
    pub status: ExecutionStatus,
    pub exit_code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    /// Output past 1 MiB per stream was dropped.
    pub truncated: bool,
    pub duration_ms: u64,
    pub started_at: String,
    pub finished_at: Option<String>,
    /// The command's pid in the guest, for a command that keeps running
    /// (E2B's processes; not part of the REST contract).
    #[serde(skip)]
    pub pid: Option<u32>,
    /// The signal that ended it, when one did (its `exit_code` is then 128
    /// plus it); known to the call that ran it, not stored.
    #[serde(skip)]
    pub signal: Option<i32>,
}

/// Content encodings of file content.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema, Default)]
#[serde(rename_all = "lowercase")]
pub enum Encoding {
    #[default]
    Utf8,
    Base64,
}

/// `PUT /sandboxes/{id}/files` body and `write_file` input (minus the sandbox id).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct WriteFile {
    /// Relative to /workspace, or absolute.
    pub path: String,
    pub content: String,
    #[serde(default)]
    pub encoding: Option<Encoding>,
}

/// Answer to a write.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct FileWritten {
    pub path: String,
    pub bytes: u64,
}

/// A file read back.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct FileContent {
    pub path: String,
    pub content: String,
    pub bytes: u64,
    pub encoding: Encoding,
}

/// Type of a listed entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum EntryType {
    File,
    Dir,
    Symlink,
    Other,
}

/// One listed entry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct FileEntry {
    /// Relative to the listed directory.
    pub name: String,
    #[serde(rename = "type")]
    pub kind: EntryType,
    pub size_bytes: u64,
}

/// A directory listing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct FileList {
    pub path: String,
    pub entries: Vec<FileEntry>,
    pub truncated: bool,
}

/// Answer to a delete.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct FileDeleted {
    pub path: String,
    pub deleted: bool,
}

/// A one-use token that opens one sandbox's terminal without an API key,
/// for a browser's WebSocket (which cannot send the key's header).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TerminalToken {
    /// Put in the terminal's URL as `?token=`; works once.
    pub token: String,
    /// After this (a minute after it was made) it opens nothing.
    pub expires_at: String,
    /// The terminal's path with the token, to open as a WebSocket.
    pub url: String,
}

/// An exposed port.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Port {
    pub port: u16,
    pub url: String,
    pub created_at: String,
    /// Served only to requests with the sandbox's traffic token (the
    /// `x-sandpit-traffic-token` header, or a signed URL); anything else
    /// gets 401 before it reaches the sandbox.
    #[serde(default)]
    pub private: bool,
    /// A private port's URL signed for an hour from this answer (open it in
    /// a browser: it keeps working for that preview host until then).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signed_url: Option<String>,
    /// When `signed_url` stops working (RFC 3339 UTC).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signed_url_expires_at: Option<String>,
}

/// A private port's URL signed until a time its owner chose.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct SignedUrl {
    pub url: String,
    /// RFC 3339 UTC.
    pub expires_at: String,
}

/// One sandbox in a usage report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct SandboxUsage {
    pub id: String,
    pub size: String,
    pub seconds: u64,
    pub cost_usd: f64,
    pub created_at: String,
    pub deleted_at: Option<String>,
    /// Bytes clients sent to it through its preview URLs.
    #[serde(default)]
    pub preview_bytes_in: u64,
    /// Bytes it sent back through its preview URLs.
    #[serde(default)]
    pub preview_bytes_out: u64,
    /// What its disk takes (took) on the host, in bytes.
    #[serde(default)]
    pub disk_used_bytes: u64,
}

/// One volume in a usage report: its stored bytes, billed per second it
/// existed within the period.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct VolumeUsage {
    pub id: String,
    pub name: String,
    pub size_gb: u32,
    /// Seconds it existed within the period.
    pub seconds: u64,
    pub cost_usd: f64,
    pub created_at: String,
    pub deleted_at: Option<String>,
}

/// The usage object.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Usage {
    /// Always `"usage"`.
    pub object: String,
    pub credit_remaining_usd: f64,
    pub period_days: u32,
    /// The sandboxes' and the volumes' costs together.
    pub total_cost_usd: f64,
    pub sandboxes: Vec<SandboxUsage>,
    /// The account's volumes that existed within the period. Absent from
    /// older servers.
    #[serde(default)]
    pub volumes: Vec<VolumeUsage>,
}

/// The account object.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Account {
    /// Always `"account"`.
    pub object: String,
    pub id: String,
    pub name: String,
    pub credit_remaining_usd: f64,
    pub max_concurrent_sandboxes: u32,
    pub created_at: String,
    /// What the account's live sandboxes' disks take together, in bytes.
    #[serde(default)]
    pub disk_used_bytes: u64,
}

/// A size with its resources and price.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct SizeInfo {
    pub name: String,
    pub resources: Resources,
    pub price_usd_per_hour: f64,
}

fn default_size_name() -> String {
    "small".into()
}

/// What this service is.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ServiceInfo {
    pub name: String,
    pub version: String,
    /// The commit the server was built from (`unknown` when not known).
    #[serde(default)]
    pub commit: String,
    /// Cheapest first (by price, then vCPUs, memory and disk).
    pub sizes: Vec<SizeInfo>,
    /// The size a create without one gets. Absent from older servers,
    /// whose default was `small`.
    #[serde(default = "default_size_name")]
    pub default_size: String,
    pub default_timeout_minutes: u32,
    pub max_timeout_minutes: u32,
    pub max_lifetime_minutes: u32,
    pub max_concurrent_sandboxes: u32,
    /// `kvm` or `tcg`.
    pub acceleration: String,
    pub hosts: Vec<String>,
    pub authentication: String,
    pub guest: GuestInfo,
    /// How sandboxes start on this host: snapshot restore, warm pool.
    pub fast_start: FastStartInfo,
    /// What one call may ask for and how long it may take. Absent from
    /// older servers, which had the defaults.
    #[serde(default)]
    pub limits: Limits,
    /// Whether this host takes new sandboxes now and what limits it
    /// (memory, CPU budget, kernel limits): a create it would refuse gets
    /// `service_unavailable` with a `Retry-After`. Absent on a server
    /// without VMs of its own (a cluster's replica) and on older servers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<sandpit_host::capacity::CapacityReport>,
}

/// The sizes and times a call is held to, as configured: what the tools'
/// schemas advertise and what the service enforces.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(default)]
pub struct Limits {
    /// `timeout_minutes` of a new sandbox: the default and the most.
    pub default_timeout_minutes: u32,
    pub max_timeout_minutes: u32,
    /// A sandbox lives at most this long from creation, extensions included.
    pub max_lifetime_minutes: u32,
    /// `timeout_ms` of a command: the default, the least and the most.
    pub exec_default_timeout_ms: u64,
    pub exec_min_timeout_ms: u64,
    pub exec_max_timeout_ms: u64,
    /// The longest command, in bytes (Linux's limit on one argument).
    pub max_command_bytes: u64,
    /// All of a command's `env`, in bytes.
    pub max_env_bytes: u64,
    /// Output kept per stream of a command; past it `truncated` is set.
    pub max_output_bytes: u64,
    /// The largest file `read_file` returns and `write_file` takes.
    pub max_read_bytes: u64,
    pub max_write_bytes: u64,
    /// Entries in one listing; past it (or past 512 KiB of names) `truncated` is set.
    pub max_list_entries: u64,
    /// How long the service waits for each answer a sandbox owes it before
    /// the call fails with `service_unavailable`.
    pub reply_deadline_secs: u64,
    /// Connections to the guest one sandbox's preview URLs hold open.
    pub preview_max_connections: u32,
    /// Requests a second one sandbox's preview URLs take (bursts of twice).
    pub preview_requests_per_second: u32,
    /// File reads and writes one account runs at once; more wait, then
    /// get `rate_limited`.
    pub max_concurrent_transfers: u32,
    /// What an account's stored executions may take; past it, its oldest
    /// ended ones are deleted (and their `get` is 404).
    pub execution_storage_bytes: u64,
    /// Days an ended sandbox's executions are kept.
    pub execution_retention_days: u32,
    /// What one account's live sandboxes' disks may take together on the
    /// host (what their guests wrote). At it, no new sandbox starts
    /// (`forbidden`) and the account's sandboxes' disk writes are held to
    /// `over_disk_limit_write_bytes_per_second` until it is back under.
    pub account_disk_bytes: u64,
    /// The write rate of an over-limit account's disks.
    pub over_disk_limit_write_bytes_per_second: u64,
    /// A sandbox unused this long whose guest is idle too is paused, and
    /// resumed by the next call that needs it (0: never).
    pub idle_pause_seconds: u64,
}

/// Linux's limit on one argument of exec (`MAX_ARG_STRLEN` less its NUL):
/// a command is one (`bash -c COMMAND`), each variable one.
pub const MAX_COMMAND_BYTES: u64 = 128 * 1024 - 1;
/// All variables of a command, in bytes: half of `ARG_MAX` (a quarter of the
/// default 8 MiB stack), leaving room for the rest.
pub const MAX_ENV_BYTES: u64 = 512 * 1024;
/// Most bytes fed to a running command's stdin in one call (E2B's
/// `send_stdin`): the agent takes them in frame-sized pieces.
pub const MAX_INPUT_BYTES: u64 = 8 * 1024 * 1024;

/// Snapshot restore and the warm pool, as they stand now.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct FastStartInfo {
    /// New VMs are restored from snapshot templates (else booted).
    pub snapshots: bool,
    /// Ready VMs and the target, per size with a pool.
    pub warm_pool: Vec<WarmPoolInfo>,
}

/// The warm pool of one size.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct WarmPoolInfo {
    pub size: String,
    pub ready: usize,
    pub target: usize,
}

/// What a sandbox looks like from inside.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct GuestInfo {
    pub os: String,
    pub kernel: String,
    pub user: String,
    pub workdir: String,
}

/// Something that happened to a sandbox (`GET /v1/events`): every change
/// of its life, written in the same transaction as the change itself, so
/// the log neither misses one nor tells of one that did not happen.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Event {
    /// Always `"event"`.
    pub object: String,
    /// `evt_…`: the same in the log and in every webhook delivery of it
    /// (the `webhook-id` header), so a receiver can drop a repeat.
    pub id: String,
    /// Its place in the account's log: `after=` this lists what came next.
    pub cursor: String,
    /// `sandbox.created`, `sandbox.started`, `sandbox.paused`,
    /// `sandbox.resumed`, `sandbox.snapshotted`, `sandbox.forked`,
    /// `sandbox.restored`, `sandbox.extended`, `sandbox.shortened`,
    /// `sandbox.moved`,
    /// `sandbox.destroying`, `sandbox.killed`, `sandbox.expired`,
    /// `sandbox.failed` or `sandbox.noted` (see [`EVENT_TYPES`]).
    #[serde(rename = "type")]
    pub kind: String,
    pub sandbox_id: String,
    /// The sandbox's size (`small`, `medium`…).
    pub size: String,
    /// The sandbox's status right after it.
    pub status: String,
    /// Who caused it: `key sp_…` (the API key's prefix), `dashboard`,
    /// `sandbox token`, `the expiry`, `the idle sweep`, `replica <name>`
    /// (a control plane that found its node lost), `node <name>`…
    pub actor: String,
    /// Why, in words (a failure's cause, `expired`, `destroyed`…).
    pub reason: Option<String>,
    /// What else it carries, by type: `from` (`pool`, `template`,
    /// `snapshot`, `cold`) for `started`; `snapshot_id` for `snapshotted`,
    /// `restored`, and a sandbox `created` from a snapshot; `forks` for
    /// `forked` and `forked_from` for a fork's `created`; `expires_at` and
    /// `timeout_minutes` for `extended` and `shortened`; `node` for a
    /// failure because its node was lost; `from`, `to`, `bytes` (what was
    /// carried) and `cut` (the connections closed) for `moved`.
    pub detail: serde_json::Map<String, serde_json::Value>,
    /// RFC 3339 UTC.
    pub at: String,
}

/// Every event type, in a sandbox's usual order.
pub const EVENT_TYPES: &[&str] = &[
    "sandbox.created",
    "sandbox.started",
    "sandbox.paused",
    "sandbox.resumed",
    "sandbox.snapshotted",
    "sandbox.forked",
    "sandbox.restored",
    "sandbox.extended",
    "sandbox.shortened",
    "sandbox.moved",
    "sandbox.noted",
    "sandbox.destroying",
    "sandbox.killed",
    "sandbox.expired",
    "sandbox.failed",
];

/// `GET /v1/events` query and `list_events` input.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ListEvents {
    /// 1..500, default 100.
    #[serde(default)]
    pub limit: Option<u32>,
    /// A cursor (an event's, or the previous page's `next_cursor`): list
    /// what came after it. Absent: from the oldest kept.
    #[serde(default)]
    pub after: Option<String>,
    /// Only this sandbox's (`GET /v1/sandboxes/{id}/events`).
    #[serde(default)]
    pub sandbox_id: Option<String>,
}

/// A URL the account wants its events POSTed to (`/v1/webhooks`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Webhook {
    /// Always `"webhook"`.
    pub object: String,
    /// `wh_…`.
    pub id: String,
    pub url: String,
    /// The event types it gets (see [`EVENT_TYPES`]); `["*"]`: all.
    pub events: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// `whsec_…` + base64 of 32 random bytes: the HMAC-SHA256 key of its
    /// deliveries' `webhook-signature` (Standard Webhooks). Given when it
    /// is created, never again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret: Option<String>,
    /// RFC 3339 UTC.
    pub created_at: String,
    /// Its deliveries by state: how many wait (a first try or a retry),
    /// were delivered, gave up after a day of retries.
    pub pending: u64,
    pub delivered: u64,
    pub failed: u64,
}

/// `POST /v1/webhooks` body and `create_webhook` input.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateWebhook {
    /// `http://` or `https://`; its host must resolve to addresses the
    /// operator allows (by default no loopback, link-local or private
    /// range), checked now and at every delivery.
    pub url: String,
    /// Event types (see [`EVENT_TYPES`]); absent, empty or `["*"]`: all.
    #[serde(default)]
    pub events: Vec<String>,
    #[serde(default)]
    pub description: Option<String>,
}

/// One event's delivery to one webhook, with its attempts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct WebhookDelivery {
    /// Always `"webhook_delivery"`.
    pub object: String,
    /// The event's id (`evt_…`): a webhook gets each event once.
    pub id: String,
    pub webhook_id: String,
    /// The event's type and sandbox.
    pub event_type: String,
    pub sandbox_id: String,
    /// `pending` (waits for its first try or a retry), `delivered` (a 2xx
    /// answer), `failed` (no 2xx in a day of retries).
    pub status: String,
    /// When it is tried next, while `pending`.
    pub next_attempt_at: Option<String>,
    /// Oldest first.
    pub attempts: Vec<DeliveryAttempt>,
    pub created_at: String,
    pub delivered_at: Option<String>,
}

/// One POST of a delivery.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct DeliveryAttempt {
    pub at: String,
    /// The receiver's HTTP status, if it answered.
    pub status_code: Option<u16>,
    /// Why it did not count as delivered: the answer's status, or what
    /// went wrong (refused address, connection, timeout…).
    pub error: Option<String>,
    pub duration_ms: u64,
}

/// `GET /v1/webhooks/{id}/deliveries` query.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ListDeliveries {
    /// 1..100, default 20.
    #[serde(default)]
    pub limit: Option<u32>,
    /// A delivery id: list older ones (the previous page's `next_cursor`).
    #[serde(default)]
    pub starting_after: Option<String>,
}
