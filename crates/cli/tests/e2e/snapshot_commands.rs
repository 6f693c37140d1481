//! `sandpit sandbox snapshot|fork|restore|snapshots|delete-snapshot` and
//! `create --snapshot`: the commands that talk to a server, run as a person
//! runs them (a process each) against the REST API served over the
//! in-memory fake (`sandpit-fake`). No VM is involved: what the service does
//! with a snapshot is proven by the real-VM tests; this proves the commands
//! ask the server for the right thing and print what it answers.

use sandpit_core::prelude::*;
use sandpit_core::{Caller, CreateSandbox, Encoding, SandboxApi, WriteFile};
use sandpit_fake::{Fake, Op, ACCOUNT_A, KEY_A};
use serde_json::Value;
use std::process::{Command, Output};
use std::sync::Arc;

struct Server {
    url: String,
    fake: Arc<Fake>,
    data: tempfile::TempDir,
    rt: tokio::runtime::Runtime,
}

impl Server {
    fn start() -> Server {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let fake = Fake::new();
        let app = sandpit_api::router(fake.clone(), Default::default());
        let listener = rt
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let addr = listener.local_addr().unwrap();
        rt.spawn(async move { axum::serve(listener, app).await });
        Server {
            url: format!("http://{addr}"),
            fake,
            data: tempfile::tempdir().unwrap(),
            rt,
        }
    }

    /// `sandpit --data-dir D sandbox ARGS` with the server's URL and account
    /// A's key in the environment.
    fn run(&self, args: &[&str]) -> Output {
        self.command(args)
            .env("SANDPIT_API_KEY", KEY_A)
            .output()
            .unwrap()
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_sandpit"));
        c.arg("--data-dir")
            .arg(self.data.path())
            .arg("sandbox")
            .args(args)
            .env("SANDPIT_URL", &self.url)
            .env_remove("SANDPIT_API_KEY")
            .env_remove("SANDPIT_CONFIG")
            .env_remove("SANDPIT_DATABASE_URL");
        c
    }

    fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert!(
            out.status.success(),
            "sandpit sandbox {args:?} failed: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    fn read(&self, id: &str, path: &str) -> String {
        let api: Arc<dyn SandboxApi> = self.fake.clone();
        self.rt
            .block_on(api.read_file(&a(), id, path, Encoding::Utf8))
            .unwrap()
            .content
    }

    fn write(&self, id: &str, path: &str, content: &str) {
        let req = WriteFile {
            path: path.into(),
            content: content.into(),
            encoding: None,
        };
        self.rt
            .block_on(self.fake.write_file(&a(), id, req))
            .unwrap();
    }

    /// The last call of the operation `name`.
    fn last(&self, name: &str) -> Op {
        let calls = self.fake.calls();
        let call = calls.iter().rev().find(|c| c.op.name() == name);
        call.unwrap_or_else(|| panic!("no {name} in {calls:?}"))
            .op
            .clone()
    }
}

fn a() -> Caller {
    Caller::new(ACCOUNT_A, "test")
}

fn lines(s: &str) -> Vec<&str> {
    s.lines().collect()
}

#[test]
fn snapshot_restore_fork_create_list_delete() {
    let s = Server::start();
    let sbx = s.fake.add_sandbox(ACCOUNT_A, "sbx_cli").id;
    s.write(&sbx, "state.txt", "good");

    let out = s.ok(&["snapshot", &sbx, "--name", "base"]);
    let snap = out.trim().to_owned();
    assert!(
        snap.starts_with("snap_") && lines(&out).len() == 1,
        "stdout is the id alone: {out:?}"
    );
    let Op::SnapshotSandbox { id, req, .. } = s.last("snapshot_sandbox") else {
        unreachable!()
    };
    assert_eq!(
        (id.as_str(), req.name.as_deref()),
        ("sbx_cli", Some("base"))
    );

    s.write(&sbx, "state.txt", "broken");
    assert_eq!(s.ok(&["restore", &sbx, &snap]), "sbx_cli\n");
    assert_eq!(s.read(&sbx, "state.txt"), "good");

    let out = s.ok(&["fork", &sbx, "--count", "2", "--timeout", "30m"]);
    let copies = lines(&out);
    assert_eq!(copies.len(), 2, "{out}");
    for c in &copies {
        assert!(c.starts_with("sbx_"), "{c}");
        assert_eq!(s.read(c, "state.txt"), "good");
    }
    let Op::ForkSandbox { req, .. } = s.last("fork_sandbox") else {
        unreachable!()
    };
    assert_eq!((req.count, req.timeout_minutes), (Some(2), Some(30)));
    let fork: Value = serde_json::from_str(&s.ok(&["fork", &sbx, "--json"])).unwrap();
    assert_eq!(fork["sandboxes"].as_array().unwrap().len(), 1);
    assert_eq!(fork["snapshot"]["sandbox_id"], "sbx_cli");

    let created: Value = serde_json::from_str(&s.ok(&[
        "create",
        "--snapshot",
        &snap,
        "--name",
        "from-cli",
        "--timeout",
        "1h",
        "--json",
    ]))
    .unwrap();
    let new_id = created["id"].as_str().unwrap();
    assert_eq!(created["name"], "from-cli");
    assert_eq!(s.read(new_id, "state.txt"), "good");
    let Op::CreateSandbox { req, .. } = s.last("create_sandbox") else {
        unreachable!()
    };
    assert_eq!(
        *req,
        CreateSandbox {
            size: None,
            name: Some("from-cli".into()),
            timeout_minutes: Some(60),
            snapshot_id: Some(snap.clone()),
            ..CreateSandbox::default()
        }
    );

    // Newest first: the two forks' snapshots, then the named one.
    let table = s.ok(&["snapshots"]);
    let rows = lines(&table);
    assert_eq!(rows.len(), 4, "{table}");
    assert!(rows[0].starts_with("ID "), "{table}");
    assert!(
        rows[3].starts_with(&snap) && rows[3].ends_with(" base"),
        "{table}"
    );
    let listed: Vec<Value> = serde_json::from_str(&s.ok(&["snapshots", "--json"])).unwrap();
    assert_eq!(listed.len(), 3);
    assert_eq!(listed[2]["id"], snap.as_str());
    assert_eq!(listed[0]["id"], fork["snapshot"]["id"]);

    // One unknown id: the rest are deleted, the exit code says one failed.
    let out = s.run(&["delete-snapshot", &snap, "snap_nope"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(String::from_utf8_lossy(&out.stdout), format!("{snap}\n"));
    assert!(String::from_utf8_lossy(&out.stderr).contains("snap_nope"));
    let listed: Vec<Value> = serde_json::from_str(&s.ok(&["snapshots", "--json"])).unwrap();
    assert_eq!(listed.len(), 2);
}

#[test]
fn the_servers_refusals_and_a_missing_key_are_reported() {
    let s = Server::start();
    let sbx = s.fake.add_sandbox(ACCOUNT_A, "sbx_cli").id;

    let out = s.run(&["fork", &sbx, "--count", "11"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("invalid_request") && err.contains("count"),
        "{err}"
    );

    let out = s.run(&["restore", &sbx, "snap_nope"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not_found"), "{err}");

    let out = s.run(&["fork", &sbx, "--timeout", "10s"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--timeout"));

    // No key: says where to put one, and asks the server nothing.
    let before = s.fake.calls().len();
    let out = s.command(&["snapshot", &sbx]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("SANDPIT_API_KEY"), "{err}");
    let out = s
        .command(&["snapshots"])
        .env("SANDPIT_API_KEY", "sk_wrong")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unauthorized"));
    assert_eq!(s.fake.calls().len(), before);
}
