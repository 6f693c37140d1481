//! A running VM saved whole and VMs started from the save, for real: the
//! same machine (files, a process whose state is only in memory), an
//! identity of its own, independent of the VM it came from, a save that
//! keeps only the memory the guest changed, disks that outlive the saves
//! they were frozen in, and nothing left once VMs and saves are gone.

use sandpit_vmtest::*;
use std::time::{Duration, Instant};

fn rt() -> tokio::runtime::Runtime {
    let _ = tracing_subscriber::fmt()
        .with_env_filter("sandpit_runtime=debug")
        .with_test_writer()
        .try_init();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap()
}

async fn count(vm: &sandpit_runtime::Vm) -> u64 {
    sh(vm, "cat /tmp/count").await.parse().unwrap()
}

/// Whether the guest's counter goes past `from` within 20 s: it ticks
/// every 100 ms of the guest's time, but a guest under software emulation
/// on a loaded host can get little of the host's (CI once saw 500 ms pass
/// with no tick), so a stopped process is told from a slow one by a
/// deadline, not by one look.
async fn counts_past(vm: &sandpit_runtime::Vm, from: u64) -> bool {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if count(vm).await > from {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The SHA-256 of a guest file read from its disk, not its page cache.
async fn disk_sha(vm: &sandpit_runtime::Vm, file: &str) -> String {
    sh(
        vm,
        &format!("dd if={file} iflag=direct bs=1M status=none | sha256sum"),
    )
    .await
}

/// The guest writes a new file and reads it back from its disk.
async fn write_and_read(vm: &sandpit_runtime::Vm) {
    let written = sh(
        vm,
        "head -c 1M /dev/urandom > /workspace/new && sync && sha256sum < /workspace/new",
    )
    .await;
    assert_eq!(disk_sha(vm, "/workspace/new").await, written);
}

/// The guest RAM a QEMU holds of its own (copied, not shared with the
/// file its RAM maps): the anonymous memory of its largest mapping.
fn anonymous_kib(pid: u32) -> u64 {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap();
    let field = |l: &str, name: &str| -> Option<u64> {
        let v = l.strip_prefix(name)?.trim().strip_suffix("kB")?;
        v.trim().parse().ok()
    };
    let (mut size, mut largest, mut anon) = (0, 0, 0);
    for l in smaps.lines() {
        if let Some(s) = field(l, "Size:") {
            size = s;
        } else if let Some(a) = field(l, "Anonymous:") {
            if size > largest {
                (largest, anon) = (size, a);
            }
        }
    }
    assert!(largest >= 256 << 10, "no guest RAM mapping in QEMU {pid}");
    anon
}

fn files_in(dir: &std::path::Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().to_string())
        .collect();
    v.sort();
    v
}

/// Disk layers and saved RAM files in the layers directory.
fn layers_in(data: &std::path::Path) -> (usize, usize) {
    let files = files_in(&data.join("layers"));
    let disks = files.iter().filter(|f| f.ends_with(".qcow2")).count();
    let rams = files.iter().filter(|f| f.ends_with(".ram")).count();
    assert_eq!(disks + rams, files.len(), "{files:?}");
    (disks, rams)
}

#[test]
fn a_vm_started_from_a_save_is_the_same_machine_with_its_own_identity() {
    let data = data_dir();
    let m = manager_with(config(&data));
    rt().block_on(async {
        m.ensure_template("small").await.expect("template");
        let a = m.create(new_vm("sbx_saved_a")).await.expect("restore a");
        // State in a file, and state only in a process's memory: the
        // counter lives in the shell's variable; the file only shows it
        // (replaced whole, so a reader never sees it empty).
        sh(&a, "echo kept > /workspace/file && sync").await;
        // 20 MB on disk, read back later past the page cache.
        sh(&a, "head -c 20M /dev/urandom > /workspace/big && sync").await;
        let big = disk_sha(&a, "/workspace/big").await;
        sh(
            &a,
            "nohup bash -c 'i=0; while :; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; sleep 0.1; done' \
             >/dev/null 2>&1 & sleep 0.5",
        )
        .await;
        // 64 MiB of memory the guest changed.
        sh(&a, "head -c 64M /dev/urandom > /dev/shm/blob").await;

        let at_save = count(&a).await;
        let t = Instant::now();
        let saved = m.save("sbx_saved_a", "one", sandpit_runtime::AfterSave::Run).await.expect("save");
        let took = t.elapsed();
        eprintln!(
            "saved in {took:?}: {} changed pages, {} MiB on disk",
            saved.record.changed_pages,
            saved.bytes() >> 20
        );
        assert_eq!(m.list_saved(), ["one"]);
        assert_eq!(m.saved("one").expect("saved").record.layer, saved.record.layer);
        // The VM runs on.
        let later = count(&a).await;
        assert!(
            later >= at_save,
            "the counter went back: {at_save} -> {later}"
        );
        assert!(counts_past(&a, later).await, "the saved VM stopped counting");

        let t = Instant::now();
        let b = m
            .create_from_saved(new_vm("sbx_saved_b"), &saved)
            .await
            .expect("start from the save");
        eprintln!("started from the save in {:?}", t.elapsed());
        assert_eq!(sh(&b, "cat /workspace/file").await, "kept");
        let resumed = count(&b).await;
        assert!(
            resumed >= at_save && resumed < at_save + 50,
            "the counter should go on from {at_save}, it is at {resumed}"
        );
        assert!(
            counts_past(&b, resumed).await,
            "the restored process does not run"
        );
        assert_eq!(
            sh(&b, "sha256sum < /dev/shm/blob").await,
            sh(&a, "sha256sum < /dev/shm/blob").await
        );
        // b read the 64 MiB it did not write from the save's RAM image,
        // shared by every VM started from the save: none of it was copied
        // into b's own memory (where the host can mount the image, as
        // here: see `ram_image`).
        let own = anonymous_kib(b.record.qemu_pid);
        eprintln!("the VM from the save holds {own} KiB of its own");
        assert!(
            own < 32 << 10,
            "b's QEMU holds {own} KiB of its own memory: its save's pages were copied into it \
             (mapping the save's image needs root and Linux 6.12 or later with EROFS)"
        );
        // Its own identity, and its own disk.
        assert_eq!(sh(&b, "hostname").await, "sbx-saved-b");
        assert_ne!(
            sh(&a, "cat /etc/machine-id").await,
            sh(&b, "cat /etc/machine-id").await
        );
        sh(&b, "echo b > /workspace/only-b && sync").await;
        sh(&a, "test ! -e /workspace/only-b").await;
        sh(&a, "echo a > /workspace/only-a && sync").await;
        sh(&b, "test ! -e /workspace/only-a").await;

        // A save keeps what the guest changed, not the template's memory.
        assert!(
            saved.bytes() < 200 << 20,
            "the save takes {} MiB",
            saved.bytes() >> 20
        );
        // A name taken, or no name: refused, and the VM runs on untouched.
        assert!(m.save("sbx_saved_a", "one", sandpit_runtime::AfterSave::Run).await.is_err());
        assert!(m.save("sbx_saved_a", "../one", sandpit_runtime::AfterSave::Run).await.is_err());
        assert_eq!(files_in(&data.join("saves")), ["one"]);
        assert_eq!(layers_in(&data), (1, 1), "a disk layer and a RAM file");
        // Guest memory no QEMU may read: root's alone.
        {
            use std::os::unix::fs::PermissionsExt;
            let ram = data.join("layers").join(saved.record.ram.as_ref().expect("a RAM file"));
            let mode = std::fs::metadata(&ram).expect("the RAM file").permissions().mode();
            assert_eq!(mode & 0o777, 0o600, "{}", ram.display());
        }
        let later = count(&a).await;
        assert!(counts_past(&a, later).await, "a refused save stopped the VM");

        // A second save of the same VM, and a VM from it. It stands on
        // the first: it holds only the pages changed since.
        let again = m.save("sbx_saved_a", "two", sandpit_runtime::AfterSave::Run).await.expect("save 2");
        eprintln!(
            "saved again: {} changed pages, {} KiB on disk",
            again.record.changed_pages,
            again.bytes() >> 10
        );
        assert!(again.record.changed_pages >= saved.record.changed_pages * 9 / 10);
        assert!(
            again.bytes() < saved.bytes() / 4,
            "the second save takes {} KiB, the first {} KiB",
            again.bytes() >> 10,
            saved.bytes() >> 10
        );
        let c = m
            .create_from_saved(new_vm("sbx_saved_c"), &again)
            .await
            .expect("start from the second save");
        assert_eq!(sh(&c, "cat /workspace/only-a").await, "a");
        sh(&c, "test ! -e /workspace/only-b").await;

        // The first save goes while a and c, whose disks stand on its
        // layer, run: both still read what was on it and write.
        m.delete_saved("one").await.expect("delete save 1");
        m.delete_saved("one").await.expect("a save gone is deleted");
        assert_eq!(m.list_saved(), ["two"]);
        assert!(m.saved("one").is_err());
        assert_eq!(
            layers_in(&data),
            (2, 2),
            "the second save's layer and RAM stand on the first's"
        );
        // A manager starting on the data directory removes what a save
        // that died left, and a layer nothing names, not the layers in use.
        std::fs::create_dir(data.join("saves/.dead.0.tmp")).unwrap();
        let stray = data.join(format!("layers/{}.qcow2", "0".repeat(32)));
        std::fs::write(&stray, b"").unwrap();
        drop(manager_with(config(&data)));
        assert_eq!(files_in(&data.join("saves")), ["two"]);
        assert!(!stray.exists());
        assert_eq!(layers_in(&data), (2, 2));
        for vm in [&a, &c] {
            assert_eq!(disk_sha(vm, "/workspace/big").await, big);
            write_and_read(vm).await;
        }
        // A new VM from the second save opens its whole chain by name.
        let e = m
            .create_from_saved(new_vm("sbx_saved_e"), &m.saved("two").expect("save 2"))
            .await
            .expect("start from the second save after the first is deleted");
        assert_eq!(disk_sha(&e, "/workspace/big").await, big);
        assert_eq!(sh(&e, "cat /workspace/only-a").await, "a");
        write_and_read(&e).await;

        for id in ["sbx_saved_a", "sbx_saved_b", "sbx_saved_c", "sbx_saved_e"] {
            m.destroy(id).await.unwrap();
        }
        // The saves outlive the VM they came from.
        let d = m
            .create_from_saved(new_vm("sbx_saved_d"), &again)
            .await
            .expect("start from the save after its VM is gone");
        assert_eq!(sh(&d, "cat /workspace/file").await, "kept");
        m.destroy("sbx_saved_d").await.unwrap();
        assert_eq!(layers_in(&data), (2, 2));
        m.delete_saved("two").await.expect("delete save 2");

        // Nothing leaked.
        assert!(m.list_saved().is_empty());
        for dir in ["vms", "saves", "layers"] {
            assert_eq!(files_in(&data.join(dir)), Vec::<String>::new(), "{dir}");
        }
    });
}
