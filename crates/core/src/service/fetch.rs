//! A template's save fetched to a node of the cluster that lacks it, over
//! the node link, before a sandbox from the template starts there.
//!
//! A template's sandboxes start on any node that holds its save: the one
//! that built it, or one with a copy. A create placed on a node without
//! one fetches it first (`create::place` tries the nodes that hold it
//! first, then the others): this member reads the save from a node that
//! holds it ([`Machines::send_snapshot`], the parts the target already
//! holds left out) and writes it to the target
//! ([`Machines::receive_snapshot`]), which keeps it with the snapshot
//! template its memory is a difference to (see
//! `sandpit_runtime::save::transfer`). The copy is a row of
//! `template_layers` (the template's layer, on the target's host), written
//! before the save exists so the target's sweep never takes it for an
//! orphan, with its bytes once whole: a copy without bytes is not started
//! from. So a copy is a cache like any layer: a rebuild on that node
//! resumes from it, and one unused for the snapshots' retention is
//! forgotten (then swept) unless it is the template's own save.
//!
//! One fetch per node and layer at a time in a member (the creates behind
//! it wait and then use its copy). Two members fetching the same at once
//! each make a copy; the row keeps the last, and the sweep removes the
//! other.

use crate::cluster::Placement;
use crate::service::create::StartFrom;
use crate::service::Service;
use sandpit_host::ids::new_id;
use sandpit_host::machines::{Machines, VmResult};
use sandpit_runtime::RuntimeError;
use std::sync::Arc;

impl Service {
    /// The save a sandbox from `from` (a template) starts from on
    /// `target`, fetched there now from a node that holds it; `Err` says
    /// why that cannot be (the create then tries the next node).
    pub(super) async fn fetch_to(
        &self,
        from: &StartFrom,
        target: &Placement,
    ) -> std::result::Result<String, String> {
        let Some(layer) = &from.fetch else {
            return Err(format!("{} is kept on node {} alone", from.what, from.host));
        };
        let key = format!("{}/{}/{}", target.host, layer.account_id, layer.layer_key);
        let _turn = self.fetching.take(&key).await;
        self.fetch_in_turn(from, layer, target).await
    }

    async fn fetch_in_turn(
        &self,
        from: &StartFrom,
        layer: &sandpit_store::LayerRow,
        target: &Placement,
    ) -> std::result::Result<String, String> {
        let refused =
            |why: String| format!("node {} could not fetch {}: {why}", target.host, from.what);
        let copies = self
            .store
            .template_layer_copies(&layer.account_id, &layer.layer_key)
            .await
            .map_err(|e| refused(e.to_string()))?;
        // A copy the create before this one made.
        if let Some(copy) = copies.iter().find(|c| c.host == target.host && c.bytes > 0) {
            return Ok(copy.save_id.clone());
        }
        let mut copy = sandpit_store::LayerRow {
            host: target.host.clone(),
            save_id: new_id("snap_"),
            bytes: 0,
            ..layer.clone()
        };
        self.store
            .put_template_layer(&copy)
            .await
            .map_err(|e| refused(e.to_string()))?;
        let sources = std::iter::once((from.host.clone(), from.save.clone())).chain(
            copies
                .into_iter()
                .filter(|c| c.bytes > 0 && c.host != target.host && c.host != from.host)
                .map(|c| (c.host, c.save_id)),
        );
        let mut why = "no node that holds it is up".to_string();
        for (host, save) in sources {
            let source = match self.machines_on(&host, &from.what).await {
                Ok(m) => m,
                Err(e) => {
                    why = format!("node {host}, which holds it: {}", e.message);
                    continue;
                }
            };
            let started = std::time::Instant::now();
            // In a task of its own: a caller that hangs up does not cut a
            // copy short (the next create uses it).
            let carried = tokio::spawn(carry(
                source,
                save,
                target.machines.clone(),
                copy.save_id.clone(),
            ))
            .await
            .unwrap_or_else(|e| Err(RuntimeError::Launch(format!("the fetch's task: {e}"))));
            match carried {
                Ok(bytes) => {
                    copy.bytes = bytes.max(1);
                    self.store
                        .put_template_layer(&copy)
                        .await
                        .map_err(|e| refused(e.to_string()))?;
                    tracing::info!(
                        from = %host, to = %target.host, save = %copy.save_id,
                        "fetched {} in {} ms ({bytes} bytes kept)",
                        from.what, started.elapsed().as_millis()
                    );
                    return Ok(copy.save_id);
                }
                Err(e) => {
                    tracing::warn!(from = %host, to = %target.host, "fetching {}: {e}", from.what);
                    why = format!("from node {host}: {e}");
                }
            }
        }
        // Nothing of it stays.
        if let Err(e) = self.store.forget_template_layer(&copy.save_id).await {
            tracing::warn!(save = %copy.save_id, "forgetting a copy never made: {e}");
        }
        let _ = target.machines.delete_snapshot(&copy.save_id).await;
        Err(refused(why))
    }

    /// Marks the copy of `from` a sandbox on `host` starts from as used
    /// now (a copy unused for the retention is forgotten).
    pub(super) async fn used_copy(&self, from: &StartFrom, host: &str, save: &str) {
        let Some(layer) = from.fetch.as_ref().filter(|_| save != from.save) else {
            return;
        };
        if let Err(e) = self
            .store
            .template_layer(&layer.account_id, &layer.layer_key, &[host.to_string()])
            .await
        {
            tracing::warn!(%host, "marking {}'s copy used: {e}", from.what);
        }
    }
}

/// Snapshot `save` of `source` carried to `target` as `copy`; once more
/// when the target lost a part it said it held meanwhile. Returns what
/// the copy takes there. (A template's save, and a moved sandbox's paused
/// VM: one way to carry both.)
pub(super) async fn carry(
    source: Arc<dyn Machines>,
    save: String,
    target: Arc<dyn Machines>,
    copy: String,
) -> VmResult<u64> {
    let mut tries = 0;
    loop {
        tries += 1;
        let held = target.held_parts().await?;
        let mut sending = source.send_snapshot(&save, held).await?;
        let mut receiving = target.receive_snapshot(&copy, sending.size()).await?;
        let mut sent = Ok(());
        while let Some(piece) = sending.next_chunk().await? {
            sent = receiving.send(&piece).await;
            if sent.is_err() {
                break;
            }
        }
        let received = match sent {
            Ok(()) => receiving.finish().await.map(|(_, bytes)| bytes),
            Err(e) => Err(e),
        };
        match received {
            Err(RuntimeError::Busy(_)) if tries < 2 => continue,
            outcome => return outcome,
        }
    }
}
