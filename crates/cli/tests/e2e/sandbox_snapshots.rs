//! Snapshots, fork and restore through a real `sandpit serve` and real VMs,
//! as a client meets them over REST: the machine that comes back is the
//! same machine (files, a process whose state is only in memory, a dev
//! server behind its preview URL), copies are independent, another account
//! cannot see or use a snapshot, a refused fork charges nothing, and
//! deleted snapshots and ended sandboxes leave no files behind.

use crate::common::serve::{Rest, Server};
use crate::common::*;
use serde_json::{json, Value};
use std::path::Path;
use std::time::{Duration, Instant};

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap()
}

async fn sh(api: &Rest, id: &str, command: &str) -> String {
    api.sh(id, command).await
}

async fn count(api: &Rest, id: &str) -> u64 {
    sh(api, id, "cat /tmp/count").await.parse().unwrap()
}

fn id_of(v: &Value) -> String {
    v["id"].as_str().unwrap().to_string()
}

/// What the data directory holds of saves and frozen disk layers.
fn saves_and_layers(data: &Path) -> (Vec<String>, usize) {
    let names = |d: &str| -> Vec<String> {
        std::fs::read_dir(data.join(d))
            .map(|rd| {
                rd.filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| !n.starts_with('.'))
                    .collect()
            })
            .unwrap_or_default()
    };
    let mut saves = names("saves");
    saves.sort();
    (saves, names("layers").len())
}

#[test]
fn a_sandbox_snapshotted_forked_and_restored_is_the_same_machine() {
    let data = data_dir();
    let server = Server::start_with(&data, "[limits]\nmax_snapshots = 4\n");
    let key = server.admin_key.clone().unwrap();
    let api = Rest::new(&server, &key);
    rt().block_on(async {
        // The first start of a server builds the snapshot template; the
        // sandboxes here are restored from it, as nearly all are.
        api.template_ready().await;
        let (st, a) = api
            .post("/sandboxes", json!({"size": "small", "timeout_minutes": 20}))
            .await;
        assert_eq!(st, 201, "{a}");
        let a = id_of(&a);
        // A file, a counter whose state is only in a shell's memory, and
        // a dev server with something in its memory too.
        sh(&api, &a, "echo v1 > /workspace/file && mkdir -p /workspace/www && echo served > /workspace/www/index.html").await;
        sh(
            &api,
            &a,
            "nohup bash -c 'i=0; while :; do i=$((i+1)); echo $i > /tmp/count.new; \
             mv /tmp/count.new /tmp/count; sleep 0.1; done' >/dev/null 2>&1 & \
             cd /workspace/www && nohup python3 -m http.server 8000 >/dev/null 2>&1 & sleep 1",
        )
        .await;
        let (st, port) = api
            .post(&format!("/sandboxes/{a}/ports"), json!({"port": 8000}))
            .await;
        assert_eq!(st, 200, "{port}");
        let preview = port["url"].as_str().unwrap().to_string();
        // The dev server takes a moment to start under emulation.
        assert_eq!(served(&preview).await, (200, "served\n".into()));

        let machine_id = sh(&api, &a, "cat /etc/machine-id").await;
        // A snapshot, replayed by its Idempotency-Key.
        let at_snapshot = count(&api, &a).await;
        let t = Instant::now();
        let resp = api
            .http
            .post(format!("{}/v1/sandboxes/{a}/snapshots", server.url))
            .bearer_auth(&key)
            .header("Idempotency-Key", "snap-1")
            .json(&json!({"name": "before"}))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), 201);
        let snap: Value = resp.json().await.unwrap();
        eprintln!("snapshot in {:?}: {snap}", t.elapsed());
        let s1 = id_of(&snap);
        assert!(s1.starts_with("snap_"), "{snap}");
        assert_eq!(snap["status"], "ready");
        assert_eq!(snap["sandbox_id"], a.as_str());
        assert_eq!(snap["name"], "before");
        let bytes = snap["size_bytes"].as_u64().unwrap();
        assert!(bytes > 0 && bytes < 400 << 20, "{snap}");
        let again = api
            .http
            .post(format!("{}/v1/sandboxes/{a}/snapshots", server.url))
            .bearer_auth(&key)
            .header("Idempotency-Key", "snap-1")
            .json(&json!({"name": "before"}))
            .send()
            .await
            .unwrap();
        assert_eq!(again.status().as_u16(), 200);
        assert_eq!(id_of(&again.json().await.unwrap()), s1);
        // The sandbox ran on.
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert!(count(&api, &a).await > at_snapshot);

        // Break it, then take it back.
        sh(&api, &a, "echo v2 > /workspace/file; rm -rf /workspace/www; pkill -f '^python3 -m http.server'; true").await;
        assert_ne!(fetch(&preview).await.0, 200);
        let t = Instant::now();
        let (st, restored) = api
            .post(
                &format!("/sandboxes/{a}/restore"),
                json!({"snapshot_id": s1}),
            )
            .await;
        eprintln!("restored in {:?}", t.elapsed());
        assert_eq!(st, 200, "{restored}");
        assert_eq!(restored["id"], a.as_str());
        assert_eq!(restored["status"], "running");
        assert_eq!(sh(&api, &a, "cat /workspace/file").await, "v1");
        // The same machine: its own machine-id still.
        assert_eq!(sh(&api, &a, "cat /etc/machine-id").await, machine_id);
        let resumed = count(&api, &a).await;
        assert!(
            resumed >= at_snapshot && resumed < at_snapshot + 50,
            "the counter should go on from {at_snapshot}, it is at {resumed}"
        );
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert!(count(&api, &a).await > resumed, "the counter stopped");
        // The same preview URL serves again, from the restored dev server.
        assert_eq!(fetch(&preview).await, (200, "served\n".into()));

        // Paused: no VM process left, its state on disk; the preview URL
        // resumes it, the counter goes on from where it stopped.
        let (st, p) = api
            .post(&format!("/sandboxes/{a}/pause"), json!({}))
            .await;
        assert_eq!(st, 200, "{p}");
        assert_eq!(p["status"], "paused");
        let at_pause = {
            let (_, got) = api.get(&format!("/sandboxes/{a}")).await;
            assert_eq!(got["status"], "paused");
            host_processes(&data)
                .iter()
                .filter(|p| p.vm.as_deref() == Some(a.as_str()))
                .count()
        };
        assert_eq!(at_pause, 0, "a paused sandbox runs no host process");
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(served(&preview).await, (200, "served\n".into()));
        let (_, got) = api.get(&format!("/sandboxes/{a}")).await;
        assert_eq!(got["status"], "running", "the preview request resumed it");
        let after = count(&api, &a).await;
        assert!(after >= resumed, "the counter went back: {resumed} -> {after}");
        assert_eq!(sh(&api, &a, "cat /etc/machine-id").await, machine_id);
        assert!(
            after < resumed + 100,
            "the counter ran while paused: {resumed} -> {after}"
        );
        // Through the CLI, as a person pauses and resumes it.
        let cli = |args: &[&str]| {
            let out = std::process::Command::new(env!("CARGO_BIN_EXE_sandpit"))
                .arg("--data-dir")
                .arg(data.join("cli"))
                .arg("sandbox")
                .args(args)
                .env("SANDPIT_URL", &server.url)
                .env("SANDPIT_API_KEY", &key)
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "sandpit sandbox {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            String::from_utf8(out.stdout).unwrap().trim().to_string()
        };
        let paused: Value = serde_json::from_str(&cli(&["pause", &a, "--json"])).unwrap();
        assert_eq!(paused["status"], "paused");
        let resumed: Value = serde_json::from_str(&cli(&["resume", &a, "--json"])).unwrap();
        assert_eq!(resumed["status"], "running");
        assert_eq!(sh(&api, &a, "cat /workspace/file").await, "v1");
        let listed = cli(&["snapshots"]);
        assert!(listed.contains(&s1), "{listed}");

        // Over MCP, as an agent: snapshot, break, restore.
        {
            use rmcp::model::CallToolRequestParams;
            use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
            use rmcp::transport::StreamableHttpClientTransport;
            use rmcp::ServiceExt;
            let transport = StreamableHttpClientTransport::from_config(
                StreamableHttpClientTransportConfig::with_uri(format!("{}/v1/mcp", server.url))
                    .auth_header(key.clone()),
            );
            let agent = ().serve(transport).await.unwrap();
            let call = |name: &'static str, args: Value| {
                let agent = &agent;
                async move {
                    let r = agent
                        .call_tool(
                            CallToolRequestParams::new(name)
                                .with_arguments(args.as_object().cloned().unwrap()),
                        )
                        .await
                        .unwrap();
                    assert_ne!(r.is_error, Some(true), "{name}: {r:?}");
                    r.structured_content.unwrap()
                }
            };
            let snap = call("snapshot_sandbox", json!({"sandbox_id": a, "name": "mcp"})).await;
            sh(&api, &a, "echo broken > /workspace/file").await;
            let back = call(
                "restore_sandbox",
                json!({"sandbox_id": a, "snapshot_id": snap["id"]}),
            )
            .await;
            assert_eq!(back["status"], "running");
            assert_eq!(sh(&api, &a, "cat /workspace/file").await, "v1");
            call("delete_snapshot", json!({"snapshot_id": snap["id"]})).await;
            agent.cancel().await.unwrap();
        }

        // Three copies at once, each independent of the others and of A.
        let t = Instant::now();
        let (st, fork) = api
            .post(&format!("/sandboxes/{a}/fork"), json!({"count": 3}))
            .await;
        eprintln!("fork x3 in {:?}", t.elapsed());
        assert_eq!(st, 201, "{fork}");
        let copies: Vec<String> = fork["sandboxes"]
            .as_array()
            .unwrap()
            .iter()
            .map(id_of)
            .collect();
        assert_eq!(copies.len(), 3);
        let s2 = id_of(&fork["snapshot"]);
        for (i, c) in copies.iter().enumerate() {
            assert_eq!(sh(&api, c, "cat /workspace/file").await, "v1");
            assert_eq!(sh(&api, c, "hostname").await, c.replace('_', "-"));
            sh(&api, c, &format!("echo {i} > /workspace/mine")).await;
        }
        for (i, c) in copies.iter().enumerate() {
            assert_eq!(sh(&api, c, "cat /workspace/mine").await, i.to_string());
        }
        sh(&api, &a, "test ! -e /workspace/mine").await;
        let ids: std::collections::BTreeSet<String> = futures_ids(&api, &copies).await;
        assert_eq!(ids.len(), 3, "machine ids: {ids:?}");
        assert!(!ids.contains(&machine_id), "a copy is a machine of its own");

        // A sandbox from a snapshot: the snapshot's size and state.
        let create_b = || {
            api.http
                .post(format!("{}/v1/sandboxes", server.url))
                .bearer_auth(&key)
                .header("Idempotency-Key", "from-s1")
                .json(&json!({"snapshot_id": s1, "timeout_minutes": 5}))
                .send()
        };
        let resp = create_b().await.unwrap();
        assert_eq!(resp.status().as_u16(), 201);
        let b: Value = resp.json().await.unwrap();
        assert_eq!(b["size"], "small");
        let b = id_of(&b);
        assert_eq!(sh(&api, &b, "cat /workspace/file").await, "v1");
        let (st, e) = api
            .post("/sandboxes", json!({"snapshot_id": s1, "size": "medium"}))
            .await;
        assert_eq!(st, 400, "{e}");

        // Restore: this sandbox's snapshots or its ancestors', no other.
        let (st, _) = api
            .post(
                &format!("/sandboxes/{}/restore", copies[0]),
                json!({"snapshot_id": s1}),
            )
            .await;
        assert_eq!(st, 200, "a copy rolls back to its parent's snapshot");
        sh(&api, &copies[0], "test ! -e /workspace/mine").await;
        let (st, s3) = api
            .post(&format!("/sandboxes/{}/snapshots", copies[1]), json!({}))
            .await;
        assert_eq!(st, 201, "{s3}");
        let (st, e) = api
            .post(
                &format!("/sandboxes/{a}/restore"),
                json!({"snapshot_id": id_of(&s3)}),
            )
            .await;
        assert_eq!(st, 400, "a parent cannot take its copy's snapshot: {e}");

        // The quota (4): s1, s2, s3 and one more; then 429.
        let (st, s4) = api
            .post(&format!("/sandboxes/{a}/snapshots"), json!({}))
            .await;
        assert_eq!(st, 201, "{s4}");
        let (st, e) = api
            .post(&format!("/sandboxes/{a}/snapshots"), json!({}))
            .await;
        assert_eq!(st, 429, "{e}");
        assert_eq!(e["error"]["type"], "rate_limited", "{e}");
        let (_, list) = api.get("/snapshots").await;
        assert_eq!(list["data"].as_array().unwrap().len(), 4, "{list}");

        // Another account sees none of it.
        let other = Rest::new(&server, &server.new_account("other", 0.05));
        let (st, _) = other.get(&format!("/snapshots/{s1}")).await;
        assert_eq!(st, 404);
        let (st, _) = other
            .post("/sandboxes", json!({"snapshot_id": s1}))
            .await;
        assert_eq!(st, 404);
        let (st, _) = other
            .call(reqwest::Method::DELETE, &format!("/snapshots/{s1}"), None)
            .await;
        assert_eq!(st, 404);
        let (_, list) = other.get("/snapshots").await;
        assert!(list["data"].as_array().unwrap().is_empty());
        // Its fork of 10 is more than its credit: refused whole, nothing
        // made, nothing charged.
        let (st, c) = other
            .post("/sandboxes", json!({"size": "small", "timeout_minutes": 5}))
            .await;
        assert_eq!(st, 201, "{c}");
        let c = id_of(&c);
        let (_, before) = other.get("/account").await;
        let (st, e) = other
            .post(&format!("/sandboxes/{c}/fork"), json!({"count": 10}))
            .await;
        assert_eq!(st, 402, "{e}");
        let (_, after) = other.get("/account").await;
        assert_eq!(before["credit_remaining_usd"], after["credit_remaining_usd"]);
        let (_, list) = other.get("/snapshots").await;
        assert!(list["data"].as_array().unwrap().is_empty());
        let (_, live) = other.get("/sandboxes").await;
        assert_eq!(live["data"].as_array().unwrap().len(), 1, "{live}");

        // Deleting a snapshot frees its files; sandboxes from it live on.
        let (saves, _) = saves_and_layers(&data);
        assert_eq!(saves.len(), 4, "{saves:?}");
        let (st, _) = api
            .call(reqwest::Method::DELETE, &format!("/snapshots/{s1}"), None)
            .await;
        assert_eq!(st, 200);
        let (st, _) = api.get(&format!("/snapshots/{s1}")).await;
        assert_eq!(st, 404);
        assert!(!saves_and_layers(&data).0.contains(&s1));
        assert_eq!(sh(&api, &b, "cat /workspace/file").await, "v1");
        // A retry of b's create answers with b, the snapshot gone or not;
        // the same key with another body is a conflict.
        let again = create_b().await.unwrap();
        assert_eq!(again.status().as_u16(), 200);
        assert_eq!(id_of(&again.json().await.unwrap()), b);
        let other_body = api
            .http
            .post(format!("{}/v1/sandboxes", server.url))
            .bearer_auth(&key)
            .header("Idempotency-Key", "from-s1")
            .json(&json!({"snapshot_id": s1, "timeout_minutes": 6}))
            .send()
            .await
            .unwrap();
        assert_eq!(other_body.status().as_u16(), 409);
        sh(&api, &b, "echo still > /workspace/w && sync").await;

        // Everything ended and deleted: no save, no layer, no VM left.
        for s in [s2, id_of(&s3), id_of(&s4)] {
            let (st, _) = api
                .call(reqwest::Method::DELETE, &format!("/snapshots/{s}"), None)
                .await;
            assert_eq!(st, 200);
        }
        let ours: Vec<String> = [a, b, c.clone()].into_iter().chain(copies).collect();
        for id in &ours {
            let who = if *id == c { &other } else { &api };
            let (st, _) = who
                .call(reqwest::Method::DELETE, &format!("/sandboxes/{id}"), None)
                .await;
            assert_eq!(st, 200);
        }
        wait_until("the saves and layers to go", Duration::from_secs(10), || {
            saves_and_layers(&data) == (vec![], 0)
        });
        // (The warm pool's VMs stay.)
        let left = vm_dirs(&data);
        assert!(!ours.iter().any(|id| left.contains(id)), "{left:?}");
    });
}

/// A GET of `url` through the system's resolver, as a user's program
/// makes it: status and body (status 0: no connection).
async fn fetch(url: &str) -> (u16, String) {
    match reqwest::get(url).await {
        Ok(r) => (r.status().as_u16(), r.text().await.unwrap_or_default()),
        Err(e) => (0, e.to_string()),
    }
}

/// [`fetch`] until it answers 200 (30 s at most).
async fn served(url: &str) -> (u16, String) {
    let mut last = (0, String::new());
    for _ in 0..150 {
        last = fetch(url).await;
        if last.0 == 200 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    last
}

/// The machine ids of `sandboxes`.
async fn futures_ids(api: &Rest, sandboxes: &[String]) -> std::collections::BTreeSet<String> {
    let mut ids = std::collections::BTreeSet::new();
    for s in sandboxes {
        ids.insert(sh(api, s, "cat /etc/machine-id").await);
    }
    ids
}

#[test]
fn snapshots_and_pauses_outlive_a_restart_and_expired_snapshots_free_their_disk() {
    let data = data_dir();
    let (a, s1) = {
        let server = Server::start(&data);
        let key = server.admin_key.clone().unwrap();
        std::fs::write(data.join("admin.key"), &key).unwrap();
        let api = Rest::new(&server, &key);
        rt().block_on(async {
            api.template_ready().await;
            let (st, a) = api.post("/sandboxes", json!({"timeout_minutes": 10})).await;
            assert_eq!(st, 201, "{a}");
            let a = id_of(&a);
            sh(&api, &a, "echo before > /workspace/f").await;
            let (st, s1) = api
                .post(&format!("/sandboxes/{a}/snapshots"), json!({}))
                .await;
            assert_eq!(st, 201, "{s1}");
            // Paused across the restart too.
            let (st, p) = api.post(&format!("/sandboxes/{a}/pause"), json!({})).await;
            assert_eq!(st, 200, "{p}");
            (a, id_of(&s1))
        })
    };
    // The server stopped (its sandboxes run on); the next one keeps
    // snapshots for no time at all.
    let server = Server::start_with(&data, "[limits]\nsnapshot_retention_days = 0\n");
    let key = std::fs::read_to_string(data.join("admin.key")).unwrap();
    let api = Rest::new(&server, &key);
    rt().block_on(async {
        let (_, got) = api.get(&format!("/sandboxes/{a}")).await;
        assert_eq!(got["status"], "paused", "{got}");
        assert_eq!(sh(&api, &a, "cat /workspace/f").await, "before");
        let (st, snap) = api.get(&format!("/snapshots/{s1}")).await;
        assert_eq!(st, 200, "{snap}");
        assert_eq!(snap["status"], "ready");
        let (st, b) = api
            .post(
                "/sandboxes",
                json!({"snapshot_id": s1, "timeout_minutes": 5}),
            )
            .await;
        assert_eq!(st, 201, "{b}");
        let b = id_of(&b);
        assert_eq!(sh(&api, &b, "cat /workspace/f").await, "before");

        // A snapshot past its expiry is deleted, its files with it.
        let (st, s2) = api
            .post(&format!("/sandboxes/{a}/snapshots"), json!({}))
            .await;
        assert_eq!(st, 201, "{s2}");
        let s2 = id_of(&s2);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let (st, _) = api.get(&format!("/snapshots/{s2}")).await;
            let (saves, _) = saves_and_layers(&data);
            if st == 404 && !saves.contains(&s2) {
                assert!(saves.contains(&s1), "{saves:?}");
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{s2} did not expire: {st} {saves:?}"
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        for id in [&a, &b] {
            let (st, _) = api
                .call(reqwest::Method::DELETE, &format!("/sandboxes/{id}"), None)
                .await;
            assert_eq!(st, 200);
        }
        let (st, _) = api
            .call(reqwest::Method::DELETE, &format!("/snapshots/{s1}"), None)
            .await;
        assert_eq!(st, 200);
        wait_until(
            "the saves and layers to go",
            Duration::from_secs(10),
            || saves_and_layers(&data) == (vec![], 0),
        );
    });
}
