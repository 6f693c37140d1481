//! The guest kernel and the initramfs's busybox, each fetched once from
//! Debian's archive with `apt-get download` + `dpkg-deb -x` and cached by
//! version.
//!
//! Why from packages and not the host: the host need not run Debian's cloud
//! kernel nor have busybox installed, and the guest must not depend on what
//! the host happens to have. The cache keys are the kernel release
//! (`kernel-6.1.0-50-cloud-amd64/`) and the busybox package version, so two
//! images with the same kernel share one 100 MB module tree.

use std::fs;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::apt::PrivateApt;
use super::error::{ImageError, IoContext};
use super::exec::BuildLog;
use super::fsutil;
use super::modules;

/// What `kernel.json` in a kernel cache directory records.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct KernelInfo {
    pub release: String,
    pub package: String,
    pub version: String,
}

/// A cached kernel: `vmlinuz` and `modules/` (the `lib/modules/<release>` tree).
#[derive(Debug, Clone)]
pub(crate) struct CachedKernel {
    pub dir: PathBuf,
    pub release: String,
}

impl CachedKernel {
    pub(crate) fn at(images_dir: &Path, release: &str) -> Self {
        Self {
            dir: images_dir.join(format!("kernel-{release}")),
            release: release.to_string(),
        }
    }

    pub(crate) fn vmlinuz(&self) -> PathBuf {
        self.dir.join("vmlinuz")
    }

    pub(crate) fn modules_dir(&self) -> PathBuf {
        self.dir.join("modules")
    }

    pub(crate) fn is_complete(&self) -> bool {
        self.dir.join("kernel.json").is_file()
            && self.vmlinuz().is_file()
            && self.modules_dir().join("modules.dep").is_file()
    }

    /// Downloads and unpacks `package` (the concrete kernel package).
    pub(crate) fn fetch(
        &self,
        images_dir: &Path,
        apt: &PrivateApt,
        package: &str,
        log: &mut BuildLog,
    ) -> Result<(), ImageError> {
        let version = apt.version(package, log)?;
        let guard = fsutil::TempDir::new(images_dir, "kernel")?;
        let tmp = guard.path();
        let root = apt.fetch_and_extract(package, tmp, log)?;
        let out = tmp.join("out");
        fs::create_dir(&out).ctx(|| format!("creating {}", out.display()))?;

        let vmlinuz = root.join("boot").join(format!("vmlinuz-{}", self.release));
        if !vmlinuz.is_file() {
            return Err(log.fail(&format!("{package} has no boot/vmlinuz-{}", self.release)));
        }
        fs::rename(&vmlinuz, out.join("vmlinuz"))
            .ctx(|| format!("moving {}", vmlinuz.display()))?;

        let moddir = ["lib/modules", "usr/lib/modules"]
            .iter()
            .map(|d| root.join(d).join(&self.release))
            .find(|d| d.is_dir())
            .ok_or_else(|| log.fail(&format!("{package} has no lib/modules/{}", self.release)))?;
        let target = out.join("modules");
        fs::rename(&moddir, &target).ctx(|| format!("moving {}", moddir.display()))?;
        modules::prepare_tree(&target, log)?;

        let info = KernelInfo {
            release: self.release.clone(),
            package: package.to_string(),
            version,
        };
        fsutil::write_json(&out.join("kernel.json"), &info)?;
        fsutil::install_dir(images_dir, &out, &self.dir)
    }
}

/// A cached busybox: `busybox-<version>/busybox` (static).
pub(crate) struct CachedBusybox {
    pub dir: PathBuf,
}

/// The Debian package with a statically linked busybox.
pub(crate) const BUSYBOX_PACKAGE: &str = "busybox-static";

impl CachedBusybox {
    pub(crate) fn at(images_dir: &Path, version: &str) -> Self {
        let safe: String = version
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || ".+-~".contains(c) {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        Self {
            dir: images_dir.join(format!("busybox-{safe}")),
        }
    }

    pub(crate) fn binary(&self) -> PathBuf {
        self.dir.join("busybox")
    }

    pub(crate) fn is_complete(&self) -> bool {
        self.binary().is_file()
    }

    pub(crate) fn fetch(
        &self,
        images_dir: &Path,
        apt: &PrivateApt,
        log: &mut BuildLog,
    ) -> Result<(), ImageError> {
        let guard = fsutil::TempDir::new(images_dir, "busybox")?;
        let tmp = guard.path();
        let root = apt.fetch_and_extract(BUSYBOX_PACKAGE, tmp, log)?;
        let binary = ["bin/busybox", "usr/bin/busybox"]
            .iter()
            .map(|p| root.join(p))
            .find(|p| p.is_file())
            .ok_or_else(|| log.fail(&format!("{BUSYBOX_PACKAGE} has no bin/busybox")))?;
        let out = tmp.join("out");
        fs::create_dir(&out).ctx(|| format!("creating {}", out.display()))?;
        fs::rename(&binary, out.join("busybox")).ctx(|| format!("moving {}", binary.display()))?;
        fsutil::install_dir(images_dir, &out, &self.dir)
    }
}
