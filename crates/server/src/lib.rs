//! Sandpit's server, assembled: what `sandpit serve`, `sandpit node` and
//! `sandpit mcp` run, given the settings the command line read.
//!
//! - [`settings`]: the configuration file, the environment and the flags,
//!   merged once into [`settings::Settings`].
//! - [`owner`]: one process owns a data directory's VMs at a time.
//! - [`images`]: the guest image a server boots (built when missing).
//! - [`serve`]: the wiring: store, VMs, core service, cluster membership,
//!   node API, and the listeners.
//! - [`listener`]: the public listener (HTTP/1.1 and HTTP/2, connection
//!   limits, graceful shutdown), and [`front`], which sends each request
//!   to the API (REST, MCP, dashboard) or, by its host name, to the
//!   [`proxy`] of preview URLs.
//! - [`metrics`]: the Prometheus exporter and its listener.
//!
//! The front router and the proxy reach the service only through the
//! traits the adapters use (`SandboxApi`, `PreviewGate`).

pub mod front;
pub mod images;
pub mod listener;
pub mod metrics;
pub mod owner;
pub mod proxy;
pub mod serve;
pub mod settings;
