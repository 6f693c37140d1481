//! The fake's [`SandboxApi`]: each operation recorded, its fault (if one is
//! armed) raised, then done on the in-memory state as the service does it.

use super::*;
use sandpit_core::api::prelude::*;

#[async_trait]
impl Accounts for Fake {
    async fn authenticate(&self, api_key: &str) -> Result<Caller> {
        ACCOUNTS
            .iter()
            .find(|(key, _, _)| *key == api_key)
            .map(|(_, id, _)| Caller::new((*id).to_owned(), "api key"))
            .ok_or_else(CoreError::unauthorized)
    }

    async fn usage(&self, caller: &Caller, days: Option<u32>) -> Result<Usage> {
        self.begin(caller, Op::Usage { days })?;
        let days = days.unwrap_or(30);
        if !(1..=366).contains(&days) {
            return Err(CoreError::invalid(format!(
                "days must be between 1 and 366, not {days}"
            )));
        }
        let st = self.state.lock().unwrap();
        // The clock stands still: nothing has run for a second yet.
        let sandboxes = st
            .sandboxes
            .iter()
            .filter(|h| h.account_id == caller.account_id)
            .map(|h| SandboxUsage {
                id: h.sandbox.id.clone(),
                size: h.sandbox.size.clone(),
                seconds: 0,
                cost_usd: 0.0,
                created_at: h.sandbox.created_at.clone(),
                deleted_at: h.sandbox.deleted_at.clone(),
                preview_bytes_in: 0,
                preview_bytes_out: 0,
                disk_used_bytes: 0,
            })
            .collect();
        Ok(Usage {
            object: "usage".into(),
            credit_remaining_usd: CREDIT_USD,
            period_days: days,
            total_cost_usd: 0.0,
            sandboxes,
            volumes: Vec::new(),
        })
    }

    async fn account(&self, caller: &Caller) -> Result<Account> {
        self.begin(caller, Op::Account)?;
        let (_, id, name) = ACCOUNTS
            .iter()
            .find(|(_, id, _)| *id == caller.account_id)
            .ok_or_else(CoreError::unauthorized)?;
        Ok(Account {
            object: "account".into(),
            id: (*id).to_owned(),
            name: (*name).to_owned(),
            credit_remaining_usd: CREDIT_USD,
            max_concurrent_sandboxes: self.config().default_max_concurrent_sandboxes,
            created_at: T0.into(),
            disk_used_bytes: 0,
        })
    }

    async fn service_info(&self) -> Result<ServiceInfo> {
        let config = self.config();
        Ok(ServiceInfo {
            name: "sandpit".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            commit: config.commit.clone(),
            sizes: config.sizes_cheapest_first(),
            default_size: config.default_size.clone(),
            default_timeout_minutes: config.default_timeout_minutes,
            max_timeout_minutes: config.max_timeout_minutes,
            max_lifetime_minutes: config.max_lifetime_minutes,
            max_concurrent_sandboxes: config.default_max_concurrent_sandboxes,
            acceleration: "tcg".into(),
            hosts: vec![config.host_name.clone()],
            authentication: "send the account's API key as `Authorization: Bearer <key>` or \
                             `x-api-key: <key>`; over stdio (`sandpit mcp`) no key is needed"
                .into(),
            guest: GuestInfo {
                os: "Debian GNU/Linux 12 (bookworm)".into(),
                kernel: "6.1.0".into(),
                user: "user (uid 1000), no sudo".into(),
                workdir: sandpit_protocol::WORKSPACE.into(),
            },
            fast_start: FastStartInfo {
                snapshots: true,
                warm_pool: vec![WarmPoolInfo {
                    size: config.default_size.clone(),
                    ready: 2,
                    target: 2,
                }],
            },
            // 30 s: the runtime's reply deadline.
            limits: Limits::of(&config, 30),
            capacity: None,
        })
    }
}

#[async_trait]
impl Sandboxes for Fake {
    async fn create_sandbox(
        &self,
        caller: &Caller,
        req: CreateSandbox,
        idempotency_key: Option<String>,
    ) -> Result<(Sandbox, bool)> {
        self.begin(
            caller,
            Op::CreateSandbox {
                req: Box::new(req.clone()),
                idempotency_key: idempotency_key.clone(),
            },
        )?;
        let config = self.config();
        let mut st = self.state.lock().unwrap();
        // Volumes: their paths checked and each one the caller's (the
        // fake's sandboxes mount nothing).
        for mount in &req.volumes {
            sandpit_core::service::check_mount_path(&mount.path)?;
            let known = st.volumes.iter().any(|(account, v)| {
                *account == caller.account_id && (v.id == mount.volume || v.name == mount.volume)
            });
            if !known {
                return Err(CoreError::new(
                    sandpit_core::error::ErrorType::NotFound,
                    format!("no volume {:?}", mount.volume),
                ));
            }
        }
        // A snapshot sets the size; another size is refused.
        let mut checked = req.clone();
        // The fake builds no templates: every name is unknown, as the
        // service says of one nobody built.
        if let Some(t) = &req.template {
            return Err(CoreError::not_found("template", t));
        }
        if let Some(snap) = &req.snapshot_id {
            let size = st.snapshot(caller, snap)?.snapshot.size.clone();
            match &req.size {
                Some(asked) if *asked != size => {
                    return Err(CoreError::invalid(format!(
                        "snapshot {snap} is of a {size} sandbox; leave size out or ask for {size}, not {asked}"
                    )))
                }
                _ => checked.size = Some(size),
            }
        }
        let (size, _, timeout) = check_create(&config, &checked, idempotency_key.as_deref())?;
        let asked = (
            size.clone(),
            req.name.clone(),
            timeout,
            req.snapshot_id.clone(),
        );
        if let Some(key) = &idempotency_key {
            let first = (caller.account_id.clone(), key.clone());
            if let Some((before, id)) = st.idempotency.get(&first).cloned() {
                if before != asked {
                    return Err(CoreError::conflict(
                        "this Idempotency-Key was already used with a different request body",
                    ));
                }
                return Ok((st.held(caller, &id)?.sandbox.clone(), true));
            }
        }
        let mut s = new_sandbox(&config, new_id("sbx_"), req.name, &size, timeout);
        s.metadata = req.metadata;
        s.internet_access = req.internet_access;
        s.access_token = Some(format!("token-of-{}", s.id));
        let held = match &req.snapshot_id {
            Some(snap) => Held::from_snapshot(
                &caller.account_id,
                s.clone(),
                st.ready_snapshot(caller, snap)?,
            ),
            None => Held::new(&caller.account_id, s.clone()),
        };
        st.sandboxes.push(held);
        let mut created = Detail::new();
        let mut started = Detail::new();
        match &req.snapshot_id {
            Some(snap) => {
                created.insert("snapshot_id".into(), snap.clone().into());
                started.insert("from".into(), "snapshot".into());
            }
            None => {
                started.insert("from".into(), "cold".into());
            }
        }
        let provisioning = Sandbox {
            status: SandboxStatus::Provisioning,
            ..s.clone()
        };
        st.record(caller, &provisioning, "sandbox.created", None, created);
        st.record(caller, &s, "sandbox.started", None, started);
        if let Some(key) = idempotency_key {
            st.idempotency
                .insert((caller.account_id.clone(), key), (asked, s.id.clone()));
        }
        Ok((s, false))
    }

    async fn get_sandbox(&self, caller: &Caller, id: &str) -> Result<Sandbox> {
        self.begin(caller, Op::GetSandbox { id: id.into() })?;
        Ok(self.state.lock().unwrap().held(caller, id)?.sandbox.clone())
    }

    async fn list_sandboxes(&self, caller: &Caller, q: ListSandboxes) -> Result<List<Sandbox>> {
        self.begin(caller, Op::ListSandboxes { query: q.clone() })?;
        let limit = page_limit(q.limit)?;
        let mut st = self.state.lock().unwrap();
        if let Some(c) = &q.starting_after {
            if st.held(caller, c).is_err() {
                return Err(unknown_cursor("sandbox", c));
            }
        }
        let newest_first = st
            .sandboxes
            .iter()
            .rev()
            .filter(|h| h.account_id == caller.account_id)
            .map(|h| &h.sandbox);
        let shown = |s: &Sandbox| q.include_deleted == Some(true) || s.status.is_live();
        let after = q.starting_after.as_deref();
        let (data, has_more) = page_of(newest_first, |s| &s.id, after, shown, limit);
        Ok(List::page(data, has_more, |s| s.id.clone()))
    }

    async fn extend_sandbox(
        &self,
        caller: &Caller,
        id: &str,
        additional_minutes: Option<u32>,
    ) -> Result<Sandbox> {
        self.begin(
            caller,
            Op::ExtendSandbox {
                id: id.into(),
                additional_minutes,
            },
        )?;
        let config = self.config();
        let add = extension_minutes(&config, additional_minutes)?;
        let mut st = self.state.lock().unwrap();
        let s = &mut st.held(caller, id)?.sandbox;
        let total = u64::from(s.timeout_minutes) + u64::from(add);
        if total > u64::from(config.max_lifetime_minutes) {
            return Err(CoreError::invalid(format!(
                "a sandbox may live at most {} minutes from creation; it has {} and asked for {add} more",
                config.max_lifetime_minutes, s.timeout_minutes
            )));
        }
        if !s.status.is_live() {
            return Err(CoreError::conflict(format!(
                "sandbox {id} is {}; only a running sandbox can be extended",
                s.status.as_str()
            )));
        }
        s.timeout_minutes = total as u32;
        s.expires_at = expiry(s.timeout_minutes);
        Ok(s.clone())
    }

    /// The lists as given (the fake checks nothing of them).
    async fn update_network(
        &self,
        caller: &Caller,
        id: &str,
        lists: NetworkLists,
        internet_access: Option<bool>,
    ) -> Result<Sandbox> {
        self.begin(
            caller,
            Op::UpdateNetwork {
                id: id.into(),
                lists: lists.clone(),
                internet_access,
            },
        )?;
        let mut st = self.state.lock().unwrap();
        let s = &mut st.held(caller, id)?.sandbox;
        if !s.status.is_live() {
            return Err(CoreError::conflict(format!(
                "sandbox {id} is {}; create a new one",
                s.status.as_str()
            )));
        }
        s.internet_access = internet_access;
        s.network = Some(lists).filter(|l| !l.allow_out.is_empty() || !l.deny_out.is_empty());
        Ok(s.clone())
    }

    async fn destroy_sandbox(&self, caller: &Caller, id: &str) -> Result<Sandbox> {
        self.begin(caller, Op::DestroySandbox { id: id.into() })?;
        let mut st = self.state.lock().unwrap();
        let s = &mut st.held(caller, id)?.sandbox;
        if !s.status.is_live() {
            return Ok(s.clone());
        }
        s.status = SandboxStatus::Deleting;
        let deleting = s.clone();
        s.status = SandboxStatus::Deleted;
        s.deleted_at = Some(T0.into());
        s.deleted_reason = Some("destroyed".into());
        let s = s.clone();
        let none = Detail::new;
        st.record(caller, &deleting, "sandbox.destroying", None, none());
        st.record(caller, &s, "sandbox.killed", Some("destroyed"), none());
        Ok(s)
    }

    async fn pause_sandbox(&self, caller: &Caller, id: &str) -> Result<Sandbox> {
        self.begin(caller, Op::PauseSandbox { id: id.into() })?;
        let mut st = self.state.lock().unwrap();
        let h = st.held(caller, id)?;
        if h.sandbox.status != SandboxStatus::Paused {
            let h = st.running(caller, id)?;
            h.sandbox.status = SandboxStatus::Paused;
            let paused = h.sandbox.clone();
            st.record(caller, &paused, "sandbox.paused", None, Detail::new());
        }
        Ok(st.held(caller, id)?.sandbox.clone())
    }

    async fn resume_sandbox(&self, caller: &Caller, id: &str) -> Result<Sandbox> {
        self.begin(caller, Op::ResumeSandbox { id: id.into() })?;
        let mut st = self.state.lock().unwrap();
        Ok(st.running(caller, id)?.sandbox.clone())
    }

    async fn sandbox_metrics(&self, caller: &Caller, id: &str) -> Result<Vec<SandboxMetric>> {
        self.begin(caller, Op::SandboxMetrics { id: id.into() })?;
        let sandbox = self.state.lock().unwrap().held(caller, id)?.sandbox.clone();
        if sandbox.status != SandboxStatus::Running {
            // A paused sandbox is not woken to be read; an ended one has
            // nothing to read.
            return match sandbox.status {
                SandboxStatus::Paused => Ok(Vec::new()),
                _ => Err(CoreError::conflict(format!("sandbox {id} is not running"))),
            };
        }
        {
            let _reading = self.reading();
            tokio::time::sleep(crate::READING_TAKES).await;
        }
        let spec = self.config().sizes[&sandbox.size].clone();
        Ok(vec![SandboxMetric {
            at_unix_ms: (OffsetDateTime::now_utc().unix_timestamp_nanos() / 1_000_000) as i64,
            cpu_count: spec.vcpus,
            cpu_used_pct: 1.0,
            mem_used_bytes: 64 << 20,
            mem_total_bytes: u64::from(spec.memory_mb) << 20,
            mem_cache_bytes: 16 << 20,
            disk_used_bytes: 1 << 30,
            disk_total_bytes: u64::from(spec.disk_gb) << 30,
        }])
    }
}

#[async_trait]
impl Snapshots for Fake {
    async fn snapshot_sandbox(
        &self,
        caller: &Caller,
        id: &str,
        req: CreateSnapshot,
        idempotency_key: Option<String>,
    ) -> Result<(Snapshot, bool)> {
        self.begin(
            caller,
            Op::SnapshotSandbox {
                id: id.into(),
                req: req.clone(),
                idempotency_key: idempotency_key.clone(),
            },
        )?;
        check_snapshot_name(req.name.as_deref())?;
        let config = self.config();
        let mut st = self.state.lock().unwrap();
        let asked = (id.to_owned(), req.name.clone());
        if let Some(key) = &idempotency_key {
            if key.is_empty() || key.len() > 255 {
                return Err(CoreError::invalid(
                    "Idempotency-Key must be 1 to 255 characters",
                ));
            }
            let first = (caller.account_id.clone(), key.clone());
            if let Some((before, snap)) = st.snapshot_keys.get(&first).cloned() {
                if before != asked {
                    return Err(CoreError::conflict(
                        "this Idempotency-Key was already used with a different request",
                    ));
                }
                return Ok((st.snapshot(caller, &snap)?.snapshot.clone(), true));
            }
        }
        let snap = st.take_snapshot(caller, id, req.name, config.snapshot_retention_days)?;
        if let Some(key) = idempotency_key {
            st.snapshot_keys
                .insert((caller.account_id.clone(), key), (asked, snap.id.clone()));
        }
        Ok((snap, false))
    }

    async fn get_snapshot(&self, caller: &Caller, snapshot_id: &str) -> Result<Snapshot> {
        self.begin(
            caller,
            Op::GetSnapshot {
                id: snapshot_id.into(),
            },
        )?;
        let mut st = self.state.lock().unwrap();
        Ok(st.snapshot(caller, snapshot_id)?.snapshot.clone())
    }

    async fn list_snapshots(&self, caller: &Caller, q: ListSnapshots) -> Result<List<Snapshot>> {
        self.begin(caller, Op::ListSnapshots { query: q.clone() })?;
        let limit = page_limit(q.limit)?;
        let mut st = self.state.lock().unwrap();
        if let Some(c) = &q.starting_after {
            if st.snapshot(caller, c).is_err() {
                return Err(unknown_cursor("snapshot", c));
            }
        }
        let newest_first = st
            .snapshots
            .iter()
            .rev()
            .filter(|h| h.account_id == caller.account_id)
            .map(|h| &h.snapshot);
        let shown = |s: &Snapshot| s.status != "deleted";
        let after = q.starting_after.as_deref();
        let (data, has_more) = page_of(newest_first, |s| &s.id, after, shown, limit);
        Ok(List::page(data, has_more, |s| s.id.clone()))
    }

    async fn delete_snapshot(&self, caller: &Caller, snapshot_id: &str) -> Result<Snapshot> {
        self.begin(
            caller,
            Op::DeleteSnapshot {
                id: snapshot_id.into(),
            },
        )?;
        let mut st = self.state.lock().unwrap();
        let h = st.snapshot(caller, snapshot_id)?;
        h.snapshot.status = "deleted".into();
        h.files.clear();
        h.dirs.clear();
        Ok(h.snapshot.clone())
    }

    async fn fork_sandbox(&self, caller: &Caller, id: &str, req: ForkSandbox) -> Result<Fork> {
        self.begin(
            caller,
            Op::ForkSandbox {
                id: id.into(),
                req: req.clone(),
            },
        )?;
        let count = req.count.unwrap_or(1);
        if !(1..=MAX_FORKS).contains(&count) {
            return Err(CoreError::invalid(format!(
                "count must be between 1 and {MAX_FORKS}, not {count}"
            )));
        }
        let config = self.config();
        let mut st = self.state.lock().unwrap();
        let size = st.running(caller, id)?.sandbox.size.clone();
        let each = CreateSandbox {
            size: Some(size.clone()),
            timeout_minutes: req.timeout_minutes,
            ..Default::default()
        };
        let (_, _, timeout) = check_create(&config, &each, None)?;
        let snapshot = st.take_snapshot(caller, id, None, config.snapshot_retention_days)?;
        let mut sandboxes = Vec::new();
        for _ in 0..count {
            let s = new_sandbox(&config, new_id("sbx_"), None, &size, timeout);
            let from = st.ready_snapshot(caller, &snapshot.id)?;
            let held = Held::from_snapshot(&caller.account_id, s.clone(), from);
            st.sandboxes.push(held);
            sandboxes.push(s);
        }
        Ok(Fork {
            snapshot,
            sandboxes,
        })
    }

    async fn restore_sandbox(
        &self,
        caller: &Caller,
        id: &str,
        req: RestoreSandbox,
    ) -> Result<Sandbox> {
        self.begin(
            caller,
            Op::RestoreSandbox {
                id: id.into(),
                req: req.clone(),
            },
        )?;
        let mut st = self.state.lock().unwrap();
        st.running(caller, id)?;
        let lineage = st.lineage(caller, id);
        let snap = st.ready_snapshot(caller, &req.snapshot_id)?;
        if !lineage.contains(&snap.snapshot.sandbox_id) {
            return Err(CoreError::invalid(format!(
                "snapshot {} is of sandbox {}, which {id} was not started from; \
                 create a new sandbox from it instead",
                snap.snapshot.id, snap.snapshot.sandbox_id
            )));
        }
        let (files, dirs, size) = (
            snap.files.clone(),
            snap.dirs.clone(),
            snap.snapshot.size.clone(),
        );
        let h = st.running(caller, id)?;
        if h.sandbox.size != size {
            return Err(CoreError::invalid(format!(
                "snapshot {} is of a {size} sandbox and {id} is {}; restore needs the same size",
                req.snapshot_id, h.sandbox.size
            )));
        }
        h.files = files;
        h.dirs = dirs;
        Ok(h.sandbox.clone())
    }
}

#[async_trait]
impl Commands for Fake {
    async fn exec(&self, caller: &Caller, id: &str, params: ExecParams) -> Result<Execution> {
        self.begin(
            caller,
            Op::Exec {
                id: id.into(),
                params: params.clone(),
            },
        )?;
        // Dropping this call drops the stream, which cancels the command.
        let mut stream = self.start(caller, id, &params)?;
        loop {
            match stream.next().await {
                Some(ExecEvent::Started(_) | ExecEvent::Stdout(_) | ExecEvent::Stderr(_)) => {}
                Some(ExecEvent::Exit(exec)) => return Ok(exec),
                Some(ExecEvent::Error(e)) => return Err(e),
                None => {
                    return Err(CoreError::internal(
                        "the command's output ended without an exit",
                    ))
                }
            }
        }
    }

    async fn exec_stream(
        &self,
        caller: &Caller,
        id: &str,
        params: ExecParams,
    ) -> Result<ExecStream> {
        self.begin(
            caller,
            Op::ExecStream {
                id: id.into(),
                params: params.clone(),
            },
        )?;
        self.start(caller, id, &params)
    }

    async fn list_executions(
        &self,
        caller: &Caller,
        id: &str,
        q: ListExecutions,
    ) -> Result<List<Execution>> {
        self.begin(
            caller,
            Op::ListExecutions {
                id: id.into(),
                query: q.clone(),
            },
        )?;
        let limit = page_limit(q.limit)?;
        let mut st = self.state.lock().unwrap();
        st.held(caller, id)?;
        let of_sandbox = |x: &Execution| x.sandbox_id == id;
        if let Some(c) = &q.starting_after {
            if !st.executions.get(c).is_some_and(|(_, x)| of_sandbox(x)) {
                return Err(unknown_cursor("execution", c));
            }
        }
        let st = &*st;
        let newest_first = st
            .started
            .iter()
            .rev()
            .filter_map(|x| st.executions.get(x))
            .map(|(_, x)| x);
        let after = q.starting_after.as_deref();
        let (data, has_more) = page_of(newest_first, |x| &x.id, after, of_sandbox, limit);
        Ok(List::page(data, has_more, |x| x.id.clone()))
    }

    async fn get_execution(&self, caller: &Caller, exec_id: &str) -> Result<Execution> {
        self.begin(caller, Op::GetExecution { id: exec_id.into() })?;
        match self.state.lock().unwrap().executions.get(exec_id) {
            Some((account, e)) if *account == caller.account_id => Ok(e.clone()),
            _ => Err(CoreError::not_found("execution", exec_id)),
        }
    }
}

#[async_trait]
impl Files for Fake {
    async fn write_file(&self, caller: &Caller, id: &str, req: WriteFile) -> Result<FileWritten> {
        self.begin(
            caller,
            Op::WriteFile {
                id: id.into(),
                path: req.path.clone(),
                encoding: req.encoding,
            },
        )?;
        let (path, bytes) = write_content(&self.config(), req)?;
        let path = resolve(&path)?;
        let mut st = self.state.lock().unwrap();
        let h = st.running(caller, id)?;
        if h.dirs.contains(&path) {
            return Err(is_a_directory(&path));
        }
        // Its directories are made as needed (mkdir -p), through no file.
        let mut dirs = Vec::new();
        let mut at = path.as_str();
        while let Some((parent, _)) = at.rsplit_once('/') {
            let parent = if parent.is_empty() { "/" } else { parent };
            if h.files.contains_key(parent) {
                return Err(CoreError::invalid(format!(
                    "{parent}: a path component is not a directory"
                )));
            }
            dirs.push(parent.to_owned());
            if parent == "/" {
                break;
            }
            at = parent;
        }
        h.dirs.extend(dirs);
        let n = bytes.len() as u64;
        h.files.insert(path.clone(), bytes);
        Ok(FileWritten { path, bytes: n })
    }

    async fn read_file(
        &self,
        caller: &Caller,
        id: &str,
        path: &str,
        encoding: Encoding,
    ) -> Result<FileContent> {
        self.begin(
            caller,
            Op::ReadFile {
                id: id.into(),
                path: path.into(),
                encoding,
            },
        )?;
        let path = resolve(path)?;
        let mut st = self.state.lock().unwrap();
        let h = st.running(caller, id)?;
        let Some(bytes) = h.files.get(&path) else {
            return Err(match h.dirs.contains(&path) {
                true => is_a_directory(&path),
                false => no_such_file(&path),
            });
        };
        let content = match encoding {
            Encoding::Utf8 => String::from_utf8(bytes.clone()).map_err(|_| {
                CoreError::invalid(format!(
                    "{path} is not valid UTF-8 text; read it with encoding \"base64\""
                ))
            })?,
            Encoding::Base64 => base64::engine::general_purpose::STANDARD.encode(bytes),
        };
        Ok(FileContent {
            bytes: bytes.len() as u64,
            path,
            content,
            encoding,
        })
    }

    async fn list_files(
        &self,
        caller: &Caller,
        id: &str,
        path: Option<&str>,
        recursive: bool,
    ) -> Result<FileList> {
        self.begin(
            caller,
            Op::ListFiles {
                id: id.into(),
                path: path.map(Into::into),
                recursive,
            },
        )?;
        let path = resolve(path.unwrap_or(sandpit_protocol::WORKSPACE))?;
        let mut st = self.state.lock().unwrap();
        let h = st.running(caller, id)?;
        let entries = if h.dirs.contains(&path) {
            h.entries(&path, recursive)
        } else if let Some(bytes) = h.files.get(&path) {
            // A file is listed as itself.
            vec![FileEntry {
                name: path.rsplit('/').next().unwrap_or_default().to_owned(),
                kind: EntryType::File,
                size_bytes: bytes.len() as u64,
            }]
        } else {
            return Err(no_such_file(&path));
        };
        Ok(FileList {
            path,
            entries,
            truncated: false,
        })
    }

    async fn delete_file(
        &self,
        caller: &Caller,
        id: &str,
        path: &str,
        recursive: bool,
    ) -> Result<FileDeleted> {
        self.begin(
            caller,
            Op::DeleteFile {
                id: id.into(),
                path: path.into(),
                recursive,
            },
        )?;
        let path = resolve(path)?;
        let mut st = self.state.lock().unwrap();
        let h = st.running(caller, id)?;
        if path == "/" {
            return Err(CoreError::invalid("refusing to delete /"));
        }
        if h.files.remove(&path).is_none() {
            if !h.dirs.contains(&path) {
                return Err(no_such_file(&path));
            }
            if !recursive && !h.entries(&path, false).is_empty() {
                return Err(CoreError::invalid("directory not empty; pass recursive"));
            }
            let inside = format!("{path}/");
            h.dirs.retain(|d| *d != path && !d.starts_with(&inside));
            h.files.retain(|f, _| !f.starts_with(&inside));
        }
        Ok(FileDeleted {
            path,
            deleted: true,
        })
    }
}

#[async_trait]
impl Ports for Fake {
    /// Private or not as asked (no signed URL: the fake has no token).
    async fn expose_port(
        &self,
        caller: &Caller,
        id: &str,
        port: u16,
        private: bool,
    ) -> Result<Port> {
        self.begin(
            caller,
            Op::ExposePort {
                id: id.into(),
                port,
                private,
            },
        )?;
        check_port(port)?;
        let config = self.config();
        let mut st = self.state.lock().unwrap();
        let h = st.running(caller, id)?;
        if let Some(p) = h.ports.iter_mut().find(|p| p.port == port) {
            p.private = private;
            return Ok(p.clone());
        }
        let p = Port {
            port,
            url: sandpit_core::preview::preview_url(
                &config.preview_scheme,
                &config.preview_domain,
                port,
                id,
            ),
            created_at: T0.into(),
            private,
            signed_url: None,
            signed_url_expires_at: None,
        };
        h.ports.push(p.clone());
        Ok(p)
    }

    async fn list_ports(&self, caller: &Caller, id: &str) -> Result<List<Port>> {
        self.begin(caller, Op::ListPorts { id: id.into() })?;
        let mut st = self.state.lock().unwrap();
        Ok(List::new(st.held(caller, id)?.ports.clone(), false, None))
    }

    async fn close_port(&self, caller: &Caller, id: &str, port: u16) -> Result<()> {
        self.begin(
            caller,
            Op::ClosePort {
                id: id.into(),
                port,
            },
        )?;
        let mut st = self.state.lock().unwrap();
        let ports = &mut st.held(caller, id)?.ports;
        let before = ports.len();
        ports.retain(|p| p.port != port);
        if ports.len() == before {
            return Err(CoreError::not_found("exposed port", &port.to_string()));
        }
        Ok(())
    }
}

/// A page of `newest_first`: the items after the one named `after` (all of
/// them without one, whether that one is `shown` or not) that are `shown`,
/// at most `limit`, and whether more follow.
fn page_of<'a, T: Clone + 'a>(
    mut newest_first: impl Iterator<Item = &'a T>,
    id: impl Fn(&T) -> &str,
    after: Option<&str>,
    shown: impl Fn(&T) -> bool,
    limit: u32,
) -> (Vec<T>, bool) {
    if let Some(after) = after {
        newest_first.by_ref().find(|t| id(t) == after);
    }
    let mut data: Vec<T> = newest_first
        .filter(|t| shown(t))
        .take(limit as usize + 1)
        .cloned()
        .collect();
    let has_more = data.len() > limit as usize;
    data.truncate(limit as usize);
    (data, has_more)
}

/// Terminals are a server's own: the fake answers as any backend without them.
#[async_trait]
impl Terminals for Fake {}

/// Secrets are a server's own (sealed under its key): the fake answers as
/// any backend without them.
#[async_trait]
impl Secrets for Fake {}

/// Volumes as the service keeps them, without their files: the same
/// checks (name, size, one name per account), made `ready` at once,
/// mounted by no sandbox (a create names them, the fake mounts none, as the
/// service's are until mounting is wired).
#[async_trait]
impl Volumes for Fake {
    async fn create_volume(
        &self,
        caller: &Caller,
        req: CreateVolume,
        idempotency_key: Option<String>,
    ) -> Result<(Volume, bool)> {
        let op = Op::CreateVolume {
            req: req.clone(),
            idempotency_key: idempotency_key.clone(),
        };
        self.begin(caller, op)?;
        sandpit_core::service::check_volume_name(&req.name)?;
        let limits = self.config().volumes;
        let size_gb = req.size_gb.unwrap_or(limits.default_size_gb);
        if size_gb == 0 || size_gb > limits.max_size_gb {
            return Err(CoreError::invalid(format!(
                "size_gb must be between 1 and {}, not {size_gb}",
                limits.max_size_gb
            )));
        }
        let mut st = self.state.lock().unwrap();
        let keyed = idempotency_key.map(|k| (caller.account_id.clone(), k));
        if let Some((asked, made)) = keyed.as_ref().and_then(|k| st.volume_keys.get(k)) {
            if *asked != (req.name.clone(), size_gb) {
                return Err(CoreError::conflict(
                    "this Idempotency-Key was already used with a different request body",
                ));
            }
            // As it is now: gone since, it is shown deleted.
            let now = st.volumes.iter().find(|(_, v)| v.id == made.id);
            let volume = match now {
                Some((_, v)) => v.clone(),
                None => Volume {
                    status: "deleted".into(),
                    ..made.clone()
                },
            };
            return Ok((volume, true));
        }
        let theirs = |(a, _): &&(String, Volume)| *a == caller.account_id;
        if st
            .volumes
            .iter()
            .filter(theirs)
            .any(|(_, v)| v.name == req.name)
        {
            return Err(CoreError::conflict(format!(
                "the account has a volume named {:?} already",
                req.name
            )));
        }
        let volume = Volume {
            object: "volume".into(),
            id: new_id("vol_"),
            name: req.name,
            size_gb,
            status: "ready".into(),
            created_at: T0.into(),
            mounted_by: Vec::new(),
        };
        st.volumes.push((caller.account_id.clone(), volume.clone()));
        if let Some(key) = keyed {
            let asked = (volume.name.clone(), size_gb);
            st.volume_keys.insert(key, (asked, volume.clone()));
        }
        Ok((volume, false))
    }

    async fn list_volumes(&self, caller: &Caller) -> Result<List<Volume>> {
        self.begin(caller, Op::ListVolumes)?;
        let st = self.state.lock().unwrap();
        let mut data: Vec<Volume> = st
            .volumes
            .iter()
            .filter(|(a, _)| *a == caller.account_id)
            .map(|(_, v)| v.clone())
            .collect();
        data.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(List::new(data, false, None))
    }

    async fn get_volume(&self, caller: &Caller, volume: &str) -> Result<Volume> {
        let op = Op::GetVolume {
            volume: volume.into(),
        };
        self.begin(caller, op)?;
        let st = self.state.lock().unwrap();
        Ok(st.volumes[volume_at(&st, caller, volume)?].1.clone())
    }

    async fn resize_volume(
        &self,
        caller: &Caller,
        volume: &str,
        req: ResizeVolume,
    ) -> Result<Volume> {
        let op = Op::ResizeVolume {
            volume: volume.into(),
            size_gb: req.size_gb,
        };
        self.begin(caller, op)?;
        let max = self.config().volumes.max_size_gb;
        let mut st = self.state.lock().unwrap();
        let at = volume_at(&st, caller, volume)?;
        let v = &mut st.volumes[at].1;
        if req.size_gb > max {
            return Err(CoreError::invalid(format!(
                "size_gb must be between 1 and {max}, not {}",
                req.size_gb
            )));
        }
        if req.size_gb <= v.size_gb {
            return Err(CoreError::invalid(format!(
                "volume {:?} is {} GiB: a volume only grows (size_gb above {})",
                v.name, v.size_gb, v.size_gb
            )));
        }
        v.size_gb = req.size_gb;
        Ok(v.clone())
    }

    async fn delete_volume(&self, caller: &Caller, volume: &str) -> Result<Volume> {
        let op = Op::DeleteVolume {
            volume: volume.into(),
        };
        self.begin(caller, op)?;
        let mut st = self.state.lock().unwrap();
        let at = volume_at(&st, caller, volume)?;
        let (_, mut gone) = st.volumes.remove(at);
        gone.status = "deleted".into();
        Ok(gone)
    }
}

/// Where the caller's volume of id or name `volume` is in `st.volumes`.
fn volume_at(st: &State, caller: &Caller, volume: &str) -> Result<usize> {
    st.volumes
        .iter()
        .position(|(a, v)| *a == caller.account_id && (v.id == volume || v.name == volume))
        .ok_or_else(|| CoreError::new(ErrorType::NotFound, format!("no volume {volume:?}")))
}

/// The fake builds no templates: it has none to list.
#[async_trait]
impl Templates for Fake {
    async fn list_templates(&self, _caller: &Caller) -> Result<List<Template>> {
        Ok(List::new(Vec::new(), false, None))
    }
}

/// The events the fake wrote (see the crate's documentation), and
/// webhooks kept and checked as the service keeps them, to which nothing
/// is ever delivered.
#[async_trait]
impl Events for Fake {
    async fn list_events(&self, caller: &Caller, q: ListEvents) -> Result<List<Event>> {
        self.begin(caller, Op::ListEvents { query: q.clone() })?;
        let limit = q.limit.unwrap_or(DEFAULT_EVENTS);
        if !(1..=MAX_EVENTS).contains(&limit) {
            return Err(CoreError::invalid(format!(
                "limit must be between 1 and {MAX_EVENTS}, not {limit}"
            )));
        }
        let from = match q.after.as_deref().map(str::trim) {
            None | Some("") => 0,
            Some(c) => c.parse::<usize>().map_err(|_| {
                CoreError::invalid(format!(
                    "after {c:?} is not a cursor (an event's `cursor`, or a list's `next_cursor`)"
                ))
            })?,
        };
        let mut st = self.state.lock().unwrap();
        if let Some(id) = &q.sandbox_id {
            st.held(caller, id)?;
        }
        let theirs = |(a, e): &&(String, Event)| {
            *a == caller.account_id && q.sandbox_id.as_ref().is_none_or(|id| e.sandbox_id == *id)
        };
        let mut data: Vec<Event> = st.events[from.min(st.events.len())..]
            .iter()
            .filter(theirs)
            .take(limit as usize + 1)
            .map(|(_, e)| e.clone())
            .collect();
        let has_more = data.len() > limit as usize;
        data.truncate(limit as usize);
        let next = data
            .last()
            .map(|e| e.cursor.clone())
            .unwrap_or_else(|| from.to_string());
        Ok(List::new(data, has_more, Some(next)))
    }

    async fn create_webhook(&self, caller: &Caller, req: CreateWebhook) -> Result<Webhook> {
        self.begin(caller, Op::CreateWebhook { req: req.clone() })?;
        let events = webhook_events(&req)?;
        let secret = base64::engine::general_purpose::STANDARD.encode(rand::random::<[u8; 32]>());
        let webhook = Webhook {
            object: "webhook".into(),
            id: new_id("wh_"),
            url: req.url,
            events,
            description: req.description,
            secret: None,
            created_at: T0.into(),
            pending: 0,
            delivered: 0,
            failed: 0,
        };
        let mut st = self.state.lock().unwrap();
        st.webhooks
            .push((caller.account_id.clone(), webhook.clone()));
        Ok(Webhook {
            secret: Some(format!("whsec_{secret}")),
            ..webhook
        })
    }

    async fn list_webhooks(&self, caller: &Caller) -> Result<List<Webhook>> {
        self.begin(caller, Op::ListWebhooks)?;
        let st = self.state.lock().unwrap();
        let data = st
            .webhooks
            .iter()
            .filter(|(a, _)| *a == caller.account_id)
            .map(|(_, w)| w.clone())
            .collect();
        Ok(List::new(data, false, None))
    }

    async fn get_webhook(&self, caller: &Caller, id: &str) -> Result<Webhook> {
        self.begin(caller, Op::GetWebhook { id: id.into() })?;
        let st = self.state.lock().unwrap();
        Ok(st.webhooks[webhook_at(&st, caller, id)?].1.clone())
    }

    async fn delete_webhook(&self, caller: &Caller, id: &str) -> Result<Webhook> {
        self.begin(caller, Op::DeleteWebhook { id: id.into() })?;
        let mut st = self.state.lock().unwrap();
        let at = webhook_at(&st, caller, id)?;
        Ok(st.webhooks.remove(at).1)
    }

    async fn list_deliveries(
        &self,
        caller: &Caller,
        webhook_id: &str,
        q: ListDeliveries,
    ) -> Result<List<WebhookDelivery>> {
        let op = Op::ListDeliveries {
            webhook_id: webhook_id.into(),
            query: q.clone(),
        };
        self.begin(caller, op)?;
        page_limit(q.limit)?;
        let st = self.state.lock().unwrap();
        webhook_at(&st, caller, webhook_id)?;
        // A delivery's id is its event's; nothing is delivered here, so
        // nothing is older than one.
        let starting_after = q.starting_after.as_deref();
        if let Some(c) = starting_after.filter(|c| !c.starts_with("evt_")) {
            return Err(unknown_cursor("delivery", c));
        }
        Ok(List::new(Vec::new(), false, None))
    }

    async fn redeliver(
        &self,
        caller: &Caller,
        webhook_id: &str,
        delivery_id: &str,
    ) -> Result<WebhookDelivery> {
        let op = Op::Redeliver {
            webhook_id: webhook_id.into(),
            delivery_id: delivery_id.into(),
        };
        self.begin(caller, op)?;
        let st = self.state.lock().unwrap();
        webhook_at(&st, caller, webhook_id)?;
        Err(CoreError::not_found("delivery", delivery_id))
    }
}

/// `list_events`' default and largest page.
const DEFAULT_EVENTS: u32 = 100;
const MAX_EVENTS: u32 = 500;

/// The event types a new webhook gets, checked as the service checks them
/// (its URL http or https with a host and no credentials, each type one
/// of [`EVENT_TYPES`], a description of at most 500 bytes); none, or `*`
/// among them, is `["*"]`.
fn webhook_events(req: &CreateWebhook) -> Result<Vec<String>> {
    let url = req.url.trim();
    let lower = url.to_ascii_lowercase();
    let Some((scheme, rest)) = lower.split_once("://") else {
        return Err(CoreError::invalid(format!("url {url:?} is not a URL")));
    };
    if !matches!(scheme, "http" | "https") {
        return Err(CoreError::invalid(format!(
            "url {url:?}: a webhook is http:// or https://, not {scheme}://"
        )));
    }
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    if authority.contains('@') {
        return Err(CoreError::invalid(format!(
            "url {url:?} carries credentials; a webhook's deliveries are signed instead"
        )));
    }
    if authority.split(':').next().unwrap_or_default().is_empty() {
        return Err(CoreError::invalid(format!("url {url:?} names no host")));
    }
    if url.len() > 2048 {
        return Err(CoreError::invalid("url is longer than 2048 bytes"));
    }
    let mut events: Vec<String> = Vec::new();
    for kind in req.events.iter().map(|e| e.trim()) {
        if kind != "*" && !EVENT_TYPES.contains(&kind) {
            return Err(CoreError::invalid(format!(
                "event type {kind:?} is not one of {} (or \"*\")",
                EVENT_TYPES.join(", ")
            )));
        }
        if !events.iter().any(|e| e == kind) {
            events.push(kind.to_owned());
        }
    }
    if req.description.as_ref().is_some_and(|d| d.len() > 500) {
        return Err(CoreError::invalid("description is longer than 500 bytes"));
    }
    if events.is_empty() || events.iter().any(|e| e == "*") {
        events = vec!["*".into()];
    }
    Ok(events)
}

/// Where the caller's webhook `id` is in `st.webhooks`.
fn webhook_at(st: &State, caller: &Caller, id: &str) -> Result<usize> {
    st.webhooks
        .iter()
        .position(|(a, w)| *a == caller.account_id && w.id == id)
        .ok_or_else(|| CoreError::not_found("webhook", id))
}
