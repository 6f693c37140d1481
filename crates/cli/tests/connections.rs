//! What a client can hold open on `sandpit serve`'s listener is bounded: a
//! real server (no VMs needed), thousands of real idle and half-sent
//! connections from this test, and the API answering meanwhile.

mod common;

use common::serve::*;
use common::*;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// Room for thousands of sockets in this test process.
fn raise_descriptor_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit on a local struct.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim), 0);
        lim.rlim_cur = lim.rlim_max;
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &lim), 0);
    }
    assert!(
        lim.rlim_cur >= 12_000,
        "the descriptor limit is {}",
        lim.rlim_cur
    );
}

fn addr(server: &Server) -> String {
    server.url.trim_start_matches("http://").to_string()
}

fn service_answers(server: &Server) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let r = reqwest::Client::builder()
            .timeout(Duration::from_secs(30))
            .build()
            .unwrap()
            .get(format!("{}/v1/service", server.url))
            .send()
            .await
            .expect("/v1/service answers");
        assert_eq!(r.status(), 200);
    });
}

/// Read until the server closes `c`, or fail at `deadline`.
fn closed_by_server(c: &mut TcpStream, deadline: Instant) -> bool {
    let mut buf = [0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        c.set_read_timeout(Some(left)).unwrap();
        match c.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue, // a 408 or a GOAWAY on the way out
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
}

#[test]
fn thousands_of_idle_and_half_sent_connections_neither_stop_the_api_nor_stay_open() {
    raise_descriptor_limit();
    let data = data_dir();
    let server = Server::start_with(
        &data,
        "[pool]\nsizes = {}\n[server]\nheader_timeout_secs = 2\nidle_timeout_secs = 3\n",
    );
    let mut conns = Vec::new();
    for i in 0..5000 {
        let mut c = TcpStream::connect(addr(&server)).unwrap();
        match i % 3 {
            // Says nothing at all.
            0 => {}
            // Half a request head, never finished.
            1 => c
                .write_all(b"POST /v1/sandboxes HTTP/1.1\r\nHost: localhost\r\ncontent-length: 2")
                .unwrap(),
            // HTTP/2: the preface and its settings, then nothing.
            _ => c
                .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
                .unwrap(),
        }
        conns.push(c);
    }
    // The API answers while they are all open.
    service_answers(&server);
    // And the server lets go of every one of them, none kept for ever.
    let deadline = Instant::now() + Duration::from_secs(30);
    let open: Vec<usize> = conns
        .iter_mut()
        .enumerate()
        .filter_map(|(i, c)| (!closed_by_server(c, deadline)).then_some(i))
        .collect();
    assert!(
        open.is_empty(),
        "{} of 5000 connections still open 30 s later (first: #{:?})",
        open.len(),
        open.first()
    );
    service_answers(&server);
}

#[test]
fn past_the_connection_limit_a_client_is_told_why() {
    raise_descriptor_limit();
    let data = data_dir();
    let server = Server::start_with(
        &data,
        "[pool]\nsizes = {}\n[server]\nmax_connections = 20\n",
    );
    let mut held: Vec<TcpStream> = (0..20)
        .map(|_| TcpStream::connect(addr(&server)).unwrap())
        .collect();
    // Accepted in order: let the server take all twenty first.
    std::thread::sleep(Duration::from_millis(500));
    let mut extra = TcpStream::connect(addr(&server)).unwrap();
    extra
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut answer = String::new();
    let _ = extra.read_to_string(&mut answer);
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer:?}");
    let body: serde_json::Value =
        serde_json::from_str(answer.split("\r\n\r\n").nth(1).unwrap()).unwrap();
    assert_eq!(body["error"]["type"], "service_unavailable", "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("20 connections"),
        "{body}"
    );
    assert!(answer.to_lowercase().contains("retry-after: 1"), "{answer}");
    // Room again once some go.
    held.truncate(10);
    std::thread::sleep(Duration::from_millis(500));
    service_answers(&server);
    drop(held);
}

#[test]
fn serving_beyond_the_loopback_without_tls_is_warned_about() {
    let data = data_dir();
    let server = Server::start_on(&data, "[pool]\nsizes = {}\n", "0.0.0.0:0");
    assert!(
        server
            .wait_for_log("WITHOUT TLS", Duration::from_secs(10))
            .is_some(),
        "no warning about clear text on 0.0.0.0"
    );
    let data = data_dir();
    let server = Server::start_with(&data, "[pool]\nsizes = {}\n");
    assert!(server
        .wait_for_log("WITHOUT TLS", Duration::from_secs(2))
        .is_none());
}

#[test]
fn mcp_answers_carry_request_ids_as_rest_answers_do() {
    let data = data_dir();
    let server = Server::start_with(&data, "[pool]\nsizes = {}\n");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let http = reqwest::Client::new();
        let init = serde_json::json!({
            "jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {"protocolVersion": "2025-11-25", "capabilities": {},
                       "clientInfo": {"name": "t", "version": "1"}}
        });
        for version in ["2025-11-25", "1999-01-01"] {
            let r = http
                .post(format!("{}/v1/mcp", server.url))
                .header("accept", "application/json, text/event-stream")
                .header("mcp-protocol-version", version)
                .json(&init)
                .send()
                .await
                .unwrap();
            let id = r
                .headers()
                .get("x-request-id")
                .map(|v| v.to_str().unwrap().to_string());
            assert!(
                id.is_some_and(|id| id.starts_with("req_")),
                "{version}: {:?}",
                r.headers()
            );
            // MCP's own error format is kept (the unsupported version is a JSON-RPC error).
            if version == "1999-01-01" {
                assert_eq!(r.status(), 400);
                let body: serde_json::Value = r.json().await.unwrap();
                assert_eq!(body["error"]["code"], -32022, "{body}");
            }
        }
    });
}
