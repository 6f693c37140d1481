//! Set-up shared by the core service's real-VM tests.
#![allow(dead_code)]

use sandpit_core::config::{ServiceConfig, SizeConfig};
use sandpit_core::{Caller, ExecParams, Service};
use sandpit_host::local::{LocalVms, PoolConfig};
use sandpit_runtime::{RuntimeConfig, VmManager};
use sandpit_store::Store;
pub use sandpit_vmtest::{image, DataDir};
use std::sync::Arc;

/// A service on a fresh data directory with a small test size.
pub async fn service() -> (Arc<Service>, DataDir) {
    service_with_pool(PoolConfig::none()).await
}

/// The same with a warm pool.
pub async fn service_with_pool(pool: PoolConfig) -> (Arc<Service>, DataDir) {
    service_with(pool, |_| {}).await
}

/// The same with a warm pool and the service's configuration changed by `f`
/// (the runtime's size table follows the service's).
pub async fn service_with(
    pool: PoolConfig,
    f: impl FnOnce(&mut ServiceConfig),
) -> (Arc<Service>, DataDir) {
    service_configured(pool, f, |_| {}).await
}

/// The same with the runtime's configuration then changed by `g`.
pub async fn service_configured(
    pool: PoolConfig,
    f: impl FnOnce(&mut ServiceConfig),
    g: impl FnOnce(&mut RuntimeConfig),
) -> (Arc<Service>, DataDir) {
    let dir = DataDir::new();
    let mut rt = sandpit_vmtest::config(dir.path());
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
    rt.sizes = cfg
        .sizes
        .iter()
        .map(|(name, s)| {
            let spec = sandpit_runtime::config::SizeSpec {
                vcpus: s.vcpus,
                memory_mb: s.memory_mb,
                disk_gb: s.disk_gb,
            };
            (name.clone(), spec)
        })
        .collect();
    g(&mut rt);
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
    Caller::new(a.id, "test")
}

pub fn cmd(c: &str) -> ExecParams {
    ExecParams {
        command: c.into(),
        ..Default::default()
    }
}
