//! File requests: write, read, list, delete, all as the guest user.
//!
//! Each request runs on a short-lived thread that first switches its own
//! filesystem credentials to the user (supplementary groups via the raw
//! per-thread syscall, then fsgid and fsuid). The kernel then checks every
//! permission as the user would see it, and new files and directories belong
//! to 1000:1000, with no chown afterwards and no window where a root-owned
//! file exists. glibc's `setgroups()` would change every thread of PID 1;
//! the raw syscall changes only the calling one, which exits afterwards.
//!
//! Writes go to a temporary file in the target's directory, renamed over the
//! target at the end, so a reader never sees half a file.

use crate::channel::Reply;
use crate::sys::{self, lock};
use crate::window::SendWindow;
use sandpit_protocol::{
    resolve_guest_path, AgentError, DoneResult, ErrorKind, FileEntry, FileKind, Message, PathCall,
    PathEntry, RequestId, CHUNK_LEN, GUEST_UID, MAX_LISTING_BYTES,
};
use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};
use std::fs::{self, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering as AtomicOrdering};
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The text of an OS error without std's " (os error N)" suffix.
fn strerror(e: &io::Error) -> String {
    let s = e.to_string();
    match s.find(" (os error ") {
        Some(i) => s[..i].to_string(),
        None => s,
    }
}

/// Map an I/O error on `what` (usually a path) to a protocol error.
pub fn io_error(e: &io::Error, what: &str) -> AgentError {
    let kind = match sys::errno(e) {
        libc::ENOENT => ErrorKind::NotFound,
        libc::EISDIR => ErrorKind::IsADirectory,
        libc::ENOTDIR => ErrorKind::NotADirectory,
        libc::EACCES | libc::EPERM => ErrorKind::PermissionDenied,
        libc::EEXIST => ErrorKind::AlreadyExists,
        _ => ErrorKind::Io,
    };
    AgentError::new(kind, format!("{what}: {}", strerror(e)))
}

/// Switch the calling thread's filesystem identity to the guest user.
/// Only for threads that end with the request. A no-op when not root
/// (development), where there is nothing to drop.
pub fn become_user() -> io::Result<()> {
    // SAFETY: plain syscalls that only affect the calling thread.
    unsafe {
        if libc::geteuid() != 0 {
            return Ok(());
        }
        let groups = [GUEST_UID as libc::gid_t];
        if libc::syscall(libc::SYS_setgroups, 1 as libc::c_long, groups.as_ptr()) < 0 {
            return Err(io::Error::last_os_error());
        }
        libc::syscall(libc::SYS_setfsgid, GUEST_UID as libc::c_long);
        libc::syscall(libc::SYS_setfsuid, GUEST_UID as libc::c_long);
        // setfs[ug]id report the previous value, never an error: ask again
        // with an invalid id (which changes nothing) to check.
        let uid = libc::syscall(libc::SYS_setfsuid, -1 as libc::c_long);
        let gid = libc::syscall(libc::SYS_setfsgid, -1 as libc::c_long);
        if uid != GUEST_UID as libc::c_long || gid != GUEST_UID as libc::c_long {
            return Err(io::Error::other("could not switch to the guest user"));
        }
        drop_effective_capabilities()?;
    }
    Ok(())
}

/// Clear the calling thread's effective capabilities (capabilities are per
/// thread). setfsuid drops only the file-permission ones; without this the
/// thread would keep e.g. CAP_SYS_RESOURCE and write into the blocks ext4
/// reserves for root, so a user who filled the disk could still write through
/// the agent, and the reserve that keeps the agent working would be gone.
fn drop_effective_capabilities() -> io::Result<()> {
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    const VERSION_3: u32 = 0x2008_0522;
    let mut header = Header {
        version: VERSION_3,
        pid: 0,
    };
    let mut data = [Data::default(); 2];
    // SAFETY: capget/capset with a v3 header and two data words, as the ABI says;
    // they change only the calling thread.
    unsafe {
        if libc::syscall(
            libc::SYS_capget,
            &mut header as *mut Header,
            data.as_mut_ptr(),
        ) < 0
        {
            return Err(io::Error::last_os_error());
        }
        for d in &mut data {
            d.effective = 0;
        }
        if libc::syscall(libc::SYS_capset, &mut header as *mut Header, data.as_ptr()) < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

fn kind_of(t: fs::FileType) -> FileKind {
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

/// Write `size` bytes arriving on `data` to `path`. `Ok(None)` means the
/// session ended before all data arrived (nothing is written, nobody to tell).
pub fn write_file(
    path: &str,
    size: u64,
    mode: Option<u32>,
    data: Receiver<Vec<u8>>,
) -> Result<Option<DoneResult>, AgentError> {
    let target = resolve_guest_path(path)?;
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
    while written < size {
        let Ok(chunk) = data.recv() else {
            return Ok(None);
        };
        written += chunk.len() as u64;
        if written > size {
            return Err(AgentError::new(
                ErrorKind::InvalidRequest,
                format!("received more than the announced {size} bytes"),
            ));
        }
        file.write_all(&chunk).map_err(|e| io_error(&e, &target))?;
    }
    let mode = mode.unwrap_or(0o644) & 0o7777;
    file.set_permissions(fs::Permissions::from_mode(mode))
        .map_err(|e| io_error(&e, &target))?;
    // On a volume, written means on its device: it outlives this VM.
    let on_volume = crate::volumes::holds(target_path);
    if on_volume {
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
    if on_volume {
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

/// The send window of each read the host gave one (see
/// [`Message::ReadFile`]).
static READS: Mutex<Option<HashMap<RequestId, Arc<SendWindow>>>> = Mutex::new(None);

/// How long a read waits for the host to acknowledge data before it gives
/// up (the host consumes as its client reads; a host gone for good never
/// acks).
const ACK_PATIENCE: Duration = Duration::from_secs(120);

/// Registers a read whose send window starts at `window` bytes.
pub fn open_read(id: RequestId, window: u32) -> Arc<SendWindow> {
    let send_window = Arc::new(SendWindow::new(window.into()));
    lock(&READS)
        .get_or_insert_with(HashMap::new)
        .insert(id, send_window.clone());
    send_window
}

/// The host consumed `bytes` of read `id`.
pub fn ack_read(id: RequestId, bytes: u32) {
    if let Some(c) = lock(&READS).as_ref().and_then(|r| r.get(&id)) {
        c.add(bytes.into());
    }
}

/// Read `id` is over (done, or cancelled by the host: it stops sending).
/// Whether it was still open.
pub fn close_read(id: RequestId) -> bool {
    match lock(&READS).as_mut().and_then(|r| r.remove(&id)) {
        Some(c) => {
            c.close();
            true
        }
        None => false,
    }
}

/// Send a file: `FileInfo`, `FileData` chunks, `Done{Read}`; with `send_window`,
/// never more data than the host granted and has not acknowledged.
pub fn read_file(
    reply: &Reply,
    id: RequestId,
    path: &str,
    max_bytes: u64,
    send_window: Option<&SendWindow>,
) -> Result<(), AgentError> {
    let target = resolve_guest_path(path)?;
    // O_NONBLOCK so a FIFO cannot hang the open; it means nothing for
    // regular files, the only kind that is read.
    let mut file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_CLOEXEC | libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(&target)
        .map_err(|e| io_error(&e, &target))?;
    let meta = file.metadata().map_err(|e| io_error(&e, &target))?;
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
        // Possibly a procfs/sysfs file, whose size is only known by reading.
        let mut content = Vec::new();
        (&mut file)
            .take(max_bytes.saturating_add(1))
            .read_to_end(&mut content)
            .map_err(|e| io_error(&e, &target))?;
        if content.len() as u64 > max_bytes {
            return Err(too_large(
                "at least ".to_string() + &content.len().to_string(),
            ));
        }
        let size = content.len() as u64;
        return send_content(reply, id, &target, size, &mut &content[..], send_window);
    }
    if size > max_bytes {
        return Err(too_large(size.to_string()));
    }
    send_content(reply, id, &target, size, &mut file, send_window)
}

fn send_content(
    reply: &Reply,
    id: RequestId,
    path: &str,
    size: u64,
    src: &mut dyn Read,
    send_window: Option<&SendWindow>,
) -> Result<(), AgentError> {
    reply.send(
        &Message::FileInfo {
            id,
            path: path.to_string(),
            size,
        },
        &[],
    );
    let mut buf = vec![0u8; CHUNK_LEN.min(size as usize).max(1)];
    let mut sent: u64 = 0;
    while sent < size {
        if !reply.is_current() {
            return Ok(()); // the session ended: nobody to send to
        }
        let mut want = (size - sent).min(buf.len() as u64) as usize;
        if let Some(send_window) = send_window {
            match send_window.take_within(want, Some(ACK_PATIENCE)) {
                Some(n) => want = n,
                // Cancelled, or the host stopped taking it: nobody reads on.
                None => return Ok(()),
            }
        }
        let n = match src.read(&mut buf[..want]) {
            Ok(0) => break, // the file shrank meanwhile
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {
                if let Some(send_window) = send_window {
                    send_window.add(want as u64);
                }
                continue;
            }
            Err(e) => return Err(io_error(&e, path)),
        };
        if let Some(send_window) = send_window {
            // SendWindow taken for bytes the file did not have goes back.
            send_window.add((want - n) as u64);
        }
        reply.send(&Message::FileData { id }, &buf[..n]);
        sent += n as u64;
    }
    reply.done(
        id,
        DoneResult::Read {
            path: path.to_string(),
            bytes: sent,
        },
    );
    Ok(())
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

fn push_children(dir: &Path, prefix: &str, heap: &mut BinaryHeap<Pending>) -> io::Result<()> {
    for entry in fs::read_dir(dir)?.flatten() {
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
pub fn list(path: &str, recursive: bool, max_entries: u64) -> Result<DoneResult, AgentError> {
    let root = resolve_guest_path(path)?;
    let meta = fs::symlink_metadata(&root).map_err(|e| io_error(&e, &root))?;
    let (entries, truncated) = if meta.is_dir() {
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

/// A [`PathCall`], as the guest user (the caller's thread has become it):
/// the kernel decides what the user may see, make and move.
pub fn path_call(call: PathCall) -> Result<DoneResult, AgentError> {
    let path = match call {
        PathCall::Stat { path } => resolve_guest_path(&path)?,
        PathCall::MakeDir { path } => {
            let path = resolve_guest_path(&path)?;
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
            let (from, to) = (resolve_guest_path(&from)?, resolve_guest_path(&to)?);
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
pub fn delete(path: &str, recursive: bool) -> Result<DoneResult, AgentError> {
    let target = resolve_guest_path(path)?;
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

#[cfg(test)]
mod tests;
