//! `Clock`: step the guest's clock and read it, for the host's exchange.
//!
//! `Configure` sets the clock to the host's time as it was sent; a busy host
//! delivers that message late (a second was seen under emulation at a load
//! of 10 on two cores, a VM made ahead of demand at idle priority), and the
//! guest then runs behind by as much. The host reads its own clock before
//! and after a `Clock` exchange: the guest's reading must fall between, and
//! when it does not by more than the exchange's own width the host sends
//! the difference back as a step. The step is one `clock_adjtime` call
//! (`ADJ_SETOFFSET`): the kernel adds it to the time it has at that moment,
//! so a vCPU that is descheduled between a read and a set loses nothing.

use crate::sys;
use sandpit_protocol::{AgentError, ErrorKind};

const NANOS: i64 = 1_000_000_000;

/// Step `CLOCK_REALTIME` by `step_ns` (none when 0, and never outside the
/// VM: an agent run by hand for development leaves its host's clock alone)
/// and read it.
pub fn step_and_read(step_ns: i64) -> Result<i64, AgentError> {
    if step_ns != 0 && crate::is_pid1() {
        step(step_ns).map_err(|e| AgentError::new(ErrorKind::Io, format!("clock: {e}")))?;
    }
    read().map_err(|e| AgentError::new(ErrorKind::Io, format!("clock: {e}")))
}

fn step(step_ns: i64) -> std::io::Result<()> {
    // SAFETY: a zeroed timex is a valid "change nothing" request.
    let mut tx: libc::timex = unsafe { std::mem::zeroed() };
    tx.modes = libc::ADJ_SETOFFSET | libc::ADJ_NANO;
    // With ADJ_NANO the offset is seconds and nanoseconds, the latter in
    // [0, 1e9) even for a negative offset.
    tx.time.tv_sec = step_ns.div_euclid(NANOS);
    tx.time.tv_usec = step_ns.rem_euclid(NANOS);
    // SAFETY: a valid timex; the kernel only reads and writes it.
    sys::cvt(unsafe { libc::clock_adjtime(libc::CLOCK_REALTIME, &mut tx) }).map(drop)
}

fn read() -> std::io::Result<i64> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec to write to.
    sys::cvt(unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut ts) })?;
    Ok(ts.tv_sec * NANOS + ts.tv_nsec)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reading_is_now() {
        let host = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as i64;
        // Not pid 1: the step is not applied, the reading is still given.
        let guest = step_and_read(-5 * NANOS).unwrap();
        assert!((guest - host).abs() < NANOS, "{guest} vs {host}");
    }
}
