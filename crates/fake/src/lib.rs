//! One in-memory fake of [`SandboxApi`], for the adapter tests.
//!
//! # Why it exists
//!
//! The REST adapter (`sandpit-api`) and the MCP adapter (`sandpit-mcp`)
//! translate, nothing more: every decision is the core's. Their tests drive
//! each adapter over its real transport in front of this fake, so both are
//! checked against the *same* behaviour; a fake per adapter would let the
//! two drift apart, each agreeing with a service of its own. The fake
//! follows the real service (`sandpit_core::Service`) where an adapter can
//! see it: the same request checks (it calls the service's own, in
//! `sandpit_core::service`), the same errors and messages, sandboxes per
//! account, a file tree per sandbox, idempotent creates, executions kept for
//! `get_execution`, cancellation when an [`ExecStream`] is dropped.
//!
//! A fake is for adapter unit tests only. It proves nothing about the
//! service itself: the real one, with real VMs, is proven by the VM tests in
//! `crates/cli/tests` (and `crates/core/tests`).
//!
//! # What it is
//!
//! * Two accounts, [`ACCOUNT_A`] and [`ACCOUNT_B`], with keys [`KEY_A`] and
//!   [`KEY_B`]; a credit of $9.50 each that nothing charges.
//! * No sandboxes until created (or put there with [`Fake::add_sandbox`]).
//!   A new sandbox is running at once.
//! * Snapshots hold a copy of their sandbox's file tree (nothing else of a
//!   guest exists here): a sandbox created from one, or forked, starts with
//!   that tree, and a restore puts it back. A snapshot is `ready` at once,
//!   its `size_bytes` the sum of its files. `delete_snapshot` answers with
//!   it as `deleted`; from then on it is `not_found`, like a missing one (as
//!   the service's), though sandboxes still descend from it. A restore
//!   takes a snapshot of the sandbox itself or of one it descends from
//!   (through `create` from a snapshot or a fork).
//! * A clock stopped at [`T0`]: every timestamp is `T0`, except a sandbox's
//!   `expires_at` (`T0` plus its timeout).
//! * The service's default configuration ([`ServiceConfig::default`]) with
//!   preview URLs `https://{port}-{id}.sandpit.test`; change it with
//!   [`Fake::configure`] (`service_info`'s limits follow it).
//! * A guest that knows a few commands ([`exec`](SandboxApi::exec) and
//!   [`exec_stream`](SandboxApi::exec_stream) run them alike: `exec` answers
//!   with what the stream would have ended with, as the service's does):
//!
//!   | command   | output events                                   | end |
//!   |-----------|-------------------------------------------------|-----|
//!   | `make`    | stdout `hello `, stderr `warning\n`, stdout `world\n` | completed, exit 0 |
//!   | `sleep N` | none                                            | timed out when N s reach `timeout_ms`, else completed |
//!   | `hang`    | stdout `started\n`                              | runs until cancelled (the stream or the `exec` call dropped), or timed out at `timeout_ms` |
//!   | `crash`   | stdout `partial`                                | the VM is lost: an [`ExecEvent::Error`] (`service_unavailable`), or `exec`'s error |
//!   | `vanish`  | stderr `bye`                                    | none: the stream just ends (a backend bug an adapter must report) |
//!   | any other | stdout `ran {command}\n`                        | completed, exit 0 |
//!
//! # Knobs
//!
//! * [`Fake::calls`]: every account-scoped operation, in order, with its
//!   caller and arguments (`authenticate` and `service_info` are not
//!   recorded: they act for no account).
//! * [`Fake::fail_next`]: the next call of an operation fails with a given
//!   error, or panics, before it does anything.
//! * [`Fake::wait_cancelled`]: how many running commands were cancelled.

use async_trait::async_trait;
use base64::Engine;
use sandpit_core::config::ServiceConfig;
use sandpit_core::error::Result;
use sandpit_core::model::{FastStartInfo, Limits, WarmPoolInfo};
use sandpit_core::service::{
    check_create, check_path, check_port, extension_minutes, validate_exec, write_content,
};
use sandpit_core::*;
use sandpit_host::ids::{new_id, rfc3339};
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use time::OffsetDateTime;
use tokio::sync::{mpsc, oneshot, Notify};

/// Account A's API key.
pub const KEY_A: &str = "sk_test_a";
pub const ACCOUNT_A: &str = "acct_a";
/// Account B's API key.
pub const KEY_B: &str = "sk_test_b";
pub const ACCOUNT_B: &str = "acct_b";
/// The fake's clock, which never moves.
pub const T0: &str = "2026-01-01T00:00:00Z";
const T0_TIME: OffsetDateTime = time::macros::datetime!(2026-01-01 0:00 UTC);

/// (key, account id, account name).
const ACCOUNTS: [(&str, &str, &str); 2] = [
    (KEY_A, ACCOUNT_A, "Account A"),
    (KEY_B, ACCOUNT_B, "Account B"),
];
const CREDIT_USD: f64 = 9.5;
/// A killed command's exit code: 128 + SIGKILL, as the service reports it.
const KILLED: i32 = 128 + 9;

/// The names of the operations [`Fake::calls`] records and
/// [`Fake::fail_next`] takes: [`SandboxApi`]'s methods that act for an
/// account.
pub const OPERATIONS: [&str; 25] = [
    "create_sandbox",
    "get_sandbox",
    "list_sandboxes",
    "extend_sandbox",
    "destroy_sandbox",
    "snapshot_sandbox",
    "get_snapshot",
    "list_snapshots",
    "delete_snapshot",
    "fork_sandbox",
    "restore_sandbox",
    "pause_sandbox",
    "resume_sandbox",
    "exec",
    "exec_stream",
    "get_execution",
    "write_file",
    "read_file",
    "list_files",
    "delete_file",
    "expose_port",
    "list_ports",
    "close_port",
    "usage",
    "account",
];

/// One call of an operation, as the fake received it.
#[derive(Debug, Clone, PartialEq)]
pub struct Call {
    /// The caller's account.
    pub account_id: String,
    pub op: Op,
}

/// An operation and its arguments.
#[derive(Debug, Clone, PartialEq)]
pub enum Op {
    CreateSandbox {
        req: CreateSandbox,
        idempotency_key: Option<String>,
    },
    GetSandbox {
        id: String,
    },
    ListSandboxes {
        query: ListSandboxes,
    },
    ExtendSandbox {
        id: String,
        additional_minutes: Option<u32>,
    },
    DestroySandbox {
        id: String,
    },
    SnapshotSandbox {
        id: String,
        req: CreateSnapshot,
        idempotency_key: Option<String>,
    },
    GetSnapshot {
        id: String,
    },
    ListSnapshots {
        query: ListSnapshots,
    },
    DeleteSnapshot {
        id: String,
    },
    ForkSandbox {
        id: String,
        req: ForkSandbox,
    },
    RestoreSandbox {
        id: String,
        req: RestoreSandbox,
    },
    PauseSandbox {
        id: String,
    },
    ResumeSandbox {
        id: String,
    },
    Exec {
        id: String,
        params: ExecParams,
    },
    ExecStream {
        id: String,
        params: ExecParams,
    },
    GetExecution {
        id: String,
    },
    /// The content is left out (it may be 32 MiB).
    WriteFile {
        id: String,
        path: String,
        encoding: Option<Encoding>,
    },
    ReadFile {
        id: String,
        path: String,
        encoding: Encoding,
    },
    ListFiles {
        id: String,
        path: Option<String>,
        recursive: bool,
    },
    DeleteFile {
        id: String,
        path: String,
        recursive: bool,
    },
    ExposePort {
        id: String,
        port: u16,
    },
    ListPorts {
        id: String,
    },
    ClosePort {
        id: String,
        port: u16,
    },
    Usage {
        days: Option<u32>,
    },
    Account,
}

impl Op {
    /// The operation's name: its [`SandboxApi`] method's.
    pub fn name(&self) -> &'static str {
        match self {
            Op::CreateSandbox { .. } => "create_sandbox",
            Op::GetSandbox { .. } => "get_sandbox",
            Op::ListSandboxes { .. } => "list_sandboxes",
            Op::ExtendSandbox { .. } => "extend_sandbox",
            Op::DestroySandbox { .. } => "destroy_sandbox",
            Op::SnapshotSandbox { .. } => "snapshot_sandbox",
            Op::GetSnapshot { .. } => "get_snapshot",
            Op::ListSnapshots { .. } => "list_snapshots",
            Op::DeleteSnapshot { .. } => "delete_snapshot",
            Op::ForkSandbox { .. } => "fork_sandbox",
            Op::RestoreSandbox { .. } => "restore_sandbox",
            Op::PauseSandbox { .. } => "pause_sandbox",
            Op::ResumeSandbox { .. } => "resume_sandbox",
            Op::Exec { .. } => "exec",
            Op::ExecStream { .. } => "exec_stream",
            Op::GetExecution { .. } => "get_execution",
            Op::WriteFile { .. } => "write_file",
            Op::ReadFile { .. } => "read_file",
            Op::ListFiles { .. } => "list_files",
            Op::DeleteFile { .. } => "delete_file",
            Op::ExposePort { .. } => "expose_port",
            Op::ListPorts { .. } => "list_ports",
            Op::ClosePort { .. } => "close_port",
            Op::Usage { .. } => "usage",
            Op::Account => "account",
        }
    }
}

/// What an operation does instead of its work ([`Fake::fail_next`]).
#[derive(Debug, Clone)]
pub enum Fault {
    /// Return this error.
    Fail(CoreError),
    /// Panic (a bug in the core, as an adapter sees one).
    Panic,
}

impl From<CoreError> for Fault {
    fn from(e: CoreError) -> Self {
        Fault::Fail(e)
    }
}

/// A sandbox and what its guest holds.
struct Held {
    account_id: String,
    sandbox: Sandbox,
    /// Regular files by absolute path.
    files: BTreeMap<String, Vec<u8>>,
    /// Directories by absolute path (`/` included).
    dirs: BTreeSet<String>,
    ports: Vec<Port>,
    /// The snapshot it was started from (`None`: from the image).
    snapshot_id: Option<String>,
}

/// A snapshot and the file tree it saved.
struct HeldSnapshot {
    account_id: String,
    snapshot: Snapshot,
    files: BTreeMap<String, Vec<u8>>,
    dirs: BTreeSet<String>,
}

/// What a create asks for once its defaults are filled in: size, name,
/// timeout, snapshot (what the service compares a retried
/// `Idempotency-Key`'s by).
type Asked = (String, Option<String>, u32, Option<String>);

/// What a snapshot asks for: the sandbox and the name (what a retried
/// `Idempotency-Key`'s is compared by).
type SnapshotAsked = (String, Option<String>);

#[derive(Default)]
struct State {
    /// Oldest first.
    sandboxes: Vec<Held>,
    /// Oldest first.
    snapshots: Vec<HeldSnapshot>,
    /// (account, key) -> (what the first request asked for, sandbox id).
    idempotency: HashMap<(String, String), (Asked, String)>,
    /// (account, key) -> ((sandbox id, name), snapshot id): snapshots'
    /// keys, apart from creates'.
    snapshot_keys: HashMap<(String, String), (SnapshotAsked, String)>,
    /// id -> (account, execution).
    executions: HashMap<String, (String, Execution)>,
}

impl State {
    fn held(&mut self, caller: &Caller, id: &str) -> Result<&mut Held> {
        self.sandboxes
            .iter_mut()
            .find(|h| h.account_id == caller.account_id && h.sandbox.id == id)
            .ok_or_else(|| CoreError::not_found("sandbox", id))
    }

    /// A running sandbox of the caller, or why it cannot be used (the
    /// service's words).
    /// A running sandbox of the caller's; a paused one is resumed, as the
    /// service does for every call that needs its VM.
    fn running(&mut self, caller: &Caller, id: &str) -> Result<&mut Held> {
        let h = self.held(caller, id)?;
        if h.sandbox.status == SandboxStatus::Paused {
            h.sandbox.status = SandboxStatus::Running;
        }
        let s = &h.sandbox;
        if s.status != SandboxStatus::Running {
            let why = s
                .deleted_reason
                .as_deref()
                .map(|r| format!(" ({r})"))
                .unwrap_or_default();
            return Err(CoreError::conflict(format!(
                "sandbox {} is {}{why}; create a new one",
                s.id,
                s.status.as_str()
            )));
        }
        Ok(h)
    }

    /// A snapshot of the caller's; another account's, or a deleted one, is
    /// `not_found` like a missing one.
    fn snapshot(&mut self, caller: &Caller, id: &str) -> Result<&mut HeldSnapshot> {
        self.snapshots
            .iter_mut()
            .find(|h| {
                h.account_id == caller.account_id
                    && h.snapshot.id == id
                    && h.snapshot.status != "deleted"
            })
            .ok_or_else(|| CoreError::not_found("snapshot", id))
    }

    /// A snapshot of the caller's that can be started from.
    fn ready_snapshot(&mut self, caller: &Caller, id: &str) -> Result<&mut HeldSnapshot> {
        let h = self.snapshot(caller, id)?;
        if h.snapshot.status != "ready" {
            return Err(CoreError::conflict(format!(
                "snapshot {id} is still being written; retry when it is ready"
            ))
            .with_retry_after(1));
        }
        Ok(h)
    }

    /// Save the file tree of the caller's running sandbox `id` as a new
    /// snapshot; returns it.
    fn take_snapshot(
        &mut self,
        caller: &Caller,
        id: &str,
        name: Option<String>,
        retention_days: u32,
    ) -> Result<Snapshot> {
        let h = self.running(caller, id)?;
        let snapshot = Snapshot {
            id: new_id("snap_"),
            object: "snapshot".into(),
            name,
            sandbox_id: h.sandbox.id.clone(),
            size: h.sandbox.size.clone(),
            status: "ready".into(),
            size_bytes: h.files.values().map(|b| b.len() as u64).sum(),
            created_at: T0.into(),
            expires_at: rfc3339(T0_TIME + time::Duration::days(retention_days.into())),
        };
        let held = HeldSnapshot {
            account_id: caller.account_id.clone(),
            snapshot: snapshot.clone(),
            files: h.files.clone(),
            dirs: h.dirs.clone(),
        };
        self.snapshots.push(held);
        Ok(snapshot)
    }

    /// The snapshots the sandbox `id` may be restored to: its own, and
    /// those of the sandboxes it was started from, all the way up.
    fn lineage(&self, caller: &Caller, id: &str) -> BTreeSet<String> {
        let mut ancestors = BTreeSet::new();
        let mut at = Some(id.to_owned());
        while let Some(sbx) = at.take() {
            if !ancestors.insert(sbx.clone()) {
                break;
            }
            at = self
                .sandboxes
                .iter()
                .find(|h| h.account_id == caller.account_id && h.sandbox.id == sbx)
                .and_then(|h| h.snapshot_id.as_deref())
                .and_then(|snap| self.snapshots.iter().find(|s| s.snapshot.id == snap))
                .map(|s| s.snapshot.sandbox_id.clone());
        }
        ancestors
    }
}

#[derive(Default)]
struct Cancels {
    count: AtomicUsize,
    seen: Notify,
}

/// The fake. Cheap to make: one per test.
pub struct Fake {
    config: Mutex<ServiceConfig>,
    state: Arc<Mutex<State>>,
    calls: Mutex<Vec<Call>>,
    faults: Mutex<VecDeque<(&'static str, Fault)>>,
    cancels: Arc<Cancels>,
}

impl Fake {
    /// Accounts A and B, no sandboxes.
    pub fn new() -> Arc<Fake> {
        let config = ServiceConfig {
            preview_scheme: "https".into(),
            preview_domain: "sandpit.test".into(),
            ..ServiceConfig::default()
        };
        Arc::new(Fake {
            config: Mutex::new(config),
            state: Arc::default(),
            calls: Mutex::default(),
            faults: Mutex::default(),
            cancels: Arc::default(),
        })
    }

    /// Put a running sandbox of the default size and timeout with this id
    /// in `account_id` (for tests that name a sandbox before any create).
    pub fn add_sandbox(&self, account_id: &str, id: &str) -> Sandbox {
        let config = self.config();
        let size = config.default_size.clone();
        let timeout = config.default_timeout_minutes;
        let s = new_sandbox(&config, id.to_owned(), None, &size, timeout);
        self.state
            .lock()
            .unwrap()
            .sandboxes
            .push(Held::new(account_id, s.clone()));
        s
    }

    /// Change the service configuration the fake checks requests against
    /// and describes in `service_info`.
    pub fn configure(&self, f: impl FnOnce(&mut ServiceConfig)) {
        f(&mut self.config.lock().unwrap());
    }

    /// The next call of `operation` (one of [`OPERATIONS`]) is recorded,
    /// then fails with `fault` before doing anything. Faults of one
    /// operation are used in the order they were given.
    pub fn fail_next(&self, operation: &'static str, fault: impl Into<Fault>) {
        assert!(
            OPERATIONS.contains(&operation),
            "{operation:?} is not one of {OPERATIONS:?}"
        );
        self.faults
            .lock()
            .unwrap()
            .push_back((operation, fault.into()));
    }

    /// Every call so far, oldest first.
    pub fn calls(&self) -> Vec<Call> {
        self.calls.lock().unwrap().clone()
    }

    /// The names of the operations called so far, oldest first.
    pub fn call_names(&self) -> Vec<&'static str> {
        self.calls
            .lock()
            .unwrap()
            .iter()
            .map(|c| c.op.name())
            .collect()
    }

    /// What the last `exec` or `exec_stream` was asked to run.
    pub fn last_exec(&self) -> Option<ExecParams> {
        self.calls
            .lock()
            .unwrap()
            .iter()
            .rev()
            .find_map(|c| match &c.op {
                Op::Exec { params, .. } | Op::ExecStream { params, .. } => Some(params.clone()),
                _ => None,
            })
    }

    /// The `Idempotency-Key` of the last `create_sandbox` (`None`: no
    /// create yet; `Some(None)`: the last one had none).
    pub fn last_idempotency_key(&self) -> Option<Option<String>> {
        self.calls
            .lock()
            .unwrap()
            .iter()
            .rev()
            .find_map(|c| match &c.op {
                Op::CreateSandbox {
                    idempotency_key, ..
                } => Some(idempotency_key.clone()),
                _ => None,
            })
    }

    /// Commands cancelled while they ran.
    pub fn cancelled(&self) -> usize {
        self.cancels.count.load(Ordering::SeqCst)
    }

    /// Wait until `n` running commands were cancelled; panics after `within`.
    pub async fn wait_cancelled(&self, n: usize, within: Duration) {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let seen = self.cancels.seen.notified();
            if self.cancelled() >= n {
                return;
            }
            if tokio::time::timeout_at(deadline, seen).await.is_err() {
                panic!(
                    "only {} of {n} commands were cancelled within {within:?}",
                    self.cancelled()
                );
            }
        }
    }

    fn config(&self) -> ServiceConfig {
        self.config.lock().unwrap().clone()
    }

    /// Record the call; then its fault, if one is waiting.
    fn begin(&self, caller: &Caller, op: Op) -> Result<()> {
        let name = op.name();
        self.calls.lock().unwrap().push(Call {
            account_id: caller.account_id.clone(),
            op,
        });
        let fault = {
            let mut faults = self.faults.lock().unwrap();
            let at = faults.iter().position(|(o, _)| *o == name);
            at.and_then(|i| faults.remove(i))
        };
        match fault {
            None => Ok(()),
            Some((_, Fault::Fail(e))) => Err(e),
            Some((_, Fault::Panic)) => panic!("the fake panics in {name} on purpose"),
        }
    }

    /// Start a command in a running sandbox: its events on a stream, its
    /// execution recorded (as the service shows one still running: failed,
    /// with no `finished_at`) and updated when it ends.
    fn start(&self, caller: &Caller, id: &str, params: &ExecParams) -> Result<ExecStream> {
        let req = validate_exec(&self.config(), params)?;
        let mut st = self.state.lock().unwrap();
        st.running(caller, id)?;
        let exec = Execution {
            id: new_id("exec_"),
            object: "execution".into(),
            sandbox_id: id.to_owned(),
            status: ExecutionStatus::Failed,
            exit_code: None,
            stdout: String::new(),
            stderr: String::new(),
            truncated: false,
            duration_ms: 0,
            started_at: T0.into(),
            finished_at: None,
        };
        st.executions
            .insert(exec.id.clone(), (caller.account_id.clone(), exec.clone()));
        drop(st);
        let (tx, events) = mpsc::channel(16);
        let (cancel, cancelled) = oneshot::channel();
        let script = Script::of(&req.command, req.timeout_ms);
        tokio::spawn(script.run(
            exec,
            self.state.clone(),
            self.cancels.clone(),
            tx,
            cancelled,
        ));
        Ok(ExecStream {
            events,
            cancel: Some(cancel),
        })
    }
}

impl Held {
    fn new(account_id: &str, sandbox: Sandbox) -> Held {
        Held {
            account_id: account_id.to_owned(),
            sandbox,
            files: BTreeMap::new(),
            dirs: ["/", "/home", "/home/user", "/tmp", "/workspace"]
                .into_iter()
                .map(String::from)
                .collect(),
            ports: Vec::new(),
            snapshot_id: None,
        }
    }

    /// A new sandbox started from a snapshot: the snapshot's file tree.
    fn from_snapshot(account_id: &str, sandbox: Sandbox, snap: &HeldSnapshot) -> Held {
        Held {
            files: snap.files.clone(),
            dirs: snap.dirs.clone(),
            snapshot_id: Some(snap.snapshot.id.clone()),
            ..Held::new(account_id, sandbox)
        }
    }

    /// The entries under directory `dir` (absolute), sorted by name,
    /// relative to it; all of them, or its children only.
    fn entries(&self, dir: &str, recursive: bool) -> Vec<FileEntry> {
        let prefix = if dir == "/" {
            "/".to_owned()
        } else {
            format!("{dir}/")
        };
        let under = |p: &String| {
            p.strip_prefix(&prefix)
                .filter(|rest| !rest.is_empty() && (recursive || !rest.contains('/')))
                .map(str::to_owned)
        };
        let dirs = self.dirs.iter().filter_map(|d| {
            under(d).map(|name| FileEntry {
                name,
                kind: EntryType::Dir,
                size_bytes: 0,
            })
        });
        let files = self.files.iter().filter_map(|(p, bytes)| {
            under(p).map(|name| FileEntry {
                name,
                kind: EntryType::File,
                size_bytes: bytes.len() as u64,
            })
        });
        let mut all: Vec<FileEntry> = dirs.chain(files).collect();
        all.sort_by(|a, b| a.name.cmp(&b.name));
        all
    }
}

/// A path as the guest resolves it (relative to /workspace, `.` and `..`
/// applied).
fn resolve(path: &str) -> Result<String> {
    check_path(path)?;
    sandpit_protocol::resolve_guest_path(path).map_err(|e| CoreError::invalid(e.message))
}

fn no_such_file(path: &str) -> CoreError {
    CoreError::new(
        ErrorType::NotFound,
        format!("{path}: No such file or directory"),
    )
}

fn is_a_directory(path: &str) -> CoreError {
    CoreError::invalid(format!("{path}: Is a directory"))
}

/// The most copies one fork makes.
const MAX_FORKS: u32 = 10;

fn check_snapshot_name(name: Option<&str>) -> Result<()> {
    match name {
        Some(n) if n.chars().count() > 200 => {
            Err(CoreError::invalid("name is at most 200 characters"))
        }
        _ => Ok(()),
    }
}

fn new_sandbox(
    config: &ServiceConfig,
    id: String,
    name: Option<String>,
    size: &str,
    timeout_minutes: u32,
) -> Sandbox {
    let resources = config
        .sizes
        .get(size)
        .unwrap_or_else(|| panic!("no size {size:?} in the fake's configuration"))
        .resources();
    Sandbox {
        id,
        object: "sandbox".into(),
        name,
        status: SandboxStatus::Running,
        size: size.to_owned(),
        resources,
        timeout_minutes,
        created_at: T0.into(),
        ready_at: Some(T0.into()),
        expires_at: expiry(timeout_minutes),
        deleted_at: None,
        deleted_reason: None,
        disk_used_bytes: 0,
    }
}

/// When a sandbox created at `T0` with this timeout expires.
fn expiry(timeout_minutes: u32) -> String {
    rfc3339(T0_TIME + time::Duration::minutes(timeout_minutes.into()))
}

// ---- the guest's commands ------------------------------------------------

enum Output {
    Stdout(String),
    Stderr(String),
}

enum End {
    Exit(i32),
    TimedOut,
    /// Until cancelled, or timed out.
    Hang,
    /// The VM is lost under the command.
    Lost,
    /// The stream ends without an exit.
    Vanish,
}

/// What a command does in the fake's guest (the table in the crate doc).
struct Script {
    output: Vec<Output>,
    end: End,
    timeout: Duration,
}

impl Script {
    fn of(command: &str, timeout_ms: u64) -> Script {
        use Output::*;
        let (output, end) = match command {
            "make" => (
                vec![
                    Stdout("hello ".into()),
                    Stderr("warning\n".into()),
                    Stdout("world\n".into()),
                ],
                End::Exit(0),
            ),
            "hang" => (vec![Stdout("started\n".into())], End::Hang),
            "crash" => (vec![Stdout("partial".into())], End::Lost),
            "vanish" => (vec![Stderr("bye".into())], End::Vanish),
            c => match c.strip_prefix("sleep ").map(|s| s.trim().parse::<u64>()) {
                Some(Ok(secs)) if secs.saturating_mul(1000) >= timeout_ms => {
                    (vec![], End::TimedOut)
                }
                Some(Ok(_)) => (vec![], End::Exit(0)),
                _ => (vec![Stdout(format!("ran {c}\n"))], End::Exit(0)),
            },
        };
        Script {
            output,
            end,
            timeout: Duration::from_millis(timeout_ms),
        }
    }

    /// Send the events, then the end, and record how the command ended.
    async fn run(
        self,
        mut exec: Execution,
        state: Arc<Mutex<State>>,
        cancels: Arc<Cancels>,
        tx: mpsc::Sender<ExecEvent>,
        mut cancel: oneshot::Receiver<()>,
    ) {
        for out in self.output {
            let event = match out {
                Output::Stdout(s) => {
                    exec.stdout.push_str(&s);
                    ExecEvent::Stdout(s)
                }
                Output::Stderr(s) => {
                    exec.stderr.push_str(&s);
                    ExecEvent::Stderr(s)
                }
            };
            let _ = tx.send(event).await;
        }
        let started = tokio::time::Instant::now();
        let mut was_cancelled = false;
        let ended = match self.end {
            End::Exit(code) => Ok((ExecutionStatus::Completed, code)),
            End::TimedOut => Ok((ExecutionStatus::TimedOut, KILLED)),
            End::Hang => {
                tokio::select! {
                    _ = &mut cancel => was_cancelled = true,
                    _ = tx.closed() => was_cancelled = true,
                    _ = tokio::time::sleep(self.timeout) => {}
                }
                match was_cancelled {
                    true => Ok((ExecutionStatus::Cancelled, KILLED)),
                    false => Ok((ExecutionStatus::TimedOut, KILLED)),
                }
            }
            End::Lost => Err(Some(CoreError::new(
                ErrorType::ServiceUnavailable,
                "the host lost the VM",
            ))),
            End::Vanish => Err(None),
        };
        exec.duration_ms = match self.end {
            End::TimedOut => self.timeout.as_millis() as u64,
            _ => 3 + started.elapsed().as_millis() as u64,
        };
        exec.finished_at = Some(T0.into());
        if let Ok((status, code)) = ended {
            exec.status = status;
            exec.exit_code = Some(code);
        }
        if let Some((_, kept)) = state.lock().unwrap().executions.get_mut(&exec.id) {
            *kept = exec.clone();
        }
        if was_cancelled {
            cancels.count.fetch_add(1, Ordering::SeqCst);
            cancels.seen.notify_waiters();
        }
        let last = match ended {
            Ok(_) => ExecEvent::Exit(exec),
            Err(Some(e)) => ExecEvent::Error(e),
            Err(None) => return,
        };
        let _ = tx.send(last).await;
    }
}

// ---- the API ---------------------------------------------------------------

#[async_trait]
impl SandboxApi for Fake {
    async fn authenticate(&self, api_key: &str) -> Result<Caller> {
        ACCOUNTS
            .iter()
            .find(|(key, _, _)| *key == api_key)
            .map(|(_, id, _)| Caller {
                account_id: (*id).to_owned(),
            })
            .ok_or_else(CoreError::unauthorized)
    }

    async fn create_sandbox(
        &self,
        caller: &Caller,
        req: CreateSandbox,
        idempotency_key: Option<String>,
    ) -> Result<(Sandbox, bool)> {
        self.begin(
            caller,
            Op::CreateSandbox {
                req: req.clone(),
                idempotency_key: idempotency_key.clone(),
            },
        )?;
        let config = self.config();
        let mut st = self.state.lock().unwrap();
        // A snapshot sets the size; another size is refused.
        let mut checked = req.clone();
        if let Some(snap) = &req.snapshot_id {
            let size = st.snapshot(caller, snap)?.snapshot.size.clone();
            match &req.size {
                Some(asked) if *asked != size => {
                    return Err(CoreError::invalid(format!(
                        "snapshot {snap} is of a {size} sandbox; leave size out or ask for {size}, not {asked}"
                    )))
                }
                _ => checked.size = Some(size),
            }
        }
        let (size, _, timeout) = check_create(&config, &checked, idempotency_key.as_deref())?;
        let asked = (
            size.clone(),
            req.name.clone(),
            timeout,
            req.snapshot_id.clone(),
        );
        if let Some(key) = &idempotency_key {
            let first = (caller.account_id.clone(), key.clone());
            if let Some((before, id)) = st.idempotency.get(&first).cloned() {
                if before != asked {
                    return Err(CoreError::conflict(
                        "this Idempotency-Key was already used with a different request body",
                    ));
                }
                return Ok((st.held(caller, &id)?.sandbox.clone(), true));
            }
        }
        let s = new_sandbox(&config, new_id("sbx_"), req.name, &size, timeout);
        let held = match &req.snapshot_id {
            Some(snap) => Held::from_snapshot(
                &caller.account_id,
                s.clone(),
                st.ready_snapshot(caller, snap)?,
            ),
            None => Held::new(&caller.account_id, s.clone()),
        };
        st.sandboxes.push(held);
        if let Some(key) = idempotency_key {
            st.idempotency
                .insert((caller.account_id.clone(), key), (asked, s.id.clone()));
        }
        Ok((s, false))
    }

    async fn get_sandbox(&self, caller: &Caller, id: &str) -> Result<Sandbox> {
        self.begin(caller, Op::GetSandbox { id: id.into() })?;
        Ok(self.state.lock().unwrap().held(caller, id)?.sandbox.clone())
    }

    async fn list_sandboxes(&self, caller: &Caller, q: ListSandboxes) -> Result<List<Sandbox>> {
        self.begin(caller, Op::ListSandboxes { query: q.clone() })?;
        let limit = q.limit.unwrap_or(20);
        if !(1..=100).contains(&limit) {
            return Err(CoreError::invalid(format!(
                "limit must be between 1 and 100, not {limit}"
            )));
        }
        let mut st = self.state.lock().unwrap();
        if let Some(c) = &q.starting_after {
            if st.held(caller, c).is_err() {
                return Err(CoreError::invalid(format!(
                    "starting_after {c:?} is not a sandbox of this account"
                )));
            }
        }
        let mut newest_first = st
            .sandboxes
            .iter()
            .rev()
            .filter(|h| h.account_id == caller.account_id)
            .map(|h| &h.sandbox);
        if let Some(c) = &q.starting_after {
            newest_first.by_ref().find(|s| &s.id == c);
        }
        let mut data: Vec<Sandbox> = newest_first
            .filter(|s| q.include_deleted == Some(true) || s.status.is_live())
            .take(limit as usize + 1)
            .cloned()
            .collect();
        let has_more = data.len() > limit as usize;
        data.truncate(limit as usize);
        let next = match has_more {
            true => data.last().map(|s| s.id.clone()),
            false => None,
        };
        Ok(List::new(data, has_more, next))
    }

    async fn extend_sandbox(
        &self,
        caller: &Caller,
        id: &str,
        additional_minutes: Option<u32>,
    ) -> Result<Sandbox> {
        self.begin(
            caller,
            Op::ExtendSandbox {
                id: id.into(),
                additional_minutes,
            },
        )?;
        let config = self.config();
        let add = extension_minutes(&config, additional_minutes)?;
        let mut st = self.state.lock().unwrap();
        let s = &mut st.held(caller, id)?.sandbox;
        let total = u64::from(s.timeout_minutes) + u64::from(add);
        if total > u64::from(config.max_lifetime_minutes) {
            return Err(CoreError::invalid(format!(
                "a sandbox may live at most {} minutes from creation; it has {} and asked for {add} more",
                config.max_lifetime_minutes, s.timeout_minutes
            )));
        }
        if !s.status.is_live() {
            return Err(CoreError::conflict(format!(
                "sandbox {id} is {}; only a running sandbox can be extended",
                s.status.as_str()
            )));
        }
        s.timeout_minutes = total as u32;
        s.expires_at = expiry(s.timeout_minutes);
        Ok(s.clone())
    }

    async fn destroy_sandbox(&self, caller: &Caller, id: &str) -> Result<Sandbox> {
        self.begin(caller, Op::DestroySandbox { id: id.into() })?;
        let mut st = self.state.lock().unwrap();
        let s = &mut st.held(caller, id)?.sandbox;
        if s.status.is_live() {
            s.status = SandboxStatus::Deleted;
            s.deleted_at = Some(T0.into());
            s.deleted_reason = Some("destroyed".into());
        }
        Ok(s.clone())
    }

    async fn snapshot_sandbox(
        &self,
        caller: &Caller,
        id: &str,
        req: CreateSnapshot,
        idempotency_key: Option<String>,
    ) -> Result<(Snapshot, bool)> {
        self.begin(
            caller,
            Op::SnapshotSandbox {
                id: id.into(),
                req: req.clone(),
                idempotency_key: idempotency_key.clone(),
            },
        )?;
        check_snapshot_name(req.name.as_deref())?;
        let config = self.config();
        let mut st = self.state.lock().unwrap();
        let asked = (id.to_owned(), req.name.clone());
        if let Some(key) = &idempotency_key {
            if key.is_empty() || key.len() > 255 {
                return Err(CoreError::invalid(
                    "Idempotency-Key must be 1 to 255 characters",
                ));
            }
            let first = (caller.account_id.clone(), key.clone());
            if let Some((before, snap)) = st.snapshot_keys.get(&first).cloned() {
                if before != asked {
                    return Err(CoreError::conflict(
                        "this Idempotency-Key was already used with a different request",
                    ));
                }
                return Ok((st.snapshot(caller, &snap)?.snapshot.clone(), true));
            }
        }
        let snap = st.take_snapshot(caller, id, req.name, config.snapshot_retention_days)?;
        if let Some(key) = idempotency_key {
            st.snapshot_keys
                .insert((caller.account_id.clone(), key), (asked, snap.id.clone()));
        }
        Ok((snap, false))
    }

    async fn get_snapshot(&self, caller: &Caller, snapshot_id: &str) -> Result<Snapshot> {
        self.begin(
            caller,
            Op::GetSnapshot {
                id: snapshot_id.into(),
            },
        )?;
        let mut st = self.state.lock().unwrap();
        Ok(st.snapshot(caller, snapshot_id)?.snapshot.clone())
    }

    async fn list_snapshots(&self, caller: &Caller, q: ListSnapshots) -> Result<List<Snapshot>> {
        self.begin(caller, Op::ListSnapshots { query: q.clone() })?;
        let limit = q.limit.unwrap_or(20);
        if !(1..=100).contains(&limit) {
            return Err(CoreError::invalid(format!(
                "limit must be between 1 and 100, not {limit}"
            )));
        }
        let mut st = self.state.lock().unwrap();
        if let Some(c) = &q.starting_after {
            if st.snapshot(caller, c).is_err() {
                return Err(CoreError::invalid(format!(
                    "starting_after {c:?} is not a snapshot of this account"
                )));
            }
        }
        let mut newest_first = st
            .snapshots
            .iter()
            .rev()
            .filter(|h| h.account_id == caller.account_id)
            .map(|h| &h.snapshot);
        if let Some(c) = &q.starting_after {
            newest_first.by_ref().find(|s| &s.id == c);
        }
        let mut data: Vec<Snapshot> = newest_first
            .filter(|s| s.status != "deleted")
            .take(limit as usize + 1)
            .cloned()
            .collect();
        let has_more = data.len() > limit as usize;
        data.truncate(limit as usize);
        let next = match has_more {
            true => data.last().map(|s| s.id.clone()),
            false => None,
        };
        Ok(List::new(data, has_more, next))
    }

    async fn delete_snapshot(&self, caller: &Caller, snapshot_id: &str) -> Result<Snapshot> {
        self.begin(
            caller,
            Op::DeleteSnapshot {
                id: snapshot_id.into(),
            },
        )?;
        let mut st = self.state.lock().unwrap();
        let h = st.snapshot(caller, snapshot_id)?;
        h.snapshot.status = "deleted".into();
        h.files.clear();
        h.dirs.clear();
        Ok(h.snapshot.clone())
    }

    async fn fork_sandbox(&self, caller: &Caller, id: &str, req: ForkSandbox) -> Result<Fork> {
        self.begin(
            caller,
            Op::ForkSandbox {
                id: id.into(),
                req: req.clone(),
            },
        )?;
        let count = req.count.unwrap_or(1);
        if !(1..=MAX_FORKS).contains(&count) {
            return Err(CoreError::invalid(format!(
                "count must be between 1 and {MAX_FORKS}, not {count}"
            )));
        }
        let config = self.config();
        let mut st = self.state.lock().unwrap();
        let size = st.running(caller, id)?.sandbox.size.clone();
        let each = CreateSandbox {
            size: Some(size.clone()),
            timeout_minutes: req.timeout_minutes,
            ..Default::default()
        };
        let (_, _, timeout) = check_create(&config, &each, None)?;
        let snapshot = st.take_snapshot(caller, id, None, config.snapshot_retention_days)?;
        let mut sandboxes = Vec::new();
        for _ in 0..count {
            let s = new_sandbox(&config, new_id("sbx_"), None, &size, timeout);
            let from = st.ready_snapshot(caller, &snapshot.id)?;
            let held = Held::from_snapshot(&caller.account_id, s.clone(), from);
            st.sandboxes.push(held);
            sandboxes.push(s);
        }
        Ok(Fork {
            snapshot,
            sandboxes,
        })
    }

    async fn restore_sandbox(
        &self,
        caller: &Caller,
        id: &str,
        req: RestoreSandbox,
    ) -> Result<Sandbox> {
        self.begin(
            caller,
            Op::RestoreSandbox {
                id: id.into(),
                req: req.clone(),
            },
        )?;
        let mut st = self.state.lock().unwrap();
        st.running(caller, id)?;
        let lineage = st.lineage(caller, id);
        let snap = st.ready_snapshot(caller, &req.snapshot_id)?;
        if !lineage.contains(&snap.snapshot.sandbox_id) {
            return Err(CoreError::invalid(format!(
                "snapshot {} is of sandbox {}, which {id} was not started from; \
                 create a new sandbox from it instead",
                snap.snapshot.id, snap.snapshot.sandbox_id
            )));
        }
        let (files, dirs, size) = (
            snap.files.clone(),
            snap.dirs.clone(),
            snap.snapshot.size.clone(),
        );
        let h = st.running(caller, id)?;
        if h.sandbox.size != size {
            return Err(CoreError::invalid(format!(
                "snapshot {} is of a {size} sandbox and {id} is {}; restore needs the same size",
                req.snapshot_id, h.sandbox.size
            )));
        }
        h.files = files;
        h.dirs = dirs;
        Ok(h.sandbox.clone())
    }

    async fn pause_sandbox(&self, caller: &Caller, id: &str) -> Result<Sandbox> {
        self.begin(caller, Op::PauseSandbox { id: id.into() })?;
        let mut st = self.state.lock().unwrap();
        let h = st.held(caller, id)?;
        if h.sandbox.status != SandboxStatus::Paused {
            st.running(caller, id)?.sandbox.status = SandboxStatus::Paused;
        }
        Ok(st.held(caller, id)?.sandbox.clone())
    }

    async fn resume_sandbox(&self, caller: &Caller, id: &str) -> Result<Sandbox> {
        self.begin(caller, Op::ResumeSandbox { id: id.into() })?;
        let mut st = self.state.lock().unwrap();
        Ok(st.running(caller, id)?.sandbox.clone())
    }

    async fn exec(&self, caller: &Caller, id: &str, params: ExecParams) -> Result<Execution> {
        self.begin(
            caller,
            Op::Exec {
                id: id.into(),
                params: params.clone(),
            },
        )?;
        // Dropping this call drops the stream, which cancels the command.
        let mut stream = self.start(caller, id, &params)?;
        loop {
            match stream.next().await {
                Some(ExecEvent::Stdout(_) | ExecEvent::Stderr(_)) => {}
                Some(ExecEvent::Exit(exec)) => return Ok(exec),
                Some(ExecEvent::Error(e)) => return Err(e),
                None => {
                    return Err(CoreError::internal(
                        "the command's output ended without an exit",
                    ))
                }
            }
        }
    }

    async fn exec_stream(
        &self,
        caller: &Caller,
        id: &str,
        params: ExecParams,
    ) -> Result<ExecStream> {
        self.begin(
            caller,
            Op::ExecStream {
                id: id.into(),
                params: params.clone(),
            },
        )?;
        self.start(caller, id, &params)
    }

    async fn get_execution(&self, caller: &Caller, exec_id: &str) -> Result<Execution> {
        self.begin(caller, Op::GetExecution { id: exec_id.into() })?;
        match self.state.lock().unwrap().executions.get(exec_id) {
            Some((account, e)) if *account == caller.account_id => Ok(e.clone()),
            _ => Err(CoreError::not_found("execution", exec_id)),
        }
    }

    async fn write_file(&self, caller: &Caller, id: &str, req: WriteFile) -> Result<FileWritten> {
        self.begin(
            caller,
            Op::WriteFile {
                id: id.into(),
                path: req.path.clone(),
                encoding: req.encoding,
            },
        )?;
        let (path, bytes) = write_content(&self.config(), req)?;
        let path = resolve(&path)?;
        let mut st = self.state.lock().unwrap();
        let h = st.running(caller, id)?;
        if h.dirs.contains(&path) {
            return Err(is_a_directory(&path));
        }
        // Its directories are made as needed (mkdir -p), through no file.
        let mut dirs = Vec::new();
        let mut at = path.as_str();
        while let Some((parent, _)) = at.rsplit_once('/') {
            let parent = if parent.is_empty() { "/" } else { parent };
            if h.files.contains_key(parent) {
                return Err(CoreError::invalid(format!(
                    "{parent}: a path component is not a directory"
                )));
            }
            dirs.push(parent.to_owned());
            if parent == "/" {
                break;
            }
            at = parent;
        }
        h.dirs.extend(dirs);
        let n = bytes.len() as u64;
        h.files.insert(path.clone(), bytes);
        Ok(FileWritten { path, bytes: n })
    }

    async fn read_file(
        &self,
        caller: &Caller,
        id: &str,
        path: &str,
        encoding: Encoding,
    ) -> Result<FileContent> {
        self.begin(
            caller,
            Op::ReadFile {
                id: id.into(),
                path: path.into(),
                encoding,
            },
        )?;
        let path = resolve(path)?;
        let mut st = self.state.lock().unwrap();
        let h = st.running(caller, id)?;
        let Some(bytes) = h.files.get(&path) else {
            return Err(match h.dirs.contains(&path) {
                true => is_a_directory(&path),
                false => no_such_file(&path),
            });
        };
        let content = match encoding {
            Encoding::Utf8 => String::from_utf8(bytes.clone()).map_err(|_| {
                CoreError::invalid(format!(
                    "{path} is not valid UTF-8 text; read it with encoding \"base64\""
                ))
            })?,
            Encoding::Base64 => base64::engine::general_purpose::STANDARD.encode(bytes),
        };
        Ok(FileContent {
            bytes: bytes.len() as u64,
            path,
            content,
            encoding,
        })
    }

    async fn list_files(
        &self,
        caller: &Caller,
        id: &str,
        path: Option<&str>,
        recursive: bool,
    ) -> Result<FileList> {
        self.begin(
            caller,
            Op::ListFiles {
                id: id.into(),
                path: path.map(Into::into),
                recursive,
            },
        )?;
        let path = resolve(path.unwrap_or(sandpit_protocol::WORKSPACE))?;
        let mut st = self.state.lock().unwrap();
        let h = st.running(caller, id)?;
        let entries = if h.dirs.contains(&path) {
            h.entries(&path, recursive)
        } else if let Some(bytes) = h.files.get(&path) {
            // A file is listed as itself.
            vec![FileEntry {
                name: path.rsplit('/').next().unwrap_or_default().to_owned(),
                kind: EntryType::File,
                size_bytes: bytes.len() as u64,
            }]
        } else {
            return Err(no_such_file(&path));
        };
        Ok(FileList {
            path,
            entries,
            truncated: false,
        })
    }

    async fn delete_file(
        &self,
        caller: &Caller,
        id: &str,
        path: &str,
        recursive: bool,
    ) -> Result<FileDeleted> {
        self.begin(
            caller,
            Op::DeleteFile {
                id: id.into(),
                path: path.into(),
                recursive,
            },
        )?;
        let path = resolve(path)?;
        let mut st = self.state.lock().unwrap();
        let h = st.running(caller, id)?;
        if path == "/" {
            return Err(CoreError::invalid("refusing to delete /"));
        }
        if h.files.remove(&path).is_none() {
            if !h.dirs.contains(&path) {
                return Err(no_such_file(&path));
            }
            if !recursive && !h.entries(&path, false).is_empty() {
                return Err(CoreError::invalid("directory not empty; pass recursive"));
            }
            let inside = format!("{path}/");
            h.dirs.retain(|d| *d != path && !d.starts_with(&inside));
            h.files.retain(|f, _| !f.starts_with(&inside));
        }
        Ok(FileDeleted {
            path,
            deleted: true,
        })
    }

    async fn expose_port(&self, caller: &Caller, id: &str, port: u16) -> Result<Port> {
        self.begin(
            caller,
            Op::ExposePort {
                id: id.into(),
                port,
            },
        )?;
        check_port(port)?;
        let config = self.config();
        let mut st = self.state.lock().unwrap();
        let h = st.running(caller, id)?;
        if let Some(p) = h.ports.iter().find(|p| p.port == port) {
            return Ok(p.clone());
        }
        let p = Port {
            port,
            url: sandpit_core::preview::preview_url(
                &config.preview_scheme,
                &config.preview_domain,
                port,
                id,
            ),
            created_at: T0.into(),
        };
        h.ports.push(p.clone());
        Ok(p)
    }

    async fn list_ports(&self, caller: &Caller, id: &str) -> Result<List<Port>> {
        self.begin(caller, Op::ListPorts { id: id.into() })?;
        let mut st = self.state.lock().unwrap();
        Ok(List::new(st.held(caller, id)?.ports.clone(), false, None))
    }

    async fn close_port(&self, caller: &Caller, id: &str, port: u16) -> Result<()> {
        self.begin(
            caller,
            Op::ClosePort {
                id: id.into(),
                port,
            },
        )?;
        let mut st = self.state.lock().unwrap();
        let ports = &mut st.held(caller, id)?.ports;
        let before = ports.len();
        ports.retain(|p| p.port != port);
        if ports.len() == before {
            return Err(CoreError::not_found("exposed port", &port.to_string()));
        }
        Ok(())
    }

    async fn usage(&self, caller: &Caller, days: Option<u32>) -> Result<Usage> {
        self.begin(caller, Op::Usage { days })?;
        let days = days.unwrap_or(30);
        if !(1..=366).contains(&days) {
            return Err(CoreError::invalid(format!(
                "days must be between 1 and 366, not {days}"
            )));
        }
        let st = self.state.lock().unwrap();
        // The clock stands still: nothing has run for a second yet.
        let sandboxes = st
            .sandboxes
            .iter()
            .filter(|h| h.account_id == caller.account_id)
            .map(|h| SandboxUsage {
                id: h.sandbox.id.clone(),
                size: h.sandbox.size.clone(),
                seconds: 0,
                cost_usd: 0.0,
                created_at: h.sandbox.created_at.clone(),
                deleted_at: h.sandbox.deleted_at.clone(),
                preview_bytes_in: 0,
                preview_bytes_out: 0,
                disk_used_bytes: 0,
            })
            .collect();
        Ok(Usage {
            object: "usage".into(),
            credit_remaining_usd: CREDIT_USD,
            period_days: days,
            total_cost_usd: 0.0,
            sandboxes,
        })
    }

    async fn account(&self, caller: &Caller) -> Result<Account> {
        self.begin(caller, Op::Account)?;
        let (_, id, name) = ACCOUNTS
            .iter()
            .find(|(_, id, _)| *id == caller.account_id)
            .ok_or_else(CoreError::unauthorized)?;
        Ok(Account {
            object: "account".into(),
            id: (*id).to_owned(),
            name: (*name).to_owned(),
            credit_remaining_usd: CREDIT_USD,
            max_concurrent_sandboxes: self.config().default_max_concurrent_sandboxes,
            created_at: T0.into(),
            disk_used_bytes: 0,
        })
    }

    async fn service_info(&self) -> Result<ServiceInfo> {
        let config = self.config();
        Ok(ServiceInfo {
            name: "sandpit".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            commit: sandpit_core::COMMIT.into(),
            sizes: config
                .sizes
                .iter()
                .map(|(name, s)| SizeInfo {
                    name: name.clone(),
                    resources: s.resources(),
                    price_usd_per_hour: s.price_usd_per_hour,
                })
                .collect(),
            default_timeout_minutes: config.default_timeout_minutes,
            max_timeout_minutes: config.max_timeout_minutes,
            max_lifetime_minutes: config.max_lifetime_minutes,
            max_concurrent_sandboxes: config.default_max_concurrent_sandboxes,
            acceleration: "tcg".into(),
            hosts: vec![config.host_name.clone()],
            authentication: "send the account's API key as `Authorization: Bearer <key>` or \
                             `x-api-key: <key>`; over stdio (`sandpit mcp`) no key is needed"
                .into(),
            guest: GuestInfo {
                os: "Debian GNU/Linux 12 (bookworm)".into(),
                kernel: "6.1.0".into(),
                user: "user (uid 1000), no sudo".into(),
                workdir: sandpit_protocol::WORKSPACE.into(),
            },
            fast_start: FastStartInfo {
                snapshots: true,
                warm_pool: vec![WarmPoolInfo {
                    size: config.default_size.clone(),
                    ready: 2,
                    target: 2,
                }],
            },
            // 30 s: the runtime's reply deadline.
            limits: Limits::of(&config, 30),
            capacity: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a() -> Caller {
        Caller {
            account_id: ACCOUNT_A.into(),
        }
    }

    fn run(command: &str) -> ExecParams {
        ExecParams {
            command: command.into(),
            ..Default::default()
        }
    }

    async fn events(mut s: ExecStream) -> Vec<ExecEvent> {
        let mut all = Vec::new();
        while let Some(e) = s.next().await {
            all.push(e);
        }
        all
    }

    #[tokio::test]
    async fn exec_is_the_stream_collected_and_both_are_kept() {
        let f = Fake::new();
        let (s, _) = f
            .create_sandbox(&a(), Default::default(), None)
            .await
            .unwrap();
        let streamed = events(f.exec_stream(&a(), &s.id, run("make")).await.unwrap()).await;
        let [ExecEvent::Stdout(o1), ExecEvent::Stderr(e1), ExecEvent::Stdout(o2), ExecEvent::Exit(x)] =
            &streamed[..]
        else {
            panic!("{streamed:?}")
        };
        assert_eq!(
            (x.stdout.clone(), x.stderr.clone()),
            (format!("{o1}{o2}"), e1.clone())
        );
        assert_eq!(f.get_execution(&a(), &x.id).await.unwrap(), *x);
        let y = f.exec(&a(), &s.id, run("make")).await.unwrap();
        assert_eq!(
            (&y.stdout, &y.stderr, y.status),
            (&x.stdout, &x.stderr, x.status)
        );
        assert_ne!(y.id, x.id);
        assert_eq!(
            f.call_names(),
            ["create_sandbox", "exec_stream", "get_execution", "exec"]
        );
        assert_eq!(f.last_exec(), Some(run("make")));

        let t = f.exec(&a(), &s.id, run("sleep 61")).await.unwrap();
        assert_eq!(t.status, ExecutionStatus::TimedOut);
        let e = f.exec(&a(), &s.id, run("crash")).await.unwrap_err();
        assert_eq!(e.kind, ErrorType::ServiceUnavailable);
        let e = f.exec(&a(), &s.id, run("vanish")).await.unwrap_err();
        assert_eq!(e.kind, ErrorType::InternalError);
        let e = f.exec(&a(), &s.id, run(" ")).await.unwrap_err();
        assert_eq!(
            e.kind,
            ErrorType::InvalidRequest,
            "the service's own checks"
        );
    }

    #[tokio::test]
    async fn a_dropped_stream_cancels_its_command() {
        let f = Fake::new();
        let s = f.add_sandbox(ACCOUNT_A, "sbx_here");
        let mut st = f.exec_stream(&a(), &s.id, run("hang")).await.unwrap();
        assert_eq!(st.next().await, Some(ExecEvent::Stdout("started\n".into())));
        assert_eq!(f.cancelled(), 0);
        drop(st);
        f.wait_cancelled(1, Duration::from_secs(5)).await;
        let kept = f
            .state
            .lock()
            .unwrap()
            .executions
            .values()
            .next()
            .unwrap()
            .1
            .clone();
        assert_eq!(kept.status, ExecutionStatus::Cancelled);
    }

    #[tokio::test]
    async fn files_are_a_tree_with_directories() {
        let f = Fake::new();
        let s = f.add_sandbox(ACCOUNT_A, "sbx_here");
        let write = |path: &str| WriteFile {
            path: path.into(),
            content: "x".into(),
            encoding: None,
        };
        f.write_file(&a(), &s.id, write("d/e/f.txt")).await.unwrap();
        f.write_file(&a(), &s.id, write("/workspace/g"))
            .await
            .unwrap();
        let names = |l: FileList| -> Vec<(String, EntryType)> {
            l.entries.into_iter().map(|e| (e.name, e.kind)).collect()
        };
        let top = f.list_files(&a(), &s.id, None, false).await.unwrap();
        assert_eq!(top.path, "/workspace");
        assert_eq!(
            names(top),
            [("d".into(), EntryType::Dir), ("g".into(), EntryType::File)]
        );
        let all = f.list_files(&a(), &s.id, Some("d"), true).await.unwrap();
        assert_eq!(
            names(all),
            [
                ("e".into(), EntryType::Dir),
                ("e/f.txt".into(), EntryType::File)
            ]
        );
        let e = f.write_file(&a(), &s.id, write("g/h")).await.unwrap_err();
        assert_eq!(e.kind, ErrorType::InvalidRequest);
        let e = f.delete_file(&a(), &s.id, "d", false).await.unwrap_err();
        assert!(e.message.contains("recursive"), "{e}");
        f.delete_file(&a(), &s.id, "d", true).await.unwrap();
        let e = f
            .read_file(&a(), &s.id, "d/e/f.txt", Encoding::Utf8)
            .await
            .unwrap_err();
        assert_eq!(e.kind, ErrorType::NotFound);
    }

    fn b() -> Caller {
        Caller {
            account_id: ACCOUNT_B.into(),
        }
    }

    async fn read(f: &Fake, id: &str, path: &str) -> Result<String> {
        Ok(f.read_file(&a(), id, path, Encoding::Utf8).await?.content)
    }

    async fn write(f: &Fake, id: &str, path: &str, content: &str) {
        let req = WriteFile {
            path: path.into(),
            content: content.into(),
            encoding: None,
        };
        f.write_file(&a(), id, req).await.unwrap();
    }

    #[tokio::test]
    async fn snapshots_copy_the_file_tree_and_restore_puts_it_back() {
        let f = Fake::new();
        let s = f.add_sandbox(ACCOUNT_A, "sbx_here");
        write(&f, &s.id, "d/state.txt", "before").await;
        let named = CreateSnapshot {
            name: Some("clean".into()),
        };
        let (snap, replayed) = f
            .snapshot_sandbox(&a(), &s.id, named.clone(), Some("k".into()))
            .await
            .unwrap();
        assert!(!replayed);
        assert!(snap.id.starts_with("snap_"), "{}", snap.id);
        assert_eq!(
            (
                snap.status.as_str(),
                snap.size_bytes,
                snap.sandbox_id.as_str()
            ),
            ("ready", 6, "sbx_here")
        );
        assert_eq!(snap.expires_at, "2026-01-08T00:00:00Z");
        let (again, replayed) = f
            .snapshot_sandbox(&a(), &s.id, named, Some("k".into()))
            .await
            .unwrap();
        assert!(replayed);
        assert_eq!(again, snap);
        let e = f
            .snapshot_sandbox(&a(), &s.id, CreateSnapshot::default(), Some("k".into()))
            .await
            .unwrap_err();
        assert_eq!(e.kind, ErrorType::Conflict);

        // A change, undone.
        write(&f, &s.id, "d/state.txt", "after").await;
        write(&f, &s.id, "new.txt", "x").await;
        let req = RestoreSandbox {
            snapshot_id: snap.id.clone(),
        };
        let back = f.restore_sandbox(&a(), &s.id, req.clone()).await.unwrap();
        assert_eq!(back.id, s.id);
        assert_eq!(read(&f, &s.id, "d/state.txt").await.unwrap(), "before");
        assert_eq!(
            read(&f, &s.id, "new.txt").await.unwrap_err().kind,
            ErrorType::NotFound
        );

        // A new sandbox from it starts with its files, at its size.
        let from = CreateSandbox {
            snapshot_id: Some(snap.id.clone()),
            ..Default::default()
        };
        let (c, _) = f.create_sandbox(&a(), from.clone(), None).await.unwrap();
        assert_eq!(read(&f, &c.id, "d/state.txt").await.unwrap(), "before");
        let e = f
            .create_sandbox(
                &a(),
                CreateSandbox {
                    size: Some("large".into()),
                    ..from
                },
                None,
            )
            .await
            .unwrap_err();
        assert_eq!(e.kind, ErrorType::InvalidRequest, "{e}");
        // ... which it may be restored to, being started from it.
        write(&f, &c.id, "d/state.txt", "child").await;
        f.restore_sandbox(&a(), &c.id, req.clone()).await.unwrap();
        assert_eq!(read(&f, &c.id, "d/state.txt").await.unwrap(), "before");
        // A snapshot of the child is no ancestor of its parent.
        let (child_snap, _) = f
            .snapshot_sandbox(&a(), &c.id, CreateSnapshot::default(), None)
            .await
            .unwrap();
        let e = f
            .restore_sandbox(
                &a(),
                &s.id,
                RestoreSandbox {
                    snapshot_id: child_snap.id.clone(),
                },
            )
            .await
            .unwrap_err();
        assert_eq!(e.kind, ErrorType::InvalidRequest, "{e}");

        // Another account sees none of it.
        for e in [
            f.get_snapshot(&b(), &snap.id).await.unwrap_err(),
            f.delete_snapshot(&b(), &snap.id).await.unwrap_err(),
            f.create_sandbox(
                &b(),
                CreateSandbox {
                    snapshot_id: Some(snap.id.clone()),
                    ..Default::default()
                },
                None,
            )
            .await
            .unwrap_err(),
        ] {
            assert_eq!(e.kind, ErrorType::NotFound, "{e}");
        }
        assert!(f
            .list_snapshots(&b(), ListSnapshots::default())
            .await
            .unwrap()
            .data
            .is_empty());

        // Newest first, paged; a deleted one is listed no more.
        let page = f
            .list_snapshots(
                &a(),
                ListSnapshots {
                    limit: Some(1),
                    starting_after: None,
                },
            )
            .await
            .unwrap();
        assert_eq!(page.data[0].id, child_snap.id);
        assert_eq!(page.next_cursor.as_deref(), Some(child_snap.id.as_str()));
        let gone = f.delete_snapshot(&a(), &snap.id).await.unwrap();
        assert_eq!(gone.status, "deleted");
        let all = f
            .list_snapshots(&a(), ListSnapshots::default())
            .await
            .unwrap();
        assert_eq!(all.data, std::slice::from_ref(&child_snap));
        // Deleted, it is not found, like a missing one.
        for e in [
            f.get_snapshot(&a(), &snap.id).await.unwrap_err(),
            f.delete_snapshot(&a(), &snap.id).await.unwrap_err(),
            f.restore_sandbox(&a(), &s.id, req).await.unwrap_err(),
        ] {
            assert_eq!(e.kind, ErrorType::NotFound, "{e}");
        }
        // The child still descends from it: its own snapshot restores it.
        let to_child = RestoreSandbox {
            snapshot_id: child_snap.id,
        };
        f.restore_sandbox(&a(), &c.id, to_child).await.unwrap();
    }

    #[tokio::test]
    async fn a_fork_is_a_snapshot_and_its_copies() {
        let f = Fake::new();
        let s = f.add_sandbox(ACCOUNT_A, "sbx_here");
        write(&f, &s.id, "a.txt", "shared").await;
        let fork = f
            .fork_sandbox(
                &a(),
                &s.id,
                ForkSandbox {
                    count: Some(3),
                    timeout_minutes: Some(30),
                },
            )
            .await
            .unwrap();
        assert_eq!(fork.snapshot.sandbox_id, s.id);
        assert_eq!(fork.sandboxes.len(), 3);
        for c in &fork.sandboxes {
            assert_ne!(c.id, s.id);
            assert_eq!((c.size.as_str(), c.timeout_minutes), ("small", 30));
            assert_eq!(read(&f, &c.id, "a.txt").await.unwrap(), "shared");
        }
        // The copies are copies: a write to one is in no other.
        write(&f, &fork.sandboxes[0].id, "a.txt", "mine").await;
        assert_eq!(read(&f, &s.id, "a.txt").await.unwrap(), "shared");
        assert_eq!(
            read(&f, &fork.sandboxes[1].id, "a.txt").await.unwrap(),
            "shared"
        );
        for count in [0, 11] {
            let e = f
                .fork_sandbox(
                    &a(),
                    &s.id,
                    ForkSandbox {
                        count: Some(count),
                        timeout_minutes: None,
                    },
                )
                .await
                .unwrap_err();
            assert_eq!(e.kind, ErrorType::InvalidRequest, "{e}");
            assert!(e.message.contains("count"), "{e}");
        }
        let e = f
            .fork_sandbox(&b(), &s.id, ForkSandbox::default())
            .await
            .unwrap_err();
        assert_eq!(e.kind, ErrorType::NotFound);
        f.destroy_sandbox(&a(), &s.id).await.unwrap();
        let e = f
            .fork_sandbox(&a(), &s.id, ForkSandbox::default())
            .await
            .unwrap_err();
        assert_eq!(e.kind, ErrorType::Conflict);
    }

    #[tokio::test]
    async fn faults_come_once_in_order_after_the_call_is_recorded() {
        let f = Fake::new();
        f.fail_next("usage", CoreError::internal("one"));
        f.fail_next("usage", CoreError::internal("two"));
        assert_eq!(f.usage(&a(), None).await.unwrap_err().message, "one");
        assert_eq!(f.usage(&a(), None).await.unwrap_err().message, "two");
        assert!(f.usage(&a(), None).await.is_ok());
        assert_eq!(f.calls().len(), 3);
        assert!(f.calls().iter().all(|c| c.account_id == ACCOUNT_A));
    }
}
