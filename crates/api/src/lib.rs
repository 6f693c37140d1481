//! Sandpit's REST API (`/v1`), as an adapter and nothing more.
//!
//! Why this crate exists: the public "Sandbox as a Service" REST contract
//! (`docs/spec/rest-api.md`) must be served field for field so that
//! existing SDKs work against Sandpit by changing only the base URL and key.
//! Everything that *decides* (validation of values, ownership, billing, state
//! changes) lives in `sandpit-core` behind [`SandboxApi`]; this crate only
//! translates HTTP to trait calls and back, so REST and MCP cannot drift apart.
//!
//! What it adds on top of the trait is purely HTTP:
//!
//! - [`router`]: the axum router for every `/v1` route, with the key taken
//!   only from headers, one JSON error shape for *every* non-2xx response
//!   (including axum's own rejections, unknown routes and wrong methods), an
//!   `x-request-id` on every response, `Retry-After` on 429/503, strict body
//!   and query parsing (unknown fields are errors, not silently ignored), and
//!   server-sent events for streaming exec.
//! - [`openapi()`]: the OpenAPI 3.1 document, generated from the same model
//!   types the handlers serialize (their `schemars` derives), served at
//!   `/v1/openapi.json` and committed as `docs/openapi.json`.
//! - [`RemoteApi`]: a [`SandboxApi`] that is a client of this REST API, so
//!   anything written against the trait (the MCP adapter) can drive a remote
//!   Sandpit server (`sandpit mcp --remote URL`, key in `SANDPIT_API_KEY`).

mod bodies;
mod budget;
mod error;
mod extract;
mod operations;
pub mod raw;
mod remote;
mod server;
mod sse;
mod state;
mod terminal;

pub use bodies::{ExposePortBody, ExtendBody, FilesQuery, PortClosed, UsageQuery};
pub use budget::BodyBudget;
pub use error::{ErrorBody, ErrorObject};
pub use extract::{parse_json_body, parse_query_string};
pub use operations::{openapi, router};
pub use remote::{RemoteApi, API_KEY_ENV};
pub use server::with_request_layers;
pub use sse::OutputChunk;
pub use state::{RestConfig, DEFAULT_BODY_BUDGET};
pub use terminal::{TerminalControl, TerminalEvent, TerminalQuery};

#[doc(no_inline)]
pub use sandpit_core::SandboxApi;
