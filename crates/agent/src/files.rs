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
mod tests {
    use super::*;
    use crate::channel::Outbox;
    use std::os::unix::fs::symlink;
    use std::sync::mpsc;

    fn scratch(name: &str) -> PathBuf {
        let d =
            std::env::temp_dir().join(format!("sandpit-agent-files-{}-{name}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        d
    }

    fn read_all(p: &Path) -> Vec<u8> {
        fs::read(p).unwrap()
    }

    fn s(p: &Path) -> String {
        p.to_string_lossy().into_owned()
    }

    #[test]
    fn errno_mapping() {
        let k = |errno| io_error(&io::Error::from_raw_os_error(errno), "/x").kind;
        assert_eq!(k(libc::ENOENT), ErrorKind::NotFound);
        assert_eq!(k(libc::EISDIR), ErrorKind::IsADirectory);
        assert_eq!(k(libc::ENOTDIR), ErrorKind::NotADirectory);
        assert_eq!(k(libc::EACCES), ErrorKind::PermissionDenied);
        assert_eq!(k(libc::EPERM), ErrorKind::PermissionDenied);
        assert_eq!(k(libc::ENOSPC), ErrorKind::Io);
        let e = io_error(&io::Error::from_raw_os_error(libc::ENOSPC), "/x");
        assert_eq!(e.message, "/x: No space left on device");
    }

    fn upload(
        path: &str,
        chunks: Vec<Vec<u8>>,
        size: u64,
        mode: Option<u32>,
    ) -> Result<Option<DoneResult>, AgentError> {
        let (tx, rx) = mpsc::sync_channel(chunks.len() + 1);
        for c in chunks {
            tx.send(c).unwrap();
        }
        drop(tx);
        write_file(path, size, mode, rx)
    }

    #[test]
    fn writes_are_binary_exact_and_create_parents() {
        let d = scratch("write");
        let target = d.join("a/b/c.bin");
        let body: Vec<u8> = (0..=255u8).cycle().take(70_000).collect();
        let r = upload(
            &s(&target),
            vec![body[..1000].to_vec(), body[1000..].to_vec()],
            body.len() as u64,
            Some(0o755),
        )
        .unwrap();
        assert_eq!(
            r,
            Some(DoneResult::Written {
                path: s(&target),
                bytes: 70_000
            })
        );
        assert_eq!(read_all(&target), body);
        assert_eq!(
            fs::metadata(&target).unwrap().permissions().mode() & 0o777,
            0o755
        );
        // Overwrite with an empty file, default mode; no temp files left.
        upload(&s(&target), vec![], 0, None).unwrap().unwrap();
        assert!(read_all(&target).is_empty());
        assert_eq!(
            fs::metadata(&target).unwrap().permissions().mode() & 0o777,
            0o644
        );
        assert_eq!(fs::read_dir(d.join("a/b")).unwrap().count(), 1);
        fs::remove_dir_all(d).unwrap();
    }

    #[test]
    fn write_errors() {
        let d = scratch("write-errors");
        let e = upload(&s(&d), vec![], 0, None).unwrap_err();
        assert_eq!(e.kind, ErrorKind::IsADirectory);
        assert_eq!(
            upload("/", vec![], 0, None).unwrap_err().kind,
            ErrorKind::IsADirectory
        );
        fs::write(d.join("file"), "x").unwrap();
        let e = upload(&s(&d.join("file/sub")), vec![], 0, None).unwrap_err();
        assert_eq!(e.kind, ErrorKind::NotADirectory);
        let e = upload(&s(&d.join("file/sub/deeper")), vec![], 0, None).unwrap_err();
        assert_eq!(e.kind, ErrorKind::NotADirectory);
        let e = upload(&s(&d.join("big")), vec![vec![1; 10]], 5, None).unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidRequest);
        // The session ended midway: nothing written, no temp file left.
        assert_eq!(
            upload(&s(&d.join("cut")), vec![vec![1; 3]], 5, None).unwrap(),
            None
        );
        let mut names: Vec<_> = fs::read_dir(&d)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        names.sort();
        assert_eq!(names, vec!["file"]);
        fs::remove_dir_all(d).unwrap();
    }

    fn decode_all(rx: &mpsc::Receiver<(u64, Vec<u8>)>) -> Vec<sandpit_protocol::Frame> {
        let mut d = sandpit_protocol::FrameDecoder::new();
        while let Ok((_, bytes)) = rx.try_recv() {
            d.push(&bytes);
        }
        std::iter::from_fn(|| d.next_frame().unwrap()).collect()
    }

    #[test]
    fn a_read_with_a_window_waits_for_acks_and_stops_when_cancelled() {
        let d = scratch("window");
        let (tx, rx) = mpsc::sync_channel(64);
        let reply = Reply::new(u64::MAX, Outbox::for_test(tx));
        let body = vec![7u8; 4 * CHUNK_LEN];
        let p = d.join("f");
        fs::write(&p, &body).unwrap();
        let send_window = open_read(40, (CHUNK_LEN + 100) as u32);
        let path = s(&p);
        let reading =
            std::thread::spawn(move || read_file(&reply, 40, &path, 1 << 30, Some(&send_window)));
        let data_sent = |frames: &[sandpit_protocol::Frame]| -> usize {
            frames
                .iter()
                .filter(|f| matches!(f.message, Message::FileData { .. }))
                .map(|f| f.body.len())
                .sum()
        };
        std::thread::sleep(std::time::Duration::from_millis(200));
        let mut frames = decode_all(&rx);
        assert_eq!(data_sent(&frames), CHUNK_LEN + 100, "the window, no more");
        ack_read(40, CHUNK_LEN as u32);
        std::thread::sleep(std::time::Duration::from_millis(200));
        frames.extend(decode_all(&rx));
        assert_eq!(data_sent(&frames), 2 * CHUNK_LEN + 100);
        // The host gave up on it: it stops, with nothing more sent.
        assert!(close_read(40));
        reading.join().unwrap().unwrap();
        assert!(decode_all(&rx).is_empty());
        assert!(!close_read(40));
        fs::remove_dir_all(d).unwrap();
    }

    #[test]
    fn reads_in_chunks_and_refuses_what_it_must() {
        let d = scratch("read");
        let (tx, rx) = mpsc::sync_channel(64);
        let reply = Reply::new(u64::MAX, Outbox::for_test(tx));
        let body: Vec<u8> = (0..CHUNK_LEN + 10).map(|i| (i % 251) as u8).collect();
        let p = d.join("f");
        fs::write(&p, &body).unwrap();
        read_file(&reply, 4, &s(&p), body.len() as u64, None).unwrap();
        let frames = decode_all(&rx);
        assert_eq!(
            frames[0].message,
            Message::FileInfo {
                id: 4,
                path: s(&p),
                size: body.len() as u64
            }
        );
        assert_eq!(frames.len(), 4);
        let data: Vec<u8> = frames[1..3].iter().flat_map(|f| f.body.clone()).collect();
        assert_eq!(data, body);
        assert!(
            matches!(frames[3].message, Message::Done { id: 4, result: DoneResult::Read { bytes, .. } } if bytes == body.len() as u64)
        );

        let e = read_file(&reply, 5, &s(&p), 10, None).unwrap_err();
        assert_eq!(e.kind, ErrorKind::TooLarge);
        assert!(e.message.contains(&body.len().to_string()) && e.message.contains("10"));
        assert_eq!(
            read_file(&reply, 6, &s(&d), 10, None).unwrap_err().kind,
            ErrorKind::IsADirectory
        );
        assert_eq!(
            read_file(&reply, 7, &s(&d.join("nope")), 10, None)
                .unwrap_err()
                .kind,
            ErrorKind::NotFound
        );
        assert!(decode_all(&rx).is_empty());

        // procfs: size 0 in stat, content on read.
        read_file(&reply, 8, "/proc/self/status", 1 << 20, None).unwrap();
        let frames = decode_all(&rx);
        let Message::FileInfo { size, .. } = frames[0].message else {
            panic!()
        };
        assert!(size > 0);
        assert_eq!(
            read_file(&reply, 9, "/proc/self/status", 3, None)
                .unwrap_err()
                .kind,
            ErrorKind::TooLarge
        );
        fs::remove_dir_all(d).unwrap();
    }

    fn names(r: &DoneResult) -> Vec<(String, FileKind, u64)> {
        let DoneResult::Listing { entries, .. } = r else {
            panic!()
        };
        entries
            .iter()
            .map(|e| (e.name.clone(), e.kind, e.size_bytes))
            .collect()
    }

    #[test]
    fn listings_are_sorted_never_follow_symlinks_and_truncate() {
        let d = scratch("list");
        fs::create_dir_all(d.join("a/b")).unwrap();
        fs::create_dir_all(d.join("a-c")).unwrap();
        fs::write(d.join("a/b/f.txt"), "12345").unwrap();
        fs::write(d.join("z"), "1").unwrap();
        symlink("/", d.join("a/root-link")).unwrap();
        let all = list(&s(&d), true, 100).unwrap();
        assert_eq!(
            names(&all),
            vec![
                ("a".into(), FileKind::Dir, 0),
                ("a-c".into(), FileKind::Dir, 0),
                ("a/b".into(), FileKind::Dir, 0),
                ("a/b/f.txt".into(), FileKind::File, 5),
                ("a/root-link".into(), FileKind::Symlink, 0),
                ("z".into(), FileKind::File, 1),
            ]
        );
        let DoneResult::Listing {
            truncated, path, ..
        } = &all
        else {
            panic!()
        };
        assert!(!truncated);
        assert_eq!(path, &s(&d));

        let top = list(&s(&d), false, 100).unwrap();
        assert_eq!(names(&top).len(), 3);
        let cut = list(&s(&d), true, 3).unwrap();
        assert_eq!(
            names(&cut).iter().map(|n| n.0.clone()).collect::<Vec<_>>(),
            vec!["a", "a-c", "a/b"]
        );
        assert!(matches!(
            cut,
            DoneResult::Listing {
                truncated: true,
                ..
            }
        ));
        let exact = list(&s(&d), true, 6).unwrap();
        assert!(matches!(
            exact,
            DoneResult::Listing {
                truncated: false,
                ..
            }
        ));

        let one = list(&s(&d.join("a/b/f.txt")), true, 10).unwrap();
        assert_eq!(names(&one), vec![("f.txt".into(), FileKind::File, 5)]);
        let link = list(&s(&d.join("a/root-link")), true, 10).unwrap();
        assert_eq!(
            names(&link),
            vec![("root-link".into(), FileKind::Symlink, 0)]
        );
        assert_eq!(
            list(&s(&d.join("missing")), false, 1).unwrap_err().kind,
            ErrorKind::NotFound
        );
        fs::remove_dir_all(d).unwrap();
    }

    #[test]
    fn deletes() {
        let d = scratch("delete");
        fs::create_dir_all(d.join("tree/sub")).unwrap();
        fs::write(d.join("tree/sub/f"), "x").unwrap();
        fs::create_dir_all(d.join("outside")).unwrap();
        fs::write(d.join("outside/keep"), "x").unwrap();
        symlink(d.join("outside"), d.join("tree/link")).unwrap();
        fs::create_dir(d.join("empty")).unwrap();
        fs::write(d.join("file"), "x").unwrap();

        let e = delete(&s(&d.join("tree")), false).unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidRequest);
        assert_eq!(e.message, "directory not empty; pass recursive");
        delete(&s(&d.join("tree")), true).unwrap();
        assert!(!d.join("tree").exists());
        assert!(d.join("outside/keep").exists(), "followed a symlink");
        delete(&s(&d.join("empty")), false).unwrap();
        assert_eq!(
            delete(&s(&d.join("file")), false).unwrap(),
            DoneResult::Deleted {
                path: s(&d.join("file"))
            }
        );
        assert_eq!(
            delete(&s(&d.join("file")), false).unwrap_err().kind,
            ErrorKind::NotFound
        );
        assert_eq!(delete("/", true).unwrap_err().kind, ErrorKind::InvalidPath);
        fs::remove_dir_all(d).unwrap();
    }

    #[test]
    fn paths_are_described_made_and_moved() {
        let d = scratch("paths");
        let entry = |r: DoneResult| match r {
            DoneResult::PathInfo { entry } => entry,
            other => panic!("{other:?}"),
        };
        fs::write(d.join("f"), "12345").unwrap();
        symlink("f", d.join("l")).unwrap();
        let f = entry(
            path_call(PathCall::Stat {
                path: s(&d.join("f")),
            })
            .unwrap(),
        );
        assert_eq!(
            (f.name.as_str(), f.kind, f.size_bytes),
            ("f", FileKind::File, 5)
        );
        assert_eq!(f.path, s(&d.join("f")));
        assert!(f.modified_unix_ms > 1_600_000_000_000, "{f:?}");
        assert!(!f.owner.is_empty() && !f.group.is_empty(), "{f:?}");
        let l = entry(
            path_call(PathCall::Stat {
                path: s(&d.join("l")),
            })
            .unwrap(),
        );
        assert_eq!(
            (l.kind, l.symlink_target.as_deref()),
            (FileKind::Symlink, Some("f"))
        );
        let missing = path_call(PathCall::Stat {
            path: s(&d.join("nope")),
        })
        .unwrap_err();
        assert_eq!(missing.kind, ErrorKind::NotFound);

        let made = entry(
            path_call(PathCall::MakeDir {
                path: s(&d.join("a/b/c")),
            })
            .unwrap(),
        );
        assert_eq!((made.name.as_str(), made.kind), ("c", FileKind::Dir));
        let again = path_call(PathCall::MakeDir {
            path: s(&d.join("a/b")),
        })
        .unwrap_err();
        assert_eq!(again.kind, ErrorKind::AlreadyExists);

        let moved = entry(
            path_call(PathCall::Move {
                from: s(&d.join("f")),
                to: s(&d.join("a/b/g")),
            })
            .unwrap(),
        );
        assert_eq!((moved.path, moved.size_bytes), (s(&d.join("a/b/g")), 5));
        assert!(!d.join("f").exists());
        let gone = path_call(PathCall::Move {
            from: s(&d.join("f")),
            to: s(&d.join("h")),
        })
        .unwrap_err();
        assert_eq!(gone.kind, ErrorKind::NotFound);
        fs::remove_dir_all(d).unwrap();
    }
}
