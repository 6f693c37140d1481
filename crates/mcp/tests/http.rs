//! The server over real Streamable HTTP: `http_service` mounted at `/v1/mcp`
//! in an axum app on 127.0.0.1:0, driven by rmcp's HTTP client and by raw
//! requests where the wire itself is the point (headers, status codes, JSON vs
//! SSE bodies).

mod common;

use common::*;
use rmcp::{
    model::{ProtocolVersion, Tool},
    transport::{
        streamable_http_client::StreamableHttpClientTransportConfig, StreamableHttpClientTransport,
    },
    ClientLifecycleMode, ClientServiceExt, ServiceExt,
};
use sandpit_core::{CoreError, SandboxApi};
use sandpit_mcp::{http_service, CancellationToken, HttpConfig};
use serde_json::{json, Value};
use std::{collections::HashMap, sync::Arc};

enum Key {
    None,
    Bearer(&'static str),
    Header(&'static str),
}

async fn connect(s: &Server, key: Key, version: ProtocolVersion) -> (Client, TestClient) {
    let mut config = StreamableHttpClientTransportConfig::with_uri(s.url.clone());
    match key {
        Key::None => {}
        Key::Bearer(k) => config = config.auth_header(k),
        Key::Header(k) => {
            let mut headers = HashMap::new();
            headers.insert(
                http::HeaderName::from_static("x-api-key"),
                http::HeaderValue::from_static(k),
            );
            config = config.custom_headers(headers);
        }
    }
    let transport = StreamableHttpClientTransport::from_config(config);
    let handler = TestClient::new(version.clone());
    let client = if version == ProtocolVersion::V_2026_07_28 {
        handler
            .clone()
            .serve_with_lifecycle(
                transport,
                ClientLifecycleMode::Discover {
                    preferred_versions: vec![version.clone()],
                },
            )
            .await
            .expect("server/discover")
    } else {
        handler.clone().serve(transport).await.expect("initialize")
    };
    assert_eq!(client.peer_info().unwrap().protocol_version, version);
    (client, handler)
}

const VERSIONS: [ProtocolVersion; 3] = [
    ProtocolVersion::V_2025_06_18,
    ProtocolVersion::V_2025_11_25,
    ProtocolVersion::V_2026_07_28,
];

#[tokio::test]
async fn every_tool_works_with_a_key_in_each_revision() {
    let s = server().await;
    for version in VERSIONS {
        let (c, _) = connect(&s, Key::Bearer(KEY), version.clone()).await;
        assert_eq!(
            c.list_all_tools().await.unwrap().len(),
            TOOLS.len(),
            "{version}"
        );
        happy_paths(&c).await;
        c.cancel().await.unwrap();
    }
    let (c, _) = connect(&s, Key::Header(KEY), ProtocolVersion::V_2025_11_25).await;
    happy_paths(&c).await;
    c.cancel().await.unwrap();
}

#[tokio::test]
async fn without_a_key_only_discovery_works() {
    let s = server().await;
    for version in VERSIONS {
        for key in [Key::None, Key::Bearer("sk_wrong"), Key::Header("sk_wrong")] {
            let (c, _) = connect(&s, key, version.clone()).await;
            let tools = c.list_all_tools().await.unwrap();
            assert_eq!(tools.len(), TOOLS.len());
            let info_tool: &Tool = tools.iter().find(|t| t.name == "get_service_info").unwrap();
            let info = ok(&call(&c, "get_service_info", json!({})).await, info_tool);
            assert_eq!(info["name"], "sandpit");
            for (tool, args) in [
                ("create_sandbox", json!({})),
                ("list_sandboxes", json!({})),
                ("get_usage", json!({})),
                ("get_sandbox", json!({"sandbox_id": "sbx_existing"})),
                ("snapshot_sandbox", json!({"sandbox_id": "sbx_existing"})),
                ("list_snapshots", json!({})),
                // Even with bad arguments, the first thing to fix is the key.
                ("run_command", json!({"nonsense": true})),
            ] {
                let m = err(&call(&c, tool, args).await);
                assert!(
                    m.starts_with("unauthorized: a valid API key is required"),
                    "{m}"
                );
                assert!(m.contains("Authorization: Bearer <key>"), "{m}");
                assert!(m.contains("x-api-key"), "{m}");
            }
            c.cancel().await.unwrap();
        }
    }
    assert!(s.api.calls().is_empty(), "nothing reached the core");
}

#[tokio::test]
async fn run_command_streams_progress_over_sse() {
    let s = server().await;
    for version in [ProtocolVersion::V_2025_11_25, ProtocolVersion::V_2026_07_28] {
        let (c, handler) = connect(&s, Key::Bearer(KEY), version.clone()).await;
        let r = call(
            &c,
            "run_command",
            json!({"sandbox_id": "sbx_existing", "command": "make"}),
        )
        .await;
        assert_ne!(r.is_error, Some(true), "{}", text(&r));
        for _ in 0..100 {
            if handler.progress.lock().unwrap().len() >= 3 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        let messages: Vec<String> = handler
            .progress
            .lock()
            .unwrap()
            .iter()
            .map(|p| p.message.clone().unwrap())
            .collect();
        assert_eq!(messages, ["hello ", "warning\n", "world\n"], "{version}");
        c.cancel().await.unwrap();
    }
}

// ---- raw HTTP ----

fn post(s: &Server, body: Value) -> reqwest::RequestBuilder {
    reqwest::Client::new()
        .post(&s.url)
        .header("accept", "application/json, text/event-stream")
        .header("content-type", "application/json")
        .body(body.to_string())
}

fn tools_call(id: u64, tool: &str, arguments: Value, progress_token: Option<&str>) -> Value {
    let mut params = json!({"name": tool, "arguments": arguments});
    if let Some(t) = progress_token {
        params["_meta"] = json!({"progressToken": t});
    }
    json!({"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": params})
}

fn initialize(version: &str) -> Value {
    json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": version, "capabilities": {},
        "clientInfo": {"name": "raw", "version": "0"}}})
}

/// The JSON-RPC messages of a response body, JSON or SSE.
async fn messages(r: reqwest::Response) -> (String, Vec<Value>) {
    let content_type = r.headers()["content-type"].to_str().unwrap().to_string();
    let body = r.text().await.unwrap();
    let msgs = if content_type.starts_with("application/json") {
        vec![serde_json::from_str(&body).unwrap()]
    } else {
        body.lines()
            .filter_map(|l| l.strip_prefix("data:"))
            .map(str::trim)
            .filter(|d| !d.is_empty())
            .map(|d| serde_json::from_str(d).unwrap())
            .collect()
    };
    (content_type, msgs)
}

#[tokio::test]
async fn another_authorization_scheme_is_refused_as_rest_refuses_it() {
    let s = server().await;
    // Basic credentials beside a valid x-api-key: refused, with the reason,
    // as the REST API refuses them (one reader for both).
    let r = post(&s, tools_call(3, "get_usage", json!({}), None))
        .header("authorization", "Basic dXNlcjpwYXNz")
        .header("x-api-key", KEY)
        .header("mcp-protocol-version", "2025-11-25")
        .send()
        .await
        .unwrap();
    let (_, msgs) = messages(r).await;
    let result = &msgs[0]["result"];
    assert_eq!(result["isError"], true, "{msgs:?}");
    let text = result["content"][0]["text"].as_str().unwrap();
    assert!(text.contains("unsupported Authorization scheme"), "{text}");
    assert!(s.api.calls().is_empty(), "{:?}", s.api.calls());
}

#[tokio::test]
async fn stateless_json_answers_and_exec_without_a_progress_token() {
    let s = server().await;
    let r = post(
        &s,
        tools_call(
            7,
            "run_command",
            json!({"sandbox_id": "sbx_existing", "command": "echo hi"}),
            None,
        ),
    )
    .header("authorization", format!("Bearer {KEY}"))
    .header("mcp-protocol-version", "2025-11-25")
    .send()
    .await
    .unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.headers().get("mcp-session-id").is_none(), "stateless");
    let (ct, msgs) = messages(r).await;
    assert!(ct.starts_with("application/json"), "{ct}");
    let result = &msgs[0]["result"];
    assert_eq!(result["structuredContent"]["stdout"], "ran echo hi\n");
    assert_eq!(result["isError"], false);
    let text: Value = serde_json::from_str(result["content"][0]["text"].as_str().unwrap()).unwrap();
    assert_eq!(text, result["structuredContent"]);
    assert_eq!(s.api.call_names(), ["exec"], "no token: plain exec");

    // With a token: an SSE stream of progress, then the result.
    let r = post(
        &s,
        tools_call(
            8,
            "run_command",
            json!({"sandbox_id": "sbx_existing", "command": "make"}),
            Some("tok-1"),
        ),
    )
    .header("x-api-key", KEY)
    .send()
    .await
    .unwrap();
    assert_eq!(r.status(), 200);
    let (ct, msgs) = messages(r).await;
    assert!(ct.starts_with("text/event-stream"), "{ct}");
    let progress: Vec<&Value> = msgs
        .iter()
        .filter(|m| m["method"] == "notifications/progress")
        .collect();
    assert_eq!(progress.len(), 3, "{msgs:?}");
    assert_eq!(progress[0]["params"]["progressToken"], "tok-1");
    assert_eq!(progress[0]["params"]["message"], "hello ");
    assert_eq!(progress[0]["params"]["_meta"]["sandpit/stream"], "stdout");
    assert_eq!(progress[1]["params"]["_meta"]["sandpit/stream"], "stderr");
    let last = msgs.last().unwrap();
    assert_eq!(last["id"], 8);
    assert_eq!(last["result"]["structuredContent"]["status"], "completed");
    assert_eq!(s.api.call_names(), ["exec", "exec_stream"]);

    // internal_error is the one failure that is a JSON-RPC error.
    s.api
        .fail_next("exec", CoreError::internal("the fake platform broke"));
    let r = post(
        &s,
        tools_call(
            9,
            "run_command",
            json!({"sandbox_id": "sbx_existing", "command": "ls"}),
            None,
        ),
    )
    .header("authorization", format!("bearer {KEY}"))
    .send()
    .await
    .unwrap();
    let (_, msgs) = messages(r).await;
    assert_eq!(msgs[0]["error"]["code"], -32603, "{msgs:?}");
}

#[tokio::test]
async fn initialize_negotiates_over_http() {
    let s = server().await;
    for (asked, answered) in [
        ("2025-06-18", "2025-06-18"),
        ("2025-11-25", "2025-11-25"),
        ("2026-07-28", "2025-11-25"),
        ("2024-11-05", "2025-11-25"),
        ("1999-01-01", "2025-11-25"),
    ] {
        let r = post(&s, initialize(asked)).send().await.unwrap();
        assert_eq!(r.status(), 200, "{asked}");
        let (_, msgs) = messages(r).await;
        let result = &msgs[0]["result"];
        assert_eq!(result["protocolVersion"], answered, "asked {asked}");
        assert!(result["instructions"]
            .as_str()
            .unwrap()
            .contains("uid 1000"));
        assert_eq!(result["serverInfo"]["name"], "sandpit");
    }
    // 2026-07-28's discovery lists exactly the three revisions.
    let discover = json!({"jsonrpc": "2.0", "id": 1, "method": "server/discover", "params": {
        "_meta": {
            "io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientInfo": {"name": "raw", "version": "0"},
            "io.modelcontextprotocol/clientCapabilities": {}}}});
    // (2026-07-28 also wants the SEP-2243 standard headers.)
    let r = post(&s, discover)
        .header("mcp-protocol-version", "2026-07-28")
        .header("mcp-method", "server/discover")
        .send()
        .await
        .unwrap();
    let status = r.status();
    let (_, msgs) = messages(r).await;
    assert_eq!(status, 200, "{msgs:?}");
    assert_eq!(
        msgs[0]["result"]["supportedVersions"],
        json!(["2025-06-18", "2025-11-25", "2026-07-28"]),
        "{msgs:?}"
    );
}

/// The `UnsupportedProtocolVersionError` of a 400 answer: checks its shape
/// (2026-07-28's `schema.ts`) and returns the error object.
async fn unsupported_version(r: reqwest::Response, requested: &str) -> Value {
    assert_eq!(r.status(), 400, "{requested}");
    assert!(
        r.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("application/json"),
        "{requested}: {:?}",
        r.headers()
    );
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["jsonrpc"], "2.0", "{body}");
    let error = &body["error"];
    assert_eq!(error["code"], -32022, "{body}");
    assert_eq!(
        error["data"],
        json!({"supported": ["2025-06-18", "2025-11-25", "2026-07-28"], "requested": requested}),
        "{body}"
    );
    assert!(
        error["message"]
            .as_str()
            .unwrap()
            .contains("2025-06-18, 2025-11-25, 2026-07-28"),
        "{body}"
    );
    body
}

#[tokio::test]
async fn unsupported_protocol_version_is_400_with_the_supported_list() {
    let s = server().await;
    // Revisions rmcp knows but this server does not offer, and unknown ones.
    for v in ["2024-11-05", "2025-03-26", "2030-01-01", "1999-01-01"] {
        let r = post(
            &s,
            json!({"jsonrpc": "2.0", "id": 7, "method": "tools/list"}),
        )
        .header("mcp-protocol-version", v)
        .send()
        .await
        .unwrap();
        let body = unsupported_version(r, v).await;
        assert_eq!(body["id"], 7, "the request's id is echoed: {body}");
    }
    // A stateless (2026-07-28) request names its revision in _meta too.
    let stateless = json!({"jsonrpc": "2.0", "id": "a-1", "method": "tools/list", "params": {
        "_meta": {
            "io.modelcontextprotocol/protocolVersion": "1999-01-01",
            "io.modelcontextprotocol/clientInfo": {"name": "raw", "version": "0"},
            "io.modelcontextprotocol/clientCapabilities": {}}}});
    let r = post(&s, stateless)
        .header("mcp-protocol-version", "1999-01-01")
        .header("mcp-method", "tools/list")
        .send()
        .await
        .unwrap();
    assert_eq!(unsupported_version(r, "1999-01-01").await["id"], "a-1");
    // A body that is not a request: the error has no id.
    let r = reqwest::Client::new()
        .post(&s.url)
        .header("accept", "application/json, text/event-stream")
        .header("content-type", "application/json")
        .header("mcp-protocol-version", "1999-01-01")
        .body("not json")
        .send()
        .await
        .unwrap();
    let body = unsupported_version(r, "1999-01-01").await;
    assert!(body.get("id").is_none(), "{body}");
    assert!(s.api.calls().is_empty());

    let r = post(
        &s,
        json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}),
    )
    .header("mcp-protocol-version", "2025-06-18")
    .send()
    .await
    .unwrap();
    assert_eq!(r.status(), 200);
}

/// What the error is for: a client that prefers a revision this server does
/// not have learns the ones it has from the error, and retries with one.
#[tokio::test]
async fn a_client_asking_for_an_unknown_revision_retries_with_a_supported_one() {
    let s = server().await;
    let future: ProtocolVersion = serde_json::from_value(json!("2030-01-01")).unwrap();
    let transport = StreamableHttpClientTransport::from_config(
        StreamableHttpClientTransportConfig::with_uri(s.url.clone()).auth_header(KEY),
    );
    let c = TestClient::new(ProtocolVersion::V_2026_07_28)
        .serve_with_lifecycle(
            transport,
            ClientLifecycleMode::Discover {
                preferred_versions: vec![future, ProtocolVersion::V_2026_07_28],
            },
        )
        .await
        .expect("server/discover, retried with 2026-07-28");
    assert_eq!(
        c.peer_info().unwrap().protocol_version,
        ProtocolVersion::V_2026_07_28
    );
    assert_eq!(c.list_all_tools().await.unwrap().len(), TOOLS.len());
    c.cancel().await.unwrap();
}

#[tokio::test]
async fn host_and_origin_are_checked() {
    let s = server().await;
    let list = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list"});
    let status = |r: reqwest::Response| r.status().as_u16();

    // DNS rebinding: a foreign Host.
    for host in ["evil.example", "evil.example:80", "localhost.evil.example"] {
        let r = post(&s, list.clone())
            .header("host", host)
            .send()
            .await
            .unwrap();
        assert_eq!(status(r), 403, "Host {host}");
    }
    // Loopback names on any port pass.
    for host in ["localhost:9", "127.0.0.1", "[::1]:8080"] {
        let r = post(&s, list.clone())
            .header("host", host)
            .send()
            .await
            .unwrap();
        assert_eq!(status(r), 200, "Host {host}");
    }
    // Browser origins: only localhost ones.
    for origin in ["https://evil.example", "http://evil.example:1234", "null"] {
        let r = post(&s, list.clone())
            .header("origin", origin)
            .send()
            .await
            .unwrap();
        assert_eq!(status(r), 403, "Origin {origin}");
    }
    for origin in [
        "http://localhost:3000",
        "https://127.0.0.1",
        "http://[::1]:5173",
    ] {
        let r = post(&s, list.clone())
            .header("origin", origin)
            .send()
            .await
            .unwrap();
        assert_eq!(status(r), 200, "Origin {origin}");
    }
    // The check comes before anything else, GET included.
    let r = reqwest::Client::new()
        .get(&s.url)
        .header("host", "evil.example")
        .send()
        .await
        .unwrap();
    assert_eq!(status(r), 403);
    assert!(s.api.calls().is_empty());
}

#[tokio::test]
async fn configured_allow_lists_replace_the_defaults() {
    let api: Arc<dyn SandboxApi> = fake();
    let config = HttpConfig {
        allowed_hosts: vec!["sandpit.example".into()],
        allowed_origins: vec!["https://app.sandpit.example".into()],
        ..HttpConfig::default()
    };
    let app = axum::Router::new().nest_service("/v1/mcp", http_service(api, config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/v1/mcp", listener.local_addr().unwrap());
    let stop = CancellationToken::new();
    let stopped = stop.clone();
    let task = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(stopped.cancelled_owned())
            .await
    });
    let send = |host: &'static str, origin: Option<&'static str>| {
        let mut r = reqwest::Client::new()
            .post(&url)
            .header("accept", "application/json, text/event-stream")
            .header("content-type", "application/json")
            .header("host", host)
            .body(r#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#);
        if let Some(o) = origin {
            r = r.header("origin", o);
        }
        async move { r.send().await.unwrap().status().as_u16() }
    };
    assert_eq!(send("sandpit.example", None).await, 200);
    assert_eq!(
        send("sandpit.example:443", Some("https://app.sandpit.example")).await,
        200
    );
    assert_eq!(send("localhost", None).await, 403);
    assert_eq!(
        send("sandpit.example", Some("http://localhost:3000")).await,
        403
    );
    stop.cancel();
    let _ = task.await;
}

#[tokio::test]
async fn mounts_with_nest_too() {
    let api: Arc<dyn SandboxApi> = fake();
    let app = axum::Router::new().nest("/v1/mcp", http_service(api, HttpConfig::default()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/v1/mcp", listener.local_addr().unwrap());
    let stop = CancellationToken::new();
    let stopped = stop.clone();
    let task = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(stopped.cancelled_owned())
            .await
    });
    let r = reqwest::Client::new()
        .post(&url)
        .header("accept", "application/json, text/event-stream")
        .header("content-type", "application/json")
        .body(initialize("2025-11-25").to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    stop.cancel();
    let _ = task.await;
}

#[tokio::test]
async fn plain_get_is_405() {
    let s = server().await;
    let r = reqwest::Client::new()
        .get(&s.url)
        .header("accept", "text/event-stream")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 405);
    assert_eq!(r.headers()["allow"], "POST");
    let _ = s.addr;
}
