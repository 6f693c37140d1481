//! Snapshot templates, for real: a template is built from the real image,
//! VMs restored from it each get a fresh identity (entropy, hostname,
//! machine-id, clock, which the clock exchange brings back when it is
//! wrong) and a disk of their own, a broken template falls back to
//! a cold boot (a late restore is a busy host: refused, the template kept),
//! and a changed image gets a template of its own. A QEMU outside the
//! series whose RAM block table the save path reads refuses saves, saying
//! why.

use sandpit_runtime::{VmManager, VmState};
use sandpit_vmtest::*;
use std::time::Duration;

fn rt() -> tokio::runtime::Runtime {
    // The runtime logs why a restore fell back; show it with the test.
    let _ = tracing_subscriber::fmt()
        .with_env_filter("sandpit_runtime=info")
        .with_test_writer()
        .try_init();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Host wall clock, seconds since the epoch.
fn host_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// Guest wall clock minus host wall clock, seconds (the host's clock read
/// half-way through the round trip).
async fn clock_offset(vm: &sandpit_runtime::Vm) -> f64 {
    let before = host_now();
    let guest: f64 = sh(vm, "date +%s.%N").await.parse().unwrap();
    let after = host_now();
    guest - (before + after) / 2.0
}

/// A QEMU that says it is `version` and is the real one otherwise.
fn qemu_saying(dir: &std::path::Path, version: &str) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let real = String::from_utf8(
        std::process::Command::new("sh")
            .args(["-c", "command -v qemu-system-x86_64"])
            .output()
            .unwrap()
            .stdout,
    )
    .unwrap();
    let path = dir.join("qemu-system-x86_64");
    std::fs::write(
        &path,
        format!(
            "#!/bin/sh\nif [ \"$1\" = --version ]; then echo 'QEMU emulator version {version}'; exit 0; fi\nexec {} \"$@\"\n",
            real.trim()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

#[test]
fn a_qemu_outside_the_known_series_refuses_saves_and_says_why() {
    rt().block_on(async {
        let dir = data_dir();
        for (version, saves) in [("11.0.0", false), ("9.2.0", false), ("10.1.3", true)] {
            let mut c = config(&dir);
            c.qemu_binary = qemu_saying(&dir, version);
            let m = manager_with(c);
            assert!(
                m.snapshots_supported(),
                "{version}: templates still restore"
            );
            let e = m
                .save("sbx_nosuchvm", "s1", sandpit_runtime::AfterSave::Run)
                .await
                .unwrap_err()
                .to_string();
            assert_eq!(!e.contains("x-query-ramblock"), saves, "{version}: {e}");
            if !saves {
                assert!(e.contains(version), "{version}: {e}");
            }
        }
    });
}

fn template_dirs(m: &VmManager) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(m.templates_dir())
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().to_string())
                .filter(|n| !n.starts_with('.'))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

#[test]
fn restored_vms_get_their_own_identity_clock_and_disk() {
    let m = manager();
    rt().block_on(async {
        assert!(
            m.snapshots_supported(),
            "this QEMU cannot restore templates: scripts/install-deps.sh installs QEMU 10 from bookworm-backports"
        );
        assert!(m.template("small").is_none());
        let t = m.ensure_template("small").await.expect("building the template");
        assert_eq!(template_dirs(&m), [format!("small-{}", t.key)]);

        let asked = std::time::Instant::now();
        let a = m.create(new_vm("sbx_snap_a")).await.expect("restore a");
        let took = asked.elapsed();
        let b = m.create(new_vm("sbx_snap_b")).await.expect("restore b");
        assert_eq!(a.record.template.as_deref(), Some(t.key.as_str()));
        assert_eq!(b.record.template.as_deref(), Some(t.key.as_str()));
        // Where the restore's time went (what the bench prints): phases in
        // the order they happen, within the time the caller waited.
        let times = a.start_times.expect("a start says where its time went");
        assert!(
            times.state_loaded <= times.agent_answered
                && times.agent_answered <= times.configured
                && times.set_up + times.configured <= took,
            "{times:?} in a create that took {took:?}"
        );

        // Entropy: the same 32 bytes would mean a shared RNG state.
        let ra = sh(&a, "head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'").await;
        let rb = sh(&b, "head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'").await;
        assert_eq!(ra.len(), 64);
        assert_ne!(ra, rb, "two restored VMs read the same random bytes");

        // Identity.
        assert_eq!(sh(&a, "hostname").await, "sbx-snap-a");
        assert_eq!(sh(&b, "hostname").await, "sbx-snap-b");
        assert_eq!(sh(&a, "cat /etc/hostname").await, "sbx-snap-a");
        // The new name resolves (tools look their own host up), to the
        // guest's own address.
        assert_eq!(
            sh(&a, "getent ahostsv4 \"$(hostname)\" | awk 'NR==1{print $1}'").await,
            "10.0.2.15"
        );
        let ma = sh(&a, "cat /etc/machine-id").await;
        let mb = sh(&b, "cat /etc/machine-id").await;
        assert_eq!(ma.len(), 32);
        assert_ne!(ma, mb, "two restored VMs share a machine-id");

        // The clock is the host's, not the template's, and it keeps time.
        for vm in [&a, &b] {
            let off = clock_offset(vm).await;
            assert!(off.abs() < 1.0, "guest clock is {off:.3} s off the host's");
        }
        tokio::time::sleep(Duration::from_secs(10)).await;
        let off = clock_offset(&a).await;
        assert!(
            off.abs() < 1.0,
            "after 10 s the guest clock is {off:.3} s off the host's"
        );

        // A guest clock gone wrong (stepped 5 s back through the exchange
        // itself) is brought back by the next exchange.
        a.agent.clock_exchange(-5_000_000_000).await.unwrap();
        let off = clock_offset(&a).await;
        assert!(
            (off + 5.0).abs() < 1.0,
            "a step of -5 s left the guest clock {off:.3} s off the host's"
        );
        let synced = a.agent.sync_clock().await.unwrap();
        assert!(synced.stepped_ns.is_some(), "{synced:?}");
        // Read by the user's own `date`: within the host's readings around
        // the command, give or take what the exchange could not tell.
        let before = host_now();
        let guest: f64 = sh(&a, "date +%s.%N").await.parse().unwrap();
        let after = host_now();
        let slack = 0.05 + synced.found.width() as f64 / 2e9;
        assert!(
            guest > before - slack && guest < after + slack,
            "after the exchange ({synced:?}) the guest read {:.3} s after the \
             host's {before:.3}, which read {:.3} s later",
            guest - before,
            after - before
        );

        // Disks: a file written in one never appears in the other, nor in a
        // VM restored afterwards.
        sh(&a, "echo secret-a > /workspace/mine && sync").await;
        sh(&b, "test ! -e /workspace/mine").await;
        let c = m.create(new_vm("sbx_snap_c")).await.expect("restore c");
        sh(&c, "test ! -e /workspace/mine").await;
        assert_eq!(sh(&a, "cat /workspace/mine").await, "secret-a");

        // The network the template configured is in place in a restored VM.
        let addr = sh(&c, "ip -4 -o addr show scope global | awk '{print $4}'").await;
        assert_eq!(addr, "10.0.2.15/24");

        for id in ["sbx_snap_a", "sbx_snap_b", "sbx_snap_c"] {
            m.destroy(id).await.unwrap();
        }
        // The template survives its VMs.
        assert!(m.template("small").is_some());
    });
}

#[test]
fn a_broken_template_falls_back_to_a_cold_boot_and_is_rebuilt() {
    let m = manager();
    rt().block_on(async {
        let t = m.ensure_template("small").await.expect("template");
        // A restore that is only late (here: a deadline no restore meets)
        // means a host too busy for another VM: refused as such, nothing
        // left behind, and the good template kept. The host gains an
        // address first (as when a bridge or a VPN comes up, or another
        // test's namespace): that is no reason to rebuild the template,
        // whose restores are sent the new deny list (CI once saw this
        // manager miss the template for it, and boot cold).
        let address = HostAddress::add("198.51.100.77/32");
        let mut hurried = m.config().clone();
        hurried.boot_timeout = Duration::from_millis(1);
        let hurried = manager_with(hurried);
        drop(address);
        match hurried.create(new_vm("sbx_late")).await {
            Err(sandpit_runtime::RuntimeError::HostFull(why)) => {
                assert!(why.contains("too busy"), "{why}")
            }
            other => panic!("a late restore: {:?}", other.map(|vm| vm.record)),
        }
        assert!(hurried.list().is_empty());
        assert!(!hurried.paths("sbx_late").dir.exists());
        assert_eq!(
            m.template("small").map(|k| k.key.clone()),
            Some(t.key.clone())
        );
        // Corrupt the saved device state.
        std::fs::write(t.state(), b"not a migration stream").unwrap();
        let vm = m.create(new_vm("sbx_fallback")).await.expect("create");
        assert_eq!(vm.record.template, None, "expected a cold boot");
        assert_eq!(sh(&vm, "echo ok").await, "ok");
        // The broken template is gone; the next ensure builds a good one.
        assert!(m.template("small").is_none());
        assert!(template_dirs(&m).is_empty(), "{:?}", template_dirs(&m));
        let t2 = m.ensure_template("small").await.expect("rebuilt");
        let vm2 = m.create(new_vm("sbx_fallback2")).await.expect("restore");
        assert_eq!(vm2.record.template.as_deref(), Some(t2.key.as_str()));
        // A missing state file: the same.
        std::fs::remove_file(t2.state()).unwrap();
        assert!(m.template("small").is_none());
        let vm3 = m.create(new_vm("sbx_fallback3")).await.expect("create");
        assert_eq!(vm3.record.template, None);
        for id in ["sbx_fallback", "sbx_fallback2", "sbx_fallback3"] {
            m.destroy(id).await.unwrap();
        }
        assert!(m.list().is_empty());
    });
}

#[test]
fn a_changed_image_gets_a_new_template_and_old_vms_keep_running() {
    let dir = data_dir();
    let m = manager_with(config(&dir));
    rt().block_on(async {
        let t1 = m.ensure_template("small").await.expect("template");
        let old = m.create(new_vm("sbx_old_image")).await.expect("restore");
        assert_eq!(old.record.template.as_deref(), Some(t1.key.as_str()));

        // The same files under another image id stand for a rebuilt image.
        let mut image = image();
        image.id = format!("{}-next", image.id);
        let m2 = VmManager::new(config(&dir), image).unwrap();
        assert!(
            m2.template("small").is_none(),
            "the old template was reused"
        );
        let t2 = m2.ensure_template("small").await.expect("new template");
        assert_ne!(t1.key, t2.key);
        // The old template stays (outdated) while a VM stands on it: a
        // snapshot, fork or pause of that VM saves against it.
        let (old_dir, new_dir) = (format!("small-{}", t1.key), format!("small-{}", t2.key));
        let mut both = vec![old_dir, new_dir.clone()];
        both.sort();
        assert_eq!(template_dirs(&m2), both);

        // The VM restored from the outdated template still works.
        assert_eq!(sh(&old, "echo still here").await, "still here");
        assert!(matches!(m.state(&old.record), VmState::Running));
        m.destroy("sbx_old_image").await.unwrap();
        // Once none does, the new image's collection removes it.
        m2.gc_layers();
        assert_eq!(template_dirs(&m2), [new_dir]);
    });
}

/// An image as an upgrade leaves one in `images` (the data directory's own
/// images directory): `image-<id>` with the real kernel and initramfs, its
/// record and its `rootfs.qcow2` link, and `rootfs-<id>/base.qcow2`, a real
/// disk on the real image's (a qcow2 layer, so no GiB is copied). Its
/// record names `kernel_release`, and `kernel-<release>/` is made too.
fn image_in(
    images: &std::path::Path,
    real: &sandpit_runtime::image::GuestImage,
    id: &str,
    kernel_release: &str,
) -> sandpit_runtime::image::GuestImage {
    let dir = images.join(format!("image-{id}"));
    let rootfs = images.join(format!("rootfs-{id}"));
    for d in [
        &dir,
        &rootfs,
        &images.join(format!("kernel-{kernel_release}")),
    ] {
        std::fs::create_dir_all(d).unwrap();
    }
    for (from, name) in [(&real.kernel, "vmlinuz"), (&real.initrd, "initrd.img")] {
        std::fs::copy(from, dir.join(name)).unwrap();
    }
    let base = rootfs.join("base.qcow2");
    let made = std::process::Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", "-F", "qcow2", "-b"])
        .arg(&real.rootfs)
        .arg(&base)
        .status()
        .unwrap();
    assert!(made.success());
    std::os::unix::fs::symlink(
        format!("../rootfs-{id}/base.qcow2"),
        dir.join("rootfs.qcow2"),
    )
    .unwrap();
    let image = sandpit_runtime::image::GuestImage {
        id: id.to_string(),
        dir: dir.clone(),
        kernel: dir.join("vmlinuz"),
        initrd: dir.join("initrd.img"),
        rootfs: base,
        kernel_release: kernel_release.to_string(),
    };
    std::fs::write(dir.join("image.json"), serde_json::to_vec(&image).unwrap()).unwrap();
    // The VM runs the real kernel, whatever the record says.
    sandpit_runtime::image::GuestImage {
        kernel_release: real.kernel_release.clone(),
        ..image
    }
}

fn entries(dir: &std::path::Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().to_string())
        .filter(|n| !n.starts_with('.'))
        .collect();
    v.sort();
    v
}

#[test]
fn an_outdated_guest_image_goes_once_nothing_stands_on_it() {
    let dir = data_dir();
    let real = image();
    let images = dir.join("images");
    let old = image_in(&images, &real, "01d0000000000001", "6.0.0-1-old-amd64");
    let new = image_in(&images, &real, "2e00000000000002", &real.kernel_release);
    std::fs::write(
        images.join("current.json"),
        serde_json::to_vec(&new).unwrap(),
    )
    .unwrap();
    let cold = || {
        let mut c = config(&dir);
        c.snapshots = false;
        c
    };
    let everything = [
        "current.json",
        "image-01d0000000000001",
        "image-2e00000000000002",
        "kernel-6.0.0-1-old-amd64",
        &format!("kernel-{}", real.kernel_release),
        "rootfs-01d0000000000001",
        "rootfs-2e00000000000002",
    ];
    let mut everything: Vec<String> = everything.iter().map(|s| s.to_string()).collect();
    everything.sort();
    rt().block_on(async {
        let m = VmManager::new(cold(), old).unwrap();
        let vm = m
            .create(new_vm("sbx_on_old"))
            .await
            .expect("a VM on the old image");
        assert_eq!(sh(&vm, "echo up").await, "up");
        // The upgraded process starts (and collects): the old image stays
        // while a VM stands on it.
        let m2 = VmManager::new(cold(), new).unwrap();
        assert_eq!(entries(&images), everything);
        assert_eq!(sh(&vm, "cat /etc/debian_version | cut -c1-2").await, "12");
        // Once it is gone, the old image, its root file system and its
        // kernel go; the current image and what it uses stay.
        m.destroy("sbx_on_old").await.unwrap();
        m2.gc_layers();
        everything.retain(|e| !e.contains("01d0000000000001") && !e.contains("old-amd64"));
        assert_eq!(entries(&images), everything);
    });
    // An images directory outside the data directory may serve others:
    // nothing in it is collected (the shared test cache keeps its images).
    let shared = real.dir.parent().unwrap();
    let before = entries(shared);
    VmManager::new(config(&dir), real.clone())
        .unwrap()
        .gc_layers();
    assert_eq!(entries(shared), before);
}

/// Each mapping of process `pid` (its `/proc/<pid>/smaps` header line) with
/// its `VmFlags`.
fn mappings_with_flags(pid: u32) -> Vec<(String, String)> {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap();
    let is_header = |line: &str| {
        line.split_whitespace()
            .next()
            .and_then(|range| range.split_once('-'))
            .is_some_and(|(a, b)| {
                u64::from_str_radix(a, 16).is_ok() && u64::from_str_radix(b, 16).is_ok()
            })
    };
    let mut out = Vec::new();
    let mut header = String::new();
    for line in smaps.lines() {
        if let Some(flags) = line.strip_prefix("VmFlags:") {
            out.push((header.clone(), flags.trim().to_string()));
        } else if is_header(line) {
            header = line.to_string();
        }
    }
    out
}

#[test]
fn only_the_network_helper_is_offered_to_page_merging() {
    let m = manager();
    rt().block_on(async {
        m.ensure_template("small").await.expect("template");
        let vm = m.create(new_vm("sbx_ksm")).await.expect("restore");
        assert!(vm.record.template.is_some(), "the VM was not restored");
        let passt = vm.record.passt_pid.expect("a network helper");
        let stat = std::fs::read_to_string(format!("/proc/{passt}/ksm_stat")).expect(
            "/proc/PID/ksm_stat is missing: KSM needs a host kernel built with CONFIG_KSM",
        );
        assert!(
            stat.contains("ksm_merge_any: yes"),
            "passt did not opt into KSM (needs Linux 6.7 or newer for PR_SET_MEMORY_MERGE across exec): {stat}"
        );
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            let run = std::fs::read_to_string("/sys/kernel/mm/ksm/run").unwrap();
            assert_ne!(run.trim(), "0", "the service left the host's KSM daemon off");
        }
        // Guest RAM (the template's file, mapped privately) and every other
        // QEMU mapping stay out of it: tenants' pages are never merged.
        let qemu = mappings_with_flags(vm.record.qemu_pid);
        assert!(
            qemu.iter().any(|(name, _)| name.ends_with("/mem")),
            "guest RAM mapping not found in QEMU's smaps"
        );
        let mergeable: Vec<_> = qemu
            .iter()
            .filter(|(_, flags)| flags.split_whitespace().any(|f| f == "mg"))
            .map(|(name, _)| name.clone())
            .collect();
        assert!(mergeable.is_empty(), "QEMU offers {mergeable:?} to KSM");
        m.destroy("sbx_ksm").await.unwrap();
    });
}

/// An address on the host's loopback for as long as it is held (a TEST-NET
/// address no one else uses).
struct HostAddress(&'static str);

impl HostAddress {
    fn add(cidr: &'static str) -> HostAddress {
        let status = std::process::Command::new("ip")
            .args(["addr", "add", cidr, "dev", "lo"])
            .status()
            .expect("running ip (iproute2)");
        assert!(status.success(), "adding {cidr} to lo");
        HostAddress(cidr)
    }
}

impl Drop for HostAddress {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["addr", "del", self.0, "dev", "lo"])
            .status();
    }
}
