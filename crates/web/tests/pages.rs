//! The dashboard's pages over real HTTP, without a browser or a VM: the
//! router served by `axum::serve` on a real SQLite store, through a
//! service without VMs of its own (what a page shows before any sandbox
//! exists). What a browser does with them is `crates/cli/tests/e2e/dashboard.rs`.

use reqwest::header::{CONTENT_TYPE, COOKIE, LOCATION, SET_COOKIE};
use reqwest::redirect::Policy;
use sandpit_core::config::{ServiceConfig, SizeConfig};
use sandpit_core::Service;
use std::sync::Arc;

struct Dashboard {
    url: String,
    http: reqwest::Client,
    key: String,
    _dir: tempfile::TempDir,
}

/// An operator's size table in alphabetical order, dearest first, and a
/// default that is neither first nor last.
fn config() -> ServiceConfig {
    let size = |vcpus, memory_mb, price_usd_per_hour| SizeConfig {
        vcpus,
        memory_mb,
        disk_gb: 10,
        price_usd_per_hour,
    };
    let mut c = ServiceConfig::default();
    c.sizes.clear();
    c.sizes.insert("a-huge".into(), size(16, 32768, 1.2));
    c.sizes.insert("b-tiny".into(), size(1, 512, 0.02));
    c.sizes.insert("c-mid".into(), size(2, 2048, 0.09));
    c.default_size = "c-mid".into();
    c
}

impl Dashboard {
    async fn start() -> Dashboard {
        let dir = tempfile::tempdir().unwrap();
        let store = sandpit_store::Store::open_sqlite(dir.path().join("sandpit.db"))
            .await
            .unwrap();
        let config = config();
        sandpit_core::admin::create_account(&store, &config, "ann", 10.0)
            .await
            .unwrap();
        let (key, _) = sandpit_core::admin::create_key(&store, "ann")
            .await
            .unwrap();
        let svc: Arc<Service> = Service::without_vms(config, store);
        let app = sandpit_web::router(svc, sandpit_web::WebConfig::default());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        let http = reqwest::Client::builder()
            .redirect(Policy::none())
            .build()
            .unwrap();
        Dashboard {
            url,
            http,
            key,
            _dir: dir,
        }
    }

    /// Signs in with the key: the session cookie, and the CSRF token the
    /// sandboxes page's forms carry.
    async fn sign_in(&self) -> (String, String) {
        let r = self
            .http
            .post(format!("{}/sign-in", self.url))
            .form(&[("key", self.key.as_str()), ("next", "/sandboxes")])
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 303, "signing in");
        let cookie = r.headers()[SET_COOKIE]
            .to_str()
            .unwrap()
            .split(';')
            .next()
            .unwrap()
            .to_string();
        let page = self.page("/sandboxes", &cookie).await;
        let csrf = page
            .split("name=\"csrf\" value=\"")
            .nth(1)
            .and_then(|rest| rest.split('"').next())
            .expect("a CSRF field on the sandboxes page")
            .to_string();
        (cookie, csrf)
    }

    async fn page(&self, path: &str, cookie: &str) -> String {
        let r = self
            .http
            .get(format!("{}{path}", self.url))
            .header(COOKIE, cookie)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "GET {path}");
        r.text().await.unwrap()
    }

    async fn post(&self, path: &str, cookie: &str, form: &[(&str, &str)]) -> reqwest::Response {
        self.http
            .post(format!("{}{path}", self.url))
            .header(COOKIE, cookie)
            .form(form)
            .send()
            .await
            .unwrap()
    }
}

/// A whole HTML document: nothing after `</html>`.
fn assert_whole_document(page: &str) {
    let end = page.find("</html>").expect("an </html>");
    assert_eq!(
        page[end..].trim_end(),
        "</html>",
        "written after </html>: {page}"
    );
}

#[tokio::test]
async fn the_create_form_lists_sizes_cheapest_first_with_the_default_selected() {
    let d = Dashboard::start().await;
    let (cookie, _) = d.sign_in().await;
    let page = d.page("/sandboxes", &cookie).await;
    let options: Vec<&str> = page
        .split("<option value=\"")
        .skip(1)
        .map(|o| o.split('<').next().unwrap())
        .filter(|o| !o.starts_with('"'))
        .collect();
    assert_eq!(options.len(), 3, "{options:?}");
    assert!(options[0].starts_with("b-tiny\""), "{options:?}");
    assert!(options[1].starts_with("c-mid\" selected"), "{options:?}");
    assert!(options[2].starts_with("a-huge\""), "{options:?}");
}

#[tokio::test]
async fn the_signed_out_page_is_one_document_with_its_notice_inside() {
    let d = Dashboard::start().await;
    let (cookie, csrf) = d.sign_in().await;
    let r = d.post("/sign-out", &cookie, &[("csrf", &csrf)]).await;
    assert_eq!(r.status(), 303);
    let to = r.headers()[LOCATION].to_str().unwrap().to_string();
    let page = d.page(&to, "").await;
    assert!(page.contains("You are signed out"), "{page}");
    let notice = page.find("You are signed out").unwrap();
    assert!(
        notice > page.find("<main").unwrap() && notice < page.find("</main>").unwrap(),
        "the notice is not in the page's main part: {page}"
    );
    assert_whole_document(&page);
}

#[tokio::test]
async fn an_error_page_keeps_the_navigation_and_sign_out_of_whoever_is_signed_in() {
    let d = Dashboard::start().await;
    let (cookie, _) = d.sign_in().await;
    let r = d
        .http
        .get(format!("{}/sandboxes/sbx_nosuchsandbox", d.url))
        .header(COOKIE, &cookie)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let page = r.text().await.unwrap();
    for part in [
        "Not Found",
        "href=\"/snapshots\"",
        "href=\"/keys\"",
        "Sign out",
        "ann",
    ] {
        assert!(page.contains(part), "no {part:?} on the 404 page: {page}");
    }
    assert_whole_document(&page);
    // Signed out, the same page has no navigation to offer.
    let r = d
        .http
        .post(format!("{}/sandboxes/sbx_nosuchsandbox/act/pause", d.url))
        .form(&[("csrf", "x")])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let page = r.text().await.unwrap();
    assert!(
        page.contains("signed out") && !page.contains("Sign out"),
        "{page}"
    );
}

#[tokio::test]
async fn a_form_without_its_csrf_field_gets_the_dashboards_403_page() {
    let d = Dashboard::start().await;
    let (cookie, csrf) = d.sign_in().await;
    for (path, form) in [
        ("/sign-out", vec![]),
        ("/keys", vec![]),
        (
            "/sandboxes",
            vec![("size", "b-tiny"), ("timeout_minutes", "5")],
        ),
        ("/sandboxes/sbx_x/act/pause", vec![]),
    ] {
        let r = d.post(path, &cookie, &form).await;
        assert_eq!(r.status(), 403, "POST {path} without csrf");
        let html = r.headers()[CONTENT_TYPE]
            .to_str()
            .unwrap()
            .starts_with("text/html");
        let page = r.text().await.unwrap();
        assert!(
            html && page.contains("reload the page"),
            "POST {path}: {page}"
        );
        assert!(
            page.contains("Sign out"),
            "POST {path}: no navigation: {page}"
        );
    }
    // A form that cannot be read at all is the dashboard's 400 page, not
    // axum's plain-text 422.
    let r = d
        .post(
            "/sandboxes",
            &cookie,
            &[
                ("csrf", &csrf),
                ("size", "b-tiny"),
                ("timeout_minutes", "soon"),
            ],
        )
        .await;
    assert_eq!(r.status(), 400);
    let page = r.text().await.unwrap();
    assert!(
        page.contains("could not be read") && page.contains("<!DOCTYPE html>"),
        "{page}"
    );
    // The session still works: nothing above signed it out.
    d.page("/sandboxes", &cookie).await;
}

/// Two replicas behind one balancer (two services, each its own pool, on
/// one database) share one per-address count: the limit is the limit,
/// not the limit times the replicas.
#[tokio::test]
async fn replicas_share_the_sign_up_limit_of_an_address() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("sandpit.db");
    let mut urls = Vec::new();
    for _ in 0..2 {
        let store = sandpit_store::Store::open_sqlite(&db).await.unwrap();
        let svc: Arc<Service> = Service::without_vms(config(), store);
        let web = sandpit_web::WebConfig {
            signup: sandpit_web::SignupConfig {
                mode: sandpit_web::SignupMode::Open,
                free_credit_usd: 1.0,
                per_address_per_hour: 2,
            },
            ..Default::default()
        };
        let app = sandpit_web::router(svc, web);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        urls.push(format!("http://{}", listener.local_addr().unwrap()));
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    }
    let http = reqwest::Client::builder()
        .redirect(Policy::none())
        .build()
        .unwrap();
    let sign_up = |url: &str, name: &str| {
        http.post(format!("{url}/sign-up"))
            .form(&[("name", name)])
            .send()
    };
    assert_eq!(sign_up(&urls[0], "ann").await.unwrap().status(), 200);
    assert_eq!(sign_up(&urls[1], "bob").await.unwrap().status(), 200);
    for url in &urls {
        let r = sign_up(url, "cat").await.unwrap();
        assert_eq!(r.status(), 429, "a third sign-up through {url}");
        assert!(r.headers().contains_key("retry-after"));
    }
}

#[tokio::test]
async fn the_events_page_says_when_there_are_none() {
    let d = Dashboard::start().await;
    let (cookie, _) = d.sign_in().await;
    let page = d.page("/events", &cookie).await;
    assert!(
        page.contains("No events yet") && page.contains("aria-current=\"page\">Events</a>"),
        "{page}"
    );
    assert_whole_document(&page);
    // A cursor the log does not have is the dashboard's 404, framed.
    let r = d
        .http
        .get(format!("{}/events?before=999999", d.url))
        .header(COOKIE, &cookie)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let page = r.text().await.unwrap();
    assert!(page.contains("Sign out"), "{page}");
}

/// The value of the input with `id` on `page`.
fn value_of<'a>(page: &'a str, id: &str) -> &'a str {
    let input = page
        .split(&format!("id=\"{id}\""))
        .nth(1)
        .unwrap_or_else(|| panic!("no #{id}: {page}"));
    let input = &input[..input.find('>').unwrap()];
    input
        .split("value=\"")
        .nth(1)
        .map_or("", |v| v.split('"').next().unwrap())
}

#[tokio::test]
async fn a_webhook_is_refused_with_its_form_kept_or_made_with_its_secret_shown_once() {
    let d = Dashboard::start().await;
    let (cookie, csrf) = d.sign_in().await;
    let page = d.page("/webhooks", &cookie).await;
    assert!(page.contains("No webhooks yet"), "{page}");
    assert!(
        page.contains("id=\"events-all\" name=\"all\" type=\"checkbox\" value=\"on\" checked"),
        "all events by default: {page}"
    );

    // A loopback address is refused, saying why; the form comes back as
    // it was sent.
    let r = d
        .post(
            "/webhooks",
            &cookie,
            &[
                ("csrf", &csrf),
                ("url", "http://127.0.0.1:9/hook"),
                ("description", "mine"),
                ("events", "sandbox.paused"),
                ("events", "sandbox.failed"),
            ],
        )
        .await;
    assert_eq!(r.status(), 400);
    let page = r.text().await.unwrap();
    assert!(page.contains("class=\"error\""), "{page}");
    assert_eq!(value_of(&page, "webhook-url"), "http://127.0.0.1:9/hook");
    assert_eq!(value_of(&page, "webhook-description"), "mine");
    for t in ["sandbox.paused", "sandbox.failed"] {
        assert!(
            page.contains(&format!("value=\"{t}\" checked")),
            "{t} not kept: {page}"
        );
    }
    assert!(
        !page.contains("value=\"sandbox.created\" checked"),
        "{page}"
    );
    assert!(!page.contains("value=\"on\" checked"), "{page}");
    assert_whole_document(&page);

    // A public address: made, its secret on the answer and nowhere after.
    let r = d
        .post(
            "/webhooks",
            &cookie,
            &[
                ("csrf", &csrf),
                ("url", "https://1.1.1.1/sandpit-hook"),
                ("all", "on"),
            ],
        )
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["cache-control"], "no-store");
    let page = r.text().await.unwrap();
    let secret = value_of(&page, "webhook-secret").to_string();
    assert!(secret.starts_with("whsec_"), "{page}");
    assert!(page.contains("it is not shown again"), "{page}");
    let list = d.page("/webhooks", &cookie).await;
    assert!(
        list.contains("Webhooks (1)")
            && list.contains("https://1.1.1.1/sandpit-hook")
            && list.contains("0 pending")
            && !list.contains(&secret),
        "{list}"
    );
    let id = list
        .split("href=\"/webhooks/wh_")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .map(|rest| format!("wh_{rest}"))
        .expect("a link to the webhook's page");
    let one = d.page(&format!("/webhooks/{id}"), &cookie).await;
    assert!(
        one.contains("No deliveries yet") && !one.contains(&secret),
        "{one}"
    );
    assert_whole_document(&one);

    // Deleted from the list.
    let r = d
        .post(
            &format!("/webhooks/{id}/delete"),
            &cookie,
            &[("csrf", &csrf)],
        )
        .await;
    assert_eq!(r.status(), 303);
    assert_eq!(r.headers()[LOCATION], "/webhooks");
    let list = d.page("/webhooks", &cookie).await;
    assert!(list.contains("No webhooks yet"), "{list}");
}
