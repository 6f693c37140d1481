//! Volume slots: how a volume (a file of the host holding an ext4
//! filesystem, see `crate::volume_files`) reaches a running VM.
//!
//! QEMU's `microvm` has no hot-plug (its virtio devices sit on MMIO, not
//! PCI), so every VM is started with [`VOLUME_SLOTS`] disks that hold
//! nothing: a `raw` node over an empty `null-co` one, behind a
//! `virtio-blk-device` whose serial is `sandpit-vol<N>` (how the agent
//! finds it; the guest's names, `vdb`…, follow probe order). Attaching a
//! volume to slot N of a running VM is three QMP commands, measured with
//! this QEMU (10.0): `blockdev-add` of the volume's node, `blockdev-reopen`
//! of the slot's `raw` node onto it, and `block_resize` of the slot to the
//! volume's size, whose virtio configuration change tells the guest its
//! disk now has a size. The agent then mounts it ([`AgentClient::mount_volume`]).
//!
//! QEMU runs as the VM's own uid and under seccomp: it cannot open the
//! volume's file, and need not. The host opens it and passes the
//! descriptor over QMP (`add-fd`, `SCM_RIGHTS`); the node opens
//! `/dev/fdset/<set>`, and the set is removed once the node holds its own
//! copy.
//!
//! Read-only: the slot's disk is made read-write at the VM's start (it
//! cannot be otherwise, not knowing what it will hold), so its node cannot
//! be reopened onto a read-only file ("cannot support read-write users").
//! A read-only attach gives it instead a qcow2 overlay in the VM's
//! directory whose backing is the volume, opened read-only: the guest
//! mounts it read-only, and a guest root that remounts it read-write only
//! ever writes into its own overlay, which goes with the VM. The volume's
//! file is never opened for writing.
//!
//! QEMU's own image locking is off for volumes' files (`locking: off`):
//! it would refuse a read-only reader while a writer holds the file
//! ("Failed to get shared write lock"), which volumes allow (one sandbox
//! writes, any number read), and who may hold a volume read-write is the
//! store's to decide, across nodes too, not one host's file locks.
//!
//! A VM's volumes are in its record ([`VmVolume`], slot N the Nth), so
//! every later step knows them: [`VmManager::mount_volumes`] attaches and
//! mounts what a start asks for; a save made to resume (a pause) records
//! them as mounted in its memory, and the VM started from it has them
//! attached again before its guest runs a single instruction (see
//! `save::saved::load_saved_state`): the guest never sees its disk empty.
//! A snapshot is taken with them unmounted (its caller's job), so it holds
//! none. [`VmManager::sync_volumes`] writes the guest's cache of them out
//! before the VM stops, and [`sync_volume_files`] the host's.
//!
//! [`AgentClient::mount_volume`]: crate::AgentClient::mount_volume

use super::qmp::Qmp;
use super::VmManager;
use crate::volume_files::VolumeFiles;
use crate::{AgentClient, Result, RuntimeError};
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::os::fd::AsFd;
use std::path::Path;

/// A volume a VM holds, in the slot of its place in the VM's list.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmVolume {
    /// The volume's id (its file is `VolumeFiles::path`).
    pub volume: String,
    /// Where the guest mounts it.
    pub path: String,
    pub read_only: bool,
}

/// A volume's file opened for an attach to `slot`: the volume, and a
/// read-only attach's overlay.
pub(crate) struct Opened {
    slot: u32,
    volume: std::fs::File,
    overlay: Option<std::fs::File>,
    size: u64,
}

/// Volume slots of every VM (the most volumes one sandbox mounts).
pub const VOLUME_SLOTS: u32 = 4;

/// The serial of slot `slot`'s disk, which the agent finds it by.
pub fn slot_serial(slot: u32) -> String {
    format!("sandpit-vol{slot}")
}

/// QEMU's arguments for `slots` empty volume slots.
pub(super) fn slot_args(slots: u32) -> Vec<String> {
    (0..slots)
        .flat_map(|n| {
            [
                "-blockdev".to_string(),
                format!("driver=null-co,node-name=slot{n}-empty,size=0"),
                "-blockdev".to_string(),
                format!("driver=raw,node-name=slot{n},file=slot{n}-empty"),
                "-device".to_string(),
                format!("virtio-blk-device,drive=slot{n},serial={}", slot_serial(n)),
            ]
        })
        .collect()
}

/// The fd set a slot's attach passes its descriptors in (the volume's,
/// then a read-only attach's overlay's).
fn fd_set(slot: u32, which: u32) -> u32 {
    1000 + slot * 10 + which
}

impl VmManager {
    /// Give slot `slot` of running VM `id` the volume in `file`:
    /// read-write, or read-only through an overlay in the VM's directory
    /// (see the module's docs). The guest's disk then has the volume's
    /// size; mounting it is the agent's.
    pub async fn attach_volume(
        &self,
        id: &str,
        slot: u32,
        file: &Path,
        read_only: bool,
    ) -> Result<()> {
        let opened = open_volume(&self.paths(id).dir, slot, file, read_only).await?;
        self.qmp_bounded(id, "a volume's attach", |mut qmp| async move {
            attach(&mut qmp, opened).await
        })
        .await
    }

    /// Attach and mount in running VM `id` the volumes of `wanted` it does
    /// not hold yet (`agent` its agent), in order: slot N the Nth. A VM
    /// that holds others in those slots is refused.
    pub async fn mount_volumes(
        &self,
        id: &str,
        agent: &AgentClient,
        wanted: &[VmVolume],
    ) -> Result<()> {
        let mut record = self.record(id)?;
        let slots = self.volume_slots(&record);
        if wanted.len() > slots as usize {
            return Err(RuntimeError::Config(format!(
                "{} volumes for VM {id}, which has {slots} volume slots",
                wanted.len()
            )));
        }
        let files = VolumeFiles::new(self.config.volumes_dir());
        for (slot, volume) in wanted.iter().enumerate() {
            match record.volumes.get(slot) {
                Some(held) if held == volume => continue,
                Some(held) => {
                    return Err(RuntimeError::Config(format!(
                        "VM {id} holds volume {} in slot {slot}, not {}",
                        held.volume, volume.volume
                    )))
                }
                None => {}
            }
            let file = files.path(&volume.volume)?;
            self.attach_volume(id, slot as u32, &file, volume.read_only)
                .await?;
            agent
                .mount_volume(&slot_serial(slot as u32), &volume.path, volume.read_only)
                .await?;
            record.volumes.push(volume.clone());
            super::write_record(&self.paths(id), &record)?;
        }
        Ok(())
    }

    /// Write what running VM `id`'s guest caches of its volumes to them
    /// (`agent` its agent), unmounting them when `unmount` (they stay
    /// attached: a mount of the same slot brings them back). The first
    /// failure is returned, after every volume was tried.
    pub async fn sync_volumes(&self, id: &str, agent: &AgentClient, unmount: bool) -> Result<()> {
        let record = self.record(id)?;
        let mut first_failure = None;
        for volume in &record.volumes {
            if let Err(e) = agent.sync_volume(&volume.path, unmount).await {
                tracing::warn!(id, path = %volume.path, "a volume's sync failed: {e}");
                first_failure.get_or_insert(e);
            }
        }
        first_failure.map_or(Ok(()), Err)
    }

    /// Mount again in running VM `id` the volumes
    /// [`VmManager::sync_volumes`] unmounted (still attached).
    pub async fn remount_volumes(&self, id: &str, agent: &AgentClient) -> Result<()> {
        let record = self.record(id)?;
        for (slot, volume) in record.volumes.iter().enumerate() {
            agent
                .mount_volume(&slot_serial(slot as u32), &volume.path, volume.read_only)
                .await?;
        }
        Ok(())
    }

    /// The volume slots VM `record` was started with (a VM restored from a
    /// template made before volumes has none).
    fn volume_slots(&self, record: &super::VmRecord) -> u32 {
        match &record.template {
            Some(key) => self
                .template_by_key(&record.size, key)
                .map_or(0, |t| t.record.inputs.volume_slots),
            None => VOLUME_SLOTS,
        }
    }

    /// The files of the volumes `volumes` opened for a start from save
    /// `saved_dir`, whose memory has them mounted (attached before its
    /// guest runs): a read-only one's overlay is the one the save kept
    /// ([`keep_overlays`]), whose blocks the guest's cache may hold.
    pub(crate) async fn open_volumes(
        &self,
        vm_dir: &Path,
        saved_dir: &Path,
        volumes: &[VmVolume],
    ) -> Result<Vec<Opened>> {
        let files = VolumeFiles::new(self.config.volumes_dir());
        let mut opened = Vec::new();
        for (slot, volume) in volumes.iter().enumerate() {
            let kept = overlay_name(slot as u32);
            if volume.read_only && saved_dir.join(&kept).is_file() {
                std::fs::copy(saved_dir.join(&kept), vm_dir.join(&kept)).map_err(
                    RuntimeError::io(format!("copying {kept} of {}", saved_dir.display())),
                )?;
            }
            let file = files.path(&volume.volume)?;
            opened.push(open_volume(vm_dir, slot as u32, &file, volume.read_only).await?);
        }
        Ok(opened)
    }
}

/// The file of a read-only attach's overlay in slot `slot`.
fn overlay_name(slot: u32) -> String {
    format!("volume-{slot}.qcow2")
}

/// Keep with a pause's save in `saved_dir` the overlays of the read-only
/// volumes of the VM in `vm_dir`: its saved memory may cache their blocks
/// (a journal replayed into one), and the VM resumed from it must see the
/// same ones.
pub fn keep_overlays(vm_dir: &Path, saved_dir: &Path, volumes: &[VmVolume]) -> Result<()> {
    for (slot, _) in volumes.iter().enumerate().filter(|(_, v)| v.read_only) {
        let name = overlay_name(slot as u32);
        std::fs::copy(vm_dir.join(&name), saved_dir.join(&name))
            .map_err(RuntimeError::io(format!("keeping {name} with its save")))?;
    }
    Ok(())
}

/// Flush to the host's disk what was written to the read-write volumes of
/// `volumes` (QEMU writes through the host's page cache; a VM that ended
/// leaves its last writes there). Failures are logged.
pub async fn sync_volume_files(volumes_dir: &Path, volumes: &[VmVolume]) {
    let files = VolumeFiles::new(volumes_dir);
    for volume in volumes.iter().filter(|v| !v.read_only) {
        let Ok(path) = files.path(&volume.volume) else {
            continue;
        };
        let synced = tokio::task::spawn_blocking(move || {
            std::fs::OpenOptions::new()
                .write(true)
                .open(&path)
                .and_then(|f| f.sync_all())
        })
        .await;
        if let Ok(Err(e)) = synced {
            tracing::warn!(volume = %volume.volume, "syncing a volume's file: {e}");
        }
    }
}

/// Open `file` for an attach to `slot` of the VM in `vm_dir` (with its
/// overlay there when `read_only`).
async fn open_volume(vm_dir: &Path, slot: u32, file: &Path, read_only: bool) -> Result<Opened> {
    if slot >= VOLUME_SLOTS {
        return Err(RuntimeError::Config(format!(
            "volume slot {slot}: a VM has {VOLUME_SLOTS}"
        )));
    }
    let volume = std::fs::OpenOptions::new()
        .read(true)
        .write(!read_only)
        .open(file)
        .map_err(RuntimeError::io(format!(
            "opening volume {}",
            file.display()
        )))?;
    let size = volume
        .metadata()
        .map_err(RuntimeError::io(format!(
            "reading volume {}",
            file.display()
        )))?
        .len();
    let overlay = match read_only {
        false => None,
        true => Some(read_only_overlay(vm_dir, slot, file, size).await?),
    };
    Ok(Opened {
        slot,
        volume,
        overlay,
        size,
    })
}

/// Attach `opened` to its slot through `qmp` (see the module's docs).
pub(crate) async fn attach(qmp: &mut Qmp, opened: Opened) -> Result<()> {
    let Opened {
        slot,
        volume,
        overlay,
        size,
    } = opened;
    let base = fd_set(slot, 0);
    let file_node = format!("vol{slot}-file");
    let top = match overlay {
        None => {
            pass(qmp, base, &volume).await?;
            qmp.execute(
                "blockdev-add",
                json!({
                    "driver": "file", "node-name": file_node,
                    "filename": format!("/dev/fdset/{base}"),
                    "discard": "unmap", "locking": "off",
                }),
            )
            .await?;
            file_node
        }
        Some(overlay) => {
            pass(qmp, base, &volume).await?;
            let layer = fd_set(slot, 1);
            pass(qmp, layer, &overlay).await?;
            let backing = format!("vol{slot}-base");
            qmp.execute(
                "blockdev-add",
                json!({
                    "driver": "raw", "node-name": backing, "read-only": true,
                    "file": {"driver": "file", "read-only": true, "locking": "off",
                             "filename": format!("/dev/fdset/{base}")},
                }),
            )
            .await?;
            let top = format!("vol{slot}-overlay");
            qmp.execute(
                "blockdev-add",
                json!({
                    "driver": "qcow2", "node-name": top, "backing": backing,
                    "file": {"driver": "file", "node-name": file_node,
                             "filename": format!("/dev/fdset/{layer}")},
                }),
            )
            .await?;
            qmp.execute("remove-fd", json!({"fdset-id": layer})).await?;
            top
        }
    };
    qmp.execute("remove-fd", json!({"fdset-id": base})).await?;
    qmp.execute(
        "blockdev-reopen",
        json!({"options": [{"driver": "raw", "node-name": format!("slot{slot}"),
                            "file": top}]}),
    )
    .await?;
    qmp.execute(
        "block_resize",
        json!({"node-name": format!("slot{slot}"), "size": size}),
    )
    .await?;
    Ok(())
}

/// A qcow2 overlay of `size` bytes in the VM's directory `vm_dir` for a
/// read-only attach of `file` to `slot`, opened for QEMU.
async fn read_only_overlay(
    vm_dir: &Path,
    slot: u32,
    file: &Path,
    size: u64,
) -> Result<std::fs::File> {
    let path = vm_dir.join(overlay_name(slot));
    if path.is_file() {
        // Kept from a pause (see `keep_overlays`).
        return std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(RuntimeError::io(format!("opening {}", path.display())));
    }
    // `-u`: the backing is not opened here; QEMU is given it as a
    // node of its own, which the header's name does not override.
    let out = tokio::process::Command::new("qemu-img")
        .args(["create", "-q", "-u", "-f", "qcow2", "-F", "raw", "-b"])
        .arg(file)
        .arg(&path)
        .arg(size.to_string())
        .output()
        .await
        .map_err(RuntimeError::spawn("qemu-img", "qemu-utils", "qemu-img"))?;
    if !out.status.success() {
        return Err(RuntimeError::Launch(format!(
            "qemu-img create (a volume's overlay) failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    let opened = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .map_err(RuntimeError::io(format!("opening {}", path.display())))?;
    Ok(opened)
}

/// Pass `file` to QEMU in fd set `set`.
async fn pass(qmp: &mut Qmp, set: u32, file: &std::fs::File) -> Result<()> {
    qmp.execute_with_fd("add-fd", json!({"fdset-id": set}), file.as_fd())
        .await
        .map(drop)
}
