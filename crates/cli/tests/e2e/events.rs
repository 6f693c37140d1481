//! Lifecycle events and webhooks through a real `sandpit serve` and real
//! VMs: a receiver in a network namespace of its own (Python's HTTP
//! server, which checks each delivery's signature with Python's own HMAC,
//! not Sandpit's code) gets every event of a sandbox's life once, in the
//! log's order; the receiver down for 30 s gets them after with the
//! retries shown; the server SIGKILLed between a change and its delivery
//! delivers it after its restart; a webhook to an address the operator
//! does not allow is refused when registered.

use crate::common::netns::TestHost;
use crate::common::serve::{Rest, Server};
use crate::common::*;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap()
}

const HOST_SIDE: &str = "10.231.7.1";
const RECEIVER: &str = "10.231.7.2";
const PORT: u16 = 8099;

/// The receiver: each POST is checked against Standard Webhooks' signature
/// (v1, HMAC-SHA256 of "id.timestamp.body" keyed with the secret's bytes)
/// and written as a JSON line; a bad signature is answered 400.
const RECEIVER_PY: &str = r#"
import base64, hashlib, hmac, http.server, json, sys
addr, port, secret, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
key = base64.b64decode(secret[len("whsec_"):])
class Hook(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        mid = self.headers.get("webhook-id", "")
        ts = self.headers.get("webhook-timestamp", "")
        sig = self.headers.get("webhook-signature", "")
        mac = hmac.new(key, mid.encode() + b"." + ts.encode() + b"." + body, hashlib.sha256)
        want = "v1," + base64.b64encode(mac.digest()).decode()
        valid = any(hmac.compare_digest(s, want) for s in sig.split(" "))
        with open(out, "a") as f:
            f.write(json.dumps({"id": mid, "valid": valid, "body": json.loads(body)}) + "\n")
        self.send_response(200 if valid else 400)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer((addr, port), Hook).serve_forever()
"#;

struct Receiver {
    child: Child,
}

impl Receiver {
    fn start(host: &TestHost, secret: &str, out: &Path) -> Receiver {
        let mut child = Command::new("ip")
            .args(["netns", "exec", &host.ns, "python3", "-c", RECEIVER_PY])
            .args([RECEIVER, &PORT.to_string(), secret])
            .arg(out)
            .stdout(Stdio::null())
            .spawn()
            .expect("python3 (install python3)");
        for _ in 0..100 {
            if std::net::TcpStream::connect((RECEIVER, PORT)).is_ok() {
                return Receiver { child };
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = child.kill();
        let _ = child.wait();
        panic!("the webhook receiver did not start");
    }

    fn stop(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // Down: nothing listens (connections are refused).
        assert!(std::net::TcpStream::connect((RECEIVER, PORT)).is_err());
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What the receiver got so far: (event id, valid signature, body).
fn received(out: &Path) -> Vec<(String, bool, Value)> {
    std::fs::read_to_string(out)
        .unwrap_or_default()
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            (
                v["id"].as_str().unwrap().to_string(),
                v["valid"].as_bool().unwrap(),
                v["body"].clone(),
            )
        })
        .collect()
}

/// The types the receiver got for sandbox `id`, first arrivals in order.
fn types_received(out: &Path, id: &str) -> Vec<String> {
    let mut seen = std::collections::HashSet::new();
    received(out)
        .into_iter()
        .filter(|(_, _, b)| b["data"]["sandbox_id"] == id)
        .filter(|(eid, _, _)| seen.insert(eid.clone()))
        .map(|(_, _, b)| b["type"].as_str().unwrap().to_string())
        .collect()
}

/// Waits (up to `bound`) until the receiver has `sandbox.killed` of `id`.
fn until_killed_arrives(out: &Path, id: &str, bound: Duration, what: &str) {
    let t = Instant::now();
    while !types_received(out, id)
        .iter()
        .any(|t| t == "sandbox.killed")
    {
        assert!(
            t.elapsed() < bound,
            "{what}: sandbox.killed of {id} not delivered within {bound:?}; got {:?}",
            types_received(out, id)
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// The log's types for sandbox `id`, oldest first.
async fn logged(api: &Rest, id: &str) -> Vec<Value> {
    let (st, got) = api.get(&format!("/sandboxes/{id}/events")).await;
    assert_eq!(st, 200, "{got}");
    got["data"].as_array().unwrap().clone()
}

fn types(events: &[Value]) -> Vec<String> {
    events
        .iter()
        .map(|e| e["type"].as_str().unwrap().to_string())
        .collect()
}

async fn create(api: &Rest) -> String {
    let (st, sb) = api
        .post(
            "/sandboxes",
            json!({"size": "small", "timeout_minutes": 20}),
        )
        .await;
    assert_eq!(st, 201, "{sb}");
    sb["id"].as_str().unwrap().to_string()
}

async fn destroy(api: &Rest, id: &str) {
    let (st, got) = api
        .call(reqwest::Method::DELETE, &format!("/sandboxes/{id}"), None)
        .await;
    assert_eq!(st, 200, "{got}");
}

fn config() -> String {
    format!("[webhooks]\nallow = [\"{HOST_SIDE}/24\"]\n")
}

#[test]
fn webhooks_deliver_every_event_once_in_order_signed_through_outages_and_kills() {
    let host = TestHost::start("whook", HOST_SIDE, RECEIVER);
    let data = data_dir();
    let out: PathBuf = data.join("received.jsonl");
    let server = Server::start_with(&data, &config());
    let key = server.admin_key.clone().unwrap();
    let api = Rest::new(&server, &key);
    let runtime = rt();

    // Refused when registered: loopback, link-local, a private range the
    // operator did not allow, another scheme, an unknown type.
    let (hook, secret) = runtime.block_on(async {
        for (url, says) in [
            ("http://127.0.0.1:9/hook", "127.0.0.1"),
            ("http://[::1]:9/hook", "::1"),
            ("http://169.254.169.254/latest", "169.254.0.0/16"),
            ("http://10.231.8.2/hook", "10.0.0.0/8"),
            ("http://localhost:9/hook", "localhost resolves to"),
            ("ftp://10.231.7.2/hook", "http"),
        ] {
            let (st, got) = api.post("/webhooks", json!({ "url": url })).await;
            assert_eq!(st, 400, "{url}: {got}");
            let message = got["error"]["message"].as_str().unwrap_or_default();
            assert!(message.contains(says), "{url}: {got}");
        }
        let (st, got) = api
            .post(
                "/webhooks",
                json!({"url": format!("http://{RECEIVER}:{PORT}/hook"), "events": ["sandbox.bogus"]}),
            )
            .await;
        assert_eq!(st, 400, "{got}");
        let (st, hook) = api
            .post(
                "/webhooks",
                json!({"url": format!("http://{RECEIVER}:{PORT}/hook"), "description": "test"}),
            )
            .await;
        assert_eq!(st, 201, "{hook}");
        let secret = hook["secret"].as_str().unwrap().to_string();
        assert!(secret.starts_with("whsec_"), "{hook}");
        let id = hook["id"].as_str().unwrap().to_string();
        let (st, again) = api.get(&format!("/webhooks/{id}")).await;
        assert_eq!(st, 200, "{again}");
        assert!(again.get("secret").is_none(), "the secret is shown once: {again}");
        assert_eq!(again["events"], json!(["*"]));
        (id, secret)
    });
    let receiver = Receiver::start(&host, &secret, &out);

    // A whole life: every event arrives once, in the log's order, signed.
    let first = runtime.block_on(async {
        api.template_ready().await;
        let id = create(&api).await;
        for (path, body) in [
            ("pause", json!({})),
            ("resume", json!({})),
            ("extend", json!({"additional_minutes": 5})),
            ("snapshots", json!({})),
        ] {
            let (st, got) = api.post(&format!("/sandboxes/{id}/{path}"), body).await;
            assert!(st == 200 || st == 201, "{path}: {st} {got}");
        }
        destroy(&api, &id).await;
        id
    });
    until_killed_arrives(&out, &first, Duration::from_secs(60), "a whole life");
    let log = runtime.block_on(logged(&api, &first));
    let want = [
        "sandbox.created",
        "sandbox.started",
        "sandbox.paused",
        "sandbox.resumed",
        "sandbox.extended",
        "sandbox.snapshotted",
        "sandbox.destroying",
        "sandbox.killed",
    ];
    assert_eq!(types(&log), want, "{log:?}");
    let prefix = &key[..12];
    assert_eq!(log[0]["actor"], format!("key {prefix}"), "{}", log[0]);
    assert!(
        ["pool", "cold"].contains(&log[1]["detail"]["from"].as_str().unwrap_or_default()),
        "{}",
        log[1]
    );
    assert_eq!(log[0]["size"], "small");
    let got = received(&out);
    let of_first: Vec<&(String, bool, Value)> = got
        .iter()
        .filter(|(_, _, b)| b["data"]["sandbox_id"] == first.as_str())
        .collect();
    assert_eq!(
        of_first
            .iter()
            .map(|(i, _, _)| i.clone())
            .collect::<Vec<_>>(),
        log.iter()
            .map(|e| e["id"].as_str().unwrap().to_string())
            .collect::<Vec<_>>(),
        "each event once, in order"
    );
    assert!(of_first.iter().all(|(_, valid, _)| *valid), "signatures");
    assert_eq!(of_first[2].2["data"], log[2], "the body carries the event");
    // The account's log pages by cursor.
    runtime.block_on(async {
        let cursor = log[3]["cursor"].as_str().unwrap();
        let (st, page) = api.get(&format!("/events?after={cursor}&limit=2")).await;
        assert_eq!(st, 200, "{page}");
        assert_eq!(
            types(page["data"].as_array().unwrap()),
            want[4..6],
            "{page}"
        );
        assert_eq!(page["has_more"], true);
        assert_eq!(page["next_cursor"], log[5]["cursor"]);
    });

    // The receiver down for 30 s: what happened meanwhile arrives after,
    // in order, its retries shown.
    receiver.stop();
    let down = Instant::now();
    let second = runtime.block_on(async {
        let id = create(&api).await;
        destroy(&api, &id).await;
        id
    });
    std::thread::sleep(Duration::from_secs(30).saturating_sub(down.elapsed()));
    let receiver = Receiver::start(&host, &secret, &out);
    until_killed_arrives(&out, &second, Duration::from_secs(120), "after the outage");
    let log = runtime.block_on(logged(&api, &second));
    assert_eq!(types_received(&out, &second), types(&log));
    runtime.block_on(async {
        let (st, list) = api
            .get(&format!("/webhooks/{hook}/deliveries?limit=100"))
            .await;
        assert_eq!(st, 200, "{list}");
        let created = list["data"]
            .as_array()
            .unwrap()
            .iter()
            .find(|d| d["id"] == log[0]["id"])
            .unwrap_or_else(|| panic!("no delivery of {}: {list}", log[0]["id"]))
            .clone();
        assert_eq!(created["status"], "delivered", "{created}");
        let attempts = created["attempts"].as_array().unwrap();
        assert!(attempts.len() >= 2, "retries shown: {created}");
        assert!(attempts[0]["error"].is_string(), "{created}");
        assert_eq!(attempts.last().unwrap()["status_code"], 200, "{created}");
        let (st, hook) = api.get(&format!("/webhooks/{hook}")).await;
        assert_eq!(st, 200);
        assert_eq!(hook["pending"], 0, "{hook}");
        // Redelivered on request: once more, the same id.
        let (st, again) = api
            .post(
                &format!(
                    "/webhooks/{}/deliveries/{}/redeliver",
                    hook["id"].as_str().unwrap(),
                    log[0]["id"].as_str().unwrap()
                ),
                json!({}),
            )
            .await;
        assert_eq!(st, 200, "{again}");
    });
    let t = Instant::now();
    while received(&out)
        .iter()
        .filter(|(i, _, _)| *i == log[0]["id"])
        .count()
        < 2
    {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the redelivery did not arrive"
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    // The server SIGKILLed between the changes and their deliveries: they
    // are delivered after its restart.
    receiver.stop();
    let third = runtime.block_on(async {
        let id = create(&api).await;
        destroy(&api, &id).await;
        id
    });
    assert!(types_received(&out, &third).is_empty());
    server.sigkill();
    let _receiver = Receiver::start(&host, &secret, &out);
    let server = Server::start_with(&data, &config());
    let api = Rest::new(&server, &key);
    until_killed_arrives(&out, &third, Duration::from_secs(150), "after the restart");
    let log = runtime.block_on(logged(&api, &third));
    assert_eq!(
        types_received(&out, &third),
        types(&log),
        "in order, each at least once"
    );
    assert!(received(&out).iter().all(|(_, valid, _)| *valid));
    drop(server);
}
