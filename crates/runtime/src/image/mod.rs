//! Guest images: a Debian 12 root file system, the Debian cloud kernel and
//! an initramfs carrying the agent, built once and cached by recipe hash.
//!
//! Why a cache split in three: building the root file system takes over a
//! minute (debootstrap + apt), fetching a kernel a few seconds, and an
//! initramfs about one. Each part is cached under `images_dir` by what
//! determines it, so changing the agent binary (the common case during
//! development) rebuilds only the initramfs:
//!
//! ```text
//! images_dir/
//!   .lock                         flock: one builder at a time, others wait
//!   logs/build-*.log              subprocess output of each build
//!   apt-<hash>/                   private apt state for mirror + suite
//!   rootfs-<id>/base.qcow2        read-only base disk (+ recipe.json)
//!   kernel-<release>/vmlinuz      + modules/ (lib/modules/<release>)
//!   busybox-<version>/busybox     static busybox for the initramfs
//!   image-<id>/                   vmlinuz, initrd.img, image.json,
//!                                 recipe.json, rootfs.qcow2 -> the base
//! ```
//!
//! Every part is built in a `.tmp-*` directory inside `images_dir` and
//! renamed into place when complete, so a crash never leaves something that
//! looks finished; [`find_image`] only ever sees whole images. The blocking
//! functions here are meant for `spawn_blocking`.
//!
//! The kernel metapackage (`linux-image-cloud-amd64`) is resolved against
//! package lists fetched once per mirror and suite, so rebuilding an image
//! needs no network and keeps the kernel it had; to move to a newer kernel
//! from the mirror, delete `apt-<hash>/`. Old images, root file systems and
//! kernels are removed once nothing stands on them ([`collect_outdated`]).

mod apt;
mod collect;
mod cpio;
mod error;
mod exec;
mod fsutil;
mod initramfs;
mod kernel;
mod modules;
mod progress;
mod recipe;
mod rootfs;

use std::fs;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

pub use collect::{collect_outdated, InUse};
pub use error::ImageError;
pub use progress::{BarProgress, BuildProgress, NoProgress};
pub use recipe::{
    ImageRecipe, RootfsRecipe, BUILDER_VERSION, DEFAULT_KERNEL_PACKAGE, DEFAULT_MIRROR,
    DEFAULT_PACKAGES, DEFAULT_SUITE,
};

use error::IoContext;
use exec::BuildLog;
use kernel::{CachedBusybox, CachedKernel};

/// What to build: the guest's Debian suite, packages and kernel, and the
/// agent binary that becomes the guest's PID 1.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ImageSpec {
    /// The in-guest agent (a static x86_64 binary).
    pub agent_binary: PathBuf,
    /// Debian mirror URL.
    pub mirror: String,
    /// Debian suite.
    pub suite: String,
    /// Packages installed in the root file system.
    pub packages: Vec<String>,
    /// Kernel package: a metapackage (resolved through its dependency) or a
    /// concrete `linux-image-<release>`.
    pub kernel_package: String,
}

impl Default for ImageSpec {
    fn default() -> Self {
        Self {
            agent_binary: PathBuf::new(),
            mirror: DEFAULT_MIRROR.to_string(),
            suite: DEFAULT_SUITE.to_string(),
            packages: DEFAULT_PACKAGES.iter().map(|p| p.to_string()).collect(),
            kernel_package: DEFAULT_KERNEL_PACKAGE.to_string(),
        }
    }
}

/// A complete, cached guest image (what `image.json` holds).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuestImage {
    /// Short hash of the image recipe.
    pub id: String,
    /// The image directory.
    pub dir: PathBuf,
    /// The kernel (`vmlinuz`) to pass to `-kernel`.
    pub kernel: PathBuf,
    /// The initramfs to pass to `-initrd`.
    pub initrd: PathBuf,
    /// The read-only qcow2 base disk; give each VM an overlay on it.
    pub rootfs: PathBuf,
    /// The kernel release, e.g. `6.1.0-50-cloud-amd64`.
    pub kernel_release: String,
}

/// Returns the cached image for `spec` if it is complete; never builds.
pub fn find_image(images_dir: &Path, spec: &ImageSpec) -> Result<Option<GuestImage>, ImageError> {
    Ok(Plan::new(images_dir, spec)?.load())
}

/// Returns the image for `spec`, building whatever is not cached yet.
/// Waits if another process is building in the same `images_dir`.
pub fn ensure_image(
    images_dir: &Path,
    spec: &ImageSpec,
    progress: &dyn BuildProgress,
) -> Result<GuestImage, ImageError> {
    let plan = Plan::new(images_dir, spec)?;
    if let Some(image) = plan.load() {
        return Ok(image);
    }
    if !nix::unistd::geteuid().is_root() {
        return Err(ImageError::NotRoot);
    }
    fs::create_dir_all(&plan.images_dir)
        .ctx(|| format!("creating {}", plan.images_dir.display()))?;
    let _lock = fsutil::BuildLock::acquire(&plan.images_dir)?;
    if let Some(image) = plan.load() {
        // Another process built it while we waited.
        return Ok(image);
    }
    fsutil::remove_stale_temp_dirs(&plan.images_dir)?;
    let result = plan.build(spec, progress);
    progress.finish();
    result
}

/// The names and recipes of one spec's cache entries.
struct Plan {
    images_dir: PathBuf,
    rootfs: recipe::RootfsRecipe,
    rootfs_dir: PathBuf,
    image: recipe::ImageRecipe,
    image_dir: PathBuf,
    agent: Vec<u8>,
}

impl Plan {
    fn new(images_dir: &Path, spec: &ImageSpec) -> Result<Self, ImageError> {
        validate(spec)?;
        let images_dir = std::path::absolute(images_dir)
            .ctx(|| format!("resolving {}", images_dir.display()))?;
        let agent_path = &spec.agent_binary;
        if agent_path.as_os_str().is_empty() || !agent_path.is_file() {
            return Err(ImageError::AgentMissing(agent_path.clone()));
        }
        // Read once: the bytes hashed are the bytes packed.
        let agent = fs::read(agent_path).ctx(|| format!("reading {}", agent_path.display()))?;
        let agent_sha256 = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(&agent));
        let rootfs = recipe::RootfsRecipe::new(&spec.suite, &spec.mirror, &spec.packages);
        let rootfs_dir = images_dir.join(format!("rootfs-{}", rootfs.id()));
        let image = recipe::ImageRecipe::new(&rootfs.id(), &spec.kernel_package, &agent_sha256);
        let image_dir = images_dir.join(format!("image-{}", image.id()));
        Ok(Self {
            images_dir,
            rootfs,
            rootfs_dir,
            image,
            image_dir,
            agent,
        })
    }

    fn base(&self) -> PathBuf {
        self.rootfs_dir.join(rootfs::BASE_NAME)
    }

    fn rootfs_complete(&self) -> bool {
        self.base().is_file() && self.rootfs_dir.join("recipe.json").is_file()
    }

    fn guest_image(&self, kernel_release: &str) -> GuestImage {
        GuestImage {
            id: self.image.id(),
            dir: self.image_dir.clone(),
            kernel: self.image_dir.join("vmlinuz"),
            initrd: self.image_dir.join("initrd.img"),
            rootfs: self.base(),
            kernel_release: kernel_release.to_string(),
        }
    }

    /// The cached image, if complete. Paths are derived from `images_dir`
    /// (not trusted from the file), so a moved cache still works.
    fn load(&self) -> Option<GuestImage> {
        let path = self.image_dir.join("image.json");
        let text = fs::read_to_string(&path).ok()?;
        let stored: GuestImage = match serde_json::from_str(&text) {
            Ok(stored) => stored,
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "ignoring unreadable image metadata");
                return None;
            }
        };
        let image = self.guest_image(&stored.kernel_release);
        let complete = stored.id == image.id
            && image.kernel.is_file()
            && image.initrd.is_file()
            && self.rootfs_complete();
        complete.then_some(image)
    }

    fn build(
        &self,
        spec: &ImageSpec,
        progress: &dyn BuildProgress,
    ) -> Result<GuestImage, ImageError> {
        let apt = apt::PrivateApt::new(&self.images_dir, &self.rootfs.mirror, &self.rootfs.suite);
        let need_rootfs = !self.rootfs_complete();
        let need_lists = !apt.has_lists();
        preflight(need_rootfs, need_lists)?;

        let mut log = BuildLog::create(&self.images_dir.join("logs"))?;
        tracing::info!(log = %log.path().display(), image = %self.image.id(), "building guest image");
        let mut resolved = if need_lists {
            None
        } else {
            log.begin_step("resolve kernel and busybox packages")?;
            let resolved = self.resolve(&apt, spec, &mut log)?;
            log.end_step()?;
            Some(resolved)
        };

        let mut plan: Vec<Step> = Vec::new();
        if need_lists {
            plan.push(Step::Lists);
        }
        match &resolved {
            None => plan.extend([Step::Kernel, Step::Busybox]),
            Some((kernel, _, busybox)) => {
                if !kernel.is_complete() {
                    plan.push(Step::Kernel);
                }
                if !busybox.is_complete() {
                    plan.push(Step::Busybox);
                }
            }
        }
        if need_rootfs {
            plan.extend([
                Step::Debootstrap,
                Step::Packages,
                Step::Filesystem,
                Step::Qcow2,
            ]);
        }
        plan.push(Step::Initramfs);

        let total = plan.len();
        let mut rootfs_build = None;
        for (i, step) in plan.iter().enumerate() {
            let name = step.name(&self.rootfs.suite);
            progress.step(i + 1, total, &name);
            log.begin_step(&name)?;
            match step {
                Step::Lists => {
                    apt.update(&self.rootfs.mirror, &self.rootfs.suite, &mut log)?;
                    resolved = Some(self.resolve(&apt, spec, &mut log)?);
                }
                Step::Kernel => {
                    let (kernel, package, _) = resolved.as_ref().expect("resolved before");
                    if !kernel.is_complete() {
                        kernel.fetch(&self.images_dir, &apt, package, &mut log)?;
                    }
                }
                Step::Busybox => {
                    let (_, _, busybox) = resolved.as_ref().expect("resolved before");
                    if !busybox.is_complete() {
                        busybox.fetch(&self.images_dir, &apt, &mut log)?;
                    }
                }
                Step::Debootstrap => {
                    let build = rootfs::RootfsBuild::start(&self.images_dir)?;
                    build.debootstrap(&self.rootfs, &mut log)?;
                    rootfs_build = Some(build);
                }
                Step::Packages => rootfs_build
                    .as_ref()
                    .expect("debootstrap ran")
                    .install_packages(&self.rootfs, &mut log)?,
                Step::Filesystem => rootfs_build
                    .as_ref()
                    .expect("debootstrap ran")
                    .make_filesystem(&self.rootfs, &mut log)?,
                Step::Qcow2 => rootfs_build.take().expect("debootstrap ran").finish(
                    &self.images_dir,
                    &self.rootfs,
                    &self.rootfs_dir,
                    &mut log,
                )?,
                Step::Initramfs => {
                    let (kernel, _, busybox) = resolved.as_ref().expect("resolved before");
                    let image = self.assemble(kernel, busybox, &mut log)?;
                    log.end_step()?;
                    tracing::info!(image = %image.id, dir = %image.dir.display(), "guest image ready");
                    return Ok(image);
                }
            }
            log.end_step()?;
        }
        unreachable!("the plan ends with the initramfs step")
    }

    /// Resolves the kernel metapackage and busybox's version from the
    /// cached package lists (offline).
    fn resolve(
        &self,
        apt: &apt::PrivateApt,
        spec: &ImageSpec,
        log: &mut BuildLog,
    ) -> Result<(CachedKernel, String, CachedBusybox), ImageError> {
        let (package, release) = apt.resolve_kernel(&spec.kernel_package, log)?;
        let version = apt.version(kernel::BUSYBOX_PACKAGE, log)?;
        log.note(&format!(
            "kernel: {package} ({release}); busybox-static {version}"
        ))?;
        Ok((
            CachedKernel::at(&self.images_dir, &release),
            package,
            CachedBusybox::at(&self.images_dir, &version),
        ))
    }

    /// Writes the image directory: initramfs, kernel, metadata.
    fn assemble(
        &self,
        kernel: &CachedKernel,
        busybox: &CachedBusybox,
        log: &mut BuildLog,
    ) -> Result<GuestImage, ImageError> {
        let tmp = fsutil::TempDir::new(&self.images_dir, "image")?;
        let out = tmp.path().join("out");
        fs::create_dir(&out).ctx(|| format!("creating {}", out.display()))?;
        let order = initramfs::build(
            &out.join("initrd.img"),
            &busybox.binary(),
            kernel,
            &self.agent,
        )?;
        log.note(&format!(
            "initramfs modules, in load order: {}",
            order.join(" ")
        ))?;
        fsutil::link_or_copy(&kernel.vmlinuz(), &out.join("vmlinuz"))?;
        let base_rel = Path::new("..")
            .join(self.rootfs_dir.file_name().expect("rootfs dir has a name"))
            .join(rootfs::BASE_NAME);
        std::os::unix::fs::symlink(&base_rel, out.join("rootfs.qcow2"))
            .ctx(|| format!("linking {}", base_rel.display()))?;
        let image = self.guest_image(&kernel.release);
        fsutil::write_json(&out.join("recipe.json"), &self.image)?;
        fsutil::write_json(&out.join("image.json"), &image)?;
        fsutil::install_dir(&self.images_dir, &out, &self.image_dir)?;
        Ok(image)
    }
}

/// The steps of a build, in the order they run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    Lists,
    Kernel,
    Busybox,
    Debootstrap,
    Packages,
    Filesystem,
    Qcow2,
    Initramfs,
}

impl Step {
    fn name(self, suite: &str) -> String {
        match self {
            Step::Lists => format!("fetch package lists ({suite})"),
            Step::Kernel => "download kernel".into(),
            Step::Busybox => "download busybox".into(),
            Step::Debootstrap => format!("debootstrap {suite} (minbase)"),
            Step::Packages => "install packages in chroot".into(),
            Step::Filesystem => "make ext4 file system".into(),
            Step::Qcow2 => "convert to qcow2".into(),
            Step::Initramfs => "build initramfs".into(),
        }
    }
}

/// Checks the host before anything slow: every tool the planned steps run.
fn preflight(need_rootfs: bool, need_lists: bool) -> Result<(), ImageError> {
    let mut tools = vec![exec::APT_GET, exec::APT_CACHE, exec::DPKG_DEB];
    if need_rootfs {
        tools.extend([
            exec::DEBOOTSTRAP,
            exec::UNSHARE,
            exec::MOUNT,
            exec::CHROOT,
            exec::MKFS_EXT4,
            exec::QEMU_IMG,
        ]);
    }
    for tool in tools {
        exec::find_tool(tool)?;
    }
    if (need_rootfs || need_lists) && !Path::new(exec::DEBIAN_KEYRING).is_file() {
        return Err(ImageError::MissingTool {
            tool: exec::DEBIAN_KEYRING.to_string(),
            package: "debian-archive-keyring".to_string(),
        });
    }
    Ok(())
}

/// Rejects specs whose strings would be read as options or break the
/// generated files.
fn validate(spec: &ImageSpec) -> Result<(), ImageError> {
    let bad = |what: &str, value: &str| ImageError::InvalidSpec(format!("{what} {value:?}"));
    let plain = |s: &str| {
        !s.is_empty()
            && !s.starts_with('-')
            && !s.chars().any(|c| c.is_whitespace() || c.is_control())
    };
    if !plain(&spec.suite) || spec.suite.contains('/') {
        return Err(bad("suite", &spec.suite));
    }
    if !plain(&spec.mirror)
        || !(spec.mirror.starts_with("http://") || spec.mirror.starts_with("https://"))
    {
        return Err(bad("mirror", &spec.mirror));
    }
    if !plain(&spec.kernel_package) || !spec.kernel_package.starts_with("linux-image-") {
        return Err(bad("kernel package", &spec.kernel_package));
    }
    for p in &spec.packages {
        if !plain(p) {
            return Err(bad("package", p));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
