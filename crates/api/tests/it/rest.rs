//! Every route's status and body shape, auth, and the error contract.

use crate::{expect_error, request_id, Server};
use reqwest::Method;
use sandpit_api::RestConfig;
use sandpit_core::prelude::*;
use sandpit_core::*;
use sandpit_fake::{Fault, KEY_A};
use serde_json::{json, Value};

#[tokio::test]
async fn service_and_openapi_need_no_key() {
    let s = Server::start().await;
    let r = s.http.get(s.v1("/service")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    request_id(&r);
    let info: ServiceInfo = r.json().await.unwrap();
    assert_eq!(info, s.fake.service_info().await.unwrap());

    let r = s.http.get(s.v1("/openapi.json")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let doc: Value = r.json().await.unwrap();
    assert_eq!(doc, sandpit_api::openapi());
}

#[tokio::test]
async fn auth_bearer_and_x_api_key() {
    let s = Server::start().await;
    let r = s.a(Method::GET, "/account").send().await.unwrap();
    assert_eq!(r.status(), 200);
    let acct: Account = r.json().await.unwrap();
    assert_eq!(acct.id, "acct_a");
    assert_eq!(acct.object, "account");

    let r = s.b(Method::GET, "/account").send().await.unwrap();
    assert_eq!(r.json::<Account>().await.unwrap().id, "acct_b");

    // The scheme is case-insensitive.
    let r = s
        .http
        .get(s.v1("/account"))
        .header("authorization", format!("bearer {KEY_A}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
}

#[tokio::test]
async fn auth_failures_are_401() {
    let s = Server::start().await;
    for path in ["/account", "/sandboxes", "/usage", "/executions/x"] {
        let r = s.http.get(s.v1(path)).send().await.unwrap();
        expect_error(r, 401, ErrorType::Unauthorized).await;
    }
    let r = s
        .http
        .get(s.v1("/account"))
        .bearer_auth("sk_wrong")
        .send()
        .await
        .unwrap();
    expect_error(r, 401, ErrorType::Unauthorized).await;
    let r = s
        .http
        .get(s.v1("/account"))
        .header("x-api-key", "")
        .send()
        .await
        .unwrap();
    expect_error(r, 401, ErrorType::Unauthorized).await;
    let r = s
        .http
        .get(s.v1("/account"))
        .basic_auth("user", Some(KEY_A))
        .send()
        .await
        .unwrap();
    let e = expect_error(r, 401, ErrorType::Unauthorized).await;
    assert!(e.error.message.contains("Bearer"), "{}", e.error.message);

    // Auth comes before body validation: a broken body without a key is 401.
    let r = s
        .http
        .post(s.v1("/sandboxes"))
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    expect_error(r, 401, ErrorType::Unauthorized).await;
}

#[tokio::test]
async fn key_in_query_string_is_refused_even_with_a_valid_header() {
    let s = Server::start().await;
    for q in ["api_key", "key", "access_token", "API_KEY"] {
        let r = s
            .http
            .get(format!("{}?{q}={KEY_A}", s.v1("/account")))
            .send()
            .await
            .unwrap();
        let e = expect_error(r, 401, ErrorType::Unauthorized).await;
        assert!(e.error.message.contains("URL"), "{}", e.error.message);
        let r = s
            .a(Method::GET, &format!("/sandboxes?{q}={KEY_A}"))
            .send()
            .await
            .unwrap();
        expect_error(r, 401, ErrorType::Unauthorized).await;
    }
}

#[tokio::test]
async fn create_then_idempotent_replay_and_clash() {
    let s = Server::start().await;
    let body = json!({"size": "medium", "name": "job", "timeout_minutes": 30});
    let r = s
        .a(Method::POST, "/sandboxes")
        .header("Idempotency-Key", "k1")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    request_id(&r);
    let v: Value = r.json().await.unwrap();
    for k in [
        "id",
        "object",
        "name",
        "status",
        "size",
        "resources",
        "timeout_minutes",
        "created_at",
        "ready_at",
        "expires_at",
        "deleted_at",
    ] {
        assert!(v.get(k).is_some(), "missing {k} in {v}");
    }
    assert_eq!(v["object"], "sandbox");
    assert_eq!(v["status"], "running");
    assert_eq!(v["deleted_at"], Value::Null);
    assert_eq!(s.fake.last_idempotency_key(), Some(Some("k1".to_owned())));

    let r = s
        .a(Method::POST, "/sandboxes")
        .header("Idempotency-Key", "k1")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "replay");
    assert_eq!(r.json::<Value>().await.unwrap()["id"], v["id"]);

    let r = s
        .a(Method::POST, "/sandboxes")
        .header("Idempotency-Key", "k1")
        .json(&json!({"size": "large"}))
        .send()
        .await
        .unwrap();
    expect_error(r, 409, ErrorType::Conflict).await;

    // No key: a new sandbox every time; an empty body is `{}`.
    let r = s.a(Method::POST, "/sandboxes").send().await.unwrap();
    assert_eq!(r.status(), 201);
    assert_eq!(s.fake.last_idempotency_key(), Some(None));
    let v2: Value = r.json().await.unwrap();
    assert_ne!(v2["id"], v["id"]);
    assert_eq!(v2["size"], "small");
}

#[tokio::test]
async fn bad_bodies_are_400_with_a_useful_message() {
    let s = Server::start().await;
    let send = |body: &'static str, ct: Option<&'static str>| {
        let mut r = s.a(Method::POST, "/sandboxes").body(body);
        if let Some(ct) = ct {
            r = r.header("content-type", ct);
        }
        r.send()
    };
    let e = expect_error(
        send("{\"size\": ", Some("application/json")).await.unwrap(),
        400,
        ErrorType::InvalidRequest,
    )
    .await;
    assert!(
        e.error.message.contains("malformed JSON"),
        "{}",
        e.error.message
    );

    let e = expect_error(
        send("{\"size\": \"small\"}", Some("text/plain"))
            .await
            .unwrap(),
        400,
        ErrorType::InvalidRequest,
    )
    .await;
    assert!(
        e.error.message.contains("Content-Type"),
        "{}",
        e.error.message
    );

    let e = expect_error(
        send("{\"size\": \"small\"}", None).await.unwrap(),
        400,
        ErrorType::InvalidRequest,
    )
    .await;
    assert!(
        e.error.message.contains("Content-Type"),
        "{}",
        e.error.message
    );

    let e = expect_error(
        send("{\"sise\": \"small\"}", Some("application/json"))
            .await
            .unwrap(),
        400,
        ErrorType::InvalidRequest,
    )
    .await;
    assert!(e.error.message.contains("sise"), "{}", e.error.message);

    let e = expect_error(
        send(
            "{\"timeout_minutes\": -5}",
            Some("application/json; charset=utf-8"),
        )
        .await
        .unwrap(),
        400,
        ErrorType::InvalidRequest,
    )
    .await;
    assert!(
        e.error.message.contains("timeout_minutes"),
        "{}",
        e.error.message
    );

    let e = expect_error(
        send("[]", Some("application/json")).await.unwrap(),
        400,
        ErrorType::InvalidRequest,
    )
    .await;
    assert!(
        e.error.message.starts_with("invalid body"),
        "{}",
        e.error.message
    );

    // Unknown fields are refused also where the core type would ignore them.
    let id = s.create().await;
    let r = s
        .a(Method::POST, &format!("/sandboxes/{id}/exec"))
        .json(&json!({"command": "ls", "timeout": 5}))
        .send()
        .await
        .unwrap();
    let e = expect_error(r, 400, ErrorType::InvalidRequest).await;
    assert!(e.error.message.contains("`timeout`"), "{}", e.error.message);
    assert!(
        e.error.message.contains("`timeout_ms`"),
        "{}",
        e.error.message
    );
    let r = s
        .a(Method::POST, &format!("/sandboxes/{id}/exec"))
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    let e = expect_error(r, 400, ErrorType::InvalidRequest).await;
    assert!(e.error.message.contains("command"), "{}", e.error.message);

    // A value the core refuses comes back with the core's type and message.
    let r = s
        .a(Method::POST, "/sandboxes")
        .json(&json!({"size": "huge"}))
        .send()
        .await
        .unwrap();
    let e = expect_error(r, 400, ErrorType::InvalidRequest).await;
    assert!(e.error.message.contains("huge"));
}

#[tokio::test]
async fn get_list_extend_destroy() {
    let s = Server::start().await;
    let first = s.create().await;
    let second = s.create().await;

    let r = s
        .a(Method::GET, &format!("/sandboxes/{first}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Sandbox>().await.unwrap().id, first);

    // Another account's sandbox does not exist for B.
    let r = s
        .b(Method::GET, &format!("/sandboxes/{first}"))
        .send()
        .await
        .unwrap();
    expect_error(r, 404, ErrorType::NotFound).await;

    let r = s.a(Method::GET, "/sandboxes?limit=1").send().await.unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["object"], "list");
    assert_eq!(v["has_more"], true);
    assert_eq!(v["data"][0]["id"], second.as_str(), "newest first");
    assert_eq!(v["next_cursor"], second.as_str());
    let r = s
        .a(
            Method::GET,
            &format!("/sandboxes?limit=1&starting_after={second}&include_deleted=false"),
        )
        .send()
        .await
        .unwrap();
    let page: List<Sandbox> = r.json().await.unwrap();
    assert_eq!(page.data[0].id, first);
    assert!(!page.has_more);
    assert_eq!(page.next_cursor, None);

    for (q, word) in [
        ("limit=abc", "limit"),
        ("limit=-1", "limit"),
        ("include_deleted=yes", "include_deleted"),
        ("color=red", "color"),
    ] {
        let r = s
            .a(Method::GET, &format!("/sandboxes?{q}"))
            .send()
            .await
            .unwrap();
        let e = expect_error(r, 400, ErrorType::InvalidRequest).await;
        assert!(e.error.message.contains(word), "{q}: {}", e.error.message);
    }
    let r = s
        .a(Method::GET, "/sandboxes?limit=500")
        .send()
        .await
        .unwrap();
    expect_error(r, 400, ErrorType::InvalidRequest).await;

    let r = s
        .a(Method::POST, &format!("/sandboxes/{first}/extend"))
        .json(&json!({"additional_minutes": 10}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Sandbox>().await.unwrap().timeout_minutes, 25);
    let r = s
        .a(Method::POST, &format!("/sandboxes/{first}/extend"))
        .send()
        .await
        .unwrap();
    assert_eq!(
        r.json::<Sandbox>().await.unwrap().timeout_minutes,
        40,
        "default 15"
    );
    let r = s
        .a(Method::POST, &format!("/sandboxes/{first}/extend"))
        .json(&json!({"minutes": 10}))
        .send()
        .await
        .unwrap();
    expect_error(r, 400, ErrorType::InvalidRequest).await;

    let r = s
        .a(Method::DELETE, &format!("/sandboxes/{first}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let gone: Sandbox = r.json().await.unwrap();
    assert_eq!(gone.status, SandboxStatus::Deleted);
    assert_eq!(gone.deleted_reason.as_deref(), Some("destroyed"));
    let r = s
        .a(Method::DELETE, &format!("/sandboxes/{first}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "idempotent");

    let r = s.a(Method::GET, "/sandboxes").send().await.unwrap();
    let live: List<Sandbox> = r.json().await.unwrap();
    assert_eq!(live.data.len(), 1);
    let r = s
        .a(Method::GET, "/sandboxes?include_deleted=true")
        .send()
        .await
        .unwrap();
    assert_eq!(r.json::<List<Sandbox>>().await.unwrap().data.len(), 2);

    let r = s
        .a(Method::POST, &format!("/sandboxes/{first}/exec"))
        .json(&json!({"command": "ls"}))
        .send()
        .await
        .unwrap();
    expect_error(r, 409, ErrorType::Conflict).await;
}

#[tokio::test]
async fn exec_and_get_execution() {
    let s = Server::start().await;
    let id = s.create().await;
    let r = s
        .a(Method::POST, &format!("/sandboxes/{id}/exec"))
        .json(&json!({"command": "echo hi", "timeout_ms": 5000, "cwd": "/tmp", "env": {"A": "1"}}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("application/json"));
    let v: Value = r.json().await.unwrap();
    for k in [
        "id",
        "object",
        "sandbox_id",
        "status",
        "exit_code",
        "stdout",
        "stderr",
        "truncated",
        "duration_ms",
        "started_at",
        "finished_at",
    ] {
        assert!(v.get(k).is_some(), "missing {k} in {v}");
    }
    assert_eq!(v["object"], "execution");
    assert_eq!(v["stdout"], "ran echo hi\n");
    let got = s.fake.last_exec().unwrap();
    assert_eq!(got.timeout_ms, Some(5000));
    assert_eq!(got.cwd.as_deref(), Some("/tmp"));
    assert_eq!(got.env.unwrap()["A"], "1");

    let exec_id = v["id"].as_str().unwrap();
    let r = s
        .a(Method::GET, &format!("/executions/{exec_id}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.unwrap(), v);
    let r = s
        .b(Method::GET, &format!("/executions/{exec_id}"))
        .send()
        .await
        .unwrap();
    expect_error(r, 404, ErrorType::NotFound).await;

    s.fake.fail_next(
        "exec",
        CoreError::new(ErrorType::ServiceUnavailable, "agent busy").with_retry_after(2),
    );
    let r = s
        .a(Method::POST, &format!("/sandboxes/{id}/exec"))
        .json(&json!({"command": "ls"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()["retry-after"], "2");
    expect_error(r, 503, ErrorType::ServiceUnavailable).await;
}

#[tokio::test]
async fn files_write_read_list_delete() {
    let s = Server::start().await;
    let id = s.create().await;
    let files = format!("/sandboxes/{id}/files");
    let text = "line 1\n'quotes' \"and\" $dollars\n";
    let r = s
        .a(Method::PUT, &files)
        .json(&json!({"path": "dir/a.txt", "content": text, "encoding": "utf8"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let w: Value = r.json().await.unwrap();
    assert_eq!(
        w,
        json!({"path": "/workspace/dir/a.txt", "bytes": text.len()})
    );

    let r = s
        .a(Method::PUT, &files)
        .json(&json!({"path": "/workspace/b.bin", "content": "AP8A/w==", "encoding": "base64"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.json::<FileWritten>().await.unwrap().bytes, 4);

    let r = s
        .a(Method::GET, &format!("{files}?path=dir/a.txt"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(
        v,
        json!({"path": "/workspace/dir/a.txt", "content": text, "bytes": text.len(), "encoding": "utf8"})
    );
    let r = s
        .a(
            Method::GET,
            &format!("{files}?path=%2Fworkspace%2Fb.bin&encoding=base64"),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.json::<FileContent>().await.unwrap().content, "AP8A/w==");
    let r = s
        .a(Method::GET, &format!("{files}?path=b.bin"))
        .send()
        .await
        .unwrap();
    let e = expect_error(r, 400, ErrorType::InvalidRequest).await;
    assert!(e.error.message.contains("base64"));
    let r = s
        .a(Method::GET, &format!("{files}?path=b.bin&encoding=hex"))
        .send()
        .await
        .unwrap();
    let e = expect_error(r, 400, ErrorType::InvalidRequest).await;
    assert!(e.error.message.contains("encoding"), "{}", e.error.message);
    let r = s.a(Method::GET, &files).send().await.unwrap();
    let e = expect_error(r, 400, ErrorType::InvalidRequest).await;
    assert!(e.error.message.contains("path"));

    let r = s
        .a(Method::GET, &format!("{files}?list=true"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(
        v,
        json!({"path": "/workspace", "entries": [
            {"name": "b.bin", "type": "file", "size_bytes": 4},
            {"name": "dir", "type": "dir", "size_bytes": 0},
        ], "truncated": false})
    );
    let r = s
        .a(
            Method::GET,
            &format!("{files}?list=true&recursive=true&path=/workspace"),
        )
        .send()
        .await
        .unwrap();
    let names: Vec<String> = r
        .json::<FileList>()
        .await
        .unwrap()
        .entries
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert_eq!(names, ["b.bin", "dir", "dir/a.txt"]);
    let r = s
        .a(Method::GET, &format!("{files}?list=maybe"))
        .send()
        .await
        .unwrap();
    expect_error(r, 400, ErrorType::InvalidRequest).await;

    let r = s
        .a(
            Method::DELETE,
            &format!("{files}?path=dir/a.txt&recursive=false"),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.json::<Value>().await.unwrap(),
        json!({"path": "/workspace/dir/a.txt", "deleted": true})
    );
    let r = s
        .a(Method::DELETE, &format!("{files}?path=dir/a.txt"))
        .send()
        .await
        .unwrap();
    expect_error(r, 404, ErrorType::NotFound).await;
    let r = s.a(Method::DELETE, &files).send().await.unwrap();
    expect_error(r, 400, ErrorType::InvalidRequest).await;

    let r = s
        .b(Method::GET, &format!("{files}?list=true"))
        .send()
        .await
        .unwrap();
    expect_error(r, 404, ErrorType::NotFound).await;
}

#[tokio::test]
async fn ports_expose_list_close() {
    let s = Server::start().await;
    let id = s.create().await;
    let ports = format!("/sandboxes/{id}/ports");
    let r = s
        .a(Method::POST, &ports)
        .json(&json!({"port": 8080}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let p: Value = r.json().await.unwrap();
    assert_eq!(p["port"], 8080);
    assert!(p["url"].as_str().unwrap().starts_with("https://8080-"));
    assert!(p.get("created_at").is_some());
    let r = s
        .a(Method::POST, &ports)
        .json(&json!({"port": 8080}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.json::<Value>().await.unwrap(), p, "same port, same URL");

    let r = s
        .a(Method::POST, &ports)
        .json(&json!({"port": 70000}))
        .send()
        .await
        .unwrap();
    let e = expect_error(r, 400, ErrorType::InvalidRequest).await;
    assert!(e.error.message.contains("port"));
    let r = s
        .a(Method::POST, &ports)
        .json(&json!({"port": 0}))
        .send()
        .await
        .unwrap();
    expect_error(r, 400, ErrorType::InvalidRequest).await;

    let r = s.a(Method::GET, &ports).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"], json!([p]));

    let r = s
        .a(Method::DELETE, &format!("{ports}/8080"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.json::<Value>().await.unwrap(),
        json!({"port": 8080, "closed": true})
    );
    let r = s
        .a(Method::DELETE, &format!("{ports}/8080"))
        .send()
        .await
        .unwrap();
    expect_error(r, 404, ErrorType::NotFound).await;
    let r = s
        .a(Method::DELETE, &format!("{ports}/http"))
        .send()
        .await
        .unwrap();
    expect_error(r, 400, ErrorType::InvalidRequest).await;
}

#[tokio::test]
async fn usage_and_account() {
    let s = Server::start().await;
    s.create().await;
    let r = s.a(Method::GET, "/usage?days=7").send().await.unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["object"], "usage");
    assert_eq!(v["period_days"], 7);
    let u = &v["sandboxes"][0];
    for k in [
        "id",
        "size",
        "seconds",
        "cost_usd",
        "created_at",
        "deleted_at",
    ] {
        assert!(u.get(k).is_some(), "missing {k}");
    }
    let r = s.a(Method::GET, "/usage").send().await.unwrap();
    assert_eq!(r.json::<Usage>().await.unwrap().period_days, 30);
    let r = s.a(Method::GET, "/usage?days=week").send().await.unwrap();
    let e = expect_error(r, 400, ErrorType::InvalidRequest).await;
    assert!(e.error.message.contains("days"));

    let r = s.a(Method::GET, "/account").send().await.unwrap();
    let v: Value = r.json().await.unwrap();
    for k in [
        "object",
        "id",
        "name",
        "credit_remaining_usd",
        "max_concurrent_sandboxes",
        "created_at",
    ] {
        assert!(v.get(k).is_some(), "missing {k}");
    }
}

#[tokio::test]
async fn core_errors_keep_type_status_and_retry_after() {
    let s = Server::start().await;
    let create = |fault: Fault| {
        s.fake.fail_next("create_sandbox", fault);
        s.a(Method::POST, "/sandboxes").json(&json!({})).send()
    };
    let r = create(
        CoreError::new(ErrorType::RateLimited, "20 live sandboxes")
            .with_retry_after(7)
            .into(),
    )
    .await
    .unwrap();
    assert_eq!(r.headers()["retry-after"], "7");
    let e = expect_error(r, 429, ErrorType::RateLimited).await;
    assert_eq!(e.error.message, "20 live sandboxes");
    let r = create(CoreError::new(ErrorType::ServiceUnavailable, "host full").into())
        .await
        .unwrap();
    assert_eq!(
        r.headers()["retry-after"],
        "1",
        "default when the core gives none"
    );
    expect_error(r, 503, ErrorType::ServiceUnavailable).await;
    let r = create(CoreError::new(ErrorType::InsufficientCredits, "credit $0.00").into())
        .await
        .unwrap();
    assert!(r.headers().get("retry-after").is_none());
    expect_error(r, 402, ErrorType::InsufficientCredits).await;
    let r = create(Fault::Panic).await.unwrap();
    expect_error(r, 500, ErrorType::InternalError).await;
}

#[tokio::test]
async fn unknown_routes_and_wrong_methods_are_json() {
    let s = Server::start().await;
    for path in ["/v1/nope", "/", "/v2/sandboxes", "/v1/sandboxes/x/y/z"] {
        let r = s.http.get(format!("{}{path}", s.url)).send().await.unwrap();
        expect_error(r, 404, ErrorType::NotFound).await;
    }
    let r = s.a(Method::PATCH, "/sandboxes").send().await.unwrap();
    let allow = r.headers()["allow"].to_str().unwrap().to_owned();
    assert!(allow.contains("POST") && allow.contains("GET"), "{allow}");
    let e = expect_error(r, 405, ErrorType::InvalidRequest).await;
    assert!(e.error.message.contains("method"));
    let r = s.http.delete(s.v1("/service")).send().await.unwrap();
    expect_error(r, 405, ErrorType::InvalidRequest).await;
}

#[tokio::test]
async fn request_ids_are_fresh_and_never_the_clients() {
    let s = Server::start().await;
    let mut seen = std::collections::HashSet::new();
    for _ in 0..5 {
        let r = s
            .a(Method::GET, "/account")
            .header("x-request-id", "req_mine")
            .send()
            .await
            .unwrap();
        let id = request_id(&r);
        assert_ne!(id, "req_mine");
        assert!(seen.insert(id));
    }
}

#[tokio::test]
async fn oversized_bodies_are_413_stating_the_limit() {
    let s = Server::with_config(RestConfig {
        max_body_bytes: 4096,
        ..RestConfig::default()
    })
    .await;
    let id = s.create().await;
    let big = "x".repeat(5000);
    let r = s
        .a(Method::PUT, &format!("/sandboxes/{id}/files"))
        .json(&json!({"path": "a", "content": big}))
        .send()
        .await
        .unwrap();
    let e = expect_error(r, 413, ErrorType::InvalidRequest).await;
    assert!(e.error.message.contains("4096"), "{}", e.error.message);
    // Chunked (no Content-Length) is caught as well.
    let stream = futures::stream::iter(
        (0..10).map(|_| Ok::<_, std::io::Error>(bytes_of(&"y".repeat(1000)))),
    );
    let r = s
        .a(Method::PUT, &format!("/sandboxes/{id}/files"))
        .header("content-type", "application/json")
        .body(reqwest::Body::wrap_stream(stream))
        .send()
        .await
        .unwrap();
    expect_error(r, 413, ErrorType::InvalidRequest).await;
}

fn bytes_of(s: &str) -> Vec<u8> {
    s.as_bytes().to_vec()
}

#[tokio::test]
async fn the_default_limit_takes_a_32_mib_file_as_base64() {
    use base64::Engine;
    let s = Server::start().await;
    let id = s.create().await;
    let raw = vec![0xA5u8; 32 * 1024 * 1024];
    let content = base64::engine::general_purpose::STANDARD.encode(&raw);
    let body =
        serde_json::to_vec(&json!({"path": "big.bin", "content": content, "encoding": "base64"}))
            .unwrap();
    let r = s
        .a(Method::PUT, &format!("/sandboxes/{id}/files"))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.json::<FileWritten>().await.unwrap().bytes,
        raw.len() as u64
    );
}
