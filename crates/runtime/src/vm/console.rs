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

/// What the host can tell of a guest that did not boot within its bound,
/// for the error and the log: QEMU's CPU time since it started (a guest
/// spinning somewhere shows the bound's worth, one starved by a busy host
/// little) and where each vCPU is (its instruction pointer, from QEMU's
/// monitor: stuck in one place or moving between two looks). Under TCG a
/// quiet guest kernel prints nothing while it boots, so without this a
/// boot that never came up left an empty console and no clue.
pub async fn stuck_boot(qmp_socket: &Path, qemu_pid: u32) -> String {
    let cpu = crate::host::cpu_ticks(qemu_pid)
        .map(|ticks| {
            format!(
                "QEMU used {:.1} s of CPU",
                ticks as f64 / crate::host::clock_ticks_per_second()
            )
        })
        .unwrap_or_else(|| "QEMU's CPU time is unknown".into());
    let rips = async {
        let mut qmp = super::qmp::Qmp::connect(qmp_socket).await.ok()?;
        let mut seen = Vec::new();
        // Twice, a moment apart: a vCPU in a tight loop stays put.
        for _ in 0..2 {
            let out = qmp
                .execute(
                    "human-monitor-command",
                    serde_json::json!({"command-line": "info registers -a"}),
                )
                .await
                .ok()?;
            seen.push(vcpu_positions(out.as_str().unwrap_or_default()).join(" "));
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        }
        Some(seen.join(", then "))
    };
    match tokio::time::timeout(std::time::Duration::from_secs(3), rips).await {
        Ok(Some(rips)) if !rips.trim().is_empty() => format!("{cpu}; vCPUs at {rips}"),
        _ => cpu,
    }
}

/// Each vCPU's `RIP=` from the monitor's `info registers -a`.
fn vcpu_positions(registers: &str) -> Vec<String> {
    registers
        .split_whitespace()
        .filter_map(|word| word.strip_prefix("RIP="))
        .map(str::to_string)
        .collect()
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

    #[test]
    fn each_vcpus_instruction_pointer_is_read_from_the_monitor() {
        let out = "\r\nCPU#0\r\nRAX=0000000000000000 RBX=ffffffff82a0e940\r\n\
                   RIP=ffffffff81e2b7d4 RFL=00000246 [---Z-P-] CPL=0 II=0 A20=1 SMM=0 HLT=1\r\n\
                   CPU#1\r\nRIP=ffffffff8106a1b2 RFL=00000002\r\n";
        assert_eq!(
            vcpu_positions(out),
            ["ffffffff81e2b7d4", "ffffffff8106a1b2"]
        );
        assert!(vcpu_positions("").is_empty());
    }
}
