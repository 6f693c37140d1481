//! The egress proxies of this manager's VMs whose lists name hosts (see
//! [`crate::egress`]): one per VM, on a loopback port its guard redirects
//! its connections to ports 80 and 443 to. Started with the VM, or when its
//! lists gain a name; given the new rules when they change; stopped when
//! they name no host any more and when the VM is destroyed. A proxy lives
//! in the process that runs it, VMs outlive that process (a restart of
//! `sandpit serve`), so [`VmManager::restart_egress_proxies`] starts them
//! anew for the VMs still running and remakes their guards with the new
//! ports.

use super::{guard, net, Egress, VmManager};
use crate::egress::proxy::{EgressProxy, Resolve, Upstream};
use crate::egress::rules::Prefixes;
use crate::{Result, RuntimeError};
use std::net::Ipv4Addr;
use std::sync::Arc;

impl VmManager {
    /// The loopback port of VM `id`'s egress proxy for `egress`: started,
    /// or given `egress`'s rules, when its lists name hosts; stopped
    /// (`None`) when they do not.
    pub(super) async fn egress_proxy(&self, id: &str, egress: &Egress) -> Result<Option<u16>> {
        if !egress.needs_proxy() {
            self.stop_egress_proxy(id);
            return Ok(None);
        }
        if let Some(p) = self.proxies.lock().unwrap().get(id) {
            p.set_rules(egress.rules());
            p.set_broker(egress.broker.as_ref());
            return Ok(Some(p.addr().port()));
        }
        let proxy = EgressProxy::start(
            id,
            egress.rules(),
            egress.broker.as_ref(),
            self.egress_upstream(),
        )
        .await
        .map_err(RuntimeError::io("starting the VM's egress proxy"))?;
        // A restart of the proxies may have started one meanwhile (the
        // service gives running VMs their secrets while this process
        // restarts their proxies): the first stays, given this egress.
        let mut proxies = self.proxies.lock().unwrap();
        let proxy = match proxies.entry(id.to_string()) {
            std::collections::hash_map::Entry::Vacant(v) => v.insert(proxy),
            std::collections::hash_map::Entry::Occupied(o) => {
                let first = o.into_mut();
                first.set_rules(egress.rules());
                first.set_broker(egress.broker.as_ref());
                first
            }
        };
        Ok(Some(proxy.addr().port()))
    }

    /// How the proxies reach a name's host: names resolved as the guests'
    /// own name servers answer them (the `[network] dns` servers, else the
    /// host's resolver, which passt forwards the guests to), and never an
    /// address the operator denies, nor one of the host's own (read at
    /// each connection: the host may gain one).
    fn egress_upstream(&self) -> Upstream {
        let never = Prefixes::new(&self.deny);
        let forbidden = Arc::new(move |a: Ipv4Addr| {
            a.is_loopback()
                || a.is_unspecified()
                || a.is_broadcast()
                || never.contains(a)
                || net::host_addresses().contains(&format!("{a}/32"))
        });
        let servers: Vec<std::net::IpAddr> = self
            .config
            .network
            .dns
            .iter()
            .flatten()
            .filter_map(|s| s.parse().ok())
            .collect();
        let resolve: Resolve = match servers.is_empty() {
            true => Arc::new(|name: String| {
                Box::pin(async move {
                    let found = tokio::net::lookup_host((name.as_str(), 0)).await?;
                    Ok(found
                        .filter_map(|a| match a.ip() {
                            std::net::IpAddr::V4(v4) => Some(v4),
                            std::net::IpAddr::V6(_) => None,
                        })
                        .collect())
                })
            }),
            false => {
                use hickory_resolver::config::{
                    NameServerConfigGroup, ResolverConfig, ResolverOpts,
                };
                let group = NameServerConfigGroup::from_ips_clear(&servers, 53, true);
                let config = ResolverConfig::from_parts(None, Vec::new(), group);
                let resolver = Arc::new(hickory_resolver::TokioAsyncResolver::tokio(
                    config,
                    ResolverOpts::default(),
                ));
                Arc::new(move |name: String| {
                    let resolver = resolver.clone();
                    Box::pin(async move {
                        let found = resolver
                            .ipv4_lookup(format!("{name}."))
                            .await
                            .map_err(std::io::Error::other)?;
                        Ok(found.iter().map(|a| a.0).collect())
                    })
                })
            }
        };
        let name_servers = self
            .guest_name_servers()
            .into_iter()
            .map(|a| std::net::SocketAddr::new(a, 53))
            .collect();
        Upstream {
            resolve,
            name_servers,
            forbidden,
            tls: self.upstream_tls.clone(),
        }
    }

    /// VM `id` has no egress proxy any more.
    pub(super) fn stop_egress_proxy(&self, id: &str) {
        self.proxies.lock().unwrap().remove(id);
    }

    /// When VM `id`'s egress proxy last put each of its secrets into a
    /// request (by name; empty without a proxy).
    pub fn secrets_last_used(
        &self,
        id: &str,
    ) -> std::collections::HashMap<String, time::OffsetDateTime> {
        self.proxies
            .lock()
            .unwrap()
            .get(id)
            .map(EgressProxy::secrets_last_used)
            .unwrap_or_default()
    }

    /// Connections VM `id`'s egress proxy refused (0 without one).
    pub fn egress_refused(&self, id: &str) -> u64 {
        self.proxies
            .lock()
            .unwrap()
            .get(id)
            .map_or(0, EgressProxy::refused)
    }

    /// Proxies for the running VMs whose lists name hosts, their guards
    /// remade with the new ports (after this process started; see the
    /// module docs). A VM whose guard cannot be remade is left as it was:
    /// its connections to ports 80 and 443 go to a closed port, refused.
    pub async fn restart_egress_proxies(&self) {
        if !self.config.network.enabled {
            return;
        }
        for record in self.list() {
            let Some(uid) = record.qemu_uid else {
                continue;
            };
            if !record.egress.needs_proxy() || self.proxies.lock().unwrap().contains_key(&record.id)
            {
                continue;
            }
            if !matches!(self.state(&record), super::VmState::Running) {
                continue;
            }
            // The record's egress has no secrets' values: a proxy the
            // service gave them to meanwhile (see `egress_proxy`) is kept.
            let proxy = match EgressProxy::start(
                &record.id,
                record.egress.rules(),
                record.egress.broker.as_ref(),
                self.egress_upstream(),
            )
            .await
            {
                Ok(p) => p,
                Err(e) => {
                    tracing::warn!(id = %record.id, "restarting its egress proxy: {e}");
                    continue;
                }
            };
            let redirect = {
                let mut proxies = self.proxies.lock().unwrap();
                let proxy = proxies.entry(record.id.clone()).or_insert(proxy);
                Some(proxy.addr().port())
            };
            let plan = self.guard_plan(&record.egress, redirect);
            let installed = tokio::task::spawn_blocking(move || guard::install(uid, &plan)).await;
            if !matches!(installed, Ok(Ok(()))) {
                tracing::warn!(id = %record.id, "remaking its guard for its egress proxy failed");
            }
        }
    }
}
