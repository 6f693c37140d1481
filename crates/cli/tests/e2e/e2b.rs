//! E2B's official SDKs, unchanged, against a real server: the Python SDK
//! (pinned in `crates/e2b/sdk-tests/requirements.txt`, installed by
//! `scripts/e2b-sdks.sh`) runs `crates/e2b/sdk-tests/*.py`, sync and async,
//! with nothing but E2B's three variables pointing at the server (one
//! server for both).

use crate::common::serve::Server;
use crate::common::*;
use std::path::PathBuf;
use std::process::Command;

/// The SDKs' Python (`SANDPIT_E2B_PYTHON`, which the test command sets).
fn sdk_python() -> PathBuf {
    let python = std::env::var_os("SANDPIT_E2B_PYTHON").map(PathBuf::from);
    match python {
        Some(p) if p.is_file() => p,
        _ => panic!(
            "E2B's Python SDK is missing: run scripts/e2b-sdks.sh and set SANDPIT_E2B_PYTHON \
             to the python it prints (the README's test command does both)"
        ),
    }
}

fn script(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../e2b/sdk-tests")
        .join(name)
}

/// Run an SDK script against `server` with `key`; returns its `ok` lines.
fn run_sdk(python: &PathBuf, name: &str, server: &Server, key: &str, revoked: &str) -> Vec<String> {
    let e2b_key = sandpit_store::e2b_spelling(key).expect("a Sandpit key");
    let out = Command::new(python)
        .arg(script(name))
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("E2B_API_URL", format!("{}/e2b", server.url))
        .env("E2B_SANDBOX_URL", &server.url)
        .env("E2B_API_KEY", &e2b_key)
        .env("SANDPIT_REVOKED_KEY", revoked)
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

#[test]
fn the_python_sdk_drives_sandboxes_unchanged() {
    let python = sdk_python();
    let data = data_dir();
    let server = Server::start(&data);
    let key = server.new_account("e2b-user", 20.0);
    let revoked = server.admin(&["key", "create", "--account", "e2b-user"]);
    server.admin(&["key", "revoke", &revoked[..12]]);
    let done = run_sdk(&python, "python_sync.py", &server, &key, &revoked);
    for check in [
        "create",
        "commands.run",
        "on_stdout as it comes",
        "CommandExitException",
        "cwd, envs, the create's envs, the default user",
        "timeout",
        "another user is refused, saying why",
        "background, list, connect from a second client",
        "send_stdin, close_stdin; a command without stdin refuses input",
        "get_host: a background http.server reached",
        "files.write and files.read",
        "files.exists, get_info, make_dir, list with depth, rename, remove",
        "is_running, get_info",
        "list, filtered by metadata",
        "set_timeout, longer then shorter",
        "connect",
        "create_snapshot, list_snapshots, create from a snapshot, fork, delete_snapshot",
        "pause, then connect resumes it",
        "kill; a killed sandbox is not found",
        "a wrong or revoked key is refused",
    ] {
        assert!(
            done.iter().any(|d| d.starts_with(check)),
            "the script did not check {check:?}: {done:?}"
        );
    }
    let done = run_sdk(&python, "python_async.py", &server, &key, &revoked);
    for check in [
        "create",
        "commands.run, output as it comes",
        "two commands at once",
        "background with callbacks, send_stdin, list, kill",
        "CommandExitException",
        "files",
        "get_info, is_running",
        "kill",
    ] {
        assert!(
            done.iter().any(|d| d.starts_with(check)),
            "the async script did not check {check:?}: {done:?}"
        );
    }
}
