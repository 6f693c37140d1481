//! An upgrade as an operator makes one: the previous release's `sandpit
//! serve` (built from this repository's history by
//! `scripts/build-previous.sh`) runs on a data directory with sandboxes in
//! it and stops; this build's starts on the same directory and takes them
//! over. Its store is migrated forward, its agent (the guest image's)
//! differs from the old VMs' agent, and new creates get a new image and
//! new templates while the old VMs run on.
//!
//! The two releases share the cached guest root filesystem (their recipes
//! are the same) through an images directory of the test's own, so neither
//! touches the shared cache's `current.json`.

use crate::common::serve::*;
use crate::common::*;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// The previous release's binaries, which the test script builds.
fn previous_release(images: &Path) -> (Build, String) {
    let target = Path::new(env!("CARGO_BIN_EXE_sandpit"))
        .ancestors()
        .nth(2)
        .unwrap()
        .to_path_buf();
    let dir = target.join("previous/current");
    let commit = std::fs::read_link(&dir)
        .map(|c| c.display().to_string())
        .unwrap_or_default();
    let build = Build {
        program: dir.join("sandpit"),
        agent: dir.join("sandpit-agent"),
        images: images.to_path_buf(),
    };
    assert!(
        build.program.exists() && build.agent.exists(),
        "the previous release is not built in {}: run scripts/build-previous.sh \
         (scripts/test.sh does)",
        dir.display()
    );
    (build, commit)
}

/// An images directory of the test's own over the shared cache: its root
/// filesystem, kernel and packages, but none of its images.
fn private_images() -> PathBuf {
    let dir = data_dir();
    use std::os::unix::fs::PermissionsExt;
    // VMs' QEMUs run under uids of their own and read the image through it.
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let shared = std::fs::canonicalize(images_dir()).unwrap();
    for e in std::fs::read_dir(&shared).unwrap().flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        let cached = ["rootfs-", "kernel-", "busybox-", "apt-"]
            .iter()
            .any(|p| name.starts_with(p));
        if cached {
            std::os::unix::fs::symlink(e.path(), dir.join(&name)).unwrap();
        }
    }
    dir
}

fn vm_record(data: &Path, id: &str) -> Value {
    let path = data.join("vms").join(id).join("vm.json");
    serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap()
}

/// The finished template directories under `data`.
fn templates(data: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(data.join("templates"))
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().to_string())
                .filter(|n| !n.starts_with('.'))
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

fn parse_time(v: &Value) -> OffsetDateTime {
    OffsetDateTime::parse(v.as_str().unwrap(), &Rfc3339).unwrap()
}

async fn sh(api: &Rest, id: &str, cmd: &str) -> String {
    let (st, ex) = api
        .post(&format!("/sandboxes/{id}/exec"), json!({"command": cmd}))
        .await;
    assert_eq!(st, 200, "`{cmd}` in {id}: {ex}");
    assert_eq!(ex["exit_code"], 0, "`{cmd}` in {id}: {ex}");
    ex["stdout"].as_str().unwrap().trim().to_string()
}

/// Write `content` to `path` in sandbox `id` through the files API.
async fn write(api: &Rest, id: &str, path: &str, content: &str) {
    let (st, w) = api
        .call(
            reqwest::Method::PUT,
            &format!("/sandboxes/{id}/files"),
            Some(json!({"path": path, "content": content, "encoding": "utf8"})),
        )
        .await;
    assert_eq!(st, 200, "{w}");
}

/// Wait until the server's warm pool holds its two small VMs: its template
/// is built.
async fn pool_filled(api: &Rest) {
    let deadline = Instant::now() + Duration::from_secs(240);
    loop {
        let (_, info) = api.get("/service").await;
        if info["fast_start"]["warm_pool"][0]["ready"].as_u64() >= Some(2) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the warm pool did not fill: {info}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

async fn create(api: &Rest, body: Value) -> String {
    let (st, s) = api.post("/sandboxes", body).await;
    assert_eq!(st, 201, "{s}");
    assert_eq!(s["status"], "running", "{s}");
    s["id"].as_str().unwrap().to_string()
}

async fn destroy(api: &Rest, id: &str) {
    let (st, s) = api
        .call(reqwest::Method::DELETE, &format!("/sandboxes/{id}"), None)
        .await;
    assert_eq!(st, 200, "{s}");
}

#[test]
fn the_previous_release_s_sandboxes_live_on_under_this_one() {
    let images = private_images();
    let (previous, previous_commit) = previous_release(&images);
    let this = Build {
        program: PathBuf::from(env!("CARGO_BIN_EXE_sandpit")),
        agent: this_agent(),
        images: images.clone(),
    };
    let data = data_dir();

    // The previous release makes the data directory and its sandboxes: one
    // that expires under the new release, one that lives through it.
    let old = Server::start_build(&data, &previous);
    let key = old
        .admin_key
        .clone()
        .expect("the previous release's first start prints the admin key");
    let (short, long, boot_id, sleeper, long_created) = rt().block_on(async {
        let api = Rest::new(&old, &key);
        let (_, info) = api.get("/service").await;
        assert!(
            info.get("commit").is_none(),
            "not the previous release: {info}"
        );
        // Its sandboxes come from its warm pool, restored from its template.
        pool_filled(&api).await;
        let short = create(&api, json!({"name": "short", "timeout_minutes": 2})).await;
        let long = create(&api, json!({"name": "long", "timeout_minutes": 30})).await;
        write(&api, &long, "notes.txt", "written before the upgrade\n").await;
        let boot_id = sh(&api, &long, "cat /proc/sys/kernel/random/boot_id").await;
        let sleeper = sh(
            &api,
            &long,
            "setsid sleep 100000 >/dev/null 2>&1 < /dev/null & echo $!",
        )
        .await;
        let (_, s) = api.get(&format!("/sandboxes/{long}")).await;
        (short, long, boot_id, sleeper, parse_time(&s["created_at"]))
    });
    let old_image = vm_record(&data, &long)["image_id"]
        .as_str()
        .unwrap()
        .to_string();
    let old_templates = templates(&data);
    assert_eq!(old_templates.len(), 1, "{old_templates:?}");
    assert_eq!(
        vm_record(&data, &long)["template"]
            .as_str()
            .map(|k| format!("small-{k}")),
        Some(old_templates[0].clone()),
        "the old sandbox was not restored from the old release's template"
    );
    // It stops as a service stops: its sandboxes run on.
    drop(old);
    for id in [&short, &long] {
        assert!(
            !pids_mentioning(&format!("sandpit-vm-{id}")).is_empty(),
            "{id} did not outlive the previous release's server"
        );
    }

    // This release takes the directory over.
    let new = Server::start_build(&data, &this);
    assert!(
        new.admin_key.is_none(),
        "an upgrade made a new admin account"
    );
    rt().block_on(async {
        let api = Rest::new(&new, &key);
        let (_, info) = api.get("/service").await;
        assert_eq!(info["commit"], head_commit(), "{info}");

        // The old sandboxes answer, the same machines: same boot, same
        // processes, same files, read and written through the new host.
        for id in [&short, &long] {
            let (st, s) = api.get(&format!("/sandboxes/{id}")).await;
            assert_eq!((st, s["status"].as_str()), (200, Some("running")), "{s}");
        }
        assert_eq!(
            sh(&api, &long, "cat /proc/sys/kernel/random/boot_id").await,
            boot_id,
            "the old sandbox was rebooted or replaced"
        );
        sh(&api, &long, &format!("kill -0 {sleeper}")).await;
        let (st, f) = api
            .get(&format!("/sandboxes/{long}/files?path=notes.txt"))
            .await;
        assert_eq!(st, 200, "{f}");
        assert_eq!(f["content"], "written before the upgrade\n", "{f}");
        write(&api, &long, "after.txt", "and after\n").await;
        assert_eq!(sh(&api, &long, "cat after.txt").await, "and after");

        // Its lifetime is the new release's to keep: an extension moves
        // both the row and the VM's own watchdog.
        let (st, s) = api
            .post(
                &format!("/sandboxes/{long}/extend"),
                json!({"additional_minutes": 5}),
            )
            .await;
        assert_eq!(st, 200, "{s}");
        let until = parse_time(&s["expires_at"]);
        let watchdog: i64 = std::fs::read_to_string(data.join("vms").join(&long).join("expires"))
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        assert!(
            (1..=2).contains(&(watchdog - until.unix_timestamp())),
            "the old VM's watchdog was not moved with its sandbox ({watchdog} for {until})"
        );

        // A new create gets this release's image and a template built for
        // it; the old template stays while old VMs stand on it.
        pool_filled(&api).await;
        let fresh = create(&api, json!({"name": "fresh", "timeout_minutes": 10})).await;
        assert_eq!(sh(&api, &fresh, "echo new").await, "new");
        let new_image = vm_record(&data, &fresh)["image_id"]
            .as_str()
            .unwrap()
            .to_string();
        assert_ne!(new_image, old_image, "the new release boots the old image");
        assert_eq!(
            vm_record(&data, &long)["image_id"].as_str(),
            Some(old_image.as_str())
        );
        assert!(images.join(format!("image-{old_image}")).exists());
        let new_template = vm_record(&data, &fresh)["template"]
            .as_str()
            .map(|k| format!("small-{k}"))
            .expect("the new sandbox came from this release's template");
        assert_ne!(new_template, old_templates[0]);
        let now_templates = templates(&data);
        assert_eq!(now_templates.len(), 2, "{now_templates:?}");
        assert!(
            now_templates.contains(&old_templates[0]),
            "the old template was removed under the old VMs: {now_templates:?}"
        );
        assert!(
            data.join("templates")
                .join(&old_templates[0])
                .join("outdated")
                .exists(),
            "the old template is not marked outdated"
        );

        // An old VM can still be copied: a fork stands on the old template.
        let (st, fork) = api
            .post(&format!("/sandboxes/{long}/fork"), json!({"count": 1}))
            .await;
        assert_eq!(st, 201, "{fork}");
        let copy = fork["sandboxes"][0]["id"].as_str().unwrap().to_string();
        let fork_snapshot = fork["snapshot"]["id"].as_str().unwrap().to_string();
        assert_eq!(
            sh(&api, &copy, "cat notes.txt after.txt").await,
            "written before the upgrade\nand after"
        );
        assert_ne!(
            sh(&api, &copy, "cat /etc/machine-id").await,
            sh(&api, &long, "cat /etc/machine-id").await
        );

        // The short one expires at its time under the new release, its VM
        // gone within seconds, charged up to its expiry.
        let (_, s) = api.get(&format!("/sandboxes/{short}")).await;
        let expires_at = parse_time(&s["expires_at"]);
        let left = expires_at - OffsetDateTime::now_utc();
        eprintln!("the short sandbox expires in {left}");
        assert!(
            left.is_positive(),
            "the test's set-up outlasted the short sandbox's 2 minutes (it takes about 15 s)"
        );
        tokio::time::sleep(Duration::from_secs_f64(left.as_seconds_f64()) + Duration::from_secs(5))
            .await;
        let (_, s) = api.get(&format!("/sandboxes/{short}")).await;
        assert_eq!(
            (s["status"].as_str(), s["deleted_reason"].as_str()),
            (Some("deleted"), Some("expired")),
            "{s}"
        );
        assert!(pids_mentioning(&format!("sandpit-vm-{short}")).is_empty());
        assert!(!data.join("vms").join(&short).exists());

        // Everything else ends; the old template goes with the last VM
        // or snapshot that stood on it, and nothing of any sandbox is left.
        for id in [&copy, &long, &fresh] {
            destroy(&api, id).await;
        }
        assert!(
            templates(&data).contains(&old_templates[0]),
            "the old template went while the fork's snapshot stands on it"
        );
        let (st, d) = api
            .call(
                reqwest::Method::DELETE,
                &format!("/snapshots/{fork_snapshot}"),
                None,
            )
            .await;
        assert_eq!(st, 200, "{d}");
        let leftover = || {
            host_processes(&data)
                .into_iter()
                .filter(|p| {
                    p.vm.as_ref()
                        .is_some_and(|vm| [&short, &long, &copy, &fresh].contains(&vm))
                })
                .collect::<Vec<_>>()
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while !leftover().is_empty() {
            assert!(Instant::now() < deadline, "left running: {:?}", leftover());
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        assert!(
            !templates(&data).contains(&old_templates[0]),
            "the old template outlived the VMs that stood on it: {:?}",
            templates(&data)
        );

        // Billing: the short one to its expiry, the long one across the
        // downtime, and the credit is exactly what the usage says.
        let (_, u) = api.get("/usage").await;
        let row = |id: &str| {
            u["sandboxes"]
                .as_array()
                .unwrap()
                .iter()
                .find(|s| s["id"] == id)
                .unwrap_or_else(|| panic!("{id} is not in the usage: {u}"))
                .clone()
        };
        assert_eq!(
            (
                row(&short)["seconds"].as_u64(),
                row(&short)["cost_usd"].as_f64()
            ),
            (Some(120), Some(0.003)),
            "{u}"
        );
        let lived = (OffsetDateTime::now_utc() - long_created).whole_seconds() as u64;
        let long_seconds = row(&long)["seconds"].as_u64().unwrap();
        assert!(
            long_seconds + 2 >= lived && long_seconds <= lived + 1,
            "the long sandbox was billed {long_seconds} s of its {lived} s"
        );
        let total = u["total_cost_usd"].as_f64().unwrap();
        let credit = u["credit_remaining_usd"].as_f64().unwrap();
        assert!(
            (100.0 - total - credit).abs() < 1e-6,
            "credit {credit} after {total} spent of 100"
        );
    });
    eprintln!("upgraded from {previous_commit}");
}

/// This build's agent, as the test script exports it.
fn this_agent() -> PathBuf {
    std::env::var_os("SANDPIT_AGENT_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_BIN_EXE_sandpit"))
                .ancestors()
                .nth(2)
                .unwrap()
                .join("x86_64-unknown-linux-gnu/release/sandpit-agent")
        })
}
