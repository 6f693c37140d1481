//! A volume's file carried whole to another node (`sandpit volume move`),
//! and received there.
//!
//! The stream is one line of JSON ([`Head`]: the file's length and its
//! data's extents), then each extent's bytes in order: holes are not sent,
//! so a 100 GiB volume holding 2 GiB moves 2 GiB (and stays as sparse on
//! its new disk).
//!
//! The receiver writes `<id>.img.making` (what a make in progress writes,
//! so a node that dies mid-way leaves what its sweep removes) and renames
//! it into place only once every byte is there and on disk; dropped before
//! [`VolumeReceiving::finish`], it removes what came. A volume of that id
//! already there is never replaced. The sender reads a file no VM holds
//! and that nothing changes meanwhile: the service's lease sees to it.

use crate::save::transfer::extents;
use crate::volume_files::VolumeFiles;
use crate::{Result, RuntimeError};
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use tokio::sync::mpsc;

/// The pieces the sender reads and sends.
const PIECE: usize = 1 << 20;
/// The longest head a receiver reads (a fragmented file's extents).
const MAX_HEAD: usize = 64 << 20;

/// What comes first: the file's length, and where its data is.
#[derive(Debug, Serialize, Deserialize)]
struct Head {
    bytes: u64,
    /// `(offset, length)`, in order, not overlapping.
    extents: Vec<(u64, u64)>,
}

/// A volume being sent: [`VolumeSending::size`] bytes in pieces.
pub struct VolumeSending {
    size: u64,
    pieces: mpsc::Receiver<Result<Vec<u8>>>,
}

impl VolumeSending {
    /// The whole stream's length.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The next piece; `None` after the last.
    pub async fn next_piece(&mut self) -> Result<Option<Vec<u8>>> {
        self.pieces.recv().await.transpose()
    }
}

/// A volume being received; dropped before [`VolumeReceiving::finish`],
/// what came is removed.
pub struct VolumeReceiving {
    id: String,
    making: PathBuf,
    target: PathBuf,
    dir: PathBuf,
    file: std::fs::File,
    size: u64,
    got: u64,
    head: Vec<u8>,
    /// The extents still to fill, the first one partly.
    extents: Option<VecDeque<(u64, u64)>>,
    finished: bool,
}

fn broken(id: &str, why: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Launch(format!("receiving volume {id}: {why}"))
}

impl VolumeFiles {
    /// Sends volume `id`'s file (see the module's doc).
    pub fn send(&self, id: &str) -> Result<VolumeSending> {
        let path = self.path(id)?;
        let file = std::fs::File::open(&path)
            .map_err(RuntimeError::io(format!("opening {}", path.display())))?;
        let bytes = file
            .metadata()
            .map_err(RuntimeError::io(format!("sizing {}", path.display())))?
            .len();
        let extents = extents(&file, bytes)
            .map_err(RuntimeError::io(format!("mapping {}", path.display())))?;
        let mut head = serde_json::to_vec(&Head {
            bytes,
            extents: extents.clone(),
        })
        .expect("json");
        head.push(b'\n');
        let size = head.len() as u64 + extents.iter().map(|e| e.1).sum::<u64>();
        let (tx, pieces) = mpsc::channel(4);
        std::thread::spawn(move || {
            if tx.blocking_send(Ok(head)).is_err() {
                return;
            }
            for (offset, length) in extents {
                let mut at = offset;
                while at < offset + length {
                    let n = PIECE.min((offset + length - at) as usize);
                    let mut piece = vec![0u8; n];
                    let read = file
                        .read_exact_at(&mut piece, at)
                        .map(|_| piece)
                        .map_err(RuntimeError::io(format!("reading {}", path.display())));
                    let failed = read.is_err();
                    if tx.blocking_send(read).is_err() || failed {
                        return;
                    }
                    at += n as u64;
                }
            }
        });
        Ok(VolumeSending { size, pieces })
    }

    /// Receives volume `id`'s file, a stream of `size` bytes that
    /// [`VolumeFiles::send`] made on another node.
    pub fn receive(&self, id: &str, size: u64) -> Result<VolumeReceiving> {
        let target = self.path(id)?;
        if target.exists() {
            return Err(RuntimeError::Config(format!(
                "volume {id} is on this node already ({})",
                target.display()
            )));
        }
        let dir = self.dir().to_path_buf();
        std::fs::create_dir_all(&dir)
            .map_err(RuntimeError::io(format!("creating {}", dir.display())))?;
        let making = dir.join(format!("{id}.img.making"));
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&making)
            .map_err(RuntimeError::io(format!("creating {}", making.display())))?;
        Ok(VolumeReceiving {
            id: id.to_string(),
            making,
            target,
            dir,
            file,
            size,
            got: 0,
            head: Vec::new(),
            extents: None,
            finished: false,
        })
    }
}

impl VolumeReceiving {
    /// The next bytes of the stream.
    pub fn send(&mut self, mut data: &[u8]) -> Result<()> {
        self.got += data.len() as u64;
        if self.got > self.size {
            return Err(broken(
                &self.id,
                format!("more than the {} bytes announced", self.size),
            ));
        }
        if self.extents.is_none() {
            match data.iter().position(|&b| b == b'\n') {
                None => {
                    self.head.extend_from_slice(data);
                    if self.head.len() > MAX_HEAD {
                        return Err(broken(&self.id, "a head past its bound"));
                    }
                    return Ok(());
                }
                Some(end) => {
                    self.head.extend_from_slice(&data[..end]);
                    data = &data[end + 1..];
                    let head: Head = serde_json::from_slice(&self.head)
                        .map_err(|e| broken(&self.id, format!("its head: {e}")))?;
                    let mut last_end = 0u64;
                    for &(offset, length) in &head.extents {
                        if offset < last_end || offset.saturating_add(length) > head.bytes {
                            return Err(broken(&self.id, "extents out of order or past its end"));
                        }
                        last_end = offset + length;
                    }
                    self.file
                        .set_len(head.bytes)
                        .map_err(RuntimeError::io(format!(
                            "sizing {}",
                            self.making.display()
                        )))?;
                    self.extents = Some(head.extents.into_iter().filter(|e| e.1 > 0).collect());
                }
            }
        }
        let extents = self.extents.as_mut().expect("the head was read");
        while !data.is_empty() {
            let Some((offset, length)) = extents.front_mut() else {
                return Err(broken(&self.id, "bytes past its last extent"));
            };
            let n = (*length).min(data.len() as u64) as usize;
            self.file
                .write_all_at(&data[..n], *offset)
                .map_err(RuntimeError::io(format!(
                    "writing {}",
                    self.making.display()
                )))?;
            *offset += n as u64;
            *length -= n as u64;
            if *length == 0 {
                extents.pop_front();
            }
            data = &data[n..];
        }
        Ok(())
    }

    /// Puts the volume in place once every byte is there and on disk.
    pub fn finish(mut self) -> Result<()> {
        let whole = self.got == self.size && self.extents.as_ref().is_some_and(|e| e.is_empty());
        if !whole {
            return Err(broken(
                &self.id,
                format!("{} of its {} bytes came", self.got, self.size),
            ));
        }
        self.file.sync_all().map_err(RuntimeError::io(format!(
            "syncing {}",
            self.making.display()
        )))?;
        if self.target.exists() {
            return Err(RuntimeError::Config(format!(
                "volume {} appeared on this node while it was received",
                self.id
            )));
        }
        std::fs::rename(&self.making, &self.target).map_err(RuntimeError::io(format!(
            "moving {} into place",
            self.making.display()
        )))?;
        self.finished = true;
        std::fs::File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(RuntimeError::io(format!("syncing {}", self.dir.display())))
    }
}

impl Drop for VolumeReceiving {
    fn drop(&mut self) {
        if !self.finished {
            let _ = std::fs::remove_file(&self.making);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1024 * 1024;

    #[tokio::test]
    async fn a_volume_arrives_whole_and_sparse_and_a_cut_one_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let from = VolumeFiles::new(dir.path().join("a"));
        let to = VolumeFiles::new(dir.path().join("b"));
        from.create("vol_m", 64 * MIB).await.unwrap();
        // Data past the file system's own, far in.
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(from.path("vol_m").unwrap())
            .unwrap();
        f.write_all_at(&[7u8; 3 * 1024 * 1024 + 5], 40 * MIB)
            .unwrap();
        drop(f);
        let original = std::fs::read(from.path("vol_m").unwrap()).unwrap();

        let mut sending = from.send("vol_m").unwrap();
        assert!(
            sending.size() < 32 * MIB,
            "holes were sent: {}",
            sending.size()
        );
        let mut receiving = to.receive("vol_m", sending.size()).unwrap();
        // In odd pieces, as a network cuts them.
        while let Some(piece) = sending.next_piece().await.unwrap() {
            for part in piece.chunks(77_777) {
                receiving.send(part).unwrap();
            }
        }
        receiving.finish().unwrap();
        let moved = to.path("vol_m").unwrap();
        assert!(
            std::fs::read(&moved).unwrap() == original,
            "the copy differs"
        );
        use std::os::unix::fs::MetadataExt;
        assert!(std::fs::metadata(&moved).unwrap().blocks() * 512 < 32 * MIB);
        // Never over one that is there.
        assert!(to.receive("vol_m", 10).is_err());

        // Cut short: nothing is left.
        let mut sending = from.send("vol_m").unwrap();
        let mut receiving = to.receive("vol_n", sending.size()).unwrap();
        receiving
            .send(&sending.next_piece().await.unwrap().unwrap())
            .unwrap();
        assert!(receiving.finish().is_err());
        assert_eq!(to.list().unwrap().len(), 1, "{:?}", to.list().unwrap());
    }
}
