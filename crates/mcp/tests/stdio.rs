//! The server over an in-process byte pipe, exactly as `serve_stdio` runs it
//! (newline-delimited JSON-RPC), driven by a real rmcp client.

mod common;

use common::*;
use rmcp::{
    model::{CallToolRequestParams, ProtocolVersion},
    ClientLifecycleMode, ClientServiceExt, ServiceExt,
};
use sandpit_core::prelude::*;
use sandpit_core::{Caller, CoreError, ErrorType, SandboxApi};
use sandpit_fake::Op;
use serde_json::{json, Value};
use std::sync::Arc;

/// Start the server on one end of a duplex pipe; return the other end.
fn start(api: Arc<Fake>) -> tokio::io::DuplexStream {
    let (server_end, client_end) = tokio::io::duplex(1 << 20);
    let caller = Caller::new(ACCOUNT, "test");
    let api: Arc<dyn SandboxApi> = api;
    tokio::spawn(async move {
        let (r, w) = tokio::io::split(server_end);
        sandpit_mcp::serve_io(api, caller, r, w).await
    });
    client_end
}

async fn client(api: Arc<Fake>, version: ProtocolVersion) -> Client {
    TestClient::new(version)
        .serve(start(api))
        .await
        .expect("initialize")
}

#[tokio::test]
async fn tools_list_has_every_tool_with_schemas_and_annotations() {
    let c = client(fake(), ProtocolVersion::V_2025_11_25).await;
    let tools = c.list_all_tools().await.unwrap();
    let mut names: Vec<&str> = tools.iter().map(|t| t.name.as_ref()).collect();
    names.sort();
    let mut expected = TOOLS.to_vec();
    expected.sort();
    assert_eq!(names, expected);

    for t in &tools {
        assert_eq!(t.input_schema["type"], "object", "{}", t.name);
        let out = t.output_schema.as_ref().expect("outputSchema");
        assert_eq!(out["type"], "object", "{}", t.name);
        assert!(t.description.as_ref().is_some_and(|d| d.len() > 40));
        let a = t.annotations.as_ref().expect("annotations");
        assert!(a.title.is_some());
        for hint in [
            a.read_only_hint,
            a.destructive_hint,
            a.idempotent_hint,
            a.open_world_hint,
        ] {
            assert!(hint.is_some(), "{}: every hint is stated", t.name);
        }
    }
    let get = |n: &str| tools.iter().find(|t| t.name == n).unwrap();
    let hints = |n: &str| {
        let a = get(n).annotations.clone().unwrap();
        (
            a.read_only_hint.unwrap(),
            a.destructive_hint.unwrap(),
            a.idempotent_hint.unwrap(),
            a.open_world_hint.unwrap(),
        )
    };
    for ro in [
        "get_sandbox",
        "list_sandboxes",
        "get_usage",
        "get_service_info",
        "read_file",
        "list_files",
        "list_snapshots",
        "list_templates",
        "list_volumes",
    ] {
        assert!(hints(ro).0, "{ro} is read-only");
        assert!(!hints(ro).1, "{ro} is not destructive");
    }
    assert_eq!(hints("destroy_sandbox"), (false, true, true, false));
    assert_eq!(hints("run_command"), (false, true, false, true));
    assert_eq!(hints("create_sandbox"), (false, false, false, false));
    assert!(!hints("extend_sandbox").2, "extending twice adds twice");
    assert!(hints("expose_port").3, "a public URL is open world");
    assert_eq!(hints("snapshot_sandbox"), (false, false, false, false));
    assert_eq!(hints("fork_sandbox"), (false, false, false, false));
    assert_eq!(hints("restore_sandbox"), (false, true, true, false));
    assert_eq!(hints("delete_snapshot"), (false, true, true, false));
    assert_eq!(hints("pause_sandbox"), (false, false, true, false));
    assert_eq!(hints("resume_sandbox"), (false, false, true, false));
    assert_eq!(hints("create_volume"), (false, false, false, false));
    assert_eq!(hints("delete_volume"), (false, true, false, false));

    // Input schemas name the spec's fields, with the right ones required.
    let run = &get("run_command").input_schema;
    for f in ["sandbox_id", "command", "timeout_ms", "cwd", "env"] {
        assert!(run["properties"].get(f).is_some(), "run_command.{f}");
    }
    assert_eq!(run["required"], json!(["sandbox_id", "command"]));
    assert_eq!(run["properties"]["timeout_ms"]["maximum"], 600000);
    let create = &get("create_sandbox").input_schema;
    assert!(create.get("required").is_none_or(|r| r == &json!([])));
    assert!(create["properties"].get("snapshot_id").is_some());
    assert!(create["properties"].get("template").is_some());
    for (tool, required) in [
        ("snapshot_sandbox", json!(["sandbox_id"])),
        ("fork_sandbox", json!(["sandbox_id"])),
        ("restore_sandbox", json!(["sandbox_id", "snapshot_id"])),
        ("delete_snapshot", json!(["snapshot_id"])),
        ("create_volume", json!(["name"])),
        ("delete_volume", json!(["volume"])),
    ] {
        assert_eq!(get(tool).input_schema["required"], required, "{tool}");
    }
    assert!(get("list_snapshots")
        .input_schema
        .get("required")
        .is_none_or(|r| r == &json!([])));
    // The descriptions say when to reach for them.
    let says = |tool: &str, words: &[&str]| {
        let d = get(tool).description.as_ref().unwrap().to_string();
        for w in words {
            assert!(d.contains(w), "{tool}'s description mentions {w:?}: {d}");
        }
    };
    says("snapshot_sandbox", &["risky change", "restore_sandbox"]);
    says(
        "create_volume",
        &["outlives", "create_sandbox", "kept when the sandbox ends"],
    );
    let volumes = &create["properties"]["volumes"];
    assert!(volumes.is_object(), "create_sandbox.volumes: {create:?}");
    says("fork_sandbox", &["parallel", "count"]);
    says("restore_sandbox", &["undo", "lost"]);
    says("pause_sandbox", &["resumes it", "expires_at"]);
    says("create_sandbox", &["snapshot_id", "prepared environment"]);
    let enc = &get("write_file").input_schema["properties"]["encoding"];
    assert!(enc.to_string().contains("base64"), "{enc}");
    assert!(get("run_command")
        .description
        .as_ref()
        .unwrap()
        .contains('&'));
    assert!(get("create_sandbox")
        .description
        .as_ref()
        .unwrap()
        .contains("sudo"));

    // The notes for agents are in the instructions.
    let info = c.peer_info().unwrap();
    let instructions = info.instructions.as_ref().unwrap();
    for note in [
        "uid 1000",
        "no sudo",
        "--break-system-packages",
        "&",
        "expose_port",
        "time out",
    ] {
        assert!(instructions.contains(note), "instructions mention {note:?}");
    }
    c.cancel().await.unwrap();
}

/// The `format` values JSON Schema 2020-12 defines (Validation, section 7.3).
const STANDARD_FORMATS: [&str; 19] = [
    "date-time",
    "date",
    "time",
    "duration",
    "email",
    "idn-email",
    "hostname",
    "idn-hostname",
    "ipv4",
    "ipv6",
    "uri",
    "uri-reference",
    "iri",
    "iri-reference",
    "uuid",
    "uri-template",
    "json-pointer",
    "relative-json-pointer",
    "regex",
];

/// The one signed integer the tools carry (a process's exit code); every
/// other integer is a Rust unsigned type.
const SIGNED_INTEGERS: [&str; 1] = ["exit_code"];

/// Every subschema of `schema` with its JSON path, following only the
/// keywords that hold schemas (so `default`, `enum` or a property that
/// happens to be called `format` are not mistaken for schemas).
fn subschemas<'a>(path: String, schema: &'a Value, out: &mut Vec<(String, &'a Value)>) {
    let Some(o) = schema.as_object() else {
        return;
    };
    out.push((path.clone(), schema));
    for (key, value) in o {
        let at = format!("{path}/{key}");
        match key.as_str() {
            "properties" | "patternProperties" | "$defs" | "definitions" | "dependentSchemas" => {
                for (name, s) in value.as_object().into_iter().flatten() {
                    subschemas(format!("{at}/{name}"), s, out);
                }
            }
            "items" | "prefixItems" | "allOf" | "anyOf" | "oneOf" => match value.as_array() {
                Some(list) => {
                    for (i, s) in list.iter().enumerate() {
                        subschemas(format!("{at}/{i}"), s, out);
                    }
                }
                None => subschemas(at, value, out),
            },
            "additionalProperties"
            | "unevaluatedProperties"
            | "unevaluatedItems"
            | "not"
            | "if"
            | "then"
            | "else"
            | "contains"
            | "propertyNames" => subschemas(at, value, out),
            _ => {}
        }
    }
}

fn is_integer(schema: &Value) -> bool {
    match &schema["type"] {
        Value::String(t) => t == "integer",
        Value::Array(ts) => ts.iter().any(|t| t == "integer"),
        _ => false,
    }
}

/// Strict validators (Ajv in the official TypeScript SDK) warn about every
/// `format` they do not know, and schemars writes Rust's number types as
/// formats of its own (`uint32`, `uint64`, `double`...). Every schema
/// A service configured with other limits advertises them: the schemas say
/// what will be enforced, not the defaults.
#[tokio::test]
async fn tool_schemas_carry_the_configured_limits() {
    let api = fake();
    api.configure(|c| {
        c.max_timeout_minutes = 60;
        c.max_lifetime_minutes = 120;
        c.exec_min_timeout_ms = 500;
        c.exec_max_timeout_ms = 90_000;
    });
    let c = client(api, ProtocolVersion::V_2025_11_25).await;
    let tools = c.list_all_tools().await.unwrap();
    let prop = |tool: &str, p: &str| {
        let t = tools.iter().find(|t| t.name == tool).unwrap();
        t.input_schema["properties"][p].clone()
    };
    assert_eq!(prop("create_sandbox", "timeout_minutes")["maximum"], 60);
    assert_eq!(prop("create_sandbox", "timeout_minutes")["minimum"], 1);
    assert_eq!(prop("fork_sandbox", "timeout_minutes")["maximum"], 60);
    assert_eq!(prop("extend_sandbox", "additional_minutes")["maximum"], 120);
    assert_eq!(prop("run_command", "timeout_ms")["minimum"], 500);
    assert_eq!(prop("run_command", "timeout_ms")["maximum"], 90_000);
    assert_eq!(prop("run_command", "command")["maxLength"], 131_071);
    // Nothing else in those schemas changed.
    assert_eq!(prop("run_command", "command")["type"], "string");
}

/// `tools/list` serves must be standard JSON Schema: no such format, and an
/// integer's range stated with `minimum`/`maximum`.
#[tokio::test]
async fn tool_schemas_are_standard_json_schema() {
    let c = client(fake(), ProtocolVersion::V_2025_11_25).await;
    let tools = c.list_all_tools().await.unwrap();
    let mut problems = Vec::new();
    let mut integers = 0;
    for t in &tools {
        let input = Value::Object(t.input_schema.as_ref().clone());
        let output = Value::Object(
            t.output_schema
                .as_ref()
                .expect("outputSchema")
                .as_ref()
                .clone(),
        );
        let mut all = Vec::new();
        subschemas(format!("{}.inputSchema", t.name), &input, &mut all);
        subschemas(format!("{}.outputSchema", t.name), &output, &mut all);
        for (path, s) in all {
            if let Some(f) = s.get("format") {
                if !f.as_str().is_some_and(|f| STANDARD_FORMATS.contains(&f)) {
                    problems.push(format!("{path}: non-standard format {f}"));
                }
            }
            if !is_integer(s) {
                continue;
            }
            integers += 1;
            let (min, max) = (s.get("minimum"), s.get("maximum"));
            if !min.is_some_and(Value::is_number) || !max.is_some_and(Value::is_number) {
                problems.push(format!("{path}: integer without minimum and maximum: {s}"));
            }
            let signed = SIGNED_INTEGERS
                .iter()
                .any(|n| path.ends_with(&format!("/{n}")));
            if !signed && !min.and_then(Value::as_f64).is_some_and(|m| m >= 0.0) {
                problems.push(format!(
                    "{path}: an unsigned integer's minimum is not >= 0: {s}"
                ));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    assert!(integers > 20, "the walk reached the integers ({integers})");

    // Ranges declared on the arguments are kept, not widened to the type's.
    let get = |n: &str| tools.iter().find(|t| t.name == n).unwrap();
    for (tool, field, min, max) in [
        ("create_sandbox", "timeout_minutes", 1, 1440),
        ("run_command", "timeout_ms", 1000, 600000),
        ("expose_port", "port", 1, 65535),
        ("list_sandboxes", "limit", 1, 100),
        ("extend_sandbox", "additional_minutes", 1, 1440),
        ("get_usage", "days", 1, u64::from(u32::MAX)),
        ("fork_sandbox", "count", 1, 10),
        ("fork_sandbox", "timeout_minutes", 1, 1440),
        ("list_snapshots", "limit", 1, 100),
    ] {
        let p = &get(tool).input_schema["properties"][field];
        assert_eq!(
            (&p["minimum"], &p["maximum"]),
            (&json!(min), &json!(max)),
            "{tool}.{field}: {p}"
        );
    }
    // And an output's range is its Rust type's.
    let sandbox = get("get_sandbox").output_schema.clone().unwrap();
    let t = &sandbox["properties"]["timeout_minutes"];
    assert_eq!(
        (&t["minimum"], &t["maximum"]),
        (&json!(0), &json!(u32::MAX)),
        "{t}"
    );
    c.cancel().await.unwrap();
}

#[tokio::test]
async fn every_tool_answers_with_structured_content_and_text() {
    let api = fake();
    let c = client(api.clone(), ProtocolVersion::V_2025_06_18).await;
    happy_paths(&c).await;
    // The stdio caller is fixed: no key needed, and every call acted for it.
    let calls = api.calls();
    assert!(calls.iter().all(|c| c.account_id == ACCOUNT), "{calls:?}");
    assert!(api.call_names().contains(&"destroy_sandbox"));
    assert!(calls.iter().any(|c| matches!(
        c.op,
        Op::ListFiles {
            recursive: false,
            ..
        }
    )));
    c.cancel().await.unwrap();
}

#[tokio::test]
async fn actionable_failures_are_tool_errors_that_say_what_to_do() {
    let api = fake();
    let c = client(api.clone(), ProtocolVersion::V_2025_11_25).await;

    let m = err(&call(&c, "get_sandbox", json!({"sandbox_id": "sbx_nope"})).await);
    assert!(
        m.starts_with("not_found: no sandbox with id \"sbx_nope\""),
        "{m}"
    );
    assert!(m.contains("list_sandboxes"), "{m}");

    let m = err(&call(&c, "create_sandbox", json!({"size": "giant"})).await);
    assert!(m.starts_with("invalid_request: unknown size"), "{m}");

    api.fail_next(
        "create_sandbox",
        CoreError::new(
            ErrorType::InsufficientCredits,
            "the credit cannot cover 1440 minutes of a small sandbox",
        ),
    );
    let m = err(&call(&c, "create_sandbox", json!({"timeout_minutes": 1440})).await);
    assert!(m.starts_with("insufficient_credits"), "{m}");
    assert!(m.contains("get_usage"), "{m}");

    // A file that is not UTF-8 (one 0xFF byte), read as text.
    let w = call(
        &c,
        "write_file",
        json!({"sandbox_id": "sbx_existing", "path": "binary.bin", "content": "/w==", "encoding": "base64"}),
    )
    .await;
    assert_ne!(w.is_error, Some(true), "{}", text(&w));
    let m = err(&call(
        &c,
        "read_file",
        json!({"sandbox_id": "sbx_existing", "path": "binary.bin"}),
    )
    .await);
    assert!(m.contains("base64"), "{m}");

    // Arguments the schema does not accept: a tool error naming the field.
    let m = err(&call(&c, "get_sandbox", json!({})).await);
    assert!(m.contains("missing field `sandbox_id`"), "{m}");
    let m = err(&call(
        &c,
        "run_command",
        json!({"sandbox_id": "sbx_existing", "command": "ls", "timeout": 5}),
    )
    .await);
    assert!(m.contains("unknown field `timeout`"), "{m}");
    let m = err(&call(
        &c,
        "expose_port",
        json!({"sandbox_id": "sbx_existing", "port": "eighty"}),
    )
    .await);
    assert!(m.starts_with("invalid_request"), "{m}");

    // A command that timed out: an error that still carries the execution.
    let r = call(
        &c,
        "run_command",
        json!({"sandbox_id": "sbx_existing", "command": "sleep 1000"}),
    )
    .await;
    let m = err(&r);
    assert!(m.contains("timeout_ms"), "{m}");
    assert_eq!(
        r.structured_content.as_ref().unwrap()["status"],
        "timed_out"
    );

    // An internal error is the one protocol error (rmcp's client sends a
    // progress token, so the command is streamed).
    api.fail_next(
        "exec_stream",
        CoreError::internal("the fake platform broke"),
    );
    let e = c
        .call_tool(
            CallToolRequestParams::new("run_command")
                .with_arguments(args(json!({"sandbox_id": "sbx_existing", "command": "ls"}))),
        )
        .await;
    let e = e.expect_err("internal_error is a protocol error");
    assert!(e.to_string().contains("the fake platform broke"), "{e}");
    assert_eq!(api.call_names().last(), Some(&"exec_stream"));
    c.cancel().await.unwrap();
}

#[tokio::test]
async fn run_command_streams_output_as_progress() {
    let api = fake();
    let client = TestClient::new(ProtocolVersion::V_2025_11_25);
    let progress = client.progress.clone();
    let c = client.serve(start(api.clone())).await.unwrap();
    // rmcp's client puts a progress token on every request.
    let r = call(
        &c,
        "run_command",
        json!({"sandbox_id": "sbx_existing", "command": "make"}),
    )
    .await;
    assert_ne!(r.is_error, Some(true), "{}", text(&r));
    assert_eq!(
        r.structured_content.as_ref().unwrap()["stdout"],
        "hello world\n"
    );
    assert_eq!(api.call_names(), ["exec_stream"]);
    assert_eq!(api.last_exec().unwrap().command, "make");
    // Notifications precede the response on the same pipe, but the client
    // dispatches them on its own task: give it a moment.
    for _ in 0..100 {
        if progress.lock().unwrap().len() >= 3 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let p = progress.lock().unwrap().clone();
    let chunks: Vec<(String, String)> = p
        .iter()
        .map(|p| {
            let stream = p.meta.as_ref().unwrap()["sandpit/stream"]
                .as_str()
                .unwrap()
                .to_string();
            (stream, p.message.clone().unwrap())
        })
        .collect();
    assert_eq!(
        chunks,
        vec![
            ("stdout".to_string(), "hello ".to_string()),
            ("stderr".to_string(), "warning\n".to_string()),
            ("stdout".to_string(), "world\n".to_string()),
        ]
    );
    let values: Vec<f64> = p.iter().map(|p| p.progress).collect();
    assert_eq!(
        values,
        vec![6.0, 14.0, 20.0],
        "progress counts bytes, increasing"
    );
    c.cancel().await.unwrap();
}

#[tokio::test]
async fn initialize_negotiates_the_protocol_version() {
    for (asked, answered) in [
        (ProtocolVersion::V_2025_06_18, ProtocolVersion::V_2025_06_18),
        (ProtocolVersion::V_2025_11_25, ProtocolVersion::V_2025_11_25),
        // Not offered over initialize: answered with the newest we have there.
        (ProtocolVersion::V_2026_07_28, ProtocolVersion::V_2025_11_25),
        (ProtocolVersion::V_2025_03_26, ProtocolVersion::V_2025_11_25),
        (ProtocolVersion::V_2024_11_05, ProtocolVersion::V_2025_11_25),
    ] {
        let api = fake();
        let client = TestClient::new(asked.clone()).serve(start(api)).await;
        // rmcp's client refuses a version it did not ask for; what matters
        // here is what the server answered, which it reports either way.
        match client {
            Ok(c) => {
                assert_eq!(c.peer_info().unwrap().protocol_version, answered, "{asked}");
                c.cancel().await.unwrap();
            }
            Err(e) => {
                let s = e.to_string();
                assert!(s.contains(answered.as_str()), "asked {asked}: {s}");
            }
        }
    }
}

#[tokio::test]
async fn revision_2026_07_28_works_without_initialize() {
    let api = fake();
    let c = TestClient::new(ProtocolVersion::V_2026_07_28)
        .serve_with_lifecycle(
            start(api),
            ClientLifecycleMode::Discover {
                preferred_versions: vec![ProtocolVersion::V_2026_07_28],
            },
        )
        .await
        .expect("server/discover");
    let info = c.peer_info().unwrap();
    assert_eq!(info.protocol_version, ProtocolVersion::V_2026_07_28);
    assert!(info.instructions.as_ref().unwrap().contains("uid 1000"));
    happy_paths(&c).await;
    c.cancel().await.unwrap();
}

#[tokio::test]
async fn snapshot_tools_pass_their_arguments_and_report_what_to_do() {
    let api = fake();
    let c = client(api.clone(), ProtocolVersion::V_2025_11_25).await;
    let tools = c.list_all_tools().await.unwrap();
    let tool = |name: &str| tools.iter().find(|t| t.name == name).unwrap().clone();

    let snap = ok(
        &call(&c, "snapshot_sandbox", json!({"sandbox_id": EXISTING})).await,
        &tool("snapshot_sandbox"),
    );
    assert_eq!(snap["name"], Value::Null);
    let snap_id = snap["id"].as_str().unwrap().to_owned();
    let last = api.calls().last().unwrap().op.clone();
    assert_eq!(
        last,
        Op::SnapshotSandbox {
            id: EXISTING.into(),
            req: Default::default(),
            // A tool call is never a replay: each makes a snapshot.
            idempotency_key: None,
        }
    );
    ok(
        &call(&c, "fork_sandbox", json!({"sandbox_id": EXISTING})).await,
        &tool("fork_sandbox"),
    );
    assert_eq!(
        api.calls().last().unwrap().op,
        Op::ForkSandbox {
            id: EXISTING.into(),
            req: Default::default(),
        }
    );

    // Out of range: the core's message, and what to do.
    let m = err(&call(
        &c,
        "fork_sandbox",
        json!({"sandbox_id": EXISTING, "count": 11}),
    )
    .await);
    assert!(m.starts_with("invalid_request: count"), "{m}");
    // Not this account's (or no such) snapshot: where to look.
    let theirs = Caller::new(sandpit_fake::ACCOUNT_B, "test");
    let other = api.add_sandbox(sandpit_fake::ACCOUNT_B, "sbx_theirs");
    let (their_snap, _) = api
        .snapshot_sandbox(&theirs, &other.id, Default::default(), None)
        .await
        .unwrap();
    for (tool, args) in [
        (
            "restore_sandbox",
            json!({"sandbox_id": EXISTING, "snapshot_id": their_snap.id}),
        ),
        ("delete_snapshot", json!({"snapshot_id": their_snap.id})),
        ("create_sandbox", json!({"snapshot_id": their_snap.id})),
        ("snapshot_sandbox", json!({"sandbox_id": other.id})),
    ] {
        let m = err(&call(&c, tool, args).await);
        assert!(m.starts_with("not_found: no "), "{tool}: {m}");
        assert!(m.contains("list_snapshots"), "{tool}: {m}");
    }
    let listed = ok(
        &call(&c, "list_snapshots", json!({})).await,
        &tool("list_snapshots"),
    );
    assert_eq!(listed["data"].as_array().unwrap().len(), 2, "{listed}");
    assert!(listed.to_string().contains(&snap_id));
    assert!(!listed.to_string().contains(&their_snap.id));

    // Arguments the schema does not take are named.
    let m = err(&call(&c, "restore_sandbox", json!({"sandbox_id": EXISTING})).await);
    assert!(m.contains("missing field `snapshot_id`"), "{m}");
    let m = err(&call(
        &c,
        "snapshot_sandbox",
        json!({"sandbox_id": EXISTING, "label": "x"}),
    )
    .await);
    assert!(m.contains("unknown field `label`"), "{m}");
    c.cancel().await.unwrap();
}
