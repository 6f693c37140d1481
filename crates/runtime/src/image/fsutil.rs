//! File system helpers for a cache that must never look complete when it is
//! not: build in a temporary directory inside the cache, then `rename` it into
//! place (atomic on one file system); serialize builders with `flock`; and
//! delete leftovers without ever descending into a mount (a crashed chroot
//! phase must not take the host's `/dev` with it).

use std::fs::{self, File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};

use nix::fcntl::{Flock, FlockArg};

use super::error::{ImageError, IoContext};

/// Prefix of the temporary directories builds work in.
pub(crate) const TMP_PREFIX: &str = ".tmp-";

/// Holds the exclusive build lock on `images_dir/.lock` until dropped.
pub(crate) struct BuildLock {
    _lock: Flock<File>,
}

impl BuildLock {
    /// Blocks until no other builder holds the lock.
    pub(crate) fn acquire(images_dir: &Path) -> Result<Self, ImageError> {
        let path = images_dir.join(".lock");
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .ctx(|| format!("opening {}", path.display()))?;
        let lock = Flock::lock(file, FlockArg::LockExclusiveNonblock).or_else(|(file, errno)| {
            if errno != nix::errno::Errno::EWOULDBLOCK {
                return Err((file, errno));
            }
            tracing::info!(lock = %path.display(), "another image build is running; waiting for it");
            Flock::lock(file, FlockArg::LockExclusive)
        });
        let lock = lock.map_err(|(_, errno)| ImageError::Io {
            context: format!("locking {}", path.display()),
            source: io::Error::from(errno),
        })?;
        Ok(Self { _lock: lock })
    }
}

impl BuildLock {
    /// The lock if no builder holds it now; `None` if one does.
    pub(crate) fn try_acquire(images_dir: &Path) -> Result<Option<Self>, ImageError> {
        let path = images_dir.join(".lock");
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .ctx(|| format!("opening {}", path.display()))?;
        match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(lock) => Ok(Some(Self { _lock: lock })),
            Err((_, nix::errno::Errno::EWOULDBLOCK)) => Ok(None),
            Err((_, errno)) => Err(ImageError::Io {
                context: format!("locking {}", path.display()),
                source: io::Error::from(errno),
            }),
        }
    }
}

/// A temporary directory `images_dir/.tmp-<what>-<random>`, deleted when
/// dropped (a build that fails cleans up after itself; one that is killed
/// leaves it to the next build, see [`remove_stale_temp_dirs`]).
pub(crate) struct TempDir {
    path: PathBuf,
}

impl TempDir {
    pub(crate) fn new(images_dir: &Path, what: &str) -> Result<Self, ImageError> {
        let suffix: u64 = rand::random();
        let path = images_dir.join(format!("{TMP_PREFIX}{what}-{suffix:016x}"));
        fs::create_dir(&path).ctx(|| format!("creating {}", path.display()))?;
        Ok(Self { path })
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if let Err(e) = remove_tree(&self.path) {
            tracing::warn!(error = %e, "could not delete a temporary build directory");
        }
    }
}

/// Moves the finished directory `from` to `to`. Anything already at `to`
/// (an incomplete or corrupt leftover: complete ones are never rebuilt) is
/// moved aside first and deleted.
pub(crate) fn install_dir(images_dir: &Path, from: &Path, to: &Path) -> Result<(), ImageError> {
    if fs::symlink_metadata(to).is_ok() {
        let aside = TempDir::new(images_dir, "old")?;
        let target = aside.path().join("old");
        fs::rename(to, &target).ctx(|| format!("moving aside {}", to.display()))?;
    }
    fs::rename(from, to).ctx(|| format!("renaming {} to {}", from.display(), to.display()))
}

/// Deletes a directory tree, refusing if anything is mounted inside it.
pub(crate) fn remove_tree(path: &Path) -> Result<(), ImageError> {
    let mounts = mounts_under(path).ctx(|| "reading /proc/self/mountinfo".to_string())?;
    if let Some(m) = mounts.first() {
        return Err(ImageError::Io {
            context: format!(
                "refusing to delete {}: {} is mounted inside it",
                path.display(),
                m.display()
            ),
            source: io::Error::from(io::ErrorKind::ResourceBusy),
        });
    }
    match fs::remove_dir_all(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e).ctx(|| format!("deleting {}", path.display())),
    }
}

/// Mount points at or below `path`, from this process's mount namespace.
fn mounts_under(path: &Path) -> io::Result<Vec<PathBuf>> {
    let path = fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let text = fs::read_to_string("/proc/self/mountinfo")?;
    Ok(text
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .map(|field| PathBuf::from(unescape_mountinfo(field)))
        .filter(|m| m.starts_with(&path))
        .collect())
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo`.
fn unescape_mountinfo(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\'
            && i + 3 < bytes.len()
            && bytes[i + 1..i + 4]
                .iter()
                .all(|b| (b'0'..=b'7').contains(b))
        {
            let value = bytes[i + 1..i + 4]
                .iter()
                .fold(0u32, |acc, b| acc * 8 + u32::from(b - b'0'));
            out.push(value as u8);
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Deletes the temporary directories of builds that died. Call only while
/// holding the build lock (no live build then owns one).
pub(crate) fn remove_stale_temp_dirs(images_dir: &Path) -> Result<(), ImageError> {
    let entries = fs::read_dir(images_dir).ctx(|| format!("reading {}", images_dir.display()))?;
    for entry in entries.flatten() {
        if entry.file_name().to_string_lossy().starts_with(TMP_PREFIX) {
            tracing::info!(path = %entry.path().display(), "deleting leftover of an interrupted image build");
            remove_tree(&entry.path())?;
        }
    }
    Ok(())
}

/// Hard-links `from` to `to`, copying when a link is not possible.
pub(crate) fn link_or_copy(from: &Path, to: &Path) -> Result<(), ImageError> {
    if fs::hard_link(from, to).is_ok() {
        return Ok(());
    }
    fs::copy(from, to)
        .map(|_| ())
        .ctx(|| format!("copying {} to {}", from.display(), to.display()))
}

/// Writes `value` as pretty JSON to `path`.
pub(crate) fn write_json<T: serde::Serialize>(path: &Path, value: &T) -> Result<(), ImageError> {
    let mut text = serde_json::to_string_pretty(value).expect("image metadata serializes");
    text.push('\n');
    fs::write(path, text).ctx(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_unescape() {
        assert_eq!(unescape_mountinfo(r"/a\040b\134c"), r"/a b\c");
        assert_eq!(unescape_mountinfo("/plain"), "/plain");
        assert_eq!(unescape_mountinfo(r"/end\04"), r"/end\04");
    }

    #[test]
    fn install_replaces_leftover() {
        let dir = tempfile::tempdir().unwrap();
        let tmp = TempDir::new(dir.path(), "x").unwrap();
        let from = tmp.path().join("out");
        fs::create_dir(&from).unwrap();
        fs::write(from.join("new"), "1").unwrap();
        let to = dir.path().join("final");
        fs::create_dir(&to).unwrap();
        fs::write(to.join("old"), "0").unwrap();
        install_dir(dir.path(), &from, &to).unwrap();
        assert!(to.join("new").exists());
        assert!(!to.join("old").exists());
        drop(tmp);
        fs::create_dir(dir.path().join(".tmp-stale-1")).unwrap();
        remove_stale_temp_dirs(dir.path()).unwrap();
        let left: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(left, vec![std::ffi::OsString::from("final")]);
    }
}
