//! Cache lookup tests, plus one real build-and-boot test (ignored by
//! default: it needs root, Debian's mirror, QEMU and a few minutes).

use super::*;

fn spec_with_agent(dir: &Path, contents: &[u8]) -> ImageSpec {
    let agent = dir.join("agent");
    fs::write(&agent, contents).unwrap();
    ImageSpec {
        agent_binary: agent,
        ..ImageSpec::default()
    }
}

#[test]
fn default_spec() {
    let spec = ImageSpec::default();
    assert_eq!(spec.mirror, "http://deb.debian.org/debian");
    assert_eq!(spec.suite, "bookworm");
    assert_eq!(spec.kernel_package, "linux-image-cloud-amd64");
    assert!(spec.packages.iter().any(|p| p == "npm"));
    assert!(!spec.packages.iter().any(|p| p == "sudo"));
}

#[test]
fn missing_agent_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let spec = ImageSpec {
        agent_binary: dir.path().join("nope"),
        ..ImageSpec::default()
    };
    assert!(matches!(
        find_image(dir.path(), &spec),
        Err(ImageError::AgentMissing(_))
    ));
    assert!(matches!(
        find_image(dir.path(), &ImageSpec::default()),
        Err(ImageError::AgentMissing(_))
    ));
}

#[test]
fn options_in_spec_are_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let mut spec = spec_with_agent(dir.path(), b"agent");
    spec.packages.push("-oAPT::Get::Foo=1".into());
    assert!(matches!(
        find_image(dir.path(), &spec),
        Err(ImageError::InvalidSpec(_))
    ));
    let mut spec = spec_with_agent(dir.path(), b"agent");
    spec.mirror = "file:///etc".into();
    assert!(matches!(
        find_image(dir.path(), &spec),
        Err(ImageError::InvalidSpec(_))
    ));
}

/// Lays out a fake complete image for `spec` the way a build would.
fn fake_build(images_dir: &Path, spec: &ImageSpec) -> GuestImage {
    let plan = Plan::new(images_dir, spec).unwrap();
    fs::create_dir_all(&plan.rootfs_dir).unwrap();
    fs::write(plan.base(), "qcow2").unwrap();
    fsutil::write_json(&plan.rootfs_dir.join("recipe.json"), &plan.rootfs).unwrap();
    fs::create_dir_all(&plan.image_dir).unwrap();
    fs::write(plan.image_dir.join("vmlinuz"), "k").unwrap();
    fs::write(plan.image_dir.join("initrd.img"), "i").unwrap();
    let image = plan.guest_image("6.1.0-test-cloud-amd64");
    fsutil::write_json(&plan.image_dir.join("image.json"), &image).unwrap();
    image
}

#[test]
fn find_image_sees_only_complete_images() {
    let dir = tempfile::tempdir().unwrap();
    let spec = spec_with_agent(dir.path(), b"agent v1");
    let images = dir.path().join("images");
    assert_eq!(find_image(&images, &spec).unwrap(), None);

    let built = fake_build(&images, &spec);
    let found = find_image(&images, &spec).unwrap().expect("complete image");
    assert_eq!(found, built);
    assert!(found.dir.is_absolute() && found.rootfs.is_absolute());
    assert!(found.dir.ends_with(format!("image-{}", found.id)));
    assert_eq!(found.kernel_release, "6.1.0-test-cloud-amd64");

    // A new agent: a different image id on the same root file system.
    let spec2 = spec_with_agent(dir.path(), b"agent v2");
    assert_eq!(find_image(&images, &spec2).unwrap(), None);
    let plan2 = Plan::new(&images, &spec2).unwrap();
    assert_ne!(plan2.image.id(), found.id);
    assert_eq!(plan2.base(), found.rootfs);

    // Anything missing makes it incomplete.
    let spec1 = spec_with_agent(dir.path(), b"agent v1");
    fs::remove_file(&found.initrd).unwrap();
    assert_eq!(find_image(&images, &spec1).unwrap(), None);
    fs::write(&found.initrd, "i").unwrap();
    assert!(find_image(&images, &spec1).unwrap().is_some());
    fs::remove_file(&found.rootfs).unwrap();
    assert_eq!(find_image(&images, &spec1).unwrap(), None);
}

#[test]
fn ensure_image_returns_cached_image_without_root_or_tools() {
    let dir = tempfile::tempdir().unwrap();
    let spec = spec_with_agent(dir.path(), b"agent");
    let built = fake_build(dir.path(), &spec);
    assert_eq!(ensure_image(dir.path(), &spec, &NoProgress).unwrap(), built);
}

/// Builds the default image with a real agent (`SANDPIT_TEST_AGENT`, a
/// static binary that prints `SANDPIT_TEST_MARKER` to the console) into
/// `SANDPIT_TEST_IMAGES` and boots it once under QEMU (TCG).
///
/// `SANDPIT_TEST_AGENT=/tmp/fake-agent SANDPIT_TEST_IMAGES=/var/tmp/images
/// cargo test -p sandpit-runtime image::tests::build_and_boot -- --ignored --nocapture`
#[test]
#[ignore = "needs root, Debian's mirror, QEMU and minutes"]
fn build_and_boot() {
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};

    let agent = std::env::var_os("SANDPIT_TEST_AGENT").expect("set SANDPIT_TEST_AGENT");
    let images =
        PathBuf::from(std::env::var_os("SANDPIT_TEST_IMAGES").expect("set SANDPIT_TEST_IMAGES"));
    let marker =
        std::env::var("SANDPIT_TEST_MARKER").unwrap_or_else(|_| "sandpit fake agent up".into());
    let spec = ImageSpec {
        agent_binary: agent.into(),
        ..ImageSpec::default()
    };
    let started = Instant::now();
    let image = ensure_image(&images, &spec, &BarProgress::new()).unwrap();
    eprintln!(
        "ensure_image: {:.1} s: {image:#?}",
        started.elapsed().as_secs_f64()
    );
    assert_eq!(find_image(&images, &spec).unwrap().as_ref(), Some(&image));

    let vm = tempfile::tempdir().unwrap();
    let overlay = vm.path().join("overlay.qcow2");
    let status = Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", "-F", "qcow2", "-b"])
        .arg(&image.rootfs)
        .arg(&overlay)
        .status()
        .unwrap();
    assert!(status.success());
    let console = vm.path().join("console.log");
    let mut qemu = Command::new("qemu-system-x86_64")
        .args([
            "-M",
            "microvm,accel=tcg,pit=on,pic=on,rtc=on",
            "-cpu",
            "max",
            "-m",
            "512",
        ])
        .args(["-nodefaults", "-nographic", "-no-reboot"])
        .arg("-serial")
        .arg(format!("file:{}", console.display()))
        .arg("-drive")
        .arg(format!(
            "id=root,file={},format=qcow2,if=none",
            overlay.display()
        ))
        .args(["-device", "virtio-blk-device,drive=root"])
        .args(["-device", "virtio-serial-device"])
        .arg("-kernel")
        .arg(&image.kernel)
        .arg("-initrd")
        .arg(&image.initrd)
        .args([
            "-append",
            "console=ttyS0 panic=-1 tsc=reliable tsc_early_khz=2000000 quiet",
        ])
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut text = String::new();
    while Instant::now() < deadline {
        text = fs::read_to_string(&console).unwrap_or_default();
        if text.contains(&marker)
            || text.contains("sandpit-init:")
            || qemu.try_wait().unwrap().is_some()
        {
            std::thread::sleep(Duration::from_millis(500));
            text = fs::read_to_string(&console).unwrap_or_default();
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = qemu.kill();
    let _ = qemu.wait();
    eprintln!("--- console ---\n{text}\n---");
    assert!(!text.contains("sandpit-init:"), "init failed");
    assert!(text.contains(&marker), "agent did not start");
}
