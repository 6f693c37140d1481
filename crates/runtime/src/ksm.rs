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

use std::path::Path;

const RUN: &str = "/sys/kernel/mm/ksm/run";

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
