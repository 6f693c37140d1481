//! Running the build's subprocesses: tool lookup (with the Debian package to
//! install when a tool is missing) and one build log that every step appends
//! its output to.
//!
//! Why one log file and not captured output: debootstrap and apt print
//! thousands of lines, nobody wants them on the terminal, but when a step
//! fails the cause is in its last lines. So the output goes to the file and
//! a failure carries the step's last lines plus the path of the whole log.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use super::error::{ImageError, IoContext};

/// The `PATH` given to every build subprocess (the caller's may lack sbin).
pub(crate) const BUILD_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// How many lines of a failed step's output the error carries.
const TAIL_LINES: usize = 20;

/// A host program the build runs, and the Debian package that provides it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Tool {
    pub name: &'static str,
    pub package: &'static str,
}

pub(crate) const DEBOOTSTRAP: Tool = Tool {
    name: "debootstrap",
    package: "debootstrap",
};
pub(crate) const MKFS_EXT4: Tool = Tool {
    name: "mkfs.ext4",
    package: "e2fsprogs",
};
pub(crate) const QEMU_IMG: Tool = Tool {
    name: "qemu-img",
    package: "qemu-utils",
};
pub(crate) const DPKG_DEB: Tool = Tool {
    name: "dpkg-deb",
    package: "dpkg",
};
pub(crate) const APT_GET: Tool = Tool {
    name: "apt-get",
    package: "apt",
};
pub(crate) const APT_CACHE: Tool = Tool {
    name: "apt-cache",
    package: "apt",
};
pub(crate) const CHROOT: Tool = Tool {
    name: "chroot",
    package: "coreutils",
};
pub(crate) const UNSHARE: Tool = Tool {
    name: "unshare",
    package: "util-linux",
};
pub(crate) const MOUNT: Tool = Tool {
    name: "mount",
    package: "mount",
};
pub(crate) const XZ: Tool = Tool {
    name: "xz",
    package: "xz-utils",
};
pub(crate) const ZSTD: Tool = Tool {
    name: "zstd",
    package: "zstd",
};
pub(crate) const GZIP: Tool = Tool {
    name: "gzip",
    package: "gzip",
};

/// The keyring debootstrap and apt verify Debian's archive with.
pub(crate) const DEBIAN_KEYRING: &str = "/usr/share/keyrings/debian-archive-keyring.gpg";

/// Finds `tool` in `BUILD_PATH` (and the caller's `PATH`).
pub(crate) fn find_tool(tool: Tool) -> Result<PathBuf, ImageError> {
    let caller_path = std::env::var_os("PATH").unwrap_or_default();
    let dirs = std::env::split_paths(BUILD_PATH).chain(std::env::split_paths(&caller_path));
    for dir in dirs {
        let candidate = dir.join(tool.name);
        if is_executable(&candidate) {
            return Ok(candidate);
        }
    }
    Err(ImageError::MissingTool {
        tool: tool.name.to_string(),
        package: tool.package.to_string(),
    })
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// A command line for `tool` with the build's environment: a clean
/// environment (so the caller's locale or `DEBIAN_FRONTEND` settings do not
/// change what gets built) plus proxy settings, which must pass through.
pub(crate) fn command(tool: Tool) -> Result<Command, ImageError> {
    let mut cmd = Command::new(find_tool(tool)?);
    cmd.env_clear()
        .env("PATH", BUILD_PATH)
        .env("LC_ALL", "C.UTF-8")
        .env("HOME", "/root")
        .env("DEBIAN_FRONTEND", "noninteractive");
    for var in [
        "http_proxy",
        "https_proxy",
        "no_proxy",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "NO_PROXY",
    ] {
        if let Some(value) = std::env::var_os(var) {
            cmd.env(var, value);
        }
    }
    Ok(cmd)
}

/// The program's file name.
fn program(cmd: &Command) -> String {
    let p = Path::new(cmd.get_program());
    p.file_name()
        .unwrap_or(p.as_os_str())
        .to_string_lossy()
        .into_owned()
}

/// A command line as a person would type it (for the log).
fn display(cmd: &Command) -> String {
    let mut line = String::new();
    for (key, value) in cmd.get_envs() {
        if let (Some(value), true) = (value, key == "APT_CONFIG") {
            line.push_str(&format!("APT_CONFIG={} ", value.to_string_lossy()));
        }
    }
    line.push_str(&program(cmd));
    for arg in cmd.get_args() {
        let arg = arg.to_string_lossy();
        line.push(' ');
        if arg.is_empty() || arg.contains(|c: char| c.is_whitespace() || "'\"$`\\".contains(c)) {
            line.push_str(&format!("'{}'", arg.replace('\'', "'\\''")));
        } else {
            line.push_str(&arg);
        }
    }
    line
}

/// Runs `program` (with the arguments the caller adds) in its own mount
/// and PID namespaces: `unshare --mount --propagation private --pid --fork
/// --kill-child`. Whatever it mounts disappears with it, and if the build
/// dies, the kernel kills the whole process tree (unshare gets SIGKILL when
/// its parent thread dies; its child, PID 1 of the namespace, when unshare
/// dies; everything else in the namespace with its PID 1), so no
/// debootstrap or apt keeps running into a directory the next build deletes.
pub(crate) fn isolated(program: &Path) -> Result<Command, ImageError> {
    use std::os::unix::process::CommandExt;
    let mut cmd = command(UNSHARE)?;
    cmd.args([
        "--mount",
        "--propagation",
        "private",
        "--pid",
        "--fork",
        "--kill-child",
        "--",
    ])
    .arg(program);
    // SAFETY: prctl is async-signal-safe, the closure allocates nothing.
    unsafe {
        cmd.pre_exec(|| {
            nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)
                .map_err(std::io::Error::from)
        });
    }
    Ok(cmd)
}

/// The log file of one build; every step appends to it.
pub(crate) struct BuildLog {
    path: PathBuf,
    file: File,
    step: String,
    step_start: u64,
    step_clock: Instant,
}

impl BuildLog {
    /// Creates `dir/build-<time>-<pid>.log`.
    pub(crate) fn create(dir: &Path) -> Result<Self, ImageError> {
        std::fs::create_dir_all(dir).ctx(|| format!("creating {}", dir.display()))?;
        let stamp = time::OffsetDateTime::now_utc()
            .format(&time::macros::format_description!(
                "[year][month][day]T[hour][minute][second]Z"
            ))
            .unwrap_or_else(|_| "unknown".into());
        let path = dir.join(format!("build-{stamp}-{}.log", std::process::id()));
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .read(true)
            .open(&path)
            .ctx(|| format!("creating build log {}", path.display()))?;
        Ok(Self {
            path,
            file,
            step: String::new(),
            step_start: 0,
            step_clock: Instant::now(),
        })
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Marks the start of a step: its output is what a failure's tail shows.
    pub(crate) fn begin_step(&mut self, name: &str) -> Result<(), ImageError> {
        self.step = name.to_string();
        self.note(&format!("==> step: {name}"))?;
        self.step_start = self.file.seek(SeekFrom::End(0)).ctx(|| self.ctx())?;
        self.step_clock = Instant::now();
        Ok(())
    }

    /// Closes the current step, logging how long it took; returns the seconds.
    pub(crate) fn end_step(&mut self) -> Result<f64, ImageError> {
        let secs = self.step_clock.elapsed().as_secs_f64();
        self.note(&format!("==> step done: {} ({secs:.2} s)", self.step))?;
        tracing::info!(step = %self.step, seconds = secs, "image build step done");
        Ok(secs)
    }

    /// Appends a line of our own to the log.
    pub(crate) fn note(&mut self, line: &str) -> Result<(), ImageError> {
        writeln!(self.file, "{line}").ctx(|| self.ctx())
    }

    /// Runs `cmd` with stdout and stderr going to the log; a non-zero exit is
    /// a `StepFailed` for the current step.
    pub(crate) fn run(&mut self, cmd: &mut Command) -> Result<(), ImageError> {
        self.note(&format!("$ {}", display(cmd)))?;
        let stdout = self.file.try_clone().ctx(|| self.ctx())?;
        let stderr = self.file.try_clone().ctx(|| self.ctx())?;
        let status = cmd
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            .status()
            .ctx(|| format!("starting {:?}", cmd.get_program()))?;
        if status.success() {
            return Ok(());
        }
        Err(self.fail(&format!("{} failed ({status})", program(cmd))))
    }

    /// Like `run`, but returns the command's stdout (stderr goes to the log).
    pub(crate) fn output(&mut self, cmd: &mut Command) -> Result<String, ImageError> {
        self.note(&format!("$ {}", display(cmd)))?;
        let stderr = self.file.try_clone().ctx(|| self.ctx())?;
        let out = cmd
            .stdin(Stdio::null())
            .stderr(stderr)
            .output()
            .ctx(|| format!("starting {:?}", cmd.get_program()))?;
        if out.status.success() {
            return Ok(String::from_utf8_lossy(&out.stdout).into_owned());
        }
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let _ = self.note(stdout.trim_end());
        Err(self.fail(&format!("{} failed ({})", program(cmd), out.status)))
    }

    /// Appends a file (e.g. debootstrap's own log) to the build log.
    pub(crate) fn append_file(&mut self, path: &Path) {
        if let Ok(text) = std::fs::read(path) {
            let _ = self.note(&format!("--- {} ---", path.display()));
            let _ = self.file.write_all(&text);
            let _ = self.note("---");
        }
    }

    /// Records `message` in the log and makes the current step's failure
    /// error out of it (with the step's last lines).
    pub(crate) fn fail(&mut self, message: &str) -> ImageError {
        let _ = self.note(&format!("error: {message}"));
        ImageError::StepFailed {
            step: self.step.clone(),
            log_tail: self.tail(),
            log_path: self.path.clone(),
        }
    }

    fn tail(&mut self) -> String {
        let mut text = Vec::new();
        if self.file.seek(SeekFrom::Start(self.step_start)).is_err()
            || self.file.read_to_end(&mut text).is_err()
        {
            return String::new();
        }
        let text = String::from_utf8_lossy(&text);
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(TAIL_LINES)..].join("\n")
    }

    fn ctx(&self) -> String {
        format!("writing build log {}", self.path.display())
    }
}
