//! Sandpit's domain: what a sandbox, an execution, an account and a credit
//! ledger are, and the one place where each behaviour lives.
//!
//! REST (`sandpit-api`) and MCP (`sandpit-mcp`) are thin adapters over the
//! [`SandboxApi`] trait: the core service implements it for local VMs, and a
//! REST client implements it for `sandpit mcp --remote`. Neither adapter
//! decides anything: validation, billing, ownership and state changes happen
//! here, so both transports behave identically by construction.

pub mod admin;
pub mod api;
pub mod cluster;
pub mod config;
pub mod e2b;
pub mod error;
pub(crate) mod idle;
pub mod metrics;
pub mod model;
pub mod preview;
pub mod private_preview;
pub mod secrets_key;
pub mod service;
pub mod utf8;

/// This release's version and the commit the binary was built from, as
/// `sandpit --version` prints them (the binary knows its commit and says it
/// in [`ServiceConfig::commit`](config::ServiceConfig::commit)).
pub fn version(commit: &str) -> String {
    format!("{} (commit {commit})", env!("CARGO_PKG_VERSION"))
}

/// The API's traits by subject, for `use sandpit_core::prelude::*`.
pub use api::prelude;
pub use api::{Caller, DirWatchStream, ExecEvent, ExecStream, ReservedBuild, SandboxApi};
pub use error::{CoreError, ErrorType};
pub use model::*;
pub use service::Service;
pub use service::{parse_template_reference, MAX_TEMPLATE_FILES_BYTES};
