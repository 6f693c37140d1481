//! A volume's files sent and received by this host ([`Machines::volume_upload`],
//! [`Machines::volume_download`]): the bytes pass through an anonymous
//! scratch file beside the volumes, so that the volume is read or changed
//! in one step by `sandpit_runtime::volume_content`, never while a caller
//! is still sending or reading. And a whole volume's file on its way to or
//! from another node ([`Machines::send_volume`], [`Machines::receive_volume`],
//! `sandpit_runtime::volume_transfer`).
//!
//! [`Machines::volume_upload`]: crate::machines::Machines::volume_upload
//! [`Machines::volume_download`]: crate::machines::Machines::volume_download
//! [`Machines::send_volume`]: crate::machines::Machines::send_volume
//! [`Machines::receive_volume`]: crate::machines::Machines::receive_volume

use crate::machines::{Download, Ownership, Upload, VmResult};
use async_trait::async_trait;
use sandpit_protocol::{AgentError, ErrorKind};
use sandpit_runtime::volume_content::append;
use sandpit_runtime::volume_files::VolumeFiles;
use sandpit_runtime::RuntimeError;
use tokio::io::AsyncReadExt;

/// The most bytes one piece of a download carries.
const PIECE_BYTES: usize = 256 * 1024;

/// A file on its way into a volume.
pub(crate) struct VolumeUploading {
    files: VolumeFiles,
    id: String,
    path: String,
    size: u64,
    owner: Ownership,
    overwrite: bool,
    scratch: std::fs::File,
    received: u64,
}

impl VolumeUploading {
    pub(crate) fn new(
        files: VolumeFiles,
        id: &str,
        path: &str,
        size: u64,
        owner: Ownership,
        overwrite: bool,
    ) -> VmResult<VolumeUploading> {
        // Refused before any byte is taken: a path that cannot be, a
        // volume that is not here.
        sandpit_runtime::volume_content::check_path(path)?;
        if !files.path(id)?.exists() {
            return Err(RuntimeError::NotFound(format!("volume {id}")));
        }
        Ok(VolumeUploading {
            scratch: files.scratch_file()?,
            files,
            id: id.into(),
            path: path.into(),
            size,
            owner,
            overwrite,
            received: 0,
        })
    }
}

fn wrong_length(received: u64, size: u64) -> RuntimeError {
    RuntimeError::Agent(AgentError::new(
        ErrorKind::InvalidRequest,
        format!("the upload brought {received} bytes, not the {size} it announced"),
    ))
}

#[async_trait]
impl Upload for VolumeUploading {
    async fn send(&mut self, data: &[u8]) -> VmResult<()> {
        self.received += data.len() as u64;
        if self.received > self.size {
            return Err(wrong_length(self.received, self.size));
        }
        let scratch = self
            .scratch
            .try_clone()
            .map_err(RuntimeError::io("an upload's scratch file"))?;
        let data = data.to_vec();
        tokio::task::spawn_blocking(move || append(&scratch, &data))
            .await
            .map_err(|e| RuntimeError::Launch(format!("an upload's writer: {e}")))?
    }

    async fn finish(self: Box<Self>) -> VmResult<(String, u64)> {
        if self.received != self.size {
            return Err(wrong_length(self.received, self.size));
        }
        let entry = self
            .files
            .write_file(
                &self.id,
                &self.path,
                &self.scratch,
                self.owner,
                self.overwrite,
            )
            .await?;
        Ok((entry.path, entry.size))
    }
}

/// A volume's file on its way out: copied whole to a scratch file first.
pub(crate) struct VolumeDownloading {
    path: String,
    size: u64,
    scratch: tokio::fs::File,
}

impl VolumeDownloading {
    pub(crate) async fn copy(
        files: VolumeFiles,
        id: &str,
        path: &str,
    ) -> VmResult<VolumeDownloading> {
        let scratch = files.scratch_file()?;
        let entry = files.read_file(id, path, &scratch).await?;
        Ok(VolumeDownloading {
            path: entry.path,
            size: entry.size,
            scratch: tokio::fs::File::from_std(scratch),
        })
    }
}

#[async_trait]
impl Download for VolumeDownloading {
    fn path(&self) -> &str {
        &self.path
    }

    fn size(&self) -> u64 {
        self.size
    }

    async fn next_chunk(&mut self) -> VmResult<Option<Vec<u8>>> {
        let mut piece = vec![0u8; PIECE_BYTES];
        let n = self
            .scratch
            .read(&mut piece)
            .await
            .map_err(RuntimeError::io("reading a volume's file copy"))?;
        if n == 0 {
            return Ok(None);
        }
        piece.truncate(n);
        Ok(Some(piece))
    }
}

/// A volume's file on its way to another node.
pub(crate) struct VolumeSending {
    pub(crate) id: String,
    pub(crate) sending: sandpit_runtime::volume_transfer::VolumeSending,
}

#[async_trait]
impl Download for VolumeSending {
    fn path(&self) -> &str {
        &self.id
    }

    fn size(&self) -> u64 {
        self.sending.size()
    }

    async fn next_chunk(&mut self) -> VmResult<Option<Vec<u8>>> {
        self.sending.next_piece().await
    }
}

/// A volume's file coming from another node.
pub(crate) struct VolumeReceiving {
    pub(crate) id: String,
    pub(crate) receiving: Option<sandpit_runtime::volume_transfer::VolumeReceiving>,
}

#[async_trait]
impl Upload for VolumeReceiving {
    async fn send(&mut self, data: &[u8]) -> VmResult<()> {
        let mut receiving = self.receiving.take().expect("not finished");
        let data = data.to_vec();
        let (receiving, sent) = tokio::task::spawn_blocking(move || {
            let sent = receiving.send(&data);
            (receiving, sent)
        })
        .await
        .map_err(|e| RuntimeError::Launch(format!("a volume's receiver: {e}")))?;
        self.receiving = Some(receiving);
        sent
    }

    async fn finish(mut self: Box<Self>) -> VmResult<(String, u64)> {
        let receiving = self.receiving.take().expect("not finished");
        tokio::task::spawn_blocking(move || receiving.finish())
            .await
            .map_err(|e| RuntimeError::Launch(format!("a volume's receiver: {e}")))??;
        Ok((self.id.clone(), 0))
    }
}
