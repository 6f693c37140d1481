//! Snapshot templates: boot a size once, save it, and start every later VM of
//! that size by restoring the save instead of booting.
//!
//! A template is a guest booted to a configured, answering agent (and one
//! command run, so the shell is in its page cache), stopped, and saved with
//! QEMU's `x-ignore-shared` migration capability. Its RAM lives in a file
//! (`mem`) that the template VM mapped shared, so the saved state (`state`)
//! holds only device state, a few hundred KiB, and the RAM is the file
//! itself. A restored VM maps `mem` read-only and private: it reads nothing up
//! front, pages come in as the guest touches them, writes are copy-on-write,
//! and every VM of the template shares the unchanged pages through the page
//! cache. The guest's disk at save time (`disk.qcow2`, an overlay on the
//! image's root filesystem) becomes the backing file of each restored VM's own
//! overlay, so what the guest's page cache believes is on disk is on disk.
//!
//! A template is identified by everything that would make a restore wrong or
//! impossible: the image, the size, the QEMU version and accelerator, the
//! translation cache size, the network plan (with the operator's proxy), the
//! guest limits and the extra CA certificates. When any of
//! them changes the key changes (an upgrade brings a new image, for one),
//! the template is rebuilt under the new key, and the old directories are
//! removed, except those that running VMs were restored from or that saves
//! are based on (see `saved`): a save of such a VM, or a VM started from a
//! save, maps the template's RAM file and stands on its disk, so such a
//! template stays, marked outdated, until no VM and no save names it.
//! The host's TSC rate is checked separately, with a tolerance, because it is
//! measured. Building takes a per-size file lock, so two processes sharing a
//! data directory build a template once.
//!
//! A restored VM never runs the boot loader path, yet QEMU still reads the
//! `-kernel` file whole into its own heap for the firmware interface: 13.5
//! MiB of anonymous memory in every sandbox. A restore therefore gets
//! `kernel-stub`, the image kernel's boot-protocol header and setup sectors
//! and nothing else: QEMU accepts it and sets up the same devices and option
//! ROM, so the saved state loads; the guest kernel itself is in `mem`. QEMU
//! runs with `-no-reboot`, so the stub is never booted.
//!
//! Restored guests share the template's memory, so the template must hold no
//! secret: it is configured with a throwaway identity, and every restore is
//! configured again (clock, entropy with a forced CRNG reseed, hostname,
//! machine-id) before it is handed out.

use crate::config::SizeSpec;
use crate::host::accel::Accel;
use crate::{Result, RuntimeError};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::HashSet;
use std::path::{Path, PathBuf};

/// Bumped when the layout or the way templates are made changes.
pub(crate) const FORMAT: u32 = 2;

/// Everything a template depends on (`template.json` keeps a copy).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TemplateInputs {
    pub format: u32,
    pub image_id: String,
    pub size: String,
    pub resources: SizeSpec,
    /// `qemu-system-x86_64 --version`, first line.
    pub qemu_version: String,
    pub accel: Accel,
    pub tcg_tb_size_mb: u32,
    /// The kernel command line without the measured TSC rate.
    pub kernel_cmdline: String,
    /// QEMU's `-M` (machine type and its devices).
    pub machine: String,
    /// The guest network plan (JSON), `None` without a network.
    pub network: Option<serde_json::Value>,
    pub user_pids_max: u32,
    pub reserved_memory_mb: u32,
    /// SHA-256 of the extra CA certificates the guest trusts ([`ca_digest`]);
    /// absent without any, so templates made before the setting existed keep
    /// their key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_certificates: Option<String>,
    /// The VM's empty volume slots (see `vm::volumes`), part of its
    /// devices: a template's VMs, and the saves made from them, have as
    /// many. Absent (0) in templates made before volumes existed.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub volume_slots: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// What [`TemplateInputs::ca_certificates`] holds for these certificates.
pub fn ca_digest(pems: &[String]) -> Option<String> {
    if pems.is_empty() {
        return None;
    }
    let mut h = Sha256::new();
    for pem in pems {
        h.update(pem.as_bytes());
        h.update([0]);
    }
    Some(hex::encode(h.finalize()))
}

impl TemplateInputs {
    /// A short hash of the inputs: the template's name.
    pub fn key(&self) -> String {
        let json = serde_json::to_vec(self).expect("json");
        hex::encode(&Sha256::digest(&json)[..8])
    }
}

/// What `template.json` records.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TemplateRecord {
    pub inputs: TemplateInputs,
    /// The host TSC rate the template's kernel was told (TCG only).
    pub tsc_khz: u32,
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: time::OffsetDateTime,
    /// How long the build took, seconds.
    pub build_secs: f64,
}

/// A finished template on disk.
#[derive(Debug, Clone)]
pub struct Template {
    pub key: String,
    pub size: String,
    pub dir: PathBuf,
    pub record: TemplateRecord,
}

impl Template {
    /// The guest RAM file.
    pub fn mem(&self) -> PathBuf {
        self.dir.join(MEM)
    }
    /// The saved device state.
    pub fn state(&self) -> PathBuf {
        self.dir.join(STATE)
    }
    /// The guest disk at save time (read-only backing file).
    pub fn disk(&self) -> PathBuf {
        self.dir.join(DISK)
    }
    /// The `-kernel` a restore passes (see the module docs).
    pub fn kernel_stub(&self) -> PathBuf {
        self.dir.join(KERNEL_STUB)
    }
}

pub(crate) const MEM: &str = "mem";
pub(crate) const STATE: &str = "state";
pub(crate) const DISK: &str = "disk.qcow2";
pub(crate) const KERNEL_STUB: &str = "kernel-stub";
pub(crate) const RECORD: &str = "template.json";

/// Write `kernel`'s boot header and setup sectors to `stub` (Linux x86 boot
/// protocol: `setup_sects` at 0x1f1, 0 meaning 4, plus the boot sector; the
/// magic `HdrS` at 0x202). One sector of the kernel proper follows, since
/// QEMU wants the file longer than its setup.
pub(crate) fn write_kernel_stub(kernel: &Path, stub: &Path) -> std::io::Result<()> {
    use std::io::Read;
    let mut head = vec![0u8; 64 * 1024];
    let mut f = std::fs::File::open(kernel)?;
    let mut n = 0;
    while n < head.len() {
        match f.read(&mut head[n..])? {
            0 => break,
            k => n += k,
        }
    }
    head.truncate(n);
    let bad = |why: &str| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{}: {why}", kernel.display()),
        )
    };
    if head.len() < 0x206 || &head[0x202..0x206] != b"HdrS" {
        return Err(bad("not a Linux bzImage (no HdrS header)"));
    }
    let sects = match head[0x1f1] {
        0 => 4,
        s => s as usize,
    };
    let len = (sects + 1) * 512 + 512;
    if head.len() < len {
        return Err(bad("shorter than its own setup"));
    }
    std::fs::write(stub, &head[..len])
}

/// Template builds this process finished and failed, for the service's
/// metrics (a build is rare and slow: a count is all they need).
static BUILDS: [std::sync::atomic::AtomicU64; 2] = [
    std::sync::atomic::AtomicU64::new(0),
    std::sync::atomic::AtomicU64::new(0),
];

/// Counts a finished (`ok`) or failed template build.
pub(crate) fn count_build(ok: bool) {
    BUILDS[usize::from(!ok)].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

/// Template builds this process finished and failed so far.
pub fn builds() -> (u64, u64) {
    let read = |n: &std::sync::atomic::AtomicU64| n.load(std::sync::atomic::Ordering::Relaxed);
    (read(&BUILDS[0]), read(&BUILDS[1]))
}

/// The directory name of the template of `size` with `key`.
pub(crate) fn dir_name(size: &str, key: &str) -> String {
    format!("{size}-{key}")
}

/// Read a finished template, if `dir` holds one made from `inputs` on a host
/// whose TSC runs at `tsc_khz` (within 0.05 %).
pub(crate) fn load(dir: &Path, inputs: &TemplateInputs, tsc_khz: u32) -> Option<Template> {
    let t = load_any(dir)?;
    if &t.record.inputs != inputs {
        return None;
    }
    if inputs.accel == Accel::Tcg {
        let drift = (t.record.tsc_khz as f64 - tsc_khz as f64).abs() / tsc_khz as f64;
        if drift > 0.0005 {
            return None;
        }
    }
    Some(t)
}

/// Read the finished template in `dir` whatever it was made from: the
/// current one, or one outdated since and kept for the saves made on it
/// (see [`remove_others`]).
pub(crate) fn load_any(dir: &Path) -> Option<Template> {
    let bytes = std::fs::read(dir.join(RECORD)).ok()?;
    let record: TemplateRecord = serde_json::from_slice(&bytes).ok()?;
    // A template received from another host with a save (see `transfer`)
    // is `<size>-<key>-<identity>` beside this host's own: its whole
    // suffix names it, in the saves and VMs that stand on it.
    let key = record.inputs.key();
    let key = dir
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_prefix(&format!("{}-", record.inputs.size)))
        .filter(|k| k.len() == 16 + 1 + 16 && k.starts_with(&format!("{key}-")))
        .map_or(key, str::to_string);
    if ![MEM, STATE, DISK, KERNEL_STUB]
        .iter()
        .all(|f| dir.join(f).is_file())
    {
        return None;
    }
    Some(Template {
        key,
        size: record.inputs.size.clone(),
        dir: dir.to_path_buf(),
        record,
    })
}

/// Is `name` a finished template's directory name ([`dir_name`])?
fn is_finished(name: &str) -> bool {
    !name.starts_with('.')
        && name
            .rsplit_once('-')
            .is_some_and(|(size, key)| !size.is_empty() && is_key(key))
}

fn is_key(s: &str) -> bool {
    s.len() == 16 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// In a template kept only for the VMs and saves that stand on it: it is
/// outdated, and goes once none names it ([`remove_outdated`]).
pub(crate) const OUTDATED: &str = "outdated";

/// Remove every template directory of `size` except `keep`, and leftovers of
/// builds that died (`.{size}-*.tmp`). A template still in use (its
/// directory name in `in_use`: a running VM was restored from it, or a save
/// is based on it) stays, marked [`OUTDATED`]: such VMs map its RAM file and
/// their disks reach its disk, and a save of one needs both; QEMU's open
/// files would keep the VM running, but not its next save.
/// [`remove_outdated`] removes it once nothing names it.
pub(crate) fn remove_others(
    templates_dir: &Path,
    size: &str,
    keep: Option<&str>,
    in_use: &HashSet<String>,
) {
    let Ok(rd) = std::fs::read_dir(templates_dir) else {
        return;
    };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        let finished = name
            .strip_prefix(&format!("{size}-"))
            .is_some_and(|rest| rest.len() == 16 && !rest.contains('.'));
        let unfinished = name.starts_with(&format!(".{size}-")) && name.ends_with(".tmp");
        if finished && Some(name.as_str()) != keep {
            if in_use.contains(&name) {
                tracing::info!(
                    template = %name,
                    "keeping an outdated snapshot template: VMs or saves stand on it"
                );
                let _ = std::fs::write(e.path().join(OUTDATED), b"");
                continue;
            }
            tracing::info!(template = %name, "removing an outdated snapshot template");
            let _ = std::fs::remove_dir_all(e.path());
        }
        if unfinished {
            tracing::info!(template = %name, "removing an unfinished snapshot template");
            // A build that died may have left its QEMU or passt running.
            let marker = e.path().display().to_string();
            for _ in 0..4 {
                let Some(pid) = crate::vm::process::find_by_marker(&marker) else {
                    break;
                };
                // SAFETY: plain kill(2) of a process whose command line names
                // this directory.
                unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// Remove the templates [`remove_others`] kept that nothing in `in_use`
/// names any more and that are not `current` again (directory names);
/// returns the names removed.
pub(crate) fn remove_outdated(
    templates_dir: &Path,
    current: &HashSet<String>,
    in_use: &HashSet<String>,
) -> Vec<String> {
    let mut removed = Vec::new();
    let Ok(rd) = std::fs::read_dir(templates_dir) else {
        return removed;
    };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        if !is_finished(&name)
            || current.contains(&name)
            || in_use.contains(&name)
            || !e.path().join(OUTDATED).exists()
        {
            continue;
        }
        // Out of `template()`'s sight at once, then removed.
        let gone = templates_dir.join(format!(".{name}.{}.gone", rand::random::<u32>()));
        if std::fs::rename(e.path(), &gone).is_ok() {
            tracing::info!(template = %name, "removing an outdated snapshot template no save needs now");
            let _ = std::fs::remove_dir_all(&gone);
            removed.push(name);
        }
    }
    removed
}

/// Hold the build lock of `size` until the returned file is dropped.
pub(crate) async fn lock(templates_dir: &Path, size: &str) -> Result<std::fs::File> {
    let path = templates_dir.join(format!(".{size}.lock"));
    tokio::task::spawn_blocking(move || {
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(RuntimeError::io(format!("opening {}", path.display())))?;
        use std::os::fd::AsRawFd;
        // SAFETY: flock on an fd we own; it is released when the file closes.
        let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) };
        if rc != 0 {
            return Err(RuntimeError::io(format!("locking {}", path.display()))(
                std::io::Error::last_os_error(),
            ));
        }
        Ok(f)
    })
    .await
    .map_err(|e| RuntimeError::Launch(format!("the lock task failed: {e}")))?
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inputs() -> TemplateInputs {
        TemplateInputs {
            format: FORMAT,
            image_id: "abc".into(),
            size: "small".into(),
            resources: SizeSpec {
                vcpus: 2,
                memory_mb: 512,
                disk_gb: 4,
            },
            qemu_version: "QEMU emulator version 10.0.2".into(),
            accel: Accel::Tcg,
            tcg_tb_size_mb: 16,
            kernel_cmdline: "console=ttyS0".into(),
            machine: "microvm".into(),
            network: None,
            user_pids_max: 100,
            reserved_memory_mb: 64,
            ca_certificates: None,
            volume_slots: 0,
        }
    }

    #[test]
    fn every_input_changes_the_key() {
        let base = inputs().key();
        assert_eq!(base.len(), 16);
        let mut i = inputs();
        i.image_id = "abd".into();
        assert_ne!(i.key(), base);
        let mut i = inputs();
        i.qemu_version.push('1');
        assert_ne!(i.key(), base);
        let mut i = inputs();
        i.resources.memory_mb += 1;
        assert_ne!(i.key(), base);
        let mut i = inputs();
        i.network = Some(serde_json::json!({"deny": []}));
        assert_ne!(i.key(), base);
        let mut i = inputs();
        i.ca_certificates = ca_digest(&["-----BEGIN CERTIFICATE-----\n".into()]);
        assert_ne!(i.key(), base);
        assert_ne!(
            ca_digest(&["a".into(), "b".into()]),
            ca_digest(&["ab".into()])
        );
        assert_eq!(ca_digest(&[]), None);
        assert_eq!(inputs().key(), base);
        // Templates made before the CA setting existed keep their key.
        let old = serde_json::to_value(inputs()).unwrap();
        assert!(old.get("ca_certificates").is_none());
    }

    #[test]
    fn load_checks_inputs_files_and_tsc() {
        let dir = tempfile::tempdir().unwrap();
        let record = TemplateRecord {
            inputs: inputs(),
            tsc_khz: 2_600_000,
            created_at: time::OffsetDateTime::now_utc(),
            build_secs: 1.0,
        };
        std::fs::write(
            dir.path().join(RECORD),
            serde_json::to_vec(&record).unwrap(),
        )
        .unwrap();
        // Files missing: not a template.
        assert!(load(dir.path(), &inputs(), 2_600_000).is_none());
        for f in [MEM, STATE, DISK, KERNEL_STUB] {
            std::fs::write(dir.path().join(f), b"x").unwrap();
        }
        assert!(load(dir.path(), &inputs(), 2_600_000).is_some());
        assert!(load(dir.path(), &inputs(), 2_600_500).is_some());
        assert!(load(dir.path(), &inputs(), 2_610_000).is_none());
        let mut other = inputs();
        other.image_id = "zzz".into();
        assert!(load(dir.path(), &other, 2_600_000).is_none());
    }

    #[test]
    fn kernel_stub_keeps_the_setup_and_drops_the_kernel() {
        let dir = tempfile::tempdir().unwrap();
        let kernel = dir.path().join("vmlinuz");
        let stub = dir.path().join("stub");
        let mut image = vec![7u8; 1 << 20];
        image[0x1f1] = 27;
        image[0x202..0x206].copy_from_slice(b"HdrS");
        std::fs::write(&kernel, &image).unwrap();
        write_kernel_stub(&kernel, &stub).unwrap();
        let got = std::fs::read(&stub).unwrap();
        assert_eq!(got.len(), 28 * 512 + 512);
        assert_eq!(got[..], image[..got.len()]);
        // setup_sects 0 means 4.
        image[0x1f1] = 0;
        std::fs::write(&kernel, &image).unwrap();
        write_kernel_stub(&kernel, &stub).unwrap();
        assert_eq!(std::fs::metadata(&stub).unwrap().len(), 5 * 512 + 512);
        // Not a bzImage, or cut inside its setup: refused.
        std::fs::write(&kernel, vec![0u8; 4096]).unwrap();
        assert!(write_kernel_stub(&kernel, &stub).is_err());
        image[0x1f1] = 100;
        std::fs::write(&kernel, &image[..8192]).unwrap();
        assert!(write_kernel_stub(&kernel, &stub).is_err());
    }

    #[test]
    fn remove_others_keeps_the_current_one() {
        let dir = tempfile::tempdir().unwrap();
        for n in [
            "small-0123456789abcdef",
            "small-fedcba9876543210",
            ".small-0123456789abcdef.1.tmp",
            "medium-0123456789abcdef",
            ".small.lock",
        ] {
            std::fs::create_dir(dir.path().join(n)).unwrap();
        }
        remove_others(
            dir.path(),
            "small",
            Some("small-0123456789abcdef"),
            &HashSet::new(),
        );
        let mut left: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().to_string())
            .collect();
        left.sort();
        assert_eq!(
            left,
            [
                ".small.lock",
                "medium-0123456789abcdef",
                "small-0123456789abcdef"
            ]
        );
    }

    #[test]
    fn templates_saves_depend_on_are_kept_until_no_save_names_them() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        for n in [
            "small-0123456789abcdef",
            "small-1111111111111111",
            "small-2222222222222222",
        ] {
            std::fs::create_dir(d.join(n)).unwrap();
        }
        let saved_on: HashSet<String> = ["small-1111111111111111".to_string()].into();
        // A rebuild: the new template is 0123..., 2222... goes, 1111... stays.
        remove_others(d, "small", Some("small-0123456789abcdef"), &saved_on);
        let left = |d: &Path| {
            let mut v: Vec<String> = std::fs::read_dir(d)
                .unwrap()
                .flatten()
                .map(|e| e.file_name().to_string_lossy().to_string())
                .collect();
            v.sort();
            v
        };
        assert_eq!(
            left(d),
            ["small-0123456789abcdef", "small-1111111111111111"]
        );
        assert!(d.join("small-1111111111111111").join(OUTDATED).exists());
        let current: HashSet<String> = ["small-0123456789abcdef".to_string()].into();
        // While a save names it, it stays.
        assert!(remove_outdated(d, &current, &saved_on).is_empty());
        // Current again (the config went back): it stays too.
        let both: HashSet<String> = current
            .iter()
            .cloned()
            .chain(["small-1111111111111111".to_string()])
            .collect();
        assert!(remove_outdated(d, &both, &HashSet::new()).is_empty());
        // The last save gone: it goes; the current one (never marked) stays.
        assert_eq!(
            remove_outdated(d, &current, &HashSet::new()),
            ["small-1111111111111111"]
        );
        assert_eq!(left(d), ["small-0123456789abcdef"]);
        assert!(remove_outdated(d, &HashSet::new(), &HashSet::new()).is_empty());
    }

    #[test]
    fn finished_template_names() {
        assert!(is_finished("small-0123456789abcdef"));
        assert!(is_finished("x-large-0123456789abcdef"));
        assert!(!is_finished(".small-0123456789abcdef.1.tmp"));
        assert!(!is_finished("small-0123"));
        assert!(!is_finished(".small.lock"));
    }
}
