//! The operations an agent can ask for, as a few traits by subject
//! ([`Sandboxes`], [`Snapshots`], [`Commands`], [`Files`], [`Ports`],
//! [`Terminals`], [`Accounts`], [`Templates`], [`Secrets`], [`Volumes`],
//! [`Events`]) that
//! [`SandboxApi`] gathers. The core
//! service implements each in the module of its subject; a REST client
//! implements them for a remote server. The REST, MCP and dashboard
//! adapters take an `Arc<dyn SandboxApi>` and translate, nothing more.

use crate::error::Result;
use crate::model::*;
use async_trait::async_trait;
use std::collections::BTreeMap;
use tokio::sync::mpsc;

pub use sandpit_host::machines::{PtyExit, PtyInput, PtyOutput, PtySize};

/// An interactive shell in a sandbox ([`Terminals::open_terminal`]):
/// keystrokes and sizes go to `input`, output and the shell's end come from
/// `output`. Dropping it (or `input`) hangs the shell up; `output` ends
/// without an exit when the terminal was cut (the sandbox ended).
pub struct TerminalSession {
    pub input: mpsc::Sender<PtyInput>,
    pub output: mpsc::Receiver<PtyOutput>,
    /// What keeps it counted among the sandbox's open terminals.
    _open: Box<dyn Send + Sync>,
}

impl TerminalSession {
    pub fn new(
        input: mpsc::Sender<PtyInput>,
        output: mpsc::Receiver<PtyOutput>,
        open: impl Send + Sync + 'static,
    ) -> Self {
        TerminalSession {
            input,
            output,
            _open: Box::new(open),
        }
    }
}

/// What an implementation without terminals answers.
fn no_terminals() -> crate::error::CoreError {
    crate::error::CoreError::new(
        crate::error::ErrorType::InvalidRequest,
        "terminals are served by a Sandpit server's own API only",
    )
}

/// Who is asking: an authenticated account, and through what.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub account_id: String,
    /// Who acts, as the account's events name it (`key sp_ab12cd34e`,
    /// `dashboard`, `sandbox token`, `sandpit mcp`…): never a secret.
    pub actor: String,
}

impl Caller {
    pub fn new(account_id: impl Into<String>, actor: impl Into<String>) -> Self {
        Caller {
            account_id: account_id.into(),
            actor: actor.into(),
        }
    }
}

/// Where a streamed upload's bytes come from (an HTTP request's body).
#[async_trait]
pub trait ByteSource: Send {
    /// The next piece; `None` at the end. An error ends the upload (the
    /// client went away, or sent less than it announced).
    async fn next_chunk(&mut self) -> Option<std::io::Result<Vec<u8>>>;
}

/// A file read a piece at a time ([`Files::download_file`]).
pub struct FileDownload {
    /// Resolved, absolute.
    pub path: String,
    /// Its size when the guest opened it (what `chunks` brings, unless it
    /// changes while being read, which ends `chunks` with an error).
    pub size: u64,
    pub chunks: mpsc::Receiver<Result<Vec<u8>>>,
}

/// A directory being watched ([`Files::watch_dir`]). Dropping it stops
/// the watch in the guest.
pub struct DirWatchStream {
    /// The watched directory, resolved, absolute.
    pub path: String,
    /// What changes, a batch at a time as the guest reports it; an error
    /// is the last item (the directory went, events were lost, the sandbox
    /// ended); the channel closing without one means the watch was stopped.
    pub events: mpsc::Receiver<Result<Vec<sandpit_protocol::WatchEvent>>>,
}

/// One event of a streaming execution.
#[derive(Debug, Clone, PartialEq)]
pub enum ExecEvent {
    /// The first event: the execution as it starts (status `running`), so
    /// a client whose stream breaks still knows the id to look it up by.
    Started(Execution),
    /// Output, decoded as UTF-8 without splitting characters across chunks.
    Stdout(String),
    Stderr(String),
    /// The last event: the execution object (also stored).
    Exit(Execution),
    /// The platform failed mid-way; the last event.
    Error(crate::error::CoreError),
}

/// A running command's events. Dropping it before `Exit` cancels the command
/// (it is then recorded as `cancelled`).
pub struct ExecStream {
    pub events: mpsc::Receiver<ExecEvent>,
    /// Dropped or fired: cancel.
    pub cancel: Option<tokio::sync::oneshot::Sender<()>>,
}

impl ExecStream {
    pub async fn next(&mut self) -> Option<ExecEvent> {
        self.events.recv().await
    }
}

impl Drop for ExecStream {
    fn drop(&mut self) {
        if let Some(c) = self.cancel.take() {
            let _ = c.send(());
        }
    }
}

/// Everything an account can do with its sandboxes, by subject: each
/// subject is a trait of its own, which the core service implements in the
/// module of that subject, and an adapter names what it uses. Bring the
/// methods into scope with `use sandpit_core::api::prelude::*`.
pub trait SandboxApi:
    Accounts
    + Sandboxes
    + Snapshots
    + Commands
    + Files
    + Ports
    + Terminals
    + Templates
    + Secrets
    + Volumes
    + Events
{
}

impl<T> SandboxApi for T where
    T: Accounts
        + Sandboxes
        + Snapshots
        + Commands
        + Files
        + Ports
        + Terminals
        + Templates
        + Secrets
        + Volumes
        + Events
        + ?Sized
{
}

/// The API's traits, for `use sandpit_core::api::prelude::*`.
pub mod prelude {
    pub use super::{
        Accounts, Commands, Events, Files, Ports, SandboxApi, Sandboxes, Secrets, Snapshots,
        Templates, Terminals, Volumes,
    };
}

/// Who calls and what they have: the key's account, its usage, and what the service offers.
#[async_trait]
pub trait Accounts: Send + Sync {
    /// Resolve an API key to its account (`unauthorized` if unknown or revoked).
    async fn authenticate(&self, api_key: &str) -> Result<Caller>;
    async fn usage(&self, caller: &Caller, days: Option<u32>) -> Result<Usage>;
    async fn account(&self, caller: &Caller) -> Result<Account>;
    /// No key needed.
    async fn service_info(&self) -> Result<ServiceInfo>;
    /// Resolve a sandbox's data-plane token (E2B's `envdAccessToken`) to
    /// the sandbox's account: `not_found` for a sandbox that is not live,
    /// `unauthorized` for a token that is not its own. A backend without
    /// tokens refuses every one.
    async fn authenticate_sandbox(&self, sandbox_id: &str, token: &str) -> Result<Caller> {
        let _ = (sandbox_id, token);
        Err(crate::error::CoreError::unauthorized())
    }
    /// The live sandbox whose data-plane token `proof` accepts, and its
    /// account, for a request that names no sandbox but carries proof made
    /// with its token (E2B's signed file URLs: a hash of the path, the
    /// operation and the token, and no sandbox id). `unauthorized` when no
    /// live sandbox's token is accepted; a backend without tokens refuses
    /// every proof. `proof` should compare in constant time.
    async fn authenticate_sandbox_by_proof(
        &self,
        proof: &(dyn for<'t> Fn(&'t str) -> bool + Send + Sync),
    ) -> Result<(String, Caller)> {
        let _ = proof;
        Err(crate::error::CoreError::unauthorized())
    }
}

/// A sandbox's life: create, look up, list, extend, destroy, pause and resume.
#[async_trait]
pub trait Sandboxes: Send + Sync {
    async fn create_sandbox(
        &self,
        caller: &Caller,
        req: CreateSandbox,
        idempotency_key: Option<String>,
    ) -> Result<(Sandbox, bool)>;
    async fn get_sandbox(&self, caller: &Caller, id: &str) -> Result<Sandbox>;
    async fn list_sandboxes(&self, caller: &Caller, q: ListSandboxes) -> Result<List<Sandbox>>;
    async fn extend_sandbox(
        &self,
        caller: &Caller,
        id: &str,
        additional_minutes: Option<u32>,
    ) -> Result<Sandbox>;
    async fn destroy_sandbox(&self, caller: &Caller, id: &str) -> Result<Sandbox>;
    /// Ends a live sandbox's life sooner: it expires `timeout_minutes`
    /// after its creation instead, and the reservation of the time it will
    /// not live goes back (E2B's `set_timeout` to less than what is left;
    /// not part of the REST contract). A lifetime that is not shorter, or
    /// that would be over already, is refused. A backend that cannot
    /// refuses.
    async fn shorten_sandbox(
        &self,
        caller: &Caller,
        id: &str,
        timeout_minutes: u32,
    ) -> Result<Sandbox> {
        let _ = (caller, id, timeout_minutes);
        Err(crate::error::CoreError::invalid(
            "shortening a sandbox's life is not available here",
        ))
    }
    /// Stops the sandbox's VM, its whole state kept on disk, billed at the
    /// paused rate; any call that needs the VM resumes it. Pausing a paused
    /// sandbox changes nothing.
    async fn pause_sandbox(&self, caller: &Caller, id: &str) -> Result<Sandbox>;
    /// Runs a paused sandbox again, its processes where they were.
    /// Resuming a running sandbox changes nothing.
    async fn resume_sandbox(&self, caller: &Caller, id: &str) -> Result<Sandbox>;
    /// The sandbox's resources as its guest counts them: a reading taken
    /// now when it runs (a paused one is not woken), after the ones kept
    /// from the last hour, oldest first (E2B's `get_metrics`; not part of
    /// the REST contract). A backend without it refuses.
    async fn sandbox_metrics(&self, caller: &Caller, id: &str) -> Result<Vec<SandboxMetric>> {
        let _ = (caller, id);
        Err(crate::error::CoreError::invalid(
            "a sandbox's metrics are not available here",
        ))
    }
    /// Replaces a live sandbox's own egress lists (see [`NetworkLists`];
    /// empty lists: the operator's network as it is) and, from E2B's
    /// update, whether it may reach the network at all (`None`: as its
    /// lists say). A running sandbox's VM has them when this answers; a
    /// paused one gets them when it resumes. A backend without it refuses.
    async fn update_network(
        &self,
        caller: &Caller,
        id: &str,
        lists: NetworkLists,
        internet_access: Option<bool>,
    ) -> Result<Sandbox> {
        let _ = (caller, id, lists, internet_access);
        Err(crate::error::CoreError::invalid(
            "changing a sandbox's network is not available here",
        ))
    }
    /// E2B's `update_network`: as [`Sandboxes::update_network`], its
    /// network rules replaced too (see [`NetworkRules`]; each secret they
    /// name must be the account's). Not part of the REST API.
    async fn update_network_and_rules(
        &self,
        caller: &Caller,
        id: &str,
        lists: NetworkLists,
        internet_access: Option<bool>,
        rules: NetworkRules,
    ) -> Result<Sandbox> {
        let _ = (caller, id, lists, internet_access, rules);
        Err(crate::error::CoreError::invalid(
            "changing a sandbox's network is not available here",
        ))
    }
}

/// A sandbox's whole state saved, and what starts from it: snapshots, forks, restores.
#[async_trait]
pub trait Snapshots: Send + Sync {
    /// Save the whole state of a running sandbox (it runs on; it is paused
    /// only while its state is captured). The bool: replayed from an
    /// earlier call with the same `Idempotency-Key`.
    async fn snapshot_sandbox(
        &self,
        caller: &Caller,
        id: &str,
        req: CreateSnapshot,
        idempotency_key: Option<String>,
    ) -> Result<(Snapshot, bool)>;
    async fn get_snapshot(&self, caller: &Caller, snapshot_id: &str) -> Result<Snapshot>;
    async fn list_snapshots(&self, caller: &Caller, q: ListSnapshots) -> Result<List<Snapshot>>;
    /// Deletes it and frees its disk. Sandboxes started from it live on.
    async fn delete_snapshot(&self, caller: &Caller, snapshot_id: &str) -> Result<Snapshot>;
    /// A snapshot of the sandbox and `count` new sandboxes from it, their
    /// credit reserved at once or the call refused whole.
    async fn fork_sandbox(&self, caller: &Caller, id: &str, req: ForkSandbox) -> Result<Fork>;
    /// Rolls the sandbox back to a snapshot of itself or of an ancestor of
    /// the same size: same id, preview URLs and expiry.
    async fn restore_sandbox(
        &self,
        caller: &Caller,
        id: &str,
        req: RestoreSandbox,
    ) -> Result<Sandbox>;
}

/// Commands in a sandbox, and the executions kept of them.
#[async_trait]
pub trait Commands: Send + Sync {
    /// Run a command to completion.
    async fn exec(&self, caller: &Caller, id: &str, params: ExecParams) -> Result<Execution>;
    /// Run a command, streaming its output.
    async fn exec_stream(
        &self,
        caller: &Caller,
        id: &str,
        params: ExecParams,
    ) -> Result<ExecStream>;
    async fn get_execution(&self, caller: &Caller, exec_id: &str) -> Result<Execution>;
    /// Follow a running command by its pid (E2B's `commands.connect`; not
    /// part of the REST contract): its output from now on and its end.
    /// The stream's `Started` and `Exit` carry the pid and how it ended,
    /// not a stored execution (that is the starting call's). Dropping the
    /// stream stops following; the command goes on. A backend without
    /// processes refuses.
    async fn attach_process(&self, caller: &Caller, id: &str, pid: u32) -> Result<ExecStream> {
        let _ = (caller, id, pid);
        Err(crate::error::CoreError::invalid(
            "following a running command is not available here",
        ))
    }
    /// The commands running in a sandbox now (E2B's `commands.list`).
    async fn list_processes(
        &self,
        caller: &Caller,
        id: &str,
    ) -> Result<Vec<sandpit_protocol::ProcessInfo>> {
        let _ = (caller, id);
        Err(crate::error::CoreError::invalid(
            "listing running commands is not available here",
        ))
    }
    /// Feed (`input`), close the stdin of, or signal a running command
    /// (E2B's `send_stdin`, `close_stdin`, `kill`).
    async fn process_call(
        &self,
        caller: &Caller,
        id: &str,
        pid: u32,
        call: sandpit_protocol::ProcessCall,
        input: Vec<u8>,
    ) -> Result<()> {
        let _ = (caller, id, pid, call, input);
        Err(crate::error::CoreError::invalid(
            "calls on running commands are not available here",
        ))
    }
    /// A sandbox's executions (ended or not, of a deleted sandbox too while
    /// they are kept), newest first, a page at a time.
    async fn list_executions(
        &self,
        caller: &Caller,
        id: &str,
        q: ListExecutions,
    ) -> Result<List<Execution>>;
}

/// Files in a sandbox, whole or a piece at a time.
#[async_trait]
pub trait Files: Send + Sync {
    async fn write_file(&self, caller: &Caller, id: &str, req: WriteFile) -> Result<FileWritten>;
    /// Write `size` bytes from `body` to `path`, a piece at a time: the
    /// server holds one piece of it, not the file. Same checks and answer
    /// as [`Files::write_file`]; a body that ends early or runs long
    /// writes nothing. This default (for backends that cannot stream)
    /// collects the body and writes it whole.
    async fn upload_file(
        &self,
        caller: &Caller,
        id: &str,
        path: &str,
        size: u64,
        mut body: Box<dyn ByteSource>,
    ) -> Result<FileWritten> {
        use base64::Engine;
        let mut bytes = Vec::new();
        while let Some(chunk) = body.next_chunk().await {
            bytes.extend(chunk.map_err(crate::error::body_failed)?);
        }
        if bytes.len() as u64 != size {
            return Err(crate::error::body_length(bytes.len() as u64, size));
        }
        let req = WriteFile {
            path: path.to_string(),
            content: base64::engine::general_purpose::STANDARD.encode(&bytes),
            encoding: Some(Encoding::Base64),
        };
        self.write_file(caller, id, req).await
    }
    /// Read `path` a piece at a time. Same checks as
    /// [`Files::read_file`]. This default (for backends that cannot
    /// stream) reads it whole.
    async fn download_file(&self, caller: &Caller, id: &str, path: &str) -> Result<FileDownload> {
        use base64::Engine;
        let file = self.read_file(caller, id, path, Encoding::Base64).await?;
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(file.content)
            .map_err(|e| {
                crate::error::CoreError::internal(format!("bad base64 from the backend: {e}"))
            })?;
        let (tx, chunks) = mpsc::channel(1);
        let _ = tx.try_send(Ok(bytes));
        Ok(FileDownload {
            path: file.path,
            size: file.bytes,
            chunks,
        })
    }
    async fn read_file(
        &self,
        caller: &Caller,
        id: &str,
        path: &str,
        encoding: Encoding,
    ) -> Result<FileContent>;
    async fn list_files(
        &self,
        caller: &Caller,
        id: &str,
        path: Option<&str>,
        recursive: bool,
    ) -> Result<FileList>;
    async fn delete_file(
        &self,
        caller: &Caller,
        id: &str,
        path: &str,
        recursive: bool,
    ) -> Result<FileDeleted>;
    /// Describe, make (a directory) or move a path, as the guest user
    /// (E2B's filesystem API; not part of the REST contract). A backend
    /// without it refuses.
    async fn path_call(
        &self,
        caller: &Caller,
        id: &str,
        call: sandpit_protocol::PathCall,
    ) -> Result<sandpit_protocol::PathEntry> {
        let _ = (caller, id, call);
        Err(crate::error::CoreError::invalid(
            "describing, making or moving a path is not available here",
        ))
    }
    /// Watch directory `path` (with `recursive`, the tree under it) as the
    /// guest user, from the moment this returns (E2B's filesystem API; not
    /// part of the REST contract). The sandbox is in use, and so not put
    /// to sleep for idleness, while the watch is open. A backend without it
    /// refuses.
    async fn watch_dir(
        &self,
        caller: &Caller,
        id: &str,
        path: &str,
        recursive: bool,
    ) -> Result<DirWatchStream> {
        let _ = (caller, id, path, recursive);
        Err(crate::error::CoreError::invalid(
            "watching a directory is not available here",
        ))
    }
}

/// Ports of a sandbox exposed on preview URLs.
#[async_trait]
pub trait Ports: Send + Sync {
    /// Exposes `port` on its preview URL, `private` (the traffic token
    /// needed) or public; exposing an exposed port again changes only that.
    async fn expose_port(
        &self,
        caller: &Caller,
        id: &str,
        port: u16,
        private: bool,
    ) -> Result<Port>;
    async fn list_ports(&self, caller: &Caller, id: &str) -> Result<List<Port>>;
    async fn close_port(&self, caller: &Caller, id: &str, port: u16) -> Result<()>;
    /// A private port's URL signed for `expires_in_seconds` (default an
    /// hour, at most 7 days). A backend without private ports refuses.
    async fn sign_preview_url(
        &self,
        caller: &Caller,
        id: &str,
        port: u16,
        expires_in_seconds: Option<u64>,
    ) -> Result<SignedUrl> {
        let _ = (caller, id, port, expires_in_seconds);
        Err(crate::error::CoreError::invalid(
            "signed preview URLs are not available here",
        ))
    }
}

/// Interactive shells for people, and the one-use tokens a browser opens them with.
#[async_trait]
pub trait Terminals: Send + Sync {
    /// An interactive login shell as the guest user on a new terminal of
    /// `size` in a running sandbox (a paused one is resumed first).
    async fn open_terminal(
        &self,
        _caller: &Caller,
        _id: &str,
        _size: PtySize,
    ) -> Result<TerminalSession> {
        Err(no_terminals())
    }
    /// A one-use token that opens sandbox `id`'s terminal without a key
    /// (for a browser's WebSocket), valid for a minute.
    async fn terminal_token(&self, _caller: &Caller, _id: &str) -> Result<TerminalToken> {
        Err(no_terminals())
    }
    /// Takes a terminal token for sandbox `id`: whose it is. Unknown, used,
    /// expired or another sandbox's: `unauthorized`.
    async fn redeem_terminal_token(&self, _token: &str, _id: &str) -> Result<Caller> {
        Err(no_terminals())
    }
}

/// What an implementation without templates answers.
fn no_templates() -> crate::error::CoreError {
    crate::error::CoreError::new(
        crate::error::ErrorType::InvalidRequest,
        "templates are built by a Sandpit server's own API only",
    )
}

/// Templates: environments built once (the standard image plus steps,
/// saved with their start command running), which sandboxes start from.
#[async_trait]
pub trait Templates: Send + Sync {
    /// Starts a build; returns it `building` (its log in
    /// [`Templates::get_template`]). What cannot be built is refused here,
    /// before any VM starts.
    async fn build_template(&self, _caller: &Caller, _req: BuildTemplate) -> Result<Template> {
        Err(no_templates())
    }
    /// A build by id (`tpl_…`), or the newest of `name[:tag]`, with its log.
    async fn get_template(&self, _caller: &Caller, _id: &str) -> Result<Template> {
        Err(no_templates())
    }
    /// The account's builds and the published ones, newest first.
    async fn list_templates(&self, _caller: &Caller) -> Result<List<Template>> {
        Err(no_templates())
    }
    /// Deletes a build (by id), or every build of `name[:tag]`; sandboxes
    /// started from it live on.
    async fn delete_template(&self, _caller: &Caller, _id: &str) -> Result<Template> {
        Err(no_templates())
    }
    /// Keeps the files of a `COPY` step (a tar) under their SHA-256, which
    /// is checked.
    async fn upload_template_files(
        &self,
        _caller: &Caller,
        _sha256: &str,
        _tar: Vec<u8>,
    ) -> Result<()> {
        Err(no_templates())
    }
    /// Whether the account holds files by this key (a SHA-256, or an E2B
    /// build context's own hash).
    async fn has_template_files(&self, _caller: &Caller, _key: &str) -> Result<bool> {
        Err(no_templates())
    }
    /// Asks for a build of `name[:tag]` whose steps come later (E2B's
    /// builder uploads its files in between): `waiting`, with the secret
    /// its uploads carry ([`Templates::upload_template_context`]). Left
    /// waiting for an hour, it fails.
    async fn reserve_template_build(
        &self,
        _caller: &Caller,
        _name: &str,
        _size: Option<String>,
    ) -> Result<ReservedBuild> {
        Err(no_templates())
    }
    /// The upload secret of the caller's waiting build `id`.
    async fn template_upload_token(&self, _caller: &Caller, _id: &str) -> Result<String> {
        Err(no_templates())
    }
    /// Starts waiting build `id` with its steps; returns it `building`.
    /// Steps that cannot be built (`Err`: why, from reading them; or what
    /// the check finds) fail the build at once, the reason in its log.
    async fn start_template_build(
        &self,
        _caller: &Caller,
        _id: &str,
        _spec: std::result::Result<sandpit_templates::Spec, sandpit_templates::SpecError>,
    ) -> Result<Template> {
        Err(no_templates())
    }
    /// Keeps a build context (a tar, maybe gzipped) for waiting build
    /// `build_id`'s account under the client's own key for it (E2B's
    /// `filesHash`, not the bytes' hash: it also covers names and modes),
    /// let in by the build's upload secret instead of an API key.
    async fn upload_template_context(
        &self,
        _build_id: &str,
        _upload_token: &str,
        _key: &str,
        _archive: Vec<u8>,
    ) -> Result<()> {
        Err(no_templates())
    }
}

/// What an implementation without secrets answers.
fn no_secrets() -> crate::error::CoreError {
    crate::error::CoreError::new(
        crate::error::ErrorType::InvalidRequest,
        "secrets are kept by a Sandpit server's own API only",
    )
}

/// Secrets: an account's credentials, which its sandboxes use without
/// holding them (see [`CreateSandbox::secrets`]). A value is given once and
/// never shown again.
#[async_trait]
pub trait Secrets: Send + Sync {
    /// Stores secret `name` (an environment variable's name), replacing
    /// the account's secret of that name if it has one; its running
    /// sandboxes that use it send the new value from their next request.
    async fn put_secret(&self, _caller: &Caller, _name: &str, _req: PutSecret) -> Result<Secret> {
        Err(no_secrets())
    }
    /// The account's secrets, by name, without their values.
    async fn list_secrets(&self, _caller: &Caller) -> Result<List<Secret>> {
        Err(no_secrets())
    }
    /// Deletes secret `name` (or of id `name`, `sec_…`): what it was.
    /// Sandboxes that use it keep their placeholder, which is sent on as it
    /// is from then on; their network rules that name it set nothing.
    async fn delete_secret(&self, _caller: &Caller, _name: &str) -> Result<Secret> {
        Err(no_secrets())
    }
    /// Creates secret `name` as E2B does (lower-cased; letters, digits, `-`
    /// and `_`; not `sec_…`), with no hosts: its sandboxes' network rules
    /// put it in requests (see [`NetworkRules`]). A name the account has
    /// already is a conflict. Not part of the REST API.
    async fn create_secret(
        &self,
        _caller: &Caller,
        _name: &str,
        _value: String,
        _metadata: BTreeMap<String, String>,
    ) -> Result<Secret> {
        Err(no_secrets())
    }
    /// The account's secret of id `secret` (`sec_…`) or of that name (as
    /// it is, else lower-cased: E2B's canonical form), without its value.
    async fn get_secret(&self, _caller: &Caller, _secret: &str) -> Result<Secret> {
        Err(no_secrets())
    }
    /// A new value for secret `secret` (as [`Secrets::get_secret`] finds
    /// it): its version one more, its metadata replaced when given, its
    /// hosts kept. Running sandboxes that use it send the new value from
    /// their next connection. Not part of the REST API.
    async fn update_secret(
        &self,
        _caller: &Caller,
        _secret: &str,
        _value: String,
        _metadata: Option<BTreeMap<String, String>>,
    ) -> Result<Secret> {
        Err(no_secrets())
    }
}

/// What an implementation without volumes answers.
fn no_volumes() -> crate::error::CoreError {
    crate::error::CoreError::new(
        crate::error::ErrorType::InvalidRequest,
        "volumes are kept by a Sandpit server's own API only",
    )
}

/// Volumes: an account's named file systems, kept on one node's disk until
/// deleted, which its sandboxes mount (see [`CreateSandbox::volumes`]).
/// A volume is found by its id (`vol_…`) or its name.
#[async_trait]
pub trait Volumes: Send + Sync {
    /// Makes an empty volume: a name the account has already, or one past
    /// its quota (count or bytes), is refused saying which. With
    /// `idempotency_key`, a retry of the same request returns the volume
    /// the first made (`true`: replayed); another request under the key is
    /// a conflict.
    async fn create_volume(
        &self,
        _caller: &Caller,
        _req: CreateVolume,
        _idempotency_key: Option<String>,
    ) -> Result<(Volume, bool)> {
        Err(no_volumes())
    }
    /// The account's volumes, by name.
    async fn list_volumes(&self, _caller: &Caller) -> Result<List<Volume>> {
        Err(no_volumes())
    }
    async fn get_volume(&self, _caller: &Caller, _volume: &str) -> Result<Volume> {
        Err(no_volumes())
    }
    /// Grows a volume (never shrinks it); refused (conflict) while a live
    /// sandbox mounts it.
    async fn resize_volume(
        &self,
        _caller: &Caller,
        _volume: &str,
        _req: ResizeVolume,
    ) -> Result<Volume> {
        Err(no_volumes())
    }
    /// Runs a call on a volume's files, served by the host from the
    /// volume's file: refused (conflict, naming them) while a live sandbox
    /// mounts it read-write, or for a call that changes it, while any
    /// does. What it describes (a listing's entries; one path's; none for
    /// a removal).
    async fn volume_files(
        &self,
        _caller: &Caller,
        _volume: &str,
        _call: VolumeCall,
    ) -> Result<Vec<VolumeFile>> {
        Err(no_volumes())
    }
    /// Writes `size` bytes from `body` to `path` of a volume, its
    /// directories made (owned and moded as `owner` says: the guest's
    /// user, 0644 by default); an existing file is replaced only with
    /// `overwrite`. Same rule as [`Volumes::volume_files`]; a body that
    /// ends early or runs long writes nothing.
    #[allow(clippy::too_many_arguments)]
    async fn upload_volume_file(
        &self,
        _caller: &Caller,
        _volume: &str,
        _path: &str,
        _size: u64,
        _owner: VolumeOwnership,
        _overwrite: bool,
        _body: Box<dyn ByteSource>,
    ) -> Result<VolumeFile> {
        Err(no_volumes())
    }
    /// Reads file `path` of a volume, a piece at a time. Same rule as
    /// [`Volumes::volume_files`].
    async fn download_volume_file(
        &self,
        _caller: &Caller,
        _volume: &str,
        _path: &str,
    ) -> Result<FileDownload> {
        Err(no_volumes())
    }
    /// Moves a volume's file to cluster node `node` (`sandpit volume
    /// move`): a streamed copy, while no sandbox mounts it (conflict
    /// otherwise), after which its sandboxes run there. What it is now.
    async fn move_volume(&self, _caller: &Caller, _volume: &str, _node: &str) -> Result<Volume> {
        Err(no_volumes())
    }
    /// A token that opens this volume's files alone, without the
    /// account's key (E2B's volume token): good until the volume is
    /// deleted, or the operator's secrets key changes.
    async fn volume_token(&self, _caller: &Caller, _volume: &str) -> Result<String> {
        Err(no_volumes())
    }
    /// The account that volume `volume_id`'s `token` was made for
    /// ([`Volumes::volume_token`]): unauthorized for any other token, a
    /// deleted volume's included.
    async fn authenticate_volume(&self, _volume_id: &str, _token: &str) -> Result<Caller> {
        Err(no_volumes())
    }
    /// Deletes a volume and what it holds: what it was. Refused (conflict)
    /// while a live sandbox mounts it.
    async fn delete_volume(&self, _caller: &Caller, _volume: &str) -> Result<Volume> {
        Err(no_volumes())
    }
}

/// A build asked for before its steps ([`Templates::reserve_template_build`]).
#[derive(Debug, Clone)]
pub struct ReservedBuild {
    pub template: Template,
    /// Lets the build's files be uploaded without the API key (E2B's
    /// upload URL carries it); spent when the build starts.
    pub upload_token: String,
}

/// The API key an HTTP request carries, read the same way by REST and MCP:
/// `Authorization: Bearer <key>` (scheme in any case) or `x-api-key: <key>`,
/// given as the raw header values. An `Authorization` header of another
/// scheme is refused, not skipped for `x-api-key` (a client that sends Basic
/// credentials learns why it is not let in), as is one that is not text or
/// carries no key.
pub fn api_key_from_headers(
    authorization: Option<&[u8]>,
    x_api_key: Option<&[u8]>,
) -> Result<String, crate::CoreError> {
    use crate::{CoreError, ErrorType};
    if let Some(v) = authorization {
        let v = std::str::from_utf8(v)
            .map_err(|_| CoreError::unauthorized())?
            .trim();
        let (scheme, rest) = v.split_once(' ').unwrap_or((v, ""));
        if !scheme.eq_ignore_ascii_case("bearer") {
            return Err(CoreError::new(
                ErrorType::Unauthorized,
                "unsupported Authorization scheme: send `Authorization: Bearer <key>` or `x-api-key: <key>`",
            ));
        }
        let key = rest.trim();
        if key.is_empty() {
            return Err(CoreError::unauthorized());
        }
        return Ok(key.to_owned());
    }
    if let Some(v) = x_api_key {
        let key = std::str::from_utf8(v)
            .map_err(|_| CoreError::unauthorized())?
            .trim();
        if !key.is_empty() {
            return Ok(key.to_owned());
        }
    }
    Err(CoreError::unauthorized())
}

fn no_events() -> crate::error::CoreError {
    crate::error::CoreError::new(
        crate::error::ErrorType::InvalidRequest,
        "events and webhooks are kept by a Sandpit server's own API only",
    )
}

/// The account's lifecycle events, and the webhooks they are POSTed to.
#[async_trait]
pub trait Events: Send + Sync {
    /// The account's events (or one sandbox's: not found when it is not
    /// the account's), oldest first, after `after`. `next_cursor` is always
    /// set: the last event's cursor, or `after` itself when nothing came,
    /// so a client polls with it.
    async fn list_events(&self, _caller: &Caller, _q: ListEvents) -> Result<List<Event>> {
        Err(no_events())
    }
    /// Registers a webhook; its address is refused when the operator does
    /// not allow it. The answer carries its secret, once.
    async fn create_webhook(&self, _caller: &Caller, _req: CreateWebhook) -> Result<Webhook> {
        Err(no_events())
    }
    async fn list_webhooks(&self, _caller: &Caller) -> Result<List<Webhook>> {
        Err(no_events())
    }
    async fn get_webhook(&self, _caller: &Caller, _id: &str) -> Result<Webhook> {
        Err(no_events())
    }
    /// Removes a webhook: its pending deliveries are dropped.
    async fn delete_webhook(&self, _caller: &Caller, _id: &str) -> Result<Webhook> {
        Err(no_events())
    }
    /// A webhook's deliveries, newest first, with their attempts.
    async fn list_deliveries(
        &self,
        _caller: &Caller,
        _webhook_id: &str,
        _q: ListDeliveries,
    ) -> Result<List<WebhookDelivery>> {
        Err(no_events())
    }
    /// Sends a delivery again, now (its earlier attempts kept): for one
    /// that failed, or to replay one that was delivered.
    async fn redeliver(
        &self,
        _caller: &Caller,
        _webhook_id: &str,
        _delivery_id: &str,
    ) -> Result<WebhookDelivery> {
        Err(no_events())
    }
}

#[cfg(test)]
mod key_tests {
    use super::api_key_from_headers as key;
    use crate::ErrorType;

    #[test]
    fn keys_are_read_from_either_header_and_other_schemes_are_refused() {
        assert_eq!(key(Some(b"Bearer sp_1"), None).unwrap(), "sp_1");
        assert_eq!(key(Some(b"bearer   sp_1 "), None).unwrap(), "sp_1");
        assert_eq!(key(None, Some(b" sp_2")).unwrap(), "sp_2");
        let e = key(Some(b"Basic dXNlcjpwYXNz"), Some(b"sp_2")).unwrap_err();
        assert_eq!(e.kind, ErrorType::Unauthorized);
        assert!(
            e.message.contains("unsupported Authorization scheme"),
            "{e}"
        );
        for (a, x) in [
            (Some(&b"Bearer "[..]), None),
            (None, Some(&b"  "[..])),
            (None, None),
            (Some(&b"Bearer \xff"[..]), None),
        ] {
            assert_eq!(key(a, x).unwrap_err().kind, ErrorType::Unauthorized);
        }
    }
}
