//! The REST API's operations, each declared once: its method, path and
//! handler, and what the OpenAPI 3.1 document says of it. The router serves
//! exactly this table ([`router`]) and the document describes exactly it
//! ([`openapi`]), so a route cannot go undocumented nor a documented one
//! unserved.
//!
//! Component schemas come from the `schemars::JsonSchema` derives of the very
//! types the handlers parse and serialize (requests with the *deserialize*
//! contract, responses with the *serialize* contract), so the document cannot
//! describe a field the server does not have. A test holds the table to the
//! contract's list of routes, and another holds `docs/openapi.json` to this
//! document.

use crate::bodies::{
    ExposePortBody, ExtendBody, FilesQuery, PortClosed, SandboxEventsQuery, SignUrlBody,
    UsageQuery, VolumeFilesQuery,
};
use crate::error::ErrorBody;
use crate::server;
use crate::sse::OutputChunk;
use crate::state::{AppState, RestConfig};
use crate::terminal;
use axum::extract::DefaultBodyLimit;
use axum::routing::{delete, get, patch, post, put, MethodRouter};
use axum::Router;
use sandpit_core::SandboxApi;
use sandpit_core::{
    Account, BuildTemplate, CreateSandbox, CreateSnapshot, CreateVolume, ExecParams, Execution,
    FileContent, FileDeleted, FileList, FileWritten, Fork, ForkSandbox, List, ListExecutions,
    ListSandboxes, ListSnapshots, NetworkLists, Port, PutSecret, ResizeVolume, RestoreSandbox,
    Sandbox, Secret, ServiceInfo, SignedUrl, Snapshot, Template, TerminalToken, Usage, Volume,
    WriteFile,
};
use sandpit_core::{CreateWebhook, Event, ListDeliveries, ListEvents, Webhook, WebhookDelivery};
use sandpit_core::{MoveVolume, VolumeFile, VolumeFileMeta};
use schemars::generate::{Contract, SchemaGenerator, SchemaSettings};
use schemars::JsonSchema;
use serde_json::{json, Map, Value};
use std::sync::Arc;
use terminal::{TerminalControl, TerminalEvent, TerminalQuery};

fn generator(contract: Contract) -> SchemaGenerator {
    SchemaSettings::draft2020_12()
        .with(|s| {
            s.definitions_path = "/components/schemas".into();
            s.meta_schema = None;
            s.contract = contract;
        })
        .into_generator()
}

/// Which error responses an operation can give.
#[derive(Clone, Copy)]
struct Errors {
    auth: bool,
    body: bool,
    not_found: bool,
    conflict: bool,
    credits: bool,
}

const NONE: Errors = Errors {
    auth: false,
    body: false,
    not_found: false,
    conflict: false,
    credits: false,
};
const AUTH: Errors = Errors { auth: true, ..NONE };
const ON_SANDBOX: Errors = Errors {
    not_found: true,
    conflict: true,
    ..AUTH
};

struct Op {
    method: &'static str,
    path: &'static str,
    /// What serves it (its method's router for `path`).
    handler: MethodRouter<AppState>,
    id: &'static str,
    summary: &'static str,
    description: &'static str,
    params: Vec<Value>,
    body: Option<Value>,
    responses: Vec<(&'static str, &'static str, Value)>,
    errors: Errors,
}

fn path_param(name: &str, description: &str, schema: Value) -> Value {
    json!({"name": name, "in": "path", "required": true, "description": description, "schema": schema})
}

fn id_param(what: &str) -> Value {
    path_param("id", &format!("The {what} id."), json!({"type": "string"}))
}

/// Query parameters from the properties of a query type's schema.
fn query_params<T: JsonSchema>(gen: &mut SchemaGenerator) -> Vec<Value> {
    let schema = T::json_schema(gen).to_value();
    let required: Vec<&str> = schema
        .get("required")
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let mut out = Vec::new();
    if let Some(props) = schema.get("properties").and_then(Value::as_object) {
        for (name, prop) in props {
            let mut prop = prop.clone();
            let description = prop
                .as_object_mut()
                .and_then(|o| o.remove("description"))
                .unwrap_or(Value::String(String::new()));
            strip_null(&mut prop);
            out.push(json!({
                "name": name,
                "in": "query",
                "required": required.contains(&name.as_str()),
                "description": description,
                "schema": prop,
            }));
        }
    }
    out
}

/// A query parameter is absent or has a value; it is never `null`.
fn strip_null(schema: &mut Value) {
    let Some(o) = schema.as_object_mut() else {
        return;
    };
    if o.get("default") == Some(&Value::Null) {
        o.remove("default");
    }
    if let Some(Value::Array(types)) = o.get_mut("type") {
        types.retain(|t| t != "null");
        if types.len() == 1 {
            let t = types.remove(0);
            o.insert("type".into(), t);
        }
    }
    if let Some(Value::Array(any)) = o.get("anyOf") {
        let rest: Vec<Value> = any
            .iter()
            .filter(|s| s.get("type") != Some(&json!("null")))
            .cloned()
            .collect();
        if rest.len() == 1 {
            o.remove("anyOf");
            if let Some(Value::Object(only)) = rest.into_iter().next() {
                o.extend(only);
            }
        }
    }
}

/// Give a generated schema a name of our choosing (generic types such as
/// `List<T>` otherwise get `List`, `List2`, ...), rewriting every `$ref`.
fn rename_schema(doc: &mut Value, reference: &Value, new_name: &str) {
    let Some(old_ref) = reference.get("$ref").and_then(Value::as_str) else {
        return;
    };
    let old_ref = old_ref.to_owned();
    let old_name = old_ref.rsplit('/').next().unwrap_or_default().to_owned();
    let new_ref = format!("#/components/schemas/{new_name}");
    if let Some(schemas) = doc
        .pointer_mut("/components/schemas")
        .and_then(Value::as_object_mut)
    {
        if let Some(s) = schemas.remove(&old_name) {
            schemas.insert(new_name.to_owned(), s);
        }
    }
    fn walk(v: &mut Value, old: &str, new: &str) {
        match v {
            Value::Object(m) => {
                for (k, v) in m.iter_mut() {
                    if k == "$ref" && v.as_str() == Some(old) {
                        *v = Value::String(new.to_owned());
                    } else {
                        walk(v, old, new);
                    }
                }
            }
            Value::Array(a) => a.iter_mut().for_each(|v| walk(v, old, new)),
            _ => {}
        }
    }
    walk(doc, &old_ref, &new_ref);
}

fn json_content(schema: Value) -> Value {
    json!({"application/json": {"schema": schema}})
}

fn error_responses(e: Errors, responses: &mut Map<String, Value>) {
    let mut add = |status: &str, name: &str| {
        responses.insert(
            status.into(),
            json!({"$ref": format!("#/components/responses/{name}")}),
        );
    };
    add("400", "InvalidRequest");
    if e.auth {
        add("401", "Unauthorized");
        add("403", "Forbidden");
    }
    if e.credits {
        add("402", "InsufficientCredits");
    }
    if e.not_found {
        add("404", "NotFound");
    }
    if e.conflict {
        add("409", "Conflict");
    }
    if e.body {
        add("413", "PayloadTooLarge");
    }
    add("429", "RateLimited");
    add("500", "InternalError");
    add("503", "ServiceUnavailable");
}

fn operation(op: &Op) -> Value {
    let mut responses = Map::new();
    for (status, description, content) in &op.responses {
        let mut r = json!({
            "description": description,
            "headers": {"x-request-id": {"$ref": "#/components/headers/RequestId"}},
        });
        if !content.is_null() {
            r["content"] = content.clone();
        }
        responses.insert((*status).into(), r);
    }
    error_responses(op.errors, &mut responses);
    let mut o = json!({
        "operationId": op.id,
        "summary": op.summary,
        "description": op.description,
        "responses": responses,
    });
    if !op.params.is_empty() {
        o["parameters"] = Value::Array(op.params.clone());
    }
    if let Some(body) = &op.body {
        o["requestBody"] = json!({"required": true, "content": body.clone()});
    }
    if !op.errors.auth {
        o["security"] = json!([]);
    }
    o
}

fn error_response(description: &str, retry_after: bool) -> Value {
    let mut headers = json!({"x-request-id": {"$ref": "#/components/headers/RequestId"}});
    if retry_after {
        headers["Retry-After"] = json!({"$ref": "#/components/headers/RetryAfter"});
    }
    json!({
        "description": description,
        "headers": headers,
        "content": json_content(json!({"$ref": "#/components/schemas/Error"})),
    })
}

const DESCRIPTION: &str = "\
Sandpit's REST API: disposable Linux VMs (sandboxes) for AI agents, wire-compatible \
with the public \"Sandbox as a Service\" REST API.

Authentication: every operation except `GET /v1/service` and `GET /v1/openapi.json` \
needs the account's API key as `Authorization: Bearer <key>` or `x-api-key: <key>`. \
A key in the URL is never accepted (401, even next to a valid header). A resource of \
another account is reported exactly like one that does not exist (404).

Errors: every non-2xx response, including unknown routes (404) and wrong methods \
(405, `invalid_request`), has the body `{\"error\": {\"type\", \"message\"}, \"request_id\"}`. \
Every response carries `x-request-id`. 429 and 503 carry `Retry-After` (seconds). \
Bodies must be JSON (`Content-Type: application/json`; an empty body is read as `{}`); \
unknown body fields and unknown query parameters are `invalid_request`, never ignored. \
A body over the size limit (default 64 MiB) is 413 with type `invalid_request`.

Times are RFC 3339 UTC strings. IDs are opaque strings.";

const EXEC_DESCRIPTION: &str = "\
Runs the command through `/bin/sh -c` (bash where installed) as the unprivileged sandbox \
user, with `env` exported first. Output past 1 MiB per stream is dropped and `truncated` \
is set; a command running past `timeout_ms` is killed with its process group and \
reported as `timed_out`.

With `\"stream\": true` or `Accept: text/event-stream` the answer is a server-sent event \
stream: first `event: start` whose data is the Execution as it starts (status \
`running`: its id, to find it by with `GET /v1/executions/{id}` if the stream breaks), \
then `event: stdout` / `event: stderr` with `data: {\"data\": \"<chunk>\"}` \
(OutputChunk), then one last `event: exit` whose data is the Execution, or \
`event: error` whose data is the Error body if the platform fails mid-way. \
`: ping` comments keep an idle stream alive (every 15 s). If the client disconnects \
before the exit event, the command is killed and recorded as `cancelled`. Errors \
found before the command starts are ordinary JSON error responses.";

const TERMINAL_DESCRIPTION: &str = "\
An interactive login shell (bash) as the unprivileged sandbox user on a new terminal \
(`TERM=xterm-256color`, in /workspace, under the same memory and process limits as \
commands), carried over a WebSocket. Authenticate with the key's header, or with \
`?token=` from `POST /v1/sandboxes/{id}/pty/tokens` (the only credential accepted in \
this URL). The size starts as `rows` x `cols` (24 x 80).

Framing: client to server, a binary message is keystrokes (bytes); a text message is \
JSON, `{\"type\":\"resize\",\"rows\":R,\"cols\":C}` or `{\"type\":\"input\",\"data\":\"...\"}` \
(TerminalControl). Server to client, a binary message is the terminal's output (bytes); \
a text message is JSON (TerminalEvent): `{\"type\":\"exit\",\"exit_code\":N,\"signal\":null}` \
when the shell exits, then a normal close (1000); `{\"type\":\"error\",\"error\":{...}}` \
for a control message it could not take (the terminal stays), or when the terminal was \
hung up because its sandbox stopped (then a close, 1011). Closing the socket hangs the \
shell up (SIGHUP to its session, as an ssh connection that drops). A sandbox has at most \
16 terminals open (429 past that). Errors before the upgrade are ordinary JSON errors.";

const EVENTS_DESCRIPTION: &str = "\
Everything that happened to the account's sandboxes (created, started, paused, resumed, \
snapshotted, forked, restored, extended, shortened, moved, noted, destroying, killed, expired, \
failed), oldest first, each written in the same transaction as the change itself. Each \
event names who caused it (`actor`: the API key's prefix, `dashboard`, `the expiry`…) and \
why (`reason`). Page with `after` (an event's `cursor`, or the previous page's \
`next_cursor`) and `limit` (1..500, default 100); `sandbox_id` keeps one sandbox's (404 \
when it is not the account's). To follow the log, poll with `after=next_cursor`: it is \
always set once an event was seen, so nothing is missed or seen twice. A cursor that is \
not one is 400.";

/// The REST API: every `/v1` route of `docs/spec/rest-api.md`, plus
/// `GET /v1/service` and `GET /v1/openapi.json` (both without a key).
///
/// Serve it with `axum::serve(listener, router(api, config))`.
pub fn router(api: Arc<dyn SandboxApi>, config: RestConfig) -> Router {
    let (routes, document) = table();
    let state = AppState {
        api,
        openapi: Arc::new(document),
        cfg: Arc::new(config.clone()),
    };
    routes
        .into_iter()
        .fold(Router::new(), |router, (path, handler)| {
            router.route(path, handler)
        })
        .fallback(server::not_found)
        .layer(DefaultBodyLimit::max(config.max_body_bytes))
        .layer(axum::middleware::from_fn_with_state(
            config.body_budget.clone(),
            crate::budget::hold,
        ))
        .layer(tower_http::catch_panic::CatchPanicLayer::new())
        .layer(axum::middleware::from_fn(crate::error::finish))
        .with_state(state)
}

/// The OpenAPI 3.1 document of the REST API (also served at `GET /v1/openapi.json`).
pub fn openapi() -> Value {
    table().1
}

/// The table's routes (a path may come more than once, a method each) and
/// its document.
type Table = (Vec<(&'static str, MethodRouter<AppState>)>, Value);

/// The operations, as routes and as the document that describes them.
fn table() -> Table {
    let mut req = generator(Contract::Deserialize);
    let mut res = generator(Contract::Serialize);

    let sandbox = res.subschema_for::<Sandbox>().to_value();
    let sandbox_list = res.subschema_for::<List<Sandbox>>().to_value();
    let sandbox_list_ref = sandbox_list.clone();
    let port_list = res.subschema_for::<List<Port>>().to_value();
    let execution = res.subschema_for::<Execution>().to_value();
    let execution_list = res.subschema_for::<List<Execution>>().to_value();
    let chunk = res.subschema_for::<OutputChunk>().to_value();
    let error = res.subschema_for::<ErrorBody>().to_value();
    let sandbox_resp = json_content(sandbox.clone());
    let snapshot_resp = json_content(res.subschema_for::<Snapshot>().to_value());
    let template_resp = json_content(res.subschema_for::<Template>().to_value());
    let template_list = res.subschema_for::<List<Template>>().to_value();
    let snapshot_list = res.subschema_for::<List<Snapshot>>().to_value();
    let snapshot_list_ref = snapshot_list.clone();
    let secret_resp = json_content(res.subschema_for::<Secret>().to_value());
    let secret_list = res.subschema_for::<List<Secret>>().to_value();
    let secret_name = || {
        path_param(
            "name",
            "The secret's name: an environment variable's (letters, digits and _).",
            json!({"type": "string"}),
        )
    };
    let volume_resp = json_content(res.subschema_for::<Volume>().to_value());
    let volume_list = res.subschema_for::<List<Volume>>().to_value();
    let volume_param = || {
        path_param(
            "volume",
            "The volume's id (`vol_…`) or name.",
            json!({"type": "string"}),
        )
    };
    // A volume's files call's parameters: the volume, and the named ones
    // of its query.
    let volume_files_params = |req: &mut SchemaGenerator, names: &[&str]| {
        let mut p = vec![volume_param()];
        p.extend(
            query_params::<VolumeFilesQuery>(req)
                .into_iter()
                .filter(|q| names.contains(&q["name"].as_str().unwrap_or(""))),
        );
        p
    };
    let idempotency_header = |what: &str| {
        json!({
            "name": "Idempotency-Key",
            "in": "header",
            "required": false,
            "description": format!("Makes retries safe: the same key and body return the {what} made first."),
            "schema": {"type": "string"},
        })
    };

    let webhook = res.subschema_for::<Webhook>().to_value();
    let delivery = res.subschema_for::<WebhookDelivery>().to_value();
    let _ = res.subschema_for::<Event>();

    let mut ops = vec![
        Op {
            method: "get",
            path: "/v1/service",
            handler: get(server::service),
            id: "getService",
            summary: "What this service is",
            description: "Sizes, prices, limits and the guest environment. No key needed.",
            params: vec![],
            body: None,
            responses: vec![(
                "200",
                "The service description.",
                json_content(res.subschema_for::<ServiceInfo>().to_value()),
            )],
            errors: NONE,
        },
        Op {
            method: "get",
            path: "/v1/openapi.json",
            handler: get(server::openapi_doc),
            id: "getOpenApi",
            summary: "This document",
            description: "The OpenAPI 3.1 document of this API. No key needed.",
            params: vec![],
            body: None,
            responses: vec![(
                "200",
                "The OpenAPI document.",
                json_content(json!({"type": "object"})),
            )],
            errors: NONE,
        },
        Op {
            method: "get",
            path: "/v1/account",
            handler: get(server::account),
            id: "getAccount",
            summary: "The calling account",
            description: "The account the key belongs to, with its remaining credit.",
            params: vec![],
            body: None,
            responses: vec![(
                "200",
                "The account object.",
                json_content(res.subschema_for::<Account>().to_value()),
            )],
            errors: AUTH,
        },
        Op {
            method: "get",
            path: "/v1/usage",
            handler: get(server::usage),
            id: "getUsage",
            summary: "Remaining credit and recent usage",
            description: "Cost per sandbox over the last `days` days.",
            params: query_params::<UsageQuery>(&mut req),
            body: None,
            responses: vec![(
                "200",
                "The usage object.",
                json_content(res.subschema_for::<Usage>().to_value()),
            )],
            errors: AUTH,
        },
        Op {
            method: "post",
            path: "/v1/sandboxes",
            handler: post(server::create_sandbox),
            id: "createSandbox",
            summary: "Create a sandbox",
            description: "Synchronous: answers once the sandbox accepts commands (status `running`). \
                The cost of the whole timeout is reserved from the credit (402 if it cannot be). \
                With `Idempotency-Key`, a retry with the same key and body returns the original \
                sandbox (200); the same key with a different body is 409. \
                With `snapshot_id`, the sandbox starts from that snapshot (its disk, memory and \
                running processes, with a fresh identity) at the snapshot's size; another `size` is 400.",
            params: vec![idempotency_header("sandbox")],
            body: Some(json_content(req.subschema_for::<CreateSandbox>().to_value())),
            responses: vec![
                ("201", "Created.", sandbox_resp.clone()),
                ("200", "Idempotent replay: the sandbox created by the first request with this key.", sandbox_resp.clone()),
            ],
            errors: Errors { body: true, credits: true, conflict: true, ..AUTH },
        },
        Op {
            method: "get",
            path: "/v1/sandboxes",
            handler: get(server::list_sandboxes),
            id: "listSandboxes",
            summary: "List sandboxes",
            description: "Newest first, paged with `limit` (1..100) and `starting_after` (the previous page's `next_cursor`).",
            params: query_params::<ListSandboxes>(&mut req),
            body: None,
            responses: vec![("200", "A page of sandboxes.", json_content(sandbox_list))],
            errors: AUTH,
        },
        Op {
            method: "get",
            path: "/v1/sandboxes/{id}",
            handler: get(server::get_sandbox),
            id: "getSandbox",
            summary: "Get a sandbox",
            description: "The sandbox object.",
            params: vec![id_param("sandbox")],
            body: None,
            responses: vec![("200", "The sandbox object.", sandbox_resp.clone())],
            errors: Errors { not_found: true, ..AUTH },
        },
        Op {
            method: "delete",
            path: "/v1/sandboxes/{id}",
            handler: delete(server::destroy_sandbox),
            id: "destroySandbox",
            summary: "Destroy a sandbox",
            description: "Destroys it and stops billing; the unused reserved credit is returned. \
                Answers with status `deleted` (or `deleting` while teardown finishes). \
                Destroying a destroyed sandbox returns it again.",
            params: vec![id_param("sandbox")],
            body: None,
            responses: vec![("200", "The sandbox object.", sandbox_resp.clone())],
            errors: ON_SANDBOX,
        },
        Op {
            method: "post",
            path: "/v1/sandboxes/{id}/extend",
            handler: post(server::extend_sandbox),
            id: "extendSandbox",
            summary: "Extend a sandbox's lifetime",
            description: "Reserves the extra time from the credit. The total lifetime may not pass 24 h from creation (400).",
            params: vec![id_param("sandbox")],
            body: Some(json_content(req.subschema_for::<ExtendBody>().to_value())),
            responses: vec![("200", "The updated sandbox.", sandbox_resp.clone())],
            errors: Errors { body: true, credits: true, ..ON_SANDBOX },
        },
        Op {
            method: "put",
            path: "/v1/sandboxes/{id}/network",
            handler: put(server::update_network),
            id: "updateSandboxNetwork",
            summary: "Replace a sandbox's egress lists",
            description: "Replaces the sandbox's own `allow_out` and `deny_out` lists (IPv4 addresses \
                and prefixes, at most 256 each; empty lists: the operator's network as it is). A running \
                sandbox has them when this answers: a connect they deny is refused at once; a paused \
                one gets them when it resumes. Nothing reaches what the operator denies or the host's \
                own addresses, whatever the lists say. A domain name is refused (400).",
            params: vec![id_param("sandbox")],
            body: Some(json_content(req.subschema_for::<NetworkLists>().to_value())),
            responses: vec![("200", "The updated sandbox.", sandbox_resp.clone())],
            errors: Errors { body: true, ..ON_SANDBOX },
        },
        Op {
            method: "post",
            path: "/v1/sandboxes/{id}/snapshots",
            handler: post(server::snapshot_sandbox),
            id: "snapshotSandbox",
            summary: "Snapshot a sandbox",
            description: "Saves the whole state of a running sandbox (disk, memory, processes); it runs on, \
                paused only while its state is captured. The snapshot is kept until its `expires_at` \
                unless deleted before. Start new sandboxes from it (`POST /v1/sandboxes` with \
                `snapshot_id`) or roll the sandbox back to it (`POST /v1/sandboxes/{id}/restore`). \
                With `Idempotency-Key`, a retry with the same key and body returns the original \
                snapshot (200); the same key with a different body is 409.",
            params: vec![id_param("sandbox"), idempotency_header("snapshot")],
            body: Some(json_content(req.subschema_for::<CreateSnapshot>().to_value())),
            responses: vec![
                ("201", "Created.", snapshot_resp.clone()),
                ("200", "Idempotent replay: the snapshot made by the first request with this key.", snapshot_resp.clone()),
            ],
            errors: Errors { body: true, ..ON_SANDBOX },
        },
        Op {
            method: "post",
            path: "/v1/sandboxes/{id}/fork",
            handler: post(server::fork_sandbox),
            id: "forkSandbox",
            summary: "Fork a sandbox",
            description: "Snapshots the sandbox and starts `count` (1..10, default 1) new sandboxes from \
                that snapshot, each with `timeout_minutes` of life. Their credit is reserved at once, \
                or the call is refused whole (402). The snapshot is kept like any other.",
            params: vec![id_param("sandbox")],
            body: Some(json_content(req.subschema_for::<ForkSandbox>().to_value())),
            responses: vec![(
                "201",
                "The snapshot and the new sandboxes.",
                json_content(res.subschema_for::<Fork>().to_value()),
            )],
            errors: Errors { body: true, credits: true, ..ON_SANDBOX },
        },
        Op {
            method: "post",
            path: "/v1/sandboxes/{id}/restore",
            handler: post(server::restore_sandbox),
            id: "restoreSandbox",
            summary: "Roll a sandbox back to a snapshot",
            description: "Puts the sandbox back in the state of `snapshot_id`: a snapshot of this sandbox, \
                or of a sandbox it was started from, of the same size (400 otherwise). Everything \
                since is lost. The sandbox keeps its id, preview URLs and expiry.",
            params: vec![id_param("sandbox")],
            body: Some(json_content(req.subschema_for::<RestoreSandbox>().to_value())),
            responses: vec![("200", "The restored sandbox.", sandbox_resp.clone())],
            errors: Errors { body: true, ..ON_SANDBOX },
        },
        Op {
            method: "post",
            path: "/v1/sandboxes/{id}/pause",
            handler: post(server::pause_sandbox),
            id: "pauseSandbox",
            summary: "Pause a sandbox",
            description: "Stops the sandbox's VM with its whole state (disk, memory, processes) kept \
                on disk: it uses no CPU or memory and is billed at the paused rate (10% of its \
                price by default). Any command, file or preview call resumes it first, as does \
                `POST /v1/sandboxes/{id}/resume`. It still ends at its `expires_at`. Pausing a \
                paused sandbox changes nothing.",
            params: vec![id_param("sandbox")],
            body: None,
            responses: vec![("200", "The paused sandbox.", sandbox_resp.clone())],
            errors: ON_SANDBOX,
        },
        Op {
            method: "post",
            path: "/v1/sandboxes/{id}/resume",
            handler: post(server::resume_sandbox),
            id: "resumeSandbox",
            summary: "Resume a paused sandbox",
            description: "Runs a paused sandbox again, its processes where they were. Resuming a \
                running sandbox changes nothing.",
            params: vec![id_param("sandbox")],
            body: None,
            responses: vec![("200", "The running sandbox.", sandbox_resp.clone())],
            errors: ON_SANDBOX,
        },
        Op {
            method: "get",
            path: "/v1/snapshots",
            handler: get(server::list_snapshots),
            id: "listSnapshots",
            summary: "List snapshots",
            description: "The account's snapshots, newest first, paged with `limit` (1..100) and \
                `starting_after` (the previous page's `next_cursor`). Deleted ones are not listed.",
            params: query_params::<ListSnapshots>(&mut req),
            body: None,
            responses: vec![("200", "A page of snapshots.", json_content(snapshot_list))],
            errors: AUTH,
        },
        Op {
            method: "get",
            path: "/v1/snapshots/{id}",
            handler: get(server::get_snapshot),
            id: "getSnapshot",
            summary: "Get a snapshot",
            description: "The snapshot object.",
            params: vec![id_param("snapshot")],
            body: None,
            responses: vec![("200", "The snapshot object.", snapshot_resp.clone())],
            errors: Errors { not_found: true, ..AUTH },
        },
        Op {
            method: "delete",
            path: "/v1/snapshots/{id}",
            handler: delete(server::delete_snapshot),
            id: "deleteSnapshot",
            summary: "Delete a snapshot",
            description: "Deletes it and frees its disk; answers with it, status `deleted`. From then on it is \
                404 like one that never existed. Sandboxes started from it live on.",
            params: vec![id_param("snapshot")],
            body: None,
            responses: vec![("200", "The deleted snapshot.", snapshot_resp.clone())],
            errors: Errors { not_found: true, conflict: true, ..AUTH },
        },
        Op {
            method: "get",
            path: "/v1/secrets",
            handler: get(server::list_secrets),
            id: "listSecrets",
            summary: "List secrets",
            description: "The account's secrets, by name: their hosts, header and format, never their \
                values.",
            params: vec![],
            body: None,
            responses: vec![("200", "Every secret, without its value.", json_content(secret_list))],
            errors: AUTH,
        },
        Op {
            method: "put",
            path: "/v1/secrets/{name}",
            handler: put(server::put_secret),
            id: "putSecret",
            summary: "Store a secret",
            description: "Stores the secret `name` (replacing one of that name, whose `created_at` is \
                kept), sealed at rest; its value is never shown again. A sandbox created with \
                `secrets: [name]` has `name` in its commands' environment holding a placeholder, \
                which the host replaces with the value in the secret's `header` (as `format` says) \
                of HTTPS requests to its `hosts` only, after it verified their server: the value \
                never enters the sandbox. Running sandboxes that use it send the new value from \
                their next request. A bad name, value, host, header or format is 400, saying why.",
            params: vec![secret_name()],
            body: Some(json_content(req.subschema_for::<PutSecret>().to_value())),
            responses: vec![("200", "The secret, without its value.", secret_resp.clone())],
            errors: Errors { body: true, ..AUTH },
        },
        Op {
            method: "delete",
            path: "/v1/secrets/{name}",
            handler: delete(server::delete_secret),
            id: "deleteSecret",
            summary: "Delete a secret",
            description: "Deletes it; answers with it as it was (without its value). Sandboxes that \
                use it keep their placeholder, which is sent on unchanged from their next request.",
            params: vec![secret_name()],
            body: None,
            responses: vec![("200", "The deleted secret, without its value.", secret_resp)],
            errors: Errors { not_found: true, ..AUTH },
        },
        Op {
            method: "post",
            path: "/v1/volumes",
            handler: post(server::create_volume),
            id: "createVolume",
            summary: "Create a volume",
            description: "Makes an empty volume: an ext4 file system of `size_gb` GiB (default 10, at \
                most 100 unless the operator says otherwise) on one node's disk, owned by the \
                sandbox's user, kept until it is deleted whatever becomes of the sandboxes. Its \
                size is billed per second it exists (`GET /v1/usage`). A name the account has \
                already is 409; past the account's quota (20 volumes, 100 GiB together by \
                default) 429, saying which. With `Idempotency-Key`, a retry with the same key \
                and body returns the volume the first request made (200); the same key with a \
                different body is 409. A sandbox mounts it with `volumes` at its create.",
            params: vec![idempotency_header("volume")],
            body: Some(json_content(req.subschema_for::<CreateVolume>().to_value())),
            responses: vec![
                ("201", "The new volume, ready.", volume_resp.clone()),
                ("200", "Idempotent replay: the volume made by the first request with this key.", volume_resp.clone()),
            ],
            errors: Errors { body: true, conflict: true, ..AUTH },
        },
        Op {
            method: "get",
            path: "/v1/volumes",
            handler: get(server::list_volumes),
            id: "listVolumes",
            summary: "List volumes",
            description: "The account's volumes, by name, with the live sandboxes that mount each.",
            params: vec![],
            body: None,
            responses: vec![("200", "Every volume.", json_content(volume_list))],
            errors: AUTH,
        },
        Op {
            method: "get",
            path: "/v1/volumes/{volume}",
            handler: get(server::get_volume),
            id: "getVolume",
            summary: "Get a volume",
            description: "The volume object, with the live sandboxes that mount it.",
            params: vec![volume_param()],
            body: None,
            responses: vec![("200", "The volume object.", volume_resp.clone())],
            errors: Errors { not_found: true, ..AUTH },
        },
        Op {
            method: "patch",
            path: "/v1/volumes/{volume}",
            handler: patch(server::resize_volume),
            id: "resizeVolume",
            summary: "Grow a volume",
            description: "Grows the volume and its file system to `size_gb` GiB, what it holds kept. \
                A volume never shrinks (400). Refused (409) while a live sandbox mounts it.",
            params: vec![volume_param()],
            body: Some(json_content(req.subschema_for::<ResizeVolume>().to_value())),
            responses: vec![("200", "The grown volume.", volume_resp.clone())],
            errors: Errors { body: true, not_found: true, conflict: true, ..AUTH },
        },
        Op {
            method: "delete",
            path: "/v1/volumes/{volume}",
            handler: delete(server::delete_volume),
            id: "deleteVolume",
            summary: "Delete a volume",
            description: "Deletes the volume and everything on it; answers with it, status \
                `deleted`. Its billing ends and its name is free again. Refused (409) while a \
                live sandbox mounts it, saying which.",
            params: vec![volume_param()],
            body: None,
            responses: vec![("200", "The deleted volume.", volume_resp.clone())],
            errors: Errors { not_found: true, conflict: true, ..AUTH },
        },
        Op {
            method: "post",
            path: "/v1/volumes/{volume}/move",
            handler: post(server::move_volume),
            id: "moveVolume",
            summary: "Move a volume to another node",
            description: "In a cluster, copies the volume's file to node `node` (streamed, holes \
                left out), then keeps it there: sandboxes that mount it run on that node from \
                then on. Refused (409, naming them) while a live sandbox mounts it; meanwhile no \
                sandbox takes it. A node that is not live is 503. A copy that fails leaves the \
                volume where it was, whole.",
            params: vec![volume_param()],
            body: Some(json_content(req.subschema_for::<MoveVolume>().to_value())),
            responses: vec![("200", "The volume, on its new node.", volume_resp)],
            errors: Errors { body: true, not_found: true, conflict: true, ..AUTH },
        },
        Op {
            method: "get",
            path: "/v1/volumes/{volume}/files",
            handler: get(server::get_volume_files),
            id: "readVolumeFiles",
            summary: "Read a volume's file, describe a path, or list a directory",
            description: "A volume's files without a sandbox, read by the host from the volume \
                while no live sandbox mounts it read-write (409 naming it otherwise). \
                Paths are absolute in the volume (`/` its root). Without `list` or `stat`: the \
                file itself, streamed (`application/octet-stream`, its `Content-Length`, its \
                resolved path in `x-sandpit-path`; symbolic links inside the volume followed). \
                `stat=true`: the path described. `list=true`: the directory's entries, `depth` \
                levels down (default 1), each described.",
            params: volume_files_params(&mut req, &["path", "list", "depth", "stat"]),
            body: None,
            responses: vec![(
                "200",
                "The file (octet-stream), one VolumeFile with `stat`, or a list of them with `list`.",
                json!({
                    "application/json": {"schema": {"oneOf": [
                        res.subschema_for::<VolumeFile>().to_value(),
                        res.subschema_for::<List<VolumeFile>>().to_value(),
                    ]}},
                    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
                }),
            )],
            errors: Errors { not_found: true, conflict: true, ..AUTH },
        },
        Op {
            method: "put",
            path: "/v1/volumes/{volume}/files",
            handler: put(server::put_volume_file),
            id: "writeVolumeFile",
            summary: "Write a volume's file",
            description: "Writes the request body (`application/octet-stream`, with a \
                `Content-Length`) to `path`, making the directories above it; the file is the \
                sandbox user's (1000) and 0644 unless `uid`, `gid` and `mode` say otherwise. An \
                existing file is replaced, at once, only with `overwrite=true` (409 otherwise); a \
                directory never is. Refused (409, naming them) while any live sandbox mounts the \
                volume; a sandbox's create that asks for it meanwhile waits its turn (409, retry). \
                A body cut short writes nothing; one that does not fit is 409 (grow the volume).",
            params: volume_files_params(&mut req, &["path", "overwrite", "uid", "gid", "mode"]),
            body: Some(json!({
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
            })),
            responses: vec![(
                "201",
                "The file written, described.",
                json_content(res.subschema_for::<VolumeFile>().to_value()),
            )],
            errors: Errors { body: true, not_found: true, conflict: true, ..AUTH },
        },
        Op {
            method: "post",
            path: "/v1/volumes/{volume}/files",
            handler: post(server::make_volume_dir),
            id: "makeVolumeDirectory",
            summary: "Make a directory in a volume",
            description: "Makes directory `path` (the sandbox user's, 0755, unless `uid`, `gid` \
                and `mode` say otherwise), and with `parents=true` the missing ones above it. \
                One that exists is 409. Same rule as writing a file.",
            params: volume_files_params(&mut req, &["path", "parents", "uid", "gid", "mode"]),
            body: None,
            responses: vec![(
                "201",
                "The directory, described.",
                json_content(res.subschema_for::<VolumeFile>().to_value()),
            )],
            errors: Errors { not_found: true, conflict: true, ..AUTH },
        },
        Op {
            method: "patch",
            path: "/v1/volumes/{volume}/files",
            handler: patch(server::patch_volume_file),
            id: "changeVolumeFile",
            summary: "Change a volume path's owner or mode",
            description: "Sets what the body names of `path`'s owner and permission bits. \
                Same rule as writing a file.",
            params: volume_files_params(&mut req, &["path"]),
            body: Some(json_content(req.subschema_for::<VolumeFileMeta>().to_value())),
            responses: vec![(
                "200",
                "The path, described.",
                json_content(res.subschema_for::<VolumeFile>().to_value()),
            )],
            errors: Errors { body: true, not_found: true, conflict: true, ..AUTH },
        },
        Op {
            method: "delete",
            path: "/v1/volumes/{volume}/files",
            handler: delete(server::delete_volume_file),
            id: "deleteVolumeFile",
            summary: "Delete a volume's file or directory",
            description: "Removes `path`; a directory with everything in it. The volume's \
                root is not removed (400). Same rule as writing a file.",
            params: volume_files_params(&mut req, &["path"]),
            body: None,
            responses: vec![(
                "200",
                "Deleted.",
                json_content(res.subschema_for::<FileDeleted>().to_value()),
            )],
            errors: Errors { not_found: true, conflict: true, ..AUTH },
        },
        Op {
            method: "post",
            path: "/v1/templates",
            handler: post(server::build_template),
            id: "buildTemplate",
            summary: "Build a template",
            description: "Starts a build of template `name` (the standard image plus steps, saved with its \
                start command running) and answers at once with the build, `building`; follow it with \
                `GET /v1/templates/{id}` (its `log`). Steps up to the first changed one are taken from \
                earlier builds' layers. What cannot be built (another `FROM`, an unknown instruction, \
                files not uploaded) is 400, before any VM starts. The build runs in a sandbox of the \
                account, billed as one.",
            params: vec![],
            body: Some(json_content(req.subschema_for::<BuildTemplate>().to_value())),
            responses: vec![("202", "The build, building.", template_resp.clone())],
            errors: Errors { body: true, credits: true, ..AUTH },
        },
        Op {
            method: "get",
            path: "/v1/templates",
            handler: get(server::list_templates),
            id: "listTemplates",
            summary: "List templates",
            description: "The account's builds and those an operator published, newest first.",
            params: vec![],
            body: None,
            responses: vec![("200", "Every build.", json_content(template_list))],
            errors: AUTH,
        },
        Op {
            method: "get",
            path: "/v1/templates/{id}",
            handler: get(server::get_template),
            id: "getTemplate",
            summary: "Get a template build",
            description: "A build by id (`tpl_…`), or the newest build of `name` or `name:tag`, with its log.",
            params: vec![id_param("template build (or name[:tag])")],
            body: None,
            responses: vec![("200", "The template object, with `log`.", template_resp.clone())],
            errors: Errors { not_found: true, ..AUTH },
        },
        Op {
            method: "delete",
            path: "/v1/templates/{id}",
            handler: delete(server::delete_template),
            id: "deleteTemplate",
            summary: "Delete a template build",
            description: "Sandboxes started from it live on; its layers stay while newer builds use them.",
            params: vec![id_param("template build")],
            body: None,
            responses: vec![("200", "The build, as it was.", template_resp)],
            errors: Errors { not_found: true, conflict: true, ..AUTH },
        },
        Op {
            method: "put",
            path: "/v1/templates/files/{sha256}",
            handler: put(server::upload_template_files),
            id: "uploadTemplateFiles",
            summary: "Upload a copy step's files",
            description: "The body is a tar (at most 64 MiB) whose SHA-256 is the path's: a copy step of a \
                build names it in `files` and unpacks it into its `dest`. Kept for the account.",
            params: vec![path_param(
                "sha256",
                "The tar's SHA-256, in hex.",
                json!({"type": "string"}),
            )],
            body: Some(json!({"application/x-tar": {"schema": {"type": "string", "format": "binary"}}})),
            responses: vec![("204", "Kept.", json!({}))],
            errors: Errors { body: true, ..AUTH },
        },
        Op {
            method: "post",
            path: "/v1/sandboxes/{id}/exec",
            handler: post(server::exec),
            id: "execCommand",
            summary: "Run a shell command",
            description: EXEC_DESCRIPTION,
            params: vec![
                id_param("sandbox"),
                json!({
                    "name": "Accept",
                    "in": "header",
                    "required": false,
                    "description": "`text/event-stream` asks for the streaming answer (like `\"stream\": true`).",
                    "schema": {"type": "string"},
                }),
            ],
            body: Some(json_content(req.subschema_for::<ExecParams>().to_value())),
            responses: vec![(
                "200",
                "The finished execution, or (streaming) its events.",
                json!({
                    "application/json": {"schema": execution.clone()},
                    "text/event-stream": {
                        "schema": {"type": "string", "description": "Server-sent events; see the operation's description."},
                        "x-sse-events": {
                            "start": execution.clone(),
                            "stdout": chunk.clone(),
                            "stderr": chunk,
                            "exit": execution.clone(),
                            "error": error,
                        },
                    },
                }),
            )],
            errors: Errors { body: true, ..ON_SANDBOX },
        },
        Op {
            method: "get",
            path: "/v1/sandboxes/{id}/executions",
            handler: get(server::list_executions),
            id: "listExecutions",
            summary: "List a sandbox's executions",
            description: "The sandbox's executions, newest first, running ones included (status \
                `running`), paged with `limit` (1..100) and `starting_after` (the previous page's \
                `next_cursor`). A deleted sandbox's are listed while they are kept.",
            params: {
                let mut p = vec![id_param("sandbox")];
                p.extend(query_params::<ListExecutions>(&mut req));
                p
            },
            body: None,
            responses: vec![(
                "200",
                "A page of executions.",
                json_content(execution_list.clone()),
            )],
            errors: Errors { not_found: true, ..AUTH },
        },
        Op {
            method: "get",
            path: "/v1/executions/{id}",
            handler: get(server::get_execution),
            id: "getExecution",
            summary: "Get an execution",
            description: "An execution object, later; `running` while its command runs.",
            params: vec![id_param("execution")],
            body: None,
            responses: vec![("200", "The execution object.", json_content(execution))],
            errors: Errors { not_found: true, ..AUTH },
        },
        Op {
            method: "put",
            path: "/v1/sandboxes/{id}/files",
            handler: put(server::write_file),
            id: "writeFile",
            summary: "Write a file",
            description: "`path` is relative to /workspace or absolute; parent directories are created; \
                the file belongs to the sandbox user. Content travels out of band (never through a shell), \
                so any bytes survive exactly (send binary content as `base64`). \
                Or send the file itself, streamed: `Content-Type: application/octet-stream`, \
                `path` in the query and a `Content-Length` (required; a chunked body is 400); \
                the server holds one piece of it at a time, and an upload cut short writes nothing.",
            params: {
                let mut p = vec![id_param("sandbox")];
                p.extend(
                    query_params::<FilesQuery>(&mut req)
                        .into_iter()
                        .filter(|q| q["name"] == "path"),
                );
                p
            },
            body: Some(json!({
                "application/json": {"schema": req.subschema_for::<WriteFile>().to_value()},
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
            })),
            responses: vec![(
                "200",
                "Written.",
                json_content(res.subschema_for::<FileWritten>().to_value()),
            )],
            errors: Errors { body: true, ..ON_SANDBOX },
        },
        Op {
            method: "get",
            path: "/v1/sandboxes/{id}/files",
            handler: get(server::get_files),
            id: "readOrListFiles",
            summary: "Read a file, or list a directory (`list=true`)",
            description: "Without `list`: reads `path` (required). Reading a non-UTF-8 file with `utf8` is 400 \
                (use `base64`); a file over the read limit (default 32 MiB) is 400. \
                With `list=true`: lists `path` (default /workspace), recursively with `recursive=true`; \
                entries are capped (default 10,000) and `truncated` says so. \
                With `Accept: application/octet-stream` and no `encoding`, the file itself is the \
                answer, streamed, with its `Content-Length` and its resolved path in `x-sandpit-path`.",
            params: {
                let mut p = vec![id_param("sandbox")];
                p.extend(query_params::<FilesQuery>(&mut req));
                p
            },
            body: None,
            responses: vec![(
                "200",
                "The file content (FileContent), or the listing (FileList) with `list=true`.",
                json!({
                    "application/json": {"schema": {"oneOf": [
                        res.subschema_for::<FileContent>().to_value(),
                        res.subschema_for::<FileList>().to_value(),
                    ]}},
                    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
                }),
            )],
            errors: ON_SANDBOX,
        },
        Op {
            method: "delete",
            path: "/v1/sandboxes/{id}/files",
            handler: delete(server::delete_file),
            id: "deleteFile",
            summary: "Delete a file or directory",
            description: "Deletes `path` (required); a non-empty directory needs `recursive=true`. \
                `list` and `encoding` do not apply.",
            params: {
                let mut p = vec![id_param("sandbox")];
                p.extend(query_params::<FilesQuery>(&mut req));
                p
            },
            body: None,
            responses: vec![(
                "200",
                "Deleted.",
                json_content(res.subschema_for::<FileDeleted>().to_value()),
            )],
            errors: ON_SANDBOX,
        },
        Op {
            method: "post",
            path: "/v1/sandboxes/{id}/ports",
            handler: post(server::expose_port),
            id: "exposePort",
            summary: "Expose a port",
            description: "Gives a URL for a port the sandbox listens on (localhost is enough); \
                asking again for the same port returns the same URL (and changes only whether it is \
                private). WebSocket upgrades pass through. Public by default; a private port is \
                served only to requests with the sandbox's `traffic_token` in the \
                `x-sandpit-traffic-token` header or with a signed URL (`signed_url` here, good for an \
                hour; `POST .../signed-url` for another expiry), and anything else gets 401 before it \
                reaches the sandbox.",
            params: vec![id_param("sandbox")],
            body: Some(json_content(req.subschema_for::<ExposePortBody>().to_value())),
            responses: vec![(
                "200",
                "The exposed port.",
                json_content(res.subschema_for::<Port>().to_value()),
            )],
            errors: Errors { body: true, ..ON_SANDBOX },
        },
        Op {
            method: "post",
            path: "/v1/sandboxes/{id}/ports/{port}/signed-url",
            handler: post(server::sign_preview_url),
            id: "signPreviewUrl",
            summary: "Sign a private port's URL",
            description: "A URL of a private port that works without the token until `expires_at` \
                (`expires_in_seconds`, default an hour, at most 7 days): for a browser, which cannot \
                send the header. Opening it leaves a cookie for that preview host until then, so \
                the page's links and assets load too. 404 when the port is not private.",
            params: vec![
                id_param("sandbox"),
                path_param(
                    "port",
                    "The private port.",
                    json!({"type": "integer", "minimum": 1, "maximum": 65535}),
                ),
            ],
            body: Some(json_content(req.subschema_for::<SignUrlBody>().to_value())),
            responses: vec![(
                "200",
                "The signed URL.",
                json_content(res.subschema_for::<SignedUrl>().to_value()),
            )],
            errors: Errors { body: true, ..ON_SANDBOX },
        },
        Op {
            method: "get",
            path: "/v1/sandboxes/{id}/ports",
            handler: get(server::list_ports),
            id: "listPorts",
            summary: "List exposed ports",
            description: "Every exposed port of the sandbox.",
            params: vec![id_param("sandbox")],
            body: None,
            responses: vec![(
                "200",
                "The exposed ports.",
                json_content(port_list.clone()),
            )],
            errors: Errors { not_found: true, ..AUTH },
        },
        Op {
            method: "delete",
            path: "/v1/sandboxes/{id}/ports/{port}",
            handler: delete(server::close_port),
            id: "closePort",
            summary: "Close an exposed port",
            description: "Its URL stops answering. Always 200 with `{\"port\": N, \"closed\": true}` (never 204), \
                so every success has a JSON body.",
            params: vec![
                id_param("sandbox"),
                path_param(
                    "port",
                    "The exposed port.",
                    json!({"type": "integer", "minimum": 1, "maximum": 65535}),
                ),
            ],
            body: None,
            responses: vec![(
                "200",
                "Closed.",
                json_content(res.subschema_for::<PortClosed>().to_value()),
            )],
            errors: ON_SANDBOX,
        },
        Op {
            method: "post",
            path: "/v1/sandboxes/{id}/pty/tokens",
            handler: post(terminal::mint_token),
            id: "createTerminalToken",
            summary: "Make a one-use terminal token",
            description: "A token that opens this sandbox's terminal once, within a minute, without \
                the key's header: for a browser, whose WebSocket cannot send one. Put it in the \
                terminal's URL as `?token=` (`url` is that path).",
            params: vec![id_param("sandbox")],
            body: None,
            responses: vec![(
                "201",
                "The token.",
                json_content(res.subschema_for::<TerminalToken>().to_value()),
            )],
            errors: ON_SANDBOX,
        },
        Op {
            method: "get",
            path: "/v1/sandboxes/{id}/pty",
            handler: get(terminal::open),
            id: "openTerminal",
            summary: "Open a terminal (WebSocket)",
            description: TERMINAL_DESCRIPTION,
            params: {
                let mut p = vec![id_param("sandbox")];
                p.extend(query_params::<TerminalQuery>(&mut req));
                p
            },
            body: None,
            responses: vec![(
                "101",
                "Switching to the WebSocket protocol; the framing is described above.",
                Value::Null,
            )],
            errors: ON_SANDBOX,
        },
    ];
    // Events and webhooks. Their lists' schemas are made here, after every
    // other, so the other lists keep their generated names.
    let event_list = res.subschema_for::<List<Event>>().to_value();
    let webhook_list = res.subschema_for::<List<Webhook>>().to_value();
    let delivery_list = res.subschema_for::<List<WebhookDelivery>>().to_value();
    let (event_list_ref, webhook_list_ref, delivery_list_ref) = (
        event_list.clone(),
        webhook_list.clone(),
        delivery_list.clone(),
    );
    ops.extend([
        Op {
            method: "get",
            path: "/v1/events",
            handler: get(server::list_events),
            id: "listEvents",
            summary: "List the account's events",
            description: EVENTS_DESCRIPTION,
            params: query_params::<ListEvents>(&mut req),
            body: None,
            responses: vec![(
                "200",
                "A page of events, oldest first; `next_cursor` is always set once any event was \
                 seen (`after` itself when nothing came), so poll with it.",
                json_content(event_list.clone()),
            )],
            errors: Errors {
                not_found: true,
                ..AUTH
            },
        },
        Op {
            method: "get",
            path: "/v1/sandboxes/{id}/events",
            handler: get(server::list_sandbox_events),
            id: "listSandboxEvents",
            summary: "List a sandbox's events",
            description: "The sandbox's events, oldest first, as `GET /v1/events?sandbox_id=` \
                lists them: paged with `after` (a cursor) and `limit` (1..500, default 100). \
                A sandbox of another account is 404.",
            params: {
                let mut p = vec![id_param("sandbox")];
                p.extend(query_params::<SandboxEventsQuery>(&mut req));
                p
            },
            body: None,
            responses: vec![(
                "200",
                "A page of the sandbox's events.",
                json_content(event_list),
            )],
            errors: Errors {
                not_found: true,
                ..AUTH
            },
        },
        Op {
            method: "post",
            path: "/v1/webhooks",
            handler: post(server::create_webhook),
            id: "createWebhook",
            summary: "Register a webhook",
            description:
                "From now on the account's events of the types in `events` (absent, empty \
                or `[\"*\"]`: all) are POSTed to `url` as JSON (the event object), signed as \
                Standard Webhooks says: headers `webhook-id` (the event's id: drop a repeat), \
                `webhook-timestamp` and `webhook-signature` (`v1,` + base64 of the HMAC-SHA256, \
                under the secret's bytes after `whsec_`, of `id.timestamp.body`). A delivery \
                that gets no 2xx answer is retried with backoff for a day. The answer carries \
                the webhook's `secret`, this once: it is never shown again. An event type not \
                in the list, a URL that is not http(s) or whose address the operator does \
                not allow (by default no loopback, link-local or private range) is 400, \
                saying which.",
            params: vec![],
            body: Some(json_content(
                req.subschema_for::<CreateWebhook>().to_value(),
            )),
            responses: vec![(
                "201",
                "The webhook, with its secret (shown once).",
                json_content(webhook.clone()),
            )],
            errors: Errors { body: true, ..AUTH },
        },
        Op {
            method: "get",
            path: "/v1/webhooks",
            handler: get(server::list_webhooks),
            id: "listWebhooks",
            summary: "List webhooks",
            description: "The account's webhooks, with their deliveries counted by state; never \
                their secrets.",
            params: vec![],
            body: None,
            responses: vec![(
                "200",
                "Every webhook, without its secret.",
                json_content(webhook_list.clone()),
            )],
            errors: AUTH,
        },
        Op {
            method: "get",
            path: "/v1/webhooks/{id}",
            handler: get(server::get_webhook),
            id: "getWebhook",
            summary: "Get a webhook",
            description: "The webhook object (`wh_…`), with its deliveries counted by state; \
                without its secret.",
            params: vec![id_param("webhook")],
            body: None,
            responses: vec![(
                "200",
                "The webhook, without its secret.",
                json_content(webhook.clone()),
            )],
            errors: Errors {
                not_found: true,
                ..AUTH
            },
        },
        Op {
            method: "delete",
            path: "/v1/webhooks/{id}",
            handler: delete(server::delete_webhook),
            id: "deleteWebhook",
            summary: "Delete a webhook",
            description: "Stops its deliveries (those still pending are dropped) and answers \
                with it as it was, without its secret. From then on it is 404.",
            params: vec![id_param("webhook")],
            body: None,
            responses: vec![(
                "200",
                "The deleted webhook, without its secret.",
                json_content(webhook),
            )],
            errors: Errors {
                not_found: true,
                ..AUTH
            },
        },
        Op {
            method: "get",
            path: "/v1/webhooks/{id}/deliveries",
            handler: get(server::list_deliveries),
            id: "listWebhookDeliveries",
            summary: "List a webhook's deliveries",
            description: "The webhook's deliveries, newest first, each with its status \
                (`pending`, `delivered`, `failed`) and its attempts (when, the receiver's \
                status, the error, how long), paged with `limit` (1..100, default 20) and \
                `starting_after` (the previous page's `next_cursor`).",
            params: {
                let mut p = vec![id_param("webhook")];
                p.extend(query_params::<ListDeliveries>(&mut req));
                p
            },
            body: None,
            responses: vec![(
                "200",
                "A page of deliveries.",
                json_content(delivery_list.clone()),
            )],
            errors: Errors {
                not_found: true,
                ..AUTH
            },
        },
        Op {
            method: "post",
            path: "/v1/webhooks/{id}/deliveries/{delivery_id}/redeliver",
            handler: post(server::redeliver),
            id: "redeliverWebhookDelivery",
            summary: "Send a delivery again",
            description: "POSTs the delivery's event to the webhook again, now, signed afresh \
                (its earlier attempts are kept): for one that failed, or to replay one that \
                was delivered. Answers with the delivery and the new attempt.",
            params: vec![
                id_param("webhook"),
                path_param(
                    "delivery_id",
                    "The delivery's id: its event's (`evt_…`).",
                    json!({"type": "string"}),
                ),
            ],
            body: None,
            responses: vec![(
                "200",
                "The delivery, with its attempts.",
                json_content(delivery),
            )],
            errors: Errors {
                not_found: true,
                ..AUTH
            },
        },
    ]);
    // The terminal's messages, described by their schemas.
    let _ = req.subschema_for::<TerminalControl>();
    let _ = res.subschema_for::<TerminalEvent>();

    let mut paths = Map::new();
    for op in &ops {
        let item = paths.entry(op.path.to_owned()).or_insert_with(|| json!({}));
        item[op.method] = operation(op);
    }
    let routes = ops.into_iter().map(|op| (op.path, op.handler)).collect();

    let mut schemas = res.take_definitions(true);
    for (name, schema) in req.take_definitions(true) {
        match schemas.get(&name) {
            Some(existing) if *existing != schema => panic!(
                "schema {name} differs between request and response contracts; give one a distinct name"
            ),
            Some(_) => {}
            None => {
                schemas.insert(name, schema);
            }
        }
    }

    let mut doc = json!({
        "openapi": "3.1.0",
        "info": {
            "title": "Sandpit REST API",
            "version": env!("CARGO_PKG_VERSION"),
            "description": DESCRIPTION,
            "license": {"name": "Apache-2.0", "identifier": "Apache-2.0"},
        },
        "jsonSchemaDialect": "https://json-schema.org/draft/2020-12/schema",
        "security": [{"bearerAuth": []}, {"apiKeyAuth": []}],
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {
                "bearerAuth": {"type": "http", "scheme": "bearer", "description": "`Authorization: Bearer <key>`"},
                "apiKeyAuth": {"type": "apiKey", "in": "header", "name": "x-api-key", "description": "`x-api-key: <key>`"},
            },
            "headers": {
                "RequestId": {
                    "description": "This request's id (`req_...`), also in error bodies as `request_id`.",
                    "schema": {"type": "string"},
                },
                "RetryAfter": {
                    "description": "Seconds after which a retry may succeed.",
                    "schema": {"type": "integer", "minimum": 0},
                },
            },
            "responses": {
                "InvalidRequest": error_response("`invalid_request`: the body, query or path was not accepted; also 405 for a method a path does not have.", false),
                "Unauthorized": error_response("`unauthorized`: no key, an unknown or revoked key, or a key in the URL.", false),
                "InsufficientCredits": error_response("`insufficient_credits`: the account cannot pay for what was asked.", false),
                "Forbidden": error_response("`forbidden`: the key is valid but not allowed to do this.", false),
                "NotFound": error_response("`not_found`: no such resource (or it belongs to another account), or no such route.", false),
                "Conflict": error_response("`conflict`: the sandbox's state does not allow this, or an Idempotency-Key clash.", false),
                "PayloadTooLarge": error_response("`invalid_request` with status 413: the body is over the size limit, stated in the message.", false),
                "RateLimited": error_response("`rate_limited`: too many requests or too many live sandboxes.", true),
                "InternalError": error_response("`internal_error`: a failure of the platform.", false),
                "ServiceUnavailable": error_response("`service_unavailable`: the host cannot serve now; safe to retry.", true),
            },
        },
    });
    rename_schema(&mut doc, &sandbox_list_ref, "SandboxList");
    rename_schema(&mut doc, &port_list, "PortList");
    rename_schema(&mut doc, &execution_list, "ExecutionList");
    rename_schema(&mut doc, &snapshot_list_ref, "SnapshotList");
    rename_schema(&mut doc, &event_list_ref, "EventList");
    rename_schema(&mut doc, &webhook_list_ref, "WebhookList");
    rename_schema(&mut doc, &delivery_list_ref, "WebhookDeliveryList");
    sort_keys(&mut doc);
    (routes, doc)
}

/// Object keys in sorted order at every level, so the document's text is the
/// same whether or not some other crate turns on serde_json's `preserve_order`.
fn sort_keys(v: &mut Value) {
    match v {
        Value::Object(m) => {
            let mut entries: Vec<(String, Value)> = std::mem::take(m).into_iter().collect();
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            for (k, mut v) in entries {
                sort_keys(&mut v);
                m.insert(k, v);
            }
        }
        Value::Array(a) => a.iter_mut().for_each(sort_keys),
        _ => {}
    }
}
