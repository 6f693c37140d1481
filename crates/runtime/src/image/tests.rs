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
