//! A private apt configuration for fetching the kernel and busybox packages
//! on the host, from the spec's mirror and suite.
//!
//! Why not the host's apt: its sources may point elsewhere (another suite,
//! snapshots, backports), its lists may be stale or missing, and the guest's
//! kernel must come from the same archive as its root filesystem. The state
//! (sources, lists, an empty dpkg status) lives in `images_dir/apt-<hash>/`;
//! the host's `apt.conf.d` still applies, so proxy settings keep working.
//! Lists are fetched once and then reused, which makes resolving
//! `linux-image-cloud-amd64` to a concrete kernel an offline ~0.4 s lookup:
//! a new agent binary rebuilds the image without touching the network. To
//! pick up a newer kernel from the mirror, delete that `apt-*` directory.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

use super::error::{ImageError, IoContext};
use super::exec::{self, BuildLog};

pub(crate) struct PrivateApt {
    dir: PathBuf,
}

impl PrivateApt {
    pub(crate) fn new(images_dir: &Path, mirror: &str, suite: &str) -> Self {
        let key = hex::encode(Sha256::digest(format!("{mirror}\n{suite}\n").as_bytes()));
        Self {
            dir: images_dir.join(format!("apt-{}", &key[..12])),
        }
    }

    fn stamp(&self) -> PathBuf {
        self.dir.join("lists-complete")
    }

    /// Whether package lists were fetched before.
    pub(crate) fn has_lists(&self) -> bool {
        self.stamp().exists() && self.dir.join("apt.conf").exists()
    }

    /// Writes the configuration and fetches the package lists.
    pub(crate) fn update(
        &self,
        mirror: &str,
        suite: &str,
        log: &mut BuildLog,
    ) -> Result<(), ImageError> {
        for sub in [
            "sources.list.d",
            "preferences.d",
            "state/lists/partial",
            "cache/archives/partial",
        ] {
            let d = self.dir.join(sub);
            fs::create_dir_all(&d).ctx(|| format!("creating {}", d.display()))?;
        }
        let signed_by = if Path::new(exec::DEBIAN_KEYRING).exists() {
            format!("[signed-by={}] ", exec::DEBIAN_KEYRING)
        } else {
            String::new()
        };
        let sources = self.dir.join("sources.list");
        fs::write(&sources, format!("deb {signed_by}{mirror} {suite} main\n"))
            .ctx(|| format!("writing {}", sources.display()))?;
        let status = self.dir.join("state/status");
        fs::write(&status, "").ctx(|| format!("writing {}", status.display()))?;
        self.write_config()?;
        let _ = fs::remove_file(self.stamp());
        // Without --error-on=any, apt-get update exits 0 when nothing could
        // be fetched.
        log.run(
            self.command(exec::APT_GET)?
                .args(["update", "--error-on=any"]),
        )?;
        fs::write(self.stamp(), "").ctx(|| format!("writing {}", self.stamp().display()))
    }

    /// `apt-get`/`apt-cache` with this configuration (through `APT_CONFIG`,
    /// which replaces only `/etc/apt/apt.conf`: `apt.conf.d` still applies).
    ///
    /// The configuration is written again first: it names this directory by
    /// its absolute path, and the images directory may be reached by
    /// another path than the one that fetched the lists (moved, or a build
    /// cache that several checkouts link to). A configuration written once
    /// would send apt to a directory that is no longer there.
    pub(crate) fn command(&self, tool: exec::Tool) -> Result<Command, ImageError> {
        self.write_config()?;
        let mut cmd = exec::command(tool)?;
        cmd.env("APT_CONFIG", self.dir.join("apt.conf"));
        Ok(cmd)
    }

    /// Writes `apt.conf` for this directory, whole (through a rename, so a
    /// concurrent reader never sees half of it).
    fn write_config(&self) -> Result<(), ImageError> {
        // By its real path: the directory may be reached through a link
        // (a test's images directory over a shared cache) that is gone
        // before the next reader comes.
        let real = fs::canonicalize(&self.dir).unwrap_or_else(|_| self.dir.clone());
        let d = real.display();
        let conf = format!(
            "Dir::Etc::SourceList \"{d}/sources.list\";\n\
             Dir::Etc::SourceParts \"{d}/sources.list.d\";\n\
             Dir::Etc::Preferences \"{d}/preferences\";\n\
             Dir::Etc::PreferencesParts \"{d}/preferences.d\";\n\
             Dir::State \"{d}/state\";\n\
             Dir::State::status \"{d}/state/status\";\n\
             Dir::Cache \"{d}/cache\";\n\
             APT::Architecture \"amd64\";\n\
             APT::Architectures {{ \"amd64\"; }};\n\
             APT::Sandbox::User \"root\";\n"
        );
        let path = self.dir.join("apt.conf");
        let partial = self
            .dir
            .join(format!("apt.conf.{}.partial", std::process::id()));
        fs::write(&partial, conf).ctx(|| format!("writing {}", partial.display()))?;
        fs::rename(&partial, &path).ctx(|| format!("writing {}", path.display()))
    }

    /// The concrete kernel package behind `package` (a metapackage such as
    /// `linux-image-cloud-amd64`, or already a concrete one) and its release.
    pub(crate) fn resolve_kernel(
        &self,
        package: &str,
        log: &mut BuildLog,
    ) -> Result<(String, String), ImageError> {
        let concrete = if is_concrete_kernel(package) {
            package.to_string()
        } else {
            let out = log.output(self.command(exec::APT_CACHE)?.args(["depends", package]))?;
            match kernel_dependency(&out) {
                Some(p) => p,
                None => {
                    let _ = log.note(&out);
                    return Err(log.fail(&format!(
                        "{package} does not depend on a linux-image-<release> package"
                    )));
                }
            }
        };
        let release = concrete
            .strip_prefix("linux-image-")
            .map(|r| r.strip_suffix("-unsigned").unwrap_or(r).to_string())
            .expect("concrete kernel packages start with linux-image-");
        Ok((concrete, release))
    }

    /// The candidate version of `package`.
    pub(crate) fn version(&self, package: &str, log: &mut BuildLog) -> Result<String, ImageError> {
        let out = log.output(self.command(exec::APT_CACHE)?.args([
            "show",
            "--no-all-versions",
            package,
        ]))?;
        out.lines()
            .find_map(|l| l.strip_prefix("Version: "))
            .map(|v| v.trim().to_string())
            .ok_or_else(|| log.fail(&format!("no version of {package} in the package lists")))
    }

    /// Downloads `package` into `dest` and extracts it to `dest/root`;
    /// returns that root.
    pub(crate) fn fetch_and_extract(
        &self,
        package: &str,
        dest: &Path,
        log: &mut BuildLog,
    ) -> Result<PathBuf, ImageError> {
        log.run(
            self.command(exec::APT_GET)?
                .current_dir(dest)
                .args(["download", package]),
        )?;
        let deb = fs::read_dir(dest)
            .ctx(|| format!("reading {}", dest.display()))?
            .flatten()
            .map(|e| e.path())
            .find(|p| p.extension().is_some_and(|e| e == "deb"))
            .ok_or_else(|| log.fail(&format!("apt-get download {package} left no .deb")))?;
        let root = dest.join("root");
        log.run(
            exec::command(exec::DPKG_DEB)?
                .arg("-x")
                .arg(&deb)
                .arg(&root),
        )?;
        fs::remove_file(&deb).ctx(|| format!("deleting {}", deb.display()))?;
        Ok(root)
    }
}

/// `linux-image-6.1.0-50-cloud-amd64` (a release number after the prefix).
fn is_concrete_kernel(package: &str) -> bool {
    package
        .strip_prefix("linux-image-")
        .is_some_and(|r| r.starts_with(|c: char| c.is_ascii_digit()))
}

/// The first `Depends: linux-image-<digit>...` in `apt-cache depends` output.
fn kernel_dependency(apt_cache_depends: &str) -> Option<String> {
    apt_cache_depends.lines().find_map(|line| {
        let dep = line
            .trim()
            .trim_start_matches('|')
            .strip_prefix("Depends:")?
            .trim();
        let dep = dep.trim_start_matches('<').trim_end_matches('>');
        is_concrete_kernel(dep).then(|| dep.to_string())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_kernel_dependency() {
        let out = "linux-image-cloud-amd64\n  Depends: linux-image-6.1.0-50-cloud-amd64\n";
        assert_eq!(
            kernel_dependency(out).as_deref(),
            Some("linux-image-6.1.0-50-cloud-amd64")
        );
        let out = "x\n  Depends: kmod\n |Depends: linux-image-6.12.9-cloud-amd64-unsigned\n";
        assert_eq!(
            kernel_dependency(out).as_deref(),
            Some("linux-image-6.12.9-cloud-amd64-unsigned")
        );
        assert_eq!(kernel_dependency("x\n  Depends: linux-base\n"), None);
        assert!(is_concrete_kernel("linux-image-6.1.0-50-cloud-amd64"));
        assert!(!is_concrete_kernel("linux-image-cloud-amd64"));
    }

    /// Lists fetched under one path, the images directory then reached by
    /// another: apt is pointed at the directory where it is now.
    #[test]
    fn a_moved_images_directory_gets_a_configuration_naming_where_it_is() {
        let root = tempfile::tempdir().unwrap();
        let first = root.path().join("first");
        let apt = PrivateApt::new(&first, "http://deb.debian.org/debian", "bookworm");
        fs::create_dir_all(&apt.dir).unwrap();
        apt.write_config().unwrap();
        fs::write(apt.stamp(), "").unwrap();
        let moved = root.path().join("moved");
        fs::rename(&first, &moved).unwrap();
        let apt = PrivateApt::new(&moved, "http://deb.debian.org/debian", "bookworm");
        assert!(apt.has_lists());
        // Reached through a link, it is still named by its real path.
        let link = root.path().join("link");
        std::os::unix::fs::symlink(&apt.dir, &link).unwrap();
        PrivateApt { dir: link.clone() }.write_config().unwrap();
        let conf = fs::read_to_string(apt.dir.join("apt.conf")).unwrap();
        assert!(!conf.contains(&link.display().to_string()), "{conf}");
        check_names(&apt.dir, &first);
        let Ok(cmd) = apt.command(exec::APT_CACHE) else {
            // No apt-cache on this machine: the configuration, checked
            // above, is all there is to check.
            return;
        };
        let config = cmd
            .get_envs()
            .find(|(k, _)| *k == "APT_CONFIG")
            .and_then(|(_, v)| v)
            .map(PathBuf::from)
            .unwrap();
        assert_eq!(config, apt.dir.join("apt.conf"));
        check_names(&apt.dir, &first);
    }

    fn check_names(dir: &Path, old: &Path) {
        let conf = fs::read_to_string(dir.join("apt.conf")).unwrap();
        let dir = fs::canonicalize(dir).unwrap();
        let dir = dir.as_path();
        assert!(
            conf.contains(&format!("Dir::State \"{}/state\";", dir.display())),
            "{conf}"
        );
        assert!(!conf.contains(&old.display().to_string()), "{conf}");
        let left: Vec<_> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.contains("partial"))
            .collect();
        assert!(left.is_empty(), "{left:?}");
    }
}
