//! A fake `SandboxApi` and an rmcp test client, shared by the adapter tests.
//! The fake answers from memory and records which operations were called, so
//! the tests can check what the MCP layer asked of the core (e.g. `exec` vs
//! `exec_stream`). End-to-end tests against real VMs live elsewhere.
#![allow(dead_code)]

use async_trait::async_trait;
use rmcp::{
    model::{
        CallToolRequestParams, CallToolResult, ClientCapabilities, ClientConfig, Implementation,
        NotificationMetaObject, ProgressNotificationParam, ProtocolVersion, Tool,
    },
    service::{NotificationContext, RunningService},
    ClientHandler, RoleClient,
};
use sandpit_core::*;
use sandpit_mcp::{http_service, CancellationToken, HttpConfig};
use serde_json::{json, Value};
use std::{
    collections::HashMap,
    net::SocketAddr,
    sync::{Arc, Mutex},
};
use tokio::sync::mpsc;

pub const KEY: &str = "sk_test_alice";
pub const ACCOUNT: &str = "acct_alice";

pub const TOOLS: [&str; 12] = [
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

#[derive(Default)]
pub struct FakeApi {
    /// Operation names, in call order, with the caller's account.
    pub calls: Mutex<Vec<String>>,
    sandboxes: Mutex<HashMap<String, Sandbox>>,
    /// What `get_service_info` says the limits are.
    pub limits: Mutex<sandpit_core::Limits>,
}

fn now() -> String {
    "2026-01-01T00:00:00Z".to_string()
}

fn sandbox(id: &str, size: &str, name: Option<String>, timeout: u32) -> Sandbox {
    Sandbox {
        id: id.to_string(),
        object: "sandbox".into(),
        name,
        status: SandboxStatus::Running,
        size: size.to_string(),
        resources: Resources {
            vcpus: 2,
            memory_mb: 4096,
            disk_gb: 40,
        },
        timeout_minutes: timeout,
        created_at: now(),
        ready_at: Some(now()),
        expires_at: "2026-01-01T00:15:00Z".into(),
        deleted_at: None,
        deleted_reason: None,
        disk_used_bytes: 0,
    }
}

fn execution(sandbox_id: &str, status: ExecutionStatus, stdout: &str, stderr: &str) -> Execution {
    Execution {
        id: "exec_1".into(),
        object: "execution".into(),
        sandbox_id: sandbox_id.to_string(),
        status,
        exit_code: (status == ExecutionStatus::Completed).then_some(0),
        stdout: stdout.to_string(),
        stderr: stderr.to_string(),
        truncated: false,
        duration_ms: 12,
        started_at: now(),
        finished_at: Some(now()),
    }
}

impl FakeApi {
    pub fn new() -> Arc<Self> {
        let api = FakeApi::default();
        api.sandboxes.lock().unwrap().insert(
            "sbx_existing".into(),
            sandbox("sbx_existing", "small", None, 15),
        );
        Arc::new(api)
    }

    pub fn calls(&self) -> Vec<String> {
        self.calls.lock().unwrap().clone()
    }

    fn record(&self, caller: &Caller, op: &str) {
        assert_eq!(
            caller.account_id, ACCOUNT,
            "{op} acts for the key's account"
        );
        self.calls.lock().unwrap().push(op.to_string());
    }

    fn live(&self, id: &str) -> Result<Sandbox, CoreError> {
        self.sandboxes
            .lock()
            .unwrap()
            .get(id)
            .cloned()
            .ok_or_else(|| CoreError::not_found("sandbox", id))
    }
}

#[async_trait]
impl SandboxApi for FakeApi {
    async fn authenticate(&self, api_key: &str) -> Result<Caller, CoreError> {
        if api_key == KEY {
            Ok(Caller {
                account_id: ACCOUNT.into(),
            })
        } else {
            Err(CoreError::unauthorized())
        }
    }

    async fn create_sandbox(
        &self,
        caller: &Caller,
        req: CreateSandbox,
        _idempotency_key: Option<String>,
    ) -> Result<(Sandbox, bool), CoreError> {
        self.record(caller, "create_sandbox");
        let size = req.size.unwrap_or_else(|| "small".into());
        if !["small", "medium", "large"].contains(&size.as_str()) {
            return Err(CoreError::invalid(format!(
                "unknown size {size:?}; use small, medium or large"
            )));
        }
        if req.timeout_minutes == Some(1440) {
            return Err(CoreError::new(
                ErrorType::InsufficientCredits,
                "the credit cannot cover 1440 minutes of a small sandbox",
            ));
        }
        let s = sandbox(
            "sbx_new",
            &size,
            req.name,
            req.timeout_minutes.unwrap_or(15),
        );
        self.sandboxes
            .lock()
            .unwrap()
            .insert(s.id.clone(), s.clone());
        Ok((s, false))
    }

    async fn get_sandbox(&self, caller: &Caller, id: &str) -> Result<Sandbox, CoreError> {
        self.record(caller, "get_sandbox");
        self.live(id)
    }

    async fn list_sandboxes(
        &self,
        caller: &Caller,
        q: ListSandboxes,
    ) -> Result<List<Sandbox>, CoreError> {
        self.record(caller, "list_sandboxes");
        let mut data: Vec<Sandbox> = self.sandboxes.lock().unwrap().values().cloned().collect();
        data.sort_by(|a, b| a.id.cmp(&b.id));
        data.truncate(q.limit.unwrap_or(20) as usize);
        Ok(List::new(data, false, None))
    }

    async fn extend_sandbox(
        &self,
        caller: &Caller,
        id: &str,
        additional_minutes: Option<u32>,
    ) -> Result<Sandbox, CoreError> {
        self.record(caller, "extend_sandbox");
        let mut s = self.live(id)?;
        s.timeout_minutes += additional_minutes.unwrap_or(15);
        Ok(s)
    }

    async fn destroy_sandbox(&self, caller: &Caller, id: &str) -> Result<Sandbox, CoreError> {
        self.record(caller, "destroy_sandbox");
        let mut s = self.live(id)?;
        s.status = SandboxStatus::Deleted;
        s.deleted_at = Some(now());
        s.deleted_reason = Some("destroyed".into());
        Ok(s)
    }

    async fn exec(
        &self,
        caller: &Caller,
        id: &str,
        params: ExecParams,
    ) -> Result<Execution, CoreError> {
        self.record(caller, "exec");
        self.live(id)?;
        match params.command.as_str() {
            "boom" => Err(CoreError::internal("the fake platform broke")),
            "sleep 1000" => Ok(execution(id, ExecutionStatus::TimedOut, "partial\n", "")),
            cmd => Ok(execution(
                id,
                ExecutionStatus::Completed,
                &format!("ran {cmd}\n"),
                "",
            )),
        }
    }

    async fn exec_stream(
        &self,
        caller: &Caller,
        id: &str,
        params: ExecParams,
    ) -> Result<ExecStream, CoreError> {
        self.record(caller, "exec_stream");
        self.live(id)?;
        if params.command == "boom" {
            return Err(CoreError::internal("the fake platform broke"));
        }
        let status = match params.command.as_str() {
            "sleep 1000" => ExecutionStatus::TimedOut,
            _ => ExecutionStatus::Completed,
        };
        let (tx, rx) = mpsc::channel(8);
        let id = id.to_string();
        tokio::spawn(async move {
            let events = [
                ExecEvent::Stdout("hello ".into()),
                ExecEvent::Stderr("warning\n".into()),
                ExecEvent::Stdout("world\n".into()),
                ExecEvent::Exit(execution(
                    &id,
                    status,
                    &format!("hello world\n[{}]", params.command),
                    "warning\n",
                )),
            ];
            for e in events {
                if tx.send(e).await.is_err() {
                    return;
                }
            }
        });
        Ok(ExecStream {
            events: rx,
            cancel: None,
        })
    }

    async fn get_execution(&self, caller: &Caller, exec_id: &str) -> Result<Execution, CoreError> {
        self.record(caller, "get_execution");
        Err(CoreError::not_found("execution", exec_id))
    }

    async fn write_file(
        &self,
        caller: &Caller,
        id: &str,
        req: WriteFile,
    ) -> Result<FileWritten, CoreError> {
        self.record(caller, "write_file");
        self.live(id)?;
        Ok(FileWritten {
            path: format!("/workspace/{}", req.path),
            bytes: req.content.len() as u64,
        })
    }

    async fn read_file(
        &self,
        caller: &Caller,
        id: &str,
        path: &str,
        encoding: Encoding,
    ) -> Result<FileContent, CoreError> {
        self.record(caller, "read_file");
        self.live(id)?;
        if path == "binary.bin" && encoding == Encoding::Utf8 {
            return Err(CoreError::invalid(
                "binary.bin is not UTF-8 text; read it with encoding base64",
            ));
        }
        Ok(FileContent {
            path: format!("/workspace/{path}"),
            content: "it's \"quoted\"\n".into(),
            bytes: 14,
            encoding,
        })
    }

    async fn list_files(
        &self,
        caller: &Caller,
        id: &str,
        path: Option<&str>,
        recursive: bool,
    ) -> Result<FileList, CoreError> {
        self.record(caller, &format!("list_files recursive={recursive}"));
        self.live(id)?;
        Ok(FileList {
            path: path.unwrap_or("/workspace").to_string(),
            entries: vec![FileEntry {
                name: "out.txt".into(),
                kind: EntryType::File,
                size_bytes: 3,
            }],
            truncated: false,
        })
    }

    async fn delete_file(
        &self,
        caller: &Caller,
        _id: &str,
        path: &str,
        _recursive: bool,
    ) -> Result<FileDeleted, CoreError> {
        self.record(caller, "delete_file");
        Ok(FileDeleted {
            path: path.to_string(),
            deleted: true,
        })
    }

    async fn expose_port(&self, caller: &Caller, id: &str, port: u16) -> Result<Port, CoreError> {
        self.record(caller, "expose_port");
        self.live(id)?;
        Ok(Port {
            port,
            url: format!("https://{port}-{id}.sandpit.test"),
            created_at: now(),
        })
    }

    async fn list_ports(&self, caller: &Caller, _id: &str) -> Result<List<Port>, CoreError> {
        self.record(caller, "list_ports");
        Ok(List::new(vec![], false, None))
    }

    async fn close_port(&self, caller: &Caller, _id: &str, _port: u16) -> Result<(), CoreError> {
        self.record(caller, "close_port");
        Ok(())
    }

    async fn usage(&self, caller: &Caller, days: Option<u32>) -> Result<Usage, CoreError> {
        self.record(caller, "usage");
        Ok(Usage {
            object: "usage".into(),
            credit_remaining_usd: 4.5,
            period_days: days.unwrap_or(30),
            total_cost_usd: 0.5,
            sandboxes: vec![],
        })
    }

    async fn account(&self, caller: &Caller) -> Result<Account, CoreError> {
        self.record(caller, "account");
        Ok(Account {
            object: "account".into(),
            id: ACCOUNT.into(),
            name: "alice".into(),
            credit_remaining_usd: 4.5,
            max_concurrent_sandboxes: 20,
            created_at: now(),
            disk_used_bytes: 0,
        })
    }

    async fn service_info(&self) -> Result<ServiceInfo, CoreError> {
        Ok(ServiceInfo {
            name: "sandpit".into(),
            version: "0.1.0".into(),
            sizes: vec![SizeInfo {
                name: "small".into(),
                resources: Resources {
                    vcpus: 2,
                    memory_mb: 4096,
                    disk_gb: 40,
                },
                price_usd_per_hour: 0.09,
            }],
            default_timeout_minutes: 15,
            max_timeout_minutes: 1440,
            max_lifetime_minutes: 1440,
            max_concurrent_sandboxes: 20,
            acceleration: "tcg".into(),
            hosts: vec!["localhost".into()],
            authentication: "Authorization: Bearer <key> or x-api-key: <key>".into(),
            guest: GuestInfo {
                os: "Debian 12".into(),
                kernel: "6.1".into(),
                user: "user".into(),
                workdir: "/workspace".into(),
            },
            fast_start: sandpit_core::model::FastStartInfo {
                snapshots: true,
                warm_pool: vec![sandpit_core::model::WarmPoolInfo {
                    size: "small".into(),
                    ready: 2,
                    target: 2,
                }],
            },
            limits: self.limits.lock().unwrap().clone(),
        })
    }
}

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
    assert_eq!(s["id"], "sbx_new");
    assert_eq!(s["name"], "job");
    assert_eq!(s["status"], "running");

    let s = ok(
        &call(client, "get_sandbox", json!({"sandbox_id": "sbx_new"})).await,
        &tool("get_sandbox"),
    );
    assert_eq!(s["object"], "sandbox");

    let x = ok(
        &call(
            client,
            "write_file",
            json!({"sandbox_id": "sbx_new", "path": "a.py", "content": "print('hi')"}),
        )
        .await,
        &tool("write_file"),
    );
    assert_eq!(x["path"], "/workspace/a.py");
    assert_eq!(x["bytes"], 11);

    let x = ok(
        &call(
            client,
            "read_file",
            json!({"sandbox_id": "sbx_new", "path": "a.py"}),
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
            json!({"sandbox_id": "sbx_new", "recursive": false}),
        )
        .await,
        &tool("list_files"),
    );
    assert_eq!(x["entries"][0]["type"], "file");

    let x = ok(
        &call(
            client,
            "expose_port",
            json!({"sandbox_id": "sbx_new", "port": 8000}),
        )
        .await,
        &tool("expose_port"),
    );
    assert_eq!(x["url"], "https://8000-sbx_new.sandpit.test");

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
            json!({"sandbox_id": "sbx_new", "additional_minutes": 30}),
        )
        .await,
        &tool("extend_sandbox"),
    );
    assert_eq!(x["timeout_minutes"], 45);

    let x = ok(
        &call(
            client,
            "run_command",
            json!({"sandbox_id": "sbx_new", "command": "echo hi", "env": {"A": "1"}}),
        )
        .await,
        &tool("run_command"),
    );
    assert_eq!(x["status"], "completed");
    assert_eq!(x["exit_code"], 0);

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
        &call(client, "destroy_sandbox", json!({"sandbox_id": "sbx_new"})).await,
        &tool("destroy_sandbox"),
    );
    assert_eq!(x["status"], "deleted");
}

/// `http_service` over the fake, mounted at `/v1/mcp` in an axum app on
/// 127.0.0.1:0 with the default `HttpConfig`; stopped when dropped.
pub struct Server {
    pub addr: SocketAddr,
    pub url: String,
    pub api: Arc<FakeApi>,
    shutdown: CancellationToken,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

pub async fn server() -> Server {
    let api = FakeApi::new();
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
