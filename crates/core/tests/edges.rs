//! Every call answers, whatever its size and whatever the guest does: a
//! real VM, inputs nobody sent before, a guest that fills a directory with
//! more names than one answer can carry, and a guest that stops answering.

use sandpit_core::{CreateSandbox, ErrorType, ExecutionStatus, SandboxApi};
use std::time::{Duration, Instant};

mod common;

use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_input_a_huge_listing_and_a_frozen_guest_all_get_answers() {
    let (svc, _dir) = service().await;
    let me = account(&svc, "edgy", 1.0).await;
    let (sbx, _) = svc
        .create_sandbox(&me, CreateSandbox::default(), None)
        .await
        .unwrap();
    let id = sbx.id.as_str();

    // A 2 MB command: refused at once, with the limit, and nothing recorded.
    let huge = format!("echo {}", "x".repeat(2 * 1024 * 1024));
    let e = svc.exec(&me, id, cmd(&huge)).await.unwrap_err();
    assert_eq!(e.kind, ErrorType::InvalidRequest, "{e}");
    assert!(e.message.contains("131071"), "{e}");
    // The longest command the guest can run is run.
    let ys = 128 * 1024 - 1 - "echo  | wc -c".len();
    let longest = format!("echo {} | wc -c", "y".repeat(ys));
    assert_eq!(longest.len(), 131071);
    let ex = svc.exec(&me, id, cmd(&longest)).await.unwrap();
    assert_eq!(
        (ex.status, ex.stdout.trim()),
        (ExecutionStatus::Completed, (ys + 1).to_string().as_str()),
        "{ex:?}"
    );
    // Env: one variable over the limit, and all of them over theirs.
    let mut p = cmd("true");
    p.env = Some([("BIG".to_string(), "z".repeat(200_000))].into());
    let e = svc.exec(&me, id, p).await.unwrap_err();
    assert_eq!(e.kind, ErrorType::InvalidRequest, "{e}");
    let mut p = cmd("true");
    p.env = Some(
        (0..8)
            .map(|i| (format!("V{i}"), "z".repeat(100_000)))
            .collect(),
    );
    let e = svc.exec(&me, id, p).await.unwrap_err();
    assert_eq!(e.kind, ErrorType::InvalidRequest, "{e}");

    // 12,000 files with 100-character names: more than one answer can hold.
    let made = svc
        .exec(
            &me,
            id,
            cmd("mkdir -p many && cd many && python3 -c \"\nfor i in range(12000):\n    open('%06d' % i + 'n' * 94, 'w').close()\" && ls | wc -l"),
        )
        .await
        .unwrap();
    assert_eq!(made.stdout.trim(), "12000", "{made:?}");
    for recursive in [true, false] {
        let list = svc
            .list_files(&me, id, Some("many"), recursive)
            .await
            .unwrap();
        assert!(
            list.truncated,
            "a listing of 12,000 long names is marked truncated"
        );
        assert!(list.entries.len() > 1000, "{} entries", list.entries.len());
        assert!(list.entries.iter().all(|e| e.name.len() == 100));
        // In order, from the start: the first ones.
        assert!(list.entries[0].name.starts_with("000000"));
    }

    // A guest that stops answering (its QEMU stopped): the call fails by its
    // own deadline, typed, and the sandbox works again once the guest does.
    let qemu = svc.vm_record(id).unwrap().qemu_pid;
    // SAFETY: stopping and continuing the test's own VM.
    unsafe { libc::kill(qemu as i32, libc::SIGSTOP) };
    let started = Instant::now();
    let e = svc.list_files(&me, id, None, true).await.unwrap_err();
    let waited = started.elapsed();
    unsafe { libc::kill(qemu as i32, libc::SIGCONT) };
    assert_eq!(e.kind, ErrorType::ServiceUnavailable, "{e}");
    assert!(e.message.contains("did not answer"), "{e}");
    assert!(waited < Duration::from_secs(120), "{waited:?}");
    let ex = svc.exec(&me, id, cmd("echo back")).await.unwrap();
    assert_eq!(ex.stdout, "back\n");
    svc.destroy_sandbox(&me, id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_executions_are_held_to_the_accounts_budget_and_dropped_after_the_end() {
    const BUDGET: u64 = 1024 * 1024;
    let (svc, _dir) = service_with(sandpit_core::backend::PoolConfig::none(), |c| {
        c.execution_storage_bytes = BUDGET;
        c.execution_retention_days = 0;
    })
    .await;
    let me = account(&svc, "chatty", 1.0).await;
    let (sbx, _) = svc
        .create_sandbox(&me, CreateSandbox::default(), None)
        .await
        .unwrap();
    let id = sbx.id.as_str();
    // Six commands of 300 KB of output each: 1.8 MB, over a 1 MiB budget.
    let mut execs = Vec::new();
    for _ in 0..6 {
        let ex = svc
            .exec(&me, id, cmd("head -c 300000 /dev/zero | tr '\\0' y"))
            .await
            .unwrap();
        assert_eq!(ex.stdout.len(), 300_000);
        execs.push(ex.id);
    }
    let used = svc.store().execution_bytes(&me.account_id).await.unwrap();
    assert!(used <= BUDGET, "{used} bytes stored, over the budget");
    // The oldest went, the newest three are kept whole.
    for (i, e) in execs.iter().enumerate() {
        match svc.get_execution(&me, e).await {
            Ok(ex) => {
                assert!(i >= 3, "execution {i} is still stored");
                assert_eq!(ex.stdout.len(), 300_000);
            }
            Err(err) => {
                assert!(i < 3, "execution {i} was deleted: {err}");
                assert_eq!(err.kind, ErrorType::NotFound, "{err}");
            }
        }
    }
    // Once the sandbox ended, a sweep past the retention drops the rest.
    svc.destroy_sandbox(&me, id).await.unwrap();
    assert_eq!(svc.drop_old_executions().await.unwrap(), 3);
    let e = svc.get_execution(&me, &execs[5]).await.unwrap_err();
    assert_eq!(e.kind, ErrorType::NotFound, "{e}");
    assert_eq!(
        svc.store().execution_bytes(&me.account_id).await.unwrap(),
        0
    );
}
