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
pub mod service;
pub mod utf8;

/// The commit this binary was built from (`unknown` outside a checkout,
/// unless the build's environment named it in `SANDPIT_COMMIT`).
pub const COMMIT: &str = env!("SANDPIT_COMMIT");

/// The version and the commit, as `sandpit --version` prints them.
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("SANDPIT_COMMIT"),
    ")"
);

/// The API's traits by subject, for `use sandpit_core::prelude::*`.
pub use api::prelude;
pub use api::{Caller, ExecEvent, ExecStream, SandboxApi};
pub use error::{CoreError, ErrorType};
pub use model::*;
pub use service::Service;
