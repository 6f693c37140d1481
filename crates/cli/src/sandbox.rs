//! `sandpit sandbox ...`: VMs on this machine, driven directly through the
//! runtime (no server). State lives in the data directory, so a sandbox made
//! by one invocation is used by the next.
//!
//! Snapshots, fork and restore are the exception: a snapshot is a record of
//! the service (its quota, expiry, owner and lineage live in the server's
//! store), so those commands (`snapshot`, `fork`, `restore`, `snapshots`,
//! `delete-snapshot`, and `create --snapshot`) talk to a running server,
//! as `shell` does (a terminal is the server's, see `crate::shell`),
//! through its REST API (`--url`, the key in `SANDPIT_API_KEY`), on the
//! sandboxes of that key's account.
//!
//! Expiry without a server: the runtime gives every VM a watchdog of its own
//! (`sandpit_runtime::vm::expiry`) that destroys it when its time is up, whether
//! or not anyone remembered to.

use anyhow::{anyhow, bail, Context, Result};
use clap::{Args, Subcommand};
use sandpit_core::prelude::*;
use sandpit_core::{
    Caller, CreateSandbox, CreateSnapshot, ForkSandbox, ListSnapshots, RestoreSandbox, Snapshot,
};
use sandpit_protocol::ExecRequest;
use sandpit_runtime::{CreateVm, GuestExecEvent, RuntimeError, VmManager, VmRecord, VmState};
use sandpit_server::images;
use sandpit_server::settings::Settings;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use time::OffsetDateTime;

#[derive(Subcommand)]
pub enum SandboxCommand {
    /// Create a sandbox; prints its id (or, with --json, the whole object)
    Create(CreateArgs),
    /// Run a shell command in a sandbox, streaming its output; exits with its code
    Exec(ExecArgs),
    /// Copy a file: `cp LOCAL ID:PATH` or `cp ID:PATH LOCAL`
    Cp { src: String, dst: String },
    /// List sandboxes on this machine
    Ls {
        #[arg(long)]
        json: bool,
    },
    /// Destroy sandboxes
    Rm {
        #[arg(required = true)]
        ids: Vec<String>,
    },
    /// Snapshot a server's sandbox (its disk, memory and processes; it runs
    /// on); prints the snapshot's id
    Snapshot(SnapshotArgs),
    /// Copy a server's sandbox into new ones started from a snapshot of it;
    /// prints their ids
    Fork(ForkArgs),
    /// Roll a server's sandbox back to a snapshot of it (or of the sandbox
    /// it was started from)
    Restore(RestoreArgs),
    /// Pause a server's sandbox: its VM stops, its state kept on disk,
    /// billed at the paused rate; any later call resumes it
    Pause(PauseArgs),
    /// Resume a server's paused sandbox, its processes where they were
    Resume(PauseArgs),
    /// List the snapshots of the key's account on a server
    Snapshots(SnapshotsArgs),
    /// Delete snapshots on a server
    DeleteSnapshot(DeleteSnapshotArgs),
    /// Open an interactive terminal (a login shell as the sandbox's user)
    /// in a server's sandbox; exits with the shell's code
    Shell(ShellArgs),
}

#[derive(Args)]
pub struct ShellArgs {
    /// The sandbox (sbx_...)
    id: String,
    #[command(flatten)]
    server: ServerArgs,
}

#[derive(Args)]
pub struct CreateArgs {
    /// small, medium or large [default: small; with --snapshot, the snapshot's]
    #[arg(long)]
    size: Option<String>,
    /// Lifetime, e.g. 15m, 2h (1 minute .. 24 hours)
    #[arg(long, default_value = "15m")]
    timeout: humantime::Duration,
    #[arg(long)]
    name: Option<String>,
    /// Start from this snapshot (snap_...) on the server at --url, instead
    /// of on this machine
    #[arg(long, value_name = "SNAPSHOT_ID")]
    snapshot: Option<String>,
    /// The server (only with --snapshot)
    #[command(flatten)]
    server: ServerArgs,
    /// Print the whole sandbox object as JSON
    #[arg(long)]
    json: bool,
}

/// Where the snapshot commands find the server. The API key comes from
/// SANDPIT_API_KEY only (a key on the command line ends up in shell history
/// and process lists).
#[derive(Args)]
pub struct ServerArgs {
    /// The Sandpit server's base URL
    #[arg(long, env = "SANDPIT_URL", default_value = "http://127.0.0.1:8080")]
    pub(crate) url: String,
}

#[derive(Args)]
pub struct SnapshotArgs {
    /// The sandbox (sbx_...)
    id: String,
    /// A label of your own
    #[arg(long)]
    name: Option<String>,
    #[command(flatten)]
    server: ServerArgs,
    /// Print the whole snapshot object as JSON
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct ForkArgs {
    /// The sandbox to copy (sbx_...)
    id: String,
    /// How many copies, 1..10
    #[arg(long, default_value_t = 1)]
    count: u32,
    /// Lifetime of each copy, e.g. 15m, 2h [default: the server's]
    #[arg(long)]
    timeout: Option<humantime::Duration>,
    #[command(flatten)]
    server: ServerArgs,
    /// Print the snapshot and the new sandboxes as JSON
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct PauseArgs {
    /// The sandbox (sbx_...)
    id: String,
    #[command(flatten)]
    server: ServerArgs,
    /// Print the whole sandbox object as JSON
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct RestoreArgs {
    /// The sandbox to roll back (sbx_...)
    id: String,
    /// The snapshot to roll it back to (snap_...)
    snapshot_id: String,
    #[command(flatten)]
    server: ServerArgs,
    /// Print the whole sandbox object as JSON
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct SnapshotsArgs {
    #[command(flatten)]
    server: ServerArgs,
    /// Print the snapshots as a JSON array
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct DeleteSnapshotArgs {
    /// The snapshots (snap_...)
    #[arg(required = true)]
    ids: Vec<String>,
    #[command(flatten)]
    server: ServerArgs,
}

#[derive(Args)]
pub struct ExecArgs {
    id: String,
    /// Kill the command after this many milliseconds
    #[arg(long, default_value_t = 60_000)]
    timeout_ms: u64,
    /// Working directory (relative to /workspace, or absolute)
    #[arg(long)]
    cwd: Option<String>,
    /// Environment variables, KEY=VALUE (repeatable)
    #[arg(long = "env", short = 'e')]
    env: Vec<String>,
    /// The command: one argument is taken as a shell command line, several are quoted and joined
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

/// Default output kept per stream.
pub const MAX_OUTPUT: u64 = 1024 * 1024;
/// Largest file `cp` moves out of a sandbox.
const CP_MAX: u64 = 1024 * 1024 * 1024;

/// A VM manager for existing VMs only: never builds an image.
fn existing_manager(settings: &Settings) -> Result<VmManager> {
    let img = images::existing(&settings.images_dir)?;
    Ok(VmManager::new(settings.runtime.clone(), img)?)
}

/// A new sandbox id: `sbx_` and 120 random bits in base32 (as the server makes them).
pub fn new_id() -> String {
    sandpit_host::ids::new_id("sbx_")
}

use sandpit_host::ids::rfc3339;

/// The sandbox object as the CLI shows it.
pub fn to_json(m: &VmManager, r: &VmRecord) -> serde_json::Value {
    let state = m.state(r);
    let (status, reason) = match &state {
        VmState::Running => ("running", None),
        VmState::Exited { cause } => ("failed", Some(cause.clone())),
    };
    serde_json::json!({
        "id": r.id,
        "object": "sandbox",
        "name": r.metadata.get("name"),
        "status": status,
        "deleted_reason": reason.map(|c| format!("failed: {c}")),
        "size": r.size,
        "resources": {"vcpus": r.resources.vcpus, "memory_mb": r.resources.memory_mb, "disk_gb": r.resources.disk_gb},
        "accel": r.accel,
        "kernel": r.kernel_release,
        "timeout_minutes": r.metadata.get("timeout_minutes").and_then(|t| t.parse::<u64>().ok()),
        "created_at": rfc3339(r.created_at),
        "ready_at": r.ready_at.map(rfc3339),
        "expires_at": r.metadata.get("expires_at"),
    })
}

pub async fn run(settings: &Settings, cmd: SandboxCommand) -> Result<i32> {
    // Listing only reads; the rest make, use or remove VMs, which a server
    // on the same data directory owns (see `crate::owner`).
    // The commands that talk to a server touch nothing here.
    let _owner = match cmd {
        SandboxCommand::Ls { .. }
        | SandboxCommand::Snapshot(_)
        | SandboxCommand::Fork(_)
        | SandboxCommand::Restore(_)
        | SandboxCommand::Pause(_)
        | SandboxCommand::Resume(_)
        | SandboxCommand::Snapshots(_)
        | SandboxCommand::DeleteSnapshot(_)
        | SandboxCommand::Shell(_) => None,
        SandboxCommand::Create(CreateArgs {
            snapshot: Some(_), ..
        }) => None,
        _ => Some(sandpit_server::serve::own(
            settings,
            sandpit_server::owner::Role::Cli,
        )?),
    };
    match cmd {
        SandboxCommand::Create(a) => create(settings, a).await,
        SandboxCommand::Exec(a) => exec(settings, a).await,
        SandboxCommand::Cp { src, dst } => cp(settings, &src, &dst).await,
        SandboxCommand::Ls { json } => ls(settings, json),
        SandboxCommand::Rm { ids } => rm(settings, ids).await,
        SandboxCommand::Snapshot(a) => snapshot(a).await,
        SandboxCommand::Fork(a) => fork(a).await,
        SandboxCommand::Restore(a) => restore(a).await,
        SandboxCommand::Pause(a) => pause_or_resume(a, true).await,
        SandboxCommand::Resume(a) => pause_or_resume(a, false).await,
        SandboxCommand::Snapshots(a) => snapshots(a).await,
        SandboxCommand::DeleteSnapshot(a) => delete_snapshots(a).await,
        SandboxCommand::Shell(a) => crate::shell::shell(&a.server.url, &a.id).await,
    }
}

/// Whole minutes of a `--timeout`, which must be 1 minute .. 24 hours.
fn timeout_minutes(timeout: humantime::Duration) -> Result<u32> {
    let timeout: Duration = timeout.into();
    if timeout < Duration::from_secs(60) || timeout > Duration::from_secs(24 * 3600) {
        bail!("--timeout must be between 1m and 24h");
    }
    Ok((timeout.as_secs() / 60) as u32)
}

async fn create(settings: &Settings, a: CreateArgs) -> Result<i32> {
    if let Some(snapshot_id) = a.snapshot.clone() {
        return create_from_snapshot(a, snapshot_id).await;
    }
    let size = a.size.clone().unwrap_or_else(|| "small".into());
    let timeout: Duration = a.timeout.into();
    timeout_minutes(a.timeout)?;
    let m = settings.vm_manager()?;
    let id = new_id();
    let created = OffsetDateTime::now_utc();
    let mut metadata = BTreeMap::new();
    if let Some(n) = &a.name {
        metadata.insert("name".into(), n.clone());
    }
    metadata.insert(
        "timeout_minutes".into(),
        (timeout.as_secs() / 60).to_string(),
    );
    metadata.insert("expires_at".into(), rfc3339(created + timeout));
    ensure_template(&m, &size).await;
    eprintln!("creating {id} ({size}, {} acceleration)...", m.accel());
    let start = Instant::now();
    let vm = m
        .create(CreateVm {
            id: id.clone(),
            size: size.clone(),
            metadata,
            expires_at: created + timeout,
            egress: sandpit_runtime::Egress::open(),
            volumes: Vec::new(),
        })
        .await?;
    eprintln!("{id} is running ({:.1} s)", start.elapsed().as_secs_f64());
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&to_json(&m, &vm.record))?
        );
    } else {
        println!("{id}");
    }
    Ok(0)
}

/// The server at `args.url` as a [`SandboxApi`], and the caller its key
/// (`SANDPIT_API_KEY`) stands for.
pub(crate) async fn server(args: &ServerArgs) -> Result<(sandpit_api::RemoteApi, Caller)> {
    let key = std::env::var(sandpit_api::API_KEY_ENV).map_err(|_| {
        anyhow!(
            "this command talks to a Sandpit server ({}): put an API key of it in {}",
            args.url,
            sandpit_api::API_KEY_ENV
        )
    })?;
    let api = sandpit_api::RemoteApi::new(&args.url).map_err(api_error)?;
    let caller = api.authenticate(&key).await.map_err(api_error)?;
    Ok((api, caller))
}

/// A failure the server reported, with its type (`not_found: ...`).
pub(crate) fn api_error(e: sandpit_core::CoreError) -> anyhow::Error {
    anyhow!("{}: {}", e.kind, e.message)
}

fn print_json<T: serde::Serialize>(value: &T) -> Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

/// A server's answer on stdout: the whole object with `--json`, else the
/// ids it made or names, a line each (what a script takes).
fn print_answer<T: serde::Serialize>(json: bool, value: &T, ids: &[&str]) -> Result<i32> {
    match json {
        true => print_json(value)?,
        false => ids.iter().for_each(|id| println!("{id}")),
    }
    Ok(0)
}

async fn create_from_snapshot(a: CreateArgs, snapshot_id: String) -> Result<i32> {
    let timeout = timeout_minutes(a.timeout)?;
    let (api, caller) = server(&a.server).await?;
    eprintln!(
        "creating a sandbox from {snapshot_id} on {}...",
        a.server.url
    );
    let start = Instant::now();
    let req = CreateSandbox {
        size: a.size,
        name: a.name,
        timeout_minutes: Some(timeout),
        snapshot_id: Some(snapshot_id),
        ..CreateSandbox::default()
    };
    let (sandbox, _) = api
        .create_sandbox(&caller, req, None)
        .await
        .map_err(api_error)?;
    eprintln!(
        "{} is running ({:.1} s)",
        sandbox.id,
        start.elapsed().as_secs_f64()
    );
    print_answer(a.json, &sandbox, &[&sandbox.id])
}

async fn snapshot(a: SnapshotArgs) -> Result<i32> {
    let (api, caller) = server(&a.server).await?;
    let start = Instant::now();
    let req = CreateSnapshot { name: a.name };
    let (snap, _) = api
        .snapshot_sandbox(&caller, &a.id, req, None)
        .await
        .map_err(api_error)?;
    eprintln!(
        "{} of {} is {} ({}, {:.1} s)",
        snap.id,
        a.id,
        snap.status,
        human_bytes(snap.size_bytes),
        start.elapsed().as_secs_f64()
    );
    print_answer(a.json, &snap, &[&snap.id])
}

async fn fork(a: ForkArgs) -> Result<i32> {
    let timeout = a.timeout.map(timeout_minutes).transpose()?;
    let (api, caller) = server(&a.server).await?;
    let start = Instant::now();
    let req = ForkSandbox {
        count: Some(a.count),
        timeout_minutes: timeout,
    };
    let fork = api
        .fork_sandbox(&caller, &a.id, req)
        .await
        .map_err(api_error)?;
    eprintln!(
        "{} copies of {} from {} ({:.1} s)",
        fork.sandboxes.len(),
        a.id,
        fork.snapshot.id,
        start.elapsed().as_secs_f64()
    );
    let ids: Vec<&str> = fork.sandboxes.iter().map(|s| s.id.as_str()).collect();
    print_answer(a.json, &fork, &ids)
}

async fn restore(a: RestoreArgs) -> Result<i32> {
    let (api, caller) = server(&a.server).await?;
    let start = Instant::now();
    let req = RestoreSandbox {
        snapshot_id: a.snapshot_id.clone(),
    };
    let sandbox = api
        .restore_sandbox(&caller, &a.id, req)
        .await
        .map_err(api_error)?;
    eprintln!(
        "{} is back at {} ({:.1} s)",
        sandbox.id,
        a.snapshot_id,
        start.elapsed().as_secs_f64()
    );
    print_answer(a.json, &sandbox, &[&sandbox.id])
}

async fn pause_or_resume(a: PauseArgs, pause: bool) -> Result<i32> {
    let (api, caller) = server(&a.server).await?;
    let start = Instant::now();
    let sandbox = match pause {
        true => api.pause_sandbox(&caller, &a.id).await,
        false => api.resume_sandbox(&caller, &a.id).await,
    }
    .map_err(api_error)?;
    eprintln!(
        "{} is {} ({:.1} s)",
        sandbox.id,
        sandbox.status,
        start.elapsed().as_secs_f64()
    );
    print_answer(a.json, &sandbox, &[&sandbox.id])
}

async fn snapshots(a: SnapshotsArgs) -> Result<i32> {
    let (api, caller) = server(&a.server).await?;
    let mut all: Vec<Snapshot> = Vec::new();
    let mut after = None;
    loop {
        let q = ListSnapshots {
            limit: Some(100),
            starting_after: after,
        };
        let page = api.list_snapshots(&caller, q).await.map_err(api_error)?;
        all.extend(page.data);
        match page.next_cursor {
            Some(c) if page.has_more => after = Some(c),
            _ => break,
        }
    }
    if a.json {
        print_json(&all)?;
        return Ok(0);
    }
    println!(
        "{:<31} {:<8} {:<7} {:>9} {:<30} {:<22} {:<22} NAME",
        "ID", "STATUS", "SIZE", "BYTES", "SANDBOX", "CREATED", "EXPIRES"
    );
    for s in &all {
        println!(
            "{:<31} {:<8} {:<7} {:>9} {:<30} {:<22} {:<22} {}",
            s.id,
            s.status,
            s.size,
            human_bytes(s.size_bytes),
            s.sandbox_id,
            s.created_at,
            s.expires_at,
            s.name.as_deref().unwrap_or("")
        );
    }
    Ok(0)
}

async fn delete_snapshots(a: DeleteSnapshotArgs) -> Result<i32> {
    let (api, caller) = server(&a.server).await?;
    let mut code = 0;
    for id in a.ids {
        match api.delete_snapshot(&caller, &id).await {
            Ok(s) => println!("{}", s.id),
            Err(e) if e.kind == sandpit_core::ErrorType::NotFound => {
                eprintln!("error: no snapshot {id} on {}", a.server.url);
                code = 1;
            }
            Err(e) => return Err(api_error(e)),
        }
    }
    Ok(code)
}

/// Bytes for people: `512 B`, `3.2 MiB`, `1.5 GiB`.
fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut v = n as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.1} {}", UNITS[unit])
}

fn command_line(parts: &[String]) -> String {
    if parts.len() == 1 {
        parts[0].clone()
    } else {
        shell_words::join(parts)
    }
}

async fn exec(settings: &Settings, a: ExecArgs) -> Result<i32> {
    let m = existing_manager(settings)?;
    let vm = m.attach(&a.id).await?;
    let mut env = BTreeMap::new();
    for kv in &a.env {
        let (k, v) = kv
            .split_once('=')
            .ok_or_else(|| anyhow!("--env takes KEY=VALUE, got {kv:?}"))?;
        env.insert(k.to_string(), v.to_string());
    }
    let mut h = vm.agent.exec(ExecRequest {
        command: command_line(&a.command),
        cwd: a.cwd,
        env,
        timeout_ms: a.timeout_ms,
        max_output_bytes: MAX_OUTPUT,
        ..Default::default()
    })?;
    let mut out = std::io::stdout();
    let mut err = std::io::stderr();
    loop {
        tokio::select! {
            ev = h.next() => match ev? {
                GuestExecEvent::Started(_) => {}
                GuestExecEvent::Stdout(b) => { out.write_all(&b)?; out.flush()?; }
                GuestExecEvent::Stderr(b) => { err.write_all(&b)?; err.flush()?; }
                GuestExecEvent::Exited(r) => {
                    if r.stdout_truncated || r.stderr_truncated {
                        eprintln!("sandpit: output past {MAX_OUTPUT} bytes per stream was dropped");
                    }
                    if r.timed_out {
                        eprintln!("sandpit: the command timed out after {} ms and was killed", a.timeout_ms);
                        return Ok(124);
                    }
                    return Ok(match (r.exit_code, r.signal) {
                        (Some(c), _) => c,
                        (None, Some(s)) => 128 + s,
                        _ => 1,
                    });
                }
            },
            _ = tokio::signal::ctrl_c() => {
                h.cancel();
                eprintln!("sandpit: interrupted; the command was killed");
                return Ok(130);
            }
        }
    }
}

enum Loc {
    Local(PathBuf),
    Remote(String, String),
}

fn parse_loc(s: &str) -> Loc {
    match s.split_once(':') {
        Some((id, path)) if id.starts_with("sbx_") => Loc::Remote(id.into(), path.into()),
        _ => Loc::Local(PathBuf::from(s)),
    }
}

async fn cp(settings: &Settings, src: &str, dst: &str) -> Result<i32> {
    let m = existing_manager(settings)?;
    match (parse_loc(src), parse_loc(dst)) {
        (Loc::Local(l), Loc::Remote(id, path)) => {
            let bytes = std::fs::read(&l).with_context(|| format!("reading {}", l.display()))?;
            let vm = m.attach(&id).await?;
            let (p, n) = vm.agent.write_file(&path, &bytes, None).await?;
            eprintln!("wrote {n} bytes to {id}:{p}");
        }
        (Loc::Remote(id, path), Loc::Local(l)) => {
            let vm = m.attach(&id).await?;
            let (p, bytes) = vm.agent.read_file(&path, CP_MAX).await?;
            std::fs::write(&l, &bytes).with_context(|| format!("writing {}", l.display()))?;
            eprintln!("copied {} bytes from {id}:{p}", bytes.len());
        }
        _ => {
            bail!("one side of cp must be a sandbox path (sbx_...:PATH) and the other a local path")
        }
    }
    Ok(0)
}

fn ls(settings: &Settings, json: bool) -> Result<i32> {
    let m = match existing_manager(settings) {
        Ok(m) => m,
        Err(e) if !settings.runtime.vms_dir().exists() => {
            tracing::debug!("no sandboxes yet: {e:#}");
            if json {
                println!("[]");
            }
            return Ok(0);
        }
        Err(e) => return Err(e),
    };
    let mut records = m.list();
    records.reverse(); // newest first
    if json {
        let all: Vec<_> = records.iter().map(|r| to_json(&m, r)).collect();
        println!("{}", serde_json::to_string_pretty(&all)?);
        return Ok(0);
    }
    println!(
        "{:<30} {:<8} {:<7} {:<22} {:<22} NAME",
        "ID", "STATUS", "SIZE", "CREATED", "EXPIRES"
    );
    for r in &records {
        let v = to_json(&m, r);
        println!(
            "{:<30} {:<8} {:<7} {:<22} {:<22} {}",
            r.id,
            v["status"].as_str().unwrap_or("?"),
            r.size,
            v["created_at"].as_str().unwrap_or(""),
            v["expires_at"].as_str().unwrap_or("-"),
            v["name"].as_str().unwrap_or("")
        );
    }
    Ok(0)
}

async fn rm(settings: &Settings, ids: Vec<String>) -> Result<i32> {
    let m = existing_manager(settings)?;
    let mut code = 0;
    for id in ids {
        match m.destroy(&id).await {
            Ok(()) => println!("{id}"),
            Err(RuntimeError::NotFound(_)) => {
                eprintln!("error: no sandbox {id} on this machine");
                code = 1;
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(code)
}

/// Build the size's snapshot template when there is none yet, so this and
/// every later create restores instead of booting. A failure only costs
/// speed: the create boots cold.
async fn ensure_template(m: &VmManager, size: &str) {
    if !m.snapshots_supported() || m.template(size).is_some() {
        return;
    }
    eprintln!(
        "preparing the snapshot template of size {size} (once; about a cold boot and 3 s)..."
    );
    if let Err(e) = m.ensure_template(size).await {
        eprintln!("warning: no snapshot template ({e}); booting cold");
    }
}

/// The main job until the server exists: one sandbox, end to end.
pub async fn demo(settings: &Settings) -> Result<i32> {
    let _owner = sandpit_server::serve::own(settings, sandpit_server::owner::Role::Cli)?;
    let dir = settings.images_dir.clone();
    tokio::task::spawn_blocking(move || images::build(&dir, None)).await??;
    let m = settings.vm_manager()?;
    let id = new_id();
    let t = Instant::now();
    eprintln!("creating sandbox {id} ({} acceleration)...", m.accel());
    let vm = m
        .create(CreateVm {
            id: id.clone(),
            size: "small".into(),
            metadata: BTreeMap::new(),
            // The demo destroys it; should the demo die, it goes anyway.
            expires_at: OffsetDateTime::now_utc() + time::Duration::minutes(15),
            egress: sandpit_runtime::Egress::open(),
            volumes: Vec::new(),
        })
        .await?;
    eprintln!("running after {:.2} s", t.elapsed().as_secs_f64());
    let result = async {
        for cmd in [
            "uname -sr; id; cat /etc/debian_version",
            "python3 -c 'import sys; print(\"python\", sys.version.split()[0])'",
        ] {
            let t = Instant::now();
            let out = vm
                .agent
                .exec_collect(ExecRequest {
                    command: cmd.into(),
                    cwd: None,
                    env: BTreeMap::new(),
                    timeout_ms: 60_000,
                    max_output_bytes: MAX_OUTPUT,
                    ..Default::default()
                })
                .await?;
            println!("$ {cmd}   ({:.2} s)", t.elapsed().as_secs_f64());
            print!("{}", String::from_utf8_lossy(&out.stdout));
            eprint!("{}", String::from_utf8_lossy(&out.stderr));
        }
        vm.agent
            .write_file("hello.txt", b"hello from the host\n", None)
            .await?;
        let (p, back) = vm.agent.read_file("hello.txt", 1024).await?;
        println!("read back {p}: {}", String::from_utf8_lossy(&back).trim());
        anyhow::Ok(())
    }
    .await;
    m.destroy(&id).await?;
    eprintln!("destroyed {id}");
    result.map(|_| 0)
}
