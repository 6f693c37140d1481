//! Frozen disk layers shared by saves and VMs, and their collection.
//!
//! A save freezes the qcow2 overlay its VM was writing to; from then on that
//! file is a layer: the backing file of the VM's next overlay, of the
//! overlays of every VM started from the save, and of the layer a later save
//! of any of those freezes. Such a file cannot belong to the save, nor to the
//! VM: deleting either must not break the disks of the others. So layers
//! live on their own in `<data_dir>/layers/<128-bit random hex>.qcow2`,
//! named by absolute path in the headers of the overlays and layers above
//! them, and a layer is deleted only when nothing names it any more:
//! no qcow2 file in a VM's directory (its active overlay, the one a save
//! froze, one made for a switch still to come) and no save (finished or
//! being written) reaches it through its chain of backing files.
//!
//! Saved RAM files (`<128-bit random hex>.ram`, see `ram_pages`) live here
//! too and are collected the same way: a RAM file's header names the file
//! it stands on, and a save's RAM file and each VM's `ram_base` are roots.
//!
//! The chains are read from the qcow2 headers themselves (a few bytes each)
//! rather than by spawning `qemu-img` for every file: collection runs after
//! every destroy.
//!
//! Collection and the making of a layer exclude each other through one lock
//! file per data directory (`flock`, so two processes sharing it do too): a
//! layer exists unnamed only between its hard link and the overlay made over
//! it, both under the lock; a VM started from a save holds it while its
//! overlay over the layer is made.

use crate::{Result, RuntimeError};
use std::collections::{HashMap, HashSet};
use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// The qcow2 magic, `QFI\xfb`.
const QCOW2_MAGIC: [u8; 4] = *b"QFI\xfb";
/// qcow2 limits a backing file name to 1023 bytes.
const MAX_BACKING_NAME: u32 = 1023;
/// Longer chains than this are not followed (a loop, or a broken file).
const MAX_DEPTH: usize = 64;

/// A new layer's file name: 128 random bits, so no other VM's QEMU, which
/// may walk through the layers directory but not list it, can guess it.
pub(crate) fn new_name(suffix: &str) -> String {
    format!("{}{suffix}", hex::encode(rand::random::<[u8; 16]>()))
}

/// Is `name` a file name [`new_name`] makes with `.qcow2` (a disk layer)
/// or `.ram` (a saved RAM file)?
pub(crate) fn is_layer_name(name: &str) -> bool {
    name.strip_suffix(".qcow2")
        .or_else(|| name.strip_suffix(".ram"))
        .is_some_and(|h| h.len() == 32 && h.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// The file `file` stands on: a qcow2 image's backing file, or a saved
/// RAM file's parent (see `ram_pages`).
fn stands_on(file: &Path) -> std::io::Result<Option<PathBuf>> {
    match backing_file(file)? {
        Some(below) => Ok(Some(below)),
        None => crate::save::ram_pages::parent_of(file),
    }
}

/// The backing file a qcow2 image names in its header, resolved as QEMU
/// does (a relative name is relative to the image's directory); `None` for
/// an image without one or a file that is not qcow2.
pub fn backing_file(image: &Path) -> std::io::Result<Option<PathBuf>> {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(image)?;
    let mut header = [0u8; 20];
    if let Err(e) = f.read_exact_at(&mut header, 0) {
        return match e.kind() {
            std::io::ErrorKind::UnexpectedEof => Ok(None),
            _ => Err(e),
        };
    }
    if header[..4] != QCOW2_MAGIC {
        return Ok(None);
    }
    let offset = u64::from_be_bytes(header[8..16].try_into().expect("8 bytes"));
    let size = u32::from_be_bytes(header[16..20].try_into().expect("4 bytes"));
    if offset == 0 || size == 0 {
        return Ok(None);
    }
    if size > MAX_BACKING_NAME {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{}: a backing file name of {size} bytes", image.display()),
        ));
    }
    let mut name = vec![0u8; size as usize];
    f.read_exact_at(&mut name, offset)?;
    use std::os::unix::ffi::OsStringExt;
    let name = PathBuf::from(OsString::from_vec(name));
    Ok(Some(if name.is_absolute() {
        name
    } else {
        image.parent().unwrap_or(Path::new("/")).join(name)
    }))
}

/// The layers (file names in `layers_dir`) that the chains of `roots`
/// reach (backing files, RAM files' parents). A file that cannot be read
/// ends its chain.
pub(crate) fn reachable(layers_dir: &Path, roots: &[PathBuf]) -> HashSet<OsString> {
    let layers_dir = canonical(layers_dir);
    // Canonical directories, once per directory met.
    let mut dirs: HashMap<PathBuf, PathBuf> = HashMap::new();
    let mut in_layers = |file: &Path| -> Option<OsString> {
        let parent = file.parent()?;
        let dir = dirs
            .entry(parent.to_path_buf())
            .or_insert_with(|| canonical(parent));
        if *dir != layers_dir {
            return None;
        }
        file.file_name().map(OsString::from)
    };
    let mut found = HashSet::new();
    for root in roots {
        if let Some(name) = in_layers(root) {
            if !found.insert(name) {
                continue;
            }
        }
        let mut file = root.clone();
        for _ in 0..MAX_DEPTH {
            let Ok(Some(backing)) = stands_on(&file) else {
                break;
            };
            if let Some(name) = in_layers(&backing) {
                // Seen already: so is the rest of its chain.
                if !found.insert(name) {
                    break;
                }
            }
            file = backing;
        }
    }
    found
}

fn canonical(dir: &Path) -> PathBuf {
    std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf())
}

/// Remove every layer in `layers_dir` that no chain of `roots` reaches;
/// returns the names removed.
pub(crate) fn collect(layers_dir: &Path, roots: &[PathBuf]) -> Vec<String> {
    let keep = reachable(layers_dir, roots);
    let mut removed = Vec::new();
    let Ok(rd) = std::fs::read_dir(layers_dir) else {
        return removed;
    };
    for e in rd.flatten() {
        let name = e.file_name();
        let Some(text) = name.to_str() else { continue };
        if !is_layer_name(text) || keep.contains(&name) {
            continue;
        }
        match std::fs::remove_file(e.path()) {
            Ok(()) => removed.push(text.to_string()),
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
            Err(err) => tracing::warn!(layer = text, "removing an unused disk layer: {err}"),
        }
    }
    removed
}

/// Every qcow2 file in the directories directly under `dir` (the VMs'
/// directories).
pub(crate) fn qcow2_files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(dir) else {
        return out;
    };
    for sub in rd.flatten() {
        let Ok(files) = std::fs::read_dir(sub.path()) else {
            continue;
        };
        for f in files.flatten() {
            let path = f.path();
            if path.extension().is_some_and(|x| x == "qcow2") {
                out.push(path);
            }
        }
    }
    out
}

/// An exclusive `flock` on `path` (made when missing), released when the
/// file is dropped.
pub(crate) fn lock_blocking(path: &Path) -> Result<std::fs::File> {
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .map_err(RuntimeError::io(format!("opening {}", path.display())))?;
    flock(&f, libc::LOCK_EX).map_err(RuntimeError::io(format!("locking {}", path.display())))?;
    Ok(f)
}

/// [`lock_blocking`] off the async threads.
pub(crate) async fn lock(path: &Path) -> Result<std::fs::File> {
    let path = path.to_path_buf();
    tokio::task::spawn_blocking(move || lock_blocking(&path))
        .await
        .map_err(|e| RuntimeError::Launch(format!("the lock task failed: {e}")))?
}

/// `flock(2)` on an open file (a directory too).
pub(crate) fn flock(f: &std::fs::File, how: libc::c_int) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: flock on an fd owned by `f`; the lock goes with the file.
    if unsafe { libc::flock(f.as_raw_fd(), how) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qemu_img(args: &[&str], dir: &Path) {
        let out = std::process::Command::new("qemu-img")
            .args(args)
            .current_dir(dir)
            .output()
            .expect("qemu-img (package qemu-utils)");
        assert!(
            out.status.success(),
            "qemu-img {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// `qemu-img create` of `file` over `backing` (as given: relative or not).
    fn overlay(dir: &Path, file: &Path, backing: Option<&Path>) {
        let file = file.to_str().unwrap();
        match backing {
            Some(b) => qemu_img(
                &[
                    "create",
                    "-q",
                    "-f",
                    "qcow2",
                    "-F",
                    "qcow2",
                    "-b",
                    b.to_str().unwrap(),
                    file,
                    "64M",
                ],
                dir,
            ),
            None => qemu_img(&["create", "-q", "-f", "qcow2", file, "64M"], dir),
        }
    }

    #[test]
    fn the_header_names_the_backing_file() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let base = d.join("base.qcow2");
        overlay(d, &base, None);
        assert_eq!(backing_file(&base).unwrap(), None);
        let top = d.join("top.qcow2");
        overlay(d, &top, Some(&base));
        assert_eq!(backing_file(&top).unwrap(), Some(base.clone()));
        // A relative name is relative to the image's own directory.
        std::fs::create_dir(d.join("sub")).unwrap();
        let rel = d.join("sub/rel.qcow2");
        overlay(d, &rel, Some(Path::new("../base.qcow2")));
        assert_eq!(
            backing_file(&rel).unwrap(),
            Some(d.join("sub/../base.qcow2"))
        );
        // Not qcow2: nothing to follow.
        std::fs::write(d.join("raw"), vec![0u8; 4096]).unwrap();
        assert_eq!(backing_file(&d.join("raw")).unwrap(), None);
        std::fs::write(d.join("short"), b"QFI").unwrap();
        assert_eq!(backing_file(&d.join("short")).unwrap(), None);
        assert!(backing_file(&d.join("missing")).is_err());
        // A header whose name runs past the file's end is an error.
        let mut bad = std::fs::read(&top).unwrap()[..512].to_vec();
        bad[8..16].copy_from_slice(&4000u64.to_be_bytes());
        std::fs::write(d.join("bad"), &bad).unwrap();
        assert!(backing_file(&d.join("bad")).is_err());
    }

    #[test]
    fn only_layers_no_chain_reaches_are_collected() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let layers = d.join("layers");
        let vms = d.join("vms");
        std::fs::create_dir_all(&layers).unwrap();
        std::fs::create_dir_all(vms.join("a")).unwrap();
        std::fs::create_dir_all(vms.join("b")).unwrap();
        let base = d.join("template.qcow2");
        overlay(d, &base, None);
        let layer = |n: u8| layers.join(format!("{}.qcow2", hex::encode([n; 16])));
        // l1 <- l2 <- a's overlay: the first save, then the second.
        // l3 <- b's overlay: b from a save of another VM.
        // l4: a save's own layer, named by nothing but the save.
        // l5, l6 (l6 over l5): named by nothing.
        overlay(d, &layer(1), Some(&base));
        overlay(d, &layer(2), Some(&layer(1)));
        overlay(d, &vms.join("a/disk-2.qcow2"), Some(&layer(2)));
        overlay(d, &layer(3), Some(&base));
        overlay(d, &vms.join("b/disk.qcow2"), Some(&layer(3)));
        overlay(d, &layer(4), Some(&layer(1)));
        overlay(d, &layer(5), Some(&base));
        overlay(d, &layer(6), Some(&layer(5)));
        // Not a layer's name: never touched.
        std::fs::write(layers.join("notes.txt"), b"x").unwrap();

        let mut roots = qcow2_files_under(&vms);
        roots.sort();
        assert_eq!(
            roots,
            [vms.join("a/disk-2.qcow2"), vms.join("b/disk.qcow2")]
        );
        roots.push(layer(4));
        let name = |n: u8| OsString::from(format!("{}.qcow2", hex::encode([n; 16])));
        let seen = reachable(&layers, &roots);
        assert_eq!(seen, [1, 2, 3, 4].map(name).into_iter().collect());
        // The layers directory named another way is the same directory.
        let other = vec![d.join("layers/../layers").join(name(2))];
        assert_eq!(
            reachable(&layers, &other),
            [1, 2].map(name).into_iter().collect()
        );

        let mut removed = collect(&layers, &roots);
        removed.sort();
        assert_eq!(
            removed,
            [5, 6].map(|n| format!("{}.qcow2", hex::encode([n; 16])))
        );
        // The first save is deleted (l4 is no root now) and b destroyed:
        // a's chain keeps l1 and l2.
        std::fs::remove_dir_all(vms.join("b")).unwrap();
        let roots = qcow2_files_under(&vms);
        let mut removed = collect(&layers, &roots);
        removed.sort();
        assert_eq!(
            removed,
            [3, 4].map(|n| format!("{}.qcow2", hex::encode([n; 16])))
        );
        assert!(layer(1).exists() && layer(2).exists());
        // Nothing names anything: all layers go, other files stay.
        std::fs::remove_dir_all(&vms).unwrap();
        assert_eq!(collect(&layers, &[]).len(), 2);
        let left: Vec<_> = std::fs::read_dir(&layers)
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(left, [OsString::from("notes.txt")]);
    }

    #[test]
    fn a_loop_of_backing_files_ends() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let layers = d.join("layers");
        std::fs::create_dir(&layers).unwrap();
        let a = layers.join(format!("{}.qcow2", hex::encode([1u8; 16])));
        let b = layers.join(format!("{}.qcow2", hex::encode([2u8; 16])));
        overlay(d, &a, None);
        overlay(d, &b, Some(&a));
        // Point a back at b by rewriting its header (qemu-img refuses loops).
        qemu_img(
            &[
                "rebase",
                "-u",
                "-f",
                "qcow2",
                "-F",
                "qcow2",
                "-b",
                b.to_str().unwrap(),
                a.to_str().unwrap(),
            ],
            d,
        );
        assert_eq!(reachable(&layers, std::slice::from_ref(&b)).len(), 2);
    }

    #[test]
    fn layer_names() {
        let n = new_name(".qcow2");
        assert!(is_layer_name(&n), "{n}");
        assert_ne!(n, new_name(".qcow2"));
        assert!(!is_layer_name("disk.qcow2"));
        assert!(!is_layer_name(&format!("{}.qcow2", "g".repeat(32))));
        assert!(!is_layer_name(&n.replace(".qcow2", ".state")));
    }
}
