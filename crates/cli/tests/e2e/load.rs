//! `sandpit bench load` against a real `sandpit serve`: 200 concurrent MCP
//! clients over Streamable HTTP (rmcp's client, a session each), four
//! accounts, eight shared sandboxes, for 15 s. The target is no error at
//! all, and every client must have done each operation at least once (a
//! client starved by the others is a failure too). Latencies are printed,
//! never asserted (the machine is shared and noisy).

use crate::common::serve::*;
use crate::common::*;

#[test]
fn two_hundred_mcp_clients_get_no_error() {
    let data = data_dir();
    // No warm pool: the eight sandboxes are made on demand and the host's
    // cores go to the load, not to refills.
    let server = Server::start_with(&data, "[pool]\nsizes = {}\n");
    let keys: Vec<String> = (0..4)
        .map(|i| server.new_account(&format!("load{i}"), 100.0))
        .collect();
    let secs = std::env::var("SANDPIT_LOAD_SECS").unwrap_or_else(|_| "15".into());
    let out = sandpit(&data)
        .args(["bench", "load", "--url", &server.url])
        .args(["--key", &keys.join(",")])
        .args(["--clients", "200", "--sandboxes", "8"])
        .args(["--duration", &format!("{secs}s")])
        .stderr(std::process::Stdio::inherit())
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&out.stdout);
    println!("{table}");
    assert!(
        out.status.success(),
        "the load bench failed ({}):\n{table}",
        out.status
    );
    assert!(table.contains("\nerrors: 0\n"), "{table}");
    for op in ["initialize", "tools/list", "get_usage", "run_command"] {
        assert!(
            table.contains(&format!("{op} 200/200")),
            "not every client completed {op}:\n{table}"
        );
    }
    // The bench destroyed its sandboxes.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !vm_dirs(&data).is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "VMs left after the bench: {:?}",
            vm_dirs(&data)
        );
        std::thread::sleep(std::time::Duration::from_millis(250));
    }
}
