//! The browser harness (`common/browser.rs`) proved on real things, the
//! cheap way: a real `sandpit serve` whose JSON a headless Chromium shows,
//! and a page served from a real VM through a preview URL on which the
//! browser does what a user does (types into a labelled field, presses a
//! button, reads the answer), takes screenshots on a laptop's and a
//! phone's viewport, and reads an `HttpOnly` cookie's attributes. Every run
//! ends by checking that no chromedriver or Chromium process is left.
//!
//! Chromium resolves `*.localhost` to the loopback itself, so the preview
//! URL needs nothing from the system resolver.

use crate::common::browser::{Browser, DESKTOP, PHONE};
use crate::common::serve::*;
use crate::common::*;
use serde_json::{json, Value};
use std::path::Path;
use std::time::{Duration, Instant};

/// No warm pool: these tests need one VM at most.
const NO_POOL: &str = "[pool]\nsizes = {}\n";

/// A form whose fields are named by labels of both kinds (`for=` and a
/// wrapping label) and hold text already, and whose button answers with
/// inline JavaScript.
const PAGE: &str = r##"<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Greeter</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>body { font-family: sans-serif; margin: 2em; } input { width: 100%; }</style>
</head><body>
<h1>Greeter</h1>
<form onsubmit="event.preventDefault();
  document.getElementById('answer').textContent =
    'Hello, ' + document.getElementById('name').value + ' from ' + this.town.value + '!';">
  <p><label for="name">Your name</label> <input id="name" value="Somebody"></p>
  <p><label>Your town <input name="town" value="Nowhere"></label></p>
  <p><button type="submit">Say hello</button> <a href="#elsewhere">Elsewhere</a></p>
</form>
<p id="answer">Nobody greeted yet.</p>
</body></html>
"##;

/// Python's `http.server` for the directory, each answer setting the kind
/// of session cookie a login sets.
const SERVER: &str = r#"
import functools, http.server
class H(http.server.SimpleHTTPRequestHandler):
    def end_headers(self):
        self.send_header("Set-Cookie", "session=s3cret; Path=/; HttpOnly; SameSite=Strict")
        super().end_headers()
    def log_message(self, *a): pass
H = functools.partial(H, directory="/workspace/site")
http.server.ThreadingHTTPServer(("0.0.0.0", 8000), H).serve_forever()
"#;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn the_service_document_shows_in_chromium() {
    let data = data_dir();
    let server = Server::start_with(&data, NO_POOL);
    let key = server.admin_key.clone().expect("the first start's key");
    runtime().block_on(async {
        let (st, info) = Rest::new(&server, &key).get("/service").await;
        assert_eq!(st, 200, "{info}");
        let fields: Vec<&String> = info.as_object().expect("an object").keys().collect();
        assert!(fields.len() >= 3, "{info}");

        let browser = Browser::start().await;
        let traces = browser.traces();
        let url = format!("{}/v1/service", server.url);
        browser.goto(&url).await;
        assert_eq!(browser.current_url().await, url);
        let text = browser.text().await;
        for field in fields {
            assert!(
                text.contains(&format!("\"{field}\":")),
                "the page lacks the field {field:?}: {text}"
            );
        }
        drop(browser);
        traces.assert_all_gone();
    });
}

#[test]
fn a_preview_page_is_used_as_a_person_would_on_a_laptop_and_a_phone() {
    let started = Instant::now();
    let data = data_dir();
    let server = Server::start_with(&data, NO_POOL);
    let key = server.admin_key.clone().expect("the first start's key");
    let shots = tempfile::tempdir().unwrap();
    runtime().block_on(async {
        let api = Rest::new(&server, &key);
        let (st, sbx) = api
            .post(
                "/sandboxes",
                json!({"name": "browser", "timeout_minutes": 15}),
            )
            .await;
        assert_eq!(st, 201, "{sbx}");
        let id = sbx["id"].as_str().unwrap().to_string();
        write(&api, &id, "/workspace/site/index.html", PAGE).await;
        write(&api, &id, "/workspace/serve.py", SERVER).await;
        sh(
            &api,
            &id,
            "(nohup python3 /workspace/serve.py > /tmp/serve.log 2>&1 &)",
        )
        .await;
        let (st, port) = api
            .post(&format!("/sandboxes/{id}/ports"), json!({"port": 8000}))
            .await;
        assert_eq!(st, 200, "{port}");
        let url = port["url"].as_str().unwrap().to_string();
        assert!(url.contains(".localhost:"), "{url}");

        let browser = Browser::start().await;
        let traces = browser.traces();
        // Until the guest's server listens, the preview says so: reload.
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            browser.goto(&format!("{url}/")).await;
            if browser.text().await.contains("Nobody greeted yet.") {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the guest's page never showed\n{}",
                browser.dump().await
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        assert_eq!(browser.current_url().await, format!("{url}/"));

        // Typing replaces what the fields held; the button's script answers.
        browser.fill("Your name", "Ada Lovelace").await;
        browser.fill("Your town", "London").await;
        browser.click("Say hello").await;
        let text = browser
            .wait_for_text("Hello, Ada", Duration::from_secs(10))
            .await;
        assert!(text.contains("Hello, Ada Lovelace from London!"), "{text}");
        assert!(!text.contains("Nobody greeted yet."), "{text}");
        // CSS selects a field too.
        browser.fill("input[name=town]", "Paris").await;
        browser.click("Say hello").await;
        browser
            .wait_for_text("Hello, Ada Lovelace from Paris!", Duration::from_secs(10))
            .await;

        // The session cookie: HttpOnly (so the page's scripts cannot read
        // it) and SameSite=Strict, as the browser holds it.
        let cookies = browser.cookies().await;
        let session = cookies
            .iter()
            .find(|c| c.name() == "session")
            .unwrap_or_else(|| panic!("no session cookie among {cookies:?}"));
        assert_eq!(session.value(), "s3cret");
        assert_eq!(session.http_only(), Some(true), "{session:?}");
        assert!(
            session.same_site().is_some_and(|s| s.is_strict()),
            "{session:?}"
        );
        let visible_to_scripts = browser.execute("return document.cookie", vec![]).await;
        assert_eq!(visible_to_scripts, json!(""));

        // A laptop's screenshot, then a phone's; the page is laid out anew
        // for each (its full-width field follows the viewport).
        let field_width = r#"return document.getElementById("name").getBoundingClientRect().width"#;
        let wide = browser.execute(field_width, vec![]).await.as_f64().unwrap();
        assert!(
            wide > 1000.0,
            "the name field is {wide} px wide on a laptop"
        );
        let png = browser.screenshot(&shots.path().join("desktop.png")).await;
        assert_png(&png, DESKTOP);
        assert_eq!(
            std::fs::read(shots.path().join("desktop.png")).unwrap(),
            png
        );
        browser.set_window_size(PHONE.0, PHONE.1).await;
        let viewport = browser
            .execute("return [window.innerWidth, window.innerHeight]", vec![])
            .await;
        assert_eq!(viewport, json!([PHONE.0, PHONE.1]));
        let narrow = browser.execute(field_width, vec![]).await.as_f64().unwrap();
        assert!(
            narrow < f64::from(PHONE.0) - 50.0,
            "the name field is {narrow} px wide on a phone"
        );
        let png = browser.screenshot(&shots.path().join("phone.png")).await;
        assert_png(&png, PHONE);
        assert!(browser
            .text()
            .await
            .contains("Hello, Ada Lovelace from Paris!"));

        drop(browser);
        traces.assert_all_gone();
    });
    eprintln!("the preview test took {:?}", started.elapsed());
}

/// A page of its own (a `data:` URL), for the harness's failures.
const SMALL_PAGE: &str = "data:text/html,<title>Small</title><p>Only this.</p>\
     <label for=a>Email</label><input id=a><input aria-label=Search>\
     <button>Send</button><button style='display:none'>Hidden</button>";

#[test]
fn the_harness_fails_loudly_naming_what_it_did_not_find() {
    runtime().block_on(async {
        let browser = Browser::start().await;
        let traces = browser.traces();
        browser.goto(SMALL_PAGE).await;
        // What is there is found: by label, by aria-label, by CSS, by text.
        browser.fill("Email", "a@example.com").await;
        browser.fill("Search", "needle").await;
        browser.fill("#a", "b@example.com").await;
        let values = browser
            .execute(
                "return [...document.querySelectorAll('input')].map(i => i.value)",
                vec![],
            )
            .await;
        assert_eq!(values, json!(["b@example.com", "needle"]));
        browser.click("Send").await;

        let missing_field = panic_message(browser.fill("Password", "x")).await;
        assert!(
            missing_field.contains(r#"no field labelled "Password""#)
                && missing_field.contains(r#"["Email"]"#)
                && missing_field.contains("Only this."),
            "{missing_field}"
        );
        // A hidden button is not one a person can press.
        let hidden = panic_message(browser.click("Hidden")).await;
        assert!(
            hidden.contains(r#"nothing visible to click named "Hidden""#)
                && hidden.contains(r#"["Send"]"#)
                && hidden.contains("Only this."),
            "{hidden}"
        );
        let started = Instant::now();
        let never = panic_message(browser.wait_for_text("Never", Duration::from_millis(500))).await;
        assert!(started.elapsed() < Duration::from_secs(5));
        assert!(
            never.contains(r#"the page did not say "Never" within 500ms"#)
                && never.contains("Only this."),
            "{never}"
        );
        drop(browser);
        traces.assert_all_gone();
    });
}

/// The message `action` panics with; panics if it does not.
async fn panic_message(action: impl std::future::Future<Output = impl std::fmt::Debug>) -> String {
    use futures_util::FutureExt;
    match std::panic::AssertUnwindSafe(action).catch_unwind().await {
        Ok(v) => panic!("expected a panic, got {v:?}"),
        Err(payload) => payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default(),
    }
}

/// `png` is a PNG of `width` x `height` pixels with more in it than a blank
/// image (a blank 390x844 one is well under 2 kB).
fn assert_png(png: &[u8], (width, height): (u32, u32)) {
    assert!(
        png.starts_with(b"\x89PNG\r\n\x1a\n"),
        "not a PNG: {:?}",
        &png[..png.len().min(16)]
    );
    // The first chunk is IHDR: its width and height, big-endian, at 16..24.
    assert_eq!(&png[12..16], b"IHDR");
    let dimension = |at: usize| u32::from_be_bytes(png[at..at + 4].try_into().unwrap());
    assert_eq!((dimension(16), dimension(20)), (width, height));
    assert!(png.len() > 4000, "a {}-byte screenshot", png.len());
}

/// Run a shell command in the sandbox; panics unless it exits 0.
async fn sh(api: &Rest, id: &str, cmd: &str) -> String {
    let (st, ex) = api
        .post(
            &format!("/sandboxes/{id}/exec"),
            json!({"command": cmd, "timeout_ms": 60_000}),
        )
        .await;
    assert_eq!(st, 200, "{ex}");
    assert_eq!(ex["exit_code"], 0, "`{cmd}` failed: {ex}");
    ex["stdout"].as_str().unwrap().trim().to_string()
}

/// Write `content` to `path` in the sandbox (directories made).
async fn write(api: &Rest, id: &str, path: &str, content: &str) {
    let dir = Path::new(path).parent().unwrap().display().to_string();
    sh(api, id, &format!("mkdir -p {dir}")).await;
    let (st, w): (u16, Value) = api
        .call(
            reqwest::Method::PUT,
            &format!("/sandboxes/{id}/files"),
            Some(json!({"path": path, "content": content, "encoding": "utf8"})),
        )
        .await;
    assert_eq!(st, 200, "{w}");
}
