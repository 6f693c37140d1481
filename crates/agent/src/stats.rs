//! `Stats`: the guest's CPU, memory and disk as its own kernel counts them,
//! for a sandbox's metrics (E2B's `get_metrics`).
//!
//! Only the guest knows what its programs use: from the host, a VM's memory
//! is what QEMU mapped (the page cache and freed pages included) and its
//! disk is the overlay's allocated size. So the host asks, and the agent
//! reads `/proc/stat`, `/proc/meminfo` and `statvfs("/")`, which costs a
//! few file reads and nothing that runs as the user. CPU time is sent as
//! cumulative ticks: the host turns two readings into a busy share.

use sandpit_protocol::{AgentError, ErrorKind, GuestStats};

/// The guest's resources now.
pub fn read() -> Result<GuestStats, AgentError> {
    let stat = std::fs::read_to_string("/proc/stat").map_err(io("/proc/stat"))?;
    let meminfo = std::fs::read_to_string("/proc/meminfo").map_err(io("/proc/meminfo"))?;
    let (cpu_count, cpu_busy_ticks, cpu_total_ticks) =
        cpu(&stat).ok_or_else(|| AgentError::new(ErrorKind::Io, "/proc/stat has no cpu line"))?;
    let mem = |key: &str| {
        meminfo_kib(&meminfo, key)
            .map(|kib| kib * 1024)
            .ok_or_else(|| AgentError::new(ErrorKind::Io, format!("/proc/meminfo has no {key}")))
    };
    let fs = nix::sys::statvfs::statvfs("/")
        .map_err(|e| AgentError::new(ErrorKind::Io, format!("statvfs /: {e}")))?;
    let block = fs.fragment_size() as u64;
    Ok(GuestStats {
        cpu_count,
        cpu_busy_ticks,
        cpu_total_ticks,
        mem_total_bytes: mem("MemTotal")?,
        mem_available_bytes: mem("MemAvailable")?,
        mem_cache_bytes: mem("Cached")?,
        disk_total_bytes: fs.blocks() as u64 * block,
        disk_used_bytes: (fs.blocks() as u64).saturating_sub(fs.blocks_free() as u64) * block,
    })
}

fn io(what: &'static str) -> impl Fn(std::io::Error) -> AgentError {
    move |e| AgentError::new(ErrorKind::Io, format!("reading {what}: {e}"))
}

/// CPUs online, busy ticks and all ticks, from `/proc/stat`: `cpu  user
/// nice system idle iowait irq softirq steal guest guest_nice`, then a
/// `cpuN` line per CPU.
fn cpu(stat: &str) -> Option<(u32, u64, u64)> {
    let mut lines = stat.lines();
    let first = lines.next()?.strip_prefix("cpu ")?;
    let fields: Vec<u64> = first
        .split_whitespace()
        .map(|f| f.parse().ok())
        .collect::<Option<_>>()?;
    // user nice system idle iowait irq softirq steal: guest time is counted
    // in user and nice already.
    let total: u64 = fields.iter().take(8).sum();
    let idle = fields.get(3)? + fields.get(4).unwrap_or(&0);
    let count = lines
        .filter(|l| l.starts_with("cpu") && l.as_bytes().get(3).is_some_and(u8::is_ascii_digit))
        .count() as u32;
    Some((count.max(1), total.saturating_sub(idle), total))
}

/// A `/proc/meminfo` value in KiB.
fn meminfo_kib(meminfo: &str, key: &str) -> Option<u64> {
    meminfo.lines().find_map(|l| {
        let rest = l.strip_prefix(key)?.strip_prefix(':')?;
        rest.split_whitespace().next()?.parse().ok()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_ticks_count_idle_and_iowait_as_not_busy() {
        let stat = "cpu  100 5 50 1000 20 3 2 1 7 0\n\
                    cpu0 50 2 25 500 10 1 1 0 3 0\n\
                    cpu1 50 3 25 500 10 2 1 1 4 0\n\
                    intr 12345\nctxt 999\n";
        // total = 100+5+50+1000+20+3+2+1; idle = 1000+20.
        assert_eq!(cpu(stat), Some((2, 161, 1181)));
        assert_eq!(cpu("intr 1\n"), None);
    }

    #[test]
    fn meminfo_values_are_read_by_exact_key() {
        let m = "MemTotal:        1004512 kB\nMemFree:          512000 kB\n\
                 MemAvailable:     800000 kB\nBuffers:            1000 kB\n\
                 Cached:           200000 kB\nSwapCached:           0 kB\n";
        assert_eq!(meminfo_kib(m, "MemTotal"), Some(1_004_512));
        assert_eq!(meminfo_kib(m, "Cached"), Some(200_000));
        assert_eq!(meminfo_kib(m, "Mem"), None);
    }

    #[test]
    fn this_machine_reads() {
        let s = read().expect("stats of the machine the test runs on");
        assert!(s.cpu_count >= 1);
        assert!(s.cpu_total_ticks >= s.cpu_busy_ticks);
        assert!(s.mem_total_bytes >= s.mem_available_bytes);
        assert!(s.disk_total_bytes >= s.disk_used_bytes && s.disk_total_bytes > 0);
    }
}
