//! VMs started ahead of demand give way to live work.
//!
//! A warm-pool refill restores a VM and runs one command in it: about half a
//! second of CPU, translating guest code under emulation. Even at
//! `SCHED_IDLE` it slowed a live sandbox's commands 1.4–1.6x on a 2-core
//! host: the two share caches and memory bandwidth, and an idle-class thread
//! still runs whenever a live one blocks for a moment. So while live work
//! holds a [`Held`] guard (a command, a file transfer, a create someone waits
//! for), every background start in flight is stopped outright (`SIGSTOP`)
//! and continued [`LINGER`] after the last guard drops, so that commands
//! sent back to back hold it as one long command would.
//!
//! A stop is bounded, so a refill cannot starve nor run into its own
//! timeouts: one stop lasts at most [`MAX_STOP`] (a long command lets the
//! refill go on at idle priority), and one start is stopped for at most
//! [`MAX_TOTAL_STOP`] in all. Stopping a QEMU does not disturb the guest:
//! its clock follows the host's, and it only sees a pause.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The longest one stop lasts.
pub const MAX_STOP: Duration = Duration::from_secs(2);
/// How long background starts stay stopped after the last live work ends.
/// Back-to-back commands then hold them as one long command would, instead
/// of letting them run in the millisecond between every two commands.
pub const LINGER: Duration = Duration::from_millis(50);

/// The longest one background start is stopped, in all.
pub const MAX_TOTAL_STOP: Duration = Duration::from_secs(8);

#[derive(Debug)]
struct Starting {
    /// Signals go through a pidfd: they can never reach another process
    /// that got the pid after QEMU exited.
    pidfd: OwnedFd,
    stopped_at: Option<Instant>,
    total: Duration,
    /// Ran past `MAX_STOP` in the current hold: left alone until it ends.
    let_run: bool,
}

#[derive(Debug, Default)]
struct State {
    holders: usize,
    /// Counts the times `holders` fell to 0: a linger ends only if no
    /// live work came and went since.
    idle_epoch: u64,
    starting: HashMap<u32, Starting>,
}

/// The background starts in flight and the live work holding them back.
#[derive(Debug, Clone, Default)]
pub struct GiveWay {
    state: Arc<Mutex<State>>,
}

/// Live work in progress (see [`GiveWay::hold`]).
#[must_use]
pub struct Held {
    give_way: GiveWay,
}

impl Drop for Held {
    fn drop(&mut self) {
        self.give_way.release();
    }
}

/// A background start in progress (see [`GiveWay::track`]).
pub(crate) struct Tracked {
    give_way: GiveWay,
    pid: u32,
}

impl Drop for Tracked {
    fn drop(&mut self) {
        let mut st = self.give_way.lock();
        if let Some(mut s) = st.starting.remove(&self.pid) {
            resume(&mut s);
        }
    }
}

impl Tracked {
    /// Continue this start now, and let nothing stop it until the returned
    /// guard drops: for a step that must not be stopped halfway, the guest
    /// setting its clock from the host's time (stopped after the host read
    /// its clock and before the guest set it, the guest would be as late as
    /// the stop was long, and stay so).
    pub(crate) fn unstoppable(&self) -> Unstoppable {
        let mut st = self.give_way.lock();
        let taken = st.starting.remove(&self.pid).map(|mut s| {
            resume(&mut s);
            s
        });
        Unstoppable {
            give_way: self.give_way.clone(),
            pid: self.pid,
            taken,
        }
    }
}

/// See [`Tracked::unstoppable`]: on drop, the start can be stopped again
/// (at once, if live work holds).
pub(crate) struct Unstoppable {
    give_way: GiveWay,
    pid: u32,
    taken: Option<Starting>,
}

impl Drop for Unstoppable {
    fn drop(&mut self) {
        let Some(mut s) = self.taken.take() else {
            return;
        };
        let mut st = self.give_way.lock();
        if st.holders > 0 {
            self.give_way.stop(self.pid, &mut s);
        }
        st.starting.insert(self.pid, s);
    }
}

impl GiveWay {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Live work starts: stop background starts until the guard drops.
    pub fn hold(&self) -> Held {
        let mut st = self.lock();
        st.holders += 1;
        if st.holders == 1 {
            let pids: Vec<u32> = st.starting.keys().copied().collect();
            for pid in pids {
                let s = st.starting.get_mut(&pid).expect("listed");
                self.stop(pid, s);
            }
        }
        Held {
            give_way: self.clone(),
        }
    }

    fn release(&self) {
        let mut st = self.lock();
        st.holders = st.holders.saturating_sub(1);
        if st.holders > 0 {
            return;
        }
        st.idle_epoch += 1;
        // Nothing to continue (the usual case for a command): no linger
        // task on the command's path.
        if st.starting.is_empty() {
            return;
        }
        let epoch = st.idle_epoch;
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return resume_all(&mut st);
        };
        let me = self.clone();
        rt.spawn(async move {
            tokio::time::sleep(LINGER).await;
            let mut st = me.lock();
            if st.holders == 0 && st.idle_epoch == epoch {
                resume_all(&mut st);
            }
        });
    }

    /// QEMU `pid` is a background start until the returned guard drops
    /// (which continues it if it is stopped). `None` if it is gone already.
    pub(crate) fn track(&self, pid: u32) -> Option<Tracked> {
        let pidfd = crate::vm::process::pidfd_open(pid)?;
        let mut st = self.lock();
        let mut s = Starting {
            pidfd,
            stopped_at: None,
            total: Duration::ZERO,
            let_run: false,
        };
        if st.holders > 0 {
            self.stop(pid, &mut s);
        }
        st.starting.insert(pid, s);
        Some(Tracked {
            give_way: self.clone(),
            pid,
        })
    }

    /// Background starts in flight (for tests).
    pub fn starting(&self) -> usize {
        self.lock().starting.len()
    }

    /// Background starts stopped now (for tests).
    pub fn stopped(&self) -> usize {
        self.lock()
            .starting
            .values()
            .filter(|s| s.stopped_at.is_some())
            .count()
    }

    fn stop(&self, pid: u32, s: &mut Starting) {
        if s.stopped_at.is_some() || s.let_run || s.total >= MAX_TOTAL_STOP {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return; // nothing could bound the stop
        };
        signal(&s.pidfd, libc::SIGSTOP);
        let at = Instant::now();
        s.stopped_at = Some(at);
        let bound = MAX_STOP.min(MAX_TOTAL_STOP - s.total);
        let me = self.clone();
        rt.spawn(async move {
            tokio::time::sleep(bound).await;
            let mut st = me.lock();
            if let Some(s) = st.starting.get_mut(&pid) {
                if s.stopped_at == Some(at) {
                    resume(s);
                    s.let_run = true;
                }
            }
        });
    }
}

/// No live work left: every start goes on, and may be stopped again.
fn resume_all(st: &mut State) {
    for s in st.starting.values_mut() {
        resume(s);
        s.let_run = false;
    }
}

fn resume(s: &mut Starting) {
    if let Some(at) = s.stopped_at.take() {
        signal(&s.pidfd, libc::SIGCONT);
        s.total += at.elapsed();
    }
}

fn signal(pidfd: &OwnedFd, sig: libc::c_int) {
    // SAFETY: pidfd_send_signal(2) on a pidfd we own; a process that exited
    // meanwhile just makes it fail.
    unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            sig,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A child that counts, one byte appended per tick: stopped, its counter
    /// stands still. (Appending, not rewriting a number: a rewrite truncates
    /// the file first, and a read in between saw the count fall to 0.)
    fn counter() -> (std::process::Child, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap().keep();
        let file = dir.join("n");
        let child = std::process::Command::new("sh")
            .arg("-c")
            .arg(format!(
                "while true; do printf . >> {}; sleep 0.01; done",
                file.display()
            ))
            .spawn()
            .unwrap();
        (child, file)
    }

    fn count(file: &std::path::Path) -> u64 {
        std::fs::metadata(file).map_or(0, |m| m.len())
    }

    /// The counter grows within a few seconds (a loaded host can leave a
    /// continued shell unscheduled for a while: a fixed short window made
    /// this flaky in CI).
    async fn advances(file: &std::path::Path) -> bool {
        let a = count(file);
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(5) {
            tokio::time::sleep(Duration::from_millis(20)).await;
            if count(file) > a {
                return true;
            }
        }
        false
    }

    /// The counter stands still for 300 ms (a running one ticks every 10).
    async fn stands_still(file: &std::path::Path) -> bool {
        let a = count(file);
        tokio::time::sleep(Duration::from_millis(300)).await;
        count(file) == a
    }

    /// Waits for every stopped start to be continued, as the linger after
    /// the last live work does, well before any stop's own bound would.
    async fn continued_within(g: &GiveWay, limit: Duration) {
        let start = Instant::now();
        while g.stopped() > 0 {
            assert!(
                start.elapsed() < limit,
                "still stopped {limit:?} after the last live work ended"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    #[tokio::test]
    async fn live_work_stops_a_background_start_and_lets_it_go() {
        let (mut child, file) = counter();
        let g = GiveWay::default();
        let tracked = g.track(child.id()).unwrap();
        assert!(advances(&file).await);
        let held = g.hold();
        let also = g.hold();
        assert_eq!(g.stopped(), 1);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(stands_still(&file).await, "stopped while held");
        drop(held);
        assert!(stands_still(&file).await, "still held by the second guard");
        drop(also);
        assert_eq!(g.stopped(), 1, "stays stopped for LINGER");
        continued_within(&g, MAX_STOP / 2).await;
        // Live work within LINGER keeps it stopped past the first LINGER.
        // The check must fall between the first linger's end and the
        // second's: a test thread the host left waiting past both proves
        // nothing, so such a round is tried again.
        let mut in_time = 0;
        for _ in 0..10 {
            let held = g.hold();
            assert_eq!(g.stopped(), 1);
            drop(held);
            let first = Instant::now();
            tokio::time::sleep(LINGER / 2).await;
            drop(g.hold());
            let second = Instant::now();
            tokio::time::sleep(LINGER * 3 / 4).await;
            let stopped = g.stopped();
            if first.elapsed() > LINGER && second.elapsed() < LINGER * 9 / 10 {
                assert_eq!(stopped, 1, "held again within LINGER");
                in_time += 1;
            }
            continued_within(&g, MAX_STOP / 2).await;
            if in_time == 3 {
                break;
            }
        }
        assert!(
            in_time > 0,
            "no round's check came in time: the host is too busy"
        );
        assert!(advances(&file).await, "continued once nothing holds it");
        // A start that begins while work is held is stopped at once, and
        // continued when it finishes, held or not.
        let held = g.hold();
        drop(tracked);
        let (mut other, file2) = counter();
        let t2 = g.track(other.id()).unwrap();
        assert_eq!(g.stopped(), 1);
        drop(t2);
        assert!(advances(&file2).await, "a finished start runs");
        assert_eq!(g.starting(), 0);
        drop(held);
        for c in [&mut child, &mut other] {
            c.kill().unwrap();
            c.wait().unwrap();
        }
    }

    #[tokio::test]
    async fn a_start_made_unstoppable_runs_through_live_work_until_the_guard_drops() {
        let (mut child, file) = counter();
        let g = GiveWay::default();
        let tracked = g.track(child.id()).unwrap();
        let held = g.hold();
        assert_eq!(g.stopped(), 1);
        let unstoppable = tracked.unstoppable();
        assert_eq!(g.stopped(), 0, "continued at once");
        assert!(advances(&file).await, "runs while live work holds");
        drop(g.hold());
        assert!(advances(&file).await, "new live work does not stop it");
        drop(unstoppable);
        assert_eq!(g.stopped(), 1, "stopped again: live work still holds");
        assert_eq!(g.starting(), 1);
        drop(held);
        continued_within(&g, MAX_STOP / 2).await;
        drop(tracked);
        assert_eq!(g.starting(), 0);
        child.kill().unwrap();
        child.wait().unwrap();
    }

    #[tokio::test]
    async fn a_stop_is_bounded() {
        let (mut child, file) = counter();
        let g = GiveWay::default();
        let _tracked = g.track(child.id()).unwrap();
        let _held = g.hold();
        assert!(stands_still(&file).await);
        tokio::time::sleep(MAX_STOP).await;
        assert!(
            advances(&file).await,
            "continued after MAX_STOP though held"
        );
        assert_eq!(g.stopped(), 0);
        child.kill().unwrap();
        child.wait().unwrap();
    }
}
