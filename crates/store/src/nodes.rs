//! Nodes: the machines that run sandboxes' VMs when several share one
//! database. Each holds a lease on the database's clock, renewed by its
//! heartbeat; one whose lease ran out (plus a grace period) is declared
//! lost by whichever process sweeps first, and its sandboxes are failed and
//! settled in that same transaction, so exactly once.
//!
//! Time here is the database's (`now_ms`), never a machine's: two machines
//! whose clocks disagree still agree on whose lease is live.

use crate::error::{Result, StoreError};
use crate::sandboxes::{finish_in, sandbox_from, SandboxRow};
use crate::states::{live_statuses, NodeState};
use crate::util::{get_i64, get_str};
use crate::{is_postgres, Engine, SandboxStatus, Store};
use sqlx::any::AnyRow;
use sqlx::Row;
use std::collections::BTreeMap;
use std::time::Duration;
use time::OffsetDateTime;

/// A node as stored, with the database's clock at the time it was read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeRow {
    pub name: String,
    /// Where the control plane reaches its internal API.
    pub address: String,
    /// Grows at each start; a renewal with an older one is refused.
    pub epoch: i64,
    pub state: NodeState,
    pub vcpus: u32,
    pub memory_mb: u32,
    pub started_at_ms: i64,
    pub heartbeat_ms: i64,
    pub lease_until_ms: i64,
    /// The last heartbeat before it was declared lost.
    pub lost_at_ms: Option<i64>,
    /// Live sandboxes it takes at most (0: none).
    pub max_sandboxes: u32,
    /// The ids of the ready VMs in its warm pool per size, as of its last
    /// heartbeat. A control plane may create a sandbox under one of these
    /// ids without asking the node first: the sandbox's primary key makes
    /// sure one create at most gets it, and the node hands the VM over when
    /// that create's start comes (see `sandpit_core::cluster`).
    pub warm: BTreeMap<String, Vec<String>>,
    /// Being emptied by an operator (`sandpit node drain`): it takes no
    /// new sandbox and its sandboxes are moved to other nodes. Kept across
    /// its restarts, until it is put back in service.
    pub draining: bool,
    /// The database's clock when this row was read.
    pub now_ms: i64,
}

impl NodeRow {
    /// Up and within its lease: a node the control plane may route to and
    /// place sandboxes on.
    pub fn is_live(&self) -> bool {
        self.state == NodeState::Up && self.lease_until_ms > self.now_ms
    }
}

/// What a node registers with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewNode {
    pub name: String,
    pub address: String,
    pub vcpus: u32,
    pub memory_mb: u32,
    /// Live sandboxes it takes at most (0: none).
    pub max_sandboxes: u32,
}

/// A live node a sandbox may be placed on, with what it holds now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    pub node: NodeRow,
    /// Its live sandboxes.
    pub live: u32,
}

/// A node declared lost, with the sandboxes that ended with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LostNode {
    pub node: NodeRow,
    pub sandboxes: Vec<SandboxRow>,
}

/// The database's clock in milliseconds since the Unix epoch, as SQL.
pub(crate) fn now_ms_sql(engine: Engine) -> &'static str {
    match engine {
        // clock_timestamp(), not now(): now() is the transaction's start.
        Engine::Postgres => "CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT)",
        Engine::Sqlite => "CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)",
    }
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

fn u32_of(row: &AnyRow, col: &str) -> Result<u32> {
    let v = get_i64(row, col)?;
    u32::try_from(v).map_err(|_| StoreError::Corrupt(format!("{col} = {v}")))
}

fn node_from(row: &AnyRow) -> Result<NodeRow> {
    Ok(NodeRow {
        name: get_str(row, "name")?,
        address: get_str(row, "address")?,
        epoch: get_i64(row, "epoch")?,
        state: NodeState::stored(&get_str(row, "state")?)?,
        vcpus: u32_of(row, "vcpus")?,
        memory_mb: u32_of(row, "memory_mb")?,
        started_at_ms: get_i64(row, "started_at_ms")?,
        heartbeat_ms: get_i64(row, "heartbeat_ms")?,
        lease_until_ms: get_i64(row, "lease_until_ms")?,
        lost_at_ms: row.try_get::<Option<i64>, _>("lost_at_ms")?,
        max_sandboxes: u32_of(row, "max_sandboxes")?,
        warm: warm_from(&get_str(row, "warm")?)?,
        draining: get_i64(row, "draining")? != 0,
        now_ms: get_i64(row, "now_ms")?,
    })
}

/// `nodes.warm` as stored: per size, the ready VMs' ids (a count, as an
/// older node wrote it, reads as no id: that node is asked instead).
fn warm_from(stored: &str) -> Result<BTreeMap<String, Vec<String>>> {
    let sizes: BTreeMap<String, serde_json::Value> = serde_json::from_str(stored)
        .map_err(|e| StoreError::Corrupt(format!("nodes.warm: {e}")))?;
    Ok(sizes
        .into_iter()
        .map(|(size, ids)| {
            let ids = serde_json::from_value::<Vec<String>>(ids).unwrap_or_default();
            (size, ids)
        })
        .collect())
}

/// A time in milliseconds since the Unix epoch as a timestamp.
pub fn ms_to_time(ms: i64) -> OffsetDateTime {
    OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000)
        .unwrap_or(OffsetDateTime::UNIX_EPOCH)
}

impl Store {
    /// The database's clock, in milliseconds since the Unix epoch.
    pub async fn now_ms(&self) -> Result<i64> {
        let sql = format!("SELECT {}", now_ms_sql(self.engine));
        Ok(sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
            .fetch_one(&self.pool)
            .await?)
    }

    /// Registers a node starting up (or starting again): a new epoch, `up`,
    /// a lease of `lease` from now. A node that was lost is up again from
    /// here; its old sandboxes were settled when it was declared lost.
    pub async fn register_node(&self, node: &NewNode, lease: Duration) -> Result<NodeRow> {
        if node.name.is_empty() {
            return Err(StoreError::Invalid("a node needs a name".into()));
        }
        let now = now_ms_sql(self.engine);
        let sql = format!(
            "INSERT INTO nodes (name, address, epoch, state, vcpus, memory_mb, started_at_ms, \
                 heartbeat_ms, lease_until_ms, lost_at_ms, max_sandboxes, warm) \
             VALUES ($1, $2, 1, 'up', $3, $4, {now}, {now}, {now} + $5, NULL, $6, '{{}}') \
             ON CONFLICT (name) DO UPDATE SET address = excluded.address, \
                 epoch = nodes.epoch + 1, state = 'up', vcpus = excluded.vcpus, \
                 memory_mb = excluded.memory_mb, started_at_ms = excluded.started_at_ms, \
                 heartbeat_ms = excluded.heartbeat_ms, lease_until_ms = excluded.lease_until_ms, \
                 lost_at_ms = NULL, max_sandboxes = excluded.max_sandboxes, warm = '{{}}' \
             RETURNING *, {now} AS now_ms"
        );
        let row = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(&node.name)
            .bind(&node.address)
            .bind(i64::from(node.vcpus))
            .bind(i64::from(node.memory_mb))
            .bind(millis(lease))
            .bind(i64::from(node.max_sandboxes))
            .fetch_one(&self.pool)
            .await?;
        node_from(&row)
    }

    /// Renews a node's lease for `lease` from now, if it is still `up` at
    /// `epoch`. `false` means it has been fenced: declared lost, or started
    /// again elsewhere with a newer epoch. A lease that ran out but was not
    /// yet declared lost is renewed. `warm` is what its pool holds now: the
    /// ready VMs' ids per size.
    pub async fn renew_lease(
        &self,
        name: &str,
        epoch: i64,
        lease: Duration,
        warm: &BTreeMap<String, Vec<String>>,
    ) -> Result<bool> {
        let now = now_ms_sql(self.engine);
        let sql = format!(
            "UPDATE nodes SET heartbeat_ms = {now}, lease_until_ms = {now} + $3, warm = $4 \
             WHERE name = $1 AND epoch = $2 AND state = 'up'"
        );
        let done = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(name)
            .bind(epoch)
            .bind(millis(lease))
            .bind(serde_json::to_string(warm).expect("a map of ids"))
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    /// Every node, by name.
    pub async fn nodes(&self) -> Result<Vec<NodeRow>> {
        let sql = format!(
            "SELECT *, {} AS now_ms FROM nodes ORDER BY name",
            now_ms_sql(self.engine)
        );
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .fetch_all(&self.pool)
            .await?
            .iter()
            .map(node_from)
            .collect()
    }

    /// The nodes a new sandbox may go to: up, within their lease, taking
    /// sandboxes, with their live sandboxes counted. In no order: the
    /// control plane ranks them (see `sandpit_core`'s placement), and the
    /// create's transaction checks the chosen one again under its lock.
    pub async fn placement_candidates(&self) -> Result<Vec<Candidate>> {
        let sql = format!(
            concat!(
                "SELECT nodes.*, {now} AS now_ms, \
                 (SELECT COUNT(*) FROM sandboxes WHERE sandboxes.host = nodes.name \
                    AND sandboxes.status IN ",
                live_statuses!(),
                ") AS live \
             FROM nodes WHERE state = 'up' AND lease_until_ms > {now} AND max_sandboxes > 0 \
               AND draining = 0 \
             ORDER BY name"
            ),
            now = now_ms_sql(self.engine)
        );
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .fetch_all(&self.pool)
            .await?
            .iter()
            .map(|row| {
                Ok(Candidate {
                    node: node_from(row)?,
                    live: u32_of(row, "live")?,
                })
            })
            .collect()
    }

    /// One node.
    pub async fn node(&self, name: &str) -> Result<Option<NodeRow>> {
        let sql = format!(
            "SELECT *, {} AS now_ms FROM nodes WHERE name = $1",
            now_ms_sql(self.engine)
        );
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(name)
            .fetch_optional(&self.pool)
            .await?
            .as_ref()
            .map(node_from)
            .transpose()
    }

    /// Declares lost every `up` node whose lease ran out more than `grace`
    /// ago, and in the same transaction ends each of its live sandboxes as
    /// `failed` ("its node … was lost"), at the node's last heartbeat,
    /// charged `charge(sandbox, lost_at)` (what it ran until then) and the
    /// rest of its reservation released, and deletes its snapshots.
    ///
    /// Any number of processes may sweep at once: the flip to `lost` is a
    /// conditional update under the node's row lock, so one of them wins
    /// each node and the others find nothing to do; a sandbox's settlement
    /// is [`Store::finish_sandbox`]'s, which never settles twice.
    ///
    /// The flip also asks that the sweeping member `sweeper`'s own lease be
    /// live on the database's clock at that moment: a sweep whose
    /// statements waited out a database outage (issued before it, run
    /// after it) finds its own lease lapsed with everyone else's, since
    /// nobody could renew meanwhile, and declares nothing; its members
    /// renew first.
    pub async fn declare_lost_nodes(
        &self,
        grace: Duration,
        sweeper: &str,
        charge: impl Fn(&SandboxRow, OffsetDateTime) -> i64,
    ) -> Result<Vec<LostNode>> {
        let now = now_ms_sql(self.engine);
        let sql = format!(
            "SELECT name FROM nodes WHERE state = 'up' AND lease_until_ms + $1 < {now} \
             ORDER BY name"
        );
        let due: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
            .bind(millis(grace))
            .fetch_all(&self.pool)
            .await?;
        let mut lost = Vec::new();
        for name in due {
            let mut tx = self.write_tx().await?;
            let sql = format!(
                "UPDATE nodes SET state = 'lost', lost_at_ms = heartbeat_ms \
                 WHERE name = $1 AND state = 'up' AND lease_until_ms + $2 < {now} \
                 AND EXISTS (SELECT 1 FROM nodes AS sweeper WHERE sweeper.name = $3 \
                             AND sweeper.state = 'up' AND sweeper.lease_until_ms >= {now}) \
                 RETURNING *, {now} AS now_ms"
            );
            let Some(row) = sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(&name)
                .bind(millis(grace))
                .bind(sweeper)
                .fetch_optional(&mut *tx)
                .await?
            else {
                // Renewed, another sweeper got there first, or this
                // sweeper's own lease lapsed (a database outage).
                continue;
            };
            let node = node_from(&row)?;
            let lost_at = ms_to_time(node.lost_at_ms.unwrap_or(node.heartbeat_ms));
            let lock = if is_postgres(&tx) {
                " FOR NO KEY UPDATE"
            } else {
                ""
            };
            let sql = format!(
                concat!(
                    "SELECT * FROM sandboxes WHERE host = $1 \
                   AND status IN ",
                    live_statuses!(),
                    " \
                 ORDER BY created_at, id{lock}"
                ),
                lock = lock
            );
            let live = sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(&name)
                .fetch_all(&mut *tx)
                .await?
                .iter()
                .map(sandbox_from)
                .collect::<Result<Vec<_>>>()?;
            let reason = format!(
                "failed: its node {name} was lost (no heartbeat since {})",
                crate::format_ts(lost_at)
            );
            let mut ended = Vec::new();
            for sbx in &live {
                // Billed until the loss, never past its expiry.
                let until = lost_at.min(sbx.expires_at).max(sbx.created_at);
                let charged = charge(sbx, until);
                let cause =
                    crate::Cause::by(format!("replica {sweeper}")).with("node", name.as_str());
                if let Some(done) = finish_in(
                    &mut tx,
                    sbx,
                    SandboxStatus::Failed,
                    &reason,
                    until,
                    charged,
                    &cause,
                )
                .await?
                {
                    ended.push(done);
                }
            }
            // What it was running for others (a replica routes commands to
            // nodes) will never be finished by it.
            crate::executions::fail_running_executions_of(&mut tx, &name, lost_at).await?;
            // Its snapshots were on its disk: gone with it (should it come
            // back, its sweep removes their files).
            sqlx::query(
                "UPDATE snapshots SET status = 'deleted', deleted_at = $2 \
                 WHERE host = $1 AND status <> 'deleted'",
            )
            .bind(&name)
            .bind(crate::format_ts(lost_at))
            .execute(&mut *tx)
            .await?;
            tx.commit().await?;
            lost.push(LostNode {
                node,
                sandboxes: ended,
            });
        }
        Ok(lost)
    }
}
