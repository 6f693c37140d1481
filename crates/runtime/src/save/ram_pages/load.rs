//! Loading a chain's pages into a new QEMU's RAM, batch by batch, with
//! the reads pipelined behind the writes.

use super::*;

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

pub(super) fn read_bitmap(file: &File, area: &RamArea, offset: u64) -> Result<Vec<u64>> {
    let mut bytes = vec![0u8; area.bitmap_words() * 8];
    file.read_exact_at(&mut bytes, offset)
        .map_err(RuntimeError::io("reading the saved RAM's bitmaps"))?;
    Ok(bytes
        .chunks_exact(8)
        .map(|w| u64::from_ne_bytes(w.try_into().expect("8 bytes")))
        .collect())
}
