//! `sandpit bench cluster`: what running as a cluster costs, on this
//! machine. The same calls go, interleaved round by round, to the embedded
//! single process (SQLite, VMs in the process) and to a control-plane
//! replica (`Service::without_vms`, in this process) whose sandboxes run on
//! a real `sandpit node` child process, over the node API's mutual TLS on
//! the loopback, with a throwaway PostgreSQL (Debian's, as the tests start
//! it) as the shared database. Then the node is killed, and the time until
//! its sandbox is failed and settled is measured with the configured lease
//! and grace.

use crate::{median, row, Row};
use anyhow::{Context, Result};
use clap::Args;
use sandpit_core::prelude::*;
use sandpit_core::{Caller, CreateSandbox, ExecParams, SandboxApi, Service};
use sandpit_server::settings::Settings;
use std::io::BufRead;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Args)]
pub struct ClusterBenchArgs {
    /// Rounds of each measurement (each round times both sides)
    #[arg(long, default_value_t = 15)]
    rounds: usize,
    /// Creates (each with a command) per side before any is timed: every
    /// pooled database connection has then met the queries of the path, as
    /// in a server that has run a while (PostgreSQL prepares a statement
    /// once per connection, and the pool hands its connections out in turn)
    #[arg(long, default_value_t = 12)]
    warmup: usize,
    /// Sandbox size to use
    #[arg(long, default_value = "small")]
    size: String,
    /// Skip killing the node to time how long its loss takes to settle
    #[arg(long)]
    skip_loss: bool,
}

/// One side of the comparison: a service, an account on it, its HTTP front.
struct Side {
    name: &'static str,
    svc: Arc<Service>,
    caller: Caller,
}

/// Ready VMs the warm pool keeps per side (creates are timed from the pool).
const POOL: usize = 2;

pub async fn run(settings: &Settings, a: ClusterBenchArgs) -> Result<i32> {
    let _owner = sandpit_server::serve::own(settings, sandpit_server::owner::Role::Bench)?;
    let scratch = tempfile::tempdir()?;
    eprintln!("starting a throwaway PostgreSQL (Debian's postgresql package)");
    let pg = tokio::task::spawn_blocking(|| {
        sandpit_pgtest::Postgres::start(&[std::net::Ipv4Addr::LOCALHOST.into()])
    })
    .await?;
    let url = pg.fresh_database().await;

    // The cluster's certificates.
    let certs = scratch.path().join("certs");
    sandpit_node::init_ca(&certs)?;
    for member in ["bench-node", "bench-replica"] {
        sandpit_node::issue(&certs, member, &["127.0.0.1".into()])?;
    }

    // Both sides' config: the warm pool for the size, the rest as set.
    let mut config: toml::Table = match &settings.config_file {
        Some(f) => toml::from_str(&std::fs::read_to_string(f)?)
            .with_context(|| format!("reading {}", f.display()))?,
        None => toml::Table::new(),
    };
    let pool = config
        .entry("pool")
        .or_insert_with(|| toml::Value::Table(toml::Table::new()));
    if let toml::Value::Table(pool) = pool {
        let mut sizes = toml::Table::new();
        sizes.insert(a.size.clone(), toml::Value::Integer(POOL as i64));
        pool.insert("sizes".into(), toml::Value::Table(sizes));
    }
    let config_file = scratch.path().join("config.toml");
    std::fs::write(&config_file, toml::to_string(&config)?)?;
    let node_data = scratch.path().join("node");
    std::fs::create_dir_all(&node_data)?;
    let node = NodeChild::start(settings, &node_data, &config_file, &url, &certs)?;

    let mut pool_cfg = settings.pool.clone();
    pool_cfg.sizes = std::collections::BTreeMap::from([(a.size.clone(), POOL)]);
    let embedded_store =
        sandpit_store::Store::open_sqlite(scratch.path().join("embedded.db")).await?;
    let vms = sandpit_host::local::LocalVms::with_pool(settings.vm_manager()?, pool_cfg);
    let embedded = side("embedded", settings, |service| {
        Service::new(service, embedded_store, vms)
    })
    .await?;
    let replica_store = sandpit_store::Store::connect(&url).await?;
    let cluster_cfg = settings.cluster.clone();
    let replica = side("cluster", settings, |mut service| {
        service.host_name = "bench-replica".into();
        Service::without_vms(service, replica_store)
    })
    .await?;
    let identity = sandpit_node::Identity::in_dir(&certs, "bench-replica");
    let link = Arc::new(sandpit_node::NodeClient::new(sandpit_node::client_config(
        &identity,
    )?));
    replica.svc.set_node_link(link.clone());
    replica.svc.join_cluster(cluster_cfg.clone(), "").await?;
    replica.svc.start().await?;
    embedded.svc.start().await?;
    let sides = [embedded, replica];

    let mut rows = Vec::new();
    // Creates from a full warm pool, then the sandbox's first `true`.
    let mut create = [Vec::new(), Vec::new()];
    let mut first = [Vec::new(), Vec::new()];
    for round in 0..a.warmup + a.rounds {
        for (i, s) in sides.iter().enumerate() {
            // Both pools full and at rest: no refill competes for the CPU.
            for s in &sides {
                wait_warm(s, &a.size).await?;
            }
            let t = Instant::now();
            let (sbx, _) = s
                .svc
                .create_sandbox(&s.caller, create_request(&a.size), None)
                .await?;
            let created = ms(t);
            let t = Instant::now();
            s.svc.exec(&s.caller, &sbx.id, true_cmd()).await?;
            if round >= a.warmup {
                create[i].push(created);
                first[i].push(ms(t));
            }
            s.svc.destroy_sandbox(&s.caller, &sbx.id).await?;
        }
    }
    compare(&mut rows, "create_sandbox from the warm pool", &create);
    compare(&mut rows, "its first `true`", &first);

    // Commands and preview GETs on one long-lived sandbox per side.
    let mut live = Vec::new();
    for s in &sides {
        for s in &sides {
            wait_warm(s, &a.size).await?;
        }
        let (sbx, _) = s
            .svc
            .create_sandbox(&s.caller, create_request(&a.size), None)
            .await?;
        live.push(sbx.id);
    }
    for s in &sides {
        wait_warm(s, &a.size).await?;
    }
    let mut exec = [Vec::new(), Vec::new()];
    for _ in 0..a.rounds * 4 {
        for (i, s) in sides.iter().enumerate() {
            let t = Instant::now();
            s.svc.exec(&s.caller, &live[i], true_cmd()).await?;
            exec[i].push(ms(t));
        }
    }
    compare(&mut rows, "run_command(\"true\")", &exec);
    let mut previews = Vec::new();
    for (i, s) in sides.iter().enumerate() {
        previews.push(preview_url(s, &live[i]).await?);
    }
    let http = reqwest::Client::new();
    let mut get = [Vec::new(), Vec::new()];
    for _ in 0..a.rounds * 4 {
        for (i, url) in previews.iter().enumerate() {
            let t = Instant::now();
            let r = http.get(url).send().await?;
            anyhow::ensure!(r.status() == 200, "preview GET: {}", r.status());
            r.bytes().await?;
            get[i].push(ms(t));
        }
    }
    compare(&mut rows, "preview GET of 1 KiB", &get);

    // What one round trip costs here, to read the differences above by: a
    // create in the cluster makes one node call (the start; a second, the
    // warm take, when the node's published pool has no VM left for it) and
    // two database round trips (one on the replica, one on the node); see
    // docs/design.md.
    let store = sides[1].svc.store();
    let node_row = store
        .node("bench-node")
        .await?
        .context("the node's row is gone")?;
    let remote =
        sandpit_host::machines::NodeLink::machines(&*link, &node_row.address, node_row.epoch);
    // Back to back, and after a pause (as in a create, where each goes to
    // a process that had nothing to do since the last create).
    for pause in [Duration::ZERO, Duration::from_millis(50)] {
        let (mut db, mut call) = (Vec::new(), Vec::new());
        for _ in 0..a.rounds * 4 {
            tokio::time::sleep(pause).await;
            let t = Instant::now();
            store.now_ms().await?;
            db.push(ms(t));
            tokio::time::sleep(pause).await;
            let t = Instant::now();
            remote.state("sbx_bench_none").await?;
            call.push(ms(t));
        }
        let after = match pause.is_zero() {
            true => "back to back".to_string(),
            false => format!("each after {} ms idle", pause.as_millis()),
        };
        row(
            &mut rows,
            format!("one round trip, {after} ({} each)", db.len()),
            format!(
                "a PostgreSQL query {:.2} ms; a node call {:.2} ms",
                median(db),
                median(call)
            ),
        );
    }
    for (i, s) in sides.iter().enumerate() {
        s.svc.destroy_sandbox(&s.caller, &live[i]).await?;
    }

    if !a.skip_loss {
        let s = &sides[1];
        wait_warm(s, &a.size).await?;
        let (sbx, _) = s
            .svc
            .create_sandbox(&s.caller, create_request(&a.size), None)
            .await?;
        let killed = Instant::now();
        node.kill();
        loop {
            let now = s.svc.get_sandbox(&s.caller, &sbx.id).await?;
            if now.status == sandpit_core::SandboxStatus::Failed {
                break;
            }
            anyhow::ensure!(
                killed.elapsed() < Duration::from_secs(300),
                "the lost node's sandbox was never settled"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        row(
            &mut rows,
            format!(
                "node SIGKILLed to its sandbox failed and settled (lease {} s, grace {} s)",
                cluster_cfg.lease_secs, cluster_cfg.lost_after_secs
            ),
            format!("{:.1} s", killed.elapsed().as_secs_f64()),
        );
    }
    sides[0].svc.shutdown().await;
    drop(node);
    // The killed node's VMs: removed as its next start would.
    remove_vms(settings, &node_data).await;

    println!();
    println!(
        "| cluster vs embedded ({}, size {}, medians of {} rounds) | value |",
        sides[0]
            .svc
            .vms_accel()
            .map_or("?".to_string(), |a| a.to_string()),
        a.size,
        a.rounds
    );
    println!("|---|---|");
    for Row(what, value) in rows {
        println!("| {what} | {value} |");
    }
    Ok(0)
}

/// A service with an account, served over HTTP on the loopback (previews
/// at `localhost:{its port}`).
async fn side(
    name: &'static str,
    settings: &Settings,
    make: impl FnOnce(sandpit_core::config::ServiceConfig) -> Arc<Service>,
) -> Result<Side> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    let mut service = settings.service.clone();
    service.preview_scheme = "http".into();
    service.preview_domain = format!("localhost:{port}");
    service.default_max_concurrent_sandboxes = 100;
    let svc = make(service.clone());
    let account =
        sandpit_core::admin::create_account(svc.store(), &service, "bench", 100_000.0).await?;
    let api: Arc<dyn SandboxApi> = svc.clone();
    let e2b = sandpit_e2b::E2b {
        api: api.clone(),
        domain: service.preview_domain.clone(),
        public_url: format!("http://127.0.0.1:{port}"),
        default_size: api.service_info().await?.default_size,
        max_body_bytes: sandpit_api::RestConfig::default().max_body_bytes,
        watchers: Default::default(),
    };
    let front = Arc::new(sandpit_server::front::Front {
        api: sandpit_api::router(api, sandpit_api::RestConfig::default())
            .nest_service("/e2b", sandpit_e2b::control_plane(e2b.clone())),
        e2b_data: sandpit_e2b::data_plane(e2b),
        proxy: sandpit_server::proxy::Proxy::new(svc.clone(), &svc.config().preview_scheme),
        preview_domain: service.preview_domain.clone(),
        preview_scheme: service.preview_scheme.clone(),
    });
    tokio::spawn(sandpit_server::listener::serve(
        vec![listener],
        None,
        front,
        sandpit_server::listener::ConnectionLimits::default(),
        std::future::pending(),
    ));
    Ok(Side {
        name,
        svc,
        caller: Caller::new(account.id, "bench"),
    })
}

/// Until the side's warm pool is full: the embedded one's in memory, the
/// node's as a heartbeat after this call wrote it (an older one may count
/// a VM taken since), and then as the replica read it (as its own
/// heartbeat would: a busy replica's creates find the node's pool
/// published).
async fn wait_warm(side: &Side, size: &str) -> Result<()> {
    let t = Instant::now();
    let since = side.svc.store().now_ms().await?;
    loop {
        let ready = match side.name {
            "embedded" => side.svc.warm_count(size),
            _ => {
                let store = side.svc.store();
                store
                    .node("bench-node")
                    .await?
                    .filter(|n| n.heartbeat_ms > since)
                    .and_then(|n| n.warm.get(size).map(Vec::len))
                    .unwrap_or(0)
            }
        };
        if ready >= POOL {
            if side.name != "embedded" {
                side.svc.read_cluster_again().await?;
            }
            return Ok(());
        }
        anyhow::ensure!(
            t.elapsed() < Duration::from_secs(600),
            "the {} warm pool did not fill",
            side.name
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn create_request(size: &str) -> CreateSandbox {
    CreateSandbox {
        size: Some(size.to_string()),
        timeout_minutes: Some(30),
        ..CreateSandbox::default()
    }
}

fn true_cmd() -> ExecParams {
    ExecParams {
        command: "true".into(),
        cwd: None,
        env: None,
        timeout_ms: None,
        stream: None,
        ..Default::default()
    }
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1000.0
}

/// A row: both medians, what the cluster adds, and the ratio.
fn compare(rows: &mut Vec<Row>, what: &str, laps: &[Vec<f64>; 2]) {
    let (e, c) = (median(laps[0].clone()), median(laps[1].clone()));
    row(
        rows,
        format!("{what} ({} each)", laps[0].len()),
        format!(
            "embedded {e:.2} ms; cluster {c:.2} ms; the cluster adds {:.2} ms ({:.2}x)",
            c - e,
            c / e
        ),
    );
}

/// A 1 KiB file served by Python in the sandbox, exposed; its preview URL.
async fn preview_url(side: &Side, id: &str) -> Result<String> {
    let mut setup = true_cmd();
    setup.command = "mkdir -p /workspace/bench && cd /workspace/bench \
        && head -c 1024 /dev/zero | tr '\\0' x > bench.txt \
        && (nohup python3 -m http.server 8000 > /tmp/bench-http.log 2>&1 &)"
        .into();
    side.svc.exec(&side.caller, id, setup).await?;
    let port = side.svc.expose_port(&side.caller, id, 8000, false).await?;
    let url = format!("{}/bench.txt", port.url);
    let http = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Ok(r) = http.get(&url).send().await {
            if r.status() == 200 {
                return Ok(url);
            }
        }
        anyhow::ensure!(Instant::now() < deadline, "the preview URL never answered");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// The `sandpit node` child process the replica places sandboxes on.
struct NodeChild(std::sync::Mutex<Option<std::process::Child>>);

impl NodeChild {
    fn start(
        settings: &Settings,
        data: &std::path::Path,
        config: &std::path::Path,
        url: &str,
        certs: &std::path::Path,
    ) -> Result<NodeChild> {
        let mut child = std::process::Command::new(std::env::current_exe()?)
            .arg("--data-dir")
            .arg(data)
            .arg("--images-dir")
            .arg(&settings.images_dir)
            .arg("--config")
            .arg(config)
            .args(["node", "--name", "bench-node", "--listen", "127.0.0.1:0"])
            .arg("--cluster-dir")
            .arg(certs)
            .env("SANDPIT_DATABASE_URL", url)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()?;
        let stderr = child.stderr.take().expect("piped");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stderr)
                .lines()
                .map_while(Result::ok)
            {
                if line.contains("serving its VMs at") {
                    let _ = tx.send(());
                }
                eprintln!("[node] {line}");
            }
        });
        rx.recv_timeout(Duration::from_secs(300))
            .context("the bench's sandpit node did not start")?;
        Ok(NodeChild(std::sync::Mutex::new(Some(child))))
    }

    fn kill(&self) {
        if let Some(mut c) = self.0.lock().unwrap().take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for NodeChild {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Removes the VMs left in a (killed) node's data directory.
async fn remove_vms(settings: &Settings, data: &std::path::Path) {
    let mut s = settings.clone();
    s.data_dir = data.to_path_buf();
    s.runtime.data_dir = data.to_path_buf();
    let Ok(manager) = s.vm_manager() else {
        return;
    };
    let vms = sandpit_host::local::LocalVms::new(manager);
    for vm in vms.list() {
        let _ = vms.destroy(&vm.id).await;
    }
    vms.kill_orphan_qemus(&[]).await;
}
