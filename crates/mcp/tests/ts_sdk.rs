//! The server as most agents meet it: through the official TypeScript SDK
//! (`@modelcontextprotocol/sdk`, pinned in `tests/ts-sdk/package-lock.json`),
//! whose client compiles every tool's `outputSchema` with Ajv and validates
//! each `structuredContent` against it. Ajv prints a warning for every part
//! of a schema it does not understand (`unknown format "uint32" ignored in
//! schema ...`), dozens per session; a client's user sees them, so this test
//! fails on any output the SDK writes besides the script's result line.
//!
//! It needs Node.js and npm (`scripts/install-deps.sh` installs them) and the
//! npm registry for `npm ci` (or npm's cache). It is not skipped when they
//! are missing: it fails and says what to install.

mod common;

use common::*;
use serde_json::Value;
use std::{path::Path, process::Output, time::Duration};
use tokio::process::Command;

const PROJECT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/ts-sdk");

/// Run a command in the Node project; `None` when the program is not installed.
async fn run(program: &str, args: &[&str], limit: Duration) -> Option<Output> {
    let child = Command::new(program)
        .args(args)
        .current_dir(PROJECT)
        .kill_on_drop(true)
        .output();
    match tokio::time::timeout(limit, child).await {
        Ok(Ok(output)) => Some(output),
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::NotFound => None,
        Ok(Err(e)) => panic!("{program} {args:?}: {e}"),
        Err(_) => panic!("{program} {args:?} did not finish within {limit:?}"),
    }
}

fn describe(output: &Output) -> String {
    format!(
        "{}\n--- stdout\n{}\n--- stderr\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_typescript_sdk_lists_and_calls_every_tool_without_warnings() {
    for program in ["node", "npm"] {
        if run(program, &["--version"], Duration::from_secs(30))
            .await
            .is_none()
        {
            panic!(
                "`{program}` is not installed: install nodejs and npm (scripts/install-deps.sh \
                 does) to run the TypeScript SDK test"
            );
        }
    }
    assert!(Path::new(PROJECT).join("package-lock.json").is_file());
    let install = run(
        "npm",
        &["ci", "--no-audit", "--no-fund", "--prefer-offline"],
        Duration::from_secs(300),
    )
    .await
    .expect("npm");
    assert!(
        install.status.success(),
        "npm ci in {PROJECT} failed (it needs the npm registry or npm's cache):\n{}",
        describe(&install)
    );

    let s = server().await;
    let check = run(
        "node",
        &["--no-warnings", "check.mjs", &s.url, KEY],
        Duration::from_secs(60),
    )
    .await
    .expect("node");
    let report = describe(&check);
    assert!(check.status.success(), "check.mjs failed: {report}");
    assert!(
        check.stderr.is_empty(),
        "the SDK wrote to stderr (an Ajv warning is what a user would see): {report}"
    );
    let stdout = String::from_utf8_lossy(&check.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 1, "only the result line is printed: {report}");
    let result: Value = serde_json::from_str(lines[0]).expect("the result line is JSON");
    let mut listed: Vec<&str> = result["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    listed.sort();
    let mut called: Vec<&str> = result["called"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    called.sort();
    let mut expected = TOOLS.to_vec();
    expected.sort();
    assert_eq!(listed, expected, "tools/list");
    assert_eq!(called, expected, "every tool was called: {report}");
    assert_eq!(result["protocolVersion"], "2025-11-25", "{report}");
    assert!(
        s.api.call_names().contains(&"destroy_sandbox"),
        "{:?}",
        s.api.call_names()
    );
}
