//! Pause and resume: a sandbox kept, its VM not running.
//!
//! Pausing saves the VM whole on its node's disk (as a snapshot is saved)
//! and stops it: no CPU, no guest memory on the host. The row stays
//! `running` in the database with the time it was paused, so everything
//! that counts live sandboxes (the concurrency limit, the node's room, the
//! reaper's expiry) counts it; the API shows `paused`. Its time paused is
//! billed at the paused rate. Any call that needs its VM (a command, a
//! file, a preview request) resumes it first, so an agent never has to
//! know; expiry destroys it like any other (its saved state goes with it).
//!
//! Owns pause, resume, and the resume that calls needing the VM do.

use crate::api::Caller;
use crate::error::{CoreError, Result};
use crate::model::*;
use crate::service::errors::{not_running, runtime_error};
use crate::service::Service;
use sandpit_store::{Cause, SandboxRow};

impl Service {
    /// The API's `pause_sandbox`. Pausing a paused sandbox is a no-op.
    pub(super) async fn pause(&self, caller: &Caller, id: &str) -> Result<Sandbox> {
        let row = self.owned(caller, id).await?;
        match row.status {
            SandboxStatus::Paused => return Ok(super::lifecycle::to_sandbox(&row)),
            SandboxStatus::Running => {}
            _ => return Err(not_running(&row)),
        }
        let me = self
            .arc_self()
            .ok_or_else(|| CoreError::internal("the service is shutting down"))?;
        // A client that hangs up does not leave it half paused.
        let id = id.to_string();
        let actor = caller.actor.clone();
        tokio::spawn(async move { me.pause_row(&id, &actor).await })
            .await
            .map_err(|e| CoreError::internal(format!("the pause task failed: {e}")))?
            .map(|row| super::lifecycle::to_sandbox(&row))
    }

    /// Pauses sandbox `id`, as `actor` asked.
    pub(super) async fn pause_row(&self, id: &str, actor: &str) -> Result<SandboxRow> {
        let _turn = self.turns.take(id).await;
        let row = self.current(id).await?;
        match row.status {
            SandboxStatus::Paused => return Ok(row),
            SandboxStatus::Running => {}
            _ => return Err(not_running(&row)),
        }
        let machines = self.machines_for(&row).await?;
        // Its preview connections reach the VM being stopped.
        self.previews.close(id, None);
        self.terminals.close(id);
        self.note_secrets_used_by(&row).await;
        let pausing = self.restoring(id).await;
        let paused = machines.pause(id).await;
        drop(pausing);
        if let Err(e) = paused {
            tracing::warn!(id, "pausing failed: {e}");
            return Err(self.agent_failure(&row, e).await);
        }
        match self.store.pause_sandbox(id, &Cause::by(actor)).await? {
            Some(row) => Ok(row),
            // Ended meanwhile (destroyed, expired): so be it.
            None => Err(not_running(&self.current(id).await?)),
        }
    }

    /// The API's `resume_sandbox`. Resuming a running sandbox is a no-op.
    pub(super) async fn resume(&self, caller: &Caller, id: &str) -> Result<Sandbox> {
        let row = self.owned(caller, id).await?;
        match row.status {
            SandboxStatus::Running => Ok(super::lifecycle::to_sandbox(&row)),
            SandboxStatus::Paused => Ok(super::lifecycle::to_sandbox(
                &self.wake(&row, &caller.actor).await?,
            )),
            _ => Err(not_running(&row)),
        }
    }

    /// Paused sandbox `row` running again (whoever asks first: the others
    /// wait for it and find it running), for `actor` (its event names who
    /// needed it).
    pub(super) async fn wake(&self, row: &SandboxRow, actor: &str) -> Result<SandboxRow> {
        let me = self
            .arc_self()
            .ok_or_else(|| CoreError::internal("the service is shutting down"))?;
        let (id, actor) = (row.id.clone(), actor.to_string());
        tokio::spawn(async move { me.wake_row(&id, &actor).await })
            .await
            .map_err(|e| CoreError::internal(format!("the resume task failed: {e}")))?
    }

    async fn wake_row(&self, id: &str, actor: &str) -> Result<SandboxRow> {
        let _turn = self.turns.take(id).await;
        let row = self.after_move(self.current(id).await?).await?;
        match row.status {
            SandboxStatus::Running => return Ok(row),
            SandboxStatus::Paused => {}
            _ => return Err(not_running(&row)),
        }
        let machines = self.machines_for(&row).await?;
        let resuming = self.restoring(id).await;
        let resumed = machines
            .resume(
                id,
                row.expires_at,
                self.egress(&row).await,
                self.vm_volumes(&row).await?,
            )
            .await;
        drop(resuming);
        if let Err(e) = resumed {
            tracing::warn!(id, "resuming failed: {e}");
            return Err(runtime_error(e));
        }
        match self.store.resume_sandbox(id, &Cause::by(actor)).await? {
            Some(row) => Ok(row),
            None => match self.current(id).await? {
                now if now.status == SandboxStatus::Running => Ok(now),
                now => Err(not_running(&now)),
            },
        }
    }

    /// Sandbox `id` as the store has it now.
    async fn current(&self, id: &str) -> Result<SandboxRow> {
        self.store
            .sandbox(id)
            .await?
            .ok_or_else(|| CoreError::not_found("sandbox", id))
    }
}
