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
//! [`AgentClient::mount_volume`]: crate::AgentClient::mount_volume

use super::qmp::Qmp;
use super::VmManager;
use crate::{Result, RuntimeError};
use serde_json::json;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

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
            true => Some(self.read_only_overlay(id, slot, file, size).await?),
        };
        self.qmp_bounded(id, "a volume's attach", |mut qmp| async move {
            let base = fd_set(slot, 0);
            let file_node = format!("vol{slot}-file");
            let top = match overlay {
                None => {
                    pass(&mut qmp, base, &volume).await?;
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
                Some((_, overlay)) => {
                    pass(&mut qmp, base, &volume).await?;
                    let layer = fd_set(slot, 1);
                    pass(&mut qmp, layer, &overlay).await?;
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
        })
        .await
    }

    /// A qcow2 overlay of `size` bytes in VM `id`'s directory for a
    /// read-only attach of `file` to `slot`, opened for QEMU.
    async fn read_only_overlay(
        &self,
        id: &str,
        slot: u32,
        file: &Path,
        size: u64,
    ) -> Result<(PathBuf, std::fs::File)> {
        let path = self.paths(id).dir.join(format!("volume-{slot}.qcow2"));
        let _ = std::fs::remove_file(&path);
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
        Ok((path, opened))
    }
}

/// Pass `file` to QEMU in fd set `set`.
async fn pass(qmp: &mut Qmp, set: u32, file: &std::fs::File) -> Result<()> {
    qmp.execute_with_fd("add-fd", json!({"fdset-id": set}), file.as_fd())
        .await
        .map(drop)
}
