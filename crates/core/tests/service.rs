//! The core service against real VMs and a real SQLite file: the agent flow,
//! billing and refunds, isolation between accounts, credit that concurrent
//! creates can never overdraw, and expiry while the service runs.

use sandpit_core::prelude::*;
use sandpit_core::{
    CreateSandbox, Encoding, ErrorType, ExecEvent, ExecutionStatus, ListExecutions, ListSandboxes,
    SandboxStatus, WriteFile,
};
use std::time::Duration;

mod common;

use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_flow_and_its_bill() {
    let (svc, _dir) = service().await;
    let me = account(&svc, "alice", 1.0).await;
    let (sbx, replay) = svc
        .create_sandbox(
            &me,
            CreateSandbox {
                name: Some("flow".into()),
                ..Default::default()
            },
            None,
        )
        .await
        .unwrap();
    assert!(!replay);
    assert_eq!(sbx.status, SandboxStatus::Running);
    assert_eq!(sbx.timeout_minutes, 15);
    assert!(sbx.ready_at.is_some());
    // 15 minutes of small ($0.09/h) are reserved: $0.0225.
    let acct = svc.account(&me).await.unwrap();
    assert!(
        (acct.credit_remaining_usd - 0.9775).abs() < 1e-9,
        "{acct:?}"
    );

    svc.write_file(
        &me,
        &sbx.id,
        WriteFile {
            path: "job.py".into(),
            content: "import json\nopen('out.json','w').write(json.dumps({'sum': sum(range(10))}))\nprint('done')\n".into(),
            encoding: None,
        },
    )
    .await
    .unwrap();
    let ex = svc.exec(&me, &sbx.id, cmd("python3 job.py")).await.unwrap();
    assert_eq!(ex.status, ExecutionStatus::Completed);
    assert_eq!(ex.exit_code, Some(0));
    assert_eq!(ex.stdout, "done\n");
    assert_eq!(svc.get_execution(&me, &ex.id).await.unwrap(), ex);
    let out = svc
        .read_file(&me, &sbx.id, "out.json", Encoding::Utf8)
        .await
        .unwrap();
    assert_eq!(out.content, "{\"sum\": 45}");
    let list = svc.list_files(&me, &sbx.id, None, true).await.unwrap();
    let names: Vec<_> = list.entries.iter().map(|e| e.name.as_str()).collect();
    assert!(
        names.contains(&"job.py") && names.contains(&"out.json"),
        "{names:?}"
    );

    // Streaming: first the execution as it starts, which its id finds as
    // running while it runs; then output as events, then the execution.
    let mut s = svc
        .exec_stream(
            &me,
            &sbx.id,
            cmd("while [ ! -e go ]; do sleep 0.1; done; echo one; echo two >&2"),
        )
        .await
        .unwrap();
    let Some(ExecEvent::Started(started)) = s.next().await else {
        panic!("the first event is not the start");
    };
    assert_eq!(started.status, ExecutionStatus::Running);
    assert!(started.id.starts_with("exec_"), "{started:?}");
    let meanwhile = svc.get_execution(&me, &started.id).await.unwrap();
    assert_eq!(meanwhile.status, ExecutionStatus::Running, "{meanwhile:?}");
    let touch = svc.exec(&me, &sbx.id, cmd("touch go")).await.unwrap();
    let (mut so, mut se, mut exit) = (String::new(), String::new(), None);
    while let Some(ev) = s.next().await {
        match ev {
            ExecEvent::Started(e) => panic!("a second start: {e:?}"),
            ExecEvent::Stdout(t) => so += &t,
            ExecEvent::Stderr(t) => se += &t,
            ExecEvent::Exit(e) => exit = Some(e),
            ExecEvent::Error(e) => panic!("{e}"),
        }
    }
    assert_eq!((so.as_str(), se.as_str()), ("one\n", "two\n"));
    let exit = exit.unwrap();
    assert_eq!(exit.status, ExecutionStatus::Completed);
    assert_eq!(exit.id, started.id);
    // The sandbox's executions, newest first: the `touch`, then the stream.
    let listed = svc
        .list_executions(&me, &sbx.id, ListExecutions::default())
        .await
        .unwrap();
    assert_eq!(listed.data[0], touch, "{listed:?}");
    assert_eq!(listed.data[1], exit);

    let ext = svc.extend_sandbox(&me, &sbx.id, Some(10)).await.unwrap();
    assert_eq!(ext.timeout_minutes, 25);
    let too_long = svc
        .extend_sandbox(&me, &sbx.id, Some(1440))
        .await
        .unwrap_err();
    assert_eq!(too_long.kind, ErrorType::InvalidRequest);

    let usage = svc.usage(&me, None).await.unwrap();
    assert_eq!(usage.sandboxes.len(), 1);
    assert_eq!(usage.sandboxes[0].id, sbx.id);

    let gone = svc.destroy_sandbox(&me, &sbx.id).await.unwrap();
    assert_eq!(gone.status, SandboxStatus::Deleted);
    assert_eq!(gone.deleted_reason.as_deref(), Some("destroyed"));
    // Destroying again returns it again.
    assert_eq!(
        svc.destroy_sandbox(&me, &sbx.id).await.unwrap().status,
        SandboxStatus::Deleted
    );
    // The unused reservation came back: only the seconds it lived were charged.
    let usage = svc.usage(&me, None).await.unwrap();
    let spent = usage.total_cost_usd;
    assert!(spent > 0.0 && spent < 0.005, "charged {spent}");
    let acct = svc.account(&me).await.unwrap();
    assert!(
        (acct.credit_remaining_usd - (1.0 - spent)).abs() < 1e-9,
        "{acct:?} vs {spent}"
    );
    // And it is no longer usable.
    let e = svc.exec(&me, &sbx.id, cmd("true")).await.unwrap_err();
    assert_eq!(e.kind, ErrorType::Conflict);
    assert!(svc.vms_on_host().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accounts_cannot_see_each_other() {
    let (svc, _dir) = service().await;
    let a = account(&svc, "a", 1.0).await;
    let b = account(&svc, "b", 1.0).await;
    let (sbx, _) = svc
        .create_sandbox(&a, CreateSandbox::default(), None)
        .await
        .unwrap();
    for e in [
        svc.get_sandbox(&b, &sbx.id).await.unwrap_err(),
        svc.exec(&b, &sbx.id, cmd("true")).await.unwrap_err(),
        svc.destroy_sandbox(&b, &sbx.id).await.unwrap_err(),
        svc.read_file(&b, &sbx.id, "x", Encoding::Utf8)
            .await
            .unwrap_err(),
        svc.extend_sandbox(&b, &sbx.id, None).await.unwrap_err(),
    ] {
        assert_eq!(e.kind, ErrorType::NotFound, "{e}");
    }
    let unknown = svc.get_sandbox(&b, "sbx_doesnotexist").await.unwrap_err();
    assert_eq!(
        unknown.message.replace("sbx_doesnotexist", "X"),
        svc.get_sandbox(&b, &sbx.id)
            .await
            .unwrap_err()
            .message
            .replace(&sbx.id, "X")
    );
    assert!(svc
        .list_sandboxes(&b, ListSandboxes::default())
        .await
        .unwrap()
        .data
        .is_empty());
    svc.destroy_sandbox(&a, &sbx.id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_creates_never_overdraw_the_credit() {
    let (svc, _dir) = service().await;
    // Two 15-minute small sandboxes cost $0.0225 each: $0.05 covers two.
    let me = account(&svc, "thrifty", 0.05).await;
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let svc = svc.clone();
        let me = me.clone();
        tasks.push(tokio::spawn(async move {
            svc.create_sandbox(&me, CreateSandbox::default(), None)
                .await
        }));
    }
    let mut made = Vec::new();
    let mut refused = 0;
    for t in tasks {
        match t.await.unwrap() {
            Ok((s, _)) => made.push(s.id),
            Err(e) => {
                assert_eq!(e.kind, ErrorType::InsufficientCredits, "{e}");
                refused += 1;
            }
        }
    }
    assert_eq!((made.len(), refused), (2, 2));
    let acct = svc.account(&me).await.unwrap();
    assert!(acct.credit_remaining_usd >= 0.0);
    assert!((acct.credit_remaining_usd - 0.005).abs() < 1e-9, "{acct:?}");
    for id in made {
        svc.destroy_sandbox(&me, &id).await.unwrap();
    }
    assert!(svc.account(&me).await.unwrap().credit_remaining_usd > 0.04);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_changes_nothing() {
    let (svc, _dir) = service().await;
    let me = account(&svc, "careful", 1.0).await;
    let bad = [
        CreateSandbox {
            size: Some("huge".into()),
            ..Default::default()
        },
        CreateSandbox {
            timeout_minutes: Some(0),
            ..Default::default()
        },
        CreateSandbox {
            timeout_minutes: Some(1441),
            ..Default::default()
        },
    ];
    for req in bad {
        let e = svc.create_sandbox(&me, req, None).await.unwrap_err();
        assert_eq!(e.kind, ErrorType::InvalidRequest, "{e}");
    }
    assert!((svc.account(&me).await.unwrap().credit_remaining_usd - 1.0).abs() < 1e-9);
    assert!(svc.vms_on_host().is_empty());
    let poor = account(&svc, "poor", 0.0).await;
    let e = svc
        .create_sandbox(&poor, CreateSandbox::default(), None)
        .await
        .unwrap_err();
    assert_eq!(e.kind, ErrorType::InsufficientCredits);
    assert!(e.message.contains("add credit"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotent_creates_return_the_original() {
    let (svc, _dir) = service().await;
    let me = account(&svc, "retry", 1.0).await;
    let req = CreateSandbox {
        name: Some("once".into()),
        ..Default::default()
    };
    let (a, ra) = svc
        .create_sandbox(&me, req.clone(), Some("key-1".into()))
        .await
        .unwrap();
    let (b, rb) = svc
        .create_sandbox(&me, req, Some("key-1".into()))
        .await
        .unwrap();
    assert!(!ra && rb);
    assert_eq!(a.id, b.id);
    let other = CreateSandbox {
        name: Some("twice".into()),
        ..Default::default()
    };
    let e = svc
        .create_sandbox(&me, other, Some("key-1".into()))
        .await
        .unwrap_err();
    assert_eq!(e.kind, ErrorType::Conflict);
    assert_eq!(
        svc.list_sandboxes(&me, ListSandboxes::default())
            .await
            .unwrap()
            .data
            .len(),
        1
    );
    svc.destroy_sandbox(&me, &a.id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_expires_on_time_while_the_service_runs() {
    let (svc, _dir) = service().await;
    let me = account(&svc, "late", 1.0).await;
    // The size's snapshot template is made by its first create, inside that
    // sandbox's lifetime: on a busy host that is most of a minute, so it is
    // made first, by a sandbox of the default lifetime.
    let (first, _) = svc
        .create_sandbox(&me, CreateSandbox::default(), None)
        .await
        .unwrap();
    svc.destroy_sandbox(&me, &first.id).await.unwrap();
    let spent_before = svc.usage(&me, None).await.unwrap().total_cost_usd;
    let (sbx, _) = svc
        .create_sandbox(
            &me,
            CreateSandbox {
                timeout_minutes: Some(1),
                ..Default::default()
            },
            None,
        )
        .await
        .unwrap();
    let expires = sandpit_host::ids::parse_rfc3339(&sbx.expires_at).unwrap();
    loop {
        let s = svc.get_sandbox(&me, &sbx.id).await.unwrap();
        if s.status == SandboxStatus::Deleted {
            assert_eq!(s.deleted_reason.as_deref(), Some("expired"));
            let at = sandpit_host::ids::parse_rfc3339(s.deleted_at.as_deref().unwrap()).unwrap();
            let late = at - expires;
            assert!(
                late <= time::Duration::seconds(2),
                "reaped {late} after expiry"
            );
            break;
        }
        assert!(
            time::OffsetDateTime::now_utc() < expires + time::Duration::seconds(10),
            "not reaped"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert!(svc.vms_on_host().is_empty());
    // Charged for at most its minute.
    let spent = svc.usage(&me, None).await.unwrap().total_cost_usd - spent_before;
    assert!(spent <= 0.0015 + 1e-9, "{spent}");
}

/// Found by the chaos test (`crates/cli/tests/e2e/chaos.rs`): extensions that
/// read the same sandbox at once each stored `timeout + 1` (one lost, both
/// reserved), and one that read a row another had since extended moved the
/// VM's watchdog back before the stored expiry. Eight at once must add
/// eight minutes, in the database and on the VM's watchdog alike. A life
/// shortened then gives back what it will not use, and its watchdog moves
/// back with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extensions_all_count_the_vm_keeps_the_latest_expiry_and_a_shortening_gives_back() {
    let (svc, dir) = service().await;
    let me = account(&svc, "extender", 1.0).await;
    let (sbx, _) = svc
        .create_sandbox(
            &me,
            CreateSandbox {
                // Two: the size's template is made in this lifetime.
                timeout_minutes: Some(2),
                ..Default::default()
            },
            None,
        )
        .await
        .unwrap();
    let extensions: Vec<_> = (0..8)
        .map(|_| {
            let (svc, me, id) = (svc.clone(), me.clone(), sbx.id.clone());
            tokio::spawn(async move { svc.extend_sandbox(&me, &id, Some(1)).await })
        })
        .collect();
    for r in extensions {
        r.await.unwrap().unwrap();
    }
    let s = svc.get_sandbox(&me, &sbx.id).await.unwrap();
    assert_eq!(s.timeout_minutes, 10, "{s:?}");
    let watchdog_lag = |s: &sandpit_core::Sandbox| {
        let expires = sandpit_host::ids::parse_rfc3339(&s.expires_at).unwrap();
        let watchdog: i64 =
            std::fs::read_to_string(dir.path().join("vms").join(&s.id).join("expires"))
                .unwrap()
                .trim()
                .parse()
                .unwrap();
        watchdog - expires.unix_timestamp()
    };
    let lag = watchdog_lag(&s);
    assert!(
        (1..=2).contains(&lag),
        "the VM's watchdog fires {lag} s after the stored expiry"
    );
    // Ten minutes reserved, no more: $0.09/h * 10/60.
    let credit = || async { svc.account(&me).await.unwrap().credit_remaining_usd };
    let left = credit().await;
    assert!((left - (1.0 - 0.015)).abs() < 1e-9, "{left}");

    // Shortened to 5 minutes from its creation (E2B's set_timeout): the
    // five it will not live go back, and the watchdog learns it.
    let short = svc.shorten_sandbox(&me, &sbx.id, 5).await.unwrap();
    assert_eq!(short.timeout_minutes, 5);
    let lag = watchdog_lag(&short);
    assert!(
        (1..=2).contains(&lag),
        "after the shortening the VM's watchdog fires {lag} s after the stored expiry"
    );
    let left = credit().await;
    assert!((left - (1.0 - 0.0075)).abs() < 1e-9, "{left}");
    for not_shorter in [5, 0, 20] {
        let e = svc
            .shorten_sandbox(&me, &sbx.id, not_shorter)
            .await
            .unwrap_err();
        assert_eq!(e.kind, sandpit_core::ErrorType::InvalidRequest, "{e}");
    }
    assert_eq!(
        svc.get_sandbox(&me, &sbx.id).await.unwrap().timeout_minutes,
        5
    );
    svc.destroy_sandbox(&me, &sbx.id).await.unwrap();
}

/// Found by the chaos test: a command running while its sandbox was
/// destroyed saw the VM die and failed the sandbox first, so a destroyed
/// sandbox was recorded as failed and not charged at all; and the command
/// was answered 503 "retry".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destroy_while_commands_run_is_a_destroy_and_is_charged() {
    let (svc, _dir) = service().await;
    let me = account(&svc, "destroyer", 1.0).await;
    for round in 0..3 {
        let (sbx, _) = svc
            .create_sandbox(&me, CreateSandbox::default(), None)
            .await
            .unwrap();
        let running: Vec<_> = (0..4)
            .map(|_| {
                let (svc, me, id) = (svc.clone(), me.clone(), sbx.id.clone());
                tokio::spawn(async move { svc.exec(&me, &id, cmd("sleep 30")).await })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(500)).await;
        let d = svc.destroy_sandbox(&me, &sbx.id).await.unwrap();
        for r in running {
            // Each command ends now; one cut short says its sandbox is gone
            // (409), not "retry" (503), which could not help.
            if let Err(e) = r.await.unwrap() {
                assert_eq!(e.kind, ErrorType::Conflict, "round {round}: {e:?}");
            }
        }
        let s = svc.get_sandbox(&me, &sbx.id).await.unwrap();
        assert_eq!(
            (s.status, s.deleted_reason.as_deref()),
            (SandboxStatus::Deleted, Some("destroyed")),
            "round {round}: {s:?} (destroy answered {d:?})"
        );
        let usage = svc.usage(&me, None).await.unwrap();
        let cost = usage
            .sandboxes
            .iter()
            .find(|u| u.id == sbx.id)
            .unwrap()
            .cost_usd;
        assert!(
            cost > 0.0,
            "round {round}: a destroyed sandbox cost nothing"
        );
    }
}
