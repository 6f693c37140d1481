//! A save's guest RAM as one read-only file, put together by the kernel
//! from the files that hold it, for every VM started from the save.
//!
//! A save holds only the pages that differ from its template (see
//! `ram_pages`). Writing those into each new VM's copy-on-write mapping of
//! the template costs a page fault and two copies per page, per VM, before
//! the guest may run: 0.1 s for a save of 300 MiB alone, and three copies of
//! a fork started side by side wait on each other for the CPU. Making the
//! RAM whole once in memory (tried: a memfd, then a huge-page tmpfs) costs
//! as much, because every page of it is new memory, and on hosts that are
//! VMs themselves new memory is what is slow.
//!
//! Instead the kernel composes it (see `erofs`): a small EROFS image names,
//! for each page, the block of the template's RAM file or of a chain file
//! that holds it, or a hole. Its one file is the save's RAM. A VM's QEMU
//! maps it privately, exactly as a template restore maps the template's RAM
//! file: no page is copied before the guest runs, a page is read from its
//! file the first time any VM started from the save touches it, into the
//! image's page cache that those VMs share, and copied only when a guest
//! writes it.
//!
//! The image is written to a file on a ramfs of its own and mounted
//! nowhere (`fsmount`, see `erofs::scratch_file`): nothing is left behind
//! by a crash, and the mount lives as long as a QEMU maps its file. It
//! needs root (as the VMs' own uids do) and file-backed EROFS (Linux 6.12);
//! without either, a start from a save writes its pages as before
//! ([`RamImages::get`] answers `None`), and so does a start whose image
//! failed for any other reason (logged; the next start tries again).
//!
//! The first VM to touch a page of an image pays for reading it in: a VM
//! alone on a new image answers its first command about 0.15 s later than
//! one whose pages were written before it ran. So an image is made for
//! new sandboxes from a save (a snapshot's, a fork's copies), which others
//! may share, and not for a sandbox started again from its own save (a
//! resume, a rollback) unless one is kept. An image is kept for [`LINGER`]
//! after the last start that asked for it, so VMs started one after another
//! from the same save share one page cache.

use crate::{save::erofs, save::ram_pages, Result, RuntimeError};
use std::collections::HashMap;
use std::fs::File;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How long an image is kept for the next start from the same save.
pub const LINGER: Duration = Duration::from_secs(30);
/// The name of the image's one file.
const FILE: &str = "ram";

/// The images being made or kept, by save RAM file name.
#[derive(Default, Clone)]
pub struct RamImages {
    images: Arc<Mutex<HashMap<String, Arc<Entry>>>>,
    /// Set once an image could not be mounted: this host cannot, so later
    /// starts write their pages without trying again.
    unsupported: Arc<std::sync::atomic::AtomicBool>,
}

#[derive(Default)]
struct Entry {
    /// `None`: this host cannot mount one.
    image: tokio::sync::OnceCell<Option<Arc<File>>>,
}

impl RamImages {
    /// The file that reads as guest RAM block `block` of a save whose own
    /// pages are the chain at `ram`, over its template's RAM file
    /// `template` (the template's pages with the save's over them), made
    /// now unless it is kept or being made; `None` where this host cannot
    /// make one, when making it failed (logged), or when none is kept and
    /// `make` is false.
    pub async fn get(
        &self,
        ram: PathBuf,
        template: PathBuf,
        block: &'static str,
        make: bool,
    ) -> Result<Option<Arc<File>>> {
        if self.unsupported.load(std::sync::atomic::Ordering::Relaxed) {
            return Ok(None);
        }
        let key = key_of(&ram);
        let entry = {
            let mut images = self.images.lock().expect("images lock");
            if !make && !images.contains_key(&key) {
                return Ok(None);
            }
            images.entry(key.clone()).or_default().clone()
        };
        let name = key.clone();
        let unsupported = self.unsupported.clone();
        let made = entry
            .image
            .get_or_try_init(|| async move {
                let started = std::time::Instant::now();
                let made = tokio::task::spawn_blocking(move || mount(&template, &ram, block))
                    .await
                    .map_err(|e| RuntimeError::Launch(format!("making a RAM image failed: {e}")))??;
                match made {
                    Ok(file) => {
                        tracing::debug!(ram = %name, "RAM image mounted in {} ms", started.elapsed().as_millis());
                        Ok::<_, RuntimeError>(Some(Arc::new(file)))
                    }
                    Err(why) => {
                        tracing::info!(
                            "starts from saves write their RAM pages: a RAM image cannot be \
                             mounted here ({why})"
                        );
                        unsupported.store(true, std::sync::atomic::Ordering::Relaxed);
                        Ok(None)
                    }
                }
            })
            .await
            .cloned();
        let made = made.unwrap_or_else(|e| {
            tracing::warn!(ram = %key, "no RAM image, writing its pages instead: {e}");
            None
        });
        self.linger(key, entry);
        Ok(made)
    }

    /// Keeps `entry` for [`LINGER`], then forgets it unless another start
    /// holds it.
    fn linger(&self, key: String, entry: Arc<Entry>) {
        let images = self.images.clone();
        tokio::spawn(async move {
            tokio::time::sleep(LINGER).await;
            let mut images = images.lock().expect("images lock");
            drop(entry);
            if images.get(&key).is_some_and(|e| Arc::strong_count(e) == 1) {
                images.remove(&key);
            }
        });
    }
}

/// The name an image is kept under: its save's RAM file's.
fn key_of(ram: &Path) -> String {
    ram.file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_default()
}

/// The image of block `block` of the RAM the chain at `ram` makes over the
/// template's RAM file `template`, mounted, and its file opened; `Err`
/// with the reason when this host will not mount it.
pub(crate) fn mount(
    template: &Path,
    ram: &Path,
    block: &str,
) -> Result<std::result::Result<File, String>> {
    let chain = ram_pages::Chain::open(ram)?;
    let tfile = File::open(template)
        .map_err(RuntimeError::io(format!("opening {}", template.display())))?;
    let len = tfile
        .metadata()
        .map_err(RuntimeError::io(format!("reading {}", template.display())))?
        .len();
    let chunks = chain.chunks(block, len, &ram_pages::data_pages(&tfile, len)?)?;
    let mut devices = vec![template.to_path_buf()];
    devices.extend(chain.paths());
    let lengths = devices
        .iter()
        .map(|d| std::fs::metadata(d).map(|m| m.len()))
        .collect::<std::io::Result<Vec<_>>>()
        .map_err(RuntimeError::io("reading a RAM file's length"))?;
    let image = match erofs::scratch_file() {
        Ok(image) => image,
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::EPERM | libc::ENOSYS | libc::ENODEV)
            ) =>
        {
            return Ok(Err(e.to_string()))
        }
        Err(e) => return Err(RuntimeError::io("making a file for a RAM image")(e)),
    };
    erofs::write_image(&image, FILE, len, &chunks, &lengths)
        .map_err(RuntimeError::io("writing a RAM image"))?;
    let mount = match erofs::mount(&image, &devices) {
        Ok(mount) => mount,
        Err(e) => {
            return match e.raw_os_error() {
                Some(libc::EPERM | libc::ENODEV | libc::ENOTBLK | libc::ENOSYS) => {
                    Ok(Err(e.to_string()))
                }
                _ => Err(RuntimeError::io("mounting a RAM image")(e)),
            }
        }
    };
    let file = erofs::open_in(&mount, FILE).map_err(RuntimeError::io("opening a RAM image"))?;
    Ok(Ok(file))
}

/// A descriptor of `file` for a QEMU to inherit.
pub fn descriptor(file: &File) -> Result<OwnedFd> {
    file.try_clone()
        .map(OwnedFd::from)
        .map_err(RuntimeError::io("passing a RAM image"))
}
