//! Exec as server-sent events: framing, pings, errors, and cancellation
//! when the client goes away; a sandbox's executions, listed.

use crate::{expect_error, request_id, Server};
use reqwest::Method;
use sandpit_api::{ErrorBody, RestConfig};
use sandpit_core::prelude::*;
use sandpit_core::{ErrorType, Execution, ExecutionStatus, List, ListExecutions};
use serde_json::{json, Value};
use std::time::Duration;

/// Split a complete event-stream body into (event, data) frames and comments.
fn frames(body: &str) -> (Vec<(String, String)>, Vec<String>) {
    let mut events = Vec::new();
    let mut comments = Vec::new();
    for block in body.split("\n\n").filter(|b| !b.is_empty()) {
        let mut event = String::new();
        let mut data = Vec::new();
        for line in block.lines() {
            if let Some(c) = line.strip_prefix(':') {
                comments.push(c.trim().to_owned());
            } else if let Some(e) = line.strip_prefix("event: ") {
                event = e.to_owned();
            } else if let Some(d) = line.strip_prefix("data: ") {
                data.push(d.to_owned());
            } else {
                panic!("unexpected line {line:?} in {body:?}");
            }
        }
        if !event.is_empty() || !data.is_empty() {
            events.push((event, data.join("\n")));
        }
    }
    (events, comments)
}

async fn stream(s: &Server, id: &str, body: Value, accept: bool) -> reqwest::Response {
    let mut r = s
        .a(Method::POST, &format!("/sandboxes/{id}/exec"))
        .json(&body);
    if accept {
        r = r.header("accept", "text/event-stream");
    }
    r.send().await.unwrap()
}

fn assert_sse(r: &reqwest::Response) {
    assert_eq!(r.status(), 200);
    assert!(r.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    request_id(r);
}

#[tokio::test]
async fn stream_flag_gives_stdout_stderr_then_exit() {
    let s = Server::start().await;
    let id = s.create().await;
    for (body, accept) in [
        (json!({"command": "make", "stream": true}), false),
        (json!({"command": "make"}), true),
    ] {
        let r = stream(&s, &id, body, accept).await;
        assert_sse(&r);
        let (events, _) = frames(&r.text().await.unwrap());
        let names: Vec<&str> = events.iter().map(|(e, _)| e.as_str()).collect();
        assert_eq!(names, ["start", "stdout", "stderr", "stdout", "exit"]);
        // First the execution as it starts: its id, before any output.
        let start: Execution = serde_json::from_str(&events[0].1).unwrap();
        assert_eq!(start.status, ExecutionStatus::Running);
        assert_eq!(start.finished_at, None);
        for (event, data) in [(1, "hello "), (2, "warning\n"), (3, "world\n")] {
            assert_eq!(
                serde_json::from_str::<Value>(&events[event].1).unwrap(),
                json!({ "data": data })
            );
        }
        let exit: Execution = serde_json::from_str(&events[4].1).unwrap();
        assert_eq!(exit.status, ExecutionStatus::Completed);
        assert_eq!(exit.id, start.id);
        assert_eq!(
            (exit.stdout, exit.stderr),
            ("hello world\n".into(), "warning\n".into())
        );
        assert_eq!(exit.object, "execution");
        assert_eq!(exit.sandbox_id, id);
    }
}

#[tokio::test]
async fn platform_failure_is_an_error_event() {
    let s = Server::start().await;
    let id = s.create().await;
    let r = stream(&s, &id, json!({"command": "crash", "stream": true}), false).await;
    assert_sse(&r);
    let rid = request_id(&r);
    let (events, _) = frames(&r.text().await.unwrap());
    assert_eq!(events[0].0, "start");
    assert_eq!(
        events[1],
        ("stdout".to_owned(), r#"{"data":"partial"}"#.to_owned())
    );
    assert_eq!(events[2].0, "error");
    assert_eq!(events.len(), 3);
    let e: ErrorBody = serde_json::from_str(&events[2].1).unwrap();
    assert_eq!(e.error.kind, ErrorType::ServiceUnavailable);
    assert_eq!(e.request_id, rid);

    // A stream that ends without an exit is reported, not silently cut.
    let r = stream(&s, &id, json!({"command": "vanish", "stream": true}), false).await;
    let (events, _) = frames(&r.text().await.unwrap());
    assert_eq!(events[1].0, "stderr");
    let e: ErrorBody = serde_json::from_str(&events[2].1).unwrap();
    assert_eq!(e.error.kind, ErrorType::InternalError);
}

#[tokio::test]
async fn errors_before_the_stream_are_plain_json() {
    let s = Server::start().await;
    let id = s.create().await;
    let r = s
        .b(Method::POST, &format!("/sandboxes/{id}/exec"))
        .header("accept", "text/event-stream")
        .json(&json!({"command": "ls", "stream": true}))
        .send()
        .await
        .unwrap();
    expect_error(r, 404, ErrorType::NotFound).await;
}

#[tokio::test]
async fn pings_keep_it_alive_and_disconnect_cancels() {
    let s = Server::with_config(RestConfig {
        sse_ping_interval: Duration::from_millis(50),
        ..RestConfig::default()
    })
    .await;
    let id = s.create().await;
    let mut r = stream(&s, &id, json!({"command": "hang", "stream": true}), false).await;
    assert_sse(&r);
    let mut text = String::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while text.matches(": ping\n\n").count() < 2 {
        let chunk = tokio::time::timeout_at(deadline, r.chunk())
            .await
            .expect("pings within 10 s")
            .unwrap()
            .expect("stream still open");
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    let (events, comments) = frames(&text);
    assert_eq!(events[0].0, "start");
    assert_eq!(
        events[1],
        ("stdout".to_owned(), r#"{"data":"started\n"}"#.to_owned())
    );
    assert!(comments.iter().all(|c| c == "ping"), "{comments:?}");
    assert_eq!(s.fake.cancelled(), 0);

    // The client goes away: the server drops the ExecStream, which cancels.
    drop(r);
    s.fake.wait_cancelled(1, Duration::from_secs(10)).await;
}

#[tokio::test]
async fn default_ping_interval_is_15_s() {
    assert_eq!(
        RestConfig::default().sse_ping_interval,
        Duration::from_secs(15)
    );
    assert_eq!(RestConfig::default().max_body_bytes, 64 * 1024 * 1024);
}

#[tokio::test]
async fn disconnect_is_noticed_without_waiting_for_a_ping() {
    let s = Server::with_config(RestConfig {
        sse_ping_interval: Duration::from_secs(3600),
        ..RestConfig::default()
    })
    .await;
    let id = s.create().await;
    let mut r = stream(&s, &id, json!({"command": "hang", "stream": true}), false).await;
    assert_sse(&r);
    let first = r.chunk().await.unwrap().unwrap();
    assert!(String::from_utf8_lossy(&first).contains("started"));
    drop(r);
    s.fake.wait_cancelled(1, Duration::from_secs(3)).await;
}

#[tokio::test]
async fn a_sandboxs_executions_are_listed_newest_first_a_page_at_a_time() {
    let s = Server::start().await;
    let id = s.create().await;
    let other = s.create().await;
    let mut ran = Vec::new();
    for command in ["echo 1", "echo 2", "echo 3"] {
        let r = s
            .a(Method::POST, &format!("/sandboxes/{id}/exec"))
            .json(&json!({ "command": command }))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        ran.push(r.json::<Execution>().await.unwrap().id);
    }
    // Another sandbox's are not listed.
    let r = s
        .a(Method::POST, &format!("/sandboxes/{other}/exec"))
        .json(&json!({ "command": "echo elsewhere" }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);

    let page = |query: String| {
        let r = s.a(Method::GET, &format!("/sandboxes/{id}/executions{query}"));
        async move { r.send().await.unwrap() }
    };
    let r = page("?limit=2".into()).await;
    assert_eq!(r.status(), 200);
    let first: List<Execution> = r.json().await.unwrap();
    let ids: Vec<&str> = first.data.iter().map(|x| x.id.as_str()).collect();
    assert_eq!(ids, [ran[2].as_str(), ran[1].as_str()], "newest first");
    assert!(first.has_more);
    assert_eq!(first.next_cursor.as_deref(), Some(ran[1].as_str()));
    let r = page(format!("?limit=2&starting_after={}", ran[1])).await;
    let second: List<Execution> = r.json().await.unwrap();
    let ids: Vec<&str> = second.data.iter().map(|x| x.id.as_str()).collect();
    assert_eq!(ids, [ran[0].as_str()]);
    assert!(!second.has_more && second.next_cursor.is_none());
    assert!(second.data[0].stdout.contains('1'), "{:?}", second.data[0]);

    // A cursor of another sandbox, a bad limit, another account.
    expect_error(
        page("?starting_after=exec_nope".into()).await,
        400,
        ErrorType::InvalidRequest,
    )
    .await;
    expect_error(
        page("?limit=0".into()).await,
        400,
        ErrorType::InvalidRequest,
    )
    .await;
    let r = s
        .b(Method::GET, &format!("/sandboxes/{id}/executions"))
        .send()
        .await
        .unwrap();
    expect_error(r, 404, ErrorType::NotFound).await;

    // Through the Rust client, the same page.
    let api = sandpit_api::RemoteApi::new(&format!("{}/v1/", s.url)).unwrap();
    let me = api.authenticate(sandpit_fake::KEY_A).await.unwrap();
    let q = ListExecutions {
        limit: Some(2),
        starting_after: None,
    };
    assert_eq!(api.list_executions(&me, &id, q).await.unwrap(), first);
}
