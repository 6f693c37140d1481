//! Exec as server-sent events: framing, pings, errors, and cancellation
//! when the client goes away.

use crate::{expect_error, request_id, Server};
use reqwest::Method;
use sandpit_api::{ErrorBody, RestConfig};
use sandpit_core::{ErrorType, Execution, ExecutionStatus};
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
        assert_eq!(names, ["stdout", "stderr", "stdout", "exit"]);
        for (event, data) in [(0, "hello "), (1, "warning\n"), (2, "world\n")] {
            assert_eq!(
                serde_json::from_str::<Value>(&events[event].1).unwrap(),
                json!({ "data": data })
            );
        }
        let exit: Execution = serde_json::from_str(&events[3].1).unwrap();
        assert_eq!(exit.status, ExecutionStatus::Completed);
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
    assert_eq!(
        events[0],
        ("stdout".to_owned(), r#"{"data":"partial"}"#.to_owned())
    );
    assert_eq!(events[1].0, "error");
    assert_eq!(events.len(), 2);
    let e: ErrorBody = serde_json::from_str(&events[1].1).unwrap();
    assert_eq!(e.error.kind, ErrorType::ServiceUnavailable);
    assert_eq!(e.request_id, rid);

    // A stream that ends without an exit is reported, not silently cut.
    let r = stream(&s, &id, json!({"command": "vanish", "stream": true}), false).await;
    let (events, _) = frames(&r.text().await.unwrap());
    assert_eq!(events[0].0, "stderr");
    let e: ErrorBody = serde_json::from_str(&events[1].1).unwrap();
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
    assert_eq!(
        events[0],
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
