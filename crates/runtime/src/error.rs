//! One error type for the runtime, one variant per thing that can go wrong, so
//! callers (the CLI now, the control plane later) can map each to a stable API
//! error without parsing messages.

use sandpit_protocol::AgentError;

/// Everything the runtime can fail with.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// No VM with this id lives on this host.
    #[error("no sandbox VM with id {0} on this host")]
    NotFound(String),
    /// The size name is not in the configured size table.
    #[error("unknown size {0:?} (configured sizes: {1})")]
    UnknownSize(String, String),
    /// The guest agent reported a typed failure (not found, permission denied...).
    #[error(transparent)]
    Agent(#[from] AgentError),
    /// The guest did not reach its agent within the boot bound.
    /// `console_tail`: what the host saw of it (QEMU's CPU time, where its
    /// vCPUs were) and the last lines of its console.
    #[error("the VM did not boot within {secs} s: {console_tail}")]
    BootTimeout { secs: u64, console_tail: String },
    /// The VM is gone: QEMU exited (guest power-off, panic, crash or kill).
    #[error("the VM is not running: {cause}")]
    VmExited { cause: String },
    /// The agent channel closed or misbehaved.
    #[error("lost the connection to the guest agent: {0}")]
    Disconnected(String),
    /// The guest agent did not answer a request within its deadline (a
    /// guest that is overloaded, wedged or hostile); the request is dropped
    /// and the connection stays usable.
    #[error("the sandbox did not answer {what} within {secs} s")]
    AgentTimeout { what: String, secs: u64 },
    /// The guest agent speaks another protocol generation.
    #[error("guest agent speaks protocol generation {guest}, this host speaks {host}; rebuild the image")]
    ProtocolMismatch { host: u32, guest: u32 },
    /// Too many VMs are starting at once and the wait queue is full.
    #[error("{0}")]
    Busy(String),
    /// The host has no room for another VM now (memory, CPU budget, a
    /// kernel limit): the message says which; it frees as sandboxes end.
    #[error("{0}")]
    HostFull(String),
    /// Starting or driving QEMU (or passt) failed.
    #[error("{0}")]
    Launch(String),
    /// A setting cannot be used as it is (a CA file with no certificate, a
    /// proxy that does not resolve).
    #[error("configuration: {0}")]
    Config(String),
    /// A host tool is missing.
    #[error(
        "{tool} is not installed; install the Debian package {package} (apt-get install {package})"
    )]
    MissingTool { tool: String, package: String },
    /// A host tool ran and failed: `what` it was doing, and the end of
    /// what it said.
    #[error("{what}: {tool} failed: {detail}")]
    ToolFailed {
        tool: String,
        what: String,
        detail: String,
    },
    /// A volume's file cannot take this size (smaller than it is, or too
    /// small for a file system).
    #[error("volume {id} cannot be {bytes} bytes: {why}")]
    VolumeSize { id: String, bytes: u64, why: String },
    /// Filesystem or socket error on the host.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

impl RuntimeError {
    /// A host program that could not be started: missing (say which Debian
    /// package has it) or failing to start (`what` says which step).
    pub fn spawn(
        tool: impl Into<String>,
        package: &str,
        what: &str,
    ) -> impl FnOnce(std::io::Error) -> RuntimeError {
        let (tool, package, what) = (tool.into(), package.to_string(), what.to_string());
        move |e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                RuntimeError::MissingTool { tool, package }
            } else {
                RuntimeError::Launch(format!("{what}: {e}"))
            }
        }
    }

    /// Wrap an I/O error with what was being done.
    pub fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> RuntimeError {
        let context = context.into();
        move |source| RuntimeError::Io { context, source }
    }
}

pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;
