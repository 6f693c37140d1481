//! The host end of a terminal in the guest (an interactive login shell on
//! a pseudo-terminal, see the agent's `pty`): a [`TunnelStream`] for its
//! bytes, with the same flow control as a port tunnel, and a
//! [`PtyControl`] to resize it and to read how its shell ended.

use crate::channel::tunnel::{PtyExit, TunnelStream, WINDOW};
use crate::channel::{AgentClient, Inner};
use crate::Result;
use sandpit_protocol::{Message, RequestId};
use std::sync::{Arc, Mutex};

/// A terminal's size in character cells.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PtySize {
    pub rows: u16,
    pub cols: u16,
}

/// A terminal: keystrokes are written to `stream` and its output read from
/// it; the stream's end of file is the shell's end (then
/// [`PtyControl::exit`] tells how). Dropping the stream hangs the terminal
/// up.
pub struct Pty {
    pub stream: TunnelStream,
    pub control: PtyControl,
}

/// Resizes a terminal, and tells how its shell ended.
#[derive(Clone)]
pub struct PtyControl {
    id: RequestId,
    inner: Arc<Inner>,
    exit: Arc<Mutex<Option<PtyExit>>>,
}

impl PtyControl {
    /// Give the terminal a new size; its foreground programs get SIGWINCH.
    pub fn resize(&self, size: PtySize) -> Result<()> {
        self.inner.send(
            &Message::PtyResize {
                id: self.id,
                rows: size.rows,
                cols: size.cols,
            },
            &[],
        )
    }

    /// How the shell ended, once the stream read its end; `None` before,
    /// and when the stream ended otherwise (hung up, agent connection lost).
    pub fn exit(&self) -> Option<PtyExit> {
        *self.exit.lock().unwrap()
    }
}

impl AgentClient {
    /// Start an interactive login shell as the guest user on a new terminal
    /// of `size`. The caller bounds the wait for an answer.
    pub async fn open_pty(&self, size: PtySize) -> Result<Pty> {
        let stream = self
            .open_stream("opening a terminal", |id| Message::PtyOpen {
                id,
                rows: size.rows,
                cols: size.cols,
                window: WINDOW,
            })
            .await?;
        let control = PtyControl {
            id: stream.id(),
            inner: self.inner().clone(),
            exit: stream.exit.clone(),
        };
        Ok(Pty { stream, control })
    }
}
