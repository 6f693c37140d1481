//! Templates (see migration 0016): one row per build of an account's
//! `name:tag`, the layers builds left (a saved state per step, by cache
//! key, on the host that holds it), and the files `COPY` steps unpack.
//!
//! A build's life: `building` (its log and `updated_at` move as it goes),
//! then `ready` with the save sandboxes start from, or `failed` with why.
//! The newest ready build of a name:tag is the template; older ready ones
//! stay until retired ([`Store::retire_templates`]), so a sandbox
//! starting from one meanwhile still finds its save.

use crate::error::Result;
use crate::util::{format_ts, get_i64, get_opt_str, get_opt_ts, get_str, get_ts, now};
use crate::Store;
use sqlx::any::AnyRow;
use time::OffsetDateTime;

/// Where a build is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TemplateStatus {
    /// Asked for, its steps not given yet (E2B's builder uploads its files
    /// in between; see migration 0017).
    Waiting,
    Building,
    Ready,
    Failed,
    Deleted,
}

impl TemplateStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            TemplateStatus::Waiting => "waiting",
            TemplateStatus::Building => "building",
            TemplateStatus::Ready => "ready",
            TemplateStatus::Failed => "failed",
            TemplateStatus::Deleted => "deleted",
        }
    }

    fn stored(s: &str) -> Result<TemplateStatus> {
        match s {
            "waiting" => Ok(TemplateStatus::Waiting),
            "building" => Ok(TemplateStatus::Building),
            "ready" => Ok(TemplateStatus::Ready),
            "failed" => Ok(TemplateStatus::Failed),
            "deleted" => Ok(TemplateStatus::Deleted),
            other => Err(crate::StoreError::Corrupt(format!(
                "unknown template status {other:?}"
            ))),
        }
    }
}

/// A template build as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TemplateRow {
    pub id: String,
    pub account_id: String,
    pub name: String,
    pub tag: String,
    pub size: String,
    pub status: TemplateStatus,
    /// Its description (`sandpit_templates::Spec`, as JSON).
    pub spec: String,
    /// Published by an operator: every account may start from it.
    pub public: bool,
    /// The save its sandboxes start from, and the host that holds it
    /// (once ready).
    pub snapshot_id: Option<String>,
    pub host: Option<String>,
    /// What its layers take on that host's disk.
    pub bytes: u64,
    /// Its steps, and how many of them a cached layer spared.
    pub steps: u32,
    pub cached_steps: u32,
    pub log: String,
    pub error: Option<String>,
    pub created_at: OffsetDateTime,
    pub updated_at: OffsetDateTime,
    pub finished_at: Option<OffsetDateTime>,
    /// A waiting build's secret for uploading its files (E2B's upload
    /// URL carries it instead of an API key).
    pub upload_token: Option<String>,
}

/// A layer: the save after a step, by the key naming that step and every
/// one before it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerRow {
    pub account_id: String,
    pub layer_key: String,
    pub host: String,
    pub save_id: String,
    pub size: String,
    pub bytes: u64,
}

fn template_from(row: &AnyRow) -> Result<TemplateRow> {
    Ok(TemplateRow {
        id: get_str(row, "id")?,
        account_id: get_str(row, "account_id")?,
        name: get_str(row, "name")?,
        tag: get_str(row, "tag")?,
        size: get_str(row, "size")?,
        status: TemplateStatus::stored(&get_str(row, "status")?)?,
        spec: get_str(row, "spec")?,
        public: get_i64(row, "public")? != 0,
        snapshot_id: get_opt_str(row, "snapshot_id")?,
        host: get_opt_str(row, "host")?,
        bytes: get_i64(row, "bytes")?.max(0) as u64,
        steps: get_i64(row, "steps")?.max(0) as u32,
        cached_steps: get_i64(row, "cached_steps")?.max(0) as u32,
        log: get_str(row, "log")?,
        error: get_opt_str(row, "error")?,
        created_at: get_ts(row, "created_at")?,
        updated_at: get_ts(row, "updated_at")?,
        finished_at: get_opt_ts(row, "finished_at")?,
        upload_token: get_opt_str(row, "upload_token")?,
    })
}

fn layer_from(row: &AnyRow) -> Result<LayerRow> {
    Ok(LayerRow {
        account_id: get_str(row, "account_id")?,
        layer_key: get_str(row, "layer_key")?,
        host: get_str(row, "host")?,
        save_id: get_str(row, "save_id")?,
        size: get_str(row, "size")?,
        bytes: get_i64(row, "bytes")?.max(0) as u64,
    })
}

/// A log as PostgreSQL's TEXT takes it (no NUL), at most `max` bytes: its
/// end, cut at a character boundary.
fn storable_log(log: &str, max: usize) -> String {
    let log = log.replace('\0', "\u{fffd}");
    if log.len() <= max {
        return log;
    }
    let mut from = log.len() - max;
    while !log.is_char_boundary(from) {
        from += 1;
    }
    log[from..].to_string()
}

/// The most of a build's log kept.
pub const MAX_LOG_BYTES: usize = 256 * 1024;

impl Store {
    /// Records a new build of `account_id`'s `name:tag`, `building`.
    pub async fn create_template(
        &self,
        id: &str,
        account_id: &str,
        (name, tag): (&str, &str),
        size: &str,
        spec: &str,
        steps: u32,
    ) -> Result<TemplateRow> {
        let at = format_ts(now());
        let row = sqlx::query(
            "INSERT INTO templates (id, account_id, name, tag, size, status, spec, steps, \
               created_at, updated_at) \
             VALUES ($1, $2, $3, $4, $5, 'building', $6, $7, $8, $8) RETURNING *",
        )
        .bind(id)
        .bind(account_id)
        .bind(name)
        .bind(tag)
        .bind(size)
        .bind(spec)
        .bind(i64::from(steps))
        .bind(at)
        .fetch_one(&self.pool)
        .await?;
        template_from(&row)
    }

    /// Records a build of `account_id`'s `name:tag` whose steps come later
    /// ([`Store::start_template`]), `waiting`, with the secret its files'
    /// uploads carry.
    pub async fn reserve_template(
        &self,
        id: &str,
        account_id: &str,
        (name, tag): (&str, &str),
        size: &str,
        upload_token: &str,
    ) -> Result<TemplateRow> {
        let at = format_ts(now());
        let row = sqlx::query(
            "INSERT INTO templates (id, account_id, name, tag, size, status, spec, steps, \
               upload_token, created_at, updated_at) \
             VALUES ($1, $2, $3, $4, $5, 'waiting', '{}', 0, $6, $7, $7) RETURNING *",
        )
        .bind(id)
        .bind(account_id)
        .bind(name)
        .bind(tag)
        .bind(size)
        .bind(upload_token)
        .bind(at)
        .fetch_one(&self.pool)
        .await?;
        template_from(&row)
    }

    /// A waiting build given its steps: `building` from now (its upload
    /// token spent). `None` if it is not waiting (started already, failed
    /// by the reaper, deleted).
    pub async fn start_template(
        &self,
        id: &str,
        spec: &str,
        steps: u32,
    ) -> Result<Option<TemplateRow>> {
        let row = sqlx::query(
            "UPDATE templates SET status = 'building', spec = $2, steps = $3, \
               upload_token = NULL, updated_at = $4 \
             WHERE id = $1 AND status = 'waiting' RETURNING *",
        )
        .bind(id)
        .bind(spec)
        .bind(i64::from(steps))
        .bind(format_ts(now()))
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(template_from).transpose()
    }

    /// What `account_id`'s templates hold: the `name:tag`s with a build
    /// waiting, building or ready (other than `except`, the one a new build
    /// is of), and the bytes of its builds' layers (a layer two builds
    /// share counts twice) and of its uploaded files.
    pub async fn template_usage(
        &self,
        account_id: &str,
        except: (&str, &str),
    ) -> Result<(u64, u64)> {
        let names: i64 = sqlx::query_scalar(
            "SELECT CAST(COUNT(*) AS BIGINT) FROM (SELECT DISTINCT name, tag FROM templates \
               WHERE account_id = $1 AND status IN ('waiting', 'building', 'ready') \
                 AND NOT (name = $2 AND tag = $3)) AS held",
        )
        .bind(account_id)
        .bind(except.0)
        .bind(except.1)
        .fetch_one(&self.pool)
        .await?;
        let builds: i64 = sqlx::query_scalar(
            "SELECT CAST(COALESCE(SUM(bytes), 0) AS BIGINT) FROM templates \
             WHERE account_id = $1 AND status IN ('building', 'ready')",
        )
        .bind(account_id)
        .fetch_one(&self.pool)
        .await?;
        let files: i64 = sqlx::query_scalar(
            "SELECT CAST(COALESCE(SUM(bytes), 0) AS BIGINT) FROM template_files \
             WHERE account_id = $1",
        )
        .bind(account_id)
        .fetch_one(&self.pool)
        .await?;
        Ok((names.max(0) as u64, (builds.max(0) + files.max(0)) as u64))
    }

    /// A building template's log so far (its last [`MAX_LOG_BYTES`]) and
    /// how many steps were cached; moves its `updated_at`, which says the
    /// build is alive.
    pub async fn template_progress(&self, id: &str, log: &str, cached_steps: u32) -> Result<()> {
        sqlx::query(
            "UPDATE templates SET log = $2, cached_steps = $3, updated_at = $4 \
             WHERE id = $1 AND status = 'building'",
        )
        .bind(id)
        .bind(storable_log(log, MAX_LOG_BYTES))
        .bind(i64::from(cached_steps))
        .bind(format_ts(now()))
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// A build is over: `ready` from save `snapshot_id` on `host` taking
    /// `bytes` (with `error` `None`), else `failed` with `error`. `None` if
    /// it was not building any more.
    pub async fn finish_template(
        &self,
        id: &str,
        outcome: std::result::Result<(&str, &str, u64), &str>,
        log: &str,
    ) -> Result<Option<TemplateRow>> {
        let (status, snapshot, host, bytes, error) = match outcome {
            Ok((snapshot, host, bytes)) => (
                "ready",
                Some(snapshot),
                Some(host),
                i64::try_from(bytes).unwrap_or(i64::MAX),
                None,
            ),
            Err(e) => ("failed", None, None, 0, Some(e)),
        };
        let at = format_ts(now());
        let row = sqlx::query(
            "UPDATE templates SET status = $2, snapshot_id = $3, host = $4, bytes = $5, \
               error = $6, log = $7, updated_at = $8, finished_at = $8 \
             WHERE id = $1 AND status = 'building' RETURNING *",
        )
        .bind(id)
        .bind(status)
        .bind(snapshot)
        .bind(host)
        .bind(bytes)
        .bind(error)
        .bind(storable_log(log, MAX_LOG_BYTES))
        .bind(at)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(template_from).transpose()
    }

    /// Builds that stopped moving before `before` (their server died), and
    /// builds left waiting for their steps since `waiting_before`: failed,
    /// with that said. Returns how many.
    pub async fn fail_stalled_templates(
        &self,
        before: OffsetDateTime,
        waiting_before: OffsetDateTime,
    ) -> Result<u64> {
        let at = format_ts(now());
        let stalled = sqlx::query(
            "UPDATE templates SET status = 'failed', \
               error = 'the build stopped: the server running it went away', \
               updated_at = $2, finished_at = $2 \
             WHERE status = 'building' AND updated_at < $1",
        )
        .bind(format_ts(before))
        .bind(&at)
        .execute(&self.pool)
        .await?;
        let abandoned = sqlx::query(
            "UPDATE templates SET status = 'failed', upload_token = NULL, \
               error = 'the build was asked for and never started (its steps never came)', \
               updated_at = $2, finished_at = $2 \
             WHERE status = 'waiting' AND updated_at < $1",
        )
        .bind(format_ts(waiting_before))
        .bind(&at)
        .execute(&self.pool)
        .await?;
        Ok(stalled.rows_affected() + abandoned.rows_affected())
    }

    /// A build by id, in any status.
    pub async fn template(&self, id: &str) -> Result<Option<TemplateRow>> {
        let row = sqlx::query("SELECT * FROM templates WHERE id = $1")
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(template_from).transpose()
    }

    /// The newest build of `name:tag` that `account_id` may see in
    /// `statuses`: its own first, else a published one (the newest).
    pub async fn template_named(
        &self,
        account_id: &str,
        name: &str,
        tag: &str,
        statuses: &[TemplateStatus],
    ) -> Result<Option<TemplateRow>> {
        let rows = sqlx::query(
            "SELECT * FROM templates WHERE name = $1 AND tag = $2 \
               AND (account_id = $3 OR public <> 0) \
             ORDER BY CASE WHEN account_id = $3 THEN 0 ELSE 1 END, created_at DESC, id DESC",
        )
        .bind(name)
        .bind(tag)
        .bind(account_id)
        .fetch_all(&self.pool)
        .await?;
        for row in &rows {
            let t = template_from(row)?;
            if statuses.contains(&t.status) {
                return Ok(Some(t));
            }
        }
        Ok(None)
    }

    /// The templates `account_id` may see (its own, then published ones),
    /// not deleted: every build, newest first.
    pub async fn templates_of(&self, account_id: &str) -> Result<Vec<TemplateRow>> {
        let rows = sqlx::query(
            "SELECT * FROM templates WHERE status <> 'deleted' \
               AND (account_id = $1 OR public <> 0) \
             ORDER BY created_at DESC, id DESC",
        )
        .bind(account_id)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(template_from).collect()
    }

    /// Marks a build deleted; the row as it was, or `None` if it was.
    pub async fn delete_template(&self, id: &str) -> Result<Option<TemplateRow>> {
        let row = sqlx::query(
            "UPDATE templates SET status = 'deleted', deleted_at = $2 \
             WHERE id = $1 AND status <> 'deleted' RETURNING *",
        )
        .bind(id)
        .bind(format_ts(now()))
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(template_from).transpose()
    }

    /// Publishes (or withdraws) every build of an account's `name:tag`.
    /// Returns how many builds it touched.
    pub async fn publish_template(
        &self,
        account_id: &str,
        name: &str,
        tag: &str,
        public: bool,
    ) -> Result<u64> {
        let done = sqlx::query(
            "UPDATE templates SET public = $4 \
             WHERE account_id = $1 AND name = $2 AND tag = $3 AND status <> 'deleted'",
        )
        .bind(account_id)
        .bind(name)
        .bind(tag)
        .bind(i64::from(public))
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected())
    }

    /// Ready builds of `name:tag` beyond the newest `keep`: deleted
    /// (their layers stay while newer builds use them). Returns them.
    pub async fn retire_templates(
        &self,
        account_id: &str,
        name: &str,
        tag: &str,
        keep: usize,
    ) -> Result<Vec<TemplateRow>> {
        let rows = sqlx::query(
            "SELECT * FROM templates WHERE account_id = $1 AND name = $2 AND tag = $3 \
               AND status IN ('ready', 'failed') ORDER BY created_at DESC, id DESC",
        )
        .bind(account_id)
        .bind(name)
        .bind(tag)
        .fetch_all(&self.pool)
        .await?;
        let mut retired = Vec::new();
        for row in rows.iter().skip(keep) {
            let t = template_from(row)?;
            if let Some(t) = self.delete_template(&t.id).await? {
                retired.push(t);
            }
        }
        Ok(retired)
    }

    /// An account's layer of `layer_key`, on any of `hosts` (the first
    /// found, in their order), marked used now.
    pub async fn template_layer(
        &self,
        account_id: &str,
        layer_key: &str,
        hosts: &[String],
    ) -> Result<Option<LayerRow>> {
        let rows =
            sqlx::query("SELECT * FROM template_layers WHERE account_id = $1 AND layer_key = $2")
                .bind(account_id)
                .bind(layer_key)
                .fetch_all(&self.pool)
                .await?;
        let layers = rows.iter().map(layer_from).collect::<Result<Vec<_>>>()?;
        let Some(found) = hosts
            .iter()
            .find_map(|h| layers.iter().find(|l| &l.host == h))
            .cloned()
        else {
            return Ok(None);
        };
        sqlx::query(
            "UPDATE template_layers SET used_at = $3 WHERE account_id = $1 AND save_id = $2",
        )
        .bind(account_id)
        .bind(&found.save_id)
        .bind(format_ts(now()))
        .execute(&self.pool)
        .await?;
        Ok(Some(found))
    }

    /// The layer whose save is `save_id` (a template's save is always
    /// one), if any.
    pub async fn template_layer_of(&self, save_id: &str) -> Result<Option<LayerRow>> {
        sqlx::query("SELECT * FROM template_layers WHERE save_id = $1")
            .bind(save_id)
            .fetch_optional(&self.pool)
            .await?
            .as_ref()
            .map(layer_from)
            .transpose()
    }

    /// Every host's copy of an account's layer of `layer_key` (a node that
    /// fetched a template holds a copy of its layer).
    pub async fn template_layer_copies(
        &self,
        account_id: &str,
        layer_key: &str,
    ) -> Result<Vec<LayerRow>> {
        sqlx::query("SELECT * FROM template_layers WHERE account_id = $1 AND layer_key = $2")
            .bind(account_id)
            .bind(layer_key)
            .fetch_all(&self.pool)
            .await?
            .iter()
            .map(layer_from)
            .collect()
    }

    /// Forgets the layer whose save is `save_id` (a copy that could not be
    /// made); the host's sweep then removes whatever of it is there.
    pub async fn forget_template_layer(&self, save_id: &str) -> Result<()> {
        sqlx::query("DELETE FROM template_layers WHERE save_id = $1")
            .bind(save_id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Forgets the layers nobody used since `before` that no live template
    /// starts from (the cache's eviction; the sweep then removes their
    /// saves, which nothing names any more). Returns how many.
    pub async fn drop_stale_template_layers(&self, before: OffsetDateTime) -> Result<u64> {
        let done = sqlx::query(
            "DELETE FROM template_layers WHERE used_at < $1 AND save_id NOT IN \
               (SELECT snapshot_id FROM templates \
                WHERE status <> 'deleted' AND snapshot_id IS NOT NULL)",
        )
        .bind(format_ts(before))
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected())
    }

    /// Records a layer (a newer save of the same key on the same host
    /// replaces it: a forced step); returns the save it replaced, for its
    /// files to go.
    pub async fn put_template_layer(&self, layer: &LayerRow) -> Result<Option<String>> {
        let mut tx = self.write_tx().await?;
        let before: Option<String> = sqlx::query_scalar(
            "SELECT save_id FROM template_layers \
             WHERE account_id = $1 AND layer_key = $2 AND host = $3",
        )
        .bind(&layer.account_id)
        .bind(&layer.layer_key)
        .bind(&layer.host)
        .fetch_optional(&mut *tx)
        .await?;
        sqlx::query(
            "DELETE FROM template_layers WHERE account_id = $1 AND layer_key = $2 AND host = $3",
        )
        .bind(&layer.account_id)
        .bind(&layer.layer_key)
        .bind(&layer.host)
        .execute(&mut *tx)
        .await?;
        let at = format_ts(now());
        sqlx::query(
            "INSERT INTO template_layers (account_id, layer_key, host, save_id, size, bytes, \
               created_at, used_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $7)",
        )
        .bind(&layer.account_id)
        .bind(&layer.layer_key)
        .bind(&layer.host)
        .bind(&layer.save_id)
        .bind(&layer.size)
        .bind(i64::try_from(layer.bytes).unwrap_or(i64::MAX))
        .bind(at)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(before.filter(|b| *b != layer.save_id))
    }

    /// Every save on `host` that a layer or a template that is not deleted
    /// names: what the host's sweep keeps.
    pub async fn template_saves_on(&self, host: &str) -> Result<Vec<String>> {
        let mut saves: Vec<String> =
            sqlx::query_scalar("SELECT save_id FROM template_layers WHERE host = $1")
                .bind(host)
                .fetch_all(&self.pool)
                .await?;
        let finals: Vec<Option<String>> = sqlx::query_scalar(
            "SELECT snapshot_id FROM templates WHERE host = $1 AND status <> 'deleted'",
        )
        .bind(host)
        .fetch_all(&self.pool)
        .await?;
        saves.extend(finals.into_iter().flatten());
        Ok(saves)
    }

    /// Stores the files of a COPY (a tar) under their SHA-256, for
    /// `account_id` (kept once).
    pub async fn put_template_files(
        &self,
        account_id: &str,
        sha256: &str,
        data: &[u8],
    ) -> Result<()> {
        sqlx::query(
            "INSERT INTO template_files (account_id, sha256, data, bytes, created_at) \
             VALUES ($1, $2, $3, $4, $5) ON CONFLICT (account_id, sha256) DO NOTHING",
        )
        .bind(account_id)
        .bind(sha256)
        .bind(data.to_vec())
        .bind(data.len() as i64)
        .bind(format_ts(now()))
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// The files `account_id` uploaded under `sha256`.
    pub async fn template_files(&self, account_id: &str, sha256: &str) -> Result<Option<Vec<u8>>> {
        let data: Option<Vec<u8>> = sqlx::query_scalar(
            "SELECT data FROM template_files WHERE account_id = $1 AND sha256 = $2",
        )
        .bind(account_id)
        .bind(sha256)
        .fetch_optional(&self.pool)
        .await?;
        Ok(data)
    }

    /// Whether `account_id` uploaded files under `sha256`.
    pub async fn has_template_files(&self, account_id: &str, sha256: &str) -> Result<bool> {
        let n: i64 = sqlx::query_scalar(
            "SELECT CAST(COUNT(*) AS BIGINT) FROM template_files \
             WHERE account_id = $1 AND sha256 = $2",
        )
        .bind(account_id)
        .bind(sha256)
        .fetch_one(&self.pool)
        .await?;
        Ok(n > 0)
    }
}
