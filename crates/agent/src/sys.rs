//! Thin wrappers over the raw syscalls the agent needs and std does not offer
//! (signal masks, eventfd, poll, uname), kept in one place so the `unsafe` is
//! small, reviewed once, and the rest of the agent reads as ordinary Rust.

use std::ffi::{CStr, CString};
use std::fs::OpenOptions;
use std::io::{self, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

/// Turn a libc return value into an `io::Result`, reading errno on failure.
pub fn cvt(ret: libc::c_int) -> io::Result<libc::c_int> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// Lock a mutex, ignoring poisoning: a panicking request handler must not
/// take the whole agent (PID 1) down with it.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A Rust string as a C string, failing (instead of panicking) on NUL bytes.
pub fn cstring(s: &str) -> io::Result<CString> {
    CString::new(s).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "contains a NUL byte"))
}

/// A signal set holding exactly `signals`.
pub fn sigset(signals: &[libc::c_int]) -> libc::sigset_t {
    // SAFETY: sigemptyset initialises the set it is given.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for &s in signals {
            libc::sigaddset(&mut set, s);
        }
        set
    }
}

/// Block `signals` in the calling thread (and so in every thread it starts
/// afterwards, which inherit the mask).
pub fn block_signals(signals: &[libc::c_int]) -> io::Result<()> {
    let set = sigset(signals);
    // SAFETY: plain syscall on a valid set.
    let rc = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
    if rc != 0 {
        return Err(io::Error::from_raw_os_error(rc));
    }
    Ok(())
}

/// Wait for one of the (blocked) signals in `set`. `None` waits forever.
/// Returns the signal, or `None` on timeout or interruption.
pub fn wait_signal(set: &libc::sigset_t, timeout: Option<Duration>) -> Option<libc::c_int> {
    let ts = timeout.map(|d| libc::timespec {
        tv_sec: d.as_secs().min(i64::MAX as u64) as libc::time_t,
        tv_nsec: d.subsec_nanos() as libc::c_long,
    });
    let ts_ptr = ts
        .as_ref()
        .map_or(std::ptr::null(), |t| t as *const libc::timespec);
    // SAFETY: valid set and timespec pointers; info may be null.
    let rc = unsafe { libc::sigtimedwait(set, std::ptr::null_mut(), ts_ptr) };
    (rc > 0).then_some(rc)
}

/// A Linux eventfd used as a one-way "wake up" signal between threads; it can
/// sit in a `poll()` set next to pipes.
#[derive(Debug)]
pub struct EventFd(OwnedFd);

impl EventFd {
    pub fn new() -> io::Result<Self> {
        // SAFETY: eventfd returns a new descriptor or -1.
        let fd = cvt(unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) })?;
        // SAFETY: fd is freshly created and owned by nobody else.
        Ok(EventFd(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Make the eventfd readable (idempotent until cleared).
    pub fn signal(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a valid u64. Failure (counter overflow)
        // still leaves the fd readable, which is all we need.
        unsafe { libc::write(self.0.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    /// Reset to not readable.
    pub fn clear(&self) {
        let mut v: u64 = 0;
        // SAFETY: reads 8 bytes into a valid u64; EAGAIN when already clear.
        unsafe { libc::read(self.0.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
    }

    pub fn raw(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

/// Set or clear O_NONBLOCK on a descriptor.
pub fn set_nonblocking(fd: RawFd, on: bool) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor the caller owns.
    unsafe {
        let flags = cvt(libc::fcntl(fd, libc::F_GETFL))?;
        let new = if on {
            flags | libc::O_NONBLOCK
        } else {
            flags & !libc::O_NONBLOCK
        };
        if new != flags {
            cvt(libc::fcntl(fd, libc::F_SETFL, new))?;
        }
    }
    Ok(())
}

/// read(2) into `buf`, retrying on EINTR.
pub fn read_fd(fd: RawFd, buf: &mut [u8]) -> io::Result<usize> {
    loop {
        // SAFETY: buf is valid for buf.len() bytes.
        let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

/// poll(2) with no timeout, retrying on EINTR.
pub fn poll_forever(fds: &mut [libc::pollfd]) -> io::Result<usize> {
    loop {
        // SAFETY: fds is a valid slice of pollfd.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

/// poll() for at most `timeout` (rounded up to whole milliseconds; `None`:
/// forever). Returns how many descriptors are ready; 0 when the time ran
/// out or a signal interrupted the wait.
pub fn poll(fds: &mut [libc::pollfd], timeout: Option<Duration>) -> io::Result<usize> {
    let ms = match timeout {
        None => -1,
        Some(t) => t.as_nanos().div_ceil(1_000_000).min(i32::MAX as u128) as libc::c_int,
    };
    // SAFETY: fds is a valid slice of pollfd.
    let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
    if n >= 0 {
        return Ok(n as usize);
    }
    let err = io::Error::last_os_error();
    if err.kind() == io::ErrorKind::Interrupted {
        return Ok(0);
    }
    Err(err)
}

/// A pollfd asking for readability.
pub fn pollin(fd: RawFd) -> libc::pollfd {
    libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    }
}

/// True when poll reported the descriptor readable, hung up or in error:
/// in each case a read() will not block and tells what happened.
pub fn ready(p: &libc::pollfd) -> bool {
    p.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0
}

/// `uname -r` and the current hostname.
pub fn uname() -> (String, String) {
    // SAFETY: uname fills a zeroed utsname; its fields are NUL-terminated.
    unsafe {
        let mut u: libc::utsname = std::mem::zeroed();
        if libc::uname(&mut u) != 0 {
            return (String::new(), String::new());
        }
        let release = CStr::from_ptr(u.release.as_ptr())
            .to_string_lossy()
            .into_owned();
        let node = CStr::from_ptr(u.nodename.as_ptr())
            .to_string_lossy()
            .into_owned();
        (release, node)
    }
}

/// Write a value into an existing kernel file (procfs, sysfs, cgroupfs):
/// no create, no truncate games, one write.
pub fn write_kernel_file(path: impl AsRef<Path>, value: &str) -> io::Result<()> {
    let mut f = OpenOptions::new().write(true).open(path)?;
    f.write_all(value.as_bytes())
}

/// Replace a file atomically (temp file in the same directory + rename), so a
/// crash never leaves half a /etc/hosts; a symlink at `path` is replaced too.
pub fn replace_file(path: &Path, contents: &[u8], mode: u32) -> io::Result<()> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let dir = path.parent().unwrap_or(Path::new("/"));
    let tmp = dir.join(format!(".sandpit-tmp-{}-{n}", std::process::id()));
    let result = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(mode)
            .custom_flags(libc::O_CLOEXEC)
            .open(&tmp)?;
        f.write_all(contents)?;
        f.set_permissions(std::fs::Permissions::from_mode(mode))?;
        drop(f);
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Give `path` the contents `contents`: written over the old bytes in place
/// when the file is a regular file of exactly that length (no new inode, no
/// rename: much less kernel code than [`replace_file`]), replaced otherwise.
/// For small identity files nothing reads while they change.
pub fn overwrite_file(path: &Path, contents: &[u8], mode: u32) -> io::Result<()> {
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if meta.is_file() && meta.len() == contents.len() as u64 {
            let f = OpenOptions::new()
                .write(true)
                .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
                .open(path)?;
            return f.write_all_at(contents, 0);
        }
    }
    replace_file(path, contents, mode)
}

/// errno of an `io::Error`, 0 when it has none.
pub fn errno(e: &io::Error) -> i32 {
    e.raw_os_error().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eventfd_signals_and_clears() {
        let e = EventFd::new().unwrap();
        let mut p = [pollin(e.raw())];
        // SAFETY: valid pollfd array.
        assert_eq!(unsafe { libc::poll(p.as_mut_ptr(), 1, 0) }, 0);
        e.signal();
        e.signal();
        assert_eq!(poll_forever(&mut p).unwrap(), 1);
        assert!(ready(&p[0]));
        e.clear();
        p[0].revents = 0;
        // SAFETY: valid pollfd array.
        assert_eq!(unsafe { libc::poll(p.as_mut_ptr(), 1, 0) }, 0);
    }

    #[test]
    fn replaces_files_and_symlinks() {
        use std::os::unix::fs::PermissionsExt;
        let d = std::env::temp_dir().join(format!("sandpit-agent-sys-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("target"), "old").unwrap();
        std::os::unix::fs::symlink(d.join("target"), d.join("link")).unwrap();
        replace_file(&d.join("link"), b"new", 0o640).unwrap();
        assert_eq!(std::fs::read(d.join("link")).unwrap(), b"new");
        assert_eq!(std::fs::read(d.join("target")).unwrap(), b"old");
        let meta = std::fs::symlink_metadata(d.join("link")).unwrap();
        assert!(meta.is_file());
        assert_eq!(meta.permissions().mode() & 0o777, 0o640);
        assert_eq!(std::fs::read_dir(&d).unwrap().count(), 2);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn cstring_rejects_nul() {
        assert!(cstring("a\0b").is_err());
        assert_eq!(cstring("/x").unwrap().as_bytes(), b"/x");
    }
}
