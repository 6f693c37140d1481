//! The account as the service answers for it: who calls, what they spent,
//! what they have, and what this service offers.
//!
//! Separate because these calls only read (the ledger, the usage rows, the
//! configuration and the hosts); none of them changes a sandbox. Owns
//! authentication, accounts' creation (for operators), usage (a live
//! sandbox's cost so far, an ended one's charge, preview traffic not yet
//! flushed included), the account object and the service's description.

use crate::api::Accounts;
use crate::api::Caller;
use crate::error::{CoreError, Result};
use crate::model::*;
use crate::service::lifecycle::{cost_until, lived_seconds};
use crate::service::Service;
use sandpit_host::ids::rfc3339;
use time::OffsetDateTime;

impl Service {
    /// Create an account with `credit_usd` (see [`crate::admin`]).
    pub async fn create_account(&self, name: &str, credit_usd: f64) -> Result<Account> {
        crate::admin::create_account(&self.store, &self.config, name, credit_usd).await
    }
}

#[async_trait::async_trait]
impl Accounts for Service {
    /// The API's `authenticate`.
    async fn authenticate(&self, api_key: &str) -> Result<Caller> {
        match self.store.authenticate(api_key).await? {
            Some((key, acct)) => Ok(Caller::new(acct.id, format!("key {}", key.prefix))),
            None => Err(CoreError::unauthorized()),
        }
    }

    /// The API's `authenticate_sandbox`: the token is compared in
    /// constant time (see [`crate::metrics::token_matches`]).
    async fn authenticate_sandbox(&self, sandbox_id: &str, token: &str) -> Result<Caller> {
        let row = match self.store.sandbox(sandbox_id).await? {
            Some(row) if row.is_live() => row,
            _ => return Err(CoreError::not_found("sandbox", sandbox_id)),
        };
        match &row.access_token {
            Some(expected) if crate::metrics::token_matches(expected, token) => {
                Ok(Caller::new(row.account_id, "sandbox token"))
            }
            _ => Err(CoreError::unauthorized()),
        }
    }

    /// The API's `authenticate_sandbox_by_proof`: every live sandbox's
    /// token is tried (a hash each, microseconds for thousands).
    async fn authenticate_sandbox_by_proof(
        &self,
        proof: &(dyn for<'t> Fn(&'t str) -> bool + Send + Sync),
    ) -> Result<(String, Caller)> {
        for (id, account_id, token) in self.store.live_sandbox_tokens().await? {
            if proof(&token) {
                return Ok((id, Caller::new(account_id, "sandbox token")));
            }
        }
        Err(CoreError::unauthorized())
    }

    /// The API's `usage`.
    async fn usage(&self, caller: &Caller, days: Option<u32>) -> Result<Usage> {
        let days = days.unwrap_or(30);
        if !(1..=366).contains(&days) {
            return Err(CoreError::invalid(format!(
                "days must be between 1 and 366, not {days}"
            )));
        }
        let now = OffsetDateTime::now_utc();
        let since = now - time::Duration::days(days as i64);
        let rows = self.store.usage(&caller.account_id, since).await?;
        let mut total = 0;
        let sandboxes = rows
            .iter()
            .map(|u| {
                let r = &u.sandbox;
                let end = r.deleted_at.unwrap_or(now).min(r.expires_at);
                let seconds = lived_seconds(r.created_at, end);
                let cost_micros = if r.is_live() {
                    cost_until(r, end, self.config.paused_price_percent)
                } else {
                    u.charged_micros
                };
                total += cost_micros;
                let (pending_in, pending_out) = self.previews.pending(&r.id);
                SandboxUsage {
                    preview_bytes_in: u.preview_bytes_in as u64 + pending_in,
                    preview_bytes_out: u.preview_bytes_out as u64 + pending_out,
                    id: r.id.clone(),
                    size: r.size.clone(),
                    seconds,
                    cost_usd: usd(cost_micros),
                    created_at: rfc3339(r.created_at),
                    deleted_at: r.deleted_at.map(rfc3339),
                    disk_used_bytes: r.disk_used_bytes,
                }
            })
            .collect();
        let (volumes, stored) = self.volume_usage(&caller.account_id, since, now).await?;
        total += stored;
        let balance = self.store.balance(&caller.account_id).await?;
        Ok(Usage {
            object: "usage".into(),
            credit_remaining_usd: usd(balance),
            period_days: days,
            total_cost_usd: usd(total),
            sandboxes,
            volumes,
        })
    }

    /// The API's `account`.
    async fn account(&self, caller: &Caller) -> Result<Account> {
        let acct = self
            .store
            .account(&caller.account_id)
            .await?
            .ok_or_else(CoreError::unauthorized)?;
        crate::admin::account_object(&self.store, acct).await
    }

    /// The API's `service_info`.
    async fn service_info(&self) -> Result<ServiceInfo> {
        // A replica without VMs describes its nodes' (they run the same
        // release and image).
        let m = self.vms.as_ref().map(|vms| vms.manager());
        let hosts = match self.membership() {
            Some(_) => self
                .store
                .placement_candidates()
                .await?
                .into_iter()
                .map(|c| c.node.name)
                .collect(),
            None => vec![self.config.host_name.clone()],
        };
        Ok(ServiceInfo {
            name: "Sandpit".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            commit: self.config.commit.clone(),
            sizes: self.config.sizes_cheapest_first(),
            default_size: self.config.default_size.clone(),
            default_timeout_minutes: self.config.default_timeout_minutes,
            max_timeout_minutes: self.config.max_timeout_minutes,
            max_lifetime_minutes: self.config.max_lifetime_minutes,
            max_concurrent_sandboxes: self.config.default_max_concurrent_sandboxes,
            acceleration: m.map_or("on the nodes".into(), |m| m.accel().to_string()),
            hosts,
            authentication: "send the account's API key as `Authorization: Bearer <key>` or `x-api-key: <key>`; over stdio (`sandpit mcp`) no key is needed".into(),
            guest: GuestInfo {
                os: "Debian GNU/Linux 12 (bookworm)".into(),
                kernel: m.map_or(String::new(), |m| m.image().kernel_release.clone()),
                user: format!("{} (uid {}), no sudo", sandpit_protocol::GUEST_USER, sandpit_protocol::GUEST_UID),
                workdir: sandpit_protocol::WORKSPACE.into(),
            },
            fast_start: crate::model::FastStartInfo {
                snapshots: m.is_some_and(|m| m.snapshots_supported()),
                warm_pool: self
                    .vms
                    .iter()
                    .flat_map(|vms| {
                        vms.pool_targets()
                            .into_iter()
                            .map(|(size, target)| crate::model::WarmPoolInfo {
                                ready: vms.warm_count(&size),
                                size,
                                target,
                            })
                    })
                    .collect(),
            },
            limits: crate::model::Limits::of(
                &self.config,
                sandpit_runtime::channel::REPLY_DEADLINE.as_secs(),
            ),
            capacity: self.vms.as_ref().map(|vms| vms.capacity()),
        })
    }
}
