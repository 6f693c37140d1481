//! The clock exchange: the guest's clock set from the host's to within
//! what the channel can measure.
//!
//! `Configure` carries the host's time as it was sent, and the guest sets
//! its clock from it on arrival: late by as long as the message took, which
//! a busy host makes long (a VM made ahead of demand at idle priority, under
//! emulation at a load of 10 on two cores, was found a second behind). So
//! once a VM is live the host asks the guest's time, reading its own just
//! before and just after: a guest clock in that window is as right as the
//! exchange can tell; one outside it is stepped to the window's middle. A
//! few exchanges are tried and the narrowest one is trusted, as NTP does.

use super::AgentClient;
use crate::{Result, RuntimeError};
use sandpit_protocol::{DoneResult, Message};
use std::time::Duration;

/// A guest clock this close to the host's is left alone, whatever the
/// exchange: a step moves every program's clock at once.
pub const CLOCK_TOLERANCE_NS: i64 = 10_000_000;
/// An exchange this narrow is trusted without trying another.
const NARROW_NS: i64 = 5_000_000;
/// Exchanges tried, at most, before the narrowest is trusted.
const EXCHANGES: usize = 3;
/// One exchange's bound: a guest this slow to answer is not stepped.
const EXCHANGE_DEADLINE: Duration = Duration::from_secs(5);

/// One exchange, in nanoseconds since the Unix epoch: the host's clock when
/// it asked, the guest's reading, the host's clock when the answer came.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exchange {
    pub asked: i64,
    pub guest: i64,
    pub answered: i64,
}

impl Exchange {
    pub fn width(&self) -> i64 {
        self.answered.saturating_sub(self.asked)
    }

    /// How far the guest is ahead of the window's middle (behind: < 0).
    /// Saturating: the reading is the guest's to make up.
    pub fn offset(&self) -> i64 {
        self.guest
            .saturating_sub(self.asked.saturating_add(self.width() / 2))
    }

    /// The step that brings the guest to the window's middle, when its
    /// reading fell outside the window (and past the tolerance).
    pub fn step(&self) -> Option<i64> {
        let offset = self.offset();
        (offset.saturating_abs() > (self.width() / 2).max(CLOCK_TOLERANCE_NS))
            .then(|| offset.saturating_neg())
    }
}

/// What an exchange found and did (for the logs and the tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClockSync {
    /// The narrowest exchange before any step.
    pub found: Exchange,
    /// What the guest's clock was stepped by.
    pub stepped_ns: Option<i64>,
}

fn host_now() -> i64 {
    time::OffsetDateTime::now_utc().unix_timestamp_nanos() as i64
}

impl AgentClient {
    /// Step the guest's clock by `step_ns` (0: leave it) and read it,
    /// timed by the host's clock.
    pub async fn clock_exchange(&self, step_ns: i64) -> Result<Exchange> {
        self.needs("clock", "the clock exchange")?;
        let asked = host_now();
        let done = self
            .simple_within(
                "its clock",
                |id| Message::Clock { id, step_ns },
                &[],
                EXCHANGE_DEADLINE,
            )
            .await?;
        let answered = host_now();
        match done {
            DoneResult::Clock { unix_ns } => Ok(Exchange {
                asked,
                guest: unix_ns,
                answered,
            }),
            other => Err(RuntimeError::Disconnected(format!(
                "unexpected answer to a clock exchange: {other:?}"
            ))),
        }
    }

    /// Bring the guest's clock to the host's (see the module's docs).
    pub async fn sync_clock(&self) -> Result<ClockSync> {
        let mut best = self.clock_exchange(0).await?;
        for _ in 1..EXCHANGES {
            if best.width() <= NARROW_NS {
                break;
            }
            let next = self.clock_exchange(0).await?;
            if next.width() < best.width() {
                best = next;
            }
        }
        let stepped_ns = match best.step() {
            Some(step) => {
                self.clock_exchange(step).await?;
                Some(step)
            }
            None => None,
        };
        Ok(ClockSync {
            found: best,
            stepped_ns,
        })
    }

    /// [`AgentClient::sync_clock`] for a VM going live, which goes live
    /// either way: a failed exchange leaves the clock `Configure` set, and
    /// an older image's agent, which cannot take part, is left as it was.
    pub async fn settle_clock(&self, vm: &str) {
        match self.sync_clock().await {
            Ok(ClockSync {
                found,
                stepped_ns: Some(step),
            }) => tracing::debug!(
                id = vm,
                step_ms = step as f64 / 1e6,
                window_ms = found.width() as f64 / 1e6,
                "the guest's clock was stepped to the host's"
            ),
            Ok(_) => {}
            Err(RuntimeError::Agent(e)) if e.kind == sandpit_protocol::ErrorKind::Unsupported => {}
            Err(e) => tracing::warn!(id = vm, "the guest's clock could not be checked: {e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: i64 = 1_000_000;

    fn exchange(asked: i64, guest: i64, answered: i64) -> Exchange {
        Exchange {
            asked: asked * MS,
            guest: guest * MS,
            answered: answered * MS,
        }
    }

    #[test]
    fn a_reading_inside_the_window_is_left_alone() {
        assert_eq!(exchange(1000, 1150, 1200).step(), None);
        assert_eq!(exchange(1000, 1000, 1200).step(), None);
    }

    #[test]
    fn a_reading_within_the_tolerance_is_left_alone_even_in_a_narrow_window() {
        assert_eq!(exchange(1000, 992, 1002).step(), None);
    }

    #[test]
    fn a_clock_behind_the_window_is_stepped_to_its_middle() {
        // What CI saw: a guest a second behind, a window of 0.6 s.
        let e = exchange(10_000, 8_974, 10_616);
        assert_eq!(e.step(), Some(1_334 * MS));
        assert_eq!(e.guest + e.step().unwrap(), e.asked + e.width() / 2);
    }

    #[test]
    fn a_clock_ahead_is_stepped_back() {
        assert_eq!(exchange(1000, 1500, 1002).step(), Some(-499 * MS));
    }

    #[test]
    fn a_guest_that_answers_anything_gets_a_step_and_no_panic() {
        let now = 1_796_539_623_702_000_000;
        for guest in [i64::MIN, i64::MAX, 0, -1] {
            let e = Exchange {
                asked: now,
                guest,
                answered: now + 2 * MS,
            };
            assert!(e.step().is_some(), "{e:?}");
        }
    }
}
