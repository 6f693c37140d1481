//! The committed `docs/openapi.json` is what the code generates
//! (`SANDPIT_BLESS=1 cargo test -p sandpit-api` rewrites it), it is
//! self-consistent, and it describes exactly the routes the router serves.

use crate::Server;
use serde_json::Value;
use std::collections::BTreeSet;

const COMMITTED: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/openapi.json");

fn rendered() -> String {
    let mut s = serde_json::to_string_pretty(&sandpit_api::openapi()).unwrap();
    s.push('\n');
    s
}

#[test]
fn committed_document_is_current() {
    let want = rendered();
    if std::env::var_os("SANDPIT_BLESS").is_some_and(|v| v == "1") {
        std::fs::write(COMMITTED, &want).unwrap();
        return;
    }
    let have = std::fs::read_to_string(COMMITTED).unwrap_or_default();
    assert!(
        have == want,
        "docs/openapi.json is not what the code generates; \
         run `SANDPIT_BLESS=1 cargo test -p sandpit-api committed_document` and commit it"
    );
}

fn refs(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            for (k, v) in m {
                if k == "$ref" {
                    out.push(v.as_str().unwrap().to_owned());
                } else {
                    refs(v, out);
                }
            }
        }
        Value::Array(a) => a.iter().for_each(|v| refs(v, out)),
        _ => {}
    }
}

#[test]
fn every_ref_resolves_and_ids_are_unique() {
    let doc = sandpit_api::openapi();
    assert_eq!(doc["openapi"], "3.1.0");
    let mut all = Vec::new();
    refs(&doc, &mut all);
    assert!(!all.is_empty());
    for r in &all {
        let pointer = r.strip_prefix('#').expect("local refs only");
        assert!(doc.pointer(pointer).is_some(), "dangling {r}");
    }
    let schemas = doc["components"]["schemas"].as_object().unwrap();
    for name in [
        "Sandbox",
        "Execution",
        "Error",
        "CreateSandbox",
        "ExecParams",
        "WriteFile",
        "Port",
        "Usage",
        "Account",
        "ServiceInfo",
        "OutputChunk",
        "FileList",
        "FileContent",
        "Snapshot",
        "SnapshotList",
        "CreateSnapshot",
        "ForkSandbox",
        "Fork",
        "RestoreSandbox",
        "Secret",
        "PutSecret",
        "Event",
        "EventList",
        "Webhook",
        "WebhookList",
        "CreateWebhook",
        "WebhookDelivery",
        "WebhookDeliveryList",
        "DeliveryAttempt",
    ] {
        assert!(schemas.contains_key(name), "no schema {name}");
    }
    // No JSON Schema leftovers that do not belong in components.
    assert!(!serde_json::to_string(&doc).unwrap().contains("\"$schema\""));
    let mut ids = BTreeSet::new();
    for (_, item) in doc["paths"].as_object().unwrap() {
        for (_, op) in item.as_object().unwrap() {
            assert!(ids.insert(op["operationId"].as_str().unwrap().to_owned()));
            assert!(op["responses"]["400"].is_object());
        }
    }
    // The error schema says what the body is.
    let error = &schemas["Error"];
    assert!(error["properties"]["request_id"].is_object(), "{error}");
}

fn documented() -> BTreeSet<(String, String)> {
    let doc = sandpit_api::openapi();
    let mut out = BTreeSet::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for method in item.as_object().unwrap().keys() {
            out.insert((method.to_uppercase(), path.clone()));
        }
    }
    out
}

#[test]
fn documents_exactly_the_contract_routes() {
    let want: BTreeSet<(String, String)> = [
        ("GET", "/v1/service"),
        ("GET", "/v1/openapi.json"),
        ("GET", "/v1/account"),
        ("GET", "/v1/usage"),
        ("POST", "/v1/sandboxes"),
        ("GET", "/v1/sandboxes"),
        ("GET", "/v1/sandboxes/{id}"),
        ("DELETE", "/v1/sandboxes/{id}"),
        ("POST", "/v1/sandboxes/{id}/extend"),
        // Sandpit's own: a sandbox's egress lists.
        ("PUT", "/v1/sandboxes/{id}/network"),
        ("POST", "/v1/sandboxes/{id}/snapshots"),
        ("POST", "/v1/sandboxes/{id}/fork"),
        ("POST", "/v1/sandboxes/{id}/restore"),
        ("POST", "/v1/sandboxes/{id}/pause"),
        ("POST", "/v1/sandboxes/{id}/resume"),
        ("GET", "/v1/snapshots"),
        ("GET", "/v1/snapshots/{id}"),
        ("DELETE", "/v1/snapshots/{id}"),
        ("POST", "/v1/sandboxes/{id}/exec"),
        ("GET", "/v1/executions/{id}"),
        ("GET", "/v1/sandboxes/{id}/executions"),
        ("PUT", "/v1/sandboxes/{id}/files"),
        ("GET", "/v1/sandboxes/{id}/files"),
        ("DELETE", "/v1/sandboxes/{id}/files"),
        ("POST", "/v1/sandboxes/{id}/ports"),
        ("GET", "/v1/sandboxes/{id}/ports"),
        ("DELETE", "/v1/sandboxes/{id}/ports/{port}"),
        // Sandpit's own: a private port's signed URL.
        ("POST", "/v1/sandboxes/{id}/ports/{port}/signed-url"),
        ("GET", "/v1/sandboxes/{id}/pty"),
        ("POST", "/v1/sandboxes/{id}/pty/tokens"),
        // Sandpit's own: templates.
        ("POST", "/v1/templates"),
        ("GET", "/v1/templates"),
        ("GET", "/v1/templates/{id}"),
        ("DELETE", "/v1/templates/{id}"),
        ("PUT", "/v1/templates/files/{sha256}"),
        // Sandpit's own: secrets that never enter the VM.
        ("GET", "/v1/secrets"),
        ("PUT", "/v1/secrets/{name}"),
        ("DELETE", "/v1/secrets/{name}"),
        // Sandpit's own: volumes.
        ("POST", "/v1/volumes"),
        ("GET", "/v1/volumes"),
        ("GET", "/v1/volumes/{volume}"),
        ("PATCH", "/v1/volumes/{volume}"),
        ("DELETE", "/v1/volumes/{volume}"),
        ("POST", "/v1/volumes/{volume}/move"),
        // Sandpit's own: a volume's files without a sandbox.
        ("GET", "/v1/volumes/{volume}/files"),
        ("PUT", "/v1/volumes/{volume}/files"),
        ("POST", "/v1/volumes/{volume}/files"),
        ("PATCH", "/v1/volumes/{volume}/files"),
        ("DELETE", "/v1/volumes/{volume}/files"),
        // Sandpit's own: lifecycle events and the webhooks they are sent to.
        ("GET", "/v1/events"),
        ("GET", "/v1/sandboxes/{id}/events"),
        ("POST", "/v1/webhooks"),
        ("GET", "/v1/webhooks"),
        ("GET", "/v1/webhooks/{id}"),
        ("DELETE", "/v1/webhooks/{id}"),
        ("GET", "/v1/webhooks/{id}/deliveries"),
        (
            "POST",
            "/v1/webhooks/{id}/deliveries/{delivery_id}/redeliver",
        ),
    ]
    .into_iter()
    .map(|(m, p)| (m.to_owned(), p.to_owned()))
    .collect();
    assert_eq!(documented(), want);
}

#[tokio::test]
async fn every_documented_route_is_served() {
    let s = Server::start().await;
    for (method, path) in documented() {
        let url = format!(
            "{}{}",
            s.url,
            path.replace("{id}", "x")
                .replace("{port}", "1")
                .replace("{name}", "X")
                .replace("{volume}", "v")
                .replace("{delivery_id}", "evt_x")
        );
        let m = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
        let r = s.http.request(m, &url).send().await.unwrap();
        let status = r.status().as_u16();
        let public = path == "/v1/service" || path == "/v1/openapi.json";
        assert_eq!(status, if public { 200 } else { 401 }, "{method} {path}");
    }
}
