//! The dashboard in a real browser: headless Chromium (Debian's, through
//! chromedriver) against a real `sandpit serve` with real VMs, doing what a
//! person does: sign in with the printed key, create a sandbox, run a
//! command, use the file browser (upload, download, delete), expose a port
//! and open its link, type into the terminal and read its output from the
//! page, pause, resume and snapshot, read the sandbox's events on its page
//! and the Events page, be refused a webhook to a denied address (the form
//! kept), make one to a receiver here (its secret shown once) and see its
//! deliveries and redeliver one, find a template, read its build's
//! log, rebuild it and start a sandbox from it, make and revoke a key, read usage,
//! add credit as an operator, sign out, sign up with an invitation (and be
//! refused past the per-address limit), and never see another account's
//! sandboxes.
//!
//! Every page visited is also a screenshot (a laptop's and, for the
//! sandboxes, a phone's window). They go to a temporary directory, or to
//! `SANDPIT_SCREENSHOTS_DIR` (`docs/screenshots` refreshes the README's).

use crate::common::browser::{Browser, DESKTOP, PHONE};
use crate::common::serve::*;
use fantoccini::Locator;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Sign-up by invitation, two an hour from one address; beside the test
/// size `small`, two dearer ones that come first in the alphabet (the
/// form once picked the first of them); webhooks may reach this host's
/// loopback address (a receiver in the test), nothing else private.
const SIGNUP: &str =
    "[signup]\nmode = \"invite\"\nfree_credit_usd = 2.5\nper_address_per_hour = 2\n\
    [sizes.large]\nvcpus = 2\nmemory_mb = 1024\ndisk_gb = 4\nprice_usd_per_hour = 0.55\n\
    [sizes.medium]\nvcpus = 2\nmemory_mb = 1024\ndisk_gb = 4\nprice_usd_per_hour = 0.28\n\
    [webhooks]\nallow = [\"127.0.0.1/32\"]\n";
/// How long a page may take to say what it should (a create or a terminal
/// under emulation on a busy host).
const PATIENCE: Duration = Duration::from_secs(120);

/// The page's width against the window's, and the outermost elements
/// whose right edge passes the window (each as `tag#id.class: right edge`);
/// content in a box that scrolls sideways itself (a wide table in
/// `.scroll`, a `pre`) does not count.
const WIDER_THAN_THE_WINDOW: &str = r#"
const w = document.documentElement.clientWidth;
const out = [];
const scrolls = el => { for (let p = el.parentElement; p; p = p.parentElement) {
  const o = getComputedStyle(p).overflowX; if (o === 'auto' || o === 'scroll' || o === 'hidden') return true; } return false; };
const walk = el => {
  const r = el.getBoundingClientRect();
  if (r.width > 0 && r.right > w + 0.5 && !scrolls(el)) {
    const wide = [...el.children].some(c => c.getBoundingClientRect().right > w + 0.5);
    if (!wide) { out.push(el.tagName.toLowerCase() + (el.id ? '#' + el.id : '') +
      (el.className && typeof el.className === 'string' ? '.' + el.className.split(' ').join('.') : '') +
      ': ' + Math.round(r.right)); return; }
  }
  [...el.children].forEach(walk);
};
walk(document.body);
if (document.documentElement.scrollWidth > w) out.push('page: ' + document.documentElement.scrollWidth + ' > ' + w);
return out;
"#;

/// Where screenshots go, and a check that each is a real picture.
struct Shots {
    dir: PathBuf,
    _temp: Option<tempfile::TempDir>,
}

impl Shots {
    fn new() -> Shots {
        match std::env::var_os("SANDPIT_SCREENSHOTS_DIR") {
            Some(d) => Shots {
                dir: PathBuf::from(d),
                _temp: None,
            },
            None => {
                let t = tempfile::tempdir().unwrap();
                Shots {
                    dir: t.path().to_path_buf(),
                    _temp: Some(t),
                }
            }
        }
    }

    /// The page on a laptop's window, then on a phone's (`{name}-phone`),
    /// where nothing may stick out sideways: no element wider than the
    /// window, so the page never scrolls sideways and its header spans it.
    async fn take(&self, b: &Browser, name: &str) {
        self.picture(b, name).await;
        b.set_window_size(PHONE.0, PHONE.1).await;
        let wider = b.execute(WIDER_THAN_THE_WINDOW, vec![]).await;
        assert_eq!(
            wider,
            json!([]),
            "{name}: on a phone ({} px), these stick out of the window",
            PHONE.0
        );
        self.picture(b, &format!("{name}-phone")).await;
        b.set_window_size(DESKTOP.0, DESKTOP.1).await;
    }

    async fn picture(&self, b: &Browser, name: &str) {
        let png = b.screenshot(&self.dir.join(format!("{name}.png"))).await;
        assert!(
            png.starts_with(b"\x89PNG\r\n\x1a\n") && png.len() > 5_000,
            "{name}: not a picture of a page ({} bytes)",
            png.len()
        );
    }
}

/// The REST answer to `GET path` with `key`: status and JSON.
async fn rest_get(url: &str, key: &str, path: &str) -> (u16, Value) {
    let r = reqwest::Client::new()
        .get(format!("{url}/v1{path}"))
        .bearer_auth(key)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// A file's bytes as the API reads them.
async fn file_bytes(url: &str, key: &str, id: &str, path: &str) -> Vec<u8> {
    let r = reqwest::Client::new()
        .get(format!("{url}/v1/sandboxes/{id}/files"))
        .query(&[("path", path)])
        .header("accept", "application/octet-stream")
        .bearer_auth(key)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200, "reading {path}");
    r.bytes().await.unwrap().to_vec()
}

/// The id of the sandbox whose page is shown.
async fn sandbox_shown(b: &Browser) -> String {
    let page = b.current_url().await;
    let id = page
        .rsplit('/')
        .next()
        .and_then(|last| last.split(['?', '#']).next())
        .unwrap_or_default()
        .to_string();
    assert!(id.starts_with("sbx_"), "not a sandbox's page: {page}");
    id
}

/// Waits until the server's warm pool has a VM ready: its snapshot
/// template exists.
async fn template_ready(url: &str, key: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(300);
    loop {
        let (_, info) = rest_get(url, key, "/service").await;
        if info["fast_start"]["warm_pool"][0]["ready"].as_u64() >= Some(1) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the warm pool did not fill"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Waits until template `name`'s first build is ready; its id.
async fn template_built(url: &str, key: &str, name: &str) -> String {
    let deadline = std::time::Instant::now() + PATIENCE;
    loop {
        let (_, t) = rest_get(url, key, &format!("/templates/{name}")).await;
        match t["status"].as_str() {
            Some("ready") => return t["id"].as_str().unwrap().to_string(),
            Some("building") => {}
            _ => panic!("template {name}: {t}"),
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{name} was not built: {t}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

async fn sign_in(b: &Browser, url: &str, key: &str) {
    b.goto(&format!("{url}/")).await;
    b.fill("API key", key).await;
    click_and_load(b, "Sign in").await;
    b.wait_for_text("New sandbox", PATIENCE).await;
}

/// Click `name` (a form's button, a link) and wait until the page it
/// leads to has replaced this one, so what is read next is the new page's.
async fn click_and_load(b: &Browser, name: &str) {
    b.execute("window.sandpitOldPage = true", vec![]).await;
    b.click(name).await;
    let deadline = std::time::Instant::now() + PATIENCE;
    loop {
        // Mid-navigation a script may fail: that is not an answer yet.
        let still_old = b
            .client()
            .execute("return window.sandpitOldPage === true", vec![])
            .await;
        if let Ok(Value::Bool(false)) = still_old {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "clicking {name:?} led to no new page\n{}",
            b.dump().await
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A webhook receiver on the loopback: its URL, and the `webhook-id` of
/// every POST it answered (204).
async fn receiver() -> (String, Arc<Mutex<Vec<String>>>) {
    let got = Arc::new(Mutex::new(Vec::new()));
    let kept = got.clone();
    let app = axum::Router::new().route(
        "/hook",
        axum::routing::post(move |headers: axum::http::HeaderMap| {
            let kept = kept.clone();
            async move {
                let id = headers
                    .get("webhook-id")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default();
                kept.lock().unwrap().push(id.to_string());
                axum::http::StatusCode::NO_CONTENT
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, got)
}

/// The event rows inside the element `arguments[0]` selects, newest
/// first: each row's type and the sandbox it links to (none on a
/// sandbox's own page).
const EVENT_ROWS: &str = r#"
return [...document.querySelector(arguments[0]).querySelectorAll('table.events tbody tr')].map(r => {
  const link = r.querySelector('a[href^="/sandboxes/"]');
  return [r.querySelector('code').textContent, link ? link.getAttribute('href') : null];
});
"#;

/// `rows` (from [`EVENT_ROWS`], newest first) tell a sandbox's life so
/// far: created, started, paused and resumed, in that order, each row of
/// sandbox `id` (when the rows name theirs) linking to it.
fn assert_lived(rows: &Value, id: Option<&str>) {
    let rows = rows.as_array().expect("event rows");
    let mut kinds: Vec<&str> = rows
        .iter()
        .filter(|r| match id {
            Some(id) => r[1].as_str() == Some(&format!("/sandboxes/{id}")),
            None => r[1].is_null(),
        })
        .map(|r| r[0].as_str().unwrap())
        .collect();
    kinds.reverse();
    let mut wanted = [
        "sandbox.created",
        "sandbox.started",
        "sandbox.paused",
        "sandbox.resumed",
    ]
    .into_iter()
    .peekable();
    for k in &kinds {
        if wanted.peek() == Some(k) {
            wanted.next();
        }
    }
    assert!(
        wanted.peek().is_none() && kinds.first() == Some(&"sandbox.created"),
        "not created, started, paused and resumed (oldest first): {kinds:?} of {rows:?}"
    );
}

/// Wait until the executions' output (inside closed `<details>`) shows
/// `needle`, opening them as they come.
async fn wait_for_output(b: &Browser, needle: &str) {
    let deadline = std::time::Instant::now() + PATIENCE;
    loop {
        b.execute(
            "document.querySelectorAll('details').forEach(d => d.open = true)",
            vec![],
        )
        .await;
        if b.text().await.contains(needle) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no output {needle:?}\n{}",
            b.dump().await
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_person_uses_the_dashboard_in_a_real_browser() {
    let data = tempfile::tempdir().unwrap();
    let server = Server::start_with(data.path(), SIGNUP);
    let url = server.url.clone();
    let admin_key = server.admin_key.clone().expect("the first start's key");
    let shots = Shots::new();
    let (hook_url, hook_got) = receiver().await;
    let b = Browser::start().await;

    // Sign in: a wrong key is told so; the right one lands on the
    // sandboxes, with a session cookie scripts cannot read.
    b.goto(&format!("{url}/")).await;
    b.wait_for_text("Paste an API key", PATIENCE).await;
    shots.take(&b, "sign-in").await;
    b.fill("API key", "sp_notakey").await;
    click_and_load(&b, "Sign in").await;
    b.wait_for_text("not a valid API key", PATIENCE).await;
    sign_in(&b, &url, &admin_key).await;
    let cookie = b
        .cookies()
        .await
        .into_iter()
        .find(|c| c.name() == "sandpit_session")
        .expect("a session cookie");
    assert_eq!(cookie.http_only(), Some(true), "{cookie:?}");
    assert_eq!(
        cookie.same_site().map(|s| s.to_string()).as_deref(),
        Some("Lax"),
        "{cookie:?}"
    );
    assert!(
        !cookie.value().contains(&admin_key[3..]),
        "the key itself in a cookie"
    );

    // The form offers the sizes cheapest first, the service's default
    // chosen: a create that leaves the size alone gets `small`.
    let sizes = b
        .execute(
            "return [...document.querySelectorAll('#size option')].map(o => [o.value, o.selected])",
            vec![],
        )
        .await;
    assert_eq!(
        sizes,
        json!([["small", true], ["medium", false], ["large", false]])
    );

    // A secret saved on its page: listed by name, hosts and header, its
    // value never shown again; a bad name is told why, the form kept.
    click_and_load(&b, "Secrets").await;
    b.wait_for_text("No secrets yet", PATIENCE).await;
    b.fill("Name (an environment variable)", "DASH_TOKEN").await;
    b.fill("Value", "dash-secret-value-1234").await;
    b.fill("Hosts it may be sent to", "api.example.test, *.example.org")
        .await;
    click_and_load(&b, "Save secret").await;
    let listed = b.wait_for_text("Saved (1)", PATIENCE).await;
    assert!(
        listed.contains("DASH_TOKEN")
            && listed.contains("api.example.test, *.example.org")
            && listed.contains("Authorization: Bearer {value}")
            && listed.contains("never"),
        "{listed}"
    );
    let html = b
        .execute("return document.documentElement.outerHTML", vec![])
        .await;
    assert!(
        !html.as_str().unwrap().contains("dash-secret-value"),
        "the value on the page"
    );
    let (_, secrets) = rest_get(&url, &admin_key, "/secrets").await;
    assert_eq!(secrets["data"][0]["name"], "DASH_TOKEN", "{secrets}");
    b.execute(
        "document.getElementById('secret-name').removeAttribute('pattern')",
        vec![],
    )
    .await;
    b.fill("Name (an environment variable)", "2BAD").await;
    b.fill("Value", "x").await;
    b.fill("Hosts it may be sent to", "api.example.test").await;
    click_and_load(&b, "Save secret").await;
    b.wait_for_text("not an environment variable", PATIENCE)
        .await;
    let kept = b
        .execute(
            "return ['secret-name', 'secret-value', 'secret-hosts'].map(i => document.getElementById(i).value)",
            vec![],
        )
        .await;
    assert_eq!(
        kept,
        json!(["2BAD", "", "api.example.test"]),
        "the form as sent, but its value"
    );
    shots.take(&b, "secrets").await;

    // A volume made on its page, listed; a name the account has is told
    // why, the form kept.
    click_and_load(&b, "Volumes").await;
    b.wait_for_text("No volumes yet", PATIENCE).await;
    b.fill("Name", "dash-data").await;
    b.fill("Size (GiB)", "1").await;
    click_and_load(&b, "Create volume").await;
    let listed = b.wait_for_text("Volumes (1)", PATIENCE).await;
    assert!(
        listed.contains("dash-data") && listed.contains("1 GiB") && listed.contains("ready"),
        "{listed}"
    );
    b.fill("Name", "dash-data").await;
    b.fill("Size (GiB)", "2").await;
    click_and_load(&b, "Create volume").await;
    b.wait_for_text("already", PATIENCE).await;
    let kept = b
        .execute(
            "return ['volume-name', 'volume-size'].map(i => document.getElementById(i).value)",
            vec![],
        )
        .await;
    assert_eq!(kept, json!(["dash-data", "2"]), "the form as sent");
    shots.take(&b, "volumes").await;
    click_and_load(&b, "Sandboxes").await;

    // Create a sandbox from the form, with the secret; its page shows it
    // running. (Once the server's snapshot template exists, which its warm
    // pool waits for: a sandbox booted before it cannot be paused or
    // snapshotted.)
    template_ready(&url, &admin_key).await;
    b.fill("Secrets (names, optional)", "DASH_TOKEN").await;
    b.fill(
        "Volumes (name:/path, :ro to read only; optional)",
        "dash-data:/data",
    )
    .await;
    b.fill("Name (optional)", "demo").await;
    b.fill("Lifetime (minutes)", "30").await;
    click_and_load(&b, "Create sandbox").await;
    b.wait_for_text("Preview ports", PATIENCE).await;
    let id = sandbox_shown(&b).await;
    let (_, sbx) = rest_get(&url, &admin_key, &format!("/sandboxes/{id}")).await;
    assert_eq!(sbx["status"], "running", "{sbx}");
    assert_eq!(sbx["size"], "small", "{sbx}");
    assert_eq!(sbx["name"], "demo", "{sbx}");
    assert_eq!(sbx["timeout_minutes"], 30, "{sbx}");
    let (_, volume) = rest_get(&url, &admin_key, "/volumes/dash-data").await;
    assert_eq!(
        volume["mounted_by"][0]["sandbox_id"],
        id.as_str(),
        "{volume}"
    );
    assert_eq!(volume["mounted_by"][0]["path"], "/data", "{volume}");

    // A command from the command box, and its execution with its output.
    b.fill(
        "Command",
        "echo made-$((6*7)) > /workspace/made.txt; cat /workspace/made.txt; \
         echo \"token=${DASH_TOKEN:0:15}\"",
    )
    .await;
    click_and_load(&b, "Run").await;
    wait_for_output(&b, "made-42").await;
    // The secret's placeholder, not its value, is what the sandbox holds.
    wait_for_output(&b, "token=sandpit-secret-").await;

    // Files: the new file is listed, downloads as it is, uploads arrive
    // byte for byte, and a delete removes it.
    b.wait_for_text("made.txt", PATIENCE).await;
    let downloaded = b
        .execute(
            "return fetch(arguments[0]).then(r => r.text())",
            vec![json!(format!(
                "/sandboxes/{id}/files/download?path=/workspace/made.txt"
            ))],
        )
        .await;
    assert_eq!(downloaded, json!("made-42\n"));
    let local = data.path().join("upload.bin");
    let content: Vec<u8> = (0..200_000u32).map(|i| (i * 7 % 251) as u8).collect();
    std::fs::write(&local, &content).unwrap();
    b.client()
        .find(Locator::Css("#upload"))
        .await
        .expect("the upload field")
        .send_keys(&local.display().to_string())
        .await
        .unwrap();
    click_and_load(&b, "Upload").await;
    b.wait_for_text("upload.bin", PATIENCE).await;
    assert_eq!(
        file_bytes(&url, &admin_key, &id, "/workspace/upload.bin").await,
        content
    );
    click_and_load(&b, "Delete made.txt").await;
    b.wait_for_text("upload.bin", PATIENCE).await;
    let (_, listing) = rest_get(
        &url,
        &admin_key,
        &format!("/sandboxes/{id}/files?path=/workspace&list=true"),
    )
    .await;
    let names: Vec<&str> = listing["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    assert!(
        !names.contains(&"made.txt") && names.contains(&"upload.bin"),
        "{names:?}"
    );

    // A port: a server started from the command box, exposed, its link
    // opened.
    b.fill(
        "Command",
        "nohup python3 -m http.server 8000 --directory /workspace >/dev/null 2>&1 &",
    )
    .await;
    click_and_load(&b, "Run").await;
    b.wait_for_text("Executions", PATIENCE).await;
    b.fill("Port", "8000").await;
    click_and_load(&b, "Expose port").await;
    b.wait_for_text("Port 8000:", PATIENCE).await;
    b.execute("window.scrollTo(0, 0)", vec![]).await;
    shots.take(&b, "sandbox").await;
    let link = b
        .execute("return document.querySelector('#ports li a').href", vec![])
        .await;
    let link = link.as_str().expect("a preview link").to_string();
    assert!(
        link.starts_with(&format!("http://8000-{id}.localhost:")),
        "{link}"
    );
    // The server takes a moment to start: its link says so (502) until then.
    let deadline = std::time::Instant::now() + PATIENCE;
    loop {
        b.goto(&link).await;
        if b.text().await.contains("upload.bin") {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the preview never served the directory\n{}",
            b.dump().await
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    // The port made private: the page's link is signed and serves in the
    // browser; the bare URL answers 401 to a client without the token.
    b.goto(&format!("{url}/sandboxes/{id}")).await;
    b.fill("Port", "8000").await;
    b.execute("document.querySelector('#private').click()", vec![])
        .await;
    click_and_load(&b, "Expose port").await;
    b.wait_for_text("this link works for an hour", PATIENCE)
        .await;
    let signed = b
        .execute("return document.querySelector('#ports li a').href", vec![])
        .await;
    let signed = signed.as_str().expect("a signed link").to_string();
    assert!(signed.contains("sandpit_signature="), "{signed}");
    b.goto(&signed).await;
    b.wait_for_text("upload.bin", PATIENCE).await;
    let bare = reqwest::get(&link).await.unwrap();
    assert_eq!(bare.status(), 401, "a private port served a stranger");

    // Its network: a denied address typed in the form, in effect at once
    // (the connect never leaves the VM), the usual network back after.
    b.goto(&format!("{url}/sandboxes/{id}")).await;
    b.fill("Denied", "198.51.100.1/32").await;
    click_and_load(&b, "Save network").await;
    let (_, shown) = rest_get(&url, &admin_key, &format!("/sandboxes/{id}")).await;
    assert_eq!(
        shown["network"]["deny_out"],
        json!(["198.51.100.1/32"]),
        "{shown}"
    );
    b.fill(
        "Command",
        "curl -sS -m 20 -o /dev/null http://198.51.100.1:8080/",
    )
    .await;
    click_and_load(&b, "Run").await;
    wait_for_output(&b, "exit 7").await;
    b.fill("Denied", "").await;
    click_and_load(&b, "Save network").await;
    b.wait_for_text("no lists of its own", PATIENCE).await;

    // The terminal: type a command, read its output on the page.
    b.goto(&format!("{url}/sandboxes/{id}/terminal")).await;
    b.wait_for_text("Connected", PATIENCE).await;
    b.client()
        .find(Locator::Css(".xterm-helper-textarea"))
        .await
        .expect("the terminal's input")
        .send_keys("echo term-$((40+2)) $TERM\u{e007}")
        .await
        .unwrap();
    b.wait_for_text("term-42 xterm-256color", PATIENCE).await;
    shots.take(&b, "terminal").await;

    // Pause, resume and snapshot from the list.
    b.goto(&format!("{url}/sandboxes")).await;
    click_and_load(&b, "Pause").await;
    b.wait_for_text("paused", PATIENCE).await;
    click_and_load(&b, "Resume").await;
    b.wait_for_text("Snapshot", PATIENCE).await;
    let (_, sbx) = rest_get(&url, &admin_key, &format!("/sandboxes/{id}")).await;
    assert_eq!(sbx["status"], "running", "{sbx}");

    // Its events: on its page and on the Events page (newest first, each
    // linking to its sandbox), made, started, paused and resumed, by the
    // dashboard.
    b.goto(&format!("{url}/sandboxes/{id}")).await;
    b.wait_for_text("sandbox.resumed", PATIENCE).await;
    let kinds = b.execute(EVENT_ROWS, vec![json!("#events")]).await;
    assert_lived(&kinds, None);
    b.execute("document.getElementById('events').scrollIntoView()", vec![])
        .await;
    shots.take(&b, "sandbox-events").await;
    click_and_load(&b, "Events").await;
    b.wait_for_text("sandbox.resumed", PATIENCE).await;
    let rows = b.execute(EVENT_ROWS, vec![json!("main")]).await;
    assert_lived(&rows, Some(&id));
    shots.take(&b, "events").await;

    // A webhook to an address the server does not allow is refused,
    // saying why, the form as it was sent.
    click_and_load(&b, "Webhooks").await;
    b.wait_for_text("No webhooks yet", PATIENCE).await;
    b.fill("URL", "http://169.254.169.254/hook").await;
    b.fill("Description (optional)", "mine").await;
    b.execute("document.getElementById('event-paused').click()", vec![])
        .await;
    click_and_load(&b, "Create webhook").await;
    let refused = b
        .execute(
            "const e = document.querySelector('main p.error'); return e ? e.textContent : null",
            vec![],
        )
        .await;
    assert!(
        refused
            .as_str()
            .is_some_and(|e| e.contains("169.254.169.254")),
        "no refusal naming the address: {refused}\n{}",
        b.dump().await
    );
    let kept = b
        .execute(
            "return [document.getElementById('webhook-url').value, \
             document.getElementById('webhook-description').value, \
             document.getElementById('event-paused').checked, \
             document.getElementById('events-all').checked]",
            vec![],
        )
        .await;
    assert_eq!(
        kept,
        json!(["http://169.254.169.254/hook", "mine", true, false]),
        "the form as sent"
    );
    shots.take(&b, "webhooks-refused").await;
    let (_, hooks) = rest_get(&url, &admin_key, "/webhooks").await;
    assert_eq!(hooks["data"], json!([]), "{hooks}");

    // One to the receiver here, for every event ("All events" ticked again
    // unticks the types): made, its secret shown this once, then listed
    // without it.
    b.fill("URL", &hook_url).await;
    b.fill("Description (optional)", "the test's receiver")
        .await;
    b.execute("document.getElementById('events-all').click()", vec![])
        .await;
    let ticked = b
        .execute(
            "return [...document.querySelectorAll('input[type=checkbox]:checked')].map(c => c.id)",
            vec![],
        )
        .await;
    assert_eq!(ticked, json!(["events-all"]));
    click_and_load(&b, "Create webhook").await;
    b.wait_for_text("it is not shown again", PATIENCE).await;
    let secret = b
        .execute(
            "return document.getElementById('webhook-secret').value",
            vec![],
        )
        .await;
    let secret = secret.as_str().unwrap().to_string();
    assert!(secret.starts_with("whsec_"), "{secret}");
    shots.take(&b, "webhook-created").await;
    b.goto(&format!("{url}/webhooks")).await;
    let listed = b.wait_for_text("Webhooks (1)", PATIENCE).await;
    assert!(
        listed.contains(&hook_url) && listed.contains("the test's receiver"),
        "{listed}"
    );
    let html = b
        .execute("return document.documentElement.outerHTML", vec![])
        .await;
    assert!(
        !html.as_str().unwrap().contains(&secret),
        "the secret shown again"
    );
    shots.take(&b, "webhooks").await;
    let (_, hooks) = rest_get(&url, &admin_key, "/webhooks").await;
    assert_eq!(hooks["data"][0]["events"], json!(["*"]), "{hooks}");
    let hook = hooks["data"][0]["id"].as_str().unwrap().to_string();

    b.goto(&format!("{url}/sandboxes")).await;
    b.wait_for_text("Live (1)", PATIENCE).await;
    shots.take(&b, "sandboxes").await;
    b.goto(&format!("{url}/sandboxes")).await;
    click_and_load(&b, "Snapshot").await;
    b.wait_for_text("Snapshots", PATIENCE).await;
    // Written before the answer; a reload shows it ready.
    let snaps = rest_get(&url, &admin_key, "/snapshots").await.1;
    assert_eq!(snaps["data"][0]["status"], "ready", "{snaps}");
    b.goto(&format!("{url}/snapshots")).await;
    b.wait_for_text("ready", PATIENCE).await;
    shots.take(&b, "snapshots").await;

    // +15 min, a sandbox from the snapshot (its files came with it), a
    // fork, then every one destroyed, and the snapshots deleted.
    b.goto(&format!("{url}/sandboxes")).await;
    click_and_load(&b, "+15 min").await;
    let (_, sbx) = rest_get(&url, &admin_key, &format!("/sandboxes/{id}")).await;
    assert_eq!(sbx["timeout_minutes"], 45, "{sbx}");
    let snap = snaps["data"][0]["id"].as_str().unwrap().to_string();
    b.goto(&format!("{url}/sandboxes")).await;
    b.execute(
        "document.getElementById('snapshot').value = arguments[0]",
        vec![json!(snap)],
    )
    .await;
    click_and_load(&b, "Create sandbox").await;
    b.wait_for_text("upload.bin", PATIENCE).await;
    let copy = sandbox_shown(&b).await;
    assert_ne!(copy, id);
    assert_eq!(
        file_bytes(&url, &admin_key, &copy, "/workspace/upload.bin").await,
        content
    );
    b.goto(&format!("{url}/sandboxes")).await;
    click_and_load(&b, "Fork").await;
    b.wait_for_text("Live (3)", PATIENCE).await;
    for left in (0..3).rev() {
        click_and_load(&b, "Destroy").await;
        if left > 0 {
            b.goto(&format!("{url}/sandboxes")).await;
            b.wait_for_text(&format!("Live ({left})"), PATIENCE).await;
        }
    }
    b.goto(&format!("{url}/sandboxes")).await;
    let ended = b.wait_for_text("No live sandboxes", PATIENCE).await;
    assert!(
        ended.matches("destroyed").count() == 3 && ended.contains("demo"),
        "{ended}"
    );

    // The webhook got what happened since it was made (a snapshot, a
    // create, a fork, the ends…): its page shows each delivery with its
    // attempt; one sent again from the page has a second.
    let page = format!("{url}/webhooks/{hook}");
    let deadline = std::time::Instant::now() + PATIENCE;
    let delivered = loop {
        b.goto(&page).await;
        let first = b
            .execute(
                "const d = document.querySelector('.delivery:has(.badge.delivered)'); \
                 return d ? d.id.replace('delivery-', '') : null",
                vec![],
            )
            .await;
        if let Some(first) = first.as_str() {
            break first.to_string();
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no delivery delivered\n{}",
            b.dump().await
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let text = b.text().await;
    assert!(text.contains("HTTP 204"), "{text}");
    assert!(
        hook_got.lock().unwrap().contains(&delivered),
        "the receiver did not get {delivered}"
    );
    click_and_load(&b, &format!("Redeliver {delivered}")).await;
    let attempts = format!("#delivery-{delivered} ol.attempts li");
    let deadline = std::time::Instant::now() + PATIENCE;
    loop {
        b.goto(&page).await;
        let n = b
            .execute(
                "return document.querySelectorAll(arguments[0]).length",
                vec![json!(attempts)],
            )
            .await;
        if n.as_u64() >= Some(2) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no second attempt of {delivered}\n{}",
            b.dump().await
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let got = hook_got.lock().unwrap().clone();
    assert_eq!(
        got.iter().filter(|id| **id == delivered).count(),
        2,
        "{got:?}"
    );
    shots.take(&b, "webhook").await;

    b.goto(&format!("{url}/snapshots")).await;
    while b.text().await.contains("Delete") {
        click_and_load(&b, "Delete").await;
    }
    b.wait_for_text("No snapshots yet", PATIENCE).await;

    // Templates: one built over REST is on its page (a laptop's and a
    // phone's window), its build's page shows the log; a rebuild from the
    // page runs every step again; the create form starts a sandbox from
    // it, the step's file there.
    let started = reqwest::Client::new()
        .post(format!("{url}/v1/templates"))
        .bearer_auth(&admin_key)
        .json(&json!({"name": "dash", "spec": {"steps": [
            {"type": "run", "command": "echo from-the-template > /etc/dash"}
        ]}}))
        .send()
        .await
        .unwrap();
    assert_eq!(started.status().as_u16(), 202);
    let built = template_built(&url, &admin_key, "dash").await;
    click_and_load(&b, "Templates").await;
    b.wait_for_text("Ready to use (1)", PATIENCE).await;
    shots.take(&b, "templates").await;
    click_and_load(&b, "dash:latest").await;
    b.wait_for_text("step 1/1: RUN echo from-the-template", PATIENCE)
        .await;
    shots.take(&b, "template").await;
    click_and_load(&b, "Rebuild from scratch").await;
    let rebuilt = b.current_url().await;
    assert!(!rebuilt.ends_with(&built), "a new build's page: {rebuilt}");
    let deadline = std::time::Instant::now() + PATIENCE;
    loop {
        b.goto(&rebuilt).await;
        let text = b.text().await;
        if text.contains("ready in") {
            assert!(
                !text.contains("(cached)"),
                "a rebuild from scratch used the cache: {text}"
            );
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the rebuild did not finish: {text}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    b.goto(&format!("{url}/sandboxes")).await;
    let offered = b
        .execute(
            "return [...document.querySelectorAll('#template option')].map(o => o.value)",
            vec![],
        )
        .await;
    assert_eq!(offered, json!(["", "dash:latest"]));
    b.execute(
        "document.getElementById('template').value = 'dash:latest'",
        vec![],
    )
    .await;
    click_and_load(&b, "Create sandbox").await;
    b.wait_for_text("Preview ports", PATIENCE).await;
    let from_template = sandbox_shown(&b).await;
    b.fill("Command", "cat /etc/dash").await;
    click_and_load(&b, "Run").await;
    wait_for_output(&b, "from-the-template").await;
    let gone = reqwest::Client::new()
        .delete(format!("{url}/v1/sandboxes/{from_template}"))
        .bearer_auth(&admin_key)
        .send()
        .await
        .unwrap();
    assert_eq!(gone.status().as_u16(), 200);

    // Usage.
    click_and_load(&b, "Usage").await;
    b.wait_for_text("Credit left", PATIENCE).await;
    b.wait_for_text("Cost per sandbox", PATIENCE).await;
    shots.take(&b, "usage").await;

    // A key made on the page works; revoked on the page, it no longer does.
    click_and_load(&b, "API keys").await;
    click_and_load(&b, "Create a key").await;
    b.wait_for_text("shown only this once", PATIENCE).await;
    let new_key = b
        .execute("return document.getElementById('new-key').value", vec![])
        .await;
    let new_key = new_key.as_str().unwrap().to_string();
    assert!(new_key.starts_with("sp_"), "{new_key}");
    let mcp = b.wait_for_text("mcpServers", PATIENCE).await;
    assert!(
        mcp.contains(&format!("Bearer {new_key}")) && mcp.contains("/v1/mcp"),
        "{mcp}"
    );
    assert_eq!(rest_get(&url, &new_key, "/account").await.0, 200);
    // The E2B SDKs' variables, with the key's E2B spelling, which is the
    // same key.
    let e2b = b
        .execute(
            "return document.getElementById('e2b-env').textContent",
            vec![],
        )
        .await;
    let e2b = e2b.as_str().unwrap().to_string();
    assert!(e2b.contains(&format!("E2B_API_URL={url}/e2b")), "{e2b}");
    assert!(e2b.contains(&format!("E2B_SANDBOX_URL={url}\n")), "{e2b}");
    let e2b_key = e2b
        .lines()
        .find_map(|l| l.strip_prefix("export E2B_API_KEY="))
        .expect("E2B_API_KEY")
        .to_string();
    assert!(e2b_key.starts_with("e2b_"), "{e2b}");
    assert_eq!(rest_get(&url, &e2b_key, "/account").await.0, 200);
    click_and_load(&b, "API keys").await;
    click_and_load(&b, &format!("Revoke {}", &new_key[..12])).await;
    b.wait_for_text("revoked", PATIENCE).await;
    shots.take(&b, "keys").await;
    assert_eq!(rest_get(&url, &new_key, "/account").await.0, 401);
    assert_eq!(rest_get(&url, &e2b_key, "/account").await.0, 401);

    // Sign out: the dashboard asks for a key again.
    click_and_load(&b, "Sign out").await;
    b.wait_for_text("You are signed out", PATIENCE).await;
    b.goto(&format!("{url}/sandboxes")).await;
    b.wait_for_text("Paste an API key", PATIENCE).await;

    // Sign up with an invitation: a new account with its free credit and
    // its first key, signed in, that sees none of admin's sandboxes.
    let code = server.admin(&["invite", "create", "--uses", "3"]);
    b.goto(&format!("{url}/sign-up")).await;
    b.wait_for_text("of free credit", PATIENCE).await;
    b.fill("Account name", "bob").await;
    b.fill("Invitation code", &code).await;
    click_and_load(&b, "Create account").await;
    b.wait_for_text("Welcome to Sandpit", PATIENCE).await;
    shots.take(&b, "sign-up").await;
    let bob_key = b
        .execute("return document.getElementById('new-key').value", vec![])
        .await;
    let bob_key = bob_key.as_str().unwrap().to_string();
    let (_, account) = rest_get(&url, &bob_key, "/account").await;
    assert_eq!(account["name"], "bob", "{account}");
    assert_eq!(account["credit_remaining_usd"], 2.5, "{account}");
    b.goto(&format!("{url}/sandboxes")).await;
    let text = b.wait_for_text("No live sandboxes", PATIENCE).await;
    assert!(!text.contains(&id), "bob sees admin's sandbox");
    b.goto(&format!("{url}/sandboxes/{id}")).await;
    let text = b.wait_for_text("Not Found", PATIENCE).await;
    assert!(
        text.contains("Sign out"),
        "the 404 page lost the navigation: {text}"
    );
    shots.take(&b, "not-found").await;
    b.goto(&format!("{url}/sandboxes/{id}/terminal")).await;
    b.wait_for_text("Not Found", PATIENCE).await;
    let fetched = b
        .execute(
            "return fetch(arguments[0]).then(r => r.status)",
            vec![json!(format!(
                "/sandboxes/{id}/files/download?path=/workspace/upload.bin"
            ))],
        )
        .await;
    assert_eq!(fetched, json!(404));

    // The second sign-up from this address is refused for its code, the
    // third for the limit, saying when to try again.
    b.goto(&format!("{url}/sandboxes")).await;
    click_and_load(&b, "Sign out").await;
    b.goto(&format!("{url}/sign-up")).await;
    b.fill("Account name", "carol").await;
    b.fill("Invitation code", "spi_wrong").await;
    click_and_load(&b, "Create account").await;
    b.wait_for_text("unknown, used up or expired", PATIENCE)
        .await;
    b.fill("Account name", "dave").await;
    b.fill("Invitation code", &code).await;
    click_and_load(&b, "Create account").await;
    b.wait_for_text("Too many sign-ups from your address", PATIENCE)
        .await;

    // An operator sees every account and adds credit.
    sign_in(&b, &url, &admin_key).await;
    click_and_load(&b, "Accounts").await;
    b.wait_for_text("bob", PATIENCE).await;
    b.fill("USD to add to bob", "10").await;
    click_and_load(&b, "Add credit to bob").await;
    b.wait_for_text("$12.50", PATIENCE).await;
    shots.take(&b, "accounts").await;
    let (_, account) = rest_get(&url, &bob_key, "/account").await;
    assert_eq!(account["credit_remaining_usd"], 12.5, "{account}");
    // bob's page has no Accounts.
    click_and_load(&b, "Sign out").await;
    sign_in(&b, &url, &bob_key).await;
    let text = b.text().await;
    assert!(!text.contains("Accounts"), "{text}");
    b.goto(&format!("{url}/accounts")).await;
    b.wait_for_text("Only an operator", PATIENCE).await;

    let traces = b.traces();
    drop(b);
    traces.assert_all_gone();
    assert!(Path::new(&shots.dir).join("terminal.png").exists());
}
