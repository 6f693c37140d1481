//! The control plane end to end: a real `sandpit serve` process on a fresh
//! data directory, real VMs, a real HTTP client for REST, rmcp's client over
//! Streamable HTTP and over stdio (`sandpit mcp`), and the operator commands.
//! Includes the SIGKILL-and-restart reconciliation.

use crate::common::serve::*;
use crate::common::*;
use rmcp::model::CallToolRequestParams;
use rmcp::ServiceExt;
use serde_json::{json, Value};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn the_agent_flow_over_rest() {
    let data = data_dir();
    let server = Server::start(&data);
    let key = server
        .admin_key
        .clone()
        .expect("first start prints the admin key");
    rt().block_on(async {
        let api = Rest::new(&server, &key);
        // The server restores VMs from snapshots and keeps a warm pool of
        // two small ones (the default), which fills by itself.
        let pool_ready = || async {
            let (st, info) = api.get("/service").await;
            assert_eq!(st, 200, "{info}");
            assert_eq!(info["fast_start"]["snapshots"], true, "{info}");
            assert_eq!(info["fast_start"]["warm_pool"][0]["size"], "small", "{info}");
            assert_eq!(info["fast_start"]["warm_pool"][0]["target"], 2, "{info}");
            info["fast_start"]["warm_pool"][0]["ready"].as_u64().unwrap()
        };
        let deadline = Instant::now() + Duration::from_secs(180);
        while pool_ready().await < 2 {
            assert!(Instant::now() < deadline, "the warm pool did not fill");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        // Its own egress lists: a denied address refused at once (curl's
        // 7: the connect never leaves the VM).
        let denied = "198.51.100.1";
        let (st, sbx) = api
            .post(
                "/sandboxes",
                json!({"name": "flow", "timeout_minutes": 10,
                       "network": {"deny_out": [format!("{denied}/32")]}}),
            )
            .await;
        assert_eq!(st, 201, "{sbx}");
        assert_eq!(sbx["status"], "running");
        assert_eq!(sbx["network"], json!({"deny_out": ["198.51.100.1/32"]}));
        let id = sbx["id"].as_str().unwrap().to_string();
        let curl = format!("curl -sS -m 20 -o /dev/null http://{denied}:8080/");
        let (st, ex) = api.post(&format!("/sandboxes/{id}/exec"), json!({"command": curl})).await;
        assert_eq!((st, ex["exit_code"].as_i64()), (200, Some(7)), "{ex}");
        let network = format!("/sandboxes/{id}/network");
        let (st, err) = api
            .call(reqwest::Method::PUT, &network, Some(json!({"allow_out": ["exa mple.com"]})))
            .await;
        assert_eq!(st, 400, "{err}");
        let message = err["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains("is not a host name"), "{err}");
        let (st, err) = api
            .call(reqwest::Method::PUT, "/sandboxes/sbx_nosuch/network", Some(json!({})))
            .await;
        assert_eq!(st, 404, "{err}");
        let (st, cleared) = api.call(reqwest::Method::PUT, &network, Some(json!({}))).await;
        assert_eq!(st, 200, "{cleared}");
        assert!(cleared.get("network").is_none(), "{cleared}");
        // A secret: stored, listed without its value; a sandbox (from the
        // warm pool) created with it holds a placeholder and trusts a CA of
        // its own, never the value; nor does a snapshot of it.
        let value = "sk-flow-5e0c7d1a9b3f4e6a8c2d0b1f3a5c7e9d";
        let (st, put) = api
            .call(
                reqwest::Method::PUT,
                "/secrets/FLOW_TOKEN",
                Some(json!({"value": value, "hosts": ["api.flow.test"]})),
            )
            .await;
        assert_eq!(st, 200, "{put}");
        assert_eq!(put["header"], "Authorization");
        let (st, listed) = api.get("/secrets").await;
        assert_eq!(st, 200, "{listed}");
        assert_eq!(listed["data"][0]["name"], "FLOW_TOKEN", "{listed}");
        assert!(!listed.to_string().contains(value), "{listed}");
        let (st, sbx) = api
            .post("/sandboxes", json!({"timeout_minutes": 5, "secrets": ["FLOW_TOKEN"]}))
            .await;
        assert_eq!(st, 201, "{sbx}");
        let secret_id = sbx["id"].as_str().unwrap().to_string();
        let look = "echo \"$FLOW_TOKEN\"; env | grep -c sk-flow-; \
                    awk '/sandpit: the operator/{on=1;next} on' /etc/ssl/certs/ca-certificates.crt \
                    | openssl x509 -noout -subject";
        let (st, ex) = api.post(&format!("/sandboxes/{secret_id}/exec"), json!({"command": look})).await;
        assert_eq!(st, 200, "{ex}");
        let out = ex["stdout"].as_str().unwrap_or_default();
        let mut lines = out.lines();
        let placeholder = lines.next().unwrap_or_default();
        assert!(
            placeholder.starts_with("sandpit-secret-") && placeholder.len() == 55,
            "{ex}"
        );
        assert_eq!(lines.next(), Some("0"), "{ex}");
        assert!(
            lines.next().unwrap_or_default().contains(&format!("Sandpit secrets broker for {secret_id}")),
            "{ex}"
        );
        let (st, snap) = api.post(&format!("/sandboxes/{secret_id}/snapshots"), json!({})).await;
        assert!(st == 200 || st == 201, "{snap}");
        assert!(!files_hold(&data, value.as_bytes()), "the value is in the data directory");
        let (st, _) = api.call(reqwest::Method::DELETE, &format!("/sandboxes/{secret_id}"), None).await;
        assert_eq!(st, 200);
        let (st, _) = api.call(reqwest::Method::DELETE, "/secrets/FLOW_TOKEN", None).await;
        assert_eq!(st, 200);
        let (_, listed) = api.get("/secrets").await;
        assert_eq!(listed["data"], json!([]), "{listed}");
        let (st, w) = api
            .call(
                reqwest::Method::PUT,
                &format!("/sandboxes/{id}/files"),
                Some(json!({"path": "job.py", "content": "print(6*7)\nopen('out.txt','w').write('ok')\n", "encoding": "utf8"})),
            )
            .await;
        assert_eq!(st, 200, "{w}");
        assert_eq!(w["path"], "/workspace/job.py");
        let (st, ex) = api.post(&format!("/sandboxes/{id}/exec"), json!({"command": "python3 job.py"})).await;
        assert_eq!(st, 200, "{ex}");
        assert_eq!(ex["stdout"], "42\n");
        assert_eq!(ex["status"], "completed");
        let (_, again) = api.get(&format!("/executions/{}", ex["id"].as_str().unwrap())).await;
        assert_eq!(again, ex);
        let (st, f) = api.get(&format!("/sandboxes/{id}/files?path=out.txt")).await;
        assert_eq!((st, f["content"].as_str()), (200, Some("ok")));
        let (st, l) = api.get(&format!("/sandboxes/{id}/files?path=/workspace&list=true&recursive=true")).await;
        assert_eq!(st, 200, "{l}");
        assert!(l["entries"].as_array().unwrap().iter().any(|e| e["name"] == "out.txt"));
        // The file API has the user's rights and no more: the agent's own
        // /proc files (PID 1's) answer as the user's `cat` and `ls` do,
        // read or listed, raw or not, and through a symlink the user made;
        // /proc/self names the reader, the user's own; world-readable files
        // and the user's own still read, and a write goes where the user
        // may write, and nowhere else.
        api.sh(&id, "ln -s /proc/1/maps agent-maps").await;
        assert_eq!(
            api.sh(&id, "for c in 'cat /proc/1/maps' 'ls /proc/1/fd' 'cat agent-maps'; do $c >/dev/null 2>&1 && echo read || echo refused; done").await,
            "refused\nrefused\nrefused"
        );
        let raw = |path: &str| {
            api.http
                .get(format!("{}/v1/sandboxes/{id}/files?path={path}", api.url))
                .header(reqwest::header::ACCEPT, "application/octet-stream")
                .bearer_auth(&api.key)
                .send()
        };
        for path in ["/proc/1/maps", "/proc/1/smaps", "/proc/1/exe", "/proc/1/fdinfo/3", "/proc/1/environ", "agent-maps"] {
            let (st, err) = api.get(&format!("/sandboxes/{id}/files?path={path}")).await;
            assert_eq!(st, 403, "{path}: {err}");
            assert_eq!(err["error"]["type"], "forbidden", "{path}: {err}");
            let answer = raw(path).await.unwrap();
            assert_eq!(answer.status().as_u16(), 403, "raw {path}");
        }
        for dir in ["/proc/1/fd", "/proc/1/fdinfo", "/proc/1/map_files", "/proc/1/task/1/fd"] {
            let (st, err) = api.get(&format!("/sandboxes/{id}/files?path={dir}&list=true")).await;
            assert_eq!(st, 403, "{dir}: {err}");
        }
        let (st, f) = api.get(&format!("/sandboxes/{id}/files?path=/proc/self/status")).await;
        assert_eq!(st, 200, "{f}");
        let status = f["content"].as_str().unwrap_or_default();
        assert!(status.contains("\nUid:\t60001\t1000\t60001\t1000\n"), "{status}");
        assert!(status.contains("\nCapEff:\t0000000000000000\n"), "{status}");
        let answer = raw("/etc/os-release").await.unwrap();
        assert_eq!(answer.status().as_u16(), 200);
        assert!(String::from_utf8_lossy(&answer.bytes().await.unwrap()).contains("Debian"));
        let files = format!("/sandboxes/{id}/files");
        let put = |path: &'static str| {
            api.call(
                reqwest::Method::PUT,
                &files,
                Some(json!({"path": path, "content": "mine", "encoding": "utf8"})),
            )
        };
        assert_eq!(put("/tmp/mine.txt").await.0, 200);
        assert_eq!(api.sh(&id, "stat -c %U:%s /tmp/mine.txt").await, "user:4");
        let (st, err) = put("/etc/not-mine.txt").await;
        assert_eq!(st, 403, "{err}");
        let (st, e) = api.post(&format!("/sandboxes/{id}/extend"), json!({"additional_minutes": 5})).await;
        assert_eq!((st, e["timeout_minutes"].as_u64()), (200, Some(15)));
        let (st, u) = api.get("/usage").await;
        assert_eq!(st, 200);
        let used = u["sandboxes"].as_array().unwrap();
        assert!(used.iter().any(|s| s["id"] == id.as_str()), "{u}");
        let (st, d) = api.call(reqwest::Method::DELETE, &format!("/sandboxes/{id}"), None).await;
        assert_eq!((st, d["status"].as_str()), (200, Some("deleted")));
        let (st, err) = api.post(&format!("/sandboxes/{id}/exec"), json!({"command": "true"})).await;
        assert_eq!(st, 409, "{err}");
        assert!(err["request_id"].as_str().unwrap().starts_with("req_"));
    });
}

#[test]
fn keys_isolation_and_credit_over_rest() {
    let data = data_dir();
    let server = Server::start(&data);
    let alice = server.new_account("alice", 1.0);
    let bob = server.new_account("bob", 0.05); // two 15-minute small sandboxes
    rt().block_on(async {
        let a = Rest::new(&server, &alice);
        let b = Rest::new(&server, &bob);
        let nobody = Rest::new(&server, "sp_not_a_key");
        let (st, e) = nobody.get("/account").await;
        assert_eq!(
            (st, e["error"]["type"].as_str()),
            (401, Some("unauthorized"))
        );

        let (st, sbx) = a.post("/sandboxes", json!({})).await;
        assert_eq!(st, 201);
        let id = sbx["id"].as_str().unwrap();
        // Bob can't see, use or destroy Alice's sandbox: exactly like a missing one.
        let (st, e) = b.get(&format!("/sandboxes/{id}")).await;
        let (st2, e2) = b.get("/sandboxes/sbx_aaaaaaaaaaaaaaaaaaaaaaaa").await;
        assert_eq!((st, st2), (404, 404));
        assert_eq!(e["error"]["type"], e2["error"]["type"]);
        assert_eq!(
            b.post(&format!("/sandboxes/{id}/exec"), json!({"command": "id"}))
                .await
                .0,
            404
        );
        assert_eq!(
            b.call(reqwest::Method::DELETE, &format!("/sandboxes/{id}"), None)
                .await
                .0,
            404
        );

        // Four concurrent creates against credit for two: exactly two, never overdrawn.
        let results = futures_join4(&b).await;
        let created: Vec<&Value> = results
            .iter()
            .filter(|(s, _)| *s == 201)
            .map(|(_, v)| v)
            .collect();
        let refused = results
            .iter()
            .filter(|(s, v)| *s == 402 && v["error"]["type"] == "insufficient_credits")
            .count();
        assert_eq!((created.len(), refused), (2, 2), "{results:?}");
        let (_, acct) = b.get("/account").await;
        assert!(acct["credit_remaining_usd"].as_f64().unwrap() >= 0.0);
        for s in created {
            b.call(
                reqwest::Method::DELETE,
                &format!("/sandboxes/{}", s["id"].as_str().unwrap()),
                None,
            )
            .await;
        }
        a.call(reqwest::Method::DELETE, &format!("/sandboxes/{id}"), None)
            .await;

        // A revoked key stops working at once.
        server.admin(&["key", "revoke", &bob[..12]]);
        assert_eq!(b.get("/account").await.0, 401);
    });
}

async fn futures_join4(b: &Rest) -> Vec<(u16, Value)> {
    let (r1, r2, r3, r4) = tokio::join!(
        b.post("/sandboxes", json!({})),
        b.post("/sandboxes", json!({})),
        b.post("/sandboxes", json!({})),
        b.post("/sandboxes", json!({})),
    );
    vec![r1, r2, r3, r4]
}

fn args(v: Value) -> serde_json::Map<String, Value> {
    v.as_object().unwrap().clone()
}

/// The agent flow through MCP tools; returns the sandbox id it destroyed.
async fn mcp_flow<S: rmcp::service::Service<rmcp::RoleClient>>(
    c: &rmcp::service::RunningService<rmcp::RoleClient, S>,
) {
    let tools = c.list_all_tools().await.unwrap();
    // The spec's twelve, then snapshots, fork, restore, pause, templates,
    // the network and volumes.
    assert_eq!(tools.len(), 24);
    for name in ["run_command", "snapshot_sandbox", "pause_sandbox"] {
        assert!(tools.iter().any(|t| t.name == name), "{name}");
    }
    let call = |name: &'static str, a: Value| {
        let req = CallToolRequestParams::new(name).with_arguments(args(a));
        async move {
            let r = c.call_tool(req).await.unwrap();
            assert_ne!(r.is_error, Some(true), "{name}: {r:?}");
            r.structured_content.clone().expect("structuredContent")
        }
    };
    let sbx = call("create_sandbox", json!({"timeout_minutes": 10})).await;
    let id = sbx["id"].as_str().unwrap().to_string();
    call(
        "write_file",
        json!({"sandbox_id": id, "path": "hi.py", "content": "print('hello from mcp')"}),
    )
    .await;
    let ex = call(
        "run_command",
        json!({"sandbox_id": id, "command": "python3 hi.py > out.txt; cat out.txt"}),
    )
    .await;
    assert_eq!(ex["stdout"], "hello from mcp\n");
    let f = call("read_file", json!({"sandbox_id": id, "path": "out.txt"})).await;
    assert_eq!(f["content"], "hello from mcp\n");
    let l = call("list_files", json!({"sandbox_id": id})).await;
    assert!(l["entries"]
        .as_array()
        .unwrap()
        .iter()
        .any(|e| e["name"] == "out.txt"));
    // The agent's own memory map and descriptors are not the user's to
    // read: refused, as `cat` is, with nothing of them in the answer.
    for (tool, path) in [("read_file", "/proc/1/maps"), ("list_files", "/proc/1/fd")] {
        let r = c
            .call_tool(
                CallToolRequestParams::new(tool)
                    .with_arguments(args(json!({"sandbox_id": id, "path": path}))),
            )
            .await
            .unwrap();
        assert_eq!(r.is_error, Some(true), "{tool} {path}: {r:?}");
        let text = format!("{:?}", r.content);
        assert!(
            text.to_lowercase().contains("permission denied"),
            "{tool} {path}: {text}"
        );
        assert!(!text.contains("sandpit-agent"), "{tool} {path}: {text}");
    }
    let e = call(
        "extend_sandbox",
        json!({"sandbox_id": id, "additional_minutes": 5}),
    )
    .await;
    assert_eq!(e["timeout_minutes"], 15);
    // Its network narrowed: a denied address refused at once (the connect
    // never leaves the VM), then the usual network back.
    let n = call(
        "update_network",
        json!({"sandbox_id": id, "deny_out": ["198.51.100.1/32"]}),
    )
    .await;
    assert_eq!(n["network"], json!({"deny_out": ["198.51.100.1/32"]}));
    let ex = call(
        "run_command",
        json!({"sandbox_id": id, "command": "curl -sS -m 20 -o /dev/null http://198.51.100.1:8080/"}),
    )
    .await;
    assert_eq!(ex["exit_code"], 7, "{ex}");
    let n = call("update_network", json!({"sandbox_id": id})).await;
    assert!(n.get("network").is_none(), "{n}");
    let u = call("get_usage", json!({})).await;
    assert!(u["sandboxes"]
        .as_array()
        .unwrap()
        .iter()
        .any(|s| s["id"] == id.as_str()));
    let d = call("destroy_sandbox", json!({"sandbox_id": id})).await;
    assert_eq!(d["status"], "deleted");
    // Using it now is an error the agent can act on, not a protocol error.
    let r = c
        .call_tool(
            CallToolRequestParams::new("run_command")
                .with_arguments(args(json!({"sandbox_id": id, "command": "true"}))),
        )
        .await
        .unwrap();
    assert_eq!(r.is_error, Some(true));
}

#[test]
fn the_agent_flow_over_mcp_streamable_http() {
    use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
    use rmcp::transport::StreamableHttpClientTransport;
    let data = data_dir();
    let server = Server::start(&data);
    let key = server.admin_key.clone().unwrap();
    rt().block_on(async {
        let url = format!("{}/v1/mcp", server.url);
        // Anonymous: discovery works, acting does not.
        let anon = ()
            .serve(StreamableHttpClientTransport::from_config(
                StreamableHttpClientTransportConfig::with_uri(url.clone()),
            ))
            .await
            .unwrap();
        assert_eq!(anon.list_all_tools().await.unwrap().len(), 24);
        let info = anon
            .call_tool(CallToolRequestParams::new("get_service_info"))
            .await
            .unwrap();
        assert_ne!(info.is_error, Some(true));
        let info = info.structured_content.unwrap();
        assert_eq!(info["acceleration"], "tcg");
        // The commit the server was built from: the checkout's.
        assert_eq!(info["commit"], crate::common::head_commit(), "{info}");
        let denied = anon
            .call_tool(CallToolRequestParams::new("create_sandbox").with_arguments(args(json!({}))))
            .await
            .unwrap();
        assert_eq!(denied.is_error, Some(true));
        anon.cancel().await.unwrap();

        let client = ()
            .serve(StreamableHttpClientTransport::from_config(
                StreamableHttpClientTransportConfig::with_uri(url).auth_header(key),
            ))
            .await
            .unwrap();
        mcp_flow(&client).await;
        client.cancel().await.unwrap();
    });
}

#[test]
fn the_agent_flow_over_mcp_stdio() {
    use rmcp::transport::TokioChildProcess;
    let data = data_dir();
    std::fs::write(data.join("config.toml"), CONFIG).unwrap();
    rt().block_on(async {
        let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_sandpit"));
        cmd.arg("--data-dir")
            .arg(&data)
            .arg("--images-dir")
            .arg(images_dir())
            .arg("--config")
            .arg(data.join("config.toml"))
            .arg("mcp");
        let client = ().serve(TokioChildProcess::new(cmd).unwrap()).await.unwrap();
        mcp_flow(&client).await;
        client.cancel().await.unwrap();
    });
}

/// Who holds the data directory, as its lock file says: (pid, role).
fn owner_of(data: &std::path::Path) -> Option<(u32, String)> {
    let s = std::fs::read_to_string(data.join("owner.lock")).ok()?;
    let (pid, role) = s.trim().split_once(' ')?;
    Some((pid.parse().ok()?, role.to_string()))
}

fn alive(pid: u32) -> bool {
    // A zombie (exited, not yet reaped by whoever adopted it) is gone.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            !s.rsplit_once(')')
                .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'))
        })
        .unwrap_or(false)
}

#[test]
fn a_data_directory_has_one_owner_and_its_reaper_hands_over() {
    let data = data_dir();
    std::fs::write(data.join("config.toml"), CONFIG).unwrap();
    // `sandpit mcp` makes a sandbox, and its client goes: the reaper it
    // leaves behind takes the data directory over, to expire the sandbox.
    let id = rt().block_on(async {
        // Over its own pipes (rmcp's child-process transport kills the
        // child when it goes, and a killed mcp leaves no reaper): the
        // client closes stdin, as an MCP host does, and mcp exits.
        let mut mcp = tokio::process::Command::new(env!("CARGO_BIN_EXE_sandpit"))
            .arg("--data-dir")
            .arg(&data)
            .arg("--images-dir")
            .arg(images_dir())
            .arg("--config")
            .arg(data.join("config.toml"))
            .arg("mcp")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let pipes = (mcp.stdout.take().unwrap(), mcp.stdin.take().unwrap());
        let client = ().serve(pipes).await.unwrap();
        let r = client
            .call_tool(
                CallToolRequestParams::new("create_sandbox")
                    .with_arguments(args(json!({"timeout_minutes": 10}))),
            )
            .await
            .unwrap();
        assert_ne!(r.is_error, Some(true), "{r:?}");
        let id = r.structured_content.unwrap()["id"]
            .as_str()
            .unwrap()
            .to_string();
        client.cancel().await.unwrap();
        let status = tokio::time::timeout(Duration::from_secs(60), mcp.wait())
            .await
            .expect("sandpit mcp exits when its client goes")
            .unwrap();
        assert!(status.success(), "sandpit mcp: {status}");
        id
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    let reaper = loop {
        match owner_of(&data) {
            Some((pid, role)) if role == "sandpit reap" && alive(pid) => break pid,
            other => assert!(Instant::now() < deadline, "no reaper took over: {other:?}"),
        }
        std::thread::sleep(Duration::from_millis(100));
    };

    // A server on the directory stops the reaper and takes over; the
    // sandbox lives on under it.
    let server = Server::start(&data);
    assert!(!alive(reaper), "the reaper still runs beside the server");
    assert_eq!(
        owner_of(&data),
        Some((server.child.id(), "sandpit serve".to_string()))
    );
    let key = server.admin(&["key", "create", "--account", "local"]);
    let exec_true = || {
        rt().block_on(async {
            let api = Rest::new(&server, &key);
            let (st, ex) = api
                .post(
                    &format!("/sandboxes/{id}/exec"),
                    json!({"command": "hostname"}),
                )
                .await;
            assert_eq!(st, 200, "{ex}");
            assert_eq!(ex["exit_code"], 0, "{ex}");
        })
    };
    exec_true();

    // A second owner is refused, naming the first; the operator commands,
    // which own no VMs, still work.
    let holder = format!("in use by sandpit serve (pid {})", server.child.id());
    for what in [
        vec!["mcp"],
        vec!["sandbox", "create", "--timeout", "5m"],
        vec!["sandbox", "rm", &id],
    ] {
        let out = sandpit(&data)
            .args(&what)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success(),
            "sandpit {what:?} ran beside the server"
        );
        assert!(err.contains(&holder), "sandpit {what:?}: {err}");
    }
    assert!(server.admin(&["account", "list"]).contains("local"));
    // Nothing of the server's was touched.
    exec_true();
    assert_eq!(
        owner_of(&data),
        Some((server.child.id(), "sandpit serve".to_string()))
    );
}

#[test]
fn the_agent_flow_over_mcp_stdio_forwarding_to_a_server() {
    use rmcp::transport::TokioChildProcess;
    let data = data_dir();
    let server = Server::start(&data);
    let key = server.admin_key.clone().unwrap();
    rt().block_on(async {
        let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_sandpit"));
        cmd.args(["mcp", "--remote", &server.url])
            .env("SANDPIT_API_KEY", &key);
        let client = ().serve(TokioChildProcess::new(cmd).unwrap()).await.unwrap();
        mcp_flow(&client).await;
        client.cancel().await.unwrap();
    });
    // A wrong key is refused at start, with a message.
    let out = Command::new(env!("CARGO_BIN_EXE_sandpit"))
        .args(["mcp", "--remote", &server.url])
        .env("SANDPIT_API_KEY", "sp_wrong")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("API key"));
}

#[test]
fn a_client_that_hangs_up_mid_create_leaks_nothing() {
    let data = data_dir();
    // No warm pool: a pool VM would answer the create in milliseconds.
    let server = Server::start_with(&data, "[pool]\nsizes = {}\n");
    let key = server.admin_key.clone().unwrap();
    rt().block_on(async {
        // The size's template is made first (a create that hangs up while
        // it is made leaves nothing at all): this one hangs up in the start.
        let api = Rest::new(&server, &key);
        let (st, first) = api.post("/sandboxes", json!({})).await;
        assert_eq!(st, 201, "{first}");
        let (st, _) = api
            .call(
                reqwest::Method::DELETE,
                &format!("/sandboxes/{}", first["id"].as_str().unwrap()),
                None,
            )
            .await;
        assert_eq!(st, 200);
        // A restore takes 150 ms and more here; the request itself reaches
        // the server in a millisecond.
        let impatient = reqwest::Client::builder()
            .timeout(Duration::from_millis(100))
            .build()
            .unwrap();
        let r = impatient
            .post(format!("{}/v1/sandboxes", server.url))
            .bearer_auth(&key)
            .json(&json!({}))
            .send()
            .await;
        if let Ok(r) = r {
            panic!(
                "the create answered within 100 ms: {} {}",
                r.status(),
                r.text().await.unwrap_or_default()
            );
        }
        // The boot goes on; the sandbox shows up running, and can be destroyed.
        let deadline = Instant::now() + Duration::from_secs(120);
        let id = loop {
            let (_, l) = api.get("/sandboxes").await;
            let live = l["data"]
                .as_array()
                .and_then(|d| d.iter().find(|s| s["id"] != first["id"]));
            if let Some(s) = live {
                if s["status"] == "running" {
                    break s["id"].as_str().unwrap().to_string();
                }
            }
            assert!(Instant::now() < deadline, "the sandbox never came up");
            tokio::time::sleep(Duration::from_millis(250)).await;
        };
        let (st, d) = api
            .call(reqwest::Method::DELETE, &format!("/sandboxes/{id}"), None)
            .await;
        assert_eq!((st, d["status"].as_str()), (200, Some("deleted")));
        assert!(pids_mentioning(&format!("sandpit-vm-{id}")).is_empty());
        assert!(!data.join("vms").join(&id).exists());
    });
}

#[test]
fn a_client_that_hangs_up_mid_command_kills_the_command() {
    let data = data_dir();
    let server = Server::start(&data);
    let key = server.admin_key.clone().unwrap();
    rt().block_on(async {
        let api = Rest::new(&server, &key);
        let (_, sbx) = api.post("/sandboxes", json!({})).await;
        let id = sbx["id"].as_str().unwrap().to_string();
        let impatient = reqwest::Client::builder()
            .timeout(Duration::from_millis(1500))
            .build()
            .unwrap();
        for (cmd, stream) in [("sleep 301", false), ("echo started; sleep 302", true)] {
            let r = impatient
                .post(format!("{}/v1/sandboxes/{id}/exec", server.url))
                .bearer_auth(&key)
                .json(&json!({"command": cmd, "stream": stream}))
                .send()
                .await;
            if let Ok(resp) = r {
                // The stream's headers came back; read until the client gives up.
                let _ = resp.bytes().await;
            }
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                let (_, ex) = api
                    .post(
                        &format!("/sandboxes/{id}/exec"),
                        json!({"command": "pgrep -f 'sleep 30[12]' || echo none"}),
                    )
                    .await;
                if ex["stdout"] == "none\n" {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "`{cmd}` survived its client: {ex}"
                );
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        }
        api.call(reqwest::Method::DELETE, &format!("/sandboxes/{id}"), None)
            .await;
    });
}

#[test]
fn a_killed_server_reconciles_on_restart() {
    let data = data_dir();
    let server = Server::start(&data);
    let key = server.admin_key.clone().unwrap();
    let (keep, expire, vanish, orphan, expire_at) = rt().block_on(async {
        let api = Rest::new(&server, &key);
        let mut ids = Vec::new();
        for t in [30, 1, 30, 30] {
            let (st, s) = api.post("/sandboxes", json!({"timeout_minutes": t})).await;
            assert_eq!(st, 201, "{s}");
            ids.push(s["id"].as_str().unwrap().to_string());
        }
        // An extension reaches the VM's own watchdog (see below).
        let (st, s) = api
            .post(
                &format!("/sandboxes/{}/extend", ids[0]),
                json!({"additional_minutes": 5}),
            )
            .await;
        assert_eq!(st, 200, "{s}");
        let kept_until = time::OffsetDateTime::parse(
            s["expires_at"].as_str().unwrap(),
            &time::format_description::well_known::Rfc3339,
        )
        .unwrap();
        let watchdog_reads: i64 =
            std::fs::read_to_string(data.join("vms").join(&ids[0]).join("expires"))
                .unwrap()
                .trim()
                .parse()
                .unwrap();
        let lag = watchdog_reads - kept_until.unix_timestamp();
        assert!(
            (1..=2).contains(&lag),
            "the VM's expiry is {lag} s past the sandbox's"
        );
        let (_, s) = api.get(&format!("/sandboxes/{}", ids[1])).await;
        let expire_at = time::OffsetDateTime::parse(
            s["expires_at"].as_str().unwrap(),
            &time::format_description::well_known::Rfc3339,
        )
        .unwrap();
        (
            ids[0].clone(),
            ids[1].clone(),
            ids[2].clone(),
            ids[3].clone(),
            expire_at,
        )
    });
    let record: Value = serde_json::from_slice(
        &std::fs::read(data.join("vms").join(&expire).join("vm.json")).unwrap(),
    )
    .unwrap();
    let passt = record["passt_pid"].as_u64().expect("a network helper") as u32;
    let passt_started = sandpit_runtime::vm::process::start_time(passt).expect("passt runs");
    server.sigkill();
    // The VMs outlive the server...
    assert!(!pids_mentioning(&format!("sandpit-vm-{keep}")).is_empty());
    // ...one of them dies while it is down, and another expires meanwhile.
    for pid in pids_mentioning(&format!("sandpit-vm-{vanish}")) {
        // SAFETY: killing the test's own VM.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    }
    // ...and one loses its files while its QEMU keeps running.
    std::fs::remove_dir_all(data.join("vms").join(&orphan)).unwrap();

    // With no sandpit process alive, the expiring one runs until its expiry
    // and is gone, QEMU, passt and files, within 5 s of it.
    let expiring_qemu = || !pids_mentioning(&format!("sandpit-vm-{expire}")).is_empty();
    let expiring_passt = || sandpit_runtime::vm::process::start_time(passt) == Some(passt_started);
    let until = |t: time::OffsetDateTime| {
        let d = t - time::OffsetDateTime::now_utc();
        Duration::from_secs_f64(d.as_seconds_f64().max(0.0))
    };
    std::thread::sleep(until(expire_at - time::Duration::seconds(2)));
    assert!(expiring_qemu(), "{expire} was killed before its expiry");
    std::thread::sleep(until(expire_at + time::Duration::seconds(5)));
    assert!(
        !expiring_qemu(),
        "{expire}'s QEMU outlived its expiry by 5 s with the server dead"
    );
    assert!(
        !expiring_passt(),
        "{expire}'s passt outlived its expiry by 5 s"
    );
    assert!(
        !data.join("vms").join(&expire).exists(),
        "{expire}'s files outlived it"
    );
    assert!(
        !pids_mentioning(&format!("sandpit-vm-{keep}")).is_empty(),
        "{keep} was killed early"
    );

    let server = Server::start(&data);
    assert!(
        server.admin_key.is_none(),
        "a second start must not make a new admin"
    );
    rt().block_on(async {
        let api = Rest::new(&server, &key);
        let (_, s) = api.get(&format!("/sandboxes/{expire}")).await;
        assert_eq!(
            (s["status"].as_str(), s["deleted_reason"].as_str()),
            (Some("deleted"), Some("expired")),
            "{s}"
        );
        let (_, s) = api.get(&format!("/sandboxes/{vanish}")).await;
        assert_eq!(s["status"], "failed", "{s}");
        assert!(
            s["deleted_reason"]
                .as_str()
                .unwrap()
                .starts_with("failed: "),
            "{s}"
        );
        let (_, s) = api.get(&format!("/sandboxes/{orphan}")).await;
        assert_eq!(s["status"], "failed", "{s}");
        let (_, s) = api.get(&format!("/sandboxes/{keep}")).await;
        assert_eq!(s["status"], "running");
        let (st, ex) = api
            .post(
                &format!("/sandboxes/{keep}/exec"),
                json!({"command": "echo still here"}),
            )
            .await;
        assert_eq!(
            (st, ex["stdout"].as_str()),
            (200, Some("still here\n")),
            "{ex}"
        );
        api.call(reqwest::Method::DELETE, &format!("/sandboxes/{keep}"), None)
            .await;
        // Nothing of the ended ones is left on the host.
        for id in [&expire, &vanish, &orphan, &keep] {
            assert!(
                pids_mentioning(&format!("sandpit-vm-{id}")).is_empty(),
                "{id} still has a QEMU"
            );
            assert!(!data.join("vms").join(id).exists(), "{id} still has files");
        }
        // The vanished one was refunded: only the expired one's minute and the kept one's seconds were charged.
        let (_, u) = api.get("/usage").await;
        // The expired one is charged to its expiry: 60 s at $0.09/h.
        let expired = u["sandboxes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["id"] == expire.as_str())
            .unwrap()
            .clone();
        assert_eq!(
            (expired["seconds"].as_u64(), expired["cost_usd"].as_f64()),
            (Some(60), Some(0.0015)),
            "{u}"
        );
        let vanished = u["sandboxes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["id"] == vanish.as_str())
            .unwrap()
            .clone();
        assert_eq!(vanished["cost_usd"].as_f64(), Some(0.0), "{u}");
    });
    // Stopping the server removes its warm pool too.
    drop(server);
    let left = || vm_dirs(&data);
    let gone = Instant::now() + Duration::from_secs(10);
    while !left().is_empty() {
        assert!(
            Instant::now() < gone,
            "VMs left after the server stopped: {:?}",
            left()
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// Whether a file under `dir` (but the store's, where it is sealed) holds
/// `needle`.
fn files_hold(dir: &std::path::Path, needle: &[u8]) -> bool {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return false;
    };
    entries.flatten().any(|e| {
        let path = e.path();
        match e.file_type() {
            Ok(t) if t.is_dir() => files_hold(&path, needle),
            Ok(t) if t.is_file() => std::fs::read(&path)
                .map(|b| b.windows(needle.len()).any(|w| w == needle))
                .unwrap_or(false),
            _ => false,
        }
    })
}
