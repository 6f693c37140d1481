//! A volume's files without a sandbox (`Volumes::volume_files`,
//! `upload_volume_file`, `download_volume_file`):
//! served by the volume's node from its file
//! (`sandpit_runtime::volume_content`), while no sandbox mounts it
//! read-write — while none mounts it at all, for a call that changes it.
//!
//! The rule is the store's to keep, race-free: each call on the node
//! holds a lease on the volume ([`Store::lease_volume`]), granted only
//! while the rule holds, during which no sandbox takes the volume, nor is
//! it resized or deleted. The lease is taken once the call can run at
//! once (an upload's bytes are on the node already) and ended when the
//! node is done, by a task of its own: a caller that goes away mid-call
//! neither cuts the node's work short nor ends the lease before it. A
//! lease of a process that died lapses at its bound.
//!
//! [`Store::lease_volume`]: sandpit_store::Store::lease_volume

use crate::api::{ByteSource, Caller, FileDownload};
use crate::error::{body_failed, body_length, CoreError, Result};
use crate::model::*;
use crate::service::errors::runtime_error;
use crate::service::Service;
use sandpit_host::machines::{EntryKind, Machines, VolumeEntry};
use sandpit_store::{VolumeLeased, VolumeRow};
use std::sync::Arc;
use tokio::sync::mpsc;

/// How long a lease outlives its start: past the node's own bound on a
/// call (10 minutes), so that it never lapses while the node works.
const LEASE_BOUND: time::Duration = time::Duration::minutes(15);

/// What starts a volume token.
const TOKEN_PREFIX: &str = "svt1";

/// Volume `volume_id`'s token for account `account_id`: both named, then
/// their signature under the operator's key, `.`-separated (ids hold no
/// `.`).
fn volume_token_of(
    key: &crate::secrets_key::SecretsKey,
    account_id: &str,
    volume_id: &str,
) -> String {
    let signed = key.sign(format!("volume-token\0{account_id}\0{volume_id}").as_bytes());
    format!(
        "{TOKEN_PREFIX}.{account_id}.{volume_id}.{}",
        hex::encode(signed)
    )
}

/// A path in a volume as the API shows it.
pub(crate) fn to_volume_file(e: &VolumeEntry) -> VolumeFile {
    let ts = |t: time::OffsetDateTime| {
        t.format(&time::format_description::well_known::Rfc3339)
            .unwrap_or_default()
    };
    VolumeFile {
        object: "volume_file".into(),
        name: e.name.clone(),
        path: e.path.clone(),
        kind: match e.kind {
            EntryKind::File => "file",
            EntryKind::Directory => "directory",
            EntryKind::Symlink => "symlink",
            EntryKind::Unknown => "other",
        }
        .into(),
        size: e.size,
        mode: e.mode,
        uid: e.uid,
        gid: e.gid,
        atime: ts(e.atime),
        mtime: ts(e.mtime),
        ctime: ts(e.ctime),
        target: e.target.clone(),
    }
}

/// A lease on a volume, and the node that serves its files.
struct Leased {
    lease_id: String,
    row: VolumeRow,
    machines: Arc<dyn Machines>,
}

impl Service {
    /// Leases the caller's `volume` for a call (`writing`: one that
    /// changes it), or says why not.
    async fn lease_files(&self, caller: &Caller, volume: &str, writing: bool) -> Result<Leased> {
        let row = self.find_volume(caller, volume).await?;
        let machines = self.machines_on(&row.host, &row.id).await?;
        let lease_id = sandpit_host::ids::new_id("vlease_");
        let until = time::OffsetDateTime::now_utc() + LEASE_BOUND;
        match self
            .store
            .lease_volume(&caller.account_id, &row.id, &lease_id, writing, until)
            .await?
        {
            VolumeLeased::Leased(row) => Ok(Leased {
                lease_id,
                row,
                machines,
            }),
            VolumeLeased::Missing => Err(super::volumes::no_volume(volume)),
            VolumeLeased::Busy(status) => Err(super::volumes::busy(&row.name, status)),
            VolumeLeased::Held(sandboxes) => Err(CoreError::conflict(if writing {
                format!(
                    "volume {:?} is mounted by sandboxes ({}): its files change here only \
                     while no sandbox mounts it; write them from that sandbox, or destroy it first",
                    row.name,
                    sandboxes.join(", ")
                )
            } else {
                format!(
                    "volume {:?} is mounted read-write by sandbox {}: its files are read here \
                     only while no sandbox writes them; read them from that sandbox, or destroy \
                     it first",
                    row.name,
                    sandboxes.join(", ")
                )
            })),
        }
    }

    /// Runs `work` on the leased volume's node in a task of its own, and
    /// ends the lease once it is done, whether or not the caller waited.
    async fn under_lease<T, F>(&self, leased: Leased, work: F) -> Result<T>
    where
        T: Send + 'static,
        F: std::future::Future<Output = sandpit_runtime::Result<T>> + Send + 'static,
    {
        let store = self.store.clone();
        let lease_id = leased.lease_id;
        let done = tokio::spawn(async move {
            let out = work.await;
            if let Err(e) = store.end_volume_lease(&lease_id).await {
                tracing::warn!(%lease_id, "ending a volume's lease (it lapses on its own): {e}");
            }
            out
        })
        .await
        .map_err(|e| CoreError::internal(format!("a volume call's task failed: {e}")))?;
        done.map_err(runtime_error)
    }
}

/// The API's calls ([`Volumes`] implemented for the service in
/// `volumes.rs` calls these).
///
/// [`Volumes`]: crate::api::Volumes
impl Service {
    pub(crate) async fn volume_token_for(&self, caller: &Caller, volume: &str) -> Result<String> {
        let row = self.find_volume(caller, volume).await?;
        Ok(volume_token_of(
            &self.config.secrets_key,
            &caller.account_id,
            &row.id,
        ))
    }

    pub(crate) async fn volume_token_caller(&self, volume_id: &str, token: &str) -> Result<Caller> {
        let account_id = token
            .split('.')
            .nth(1)
            .filter(|a| !a.is_empty())
            .ok_or_else(CoreError::unauthorized)?;
        let expected = volume_token_of(&self.config.secrets_key, account_id, volume_id);
        if !crate::metrics::token_matches(&expected, token) {
            return Err(CoreError::unauthorized());
        }
        match self.store.volume(account_id, volume_id).await? {
            Some(v) if v.status != sandpit_store::VolumeStatus::Deleted => {
                Ok(Caller::new(account_id.to_string(), "volume token"))
            }
            _ => Err(CoreError::unauthorized()),
        }
    }

    pub(crate) async fn volume_files_call(
        &self,
        caller: &Caller,
        volume: &str,
        call: VolumeCall,
    ) -> Result<Vec<VolumeFile>> {
        let leased = self.lease_files(caller, volume, call.changes()).await?;
        let (machines, id) = (leased.machines.clone(), leased.row.id.clone());
        let entries = self
            .under_lease(leased, async move { machines.volume_call(&id, call).await })
            .await?;
        Ok(entries.iter().map(to_volume_file).collect())
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn volume_file_upload(
        &self,
        caller: &Caller,
        volume: &str,
        path: &str,
        size: u64,
        owner: VolumeOwnership,
        overwrite: bool,
        mut body: Box<dyn ByteSource>,
    ) -> Result<VolumeFile> {
        let _slot = self.transfer_slot(caller).await?;
        let row = self.find_volume(caller, volume).await?;
        if size > row.size_bytes {
            return Err(CoreError::invalid(format!(
                "{size} bytes do not fit in volume {:?} ({} bytes): grow it first",
                row.name, row.size_bytes
            )));
        }
        let machines = self.machines_on(&row.host, &row.id).await?;
        // Dropped on any early return: the node discards what it had.
        let mut upload = machines
            .volume_upload(&row.id, path, size, owner, overwrite)
            .await
            .map_err(runtime_error)?;
        let mut got = 0u64;
        while let Some(chunk) = body.next_chunk().await {
            let chunk = chunk.map_err(body_failed)?;
            got += chunk.len() as u64;
            if got > size {
                return Err(body_length(got, size));
            }
            upload.send(&chunk).await.map_err(runtime_error)?;
        }
        if got != size {
            return Err(body_length(got, size));
        }
        // Every byte is on the node: the volume is taken only now.
        let leased = self.lease_files(caller, volume, true).await?;
        let (machines, id) = (leased.machines.clone(), leased.row.id.clone());
        let entries = self
            .under_lease(leased, async move {
                let (path, _) = upload.finish().await?;
                machines.volume_call(&id, VolumeCall::Stat { path }).await
            })
            .await?;
        entries
            .first()
            .map(to_volume_file)
            .ok_or_else(|| CoreError::internal("a written file was not described"))
    }

    pub(crate) async fn volume_file_download(
        &self,
        caller: &Caller,
        volume: &str,
        path: &str,
    ) -> Result<FileDownload> {
        let slot = self.transfer_slot(caller).await?;
        let leased = self.lease_files(caller, volume, false).await?;
        let (machines, id, path) = (
            leased.machines.clone(),
            leased.row.id.clone(),
            path.to_string(),
        );
        // Copied whole on the node under the lease; sent after it.
        let mut download = self
            .under_lease(
                leased,
                async move { machines.volume_download(&id, &path).await },
            )
            .await?;
        let (tx, chunks) = mpsc::channel(4);
        let (path, size) = (download.path().to_string(), download.size());
        tokio::spawn(async move {
            let _slot = slot;
            loop {
                let piece = match download.next_chunk().await {
                    Ok(Some(piece)) => Ok(piece),
                    Ok(None) => break,
                    Err(e) => Err(runtime_error(e)),
                };
                let last = piece.is_err();
                if tx.send(piece).await.is_err() || last {
                    break;
                }
            }
        });
        Ok(FileDownload { path, size, chunks })
    }
}

/// How long a move's lease lasts unless renewed, and how often it is.
const MOVE_LEASE: time::Duration = time::Duration::minutes(2);
const MOVE_RENEW: std::time::Duration = std::time::Duration::from_secs(30);

impl Service {
    /// The API's `move_volume`: the volume's file streamed from its node to
    /// `node` under a lease (no sandbox takes it meanwhile, and none may
    /// mount it to begin with), the row moved to `node` in a statement
    /// that asks the lease to be live still, then the old file removed.
    /// A copy that fails leaves the volume where it was, whole.
    pub(crate) async fn volume_move(
        &self,
        caller: &Caller,
        volume: &str,
        node: &str,
    ) -> Result<Volume> {
        let row = self.find_volume(caller, volume).await?;
        if row.host == node {
            return Err(CoreError::invalid(format!(
                "volume {:?} is on node {node} already",
                row.name
            )));
        }
        let to = self.machines_on(node, &row.id).await.map_err(|e| {
            CoreError::new(
                e.kind,
                format!(
                    "node {node:?} cannot take volume {:?}: {}",
                    row.name, e.message
                ),
            )
        })?;
        let from = self.machines_on(&row.host, &row.id).await?;
        let lease_id = sandpit_host::ids::new_id("vlease_");
        let until = time::OffsetDateTime::now_utc() + MOVE_LEASE;
        match self
            .store
            .lease_volume(&caller.account_id, &row.id, &lease_id, true, until)
            .await?
        {
            VolumeLeased::Leased(_) => {}
            VolumeLeased::Missing => return Err(super::volumes::no_volume(volume)),
            VolumeLeased::Busy(status) => return Err(super::volumes::busy(&row.name, status)),
            VolumeLeased::Held(sandboxes) => {
                return Err(CoreError::conflict(format!(
                    "volume {:?} is mounted by sandboxes ({}): it moves only while none \
                     mounts it",
                    row.name,
                    sandboxes.join(", ")
                )))
            }
        }
        // The copy runs to its end in a task of its own, renewing the
        // lease as it goes; the lease ends with it.
        let (store, id, source, target) = (
            self.store.clone(),
            row.id.clone(),
            row.host.clone(),
            node.to_string(),
        );
        let moved = tokio::spawn(async move {
            let copy = async {
                // A copy the new node kept from an earlier move away from
                // it is stale: the row says the volume is elsewhere.
                to.delete_volume(&id).await?;
                let mut sending = from.send_volume(&id).await?;
                let mut receiving = to.receive_volume(&id, sending.size()).await?;
                let mut renewed = std::time::Instant::now();
                while let Some(piece) = sending.next_chunk().await? {
                    receiving.send(&piece).await?;
                    if renewed.elapsed() > MOVE_RENEW {
                        renewed = std::time::Instant::now();
                        let until = time::OffsetDateTime::now_utc() + MOVE_LEASE;
                        if !store.renew_volume_lease(&lease_id, until).await.unwrap_or(false) {
                            return Err(sandpit_runtime::RuntimeError::Busy(
                                "the volume's lease lapsed mid-move; retry".into(),
                            ));
                        }
                    }
                }
                receiving.finish().await.map(|_| ())
            };
            let copied = copy.await.map_err(runtime_error);
            let recorded = match copied {
                Ok(()) => store
                    .move_volume(&id, &source, &target, &lease_id)
                    .await
                    .map_err(CoreError::from),
                Err(e) => Err(e),
            };
            if let Err(e) = store.end_volume_lease(&lease_id).await {
                tracing::warn!(%lease_id, "ending a volume's lease (it lapses on its own): {e}");
            }
            match recorded {
                // Moved: the old file goes.
                Ok(true) => {
                    if let Err(e) = from.delete_volume(&id).await {
                        tracing::warn!(%id, node = %source, "removing a moved volume's old file: {e}");
                    }
                    Ok(())
                }
                // Not recorded: the copy goes, the volume stays.
                other => {
                    if let Err(e) = to.delete_volume(&id).await {
                        tracing::warn!(%id, node = %target, "removing a volume's copy not moved to: {e}");
                    }
                    match other {
                        Ok(_) => Err(CoreError::conflict(
                            "the volume changed while it was copied (its lease lapsed); retry",
                        )),
                        Err(e) => Err(e),
                    }
                }
            }
        })
        .await
        .map_err(|e| CoreError::internal(format!("a volume move's task failed: {e}")))?;
        moved?;
        let row = self.find_volume(caller, &row.id).await?;
        let holders = self.store.volume_holders(&row.id).await?;
        Ok(super::volumes::to_volume(&row, &holders))
    }
}
