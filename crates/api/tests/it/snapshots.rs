//! Snapshots, fork and restore over REST: status codes, body shapes,
//! idempotent replays, ownership, strict bodies, and `RemoteApi`'s round
//! trips of the same calls.

use crate::{expect_error, request_id, Server};
use reqwest::Method;
use sandpit_api::RemoteApi;
use sandpit_core::prelude::*;
use sandpit_core::*;
use sandpit_fake::{Op, KEY_A};
use serde_json::{json, Value};

/// Write `content` to `path` in sandbox `id` as account A.
async fn write(s: &Server, id: &str, path: &str, content: &str) {
    let r = s
        .a(Method::PUT, &format!("/sandboxes/{id}/files"))
        .json(&json!({"path": path, "content": content}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
}

/// The content of `path` in sandbox `id` (account A), or the error's status.
async fn read(s: &Server, id: &str, path: &str) -> Result<String, u16> {
    let r = s
        .a(Method::GET, &format!("/sandboxes/{id}/files?path={path}"))
        .send()
        .await
        .unwrap();
    match r.status().as_u16() {
        200 => Ok(r.json::<Value>().await.unwrap()["content"]
            .as_str()
            .unwrap()
            .to_owned()),
        other => Err(other),
    }
}

async fn snapshot(s: &Server, id: &str, body: Value) -> Value {
    let r = s
        .a(Method::POST, &format!("/sandboxes/{id}/snapshots"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    r.json().await.unwrap()
}

#[tokio::test]
async fn snapshot_then_replay_clash_get_list_delete() {
    let s = Server::start().await;
    let id = s.create().await;
    write(&s, &id, "state.txt", "v1").await;
    let r = s
        .a(Method::POST, &format!("/sandboxes/{id}/snapshots"))
        .header("Idempotency-Key", "snap-1")
        .json(&json!({"name": "clean"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    request_id(&r);
    let snap: Value = r.json().await.unwrap();
    let mut keys: Vec<&String> = snap.as_object().unwrap().keys().collect();
    keys.sort();
    assert_eq!(
        keys,
        [
            "created_at",
            "expires_at",
            "id",
            "name",
            "object",
            "sandbox_id",
            "size",
            "size_bytes",
            "status"
        ],
        "{snap}"
    );
    assert_eq!(snap["object"], "snapshot");
    assert_eq!(snap["name"], "clean");
    assert_eq!(snap["sandbox_id"], id.as_str());
    assert_eq!(snap["size"], "small");
    assert_eq!(snap["status"], "ready");
    assert_eq!(snap["size_bytes"], 2);
    let snap_id = snap["id"].as_str().unwrap().to_owned();
    assert!(snap_id.starts_with("snap_"), "{snap_id}");
    let Op::SnapshotSandbox {
        idempotency_key, ..
    } = s.fake.calls().last().unwrap().op.clone()
    else {
        panic!("{:?}", s.fake.calls())
    };
    assert_eq!(idempotency_key.as_deref(), Some("snap-1"));

    // The same key and body: the same snapshot, 200.
    let r = s
        .a(Method::POST, &format!("/sandboxes/{id}/snapshots"))
        .header("Idempotency-Key", "snap-1")
        .json(&json!({"name": "clean"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "replay");
    assert_eq!(r.json::<Value>().await.unwrap(), snap);
    // Another body: 409.
    let r = s
        .a(Method::POST, &format!("/sandboxes/{id}/snapshots"))
        .header("Idempotency-Key", "snap-1")
        .json(&json!({"name": "other"}))
        .send()
        .await
        .unwrap();
    expect_error(r, 409, ErrorType::Conflict).await;
    // No body at all is `{}`: a snapshot without a name.
    let r = s
        .a(Method::POST, &format!("/sandboxes/{id}/snapshots"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let unnamed: Value = r.json().await.unwrap();
    assert_eq!(unnamed["name"], Value::Null);

    let r = s
        .a(Method::GET, &format!("/snapshots/{snap_id}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.unwrap(), snap);

    // Newest first, paged.
    let r = s.a(Method::GET, "/snapshots?limit=1").send().await.unwrap();
    assert_eq!(r.status(), 200);
    let page: Value = r.json().await.unwrap();
    assert_eq!(page["object"], "list");
    assert_eq!(page["data"], json!([unnamed]));
    assert_eq!(page["has_more"], true);
    assert_eq!(page["next_cursor"], unnamed["id"]);
    let r = s
        .a(
            Method::GET,
            &format!(
                "/snapshots?starting_after={}",
                unnamed["id"].as_str().unwrap()
            ),
        )
        .send()
        .await
        .unwrap();
    let page: Value = r.json().await.unwrap();
    assert_eq!(page["data"], json!([snap]));
    assert_eq!(page["has_more"], false);
    assert_eq!(page["next_cursor"], Value::Null);

    let r = s
        .a(Method::DELETE, &format!("/snapshots/{snap_id}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let gone: Value = r.json().await.unwrap();
    assert_eq!(gone["id"], snap_id.as_str());
    assert_eq!(gone["status"], "deleted");
    let r = s.a(Method::GET, "/snapshots").send().await.unwrap();
    let page: Value = r.json().await.unwrap();
    assert_eq!(page["data"], json!([unnamed]));
}

#[tokio::test]
async fn restore_rolls_back_and_create_starts_from_a_snapshot() {
    let s = Server::start().await;
    let id = s.create().await;
    write(&s, &id, "state.txt", "good").await;
    let snap = snapshot(&s, &id, json!({})).await;
    let snap_id = snap["id"].as_str().unwrap();

    write(&s, &id, "state.txt", "broken").await;
    write(&s, &id, "junk.txt", "x").await;
    let before: Value = s
        .a(Method::GET, &format!("/sandboxes/{id}"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let r = s
        .a(Method::POST, &format!("/sandboxes/{id}/restore"))
        .json(&json!({"snapshot_id": snap_id}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let after: Value = r.json().await.unwrap();
    assert_eq!(after, before, "same id, expiry and the rest");
    assert_eq!(read(&s, &id, "state.txt").await, Ok("good".into()));
    assert_eq!(read(&s, &id, "junk.txt").await, Err(404));

    // A new sandbox from it: 201, the snapshot's files and size.
    let r = s
        .a(Method::POST, "/sandboxes")
        .header("Idempotency-Key", "from-snap")
        .json(&json!({"snapshot_id": snap_id, "name": "copy"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let copy: Value = r.json().await.unwrap();
    assert_ne!(copy["id"], id.as_str());
    assert_eq!(copy["size"], "small");
    let Op::CreateSandbox { req, .. } = s.fake.calls().last().unwrap().op.clone() else {
        panic!()
    };
    assert_eq!(req.snapshot_id.as_deref(), Some(snap_id));
    let copy_id = copy["id"].as_str().unwrap();
    assert_eq!(read(&s, copy_id, "state.txt").await, Ok("good".into()));
    // The key is held to the snapshot too.
    let r = s
        .a(Method::POST, "/sandboxes")
        .header("Idempotency-Key", "from-snap")
        .json(&json!({"snapshot_id": snap_id, "name": "copy"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = s
        .a(Method::POST, "/sandboxes")
        .header("Idempotency-Key", "from-snap")
        .json(&json!({"name": "copy"}))
        .send()
        .await
        .unwrap();
    expect_error(r, 409, ErrorType::Conflict).await;
    // Its size is the snapshot's.
    let r = s
        .a(Method::POST, "/sandboxes")
        .json(&json!({"snapshot_id": snap_id, "size": "large"}))
        .send()
        .await
        .unwrap();
    expect_error(r, 400, ErrorType::InvalidRequest).await;
    let r = s
        .a(Method::POST, "/sandboxes")
        .json(&json!({"snapshot_id": "snap_nope"}))
        .send()
        .await
        .unwrap();
    expect_error(r, 404, ErrorType::NotFound).await;

    // Restore needs its snapshot id.
    let r = s
        .a(Method::POST, &format!("/sandboxes/{id}/restore"))
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    let e = expect_error(r, 400, ErrorType::InvalidRequest).await;
    assert!(
        e.error.message.contains("snapshot_id"),
        "{}",
        e.error.message
    );
    // A deleted sandbox cannot be restored.
    s.a(Method::DELETE, &format!("/sandboxes/{id}"))
        .send()
        .await
        .unwrap();
    let r = s
        .a(Method::POST, &format!("/sandboxes/{id}/restore"))
        .json(&json!({"snapshot_id": snap_id}))
        .send()
        .await
        .unwrap();
    expect_error(r, 409, ErrorType::Conflict).await;
}

#[tokio::test]
async fn fork_makes_a_snapshot_and_copies() {
    let s = Server::start().await;
    let id = s.create().await;
    write(&s, &id, "work.txt", "halfway").await;
    let r = s
        .a(Method::POST, &format!("/sandboxes/{id}/fork"))
        .json(&json!({"count": 3, "timeout_minutes": 30}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    request_id(&r);
    let fork: Value = r.json().await.unwrap();
    let mut keys: Vec<&String> = fork.as_object().unwrap().keys().collect();
    keys.sort();
    assert_eq!(keys, ["sandboxes", "snapshot"], "{fork}");
    assert_eq!(fork["snapshot"]["object"], "snapshot");
    assert_eq!(fork["snapshot"]["sandbox_id"], id.as_str());
    let copies = fork["sandboxes"].as_array().unwrap();
    assert_eq!(copies.len(), 3);
    for c in copies {
        assert_eq!(c["object"], "sandbox");
        assert_eq!(c["status"], "running");
        assert_eq!(c["timeout_minutes"], 30);
        let cid = c["id"].as_str().unwrap();
        assert_eq!(read(&s, cid, "work.txt").await, Ok("halfway".into()));
    }
    // The fork's snapshot is an ordinary one.
    let r = s
        .a(
            Method::GET,
            &format!("/snapshots/{}", fork["snapshot"]["id"].as_str().unwrap()),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.json::<Value>().await.unwrap(), fork["snapshot"]);

    // An empty body: one copy.
    let r = s
        .a(Method::POST, &format!("/sandboxes/{id}/fork"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let one: Value = r.json().await.unwrap();
    assert_eq!(one["sandboxes"].as_array().unwrap().len(), 1);

    for body in [json!({"count": 0}), json!({"count": 11})] {
        let r = s
            .a(Method::POST, &format!("/sandboxes/{id}/fork"))
            .json(&body)
            .send()
            .await
            .unwrap();
        let e = expect_error(r, 400, ErrorType::InvalidRequest).await;
        assert!(e.error.message.contains("count"), "{}", e.error.message);
    }
    // A typo is refused, not ignored.
    let r = s
        .a(Method::POST, &format!("/sandboxes/{id}/fork"))
        .json(&json!({"copies": 2}))
        .send()
        .await
        .unwrap();
    let e = expect_error(r, 400, ErrorType::InvalidRequest).await;
    assert!(e.error.message.contains("`copies`"), "{}", e.error.message);
    assert!(e.error.message.contains("`count`"), "{}", e.error.message);
    // What the core refuses keeps its status (402 here).
    s.fake.fail_next(
        "fork_sandbox",
        CoreError::new(ErrorType::InsufficientCredits, "not enough credit for 3"),
    );
    let r = s
        .a(Method::POST, &format!("/sandboxes/{id}/fork"))
        .json(&json!({"count": 3}))
        .send()
        .await
        .unwrap();
    expect_error(r, 402, ErrorType::InsufficientCredits).await;
}

#[tokio::test]
async fn another_accounts_snapshots_are_not_found() {
    let s = Server::start().await;
    let id = s.create().await;
    let snap = snapshot(&s, &id, json!({"name": "mine"})).await;
    let snap_id = snap["id"].as_str().unwrap();
    for (method, path, body) in [
        (Method::GET, format!("/snapshots/{snap_id}"), None),
        (Method::DELETE, format!("/snapshots/{snap_id}"), None),
        (
            Method::POST,
            "/sandboxes".to_owned(),
            Some(json!({"snapshot_id": snap_id})),
        ),
        (Method::POST, format!("/sandboxes/{id}/snapshots"), None),
        (Method::POST, format!("/sandboxes/{id}/fork"), None),
        (
            Method::POST,
            format!("/sandboxes/{id}/restore"),
            Some(json!({"snapshot_id": snap_id})),
        ),
    ] {
        let mut r = s.b(method.clone(), &path);
        if let Some(b) = body {
            r = r.json(&b);
        }
        let r = r.send().await.unwrap();
        let e = expect_error(r, 404, ErrorType::NotFound).await;
        assert!(!e.error.message.contains("acct_a"), "{}", e.error.message);
    }
    let r = s.b(Method::GET, "/snapshots").send().await.unwrap();
    assert_eq!(r.json::<Value>().await.unwrap()["data"], json!([]));
    // Without a key: 401 before anything else.
    for path in ["/snapshots", &format!("/snapshots/{snap_id}")] {
        let r = s.http.get(s.v1(path)).send().await.unwrap();
        expect_error(r, 401, ErrorType::Unauthorized).await;
    }
    // The snapshot is still there for its owner.
    let r = s
        .a(Method::GET, &format!("/snapshots/{snap_id}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.json::<Value>().await.unwrap(), snap);
}

#[tokio::test]
async fn bad_snapshot_requests_are_400() {
    let s = Server::start().await;
    let id = s.create().await;
    for (path, body) in [
        (format!("/sandboxes/{id}/snapshots"), json!({"nmae": "x"})),
        (format!("/sandboxes/{id}/snapshots"), json!({"name": 5})),
        (
            format!("/sandboxes/{id}/restore"),
            json!({"snapshot_id": 1}),
        ),
        (format!("/sandboxes/{id}/fork"), json!({"count": -1})),
    ] {
        let r = s.a(Method::POST, &path).json(&body).send().await.unwrap();
        expect_error(r, 400, ErrorType::InvalidRequest).await;
    }
    for q in [
        "limit=0",
        "limit=abc",
        "include_deleted=true",
        "starting_after=snap_nope",
    ] {
        let r = s
            .a(Method::GET, &format!("/snapshots?{q}"))
            .send()
            .await
            .unwrap();
        expect_error(r, 400, ErrorType::InvalidRequest).await;
    }
    let r = s
        .a(Method::GET, &format!("/snapshots?key={KEY_A}"))
        .send()
        .await
        .unwrap();
    expect_error(r, 401, ErrorType::Unauthorized).await;
    // Wrong method on a snapshot: JSON 405.
    let r = s.a(Method::PUT, "/snapshots/snap_x").send().await.unwrap();
    assert_eq!(r.status(), 405);
    request_id(&r);
}

#[tokio::test]
async fn remote_api_round_trips_snapshots_fork_and_restore() {
    let s = Server::start().await;
    let api = RemoteApi::new(&s.url).unwrap();
    let me = api.authenticate(KEY_A).await.unwrap();
    let local = s.fake.authenticate(KEY_A).await.unwrap();
    let (sbx, _) = api
        .create_sandbox(&me, CreateSandbox::default(), None)
        .await
        .unwrap();

    let req = CreateSnapshot {
        name: Some("r".into()),
    };
    let (snap, replayed) = api
        .snapshot_sandbox(&me, &sbx.id, req.clone(), Some("k".into()))
        .await
        .unwrap();
    assert!(!replayed);
    assert_eq!(snap.name.as_deref(), Some("r"));
    let (again, replayed) = api
        .snapshot_sandbox(&me, &sbx.id, req, Some("k".into()))
        .await
        .unwrap();
    assert!(replayed);
    assert_eq!(again, snap);
    assert_eq!(api.get_snapshot(&me, &snap.id).await.unwrap(), snap);

    let fork = api
        .fork_sandbox(
            &me,
            &sbx.id,
            ForkSandbox {
                count: Some(2),
                timeout_minutes: None,
            },
        )
        .await
        .unwrap();
    assert_eq!(fork.sandboxes.len(), 2);
    assert_eq!(
        api.get_sandbox(&me, &fork.sandboxes[1].id).await.unwrap(),
        fork.sandboxes[1]
    );

    let q = ListSnapshots {
        limit: Some(1),
        starting_after: Some(fork.snapshot.id.clone()),
    };
    let page = api.list_snapshots(&me, q.clone()).await.unwrap();
    assert_eq!(page, s.fake.list_snapshots(&local, q).await.unwrap());
    assert_eq!(page.data, std::slice::from_ref(&snap));
    let all = api
        .list_snapshots(&me, ListSnapshots::default())
        .await
        .unwrap();
    assert_eq!(all.data, [fork.snapshot.clone(), snap.clone()]);

    let restored = api
        .restore_sandbox(
            &me,
            &sbx.id,
            RestoreSandbox {
                snapshot_id: snap.id.clone(),
            },
        )
        .await
        .unwrap();
    assert_eq!(restored, sbx);
    let Op::RestoreSandbox { id, req } = s.fake.calls().last().unwrap().op.clone() else {
        panic!()
    };
    assert_eq!(
        (id.as_str(), req.snapshot_id.as_str()),
        (sbx.id.as_str(), snap.id.as_str())
    );

    let (copy, _) = api
        .create_sandbox(
            &me,
            CreateSandbox {
                snapshot_id: Some(snap.id.clone()),
                ..Default::default()
            },
            None,
        )
        .await
        .unwrap();
    assert_ne!(copy.id, sbx.id);

    let gone = api.delete_snapshot(&me, &snap.id).await.unwrap();
    assert_eq!(gone.status, "deleted");
    let e = api.get_snapshot(&me, "snap_nope").await.unwrap_err();
    assert_eq!(e.kind, ErrorType::NotFound);
    let e = api
        .fork_sandbox(
            &me,
            &sbx.id,
            ForkSandbox {
                count: Some(11),
                timeout_minutes: None,
            },
        )
        .await
        .unwrap_err();
    assert_eq!(e.kind, ErrorType::InvalidRequest);
}

#[tokio::test]
async fn pause_and_resume_over_rest_and_remote_api() {
    let s = Server::start().await;
    let id = s.create().await;
    let r = s
        .a(Method::POST, &format!("/sandboxes/{id}/pause"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    request_id(&r);
    let paused: Value = r.json().await.unwrap();
    assert_eq!(paused["status"], "paused");
    assert_eq!(paused["id"], id.as_str());
    // A call that needs the VM resumes it.
    write(&s, &id, "x.txt", "1").await;
    let r = s
        .a(Method::GET, &format!("/sandboxes/{id}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.json::<Value>().await.unwrap()["status"], "running");
    // Another account's is 404; an unknown one too.
    let r = s
        .b(Method::POST, &format!("/sandboxes/{id}/pause"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let r = s
        .a(Method::POST, "/sandboxes/sbx_nope/resume")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);

    let api = RemoteApi::new(&s.url).unwrap();
    let me = api.authenticate(KEY_A).await.unwrap();
    let p = api.pause_sandbox(&me, &id).await.unwrap();
    assert_eq!(p.status, SandboxStatus::Paused);
    assert_eq!(
        api.pause_sandbox(&me, &id).await.unwrap().status,
        SandboxStatus::Paused,
        "pausing twice changes nothing"
    );
    let r = api.resume_sandbox(&me, &id).await.unwrap();
    assert_eq!(r.status, SandboxStatus::Running);
    assert_eq!(
        s.fake
            .calls()
            .iter()
            .filter(|c| matches!(c.op, Op::PauseSandbox { .. }))
            .count(),
        4,
        "one over REST by A, one by B, two through RemoteApi"
    );
}
