//! A live sandbox's lifetime: its expiry moved later (extend, which
//! reserves more) or earlier (shorten, which gives back), and its pauses.
//! Each change is one transaction that locks the account's row first, as a
//! create does, so the balance it checks is the one it changes.

use super::*;

/// Sandbox `id` of `account_id`, in `tx`, with the account's row locked;
/// a sandbox of another account is [`StoreError::NotFound`].
async fn owned_row_in(
    tx: &mut Transaction<'static, Any>,
    id: &str,
    account_id: &str,
) -> Result<SandboxRow> {
    lock_account(tx, account_id).await?;
    sandbox_in(tx, id)
        .await?
        .filter(|r| r.account_id == account_id)
        .ok_or_else(|| StoreError::NotFound(format!("sandbox {id}")))
}

/// Stores sandbox `id`'s new expiry and timeout; the row as it is then.
async fn set_lifetime_in(
    tx: &mut Transaction<'static, Any>,
    id: &str,
    expires_at: OffsetDateTime,
    timeout_minutes: u32,
) -> Result<SandboxRow> {
    let row = sqlx::query(
        "UPDATE sandboxes SET expires_at = $2, timeout_minutes = $3 WHERE id = $1 RETURNING *",
    )
    .bind(id)
    .bind(format_ts(expires_at))
    .bind(i64::from(timeout_minutes))
    .fetch_one(&mut **tx)
    .await?;
    sandbox_from(&row)
}

/// The event of a change of `row`'s lifetime: its new expiry and timeout.
async fn lifetime_event(
    tx: &mut Transaction<'static, Any>,
    row: &SandboxRow,
    kind: &str,
    cause: &Cause,
) -> Result<()> {
    let cause = cause
        .clone()
        .with("expires_at", crate::util::format_rfc3339(row.expires_at))
        .with("timeout_minutes", row.timeout_minutes);
    insert_event(
        tx,
        &row.id,
        &row.account_id,
        row.status,
        kind,
        None,
        &cause,
        now(),
    )
    .await
}

impl Store {
    /// Extends a `provisioning` or `running` sandbox of `account_id`: stores
    /// the new expiry and timeout and reserves `extra_reserve_micros` more,
    /// if the balance covers it. Same transaction discipline as
    /// [`Store::create_sandbox`]. A sandbox of another account is
    /// [`StoreError::NotFound`]; an expiry earlier than the current one is
    /// [`StoreError::Invalid`].
    pub async fn extend_sandbox(
        &self,
        id: &str,
        account_id: &str,
        new_expires_at: OffsetDateTime,
        new_timeout_minutes: u32,
        extra_reserve_micros: i64,
        cause: &Cause,
    ) -> Result<ExtendOutcome> {
        if extra_reserve_micros < 0 {
            return Err(StoreError::Invalid(format!(
                "extra_reserve_micros must not be negative, not {extra_reserve_micros}"
            )));
        }
        let mut tx = self.write_tx().await?;
        let row = owned_row_in(&mut tx, id, account_id).await?;
        if !matches!(
            row.status,
            SandboxStatus::Provisioning | SandboxStatus::Running | SandboxStatus::Paused
        ) {
            return Ok(ExtendOutcome::NotLive(row));
        }
        if new_expires_at < row.expires_at {
            return Err(StoreError::Invalid(format!(
                "new expiry {} is before the current {}",
                format_ts(new_expires_at),
                format_ts(row.expires_at)
            )));
        }
        let balance = balance_in(&mut *tx, account_id).await?;
        if balance < extra_reserve_micros {
            return Ok(ExtendOutcome::InsufficientCredits {
                balance,
                needed: extra_reserve_micros,
            });
        }
        let updated = set_lifetime_in(&mut tx, id, new_expires_at, new_timeout_minutes).await?;
        if extra_reserve_micros > 0 {
            insert_ledger(
                &mut tx,
                account_id,
                id,
                "reserve",
                -extra_reserve_micros,
                Some("extend"),
                now(),
            )
            .await?;
        }
        lifetime_event(&mut tx, &updated, "sandbox.extended", cause).await?;
        tx.commit().await?;
        Ok(ExtendOutcome::Extended(updated))
    }

    /// Shortens a live sandbox of `account_id`: stores the earlier expiry
    /// and timeout, and gives `release_micros` of its reservation back (a
    /// `release` ledger row; its end settles the rest as always). Same
    /// transaction discipline as [`Store::extend_sandbox`]. `None` when it
    /// is not live; a sandbox of another account is
    /// [`StoreError::NotFound`]; an expiry not earlier than the current one,
    /// or already past, is [`StoreError::Invalid`].
    pub async fn shorten_sandbox(
        &self,
        id: &str,
        account_id: &str,
        new_expires_at: OffsetDateTime,
        new_timeout_minutes: u32,
        release_micros: i64,
        cause: &Cause,
    ) -> Result<Option<SandboxRow>> {
        if release_micros < 0 {
            return Err(StoreError::Invalid(format!(
                "release_micros must not be negative, not {release_micros}"
            )));
        }
        let mut tx = self.write_tx().await?;
        let row = owned_row_in(&mut tx, id, account_id).await?;
        if !row.is_live() || row.status == SandboxStatus::Deleting {
            return Ok(None);
        }
        let at = now();
        if new_expires_at >= row.expires_at || new_expires_at <= at {
            return Err(StoreError::Invalid(format!(
                "new expiry {} is not between now ({}) and the current {}",
                format_ts(new_expires_at),
                format_ts(at),
                format_ts(row.expires_at)
            )));
        }
        let updated = set_lifetime_in(&mut tx, id, new_expires_at, new_timeout_minutes).await?;
        if release_micros > 0 {
            insert_ledger(
                &mut tx,
                account_id,
                id,
                "release",
                release_micros,
                Some("shorten"),
                at,
            )
            .await?;
        }
        lifetime_event(&mut tx, &updated, "sandbox.shortened", cause).await?;
        tx.commit().await?;
        Ok(Some(updated))
    }

    /// A running sandbox whose VM was saved and stopped is `paused` from
    /// now. `None` if it is not running (or already paused).
    pub async fn pause_sandbox(&self, id: &str, cause: &Cause) -> Result<Option<SandboxRow>> {
        let mut tx = self.write_tx().await?;
        let at = now();
        let row = sqlx::query(
            "UPDATE sandboxes SET paused_at = $2 \
             WHERE id = $1 AND status = 'running' AND paused_at IS NULL RETURNING *",
        )
        .bind(id)
        .bind(format_ts(at))
        .fetch_optional(&mut *tx)
        .await?;
        let Some(row) = row.as_ref().map(sandbox_from).transpose()? else {
            return Ok(None);
        };
        insert_event(
            &mut tx,
            id,
            &row.account_id,
            SandboxStatus::Paused,
            "sandbox.paused",
            None,
            cause,
            at,
        )
        .await?;
        tx.commit().await?;
        Ok(Some(row))
    }

    /// A paused sandbox runs again: the pause's seconds are added to its
    /// paused time. `None` if it was not paused.
    pub async fn resume_sandbox(&self, id: &str, cause: &Cause) -> Result<Option<SandboxRow>> {
        let mut tx = self.write_tx().await?;
        let Some(row) = sandbox_in(&mut tx, id).await? else {
            return Err(StoreError::NotFound(format!("sandbox {id}")));
        };
        if row.status != SandboxStatus::Paused {
            return Ok(None);
        }
        let at = now();
        let row = sqlx::query(
            "UPDATE sandboxes SET paused_at = NULL, paused_seconds = $2 WHERE id = $1 \
             RETURNING *",
        )
        .bind(id)
        .bind(i64::try_from(row.paused_seconds_until(at)).unwrap_or(i64::MAX))
        .fetch_one(&mut *tx)
        .await?;
        let row = sandbox_from(&row)?;
        insert_event(
            &mut tx,
            id,
            &row.account_id,
            SandboxStatus::Running,
            "sandbox.resumed",
            None,
            cause,
            at,
        )
        .await?;
        tx.commit().await?;
        Ok(Some(row))
    }
}
