//! Sandboxes moved between nodes (issue 48): a node drained by its
//! operator, its sandboxes carried to others with their memory.
//!
//! A move is held in the sandbox's row (`moving_to`, `moving_until`,
//! migration 0026) by the member doing it, so that two members never move
//! one sandbox at once and calls that need its VM wait for it. The switch
//! of its `host` is one conditional update, in the transaction that logs
//! `sandbox.moved`: it happens only while the sandbox is live on the node
//! it leaves and the target is up. The sweep that declares a node lost
//! fails the sandboxes whose `host` is that node under their row locks, so
//! a sandbox is either moved or handled as lost with its node, never both.

use crate::error::{Result, StoreError};
use crate::events::{insert_event, Cause};
use crate::nodes::NodeRow;
use crate::sandboxes::{sandbox_from, SandboxRow};
use crate::util::{format_ts, now};
use crate::Store;
use time::OffsetDateTime;

impl Store {
    /// Marks node `name` as draining (or back in service): placement skips
    /// a draining node, and the members move its sandboxes away. `None`:
    /// no such node.
    pub async fn set_node_draining(&self, name: &str, draining: bool) -> Result<Option<NodeRow>> {
        let done = sqlx::query("UPDATE nodes SET draining = $2 WHERE name = $1")
            .bind(name)
            .bind(i64::from(draining))
            .execute(&self.pool)
            .await?;
        if done.rows_affected() == 0 {
            return Ok(None);
        }
        self.node(name).await
    }

    /// Takes the move of running (or paused) sandbox `id` from node `from`
    /// to node `to`, held until `until`: `None` when it is not live on
    /// `from` any more, or another move of it is under way.
    pub async fn begin_move(
        &self,
        id: &str,
        from: &str,
        to: &str,
        until: OffsetDateTime,
    ) -> Result<Option<SandboxRow>> {
        if from == to {
            return Err(StoreError::Invalid(format!(
                "sandbox {id} cannot move to the node it is on ({to})"
            )));
        }
        let row = sqlx::query(
            "UPDATE sandboxes SET moving_to = $3, moving_until = $4 \
             WHERE id = $1 AND host = $2 AND status = 'running' \
               AND (moving_until IS NULL OR moving_until < $5) RETURNING *",
        )
        .bind(id)
        .bind(from)
        .bind(to)
        .bind(format_ts(until))
        .bind(format_ts(now()))
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(sandbox_from).transpose()
    }

    /// The move of sandbox `id` from `from` to `to` done: its `host` is
    /// `to` from now on, and `sandbox.moved` is logged with `cause`. The
    /// move stays held (calls wait) until [`Store::end_move`], once its VM
    /// runs there. `None` when that cannot be: the sandbox ended (its node
    /// was lost, say), its move was taken over, or `to` is no longer up;
    /// the move is then the caller's to undo.
    pub async fn finish_move(
        &self,
        id: &str,
        from: &str,
        to: &str,
        cause: &Cause,
    ) -> Result<Option<SandboxRow>> {
        let mut tx = self.write_tx().await?;
        let row = sqlx::query(
            "UPDATE sandboxes SET host = $3 \
             WHERE id = $1 AND host = $2 AND moving_to = $3 AND status = 'running' \
               AND EXISTS (SELECT 1 FROM nodes WHERE name = $3 AND state = 'up') \
             RETURNING *",
        )
        .bind(id)
        .bind(from)
        .bind(to)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(row) = row.as_ref().map(sandbox_from).transpose()? else {
            return Ok(None);
        };
        insert_event(
            &mut tx,
            id,
            &row.account_id,
            row.status,
            "sandbox.moved",
            None,
            cause,
            now(),
        )
        .await?;
        tx.commit().await?;
        Ok(Some(row))
    }

    /// Lets go of sandbox `id`'s move to `to` (undone, or finished by the
    /// host switch already); another move of it may begin.
    pub async fn end_move(&self, id: &str, to: &str) -> Result<()> {
        sqlx::query(
            "UPDATE sandboxes SET moving_to = NULL, moving_until = NULL \
             WHERE id = $1 AND moving_to = $2",
        )
        .bind(id)
        .bind(to)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Takes over the lapsed move of sandbox `id` (its member was lost
    /// mid-way), held until `until`, to put it right: `None` when another
    /// took it first, or it did not lapse.
    pub async fn take_over_move(
        &self,
        id: &str,
        until: OffsetDateTime,
    ) -> Result<Option<SandboxRow>> {
        let row = sqlx::query(
            "UPDATE sandboxes SET moving_until = $2 \
             WHERE id = $1 AND moving_until IS NOT NULL AND moving_until < $3 RETURNING *",
        )
        .bind(id)
        .bind(format_ts(until))
        .bind(format_ts(now()))
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(sandbox_from).transpose()
    }

    /// Live sandboxes whose move lapsed before `now` (its member was lost
    /// mid-way), for [`Store::take_over_move`].
    pub async fn lapsed_moves(&self, now: OffsetDateTime) -> Result<Vec<SandboxRow>> {
        sqlx::query(
            "SELECT * FROM sandboxes WHERE moving_until IS NOT NULL AND moving_until < $1 \
             AND status = 'running' ORDER BY moving_until",
        )
        .bind(format_ts(now))
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(sandbox_from)
        .collect()
    }
}
