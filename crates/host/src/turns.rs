//! One start at a time per sandbox on this machine.
//!
//! A sandbox's VM is started, paused and resumed by whoever asks first: a
//! create and its retry (the first call, or the replica that made it, may
//! still be at it or lost), a member's start over the node API, a command
//! that wakes a paused sandbox. Each takes the sandbox's [`Turn`] first; a
//! caller that had to wait learns so ([`Turn::waited`]) and reads the
//! outcome the first one recorded instead of starting again.
//!
//! The turns are keyed by any string: the service also takes one per node
//! and template layer to fetch a template once at a time.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tokio::sync::OwnedMutexGuard;

/// The turns of this machine's sandboxes; a sandbox's lock is forgotten
/// when nobody holds or waits for it.
#[derive(Default)]
pub struct Turns {
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

impl Turns {
    /// Sandbox `id`'s turn, once every earlier holder has let it go.
    pub async fn take(self: &Arc<Self>, id: &str) -> Turn {
        let lock = self
            .locks
            .lock()
            .expect("not poisoned")
            .entry(id.to_string())
            .or_default()
            .clone();
        let (held, waited) = match lock.clone().try_lock_owned() {
            Ok(held) => (held, false),
            Err(_) => (lock.clone().lock_owned().await, true),
        };
        Turn {
            turns: self.clone(),
            id: id.to_string(),
            held: Some(held),
            lock: Some(lock),
            waited,
        }
    }

    /// How many sandboxes have a lock now (held or waited for).
    pub fn len(&self) -> usize {
        self.locks.lock().expect("not poisoned").len()
    }

    /// Whether no sandbox has one.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A sandbox's turn (see [`Turns::take`]), given back when dropped.
pub struct Turn {
    turns: Arc<Turns>,
    id: String,
    held: Option<OwnedMutexGuard<()>>,
    lock: Option<Arc<tokio::sync::Mutex<()>>>,
    waited: bool,
}

impl Turn {
    /// Whether another caller held the turn first (and may have recorded
    /// the outcome this one came for).
    pub fn waited(&self) -> bool {
        self.waited
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        drop(self.held.take());
        drop(self.lock.take());
        let mut locks = self.turns.locks.lock().expect("not poisoned");
        if locks
            .get(&self.id)
            .is_some_and(|l| Arc::strong_count(l) == 1)
        {
            locks.remove(&self.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn a_second_caller_waits_and_knows_it_waited() {
        let turns = Arc::new(Turns::default());
        let first = turns.take("sb1").await;
        assert!(!first.waited());
        let other = turns.take("sb2").await;
        assert!(!other.waited(), "another sandbox's turn is its own");
        let waiter = {
            let turns = turns.clone();
            tokio::spawn(async move { turns.take("sb1").await.waited() })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            !waiter.is_finished(),
            "the second caller waits for the first"
        );
        drop(first);
        assert!(waiter.await.unwrap(), "and learns that it waited");
        drop(other);
        assert!(turns.is_empty(), "no lock is kept once nobody holds one");
    }
}
