//! Secrets over REST in front of the real core service, not the fake: their
//! checks, sealing and store are the service's own. It runs no VMs (a
//! control-plane replica's `Service::without_vms` over a SQLite file), so
//! what is tested is what needs none: put, list, replace, delete, the
//! refusals, and a create naming a secret the account has not.

use crate::expect_error;
use reqwest::Method;
use sandpit_core::config::ServiceConfig;
use sandpit_core::{ErrorType, Secret, Service};
use serde_json::{json, Value};

struct Real {
    url: String,
    http: reqwest::Client,
    key: String,
    dir: tempfile::TempDir,
}

impl Real {
    async fn start() -> Real {
        let dir = tempfile::tempdir().unwrap();
        let store = sandpit_store::Store::open_sqlite(dir.path().join("sandpit.db"))
            .await
            .unwrap();
        let config = ServiceConfig::default();
        sandpit_core::admin::create_account(&store, &config, "ann", 10.0)
            .await
            .unwrap();
        let (key, _) = sandpit_core::admin::create_key(&store, "ann")
            .await
            .unwrap();
        let svc = Service::without_vms(config, store);
        let app = sandpit_api::router(svc, sandpit_api::RestConfig::default());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/v1", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        Real {
            url,
            http: reqwest::Client::new(),
            key,
            dir,
        }
    }

    fn call(&self, method: Method, path: &str) -> reqwest::RequestBuilder {
        self.http
            .request(method, format!("{}{path}", self.url))
            .bearer_auth(&self.key)
    }

    async fn put(&self, name: &str, body: Value) -> reqwest::Response {
        self.call(Method::PUT, &format!("/secrets/{name}"))
            .json(&body)
            .send()
            .await
            .unwrap()
    }
}

const VALUE: &str = "sk-test-0123456789abcdef";

#[tokio::test]
async fn a_secret_is_stored_listed_without_its_value_replaced_and_deleted() {
    let s = Real::start().await;
    let r = s
        .put(
            "OPENAI_API_KEY",
            json!({"value": VALUE, "hosts": ["api.openai.com"]}),
        )
        .await;
    assert_eq!(r.status(), 200);
    let body: Value = r.json().await.unwrap();
    assert!(body.get("value").is_none(), "{body}");
    let first: Secret = serde_json::from_value(body).unwrap();
    assert_eq!(first.object, "secret");
    assert_eq!(first.name, "OPENAI_API_KEY");
    assert_eq!(first.hosts, ["api.openai.com"]);
    assert_eq!(first.header, "Authorization");
    assert_eq!(first.format, "Bearer {value}");
    assert_eq!(first.last_used_at, None);

    // Listed, never with its value; the store holds it sealed only.
    let r = s.call(Method::GET, "/secrets").send().await.unwrap();
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    assert!(!text.contains(VALUE), "{text}");
    let list: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(list["object"], "list");
    assert_eq!(list["data"][0]["name"], "OPENAI_API_KEY");
    assert!(list["data"][0].get("value").is_none(), "{list}");
    for file in ["sandpit.db", "sandpit.db-wal"] {
        let bytes = std::fs::read(s.dir.path().join(file)).unwrap_or_default();
        assert!(
            !bytes.windows(VALUE.len()).any(|w| w == VALUE.as_bytes()),
            "{file} holds the value in clear"
        );
    }

    // Put again (in another second: times are shown to the second):
    // replaced, created_at kept.
    tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
    let r = s
        .put(
            "OPENAI_API_KEY",
            json!({"value": "sk-other", "hosts": ["*.example.com"], "header": "x-api-key",
                   "format": "{value}"}),
        )
        .await;
    assert_eq!(r.status(), 200);
    let second: Secret = r.json().await.unwrap();
    assert_eq!(second.created_at, first.created_at);
    assert!(second.updated_at > first.updated_at);
    assert_eq!(
        (second.header.as_str(), second.format.as_str()),
        ("x-api-key", "{value}")
    );
    assert_eq!(second.hosts, ["*.example.com"]);

    // Deleted: answered with what it was; then 404.
    let r = s
        .call(Method::DELETE, "/secrets/OPENAI_API_KEY")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Secret>().await.unwrap(), second);
    let r = s
        .call(Method::DELETE, "/secrets/OPENAI_API_KEY")
        .send()
        .await
        .unwrap();
    let e = expect_error(r, 404, ErrorType::NotFound).await;
    assert!(
        e.error.message.contains("OPENAI_API_KEY"),
        "{}",
        e.error.message
    );
    let list: Value = s
        .call(Method::GET, "/secrets")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(list["data"], json!([]));
}

#[tokio::test]
async fn a_bad_secret_is_refused_saying_why() {
    let s = Real::start().await;
    let good = || json!({"value": VALUE, "hosts": ["api.example.com"]});
    for (name, body, why) in [
        ("MY-KEY", good(), "environment variable"),
        ("1KEY", good(), "environment variable"),
        (
            "KEY",
            json!({"value": "", "hosts": ["a.example.com"]}),
            "empty",
        ),
        (
            "KEY",
            json!({"value": "a\nb", "hosts": ["a.example.com"]}),
            "CR, LF",
        ),
        ("KEY", json!({"value": VALUE, "hosts": []}), "1 to 32"),
        (
            "KEY",
            json!({"value": VALUE, "hosts": ["exa mple.com"]}),
            "not a host name",
        ),
        (
            "KEY",
            json!({"value": VALUE, "hosts": ["*.com"]}),
            "top-level",
        ),
        (
            "KEY",
            json!({"value": VALUE, "hosts": ["a.example.com"], "header": "bad header"}),
            "header name",
        ),
        (
            "KEY",
            json!({"value": VALUE, "hosts": ["a.example.com"], "format": "Bearer"}),
            "{value} exactly once",
        ),
        (
            "KEY",
            json!({"value": VALUE, "hosts": ["a.example.com"], "extra": 1}),
            "extra",
        ),
    ] {
        let e = expect_error(s.put(name, body).await, 400, ErrorType::InvalidRequest).await;
        assert!(e.error.message.contains(why), "{name}: {}", e.error.message);
    }
    let list: Value = s
        .call(Method::GET, "/secrets")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(list["data"], json!([]));
}

#[tokio::test]
async fn a_create_naming_a_secret_the_account_has_not_is_refused_naming_it() {
    let s = Real::start().await;
    assert_eq!(
        s.put(
            "GITHUB_TOKEN",
            json!({"value": VALUE, "hosts": ["api.github.com"]})
        )
        .await
        .status(),
        200
    );
    let r = s
        .call(Method::POST, "/sandboxes")
        .json(&json!({"secrets": ["GITHUB_TOKEN", "OPENAI_API_KEY"]}))
        .send()
        .await
        .unwrap();
    let e = expect_error(r, 400, ErrorType::InvalidRequest).await;
    assert!(
        e.error.message.contains("OPENAI_API_KEY"),
        "{}",
        e.error.message
    );
    assert!(
        !e.error.message.contains("GITHUB_TOKEN"),
        "{}",
        e.error.message
    );
    let too_many: Vec<String> = (0..33).map(|i| format!("K{i}")).collect();
    let r = s
        .call(Method::POST, "/sandboxes")
        .json(&json!({"secrets": too_many}))
        .send()
        .await
        .unwrap();
    let e = expect_error(r, 400, ErrorType::InvalidRequest).await;
    assert!(
        e.error.message.contains("at most 32"),
        "{}",
        e.error.message
    );
}
