//! A template is a named build of the standard guest image plus steps: run
//! commands (as root by default, so `apt-get install` works), copy files,
//! set the environment, working directory and user, and an optional start
//! command with a ready check. The service runs the steps in a VM, saves it
//! after each one (a layer), and saves it once more with the start command
//! running and ready: every sandbox of the template starts from that save,
//! its server already up.
//!
//! This crate is the model alone, shared by every way to describe one (a
//! Dockerfile, E2B's template builder, REST's JSON): [`Spec`] and its
//! [`Step`]s, [`dockerfile::parse`], the state the steps leave
//! ([`Spec::states`]) and each layer's cache key ([`Spec::layer_keys`]): a
//! rebuild reuses every layer whose key it finds, that is every step up to
//! the first one that changed.

pub mod dockerfile;
pub mod e2b;
mod spec;

pub use spec::*;
