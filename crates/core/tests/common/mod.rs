//! Set-up shared by the core service's real-VM tests.
#![allow(dead_code)]

use sandpit_core::backend::{LocalVms, PoolConfig};
use sandpit_core::config::{ServiceConfig, SizeConfig};
use sandpit_core::{Caller, ExecParams, Service};
use sandpit_runtime::config::SizeSpec;
use sandpit_runtime::image::GuestImage;
use sandpit_runtime::{RuntimeConfig, VmManager};
use sandpit_store::Store;
use std::path::{Path, PathBuf};
use std::sync::Arc;

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

/// A service on a fresh data directory with a small test size.
pub async fn service() -> (Arc<Service>, tempfile::TempDir) {
    service_with_pool(PoolConfig::none()).await
}

/// The same with a warm pool.
pub async fn service_with_pool(pool: PoolConfig) -> (Arc<Service>, tempfile::TempDir) {
    let dir = tempfile::Builder::new()
        .prefix("spc-")
        .tempdir_in("/tmp")
        .unwrap();
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
