//! `RemoteApi` against the router: every trait method round-trips to the
//! same value the fake returns in-process, and errors come back as the same
//! `CoreError`.

use crate::Server;
use sandpit_api::RemoteApi;
use sandpit_core::prelude::*;
use sandpit_core::*;
use sandpit_fake::{KEY_A, KEY_B};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

async fn remote(s: &Server) -> (RemoteApi, Caller) {
    let api = RemoteApi::new(&format!("{}/v1/", s.url)).unwrap();
    let caller = api.authenticate(KEY_A).await.unwrap();
    (api, caller)
}

#[tokio::test]
async fn every_method_round_trips() {
    let s = Server::start().await;
    let (api, me) = remote(&s).await;
    assert_eq!(me.account_id, "acct_a");
    // The in-process view, for comparison.
    let fake: Arc<dyn SandboxApi> = s.fake.clone();
    let local = fake.authenticate(KEY_A).await.unwrap();

    assert_eq!(
        api.service_info().await.unwrap(),
        fake.service_info().await.unwrap()
    );
    assert_eq!(
        api.account(&me).await.unwrap(),
        fake.account(&local).await.unwrap()
    );

    let req = CreateSandbox {
        size: Some("medium".into()),
        name: Some("r".into()),
        timeout_minutes: Some(20),
        ..CreateSandbox::default()
    };
    let (sbx, replayed) = api
        .create_sandbox(&me, req.clone(), Some("idem-1".into()))
        .await
        .unwrap();
    assert!(!replayed);
    assert_eq!(sbx.size, "medium");
    let (again, replayed) = api
        .create_sandbox(&me, req, Some("idem-1".into()))
        .await
        .unwrap();
    assert!(replayed);
    assert_eq!(again, sbx);

    assert_eq!(api.get_sandbox(&me, &sbx.id).await.unwrap(), sbx);
    let q = ListSandboxes {
        limit: Some(5),
        starting_after: None,
        include_deleted: Some(true),
    };
    // E2B's data-plane token is not part of the REST API, so it does not
    // come through it.
    let mut direct = fake.list_sandboxes(&local, q.clone()).await.unwrap();
    for s in &mut direct.data {
        s.access_token = None;
    }
    assert_eq!(api.list_sandboxes(&me, q).await.unwrap(), direct);
    assert_eq!(
        api.list_sandboxes(&me, ListSandboxes::default())
            .await
            .unwrap()
            .data,
        vec![sbx.clone()]
    );
    let ext = api.extend_sandbox(&me, &sbx.id, Some(5)).await.unwrap();
    assert_eq!(ext.timeout_minutes, 25);
    assert_eq!(
        api.extend_sandbox(&me, &sbx.id, None)
            .await
            .unwrap()
            .timeout_minutes,
        40
    );

    let params = ExecParams {
        command: "echo 'a b'".into(),
        timeout_ms: Some(2000),
        cwd: Some("sub".into()),
        env: Some(BTreeMap::from([("K".to_owned(), "v v".to_owned())])),
        stream: None,
        ..Default::default()
    };
    let e = api.exec(&me, &sbx.id, params.clone()).await.unwrap();
    assert_eq!(e.stdout, "ran echo 'a b'\n");
    assert_eq!(s.fake.last_exec().unwrap(), params);
    assert_eq!(api.get_execution(&me, &e.id).await.unwrap(), e);

    let params = ExecParams {
        command: "make".into(),
        ..params
    };
    let mut st = api.exec_stream(&me, &sbx.id, params.clone()).await.unwrap();
    let Some(ExecEvent::Started(start)) = st.next().await else {
        panic!("no start event first")
    };
    assert_eq!(start.status, ExecutionStatus::Running);
    assert_eq!(
        api.get_execution(&me, &start.id).await.unwrap().id,
        start.id
    );
    assert_eq!(st.next().await, Some(ExecEvent::Stdout("hello ".into())));
    assert_eq!(st.next().await, Some(ExecEvent::Stderr("warning\n".into())));
    assert_eq!(st.next().await, Some(ExecEvent::Stdout("world\n".into())));
    let Some(ExecEvent::Exit(exit)) = st.next().await else {
        panic!("no exit event")
    };
    assert_eq!(exit.status, ExecutionStatus::Completed);
    assert_eq!(exit.id, start.id);
    assert_eq!(st.next().await, None);
    // (`stream` is how the request asked for events; the rest arrives as sent.)
    let got = s.fake.last_exec().unwrap();
    assert_eq!(
        ExecParams {
            stream: None,
            ..got
        },
        params
    );
    assert_eq!(api.get_execution(&me, &exit.id).await.unwrap(), exit);

    let binary = "AP8A/w==";
    let w = api
        .write_file(
            &me,
            &sbx.id,
            WriteFile {
                path: "d/x.bin".into(),
                content: binary.into(),
                encoding: Some(Encoding::Base64),
            },
        )
        .await
        .unwrap();
    assert_eq!(
        w,
        FileWritten {
            path: "/workspace/d/x.bin".into(),
            bytes: 4
        }
    );
    let r = api
        .read_file(&me, &sbx.id, "d/x.bin", Encoding::Base64)
        .await
        .unwrap();
    assert_eq!(r.content, binary);
    assert_eq!(r.encoding, Encoding::Base64);
    let err = api
        .read_file(&me, &sbx.id, "d/x.bin", Encoding::Utf8)
        .await
        .unwrap_err();
    assert_eq!(err.kind, ErrorType::InvalidRequest);
    assert_eq!(
        api.list_files(&me, &sbx.id, None, true).await.unwrap(),
        fake.list_files(&local, &sbx.id, None, true).await.unwrap()
    );
    assert_eq!(
        api.list_files(&me, &sbx.id, Some("/workspace/d"), false)
            .await
            .unwrap()
            .entries[0]
            .name,
        "x.bin"
    );
    assert_eq!(
        api.delete_file(&me, &sbx.id, "d/x.bin", false)
            .await
            .unwrap(),
        FileDeleted {
            path: "/workspace/d/x.bin".into(),
            deleted: true
        }
    );

    let p = api.expose_port(&me, &sbx.id, 3000, false).await.unwrap();
    assert_eq!(p.port, 3000);
    assert_eq!(api.list_ports(&me, &sbx.id).await.unwrap().data, vec![p]);
    api.close_port(&me, &sbx.id, 3000).await.unwrap();
    assert_eq!(
        api.close_port(&me, &sbx.id, 3000).await.unwrap_err().kind,
        ErrorType::NotFound
    );

    assert_eq!(
        api.usage(&me, Some(3)).await.unwrap(),
        fake.usage(&local, Some(3)).await.unwrap()
    );
    assert_eq!(api.usage(&me, None).await.unwrap().period_days, 30);

    let gone = api.destroy_sandbox(&me, &sbx.id).await.unwrap();
    assert_eq!(gone.status, SandboxStatus::Deleted);
}

#[tokio::test]
async fn errors_map_back_to_the_same_core_error() {
    let s = Server::start().await;
    let (api, me) = remote(&s).await;

    let err = api.authenticate("sk_nope").await.unwrap_err();
    assert_eq!(err, CoreError::unauthorized());

    let err = api.get_sandbox(&me, "sbx_missing").await.unwrap_err();
    assert_eq!(err, CoreError::not_found("sandbox", "sbx_missing"));

    s.fake.fail_next(
        "create_sandbox",
        CoreError::new(ErrorType::RateLimited, "20 live sandboxes").with_retry_after(7),
    );
    let req = CreateSandbox::default();
    let err = api.create_sandbox(&me, req, None).await.unwrap_err();
    assert_eq!(
        err,
        CoreError::new(ErrorType::RateLimited, "20 live sandboxes").with_retry_after(7)
    );

    // Another account's sandbox is not found through its key either.
    let (sbx, _) = api
        .create_sandbox(&me, CreateSandbox::default(), None)
        .await
        .unwrap();
    let other = api.authenticate(KEY_B).await.unwrap();
    assert_eq!(
        api.get_sandbox(&other, &sbx.id).await.unwrap_err().kind,
        ErrorType::NotFound
    );
    // A caller that never authenticated has no key.
    let stranger = Caller::new("acct_x", "test");
    assert_eq!(
        api.account(&stranger).await.unwrap_err().kind,
        ErrorType::Unauthorized
    );

    // Mid-stream failures arrive as the last event.
    let mut st = api
        .exec_stream(
            &me,
            &sbx.id,
            ExecParams {
                command: "crash".into(),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert!(matches!(st.next().await, Some(ExecEvent::Started(_))));
    assert_eq!(st.next().await, Some(ExecEvent::Stdout("partial".into())));
    assert_eq!(
        st.next().await,
        Some(ExecEvent::Error(CoreError::new(
            ErrorType::ServiceUnavailable,
            "the host lost the VM"
        )))
    );

    // Nothing listening: service_unavailable, safe to retry.
    let dead = RemoteApi::new("http://127.0.0.1:9").unwrap();
    assert_eq!(
        dead.service_info().await.unwrap_err().kind,
        ErrorType::ServiceUnavailable
    );
}

#[tokio::test]
async fn dropping_a_remote_stream_cancels_on_the_server() {
    let s = Server::with_config(sandpit_api::RestConfig {
        sse_ping_interval: std::time::Duration::from_millis(50),
        ..Default::default()
    })
    .await;
    let (api, me) = remote(&s).await;
    let (sbx, _) = api
        .create_sandbox(&me, CreateSandbox::default(), None)
        .await
        .unwrap();
    let mut st = api
        .exec_stream(
            &me,
            &sbx.id,
            ExecParams {
                command: "hang".into(),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert!(matches!(st.next().await, Some(ExecEvent::Started(_))));
    assert_eq!(st.next().await, Some(ExecEvent::Stdout("started\n".into())));
    drop(st);
    s.fake.wait_cancelled(1, Duration::from_secs(10)).await;
}
