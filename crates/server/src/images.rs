//! Finding (and, when needed, building) the guest image for this binary.
//!
//! The image embeds the agent binary, so the image to boot is the one built
//! from the agent that ships with this `sandpit`: `sandpit-agent` beside the
//! executable or in `../lib/sandpit` (an install, the Debian package), or
//! the static build in the Cargo target directory
//! (a source checkout), or `--agent`/`SANDPIT_AGENT_BIN`. The last image built
//! is also remembered in `images/current.json`, for a `sandpit` that has no
//! agent beside it.

use anyhow::{bail, Context, Result};
use sandpit_runtime::image::{self, BarProgress, GuestImage, ImageSpec};
use std::path::{Path, PathBuf};

/// Where the agent binary of this build is.
pub fn locate_agent(explicit: Option<&Path>) -> Option<PathBuf> {
    if let Some(p) = explicit {
        return Some(p.to_path_buf());
    }
    if let Some(p) = std::env::var_os("SANDPIT_AGENT_BIN") {
        return Some(PathBuf::from(p));
    }
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?;
    // Beside the binary, or where the Debian package puts it
    // (/usr/bin/sandpit, /usr/lib/sandpit/sandpit-agent).
    let mut candidates = vec![
        dir.join("sandpit-agent"),
        dir.join("../lib/sandpit/sandpit-agent"),
    ];
    // target/{debug,release}/sandpit (or target/debug/deps/test-binary)
    for up in dir.ancestors().take(3) {
        candidates.push(up.join("x86_64-unknown-linux-gnu/release/sandpit-agent"));
    }
    candidates.into_iter().find(|p| is_static_elf(p))
}

/// A statically linked ELF executable has no `PT_INTERP` program header. The
/// agent must be static: it runs as PID 1 before any guest library is trusted,
/// and a dynamically linked debug build lying beside `sandpit` must not be
/// mistaken for it.
pub fn is_static_elf(path: &Path) -> bool {
    let Ok(b) = std::fs::read(path) else {
        return false;
    };
    if b.len() < 64 || &b[..4] != b"\x7fELF" || b[4] != 2 {
        return false;
    }
    let u16_at = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]) as usize;
    let phoff = u64::from_le_bytes(b[32..40].try_into().unwrap()) as usize;
    let (phentsize, phnum) = (u16_at(54), u16_at(56));
    (0..phnum).all(|i| {
        let o = phoff + i * phentsize;
        o + 4 <= b.len() && u32::from_le_bytes(b[o..o + 4].try_into().unwrap()) != 3
    })
}

fn current_pointer(images_dir: &Path) -> PathBuf {
    images_dir.join("current.json")
}

/// Build the image if it is missing (progress on stderr) and remember it.
pub fn build(images_dir: &Path, agent: Option<&Path>) -> Result<GuestImage> {
    let Some(agent) = locate_agent(agent) else {
        bail!(
            "cannot find the sandpit-agent binary: build it with `scripts/build-agent.sh` \
             (or pass --agent PATH / set SANDPIT_AGENT_BIN)"
        );
    };
    let spec = ImageSpec {
        agent_binary: agent,
        ..ImageSpec::default()
    };
    std::fs::create_dir_all(images_dir)
        .with_context(|| format!("creating {}", images_dir.display()))?;
    let progress = BarProgress::new();
    let img = image::ensure_image(images_dir, &spec, &progress)?;
    // Written beside, then renamed over: a reader (a server starting, the
    // tests) never sees half a pointer, and a hard link to the old one (a
    // copy of the directory made with `cp -l`) keeps pointing where it did.
    let pointer = current_pointer(images_dir);
    let partial = images_dir.join(format!(".current.json.{}.tmp", std::process::id()));
    std::fs::write(&partial, serde_json::to_vec_pretty(&img)?)?;
    std::fs::rename(&partial, &pointer)
        .with_context(|| format!("replacing {}", pointer.display()))?;
    Ok(img)
}

/// An image that already exists, never building one: the one built from this
/// binary's agent if it is cached, else the last one built. For commands that
/// only look at or tear down existing sandboxes (`ls`, `rm`, `exec`, `cp`),
/// which must not start a multi-minute image build.
pub fn existing(images_dir: &Path) -> Result<GuestImage> {
    if let Some(agent) = locate_agent(None) {
        let spec = ImageSpec {
            agent_binary: agent,
            ..ImageSpec::default()
        };
        if let Ok(Some(img)) = image::find_image(images_dir, &spec) {
            return Ok(img);
        }
    }
    pointed(images_dir)
}

fn pointed(images_dir: &Path) -> Result<GuestImage> {
    let ptr = current_pointer(images_dir);
    let bytes = std::fs::read(&ptr).with_context(|| {
        format!(
            "no guest image in {}: run `sandpit image build` first",
            images_dir.display()
        )
    })?;
    let img: GuestImage = serde_json::from_slice(&bytes)?;
    if !img.rootfs.exists() || !img.kernel.exists() || !img.initrd.exists() {
        bail!(
            "the guest image recorded in {} is incomplete: run `sandpit image build`",
            ptr.display()
        );
    }
    Ok(img)
}

/// The image to boot: built from this binary's agent when it can be found
/// (building it if needed), else the last one built.
pub fn current(images_dir: &Path, agent: Option<&Path>) -> Result<GuestImage> {
    if locate_agent(agent).is_some() {
        return build(images_dir, agent);
    }
    pointed(images_dir)
}

#[cfg(test)]
mod tests {
    #[test]
    fn dynamic_executables_are_not_static() {
        // The test binary itself is dynamically linked.
        let me = std::env::current_exe().unwrap();
        assert!(!super::is_static_elf(&me));
        assert!(!super::is_static_elf(std::path::Path::new("/etc/hostname")));
    }
}
