//! A stopped VM's RAM copied out of its QEMU, and copied into another QEMU,
//! page by page, keeping only the pages that differ from what the VM's
//! memory was made from.
//!
//! A sandbox's guest RAM is a private copy-on-write mapping of its
//! template's RAM file (`memory-backend-file,share=off`): a page the guest
//! (or QEMU) never wrote is still the file's page, one it wrote is an
//! anonymous page of the QEMU process. The kernel tells which is which
//! (`/proc/PID/pagemap`: present and not file-backed, or swapped out), so a
//! save reads exactly the written pages (`process_vm_readv`) without asking
//! QEMU to walk and write all of guest RAM, as its `mapped-ram` migration
//! does (4 s for 370 MiB on these hosts, against a few hundred ms here).
//! QEMU's own `xen-save-devices-state` writes the devices alone, next to it.
//!
//! **Chains.** A VM started from a save (or saved before) was last made
//! equal to that save's RAM file, its parent: a page it wrote that still
//! equals the parent's is marked as the parent's and not written again, so
//! ten snapshots of one sandbox store its memory about once. A file names
//! its parent (a file name in the same directory, the layers directory:
//! see `layers`, which keeps a file as long as a chain reaches it).
//!
//! A VM started from a save maps the same template file privately, waits
//! with `-incoming defer`, receives the saved pages here
//! (`process_vm_writev`, before any guest code runs), each from the newest
//! file of the chain that holds it, straight from the files' read-only
//! mappings, and then loads the devices as a migration: every other page
//! is the template's, as it was in the saved VM. QEMU's other writable RAM blocks (the firmware's, a few hundred KiB)
//! are saved whole; read-only ones are rebuilt by QEMU itself. Or, where
//! the host can, it maps an image of the whole block instead (see
//! `ram_image`, built from `Chain::chunks`), and only the other blocks
//! are written: then a page it did not write is the image's, which a
//! [`capture`] told of it (`mapped`) counts as saved, and as the parent's
//! unread where the parent's chain holds it in the same place.
//!
//! The file: a header page (magic, then JSON naming the parent and each
//! block's areas), then per block three bitmaps (bit `i` of host-endian
//! `u64` words is page `i`): the pages that differ from the template, those
//! of them this file holds (the others are the parent's), and of those the
//! ones that are zero; then the bytes of the held pages that are not zero,
//! one after another in page order: a save writes them in a few large
//! writes however scattered they are in the guest, and a load reads them
//! back the same way.

use crate::{Result, RuntimeError};
use serde::{Deserialize, Serialize};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

mod capture;
mod load;

pub use capture::capture;
pub(crate) use load::data_pages;
pub use load::load;
use load::read_bitmap;

/// The page size of QEMU's x86 RAM blocks here.
pub const PAGE: u64 = 4096;

const MAGIC: &[u8; 12] = b"SANDPIT-RAM\n";
/// Bytes before the first block's bitmaps: the magic, the header's length
/// and the header.
const HEADER_BYTES: u64 = PAGE;
const VERSION: u32 = 1;
/// Files in a chain at most: a save of a VM whose chain is this long
/// starts a new one (it holds all its pages), so a load reads few files.
pub const MAX_CHAIN: usize = 8;

/// Bytes moved per `process_vm_readv`/`writev` call, and remote areas per
/// call (the kernel's `IOV_MAX`).
const BATCH_BYTES: usize = 4 << 20;
const BATCH_AREAS: usize = 1024;
/// The largest RAM block saved (what QEMU reports is checked: its bitmaps
/// are allocated whole).
const MAX_BLOCK: u64 = 1 << 40;
/// Pagemap entries read at once (4 MiB of guest RAM each).
const PAGEMAP_CHUNK: u64 = 1024;

const PM_PRESENT: u64 = 1 << 63;
const PM_SWAPPED: u64 = 1 << 62;
const PM_FILE_OR_SHARED: u64 = 1 << 61;

/// One of QEMU's RAM blocks in its process (from `x-query-ramblock`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Block {
    /// QEMU's name for it: a memory backend's id (`ram`), `pc.bios`, ...
    pub name: String,
    /// Bytes in use.
    pub length: u64,
    /// Where it is mapped in QEMU's address space.
    pub hva: u64,
    /// Whether the host mapping is writable (read-only ones are QEMU's own
    /// firmware tables, rebuilt at every start).
    pub writable: bool,
}

/// One block's areas in a RAM file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RamArea {
    pub name: String,
    pub length: u64,
    /// The pages that differ from the template (bit `i`: page `i`).
    pub saved_bitmap: u64,
    /// Of those, the pages this file holds (the others are the parent's).
    pub own_bitmap: u64,
    /// Of those, the pages that are zero (no bytes in the file).
    pub zero_bitmap: u64,
    /// Where the bytes of the held pages that are not zero are, one after
    /// another in page order.
    pub pages_offset: u64,
    pub data_pages: u64,
}

impl RamArea {
    fn pages(&self) -> u64 {
        self.length / PAGE
    }
    fn bitmap_words(&self) -> usize {
        self.pages().div_ceil(64) as usize
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Header {
    version: u32,
    /// The file below, in the same directory.
    parent: Option<String>,
    areas: Vec<RamArea>,
}

/// What a capture wrote.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Captured {
    /// Pages written with their bytes.
    pub data_pages: u64,
    /// Pages marked as zero (no bytes).
    pub zero_pages: u64,
    /// Pages that differ from the template but not from the parent's
    /// (marked as the parent's).
    pub inherited_pages: u64,
}

impl Captured {
    /// The pages that differ from the template.
    pub fn saved_pages(&self) -> u64 {
        self.data_pages + self.zero_pages + self.inherited_pages
    }
}

fn corrupt(what: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Launch(format!("saved RAM: {what}"))
}

/// Parses QEMU's `x-query-ramblock` table (10.0: name, page size in two
/// words, offset, used, total, host address, `rw`/`ro`).
pub fn parse_ramblocks(text: &str) -> Result<Vec<Block>> {
    let hex = |s: &str| {
        u64::from_str_radix(s.trim_start_matches("0x"), 16)
            .map_err(|_| corrupt(format!("QEMU's RAM block table has {s:?} for a number")))
    };
    let mut lines = text.lines();
    if !lines.by_ref().any(|l| l.contains("Block Name")) {
        return Err(corrupt(format!(
            "QEMU's RAM block table is not in the expected form: {text:?}"
        )));
    }
    let mut out = Vec::new();
    for line in lines {
        let t: Vec<&str> = line.split_whitespace().collect();
        if t.is_empty() {
            continue;
        }
        let n = t.len();
        if n < 7 || !matches!(t[n - 1], "rw" | "ro") {
            return Err(corrupt(format!("QEMU's RAM block line {line:?}")));
        }
        out.push(Block {
            name: t[0].to_string(),
            length: hex(t[n - 4])?,
            hva: hex(t[n - 2])?,
            writable: t[n - 1] == "rw",
        });
    }
    Ok(out)
}

/// QEMU's RAM blocks, through its monitor.
pub async fn query_blocks(qmp: &mut crate::vm::qmp::Qmp) -> Result<Vec<Block>> {
    let v = qmp
        .execute("x-query-ramblock", serde_json::json!({}))
        .await?;
    let text = v
        .get("human-readable-text")
        .and_then(|t| t.as_str())
        .ok_or_else(|| corrupt(format!("x-query-ramblock answered {v}")))?;
    parse_ramblocks(text)
}

/// A RAM file and the files below it, newest first, their bitmaps read.
pub struct Chain {
    files: Vec<ChainFile>,
}

struct ChainFile {
    name: String,
    path: PathBuf,
    map: Mapped,
    areas: Vec<AreaBits>,
}

/// A RAM file mapped read-only, so a load hands its pages to the kernel
/// without copying them first. RAM files are complete before any chain
/// opens them and never change after (a removed one stays mapped).
struct Mapped {
    ptr: *const u8,
    len: usize,
}

// SAFETY: a read-only mapping of a file nobody writes, unmapped only on drop.
unsafe impl Send for Mapped {}
unsafe impl Sync for Mapped {}

impl Mapped {
    fn of(file: &File, path: &Path) -> Result<Mapped> {
        use std::os::unix::io::AsRawFd;
        let len = file
            .metadata()
            .map_err(RuntimeError::io(format!("reading {}", path.display())))?
            .len() as usize;
        // SAFETY: a new shared read-only mapping of the whole file.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(RuntimeError::io(format!("mapping {}", path.display()))(
                std::io::Error::last_os_error(),
            ));
        }
        Ok(Mapped {
            ptr: ptr as *const u8,
            len,
        })
    }

    /// The page at `offset`, if the file holds it whole.
    fn page(&self, offset: u64) -> Result<&[u8]> {
        let at = offset as usize;
        if at
            .checked_add(PAGE as usize)
            .is_none_or(|end| end > self.len)
        {
            return Err(corrupt(format!(
                "a page at {offset} is past the file's end"
            )));
        }
        // SAFETY: within the mapping, which lives as long as `self`.
        Ok(unsafe { std::slice::from_raw_parts(self.ptr.add(at), PAGE as usize) })
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        // SAFETY: unmapping what `of` mapped.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
    }
}

static ZERO_PAGE: [u8; PAGE as usize] = [0; PAGE as usize];

/// A block's bitmaps in one file of a chain.
struct AreaBits {
    area: RamArea,
    saved: Vec<u64>,
    own: Vec<u64>,
    zero: Vec<u64>,
    /// Pages with bytes in the file before word `w` of the bitmaps.
    rank: Vec<u64>,
}

fn bit(words: &[u64], page: u64) -> bool {
    words
        .get((page / 64) as usize)
        .is_some_and(|w| w & (1 << (page % 64)) != 0)
}

impl AreaBits {
    fn read(file: &File, area: &RamArea) -> Result<AreaBits> {
        let saved = read_bitmap(file, area, area.saved_bitmap)?;
        let own = read_bitmap(file, area, area.own_bitmap)?;
        let zero = read_bitmap(file, area, area.zero_bitmap)?;
        let mut rank = Vec::with_capacity(own.len());
        let mut before = 0;
        for (o, z) in own.iter().zip(&zero) {
            rank.push(before);
            before += (o & !z).count_ones() as u64;
        }
        if before != area.data_pages {
            return Err(corrupt(format!(
                "block {}'s bitmaps do not match its page count",
                area.name
            )));
        }
        Ok(AreaBits {
            area: area.clone(),
            saved,
            own,
            zero,
            rank,
        })
    }

    /// Where the bytes of held, non-zero `page` are.
    fn offset(&self, page: u64) -> u64 {
        let w = (page / 64) as usize;
        let below = (1u64 << (page % 64)) - 1;
        let before = self.rank[w] + (self.own[w] & !self.zero[w] & below).count_ones() as u64;
        self.area.pages_offset + before * PAGE
    }
}

/// Where a chain holds a page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    Zero,
    /// File `file` of the chain, at `offset`.
    Data {
        file: usize,
        offset: u64,
    },
}

/// One block through a chain: its bitmaps in each file, newest first.
struct ChainBlock<'a> {
    files: &'a [ChainFile],
    areas: Vec<Option<&'a AreaBits>>,
}

impl<'a> ChainBlock<'a> {
    fn newest(&self) -> Option<&'a AreaBits> {
        self.areas.first().copied().flatten()
    }

    /// Where `page` is held; `None` when it is the template's.
    fn source(&self, page: u64) -> Result<Option<Source>> {
        if !self.newest().is_some_and(|a| bit(&a.saved, page)) {
            return Ok(None);
        }
        for (file, area) in self.areas.iter().enumerate() {
            let Some(area) = area else { continue };
            if bit(&area.own, page) {
                return Ok(Some(if bit(&area.zero, page) {
                    Source::Zero
                } else {
                    Source::Data {
                        file,
                        offset: area.offset(page),
                    }
                }));
            }
        }
        Err(corrupt(format!("page {page} is saved but held by no file")))
    }

    /// The chain's bytes of `page`; `None` when it is the template's.
    fn page(&self, page: u64) -> Result<Option<&[u8]>> {
        Ok(match self.source(page)? {
            None => None,
            Some(Source::Zero) => Some(&ZERO_PAGE[..]),
            Some(Source::Data { file, offset }) => Some(self.files[file].map.page(offset)?),
        })
    }
}

impl Chain {
    /// The RAM file at `path` and the files it stands on.
    pub fn open(path: &Path) -> Result<Chain> {
        let mut files = Vec::new();
        let mut next = Some(path.to_path_buf());
        while let Some(path) = next {
            if files.len() == MAX_CHAIN {
                return Err(corrupt(format!(
                    "{} stands on more than {MAX_CHAIN} files",
                    path.display()
                )));
            }
            let file = File::open(&path)
                .map_err(RuntimeError::io(format!("opening {}", path.display())))?;
            let header = read_header(&file)?;
            next = header.parent.as_ref().map(|p| sibling(&path, p));
            let areas = header
                .areas
                .iter()
                .map(|a| AreaBits::read(&file, a))
                .collect::<Result<_>>()?;
            files.push(ChainFile {
                name: path
                    .file_name()
                    .map(|n| n.to_string_lossy().to_string())
                    .unwrap_or_default(),
                map: Mapped::of(&file, &path)?,
                path: path.clone(),
                areas,
            });
        }
        Ok(Chain { files })
    }

    /// The newest file's name.
    pub fn name(&self) -> &str {
        &self.files[0].name
    }

    /// The chain's files, newest first.
    pub fn paths(&self) -> Vec<PathBuf> {
        self.files.iter().map(|f| f.path.clone()).collect()
    }

    /// Where each page of block `block` of the RAM the chain makes over a
    /// template is, as EROFS chunks (see `erofs`): device 0 is the
    /// template's RAM file (read where it has data, see `template_data`),
    /// device `1 + i` the chain's file `i` (as [`Chain::paths`] lists
    /// them), a hole a zero page.
    pub(crate) fn chunks(
        &self,
        block: &str,
        len: u64,
        template_data: &[u64],
    ) -> Result<Vec<crate::save::erofs::Chunk>> {
        use crate::save::erofs::Chunk;
        let through = self.block(block);
        let newest = through
            .newest()
            .filter(|a| a.area.length == len)
            .ok_or_else(|| {
                corrupt(format!(
                    "{} has no block {block} of {len} bytes",
                    self.name()
                ))
            })?;
        let at = |device: usize, offset: u64| -> Result<Chunk> {
            Ok(Chunk::At {
                device: device as u16,
                block: u32::try_from(offset / PAGE)
                    .map_err(|_| corrupt(format!("offset {offset} is too far")))?,
            })
        };
        let pages = len / PAGE;
        let mut chunks = Vec::with_capacity(pages as usize);
        for page in 0..pages {
            // Most pages are the template's: one bit test each.
            let chunk = if !bit(&newest.saved, page) {
                if bit(template_data, page) {
                    at(0, page * PAGE)?
                } else {
                    Chunk::Hole
                }
            } else {
                match through.source(page)? {
                    None | Some(Source::Zero) => Chunk::Hole,
                    Some(Source::Data { file, offset }) => at(1 + file, offset)?,
                }
            };
            chunks.push(chunk);
        }
        Ok(chunks)
    }

    /// Files in the chain.
    pub fn depth(&self) -> usize {
        self.files.len()
    }

    fn block(&self, name: &str) -> ChainBlock<'_> {
        ChainBlock {
            files: &self.files,
            areas: self
                .files
                .iter()
                .map(|f| f.areas.iter().find(|a| a.area.name == name))
                .collect(),
        }
    }
}

fn sibling(path: &Path, name: &str) -> PathBuf {
    path.parent().unwrap_or(Path::new("/")).join(name)
}

/// The file a RAM file stands on, if `path` is a RAM file that names one
/// (for the layers' collection).
pub fn parent_of(path: &Path) -> std::io::Result<Option<PathBuf>> {
    let file = File::open(path)?;
    Ok(read_header(&file)
        .ok()
        .and_then(|h| h.parent)
        .map(|p| sibling(path, &p)))
}

/// Starts RAM file `out` (an empty file) on `parent`: once this header is
/// written, the layers' collection keeps the parent for it.
pub fn begin(out: &File, parent: Option<&Chain>) -> Result<()> {
    write_header(
        out,
        &Header {
            version: VERSION,
            parent: parent.map(|c| c.name().to_string()),
            areas: Vec::new(),
        },
    )
}

/// Pages moved in one call: runs of consecutive pages, each one remote
/// area, their bytes one after another in the local buffer.
#[derive(Default)]
struct Batch {
    pages: Vec<u64>,
    /// (first page, pages) of each run.
    runs: Vec<(u64, u64)>,
}

impl Batch {
    fn full(&self) -> bool {
        self.pages.len() as u64 * PAGE >= BATCH_BYTES as u64 || self.runs.len() >= BATCH_AREAS
    }

    fn push(&mut self, page: u64) {
        match self.runs.last_mut() {
            Some((first, n)) if *first + *n == page => *n += 1,
            _ => self.runs.push((page, 1)),
        }
        self.pages.push(page);
    }

    fn remote(&self, hva: u64) -> Vec<libc::iovec> {
        self.runs
            .iter()
            .map(|&(first, n)| libc::iovec {
                iov_base: (hva + first * PAGE) as *mut libc::c_void,
                iov_len: (n * PAGE) as usize,
            })
            .collect()
    }

    fn bytes(&self) -> usize {
        self.pages.len() * PAGE as usize
    }

    /// Reads the batch's pages from QEMU `pid` into `buf`.
    fn read(&self, pid: u32, hva: u64, buf: &mut [u8]) -> Result<usize> {
        let want = self.bytes();
        assert!(want <= buf.len());
        let local = [libc::iovec {
            iov_base: buf.as_mut_ptr() as *mut libc::c_void,
            iov_len: want,
        }];
        // SAFETY: `buf` holds `want` bytes; the remote areas are only read.
        let n = unsafe { self.transfer(pid, hva, &local, libc::process_vm_readv) };
        check_moved(n, want, "reading the VM's memory")
    }

    /// Writes the `local` areas (the batch's pages' bytes, one after
    /// another) into QEMU `pid`.
    ///
    /// # Safety
    /// The local areas must be readable; the remote ones must be guest RAM
    /// of a QEMU that does not run its guest yet.
    unsafe fn transfer_from(&self, pid: u32, hva: u64, local: &[libc::iovec]) -> isize {
        // SAFETY: as the caller promised.
        unsafe { self.transfer(pid, hva, local, libc::process_vm_writev) }
    }

    /// `process_vm_readv` or `process_vm_writev` between the `local` areas
    /// and the batch's pages in QEMU `pid`.
    ///
    /// # Safety
    /// The local areas must be valid (and writable for a read).
    unsafe fn transfer(
        &self,
        pid: u32,
        hva: u64,
        local: &[libc::iovec],
        call: unsafe extern "C" fn(
            libc::pid_t,
            *const libc::iovec,
            libc::c_ulong,
            *const libc::iovec,
            libc::c_ulong,
            libc::c_ulong,
        ) -> isize,
    ) -> isize {
        let remote = self.remote(hva);
        // SAFETY: the local areas as the caller promised; `remote` lives
        // across the call.
        unsafe {
            call(
                pid as libc::pid_t,
                local.as_ptr(),
                local.len() as libc::c_ulong,
                remote.as_ptr(),
                remote.len() as libc::c_ulong,
                0,
            )
        }
    }
}

/// Copies in two halves that overlap: `fill` puts each job's bytes in a
/// buffer on a second thread while `drain` takes the previous job's here
/// (reading a VM's memory while the file gets the pages read before: each
/// about as costly as the other).
fn pipelined<J: Sync>(
    jobs: &[J],
    fill: impl Fn(&J, &mut [u8]) -> Result<usize> + Sync,
    mut drain: impl FnMut(&J, &[u8]) -> Result<()>,
) -> Result<()> {
    use std::sync::mpsc::sync_channel;
    if jobs.is_empty() {
        return Ok(());
    }
    let (filled_tx, filled_rx) = sync_channel::<Result<(usize, Vec<u8>, usize)>>(2);
    let (free_tx, free_rx) = sync_channel::<Vec<u8>>(2);
    for _ in 0..2 {
        free_tx.send(vec![0u8; BATCH_BYTES]).expect("room for two");
    }
    let fill = &fill;
    // Everything the drain holds goes when it returns, failed or not, so
    // the filling thread, waiting on it, ends before the scope joins it.
    std::thread::scope(move |scope| {
        scope.spawn(move || {
            for (i, job) in jobs.iter().enumerate() {
                // The drain stopped (it failed): nothing more to fill.
                let Ok(mut buf) = free_rx.recv() else { return };
                let filled = fill(job, &mut buf).map(|n| (i, buf, n));
                let failed = filled.is_err();
                if filled_tx.send(filled).is_err() || failed {
                    return;
                }
            }
        });
        for _ in 0..jobs.len() {
            let (i, buf, n) = filled_rx
                .recv()
                .map_err(|_| corrupt("the copying thread ended early"))??;
            drain(&jobs[i], &buf[..n])?;
            let _ = free_tx.send(buf);
        }
        Ok(())
    })
}

fn check_moved(n: isize, want: usize, what: &str) -> Result<usize> {
    if n < 0 {
        return Err(RuntimeError::io(what.to_string())(
            std::io::Error::last_os_error(),
        ));
    }
    if n as usize != want {
        return Err(corrupt(format!("{what}: {n} of {want} bytes moved")));
    }
    Ok(want)
}

fn is_zero(bytes: &[u8]) -> bool {
    bytes
        .chunks_exact(64)
        .all(|c| c.iter().fold(0u8, |a, &b| a | b) == 0)
}

fn words_as_bytes(words: &[u64]) -> &[u8] {
    // SAFETY: u64 has no padding and u8 has no alignment requirement.
    unsafe { std::slice::from_raw_parts(words.as_ptr() as *const u8, words.len() * 8) }
}

fn write_header(out: &File, header: &Header) -> Result<()> {
    let json = serde_json::to_vec(header).expect("json");
    let mut page = Vec::with_capacity(HEADER_BYTES as usize);
    page.extend_from_slice(MAGIC);
    page.extend_from_slice(&(json.len() as u32).to_le_bytes());
    page.extend_from_slice(&json);
    if page.len() as u64 > HEADER_BYTES {
        return Err(corrupt("too many RAM blocks for the header"));
    }
    out.write_all_at(&page, 0)
        .map_err(RuntimeError::io("writing the saved RAM's header"))
}

fn read_header(file: &File) -> Result<Header> {
    let mut page = vec![0u8; HEADER_BYTES as usize];
    file.read_exact_at(&mut page, 0)
        .map_err(RuntimeError::io("reading the saved RAM's header"))?;
    if &page[..MAGIC.len()] != MAGIC {
        return Err(corrupt("not a saved RAM file"));
    }
    let at = MAGIC.len();
    let len = u32::from_le_bytes(page[at..at + 4].try_into().expect("4 bytes")) as usize;
    let json = page
        .get(at + 4..at + 4 + len)
        .ok_or_else(|| corrupt("its header is cut short"))?;
    let header: Header =
        serde_json::from_slice(json).map_err(|e| corrupt(format!("its header: {e}")))?;
    if header.version != VERSION {
        return Err(corrupt(format!(
            "version {} (this Sandpit reads {VERSION})",
            header.version
        )));
    }
    // A parent is a RAM file beside this one, never a path.
    if let Some(parent) = &header.parent {
        if !crate::save::layers::is_layer_name(parent) || !parent.ends_with(".ram") {
            return Err(corrupt(format!(
                "its parent {parent:?} is no RAM file's name"
            )));
        }
    }
    Ok(header)
}

#[cfg(test)]
mod tests;
