//! `/metrics` end to end: a real `sandpit serve` with real VMs, scraped on
//! its own listener and, behind the token, on the public one, and read by a
//! Prometheus text-format parser; the values move as sandboxes are created,
//! used and destroyed. Then a server without `[metrics]`, whose public
//! listener has no `/metrics`.

use crate::common::serve::*;
use crate::common::*;
use serde_json::json;
use std::time::{Duration, Instant};

const TOKEN: &str = "metrics-token-0123456789abcdef";

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// One scrape, parsed.
struct Scrape(prometheus_parse::Scrape);

impl Scrape {
    /// The sum of the samples of `name` whose labels include `labels` (0
    /// when there is none: a family with no sample yet, or a state no
    /// sandbox is in). A histogram's `_count` and `_sum` are samples of
    /// their own.
    fn value(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.0
            .samples
            .iter()
            .filter(|s| s.metric == name)
            .filter(|s| labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
            .map(|s| match s.value {
                prometheus_parse::Value::Counter(v)
                | prometheus_parse::Value::Gauge(v)
                | prometheus_parse::Value::Untyped(v) => v,
                _ => panic!("{name} is not a single value"),
            })
            .sum()
    }

    fn has(&self, name: &str) -> bool {
        self.0.samples.iter().any(|s| s.metric == name)
    }
}

/// Parses a scrape's text, and checks that every sample names the node.
fn parse(text: &str, node: &str) -> Scrape {
    let lines = text.lines().map(|l| Ok(l.to_string()));
    let scrape = prometheus_parse::Scrape::parse(lines).expect("the Prometheus text format");
    assert!(!scrape.samples.is_empty(), "{text}");
    for s in &scrape.samples {
        assert_eq!(
            s.labels.get("node"),
            Some(node),
            "{} has no node label",
            s.metric
        );
    }
    Scrape(scrape)
}

async fn get(url: &str, token: Option<&str>) -> (u16, String, String) {
    let mut req = reqwest::Client::new().get(url);
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    let resp = req.send().await.unwrap();
    let status = resp.status().as_u16();
    let kind = resp
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    (status, kind, resp.text().await.unwrap())
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .unwrap()
        .trim()
        .to_string()
}

#[test]
fn metrics_move_with_sandboxes_on_their_listener_and_behind_the_token() {
    let data = data_dir();
    let server = Server::start_with(
        &data,
        &format!(
            "[pool]\nsizes = {{ small = 1 }}\n\
             [metrics]\nlisten = \"127.0.0.1:0\"\ntoken = \"{TOKEN}\"\n"
        ),
    );
    let key = server.admin_key.clone().expect("the admin key");
    let line = server
        .wait_for_log("metrics at ", Duration::from_secs(5))
        .expect("the metrics listener's address");
    let own = line.split("metrics at ").nth(1).unwrap().trim().to_string();
    let public = format!("{}/metrics", server.url);
    let node = host_name();
    rt().block_on(async {
        let scrape = || async {
            let (status, kind, text) = get(&own, None).await;
            assert_eq!(status, 200, "{text}");
            assert!(kind.starts_with("text/plain; version=0.0.4"), "{kind}");
            parse(&text, &node)
        };

        // The warm pool fills (building the snapshot template first).
        let deadline = Instant::now() + Duration::from_secs(300);
        let before = loop {
            let m = scrape().await;
            if m.value("sandpit_pool_ready", &[("size", "small")]) == 1.0 {
                break m;
            }
            assert!(Instant::now() < deadline, "the warm pool did not fill");
            tokio::time::sleep(Duration::from_millis(500)).await;
        };
        assert_eq!(
            before.value("sandpit_pool_target", &[("size", "small")]),
            1.0
        );
        assert_eq!(
            before.value("sandpit_sandboxes", &[("state", "running")]),
            0.0
        );
        assert_eq!(before.value("sandpit_credit_reserved_usd", &[]), 0.0);
        assert!(before.value("sandpit_vms", &[]) >= 1.0, "the pool's VM");
        assert_eq!(before.value("sandpit_vms_stopped_disk_full", &[]), 0.0);
        assert!(before.value("sandpit_vm_memory_rss_bytes", &[]) > 0.0);
        assert!(before.value("sandpit_vm_memory_pss_bytes", &[]) > 0.0);
        assert!(before.value("sandpit_vm_cpu_seconds_total", &[]) > 0.0);
        for family in [
            "sandpit_template_builds_total",
            "sandpit_preview_connections_total",
            "sandpit_egress_refused_total",
        ] {
            assert!(before.has(family), "{family} is missing");
        }

        // On the public listener only with the token.
        let (status, _, body) = get(&public, None).await;
        assert_eq!(status, 401, "{body}");
        let err: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(err["error"]["type"], "unauthorized", "{body}");
        let (status, _, _) = get(&public, Some("metrics-token-0123456789abcdeX")).await;
        assert_eq!(status, 401);
        let (status, _, text) = get(&public, Some(TOKEN)).await;
        assert_eq!(status, 200, "{text}");
        parse(&text, &node);

        // Two sandboxes: the first takes the pool's VM; the second finds
        // the pool empty or refilled.
        let api = Rest::new(&server, &key);
        let mut ids = Vec::new();
        for name in ["m1", "m2"] {
            let (st, sbx) = api
                .post("/sandboxes", json!({"name": name, "timeout_minutes": 5}))
                .await;
            assert_eq!(st, 201, "{sbx}");
            ids.push(sbx["id"].as_str().unwrap().to_string());
        }
        let during = scrape().await;
        let moved = |name: &str, labels: &[(&str, &str)]| {
            during.value(name, labels) - before.value(name, labels)
        };
        assert_eq!(
            during.value(
                "sandpit_sandboxes",
                &[("state", "running"), ("size", "small")]
            ),
            2.0
        );
        assert!(during.value("sandpit_credit_reserved_usd", &[]) > 0.0);
        assert_eq!(
            moved("sandpit_sandbox_creates_total", &[("outcome", "ok")]),
            2.0
        );
        assert_eq!(
            moved(
                "sandpit_sandbox_creates_total",
                &[("path", "pool"), ("outcome", "ok")]
            ),
            moved(
                "sandpit_sandbox_create_duration_seconds_count",
                &[("path", "pool")]
            ),
        );
        assert!(
            moved(
                "sandpit_sandbox_create_duration_seconds_count",
                &[("path", "pool")]
            ) >= 1.0
        );
        let came = |path| {
            moved(
                "sandpit_sandbox_create_duration_seconds_count",
                &[("path", path)],
            )
        };
        assert_eq!(came("pool") + came("restore") + came("cold"), 2.0);
        assert_eq!(came("snapshot") + came("new"), 0.0);

        // A command.
        let (st, ex) = api
            .post(
                &format!("/sandboxes/{}/exec", ids[0]),
                json!({"command": "echo hi"}),
            )
            .await;
        assert_eq!((st, ex["stdout"].as_str()), (200, Some("hi\n")), "{ex}");
        // An error.
        let (st, _) = api.get("/sandboxes/sbx_nosuchsandbox").await;
        assert_eq!(st, 404);
        let after_use = scrape().await;
        let moved = |name: &str, labels: &[(&str, &str)]| {
            after_use.value(name, labels) - during.value(name, labels)
        };
        assert_eq!(
            moved("sandpit_execs_total", &[("status", "completed")]),
            1.0
        );
        assert_eq!(
            moved(
                "sandpit_exec_duration_seconds_count",
                &[("status", "completed")]
            ),
            1.0
        );
        assert_eq!(moved("sandpit_errors_total", &[("type", "not_found")]), 1.0);

        // Destroyed, they are no longer counted.
        for id in &ids {
            let (st, d) = api
                .call(reqwest::Method::DELETE, &format!("/sandboxes/{id}"), None)
                .await;
            assert_eq!(st, 200, "{d}");
        }
        let after = scrape().await;
        assert_eq!(after.value("sandpit_sandboxes", &[]), 0.0);
        assert_eq!(after.value("sandpit_credit_reserved_usd", &[]), 0.0);
        assert!(
            after.value("sandpit_vm_cpu_seconds_total", &[])
                >= during.value("sandpit_vm_cpu_seconds_total", &[]),
            "the VMs' CPU time went back when they ended"
        );
    });
    drop(server);

    // Without `[metrics]`, the public listener has no /metrics.
    let data = data_dir();
    let plain = Server::start_with(&data, "[pool]\nsizes = {}\n");
    rt().block_on(async {
        let (status, kind, body) = get(&format!("{}/metrics", plain.url), None).await;
        assert_eq!(status, 404, "{body}");
        assert!(kind.starts_with("application/json"), "{kind}");
        let (status, _, _) = get(&format!("{}/metrics", plain.url), Some(TOKEN)).await;
        assert_eq!(status, 404);
    });
}
