//! Shared set-up of the end-to-end tests: real VMs (`sandpit-vmtest`, which
//! the runtime's own VM tests share), a browser, the `sandpit` binary,
//! network namespaces, servers.
#![allow(dead_code)]

pub mod browser;
pub mod cli;
pub mod netns;
pub mod serve;

pub use sandpit_vmtest::*;

/// The checkout's commit, as the build script records it (12 digits).
pub fn head_commit() -> String {
    let out = std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("git (apt-get install git): the tests run in the project's checkout");
    assert!(out.status.success(), "git rev-parse HEAD: {out:?}");
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}
