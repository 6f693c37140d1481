//! What this member's part of the world looks like now, read at each
//! scrape of the metrics (see [`crate::metrics`]): its live sandboxes from
//! the store in one grouped query, its warm pool, VMs and preview
//! connections from memory.

use super::Service;
use crate::error::Result;
use crate::metrics::World;

impl Service {
    /// This member's sandboxes, pool, VMs and preview connections.
    pub(crate) async fn world(&self) -> Result<World> {
        let sandboxes = self.store.sandbox_tally(&self.config.host_name).await?;
        let (preview_connections_open, preview_connections_opened) =
            self.previews.connection_counts();
        let mut world = World {
            sizes: self.config.sizes.keys().cloned().collect(),
            sandboxes,
            preview_connections_open,
            preview_connections_opened,
            vms_stopped_on_full_disk: self.disk_holds.stopped_on_full_disk(),
            ..World::default()
        };
        if let Some(vms) = &self.vms {
            world.pool = vms
                .pool_targets()
                .into_iter()
                .map(|(size, target)| {
                    let ready = vms.warm_count(&size);
                    (size, ready, target)
                })
                .collect();
            world.vms = vms.list().into_iter().map(|r| (r.id, r.qemu_pid)).collect();
        }
        Ok(world)
    }
}
