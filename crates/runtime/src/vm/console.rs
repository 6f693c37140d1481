//! The guest console log: captured to a file by QEMU (append mode), kept
//! bounded by the host, and read back to explain failures.
//!
//! The agent lowers the console log level after boot, so a healthy guest writes
//! almost nothing; the cap guards against a misbehaving kernel. Because QEMU
//! opens the file with `append=on`, the host may cut it at any time and QEMU's
//! next write lands at the new end.

use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

/// Console logs larger than this are cut down to their last [`KEEP_BYTES`].
pub const MAX_BYTES: u64 = 1024 * 1024;
/// What is kept when a console log is cut.
pub const KEEP_BYTES: u64 = 256 * 1024;

/// The last `max` bytes of a file as lossy UTF-8 (empty if it is missing).
pub fn tail(path: &Path, max: u64) -> String {
    let Ok(mut f) = std::fs::File::open(path) else {
        return String::new();
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let start = len.saturating_sub(max);
    let _ = f.seek(SeekFrom::Start(start));
    let mut buf = Vec::new();
    let _ = f.read_to_end(&mut buf);
    String::from_utf8_lossy(&buf).into_owned()
}

/// The last `n` lines of a file.
pub fn tail_lines(path: &Path, n: usize) -> String {
    let t = tail(path, 64 * 1024);
    let lines: Vec<&str> = t.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Cut the log to its tail if it grew past the cap.
pub fn enforce_cap(path: &Path) {
    let Ok(meta) = std::fs::metadata(path) else {
        return;
    };
    if meta.len() <= MAX_BYTES {
        return;
    }
    let keep = tail(path, KEEP_BYTES);
    let _ = std::fs::write(path, keep.as_bytes());
}

/// Why a guest went away, read from its console and QEMU's own log.
pub fn exit_cause(console: &Path, qemu_log: &Path) -> String {
    let con = tail(console, 64 * 1024);
    let qemu = tail(qemu_log, 16 * 1024);
    if let Some(line) = con.lines().rev().find(|l| l.contains("Kernel panic")) {
        return format!("guest kernel panic: {}", line.trim());
    }
    if con.contains("reboot: Power down") {
        return "guest powered off".into();
    }
    if con.contains("reboot: Restarting system") {
        return "guest rebooted".into();
    }
    if let Some(line) = con.lines().rev().find(|l| l.contains("sandpit-init:")) {
        return format!("guest failed to start: {}", line.trim());
    }
    if let Some(line) = qemu
        .lines()
        .rev()
        .find(|l| l.contains("terminating on signal"))
    {
        return format!("QEMU was killed ({})", line.trim());
    }
    match qemu.lines().rev().find(|l| !l.trim().is_empty()) {
        Some(line) => format!("QEMU exited: {}", line.trim()),
        None => "QEMU exited unexpectedly".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn causes_are_read_from_the_console() {
        let d = tempfile::tempdir().unwrap();
        let con = d.path().join("console.log");
        let q = d.path().join("qemu.log");
        std::fs::write(&con, "boot\n[ 3.1] reboot: Power down\n").unwrap();
        assert_eq!(exit_cause(&con, &q), "guest powered off");
        std::fs::write(
            &con,
            "x\n[ 1.0] Kernel panic - not syncing: Attempted to kill init!\n",
        )
        .unwrap();
        assert!(exit_cause(&con, &q).starts_with("guest kernel panic"));
        std::fs::write(&con, "").unwrap();
        std::fs::write(
            &q,
            "qemu-system-x86_64: terminating on signal 9 from pid 1\n",
        )
        .unwrap();
        assert!(exit_cause(&con, &q).starts_with("QEMU was killed"));
    }

    #[test]
    fn the_cap_keeps_the_tail() {
        let d = tempfile::tempdir().unwrap();
        let con = d.path().join("console.log");
        let mut big = vec![b'a'; (MAX_BYTES + 10) as usize];
        big.extend_from_slice(b"THE END");
        std::fs::write(&con, &big).unwrap();
        enforce_cap(&con);
        let len = std::fs::metadata(&con).unwrap().len();
        assert!(len <= KEEP_BYTES);
        assert!(tail(&con, 100).ends_with("THE END"));
    }
}
