//! Data directories with long paths (issue 50). A unix socket's address
//! holds 107 bytes, and VMs' sockets were once bound by their whole path
//! under the data directory: on a data directory of ~41 characters or more
//! a server started, answered, and never filled its warm pool (every
//! create booted cold; nothing could be snapshotted or forked), and
//! `doctor` found nothing wrong. Here a server, a node and `sandpit mcp`,
//! each on a data directory of 200 characters, fill their warm pools from
//! a template built under such a path, and a sandbox restored from it is
//! snapshotted and forked. The one limit left (the system's on a whole
//! path) is refused at the start, with its reason.

use crate::common::serve::*;
use crate::common::*;
use rmcp::model::CallToolRequestParams;
use rmcp::ServiceExt;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// The length of the data directories' paths, in bytes.
const LONG: usize = 200;

/// One warm VM a process: enough to see the pool fill.
const POOL: &str = "[pool]\nsizes = { small = 1 }\n";

/// `<root>/<padding>/<name>`, `len` bytes long (made when `make`).
fn long_dir(root: &Path, name: &str, len: usize, make: bool) -> PathBuf {
    let used = root.as_os_str().len() + name.len() + 2;
    let mut dir = root.to_path_buf();
    let mut left = len - used;
    while left > 0 {
        // Each part within the 255 bytes a file name may have.
        let part = left.min(200);
        dir.push("p".repeat(part));
        // The next part comes after its separator.
        left = left.saturating_sub(part + 1);
    }
    let dir = dir.join(name);
    assert_eq!(dir.as_os_str().len(), len, "{}", dir.display());
    if make {
        std::fs::create_dir_all(&dir).unwrap();
    }
    dir
}

/// Whether VM `id` of the data directory `data` was restored from a
/// snapshot template (its runtime record names the template), rather than
/// booted.
fn restored_from_a_template(data: &Path, id: &str) -> bool {
    let record: Value =
        serde_json::from_slice(&std::fs::read(data.join("vms").join(id).join("vm.json")).unwrap())
            .unwrap();
    record["template"].is_string()
}

/// `data/templates` is `templates`: the template built once, under a long
/// path, is restored by each process.
fn share(templates: &Path, data: &Path) {
    std::os::unix::fs::symlink(templates, data.join("templates")).unwrap();
}

#[test]
fn a_server_a_node_and_mcp_on_200_character_data_directories_restore_snapshot_and_fork() {
    let root = DataDir::new();
    let t = Instant::now();

    // A server. Its templates directory is its own, so the template is
    // built under this path (in `templates/.small.N.tmp`), as in the issue.
    let data = long_dir(root.path(), "server", LONG, true);
    let templates = data.join("templates");
    std::fs::create_dir(&templates).unwrap();
    std::fs::write(data.join("config.toml"), CONFIG).unwrap();
    let doctor = sandpit(&data).args(["doctor", "--json"]).output().unwrap();
    let line = String::from_utf8_lossy(&doctor.stdout)
        .lines()
        .find(|l| l.contains("\"data directory\""))
        .map(str::to_string)
        .expect("the data directory's line");
    let line: Value = serde_json::from_str(&line).unwrap();
    assert_eq!(line["verdict"], "ok", "{line}");
    assert!(
        line["found"]
            .as_str()
            .unwrap()
            .contains("unix sockets work"),
        "{line}"
    );
    let server = Server::start_with(&data, POOL);
    let key = server.admin_key.clone().unwrap();
    let api = Rest::new(&server, &key);
    rt().block_on(async {
        api.template_ready().await;
        let built: Vec<String> = std::fs::read_dir(&templates)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("small-"))
            .collect();
        assert_eq!(
            built.len(),
            1,
            "the template, under the long path: {built:?}"
        );
        restore_snapshot_and_fork(&api, &data).await;
    });
    drop(server);
    kill_vms_under(&data);
    eprintln!("server: {:?}", t.elapsed());

    // A node of a cluster (a replica without VMs in front of it, on a
    // short path), on a data directory of its own.
    let t = Instant::now();
    let pg = sandpit_pgtest::shared();
    let url = rt().block_on(pg.fresh_database());
    let certs = tempfile::tempdir().unwrap();
    sandpit_node::init_ca(certs.path()).unwrap();
    for member in ["replica", "node"] {
        sandpit_node::issue(certs.path(), member, &["127.0.0.1".into()]).unwrap();
    }
    let node_data = long_dir(root.path(), "node", LONG, true);
    share(&templates, &node_data);
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let node = Node::start(
        None,
        &node_data,
        &url,
        "node",
        &format!("127.0.0.1:{port}"),
        certs.path(),
        POOL,
    );
    let replica_data = root.path().join("replica");
    std::fs::create_dir(&replica_data).unwrap();
    let replica = Server::start_node_with(
        &replica_data,
        &url,
        "replica",
        "",
        &["--no-vms", "--cluster-dir", certs.path().to_str().unwrap()],
    );
    let key = replica.new_account("team", 5.0);
    let api = Rest::new(&replica, &key);
    rt().block_on(async {
        // The node publishes its warm VMs: its pool filled.
        let store = sandpit_store::Store::connect(&url).await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(300);
        loop {
            let row = store.node("node").await.unwrap();
            if row.is_some_and(|r| r.warm.get("small").is_some_and(|w| !w.is_empty())) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the node's warm pool did not fill"
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        restore_snapshot_and_fork(&api, &node_data).await;
    });
    drop(replica);
    drop(node);
    kill_vms_under(&node_data);
    eprintln!("node: {:?}", t.elapsed());

    // `sandpit mcp` (stdio) on a data directory of its own.
    let t = Instant::now();
    let mcp_data = long_dir(root.path(), "mcp", LONG, true);
    share(&templates, &mcp_data);
    std::fs::write(mcp_data.join("config.toml"), format!("{CONFIG}{POOL}")).unwrap();
    rt().block_on(async {
        use rmcp::transport::TokioChildProcess;
        let mut cmd = tokio::process::Command::from(sandpit(&mcp_data));
        cmd.arg("mcp");
        let client = ().serve(TokioChildProcess::new(cmd).unwrap()).await.unwrap();
        let call = |name: &'static str, a: Value| {
            let mut req = CallToolRequestParams::new(name);
            if let Value::Object(a) = a {
                req = req.with_arguments(a);
            }
            let client = &client;
            async move {
                let r = client.call_tool(req).await.unwrap();
                assert_ne!(r.is_error, Some(true), "{name}: {r:?}");
                r.structured_content.clone().expect("structuredContent")
            }
        };
        let deadline = Instant::now() + Duration::from_secs(300);
        loop {
            let info = call("get_service_info", json!({})).await;
            if info["fast_start"]["warm_pool"][0]["ready"].as_u64() >= Some(1) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the warm pool did not fill: {info}"
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        let a = call("create_sandbox", json!({"timeout_minutes": 10})).await;
        let a = a["id"].as_str().unwrap().to_string();
        assert!(restored_from_a_template(&mcp_data, &a), "{a} was booted");
        let call = &call;
        let sh = |id: String, command: &'static str| async move {
            let ex = call("run_command", json!({"sandbox_id": id, "command": command})).await;
            assert_eq!(ex["exit_code"], 0, "{command}: {ex}");
            ex["stdout"].as_str().unwrap().trim().to_string()
        };
        sh(a.clone(), "echo kept > /workspace/f").await;
        call("snapshot_sandbox", json!({"sandbox_id": a})).await;
        let fork = call("fork_sandbox", json!({"sandbox_id": a, "count": 1})).await;
        let copy = fork["sandboxes"][0]["id"].as_str().unwrap().to_string();
        assert_eq!(sh(copy, "cat /workspace/f").await, "kept");
        client.cancel().await.unwrap();
    });
    kill_vms_under(&mcp_data);
    eprintln!("mcp: {:?}", t.elapsed());

    // Past the one limit left, the data directory is refused at the start
    // of serve, node and mcp, and by doctor, each saying why.
    let too_long = long_dir(root.path(), "data", 3100, false);
    let on_too_long = || {
        let mut c = Command::new(env!("CARGO_BIN_EXE_sandpit"));
        c.arg("--data-dir")
            .arg(&too_long)
            .arg("--images-dir")
            .arg(images_dir())
            .stdin(Stdio::null());
        c
    };
    let why = "longer than the 3072 bytes taken";
    let certs_arg = certs.path().to_str().unwrap();
    let node_args = [
        "node",
        "--name",
        "node",
        "--listen",
        "127.0.0.1:0",
        "--cluster-dir",
        certs_arg,
    ];
    for args in [
        &["serve", "--listen", "127.0.0.1:0"][..],
        &["mcp"],
        &node_args,
    ] {
        let mut cmd = on_too_long();
        if args[0] == "node" {
            cmd.env("SANDPIT_DATABASE_URL", &url);
        }
        let out = cmd.args(args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?}: {err}");
        assert!(err.contains(why), "{args:?}: {err}");
        assert!(!too_long.exists(), "{args:?} made it");
    }
    let out = on_too_long().args(["doctor", "--json"]).output().unwrap();
    assert!(!out.status.success());
    let report = String::from_utf8_lossy(&out.stdout);
    let line = report
        .lines()
        .find(|l| l.contains("\"data directory\""))
        .expect("the data directory's line");
    let line: Value = serde_json::from_str(line).unwrap();
    assert_eq!(line["verdict"], "fail", "{line}");
    assert!(line["found"].as_str().unwrap().contains(why), "{line}");
}

/// A sandbox created through `api` is restored from a template under
/// `data`, snapshotted, and forked into a copy that has its file.
async fn restore_snapshot_and_fork(api: &Rest, data: &Path) {
    let (st, a) = api.post("/sandboxes", json!({"timeout_minutes": 10})).await;
    assert_eq!(st, 201, "{a}");
    let a = a["id"].as_str().unwrap().to_string();
    assert!(restored_from_a_template(data, &a), "{a} was booted");
    api.sh(&a, "echo kept > /workspace/f").await;
    let (st, snap) = api
        .post(&format!("/sandboxes/{a}/snapshots"), json!({}))
        .await;
    assert_eq!(st, 201, "{snap}");
    let (st, fork) = api
        .post(&format!("/sandboxes/{a}/fork"), json!({"count": 1}))
        .await;
    assert_eq!(st, 201, "{fork}");
    let copy = fork["sandboxes"][0]["id"].as_str().unwrap();
    assert_eq!(api.sh(copy, "cat /workspace/f").await, "kept");
}
