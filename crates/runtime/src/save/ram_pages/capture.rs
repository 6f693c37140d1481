//! Capturing a stopped VM's RAM into a file of the chain: only the pages
//! that differ from what the chain's parent holds, written in large
//! vectored batches.

use super::*;

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
