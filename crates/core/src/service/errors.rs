//! How a failure reads to the client.
//!
//! Every concern ends in the same few failures: the store unavailable, the
//! guest's agent refusing, the VM gone under a running sandbox, a request
//! body that ended early. Each reads the same wherever it happens (the same
//! status, the same message, the same retry hint), so the mapping is kept
//! once, here. Owns the store's and the runtime's errors as the API reports
//! them, a guest call that failed because its sandbox ended meanwhile (which
//! ends a sandbox whose VM died), and why a sandbox that is not running
//! cannot be used.

use crate::error::{CoreError, ErrorType};
use crate::service::Service;
use sandpit_protocol::ErrorKind;
use sandpit_runtime::RuntimeError;
use sandpit_store::{SandboxRow, SandboxStatus, StoreError};

impl From<StoreError> for CoreError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::NotFound(what) => {
                CoreError::new(ErrorType::NotFound, format!("{what} not found"))
            }
            StoreError::Conflict(m) => CoreError::conflict(m),
            StoreError::Invalid(m) => CoreError::invalid(m),
            // What timed out or could not be reached (no password in it).
            StoreError::Unavailable(m) => {
                tracing::warn!("store: {m}");
                CoreError::new(
                    ErrorType::ServiceUnavailable,
                    format!("the database is unavailable ({m}); retry shortly"),
                )
                .with_retry_after(1)
            }
            other => {
                tracing::error!("store: {other}");
                CoreError::new(
                    ErrorType::ServiceUnavailable,
                    "the database is unavailable; retry shortly",
                )
                .with_retry_after(1)
            }
        }
    }
}

/// A runtime failure as the API reports it.
pub(super) fn runtime_error(e: RuntimeError) -> CoreError {
    match e {
        RuntimeError::Agent(a) => {
            let kind = match a.kind {
                ErrorKind::NotFound => ErrorType::NotFound,
                ErrorKind::PermissionDenied => ErrorType::Forbidden,
                ErrorKind::IsADirectory
                | ErrorKind::NotADirectory
                | ErrorKind::TooLarge
                | ErrorKind::InvalidPath
                | ErrorKind::InvalidRequest
                | ErrorKind::Unsupported => ErrorType::InvalidRequest,
                // Disk full, nothing listening and the like: the sandbox's
                // state prevents it.
                ErrorKind::Io | ErrorKind::ConnectionRefused | ErrorKind::TimedOut => {
                    ErrorType::Conflict
                }
                // A directory to make is there already.
                ErrorKind::AlreadyExists => ErrorType::Conflict,
            };
            CoreError::new(kind, a.message)
        }
        RuntimeError::VmExited { cause } => CoreError::conflict(format!(
            "the sandbox's VM has stopped ({cause}); create a new sandbox"
        )),
        RuntimeError::Disconnected(m) => CoreError::new(
            ErrorType::ServiceUnavailable,
            format!("lost the connection to the sandbox ({m}); retry"),
        )
        .with_retry_after(1),
        RuntimeError::Busy(m) => {
            CoreError::new(ErrorType::ServiceUnavailable, m).with_retry_after(2)
        }
        RuntimeError::HostFull(m) => CoreError::new(
            ErrorType::ServiceUnavailable,
            format!("{m}; retry later, or destroy a sandbox you no longer need"),
        )
        .with_retry_after(sandpit_host::capacity::RETRY_AFTER_SECS),
        RuntimeError::AgentTimeout { what, secs } => CoreError::new(
            ErrorType::ServiceUnavailable,
            format!(
                "the sandbox did not answer {what} within {secs} s (it may be overloaded); \
                 it is still usable, retry"
            ),
        )
        .with_retry_after(1),
        RuntimeError::BootTimeout { secs, .. } => CoreError::new(
            ErrorType::ServiceUnavailable,
            format!("the VM did not boot within {secs} s; retry"),
        )
        .with_retry_after(1),
        other => {
            tracing::error!("runtime: {other}");
            CoreError::new(
                ErrorType::ServiceUnavailable,
                format!("the host cannot run this now: {other}"),
            )
            .with_retry_after(5)
        }
    }
}

impl Service {
    /// The error for a call to `row`'s guest that failed with `e`: when
    /// the sandbox ended meanwhile (a destroy, the expiry), that it is no
    /// longer running, rather than "retry", which cannot help.
    pub(super) async fn agent_failure(&self, row: &SandboxRow, e: RuntimeError) -> CoreError {
        // The VM is being replaced by a restore: not lost.
        if !matches!(e, RuntimeError::Agent(_)) && self.is_restoring(&row.id).await {
            return CoreError::new(
                ErrorType::ServiceUnavailable,
                format!(
                    "sandbox {} is being restored from a snapshot; retry",
                    row.id
                ),
            )
            .with_retry_after(1);
        }
        // The VM is gone under a running sandbox: the sandbox failed,
        // unless a VM runs for it again now (replaced just before this
        // call's failure was looked at).
        if let RuntimeError::VmExited { cause } | RuntimeError::NotFound(cause) = &e {
            let replaced = match self.machines_for(row).await {
                Ok(machines) => matches!(
                    machines.state(&row.id).await,
                    Ok(Some(sandpit_runtime::VmState::Running))
                ),
                Err(_) => false,
            };
            if replaced {
                return CoreError::new(
                    ErrorType::ServiceUnavailable,
                    format!(
                        "sandbox {}'s VM was replaced during the call; retry",
                        row.id
                    ),
                )
                .with_retry_after(1);
            }
            if row.status == SandboxStatus::Running {
                let _ = self
                    .end(
                        row,
                        SandboxStatus::Failed,
                        &format!("failed: {cause}"),
                        sandpit_store::Cause::by(crate::service::events::SANDPIT),
                    )
                    .await;
                return CoreError::conflict(format!(
                    "the sandbox's VM has stopped ({cause}); create a new sandbox"
                ));
            }
        }
        if !matches!(e, RuntimeError::Agent(_)) {
            if let Ok(Some(now)) = self.store.sandbox(&row.id).await {
                if now.status != SandboxStatus::Running {
                    return not_running(&now);
                }
            }
        }
        runtime_error(e)
    }

    /// The error for a read of `row`'s guest that failed with `e`: a file
    /// over the read limit says the limit.
    pub(super) async fn read_failure(&self, row: &SandboxRow, e: RuntimeError) -> CoreError {
        match e {
            RuntimeError::Agent(a) if a.kind == ErrorKind::TooLarge => CoreError::invalid(format!(
                "{}; the read limit is {} bytes",
                a.message, self.config.max_read_bytes
            )),
            e => self.agent_failure(row, e).await,
        }
    }
}

/// Why a sandbox that is not running cannot be used.
pub(super) fn not_running(row: &SandboxRow) -> CoreError {
    let why = row
        .deleted_reason
        .as_deref()
        .map(|r| format!(" ({r})"))
        .unwrap_or_default();
    CoreError::conflict(format!(
        "sandbox {} is {}{why}; create a new one",
        row.id, row.status
    ))
}
