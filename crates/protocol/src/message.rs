//! The messages of protocol generation 1.
//!
//! Every request carries an `id` chosen by the host; every reply to it carries
//! the same `id`, so many requests (several commands, a file transfer) can be in
//! flight on one connection at once. A request ends with exactly one of
//! [`Message::Done`], [`Message::Exited`] (for [`Message::Exec`]) or
//! [`Message::Error`].

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Request id, chosen by the host, unique per connection.
pub type RequestId = u64;

/// One protocol message (the JSON header of a frame).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Message {
    // ---- host → guest -------------------------------------------------
    /// First message of every connection. `nonce` is echoed in the ack so the
    /// host can skip bytes left over from an earlier connection.
    Hello { protocol: u32, nonce: u64 },
    /// Give the guest its identity, clock and network. The frame body carries
    /// fresh entropy from the host, which the agent adds to the kernel's pool.
    Configure { id: RequestId, config: GuestConfig },
    /// Liveness check; answered with [`Message::Done`] / [`DoneResult::Pong`].
    Ping { id: RequestId },
    /// Run a shell command as the guest user.
    Exec { id: RequestId, request: ExecRequest },
    /// Kill a running command (its whole process group) and report it cancelled.
    Cancel { id: RequestId },
    /// Start writing a file of `size` bytes; the content follows in
    /// [`Message::FileData`] frames with the same id (none when `size` is 0).
    WriteFile {
        id: RequestId,
        path: String,
        size: u64,
        #[serde(default)]
        mode: Option<u32>,
    },
    /// Read a file; answered with [`Message::FileInfo`], then [`Message::FileData`]
    /// frames, then [`Message::Done`] / [`DoneResult::Read`]. With a
    /// `window`, the guest has at most that many bytes of data
    /// unacknowledged ([`Message::FileAck`]); without, it sends all at once.
    /// [`Message::Cancel`] stops it (nothing more is sent for it).
    ReadFile {
        id: RequestId,
        path: String,
        max_bytes: u64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        window: Option<u32>,
    },
    /// The host consumed `bytes` of a read's data: the guest may send that
    /// many more.
    FileAck { id: RequestId, bytes: u32 },
    /// List a directory (or describe one file).
    ListFiles {
        id: RequestId,
        path: String,
        recursive: bool,
        max_entries: u64,
    },
    /// Delete a file, a symlink, an empty directory, or (recursive) a tree.
    DeleteFile {
        id: RequestId,
        path: String,
        recursive: bool,
    },
    /// A file system call on one path or two ([`PathCall`]), as the guest
    /// user; answered with [`Message::Done`] / [`DoneResult::PathInfo`]
    /// describing the path it leaves. Older agents answer `Unsupported`.
    PathCall { id: RequestId, call: PathCall },
    /// Follow a running command by its pid (see [`ExecRequest::keep_running`]):
    /// answered by [`Message::Started`], then its output from then on and
    /// its [`Message::Exited`], as for the [`Message::Exec`] that started
    /// it; or by [`Message::Error`] / [`ErrorKind::NotFound`] when no
    /// command of the agent's has that pid. [`Message::Cancel`] stops
    /// following it (the command goes on). Older agents answer
    /// `Unsupported`.
    ProcessAttach { id: RequestId, pid: u32 },
    /// The commands running now; answered with [`Message::Done`] /
    /// [`DoneResult::Processes`].
    ProcessList { id: RequestId },
    /// The guest's CPU, memory and disk now, as its kernel counts them;
    /// answered with [`Message::Done`] / [`DoneResult::Stats`]. Older
    /// agents answer `Unsupported`.
    Stats { id: RequestId },
    /// Step the guest's clock by `step_ns` (0: leave it) and answer with
    /// its reading after, [`Message::Done`] / [`DoneResult::Clock`]: the
    /// host reads its own clock around the exchange and steps the guest's
    /// when the two differ by more than the exchange can explain (the time
    /// in [`GuestConfig`] arrives late by as long as a busy host delays the
    /// message). Older agents do not list `"clock"` in their features.
    Clock { id: RequestId, step_ns: i64 },
    /// Feed, close or signal a running command ([`ProcessCall`]); answered
    /// with [`Message::Done`] / [`DoneResult::ProcessCalled`], or
    /// [`ErrorKind::NotFound`] when no command has that pid.
    ProcessCall {
        id: RequestId,
        pid: u32,
        call: ProcessCall,
    },
    /// Watch a directory (and, `recursive`, every directory under it, those
    /// made later included) as the guest user: the kernel decides what the
    /// user may watch. Answered by [`Message::Watching`] once the watch is
    /// set, then [`Message::WatchEvents`] as things change, until a
    /// [`Message::Cancel`] ([`Message::Done`] / [`DoneResult::Cancelled`])
    /// or the directory goes ([`Message::Error`] / [`ErrorKind::NotFound`]).
    /// Events the guest's kernel could not queue end it with
    /// [`ErrorKind::TooLarge`]. Older agents do not list `"watch"` in their
    /// features.
    WatchDir {
        id: RequestId,
        path: String,
        recursive: bool,
    },

    /// Mount the volume the host attached to the slot whose block device
    /// has serial `serial` (`sandpit-vol<N>`) at `path` (made if missing),
    /// ext4, `read_only` or read-write, without set-uid programs or
    /// devices; answered with [`Message::Done`] / [`DoneResult::Mounted`]
    /// once mounted, after the device shows the volume's size (the host's
    /// attach reaches the guest as a capacity change). Older agents do not
    /// list `"volumes"` in their features.
    MountVolume {
        id: RequestId,
        serial: String,
        path: String,
        read_only: bool,
    },
    /// Write what the guest holds of the volume mounted at `path` to its
    /// device (`syncfs`), then unmount it when `unmount`; answered with
    /// [`Message::Done`] / [`DoneResult::Synced`]. What a command wrote
    /// there is then in the volume's file on the host.
    SyncVolume {
        id: RequestId,
        path: String,
        unmount: bool,
    },

    /// Sync the disks and power the guest off. The VM then exits; nothing answers.
    PowerOff { id: RequestId },
    /// Open a TCP connection to `port` on the guest's loopback (127.0.0.1,
    /// then ::1). The request id names the stream from then on. Answered by
    /// [`Message::TunnelOpened`], or by [`Message::Error`] with
    /// [`ErrorKind::ConnectionRefused`] (nothing listens) or
    /// [`ErrorKind::TimedOut`]. `window` is how many bytes the guest may send
    /// on this stream before the host acknowledges them ([`Message::TunnelAck`]).
    TunnelOpen {
        id: RequestId,
        port: u16,
        window: u32,
    },

    /// Start an interactive login shell as the guest user on a new
    /// pseudo-terminal of `rows` × `cols`, in /workspace, `TERM` set to
    /// `xterm-256color`. The request id names the terminal's stream from
    /// then on, as a tunnel's: answered by [`Message::TunnelOpened`] (or
    /// [`Message::Error`]), then [`Message::TunnelData`] carries keystrokes
    /// to it and its output back, each direction within its window and
    /// acknowledged by [`Message::TunnelAck`]. A [`Message::TunnelClose`]
    /// from the host hangs the terminal up (its shell gets SIGHUP, then
    /// SIGKILL if it stays). When the shell exits by itself the guest sends
    /// the rest of its output, then [`Message::PtyExited`], the last message
    /// for the id.
    PtyOpen {
        id: RequestId,
        rows: u16,
        cols: u16,
        window: u32,
    },
    /// A terminal's new size; its foreground programs get SIGWINCH.
    PtyResize { id: RequestId, rows: u16, cols: u16 },

    // ---- either direction (tunnels) ------------------------------------
    /// Bytes of a tunnel stream (frame body). The sender never has more
    /// unacknowledged bytes in flight than the window the other side granted.
    TunnelData { id: RequestId },
    /// The receiver consumed `bytes` of the stream's data: the sender may send
    /// that many more.
    TunnelAck { id: RequestId, bytes: u32 },
    /// The sender will send no more data on this stream (a TCP half-close).
    TunnelShutdown { id: RequestId },
    /// The stream is over, in both directions: sent by the host when it is
    /// done with it, by the guest when the connection failed. Needs no answer.
    TunnelClose { id: RequestId },

    // ---- guest → host -------------------------------------------------
    /// Answer to [`Message::Hello`].
    HelloAck {
        protocol: u32,
        nonce: u64,
        agent_version: String,
        kernel_release: String,
        hostname: String,
        /// What this agent can do beyond generation 1 as it was first
        /// frozen ([`FEATURES`]): an agent of an older image lists less,
        /// or nothing (absent), and the host refuses at once, by name,
        /// what it lacks, where the agent would time the request out
        /// (an unknown message's error cannot name its request) or
        /// silently ignore a new field.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        features: Vec<String>,
    },
    /// A command started, or is followed from now on: the first message
    /// for an [`Message::Exec`] with [`ExecRequest::keep_running`] and for
    /// a [`Message::ProcessAttach`]. Not sent for other commands: under
    /// emulation the extra frame cost every command ~0.4 ms.
    Started { id: RequestId, pid: u32 },
    /// Output of a command on stdout (frame body).
    Stdout { id: RequestId },
    /// Output of a command on stderr (frame body).
    Stderr { id: RequestId },
    /// A command ended; the last message for its id.
    Exited { id: RequestId, result: ExecResult },
    /// Size and resolved path of a file about to be sent by [`Message::ReadFile`].
    FileInfo {
        id: RequestId,
        path: String,
        size: u64,
    },
    /// A piece of file content (frame body), in either direction.
    FileData { id: RequestId },
    /// A request succeeded.
    Done { id: RequestId, result: DoneResult },
    /// A request failed. `id` is 0 for errors not tied to a request.
    Error { id: RequestId, error: AgentError },
    /// The guest connected a [`Message::TunnelOpen`]; `window` is how many
    /// bytes the host may send before the guest acknowledges them.
    TunnelOpened { id: RequestId, window: u32 },
    /// A terminal's shell exited (after the last of its output): its exit
    /// code, or the signal that killed it. The last message for the id.
    PtyExited {
        id: RequestId,
        exit_code: Option<i32>,
        signal: Option<i32>,
    },
    /// A [`Message::WatchDir`]'s watch is set: what changes from now on is
    /// reported.
    Watching { id: RequestId, path: String },
    /// What changed in a watched directory, in the order the guest's kernel
    /// reported it.
    WatchEvents {
        id: RequestId,
        events: Vec<WatchEvent>,
    },
}

impl Message {
    /// The request id a message belongs to, if any.
    pub fn request_id(&self) -> Option<RequestId> {
        use Message::*;
        match self {
            Hello { .. } | HelloAck { .. } => None,
            Configure { id, .. }
            | Ping { id }
            | Exec { id, .. }
            | Cancel { id }
            | WriteFile { id, .. }
            | ReadFile { id, .. }
            | FileAck { id, .. }
            | ListFiles { id, .. }
            | DeleteFile { id, .. }
            | PathCall { id, .. }
            | ProcessAttach { id, .. }
            | ProcessList { id }
            | Stats { id }
            | Clock { id, .. }
            | ProcessCall { id, .. }
            | WatchDir { id, .. }
            | Watching { id, .. }
            | WatchEvents { id, .. }
            | MountVolume { id, .. }
            | SyncVolume { id, .. }
            | PowerOff { id }
            | TunnelOpen { id, .. }
            | TunnelData { id }
            | TunnelAck { id, .. }
            | TunnelShutdown { id }
            | TunnelClose { id }
            | TunnelOpened { id, .. }
            | PtyOpen { id, .. }
            | PtyResize { id, .. }
            | PtyExited { id, .. }
            | Started { id, .. }
            | Stdout { id }
            | Stderr { id }
            | Exited { id, .. }
            | FileInfo { id, .. }
            | FileData { id }
            | Done { id, .. }
            | Error { id, .. } => Some(*id),
        }
    }
}

/// What the guest needs to become a particular sandbox.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GuestConfig {
    /// Hostname to set (also written to /etc/hostname).
    pub hostname: String,
    /// 32 lowercase hex digits for /etc/machine-id.
    pub machine_id: String,
    /// The host's wall clock, milliseconds since the Unix epoch, when sent.
    pub time_unix_ms: u64,
    /// Network set-up; `None` leaves the guest without network.
    #[serde(default)]
    pub network: Option<NetworkConfig>,
    /// Most processes the guest user may have at once (fork-bomb guard).
    pub user_pids_max: u32,
    /// Memory kept back from the guest user for the agent and kernel, in MiB.
    pub reserved_memory_mb: u32,
    /// CA certificates the guest trusts besides its own (an operator's
    /// TLS-inspecting proxy), one PEM `CERTIFICATE` block each: added to the
    /// system bundle, which every command is pointed at. Added within
    /// generation 1; absent means none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ca_certificates: Vec<String>,
}

/// Static IPv4 configuration of the guest's one network interface and its
/// egress filter.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NetworkConfig {
    /// Guest address with prefix length, e.g. `10.0.2.15/24`.
    pub address: String,
    /// Default gateway, e.g. `10.0.2.2`.
    pub gateway: String,
    /// Name servers for /etc/resolv.conf.
    pub dns: Vec<String>,
    /// Destinations (CIDRs, IPv4) the guest must never reach. Enforced in the
    /// guest before any user command runs; connections are rejected, not dropped,
    /// so a denied connect fails at once instead of hanging.
    pub deny: Vec<String>,
    /// The sandbox's own allow list (CIDRs, IPv4): let through after `deny`
    /// and before `then_deny`. Added within generation 1; an older agent
    /// ignores it, and the host's guard still enforces the lists (a denied
    /// connect then times out there instead of failing at once).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow: Vec<String>,
    /// The sandbox's own deny list when it has an allow list: rejected after
    /// `allow`. (Without an allow list it is part of `deny`.)
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub then_deny: Vec<String>,
    /// TCP ports let through after `deny` and before the sandbox's own
    /// lists: the host's egress proxy decides their connections by host
    /// name (80 and 443 when the lists name hosts). Added within
    /// generation 1; an older agent ignores it (and then applies no
    /// sandbox list that would need it: see `allow`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub proxied_ports: Vec<u16>,
    /// Interface MTU.
    pub mtu: u32,
    /// The HTTP proxy every command is told to use. Added within generation
    /// 1; absent means none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proxy: Option<ProxyConfig>,
}

/// An HTTP proxy for the guest's commands (`http_proxy`, `https_proxy`,
/// `no_proxy` and their upper-case names). Its address and port are the one
/// destination the egress filter lets through even inside a denied prefix.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProxyConfig {
    /// The value of `http_proxy` and `https_proxy`: `http://ADDRESS:PORT`,
    /// possibly with `user:password@`.
    pub url: String,
    /// The proxy's IP address, as in `url`.
    pub address: String,
    /// The proxy's TCP port, as in `url`.
    pub port: u16,
    /// Hosts, domains and addresses reached without the proxy (`no_proxy`),
    /// the guest's own `localhost` included by the host.
    pub no_proxy: Vec<String>,
}

/// A shell command to run.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ExecRequest {
    /// Passed to `bash -c` (or `sh -c` where bash is absent).
    pub command: String,
    /// Working directory; relative to /workspace or absolute. Default /workspace.
    #[serde(default)]
    pub cwd: Option<String>,
    /// Extra environment, exported before the command runs.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Kill the command's whole process group after this long.
    pub timeout_ms: u64,
    /// Output kept per stream; the rest is read and dropped, and flagged truncated.
    pub max_output_bytes: u64,
    /// The command is not the request's: [`Message::Started`] gives its
    /// pid first, a [`Message::Cancel`] (or the host's connection ending)
    /// only stops its output being sent, and it runs on until it exits,
    /// its timeout, or a signal ([`ProcessCall::Signal`]), followed by
    /// whoever attaches to it ([`Message::ProcessAttach`]). Added within
    /// generation 1; older agents ignore it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub keep_running: bool,
    /// Give the command a pipe for its stdin ([`ProcessCall::Input`],
    /// [`ProcessCall::CloseStdin`]) instead of `/dev/null`. Added within
    /// generation 1.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stdin: bool,
    /// Run it on a new pseudo-terminal of this size instead of pipes: the
    /// terminal is its stdin, stdout and stderr (all output comes as
    /// stdout, as a terminal shows it) and its controlling terminal, input
    /// goes through [`ProcessCall::Input`] as keystrokes, and
    /// [`ProcessCall::Resize`] changes the size. Added within generation 1
    /// (feature `pty`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pty: Option<TerminalSize>,
    /// Run it as root (uid 0, root's home and `PATH`) instead of
    /// [`crate::GUEST_USER`]: a template's build steps, which install
    /// packages, are the one caller (the host sends it for them alone; no
    /// API asks for it). Added within generation 1 (feature `root_exec`): an
    /// older agent would ignore it and run the step as the user, so the
    /// host checks the feature first.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub as_root: bool,
}

/// A terminal's size, in characters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TerminalSize {
    pub rows: u16,
    pub cols: u16,
}

/// How a command ended.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExecResult {
    /// Exit code, when the shell exited normally.
    pub exit_code: Option<i32>,
    /// Signal number, when the shell was killed by one.
    pub signal: Option<i32>,
    /// Killed because it ran past its timeout.
    pub timed_out: bool,
    /// Killed because the host asked ([`Message::Cancel`]) or went away.
    pub cancelled: bool,
    /// Bytes the command wrote to stdout (including dropped ones).
    pub stdout_bytes: u64,
    /// Bytes the command wrote to stderr (including dropped ones).
    pub stderr_bytes: u64,
    /// Some stdout was dropped past `max_output_bytes`.
    pub stdout_truncated: bool,
    /// Some stderr was dropped past `max_output_bytes`.
    pub stderr_truncated: bool,
    /// Wall time from start to exit, in milliseconds.
    pub duration_ms: u64,
    /// The same in microseconds (a `true` takes ~10 ms under emulation,
    /// and what the host adds to it is measured against it). Absent from
    /// older agents.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration_us: Option<u64>,
}

/// The successful outcome of a request other than exec.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum DoneResult {
    Pong,
    Configured,
    Written {
        path: String,
        bytes: u64,
    },
    Read {
        path: String,
        bytes: u64,
    },
    Listing {
        path: String,
        entries: Vec<FileEntry>,
        truncated: bool,
    },
    Deleted {
        path: String,
    },
    Cancelled,
    /// What a [`Message::PathCall`] leaves at its path.
    PathInfo {
        entry: PathEntry,
    },
    /// The commands running now ([`Message::ProcessList`]), oldest first.
    Processes {
        processes: Vec<ProcessInfo>,
    },
    /// A [`Message::ProcessCall`] was done.
    ProcessCalled {
        pid: u32,
    },
    /// The guest's resources now ([`Message::Stats`]).
    Stats {
        stats: GuestStats,
    },
    /// The guest's `CLOCK_REALTIME` after a [`Message::Clock`], in
    /// nanoseconds since the Unix epoch.
    Clock {
        unix_ns: i64,
    },
    /// A [`Message::MountVolume`]'s volume is mounted at `path`, from the
    /// guest's block device `device` (`/dev/vdb`).
    Mounted {
        path: String,
        device: String,
    },
    /// A [`Message::SyncVolume`] is done.
    Synced {
        path: String,
        unmounted: bool,
    },
}

/// One change in a watched directory ([`Message::WatchDir`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WatchEvent {
    /// The entry's path relative to the watched directory (`sub/file.txt`
    /// under a recursive watch).
    pub name: String,
    pub kind: WatchEventKind,
}

/// What happened to a watched entry, as inotify reports it: `Create` (made,
/// or moved in), `Write` (its content changed), `Remove`, `Rename` (moved
/// away, or renamed from this name), `Chmod` (its metadata changed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WatchEventKind {
    Create,
    Write,
    Remove,
    Rename,
    Chmod,
}

/// What the guest's kernel says of its resources at one moment. CPU time is
/// cumulative: the busy share of an interval is the difference of two
/// readings' `cpu_busy_ticks` over that of their `cpu_total_ticks`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuestStats {
    /// CPUs online.
    pub cpu_count: u32,
    /// Clock ticks all CPUs spent on anything but idling and waiting for
    /// I/O since boot (`/proc/stat`'s `cpu` line).
    pub cpu_busy_ticks: u64,
    /// Clock ticks all CPUs spent in all since boot (the same line's first
    /// eight fields; the guest fields are already in user and nice).
    pub cpu_total_ticks: u64,
    /// `MemTotal`, in bytes.
    pub mem_total_bytes: u64,
    /// `MemAvailable`: what could be given to programs without swapping.
    pub mem_available_bytes: u64,
    /// `Cached`: the page cache.
    pub mem_cache_bytes: u64,
    /// The root file system's size and use, as `df /` counts them.
    pub disk_total_bytes: u64,
    pub disk_used_bytes: u64,
}

/// What to do to a running command (see [`Message::ProcessCall`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum ProcessCall {
    /// Write the frame's body to its stdin (which it was given with
    /// [`ExecRequest::stdin`]). A command that does not read within
    /// seconds fails it with [`ErrorKind::TimedOut`].
    Input,
    /// Close its stdin: it reads end of file.
    CloseStdin,
    /// Send `signal` (1 to 31) to its whole process group.
    Signal { signal: i32 },
    /// Set the size of its terminal ([`ExecRequest::pty`]); its
    /// foreground programs get SIGWINCH. A command without one fails it
    /// with [`ErrorKind::InvalidRequest`]. Added within generation 1
    /// (feature `pty`).
    Resize { rows: u16, cols: u16 },
}

/// A running command, as [`Message::ProcessList`] describes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessInfo {
    /// The shell's pid, which leads the command's process group.
    pub pid: u32,
    /// The command line, as given to the shell.
    pub command: String,
    /// Its working directory, resolved.
    pub cwd: String,
    /// The environment the request added.
    pub env: BTreeMap<String, String>,
    /// Whether it outlives its request ([`ExecRequest::keep_running`]).
    pub keep_running: bool,
    /// Whether it has a stdin pipe still open.
    pub stdin: bool,
    /// Whether it runs on a terminal ([`ExecRequest::pty`]). Added within
    /// generation 1 (feature `pty`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub pty: bool,
}

/// A file system call on one path or two (see [`Message::PathCall`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum PathCall {
    /// Describe `path` (a final symlink is described, not followed).
    Stat { path: String },
    /// Make directory `path` and its missing parents; `AlreadyExists` when
    /// something is there.
    MakeDir { path: String },
    /// Rename `from` to `to`, replacing a file there (never a directory).
    Move { from: String, to: String },
}

/// One path described, as `stat(2)` (`lstat`) sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PathEntry {
    /// Its last component.
    pub name: String,
    /// Absolute.
    pub path: String,
    #[serde(rename = "type")]
    pub kind: FileKind,
    pub size_bytes: u64,
    /// The permission bits (`0o7777`).
    pub mode: u32,
    pub owner: String,
    pub group: String,
    /// Last modified, milliseconds since the Unix epoch.
    pub modified_unix_ms: i64,
    /// Where a symlink points.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub symlink_target: Option<String>,
}

/// One entry of a listing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    /// Path relative to the listed directory, `/`-separated.
    pub name: String,
    #[serde(rename = "type")]
    pub kind: FileKind,
    pub size_bytes: u64,
}

/// Type of a directory entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FileKind {
    File,
    Dir,
    Symlink,
    Other,
}

/// A typed failure reported by the agent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{kind}: {message}")]
pub struct AgentError {
    pub kind: ErrorKind,
    pub message: String,
}

impl AgentError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        AgentError {
            kind,
            message: message.into(),
        }
    }
}

/// Stable error kinds; hosts map them to API error types.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    NotFound,
    IsADirectory,
    NotADirectory,
    TooLarge,
    PermissionDenied,
    InvalidPath,
    InvalidRequest,
    Unsupported,
    Io,
    /// Nothing accepts connections on the address (a tunnel's port).
    ConnectionRefused,
    /// An operation gave up after its bound (a tunnel's connect).
    TimedOut,
    /// Something is already there (a directory to make).
    AlreadyExists,
}

impl std::fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = match self {
            ErrorKind::NotFound => "not found",
            ErrorKind::IsADirectory => "is a directory",
            ErrorKind::NotADirectory => "not a directory",
            ErrorKind::TooLarge => "too large",
            ErrorKind::PermissionDenied => "permission denied",
            ErrorKind::InvalidPath => "invalid path",
            ErrorKind::InvalidRequest => "invalid request",
            ErrorKind::Unsupported => "unsupported",
            ErrorKind::Io => "i/o error",
            ErrorKind::ConnectionRefused => "connection refused",
            ErrorKind::TimedOut => "timed out",
            ErrorKind::AlreadyExists => "already exists",
        };
        f.write_str(s)
    }
}

/// Resolve a user-supplied path the way every file and cwd parameter is
/// resolved: relative to /workspace, or absolute; `.` and `..` are folded
/// lexically (no symlinks are followed here); NUL bytes and empty paths are
/// rejected. Permission checks happen in the guest, as the guest user.
pub fn resolve_guest_path(path: &str) -> Result<String, AgentError> {
    if path.is_empty() {
        return Err(AgentError::new(ErrorKind::InvalidPath, "path is empty"));
    }
    if path.contains('\0') {
        return Err(AgentError::new(
            ErrorKind::InvalidPath,
            "path contains a NUL byte",
        ));
    }
    let joined = if path.starts_with('/') {
        path.to_string()
    } else {
        format!("{}/{}", crate::WORKSPACE, path)
    };
    let mut parts: Vec<&str> = Vec::new();
    for part in joined.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            p => parts.push(p),
        }
    }
    Ok(format!("/{}", parts.join("/")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_resolve_against_workspace() {
        assert_eq!(resolve_guest_path("a/b").unwrap(), "/workspace/a/b");
        assert_eq!(resolve_guest_path("/etc/passwd").unwrap(), "/etc/passwd");
        assert_eq!(resolve_guest_path("../x").unwrap(), "/x");
        assert_eq!(resolve_guest_path("/../../").unwrap(), "/");
        assert_eq!(resolve_guest_path("./a//b/.").unwrap(), "/workspace/a/b");
        assert!(resolve_guest_path("").is_err());
        assert!(resolve_guest_path("a\0b").is_err());
    }
}
