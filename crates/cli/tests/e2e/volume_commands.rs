//! `sandpit volume create|ls|resize|rm`: run as a person runs them (a
//! process each) against the REST API served over the in-memory fake
//! (`sandpit-fake`). What the service does with a volume (its file, its
//! quota, its holds) is proven in `crates/core/tests/volumes.rs`; this
//! proves the commands ask the server for the right thing and print what
//! it answers.

use sandpit_fake::{Fake, KEY_A};
use serde_json::Value;
use std::process::Output;

/// A REST server over the fake, in a runtime of its own (the commands
/// run as processes beside it).
fn serve() -> (String, tokio::runtime::Runtime) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let app = sandpit_api::router(Fake::new(), Default::default());
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    rt.spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}"), rt)
}

/// `sandpit volume ARGS` against `url` with account A's key.
fn volume(url: &str, args: &[&str]) -> Output {
    let data = tempfile::tempdir().unwrap();
    std::process::Command::new(env!("CARGO_BIN_EXE_sandpit"))
        .arg("--data-dir")
        .arg(data.path())
        .arg("volume")
        .args(args)
        .env("SANDPIT_URL", url)
        .env("SANDPIT_API_KEY", KEY_A)
        .env_remove("SANDPIT_CONFIG")
        .env_remove("SANDPIT_DATABASE_URL")
        .output()
        .unwrap()
}

fn ok(url: &str, args: &[&str]) -> String {
    let out = volume(url, args);
    assert!(
        out.status.success(),
        "sandpit volume {args:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn volumes_are_created_listed_grown_and_removed_from_the_command_line() {
    let (url, _rt) = serve();
    let made: Value =
        serde_json::from_str(&ok(&url, &["create", "data", "--size-gb", "3", "--json"])).unwrap();
    assert_eq!(made["object"], "volume");
    assert_eq!(made["size_gb"], 3);
    let id = made["id"].as_str().unwrap();
    let line = ok(&url, &["create", "cache"]);
    assert!(line.starts_with("cache\tvol_"), "{line}");
    assert!(line.contains("\t10 GiB\tready\t-"), "{line}");

    let listed = ok(&url, &["ls"]);
    let names: Vec<&str> = listed
        .lines()
        .map(|l| l.split('\t').next().unwrap())
        .collect();
    assert_eq!(names, ["cache", "data"], "{listed}");
    let grown = ok(&url, &["resize", id, "--size-gb", "5"]);
    assert!(grown.contains("\t5 GiB\t"), "{grown}");

    // A refusal is the server's, said on stderr, with a failing status.
    let out = volume(&url, &["resize", "data", "--size-gb", "4"]);
    assert!(!out.status.success());
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(said.contains("only grows"), "{said}");
    let out = volume(&url, &["create", "bad name"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("letters, digits"));

    assert_eq!(ok(&url, &["rm", "data", "cache"]), "data\ncache\n");
    assert_eq!(ok(&url, &["ls"]), "");
    let out = volume(&url, &["rm", "data"]);
    assert!(!out.status.success());
}
