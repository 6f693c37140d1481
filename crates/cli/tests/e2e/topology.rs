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

    // n2 drained: its sandbox moves to another node with its memory (a
    // counter running on from where it was, its token the same), its file,
    // its web server behind the same preview URL and its id; a command
    // sent during the move waits for it and runs; n2 takes no new sandbox.
    let web = web.clone();
    let (token, before) = {
        exec(
            &via_b,
            &web,
            "cat > /tmp/counter.py <<'EOF'\nimport os, time\ntoken = os.urandom(8).hex()\nn = 0\nwhile True:\n    n += 1\n    with open('/tmp/count.tmp', 'w') as f:\n        f.write(f'{token} {n}')\n    os.replace('/tmp/count.tmp', '/tmp/count')\n    time.sleep(0.1)\nEOF\n(nohup python3 /tmp/counter.py >/dev/null 2>&1 &)",
        );
        wait_until("the counter counts", Duration::from_secs(30), || {
            exec(&via_b, &web, "cat /tmp/count 2>/dev/null || true")["stdout"]
                .as_str()
                .is_some_and(|c| {
                    c.split(' ')
                        .nth(1)
                        .is_some_and(|n| n.parse::<u64>().unwrap_or(0) > 5)
                })
        });
        let count = exec(&via_b, &web, "cat /tmp/count")["stdout"]
            .as_str()
            .unwrap()
            .to_string();
        let (token, n) = count.split_once(' ').unwrap();
        (token.to_string(), n.parse::<u64>().unwrap())
    };
    let drained = a.admin(&["node", "drain", "n2", "--no-wait"]);
    assert!(drained.contains("node n2 is draining"), "{drained}");
    wait_until("n2's sandbox being moved", Duration::from_secs(30), || {
        row(&url, &web).moving_to.is_some()
    });
    let during = exec(&via_b, &web, "cat /tmp/count");
    let during = during["stdout"].as_str().unwrap();
    assert!(during.starts_with(&format!("{token} ")), "{during}");
    let moved_to = row(&url, &web).host;
    assert_ne!(moved_to, "n2", "the command ran before the move");
    let done = a.admin(&["node", "drain", "n2"]);
    assert!(done.contains("node n2 is drained"), "{done}");
    let after = exec(&via_b, &web, "sleep 1; cat /tmp/count")["stdout"]
        .as_str()
        .unwrap()
        .to_string();
    let (same_token, n) = after.split_once(' ').unwrap();
    assert_eq!(same_token, token, "the counter started again: {after}");
    assert!(n.parse::<u64>().unwrap() > before, "{after} after {before}");
    rt().block_on(async {
        use base64::Engine;
        let b64 = base64::engine::general_purpose::STANDARD;
        let bytes: Vec<u8> = (0..=255u8).cycle().take(300_000).collect();
        let (st, r) = via_b
            .get(&format!(
                "/sandboxes/{web}/files?path=blob.bin&encoding=base64"
            ))
            .await;
        assert_eq!(st, 200, "{r}");
        assert_eq!(b64.decode(r["content"].as_str().unwrap()).unwrap(), bytes);
    });
    // Its VM on n2 went before the one on the other node started.
    assert_eq!(
        pids_mentioning(&format!("sandpit-vm-{web}")).len(),
        1,
        "one VM of it"
    );
    rt().block_on(async {
        let (st, s) = via_a.get(&format!("/sandboxes/{web}")).await;
        assert_eq!(
            (st, s["id"].as_str(), s["status"].as_str()),
            (200, Some(web.as_str()), Some("running")),
            "{s}"
        );
        let (st, events) = via_a.get(&format!("/sandboxes/{web}/events")).await;
        assert_eq!(st, 200, "{events}");
        let moved: Vec<&Value> = events["data"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["type"] == "sandbox.moved")
            .collect();
        assert_eq!(moved.len(), 1, "{events}");
        assert_eq!(moved[0]["detail"]["from"], "n2", "{events}");
        assert_eq!(moved[0]["detail"]["to"], moved_to.as_str(), "{events}");
        assert_eq!(moved[0]["actor"], "drain of node n2", "{events}");
        assert!(moved[0]["detail"]["cut"]
            .as_str()
            .unwrap()
            .contains("reconnect"));
        // The preview URL answers from the moved VM's web server.
        let (st, p) = via_b
            .post(&format!("/sandboxes/{web}/ports"), json!({"port": 8000}))
            .await;
        assert_eq!(st, 200, "{p}");
        let client = reqwest::Client::new();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(r) = client.get(p["url"].as_str().unwrap()).send().await {
                if r.status() == 200 {
                    assert_eq!(r.text().await.unwrap(), "hello from a node\n");
                    break;
                }
            }
            assert!(Instant::now() < deadline, "the preview after the move");
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    });
    // A drained node takes nothing new; back in service, it does.
    let listed = a.admin(&["node", "list"]);
    assert!(
        listed.contains("n2\tup, draining\t0 sandbox(es)"),
        "{listed}"
    );
    let (st, s) = create(&via_a, None).unwrap();
    assert_eq!(st, 201, "{s}");
    assert_ne!(row(&url, s["id"].as_str().unwrap()).host, "n2");
    rt().block_on(async {
        let id = s["id"].as_str().unwrap();
        let (st, d) = via_a
            .call(reqwest::Method::DELETE, &format!("/sandboxes/{id}"), None)
            .await;
        assert_eq!(st, 200, "{d}");
    });
    a.admin(&["node", "undrain", "n2"]);
    let mut on = on;
    let fresh = wait_until(
        "a create placed on n2 again",
        Duration::from_secs(30),
        || {
            let (st, s) = create(&via_a, None).unwrap();
            assert_eq!(st, 201, "{s}");
            let id = s["id"].as_str().unwrap().to_string();
            if row(&url, &id).host == "n2" {
                on.insert("n2".into(), id);
                return true;
            }
            false
        },
    );
    eprintln!("n2 took a sandbox {fresh:?} after its undrain");

    // A replica killed mid-create: the retry with the same key on the
    // other replica gets the same sandbox, running, reserved once.
    let rows = || {
        rt().block_on(async {
            let store = Store::connect(&url).await.unwrap();
            store
                .list_sandboxes(&team.id, 100, None, true)
                .await
                .unwrap()
                .data
                .len()
        })
    };
    let rows_before = rows();
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
        rows() == rows_before + 1
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

    // n3 SIGKILLed in the middle of its drain: each of its sandboxes is
    // either moved (running on another node, one VM of it) or failed with
    // the node and refunded for the time after the loss, once; never both.
    // New creates go to the other nodes.
    // Two sandboxes on n3 (placement fills the least full node; those
    // placed elsewhere go at once).
    let live_on_n3 = || {
        rt().block_on(async {
            let store = Store::connect(&url).await.unwrap();
            store.live_sandboxes("n3").await.unwrap().len()
        })
    };
    for _ in 0..4 {
        if live_on_n3() >= 2 {
            break;
        }
        let (st, s) = create(&via_b, None).unwrap();
        assert_eq!(st, 201, "{s}");
        let id = s["id"].as_str().unwrap();
        if row(&url, id).host != "n3" {
            rt().block_on(async {
                let (st, d) = via_b
                    .call(reqwest::Method::DELETE, &format!("/sandboxes/{id}"), None)
                    .await;
                assert_eq!(st, 200, "{d}");
            });
        }
    }
    let on_n3: Vec<String> = rt().block_on(async {
        let store = Store::connect(&url).await.unwrap();
        store
            .live_sandboxes("n3")
            .await
            .unwrap()
            .into_iter()
            .map(|r| r.id)
            .collect()
    });
    assert!(on_n3.contains(&on["n3"]), "{on_n3:?}");
    assert_eq!(on_n3.len(), 2, "{on_n3:?}");
    // Killed once the first has moved and the second's move has begun.
    b.admin(&["node", "drain", "n3", "--no-wait"]);
    wait_until(
        "n3's second sandbox being moved",
        Duration::from_secs(90),
        || {
            let (first, second) = (row(&url, &on_n3[0]), row(&url, &on_n3[1]));
            first.host != "n3" && first.moving_to.is_none() && second.moving_to.is_some()
        },
    );
    let n3 = nodes[2].take().unwrap();
    let n3_data = n3.data.clone();
    n3.sigkill();
    let settled = wait_until(
        "n3's sandboxes moved or failed",
        Duration::from_secs(60),
        || {
            on_n3.iter().all(|id| {
                let r = row(&url, id);
                r.status == sandpit_store::SandboxStatus::Failed
                    || (r.host != "n3" && r.moving_to.is_none() && r.is_live())
            })
        },
    );
    eprintln!("n3's drain and loss settled {settled:?} after the SIGKILL (lease 3 s, grace 2 s)");
    let mut failed_with_n3 = Vec::new();
    for id in &on_n3 {
        let (status, reason) = status_of(&via_b, id);
        let r = row(&url, id);
        if status == "failed" {
            assert!(reason.contains("its node n3 was lost"), "{id}: {reason}");
            assert_eq!(r.host, "n3", "{id} failed with n3 but was moved");
            failed_with_n3.push(id.clone());
        } else {
            assert_eq!(status, "running", "{id}");
            assert_ne!(r.host, "n3");
            assert_eq!(exec(&via_b, id, "echo here")["stdout"], "here\n");
        }
    }
    eprintln!(
        "of n3's {} sandboxes, {} failed with it and the others moved",
        on_n3.len(),
        failed_with_n3.len()
    );
    assert!(!failed_with_n3.contains(&on_n3[0]), "the first had moved");
    let (st, s) = create(&via_b, None).unwrap();
    assert_eq!(st, 201, "{s}");
    let placed_on = row(&url, s["id"].as_str().unwrap()).host;
    assert!(placed_on == "n1" || placed_on == "n2", "{placed_on}");
    // n3 back, still draining until told: the VMs of its lost sandboxes
    // go; a moved one runs once, on its new node.
    nodes[2] = Some(restart_node(2, &n3_data));
    wait_until(
        "the lost sandboxes' VMs removed",
        Duration::from_secs(30),
        || failed_with_n3.iter().all(|id| !vm_runs(id)),
    );
    for id in on_n3.iter().filter(|id| !failed_with_n3.contains(id)) {
        assert_eq!(
            pids_mentioning(&format!("sandpit-vm-{id}")).len(),
            1,
            "{id}"
        );
    }
    assert!(b.admin(&["node", "list"]).contains("n3\tup, draining"));
    b.admin(&["node", "undrain", "n3"]);

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
        for id in failed_with_n3.iter().chain([&frozen, &cut]) {
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
