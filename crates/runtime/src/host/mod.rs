//! What this host has and what its processes use, read from `/proc`: the
//! one place that parses those files, for admission (`sandpit_core`'s
//! capacity), the metrics and the bench.
//!
//! Every reader returns `None` (or a zero) rather than an error: a process
//! that ended between listing and reading is normal, and a figure that
//! cannot be read must not fail the call that wanted it.

pub mod accel;
pub mod ksm;

use std::path::Path;

/// The host's memory, MiB.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Memory {
    pub total_mb: u64,
    /// What the kernel estimates it can give new work without swapping
    /// (`MemAvailable`: free memory plus reclaimable caches).
    pub available_mb: u64,
}

/// `/proc/meminfo`'s total and available memory.
pub fn memory() -> Option<Memory> {
    parse_meminfo(&std::fs::read_to_string("/proc/meminfo").ok()?)
}

pub fn parse_meminfo(text: &str) -> Option<Memory> {
    let kib = |key: &str| -> Option<u64> {
        let line = text.lines().find(|l| l.starts_with(key))?;
        line[key.len()..].split_whitespace().next()?.parse().ok()
    };
    Some(Memory {
        total_mb: kib("MemTotal:")? / 1024,
        available_mb: kib("MemAvailable:")? / 1024,
    })
}

/// Clock ticks per second, the unit of `/proc/PID/stat`'s CPU times.
pub fn clock_ticks_per_second() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if ticks > 0 {
        ticks as f64
    } else {
        100.0
    }
}

/// CPUs this process may run on.
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// utime + stime of process `pid` (all its threads), in clock ticks.
pub fn cpu_ticks(pid: u32) -> Option<u64> {
    parse_cpu_ticks(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// utime + stime from a `/proc/PID/stat` line: fields 14 and 15, counted
/// after the command name, which may hold spaces and parentheses.
pub fn parse_cpu_ticks(stat: &str) -> Option<u64> {
    let after_name = &stat[stat.rfind(')')? + 1..];
    let mut fields = after_name.split_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
}

/// Bytes process `pid` has read and written through system calls so far
/// (`rchar` + `wchar` of `/proc/PID/io`): for passt, the guest's network
/// traffic both ways.
pub fn io_bytes(pid: u32) -> Option<u64> {
    parse_io_bytes(&std::fs::read_to_string(format!("/proc/{pid}/io")).ok()?)
}

/// `rchar` + `wchar` from a `/proc/PID/io` text.
pub fn parse_io_bytes(io: &str) -> Option<u64> {
    let field = |name: &str| -> Option<u64> {
        io.lines()
            .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
    };
    Some(field("rchar:")? + field("wchar:")?)
}

/// Rss and Pss of process `pid`, in bytes.
pub fn process_memory(pid: u32) -> Option<(u64, u64)> {
    parse_smaps_rollup(&std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?)
}

pub fn parse_smaps_rollup(rollup: &str) -> Option<(u64, u64)> {
    let kib = |key: &str| -> Option<u64> {
        let line = rollup.lines().find(|l| l.starts_with(key))?;
        line[key.len()..].split_whitespace().next()?.parse().ok()
    };
    Some((kib("Rss:")? * 1024, kib("Pss:")? * 1024))
}

/// Tasks (threads) on the host now, and the most the kernel allows: the
/// smaller of `kernel.pid_max` and `kernel.threads-max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Tasks {
    pub now: u64,
    pub max: u64,
}

pub fn tasks() -> Option<Tasks> {
    let now = parse_loadavg_tasks(&std::fs::read_to_string("/proc/loadavg").ok()?)?;
    let read = |p: &str| -> Option<u64> { std::fs::read_to_string(p).ok()?.trim().parse().ok() };
    let max = match (
        read("/proc/sys/kernel/pid_max"),
        read("/proc/sys/kernel/threads-max"),
    ) {
        (Some(a), Some(b)) => a.min(b),
        (a, b) => a.or(b)?,
    };
    Some(Tasks { now, max })
}

/// The task count of `/proc/loadavg` (`0.10 0.20 0.30 1/650 1234`: 650).
pub fn parse_loadavg_tasks(text: &str) -> Option<u64> {
    text.split_whitespace()
        .nth(3)?
        .split_once('/')?
        .1
        .parse()
        .ok()
}

/// File descriptors this process holds, and its limit (`RLIMIT_NOFILE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Descriptors {
    pub open: u64,
    pub limit: u64,
}

pub fn descriptors() -> Option<Descriptors> {
    let open = std::fs::read_dir(Path::new("/proc/self/fd")).ok()?.count() as u64;
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit fills a local struct.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return None;
    }
    Some(Descriptors {
        open,
        limit: lim.rlim_cur,
    })
}

/// Raise this process's descriptor limit to its hard limit; returns the
/// limit in force. A server holds a few descriptors per VM and per
/// connection, and the soft limit of a login shell (1024) runs out long
/// before the machine does.
pub fn raise_descriptor_limit() -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit on a local struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: lim.rlim_max,
                rlim_max: lim.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                lim = raised;
            }
        }
    }
    lim.rlim_cur
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_time_is_read_after_the_command_name() {
        let stat = "1234 (qemu (x) 1) S 1 1234 1234 0 -1 4194560 100 0 0 0 250 50 0 0 20 0";
        assert_eq!(parse_cpu_ticks(stat), Some(300));
        assert_eq!(parse_cpu_ticks("garbage"), None);
    }

    #[test]
    fn io_bytes_are_read_and_written_together() {
        let io = "rchar: 1000\nwchar: 24\nsyscr: 5\nsyscw: 2\nread_bytes: 0\n";
        assert_eq!(parse_io_bytes(io), Some(1024));
        assert_eq!(parse_io_bytes("syscr: 5\n"), None);
    }

    #[test]
    fn memory_is_read_from_smaps_rollup() {
        let rollup =
            "00400000-7ffd [rollup]\nRss:              2048 kB\nPss:              1024 kB\n";
        assert_eq!(parse_smaps_rollup(rollup), Some((2048 * 1024, 1024 * 1024)));
    }

    #[test]
    fn meminfo_gives_total_and_available() {
        let text =
            "MemTotal:       24576000 kB\nMemFree:         1000 kB\nMemAvailable:   12288000 kB\n";
        assert_eq!(
            parse_meminfo(text),
            Some(Memory {
                total_mb: 24000,
                available_mb: 12000
            })
        );
        assert_eq!(parse_meminfo("MemTotal: 1 kB\n"), None);
    }

    #[test]
    fn loadavg_gives_the_task_count() {
        assert_eq!(parse_loadavg_tasks("2.24 1.28 0.52 1/650 29137"), Some(650));
        assert_eq!(parse_loadavg_tasks("2.24"), None);
    }

    #[test]
    fn this_host_reads() {
        let m = memory().unwrap();
        assert!(m.total_mb > 0 && m.available_mb <= m.total_mb, "{m:?}");
        let t = tasks().unwrap();
        assert!(t.now > 0 && t.max > t.now, "{t:?}");
        let d = descriptors().unwrap();
        assert!(d.open > 0 && d.limit >= d.open, "{d:?}");
        assert!(cpu_ticks(std::process::id()).is_some());
        assert!(process_memory(std::process::id()).unwrap().1 > 0);
    }
}
