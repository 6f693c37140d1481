//! A save carried whole to another host, and received there: what a
//! sandbox from a template needs on a node of a cluster that did not build
//! the template.
//!
//! A save is more than its directory: its disk stands on a chain of layers,
//! the last one on the snapshot template of its size, and its RAM is a
//! difference to that template's RAM file, through a chain of saved RAM
//! files (see `layers`, `ram_pages`). Every host builds its templates
//! itself, and two builds of the same inputs differ byte for byte (a
//! guest's memory after a boot is never the same twice), so a save is good
//! only with the very template it was made on: the sender carries that
//! template too, and the receiver keeps it beside its own as
//! `<size>-<key>-<identity>`, the identity being a hash of the template's
//! `template.json` (which records the moment of its build). Such a
//! template is marked outdated from the start: it goes once no save or VM
//! names it (`template::remove_outdated`).
//!
//! A part the receiver holds already (a template of that identity, a layer
//! of that name: layer names are random and their files never change) is
//! not sent again; the receiver says what it holds first
//! ([`VmManager::held_parts`]).
//!
//! The stream is one line of JSON ([`Manifest`]: the save's record, the
//! template's record, the layers the save stands on, and the head of each
//! file that follows), then each file's data, extent by extent: holes are
//! not sent (a template's RAM file is gigabytes long with a few hundred
//! MiB written).
//!
//! The receiver writes everything into a locked temporary directory of its
//! saves (what a save being made uses, so a host that dies mid-way leaves
//! it to its next start to remove), points each disk file's backing file at
//! its own paths (`qemu-img rebase -u`: qcow2 headers name the file below
//! by absolute path, and another host's data and images directories may be
//! elsewhere), and then, under the layers' lock, moves the layers and the
//! template into place and the save last, so the collection never sees a
//! layer without the save that names it, nor a save without its layers.

use crate::save::layers;
use crate::save::saved::{write_saved_record, SavedRecord, SavedVm, Unfinished};
use crate::save::template::{self, TemplateInputs, TemplateRecord};
use crate::vm::validate_id;
use crate::{Result, RuntimeError, VmManager};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::HashSet;
use std::fs::File;
use std::io::{BufRead, Read};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use tokio::sync::mpsc;

/// The longest manifest a receiver reads (a fragmented RAM file's extents
/// are most of it).
const MAX_MANIFEST: u64 = 64 << 20;
/// The pieces the sender reads and sends.
const PIECE: usize = 1 << 20;

/// What a host holds that a save sent to it need not carry: a template
/// (`template:<identity>`) or a layer (`layer:<file name>`).
fn template_part(identity: &str) -> String {
    format!("template:{identity}")
}

fn layer_part(name: &str) -> String {
    format!("layer:{name}")
}

/// A template's identity: the first 8 bytes of the SHA-256 of its
/// `template.json`, in hex (16 digits, like a key).
fn identity_of(record: &[u8]) -> String {
    hex::encode(&Sha256::digest(record)[..8])
}

/// Where a sent file goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Place {
    /// The template's directory.
    Template,
    /// The layers directory.
    Layer,
    /// The save's own directory.
    Save,
}

/// A file the stream carries.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct FileHead {
    place: Place,
    name: String,
    /// Its length (holes included).
    len: u64,
    mode: u32,
    /// Its data as (offset, length), in order; the rest is holes.
    extents: Vec<(u64, u64)>,
}

/// The stream's first line.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Manifest {
    /// The save's record as the sender has it.
    save: SavedRecord,
    /// The template's `template.json`, as its bytes (its identity is their
    /// hash).
    template: String,
    /// Every layer the save stands on (its disk's chain, then its RAM's).
    layers: Vec<String>,
    /// The files that follow, in order.
    files: Vec<FileHead>,
}

/// A save being sent: [`SaveSending::size`] bytes in pieces.
pub struct SaveSending {
    size: u64,
    pieces: mpsc::Receiver<Result<Vec<u8>>>,
}

impl SaveSending {
    /// The whole stream's length.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The next piece; `None` after the last.
    pub async fn next_piece(&mut self) -> Result<Option<Vec<u8>>> {
        self.pieces.recv().await.transpose()
    }
}

/// A save being received; dropped before [`SaveReceiving::finish`], what
/// came is discarded.
pub struct SaveReceiving {
    name: String,
    size: u64,
    got: u64,
    pieces: Option<mpsc::Sender<Vec<u8>>>,
    task: tokio::task::JoinHandle<Result<u64>>,
}

impl SaveReceiving {
    /// The next bytes of the stream.
    pub async fn send(&mut self, data: &[u8]) -> Result<()> {
        self.got += data.len() as u64;
        if self.got > self.size {
            return Err(RuntimeError::Launch(format!(
                "the save {} sent more than the {} bytes announced",
                self.name, self.size
            )));
        }
        let sent = match &self.pieces {
            Some(tx) => tx.send(data.to_vec()).await.is_ok(),
            None => false,
        };
        if !sent {
            // The receiver stopped: its outcome says why.
            self.pieces = None;
            return Err(match (&mut self.task).await {
                Ok(Err(e)) => e,
                _ => RuntimeError::Launch(format!("receiving the save {} stopped", self.name)),
            });
        }
        Ok(())
    }

    /// Waits for the save to be in place; returns what it alone takes on
    /// this host's disk (as [`SavedVm::bytes`]).
    pub async fn finish(mut self) -> Result<u64> {
        self.pieces = None;
        if self.got != self.size {
            return Err(RuntimeError::Launch(format!(
                "the save {} came with {} of its {} bytes",
                self.name, self.got, self.size
            )));
        }
        (&mut self.task)
            .await
            .map_err(|e| RuntimeError::Launch(format!("the task receiving the save failed: {e}")))?
    }
}

/// What the receiving task needs of this host.
struct Destination {
    name: String,
    unfinished: Unfinished,
    final_dir: PathBuf,
    layers_dir: PathBuf,
    templates_dir: PathBuf,
    layers_lock: PathBuf,
    /// This host's inputs of each size it has.
    inputs: Vec<TemplateInputs>,
    /// The image's disk, which templates' disks stand on.
    rootfs: PathBuf,
    tsc_khz: u32,
}

impl VmManager {
    /// What this host holds that a save sent here need not carry (see
    /// [`VmManager::send_saved`]).
    pub fn held_parts(&self) -> Vec<String> {
        let mut parts: Vec<String> = templates_by_identity(&self.templates_dir())
            .into_iter()
            .map(|(identity, _)| template_part(&identity))
            .collect();
        if let Ok(rd) = std::fs::read_dir(self.layers_dir()) {
            parts.extend(
                rd.flatten()
                    .filter_map(|e| e.file_name().into_string().ok())
                    .filter(|n| layers::is_layer_name(n))
                    .map(|n| layer_part(&n)),
            );
        }
        parts.sort();
        parts
    }

    /// Save `name` as a stream for another host that holds `held` (what
    /// its [`VmManager::held_parts`] said), its files open from now on, so
    /// a save deleted meanwhile is still sent whole.
    pub fn send_saved(&self, name: &str, held: &HashSet<String>) -> Result<SaveSending> {
        let saved = self.saved(name)?;
        let template_record = std::fs::read(saved.template.dir.join(template::RECORD)).map_err(
            RuntimeError::io(format!("reading {}", saved.template.dir.display())),
        )?;
        let identity = identity_of(&template_record);
        let chain = chain_of(&saved, &self.layers_dir())?;
        let mut sent: Vec<(FileHead, File)> = Vec::new();
        let mut add = |place: Place, path: PathBuf| -> Result<()> {
            let file = File::open(&path).map_err(RuntimeError::io(format!(
                "opening {} to send it",
                path.display()
            )))?;
            let meta = file
                .metadata()
                .map_err(RuntimeError::io(format!("reading {}", path.display())))?;
            use std::os::unix::fs::PermissionsExt;
            let head = FileHead {
                place,
                name: file_name(&path)?,
                len: meta.len(),
                mode: meta.permissions().mode() & 0o777,
                extents: extents(&file, meta.len())
                    .map_err(RuntimeError::io(format!("reading {}", path.display())))?,
            };
            sent.push((head, file));
            Ok(())
        };
        if !held.contains(&template_part(&identity)) {
            for f in [
                template::MEM,
                template::STATE,
                template::DISK,
                template::KERNEL_STUB,
            ] {
                add(Place::Template, saved.template.dir.join(f))?;
            }
        }
        for layer in &chain {
            if !held.contains(&layer_part(layer)) {
                add(Place::Layer, self.layers_dir().join(layer))?;
            }
        }
        add(Place::Save, saved.state())?;
        let manifest = Manifest {
            save: saved.record.clone(),
            template: String::from_utf8(template_record).map_err(|_| {
                RuntimeError::Launch(format!(
                    "the template of the save {name} has a corrupt record"
                ))
            })?,
            layers: chain,
            files: sent.iter().map(|(h, _)| h.clone()).collect(),
        };
        let mut line = serde_json::to_vec(&manifest).expect("json");
        line.push(b'\n');
        let size = line.len() as u64
            + sent
                .iter()
                .flat_map(|(h, _)| h.extents.iter().map(|e| e.1))
                .sum::<u64>();
        let (tx, rx) = mpsc::channel(4);
        std::thread::spawn(move || {
            if tx.blocking_send(Ok(line)).is_err() {
                return;
            }
            for (head, file) in sent {
                for &(offset, len) in &head.extents {
                    let mut at = offset;
                    while at < offset + len {
                        let n = ((offset + len - at) as usize).min(PIECE);
                        let mut piece = vec![0u8; n];
                        let read =
                            file.read_exact_at(&mut piece, at)
                                .map_err(RuntimeError::io(format!(
                                    "reading {} to send it",
                                    head.name
                                )));
                        let failed = read.is_err();
                        if tx.blocking_send(read.map(|()| piece)).is_err() || failed {
                            return;
                        }
                        at += n as u64;
                    }
                }
            }
        });
        Ok(SaveSending { size, pieces: rx })
    }

    /// Receives, as save `name`, the `size` bytes another host's
    /// [`VmManager::send_saved`] makes. The save exists once
    /// [`SaveReceiving::finish`] returned.
    pub async fn receive_saved(&self, name: &str, size: u64) -> Result<SaveReceiving> {
        validate_id(name).map_err(|_| {
            RuntimeError::Launch(format!(
                "{name:?} cannot name a save: 1 to 64 letters, digits, '_' and '-'"
            ))
        })?;
        if !self.snapshots_supported() {
            return Err(RuntimeError::Launch(
                "this host has snapshots off, or a QEMU too old for them: it cannot start \
                 another host's saves"
                    .into(),
            ));
        }
        let final_dir = self.saves_dir().join(name);
        if final_dir.exists() {
            return Err(RuntimeError::Launch(format!("a save named {name} exists")));
        }
        let destination = Destination {
            name: name.to_string(),
            unfinished: Unfinished::create(self, name).await?,
            final_dir,
            layers_dir: self.layers_dir(),
            templates_dir: std::path::absolute(self.templates_dir())
                .unwrap_or_else(|_| self.templates_dir()),
            layers_lock: self.layers_lock(),
            inputs: self
                .config()
                .sizes
                .iter()
                .map(|(n, s)| self.template_inputs(n, *s))
                .collect(),
            rootfs: self.image().rootfs.clone(),
            tsc_khz: crate::host::accel::host_tsc_khz(),
        };
        let (tx, rx) = mpsc::channel::<Vec<u8>>(4);
        let task = tokio::task::spawn_blocking(move || {
            receive(
                destination,
                Pieces {
                    rx,
                    piece: Vec::new(),
                    at: 0,
                },
            )
        });
        Ok(SaveReceiving {
            name: name.to_string(),
            size,
            got: 0,
            pieces: Some(tx),
            task,
        })
    }
}

/// The layers a save stands on: its disk's chain down to its template's
/// disk, then its RAM's.
fn chain_of(saved: &SavedVm, layers_dir: &Path) -> Result<Vec<String>> {
    let canonical = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
    let layers_dir = canonical(layers_dir);
    let template_disk = canonical(&saved.template.disk());
    let broken = |why: String| RuntimeError::Launch(format!("the save {}: {why}", saved.name));
    let mut chain = Vec::new();
    let mut file = saved.disk();
    loop {
        if canonical(&file) == template_disk {
            break;
        }
        if file.parent().map(canonical) != Some(layers_dir.clone()) {
            return Err(broken(format!(
                "its disk stands on {}, which is neither a layer nor its template's disk",
                file.display()
            )));
        }
        chain.push(file_name(&file)?);
        if chain.len() > 64 {
            return Err(broken("its disk's chain is too long".into()));
        }
        file = layers::backing_file(&file)
            .map_err(RuntimeError::io(format!("reading {}", file.display())))?
            .ok_or_else(|| broken(format!("{} stands on nothing", file.display())))?;
    }
    let mut ram = saved.ram();
    while let Some(file) = ram {
        chain.push(file_name(&file)?);
        if chain.len() > 128 {
            return Err(broken("its RAM's chain is too long".into()));
        }
        ram = crate::save::ram_pages::parent_of(&file)
            .map_err(RuntimeError::io(format!("reading {}", file.display())))?;
    }
    Ok(chain)
}

fn file_name(path: &Path) -> Result<String> {
    path.file_name()
        .and_then(|n| n.to_str())
        .map(str::to_string)
        .ok_or_else(|| RuntimeError::Launch(format!("{} has no file name", path.display())))
}

/// The data of `file` (of `len` bytes) as (offset, length) extents, by
/// `SEEK_DATA` and `SEEK_HOLE`; the whole file where the file system
/// cannot tell.
pub(crate) fn extents(file: &File, len: u64) -> std::io::Result<Vec<(u64, u64)>> {
    use std::os::fd::AsRawFd;
    let fd = file.as_raw_fd();
    let mut out = Vec::new();
    let mut at: u64 = 0;
    while at < len {
        // SAFETY: lseek(2) on an fd `file` owns.
        let data = unsafe { libc::lseek(fd, at as libc::off_t, libc::SEEK_DATA) };
        if data < 0 {
            let e = std::io::Error::last_os_error();
            return match e.raw_os_error() {
                // No data after `at`: the rest is a hole.
                Some(libc::ENXIO) => Ok(out),
                Some(libc::EINVAL) if at == 0 => Ok(vec![(0, len)]),
                _ => Err(e),
            };
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
        if hole < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let (data, hole) = (data as u64, (hole as u64).min(len));
        if hole > data {
            out.push((data, hole - data));
        }
        at = hole.max(data + 1);
    }
    Ok(out)
}

/// The finished templates in `dir` by identity (with their directories).
fn templates_by_identity(dir: &Path) -> Vec<(String, PathBuf)> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    rd.flatten()
        .filter(|e| !e.file_name().to_string_lossy().starts_with('.'))
        .filter(|e| template::load_any(&e.path()).is_some())
        .filter_map(|e| {
            let record = std::fs::read(e.path().join(template::RECORD)).ok()?;
            Some((identity_of(&record), e.path()))
        })
        .collect()
}

/// The stream's bytes, as the receiving task reads them.
struct Pieces {
    rx: mpsc::Receiver<Vec<u8>>,
    piece: Vec<u8>,
    at: usize,
}

impl Read for Pieces {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        while self.at == self.piece.len() {
            match self.rx.blocking_recv() {
                Some(p) => (self.piece, self.at) = (p, 0),
                None => return Ok(0),
            }
        }
        let n = buf.len().min(self.piece.len() - self.at);
        buf[..n].copy_from_slice(&self.piece[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }
}

/// Is `name` a save's state file name (`<128-bit hex>.state`)?
fn is_state_name(name: &str) -> bool {
    name.strip_suffix(".state")
        .is_some_and(|h| h.len() == 32 && h.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// Does the received `head` name a file its place may hold?
fn check_head(head: &FileHead, manifest: &Manifest) -> Result<()> {
    let allowed = match head.place {
        Place::Template => [
            template::MEM,
            template::STATE,
            template::DISK,
            template::KERNEL_STUB,
        ]
        .contains(&head.name.as_str()),
        Place::Layer => layers::is_layer_name(&head.name) && manifest.layers.contains(&head.name),
        Place::Save => is_state_name(&head.name) && head.name == manifest.save.state,
    };
    let mut end = 0;
    let ordered = head.extents.iter().all(|&(offset, len)| {
        let ok = offset >= end && offset.checked_add(len).is_some_and(|e| e <= head.len);
        end = offset.saturating_add(len);
        ok
    });
    if !allowed || !ordered {
        return Err(RuntimeError::Launch(format!(
            "a received save names a file it may not ({:?} {:?}) or data outside it",
            head.place, head.name
        )));
    }
    Ok(())
}

/// The receiving task: the stream read, checked, written and put in
/// place; returns what the save alone takes.
fn receive(dest: Destination, pieces: Pieces) -> Result<u64> {
    let bad =
        |why: String| RuntimeError::Launch(format!("receiving the save {}: {why}", dest.name));
    let mut reader = std::io::BufReader::with_capacity(PIECE, pieces);
    let mut line = Vec::new();
    (&mut reader)
        .take(MAX_MANIFEST)
        .read_until(b'\n', &mut line)
        .map_err(|e| bad(e.to_string()))?;
    let manifest: Manifest = serde_json::from_slice(&line).map_err(|e| {
        bad(format!(
            "its manifest: {e} (is the sender the same Sandpit?)"
        ))
    })?;
    let mut record = manifest.save.clone();
    let template_record: TemplateRecord = serde_json::from_str(&manifest.template)
        .map_err(|e| bad(format!("its template's record: {e}")))?;
    let inputs = &template_record.inputs;
    // The save's template, made on the sender, must be one this host would
    // make itself (image, QEMU, accelerator, size, configuration): else
    // its VMs would not restore here.
    if record.size != inputs.size || !dest.inputs.contains(inputs) {
        return Err(bad(format!(
            "it was made on a {} template of another image, QEMU, accelerator or \
             configuration than this host's",
            inputs.size
        )));
    }
    if inputs.accel == crate::Accel::Tcg {
        let drift = (template_record.tsc_khz as f64 - dest.tsc_khz as f64).abs()
            / f64::from(dest.tsc_khz.max(1));
        if drift > 0.0005 {
            return Err(bad(format!(
                "its template's guest runs at {} kHz, this host's TSC at {} kHz",
                template_record.tsc_khz, dest.tsc_khz
            )));
        }
    }
    for name in [Some(&record.layer), record.ram.as_ref()]
        .into_iter()
        .flatten()
    {
        if !manifest.layers.contains(name) {
            return Err(bad(format!("its layer {name} is not in its chain")));
        }
    }
    if manifest.layers.iter().any(|l| !layers::is_layer_name(l)) || !is_state_name(&record.state) {
        return Err(bad("it names files it may not".into()));
    }
    let identity = identity_of(manifest.template.as_bytes());
    // Where its template is, or goes: this host's own directory of that
    // identity, or `<size>-<key>-<identity>`.
    let template_dir = templates_by_identity(&dest.templates_dir)
        .into_iter()
        .find(|(i, _)| *i == identity)
        .map(|(_, dir)| dir)
        .unwrap_or_else(|| {
            dest.templates_dir.join(template::dir_name(
                &inputs.size,
                &format!("{}-{identity}", inputs.key()),
            ))
        });
    let tmp = dest.unfinished.path.clone();
    let tmp_template = tmp.join("template");
    let tmp_layers = tmp.join("layers");
    for d in [&tmp_template, &tmp_layers] {
        std::fs::create_dir(d).map_err(RuntimeError::io(format!("creating {}", d.display())))?;
    }
    let mut sent_template = false;
    let mut sent_layers = Vec::new();
    for head in &manifest.files {
        check_head(head, &manifest).map_err(|e| bad(e.to_string()))?;
        let path = match head.place {
            Place::Template => {
                sent_template = true;
                tmp_template.join(&head.name)
            }
            Place::Layer => {
                sent_layers.push(head.name.clone());
                tmp_layers.join(&head.name)
            }
            Place::Save => tmp.join(&head.name),
        };
        write_file(&mut reader, &path, head).map_err(|e| bad(e.to_string()))?;
    }
    let mut rest = [0u8; 1];
    if reader.read(&mut rest).map_err(|e| bad(e.to_string()))? != 0 {
        return Err(bad("more bytes than its manifest announced".into()));
    }
    if sent_template {
        std::fs::write(tmp_template.join(template::RECORD), &manifest.template)
            .map_err(RuntimeError::io("writing the template's record"))?;
        std::fs::write(tmp_template.join(template::OUTDATED), b"")
            .map_err(RuntimeError::io("marking the template"))?;
        rebase(&tmp_template.join(template::DISK), &dest.rootfs)?;
    }
    // Each disk layer onto this host's files: a layer, or the template's
    // disk.
    for name in sent_layers.iter().filter(|n| n.ends_with(".qcow2")) {
        let path = tmp_layers.join(name);
        let below = layers::backing_file(&path)
            .map_err(RuntimeError::io(format!("reading {}", path.display())))?
            .ok_or_else(|| bad(format!("its layer {name} stands on nothing")))?;
        let below_name = file_name(&below)?;
        let here = if layers::is_layer_name(&below_name) {
            dest.layers_dir.join(below_name)
        } else if below_name == template::DISK {
            template_dir.join(template::DISK)
        } else {
            return Err(bad(format!(
                "its layer {name} stands on {}",
                below.display()
            )));
        };
        rebase(&path, &here)?;
    }
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&tmp_template, std::fs::Permissions::from_mode(0o755))
        .map_err(RuntimeError::io("chmod the template"))?;
    // In place, all at once for the collection.
    let _lock = layers::lock_blocking(&dest.layers_lock)?;
    if template::load_any(&template_dir).is_none() {
        if !sent_template {
            return Err(RuntimeError::Busy(format!(
                "the template the save {} stands on went from this host meanwhile; send it again",
                dest.name
            )));
        }
        let _ = std::fs::remove_dir_all(&template_dir);
        std::fs::rename(&tmp_template, &template_dir).map_err(RuntimeError::io(format!(
            "placing {}",
            template_dir.display()
        )))?;
    }
    for name in &sent_layers {
        let to = dest.layers_dir.join(name);
        if !to.exists() {
            std::fs::rename(tmp_layers.join(name), &to)
                .map_err(RuntimeError::io(format!("placing the layer {name}")))?;
        }
    }
    if let Some(missing) = manifest
        .layers
        .iter()
        .find(|l| !dest.layers_dir.join(l).is_file())
    {
        return Err(RuntimeError::Busy(format!(
            "the layer {missing} the save {} stands on went from this host meanwhile; send it \
             again",
            dest.name
        )));
    }
    let dir_name = file_name(&template_dir)?;
    record.template = dir_name
        .strip_prefix(&format!("{}-", record.size))
        .ok_or_else(|| bad(format!("its template's directory {dir_name}")))?
        .to_string();
    let _ = std::fs::remove_dir_all(&tmp_template);
    let _ = std::fs::remove_dir_all(&tmp_layers);
    write_saved_record(&tmp, &record)?;
    dest.unfinished.finish(&dest.final_dir, &dest.name)?;
    use std::os::unix::fs::MetadataExt;
    Ok([
        dest.layers_dir.join(&record.layer),
        dest.final_dir.join(&record.state),
    ]
    .into_iter()
    .chain(record.ram.as_ref().map(|r| dest.layers_dir.join(r)))
    .filter_map(|f| std::fs::metadata(f).ok())
    .map(|m| m.blocks() * 512)
    .sum())
}

/// Writes `head`'s file at `path` from the stream.
fn write_file(reader: &mut impl Read, path: &Path, head: &FileHead) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let file = File::create(path)?;
    file.set_len(head.len)?;
    let mut buf = vec![0u8; PIECE];
    for &(offset, len) in &head.extents {
        let mut at = offset;
        while at < offset + len {
            let n = ((offset + len - at) as usize).min(PIECE);
            reader.read_exact(&mut buf[..n])?;
            file.write_all_at(&buf[..n], at)?;
            at += n as u64;
        }
    }
    file.sync_all()?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(head.mode & 0o755))
}

/// Points qcow2 image `image`'s backing file at `below` (unsafe mode: the
/// header alone changes, `below` holds the same data), unless it names it
/// already.
fn rebase(image: &Path, below: &Path) -> Result<()> {
    let now = layers::backing_file(image)
        .map_err(RuntimeError::io(format!("reading {}", image.display())))?;
    if now.as_deref() == Some(below) {
        return Ok(());
    }
    let out = std::process::Command::new("qemu-img")
        .args(["rebase", "-u", "-f", "qcow2", "-F", "qcow2", "-b"])
        .arg(below)
        .arg(image)
        .output()
        .map_err(RuntimeError::spawn("qemu-img", "qemu-utils", "qemu-img"))?;
    if !out.status.success() {
        return Err(RuntimeError::Launch(format!(
            "qemu-img rebase {}: {}",
            image.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extents_skip_holes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let f = File::create(&path).unwrap();
        f.set_len(64 << 20).unwrap();
        f.write_all_at(&[1u8; 4096], 8 << 20).unwrap();
        f.write_all_at(&[2u8; 4096], 32 << 20).unwrap();
        f.sync_all().unwrap();
        let found = extents(&File::open(&path).unwrap(), 64 << 20).unwrap();
        let data: u64 = found.iter().map(|e| e.1).sum();
        // Both pieces, and far less than the file (the file system may
        // round to its blocks).
        assert!(found
            .iter()
            .any(|&(o, l)| o <= 8 << 20 && o + l >= (8 << 20) + 4096));
        assert!(found
            .iter()
            .any(|&(o, l)| o <= 32 << 20 && o + l >= (32 << 20) + 4096));
        assert!(data < 4 << 20, "{found:?}");
    }

    #[test]
    fn a_head_may_name_only_its_places_files() {
        let manifest = Manifest {
            save: SavedRecord {
                from: "v".into(),
                size: "small".into(),
                template: "0123456789abcdef".into(),
                layer: format!("{}.qcow2", "a".repeat(32)),
                state: format!("{}.state", "b".repeat(32)),
                ram: Some(format!("{}.ram", "c".repeat(32))),
                changed_pages: 0,
                created_at: time::OffsetDateTime::UNIX_EPOCH,
                machine_id: None,
                volumes: Vec::new(),
            },
            template: String::new(),
            layers: vec![
                format!("{}.qcow2", "a".repeat(32)),
                format!("{}.ram", "c".repeat(32)),
            ],
            files: Vec::new(),
        };
        let head = |place, name: &str, extents: Vec<(u64, u64)>| FileHead {
            place,
            name: name.to_string(),
            len: 100,
            mode: 0o644,
            extents,
        };
        let ok = |h: FileHead| check_head(&h, &manifest).is_ok();
        assert!(ok(head(Place::Template, "mem", vec![(0, 10), (20, 80)])));
        assert!(!ok(head(Place::Template, "../etc/passwd", vec![])));
        assert!(!ok(head(Place::Template, "template.json", vec![])));
        assert!(ok(head(Place::Layer, &manifest.layers[0], vec![])));
        // A layer name not in the chain, or none at all.
        assert!(!ok(head(
            Place::Layer,
            &format!("{}.qcow2", "d".repeat(32)),
            vec![]
        )));
        assert!(!ok(head(Place::Layer, "x.qcow2", vec![])));
        assert!(ok(head(Place::Save, &manifest.save.state, vec![])));
        assert!(!ok(head(Place::Save, "saved.json", vec![])));
        // Data past the end, or out of order.
        assert!(!ok(head(Place::Template, "mem", vec![(90, 20)])));
        assert!(!ok(head(Place::Template, "mem", vec![(50, 10), (0, 10)])));
        assert!(!ok(head(Place::Template, "mem", vec![(u64::MAX, 2)])));
    }
}
