//! Idle sandboxes sleep, through a real `sandpit serve` and real VMs: with
//! `idle_pause_seconds`, a sandbox nobody uses whose guest is idle is
//! paused by the server itself (no host process left), and the next call
//! resumes it as if nothing happened (its files and processes there); a
//! guest that computes, or a command still running, keeps its sandbox
//! awake however long nobody calls.

use crate::common::serve::{Rest, Server};
use crate::common::*;
use serde_json::json;
use std::time::{Duration, Instant};

/// Seconds of no use after which the server pauses a sandbox here.
const IDLE: u64 = 4;

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap()
}

async fn status(api: &Rest, id: &str) -> String {
    let (st, got) = api.get(&format!("/sandboxes/{id}")).await;
    assert_eq!(st, 200, "{got}");
    got["status"].as_str().unwrap().to_string()
}

/// Waits until sandbox `id` is paused; panics with `what` past 2 minutes.
async fn until_paused(api: &Rest, id: &str, what: &str) {
    let t = Instant::now();
    while status(api, id).await != "paused" {
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "{what} after {IDLE} s idle"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

async fn create(api: &Rest) -> String {
    let (st, sb) = api
        .post(
            "/sandboxes",
            json!({"size": "small", "timeout_minutes": 20}),
        )
        .await;
    assert_eq!(st, 201, "{sb}");
    sb["id"].as_str().unwrap().to_string()
}

#[test]
fn idle_sandboxes_are_paused_and_the_next_call_resumes_them() {
    let data = data_dir();
    let server = Server::start_with(&data, &format!("[limits]\nidle_pause_seconds = {IDLE}\n"));
    let key = server.admin_key.clone().unwrap();
    let api = Rest::new(&server, &key);
    let ids = rt().block_on(async {
        let (_, info) = api.get("/service").await;
        assert_eq!(info["limits"]["idle_pause_seconds"], IDLE, "{info}");
        api.template_ready().await;
        let (idle, computing, waiting) =
            (create(&api).await, create(&api).await, create(&api).await);
        // A file, and a process whose state is only in memory.
        api.sh(
            &idle,
            "echo kept > /workspace/file; (sleep 100000 & echo $! > /tmp/pid) >/dev/null 2>&1",
        )
        .await;
        api.sh(
            &computing,
            "nohup sh -c 'while :; do :; done' >/dev/null 2>&1 &",
        )
        .await;
        // A command that outlasts the idle time several times over, and
        // writes nothing meanwhile.
        let long = {
            let api = Rest::new(&server, &key);
            let waiting = waiting.clone();
            tokio::spawn(async move {
                let t = Instant::now();
                let out = api
                    .sh(&waiting, &format!("sleep {}; echo done", IDLE * 4))
                    .await;
                (out, t.elapsed())
            })
        };

        // The idle one sleeps, on its own: no host process of it is left.
        until_paused(&api, &idle, "an idle sandbox was not paused").await;
        let left: Vec<_> = host_processes(&data)
            .into_iter()
            .filter(|p| p.vm.as_deref() == Some(idle.as_str()))
            .collect();
        assert!(
            left.is_empty(),
            "a paused sandbox runs no host process: {left:?}"
        );

        // The command ran to its end, its sandbox never paused under it.
        let (out, took) = long.await.unwrap();
        assert_eq!(out, "done");
        assert!(took < Duration::from_secs(IDLE * 4 + 60), "{took:?}");
        // The computing guest was left running all along, with nobody
        // calling it for far longer than the idle time.
        assert_eq!(status(&api, &computing).await, "running");

        // The next call resumes the idle one: its file and process are there.
        assert_eq!(
            api.sh(
                &idle,
                "cat /workspace/file; kill -0 $(cat /tmp/pid) && echo alive"
            )
            .await,
            "kept\nalive"
        );
        assert_eq!(status(&api, &idle).await, "running");

        // Left alone again, it sleeps again; destroying a paused sandbox
        // leaves nothing behind.
        until_paused(&api, &idle, "not paused a second time").await;
        for id in [&idle, &computing, &waiting] {
            let (st, body) = api
                .call(reqwest::Method::DELETE, &format!("/sandboxes/{id}"), None)
                .await;
            assert!(st == 200 || st == 204, "{st} {body}");
        }
        [idle, computing, waiting]
    });
    wait_until(
        "the destroyed sandboxes' processes to end",
        Duration::from_secs(60),
        || {
            !host_processes(&data)
                .iter()
                .any(|p| p.vm.as_ref().is_some_and(|vm| ids.contains(vm)))
        },
    );
}
