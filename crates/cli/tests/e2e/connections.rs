//! What a client can hold open on `sandpit serve`'s listener is bounded: a
//! real server (no VMs needed), thousands of real idle and half-sent
//! connections from this test, and the API answering meanwhile.

use crate::common::serve::*;
use crate::common::*;
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

/// One HTTP/1.1 response (with a `content-length`) read off `c`, leaving
/// the connection open.
fn one_response(c: &mut TcpStream) -> String {
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = c.read(&mut buf).expect("the response");
        assert!(
            n > 0,
            "closed before its response: {:?}",
            String::from_utf8_lossy(&got)
        );
        got.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&got).to_string();
        let Some((head, body)) = text.split_once("\r\n\r\n") else {
            continue;
        };
        let length: usize = head
            .lines()
            .find_map(|l| {
                l.to_ascii_lowercase()
                    .strip_prefix("content-length: ")
                    .map(str::to_string)
            })
            .expect("a content-length")
            .trim()
            .parse()
            .unwrap();
        if body.len() >= length {
            return text;
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
    // A connection between two requests is kept past the head's timeout,
    // as a client's pool keeps it, and the next request on it is answered:
    // the server lets go of it only after the idle timeout.
    let mut kept = TcpStream::connect(addr(&server)).unwrap();
    let get = format!(
        "GET /v1/service HTTP/1.1\r\nHost: {}\r\n\r\n",
        addr(&server)
    );
    for _ in 0..2 {
        kept.write_all(get.as_bytes()).unwrap();
        let answer = one_response(&mut kept);
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        std::thread::sleep(Duration::from_millis(2_500));
    }
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

/// The most memory the process has held so far (its high-water mark), in bytes.
fn peak_memory(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib * 1024
}

/// Bodies held at once, and file transfers of one account, in the test's server.
const BODY_BUDGET_MB: u64 = 64;
const TRANSFERS: u64 = 2;

#[test]
fn parallel_uploads_are_held_to_the_body_budget_and_the_accounts_transfers() {
    use base64::Engine;
    let data = data_dir();
    let server = Server::start_with(
        &data,
        &format!(
            "[limits]\nbody_budget_mb = {BODY_BUDGET_MB}\nmax_concurrent_transfers = {TRANSFERS}\n"
        ),
    );
    let key = server
        .admin_key
        .clone()
        .expect("first start prints the admin key");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let api = Rest::new(&server, &key);
        let (st, sbx) = api
            .post("/sandboxes", serde_json::json!({"timeout_minutes": 10}))
            .await;
        assert_eq!(st, 201, "{sbx}");
        let id = sbx["id"].as_str().unwrap().to_string();
        let (st, info) = api.get("/service").await;
        assert_eq!(st, 200);
        assert_eq!(info["limits"]["max_concurrent_transfers"], TRANSFERS);

        // 16 uploads of 12 MiB at once: 16 MiB of JSON each, 256 MiB in all,
        // and a decoded copy and a queued copy each behind that.
        let before = peak_memory(server.child.id());
        let file = vec![0x5au8; 12 << 20];
        let body = serde_json::json!({
            "path": "up.bin",
            "content": base64::engine::general_purpose::STANDARD.encode(&file),
            "encoding": "base64",
        });
        let uploads: Vec<_> = (0..16)
            .map(|i| {
                let (http, url, key) = (api.http.clone(), api.url.clone(), api.key.clone());
                let mut body = body.clone();
                body["path"] = format!("up-{i}.bin").into();
                let id = id.clone();
                // As a client should: a 503 (the budget stayed full for
                // its wait, on a busy host) is sent again. The server
                // answers it before reading the body and closes the
                // connection, so the client may see only the close: a PUT
                // is idempotent, and that is sent again too.
                tokio::spawn(async move {
                    let mut tries = 0;
                    loop {
                        tries += 1;
                        let sent = http
                            .put(format!("{url}/v1/sandboxes/{id}/files"))
                            .bearer_auth(&key)
                            .json(&body)
                            .send()
                            .await;
                        let (status, text) = match sent {
                            Ok(r) => (r.status().as_u16(), r.text().await.unwrap()),
                            Err(e) if tries < 5 => {
                                eprintln!("upload {i}: {e}; sent again");
                                tokio::time::sleep(Duration::from_secs(1)).await;
                                continue;
                            }
                            Err(e) => panic!("upload {i}, try {tries}: {e}"),
                        };
                        if status != 503 || tries == 5 {
                            return (status, text);
                        }
                        assert!(text.contains("request bodies already"), "{text}");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                })
            })
            .collect();
        for u in uploads {
            let (status, text) = u.await.unwrap();
            assert_eq!(status, 200, "{text}");
            assert!(text.contains("\"bytes\":12582912"), "{text}");
        }
        let grown = peak_memory(server.child.id()).saturating_sub(before);
        eprintln!("the server's peak memory grew by {} MiB", grown >> 20);
        // Unbounded, all 16 bodies and their copies were in memory at once;
        // held to 64 MiB of bodies and 2 transfers, far less.
        assert!(
            grown < 320 << 20,
            "the server's peak memory grew by {} MiB",
            grown >> 20
        );
        let (st, listing) = api
            .get(&format!("/sandboxes/{id}/files?path=/workspace&list=true"))
            .await;
        assert_eq!(st, 200);
        let sizes: Vec<_> = listing["entries"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["name"].as_str().unwrap().starts_with("up-"))
            .map(|e| e["size_bytes"].as_u64().unwrap())
            .collect();
        assert_eq!(sizes, vec![12 << 20; 16]);
    });
}

#[test]
fn no_sandbox_starts_on_a_disk_under_its_reserve() {
    let data = data_dir();
    // A reserve no disk has: every create is refused, saying why.
    let server = Server::start_with(&data, "[limits]\ndisk_reserve_mb = 1000000000\n");
    let key = server
        .admin_key
        .clone()
        .expect("first start prints the admin key");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let api = Rest::new(&server, &key);
        let (_, before) = api.get("/account").await;
        let (st, e) = api
            .post("/sandboxes", serde_json::json!({"timeout_minutes": 5}))
            .await;
        assert_eq!(st, 503, "{e}");
        assert_eq!(e["error"]["type"], "service_unavailable", "{e}");
        let message = e["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("under its reserve of 1000000000 MiB"),
            "{message}"
        );
        // Nothing was charged or left running.
        let (st, sandboxes) = api.get("/sandboxes").await;
        assert_eq!(st, 200);
        assert_eq!(sandboxes["data"], serde_json::json!([]), "{sandboxes}");
        let (_, after) = api.get("/account").await;
        assert_eq!(
            after["credit_remaining_usd"],
            before["credit_remaining_usd"]
        );
    });
}

/// Byte `i` of test file `k`: a pattern that differs per file and per offset.
fn pattern(k: u8, i: u64) -> u8 {
    (i.wrapping_mul(31) >> 3) as u8 ^ k
}

/// Test file `k` of `len` bytes as a request body made as it is sent, in
/// 1 MiB pieces; `fail_after` cuts it with an error after that many bytes.
fn streamed_file(k: u8, len: u64, fail_after: Option<u64>) -> reqwest::Body {
    const PIECE: u64 = 1 << 20;
    let pieces = futures_util::stream::unfold(0u64, move |at| async move {
        if at >= len {
            return None;
        }
        if fail_after.is_some_and(|f| at >= f) {
            // Let the pieces already sent reach the guest first.
            tokio::time::sleep(Duration::from_millis(500)).await;
            return Some((Err(std::io::Error::other("the client gave up")), len));
        }
        let end = (at + PIECE).min(len);
        let piece: Vec<u8> = (at..end).map(|i| pattern(k, i)).collect();
        Some((Ok::<_, std::io::Error>(piece), end))
    });
    reqwest::Body::wrap_stream(pieces)
}

#[test]
fn raw_file_bodies_are_streamed_both_ways_and_a_cut_upload_leaves_nothing() {
    use futures_util::StreamExt;
    const FILE: u64 = 64 << 20;
    let data = data_dir();
    let server = Server::start_with(
        &data,
        "[limits]\nmax_write_bytes = 134217728\nmax_read_bytes = 134217728\n\
         max_concurrent_transfers = 4\n",
    );
    let key = server
        .admin_key
        .clone()
        .expect("first start prints the admin key");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let api = Rest::new(&server, &key);
        let (st, sbx) = api
            .post("/sandboxes", serde_json::json!({"timeout_minutes": 10}))
            .await;
        assert_eq!(st, 201, "{sbx}");
        let id = sbx["id"].as_str().unwrap().to_string();
        let files = format!("{}/v1/sandboxes/{id}/files", api.url);
        let put = |path: &str, body: reqwest::Body, len: Option<u64>| {
            let mut r = api
                .http
                .put(format!("{files}?path={path}"))
                .bearer_auth(&api.key)
                .header("content-type", "application/octet-stream")
                .body(body);
            if let Some(len) = len {
                r = r.header("content-length", len);
            }
            r.send()
        };

        // Four uploads of 64 MiB at once, sent as they are made.
        let before = peak_memory(server.child.id());
        let uploads: Vec<_> = (0..4u8)
            .map(|k| {
                put(
                    &format!("up-{k}.bin"),
                    streamed_file(k, FILE, None),
                    Some(FILE),
                )
            })
            .collect();
        for (k, r) in futures_util::future::join_all(uploads)
            .await
            .into_iter()
            .enumerate()
        {
            // A server that answers early (a guest that took nothing for
            // its deadline, on a busy host) closes the connection under
            // the body: the client sees the close, and sends it again.
            let r = match r {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("upload {k}: {e}; sent again");
                    let path = format!("up-{k}.bin");
                    put(&path, streamed_file(k as u8, FILE, None), Some(FILE))
                        .await
                        .unwrap()
                }
            };
            assert_eq!(r.status(), 200, "{:?}", r.text().await);
            let done: serde_json::Value = r.json().await.unwrap();
            assert_eq!(done["bytes"], FILE, "{done}");
            assert_eq!(done["path"], format!("/workspace/up-{k}.bin"), "{done}");
        }

        // Read back as themselves, byte for byte.
        for k in [0u8, 3] {
            let r = api
                .http
                .get(format!("{files}?path=up-{k}.bin"))
                .bearer_auth(&api.key)
                .header("accept", "application/octet-stream")
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            assert_eq!(r.content_length(), Some(FILE));
            assert_eq!(
                r.headers()["x-sandpit-path"],
                format!("/workspace/up-{k}.bin")
            );
            let mut at = 0u64;
            let mut body = r.bytes_stream();
            while let Some(piece) = body.next().await {
                for b in piece.unwrap() {
                    assert_eq!(b, pattern(k, at), "byte {at} of up-{k}.bin");
                    at += 1;
                }
            }
            assert_eq!(at, FILE);
        }
        let grown = peak_memory(server.child.id()).saturating_sub(before);
        eprintln!(
            "256 MiB up and 128 MiB down: the server's peak memory grew by {} MiB",
            grown >> 20
        );
        // Held whole, each file was in memory at least once, several at once.
        assert!(grown < FILE / 2, "grew by {} MiB", grown >> 20);

        // An upload the client cuts midway writes nothing, and leaves nothing.
        let cut = put("cut.bin", streamed_file(9, FILE, Some(8 << 20)), Some(FILE)).await;
        assert!(cut.is_err() || cut.unwrap().status() != 200);
        let mut left = String::new();
        for _ in 0..100 {
            let (st, ex) = api
                .post(
                    &format!("/sandboxes/{id}/exec"),
                    serde_json::json!({"command": "ls -A /workspace"}),
                )
                .await;
            assert_eq!(st, 200, "{ex}");
            left = ex["stdout"].as_str().unwrap().to_string();
            if !left.contains(".sandpit-upload") {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(left, "up-0.bin\nup-1.bin\nup-2.bin\nup-3.bin\n");

        // A body that does not say its length, or says more than it has.
        let r = put("chunked.bin", streamed_file(1, 1000, None), None)
            .await
            .unwrap();
        assert_eq!(r.status(), 400);
        let e: serde_json::Value = r.json().await.unwrap();
        assert!(
            e["error"]["message"]
                .as_str()
                .unwrap()
                .contains("Content-Length"),
            "{e}"
        );
        // Over the write limit: refused before anything is sent.
        // (Only the head is sent: the answer comes without the body.)
        let mut c = TcpStream::connect(addr(&server)).unwrap();
        write!(
            c,
            "PUT /v1/sandboxes/{id}/files?path=big.bin HTTP/1.1\r\nHost: {}\r\n\
             Authorization: Bearer {}\r\nContent-Type: application/octet-stream\r\n\
             Content-Length: 1073741824\r\n\r\n",
            addr(&server),
            api.key
        )
        .unwrap();
        c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut answer = vec![0u8; 4096];
        let n = c.read(&mut answer).unwrap();
        let answer = String::from_utf8_lossy(&answer[..n]);
        assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
        assert!(answer.contains("the limit is 134217728 bytes"), "{answer}");
        // The JSON form still answers as the public API says.
        let (st, done) = api
            .call(
                reqwest::Method::PUT,
                &format!("/sandboxes/{id}/files"),
                Some(serde_json::json!({"path": "j.txt", "content": "hi\n"})),
            )
            .await;
        assert_eq!(st, 200, "{done}");
        assert_eq!(done["bytes"], 3);
    });
}
