//! The rmcp handler: the tools over an `Arc<dyn SandboxApi>` (the spec's
//! twelve, then snapshots, fork and restore).
//!
//! Every tool does the same three things: find out who is calling
//! ([`CallerSource`]), parse its arguments ([`crate::args`]), call the core,
//! and shape the answer. Successes carry the core's object as
//! `structuredContent` and the same JSON as a text block; failures an agent can
//! act on are `isError` results whose text says what to do next; only
//! `internal_error` (a bug or a platform failure) becomes a JSON-RPC error.

use crate::descriptions::*;
use crate::{args::*, schema};
use rmcp::{
    handler::server::router::tool::ToolRouter,
    model::{
        CallToolResult, ContentBlock, Implementation, JsonObject, MetaObject,
        NotificationMetaObject, ProgressNotificationParam, ProgressToken, ProtocolVersion,
        ServerCapabilities, ServerConfig,
    },
    service::RequestContext,
    tool, tool_handler, tool_router, ErrorData, RoleServer, ServerHandler,
};
use sandpit_core::{
    Caller, CoreError, Encoding, ErrorType, ExecEvent, ExecParams, Execution, ExecutionStatus,
    FileContent, FileList, FileWritten, Fork, Limits, List, Port, Sandbox, SandboxApi, ServiceInfo,
    Snapshot, Template, Usage, Volume,
};
use serde::{de::DeserializeOwned, Serialize};
use std::{borrow::Cow, sync::Arc};

/// The MCP revisions this server speaks, oldest first.
///
/// `2025-06-18` and `2025-11-25` use the `initialize` handshake (the answer
/// echoes the client's version when it is one of these, and is `2025-11-25`
/// otherwise); `2026-07-28` has no handshake: `server/discover` advertises
/// this list and each request names its version in `_meta`, which rmcp checks
/// against this list.
pub const SUPPORTED_PROTOCOL_VERSIONS: &[ProtocolVersion] = &[
    ProtocolVersion::V_2025_06_18,
    ProtocolVersion::V_2025_11_25,
    ProtocolVersion::V_2026_07_28,
];

/// Who a tool call acts for.
#[derive(Debug, Clone)]
pub enum CallerSource {
    /// Every call acts for this account: stdio, where whoever started the
    /// process is the user (the local account, or the account of the key a
    /// remote `SandboxApi` client was built with).
    Fixed(Caller),
    /// Each call carries its own API key in the HTTP request that brought it
    /// (`Authorization: Bearer <key>` or `x-api-key: <key>`; never the URL),
    /// resolved with [`SandboxApi::authenticate`]. rmcp's Streamable HTTP
    /// server puts the request's `http::request::Parts` into the request
    /// context's extensions, which is where the key is read from.
    RequestApiKey,
}

/// The MCP server: the tools over one [`SandboxApi`].
#[derive(Clone)]
pub struct SandpitMcp {
    api: Arc<dyn SandboxApi>,
    callers: CallerSource,
    tool_router: ToolRouter<SandpitMcp>,
}

/// Bounds of the tools' inputs that the service's limits set:
/// `(tool, property, keyword, value)`.
fn limit_bounds(l: &Limits) -> [(&'static str, &'static str, &'static str, u64); 7] {
    [
        (
            "create_sandbox",
            "timeout_minutes",
            "maximum",
            u64::from(l.max_timeout_minutes),
        ),
        (
            "fork_sandbox",
            "timeout_minutes",
            "maximum",
            u64::from(l.max_timeout_minutes),
        ),
        (
            "extend_sandbox",
            "additional_minutes",
            "maximum",
            u64::from(l.max_lifetime_minutes),
        ),
        (
            "run_command",
            "timeout_ms",
            "minimum",
            l.exec_min_timeout_ms,
        ),
        (
            "run_command",
            "timeout_ms",
            "maximum",
            l.exec_max_timeout_ms,
        ),
        // Characters, not bytes: a bound no command within the limit passes.
        ("run_command", "command", "maxLength", l.max_command_bytes),
        ("run_command", "cwd", "maxLength", 4095),
    ]
}

impl std::fmt::Debug for SandpitMcp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SandpitMcp")
            .field("callers", &self.callers)
            .finish_non_exhaustive()
    }
}

/// Parse a tool's arguments; a failure is an `isError` result that quotes
/// serde's reason (which names the field) and points at the schema.
fn parse<T: DeserializeOwned>(tool: &str, args: JsonObject) -> Result<T, CallToolResult> {
    serde_json::from_value(serde_json::Value::Object(args)).map_err(|e| {
        tool_error(format!(
            "invalid_request: the arguments of {tool} were not accepted: {e}. \
             Fix them (see the tool's input schema) and call it again."
        ))
    })
}

fn tool_error(message: String) -> CallToolResult {
    CallToolResult::error(vec![ContentBlock::text(message)])
}

/// What to do next, per error type: appended to the core's message.
fn next_step(e: &CoreError) -> String {
    let retry = |default: &str| match e.retry_after {
        Some(s) => format!("Retry in {s} s."),
        None => default.to_string(),
    };
    match e.kind {
        ErrorType::InvalidRequest => {
            "Fix the argument and call the tool again (its input schema gives the ranges)."
                .to_string()
        }
        ErrorType::Unauthorized => "Configure your MCP client to send the key on every request: \
             `Authorization: Bearer <key>` or `x-api-key: <key>` (never in the URL). \
             get_service_info works without a key."
            .to_string(),
        ErrorType::InsufficientCredits => "get_usage shows the remaining credit; destroy \
             sandboxes you no longer need (list_sandboxes finds them), or ask for a smaller size \
             or a shorter timeout."
            .to_string(),
        ErrorType::Forbidden => {
            "This key may not do that; use a key of an account that may.".to_string()
        }
        ErrorType::NotFound => "Check the id: list_sandboxes shows this account's sandboxes \
             (include_deleted=true also shows ended ones) and list_snapshots its snapshots; a \
             sandbox that expired or was destroyed is gone, so create a new one."
            .to_string(),
        ErrorType::Conflict => "get_sandbox shows the sandbox's current status; a sandbox that \
             is deleting or deleted cannot be used, so create a new one."
            .to_string(),
        ErrorType::RateLimited => format!(
            "{} Too many live sandboxes also count: destroy the ones you no longer need \
             (list_sandboxes finds them).",
            retry("Wait a little and retry.")
        ),
        ErrorType::ServiceUnavailable => {
            format!("{} It is safe to retry.", retry("Retry shortly."))
        }
        ErrorType::InternalError => String::new(),
    }
}

/// A core failure as the tool's answer: `isError` with the type, the core's
/// message and the next step; `internal_error` as a JSON-RPC error.
fn failure(e: CoreError) -> Result<CallToolResult, ErrorData> {
    sandpit_core::metrics::record_error(e.kind);
    if e.kind == ErrorType::InternalError {
        return Err(ErrorData::internal_error(e.message, None));
    }
    let mut message = format!("{}: {}", e.kind, e.message);
    if !message.ends_with('.') {
        message.push('.');
    }
    Ok(tool_error(format!("{message} {}", next_step(&e))))
}

fn success<T: Serialize>(value: &T) -> Result<CallToolResult, ErrorData> {
    let value = serde_json::to_value(value)
        .map_err(|e| ErrorData::internal_error(format!("serializing the result: {e}"), None))?;
    Ok(CallToolResult::structured(value))
}

fn answer<T: Serialize>(r: Result<T, CoreError>) -> Result<CallToolResult, ErrorData> {
    match r {
        Ok(v) => success(&v),
        Err(e) => failure(e),
    }
}

/// An execution as `run_command`'s answer: a command that ran to its end is a
/// success whatever its exit code; one that timed out, was cancelled or could
/// not run is an `isError` result that still carries the execution (with the
/// output it produced) and says what to do.
fn execution_answer(x: Execution) -> Result<CallToolResult, ErrorData> {
    let hint = match x.status {
        ExecutionStatus::Completed => return success(&x),
        ExecutionStatus::TimedOut => format!(
            "The command ran past its timeout and was killed after {} ms (the output it \
             produced is above). Raise timeout_ms (up to its schema's maximum), or start long jobs in the \
             background with `&`, redirect their output to a file and poll it.",
            x.duration_ms
        ),
        ExecutionStatus::Cancelled => {
            "The command was cancelled before it finished; run it again if it is still needed."
                .to_string()
        }
        // `run_command` answers at the end; an answer still running could
        // only be a platform fault.
        ExecutionStatus::Failed | ExecutionStatus::Running => "The command could not be run to its end by the platform; \
             get_sandbox shows whether the sandbox is still running. Retry, or create a new \
             sandbox if it is gone."
            .to_string(),
    };
    let mut result = success(&x)?;
    result.is_error = Some(true);
    result.content.push(ContentBlock::text(hint));
    Ok(result)
}

impl SandpitMcp {
    pub fn new(api: Arc<dyn SandboxApi>, callers: CallerSource) -> Self {
        SandpitMcp {
            api,
            callers,
            tool_router: Self::tool_router(),
        }
        .with_limits(&Limits::default())
    }

    /// The tools as this service is configured: their input schemas carry
    /// its limits (a server with `max_timeout_minutes = 60` advertises 60,
    /// not the default), so a client validates against what will be
    /// enforced.
    pub fn with_limits(mut self, limits: &Limits) -> Self {
        for (tool, property, keyword, value) in limit_bounds(limits) {
            let Some(route) = self.tool_router.map.get_mut(tool) else {
                continue;
            };
            let mut schema = route.attr.input_schema.as_ref().clone();
            if let Some(serde_json::Value::Object(p)) = schema
                .get_mut("properties")
                .and_then(|ps| ps.get_mut(property))
            {
                p.insert(keyword.to_string(), value.into());
            }
            route.attr.input_schema = Arc::new(schema);
        }
        self
    }

    /// Who this call acts for, or the `isError` answer saying how to authenticate.
    async fn caller(&self, ctx: &RequestContext<RoleServer>) -> Result<Caller, CoreError> {
        match &self.callers {
            CallerSource::Fixed(caller) => Ok(caller.clone()),
            CallerSource::RequestApiKey => {
                let parts = ctx
                    .extensions
                    .get::<http::request::Parts>()
                    .ok_or_else(CoreError::unauthorized)?;
                // The same reader as REST's: the same key, or the same refusal.
                let key = sandpit_core::api::api_key_from_headers(
                    parts
                        .headers
                        .get(http::header::AUTHORIZATION)
                        .map(|v| v.as_bytes()),
                    parts.headers.get("x-api-key").map(|v| v.as_bytes()),
                )?;
                self.api.authenticate(&key).await
            }
        }
    }

    /// Authenticate, then parse: an anonymous caller always learns how to
    /// authenticate first, whatever its arguments.
    async fn prepare<T: DeserializeOwned>(
        &self,
        tool: &str,
        ctx: &RequestContext<RoleServer>,
        args: JsonObject,
    ) -> Result<(Caller, T), Result<CallToolResult, ErrorData>> {
        let caller = self.caller(ctx).await.map_err(failure)?;
        let args = parse(tool, args).map_err(Ok)?;
        Ok((caller, args))
    }

    /// Run a command, streaming its output as progress notifications.
    async fn exec_with_progress(
        &self,
        caller: &Caller,
        id: &str,
        params: ExecParams,
        token: ProgressToken,
        ctx: &RequestContext<RoleServer>,
    ) -> Option<Result<Execution, CoreError>> {
        let mut stream = match self.api.exec_stream(caller, id, params).await {
            Ok(s) => s,
            Err(e) => return Some(Err(e)),
        };
        let mut bytes = 0u64;
        loop {
            let event = tokio::select! {
                event = stream.next() => event,
                // Dropping the stream cancels the command.
                _ = ctx.ct.cancelled() => return None,
            };
            let (which, chunk) = match event {
                Some(ExecEvent::Started(_)) => continue,
                Some(ExecEvent::Stdout(s)) => ("stdout", s),
                Some(ExecEvent::Stderr(s)) => ("stderr", s),
                Some(ExecEvent::Exit(x)) => return Some(Ok(x)),
                Some(ExecEvent::Error(e)) => return Some(Err(e)),
                None => {
                    return Some(Err(CoreError::internal(
                        "the command's output stream ended without an exit event",
                    )));
                }
            };
            if chunk.is_empty() {
                continue;
            }
            bytes += chunk.len() as u64;
            let mut meta = MetaObject::new();
            meta.insert("sandpit/stream".into(), which.into());
            let mut progress =
                ProgressNotificationParam::new(token.clone(), bytes as f64).with_message(chunk);
            progress.meta = Some(NotificationMetaObject(meta));
            if let Err(e) = ctx.peer.notify_progress(progress).await {
                tracing::debug!(error = %e, "progress notification not delivered");
            }
        }
    }
}

/// The answer to a `run_command` whose request the client cancelled (the
/// client will not read it, but every request gets an answer).
fn cancelled() -> CallToolResult {
    tool_error(
        "cancelled: the request was cancelled by the client, so the command was cancelled."
            .to_string(),
    )
}

#[tool_router]
impl SandpitMcp {
    #[tool(
        name = "create_sandbox",
        description = D_CREATE,
        input_schema = schema::input::<CreateSandboxArgs>(),
        output_schema = schema::output::<Sandbox>(),
        annotations(
            title = "Create a sandbox",
            read_only_hint = false,
            destructive_hint = false,
            idempotent_hint = false,
            open_world_hint = false
        )
    )]
    async fn create_sandbox(
        &self,
        ctx: RequestContext<RoleServer>,
        args: JsonObject,
    ) -> Result<CallToolResult, ErrorData> {
        let (caller, a) = match self
            .prepare::<CreateSandboxArgs>("create_sandbox", &ctx, args)
            .await
        {
            Ok(v) => v,
            Err(r) => return r,
        };
        answer(
            self.api
                .create_sandbox(&caller, a.into(), None)
                .await
                .map(|(sandbox, _replayed)| sandbox),
        )
    }

    #[tool(
        name = "run_command",
        description = D_RUN,
        input_schema = schema::input::<RunCommandArgs>(),
        output_schema = schema::output::<Execution>(),
        annotations(
            title = "Run a shell command",
            read_only_hint = false,
            destructive_hint = true,
            idempotent_hint = false,
            open_world_hint = true
        )
    )]
    async fn run_command(
        &self,
        ctx: RequestContext<RoleServer>,
        args: JsonObject,
    ) -> Result<CallToolResult, ErrorData> {
        let (caller, a) = match self
            .prepare::<RunCommandArgs>("run_command", &ctx, args)
            .await
        {
            Ok(v) => v,
            Err(r) => return r,
        };
        let (id, params) = a.into_parts();
        let result = match ctx.meta.get_progress_token() {
            Some(token) => {
                self.exec_with_progress(&caller, &id, params, token, &ctx)
                    .await
            }
            // Dropping the `exec` future cancels the command.
            None => tokio::select! {
                r = self.api.exec(&caller, &id, params) => Some(r),
                _ = ctx.ct.cancelled() => None,
            },
        };
        match result {
            Some(Ok(x)) => execution_answer(x),
            Some(Err(e)) => failure(e),
            None => Ok(cancelled()),
        }
    }

    #[tool(
        name = "write_file",
        description = D_WRITE,
        input_schema = schema::input::<WriteFileArgs>(),
        output_schema = schema::output::<FileWritten>(),
        annotations(
            title = "Write a file",
            read_only_hint = false,
            destructive_hint = true,
            idempotent_hint = true,
            open_world_hint = false
        )
    )]
    async fn write_file(
        &self,
        ctx: RequestContext<RoleServer>,
        args: JsonObject,
    ) -> Result<CallToolResult, ErrorData> {
        let (caller, a) = match self
            .prepare::<WriteFileArgs>("write_file", &ctx, args)
            .await
        {
            Ok(v) => v,
            Err(r) => return r,
        };
        let (id, req) = a.into_parts();
        answer(self.api.write_file(&caller, &id, req).await)
    }

    #[tool(
        name = "read_file",
        description = D_READ,
        input_schema = schema::input::<ReadFileArgs>(),
        output_schema = schema::output::<FileContent>(),
        annotations(
            title = "Read a file",
            read_only_hint = true,
            destructive_hint = false,
            idempotent_hint = true,
            open_world_hint = false
        )
    )]
    async fn read_file(
        &self,
        ctx: RequestContext<RoleServer>,
        args: JsonObject,
    ) -> Result<CallToolResult, ErrorData> {
        let (caller, a) = match self.prepare::<ReadFileArgs>("read_file", &ctx, args).await {
            Ok(v) => v,
            Err(r) => return r,
        };
        let encoding = a.encoding.unwrap_or(Encoding::Utf8);
        answer(
            self.api
                .read_file(&caller, &a.sandbox_id, &a.path, encoding)
                .await,
        )
    }

    #[tool(
        name = "list_files",
        description = D_LIST,
        input_schema = schema::input::<ListFilesArgs>(),
        output_schema = schema::output::<FileList>(),
        annotations(
            title = "List files",
            read_only_hint = true,
            destructive_hint = false,
            idempotent_hint = true,
            open_world_hint = false
        )
    )]
    async fn list_files(
        &self,
        ctx: RequestContext<RoleServer>,
        args: JsonObject,
    ) -> Result<CallToolResult, ErrorData> {
        let (caller, a) = match self
            .prepare::<ListFilesArgs>("list_files", &ctx, args)
            .await
        {
            Ok(v) => v,
            Err(r) => return r,
        };
        answer(
            self.api
                .list_files(
                    &caller,
                    &a.sandbox_id,
                    a.path.as_deref(),
                    a.recursive.unwrap_or(true),
                )
                .await,
        )
    }

    #[tool(
        name = "expose_port",
        description = D_EXPOSE,
        input_schema = schema::input::<ExposePortArgs>(),
        output_schema = schema::output::<Port>(),
        annotations(
            title = "Expose a port on a public URL",
            read_only_hint = false,
            destructive_hint = false,
            idempotent_hint = true,
            open_world_hint = true
        )
    )]
    async fn expose_port(
        &self,
        ctx: RequestContext<RoleServer>,
        args: JsonObject,
    ) -> Result<CallToolResult, ErrorData> {
        let (caller, a) = match self
            .prepare::<ExposePortArgs>("expose_port", &ctx, args)
            .await
        {
            Ok(v) => v,
            Err(r) => return r,
        };
        answer(
            self.api
                .expose_port(&caller, &a.sandbox_id, a.port, a.private)
                .await,
        )
    }

    #[tool(
        name = "get_sandbox",
        description = D_GET,
        input_schema = schema::input::<SandboxIdArgs>(),
        output_schema = schema::output::<Sandbox>(),
        annotations(
            title = "Get a sandbox",
            read_only_hint = true,
            destructive_hint = false,
            idempotent_hint = true,
            open_world_hint = false
        )
    )]
    async fn get_sandbox(
        &self,
        ctx: RequestContext<RoleServer>,
        args: JsonObject,
    ) -> Result<CallToolResult, ErrorData> {
        let (caller, a) = match self
            .prepare::<SandboxIdArgs>("get_sandbox", &ctx, args)
            .await
        {
            Ok(v) => v,
            Err(r) => return r,
        };
        answer(self.api.get_sandbox(&caller, &a.sandbox_id).await)
    }

    #[tool(
        name = "list_sandboxes",
        description = D_LIST_SANDBOXES,
        input_schema = schema::input::<ListSandboxesArgs>(),
        output_schema = schema::output::<List<Sandbox>>(),
        annotations(
            title = "List sandboxes",
            read_only_hint = true,
            destructive_hint = false,
            idempotent_hint = true,
            open_world_hint = false
        )
    )]
    async fn list_sandboxes(
        &self,
        ctx: RequestContext<RoleServer>,
        args: JsonObject,
    ) -> Result<CallToolResult, ErrorData> {
        let (caller, a) = match self
            .prepare::<ListSandboxesArgs>("list_sandboxes", &ctx, args)
            .await
        {
            Ok(v) => v,
            Err(r) => return r,
        };
        answer(self.api.list_sandboxes(&caller, a.into()).await)
    }

    #[tool(
        name = "extend_sandbox",
        description = D_EXTEND,
        input_schema = schema::input::<ExtendSandboxArgs>(),
        output_schema = schema::output::<Sandbox>(),
        annotations(
            title = "Extend a sandbox's lifetime",
            read_only_hint = false,
            destructive_hint = false,
            idempotent_hint = false,
            open_world_hint = false
        )
    )]
    async fn extend_sandbox(
        &self,
        ctx: RequestContext<RoleServer>,
        args: JsonObject,
    ) -> Result<CallToolResult, ErrorData> {
        let (caller, a) = match self
            .prepare::<ExtendSandboxArgs>("extend_sandbox", &ctx, args)
            .await
        {
            Ok(v) => v,
            Err(r) => return r,
        };
        answer(
            self.api
                .extend_sandbox(&caller, &a.sandbox_id, a.additional_minutes)
                .await,
        )
    }

    #[tool(
        name = "update_network",
        description = D_UPDATE_NETWORK,
        input_schema = schema::input::<UpdateNetworkArgs>(),
        output_schema = schema::output::<Sandbox>(),
        annotations(
            title = "Change what a sandbox may reach",
            read_only_hint = false,
            destructive_hint = false,
            idempotent_hint = true,
            open_world_hint = false
        )
    )]
    async fn update_network(
        &self,
        ctx: RequestContext<RoleServer>,
        args: JsonObject,
    ) -> Result<CallToolResult, ErrorData> {
        let (caller, a) = match self
            .prepare::<UpdateNetworkArgs>("update_network", &ctx, args)
            .await
        {
            Ok(v) => v,
            Err(r) => return r,
        };
        let lists = sandpit_core::NetworkLists {
            allow_out: a.allow_out,
            deny_out: a.deny_out,
        };
        answer(
            self.api
                .update_network(&caller, &a.sandbox_id, lists, None)
                .await,
        )
    }

    #[tool(
        name = "destroy_sandbox",
        description = D_DESTROY,
        input_schema = schema::input::<SandboxIdArgs>(),
        output_schema = schema::output::<Sandbox>(),
        annotations(
            title = "Destroy a sandbox",
            read_only_hint = false,
            destructive_hint = true,
            idempotent_hint = true,
            open_world_hint = false
        )
    )]
    async fn destroy_sandbox(
        &self,
        ctx: RequestContext<RoleServer>,
        args: JsonObject,
    ) -> Result<CallToolResult, ErrorData> {
        let (caller, a) = match self
            .prepare::<SandboxIdArgs>("destroy_sandbox", &ctx, args)
            .await
        {
            Ok(v) => v,
            Err(r) => return r,
        };
        answer(self.api.destroy_sandbox(&caller, &a.sandbox_id).await)
    }

    #[tool(
        name = "snapshot_sandbox",
        description = D_SNAPSHOT,
        input_schema = schema::input::<SnapshotSandboxArgs>(),
        output_schema = schema::output::<Snapshot>(),
        annotations(
            title = "Snapshot a sandbox",
            read_only_hint = false,
            destructive_hint = false,
            idempotent_hint = false,
            open_world_hint = false
        )
    )]
    async fn snapshot_sandbox(
        &self,
        ctx: RequestContext<RoleServer>,
        args: JsonObject,
    ) -> Result<CallToolResult, ErrorData> {
        let (caller, a) = match self
            .prepare::<SnapshotSandboxArgs>("snapshot_sandbox", &ctx, args)
            .await
        {
            Ok(v) => v,
            Err(r) => return r,
        };
        let (id, req) = a.into_parts();
        answer(
            self.api
                .snapshot_sandbox(&caller, &id, req, None)
                .await
                .map(|(snapshot, _replayed)| snapshot),
        )
    }

    #[tool(
        name = "fork_sandbox",
        description = D_FORK,
        input_schema = schema::input::<ForkSandboxArgs>(),
        output_schema = schema::output::<Fork>(),
        annotations(
            title = "Fork a sandbox into copies",
            read_only_hint = false,
            destructive_hint = false,
            idempotent_hint = false,
            open_world_hint = false
        )
    )]
    async fn fork_sandbox(
        &self,
        ctx: RequestContext<RoleServer>,
        args: JsonObject,
    ) -> Result<CallToolResult, ErrorData> {
        let (caller, a) = match self
            .prepare::<ForkSandboxArgs>("fork_sandbox", &ctx, args)
            .await
        {
            Ok(v) => v,
            Err(r) => return r,
        };
        let (id, req) = a.into_parts();
        answer(self.api.fork_sandbox(&caller, &id, req).await)
    }

    #[tool(
        name = "restore_sandbox",
        description = D_RESTORE,
        input_schema = schema::input::<RestoreSandboxArgs>(),
        output_schema = schema::output::<Sandbox>(),
        annotations(
            title = "Roll a sandbox back to a snapshot",
            read_only_hint = false,
            destructive_hint = true,
            idempotent_hint = true,
            open_world_hint = false
        )
    )]
    async fn restore_sandbox(
        &self,
        ctx: RequestContext<RoleServer>,
        args: JsonObject,
    ) -> Result<CallToolResult, ErrorData> {
        let (caller, a) = match self
            .prepare::<RestoreSandboxArgs>("restore_sandbox", &ctx, args)
            .await
        {
            Ok(v) => v,
            Err(r) => return r,
        };
        let (id, req) = a.into_parts();
        answer(self.api.restore_sandbox(&caller, &id, req).await)
    }

    #[tool(
        name = "pause_sandbox",
        description = D_PAUSE,
        input_schema = schema::input::<SandboxIdArgs>(),
        output_schema = schema::output::<Sandbox>(),
        annotations(
            title = "Pause a sandbox",
            read_only_hint = false,
            destructive_hint = false,
            idempotent_hint = true,
            open_world_hint = false
        )
    )]
    async fn pause_sandbox(
        &self,
        ctx: RequestContext<RoleServer>,
        args: JsonObject,
    ) -> Result<CallToolResult, ErrorData> {
        let (caller, a) = match self
            .prepare::<SandboxIdArgs>("pause_sandbox", &ctx, args)
            .await
        {
            Ok(v) => v,
            Err(r) => return r,
        };
        answer(self.api.pause_sandbox(&caller, &a.sandbox_id).await)
    }

    #[tool(
        name = "resume_sandbox",
        description = D_RESUME,
        input_schema = schema::input::<SandboxIdArgs>(),
        output_schema = schema::output::<Sandbox>(),
        annotations(
            title = "Resume a paused sandbox",
            read_only_hint = false,
            destructive_hint = false,
            idempotent_hint = true,
            open_world_hint = false
        )
    )]
    async fn resume_sandbox(
        &self,
        ctx: RequestContext<RoleServer>,
        args: JsonObject,
    ) -> Result<CallToolResult, ErrorData> {
        let (caller, a) = match self
            .prepare::<SandboxIdArgs>("resume_sandbox", &ctx, args)
            .await
        {
            Ok(v) => v,
            Err(r) => return r,
        };
        answer(self.api.resume_sandbox(&caller, &a.sandbox_id).await)
    }

    #[tool(
        name = "list_snapshots",
        description = D_LIST_SNAPSHOTS,
        input_schema = schema::input::<ListSnapshotsArgs>(),
        output_schema = schema::output::<List<Snapshot>>(),
        annotations(
            title = "List snapshots",
            read_only_hint = true,
            destructive_hint = false,
            idempotent_hint = true,
            open_world_hint = false
        )
    )]
    async fn list_snapshots(
        &self,
        ctx: RequestContext<RoleServer>,
        args: JsonObject,
    ) -> Result<CallToolResult, ErrorData> {
        let (caller, a) = match self
            .prepare::<ListSnapshotsArgs>("list_snapshots", &ctx, args)
            .await
        {
            Ok(v) => v,
            Err(r) => return r,
        };
        answer(self.api.list_snapshots(&caller, a.into()).await)
    }

    #[tool(
        name = "list_templates",
        description = D_LIST_TEMPLATES,
        input_schema = schema::input::<ListTemplatesArgs>(),
        output_schema = schema::output::<List<Template>>(),
        annotations(
            title = "List templates",
            read_only_hint = true,
            destructive_hint = false,
            idempotent_hint = true,
            open_world_hint = false
        )
    )]
    async fn list_templates(
        &self,
        ctx: RequestContext<RoleServer>,
        args: JsonObject,
    ) -> Result<CallToolResult, ErrorData> {
        let (caller, a) = match self
            .prepare::<ListTemplatesArgs>("list_templates", &ctx, args)
            .await
        {
            Ok(v) => v,
            Err(r) => return r,
        };
        answer(
            self.api
                .list_templates(&caller)
                .await
                .map(|all| match a.all_builds {
                    true => all,
                    false => List::new(sandpit_core::usable_templates(&all.data), false, None),
                }),
        )
    }

    #[tool(
        name = "delete_snapshot",
        description = D_DELETE_SNAPSHOT,
        input_schema = schema::input::<SnapshotIdArgs>(),
        output_schema = schema::output::<Snapshot>(),
        annotations(
            title = "Delete a snapshot",
            read_only_hint = false,
            destructive_hint = true,
            idempotent_hint = true,
            open_world_hint = false
        )
    )]
    async fn delete_snapshot(
        &self,
        ctx: RequestContext<RoleServer>,
        args: JsonObject,
    ) -> Result<CallToolResult, ErrorData> {
        let (caller, a) = match self
            .prepare::<SnapshotIdArgs>("delete_snapshot", &ctx, args)
            .await
        {
            Ok(v) => v,
            Err(r) => return r,
        };
        answer(self.api.delete_snapshot(&caller, &a.snapshot_id).await)
    }

    #[tool(
        name = "list_volumes",
        description = D_LIST_VOLUMES,
        input_schema = schema::input::<NoArgs>(),
        output_schema = schema::output::<List<Volume>>(),
        annotations(
            title = "List volumes",
            read_only_hint = true,
            destructive_hint = false,
            idempotent_hint = true,
            open_world_hint = false
        )
    )]
    async fn list_volumes(
        &self,
        ctx: RequestContext<RoleServer>,
        args: JsonObject,
    ) -> Result<CallToolResult, ErrorData> {
        let (caller, _) = match self.prepare::<NoArgs>("list_volumes", &ctx, args).await {
            Ok(v) => v,
            Err(r) => return r,
        };
        answer(self.api.list_volumes(&caller).await)
    }

    #[tool(
        name = "create_volume",
        description = D_CREATE_VOLUME,
        input_schema = schema::input::<CreateVolumeArgs>(),
        output_schema = schema::output::<Volume>(),
        annotations(
            title = "Create a volume",
            read_only_hint = false,
            destructive_hint = false,
            idempotent_hint = false,
            open_world_hint = false
        )
    )]
    async fn create_volume(
        &self,
        ctx: RequestContext<RoleServer>,
        args: JsonObject,
    ) -> Result<CallToolResult, ErrorData> {
        let (caller, a) = match self
            .prepare::<CreateVolumeArgs>("create_volume", &ctx, args)
            .await
        {
            Ok(v) => v,
            Err(r) => return r,
        };
        answer(
            self.api
                .create_volume(&caller, a.into(), None)
                .await
                .map(|(volume, _replayed)| volume),
        )
    }

    #[tool(
        name = "delete_volume",
        description = D_DELETE_VOLUME,
        input_schema = schema::input::<VolumeArgs>(),
        output_schema = schema::output::<Volume>(),
        annotations(
            title = "Delete a volume",
            read_only_hint = false,
            destructive_hint = true,
            idempotent_hint = false,
            open_world_hint = false
        )
    )]
    async fn delete_volume(
        &self,
        ctx: RequestContext<RoleServer>,
        args: JsonObject,
    ) -> Result<CallToolResult, ErrorData> {
        let (caller, a) = match self
            .prepare::<VolumeArgs>("delete_volume", &ctx, args)
            .await
        {
            Ok(v) => v,
            Err(r) => return r,
        };
        answer(self.api.delete_volume(&caller, &a.volume).await)
    }

    #[tool(
        name = "get_usage",
        description = D_USAGE,
        input_schema = schema::input::<GetUsageArgs>(),
        output_schema = schema::output::<Usage>(),
        annotations(
            title = "Get credit and usage",
            read_only_hint = true,
            destructive_hint = false,
            idempotent_hint = true,
            open_world_hint = false
        )
    )]
    async fn get_usage(
        &self,
        ctx: RequestContext<RoleServer>,
        args: JsonObject,
    ) -> Result<CallToolResult, ErrorData> {
        let (caller, a) = match self.prepare::<GetUsageArgs>("get_usage", &ctx, args).await {
            Ok(v) => v,
            Err(r) => return r,
        };
        answer(self.api.usage(&caller, a.days).await)
    }

    #[tool(
        name = "get_service_info",
        description = D_INFO,
        input_schema = schema::input::<NoArgs>(),
        output_schema = schema::output::<ServiceInfo>(),
        annotations(
            title = "Get service info",
            read_only_hint = true,
            destructive_hint = false,
            idempotent_hint = true,
            open_world_hint = false
        )
    )]
    async fn get_service_info(&self) -> Result<CallToolResult, ErrorData> {
        // Free discovery: no caller needed.
        answer(self.api.service_info().await)
    }
}

#[tool_handler(router = self.tool_router)]
impl ServerHandler for SandpitMcp {
    fn get_info(&self) -> ServerConfig {
        // `protocol_version` stays rmcp's default (the newest it knows); the
        // `initialize` answer is negotiated against `supported_protocol_versions`.
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(
                Implementation::new("sandpit", env!("CARGO_PKG_VERSION"))
                    .with_title("Sandpit: Linux VMs for agents"),
            )
            .with_instructions(INSTRUCTIONS)
    }

    fn supported_protocol_versions(&self) -> Cow<'static, [ProtocolVersion]> {
        Cow::Borrowed(SUPPORTED_PROTOCOL_VERSIONS)
    }
}

#[cfg(test)]
mod tests;
