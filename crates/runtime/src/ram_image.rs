//! A save's guest RAM made whole once, for every VM started from it.
//!
//! A save holds only the pages that differ from its template (see
//! `ram_pages`). Writing those into each new VM's copy-on-write mapping of
//! the template costs a page fault and two copies per page, per VM: three
//! copies of a fork started side by side wait on each other for the CPU.
//! Instead the template's pages with the save's over them are written once
//! into a sealed memfd ([`crate::ram_pages::build_image`]), which each VM's
//! QEMU maps privately as it maps a template's RAM file: its start is a
//! template restore's, the image's pages are shared until a guest writes
//! one, and nothing is left on disk.
//!
//! The image lives while a QEMU maps it (each is handed its own descriptor
//! at start) and, here, for [`LINGER`] after the last start that asked for
//! it, so VMs started one after another from the same save share one too.

use crate::saved::SavedVm;
use crate::{ram_pages, Result, RuntimeError};
use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How long an image is kept for the next start from the same save.
pub const LINGER: Duration = Duration::from_secs(30);

/// The images being built or kept, by save RAM file name.
#[derive(Default, Clone)]
pub struct RamImages {
    images: Arc<Mutex<HashMap<String, Arc<Entry>>>>,
}

#[derive(Default)]
struct Entry {
    image: tokio::sync::OnceCell<Arc<OwnedFd>>,
}

impl RamImages {
    /// The image of `saved`'s guest RAM block `block`, built now unless it
    /// is kept or being built.
    pub async fn get(&self, saved: &SavedVm, block: &'static str) -> Result<Arc<OwnedFd>> {
        let ram = saved.ram().ok_or_else(|| {
            RuntimeError::Launch(format!("the save {} holds no RAM of its own", saved.name))
        })?;
        let key = ram
            .file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_default();
        let entry = {
            let mut images = self.images.lock().expect("images lock");
            images.entry(key.clone()).or_default().clone()
        };
        let template = saved.template.mem();
        let name = key.clone();
        let image = entry
            .image
            .get_or_try_init(|| async move {
                let started = std::time::Instant::now();
                let image = tokio::task::spawn_blocking(move || {
                    ram_pages::build_image(&template, &ram_pages::Chain::open(&ram)?, block)
                })
                .await
                .map_err(|e| RuntimeError::Launch(format!("building a RAM image failed: {e}")))??;
                tracing::debug!(ram = %name, "RAM image built in {} ms", started.elapsed().as_millis());
                Ok::<_, RuntimeError>(Arc::new(image))
            })
            .await
            .cloned();
        self.linger(key, entry);
        image
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
