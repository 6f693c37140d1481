//! Set-up shared by the core service's real-VM tests.
#![allow(dead_code)]

use sandpit_core::config::{ServiceConfig, SizeConfig};
use sandpit_core::{Caller, ExecParams, Service};
use sandpit_host::local::{LocalVms, PoolConfig};
use sandpit_runtime::config::SizeSpec;
use sandpit_runtime::image::GuestImage;
use sandpit_runtime::{RuntimeConfig, VmManager};
use sandpit_store::Store;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Once};

pub fn image() -> GuestImage {
    let dir = std::env::var_os("SANDPIT_IMAGES_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/sandpit-images")
        });
    let bytes = std::fs::read(dir.join("current.json")).unwrap_or_else(|_| {
        panic!(
            "no guest image in {}: run scripts/test.sh (it builds the agent and the image)",
            dir.display()
        )
    });
    serde_json::from_slice(&bytes).unwrap()
}

/// A test's data directory. A VM runs in a session of its own and would
/// outlive a failed test (a panic leaves the service's VMs running): every
/// QEMU and passt started under the directory is killed when it is dropped,
/// also while a failed test unwinds, and again when the test binary exits
/// (a pool refill still in flight during the unwinding may start one more).
pub struct DataDir(tempfile::TempDir);

/// Every test's data directory, for the kill at exit.
static DATA_DIRS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

impl DataDir {
    fn new() -> Self {
        static AT_EXIT: Once = Once::new();
        AT_EXIT.call_once(|| {
            // SAFETY: registering a plain extern "C" fn.
            unsafe { libc::atexit(kill_vms_at_exit) };
        });
        let dir = tempfile::Builder::new()
            .prefix("spc-")
            .tempdir_in("/tmp")
            .unwrap();
        DATA_DIRS
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(dir.path().to_path_buf());
        DataDir(dir)
    }

    pub fn path(&self) -> &Path {
        self.0.path()
    }
}

impl Drop for DataDir {
    fn drop(&mut self) {
        kill_vms_under(self.path());
    }
}

extern "C" fn kill_vms_at_exit() {
    let dirs = DATA_DIRS.lock().map(|d| d.clone()).unwrap_or_default();
    for dir in dirs {
        kill_vms_under(&dir);
    }
}

/// SIGKILL every QEMU/passt whose command line mentions `dir`.
fn kill_vms_under(dir: &Path) {
    sandpit_runtime::vm::process::kill_mentioning(&dir.display().to_string());
}

/// A service on a fresh data directory with a small test size.
pub async fn service() -> (Arc<Service>, DataDir) {
    service_with_pool(PoolConfig::none()).await
}

/// The same with a warm pool.
pub async fn service_with_pool(pool: PoolConfig) -> (Arc<Service>, DataDir) {
    service_with(pool, |_| {}).await
}

/// The same with a warm pool and the service's configuration changed by `f`.
pub async fn service_with(
    pool: PoolConfig,
    f: impl FnOnce(&mut ServiceConfig),
) -> (Arc<Service>, DataDir) {
    let dir = DataDir::new();
    let mut rt = RuntimeConfig::new(dir.path());
    rt.sizes.clear();
    rt.sizes.insert(
        "small".into(),
        SizeSpec {
            vcpus: 2,
            memory_mb: 1024,
            disk_gb: 4,
        },
    );
    let mut cfg = ServiceConfig::default();
    cfg.sizes.clear();
    cfg.sizes.insert(
        "small".into(),
        SizeConfig {
            vcpus: 2,
            memory_mb: 1024,
            disk_gb: 4,
            price_usd_per_hour: 0.09,
        },
    );
    f(&mut cfg);
    let store = Store::open_sqlite(dir.path().join("sandpit.db"))
        .await
        .unwrap();
    let vms = LocalVms::with_pool(VmManager::new(rt, image()).unwrap(), pool);
    let svc = Service::new(cfg, store, vms);
    svc.start().await.unwrap();
    (svc, dir)
}

pub async fn account(svc: &Service, name: &str, usd: f64) -> Caller {
    let a = svc.create_account(name, usd).await.unwrap();
    Caller { account_id: a.id }
}

pub fn cmd(c: &str) -> ExecParams {
    ExecParams {
        command: c.into(),
        ..Default::default()
    }
}
