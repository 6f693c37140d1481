//! The control plane over real HTTP in front of the in-memory fake
//! `SandboxApi`: what the SDKs depend on beyond what the SDK tests reach
//! (the error bodies of every refusal, paging by `X-Next-Token`). The proof
//! that the SDKs work is the SDK tests (`crates/cli/tests/e2e/e2b.rs`).

use sandpit_fake::{Fake, KEY_A, KEY_B};
use serde_json::{json, Value};

struct Server {
    url: String,
    http: reqwest::Client,
    fake: std::sync::Arc<Fake>,
}

async fn start() -> Server {
    let fake = Fake::new();
    let e2b = sandpit_e2b::E2b {
        api: fake.clone(),
        domain: "sandpit.test".into(),
        public_url: "http://sandpit.test".into(),
        default_size: "small".into(),
        max_body_bytes: sandpit_api::RestConfig::default().max_body_bytes,
        watchers: Default::default(),
    };
    let app = axum::Router::new().nest_service("/e2b", sandpit_e2b::control_plane(e2b));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    Server {
        url: format!("http://{addr}/e2b"),
        http: reqwest::Client::new(),
        fake,
    }
}

impl Server {
    async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        key: Option<&str>,
        body: Option<Value>,
    ) -> (u16, reqwest::header::HeaderMap, Value) {
        let mut req = self.http.request(method, format!("{}{path}", self.url));
        if let Some(key) = key {
            req = req.header("X-API-KEY", key);
        }
        if let Some(body) = body {
            req = req.json(&body);
        }
        let r = req.send().await.unwrap();
        let status = r.status().as_u16();
        let headers = r.headers().clone();
        let text = r.text().await.unwrap();
        let json = if text.is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: not JSON ({e}): {text}"))
        };
        (status, headers, json)
    }
}

/// Every refusal is `{"code": <its status>, "message": …}`: the Python SDK
/// fails to decode anything else, and the JavaScript one tells "not found"
/// by the body's `code`.
fn assert_error(status: u16, body: &Value, expected: u16, says: &str) {
    assert_eq!(status, expected, "{body}");
    assert_eq!(body["code"], expected, "{body}");
    let message = body["message"].as_str().unwrap();
    assert!(message.contains(says), "{message:?} does not say {says:?}");
}

#[tokio::test]
async fn refusals_are_e2bs_error_bodies() {
    use reqwest::Method;
    let s = start().await;
    let (st, _, body) = s
        .call(Method::POST, "/v2/sandboxes", None, Some(json!({})))
        .await;
    assert_error(st, &body, 401, "E2B_API_KEY");
    let (st, _, body) = s
        .call(
            Method::POST,
            "/v2/sandboxes",
            Some("e2b_00"),
            Some(json!({})),
        )
        .await;
    assert_error(st, &body, 401, "");
    let (st, _, body) = s
        .call(
            Method::POST,
            "/v2/sandboxes",
            Some(KEY_A),
            Some(json!({"templateID": "Python 3.12"})),
        )
        .await;
    assert_error(st, &body, 400, "the account's templates (name or name:tag)");
    // A name nobody built: not found, as E2B says of a missing template.
    let (st, _, body) = s
        .call(
            Method::POST,
            "/v2/sandboxes",
            Some(KEY_A),
            Some(json!({"templateID": "python-3.12"})),
        )
        .await;
    assert_error(st, &body, 404, "python-3.12");
    // A sandbox without internet, asked either way E2B defines it; its
    // detail says so, and one that did not say shows nothing.
    for asked in [
        json!({"templateID": "base", "allow_internet_access": false}),
        json!({"templateID": "base", "network": {"denyOut": ["0.0.0.0/0"]}}),
    ] {
        let (st, _, made) = s
            .call(
                Method::POST,
                "/v2/sandboxes",
                Some(KEY_A),
                Some(asked.clone()),
            )
            .await;
        assert_eq!(st, 201, "{asked}: {made}");
        let id = made["sandboxID"].as_str().unwrap();
        let (_, _, info) = s
            .call(Method::GET, &format!("/sandboxes/{id}"), Some(KEY_A), None)
            .await;
        assert_eq!(info["allowInternetAccess"], false, "{asked}: {info}");
        s.call(
            Method::DELETE,
            &format!("/sandboxes/{id}"),
            Some(KEY_A),
            None,
        )
        .await;
    }
    let (st, _, body) = s
        .call(
            Method::POST,
            "/v2/sandboxes",
            Some(KEY_A),
            // Rules are taken (the service checks the secrets they name);
            // a body that is not E2B's shape of them is refused.
            Some(json!({"templateID": "base", "network": {"rules": {"api.example.com": "nope"}}})),
        )
        .await;
    assert_error(st, &body, 400, "rules");
    let (st, _, body) = s
        .call(Method::GET, "/sandboxes/sbx_nope", Some(KEY_A), None)
        .await;
    assert_error(st, &body, 404, "sbx_nope");
    let (st, _, body) = s
        .call(Method::DELETE, "/sandboxes/sbx_nope", Some(KEY_A), None)
        .await;
    assert_error(st, &body, 404, "sbx_nope");
    let (st, _, body) = s
        .call(Method::POST, "/templates", Some(KEY_A), Some(json!({})))
        .await;
    assert_error(st, &body, 404, "not part of Sandpit's E2B API");

    // Made by one account, it is not found by another.
    let (st, _, made) = s
        .call(
            Method::POST,
            "/v2/sandboxes",
            Some(KEY_A),
            Some(json!({"templateID": "base", "timeout": 61})),
        )
        .await;
    assert_eq!(st, 201, "{made}");
    for field in [
        "templateID",
        "sandboxID",
        "clientID",
        "envdVersion",
        "envdAccessToken",
        "domain",
    ] {
        assert!(made[field].is_string(), "{field} in {made}");
    }
    assert_eq!(made["templateID"], "base");
    assert_eq!(made["domain"], "sandpit.test");
    let id = made["sandboxID"].as_str().unwrap();
    let (st, _, info) = s
        .call(Method::GET, &format!("/sandboxes/{id}"), Some(KEY_A), None)
        .await;
    assert_eq!(st, 200, "{info}");
    assert_eq!(info["state"], "running");
    assert!(info.get("allowInternetAccess").is_none(), "{info}");
    let (st, _, body) = s
        .call(Method::GET, &format!("/sandboxes/{id}"), Some(KEY_B), None)
        .await;
    assert_error(st, &body, 404, id);
    let (st, _, _) = s
        .call(
            Method::DELETE,
            &format!("/sandboxes/{id}"),
            Some(KEY_A),
            None,
        )
        .await;
    assert_eq!(st, 204);
    let (st, _, body) = s
        .call(
            Method::DELETE,
            &format!("/sandboxes/{id}"),
            Some(KEY_A),
            None,
        )
        .await;
    assert_error(st, &body, 404, id);
}

#[tokio::test]
async fn lists_are_paged_by_the_next_token_and_filtered_by_metadata() {
    use reqwest::Method;
    let s = start().await;
    let mut made = Vec::new();
    for i in 0..5 {
        let team = if i % 2 == 0 { "even" } else { "odd" };
        let (st, _, body) = s
            .call(
                Method::POST,
                "/v2/sandboxes",
                Some(KEY_A),
                Some(json!({"metadata": {"team": team, "n": i.to_string()}})),
            )
            .await;
        assert_eq!(st, 201, "{body}");
        made.push(body["sandboxID"].as_str().unwrap().to_string());
    }
    // Two at a time, following the token, until there is none.
    let mut seen = Vec::new();
    let mut token: Option<String> = None;
    for _ in 0..10 {
        let path = match &token {
            Some(t) => format!("/v2/sandboxes?limit=2&nextToken={t}"),
            None => "/v2/sandboxes?limit=2".to_string(),
        };
        let (st, headers, page) = s.call(Method::GET, &path, Some(KEY_A), None).await;
        assert_eq!(st, 200, "{page}");
        let page = page.as_array().unwrap();
        assert!(page.len() <= 2);
        seen.extend(
            page.iter()
                .map(|p| p["sandboxID"].as_str().unwrap().to_string()),
        );
        token = headers
            .get("x-next-token")
            .map(|t| t.to_str().unwrap().to_string());
        if token.is_none() {
            break;
        }
    }
    seen.sort();
    let mut all = made.clone();
    all.sort();
    assert_eq!(seen, all);
    // The metadata filter as the SDKs encode it: percent-encoded pairs,
    // form-encoded together, sent as one value.
    let (st, _, odd) = s
        .call(
            Method::GET,
            "/v2/sandboxes?metadata=team%3Dodd",
            Some(KEY_A),
            None,
        )
        .await;
    assert_eq!(st, 200);
    let mut odd: Vec<String> = odd
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["sandboxID"].as_str().unwrap().to_string())
        .collect();
    odd.sort();
    let mut want = vec![made[1].clone(), made[3].clone()];
    want.sort();
    assert_eq!(odd, want);
    let (_, _, none) = s
        .call(
            Method::GET,
            "/v2/sandboxes?metadata=team%3Dodd%26n%3D0",
            Some(KEY_A),
            None,
        )
        .await;
    assert_eq!(none, json!([]));
    // Another account sees none of them.
    let (_, _, theirs) = s
        .call(Method::GET, "/v2/sandboxes", Some(KEY_B), None)
        .await;
    assert_eq!(theirs, json!([]));
}

#[tokio::test]
async fn metrics_of_many_sandboxes_are_read_side_by_side() {
    use reqwest::Method;
    let s = start().await;
    let mut mine = Vec::new();
    for _ in 0..40 {
        let (st, _, body) = s
            .call(Method::POST, "/v2/sandboxes", Some(KEY_A), Some(json!({})))
            .await;
        assert_eq!(st, 201, "{body}");
        mine.push(body["sandboxID"].as_str().unwrap().to_string());
    }
    let (st, _, theirs) = s
        .call(Method::POST, "/v2/sandboxes", Some(KEY_B), Some(json!({})))
        .await;
    assert_eq!(st, 201, "{theirs}");
    // Mine (one of them twice), another account's, and one nobody has.
    let asked = format!(
        "{},{},{},sbx_nobody",
        mine.join(","),
        mine[0],
        theirs["sandboxID"].as_str().unwrap()
    );
    let (st, _, body) = s
        .call(
            Method::GET,
            &format!("/sandboxes/metrics?sandbox_ids={asked}"),
            Some(KEY_A),
            None,
        )
        .await;
    assert_eq!(st, 200, "{body}");
    let got = body["sandboxes"].as_object().unwrap();
    let mut expected = mine.clone();
    expected.sort();
    assert_eq!(got.keys().cloned().collect::<Vec<_>>(), expected);
    for (id, m) in got {
        assert_eq!(m["cpuCount"], 2, "{id}: {m}");
        assert!(m["memTotal"].as_u64().unwrap() > 0, "{id}: {m}");
    }
    // Side by side, and a bounded number at once: one reading takes a
    // moment (the service's first waits to measure the CPU), and a
    // hundred in turn took half a minute.
    let at_once = s.fake.most_readings_at_once();
    assert!((2..=16).contains(&at_once), "{at_once} readings at once");

    // More than a hundred ids is refused.
    let many: Vec<String> = (0..101).map(|i| format!("sbx_{i}")).collect();
    let (st, _, body) = s
        .call(
            Method::GET,
            &format!("/sandboxes/metrics?sandbox_ids={}", many.join(",")),
            Some(KEY_A),
            None,
        )
        .await;
    assert_error(st, &body, 400, "from 1 to 100");
}
