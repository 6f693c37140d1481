//! Volumes' files on this host: `<data_dir>/volumes/<id>.img`, each a
//! sparse file holding an ext4 file system whose root directory the
//! guest's unprivileged user owns.
//!
//! Why a file and ext4: a raw file is what QEMU attaches to a running VM
//! with no conversion (see `crate::vm::volumes`), sparse so that a volume
//! takes on disk only what was written to it; ext4 is what the guest's
//! kernel mounts without a module of its own, and e2fsprogs makes, checks
//! and grows it on the host without mounting it (no loop device, no root
//! in a mount namespace). `root_owner` gives the file system's root to the
//! guest user at its making, so the guest needs no `chown` (which a
//! read-only mount could not do).
//!
//! A volume is made under a temporary name and renamed into place once it
//! is whole and on disk, so a crash mid-way never leaves a file that looks
//! like a volume. Growing is offline (no sandbox holds it: the service
//! checks), with the file system checked first, as `resize2fs` asks.
//! Every change is fsynced, the directory too, before it is reported.

use crate::{Result, RuntimeError};
use sandpit_protocol::GUEST_UID;
use std::path::{Path, PathBuf};
use tokio::process::Command;

/// The Debian package of the tools used here.
const PACKAGE: &str = "e2fsprogs";

/// The smallest volume ext4 is made on here: below it the file system's
/// own structures take most of it.
pub const MIN_VOLUME_BYTES: u64 = 16 * 1024 * 1024;

/// A file in the volumes' directory ([`VolumeFiles::list`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeFile {
    pub id: String,
    /// Its temporary file: being made, or left by a make that was lost.
    pub making: bool,
    pub modified: std::time::SystemTime,
}

/// The volumes' files of one host.
#[derive(Debug, Clone)]
pub struct VolumeFiles {
    dir: PathBuf,
}

impl VolumeFiles {
    /// The volumes kept in `dir` (`RuntimeConfig::volumes_dir`).
    pub fn new(dir: impl Into<PathBuf>) -> VolumeFiles {
        VolumeFiles { dir: dir.into() }
    }

    /// Where the volumes' files are.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Volume `id`'s file. An id is the service's (`vol_…`): anything that
    /// could name another path is refused.
    pub fn path(&self, id: &str) -> Result<PathBuf> {
        let usable = !id.is_empty()
            && id.len() <= 64
            && id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        if !usable {
            return Err(RuntimeError::Config(format!(
                "{id:?} is not a volume id (letters, digits, _ and - only)"
            )));
        }
        Ok(self.dir.join(format!("{id}.img")))
    }

    /// Makes volume `id`: a sparse file of `bytes` holding a fresh ext4
    /// file system owned by the guest's user. One that exists already is
    /// refused (its content is never replaced).
    pub async fn create(&self, id: &str, bytes: u64) -> Result<()> {
        let path = self.path(id)?;
        if bytes < MIN_VOLUME_BYTES {
            return Err(RuntimeError::VolumeSize {
                id: id.into(),
                bytes,
                why: format!("a volume is at least {MIN_VOLUME_BYTES} bytes"),
            });
        }
        make_private_dir(&self.dir)?;
        if path.exists() {
            return Err(RuntimeError::Config(format!(
                "volume {id} exists already at {}",
                path.display()
            )));
        }
        let making = self.dir.join(format!("{id}.img.making"));
        let result = async {
            let file = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .open(&making)
                .map_err(RuntimeError::io(format!("creating {}", making.display())))?;
            file.set_len(bytes)
                .map_err(RuntimeError::io(format!("sizing {}", making.display())))?;
            drop(file);
            let owner = format!("root_owner={GUEST_UID}:{GUEST_UID}");
            run(
                "mkfs.ext4",
                &["-q", "-F", "-m", "0", "-E", &owner],
                &making,
                &format!("making volume {id}'s file system"),
            )
            .await?;
            sync_file(&making)?;
            std::fs::rename(&making, &path).map_err(RuntimeError::io(format!(
                "moving {} into place",
                making.display()
            )))?;
            sync_dir(&self.dir)
        }
        .await;
        if result.is_err() {
            let _ = std::fs::remove_file(&making);
        }
        result
    }

    /// Grows volume `id` to `bytes`, its file system too. No VM may have
    /// it attached meanwhile (the caller's to see to). Smaller than it is
    /// is refused; the same size does nothing.
    pub async fn resize(&self, id: &str, bytes: u64) -> Result<()> {
        let path = self.path(id)?;
        let now = std::fs::metadata(&path)
            .map_err(RuntimeError::io(format!(
                "reading volume {}",
                path.display()
            )))?
            .len();
        if bytes < now {
            return Err(RuntimeError::VolumeSize {
                id: id.into(),
                bytes,
                why: format!("it is {now} bytes, and a volume only grows"),
            });
        }
        if bytes == now {
            return Ok(());
        }
        let what = format!("growing volume {id}");
        // resize2fs asks for a file system checked since its last mount.
        check(&path, &what).await?;
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .and_then(|f| f.set_len(bytes))
            .map_err(RuntimeError::io(format!("sizing {}", path.display())))?;
        run("resize2fs", &[], &path, &what).await?;
        sync_file(&path)
    }

    /// The files here: each volume's id, and whether it is still being
    /// made (its temporary file) with when it last changed. None when the
    /// directory is not there yet.
    pub fn list(&self) -> Result<Vec<VolumeFile>> {
        let entries = match std::fs::read_dir(&self.dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => {
                return Err(RuntimeError::io(format!("listing {}", self.dir.display()))(
                    e,
                ))
            }
        };
        let mut out = Vec::new();
        for entry in entries {
            let entry =
                entry.map_err(RuntimeError::io(format!("listing {}", self.dir.display())))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let (id, making) = match (name.strip_suffix(".img"), name.strip_suffix(".img.making")) {
                (Some(id), _) => (id.to_string(), false),
                (_, Some(id)) => (id.to_string(), true),
                _ => continue,
            };
            let modified =
                entry
                    .metadata()
                    .and_then(|m| m.modified())
                    .map_err(RuntimeError::io(format!(
                        "reading {}",
                        entry.path().display()
                    )))?;
            out.push(VolumeFile {
                id,
                making,
                modified,
            });
        }
        out.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(out)
    }

    /// Removes what a make of volume `id` that never finished left (its
    /// process was lost mid-way).
    pub fn remove_unfinished(&self, id: &str) -> Result<()> {
        self.path(id)?;
        let making = self.dir.join(format!("{id}.img.making"));
        match std::fs::remove_file(&making) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(RuntimeError::io(format!("removing {}", making.display()))(
                e,
            )),
        }
    }

    /// Removes volume `id`'s file (one already gone is fine).
    pub async fn delete(&self, id: &str) -> Result<()> {
        let path = self.path(id)?;
        match std::fs::remove_file(&path) {
            Ok(()) => sync_dir(&self.dir),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(RuntimeError::io(format!("removing {}", path.display()))(e)),
        }
    }
}

/// `e2fsck -f -p`: a forced check that repairs what is safe to repair
/// unasked. Exit 0 is clean, 1 repaired; anything else is a failure.
async fn check(path: &Path, what: &str) -> Result<()> {
    let out = Command::new("e2fsck")
        .args(["-f", "-p"])
        .arg(path)
        .output()
        .await
        .map_err(RuntimeError::spawn("e2fsck", PACKAGE, what))?;
    match out.status.code() {
        Some(0 | 1) => Ok(()),
        _ => Err(failed("e2fsck", what, &out)),
    }
}

/// Runs `tool args… path`, which must succeed.
async fn run(tool: &str, args: &[&str], path: &Path, what: &str) -> Result<()> {
    let out = Command::new(tool)
        .args(args)
        .arg(path)
        .output()
        .await
        .map_err(RuntimeError::spawn(tool, PACKAGE, what))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(failed(tool, what, &out))
    }
}

fn failed(tool: &str, what: &str, out: &std::process::Output) -> RuntimeError {
    let said = String::from_utf8_lossy(&out.stderr);
    let said = said.trim();
    let tail: String = said
        .char_indices()
        .nth_back(999)
        .map_or(said, |(i, _)| &said[i..])
        .to_string();
    RuntimeError::ToolFailed {
        tool: tool.into(),
        what: what.into(),
        detail: format!("{} ({tail})", out.status),
    }
}

/// The volumes' directory, its owner's alone (the files are tenants' data).
fn make_private_dir(dir: &Path) -> Result<()> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(RuntimeError::io(format!("creating {}", dir.display())))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
        .map_err(RuntimeError::io(format!("restricting {}", dir.display())))
}

fn sync_file(path: &Path) -> Result<()> {
    std::fs::File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(RuntimeError::io(format!("syncing {}", path.display())))
}

fn sync_dir(dir: &Path) -> Result<()> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(RuntimeError::io(format!("syncing {}", dir.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1024 * 1024;

    /// A tool's answer about `path`: it must be there (e2fsprogs is a
    /// dependency of the host; a missing one fails the test by name).
    fn tool(tool: &str, args: &[&str], path: &Path) -> String {
        let out = std::process::Command::new(tool)
            .args(args)
            .arg(path)
            .output()
            .unwrap_or_else(|e| {
                panic!("{tool} cannot run ({e}): install e2fsprogs (apt-get install e2fsprogs)")
            });
        assert!(out.status.success(), "{tool}: {out:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `dumpe2fs -h`'s value of `field`.
    fn field(header: &str, name: &str) -> String {
        header
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name}:")))
            .unwrap_or_else(|| panic!("no {name:?} in {header}"))
            .trim()
            .to_string()
    }

    #[tokio::test]
    async fn a_volume_is_sparse_ext4_owned_by_the_guest_user_and_grows() {
        let dir = tempfile::tempdir().unwrap();
        let files = VolumeFiles::new(dir.path().join("volumes"));
        files.create("vol_test", 64 * MIB).await.unwrap();
        let path = files.path("vol_test").unwrap();
        let meta = std::fs::metadata(&path).unwrap();
        assert_eq!(meta.len(), 64 * MIB);
        use std::os::unix::fs::MetadataExt;
        assert!(
            meta.blocks() * 512 < 64 * MIB / 2,
            "not sparse: {} bytes on disk",
            meta.blocks() * 512
        );
        let header = tool("dumpe2fs", &["-h"], &path);
        assert!(field(&header, "Filesystem features").contains("extent"));
        assert!(field(&header, "Filesystem features").contains("has_journal"));
        assert_eq!(field(&header, "Reserved block count"), "0");
        let block_size: u64 = field(&header, "Block size").parse().unwrap();
        let blocks: u64 = field(&header, "Block count").parse().unwrap();
        assert_eq!(blocks * block_size, 64 * MIB);
        // The root directory is the guest user's.
        let root = tool("debugfs", &["-R", "stat /"], &path);
        assert!(
            root.contains(&format!("User:  {GUEST_UID}"))
                && root.contains(&format!("Group:  {GUEST_UID}")),
            "{root}"
        );
        // No half-made file beside it; the directory is its owner's alone.
        let names: Vec<_> = std::fs::read_dir(dir.path().join("volumes"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(names, ["vol_test.img"]);
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.path().join("volumes"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o700);

        // Made twice: refused, the first kept.
        assert!(files.create("vol_test", 64 * MIB).await.is_err());

        // Grown: the file system takes the new size.
        files.resize("vol_test", 96 * MIB).await.unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 96 * MIB);
        let header = tool("dumpe2fs", &["-h"], &path);
        let grown: u64 = field(&header, "Block count").parse().unwrap();
        assert_eq!(grown * block_size, 96 * MIB);
        tool("e2fsck", &["-f", "-n"], &path);
        let root = tool("debugfs", &["-R", "stat /"], &path);
        assert!(root.contains(&format!("User:  {GUEST_UID}")), "{root}");

        // Never shrunk; the same size is nothing to do.
        let e = files.resize("vol_test", 64 * MIB).await.unwrap_err();
        assert!(matches!(e, RuntimeError::VolumeSize { .. }), "{e}");
        files.resize("vol_test", 96 * MIB).await.unwrap();

        // Listed, with what a lost make left beside it.
        std::fs::write(dir.path().join("volumes/vol_lost.img.making"), b"").unwrap();
        std::fs::write(dir.path().join("volumes/notes.txt"), b"").unwrap();
        let listed: Vec<(String, bool)> = files
            .list()
            .unwrap()
            .into_iter()
            .map(|f| (f.id, f.making))
            .collect();
        assert_eq!(
            listed,
            [("vol_lost".into(), true), ("vol_test".into(), false)]
        );
        files.remove_unfinished("vol_lost").unwrap();
        files.remove_unfinished("vol_lost").unwrap();
        assert_eq!(files.list().unwrap().len(), 1);

        // Deleted, twice without error.
        files.delete("vol_test").await.unwrap();
        assert!(!path.exists());
        files.delete("vol_test").await.unwrap();
    }

    #[tokio::test]
    async fn ids_that_name_other_paths_and_tiny_sizes_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let files = VolumeFiles::new(dir.path());
        for id in ["", "../x", "a/b", "vol_.", &"a".repeat(65)] {
            assert!(files.path(id).is_err(), "{id:?}");
        }
        let e = files.create("vol_small", MIB).await.unwrap_err();
        assert!(e.to_string().contains("at least"), "{e}");
        assert!(std::fs::read_dir(dir.path()).unwrap().next().is_none());
    }
}
