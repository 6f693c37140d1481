//! The link between Sandpit's control plane and its nodes.
//!
//! When machines share one database (see `sandpit_core::cluster`), each
//! node serves an internal API that the control plane's replicas call to
//! reach the node's VMs. This crate is that link: the cluster's own CA and
//! the mutual TLS it gives ([`tls`]), and the API itself, fenced by the
//! node's epoch ([`server`], [`client`]): the core's `Machines` trait over
//! the network. It knows nothing of sandboxes' money or accounts: those
//! stay in the core.

pub mod client;
pub mod server;
pub mod tls;
pub mod wire;

pub use client::{NodeClient, NodeError, RemoteNode};
pub use server::{serve, Health, NodeState, EPOCH_HEADER};
pub use tls::{client_config, init_ca, issue, server_config, Identity};
