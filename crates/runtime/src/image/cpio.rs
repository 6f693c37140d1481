//! A writer (and, for tests and checks, a reader) of the `newc` cpio format,
//! the format the Linux kernel unpacks as an initramfs.
//!
//! Why write it ourselves: the format is a 110-byte ASCII header per entry,
//! and owning it gives byte-for-byte deterministic output (fixed inode
//! numbers, owners and times) from the same inputs, lets the archive contain
//! device nodes such as `/dev/console` without `mknod` on the host, and is one
//! host tool less. The archive is left uncompressed: a few megabytes that the
//! kernel unpacks faster than it could decompress them.

use std::io::{self, Write};

const MAGIC: &[u8; 6] = b"070701";
const TRAILER: &str = "TRAILER!!!";

pub(crate) const S_IFDIR: u32 = 0o040_000;
pub(crate) const S_IFREG: u32 = 0o100_000;
pub(crate) const S_IFLNK: u32 = 0o120_000;
pub(crate) const S_IFCHR: u32 = 0o020_000;

/// Writes a newc archive entry by entry. Paths are relative (`bin/busybox`);
/// parents must be written before their children.
pub(crate) struct CpioWriter<W: Write> {
    out: W,
    next_ino: u32,
    offset: u64,
}

impl<W: Write> CpioWriter<W> {
    pub(crate) fn new(out: W) -> Self {
        Self {
            out,
            next_ino: 1,
            offset: 0,
        }
    }

    pub(crate) fn dir(&mut self, path: &str, perm: u32) -> io::Result<()> {
        self.entry(path, S_IFDIR | (perm & 0o7777), 2, (0, 0), &[])
    }

    pub(crate) fn file(&mut self, path: &str, perm: u32, data: &[u8]) -> io::Result<()> {
        self.entry(path, S_IFREG | (perm & 0o7777), 1, (0, 0), data)
    }

    pub(crate) fn symlink(&mut self, path: &str, target: &str) -> io::Result<()> {
        self.entry(path, S_IFLNK | 0o777, 1, (0, 0), target.as_bytes())
    }

    pub(crate) fn char_dev(
        &mut self,
        path: &str,
        perm: u32,
        major: u32,
        minor: u32,
    ) -> io::Result<()> {
        self.entry(path, S_IFCHR | (perm & 0o7777), 1, (major, minor), &[])
    }

    /// Writes the trailer and returns the underlying writer.
    pub(crate) fn finish(mut self) -> io::Result<W> {
        self.next_ino = 0;
        self.entry(TRAILER, 0, 1, (0, 0), &[])?;
        self.out.flush()?;
        Ok(self.out)
    }

    fn entry(
        &mut self,
        name: &str,
        mode: u32,
        nlink: u32,
        rdev: (u32, u32),
        data: &[u8],
    ) -> io::Result<()> {
        if name.is_empty() || name.contains('\0') {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("bad cpio path {name:?}"),
            ));
        }
        let size = u32::try_from(data.len()).map_err(|_| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{name}: file too large for cpio"),
            )
        })?;
        let ino = self.next_ino;
        if ino != 0 {
            self.next_ino += 1;
        }
        let namesize = name.len() as u32 + 1;
        let fields = [
            ino, mode, 0, /* uid */ 0, /* gid */ nlink, 0, /* mtime */ size,
            0, /* devmajor */
            0, /* devminor */ rdev.0, rdev.1, namesize, 0, /* check */
        ];
        let mut header = Vec::with_capacity(110 + name.len() + 4);
        header.extend_from_slice(MAGIC);
        for f in fields {
            header.extend_from_slice(format!("{f:08X}").as_bytes());
        }
        header.extend_from_slice(name.as_bytes());
        header.push(0);
        self.write_padded(&header)?;
        self.write_padded(data)
    }

    fn write_padded(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.out.write_all(bytes)?;
        self.offset += bytes.len() as u64;
        let pad = (4 - (self.offset % 4)) % 4;
        self.out.write_all(&[0u8; 3][..pad as usize])?;
        self.offset += pad;
        Ok(())
    }
}

/// One entry read back from an archive.
#[cfg(test)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CpioEntry {
    pub name: String,
    pub mode: u32,
    pub rdev: (u32, u32),
    pub data: Vec<u8>,
}

/// Parses a whole newc archive (up to the trailer).
#[cfg(test)]
pub(crate) fn read_archive(bytes: &[u8]) -> io::Result<Vec<CpioEntry>> {
    let bad = |what: &str| io::Error::new(io::ErrorKind::InvalidData, format!("cpio: {what}"));
    let align = |x: usize| (x + 3) & !3;
    let mut entries = Vec::new();
    let mut pos = 0usize;
    loop {
        let header = bytes
            .get(pos..pos + 110)
            .ok_or_else(|| bad("truncated header"))?;
        if &header[..6] != MAGIC {
            return Err(bad("bad magic"));
        }
        let field = |i: usize| -> io::Result<u32> {
            let s = std::str::from_utf8(&header[6 + i * 8..14 + i * 8])
                .map_err(|_| bad("non-ASCII header"))?;
            u32::from_str_radix(s, 16).map_err(|_| bad("bad hex field"))
        };
        let mode = field(1)?;
        let size = field(6)? as usize;
        let rdev = (field(9)?, field(10)?);
        let namesize = field(11)? as usize;
        let name_bytes = bytes
            .get(pos + 110..pos + 110 + namesize)
            .ok_or_else(|| bad("truncated name"))?;
        let name = std::str::from_utf8(
            name_bytes
                .strip_suffix(&[0])
                .ok_or_else(|| bad("name not NUL-terminated"))?,
        )
        .map_err(|_| bad("name not UTF-8"))?
        .to_string();
        let data_start = align(pos + 110 + namesize);
        let data = bytes
            .get(data_start..data_start + size)
            .ok_or_else(|| bad("truncated data"))?
            .to_vec();
        pos = align(data_start + size);
        if name == TRAILER {
            return Ok(entries);
        }
        entries.push(CpioEntry {
            name,
            mode,
            rdev,
            data,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<u8> {
        let mut w = CpioWriter::new(Vec::new());
        w.dir("bin", 0o755).unwrap();
        w.file("bin/busybox", 0o755, b"\x7fELF not really").unwrap();
        w.symlink("bin/sh", "busybox").unwrap();
        w.dir("dev", 0o755).unwrap();
        w.char_dev("dev/console", 0o600, 5, 1).unwrap();
        w.file("init", 0o755, b"#!/bin/sh\n").unwrap();
        w.file("empty", 0o644, b"").unwrap();
        w.finish().unwrap()
    }

    #[test]
    fn round_trip() {
        let bytes = sample();
        assert_eq!(bytes.len() % 4, 0);
        let entries = read_archive(&bytes).unwrap();
        let names: Vec<_> = entries.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "bin",
                "bin/busybox",
                "bin/sh",
                "dev",
                "dev/console",
                "init",
                "empty"
            ]
        );
        assert_eq!(entries[1].mode, S_IFREG | 0o755);
        assert_eq!(entries[1].data, b"\x7fELF not really");
        assert_eq!(entries[2].mode, S_IFLNK | 0o777);
        assert_eq!(entries[2].data, b"busybox");
        assert_eq!(entries[4].mode, S_IFCHR | 0o600);
        assert_eq!(entries[4].rdev, (5, 1));
        assert!(entries[6].data.is_empty());
    }

    #[test]
    fn deterministic() {
        assert_eq!(sample(), sample());
    }

    /// GNU cpio, where installed, must read our archive the same way.
    #[test]
    fn gnu_cpio_lists_it() {
        use std::process::{Command, Stdio};
        let Ok(mut child) = Command::new("cpio")
            .args(["-t", "--quiet"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
        else {
            eprintln!("cpio not installed; skipping");
            return;
        };
        child.stdin.take().unwrap().write_all(&sample()).unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success());
        let listed = String::from_utf8(out.stdout).unwrap();
        assert_eq!(
            listed.lines().collect::<Vec<_>>(),
            [
                "bin",
                "bin/busybox",
                "bin/sh",
                "dev",
                "dev/console",
                "init",
                "empty"
            ]
        );
    }
}
