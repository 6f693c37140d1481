//! Files in a sandbox, as the service moves them.
//!
//! Separate because a file transfer is the one call whose content passes
//! through the host's memory: each account has `max_concurrent_transfers`
//! slots, and a transfer holds one until its last byte went (a download's
//! after the call returned). Owns those slots, writing (whole or streamed
//! from the request body), reading (whole or streamed to the client),
//! listing and deleting, with the read limit in the errors they give.

use crate::api::Caller;
use crate::api::Files;
use crate::error::{body_failed, body_length};
use crate::error::{CoreError, ErrorType, Result};
use crate::model::*;
use crate::service::checks::{check_path, check_write_size, write_content};
use crate::service::errors::runtime_error;
use crate::service::Service;
use base64::Engine;
use sandpit_host::machines::Listing;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// How long a file transfer waits for one of its account's slots.
pub const TRANSFER_WAIT: Duration = Duration::from_secs(30);

impl Service {
    /// One of the account's `max_concurrent_transfers` slots for a file
    /// read or write: its content, decoded and in flight, is in memory
    /// until it ends. Waits [`TRANSFER_WAIT`] at most.
    pub(super) async fn transfer_slot(
        &self,
        caller: &Caller,
    ) -> Result<tokio::sync::OwnedSemaphorePermit> {
        let max = self.config.max_concurrent_transfers;
        let slots = {
            let mut all = self.transfers.lock().unwrap();
            // Entries nobody holds (no transfer, no waiter) go, so the map
            // stays as small as the number of accounts transferring now.
            all.retain(|_, s| Arc::strong_count(s) > 1);
            all.entry(caller.account_id.clone())
                .or_insert_with(|| Arc::new(tokio::sync::Semaphore::new(max as usize)))
                .clone()
        };
        match tokio::time::timeout(TRANSFER_WAIT, slots.acquire_owned()).await {
            Ok(Ok(permit)) => Ok(permit),
            _ => Err(CoreError::new(
                ErrorType::RateLimited,
                format!(
                    "this account has {max} file transfers in flight, its most; retry when one ends"
                ),
            )),
        }
    }
}

#[async_trait::async_trait]
impl Files for Service {
    /// The API's `write_file`.
    async fn write_file(&self, caller: &Caller, id: &str, req: WriteFile) -> Result<FileWritten> {
        let _slot = self.transfer_slot(caller).await?;
        let (path, bytes) = write_content(&self.config, req)?;
        let (row, _busy) = self.running(caller, id).await?;
        let machines = self.machines_for(&row).await?;
        let (path, n) = match machines.write_file(&row.id, &path, bytes).await {
            Ok(done) => done,
            Err(e) => return Err(self.agent_failure(&row, e).await),
        };
        Ok(FileWritten { path, bytes: n })
    }

    /// The API's `upload_file`.
    async fn upload_file(
        &self,
        caller: &Caller,
        id: &str,
        path: &str,
        size: u64,
        mut body: Box<dyn crate::api::ByteSource>,
    ) -> Result<FileWritten> {
        check_path(path)?;
        check_write_size(&self.config, size)?;
        let _slot = self.transfer_slot(caller).await?;
        let (row, _busy) = self.running(caller, id).await?;
        let machines = self.machines_for(&row).await?;
        // Dropped on any early return: the guest discards what it had.
        let mut upload = match machines.upload(&row.id, path, size).await {
            Ok(u) => u,
            Err(e) => return Err(self.agent_failure(&row, e).await),
        };
        let mut got = 0u64;
        while let Some(chunk) = body.next_chunk().await {
            let chunk = chunk.map_err(body_failed)?;
            got += chunk.len() as u64;
            if got > size {
                return Err(body_length(got, size));
            }
            if let Err(e) = upload.send(&chunk).await {
                return Err(self.agent_failure(&row, e).await);
            }
        }
        if got != size {
            return Err(body_length(got, size));
        }
        match upload.finish().await {
            Ok((path, bytes)) => Ok(FileWritten { path, bytes }),
            Err(e) => Err(self.agent_failure(&row, e).await),
        }
    }

    /// The API's `download_file`.
    async fn download_file(
        &self,
        caller: &Caller,
        id: &str,
        path: &str,
    ) -> Result<crate::api::FileDownload> {
        check_path(path)?;
        let slot = self.transfer_slot(caller).await?;
        let (row, busy) = self.running(caller, id).await?;
        let machines = self.machines_for(&row).await?;
        let limit = self.config.max_read_bytes;
        let mut download = match machines.download(&row.id, path, limit).await {
            Ok(d) => d,
            Err(e) => return Err(self.read_failure(&row, e).await),
        };
        let (tx, chunks) = mpsc::channel(4);
        let (path, size) = (download.path().to_string(), download.size());
        let me = self.arc_self();
        // Pieces go as fast as the client takes them (four at most wait);
        // the transfer slot is held until the last one went.
        tokio::spawn(async move {
            // The sandbox is in use until the last piece went.
            let _held = (slot, busy);
            loop {
                let piece = match download.next_chunk().await {
                    Ok(Some(piece)) => Ok(piece),
                    Ok(None) => return,
                    Err(e) => Err(match &me {
                        Some(svc) => svc.read_failure(&row, e).await,
                        None => runtime_error(e),
                    }),
                };
                let failed = piece.is_err();
                if tx.send(piece).await.is_err() || failed {
                    return;
                }
            }
        });
        Ok(crate::api::FileDownload { path, size, chunks })
    }

    /// The API's `read_file`.
    async fn read_file(
        &self,
        caller: &Caller,
        id: &str,
        path: &str,
        encoding: Encoding,
    ) -> Result<FileContent> {
        check_path(path)?;
        let _slot = self.transfer_slot(caller).await?;
        let (row, _busy) = self.running(caller, id).await?;
        let machines = self.machines_for(&row).await?;
        let (path, bytes) = match machines
            .read_file(&row.id, path, self.config.max_read_bytes)
            .await
        {
            Ok(read) => read,
            Err(e) => return Err(self.read_failure(&row, e).await),
        };
        let n = bytes.len() as u64;
        let content = match encoding {
            Encoding::Utf8 => String::from_utf8(bytes).map_err(|_| {
                CoreError::invalid(format!(
                    "{path} is not valid UTF-8 text; read it with encoding \"base64\""
                ))
            })?,
            Encoding::Base64 => base64::engine::general_purpose::STANDARD.encode(&bytes),
        };
        Ok(FileContent {
            path,
            content,
            bytes: n,
            encoding,
        })
    }

    /// The API's `list_files`.
    async fn list_files(
        &self,
        caller: &Caller,
        id: &str,
        path: Option<&str>,
        recursive: bool,
    ) -> Result<FileList> {
        let path = path.unwrap_or(sandpit_protocol::WORKSPACE);
        check_path(path)?;
        let (row, _busy) = self.running(caller, id).await?;
        let machines = self.machines_for(&row).await?;
        let Listing {
            path,
            entries,
            truncated,
        } = match machines
            .list_files(&row.id, path, recursive, self.config.max_list_entries)
            .await
        {
            Ok(listed) => listed,
            Err(e) => return Err(self.agent_failure(&row, e).await),
        };
        Ok(FileList {
            path,
            entries: entries
                .into_iter()
                .map(|e| FileEntry {
                    name: e.name,
                    kind: match e.kind {
                        sandpit_protocol::FileKind::File => EntryType::File,
                        sandpit_protocol::FileKind::Dir => EntryType::Dir,
                        sandpit_protocol::FileKind::Symlink => EntryType::Symlink,
                        sandpit_protocol::FileKind::Other => EntryType::Other,
                    },
                    size_bytes: e.size_bytes,
                })
                .collect(),
            truncated,
        })
    }

    /// The API's `delete_file`.
    async fn delete_file(
        &self,
        caller: &Caller,
        id: &str,
        path: &str,
        recursive: bool,
    ) -> Result<FileDeleted> {
        check_path(path)?;
        let (row, _busy) = self.running(caller, id).await?;
        let machines = self.machines_for(&row).await?;
        let path = match machines.delete_file(&row.id, path, recursive).await {
            Ok(path) => path,
            Err(e) => return Err(self.agent_failure(&row, e).await),
        };
        Ok(FileDeleted {
            path,
            deleted: true,
        })
    }

    /// The API's `path_call`.
    async fn path_call(
        &self,
        caller: &Caller,
        id: &str,
        call: sandpit_protocol::PathCall,
    ) -> Result<sandpit_protocol::PathEntry> {
        use sandpit_protocol::PathCall;
        match &call {
            PathCall::Stat { path } | PathCall::MakeDir { path } => check_path(path)?,
            PathCall::Move { from, to } => {
                check_path(from)?;
                check_path(to)?;
            }
        }
        let (row, _busy) = self.running(caller, id).await?;
        let machines = self.machines_for(&row).await?;
        match machines.path_call(&row.id, call).await {
            Ok(entry) => Ok(entry),
            Err(e) => Err(self.agent_failure(&row, e).await),
        }
    }

    async fn watch_dir(
        &self,
        caller: &Caller,
        id: &str,
        path: &str,
        recursive: bool,
    ) -> Result<crate::api::DirWatchStream> {
        check_path(path)?;
        let (row, busy) = self.running(caller, id).await?;
        let machines = self.machines_for(&row).await?;
        let mut watch = match machines.watch_dir(&row.id, path, recursive).await {
            Ok(w) => w,
            Err(e) => return Err(self.agent_failure(&row, e).await),
        };
        let resolved = watch.path().to_string();
        let (tx, events) = mpsc::channel(16);
        let me = self.arc_self();
        tokio::spawn(async move {
            // In use while watched (see `Files::watch_dir`).
            let _busy = busy;
            loop {
                let next = tokio::select! {
                    next = watch.next() => next,
                    // The watcher went: dropping the watch stops it.
                    _ = tx.closed() => return,
                };
                let item = match next {
                    Ok(Some(batch)) => Ok(batch),
                    Ok(None) => return,
                    Err(e) => match &me {
                        Some(me) => Err(me.agent_failure(&row, e).await),
                        None => Err(runtime_error(e)),
                    },
                };
                let last = item.is_err();
                if tx.send(item).await.is_err() || last {
                    return;
                }
            }
        });
        Ok(crate::api::DirWatchStream {
            path: resolved,
            events,
        })
    }
}
