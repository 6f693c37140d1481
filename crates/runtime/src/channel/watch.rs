//! Watching a directory in the guest ([`Message::WatchDir`]): the host's
//! end of the agent's inotify watch.
//!
//! A watch is a request that stays open: [`AgentClient::watch_dir`]
//! returns once the agent says the watch is set (so a change made after it
//! returns is seen), and [`DirWatch::next`] gives the events as they come.
//! Events wait in the host for a reader at most
//! [`OUTPUT_BACKLOG_BYTES`](super::requests::OUTPUT_BACKLOG_BYTES) worth,
//! as a followed command's output does; past that the watch ends saying
//! events were lost, rather than going on with a gap nobody sees.

use super::requests::OutputBacklog;
use super::{next_frame, AgentClient, Inner, REPLY_DEADLINE};
use crate::{Result, RuntimeError};
use sandpit_protocol::{AgentError, ErrorKind, Frame, Message, RequestId, WatchEvent};
use std::sync::Arc;
use tokio::sync::mpsc;

/// What a frame of `events` counts against its watch's backlog: the names
/// and a little for each event's framing.
pub(crate) fn queued_size(events: &[WatchEvent]) -> usize {
    events.iter().map(|e| e.name.len() + 32).sum()
}

/// A directory watched in the guest. Dropped, it stops the watch.
pub struct DirWatch {
    id: RequestId,
    inner: Arc<Inner>,
    rx: mpsc::UnboundedReceiver<Frame>,
    pub(super) backlog: Arc<OutputBacklog>,
    /// The watched directory's path in the guest, resolved.
    path: String,
    ended: bool,
}

impl AgentClient {
    /// Watch `path` (relative to the user's home, or absolute; with
    /// `recursive`, every directory under it) as the guest user. Returns
    /// once the watch is set, or the agent's error (not found, not a
    /// directory, permission denied, too many watches).
    pub async fn watch_dir(&self, path: &str, recursive: bool) -> Result<DirWatch> {
        self.needs("watch", "watching a directory")?;
        let (id, mut rx, backlog) = self.register_followed()?;
        let mut watch = DirWatch {
            id,
            inner: self.inner.clone(),
            rx: mpsc::unbounded_channel().1,
            backlog,
            path: String::new(),
            ended: false,
        };
        let request = Message::WatchDir {
            id,
            path: path.to_string(),
            recursive,
        };
        self.inner.send(&request, &[])?;
        let deadline = tokio::time::Instant::now() + REPLY_DEADLINE;
        let frame = next_frame(&mut rx, deadline, "a directory watch's start").await?;
        watch.rx = rx;
        match frame.message {
            Message::Watching { path, .. } => {
                watch.path = path;
                Ok(watch)
            }
            Message::Error { error, .. } => {
                watch.ended = true;
                Err(RuntimeError::Agent(error))
            }
            other => Err(super::unexpected(other)),
        }
    }
}

impl DirWatch {
    /// The watched directory, as the guest resolved it.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The next events, in the order the guest's kernel reported them;
    /// `None` once the watch was stopped. Waits as long as nothing changes.
    /// An error ends the watch: the directory went (not found), events
    /// were lost (too large), or the guest went.
    pub async fn next(&mut self) -> Result<Option<Vec<WatchEvent>>> {
        if self.ended {
            return Ok(None);
        }
        if self.backlog.dropped().0 {
            self.stop();
            return Err(RuntimeError::Agent(AgentError::new(
                ErrorKind::TooLarge,
                "events were lost: they came faster than the watch was read",
            )));
        }
        let Some(frame) = self.rx.recv().await else {
            self.ended = true;
            return Err(RuntimeError::Disconnected(
                "the agent connection closed while a directory was watched".into(),
            ));
        };
        match frame.message {
            Message::WatchEvents { events, .. } => {
                self.backlog.taken(queued_size(&events));
                Ok(Some(events))
            }
            Message::Done { .. } => {
                self.ended = true;
                Ok(None)
            }
            Message::Error { error, .. } => {
                self.ended = true;
                Err(RuntimeError::Agent(error))
            }
            other => {
                self.stop();
                Err(super::unexpected(other))
            }
        }
    }

    /// Ask the guest to stop watching (its `Done` then ends the events).
    fn stop(&mut self) {
        if !self.ended {
            let _ = self.inner.send(&Message::Cancel { id: self.id }, &[]);
        }
        self.ended = true;
    }
}

impl Drop for DirWatch {
    fn drop(&mut self) {
        self.stop();
        self.inner.forget(self.id);
    }
}
