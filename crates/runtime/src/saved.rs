//! A running VM saved whole (disk, memory, devices) and VMs started from it.
//!
//! Saving pauses the guest only while its state is captured:
//! - **Disk.** The overlay the VM writes to is frozen: hard-linked into the
//!   save's directory as `disk.qcow2`, and the VM goes on writing to a new
//!   overlay on top of it (QMP `blockdev-snapshot-sync`, `mode=existing`,
//!   on an overlay made first whose backing file names the save's copy, so
//!   the chain outlives the VM's directory).
//! - **Memory and devices.** QEMU's `mapped-ram` migration to `state`, then
//!   [`crate::ram_diff::keep_differences`] against the template's RAM file
//!   the VM's memory is a private copy of: only the pages the guest changed
//!   stay on disk.
//!
//! A VM started from the save maps the same template RAM file privately,
//! loads `state` (only the changed pages are read) and runs on a new
//! overlay over the save's disk, then takes its own identity as any
//! restored VM does. Its agent still holds the saved VM's session; the new
//! host's `Hello` ends it.

use crate::process::Priority;
use crate::qmp::Qmp;
use crate::template::Template;
use crate::vm::{create_overlay, validate_id, write_record, CreateVm, Start, Vm, VmPaths};
use crate::{console, Result, RuntimeError, VmManager};
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// The RAM block of a VM's memory backend (`-object memory-backend-*,id=ram`).
const RAM_BLOCK: &str = "ram";

/// What `saved.json` records of a save.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SavedRecord {
    /// The VM it was saved from.
    pub from: String,
    pub size: String,
    /// The template whose RAM file the saved memory is a difference to.
    pub template: String,
    /// Guest pages kept (those that differ from the template's).
    pub changed_pages: u64,
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: time::OffsetDateTime,
}

/// A save on disk, ready to start VMs from.
#[derive(Debug, Clone)]
pub struct SavedVm {
    pub dir: PathBuf,
    pub record: SavedRecord,
    /// The template it is based on.
    pub template: Template,
}

impl SavedVm {
    /// The frozen disk (the backing file of the VMs started from it).
    pub fn disk(&self) -> PathBuf {
        self.dir.join("disk.qcow2")
    }
    /// The saved memory and device state.
    pub fn state(&self) -> PathBuf {
        self.dir.join("state")
    }
    /// Bytes the save takes on the host's disk.
    pub fn bytes(&self) -> u64 {
        use std::os::unix::fs::MetadataExt;
        ["disk.qcow2", "state", "saved.json"]
            .iter()
            .filter_map(|f| std::fs::metadata(self.dir.join(f)).ok())
            .map(|m| m.blocks() * 512)
            .sum()
    }
}

impl VmManager {
    /// Saves VM `id` whole into `dir` (created; must not exist). The VM
    /// is paused while its state is captured and then runs on.
    pub async fn save(&self, id: &str, dir: &Path) -> Result<SavedVm> {
        validate_id(id)?;
        let mut record = self.record(id)?;
        let template = record
            .template
            .as_ref()
            .and_then(|_| self.template(&record.size))
            .filter(|t| Some(&t.key) == record.template.as_ref())
            .ok_or_else(|| {
                RuntimeError::Launch(format!(
                    "VM {id} was not restored from this host's current template of size {}, \
                     so its memory has no base to save against",
                    record.size
                ))
            })?;
        let paths = self.paths(id);
        std::fs::create_dir(dir)
            .map_err(RuntimeError::io(format!("creating {}", dir.display())))?;
        let saved = SavedVm {
            dir: dir.to_path_buf(),
            record: SavedRecord {
                from: id.to_string(),
                size: record.size.clone(),
                template: template.key.clone(),
                changed_pages: 0,
                created_at: time::OffsetDateTime::now_utc(),
            },
            template,
        };
        let started = Instant::now();
        let mut qmp = Qmp::connect(&paths.qmp_socket()).await?;
        qmp.execute("stop", json!({})).await?;
        let captured = self.capture(&mut qmp, &paths, &mut record, &saved).await;
        // The guest runs again whatever happened; a failed save leaves
        // nothing of itself behind.
        let resumed = qmp.execute("cont", json!({})).await;
        let paused = started.elapsed();
        if let Err(e) = captured.and(resumed.map(drop)) {
            let _ = std::fs::remove_dir_all(dir);
            return Err(e);
        }
        let state = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(saved.state())
            .map_err(RuntimeError::io("opening the saved state"))?;
        let base = std::fs::File::open(saved.template.mem())
            .map_err(RuntimeError::io("opening the template's RAM"))?;
        let kept = tokio::task::spawn_blocking(move || {
            crate::ram_diff::keep_differences(&state, RAM_BLOCK, Some(&base))
        })
        .await
        .map_err(|e| RuntimeError::Launch(format!("the RAM comparison failed: {e}")))??;
        let mut saved = saved;
        saved.record.changed_pages = kept.data_pages + kept.zeroed_pages;
        let json = serde_json::to_vec_pretty(&saved.record).expect("json");
        std::fs::write(dir.join("saved.json"), json)
            .map_err(RuntimeError::io("writing saved.json"))?;
        tracing::debug!(
            id,
            "saved in {} ms (paused {} ms), {} pages changed",
            started.elapsed().as_millis(),
            paused.as_millis(),
            saved.record.changed_pages
        );
        Ok(saved)
    }

    /// The paused VM's disk frozen into the save and its memory and devices
    /// written to `state`.
    async fn capture(
        &self,
        qmp: &mut Qmp,
        paths: &VmPaths,
        record: &mut crate::VmRecord,
        saved: &SavedVm,
    ) -> Result<()> {
        let active = paths.active_disk(record);
        std::fs::hard_link(&active, saved.disk())
            .map_err(RuntimeError::io(format!("linking {}", active.display())))?;
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
        create_overlay(&saved.disk(), &next, record.resources.disk_gb).await?;
        restrict_to(&next, record.qemu_uid)?;
        // Other VMs' QEMUs read the frozen layer as their backing file.
        share_read_only(&saved.disk())?;
        qmp.execute(
            "blockdev-snapshot-sync",
            json!({"device": "root", "snapshot-file": next.display().to_string(),
                   "format": "qcow2", "mode": "existing"}),
        )
        .await?;
        record.disk = Some(next_name);
        write_record(paths, record)?;
        let frozen = Instant::now();
        // QEMU (its own uid) writes the state into a file made for it.
        let state = saved.state();
        std::fs::File::create(&state).map_err(RuntimeError::io("creating the state file"))?;
        restrict_to(&state, record.qemu_uid)?;
        set_mapped_ram(qmp, true).await?;
        qmp.execute(
            "migrate",
            json!({"uri": format!("file:{}", state.display())}),
        )
        .await?;
        let done = qmp.wait_migration("saving the VM").await;
        let _ = set_mapped_ram(qmp, false).await;
        done?;
        tracing::debug!(
            "memory and devices written in {} ms",
            frozen.elapsed().as_millis()
        );
        share_read_only(&state)
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
        let size = self.config().size(&req.size)?;
        self.start(&req, size, Start::Saved(saved), Priority::Normal)
            .await
    }

    /// The save in `dir`, if it is one this host can start VMs from.
    pub fn saved(&self, dir: &Path) -> Result<SavedVm> {
        let bytes = std::fs::read(dir.join("saved.json")).map_err(RuntimeError::io(format!(
            "reading {}/saved.json",
            dir.display()
        )))?;
        let record: SavedRecord = serde_json::from_slice(&bytes)
            .map_err(|e| RuntimeError::Launch(format!("corrupt saved.json: {e}")))?;
        let template = self
            .template(&record.size)
            .filter(|t| t.key == record.template)
            .ok_or_else(|| {
                RuntimeError::Launch(format!(
                    "the template the save in {} is based on is gone",
                    dir.display()
                ))
            })?;
        Ok(SavedVm {
            dir: dir.to_path_buf(),
            record,
            template,
        })
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

async fn set_mapped_ram(qmp: &mut Qmp, on: bool) -> Result<()> {
    qmp.execute(
        "migrate-set-capabilities",
        json!({"capabilities": [
            {"capability": "mapped-ram", "state": on},
            {"capability": "multifd", "state": on},
            {"capability": "x-ignore-shared", "state": false},
        ]}),
    )
    .await
    .map(drop)
}

/// Loads a save's state into a QEMU waiting with `-incoming defer` and
/// starts the guest (it was saved paused).
pub(crate) async fn load_saved_state(
    paths: &VmPaths,
    saved: &SavedVm,
    qemu_pid: u32,
    marker: &str,
) -> Result<()> {
    crate::vm::wait_for_socket(paths, &paths.qmp_socket(), "QMP", qemu_pid, marker).await?;
    let mut qmp = Qmp::connect(&paths.qmp_socket()).await?;
    set_mapped_ram(&mut qmp, true).await?;
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
    qmp.execute("cont", json!({})).await?;
    Ok(())
}
