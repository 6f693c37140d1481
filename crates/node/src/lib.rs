//! The link between Sandpit's control plane and its nodes.
//!
//! When machines share one database (see `sandpit_core::cluster`), each
//! node serves an internal API that the control plane's replicas call to
//! reach the node's VMs. This crate is that link: the cluster's own CA and
//! the mutual TLS it gives ([`tls`]), and the API itself, fenced by the
//! node's epoch ([`api`]). It knows nothing of sandboxes' money or
//! accounts: those stay in the core.

pub mod api;
pub mod tls;
pub mod wire;

pub use api::{Health, NodeClient, NodeError, NodeState, Refusal, RemoteExec, EPOCH_HEADER};
pub use tls::{client_config, init_ca, issue, server_config, Identity};
