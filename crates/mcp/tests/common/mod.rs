//! What the MCP tests share: an rmcp test client, the calls and checks of
//! every tool, and the HTTP server. They run in front of the in-memory fake
//! `SandboxApi` (`sandpit-fake`, the one the REST tests use too), which
//! records the operations called, so the tests can check what the MCP layer
//! asked of the core (e.g. `exec` vs `exec_stream`). End-to-end tests
//! against real VMs live elsewhere.
#![allow(dead_code)]

use rmcp::{
    model::{
        CallToolRequestParams, CallToolResult, ClientCapabilities, ClientConfig, Implementation,
        NotificationMetaObject, ProgressNotificationParam, ProtocolVersion, Tool,
    },
    service::{NotificationContext, RunningService},
    ClientHandler, RoleClient,
};
use sandpit_core::*;
pub use sandpit_fake::Fake;
use sandpit_mcp::{http_service, CancellationToken, HttpConfig};
use serde_json::{json, Value};
use std::{
    net::SocketAddr,
    sync::{Arc, Mutex},
};

/// The key the tests authenticate with, and its account.
pub const KEY: &str = sandpit_fake::KEY_A;
pub const ACCOUNT: &str = sandpit_fake::ACCOUNT_A;
/// A sandbox of [`ACCOUNT`]'s that every [`fake`] starts with.
pub const EXISTING: &str = "sbx_existing";

/// The fake, with [`EXISTING`] in it (for tests that name a sandbox without
/// creating one).
pub fn fake() -> Arc<Fake> {
    let api = Fake::new();
    api.add_sandbox(ACCOUNT, EXISTING);
    api
}

/// The spec's twelve tools: their names and behaviour never change.
pub const SPEC_TOOLS: [&str; 12] = [
    "create_sandbox",
    "run_command",
    "write_file",
    "read_file",
    "list_files",
    "expose_port",
    "get_sandbox",
    "list_sandboxes",
    "extend_sandbox",
    "destroy_sandbox",
    "get_usage",
    "get_service_info",
];

/// Every tool: the spec's twelve, then snapshots, fork, restore, pause,
/// templates, the network and volumes.
pub const TOOLS: [&str; 24] = [
    "create_sandbox",
    "run_command",
    "write_file",
    "read_file",
    "list_files",
    "expose_port",
    "get_sandbox",
    "list_sandboxes",
    "extend_sandbox",
    "destroy_sandbox",
    "get_usage",
    "get_service_info",
    "snapshot_sandbox",
    "fork_sandbox",
    "restore_sandbox",
    "list_snapshots",
    "delete_snapshot",
    "pause_sandbox",
    "resume_sandbox",
    "list_templates",
    "update_network",
    "list_volumes",
    "create_volume",
    "delete_volume",
];

/// An rmcp client that offers one protocol version at `initialize` and keeps
/// the progress notifications it receives.
#[derive(Clone)]
pub struct TestClient {
    pub version: ProtocolVersion,
    pub progress: Arc<Mutex<Vec<ProgressNotificationParam>>>,
}

impl TestClient {
    pub fn new(version: ProtocolVersion) -> Self {
        TestClient {
            version,
            progress: Arc::default(),
        }
    }
}

impl ClientHandler for TestClient {
    fn get_info(&self) -> ClientConfig {
        ClientConfig::new(
            ClientCapabilities::default(),
            Implementation::new("sandpit-mcp-tests", "0"),
        )
        .with_protocol_version(self.version.clone())
    }

    async fn on_progress(
        &self,
        mut params: ProgressNotificationParam,
        context: NotificationContext<RoleClient>,
    ) {
        // rmcp 3.11 moves the notification's `_meta` out of the params; it
        // lands in the context's extensions (not in `context.meta`, which it
        // leaves empty).
        if params.meta.is_none() {
            params.meta = context
                .extensions
                .get::<NotificationMetaObject>()
                .cloned()
                .or_else(|| (!context.meta.is_empty()).then_some(context.meta));
        }
        self.progress.lock().unwrap().push(params);
    }
}

pub type Client = RunningService<RoleClient, TestClient>;

pub fn args(v: Value) -> serde_json::Map<String, Value> {
    match v {
        Value::Object(m) => m,
        _ => panic!("arguments must be an object"),
    }
}

pub async fn call(client: &Client, tool: &'static str, arguments: Value) -> CallToolResult {
    client
        .call_tool(CallToolRequestParams::new(tool).with_arguments(args(arguments)))
        .await
        .unwrap_or_else(|e| panic!("{tool}: protocol error {e}"))
}

/// The text of a result's content blocks, joined.
pub fn text(r: &CallToolResult) -> String {
    r.content
        .iter()
        .filter_map(|c| c.as_text().map(|t| t.text.clone()))
        .collect::<Vec<_>>()
        .join("\n")
}

/// A successful result: `structuredContent`, the same JSON as the first text
/// block, and every property the tool's output schema requires.
pub fn ok(r: &CallToolResult, tool: &Tool) -> Value {
    assert_ne!(r.is_error, Some(true), "{}: {}", tool.name, text(r));
    let structured = r
        .structured_content
        .clone()
        .unwrap_or_else(|| panic!("{}: no structuredContent", tool.name));
    let first = r.content[0].as_text().expect("a text block").text.clone();
    let parsed: Value = serde_json::from_str(&first).expect("the text block is JSON");
    assert_eq!(
        parsed, structured,
        "{}: text and structuredContent agree",
        tool.name
    );
    let schema = tool.output_schema.as_ref().expect("outputSchema");
    for key in schema["required"].as_array().expect("required list") {
        let key = key.as_str().unwrap();
        assert!(
            structured.get(key).is_some(),
            "{}: structuredContent lacks {key}",
            tool.name
        );
    }
    structured
}

/// An `isError` result; returns its text.
pub fn err(r: &CallToolResult) -> String {
    assert_eq!(r.is_error, Some(true), "expected isError: {r:?}");
    text(r)
}

/// Call every tool's happy path and check the answers.
pub async fn happy_paths(client: &Client) {
    let tools = client.list_all_tools().await.expect("tools/list");
    let tool = |name: &str| tools.iter().find(|t| t.name == name).unwrap().clone();

    let s = ok(
        &call(
            client,
            "create_sandbox",
            json!({"size": "small", "name": "job"}),
        )
        .await,
        &tool("create_sandbox"),
    );
    let id = s["id"].as_str().expect("an id").to_owned();
    assert!(id.starts_with("sbx_"), "{id}");
    assert_eq!(s["name"], "job");
    assert_eq!(s["status"], "running");

    let got = ok(
        &call(client, "get_sandbox", json!({"sandbox_id": id})).await,
        &tool("get_sandbox"),
    );
    assert_eq!(got["object"], "sandbox");
    assert_eq!(got, s);

    let x = ok(
        &call(
            client,
            "write_file",
            json!({"sandbox_id": id, "path": "a.py", "content": "it's \"quoted\"\n"}),
        )
        .await,
        &tool("write_file"),
    );
    assert_eq!(x["path"], "/workspace/a.py");
    assert_eq!(x["bytes"], 14);

    let x = ok(
        &call(
            client,
            "read_file",
            json!({"sandbox_id": id, "path": "a.py"}),
        )
        .await,
        &tool("read_file"),
    );
    assert_eq!(x["content"], "it's \"quoted\"\n");
    assert_eq!(x["encoding"], "utf8");

    let x = ok(
        &call(
            client,
            "list_files",
            json!({"sandbox_id": id, "recursive": false}),
        )
        .await,
        &tool("list_files"),
    );
    assert_eq!(x["entries"][0]["name"], "a.py");
    assert_eq!(x["entries"][0]["type"], "file");

    let x = ok(
        &call(
            client,
            "expose_port",
            json!({"sandbox_id": id, "port": 8000}),
        )
        .await,
        &tool("expose_port"),
    );
    assert_eq!(x["url"], format!("https://8000-{id}.sandpit.test"));

    let x = ok(
        &call(client, "list_sandboxes", json!({"limit": 10})).await,
        &tool("list_sandboxes"),
    );
    assert_eq!(x["object"], "list");
    assert_eq!(x["data"].as_array().unwrap().len(), 2);

    let x = ok(
        &call(
            client,
            "extend_sandbox",
            json!({"sandbox_id": id, "additional_minutes": 30}),
        )
        .await,
        &tool("extend_sandbox"),
    );
    assert_eq!(x["timeout_minutes"], 45);

    let x = ok(
        &call(
            client,
            "run_command",
            json!({"sandbox_id": id, "command": "echo hi", "env": {"A": "1"}}),
        )
        .await,
        &tool("run_command"),
    );
    assert_eq!(x["status"], "completed");
    assert_eq!(x["exit_code"], 0);

    // Snapshot, break, restore; fork; start from the snapshot; delete it.
    let snap = ok(
        &call(
            client,
            "snapshot_sandbox",
            json!({"sandbox_id": id, "name": "before"}),
        )
        .await,
        &tool("snapshot_sandbox"),
    );
    let snap_id = snap["id"].as_str().expect("a snapshot id").to_owned();
    assert!(snap_id.starts_with("snap_"), "{snap_id}");
    assert_eq!(snap["object"], "snapshot");
    assert_eq!(snap["name"], "before");
    assert_eq!(snap["sandbox_id"], id.as_str());
    ok(
        &call(
            client,
            "write_file",
            json!({"sandbox_id": id, "path": "a.py", "content": "broken"}),
        )
        .await,
        &tool("write_file"),
    );
    let x = ok(
        &call(
            client,
            "restore_sandbox",
            json!({"sandbox_id": id, "snapshot_id": snap_id}),
        )
        .await,
        &tool("restore_sandbox"),
    );
    assert_eq!(x["id"], id.as_str());
    assert_eq!(x["status"], "running");
    // Paused, then resumed by the next call that needs its VM.
    let x = ok(
        &call(client, "pause_sandbox", json!({"sandbox_id": id})).await,
        &tool("pause_sandbox"),
    );
    assert_eq!(x["status"], "paused");
    let x = ok(
        &call(
            client,
            "read_file",
            json!({"sandbox_id": id, "path": "a.py"}),
        )
        .await,
        &tool("read_file"),
    );
    assert_eq!(x["content"], "it's \"quoted\"\n", "restored");
    let x = ok(
        &call(client, "get_sandbox", json!({"sandbox_id": id})).await,
        &tool("get_sandbox"),
    );
    assert_eq!(x["status"], "running", "resumed by read_file");
    let x = ok(
        &call(client, "resume_sandbox", json!({"sandbox_id": id})).await,
        &tool("resume_sandbox"),
    );
    assert_eq!(x["status"], "running");

    let fork = ok(
        &call(
            client,
            "fork_sandbox",
            json!({"sandbox_id": id, "count": 2, "timeout_minutes": 10}),
        )
        .await,
        &tool("fork_sandbox"),
    );
    assert_eq!(fork["snapshot"]["sandbox_id"], id.as_str());
    let copies = fork["sandboxes"].as_array().expect("sandboxes");
    assert_eq!(copies.len(), 2);
    assert_eq!(copies[0]["timeout_minutes"], 10);
    assert_ne!(copies[0]["id"], copies[1]["id"]);

    let from = ok(
        &call(
            client,
            "create_sandbox",
            json!({"snapshot_id": snap_id, "name": "from-snapshot"}),
        )
        .await,
        &tool("create_sandbox"),
    );
    let x = ok(
        &call(
            client,
            "read_file",
            json!({"sandbox_id": from["id"], "path": "a.py"}),
        )
        .await,
        &tool("read_file"),
    );
    assert_eq!(
        x["content"], "it's \"quoted\"\n",
        "started from the snapshot"
    );

    let x = ok(
        &call(client, "list_snapshots", json!({"limit": 10})).await,
        &tool("list_snapshots"),
    );
    assert_eq!(x["object"], "list");
    let listed: Vec<&str> = x["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["id"].as_str().unwrap())
        .collect();
    assert_eq!(
        listed,
        [fork["snapshot"]["id"].as_str().unwrap(), snap_id.as_str()],
        "newest first"
    );
    let x = ok(
        &call(client, "delete_snapshot", json!({"snapshot_id": snap_id})).await,
        &tool("delete_snapshot"),
    );
    assert_eq!(x["id"], snap_id.as_str());
    assert_eq!(x["status"], "deleted");
    // Leave the account as it was (a server may serve several runs).
    call(
        client,
        "delete_snapshot",
        json!({"snapshot_id": fork["snapshot"]["id"]}),
    )
    .await;
    for extra in copies.iter().chain([&from]) {
        ok(
            &call(
                client,
                "destroy_sandbox",
                json!({"sandbox_id": extra["id"]}),
            )
            .await,
            &tool("destroy_sandbox"),
        );
    }

    let x = ok(
        &call(client, "get_usage", json!({"days": 7})).await,
        &tool("get_usage"),
    );
    assert_eq!(x["period_days"], 7);

    let x = ok(
        &call(client, "get_service_info", json!({})).await,
        &tool("get_service_info"),
    );
    assert_eq!(x["acceleration"], "tcg");

    let x = ok(
        &call(client, "destroy_sandbox", json!({"sandbox_id": id})).await,
        &tool("destroy_sandbox"),
    );
    assert_eq!(x["status"], "deleted");
}

/// `http_service` over the fake, mounted at `/v1/mcp` in an axum app on
/// 127.0.0.1:0 with the default `HttpConfig`; stopped when dropped.
pub struct Server {
    pub addr: SocketAddr,
    pub url: String,
    pub api: Arc<Fake>,
    shutdown: CancellationToken,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

pub async fn server() -> Server {
    let api = fake();
    let config = HttpConfig::default();
    let shutdown = config.shutdown.clone();
    let dyn_api: Arc<dyn SandboxApi> = api.clone();
    let app = axum::Router::new().nest_service("/v1/mcp", http_service(dyn_api, config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stop = shutdown.clone();
    tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(stop.cancelled_owned())
            .await
    });
    Server {
        addr,
        url: format!("http://{addr}/v1/mcp"),
        api,
        shutdown,
    }
}
