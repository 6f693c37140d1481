//! Which sandboxes are in use, so that idle ones can sleep (auto-pause).
//!
//! Most sandboxes sit idle between an agent's turns, and under software
//! emulation an idle VM still holds ~40 MiB of the host (its translated
//! code, QEMU's heap, passt). A paused one holds nothing but its saved state
//! on disk, and any call that needs its VM resumes it first, so an agent
//! never has to know (see `service/pause.rs`). With `idle_pause_minutes`
//! set, a sandbox nobody used for that long, whose guest did nothing
//! either, is paused.
//!
//! The hard part is that a pause must never cut a call short. Every call
//! that needs a sandbox's VM passes through `Service::running`, which takes
//! a [`Busy`] mark here for as long as the call lasts (a command to its end,
//! a transfer, a terminal until it hangs up). The sweep pauses a sandbox
//! only after [`Activity::claim_idle`] said yes: nothing in flight and
//! nothing for the idle time. From that claim until [`Activity::release`],
//! a new call waits, then finds the sandbox paused and resumes it.
//!
//! In-memory and per process, so it holds for a server that runs its VMs
//! itself: replicas of a cluster do not see each other's calls, so the
//! sweep does not run there.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};
use tokio::sync::Notify;

/// Use of each sandbox this process has seen.
#[derive(Default)]
pub(crate) struct Activity {
    /// Off (no idle pause configured): nothing is kept, marks are free.
    tracking: bool,
    uses: Mutex<HashMap<String, Use>>,
    /// Told whenever a claimed sandbox is released.
    released: Notify,
}

struct Use {
    /// Calls that need the VM, under way now.
    in_flight: u32,
    /// The last call's end (or start), preview request or guest activity.
    last: Instant,
    /// Claimed by the sweep: being paused.
    claimed: bool,
    /// What the guest had used at the sweep before: its QEMU's CPU ticks
    /// and the bytes its network process moved.
    guest: Option<GuestUse>,
}

/// What a sandbox's guest has used so far, as its host processes count it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct GuestUse {
    pub cpu_ticks: u64,
    pub net_bytes: u64,
}

/// A call under way in a sandbox; the sandbox is not paused while one is.
pub(crate) struct Busy {
    activity: Weak<Activity>,
    id: String,
}

impl Drop for Busy {
    fn drop(&mut self) {
        if let Some(activity) = self.activity.upgrade() {
            let mut uses = activity.uses.lock().unwrap();
            if let Some(u) = uses.get_mut(&self.id) {
                u.in_flight = u.in_flight.saturating_sub(1);
                u.last = Instant::now();
            }
        }
    }
}

impl Activity {
    /// Use kept (`tracking`) or not (no sandbox is ever claimed).
    pub(crate) fn new(tracking: bool) -> Activity {
        Activity {
            tracking,
            ..Activity::default()
        }
    }

    /// Whether use is kept (the idle sweep runs).
    pub(crate) fn tracking(&self) -> bool {
        self.tracking
    }

    /// Marks a call in sandbox `id` until the mark is dropped; waits while
    /// the sandbox is being paused (the caller then finds it paused).
    pub(crate) async fn begin(self: &Arc<Self>, id: &str) -> Busy {
        if !self.tracking {
            return Busy {
                activity: Weak::new(),
                id: String::new(),
            };
        }
        loop {
            let released = self.released.notified();
            tokio::pin!(released);
            released.as_mut().enable();
            {
                let mut uses = self.uses.lock().unwrap();
                let u = uses.entry(id.to_string()).or_insert_with(Use::new);
                if !u.claimed {
                    u.in_flight += 1;
                    u.last = Instant::now();
                    return Busy {
                        activity: Arc::downgrade(self),
                        id: id.to_string(),
                    };
                }
            }
            released.await;
        }
    }

    /// Returns once sandbox `id` is not being paused for idleness (for a
    /// preview request, which then finds it paused and resumes it). Takes
    /// no mark, so an unknown name costs nothing.
    pub(crate) async fn unclaimed(&self, id: &str) {
        loop {
            let released = self.released.notified();
            tokio::pin!(released);
            released.as_mut().enable();
            if !self.uses.lock().unwrap().get(id).is_some_and(|u| u.claimed) {
                return;
            }
            released.await;
        }
    }

    /// Counts as use of sandbox `id` now (a preview request). Only a
    /// sandbox already known: anyone may send a preview request with any
    /// name, and what is not known yet counts as used when first seen.
    pub(crate) fn touch(&self, id: &str) {
        if let Some(u) = self.uses.lock().unwrap().get_mut(id) {
            u.last = Instant::now();
        }
    }

    /// Records what sandbox `id`'s guest has used so far; if it used more
    /// than `threshold` since the sweep before, that counts as use now.
    pub(crate) fn guest_used(&self, id: &str, now: GuestUse, threshold: GuestUse) {
        let mut uses = self.uses.lock().unwrap();
        let u = uses.entry(id.to_string()).or_insert_with(Use::new);
        if let Some(before) = u.guest {
            let cpu = now.cpu_ticks.saturating_sub(before.cpu_ticks);
            let net = now.net_bytes.saturating_sub(before.net_bytes);
            // Counters that went back are another process's (a resume).
            let restarted = now.cpu_ticks < before.cpu_ticks || now.net_bytes < before.net_bytes;
            if restarted || cpu > threshold.cpu_ticks || net > threshold.net_bytes {
                u.last = Instant::now();
            }
        }
        u.guest = Some(now);
    }

    /// Claims sandbox `id` for a pause if nothing used it for `idle`:
    /// until [`Activity::release`], new calls wait. A sandbox seen for the
    /// first time counts as used now (a server that just started does not
    /// pause everything at once).
    pub(crate) fn claim_idle(&self, id: &str, idle: Duration) -> bool {
        let mut uses = self.uses.lock().unwrap();
        let u = uses.entry(id.to_string()).or_insert_with(Use::new);
        if u.claimed || u.in_flight > 0 || u.last.elapsed() < idle {
            return false;
        }
        u.claimed = true;
        true
    }

    /// Ends a claim (paused or not): waiting calls go on. The guest's
    /// counters are forgotten, for a resumed VM is a new process.
    pub(crate) fn release(&self, id: &str) {
        if let Some(u) = self.uses.lock().unwrap().get_mut(id) {
            u.claimed = false;
            u.last = Instant::now();
            u.guest = None;
        }
        self.released.notify_waiters();
    }

    /// Sandbox `id` ended: nothing to remember of it.
    pub(crate) fn forget(&self, id: &str) {
        let mut uses = self.uses.lock().unwrap();
        if uses.get(id).is_some_and(|u| u.in_flight == 0 && !u.claimed) {
            uses.remove(id);
        }
    }

    /// Sandboxes this process remembers.
    pub(crate) fn known(&self) -> Vec<String> {
        self.uses.lock().unwrap().keys().cloned().collect()
    }
}

impl Use {
    fn new() -> Use {
        Use {
            in_flight: 0,
            last: Instant::now(),
            claimed: false,
            guest: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NONE: Duration = Duration::ZERO;

    #[tokio::test]
    async fn nothing_is_kept_when_no_idle_pause_is_configured() {
        let a = Arc::new(Activity::new(false));
        let busy = a.begin("s").await;
        assert!(a.known().is_empty());
        drop(busy);
        assert!(a.known().is_empty());
    }

    #[tokio::test]
    async fn a_sandbox_with_a_call_under_way_is_not_claimed() {
        let a = Arc::new(Activity::new(true));
        let busy = a.begin("s").await;
        assert!(!a.claim_idle("s", NONE));
        drop(busy);
        assert!(a.claim_idle("s", NONE));
        assert!(!a.claim_idle("s", NONE), "claimed twice");
    }

    #[tokio::test]
    async fn recent_use_keeps_a_sandbox_awake() {
        let a = Arc::new(Activity::new(true));
        drop(a.begin("s").await);
        assert!(!a.claim_idle("s", Duration::from_secs(60)));
        assert!(!a.claim_idle("t", Duration::from_secs(60)));
        a.uses.lock().unwrap().get_mut("t").unwrap().last -= Duration::from_secs(120);
        a.touch("t");
        assert!(!a.claim_idle("t", Duration::from_secs(60)));
        a.touch("never-seen");
        assert!(!a.known().contains(&"never-seen".to_string()));
        // First seen by the sweep: counts as used now.
        assert!(!a.claim_idle("u", Duration::from_secs(60)));
    }

    #[tokio::test]
    async fn a_call_waits_for_a_claim_to_be_released() {
        let a = Arc::new(Activity::new(true));
        assert!(a.claim_idle("s", NONE));
        let waiting = tokio::spawn({
            let a = a.clone();
            async move {
                let _busy = a.begin("s").await;
            }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiting.is_finished(), "a call went on during a pause");
        let visitor = tokio::spawn({
            let a = a.clone();
            async move { a.unclaimed("s").await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            !visitor.is_finished(),
            "a preview request went on during a pause"
        );
        a.release("s");
        tokio::time::timeout(Duration::from_secs(5), visitor)
            .await
            .expect("the preview request still waits after the release")
            .unwrap();
        tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("the call still waits after the release")
            .unwrap();
    }

    #[test]
    fn a_busy_guest_counts_as_use() {
        let a = Activity::new(true);
        let idle = GuestUse {
            cpu_ticks: 10,
            net_bytes: 4096,
        };
        let at = |cpu_ticks, net_bytes| GuestUse {
            cpu_ticks,
            net_bytes,
        };
        a.guest_used("s", at(100, 0), idle);
        a.uses.lock().unwrap().get_mut("s").unwrap().last -= Duration::from_secs(120);
        // Below both thresholds: still idle.
        a.guest_used("s", at(105, 1000), idle);
        assert!(a.claim_idle("s", Duration::from_secs(60)));
        a.release("s");
        a.uses.lock().unwrap().get_mut("s").unwrap().last -= Duration::from_secs(120);
        a.guest_used("s", at(200, 1000), idle);
        a.guest_used("s", at(300, 1000), idle);
        assert!(!a.claim_idle("s", Duration::from_secs(60)), "CPU used");
        a.uses.lock().unwrap().get_mut("s").unwrap().last -= Duration::from_secs(120);
        a.guest_used("s", at(300, 100_000), idle);
        assert!(!a.claim_idle("s", Duration::from_secs(60)), "network used");
    }
}
