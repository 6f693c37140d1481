//! Kernel same-page merging (KSM) for the network helper's memory, never for
//! guest memory.
//!
//! Debian 12's passt writes all of its static frame buffers when it starts:
//! about 16 MiB in every sandbox, most of it zeros and the rest the same
//! frame headers in every sandbox (each guest has the same addresses behind
//! its own NAT). Those pages never change while the sandbox is idle, so KSM
//! folds them into one copy, which is most of an idle sandbox's host memory
//! after QEMU's own.
//!
//! Only passt opts in (`PR_SET_MEMORY_MERGE`, set between fork and exec).
//! Guest RAM is kept out explicitly (QEMU's `mem-merge=off`, see
//! `vm::machine_type`): merging one tenant's pages with another's opens the
//! classic deduplication side channel between VMs, where the time of a write
//! tells whether some other VM holds the same page.
//!
//! The merging daemon is host-wide. When it is off and this process may turn
//! it on (root), it is turned on: what it then scans is only what processes
//! asked to have scanned. `ksm = false` in the config leaves the host alone.
//!
//! Its pace is kept to the number of sandboxes ([`pace`]). The kernel's
//! default (100 pages every 20 ms, 20 MiB/s) walks 400 helpers' 6 GiB in
//! five minutes, and a page is merged only after two walks found it
//! unchanged: on a host filling up, the newest sandboxes' helpers stayed
//! unmerged for ten minutes, and admission refused creates for memory that
//! was about to come back (measured: refused at 391 sandboxes, 33.5 MiB
//! each 13 minutes later). So the pace is set for one walk over everything
//! registered in [`FULL_SCAN_SECS`], between the kernel's default and
//! [`MAX_PAGES_TO_SCAN`]. A kernel's own pacing (its `advisor_mode`, 6.7
//! and later), when an administrator turned it on, is left alone.

use std::path::Path;

const KSM: &str = "/sys/kernel/mm/ksm";
const RUN: &str = "/sys/kernel/mm/ksm/run";

/// How long one walk over all the registered pages should take.
pub const FULL_SCAN_SECS: u64 = 30;
/// The kernel's default pace, and the slowest this sets.
const MIN_PAGES_TO_SCAN: u64 = 100;
/// The fastest: 2,000 pages every 20 ms is 400 MiB/s of walking, enough
/// for a full walk of 1,000 sandboxes' helpers in 40 s. Walking pages that
/// are already merged (nearly all, on an idle host) is cheap; measured
/// with 400 to 490 sandboxes at 1,000 to 1,400 pages: the daemon took 7 to
/// 11 % of a core, and the first refusal for memory came at 455 sandboxes
/// instead of 381.
const MAX_PAGES_TO_SCAN: u64 = 2_000;

/// The pages per wake-up that walk `tracked` pages in
/// [`FULL_SCAN_SECS`] when the daemon sleeps `sleep_ms` between wake-ups.
fn pages_to_scan_for(tracked: u64, sleep_ms: u64) -> u64 {
    let wakeups = (FULL_SCAN_SECS * 1000 / sleep_ms.max(1)).max(1);
    tracked
        .div_ceil(wakeups)
        .clamp(MIN_PAGES_TO_SCAN, MAX_PAGES_TO_SCAN)
}

/// Keep the daemon at `dir` walking what is registered at
/// [`FULL_SCAN_SECS`] a walk. Returns the pace set, `None` when nothing
/// was changed (KSM off or absent, the kernel's advisor in charge, already
/// at that pace, or not allowed to write).
fn pace_at(dir: &Path) -> Option<u64> {
    let read = |name: &str| -> Option<String> {
        std::fs::read_to_string(dir.join(name))
            .ok()
            .map(|s| s.trim().to_string())
    };
    let number = |name: &str| read(name)?.parse::<u64>().ok();
    if read("run")? != "1" {
        return None;
    }
    // "[none] scan-time": the bracket marks the mode in force.
    if read("advisor_mode").is_some_and(|m| !m.contains("[none]")) {
        return None;
    }
    // Every page KSM keeps an entry for: merged (shared or sharing),
    // still unique, or changing too often to merge.
    let tracked = [
        "pages_shared",
        "pages_sharing",
        "pages_unshared",
        "pages_volatile",
    ]
    .iter()
    .map(|name| number(name).unwrap_or(0))
    .sum();
    let want = pages_to_scan_for(tracked, number("sleep_millisecs")?);
    let now = number("pages_to_scan")?;
    // Within a tenth: left as it is, not rewritten every few seconds.
    if now.abs_diff(want) * 10 <= want {
        return None;
    }
    std::fs::write(dir.join("pages_to_scan"), want.to_string()).ok()?;
    Some(want)
}

/// Keep the host's KSM daemon at the pace of the sandboxes on it (see the
/// module documentation). Called every few seconds; cheap when nothing
/// changes.
pub fn pace() {
    if let Some(pages) = pace_at(Path::new(KSM)) {
        tracing::debug!("KSM now walks {pages} pages per wake-up");
    }
}

/// What [`ensure_running_at`] found or did.
#[derive(Debug, Clone, PartialEq, Eq)]
enum HostKsm {
    /// The daemon was already running.
    Running,
    /// It was off and has been turned on now.
    Started,
    /// It cannot run: no KSM in this kernel, or not allowed to turn it on.
    Unavailable(String),
}

/// Make sure the KSM daemon whose switch is `run` runs, turning it on if
/// allowed.
fn ensure_running_at(run: &Path) -> HostKsm {
    let state = match std::fs::read_to_string(run) {
        Ok(s) => s.trim().to_string(),
        Err(e) => return HostKsm::Unavailable(format!("{}: {e}", run.display())),
    };
    match state.as_str() {
        "1" => HostKsm::Running,
        // 2 means "unmerge everything and stop": an administrator's choice.
        "0" => match std::fs::write(run, "1") {
            Ok(()) => HostKsm::Started,
            Err(e) => HostKsm::Unavailable(format!("cannot turn on {}: {e}", run.display())),
        },
        other => HostKsm::Unavailable(format!("{} is {other}", run.display())),
    }
}

/// Make sure the host's KSM daemon runs, turning it on if allowed, and say
/// what happened.
pub fn ensure_running_logged() {
    match ensure_running_at(Path::new(RUN)) {
        HostKsm::Running => tracing::debug!("KSM is running"),
        HostKsm::Started => tracing::info!(
            "turned on KSM ({RUN}) to merge the network helpers' identical pages; \
             guest memory is never merged (set `ksm = false` to leave it off)"
        ),
        HostKsm::Unavailable(why) => tracing::info!(
            "KSM is not running ({why}): each sandbox's network helper keeps \
             about 15 MiB more host memory"
        ),
    }
}

/// In a child between fork and exec: ask for all of this process's anonymous
/// memory, from now on and across exec, to be merged with identical pages.
/// A kernel without it (before Linux 6.4) refuses; nothing else changes then.
pub(crate) fn opt_in_self() {
    // SAFETY: prctl is async-signal-safe and takes no pointers here.
    unsafe {
        libc::prctl(libc::PR_SET_MEMORY_MERGE, 1, 0, 0, 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pace_walks_everything_registered_in_the_full_scan_time() {
        // 20 ms naps: 1,500 wake-ups per 30 s walk.
        assert_eq!(pages_to_scan_for(0, 20), MIN_PAGES_TO_SCAN);
        assert_eq!(pages_to_scan_for(1_500 * 700, 20), 700);
        assert_eq!(pages_to_scan_for(1_500 * 700 + 1, 20), 701);
        assert_eq!(pages_to_scan_for(u64::MAX / 2, 20), MAX_PAGES_TO_SCAN);
        // Longer naps, more pages each time.
        assert_eq!(pages_to_scan_for(300 * 700, 100), 700);
        // No nap at all counts as 1 ms.
        assert_eq!(pages_to_scan_for(30_000 * 150, 0), 150);
    }

    fn ksm_dir(run: &str, advisor: Option<&str>, pages: u64) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let put = |name: &str, v: &str| std::fs::write(dir.path().join(name), v).unwrap();
        put("run", run);
        if let Some(mode) = advisor {
            put("advisor_mode", mode);
        }
        put("pages_to_scan", &format!("{pages}\n"));
        put("sleep_millisecs", "20\n");
        // 450 sandboxes' helpers: 4,096 pages each, most merged.
        put("pages_shared", "2000\n");
        put("pages_sharing", "1700000\n");
        put("pages_unshared", "140000\n");
        put("pages_volatile", "1200\n");
        dir
    }

    fn pages_at(dir: &tempfile::TempDir) -> String {
        std::fs::read_to_string(dir.path().join("pages_to_scan")).unwrap()
    }

    #[test]
    fn a_running_daemon_is_paced_to_what_it_tracks_and_left_alone_otherwise() {
        let want = pages_to_scan_for(2000 + 1_700_000 + 140_000 + 1200, 20);
        assert_eq!(want, 1229);
        let dir = ksm_dir("1\n", Some("[none] scan-time\n"), 100);
        assert_eq!(pace_at(dir.path()), Some(want));
        assert_eq!(pages_at(&dir), "1229");
        // At that pace already (within a tenth): not written again.
        assert_eq!(pace_at(dir.path()), None);
        std::fs::write(dir.path().join("pages_to_scan"), "1150\n").unwrap();
        assert_eq!(pace_at(dir.path()), None);
        // A kernel without the advisor is paced too.
        assert_eq!(pace_at(ksm_dir("1", None, 100).path()), Some(want));
        // Off, or stopped by an administrator, or the advisor in charge:
        // untouched.
        for dir in [
            ksm_dir("0", None, 100),
            ksm_dir("2", None, 100),
            ksm_dir("1", Some("none [scan-time]"), 100),
        ] {
            assert_eq!(pace_at(dir.path()), None);
            assert_eq!(pages_at(&dir), "100\n");
        }
        assert_eq!(pace_at(&dir.path().join("missing")), None);
    }

    #[test]
    fn turns_on_an_idle_daemon_and_leaves_a_stopped_one() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("run");
        std::fs::write(&run, "0\n").unwrap();
        assert_eq!(ensure_running_at(&run), HostKsm::Started);
        assert_eq!(std::fs::read_to_string(&run).unwrap(), "1");
        assert_eq!(ensure_running_at(&run), HostKsm::Running);
        std::fs::write(&run, "2\n").unwrap();
        assert!(matches!(ensure_running_at(&run), HostKsm::Unavailable(_)));
        assert_eq!(std::fs::read_to_string(&run).unwrap(), "2\n");
        assert!(matches!(
            ensure_running_at(&dir.path().join("missing")),
            HostKsm::Unavailable(_)
        ));
    }
}
