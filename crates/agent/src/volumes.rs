//! Volumes: an account's filesystems that outlive a sandbox, each a block
//! device the host attached to one of the VM's volume slots (a virtio disk
//! whose serial is `sandpit-vol<N>`, empty until the host gives it the
//! volume's file: the guest then sees its capacity change).
//!
//! `MountVolume` finds the slot's device by its serial (not by its name:
//! `vdb` is whichever disk the kernel probed second), waits for the size
//! the attach gives it, and mounts it where the host says, as root, ext4,
//! `nosuid,nodev` (a volume is the account's data, never a way to a
//! set-uid program or a device node); its root directory belongs to the
//! guest user (the host makes every volume so). `SyncVolume` writes what
//! the guest caches of a volume to its device, so that it is in the
//! host's file before the VM stops, and unmounts it when asked.
//!
//! What a guest writes to a volume and never syncs would die with its
//! QEMU (a crash, a kill, the expiry watchdog of a host whose server is
//! down: nobody asks the agent first), so while a volume is mounted the
//! agent syncs each one every [`SYNC_EVERY`] itself: a killed VM loses at
//! most that last second of a volume's writes, where the guest's own
//! writeback would lose up to half a minute. Files the file API writes
//! under a volume's path are synced before the write is answered
//! ([`holds`]).

use crate::files::io_error;
use crate::sys;
use sandpit_protocol::{AgentError, DoneResult, ErrorKind};
use std::fs;
use std::io;
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How often the volumes mounted are synced to their devices.
const SYNC_EVERY: Duration = Duration::from_secs(1);

/// The paths volumes are mounted at, read-write ones flagged.
static MOUNTED: Mutex<Vec<(String, bool)>> = Mutex::new(Vec::new());

/// How long the slot's device may take to show the volume's size.
const ATTACH_WAIT: Duration = Duration::from_secs(10);

/// Mount the volume of the slot whose disk has serial `serial` at `path`.
pub fn mount(serial: &str, path: &str, read_only: bool) -> Result<DoneResult, AgentError> {
    if !path.starts_with('/') || path.split('/').any(|c| c == ".." || c == ".") {
        return Err(AgentError::new(
            ErrorKind::InvalidPath,
            format!("a volume's mount point must be an absolute, normal path: {path:?}"),
        ));
    }
    let device = attached_device(serial)?;
    fs::create_dir_all(path).map_err(|e| io_error(&e, path))?;
    let mut flags = libc::MS_NOSUID | libc::MS_NODEV;
    if read_only {
        flags |= libc::MS_RDONLY;
    }
    // A read-only mount replays the journal of a volume another sandbox
    // writes (or one whose writer died) into the overlay the host gives
    // this guest, never into the volume: so it sees every transaction the
    // writer committed.
    let data = "";
    let (s, t, f, d) = (
        sys::cstring(&device).map_err(|e| io_error(&e, &device))?,
        sys::cstring(path).map_err(|e| io_error(&e, path))?,
        sys::cstring("ext4").expect("no NUL"),
        sys::cstring(data).expect("no NUL"),
    );
    // SAFETY: valid C strings that outlive the call.
    sys::cvt(unsafe { libc::mount(s.as_ptr(), t.as_ptr(), f.as_ptr(), flags, d.as_ptr().cast()) })
        .map_err(|e| mount_error(&e, &device, path))?;
    let mut mounted = crate::sys::lock(&MOUNTED);
    if mounted.is_empty() {
        std::thread::spawn(keep_synced);
    }
    mounted.retain(|(p, _)| p != path);
    mounted.push((path.to_string(), !read_only));
    drop(mounted);
    Ok(DoneResult::Mounted {
        path: path.to_string(),
        device,
    })
}

/// Sync the volume mounted at `path` to its device, then unmount it when
/// `unmount`.
pub fn sync(path: &str, unmount: bool) -> Result<DoneResult, AgentError> {
    sync_fs(path).map_err(|e| io_error(&e, path))?;
    if unmount {
        let t = sys::cstring(path).map_err(|e| io_error(&e, path))?;
        // SAFETY: a valid C string.
        sys::cvt(unsafe { libc::umount2(t.as_ptr(), 0) }).map_err(|e| unmount_error(&e, path))?;
        crate::sys::lock(&MOUNTED).retain(|(p, _)| p != path);
    }
    Ok(DoneResult::Synced {
        path: path.to_string(),
        unmounted: unmount,
    })
}

/// `syncfs(2)` of the file system `path` is on.
fn sync_fs(path: &str) -> io::Result<()> {
    let dir = fs::File::open(path)?;
    // SAFETY: a descriptor `dir` owns for the call.
    sys::cvt(unsafe { libc::syncfs(std::os::fd::AsRawFd::as_raw_fd(&dir)) }).map(drop)
}

/// Whether `path` (absolute, resolved) is on a volume mounted read-write.
pub fn holds(path: &Path) -> bool {
    crate::sys::lock(&MOUNTED)
        .iter()
        .any(|(mount, writable)| *writable && path.starts_with(mount))
}

/// Sync every read-write volume each [`SYNC_EVERY`], for the agent's life
/// (started by the first mount).
fn keep_synced() {
    loop {
        std::thread::sleep(SYNC_EVERY);
        let writable: Vec<String> = crate::sys::lock(&MOUNTED)
            .iter()
            .filter(|(_, writable)| *writable)
            .map(|(path, _)| path.clone())
            .collect();
        for path in writable {
            // A volume unmounted meanwhile is no error.
            let _ = sync_fs(&path);
        }
    }
}

/// `/dev/<name>` of the disk whose serial is `serial`, once it has a size.
fn attached_device(serial: &str) -> Result<String, AgentError> {
    let deadline = Instant::now() + ATTACH_WAIT;
    loop {
        match find_disk(serial) {
            Some((name, sectors)) if sectors > 0 => return Ok(format!("/dev/{name}")),
            found if Instant::now() >= deadline => {
                let why = match found {
                    Some((name, _)) => format!("its disk {name} is still empty"),
                    None => "no disk has that serial".to_string(),
                };
                return Err(AgentError::new(
                    ErrorKind::NotFound,
                    format!("the volume slot {serial} is not attached: {why}"),
                ));
            }
            _ => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

/// The disk with serial `serial` and its size in sectors.
fn find_disk(serial: &str) -> Option<(String, u64)> {
    let read = |p: &Path| fs::read_to_string(p).ok().map(|s| s.trim().to_string());
    fs::read_dir("/sys/block")
        .ok()?
        .flatten()
        .find_map(|entry| {
            let dir = entry.path();
            let found = read(&dir.join("serial"))?;
            (found == serial).then(|| {
                let sectors = read(&dir.join("size"))
                    .and_then(|s| s.parse().ok())
                    .unwrap_or(0);
                (entry.file_name().to_string_lossy().into_owned(), sectors)
            })
        })
}

fn unmount_error(e: &io::Error, path: &str) -> AgentError {
    match sys::errno(e) {
        libc::EBUSY => AgentError::new(
            ErrorKind::InvalidRequest,
            format!(
                "the volume at {path} is in use (a process has a file or its working directory \
                 there): end it first"
            ),
        ),
        _ => io_error(e, path),
    }
}

fn mount_error(e: &io::Error, device: &str, path: &str) -> AgentError {
    let kind = match sys::errno(e) {
        libc::EBUSY => ErrorKind::AlreadyExists,
        libc::ENOTDIR => ErrorKind::NotADirectory,
        _ => ErrorKind::Io,
    };
    AgentError::new(kind, format!("mounting {device} on {path}: {e}"))
}
