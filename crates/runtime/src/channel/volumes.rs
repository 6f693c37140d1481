//! The agent's side of volumes (see `vm::volumes` for the host's): mount
//! the volume the host attached to a slot, and write what the guest holds
//! of one to its device before the VM stops.

use super::AgentClient;
use crate::{Result, RuntimeError};
use sandpit_protocol::{DoneResult, Message};
use std::time::Duration;

/// How long a mount may take: the agent waits up to 10 s for the attach to
/// reach the guest, then mounts (an ext4 journal replay under emulation).
const MOUNT_DEADLINE: Duration = Duration::from_secs(60);
/// How long writing a volume's cached data out may take (a command may
/// have left gigabytes in the guest's page cache).
const SYNC_DEADLINE: Duration = Duration::from_secs(300);

impl AgentClient {
    /// Mount the volume attached to the slot whose disk has serial
    /// `serial` at `path`; the guest's device it came to (`/dev/vdb`).
    pub async fn mount_volume(&self, serial: &str, path: &str, read_only: bool) -> Result<String> {
        self.needs("volumes", "volumes")?;
        let done = self
            .simple_within(
                "a volume's mount",
                |id| Message::MountVolume {
                    id,
                    serial: serial.to_string(),
                    path: path.to_string(),
                    read_only,
                },
                &[],
                MOUNT_DEADLINE,
            )
            .await?;
        match done {
            DoneResult::Mounted { device, .. } => Ok(device),
            other => Err(RuntimeError::Disconnected(format!(
                "unexpected answer to a volume's mount: {other:?}"
            ))),
        }
    }

    /// Write what the guest caches of the volume mounted at `path` to its
    /// device, then unmount it when `unmount`.
    pub async fn sync_volume(&self, path: &str, unmount: bool) -> Result<()> {
        self.needs("volumes", "volumes")?;
        let done = self
            .simple_within(
                "a volume's sync",
                |id| Message::SyncVolume {
                    id,
                    path: path.to_string(),
                    unmount,
                },
                &[],
                SYNC_DEADLINE,
            )
            .await?;
        match done {
            DoneResult::Synced { .. } => Ok(()),
            other => Err(RuntimeError::Disconnected(format!(
                "unexpected answer to a volume's sync: {other:?}"
            ))),
        }
    }
}
