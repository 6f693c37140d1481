//! A cluster as an operator runs it: three `sandpit node` processes, each
//! in a network namespace of its own with its own address, running real
//! VMs; two `sandpit serve --no-vms` replicas on the host; one real
//! PostgreSQL (Debian's, started by the test) that every member reaches
//! over the network; the cluster's certificates from its own CA. Then the
//! failures it must survive: a node killed, frozen, and cut from the
//! database by nftables in its namespace; a replica killed mid-create and
//! mid-command. The ledger sums to the balance after all of it.

use crate::common::netns::TestHost;
use crate::common::serve::*;
use crate::common::*;
use sandpit_store::Store;
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr};
use std::process::Command;
use std::time::{Duration, Instant};

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// A short lease and grace (loss is settled within seconds), no warm pool
/// (three nodes and their VMs share the test machine's cores).
const NODE_CONFIG: &str = "[cluster]\nlease_secs = 3\nlost_after_secs = 2\n[pool]\nsizes = {}\n";

fn vm_runs(id: &str) -> bool {
    !pids_mentioning(&format!("sandpit-vm-{id}")).is_empty()
}

/// The sandbox's row, as the database has it.
fn row(url: &str, id: &str) -> sandpit_store::SandboxRow {
    rt().block_on(async {
        let store = Store::connect(url).await.unwrap();
        store.sandbox(id).await.unwrap().unwrap()
    })
}

fn create(api: &Rest, key: Option<&str>) -> reqwest::Result<(u16, Value)> {
    rt().block_on(async {
        let mut r = api
            .http
            .post(format!("{}/v1/sandboxes", api.url))
            .bearer_auth(&api.key)
            .json(&json!({"timeout_minutes": 30}));
        if let Some(k) = key {
            r = r.header("Idempotency-Key", k);
        }
        let resp = r.send().await?;
        let status = resp.status().as_u16();
        let body = resp.json::<Value>().await.unwrap_or(Value::Null);
        Ok((status, body))
    })
}

fn exec(api: &Rest, id: &str, command: &str) -> Value {
    rt().block_on(async {
        let (st, ex) = api
            .post(
                &format!("/sandboxes/{id}/exec"),
                json!({"command": command}),
            )
            .await;
        assert_eq!(st, 200, "{ex}");
        ex
    })
}

fn status_of(api: &Rest, id: &str) -> (String, String) {
    rt().block_on(async {
        let (st, s) = api.get(&format!("/sandboxes/{id}")).await;
        assert_eq!(st, 200, "{s}");
        (
            s["status"].as_str().unwrap().to_string(),
            s["deleted_reason"].as_str().unwrap_or("").to_string(),
        )
    })
}

/// Runs `nft` in `ns` (nftables, installed by the set-up).
fn nft(ns: &str, rules: &str) {
    let st = Command::new("ip")
        .args(["netns", "exec", ns, "nft", rules])
        .status()
        .expect("nft (install nftables)");
    assert!(st.success(), "nft {rules}");
}

#[test]
fn three_nodes_and_two_replicas_survive_losing_any_of_them() {
    // Three machines, each its own namespace, address and data directory.
    let hosts: Vec<TestHost> = [
        ("n1", "10.77.1.1", "10.77.1.2"),
        ("n2", "10.77.2.1", "10.77.2.2"),
        ("n3", "10.77.3.1", "10.77.3.2"),
    ]
    .into_iter()
    .map(|(name, host_side, address)| TestHost::start(name, host_side, address))
    .collect();
    let host_sides: Vec<Ipv4Addr> = ["10.77.1.1", "10.77.2.1", "10.77.3.1"]
        .iter()
        .map(|a| a.parse().unwrap())
        .collect();
    // PostgreSQL on the loopback (the replicas) and on the host's end of
    // each namespace's link (the nodes).
    let mut listen = vec![IpAddr::V4(Ipv4Addr::LOCALHOST)];
    listen.extend(host_sides.iter().map(|a| IpAddr::V4(*a)));
    let pg = sandpit_pgtest::Postgres::start(&listen);
    let url = rt().block_on(pg.fresh_database());
    let database = url.rsplit('/').next().unwrap().to_string();

    let certs = tempfile::tempdir().unwrap();
    let ca = certs.path();
    sandpit_node::init_ca(ca).unwrap();
    for (i, h) in hosts.iter().enumerate() {
        sandpit_node::issue(ca, &format!("n{}", i + 1), &[h.address.to_string()]).unwrap();
    }
    for replica in ["a", "b"] {
        sandpit_node::issue(ca, replica, &["127.0.0.1".into()]).unwrap();
    }
    let ca_arg = ca.to_str().unwrap();

    let (data_a, data_b) = (data_dir(), data_dir());
    let team = rt().block_on(async {
        let store = Store::connect(&url).await.unwrap();
        let acct = store.create_account("team", 100).await.unwrap();
        store.add_credit(&acct.id, 5_000_000, None).await.unwrap();
        acct
    });
    let start_node = |i: usize| {
        let data = data_dir();
        let node_url = pg.url(IpAddr::V4(host_sides[i]), &database);
        Node::start(
            Some(&hosts[i].ns),
            &data,
            &node_url,
            &format!("n{}", i + 1),
            &format!("{}:7443", hosts[i].address),
            ca,
            NODE_CONFIG,
        )
    };
    let restart_node = |i: usize, data: &std::path::Path| {
        let node_url = pg.url(IpAddr::V4(host_sides[i]), &database);
        Node::start(
            Some(&hosts[i].ns),
            data,
            &node_url,
            &format!("n{}", i + 1),
            &format!("{}:7443", hosts[i].address),
            ca,
            NODE_CONFIG,
        )
    };
    let mut nodes: Vec<Option<Node>> = (0..3).map(|i| Some(start_node(i))).collect();
    let replica = |data: &std::path::Path, name: &str| {
        Server::start_node_with(
            data,
            &url,
            name,
            NODE_CONFIG,
            &["--no-vms", "--cluster-dir", ca_arg],
        )
    };
    let a = replica(&data_a, "a");
    let b = replica(&data_b, "b");
    let key = a.admin(&["key", "create", "--account", "team"]);
    let (via_a, via_b) = (Rest::new(&a, &key), Rest::new(&b, &key));

    // The replicas list the nodes as where sandboxes go.
    rt().block_on(async {
        let (st, info) = via_a.get("/service").await;
        assert_eq!(st, 200, "{info}");
        assert_eq!(info["hosts"], json!(["n1", "n2", "n3"]), "{info}");
    });

    // Creates through a spread over the three nodes.
    let mut ids = Vec::new();
    for _ in 0..3 {
        let (st, s) = create(&via_a, None).unwrap();
        assert_eq!(st, 201, "{s}");
        assert_eq!(s["status"], "running", "{s}");
        ids.push(s["id"].as_str().unwrap().to_string());
    }
    let on: BTreeMap<String, String> = ids
        .iter()
        .map(|id| (row(&url, id).host, id.clone()))
        .collect();
    assert_eq!(
        on.keys().cloned().collect::<BTreeSet<_>>(),
        BTreeSet::from(["n1".to_string(), "n2".into(), "n3".into()]),
        "one sandbox per node: {on:?}"
    );

    // Through b: a command, a binary file both ways, and a preview reach
    // each node's VM.
    for (node, id) in &on {
        let ex = exec(&via_b, id, "hostname; echo err >&2; exit 3");
        assert_eq!(
            ex["stdout"],
            format!("{}\n", id.replace('_', "-")),
            "{node}"
        );
        assert_eq!(
            (ex["stderr"].as_str(), ex["exit_code"].as_i64()),
            (Some("err\n"), Some(3))
        );
        let bytes: Vec<u8> = (0..=255u8).cycle().take(300_000).collect();
        rt().block_on(async {
            use base64::Engine;
            let b64 = base64::engine::general_purpose::STANDARD;
            let (st, w) = via_b
                .call(
                    reqwest::Method::PUT,
                    &format!("/sandboxes/{id}/files"),
                    Some(json!({"path": "blob.bin", "content": b64.encode(&bytes), "encoding": "base64"})),
                )
                .await;
            assert_eq!(st, 200, "{w}");
            let (st, r) = via_b
                .get(&format!("/sandboxes/{id}/files?path=blob.bin&encoding=base64"))
                .await;
            assert_eq!(st, 200, "{node}");
            assert_eq!(b64.decode(r["content"].as_str().unwrap()).unwrap(), bytes);
        });
    }
    let (node2, web) = on.iter().nth(1).unwrap();
    rt().block_on(async {
        let ex = via_b
            .post(
                &format!("/sandboxes/{web}/exec"),
                json!({"command": "mkdir -p /workspace/www && echo hello from a node > /workspace/www/index.html && cd /workspace/www && (nohup python3 -m http.server 8000 > /tmp/web.log 2>&1 &)"}),
            )
            .await;
        assert_eq!(ex.0, 200, "{}", ex.1);
        let (st, p) = via_b
            .post(&format!("/sandboxes/{web}/ports"), json!({"port": 8000}))
            .await;
        assert_eq!(st, 200, "{p}");
        // b's preview URL, found by the system resolver.
        let preview = p["url"].as_str().unwrap().to_string();
        assert!(preview.starts_with(&format!("http://8000-{web}.localhost:")), "{preview}");
        let client = reqwest::Client::new();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let r = client.get(&preview).send().await.unwrap();
            if r.status() == 200 {
                assert_eq!(r.text().await.unwrap(), "hello from a node\n", "{node2}");
                break;
            }
            assert!(Instant::now() < deadline, "the preview on {node2}: {}", r.status());
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    });

    // A replica killed mid-create: the retry with the same key on the
    // other replica gets the same sandbox, running, reserved once.
    let (tx, rx) = std::sync::mpsc::channel();
    let pending = {
        let via_a = Rest::new(&a, &key);
        std::thread::spawn(move || {
            tx.send(()).unwrap();
            create(&via_a, Some("retry-me"))
        })
    };
    rx.recv().unwrap();
    let placed = wait_until("the create's row", Duration::from_secs(30), || {
        rt().block_on(async {
            let store = Store::connect(&url).await.unwrap();
            store
                .list_sandboxes(&team.id, 100, None, true)
                .await
                .unwrap()
                .data
                .len()
                == 4
        })
    });
    eprintln!("the row was there {placed:?} after the create began");
    a.sigkill();
    assert!(
        pending.join().unwrap().is_err(),
        "the killed replica answered"
    );
    let (st, again) = create(&via_b, Some("retry-me")).unwrap();
    assert!(st == 200 || st == 201, "{st} {again}");
    assert_eq!(again["status"], "running", "{again}");
    let retried = again["id"].as_str().unwrap().to_string();
    assert!(!ids.contains(&retried));
    assert!(vm_runs(&retried));
    let (st, same) = create(&via_b, Some("retry-me")).unwrap();
    assert_eq!((st, &same["id"]), (200, &again["id"]), "{same}");
    // Destroyed through b: its node removes the VM now, not at a heartbeat.
    rt().block_on(async {
        let (st, d) = via_b
            .call(
                reqwest::Method::DELETE,
                &format!("/sandboxes/{retried}"),
                None,
            )
            .await;
        assert_eq!(st, 200, "{d}");
    });
    assert!(!vm_runs(&retried), "the destroyed sandbox's VM still runs");

    // A replica killed mid-command: the node stops the command, the record
    // fails once the replica is declared lost, and a retry on the other
    // replica runs.
    let a = replica(&data_a, "a");
    let via_a = Rest::new(&a, &key);
    let target = on["n1"].clone();
    let sleeper = {
        let via_a = Rest::new(&a, &key);
        let target = target.clone();
        std::thread::spawn(move || {
            rt().block_on(async {
                via_a
                    .try_call(
                        reqwest::Method::POST,
                        &format!("/sandboxes/{target}/exec"),
                        Some(json!({"command": "sleep 301"})),
                    )
                    .await
            })
        })
    };
    wait_until("the command runs", Duration::from_secs(30), || {
        exec(
            &via_b,
            &target,
            "pgrep -x sleep >/dev/null && echo yes || echo no",
        )["stdout"]
            == "yes\n"
    });
    a.sigkill();
    assert!(
        sleeper.join().unwrap().is_err(),
        "the killed replica answered"
    );
    wait_until(
        "the cut command gone from the VM",
        Duration::from_secs(20),
        || {
            exec(
                &via_b,
                &target,
                "pgrep -x sleep >/dev/null && echo yes || echo no",
            )["stdout"]
                == "no\n"
        },
    );
    wait_until(
        "the cut command's record failed",
        Duration::from_secs(30),
        || {
            rt().block_on(async {
                let store = Store::connect(&url).await.unwrap();
                let execs = store.sandbox_executions(&target, 100).await.unwrap();
                let cut: Vec<_> = execs.iter().filter(|e| e.command == "sleep 301").collect();
                cut.len() == 1 && cut[0].status.as_str() == "failed"
            })
        },
    );
    assert_eq!(exec(&via_b, &target, "echo again")["stdout"], "again\n");
    drop(via_a);

    // SIGKILL n3: its sandbox fails and is refunded for the time after the
    // loss, once; new creates go to the other nodes.
    let n3 = nodes[2].take().unwrap();
    let n3_data = n3.data.clone();
    n3.sigkill();
    let lost = on["n3"].clone();
    let settled = wait_until("n3's sandbox failed", Duration::from_secs(40), || {
        status_of(&via_b, &lost).0 == "failed"
    });
    eprintln!("node loss settled {settled:?} after the SIGKILL (lease 3 s, grace 2 s)");
    assert!(status_of(&via_b, &lost).1.contains("its node n3 was lost"));
    let (st, s) = create(&via_b, None).unwrap();
    assert_eq!(st, 201, "{s}");
    let placed_on = row(&url, s["id"].as_str().unwrap()).host;
    assert!(placed_on == "n1" || placed_on == "n2", "{placed_on}");
    // n3 back: the VM of its lost sandbox goes.
    nodes[2] = Some(restart_node(2, &n3_data));
    wait_until(
        "the lost sandbox's VM removed",
        Duration::from_secs(30),
        || !vm_runs(&lost),
    );

    // SIGSTOP n2 past its lease and the grace, then SIGCONT: fenced, its
    // VM goes, and it joins again under a new epoch.
    let frozen = on["n2"].clone();
    let n2 = nodes[1].as_ref().unwrap();
    n2.signal(libc::SIGSTOP);
    wait_until(
        "the frozen node's sandbox failed",
        Duration::from_secs(40),
        || status_of(&via_b, &frozen).0 == "failed",
    );
    n2.signal(libc::SIGCONT);
    n2.wait_for_log("lost its lease", Duration::from_secs(20))
        .expect("n2 tells that it was fenced");
    wait_until(
        "the fenced node's VM removed",
        Duration::from_secs(30),
        || !vm_runs(&frozen),
    );

    // n1 cut from the database (its namespace drops what goes to
    // PostgreSQL): the same, and no second settlement when it returns.
    let cut = on["n1"].clone();
    nft(
        &hosts[0].ns,
        &format!(
            "add table inet sandpit_test_cut; \
             add chain inet sandpit_test_cut out {{ type filter hook output priority 0; }}; \
             add rule inet sandpit_test_cut out tcp dport {} drop",
            pg.port()
        ),
    );
    wait_until(
        "the cut node's sandbox failed",
        Duration::from_secs(40),
        || status_of(&via_b, &cut).0 == "failed",
    );
    nft(&hosts[0].ns, "delete table inet sandpit_test_cut");
    nodes[0]
        .as_ref()
        .unwrap()
        .wait_for_log("lost its lease", Duration::from_secs(60))
        .expect("n1 tells that it was fenced");
    wait_until("the cut node's VM removed", Duration::from_secs(30), || {
        !vm_runs(&cut)
    });

    // Every node is up again and takes sandboxes; the ledger holds.
    wait_until("three live nodes", Duration::from_secs(30), || {
        rt().block_on(async {
            let store = Store::connect(&url).await.unwrap();
            store.placement_candidates().await.unwrap().len() == 3
        })
    });
    let (st, s) = create(&via_b, None).unwrap();
    assert_eq!(st, 201, "{s}");
    rt().block_on(async {
        let store = Store::connect(&url).await.unwrap();
        let ledger = store.ledger(&team.id).await.unwrap();
        for id in [&lost, &frozen, &cut] {
            let kinds: Vec<&str> = ledger
                .iter()
                .filter(|l| l.sandbox_id.as_deref() == Some(id.as_str()))
                .map(|l| l.kind.as_str())
                .collect();
            assert_eq!(kinds, ["reserve", "release", "charge"], "{id}");
        }
        let kinds: Vec<&str> = ledger
            .iter()
            .filter(|l| l.sandbox_id.as_deref() == Some(retried.as_str()))
            .map(|l| l.kind.as_str())
            .collect();
        assert_eq!(
            kinds,
            ["reserve", "release", "charge"],
            "the retried create"
        );
        let sum: i64 = ledger.iter().map(|l| l.amount_micros).sum();
        assert_eq!(sum, store.balance(&team.id).await.unwrap());
        assert!(sum > 0);
    });
    drop(b);
    drop(nodes);
    drop(hosts);
}
