//! `sandpit bench`: one command that measures what users feel, on this
//! machine, and prints medians. Times are noisy here (2 shared cores, TCG), so
//! every figure is a median of several runs taken in the same invocation.

use crate::sandbox::{manager, new_id, MAX_OUTPUT};
use crate::settings::Settings;
use anyhow::Result;
use clap::Args;
use sandpit_protocol::ExecRequest;
use sandpit_runtime::CreateVm;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

#[derive(Args)]
pub struct BenchArgs {
    /// Cold creates to time
    #[arg(long, default_value_t = 5)]
    creates: usize,
    /// `true` round trips to time
    #[arg(long, default_value_t = 50)]
    execs: usize,
    /// 16 MiB transfers to time in each direction
    #[arg(long, default_value_t = 5)]
    transfers: usize,
    /// Sandbox size to use
    #[arg(long, default_value = "small")]
    size: String,
    /// Measure only the runtime, not the server's REST and MCP paths
    #[arg(long)]
    skip_control_plane: bool,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let n = v.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn true_cmd() -> ExecRequest {
    ExecRequest {
        command: "true".into(),
        cwd: None,
        env: BTreeMap::new(),
        timeout_ms: 60_000,
        max_output_bytes: MAX_OUTPUT,
    }
}

/// Proportional set size of a process, KiB.
fn pss_kib(pid: u32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
    text.lines()
        .find(|l| l.starts_with("Pss:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}

/// CPU time (user+system) of a process, in clock ticks.
fn cpu_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

pub async fn run(settings: &Settings, a: BenchArgs) -> Result<i32> {
    let m = manager(settings)?;
    eprintln!("accelerator: {}; size {}", m.accel(), a.size);
    let new = |id: String| CreateVm {
        id,
        size: a.size.clone(),
        metadata: BTreeMap::new(),
    };

    let mut creates = Vec::new();
    for i in 0..a.creates {
        let id = new_id();
        let t = Instant::now();
        let vm = m.create(new(id.clone())).await?;
        vm.agent.exec_collect(true_cmd()).await?;
        let s = t.elapsed().as_secs_f64();
        eprintln!("cold create {}/{}: {:.2} s", i + 1, a.creates, s);
        creates.push(s);
        m.destroy(&id).await?;
    }

    let id = new_id();
    let vm = m.create(new(id.clone())).await?;
    let result = async {
        for _ in 0..3 {
            vm.agent.exec_collect(true_cmd()).await?;
        }
        let mut execs = Vec::new();
        for _ in 0..a.execs {
            let t = Instant::now();
            vm.agent.exec_collect(true_cmd()).await?;
            execs.push(t.elapsed().as_secs_f64() * 1000.0);
        }
        let payload: Vec<u8> = (0..16 * 1024 * 1024u32)
            .map(|i| (i * 7 + 3) as u8)
            .collect();
        let mb = payload.len() as f64 / 1e6;
        let (mut writes, mut reads) = (Vec::new(), Vec::new());
        for _ in 0..a.transfers {
            let t = Instant::now();
            vm.agent.write_file("bench.bin", &payload, None).await?;
            writes.push(mb / t.elapsed().as_secs_f64());
            let t = Instant::now();
            let (_, back) = vm.agent.read_file("bench.bin", 64 << 20).await?;
            reads.push(mb / t.elapsed().as_secs_f64());
            anyhow::ensure!(back == payload, "read back differs from what was written");
        }
        // Idle: let the guest settle, then sample memory and CPU.
        tokio::time::sleep(Duration::from_secs(5)).await;
        let pid = vm.record.qemu_pid;
        let passt_pss = vm.record.passt_pid.and_then(pss_kib).unwrap_or(0);
        let mut pss = Vec::new();
        for _ in 0..3 {
            pss.push((pss_kib(pid).unwrap_or(0) + passt_pss) as f64 / 1024.0);
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        let window = Duration::from_secs(10);
        let c0 = cpu_ticks(pid).unwrap_or(0);
        tokio::time::sleep(window).await;
        let c1 = cpu_ticks(pid).unwrap_or(0);
        // SAFETY: sysconf has no preconditions.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
        let idle_cpu = (c1 - c0) as f64 / hz / window.as_secs_f64() * 100.0;
        anyhow::Ok((execs, writes, reads, pss, idle_cpu))
    }
    .await;
    m.destroy(&id).await?;
    let (execs, writes, reads, pss, idle_cpu) = result?;
    let execs_for_ratio = execs.clone();

    println!();
    println!("| measurement ({}) | median |", m.accel());
    println!("|---|---|");
    println!(
        "| cold create to first command ({} runs) | {:.2} s |",
        creates.len(),
        median(creates)
    );
    println!(
        "| `true` exec round trip ({} runs) | {:.2} ms |",
        execs.len(),
        median(execs)
    );
    println!(
        "| write 16 MiB ({} runs) | {:.1} MB/s |",
        writes.len(),
        median(writes)
    );
    println!(
        "| read 16 MiB ({} runs) | {:.1} MB/s |",
        reads.len(),
        median(reads)
    );
    println!(
        "| host PSS of an idle sandbox (QEMU + passt) | {:.1} MiB |",
        median(pss)
    );
    println!(
        "| host CPU of an idle sandbox (10 s) | {:.2} % of one core |",
        idle_cpu
    );
    if a.skip_control_plane {
        return Ok(0);
    }
    let cp = control_plane(settings, &a).await?;
    println!(
        "| create through REST until running ({} runs) | {:.2} s |",
        cp.creates.len(),
        median(cp.creates)
    );
    let list_ms = median(cp.list.clone());
    println!(
        "| MCP `tools/list` over HTTP, loopback ({} calls) | {:.2} ms ({:.0}/s) |",
        cp.list.len(),
        list_ms,
        1000.0 / list_ms
    );
    let get_ms = median(cp.get.clone());
    println!(
        "| MCP `get_sandbox` over HTTP, loopback ({} calls) | {:.2} ms ({:.0}/s) |",
        cp.get.len(),
        get_ms,
        1000.0 / get_ms
    );
    let run_ms = median(cp.run.clone());
    println!(
        "| MCP `run_command(\"true\")` over HTTP ({} calls) | {:.2} ms |",
        cp.run.len(),
        run_ms
    );
    println!(
        "| ratio: MCP `run_command` / direct agent exec | {:.2}x |",
        run_ms / median(execs_for_ratio)
    );
    let p = &cp.preview;
    // The in-guest client is emulated too (TCG here), so on this machine
    // it can be slower than the native client going through the proxy.
    println!(
        "| preview URL: GET 1 KiB, sequential ({} runs) | {:.2} ms (client in the guest: {:.2} ms; added {:+.2} ms; ratio {:.2}) |",
        p.n,
        p.url_ms,
        p.guest_ms,
        p.url_ms - p.guest_ms,
        p.url_ms / p.guest_ms
    );
    println!(
        "| preview URL: requests/s, {PREVIEW_CONCURRENCY} concurrent ({} requests) | {:.0}/s (client in the guest: {:.0}/s; ratio {:.2}) |",
        p.n / PREVIEW_CONCURRENCY * PREVIEW_CONCURRENCY,
        p.url_rps,
        p.guest_rps,
        p.url_rps / p.guest_rps
    );
    Ok(0)
}

struct ControlPlane {
    creates: Vec<f64>,
    list: Vec<f64>,
    get: Vec<f64>,
    run: Vec<f64>,
    preview: PreviewFigures,
}

/// The server in this process (store in a scratch file, VMs in the data
/// directory), driven over loopback by a real HTTP client and rmcp's client.
async fn control_plane(settings: &Settings, a: &BenchArgs) -> Result<ControlPlane> {
    use rmcp::model::CallToolRequestParams;
    use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
    use rmcp::transport::StreamableHttpClientTransport;
    use rmcp::ServiceExt;
    use sandpit_core::SandboxApi;
    use std::sync::Arc;

    let scratch = tempfile::tempdir()?;
    let store = sandpit_store::Store::open_sqlite(scratch.path().join("bench.db")).await?;
    let vms = sandpit_core::backend::LocalVms::new(manager(settings)?);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    let url = format!("http://127.0.0.1:{port}");
    let mut config = settings.service.clone();
    config.preview_scheme = "http".into();
    config.preview_domain = format!("localhost:{port}");
    let svc = sandpit_core::Service::new(config.clone(), store, vms);
    svc.start().await?;
    sandpit_core::admin::create_account(svc.store(), &settings.service, "bench", 1000.0).await?;
    let (key, _) = sandpit_core::admin::create_key(svc.store(), "bench").await?;
    let api: Arc<dyn SandboxApi> = svc.clone();
    let app = sandpit_api::router(api.clone(), sandpit_api::RestConfig::default()).nest_service(
        "/v1/mcp",
        sandpit_mcp::http_service(api, sandpit_mcp::HttpConfig::default()),
    );
    let front = Arc::new(crate::front::Front {
        api: app,
        proxy: crate::proxy::Proxy::new(svc.clone()),
        preview_domain: config.preview_domain.clone(),
        preview_scheme: config.preview_scheme.clone(),
    });
    let server = tokio::spawn(crate::front::serve(
        listener,
        None,
        front,
        std::future::pending(),
    ));

    let http = reqwest::Client::new();
    let mut creates = Vec::new();
    let mut ids = Vec::new();
    for _ in 0..a.creates.max(1) {
        let t = Instant::now();
        let resp = http
            .post(format!("{url}/v1/sandboxes"))
            .bearer_auth(&key)
            .json(&serde_json::json!({"size": a.size}))
            .send()
            .await?;
        anyhow::ensure!(
            resp.status() == 201,
            "create through REST: {}",
            resp.text().await?
        );
        creates.push(t.elapsed().as_secs_f64());
        let v: serde_json::Value = resp.json().await?;
        ids.push(v["id"].as_str().unwrap_or_default().to_string());
    }
    let id = ids[0].clone();
    for other in &ids[1..] {
        http.delete(format!("{url}/v1/sandboxes/{other}"))
            .bearer_auth(&key)
            .send()
            .await?;
    }

    let client = ()
        .serve(StreamableHttpClientTransport::from_config(
            StreamableHttpClientTransportConfig::with_uri(format!("{url}/v1/mcp"))
                .auth_header(key.clone()),
        ))
        .await?;
    let args = |v: serde_json::Value| v.as_object().cloned().unwrap_or_default();
    let (mut list, mut get, mut run) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..200 {
        let t = Instant::now();
        client.list_tools(None).await?;
        list.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    for _ in 0..200 {
        let t = Instant::now();
        let r = client
            .call_tool(
                CallToolRequestParams::new("get_sandbox")
                    .with_arguments(args(serde_json::json!({"sandbox_id": id}))),
            )
            .await?;
        anyhow::ensure!(r.is_error != Some(true), "get_sandbox failed: {r:?}");
        get.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    for _ in 0..a.execs {
        let t = Instant::now();
        let r = client
            .call_tool(
                CallToolRequestParams::new("run_command").with_arguments(args(
                    serde_json::json!({"sandbox_id": id, "command": "true"}),
                )),
            )
            .await?;
        anyhow::ensure!(r.is_error != Some(true), "run_command failed: {r:?}");
        run.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    let _ = client.cancel().await;
    let preview = preview(&http, &url, &key, &id, (a.execs * 2).max(40)).await?;
    http.delete(format!("{url}/v1/sandboxes/{id}"))
        .bearer_auth(&key)
        .send()
        .await?;
    server.abort();
    Ok(ControlPlane {
        creates,
        list,
        get,
        run,
        preview,
    })
}

/// A client loop run inside the guest against the same server: N
/// sequential requests (median latency), then N spread over `C` threads
/// (requests per second). Prints JSON.
const GUEST_CLIENT: &str = r#"
import http.client, json, statistics, sys, threading, time
N, C = int(sys.argv[1]), int(sys.argv[2])
def one():
    t = time.perf_counter()
    c = http.client.HTTPConnection("127.0.0.1", 8000)
    c.request("GET", "/bench.txt"); r = c.getresponse(); r.read(); c.close()
    assert r.status == 200
    return time.perf_counter() - t
one()
lat = [one() for _ in range(N)]
def worker():
    for _ in range(N // C): one()
ts = [threading.Thread(target=worker) for _ in range(C)]
t = time.perf_counter()
for x in ts: x.start()
for x in ts: x.join()
print(json.dumps({"median_ms": statistics.median(lat) * 1000, "rps": (N // C * C) / (time.perf_counter() - t)}))
"#;

/// Concurrent clients in the requests-per-second figures.
const PREVIEW_CONCURRENCY: usize = 8;

/// Through the preview URL vs. from inside the guest, same server (Python's
/// `http.server`, a 1 KiB file): (median ms, requests/s) for each.
struct PreviewFigures {
    n: usize,
    url_ms: f64,
    url_rps: f64,
    guest_ms: f64,
    guest_rps: f64,
}

async fn preview(
    http: &reqwest::Client,
    url: &str,
    key: &str,
    id: &str,
    n: usize,
) -> Result<PreviewFigures> {
    let exec = |command: String| {
        let req = http
            .post(format!("{url}/v1/sandboxes/{id}/exec"))
            .bearer_auth(key)
            .json(&serde_json::json!({"command": command, "timeout_ms": 600_000}));
        async move {
            let v: serde_json::Value = req.send().await?.json().await?;
            anyhow::ensure!(v["exit_code"] == 0, "in the guest: {v}");
            anyhow::Ok(v["stdout"].as_str().unwrap_or_default().to_string())
        }
    };
    exec(format!(
        "mkdir -p /workspace/bench && cd /workspace/bench && head -c 1024 /dev/zero | tr '\\0' x > bench.txt \
         && cat > client.py <<'EOF'\n{GUEST_CLIENT}\nEOF\n\
         (nohup python3 -m http.server 8000 > /tmp/bench-http.log 2>&1 &)"
    ))
    .await?;
    let p: serde_json::Value = http
        .post(format!("{url}/v1/sandboxes/{id}/ports"))
        .bearer_auth(key)
        .json(&serde_json::json!({"port": 8000}))
        .send()
        .await?
        .json()
        .await?;
    let preview = format!("{}/bench.txt", p["url"].as_str().unwrap_or_default());
    // The preview host resolves to this server, as `*.localhost` does in a browser.
    let host = preview
        .trim_start_matches("http://")
        .split(':')
        .next()
        .unwrap_or_default()
        .to_string();
    let addr: std::net::SocketAddr = url.trim_start_matches("http://").parse()?;
    let client = reqwest::Client::builder().resolve(&host, addr).build()?;
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let r = client.get(&preview).send().await?;
        if r.status() == 200 {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the preview URL never answered: {}",
            r.status()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let mut lat = Vec::new();
    for _ in 0..n {
        let t = Instant::now();
        let r = client.get(&preview).send().await?;
        anyhow::ensure!(r.status() == 200, "preview GET: {}", r.status());
        r.bytes().await?;
        lat.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    let per = n / PREVIEW_CONCURRENCY;
    let t = Instant::now();
    let tasks: Vec<_> = (0..PREVIEW_CONCURRENCY)
        .map(|_| {
            let (client, preview) = (client.clone(), preview.clone());
            tokio::spawn(async move {
                for _ in 0..per {
                    let r = client.get(&preview).send().await?;
                    anyhow::ensure!(r.status() == 200, "preview GET: {}", r.status());
                    r.bytes().await?;
                }
                anyhow::Ok(())
            })
        })
        .collect();
    for task in tasks {
        task.await??;
    }
    let url_rps = (per * PREVIEW_CONCURRENCY) as f64 / t.elapsed().as_secs_f64();
    let out = exec(format!(
        "python3 /workspace/bench/client.py {n} {PREVIEW_CONCURRENCY}"
    ))
    .await?;
    let g: serde_json::Value = serde_json::from_str(out.trim())?;
    Ok(PreviewFigures {
        n,
        url_ms: median(lat),
        url_rps,
        guest_ms: g["median_ms"].as_f64().unwrap_or(f64::NAN),
        guest_rps: g["rps"].as_f64().unwrap_or(f64::NAN),
    })
}
