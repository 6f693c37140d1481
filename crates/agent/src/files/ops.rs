//! The file operations themselves, as a file process runs them: as the
//! guest user, in a process of its own (see the module above), so that the
//! kernel decides everything the user may read, list, make, change and
//! remove. Paths come resolved (absolute, `..` folded).
//!
//! Writes go to a temporary file in the target's directory, renamed over the
//! target at the end, so a reader never sees half a file.

use super::io_error;
use super::link::{self, Frame};
use crate::sys;
use sandpit_protocol::{
    AgentError, DoneResult, ErrorKind, FileEntry, FileKind, PathCall, PathEntry, CHUNK_LEN,
    MAX_LISTING_BYTES,
};
use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::fs::{self, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering as AtomicOrdering};

pub fn kind_of(t: fs::FileType) -> FileKind {
    if t.is_symlink() {
        FileKind::Symlink
    } else if t.is_dir() {
        FileKind::Dir
    } else if t.is_file() {
        FileKind::File
    } else {
        FileKind::Other
    }
}

// ---- write ------------------------------------------------------------

static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Removes the temporary file unless the write completed.
struct TempFile(Option<PathBuf>);

impl Drop for TempFile {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = fs::remove_file(p);
        }
    }
}

fn create_parent(dir: &Path) -> Result<(), AgentError> {
    match fs::create_dir_all(dir) {
        Ok(()) => Ok(()),
        // mkdir found a file where a directory should be.
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Err(AgentError::new(
            ErrorKind::NotADirectory,
            format!("{}: a path component is not a directory", dir.display()),
        )),
        Err(e) => Err(io_error(&e, &dir.to_string_lossy())),
    }
}

/// Write the `size` bytes `data` gives to `target`. `Ok(None)` means the
/// data ended before that (the upload was cut: nothing is written, nobody to
/// tell). With `sync`, the file and the rename are on the device before the
/// answer.
pub fn write_file(
    target: &str,
    size: u64,
    mode: Option<u32>,
    sync: bool,
    data: &mut impl Read,
) -> Result<Option<DoneResult>, AgentError> {
    let target = target.to_string();
    let target_path = Path::new(&target);
    let (Some(dir), Some(_)) = (target_path.parent(), target_path.file_name()) else {
        return Err(AgentError::new(
            ErrorKind::IsADirectory,
            format!("{target} is a directory"),
        ));
    };
    if fs::symlink_metadata(target_path).is_ok_and(|m| m.is_dir()) {
        return Err(AgentError::new(
            ErrorKind::IsADirectory,
            format!("{target} is a directory"),
        ));
    }
    create_parent(dir)?;
    let n = TEMP_COUNTER.fetch_add(1, AtomicOrdering::SeqCst);
    let tmp_path = dir.join(format!(".sandpit-upload-{}-{n}.tmp", std::process::id()));
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_CLOEXEC)
        .open(&tmp_path)
        .map_err(|e| io_error(&e, &target))?;
    let tmp = TempFile(Some(tmp_path));
    let mut written: u64 = 0;
    let mut buf = vec![0u8; CHUNK_LEN.min(size as usize).max(1)];
    while written < size {
        let want = (size - written).min(buf.len() as u64) as usize;
        let n = match data.read(&mut buf[..want]) {
            Ok(0) => return Ok(None),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            // The agent's end of the data is gone: as cut.
            Err(_) => return Ok(None),
        };
        file.write_all(&buf[..n])
            .map_err(|e| io_error(&e, &target))?;
        written += n as u64;
    }
    let mode = mode.unwrap_or(0o644) & 0o7777;
    file.set_permissions(fs::Permissions::from_mode(mode))
        .map_err(|e| io_error(&e, &target))?;
    // On a volume, written means on its device: it outlives this VM.
    if sync {
        file.sync_all().map_err(|e| io_error(&e, &target))?;
    }
    drop(file);
    let tmp_path = tmp.0.as_ref().expect("still armed");
    match fs::rename(tmp_path, target_path) {
        Ok(()) => {}
        Err(e)
            if matches!(
                sys::errno(&e),
                libc::EISDIR | libc::ENOTEMPTY | libc::EEXIST
            ) =>
        {
            return Err(AgentError::new(
                ErrorKind::IsADirectory,
                format!("{target} is a directory"),
            ));
        }
        Err(e) => return Err(io_error(&e, &target)),
    }
    let mut tmp = tmp;
    tmp.0 = None;
    if sync {
        // The rename, too.
        fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| io_error(&e, &target))?;
    }
    Ok(Some(DoneResult::Written {
        path: target,
        bytes: written,
    }))
}

// ---- read -------------------------------------------------------------

/// What a read made of its file.
pub enum ReadOutcome {
    /// Sent through the request's socket ([`Frame::Info`], [`Frame::Data`]).
    Sent(DoneResult),
    /// Opened, on a filesystem that checks rights only at open: the agent
    /// reads it through this descriptor (see [`Frame::Opened`]).
    Opened { file: fs::File, size: u64 },
}

/// Filesystems whose reads check nothing the open did not (disk and memory
/// ones): a descriptor the user's process opened reads there exactly what
/// the user may, whoever reads it. Not `proc`, `sysfs` and their kind,
/// whose files may check the reader's credentials at each read.
const OPEN_CHECKED: [i64; 6] = [
    0xEF53,      // ext2/3/4
    0x0102_1994, // tmpfs
    0x794C_7630, // overlayfs
    0x5846_5342, // xfs
    0x9123_683E, // btrfs
    0x4D44,      // vfat
];

fn checked_at_open(file: &fs::File) -> bool {
    use std::os::fd::AsRawFd;
    // SAFETY: fstatfs on an open descriptor into a zeroed struct.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    (unsafe { libc::fstatfs(file.as_raw_fd(), &mut st) } == 0)
        && OPEN_CHECKED.contains(&(st.f_type as i64))
}

/// Read the regular file `target`, refused past `max_bytes`: opened here,
/// as the user; sent through `out` ([`Frame::Info`], then its bytes as
/// [`Frame::Data`] of at most [`CHUNK_LEN`]), or, where reads check nothing
/// more than the open, handed over whole. The outcome is the caller's to
/// send.
pub fn read_file(
    out: &mut impl Write,
    target: &str,
    max_bytes: u64,
) -> Result<ReadOutcome, AgentError> {
    // O_NONBLOCK so a FIFO cannot hang the open; it means nothing for
    // regular files, the only kind that is read.
    let mut file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_CLOEXEC | libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(target)
        .map_err(|e| io_error(&e, target))?;
    let meta = file.metadata().map_err(|e| io_error(&e, target))?;
    if meta.is_dir() {
        return Err(AgentError::new(
            ErrorKind::IsADirectory,
            format!("{target} is a directory"),
        ));
    }
    if !meta.is_file() {
        return Err(AgentError::new(
            ErrorKind::InvalidRequest,
            format!("{target} is not a regular file"),
        ));
    }
    let too_large = |size: String| {
        AgentError::new(
            ErrorKind::TooLarge,
            format!("{target} is {size} bytes, more than max_bytes {max_bytes}"),
        )
    };
    let size = meta.len();
    if size == 0 {
        // Possibly a procfs/sysfs file, whose size is only known by reading:
        // read in whole pieces of CHUNK_LEN (some such files, as
        // `/proc/self/pagemap`, refuse reads of sizes not a multiple of
        // their records'), until past max_bytes or at the end.
        let mut content = Vec::new();
        let mut piece = vec![0u8; CHUNK_LEN];
        while content.len() as u64 <= max_bytes {
            match file.read(&mut piece) {
                Ok(0) => break,
                Ok(n) => content.extend_from_slice(&piece[..n]),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(io_error(&e, target)),
            }
        }
        if content.len() as u64 > max_bytes {
            return Err(too_large(
                "at least ".to_string() + &content.len().to_string(),
            ));
        }
        let size = content.len() as u64;
        return send_content(out, target, size, &mut &content[..]).map(ReadOutcome::Sent);
    }
    if size > max_bytes {
        return Err(too_large(size.to_string()));
    }
    if checked_at_open(&file) {
        return Ok(ReadOutcome::Opened { file, size });
    }
    send_content(out, target, size, &mut file).map(ReadOutcome::Sent)
}

fn send_content(
    out: &mut impl Write,
    path: &str,
    size: u64,
    src: &mut dyn Read,
) -> Result<DoneResult, AgentError> {
    let gone = |e: io::Error| io_error(&e, "the agent's end");
    link::write_frame(
        out,
        &Frame::Info {
            path: path.to_string(),
            size,
        },
    )
    .map_err(gone)?;
    let mut buf = vec![0u8; CHUNK_LEN.min(size as usize).max(1)];
    let mut sent: u64 = 0;
    while sent < size {
        let want = (size - sent).min(buf.len() as u64) as usize;
        let n = match src.read(&mut buf[..want]) {
            Ok(0) => break, // the file shrank meanwhile
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(io_error(&e, path)),
        };
        link::write_frame(out, &Frame::Data(buf[..n].to_vec())).map_err(gone)?;
        sent += n as u64;
    }
    Ok(DoneResult::Read {
        path: path.to_string(),
        bytes: sent,
    })
}

// ---- list -------------------------------------------------------------

/// An entry found but not yet listed. Ordered by name, smallest first, so a
/// max-heap of them pops in sorted order.
struct Pending {
    name: String,
    path: PathBuf,
    kind: FileKind,
}

impl PartialEq for Pending {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name
    }
}
impl Eq for Pending {}
impl PartialOrd for Pending {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Pending {
    fn cmp(&self, other: &Self) -> Ordering {
        other.name.cmp(&self.name)
    }
}

/// The entries of `dir`, pushed; a directory that opens but refuses to be
/// read (the kernel checks some `/proc` directories at `getdents`) is an
/// error, as it is to `ls`.
fn push_children(dir: &Path, prefix: &str, heap: &mut BinaryHeap<Pending>) -> io::Result<()> {
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        let file_name = entry.file_name();
        let lossy = file_name.to_string_lossy();
        // d_type, or lstat when the filesystem does not fill it in.
        let kind = entry.file_type().map(kind_of).unwrap_or(FileKind::Other);
        heap.push(Pending {
            name: if prefix.is_empty() {
                lossy.into_owned()
            } else {
                format!("{prefix}/{lossy}")
            },
            path: entry.path(),
            kind,
        });
    }
    Ok(())
}

/// Entries under `root`, sorted by relative name, at most `max` and at most
/// [`MAX_LISTING_BYTES`] encoded; the bool says more were left out.
/// Symlinks are never followed; unreadable subdirectories are listed but not
/// entered.
///
/// Every descendant sorts after its directory, so expanding a directory only
/// when it is popped still yields global order, and a listing cut at `max`
/// never has to read the whole tree.
pub fn walk(root: &Path, recursive: bool, max: u64) -> io::Result<(Vec<FileEntry>, bool)> {
    let mut heap = BinaryHeap::new();
    push_children(root, "", &mut heap)?;
    let mut entries = Vec::new();
    let mut encoded = 0usize;
    while let Some(p) = heap.pop() {
        if entries.len() as u64 >= max {
            return Ok((entries, true));
        }
        // The name as JSON (escapes included), plus the entry's other fields.
        let cost = serde_json::to_string(&p.name).map_or(p.name.len() * 6, |j| j.len()) + 64;
        if encoded + cost > MAX_LISTING_BYTES {
            return Ok((entries, true));
        }
        encoded += cost;
        let size_bytes = match p.kind {
            FileKind::File => fs::symlink_metadata(&p.path).map(|m| m.len()).unwrap_or(0),
            _ => 0,
        };
        if recursive && p.kind == FileKind::Dir {
            let _ = push_children(&p.path, &p.name, &mut heap);
        }
        entries.push(FileEntry {
            name: p.name,
            kind: p.kind,
            size_bytes,
        });
    }
    Ok((entries, false))
}

/// List a directory, or describe a single non-directory.
pub fn list(root: &str, recursive: bool, max_entries: u64) -> Result<DoneResult, AgentError> {
    let root = root.to_string();
    let meta = fs::symlink_metadata(&root).map_err(|e| io_error(&e, &root))?;
    // A symlink named as the root is followed when it leads to a directory,
    // as `ls` does (entries below are never followed).
    let leads_to_dir = meta.is_symlink() && fs::metadata(&root).is_ok_and(|target| target.is_dir());
    let (entries, truncated) = if meta.is_dir() || leads_to_dir {
        walk(Path::new(&root), recursive, max_entries).map_err(|e| io_error(&e, &root))?
    } else {
        let name = Path::new(&root)
            .file_name()
            .map_or_else(|| root.clone(), |n| n.to_string_lossy().into_owned());
        let kind = kind_of(meta.file_type());
        let entry = FileEntry {
            name,
            kind,
            size_bytes: if kind == FileKind::File {
                meta.len()
            } else {
                0
            },
        };
        if max_entries == 0 {
            (vec![], true)
        } else {
            (vec![entry], false)
        }
    };
    Ok(DoneResult::Listing {
        path: root,
        entries,
        truncated,
    })
}

// ---- calls on paths ---------------------------------------------------

/// A [`PathCall`] (its paths resolved).
pub fn path_call(call: PathCall) -> Result<DoneResult, AgentError> {
    let path = match call {
        PathCall::Stat { path } => path,
        PathCall::MakeDir { path } => {
            if fs::symlink_metadata(&path).is_ok() {
                return Err(AgentError::new(
                    ErrorKind::AlreadyExists,
                    format!("{path} already exists"),
                ));
            }
            fs::create_dir_all(&path).map_err(|e| io_error(&e, &path))?;
            path
        }
        PathCall::Move { from, to } => {
            if from == "/" {
                return Err(AgentError::new(
                    ErrorKind::InvalidPath,
                    "refusing to move /",
                ));
            }
            fs::rename(&from, &to).map_err(|e| io_error(&e, &format!("{from} -> {to}")))?;
            to
        }
    };
    Ok(DoneResult::PathInfo {
        entry: describe(&path)?,
    })
}

/// `lstat(2)` of an absolute path, with its owner's and group's names.
fn describe(path: &str) -> Result<PathEntry, AgentError> {
    use std::os::unix::fs::MetadataExt;
    let meta = fs::symlink_metadata(path).map_err(|e| io_error(&e, path))?;
    let kind = kind_of(meta.file_type());
    let name = Path::new(path)
        .file_name()
        .map_or_else(|| "/".to_string(), |n| n.to_string_lossy().into_owned());
    let symlink_target = match kind {
        FileKind::Symlink => fs::read_link(path)
            .ok()
            .map(|t| t.to_string_lossy().into_owned()),
        _ => None,
    };
    Ok(PathEntry {
        name,
        path: path.to_string(),
        kind,
        size_bytes: meta.len(),
        mode: meta.mode() & 0o7777,
        owner: name_in("/etc/passwd", meta.uid()),
        group: name_in("/etc/group", meta.gid()),
        modified_unix_ms: meta.mtime() * 1000 + meta.mtime_nsec() / 1_000_000,
        symlink_target,
    })
}

/// The name `/etc/passwd` or `/etc/group` gives id `id` (its third
/// field), or the number when none does (read here, not through NSS: the
/// agent is a static binary).
fn name_in(file: &str, id: u32) -> String {
    let text = fs::read_to_string(file).unwrap_or_default();
    text.lines()
        .filter_map(|line| {
            let mut fields = line.split(':');
            let name = fields.next()?;
            let number = fields.nth(1)?.parse::<u32>().ok()?;
            (number == id).then(|| name.to_string())
        })
        .next()
        .unwrap_or_else(|| id.to_string())
}

// ---- delete -----------------------------------------------------------

/// Delete a file, symlink, empty directory, or (recursive) a whole tree.
pub fn delete(target: &str, recursive: bool) -> Result<DoneResult, AgentError> {
    let target = target.to_string();
    if target == "/" {
        return Err(AgentError::new(
            ErrorKind::InvalidPath,
            "refusing to delete /",
        ));
    }
    let meta = fs::symlink_metadata(&target).map_err(|e| io_error(&e, &target))?;
    if meta.is_dir() {
        match fs::remove_dir(&target) {
            Ok(()) => {}
            Err(e) if matches!(sys::errno(&e), libc::ENOTEMPTY | libc::EEXIST) => {
                if !recursive {
                    return Err(AgentError::new(
                        ErrorKind::InvalidRequest,
                        "directory not empty; pass recursive",
                    ));
                }
                // std's remove_dir_all never follows symlinks (it works
                // with openat/unlinkat and O_NOFOLLOW).
                fs::remove_dir_all(&target).map_err(|e| io_error(&e, &target))?;
            }
            Err(e) => return Err(io_error(&e, &target)),
        }
    } else {
        fs::remove_file(&target).map_err(|e| io_error(&e, &target))?;
    }
    Ok(DoneResult::Deleted { path: target })
}
