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

use crate::accel::Accel;
use crate::channel::AgentClient;
use crate::config::{RuntimeConfig, SizeSpec};
use crate::image::GuestImage;
use crate::process::Priority;
use crate::qmp::Qmp;
use crate::template::{self, Template, TemplateInputs};
use crate::{console, expiry, guard, net, process, Result, RuntimeError};
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
    pub fn agent_socket(&self) -> PathBuf {
        self.dir.join("agent.sock")
    }
    pub fn qmp_socket(&self) -> PathBuf {
        self.dir.join("qmp.sock")
    }
    pub fn console(&self) -> PathBuf {
        self.dir.join("console.log")
    }
    pub fn qemu_log(&self) -> PathBuf {
        self.dir.join("qemu.log")
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
    give_way: crate::give_way::GiveWay,
    /// The images of saves' guest RAM that VMs start from (see `ram_image`).
    ram_images: crate::ram_image::RamImages,
}

/// QEMU's version: its `--version` line and the numbers that gate features.
#[derive(Debug, Clone)]
pub struct QemuVersion {
    /// Its first line, as printed.
    pub line: String,
    pub major: u32,
    pub minor: u32,
}

impl QemuVersion {
    /// Restoring needs `file:` migration and `rom=` on RAM files (QEMU 8.2).
    pub fn restores_templates(&self) -> bool {
        (self.major, self.minor) >= (8, 2)
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
    Saved(&'a crate::saved::SavedVm),
}

/// What to create.
#[derive(Debug, Clone)]
pub struct CreateVm {
    pub id: String,
    pub size: String,
    pub metadata: BTreeMap<String, String>,
    /// When the VM is killed and removed even if no process of ours is left
    /// to do it (see `expiry`); [`VmManager::set_expiry`] moves it later.
    pub expires_at: OffsetDateTime,
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
        let accel = crate::accel::choose(config.accel);
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
        let qemu_version = qemu_version(&config.qemu_binary)?;
        if config.ksm {
            crate::ksm::ensure_running_logged();
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
        };
        manager.prepare_saves()?;
        Ok(manager)
    }

    /// Live work (a command, a file transfer, a create someone waits for) is
    /// running: VMs being started at [`Priority::Background`] stop until the
    /// guard drops, within bounds (see [`crate::give_way`]).
    pub fn hold_background(&self) -> crate::give_way::Held {
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
        self.start(&req, size, Start::Cold, priority).await
    }

    /// Boot a new VM cold, whatever templates exist.
    pub async fn create_cold(&self, req: CreateVm) -> Result<Vm> {
        validate_id(&req.id)?;
        let size = self.config.size(&req.size)?;
        self.start(&req, size, Start::Cold, Priority::Normal).await
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
                    RuntimeError::BootTimeout { secs, .. } => RuntimeError::BootTimeout {
                        secs,
                        console_tail: console::tail_lines(&paths.console(), 30),
                    },
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

    async fn boot(
        &self,
        req: &CreateVm,
        size: SizeSpec,
        paths: &VmPaths,
        start: &Start<'_>,
        priority: Priority,
    ) -> Result<Vm> {
        let setup_started = Instant::now();
        #[cfg(unix)]
        let sock_len = paths.agent_socket().as_os_str().len();
        if sock_len > 100 {
            return Err(RuntimeError::Launch(format!(
                "the data directory path is too long for unix sockets ({} bytes); use a shorter --data-dir",
                sock_len
            )));
        }
        let base = match start {
            Start::Restore(t) => t.disk(),
            Start::Saved(saved) => saved.disk(),
            Start::Cold | Start::Template { .. } => self.image.rootfs.clone(),
        };
        // A save's layer is named by nothing of this VM until its overlay
        // exists: the layers' collection waits (see `layers`).
        let layer_lock = match start {
            Start::Saved(saved) => {
                let lock = crate::layers::lock(&self.layers_lock()).await?;
                if !base.is_file() {
                    return Err(RuntimeError::Launch(format!(
                        "the save {} was deleted",
                        saved.name
                    )));
                }
                Some(lock)
            }
            _ => None,
        };
        create_overlay(&base, &paths.disk(), size.disk_gb).await?;
        drop(layer_lock);

        // A template runs no user code and must write its state file.
        let run_as = if nix::unistd::geteuid().is_root() && !matches!(start, Start::Template { .. })
        {
            Some(self.vm_uid(&req.id))
        } else {
            None
        };
        let passt = if self.config.network.enabled {
            // The host's guard is in place before passt can send anything.
            if let Some(uid) = run_as {
                // `nft` takes ~25 ms: off the async workers, which a burst
                // of starts would otherwise stall.
                let plan = self.guard_plan();
                tokio::task::spawn_blocking(move || guard::install(uid, &plan))
                    .await
                    .map_err(|e| RuntimeError::Launch(format!("the guard's task: {e}")))??;
            }
            Some(net::start_passt(
                &self.config.passt_binary,
                &paths.dir,
                self.config.ksm,
                run_as,
            )?)
        } else {
            None
        };
        {
            use std::os::unix::fs::PermissionsExt;
            // Only root (the runtime) and this VM's QEMU walk into a VM's
            // directory: QEMU reopens its disk by path after it dropped to its
            // own uid (when a restore activates the block devices), so the
            // directory is group-owned by that uid's group, 0710, and the
            // overlay belongs to the uid alone.
            match run_as {
                Some(uid) => {
                    let _ = std::os::unix::fs::chown(&paths.dir, Some(0), Some(uid));
                    let _ = std::fs::set_permissions(
                        &paths.dir,
                        std::fs::Permissions::from_mode(0o710),
                    );
                    let _ = std::os::unix::fs::chown(paths.disk(), Some(uid), Some(uid));
                    let _ = std::fs::set_permissions(
                        paths.disk(),
                        std::fs::Permissions::from_mode(0o600),
                    );
                }
                None => {
                    let _ = std::fs::set_permissions(
                        &paths.dir,
                        std::fs::Permissions::from_mode(0o700),
                    );
                }
            }
        }
        // The expiry is in place before anything could outlive us.
        expiry::write_expiry(&paths.dir, req.expires_at)?;
        let (life_read, life_write) = expiry::life_pipe()?;
        // A start from a save maps the save's RAM image (see `ram_image`).
        // Where the host cannot make one, its pages are written instead.
        let ram_image = match start {
            Start::Saved(saved) => match self
                .ram_images
                .get(saved, crate::saved::RAM_BLOCK, saved.record.from != req.id)
                .await?
            {
                Some(file) => Some(expiry::above_targets(crate::ram_image::descriptor(&file)?)?),
                None => None,
            },
            _ => None,
        };
        let mapped = ram_image.is_some();
        let given = Given {
            network: passt.is_some(),
            run_as,
            ram_image: mapped,
        };
        let args = self.qemu_args(req, size, paths, start, given);
        tracing::debug!(id = %req.id, "starting QEMU: {}", args.join(" "));
        let qemu_log = std::fs::File::create(paths.qemu_log())
            .map_err(RuntimeError::io("creating qemu.log"))?;
        let mut cmd = tokio::process::Command::new(&self.config.qemu_binary);
        cmd.args(&args)
            .stdin(Stdio::null())
            .stdout(qemu_log.try_clone().map_err(RuntimeError::io("qemu.log"))?)
            .stderr(qemu_log)
            .kill_on_drop(false);
        let net_fd = passt.as_ref().map(|p| p.1.as_raw_fd());
        let life_fd = life_write.as_raw_fd();
        let ram_image_fd = ram_image.as_ref().map(|fd| fd.as_raw_fd());
        // SAFETY: only async-signal-safe calls between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                libc::setsid();
                process::apply_priority_to_self(priority);
                // QEMU asks for huge pages on its translation cache, so each
                // partly filled 4 MiB region of it costs 2 MiB at once: about
                // 4 MiB more per idle VM. Guest RAM is a file mapping and
                // does not use them anyway.
                libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0);
                // Guests' memory is overcommitted (see `sandpit_core`'s
                // capacity): should the host run out anyway, its OOM killer
                // takes a VM, never the server or its database.
                let adj = c"/proc/self/oom_score_adj";
                let fd = libc::open(adj.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd >= 0 {
                    libc::write(
                        fd,
                        QEMU_OOM_SCORE_ADJ.as_ptr().cast(),
                        QEMU_OOM_SCORE_ADJ.len(),
                    );
                    libc::close(fd);
                }
                if let Some(fd) = net_fd {
                    net::pass_fd(fd, net::NET_FD)?;
                }
                // The watchdog's pipe: QEMU is its only writer, so its exit
                // is the pipe's end. Second: `life_fd` (like the image's)
                // is above every target.
                net::pass_fd(life_fd, expiry::QEMU_LIFE_FD)?;
                if let Some(fd) = ram_image_fd {
                    net::pass_fd(fd, RAM_IMAGE_FD)?;
                }
                Ok(())
            });
        }
        let child = cmd.spawn().map_err(RuntimeError::spawn(
            self.config.qemu_binary.display().to_string(),
            "qemu-system-x86",
            "starting QEMU",
        ))?;
        let qemu_pid = child.id().unwrap_or(0);
        let spawned = Instant::now();
        let _giving_way = match priority {
            Priority::Background => self.give_way.track(qemu_pid),
            Priority::Normal => None,
        };
        // QEMU holds its end of the network pair now; passt must see it close
        // when QEMU exits, so the parent keeps no copy.
        let passt = passt.map(|(pid, fd)| {
            drop(fd);
            pid
        });
        drop(child); // tokio reaps it if it exits while we live; we track it by pid.
        drop(life_write);
        drop(ram_image);
        let passt_started = passt.and_then(process::start_time);
        let at_expiry = match start {
            Start::Template { .. } => expiry::AtExpiry::Keep,
            _ => expiry::AtExpiry::Remove,
        };
        let watchdog = expiry::start_watchdog(
            &paths.dir,
            &req.id,
            qemu_pid,
            passt.zip(passt_started),
            at_expiry,
            life_read,
        );

        // A machine is the same machine when it comes back from its own
        // save (restored, resumed): its machine-id stays. Any other VM gets
        // one of its own.
        let machine_id = match start {
            Start::Saved(saved) if saved.record.from == req.id => saved.record.machine_id.clone(),
            _ => None,
        }
        .unwrap_or_else(|| {
            let mut id = [0u8; 16];
            rand::rngs::OsRng.fill_bytes(&mut id);
            hex::encode(id)
        });
        let mut record = VmRecord {
            id: req.id.clone(),
            size: req.size.clone(),
            resources: size,
            accel: self.accel,
            image_id: self.image.id.clone(),
            kernel_release: self.image.kernel_release.clone(),
            created_at: OffsetDateTime::now_utc(),
            ready_at: None,
            qemu_pid,
            passt_pid: passt,
            passt_started,
            qemu_uid: run_as,
            metadata: req.metadata.clone(),
            template: match start {
                Start::Restore(t) => Some(t.key.clone()),
                Start::Saved(saved) => Some(saved.template.key.clone()),
                _ => None,
            },
            watchdog: watchdog.as_ref().ok().copied(),
            disk: None,
            machine_id: Some(machine_id.clone()),
            ram_base: match start {
                Start::Saved(saved) => saved.record.ram.clone(),
                _ => None,
            },
            ram_mapped: match start {
                Start::Saved(saved) if mapped => saved.record.ram.clone(),
                _ => None,
            },
        };
        write_record(paths, &record)?;
        // Recorded first, so a failed start's clean-up stops QEMU and passt.
        watchdog?;

        // Wait for the agent socket, then the handshake, while watching QEMU.
        let marker = qemu_marker(&req.id);
        let exited = process::pidfd_open(qemu_pid);
        let boot_timeout = match start {
            // A restore answers in well under a second; one that has not in
            // 20 s is on a host too busy for another VM (see `create`).
            Start::Restore(_) | Start::Saved(_) => {
                self.config.boot_timeout.min(Duration::from_secs(20))
            }
            _ => self.config.boot_timeout,
        };
        let connect = async {
            wait_for_socket(paths, &paths.agent_socket(), "agent", qemu_pid, &marker).await?;
            AgentClient::connect(&paths.agent_socket(), boot_timeout).await
        };
        let load = async {
            match start {
                Start::Restore(t) => load_template_state(paths, t, qemu_pid, &marker).await,
                Start::Saved(saved) => {
                    crate::saved::load_saved_state(paths, saved, qemu_pid, &marker, mapped).await
                }
                Start::Cold | Start::Template { .. } => Ok(()),
            }
        };
        tokio::time::timeout(boot_timeout, load)
            .await
            .map_err(|_| RuntimeError::BootTimeout {
                secs: boot_timeout.as_secs(),
                console_tail: String::new(),
            })??;
        let loaded = spawned.elapsed();
        let agent = match exited {
            Some(fd) => tokio::select! {
                r = connect => r?,
                _ = process::wait_pidfd(fd) => {
                    return Err(RuntimeError::Disconnected("QEMU exited during boot".into()))
                }
            },
            None => connect.await?,
        };
        let answered = spawned.elapsed();

        let mut entropy = vec![0u8; 64];
        rand::rngs::OsRng.fill_bytes(&mut entropy);
        let network = passt.as_ref().map(|_| self.network_config());
        agent
            .configure(
                GuestConfig {
                    hostname: match start {
                        Start::Template { .. } => "sandpit-template".into(),
                        _ => hostname_for(&req.id),
                    },
                    machine_id,
                    time_unix_ms: (OffsetDateTime::now_utc().unix_timestamp_nanos() / 1_000_000)
                        as u64,
                    network,
                    user_pids_max: self.config.user_pids_max,
                    reserved_memory_mb: self.config.reserved_memory_mb,
                    ca_certificates: self.ca_certificates.clone(),
                },
                &entropy,
            )
            .await?;
        let configured = spawned.elapsed();
        if priority == Priority::Background && !matches!(start, Start::Template { .. }) {
            // A VM made ahead of demand runs one command before it is handed
            // out, so this QEMU has translated the shell's code and the
            // user's first command is as quick as any other.
            agent.warm_up().await?;
        }
        let times = StartTimes {
            set_up: setup_started.elapsed().saturating_sub(spawned.elapsed()),
            state_loaded: loaded,
            agent_answered: answered,
            configured,
        };
        tracing::debug!(
            id = %req.id,
            "started in {} ms (state loaded {} ms, agent {} ms, configured {} ms) after {} ms of set-up",
            spawned.elapsed().as_millis(),
            times.state_loaded.as_millis(),
            times.agent_answered.as_millis(),
            times.configured.as_millis(),
            times.set_up.as_millis(),
        );
        record.ready_at = Some(OffsetDateTime::now_utc());
        write_record(paths, &record)?;
        Ok(Vm {
            record,
            paths: paths.clone(),
            agent,
            start_times: Some(times),
        })
    }

    /// The guest network plan of this host's VMs.
    /// Refuse a new VM while the VMs' filesystem has less free than its
    /// reserve: the guests already running need that room to grow into.
    fn check_disk_reserve(&self) -> Result<()> {
        let dir = self.config.vms_dir();
        let st = nix::sys::statvfs::statvfs(&dir)
            .map_err(|e| RuntimeError::Launch(format!("statvfs {}: {e}", dir.display())))?;
        let free_mb = (st.blocks_available() as u64 * st.fragment_size() as u64) >> 20;
        if free_mb < self.config.disk_reserve_mb {
            return Err(RuntimeError::Busy(format!(
                "the host's disk has {free_mb} MiB free for sandboxes, under its reserve of {} MiB; \
                 no new sandbox starts until space is freed",
                self.config.disk_reserve_mb
            )));
        }
        Ok(())
    }

    /// What the host denies this manager's guests' passt (see `guard`):
    /// what their own filter denies, with the same exemptions.
    fn guard_plan(&self) -> guard::GuardPlan {
        let dns = match &self.config.network.dns {
            Some(servers) => servers.iter().filter_map(|s| s.parse().ok()).collect(),
            // passt forwards to the resolver it reads at its start, as here.
            None => {
                let conf = std::fs::read_to_string("/etc/resolv.conf").unwrap_or_default();
                net::host_resolver(&conf)
                    .map(std::net::IpAddr::V4)
                    .into_iter()
                    .collect()
            }
        };
        guard::GuardPlan {
            deny: self.deny.clone(),
            dns,
            proxy: self
                .proxy
                .as_ref()
                .and_then(|p| Some((p.address.parse().ok()?, p.port))),
        }
    }

    fn network_config(&self) -> NetworkConfig {
        NetworkConfig {
            address: net::GUEST_ADDRESS.into(),
            gateway: net::GUEST_GATEWAY.into(),
            dns: self
                .config
                .network
                .dns
                .clone()
                .unwrap_or_else(|| vec![net::GUEST_DNS_FORWARD.into()]),
            deny: self.deny.clone(),
            mtu: net::GUEST_MTU,
            proxy: self.proxy.clone(),
        }
    }

    fn qemu_args(
        &self,
        req: &CreateVm,
        size: SizeSpec,
        paths: &VmPaths,
        start: &Start<'_>,
        given: Given,
    ) -> Vec<String> {
        let Given {
            network,
            run_as,
            ram_image: mapped,
        } = given;
        let p = |p: PathBuf| p.display().to_string();
        let mut machine = machine_type(self.accel);
        // Template and restored VMs keep guest RAM in the template's file:
        // shared while the template is made, a private copy-on-write mapping
        // of the read-only file in each restored VM (`rom=off` keeps the
        // mapping writable although the file is opened read-only, so no VM
        // can write the pages others share).
        let ram = match start {
            Start::Cold => None,
            Start::Template { mem } => Some(format!(
                "memory-backend-file,id=ram,size={}M,mem-path={},share=on",
                size.memory_mb,
                mem.display()
            )),
            Start::Restore(t) => Some(format!(
                "memory-backend-file,id=ram,size={}M,mem-path={},share=off,readonly=on,rom=off",
                size.memory_mb,
                t.mem().display()
            )),
            // The save's RAM image, which QEMU holds at `RAM_IMAGE_FD`.
            Start::Saved(_) if mapped => Some(format!(
                "memory-backend-file,id=ram,size={}M,mem-path=/proc/self/fd/{RAM_IMAGE_FD},share=off,readonly=on,rom=off",
                size.memory_mb,
            )),
            // The same base as the VM that was saved, its pages written
            // over it (see `ram_pages`).
            Start::Saved(saved) => Some(format!(
                "memory-backend-file,id=ram,size={}M,mem-path={},share=off,readonly=on,rom=off",
                size.memory_mb,
                saved.template.mem().display()
            )),
        };
        if ram.is_some() {
            machine.push_str(",memory-backend=ram");
        }
        let mut a: Vec<String> = vec![
            "-name".into(),
            format!("{},process={}", qemu_marker(&req.id), qemu_marker(&req.id)),
            "-M".into(),
            machine,
        ];
        if let Some(ram) = ram {
            a.push("-object".into());
            a.push(ram);
        }
        if let Start::Restore(_) | Start::Saved(_) = start {
            // The state is loaded through QMP once its capabilities are set
            // (see `load_template_state`, `saved::load_saved_state`).
            a.push("-incoming".into());
            a.push("defer".into());
        }
        if let Start::Saved(_) = start {
            // A save's devices are QEMU's `xen-save-devices-state` stream,
            // which has no configuration section (see `saved`).
            a.push("-global".into());
            a.push("migration.send-configuration=off".into());
        }
        match self.accel {
            Accel::Tcg => {
                a.push("-accel".into());
                a.push(format!("tcg,tb-size={}", self.config.tcg_tb_size_mb));
                a.push("-cpu".into());
                a.push("max".into());
            }
            Accel::Kvm => {
                a.push("-accel".into());
                a.push("kvm".into());
                a.push("-cpu".into());
                a.push("host".into());
            }
        }
        a.extend(
            [
                "-smp",
                &size.vcpus.to_string(),
                "-m",
                &format!("{}M", size.memory_mb),
                "-nodefaults",
                "-no-user-config",
                "-display",
                "none",
                "-no-reboot",
                "-chardev",
                &format!("file,id=console,path={},append=on", p(paths.console())),
                "-serial",
                "chardev:console",
                "-device",
                "virtio-serial-device",
                "-chardev",
                &format!(
                    "socket,id=agent,path={},server=on,wait=off",
                    p(paths.agent_socket())
                ),
                "-device",
                &format!("virtserialport,chardev=agent,name={AGENT_PORT_NAME}"),
                "-qmp",
                &format!("unix:{},server=on,wait=off", p(paths.qmp_socket())),
                "-drive",
                &format!(
                    "id=root,file={},format=qcow2,if=none,discard=unmap",
                    p(paths.disk())
                ),
                "-device",
                "virtio-blk-device,drive=root",
                "-object",
                "rng-random,id=rng0,filename=/dev/urandom",
                "-device",
                "virtio-rng-device,rng=rng0",
                "-kernel",
                &p(match start {
                    Start::Restore(t) => t.kernel_stub(),
                    Start::Saved(saved) => saved.template.kernel_stub(),
                    _ => self.image.kernel.clone(),
                }),
                "-initrd",
                &p(self.image.initrd.clone()),
                "-append",
                &kernel_cmdline(self.accel, crate::accel::host_tsc_khz()),
            ]
            .iter()
            .map(|s| s.to_string()),
        );
        if network {
            a.push("-netdev".into());
            a.push(format!(
                "stream,id=net0,server=off,addr.type=fd,addr.str={}",
                net::NET_FD
            ));
            a.push("-device".into());
            a.push("virtio-net-device,netdev=net0".into());
        }
        // seccomp: no spawning, no obsolete calls, no resource control. The
        // set*id calls stay allowed only when QEMU must drop to its own uid
        // (the filter is installed before the drop); once it runs as that
        // unprivileged uid it cannot raise itself again anyway.
        a.push("-sandbox".into());
        a.push(format!(
            "on,obsolete=deny,spawn=deny,resourcecontrol=deny,elevateprivileges={}",
            if run_as.is_some() { "allow" } else { "deny" }
        ));
        if let Some(uid) = run_as {
            if self.qemu_version.major >= 9 {
                a.push("-run-with".into());
                a.push(format!("user={uid}:{uid}"));
            } else {
                a.push("-runas".into());
                a.push(format!("{uid}:{uid}"));
            }
        }
        a
    }

    /// An unprivileged uid for this VM's QEMU, not used by any other live VM.
    fn vm_uid(&self, id: &str) -> u32 {
        const BASE: u32 = 3_000_000;
        const SPAN: u32 = 1_000_000;
        let used: Vec<u32> = self.list().iter().filter_map(|r| r.qemu_uid).collect();
        let mut h: u32 = id
            .bytes()
            .fold(2166136261u32, |h, b| (h ^ b as u32).wrapping_mul(16777619));
        loop {
            let uid = BASE + h % SPAN;
            if !used.contains(&uid) {
                return uid;
            }
            h = h.wrapping_add(1);
        }
    }

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
        validate_id(id)?;
        let socket = self.paths(id).qmp_socket();
        let set = async {
            let mut qmp = Qmp::connect(&socket).await?;
            qmp.execute(
                "block_set_io_throttle",
                serde_json::json!({
                    "device": "root",
                    "bps": 0, "bps_rd": 0, "bps_wr": bytes_per_second.unwrap_or(0),
                    "iops": 0, "iops_rd": 0, "iops_wr": 0,
                }),
            )
            .await
        };
        match tokio::time::timeout(Duration::from_secs(5), set).await {
            Ok(done) => done.map(drop),
            Err(_) => Err(RuntimeError::Disconnected(format!(
                "QEMU of {id} did not answer a disk limit within 5 s"
            ))),
        }
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
        if let Ok(record) = self.record(id) {
            stop_processes(&record, &paths).await;
            if let Some(uid) = record.qemu_uid.filter(|_| self.config.network.enabled) {
                let _ = tokio::task::spawn_blocking(move || guard::remove(uid)).await;
            }
        } else {
            // A VM that died before its record was written: find its QEMU by marker.
            if let Some(pid) = find_by_marker(&qemu_marker(id)) {
                process::kill_and_wait(pid, &qemu_marker(id), Duration::from_secs(10)).await;
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

/// Find a process whose command line carries `marker`.
pub fn find_by_marker(marker: &str) -> Option<u32> {
    let rd = std::fs::read_dir("/proc").ok()?;
    for e in rd.flatten() {
        if let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) {
            if process::alive_with_marker(pid, marker) {
                return Some(pid);
            }
        }
    }
    None
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

/// Snapshot templates (see `template`): find, build, discard.
impl VmManager {
    /// Templates are on, and this QEMU can restore them.
    pub fn snapshots_supported(&self) -> bool {
        self.config.snapshots && self.qemu_version.restores_templates()
    }

    /// Where templates live.
    pub fn templates_dir(&self) -> PathBuf {
        self.config.data_dir.join("templates")
    }

    fn template_inputs(&self, size_name: &str, size: SizeSpec) -> TemplateInputs {
        TemplateInputs {
            format: template::FORMAT,
            image_id: self.image.id.clone(),
            size: size_name.to_string(),
            resources: size,
            qemu_version: self.qemu_version.line.clone(),
            accel: self.accel,
            tcg_tb_size_mb: self.config.tcg_tb_size_mb,
            kernel_cmdline: kernel_cmdline(self.accel, 0),
            machine: machine_type(self.accel),
            network: self
                .config
                .network
                .enabled
                .then(|| serde_json::to_value(self.network_config()).expect("json")),
            user_pids_max: self.config.user_pids_max,
            reserved_memory_mb: self.config.reserved_memory_mb,
            ca_certificates: template::ca_digest(&self.ca_certificates),
        }
    }

    /// The directory names of the current templates of the configured
    /// sizes, built or not.
    pub(crate) fn current_template_dirs(&self) -> std::collections::HashSet<String> {
        self.config
            .sizes
            .iter()
            .map(|(name, size)| template::dir_name(name, &self.template_inputs(name, *size).key()))
            .collect()
    }

    /// The finished template of `size` for this image, QEMU and config, if
    /// one has been built.
    pub fn template(&self, size_name: &str) -> Option<Template> {
        if !self.snapshots_supported() {
            return None;
        }
        let size = self.config.size(size_name).ok()?;
        let inputs = self.template_inputs(size_name, size);
        let dir = self
            .templates_dir()
            .join(template::dir_name(size_name, &inputs.key()));
        template::load(&dir, &inputs, crate::accel::host_tsc_khz())
    }

    /// The template of `size`, built first when there is none (about a cold
    /// boot plus three seconds). Concurrent callers, in this process or
    /// another on the same data directory, build it once.
    pub async fn ensure_template(&self, size_name: &str) -> Result<Template> {
        if !self.snapshots_supported() {
            return Err(RuntimeError::Launch(format!(
                "snapshot templates need QEMU 8.2 or newer (this is {}) and snapshots enabled",
                self.qemu_version.line
            )));
        }
        if let Some(t) = self.template(size_name) {
            return Ok(t);
        }
        let size = self.config.size(size_name)?;
        validate_id(size_name)?;
        let dir = self.templates_dir();
        std::fs::create_dir_all(&dir)
            .map_err(RuntimeError::io(format!("creating {}", dir.display())))?;
        allow_traverse(&dir);
        let _lock = template::lock(&dir, size_name).await?;
        if let Some(t) = self.template(size_name) {
            return Ok(t);
        }
        let inputs = self.template_inputs(size_name, size);
        let name = template::dir_name(size_name, &inputs.key());
        // Outdated templates and the leftovers of builds that died.
        match self.templates_in_use_now() {
            Some(in_use) => template::remove_others(&dir, size_name, None, &in_use),
            None => tracing::warn!("a save's record is unreadable: no old template is removed"),
        }
        let tmp = dir.join(format!(".{name}.{}.tmp", rand::random::<u32>()));
        let started = Instant::now();
        tracing::info!(size = size_name, template = %name, "building a snapshot template");
        if let Err(e) = self.build_template_in(&tmp, size_name, size).await {
            let _ = std::fs::remove_dir_all(&tmp);
            template::count_build(false);
            return Err(e);
        }
        let record = template::TemplateRecord {
            inputs,
            tsc_khz: crate::accel::host_tsc_khz(),
            created_at: OffsetDateTime::now_utc(),
            build_secs: started.elapsed().as_secs_f64(),
        };
        let finish = || -> std::io::Result<()> {
            use std::os::unix::fs::PermissionsExt;
            std::fs::write(
                tmp.join(template::RECORD),
                serde_json::to_vec_pretty(&record).expect("json"),
            )?;
            // Restored VMs' QEMUs (each its own uid) only read these; none
            // may write them.
            let stub = tmp.join(template::KERNEL_STUB);
            if let Err(e) = template::write_kernel_stub(&self.image.kernel, &stub) {
                // Not a bzImage: restores pass the whole kernel, as a boot does.
                tracing::info!("no kernel stub for restores ({e}); they use the kernel itself");
                std::fs::copy(&self.image.kernel, &stub)?;
            }
            for f in [
                template::MEM,
                template::STATE,
                template::DISK,
                template::KERNEL_STUB,
            ] {
                let f = tmp.join(f);
                std::os::unix::fs::chown(&f, Some(0), Some(0)).ok();
                std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644))?;
            }
            std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755))?;
            std::fs::rename(&tmp, dir.join(&name))
        };
        if let Err(e) = finish() {
            let _ = std::fs::remove_dir_all(&tmp);
            template::count_build(false);
            return Err(RuntimeError::io("finishing the template")(e));
        }
        template::count_build(true);
        tracing::info!(
            size = size_name,
            template = %name,
            "snapshot template ready in {:.1} s",
            record.build_secs
        );
        self.template(size_name).ok_or_else(|| {
            RuntimeError::Launch(format!(
                "the template {name} vanished right after its build"
            ))
        })
    }

    /// Remove a template that failed to restore, so the next
    /// `ensure_template` builds it again.
    pub fn discard_template(&self, template: &Template) {
        let gone = template.dir.with_file_name(format!(
            ".{}-{}.{}.tmp",
            template.size,
            template.key,
            rand::random::<u32>()
        ));
        if std::fs::rename(&template.dir, &gone).is_ok() {
            let _ = std::fs::remove_dir_all(&gone);
        }
    }

    async fn build_template_in(&self, dir: &Path, size_name: &str, size: SizeSpec) -> Result<()> {
        std::fs::create_dir(dir)
            .map_err(RuntimeError::io(format!("creating {}", dir.display())))?;
        let paths = VmPaths {
            dir: dir.to_path_buf(),
        };
        let req = CreateVm {
            id: format!("template-{size_name}"),
            size: size_name.to_string(),
            metadata: BTreeMap::new(),
            // Far more than a build takes; a builder that died leaves no VM.
            expires_at: OffsetDateTime::now_utc() + TEMPLATE_BUILD_LEASE,
        };
        let mem = dir.join(template::MEM);
        let booted = self
            .boot(
                &req,
                size,
                &paths,
                &Start::Template { mem: &mem },
                Priority::Normal,
            )
            .await;
        let saved = match &booted {
            Ok(vm) => save_template(vm).await,
            Err(e) => Err(RuntimeError::Launch(format!(
                "booting the template VM: {e}; last console lines:\n{}",
                console::tail_lines(&paths.console(), 20)
            ))),
        };
        // Whatever happened, nothing of the template VM keeps running.
        match std::fs::read(paths.record())
            .ok()
            .and_then(|b| serde_json::from_slice::<VmRecord>(&b).ok())
        {
            Some(record) => stop_processes(&record, &paths).await,
            None => {
                if let Some(pid) = find_by_marker(&dir.display().to_string()) {
                    process::kill_and_wait(pid, &qemu_marker(&req.id), Duration::from_secs(10))
                        .await;
                }
            }
        }
        saved?;
        for f in [
            paths.agent_socket(),
            paths.qmp_socket(),
            paths.record(),
            dir.join("passt.log"),
            dir.join(expiry::EXPIRES_FILE),
        ] {
            let _ = std::fs::remove_file(f);
        }
        Ok(())
    }
}

/// Say where the guests' DNS goes by default (see `net`), and warn when it
/// goes nowhere.
fn log_guest_resolver() {
    let conf = std::fs::read_to_string("/etc/resolv.conf").unwrap_or_default();
    match net::host_resolver(&conf) {
        Some(upstream) => tracing::debug!(
            "guests resolve names at {}, which passt forwards to {upstream} \
             (the first IPv4 nameserver of /etc/resolv.conf)",
            net::GUEST_DNS_FORWARD
        ),
        None => tracing::warn!(
            "/etc/resolv.conf names no IPv4 nameserver, so guests cannot resolve names; \
             name servers for them can be set with [network] dns"
        ),
    }
}

/// Wait until a starting QEMU has created `socket` (its `what` socket),
/// failing as soon as QEMU exits, or after 10 s.
pub(crate) async fn wait_for_socket(
    paths: &VmPaths,
    socket: &Path,
    what: &str,
    qemu_pid: u32,
    marker: &str,
) -> Result<()> {
    let start = Instant::now();
    while !socket.exists() {
        if !process::alive_with_marker(qemu_pid, marker) {
            return Err(RuntimeError::Disconnected("QEMU exited at start".into()));
        }
        if start.elapsed() > Duration::from_secs(10) {
            return Err(RuntimeError::Launch(format!(
                "QEMU did not create its {what} socket: {}",
                console::tail_lines(&paths.qemu_log(), 5)
            )));
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    Ok(())
}

/// Start loading a template's device state into a QEMU waiting with
/// `-incoming defer`. Only device state is in the file: with `x-ignore-shared`
/// the RAM is the template's file itself. QEMU exits if the load fails.
async fn load_template_state(
    paths: &VmPaths,
    template: &Template,
    qemu_pid: u32,
    marker: &str,
) -> Result<()> {
    wait_for_socket(paths, &paths.qmp_socket(), "QMP", qemu_pid, marker).await?;
    let mut qmp = Qmp::connect(&paths.qmp_socket()).await?;
    qmp.ignore_shared_ram().await?;
    qmp.execute(
        "migrate-incoming",
        serde_json::json!({"uri": format!("file:{}", template.state().display())}),
    )
    .await?;
    // Connect to the agent only once the guest runs: a host that connects
    // while the device state is still loading is not seen by the guest
    // (the loaded state says "no host"), and its first bytes go unanswered.
    // A load that fails makes QEMU exit, which closes QMP.
    loop {
        let event = qmp.next_event().await.map_err(|_| {
            RuntimeError::Disconnected(format!(
                "QEMU exited while loading the template's state: {}",
                console::tail_lines(&paths.qemu_log(), 3)
            ))
        })?;
        if event.get("event").and_then(|e| e.as_str()) == Some("RESUME") {
            return Ok(());
        }
    }
}

/// Warm the template guest, let its agent settle, and save the VM's device
/// state next to its RAM file.
async fn save_template(vm: &Vm) -> Result<()> {
    // The first command of every restored sandbox then finds the shell and
    // its libraries in the guest's page cache.
    vm.agent.warm_up().await?;
    vm.agent.close();
    // The agent ends a session 2 s after its host went away; saved after
    // that, every restore starts from an agent waiting for its first host.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let state = vm.paths.dir.join(template::STATE);
    let mut qmp = Qmp::connect(&vm.paths.qmp_socket()).await?;
    // Saved while running (QEMU stops the guest for the last step itself),
    // so the saved run state is "running" and a restore starts the guest as
    // soon as the state is loaded, without another QMP round trip. RAM is not
    // copied at all, so there is nothing to iterate over.
    qmp.ignore_shared_ram().await?;
    qmp.execute(
        "migrate",
        serde_json::json!({"uri": format!("file:{}", state.display())}),
    )
    .await?;
    qmp.wait_migration("saving the template").await
}
