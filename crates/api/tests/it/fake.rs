//! A small in-memory `SandboxApi` for adapter tests. It decides nothing
//! interesting; it exists so every route and every error path can be driven
//! over real HTTP and the answers compared with what the trait returned.

use async_trait::async_trait;
use sandpit_core::error::Result;
use sandpit_core::*;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::{mpsc, oneshot, Notify};

pub const KEY_A: &str = "sk_test_a";
pub const KEY_B: &str = "sk_test_b";
pub const T0: &str = "2026-01-01T00:00:00Z";

#[derive(Default)]
struct State {
    next: u64,
    /// (account, sandbox)
    sandboxes: Vec<(String, Sandbox)>,
    /// (account, key) -> (request, sandbox id)
    idem: HashMap<(String, String), (CreateSandbox, String)>,
    execs: HashMap<String, (String, Execution)>,
    files: BTreeMap<(String, String), Vec<u8>>,
    ports: HashMap<String, Vec<Port>>,
}

/// What the fake's streaming tasks observed.
#[derive(Default)]
pub struct Recorder {
    /// Streams whose ExecStream was dropped (or cancelled) before the end.
    pub cancelled: AtomicUsize,
    pub cancel_seen: Notify,
}

impl Recorder {
    /// Wait until `n` streams were cancelled, or fail after `secs`.
    pub async fn wait_cancelled(&self, n: usize, secs: u64) {
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(secs);
        while self.cancelled.load(Ordering::SeqCst) < n {
            let notified = self.cancel_seen.notified();
            if self.cancelled.load(Ordering::SeqCst) >= n {
                break;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                panic!(
                    "only {} of {n} streams were cancelled within {secs} s",
                    self.cancelled.load(Ordering::SeqCst)
                );
            }
        }
    }
}

#[derive(Default)]
pub struct Fake {
    state: Mutex<State>,
    pub rec: Arc<Recorder>,
    /// What the last exec received (to check the adapter passes it through).
    pub last_exec: Mutex<Option<ExecParams>>,
    pub last_idempotency_key: Mutex<Option<Option<String>>>,
}

pub fn sandbox(id: &str, name: Option<String>, size: &str, timeout: u32) -> Sandbox {
    Sandbox {
        id: id.into(),
        object: "sandbox".into(),
        name,
        status: SandboxStatus::Running,
        size: size.into(),
        resources: Resources {
            vcpus: 2,
            memory_mb: 4096,
            disk_gb: 40,
        },
        timeout_minutes: timeout,
        created_at: T0.into(),
        ready_at: Some(T0.into()),
        expires_at: "2026-01-01T00:15:00Z".into(),
        deleted_at: None,
        deleted_reason: None,
        disk_used_bytes: 0,
    }
}

pub fn execution(id: &str, sandbox_id: &str, stdout: &str, stderr: &str) -> Execution {
    Execution {
        id: id.into(),
        object: "execution".into(),
        sandbox_id: sandbox_id.into(),
        status: ExecutionStatus::Completed,
        exit_code: Some(0),
        stdout: stdout.into(),
        stderr: stderr.into(),
        truncated: false,
        duration_ms: 3,
        started_at: T0.into(),
        finished_at: Some(T0.into()),
    }
}

impl Fake {
    pub fn new() -> Arc<Self> {
        Arc::new(Fake::default())
    }

    fn id(&self, prefix: &str) -> String {
        let mut st = self.state.lock().unwrap();
        st.next += 1;
        format!("{prefix}_{:024x}", st.next * 7919)
    }

    fn owned(&self, caller: &Caller, id: &str) -> Result<Sandbox> {
        let st = self.state.lock().unwrap();
        st.sandboxes
            .iter()
            .find(|(a, s)| a == &caller.account_id && s.id == id)
            .map(|(_, s)| s.clone())
            .ok_or_else(|| CoreError::not_found("sandbox", id))
    }

    fn update(&self, caller: &Caller, id: &str, f: impl FnOnce(&mut Sandbox)) -> Result<Sandbox> {
        let mut st = self.state.lock().unwrap();
        let s = st
            .sandboxes
            .iter_mut()
            .find(|(a, s)| a == &caller.account_id && s.id == id)
            .map(|(_, s)| s)
            .ok_or_else(|| CoreError::not_found("sandbox", id))?;
        f(s);
        Ok(s.clone())
    }

    fn record_exec(&self, caller: &Caller, e: &Execution) {
        self.state
            .lock()
            .unwrap()
            .execs
            .insert(e.id.clone(), (caller.account_id.clone(), e.clone()));
    }
}

fn resolve(path: &str) -> String {
    if path.starts_with('/') {
        path.to_owned()
    } else {
        format!("/workspace/{path}")
    }
}

#[async_trait]
impl SandboxApi for Fake {
    async fn authenticate(&self, api_key: &str) -> Result<Caller> {
        match api_key {
            KEY_A => Ok(Caller {
                account_id: "acct_a".into(),
            }),
            KEY_B => Ok(Caller {
                account_id: "acct_b".into(),
            }),
            _ => Err(CoreError::unauthorized()),
        }
    }

    async fn create_sandbox(
        &self,
        caller: &Caller,
        req: CreateSandbox,
        idempotency_key: Option<String>,
    ) -> Result<(Sandbox, bool)> {
        *self.last_idempotency_key.lock().unwrap() = Some(idempotency_key.clone());
        match req.name.as_deref() {
            Some("too-many") => {
                return Err(
                    CoreError::new(ErrorType::RateLimited, "20 live sandboxes").with_retry_after(7)
                )
            }
            Some("no-capacity") => {
                return Err(CoreError::new(ErrorType::ServiceUnavailable, "host full"))
            }
            Some("poor") => {
                return Err(CoreError::new(
                    ErrorType::InsufficientCredits,
                    "credit $0.00",
                ))
            }
            Some("panic") => panic!("the fake panics on purpose"),
            _ => {}
        }
        let size = req.size.clone().unwrap_or_else(|| "small".into());
        if !["small", "medium", "large"].contains(&size.as_str()) {
            return Err(CoreError::invalid(format!("unknown size {size:?}")));
        }
        if let Some(key) = &idempotency_key {
            let st = self.state.lock().unwrap();
            if let Some((prev, id)) = st.idem.get(&(caller.account_id.clone(), key.clone())) {
                if *prev != req {
                    return Err(CoreError::conflict(
                        "Idempotency-Key reused with a different body",
                    ));
                }
                let s = st
                    .sandboxes
                    .iter()
                    .find(|(_, s)| &s.id == id)
                    .unwrap()
                    .1
                    .clone();
                return Ok((s, true));
            }
        }
        let id = self.id("sbx");
        let s = sandbox(
            &id,
            req.name.clone(),
            &size,
            req.timeout_minutes.unwrap_or(15),
        );
        let mut st = self.state.lock().unwrap();
        st.sandboxes.push((caller.account_id.clone(), s.clone()));
        if let Some(key) = idempotency_key {
            st.idem.insert((caller.account_id.clone(), key), (req, id));
        }
        Ok((s, false))
    }

    async fn get_sandbox(&self, caller: &Caller, id: &str) -> Result<Sandbox> {
        self.owned(caller, id)
    }

    async fn list_sandboxes(&self, caller: &Caller, q: ListSandboxes) -> Result<List<Sandbox>> {
        let limit = q.limit.unwrap_or(20);
        if !(1..=100).contains(&limit) {
            return Err(CoreError::invalid("limit must be 1..100"));
        }
        let st = self.state.lock().unwrap();
        let mut all: Vec<Sandbox> = st
            .sandboxes
            .iter()
            .rev()
            .filter(|(a, s)| {
                a == &caller.account_id && (q.include_deleted == Some(true) || s.status.is_live())
            })
            .map(|(_, s)| s.clone())
            .collect();
        if let Some(after) = &q.starting_after {
            let pos = all
                .iter()
                .position(|s| &s.id == after)
                .map(|p| p + 1)
                .unwrap_or(0);
            all.drain(..pos);
        }
        let has_more = all.len() > limit as usize;
        all.truncate(limit as usize);
        let next = if has_more {
            all.last().map(|s| s.id.clone())
        } else {
            None
        };
        Ok(List::new(all, has_more, next))
    }

    async fn extend_sandbox(
        &self,
        caller: &Caller,
        id: &str,
        additional_minutes: Option<u32>,
    ) -> Result<Sandbox> {
        let add = additional_minutes.unwrap_or(15);
        if add > 1440 {
            return Err(CoreError::invalid("past 24 h"));
        }
        self.update(caller, id, |s| s.timeout_minutes += add)
    }

    async fn destroy_sandbox(&self, caller: &Caller, id: &str) -> Result<Sandbox> {
        self.update(caller, id, |s| {
            if s.status != SandboxStatus::Deleted {
                s.status = SandboxStatus::Deleted;
                s.deleted_at = Some("2026-01-01T00:05:00Z".into());
                s.deleted_reason = Some("destroyed".into());
            }
        })
    }

    async fn exec(&self, caller: &Caller, id: &str, params: ExecParams) -> Result<Execution> {
        let s = self.owned(caller, id)?;
        *self.last_exec.lock().unwrap() = Some(params.clone());
        if s.status != SandboxStatus::Running {
            return Err(CoreError::conflict("sandbox is not running"));
        }
        if params.command == "busy" {
            return Err(
                CoreError::new(ErrorType::ServiceUnavailable, "agent busy").with_retry_after(2)
            );
        }
        let e = execution(&self.id("exec"), id, &format!("{}\n", params.command), "");
        self.record_exec(caller, &e);
        Ok(e)
    }

    async fn exec_stream(
        &self,
        caller: &Caller,
        id: &str,
        params: ExecParams,
    ) -> Result<ExecStream> {
        self.owned(caller, id)?;
        *self.last_exec.lock().unwrap() = Some(params.clone());
        let (tx, rx) = mpsc::channel(16);
        let (cancel_tx, mut cancel_rx) = oneshot::channel::<()>();
        let exec = execution(&self.id("exec"), id, "out\n", "err\n");
        self.record_exec(caller, &exec);
        let rec = self.rec.clone();
        let command = params.command.clone();
        tokio::spawn(async move {
            match command.as_str() {
                "hang" => {
                    let _ = tx.send(ExecEvent::Stdout("started\n".into())).await;
                    tokio::select! {
                        _ = &mut cancel_rx => {}
                        _ = tx.closed() => {}
                    }
                    rec.cancelled.fetch_add(1, Ordering::SeqCst);
                    rec.cancel_seen.notify_waiters();
                }
                "boom" => {
                    let _ = tx.send(ExecEvent::Stdout("partial".into())).await;
                    let _ = tx
                        .send(ExecEvent::Error(CoreError::new(
                            ErrorType::ServiceUnavailable,
                            "the host lost the VM",
                        )))
                        .await;
                }
                "vanish" => {
                    let _ = tx.send(ExecEvent::Stderr("bye".into())).await;
                }
                _ => {
                    let _ = tx.send(ExecEvent::Stdout("out\n".into())).await;
                    let _ = tx.send(ExecEvent::Stderr("err\n".into())).await;
                    let _ = tx.send(ExecEvent::Exit(exec)).await;
                }
            }
        });
        Ok(ExecStream {
            events: rx,
            cancel: Some(cancel_tx),
        })
    }

    async fn get_execution(&self, caller: &Caller, exec_id: &str) -> Result<Execution> {
        let st = self.state.lock().unwrap();
        match st.execs.get(exec_id) {
            Some((a, e)) if a == &caller.account_id => Ok(e.clone()),
            _ => Err(CoreError::not_found("execution", exec_id)),
        }
    }

    async fn write_file(&self, caller: &Caller, id: &str, req: WriteFile) -> Result<FileWritten> {
        self.owned(caller, id)?;
        let bytes = match req.encoding.unwrap_or_default() {
            Encoding::Utf8 => req.content.into_bytes(),
            Encoding::Base64 => {
                use base64::Engine;
                base64::engine::general_purpose::STANDARD
                    .decode(&req.content)
                    .map_err(|e| CoreError::invalid(format!("bad base64: {e}")))?
            }
        };
        let path = resolve(&req.path);
        let n = bytes.len() as u64;
        self.state
            .lock()
            .unwrap()
            .files
            .insert((id.to_owned(), path.clone()), bytes);
        Ok(FileWritten { path, bytes: n })
    }

    async fn read_file(
        &self,
        caller: &Caller,
        id: &str,
        path: &str,
        encoding: Encoding,
    ) -> Result<FileContent> {
        self.owned(caller, id)?;
        let path = resolve(path);
        let st = self.state.lock().unwrap();
        let bytes = st
            .files
            .get(&(id.to_owned(), path.clone()))
            .ok_or_else(|| CoreError::new(ErrorType::NotFound, format!("no file {path}")))?;
        let content = match encoding {
            Encoding::Utf8 => String::from_utf8(bytes.clone())
                .map_err(|_| CoreError::invalid("not UTF-8: read it with encoding=base64"))?,
            Encoding::Base64 => {
                use base64::Engine;
                base64::engine::general_purpose::STANDARD.encode(bytes)
            }
        };
        Ok(FileContent {
            path,
            content,
            bytes: bytes.len() as u64,
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
        self.owned(caller, id)?;
        let dir = resolve(path.unwrap_or("/workspace"));
        let prefix = format!("{}/", dir.trim_end_matches('/'));
        let st = self.state.lock().unwrap();
        let entries = st
            .files
            .iter()
            .filter(|((s, p), _)| s == id && p.starts_with(&prefix))
            .map(|((_, p), b)| (p[prefix.len()..].to_owned(), b.len() as u64))
            .filter(|(name, _)| recursive || !name.contains('/'))
            .map(|(name, size)| FileEntry {
                name,
                kind: EntryType::File,
                size_bytes: size,
            })
            .collect();
        Ok(FileList {
            path: dir,
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
        self.owned(caller, id)?;
        let path = resolve(path);
        let mut st = self.state.lock().unwrap();
        let existed = st.files.remove(&(id.to_owned(), path.clone())).is_some();
        if !existed && !recursive {
            return Err(CoreError::new(
                ErrorType::NotFound,
                format!("no file {path}"),
            ));
        }
        Ok(FileDeleted {
            path,
            deleted: true,
        })
    }

    async fn expose_port(&self, caller: &Caller, id: &str, port: u16) -> Result<Port> {
        self.owned(caller, id)?;
        if port == 0 {
            return Err(CoreError::invalid("port must be 1..65535"));
        }
        let mut st = self.state.lock().unwrap();
        let ports = st.ports.entry(id.to_owned()).or_default();
        if let Some(p) = ports.iter().find(|p| p.port == port) {
            return Ok(p.clone());
        }
        let p = Port {
            port,
            url: format!("https://{port}-{id}.sandpit.test"),
            created_at: T0.into(),
        };
        ports.push(p.clone());
        Ok(p)
    }

    async fn list_ports(&self, caller: &Caller, id: &str) -> Result<List<Port>> {
        self.owned(caller, id)?;
        let st = self.state.lock().unwrap();
        Ok(List::new(
            st.ports.get(id).cloned().unwrap_or_default(),
            false,
            None,
        ))
    }

    async fn close_port(&self, caller: &Caller, id: &str, port: u16) -> Result<()> {
        self.owned(caller, id)?;
        let mut st = self.state.lock().unwrap();
        let ports = st.ports.entry(id.to_owned()).or_default();
        let before = ports.len();
        ports.retain(|p| p.port != port);
        if ports.len() == before {
            return Err(CoreError::new(
                ErrorType::NotFound,
                format!("port {port} is not exposed"),
            ));
        }
        Ok(())
    }

    async fn usage(&self, caller: &Caller, days: Option<u32>) -> Result<Usage> {
        let st = self.state.lock().unwrap();
        let sandboxes = st
            .sandboxes
            .iter()
            .filter(|(a, _)| a == &caller.account_id)
            .map(|(_, s)| SandboxUsage {
                id: s.id.clone(),
                size: s.size.clone(),
                seconds: 60,
                cost_usd: 0.0015,
                created_at: s.created_at.clone(),
                deleted_at: s.deleted_at.clone(),
                preview_bytes_in: 0,
                preview_bytes_out: 0,
                disk_used_bytes: 0,
            })
            .collect::<Vec<_>>();
        Ok(Usage {
            object: "usage".into(),
            credit_remaining_usd: 9.5,
            period_days: days.unwrap_or(30),
            total_cost_usd: 0.0015 * sandboxes.len() as f64,
            sandboxes,
        })
    }

    async fn account(&self, caller: &Caller) -> Result<Account> {
        Ok(Account {
            object: "account".into(),
            id: caller.account_id.clone(),
            name: format!("Account {}", caller.account_id),
            credit_remaining_usd: 9.5,
            max_concurrent_sandboxes: 20,
            created_at: T0.into(),
            disk_used_bytes: 0,
        })
    }

    async fn service_info(&self) -> Result<ServiceInfo> {
        Ok(ServiceInfo {
            name: "sandpit".into(),
            version: "0.1.0".into(),
            sizes: vec![SizeInfo {
                name: "small".into(),
                resources: Resources {
                    vcpus: 2,
                    memory_mb: 4096,
                    disk_gb: 40,
                },
                price_usd_per_hour: 0.09,
            }],
            default_timeout_minutes: 15,
            max_timeout_minutes: 1440,
            max_lifetime_minutes: 1440,
            max_concurrent_sandboxes: 20,
            acceleration: "tcg".into(),
            hosts: vec!["local".into()],
            authentication: "api_key".into(),
            guest: GuestInfo {
                os: "Debian 12".into(),
                kernel: "6.1".into(),
                user: "user".into(),
                workdir: "/workspace".into(),
            },
            fast_start: sandpit_core::model::FastStartInfo {
                snapshots: true,
                warm_pool: vec![sandpit_core::model::WarmPoolInfo {
                    size: "small".into(),
                    ready: 2,
                    target: 2,
                }],
            },
            limits: Default::default(),
        })
    }
}
