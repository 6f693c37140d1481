//! Sandpit's MCP server: the twelve tools of `docs/spec/mcp-tools.md`
//! (create_sandbox, run_command, write_file, read_file, list_files,
//! expose_port, get_sandbox, list_sandboxes, extend_sandbox, destroy_sandbox,
//! get_usage, get_service_info), and snapshot_sandbox, fork_sandbox,
//! restore_sandbox, list_snapshots, delete_snapshot, pause_sandbox,
//! resume_sandbox, list_templates and update_network, over stdio and Streamable HTTP.
//!
//! Why it looks like this:
//!
//! - It is an adapter and nothing more. Every tool parses its input, finds
//!   out who is calling and calls [`SandboxApi`]; validation, billing and
//!   ownership live in `sandpit-core`, so MCP and REST behave the same by
//!   construction. The same server runs over a local core (`sandpit mcp`),
//!   over a REST client (`sandpit mcp --remote`) and inside `sandpit serve`.
//! - It uses rmcp, the official Rust SDK, for the protocol: JSON-RPC,
//!   version negotiation, the Streamable HTTP transport, progress. What rmcp
//!   does not decide is decided here: which revisions are offered
//!   ([`SUPPORTED_PROTOCOL_VERSIONS`]), how a caller is identified
//!   ([`CallerSource`]), which failures are tool results (everything an agent
//!   can act on, with a message saying what to do next) and which are protocol
//!   errors (only `internal_error`), and the HTTP allow-lists ([`HttpConfig`]).
//! - Tool inputs are parsed by this crate, not by rmcp's extractor, so a bad
//!   argument reaches the agent as an `isError` result it can fix.
//! - Results are the wire objects of `sandpit-core` (the REST API's objects):
//!   `structuredContent` plus the same JSON as a text block, with an
//!   `outputSchema` derived from the same types.
//!
//! Protocol revisions: `2025-06-18` and `2025-11-25` (with the `initialize`
//! handshake) and `2026-07-28` (no handshake: `server/discover` and
//! per-request `_meta`). rmcp 3.11 implements all three; this crate narrows
//! its list to them, so an `initialize` naming one of the first two is echoed,
//! any other `initialize` is answered with `2025-11-25` (the newest revision
//! that has a handshake), and a request naming an unsupported revision in its
//! `_meta` or in the `MCP-Protocol-Version` header is refused with
//! `UnsupportedProtocolVersionError`, which lists the supported revisions
//! (over HTTP with status 400; see `streamable`).
//!
//! Tool schemas are standard JSON Schema (`schema`): schemars' own number
//! formats (`uint32`...) become `minimum`/`maximum`, because strict
//! validators, the TypeScript SDK's Ajv first, warn about every one.

mod args;
mod descriptions;
mod schema;
mod server;
mod streamable;

pub use descriptions::INSTRUCTIONS;
pub use server::{CallerSource, SandpitMcp, SUPPORTED_PROTOCOL_VERSIONS};
pub use streamable::{http_service, HttpConfig};
/// The type of [`HttpConfig::shutdown`].
pub use tokio_util::sync::CancellationToken;

use rmcp::ServiceExt;
use sandpit_core::{Caller, SandboxApi};
use std::sync::Arc;
use tokio::io::{AsyncRead, AsyncWrite};

/// Serve MCP on this process's stdin/stdout until the client closes stdin,
/// every call acting for `caller`.
///
/// stdout carries the protocol and nothing else: the caller must send its
/// logs (its `tracing` subscriber) to stderr.
pub async fn serve_stdio(api: Arc<dyn SandboxApi>, caller: Caller) -> std::io::Result<()> {
    serve_io(api, caller, tokio::io::stdin(), tokio::io::stdout()).await
}

/// Serve MCP (newline-delimited JSON-RPC, as on stdio) over any byte pipe
/// until it closes, every call acting for `caller`.
pub async fn serve_io<R, W>(
    api: Arc<dyn SandboxApi>,
    caller: Caller,
    reader: R,
    writer: W,
) -> std::io::Result<()>
where
    R: AsyncRead + Send + Unpin + 'static,
    W: AsyncWrite + Send + Unpin + 'static,
{
    // The tools' schemas say what this service enforces; a server that
    // cannot say (an older one) leaves the defaults.
    let limits = api
        .service_info()
        .await
        .map(|i| i.limits)
        .unwrap_or_default();
    let running = SandpitMcp::new(api, CallerSource::Fixed(caller))
        .with_limits(&limits)
        .serve((reader, writer))
        .await
        .map_err(std::io::Error::other)?;
    running.waiting().await.map_err(std::io::Error::other)?;
    Ok(())
}
