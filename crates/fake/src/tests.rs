use super::*;
use sandpit_core::prelude::*;

fn a() -> Caller {
    Caller::new(ACCOUNT_A, "test")
}

fn run(command: &str) -> ExecParams {
    ExecParams {
        command: command.into(),
        ..Default::default()
    }
}

async fn events(mut s: ExecStream) -> Vec<ExecEvent> {
    let mut all = Vec::new();
    while let Some(e) = s.next().await {
        all.push(e);
    }
    all
}

#[tokio::test]
async fn exec_is_the_stream_collected_and_both_are_kept() {
    let f = Fake::new();
    let (s, _) = f
        .create_sandbox(&a(), Default::default(), None)
        .await
        .unwrap();
    let streamed = events(f.exec_stream(&a(), &s.id, run("make")).await.unwrap()).await;
    let [ExecEvent::Started(started), ExecEvent::Stdout(o1), ExecEvent::Stderr(e1), ExecEvent::Stdout(o2), ExecEvent::Exit(x)] =
        &streamed[..]
    else {
        panic!("{streamed:?}")
    };
    assert_eq!(
        (started.id.as_str(), started.status),
        (x.id.as_str(), ExecutionStatus::Running)
    );
    assert_eq!(
        (x.stdout.clone(), x.stderr.clone()),
        (format!("{o1}{o2}"), e1.clone())
    );
    assert_eq!(f.get_execution(&a(), &x.id).await.unwrap(), *x);
    let y = f.exec(&a(), &s.id, run("make")).await.unwrap();
    assert_eq!(
        (&y.stdout, &y.stderr, y.status),
        (&x.stdout, &x.stderr, x.status)
    );
    assert_ne!(y.id, x.id);
    assert_eq!(
        f.call_names(),
        ["create_sandbox", "exec_stream", "get_execution", "exec"]
    );
    assert_eq!(f.last_exec(), Some(run("make")));

    let t = f.exec(&a(), &s.id, run("sleep 61")).await.unwrap();
    assert_eq!(t.status, ExecutionStatus::TimedOut);
    let e = f.exec(&a(), &s.id, run("crash")).await.unwrap_err();
    assert_eq!(e.kind, ErrorType::ServiceUnavailable);
    let e = f.exec(&a(), &s.id, run("vanish")).await.unwrap_err();
    assert_eq!(e.kind, ErrorType::InternalError);
    let e = f.exec(&a(), &s.id, run(" ")).await.unwrap_err();
    assert_eq!(
        e.kind,
        ErrorType::InvalidRequest,
        "the service's own checks"
    );
}

#[tokio::test]
async fn a_dropped_stream_cancels_its_command() {
    let f = Fake::new();
    let s = f.add_sandbox(ACCOUNT_A, "sbx_here");
    let mut st = f.exec_stream(&a(), &s.id, run("hang")).await.unwrap();
    assert!(matches!(st.next().await, Some(ExecEvent::Started(_))));
    assert_eq!(st.next().await, Some(ExecEvent::Stdout("started\n".into())));
    assert_eq!(f.cancelled(), 0);
    drop(st);
    f.wait_cancelled(1, Duration::from_secs(5)).await;
    let kept = f
        .state
        .lock()
        .unwrap()
        .executions
        .values()
        .next()
        .unwrap()
        .1
        .clone();
    assert_eq!(kept.status, ExecutionStatus::Cancelled);
}

#[tokio::test]
async fn files_are_a_tree_with_directories() {
    let f = Fake::new();
    let s = f.add_sandbox(ACCOUNT_A, "sbx_here");
    let write = |path: &str| WriteFile {
        path: path.into(),
        content: "x".into(),
        encoding: None,
    };
    f.write_file(&a(), &s.id, write("d/e/f.txt")).await.unwrap();
    f.write_file(&a(), &s.id, write("/workspace/g"))
        .await
        .unwrap();
    let names = |l: FileList| -> Vec<(String, EntryType)> {
        l.entries.into_iter().map(|e| (e.name, e.kind)).collect()
    };
    let top = f.list_files(&a(), &s.id, None, false).await.unwrap();
    assert_eq!(top.path, "/workspace");
    assert_eq!(
        names(top),
        [("d".into(), EntryType::Dir), ("g".into(), EntryType::File)]
    );
    let all = f.list_files(&a(), &s.id, Some("d"), true).await.unwrap();
    assert_eq!(
        names(all),
        [
            ("e".into(), EntryType::Dir),
            ("e/f.txt".into(), EntryType::File)
        ]
    );
    let e = f.write_file(&a(), &s.id, write("g/h")).await.unwrap_err();
    assert_eq!(e.kind, ErrorType::InvalidRequest);
    let e = f.delete_file(&a(), &s.id, "d", false).await.unwrap_err();
    assert!(e.message.contains("recursive"), "{e}");
    f.delete_file(&a(), &s.id, "d", true).await.unwrap();
    let e = f
        .read_file(&a(), &s.id, "d/e/f.txt", Encoding::Utf8)
        .await
        .unwrap_err();
    assert_eq!(e.kind, ErrorType::NotFound);
}

fn b() -> Caller {
    Caller::new(ACCOUNT_B, "test")
}

async fn read(f: &Fake, id: &str, path: &str) -> Result<String> {
    Ok(f.read_file(&a(), id, path, Encoding::Utf8).await?.content)
}

async fn write(f: &Fake, id: &str, path: &str, content: &str) {
    let req = WriteFile {
        path: path.into(),
        content: content.into(),
        encoding: None,
    };
    f.write_file(&a(), id, req).await.unwrap();
}

#[tokio::test]
async fn snapshots_copy_the_file_tree_and_restore_puts_it_back() {
    let f = Fake::new();
    let s = f.add_sandbox(ACCOUNT_A, "sbx_here");
    write(&f, &s.id, "d/state.txt", "before").await;
    let named = CreateSnapshot {
        name: Some("clean".into()),
    };
    let (snap, replayed) = f
        .snapshot_sandbox(&a(), &s.id, named.clone(), Some("k".into()))
        .await
        .unwrap();
    assert!(!replayed);
    assert!(snap.id.starts_with("snap_"), "{}", snap.id);
    assert_eq!(
        (
            snap.status.as_str(),
            snap.size_bytes,
            snap.sandbox_id.as_str()
        ),
        ("ready", 6, "sbx_here")
    );
    assert_eq!(snap.expires_at, "2026-01-08T00:00:00Z");
    let (again, replayed) = f
        .snapshot_sandbox(&a(), &s.id, named, Some("k".into()))
        .await
        .unwrap();
    assert!(replayed);
    assert_eq!(again, snap);
    let e = f
        .snapshot_sandbox(&a(), &s.id, CreateSnapshot::default(), Some("k".into()))
        .await
        .unwrap_err();
    assert_eq!(e.kind, ErrorType::Conflict);

    // A change, undone.
    write(&f, &s.id, "d/state.txt", "after").await;
    write(&f, &s.id, "new.txt", "x").await;
    let req = RestoreSandbox {
        snapshot_id: snap.id.clone(),
    };
    let back = f.restore_sandbox(&a(), &s.id, req.clone()).await.unwrap();
    assert_eq!(back.id, s.id);
    assert_eq!(read(&f, &s.id, "d/state.txt").await.unwrap(), "before");
    assert_eq!(
        read(&f, &s.id, "new.txt").await.unwrap_err().kind,
        ErrorType::NotFound
    );

    // A new sandbox from it starts with its files, at its size.
    let from = CreateSandbox {
        snapshot_id: Some(snap.id.clone()),
        ..Default::default()
    };
    let (c, _) = f.create_sandbox(&a(), from.clone(), None).await.unwrap();
    assert_eq!(read(&f, &c.id, "d/state.txt").await.unwrap(), "before");
    let e = f
        .create_sandbox(
            &a(),
            CreateSandbox {
                size: Some("large".into()),
                ..from
            },
            None,
        )
        .await
        .unwrap_err();
    assert_eq!(e.kind, ErrorType::InvalidRequest, "{e}");
    // ... which it may be restored to, being started from it.
    write(&f, &c.id, "d/state.txt", "child").await;
    f.restore_sandbox(&a(), &c.id, req.clone()).await.unwrap();
    assert_eq!(read(&f, &c.id, "d/state.txt").await.unwrap(), "before");
    // A snapshot of the child is no ancestor of its parent.
    let (child_snap, _) = f
        .snapshot_sandbox(&a(), &c.id, CreateSnapshot::default(), None)
        .await
        .unwrap();
    let e = f
        .restore_sandbox(
            &a(),
            &s.id,
            RestoreSandbox {
                snapshot_id: child_snap.id.clone(),
            },
        )
        .await
        .unwrap_err();
    assert_eq!(e.kind, ErrorType::InvalidRequest, "{e}");

    // Another account sees none of it.
    for e in [
        f.get_snapshot(&b(), &snap.id).await.unwrap_err(),
        f.delete_snapshot(&b(), &snap.id).await.unwrap_err(),
        f.create_sandbox(
            &b(),
            CreateSandbox {
                snapshot_id: Some(snap.id.clone()),
                ..Default::default()
            },
            None,
        )
        .await
        .unwrap_err(),
    ] {
        assert_eq!(e.kind, ErrorType::NotFound, "{e}");
    }
    assert!(f
        .list_snapshots(&b(), ListSnapshots::default())
        .await
        .unwrap()
        .data
        .is_empty());

    // Newest first, paged; a deleted one is listed no more.
    let page = f
        .list_snapshots(
            &a(),
            ListSnapshots {
                limit: Some(1),
                starting_after: None,
            },
        )
        .await
        .unwrap();
    assert_eq!(page.data[0].id, child_snap.id);
    assert_eq!(page.next_cursor.as_deref(), Some(child_snap.id.as_str()));
    let gone = f.delete_snapshot(&a(), &snap.id).await.unwrap();
    assert_eq!(gone.status, "deleted");
    let all = f
        .list_snapshots(&a(), ListSnapshots::default())
        .await
        .unwrap();
    assert_eq!(all.data, std::slice::from_ref(&child_snap));
    // Deleted, it is not found, like a missing one.
    for e in [
        f.get_snapshot(&a(), &snap.id).await.unwrap_err(),
        f.delete_snapshot(&a(), &snap.id).await.unwrap_err(),
        f.restore_sandbox(&a(), &s.id, req).await.unwrap_err(),
    ] {
        assert_eq!(e.kind, ErrorType::NotFound, "{e}");
    }
    // The child still descends from it: its own snapshot restores it.
    let to_child = RestoreSandbox {
        snapshot_id: child_snap.id,
    };
    f.restore_sandbox(&a(), &c.id, to_child).await.unwrap();
}

#[tokio::test]
async fn a_fork_is_a_snapshot_and_its_copies() {
    let f = Fake::new();
    let s = f.add_sandbox(ACCOUNT_A, "sbx_here");
    write(&f, &s.id, "a.txt", "shared").await;
    let fork = f
        .fork_sandbox(
            &a(),
            &s.id,
            ForkSandbox {
                count: Some(3),
                timeout_minutes: Some(30),
            },
        )
        .await
        .unwrap();
    assert_eq!(fork.snapshot.sandbox_id, s.id);
    assert_eq!(fork.sandboxes.len(), 3);
    for c in &fork.sandboxes {
        assert_ne!(c.id, s.id);
        assert_eq!((c.size.as_str(), c.timeout_minutes), ("small", 30));
        assert_eq!(read(&f, &c.id, "a.txt").await.unwrap(), "shared");
    }
    // The copies are copies: a write to one is in no other.
    write(&f, &fork.sandboxes[0].id, "a.txt", "mine").await;
    assert_eq!(read(&f, &s.id, "a.txt").await.unwrap(), "shared");
    assert_eq!(
        read(&f, &fork.sandboxes[1].id, "a.txt").await.unwrap(),
        "shared"
    );
    for count in [0, 11] {
        let e = f
            .fork_sandbox(
                &a(),
                &s.id,
                ForkSandbox {
                    count: Some(count),
                    timeout_minutes: None,
                },
            )
            .await
            .unwrap_err();
        assert_eq!(e.kind, ErrorType::InvalidRequest, "{e}");
        assert!(e.message.contains("count"), "{e}");
    }
    let e = f
        .fork_sandbox(&b(), &s.id, ForkSandbox::default())
        .await
        .unwrap_err();
    assert_eq!(e.kind, ErrorType::NotFound);
    f.destroy_sandbox(&a(), &s.id).await.unwrap();
    let e = f
        .fork_sandbox(&a(), &s.id, ForkSandbox::default())
        .await
        .unwrap_err();
    assert_eq!(e.kind, ErrorType::Conflict);
}

#[tokio::test]
async fn faults_come_once_in_order_after_the_call_is_recorded() {
    let f = Fake::new();
    f.fail_next("usage", CoreError::internal("one"));
    f.fail_next("usage", CoreError::internal("two"));
    assert_eq!(f.usage(&a(), None).await.unwrap_err().message, "one");
    assert_eq!(f.usage(&a(), None).await.unwrap_err().message, "two");
    assert!(f.usage(&a(), None).await.is_ok());
    assert_eq!(f.calls().len(), 3);
    assert!(f.calls().iter().all(|c| c.account_id == ACCOUNT_A));
}
