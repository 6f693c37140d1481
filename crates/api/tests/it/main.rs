//! Adapter tests over real HTTP: the router served by `axum::serve` on
//! 127.0.0.1:0 in front of the in-memory fake `SandboxApi` (`sandpit-fake`,
//! the one the MCP tests use too), driven with reqwest (directly, and
//! through `RemoteApi`). One test binary, to link once.

mod events;
mod openapi_doc;
mod remote;
mod rest;
mod secrets;
mod snapshots;
mod stream;
mod volumes;

use sandpit_api::{ErrorBody, RestConfig};
use sandpit_core::ErrorType;
use sandpit_fake::{Fake, KEY_A, KEY_B};
use serde_json::Value;
use std::sync::Arc;

pub struct Server {
    pub url: String,
    pub fake: Arc<Fake>,
    pub http: reqwest::Client,
}

impl Server {
    pub async fn start() -> Server {
        Server::with_config(RestConfig::default()).await
    }

    pub async fn with_config(cfg: RestConfig) -> Server {
        let fake = Fake::new();
        let app = sandpit_api::router(fake.clone(), cfg);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        Server {
            url: format!("http://{addr}"),
            fake,
            http: reqwest::Client::new(),
        }
    }

    pub fn v1(&self, path: &str) -> String {
        format!("{}/v1{path}", self.url)
    }

    /// A request with account A's key as a bearer token.
    pub fn a(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        self.http.request(method, self.v1(path)).bearer_auth(KEY_A)
    }

    pub fn b(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        self.http
            .request(method, self.v1(path))
            .header("x-api-key", KEY_B)
    }

    /// Create a sandbox as account A and return its id.
    pub async fn create(&self) -> String {
        let r = self
            .a(reqwest::Method::POST, "/sandboxes")
            .json(&serde_json::json!({}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 201);
        r.json::<Value>().await.unwrap()["id"]
            .as_str()
            .unwrap()
            .to_owned()
    }
}

/// The request id header of a response (present on every response).
pub fn request_id(r: &reqwest::Response) -> String {
    let id = r
        .headers()
        .get("x-request-id")
        .expect("x-request-id on every response")
        .to_str()
        .unwrap()
        .to_owned();
    assert!(id.starts_with("req_") && id.len() >= 4 + 24, "{id}");
    id
}

/// Check an error response: status, JSON content type, the body shape (and
/// nothing else in it), the type, and that the id matches the header.
pub async fn expect_error(r: reqwest::Response, status: u16, kind: ErrorType) -> ErrorBody {
    assert_eq!(r.status().as_u16(), status, "status");
    let id = request_id(&r);
    let ct = r
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_owned());
    assert_eq!(ct.as_deref(), Some("application/json"));
    let v: Value = r.json().await.unwrap();
    let keys: Vec<&String> = v.as_object().unwrap().keys().collect();
    assert_eq!(keys, ["error", "request_id"], "{v}");
    let mut ekeys: Vec<&String> = v["error"].as_object().unwrap().keys().collect();
    ekeys.sort();
    assert_eq!(ekeys, ["message", "type"], "{v}");
    let body: ErrorBody = serde_json::from_value(v).unwrap();
    assert_eq!(body.error.kind, kind, "{}", body.error.message);
    assert!(!body.error.message.is_empty());
    assert_eq!(body.request_id, id);
    body
}
