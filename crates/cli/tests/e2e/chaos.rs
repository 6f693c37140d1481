//! Chaos: a real `sandpit serve` on one data directory is SIGKILLed 50
//! times at random moments while clients create, use, extend and destroy
//! sandboxes over REST (and run commands over MCP), and restarted each
//! time. One-minute sandboxes (two per account at most) are never destroyed
//! nor extended by the clients: they expire during the run. Every fifth
//! restart is itself killed early (reconciling, starting the pool) and
//! started again. After every
//! restart, once the server has reconciled (bounded, polled), nothing may
//! be leaked or inconsistent:
//!
//! - every QEMU, passt and expiry watchdog on the host serves a sandbox that
//!   is `running` in the database, or a warm-pool VM this server made;
//! - every VM directory likewise;
//! - no VM is alive past its sandbox's expiry (some sandboxes live 1 minute,
//!   the shortest timeout, so they expire during the run);
//! - every sandbox is `deleted`, `failed` or `running`, and a running one
//!   answers a command; none failed but those whose create a kill cut short
//!   (nothing else here kills a VM);
//! - no execution is left `running` (its server died with it);
//! - the ledger settles: a running sandbox holds its reservation and was
//!   charged nothing yet; an ended one had its whole reservation released
//!   (no leaked hold) and was charged at most that, a failed one nothing;
//!   each account's balance is its ledger's sum;
//! - no request was answered 500, nor "the database is unavailable".
//!
//! Why a test and not a one-off: a crash between any two steps of create,
//! exec, destroy or reconcile is where leaks hide, and only killing a real
//! server at random moments finds the steps no one thought of. The kill
//! moments and the workload come from one seed, printed, so a failure can be
//! replayed: `SANDPIT_CHAOS_SEED=<seed>` (and `SANDPIT_CHAOS_KILLS=<n>` for a
//! shorter or longer run). Timing differs between runs, so a replay is the
//! same plan, not the same interleaving.
//!
//! Latencies (restart to ready, time to settle) go in the printed table;
//! nothing here asserts a duration beyond generous bounds for "never".

use crate::common::serve::*;
use crate::common::*;
use rand::{Rng, SeedableRng};
use serde_json::json;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use time::OffsetDateTime;

/// The pool is kept small (one VM, not grown by bursts, so that more pool
/// VMs than that is a leak) and accounts are limited to a few live
/// sandboxes each, so the whole run fits in memory and on 2 cores.
const EXTRA_CONFIG: &str = "\
[pool]
sizes = { small = 1 }
burst_max = 0
[limits]
max_concurrent_sandboxes = 4
";
const POOL_TARGET: usize = 1;
/// Clients per account.
const WORKERS_PER_ACCOUNT: usize = 2;
const ACCOUNTS: usize = 2;
/// The longest a workload runs before its kill.
const MAX_KILL_AFTER_MS: u64 = 3000;
/// How long reconciliation and the reaper get to reach a clean state.
const SETTLE_BOUND: Duration = Duration::from_secs(30);
/// How long past its expiry a VM may still be seen: the watchdog kills at
/// expiry + 1 s (whole seconds), the reaper at expiry; then the kill itself.
const EXPIRY_SLACK: time::Duration = time::Duration::seconds(4);

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok())
}

/// Outcomes of one kind of operation: HTTP status or what went wrong.
#[derive(Default)]
struct Tally {
    ops: BTreeMap<&'static str, BTreeMap<String, usize>>,
    /// Responses that are bugs whatever the chaos: 500s.
    unexpected: Vec<String>,
    /// The first message of each kind of refusal, for the summary.
    examples: BTreeMap<String, String>,
}

impl Tally {
    fn count(&mut self, op: &'static str, outcome: String) {
        *self.ops.entry(op).or_default().entry(outcome).or_default() += 1;
    }
}

/// What the clients share: the sandboxes each account created, the tally.
struct Shared {
    ids: Vec<Mutex<Vec<String>>>,
    /// Sandboxes of one minute, which no client destroys.
    expiring: Mutex<Vec<String>>,
    tally: Mutex<Tally>,
    stop: AtomicBool,
}

fn rest(url: &str, key: &str) -> Rest {
    Rest {
        http: reqwest::Client::builder()
            .timeout(Duration::from_secs(120))
            .build()
            .unwrap(),
        url: url.to_string(),
        key: key.to_string(),
    }
}

/// One client's loop: random operations on its account's sandboxes, until
/// told to stop (right after the kill, so some of them are cut).
async fn client(shared: Arc<Shared>, api: Rest, account: usize, seed: u64) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    while !shared.stop.load(Ordering::SeqCst) {
        let pick = |rng: &mut rand::rngs::StdRng| {
            let ids = shared.ids[account].lock().unwrap();
            (!ids.is_empty()).then(|| ids[rng.gen_range(0..ids.len())].clone())
        };
        // With nothing to work on, create.
        let roll = if shared.ids[account].lock().unwrap().is_empty() {
            0
        } else {
            rng.gen_range(0..100)
        };
        let (op, result) = if roll < 30 {
            // Some of one minute, left to expire during the run; at most
            // two of those per account, so that the others keep turning over.
            let expiring = {
                let ids = shared.ids[account].lock().unwrap();
                let exp = shared.expiring.lock().unwrap();
                ids.iter().filter(|i| exp.contains(i)).count()
            };
            let minutes = if expiring < 2 && rng.gen_bool(0.5) {
                1
            } else {
                [2, 5][rng.gen_range(0..2)]
            };
            let r = api
                .try_call(
                    reqwest::Method::POST,
                    "/sandboxes",
                    Some(json!({"timeout_minutes": minutes})),
                )
                .await;
            if let Ok((201, v)) = &r {
                if let Some(id) = v["id"].as_str() {
                    shared.ids[account].lock().unwrap().push(id.to_string());
                    // Left to expire: the reaper's (or, while no server
                    // runs, the watchdog's) to end.
                    if minutes == 1 {
                        shared.expiring.lock().unwrap().push(id.to_string());
                    }
                }
            }
            ("create", r)
        } else if roll < 65 {
            let Some(id) = pick(&mut rng) else { continue };
            // Some commands are in flight for a second: the kill finds them.
            let command = if rng.gen_bool(0.3) {
                "sleep 1; echo slow"
            } else {
                "echo fast"
            };
            let r = api
                .try_call(
                    reqwest::Method::POST,
                    &format!("/sandboxes/{id}/exec"),
                    Some(json!({"command": command, "timeout_ms": 30_000})),
                )
                .await;
            ("exec", r)
        } else if roll < 75 {
            let Some(id) = pick(&mut rng) else { continue };
            let r = api
                .try_call(
                    reqwest::Method::PUT,
                    &format!("/sandboxes/{id}/files"),
                    Some(json!({"path": "chaos.txt", "content": "x".repeat(4096)})),
                )
                .await;
            ("write_file", r)
        } else if roll < 92 {
            let Some(id) = pick(&mut rng) else { continue };
            if shared.expiring.lock().unwrap().contains(&id) {
                continue;
            }
            let r = api
                .try_call(reqwest::Method::DELETE, &format!("/sandboxes/{id}"), None)
                .await;
            if let Ok((200, _)) | Ok((404, _)) = &r {
                shared.ids[account].lock().unwrap().retain(|x| *x != id);
            }
            ("destroy", r)
        } else {
            let Some(id) = pick(&mut rng) else { continue };
            if shared.expiring.lock().unwrap().contains(&id) {
                continue;
            }
            let r = api
                .try_call(
                    reqwest::Method::POST,
                    &format!("/sandboxes/{id}/extend"),
                    Some(json!({"additional_minutes": 1})),
                )
                .await;
            ("extend", r)
        };
        let outcome = match &result {
            Ok((st, v)) if *st >= 400 => {
                let label = format!("{st} {}", v["error"]["type"].as_str().unwrap_or("?"));
                let message = v["error"]["message"].as_str().unwrap_or_default();
                shared
                    .tally
                    .lock()
                    .unwrap()
                    .examples
                    .entry(format!("{op} {label}"))
                    .or_insert_with(|| message.to_string());
                label
            }
            Ok((st, _)) => st.to_string(),
            Err(_) if shared.stop.load(Ordering::SeqCst) => "cut by the kill".to_string(),
            Err(e) => format!("transport error: {e}"),
        };
        let mut tally = shared.tally.lock().unwrap();
        if let Ok((st @ 500..=502, v)) = &result {
            tally.unexpected.push(format!("{op}: {st} {v}"));
        }
        // Its own database never goes away: a store error is a bug.
        if let Ok((st, v)) = &result {
            if v["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("database is unavailable"))
            {
                tally.unexpected.push(format!("{op}: {st} {v}"));
            }
        }
        if let Err(e) = &result {
            if !shared.stop.load(Ordering::SeqCst) {
                tally
                    .unexpected
                    .push(format!("{op}: transport error while the server ran: {e}"));
            }
        }
        tally.count(op, outcome);
    }
}

/// Why reconcile fails a sandbox whose create a kill cut short.
const CUT_CREATE: &str = "failed: the server stopped while it was being created";

/// A client over MCP (rmcp, Streamable HTTP), on account 0's sandboxes:
/// `run_command`, or `create_sandbox` when there is none.
async fn mcp_client(shared: Arc<Shared>, url: String, key: String, seed: u64) {
    use rmcp::model::CallToolRequestParams;
    use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
    use rmcp::transport::StreamableHttpClientTransport;
    use rmcp::ServiceExt;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let transport = StreamableHttpClientTransport::from_config(
        StreamableHttpClientTransportConfig::with_uri(format!("{url}/v1/mcp")).auth_header(key),
    );
    let c = match ().serve(transport).await {
        Ok(c) => c,
        Err(e) => {
            let killed = shared.stop.load(Ordering::SeqCst);
            let mut tally = shared.tally.lock().unwrap();
            if !killed {
                tally.unexpected.push(format!("mcp initialize: {e}"));
            }
            tally.count(
                "mcp initialize",
                if killed { "cut by the kill" } else { "error" }.into(),
            );
            return;
        }
    };
    while !shared.stop.load(Ordering::SeqCst) {
        let id = {
            let ids = shared.ids[0].lock().unwrap();
            (!ids.is_empty()).then(|| ids[rng.gen_range(0..ids.len())].clone())
        };
        let (op, params) = match &id {
            Some(id) => (
                "mcp run_command",
                json!({"sandbox_id": id, "command": "echo mcp"}),
            ),
            None => ("mcp create_sandbox", json!({"timeout_minutes": 2})),
        };
        let name = if id.is_some() {
            "run_command"
        } else {
            "create_sandbox"
        };
        let r = c
            .call_tool(
                CallToolRequestParams::new(name)
                    .with_arguments(params.as_object().cloned().unwrap_or_default()),
            )
            .await;
        let killed = shared.stop.load(Ordering::SeqCst);
        let mut tally = shared.tally.lock().unwrap();
        let outcome = match r {
            Ok(r) if r.is_error == Some(true) => {
                let text = r
                    .content
                    .iter()
                    .find_map(|c| c.as_text().map(|t| t.text.clone()))
                    .unwrap_or_default();
                let kind = text.split(':').next().unwrap_or_default().to_string();
                if kind == "internal" || text.contains("database is unavailable") {
                    tally.unexpected.push(format!("{op}: {text}"));
                }
                tally
                    .examples
                    .entry(format!("{op} {kind}"))
                    .or_insert_with(|| text.clone());
                kind
            }
            Ok(r) => {
                if id.is_none() {
                    let sc = r.structured_content.unwrap_or_default();
                    if let Some(new) = sc["id"].as_str() {
                        shared.ids[0].lock().unwrap().push(new.to_string());
                    }
                }
                "ok".to_string()
            }
            Err(_) if killed => "cut by the kill".to_string(),
            Err(e) => {
                tally
                    .unexpected
                    .push(format!("{op}: transport error while the server ran: {e}"));
                "transport error".to_string()
            }
        };
        tally.count(op, outcome);
    }
    // The server may be dead: do not wait on a goodbye.
    let _ = tokio::time::timeout(Duration::from_secs(2), c.cancel()).await;
}

/// A sandbox row as the checks need it.
struct Row {
    id: String,
    account_id: String,
    status: String,
    reason: Option<String>,
    expires_at: OffsetDateTime,
}

/// What one look at the host and the database found.
#[derive(Default)]
struct Census {
    violations: Vec<String>,
    running: Vec<Row>,
}

/// Reads the database (a second connection beside the server's; WAL lets
/// both in).
async fn load_rows(store: &sandpit_store::Store) -> Vec<Row> {
    let rows: Vec<(String, String, String, Option<String>, String)> =
        sqlx::query_as("SELECT id, account_id, status, deleted_reason, expires_at FROM sandboxes")
            .fetch_all(store.pool())
            .await
            .unwrap();
    rows.into_iter()
        .map(|(id, account_id, status, reason, expires)| Row {
            id,
            account_id,
            status,
            reason,
            expires_at: sandpit_store::parse_ts(&expires).unwrap(),
        })
        .collect()
}

/// Is `id` a warm-pool VM made by the server started at `since`? (A pool VM
/// of an earlier, killed server should have been removed at start.)
fn current_pool_vm(data: &Path, id: &str, since: OffsetDateTime) -> Option<bool> {
    let bytes = std::fs::read(data.join("vms").join(id).join("vm.json")).ok()?;
    let record: sandpit_runtime::VmRecord = serde_json::from_slice(&bytes).ok()?;
    Some(record.metadata.contains_key("pool") && record.created_at >= since)
}

/// A process's working directory.
fn cwd_of(pid: u32) -> String {
    std::fs::read_link(format!("/proc/{pid}/cwd"))
        .map(|p| p.display().to_string())
        .unwrap_or_default()
}

/// When a process started, to the clock tick (`/proc/PID/stat`'s start
/// time after the boot time of `/proc/stat`).
fn started_at(pid: u32) -> Option<OffsetDateTime> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The fields after the command name (which may hold spaces), from the
    // third on: the start time is the 22nd.
    let after = &stat[stat.rfind(')')? + 2..];
    let ticks: i64 = after.split_whitespace().nth(19)?.parse().ok()?;
    let boot: i64 = std::fs::read_to_string("/proc/stat")
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("btime ")?.trim().parse().ok())?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as i64;
    let at = OffsetDateTime::from_unix_timestamp(boot).ok()?;
    Some(at + time::Duration::milliseconds(ticks * 1000 / hz.max(1)))
}

/// One look at everything the invariants speak of.
async fn census(
    data: &Path,
    store: &sandpit_store::Store,
    server_pid: u32,
    since: OffsetDateTime,
) -> Census {
    let mut c = Census::default();
    let now = OffsetDateTime::now_utc();
    let rows = load_rows(store).await;
    let by_id: HashMap<&str, &Row> = rows.iter().map(|r| (r.id.as_str(), r)).collect();
    for r in &rows {
        match r.status.as_str() {
            "running" => {
                if r.expires_at + EXPIRY_SLACK < now {
                    c.violations.push(format!(
                        "{} is still running {} s past its expiry",
                        r.id,
                        (now - r.expires_at).whole_seconds()
                    ));
                }
            }
            "deleted" => {}
            // Nothing in this workload kills a VM: the only failure a kill
            // may cause is a create it cut short.
            "failed" if r.reason.as_deref() == Some(CUT_CREATE) => {}
            "failed" => c.violations.push(format!(
                "{} failed: {}",
                r.id,
                r.reason.as_deref().unwrap_or("-")
            )),
            other => c
                .violations
                .push(format!("{} is {other}, neither final nor running", r.id)),
        }
    }
    // A VM (process or directory) must belong to a running sandbox or be a
    // pool VM of this server.
    let owner = |id: &str, what: &str| -> Option<String> {
        match by_id.get(id) {
            Some(r) if r.status == "running" => (r.expires_at + EXPIRY_SLACK < now).then(|| {
                format!(
                    "{what} of {id} alive {} s past its expiry",
                    (now - r.expires_at).whole_seconds()
                )
            }),
            Some(r) => Some(format!(
                "{what} of {id}, which is {} ({})",
                r.status,
                r.reason.as_deref().unwrap_or("-")
            )),
            None => match current_pool_vm(data, id, since) {
                Some(true) => None,
                Some(false) => Some(format!(
                    "{what} of {id}, no sandbox's and not a pool VM of this server"
                )),
                None => Some(format!("{what} of {id}, no sandbox's and no vm.json")),
            },
        }
    };
    let procs = host_processes(data);
    // A snapshot template being built (a restore that failed discards the
    // template, and the pool has the next one built) is this server's when
    // it started after this server did; one a killed server left behind
    // must be stopped by the next build of that size (see the runtime's
    // `remove_others`), before the census settles.
    // (A build is in a hidden directory, `templates/.<size>-<key>.<n>.tmp`;
    // restored VMs name the finished template's files.)
    let builds = format!("{}/templates/.", data.display());
    for p in &procs {
        if p.pid == server_pid {
            continue;
        }
        let what = format!("{:?} (pid {})", p.role, p.pid);
        if p.cmdline.contains(&builds) || cwd_of(p.pid).starts_with(&builds) {
            // (The boot time is in whole seconds: a second's doubt.)
            if started_at(p.pid).is_some_and(|at| at + time::Duration::seconds(1) < since) {
                c.violations.push(format!(
                    "{what} of a snapshot template build outlives the server that started it: {}",
                    p.cmdline
                ));
            }
            continue;
        }
        match (&p.role, &p.vm) {
            (HostRole::Other, _) | (_, None) => c
                .violations
                .push(format!("unexpected process {what}: {}", p.cmdline)),
            (_, Some(id)) => c.violations.extend(owner(id, &what)),
        }
    }
    let dirs = vm_dirs(data);
    for d in &dirs {
        c.violations.extend(owner(d, "VM directory"));
    }
    let pool_vms = dirs
        .iter()
        .filter(|d| !by_id.contains_key(d.as_str()))
        .count();
    if pool_vms > POOL_TARGET + 1 {
        c.violations
            .push(format!("{pool_vms} pool VMs for a pool of {POOL_TARGET}"));
    }
    for r in rows.iter().filter(|r| r.status == "running") {
        let qemu = procs
            .iter()
            .any(|p| p.role == HostRole::Qemu && p.vm.as_deref() == Some(r.id.as_str()));
        if !qemu && r.expires_at > now {
            c.violations.push(format!(
                "{} is running in the database without a QEMU",
                r.id
            ));
        }
    }
    // Nothing runs commands now (the clients are stopped): no execution
    // may still say it is running.
    let stuck: Vec<(String, String)> =
        sqlx::query_as("SELECT id, sandbox_id FROM executions WHERE status = 'running'")
            .fetch_all(store.pool())
            .await
            .unwrap();
    for (exec, sbx) in stuck {
        c.violations.push(format!(
            "execution {exec} of {sbx} is still `running` after the server that ran it died"
        ));
    }
    c.violations.extend(ledger_violations(store, &rows).await);
    c.running = rows.into_iter().filter(|r| r.status == "running").collect();
    c
}

/// The money invariants (see the module doc).
async fn ledger_violations(store: &sandpit_store::Store, rows: &[Row]) -> Vec<String> {
    let mut v = Vec::new();
    let sums: Vec<(String, i64, i64, i64)> = sqlx::query_as(
        "SELECT sandbox_id, \
             COALESCE(SUM(CASE WHEN kind = 'reserve' THEN -amount_micros ELSE 0 END), 0), \
             COALESCE(SUM(CASE WHEN kind = 'release' THEN amount_micros ELSE 0 END), 0), \
             COALESCE(SUM(CASE WHEN kind = 'charge' THEN -amount_micros ELSE 0 END), 0) \
         FROM ledger WHERE sandbox_id IS NOT NULL GROUP BY sandbox_id",
    )
    .fetch_all(store.pool())
    .await
    .unwrap();
    let money: HashMap<String, (i64, i64, i64)> = sums
        .into_iter()
        .map(|(id, r, l, c)| (id, (r, l, c)))
        .collect();
    for row in rows {
        let (reserved, released, charged) = money.get(&row.id).copied().unwrap_or_default();
        let id = &row.id;
        if reserved <= 0 {
            v.push(format!("{id} ({}) reserved nothing", row.status));
            continue;
        }
        match row.status.as_str() {
            "running" if released != 0 || charged != 0 => v.push(format!(
                "running {id} already has released {released} / charged {charged} of {reserved}"
            )),
            "deleted" | "failed" if released != reserved => v.push(format!(
                "leaked hold: {} {id} released {released} of {reserved} µ$",
                row.status
            )),
            "deleted" | "failed" if charged > reserved => {
                v.push(format!("{id} charged {charged} of {reserved} reserved"))
            }
            "failed" if charged != 0 => v.push(format!("failed {id} was charged {charged}")),
            _ => {}
        }
    }
    v
}

/// Poll until the host and the database are clean (or the bound passes):
/// how long it took and the running sandboxes, or what is still wrong.
async fn settle(
    data: &Path,
    server_pid: u32,
    since: OffsetDateTime,
) -> Result<(Duration, Vec<Row>), Vec<String>> {
    let store = sandpit_store::Store::open_sqlite(data.join("sandpit.db"))
        .await
        .unwrap();
    let t = Instant::now();
    let result = loop {
        let c = census(data, &store, server_pid, since).await;
        if c.violations.is_empty() {
            break Ok((t.elapsed(), c.running));
        }
        if t.elapsed() > SETTLE_BOUND {
            break Err(c.violations);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    store.close().await;
    result
}

/// Every running sandbox answers a command (or has just expired); every
/// account's balance, as the API reports it, is its ledger's sum.
async fn usable(data: &Path, keys: &HashMap<String, Rest>, running: &[Row]) -> Vec<String> {
    let mut v = Vec::new();
    for r in running {
        let api = &keys[&r.account_id];
        let (st, ex) = api
            .post(
                &format!("/sandboxes/{}/exec", r.id),
                json!({"command": "echo usable"}),
            )
            .await;
        if st == 200 && ex["stdout"] == "usable\n" {
            continue;
        }
        // Unless it has just expired (the reaper may still be ending it).
        let mut s = json!(null);
        for _ in 0..20 {
            s = api.get(&format!("/sandboxes/{}", r.id)).await.1;
            if s["deleted_reason"] == "expired" || r.expires_at > OffsetDateTime::now_utc() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        if s["deleted_reason"] == "expired" {
            continue;
        }
        v.push(format!(
            "running {} does not answer a command: {st} {ex}; now {s}",
            r.id
        ));
    }
    let store = sandpit_store::Store::open_sqlite(data.join("sandpit.db"))
        .await
        .unwrap();
    for (account, api) in keys {
        let sum = store.balance(account).await.unwrap();
        let (st, a) = api.get("/account").await;
        let reported = a["credit_remaining_usd"].as_f64().unwrap_or(f64::NAN);
        if st != 200 || (reported - sum as f64 / 1e6).abs() > 1e-6 {
            v.push(format!(
                "account {account}: the API says {st} {a}, the ledger sums to {sum} µ$"
            ));
        }
    }
    store.close().await;
    v
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    if v.is_empty() {
        return f64::NAN;
    }
    v[v.len() / 2]
}

#[test]
fn fifty_sigkills_leak_nothing() {
    let seed = env_u64("SANDPIT_CHAOS_SEED").unwrap_or_else(rand::random);
    let kills = env_u64("SANDPIT_CHAOS_KILLS").unwrap_or(50) as usize;
    eprintln!("chaos: seed {seed}, {kills} kills (replay: SANDPIT_CHAOS_SEED={seed})");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let data = data_dir();
    let rt = rt();

    let mut server = Server::start_with(&data, EXTRA_CONFIG);
    let admin = server.admin_key.clone().expect("first start prints a key");
    let mut account_keys = Vec::new();
    for i in 0..ACCOUNTS {
        account_keys.push(server.new_account(&format!("chaos{i}"), 1000.0));
    }
    // Account ids, for the per-account checks.
    let account_ids: Vec<String> = rt.block_on(async {
        let mut ids = Vec::new();
        for k in &account_keys {
            let (st, a) = rest(&server.url, k).get("/account").await;
            assert_eq!(st, 200, "{a}");
            ids.push(a["id"].as_str().unwrap().to_string());
        }
        ids
    });
    // The first start builds the snapshot template and fills the pool:
    // killing that is not this test's subject (a template build has a lease
    // of its own), so the first kill waits for it.
    rt.block_on(async {
        let api = rest(&server.url, &admin);
        let deadline = Instant::now() + Duration::from_secs(300);
        loop {
            let (_, info) = api.get("/service").await;
            if info["fast_start"]["warm_pool"][0]["ready"].as_u64() >= Some(POOL_TARGET as u64) {
                break;
            }
            assert!(Instant::now() < deadline, "the warm pool did not fill");
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    });

    let shared = Arc::new(Shared {
        ids: (0..ACCOUNTS).map(|_| Mutex::new(Vec::new())).collect(),
        expiring: Mutex::new(Vec::new()),
        tally: Mutex::new(Tally::default()),
        stop: AtomicBool::new(false),
    });
    let (mut restarts, mut settles, mut kill_moments) = (Vec::new(), Vec::new(), Vec::new());
    let mut early_kills: Vec<f64> = Vec::new();
    let mut checked_running = 0usize;
    let started_run = Instant::now();
    for kill in 0..kills {
        let kill_after = Duration::from_millis(rng.gen_range(200..MAX_KILL_AFTER_MS));
        kill_moments.push(kill_after.as_secs_f64());
        let worker_seed: u64 = rng.gen();
        let pid = server.child.id();
        let url = server.url.clone();
        rt.block_on(async {
            shared.stop.store(false, Ordering::SeqCst);
            let mut workers = Vec::new();
            for (a, key) in account_keys.iter().enumerate() {
                for w in 0..WORKERS_PER_ACCOUNT {
                    let seed = worker_seed ^ ((a * WORKERS_PER_ACCOUNT + w) as u64 + 1);
                    workers.push(tokio::spawn(client(
                        shared.clone(),
                        rest(&url, key),
                        a,
                        seed,
                    )));
                }
            }
            workers.push(tokio::spawn(mcp_client(
                shared.clone(),
                url.clone(),
                account_keys[0].clone(),
                worker_seed,
            )));
            tokio::time::sleep(kill_after).await;
            // Stopped first, so that what the kill cuts is counted as such;
            // requests in flight stay in flight.
            shared.stop.store(true, Ordering::SeqCst);
            // SAFETY: a plain signal to our own child.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            for w in workers {
                w.await.unwrap();
            }
        });
        server.sigkill();
        // Every fifth time, the next start is killed too, early: while it
        // reconciles what this kill left, or starts its pool.
        if kill % 5 == 4 {
            let early = Duration::from_millis(rng.gen_range(30..800));
            let mut child = sandpit(&data)
                .args(["serve", "--listen", "127.0.0.1:0"])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap();
            std::thread::sleep(early);
            let _ = child.kill();
            let _ = child.wait();
            early_kills.push(early.as_secs_f64());
        }

        let since = OffsetDateTime::now_utc();
        let t = Instant::now();
        server = Server::start_with(&data, EXTRA_CONFIG);
        restarts.push(t.elapsed().as_secs_f64());
        let keys: HashMap<String, Rest> = account_ids
            .iter()
            .zip(&account_keys)
            .map(|(id, k)| (id.clone(), rest(&server.url, k)))
            .collect();
        let pid = server.child.id();
        let problems = rt.block_on(async {
            match settle(&data, pid, since).await {
                Err(v) => v,
                Ok((took, running)) => {
                    settles.push(took.as_secs_f64());
                    checked_running += running.len();
                    usable(&data, &keys, &running).await
                }
            }
        });
        let unexpected = shared.tally.lock().unwrap().unexpected.clone();
        assert!(
            problems.is_empty() && unexpected.is_empty(),
            "after kill {} of {kills} ({:.2} s into its workload; replay with \
             SANDPIT_CHAOS_SEED={seed}):\n  {}\n  {}",
            kill + 1,
            kill_after.as_secs_f64(),
            problems.join("\n  "),
            unexpected.join("\n  ")
        );
        // Forget what ended: the clients work on what still runs.
        for (a, id) in account_ids.iter().enumerate() {
            let running: Vec<String> = rt.block_on(async {
                let (_, l) = keys[id].get("/sandboxes?limit=100").await;
                l["data"]
                    .as_array()
                    .map(|d| {
                        d.iter()
                            .filter_map(|s| s["id"].as_str().map(str::to_string))
                            .collect()
                    })
                    .unwrap_or_default()
            });
            *shared.ids[a].lock().unwrap() = running;
        }
    }
    let run_secs = started_run.elapsed().as_secs_f64();

    // The end: destroy what runs, stop the server; nothing may be left.
    let sandboxes = rt.block_on(async {
        for (a, key) in account_keys.iter().enumerate() {
            let api = rest(&server.url, key);
            let ids = shared.ids[a].lock().unwrap().clone();
            for id in ids {
                let (st, d) = api
                    .call(reqwest::Method::DELETE, &format!("/sandboxes/{id}"), None)
                    .await;
                assert_eq!(st, 200, "{d}");
            }
        }
        let store = sandpit_store::Store::open_sqlite(data.join("sandpit.db"))
            .await
            .unwrap();
        let rows = load_rows(&store).await;
        let v = ledger_violations(&store, &rows).await;
        assert!(v.is_empty(), "at the end:\n  {}", v.join("\n  "));
        store.close().await;
        rows
    });
    drop(server);
    // For a closer look at a run (the data directory goes with the test).
    if let Some(to) = std::env::var_os("SANDPIT_CHAOS_KEEP_DB") {
        std::fs::copy(data.join("sandpit.db"), to).unwrap();
    }
    let gone = Instant::now() + Duration::from_secs(20);
    loop {
        let (procs, dirs) = (host_processes(&data), vm_dirs(&data));
        if procs.is_empty() && dirs.is_empty() {
            break;
        }
        assert!(
            Instant::now() < gone,
            "left after the server stopped: {procs:?} {dirs:?}"
        );
        std::thread::sleep(Duration::from_millis(250));
    }

    let tally = shared.tally.lock().unwrap();
    let mut ended: BTreeMap<String, usize> = BTreeMap::new();
    for r in &sandboxes {
        let reason: String = r
            .reason
            .as_deref()
            .unwrap_or("-")
            .trim_start_matches("failed: ")
            .chars()
            .take(60)
            .collect();
        *ended.entry(format!("{} ({reason})", r.status)).or_default() += 1;
    }
    println!();
    println!("| chaos (seed {seed}) | |");
    println!("|---|---|");
    println!(
        "| SIGKILLs under load / restarts | {kills} / {} |",
        kills + early_kills.len()
    );
    println!(
        "| SIGKILLs of a starting server (reconcile, pool), median moment after spawn | {} ({:.2} s) |",
        early_kills.len(),
        median(early_kills.clone())
    );
    println!(
        "| kill moment into the workload, median / max | {:.2} s / {:.2} s |",
        median(kill_moments.clone()),
        kill_moments.iter().cloned().fold(0.0, f64::max)
    );
    println!(
        "| restart to serving (reconcile included), median / max | {:.2} s / {:.2} s |",
        median(restarts.clone()),
        restarts.iter().cloned().fold(0.0, f64::max)
    );
    println!(
        "| serving to clean (invariants hold), median / max | {:.2} s / {:.2} s |",
        median(settles.clone()),
        settles.iter().cloned().fold(0.0, f64::max)
    );
    for (op, outcomes) in &tally.ops {
        let total: usize = outcomes.values().sum();
        let parts: Vec<String> = outcomes.iter().map(|(o, n)| format!("{o}: {n}")).collect();
        println!("| {op}: {total} attempted | {} |", parts.join(", "));
    }
    println!(
        "| sandboxes at the end, by status (reason) | {} |",
        ended
            .iter()
            .map(|(k, n)| format!("{k}: {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    for (what, message) in &tally.examples {
        println!("| e.g. {what} | {message} |");
    }
    println!("| running sandboxes checked usable after restarts | {checked_running} |");
    println!("| leaks and inconsistencies found | 0 |");
    println!("| the whole run | {run_secs:.0} s |");
}
