//! Records the commit this build came from as `SANDPIT_COMMIT`, so that
//! `sandpit --version` and `get_service_info` tell an operator exactly what
//! runs (two binaries of one version can differ by many commits on `main`).
//!
//! Here, in the binary's crate, and not in a library under it: every commit
//! changes it, and what changes rebuilds every crate above it. The binary
//! hands it to the service (`ServiceConfig::commit`).
//!
//! A build outside a Git checkout (a source tarball, a package build) takes
//! `SANDPIT_COMMIT` from its environment, or says `unknown`. Such a build
//! watches where the checkout's `.git` would be: cargo names a path
//! package's build-script run by its path inside the workspace, so a copy
//! of the tree without `.git` that shares a target directory with a
//! checkout would otherwise leave `unknown` there for the checkout's builds
//! (its output watching nothing but `SANDPIT_COMMIT`).

use std::path::Path;
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (!text.is_empty()).then_some(text)
}

fn main() {
    println!("cargo:rerun-if-env-changed=SANDPIT_COMMIT");
    let commit = std::env::var("SANDPIT_COMMIT")
        .ok()
        .filter(|c| !c.trim().is_empty())
        .or_else(|| git(&["rev-parse", "--short=12", "HEAD"]))
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=SANDPIT_COMMIT={commit}");
    if commit == "unknown" {
        // By its absolute path, outside this package (which cargo keeps as
        // it is, where it would keep one inside relative): while it is
        // missing, cargo runs this script again at every build (cheap), in
        // this tree and in any checkout that reuses this run's output.
        let manifest = std::env::var("CARGO_MANIFEST_DIR").unwrap_or_default();
        if let Some(workspace) = Path::new(&manifest).parent().and_then(Path::parent) {
            println!(
                "cargo:rerun-if-changed={}",
                workspace.join(".git").display()
            );
        }
        return;
    }
    // Build again when HEAD moves: HEAD itself (a checkout), the branch it
    // names (a commit) and the packed refs (a gc). A path that does not
    // exist would make Cargo run this every time: only those that do.
    let mut watched = vec!["HEAD".to_string(), "packed-refs".to_string()];
    if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
        watched.push(branch);
    }
    for name in watched {
        if let Some(path) = git(&["rev-parse", "--git-path", &name]) {
            if Path::new(&path).exists() {
                println!("cargo:rerun-if-changed={path}");
            }
        }
    }
}
