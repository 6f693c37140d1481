//! Reused threads for running commands.
//!
//! Every command needs a thread that waits for it and forwards its output
//! (see `exec`). A new thread is a clone, a stack mapping and its first page
//! faults: about a millisecond of a `true`'s round trip under emulation. So
//! a thread that finished its job parks in a [`Pool`], blocked on a channel
//! (no CPU, no timer), and the next job takes the most recently parked one,
//! whose stack pages are still mapped. Past the pool's bound, threads exit.
//!
//! A job must leave its thread as it found it: nothing here resets
//! per-thread state. The file handlers, which switch the thread's file
//! credentials to the guest user, run on threads of their own.

use crate::sys::lock;
use std::io;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{self, SendError, Sender};
use std::sync::Mutex;
use std::thread;

type Job = Box<dyn FnOnce() + Send>;

/// A set of parked threads.
pub struct Pool {
    /// Most recently parked last.
    idle: Mutex<Vec<Sender<Job>>>,
    max_idle: usize,
}

/// The threads commands run on: enough parked for a few commands at once,
/// few enough that their stacks cost nothing noticeable.
pub static COMMANDS: Pool = Pool::new(8);

impl Pool {
    pub const fn new(max_idle: usize) -> Self {
        Self {
            idle: Mutex::new(Vec::new()),
            max_idle,
        }
    }

    /// Run `job` on a parked thread, or on a new one when none is parked.
    pub fn run(&'static self, job: impl FnOnce() + Send + 'static) -> io::Result<()> {
        let mut job: Job = Box::new(job);
        loop {
            let parked = lock(&self.idle).pop();
            match parked {
                Some(tx) => match tx.send(job) {
                    Ok(()) => return Ok(()),
                    // Its thread has exited; try the next.
                    Err(SendError(j)) => job = j,
                },
                None => break,
            }
        }
        thread::Builder::new()
            .name("worker".into())
            .spawn(move || self.work(job))?;
        Ok(())
    }

    fn work(&'static self, first: Job) {
        let (tx, rx) = mpsc::channel::<Job>();
        let mut job = first;
        loop {
            // A panicking job is the job's to report; the thread carries on.
            let _ = catch_unwind(AssertUnwindSafe(job));
            {
                let mut idle = lock(&self.idle);
                if idle.len() >= self.max_idle {
                    return;
                }
                idle.push(tx.clone());
            }
            match rx.recv() {
                Ok(next) => job = next,
                Err(_) => return,
            }
        }
    }

    #[cfg(test)]
    fn parked(&self) -> usize {
        lock(&self.idle).len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc::channel;
    use std::time::Duration;

    fn wait_parked(pool: &Pool, n: usize) {
        for _ in 0..2500 {
            if pool.parked() == n {
                return;
            }
            thread::sleep(Duration::from_millis(2));
        }
        panic!("{} threads parked, expected {n}", pool.parked());
    }

    #[test]
    fn jobs_run_and_threads_are_reused() {
        static POOL: Pool = Pool::new(2);
        let (tx, rx) = channel();
        let t = tx.clone();
        POOL.run(move || t.send(thread::current().id()).unwrap())
            .unwrap();
        let first = rx.recv_timeout(Duration::from_secs(5)).unwrap();
        wait_parked(&POOL, 1);
        POOL.run(move || tx.send(thread::current().id()).unwrap())
            .unwrap();
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)).unwrap(), first);
    }

    #[test]
    fn a_panicking_job_does_not_lose_the_thread() {
        static POOL: Pool = Pool::new(2);
        POOL.run(|| panic!("job failed")).unwrap();
        wait_parked(&POOL, 1);
        let (tx, rx) = channel();
        POOL.run(move || tx.send(7).unwrap()).unwrap();
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)).unwrap(), 7);
    }

    #[test]
    fn no_more_than_the_bound_stay_parked() {
        static POOL: Pool = Pool::new(1);
        let (tx, rx) = channel::<()>();
        let gate = std::sync::Arc::new(std::sync::Barrier::new(3));
        for _ in 0..2 {
            let g = gate.clone();
            let t = tx.clone();
            POOL.run(move || {
                g.wait();
                t.send(()).unwrap();
            })
            .unwrap();
        }
        gate.wait();
        rx.recv_timeout(Duration::from_secs(5)).unwrap();
        rx.recv_timeout(Duration::from_secs(5)).unwrap();
        thread::sleep(Duration::from_millis(50));
        wait_parked(&POOL, 1);
    }
}
