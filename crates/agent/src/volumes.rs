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

use crate::files::io_error;
use crate::sys;
use sandpit_protocol::{AgentError, DoneResult, ErrorKind};
use std::fs;
use std::io;
use std::path::Path;
use std::time::{Duration, Instant};

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
    // A read-only mount of a volume another sandbox writes must not replay
    // its journal (the host gives this guest an overlay, but the guest
    // would still see a filesystem it may not recover): `noload`.
    let data = if read_only { "noload" } else { "" };
    let (s, t, f, d) = (
        sys::cstring(&device).map_err(|e| io_error(&e, &device))?,
        sys::cstring(path).map_err(|e| io_error(&e, path))?,
        sys::cstring("ext4").expect("no NUL"),
        sys::cstring(data).expect("no NUL"),
    );
    // SAFETY: valid C strings that outlive the call.
    sys::cvt(unsafe { libc::mount(s.as_ptr(), t.as_ptr(), f.as_ptr(), flags, d.as_ptr().cast()) })
        .map_err(|e| mount_error(&e, &device, path))?;
    Ok(DoneResult::Mounted {
        path: path.to_string(),
        device,
    })
}

/// Sync the volume mounted at `path` to its device, then unmount it when
/// `unmount`.
pub fn sync(path: &str, unmount: bool) -> Result<DoneResult, AgentError> {
    let dir = fs::File::open(path).map_err(|e| io_error(&e, path))?;
    // SAFETY: a descriptor `dir` owns for the call.
    sys::cvt(unsafe { libc::syncfs(std::os::fd::AsRawFd::as_raw_fd(&dir)) })
        .map_err(|e| io_error(&e, path))?;
    drop(dir);
    if unmount {
        let t = sys::cstring(path).map_err(|e| io_error(&e, path))?;
        // SAFETY: a valid C string.
        sys::cvt(unsafe { libc::umount2(t.as_ptr(), 0) }).map_err(|e| io_error(&e, path))?;
    }
    Ok(DoneResult::Synced {
        path: path.to_string(),
        unmounted: unmount,
    })
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

fn mount_error(e: &io::Error, device: &str, path: &str) -> AgentError {
    let kind = match sys::errno(e) {
        libc::EBUSY => ErrorKind::AlreadyExists,
        libc::ENOTDIR => ErrorKind::NotADirectory,
        _ => ErrorKind::Io,
    };
    AgentError::new(kind, format!("mounting {device} on {path}: {e}"))
}
