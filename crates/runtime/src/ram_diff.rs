//! A saved VM's RAM kept as the pages that differ from its base.
//!
//! A sandbox's RAM is a private copy-on-write mapping of its template's RAM
//! file, so most of its pages are still the template's. QEMU's `mapped-ram`
//! migration to a `file:` writes every page of a RAM block that is not zero
//! at a fixed offset (`pages_offset + page * 4096`) and marks it in a bitmap;
//! loading reads only the marked pages into the destination's RAM and leaves
//! every other page as the destination's mapping has it. A VM restored on a
//! private mapping of the same template therefore needs only the pages that
//! differ from the template, and [`keep_differences`] rewrites a saved file
//! to hold just those:
//! - a page equal to the base's loses its mark and its bytes (a hole);
//! - a page the guest zeroed where the base is not zero gains a mark over a
//!   hole, which reads as zeros;
//! - every other marked page stays.
//!
//! The layout read here is QEMU's (10.0, `migration/ram.c`): in the stream's
//! `ram` section, after its total size, each migratable block has its name,
//! its length and a 28-byte big-endian header (version 1, page size, bitmap
//! offset, pages offset); the bitmap is host-endian `u64` words, bit `i` for
//! page `i`. Nothing else in the file is touched, so QEMU loads it as it
//! wrote it. `x-ignore-shared` must be off when saving (with it, 10.0 writes
//! an address field its own loader does not read).

use crate::{Result, RuntimeError};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;

/// The guest page size QEMU's x86 targets save RAM in.
pub const PAGE: u64 = 4096;

/// `RAM_SAVE_FLAG_MEM_SIZE`: the flag on the `ram` section's first word.
const FLAG_MEM_SIZE: u64 = 0x04;

/// The version of QEMU's per-block `MappedRamHeader` this reads.
const MAPPED_RAM_VERSION: u32 = 1;

/// How far into the file the `ram` section's start is looked for (the
/// stream's header and configuration section come first, a few hundred
/// bytes).
const SEARCH_BYTES: usize = 64 * 1024;

/// Pages compared per read.
const CHUNK_PAGES: u64 = 256;

/// One RAM block's area in a `mapped-ram` file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RamArea {
    /// QEMU's name for the block (a memory backend's id, `ram` here).
    pub name: String,
    /// Bytes of guest memory in the block.
    pub length: u64,
    /// Where its page bitmap starts.
    pub bitmap_offset: u64,
    /// Where page 0's bytes are; page `i` is at `pages_offset + i * PAGE`.
    pub pages_offset: u64,
}

impl RamArea {
    fn pages(&self) -> u64 {
        self.length / PAGE
    }

    fn bitmap_bytes(&self) -> u64 {
        self.pages().div_ceil(64) * 8
    }
}

/// What [`keep_differences`] left in a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Kept {
    /// Pages that differ from the base and are not zero: the bytes kept.
    pub data_pages: u64,
    /// Pages the guest zeroed where the base is not: marked over a hole.
    pub zeroed_pages: u64,
}

fn corrupt(what: impl Into<String>) -> RuntimeError {
    RuntimeError::Launch(format!(
        "the saved VM state is not as expected: {}",
        what.into()
    ))
}

fn read_at(file: &File, buf: &mut [u8], offset: u64, what: &str) -> Result<()> {
    file.read_exact_at(buf, offset)
        .map_err(RuntimeError::io(format!(
            "reading {what} of the saved VM state"
        )))
}

fn be_u32(b: &[u8]) -> u32 {
    u32::from_be_bytes(b[..4].try_into().expect("4 bytes"))
}

fn be_u64(b: &[u8]) -> u64 {
    u64::from_be_bytes(b[..8].try_into().expect("8 bytes"))
}

/// The RAM blocks of a state file QEMU saved with `mapped-ram`.
pub fn ram_areas(file: &File) -> Result<Vec<RamArea>> {
    let len = file
        .metadata()
        .map_err(RuntimeError::io("reading the saved VM state's size"))?
        .len();
    let mut head = vec![0u8; SEARCH_BYTES.min(len as usize)];
    read_at(file, &mut head, 0, "the head")?;
    if head.get(..4) != Some(b"QEVM".as_slice()) {
        return Err(corrupt("no QEVM magic"));
    }
    // Section start (1), section id (4), idstr "ram" (1 + 3), instance id
    // (4), version id (4), then the total RAM size with its flag.
    let at = head
        .windows(4)
        .enumerate()
        .filter(|(i, w)| *w == b"\x03ram" && *i >= 5 && head[i - 5] == 0x01)
        .map(|(i, _)| i + 4 + 8)
        .find(|&i| head.len() >= i + 8 && be_u64(&head[i..]) & FLAG_MEM_SIZE != 0)
        .ok_or_else(|| corrupt("no ram section"))?;
    let total = be_u64(&head[at..]) & !(PAGE - 1);
    let mut pos = at as u64 + 8;
    let mut areas = Vec::new();
    let mut seen = 0u64;
    while seen < total {
        let mut name_len = [0u8; 1];
        read_at(file, &mut name_len, pos, "a RAM block's name")?;
        let mut rest = vec![0u8; name_len[0] as usize + 8 + 28];
        read_at(file, &mut rest, pos + 1, "a RAM block's header")?;
        let n = name_len[0] as usize;
        let name = String::from_utf8_lossy(&rest[..n]).into_owned();
        let length = be_u64(&rest[n..]);
        let header = &rest[n + 8..];
        let (version, page_size) = (be_u32(header), be_u64(&header[4..]));
        if version != MAPPED_RAM_VERSION || page_size != PAGE {
            return Err(corrupt(format!(
                "block {name}: mapped-ram header version {version}, page size {page_size} \
                 (saved without mapped-ram, or with x-ignore-shared?)"
            )));
        }
        let area = RamArea {
            name,
            length,
            bitmap_offset: be_u64(&header[12..]),
            pages_offset: be_u64(&header[20..]),
        };
        if !length.is_multiple_of(PAGE)
            || !area.pages_offset.is_multiple_of(PAGE)
            || area.bitmap_offset + area.bitmap_bytes() > area.pages_offset
            || area.pages_offset + length > len
        {
            return Err(corrupt(format!("block {}: bad offsets", area.name)));
        }
        seen += length;
        pos = area.pages_offset + length;
        areas.push(area);
    }
    if seen != total {
        return Err(corrupt(format!(
            "blocks of {seen} bytes in a RAM of {total}"
        )));
    }
    Ok(areas)
}

/// Rewrites block `block` of the `mapped-ram` state file `state` to keep
/// only the pages that differ from `base`, the RAM image the block is
/// loaded over (a template's RAM file; `None`: zeros, as in a VM that
/// booted cold). See the module's doc.
pub fn keep_differences(state: &File, block: &str, base: Option<&File>) -> Result<Kept> {
    let area = ram_areas(state)?
        .into_iter()
        .find(|a| a.name == block)
        .ok_or_else(|| corrupt(format!("no RAM block {block}")))?;
    let mut bitmap = vec![0u8; area.bitmap_bytes() as usize];
    read_at(state, &mut bitmap, area.bitmap_offset, "the page bitmap")?;
    let mut words: Vec<u64> = bitmap
        .chunks_exact(8)
        .map(|w| u64::from_ne_bytes(w.try_into().expect("8 bytes")))
        .collect();
    let is_set = |words: &[u64], p: u64| words[(p / 64) as usize] & (1 << (p % 64)) != 0;
    let chunk = (CHUNK_PAGES * PAGE) as usize;
    let (mut saved, mut under) = (vec![0u8; chunk], vec![0u8; chunk]);
    let mut kept = Kept::default();
    let mut holes = Holes::new(state);
    let mut first = 0u64;
    while first < area.pages() {
        let count = CHUNK_PAGES.min(area.pages() - first);
        let bytes = (count * PAGE) as usize;
        let offset = first * PAGE;
        // A page without its mark is zero, whatever the file holds there.
        saved[..bytes].fill(0);
        if (first..first + count).any(|p| is_set(&words, p)) {
            read_at(
                state,
                &mut saved[..bytes],
                area.pages_offset + offset,
                "pages",
            )?;
            for i in (0..count).filter(|&i| !is_set(&words, first + i)) {
                saved[(i * PAGE) as usize..((i + 1) * PAGE) as usize].fill(0);
            }
        }
        match base {
            Some(base) => read_base(base, &mut under[..bytes], offset)?,
            None => under[..bytes].fill(0),
        }
        for i in 0..count {
            let p = first + i;
            let range = (i * PAGE) as usize..((i + 1) * PAGE) as usize;
            let page = &saved[range.clone()];
            let was_set = is_set(&words, p);
            let word = &mut words[(p / 64) as usize];
            let bit = 1u64 << (p % 64);
            if page == &under[range] {
                *word &= !bit;
                if was_set {
                    holes.add(area.pages_offset + p * PAGE)?;
                }
            } else if page.iter().all(|&b| b == 0) {
                *word |= bit;
                kept.zeroed_pages += 1;
                if was_set {
                    holes.add(area.pages_offset + p * PAGE)?;
                }
            } else {
                kept.data_pages += 1;
            }
        }
        first += count;
    }
    holes.flush()?;
    let bitmap: Vec<u8> = words.iter().flat_map(|w| w.to_ne_bytes()).collect();
    state
        .write_all_at(&bitmap, area.bitmap_offset)
        .map_err(RuntimeError::io(
            "writing the page bitmap of the saved VM state",
        ))?;
    Ok(kept)
}

/// Reads `buf.len()` bytes of the base at `offset`; past its end is zeros
/// (a RAM file may be shorter than the RAM it backs).
fn read_base(base: &File, buf: &mut [u8], offset: u64) -> Result<()> {
    let mut done = 0;
    while done < buf.len() {
        match base.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(RuntimeError::io("reading the base RAM image")(e)),
        }
    }
    buf[done..].fill(0);
    Ok(())
}

/// Consecutive pages to punch out of a file, punched a run at a time.
struct Holes<'a> {
    file: &'a File,
    run: Option<(u64, u64)>,
}

impl<'a> Holes<'a> {
    fn new(file: &'a File) -> Self {
        Holes { file, run: None }
    }

    fn add(&mut self, offset: u64) -> Result<()> {
        match &mut self.run {
            Some((start, len)) if *start + *len == offset => *len += PAGE,
            _ => {
                self.flush()?;
                self.run = Some((offset, PAGE));
            }
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        let Some((start, len)) = self.run.take() else {
            return Ok(());
        };
        // SAFETY: fallocate on an open descriptor with plain integers.
        let r = unsafe {
            libc::fallocate(
                self.file.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                start as libc::off_t,
                len as libc::off_t,
            )
        };
        if r != 0 {
            return Err(RuntimeError::io("punching out pages equal to the base")(
                std::io::Error::last_os_error(),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    /// A file laid out as QEMU 10.0 saves `mapped-ram`: a stream head, the
    /// `ram` section with each block's header, bitmap and pages (1 MiB
    /// aligned), then "device state".
    fn saved(blocks: &[(&str, &[Vec<u8>])]) -> tempfile::NamedTempFile {
        let f = tempfile::NamedTempFile::new().unwrap();
        let file = f.as_file();
        let mut head = b"QEVM\0\0\0\x03\x07\0\0\0\x0dconfiguration".to_vec();
        head.extend([
            0x01, 0, 0, 0, 2, 3, b'r', b'a', b'm', 0, 0, 0, 0, 0, 0, 0, 4,
        ]);
        let total: u64 = blocks.iter().map(|(_, p)| p.len() as u64 * PAGE).sum();
        head.extend((total | FLAG_MEM_SIZE).to_be_bytes());
        let mut pos = head.len() as u64;
        file.write_all_at(&head, 0).unwrap();
        for (name, pages) in blocks {
            let mut h = vec![name.len() as u8];
            h.extend(name.as_bytes());
            h.extend((pages.len() as u64 * PAGE).to_be_bytes());
            let bitmap_offset = pos + h.len() as u64 + 28;
            let bitmap_bytes = (pages.len() as u64).div_ceil(64) * 8;
            let pages_offset = (bitmap_offset + bitmap_bytes).next_multiple_of(1 << 20);
            h.extend(1u32.to_be_bytes());
            h.extend(PAGE.to_be_bytes());
            h.extend(bitmap_offset.to_be_bytes());
            h.extend(pages_offset.to_be_bytes());
            file.write_all_at(&h, pos).unwrap();
            let mut words = vec![0u64; bitmap_bytes as usize / 8];
            for (i, page) in pages.iter().enumerate() {
                if page.iter().any(|&b| b != 0) {
                    words[i / 64] |= 1 << (i % 64);
                    file.write_all_at(page, pages_offset + i as u64 * PAGE)
                        .unwrap();
                }
            }
            let bitmap: Vec<u8> = words.iter().flat_map(|w| w.to_ne_bytes()).collect();
            file.write_all_at(&bitmap, bitmap_offset).unwrap();
            pos = pages_offset + pages.len() as u64 * PAGE;
        }
        file.write_all_at(b"\x04devices\x00", pos).unwrap();
        f
    }

    fn page(byte: u8) -> Vec<u8> {
        vec![byte; PAGE as usize]
    }

    /// What QEMU's load leaves in RAM that starts as `base`.
    fn loaded(file: &File, area: &RamArea, base: &[Vec<u8>]) -> Vec<Vec<u8>> {
        let mut bitmap = vec![0u8; area.bitmap_bytes() as usize];
        file.read_exact_at(&mut bitmap, area.bitmap_offset).unwrap();
        base.iter()
            .enumerate()
            .map(|(i, b)| {
                if bitmap[i / 8] & (1 << (i % 8)) == 0 {
                    return b.clone();
                }
                let mut p = page(0);
                file.read_exact_at(&mut p, area.pages_offset + i as u64 * PAGE)
                    .unwrap();
                p
            })
            .collect()
    }

    #[test]
    fn the_blocks_of_a_saved_file_are_found() {
        let ram: Vec<Vec<u8>> = (0..70).map(|i| page(i as u8)).collect();
        let rom = vec![page(9)];
        let f = saved(&[("ram", &ram), ("/rom@etc/acpi/tables", &rom)]);
        let areas = ram_areas(f.as_file()).unwrap();
        assert_eq!(
            areas
                .iter()
                .map(|a| (a.name.as_str(), a.length))
                .collect::<Vec<_>>(),
            [("ram", 70 * PAGE), ("/rom@etc/acpi/tables", PAGE)]
        );
        assert_eq!(areas[0].pages_offset % (1 << 20), 0);
    }

    #[test]
    fn only_pages_that_differ_from_the_base_are_kept_and_the_load_is_the_same() {
        // Base: the template. Saved: the guest changed pages 3 and 100,
        // zeroed page 5, left the rest (including zero page 7) alone.
        let base: Vec<Vec<u8>> = (0..130)
            .map(|i| if i == 7 { page(0) } else { page(i as u8 + 1) })
            .collect();
        let mut ram = base.clone();
        ram[3] = page(0xaa);
        ram[100] = page(0xbb);
        ram[5] = page(0);
        let f = saved(&[("ram", &ram), ("rom", &[page(1)])]);
        let base_file = tempfile::NamedTempFile::new().unwrap();
        base_file.as_file().write_all_at(&base.concat(), 0).unwrap();
        let before = f.as_file().metadata().unwrap().blocks();

        let kept = keep_differences(f.as_file(), "ram", Some(base_file.as_file())).unwrap();
        assert_eq!(
            kept,
            Kept {
                data_pages: 2,
                zeroed_pages: 1
            }
        );
        let areas = ram_areas(f.as_file()).unwrap();
        assert_eq!(loaded(f.as_file(), &areas[0], &base), ram);
        let after = f.as_file().metadata().unwrap().blocks();
        assert!(
            after * 512 <= before * 512 - 120 * PAGE,
            "pages equal to the base still take room: {before} -> {after} blocks"
        );
        // The other block and what follows the RAM are as QEMU wrote them.
        assert_eq!(loaded(f.as_file(), &areas[1], &[page(0)]), [page(1)]);
        let mut tail = [0u8; 9];
        f.as_file()
            .read_exact_at(&mut tail, areas[1].pages_offset + PAGE)
            .unwrap();
        assert_eq!(&tail, b"\x04devices\x00");
    }

    #[test]
    fn without_a_base_zero_pages_stay_unmarked() {
        let ram = vec![page(0), page(4), page(0)];
        let f = saved(&[("ram", &ram)]);
        let kept = keep_differences(f.as_file(), "ram", None).unwrap();
        assert_eq!(kept.data_pages, 1);
        assert_eq!(kept.zeroed_pages, 0);
        let areas = ram_areas(f.as_file()).unwrap();
        assert_eq!(
            loaded(f.as_file(), &areas[0], &[page(0), page(0), page(0)]),
            ram
        );
    }

    #[test]
    fn a_file_saved_otherwise_is_refused() {
        let f = tempfile::NamedTempFile::new().unwrap();
        f.as_file()
            .write_all_at(b"QEVM\0\0\0\x03nothing here", 0)
            .unwrap();
        assert!(ram_areas(f.as_file()).is_err());
        assert!(keep_differences(f.as_file(), "ram", None).is_err());
    }
}
