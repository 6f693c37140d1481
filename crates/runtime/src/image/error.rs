//! The one error type of the image builder.
//!
//! Each variant is one kind of failure a caller may want to tell apart (and a
//! person may want to act on): a missing host tool names the Debian package
//! that provides it, a failed build step names the step and carries the end
//! of its log so the cause is visible without opening the file.

use std::io;
use std::path::PathBuf;

/// Why a guest image could not be found or built.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// Building a guest image needs root (debootstrap, chroot and mounts); run as root.
    #[error("building a guest image needs root (debootstrap, chroot and mounts); run as root")]
    NotRoot,

    /// A host tool the build needs is not installed.
    #[error("`{tool}` is needed to build guest images but was not found; install it with `apt-get install {package}`")]
    MissingTool {
        /// The program (or file) that is missing.
        tool: String,
        /// The Debian package that provides it.
        package: String,
    },

    /// The image spec has a value that cannot be used.
    #[error("invalid image spec: {0}")]
    InvalidSpec(String),

    /// The agent binary named in the spec does not exist or is not a file.
    #[error("agent binary {0} not found (build sandpit-agent first)")]
    AgentMissing(PathBuf),

    /// A build step failed; the log tail shows why.
    #[error("image build step `{step}` failed (full log: {log_path}):\n{log_tail}")]
    StepFailed {
        /// The name of the step, as shown in the progress output.
        step: String,
        /// The last lines the step wrote to the log.
        log_tail: String,
        /// The build log file.
        log_path: PathBuf,
    },

    /// A kernel module the guest needs is neither a module nor built into the kernel.
    #[error("kernel {kernel_release} has no module `{module}` (neither in modules.dep nor in modules.builtin)")]
    ModuleMissing {
        /// The module name.
        module: String,
        /// The kernel release searched.
        kernel_release: String,
    },

    /// A kernel module file could not be read as an ELF module.
    #[error("{path}: not a usable kernel module: {reason}")]
    BadModule {
        /// The module file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },

    /// The module dependency graph has a cycle.
    #[error("kernel module dependency cycle through `{0}`")]
    ModuleCycle(String),

    /// A file or directory operation failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done, with the path.
        context: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
}

/// Attaches a description (usually naming a path) to an `io::Error`.
pub(crate) trait IoContext<T> {
    fn ctx<F: FnOnce() -> String>(self, f: F) -> Result<T, ImageError>;
}

impl<T> IoContext<T> for Result<T, io::Error> {
    fn ctx<F: FnOnce() -> String>(self, f: F) -> Result<T, ImageError> {
        self.map_err(|source| ImageError::Io {
            context: f(),
            source,
        })
    }
}
