//! Terminals: an interactive shell in a sandbox for a person (the
//! dashboard's terminal, `sandpit sandbox shell`), over whichever machine
//! runs it (see [`sandpit_host::machines::Machines::open_pty`]).
//!
//! Separate because a terminal, like a preview connection, is a stream that
//! outlives the call that opened it: the service keeps each open one's
//! closer per sandbox, so ending the sandbox (destroy, expiry, failure,
//! pause, restore) hangs up its terminals at once. A sandbox holds at most
//! [`MAX_TERMINALS`] open; each costs the guest three threads and a shell.
//!
//! Browsers cannot put an API key in a WebSocket's headers, and a key must
//! never travel in a URL, so a key holder can mint a one-use token for one
//! sandbox's terminal that lives [`TERMINAL_TOKEN_TTL`] (kept in the store,
//! so any replica takes it).

use crate::api::Terminals;
use crate::api::{Caller, TerminalSession};
use crate::error::{CoreError, ErrorType, Result};
use crate::model::TerminalToken;
use crate::service::Service;
use sandpit_host::machines::{Closer, PtySize};
use sandpit_store::SandboxStatus;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

/// Terminals one sandbox may have open at once.
pub const MAX_TERMINALS: usize = 16;
/// How long a terminal token may wait for its WebSocket.
pub const TERMINAL_TOKEN_TTL: time::Duration = time::Duration::seconds(60);
/// The largest terminal, in rows or columns, either way.
pub const MAX_TERMINAL_CELLS: u16 = 1000;

/// Open terminals: sandbox id -> serial -> closer.
#[derive(Default)]
pub(crate) struct OpenTerminals {
    open: Mutex<HashMap<String, HashMap<u64, Closer>>>,
    serial: AtomicU64,
}

/// One open terminal's place in [`OpenTerminals`]; dropped with its session.
struct TerminalSlot {
    registry: Weak<OpenTerminals>,
    sandbox_id: String,
    serial: u64,
}

impl Drop for TerminalSlot {
    fn drop(&mut self) {
        if let Some(r) = self.registry.upgrade() {
            let mut open = r.open.lock().unwrap();
            if let Some(of) = open.get_mut(&self.sandbox_id) {
                of.remove(&self.serial);
                if of.is_empty() {
                    open.remove(&self.sandbox_id);
                }
            }
        }
    }
}

impl OpenTerminals {
    /// Count a new terminal of `sandbox_id`, cut by `closer`; `None` when
    /// the sandbox has its most open.
    fn register(self: &Arc<Self>, sandbox_id: &str, closer: Closer) -> Option<TerminalSlot> {
        let serial = self.serial.fetch_add(1, Ordering::Relaxed);
        let mut open = self.open.lock().unwrap();
        let of = open.entry(sandbox_id.to_string()).or_default();
        if of.len() >= MAX_TERMINALS {
            return None;
        }
        of.insert(serial, closer);
        Some(TerminalSlot {
            registry: Arc::downgrade(self),
            sandbox_id: sandbox_id.to_string(),
            serial,
        })
    }

    /// Whether `sandbox_id` has a terminal open.
    pub(crate) fn has_open(&self, sandbox_id: &str) -> bool {
        self.open.lock().unwrap().contains_key(sandbox_id)
    }

    /// Hang up every terminal of `sandbox_id`.
    pub(crate) fn close(&self, sandbox_id: &str) {
        let closers = self.open.lock().unwrap().remove(sandbox_id);
        for closer in closers.into_iter().flat_map(HashMap::into_values) {
            closer();
        }
    }
}

/// A terminal size the guest can take.
pub fn check_terminal_size(size: PtySize) -> Result<()> {
    let fits = |n: u16| (1..=MAX_TERMINAL_CELLS).contains(&n);
    if fits(size.rows) && fits(size.cols) {
        Ok(())
    } else {
        Err(CoreError::invalid(format!(
            "a terminal is 1 to {MAX_TERMINAL_CELLS} rows and columns, not {} x {}",
            size.rows, size.cols
        )))
    }
}

#[async_trait::async_trait]
impl Terminals for Service {
    /// The API's `open_terminal`.
    async fn open_terminal(
        &self,
        caller: &Caller,
        id: &str,
        size: PtySize,
    ) -> Result<crate::api::TerminalSession> {
        check_terminal_size(size)?;
        let (row, _busy) = self.running(caller, id).await?;
        let machines = self.machines_for(&row).await?;
        let terminal = match machines.open_pty(&row.id, size).await {
            Ok(t) => t,
            Err(e) => return Err(self.agent_failure(&row, e).await),
        };
        let Some(slot) = self.terminals.register(&row.id, terminal.closer.clone()) else {
            (terminal.closer)();
            return Err(CoreError::new(
                ErrorType::RateLimited,
                format!(
                    "sandbox {} has {MAX_TERMINALS} terminals open, its most; close one",
                    row.id
                ),
            )
            .with_retry_after(5)
            .lasting());
        };
        // Ended (or paused) while it opened: cut it now rather than serve it.
        let now = self.store.sandbox(&row.id).await?;
        if now
            .as_ref()
            .is_none_or(|r| r.status != SandboxStatus::Running)
        {
            (terminal.closer)();
            return Err(CoreError::conflict(format!(
                "sandbox {} stopped running while its terminal opened",
                row.id
            )));
        }
        Ok(TerminalSession::new(terminal.input, terminal.output, slot))
    }

    /// The API's `terminal_token`.
    async fn terminal_token(&self, caller: &Caller, id: &str) -> Result<TerminalToken> {
        let row = self.owned(caller, id).await?;
        if !row.status.is_live() {
            return Err(super::errors::not_running(&row));
        }
        let (token, expires) = self
            .store
            .create_terminal_token(&caller.account_id, &row.id, TERMINAL_TOKEN_TTL)
            .await?;
        Ok(TerminalToken {
            url: format!("/v1/sandboxes/{}/pty?token={token}", row.id),
            token,
            expires_at: sandpit_host::ids::rfc3339(expires),
        })
    }

    /// The API's `redeem_terminal_token`.
    async fn redeem_terminal_token(&self, token: &str, id: &str) -> Result<Caller> {
        let refused = || {
            CoreError::new(
                ErrorType::Unauthorized,
                "the terminal token is unknown, used or expired; ask for a new one",
            )
        };
        let grant = self
            .store
            .take_terminal_token(token)
            .await?
            .ok_or_else(refused)?;
        if grant.sandbox_id != id {
            return Err(refused());
        }
        Ok(Caller::new(grant.account_id, "terminal token"))
    }
}
