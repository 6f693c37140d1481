//! A stopped VM's RAM copied out of its QEMU, and copied into another QEMU,
//! page by page, keeping only the pages that differ from the template.
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
//! A VM started from the save maps the same template file privately, waits
//! with `-incoming defer`, receives the saved pages here
//! (`process_vm_writev`, before any guest code runs) and then loads the
//! devices as a migration: every other page is the template's, as it was in
//! the saved VM. QEMU's other writable RAM blocks (the firmware's, a few
//! hundred KiB) are copied whole; read-only ones are rebuilt by QEMU itself.
//!
//! The file: a header page (magic, then JSON naming each block's areas),
//! then per block two bitmaps (bit `i` of host-endian `u64` words is page
//! `i`: the pages saved, and of those the ones that are zero), then the
//! bytes of the saved pages that are not zero, one after another in page
//! order: a save writes them in a few large writes however scattered they
//! are in the guest, and a load reads them back the same way.

use crate::{Result, RuntimeError};
use serde::{Deserialize, Serialize};
use std::fs::File;
use std::os::unix::fs::FileExt;

/// The page size of QEMU's x86 RAM blocks here.
pub const PAGE: u64 = 4096;

const MAGIC: &[u8; 12] = b"SANDPIT-RAM\n";
/// Bytes before the first block's bitmap: the magic, the header's length
/// and the header.
const HEADER_BYTES: u64 = PAGE;
const VERSION: u32 = 1;

/// Bytes moved per `process_vm_readv`/`writev` call, and remote areas per
/// call (the kernel's `IOV_MAX`).
const BATCH_BYTES: usize = 4 << 20;
const BATCH_AREAS: usize = 1024;
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

/// One block's area in a RAM file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RamArea {
    pub name: String,
    pub length: u64,
    /// The pages saved (bit `i`: page `i`).
    pub saved_bitmap: u64,
    /// Of those, the pages that are zero (no bytes in the file).
    pub zero_bitmap: u64,
    /// Where the bytes of the saved pages that are not zero are, one after
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
    areas: Vec<RamArea>,
}

/// What a capture wrote.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Captured {
    /// Pages written with their bytes.
    pub data_pages: u64,
    /// Pages marked as zero (no bytes).
    pub zero_pages: u64,
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

/// Writes the RAM of stopped QEMU `pid` to `out` (an empty file): every
/// writable block, of `diff_block` only the pages that are no longer the
/// mapped file's.
pub fn capture(pid: u32, blocks: &[Block], diff_block: &str, out: &File) -> Result<Captured> {
    let pagemap = File::open(format!("/proc/{pid}/pagemap"))
        .map_err(RuntimeError::io(format!("opening QEMU {pid}'s page map")))?;
    let blocks: Vec<&Block> = blocks.iter().filter(|b| b.writable).collect();
    // The bitmaps first, at offsets known before any page is read.
    let mut areas = Vec::new();
    let mut offset = HEADER_BYTES;
    for block in &blocks {
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
            zero_bitmap: offset + bitmap_bytes,
            pages_offset: 0,
            data_pages: 0,
        });
        offset += 2 * bitmap_bytes;
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
        if block.name == diff_block {
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
                    let written =
                        (e & PM_PRESENT != 0 && e & PM_FILE_OR_SHARED == 0) || e & PM_SWAPPED != 0;
                    if written {
                        add(first + i as u64);
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
        let mut saved = vec![0u64; area.bitmap_words()];
        let mut zero = vec![0u64; area.bitmap_words()];
        pipelined(
            &batches,
            |batch, buf| batch.read(pid, block.hva, buf),
            |batch, data| writer.write(&batch.pages, data, &mut saved, &mut zero),
        )?;
        for (words, at) in [(&saved, area.saved_bitmap), (&zero, area.zero_bitmap)] {
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
            areas,
        },
    )?;
    Ok(writer.captured)
}

/// Appends the pages read from a VM to a RAM file.
struct Writer<'a> {
    out: &'a File,
    /// Where the next page's bytes go.
    at: u64,
    captured: Captured,
}

impl Writer<'_> {
    /// Marks `pages` (whose bytes are `data`, one after another) as saved,
    /// those that are zero as zero, and appends the others in one write.
    fn write(
        &mut self,
        pages: &[u64],
        data: &[u8],
        saved: &mut [u64],
        zero: &mut [u64],
    ) -> Result<()> {
        let page_bytes = PAGE as usize;
        let mut parts: Vec<std::io::IoSlice> = Vec::new();
        let mut run: Option<(usize, usize)> = None;
        let mut bytes = 0;
        for (i, &page) in pages.iter().enumerate() {
            let (word, bit) = ((page / 64) as usize, 1u64 << (page % 64));
            saved[word] |= bit;
            if is_zero(&data[i * page_bytes..(i + 1) * page_bytes]) {
                zero[word] |= bit;
                self.captured.zero_pages += 1;
                if let Some((from, to)) = run.take() {
                    parts.push(std::io::IoSlice::new(&data[from..to]));
                }
                continue;
            }
            self.captured.data_pages += 1;
            bytes += page_bytes;
            run = match run {
                Some((from, to)) if to == i * page_bytes => Some((from, to + page_bytes)),
                other => {
                    if let Some((from, to)) = other {
                        parts.push(std::io::IoSlice::new(&data[from..to]));
                    }
                    Some((i * page_bytes, (i + 1) * page_bytes))
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

/// Copies the pages of a RAM file into QEMU `pid`'s blocks (the VM must not
/// run yet); the pages written.
pub fn load(pid: u32, blocks: &[Block], file: &File) -> Result<u64> {
    let header = read_header(file)?;
    let zeros = vec![0u8; BATCH_BYTES];
    let mut loaded = 0;
    for area in &header.areas {
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
        let saved = read_bitmap(file, area, area.saved_bitmap)?;
        let zero = read_bitmap(file, area, area.zero_bitmap)?;
        // The pages with bytes, each batch with where its bytes start in
        // the file; and the zero pages.
        let mut data: Vec<(Batch, u64)> = Vec::new();
        let mut zeroes: Vec<Batch> = Vec::new();
        let mut at = area.pages_offset;
        let mut batch = Batch::default();
        let mut zero_batch = Batch::default();
        for (w, (&saved, &zero)) in saved.iter().zip(&zero).enumerate() {
            let mut word = saved;
            while word != 0 {
                let bit = word.trailing_zeros() as u64;
                word &= word - 1;
                let page = w as u64 * 64 + bit;
                if zero & (1 << bit) != 0 {
                    if zero_batch.full() {
                        zeroes.push(std::mem::take(&mut zero_batch));
                    }
                    zero_batch.push(page);
                } else {
                    if batch.full() {
                        let bytes = batch.bytes() as u64;
                        data.push((std::mem::take(&mut batch), at));
                        at += bytes;
                    }
                    batch.push(page);
                }
                loaded += 1;
            }
        }
        if !batch.pages.is_empty() {
            let bytes = batch.bytes() as u64;
            data.push((batch, at));
            at += bytes;
        }
        if !zero_batch.pages.is_empty() {
            zeroes.push(zero_batch);
        }
        pipelined(
            &data,
            |(batch, at), buf| {
                let n = batch.bytes();
                file.read_exact_at(&mut buf[..n], *at)
                    .map_err(RuntimeError::io("reading the saved RAM"))?;
                Ok(n)
            },
            |(batch, _), bytes| batch.write(pid, block.hva, bytes),
        )?;
        for batch in &zeroes {
            batch.write(pid, block.hva, &zeros[..batch.bytes()])?;
        }
        if at != area.pages_offset + area.data_pages * PAGE {
            return Err(corrupt(format!(
                "block {}'s bitmaps do not match its page count",
                area.name
            )));
        }
    }
    Ok(loaded)
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

/// The pages a RAM file holds (zero or not).
pub fn pages_in(file: &File) -> Result<u64> {
    let header = read_header(file)?;
    let mut pages = 0;
    for area in &header.areas {
        pages += read_bitmap(file, area, area.saved_bitmap)?
            .iter()
            .map(|w| w.count_ones() as u64)
            .sum::<u64>();
    }
    Ok(pages)
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
        // SAFETY: `buf` holds `want` bytes; the remote areas are only read.
        let n = unsafe { self.transfer(pid, hva, buf.as_mut_ptr(), want, libc::process_vm_readv) };
        check_moved(n, want, "reading the VM's memory")
    }

    /// Writes `buf` (the batch's pages) into QEMU `pid`.
    fn write(&self, pid: u32, hva: u64, buf: &[u8]) -> Result<()> {
        // SAFETY: `buf` is only read by `process_vm_writev`; the remote
        // areas are guest RAM of a QEMU that does not run its guest yet.
        let n = unsafe {
            self.transfer(
                pid,
                hva,
                buf.as_ptr() as *mut u8,
                buf.len(),
                libc::process_vm_writev,
            )
        };
        check_moved(n, buf.len(), "writing the VM's memory").map(drop)
    }

    /// `process_vm_readv` or `process_vm_writev` between `len` bytes at
    /// `local` and the batch's pages in QEMU `pid`.
    ///
    /// # Safety
    /// `local` must be valid for `len` bytes (and writable for a read).
    unsafe fn transfer(
        &self,
        pid: u32,
        hva: u64,
        local: *mut u8,
        len: usize,
        call: unsafe extern "C" fn(
            libc::pid_t,
            *const libc::iovec,
            libc::c_ulong,
            *const libc::iovec,
            libc::c_ulong,
            libc::c_ulong,
        ) -> isize,
    ) -> isize {
        let local = libc::iovec {
            iov_base: local as *mut libc::c_void,
            iov_len: len,
        };
        let remote = self.remote(hva);
        // SAFETY: `local` as the caller promised; `remote` lives across
        // the call.
        unsafe {
            call(
                pid as libc::pid_t,
                &local,
                1,
                remote.as_ptr(),
                remote.len() as libc::c_ulong,
                0,
            )
        }
    }
}

/// Copies in two halves that overlap: `fill` puts each job's bytes in a
/// buffer on a second thread while `drain` takes the previous job's here
/// (reading a VM's memory and writing a file, or reading a file and
/// writing a VM's memory, each about as costly as the other).
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

    #[test]
    fn the_written_pages_are_saved_and_load_into_a_fresh_mapping() {
        let pages = 2000usize;
        let len = pages * PAGE as usize;
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
        let out = tempfile::tempfile().unwrap();
        let blocks = [vm.block("ram"), firmware.clone(), tables];
        let captured = capture(std::process::id(), &blocks, "ram", &out).unwrap();
        // 1290 + 3 pages flipped, 1 rewritten as it was (still a written
        // page); the zeroed page is among the flipped ones; the firmware's
        // 8 pages, one of them zero.
        assert_eq!(captured.data_pages + captured.zero_pages, 1294 + 8);
        assert_eq!(captured.zero_pages, 1 + 1);
        assert_eq!(pages_in(&out).unwrap(), 1294 + 8);
        // Sparse: the zero pages and the unwritten ones take no room.
        use std::os::unix::fs::MetadataExt;
        let on_disk = out.metadata().unwrap().blocks() * 512;
        assert!(on_disk < (1300 + 8 + 4) * PAGE, "{on_disk} bytes on disk");

        let mut fresh = Mapping::of(&base, len);
        let mut bios_after = Mapping::anonymous(8 * p);
        bios_after.bytes().fill(9);
        let targets = [fresh.block("ram"), bios_after.block("pc.bios")];
        assert_eq!(load(std::process::id(), &targets, &out).unwrap(), 1294 + 8);
        assert!(fresh.bytes() == vm.bytes(), "the loaded RAM differs");
        assert!(
            bios_after.bytes() == bios.bytes(),
            "the loaded firmware differs"
        );

        // A QEMU whose block differs in size is refused.
        let mut small = Mapping::of(&base, len - p);
        assert!(load(std::process::id(), &[small.block("ram")], &out).is_err());
        let _ = small.bytes();
        assert!(load(std::process::id(), &[], &out).is_err());
        // A QEMU whose memory cannot be written fails the load (and the
        // copying thread ends with it).
        let unmapped = Block {
            hva: 0x1000,
            ..fresh.block("ram")
        };
        assert!(load(
            std::process::id(),
            &[unmapped, bios_after.block("pc.bios")],
            &out
        )
        .is_err());
        assert!(read_header(&base).is_err());
    }
}
