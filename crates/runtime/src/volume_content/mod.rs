//! A volume's files read and written by the host, from its file, while no
//! sandbox mounts it read-write: list, describe, read, write, make a
//! directory, change an owner or mode, remove (REST's
//! `/v1/volumes/{volume}/files`, E2B's volume content API).
//!
//! Why `debugfs` (e2fsprogs, which makes and grows the volumes already):
//! it reads and changes an ext4 image in user space. Mounting the file on
//! the host instead would hand a file system the guest wrote, byte for
//! byte, to the host's kernel, which is no parser of hostile input; and it
//! would need a loop device and a mount per call.
//!
//! What is true of the image is read back, never assumed: a write is
//! checked by describing the file it made (its type and size), a removal
//! by the path being gone. `debugfs` reports a failed command on its
//! standard error and exits 0, so its error lines are what it said.
//!
//! A guest that stopped without unmounting (every guest does: destroy
//! syncs, then stops QEMU) leaves committed changes in the journal that
//! are not yet in place, which `debugfs` does not read: the journal is
//! replayed first (`e2fsck -E journal_only`), under this volume's lock
//! held exclusively, whenever the superblock says it needs it.
//!
//! Calls on one volume are ordered by a lock of this process (reads
//! together, a change alone): a volume's file is served by its node's
//! process only. That no sandbox starts to mount the volume meanwhile is
//! the service's to see to (it leases the volume for the call).
//!
//! Paths are absolute in the volume (`/` its root), normalized, and free
//! of `"`, `\` and control characters (debugfs's command line quotes with
//! `"`). Bytes cross through anonymous files (`O_TMPFILE`), named to
//! debugfs by `/proc/self/fd`, so a crash leaves none behind.

mod parse;

use crate::volume_files::VolumeFiles;
use crate::{Result, RuntimeError};
use parse::{by_command, parse_listings, parse_stat, parse_stats};
use sandpit_protocol::{AgentError, ErrorKind, GUEST_UID};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use time::OffsetDateTime;
use tokio::process::Command;
use tokio::sync::RwLock;

/// The Debian package of the tools used here.
const PACKAGE: &str = "e2fsprogs";
/// The longest path taken.
const MAX_PATH_BYTES: usize = 4096;
/// The most entries one listing describes (deeper listings included).
pub const MAX_LIST_ENTRIES: usize = 50_000;
/// The deepest listing.
pub const MAX_LIST_DEPTH: u32 = 32;
/// How long one tool's run may take before it is killed.
const TOOL_BOUND: std::time::Duration = std::time::Duration::from_secs(600);
/// A new file's permission bits unless the call says.
pub const DEFAULT_FILE_MODE: u32 = 0o644;
/// A new directory's permission bits unless the call says.
pub const DEFAULT_DIR_MODE: u32 = 0o755;
/// Symbolic links followed to read a file, at most.
const MAX_LINKS_FOLLOWED: usize = 8;

/// What a path in a volume is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EntryKind {
    File,
    Directory,
    Symlink,
    /// A device, FIFO or socket: described, never read or written.
    Unknown,
}

/// One path of a volume, described.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeEntry {
    /// Its last component (`/` for the root).
    pub name: String,
    /// Absolute in the volume.
    pub path: String,
    pub kind: EntryKind,
    pub size: u64,
    /// Permission bits (`0o7777` at most).
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    #[serde(with = "time::serde::rfc3339")]
    pub atime: OffsetDateTime,
    #[serde(with = "time::serde::rfc3339")]
    pub mtime: OffsetDateTime,
    #[serde(with = "time::serde::rfc3339")]
    pub ctime: OffsetDateTime,
    /// A symbolic link's target, when the link is short enough to be kept
    /// in its inode (the common case).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
}

/// Who owns what a call makes, and its permission bits; unset: the
/// guest's user, and [`DEFAULT_FILE_MODE`] or [`DEFAULT_DIR_MODE`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ownership {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gid: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<u32>,
}

/// A call on a volume's files that moves no file content (those are
/// [`VolumeFiles::write_file`] and [`VolumeFiles::read_file`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "call", rename_all = "snake_case")]
pub enum VolumeCall {
    /// Describes a path (a symbolic link itself, not its target).
    Stat { path: String },
    /// What a directory holds, `depth` levels down (1: its entries).
    List { path: String, depth: u32 },
    /// Makes a directory; `parents` makes the missing ones above it too
    /// (each with the same owner and mode).
    MakeDir {
        path: String,
        #[serde(default)]
        owner: Ownership,
        #[serde(default)]
        parents: bool,
    },
    /// Changes what is set of a path's owner and permission bits.
    SetMeta {
        path: String,
        #[serde(default)]
        owner: Ownership,
    },
    /// Removes a path, a directory with all it holds.
    Remove { path: String },
}

impl VolumeCall {
    /// Whether the call changes the volume.
    pub fn changes(&self) -> bool {
        !matches!(self, VolumeCall::Stat { .. } | VolumeCall::List { .. })
    }
}

/// A path checked and normalized: absolute, without `.`, `..`, empty
/// components or a trailing `/`, and nothing debugfs's quoting cannot
/// carry.
pub fn check_path(path: &str) -> Result<String> {
    let refuse = |why: &str| {
        Err(RuntimeError::Agent(AgentError::new(
            ErrorKind::InvalidPath,
            format!("volume path {path:?} {why}"),
        )))
    };
    if !path.starts_with('/') {
        return refuse("is not absolute (the volume's root is /)");
    }
    if path.len() > MAX_PATH_BYTES {
        return refuse(&format!("is longer than {MAX_PATH_BYTES} bytes"));
    }
    if path
        .chars()
        .any(|c| c == '"' || c == '\\' || c.is_control())
    {
        return refuse("holds a quote, a backslash or a control character, which are not taken");
    }
    let mut parts = Vec::new();
    for part in path.split('/').filter(|p| !p.is_empty() && *p != ".") {
        if part == ".." {
            return refuse("holds `..`");
        }
        if part.len() > 255 {
            return refuse("has a name longer than 255 bytes");
        }
        parts.push(part);
    }
    Ok(format!("/{}", parts.join("/")))
}

fn parent_of(path: &str) -> Option<&str> {
    match path.rfind('/') {
        Some(0) if path.len() > 1 => Some("/"),
        Some(0) | None => None,
        Some(i) => Some(&path[..i]),
    }
}

fn name_of(path: &str) -> String {
    if path == "/" {
        return "/".into();
    }
    path.rsplit('/').next().unwrap_or(path).to_string()
}

fn typed(kind: ErrorKind, message: impl Into<String>) -> RuntimeError {
    RuntimeError::Agent(AgentError::new(kind, message))
}

/// One lock per volume file in this process: reads share it, a change
/// (and a journal replay) has it alone. Entries go when unused.
fn lock_of(file: &Path) -> Arc<RwLock<()>> {
    static LOCKS: OnceLock<Mutex<HashMap<PathBuf, Weak<RwLock<()>>>>> = OnceLock::new();
    let mut locks = LOCKS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    locks.retain(|_, lock| lock.strong_count() > 0);
    if let Some(lock) = locks.get(file).and_then(Weak::upgrade) {
        return lock;
    }
    let lock = Arc::new(RwLock::new(()));
    locks.insert(file.to_path_buf(), Arc::downgrade(&lock));
    lock
}

impl VolumeFiles {
    /// The volume's file, there: a missing one is not found.
    fn existing(&self, id: &str) -> Result<PathBuf> {
        let file = self.path(id)?;
        if !file.exists() {
            return Err(RuntimeError::NotFound(format!("volume {id}")));
        }
        Ok(file)
    }

    /// Runs a call that moves no content (see [`VolumeCall`]): what it
    /// describes (one entry; a listing's many; none for a removal).
    pub async fn call(&self, id: &str, call: VolumeCall) -> Result<Vec<VolumeEntry>> {
        let file = self.existing(id)?;
        let lock = lock_of(&file);
        let image = Image { file: &file };
        if call.changes() {
            let _alone = lock.write().await;
            image.replay_journal().await?;
            let out = image.change(call).await?;
            sync_file(&file)?;
            Ok(out)
        } else {
            let _reading = image.ready_to_read(&lock).await?;
            match call {
                VolumeCall::Stat { path } => Ok(vec![image.stat(&check_path(&path)?).await?]),
                VolumeCall::List { path, depth } => image.list(&check_path(&path)?, depth).await,
                _ => unreachable!("changes() says which calls change"),
            }
        }
    }

    /// Writes `content` (the whole of it, from its start) to `path`,
    /// making the directories above it that are missing (owned and
    /// moded as `owner` says, 0755 by default). An existing file is
    /// replaced only with `overwrite`, at once (the new file is made
    /// beside it, then takes its name); a directory never is. Returns
    /// the file made, once it is on disk.
    pub async fn write_file(
        &self,
        id: &str,
        path: &str,
        content: &std::fs::File,
        owner: Ownership,
        overwrite: bool,
    ) -> Result<VolumeEntry> {
        let path = check_path(path)?;
        if path == "/" {
            return Err(typed(ErrorKind::IsADirectory, "/ is the volume's root"));
        }
        let size = content
            .metadata()
            .map_err(RuntimeError::io("sizing an upload"))?
            .len();
        let file = self.existing(id)?;
        let lock = lock_of(&file);
        let _alone = lock.write().await;
        let image = Image { file: &file };
        image.replay_journal().await?;
        let parent = parent_of(&path).unwrap_or("/");
        let dir_owner = Ownership {
            mode: Some(DEFAULT_DIR_MODE),
            ..owner
        };
        image.make_dirs(parent, dir_owner).await?;
        let replaced = match image.lookup(&path).await? {
            Some(e) if e.kind == EntryKind::Directory => {
                return Err(typed(
                    ErrorKind::IsADirectory,
                    format!("{path} is a directory"),
                ))
            }
            Some(_) if !overwrite => {
                return Err(typed(
                    ErrorKind::AlreadyExists,
                    format!("{path} exists; ask to overwrite it"),
                ))
            }
            Some(_) => true,
            None => false,
        };
        // Made under a name of its own in the same directory, then
        // linked in place of the old one: no moment without a whole file.
        let making = format!(
            "{}/.sandpit-upload-{:016x}",
            if parent == "/" { "" } else { parent },
            rand::random::<u64>()
        );
        let source = fd_path(content);
        let mut script = vec![
            format!("write \"{source}\" \"{making}\""),
            format!("sif \"{making}\" uid {}", owner.uid.unwrap_or(GUEST_UID)),
            format!("sif \"{making}\" gid {}", owner.gid.unwrap_or(GUEST_UID)),
            format!(
                "sif \"{making}\" mode 0{:o}",
                0o100000 | (owner.mode.unwrap_or(DEFAULT_FILE_MODE) & 0o7777)
            ),
        ];
        let said = image.debugfs(true, &script).await?;
        // debugfs sizes the inode before it copies: a copy that failed
        // (the volume full) is known by what it said.
        match image.lookup(&making).await? {
            Some(e) if e.kind == EntryKind::File && e.size == size && said.errors.is_empty() => {}
            made => {
                if made.is_some() {
                    let _ = image.debugfs(true, &[format!("rm \"{making}\"")]).await;
                }
                let why = if said.errors.is_empty() {
                    "the file made is not the file sent".to_string()
                } else {
                    said.errors.join("; ")
                };
                let full = ["space", "No free", "allocat"]
                    .iter()
                    .any(|w| why.contains(w));
                return Err(if full {
                    typed(
                        ErrorKind::Io,
                        format!("{path} does not fit: the volume is full ({why}); grow it"),
                    )
                } else {
                    RuntimeError::ToolFailed {
                        tool: "debugfs".into(),
                        what: format!("writing {path}"),
                        detail: why,
                    }
                });
            }
        }
        script.clear();
        if replaced {
            script.push(format!("rm \"{path}\""));
        }
        // `ln` and `unlink` leave link counts alone: the inode keeps its
        // one link, now by the new name.
        script.push(format!("ln \"{making}\" \"{path}\""));
        script.push(format!("unlink \"{making}\""));
        let said = image.debugfs(true, &script).await?;
        let entry = image.lookup(&path).await?;
        match entry {
            Some(e) if e.kind == EntryKind::File && e.size == size => {
                sync_file(&file)?;
                Ok(e)
            }
            _ => Err(RuntimeError::ToolFailed {
                tool: "debugfs".into(),
                what: format!("putting {path} in place"),
                detail: said.errors.join("; "),
            }),
        }
    }

    /// Copies regular file `path` (symbolic links followed, inside the
    /// volume) into `to`, from its start: what was copied.
    pub async fn read_file(&self, id: &str, path: &str, to: &std::fs::File) -> Result<VolumeEntry> {
        let mut path = check_path(path)?;
        let file = self.existing(id)?;
        let lock = lock_of(&file);
        let _reading = Image { file: &file }.ready_to_read(&lock).await?;
        let image = Image { file: &file };
        for _ in 0..=MAX_LINKS_FOLLOWED {
            let entry = image.stat(&path).await?;
            match entry.kind {
                EntryKind::File => {
                    let said = image
                        .debugfs(false, &[format!("dump \"{path}\" \"{}\"", fd_path(to))])
                        .await?;
                    let got = to
                        .metadata()
                        .map_err(RuntimeError::io("sizing a download"))?
                        .len();
                    if got != entry.size {
                        return Err(RuntimeError::ToolFailed {
                            tool: "debugfs".into(),
                            what: format!("reading {path}"),
                            detail: format!(
                                "{got} bytes of {} ({})",
                                entry.size,
                                said.errors.join("; ")
                            ),
                        });
                    }
                    return Ok(entry);
                }
                EntryKind::Directory => {
                    return Err(typed(
                        ErrorKind::IsADirectory,
                        format!("{path} is a directory"),
                    ))
                }
                EntryKind::Symlink => {
                    let Some(target) = entry.target else {
                        return Err(typed(
                            ErrorKind::Unsupported,
                            format!("{path} is a symbolic link too long to follow here"),
                        ));
                    };
                    let joined = if target.starts_with('/') {
                        target
                    } else {
                        format!("{}/{target}", parent_of(&path).unwrap_or(""))
                    };
                    path = resolve_dots(&joined)?;
                }
                EntryKind::Unknown => {
                    return Err(typed(
                        ErrorKind::Unsupported,
                        format!("{path} is not a regular file"),
                    ))
                }
            }
        }
        Err(typed(
            ErrorKind::InvalidPath,
            format!("more than {MAX_LINKS_FOLLOWED} symbolic links from {path}"),
        ))
    }
}

/// A link's target made absolute: `.` and `..` resolved (never above the
/// volume's root), then checked.
fn resolve_dots(path: &str) -> Result<String> {
    let mut parts: Vec<&str> = Vec::new();
    for part in path.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            p => parts.push(p),
        }
    }
    check_path(&format!("/{}", parts.join("/")))
}

/// An open file as a path another process opens (it need not have a name:
/// the link works for anonymous and removed files too).
fn fd_path(file: &std::fs::File) -> String {
    use std::os::fd::AsRawFd;
    format!("/proc/{}/fd/{}", std::process::id(), file.as_raw_fd())
}

/// What a debugfs run said: its standard output, and its error lines (its
/// banner left out).
struct Said {
    out: String,
    errors: Vec<String>,
}

/// One volume's image, as the tools see it.
struct Image<'a> {
    file: &'a Path,
}

/// ext4's superblock: where it starts, where its incompatible features
/// are in it, and the one saying the journal needs a replay.
const SUPERBLOCK_AT: u64 = 1024;
const INCOMPAT_AT: u64 = 0x60;
const INCOMPAT_RECOVER: u32 = 0x4;

impl Image<'_> {
    /// Whether the journal holds changes not yet in place.
    fn needs_replay(&self) -> Result<bool> {
        use std::os::unix::fs::FileExt;
        let mut word = [0u8; 4];
        std::fs::File::open(self.file)
            .and_then(|f| f.read_exact_at(&mut word, SUPERBLOCK_AT + INCOMPAT_AT))
            .map_err(RuntimeError::io(format!("reading {}", self.file.display())))?;
        Ok(u32::from_le_bytes(word) & INCOMPAT_RECOVER != 0)
    }

    /// Puts the journal's committed changes in place, if it holds any.
    /// The caller has the volume alone.
    async fn replay_journal(&self) -> Result<()> {
        if !self.needs_replay()? {
            return Ok(());
        }
        let what = "replaying a volume's journal";
        let out = bounded(
            Command::new("e2fsck")
                .args(["-p", "-E", "journal_only"])
                .arg(self.file),
            "e2fsck",
            what,
        )
        .await?;
        match out.status.code() {
            Some(0..=2) => sync_file(self.file),
            _ => Err(failed("e2fsck", what, &out)),
        }
    }

    /// The lock held for reading, the journal replayed first if it needs
    /// it (under the lock alone, then taken again for reading).
    async fn ready_to_read<'l>(
        &self,
        lock: &'l Arc<RwLock<()>>,
    ) -> Result<tokio::sync::RwLockReadGuard<'l, ()>> {
        if self.needs_replay()? {
            let _alone = lock.write().await;
            self.replay_journal().await?;
        }
        Ok(lock.read().await)
    }

    /// Runs debugfs's commands on the image (`write`: opened to change).
    async fn debugfs(&self, write: bool, commands: &[String]) -> Result<Said> {
        use std::process::Stdio;
        let mut cmd = Command::new("debugfs");
        if write {
            cmd.arg("-w");
        }
        cmd.args(["-f", "-"])
            .arg(self.file)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let what = "reading or changing a volume's files";
        let mut child = cmd
            .spawn()
            .map_err(RuntimeError::spawn("debugfs", PACKAGE, what))?;
        let mut stdin = child.stdin.take().expect("piped");
        let mut script = String::new();
        for c in commands {
            script.push_str(c);
            script.push('\n');
        }
        let feed = async move {
            use tokio::io::AsyncWriteExt;
            let _ = stdin.write_all(script.as_bytes()).await;
        };
        let (_, out) = tokio::join!(
            feed,
            tokio::time::timeout(TOOL_BOUND, child.wait_with_output())
        );
        let out = out
            .map_err(|_| RuntimeError::ToolFailed {
                tool: "debugfs".into(),
                what: what.into(),
                detail: format!("no answer within {} s", TOOL_BOUND.as_secs()),
            })?
            .map_err(RuntimeError::io("running debugfs"))?;
        if !out.status.success() {
            return Err(failed("debugfs", what, &out));
        }
        let errors = String::from_utf8_lossy(&out.stderr)
            .lines()
            .filter(|l| !l.starts_with("debugfs ") && !l.trim().is_empty())
            .map(str::to_string)
            .collect();
        Ok(Said {
            out: String::from_utf8_lossy(&out.stdout).into_owned(),
            errors,
        })
    }

    /// Describes `path`, or says it is not there.
    async fn lookup(&self, path: &str) -> Result<Option<VolumeEntry>> {
        let said = self.debugfs(false, &[format!("stat \"{path}\"")]).await?;
        match parse_stats(&said.out).into_iter().next() {
            Some((_, Some(entry))) => Ok(Some(entry)),
            // Nothing by that name, or a file where a directory was to be
            // on its way: not there either.
            _ if said
                .errors
                .iter()
                .any(|e| e.contains("not found") || e.contains("not a directory")) =>
            {
                Ok(None)
            }
            _ if said.errors.is_empty() => Ok(None),
            _ => Err(RuntimeError::ToolFailed {
                tool: "debugfs".into(),
                what: format!("describing {path}"),
                detail: said.errors.join("; "),
            }),
        }
    }

    async fn stat(&self, path: &str) -> Result<VolumeEntry> {
        self.lookup(path)
            .await?
            .ok_or_else(|| typed(ErrorKind::NotFound, format!("{path} is not in the volume")))
    }

    /// What directory `path` holds, `depth` levels down, breadth first.
    async fn list(&self, path: &str, depth: u32) -> Result<Vec<VolumeEntry>> {
        let top = self.stat(path).await?;
        if top.kind != EntryKind::Directory {
            return Err(typed(
                ErrorKind::NotADirectory,
                format!("{path} is not a directory"),
            ));
        }
        let depth = depth.clamp(1, MAX_LIST_DEPTH);
        let mut out = Vec::new();
        let mut level = vec![path.to_string()];
        for _ in 0..depth {
            if level.is_empty() {
                break;
            }
            let commands: Vec<String> = level.iter().map(|d| format!("ls -p \"{d}\"")).collect();
            let said = self.debugfs(false, &commands).await?;
            // Each entry's inode, then its path: entries are described
            // by inode (`stat <n>`), which costs no lookup by name in a
            // directory of thousands.
            let mut paths: Vec<(u64, String)> = Vec::new();
            for (dir, names) in parse_listings(&said.out) {
                for (inode, name) in names {
                    let p = if dir == "/" {
                        format!("/{name}")
                    } else {
                        format!("{dir}/{name}")
                    };
                    // A name debugfs's quoting cannot carry is left out:
                    // it could not be asked for by name either.
                    if check_path(&p).is_ok() {
                        paths.push((inode, p));
                    }
                }
            }
            if out.len() + paths.len() > MAX_LIST_ENTRIES {
                return Err(typed(
                    ErrorKind::TooLarge,
                    format!(
                        "{path} holds more than {MAX_LIST_ENTRIES} entries at this depth; \
                         list a directory below it, or less deep"
                    ),
                ));
            }
            level.clear();
            if paths.is_empty() {
                continue;
            }
            let commands: Vec<String> = paths.iter().map(|(i, _)| format!("stat <{i}>")).collect();
            let said = self.debugfs(false, &commands).await?;
            let described: HashMap<String, Vec<&str>> = by_command(&said.out).into_iter().collect();
            for (inode, p) in paths {
                let Some(entry) = described
                    .get(&format!("<{inode}>"))
                    .and_then(|lines| parse_stat(&p, lines))
                else {
                    continue;
                };
                if entry.kind == EntryKind::Directory {
                    level.push(entry.path.clone());
                }
                out.push(entry);
            }
        }
        Ok(out)
    }

    /// Makes `path` and the directories above it that are missing.
    async fn make_dirs(&self, path: &str, owner: Ownership) -> Result<()> {
        let mut missing = Vec::new();
        let mut at = Some(path);
        while let Some(dir) = at {
            match self.lookup(dir).await? {
                Some(e) if e.kind == EntryKind::Directory => break,
                Some(_) => {
                    return Err(typed(
                        ErrorKind::NotADirectory,
                        format!("{dir} is not a directory"),
                    ))
                }
                None => missing.push(dir.to_string()),
            }
            at = parent_of(dir);
        }
        if missing.is_empty() {
            return Ok(());
        }
        let mut script = Vec::new();
        for dir in missing.iter().rev() {
            script.extend(made_dir_commands(dir, owner));
        }
        let said = self.debugfs(true, &script).await?;
        match self.lookup(path).await? {
            Some(e) if e.kind == EntryKind::Directory => Ok(()),
            _ => Err(typed(
                ErrorKind::Io,
                format!("making {path}: {}", said.errors.join("; ")),
            )),
        }
    }

    /// Runs a call that changes the volume (the caller has it alone).
    async fn change(&self, call: VolumeCall) -> Result<Vec<VolumeEntry>> {
        match call {
            VolumeCall::MakeDir {
                path,
                owner,
                parents,
            } => {
                let path = check_path(&path)?;
                if self.lookup(&path).await?.is_some() {
                    return Err(typed(
                        ErrorKind::AlreadyExists,
                        format!("{path} exists already"),
                    ));
                }
                let parent = parent_of(&path).unwrap_or("/");
                if parents {
                    self.make_dirs(parent, owner).await?;
                } else {
                    match self.lookup(parent).await? {
                        Some(e) if e.kind == EntryKind::Directory => {}
                        Some(_) => {
                            return Err(typed(
                                ErrorKind::NotADirectory,
                                format!("{parent} is not a directory"),
                            ))
                        }
                        None => {
                            return Err(typed(
                                ErrorKind::NotFound,
                                format!("{parent} is not in the volume (ask to make parents)"),
                            ))
                        }
                    }
                }
                self.make_dirs(&path, owner).await?;
                Ok(vec![self.stat(&path).await?])
            }
            VolumeCall::SetMeta { path, owner } => {
                let path = check_path(&path)?;
                let entry = self.stat(&path).await?;
                let mut script = Vec::new();
                if let Some(uid) = owner.uid {
                    script.push(format!("sif \"{path}\" uid {uid}"));
                }
                if let Some(gid) = owner.gid {
                    script.push(format!("sif \"{path}\" gid {gid}"));
                }
                if let Some(mode) = owner.mode {
                    if mode & !0o7777 != 0 {
                        return Err(typed(
                            ErrorKind::InvalidRequest,
                            format!("mode {mode:o} has bits past permissions (0o7777)"),
                        ));
                    }
                    let Some(bits) = type_bits(entry.kind) else {
                        return Err(typed(
                            ErrorKind::Unsupported,
                            format!("{path} is a device, FIFO or socket: its mode is kept"),
                        ));
                    };
                    script.push(format!("sif \"{path}\" mode 0{:o}", bits | mode));
                }
                if !script.is_empty() {
                    self.debugfs(true, &script).await?;
                }
                Ok(vec![self.stat(&path).await?])
            }
            VolumeCall::Remove { path } => {
                let path = check_path(&path)?;
                if path == "/" {
                    return Err(typed(
                        ErrorKind::InvalidPath,
                        "the volume's root cannot be removed (remove what it holds)",
                    ));
                }
                let entry = self.stat(&path).await?;
                let mut script = Vec::new();
                if entry.kind == EntryKind::Directory {
                    let below = self.list(&path, MAX_LIST_DEPTH).await?;
                    // Deepest first: a directory is empty when removed.
                    let mut below: Vec<&VolumeEntry> = below.iter().collect();
                    below.sort_by_key(|e| std::cmp::Reverse(e.path.matches('/').count()));
                    for e in below {
                        script.push(remove_command(e));
                    }
                }
                script.push(remove_command(&entry));
                let said = self.debugfs(true, &script).await?;
                if self.lookup(&path).await?.is_some() {
                    return Err(RuntimeError::ToolFailed {
                        tool: "debugfs".into(),
                        what: format!("removing {path}"),
                        detail: said.errors.join("; "),
                    });
                }
                Ok(Vec::new())
            }
            VolumeCall::Stat { .. } | VolumeCall::List { .. } => {
                unreachable!("a call that changes nothing")
            }
        }
    }
}

/// The mode's type bits of a file, directory or link (kept as they are
/// by a mode change).
fn type_bits(kind: EntryKind) -> Option<u32> {
    match kind {
        EntryKind::File => Some(0o100000),
        EntryKind::Directory => Some(0o040000),
        EntryKind::Symlink => Some(0o120000),
        EntryKind::Unknown => None,
    }
}

fn made_dir_commands(dir: &str, owner: Ownership) -> Vec<String> {
    vec![
        format!("mkdir \"{dir}\""),
        format!("sif \"{dir}\" uid {}", owner.uid.unwrap_or(GUEST_UID)),
        format!("sif \"{dir}\" gid {}", owner.gid.unwrap_or(GUEST_UID)),
        format!(
            "sif \"{dir}\" mode 0{:o}",
            0o040000 | (owner.mode.unwrap_or(DEFAULT_DIR_MODE) & 0o7777)
        ),
    ]
}

fn remove_command(entry: &VolumeEntry) -> String {
    match entry.kind {
        EntryKind::Directory => format!("rmdir \"{}\"", entry.path),
        _ => format!("rm \"{}\"", entry.path),
    }
}

/// Runs `cmd` to its end within [`TOOL_BOUND`].
async fn bounded(cmd: &mut Command, tool: &str, what: &str) -> Result<std::process::Output> {
    cmd.kill_on_drop(true);
    tokio::time::timeout(TOOL_BOUND, cmd.output())
        .await
        .map_err(|_| RuntimeError::ToolFailed {
            tool: tool.into(),
            what: what.into(),
            detail: format!("no answer within {} s", TOOL_BOUND.as_secs()),
        })?
        .map_err(RuntimeError::spawn(tool, PACKAGE, what))
}

fn failed(tool: &str, what: &str, out: &std::process::Output) -> RuntimeError {
    let said = String::from_utf8_lossy(&out.stderr);
    RuntimeError::ToolFailed {
        tool: tool.into(),
        what: what.into(),
        detail: format!("{} ({})", out.status, said.trim()),
    }
}

fn sync_file(path: &Path) -> Result<()> {
    std::fs::File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(RuntimeError::io(format!("syncing {}", path.display())))
}

impl VolumeFiles {
    /// An anonymous file in the volumes' directory (on the disk that
    /// holds them) for a call's bytes: gone when closed, whatever happens.
    pub fn scratch_file(&self) -> Result<std::fs::File> {
        let dir = self.dir();
        std::fs::create_dir_all(dir)
            .map_err(RuntimeError::io(format!("creating {}", dir.display())))?;
        tempfile::tempfile_in(dir).map_err(RuntimeError::io(format!(
            "making a scratch file in {}",
            dir.display()
        )))
    }
}

/// Writes all of `bytes` to `file` at its end (a scratch file being
/// filled).
pub fn append(mut file: &std::fs::File, bytes: &[u8]) -> Result<()> {
    file.write_all(bytes)
        .map_err(RuntimeError::io("filling a scratch file"))
}

#[cfg(test)]
mod tests {
    //! Real images, made by `VolumeFiles::create`, read and changed by the
    //! real tools (e2fsprogs is a dependency of the host).
    use super::*;

    const MIB: u64 = 1024 * 1024;

    async fn volume() -> (tempfile::TempDir, VolumeFiles) {
        let dir = tempfile::tempdir().unwrap();
        let files = VolumeFiles::new(dir.path().join("volumes"));
        files.create("vol_t", 64 * MIB).await.unwrap();
        (dir, files)
    }

    fn scratch_with(files: &VolumeFiles, bytes: &[u8]) -> std::fs::File {
        let f = files.scratch_file().unwrap();
        append(&f, bytes).unwrap();
        f
    }

    async fn read(files: &VolumeFiles, path: &str) -> Result<Vec<u8>> {
        use std::io::Read;
        let mut to = files.scratch_file().unwrap();
        files.read_file("vol_t", path, &to).await?;
        let mut bytes = Vec::new();
        to.read_to_end(&mut bytes).unwrap();
        Ok(bytes)
    }

    fn kind_of(e: RuntimeError) -> ErrorKind {
        match e {
            RuntimeError::Agent(a) => a.kind,
            other => panic!("not a typed file error: {other}"),
        }
    }

    #[tokio::test]
    async fn files_round_trip_through_a_volume_image() {
        let (_dir, files) = volume().await;
        // Binary content, every byte value, past one block.
        let bytes: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 256) as u8).collect();
        let made = files
            .write_file(
                "vol_t",
                "/deep/er/data.bin",
                &scratch_with(&files, &bytes),
                Ownership::default(),
                false,
            )
            .await
            .unwrap();
        assert_eq!(made.kind, EntryKind::File);
        assert_eq!(made.size, bytes.len() as u64);
        assert_eq!(
            (made.uid, made.gid, made.mode),
            (GUEST_UID, GUEST_UID, 0o644)
        );
        assert!(
            (OffsetDateTime::now_utc() - made.mtime)
                .whole_seconds()
                .abs()
                < 60
        );
        assert_eq!(read(&files, "/deep/er/data.bin").await.unwrap(), bytes);
        // The parents were made for the guest's user.
        let deep = &files
            .call(
                "vol_t",
                VolumeCall::Stat {
                    path: "/deep".into(),
                },
            )
            .await
            .unwrap()[0];
        assert_eq!(
            (deep.kind, deep.uid, deep.mode),
            (EntryKind::Directory, GUEST_UID, 0o755)
        );

        // No overwrite unless asked; then replaced whole.
        let again = files
            .write_file(
                "vol_t",
                "/deep/er/data.bin",
                &scratch_with(&files, b"new"),
                Ownership::default(),
                false,
            )
            .await
            .unwrap_err();
        assert_eq!(kind_of(again), ErrorKind::AlreadyExists);
        let owner = Ownership {
            uid: Some(0),
            gid: Some(0),
            mode: Some(0o600),
        };
        files
            .write_file(
                "vol_t",
                "/deep/er/data.bin",
                &scratch_with(&files, b"new"),
                owner,
                true,
            )
            .await
            .unwrap();
        assert_eq!(read(&files, "/deep/er/data.bin").await.unwrap(), b"new");

        // A listing, one level and two; names with spaces; the lost+found
        // mkfs makes is there too.
        files
            .call(
                "vol_t",
                VolumeCall::MakeDir {
                    path: "/a dir".into(),
                    owner: Ownership::default(),
                    parents: false,
                },
            )
            .await
            .unwrap();
        let top = files
            .call(
                "vol_t",
                VolumeCall::List {
                    path: "/".into(),
                    depth: 1,
                },
            )
            .await
            .unwrap();
        let mut names: Vec<&str> = top.iter().map(|e| e.path.as_str()).collect();
        names.sort();
        assert_eq!(names, ["/a dir", "/deep", "/lost+found"]);
        let two = files
            .call(
                "vol_t",
                VolumeCall::List {
                    path: "/deep".into(),
                    depth: 2,
                },
            )
            .await
            .unwrap();
        let data = two
            .iter()
            .find(|e| e.path == "/deep/er/data.bin")
            .expect("depth 2");
        assert_eq!((data.uid, data.mode, data.size), (0, 0o600, 3));

        // Metadata changed; a mode past permissions refused.
        let changed = files
            .call(
                "vol_t",
                VolumeCall::SetMeta {
                    path: "/deep/er/data.bin".into(),
                    owner: Ownership {
                        uid: Some(1234),
                        gid: None,
                        mode: Some(0o640),
                    },
                },
            )
            .await
            .unwrap();
        assert_eq!(
            (changed[0].uid, changed[0].gid, changed[0].mode),
            (1234, 0, 0o640)
        );
        assert_eq!(changed[0].kind, EntryKind::File);

        // Removal of a tree; then nothing there.
        files
            .call(
                "vol_t",
                VolumeCall::Remove {
                    path: "/deep".into(),
                },
            )
            .await
            .unwrap();
        let gone = files
            .call(
                "vol_t",
                VolumeCall::Stat {
                    path: "/deep/er".into(),
                },
            )
            .await
            .unwrap_err();
        assert_eq!(kind_of(gone), ErrorKind::NotFound);
        // The file system is clean after all of it.
        let fsck = std::process::Command::new("e2fsck")
            .args(["-f", "-n"])
            .arg(files.path("vol_t").unwrap())
            .output()
            .unwrap();
        assert!(fsck.status.success(), "e2fsck: {fsck:?}");
    }

    #[tokio::test]
    async fn bad_paths_and_wrong_kinds_are_typed_refusals() {
        let (_dir, files) = volume().await;
        for bad in [
            "relative",
            "/a/../b",
            "/quote\"d",
            "/back\\slash",
            "/new\nline",
        ] {
            let e = files
                .call("vol_t", VolumeCall::Stat { path: bad.into() })
                .await
                .unwrap_err();
            assert_eq!(kind_of(e), ErrorKind::InvalidPath, "{bad:?}");
        }
        assert_eq!(
            kind_of(read(&files, "/").await.unwrap_err()),
            ErrorKind::IsADirectory
        );
        assert_eq!(
            kind_of(read(&files, "/nothing").await.unwrap_err()),
            ErrorKind::NotFound
        );
        let e = files
            .call("vol_t", VolumeCall::Remove { path: "/".into() })
            .await
            .unwrap_err();
        assert_eq!(kind_of(e), ErrorKind::InvalidPath);
        let e = files
            .call(
                "vol_t",
                VolumeCall::MakeDir {
                    path: "/x/y".into(),
                    owner: Ownership::default(),
                    parents: false,
                },
            )
            .await
            .unwrap_err();
        assert_eq!(kind_of(e), ErrorKind::NotFound);
        let e = files
            .call(
                "vol_t",
                VolumeCall::List {
                    path: "/".into(),
                    depth: 1,
                },
            )
            .await;
        assert!(e.is_ok());
        assert!(matches!(
            files
                .call("vol_missing", VolumeCall::Stat { path: "/".into() })
                .await,
            Err(RuntimeError::NotFound(_))
        ));
    }

    #[tokio::test]
    async fn a_full_volume_refuses_a_write_and_keeps_the_old_file() {
        let (_dir, files) = volume().await;
        files
            .write_file(
                "vol_t",
                "/keep",
                &scratch_with(&files, b"old"),
                Ownership::default(),
                false,
            )
            .await
            .unwrap();
        let big = vec![1u8; 80 * MIB as usize];
        let e = files
            .write_file(
                "vol_t",
                "/keep",
                &scratch_with(&files, &big),
                Ownership::default(),
                true,
            )
            .await
            .unwrap_err();
        assert_eq!(kind_of(e), ErrorKind::Io);
        assert_eq!(read(&files, "/keep").await.unwrap(), b"old");
        let top = files
            .call(
                "vol_t",
                VolumeCall::List {
                    path: "/".into(),
                    depth: 1,
                },
            )
            .await
            .unwrap();
        assert!(
            top.iter().all(|e| !e.name.starts_with(".sandpit-upload")),
            "a failed write left its file: {top:?}"
        );
    }
}
