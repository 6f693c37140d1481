//! One read-only file whose pages are other files' pages, composed by the
//! kernel: an EROFS image of a single chunk-based file, each 4 KiB chunk
//! pointing at a block of one of the image's extra devices (plain files
//! here) or at nothing (a zero page), mounted nowhere.
//!
//! This is how a save's guest RAM is put back together without copying it
//! (see `ram_image`): the template's RAM file and the save's RAM files are
//! the devices, and the file reads as the RAM the save describes. The kernel
//! reads a page from its device the first time something reads it, into
//! the file's own page cache, which every VM that maps the file shares.
//!
//! Only what that needs of the format is written (Linux's
//! `fs/erofs/erofs_fs.h`): a superblock, a device table, a root directory
//! with its entries inline and one file with 8-byte chunk indexes. Reading
//! plain files as devices (file-backed EROFS) needs Linux 6.12.

use std::ffi::CString;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// The block and chunk size.
pub const BLOCK: u64 = 4096;
const BLOCK_BITS: u8 = 12;
const SUPER_OFFSET: usize = 1024;
const MAGIC: u32 = 0xE0F5_E1E2;
const INCOMPAT_CHUNKED_FILE: u32 = 0x4;
const INCOMPAT_DEVICE_TABLE: u32 = 0x8;
/// The device table, in 128-byte slots, starts at byte 1280 of block 0.
const DEVICE_SLOT: usize = 128;
const DEVICE_SLOT_OFF: u16 = 10;
/// Devices a chunk can name besides the image itself.
pub const MAX_DEVICES: usize = 16;
/// Inodes are addressed in 32-byte slots from block 0; the root directory
/// is block 1's first.
const ROOT_NID: u64 = BLOCK / 32;
const LAYOUT_FLAT_INLINE: u16 = 2;
const LAYOUT_CHUNK_BASED: u16 = 4;
const CHUNK_FORMAT_INDEXES: u16 = 0x20;
const NULL_ADDR: u32 = u32::MAX;
const FT_REG_FILE: u8 = 1;
const FT_DIR: u8 = 2;

/// Where one chunk of the file reads from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Chunk {
    /// Zeros.
    Hole,
    /// Block `block` of device `device` (0 is the first extra device).
    At { device: u16, block: u32 },
}

/// Writes to `out` (empty) an image holding one file, `name`, of `size`
/// bytes whose chunk `i` reads as `chunks[i]` says (missing ones read as
/// zeros), over the extra devices whose lengths in bytes are `devices`.
pub fn write_image(
    out: &File,
    name: &str,
    size: u64,
    chunks: &[Chunk],
    devices: &[u64],
) -> std::io::Result<()> {
    let invalid = |m: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, m);
    if devices.len() > MAX_DEVICES {
        return Err(invalid(format!("{} devices", devices.len())));
    }
    if name.is_empty() || name.len() > 255 || name.contains('/') || name.starts_with('.') {
        return Err(invalid(format!("file name {name:?}")));
    }
    let count = size.div_ceil(BLOCK) as usize;
    if chunks.len() > count {
        return Err(invalid(format!("{} chunks for {size} bytes", chunks.len())));
    }
    let blocks_of =
        |bytes: u64| u32::try_from(bytes / BLOCK).map_err(|_| invalid("too large".into()));

    // Block 1: the root directory (a compact inode, its entries inline),
    // then the file (an extended inode, then its chunk indexes).
    let root_at = BLOCK as usize;
    let names: [(&[u8], u64, u8); 3] = [
        (b".", ROOT_NID, FT_DIR),
        (b"..", ROOT_NID, FT_DIR),
        (name.as_bytes(), 0, FT_REG_FILE),
    ];
    let entries = 12 * names.len();
    let dir_len = entries + names.iter().map(|n| n.0.len()).sum::<usize>();
    let file_at = (root_at + 32 + dir_len).next_multiple_of(32);
    let file_nid = (file_at / 32) as u64;
    let mut meta = vec![0u8; file_at + 64];

    let mut dir = Vec::with_capacity(dir_len);
    let mut name_at = entries as u16;
    for (n, nid, kind) in &names {
        let nid = if *kind == FT_REG_FILE { file_nid } else { *nid };
        dir.extend_from_slice(&nid.to_le_bytes());
        dir.extend_from_slice(&name_at.to_le_bytes());
        dir.extend_from_slice(&[*kind, 0]);
        name_at += n.len() as u16;
    }
    for (n, _, _) in &names {
        dir.extend_from_slice(n);
    }
    let root = &mut meta[root_at..root_at + 32];
    put16(root, 0, LAYOUT_FLAT_INLINE << 1); // compact
    put16(root, 4, 0o040755);
    put16(root, 6, 2); // links
    put32(root, 8, dir_len as u32);
    put32(root, 20, 1); // ino
    meta[root_at + 32..root_at + 32 + dir_len].copy_from_slice(&dir);

    let file = &mut meta[file_at..file_at + 64];
    put16(file, 0, 1 | (LAYOUT_CHUNK_BASED << 1)); // extended
    put16(file, 4, 0o100444);
    put64(file, 8, size);
    put16(file, 16, CHUNK_FORMAT_INDEXES); // chunks of one block
    put32(file, 20, 2); // ino
    put32(file, 44, 1); // links

    let mut indexes = vec![0u8; count * 8];
    for i in 0..count {
        let (device, block) = match chunks.get(i).copied().unwrap_or(Chunk::Hole) {
            Chunk::Hole => (0, NULL_ADDR),
            Chunk::At { device, block } => {
                if device as usize >= devices.len() || block == NULL_ADDR {
                    return Err(invalid(format!("chunk {i} is at {device}:{block}")));
                }
                (device + 1, block)
            }
        };
        put16(&mut indexes[i * 8..], 2, device);
        put32(&mut indexes[i * 8..], 4, block);
    }
    let total = (meta.len() + indexes.len()) as u64;

    // Block 0: the superblock and the device table.
    let sb = &mut meta[SUPER_OFFSET..SUPER_OFFSET + 128];
    put32(sb, 0, MAGIC);
    sb[12] = BLOCK_BITS;
    put16(sb, 14, ROOT_NID as u16);
    put64(sb, 16, 2); // inodes
    put32(sb, 36, blocks_of(total.next_multiple_of(BLOCK))?);
    sb[64..71].copy_from_slice(b"sandpit");
    put32(sb, 80, INCOMPAT_CHUNKED_FILE | INCOMPAT_DEVICE_TABLE);
    put16(sb, 86, devices.len() as u16);
    put16(sb, 88, DEVICE_SLOT_OFF);
    for (i, len) in devices.iter().enumerate() {
        let at = DEVICE_SLOT_OFF as usize * DEVICE_SLOT + i * DEVICE_SLOT;
        let blocks = blocks_of(len.next_multiple_of(BLOCK))?;
        put32(&mut meta[at..], 64, blocks);
    }

    out.write_all_at(&meta, 0)?;
    out.write_all_at(&indexes, meta.len() as u64)?;
    out.set_len(total.next_multiple_of(BLOCK))
}

fn put16(b: &mut [u8], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_le_bytes());
}
fn put32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}
fn put64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// A new file for an image, in memory: on a ramfs of its own, mounted
/// nowhere and unlinked, so it lives as long as a descriptor of it (or the
/// mount made from it). Not on the data directory's filesystem, where
/// writing it would wait behind the writeback of the save just written,
/// and not in a memfd or tmpfs, which EROFS cannot read from. Needs
/// `CAP_SYS_ADMIN`.
pub fn scratch_file() -> std::io::Result<File> {
    let fs = open_fs(c"ramfs")?;
    let mount = mount_detached(&fs, "making a ramfs")?;
    let name = c"image";
    // SAFETY: plain calls with a valid C string.
    let file = fd_of(unsafe {
        libc::openat(
            mount.as_raw_fd(),
            name.as_ptr(),
            libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC,
            0o600 as libc::c_uint,
        )
    } as libc::c_long)?;
    // SAFETY: as above.
    if unsafe { libc::unlinkat(mount.as_raw_fd(), name.as_ptr(), 0) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(File::from(file))
}

/// Mounts image `image` (a descriptor of a regular file; it can be
/// unlinked) over files `devices`, in their order, attached nowhere: the
/// mount lives as long as the returned descriptor or a file opened through
/// it. Needs `CAP_SYS_ADMIN` and file-backed EROFS (Linux 6.12).
pub fn mount(image: &File, devices: &[PathBuf]) -> std::io::Result<OwnedFd> {
    let fs = open_fs(c"erofs")?;
    let source = PathBuf::from(format!("/proc/self/fd/{}", image.as_raw_fd()));
    let set = |key: &str, value: &Path| -> std::io::Result<()> {
        let key = CString::new(key).expect("no NUL");
        let value = CString::new(value.as_os_str().as_encoded_bytes())
            .map_err(|_| std::io::Error::other("a path with a NUL"))?;
        // SAFETY: a plain syscall with valid C strings.
        let r = unsafe {
            libc::syscall(
                libc::SYS_fsconfig,
                fs.as_raw_fd(),
                libc::FSCONFIG_SET_STRING,
                key.as_ptr(),
                value.as_ptr(),
                0,
            )
        };
        if r != 0 {
            return Err(failed(
                &fs,
                &format!("{} {}", key.to_string_lossy(), value.to_string_lossy()),
            ));
        }
        Ok(())
    };
    set("source", &source)?;
    for d in devices {
        set("device", d)?;
    }
    mount_detached(&fs, "mounting")
}

/// A new filesystem context of type `kind`.
fn open_fs(kind: &std::ffi::CStr) -> std::io::Result<OwnedFd> {
    fd_of(unsafe {
        // SAFETY: a plain syscall with a valid C string.
        libc::syscall(libc::SYS_fsopen, kind.as_ptr(), libc::FSOPEN_CLOEXEC)
    })
}

/// The filesystem of context `fs` made, and mounted nowhere.
fn mount_detached(fs: &OwnedFd, doing: &str) -> std::io::Result<OwnedFd> {
    // SAFETY: a plain syscall on our descriptor.
    let created = unsafe {
        libc::syscall(
            libc::SYS_fsconfig,
            fs.as_raw_fd(),
            libc::FSCONFIG_CMD_CREATE,
            std::ptr::null::<libc::c_char>(),
            std::ptr::null::<libc::c_void>(),
            0,
        )
    };
    if created != 0 {
        return Err(failed(fs, doing));
    }
    fd_of(unsafe {
        // SAFETY: a plain syscall on our descriptor.
        libc::syscall(libc::SYS_fsmount, fs.as_raw_fd(), libc::FSMOUNT_CLOEXEC, 0)
    })
}

/// The last error, with what the kernel logged on the filesystem context.
fn failed(fs: &OwnedFd, doing: &str) -> std::io::Error {
    let e = std::io::Error::last_os_error();
    let mut log = String::new();
    let mut buf = [0u8; 512];
    loop {
        // SAFETY: reading into our buffer from our descriptor.
        let n = unsafe { libc::read(fs.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if n <= 0 {
            break;
        }
        log.push_str(&String::from_utf8_lossy(&buf[..n as usize]));
        log.push(' ');
    }
    std::io::Error::new(e.kind(), format!("EROFS {doing}: {e} {}", log.trim()))
}

fn fd_of(r: libc::c_long) -> std::io::Result<OwnedFd> {
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor that we then own.
    Ok(unsafe { OwnedFd::from_raw_fd(r as i32) })
}

/// `name` in a mount made by [`mount`], opened read-only.
pub fn open_in(mount: &OwnedFd, name: &str) -> std::io::Result<File> {
    let name = CString::new(name).map_err(|_| std::io::Error::other("a name with a NUL"))?;
    // SAFETY: a plain call with a valid C string.
    let fd = unsafe {
        libc::openat(
            mount.as_raw_fd(),
            name.as_ptr(),
            libc::O_RDONLY | libc::O_CLOEXEC,
        )
    };
    Ok(File::from(fd_of(fd as libc::c_long)?))
}

/// Does this host compose files as [`mount`] does (root, Linux 6.12 or
/// later with EROFS)? A one-page image over a scratch file is mounted and
/// read back: what a start from a save would do, in small.
pub fn probe() -> std::io::Result<()> {
    let device = std::env::temp_dir().join(format!(
        ".sandpit-erofs-probe-{}-{:08x}",
        std::process::id(),
        rand::random::<u32>()
    ));
    let page: Vec<u8> = (0..BLOCK).map(|i| (i % 251) as u8).collect();
    std::fs::write(&device, &page)?;
    let read = (|| {
        let image = scratch_file()?;
        let chunk = Chunk::At {
            device: 0,
            block: 0,
        };
        write_image(&image, "probe", BLOCK, &[chunk], &[BLOCK])?;
        let mnt = mount(&image, std::slice::from_ref(&device))?;
        let mut got = vec![0; BLOCK as usize];
        open_in(&mnt, "probe")?.read_exact_at(&mut got, 0)?;
        Ok::<_, std::io::Error>(got)
    })();
    let _ = std::fs::remove_file(&device);
    match read? == page {
        true => Ok(()),
        false => Err(std::io::Error::other("the mounted file reads wrong")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    fn pattern(seed: u8, blocks: usize) -> Vec<u8> {
        (0..blocks * BLOCK as usize)
            .map(|i| {
                seed.wrapping_add((i / BLOCK as usize) as u8)
                    .wrapping_mul(3)
                    | 1
            })
            .collect()
    }

    #[test]
    fn a_mounted_image_reads_as_its_chunks_say() {
        let dir = tempfile::tempdir().unwrap();
        let a = pattern(1, 40);
        let b = pattern(7, 9);
        std::fs::write(dir.path().join("a"), &a).unwrap();
        std::fs::write(dir.path().join("b"), &b).unwrap();
        let size = 100 * BLOCK + 100; // a last chunk cut short
        let mut chunks = Vec::new();
        let mut want = Vec::new();
        for i in 0..95u32 {
            let (chunk, bytes): (Chunk, &[u8]) = match i % 4 {
                0 => (
                    Chunk::At {
                        device: 0,
                        block: i % 40,
                    },
                    &a[(i % 40) as usize * 4096..][..4096],
                ),
                1 => (
                    Chunk::At {
                        device: 1,
                        block: 8 - i % 9,
                    },
                    &b[(8 - i % 9) as usize * 4096..][..4096],
                ),
                _ => (Chunk::Hole, &[0u8; 4096]),
            };
            chunks.push(chunk);
            want.extend_from_slice(bytes);
        }
        want.resize(size as usize, 0); // the chunks not given are zeros
        let image = scratch_file().expect("making a ramfs needs root");
        write_image(
            &image,
            "ram",
            size,
            &chunks,
            &[a.len() as u64, b.len() as u64],
        )
        .unwrap();
        let mnt = mount(&image, &[dir.path().join("a"), dir.path().join("b")]).expect(
            "mounting an EROFS image over plain files needs root and Linux 6.12 or later \
             with EROFS (CONFIG_EROFS_FS)",
        );
        drop(image);
        let mut file = open_in(&mnt, "ram").unwrap();
        drop(mnt);
        assert_eq!(file.metadata().unwrap().len(), size);
        let mut got = Vec::new();
        file.read_to_end(&mut got).unwrap();
        assert!(got == want, "the file reads other bytes");
        assert!(cannot_be_opened_for_writing(&file));

        // Refused: a chunk on a device that is not there, too many chunks.
        let bad = tempfile::tempfile().unwrap();
        assert!(write_image(
            &bad,
            "ram",
            BLOCK,
            &[Chunk::At {
                device: 2,
                block: 0
            }],
            &[BLOCK, BLOCK]
        )
        .is_err());
        assert!(write_image(&bad, "ram", BLOCK, &[Chunk::Hole, Chunk::Hole], &[]).is_err());
        assert!(write_image(&bad, "../x", BLOCK, &[], &[]).is_err());
    }

    /// The file cannot be written, even by root.
    fn cannot_be_opened_for_writing(file: &File) -> bool {
        std::fs::OpenOptions::new()
            .write(true)
            .open(format!("/proc/self/fd/{}", file.as_raw_fd()))
            .is_err()
    }
}
