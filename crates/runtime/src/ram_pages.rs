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
pub async fn query_blocks(qmp: &mut crate::qmp::Qmp) -> Result<Vec<Block>> {
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
    ) -> Result<Vec<crate::erofs::Chunk>> {
        use crate::erofs::Chunk;
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

/// Writes the RAM of stopped QEMU `pid` to `out` (begun with [`begin`] on
/// the same `parent`): every writable block, of `diff_block` only the pages
/// that are no longer the mapped file's, and of those only the ones that
/// differ from the parent's.
pub fn capture(
    pid: u32,
    blocks: &[Block],
    diff_block: &str,
    out: &File,
    parent: Option<&Chain>,
    mapped: Option<&Chain>,
) -> Result<Captured> {
    let pagemap = File::open(format!("/proc/{pid}/pagemap"))
        .map_err(RuntimeError::io(format!("opening QEMU {pid}'s page map")))?;
    if !blocks.iter().any(|b| b.name == diff_block && b.writable) {
        return Err(corrupt(format!(
            "QEMU has no writable RAM block {diff_block} to save the written pages of"
        )));
    }
    let blocks: Vec<&Block> = blocks.iter().filter(|b| b.writable).collect();
    // The bitmaps first, at offsets known before any page is read.
    let mut areas = Vec::new();
    let mut offset = HEADER_BYTES;
    for block in &blocks {
        if block.length > MAX_BLOCK {
            return Err(corrupt(format!(
                "QEMU reports a RAM block {} of {} bytes",
                block.name, block.length
            )));
        }
        if block.length % PAGE != 0 || block.hva % PAGE != 0 {
            return Err(corrupt(format!(
                "RAM block {} is not page aligned",
                block.name
            )));
        }
        let bitmap_bytes = block.length.div_ceil(PAGE * 64) * 8;
        areas.push(RamArea {
            name: block.name.clone(),
            length: block.length,
            saved_bitmap: offset,
            own_bitmap: offset + bitmap_bytes,
            zero_bitmap: offset + 2 * bitmap_bytes,
            pages_offset: 0,
            data_pages: 0,
        });
        offset += 3 * bitmap_bytes;
    }
    let mut writer = Writer {
        out,
        at: offset.next_multiple_of(PAGE),
        captured: Captured::default(),
    };
    for (block, area) in blocks.iter().zip(&mut areas) {
        area.pages_offset = writer.at;
        let data_before = writer.captured.data_pages;
        let mut batches = Vec::new();
        let mut batch = Batch::default();
        let mut add = |page: u64| {
            if batch.full() {
                batches.push(std::mem::take(&mut batch));
            }
            batch.push(page);
        };
        let mut unread = Vec::new();
        if block.name == diff_block {
            // What the mapped file holds beyond the template: its pages
            // may differ from the parent's without being written.
            let image_saved = match mapped {
                Some(chain) => Some(
                    chain
                        .block(diff_block)
                        .newest()
                        .filter(|a| a.area.length == block.length)
                        .ok_or_else(|| {
                            corrupt(format!(
                                "the VM's RAM was made from {}, which has no block {diff_block} \
                                 of {} bytes",
                                chain.name(),
                                block.length
                            ))
                        })?
                        .saved
                        .as_slice(),
                ),
                None => None,
            };
            // A page the guest did not write is the mapped file's: when the
            // parent's chain holds it in the same place (the parent is the
            // mapped file, or stands on it and kept the page), it is the
            // parent's without reading it, which would fault every page of
            // the image in.
            let through_mapped = mapped.map(|m| m.block(diff_block));
            let through_parent = parent.map(|p| p.block(diff_block));
            let parents = |page: u64| -> Result<bool> {
                Ok(match (&through_mapped, &through_parent) {
                    (Some(m), Some(p)) => same_place(m, p, page)?,
                    _ => false,
                })
            };
            let mut entries = vec![0u8; (PAGEMAP_CHUNK * 8) as usize];
            let mut first = 0;
            while first < area.pages() {
                let count = PAGEMAP_CHUNK.min(area.pages() - first);
                let bytes = &mut entries[..(count * 8) as usize];
                pagemap
                    .read_exact_at(bytes, (block.hva / PAGE + first) * 8)
                    .map_err(RuntimeError::io("reading QEMU's page map"))?;
                for (i, e) in bytes.chunks_exact(8).enumerate() {
                    let e = u64::from_ne_bytes(e.try_into().expect("8 bytes"));
                    let page = first + i as u64;
                    let written =
                        (e & PM_PRESENT != 0 && e & PM_FILE_OR_SHARED == 0) || e & PM_SWAPPED != 0;
                    if written {
                        add(page);
                    } else if image_saved.is_some_and(|w| bit(w, page)) {
                        if parents(page)? {
                            unread.push(page);
                        } else {
                            add(page);
                        }
                    }
                }
                first += count;
            }
        } else {
            (0..area.pages()).for_each(&mut add);
        }
        if !batch.pages.is_empty() {
            batches.push(batch);
        }
        let below = parent.map(|c| c.block(&block.name));
        let mut bits = Bits::new(area.bitmap_words());
        for page in unread {
            bits.saved[(page / 64) as usize] |= 1 << (page % 64);
            writer.captured.inherited_pages += 1;
        }
        pipelined(
            &batches,
            |batch, buf| batch.read(pid, block.hva, buf),
            |batch, data| writer.write(&batch.pages, data, below.as_ref(), &mut bits),
        )?;
        for (words, at) in [
            (&bits.saved, area.saved_bitmap),
            (&bits.own, area.own_bitmap),
            (&bits.zero, area.zero_bitmap),
        ] {
            out.write_all_at(words_as_bytes(words), at)
                .map_err(RuntimeError::io("writing the saved RAM's bitmaps"))?;
        }
        area.data_pages = writer.captured.data_pages - data_before;
    }
    out.set_len(writer.at)
        .map_err(RuntimeError::io("sizing the saved RAM"))?;
    write_header(
        out,
        &Header {
            version: VERSION,
            parent: parent.map(|c| c.name().to_string()),
            areas,
        },
    )?;
    Ok(writer.captured)
}

/// Whether two chains hold `page` of a block in the same place: the same
/// offset of the same file, or both as a zero page.
fn same_place(a: &ChainBlock, b: &ChainBlock, page: u64) -> Result<bool> {
    Ok(match (a.source(page)?, b.source(page)?) {
        (Some(Source::Zero), Some(Source::Zero)) => true,
        (
            Some(Source::Data {
                file: fa,
                offset: oa,
            }),
            Some(Source::Data {
                file: fb,
                offset: ob,
            }),
        ) => oa == ob && a.files[fa].name == b.files[fb].name,
        _ => false,
    })
}

/// One block's bitmaps being written.
struct Bits {
    saved: Vec<u64>,
    own: Vec<u64>,
    zero: Vec<u64>,
}

impl Bits {
    fn new(words: usize) -> Bits {
        Bits {
            saved: vec![0; words],
            own: vec![0; words],
            zero: vec![0; words],
        }
    }
}

/// Appends the pages read from a VM to a RAM file.
struct Writer<'a> {
    out: &'a File,
    /// Where the next page's bytes go.
    at: u64,
    captured: Captured,
}

impl Writer<'_> {
    /// Marks `pages` (whose bytes are `data`, one after another) as saved;
    /// those equal to the parent's (`below`) as the parent's, the others as
    /// this file's, those that are zero as zero; and appends the rest in
    /// one write.
    fn write(
        &mut self,
        pages: &[u64],
        data: &[u8],
        below: Option<&ChainBlock>,
        bits: &mut Bits,
    ) -> Result<()> {
        let p = PAGE as usize;
        let mut parts: Vec<std::io::IoSlice> = Vec::new();
        let mut run: Option<(usize, usize)> = None;
        let mut bytes = 0;
        for (i, &page) in pages.iter().enumerate() {
            let (word, bit) = ((page / 64) as usize, 1u64 << (page % 64));
            bits.saved[word] |= bit;
            let mine = &data[i * p..(i + 1) * p];
            let theirs = match below {
                Some(below) => below.page(page)?,
                None => None,
            };
            let (zero, inherited) = if theirs == Some(mine) {
                (false, true)
            } else {
                (is_zero(mine), false)
            };
            if inherited {
                self.captured.inherited_pages += 1;
            } else {
                bits.own[word] |= bit;
            }
            if zero {
                bits.zero[word] |= bit;
                self.captured.zero_pages += 1;
            }
            if zero || inherited {
                if let Some((from, to)) = run.take() {
                    parts.push(std::io::IoSlice::new(&data[from..to]));
                }
                continue;
            }
            self.captured.data_pages += 1;
            bytes += p;
            run = match run {
                Some((from, to)) if to == i * p => Some((from, to + p)),
                other => {
                    if let Some((from, to)) = other {
                        parts.push(std::io::IoSlice::new(&data[from..to]));
                    }
                    Some((i * p, (i + 1) * p))
                }
            };
        }
        if let Some((from, to)) = run {
            parts.push(std::io::IoSlice::new(&data[from..to]));
        }
        write_all_vectored_at(self.out, &parts, self.at)?;
        self.at += bytes as u64;
        Ok(())
    }
}

/// `pwritev` until all of `parts` is written at `offset`.
fn write_all_vectored_at(out: &File, parts: &[std::io::IoSlice], offset: u64) -> Result<()> {
    use std::os::unix::io::AsRawFd;
    let mut parts: Vec<std::io::IoSlice> = parts.to_vec();
    let mut slices: &mut [std::io::IoSlice] = &mut parts;
    let mut at = offset;
    while !slices.is_empty() {
        let count = slices.len().min(BATCH_AREAS);
        // SAFETY: `IoSlice` is ABI-compatible with `iovec`; the slices
        // borrow live buffers.
        let n = unsafe {
            libc::pwritev(
                out.as_raw_fd(),
                slices.as_ptr() as *const libc::iovec,
                count as libc::c_int,
                at as libc::off_t,
            )
        };
        if n < 0 {
            return Err(RuntimeError::io("writing the saved RAM")(
                std::io::Error::last_os_error(),
            ));
        }
        if n == 0 {
            return Err(corrupt("writing the saved RAM wrote nothing"));
        }
        at += n as u64;
        std::io::IoSlice::advance_slices(&mut slices, n as usize);
    }
    Ok(())
}

/// Copies the pages of a chain of RAM files into QEMU `pid`'s blocks (the
/// VM must not run yet), but for block `mapped`, whose mapping holds them
/// already (an image, see `ram_image`); the pages written.
pub fn load(pid: u32, blocks: &[Block], chain: &Chain, mapped: Option<&str>) -> Result<u64> {
    let mut loaded = 0;
    for newest in &chain.files[0].areas {
        let area = &newest.area;
        if Some(area.name.as_str()) == mapped {
            continue;
        }
        let block = blocks
            .iter()
            .find(|b| b.name == area.name && b.writable)
            .ok_or_else(|| corrupt(format!("this QEMU has no writable RAM block {}", area.name)))?;
        if block.length != area.length {
            return Err(corrupt(format!(
                "RAM block {} holds {} bytes here and {} in the save",
                area.name, block.length, area.length
            )));
        }
        let through = chain.block(&area.name);
        // Two halves of the pages on two threads.
        let words = &newest.saved;
        let total: u64 = words.iter().map(|w| w.count_ones() as u64).sum();
        let mut mid = 0;
        let mut first_half = 0;
        while mid < words.len() && first_half < total / 2 {
            first_half += words[mid].count_ones() as u64;
            mid += 1;
        }
        let (a, b) = std::thread::scope(|scope| {
            let other = scope.spawn(|| load_words(pid, block.hva, &through, &words[mid..], mid));
            let here = load_words(pid, block.hva, &through, &words[..mid], 0);
            (
                here,
                other
                    .join()
                    .unwrap_or_else(|_| Err(corrupt("a loading thread panicked"))),
            )
        });
        loaded += a? + b?;
    }
    Ok(loaded)
}

/// Writes the pages of `words` (bitmap words from `first_word` on) from
/// the chain into QEMU `pid`'s block at `hva`, straight from the chain's
/// mappings; the pages written.
fn load_words(
    pid: u32,
    hva: u64,
    through: &ChainBlock,
    words: &[u64],
    first_word: usize,
) -> Result<u64> {
    let mut loaded = 0;
    let mut batch = Batch::default();
    let mut local: Vec<libc::iovec> = Vec::new();
    let flush = |batch: &mut Batch, local: &mut Vec<libc::iovec>| -> Result<()> {
        // SAFETY: the local areas are pages of the chain's mappings or the
        // zero page, only read.
        let n = unsafe { batch.transfer_from(pid, hva, local) };
        check_moved(n, batch.bytes(), "writing the VM's memory")?;
        *batch = Batch::default();
        local.clear();
        Ok(())
    };
    for (w, &word) in words.iter().enumerate() {
        let mut word = word;
        while word != 0 {
            let bit = word.trailing_zeros() as u64;
            word &= word - 1;
            let page = (first_word + w) as u64 * 64 + bit;
            let bytes = through
                .page(page)?
                .ok_or_else(|| corrupt(format!("page {page} is saved but held by no file")))?;
            if batch.full() || local.len() >= BATCH_AREAS {
                flush(&mut batch, &mut local)?;
            }
            batch.push(page);
            match local.last_mut() {
                Some(last)
                    if last.iov_base as usize + last.iov_len == bytes.as_ptr() as usize
                        && !std::ptr::eq(bytes.as_ptr(), ZERO_PAGE.as_ptr()) =>
                {
                    last.iov_len += bytes.len()
                }
                _ => local.push(libc::iovec {
                    iov_base: bytes.as_ptr() as *mut libc::c_void,
                    iov_len: bytes.len(),
                }),
            }
            loaded += 1;
        }
    }
    if !batch.pages.is_empty() {
        flush(&mut batch, &mut local)?;
    }
    Ok(loaded)
}

/// The pages of a file that are not holes (bit `i`: page `i`).
pub(crate) fn data_pages(file: &File, len: u64) -> Result<Vec<u64>> {
    use std::os::unix::io::AsRawFd;
    let mut words = vec![0u64; (len / PAGE).div_ceil(64) as usize];
    let mut at = 0i64;
    while (at as u64) < len {
        // SAFETY: plain descriptor calls.
        let data = unsafe { libc::lseek(file.as_raw_fd(), at, libc::SEEK_DATA) };
        if data < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENXIO) {
                break; // no data past `at`
            }
            return Err(RuntimeError::io("finding a RAM file's data")(e));
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(file.as_raw_fd(), data, libc::SEEK_HOLE) };
        if hole < 0 {
            return Err(RuntimeError::io("finding a RAM file's holes")(
                std::io::Error::last_os_error(),
            ));
        }
        for page in data as u64 / PAGE..(hole as u64).div_ceil(PAGE).min(len / PAGE) {
            words[(page / 64) as usize] |= 1 << (page % 64);
        }
        at = hole;
    }
    Ok(words)
}

fn read_bitmap(file: &File, area: &RamArea, offset: u64) -> Result<Vec<u64>> {
    let mut bytes = vec![0u8; area.bitmap_words() * 8];
    file.read_exact_at(&mut bytes, offset)
        .map_err(RuntimeError::io("reading the saved RAM's bitmaps"))?;
    Ok(bytes
        .chunks_exact(8)
        .map(|w| u64::from_ne_bytes(w.try_into().expect("8 bytes")))
        .collect())
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
        if !crate::layers::is_layer_name(parent) || !parent.ends_with(".ram") {
            return Err(corrupt(format!(
                "its parent {parent:?} is no RAM file's name"
            )));
        }
    }
    Ok(header)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TABLE: &str = "              Block Name    PSize              Offset               Used              Total                HVA  RO
                     ram    4 KiB  0x0000000000000000 0x0000000100000000 0x0000000100000000 0x00007f447ffff000  rw
    /rom@etc/acpi/tables    4 KiB  0x0000000100040000 0x0000000000001000 0x0000000000200000 0x00007f4589000000  ro
                 pc.bios    4 KiB  0x0000000100000000 0x0000000000020000 0x0000000000020000 0x00007f4589400000  rw
";

    #[test]
    fn qemus_block_table_is_read() {
        let blocks = parse_ramblocks(TABLE).unwrap();
        assert_eq!(
            blocks,
            vec![
                Block {
                    name: "ram".into(),
                    length: 0x1_0000_0000,
                    hva: 0x7f44_7fff_f000,
                    writable: true
                },
                Block {
                    name: "/rom@etc/acpi/tables".into(),
                    length: 0x1000,
                    hva: 0x7f45_8900_0000,
                    writable: false
                },
                Block {
                    name: "pc.bios".into(),
                    length: 0x20000,
                    hva: 0x7f45_8940_0000,
                    writable: true
                },
            ]
        );
        assert!(parse_ramblocks("Error: no such command").is_err());
        assert!(parse_ramblocks("Block Name\n ram 4 KiB 0x0 zz 0x0 0x0 rw").is_err());
    }

    /// A private copy-on-write mapping of a file, as QEMU has of the
    /// template: the pages written in this process differ from the file.
    struct Mapping {
        ptr: *mut u8,
        len: usize,
    }

    impl Mapping {
        fn of(file: &File, len: usize) -> Mapping {
            use std::os::unix::io::AsRawFd;
            Mapping::map(len, libc::MAP_PRIVATE, file.as_raw_fd())
        }
        fn anonymous(len: usize) -> Mapping {
            Mapping::map(len, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1)
        }
        fn map(len: usize, flags: libc::c_int, fd: libc::c_int) -> Mapping {
            // SAFETY: a fresh mapping of `len` bytes.
            let ptr = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    flags,
                    fd,
                    0,
                )
            };
            assert_ne!(ptr, libc::MAP_FAILED);
            Mapping {
                ptr: ptr as *mut u8,
                len,
            }
        }
        fn bytes(&mut self) -> &mut [u8] {
            // SAFETY: the mapping lives as long as `self`.
            unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
        }
        fn block(&self, name: &str) -> Block {
            Block {
                name: name.into(),
                length: self.len as u64,
                hva: self.ptr as u64,
                writable: true,
            }
        }
    }

    impl Drop for Mapping {
        fn drop(&mut self) {
            // SAFETY: unmapping what `of` mapped.
            unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
        }
    }

    /// A new RAM file in `dir` (named as the layers' are) begun on
    /// `parent`, captured from this process's `blocks`.
    fn save(dir: &Path, blocks: &[Block], parent: Option<&Chain>) -> (PathBuf, Captured) {
        save_mapped(dir, blocks, parent, None)
    }

    /// [`save`] of a VM whose block `ram` maps the image of `mapped`.
    fn save_mapped(
        dir: &Path,
        blocks: &[Block],
        parent: Option<&Chain>,
        mapped: Option<&Chain>,
    ) -> (PathBuf, Captured) {
        let path = dir.join(crate::layers::new_name(".ram"));
        let out = File::create_new(&path).unwrap();
        begin(&out, parent).unwrap();
        let captured = capture(std::process::id(), blocks, "ram", &out, parent, mapped).unwrap();
        (path, captured)
    }

    fn on_disk(path: &Path) -> u64 {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(path).unwrap().blocks() * 512
    }

    #[test]
    fn the_written_pages_are_saved_and_load_into_a_fresh_mapping() {
        let pages = 2000usize;
        let len = pages * PAGE as usize;
        let dir = tempfile::tempdir().unwrap();
        let base = tempfile::tempfile().unwrap();
        let content: Vec<u8> = (0..len)
            .map(|i| (i / PAGE as usize % 251 + 1) as u8)
            .collect();
        base.write_all_at(&content, 0).unwrap();
        let mut vm = Mapping::of(&base, len);
        // Read every page (mapped, still the file's), then write some: a
        // run, scattered pages, a page zeroed and a page rewritten as it was.
        assert_eq!(vm.bytes(), &content[..]);
        let p = PAGE as usize;
        for page in (10..1300).chain([1500, 1502, 1999]) {
            vm.bytes()[page * p + 7] ^= 0x5a;
        }
        vm.bytes()[400 * p..401 * p].fill(0);
        vm.bytes()[1700 * p] = content[1700 * p];
        let mut bios = Mapping::anonymous(8 * p);
        bios.bytes().fill(3);
        bios.bytes()[5 * p..6 * p].fill(0);
        let firmware = bios.block("pc.bios");
        let tables = Block {
            writable: false,
            ..bios.block("tables")
        };
        let blocks = [vm.block("ram"), firmware.clone(), tables];
        let (first, captured) = save(dir.path(), &blocks, None);
        // 1290 + 3 pages flipped, 1 rewritten as it was (still a written
        // page); the zeroed page is among the flipped ones; the firmware's
        // 8 pages, one of them zero.
        assert_eq!(captured.saved_pages(), 1294 + 8);
        assert_eq!(captured.zero_pages, 1 + 1);
        assert_eq!(captured.inherited_pages, 0);
        // The zero pages and the unwritten ones take no room.
        let size = on_disk(&first);
        assert!(size < (1300 + 8 + 4) * PAGE, "{size} bytes on disk");

        let chain = Chain::open(&first).unwrap();
        let mut fresh = Mapping::of(&base, len);
        let mut bios_after = Mapping::anonymous(8 * p);
        bios_after.bytes().fill(9);
        let targets = [fresh.block("ram"), bios_after.block("pc.bios")];
        assert_eq!(
            load(std::process::id(), &targets, &chain, None).unwrap(),
            1294 + 8
        );
        assert!(fresh.bytes() == vm.bytes(), "the loaded RAM differs");
        assert!(
            bios_after.bytes() == bios.bytes(),
            "the loaded firmware differs"
        );

        // A QEMU whose block differs in size is refused.
        let mut small = Mapping::of(&base, len - p);
        assert!(load(std::process::id(), &[small.block("ram")], &chain, None).is_err());
        let _ = small.bytes();
        assert!(load(std::process::id(), &[], &chain, None).is_err());
        // A QEMU whose memory cannot be written fails the load (and the
        // copying thread ends with it).
        let unmapped = Block {
            hva: 0x1000,
            ..fresh.block("ram")
        };
        assert!(load(
            std::process::id(),
            &[unmapped, bios_after.block("pc.bios")],
            &chain,
            None
        )
        .is_err());
        assert!(read_header(&base).is_err());
        assert_eq!(parent_of(&first).unwrap(), None);
        // A QEMU without the block the written pages are found in: refused
        // (not every block copied whole).
        let out = File::create_new(dir.path().join("none.ram")).unwrap();
        assert!(capture(
            std::process::id(),
            std::slice::from_ref(&firmware),
            "ram",
            &out,
            None,
            None
        )
        .is_err());
        // A header naming a path for its parent is refused.
        let forged = File::create_new(dir.path().join("forged.ram")).unwrap();
        write_header(
            &forged,
            &Header {
                version: VERSION,
                parent: Some("../../etc/shadow".into()),
                areas: Vec::new(),
            },
        )
        .unwrap();
        assert!(Chain::open(&dir.path().join("forged.ram")).is_err());
        assert_eq!(parent_of(&dir.path().join("forged.ram")).unwrap(), None);
    }

    #[test]
    fn a_save_over_a_parent_holds_only_what_changed_since() {
        let pages = 3000usize;
        let p = PAGE as usize;
        let len = pages * p;
        let dir = tempfile::tempdir().unwrap();
        let base = tempfile::tempfile().unwrap();
        let content: Vec<u8> = (0..len).map(|i| (i / p % 13 + 1) as u8).collect();
        base.write_all_at(&content, 0).unwrap();
        let mut vm = Mapping::of(&base, len);
        let mut bios = Mapping::anonymous(4 * p);
        bios.bytes().fill(5);
        for page in 0..2000 {
            vm.bytes()[page * p + 1] = 0xee;
        }
        vm.bytes()[1800 * p..1801 * p].fill(0);
        let blocks = [vm.block("ram"), bios.block("pc.bios")];
        let (first, _) = save(dir.path(), &blocks, None);
        let parent = Chain::open(&first).unwrap();

        // Since: 5 pages changed, 2 written for the first time, a page
        // zeroed, the zero page written, one page rewritten as it was.
        for page in [3, 700, 701, 1500, 1999, 2500, 2998] {
            vm.bytes()[page * p + 2] ^= 0x11;
        }
        vm.bytes()[900 * p..901 * p].fill(0);
        vm.bytes()[1800 * p + 9] = 1;
        vm.bytes()[1200 * p + 1] = 0xee;
        let (second, captured) = save(dir.path(), &blocks, Some(&parent));
        assert_eq!(captured.saved_pages(), 2002 + 4);
        assert_eq!(captured.data_pages, 5 + 2 + 1);
        assert_eq!(captured.zero_pages, 1);
        assert_eq!(captured.inherited_pages, 2002 + 4 - 9);
        assert!(on_disk(&second) < 24 * PAGE + on_disk(&first) / 10);
        assert_eq!(parent_of(&second).unwrap(), Some(first.clone()));

        // Loaded through the chain, it is the VM as it is now; and the
        // parent alone still loads as the VM was.
        let chain = Chain::open(&second).unwrap();
        assert_eq!(chain.depth(), 2);
        let mut fresh = Mapping::of(&base, len);
        let mut fresh_bios = Mapping::anonymous(4 * p);
        let targets = [fresh.block("ram"), fresh_bios.block("pc.bios")];
        load(std::process::id(), &targets, &chain, None).unwrap();
        assert!(fresh.bytes() == vm.bytes(), "the chain loads other RAM");
        assert!(fresh_bios.bytes() == bios.bytes());
        let mut old = Mapping::of(&base, len);
        load(
            std::process::id(),
            &[old.block("ram"), fresh_bios.block("pc.bios")],
            &parent,
            None,
        )
        .unwrap();
        assert_eq!(old.bytes()[900 * p + 1], 0xee);
        assert_eq!(old.bytes()[1800 * p + 9], 0);

        // A chain is as long as MAX_CHAIN at most.
        let mut below = chain;
        for n in 2..MAX_CHAIN {
            vm.bytes()[n * p] ^= 1;
            let (next, _) = save(dir.path(), &blocks, Some(&below));
            below = Chain::open(&next).unwrap();
        }
        assert_eq!(below.depth(), MAX_CHAIN);
        let (too_deep, _) = save(dir.path(), &blocks, Some(&below));
        assert!(Chain::open(&too_deep).is_err());
    }
    #[test]
    fn an_image_is_the_saved_ram_whole_and_its_vms_save_against_it() {
        let p = PAGE as usize;
        let pages = 5000;
        let len = pages * p;
        let dir = tempfile::tempdir().unwrap();
        // The template: data in two runs, holes around them, a zero page.
        let template_path = dir.path().join("mem");
        let template = File::create_new(&template_path).unwrap();
        template.set_len(len as u64).unwrap();
        let run: Vec<u8> = (0..300 * p).map(|i| (i / p % 7 + 1) as u8).collect();
        template.write_all_at(&run, 0).unwrap();
        template.write_all_at(&run, 4000 * PAGE).unwrap();
        template.write_all_at(&vec![0; p], 200 * PAGE).unwrap();
        let mut vm = Mapping::of(&template, len);
        let mut bios = Mapping::anonymous(2 * p);
        bios.bytes().fill(4);
        // Written: over the template's data, in its holes, a page zeroed.
        for page in (100..150).chain([400, 4060, pages - 1]) {
            vm.bytes()[page * p + 3] = 0x77;
        }
        vm.bytes()[10 * p..11 * p].fill(0);
        let blocks = [vm.block("ram"), bios.block("pc.bios")];
        let (parent, _) = save(dir.path(), &blocks, None);
        // A second save on the first, so the image reads from both files.
        vm.bytes()[4061 * p + 9] = 0x55;
        vm.bytes()[120 * p + 9] = 0x56;
        let blocks = [vm.block("ram"), bios.block("pc.bios")];
        let (saved, _) = save(dir.path(), &blocks, Some(&Chain::open(&parent).unwrap()));
        let chain = Chain::open(&saved).unwrap();
        assert_eq!(chain.depth(), 2);

        let image = crate::ram_image::mount(&template_path, &saved, "ram")
            .unwrap()
            .expect(
                "mounting an EROFS image over plain files needs root and Linux 6.12 or later \
                 with EROFS (CONFIG_EROFS_FS)",
            );
        // Mapped as QEMU maps it: reopened read-only by its /proc path.
        use std::os::unix::io::AsRawFd;
        let reopened = File::open(format!("/proc/self/fd/{}", image.as_raw_fd())).unwrap();
        assert!(std::fs::OpenOptions::new()
            .write(true)
            .open(format!("/proc/self/fd/{}", image.as_raw_fd()))
            .is_err());
        let mut child = Mapping::of(&reopened, len);
        assert!(
            child.bytes() == vm.bytes(),
            "the image is not the saved RAM"
        );
        // A mapping's copy-on-write stays its own.
        child.bytes()[5 * p] ^= 0xff;
        let second = Mapping::of(&reopened, len);
        assert_eq!(
            unsafe { std::slice::from_raw_parts(second.ptr, len) }[5 * p],
            vm.bytes()[5 * p]
        );

        // A save of the VM that maps the image: the image's pages count as
        // the VM's (the parent's, unchanged), only the written one is new.
        let mut child_bios = Mapping::anonymous(2 * p);
        assert_eq!(
            load(
                std::process::id(),
                &[child.block("ram"), child_bios.block("pc.bios")],
                &chain,
                Some("ram"),
            )
            .unwrap(),
            2
        );
        assert!(child_bios.bytes() == bios.bytes());
        let child_blocks = [child.block("ram"), child_bios.block("pc.bios")];
        let (next, captured) = save_mapped(dir.path(), &child_blocks, Some(&chain), Some(&chain));
        assert_eq!(captured.data_pages, 1);
        let next_chain = Chain::open(&next).unwrap();
        let mut fresh = Mapping::of(&template, len);
        let fresh_bios = Mapping::anonymous(2 * p);
        load(
            std::process::id(),
            &[fresh.block("ram"), fresh_bios.block("pc.bios")],
            &next_chain,
            None,
        )
        .unwrap();
        assert!(
            fresh.bytes() == child.bytes(),
            "the child's save loads other RAM"
        );
        // A later save on that one, of the same VM: the image's pages it
        // did not write are where the image has them, the parent's.
        let (later, captured) =
            save_mapped(dir.path(), &child_blocks, Some(&next_chain), Some(&chain));
        assert_eq!(captured.data_pages, 0);
        let mut fresh = Mapping::of(&template, len);
        load(
            std::process::id(),
            &[fresh.block("ram"), fresh_bios.block("pc.bios")],
            &Chain::open(&later).unwrap(),
            None,
        )
        .unwrap();
        assert!(
            fresh.bytes() == child.bytes(),
            "the later save loads other RAM"
        );
        // Without a parent it holds the image's pages itself.
        let (alone, captured) = save_mapped(dir.path(), &child_blocks, None, Some(&chain));
        assert_eq!(captured.inherited_pages, 0);
        let mut again = Mapping::of(&template, len);
        load(
            std::process::id(),
            &[again.block("ram"), fresh_bios.block("pc.bios")],
            &Chain::open(&alone).unwrap(),
            None,
        )
        .unwrap();
        assert!(
            again.bytes() == child.bytes(),
            "a save without parent loads other RAM"
        );
        // An image of a chain of another size is refused.
        let short = dir.path().join("short");
        File::create_new(&short)
            .unwrap()
            .set_len(len as u64 - PAGE)
            .unwrap();
        assert!(crate::ram_image::mount(&short, &saved, "ram").is_err());
        drop(second);
    }
}
