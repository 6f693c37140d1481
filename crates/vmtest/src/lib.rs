//! Real VMs for the tests: the guest image `scripts/test.sh` built (a test
//! that finds none fails and says how to build it), a small size table (so
//! a disk filler finishes), a throw-away data directory per use whose VMs
//! are killed when the test binary exits (also after a failed test), one VM
//! shared by a module's tests, and the host processes a data directory owns
//! (what a leak check counts).
//!
//! Shared by the runtime's own VM tests (`crates/runtime/tests/vms`) and the
//! end-to-end tests (`crates/cli/tests/e2e`).

use sandpit_protocol::ExecRequest;
use sandpit_runtime::config::SizeSpec;
use sandpit_runtime::image::GuestImage;
use sandpit_runtime::vm::process::kill_mentioning;
pub use sandpit_runtime::vm::process::pids_mentioning;
use sandpit_runtime::{CreateVm, ExecOutput, RuntimeConfig, Vm, VmManager};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

/// The images directory the test script prepared.
pub fn images_dir() -> PathBuf {
    std::env::var_os("SANDPIT_IMAGES_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/sandpit-images")
        })
}

/// The guest image to boot; fails loudly when it was not built.
pub fn image() -> GuestImage {
    let ptr = images_dir().join("current.json");
    let bytes = std::fs::read(&ptr).unwrap_or_else(|_| {
        panic!(
            "no guest image at {}: run scripts/test.sh (it installs QEMU, debootstrap and passt, \
             builds the agent and the image), or `sandpit image build --images-dir {}`",
            ptr.display(),
            images_dir().display()
        )
    });
    serde_json::from_slice(&bytes).expect("current.json")
}

/// The size table of the tests: a 4 GB disk (the smallest the base image
/// allows) so filling it is quick, 1 GiB of memory.
pub fn test_sizes() -> BTreeMap<String, SizeSpec> {
    let mut m = BTreeMap::new();
    m.insert(
        "small".to_string(),
        SizeSpec {
            vcpus: 2,
            memory_mb: 1024,
            disk_gb: 4,
        },
    );
    m
}

/// Data directories to remove (and VMs to kill) when the test binary exits.
static CLEANUP: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());
static REGISTERED: OnceLock<()> = OnceLock::new();

extern "C" fn cleanup_at_exit() {
    let dirs = CLEANUP.lock().map(|d| d.clone()).unwrap_or_default();
    for dir in dirs {
        kill_vms_under(&dir);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// SIGKILL every QEMU/passt whose command line mentions `dir`, and remove
/// the host's network guards of the VMs under it (their uid files), which
/// only a destroy would have removed.
pub fn kill_vms_under(dir: &Path) {
    kill_mentioning(&dir.display().to_string());
    for uid in vm_uids_under(dir, 4) {
        sandpit_runtime::vm::guard::remove(uid);
    }
}

/// The uids written in VM directories (`…/vms/<id>/uid`) under `dir`,
/// looking `depth` levels down (a cluster test's nodes have data
/// directories of their own inside the test's).
fn vm_uids_under(dir: &Path, depth: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in entries.flatten() {
        let path = e.path();
        if !e.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        if e.file_name() == "vms" {
            for vm in std::fs::read_dir(&path).into_iter().flatten().flatten() {
                if let Some(uid) = std::fs::read_to_string(vm.path().join("uid"))
                    .ok()
                    .and_then(|t| t.trim().parse().ok())
                {
                    out.push(uid);
                }
            }
        } else if depth > 0 {
            out.extend(vm_uids_under(&path, depth - 1));
        }
    }
    out
}

/// A fresh data directory (in /tmp; its path's length does not matter to
/// the runtime, see `crates/cli/tests/e2e/long_paths.rs`).
pub fn data_dir() -> PathBuf {
    REGISTERED.get_or_init(|| {
        // SAFETY: registering a plain extern "C" fn.
        unsafe {
            libc::atexit(cleanup_at_exit);
        }
    });
    let dir = tempfile::Builder::new()
        .prefix("sp-")
        .tempdir_in("/tmp")
        .unwrap()
        .keep();
    CLEANUP.lock().unwrap().push(dir.clone());
    dir
}

/// A data directory a test owns, for tests that run a whole service: a
/// panic leaves the service's VMs running (each in a session of its own),
/// so every QEMU and passt started under it is killed when it is dropped,
/// also while a failed test unwinds, and again when the test binary exits
/// (a pool refill still in flight during the unwinding may start one more).
pub struct DataDir(PathBuf);

impl DataDir {
    #[allow(clippy::new_without_default)]
    pub fn new() -> Self {
        DataDir(data_dir())
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for DataDir {
    fn drop(&mut self) {
        kill_vms_under(&self.0);
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A small filesystem of its own (a tmpfs of `mib` MiB) mounted at a
/// directory, for tests of what happens when a disk fills; lazily unmounted
/// when dropped (QEMUs still holding files in it keep it until they go).
pub struct SmallDisk(PathBuf);

impl SmallDisk {
    pub fn mount(at: &Path, mib: u64) -> SmallDisk {
        std::fs::create_dir_all(at).expect("the mount point");
        let status = std::process::Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={mib}m,mode=0755"),
                "tmpfs",
            ])
            .arg(at)
            .status()
            .expect("running mount (util-linux's mount; the tests run as root)");
        assert!(status.success(), "mounting a tmpfs on {}", at.display());
        SmallDisk(at.to_path_buf())
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    /// MiB free on it now.
    pub fn free_mb(&self) -> u64 {
        let st = nix::sys::statvfs::statvfs(&self.0).expect("statvfs");
        (st.blocks_available() as u64 * st.fragment_size() as u64) >> 20
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("--lazy")
            .arg(&self.0)
            .status();
    }
}

/// How long a test VM may take to boot: three minutes, not the default one.
/// CI runs four VM tests at once beside package installs on two emulated
/// cores, where a cold boot has taken over a minute; a test is about what it
/// names, not about that host's load. What a boot timeout does is tested with
/// bounds of its own.
pub const BOOT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(180);

/// A runtime config for tests in `dir`.
pub fn config(dir: &Path) -> RuntimeConfig {
    let mut c = RuntimeConfig::new(dir);
    c.sizes = test_sizes();
    c.boot_timeout = BOOT_TIMEOUT;
    c
}

pub fn manager_with(c: RuntimeConfig) -> VmManager {
    VmManager::new(c, image()).expect("VmManager::new")
}

pub fn manager() -> VmManager {
    manager_with(config(&data_dir()))
}

pub fn new_vm(id: &str) -> CreateVm {
    CreateVm {
        id: id.to_string(),
        size: "small".into(),
        metadata: BTreeMap::new(),
        expires_at: time::OffsetDateTime::now_utc() + time::Duration::minutes(30),
        egress: sandpit_runtime::Egress::open(),
        volumes: Vec::new(),
    }
}

pub fn req(cmd: &str) -> ExecRequest {
    ExecRequest {
        command: cmd.into(),
        cwd: None,
        env: BTreeMap::new(),
        timeout_ms: 60_000,
        max_output_bytes: 1 << 20,
        ..Default::default()
    }
}

pub fn req_timeout(cmd: &str, timeout_ms: u64) -> ExecRequest {
    ExecRequest {
        timeout_ms,
        ..req(cmd)
    }
}

/// Run a command, returning trimmed stdout; panics with everything on failure.
/// Bounded at 5 minutes: writing half a gigabyte takes most of one on a
/// busy host under emulation.
pub async fn sh(vm: &Vm, cmd: &str) -> String {
    let out = vm
        .agent
        .exec_collect(req_timeout(cmd, 300_000))
        .await
        .expect("exec");
    assert_eq!(
        out.result.exit_code,
        Some(0),
        "`{cmd}` failed: {:?}\nstdout: {}\nstderr: {}",
        out.result,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

pub async fn run(vm: &Vm, r: ExecRequest) -> ExecOutput {
    vm.agent.exec_collect(r).await.expect("exec")
}

/// One VM shared by the tests of a binary, on a runtime that outlives them.
pub struct Shared {
    pub rt: tokio::runtime::Runtime,
    pub manager: VmManager,
    pub vm: Vm,
}

pub fn shared(id: &str, make: impl FnOnce() -> RuntimeConfig) -> Shared {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let manager = manager_with(make());
    let vm = rt
        .block_on(manager.create(new_vm(id)))
        .expect("creating the shared test VM");
    Shared { rt, manager, vm }
}

/// The VM directories under a data directory (`<data>/vms/<id>`), by id.
pub fn vm_dirs(data: &Path) -> Vec<String> {
    std::fs::read_dir(data.join("vms"))
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().to_string())
                .collect()
        })
        .unwrap_or_default()
}

/// What a host process of a data directory is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostRole {
    /// A VM's QEMU (`sandpit-vm-<id>` in its command line).
    Qemu,
    /// A VM's network helper (its log file is in the VM's directory).
    Passt,
    /// A VM's expiry watchdog (`sandpit-expiry-<id>`, run in the VM's directory).
    Watchdog,
    /// Anything else that names the data directory.
    Other,
}

/// A live process that belongs to a data directory.
#[derive(Debug, Clone)]
pub struct HostProcess {
    pub pid: u32,
    pub role: HostRole,
    /// The VM it serves, when it serves one.
    pub vm: Option<String>,
    pub cmdline: String,
}

/// Every live process (zombies left out) whose command line or working
/// directory is in `data`, classified: what a leak check counts. A
/// watchdog's command line names only its VM's id, so it is found by its
/// working directory (the VM's directory; `… (deleted)` once that is gone).
pub fn host_processes(data: &Path) -> Vec<HostProcess> {
    let me = std::process::id();
    let root = data.display().to_string();
    let vms = format!("{root}/vms/");
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for pid in procs
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| pid != me)
    {
        let Ok(raw) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        if raw.is_empty() {
            continue; // a zombie or a kernel thread
        }
        let args: Vec<String> = raw
            .split(|b| *b == 0)
            .map(|a| String::from_utf8_lossy(a).to_string())
            .collect();
        let cmdline = args.join(" ");
        let cwd = std::fs::read_link(format!("/proc/{pid}/cwd"))
            .map(|p| p.display().to_string())
            .unwrap_or_default();
        if !cmdline.contains(&root) && !cwd.starts_with(&root) {
            continue;
        }
        let id_after = |s: &str, prefix: &str| -> Option<String> {
            let rest = &s[s.find(prefix)? + prefix.len()..];
            let end = rest.find([',', '/', ' ']).unwrap_or(rest.len());
            Some(rest[..end].to_string())
        };
        let (role, vm) = if let Some(a) = args.iter().find(|a| a.starts_with("sandpit-vm-")) {
            (HostRole::Qemu, id_after(a, "sandpit-vm-"))
        } else if let Some(a) = args.iter().find(|a| a.starts_with("sandpit-expiry-")) {
            (HostRole::Watchdog, id_after(a, "sandpit-expiry-"))
        } else if args[0].contains("passt") {
            (HostRole::Passt, id_after(&cmdline, &vms))
        } else {
            (HostRole::Other, id_after(&cmdline, &vms))
        };
        out.push(HostProcess {
            pid,
            role,
            vm,
            cmdline,
        });
    }
    out
}

/// Polls `done` every 200 ms until it holds; panics, naming `what`, past
/// `bound`. Returns how long it took.
pub fn wait_until(
    what: &str,
    bound: std::time::Duration,
    mut done: impl FnMut() -> bool,
) -> std::time::Duration {
    let t = std::time::Instant::now();
    while !done() {
        assert!(t.elapsed() < bound, "{what}: not within {bound:?}");
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    t.elapsed()
}
