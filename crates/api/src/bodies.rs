//! The REST API's own request and answer bodies (the others are the core's
//! objects, served as they are), shared by the handlers and the OpenAPI
//! document.

use sandpit_core::Encoding;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// `POST /sandboxes/{id}/extend` body.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ExtendBody {
    /// Minutes to add to the lifetime (default 15). The total lifetime may not pass 24 h from creation.
    #[serde(default)]
    pub additional_minutes: Option<u32>,
}

/// `POST /sandboxes/{id}/ports` body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ExposePortBody {
    /// The port the server inside the sandbox listens on (localhost is enough), 1..65535.
    pub port: u16,
    /// Serve it only to requests with the sandbox's traffic token (the
    /// `x-sandpit-traffic-token` header, or a signed URL); others get 401
    /// before anything reaches the sandbox. Default false: public.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub private: bool,
}

/// `POST /sandboxes/{id}/ports/{port}/signed-url` body.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SignUrlBody {
    /// How long the URL works, in seconds: 1..604800 (7 days), default 3600.
    #[serde(default)]
    pub expires_in_seconds: Option<u64>,
}

/// Answer to `DELETE /sandboxes/{id}/ports/{port}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct PortClosed {
    pub port: u16,
    /// Always `true`.
    pub closed: bool,
}

/// Query of `GET`/`DELETE /sandboxes/{id}/files`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct FilesQuery {
    /// Relative to /workspace, or absolute. Required to read or delete; listing defaults to /workspace.
    #[serde(default)]
    pub path: Option<String>,
    /// Read: how to return the content (`utf8` default; `base64` for binary files).
    #[serde(default)]
    pub encoding: Option<Encoding>,
    /// `true`: list the directory instead of reading a file.
    #[serde(default)]
    pub list: Option<bool>,
    /// List: descend into subdirectories. Delete: remove a directory and its content. Default false.
    #[serde(default)]
    pub recursive: Option<bool>,
}

/// Query of `/volumes/{volume}/files`: a volume's files, read and
/// written by the host while no sandbox mounts the volume read-write.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct VolumeFilesQuery {
    /// Absolute in the volume (`/` is its root). Required, except to list
    /// (default `/`).
    #[serde(default)]
    pub path: Option<String>,
    /// `GET`: list the directory (`depth` levels down) instead of reading a
    /// file.
    #[serde(default)]
    pub list: Option<bool>,
    /// `GET` with `list`: how many levels down (default 1, at most 32).
    #[serde(default)]
    pub depth: Option<u32>,
    /// `GET`: describe the path (a symbolic link itself) instead of reading it.
    #[serde(default)]
    pub stat: Option<bool>,
    /// `PUT`: replace an existing file (default false: 409 if one is there).
    #[serde(default)]
    pub overwrite: Option<bool>,
    /// `POST` (make a directory): make the missing directories above it too.
    #[serde(default)]
    pub parents: Option<bool>,
    /// `PUT`, `POST`: the owner of what is made (default the sandbox user, 1000).
    #[serde(default)]
    pub uid: Option<u32>,
    #[serde(default)]
    pub gid: Option<u32>,
    /// `PUT`, `POST`: permission bits, decimal or octal with a leading 0
    /// (`0644`, as chmod takes it); default 0644 for a file, 0755 for a
    /// directory.
    #[serde(default)]
    pub mode: Option<String>,
}

/// Query of `GET /usage`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct UsageQuery {
    /// How many days back to report (default 30).
    #[serde(default)]
    pub days: Option<u32>,
}

/// Query of `GET /sandboxes/{id}/events` (the sandbox is the path's).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SandboxEventsQuery {
    /// 1..500, default 100.
    #[serde(default)]
    pub limit: Option<u32>,
    /// A cursor (an event's, or the previous page's `next_cursor`): list
    /// what came after it. Absent: from the oldest kept.
    #[serde(default)]
    pub after: Option<String>,
}
