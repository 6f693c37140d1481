//! The `sandpit` command line as a person uses it: each step is a separate
//! process, so state must survive between invocations.

use crate::common::cli::Cli;
use crate::common::*;
use std::path::Path;
use std::time::{Duration, Instant};

#[test]
fn create_exec_cp_ls_rm_across_invocations() {
    let cli = Cli::new();
    let out = cli.run(&["sandbox", "create", "--size", "small", "--timeout", "15m"]);
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "create failed: {said}");
    // Restored from the size's template, not booted cold after a warning
    // (a relative --data-dir once made every restore fall back).
    assert!(!said.contains("WARN"), "create warned: {said}");
    let id = String::from_utf8(out.stdout).unwrap().trim().to_string();
    assert!(
        id.starts_with("sbx_") && id.len() == 28,
        "stdout is the id alone: {id:?}"
    );

    let out = cli.run(&[
        "sandbox",
        "exec",
        &id,
        "--",
        "echo hi; echo oops >&2; exit 3",
    ]);
    assert_eq!(out.status.code(), Some(3));
    assert_eq!(out.stdout, b"hi\n");
    assert!(String::from_utf8_lossy(&out.stderr).contains("oops"));

    // Several arguments are quoted, not re-split.
    let out = cli.ok(&[
        "sandbox", "exec", &id, "-e", "X=a b", "--", "printf", "%s|", "one two", "$X",
    ]);
    assert_eq!(out, "one two|$X|");
    let out = cli.ok(&[
        "sandbox",
        "exec",
        &id,
        "-e",
        "X=a b",
        "--cwd",
        "/tmp",
        "--",
        "echo \"$X\" $PWD",
    ]);
    assert_eq!(out, "a b /tmp\n");

    let local = cli.data.join("local.bin");
    let bytes: Vec<u8> = (0..=255u8).cycle().take(100_000).collect();
    std::fs::write(&local, &bytes).unwrap();
    cli.ok(&[
        "sandbox",
        "cp",
        local.to_str().unwrap(),
        &format!("{id}:in/copy.bin"),
    ]);
    assert_eq!(
        cli.ok(&[
            "sandbox",
            "exec",
            &id,
            "--",
            "stat -c %s /workspace/in/copy.bin"
        ]),
        "100000\n"
    );
    let back = cli.data.join("back.bin");
    cli.ok(&[
        "sandbox",
        "cp",
        &format!("{id}:/workspace/in/copy.bin"),
        back.to_str().unwrap(),
    ]);
    assert_eq!(std::fs::read(&back).unwrap(), bytes);

    let ls = cli.ok(&["sandbox", "ls"]);
    assert!(
        ls.lines()
            .any(|l| l.starts_with(&id) && l.contains("running")),
        "{ls}"
    );
    let json: serde_json::Value =
        serde_json::from_str(&cli.ok(&["sandbox", "ls", "--json"])).unwrap();
    assert_eq!(json[0]["id"], id.as_str());
    assert_eq!(json[0]["status"], "running");
    assert_eq!(json[0]["resources"]["memory_mb"], 1024);

    let out = cli.run(&[
        "sandbox",
        "exec",
        &id,
        "--timeout-ms",
        "1000",
        "--",
        "sleep 30",
    ]);
    assert_eq!(
        out.status.code(),
        Some(124),
        "a timeout exits 124 like timeout(1)"
    );

    cli.ok(&["sandbox", "rm", &id]);
    assert!(!cli.ok(&["sandbox", "ls"]).contains(&id));
    let out = cli.run(&["sandbox", "exec", &id, "--", "true"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains(&id));
    let out = cli.run(&["sandbox", "rm", &id]);
    assert_eq!(out.status.code(), Some(1));
    assert!(no_vm_files(&cli.data));
}

fn no_vm_files(data: &Path) -> bool {
    std::fs::read_dir(data.join("vms"))
        .map(|d| d.count() == 0)
        .unwrap_or(true)
}

#[test]
fn the_version_names_the_commit_it_was_built_from() {
    let cli = Cli::new();
    let version = cli.ok(&["--version"]);
    let commit = head_commit();
    assert_eq!(
        version.trim(),
        format!("sandpit {} (commit {commit})", env!("CARGO_PKG_VERSION"))
    );
}

#[test]
fn create_json_prints_the_whole_object() {
    let cli = Cli::new();
    let out = cli.ok(&[
        "sandbox",
        "create",
        "--json",
        "--name",
        "demo",
        "--timeout",
        "20m",
    ]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let id = v["id"].as_str().unwrap().to_string();
    assert_eq!(v["object"], "sandbox");
    assert_eq!(v["status"], "running");
    assert_eq!(v["name"], "demo");
    assert_eq!(v["size"], "small");
    assert_eq!(v["timeout_minutes"], 20);
    assert!(v["expires_at"].as_str().unwrap().ends_with('Z'));
    cli.ok(&["sandbox", "rm", &id]);
}

#[test]
fn bad_input_is_a_clear_error() {
    let cli = Cli::new();
    let out = cli.run(&["sandbox", "create", "--size", "huge"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown size"));
    let out = cli.run(&["sandbox", "create", "--timeout", "25h"]);
    assert!(!out.status.success());
    let out = cli.run(&["sandbox", "exec", "sbx_nonexistent", "--", "true"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("sbx_nonexistent"));
    let out = cli.run(&["sandbox", "exec", "../../etc", "--", "true"]);
    assert!(!out.status.success());
    assert!(no_vm_files(&cli.data));
}

#[test]
fn a_sandbox_is_destroyed_when_it_expires_with_nobody_asking() {
    let cli = Cli::new();
    // The first create makes the size's snapshot template inside its own
    // lifetime (most of a minute on a busy host): a sandbox of the default
    // lifetime makes it, so the one-minute sandbox is a restore.
    let first = cli.ok(&["sandbox", "create"]).trim().to_string();
    cli.ok(&["sandbox", "rm", &first]);
    let id = cli
        .ok(&["sandbox", "create", "--timeout", "1m"])
        .trim()
        .to_string();
    let deadline = Instant::now() + Duration::from_secs(150);
    while cli.ok(&["sandbox", "ls"]).contains(&id) {
        assert!(Instant::now() < deadline, "{id} outlived its timeout");
        std::thread::sleep(Duration::from_secs(2));
    }
    assert!(no_vm_files(&cli.data));
    assert!(pids_mentioning(&format!("sandpit-vm-{id}")).is_empty());
}
