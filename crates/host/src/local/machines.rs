//! [`LocalVms`] behind the [`Machines`] trait: what every caller on this
//! host reaches its VMs through (the service, and the node API for the
//! other members).

use super::*;
use crate::machines::{Ownership, VolumeCall, VolumeEntry};

/// A command in a local guest; the warm pool's refills give way while it
/// runs.
struct LocalCommand {
    handle: sandpit_runtime::ExecHandle,
    _live: sandpit_runtime::Held,
}

#[async_trait]
impl Command for LocalCommand {
    async fn next(&mut self) -> VmResult<sandpit_runtime::GuestExecEvent> {
        self.handle.next().await
    }

    fn cancel(&self) {
        self.handle.cancel()
    }
}

/// A directory watched in a local guest. Unlike a command it does not hold
/// the warm pool's refills back: a watch mostly waits.
struct LocalWatch(sandpit_runtime::DirWatch);

#[async_trait]
impl Watch for LocalWatch {
    fn path(&self) -> &str {
        self.0.path()
    }

    async fn next(&mut self) -> VmResult<Option<Vec<sandpit_protocol::WatchEvent>>> {
        self.0.next().await
    }
}

struct LocalUpload {
    upload: sandpit_runtime::FileUpload,
    _live: sandpit_runtime::Held,
}

#[async_trait]
impl Upload for LocalUpload {
    async fn send(&mut self, data: &[u8]) -> VmResult<()> {
        self.upload.send(data).await
    }

    async fn finish(self: Box<Self>) -> VmResult<(String, u64)> {
        self.upload.finish().await
    }
}

struct LocalDownload {
    download: sandpit_runtime::GuestDownload,
    _live: sandpit_runtime::Held,
}

#[async_trait]
impl Download for LocalDownload {
    fn path(&self) -> &str {
        self.download.path()
    }

    fn size(&self) -> u64 {
        self.download.size()
    }

    async fn next_chunk(&mut self) -> VmResult<Option<Vec<u8>>> {
        self.download.next_chunk().await
    }
}

/// A snapshot sent from here to another node.
struct SnapshotSending {
    name: String,
    sending: sandpit_runtime::save::transfer::SaveSending,
    _live: sandpit_runtime::Held,
}

#[async_trait]
impl Download for SnapshotSending {
    fn path(&self) -> &str {
        &self.name
    }

    fn size(&self) -> u64 {
        self.sending.size()
    }

    async fn next_chunk(&mut self) -> VmResult<Option<Vec<u8>>> {
        self.sending.next_piece().await
    }
}

/// A snapshot another node sends here.
struct SnapshotReceiving {
    name: String,
    receiving: sandpit_runtime::save::transfer::SaveReceiving,
    _live: sandpit_runtime::Held,
}

#[async_trait]
impl Upload for SnapshotReceiving {
    async fn send(&mut self, data: &[u8]) -> VmResult<()> {
        self.receiving.send(data).await
    }

    async fn finish(self: Box<Self>) -> VmResult<(String, u64)> {
        let bytes = self.receiving.finish().await?;
        Ok((self.name, bytes))
    }
}

#[async_trait]
impl Machines for LocalVms {
    async fn take_warm(&self, size: &str) -> VmResult<Option<String>> {
        self.record_demand(size);
        if self.warm_count(size) > 0 {
            self.capacity.admit_warm().map_err(RuntimeError::HostFull)?;
            if let Some(id) = LocalVms::take_warm(self, size) {
                return Ok(Some(id));
            }
        }
        // A start would be refused: refuse now, before anything is recorded.
        let room = self.capacity.report();
        if let (false, Some(why)) = (room.accepting, room.reason) {
            return Err(RuntimeError::HostFull(why));
        }
        // No warm VM: the start will boot one, in the start queue. A full
        // queue refuses now, before anything is recorded, so that a
        // cluster's create tries another node instead.
        if self.starts.available_permits() == 0
            && self.waiting.load(Ordering::SeqCst) >= self.pool.max_waiting_starts
        {
            return Err(self.queue_full());
        }
        Ok(None)
    }

    async fn return_warm(&self, id: &str, size: &str) -> VmResult<()> {
        LocalVms::return_warm(self, id, size);
        Ok(())
    }

    async fn prepare(&self, size: &str) -> VmResult<bool> {
        LocalVms::prepare(self, size).await
    }

    async fn start(
        &self,
        id: &str,
        size: &str,
        snapshot: Option<&str>,
        expires_at: OffsetDateTime,
        egress: Egress,
        volumes: Vec<VmVolume>,
    ) -> VmResult<Started> {
        if let Some(snapshot) = snapshot {
            match LocalVms::state(self, id) {
                Some(VmState::Running) => {
                    self.manager.set_expiry(id, expires_at)?;
                    self.ensure_egress(id, egress).await?;
                    self.ensure_volumes(id, &volumes).await?;
                }
                _ => drop(
                    self.create_from_snapshot(id, size, snapshot, expires_at, egress, volumes)
                        .await?,
                ),
            }
            return Ok(Started::Booted);
        }
        let claimed = self.claimed.lock().unwrap().contains(id);
        let claimed = claimed || self.take_ready(id).await;
        if !claimed && matches!(LocalVms::state(self, id), Some(VmState::Running)) {
            self.manager.set_expiry(id, expires_at)?;
            self.ensure_egress(id, egress).await?;
            self.ensure_volumes(id, &volumes).await?;
        } else {
            self.create(id, size, expires_at, egress, volumes).await?;
        }
        Ok(Started::Booted)
    }

    async fn destroy(&self, id: &str) -> VmResult<Option<u64>> {
        let used = self.manager.disk_use(id).ok();
        LocalVms::destroy(self, id).await?;
        Ok(used)
    }

    async fn set_expiry(&self, id: &str, at: OffsetDateTime) -> VmResult<()> {
        self.manager.set_expiry(id, at)
    }

    async fn create_volume(&self, id: &str, bytes: u64) -> VmResult<()> {
        self.volume_files().create(id, bytes).await
    }

    async fn resize_volume(&self, id: &str, bytes: u64) -> VmResult<()> {
        self.volume_files().resize(id, bytes).await
    }

    async fn delete_volume(&self, id: &str) -> VmResult<()> {
        self.volume_files().delete(id).await
    }

    async fn volume_call(&self, id: &str, call: VolumeCall) -> VmResult<Vec<VolumeEntry>> {
        self.volume_files().call(id, call).await
    }

    async fn volume_upload(
        &self,
        id: &str,
        path: &str,
        size: u64,
        owner: Ownership,
        overwrite: bool,
    ) -> VmResult<Box<dyn Upload>> {
        Ok(Box::new(VolumeUploading::new(
            self.volume_files(),
            id,
            path,
            size,
            owner,
            overwrite,
        )?))
    }

    async fn send_volume(&self, id: &str) -> VmResult<Box<dyn Download>> {
        Ok(Box::new(VolumeSending {
            id: id.to_string(),
            sending: self.volume_files().send(id)?,
        }))
    }

    async fn receive_volume(&self, id: &str, size: u64) -> VmResult<Box<dyn Upload>> {
        Ok(Box::new(VolumeReceiving {
            id: id.to_string(),
            receiving: Some(self.volume_files().receive(id, size)?),
        }))
    }

    async fn volume_download(&self, id: &str, path: &str) -> VmResult<Box<dyn Download>> {
        Ok(Box::new(
            VolumeDownloading::copy(self.volume_files(), id, path).await?,
        ))
    }

    async fn snapshot(&self, id: &str, snapshot: &str) -> VmResult<u64> {
        LocalVms::snapshot(self, id, snapshot).await
    }

    async fn delete_snapshot(&self, snapshot: &str) -> VmResult<()> {
        self.manager.delete_saved(snapshot).await
    }

    async fn set_egress(&self, id: &str, egress: Egress) -> VmResult<()> {
        self.ensure_egress(id, egress).await
    }

    async fn secrets_used(&self, id: &str) -> VmResult<std::collections::BTreeMap<String, String>> {
        let used = self.manager.secrets_last_used(id);
        Ok(used
            .into_iter()
            .map(|(name, at)| (name, crate::ids::rfc3339(at)))
            .collect())
    }

    async fn held_parts(&self) -> VmResult<Vec<String>> {
        Ok(self.manager.held_parts())
    }

    async fn send_snapshot(
        &self,
        snapshot: &str,
        held: Vec<String>,
    ) -> VmResult<Box<dyn Download>> {
        let held = held.into_iter().collect();
        Ok(Box::new(SnapshotSending {
            name: snapshot.to_string(),
            sending: self.manager.send_saved(snapshot, &held)?,
            _live: self.manager.hold_background(),
        }))
    }

    async fn receive_snapshot(&self, snapshot: &str, size: u64) -> VmResult<Box<dyn Upload>> {
        Ok(Box::new(SnapshotReceiving {
            name: snapshot.to_string(),
            receiving: self.manager.receive_saved(snapshot, size).await?,
            _live: self.manager.hold_background(),
        }))
    }

    async fn restore(
        &self,
        id: &str,
        snapshot: &str,
        expires_at: OffsetDateTime,
        egress: Egress,
        volumes: Vec<VmVolume>,
    ) -> VmResult<()> {
        LocalVms::restore(self, id, snapshot, expires_at, egress, volumes).await
    }

    /// Saves the VM whole under its pause's name, then stops it.
    async fn pause(&self, id: &str) -> VmResult<()> {
        let _one_at_a_time = self.saving.lock().await;
        let _live = self.manager.hold_background();
        let name = paused_name(id);
        // A pause that failed half-way left its save: it is stale.
        self.manager.delete_saved(&name).await?;
        // Its volumes stay mounted in its saved memory, their content
        // written out: they are the files' while it is paused.
        let volumes = self.sync_volumes(id).await;
        let saved = self.manager.save(id, &name, AfterSave::Stay).await?;
        // (Without them, a resumed reader gets fresh ones: logged.)
        if let Err(e) = sandpit_runtime::vm::volumes::keep_overlays(
            &self.manager.paths(id).dir,
            &saved.dir,
            &volumes,
        ) {
            tracing::warn!(id, "keeping its read-only volumes' overlays: {e}");
        }
        self.agents.lock().await.remove(id);
        match self.manager.destroy(id).await {
            Ok(()) | Err(RuntimeError::NotFound(_)) => {}
            Err(e) => return Err(e),
        }
        sync_volume_files(&self.manager.config().volumes_dir(), &volumes).await;
        Ok(())
    }

    /// Starts the paused VM again from its pause's save (a VM that runs
    /// already just has its expiry moved).
    async fn resume(
        &self,
        id: &str,
        expires_at: OffsetDateTime,
        egress: Egress,
        volumes: Vec<VmVolume>,
    ) -> VmResult<()> {
        let _one_at_a_time = self.saving.lock().await;
        if matches!(LocalVms::state(self, id), Some(VmState::Running)) {
            self.manager.set_expiry(id, expires_at)?;
            return self.ensure_egress(id, egress).await;
        }
        let name = paused_name(id);
        let saved = self.manager.saved(&name)?;
        // What is left of a VM that died is no obstacle (but its saved
        // state is what resumes).
        self.replace_from_snapshot(id, &saved.record.size, &name, expires_at, egress, volumes)
            .await?;
        self.manager.delete_saved(&name).await
    }

    fn restored(&self, id: &str) -> Option<bool> {
        self.manager.record(id).ok().map(|r| r.template.is_some())
    }

    async fn state(&self, id: &str) -> VmResult<Option<VmState>> {
        Ok(LocalVms::state(self, id))
    }

    async fn exec(&self, id: &str, request: ExecRequest) -> VmResult<Box<dyn Command>> {
        let live = self.manager.hold_background();
        let handle = self.agent(id).await?.exec(request)?;
        Ok(Box::new(LocalCommand {
            handle,
            _live: live,
        }))
    }

    async fn attach(
        &self,
        id: &str,
        pid: u32,
        max_output_bytes: u64,
        longest: std::time::Duration,
    ) -> VmResult<Box<dyn Command>> {
        let live = self.manager.hold_background();
        let handle = self
            .agent(id)
            .await?
            .attach(pid, max_output_bytes, longest)?;
        Ok(Box::new(LocalCommand {
            handle,
            _live: live,
        }))
    }

    async fn processes(&self, id: &str) -> VmResult<Vec<sandpit_protocol::ProcessInfo>> {
        self.agent(id).await?.processes().await
    }

    async fn stats(&self, id: &str) -> VmResult<sandpit_protocol::GuestStats> {
        self.agent(id).await?.stats().await
    }

    async fn process_call(
        &self,
        id: &str,
        pid: u32,
        call: sandpit_protocol::ProcessCall,
        input: Vec<u8>,
    ) -> VmResult<()> {
        self.agent(id).await?.process_call(pid, call, &input).await
    }

    async fn upload(&self, id: &str, path: &str, size: u64) -> VmResult<Box<dyn Upload>> {
        let live = self.manager.hold_background();
        let upload = self.agent(id).await?.upload(path, size, None)?;
        Ok(Box::new(LocalUpload {
            upload,
            _live: live,
        }))
    }

    async fn download(&self, id: &str, path: &str, max_bytes: u64) -> VmResult<Box<dyn Download>> {
        let live = self.manager.hold_background();
        let download = self.agent(id).await?.download(path, max_bytes).await?;
        Ok(Box::new(LocalDownload {
            download,
            _live: live,
        }))
    }

    async fn write_file(&self, id: &str, path: &str, bytes: Vec<u8>) -> VmResult<(String, u64)> {
        let _live = self.manager.hold_background();
        self.agent(id).await?.write_file(path, &bytes, None).await
    }

    async fn read_file(&self, id: &str, path: &str, max_bytes: u64) -> VmResult<(String, Vec<u8>)> {
        let _live = self.manager.hold_background();
        self.agent(id).await?.read_file(path, max_bytes).await
    }

    async fn list_files(
        &self,
        id: &str,
        path: &str,
        recursive: bool,
        max_entries: u64,
    ) -> VmResult<Listing> {
        let (path, entries, truncated) = self
            .agent(id)
            .await?
            .list_files(path, recursive, max_entries)
            .await?;
        Ok(Listing {
            path,
            entries,
            truncated,
        })
    }

    async fn delete_file(&self, id: &str, path: &str, recursive: bool) -> VmResult<String> {
        self.agent(id).await?.delete_file(path, recursive).await
    }

    async fn path_call(
        &self,
        id: &str,
        call: sandpit_protocol::PathCall,
    ) -> VmResult<sandpit_protocol::PathEntry> {
        self.agent(id).await?.path_call(call).await
    }

    async fn watch_dir(&self, id: &str, path: &str, recursive: bool) -> VmResult<Box<dyn Watch>> {
        let watch = self.agent(id).await?.watch_dir(path, recursive).await?;
        Ok(Box::new(LocalWatch(watch)))
    }

    async fn open_tunnel(&self, id: &str, port: u16) -> VmResult<Tunnel> {
        let stream = self.agent(id).await?.open_tunnel(port).await?;
        let closer = stream.closer();
        Ok(Tunnel {
            stream: Box::new(stream),
            closer: Arc::new(move || closer.close()),
        })
    }

    async fn open_pty(&self, id: &str, size: PtySize) -> VmResult<Terminal> {
        let pty = self.agent(id).await?.open_pty(size).await?;
        Ok(Terminal::over(pty))
    }
}
