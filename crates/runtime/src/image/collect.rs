//! Collecting outdated guest images. Every new agent (so every upgrade)
//! makes a new `image-<id>` beside the old, and a new package list or
//! recipe a new `rootfs-<id>` (about 1 GiB) and maybe a new kernel; nothing
//! removed the old ones, so a host that upgraded every week filled its disk
//! with them.
//!
//! An image is still in use while anything could start QEMU on it again or
//! read its disk: the current one; one a VM record, or a template (which
//! saves stand on), names; a root file system any qcow2 chain of the data
//! directory (VM overlays, templates' disks, saves' layers) reaches. A
//! kernel's cache stays while an image kept uses its release. The rest is
//! removed, moved out of sight first (a `.tmp-` name, which an interrupted
//! removal leaves for the next build's sweep).

use std::collections::HashSet;
use std::fs;
use std::path::{Path, PathBuf};

use super::fsutil::{BuildLock, TempDir};
use super::{GuestImage, ImageError};

/// What stands on the images of one images directory.
#[derive(Debug, Default)]
pub struct InUse {
    /// Image ids: the current image's, and those VMs and templates name.
    pub images: HashSet<String>,
    /// Disk files whose backing chains may reach a root file system.
    pub disks: Vec<PathBuf>,
}

/// Remove from `images_dir` the images, root file systems and kernels
/// nothing in `in_use` stands on, nor `current.json` names; returns the
/// directory names removed. Skipped (nothing removed) while a build holds
/// the directory's lock: the build may be making what looks unused.
pub fn collect_outdated(images_dir: &Path, in_use: &InUse) -> Result<Vec<String>, ImageError> {
    let Some(_lock) = BuildLock::try_acquire(images_dir)? else {
        return Ok(Vec::new());
    };
    let mut keep_images = in_use.images.clone();
    if let Some(current) = current_id(images_dir) {
        keep_images.insert(current);
    }
    let reached = reached_files(&in_use.disks);
    let mut keep_rootfs = HashSet::new();
    let mut keep_kernels = HashSet::new();
    let mut removable = Vec::new();
    let names = dir_names(images_dir)?;
    for name in &names {
        let Some(id) = name.strip_prefix("image-") else {
            continue;
        };
        if keep_images.contains(id) {
            let dir = images_dir.join(name);
            keep_rootfs.extend(rootfs_of(&dir));
            keep_kernels.extend(kernel_release_of(&dir));
        } else {
            removable.push(name.clone());
        }
    }
    for name in &names {
        if name.starts_with("rootfs-") {
            let base = images_dir.join(name).join(super::rootfs::BASE_NAME);
            let reached_now = fs::canonicalize(&base).is_ok_and(|b| reached.contains(&b));
            if !keep_rootfs.contains(name) && !reached_now {
                removable.push(name.clone());
            }
        } else if let Some(release) = name.strip_prefix("kernel-") {
            if !keep_kernels.contains(release) {
                removable.push(name.clone());
            }
        }
    }
    let mut removed = Vec::new();
    for name in removable {
        let aside = TempDir::new(images_dir, "gone")?;
        if fs::rename(images_dir.join(&name), aside.path().join(&name)).is_ok() {
            tracing::info!(images = %images_dir.display(), %name, "removed an outdated guest image part nothing stands on");
            removed.push(name);
        }
        // `aside` is deleted as it drops.
    }
    Ok(removed)
}

/// The id `current.json` names (the image last built here).
fn current_id(images_dir: &Path) -> Option<String> {
    let text = fs::read_to_string(images_dir.join("current.json")).ok()?;
    let image: GuestImage = serde_json::from_str(&text).ok()?;
    Some(image.id)
}

/// The finished entries of `images_dir` (not `.tmp-*`, not files).
fn dir_names(images_dir: &Path) -> Result<Vec<String>, ImageError> {
    use super::error::IoContext;
    let mut out = Vec::new();
    for e in fs::read_dir(images_dir)
        .ctx(|| format!("reading {}", images_dir.display()))?
        .flatten()
    {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with('.') && e.file_type().is_ok_and(|t| t.is_dir()) {
            out.push(name);
        }
    }
    Ok(out)
}

/// The `rootfs-<id>` directory an image's disk is: where its
/// `rootfs.qcow2` link points, or else its record's `rootfs`.
fn rootfs_of(image_dir: &Path) -> Option<String> {
    let base = fs::canonicalize(image_dir.join("rootfs.qcow2"))
        .ok()
        .or_else(|| Some(read_record(image_dir)?.rootfs))?;
    Some(base.parent()?.file_name()?.to_string_lossy().into_owned())
}

fn kernel_release_of(image_dir: &Path) -> Option<String> {
    Some(read_record(image_dir)?.kernel_release)
}

fn read_record(image_dir: &Path) -> Option<GuestImage> {
    let text = fs::read_to_string(image_dir.join("image.json")).ok()?;
    serde_json::from_str(&text).ok()
}

/// Every file (canonical) the backing chains of `disks` pass through.
fn reached_files(disks: &[PathBuf]) -> HashSet<PathBuf> {
    const MAX_DEPTH: usize = 256;
    let mut out = HashSet::new();
    for disk in disks {
        let mut file = disk.clone();
        for _ in 0..MAX_DEPTH {
            let Ok(Some(below)) = crate::save::layers::backing_file(&file) else {
                break;
            };
            let Ok(canonical) = fs::canonicalize(&below) else {
                break;
            };
            if !out.insert(canonical.clone()) {
                break;
            }
            file = canonical;
        }
    }
    out
}
