//! A real `sandpit serve` process for tests: started on an ephemeral port
//! with a test config, its first-start admin key captured, stopped with
//! SIGTERM on drop; and a small REST client for it.

use super::images_dir;
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The test servers' config: one small size, and boots given three minutes
/// rather than one (`sandpit_vmtest::BOOT_TIMEOUT` says why).
pub const CONFIG: &str = concat!(
    "boot_timeout_secs = 180\n",
    "[sizes.small]\nvcpus = 2\nmemory_mb = 1024\ndisk_gb = 4\nprice_usd_per_hour = 0.09\n"
);

pub fn sandpit(data: &Path) -> Command {
    sandpit_of(
        Path::new(env!("CARGO_BIN_EXE_sandpit")),
        &images_dir(),
        data,
    )
}

fn sandpit_of(program: &Path, images: &Path, data: &Path) -> Command {
    let mut c = Command::new(program);
    c.arg("--data-dir")
        .arg(data)
        .arg("--images-dir")
        .arg(images)
        .arg("--config")
        .arg(data.join("config.toml"));
    c
}

/// Servers and nodes of this build with the same config share one
/// templates directory (`data/templates` is a link to it), as processes on
/// one data directory do: the first to need a size's template builds it
/// (about a cold boot, the dearest thing a test server does under
/// emulation) under the per-size lock, and the others restore from it.
/// Same config, same image and QEMU: the same template key, so no server
/// removes another's template as outdated. A data directory that already
/// has its own is left alone, and so are other releases' servers
/// ([`Build`]), whose templates differ and are the subject of their tests.
fn share_templates(data: &Path, config: &str) {
    use std::hash::{Hash, Hasher};
    static ROOT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    let link = data.join("templates");
    if link.symlink_metadata().is_ok() {
        return;
    }
    let mut h = std::collections::hash_map::DefaultHasher::new();
    config.hash(&mut h);
    let shared = ROOT
        .get_or_init(sandpit_vmtest::data_dir)
        .join(format!("templates-{:016x}", h.finish()));
    std::fs::create_dir_all(&shared).unwrap();
    std::os::unix::fs::symlink(&shared, &link).unwrap();
}

/// A `sandpit` to start instead of this build's (another release's), with
/// the agent its guest image is built from and its images directory.
pub struct Build {
    pub program: PathBuf,
    pub agent: PathBuf,
    pub images: PathBuf,
}

impl Build {
    fn command(&self, data: &Path) -> Command {
        let mut c = sandpit_of(&self.program, &self.images, data);
        c.env("SANDPIT_AGENT_BIN", &self.agent);
        c
    }
}

/// A running `sandpit serve`.
pub struct Server {
    pub data: PathBuf,
    pub child: Child,
    pub url: String,
    pub admin_key: Option<String>,
    /// Its standard error so far, a line each.
    pub log: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    /// Its database's URL, when not the data directory's SQLite file.
    pub database: Option<String>,
}

impl Server {
    pub fn start(data: &Path) -> Server {
        Server::start_with(data, "")
    }

    /// Start with `extra` appended to the test config (TOML).
    pub fn start_with(data: &Path, extra: &str) -> Server {
        Server::start_on(data, extra, "127.0.0.1:0")
    }

    /// Start listening on `listen`, with `extra` appended to the test config.
    pub fn start_on(data: &Path, extra: &str, listen: &str) -> Server {
        Server::start_under(data, extra, listen, &[])
    }

    /// [`Server::start_on`], run by the command `wrapper` (which ends with
    /// the program to run and its arguments, e.g. `unshare -m sh -c '...; exec "$@"' sh`).
    pub fn start_under(data: &Path, extra: &str, listen: &str, wrapper: &[&str]) -> Server {
        Server::start_full(data, extra, listen, wrapper, None, None)
    }

    /// A server of `build` on `data`, with the test config.
    pub fn start_build(data: &Path, build: &Build) -> Server {
        Server::start_full(data, "", "127.0.0.1:0", &[], None, Some(build))
    }

    /// A server whose store is the (PostgreSQL) database at `url`, named
    /// `name` in it; [`Server::admin`]'s commands use that database too.
    pub fn start_on_database(data: &Path, url: &str, name: &str) -> Server {
        Server::start_node(data, url, name, "")
    }

    /// [`Server::start_on_database`] with `extra` appended to the config.
    pub fn start_node(data: &Path, url: &str, name: &str, extra: &str) -> Server {
        Server::start_full(
            data,
            extra,
            "127.0.0.1:0",
            &[],
            Some((url, name, &[])),
            None,
        )
    }

    /// [`Server::start_node`] with more arguments for `serve`.
    pub fn start_node_with(
        data: &Path,
        url: &str,
        name: &str,
        extra: &str,
        args: &[&str],
    ) -> Server {
        Server::start_full(
            data,
            extra,
            "127.0.0.1:0",
            &[],
            Some((url, name, args)),
            None,
        )
    }

    fn start_full(
        data: &Path,
        extra: &str,
        listen: &str,
        wrapper: &[&str],
        database: Option<(&str, &str, &[&str])>,
        build: Option<&Build>,
    ) -> Server {
        let config = format!("{CONFIG}{extra}");
        std::fs::write(data.join("config.toml"), &config).unwrap();
        if build.is_none() {
            share_templates(data, &config);
        }
        // Only a first start (no database yet) prints an admin key; of a
        // shared database, whatever is printed is taken.
        let first_start = database.is_some() || !data.join("sandpit.db").exists();
        let mut direct = match build {
            Some(b) => b.command(data),
            None => sandpit(data),
        };
        if let Some((url, name, args)) = database {
            direct
                .env("SANDPIT_DATABASE_URL", url)
                .args(["serve", "--name", name])
                .args(args);
        } else {
            direct.arg("serve");
        }
        let mut cmd = match wrapper.split_first() {
            None => direct,
            Some((program, args)) => {
                let mut c = Command::new(program);
                c.args(args)
                    .arg(direct.get_program())
                    .args(direct.get_args());
                c
            }
        };
        let mut child = cmd
            .args(["--listen", listen])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let tx2 = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                // The key alone on its line (it also appears in the MCP config).
                let t = line.trim();
                if t.starts_with("sp_") && t.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
                {
                    let _ = tx2.send(format!("KEY {t}"));
                }
            }
        });
        let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let log_writer = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                eprintln!("[serve] {line}");
                log_writer.lock().unwrap().push(line.clone());
                if let Some(rest) = line.split("serving ").nth(1) {
                    let url = rest.split_whitespace().next().unwrap().to_string();
                    let _ = tx.send(format!("URL {url}"));
                }
            }
        });
        let (mut url, mut key) = (None, None);
        // A server of another build (the previous release, in the upgrade
        // test) may first bootstrap its own guest root file system when
        // its recipe is not this build's and no cache holds it (minutes).
        let start_within = match build {
            Some(_) => Duration::from_secs(900),
            None => Duration::from_secs(120),
        };
        let deadline = Instant::now() + start_within;
        while url.is_none() {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(m) if m.starts_with("URL ") => url = Some(m[4..].to_string()),
                Ok(m) if m.starts_with("KEY ") => key = Some(m[4..].to_string()),
                Ok(_) => {}
                Err(_) => panic!("sandpit serve did not start"),
            }
        }
        // The first-start key is printed (on stdout) before the serving line
        // (on stderr), but the two are read by different threads: give the
        // stdout reader a moment.
        let until = Instant::now() + Duration::from_secs(2);
        while key.is_none() && first_start {
            let left = until.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(m) => {
                    if let Some(k) = m.strip_prefix("KEY ") {
                        key = Some(k.to_string());
                    }
                }
                Err(_) => break,
            }
        }
        Server {
            data: data.to_path_buf(),
            child,
            url: url.unwrap(),
            admin_key: key,
            database: database.map(|(url, _, _)| url.to_string()),
            log,
        }
    }

    /// Wait (up to `bound`) for a line of its log that contains `needle`.
    pub fn wait_for_log(&self, needle: &str, bound: Duration) -> Option<String> {
        wait_for_line(&self.log, needle, bound)
    }

    pub fn sigkill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        std::mem::forget(self);
    }

    /// Run an operator command on this server's data directory; panics
    /// unless it succeeds; returns its trimmed stdout.
    pub fn admin(&self, args: &[&str]) -> String {
        let mut cmd = sandpit(&self.data);
        if let Some(url) = &self.database {
            cmd.env("SANDPIT_DATABASE_URL", url);
        }
        let out = cmd.args(args).output().unwrap();
        assert!(
            out.status.success(),
            "sandpit {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap().trim().to_string()
    }

    /// `sandpit key create` for a new account with `usd` of credit.
    pub fn new_account(&self, name: &str, usd: f64) -> String {
        self.admin(&["account", "create", name, "--credit", &usd.to_string()]);
        self.admin(&["key", "create", "--account", name])
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // SAFETY: a plain signal to our child.
        unsafe {
            libc::kill(self.child.id() as i32, libc::SIGTERM);
        }
        let _ = self.child.wait();
    }
}

pub struct Rest {
    pub http: reqwest::Client,
    pub url: String,
    pub key: String,
}

impl Rest {
    pub fn new(s: &Server, key: &str) -> Rest {
        Rest {
            http: reqwest::Client::new(),
            url: s.url.clone(),
            key: key.to_string(),
        }
    }
    pub async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> (u16, Value) {
        self.try_call(method, path, body).await.unwrap()
    }
    /// [`Rest::call`] that returns a failed connection (a server killed
    /// mid-request) instead of panicking.
    pub async fn try_call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> reqwest::Result<(u16, Value)> {
        let mut r = self
            .http
            .request(method, format!("{}/v1{path}", self.url))
            .bearer_auth(&self.key);
        if let Some(b) = body {
            r = r.json(&b);
        }
        let resp = r.send().await?;
        let status = resp.status().as_u16();
        assert!(resp.headers().contains_key("x-request-id"));
        let v = match resp.bytes().await {
            Ok(b) => serde_json::from_slice(&b).unwrap_or(Value::Null),
            Err(e) => return Err(e),
        };
        Ok((status, v))
    }
    pub async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        self.call(reqwest::Method::POST, path, Some(body)).await
    }
    pub async fn get(&self, path: &str) -> (u16, Value) {
        self.call(reqwest::Method::GET, path, None).await
    }
    /// Runs `command` in sandbox `id`; its stdout, trimmed (panics unless it
    /// exits 0).
    pub async fn sh(&self, id: &str, command: &str) -> String {
        let (st, ex) = self
            .post(
                &format!("/sandboxes/{id}/exec"),
                serde_json::json!({ "command": command }),
            )
            .await;
        assert_eq!(st, 200, "{command}: {ex}");
        assert_eq!(ex["exit_code"], 0, "{command}: {ex}");
        ex["stdout"].as_str().unwrap().trim().to_string()
    }
    /// Waits until the server's warm pool has a VM ready: its snapshot
    /// template exists, so sandboxes are restored from it (and can be
    /// snapshotted, forked and paused).
    pub async fn template_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(300);
        loop {
            let (_, info) = self.get("/service").await;
            if info["fast_start"]["warm_pool"][0]["ready"].as_u64() >= Some(1) {
                return;
            }
            assert!(Instant::now() < deadline, "the warm pool did not fill");
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}

/// A running `sandpit node` (a cluster's VMs, no public API), in a network
/// namespace of its own or on the host.
pub struct Node {
    pub name: String,
    pub data: PathBuf,
    pub child: Child,
    /// Where the node API listens (its advertised address).
    pub address: String,
    /// Its standard error so far, a line each.
    pub log: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl Node {
    /// `sandpit node --name NAME --listen LISTEN --cluster-dir CERTS` on
    /// the database at `url`, in network namespace `ns` when given, with
    /// `extra` appended to the test config.
    pub fn start(
        ns: Option<&str>,
        data: &Path,
        url: &str,
        name: &str,
        listen: &str,
        certs: &Path,
        extra: &str,
    ) -> Node {
        let config = format!("{CONFIG}{extra}");
        std::fs::write(data.join("config.toml"), &config).unwrap();
        share_templates(data, &config);
        let direct = sandpit(data);
        let mut cmd = match ns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns])
                    .arg(direct.get_program())
                    .args(direct.get_args());
                c
            }
            None => direct,
        };
        let mut child = cmd
            .env("SANDPIT_DATABASE_URL", url)
            .args(["node", "--name", name, "--listen", listen, "--cluster-dir"])
            .arg(certs)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let log_writer = log.clone();
        let tag = name.to_string();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                eprintln!("[node {tag}] {line}");
                log_writer.lock().unwrap().push(line.clone());
                if let Some(rest) = line.split("serving its VMs at ").nth(1) {
                    let address = rest.split_whitespace().next().unwrap().to_string();
                    let _ = tx.send(address);
                }
            }
        });
        let address = rx
            .recv_timeout(Duration::from_secs(120))
            .unwrap_or_else(|_| panic!("sandpit node {name} did not start"));
        Node {
            name: name.to_string(),
            data: data.to_path_buf(),
            child,
            address,
            log,
        }
    }

    /// Wait (up to `bound`) for a line of its log that contains `needle`.
    pub fn wait_for_log(&self, needle: &str, bound: Duration) -> Option<String> {
        wait_for_line(&self.log, needle, bound)
    }

    /// Sends `signal` to the node's process.
    pub fn signal(&self, signal: i32) {
        // SAFETY: a plain signal to our child.
        unsafe {
            libc::kill(self.child.id() as i32, signal);
        }
    }

    pub fn sigkill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        std::mem::forget(self);
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.signal(libc::SIGCONT);
        self.signal(libc::SIGTERM);
        let _ = self.child.wait();
    }
}

/// Waits (up to `bound`) for a line of `log` that contains `needle`.
fn wait_for_line(
    log: &std::sync::Mutex<Vec<String>>,
    needle: &str,
    bound: Duration,
) -> Option<String> {
    let deadline = Instant::now() + bound;
    loop {
        if let Some(l) = log.lock().unwrap().iter().find(|l| l.contains(needle)) {
            return Some(l.clone());
        }
        if Instant::now() > deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
