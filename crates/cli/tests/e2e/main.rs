//! The `sandpit` binary's integration tests, as one test binary: each
//! module was a binary of its own, and each of those compiled `common` again
//! and linked the whole workspace again (most of CI's test build). One
//! binary also lets `--test-threads` run tests of different modules side by
//! side, so a module whose one test waits does not leave a core idle.
//!
//! Tests of different modules can now run at the same time: a test must not
//! assume the host is its own. What a test changes on the host (routes,
//! links, the firewall) it changes under `common::netns::HostNetworkLock`;
//! processes it looks for or kills it finds by its own data directory or
//! sandbox ids. Run one module with `cargo test -p sandpit --test e2e MODULE::`.

mod common;

mod browser;
mod capacity;
mod chaos;
mod cli;
mod cluster;
mod connections;
mod dashboard;
mod doctor;
mod e2b;
mod events;
mod idle;
mod lifecycle;
mod load;
mod long_paths;
mod metrics;
mod modes;
mod network;
mod package;
mod preview;
mod registries;
mod sandbox_snapshots;
mod server;
mod snapshot_commands;
mod templates;
mod terminal;
mod topology;
mod upgrade;
mod volume_commands;
mod volumes;
