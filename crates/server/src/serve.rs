//! `sandpit serve`, `sandpit node`, `sandpit mcp` and the reaper: the
//! control plane assembled from the core service, the store (the data
//! directory's SQLite file or `--database`), this host's VMs, the REST and
//! MCP adapters, the dashboard, the preview proxy and the node API.

use crate::front;
use crate::images;
use crate::listener;
use crate::owner;
use crate::proxy::Proxy;
use crate::settings::Settings;
use anyhow::{bail, Context, Result};
use clap::Args;
use sandpit_core::prelude::*;
use sandpit_core::{admin, Caller, SandboxApi, Service};
use sandpit_host::local::LocalVms;
use sandpit_runtime::VmManager;
use sandpit_store::Store;
use std::sync::Arc;

/// Name of the account `sandpit mcp` (local, stdio) acts for.
pub const LOCAL_ACCOUNT: &str = "local";

#[derive(Args)]
pub struct ServeArgs {
    /// Address to listen on [default: 127.0.0.1:8080; config `listen`; env SANDPIT_LISTEN]
    #[arg(long)]
    listen: Option<String>,
    /// This machine's name in a shared database (--database): its
    /// sandboxes are recorded as on it [default: the host name]
    #[arg(long)]
    name: Option<String>,
    /// Serve this node's internal API here (mutual TLS; needs --database and
    /// --cluster-dir), for the cluster's other members
    #[arg(long, value_name = "ADDR")]
    node_listen: Option<String>,
    /// The address the other members reach the node API at [default: the
    /// address --node-listen bound]
    #[arg(long, value_name = "HOST:PORT")]
    advertise: Option<String>,
    /// Where this member's certificates are: DIR/ca.pem, DIR/NAME.pem,
    /// DIR/NAME.key (`sandpit cluster issue DIR NAME`)
    #[arg(long, value_name = "DIR")]
    cluster_dir: Option<std::path::PathBuf>,
    /// Run no VMs here: a control-plane replica of a cluster (needs
    /// --database and --cluster-dir), whose sandboxes all run on nodes
    #[arg(long)]
    no_vms: bool,
    #[command(flatten)]
    metrics: crate::metrics::MetricsArgs,
}

#[derive(Args)]
pub struct NodeArgs {
    /// Serve the node API (mutual TLS) here, for the cluster's replicas
    // (Options that clap requires: `sandpit node drain` and its kin, a
    // subcommand, lift the requirement.)
    #[arg(long, value_name = "ADDR", required = true)]
    listen: Option<String>,
    /// The address the other members reach the node API at [default: the
    /// address --listen bound]
    #[arg(long, value_name = "HOST:PORT")]
    advertise: Option<String>,
    /// This machine's name in the database [default: the host name]
    #[arg(long)]
    name: Option<String>,
    /// Where this node's certificates are: DIR/ca.pem, DIR/NAME.pem,
    /// DIR/NAME.key (`sandpit cluster issue DIR NAME`)
    #[arg(long, value_name = "DIR", required = true)]
    cluster_dir: Option<std::path::PathBuf>,
    #[command(flatten)]
    metrics: crate::metrics::MetricsArgs,
}

#[derive(Args)]
pub struct McpArgs {
    /// Forward to a Sandpit server's REST API instead of running VMs here;
    /// the key comes from SANDPIT_API_KEY
    #[arg(long)]
    remote: Option<String>,
}

/// The control plane's store: `--database`, or the SQLite file in the data
/// directory.
pub async fn open_store(settings: &Settings) -> Result<Store> {
    private_dir(&settings.data_dir)?;
    match &settings.database_url {
        Some(url) => Store::connect(url)
            .await
            .with_context(|| format!("opening the database {}", sandpit_store::redact_url(url))),
        None => Store::open_sqlite(settings.database())
            .await
            .with_context(|| format!("opening {}", settings.database().display())),
    }
}

/// `sandpit mcp` (local) and its reaper keep their state in the data
/// directory: a shared database belongs to a server.
fn data_dir_store_only(settings: &Settings, what: &str) -> Result<()> {
    if let Some(url) = &settings.database_url {
        bail!(
            "{what} keeps its sandboxes in the data directory, not in {} (--database or \
             SANDPIT_DATABASE_URL): run `sandpit serve --database …` and connect with \
             `sandpit mcp --remote URL`",
            sandpit_store::redact_url(url)
        );
    }
    Ok(())
}

/// Make the data directory if it is missing, and keep it its owner's: no
/// one else lists or writes it (VMs' QEMUs, each its own uid, are given the
/// right to walk through it by the runtime, and nothing more). A directory
/// the runtime cannot keep its files in is refused here, at the start of
/// `serve`, `node` and `mcp`, rather than when a VM starts.
fn private_dir(dir: &std::path::Path) -> Result<()> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    sandpit_runtime::config::check_data_dir(dir).map_err(anyhow::Error::msg)?;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .with_context(|| format!("creating {}", dir.display()))?;
    let mode = std::fs::metadata(dir)?.permissions().mode() & 0o7777;
    if mode & 0o066 != 0 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode & !0o066))
            .with_context(|| format!("restricting {}", dir.display()))?;
    }
    Ok(())
}

/// The core service over this host's VMs, reconciled and reaping. With
/// `build`, the guest image is built if it is missing (serve, mcp); without,
/// only an existing one is used (the reaper).
async fn service_with(settings: &Settings, build: bool) -> Result<Arc<Service>> {
    let store = open_store(settings).await?;
    let mut config = settings.service.clone();
    config.secrets_key = settings.secrets_key()?;
    if settings.no_vms {
        let svc = Service::without_vms(config, store);
        svc.join_cluster(settings.cluster.clone(), "").await?;
        svc.start().await?;
        return Ok(svc);
    }
    let dir = settings.images_dir.clone();
    let image = tokio::task::spawn_blocking(move || {
        if build {
            images::current(&dir, None)
        } else {
            images::existing(&dir)
        }
    })
    .await??;
    let manager = VmManager::new(settings.runtime.clone(), image)?;
    // The reaper only expires sandboxes; serve and mcp keep a warm pool.
    let vms = if build {
        LocalVms::with_budget(manager, settings.pool.clone(), settings.capacity.clone())
    } else {
        LocalVms::new(manager)
    };
    let svc = Service::new(config, store, vms);
    // On a shared database this machine is a node of the cluster: it joins
    // (a new epoch, a lease) before it reconciles, so a sweep that declared
    // it lost while it was down has settled its old sandboxes already.
    if settings.database_url.is_some() {
        // Where the other members reach this node's API ("" without one).
        let address = settings.node_address.clone().unwrap_or_default();
        svc.join_cluster(settings.cluster.clone(), &address).await?;
    }
    svc.start().await?;
    Ok(svc)
}

/// On a store without accounts: an `admin` account and its first key,
/// printed once with the MCP client configuration to paste. Of servers
/// started together on an empty database, exactly one makes it.
async fn first_start(settings: &Settings, store: &Store, public_url: &str) -> Result<()> {
    let max_concurrent = settings.service.default_max_concurrent_sandboxes;
    let Some(first) = store.create_first_admin("admin", max_concurrent).await? else {
        return Ok(());
    };
    store
        .add_credit(
            &first.id,
            sandpit_core::model::micros(100.0),
            Some("initial credit"),
        )
        .await?;
    let (key, _) = admin::create_key(store, "admin").await?;
    let mcp = serde_json::json!({
        "mcpServers": {"sandbox": {
            "type": "http",
            "url": format!("{public_url}/v1/mcp"),
            "headers": {"Authorization": format!("Bearer {key}")}
        }}
    });
    println!(
        "First start: created the operator account \"admin\" with $100.00 of credit \
         (dashboard: {public_url}/)."
    );
    println!("Its API key (shown only now):\n\n    {key}\n");
    println!(
        "MCP client configuration:\n{}\n",
        serde_json::to_string_pretty(&mcp)?
    );
    println!(
        "E2B's SDKs, unchanged:\n{}",
        sandpit_core::e2b::environment(public_url, &key)
    );
    Ok(())
}

async fn service(settings: &Settings) -> Result<Arc<Service>> {
    service_with(settings, true).await
}

pub async fn serve(settings: &Settings, args: ServeArgs) -> Result<i32> {
    let listen = args.listen.unwrap_or_else(|| settings.listen.clone());
    let listeners = listener::bind(&listen).await?;
    let addr = listeners[0].local_addr()?;
    let listening = listeners
        .iter()
        .filter_map(|l| l.local_addr().ok())
        .collect::<Vec<_>>();
    let tls = match &settings.tls {
        Some((cert, key)) => Some(front::tls_acceptor(cert, key)?),
        None => None,
    };
    let scheme = if tls.is_some() { "https" } else { "http" };
    if tls.is_none() && !addr.ip().is_loopback() {
        tracing::warn!(
            "serving on {addr} WITHOUT TLS: API keys, commands, files and preview traffic \
             cross the network in clear text; set [preview] tls_cert and tls_key, or keep \
             the server on 127.0.0.1 behind a TLS proxy"
        );
    }
    let public_url = settings
        .public_url
        .clone()
        .unwrap_or_else(|| format!("{scheme}://{addr}"));
    // Preview URLs follow this server unless configured: on a machine with
    // no DNS, `http://{port}-{id}.localhost:{our port}` reaches us, since
    // browsers resolve every `*.localhost` to the loopback.
    let mut settings = settings.clone();
    if !settings.preview_domain_set {
        settings.service.preview_domain = format!("localhost:{}", addr.port());
    }
    if !settings.preview_scheme_set {
        settings.service.preview_scheme = scheme.into();
    }
    name_member(&mut settings, args.name)?;
    if args.no_vms {
        if settings.database_url.is_none() || args.cluster_dir.is_none() {
            bail!(
                "--no-vms makes a control-plane replica of a cluster: give --database (the \
                 cluster's PostgreSQL) and --cluster-dir (its certificates, to reach the nodes)"
            );
        }
        if args.node_listen.is_some() {
            bail!("--no-vms runs no VMs, so it serves no node API: drop --node-listen");
        }
        settings.no_vms = true;
    }
    let node_api = match (&args.node_listen, &settings.database_url) {
        (None, _) => None,
        (Some(_), None) => bail!(
            "--node-listen serves a node of a cluster that shares a database: give --database"
        ),
        (Some(listen), Some(_)) => {
            let dir = args
                .cluster_dir
                .as_deref()
                .context("--node-listen needs --cluster-dir (its certificates)")?;
            Some(bind_node_api(&mut settings, listen, args.advertise.as_deref(), dir).await?)
        }
    };
    let settings = &settings;
    // A replica owns no VMs, so no data directory.
    let _owner = match settings.no_vms {
        true => None,
        false => Some(own(settings, owner::Role::Serve)?),
    };
    let svc = service(settings).await?;
    if let (Some(dir), Some(_)) = (&args.cluster_dir, &settings.database_url) {
        link_cluster(&svc, settings, dir)?;
        // A control plane moves draining nodes' sandboxes (a node alone
        // may not reach the others).
        svc.drain_for_the_cluster();
    }
    let node_task = node_api.map(|api| spawn_node_api(&svc, api));
    let metrics = crate::metrics::start(
        &svc,
        &settings.metrics,
        node_label(settings)?,
        args.metrics,
        true,
    )
    .await?;
    first_start(settings, svc.store(), &public_url).await?;
    let api: Arc<dyn SandboxApi> = svc.clone();

    let mut rest = sandpit_api::RestConfig::default();
    if let Some(b) = settings.max_body_bytes {
        rest.max_body_bytes = b;
    }
    rest.body_budget = sandpit_api::BodyBudget::new(
        settings
            .body_budget_bytes
            .unwrap_or(sandpit_api::DEFAULT_BODY_BUDGET),
        rest.max_body_bytes,
    );
    let mut mcp = sandpit_mcp::HttpConfig::default();
    if let Some(h) = &settings.mcp_allowed_hosts {
        mcp.allowed_hosts = h.clone();
    }
    if let Some(o) = &settings.mcp_allowed_origins {
        mcp.allowed_origins = o.clone();
    }
    let info = api.service_info().await?;
    mcp.limits = info.limits;
    let shutdown = mcp.shutdown.clone();
    let budget = rest.body_budget.clone();
    // E2B's API: its control plane under /e2b, its sandboxes' data plane
    // for requests that name a sandbox in `E2b-Sandbox-Id` (see `front`).
    let e2b = sandpit_e2b::E2b {
        api: api.clone(),
        domain: settings.service.preview_domain.clone(),
        public_url: public_url.clone(),
        default_size: info.default_size,
        max_body_bytes: rest.max_body_bytes,
        watchers: Default::default(),
    };
    let e2b_data = sandpit_api::with_request_layers(
        sandpit_e2b::data_plane(e2b.clone())
            .layer(axum::extract::DefaultBodyLimit::max(rest.max_body_bytes)),
        &budget,
    );
    let app = sandpit_api::router(api.clone(), rest)
        .nest_service(
            "/v1/mcp",
            sandpit_api::with_request_layers(sandpit_mcp::http_service(api, mcp), &budget),
        )
        .nest_service(
            "/e2b",
            sandpit_api::with_request_layers(sandpit_e2b::control_plane(e2b), &budget),
        );
    let app = metrics.mount(app);
    // The dashboard at `/`, beside the API (whose fallback answers every
    // other path).
    let dashboard = sandpit_web::WebConfig {
        secure_cookies: tls.is_some(),
        public_url: public_url.clone(),
        signup: settings.signup.clone(),
        ..Default::default()
    };
    let app = app.merge(sandpit_web::router(svc.clone(), dashboard));
    let front = Arc::new(front::Front {
        api: app,
        e2b_data,
        proxy: Proxy::new(svc.clone(), &svc.config().preview_scheme),
        preview_domain: settings.service.preview_domain.clone(),
        preview_scheme: settings.service.preview_scheme.clone(),
    });
    eprintln!(
        "sandpit {} serving {public_url} (REST /v1, MCP /v1/mcp, previews {}://PORT-ID.{}; {} acceleration; data in {})",
        sandpit_core::version(&settings.service.commit),
        settings.service.preview_scheme,
        settings.service.preview_domain,
        svc.vms_accel()
            .map_or("no VMs here: the nodes'".to_string(), |a| a.to_string()),
        match settings.no_vms {
            true => "the database".to_string(),
            false => settings.data_dir.display().to_string(),
        }
    );
    listener::check_preview_names(
        &settings.service.preview_domain,
        &settings.service.preview_scheme,
        listening,
    );
    let limits = settings.connections.fit_descriptors();
    listener::serve(listeners, tls, front, limits, async move {
        wait_for_signal().await;
        eprintln!("shutting down: finishing requests in flight; sandboxes keep running");
        shutdown.cancel();
    })
    .await?;
    if let Some(task) = node_task {
        task.abort();
    }
    svc.shutdown().await;
    Ok(0)
}

/// Names this member in a shared database (`--name`, or the host name).
fn name_member(settings: &mut Settings, name: Option<String>) -> Result<()> {
    match (&settings.database_url, name) {
        (Some(_), name) => {
            settings.service.host_name = match name {
                Some(n) => n,
                None => host_name()?,
            }
        }
        (None, Some(_)) => bail!(
            "--name names this machine in a database shared with others; with the data \
             directory's own database (no --database) it is always \"{}\"",
            settings.service.host_name
        ),
        (None, None) => {}
    }
    Ok(())
}

/// The node API's listener and TLS, with the address the other members
/// will reach it at recorded in `settings` (registered when it joins).
async fn bind_node_api(
    settings: &mut Settings,
    listen: &str,
    advertise: Option<&str>,
    dir: &std::path::Path,
) -> Result<(
    tokio::net::TcpListener,
    Arc<tokio_rustls::rustls::ServerConfig>,
)> {
    let identity = sandpit_node::Identity::in_dir(dir, &settings.service.host_name);
    let tls = sandpit_node::server_config(&identity).with_context(|| {
        format!(
            "the node's certificates in {} (`sandpit cluster issue {} {}`)",
            dir.display(),
            dir.display(),
            settings.service.host_name
        )
    })?;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("binding the node API to {listen}"))?;
    settings.node_address = Some(match advertise {
        Some(a) => a.to_string(),
        None => listener.local_addr()?.to_string(),
    });
    Ok((listener, tls))
}

/// Gives the service its way to other nodes' VMs: their APIs, over mutual
/// TLS with this member's certificates.
fn link_cluster(svc: &Service, settings: &Settings, dir: &std::path::Path) -> Result<()> {
    let identity = sandpit_node::Identity::in_dir(dir, &settings.service.host_name);
    let tls = sandpit_node::client_config(&identity)
        .with_context(|| format!("this member's certificates in {}", dir.display()))?;
    svc.set_node_link(Arc::new(sandpit_node::NodeClient::new(tls)));
    Ok(())
}

/// Serves this node's VMs to the other members until the task is aborted.
fn spawn_node_api(
    svc: &Arc<Service>,
    (listener, tls): (
        tokio::net::TcpListener,
        Arc<tokio_rustls::rustls::ServerConfig>,
    ),
) -> tokio::task::JoinHandle<()> {
    let starts = svc
        .node_starts()
        .expect("a node runs VMs (--no-vms has no node API)");
    let state: Arc<dyn sandpit_node::NodeState> = Arc::new(ServedNode {
        svc: svc.clone(),
        starts,
    });
    tokio::spawn(async move {
        if let Err(e) = sandpit_node::serve(listener, tls, state, std::future::pending()).await {
            tracing::error!("the node API stopped: {e}");
        }
    })
}

/// `sandpit node`: this machine's VMs for a cluster, served to its
/// replicas over the node API; no public API.
pub async fn node(settings: &Settings, args: NodeArgs) -> Result<i32> {
    if settings.database_url.is_none() {
        bail!("sandpit node runs a node of a cluster: give --database (its PostgreSQL)");
    }
    let (Some(listen), Some(cluster_dir)) = (&args.listen, &args.cluster_dir) else {
        bail!("sandpit node runs a node: give --listen and --cluster-dir");
    };
    let mut settings = settings.clone();
    name_member(&mut settings, args.name)?;
    let api = bind_node_api(
        &mut settings,
        listen,
        args.advertise.as_deref(),
        cluster_dir,
    )
    .await?;
    let settings = &settings;
    let _owner = own(settings, owner::Role::Node)?;
    let svc = service(settings).await?;
    // A destroy or an expiry it serves for its own sandboxes needs no link;
    // it has one anyway, as every member.
    link_cluster(&svc, settings, cluster_dir)?;
    let task = spawn_node_api(&svc, api);
    crate::metrics::start(
        &svc,
        &settings.metrics,
        node_label(settings)?,
        args.metrics,
        false,
    )
    .await?;
    eprintln!(
        "sandpit {} node {} serving its VMs at {} (epoch {}; {} acceleration; data in {})",
        sandpit_core::version(&settings.service.commit),
        settings.service.host_name,
        settings.node_address.as_deref().unwrap_or_default(),
        svc.cluster_epoch().unwrap_or_default(),
        svc.vms_accel().map_or("no".to_string(), |a| a.to_string()),
        settings.data_dir.display()
    );
    wait_for_signal().await;
    eprintln!("shutting down: sandboxes keep running");
    task.abort();
    svc.shutdown().await;
    Ok(0)
}

async fn wait_for_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

pub async fn mcp(settings: &Settings, args: McpArgs) -> Result<i32> {
    if let Some(url) = args.remote {
        let key = std::env::var("SANDPIT_API_KEY")
            .context("sandpit mcp --remote needs the API key in SANDPIT_API_KEY")?;
        let remote = Arc::new(sandpit_api::RemoteApi::new(&url)?);
        let caller = remote.authenticate(&key).await?;
        sandpit_mcp::serve_stdio(remote, caller).await?;
        return Ok(0);
    }
    data_dir_store_only(settings, "sandpit mcp")?;
    let owner = own(settings, owner::Role::Mcp)?;
    let svc = service(settings).await?;
    let store = svc.store();
    let account = match store.account_by_name(LOCAL_ACCOUNT).await? {
        Some(a) => a,
        None => {
            let a =
                admin::create_account(store, &settings.service, LOCAL_ACCOUNT, 1_000_000.0).await?;
            store
                .account(&a.id)
                .await?
                .context("the local account vanished")?
        }
    };
    let caller = Caller::new(account.id, "sandpit mcp");
    let api: Arc<dyn SandboxApi> = svc.clone();
    let served = sandpit_mcp::serve_stdio(api, caller).await;
    svc.shutdown().await;
    // The client went away; sandboxes stay until they expire, and someone
    // must be there to expire them. The reaper waits for this process's
    // ownership of the data directory, dropped here.
    spawn_reaper(settings);
    drop(owner);
    served?;
    Ok(0)
}

/// Start a detached `sandpit reap` that expires this data directory's
/// sandboxes and exits when none is left.
fn spawn_reaper(settings: &Settings) {
    use std::os::unix::process::CommandExt;
    let Ok(exe) = std::env::current_exe() else {
        return;
    };
    let mut cmd = std::process::Command::new(exe);
    cmd.arg("--data-dir")
        .arg(&settings.data_dir)
        .arg("--images-dir")
        .arg(&settings.images_dir);
    if let Some(c) = &settings.config_file {
        cmd.arg("--config").arg(c);
    }
    cmd.arg("reap")
        .env_remove("SANDPIT_DATABASE_URL")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    // SAFETY: setsid is async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    if let Err(e) = cmd.spawn() {
        tracing::warn!("could not start the reaper: {e}");
    }
}

/// `sandpit reap`: expire sandboxes until none is live, then exit.
///
/// It stands in for a server: a `serve` or `mcp` that starts on the data
/// directory stops it (SIGTERM) and takes over (see [`owner`]).
pub async fn reap(settings: &Settings) -> Result<i32> {
    data_dir_store_only(settings, "sandpit reap")?;
    private_dir(&settings.data_dir)?;
    let dir = settings.data_dir.clone();
    let acquired =
        tokio::task::spawn_blocking(move || owner::acquire(&dir, owner::Role::Reap)).await??;
    let owner::Acquired::Owner(_owner) = acquired else {
        return Ok(0);
    };
    let svc = service_with(settings, false).await?;
    loop {
        if svc
            .store()
            .live_sandboxes(&svc.config().host_name)
            .await?
            .is_empty()
        {
            return Ok(0);
        }
        tokio::select! {
            _ = tokio::time::sleep(std::time::Duration::from_secs(5)) => {}
            _ = wait_for_signal() => return Ok(0),
        }
    }
}

/// The node API's view of this member's node: its name, epoch, VMs and
/// the starts it records.
struct ServedNode {
    svc: Arc<Service>,
    starts: Arc<sandpit_host::recording::RecordedStarts>,
}

#[async_trait::async_trait]
impl sandpit_node::NodeState for ServedNode {
    fn name(&self) -> &str {
        &self.svc.config().host_name
    }
    fn epoch(&self) -> Option<i64> {
        self.svc.cluster_epoch()
    }
    fn machines(&self) -> Arc<dyn sandpit_host::machines::Machines> {
        self.starts.machines()
    }
    async fn start(
        &self,
        id: &str,
        size: &str,
        snapshot: Option<&str>,
        expires_at: time::OffsetDateTime,
        egress: sandpit_runtime::Egress,
        volumes: Vec<sandpit_host::machines::VmVolume>,
    ) -> Result<sandpit_host::machines::Started, sandpit_runtime::RuntimeError> {
        self.starts
            .start(id, size, snapshot, expires_at, egress, volumes)
            .await
    }
}

/// The name every metric sample carries as `node`: the member's name on a
/// shared database, else this machine's host name.
fn node_label(settings: &Settings) -> Result<String> {
    match settings.database_url {
        Some(_) => Ok(settings.service.host_name.clone()),
        None => host_name(),
    }
}

/// This machine's host name (what `hostname` prints).
pub(crate) fn host_name() -> Result<String> {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into buf.
    if unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } != 0 {
        return Err(std::io::Error::last_os_error()).context("reading the host name");
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    let name = String::from_utf8_lossy(&buf[..end]).into_owned();
    if name.is_empty() {
        bail!("this machine has no host name: give serve --name");
    }
    Ok(name)
}

/// This process's ownership of the data directory's VMs (see [`owner`]).
pub fn own(settings: &Settings, role: owner::Role) -> Result<owner::Ownership> {
    private_dir(&settings.data_dir)?;
    match owner::acquire(&settings.data_dir, role)? {
        owner::Acquired::Owner(o) => Ok(o),
        owner::Acquired::NotNeeded => bail!("the data directory is owned by another process"),
    }
}
