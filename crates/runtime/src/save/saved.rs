//! A running VM saved whole (disk, memory, devices) under a name, and VMs
//! started from the save.
//!
//! Saving pauses the guest only while its state is captured:
//! - **Disk.** The overlay the VM writes to is frozen: hard-linked into
//!   `<data_dir>/layers/` under a random name, and the VM goes on writing to
//!   a new overlay on top of it (QMP `blockdev-snapshot-sync`,
//!   `mode=existing`, on an overlay made first whose header names the layer
//!   by absolute path). The layer belongs to neither the save nor the VM:
//!   the VM's disk, every VM started from the save and every later save
//!   stand on it, so it goes only when nothing names it (see `layers`).
//! - **Memory and devices.** QEMU writes its devices alone
//!   (`xen-save-devices-state`); the guest RAM pages that are no longer the
//!   template's (the VM's memory is a private copy-on-write mapping of the
//!   template's RAM file) are copied out of QEMU into the save's RAM file
//!   (see [`crate::save::ram_pages`]).
//!
//! Saves live in `<data_dir>/saves/<name>/` (`saved.json` and the state).
//! One is written in `.<name>.<random>.tmp`, locked (`flock`) while it is,
//! and renamed into place only when complete, so [`VmManager::list_saved`]
//! never shows half a save and a save that fails or dies leaves only a
//! directory that the save itself or the next manager's start removes. A
//! failure after the VM switched to its new overlay leaves the VM running on
//! it: the layer below stays, named by the VM's chain.
//!
//! A VM started from the save maps the same template RAM file privately,
//! receives the saved pages before its guest runs, loads the devices as an
//! incoming migration and runs on a new
//! overlay over the save's layer, then takes its own identity as any
//! restored VM does. Its agent still holds the saved VM's session; the new
//! host's `Hello` ends it. The template is kept as long as a save names it,
//! even once outdated (see [`crate::save::template::remove_others`]).
//!
//! Other VMs' QEMUs (each its own uid) must read layers and states, so those
//! are root's and `0644`; the `layers` and `saves` directories (and each
//! save's) are `0711`, walkable but not listable, and the files' names are
//! 128 random bits: a QEMU reaches only the files whose names it was given.

use crate::save::layers;
use crate::save::ram_pages;
use crate::save::template::{self, Template};
use crate::vm::process::Priority;
use crate::vm::qmp::Qmp;
use crate::vm::{create_overlay, validate_id, write_record, CreateVm, Start, Vm, VmPaths};
use crate::{vm::console, Result, RuntimeError, VmManager};
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// The RAM block of a VM's memory backend (`-object memory-backend-*,id=ram`).
pub(crate) const RAM_BLOCK: &str = "ram";
/// A save's record, in its directory.
const RECORD: &str = "saved.json";

/// What becomes of a VM once it is saved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterSave {
    /// It runs on.
    Run,
    /// It stays stopped (it is to be destroyed: a pause).
    Stay,
}

/// What `saved.json` records of a save.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SavedRecord {
    /// The VM it was saved from.
    pub from: String,
    pub size: String,
    /// The template whose RAM file the saved memory is a difference to.
    pub template: String,
    /// The frozen disk: a file name in `<data_dir>/layers`.
    pub layer: String,
    /// The device state: a file name in the save's directory.
    pub state: String,
    /// The guest RAM that differs from the template's: a file name in
    /// `<data_dir>/layers`, which may stand on other saves' (see
    /// [`crate::save::ram_pages`]). Saves made before it
    /// (QEMU's `mapped-ram` state, RAM and devices in one) have none and
    /// are no longer started from.
    #[serde(default)]
    pub ram: Option<String>,
    /// Guest pages that differ from the template's (held by its RAM file
    /// or the files below it).
    pub changed_pages: u64,
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: time::OffsetDateTime,
    /// The machine-id of the VM it was saved from, which that VM keeps if
    /// it is restored from the save (a VM of another id gets its own).
    #[serde(default)]
    pub machine_id: Option<String>,
    /// The volumes its saved memory has mounted (a pause's save keeps
    /// them; a snapshot is taken with them unmounted, and has none): a VM
    /// started from it has them attached before its guest runs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<crate::vm::volumes::VmVolume>,
}

/// A save on disk, ready to start VMs from.
#[derive(Debug, Clone)]
pub struct SavedVm {
    pub name: String,
    /// `<data_dir>/saves/<name>`.
    pub dir: PathBuf,
    pub record: SavedRecord,
    /// The template it is based on.
    pub template: Template,
    layers_dir: PathBuf,
}

impl SavedVm {
    /// The frozen disk layer (the backing file of the VMs started from it).
    pub fn disk(&self) -> PathBuf {
        self.layers_dir.join(&self.record.layer)
    }
    /// The saved device state.
    pub fn state(&self) -> PathBuf {
        self.dir.join(&self.record.state)
    }
    /// The saved guest RAM (what differs from the template's), in the
    /// layers directory: the files below it are other saves'.
    pub fn ram(&self) -> Option<PathBuf> {
        self.record.ram.as_ref().map(|r| self.layers_dir.join(r))
    }
    /// Bytes the save alone takes on the host's disk: its state, its RAM
    /// and its frozen layer (the layers and template below it are others').
    pub fn bytes(&self) -> u64 {
        use std::os::unix::fs::MetadataExt;
        [Some(self.disk()), Some(self.state()), self.ram()]
            .iter()
            .flatten()
            .filter_map(|f| std::fs::metadata(f).ok())
            .map(|m| m.blocks() * 512)
            .sum()
    }
}

impl VmManager {
    /// Where saves live, `<data_dir>/saves` (absolute).
    pub fn saves_dir(&self) -> PathBuf {
        absolute(&self.config().data_dir.join("saves"))
    }

    /// Where frozen disk layers live, `<data_dir>/layers` (absolute: the
    /// overlays above a layer name it by this path).
    pub fn layers_dir(&self) -> PathBuf {
        absolute(&self.config().data_dir.join("layers"))
    }

    /// The lock that keeps [`VmManager::gc_layers`] from a layer not named
    /// yet (see `layers`).
    pub(crate) fn layers_lock(&self) -> PathBuf {
        self.config().data_dir.join(".layers.lock")
    }

    /// At the manager's start: the directories, the removal of saves that
    /// died half written, and a collection.
    pub(crate) fn prepare_saves(&self) -> Result<()> {
        use std::os::unix::fs::PermissionsExt;
        for dir in [self.saves_dir(), self.layers_dir()] {
            std::fs::create_dir_all(&dir)
                .map_err(RuntimeError::io(format!("creating {}", dir.display())))?;
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o711))
                .map_err(RuntimeError::io(format!("chmod {}", dir.display())))?;
        }
        self.sweep_unfinished_saves()?;
        self.gc_layers();
        Ok(())
    }

    /// Saves VM `id` whole under `name` (a VM id's alphabet; no save of
    /// that name may exist). The VM is paused while its state is captured
    /// and then runs on, whether the save worked or not, unless `after` is
    /// [`AfterSave::Stay`] and the save worked.
    pub async fn save(&self, id: &str, name: &str, after: AfterSave) -> Result<SavedVm> {
        self.qemu()
            .saves_running_vms()
            .map_err(RuntimeError::Launch)?;
        validate_id(id)?;
        if validate_id(name).is_err() {
            return Err(RuntimeError::Launch(format!(
                "{name:?} cannot name a save: 1 to 64 letters, digits, '_' and '-'"
            )));
        }
        let mut record = self.record(id)?;
        let template = record
            .template
            .as_deref()
            .and_then(|key| self.template_by_key(&record.size, key))
            .ok_or_else(|| {
                RuntimeError::Launch(format!(
                    "VM {id} was not restored from a snapshot template this host still has, \
                     so its memory has no base to save against"
                ))
            })?;
        let dir = self.saves_dir().join(name);
        if dir.exists() {
            return Err(exists(name));
        }
        let unfinished = Unfinished::create(self, name).await?;
        let mut saved = SavedVm {
            name: name.to_string(),
            dir,
            record: SavedRecord {
                from: id.to_string(),
                size: record.size.clone(),
                template: template.key.clone(),
                layer: layers::new_name(".qcow2"),
                state: layers::new_name(".state"),
                ram: Some(layers::new_name(".ram")),
                changed_pages: 0,
                created_at: time::OffsetDateTime::now_utc(),
                machine_id: record.machine_id.clone(),
                volumes: match after {
                    AfterSave::Stay => record.volumes.clone(),
                    AfterSave::Run => Vec::new(),
                },
            },
            template,
            layers_dir: self.layers_dir(),
        };
        // Recorded before the layer exists, so the collection and a
        // template's rebuild see what the save in progress needs.
        write_saved_record(&unfinished.path, &saved.record)?;
        if !saved.template.mem().is_file() {
            return Err(RuntimeError::Launch(format!(
                "the template {} of VM {id} was removed",
                saved.template.key
            )));
        }
        let state = unfinished.path.join(&saved.record.state);
        let ram = saved.ram().expect("named above");
        let paths = self.paths(id);
        let started = Instant::now();
        let mut qmp = Qmp::connect(&paths.qmp_socket()).await?;
        qmp.execute("stop", json!({})).await?;
        let captured = self
            .capture(&mut qmp, &paths, &mut record, &saved.disk(), &state, &ram)
            .await;
        let finished = captured.and_then(|kept| {
            saved.record.changed_pages = kept.saved_pages();
            write_saved_record(&unfinished.path, &saved.record)?;
            unfinished.finish(&saved.dir, name)
        });
        if finished.is_err() {
            // A failed save leaves nothing of itself behind (the rest of
            // `unfinished` went when it was dropped).
            let _ = std::fs::remove_file(&ram);
        }
        // The guest runs again whatever happened, unless it is to stay
        // stopped after a save that worked.
        let resumed = match (&finished, after) {
            (Ok(()), AfterSave::Stay) => Ok(()),
            _ => qmp.execute("cont", json!({})).await.map(drop),
        };
        let paused = started.elapsed();
        finished?;
        resumed?;
        // The VM's memory is the save's now: its next save stands on it.
        record.ram_base = saved.record.ram.clone();
        write_record(&paths, &record)?;
        tracing::debug!(
            id,
            save = name,
            "saved in {} ms (paused {} ms), {} pages changed",
            started.elapsed().as_millis(),
            paused.as_millis(),
            saved.record.changed_pages
        );
        Ok(saved)
    }

    /// The stopped VM's disk frozen into `layer`, its devices written to
    /// `state` and its RAM to `ram`. When it fails before the VM switched
    /// to its new overlay, the layer and that overlay are gone again;
    /// after, the VM runs on the new overlay and the layer stays below it.
    async fn capture(
        &self,
        qmp: &mut Qmp,
        paths: &VmPaths,
        record: &mut crate::VmRecord,
        layer: &Path,
        state: &Path,
        ram: &Path,
    ) -> Result<ram_pages::Captured> {
        let active = paths.active_disk(record);
        let n = record
            .disk
            .as_deref()
            .and_then(|d| {
                d.strip_prefix("disk-")?
                    .strip_suffix(".qcow2")?
                    .parse::<u64>()
                    .ok()
            })
            .unwrap_or(0)
            + 1;
        let next_name = format!("disk-{n}.qcow2");
        let next = paths.dir.join(&next_name);
        let (out, parent) = {
            // Named by nothing until the overlay over it exists.
            let _lock = layers::lock(&self.layers_lock()).await?;
            std::fs::hard_link(&active, layer)
                .map_err(RuntimeError::io(format!("linking {}", active.display())))?;
            if let Err(e) = create_overlay(layer, &next, record.resources.disk_gb).await {
                let _ = std::fs::remove_file(layer);
                return Err(e);
            }
            // The RAM file names its parent before the lock goes, so the
            // collection keeps the parent from now on.
            let parent = self.ram_parent(record);
            let out = std::fs::File::create_new(ram)
                .map_err(RuntimeError::io("creating the saved RAM file"))
                .and_then(|out| ram_pages::begin(&out, parent.as_ref()).map(|()| out));
            match out {
                Ok(out) => (out, parent),
                Err(e) => {
                    let _ = std::fs::remove_file(ram);
                    let _ = std::fs::remove_file(&next);
                    let _ = std::fs::remove_file(layer);
                    return Err(e);
                }
            }
        };
        let captured = self
            .capture_in(
                qmp, paths, record, layer, &next, &next_name, state, out, parent,
            )
            .await;
        if captured.is_err() {
            let _ = std::fs::remove_file(ram);
        } else {
            // Read by the runtime alone (it writes the pages into the VMs
            // it starts): no QEMU may read another VM's memory.
            restrict_to(ram, None)?;
        }
        captured
    }

    /// The chain a new save of VM `record` stands on: the RAM file its
    /// memory was last made equal to, unless it is gone, unreadable or its
    /// chain is as long as chains get (then the save holds all its pages).
    fn ram_parent(&self, record: &crate::VmRecord) -> Option<ram_pages::Chain> {
        let name = record.ram_base.as_deref()?;
        match ram_pages::Chain::open(&self.layers_dir().join(name)) {
            Ok(chain) if chain.depth() < ram_pages::MAX_CHAIN => Some(chain),
            Ok(_) => None,
            Err(e) => {
                tracing::debug!(id = %record.id, "saving without a parent: {e}");
                None
            }
        }
    }

    /// [`Self::capture`] once the layer and the RAM file exist: the switch
    /// to the new overlay, the devices and the RAM.
    #[allow(clippy::too_many_arguments)]
    async fn capture_in(
        &self,
        qmp: &mut Qmp,
        paths: &VmPaths,
        record: &mut crate::VmRecord,
        layer: &Path,
        next: &Path,
        next_name: &str,
        state: &Path,
        out: std::fs::File,
        parent: Option<ram_pages::Chain>,
    ) -> Result<ram_pages::Captured> {
        let active = paths.active_disk(record);
        let switch = async {
            restrict_to(next, record.qemu_uid)?;
            // Other VMs' QEMUs read the frozen layer as their backing file.
            share_read_only(layer)?;
            qmp.execute(
                "blockdev-snapshot-sync",
                json!({"device": "root", "snapshot-file": next.display().to_string(),
                       "format": "qcow2", "mode": "existing"}),
            )
            .await
        };
        if let Err(e) = switch.await {
            // The VM still writes to `active`: it is no layer.
            let _ = std::fs::remove_file(next);
            let _ = std::fs::remove_file(layer);
            let _ = restrict_to(&active, record.qemu_uid);
            return Err(e);
        }
        record.disk = Some(next_name.to_string());
        write_record(paths, record)?;
        let frozen = Instant::now();
        // QEMU (its own uid) writes the state into a file made for it. The
        // stream has no configuration section, so the QEMU that loads it is
        // told to expect none (see `vm::qemu_args`).
        std::fs::File::create(state).map_err(RuntimeError::io("creating the state file"))?;
        restrict_to(state, record.qemu_uid)?;
        qmp.execute(
            "xen-save-devices-state",
            json!({"filename": state.display().to_string(), "live": false}),
        )
        .await?;
        share_read_only(state)?;
        let devices = frozen.elapsed();
        let blocks = ram_pages::query_blocks(qmp).await?;
        let pid = record.qemu_pid;
        let mapped = record
            .ram_mapped
            .as_ref()
            .map(|r| self.layers_dir().join(r));
        let captured = tokio::task::spawn_blocking(move || {
            let mapped = mapped.as_deref().map(ram_pages::Chain::open).transpose()?;
            ram_pages::capture(
                pid,
                &blocks,
                RAM_BLOCK,
                &out,
                parent.as_ref(),
                mapped.as_ref(),
            )
        })
        .await
        .map_err(|e| RuntimeError::Launch(format!("copying the VM's RAM failed: {e}")))??;
        tracing::debug!(
            "devices written in {} ms, then {} RAM pages ({} zero, {} the parent's) in {} ms",
            devices.as_millis(),
            captured.saved_pages(),
            captured.zero_pages,
            captured.inherited_pages,
            (frozen.elapsed() - devices).as_millis(),
        );
        Ok(captured)
    }

    /// Starts a VM from a save, with an identity of its own.
    pub async fn create_from_saved(&self, req: CreateVm, saved: &SavedVm) -> Result<Vm> {
        validate_id(&req.id)?;
        if req.size != saved.record.size {
            return Err(RuntimeError::Launch(format!(
                "a VM from a save of size {} is of that size, not {}",
                saved.record.size, req.size
            )));
        }
        // The resources the template was made with, which the saved state
        // fits, even if the size table changed since.
        let size = saved.template.record.inputs.resources;
        self.start(&req, size, Start::Saved(saved), Priority::Normal)
            .await
    }

    /// The save named `name`, if it is one this host can start VMs from.
    pub fn saved(&self, name: &str) -> Result<SavedVm> {
        validate_id(name).map_err(|_| RuntimeError::NotFound(name.to_string()))?;
        let dir = self.saves_dir().join(name);
        let bytes = std::fs::read(dir.join(RECORD)).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => RuntimeError::NotFound(name.to_string()),
            _ => RuntimeError::io(format!("reading {}/{RECORD}", dir.display()))(e),
        })?;
        let record: SavedRecord = serde_json::from_slice(&bytes)
            .map_err(|e| RuntimeError::Launch(format!("corrupt {RECORD} of save {name}: {e}")))?;
        let template = self
            .template_by_key(&record.size, &record.template)
            .ok_or_else(|| {
                RuntimeError::Launch(format!(
                    "the snapshot template the save {name} is based on is gone"
                ))
            })?;
        let saved = SavedVm {
            name: name.to_string(),
            dir,
            record,
            template,
            layers_dir: self.layers_dir(),
        };
        let Some(ram) = saved.ram() else {
            return Err(RuntimeError::Launch(format!(
                "the save {name} was made by an earlier Sandpit, in a form this one does not \
                 start VMs from; delete it"
            )));
        };
        if !saved.disk().is_file() || !saved.state().is_file() || !ram.is_file() {
            return Err(RuntimeError::Launch(format!(
                "the save {name} lost its disk layer, its state or its RAM"
            )));
        }
        Ok(saved)
    }

    /// The names of the complete saves (sorted).
    pub fn list_saved(&self) -> Vec<String> {
        let mut out: Vec<String> = std::fs::read_dir(self.saves_dir())
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().into_string().ok())
            .filter(|n| validate_id(n).is_ok())
            .filter(|n| self.saves_dir().join(n).join(RECORD).is_file())
            .collect();
        out.sort();
        out
    }

    /// Deletes the save `name` (a save already gone is deleted), then the
    /// layers and templates nothing needs any more. VMs started from it run
    /// on: their disks name the layers they stand on.
    pub async fn delete_saved(&self, name: &str) -> Result<()> {
        validate_id(name).map_err(|_| RuntimeError::NotFound(name.to_string()))?;
        let saves = self.saves_dir();
        // Out of sight at once; the sweep at a start finishes a removal
        // that died.
        let gone = saves.join(format!(".{name}.{:08x}.tmp", rand::random::<u32>()));
        match std::fs::rename(saves.join(name), &gone) {
            Ok(()) => {
                std::fs::remove_dir_all(&gone)
                    .map_err(RuntimeError::io(format!("removing {}", gone.display())))?;
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(RuntimeError::io(format!("removing the save {name}"))(e));
            }
        }
        self.gc_layers();
        Ok(())
    }

    /// Removes the disk layers that nothing names (no VM's disk and no
    /// save, finished or in progress, reaches them), and the outdated
    /// templates kept for saves that are gone. Runs after a destroy, after
    /// a save's deletion and at the manager's start.
    pub fn gc_layers(&self) {
        let _lock = match layers::lock_blocking(&self.layers_lock()) {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!("no collection of disk layers: {e}");
                return;
            }
        };
        let Some(records) = self.save_records() else {
            tracing::warn!("a save's record is unreadable: no disk layer is collected");
            return;
        };
        let layers_dir = self.layers_dir();
        let mut roots = layers::qcow2_files_under(&self.config().vms_dir());
        roots.extend(records.iter().map(|r| layers_dir.join(&r.layer)));
        // Saved RAM: each save's, and each VM's base (its next save
        // stands on it).
        roots.extend(
            records
                .iter()
                .filter_map(|r| Some(layers_dir.join(r.ram.as_ref()?))),
        );
        roots.extend(self.list().iter().flat_map(|r| {
            [&r.ram_base, &r.ram_mapped]
                .into_iter()
                .flatten()
                .map(|name| layers_dir.join(name))
        }));
        let removed = layers::collect(&layers_dir, &roots);
        if !removed.is_empty() {
            tracing::debug!(layers = ?removed, "removed disk layers and RAM files nothing names");
        }
        template::remove_outdated(
            &self.templates_dir(),
            &self.current_template_dirs(),
            &self.templates_in_use(&records),
        );
        self.collect_images();
    }

    /// Remove the guest images, root file systems and kernels nothing here
    /// stands on any more (see [`crate::image::collect_outdated`]), when the
    /// images directory is this data directory's own (inside it): one
    /// elsewhere may serve other data directories, whose VMs this manager
    /// cannot see.
    fn collect_images(&self) {
        let Some(images_dir) = self.image().dir.parent() else {
            return;
        };
        let canonical = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
        if !canonical(images_dir).starts_with(canonical(&self.config().data_dir)) {
            return;
        }
        let mut in_use = crate::image::InUse::default();
        in_use.images.insert(self.image().id.clone());
        in_use
            .images
            .extend(self.list().into_iter().map(|vm| vm.image_id));
        let templates_dir = self.templates_dir();
        if let Ok(rd) = std::fs::read_dir(&templates_dir) {
            for e in rd.flatten() {
                if let Some(t) = template::load_any(&e.path()) {
                    in_use.images.insert(t.record.inputs.image_id);
                }
            }
        }
        in_use.disks = layers::qcow2_files_under(&self.config().vms_dir());
        in_use
            .disks
            .extend(layers::qcow2_files_under(&templates_dir));
        if let Ok(rd) = std::fs::read_dir(self.layers_dir()) {
            in_use.disks.extend(rd.flatten().map(|e| e.path()));
        }
        if let Err(e) = crate::image::collect_outdated(images_dir, &in_use) {
            tracing::warn!(images = %images_dir.display(), "collecting outdated guest images: {e}");
        }
    }

    /// The directory names of the templates something stands on: VMs
    /// restored from them (or started from saves based on them) and saves,
    /// finished or in progress (`records`).
    pub(crate) fn templates_in_use(&self, records: &[SavedRecord]) -> HashSet<String> {
        let vms = self.list().into_iter().filter_map(|vm| {
            let key = vm.template?;
            Some(template::dir_name(&vm.size, &key))
        });
        saved_on(records).into_iter().chain(vms).collect()
    }

    /// [`Self::templates_in_use`] with the saves read now; `None` when a
    /// save's record cannot be read (nothing may then be removed).
    pub(crate) fn templates_in_use_now(&self) -> Option<HashSet<String>> {
        Some(self.templates_in_use(&self.save_records()?))
    }

    /// The records of every save, finished or being written; `None` when
    /// one cannot be read (nothing may then be removed on its account).
    fn save_records(&self) -> Option<Vec<SavedRecord>> {
        let mut out = Vec::new();
        let Ok(rd) = std::fs::read_dir(self.saves_dir()) else {
            return Some(out);
        };
        for e in rd.flatten() {
            let path = e.path().join(RECORD);
            match std::fs::read(&path) {
                Ok(bytes) => out.push(serde_json::from_slice(&bytes).ok()?),
                // Being written (no layer yet), or being removed.
                Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
                Err(_) if !e.path().is_dir() => {}
                Err(_) => return None,
            }
        }
        Some(out)
    }

    /// Remove what saves that died while written, or removals that died,
    /// left (`.*.tmp` no live save holds locked).
    fn sweep_unfinished_saves(&self) -> Result<()> {
        // Under the lock a save takes to make and lock its directory.
        let _lock = layers::lock_blocking(&self.layers_lock())?;
        let Ok(rd) = std::fs::read_dir(self.saves_dir()) else {
            return Ok(());
        };
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            if !(name.starts_with('.') && name.ends_with(".tmp")) {
                continue;
            }
            let Ok(dir) = std::fs::File::open(e.path()) else {
                continue;
            };
            if layers::flock(&dir, libc::LOCK_EX | libc::LOCK_NB).is_ok() {
                tracing::info!(save = %name, "removing a save that was never finished");
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
        Ok(())
    }

    /// The template of `size` with `key`: the current one, or one outdated
    /// since that saves keep.
    pub(crate) fn template_by_key(&self, size: &str, key: &str) -> Option<Template> {
        if let Some(t) = self.template(size).filter(|t| t.key == key) {
            return Some(t);
        }
        if !self.snapshots_supported() {
            return None;
        }
        template::load_any(&self.templates_dir().join(template::dir_name(size, key)))
            .filter(|t| t.key == key && t.size == size)
    }
}

fn saved_on(records: &[SavedRecord]) -> HashSet<String> {
    records
        .iter()
        .map(|r| template::dir_name(&r.size, &r.template))
        .collect()
}

fn exists(name: &str) -> RuntimeError {
    RuntimeError::io(format!("saving as {name}"))(std::io::Error::new(
        std::io::ErrorKind::AlreadyExists,
        format!("a save named {name} exists"),
    ))
}

fn absolute(path: &Path) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf())
}

/// `saved.json`, whole or not at all, readable by root alone.
pub(crate) fn write_saved_record(dir: &Path, record: &SavedRecord) -> Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = dir.join(format!("{RECORD}.tmp"));
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(&serde_json::to_vec_pretty(record).expect("json"))?;
        std::fs::rename(&tmp, dir.join(RECORD))
    };
    write().map_err(RuntimeError::io(format!("writing {RECORD}")))
}

/// A save being written: its directory, locked while it lives, removed
/// with all it holds unless [`Unfinished::finish`] renamed it into place.
pub(crate) struct Unfinished {
    pub(crate) path: PathBuf,
    _lock: std::fs::File,
    finished: bool,
}

impl Unfinished {
    pub(crate) async fn create(m: &VmManager, name: &str) -> Result<Unfinished> {
        use std::os::unix::fs::PermissionsExt;
        let path = m
            .saves_dir()
            .join(format!(".{name}.{:08x}.tmp", rand::random::<u32>()));
        // Made and locked under the lock the sweep of dead saves takes, so
        // it never takes this one for dead.
        let _sweep = layers::lock(&m.layers_lock()).await?;
        std::fs::create_dir(&path)
            .map_err(RuntimeError::io(format!("creating {}", path.display())))?;
        let lock = std::fs::File::open(&path)
            .and_then(|f| layers::flock(&f, libc::LOCK_EX).map(|_| f))
            .and_then(|f| {
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o711))?;
                Ok(f)
            });
        match lock {
            Ok(f) => Ok(Unfinished {
                path,
                _lock: f,
                finished: false,
            }),
            Err(e) => {
                let _ = std::fs::remove_dir_all(&path);
                Err(RuntimeError::io(format!("locking {}", path.display()))(e))
            }
        }
    }

    /// Renamed into place, unless a save of that name appeared meanwhile.
    pub(crate) fn finish(mut self, dir: &Path, name: &str) -> Result<()> {
        use std::os::unix::ffi::OsStrExt;
        let c = |p: &Path| std::ffi::CString::new(p.as_os_str().as_bytes()).expect("no NUL");
        let (from, to) = (c(&self.path), c(dir));
        // SAFETY: renameat2(2) of two NUL-terminated paths.
        let rc = unsafe {
            libc::renameat2(
                libc::AT_FDCWD,
                from.as_ptr(),
                libc::AT_FDCWD,
                to.as_ptr(),
                libc::RENAME_NOREPLACE,
            )
        };
        if rc != 0 {
            let e = std::io::Error::last_os_error();
            return Err(match e.kind() {
                std::io::ErrorKind::AlreadyExists => exists(name),
                _ => RuntimeError::io(format!("renaming {} into place", self.path.display()))(e),
            });
        }
        self.finished = true;
        Ok(())
    }
}

impl Drop for Unfinished {
    fn drop(&mut self) {
        if !self.finished {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// Owned by the VM's uid alone (when it has one).
fn restrict_to(path: &Path, uid: Option<u32>) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    if let Some(uid) = uid {
        std::os::unix::fs::chown(path, Some(uid), Some(uid))
            .map_err(RuntimeError::io(format!("chown {}", path.display())))?;
    }
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .map_err(RuntimeError::io(format!("chmod {}", path.display())))
}

/// Root's, readable by every VM's QEMU and writable by none.
fn share_read_only(path: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    if nix::unistd::geteuid().is_root() {
        std::os::unix::fs::chown(path, Some(0), Some(0))
            .map_err(RuntimeError::io(format!("chown {}", path.display())))?;
    }
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o644))
        .map_err(RuntimeError::io(format!("chmod {}", path.display())))
}

/// Loads a save into a QEMU waiting with `-incoming defer`: its RAM pages
/// first, while no guest code runs, then its devices as an incoming
/// migration; and starts the guest.
pub(crate) async fn load_saved_state(
    paths: &VmPaths,
    saved: &SavedVm,
    qemu_pid: u32,
    marker: &str,
    mapped: bool,
    volumes: Vec<crate::vm::volumes::Opened>,
) -> Result<()> {
    let started = Instant::now();
    crate::vm::wait_for_socket(paths, &paths.qmp_socket(), "QMP", qemu_pid, marker).await?;
    let mut qmp = Qmp::connect(&paths.qmp_socket()).await?;
    let blocks = ram_pages::query_blocks(&mut qmp).await?;
    let listening = started.elapsed();
    let ram = saved.ram().expect("checked by `saved`");
    let pages = tokio::task::spawn_blocking(move || {
        ram_pages::load(
            qemu_pid,
            &blocks,
            &ram_pages::Chain::open(&ram)?,
            mapped.then_some(RAM_BLOCK),
        )
    })
    .await
    .map_err(|e| RuntimeError::Launch(format!("loading the saved RAM failed: {e}")))??;
    let loaded = started.elapsed();
    qmp.execute(
        "migrate-incoming",
        json!({"uri": format!("file:{}", saved.state().display())}),
    )
    .await?;
    qmp.wait_migration("loading the saved VM")
        .await
        .map_err(|e| {
            RuntimeError::Disconnected(format!(
                "{e}: {}",
                console::tail_lines(&paths.qemu_log(), 3)
            ))
        })?;
    // Its memory has them mounted: attached before the guest runs on.
    for volume in volumes {
        crate::vm::volumes::attach(&mut qmp, volume).await?;
    }
    qmp.execute("cont", json!({})).await?;
    tracing::debug!(
        save = %saved.name,
        "QEMU listening after {} ms, {pages} RAM pages written in {} ms, devices loaded in {} ms",
        listening.as_millis(),
        (loaded - listening).as_millis(),
        (started.elapsed() - loaded).as_millis()
    );
    Ok(())
}
