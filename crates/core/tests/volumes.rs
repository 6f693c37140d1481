//! Volumes through the core service, on this machine's own `LocalVms`:
//! their files are really made, grown and removed (e2fsprogs on the host),
//! and their rows really kept (SQLite). No VM boots: a volume's life needs
//! none, and the creates here are refused before a VM would start. A live
//! sandbox that holds a volume is a row the test writes (mounting in real
//! VMs is `crates/cli/tests/e2e/volumes.rs`).

use sandpit_core::api::prelude::*;
use sandpit_core::config::ServiceConfig;
use sandpit_core::{Caller, CreateSandbox, CreateVolume, ErrorType, ResizeVolume, Service, Volume};
use sandpit_host::local::LocalVms;
use sandpit_runtime::image::GuestImage;
use sandpit_runtime::{RuntimeConfig, VmManager};
use sandpit_store::{CreateOutcome, NewSandbox, SandboxStatus, Store, VolumeMountRow};
use std::path::Path;
use std::sync::Arc;
use time::OffsetDateTime;

const GIB: u64 = 1024 * 1024 * 1024;

/// A service over a fresh data directory whose VM manager has an image
/// that is never booted (volumes need QEMU's version only).
async fn service(dir: &Path, f: impl FnOnce(&mut ServiceConfig)) -> Arc<Service> {
    let mut rt = RuntimeConfig::new(dir);
    rt.network.enabled = false;
    rt.ksm = false;
    rt.snapshots = false;
    let image = GuestImage {
        id: "never-booted".into(),
        dir: dir.join("image"),
        kernel: dir.join("image/vmlinuz"),
        initrd: dir.join("image/initrd"),
        rootfs: dir.join("image/rootfs.qcow2"),
        kernel_release: "none".into(),
    };
    let vms =
        LocalVms::new(VmManager::new(rt, image).expect("VmManager::new (is QEMU installed?)"));
    let store = Store::open_sqlite(dir.join("sandpit.db")).await.unwrap();
    let mut config = ServiceConfig::default();
    f(&mut config);
    Service::new(config, store, vms)
}

async fn account(svc: &Service, name: &str) -> Caller {
    let a = svc.create_account(name, 10.0).await.unwrap();
    Caller::new(a.id, "test")
}

fn create(name: &str, size_gb: Option<u32>) -> CreateVolume {
    CreateVolume {
        name: name.into(),
        size_gb,
    }
}

/// A create without an idempotency key.
async fn make(
    svc: &Service,
    caller: &Caller,
    req: CreateVolume,
) -> sandpit_core::error::Result<Volume> {
    svc.create_volume(caller, req, None).await.map(|(v, _)| v)
}

fn file(dir: &Path, id: &str) -> std::path::PathBuf {
    dir.join("volumes").join(format!("{id}.img"))
}

/// A live sandbox row of `caller`'s (no VM), as a create leaves one.
async fn live_sandbox(store: &Store, caller: &Caller) -> String {
    let now = OffsetDateTime::now_utc();
    let new = NewSandbox {
        id: sandpit_store::new_id("sbx"),
        account_id: caller.account_id.clone(),
        name: None,
        size: "small".into(),
        vcpus: 2,
        memory_mb: 4096,
        disk_gb: 40,
        timeout_minutes: 60,
        price_micros_per_hour: 0,
        host: "localhost".into(),
        created_at: now,
        expires_at: now + time::Duration::hours(1),
        reserve_micros: 0,
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
    };
    match store.create_sandbox(new).await.unwrap() {
        CreateOutcome::Created(row) => row.id,
        other => panic!("{other:?}"),
    }
}

fn mounting(volume: &str, path: &str, read_only: bool) -> CreateSandbox {
    CreateSandbox {
        volumes: vec![sandpit_core::VolumeMount {
            volume: volume.into(),
            path: path.into(),
            read_only,
        }],
        ..CreateSandbox::default()
    }
}

#[tokio::test]
async fn a_volume_is_made_listed_grown_held_and_deleted_with_its_file() {
    let dir = tempfile::tempdir().unwrap();
    let svc = service(dir.path(), |c| c.volumes.price_usd_per_gb_month = 1000.0).await;
    let ann = account(&svc, "ann").await;
    let bob = account(&svc, "bob").await;

    let data = make(&svc, &ann, create("data", Some(1))).await.unwrap();
    assert_eq!(data.object, "volume");
    assert!(data.id.starts_with("vol_"), "{}", data.id);
    assert_eq!((data.size_gb, data.status.as_str()), (1, "ready"));
    assert!(data.mounted_by.is_empty());
    let path = file(dir.path(), &data.id);
    assert_eq!(std::fs::metadata(&path).unwrap().len(), GIB);

    // Found by name and by id; another account's is 404.
    assert_eq!(svc.get_volume(&ann, "data").await.unwrap(), data);
    assert_eq!(svc.get_volume(&ann, &data.id).await.unwrap(), data);
    for volume in ["data", data.id.as_str()] {
        let e = svc.get_volume(&bob, volume).await.unwrap_err();
        assert_eq!(e.kind, ErrorType::NotFound, "{e}");
        let e = svc.delete_volume(&bob, volume).await.unwrap_err();
        assert_eq!(e.kind, ErrorType::NotFound, "{e}");
    }
    assert!(svc.list_volumes(&bob).await.unwrap().data.is_empty());
    let e = make(&svc, &ann, create("data", None)).await.unwrap_err();
    assert_eq!(e.kind, ErrorType::Conflict);
    assert!(e.message.contains("already"), "{e}");

    // Grown; never shrunk.
    let grown = svc
        .resize_volume(&ann, "data", ResizeVolume { size_gb: 2 })
        .await
        .unwrap();
    assert_eq!(grown.size_gb, 2);
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 2 * GIB);
    let e = svc
        .resize_volume(&ann, "data", ResizeVolume { size_gb: 1 })
        .await
        .unwrap_err();
    assert_eq!(e.kind, ErrorType::InvalidRequest);
    assert!(e.message.contains("only grows"), "{e}");

    // Held by a live sandbox: neither resized nor deleted, and another
    // sandbox cannot take it read-write; the refusals name the holder.
    let holder = live_sandbox(svc.store(), &ann).await;
    let held = svc
        .store()
        .hold_volumes(
            &ann.account_id,
            &holder,
            &[VolumeMountRow {
                sandbox_id: holder.clone(),
                volume_id: data.id.clone(),
                path: "/data".into(),
                read_only: false,
            }],
        )
        .await
        .unwrap();
    assert_eq!(held, sandpit_store::VolumesHeld::Held);
    let shown = svc.get_volume(&ann, "data").await.unwrap();
    assert_eq!(shown.mounted_by.len(), 1);
    assert_eq!(shown.mounted_by[0].sandbox_id, holder);
    assert_eq!(
        (
            shown.mounted_by[0].path.as_str(),
            shown.mounted_by[0].read_only
        ),
        ("/data", false)
    );
    let e = svc
        .resize_volume(&ann, "data", ResizeVolume { size_gb: 3 })
        .await
        .unwrap_err();
    assert_eq!(e.kind, ErrorType::Conflict);
    assert!(e.message.contains(&holder), "{e}");
    let e = svc.delete_volume(&ann, "data").await.unwrap_err();
    assert_eq!(e.kind, ErrorType::Conflict);
    assert!(e.message.contains(&holder), "{e}");
    let e = svc
        .create_sandbox(&ann, mounting("data", "/work", false), None)
        .await
        .unwrap_err();
    assert_eq!(e.kind, ErrorType::Conflict);
    assert!(
        e.message.contains(&holder) && e.message.contains("read-write"),
        "{e}"
    );
    // Bad mounts are refused saying why, before anything else.
    for (path, why) in [
        ("/etc/x", "in /etc"),
        ("relative", "absolute"),
        ("/", "root"),
    ] {
        let e = svc
            .create_sandbox(&ann, mounting("data", path, true), None)
            .await
            .unwrap_err();
        assert_eq!(e.kind, ErrorType::InvalidRequest);
        assert!(e.message.contains(why), "{path}: {e}");
    }
    let e = svc
        .create_sandbox(&bob, mounting("data", "/data", true), None)
        .await
        .unwrap_err();
    assert_eq!(e.kind, ErrorType::NotFound, "{e}");
    let five = CreateSandbox {
        volumes: (0..5)
            .map(|i| sandpit_core::VolumeMount {
                volume: "data".into(),
                path: format!("/v{i}"),
                read_only: true,
            })
            .collect(),
        ..CreateSandbox::default()
    };
    let e = svc.create_sandbox(&ann, five, None).await.unwrap_err();
    assert!(e.message.contains("at most 4"), "{e}");
    // No sandbox was made by any of these.
    let listed = svc
        .list_sandboxes(&ann, Default::default())
        .await
        .unwrap()
        .data;
    assert_eq!(listed.len(), 1, "{listed:?}");

    // Its holder ended: deleted, file and all; billed for the time it was.
    tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
    svc.store()
        .finish_sandbox(
            &holder,
            SandboxStatus::Deleted,
            "test",
            OffsetDateTime::now_utc(),
            0,
            &sandpit_store::Cause::default(),
        )
        .await
        .unwrap();
    let gone = svc.delete_volume(&ann, "data").await.unwrap();
    assert_eq!(gone.status, "deleted");
    assert!(!path.exists());
    let e = svc.get_volume(&ann, &data.id).await.unwrap_err();
    assert_eq!(e.kind, ErrorType::NotFound);
    let usage = svc.usage(&ann, None).await.unwrap();
    assert_eq!(usage.volumes.len(), 1, "{usage:?}");
    let billed = &usage.volumes[0];
    assert_eq!((billed.id.as_str(), billed.size_gb), (data.id.as_str(), 2));
    assert!(billed.deleted_at.is_some());
    assert!(billed.seconds >= 1, "{billed:?}");
    assert!(billed.cost_usd > 0.0, "{billed:?}");
    assert!(usage.total_cost_usd >= billed.cost_usd);
    // The ledger is charged for it (the hourly sweep), once: to its delete.
    let before = svc.store().balance(&ann.account_id).await.unwrap();
    assert_eq!(
        svc.charge_volumes(OffsetDateTime::now_utc()).await.unwrap(),
        1
    );
    let charge = svc
        .store()
        .ledger(&ann.account_id)
        .await
        .unwrap()
        .into_iter()
        .find(|l| l.note.as_deref().is_some_and(|n| n.contains(&data.id)))
        .expect("a charge for the volume");
    assert_eq!(charge.kind, "charge");
    assert!(charge.amount_micros < 0, "{charge:?}");
    assert_eq!(
        svc.store().balance(&ann.account_id).await.unwrap(),
        before + charge.amount_micros
    );
    let later = OffsetDateTime::now_utc() + time::Duration::hours(2);
    assert_eq!(svc.charge_volumes(later).await.unwrap(), 0);
    // Its name is free again.
    make(&svc, &ann, create("data", Some(1))).await.unwrap();
}

#[tokio::test]
async fn names_sizes_and_quotas_are_refused_saying_which() {
    let dir = tempfile::tempdir().unwrap();
    let svc = service(dir.path(), |c| {
        c.volumes.max_per_account = 2;
        c.volumes.max_bytes_per_account = 3 * GIB;
        c.volumes.max_size_gb = 2;
        c.volumes.default_size_gb = 1;
    })
    .await;
    let ann = account(&svc, "ann").await;
    for (name, why) in [
        ("", "letters, digits"),
        ("a b", "letters, digits"),
        ("vol_x", "reserved"),
        (&"n".repeat(65), "at most 64"),
    ] {
        let e = make(&svc, &ann, create(name, None)).await.unwrap_err();
        assert_eq!(e.kind, ErrorType::InvalidRequest, "{name:?}");
        assert!(e.message.contains(why), "{name:?}: {e}");
    }
    for size in [0, 3] {
        let e = make(&svc, &ann, create("sized", Some(size)))
            .await
            .unwrap_err();
        assert!(e.message.contains("between 1 and 2"), "{e}");
    }
    let first = make(&svc, &ann, create("one", Some(2))).await.unwrap();
    assert_eq!(first.size_gb, 2);
    // 2 GiB held, 2 more is past 3.
    let e = make(&svc, &ann, create("two", Some(2))).await.unwrap_err();
    assert_eq!(e.kind, ErrorType::RateLimited);
    assert!(e.message.contains("quota of 3 GiB"), "{e}");
    make(&svc, &ann, create("two", None)).await.unwrap();
    let e = make(&svc, &ann, create("three", None)).await.unwrap_err();
    assert_eq!(e.kind, ErrorType::RateLimited);
    assert!(e.message.contains("quota is 2"), "{e}");
    // Growing counts too.
    let e = svc
        .resize_volume(&ann, "two", ResizeVolume { size_gb: 2 })
        .await
        .unwrap_err();
    assert_eq!(e.kind, ErrorType::RateLimited, "{e}");
    let names: Vec<String> = svc
        .list_volumes(&ann)
        .await
        .unwrap()
        .data
        .into_iter()
        .map(|v| v.name)
        .collect();
    assert_eq!(names, ["one", "two"]);
    // Nothing half-made is left on disk.
    let files = std::fs::read_dir(dir.path().join("volumes"))
        .unwrap()
        .count();
    assert_eq!(files, 2);
}

#[tokio::test]
async fn a_create_retried_with_its_key_gets_the_same_volume() {
    let dir = tempfile::tempdir().unwrap();
    let svc = service(dir.path(), |_| {}).await;
    let ann = account(&svc, "ann").await;
    let key = || Some("k-1".to_string());
    let (first, replayed) = svc
        .create_volume(&ann, create("data", Some(1)), key())
        .await
        .unwrap();
    assert!(!replayed);
    let (again, replayed) = svc
        .create_volume(&ann, create("data", Some(1)), key())
        .await
        .unwrap();
    assert!(replayed);
    assert_eq!(again, first);
    // The default size is what a retry that leaves it out asks for.
    let e = svc
        .create_volume(&ann, create("data", None), key())
        .await
        .unwrap_err();
    assert_eq!(e.kind, ErrorType::Conflict);
    assert!(e.message.contains("Idempotency-Key"), "{e}");
    let e = svc
        .create_volume(&ann, create("other", Some(1)), Some(String::new()))
        .await
        .unwrap_err();
    assert_eq!(e.kind, ErrorType::InvalidRequest);
    assert_eq!(svc.list_volumes(&ann).await.unwrap().data, [first]);
}

#[tokio::test]
async fn a_volume_whose_making_or_growing_was_lost_is_settled_by_the_sweep() {
    let dir = tempfile::tempdir().unwrap();
    let svc = service(dir.path(), |_| {}).await;
    let ann = account(&svc, "ann").await;
    let kept = make(&svc, &ann, create("kept", Some(1))).await.unwrap();
    // A create whose process was lost after its node made the file, and a
    // resize lost half-way: rows left `creating` and `resizing`.
    let lost = sandpit_store::NewVolume {
        id: "vol_lostlostlostlostlostlost".into(),
        account_id: ann.account_id.clone(),
        name: "lost".into(),
        size_bytes: GIB,
        host: svc.config().host_name.clone(),
        max_count: 20,
        max_bytes: 100 * GIB,
        idempotency: None,
    };
    svc.store().create_volume(&lost).await.unwrap();
    sandpit_runtime::volume_files::VolumeFiles::new(dir.path().join("volumes"))
        .create(&lost.id, 64 << 20)
        .await
        .unwrap();
    svc.store()
        .begin_volume_resize(&ann.account_id, &kept.id, 2 * GIB, 100 * GIB)
        .await
        .unwrap();
    // Recent: nothing is touched (the work may still be under way).
    let after = sandpit_core::service::VOLUME_STUCK_AFTER;
    svc.sweep_stuck_volumes(after).await.unwrap();
    assert_eq!(
        svc.get_volume(&ann, "lost").await.unwrap().status,
        "creating"
    );
    assert_eq!(
        svc.get_volume(&ann, "kept").await.unwrap().status,
        "resizing"
    );
    // Past the bound (here: any time at all): settled.
    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    svc.sweep_stuck_volumes(time::Duration::ZERO).await.unwrap();
    let e = svc.get_volume(&ann, "lost").await.unwrap_err();
    assert_eq!(e.kind, ErrorType::NotFound);
    assert!(!file(dir.path(), &lost.id).exists());
    let back = svc.get_volume(&ann, "kept").await.unwrap();
    assert_eq!((back.status.as_str(), back.size_gb), ("ready", 1));
    // Its name is free again.
    make(&svc, &ann, create("lost", Some(1))).await.unwrap();
}

#[tokio::test]
async fn a_deleted_or_moved_volumes_file_left_behind_is_removed_and_a_stranger_kept() {
    let dir = tempfile::tempdir().unwrap();
    let svc = service(dir.path(), |_| {}).await;
    let ann = account(&svc, "ann").await;
    let files = sandpit_runtime::volume_files::VolumeFiles::new(dir.path().join("volumes"));
    let gone = make(&svc, &ann, create("gone", Some(1))).await.unwrap();
    svc.delete_volume(&ann, "gone").await.unwrap();
    // As if its node had been out of reach at the delete: the file stays.
    files.create(&gone.id, 64 << 20).await.unwrap();
    // A file no row names (a database restored from an older backup).
    files
        .create("vol_strangerstrangerstrang", 64 << 20)
        .await
        .unwrap();
    let kept = make(&svc, &ann, create("kept", Some(1))).await.unwrap();
    // A make lost mid-way, long ago.
    std::fs::write(dir.path().join("volumes/vol_lost.img.making"), b"").unwrap();
    // A volume moved to another node whose old copy here stayed (the node
    // was out of reach when the move removed it).
    let moved = sandpit_store::NewVolume {
        id: "vol_movedmovedmovedmovedmo".into(),
        account_id: ann.account_id.clone(),
        name: "moved".into(),
        size_bytes: GIB,
        host: "elsewhere".into(),
        max_count: 20,
        max_bytes: 100 * GIB,
        idempotency: None,
    };
    svc.store().create_volume(&moved).await.unwrap();
    svc.store().volume_ready(&moved.id, GIB).await.unwrap();
    files.create(&moved.id, 64 << 20).await.unwrap();

    let after = sandpit_core::service::VOLUME_STUCK_AFTER;
    svc.sweep_volume_files(after).await.unwrap();
    assert!(!file(dir.path(), &gone.id).exists());
    assert!(file(dir.path(), "vol_strangerstrangerstrang").exists());
    assert!(file(dir.path(), &kept.id).exists());
    // Recent: the make may still be under way, the copy may be one just
    // received.
    assert!(dir.path().join("volumes/vol_lost.img.making").exists());
    assert!(file(dir.path(), &moved.id).exists());
    svc.sweep_volume_files(time::Duration::ZERO).await.unwrap();
    assert!(!dir.path().join("volumes/vol_lost.img.making").exists());
    assert!(!file(dir.path(), &moved.id).exists());
    assert!(file(dir.path(), &kept.id).exists());
}

/// An upload's body from memory, in two pieces.
struct Body(Vec<Vec<u8>>);

#[async_trait::async_trait]
impl sandpit_core::api::ByteSource for Body {
    async fn next_chunk(&mut self) -> Option<std::io::Result<Vec<u8>>> {
        (!self.0.is_empty()).then(|| Ok(self.0.remove(0)))
    }
}

fn body(bytes: &[u8]) -> Box<Body> {
    let (a, b) = bytes.split_at(bytes.len() / 2);
    Box::new(Body(vec![a.to_vec(), b.to_vec()]))
}

async fn downloaded(svc: &Service, caller: &Caller, volume: &str, path: &str) -> Vec<u8> {
    let mut file = svc
        .download_volume_file(caller, volume, path)
        .await
        .unwrap();
    let mut out = Vec::new();
    while let Some(piece) = file.chunks.recv().await {
        out.extend(piece.unwrap());
    }
    assert_eq!(out.len() as u64, file.size);
    out
}

fn hold(
    svc: &Service,
    caller: &Caller,
    sandbox: &str,
    volume: &str,
    read_only: bool,
) -> impl std::future::Future<Output = sandpit_store::VolumesHeld> {
    let (store, account, sandbox, volume) = (
        svc.store().clone(),
        caller.account_id.clone(),
        sandbox.to_string(),
        volume.to_string(),
    );
    async move {
        store
            .hold_volumes(
                &account,
                &sandbox,
                &[VolumeMountRow {
                    sandbox_id: sandbox.clone(),
                    volume_id: volume,
                    path: "/data".into(),
                    read_only,
                }],
            )
            .await
            .unwrap()
    }
}

/// The files of a volume without a sandbox, through the service: written,
/// read, listed, described, changed and removed from its real file; read
/// only while no sandbox writes the volume, changed only while none mounts
/// it; and no sandbox takes it while the host works on it.
#[tokio::test]
async fn a_volumes_files_are_served_without_a_sandbox_while_none_writes_it() {
    use sandpit_core::{VolumeCall, VolumeOwnership};
    let dir = tempfile::tempdir().unwrap();
    let svc = service(dir.path(), |_| {}).await;
    let ann = account(&svc, "ann").await;
    let bob = account(&svc, "bob").await;
    let data = make(&svc, &ann, create("data", Some(1))).await.unwrap();

    let bytes: Vec<u8> = (0..1_000_000u32).map(|i| (i % 251) as u8).collect();
    let made = svc
        .upload_volume_file(
            &ann,
            "data",
            "/in/put.bin",
            bytes.len() as u64,
            VolumeOwnership::default(),
            false,
            body(&bytes),
        )
        .await
        .unwrap();
    assert_eq!(
        (made.kind.as_str(), made.size, made.uid, made.mode),
        ("file", 1_000_000, 1000, 0o644)
    );
    assert_eq!(downloaded(&svc, &ann, "data", "/in/put.bin").await, bytes);
    // By id too; another account's caller finds nothing.
    assert_eq!(
        downloaded(&svc, &ann, &data.id, "/in/put.bin").await.len(),
        1_000_000
    );
    let e = svc
        .download_volume_file(&bob, &data.id, "/in/put.bin")
        .await
        .err()
        .unwrap();
    assert_eq!(e.kind, ErrorType::NotFound);
    let e = svc
        .volume_files(
            &bob,
            "data",
            VolumeCall::List {
                path: "/".into(),
                depth: 1,
            },
        )
        .await
        .unwrap_err();
    assert_eq!(e.kind, ErrorType::NotFound);

    // A body that ends early writes nothing.
    let e = svc
        .upload_volume_file(
            &ann,
            "data",
            "/short",
            10,
            VolumeOwnership::default(),
            false,
            body(b"abc"),
        )
        .await
        .unwrap_err();
    assert_eq!(e.kind, ErrorType::InvalidRequest);
    let listed = svc
        .volume_files(
            &ann,
            "data",
            VolumeCall::List {
                path: "/".into(),
                depth: 2,
            },
        )
        .await
        .unwrap();
    let mut paths: Vec<&str> = listed.iter().map(|e| e.path.as_str()).collect();
    paths.sort();
    assert_eq!(paths, ["/in", "/in/put.bin", "/lost+found"]);
    let e = svc
        .volume_files(
            &ann,
            "data",
            VolumeCall::Stat {
                path: "/short".into(),
            },
        )
        .await
        .unwrap_err();
    assert_eq!(e.kind, ErrorType::NotFound);
    let e = svc
        .volume_files(
            &ann,
            "data",
            VolumeCall::Stat {
                path: "/../etc".into(),
            },
        )
        .await
        .unwrap_err();
    assert_eq!(e.kind, ErrorType::InvalidRequest);

    // A reader mounts it: reads go on, changes are refused naming it.
    let reader = live_sandbox(svc.store(), &ann).await;
    assert_eq!(
        hold(&svc, &ann, &reader, &data.id, true).await,
        sandpit_store::VolumesHeld::Held
    );
    assert_eq!(
        downloaded(&svc, &ann, "data", "/in/put.bin").await.len(),
        1_000_000
    );
    let e = svc
        .volume_files(&ann, "data", VolumeCall::Remove { path: "/in".into() })
        .await
        .unwrap_err();
    assert_eq!(e.kind, ErrorType::Conflict);
    assert!(e.message.contains(&reader), "{e}");
    let e = svc
        .upload_volume_file(
            &ann,
            "data",
            "/x",
            1,
            VolumeOwnership::default(),
            false,
            body(b"x"),
        )
        .await
        .unwrap_err();
    assert_eq!(e.kind, ErrorType::Conflict);
    // A writer mounts it: reads are refused too.
    let writer = live_sandbox(svc.store(), &ann).await;
    assert_eq!(
        hold(&svc, &ann, &writer, &data.id, false).await,
        sandpit_store::VolumesHeld::Held
    );
    let e = svc
        .download_volume_file(&ann, "data", "/in/put.bin")
        .await
        .err()
        .unwrap();
    assert_eq!(e.kind, ErrorType::Conflict);
    assert!(e.message.contains(&writer), "{e}");
    for id in [&reader, &writer] {
        svc.store()
            .finish_sandbox(
                id,
                SandboxStatus::Deleted,
                "test",
                OffsetDateTime::now_utc(),
                0,
                &sandpit_store::Cause::default(),
            )
            .await
            .unwrap();
    }

    // While the host works on its files (a lease, as a call holds it), no
    // sandbox takes the volume, nor is it grown or deleted.
    let until = OffsetDateTime::now_utc() + time::Duration::minutes(1);
    let leased = svc
        .store()
        .lease_volume(&ann.account_id, &data.id, "vlease_test", true, until)
        .await
        .unwrap();
    assert!(
        matches!(leased, sandpit_store::VolumeLeased::Leased(_)),
        "{leased:?}"
    );
    let next = live_sandbox(svc.store(), &ann).await;
    assert!(matches!(
        hold(&svc, &ann, &next, &data.id, true).await,
        sandpit_store::VolumesHeld::Leased { .. }
    ));
    let e = svc.delete_volume(&ann, "data").await.unwrap_err();
    assert_eq!(e.kind, ErrorType::Conflict);
    svc.store().end_volume_lease("vlease_test").await.unwrap();
    assert_eq!(
        hold(&svc, &ann, &next, &data.id, true).await,
        sandpit_store::VolumesHeld::Held
    );
}
