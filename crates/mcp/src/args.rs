//! The tools' inputs. Each derives its JSON Schema (the tool's `inputSchema`)
//! and is parsed by the server itself, not by rmcp's `Parameters` extractor,
//! so that a bad argument becomes an `isError` tool result the agent can read
//! and fix instead of a JSON-RPC protocol error it never sees.
//!
//! Unknown fields are refused: an agent that guessed `timeout` instead of
//! `timeout_ms` learns it at once rather than having its value ignored.

use sandpit_core::{
    CreateSandbox, CreateSnapshot, CreateVolume, Encoding, ExecParams, ForkSandbox, ListSandboxes,
    ListSnapshots, NetworkLists, RestoreSandbox, VolumeMount, WriteFile,
};
use schemars::JsonSchema;
use serde::Deserialize;
use std::collections::BTreeMap;

/// `create_sandbox`: what to create.
#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateSandboxArgs {
    /// `small` (default), `medium` or `large`; get_service_info lists the sizes with their vCPUs, memory and price.
    #[serde(default)]
    pub size: Option<String>,
    /// A label of your own, shown in list_sandboxes.
    #[serde(default)]
    pub name: Option<String>,
    /// Lifetime in minutes (default 15; the most is this schema's maximum). The sandbox is destroyed when it runs out; extend_sandbox pushes it out.
    #[serde(default)]
    #[schemars(range(min = 1, max = 1440))]
    pub timeout_minutes: Option<u32>,
    /// Start from this snapshot (`snap_...`, from snapshot_sandbox or list_snapshots) instead of a fresh image: its files, installed packages and running processes, with a fresh identity. The size is the snapshot's (leave size out).
    #[serde(default)]
    pub snapshot_id: Option<String>,
    /// Start from this template (`name` or `name:tag`, from list_templates; built with `sandpit template build`, E2B's Template.build or POST /v1/templates): its packages, files and environment, its server already running. The size is the template's (leave size out).
    #[serde(default)]
    pub template: Option<String>,
    /// What it may reach on the network, beyond the service's usual limits: allow_out and deny_out, IPv4 addresses and prefixes (see update_network). Leave out for the usual network.
    #[serde(default)]
    pub network: Option<NetworkLists>,
    /// Names of the account's secrets to use (stored with `sandpit secret set` or PUT /v1/secrets/NAME). Each becomes an environment variable holding a placeholder, never the value: the service puts the value in for that secret's hosts only, in its header, on the way out over HTTPS. Use the variable as you would the key, e.g. `curl -H "Authorization: Bearer $OPENAI_API_KEY" https://api.openai.com/...`.
    #[serde(default)]
    pub secrets: Vec<String>,
    /// The account's volumes to mount (at most 4; made with create_volume, listed by list_volumes): each `{volume: name or id, path: absolute directory such as /data, read_only: false}`. A volume is written by one sandbox at a time and read by any number; what a sandbox writes there is kept after it ends.
    #[serde(default)]
    pub volumes: Vec<VolumeMount>,
}

impl From<CreateSandboxArgs> for CreateSandbox {
    fn from(a: CreateSandboxArgs) -> Self {
        CreateSandbox {
            size: a.size,
            name: a.name,
            timeout_minutes: a.timeout_minutes,
            snapshot_id: a.snapshot_id,
            template: a.template,
            network: a.network,
            secrets: a.secrets,
            volumes: a.volumes,
            ..CreateSandbox::default()
        }
    }
}

/// `update_network`.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct UpdateNetworkArgs {
    /// The sandbox's id (`sbx_...`); running or paused.
    pub sandbox_id: String,
    /// Destinations it reaches, even inside a prefix of deny_out: IPv4 addresses or prefixes (`203.0.113.7`, `203.0.113.0/24`), at most 256.
    #[serde(default)]
    pub allow_out: Vec<String>,
    /// Destinations refused at once unless in allow_out (`0.0.0.0/0`: everything else), at most 256.
    #[serde(default)]
    pub deny_out: Vec<String>,
}

/// `snapshot_sandbox`.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SnapshotSandboxArgs {
    /// The sandbox's id (`sbx_...`); it must be running.
    pub sandbox_id: String,
    /// A label of your own (e.g. `deps-installed`), shown in list_snapshots.
    #[serde(default)]
    pub name: Option<String>,
}

impl SnapshotSandboxArgs {
    pub fn into_parts(self) -> (String, CreateSnapshot) {
        (self.sandbox_id, CreateSnapshot { name: self.name })
    }
}

/// `fork_sandbox`.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ForkSandboxArgs {
    /// The sandbox to copy (`sbx_...`); it must be running, and runs on unchanged.
    pub sandbox_id: String,
    /// How many copies to make, 1..10 (default 1).
    #[serde(default)]
    #[schemars(range(min = 1, max = 10))]
    pub count: Option<u32>,
    /// Lifetime of each copy in minutes (default 15; the most is this schema's maximum).
    #[serde(default)]
    #[schemars(range(min = 1, max = 1440))]
    pub timeout_minutes: Option<u32>,
}

impl ForkSandboxArgs {
    pub fn into_parts(self) -> (String, ForkSandbox) {
        (
            self.sandbox_id,
            ForkSandbox {
                count: self.count,
                timeout_minutes: self.timeout_minutes,
            },
        )
    }
}

/// `restore_sandbox`.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RestoreSandboxArgs {
    /// The sandbox to roll back (`sbx_...`).
    pub sandbox_id: String,
    /// The snapshot to roll back to (`snap_...`): one taken of this sandbox, or of the sandbox it was created or forked from.
    pub snapshot_id: String,
}

impl RestoreSandboxArgs {
    pub fn into_parts(self) -> (String, RestoreSandbox) {
        (
            self.sandbox_id,
            RestoreSandbox {
                snapshot_id: self.snapshot_id,
            },
        )
    }
}

/// `list_templates`.
#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ListTemplatesArgs {
    /// Every build (building, failed and older versions too), not just the templates a sandbox can start from.
    #[serde(default)]
    pub all_builds: bool,
}

/// `list_snapshots`.
#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ListSnapshotsArgs {
    /// How many to return, 1..100 (default 20).
    #[serde(default)]
    #[schemars(range(min = 1, max = 100))]
    pub limit: Option<u32>,
    /// The previous page's `next_cursor`: list the snapshots taken before that one.
    #[serde(default)]
    pub starting_after: Option<String>,
}

impl From<ListSnapshotsArgs> for ListSnapshots {
    fn from(a: ListSnapshotsArgs) -> Self {
        ListSnapshots {
            limit: a.limit,
            starting_after: a.starting_after,
        }
    }
}

/// A tool that acts on one snapshot and needs nothing else.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SnapshotIdArgs {
    /// The snapshot's id (`snap_...`), as returned by snapshot_sandbox, fork_sandbox or list_snapshots.
    pub snapshot_id: String,
}

/// `create_volume`.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateVolumeArgs {
    /// Its name: 1 to 64 letters, digits, `-` and `_`, unique among the account's volumes.
    pub name: String,
    /// Its size in GiB (default 10; the service's maximum applies, 100 unless configured).
    #[serde(default)]
    #[schemars(range(min = 1))]
    pub size_gb: Option<u32>,
}

impl From<CreateVolumeArgs> for CreateVolume {
    fn from(a: CreateVolumeArgs) -> Self {
        CreateVolume {
            name: a.name,
            size_gb: a.size_gb,
        }
    }
}

/// A tool that acts on one volume and needs nothing else.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct VolumeArgs {
    /// The volume's name or id (`vol_...`), as create_volume or list_volumes returned it.
    pub volume: String,
}

/// A tool that acts on one sandbox and needs nothing else.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SandboxIdArgs {
    /// The sandbox's id (`sbx_...`), as returned by create_sandbox or list_sandboxes.
    pub sandbox_id: String,
}

/// `run_command`.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RunCommandArgs {
    /// The sandbox's id (`sbx_...`).
    pub sandbox_id: String,
    /// A shell command line, run with `bash -c` as the unprivileged user `user`. Pipes, `&&` and redirections work; end with `&` to leave a server running.
    pub command: String,
    /// Kill the command (its whole process group) after this many milliseconds (default 60000; the range is this schema's).
    #[serde(default)]
    #[schemars(range(min = 1000, max = 600000))]
    pub timeout_ms: Option<u64>,
    /// Working directory, relative to /workspace or absolute; default /workspace.
    #[serde(default)]
    pub cwd: Option<String>,
    /// Environment variables exported before the command runs.
    #[serde(default)]
    pub env: Option<BTreeMap<String, String>>,
}

impl RunCommandArgs {
    pub fn into_parts(self) -> (String, ExecParams) {
        (
            self.sandbox_id,
            ExecParams {
                command: self.command,
                timeout_ms: self.timeout_ms,
                cwd: self.cwd,
                env: self.env,
                stream: None,
                ..Default::default()
            },
        )
    }
}

/// `write_file`.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WriteFileArgs {
    /// The sandbox's id (`sbx_...`).
    pub sandbox_id: String,
    /// Relative to /workspace, or absolute. Parent directories are created.
    pub path: String,
    /// The file's content: text as is with `utf8`, or bytes as base64 with `base64`.
    pub content: String,
    /// `utf8` (default) or `base64` (for binary content).
    #[serde(default)]
    pub encoding: Option<Encoding>,
}

impl WriteFileArgs {
    pub fn into_parts(self) -> (String, WriteFile) {
        (
            self.sandbox_id,
            WriteFile {
                path: self.path,
                content: self.content,
                encoding: self.encoding,
            },
        )
    }
}

/// `read_file`.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReadFileArgs {
    /// The sandbox's id (`sbx_...`).
    pub sandbox_id: String,
    /// Relative to /workspace, or absolute.
    pub path: String,
    /// `utf8` (default) or `base64`; use base64 for files that are not UTF-8 text.
    #[serde(default)]
    pub encoding: Option<Encoding>,
}

/// `list_files`.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ListFilesArgs {
    /// The sandbox's id (`sbx_...`).
    pub sandbox_id: String,
    /// Directory to list, relative to /workspace or absolute; default /workspace.
    #[serde(default)]
    pub path: Option<String>,
    /// List the whole tree below `path` (default true), or only its direct entries.
    #[serde(default)]
    pub recursive: Option<bool>,
}

/// `expose_port`.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ExposePortArgs {
    /// The sandbox's id (`sbx_...`).
    pub sandbox_id: String,
    /// The TCP port a server inside the sandbox listens on (localhost is enough), 1..65535.
    #[schemars(range(min = 1, max = 65535))]
    pub port: u16,
    /// true: only requests with the sandbox's traffic_token (header x-sandpit-traffic-token) or the signed_url returned (good for an hour) get through; others get 401. Default false: anyone with the URL.
    #[serde(default)]
    pub private: bool,
}

/// `list_sandboxes`.
#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ListSandboxesArgs {
    /// How many to return, 1..100 (default 20).
    #[serde(default)]
    #[schemars(range(min = 1, max = 100))]
    pub limit: Option<u32>,
    /// The previous page's `next_cursor`: list the sandboxes created before that one.
    #[serde(default)]
    pub starting_after: Option<String>,
    /// Also list deleted and failed sandboxes (default false).
    #[serde(default)]
    pub include_deleted: Option<bool>,
}

impl From<ListSandboxesArgs> for ListSandboxes {
    fn from(a: ListSandboxesArgs) -> Self {
        ListSandboxes {
            limit: a.limit,
            starting_after: a.starting_after,
            include_deleted: a.include_deleted,
        }
    }
}

/// `extend_sandbox`.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ExtendSandboxArgs {
    /// The sandbox's id (`sbx_...`).
    pub sandbox_id: String,
    /// Minutes to add to its expiry (default 15). The total lifetime may not pass the service's max_lifetime_minutes from creation.
    #[serde(default)]
    #[schemars(range(min = 1, max = 1440))]
    pub additional_minutes: Option<u32>,
}

/// `get_usage`.
#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct GetUsageArgs {
    /// How many days of usage to report (default 30).
    #[serde(default)]
    #[schemars(range(min = 1))]
    pub days: Option<u32>,
}

/// `get_service_info` and `list_volumes` take nothing (anything given is
/// ignored).
#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
pub struct NoArgs {}
