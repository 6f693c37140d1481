//! A sandbox's create, in its steps:
//!
//! 1. [`Service::replay_from_snapshot`]: a retry of a create from a
//!    snapshot answers with what the first call made, even once the
//!    snapshot is gone.
//! 2. [`Service::order`]: the request checked and priced (its size, from
//!    the snapshot when there is one; the whole timeout's cost to reserve).
//! 3. [`Service::place`]: the nodes that can take it, tried in turn: each
//!    gives the new sandbox's id ([`Service::claim_id`]: a warm VM's, which
//!    already carries it, or a new one), and the store writes the row, the
//!    reservation and the idempotency key in one transaction that checks
//!    the balance, the account's limits and the node's room.
//! 4. [`Service::created`]: what the store's outcome means for the caller.
//! 5. [`Service::start_created`]: the VM started in a task of its own (a
//!    client that hangs up does not cut it short), the create's metrics.

use crate::api::Caller;
use crate::cluster::Placement;
use crate::config::{cost, SizeConfig};
use crate::error::{CoreError, ErrorType, Result};
use crate::metrics::{CreatePath, Outcome};
use crate::model::*;
use crate::service::checks::check_create;
use crate::service::errors::runtime_error;
use crate::service::lifecycle::{to_sandbox, StartFailed};
use crate::service::Service;
use sandpit_host::ids::new_id;
use sandpit_host::machines::Machines;
use sandpit_runtime::RuntimeError;
use sandpit_store::{CreateOutcome, SandboxRow};
use sha2::Digest;
use std::sync::Arc;
use time::OffsetDateTime;

/// How many placements one create makes at most: the first, and others
/// after a node out of reach or a replayed failure.
const MOST_PLACEMENTS: u32 = 3;

/// A create's answer to an Idempotency-Key seen with another request.
pub(super) const KEY_REUSED: &str =
    "this Idempotency-Key was already used with a different request body";

/// How many times a create tries one node whose VMs' ids turn out taken
/// ([`sandpit_store::CreateOutcome::IdTaken`]).
const MOST_TRIES: u32 = 3;

/// What an idempotent create is recognised by: the request as checked.
fn create_hash(
    size: &str,
    name: &Option<String>,
    timeout_minutes: u32,
    snapshot_id: &Option<String>,
) -> String {
    hex::encode(sha2::Sha256::digest(
        serde_json::to_vec(&(size, name, timeout_minutes, snapshot_id)).expect("json"),
    ))
}

/// A saved state a new sandbox starts from (a snapshot, a template, a
/// template build's layer), on the node that holds it: the sandbox is
/// placed there, and its VM never comes from a pool.
pub(super) struct StartFrom {
    /// The save's name on its node (the row's `snapshot_id`).
    pub(super) save: String,
    pub(super) host: String,
    /// What it is, for messages: `snapshot snap_…`, `template web:latest`.
    pub(super) what: String,
    /// A template's: the layer it is, which other nodes hold copies of or
    /// fetch before they start it (see [`super::fetch`]); a snapshot stays
    /// on its node.
    pub(super) fetch: Option<sandpit_store::LayerRow>,
}

/// A create request checked and priced.
struct Order<'c> {
    req: CreateSandbox,
    /// The saved state it starts from, if any.
    from: Option<StartFrom>,
    /// The template build it starts from, and the working directory its
    /// commands get (a template's `WORKDIR`, or its origin's when from a
    /// snapshot).
    template_id: Option<String>,
    workdir: Option<String>,
    /// Its own egress lists, checked, as stored.
    network: Option<String>,
    /// The secrets it uses, `(name, placeholder)` (the placeholders are in
    /// its `env` too).
    placeholders: Vec<(String, String)>,
    /// Its network rules, checked, as stored.
    rules: Option<String>,
    /// The volumes it mounts, checked.
    mounts: super::volumes::CheckedMounts,
    size_name: String,
    size: &'c SizeConfig,
    timeout: u32,
    price: Micros,
    /// The whole timeout's cost, reserved by the create.
    reserve: Micros,
    request_hash: String,
    idempotency_key: Option<String>,
    at: OffsetDateTime,
}

/// Who creates a sandbox, and what its `created` event tells of its
/// origin: the snapshot or template it starts from, the sandbox it is a
/// fork of.
fn created_cause(caller: &Caller, order: &Order<'_>) -> sandpit_store::Cause {
    let mut cause = sandpit_store::Cause::by(&caller.actor);
    if let Some(snapshot) = &order.req.snapshot_id {
        cause = cause.with("snapshot_id", snapshot.as_str());
    }
    if let Some(template) = &order.req.template {
        cause = cause.with("template", template.as_str());
    }
    // Only a fork starts with its origin's secrets.
    if let Some(origin) = &order.req.secrets_of {
        cause = cause.with("forked_from", origin.as_str());
    }
    cause
}

/// Where a create was placed: the store's outcome there, the node's VMs,
/// and whether its VM came from a warm pool.
struct Placed {
    outcome: CreateOutcome,
    machines: Arc<dyn Machines>,
    from_pool: bool,
}

/// What one node's try came to.
enum Try {
    Placed(Box<Placed>),
    /// The same node again: the id of the VM it gave was taken.
    Again,
    /// The next node, for this reason.
    Refused(String),
}

impl Service {
    /// The API's `create_sandbox`.
    pub(super) async fn create(
        &self,
        caller: &Caller,
        req: CreateSandbox,
        idempotency_key: Option<String>,
    ) -> Result<(Sandbox, bool)> {
        let clock = std::time::Instant::now();
        if let Some(replayed) = self
            .replay_from_snapshot(caller, &req, idempotency_key.as_deref())
            .await?
        {
            return Ok((replayed, true));
        }
        let order = self.order(caller, req, idempotency_key).await?;
        let from_snapshot = order.from.is_some();
        // Nodes that could not be reached by this create's starts.
        let mut unreachable: Vec<String> = Vec::new();
        let mut attempts = 0;
        loop {
            attempts += 1;
            let placed = self.place(caller, &order, &unreachable).await?;
            let row = match self.created(placed.outcome, &order)? {
                Ok(row) => row,
                // A sandbox that failed before it was ever handed out (its
                // create answered an error that said "retry"): the retry
                // creates anew, it is not answered with that failure.
                Err(replayed)
                    if replayed.status == SandboxStatus::Failed
                        && replayed.ready_at.is_none()
                        && attempts < MOST_PLACEMENTS =>
                {
                    self.store.forget_idempotency_of(&replayed.id).await?;
                    continue;
                }
                Err(replayed) => return Ok((to_sandbox(&self.replayed(replayed).await?), true)),
            };
            // Private before its VM starts: never served without the token.
            let row = match order.req.private_traffic {
                true => self.made_private(row).await?,
                false => row,
            };
            // Its secrets before its VM starts, whose egress brokers them.
            self.give_broker(
                &row,
                &order.placeholders,
                order.rules.as_deref(),
                order.req.secrets_of.as_deref(),
            )
            .await?;
            // Its volumes before its VM starts, which mounts them.
            self.hold_volumes(&row, &order.mounts).await?;
            let host = row.host.clone();
            let id = row.id.clone();
            match self
                .start_created(row, placed.machines, from_snapshot, placed.from_pool, clock)
                .await
            {
                Ok(started) => return Ok((to_sandbox(&started), false)),
                // Its node could not be reached (it died since its last
                // heartbeat): the next node, in this same request. The
                // failed row keeps no key, so a retry never finds it. A
                // snapshot lives on its node alone.
                Err(failed)
                    if failed.unreachable
                        && !from_snapshot
                        && self.membership().is_some()
                        && attempts < MOST_PLACEMENTS =>
                {
                    tracing::warn!(%id, node = %host, "the create's node is out of reach: trying the next");
                    self.store.forget_idempotency_of(&id).await?;
                    unreachable.push(host);
                }
                Err(failed) => return Err(failed.error),
            }
        }
    }

    /// Step 1: a retry of a create from a snapshot, answered with what the
    /// first call made (checked against the first request).
    async fn replay_from_snapshot(
        &self,
        caller: &Caller,
        req: &CreateSandbox,
        idempotency_key: Option<&str>,
    ) -> Result<Option<Sandbox>> {
        let source = req
            .snapshot_id
            .clone()
            .or_else(|| req.template.as_ref().map(|t| format!("template:{t}")));
        let (Some(_), Some(key)) = (&source, idempotency_key) else {
            return Ok(None);
        };
        let Some((hash, row)) = self.store.created_with_key(&caller.account_id, key).await? else {
            return Ok(None);
        };
        let same_size = req.size.as_ref().is_none_or(|s| *s == row.size);
        let first = CreateSandbox {
            size: Some(row.size.clone()),
            ..req.clone()
        };
        let (size_name, _, timeout) = check_create(&self.config, &first, Some(key))?;
        if !same_size || create_hash(&size_name, &first.name, timeout, &source) != hash {
            return Err(CoreError::conflict(KEY_REUSED));
        }
        Ok(Some(to_sandbox(&self.replayed(row).await?)))
    }

    /// Step 2: the request checked and priced; from a snapshot or a
    /// template, of its size.
    async fn order(
        &self,
        caller: &Caller,
        req: CreateSandbox,
        idempotency_key: Option<String>,
    ) -> Result<Order<'_>> {
        if req.snapshot_id.is_some() && req.template.is_some() {
            return Err(CoreError::invalid(
                "a sandbox starts from a snapshot or a template, not both",
            ));
        }
        let mut req = req;
        // Checked against the create's own env, before a template adds to it.
        let placeholders = self.placeholders_for(caller, &req).await?;
        let rules = self.stored_rules(caller, &req.network_rules).await?;
        // A fork of a sandbox that mounted volumes gets them read-only
        // (see `fork_mounts`), unless it names its own.
        if let (Some(s), true) = (&req.snapshot_id, req.volumes.is_empty()) {
            let snap = self.startable_snapshot(caller, s).await?;
            req.volumes = self.fork_mounts(&snap.sandbox_id).await?;
        }
        let mounts = self.checked_mounts(caller, &req.volumes).await?;
        let (mut template_id, mut workdir) = (None, None);
        // What it starts from, and that one's size.
        let from = if let Some(s) = &req.snapshot_id {
            let snap = self.startable_snapshot(caller, s).await?;
            // Like the sandbox it was taken of: its template, its directory.
            if let Some(origin) = self.store.sandbox(&snap.sandbox_id).await? {
                template_id = origin.template_id;
                workdir = origin.workdir;
            }
            Some((
                StartFrom {
                    save: snap.id.clone(),
                    host: snap.host.clone(),
                    what: format!("snapshot {}", snap.id),
                    fetch: None,
                },
                snap.size,
            ))
        } else if let Some(name) = &req.template {
            let (template, state) = self.startable_template(caller, name).await?;
            for (k, v) in state.env {
                req.env.entry(k).or_insert(v);
            }
            workdir = state.workdir_set.then_some(state.workdir);
            template_id = Some(template.id.clone());
            let save = template.snapshot_id.clone().unwrap_or_default();
            Some((
                StartFrom {
                    fetch: self.store.template_layer_of(&save).await?,
                    save,
                    host: template.host.clone().unwrap_or_default(),
                    what: format!("template {}:{}", template.name, template.tag),
                },
                template.size,
            ))
        } else {
            req.layer.clone().map(|layer| {
                let size = req.size.clone().unwrap_or_default();
                let from = StartFrom {
                    save: layer.save_id,
                    host: layer.host,
                    what: "a template build's layer".into(),
                    fetch: None,
                };
                (from, size)
            })
        };
        let from = match from {
            Some((from, size)) if req.size.as_ref().is_some_and(|s| *s != size) => {
                return Err(CoreError::invalid(format!(
                    "{} is of size {size}: a sandbox from it is too (leave out size)",
                    from.what
                )))
            }
            Some((from, size)) => {
                req.size = Some(size);
                Some(from)
            }
            None => None,
        };
        let (size_name, size, timeout) =
            check_create(&self.config, &req, idempotency_key.as_deref())?;
        // A secret's placeholder over a template's variable of that name.
        for (name, placeholder) in &placeholders {
            req.env.insert(name.clone(), placeholder.clone());
        }
        let price = size.price_micros_per_hour();
        let network = super::network::stored_lists(req.network.as_ref())?;
        // A template is named in the hash as a snapshot is (a request
        // without either hashes as it always did).
        let source = req
            .snapshot_id
            .clone()
            .or_else(|| req.template.as_ref().map(|t| format!("template:{t}")));
        Ok(Order {
            request_hash: create_hash(&size_name, &req.name, timeout, &source),
            reserve: cost(price, timeout as u64 * 60),
            req,
            from,
            template_id,
            workdir,
            network,
            placeholders,
            rules,
            mounts,
            size_name,
            size,
            timeout,
            price,
            idempotency_key,
            at: OffsetDateTime::now_utc(),
        })
    }

    /// Step 3: the nodes that can take the sandbox, tried in turn until one
    /// records it (or the store refuses it for the account's sake).
    async fn place(
        &self,
        caller: &Caller,
        order: &Order<'_>,
        unreachable: &[String],
    ) -> Result<Placed> {
        let placement = self
            .placement(&order.size_name)
            .await?
            .into_iter()
            .filter(|t| !unreachable.contains(&t.host))
            // A sandbox runs where its volumes are.
            .filter(|t| order.mounts.host().is_none_or(|host| t.host == host));
        // Each node with the save it starts from there: the one that holds
        // it, nodes with a copy of a template first, then the others, which
        // fetch it (`None`).
        let mut targets: Vec<(Placement, Option<String>)> = match &order.from {
            None => placement.map(|t| (t, None)).collect(),
            Some(from) => {
                let mut kept = vec![(from.host.clone(), from.save.clone())];
                if let Some(layer) = &from.fetch {
                    kept.extend(
                        self.store
                            .template_layer_copies(&layer.account_id, &layer.layer_key)
                            .await?
                            .into_iter()
                            // Whole copies (one being made has no bytes yet).
                            .filter(|l| l.bytes > 0)
                            .map(|l| (l.host, l.save_id)),
                    );
                }
                let mut targets: Vec<_> = placement
                    .map(|t| {
                        let save = kept.iter().find(|k| k.0 == t.host).map(|k| k.1.clone());
                        (t, save)
                    })
                    .filter(|(_, save)| save.is_some() || from.fetch.is_some())
                    .collect();
                targets.sort_by_key(|(_, save)| save.is_none());
                targets
            }
        };
        if let (Some(from), true) = (&order.from, targets.is_empty()) {
            return Err(CoreError::new(
                ErrorType::ServiceUnavailable,
                format!(
                    "{} is kept on node {}, which cannot take a sandbox now; retry",
                    from.what, from.host
                ),
            )
            .with_retry_after(5));
        }
        if let (Some(host), true) = (order.mounts.host(), targets.is_empty()) {
            return Err(CoreError::new(
                ErrorType::ServiceUnavailable,
                format!(
                    "the sandbox's volumes are kept on node {host}, which cannot take a sandbox \
                     now; retry"
                ),
            )
            .with_retry_after(5));
        }
        let mut refused = None;
        // A node tried again after the id of the VM it gave was taken, and
        // how many times it was tried.
        let mut again = None;
        let mut targets = targets.drain(..);
        while let Some(((target, save), tries)) =
            again.take().or_else(|| targets.next().map(|t| (t, 1)))
        {
            let save = match (save, &order.from) {
                (None, Some(from)) => match self.fetch_to(from, &target).await {
                    Ok(save) => Some(save),
                    Err(why) => {
                        refused = Some(why);
                        continue;
                    }
                },
                (save, _) => save,
            };
            match self
                .try_node(caller, order, &target, save.as_deref(), tries)
                .await?
            {
                Try::Placed(placed) => {
                    if let (Some(from), Some(save)) = (&order.from, &save) {
                        self.used_copy(from, &target.host, save).await;
                    }
                    return Ok(*placed);
                }
                Try::Again => again = Some(((target, save), tries + 1)),
                Try::Refused(why) => refused = Some(why),
            }
        }
        Err(CoreError::new(
            ErrorType::ServiceUnavailable,
            match refused {
                Some(why) => format!(
                    "no node can take a {} sandbox now (the last one tried: {why}); retry",
                    order.size_name
                ),
                None => "no node can take a sandbox now: none is up with room; retry".into(),
            },
        )
        .with_retry_after(5))
    }

    /// One try of node `target` (its `tries`th): the id, then the row;
    /// from `save` on that node when the order starts from one.
    async fn try_node(
        &self,
        caller: &Caller,
        order: &Order<'_>,
        target: &Placement,
        save: Option<&str>,
        tries: u32,
    ) -> Result<Try> {
        // Another node's pool, as its last heartbeat published it, names
        // the sandbox without a call.
        let published =
            match tries == 1 && target.host != self.config.host_name && order.from.is_none() {
                true => self.routes.take_published(&target.host, &order.size_name),
                false => None,
            };
        // A new VM of a size without a template would make it inside the
        // sandbox's lifetime: it is made first, and then the lifetime starts
        // after it (a pool VM, published or taken, is a template's already).
        let mut at = order.at;
        if tries == 1 && published.is_none() && order.from.is_none() {
            // In a task of its own: a caller that hangs up meanwhile leaves
            // nothing recorded, and the build goes on for the next create.
            let (machines, size) = (target.machines.clone(), order.size_name.clone());
            let prepared = tokio::spawn(async move { machines.prepare(&size).await });
            match prepared.await {
                Ok(Ok(true)) => at = at.max(OffsetDateTime::now_utc()),
                Ok(Ok(false)) => {}
                Ok(Err(e)) => tracing::warn!(
                    node = %target.host, size = %order.size_name, "preparing a start: {e}"
                ),
                Err(e) => tracing::warn!(node = %target.host, "preparing a start: {e}"),
            }
        }
        let taken = std::sync::Mutex::new(None);
        let id = self.claim_id(order, target, published.clone(), &taken);
        let new = sandpit_store::NewSandbox {
            id: String::new(),
            account_id: caller.account_id.clone(),
            name: order.req.name.clone(),
            size: order.size_name.clone(),
            vcpus: order.size.vcpus,
            memory_mb: order.size.memory_mb,
            disk_gb: order.size.disk_gb,
            timeout_minutes: order.timeout,
            price_micros_per_hour: order.price,
            host: target.host.clone(),
            host_epoch: target.epoch,
            snapshot_id: save.map(str::to_string),
            created_at: at,
            expires_at: at + time::Duration::minutes(order.timeout as i64),
            reserve_micros: order.reserve,
            max_concurrent: None,
            disk_limit_bytes: Some(self.config.account_disk_bytes),
            idempotency: order
                .idempotency_key
                .clone()
                .map(|k| (k, order.request_hash.clone())),
            metadata: order.req.metadata.clone(),
            env: order.req.env.clone(),
            // Every sandbox can be reached through E2B's data plane,
            // whichever surface made it.
            access_token: Some(hex::encode(rand::random::<[u8; 16]>())),
            every_port_public: order.req.every_port_public,
            internet_access: order.req.internet_access,
            network: order.network.clone(),
            template_id: order.template_id.clone(),
            workdir: order.workdir.clone(),
            start_from: Some(
                match &order.from {
                    Some(from) if from.fetch.is_some() => "template",
                    Some(_) => "snapshot",
                    None => "cold",
                }
                .into(),
            ),
            cause: created_cause(caller, order),
        };
        let outcome = self.store.create_sandbox_named(new, id).await;
        let warm = match taken.into_inner().unwrap() {
            // Outside a cluster, the one host's own answer.
            Some(Err(e)) if self.membership().is_none() => return Err(runtime_error(e)),
            Some(Err(RuntimeError::Busy(why))) => {
                return Ok(Try::Refused(format!(
                    "node {} is busy ({why})",
                    target.host
                )))
            }
            Some(Err(RuntimeError::HostFull(why))) => {
                return Ok(Try::Refused(format!(
                    "node {} is full ({why})",
                    target.host
                )))
            }
            Some(Err(e)) => {
                return Ok(Try::Refused(format!(
                    "node {} is out of reach ({e})",
                    target.host
                )))
            }
            Some(Ok(warm)) => warm,
            None => None,
        };
        let from_pool = published.is_some() || warm.is_some();
        // A pool VM whose sandbox was not created goes back, never used;
        // but one whose id another create took (from the published pool)
        // is that create's to start, or dies with its pool lease.
        if let Some(id) = &warm {
            if !matches!(
                outcome,
                Ok(CreateOutcome::Created(_) | CreateOutcome::IdTaken)
            ) {
                let _ = target.machines.return_warm(id, &order.size_name).await;
            }
        }
        Ok(match outcome? {
            // Another create took it first: the node is asked for a VM (the
            // one it gives may be that same VM, which it has not handed
            // over yet: then once more).
            CreateOutcome::IdTaken if tries < MOST_TRIES => Try::Again,
            CreateOutcome::IdTaken => Try::Refused(format!(
                "node {} gave VMs whose ids were taken {tries} times",
                target.host
            )),
            // The node filled up or went silent since it was ranked: the
            // next one.
            CreateOutcome::HostFull { live, limit } => {
                self.routes.refused();
                Try::Refused(format!("node {} is full ({live} of {limit})", target.host))
            }
            CreateOutcome::HostUnavailable => {
                self.routes.refused();
                Try::Refused(format!("node {} left the cluster", target.host))
            }
            outcome => {
                if matches!(outcome, CreateOutcome::Created(_)) {
                    self.routes.placed(&target.host);
                }
                Try::Placed(Box::new(Placed {
                    outcome,
                    machines: target.machines.clone(),
                    from_pool,
                }))
            }
        })
    }

    /// The new sandbox's id, asked for by the store's transaction: the
    /// published pool VM's (`published`), a new one for a VM started from a
    /// snapshot (never a pool VM), else a warm VM's, which already carries
    /// the id its sandbox will have, or a new one. What the node answered
    /// is left in `taken` (`Ok(None)`: no pool VM was taken).
    fn claim_id<'a>(
        &'a self,
        order: &'a Order<'_>,
        target: &'a Placement,
        published: Option<String>,
        taken: &'a std::sync::Mutex<Option<std::result::Result<Option<String>, RuntimeError>>>,
    ) -> impl std::future::Future<Output = Option<(String, Option<&'static str>)>> + Send + 'a {
        async move {
            if let Some(id) = published {
                *taken.lock().unwrap() = Some(Ok(None));
                return Some((id, Some("pool")));
            }
            if order.from.is_some() {
                *taken.lock().unwrap() = Some(Ok(None));
                return Some((new_id("sbx_"), None));
            }
            let warm = target.machines.take_warm(&order.size_name).await;
            let id = match &warm {
                Ok(Some(warm)) => Some((warm.clone(), Some("pool"))),
                Ok(None) => Some((new_id("sbx_"), None)),
                Err(e) => {
                    tracing::warn!(node = %target.host, "taking a warm VM: {e}");
                    None
                }
            };
            *taken.lock().unwrap() = Some(warm);
            id
        }
    }

    /// New sandbox `row` with every port private (E2B's
    /// `allowPublicTraffic=false`); one the store could not mark ends
    /// failed, its reservation given back, rather than start public.
    async fn made_private(&self, row: SandboxRow) -> Result<SandboxRow> {
        match self.store.set_private_traffic(&row.id, true).await {
            Ok(true) => Ok(SandboxRow {
                private_traffic: true,
                ..row
            }),
            outcome => {
                let why = match outcome {
                    Err(e) => e.to_string(),
                    _ => "it ended meanwhile".to_string(),
                };
                let _ = self
                    .store
                    .finish_sandbox(
                        &row.id,
                        SandboxStatus::Failed,
                        &format!("failed: making its ports private: {why}"),
                        OffsetDateTime::now_utc(),
                        0,
                        &sandpit_store::Cause::by(crate::service::events::SANDPIT),
                    )
                    .await;
                Err(CoreError::internal(format!(
                    "sandbox {}: making its ports private: {why}",
                    row.id
                )))
            }
        }
    }

    /// Step 4: the store's outcome for the caller: the new row, the row a
    /// retry with the same Idempotency-Key finds (`Err`), or the refusal.
    fn created(
        &self,
        outcome: CreateOutcome,
        order: &Order<'_>,
    ) -> Result<std::result::Result<SandboxRow, SandboxRow>> {
        let (size_name, timeout) = (&order.size_name, order.timeout);
        match outcome {
            CreateOutcome::Created(row) => Ok(Ok(row)),
            CreateOutcome::Replay(row) => Ok(Err(row)),
            CreateOutcome::IdempotencyConflict => Err(CoreError::conflict(KEY_REUSED)),
            CreateOutcome::InsufficientCredits { balance, needed } => Err(CoreError::new(
                ErrorType::InsufficientCredits,
                format!(
                    "a {size_name} sandbox for {timeout} minutes reserves ${:.6}, but the account \
                     has ${:.6} left; add credit or ask for a shorter timeout",
                    usd(needed),
                    usd(balance)
                ),
            )),
            CreateOutcome::TooManySandboxes { live, limit } => Err(CoreError::new(
                ErrorType::RateLimited,
                format!(
                    "the account has {live} live sandboxes, its limit is {limit}; destroy one first"
                ),
            )
            .with_retry_after(10)
            .lasting()),
            CreateOutcome::OverDiskLimit { used, limit } => {
                Err(super::disk::over_limit(used, limit))
            }
            CreateOutcome::HostUnavailable
            | CreateOutcome::HostFull { .. }
            | CreateOutcome::IdTaken => {
                Err(CoreError::internal("placement refused after it was taken"))
            }
        }
    }

    /// Step 5: the new sandbox's VM started in a task of its own: a client
    /// that hangs up mid-create must not cancel the start half-way (that
    /// would leave a VM and a `provisioning` row behind). The sandbox is
    /// finished either way; the client finds it with `list_sandboxes` or an
    /// idempotent retry.
    async fn start_created(
        &self,
        row: SandboxRow,
        machines: Arc<dyn Machines>,
        from_snapshot: bool,
        from_pool: bool,
        clock: std::time::Instant,
    ) -> std::result::Result<SandboxRow, StartFailed> {
        self.wake_reaper();
        let me = self
            .arc_self()
            .ok_or_else(|| CoreError::internal("the service is shutting down"))?;
        let booted = tokio::spawn(async move { me.boot(row, machines).await })
            .await
            .map_err(|e| CoreError::internal(format!("the create task failed: {e}")))?;
        let path = match (from_snapshot, from_pool, &booted) {
            (true, _, _) => CreatePath::snapshot,
            (false, true, _) => CreatePath::pool,
            (false, false, Ok(b)) => self.how_started(b),
            (false, false, Err(_)) => CreatePath::new,
        };
        let outcome = match booted {
            Ok(_) => Outcome::ok,
            Err(_) => Outcome::failed,
        };
        crate::metrics::record_create(path, outcome, clock.elapsed());
        booted.map(|b| b.row)
    }
}
