//! `sandpit doctor`: is this host ready to run sandboxes, and if not, what
//! to do about it, line by line.
//!
//! Each check asks the same code the server uses (the accelerator choice,
//! QEMU's version gate, the guests' resolver, the admission budget, the
//! preview-name advice), so the report cannot disagree with what `serve`
//! then does. A check ends `ok`, `warn` (the service runs, worse: under
//! TCG, without KSM, with the clock adrift) or `fail` (something users
//! meet breaks: no QEMU, no guest DNS, preview URLs that programs cannot
//! open, no room for the warm pool). The exit status is 1 when any check
//! failed, so a script or a package's post-install can gate on it.

use anyhow::Result;
use sandpit_runtime::host::{self, accel};
use sandpit_runtime::vm::net;
use sandpit_runtime::AccelChoice;
use sandpit_server::settings::Settings;
use serde::Serialize;
use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

#[derive(clap::Args)]
pub struct DoctorArgs {
    /// One JSON object per check, then a summary object (for scripts)
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    Ok,
    Warn,
    Fail,
}

/// One line of the report.
#[derive(Debug, Serialize)]
pub struct Finding {
    pub check: &'static str,
    pub verdict: Verdict,
    /// What was found.
    pub found: String,
    /// What to do, when something should be done.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fix: Option<String>,
}

impl Finding {
    fn ok(check: &'static str, found: impl Into<String>) -> Finding {
        Finding {
            check,
            verdict: Verdict::Ok,
            found: found.into(),
            fix: None,
        }
    }
    fn warn(check: &'static str, found: impl Into<String>, fix: impl Into<String>) -> Finding {
        Finding::with_fix(Verdict::Warn, check, found.into(), fix.into())
    }
    fn fail(check: &'static str, found: impl Into<String>, fix: impl Into<String>) -> Finding {
        Finding::with_fix(Verdict::Fail, check, found.into(), fix.into())
    }
    /// A finding that asks for something; an empty `fix` is none.
    fn with_fix(verdict: Verdict, check: &'static str, found: String, fix: String) -> Finding {
        Finding {
            check,
            verdict,
            found,
            fix: Some(fix).filter(|f| !f.is_empty()),
        }
    }
}

/// Runs every check, prints the report, and returns the exit status.
pub fn run(settings: &Settings, args: DoctorArgs) -> Result<i32> {
    let findings = checks(settings);
    let failed = findings
        .iter()
        .filter(|f| f.verdict == Verdict::Fail)
        .count();
    let warned = findings
        .iter()
        .filter(|f| f.verdict == Verdict::Warn)
        .count();
    if args.json {
        for f in &findings {
            println!("{}", serde_json::to_string(f)?);
        }
        println!(
            "{}",
            serde_json::json!({"ready": failed == 0, "failed": failed, "warned": warned})
        );
    } else {
        println!(
            "sandpit {} doctor: data in {}",
            crate::VERSION,
            settings.data_dir.display()
        );
        for f in &findings {
            let tag = match f.verdict {
                Verdict::Ok => "ok  ",
                Verdict::Warn => "warn",
                Verdict::Fail => "FAIL",
            };
            println!("{tag}  {:<15} {}", f.check, f.found);
            if let Some(fix) = &f.fix {
                println!("      {:<15} -> {fix}", "");
            }
        }
        println!(
            "{}: {failed} failed, {warned} to look at, {} fine",
            if failed == 0 { "ready" } else { "not ready" },
            findings.len() - failed - warned
        );
    }
    Ok(if failed == 0 { 0 } else { 1 })
}

/// Every check, in the order an operator would fix them.
pub fn checks(settings: &Settings) -> Vec<Finding> {
    vec![
        root(),
        kvm(settings.runtime.accel),
        qemu(&settings.runtime.qemu_binary, settings.runtime.snapshots),
        passt(
            &settings.runtime.passt_binary,
            settings.runtime.network.enabled,
        ),
        nftables(),
        ksm(settings.runtime.ksm),
        preview_names(settings),
        guest_dns(settings),
        data_dir(&settings.data_dir),
        disk(settings),
        memory(settings),
        guest_image(&settings.images_dir),
        snapshot_memory(),
        listen(settings),
        clock(),
    ]
}

fn root() -> Finding {
    if nix::unistd::geteuid().is_root() {
        Finding::ok(
            "root",
            "running as root (VMs start under uids of their own)",
        )
    } else {
        Finding::fail(
            "root",
            format!("running as uid {}", nix::unistd::geteuid()),
            "run sandpit as root: each VM's QEMU runs under a uid of its own, behind an \
             nftables guard, which needs root to set up",
        )
    }
}

fn kvm(choice: AccelChoice) -> Finding {
    match (accel::kvm_diagnosis(), choice) {
        (Ok(()), AccelChoice::Tcg) => Finding::warn(
            "kvm",
            "usable, but the configuration says accel = \"tcg\"",
            "set accel = \"auto\" to run guests at hardware speed",
        ),
        (Ok(()), _) => Finding::ok("kvm", "usable: guests run at hardware speed"),
        (Err(why), AccelChoice::Kvm) => Finding::fail(
            "kvm",
            format!("not usable, yet the configuration says accel = \"kvm\": {why}"),
            "make KVM usable, or set accel = \"auto\" to fall back to TCG",
        ),
        (Err(why), _) => Finding::warn(
            "kvm",
            format!("not usable: {why}"),
            "guests run under TCG (software emulation): everything works, several times \
             slower; a host with KVM is the fix",
        ),
    }
}

/// The first line a tool prints for `--version`, or why it could not run.
fn tool_version(tool: &Path) -> std::result::Result<String, String> {
    let out = Command::new(tool)
        .arg("--version")
        .output()
        .map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&out.stdout);
    Ok(text.lines().next().unwrap_or_default().trim().to_string())
}

fn qemu(binary: &Path, snapshots: bool) -> Finding {
    let Ok(version) = sandpit_runtime::vm::qemu_version(binary) else {
        return Finding::fail(
            "qemu",
            format!("{} cannot be run", binary.display()),
            "apt-get install qemu-system-x86 qemu-utils (QEMU 10 from bookworm-backports: \
             scripts/install-deps.sh)",
        );
    };
    if let (true, Err(why)) = (
        snapshots && version.restores_templates(),
        version.saves_running_vms(),
    ) {
        return Finding::warn(
            "qemu",
            format!(
                "{}: restores templates, but cannot save running sandboxes",
                version.line
            ),
            why,
        );
    }
    if version.restores_templates() {
        Finding::ok(
            "qemu",
            format!(
                "{} (restores templates{})",
                version.line,
                if snapshots {
                    ""
                } else {
                    "; turned off: snapshots = false"
                }
            ),
        )
    } else {
        Finding::warn(
            "qemu",
            format!("{}: older than 8.2, cannot restore templates", version.line),
            "every create boots cold (seconds instead of milliseconds): install QEMU 10 \
             from bookworm-backports (scripts/install-deps.sh)",
        )
    }
}

/// The version of the Debian package that holds `binary`, if one does.
fn package_version(binary: &Path) -> Option<String> {
    // A bare name (the default, `passt`) is the one `PATH` finds.
    let found = if binary.components().count() > 1 {
        binary.to_path_buf()
    } else {
        std::env::split_paths(&std::env::var_os("PATH")?)
            .map(|dir| dir.join(binary))
            .find(|p| p.is_file())?
    };
    // dpkg knows a file by the path its package gave, which on a merged
    // `/usr` may be the link's (`/bin/x`) or the target's (`/usr/bin/x`).
    let real = std::fs::canonicalize(&found).ok()?;
    let owner = [found, real].iter().find_map(|path| {
        let out = Command::new("dpkg-query")
            .arg("-S")
            .arg(path)
            .output()
            .ok()?;
        let owner = String::from_utf8_lossy(&out.stdout);
        let package = owner.split(':').next()?.trim().to_string();
        (out.status.success() && !package.is_empty()).then_some(package)
    })?;
    let package = owner.as_str();
    let version = Command::new("dpkg-query")
        .args(["-W", "-f", "${Version}", package])
        .output()
        .ok()?;
    let version = String::from_utf8_lossy(&version.stdout).trim().to_string();
    (!version.is_empty()).then(|| format!("{package} {version}"))
}

fn passt(binary: &Path, network: bool) -> Finding {
    match tool_version(binary) {
        // Debian's passt builds say "passt unknown version": its package knows.
        Ok(line) if line.contains("unknown version") => {
            let version = package_version(binary).unwrap_or(line);
            Finding::ok("passt", format!("{version} (the guests' network)"))
        }
        Ok(line) => Finding::ok("passt", format!("{line} (the guests' network)")),
        Err(e) if network => Finding::fail(
            "passt",
            format!("{} cannot be run: {e}", binary.display()),
            "apt-get install passt: without it no sandbox with a network starts",
        ),
        Err(e) => Finding::ok(
            "passt",
            format!("missing ({e}), not needed: [network] enabled = false"),
        ),
    }
}

fn nftables() -> Finding {
    let version = match tool_version(Path::new("nft")) {
        Ok(v) => v,
        Err(e) => {
            return Finding::fail(
                "nftables",
                format!("nft cannot be run: {e}"),
                "apt-get install nftables: the guard that keeps guests off the host's own \
                 services and private networks is an nftables table",
            )
        }
    };
    match Command::new("nft").args(["list", "tables"]).output() {
        Ok(out) if out.status.success() => Finding::ok("nftables", version),
        Ok(out) => Finding::fail(
            "nftables",
            format!(
                "{version}, but `nft list tables` failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ),
            "run as root with CAP_NET_ADMIN (in a container: --cap-add NET_ADMIN)",
        ),
        Err(e) => Finding::fail("nftables", e.to_string(), "apt-get install nftables"),
    }
}

fn ksm(wanted: bool) -> Finding {
    let run = std::fs::read_to_string("/sys/kernel/mm/ksm/run").map(|s| s.trim().to_string());
    match (run.as_deref(), wanted) {
        (Err(_), _) => Finding::warn(
            "ksm",
            "this kernel has no KSM (/sys/kernel/mm/ksm)",
            "each sandbox's network helper keeps its own pages: a few MiB more per sandbox",
        ),
        (Ok(_), false) => Finding::ok("ksm", "left alone: ksm = false"),
        (Ok("1"), true) => Finding::ok("ksm", "on; serve paces it to the sandboxes"),
        (Ok(state), true) => Finding::ok(
            "ksm",
            format!("off now (run = {state}); serve turns it on and paces it"),
        ),
    }
}

fn preview_names(settings: &Settings) -> Finding {
    let listen: Option<SocketAddr> = settings
        .listen
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next());
    // As serve does: unset, the domain is `localhost:PORT` of the listener.
    let domain = if settings.preview_domain_set {
        settings.service.preview_domain.clone()
    } else {
        format!("localhost:{}", listen.map_or(8080, |a| a.port()))
    };
    let (name, port) =
        sandpit_server::listener::probe_name(&domain, &settings.service.preview_scheme);
    let resolved: std::io::Result<Vec<IpAddr>> = (name.as_str(), port)
        .to_socket_addrs()
        .map(|addrs| addrs.map(|a| a.ip()).collect());
    // What serve binds: the address and its loopback companions.
    let listening: Vec<SocketAddr> = listen
        .into_iter()
        .flat_map(|a| std::iter::once(a).chain(sandpit_server::listener::loopback_companions(a)))
        .collect();
    match sandpit_server::listener::preview_name_advice(&name, &resolved, &listening) {
        None => Finding::ok(
            "preview names",
            format!(
                "{name} resolves to {} for every program (the system resolver)",
                resolved
                    .map(|a| a
                        .iter()
                        .map(|ip| ip.to_string())
                        .collect::<Vec<_>>()
                        .join(", "))
                    .unwrap_or_default()
            ),
        ),
        Some(advice) => Finding::fail(
            "preview names",
            format!("{name} does not resolve to this server for programs"),
            advice,
        ),
    }
}

fn guest_dns(settings: &Settings) -> Finding {
    let network = &settings.runtime.network;
    if !network.enabled {
        return Finding::ok("guest dns", "no guest network: [network] enabled = false");
    }
    if let Some(servers) = network.dns.as_ref().filter(|s| !s.is_empty()) {
        return Finding::ok(
            "guest dns",
            format!("guests use {} ([network] dns)", servers.join(", ")),
        );
    }
    let conf = std::fs::read_to_string("/etc/resolv.conf").unwrap_or_default();
    match net::host_resolver(&conf) {
        Some(upstream) => Finding::ok(
            "guest dns",
            format!(
                "guests ask {}, which passt forwards to {upstream} (the first IPv4 \
                 nameserver of /etc/resolv.conf)",
                net::GUEST_DNS_FORWARD
            ),
        ),
        None => Finding::fail(
            "guest dns",
            "/etc/resolv.conf names no IPv4 nameserver: guests cannot resolve names \
             (apt, pip, npm, git fail in them)",
            "add an IPv4 nameserver to /etc/resolv.conf, or set [network] dns = \
             [\"IP\", ...] in the configuration",
        ),
    }
}

/// The directory itself, or its nearest existing ancestor (where it would
/// be created).
fn existing_ancestor(path: &Path) -> Option<PathBuf> {
    path.ancestors().find(|p| p.exists()).map(Path::to_path_buf)
}

fn data_dir(dir: &Path) -> Finding {
    let check = "data directory";
    if let Err(why) = sandpit_runtime::config::check_data_dir(dir) {
        return Finding::fail(check, why, "");
    }
    let Some(at) = existing_ancestor(dir) else {
        return Finding::fail(
            check,
            format!("{}: no part of it exists", dir.display()),
            "",
        );
    };
    let meta = match std::fs::metadata(&at) {
        Ok(m) => m,
        Err(e) => return Finding::fail(check, format!("{}: {e}", at.display()), "fix its path"),
    };
    let mode = meta.permissions().mode() & 0o7777;
    let me = nix::unistd::geteuid().as_raw();
    if at != dir {
        return Finding::ok(
            check,
            format!(
                "{} does not exist yet; serve creates it under {}",
                dir.display(),
                at.display()
            ),
        );
    }
    if !meta.is_dir() {
        return Finding::fail(
            check,
            format!("{} is not a directory", dir.display()),
            "point --data-dir (SANDPIT_DATA_DIR) at a directory",
        );
    }
    if mode & 0o022 != 0 {
        return Finding::fail(
            check,
            format!(
                "{} is writable by others (mode {mode:o}): anyone on the host could replace \
                 disks, templates or the database",
                dir.display()
            ),
            format!("chmod go-w {}", dir.display()),
        );
    }
    if meta.uid() != me {
        return Finding::fail(
            check,
            format!(
                "{} belongs to uid {}, not to this user ({me})",
                dir.display(),
                meta.uid()
            ),
            format!("chown {me} {}", dir.display()),
        );
    }
    let probe = dir.join(format!(".doctor-{}", std::process::id()));
    if let Err(e) = std::fs::write(&probe, b"") {
        return Finding::fail(
            check,
            format!("{} cannot be written: {e}", dir.display()),
            "a read-only or full filesystem: give sandpit a writable one",
        );
    }
    let _ = std::fs::remove_file(&probe);
    // VMs' QEMUs serve unix sockets in their directories here.
    if let Err(e) = sandpit_runtime::vm::probe_socket(dir) {
        return Finding::fail(
            check,
            format!("{} cannot hold unix sockets: {e}", dir.display()),
            "a filesystem without unix sockets: give sandpit a local one",
        );
    }
    Finding::ok(
        check,
        format!(
            "{} (mode {mode:o}, this user's, writable, unix sockets work)",
            dir.display()
        ),
    )
}

/// Free bytes for an unprivileged user on the filesystem holding `path`.
fn free_bytes(path: &Path) -> Option<u64> {
    let st = nix::sys::statvfs::statvfs(path).ok()?;
    Some(st.blocks_available() as u64 * st.fragment_size() as u64)
}

/// The guest image's build needs about this much (debootstrap's tree, the
/// root filesystem and its qcow2), MiB.
const IMAGE_BUILD_MB: u64 = 3 * 1024;

fn disk(settings: &Settings) -> Finding {
    let at = existing_ancestor(&settings.data_dir).unwrap_or_else(|| PathBuf::from("/"));
    let Some(free_mb) = free_bytes(&at).map(|b| b >> 20) else {
        return Finding::fail(
            "disk",
            format!("cannot read free space of {}", at.display()),
            "",
        );
    };
    let reserve = settings.runtime.disk_reserve_mb;
    let image_built = sandpit_server::images::existing(&settings.images_dir).is_ok();
    let needed = reserve + if image_built { 0 } else { IMAGE_BUILD_MB };
    let found = format!(
        "{free_mb} MiB free at {} (kept free: {reserve} MiB{})",
        at.display(),
        if image_built {
            ""
        } else {
            ", and ~3 GiB to build the guest image"
        }
    );
    if free_mb < needed {
        Finding::fail(
            "disk",
            found,
            "free space, or lower [limits] disk_reserve_mb: below the reserve no VM starts",
        )
    } else if free_mb < needed + 10 * 1024 {
        Finding::warn(
            "disk",
            found,
            "less than 10 GiB above what is kept: sandboxes' disks grow as guests write",
        )
    } else {
        Finding::ok("disk", found)
    }
}

fn memory(settings: &Settings) -> Finding {
    let Some(mem) = host::memory() else {
        return Finding::fail("memory", "cannot read /proc/meminfo", "");
    };
    let reserve = settings.capacity.reserve_mb(mem.total_mb);
    let pool: usize = settings.pool.sizes.values().sum();
    let pool_mb = pool as u64 * settings.capacity.memory_per_start_mb;
    let found = format!(
        "{} MiB available of {} MiB; kept for the host: {reserve} MiB; the warm pool of {pool} \
         VM(s) starts with up to {pool_mb} MiB",
        mem.available_mb, mem.total_mb
    );
    if mem.available_mb < reserve + pool_mb {
        Finding::fail(
            "memory",
            found,
            "every create would be refused (503): free memory, or lower [capacity] \
             memory_reserve_mb or the [pool] sizes",
        )
    } else {
        Finding::ok("memory", found)
    }
}

fn guest_image(images_dir: &Path) -> Finding {
    match sandpit_server::images::existing(images_dir) {
        Ok(img) => Finding::ok(
            "guest image",
            format!("{} (kernel {})", img.id, img.kernel_release),
        ),
        Err(e) => Finding::warn(
            "guest image",
            format!("not built: {e:#}"),
            "`sandpit image build` (a few minutes, once); serve builds it on its first start",
        ),
    }
}

fn snapshot_memory() -> Finding {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|r| r.trim().to_string())
        .unwrap_or_else(|_| "?".into());
    match sandpit_runtime::probe_file_backed_erofs() {
        Ok(()) => Finding::ok(
            "snapshot memory",
            format!(
                "Linux {release} composes a save's memory from files (file-backed EROFS): \
                 sandboxes from one snapshot share its pages"
            ),
        ),
        Err(e) => Finding::warn(
            "snapshot memory",
            format!("Linux {release} cannot mount EROFS over plain files: {e}"),
            "sandboxes from snapshots and forks then copy the saved memory instead of \
             sharing it: run Linux 6.12 or later with CONFIG_EROFS_FS (on Debian 12, \
             the bookworm-backports kernel)",
        ),
    }
}

fn listen(settings: &Settings) -> Finding {
    let addr = &settings.listen;
    let port = addr.rsplit(':').next().unwrap_or(addr);
    let change = "or set `listen` in the configuration (or SANDPIT_LISTEN)";
    match std::net::TcpListener::bind(addr.as_str()) {
        Ok(_) => Finding::ok("listen", format!("{addr} is free for sandpit serve")),
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
            let another = || {
                Finding::fail(
                    "listen",
                    format!("{addr} is taken by another program"),
                    format!("stop it (`ss -ltnp 'sport = :{port}'` names it), {change}"),
                )
            };
            // This data directory's server is fine only if the socket on
            // the port is its own: it may listen elsewhere.
            let serve = sandpit_server::owner::holder(&settings.data_dir)
                .filter(|(_, role)| role == "sandpit serve");
            let Some((pid, _)) = serve else {
                return another();
            };
            match port.parse().map(|port| holds_listener(pid, port)) {
                Ok(Some(true)) => Finding::ok(
                    "listen",
                    format!("{addr} is taken, by this data directory's sandpit serve (pid {pid})"),
                ),
                Ok(Some(false)) | Err(_) => another(),
                Ok(None) => Finding::warn(
                    "listen",
                    format!(
                        "{addr} is taken; this data directory's sandpit serve (pid {pid}) runs, \
                         but whether the port is its own cannot be read as this user"
                    ),
                    format!(
                        "run `sandpit doctor` as root or as the server's user to tell, {change}"
                    ),
                ),
            }
        }
        Err(e) => Finding::fail(
            "listen",
            format!("cannot listen on {addr}: {e}"),
            format!("use an address of this host and a free port: {change}"),
        ),
    }
}

/// Whether process `pid` holds a TCP socket listening on `port`: the
/// listening sockets' inodes (`/proc/net/tcp`, `tcp6`) among its open
/// files. `None` when its files cannot be read (another user's process).
fn holds_listener(pid: i32, port: u16) -> Option<bool> {
    const LISTEN: &str = "0A";
    let inodes: HashSet<String> = ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .filter_map(|table| std::fs::read_to_string(table).ok())
        .flat_map(|table| {
            table
                .lines()
                .skip(1)
                .filter_map(|line| {
                    let fields: Vec<&str> = line.split_whitespace().collect();
                    let local_port = fields.get(1)?.rsplit(':').next()?;
                    let listens = u16::from_str_radix(local_port, 16).ok()? == port
                        && *fields.get(3)? == LISTEN;
                    listens.then(|| fields.get(9).map(|inode| inode.to_string()))?
                })
                .collect::<Vec<_>>()
        })
        .collect();
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?;
    Some(fds.flatten().any(|fd| {
        std::fs::read_link(fd.path()).is_ok_and(|target| {
            target
                .to_str()
                .and_then(|t| t.strip_prefix("socket:[")?.strip_suffix(']'))
                .is_some_and(|inode| inodes.contains(inode))
        })
    }))
}

fn clock() -> Finding {
    // SAFETY: adjtimex with `modes = 0` only reads the kernel's clock state.
    let mut tx: libc::timex = unsafe { std::mem::zeroed() };
    let state = unsafe { libc::adjtimex(&mut tx) };
    if state < 0 {
        return Finding::warn(
            "clock",
            format!(
                "cannot read the clock's state: {}",
                std::io::Error::last_os_error()
            ),
            "",
        );
    }
    if state == libc::TIME_ERROR || tx.status & libc::STA_UNSYNC != 0 {
        Finding::warn(
            "clock",
            "not synchronised (the kernel has no time source's word on it)",
            "run an NTP client (systemd-timesyncd or chrony): every guest takes the host's \
             clock when it starts, and billing and expiry read it",
        )
    } else {
        Finding::ok(
            "clock",
            format!(
                "synchronised (estimated error {} ms)",
                tx.esterror.max(0) / 1000
            ),
        )
    }
}
