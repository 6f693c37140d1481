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
//! * Events, recorded as the service writes them for what the fake does:
//!   `sandbox.created` and `sandbox.started` (`from`: `cold` or
//!   `snapshot`) for a create, `sandbox.paused`, `sandbox.resumed` (a
//!   paused sandbox resumed by any call that needs it too), and
//!   `sandbox.destroying` then `sandbox.killed` (`destroyed`) for a
//!   destroy; each names its caller's actor. Their cursors count up from
//!   `1`; `list_events` pages them as the service does (after a cursor,
//!   `limit` 1..500, `next_cursor` always set: `0` before any).
//! * Webhooks kept as the service keeps them, checked as it checks them
//!   (http or https with a host; each event type one of [`EVENT_TYPES`] or
//!   `*`), with a `whsec_` secret shown by the create only; nothing is
//!   ever delivered, so a webhook has no deliveries to list or send again.
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
    check_create, check_path, check_port, extension_minutes, page_limit, unknown_cursor,
    validate_exec, write_content,
};
use sandpit_core::*;
use sandpit_host::ids::{new_id, rfc3339};
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use time::OffsetDateTime;
use tokio::sync::{mpsc, oneshot, Notify};

mod api;
mod guest;

use guest::*;

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
/// How long the fake's `sandbox_metrics` takes.
pub const READING_TAKES: std::time::Duration = std::time::Duration::from_millis(50);
/// A killed command's exit code: 128 + SIGKILL, as the service reports it.
const KILLED: i32 = 128 + 9;

/// The names of the operations [`Fake::calls`] records and
/// [`Fake::fail_next`] takes: [`SandboxApi`]'s methods that act for an
/// account.
pub const OPERATIONS: [&str; 33] = [
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
    "sandbox_metrics",
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
    "list_events",
    "create_webhook",
    "list_webhooks",
    "get_webhook",
    "delete_webhook",
    "list_deliveries",
    "redeliver",
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
        req: Box<CreateSandbox>,
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
    UpdateNetwork {
        id: String,
        lists: NetworkLists,
        internet_access: Option<bool>,
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
    SandboxMetrics {
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
    ListExecutions {
        id: String,
        query: ListExecutions,
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
        private: bool,
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
    CreateVolume {
        req: CreateVolume,
        idempotency_key: Option<String>,
    },
    ListVolumes,
    GetVolume {
        volume: String,
    },
    ResizeVolume {
        volume: String,
        size_gb: u32,
    },
    DeleteVolume {
        volume: String,
    },
    ListEvents {
        query: ListEvents,
    },
    CreateWebhook {
        req: CreateWebhook,
    },
    ListWebhooks,
    GetWebhook {
        id: String,
    },
    DeleteWebhook {
        id: String,
    },
    ListDeliveries {
        webhook_id: String,
        query: ListDeliveries,
    },
    Redeliver {
        webhook_id: String,
        delivery_id: String,
    },
}

impl Op {
    /// The operation's name: its [`SandboxApi`] method's.
    pub fn name(&self) -> &'static str {
        match self {
            Op::CreateSandbox { .. } => "create_sandbox",
            Op::GetSandbox { .. } => "get_sandbox",
            Op::ListSandboxes { .. } => "list_sandboxes",
            Op::ExtendSandbox { .. } => "extend_sandbox",
            Op::UpdateNetwork { .. } => "update_network",
            Op::DestroySandbox { .. } => "destroy_sandbox",
            Op::SnapshotSandbox { .. } => "snapshot_sandbox",
            Op::GetSnapshot { .. } => "get_snapshot",
            Op::ListSnapshots { .. } => "list_snapshots",
            Op::DeleteSnapshot { .. } => "delete_snapshot",
            Op::ForkSandbox { .. } => "fork_sandbox",
            Op::RestoreSandbox { .. } => "restore_sandbox",
            Op::PauseSandbox { .. } => "pause_sandbox",
            Op::ResumeSandbox { .. } => "resume_sandbox",
            Op::SandboxMetrics { .. } => "sandbox_metrics",
            Op::Exec { .. } => "exec",
            Op::ExecStream { .. } => "exec_stream",
            Op::GetExecution { .. } => "get_execution",
            Op::ListExecutions { .. } => "list_executions",
            Op::WriteFile { .. } => "write_file",
            Op::ReadFile { .. } => "read_file",
            Op::ListFiles { .. } => "list_files",
            Op::DeleteFile { .. } => "delete_file",
            Op::ExposePort { .. } => "expose_port",
            Op::ListPorts { .. } => "list_ports",
            Op::ClosePort { .. } => "close_port",
            Op::Usage { .. } => "usage",
            Op::Account => "account",
            Op::CreateVolume { .. } => "create_volume",
            Op::ListVolumes => "list_volumes",
            Op::GetVolume { .. } => "get_volume",
            Op::ResizeVolume { .. } => "resize_volume",
            Op::DeleteVolume { .. } => "delete_volume",
            Op::ListEvents { .. } => "list_events",
            Op::CreateWebhook { .. } => "create_webhook",
            Op::ListWebhooks => "list_webhooks",
            Op::GetWebhook { .. } => "get_webhook",
            Op::DeleteWebhook { .. } => "delete_webhook",
            Op::ListDeliveries { .. } => "list_deliveries",
            Op::Redeliver { .. } => "redeliver",
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

/// What an event carries besides its fields ([`Event::detail`]).
type Detail = serde_json::Map<String, serde_json::Value>;

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
    /// Execution ids in the order they started.
    started: Vec<String>,
    /// (account, volume), oldest first; deleted ones are gone.
    volumes: Vec<(String, Volume)>,
    /// (account, key) -> ((name, size_gb), the volume as it was made):
    /// volume creates' keys.
    volume_keys: HashMap<(String, String), ((String, u32), Volume)>,
    /// (account, event), oldest first: an event's cursor is its place
    /// here, counted from 1.
    events: Vec<(String, Event)>,
    /// (account, webhook, without its secret), oldest first; deleted ones
    /// are gone.
    webhooks: Vec<(String, Webhook)>,
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
            let resumed = h.sandbox.clone();
            self.record(caller, &resumed, "sandbox.resumed", None, Detail::new());
        }
        let h = self.held(caller, id)?;
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

    /// Write an event of the caller's about `sandbox` (as it is now).
    fn record(
        &mut self,
        caller: &Caller,
        sandbox: &Sandbox,
        kind: &str,
        reason: Option<&str>,
        detail: Detail,
    ) {
        let event = Event {
            object: "event".into(),
            id: new_id("evt_"),
            cursor: (self.events.len() + 1).to_string(),
            kind: kind.into(),
            sandbox_id: sandbox.id.clone(),
            size: sandbox.size.clone(),
            status: sandbox.status.as_str().into(),
            actor: caller.actor.clone(),
            reason: reason.map(Into::into),
            detail,
            at: T0.into(),
        };
        self.events.push((caller.account_id.clone(), event));
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
    /// `sandbox_metrics` calls in flight, and the most there ever were.
    readings: Mutex<(usize, usize)>,
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
            readings: Mutex::default(),
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

    /// The most `sandbox_metrics` calls that were ever in flight at once
    /// (each takes [`READING_TAKES`], as the service's first reading of a
    /// sandbox waits a moment to measure its CPU).
    pub fn most_readings_at_once(&self) -> usize {
        self.readings.lock().unwrap().1
    }

    /// Count a `sandbox_metrics` reading in flight until the guard drops
    /// (a call given up half-way included).
    fn reading(&self) -> impl Drop + '_ {
        struct Reading<'a>(&'a Mutex<(usize, usize)>);
        impl Drop for Reading<'_> {
            fn drop(&mut self) {
                self.0.lock().unwrap().0 -= 1;
            }
        }
        let mut r = self.readings.lock().unwrap();
        r.0 += 1;
        r.1 = r.1.max(r.0);
        Reading(&self.readings)
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
            status: ExecutionStatus::Running,
            exit_code: None,
            stdout: String::new(),
            stderr: String::new(),
            truncated: false,
            duration_ms: 0,
            started_at: T0.into(),
            finished_at: None,
            pid: None,
            signal: None,
        };
        st.started.push(exec.id.clone());
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
        metadata: Default::default(),
        access_token: None,
        internet_access: None,
        template_id: None,
        network: None,
        traffic_token: None,
        private_traffic: false,
    }
}

/// When a sandbox created at `T0` with this timeout expires.
fn expiry(timeout_minutes: u32) -> String {
    rfc3339(T0_TIME + time::Duration::minutes(timeout_minutes.into()))
}

// ---- the guest's commands ------------------------------------------------

#[cfg(test)]
mod tests;
