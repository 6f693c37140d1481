//! Admission end to end, on a real `sandpit serve`: a host whose memory
//! budget is spent refuses creates over REST and MCP with
//! `service_unavailable` and a `Retry-After`, keeps no VM for its pool, and
//! says why in `get_service_info`; a host whose VMs burn through the CPU
//! budget refuses until they calm down, then takes sandboxes again.

use crate::common::serve::*;
use crate::common::*;
use rmcp::model::CallToolRequestParams;
use rmcp::ServiceExt;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn args(v: Value) -> serde_json::Map<String, Value> {
    v.as_object().unwrap().clone()
}

/// `POST /v1/sandboxes`: status, `Retry-After` and body.
async fn create(url: &str, key: &str) -> (u16, Option<String>, Value) {
    let r = reqwest::Client::new()
        .post(format!("{url}/v1/sandboxes"))
        .bearer_auth(key)
        .json(&json!({"size": "small", "timeout_minutes": 5}))
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let retry = r
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().to_string());
    (status, retry, r.json().await.unwrap_or(Value::Null))
}

async fn capacity(url: &str) -> Value {
    let v: Value = reqwest::get(format!("{url}/v1/service"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    v["capacity"].clone()
}

#[test]
fn a_host_out_of_memory_refuses_creates_with_retry_after_and_keeps_no_pool() {
    let data = data_dir();
    // A reserve no machine has: every start is over budget.
    let server = Server::start_with(
        &data,
        "[pool]\nsizes = { small = 1 }\n[capacity]\nmemory_reserve_mb = 100000000\n",
    );
    let key = server.admin_key.clone().unwrap();
    rt().block_on(async {
        let cap = capacity(&server.url).await;
        assert_eq!(cap["accepting"], false, "{cap}");
        assert_eq!(cap["limited_by"], "memory", "{cap}");
        assert!(
            cap["reason"].as_str().unwrap().contains("out of memory"),
            "{cap}"
        );
        assert!(cap["memory_total_mb"].as_u64().unwrap() > 0, "{cap}");
        assert_eq!(cap["memory_reserve_mb"], 100000000, "{cap}");
        assert_eq!(cap["room_by_memory"], 0, "{cap}");

        let rest = Rest::new(&server, &key);
        let (_, before) = rest.get("/account").await;
        let (status, retry, body) = create(&server.url, &key).await;
        assert_eq!(status, 503, "{body}");
        assert_eq!(retry.as_deref(), Some("15"), "{body}");
        assert_eq!(body["error"]["type"], "service_unavailable", "{body}");
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("out of memory"),
            "{body}"
        );

        // Over MCP: a tool error an agent can read, and the same figures.
        use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
        use rmcp::transport::StreamableHttpClientTransport;
        let client = ()
            .serve(StreamableHttpClientTransport::from_config(
                StreamableHttpClientTransportConfig::with_uri(format!("{}/v1/mcp", server.url))
                    .auth_header(key.clone()),
            ))
            .await
            .unwrap();
        let info = client
            .call_tool(CallToolRequestParams::new("get_service_info"))
            .await
            .unwrap();
        let info = info.structured_content.unwrap();
        assert_eq!(info["capacity"]["limited_by"], "memory", "{info}");
        let refused = client
            .call_tool(CallToolRequestParams::new("create_sandbox").with_arguments(args(json!({}))))
            .await
            .unwrap();
        assert_eq!(refused.is_error, Some(true));
        let text = format!("{:?}", refused.content);
        assert!(text.contains("out of memory"), "{text}");
        client.cancel().await.unwrap();

        // Nothing was charged, nothing started, the pool stayed empty.
        let (_, list) = rest.get("/sandboxes").await;
        assert_eq!(list["data"].as_array().unwrap().len(), 0, "{list}");
        let (_, after) = rest.get("/account").await;
        assert_eq!(
            after["credit_remaining_usd"], before["credit_remaining_usd"],
            "{before} {after}"
        );
        let (_, info) = rest.get("/service").await;
        assert_eq!(info["fast_start"]["warm_pool"][0]["ready"], 0, "{info}");
    });
    assert!(vm_dirs(&data).is_empty(), "{:?}", vm_dirs(&data));
}

#[test]
fn a_host_whose_vms_spend_the_cpu_budget_refuses_until_they_calm_down() {
    let data = data_dir();
    // Two busy vCPUs of one sandbox are about all of an idle 2-core host;
    // the budget is an eighth of it, over 10 s: low enough that the
    // sandbox spends it on a host busy with other tests (CI's, where a
    // quarter was not reached), high enough that it calms below it idle.
    let server = Server::start_with(
        &data,
        "[pool]\nsizes = {}\n[capacity]\ncpu_budget_percent = 12\ncpu_window_secs = 10\n",
    );
    let key = server.admin_key.clone().unwrap();
    rt().block_on(async {
        let rest = Rest::new(&server, &key);
        let cap = capacity(&server.url).await;
        assert_eq!(cap["accepting"], true, "{cap}");
        assert_eq!(cap["cpu_budget_percent"], 12, "{cap}");
        let (status, _, busy) = create(&server.url, &key).await;
        assert_eq!(status, 201, "{busy}");
        let id = busy["id"].as_str().unwrap().to_string();
        let (s, out) = rest
            .post(
                &format!("/sandboxes/{id}/exec"),
                json!({"command": "for i in 1 2; do setsid sh -c 'while :; do :; done' >/dev/null 2>&1 & done; echo spinning"}),
            )
            .await;
        assert_eq!(s, 200, "{out}");
        // Should the host run out of memory anyway, a VM goes first.
        let qemu = host_processes(&data)
            .into_iter()
            .find(|p| p.role == HostRole::Qemu && p.vm.as_deref() == Some(id.as_str()))
            .expect("the sandbox's QEMU");
        let adj = std::fs::read_to_string(format!("/proc/{}/oom_score_adj", qemu.pid)).unwrap();
        assert_eq!(adj.trim(), "500");
        let limited = wait_for_capacity(&server.url, |c| c["limited_by"] == "cpu").await;
        assert!(limited["cpu_used_percent"].as_f64().unwrap() >= 12.0, "{limited}");
        let (status, retry, body) = create(&server.url, &key).await;
        assert_eq!(status, 503, "{body}");
        assert_eq!(retry.as_deref(), Some("15"));
        assert!(
            body["error"]["message"].as_str().unwrap().contains("CPUs"),
            "{body}"
        );
        // The sandbox already running is served as before.
        let (s, out) = rest
            .post(
                &format!("/sandboxes/{id}/exec"),
                json!({"command": "pkill -f 'while [:]' ; echo calm"}),
            )
            .await;
        assert_eq!(s, 200, "{out}");
        assert_eq!(out["stdout"], "calm\n", "{out}");
        wait_for_capacity(&server.url, |c| c["accepting"] == true).await;
        let (status, _, body) = create(&server.url, &key).await;
        assert_eq!(status, 201, "{body}");
        for id in [id, body["id"].as_str().unwrap().to_string()] {
            let (s, _) = rest
                .call(reqwest::Method::DELETE, &format!("/sandboxes/{id}"), None)
                .await;
            assert_eq!(s, 200);
        }
    });
}

/// The capacity `get_service_info` shows, once `ok` holds (the sampler reads
/// every 5 s; the window is 10 s).
async fn wait_for_capacity(url: &str, ok: impl Fn(&Value) -> bool) -> Value {
    let t = Instant::now();
    loop {
        let cap = capacity(url).await;
        if ok(&cap) {
            return cap;
        }
        assert!(
            t.elapsed() < Duration::from_secs(90),
            "capacity never changed: {cap}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
