//! The send window: how many bytes this side may still send on a stream before
//! the host acknowledges some (tunnels' down direction, file reads). The
//! host grants a window and acks what it consumed, so what waits in the
//! host for a slow consumer is at most the window.

use crate::sys::lock;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

pub struct SendWindow {
    /// (bytes that may be sent, closed)
    state: Mutex<(u64, bool)>,
    cv: Condvar,
}

impl SendWindow {
    pub fn new(n: u64) -> Self {
        SendWindow {
            state: Mutex::new((n, false)),
            cv: Condvar::new(),
        }
    }

    pub fn add(&self, n: u64) {
        lock(&self.state).0 += n;
        self.cv.notify_all();
    }

    /// No more sending: every waiter gives up.
    pub fn close(&self) {
        lock(&self.state).1 = true;
        self.cv.notify_all();
    }

    /// Waits for room in the window; takes up to `want`. `None` once closed.
    pub fn take(&self, want: usize) -> Option<usize> {
        self.take_within(want, None)
    }

    /// [`SendWindow::take`], giving up (`None`) when the window stayed shut for `patience`.
    pub fn take_within(&self, want: usize, patience: Option<Duration>) -> Option<usize> {
        let until = patience.map(|p| Instant::now() + p);
        let mut g = lock(&self.state);
        loop {
            if g.1 {
                return None;
            }
            if g.0 > 0 {
                let n = (g.0 as usize).min(want);
                g.0 -= n as u64;
                return Some(n);
            }
            g = match until {
                None => self.cv.wait(g).unwrap_or_else(|e| e.into_inner()),
                Some(until) => {
                    let left = until.checked_duration_since(Instant::now())?;
                    self.cv
                        .wait_timeout(g, left)
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                }
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn the_window_is_taken_up_to_what_was_granted_and_waits_for_more() {
        let c = Arc::new(SendWindow::new(10));
        assert_eq!(c.take(4), Some(4));
        assert_eq!(c.take(100), Some(6));
        assert_eq!(c.take_within(1, Some(Duration::from_millis(50))), None);
        let c2 = c.clone();
        let t = std::thread::spawn(move || c2.take(5));
        std::thread::sleep(Duration::from_millis(20));
        c.add(3);
        assert_eq!(t.join().unwrap(), Some(3));
        c.close();
        assert_eq!(c.take(1), None);
    }
}
