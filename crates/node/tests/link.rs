//! The control plane ↔ node link over real TCP on the loopback: a cluster CA
//! made by `init_ca`, members' certificates from `issue`, a node API server
//! and clients with and without the cluster's certificates.

use async_trait::async_trait;
use sandpit_host::machines::{
    Command, Download, Listing, Machines, PtyExit, PtyInput, PtyOutput, PtySize, Started, Terminal,
    Tunnel, Upload, VmResult, VmVolume, Watch,
};
use sandpit_node::{
    client_config, init_ca, issue, server_config, Health, NodeClient, NodeError, NodeState,
};
use sandpit_protocol::{
    AgentError, ErrorKind, ExecRequest, ExecResult, FileKind, PathCall, PathEntry, ProcessCall,
    ProcessInfo, WatchEvent, WatchEventKind,
};
use sandpit_runtime::{Egress, GuestExecEvent, RuntimeError, VmState};
use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use time::OffsetDateTime;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rustls::rustls;

/// A node whose epoch the test sets (0 = fenced), counting what it served.
struct TestNode {
    epoch: AtomicI64,
    asked: AtomicUsize,
    vms: Arc<FakeVms>,
}

#[async_trait]
impl NodeState for TestNode {
    fn name(&self) -> &str {
        "n1"
    }
    fn epoch(&self) -> Option<i64> {
        self.asked.fetch_add(1, Ordering::SeqCst);
        match self.epoch.load(Ordering::SeqCst) {
            0 => None,
            e => Some(e),
        }
    }
    fn machines(&self) -> Arc<dyn Machines> {
        self.vms.clone()
    }
    async fn start(
        &self,
        id: &str,
        size: &str,
        snapshot: Option<&str>,
        expires_at: OffsetDateTime,
        egress: Egress,
        volumes: Vec<VmVolume>,
    ) -> VmResult<Started> {
        self.vms
            .start(id, size, snapshot, expires_at, egress, volumes)
            .await
    }
}

/// VMs in memory, for what the link carries (the cluster tests run real
/// ones): one VM `vm1` with files; every other id has died.
#[derive(Default)]
struct FakeVms {
    files: Arc<Mutex<HashMap<String, Vec<u8>>>>,
    expiry: Mutex<Option<OffsetDateTime>>,
    egress: Mutex<Option<Egress>>,
    cancelled: Arc<AtomicUsize>,
    /// The snapshot calls it was asked, in order.
    snapshots: Mutex<Vec<String>>,
    /// Directory watches stopped (dropped).
    watches_stopped: Arc<AtomicUsize>,
}

/// A watch that reports two batches, then waits until it is dropped.
struct FakeWatch {
    batches: Vec<Vec<WatchEvent>>,
    stopped: Arc<AtomicUsize>,
}

#[async_trait]
impl Watch for FakeWatch {
    fn path(&self) -> &str {
        "/home/user/w"
    }
    async fn next(&mut self) -> VmResult<Option<Vec<WatchEvent>>> {
        if self.batches.is_empty() {
            std::future::pending::<()>().await;
        }
        Ok(Some(self.batches.remove(0)))
    }
}

impl Drop for FakeWatch {
    fn drop(&mut self) {
        self.stopped.fetch_add(1, Ordering::SeqCst);
    }
}

fn event(name: &str, kind: WatchEventKind) -> WatchEvent {
    WatchEvent {
        name: name.into(),
        kind,
    }
}

fn exec_request(command: &str) -> ExecRequest {
    ExecRequest {
        command: command.into(),
        cwd: None,
        env: Default::default(),
        timeout_ms: 10_000,
        max_output_bytes: 1 << 20,
        ..Default::default()
    }
}

fn check(id: &str) -> VmResult<()> {
    match id {
        "vm1" => Ok(()),
        _ => Err(RuntimeError::VmExited {
            cause: "killed by signal 9".into(),
        }),
    }
}

fn not_found(path: &str) -> RuntimeError {
    RuntimeError::Agent(AgentError::new(
        ErrorKind::NotFound,
        format!("{path}: no such file"),
    ))
}

struct FakeCommand {
    events: Vec<GuestExecEvent>,
    cancel: Arc<tokio::sync::Notify>,
    cancelled: Arc<AtomicUsize>,
}

#[async_trait]
impl Command for FakeCommand {
    async fn next(&mut self) -> VmResult<GuestExecEvent> {
        if self.events.len() > 1 {
            return Ok(self.events.remove(0));
        }
        // The last event (the exit) waits for a cancel if it asks to.
        if let Some(GuestExecEvent::Exited(r)) = self.events.first() {
            if r.cancelled {
                self.cancel.notified().await;
                self.cancelled.fetch_add(1, Ordering::SeqCst);
            }
        }
        Ok(self.events.remove(0))
    }
    fn cancel(&self) {
        self.cancel.notify_one();
    }
}

struct FakeUpload {
    files: Arc<Mutex<HashMap<String, Vec<u8>>>>,
    path: String,
    got: Vec<u8>,
}

#[async_trait]
impl Upload for FakeUpload {
    async fn send(&mut self, data: &[u8]) -> VmResult<()> {
        self.got.extend_from_slice(data);
        Ok(())
    }
    async fn finish(self: Box<Self>) -> VmResult<(String, u64)> {
        let n = self.got.len() as u64;
        let path = match self.path.starts_with("snapshot:") {
            true => self.path.clone(),
            false => format!("/workspace/{}", self.path),
        };
        self.files.lock().unwrap().insert(path.clone(), self.got);
        Ok((path, n))
    }
}

struct FakeDownload {
    path: String,
    pieces: Vec<Vec<u8>>,
    size: u64,
}

#[async_trait]
impl Download for FakeDownload {
    fn path(&self) -> &str {
        &self.path
    }
    fn size(&self) -> u64 {
        self.size
    }
    async fn next_chunk(&mut self) -> VmResult<Option<Vec<u8>>> {
        Ok((!self.pieces.is_empty()).then(|| self.pieces.remove(0)))
    }
}

#[async_trait]
impl Machines for FakeVms {
    async fn take_warm(&self, size: &str) -> VmResult<Option<String>> {
        Ok((size == "small").then(|| "vm1".to_string()))
    }
    async fn return_warm(&self, _id: &str, _size: &str) -> VmResult<()> {
        Ok(())
    }
    async fn start(
        &self,
        id: &str,
        size: &str,
        snapshot: Option<&str>,
        expires_at: OffsetDateTime,
        egress: Egress,
        volumes: Vec<VmVolume>,
    ) -> VmResult<Started> {
        check(id)?;
        *self.expiry.lock().unwrap() = Some(expires_at);
        if let Some(s) = snapshot {
            self.snapshots
                .lock()
                .unwrap()
                .push(format!("start {id} {s} {egress:?} {volumes:?}"));
        }
        // A node records its starts; a "large" one here stands for a
        // machine that leaves that to its caller.
        Ok(match size {
            "large" => Started::Booted,
            _ => Started::Recorded {
                ready_at: OffsetDateTime::from_unix_timestamp(1_800_000_000).unwrap(),
                expires_at: expires_at + time::Duration::minutes(5),
                restored: Some(true),
            },
        })
    }
    async fn destroy(&self, id: &str) -> VmResult<Option<u64>> {
        Ok((id == "vm1").then_some(4096))
    }
    async fn snapshot(&self, id: &str, snapshot: &str) -> VmResult<u64> {
        check(id)?;
        self.snapshots
            .lock()
            .unwrap()
            .push(format!("save {id} {snapshot}"));
        Ok(72 << 20)
    }
    async fn delete_snapshot(&self, snapshot: &str) -> VmResult<()> {
        self.snapshots
            .lock()
            .unwrap()
            .push(format!("delete {snapshot}"));
        Ok(())
    }
    async fn create_volume(&self, id: &str, bytes: u64) -> VmResult<()> {
        let mut log = self.snapshots.lock().unwrap();
        log.push(format!("create volume {id} {bytes}"));
        Ok(())
    }
    async fn resize_volume(&self, id: &str, bytes: u64) -> VmResult<()> {
        if id != "vol_a" {
            return Err(RuntimeError::VolumeSize {
                id: id.into(),
                bytes,
                why: "no such volume here".into(),
            });
        }
        let mut log = self.snapshots.lock().unwrap();
        log.push(format!("resize volume {id} {bytes}"));
        Ok(())
    }
    async fn delete_volume(&self, id: &str) -> VmResult<()> {
        let mut log = self.snapshots.lock().unwrap();
        log.push(format!("delete volume {id}"));
        Ok(())
    }
    async fn pause(&self, id: &str) -> VmResult<()> {
        check(id)?;
        self.snapshots.lock().unwrap().push(format!("pause {id}"));
        Ok(())
    }
    async fn resume(
        &self,
        id: &str,
        expires_at: OffsetDateTime,
        egress: Egress,
        volumes: Vec<VmVolume>,
    ) -> VmResult<()> {
        check(id)?;
        *self.expiry.lock().unwrap() = Some(expires_at);
        self.snapshots
            .lock()
            .unwrap()
            .push(format!("resume {id} {egress:?} {volumes:?}"));
        Ok(())
    }
    async fn restore(
        &self,
        id: &str,
        snapshot: &str,
        expires_at: OffsetDateTime,
        egress: Egress,
        volumes: Vec<VmVolume>,
    ) -> VmResult<()> {
        check(id)?;
        *self.expiry.lock().unwrap() = Some(expires_at);
        self.snapshots
            .lock()
            .unwrap()
            .push(format!("restore {id} {snapshot} {egress:?} {volumes:?}"));
        Ok(())
    }
    async fn set_expiry(&self, id: &str, at: OffsetDateTime) -> VmResult<()> {
        check(id)?;
        *self.expiry.lock().unwrap() = Some(at);
        Ok(())
    }
    async fn set_egress(&self, id: &str, egress: Egress) -> VmResult<()> {
        check(id)?;
        *self.egress.lock().unwrap() = Some(egress);
        Ok(())
    }
    async fn state(&self, id: &str) -> VmResult<Option<VmState>> {
        Ok(match id {
            "vm1" => Some(VmState::Running),
            "gone" => None,
            _ => Some(VmState::Exited {
                cause: "killed by signal 9".into(),
            }),
        })
    }
    async fn exec(&self, id: &str, request: ExecRequest) -> VmResult<Box<dyn Command>> {
        check(id)?;
        let wait = request.command == "sleep";
        Ok(Box::new(FakeCommand {
            events: vec![
                GuestExecEvent::Stdout(vec![0, 159, 146, 150, b'\n']),
                GuestExecEvent::Stderr(request.command.into_bytes()),
                GuestExecEvent::Exited(ExecResult {
                    exit_code: (!wait).then_some(3),
                    signal: wait.then_some(9),
                    timed_out: false,
                    cancelled: wait,
                    stdout_bytes: 5,
                    stderr_bytes: 0,
                    stdout_truncated: false,
                    stderr_truncated: false,
                    duration_ms: 1,
                    duration_us: None,
                }),
            ],
            cancel: Arc::new(tokio::sync::Notify::new()),
            cancelled: self.cancelled.clone(),
        }))
    }
    async fn upload(&self, id: &str, path: &str, _size: u64) -> VmResult<Box<dyn Upload>> {
        check(id)?;
        Ok(Box::new(FakeUpload {
            files: self.files.clone(),
            path: path.to_string(),
            got: Vec::new(),
        }))
    }
    async fn download(&self, id: &str, path: &str, max: u64) -> VmResult<Box<dyn Download>> {
        check(id)?;
        let bytes = self
            .files
            .lock()
            .unwrap()
            .get(path)
            .cloned()
            .ok_or_else(|| not_found(path))?;
        if bytes.len() as u64 > max {
            return Err(RuntimeError::Agent(AgentError::new(
                ErrorKind::TooLarge,
                "too large",
            )));
        }
        Ok(Box::new(FakeDownload {
            path: path.to_string(),
            size: bytes.len() as u64,
            pieces: bytes.chunks(1000).map(<[u8]>::to_vec).collect(),
        }))
    }
    async fn held_parts(&self) -> VmResult<Vec<String>> {
        Ok(vec!["template:0123456789abcdef".into()])
    }
    /// A snapshot is a file of the fake's named `snapshot:<name>`; what
    /// the receiver holds is left out of it as a count of parts.
    async fn send_snapshot(
        &self,
        snapshot: &str,
        held: Vec<String>,
    ) -> VmResult<Box<dyn Download>> {
        let mut bytes = self
            .files
            .lock()
            .unwrap()
            .get(&format!("snapshot:{snapshot}"))
            .cloned()
            .ok_or_else(|| RuntimeError::NotFound(snapshot.to_string()))?;
        bytes.truncate(bytes.len() - held.len());
        Ok(Box::new(FakeDownload {
            path: snapshot.to_string(),
            size: bytes.len() as u64,
            pieces: bytes.chunks(64 * 1024).map(<[u8]>::to_vec).collect(),
        }))
    }
    async fn receive_snapshot(&self, snapshot: &str, _size: u64) -> VmResult<Box<dyn Upload>> {
        Ok(Box::new(FakeUpload {
            files: self.files.clone(),
            path: format!("snapshot:{snapshot}"),
            got: Vec::new(),
        }))
    }
    async fn list_files(&self, id: &str, path: &str, _r: bool, _m: u64) -> VmResult<Listing> {
        check(id)?;
        Ok(Listing {
            path: path.to_string(),
            entries: Vec::new(),
            truncated: true,
        })
    }
    async fn delete_file(&self, id: &str, path: &str, _recursive: bool) -> VmResult<String> {
        check(id)?;
        self.files
            .lock()
            .unwrap()
            .remove(path)
            .map(|_| path.to_string())
            .ok_or_else(|| not_found(path))
    }
    async fn path_call(&self, id: &str, call: PathCall) -> VmResult<PathEntry> {
        check(id)?;
        let entry = |path: &str, kind| PathEntry {
            name: path.rsplit('/').next().unwrap_or_default().to_string(),
            path: path.to_string(),
            kind,
            size_bytes: 0,
            mode: 0o755,
            owner: "user".into(),
            group: "user".into(),
            modified_unix_ms: 1_700_000_000_000,
            symlink_target: None,
        };
        match call {
            PathCall::Stat { path } if self.files.lock().unwrap().contains_key(&path) => {
                Ok(entry(&path, FileKind::File))
            }
            PathCall::Stat { path } => Err(not_found(&path)),
            PathCall::MakeDir { path } if path == "/workspace" => Err(RuntimeError::Agent(
                AgentError::new(ErrorKind::AlreadyExists, "/workspace already exists"),
            )),
            PathCall::MakeDir { path } => Ok(entry(&path, FileKind::Dir)),
            PathCall::Move { to, .. } => Ok(entry(&to, FileKind::File)),
        }
    }
    async fn watch_dir(&self, id: &str, path: &str, _recursive: bool) -> VmResult<Box<dyn Watch>> {
        check(id)?;
        if path != "w" {
            return Err(not_found(path));
        }
        Ok(Box::new(FakeWatch {
            batches: vec![
                vec![
                    event("a.txt", WatchEventKind::Create),
                    event("a.txt", WatchEventKind::Write),
                ],
                vec![event("sub/é", WatchEventKind::Remove)],
            ],
            stopped: self.watches_stopped.clone(),
        }))
    }
    async fn attach(
        &self,
        id: &str,
        pid: u32,
        _max_output_bytes: u64,
        _longest: std::time::Duration,
    ) -> VmResult<Box<dyn Command>> {
        check(id)?;
        if pid != 812 {
            return Err(RuntimeError::Agent(AgentError::new(
                ErrorKind::NotFound,
                format!("no running command has pid {pid}"),
            )));
        }
        Ok(Box::new(FakeCommand {
            events: vec![
                GuestExecEvent::Started(pid),
                GuestExecEvent::Stdout(b"later\n".to_vec()),
                GuestExecEvent::Exited(ExecResult {
                    exit_code: None,
                    signal: Some(15),
                    timed_out: false,
                    cancelled: false,
                    stdout_bytes: 6,
                    stderr_bytes: 0,
                    stdout_truncated: false,
                    stderr_truncated: false,
                    duration_ms: 1,
                    duration_us: None,
                }),
            ],
            cancel: Arc::new(tokio::sync::Notify::new()),
            cancelled: self.cancelled.clone(),
        }))
    }
    async fn stats(&self, id: &str) -> VmResult<sandpit_protocol::GuestStats> {
        check(id)?;
        Ok(sandpit_protocol::GuestStats {
            cpu_count: 2,
            cpu_busy_ticks: 150,
            cpu_total_ticks: 1000,
            mem_total_bytes: 1 << 30,
            mem_available_bytes: 3 << 28,
            mem_cache_bytes: 1 << 26,
            disk_total_bytes: 4 << 30,
            disk_used_bytes: 1 << 30,
        })
    }
    async fn processes(&self, id: &str) -> VmResult<Vec<ProcessInfo>> {
        check(id)?;
        Ok(vec![ProcessInfo {
            pid: 812,
            command: "python3 -m http.server".into(),
            cwd: "/home/user".into(),
            env: [("A".to_string(), "b".to_string())].into(),
            keep_running: true,
            stdin: true,
            pty: true,
        }])
    }
    async fn process_call(
        &self,
        id: &str,
        pid: u32,
        call: ProcessCall,
        input: Vec<u8>,
    ) -> VmResult<()> {
        check(id)?;
        if pid != 812 {
            return Err(RuntimeError::Agent(AgentError::new(
                ErrorKind::NotFound,
                format!("no running command has pid {pid}"),
            )));
        }
        self.snapshots.lock().unwrap().push(format!(
            "{call:?} {pid} {}",
            String::from_utf8_lossy(&input)
        ));
        Ok(())
    }
    async fn open_tunnel(&self, id: &str, port: u16) -> VmResult<Tunnel> {
        check(id)?;
        if port != 8000 {
            return Err(RuntimeError::Agent(AgentError::new(
                ErrorKind::ConnectionRefused,
                format!("nothing listens on {port}"),
            )));
        }
        // An echo server that shouts back, and says goodbye at the end.
        let (mine, mut theirs) = tokio::io::duplex(1024);
        tokio::spawn(async move {
            let mut all = Vec::new();
            let _ = theirs.read_to_end(&mut all).await;
            let _ = theirs.write_all(&all.to_ascii_uppercase()).await;
            let _ = theirs.write_all(b" bye").await;
        });
        Ok(Tunnel {
            stream: Box::new(mine),
            closer: Arc::new(|| {}),
        })
    }

    async fn open_pty(&self, id: &str, size: PtySize) -> VmResult<Terminal> {
        check(id)?;
        // A terminal that shouts back what is typed, tells its sizes, and
        // ends with code 3 at "exit".
        let (input, mut typed) = tokio::sync::mpsc::channel(4);
        let (shown, output) = tokio::sync::mpsc::channel(4);
        tokio::spawn(async move {
            let first = format!("{}x{}", size.rows, size.cols);
            let _ = shown.send(PtyOutput::Data(first.into_bytes())).await;
            while let Some(item) = typed.recv().await {
                let out = match item {
                    PtyInput::Data(d) if d == b"exit" => PtyOutput::Exit(PtyExit {
                        exit_code: Some(3),
                        signal: None,
                    }),
                    PtyInput::Data(d) => PtyOutput::Data(d.to_ascii_uppercase()),
                    PtyInput::Resize(s) => PtyOutput::Data(format!("{}x{}", s.rows, s.cols).into()),
                };
                let last = matches!(out, PtyOutput::Exit(_));
                if shown.send(out).await.is_err() || last {
                    return;
                }
            }
        });
        Ok(Terminal {
            input,
            output,
            closer: Arc::new(|| {}),
        })
    }
}

async fn next_output(t: &mut Terminal) -> Option<PtyOutput> {
    tokio::time::timeout(std::time::Duration::from_secs(5), t.output.recv())
        .await
        .expect("the terminal answers")
}

#[tokio::test]
async fn only_members_of_the_cluster_reach_a_node_and_only_at_its_epoch() {
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("cluster");
    init_ca(&ca).unwrap();
    // A second init would replace the CA every member trusts: refused.
    let again = init_ca(&ca).unwrap_err().to_string();
    assert!(again.contains("already holds a cluster CA"), "{again}");
    let node = issue(&ca, "n1", &["127.0.0.1".into()]).unwrap();
    let replica = issue(&ca, "replica-a", &[]).unwrap();
    assert!(issue(&ca, "../evil", &[]).is_err());
    {
        use std::os::unix::fs::PermissionsExt;
        for key in [ca.join("ca.key"), node.key.clone(), replica.key.clone()] {
            let mode = std::fs::metadata(&key).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600, "{}", key.display());
        }
    }

    let vms = Arc::new(FakeVms::default());
    let state = Arc::new(TestNode {
        epoch: AtomicI64::new(7),
        asked: AtomicUsize::new(0),
        vms: vms.clone(),
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(sandpit_node::serve(
        listener,
        server_config(&node).unwrap(),
        state.clone(),
        async {
            let _ = stopped.await;
        },
    ));

    // A member, at the node's epoch.
    let member = NodeClient::new(client_config(&replica).unwrap());
    assert_eq!(
        member.health(&address, 7).await.unwrap(),
        Health {
            name: "n1".into(),
            epoch: 7
        }
    );
    // At an older epoch (the node started again since): refused.
    match member.health(&address, 6).await {
        Err(NodeError::StaleEpoch(m)) => assert!(m.contains("epoch 7"), "{m}"),
        other => panic!("{other:?}"),
    }

    let served = state.asked.load(Ordering::SeqCst);
    // No certificate at all: the handshake fails, nothing is served.
    let roots = {
        let mut r = rustls::RootCertStore::empty();
        use rustls::pki_types::pem::PemObject;
        for c in rustls::pki_types::CertificateDer::pem_file_iter(&node.ca).unwrap() {
            r.add(c.unwrap()).unwrap();
        }
        Arc::new(r)
    };
    let mut anonymous = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots.clone())
    .with_no_client_auth();
    anonymous.alpn_protocols = vec![b"h2".to_vec()];
    let anonymous = NodeClient::new(Arc::new(anonymous));
    assert!(matches!(
        anonymous.health(&address, 7).await,
        Err(NodeError::Unreachable { .. })
    ));
    // A certificate of another CA (another cluster, or self-made): refused.
    let other = dir.path().join("other");
    init_ca(&other).unwrap();
    let stranger = issue(&other, "replica-a", &[]).unwrap();
    let foreign = {
        use rustls::pki_types::pem::PemObject;
        let chain = rustls::pki_types::CertificateDer::pem_file_iter(&stranger.cert)
            .unwrap()
            .collect::<Result<Vec<_>, _>>()
            .unwrap();
        let key = rustls::pki_types::PrivateKeyDer::from_pem_file(&stranger.key).unwrap();
        // It trusts the node (the cluster's CA) but shows its own.
        let mut c = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)
        .unwrap();
        c.alpn_protocols = vec![b"h2".to_vec()];
        NodeClient::new(Arc::new(c))
    };
    assert!(matches!(
        foreign.health(&address, 7).await,
        Err(NodeError::Unreachable { .. })
    ));
    // A member that does not trust this node's CA does not talk to it.
    let wary = NodeClient::new(client_config(&stranger).unwrap());
    assert!(matches!(
        wary.health(&address, 7).await,
        Err(NodeError::Unreachable { .. })
    ));
    assert_eq!(
        state.asked.load(Ordering::SeqCst),
        served,
        "the node served a peer outside the cluster"
    );

    // Fenced: nothing is served, whatever the epoch.
    state.epoch.store(0, Ordering::SeqCst);
    assert!(matches!(
        member.health(&address, 7).await,
        Err(NodeError::Fenced(_))
    ));
    // Joined again under a new epoch: calls for it are served.
    state.epoch.store(8, Ordering::SeqCst);
    assert_eq!(member.health(&address, 8).await.unwrap().epoch, 8);

    stop.send(()).unwrap();
    server.await.unwrap().unwrap();
}

/// Every `Machines` call crosses the link with its answer, its bytes and
/// its failure's kind intact.
#[tokio::test]
async fn a_nodes_vms_answer_through_the_link_as_they_would_at_home() {
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("cluster");
    init_ca(&ca).unwrap();
    let node = issue(&ca, "n1", &["127.0.0.1".into()]).unwrap();
    let replica = issue(&ca, "replica-a", &[]).unwrap();
    let vms = Arc::new(FakeVms::default());
    let state = Arc::new(TestNode {
        epoch: AtomicI64::new(3),
        asked: AtomicUsize::new(0),
        vms: vms.clone(),
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    tokio::spawn(sandpit_node::serve(
        listener,
        server_config(&node).unwrap(),
        state,
        std::future::pending(),
    ));
    let client = NodeClient::new(client_config(&replica).unwrap());
    let remote: Arc<dyn Machines> = Arc::new(client.node(&address, 3));

    assert_eq!(
        remote.take_warm("small").await.unwrap().as_deref(),
        Some("vm1")
    );
    assert_eq!(remote.take_warm("large").await.unwrap(), None);
    remote.return_warm("vm1", "small").await.unwrap();
    let at = OffsetDateTime::from_unix_timestamp(1_900_000_000).unwrap();
    assert_eq!(
        remote
            .start("vm1", "small", None, at, Egress::open(), vec![])
            .await
            .unwrap(),
        Started::Recorded {
            ready_at: OffsetDateTime::from_unix_timestamp(1_800_000_000).unwrap(),
            expires_at: at + time::Duration::minutes(5),
            restored: Some(true),
        }
    );
    assert_eq!(*vms.expiry.lock().unwrap(), Some(at));
    assert_eq!(
        remote
            .start("vm1", "large", None, at, Egress::open(), vec![])
            .await
            .unwrap(),
        Started::Booted
    );
    // A VM that died is a VM that died here too, not "retry".
    match remote
        .start("vm2", "small", None, at, Egress::open(), vec![])
        .await
    {
        Err(RuntimeError::VmExited { cause }) => assert_eq!(cause, "killed by signal 9"),
        other => panic!("{other:?}"),
    }
    assert_eq!(remote.state("vm1").await.unwrap(), Some(VmState::Running));
    assert_eq!(remote.state("gone").await.unwrap(), None);

    // Snapshots: taken, started from, restored and deleted on the node.
    assert_eq!(remote.snapshot("vm1", "snap_a").await.unwrap(), 72 << 20);
    remote
        .start(
            "vm1",
            "small",
            Some("snap_a"),
            at,
            Egress::blocked(),
            vec![],
        )
        .await
        .unwrap();
    let later = at + time::Duration::minutes(1);
    // Each start of a VM carries its egress and volumes across the wire.
    let data = VmVolume {
        volume: "vol_a".into(),
        path: "/data".into(),
        read_only: true,
    };
    remote
        .restore("vm1", "snap_a", later, Egress::open(), vec![data.clone()])
        .await
        .unwrap();
    assert_eq!(*vms.expiry.lock().unwrap(), Some(later));
    remote.delete_snapshot("snap_a").await.unwrap();
    remote.pause("vm1").await.unwrap();
    remote
        .resume("vm1", at, Egress::blocked(), vec![data.clone()])
        .await
        .unwrap();
    assert_eq!(*vms.expiry.lock().unwrap(), Some(at));
    // A volume's file is made, grown and removed by its node; a failure
    // comes back with its message.
    remote.create_volume("vol_a", 1 << 30).await.unwrap();
    remote.resize_volume("vol_a", 2 << 30).await.unwrap();
    let e = remote.resize_volume("vol_b", 1 << 30).await.unwrap_err();
    assert!(e.to_string().contains("no such volume here"), "{e}");
    remote.delete_volume("vol_a").await.unwrap();
    // A running VM's egress changed: its lists arrive as sent.
    let policy = Egress::checked(vec!["198.51.100.7".into()], vec!["0.0.0.0/0".into()]).unwrap();
    remote.set_egress("vm1", policy.clone()).await.unwrap();
    assert_eq!(*vms.egress.lock().unwrap(), Some(policy));
    assert!(matches!(
        remote.set_egress("vm2", Egress::open()).await,
        Err(RuntimeError::VmExited { .. })
    ));
    assert!(matches!(
        remote.snapshot("vm2", "snap_b").await,
        Err(RuntimeError::VmExited { .. })
    ));
    assert_eq!(
        *vms.snapshots.lock().unwrap(),
        [
            "save vm1 snap_a".to_string(),
            format!("start vm1 snap_a {:?} []", Egress::blocked()),
            format!("restore vm1 snap_a {:?} [{data:?}]", Egress::open()),
            "delete snap_a".into(),
            "pause vm1".into(),
            format!("resume vm1 {:?} [{data:?}]", Egress::blocked()),
            format!("create volume vol_a {}", 1u64 << 30),
            format!("resize volume vol_a {}", 2u64 << 30),
            "delete volume vol_a".into(),
        ]
    );
    assert_eq!(remote.destroy("vm1").await.unwrap(), Some(4096));

    // A command: raw bytes both ways, its exit, and a cancel that reaches it.
    let mut cmd = remote.exec("vm1", exec_request("echo")).await.unwrap();
    let mut events = Vec::new();
    loop {
        let e = cmd.next().await.unwrap();
        let last = matches!(e, GuestExecEvent::Exited(_));
        events.push(e);
        if last {
            break;
        }
    }
    assert!(matches!(&events[0], GuestExecEvent::Stdout(b) if b == &[0, 159, 146, 150, b'\n']));
    assert!(matches!(&events[2], GuestExecEvent::Exited(r) if r.exit_code == Some(3)));
    let mut cmd = remote.exec("vm1", exec_request("sleep")).await.unwrap();
    cmd.next().await.unwrap();
    cmd.next().await.unwrap();
    cmd.cancel();
    assert!(matches!(cmd.next().await.unwrap(), GuestExecEvent::Exited(r) if r.cancelled));
    assert_eq!(vms.cancelled.load(Ordering::SeqCst), 1);

    // A directory watch: set before it returns, its events as they come,
    // stopped on the node when the caller drops it; its errors' kinds kept.
    let mut watch = remote.watch_dir("vm1", "w", true).await.unwrap();
    assert_eq!(watch.path(), "/home/user/w");
    assert_eq!(
        watch.next().await.unwrap().unwrap(),
        [
            event("a.txt", WatchEventKind::Create),
            event("a.txt", WatchEventKind::Write)
        ]
    );
    assert_eq!(
        watch.next().await.unwrap().unwrap(),
        [event("sub/é", WatchEventKind::Remove)]
    );
    drop(watch);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while vms.watches_stopped.load(Ordering::SeqCst) == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the node's watch ran on"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    match remote.watch_dir("vm1", "nope", false).await {
        Err(RuntimeError::Agent(a)) => assert_eq!(a.kind, ErrorKind::NotFound),
        Err(e) => panic!("{e:?}"),
        Ok(_) => panic!("watched"),
    }
    assert!(matches!(
        remote.watch_dir("vm2", "w", false).await,
        Err(RuntimeError::VmExited { .. })
    ));

    // Files: a binary one in pieces, a listing, a delete; a missing file
    // is the agent's not-found.
    let content: Vec<u8> = (0..5000u32).map(|i| (i % 251) as u8).collect();
    let mut up = remote.upload("vm1", "blob", 5000).await.unwrap();
    for piece in content.chunks(700) {
        up.send(piece).await.unwrap();
    }
    assert_eq!(
        up.finish().await.unwrap(),
        ("/workspace/blob".to_string(), 5000)
    );
    let (path, back) = remote
        .read_file("vm1", "/workspace/blob", 1 << 20)
        .await
        .unwrap();
    assert_eq!((path.as_str(), back.len()), ("/workspace/blob", 5000));
    assert_eq!(back, content);
    let mut down = remote
        .download("vm1", "/workspace/blob", 1 << 20)
        .await
        .unwrap();
    assert_eq!(down.size(), 5000);
    let mut pieces = 0;
    while down.next_chunk().await.unwrap().is_some() {
        pieces += 1;
    }
    assert_eq!(pieces, 5, "pieces as the guest sent them");
    // A snapshot carried to another node: relayed in pieces both ways,
    // what the receiver holds left out, an unknown one refused by kind,
    // and one cut short never kept.
    let snapshot: Vec<u8> = (0..3_000_000u32).map(|i| (i % 253) as u8).collect();
    let mut up = remote
        .receive_snapshot("snap_a", snapshot.len() as u64)
        .await
        .unwrap();
    for piece in snapshot.chunks(100_000) {
        up.send(piece).await.unwrap();
    }
    assert_eq!(
        up.finish().await.unwrap(),
        ("snapshot:snap_a".to_string(), 3_000_000)
    );
    let held = remote.held_parts().await.unwrap();
    assert_eq!(held, ["template:0123456789abcdef"]);
    let mut down = remote.send_snapshot("snap_a", held).await.unwrap();
    assert_eq!(down.size(), 2_999_999);
    let mut back = Vec::new();
    while let Some(piece) = down.next_chunk().await.unwrap() {
        back.extend_from_slice(&piece);
    }
    assert_eq!(back, snapshot[..2_999_999]);
    assert!(matches!(
        remote.send_snapshot("snap_none", Vec::new()).await,
        Err(RuntimeError::NotFound(_))
    ));
    let mut cut = remote.receive_snapshot("snap_cut", 1000).await.unwrap();
    cut.send(&[1; 10]).await.unwrap();
    drop(cut);
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    assert!(!vms.files.lock().unwrap().contains_key("snapshot:snap_cut"));
    match remote.read_file("vm1", "/workspace/blob", 10).await {
        Err(RuntimeError::Agent(a)) => assert_eq!(a.kind, ErrorKind::TooLarge),
        other => panic!("{other:?}"),
    }
    let (path, n) = remote
        .write_file("vm1", "small", b"hi".to_vec())
        .await
        .unwrap();
    assert_eq!((path.as_str(), n), ("/workspace/small", 2));
    let listing = remote
        .list_files("vm1", "/workspace", true, 10)
        .await
        .unwrap();
    assert!(listing.truncated);
    // Calls on paths cross the node API both ways, errors' kinds kept.
    let made = remote
        .path_call(
            "vm1",
            PathCall::MakeDir {
                path: "/workspace/d".into(),
            },
        )
        .await
        .unwrap();
    assert_eq!((made.name.as_str(), made.kind), ("d", FileKind::Dir));
    match remote
        .path_call(
            "vm1",
            PathCall::MakeDir {
                path: "/workspace".into(),
            },
        )
        .await
    {
        Err(RuntimeError::Agent(a)) => assert_eq!(a.kind, ErrorKind::AlreadyExists),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        remote
            .path_call(
                "vm1",
                PathCall::Stat {
                    path: "/workspace/small".into()
                }
            )
            .await
            .unwrap()
            .kind,
        FileKind::File
    );
    // Running commands: attached to by pid (its pid first), listed, fed
    // and signalled across the node API; an unknown pid stays not found.
    let mut followed = remote
        .attach("vm1", 812, 1 << 20, std::time::Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(followed.next().await.unwrap(), GuestExecEvent::Started(812));
    assert_eq!(
        followed.next().await.unwrap(),
        GuestExecEvent::Stdout(b"later\n".to_vec())
    );
    assert!(matches!(
        followed.next().await.unwrap(),
        GuestExecEvent::Exited(ExecResult {
            signal: Some(15),
            ..
        })
    ));
    match remote
        .attach("vm1", 9, 1 << 20, std::time::Duration::from_secs(60))
        .await
    {
        Ok(mut c) => match c.next().await {
            Err(RuntimeError::Agent(a)) => assert_eq!(a.kind, ErrorKind::NotFound),
            other => panic!("{other:?}"),
        },
        Err(RuntimeError::Agent(a)) => assert_eq!(a.kind, ErrorKind::NotFound),
        Err(other) => panic!("{other:?}"),
    }
    let listed = remote.processes("vm1").await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].command, "python3 -m http.server");
    assert_eq!(listed[0].env["A"], "b");
    assert!(
        listed[0].pty,
        "a command's terminal is said across the link"
    );
    let stats = remote.stats("vm1").await.unwrap();
    assert_eq!((stats.cpu_count, stats.cpu_busy_ticks), (2, 150));
    assert_eq!(stats.disk_used_bytes, 1 << 30);
    let binary = vec![0u8, 255, b'\n'];
    remote
        .process_call("vm1", 812, ProcessCall::Input, b"hello\n".to_vec())
        .await
        .unwrap();
    remote
        .process_call("vm1", 812, ProcessCall::Input, binary.clone())
        .await
        .unwrap();
    remote
        .process_call("vm1", 812, ProcessCall::Signal { signal: 15 }, Vec::new())
        .await
        .unwrap();
    match remote
        .process_call("vm1", 9, ProcessCall::CloseStdin, Vec::new())
        .await
    {
        Err(RuntimeError::Agent(a)) => assert_eq!(a.kind, ErrorKind::NotFound),
        other => panic!("{other:?}"),
    }
    {
        let log = vms.snapshots.lock().unwrap();
        assert!(log.contains(&"Input 812 hello\n".to_string()), "{log:?}");
        assert!(
            log.contains(&format!("Input 812 {}", String::from_utf8_lossy(&binary))),
            "{log:?}"
        );
        assert!(
            log.contains(&"Signal { signal: 15 } 812 ".to_string()),
            "{log:?}"
        );
    }
    assert_eq!(
        remote
            .delete_file("vm1", "/workspace/blob", false)
            .await
            .unwrap(),
        "/workspace/blob"
    );
    match remote.download("vm1", "/workspace/blob", 100).await {
        Err(RuntimeError::Agent(a)) => assert_eq!(a.kind, ErrorKind::NotFound),
        Err(other) => panic!("{other:?}"),
        Ok(_) => panic!("a deleted file was read"),
    }

    // A tunnel carries bytes both ways and each side's end.
    let mut tunnel = remote.open_tunnel("vm1", 8000).await.unwrap();
    tunnel.stream.write_all(b"hello").await.unwrap();
    tunnel.stream.shutdown().await.unwrap();
    let mut back = Vec::new();
    tunnel.stream.read_to_end(&mut back).await.unwrap();
    assert_eq!(back, b"HELLO bye");
    match remote.open_tunnel("vm1", 9).await {
        Err(RuntimeError::Agent(a)) => assert_eq!(a.kind, ErrorKind::ConnectionRefused),
        Err(other) => panic!("{other:?}"),
        Ok(_) => panic!("a tunnel to a closed port"),
    }
    // A tunnel cut from elsewhere ends for its reader.
    let mut tunnel = remote.open_tunnel("vm1", 8000).await.unwrap();
    (tunnel.closer)();
    let mut rest = Vec::new();
    let read = tokio::time::timeout(
        std::time::Duration::from_secs(5),
        tunnel.stream.read_to_end(&mut rest),
    )
    .await
    .expect("a cut tunnel ends");
    assert!(read.is_err() || rest.is_empty(), "{read:?} {rest:?}");

    // A terminal: its first size, keystrokes and resizes in order, its
    // shell's end; a dead VM's error crosses with its kind.
    let mut term = remote
        .open_pty("vm1", PtySize { rows: 24, cols: 80 })
        .await
        .unwrap();
    assert_eq!(
        next_output(&mut term).await,
        Some(PtyOutput::Data(b"24x80".to_vec()))
    );
    term.input
        .send(PtyInput::Data(b"ls".to_vec()))
        .await
        .unwrap();
    term.input
        .send(PtyInput::Resize(PtySize {
            rows: 50,
            cols: 132,
        }))
        .await
        .unwrap();
    assert_eq!(
        next_output(&mut term).await,
        Some(PtyOutput::Data(b"LS".to_vec()))
    );
    assert_eq!(
        next_output(&mut term).await,
        Some(PtyOutput::Data(b"50x132".to_vec()))
    );
    term.input
        .send(PtyInput::Data(b"exit".to_vec()))
        .await
        .unwrap();
    let exit = PtyExit {
        exit_code: Some(3),
        signal: None,
    };
    assert_eq!(next_output(&mut term).await, Some(PtyOutput::Exit(exit)));
    assert_eq!(next_output(&mut term).await, None);
    match remote.open_pty("nope", PtySize { rows: 1, cols: 1 }).await {
        Err(RuntimeError::VmExited { cause }) => assert!(cause.contains("signal 9"), "{cause}"),
        Err(other) => panic!("{other:?}"),
        Ok(_) => panic!("a terminal in a dead VM"),
    }

    // A stale epoch is "retry" (the link's own refusal), not the VM's.
    let stale: Arc<dyn Machines> = Arc::new(client.node(&address, 2));
    match stale.state("vm1").await {
        Err(RuntimeError::Disconnected(m)) => assert!(m.contains("epoch 3"), "{m}"),
        other => panic!("{other:?}"),
    }
}
