//! The Debian root file system: debootstrap, packages, the user, then an
//! ext4 image made without mounting it (`mkfs.ext4 -d`) and converted to a
//! read-only qcow2 base that each sandbox overlays.
//!
//! Why like this: debootstrap alone cannot resolve the package set (npm's
//! dependency tree defeats it), so it installs a minimal base and apt does
//! the rest in a chroot. The chroot needs `/proc`, `/dev`, `/dev/pts` and
//! `/sys`; both debootstrap and the chroot phase run in private mount and
//! PID namespaces (`unshare`, see `exec::isolated`), so whatever they mount
//! disappears when they exit and they die with the build: no leaked mounts
//! or processes on the host, even if the build is killed, and deleting a
//! half-built tree can never reach the host's `/dev`.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use super::error::{ImageError, IoContext};
use super::exec::{self, BuildLog};
use super::fsutil;
use super::recipe::{RootfsRecipe, CHROOT_WRAPPER, SETUP_SCRIPT};

/// Name of the base image in a `rootfs-<id>/` directory.
pub(crate) const BASE_NAME: &str = "base.qcow2";

/// A root file system build in progress, in `images_dir/.tmp-rootfs-*`.
pub(crate) struct RootfsBuild {
    _tmp: fsutil::TempDir,
    root: PathBuf,
    raw: PathBuf,
    out: PathBuf,
}

impl RootfsBuild {
    pub(crate) fn start(images_dir: &Path) -> Result<Self, ImageError> {
        let tmp = fsutil::TempDir::new(images_dir, "rootfs")?;
        let out = tmp.path().join("out");
        fs::create_dir(&out).ctx(|| format!("creating {}", out.display()))?;
        Ok(Self {
            root: tmp.path().join("root"),
            raw: tmp.path().join("root.img"),
            out,
            _tmp: tmp,
        })
    }

    /// `debootstrap --variant=minbase` into `root/`.
    pub(crate) fn debootstrap(
        &self,
        recipe: &RootfsRecipe,
        log: &mut BuildLog,
    ) -> Result<(), ImageError> {
        let mut cmd = exec::isolated(&exec::find_tool(exec::DEBOOTSTRAP)?)?;
        cmd.arg("--variant=minbase")
            .arg(format!(
                "--include={}",
                recipe.debootstrap_include.join(",")
            ))
            .arg(&recipe.suite)
            .arg(&self.root)
            .arg(&recipe.mirror);
        let result = log.run(&mut cmd);
        if result.is_err() {
            // debootstrap keeps the details in its own log.
            log.append_file(&self.root.join("debootstrap/debootstrap.log"));
            return Err(log.fail("debootstrap failed"));
        }
        Ok(())
    }

    /// apt-get installs the packages in a chroot, then the user and the
    /// files the guest expects are set up.
    pub(crate) fn install_packages(
        &self,
        recipe: &RootfsRecipe,
        log: &mut BuildLog,
    ) -> Result<(), ImageError> {
        let script = self.root.join("tmp/sandpit-setup.sh");
        fs::write(&script, SETUP_SCRIPT).ctx(|| format!("writing {}", script.display()))?;
        // apt in the chroot needs the host's resolver configuration.
        let resolv = self.root.join("etc/resolv.conf");
        let _ = fs::remove_file(&resolv);
        fs::copy("/etc/resolv.conf", &resolv).ctx(|| format!("writing {}", resolv.display()))?;

        // The wrapper lives beside the tree, not in it.
        let wrapper = self.root.with_file_name("sandpit-chroot.sh");
        fs::write(&wrapper, CHROOT_WRAPPER).ctx(|| format!("writing {}", wrapper.display()))?;

        let mut cmd = exec::isolated(Path::new("/bin/sh"))?;
        cmd.arg(&wrapper).arg(&self.root).args(&recipe.packages);
        log.run(&mut cmd)?;
        fs::remove_file(&script).ctx(|| format!("deleting {}", script.display()))?;
        let tmp = self.root.join("tmp");
        fs::set_permissions(&tmp, fs::Permissions::from_mode(0o1777))
            .ctx(|| format!("chmod {}", tmp.display()))
    }

    /// `mkfs.ext4 -d`: the tree becomes a file system without a mount.
    pub(crate) fn make_filesystem(
        &self,
        recipe: &RootfsRecipe,
        log: &mut BuildLog,
    ) -> Result<(), ImageError> {
        let raw = fs::File::create(&self.raw).ctx(|| format!("creating {}", self.raw.display()))?;
        raw.set_len(recipe.size_bytes)
            .ctx(|| format!("sizing {}", self.raw.display()))?;
        drop(raw);
        let mut cmd = exec::command(exec::MKFS_EXT4)?;
        cmd.args(["-q", "-F", "-L", "sandpit-root", "-d"])
            .arg(&self.root)
            .arg(&self.raw);
        log.run(&mut cmd)?;
        fsutil::remove_tree(&self.root)
    }

    /// Converts to qcow2, makes it read-only and moves it into `final_dir`.
    pub(crate) fn finish(
        self,
        images_dir: &Path,
        recipe: &RootfsRecipe,
        final_dir: &Path,
        log: &mut BuildLog,
    ) -> Result<(), ImageError> {
        let base = self.out.join(BASE_NAME);
        let mut cmd = exec::command(exec::QEMU_IMG)?;
        cmd.args(["convert", "-O", "qcow2"])
            .arg(&self.raw)
            .arg(&base);
        log.run(&mut cmd)?;
        fs::remove_file(&self.raw).ctx(|| format!("deleting {}", self.raw.display()))?;
        fs::set_permissions(&base, fs::Permissions::from_mode(0o444))
            .ctx(|| format!("chmod {}", base.display()))?;
        fsutil::write_json(&self.out.join("recipe.json"), recipe)?;
        fsutil::install_dir(images_dir, &self.out, final_dir)
    }
}
