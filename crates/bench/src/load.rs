//! `sandpit bench load`: many concurrent MCP clients against one running
//! `sandpit serve`, each its own MCP session over Streamable HTTP (rmcp's
//! client, as an agent connects), looping `tools/list`, `get_usage` and
//! `run_command` until the time is up (each client makes every call at
//! least once, however long that takes). Prints per operation the calls,
//! errors (by kind) and latency percentiles, and exits non-zero if anything
//! failed: the target is no error at all. An answer that says the service
//! is busy and the call safe to retry (a database under its lock) is
//! retried after the seconds it names, as an agent would, and counted apart.
//!
//! Sandboxes are shared: one VM per client does not fit a small host (each
//! restored VM is ~100 MiB of host memory), and what is under test is the
//! control plane's concurrency (HTTP, MCP, the store, one agent channel
//! carrying many commands), not the VM count. The bench creates
//! `--sandboxes` of them spread over the given keys (accounts), gives each
//! client one of its key's sandboxes round-robin, and destroys them at the
//! end. Each command echoes a token of its own and the answer is checked,
//! so a reply routed to the wrong caller is an error too.

use crate::percentile;
use anyhow::{bail, Context, Result};
use clap::Args;
use rmcp::model::CallToolRequestParams;
use rmcp::service::{RoleClient, RunningService};
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::ServiceExt;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Args)]
pub struct LoadArgs {
    /// The server's base URL (its MCP endpoint is URL/v1/mcp)
    #[arg(long, env = "SANDPIT_URL", default_value = "http://127.0.0.1:8080")]
    url: String,
    /// API keys to spread the clients over, one account each (repeat the
    /// flag or separate with commas)
    #[arg(
        long = "key",
        env = "SANDPIT_API_KEY",
        value_delimiter = ',',
        required = true
    )]
    keys: Vec<String>,
    /// Concurrent MCP clients, each its own session
    #[arg(long, default_value_t = 200)]
    clients: usize,
    /// How long the clients loop (each makes every call once, at least)
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// Sandboxes the clients share (at least one per key)
    #[arg(long, default_value_t = 8)]
    sandboxes: usize,
}

/// A call with no answer after this long counts as an error.
const CALL_TIMEOUT: Duration = Duration::from_secs(120);

/// The operations, in the order each client loops them.
const OPS: [&str; 4] = ["initialize", "tools/list", "get_usage", "run_command"];

#[derive(Default)]
struct OpStats {
    /// Milliseconds, every call (failed ones too).
    latencies: Vec<f64>,
    errors: BTreeMap<String, usize>,
}

#[derive(Default)]
struct Stats {
    ops: BTreeMap<&'static str, OpStats>,
    /// Clients that completed each operation at least once.
    completed: BTreeMap<&'static str, usize>,
}

type Client = RunningService<RoleClient, ()>;

async fn connect(url: &str, key: &str) -> Result<Client, String> {
    let transport = StreamableHttpClientTransport::from_config(
        StreamableHttpClientTransportConfig::with_uri(format!("{url}/v1/mcp"))
            .auth_header(key.to_string()),
    );
    ().serve(transport).await.map_err(|e| kind(&e.to_string()))
}

/// An error message shortened to its kind: what tells failures apart in the
/// table (ids, tokens and numbers left out).
fn kind(message: &str) -> String {
    let first = message.lines().next().unwrap_or_default();
    let cut: String = first.chars().take(100).collect();
    cut.split(|c: char| c.is_ascii_digit())
        .collect::<Vec<_>>()
        .join("N")
}

/// Calls answered "unavailable, safe to retry" and tried again, as the
/// answer says (counted apart: an agent acts on them, they are no error).
static RETRIED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
/// Tries of one call that keeps being answered so.
const TRIES: u32 = 4;

/// A tool call's result as the bench needs it: structured content, or why
/// not. A `service_unavailable` that says it is safe to retry (a busy
/// database) is tried again after the seconds it names, as a client would.
async fn tool(c: &Client, name: &'static str, args: Value) -> Result<Value, String> {
    let mut tries = 0;
    loop {
        tries += 1;
        let params = CallToolRequestParams::new(name)
            .with_arguments(args.as_object().cloned().unwrap_or_default());
        let r = c
            .call_tool(params)
            .await
            .map_err(|e| kind(&format!("protocol: {e}")))?;
        if r.is_error != Some(true) {
            return r
                .structured_content
                .ok_or_else(|| "no structuredContent".to_string());
        }
        let text = r
            .content
            .iter()
            .find_map(|c| c.as_text().map(|t| t.text.clone()))
            .unwrap_or_default();
        if !(text.starts_with("service_unavailable") && text.contains("safe to retry"))
            || tries >= TRIES
        {
            return Err(kind(&format!("tool error: {text}")));
        }
        RETRIED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let secs = text
            .split("Retry in ")
            .nth(1)
            .and_then(|rest| rest.split(' ').next()?.parse::<u64>().ok())
            .unwrap_or(1)
            .min(5);
        tokio::time::sleep(Duration::from_secs(secs)).await;
    }
}

/// Time one call; count it.
async fn timed<F: Future<Output = Result<(), String>>>(
    stats: &Mutex<Stats>,
    op: &'static str,
    f: F,
) -> bool {
    let t = Instant::now();
    let r = match tokio::time::timeout(CALL_TIMEOUT, f).await {
        Ok(r) => r,
        Err(_) => Err(format!("no answer within {} s", CALL_TIMEOUT.as_secs())),
    };
    let ms = t.elapsed().as_secs_f64() * 1000.0;
    let mut s = stats.lock().unwrap();
    let o = s.ops.entry(op).or_default();
    o.latencies.push(ms);
    match r {
        Ok(()) => true,
        Err(e) => {
            *o.errors.entry(e).or_default() += 1;
            false
        }
    }
}

/// One client: a session of its own, then the loop until `until`.
async fn client(
    n: usize,
    url: String,
    key: String,
    sandbox: String,
    until: Instant,
    stats: Arc<Mutex<Stats>>,
) {
    let mut done: BTreeMap<&'static str, bool> = BTreeMap::new();
    let mut session = None;
    timed(&stats, "initialize", async {
        session = Some(connect(&url, &key).await?);
        Ok(())
    })
    .await;
    let Some(c) = session else {
        return;
    };
    done.insert("initialize", true);
    // Every client makes each call at least once, however long that takes
    // on a busy host: then the time is up or not.
    let mut i = 0u64;
    let over = |i: u64| i > 1 && Instant::now() >= until;
    loop {
        i += 1;
        if over(i) {
            break;
        }
        let ok = timed(&stats, "tools/list", async {
            let tools = c
                .list_tools(None)
                .await
                .map_err(|e| kind(&format!("protocol: {e}")))?;
            if !tools.tools.iter().any(|t| t.name == "run_command") {
                return Err(format!("{} tools, none is run_command", tools.tools.len()));
            }
            Ok(())
        })
        .await;
        if ok {
            done.insert("tools/list", true);
        }
        if over(i) {
            break;
        }
        let ok = timed(&stats, "get_usage", async {
            let u = tool(&c, "get_usage", json!({})).await?;
            if !u["credit_remaining_usd"].is_number() {
                return Err("usage without credit_remaining_usd".to_string());
            }
            Ok(())
        })
        .await;
        if ok {
            done.insert("get_usage", true);
        }
        if over(i) {
            break;
        }
        let token = format!("load-{n}-{i}");
        let ok = timed(&stats, "run_command", async {
            let ex = tool(
                &c,
                "run_command",
                json!({"sandbox_id": sandbox, "command": format!("echo {token}")}),
            )
            .await?;
            if ex["exit_code"] != 0 || ex["stdout"] != format!("{token}\n").as_str() {
                return Err(kind(&format!("wrong answer: {ex}")));
            }
            Ok(())
        })
        .await;
        if ok {
            done.insert("run_command", true);
        }
    }
    let _ = c.cancel().await;
    let mut s = stats.lock().unwrap();
    for (op, ok) in done {
        if ok {
            *s.completed.entry(op).or_default() += 1;
        }
    }
}

pub async fn run(a: LoadArgs) -> Result<i32> {
    if a.keys.is_empty() || a.clients == 0 {
        bail!("give at least one --key and one client");
    }
    if a.sandboxes < a.keys.len() {
        bail!(
            "--sandboxes {} is fewer than the {} keys: every key needs one",
            a.sandboxes,
            a.keys.len()
        );
    }
    let url = a.url.trim_end_matches('/').to_string();
    // Each client is a connection (or a few) of its own.
    let descriptors = sandpit_server::listener::raise_descriptor_limit();
    eprintln!(
        "load: {} MCP clients over {} keys, {} shared sandboxes, {:?} against {url} (descriptor limit {descriptors})",
        a.clients,
        a.keys.len(),
        a.sandboxes,
        a.duration
    );

    // Set-up: the shared sandboxes, round-robin over the keys.
    let mut owners = Vec::new();
    for key in &a.keys {
        owners.push(
            connect(&url, key)
                .await
                .map_err(anyhow::Error::msg)
                .context("connecting")?,
        );
    }
    let minutes = (a.duration.as_secs() / 60 + 10).min(1440);
    let mut by_key: Vec<Vec<String>> = vec![Vec::new(); a.keys.len()];
    let mut all = Vec::new();
    let created = async {
        for j in 0..a.sandboxes {
            let k = j % a.keys.len();
            let s = tool(
                &owners[k],
                "create_sandbox",
                json!({"timeout_minutes": minutes}),
            )
            .await
            .map_err(|e| anyhow::anyhow!("creating sandbox {j}: {e}"))?;
            let id = s["id"]
                .as_str()
                .context("create_sandbox returned no id")?
                .to_string();
            by_key[k].push(id.clone());
            all.push((k, id));
        }
        anyhow::Ok(())
    }
    .await;
    let result = match created {
        Ok(()) => Ok(drive(&a, &url, &by_key).await),
        Err(e) => Err(e),
    };
    for (k, id) in &all {
        if let Err(e) = tool(&owners[*k], "destroy_sandbox", json!({"sandbox_id": id})).await {
            eprintln!("load: destroying {id}: {e}");
        }
    }
    for o in owners {
        let _ = o.cancel().await;
    }
    let (stats, secs) = result?;
    Ok(report(&a, &stats, secs))
}

/// Run the clients; the stats and how long the load lasted (seconds).
async fn drive(a: &LoadArgs, url: &str, by_key: &[Vec<String>]) -> (Stats, f64) {
    let stats = Arc::new(Mutex::new(Stats::default()));
    let start = Instant::now();
    let until = start + a.duration;
    let tasks: Vec<_> = (0..a.clients)
        .map(|n| {
            let k = n % a.keys.len();
            let mine = &by_key[k];
            let sandbox = mine[(n / a.keys.len()) % mine.len()].clone();
            tokio::spawn(client(
                n,
                url.to_string(),
                a.keys[k].clone(),
                sandbox,
                until,
                stats.clone(),
            ))
        })
        .collect();
    for t in tasks {
        if let Err(e) = t.await {
            let mut s = stats.lock().unwrap();
            *s.ops
                .entry("run_command")
                .or_default()
                .errors
                .entry(format!("client task failed: {e}"))
                .or_default() += 1;
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let stats = std::mem::take(&mut *stats.lock().unwrap());
    (stats, secs)
}

/// Print the table; the exit code (1 if any error, or any client that never
/// completed an operation).
fn report(a: &LoadArgs, s: &Stats, secs: f64) -> i32 {
    println!();
    println!(
        "| {} MCP clients, {} keys, {} sandboxes, {secs:.1} s | calls | errors | p50 ms | p90 ms | p99 ms | max ms | calls/s |",
        a.clients,
        a.keys.len(),
        a.sandboxes
    );
    println!("|---|---|---|---|---|---|---|---|");
    let mut total_errors = 0usize;
    let mut total_calls = 0usize;
    let empty = OpStats::default();
    for op in OPS {
        let o = s.ops.get(op).unwrap_or(&empty);
        let errors: usize = o.errors.values().sum();
        total_errors += errors;
        total_calls += o.latencies.len();
        let max = o.latencies.iter().cloned().fold(f64::NAN, f64::max);
        println!(
            "| {op} | {} | {errors} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} |",
            o.latencies.len(),
            percentile(&o.latencies, 0.5),
            percentile(&o.latencies, 0.9),
            percentile(&o.latencies, 0.99),
            max,
            o.latencies.len() as f64 / secs
        );
    }
    let mut starved = 0usize;
    let completed: Vec<String> = OPS
        .iter()
        .map(|op| {
            let n = s.completed.get(op).copied().unwrap_or(0);
            starved += a.clients - n.min(a.clients);
            format!("{op} {n}/{}", a.clients)
        })
        .collect();
    println!(
        "| total | {total_calls} | {total_errors} | | | | | {:.1} |",
        total_calls as f64 / secs
    );
    println!();
    println!(
        "clients that completed each operation at least once: {}",
        completed.join(", ")
    );
    for op in OPS {
        if let Some(o) = s.ops.get(op) {
            for (e, n) in &o.errors {
                println!("error: {op}: {n} x {e}");
            }
        }
    }
    println!(
        "calls answered \"unavailable, safe to retry\" and tried again: {}",
        RETRIED.load(std::sync::atomic::Ordering::Relaxed)
    );
    println!("errors: {total_errors}");
    if total_errors > 0 || starved > 0 {
        1
    } else {
        0
    }
}
