//! What an image is made of, and the hashes that name the cache entries.
//!
//! The image is split by cost: the root filesystem takes over a minute
//! (debootstrap + apt), the initramfs about a second. So there are two
//! recipes. The root filesystem's covers only what goes into it (suite,
//! mirror, packages, the scripts that configure it, the disk size and a
//! builder version); the image's covers the root filesystem's hash, the
//! kernel package, the init script, the module list, the busybox applets and
//! the agent binary's SHA-256. A new agent binary therefore makes a new
//! image directory and initramfs on top of the same root filesystem.
//!
//! Every script run at build or boot time is a constant here, so editing one
//! changes a hash and the next `ensure_image` rebuilds what it affects.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::modules::Wanted;

/// Bump when the build changes in a way the recipes do not capture.
pub const BUILDER_VERSION: u32 = 1;

/// Length (hex digits) of the ids in cache directory names.
const ID_LEN: usize = 16;

/// Default mirror and suite: Debian 12.
pub const DEFAULT_MIRROR: &str = "http://deb.debian.org/debian";
/// Default suite.
pub const DEFAULT_SUITE: &str = "bookworm";
/// Default kernel (meta)package.
pub const DEFAULT_KERNEL_PACKAGE: &str = "linux-image-cloud-amd64";

/// What a sandbox offers out of the box.
pub const DEFAULT_PACKAGES: &[&str] = &[
    "bash",
    "coreutils",
    "procps",
    "iproute2",
    "ca-certificates",
    "curl",
    "git",
    "python3",
    "python3-pip",
    "python3-venv",
    "nodejs",
    "npm",
    "build-essential",
    "jq",
    "unzip",
    "less",
    "nftables",
    "e2fsprogs",
    // For people at the terminal (the dashboard's, `sandpit sandbox shell`).
    "vim",
    "htop",
];

/// What debootstrap installs by itself. Everything else goes through apt in
/// the chroot: debootstrap's own resolver fails on npm's dependency tree.
pub(crate) const DEBOOTSTRAP_INCLUDE: &[&str] = &["ca-certificates", "iproute2", "procps"];

/// Size of the root file system (sparse; qcow2 stores only what is used).
pub(crate) const ROOTFS_SIZE_BYTES: u64 = 4 << 30;

/// Runs on the host in private mount and PID namespaces (see
/// `exec::isolated`), so the mounts it makes vanish with the process, also
/// when the build dies.
/// Arguments: the root directory, then the packages.
pub(crate) const CHROOT_WRAPPER: &str = r#"set -eu
root=$1
shift
mount -t proc proc "$root/proc"
mount --bind /dev "$root/dev"
mount --bind /dev/pts "$root/dev/pts"
mount --bind /sys "$root/sys"
exec chroot "$root" /bin/sh /tmp/sandpit-setup.sh "$@"
"#;

/// Runs inside the chroot of the fresh debootstrap; arguments: packages.
pub(crate) const SETUP_SCRIPT: &str = r#"#!/bin/sh
# Configures the Sandpit guest root file system (runs in a chroot at build time).
set -eu
export DEBIAN_FRONTEND=noninteractive

# No service may start inside the build chroot.
printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
chmod 0755 /usr/sbin/policy-rc.d

apt-get update
# libnss-myhostname: the guest's identity needs it (see /etc/hosts below).
# bash-static: the same bash, statically linked, which commands start with
# (milliseconds sooner under emulation; see the agent's `exec`).
apt-get install -y --no-install-recommends "$@" libnss-myhostname bash-static
if dpkg-query -W -f='${Status}' sudo 2>/dev/null | grep -q 'ok installed'; then
    apt-get purge -y sudo
fi
apt-get clean
rm -rf /var/lib/apt/lists/*
# C.UTF-8 (every command's LANG) from one archive file: without it each
# process that calls setlocale opens and maps a dozen files, after as many
# failed lookups, which is milliseconds per command under emulation.
localedef --add-to-archive /usr/lib/locale/C.utf8
rm -f /usr/sbin/policy-rc.d

# A login shell (E2B's SDKs run every command in one, `bash -l -c`) asks
# `id -u` which PATH to set: a process start, ~12 ms under emulation, on
# every command. bash knows its uid ($EUID); other shells still ask.
sed -i 's/"$(id -u)"/"${EUID:-$(id -u)}"/g' /etc/profile
grep -q 'EUID:-' /etc/profile

# The unprivileged user commands run as, and their working directory.
id -u user >/dev/null 2>&1 || useradd -m -u 1000 -U -s /bin/bash user
install -d -o 1000 -g 1000 -m 0755 /workspace

# The sandbox's identity lives in the kernel, so a restored snapshot takes a
# new one without creating files: /etc/hostname is the kernel's hostname, and
# nss-myhostname resolves it (to the guest's addresses), so /etc/hosts holds
# no per-sandbox line.
ln -sfn /proc/sys/kernel/hostname /etc/hostname
cat > /etc/hosts <<'EOF'
127.0.0.1	localhost
::1	localhost ip6-localhost ip6-loopback
ff02::1	ip6-allnodes
ff02::2	ip6-allrouters
EOF
sed -i -E 's/^hosts:.*/hosts:          files myhostname dns/' /etc/nsswitch.conf
grep -q '^hosts:.*myhostname' /etc/nsswitch.conf
# Each sandbox gets its own at boot; the agent rewrites these 33 bytes in
# place (no new file, no rename).
echo 00000000000000000000000000000000 > /etc/machine-id
# A plain file (not a link) that the agent rewrites at boot.
rm -f /etc/resolv.conf
echo '# written by sandpit-agent at boot' > /etc/resolv.conf
chmod 1777 /tmp
rm -rf /var/log/apt /var/log/dpkg.log /var/log/alternatives.log /var/cache/debconf/*-old
"#;

/// The initramfs's `/init`: load the modules, mount the root disk, and
/// hand PID 1 to the agent. Any failure powers the VM off at once (with a
/// `sandpit-init:` line on the console) instead of leaving it hanging.
pub(crate) const INIT_SCRIPT: &str = r#"#!/bin/busybox sh
# Sandpit guest initramfs init.
export PATH=/bin

fail() {
    echo "sandpit-init: $*" >&2
    poweroff -f
    sleep 5
    exit 1
}

mount -t proc -o nosuid,nodev,noexec proc /proc || fail "mount /proc"
mount -t sysfs -o nosuid,nodev,noexec sysfs /sys || fail "mount /sys"
mount -t devtmpfs -o nosuid,mode=0755 devtmpfs /dev || fail "mount /dev"

while read -r module; do
    [ -n "$module" ] || continue
    insmod "$module" || fail "insmod $module"
done < /modules.load

tries=0
while [ ! -b /dev/vda ]; do
    tries=$((tries + 1))
    [ "$tries" -le 500 ] || fail "no root disk /dev/vda after 10 s"
    sleep 0.02
done

# noinit_itable: the root disk reads as zeros wherever nothing was written
# (a fresh overlay), so the kernel zeroing the inode tables in the background
# (ext4lazyinit: hundreds of MiB once resize2fs grows the file system to the
# disk) would only burn CPU in every sandbox and grow its overlay.
# discard: what the guest deletes is passed down (QEMU's discard=unmap), so
# the host's overlay shrinks again instead of only ever growing.
mount -t ext4 -o rw,noinit_itable,discard /dev/vda /newroot || fail "mount /dev/vda on /newroot"
mount -t tmpfs -o mode=0755,nosuid,nodev tmpfs /newroot/run || fail "mount tmpfs on /newroot/run"
mkdir -m 0700 /newroot/run/sandpit || fail "mkdir /newroot/run/sandpit"
cp /sandpit-agent /newroot/run/sandpit/sandpit-agent || fail "copy the agent"
chmod 0755 /newroot/run/sandpit/sandpit-agent || fail "chmod the agent"
mount --move /dev /newroot/dev || fail "move /dev"
mount --move /proc /newroot/proc || fail "move /proc"
mount --move /sys /newroot/sys || fail "move /sys"
exec switch_root /newroot /run/sandpit/sandpit-agent
fail "switch_root"
"#;

/// Busybox applets the init script calls (symlinked in `/bin`).
pub(crate) const BUSYBOX_APPLETS: &[&str] = &[
    "sh",
    "mount",
    "insmod",
    "mkdir",
    "cp",
    "chmod",
    "sleep",
    "switch_root",
    "poweroff",
];

/// Modules the guest loads in the initramfs (plus their dependencies).
pub(crate) const GUEST_MODULES: &[Wanted] = &[
    Wanted {
        name: "virtio_mmio",
        required: true,
    },
    Wanted {
        name: "virtio_blk",
        required: true,
    },
    Wanted {
        name: "virtio_console",
        required: true,
    },
    Wanted {
        name: "virtio_net",
        required: true,
    },
    Wanted {
        name: "virtio_rng",
        required: true,
    },
    Wanted {
        name: "nfnetlink",
        required: true,
    },
    Wanted {
        name: "nf_tables",
        required: true,
    },
    Wanted {
        name: "nf_reject_ipv4",
        required: true,
    },
    Wanted {
        name: "nft_reject_inet",
        required: true,
    },
    Wanted {
        name: "nft_reject_ipv4",
        required: false,
    },
];

/// Everything that determines the root file system (stored as `recipe.json`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RootfsRecipe {
    /// [`BUILDER_VERSION`].
    pub builder_version: u32,
    /// Debian suite.
    pub suite: String,
    /// Debian mirror URL.
    pub mirror: String,
    /// Packages installed with apt (sorted, without duplicates).
    pub packages: Vec<String>,
    /// Packages debootstrap installs.
    pub debootstrap_include: Vec<String>,
    /// Size of the file system in bytes.
    pub size_bytes: u64,
    /// The host-side wrapper of the chroot phase.
    pub chroot_wrapper: String,
    /// The script run in the chroot.
    pub setup_script: String,
}

impl RootfsRecipe {
    pub(crate) fn new(suite: &str, mirror: &str, packages: &[String]) -> Self {
        let mut packages: Vec<String> = packages
            .iter()
            .map(|p| p.trim().to_string())
            .filter(|p| !p.is_empty())
            .collect();
        packages.sort();
        packages.dedup();
        Self {
            builder_version: BUILDER_VERSION,
            suite: suite.to_string(),
            mirror: mirror.trim_end_matches('/').to_string(),
            packages,
            debootstrap_include: DEBOOTSTRAP_INCLUDE.iter().map(|s| s.to_string()).collect(),
            size_bytes: ROOTFS_SIZE_BYTES,
            chroot_wrapper: CHROOT_WRAPPER.to_string(),
            setup_script: SETUP_SCRIPT.to_string(),
        }
    }

    pub(crate) fn id(&self) -> String {
        short_hash(self)
    }
}

/// Everything that determines an image on top of its root file system
/// (stored as `recipe.json` in the image directory).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageRecipe {
    /// [`BUILDER_VERSION`].
    pub builder_version: u32,
    /// The root file system's id.
    pub rootfs_id: String,
    /// The kernel (meta)package the kernel was resolved from.
    pub kernel_package: String,
    /// The initramfs's `/init`.
    pub init_script: String,
    /// Modules loaded by `/init` (name, required).
    pub modules: Vec<(String, bool)>,
    /// Busybox applet links in the initramfs.
    pub busybox_applets: Vec<String>,
    /// SHA-256 of the agent binary.
    pub agent_sha256: String,
}

impl ImageRecipe {
    pub(crate) fn new(rootfs_id: &str, kernel_package: &str, agent_sha256: &str) -> Self {
        Self {
            builder_version: BUILDER_VERSION,
            rootfs_id: rootfs_id.to_string(),
            kernel_package: kernel_package.to_string(),
            init_script: INIT_SCRIPT.to_string(),
            modules: GUEST_MODULES
                .iter()
                .map(|w| (w.name.to_string(), w.required))
                .collect(),
            busybox_applets: BUSYBOX_APPLETS.iter().map(|s| s.to_string()).collect(),
            agent_sha256: agent_sha256.to_string(),
        }
    }

    pub(crate) fn id(&self) -> String {
        short_hash(self)
    }
}

fn short_hash<T: Serialize>(value: &T) -> String {
    let json = serde_json::to_vec(value).expect("recipes serialize");
    let mut id = hex::encode(Sha256::digest(&json));
    id.truncate(ID_LEN);
    id
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pkgs(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn rootfs_id_is_stable() {
        let a = RootfsRecipe::new("bookworm", DEFAULT_MIRROR, &pkgs(DEFAULT_PACKAGES));
        let mut reversed = pkgs(DEFAULT_PACKAGES);
        reversed.reverse();
        reversed.push("git".into());
        let b = RootfsRecipe::new("bookworm", &format!("{DEFAULT_MIRROR}/"), &reversed);
        assert_eq!(
            a.id(),
            b.id(),
            "order, duplicates and a trailing slash do not matter"
        );
        assert_eq!(a.id().len(), 16);
        assert!(a.id().chars().all(|c| c.is_ascii_hexdigit()));
        // Same inputs in another process give the same id: nothing random or
        // map-ordered goes in.
        assert_eq!(
            a.id(),
            RootfsRecipe::new("bookworm", DEFAULT_MIRROR, &pkgs(DEFAULT_PACKAGES)).id()
        );
    }

    #[test]
    fn rootfs_id_changes_with_its_inputs() {
        let base = RootfsRecipe::new("bookworm", DEFAULT_MIRROR, &pkgs(DEFAULT_PACKAGES));
        let mut more = pkgs(DEFAULT_PACKAGES);
        more.push("tmux".into());
        let mut script = base.clone();
        script.setup_script.push_str("true\n");
        let mut version = base.clone();
        version.builder_version += 1;
        let others = [
            RootfsRecipe::new("trixie", DEFAULT_MIRROR, &pkgs(DEFAULT_PACKAGES)),
            RootfsRecipe::new(
                "bookworm",
                "http://mirror.example/debian",
                &pkgs(DEFAULT_PACKAGES),
            ),
            RootfsRecipe::new("bookworm", DEFAULT_MIRROR, &more),
            script,
            version,
        ];
        for other in others {
            assert_ne!(base.id(), other.id(), "{other:?}");
        }
    }

    #[test]
    fn image_id_covers_agent_and_kernel_but_not_more() {
        let a = ImageRecipe::new("r1", DEFAULT_KERNEL_PACKAGE, "aa");
        assert_eq!(
            a.id(),
            ImageRecipe::new("r1", DEFAULT_KERNEL_PACKAGE, "aa").id()
        );
        assert_ne!(
            a.id(),
            ImageRecipe::new("r1", DEFAULT_KERNEL_PACKAGE, "ab").id()
        );
        assert_ne!(
            a.id(),
            ImageRecipe::new("r2", DEFAULT_KERNEL_PACKAGE, "aa").id()
        );
        assert_ne!(
            a.id(),
            ImageRecipe::new("r1", "linux-image-amd64", "aa").id()
        );
        let mut init = a.clone();
        init.init_script.push('\n');
        assert_ne!(a.id(), init.id());
    }

    #[test]
    fn init_script_uses_only_linked_applets() {
        // Every external command the init script runs must be an applet we
        // link; shell builtins (echo, read, exec, ...) need no link.
        for cmd in [
            "mount ",
            "insmod ",
            "mkdir ",
            "cp ",
            "chmod ",
            "sleep ",
            "switch_root ",
            "poweroff ",
        ] {
            assert!(INIT_SCRIPT.contains(cmd));
            assert!(BUSYBOX_APPLETS.contains(&cmd.trim()), "{cmd}");
        }
    }
}
