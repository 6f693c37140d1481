//! Volumes (`Volumes`): an account's named ext4 file systems, each a file
//! on one node's disk (`sandpit_runtime::volume_files`, made there through
//! [`Machines`]), which outlive the sandboxes that mount them.
//!
//! Separate because a volume's life (its checks and quotas, its node, the
//! file made, grown and removed there, its price) is one concern, which a
//! sandbox's create asks only one thing of: are these mounts usable, and
//! record them ([`Service::checked_mounts`], [`Service::hold_volumes`]).
//!
//! The rows decide, the files follow: a create reserves the name and the
//! quota in the store (`creating`), then its node makes the file, and a
//! failure forgets the row; a resize marks it `resizing` (no sandbox can
//! take it meanwhile) before the node grows the file. Whether a live
//! sandbox holds it is the store's to say, in the transaction that acts
//! on it.
//!
//! Every start of a sandbox's VM (its create, a restore, a resume) is
//! told its mounts ([`Service::vm_volumes`]), as it is told its egress:
//! the rows are the truth, the VM follows. A sandbox started from a
//! snapshot that named none of its own gets the snapshot's sandbox's
//! volumes read-only, at the same paths ([`Service::fork_mounts`]).

use crate::api::{Caller, Volumes};
use crate::config::storage_cost;
use crate::error::{CoreError, ErrorType, Result};
use crate::model::*;
use crate::service::errors::runtime_error;
use crate::service::lifecycle::lived_seconds;
use crate::service::Service;
use sandpit_host::ids::rfc3339;
use sandpit_host::machines::{Machines, VmVolume};
use sandpit_store::{
    NewVolume, SandboxRow, SandboxStatus, VolumeChange, VolumeCreated, VolumeMountRow, VolumeRow,
    VolumeStatus, VolumesHeld,
};
use sha2::Digest;
use std::sync::Arc;
use time::OffsetDateTime;

/// The most volumes one sandbox mounts (its VM's volume slots).
pub const MAX_SANDBOX_VOLUMES: usize = 4;
/// The longest volume name.
const MAX_NAME_BYTES: usize = 64;
/// What starts a volume's id, and so no name.
const ID_PREFIX: &str = "vol_";
/// A GiB: volumes are sized in them.
const GIB: u64 = 1024 * 1024 * 1024;
/// How long a volume may be `creating` or `resizing` before the process
/// doing it is taken for lost (far past a node call's bound, 5 minutes).
pub const VOLUME_STUCK_AFTER: time::Duration = time::Duration::minutes(30);
/// Where no volume is mounted: the guest's system, which a mount over
/// would hide or break.
const SYSTEM_DIRS: [&str; 10] = [
    "/proc", "/sys", "/dev", "/etc", "/usr", "/bin", "/lib", "/sbin", "/boot", "/run",
];

/// A volume name checked: 1 to 64 letters, digits, `-` and `_` (E2B's
/// rule), not starting `vol_` (an id's).
pub fn check_volume_name(name: &str) -> Result<()> {
    if name.is_empty()
        || !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        return Err(CoreError::invalid(format!(
            "volume name {name:?} is not usable: 1 to {MAX_NAME_BYTES} letters, digits, - and _"
        )));
    }
    if name.len() > MAX_NAME_BYTES {
        return Err(CoreError::invalid(format!(
            "volume name {name:?} is {} bytes; at most {MAX_NAME_BYTES}",
            name.len()
        )));
    }
    if name.starts_with(ID_PREFIX) {
        return Err(CoreError::invalid(format!(
            "volume name {name:?}: the {ID_PREFIX} prefix is reserved for volume ids"
        )));
    }
    Ok(())
}

/// A mount path checked, as the guest will use it: absolute and
/// normalized (no `.`, `..`, `//` or trailing `/`), not `/` and not in the
/// guest's system directories.
pub fn check_mount_path(path: &str) -> Result<()> {
    let bad = |why: &str| Err(CoreError::invalid(format!("volume path {path:?} {why}")));
    if !path.starts_with('/') {
        return bad("is not absolute");
    }
    if path == "/" {
        return bad("is the root: mount a volume in a directory of its own");
    }
    if path.len() > 1024 || path.contains('\0') {
        return bad("is not a usable path");
    }
    if path.ends_with('/')
        || path[1..]
            .split('/')
            .any(|part| part.is_empty() || part == "." || part == "..")
    {
        return bad("is not normalized (no `.`, `..`, `//` or trailing `/`)");
    }
    if let Some(dir) = SYSTEM_DIRS
        .iter()
        .find(|dir| path == **dir || path.starts_with(&format!("{dir}/")))
    {
        return bad(&format!("is in {dir}, which the guest's system needs"));
    }
    Ok(())
}

/// A sandbox's volume mounts, checked, each with its volume.
#[derive(Debug, Clone, Default)]
pub(crate) struct CheckedMounts {
    /// `(volume, path, read_only)`, in the request's order.
    pub(crate) mounts: Vec<(VolumeRow, String, bool)>,
}

impl CheckedMounts {
    /// The node every volume lives on (one only: a sandbox runs on one).
    pub(crate) fn host(&self) -> Option<&str> {
        self.mounts.first().map(|(v, _, _)| v.host.as_str())
    }

    fn rows(&self, sandbox_id: &str) -> Vec<VolumeMountRow> {
        self.mounts
            .iter()
            .map(|(volume, path, read_only)| VolumeMountRow {
                sandbox_id: sandbox_id.to_string(),
                volume_id: volume.id.clone(),
                path: path.clone(),
                read_only: *read_only,
            })
            .collect()
    }
}

impl Service {
    /// What sandbox `row`'s VM mounts, slot by slot, as every start of it
    /// is told (its rows, by path).
    pub(crate) async fn vm_volumes(&self, row: &SandboxRow) -> Result<Vec<VmVolume>> {
        Ok(self
            .store
            .sandbox_volume_mounts(&row.id)
            .await?
            .into_iter()
            .map(|m| VmVolume {
                volume: m.volume_id,
                path: m.path,
                read_only: m.read_only,
            })
            .collect())
    }

    /// The mounts of a sandbox started from a snapshot of sandbox
    /// `origin`'s that names none of its own: the origin's volumes, each
    /// read-only at its path. A snapshot records which volumes were
    /// mounted, never their content (so the fork sees them as they are
    /// now), and a fork never takes a volume read-write: its origin may
    /// still hold it so, and two writers would corrupt it.
    pub(crate) async fn fork_mounts(&self, origin: &str) -> Result<Vec<VolumeMount>> {
        Ok(self
            .store
            .sandbox_volume_mounts(origin)
            .await?
            .into_iter()
            .map(|m| VolumeMount {
                volume: m.volume_id,
                path: m.path,
                read_only: true,
            })
            .collect())
    }
}

/// A volume as the API shows it.
pub(super) fn to_volume(row: &VolumeRow, holders: &[VolumeMountRow]) -> Volume {
    Volume {
        object: "volume".into(),
        id: row.id.clone(),
        name: row.name.clone(),
        size_gb: u32::try_from(row.size_bytes / GIB).unwrap_or(u32::MAX),
        status: row.status.as_str().into(),
        created_at: rfc3339(row.created_at),
        mounted_by: holders
            .iter()
            .map(|m| VolumeHolder {
                sandbox_id: m.sandbox_id.clone(),
                path: m.path.clone(),
                read_only: m.read_only,
            })
            .collect(),
    }
}

/// Volume `volume` is held: say by whom.
fn held(volume: &VolumeRow, holders: &[String], doing: &str) -> CoreError {
    CoreError::conflict(format!(
        "volume {:?} cannot be {doing} while sandboxes mount it ({}): destroy them first",
        volume.name,
        holders.join(", ")
    ))
}

/// Volume `volume` is being made or resized.
pub(super) fn busy(volume: &str, status: VolumeStatus) -> CoreError {
    CoreError::conflict(format!(
        "volume {volume:?} is {} now; retry in a moment",
        status.as_str()
    ))
    .with_retry_after(2)
}

/// Volume `volume`'s files are being read or written by the host.
fn leased(volume: &str, until: OffsetDateTime) -> CoreError {
    CoreError::conflict(format!(
        "volume {volume:?} is being read or written through its files API (until {} at the \
         latest); retry in a moment",
        rfc3339(until)
    ))
    .with_retry_after(2)
}

pub(super) fn no_volume(volume: &str) -> CoreError {
    CoreError::new(ErrorType::NotFound, format!("no volume {volume:?}"))
}

/// Over the account's bytes.
fn over_bytes(used: u64, asked: u64, limit: u64) -> CoreError {
    CoreError::new(
        ErrorType::RateLimited,
        format!(
            "the account's volumes take {} GiB, and {} GiB more would pass its quota of {} GiB: \
             delete or shrink what it no longer needs",
            used / GIB,
            asked / GIB,
            limit / GIB
        ),
    )
    .lasting()
}

#[async_trait::async_trait]
impl Volumes for Service {
    async fn create_volume(
        &self,
        caller: &Caller,
        req: CreateVolume,
        idempotency_key: Option<String>,
    ) -> Result<(Volume, bool)> {
        check_volume_name(&req.name)?;
        let limits = &self.config.volumes;
        let size_gb = req.size_gb.unwrap_or(limits.default_size_gb);
        self.check_size(size_gb)?;
        if let Some(k) = &idempotency_key {
            if k.is_empty() || k.len() > 255 {
                return Err(CoreError::invalid(
                    "Idempotency-Key must be 1 to 255 characters",
                ));
            }
        }
        // What a retry must ask again: the name and the size it gets.
        let hash = hex::encode(sha2::Sha256::digest(
            serde_json::to_vec(&(&req.name, size_gb)).expect("json"),
        ));
        let bytes = u64::from(size_gb) * GIB;
        let (host, machines) = self.volume_node().await?;
        let new = NewVolume {
            id: sandpit_host::ids::new_id(ID_PREFIX),
            account_id: caller.account_id.clone(),
            name: req.name.clone(),
            size_bytes: bytes,
            host,
            max_count: limits.max_per_account,
            max_bytes: limits.max_bytes_per_account,
            idempotency: idempotency_key.map(|key| (key, hash)),
        };
        match self.store.create_volume(&new).await? {
            VolumeCreated::Created(_) => {}
            VolumeCreated::Replay(row) => {
                let holders = self.store.volume_holders(&row.id).await?;
                return Ok((to_volume(&row, &holders), true));
            }
            VolumeCreated::IdempotencyConflict => {
                return Err(CoreError::conflict(super::create::KEY_REUSED))
            }
            VolumeCreated::NameTaken => {
                return Err(CoreError::conflict(format!(
                    "the account has a volume named {:?} already",
                    req.name
                )))
            }
            VolumeCreated::TooMany { count, limit } => {
                return Err(CoreError::new(
                    ErrorType::RateLimited,
                    format!(
                        "the account has {count} volumes; its quota is {limit}: delete one first"
                    ),
                )
                .lasting())
            }
            VolumeCreated::OverBytes { used, limit } => return Err(over_bytes(used, bytes, limit)),
        }
        // Made even if the caller goes: the row says what became of it.
        let id = new.id.clone();
        let made =
            tokio::spawn(async move { machines.create_volume(&id, bytes).await.map(|_| id) })
                .await
                .map_err(|e| CoreError::internal(format!("the volume's task failed: {e}")))?;
        if let Err(e) = made {
            if let Err(forget) = self.store.forget_volume(&new.id).await {
                tracing::warn!(id = %new.id, "forgetting a volume not made: {forget}");
            }
            return Err(runtime_error(e));
        }
        let row = self
            .store
            .volume_ready(&new.id, bytes)
            .await?
            .ok_or_else(|| CoreError::internal(format!("volume {} went while made", new.id)))?;
        Ok((to_volume(&row, &[]), false))
    }

    async fn list_volumes(&self, caller: &Caller) -> Result<List<Volume>> {
        let mut out = Vec::new();
        for row in self.store.list_volumes(&caller.account_id).await? {
            let holders = self.store.volume_holders(&row.id).await?;
            out.push(to_volume(&row, &holders));
        }
        Ok(List::new(out, false, None))
    }

    async fn get_volume(&self, caller: &Caller, volume: &str) -> Result<Volume> {
        let row = self.find_volume(caller, volume).await?;
        let holders = self.store.volume_holders(&row.id).await?;
        Ok(to_volume(&row, &holders))
    }

    async fn resize_volume(
        &self,
        caller: &Caller,
        volume: &str,
        req: ResizeVolume,
    ) -> Result<Volume> {
        let row = self.find_volume(caller, volume).await?;
        self.check_size(req.size_gb)?;
        let bytes = u64::from(req.size_gb) * GIB;
        if bytes <= row.size_bytes {
            return Err(CoreError::invalid(format!(
                "volume {:?} is {} GiB: a volume only grows (size_gb above {})",
                row.name,
                row.size_bytes / GIB,
                row.size_bytes / GIB
            )));
        }
        let limit = self.config.volumes.max_bytes_per_account;
        match self
            .store
            .begin_volume_resize(&caller.account_id, &row.id, bytes, limit)
            .await?
        {
            VolumeChange::Changed(_) => {}
            VolumeChange::Missing => return Err(no_volume(volume)),
            VolumeChange::Held(holders) => return Err(held(&row, &holders, "resized")),
            VolumeChange::Busy(status) => return Err(busy(&row.name, status)),
            VolumeChange::Leased(until) => return Err(leased(&row.name, until)),
            VolumeChange::OverBytes { used, limit } => {
                return Err(over_bytes(used, bytes - row.size_bytes, limit))
            }
        }
        let grown = match self.machines_on(&row.host, &row.id).await {
            Ok(machines) => {
                let id = row.id.clone();
                tokio::spawn(async move { machines.resize_volume(&id, bytes).await })
                    .await
                    .map_err(|e| CoreError::internal(format!("the volume's task failed: {e}")))?
                    .map_err(runtime_error)
            }
            Err(e) => Err(e),
        };
        if let Err(e) = grown {
            self.store.volume_resize_failed(&row.id).await?;
            return Err(e);
        }
        let row = self
            .store
            .volume_ready(&row.id, bytes)
            .await?
            .ok_or_else(|| CoreError::internal(format!("volume {} went while grown", row.id)))?;
        Ok(to_volume(&row, &[]))
    }

    async fn volume_files(
        &self,
        caller: &Caller,
        volume: &str,
        call: VolumeCall,
    ) -> Result<Vec<VolumeFile>> {
        self.volume_files_call(caller, volume, call).await
    }

    async fn upload_volume_file(
        &self,
        caller: &Caller,
        volume: &str,
        path: &str,
        size: u64,
        owner: VolumeOwnership,
        overwrite: bool,
        body: Box<dyn crate::api::ByteSource>,
    ) -> Result<VolumeFile> {
        self.volume_file_upload(caller, volume, path, size, owner, overwrite, body)
            .await
    }

    async fn move_volume(&self, caller: &Caller, volume: &str, node: &str) -> Result<Volume> {
        self.volume_move(caller, volume, node).await
    }

    async fn volume_token(&self, caller: &Caller, volume: &str) -> Result<String> {
        self.volume_token_for(caller, volume).await
    }

    async fn authenticate_volume(&self, volume_id: &str, token: &str) -> Result<Caller> {
        self.volume_token_caller(volume_id, token).await
    }

    async fn download_volume_file(
        &self,
        caller: &Caller,
        volume: &str,
        path: &str,
    ) -> Result<crate::api::FileDownload> {
        self.volume_file_download(caller, volume, path).await
    }

    async fn delete_volume(&self, caller: &Caller, volume: &str) -> Result<Volume> {
        let row = self.find_volume(caller, volume).await?;
        let gone = match self
            .store
            .delete_volume(&caller.account_id, &row.id)
            .await?
        {
            VolumeChange::Changed(gone) => gone,
            VolumeChange::Missing => return Err(no_volume(volume)),
            VolumeChange::Held(holders) => return Err(held(&row, &holders, "deleted")),
            VolumeChange::Busy(status) => return Err(busy(&row.name, status)),
            VolumeChange::Leased(until) => return Err(leased(&row.name, until)),
            VolumeChange::OverBytes { .. } => {
                return Err(CoreError::internal("a delete counted bytes"))
            }
        };
        // Deleted for its owner (its name free, its billing ended) whatever
        // becomes of its file, which its node removes.
        let removed = match self.machines_on(&gone.host, &gone.id).await {
            Ok(machines) => machines
                .delete_volume(&gone.id)
                .await
                .map_err(runtime_error),
            Err(e) => Err(e),
        };
        if let Err(e) = removed {
            tracing::warn!(id = %gone.id, node = %gone.host, "removing a deleted volume's file: {e}");
        }
        Ok(to_volume(&gone, &[]))
    }
}

impl Service {
    /// A size in GiB the service makes.
    fn check_size(&self, size_gb: u32) -> Result<()> {
        let max = self.config.volumes.max_size_gb;
        if size_gb == 0 || size_gb > max {
            return Err(CoreError::invalid(format!(
                "size_gb must be between 1 and {max}, not {size_gb}"
            )));
        }
        Ok(())
    }

    /// Where a new volume goes: the node a sandbox would go to now (this
    /// machine outside a cluster).
    async fn volume_node(&self) -> Result<(String, Arc<dyn Machines>)> {
        let placed = self.placement(&self.config.default_size).await?;
        let first = placed.into_iter().next().ok_or_else(|| {
            CoreError::new(
                ErrorType::ServiceUnavailable,
                "no node has room for a volume now; retry later",
            )
            .with_retry_after(5)
        })?;
        Ok((first.host, first.machines))
    }

    /// The account's volume of id `volume` (`vol_…`) or of that name.
    pub(super) async fn find_volume(&self, caller: &Caller, volume: &str) -> Result<VolumeRow> {
        let found = match volume.starts_with(ID_PREFIX) {
            true => self
                .store
                .volume(&caller.account_id, volume)
                .await?
                .filter(|v| v.status != VolumeStatus::Deleted),
            false => self.store.volume_named(&caller.account_id, volume).await?,
        };
        found.ok_or_else(|| no_volume(volume))
    }

    /// A create's `volumes` checked: at most four, distinct paths that a
    /// volume may be mounted at, each an existing volume of the caller's,
    /// all on one node, none held read-write elsewhere when asked
    /// read-write (checked again, race-free, when recorded:
    /// [`Service::hold_volumes`]).
    pub(crate) async fn checked_mounts(
        &self,
        caller: &Caller,
        mounts: &[VolumeMount],
    ) -> Result<CheckedMounts> {
        if mounts.len() > MAX_SANDBOX_VOLUMES {
            return Err(CoreError::invalid(format!(
                "volumes names {} mounts; a sandbox mounts at most {MAX_SANDBOX_VOLUMES}",
                mounts.len()
            )));
        }
        let mut checked = CheckedMounts::default();
        for (i, mount) in mounts.iter().enumerate() {
            check_mount_path(&mount.path)?;
            for other in &mounts[..i] {
                let (a, b) = (&other.path, &mount.path);
                if a == b || a.starts_with(&format!("{b}/")) || b.starts_with(&format!("{a}/")) {
                    return Err(CoreError::invalid(format!(
                        "volume paths {a:?} and {b:?} overlap: each volume needs a path of its own"
                    )));
                }
            }
            let volume = self.find_volume(caller, &mount.volume).await?;
            if volume.status != VolumeStatus::Ready {
                return Err(busy(&volume.name, volume.status));
            }
            if checked.mounts.iter().any(|(v, _, _)| v.id == volume.id) {
                return Err(CoreError::invalid(format!(
                    "volume {:?} is named twice: mount it once",
                    volume.name
                )));
            }
            if let Some(host) = checked.host() {
                if host != volume.host {
                    return Err(CoreError::invalid(format!(
                        "volumes {:?} and {:?} are on different nodes ({host} and {}): a \
                         sandbox mounts volumes of one node",
                        checked.mounts[0].0.name, volume.name, volume.host
                    )));
                }
            }
            if !mount.read_only {
                let holders = self.store.volume_holders(&volume.id).await?;
                if let Some(writer) = holders.iter().find(|m| !m.read_only) {
                    return Err(read_write_elsewhere(&volume.name, &writer.sandbox_id));
                }
            }
            checked
                .mounts
                .push((volume, mount.path.clone(), mount.read_only));
        }
        Ok(checked)
    }

    /// Records new sandbox `row`'s mounts (see
    /// [`sandpit_store::Store::hold_volumes`]); refused, the sandbox ends
    /// (failed, nothing charged) and the create is answered why.
    pub(crate) async fn hold_volumes(
        &self,
        row: &SandboxRow,
        mounts: &CheckedMounts,
    ) -> Result<()> {
        if mounts.mounts.is_empty() {
            return Ok(());
        }
        let why = match self
            .store
            .hold_volumes(&row.account_id, &row.id, &mounts.rows(&row.id))
            .await?
        {
            VolumesHeld::Held => return Ok(()),
            VolumesHeld::Missing { volume_id } => no_volume(&volume_id),
            VolumesHeld::NotReady { volume_id, status } => busy(&volume_id, status),
            VolumesHeld::Leased { volume_id, until } => {
                let name = mounts
                    .mounts
                    .iter()
                    .find(|(v, _, _)| v.id == volume_id)
                    .map_or(volume_id.clone(), |(v, _, _)| v.name.clone());
                leased(&name, until)
            }
            VolumesHeld::HeldReadWrite {
                volume_id,
                sandbox_id,
            } => {
                let name = mounts
                    .mounts
                    .iter()
                    .find(|(v, _, _)| v.id == volume_id)
                    .map_or(volume_id.clone(), |(v, _, _)| v.name.clone());
                read_write_elsewhere(&name, &sandbox_id)
            }
        };
        if let Err(e) = self
            .end(
                row,
                SandboxStatus::Failed,
                "its volumes were taken",
                sandpit_store::Cause::by(crate::service::events::SANDPIT),
            )
            .await
        {
            tracing::warn!(id = %row.id, "ending a sandbox whose volumes were taken: {e}");
        }
        Err(why)
    }

    /// Charges every account for its volumes' storage not charged yet, up
    /// to `upto` (to a volume's delete, once deleted): a ledger charge per
    /// volume of its size for those seconds at `price_usd_per_gb_month`,
    /// as the usage report counts it (run by [`Service::start`]'s hourly
    /// sweep, so the balance trails the storage by an hour at most). The
    /// charges made.
    pub async fn charge_volumes(&self, upto: OffsetDateTime) -> Result<usize> {
        let price = self.config.volumes.price_usd_per_gb_month;
        let mut charged = 0;
        for unbilled in self.store.unbilled_volumes(upto).await? {
            let end = unbilled.volume.deleted_at.map_or(upto, |d| d.min(upto));
            let seconds = (end - unbilled.billed_until).whole_seconds();
            let Ok(seconds @ 1..) = u64::try_from(seconds) else {
                continue;
            };
            let to = unbilled.billed_until + time::Duration::seconds(seconds as i64);
            let amount = storage_cost(price, unbilled.volume.size_bytes, seconds);
            let note = format!(
                "volume {} ({}): {} GiB stored for {seconds} s",
                unbilled.volume.name,
                unbilled.volume.id,
                unbilled.volume.size_bytes / GIB
            );
            if self
                .store
                .charge_volume(&unbilled, to, amount, &note)
                .await?
            {
                charged += 1;
            }
        }
        Ok(charged)
    }

    /// Settles volumes whose making or growing never finished (the process
    /// doing it was lost): one never made is removed from its node and
    /// forgotten (its name, quota and key free again); one never grown is
    /// `ready` again at the size its row had (its file may be larger, which
    /// a later resize takes in). Stuck: in that state for longer than
    /// `after` ([`VOLUME_STUCK_AFTER`] in [`Service::start`]'s hourly
    /// sweep); a node out of reach is tried again at the next.
    pub async fn sweep_stuck_volumes(&self, after: time::Duration) -> Result<()> {
        let before = OffsetDateTime::now_utc() - after;
        for volume in self.store.stuck_volumes(before).await? {
            match volume.status {
                VolumeStatus::Creating => {
                    let removed = match self.machines_on(&volume.host, &volume.id).await {
                        Ok(machines) => machines
                            .delete_volume(&volume.id)
                            .await
                            .map_err(runtime_error),
                        Err(e) => Err(e),
                    };
                    if let Err(e) = removed {
                        tracing::warn!(id = %volume.id, node = %volume.host, "removing a volume never made: {e}");
                        continue;
                    }
                    self.store.forget_volume(&volume.id).await?;
                }
                VolumeStatus::Resizing => self.store.volume_resize_failed(&volume.id).await?,
                VolumeStatus::Ready | VolumeStatus::Deleted => continue,
            }
            tracing::warn!(
                id = %volume.id,
                status = volume.status.as_str(),
                "a volume whose {} never finished is settled",
                match volume.status {
                    VolumeStatus::Creating => "making",
                    _ => "growing",
                }
            );
        }
        Ok(())
    }

    /// Removes this machine's volume files that nothing will use again: a
    /// deleted volume's whose node was out of reach at its delete, and what
    /// a make lost mid-way left (older than `after`). A file no volume row
    /// names is left alone, and logged: a database restored from an older
    /// backup must not cost anyone a volume.
    pub async fn sweep_volume_files(&self, after: time::Duration) -> Result<()> {
        let Some(vms) = self.vms() else {
            return Ok(());
        };
        let files = vms.volume_files();
        let bound = std::time::SystemTime::now() - after.unsigned_abs();
        for file in files.list().map_err(runtime_error)? {
            if file.making {
                if file.modified < bound {
                    tracing::warn!(id = %file.id, "removing what a lost make of a volume left");
                    files.remove_unfinished(&file.id).map_err(runtime_error)?;
                }
                continue;
            }
            match self.store.volume_by_id(&file.id).await? {
                Some(row) if row.status == VolumeStatus::Deleted => {
                    tracing::warn!(id = %file.id, "removing a deleted volume's file");
                    files.delete(&file.id).await.map_err(runtime_error)?;
                }
                // Kept on another node now (moved, its old copy's removal
                // having failed): this copy is stale. (A copy just received,
                // whose row is about to say so, is recent.)
                Some(row) if row.host != self.config.host_name && file.modified < bound => {
                    tracing::warn!(id = %file.id, node = %row.host, "removing a moved volume's old copy");
                    files.delete(&file.id).await.map_err(runtime_error)?;
                }
                Some(_) => {}
                None => {
                    tracing::warn!(id = %file.id, "a volume file no volume names: left as it is");
                }
            }
        }
        Ok(())
    }

    /// The account's volumes in a usage report since `since`: each billed
    /// for its size, per second it existed then. With their total.
    pub(crate) async fn volume_usage(
        &self,
        account_id: &str,
        since: OffsetDateTime,
        now: OffsetDateTime,
    ) -> Result<(Vec<VolumeUsage>, i64)> {
        let price = self.config.volumes.price_usd_per_gb_month;
        let mut total = 0;
        let rows = self.store.volumes_since(account_id, since).await?;
        let usage = rows
            .iter()
            .map(|v| {
                let from = v.created_at.max(since);
                let until = v.deleted_at.unwrap_or(now).max(from);
                let seconds = lived_seconds(from, until);
                let cost = storage_cost(price, v.size_bytes, seconds);
                total += cost;
                VolumeUsage {
                    id: v.id.clone(),
                    name: v.name.clone(),
                    size_gb: u32::try_from(v.size_bytes / GIB).unwrap_or(u32::MAX),
                    seconds,
                    cost_usd: usd(cost),
                    created_at: rfc3339(v.created_at),
                    deleted_at: v.deleted_at.map(rfc3339),
                }
            })
            .collect();
        Ok((usage, total))
    }
}

/// Volume `name` is mounted read-write by live sandbox `sandbox_id`.
fn read_write_elsewhere(name: &str, sandbox_id: &str) -> CoreError {
    CoreError::conflict(format!(
        "volume {name:?} is mounted read-write by sandbox {sandbox_id}: one sandbox at a time \
         may write it; mount it read_only, or destroy that sandbox first"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_e2b_s_and_never_an_id() {
        for ok in ["data", "a", "My_Cache-2", &"x".repeat(64)] {
            check_volume_name(ok).unwrap();
        }
        for (bad, why) in [
            ("", "letters, digits"),
            ("has space", "letters, digits"),
            ("dot.ted", "letters, digits"),
            ("ünï", "letters, digits"),
            (&"x".repeat(65), "at most 64"),
            ("vol_abc", "reserved for volume ids"),
        ] {
            let e = check_volume_name(bad).unwrap_err();
            assert_eq!(e.kind, ErrorType::InvalidRequest);
            assert!(e.message.contains(why), "{bad:?}: {e}");
        }
    }

    #[test]
    fn mount_paths_are_absolute_normalized_and_outside_the_system() {
        for ok in [
            "/data",
            "/home/user/work",
            "/mnt/a",
            "/workspace/cache",
            "/opt/x",
        ] {
            check_mount_path(ok).unwrap();
        }
        for (bad, why) in [
            ("data", "not absolute"),
            ("/", "the root"),
            ("/data/", "not normalized"),
            ("/a//b", "not normalized"),
            ("/a/./b", "not normalized"),
            ("/a/../etc", "not normalized"),
            ("/etc", "in /etc"),
            ("/usr/local/x", "in /usr"),
            ("/proc/1", "in /proc"),
            ("/run/user", "in /run"),
            ("/dev", "in /dev"),
        ] {
            let e = check_mount_path(bad).unwrap_err();
            assert!(e.message.contains(why), "{bad:?}: {e}");
        }
        // A prefix is not a parent.
        check_mount_path("/devices").unwrap();
        check_mount_path("/library").unwrap();
    }
}
