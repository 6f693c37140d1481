//! The VMs of this host, as the core service sees them: create, destroy, and a
//! long-lived connection to each guest agent.
//!
//! The server keeps one agent connection per sandbox and multiplexes every
//! command and file transfer over it (QEMU serves one client per agent
//! socket). A connection that dropped (server restart, agent hiccup) is
//! re-established on the next use.

use sandpit_runtime::{AgentClient, CreateVm, RuntimeError, VmManager, VmRecord, VmState};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use tokio::sync::Mutex;

/// This host's VMs.
pub struct LocalVms {
    manager: VmManager,
    agents: Mutex<HashMap<String, Arc<Mutex<Option<AgentClient>>>>>,
}

impl LocalVms {
    pub fn new(manager: VmManager) -> Arc<LocalVms> {
        Arc::new(LocalVms {
            manager,
            agents: Mutex::new(HashMap::new()),
        })
    }

    pub fn manager(&self) -> &VmManager {
        &self.manager
    }

    /// Boot a VM and keep its agent connection.
    pub async fn create(&self, id: &str, size: &str) -> Result<VmRecord, RuntimeError> {
        let vm = self
            .manager
            .create(CreateVm {
                id: id.to_string(),
                size: size.to_string(),
                metadata: BTreeMap::new(),
            })
            .await?;
        self.agents
            .lock()
            .await
            .insert(id.to_string(), Arc::new(Mutex::new(Some(vm.agent.clone()))));
        Ok(vm.record)
    }

    /// The agent of a running VM (reconnecting if needed).
    pub async fn agent(&self, id: &str) -> Result<AgentClient, RuntimeError> {
        // One slot per VM: the map lock is held only to find the slot, and a
        // slow (re)attach holds only its own VM's slot, so a dead VM never
        // stalls other sandboxes, and two requests never attach twice (QEMU
        // serves one client per agent socket).
        let slot = self
            .agents
            .lock()
            .await
            .entry(id.to_string())
            .or_default()
            .clone();
        let mut slot = slot.lock().await;
        if let Some(a) = slot.as_ref() {
            if !a.is_closed() {
                return Ok(a.clone());
            }
        }
        let vm = self.manager.attach(id).await?;
        *slot = Some(vm.agent.clone());
        Ok(vm.agent)
    }

    /// Kill the VM and remove its files. A VM that is already gone is fine.
    pub async fn destroy(&self, id: &str) -> Result<(), RuntimeError> {
        self.agents.lock().await.remove(id);
        match self.manager.destroy(id).await {
            Ok(()) | Err(RuntimeError::NotFound(_)) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Is the VM running, or why not (`None`: no such VM on this host).
    pub fn state(&self, id: &str) -> Option<VmState> {
        let record = self.manager.record(id).ok()?;
        Some(self.manager.state(&record))
    }

    /// Every VM directory on this host.
    pub fn list(&self) -> Vec<VmRecord> {
        self.manager.list()
    }

    /// Kill QEMU processes of this data directory whose VM is not in `keep`
    /// (their directory is gone, or was never finished).
    pub async fn kill_orphan_qemus(&self, keep: &[String]) {
        let vms_dir = self.manager.config().vms_dir().display().to_string();
        let Ok(rd) = std::fs::read_dir("/proc") else {
            return;
        };
        for e in rd.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
                continue;
            };
            let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
                continue;
            };
            let cmdline = String::from_utf8_lossy(&cmdline);
            // Ours: a QEMU of a VM under this data directory.
            let Some(id) = cmdline
                .split('\0')
                .find_map(|a| a.strip_prefix("sandpit-vm-"))
                .and_then(|rest| rest.split(',').next())
            else {
                continue;
            };
            if !cmdline.contains(&vms_dir) || keep.iter().any(|k| k == id) {
                continue;
            }
            let marker = format!("sandpit-vm-{id}");
            tracing::info!(id, pid, "killing a QEMU no live sandbox owns");
            sandpit_runtime::process::kill_and_wait(
                pid,
                &marker,
                std::time::Duration::from_secs(5),
            )
            .await;
        }
    }

    /// VM directories whose record is unreadable (a create that crashed early).
    pub fn stray_dirs(&self) -> Vec<String> {
        let known: Vec<String> = self.list().into_iter().map(|r| r.id).collect();
        let Ok(rd) = std::fs::read_dir(self.manager.config().vms_dir()) else {
            return Vec::new();
        };
        rd.flatten()
            .filter_map(|e| e.file_name().to_str().map(str::to_string))
            .filter(|n| !known.contains(n))
            .collect()
    }
}
