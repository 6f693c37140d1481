//! Sandpit's machines: the layer between the domain (`sandpit-core`) and
//! the QEMU driver (`sandpit-runtime`).
//!
//! Every caller reaches a sandbox's VM through [`machines::Machines`],
//! whether it runs on this host ([`local::LocalVms`]: the warm pool and the
//! host's [`capacity`] budget) or on another node of a cluster (the node
//! API, `sandpit-node`, reached through a [`machines::NodeLink`]). A node
//! records the starts other members ask of it through
//! [`recording::StartRecords`], never through the service.
//!
//! This crate speaks the runtime's words (ids, sizes, VM states): it knows
//! no account, no price and no row, so a node, which depends on it and not
//! on `sandpit-core`, cannot charge or refund anything.

pub mod capacity;
pub mod ids;
pub mod local;
pub mod machines;
pub mod recording;
pub mod turns;
