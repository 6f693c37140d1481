//! One QEMU process per sandbox: launch, find again, health, destroy.
//!
//! Every VM owns one directory, `<data_dir>/vms/<id>/`, and nothing outside
//! it: the copy-on-write overlay disk, the agent and QMP sockets, the console
//! log, passt's socket and `vm.json`. Destroy kills the processes and removes
//! the directory, so "nothing leaks" is checkable by listing one folder.
//!
//! QEMU runs in its own session (it outlives the CLI call that started it),
//! under seccomp (`-sandbox on`), and, when the runtime is root, as an
//! unprivileged uid of its own after start-up (each VM a different uid), so a
//! compromised QEMU cannot signal another sandbox's QEMU or open its files.

pub mod console;
pub mod expiry;
pub mod give_way;
pub mod guard;
mod host_disk;
mod launch;
pub mod net;
pub mod process;
mod proxies;
pub mod qmp;
mod templates;
pub mod volumes;

use launch::log_guest_resolver;
pub(crate) use launch::wait_for_socket;

use crate::channel::AgentClient;
use crate::config::{RuntimeConfig, SizeSpec};
use crate::egress::broker::Broker;
use crate::host::accel::Accel;
use crate::image::GuestImage;
use crate::save::template::{self, Template, TemplateInputs};
use crate::{Result, RuntimeError};
use process::Priority;
use qmp::Qmp;
use rand::RngCore;
use sandpit_protocol::{GuestConfig, NetworkConfig, ProxyConfig, AGENT_PORT_NAME};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};
use time::OffsetDateTime;

/// What the runtime remembers about a VM (`vm.json`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VmRecord {
    pub id: String,
    pub size: String,
    pub resources: SizeSpec,
    pub accel: Accel,
    pub image_id: String,
    pub kernel_release: String,
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: OffsetDateTime,
    #[serde(with = "time::serde::rfc3339::option", default)]
    pub ready_at: Option<OffsetDateTime>,
    pub qemu_pid: u32,
    #[serde(default)]
    pub passt_pid: Option<u32>,
    /// passt's start time, which with its pid identifies it (see `process`).
    #[serde(default)]
    pub passt_started: Option<u64>,
    /// The unprivileged uid QEMU runs as (when the runtime is root).
    #[serde(default)]
    pub qemu_uid: Option<u32>,
    /// Free-form labels of the caller (name, expiry, owner...).
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    /// The snapshot template it was restored from; `None`: booted cold.
    #[serde(default)]
    pub template: Option<String>,
    /// Its expiry watchdog's pid and start time (see `expiry`).
    #[serde(default)]
    pub watchdog: Option<(u32, u64)>,
    /// The file name of the disk overlay it writes to, in its directory,
    /// once a save froze the first one (`None`: `disk.qcow2`).
    #[serde(default)]
    pub disk: Option<String>,
    /// The guest's /etc/machine-id (`None`: from before it was recorded).
    #[serde(default)]
    pub machine_id: Option<String>,
    /// The saved RAM file (in `<data_dir>/layers`) the guest's memory was
    /// last made equal to, by a start from a save or a save: the next save
    /// stands on it (see `ram_pages`), and the layers' collection keeps it.
    #[serde(default)]
    pub ram_base: Option<String>,
    /// The saved RAM file whose image the guest's memory maps (a start
    /// from a save maps the save's image, see `ram_image`): its pages are
    /// the VM's without being written, so a save reads them too, and the
    /// layers' collection keeps the file. `None`: the template's RAM file.
    #[serde(default)]
    pub ram_mapped: Option<String>,
    /// What the guest may reach, as last set (absent: from before it was
    /// recorded, when every VM had the operator's network). Its secrets'
    /// values are never written here (see `Broker::without_values`).
    #[serde(default, serialize_with = "Egress::serialize_without_values")]
    pub egress: Egress,
    /// The volumes in its slots (slot N the Nth), mounted in the guest
    /// (see `volumes`).
    #[serde(default)]
    pub volumes: Vec<volumes::VmVolume>,
}

impl VmRecord {
    /// The marker in QEMU's command line that identifies this VM's process.
    pub fn qemu_marker(&self) -> String {
        qemu_marker(&self.id)
    }
}

fn qemu_marker(id: &str) -> String {
    format!("sandpit-vm-{id}")
}

/// Is the VM running, or why not?
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "lowercase")]
pub enum VmState {
    Running,
    Exited { cause: String },
}

/// The name of a VM's agent socket in its directory. QEMU runs in the VM's
/// directory and binds its sockets by these names, relative to it, and the
/// host connects through a descriptor of the directory
/// (`channel::short_socket_name`): a socket's address holds at most 107
/// bytes, and no socket path depends on the data directory's length. (A
/// VM started by a release that bound them by their whole path has them
/// at the same place.)
pub const AGENT_SOCKET: &str = "agent.sock";
/// The name of a VM's QMP socket in its directory (see [`AGENT_SOCKET`]).
pub const QMP_SOCKET: &str = "qmp.sock";

/// Bind a unix socket in `dir` and connect to it the way the runtime
/// reaches QEMU's sockets (through a descriptor of the directory): whether
/// sockets work there, whatever the length of its path (`sandpit doctor`).
pub fn probe_socket(dir: &Path) -> std::io::Result<()> {
    let path = dir.join(format!(".socket-probe-{}", std::process::id()));
    let (_dir, short) = crate::channel::short_socket_name(&path)?;
    let _ = std::fs::remove_file(&path);
    let listener = std::os::unix::net::UnixListener::bind(&short)?;
    let connected = std::os::unix::net::UnixStream::connect(&short);
    drop(listener);
    let _ = std::fs::remove_file(&path);
    connected.map(drop)
}

/// The files of one VM.
#[derive(Debug, Clone)]
pub struct VmPaths {
    pub dir: PathBuf,
}

impl VmPaths {
    pub fn record(&self) -> PathBuf {
        self.dir.join("vm.json")
    }
    pub fn disk(&self) -> PathBuf {
        self.dir.join("disk.qcow2")
    }
    /// The overlay the VM writes to now (see [`VmRecord::disk`]).
    pub fn active_disk(&self, record: &VmRecord) -> PathBuf {
        match &record.disk {
            Some(name) => self.dir.join(name),
            None => self.disk(),
        }
    }
    /// The agent's socket: QEMU binds [`AGENT_SOCKET`] in its working
    /// directory, this one (see [`AGENT_SOCKET`]).
    pub fn agent_socket(&self) -> PathBuf {
        self.dir.join(AGENT_SOCKET)
    }
    /// QMP's socket, bound like the agent's.
    pub fn qmp_socket(&self) -> PathBuf {
        self.dir.join(QMP_SOCKET)
    }
    pub fn console(&self) -> PathBuf {
        self.dir.join("console.log")
    }
    pub fn qemu_log(&self) -> PathBuf {
        self.dir.join("qemu.log")
    }
    /// The uid the VM's QEMU and passt run as, written before the host's
    /// guard for that uid goes in: a start that dies before its record is
    /// written leaves the guard found by it (see `VmManager::destroy`).
    pub fn uid_file(&self) -> PathBuf {
        self.dir.join("uid")
    }
    /// The argument only this VM's passt has on its command line.
    fn passt_marker(&self) -> String {
        self.dir.join("passt.log").display().to_string()
    }
}

/// The descriptor at which the QEMU of a VM started from a save holds the
/// save's RAM image (after `net::NET_FD` and `expiry::QEMU_LIFE_FD`).
const RAM_IMAGE_FD: i32 = 5;

/// What the host set up for a QEMU before starting it.
#[derive(Debug, Clone, Copy)]
struct Given {
    /// passt's socket, at `net::NET_FD`.
    network: bool,
    /// The uid QEMU runs as, when not ours.
    run_as: Option<u32>,
    /// A save's RAM image, at [`RAM_IMAGE_FD`] (see `ram_image`).
    ram_image: bool,
}

/// How long a template VM may run if its builder dies.
const TEMPLATE_BUILD_LEASE: time::Duration = time::Duration::minutes(10);

/// Owns the VMs of one data directory.
pub struct VmManager {
    config: RuntimeConfig,
    image: GuestImage,
    accel: Accel,
    deny: Vec<String>,
    /// The operator's proxy, resolved at start (see `net::resolve_proxy`).
    proxy: Option<ProxyConfig>,
    /// The extra CA certificates every guest trusts, read at start.
    ca_certificates: Vec<String>,
    qemu_version: QemuVersion,
    give_way: give_way::GiveWay,
    /// The images of saves' guest RAM that VMs start from (see `ram_image`).
    ram_images: crate::save::ram_image::RamImages,
    /// The egress proxies of VMs whose lists name hosts (see `proxies`).
    proxies: std::sync::Mutex<std::collections::HashMap<String, crate::egress::proxy::EgressProxy>>,
    /// What the egress proxies trust when they send a brokered secret on:
    /// the host's trust store and `[network] upstream_ca_certificates`.
    upstream_tls: std::sync::Arc<tokio_rustls::rustls::ClientConfig>,
}

/// QEMU's version: its `--version` line and the numbers that gate features.
#[derive(Debug, Clone)]
pub struct QemuVersion {
    /// Its first line, as printed.
    pub line: String,
    pub major: u32,
    pub minor: u32,
}

/// The QEMU series whose `x-query-ramblock` table the save path reads
/// (the series the tests run; see [`QemuVersion::saves_running_vms`]).
pub const SAVES_KNOWN_MAJOR: u32 = 10;

impl QemuVersion {
    /// Restoring needs `file:` migration and `rom=` on RAM files (QEMU 8.2).
    pub fn restores_templates(&self) -> bool {
        (self.major, self.minor) >= (8, 2)
    }

    /// Saving a running VM (a snapshot, a fork, a pause, idle sleep) finds
    /// its guest RAM in QEMU's memory through `x-query-ramblock`, an
    /// unstable command whose text table is parsed
    /// ([`crate::save::ram_pages::parse_ramblocks`]); a table of another
    /// form could be misread into a wrong save. So saves run only on the
    /// series known to print it as parsed, and elsewhere are refused with
    /// this reason (restoring templates, which reads no table, still runs).
    pub fn saves_running_vms(&self) -> std::result::Result<(), String> {
        if self.major == SAVES_KNOWN_MAJOR && self.restores_templates() {
            return Ok(());
        }
        Err(format!(
            "saving a running VM reads QEMU's unstable `x-query-ramblock` table, whose form is \
             known for QEMU {SAVES_KNOWN_MAJOR}.x only, and this is {}: snapshots, forks and \
             pauses are refused (install QEMU {SAVES_KNOWN_MAJOR} from bookworm-backports: \
             scripts/install-deps.sh)",
            self.line
        ))
    }
}

/// How a VM comes to life.
pub(crate) enum Start<'a> {
    /// Boot the kernel.
    Cold,
    /// Boot the kernel with guest RAM in the shared file `mem`: a template
    /// in the making.
    Template { mem: &'a Path },
    /// Restore a template's saved state.
    Restore(&'a Template),
    /// Restore a running VM's saved state (see `saved`).
    Saved(&'a crate::save::saved::SavedVm),
}

/// How long a running guest may take to apply a new egress: its `nft`
/// and `ip` runs, a few hundred milliseconds under emulation, far longer on
/// a host this loaded.
const EGRESS_CHANGE_TIMEOUT: Duration = Duration::from_secs(60);

/// What to create.
#[derive(Debug, Clone)]
pub struct CreateVm {
    pub id: String,
    pub size: String,
    pub metadata: BTreeMap<String, String>,
    /// When the VM is killed and removed even if no process of ours is left
    /// to do it (see `expiry`); [`VmManager::set_expiry`] moves it later.
    pub expires_at: OffsetDateTime,
    /// What the guest may reach outside itself.
    pub egress: Egress,
    /// The volumes mounted in the guest when the VM is handed over (see
    /// [`VmManager::mount_volumes`]).
    pub volumes: Vec<volumes::VmVolume>,
}

/// What one guest may reach outside itself, on top of what the operator's
/// `[network]` allows every guest. Each start of a VM is told its egress
/// (the caller keeps it: a restore, a resume or a fork starts a new QEMU),
/// and [`VmManager::set_egress`] changes a running VM's.
///
/// Two lists of IPv4 prefixes (`203.0.113.0/24`, or an address alone):
/// `allow` lets a destination through before `deny` refuses it, as E2B's
/// `allowOut` and `denyOut` do, and neither reaches past the operator's
/// deny list (the host's addresses, the private ranges, metadata), which is
/// applied first. Blocked (nothing allowed, `0.0.0.0/0` denied) is E2B's
/// `allow_internet_access=False`: the guest then has no name server
/// either, so a lookup fails at once instead of timing out.
///
/// Enforced by the host's guard on the VM's passt (see `guard`), which a
/// guest that became root cannot lift: a refused connect is reset at once.
/// The guest's own filter repeats what it can express (a deny list with no
/// allow list); the agent's channel is not the network, so commands, files
/// and preview URLs work whatever the egress.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Egress {
    /// Let through before `deny` (never past the operator's deny list).
    pub allow: Vec<String>,
    /// Refused, after `allow`.
    pub deny: Vec<String>,
    /// The secrets its egress proxy puts into its HTTPS requests (see
    /// [`crate::egress::broker`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub broker: Option<Broker>,
}

impl Egress {
    /// The deny list that blocks everything (IPv6 is off in every guest).
    pub const EVERYTHING: &'static str = "0.0.0.0/0";

    /// Whatever the operator's `[network]` allows.
    pub fn open() -> Egress {
        Egress::default()
    }

    /// Nothing beyond the guest itself.
    pub fn blocked() -> Egress {
        Egress {
            deny: vec![Egress::EVERYTHING.into()],
            ..Egress::default()
        }
    }

    /// Nothing allowed and everything denied.
    pub fn is_blocked(&self) -> bool {
        self.allow.is_empty() && self.deny.iter().any(|d| d == Egress::EVERYTHING)
    }

    /// The lists checked: each entry an IPv4 address or prefix, written as
    /// nft and the agent read it (`a.b.c.d` or `a.b.c.d/n`, the address
    /// part with no host bits past the prefix), or a host name rule
    /// (`example.com`, `*.example.com`; see [`crate::egress::names`]).
    pub fn checked(allow: Vec<String>, deny: Vec<String>) -> std::result::Result<Egress, String> {
        for entry in allow.iter().chain(&deny) {
            if !crate::egress::rules::looks_like_an_address(entry) {
                crate::egress::names::NameRule::parse(entry)?;
                continue;
            }
            let (address, prefix) = match entry.split_once('/') {
                Some((a, p)) => (a, Some(p)),
                None => (entry.as_str(), None),
            };
            let address: std::net::Ipv4Addr = address
                .parse()
                .map_err(|_| format!("{entry:?} is not an IPv4 address or prefix"))?;
            if let Some(p) = prefix {
                let bits: u32 = p
                    .parse()
                    .ok()
                    .filter(|b| *b <= 32)
                    .ok_or_else(|| format!("{entry:?}: a prefix length is 0 to 32"))?;
                let mask = u32::MAX.checked_shl(32 - bits).unwrap_or(0);
                if u32::from(address) & !mask != 0 {
                    return Err(format!(
                        "{entry:?} has bits set past its prefix (the network is {}/{bits})",
                        std::net::Ipv4Addr::from(u32::from(address) & mask)
                    ));
                }
            }
        }
        Ok(Egress {
            allow,
            deny,
            broker: None,
        })
    }

    /// The same with `broker`'s secrets (checked).
    pub fn with_broker(self, broker: Broker) -> std::result::Result<Egress, String> {
        Ok(Egress {
            broker: Some(broker.checked()?),
            ..self
        })
    }

    /// As a VM's record on disk holds it: its secrets without their values.
    fn serialize_without_values<S: serde::Serializer>(
        egress: &Egress,
        s: S,
    ) -> std::result::Result<S::Ok, S::Error> {
        Egress {
            broker: egress.broker.as_ref().map(Broker::without_values),
            ..egress.clone()
        }
        .serialize(s)
    }

    /// Whether its egress proxy has secrets to broker.
    pub fn brokers(&self) -> bool {
        self.broker.as_ref().is_some_and(Broker::is_usable)
    }

    /// Whether the VM needs an egress proxy: its lists name hosts, or it
    /// has secrets (whose hosts the proxy recognises by name).
    pub fn needs_proxy(&self) -> bool {
        self.has_names() || self.broker.is_some()
    }

    /// The entries of `list` that are addresses or prefixes: what nft and
    /// the guest's filter hold.
    fn prefixes(list: &[String]) -> Vec<String> {
        list.iter()
            .filter(|e| crate::egress::rules::looks_like_an_address(e))
            .cloned()
            .collect()
    }

    /// The allow list's addresses and prefixes.
    pub fn allow_prefixes(&self) -> Vec<String> {
        Egress::prefixes(&self.allow)
    }

    /// The deny list's addresses and prefixes.
    pub fn deny_prefixes(&self) -> Vec<String> {
        Egress::prefixes(&self.deny)
    }

    /// Whether an entry names a host: then the host's egress proxy looks at
    /// the VM's connections to ports 80 and 443 (see [`crate::egress`]).
    pub fn has_names(&self) -> bool {
        self.allow
            .iter()
            .chain(&self.deny)
            .any(|e| !crate::egress::rules::looks_like_an_address(e))
    }

    /// The lists as the egress proxy decides by them (checked lists always
    /// make rules; lists that do not are taken to deny everything).
    pub fn rules(&self) -> crate::egress::rules::Rules {
        crate::egress::rules::Rules::new(&self.allow, &self.deny).unwrap_or_else(|_| {
            crate::egress::rules::Rules::new(&[], &[Egress::EVERYTHING.to_string()])
                .expect("a prefix")
        })
    }
}

/// What a VM's record (and the node API) held before egress had lists:
/// `"allowed"` or `"blocked"`; read as the lists they meant.
#[derive(Deserialize)]
#[serde(untagged)]
enum EgressAsStored {
    Named(NamedEgress),
    Lists {
        #[serde(default)]
        allow: Vec<String>,
        #[serde(default)]
        deny: Vec<String>,
        #[serde(default)]
        broker: Option<Broker>,
    },
}

#[derive(Deserialize)]
#[serde(rename_all = "snake_case")]
enum NamedEgress {
    Allowed,
    Blocked,
}

impl<'de> Deserialize<'de> for Egress {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        Ok(match EgressAsStored::deserialize(d)? {
            EgressAsStored::Named(NamedEgress::Allowed) => Egress::open(),
            EgressAsStored::Named(NamedEgress::Blocked) => Egress::blocked(),
            EgressAsStored::Lists {
                allow,
                deny,
                broker,
            } => Egress {
                allow,
                deny,
                broker,
            },
        })
    }
}

/// A running VM and a live connection to its agent.
pub struct Vm {
    pub record: VmRecord,
    pub paths: VmPaths,
    pub agent: AgentClient,
    /// Where this process's start of the VM spent its time (`None` for a
    /// VM it found running).
    pub start_times: Option<StartTimes>,
}

/// Where a start spends its time: the set-up before QEMU runs (disk
/// overlay, passt, watchdog), then, counted from QEMU's spawn, its saved
/// state loaded (a restore), the agent's first answer, and the guest
/// configured. What a restore costs under emulation is mostly in the last
/// two, where the new QEMU translates the guest's code afresh; the bench
/// prints them so that floor is measured, not guessed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StartTimes {
    pub set_up: Duration,
    pub state_loaded: Duration,
    pub agent_answered: Duration,
    pub configured: Duration,
}

impl VmManager {
    /// A manager for `config.data_dir` booting `image`.
    pub fn new(config: RuntimeConfig, image: GuestImage) -> Result<VmManager> {
        crate::config::check_data_dir(&config.data_dir).map_err(RuntimeError::Launch)?;
        let accel = crate::host::accel::choose(config.accel);
        std::fs::create_dir_all(config.vms_dir()).map_err(RuntimeError::io(format!(
            "creating {}",
            config.vms_dir().display()
        )))?;
        let mut deny = config.network.deny.clone();
        deny.extend(
            net::host_addresses()
                .into_iter()
                .filter(|a| !a.starts_with("127.")),
        );
        if config.network.enabled && config.network.dns.is_none() {
            log_guest_resolver();
        }
        let proxy = match (&config.network.proxy, config.network.enabled) {
            (Some(url), true) => Some(net::resolve_proxy(url, &config.network.no_proxy)?),
            _ => None,
        };
        let ca_certificates = net::read_ca_certificates(&config.network.ca_certificates)?;
        let upstream_tls = crate::egress::terminate::client_config(&net::read_ca_certificates(
            &config.network.upstream_ca_certificates,
        )?);
        let qemu_version = qemu_version(&config.qemu_binary)?;
        if config.snapshots && qemu_version.restores_templates() {
            if let Err(why) = qemu_version.saves_running_vms() {
                tracing::warn!("{why}");
            }
        }
        if config.ksm {
            crate::host::ksm::ensure_running_logged();
        }
        if config.network.enabled && nix::unistd::geteuid().is_root() {
            guard::sweep(guard::SWEEP_AFTER);
        }
        if nix::unistd::geteuid().is_root() {
            // VMs' QEMUs (each its own uid) reopen their disks by path, so
            // they must be able to walk (not list) the way there.
            for dir in [&config.data_dir, &config.vms_dir()] {
                allow_traverse(dir);
            }
        }
        let manager = VmManager {
            config,
            image,
            accel,
            deny,
            proxy,
            ca_certificates,
            qemu_version,
            give_way: Default::default(),
            ram_images: Default::default(),
            proxies: Default::default(),
            upstream_tls,
        };
        manager.prepare_saves()?;
        Ok(manager)
    }

    /// Live work (a command, a file transfer, a create someone waits for) is
    /// running: VMs being started at [`Priority::Background`] stop until the
    /// guard drops, within bounds (see [`crate::vm::give_way`]).
    pub fn hold_background(&self) -> give_way::Held {
        self.give_way.hold()
    }

    /// The background starts in flight and those stopped now.
    pub fn background_starts(&self) -> (usize, usize) {
        (self.give_way.starting(), self.give_way.stopped())
    }

    pub fn accel(&self) -> Accel {
        self.accel
    }

    pub fn config(&self) -> &RuntimeConfig {
        &self.config
    }

    /// The QEMU its VMs run, and what that version can do.
    pub fn qemu(&self) -> &QemuVersion {
        &self.qemu_version
    }

    pub fn image(&self) -> &GuestImage {
        &self.image
    }

    /// The files of VM `id` (which may not exist).
    pub fn paths(&self, id: &str) -> VmPaths {
        VmPaths {
            dir: self.config.vms_dir().join(id),
        }
    }

    /// Start a new VM and wait until its agent is configured and answering:
    /// restored from the size's snapshot template when there is one, booted
    /// cold otherwise, or when the restore fails (the template is then
    /// discarded, to be rebuilt). A restore that only took too long is
    /// [`RuntimeError::HostFull`], the template kept. On any failure nothing
    /// of it is left behind.
    pub async fn create(&self, req: CreateVm) -> Result<Vm> {
        self.create_with_priority(req, Priority::Normal).await
    }

    /// [`VmManager::create`] with QEMU at CPU `priority`: `Background` for
    /// VMs made ahead of demand ([`process::set_priority`] them to `Normal`
    /// when they go live). A background start also runs one command to warm
    /// the VM up, and gives way to live work ([`VmManager::hold_background`]).
    pub async fn create_with_priority(&self, req: CreateVm, priority: Priority) -> Result<Vm> {
        validate_id(&req.id)?;
        let size = self.config.size(&req.size)?;
        self.check_disk_reserve()?;
        if let Some(template) = self.template(&req.size) {
            match self
                .start(&req, size, Start::Restore(&template), priority)
                .await
            {
                Ok(vm) => return Ok(vm),
                // Slow, not broken: on a host this busy (measured: a load
                // of 80 on 2 cores with 400 sandboxes filling up) a cold
                // boot would be slower still, and discarding a good
                // template would add its rebuild to the load. The create
                // is refused as one the host has no room for now.
                Err(RuntimeError::BootTimeout { secs, .. }) => {
                    tracing::warn!(
                        id = %req.id,
                        template = %template.key,
                        "restoring from the snapshot template took over {secs} s: the host is too busy"
                    );
                    return Err(RuntimeError::HostFull(format!(
                        "this host is too busy to start a sandbox now (a restore took over {secs} s)"
                    )));
                }
                Err(e) => {
                    tracing::warn!(
                        id = %req.id,
                        template = %template.key,
                        "restoring from the snapshot template failed, falling back to a cold boot: {e}"
                    );
                    self.discard_template(&template);
                }
            }
        }
        self.start_cold(&req, size, priority).await
    }

    /// [`VmManager::start`] of a cold boot, tried once more if it did not
    /// come up within its bound: under emulation a guest kernel now and
    /// then hangs early in its boot with nothing on its console (seen in CI
    /// about once in a few hundred boots; the notes report it too), and the
    /// next boot of the same VM comes up in seconds. The first one's
    /// diagnosis is logged.
    async fn start_cold(&self, req: &CreateVm, size: SizeSpec, priority: Priority) -> Result<Vm> {
        match self.start(req, size, Start::Cold, priority).await {
            Err(e @ RuntimeError::BootTimeout { .. }) => {
                tracing::warn!(id = %req.id, "a cold boot did not come up; booting it again: {e}");
                self.start(req, size, Start::Cold, priority).await
            }
            other => other,
        }
    }

    /// Boot a new VM cold, whatever templates exist.
    pub async fn create_cold(&self, req: CreateVm) -> Result<Vm> {
        validate_id(&req.id)?;
        let size = self.config.size(&req.size)?;
        self.start_cold(&req, size, Priority::Normal).await
    }

    pub(crate) async fn start(
        &self,
        req: &CreateVm,
        size: SizeSpec,
        how: Start<'_>,
        priority: Priority,
    ) -> Result<Vm> {
        let paths = self.paths(&req.id);
        std::fs::create_dir(&paths.dir).map_err(RuntimeError::io(format!(
            "creating the VM directory {}",
            paths.dir.display()
        )))?;
        match self.boot(req, size, &paths, &how, priority).await {
            Ok(vm) => Ok(vm),
            Err(e) => {
                let e = match e {
                    e @ RuntimeError::BootTimeout { .. } => explain_boot_timeout(&paths, e).await,
                    RuntimeError::Disconnected(_) => RuntimeError::VmExited {
                        cause: format!(
                            "{}; last console lines:\n{}",
                            console::exit_cause(&paths.console(), &paths.qemu_log()),
                            console::tail_lines(&paths.console(), 30)
                        ),
                    },
                    other => other,
                };
                let _ = self.destroy(&req.id).await;
                Err(e)
            }
        }
    }
}

impl VmManager {
    /// Every VM directory on this host, with its record (oldest first).
    pub fn list(&self) -> Vec<VmRecord> {
        let mut out = Vec::new();
        let Ok(rd) = std::fs::read_dir(self.config.vms_dir()) else {
            return out;
        };
        for e in rd.flatten() {
            if let Ok(bytes) = std::fs::read(e.path().join("vm.json")) {
                if let Ok(r) = serde_json::from_slice::<VmRecord>(&bytes) {
                    out.push(r);
                }
            }
        }
        out.sort_by_key(|r| r.created_at);
        out
    }

    /// The record of VM `id`.
    pub fn record(&self, id: &str) -> Result<VmRecord> {
        validate_id(id)?;
        let bytes = std::fs::read(self.paths(id).record())
            .map_err(|_| RuntimeError::NotFound(id.to_string()))?;
        serde_json::from_slice(&bytes)
            .map_err(|e| RuntimeError::Launch(format!("corrupt vm.json of {id}: {e}")))
    }

    /// Replace the caller's metadata of VM `id`.
    pub fn set_metadata(&self, id: &str, metadata: BTreeMap<String, String>) -> Result<VmRecord> {
        let mut r = self.record(id)?;
        r.metadata = metadata;
        write_record(&self.paths(id), &r)?;
        Ok(r)
    }

    /// Change what running VM `id` (whose agent is `agent`) may reach: the
    /// host's guard first, then the guest's filter, then the record. A VM
    /// made ahead of demand gets its sandbox's egress this way when it is
    /// handed out. Setting what is set already is cheap: the guest skips a
    /// network it has.
    pub async fn set_egress(&self, id: &str, agent: &AgentClient, egress: Egress) -> Result<()> {
        let mut record = self.record(id)?;
        if record.passt_pid.is_none() {
            // No network at all: nothing to reach, nothing to block.
            record.egress = egress;
            return write_record(&self.paths(id), &record);
        }
        if let Some(uid) = record.qemu_uid {
            let redirect = self.egress_proxy(id, &egress).await?;
            let plan = self.guard_plan(&egress, redirect);
            tokio::task::spawn_blocking(move || guard::install(uid, &plan))
                .await
                .map_err(|e| RuntimeError::Launch(format!("the guard's task: {e}")))??;
        }
        let machine_id = record.machine_id.clone().unwrap_or_else(|| {
            let mut bytes = [0u8; 16];
            rand::rngs::OsRng.fill_bytes(&mut bytes);
            hex::encode(bytes)
        });
        let mut entropy = vec![0u8; 64];
        rand::rngs::OsRng.fill_bytes(&mut entropy);
        agent
            .configure(
                self.guest_config(
                    hostname_for(id),
                    machine_id.clone(),
                    Some(self.network_config(&egress)),
                    &egress,
                ),
                &entropy,
                EGRESS_CHANGE_TIMEOUT,
            )
            .await?;
        record.machine_id = Some(machine_id);
        record.egress = egress;
        write_record(&self.paths(id), &record)
    }

    /// Move VM `id`'s expiry (see [`CreateVm::expires_at`]).
    pub fn set_expiry(&self, id: &str, at: OffsetDateTime) -> Result<()> {
        validate_id(id)?;
        let paths = self.paths(id);
        if !paths.dir.exists() {
            return Err(RuntimeError::NotFound(id.to_string()));
        }
        expiry::write_expiry(&paths.dir, at)
    }

    /// When VM `id` is killed, whatever else happens (see [`CreateVm::expires_at`]).
    pub fn expiry(&self, id: &str) -> Option<OffsetDateTime> {
        expiry::read_expiry(&self.paths(id).dir)
    }

    /// Bytes VM `id`'s disk takes on the host now: the blocks its
    /// copy-on-write overlay has allocated, which is what the guest wrote
    /// (the base image, shared by every VM, is not counted). Sparse regions
    /// and discarded clusters take nothing.
    pub fn disk_use(&self, id: &str) -> Result<u64> {
        use std::os::unix::fs::MetadataExt;
        validate_id(id)?;
        let record = self.record(id)?;
        let meta = std::fs::metadata(self.paths(id).active_disk(&record))
            .map_err(|_| RuntimeError::NotFound(id.to_string()))?;
        Ok(meta.blocks() * 512)
    }

    /// Hold VM `id`'s disk writes to `bytes_per_second` (QEMU's block
    /// throttling, so the guest's writes slow down and nothing fails);
    /// `None` lifts the limit. Reads are never held.
    pub async fn limit_disk_writes(&self, id: &str, bytes_per_second: Option<u64>) -> Result<()> {
        self.qmp_bounded(id, "a disk limit", |mut qmp| async move {
            qmp.execute(
                "block_set_io_throttle",
                serde_json::json!({
                    "device": "root",
                    "bps": 0, "bps_rd": 0, "bps_wr": bytes_per_second.unwrap_or(0),
                    "iops": 0, "iops_rd": 0, "iops_wr": 0,
                }),
            )
            .await
        })
        .await
        .map(drop)
    }

    /// Running, or exited and why.
    pub fn state(&self, record: &VmRecord) -> VmState {
        let paths = self.paths(&record.id);
        console::enforce_cap(&paths.console());
        if process::alive_with_marker(record.qemu_pid, &record.qemu_marker()) {
            VmState::Running
        } else {
            VmState::Exited {
                cause: console::exit_cause(&paths.console(), &paths.qemu_log()),
            }
        }
    }

    /// Connect to the agent of a running VM.
    pub async fn attach(&self, id: &str) -> Result<Vm> {
        let record = self.record(id)?;
        if let VmState::Exited { cause } = self.state(&record) {
            return Err(RuntimeError::VmExited { cause });
        }
        let paths = self.paths(id);
        let agent = AgentClient::connect(&paths.agent_socket(), Duration::from_secs(30))
            .await
            .map_err(|e| match self.state(&record) {
                VmState::Exited { cause } => RuntimeError::VmExited { cause },
                VmState::Running => match e {
                    RuntimeError::BootTimeout { secs, .. } => RuntimeError::Disconnected(format!(
                        "the guest agent did not answer within {secs} s"
                    )),
                    other => other,
                },
            })?;
        Ok(Vm {
            record,
            paths,
            agent,
            start_times: None,
        })
    }

    /// Wait until the VM's QEMU process exits; returns why.
    pub async fn wait_exit(&self, record: &VmRecord) -> VmState {
        if let Some(fd) = process::pidfd_open(record.qemu_pid) {
            if process::alive_with_marker(record.qemu_pid, &record.qemu_marker()) {
                process::wait_pidfd(fd).await;
            }
        }
        self.state(record)
    }

    /// Kill the VM's processes and remove every file it owned. Idempotent:
    /// destroying a VM that is already gone is `NotFound`.
    pub async fn destroy(&self, id: &str) -> Result<()> {
        validate_id(id)?;
        let paths = self.paths(id);
        if !paths.dir.exists() {
            return Err(RuntimeError::NotFound(id.to_string()));
        }
        self.stop_egress_proxy(id);
        if let Ok(record) = self.record(id) {
            stop_processes(&record, &paths).await;
            if let Some(uid) = record.qemu_uid.filter(|_| self.config.network.enabled) {
                let _ = tokio::task::spawn_blocking(move || guard::remove(uid)).await;
            }
        } else {
            // A VM whose start died before its record was written: its QEMU
            // and passt are found by their command lines, its guard by the
            // uid written before it went in.
            for marker in [qemu_marker(id), paths.passt_marker()] {
                if let Some(pid) = process::find_by_marker(&marker) {
                    process::kill_and_wait(pid, &marker, Duration::from_secs(10)).await;
                }
            }
            let uid = std::fs::read_to_string(paths.uid_file())
                .ok()
                .and_then(|text| text.trim().parse::<u32>().ok());
            if let Some(uid) = uid {
                let _ = tokio::task::spawn_blocking(move || guard::remove(uid)).await;
            }
        }
        let removed = match std::fs::remove_dir_all(&paths.dir) {
            // A concurrent destroy (a command that saw this one's kill and
            // ended its sandbox too) removed it first: gone is gone.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            r => r.map_err(RuntimeError::io(format!(
                "removing {}",
                paths.dir.display()
            ))),
        };
        // The disk layers below its disk that nothing else stands on.
        self.gc_layers();
        removed
    }
}

/// Ask QEMU to quit through QMP (it closes its files itself), SIGKILL
/// whatever is left, then stop passt.
async fn stop_processes(record: &VmRecord, paths: &VmPaths) {
    // The watchdog first: it must not race us to the directory.
    if let Some((pid, started)) = record.watchdog {
        process::kill_identified(pid, started, Duration::from_secs(5)).await;
    }
    if process::alive_with_marker(record.qemu_pid, &record.qemu_marker()) {
        let quit = async {
            let mut qmp = Qmp::connect(&paths.qmp_socket()).await?;
            qmp.execute("quit", serde_json::json!({})).await
        };
        let _ = tokio::time::timeout(Duration::from_millis(500), quit).await;
    }
    process::kill_and_wait(
        record.qemu_pid,
        &record.qemu_marker(),
        Duration::from_secs(10),
    )
    .await;
    if let (Some(pid), Some(started)) = (record.passt_pid, record.passt_started) {
        process::kill_identified(pid, started, Duration::from_secs(5)).await;
    }
}

pub(crate) fn write_record(paths: &VmPaths, record: &VmRecord) -> Result<()> {
    let tmp = paths.dir.join("vm.json.tmp");
    std::fs::write(&tmp, serde_json::to_vec_pretty(record).expect("json"))
        .map_err(RuntimeError::io("writing vm.json"))?;
    std::fs::rename(&tmp, paths.record()).map_err(RuntimeError::io("writing vm.json"))
}

/// Let every user walk through `dir` (`o+x`), without listing it.
fn allow_traverse(dir: &Path) {
    use std::os::unix::fs::PermissionsExt;
    if let Ok(meta) = std::fs::metadata(dir) {
        let mode = meta.permissions().mode();
        if mode & 0o001 == 0 {
            let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode | 0o001));
        }
    }
}

/// Ids become directory and process names: keep them to a safe alphabet.
pub(crate) fn validate_id(id: &str) -> Result<()> {
    let ok = !id.is_empty()
        && id.len() <= 64
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(RuntimeError::NotFound(id.to_string()))
    }
}

fn hostname_for(id: &str) -> String {
    id.replace('_', "-").to_ascii_lowercase()
}

/// A boot past its bound (`e`, a [`RuntimeError::BootTimeout`]) with what
/// the host saw of it (see [`console::stuck_boot`]) and its console's last
/// lines; QEMU must still run (call it before the VM is stopped).
pub(crate) async fn explain_boot_timeout(paths: &VmPaths, e: RuntimeError) -> RuntimeError {
    let RuntimeError::BootTimeout { secs, .. } = e else {
        return e;
    };
    let record = std::fs::read(paths.record())
        .ok()
        .and_then(|b| serde_json::from_slice::<VmRecord>(&b).ok());
    let host = match record {
        Some(record) => console::stuck_boot(&paths.qmp_socket(), record.qemu_pid).await,
        None => "QEMU did not start".into(),
    };
    RuntimeError::BootTimeout {
        secs,
        console_tail: format!(
            "{host}; last console lines:\n{}",
            console::tail_lines(&paths.console(), 30)
        ),
    }
}

/// QEMU's `oom_score_adj`: the kernel's OOM killer picks it before
/// processes at 0.
pub const QEMU_OOM_SCORE_ADJ: &[u8] = b"500";

/// QEMU's machine. Under TCG the PIC stays for the legacy interrupt set-up;
/// the PIT is off: the kernel is told the TSC rate (`tsc_early_khz`), so it
/// needs no PIT to calibrate (which hung 1 boot in 8 without the rate), and a
/// PIT left running costs an idle VM 36 host wake-ups a second.
/// `mem-merge=off`: guest RAM is never offered to KSM (see `ksm`).
fn machine_type(accel: Accel) -> String {
    let pic = match accel {
        Accel::Tcg => "on",
        Accel::Kvm => "off",
    };
    format!("microvm,pit=off,pic={pic},rtc=on,mem-merge=off")
}

/// The guest kernel command line. Under TCG the guest's TSC is the host's,
/// so the kernel is told the host's rate (see `accel::host_tsc_khz`).
pub fn kernel_cmdline(accel: Accel, tsc_khz: u32) -> String {
    let mut s = String::from("console=ttyS0 panic=-1 quiet loglevel=4 root=/dev/vda rw");
    if accel == Accel::Tcg {
        s.push_str(&format!(" tsc=reliable tsc_early_khz={tsc_khz}"));
    }
    s
}

pub(crate) async fn create_overlay(base: &Path, disk: &Path, disk_gb: u32) -> Result<()> {
    let out = tokio::process::Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", "-F", "qcow2", "-b"])
        .arg(base)
        .arg(disk)
        .arg(format!("{disk_gb}G"))
        .output()
        .await
        .map_err(RuntimeError::spawn("qemu-img", "qemu-utils", "qemu-img"))?;
    if !out.status.success() {
        return Err(RuntimeError::Launch(format!(
            "qemu-img create failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// Asks the QEMU at `qemu` its version.
pub fn qemu_version(qemu: &Path) -> Result<QemuVersion> {
    let out = std::process::Command::new(qemu)
        .arg("--version")
        .output()
        .map_err(|_| RuntimeError::MissingTool {
            tool: qemu.display().to_string(),
            package: "qemu-system-x86".into(),
        })?;
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().next().unwrap_or_default().trim().to_string();
    let mut numbers = line
        .split_whitespace()
        .skip_while(|w| *w != "version")
        .nth(1)
        .unwrap_or("7.0")
        .split(['.', '('])
        .map(|n| n.parse::<u32>().unwrap_or(0));
    Ok(QemuVersion {
        major: numbers.next().unwrap_or(7),
        minor: numbers.next().unwrap_or(0),
        line,
    })
}

#[cfg(test)]
mod egress_tests {
    use super::Egress;

    #[test]
    fn an_egress_reads_what_older_records_held_and_its_lists() {
        let read = |json: &str| serde_json::from_str::<Egress>(json).unwrap();
        assert_eq!(read("\"allowed\""), Egress::open());
        assert_eq!(read("\"blocked\""), Egress::blocked());
        assert!(read("\"blocked\"").is_blocked());
        let lists =
            Egress::checked(vec!["198.51.100.0/24".into()], vec!["0.0.0.0/0".into()]).unwrap();
        assert!(!lists.is_blocked(), "an allow list lets something out");
        assert_eq!(read(&serde_json::to_string(&lists).unwrap()), lists);
        assert_eq!(read("{}"), Egress::open());
    }

    #[test]
    fn an_egress_takes_ipv4_addresses_prefixes_and_host_names() {
        let one = |e: &str| Egress::checked(vec![e.into()], Vec::new());
        assert!(one("8.8.8.8").is_ok());
        assert!(one("10.0.0.0/8").is_ok());
        assert!(one("0.0.0.0/0").is_ok());
        assert!(one("example.com").is_ok());
        assert!(one("*.example.com").is_ok());
        for bad in [
            "exa mple.com",
            "*.com",
            "10.0.0.1/8",
            "10.0.0.0/33",
            "::1",
            "1.2.3",
            "1.2.3.4/x",
            "",
        ] {
            assert!(one(bad).is_err(), "{bad:?} was taken");
        }
        assert!(Egress::checked(Vec::new(), vec!["no pe".into()]).is_err());
        // Names and addresses apart: the guard and the guest's filter take
        // the addresses, the egress proxy all of it.
        let mixed = Egress::checked(
            vec!["pypi.org".into(), "203.0.113.7".into()],
            vec!["0.0.0.0/0".into()],
        )
        .unwrap();
        assert!(mixed.has_names());
        assert_eq!(mixed.allow_prefixes(), ["203.0.113.7"]);
        assert_eq!(mixed.deny_prefixes(), ["0.0.0.0/0"]);
        assert!(!Egress::blocked().has_names());
    }
}
