//! Machines sharing one PostgreSQL database: real `sandpit serve
//! --database postgres://…` processes with real VMs, on a real PostgreSQL
//! server the test starts (Debian's, from `initdb` in a temporary directory,
//! as the `postgres` user: see `sandpit-pgtest`); the operator commands on
//! the same database; servers killed, restarted, frozen and thawed; the
//! cluster's certificates made by the CLI.

use crate::common::serve::*;
use crate::common::*;
use sandpit_store::{new_id, CreateOutcome, NewSandbox, SandboxStatus, Store};
use serde_json::json;
use std::process::Stdio;
use std::time::{Duration, Instant};

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// `sandpit ARGS` on `data` with the database URL in the environment, as an
/// operator would set it; (success, stdout, stderr).
fn with_database(data: &std::path::Path, url: &str, args: &[&str]) -> (bool, String, String) {
    let out = sandpit(data)
        .env("SANDPIT_DATABASE_URL", url)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).trim().to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

#[test]
fn a_server_on_postgresql_keeps_its_state_there_and_only_its_own_sandboxes() {
    let pg = sandpit_pgtest::shared();
    let url = rt().block_on(pg.fresh_database());
    let data = data_dir();
    std::fs::write(data.join("config.toml"), CONFIG).unwrap();

    // The operator commands work on the database before any server runs.
    let (ok, _, err) = with_database(&data, &url, &["account", "create", "team", "--credit", "5"]);
    assert!(ok, "account create: {err}");
    let (ok, key, err) = with_database(&data, &url, &["key", "create", "--account", "team"]);
    assert!(ok && key.starts_with("sp_"), "key create: {err}");

    // Another machine's sandbox in the same database.
    let theirs = rt().block_on(async {
        let store = Store::connect(&url).await.unwrap();
        let team = store.account_by_name("team").await.unwrap().unwrap();
        let now = time::OffsetDateTime::now_utc();
        let row = match store
            .create_sandbox(NewSandbox {
                id: new_id("sbx"),
                account_id: team.id,
                name: None,
                size: "small".into(),
                vcpus: 2,
                memory_mb: 1024,
                disk_gb: 4,
                timeout_minutes: 30,
                price_micros_per_hour: 90_000,
                host: "machine-b".into(),
                created_at: now,
                expires_at: now + time::Duration::minutes(30),
                reserve_micros: 45_000,
                max_concurrent: None,
                disk_limit_bytes: None,
                idempotency: None,
                host_epoch: None,
                snapshot_id: None,
                metadata: Default::default(),
                env: Default::default(),
                access_token: None,
                every_port_public: false,
                internet_access: None,
                network: None,
                template_id: None,
                workdir: None,
                start_from: None,
                cause: Default::default(),
            })
            .await
            .unwrap()
        {
            CreateOutcome::Created(r) => r,
            other => panic!("{other:?}"),
        };
        store
            .set_status(
                &row.id,
                SandboxStatus::Running,
                None,
                &sandpit_store::Cause::default(),
            )
            .await
            .unwrap();
        row.id
    });

    let server = Server::start_on_database(&data, &url, "machine-a");
    assert!(
        !data.join("sandpit.db").exists(),
        "a server on PostgreSQL made a SQLite file"
    );
    assert_eq!(
        server.admin_key, None,
        "a database with accounts got a first-start admin"
    );
    let id = rt().block_on(async {
        let api = Rest::new(&server, &key);
        let (st, sbx) = api.post("/sandboxes", json!({"timeout_minutes": 10})).await;
        assert_eq!(st, 201, "{sbx}");
        let id = sbx["id"].as_str().unwrap().to_string();
        let (st, ex) = api
            .post(
                &format!("/sandboxes/{id}/exec"),
                json!({"command": "printf 'a\\0b'; echo"}),
            )
            .await;
        assert_eq!(st, 200, "{ex}");
        assert_eq!(ex["stdout"], "a\u{0}b\n", "{ex}");
        // The other machine's sandbox is listed (same account, same
        // database) and was left running.
        let (_, list) = api.get("/sandboxes").await;
        let ids: Vec<&str> = list["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["id"].as_str().unwrap())
            .collect();
        assert!(
            ids.contains(&theirs.as_str()) && ids.contains(&id.as_str()),
            "{list}"
        );
        id
    });

    // Killed and restarted, it finds its sandbox in the database and its
    // VM still running; the other machine's is not its to reconcile.
    server.sigkill();
    let server = Server::start_on_database(&data, &url, "machine-a");
    rt().block_on(async {
        let api = Rest::new(&server, &key);
        let (st, ex) = api
            .post(
                &format!("/sandboxes/{id}/exec"),
                json!({"command": "echo back"}),
            )
            .await;
        assert_eq!((st, ex["stdout"].as_str()), (200, Some("back\n")), "{ex}");
        let (_, s) = api.get(&format!("/sandboxes/{theirs}")).await;
        assert_eq!(s["status"], "running", "{s}");
        let (st, d) = api
            .call(reqwest::Method::DELETE, &format!("/sandboxes/{id}"), None)
            .await;
        assert_eq!((st, d["status"].as_str()), (200, Some("deleted")), "{d}");

        // The money is in PostgreSQL: the ledger sums to the balance.
        let store = Store::connect(&url).await.unwrap();
        let team = store.account_by_name("team").await.unwrap().unwrap();
        let sum: i64 = store
            .ledger(&team.id)
            .await
            .unwrap()
            .iter()
            .map(|l| l.amount_micros)
            .sum();
        assert_eq!(sum, store.balance(&team.id).await.unwrap());
        assert!(sum < 5_000_000 && sum > 0, "balance {sum}");
    });

    // `sandpit mcp` keeps its sandboxes in the data directory: it says so
    // rather than ignore the database it was given.
    let (ok, _, err) = with_database(&data, &url, &["mcp"]);
    assert!(!ok && err.contains("sandpit mcp --remote"), "{err}");
    // --name is for a shared database only.
    let out = sandpit(&data)
        .args(["serve", "--name", "x", "--listen", "127.0.0.1:0"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--name"), "{err}");
}

/// The account `team` with $5 and a key for it, made by the operator
/// commands on the database at `url` (before any server runs there).
fn team_key(data: &std::path::Path, url: &str) -> String {
    std::fs::write(data.join("config.toml"), CONFIG).unwrap();
    let (ok, _, err) = with_database(data, url, &["account", "create", "team", "--credit", "5"]);
    assert!(ok, "account create: {err}");
    let (ok, key, err) = with_database(data, url, &["key", "create", "--account", "team"]);
    assert!(ok, "key create: {err}");
    key
}

/// A short lease and grace, and no warm pool (two servers share 2 cores).
const NODE_CONFIG: &str = "[cluster]\nlease_secs = 3\nlost_after_secs = 2\n[pool]\nsizes = {}\n";

fn sandbox_status(api: &Rest, id: &str) -> (String, String) {
    rt().block_on(async {
        let (st, s) = api.get(&format!("/sandboxes/{id}")).await;
        assert_eq!(st, 200, "{s}");
        (
            s["status"].as_str().unwrap().to_string(),
            s["deleted_reason"].as_str().unwrap_or("").to_string(),
        )
    })
}

fn create_on(server: &Server, key: &str) -> String {
    rt().block_on(async {
        let (st, s) = Rest::new(server, key)
            .post("/sandboxes", json!({"timeout_minutes": 30}))
            .await;
        assert_eq!(st, 201, "{s}");
        s["id"].as_str().unwrap().to_string()
    })
}

/// A cluster CA in a temporary directory, with a certificate for each of
/// `members` on the loopback address.
fn loopback_certs(members: &[&str]) -> tempfile::TempDir {
    let certs = tempfile::tempdir().unwrap();
    sandpit_node::init_ca(certs.path()).unwrap();
    for member in members {
        sandpit_node::issue(certs.path(), member, &["127.0.0.1".into()]).unwrap();
    }
    certs
}

fn vm_runs(id: &str) -> bool {
    !pids_mentioning(&format!("sandpit-vm-{id}")).is_empty()
}

#[test]
fn a_silent_node_is_declared_lost_its_sandboxes_settled_once_and_it_is_fenced() {
    let pg = sandpit_pgtest::shared();
    let url = rt().block_on(pg.fresh_database());
    let (data_a, data_b) = (data_dir(), data_dir());
    let key = team_key(&data_a, &url);

    // Each node serves its API over mutual TLS with the cluster's
    // certificates; the test calls it as a member would.
    let certs = loopback_certs(&["a", "b", "replica"]);
    let ca = certs.path();
    let ca_arg = ca.to_str().unwrap();
    let node_args = ["--node-listen", "127.0.0.1:0", "--cluster-dir", ca_arg];
    let replica = sandpit_node::NodeClient::new(
        sandpit_node::client_config(&sandpit_node::Identity::in_dir(ca, "replica")).unwrap(),
    );
    // The node's row (address, epoch) and its API's answer at `epoch`.
    let health = |name: &str, epoch: Option<i64>| {
        rt().block_on(async {
            let store = Store::connect(&url).await.unwrap();
            let row = store.node(name).await.unwrap().unwrap();
            let asked = epoch.unwrap_or(row.epoch);
            (row.epoch, replica.health(&row.address, asked).await)
        })
    };

    // a is a control-plane replica (no VMs), b a server that is also a node.
    let a = Server::start_node_with(
        &data_a,
        &url,
        "a",
        NODE_CONFIG,
        &["--no-vms", "--cluster-dir", ca_arg],
    );
    let b = Server::start_node_with(&data_b, &url, "b", NODE_CONFIG, &node_args);
    let (epoch, answer) = health("b", None);
    assert_eq!(
        answer.unwrap(),
        sandpit_node::Health {
            name: "b".into(),
            epoch
        }
    );
    let on_b = create_on(&b, &key);
    let via_a = Rest::new(&a, &key);
    // Seen from a, b's sandbox is listed and running, and a command sent
    // to a runs on b (through b's node API), output as bytes.
    assert_eq!(sandbox_status(&via_a, &on_b).0, "running");
    rt().block_on(async {
        let (st, ex) = via_a
            .post(
                &format!("/sandboxes/{on_b}/exec"),
                json!({"command": "printf 'on %s\\0' $(hostname); echo; echo err >&2; exit 3"}),
            )
            .await;
        assert_eq!(st, 200, "{ex}");
        // (A hostname is the sandbox id with '-' for '_'.)
        let host = on_b.replace('_', "-");
        assert_eq!(ex["stdout"], format!("on {host}\u{0}\n"), "{ex}");
        assert_eq!(
            (ex["stderr"].as_str(), ex["exit_code"].as_i64()),
            (Some("err\n"), Some(3))
        );
        // Recorded by a, in the shared database: b's server shows it too.
        let (st, again) = Rest::new(&b, &key)
            .get(&format!("/executions/{}", ex["id"].as_str().unwrap()))
            .await;
        assert_eq!((st, &again["stdout"]), (200, &ex["stdout"]), "{again}");

        // What the hop costs (printed, not judged: `sandpit bench` is where
        // speed is measured): `true` through a to b, and on b directly.
        let via_b = Rest::new(&b, &key);
        let mut timings = [Vec::new(), Vec::new()];
        for _ in 0..15 {
            for (i, api) in [&via_a, &via_b].into_iter().enumerate() {
                let t = Instant::now();
                let (st, ex) = api
                    .post(
                        &format!("/sandboxes/{on_b}/exec"),
                        json!({"command": "true"}),
                    )
                    .await;
                assert_eq!(st, 200, "{ex}");
                timings[i].push(t.elapsed().as_secs_f64() * 1000.0);
            }
        }
        for t in &mut timings {
            t.sort_by(f64::total_cmp);
        }
        eprintln!(
            "run_command(\"true\") on b: {:.2} ms through a, {:.2} ms on b itself (medians of 15)",
            timings[0][7], timings[1][7]
        );

        // A client that hangs up mid-command takes the command on b with it.
        let impatient = reqwest::Client::builder()
            .timeout(Duration::from_secs(3))
            .build()
            .unwrap();
        let cut = impatient
            .post(format!("{}/v1/sandboxes/{on_b}/exec", a.url))
            .bearer_auth(&key)
            .json(&json!({"command": "sleep 301"}))
            .send()
            .await;
        assert!(cut.is_err(), "the command answered within 3 s?");
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let (st, ex) = via_a
                .post(
                    &format!("/sandboxes/{on_b}/exec"),
                    json!({"command": "pgrep -x sleep || echo none"}),
                )
                .await;
            assert_eq!(st, 200, "{ex}");
            if ex["stdout"] == "none\n" {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the cut command still runs on b: {ex}"
            );
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    });

    // Extended through a, b's VM learns the new expiry through b's node
    // API (its own watchdog would otherwise end it at the old one).
    let watchdog = |id: &str| -> i64 {
        std::fs::read_to_string(data_b.join("vms").join(id).join("expires"))
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    };
    let before = watchdog(&on_b);
    rt().block_on(async {
        let (st, s) = via_a
            .post(
                &format!("/sandboxes/{on_b}/extend"),
                json!({"additional_minutes": 5}),
            )
            .await;
        assert_eq!(st, 200, "{s}");
    });
    wait_until(
        "b's VM follows the extension",
        Duration::from_secs(15),
        || watchdog(&on_b) >= before + 5 * 60,
    );

    // SIGKILL b: a declares it lost and settles its sandbox, once.
    let b_data = b.data.clone();
    b.sigkill();
    assert!(vm_runs(&on_b), "the VM died with its server");
    // Its node is gone: a command for it is a typed, retryable refusal.
    rt().block_on(async {
        let (st, e) = via_a
            .post(
                &format!("/sandboxes/{on_b}/exec"),
                json!({"command": "true"}),
            )
            .await;
        assert_eq!(st, 503, "{e}");
        assert_eq!(e["error"]["type"], "service_unavailable", "{e}");
    });
    let settled = wait_until("b's sandbox failed", Duration::from_secs(40), || {
        sandbox_status(&via_a, &on_b).0 == "failed"
    });
    eprintln!("node loss settled {settled:?} after the SIGKILL (lease 3 s, grace 2 s)");
    let reason = sandbox_status(&via_a, &on_b).1;
    assert!(reason.contains("its node b was lost"), "{reason}");

    // b starts again: it is up under a new epoch, and the VM of the
    // sandbox that failed with it goes.
    let b = Server::start_node_with(&b_data, &url, "b", NODE_CONFIG, &node_args);
    wait_until(
        "the lost sandbox's VM removed",
        Duration::from_secs(30),
        || !vm_runs(&on_b),
    );
    // A call meant for b's first life is refused by its second.
    let (epoch, answer) = health("b", Some(1));
    assert_eq!(epoch, 2);
    assert!(
        matches!(answer, Err(sandpit_node::NodeError::StaleEpoch(_))),
        "{answer:?}"
    );
    assert_eq!(health("b", None).1.unwrap().epoch, 2);

    // SIGSTOP b past its lease and the grace, then SIGCONT: it was fenced,
    // finds out at its next heartbeat, removes the VM and joins again.
    let frozen = create_on(&b, &key);
    // SAFETY: signals to the test's own child.
    unsafe { libc::kill(b.child.id() as i32, libc::SIGSTOP) };
    wait_until(
        "the frozen node's sandbox failed",
        Duration::from_secs(40),
        || sandbox_status(&via_a, &frozen).0 == "failed",
    );
    unsafe { libc::kill(b.child.id() as i32, libc::SIGCONT) };
    b.wait_for_log("lost its lease", Duration::from_secs(20))
        .expect("b tells that it was fenced");
    wait_until(
        "the fenced node's VM removed",
        Duration::from_secs(30),
        || !vm_runs(&frozen),
    );
    // Joined again (its VMs go first, then it registers), it serves new
    // sandboxes.
    b.wait_for_log("joined the cluster again", Duration::from_secs(20))
        .expect("b joins the cluster again");
    let after = create_on(&b, &key);
    assert_eq!(sandbox_status(&Rest::new(&b, &key), &after).0, "running");
    assert_eq!(health("b", None).1.unwrap().epoch, 3);
    assert!(matches!(
        health("b", Some(2)).1,
        Err(sandpit_node::NodeError::StaleEpoch(_))
    ));

    // Each lost sandbox's log tells its failure once, not once per
    // replica that swept, naming the node and the replica that declared it.
    rt().block_on(async {
        for id in [&on_b, &frozen] {
            let (st, log) = via_a.get(&format!("/sandboxes/{id}/events")).await;
            assert_eq!(st, 200, "{log}");
            let failed: Vec<&serde_json::Value> = log["data"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|e| e["type"] == "sandbox.failed")
                .collect();
            assert_eq!(failed.len(), 1, "{id}: {log}");
            assert_eq!(failed[0]["detail"]["node"], "b", "{}", failed[0]);
            let actor = failed[0]["actor"].as_str().unwrap();
            assert!(actor.starts_with("replica "), "{actor}");
            assert_eq!(log["data"].as_array().unwrap().last(), Some(failed[0]));
        }
    });

    rt().block_on(async {
        let store = Store::connect(&url).await.unwrap();
        let nodes = store.nodes().await.unwrap();
        let b_row = nodes.iter().find(|n| n.name == "b").unwrap();
        assert_eq!((b_row.epoch, b_row.state.as_str()), (3, "up"), "{nodes:?}");
        assert!(nodes.iter().all(|n| n.is_live()), "{nodes:?}");
        // Each lost sandbox was reserved, released and charged exactly once;
        // the ledger sums to the balance.
        let team = store.account_by_name("team").await.unwrap().unwrap();
        let ledger = store.ledger(&team.id).await.unwrap();
        // (b's first sandbox was extended once: two reservations.) A lost
        // sandbox is billed until its node's last heartbeat: the frozen
        // one, made a moment before the SIGSTOP, may have no second after
        // it to be charged, and then has no charge row.
        for (id, reserves, surely_charged) in [(&on_b, 2, true), (&frozen, 1, false)] {
            let rows: Vec<_> = ledger
                .iter()
                .filter(|l| l.sandbox_id.as_deref() == Some(id.as_str()))
                .collect();
            let kinds: Vec<&str> = rows.iter().map(|l| l.kind.as_str()).collect();
            let mut want = vec!["reserve"; reserves];
            want.push("release");
            if surely_charged || kinds.last() == Some(&"charge") {
                want.push("charge");
            }
            assert_eq!(kinds, want, "{id}");
            // Everything reserved came back, and then the charge went.
            let held: i64 = rows
                .iter()
                .filter(|l| l.kind != "charge")
                .map(|l| l.amount_micros)
                .sum();
            assert_eq!(held, 0, "{id}: {rows:?}");
        }
        let sum: i64 = ledger.iter().map(|l| l.amount_micros).sum();
        assert_eq!(sum, store.balance(&team.id).await.unwrap());
    });
    drop(a);
    drop(b);
}

/// Node b keeps one warm VM, and publishes it.
const POOL_CONFIG: &str =
    "[cluster]\nlease_secs = 3\nlost_after_secs = 2\n[pool]\nsizes = { small = 1 }\n";

#[test]
fn a_replica_names_a_sandbox_after_the_warm_vm_a_node_published() {
    let pg = sandpit_pgtest::shared();
    let url = rt().block_on(pg.fresh_database());
    let (data_a, data_b) = (data_dir(), data_dir());
    let key = team_key(&data_a, &url);
    let certs = loopback_certs(&["a", "b", "c"]);
    let ca = certs.path();
    let ca_arg = ca.to_str().unwrap();
    // a is a control-plane replica (no VMs, its metrics on a listener of
    // their own), b a node with a warm pool.
    let a = Server::start_node_with(
        &data_a,
        &url,
        "a",
        &format!("{NODE_CONFIG}[metrics]\nlisten = \"127.0.0.1:0\"\n"),
        &["--no-vms", "--cluster-dir", ca_arg],
    );
    let a_metrics = a
        .wait_for_log("metrics at ", Duration::from_secs(5))
        .expect("a's metrics listener")
        .split("metrics at ")
        .nth(1)
        .unwrap()
        .trim()
        .to_string();
    let b = Server::start_node_with(
        &data_b,
        &url,
        "b",
        POOL_CONFIG,
        &["--node-listen", "127.0.0.1:0", "--cluster-dir", ca_arg],
    );
    // b's ready VM other than `not`, as b's heartbeat published it; then a
    // heartbeat of a's (every second), which reads it.
    let published = |not: &[&str]| -> String {
        let deadline = Instant::now() + Duration::from_secs(300);
        let id = rt().block_on(async {
            let store = Store::connect(&url).await.unwrap();
            loop {
                let row = store.node("b").await.unwrap().unwrap();
                let ready = row.warm.get("small").cloned().unwrap_or_default();
                if let Some(id) = ready.into_iter().find(|id| !not.contains(&id.as_str())) {
                    break id;
                }
                assert!(Instant::now() < deadline, "b never published a warm VM");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        });
        std::thread::sleep(Duration::from_secs(2));
        id
    };
    let via_a = Rest::new(&a, &key);

    // The create through a takes b's published VM: the sandbox has its id.
    let warm = published(&[]);
    let first = create_on(&a, &key);
    assert_eq!(first, warm, "not the VM b published");
    assert_eq!(sandbox_status(&via_a, &first).0, "running");
    rt().block_on(async {
        let (st, ex) = via_a
            .post(
                &format!("/sandboxes/{first}/exec"),
                json!({"command": "hostname"}),
            )
            .await;
        assert_eq!(st, 200, "{ex}");
        assert_eq!(
            ex["stdout"],
            format!("{}\n", first.replace('_', "-")),
            "{ex}"
        );
    });

    // Another create (as another replica's would) took b's next published
    // VM's id first: a's create finds the id taken, asks b, which gives
    // that same VM (not handed over yet), finds it taken again, and asks
    // once more: a VM started for it.
    let next = published(&[&first]);
    let team = rt().block_on(async {
        let store = Store::connect(&url).await.unwrap();
        let team = store.account_by_name("team").await.unwrap().unwrap();
        let now = time::OffsetDateTime::now_utc();
        let taken = NewSandbox {
            id: next.clone(),
            account_id: team.id.clone(),
            name: None,
            size: "small".into(),
            vcpus: 2,
            memory_mb: 1024,
            disk_gb: 4,
            timeout_minutes: 30,
            price_micros_per_hour: 0,
            host: "b".into(),
            host_epoch: None,
            snapshot_id: None,
            created_at: now,
            expires_at: now + time::Duration::minutes(30),
            reserve_micros: 0,
            max_concurrent: None,
            disk_limit_bytes: None,
            idempotency: None,
            metadata: Default::default(),
            env: Default::default(),
            access_token: None,
            every_port_public: false,
            internet_access: None,
            network: None,
            template_id: None,
            workdir: None,
            start_from: None,
            cause: Default::default(),
        };
        assert!(matches!(
            store.create_sandbox(taken).await.unwrap(),
            CreateOutcome::Created(_)
        ));
        team
    });
    let second = create_on(&a, &key);
    assert_ne!(second, next);
    assert_eq!(sandbox_status(&via_a, &second).0, "running");
    // a counts its creates by how b started them: the first from b's
    // pool, the second restored from b's template (b says so), none `new`.
    let creates = |path: &str| -> f64 {
        let text = rt().block_on(async {
            reqwest::get(&a_metrics)
                .await
                .unwrap()
                .text()
                .await
                .unwrap()
        });
        text.lines()
            .filter(|l| l.starts_with("sandpit_sandbox_creates_total{"))
            .filter(|l| l.contains(&format!("path=\"{path}\"")) && l.contains("outcome=\"ok\""))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    assert_eq!(
        (creates("pool"), creates("restore"), creates("new")),
        (1.0, 1.0, 0.0)
    );

    rt().block_on(async {
        let store = Store::connect(&url).await.unwrap();
        let row = store.sandbox(&next).await.unwrap().unwrap();
        assert_eq!(
            row.status,
            SandboxStatus::Provisioning,
            "the other create's row is its own"
        );
        store
            .finish_sandbox(
                &next,
                SandboxStatus::Failed,
                "test",
                time::OffsetDateTime::now_utc(),
                0,
                &sandpit_store::Cause::default(),
            )
            .await
            .unwrap();
        // Nothing was reserved twice: the ledger sums to the balance.
        let ledger = store.ledger(&team.id).await.unwrap();
        let sum: i64 = ledger.iter().map(|l| l.amount_micros).sum();
        assert_eq!(sum, store.balance(&team.id).await.unwrap());
        assert_eq!(
            ledger.iter().filter(|l| l.kind == "reserve").count(),
            2,
            "{ledger:?}"
        );
    });

    // Snapshots through the replica: taken, started from, restored,
    // paused and resumed on the node that holds them, over the node API.
    rt().block_on(async {
        let sh = |id: String, command: &'static str| {
            let via_a = &via_a;
            async move {
                let (st, ex) = via_a
                    .post(
                        &format!("/sandboxes/{id}/exec"),
                        json!({ "command": command }),
                    )
                    .await;
                assert_eq!(st, 200, "{ex}");
                assert_eq!(ex["exit_code"], 0, "{command}: {ex}");
                ex["stdout"].as_str().unwrap().trim().to_string()
            }
        };
        sh(first.clone(), "echo kept > /workspace/f").await;
        let (st, snap) = via_a
            .post(&format!("/sandboxes/{first}/snapshots"), json!({}))
            .await;
        assert_eq!(st, 201, "{snap}");
        let snap_id = snap["id"].as_str().unwrap().to_string();
        let (st, copy) = via_a
            .post("/sandboxes", json!({"snapshot_id": snap_id}))
            .await;
        assert_eq!(st, 201, "{copy}");
        let copy = copy["id"].as_str().unwrap().to_string();
        assert_eq!(sh(copy.clone(), "cat /workspace/f").await, "kept");
        let store = Store::connect(&url).await.unwrap();
        assert_eq!(store.sandbox(&copy).await.unwrap().unwrap().host, "b");
        assert_eq!(store.snapshot(&snap_id).await.unwrap().unwrap().host, "b");
        sh(first.clone(), "rm /workspace/f").await;
        // Restored through a while b (a replica too) serves the sandbox's
        // calls: a call that meets the VM being replaced is told to retry,
        // and never fails the sandbox.
        let via_b = Rest::new(&b, &key);
        let restoring = std::sync::atomic::AtomicBool::new(true);
        let calls = async {
            let mut answers = Vec::new();
            while restoring.load(std::sync::atomic::Ordering::SeqCst) {
                let (st, ex) = via_b
                    .post(
                        &format!("/sandboxes/{first}/exec"),
                        json!({"command": "true"}),
                    )
                    .await;
                answers.push((st, ex));
            }
            answers
        };
        let restore = async {
            let answer = via_a
                .post(
                    &format!("/sandboxes/{first}/restore"),
                    json!({"snapshot_id": snap_id}),
                )
                .await;
            restoring.store(false, std::sync::atomic::Ordering::SeqCst);
            answer
        };
        let ((st, back), answers) = tokio::join!(restore, calls);
        assert_eq!(st, 200, "{back}");
        assert!(!answers.is_empty(), "no call went through b meanwhile");
        for (st, ex) in &answers {
            assert!(
                *st == 200 || *st == 503,
                "a call through b meanwhile: {st} {ex}"
            );
        }
        let (_, now) = via_b.get(&format!("/sandboxes/{first}")).await;
        assert_eq!(now["status"], "running", "{now}");
        assert_eq!(sh(first.clone(), "cat /workspace/f").await, "kept");
        let (st, p) = via_a
            .post(&format!("/sandboxes/{first}/pause"), json!({}))
            .await;
        assert_eq!((st, p["status"].as_str()), (200, Some("paused")), "{p}");
        assert!(!vm_runs(&first), "a paused sandbox's QEMU still runs");
        // A command resumes it.
        assert_eq!(sh(first.clone(), "cat /workspace/f").await, "kept");
        let (_, now) = via_a.get(&format!("/sandboxes/{first}")).await;
        assert_eq!(now["status"], "running", "{now}");
        let (st, _) = via_a
            .call(
                reqwest::Method::DELETE,
                &format!("/snapshots/{snap_id}"),
                None,
            )
            .await;
        assert_eq!(st, 200);
        let (st, _) = via_a
            .call(reqwest::Method::DELETE, &format!("/sandboxes/{copy}"), None)
            .await;
        assert_eq!(st, 200);
    });

    // E2B's Python SDK through a, which runs no VMs: every call, a
    // directory watch's included, reaches b over the node API.
    let python = crate::e2b::sdk_python();
    let done = crate::e2b::run_sdk(&python, "python_replica.py", &a, &key, &key, &key);
    crate::e2b::checked(
        "python_replica.py",
        &done,
        &[
            "create, commands.run",
            "output as it comes, CommandExitException",
            "background, connect from a second client, kill",
            "files.write, files.read, watch_dir",
            "kill",
        ],
    );

    // b dies (SIGKILL) with a warm VM published; a create through a at
    // once goes to b first (its lease has not lapsed), cannot reach it,
    // and goes on to c in the same request. Its retry with the same key
    // answers the sandbox on c, never the one that failed on b.
    let data_c = data_dir();
    let c = Server::start_node_with(&data_c, &url, "c", NODE_CONFIG, &node_args(ca_arg));
    published(&[&first, &next, &second]);
    b.sigkill();
    let create = |key_header: &str| {
        rt().block_on(async {
            let r = reqwest::Client::new()
                .post(format!("{}/v1/sandboxes", a.url))
                .bearer_auth(&key)
                .header("Idempotency-Key", key_header)
                .json(&json!({"timeout_minutes": 30}))
                .send()
                .await
                .unwrap();
            let status = r.status().as_u16();
            (status, r.json::<serde_json::Value>().await.unwrap())
        })
    };
    let before = time::OffsetDateTime::now_utc();
    let (st, made) = create("after-b-died");
    assert_eq!(st, 201, "{made}");
    let made = made["id"].as_str().unwrap().to_string();
    let (st, again) = create("after-b-died");
    assert!(st == 200 || st == 201, "{again}");
    assert_eq!(again["id"], made.as_str(), "{again}");
    assert_eq!(again["status"], "running", "{again}");
    rt().block_on(async {
        let store = Store::connect(&url).await.unwrap();
        assert_eq!(store.sandbox(&made).await.unwrap().unwrap().host, "c");
        // The try on b happened, and failed before it was handed out. (The
        // try on c made c's first template before its row: the two rows'
        // times differ by that.)
        let rows: Vec<(String, String, Option<String>, String)> = sqlx::query_as(
            "SELECT host, status, ready_at, created_at FROM sandboxes WHERE id <> $1",
        )
        .bind(&made)
        .fetch_all(store.pool())
        .await
        .unwrap();
        let rfc3339 = &time::format_description::well_known::Rfc3339;
        let tried: Vec<(String, String, Option<String>)> = rows
            .into_iter()
            .filter(|r| time::OffsetDateTime::parse(&r.3, rfc3339).unwrap() >= before)
            .map(|(host, status, ready_at, _)| (host, status, ready_at))
            .collect();
        assert_eq!(
            tried,
            [("b".to_string(), "failed".to_string(), None)],
            "the creates around the one on c"
        );
    });
    drop(a);
    drop(c);
}

fn node_args(ca: &str) -> [&str; 4] {
    ["--node-listen", "127.0.0.1:0", "--cluster-dir", ca]
}

#[test]
fn the_cli_makes_the_cluster_ca_and_issues_members_certificates() {
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca");
    let run = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_sandpit"))
            .args(args)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    let ca_dir = ca.to_str().unwrap();
    let (ok, err) = run(&["cluster", "init", ca_dir]);
    assert!(ok, "{err}");
    let (ok, err) = run(&["cluster", "init", ca_dir]);
    assert!(!ok && err.contains("already holds a cluster CA"), "{err}");
    let (ok, err) = run(&[
        "cluster",
        "issue",
        ca_dir,
        "node-a",
        "--host",
        "10.0.0.1",
        "--host",
        "node-a.internal",
    ]);
    assert!(ok, "{err}");
    use std::os::unix::fs::PermissionsExt;
    for (file, private) in [
        ("ca.pem", false),
        ("ca.key", true),
        ("node-a.pem", false),
        ("node-a.key", true),
    ] {
        let mode = std::fs::metadata(ca.join(file))
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        if private {
            assert_eq!(mode, 0o600, "{file}");
        }
    }
    // The certificate names the member and its addresses, signed by the CA:
    // it serves and is accepted (see crates/node/tests/link.rs for the
    // handshakes themselves).
    let pem = std::fs::read_to_string(ca.join("node-a.pem")).unwrap();
    assert!(pem.starts_with("-----BEGIN CERTIFICATE-----"), "{pem}");
    let id = sandpit_node::Identity::in_dir(&ca, "node-a");
    sandpit_node::server_config(&id).unwrap();
    sandpit_node::client_config(&id).unwrap();
    let (ok, err) = run(&[
        "cluster",
        "issue",
        dir.path().join("nowhere").to_str().unwrap(),
        "x",
    ]);
    assert!(!ok && err.contains("cluster init"), "{err}");
}

/// The processes of a PostgreSQL server: its postmaster and the backends
/// and helpers it forked.
fn server_processes(postmaster: u32) -> Vec<i32> {
    let mut pids = vec![postmaster as i32];
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse::<u32>().ok());
        if ppid == Some(postmaster) {
            pids.push(pid);
        }
    }
    pids
}

#[test]
fn a_database_outage_longer_than_the_leases_loses_no_node() {
    // A server of its own: this test freezes it.
    let pg = sandpit_pgtest::Postgres::start(&["127.0.0.1".parse().unwrap()]);
    let url = rt().block_on(pg.fresh_database());
    let (data_a, data_b) = (data_dir(), data_dir());
    let key = team_key(&data_a, &url);
    let a = Server::start_node(&data_a, &url, "a", NODE_CONFIG);
    let b = Server::start_node(&data_b, &url, "b", NODE_CONFIG);
    let on_a = create_on(&a, &key);
    let on_b = create_on(&b, &key);

    // The database stops answering for longer than a lease and the grace
    // (3 s + 2 s): every lease lapses. When it is back, the members renew
    // before anyone sweeps, and nothing is declared lost.
    let frozen = server_processes(pg.pid());
    for pid in &frozen {
        // SAFETY: signals to the test's own PostgreSQL.
        unsafe { libc::kill(*pid, libc::SIGSTOP) };
    }
    std::thread::sleep(Duration::from_secs(9));
    for pid in &frozen {
        unsafe { libc::kill(*pid, libc::SIGCONT) };
    }
    // Three leases' time for anything that would go wrong to do so.
    std::thread::sleep(Duration::from_secs(9));
    let via_a = Rest::new(&a, &key);
    for id in [&on_a, &on_b] {
        let (status, reason) = sandbox_status(&via_a, id);
        assert_eq!(status, "running", "{id}: {reason}");
    }
    rt().block_on(async {
        let store = Store::connect(&url).await.unwrap();
        let nodes = store.nodes().await.unwrap();
        let states: Vec<_> = nodes
            .iter()
            .map(|n| (n.name.as_str(), n.epoch, n.state.as_str(), n.is_live()))
            .collect();
        assert_eq!(
            states,
            [("a", 1, "up", true), ("b", 1, "up", true)],
            "{nodes:?}"
        );
    });
    assert!(vm_runs(&on_a) && vm_runs(&on_b));
    drop(a);
    drop(b);
}

#[test]
fn two_machines_given_one_name_do_not_take_it_from_each_other() {
    let pg = sandpit_pgtest::shared();
    let url = rt().block_on(pg.fresh_database());
    let (data_1, data_2) = (data_dir(), data_dir());
    let first = Server::start_node(&data_1, &url, "same", NODE_CONFIG);
    let key = first
        .admin_key
        .clone()
        .expect("a first start on an empty database");
    let second = Server::start_node(&data_2, &url, "same", NODE_CONFIG);
    first
        .wait_for_log(
            "another process registered as node same",
            Duration::from_secs(10),
        )
        .expect("the first one says it was displaced");
    // No tug of war: the name stays with the second.
    std::thread::sleep(Duration::from_secs(4));
    let node = rt().block_on(async {
        let store = Store::connect(&url).await.unwrap();
        store.node("same").await.unwrap().unwrap()
    });
    assert_eq!((node.epoch, node.state.as_str()), (2, "up"), "{node:?}");
    // The displaced one takes no sandbox; the holder of the name does.
    rt().block_on(async {
        let (st, e) = Rest::new(&first, &key)
            .post("/sandboxes", json!({"timeout_minutes": 5}))
            .await;
        assert_eq!(st, 503, "{e}");
        assert_eq!(e["error"]["type"], "service_unavailable", "{e}");
    });
    let id = create_on(&second, &key);
    assert_eq!(sandbox_status(&Rest::new(&second, &key), &id).0, "running");
}

/// Two sandboxes at most per node, so a test can fill one.
const TWO_PER_NODE: &str =
    "[cluster]\nlease_secs = 3\nlost_after_secs = 2\nmax_sandboxes = 2\n[pool]\nsizes = {}\n";

#[test]
fn a_template_built_on_one_node_starts_on_another_which_fetches_it_first() {
    let rt = rt();
    let pg = sandpit_pgtest::shared();
    let url = rt.block_on(pg.fresh_database());
    let (data_a, data_b, data_c) = (data_dir(), data_dir(), data_dir());
    let key = team_key(&data_a, &url);
    let certs = loopback_certs(&["a", "b", "c", "replica"]);
    let ca = certs.path();
    let ca_arg = ca.to_str().unwrap();
    // a serves the API and runs no VMs: every fetch is relayed by it, from
    // one node's API to the other's.
    let a = Server::start_node_with(
        &data_a,
        &url,
        "a",
        NODE_CONFIG,
        &["--no-vms", "--cluster-dir", ca_arg],
    );
    let b = Server::start_node_with(&data_b, &url, "b", TWO_PER_NODE, &node_args(ca_arg));
    let api = Rest::new(&a, &key);
    let db = rt.block_on(Store::connect(&url)).unwrap();
    let dockerfile = "FROM debian:bookworm\n\
                      RUN echo fetched > /etc/marker\n\
                      WORKDIR /srv\n\
                      RUN echo served > index.html\n\
                      CMD python3 -m http.server 8000\n\
                      HEALTHCHECK CMD python3 -c \"import urllib.request as u; u.urlopen('http://localhost:8000/')\"\n";
    // Built while b is the only node: on b.
    rt.block_on(async {
        let (st, t) = api
            .post(
                "/templates",
                json!({"name": "web", "dockerfile": dockerfile}),
            )
            .await;
        assert_eq!(st, 202, "{t}");
        let id = t["id"].as_str().unwrap().to_string();
        let deadline = Instant::now() + Duration::from_secs(600);
        loop {
            let (_, t) = api.get(&format!("/templates/{id}")).await;
            if t["status"] != "building" {
                assert_eq!(t["status"], "ready", "{t}");
                break;
            }
            assert!(Instant::now() < deadline, "the build never ended: {t}");
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    });
    let team = rt.block_on(db.account_by_name("team")).unwrap().unwrap();
    let template = rt
        .block_on(db.template_named(
            &team.id,
            "web",
            "latest",
            &[sandpit_store::TemplateStatus::Ready],
        ))
        .unwrap()
        .unwrap();
    assert_eq!(template.host.as_deref(), Some("b"));
    let save = template.snapshot_id.clone().unwrap();

    // c joins with snapshot templates of its own (a node of its own
    // machine), so b's save stands on a template c does not have.
    std::fs::create_dir_all(data_c.join("templates")).unwrap();
    let c = Server::start_node_with(&data_c, &url, "c", TWO_PER_NODE, &node_args(ca_arg));
    let from_web = || {
        rt.block_on(async {
            let (st, s) = api
                .post(
                    "/sandboxes",
                    json!({"template": "web", "timeout_minutes": 30}),
                )
                .await;
            (st, s)
        })
    };
    let host_of = |id: &str| rt.block_on(db.sandbox(id)).unwrap().unwrap().host;
    let sh = |id: &str, command: &str| -> String {
        rt.block_on(async {
            let (st, ex) = api
                .post(
                    &format!("/sandboxes/{id}/exec"),
                    json!({ "command": command }),
                )
                .await;
            assert_eq!(st, 200, "{ex}");
            assert_eq!(ex["exit_code"], 0, "{command}: {ex}");
            ex["stdout"].as_str().unwrap().trim().to_string()
        })
    };
    // The node that holds it is tried first: b, until it is full.
    let mut on_b = Vec::new();
    for _ in 0..2 {
        let (st, s) = from_web();
        assert_eq!(st, 201, "{s}");
        let id = s["id"].as_str().unwrap().to_string();
        assert_eq!(host_of(&id), "b");
        on_b.push(id);
    }
    // Then c, which fetches it first (through a), and starts the sandbox
    // with the server up, from b's save.
    let fetching = Instant::now();
    let (st, s) = from_web();
    eprintln!(
        "the create that fetched the template to c took {} ms",
        fetching.elapsed().as_millis()
    );
    assert_eq!(st, 201, "{s}");
    let first_on_c = s["id"].as_str().unwrap().to_string();
    assert_eq!(host_of(&first_on_c), "c");
    assert_eq!(
        sh(
            &first_on_c,
            "cat /etc/marker; pwd; python3 -c \"import urllib.request as u; print(u.urlopen('http://localhost:8000/index.html').read().decode())\""
        ),
        "fetched\n/srv\nserved"
    );
    let layer = rt.block_on(db.template_layer_of(&save)).unwrap().unwrap();
    let copies = rt
        .block_on(db.template_layer_copies(&team.id, &layer.layer_key))
        .unwrap();
    let on_c: Vec<_> = copies.iter().filter(|l| l.host == "c").collect();
    assert_eq!(on_c.len(), 1, "{copies:?}");
    assert!(on_c[0].bytes > 0, "{copies:?}");
    let copy = on_c[0].save_id.clone();
    // c keeps b's snapshot template beside its own, for that save.
    let received: Vec<String> = std::fs::read_dir(data_c.join("templates"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().to_string())
        .filter(|n| n.starts_with("small-") && n.len() == "small-".len() + 33)
        .collect();
    assert_eq!(received.len(), 1, "{received:?}");

    // The node API as a member calls it: what c holds now (b's template)
    // is left out of what b sends it.
    let replica = sandpit_node::NodeClient::new(
        sandpit_node::client_config(&sandpit_node::Identity::in_dir(ca, "replica")).unwrap(),
    );
    rt.block_on(async {
        use sandpit_host::machines::Machines;
        let b_row = db.node("b").await.unwrap().unwrap();
        let c_row = db.node("c").await.unwrap().unwrap();
        let b_vms = replica.node(&b_row.address, b_row.epoch);
        let c_vms = replica.node(&c_row.address, c_row.epoch);
        let held = c_vms.held_parts().await.unwrap();
        assert!(held.iter().any(|p| p.starts_with("template:")), "{held:?}");
        let whole = b_vms.send_snapshot(&save, Vec::new()).await.unwrap();
        let rest = b_vms.send_snapshot(&save, held).await.unwrap();
        eprintln!(
            "b's save for c: {} bytes, {} whole",
            rest.size(),
            whole.size()
        );
        assert!(
            rest.size() * 4 < whole.size(),
            "{} bytes sent to c, against {} whole",
            rest.size(),
            whole.size()
        );
        // An unknown snapshot is refused by name.
        let unknown = b_vms.send_snapshot("snap_nothing", Vec::new()).await;
        assert!(unknown.is_err());
    });

    // Its copy is used again, not fetched again.
    sh(&first_on_c, "true");
    let (st, _) = rt.block_on(api.call(
        reqwest::Method::DELETE,
        &format!("/sandboxes/{first_on_c}"),
        None,
    ));
    assert_eq!(st, 200);
    let (st, s) = from_web();
    assert_eq!(st, 201, "{s}");
    let second_on_c = s["id"].as_str().unwrap().to_string();
    assert_eq!(host_of(&second_on_c), "c");
    assert_eq!(
        rt.block_on(db.sandbox(&second_on_c))
            .unwrap()
            .unwrap()
            .snapshot_id
            .as_deref(),
        Some(copy.as_str())
    );

    // A volume lives on one node (made where a sandbox would go: c, as b
    // is full); a sandbox that mounts it is placed there, and refused,
    // naming that node, while it is full (as its last heartbeat said, or
    // as the create's own transaction finds it).
    // (A node's room is what it last published: retried while it says so.)
    let deadline = Instant::now() + Duration::from_secs(60);
    let (st, v) = loop {
        let (st, v) = rt.block_on(api.post("/volumes", json!({"name": "shared", "size_gb": 1})));
        if st != 503 || Instant::now() > deadline {
            break (st, v);
        }
        std::thread::sleep(Duration::from_secs(1));
    };
    assert_eq!(st, 201, "{v}");
    let volume = v["id"].as_str().unwrap().to_string();
    let kept_on = rt.block_on(db.volume_by_id(&volume)).unwrap().unwrap().host;
    assert_eq!(kept_on, "c");
    assert!(data_c
        .join("volumes")
        .join(format!("{volume}.img"))
        .is_file());
    let mounting = |read_only: bool| {
        rt.block_on(api.post(
            "/sandboxes",
            json!({"volumes": [{"volume": "shared", "path": "/data", "read_only": read_only}]}),
        ))
    };
    let (st, s) = loop {
        let (st, s) = mounting(false);
        if st != 503 || Instant::now() > deadline {
            break (st, s);
        }
        std::thread::sleep(Duration::from_secs(1));
    };
    assert_eq!(st, 201, "{s}");
    let writer = s["id"].as_str().unwrap().to_string();
    assert_eq!(host_of(&writer), "c");
    assert_eq!(
        sh(&writer, "echo on-c > /data/where && cat /data/where"),
        "on-c"
    );
    let (st, refused) = mounting(true);
    assert_eq!(st, 503, "{refused}");
    assert!(
        refused["error"]["message"]
            .as_str()
            .unwrap()
            .contains("node c"),
        "{refused}"
    );
    let (st, gone) = rt.block_on(api.call(
        reqwest::Method::DELETE,
        &format!("/sandboxes/{writer}"),
        None,
    ));
    assert_eq!(st, 200, "{gone}");
    // Its files without a sandbox: served by c, reached from a through
    // the node API.
    let read_where = || {
        rt.block_on(async {
            let resp = api
                .http
                .get(format!("{}/v1/volumes/shared/files", api.url))
                .query(&[("path", "/where")])
                .bearer_auth(&api.key)
                .send()
                .await
                .unwrap();
            (resp.status().as_u16(), resp.text().await.unwrap())
        })
    };
    assert_eq!(read_where(), (200, "on-c\n".to_string()));
    // Moved to b (`sandpit volume move`): streamed there and kept there,
    // gone from c, what it holds with it.
    let (st, moved) =
        rt.block_on(api.post(&format!("/volumes/{volume}/move"), json!({"node": "b"})));
    assert_eq!(st, 200, "{moved}");
    assert_eq!(
        rt.block_on(db.volume_by_id(&volume)).unwrap().unwrap().host,
        "b"
    );
    assert!(data_b
        .join("volumes")
        .join(format!("{volume}.img"))
        .is_file());
    assert!(!data_c
        .join("volumes")
        .join(format!("{volume}.img"))
        .exists());
    assert_eq!(read_where(), (200, "on-c\n".to_string()));
    let (st, refused) =
        rt.block_on(api.post(&format!("/volumes/{volume}/move"), json!({"node": "b"})));
    assert_eq!(st, 400, "{refused}");
    let (st, gone) =
        rt.block_on(api.call(reqwest::Method::DELETE, &format!("/volumes/{volume}"), None));
    assert_eq!(st, 200, "{gone}");
    assert!(!data_b
        .join("volumes")
        .join(format!("{volume}.img"))
        .exists());

    // b dies: its template's sandboxes still start, on c, from the copy.
    b.sigkill();
    let deadline = Instant::now() + Duration::from_secs(60);
    let after = loop {
        let (st, s) = from_web();
        if st == 201 {
            break s["id"].as_str().unwrap().to_string();
        }
        assert_eq!(st, 503, "{s}");
        assert!(Instant::now() < deadline, "no create after b died: {s}");
        std::thread::sleep(Duration::from_secs(1));
    };
    assert_eq!(host_of(&after), "c");
    assert_eq!(sh(&after, "cat /etc/marker"), "fetched");
    drop(c);
    drop(a);
    drop(on_b);
}
