//! The preview path's figures: a 1 KiB GET through a preview URL against
//! the same server reached from inside the guest, sequential and
//! concurrent, so the proxy's cost is a ratio taken in one run.

use super::*;

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
pub(crate) const PREVIEW_CONCURRENCY: usize = 8;

/// Through the preview URL vs. from inside the guest, same server (Python's
/// `http.server`, a 1 KiB file): (median ms, requests/s) for each.
pub(crate) struct PreviewFigures {
    pub(crate) n: usize,
    pub(crate) url_ms: f64,
    pub(crate) url_rps: f64,
    pub(crate) guest_ms: f64,
    pub(crate) guest_rps: f64,
}

pub(crate) async fn preview(
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
