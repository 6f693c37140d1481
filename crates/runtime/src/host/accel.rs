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
    kvm_diagnosis().is_ok()
}

/// Whether KVM is usable here, and if not, why and what would change that
/// (what `sandpit doctor` prints). The reasons are checked in the order an
/// operator would fix them.
pub fn kvm_diagnosis() -> Result<(), String> {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let flags: Vec<&str> = cpuinfo
        .lines()
        .find(|l| l.starts_with("flags"))
        .map(|l| l.split_whitespace().collect())
        .unwrap_or_default();
    let pvm = std::path::Path::new("/sys/module/kvm_pvm").exists();
    if !flags.iter().any(|f| *f == "vmx" || *f == "svm") {
        let guest = flags.contains(&"hypervisor");
        let mut why = if guest {
            "the CPU shows this machine no vmx/svm flag: it is itself a VM whose hypervisor \
             does not pass hardware virtualisation through (enable nested virtualisation on \
             the host that runs it)"
                .to_string()
        } else {
            "the CPU has no vmx/svm flag: hardware virtualisation is missing or turned off \
             in the firmware (BIOS/UEFI)"
                .to_string()
        };
        if pvm {
            why.push_str(
                "; /dev/kvm here is PVM (the kvm_pvm module), under which stock guest kernels \
                 do not boot",
            );
        }
        return Err(why);
    }
    match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
    {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(
            "the CPU has vmx/svm but there is no /dev/kvm: load the module \
             (`modprobe kvm_intel` or `modprobe kvm_amd`)"
                .into(),
        ),
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => Err(format!(
            "/dev/kvm cannot be opened by this user ({e}): run as root, or add the user \
             to the `kvm` group"
        )),
        Err(e) => Err(format!("/dev/kvm cannot be opened: {e}")),
    }
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

/// The host's TSC frequency in kHz, measured once per process.
///
/// Under TCG the guest's `rdtsc` reads the host's TSC, so the guest kernel
/// must be told the host's rate (`tsc_early_khz`): told a wrong one, its
/// clock runs fast or slow by the ratio (30 % fast was measured with a fixed
/// 2 GHz on a 2.6 GHz host). The guest cannot calibrate it itself: microvm
/// has no HPET or PM timer to compare against. Measured against
/// `CLOCK_MONOTONIC_RAW` over 50 ms: good to about 0.01 %.
pub fn host_tsc_khz() -> u32 {
    static KHZ: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *KHZ.get_or_init(measure_tsc_khz)
}

#[cfg(target_arch = "x86_64")]
fn measure_tsc_khz() -> u32 {
    use std::time::{Duration, Instant};
    fn sample() -> (u64, Instant) {
        // SAFETY: rdtsc has no preconditions on x86_64.
        let t = unsafe { core::arch::x86_64::_rdtsc() };
        (t, Instant::now())
    }
    // The median of five windows: a window preempted between its two
    // readings is off in either direction, and at most a few are.
    let mut rates: Vec<f64> = (0..5)
        .map(|_| {
            let (t0, i0) = sample();
            std::thread::sleep(Duration::from_millis(10));
            let (t1, i1) = sample();
            t1.wrapping_sub(t0) as f64 / i1.duration_since(i0).as_secs_f64() / 1000.0
        })
        .collect();
    rates.sort_by(|a, b| a.total_cmp(b));
    Some(rates[2])
        .map(|k| k.round() as u32)
        .filter(|k| (100_000..20_000_000).contains(k))
        .unwrap_or(2_000_000)
}

#[cfg(not(target_arch = "x86_64"))]
fn measure_tsc_khz() -> u32 {
    2_000_000
}
