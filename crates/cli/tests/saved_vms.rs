//! A running VM saved whole and VMs started from the save, for real: the
//! same machine (files, a process whose state is only in memory), an
//! identity of its own, independent of the VM it came from, and a save that
//! keeps only the memory the guest changed.

mod common;

use common::*;
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

#[test]
fn a_vm_started_from_a_save_is_the_same_machine_with_its_own_identity() {
    let m = manager();
    rt().block_on(async {
        m.ensure_template("small").await.expect("template");
        let a = m.create(new_vm("sbx_saved_a")).await.expect("restore a");
        // State in a file, and state only in a process's memory: the
        // counter lives in the shell's variable; the file only shows it
        // (replaced whole, so a reader never sees it empty).
        sh(&a, "echo kept > /workspace/file && sync").await;
        sh(
            &a,
            "nohup bash -c 'i=0; while :; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; sleep 0.1; done' \
             >/dev/null 2>&1 & sleep 0.5",
        )
        .await;
        // 64 MiB of memory the guest changed.
        sh(&a, "head -c 64M /dev/urandom > /dev/shm/blob").await;

        let dir = data_dir().join("saves-test");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let at_save = count(&a).await;
        let t = Instant::now();
        let saved = m.save("sbx_saved_a", &dir.join("one")).await.expect("save");
        let took = t.elapsed();
        eprintln!(
            "saved in {took:?}: {} changed pages, {} MiB on disk",
            saved.record.changed_pages,
            saved.bytes() >> 20
        );
        // The VM runs on.
        let later = count(&a).await;
        assert!(
            later >= at_save,
            "the counter went back: {at_save} -> {later}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(count(&a).await > later, "the saved VM stopped counting");

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
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(
            count(&b).await > resumed,
            "the restored process does not run"
        );
        assert_eq!(
            sh(&b, "sha256sum < /dev/shm/blob").await,
            sh(&a, "sha256sum < /dev/shm/blob").await
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
        // A second save of the same VM, and a VM from it.
        let again = m
            .save("sbx_saved_a", &dir.join("two"))
            .await
            .expect("save 2");
        let c = m
            .create_from_saved(new_vm("sbx_saved_c"), &again)
            .await
            .expect("start from the second save");
        assert_eq!(sh(&c, "cat /workspace/only-a").await, "a");
        sh(&c, "test ! -e /workspace/only-b").await;

        for id in ["sbx_saved_a", "sbx_saved_b", "sbx_saved_c"] {
            m.destroy(id).await.unwrap();
        }
        // The saves outlive the VM they came from.
        let d = m
            .create_from_saved(new_vm("sbx_saved_d"), &saved)
            .await
            .expect("start from the save after its VM is gone");
        assert_eq!(sh(&d, "cat /workspace/file").await, "kept");
        m.destroy("sbx_saved_d").await.unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    });
}
