//! A real browser for tests: Debian's headless Chromium driven through its
//! chromedriver (WebDriver) with `fantoccini`, behind a small API that acts
//! the way a user does — type into the input a `<label>` names, press the
//! button whose text is shown, read what the page says — so a test of a web
//! page reads like what a person would do with it, and breaks when the page
//! stops working for one rather than when its markup is reshuffled.
//!
//! Why a real browser and not an HTTP client: cookies' `HttpOnly` and
//! `SameSite`, forms, inline scripts, redirects and layouts on a phone are
//! the browser's to apply; only a browser shows whether they work.
//!
//! Each [`Browser`] has its own chromedriver on a free loopback port and its
//! own throw-away profile (`--user-data-dir`, and the config and cache
//! directories where Chromium keeps crash reports) in a temporary
//! directory. Dropping it, also while a test panics, ends the WebDriver
//! session (Chromium quits), SIGKILLs chromedriver's process group and
//! anything still naming that directory (Chromium's crash handlers start
//! sessions of their own), and removes the directory: nothing outlives it.
//!
//! Chromium and chromedriver missing is a failure that says what to
//! install (`scripts/install-deps.sh` installs them), never a skipped test.
//!
//! Every helper panics on failure, naming what it looked for, with the
//! page's address and text.
#![allow(dead_code)]

use fantoccini::elements::{Element, ElementRef};
use fantoccini::{Client, ClientBuilder};
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub use fantoccini::cookies::Cookie;

/// Debian's chromedriver (package `chromium-driver`).
pub const CHROMEDRIVER: &str = "/usr/bin/chromedriver";
/// Debian's Chromium itself (package `chromium`). Not `/usr/bin/chromium`:
/// that is a launcher script for desktops which adds flags of its own
/// (extensions, GPU rasterization) and runs shell checks; a test wants
/// exactly the flags it passes.
pub const CHROMIUM: &str = "/usr/lib/chromium/chromium";
/// What to install when either is missing.
pub const INSTALL_HINT: &str = "apt-get install --no-install-recommends chromium chromium-driver \
     fonts-dejavu-core (scripts/install-deps.sh does)";

/// The viewport a browser opens with: a laptop's.
pub const DESKTOP: (u32, u32) = (1280, 800);
/// A phone's viewport (an iPhone 12 to 15's, in CSS pixels).
pub const PHONE: (u32, u32) = (390, 844);

/// How long chromedriver may take to answer, and Chromium to start.
const START_BOUND: Duration = Duration::from_secs(60);
/// At most this much of a page's text goes into a panic message.
const DUMP_CHARS: usize = 4000;

/// The W3C WebDriver key of an element reference in a script's result.
const ELEMENT_KEY: &str = "element-6066-11e4-a52e-4f735466cecf";

/// A headless Chromium with its own chromedriver, profile and port.
pub struct Browser {
    client: Client,
    session_id: String,
    chromedriver: Child,
    port: u16,
    /// The profile, config and cache directories and chromedriver's log.
    dir: tempfile::TempDir,
}

impl Browser {
    /// Start chromedriver and a headless Chromium with a [`DESKTOP`] viewport.
    /// Must run inside a tokio runtime (the WebDriver client's connection
    /// is a task on it).
    pub async fn start() -> Browser {
        for (binary, package) in [(CHROMEDRIVER, "chromium-driver"), (CHROMIUM, "chromium")] {
            assert!(
                Path::new(binary).exists(),
                "{binary} (package {package}) is not installed, so no browser test can run: \
                 {INSTALL_HINT}"
            );
        }
        let dir = tempfile::Builder::new()
            .prefix("sandpit-browser-")
            .tempdir()
            .expect("a temporary directory for the browser");
        let port = free_port();
        let log = dir.path().join("chromedriver.log");
        let mut chromedriver = Command::new(CHROMEDRIVER)
            .arg(format!("--port={port}"))
            .arg(format!("--log-path={}", log.display()))
            // Chromium's crash handlers keep their reports under the config
            // directory: in the temporary one, not root's home.
            .env("XDG_CONFIG_HOME", dir.path().join("config"))
            .env("XDG_CACHE_HOME", dir.path().join("cache"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            // A process group of its own, Chromium included: one signal
            // ends them all.
            .process_group(0)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {CHROMEDRIVER}: {e}; {INSTALL_HINT}"));
        wait_until_ready(&mut chromedriver, port, &log);

        let profile = dir.path().join("profile");
        let (width, height) = DESKTOP;
        let mut capabilities = serde_json::Map::new();
        capabilities.insert("browserName".into(), json!("chrome"));
        capabilities.insert(
            "goog:chromeOptions".into(),
            json!({
                "binary": CHROMIUM,
                "args": [
                    "--headless=new",
                    // Tests run as root, where Chromium's sandbox refuses to start.
                    "--no-sandbox",
                    "--disable-gpu",
                    // /dev/shm is small in containers; Chromium crashes when it fills.
                    "--disable-dev-shm-usage",
                    format!("--window-size={width},{height}"),
                    // One CSS pixel is one screenshot pixel.
                    "--force-device-scale-factor=1",
                    format!("--user-data-dir={}", profile.display()),
                    // Every page a test opens is on the loopback.
                    "--no-proxy-server",
                    "--no-first-run",
                    "--lang=en-US",
                ],
            }),
        );
        let client =
            match ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
                .capabilities(capabilities)
                .connect(&format!("http://127.0.0.1:{port}"))
                .await
            {
                Ok(client) => client,
                Err(e) => {
                    let _ = chromedriver.kill();
                    let _ = chromedriver.wait();
                    panic!(
                        "{CHROMEDRIVER} could not start {CHROMIUM}: {e}\n(chromium and \
                     chromium-driver must be the same version: {INSTALL_HINT})\n\
                     chromedriver's log ends:\n{}",
                        tail(&log, 40)
                    );
                }
            };
        let session_id = client
            .session_id()
            .await
            .expect("the WebDriver session's id")
            .expect("a WebDriver session has an id");
        let browser = Browser {
            client,
            session_id,
            chromedriver,
            port,
            dir,
        };
        // `--window-size` sizes the window, frame included.
        browser.set_window_size(width, height).await;
        browser
    }

    /// The WebDriver client, for what this API does not cover.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// Open `url` and wait until it has loaded.
    pub async fn goto(&self, url: &str) {
        if let Err(e) = self.client.goto(url).await {
            panic!("could not open {url}: {e}");
        }
    }

    /// The address of the page shown now.
    pub async fn current_url(&self) -> String {
        self.client
            .current_url()
            .await
            .expect("the current URL")
            .to_string()
    }

    /// The page's visible text (its body's, as rendered: hidden elements
    /// left out).
    pub async fn text(&self) -> String {
        let body = self
            .client
            .find(fantoccini::Locator::Css("body"))
            .await
            .unwrap_or_else(|e| panic!("the page has no body: {e}"));
        body.text().await.expect("the body's text")
    }

    /// Wait up to `timeout` until the page's visible text contains `needle`;
    /// returns that text.
    pub async fn wait_for_text(&self, needle: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            // The body may be missing for a moment while a page replaces itself.
            if let Ok(body) = self.client.find(fantoccini::Locator::Css("body")).await {
                if let Ok(text) = body.text().await {
                    if text.contains(needle) {
                        return text;
                    }
                }
            }
            if Instant::now() > deadline {
                panic!(
                    "the page did not say {needle:?} within {timeout:?}\n{}",
                    self.dump().await
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Type `text` into a field, as a user would: the field a `<label>`
    /// whose text is `label_or_css` names (or whose `aria-label` it is),
    /// else the element the CSS selector `label_or_css` selects. Whatever
    /// the field held is cleared first.
    pub async fn fill(&self, label_or_css: &str, text: &str) {
        let found = self.execute(FIND_FIELD, vec![json!(label_or_css)]).await;
        let field = match self.element(&found) {
            Some(field) => field,
            None => panic!(
                "no field labelled {label_or_css:?} (nor one it selects as CSS); the page's \
                 labels: {}\n{}",
                found["labels"],
                self.dump().await
            ),
        };
        if let Err(e) = field.clear().await {
            panic!(
                "the field {label_or_css:?} cannot be cleared: {e}\n{}",
                self.dump().await
            );
        }
        if let Err(e) = field.send_keys(text).await {
            panic!(
                "cannot type into the field {label_or_css:?}: {e}\n{}",
                self.dump().await
            );
        }
    }

    /// Click the visible button or link whose text or accessible name
    /// (`aria-label`, `title`, a submit input's value) is `name`, spaces
    /// collapsed. A real click: one hidden under something else fails.
    pub async fn click(&self, name: &str) {
        let found = self.execute(FIND_CLICKABLE, vec![json!(name)]).await;
        let target = match self.element(&found) {
            Some(target) => target,
            None => panic!(
                "nothing visible to click named {name:?}; the page's buttons and links: {}\n{}",
                found["names"],
                self.dump().await
            ),
        };
        if let Err(e) = target.click().await {
            panic!("clicking {name:?} failed: {e}\n{}", self.dump().await);
        }
    }

    /// Save a PNG of the window to `path` (directories created); returns
    /// its bytes.
    pub async fn screenshot(&self, path: &Path) -> Vec<u8> {
        let png = match self.client.screenshot().await {
            Ok(png) => png,
            Err(e) => panic!("no screenshot: {e}\n{}", self.dump().await),
        };
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).unwrap();
        }
        std::fs::write(path, &png).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
        png
    }

    /// Resize the window so that the page gets `width` x `height` CSS
    /// pixels (its viewport, and what a screenshot shows), e.g. [`PHONE`].
    /// Headless Chromium still counts a browser frame (toolbars) in a
    /// window's size; the frame is measured and added. Panics unless the
    /// page then has that size.
    pub async fn set_window_size(&self, width: u32, height: u32) {
        const VIEWPORT: &str = "return [window.innerWidth, window.innerHeight]";
        const FRAME: &str = "return [window.outerWidth - window.innerWidth, \
                             window.outerHeight - window.innerHeight]";
        let frame = self.execute(FRAME, vec![]).await;
        let extra = |i: usize| frame[i].as_u64().unwrap_or(0) as u32;
        if let Err(e) = self
            .client
            .set_window_size(width + extra(0), height + extra(1))
            .await
        {
            panic!("resizing the window to a {width}x{height} viewport: {e}");
        }
        let want = json!([width, height]);
        // A loaded browser resizes a little later than it answers: the
        // viewport is read until it is what was asked, for up to 2 s.
        let settled = || async {
            let mut viewport = self.execute(VIEWPORT, vec![]).await;
            for _ in 0..20 {
                if viewport == want {
                    break;
                }
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                viewport = self.execute(VIEWPORT, vec![]).await;
            }
            viewport
        };
        let mut viewport = settled().await;
        // A frame measured while the window was held at its smallest (a
        // phone's width is under headless Chromium's least) is off by what
        // was held: correct by what the page got, once.
        if viewport != want {
            let got = |i: usize| viewport[i].as_i64().unwrap_or(0);
            let outer_w = (width + extra(0)) as i64 + (width as i64 - got(0));
            let outer_h = (height + extra(1)) as i64 + (height as i64 - got(1));
            if let Err(e) = self
                .client
                .set_window_size(outer_w.max(1) as u32, outer_h.max(1) as u32)
                .await
            {
                panic!("resizing the window to a {width}x{height} viewport: {e}");
            }
            viewport = settled().await;
        }
        assert_eq!(
            viewport, want,
            "the viewport is not {width}x{height} after resizing the window (its frame: {frame})"
        );
    }

    /// The cookies the page's site has, with their attributes (`HttpOnly`,
    /// `SameSite`, `Secure`, path, expiry) as the browser holds them.
    pub async fn cookies(&self) -> Vec<Cookie<'static>> {
        self.client
            .get_all_cookies()
            .await
            .unwrap_or_else(|e| panic!("reading the cookies: {e}"))
    }

    /// Run `script` (a function body: `return` gives the result, the
    /// arguments are `arguments[0]`, ...) in the page; for what a user
    /// cannot do or see. Panics when the script throws.
    pub async fn execute(&self, script: &str, args: Vec<Value>) -> Value {
        match self.client.execute(script, args).await {
            Ok(v) => v,
            Err(e) => panic!("the script failed: {e}\n{script}\n{}", self.dump().await),
        }
    }

    /// The page's address and the start of its text, for panic messages.
    pub async fn dump(&self) -> String {
        let url = match self.client.current_url().await {
            Ok(u) => u.to_string(),
            Err(e) => format!("(unknown: {e})"),
        };
        let text = match self.client.find(fantoccini::Locator::Css("body")).await {
            Ok(body) => body
                .text()
                .await
                .unwrap_or_else(|e| format!("(unreadable: {e})")),
            Err(e) => format!("(no body: {e})"),
        };
        let mut shown: String = text.chars().take(DUMP_CHARS).collect();
        if shown.len() < text.len() {
            shown.push_str("\n[...]");
        }
        format!("page {url} says:\n---\n{shown}\n---")
    }

    /// The temporary directory of this browser (profile, chromedriver's log).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// chromedriver's log (`--log-path`).
    pub fn chromedriver_log(&self) -> PathBuf {
        self.dir.path().join("chromedriver.log")
    }

    /// The process id of chromedriver, which is also its process group's.
    pub fn chromedriver_pid(&self) -> u32 {
        self.chromedriver.id()
    }

    /// What to look for, once this browser is dropped, to prove nothing
    /// of it is left.
    pub fn traces(&self) -> Traces {
        Traces {
            process_group: self.chromedriver.id(),
            dir: self.dir.path().to_path_buf(),
        }
    }

    /// The element `found.element` of a finder script's result.
    fn element(&self, found: &Value) -> Option<Element> {
        let id = found["element"][ELEMENT_KEY].as_str()?;
        Some(Element::from_element_id(
            self.client.clone(),
            ElementRef::from(id.to_string()),
        ))
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        // Ending the session makes chromedriver quit Chromium and wait for
        // it. Plain blocking HTTP: a drop cannot await, and may run while
        // the runtime shuts down.
        let _ = http(
            self.port,
            "DELETE",
            &format!("/session/{}", self.session_id),
            Duration::from_secs(10),
        );
        // SAFETY: signals to the process group our child leads.
        unsafe {
            libc::kill(-(self.chromedriver.id() as i32), libc::SIGKILL);
        }
        let _ = self.chromedriver.wait();
        // Crash handlers make sessions of their own; they name the
        // directory (their report database is in it).
        sandpit_runtime::vm::process::kill_mentioning(&self.dir.path().display().to_string());
    }
}

/// The marks a [`Browser`] leaves while it runs: chromedriver's process
/// group (Chromium's processes are in it) and its temporary directory
/// (named in the command lines of Chromium's crash handlers, which leave
/// the group).
#[derive(Debug, Clone)]
pub struct Traces {
    pub process_group: u32,
    pub dir: PathBuf,
}

impl Traces {
    /// The live processes (zombies aside) still in the group or naming the
    /// directory: `pid command-line` each.
    pub fn live_processes(&self) -> Vec<String> {
        let dir = self.dir.display().to_string();
        let mut left = Vec::new();
        for pid in std::fs::read_dir("/proc")
            .expect("/proc")
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        {
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                continue;
            };
            // After the command's name in parentheses: state, ppid, pgrp.
            let Some((_, rest)) = stat.rsplit_once(')') else {
                continue;
            };
            let fields: Vec<&str> = rest.split_whitespace().collect();
            if fields.first() == Some(&"Z") {
                continue;
            }
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline"))
                .map(|raw| String::from_utf8_lossy(&raw).replace('\0', " "))
                .unwrap_or_default();
            let in_group = fields.get(2) == Some(&self.process_group.to_string().as_str());
            if in_group || cmdline.contains(&dir) {
                left.push(format!("{pid} {cmdline}"));
            }
        }
        left
    }

    /// Panics unless, within 10 s, no process of the browser lives and its
    /// directory is gone.
    pub fn assert_all_gone(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let left = self.live_processes();
            if left.is_empty() && !self.dir.exists() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the browser left processes {left:#?} or its directory {} (exists: {})",
                self.dir.display(),
                self.dir.exists()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// Finds the field `arguments[0]` names: by a label's text, then by
/// `aria-label`, then as a CSS selector. Returns `{element}` or, when
/// there is none, `{labels}` (every label's text, for the panic).
const FIND_FIELD: &str = r#"
const want = arguments[0];
const norm = s => (s || "").replace(/\s+/g, " ").trim();
const labels = [...document.querySelectorAll("label")];
for (const label of labels) {
  if (norm(label.textContent) === norm(want) && label.control) return {element: label.control};
}
for (const el of document.querySelectorAll("[aria-label]")) {
  if (norm(el.getAttribute("aria-label")) === norm(want)) return {element: el};
}
try {
  const el = document.querySelector(want);
  if (el) return {element: el};
} catch (e) { /* not a selector */ }
return {labels: labels.map(l => norm(l.textContent))};
"#;

/// Finds the visible button or link `arguments[0]` names (its text, or
/// `aria-label`, `title`, or a submit input's `value`). Returns `{element}`
/// or, when there is none, `{names}` (every visible one's, for the panic).
const FIND_CLICKABLE: &str = r#"
const want = arguments[0];
const norm = s => (s || "").replace(/\s+/g, " ").trim();
const all = [...document.querySelectorAll(
  'button, a[href], [role="button"], [role="link"], input[type="submit"], input[type="button"], input[type="reset"], summary'
)];
const visible = el => el.getClientRects().length > 0 && getComputedStyle(el).visibility !== "hidden";
const names = el => [el.innerText, el.getAttribute("aria-label"), el.getAttribute("title"),
  el.tagName === "INPUT" ? el.value : ""].map(norm).filter(n => n);
const shown = all.filter(visible);
const hit = shown.find(el => names(el).includes(norm(want)));
if (hit) return {element: hit};
return {names: shown.map(el => names(el)[0] || "(unnamed " + el.tagName.toLowerCase() + ")")};
"#;

/// A loopback port nobody listens on now.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free loopback port")
        .port()
}

/// Wait until chromedriver on `port` says it is ready; panics with its log
/// if it exits or does not answer in time.
fn wait_until_ready(chromedriver: &mut Child, port: u16, log: &Path) {
    let deadline = Instant::now() + START_BOUND;
    loop {
        if let Some(status) = chromedriver.try_wait().unwrap() {
            panic!(
                "{CHROMEDRIVER} exited ({status}) before answering on port {port}; its log \
                 ends:\n{}",
                tail(log, 40)
            );
        }
        if let Some(body) = http(port, "GET", "/status", Duration::from_secs(2)) {
            if body.contains(r#""ready":true"#) {
                return;
            }
        }
        if Instant::now() > deadline {
            let _ = chromedriver.kill();
            let _ = chromedriver.wait();
            panic!(
                "{CHROMEDRIVER} did not answer on port {port} within {START_BOUND:?}; its log \
                 ends:\n{}",
                tail(log, 40)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// One blocking HTTP/1.1 request without a body to chromedriver; the
/// response (head and body), or `None` when it does not answer.
fn http(port: u16, method: &str, path: &str, timeout: Duration) -> Option<String> {
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let mut stream = TcpStream::connect_timeout(&addr, timeout).ok()?;
    stream.set_read_timeout(Some(timeout)).ok()?;
    stream.set_write_timeout(Some(timeout)).ok()?;
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 0\r\n\
         Connection: close\r\n\r\n"
    )
    .ok()?;
    // chromedriver says `Connection: close` but keeps the connection open:
    // read as far as its Content-Length.
    let mut response = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let text = String::from_utf8_lossy(&response);
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let length = head.lines().find_map(|line| {
                let (name, value) = line.split_once(':')?;
                name.eq_ignore_ascii_case("content-length")
                    .then(|| value.trim().parse::<usize>().ok())?
            });
            if length.is_some_and(|n| body.len() >= n) {
                return Some(text.into_owned());
            }
        }
        match stream.read(&mut chunk) {
            Ok(0) => return Some(text.into_owned()),
            Ok(n) => response.extend_from_slice(&chunk[..n]),
            Err(_) => return None,
        }
    }
}

/// The last `lines` lines of the file at `path`.
fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| format!("({} unreadable: {e})", path.display()));
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
