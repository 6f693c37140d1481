//! `sandpit`: the command line of Sandpit. It parses the arguments and
//! calls what runs them: the server (`sandpit-server`), the benchmarks
//! (`sandpit-bench`), the local and remote sandbox commands and the
//! operator's commands here.
//!
//! Errors are `anyhow` in the program's own crates (this one, the server's
//! and the bench's) and typed in the libraries under them: each command
//! prints the whole error chain once, on stderr, and exits non-zero.

mod doctor;
mod events;
mod nodes;
mod operator;
mod sandbox;
mod secret;
mod shell;
mod template;
mod volume;
mod webhook;

use anyhow::Result;
use clap::{Parser, Subcommand};
use sandpit_server::{images, serve, settings};
use std::path::PathBuf;

/// The commit this binary was built from (`unknown` outside a checkout,
/// unless the build's environment named it in `SANDPIT_COMMIT`; see
/// build.rs).
const COMMIT: &str = env!("SANDPIT_COMMIT");

/// The version and the commit, as `sandpit --version` prints them.
const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("SANDPIT_COMMIT"),
    ")"
);

#[derive(Parser)]
#[command(
    name = "sandpit",
    version = VERSION,
    about = "Real Linux VMs that AI agents can break"
)]
struct Cli {
    /// Where images, disks and state live [default: /var/lib/sandpit for root,
    /// ~/.local/share/sandpit otherwise]
    #[arg(long, global = true, env = "SANDPIT_DATA_DIR")]
    data_dir: Option<PathBuf>,
    /// Where guest images are cached [default: DATA_DIR/images]
    #[arg(long, global = true, env = "SANDPIT_IMAGES_DIR")]
    images_dir: Option<PathBuf>,
    /// TOML config file (sizes, network policy, accelerator, limits)
    #[arg(long, global = true, env = "SANDPIT_CONFIG")]
    config: Option<PathBuf>,
    /// The control plane's database for serve and the operator commands:
    /// postgres://USER:PASSWORD@HOST/DB to share one between machines
    /// [default: the SQLite file DATA_DIR/sandpit.db]
    #[arg(long, global = true, env = "SANDPIT_DATABASE_URL", value_name = "URL")]
    database: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Guest images
    Image {
        #[command(subcommand)]
        command: ImageCommand,
    },
    /// Sandboxes running on this machine; snapshots, fork and restore on a
    /// server (--url, SANDPIT_API_KEY)
    Sandbox {
        #[command(subcommand)]
        command: sandbox::SandboxCommand,
    },
    /// Templates on a server: build one from a Dockerfile (--url,
    /// SANDPIT_API_KEY), list, show, delete; publish one (operator)
    Template {
        #[command(subcommand)]
        command: template::TemplateCommand,
    },
    /// Secrets on a server (--url, SANDPIT_API_KEY): set (the value from
    /// stdin), list, delete; sandboxes use them without ever holding them
    Secret {
        #[command(subcommand)]
        command: secret::SecretCommand,
    },
    /// Volumes on a server (--url, SANDPIT_API_KEY): create, list, resize,
    /// delete; storage that outlives sandboxes
    Volume {
        #[command(subcommand)]
        command: volume::VolumeCommand,
    },
    /// The account's sandbox events on a server (--url, SANDPIT_API_KEY):
    /// when, what, which sandbox, who and why, a line each; --follow for
    /// new ones as they come
    Events(events::EventsArgs),
    /// Webhooks on a server (--url, SANDPIT_API_KEY): create one for the
    /// account's events (its secret shown once), list, get, delete; a
    /// webhook's deliveries, and redeliver one
    Webhook {
        #[command(subcommand)]
        command: webhook::WebhookCommand,
    },
    /// Run the control plane: REST /v1 and MCP (Streamable HTTP) at /v1/mcp
    Serve(serve::ServeArgs),
    /// MCP over stdio: VMs on this machine for a local account, or --remote
    Mcp(serve::McpArgs),
    /// Run this machine's VMs for a cluster on PostgreSQL (no public API:
    /// `serve --no-vms` replicas reach them over mutual TLS); or drain,
    /// undrain and list the cluster's nodes
    Node(NodeCli),
    /// Accounts of the control plane in the data directory
    Account {
        #[command(subcommand)]
        command: operator::AccountCommand,
    },
    /// API keys
    Key {
        #[command(subcommand)]
        command: operator::KeyCommand,
    },
    /// Prepaid credit
    Credit {
        #[command(subcommand)]
        command: operator::CreditCommand,
    },
    /// Invitations to sign up on the dashboard (`[signup] mode = "invite"`)
    Invite {
        #[command(subcommand)]
        command: operator::InviteCommand,
    },
    /// The certificates of machines that share a database (mutual TLS)
    Cluster {
        #[command(subcommand)]
        command: ClusterCommand,
    },
    /// (internal) expire this data directory's sandboxes until none is left
    #[command(hide = true)]
    Reap,
    /// Check this host: KVM, QEMU, passt, nftables, KSM, preview names,
    /// the guests' DNS, disk, memory, the data directory, the clock (exit
    /// status 1 when something must be fixed)
    Doctor(doctor::DoctorArgs),
    /// Create a sandbox, run commands in it, move a file, destroy it
    Demo,
    /// Measure create, exec and file-transfer speed and idle memory; print
    /// medians (`bench load`: many MCP clients against a running server)
    Bench(sandpit_bench::BenchArgs),
}

/// `sandpit node` runs a node; `sandpit node drain|undrain|list` acts on
/// the cluster's nodes.
#[derive(clap::Args)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
struct NodeCli {
    #[command(subcommand)]
    command: Option<nodes::NodeCommand>,
    #[command(flatten)]
    run: serve::NodeArgs,
}

#[derive(Subcommand)]
enum ClusterCommand {
    /// Make the cluster's certificate authority in DIR (ca.pem, ca.key)
    Init { dir: PathBuf },
    /// Issue NAME.pem and NAME.key in DIR from its CA, for a member named
    /// NAME (a node, a replica, or both) reached at the --host names or
    /// addresses
    Issue {
        dir: PathBuf,
        name: String,
        #[arg(long = "host")]
        hosts: Vec<String>,
    },
}

#[derive(Subcommand)]
enum ImageCommand {
    /// Build the guest image if it is missing or its recipe changed
    Build {
        /// The static sandpit-agent binary to put in the image
        #[arg(long)]
        agent: Option<PathBuf>,
    },
}

fn main() {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("SANDPIT_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .init();
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let code = match rt.block_on(run(cli)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            1
        }
    };
    std::process::exit(code);
}

async fn run(cli: Cli) -> Result<i32> {
    let mut settings =
        settings::Settings::load(cli.data_dir, cli.images_dir, cli.config.as_deref())?;
    settings.database_url = cli.database.filter(|u| !u.is_empty());
    settings.service.commit = COMMIT.into();
    match cli.command {
        Command::Image {
            command: ImageCommand::Build { agent },
        } => {
            let dir = settings.images_dir.clone();
            let img = tokio::task::spawn_blocking(move || images::build(&dir, agent.as_deref()))
                .await??;
            eprintln!(
                "guest image {} ready (kernel {})",
                img.id, img.kernel_release
            );
            println!("{}", img.dir.display());
            Ok(0)
        }
        Command::Sandbox { command } => sandbox::run(&settings, command).await,
        Command::Template { command } => template::run(&settings, command).await,
        Command::Secret { command } => secret::run(command).await,
        Command::Volume { command } => volume::run(command).await,
        Command::Events(args) => events::run(args).await,
        Command::Webhook { command } => webhook::run(command).await,
        Command::Serve(a) => serve::serve(&settings, a).await,
        Command::Mcp(a) => serve::mcp(&settings, a).await,
        Command::Node(NodeCli {
            command: Some(command),
            ..
        }) => nodes::run(&settings, command).await,
        Command::Node(NodeCli { run, command: None }) => serve::node(&settings, run).await,
        Command::Account { command } => operator::account(&settings, command).await,
        Command::Key { command } => operator::key(&settings, command).await,
        Command::Credit { command } => operator::credit(&settings, command).await,
        Command::Invite { command } => operator::invite(&settings, command).await,
        Command::Cluster { command } => cluster(command),
        Command::Reap => serve::reap(&settings).await,
        Command::Doctor(args) => {
            tokio::task::spawn_blocking(move || doctor::run(&settings, args)).await?
        }
        Command::Demo => sandbox::demo(&settings).await,
        Command::Bench(args) => sandpit_bench::run(&settings, args).await,
    }
}

fn cluster(cmd: ClusterCommand) -> Result<i32> {
    match cmd {
        ClusterCommand::Init { dir } => {
            sandpit_node::init_ca(&dir)?;
            eprintln!(
                "cluster CA made: {0}/ca.pem (give it to every member) and {0}/ca.key \
                 (keep it where you issue certificates, not on the members)",
                dir.display()
            );
        }
        ClusterCommand::Issue { dir, name, hosts } => {
            let id = sandpit_node::issue(&dir, &name, &hosts)?;
            eprintln!(
                "issued {} and {} for {name}: copy them and {} to that member",
                id.cert.display(),
                id.key.display(),
                id.ca.display()
            );
        }
    }
    Ok(0)
}
