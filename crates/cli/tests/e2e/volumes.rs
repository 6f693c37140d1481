//! Volumes through a real `sandpit serve` and real VMs, as a client meets
//! them over REST: 200 MB written by the guest's user and never synced
//! survive its sandbox's destroy, byte for byte; a write the file API
//! answered survives its QEMU SIGKILLed, and the server SIGKILLed; one
//! sandbox holds a volume read-write, others read-only (a guest root that
//! remounts it writes only its own overlay: `crates/runtime/tests/vms`);
//! another account sees nothing; the quota refuses;
//! a snapshot holds no volume (a fork gets it read-only as it is now, a
//! restore keeps it as it is now); a pause keeps it mounted.

use crate::common::serve::{Rest, Server};
use crate::common::*;
use serde_json::{json, Value};
use std::path::Path;
use std::time::{Duration, Instant};

/// The config of the server here: two volumes per account at most.
const CONFIG: &str = "[volumes]\nmax_per_account = 2\n";

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn id_of(v: &Value) -> String {
    v["id"].as_str().unwrap().to_string()
}

/// A sandbox mounting `mounts` (`[(volume, path, read_only)]`), created.
async fn sandbox_with(api: &Rest, mounts: &[(&str, &str, bool)]) -> String {
    let (st, made) = create_with(api, mounts).await;
    assert_eq!(st, 201, "{made}");
    id_of(&made)
}

async fn create_with(api: &Rest, mounts: &[(&str, &str, bool)]) -> (u16, Value) {
    let volumes: Vec<Value> = mounts
        .iter()
        .map(|(volume, path, read_only)| {
            json!({"volume": volume, "path": path, "read_only": read_only})
        })
        .collect();
    api.post("/sandboxes", json!({ "volumes": volumes })).await
}

/// Runs `command` in sandbox `id` (up to 5 minutes); its exit code and
/// output (stdout then stderr).
async fn run(api: &Rest, id: &str, command: &str) -> (i64, String) {
    let (st, ex) = api
        .post(
            &format!("/sandboxes/{id}/exec"),
            json!({"command": command, "timeout_ms": 300_000}),
        )
        .await;
    assert_eq!(st, 200, "{command}: {ex}");
    let out = format!(
        "{}{}",
        ex["stdout"].as_str().unwrap_or_default(),
        ex["stderr"].as_str().unwrap_or_default()
    );
    (
        ex["exit_code"].as_i64().unwrap_or(-1),
        out.trim().to_string(),
    )
}

async fn sh(api: &Rest, id: &str, command: &str) -> String {
    let (code, out) = run(api, id, command).await;
    assert_eq!(code, 0, "{command}: {out}");
    out
}

async fn destroy(api: &Rest, id: &str) {
    let (st, gone) = api
        .call(reqwest::Method::DELETE, &format!("/sandboxes/{id}"), None)
        .await;
    assert_eq!(st, 200, "{gone}");
}

/// Writes `text` to `path` in sandbox `id` through the file API.
async fn put(api: &Rest, id: &str, path: &str, text: &str) {
    let (st, w) = api
        .call(
            reqwest::Method::PUT,
            &format!("/sandboxes/{id}/files"),
            Some(json!({"path": path, "content": text, "encoding": "utf8"})),
        )
        .await;
    assert_eq!(st, 200, "{w}");
}

/// The pid of sandbox `id`'s QEMU, from its VM's record.
fn qemu_pid(data: &Path, id: &str) -> i32 {
    let record: Value =
        serde_json::from_slice(&std::fs::read(data.join("vms").join(id).join("vm.json")).unwrap())
            .unwrap();
    record["qemu_pid"].as_i64().unwrap() as i32
}

/// Waits (up to a minute) until sandbox `id`'s status is `status`.
async fn wait_status(api: &Rest, id: &str, status: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (_, now) = api.get(&format!("/sandboxes/{id}")).await;
        if now["status"] == status {
            return now;
        }
        assert!(
            Instant::now() < deadline,
            "{id} never became {status}: {now}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[test]
fn a_volume_keeps_what_sandboxes_wrote_through_destroys_and_kills() {
    let data = data_dir();
    let server = Server::start_with(&data, CONFIG);
    let key = server.admin_key.clone().unwrap();
    let other_key = server.new_account("other", 10.0);
    let api = Rest::new(&server, &key);
    let other = Rest::new(&server, &other_key);
    let runtime = rt();
    let (volume, sum) = runtime.block_on(async {
        api.template_ready().await;
        let (st, made) = api
            .post("/volumes", json!({"name": "work", "size_gb": 1}))
            .await;
        assert_eq!(st, 201, "{made}");
        let volume = id_of(&made);

        // 200 MB written by the guest's user, never synced, then the
        // sandbox destroyed.
        let a = sandbox_with(&api, &[("work", "/data", false)]).await;
        let (_, held) = api.get(&format!("/volumes/{volume}")).await;
        assert_eq!(held["mounted_by"][0]["sandbox_id"], a.as_str(), "{held}");
        assert_eq!(
            sh(
                &api,
                &a,
                "stat -c %U /data; findmnt -no FSTYPE,OPTIONS /data | tr -s ' '"
            )
            .await,
            "user\next4 rw,nosuid,nodev,relatime"
        );
        let sum = sh(
            &api,
            &a,
            "head -c 200M /dev/urandom > /data/blob && sha256sum < /data/blob | cut -d' ' -f1",
        )
        .await;
        destroy(&api, &a).await;

        // Every byte is there in the next sandbox that mounts it.
        let b = sandbox_with(&api, &[("work", "/data", false)]).await;
        assert_eq!(
            sh(
                &api,
                &b,
                "stat -c %s /data/blob; sha256sum < /data/blob | cut -d' ' -f1"
            )
            .await,
            format!("209715200\n{sum}")
        );
        // One sandbox at a time holds it read-write.
        let (st, refused) = create_with(&api, &[("work", "/data", false)]).await;
        assert_eq!(st, 409, "{refused}");
        assert!(
            refused["error"]["message"].as_str().unwrap().contains(&b),
            "{refused}"
        );
        // Read-only, another sees it, and cannot change it even as root.
        let r = sandbox_with(&api, &[(&volume, "/ro", true)]).await;
        assert_eq!(
            sh(&api, &r, "sha256sum < /ro/blob | cut -d' ' -f1").await,
            sum
        );
        let (code, said) = run(&api, &r, "touch /ro/x").await;
        assert_ne!(code, 0);
        assert!(said.contains("Read-only file system"), "{said}");
        destroy(&api, &r).await;

        // Another account: no such volume.
        let (st, _) = other.get(&format!("/volumes/{volume}")).await;
        assert_eq!(st, 404);
        let (st, refused) = create_with(&other, &[(&volume, "/data", true)]).await;
        assert_eq!(st, 404, "{refused}");
        // The quota: two volumes per account here.
        let (st, _) = api
            .post("/volumes", json!({"name": "second", "size_gb": 1}))
            .await;
        assert_eq!(st, 201);
        let (st, refused) = api
            .post("/volumes", json!({"name": "third", "size_gb": 1}))
            .await;
        assert_eq!(st, 429, "{refused}");

        // A write the file API answered survives the sandbox's QEMU killed.
        put(&api, &b, "/data/before-qemu-died.txt", "still here").await;
        // SAFETY: a plain signal to the sandbox's QEMU.
        unsafe { libc::kill(qemu_pid(&data, &b), libc::SIGKILL) };
        // The next use finds it dead, and the sandbox failed.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let (st, _) = api
            .post(&format!("/sandboxes/{b}/exec"), json!({"command": "true"}))
            .await;
        assert_ne!(st, 200);
        wait_status(&api, &b, "failed").await;
        let c = sandbox_with(&api, &[("work", "/data", false)]).await;
        assert_eq!(
            sh(&api, &c, "cat /data/before-qemu-died.txt").await,
            "still here"
        );
        put(&api, &c, "/data/before-server-died.txt", "here too").await;
        (volume, sum)
    });
    // A write the file API answered survives the server SIGKILLed.
    server.sigkill();
    let server = Server::start_with(&data, CONFIG);
    let api = Rest::new(&server, &key);
    let other = Rest::new(&server, &other_key);
    runtime.block_on(async {
        let (_, listed) = api.get("/sandboxes").await;
        let c = listed["data"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["status"] == "running")
            .map(id_of)
            .expect("the sandbox lived on");
        destroy(&api, &c).await;
        let d = sandbox_with(&api, &[("work", "/data", false)]).await;
        assert_eq!(
            sh(
                &api,
                &d,
                "cat /data/before-server-died.txt; echo; sha256sum < /data/blob | cut -d' ' -f1"
            )
            .await,
            format!("here too\n{sum}")
        );

        // A snapshot holds no volume: the sandbox's stays mounted after
        // it; a fork gets it read-only as it is now; a restore keeps it as
        // it is now.
        sh(&api, &d, "echo one > /data/step").await;
        let (st, snap) = api
            .post(&format!("/sandboxes/{d}/snapshots"), json!({}))
            .await;
        assert_eq!(st, 201, "{snap}");
        let snap = id_of(&snap);
        // (Written out, as a reader sees only what its writer wrote out.)
        sh(&api, &d, "echo two > /data/step && sync").await;
        let (st, fork) = api.post("/sandboxes", json!({"snapshot_id": snap})).await;
        assert_eq!(st, 201, "{fork}");
        let fork = id_of(&fork);
        assert_eq!(sh(&api, &fork, "cat /data/step").await, "two");
        let (code, said) = run(&api, &fork, "echo three > /data/step").await;
        assert!(code != 0 && said.contains("Read-only"), "{said}");
        destroy(&api, &fork).await;
        let (st, restored) = api
            .post(
                &format!("/sandboxes/{d}/restore"),
                json!({"snapshot_id": snap}),
            )
            .await;
        assert_eq!(st, 200, "{restored}");
        assert_eq!(sh(&api, &d, "cat /data/step").await, "two");
        // A pause keeps it mounted; it is writable after the resume.
        let (st, paused) = api.post(&format!("/sandboxes/{d}/pause"), json!({})).await;
        assert_eq!(st, 200, "{paused}");
        let (st, resumed) = api.post(&format!("/sandboxes/{d}/resume"), json!({})).await;
        assert_eq!(st, 200, "{resumed}");
        assert_eq!(
            sh(
                &api,
                &d,
                "cat /data/step; echo three > /data/step; cat /data/step"
            )
            .await,
            "two\nthree"
        );
        // A reader paused and resumed reads on (its overlay kept).
        let reader = sandbox_with(&api, &[("work", "/ro", true)]).await;
        assert_eq!(
            sh(&api, &reader, "sha256sum < /ro/blob | cut -d' ' -f1").await,
            sum
        );
        for act in ["pause", "resume"] {
            let (st, done) = api
                .post(&format!("/sandboxes/{reader}/{act}"), json!({}))
                .await;
            assert_eq!(st, 200, "{act}: {done}");
        }
        assert_eq!(
            sh(&api, &reader, "sha256sum < /ro/blob | cut -d' ' -f1").await,
            sum
        );
        destroy(&api, &reader).await;
        // Held, it cannot be deleted; free, it can.
        let (st, _) = api
            .call(reqwest::Method::DELETE, &format!("/volumes/{volume}"), None)
            .await;
        assert_eq!(st, 409);
        destroy(&api, &d).await;
        let (st, gone) = api
            .call(reqwest::Method::DELETE, &format!("/volumes/{volume}"), None)
            .await;
        assert_eq!(st, 200, "{gone}");
        assert!(!data.join("volumes").join(format!("{volume}.img")).exists());

        files_without_a_sandbox(&api, &other).await;
    });
}

/// A raw PUT of `bytes` to a volume's `path` (query), and its answer.
async fn put_raw(api: &Rest, volume: &str, query: &str, bytes: Vec<u8>) -> (u16, Value) {
    let resp = api
        .http
        .put(format!("{}/v1/volumes/{volume}/files?{query}", api.url))
        .bearer_auth(&api.key)
        .header("content-type", "application/octet-stream")
        .body(bytes)
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}

/// A volume file's bytes (status, body) as a client downloads them.
async fn get_raw(api: &Rest, volume: &str, path: &str) -> (u16, Vec<u8>) {
    let resp = api
        .http
        .get(format!("{}/v1/volumes/{volume}/files", api.url))
        .query(&[("path", path)])
        .bearer_auth(&api.key)
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    (status, resp.bytes().await.unwrap().to_vec())
}

/// The content API's round trip without a sandbox: a binary file written
/// over REST is what a sandbox mounting the volume reads, as its user's;
/// what a sandbox wrote and never synced (still in the journal when its
/// VM stopped) is read over REST once it is destroyed, a directory of
/// 12,000 long names included; while a sandbox writes the volume its files
/// are refused, naming it; a reader leaves them readable, not writable.
async fn files_without_a_sandbox(api: &Rest, other: &Rest) {
    let (st, made) = api
        .post("/volumes", json!({"name": "files", "size_gb": 1}))
        .await;
    assert_eq!(st, 201, "{made}");
    let blob: Vec<u8> = (0..3_000_000u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    let (st, put) = put_raw(api, "files", "path=/in/blob.bin", blob.clone()).await;
    assert_eq!(st, 201, "{put}");
    assert_eq!(
        (
            put["type"].as_str(),
            put["size"].as_u64(),
            put["uid"].as_u64()
        ),
        (Some("file"), Some(3_000_000), Some(1000)),
        "{put}"
    );
    let (st, back) = get_raw(api, "files", "/in/blob.bin").await;
    assert_eq!(st, 200);
    assert!(back == blob, "the file read back differs");
    let (st, listed) = api.get("/volumes/files/files?list=true&depth=2").await;
    assert_eq!(st, 200, "{listed}");
    let paths: Vec<&str> = listed["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["path"].as_str().unwrap())
        .collect();
    assert!(
        paths.contains(&"/in/blob.bin") && paths.contains(&"/in"),
        "{listed}"
    );
    // Another account: no such volume.
    let (st, _) = other
        .get("/volumes/files/files?path=/in/blob.bin&stat=true")
        .await;
    assert_eq!(st, 404);

    // A sandbox mounting it reads the file as its user's; it writes a
    // file and 12,000 long names, never synced.
    let w = sandbox_with(api, &[("files", "/data", false)]).await;
    let sum = {
        use sha2::Digest;
        hex::encode(sha2::Sha256::digest(&blob))
    };
    assert_eq!(
        sh(
            api,
            &w,
            "stat -c %U /data/in/blob.bin; sha256sum < /data/in/blob.bin | cut -d' ' -f1"
        )
        .await,
        format!("user\n{sum}")
    );
    let long = "n".repeat(200);
    sh(
        api,
        &w,
        &format!(
            "mkdir /data/many && cd /data/many && seq -w 1 12000 | sed 's/^/{long}-/' | xargs touch \
             && echo written-in-the-guest > /data/guest.txt && ls /data/many | wc -l"
        ),
    )
    .await;
    // Held read-write: the files are refused, naming the sandbox.
    let (st, refused) = api
        .get("/volumes/files/files?path=/guest.txt&stat=true")
        .await;
    assert_eq!(st, 409, "{refused}");
    assert!(refused.to_string().contains(&w), "{refused}");
    let (st, refused) = put_raw(api, "files", "path=/x", b"x".to_vec()).await;
    assert_eq!(st, 409, "{refused}");
    destroy(api, &w).await;

    // Destroyed: what it wrote is read from the volume's file.
    let (st, text) = get_raw(api, "files", "/guest.txt").await;
    assert_eq!(
        (st, String::from_utf8_lossy(&text).as_ref()),
        (200, "written-in-the-guest\n")
    );
    let (st, many) = api.get("/volumes/files/files?list=true&path=/many").await;
    assert_eq!(st, 200);
    let many = many["data"].as_array().unwrap();
    assert_eq!(many.len(), 12_000);
    assert!(many
        .iter()
        .all(|e| e["name"].as_str().unwrap().len() == 206 && e["uid"] == 1000));

    // A reader: reads go on, changes are refused.
    let r = sandbox_with(api, &[("files", "/ro", true)]).await;
    let (st, _) = get_raw(api, "files", "/guest.txt").await;
    assert_eq!(st, 200);
    let (st, refused) = api
        .call(
            reqwest::Method::DELETE,
            "/volumes/files/files?path=/many",
            None,
        )
        .await;
    assert_eq!(st, 409, "{refused}");
    destroy(api, &r).await;
    // Free again: a directory made, a mode changed, a tree removed.
    let (st, dir) = api
        .post(
            "/volumes/files/files?path=/a/b&parents=true&mode=0700",
            json!(null),
        )
        .await;
    assert_eq!((st, dir["mode"].as_u64()), (201, Some(0o700)), "{dir}");
    let (st, changed) = api
        .call(
            reqwest::Method::PATCH,
            "/volumes/files/files?path=/guest.txt",
            Some(json!({"mode": 0o600})),
        )
        .await;
    assert_eq!(
        (st, changed["mode"].as_u64()),
        (200, Some(0o600)),
        "{changed}"
    );
    let (st, gone) = api
        .call(
            reqwest::Method::DELETE,
            "/volumes/files/files?path=/many",
            None,
        )
        .await;
    assert_eq!(st, 200, "{gone}");
    let (st, _) = api.get("/volumes/files/files?path=/many&stat=true").await;
    assert_eq!(st, 404);
    // And a sandbox sees it so.
    let last = sandbox_with(api, &[("files", "/data", false)]).await;
    assert_eq!(
        sh(api, &last, "ls /data; stat -c %a /data/guest.txt /data/a/b").await,
        "a\nguest.txt\nin\nlost+found\n600\n700"
    );
    destroy(api, &last).await;
    let (st, _) = api
        .call(reqwest::Method::DELETE, "/volumes/files", None)
        .await;
    assert_eq!(st, 200);
}
