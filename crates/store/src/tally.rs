//! What one host's live sandboxes add up to, for the service's metrics:
//! how many per state and size, and the credit they hold reserved.
//!
//! One grouped query, whatever the number of sandboxes, so a scrape costs
//! the database the same at ten sandboxes as at ten thousand (the
//! `sandboxes_host_status` index finds the rows, `ledger_sandbox` their
//! reservations).

use crate::error::Result;
use crate::states::live_statuses;
use crate::util::{get_i64, get_str};
use crate::Store;

/// The live sandboxes of one state and size on a host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxTally {
    /// The API's word: `provisioning`, `running`, `paused` or `deleting`.
    pub state: String,
    pub size: String,
    pub count: i64,
    /// Reserved and not yet released, in micro-dollars.
    pub reserved_micros: i64,
}

impl Store {
    /// The live sandboxes on `host`, grouped by state and size (a paused
    /// sandbox, stored as `running` with a pause time, counts as `paused`).
    pub async fn sandbox_tally(&self, host: &str) -> Result<Vec<SandboxTally>> {
        let rows = sqlx::query(concat!(
            "SELECT CASE WHEN s.status = 'running' AND s.paused_at IS NOT NULL THEN 'paused' \
                    ELSE s.status END AS state, \
                    s.size AS size, \
                    CAST(COUNT(*) AS BIGINT) AS n, \
                    CAST(COALESCE(SUM((SELECT -SUM(l.amount_micros) FROM ledger l \
                        WHERE l.sandbox_id = s.id AND l.kind IN ('reserve', 'release'))), 0) \
                        AS BIGINT) AS reserved \
             FROM sandboxes s WHERE s.host = $1 AND s.status IN ",
            live_statuses!(),
            " GROUP BY 1, 2 ORDER BY 1, 2"
        ))
        .bind(host)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|row| {
                Ok(SandboxTally {
                    state: get_str(row, "state")?,
                    size: get_str(row, "size")?,
                    count: get_i64(row, "n")?,
                    reserved_micros: get_i64(row, "reserved")?,
                })
            })
            .collect()
    }
}
