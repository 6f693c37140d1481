//! The initramfs: busybox, the kernel modules the guest needs before its
//! root disk is visible, the agent binary, and a `/init` script that mounts
//! the root disk and `switch_root`s into the agent as PID 1.
//!
//! Why the agent travels in the initramfs and not in the root file system:
//! the root file system is the slow, shared part of the image; carrying the
//! agent here means a new agent costs a new ~1 s initramfs, not a new root
//! file system. `/init` copies it to a tmpfs (`/run/sandpit`) in the new
//! root, so the guest's own disk never holds it.

use std::fs::{self, File};
use std::io::BufWriter;
use std::path::Path;

use super::cpio::CpioWriter;
use super::error::{ImageError, IoContext};
use super::kernel::CachedKernel;
use super::modules;
use super::recipe::{BUSYBOX_APPLETS, GUEST_MODULES, INIT_SCRIPT};

/// Where the modules go inside the initramfs.
const MODULES_DIR: &str = "lib/modules";

/// Writes the initramfs (an uncompressed newc cpio archive) to `dest`;
/// returns the module files in load order.
pub(crate) fn build(
    dest: &Path,
    busybox: &Path,
    kernel: &CachedKernel,
    agent: &[u8],
) -> Result<Vec<String>, ImageError> {
    let moddir = kernel.modules_dir();
    let read_text = |name: &str| {
        let p = moddir.join(name);
        fs::read_to_string(&p).ctx(|| format!("reading {}", p.display()))
    };
    let modules_dep = read_text("modules.dep")?;
    // Absent when the kernel has no built-in modules worth listing.
    let builtin: String = read_text("modules.builtin").unwrap_or_default();
    let order =
        modules::resolve_load_order(&modules_dep, &builtin, GUEST_MODULES, &kernel.release)?;

    let read = |p: &Path| fs::read(p).ctx(|| format!("reading {}", p.display()));
    let file = File::create(dest).ctx(|| format!("creating {}", dest.display()))?;
    let mut w = CpioWriter::new(BufWriter::new(file));
    let werr = |e| ImageError::Io {
        context: format!("writing {}", dest.display()),
        source: e,
    };

    for dir in ["bin", "dev", "proc", "sys", "newroot", "lib", MODULES_DIR] {
        w.dir(dir, 0o755).map_err(werr)?;
    }
    // The kernel opens /dev/console for init's stdio before /init runs.
    w.char_dev("dev/console", 0o600, 5, 1).map_err(werr)?;
    w.char_dev("dev/null", 0o666, 1, 3).map_err(werr)?;
    w.file("bin/busybox", 0o755, &read(busybox)?)
        .map_err(werr)?;
    for applet in BUSYBOX_APPLETS {
        w.symlink(&format!("bin/{applet}"), "busybox")
            .map_err(werr)?;
    }

    let mut load = String::new();
    for rel in &order {
        let name = modules::module_name(rel);
        let inside = format!("{MODULES_DIR}/{name}.ko");
        w.file(&inside, 0o644, &read(&moddir.join(rel))?)
            .map_err(werr)?;
        load.push_str(&format!("/{inside}\n"));
    }
    w.file("modules.load", 0o644, load.as_bytes())
        .map_err(werr)?;
    w.file("sandpit-agent", 0o755, agent).map_err(werr)?;
    w.file("init", 0o755, INIT_SCRIPT.as_bytes())
        .map_err(werr)?;
    w.finish()
        .map_err(werr)?
        .into_inner()
        .map_err(|e| werr(e.into_error()))?
        .sync_all()
        .map_err(werr)?;
    Ok(order)
}
