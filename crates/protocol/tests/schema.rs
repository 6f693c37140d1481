//! Freezes protocol generation 1: every message, serialised, must match
//! `generation-1.json` byte for byte (as JSON values). A change here breaks
//! guests built from older images; if it is intended, start generation 2.
//! To record a deliberate, compatible addition: `SANDPIT_BLESS=1 cargo test -p sandpit-protocol`.

use sandpit_protocol::*;
use std::collections::BTreeMap;

fn samples() -> Vec<Message> {
    let result = ExecResult {
        exit_code: Some(3),
        signal: None,
        timed_out: false,
        cancelled: false,
        stdout_bytes: 10,
        stderr_bytes: 0,
        stdout_truncated: false,
        stderr_truncated: false,
        duration_ms: 12,
        duration_us: None,
    };
    let mut env = BTreeMap::new();
    env.insert("A".to_string(), "b".to_string());
    vec![
        Message::Hello {
            protocol: 1,
            nonce: 42,
        },
        Message::Configure {
            id: 1,
            config: GuestConfig {
                hostname: "sbx-x".into(),
                machine_id: "0123456789abcdef0123456789abcdef".into(),
                time_unix_ms: 1_700_000_000_000,
                network: Some(NetworkConfig {
                    address: "10.0.2.15/24".into(),
                    gateway: "10.0.2.2".into(),
                    dns: vec!["10.0.2.3".into()],
                    deny: vec!["169.254.0.0/16".into()],
                    allow: vec![],
                    then_deny: vec![],
                    proxied_ports: vec![],
                    mtu: 65520,
                    proxy: None,
                }),
                user_pids_max: 4096,
                reserved_memory_mb: 96,
                ca_certificates: vec![],
            },
        },
        Message::Ping { id: 2 },
        Message::Exec {
            id: 3,
            request: ExecRequest {
                command: "echo hi".into(),
                cwd: Some("/tmp".into()),
                env,
                timeout_ms: 1000,
                max_output_bytes: 1 << 20,
                ..Default::default()
            },
        },
        Message::Cancel { id: 3 },
        Message::WriteFile {
            id: 4,
            path: "a".into(),
            size: 3,
            mode: Some(0o644),
        },
        Message::ReadFile {
            id: 5,
            path: "a".into(),
            max_bytes: 10,
            window: None,
        },
        Message::ListFiles {
            id: 6,
            path: "/workspace".into(),
            recursive: true,
            max_entries: 10,
        },
        Message::DeleteFile {
            id: 7,
            path: "a".into(),
            recursive: false,
        },
        Message::PowerOff { id: 8 },
        Message::HelloAck {
            protocol: 1,
            nonce: 42,
            agent_version: "0.1.0".into(),
            kernel_release: "6.1.0".into(),
            hostname: "sandpit".into(),
            features: Vec::new(),
        },
        Message::HelloAck {
            protocol: 1,
            nonce: 43,
            agent_version: "0.1.0".into(),
            kernel_release: "6.1.0".into(),
            hostname: "sandpit".into(),
            features: vec!["stats".into(), "clock".into(), "pty".into()],
        },
        Message::Started { id: 3, pid: 99 },
        Message::Stdout { id: 3 },
        Message::Stderr { id: 3 },
        Message::Exited { id: 3, result },
        Message::FileInfo {
            id: 5,
            path: "/workspace/a".into(),
            size: 3,
        },
        Message::FileData { id: 5 },
        Message::Done {
            id: 2,
            result: DoneResult::Pong,
        },
        Message::Done {
            id: 1,
            result: DoneResult::Configured,
        },
        Message::Done {
            id: 4,
            result: DoneResult::Written {
                path: "/workspace/a".into(),
                bytes: 3,
            },
        },
        Message::Done {
            id: 5,
            result: DoneResult::Read {
                path: "/workspace/a".into(),
                bytes: 3,
            },
        },
        Message::Done {
            id: 6,
            result: DoneResult::Listing {
                path: "/workspace".into(),
                entries: vec![FileEntry {
                    name: "a".into(),
                    kind: FileKind::File,
                    size_bytes: 3,
                }],
                truncated: false,
            },
        },
        Message::Done {
            id: 7,
            result: DoneResult::Deleted {
                path: "/workspace/a".into(),
            },
        },
        Message::Done {
            id: 3,
            result: DoneResult::Cancelled,
        },
        Message::Error {
            id: 5,
            error: AgentError::new(ErrorKind::NotFound, "no such file"),
        },
        // Added within generation 1: port tunnels.
        Message::TunnelOpen {
            id: 9,
            port: 8000,
            window: 1 << 20,
        },
        Message::TunnelOpened {
            id: 9,
            window: 1 << 20,
        },
        Message::TunnelData { id: 9 },
        Message::TunnelAck {
            id: 9,
            bytes: 65536,
        },
        Message::TunnelShutdown { id: 9 },
        Message::TunnelClose { id: 9 },
        Message::Error {
            id: 9,
            error: AgentError::new(ErrorKind::ConnectionRefused, "nothing listens on port 8000"),
        },
        Message::Error {
            id: 9,
            error: AgentError::new(ErrorKind::TimedOut, "connecting to port 8000 timed out"),
        },
        // Added within generation 1: the operator's extra CA certificates
        // and HTTP proxy, the sandbox's own allow list and the deny list
        // after it (all optional; the Configure above, without them, keeps
        // its wire form).
        Message::Configure {
            id: 10,
            config: GuestConfig {
                hostname: "sbx-y".into(),
                machine_id: "0123456789abcdef0123456789abcdef".into(),
                time_unix_ms: 1_700_000_000_000,
                network: Some(NetworkConfig {
                    address: "10.0.2.15/24".into(),
                    gateway: "10.0.2.2".into(),
                    dns: vec!["10.0.2.3".into()],
                    deny: vec!["10.0.0.0/8".into()],
                    allow: vec!["198.51.100.7/32".into()],
                    then_deny: vec!["0.0.0.0/0".into()],
                    proxied_ports: vec![80, 443],
                    mtu: 65520,
                    proxy: Some(ProxyConfig {
                        url: "http://10.1.2.3:3128".into(),
                        address: "10.1.2.3".into(),
                        port: 3128,
                        no_proxy: vec!["localhost".into(), ".corp.example".into()],
                    }),
                }),
                user_pids_max: 4096,
                reserved_memory_mb: 96,
                ca_certificates: vec![
                    "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n".into(),
                ],
            },
        },
        // Added to generation 1 (old agents never see them: a host only
        // talks to the agent of its own build).
        Message::ReadFile {
            id: 30,
            path: "a".into(),
            max_bytes: 10,
            window: Some(1 << 20),
        },
        Message::FileAck {
            id: 30,
            bytes: 262_144,
        },
        // Added to generation 1: terminals.
        Message::PtyOpen {
            id: 40,
            rows: 24,
            cols: 80,
            window: 1 << 20,
        },
        Message::PtyResize {
            id: 40,
            rows: 50,
            cols: 132,
        },
        Message::PtyExited {
            id: 40,
            exit_code: Some(0),
            signal: None,
        },
        Message::PtyExited {
            id: 41,
            exit_code: None,
            signal: Some(9),
        },
        // Added to generation 1: calls on paths (E2B's filesystem API).
        Message::PathCall {
            id: 50,
            call: PathCall::Stat { path: "a".into() },
        },
        Message::PathCall {
            id: 51,
            call: PathCall::MakeDir {
                path: "/tmp/x/y".into(),
            },
        },
        Message::PathCall {
            id: 52,
            call: PathCall::Move {
                from: "a".into(),
                to: "b".into(),
            },
        },
        Message::Done {
            id: 50,
            result: DoneResult::PathInfo {
                entry: PathEntry {
                    name: "link".into(),
                    path: "/workspace/link".into(),
                    kind: FileKind::Symlink,
                    size_bytes: 0,
                    mode: 0o777,
                    owner: "user".into(),
                    group: "user".into(),
                    modified_unix_ms: 1_700_000_000_123,
                    symlink_target: Some("/etc/hostname".into()),
                },
            },
        },
        Message::Error {
            id: 51,
            error: AgentError::new(ErrorKind::AlreadyExists, "/tmp/x/y exists"),
        },
        // Added to generation 1: commands that outlive their request (E2B's
        // process API).
        Message::Exec {
            id: 60,
            request: ExecRequest {
                command: "python3 -m http.server".into(),
                cwd: None,
                env: BTreeMap::new(),
                timeout_ms: 60_000,
                max_output_bytes: 1024,
                keep_running: true,
                stdin: true,
                pty: None,
                as_root: false,
            },
        },
        Message::Started { id: 60, pid: 812 },
        Message::ProcessAttach { id: 61, pid: 812 },
        Message::ProcessList { id: 62 },
        Message::Done {
            id: 62,
            result: DoneResult::Processes {
                processes: vec![ProcessInfo {
                    pid: 812,
                    command: "python3 -m http.server".into(),
                    cwd: "/home/user".into(),
                    env: BTreeMap::from([("A".into(), "b".into())]),
                    keep_running: true,
                    stdin: true,
                    pty: false,
                }],
            },
        },
        Message::ProcessCall {
            id: 63,
            pid: 812,
            call: ProcessCall::Input,
        },
        Message::ProcessCall {
            id: 64,
            pid: 812,
            call: ProcessCall::CloseStdin,
        },
        Message::ProcessCall {
            id: 65,
            pid: 812,
            call: ProcessCall::Signal { signal: 15 },
        },
        Message::Done {
            id: 65,
            result: DoneResult::ProcessCalled { pid: 812 },
        },
        Message::Stats { id: 66 },
        Message::Done {
            id: 66,
            result: DoneResult::Stats {
                stats: GuestStats {
                    cpu_count: 2,
                    cpu_busy_ticks: 1_234,
                    cpu_total_ticks: 56_789,
                    mem_total_bytes: 1_028_620_288,
                    mem_available_bytes: 812_000_000,
                    mem_cache_bytes: 150_000_000,
                    disk_total_bytes: 4_160_000_000,
                    disk_used_bytes: 1_900_000_000,
                },
            },
        },
        // Added to generation 1: a command on a terminal (E2B's pty).
        Message::Exec {
            id: 68,
            request: ExecRequest {
                command: "/bin/bash -i -l".into(),
                cwd: None,
                env: BTreeMap::new(),
                timeout_ms: 0,
                max_output_bytes: 1 << 20,
                keep_running: true,
                stdin: true,
                pty: Some(TerminalSize { rows: 24, cols: 80 }),
                as_root: false,
            },
        },
        Message::ProcessCall {
            id: 69,
            pid: 813,
            call: ProcessCall::Resize {
                rows: 50,
                cols: 132,
            },
        },
        Message::Done {
            id: 70,
            result: DoneResult::Processes {
                processes: vec![ProcessInfo {
                    pid: 813,
                    command: "/bin/bash -i -l".into(),
                    cwd: "/home/user".into(),
                    env: BTreeMap::new(),
                    keep_running: true,
                    stdin: true,
                    pty: true,
                }],
            },
        },
        Message::Clock {
            id: 67,
            step_ns: -1_026_000_000,
        },
        Message::Done {
            id: 67,
            result: DoneResult::Clock {
                unix_ns: 1_796_539_623_702_000_000,
            },
        },
        Message::WatchDir {
            id: 71,
            path: "project".into(),
            recursive: true,
        },
        Message::Watching {
            id: 71,
            path: "/home/user/project".into(),
        },
        Message::WatchEvents {
            id: 71,
            events: vec![
                WatchEvent {
                    name: "src/main.rs".into(),
                    kind: WatchEventKind::Create,
                },
                WatchEvent {
                    name: "src/main.rs".into(),
                    kind: WatchEventKind::Write,
                },
                WatchEvent {
                    name: "old.txt".into(),
                    kind: WatchEventKind::Rename,
                },
                WatchEvent {
                    name: "gone".into(),
                    kind: WatchEventKind::Remove,
                },
                WatchEvent {
                    name: "run.sh".into(),
                    kind: WatchEventKind::Chmod,
                },
            ],
        },
        // Added to generation 1: a template's build step, run as root.
        Message::Exec {
            id: 72,
            request: ExecRequest {
                command: "apt-get install -y cowsay".into(),
                cwd: Some("/".into()),
                env: BTreeMap::from([("DEBIAN_FRONTEND".into(), "noninteractive".into())]),
                timeout_ms: 600_000,
                max_output_bytes: 1 << 20,
                as_root: true,
                ..Default::default()
            },
        },
        // Added to generation 1: volumes (feature `volumes`).
        Message::MountVolume {
            id: 73,
            serial: "sandpit-vol0".into(),
            path: "/data".into(),
            read_only: false,
        },
        Message::Done {
            id: 73,
            result: DoneResult::Mounted {
                path: "/data".into(),
                device: "/dev/vdb".into(),
            },
        },
        Message::SyncVolume {
            id: 74,
            path: "/data".into(),
            unmount: true,
        },
        Message::Done {
            id: 74,
            result: DoneResult::Synced {
                path: "/data".into(),
                unmounted: true,
            },
        },
    ]
}

/// Fails to compile when a message is added without a sample above.
#[allow(dead_code)]
fn exhaustive(m: &Message) -> &'static str {
    match m {
        Message::Hello { .. } => "hello",
        Message::Configure { .. } => "configure",
        Message::Ping { .. } => "ping",
        Message::Exec { .. } => "exec",
        Message::Cancel { .. } => "cancel",
        Message::WriteFile { .. } => "write_file",
        Message::ReadFile { .. } => "read_file",
        Message::FileAck { .. } => "file_ack",
        Message::ListFiles { .. } => "list_files",
        Message::DeleteFile { .. } => "delete_file",
        Message::PathCall { .. } => "path_call",
        Message::ProcessAttach { .. } => "process_attach",
        Message::ProcessList { .. } => "process_list",
        Message::Stats { .. } => "stats",
        Message::Clock { .. } => "clock",
        Message::ProcessCall { .. } => "process_call",
        Message::MountVolume { .. } => "mount_volume",
        Message::SyncVolume { .. } => "sync_volume",
        Message::PowerOff { .. } => "power_off",
        Message::HelloAck { .. } => "hello_ack",
        Message::Started { .. } => "started",
        Message::Stdout { .. } => "stdout",
        Message::Stderr { .. } => "stderr",
        Message::Exited { .. } => "exited",
        Message::FileInfo { .. } => "file_info",
        Message::FileData { .. } => "file_data",
        Message::Done { .. } => "done",
        Message::Error { .. } => "error",
        Message::TunnelOpen { .. } => "tunnel_open",
        Message::TunnelOpened { .. } => "tunnel_opened",
        Message::TunnelData { .. } => "tunnel_data",
        Message::TunnelAck { .. } => "tunnel_ack",
        Message::TunnelShutdown { .. } => "tunnel_shutdown",
        Message::TunnelClose { .. } => "tunnel_close",
        Message::PtyOpen { .. } => "pty_open",
        Message::PtyResize { .. } => "pty_resize",
        Message::PtyExited { .. } => "pty_exited",
        Message::WatchDir { .. } => "watch_dir",
        Message::Watching { .. } => "watching",
        Message::WatchEvents { .. } => "watch_events",
    }
}

#[test]
fn generation_1_is_frozen() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/generation-1.json");
    let actual: Vec<serde_json::Value> = samples()
        .iter()
        .map(|m| serde_json::to_value(m).unwrap())
        .collect();
    if std::env::var_os("SANDPIT_BLESS").is_some() {
        std::fs::write(path, serde_json::to_string_pretty(&actual).unwrap() + "\n").unwrap();
    }
    let frozen: Vec<serde_json::Value> = serde_json::from_str(
        &std::fs::read_to_string(path).expect("tests/generation-1.json is committed"),
    )
    .unwrap();
    assert_eq!(actual.len(), frozen.len(), "messages were added or removed");
    for (a, f) in actual.iter().zip(&frozen) {
        assert_eq!(a, f, "the wire form of a generation-1 message changed");
    }
    // And every frozen form still parses into the same message.
    for (m, f) in samples().iter().zip(&frozen) {
        let back: Message = serde_json::from_value(f.clone()).unwrap();
        assert_eq!(&back, m);
    }
    assert_eq!(PROTOCOL_GENERATION, 1);
}
