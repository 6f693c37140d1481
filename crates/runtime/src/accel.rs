//! Choosing the accelerator.
//!
//! `/dev/kvm` can exist and even answer `KVM_CREATE_VM` on hosts where a stock
//! guest never boots under it (PVM-based nested KVM, see the project notes), so
//! "KVM is usable" means: a `vmx` or `svm` CPU flag AND an openable
//! `/dev/kvm`. Everything else runs under TCG. The flags of the two paths
//! differ only where they must (timer devices), so what is tested under TCG is
//! what runs under KVM.

use crate::config::AccelChoice;
use serde::{Deserialize, Serialize};

/// The accelerator actually in use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Accel {
    Kvm,
    Tcg,
}

impl Accel {
    pub fn as_str(self) -> &'static str {
        match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        }
    }
}

impl std::fmt::Display for Accel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Is hardware virtualisation really usable on this host?
pub fn kvm_usable() -> bool {
    let flags = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let has_flag = flags
        .lines()
        .filter(|l| l.starts_with("flags"))
        .any(|l| l.split_whitespace().any(|f| f == "vmx" || f == "svm"));
    has_flag
        && std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/kvm")
            .is_ok()
}

/// Resolve the configured choice to the accelerator to use.
pub fn choose(choice: AccelChoice) -> Accel {
    match choice {
        AccelChoice::Kvm => Accel::Kvm,
        AccelChoice::Tcg => Accel::Tcg,
        AccelChoice::Auto => {
            if kvm_usable() {
                Accel::Kvm
            } else {
                Accel::Tcg
            }
        }
    }
}
