//! The lifecycle states of a sandbox and of a command, as types.
//!
//! The database stores each state as the word the API shows
//! (`docs/spec/rest-api.md`), so one enum serves the rows, the domain and
//! the wire: the store decodes a row's word into its variant once, and
//! nothing above compares strings. An unknown word in a row is
//! [`StoreError::Corrupt`], never a silent default.

use crate::error::{Result, StoreError};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::fmt;

// The variants of the two API enums carry `//` notes, not docs: a
// documented variant would turn the OpenAPI schema from a plain `enum` of
// words into a `oneOf`.

/// Lifecycle of a sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum SandboxStatus {
    // Placed and reserved; its VM is starting.
    Provisioning,
    Running,
    // Running, its VM saved to disk and stopped (stored as `running` with a
    // pause time, so every live-status query counts it): billed at the
    // paused rate; a call that needs its VM resumes it first.
    Paused,
    // Being destroyed: its VM is going, its charge not yet settled.
    Deleting,
    // Ended by a destroy or its expiry, settled.
    Deleted,
    // Ended by a fault (its VM died, its node was lost), settled.
    Failed,
}

impl SandboxStatus {
    /// The statuses of a sandbox that holds (or is about to hold, or is
    /// still releasing) a VM and a reservation.
    pub const LIVE: [SandboxStatus; 3] = [
        SandboxStatus::Provisioning,
        SandboxStatus::Running,
        SandboxStatus::Deleting,
    ];

    /// The statuses a sandbox ends in; only [`crate::Store::finish_sandbox`]
    /// sets them.
    pub const ENDED: [SandboxStatus; 2] = [SandboxStatus::Deleted, SandboxStatus::Failed];

    /// The word stored and shown for it.
    pub fn as_str(self) -> &'static str {
        match self {
            SandboxStatus::Provisioning => "provisioning",
            SandboxStatus::Running => "running",
            SandboxStatus::Paused => "paused",
            SandboxStatus::Deleting => "deleting",
            SandboxStatus::Deleted => "deleted",
            SandboxStatus::Failed => "failed",
        }
    }

    /// The status a stored or typed word names. (`paused` is stored only
    /// in a sandbox's events: its row says `running`, with a pause time;
    /// see [`SandboxStatus::Paused`].)
    pub fn parse(s: &str) -> Option<Self> {
        Self::LIVE
            .into_iter()
            .chain(Self::ENDED)
            .chain([SandboxStatus::Paused])
            .find(|status| status.as_str() == s)
    }

    /// Still holding (or about to hold, or still releasing) a VM.
    pub fn is_live(self) -> bool {
        !self.is_ended()
    }

    /// Ended: `deleted` or `failed`, for good.
    pub fn is_ended(self) -> bool {
        Self::ENDED.contains(&self)
    }

    /// A row's stored word, decoded.
    pub(crate) fn stored(s: &str) -> Result<Self> {
        Self::parse(s).ok_or_else(|| StoreError::Corrupt(format!("sandbox status {s:?}")))
    }
}

impl fmt::Display for SandboxStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How a command ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ExecutionStatus {
    // It exited (any exit code) or was killed by a signal of its own.
    Completed,
    // Killed at its timeout.
    TimedOut,
    // Killed because its caller cancelled it.
    Cancelled,
    // The platform could not run it to its end (the VM or its agent failed).
    Failed,
}

impl ExecutionStatus {
    const ALL: [ExecutionStatus; 4] = [
        ExecutionStatus::Completed,
        ExecutionStatus::TimedOut,
        ExecutionStatus::Cancelled,
        ExecutionStatus::Failed,
    ];

    /// The word stored and shown for it.
    pub fn as_str(self) -> &'static str {
        match self {
            ExecutionStatus::Completed => "completed",
            ExecutionStatus::TimedOut => "timed_out",
            ExecutionStatus::Cancelled => "cancelled",
            ExecutionStatus::Failed => "failed",
        }
    }

    /// The status a stored or typed word names.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|status| status.as_str() == s)
    }
}

impl fmt::Display for ExecutionStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where a recorded command is: still running, or ended how.
///
/// The API shows only ended commands; `running` is the store's own word for
/// a command whose end is not recorded yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ExecutionState {
    Running,
    Ended(ExecutionStatus),
}

impl ExecutionState {
    /// The word stored for it.
    pub fn as_str(self) -> &'static str {
        match self {
            ExecutionState::Running => "running",
            ExecutionState::Ended(status) => status.as_str(),
        }
    }

    /// A row's stored word, decoded.
    pub(crate) fn stored(s: &str) -> Result<Self> {
        if s == ExecutionState::Running.as_str() {
            return Ok(ExecutionState::Running);
        }
        ExecutionStatus::parse(s)
            .map(ExecutionState::Ended)
            .ok_or_else(|| StoreError::Corrupt(format!("execution status {s:?}")))
    }
}

/// Whether a cluster node may be routed to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NodeState {
    /// Registered and heartbeating (within its lease or not: see
    /// [`crate::NodeRow::is_live`]).
    Up,
    /// Declared lost by a sweep: its sandboxes were failed and settled; it
    /// must register again (a new epoch) to take any.
    Lost,
}

impl NodeState {
    /// The word stored for it.
    pub fn as_str(self) -> &'static str {
        match self {
            NodeState::Up => "up",
            NodeState::Lost => "lost",
        }
    }

    /// A row's stored word, decoded.
    pub(crate) fn stored(s: &str) -> Result<Self> {
        [NodeState::Up, NodeState::Lost]
            .into_iter()
            .find(|state| state.as_str() == s)
            .ok_or_else(|| StoreError::Corrupt(format!("node state {s:?}")))
    }
}

/// The SQL list of the live statuses, for `status IN …` in a query's
/// text: a literal, so `concat!` builds the query at compile time.
macro_rules! live_statuses {
    () => {
        "('provisioning', 'running', 'deleting')"
    };
}
pub(crate) use live_statuses;

/// The SQL list of the ended statuses, as [`live_statuses`].
macro_rules! ended_statuses {
    () => {
        "('deleted', 'failed')"
    };
}
pub(crate) use ended_statuses;

#[cfg(test)]
mod tests {
    use super::*;

    fn sql_list(statuses: &[SandboxStatus]) -> String {
        let words: Vec<String> = statuses.iter().map(|s| format!("'{s}'")).collect();
        format!("({})", words.join(", "))
    }

    #[test]
    fn the_sql_lists_name_exactly_the_live_and_ended_statuses() {
        assert_eq!(live_statuses!(), sql_list(&SandboxStatus::LIVE));
        assert_eq!(ended_statuses!(), sql_list(&SandboxStatus::ENDED));
    }

    #[test]
    fn every_status_reads_back_from_its_word_and_serializes_as_it() {
        let all = SandboxStatus::LIVE
            .into_iter()
            .chain(SandboxStatus::ENDED)
            .chain([SandboxStatus::Paused]);
        for status in all {
            assert_eq!(SandboxStatus::stored(status.as_str()).unwrap(), status);
            assert_eq!(
                serde_json::to_value(status).unwrap(),
                serde_json::json!(status.as_str())
            );
            assert_eq!(status.is_live(), !status.is_ended());
        }
        for status in ExecutionStatus::ALL {
            let state = ExecutionState::Ended(status);
            assert_eq!(ExecutionState::stored(state.as_str()).unwrap(), state);
            assert_eq!(
                serde_json::to_value(status).unwrap(),
                serde_json::json!(status.as_str())
            );
        }
        assert_eq!(
            ExecutionState::stored("running").unwrap(),
            ExecutionState::Running
        );
        for state in [NodeState::Up, NodeState::Lost] {
            assert_eq!(NodeState::stored(state.as_str()).unwrap(), state);
        }
    }

    #[test]
    fn an_unknown_stored_word_is_corrupt_not_a_default() {
        assert!(matches!(
            SandboxStatus::stored("stopped"),
            Err(StoreError::Corrupt(_))
        ));
        assert!(matches!(
            ExecutionState::stored("RUNNING"),
            Err(StoreError::Corrupt(_))
        ));
    }
}
