//! `sandpit node drain|undrain|list`: an operator's hand on the cluster's
//! nodes, through the database they share (as `sandpit account` is), so
//! it works from any machine that reaches it, whichever member is up.
//!
//! Draining marks the node in the database; the control planes' drainers
//! do the moves (see `sandpit_core`'s `service/moves.rs`). The command
//! waits until the node holds no sandbox, saying what is left, so that
//! the operator knows when it can be stopped.

use anyhow::{bail, Result};
use clap::Subcommand;
use sandpit_server::serve::open_store;
use sandpit_server::settings::Settings;
use sandpit_store::{NodeRow, SandboxRow, Store};
use std::time::{Duration, Instant};

#[derive(Subcommand)]
pub enum NodeCommand {
    /// Empty node NAME: no new sandbox goes there, and each of its
    /// sandboxes moves to another node with its memory, files and expiry
    /// (a pause, seen from inside). Waits until it holds none (then it can
    /// be stopped with nothing lost), unless --no-wait
    Drain {
        name: String,
        /// Return once the node is marked, without waiting for the moves
        #[arg(long)]
        no_wait: bool,
        /// Give up waiting after this long (the drain goes on)
        #[arg(long, default_value = "30m")]
        timeout: humantime::Duration,
    },
    /// Put drained node NAME back in service: it takes new sandboxes again
    Undrain { name: String },
    /// The cluster's nodes: state, draining, live sandboxes
    List,
}

pub async fn run(settings: &Settings, command: NodeCommand) -> Result<i32> {
    if settings.database_url.is_none() {
        bail!("nodes are a cluster's: give --database (its PostgreSQL)");
    }
    let store = open_store(settings).await?;
    match command {
        NodeCommand::Drain {
            name,
            no_wait,
            timeout,
        } => drain(&store, &name, no_wait, timeout.into()).await,
        NodeCommand::Undrain { name } => {
            mark(&store, &name, false).await?;
            println!("node {name} is in service: it takes new sandboxes");
            Ok(0)
        }
        NodeCommand::List => {
            for node in store.nodes().await? {
                let live = store.live_sandboxes(&node.name).await?.len();
                println!("{}", node_line(&node, live));
            }
            Ok(0)
        }
    }
}

async fn mark(store: &Store, name: &str, draining: bool) -> Result<NodeRow> {
    match store.set_node_draining(name, draining).await? {
        Some(node) => Ok(node),
        None => bail!("no node is named {name} (sandpit node list)"),
    }
}

async fn drain(store: &Store, name: &str, no_wait: bool, timeout: Duration) -> Result<i32> {
    let node = mark(store, name, true).await?;
    let left = store.live_sandboxes(name).await?;
    println!(
        "node {name} is draining: it takes no new sandbox; {} to move",
        left.len()
    );
    if !node.is_live() {
        eprintln!(
            "node {name} is not live ({}): its sandboxes move once it is back, or fail with it",
            node.state.as_str()
        );
    }
    if no_wait {
        return Ok(0);
    }
    let deadline = Instant::now() + timeout;
    let mut said = String::new();
    loop {
        let left = store.live_sandboxes(name).await?;
        if left.is_empty() {
            println!("node {name} is drained: it holds no sandbox and can be stopped");
            return Ok(0);
        }
        let now = describe(&left);
        if now != said {
            println!("{now}");
            said = now;
        }
        if Instant::now() >= deadline {
            eprintln!(
                "node {name} still holds {} sandbox(es) after {}; the drain goes on \
                 (a sandbox with volumes stays: see its node's log)",
                left.len(),
                humantime::format_duration(timeout)
            );
            return Ok(1);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// What is left on a draining node, in a line.
fn describe(left: &[SandboxRow]) -> String {
    let now = time::OffsetDateTime::now_utc();
    let moving = left.iter().filter(|r| r.is_moving(now)).count();
    let ids: Vec<&str> = left.iter().map(|r| r.id.as_str()).collect();
    format!(
        "{} left ({moving} moving now): {}",
        left.len(),
        ids.join(" ")
    )
}

fn node_line(node: &NodeRow, live: usize) -> String {
    let state = if !node.is_live() && node.state == sandpit_store::NodeState::Up {
        "silent"
    } else {
        node.state.as_str()
    };
    format!(
        "{}\t{}{}\t{} sandbox(es)\t{}",
        node.name,
        state,
        if node.draining { ", draining" } else { "" },
        live,
        node.address
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(state: sandpit_store::NodeState, lease_until_ms: i64, draining: bool) -> NodeRow {
        NodeRow {
            name: "n1".into(),
            address: "10.0.0.1:7443".into(),
            epoch: 1,
            state,
            vcpus: 2,
            memory_mb: 4096,
            started_at_ms: 0,
            heartbeat_ms: 0,
            lease_until_ms,
            lost_at_ms: None,
            max_sandboxes: 8,
            warm: Default::default(),
            draining,
            now_ms: 1000,
        }
    }

    #[test]
    fn a_node_line_says_its_state_and_whether_it_drains() {
        use sandpit_store::NodeState::*;
        assert_eq!(
            node_line(&node(Up, 2000, true), 3),
            "n1\tup, draining\t3 sandbox(es)\t10.0.0.1:7443"
        );
        assert_eq!(
            node_line(&node(Up, 500, false), 0),
            "n1\tsilent\t0 sandbox(es)\t10.0.0.1:7443"
        );
        assert_eq!(
            node_line(&node(Lost, 500, false), 0),
            "n1\tlost\t0 sandbox(es)\t10.0.0.1:7443"
        );
    }
}
