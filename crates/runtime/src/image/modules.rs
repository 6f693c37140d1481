//! Kernel modules for the initramfs: which files to load, in which order.
//!
//! Debian's cloud kernel builds virtio (and nftables) as modules, so the
//! initramfs must `insmod` them, dependencies first. The order comes from
//! `modules.dep`, never from a hard-coded list, so a new kernel with a
//! different dependency graph still boots. Debian's kernel package does not
//! ship `modules.dep` (its postinst runs `depmod`), and the host may have no
//! `depmod`, so when the file is missing it is generated here from each
//! module's `.modinfo` section (`depends=`, the list `modpost` computed from
//! the module's symbols, which is what `depmod` derives too). Compressed
//! modules (`.ko.xz`, `.ko.zst`, `.ko.gz`) are decompressed once in the
//! cache, because busybox `insmod` loads plain ELF files only.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs;
use std::path::{Path, PathBuf};

use super::error::{ImageError, IoContext};
use super::exec::{self, BuildLog, Tool};

/// Module name as the kernel knows it: file stem with `-` read as `_`.
pub(crate) fn module_name(path: &str) -> String {
    let file = path.rsplit('/').next().unwrap_or(path);
    let stem = strip_compression(file);
    let stem = stem.strip_suffix(".ko").unwrap_or(stem);
    stem.replace('-', "_")
}

fn strip_compression(file: &str) -> &str {
    for ext in [".xz", ".zst", ".gz"] {
        if let Some(stem) = file.strip_suffix(ext) {
            if stem.ends_with(".ko") {
                return stem;
            }
        }
    }
    file
}

/// The `depends=` list of a module's `.modinfo` section (an ELF64
/// little-endian relocatable object, as on x86_64).
pub(crate) fn modinfo_depends(bytes: &[u8]) -> Result<Vec<String>, String> {
    let u16_at = |off: usize| -> Result<u16, String> {
        bytes
            .get(off..off + 2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .ok_or_else(|| "truncated ELF".to_string())
    };
    let u32_at = |off: usize| -> Result<u32, String> {
        bytes
            .get(off..off + 4)
            .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")))
            .ok_or_else(|| "truncated ELF".to_string())
    };
    let u64_at = |off: usize| -> Result<usize, String> {
        bytes
            .get(off..off + 8)
            .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")) as usize)
            .ok_or_else(|| "truncated ELF".to_string())
    };
    if bytes.get(..4) != Some(b"\x7fELF") {
        return Err("no ELF magic (compressed?)".into());
    }
    if bytes.get(4) != Some(&2) || bytes.get(5) != Some(&1) {
        return Err("not a 64-bit little-endian ELF file".into());
    }
    let shoff = u64_at(0x28)?;
    let shentsize = usize::from(u16_at(0x3A)?);
    let shnum = usize::from(u16_at(0x3C)?);
    let shstrndx = usize::from(u16_at(0x3E)?);
    if shentsize < 0x28 {
        return Err("bad section header size".into());
    }
    let section = |i: usize| -> Result<(u32, usize, usize), String> {
        let base = shoff
            .checked_add(i.checked_mul(shentsize).ok_or("overflow")?)
            .ok_or("overflow")?;
        Ok((u32_at(base)?, u64_at(base + 0x18)?, u64_at(base + 0x20)?))
    };
    let slice = |off: usize, size: usize| -> Result<&[u8], String> {
        bytes
            .get(off..off.checked_add(size).ok_or("overflow")?)
            .ok_or_else(|| "section outside the file".to_string())
    };
    let (_, stroff, strsize) = section(shstrndx)?;
    let strtab = slice(stroff, strsize)?;
    for i in 0..shnum {
        let (name_off, off, size) = section(i)?;
        let name = strtab
            .get(name_off as usize..)
            .and_then(|s| s.split(|&b| b == 0).next())
            .unwrap_or_default();
        if name != b".modinfo" {
            continue;
        }
        let info = slice(off, size)?;
        for field in info.split(|&b| b == 0) {
            if let Some(list) = field.strip_prefix(b"depends=") {
                let list = String::from_utf8_lossy(list);
                return Ok(list
                    .split(',')
                    .filter(|s| !s.is_empty())
                    .map(|s| s.replace('-', "_"))
                    .collect());
            }
        }
        return Ok(Vec::new());
    }
    Err("no .modinfo section".into())
}

/// Makes `moddir` (a `lib/modules/<release>` tree) ready for use: plain
/// `.ko` files and a `modules.dep`.
pub(crate) fn prepare_tree(moddir: &Path, log: &mut BuildLog) -> Result<(), ImageError> {
    let mut files = Vec::new();
    walk(moddir, &mut files).ctx(|| format!("listing {}", moddir.display()))?;
    let mut compressed: BTreeMap<&str, Vec<PathBuf>> = BTreeMap::new();
    for f in &files {
        let name = f.to_string_lossy();
        for ext in ["xz", "zst", "gz"] {
            if name.ends_with(&format!(".ko.{ext}")) {
                compressed.entry(ext).or_default().push(f.clone());
            }
        }
    }
    for (ext, list) in &compressed {
        let (tool, args): (Tool, &[&str]) = match *ext {
            "xz" => (exec::XZ, &["-d", "-q", "--"]),
            "zst" => (exec::ZSTD, &["-d", "-q", "--rm", "--"]),
            _ => (exec::GZIP, &["-d", "-q", "--"]),
        };
        log.note(&format!("decompressing {} .ko.{ext} modules", list.len()))?;
        for chunk in list.chunks(256) {
            log.run(exec::command(tool)?.args(args).args(chunk))?;
        }
    }

    let dep_path = moddir.join("modules.dep");
    if dep_path.exists() {
        if !compressed.is_empty() {
            // A shipped modules.dep names the compressed files; we just
            // decompressed them in place.
            let text =
                fs::read_to_string(&dep_path).ctx(|| format!("reading {}", dep_path.display()))?;
            let text: String = text
                .lines()
                .map(|line| {
                    let words: Vec<&str> = line.split(' ').map(strip_compression).collect();
                    let mut line = words.join(" ");
                    if let Some((head, rest)) = line.split_once(':') {
                        line = format!("{}:{rest}", strip_compression(head));
                    }
                    line + "\n"
                })
                .collect();
            fs::write(&dep_path, text).ctx(|| format!("writing {}", dep_path.display()))?;
        }
        return Ok(());
    }
    log.note("no modules.dep in the package; generating it from .modinfo")?;
    let mut files = Vec::new();
    walk(moddir, &mut files).ctx(|| format!("listing {}", moddir.display()))?;
    let mut modules = Vec::new();
    for f in files {
        if !f.to_string_lossy().ends_with(".ko") {
            continue;
        }
        let bytes = fs::read(&f).ctx(|| format!("reading {}", f.display()))?;
        let deps = modinfo_depends(&bytes).map_err(|reason| ImageError::BadModule {
            path: f.clone(),
            reason,
        })?;
        let rel = f
            .strip_prefix(moddir)
            .expect("walk stays inside")
            .to_string_lossy()
            .into_owned();
        modules.push((rel, deps));
    }
    let text = generate_modules_dep(&modules)?;
    fs::write(&dep_path, text).ctx(|| format!("writing {}", dep_path.display()))
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    let mut entries: Vec<_> = fs::read_dir(dir)?.collect::<Result<_, _>>()?;
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        let ty = entry.file_type()?;
        if ty.is_dir() {
            walk(&entry.path(), out)?;
        } else if ty.is_file() {
            out.push(entry.path());
        }
    }
    Ok(())
}

/// Writes `modules.dep` in depmod's format: `path: deps...`, each line
/// listing all transitive dependencies, in the order modprobe loads them
/// backwards (the last one first).
pub(crate) fn generate_modules_dep(
    modules: &[(String, Vec<String>)],
) -> Result<String, ImageError> {
    let by_name: HashMap<String, usize> = modules
        .iter()
        .enumerate()
        .map(|(i, (path, _))| (module_name(path), i))
        .collect();
    let direct = |i: usize| -> Vec<usize> {
        modules[i]
            .1
            .iter()
            .filter_map(|d| by_name.get(d.as_str()).copied())
            .collect()
    };
    let mut text = String::new();
    for (i, (path, _)) in modules.iter().enumerate() {
        let mut order = Vec::new();
        let mut state = HashMap::new();
        for d in direct(i) {
            topo(d, &direct, &mut state, &mut order, &|j| {
                module_name(&modules[j].0)
            })?;
        }
        text.push_str(path);
        text.push(':');
        for j in order.iter().rev() {
            text.push(' ');
            text.push_str(&modules[*j].0);
        }
        text.push('\n');
    }
    Ok(text)
}

/// Depth-first post-order: dependencies before dependents.
fn topo<F, N>(
    node: usize,
    edges: &F,
    state: &mut HashMap<usize, bool>,
    order: &mut Vec<usize>,
    name: &N,
) -> Result<(), ImageError>
where
    F: Fn(usize) -> Vec<usize>,
    N: Fn(usize) -> String,
{
    match state.get(&node) {
        Some(true) => return Ok(()),
        Some(false) => return Err(ImageError::ModuleCycle(name(node))),
        None => {}
    }
    state.insert(node, false);
    for next in edges(node) {
        topo(next, edges, state, order, name)?;
    }
    state.insert(node, true);
    order.push(node);
    Ok(())
}

/// A module the guest wants, and whether the build fails without it.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub(crate) struct Wanted {
    pub name: &'static str,
    pub required: bool,
}

/// Resolves `wanted` against a `modules.dep` and `modules.builtin` text:
/// the module files (paths relative to the modules dir) in load order,
/// dependencies first, each once. Built-in modules are skipped; a missing
/// optional module is skipped; a missing required one is an error.
pub(crate) fn resolve_load_order(
    modules_dep: &str,
    modules_builtin: &str,
    wanted: &[Wanted],
    kernel_release: &str,
) -> Result<Vec<String>, ImageError> {
    let mut paths: Vec<String> = Vec::new();
    let mut deps: Vec<Vec<String>> = Vec::new();
    let mut by_name: HashMap<String, usize> = HashMap::new();
    for line in modules_dep.lines() {
        let Some((path, rest)) = line.split_once(':') else {
            continue;
        };
        by_name.insert(module_name(path), paths.len());
        paths.push(path.trim().to_string());
        deps.push(rest.split_whitespace().map(str::to_string).collect());
    }
    let builtin: HashSet<String> = modules_builtin
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(module_name)
        .collect();
    // modules.dep lists each module's transitive dependencies in reverse
    // load order; walking them reversed, depth first, gives modprobe's order
    // and stays correct even if a line's order were not.
    let edges = |i: usize| -> Vec<usize> {
        deps[i]
            .iter()
            .rev()
            .filter_map(|d| by_name.get(&module_name(d)).copied())
            .collect()
    };
    let mut state = HashMap::new();
    let mut order = Vec::new();
    for w in wanted {
        let name = w.name.replace('-', "_");
        if let Some(&i) = by_name.get(&name) {
            topo(i, &edges, &mut state, &mut order, &|j| {
                module_name(&paths[j])
            })?;
        } else if builtin.contains(&name) {
            tracing::debug!(module = %name, "built into the kernel");
        } else if w.required {
            return Err(ImageError::ModuleMissing {
                module: name,
                kernel_release: kernel_release.to_string(),
            });
        }
    }
    Ok(order.into_iter().map(|i| paths[i].clone()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEP: &str = "\
kernel/drivers/virtio/virtio_ring.ko:
kernel/drivers/virtio/virtio.ko:
kernel/drivers/virtio/virtio_mmio.ko: kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko
kernel/drivers/block/virtio_blk.ko: kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko
kernel/drivers/char/hw_random/virtio-rng.ko: kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko
kernel/net/netfilter/nfnetlink.ko:
kernel/lib/libcrc32c.ko:
kernel/net/netfilter/nf_tables.ko: kernel/net/netfilter/nfnetlink.ko kernel/lib/libcrc32c.ko
kernel/net/netfilter/nft_reject.ko: kernel/net/netfilter/nf_tables.ko kernel/net/netfilter/nfnetlink.ko kernel/lib/libcrc32c.ko
kernel/net/netfilter/nft_reject_inet.ko: kernel/net/netfilter/nft_reject.ko kernel/net/netfilter/nf_tables.ko kernel/net/netfilter/nfnetlink.ko kernel/lib/libcrc32c.ko
";
    const BUILTIN: &str = "kernel/fs/ext4/ext4.ko\nkernel/drivers/virtio/virtio_console.ko\n";

    fn w(name: &'static str, required: bool) -> Wanted {
        Wanted { name, required }
    }

    fn pos(order: &[String], name: &str) -> usize {
        order
            .iter()
            .position(|p| module_name(p) == name)
            .unwrap_or_else(|| panic!("{name} not in {order:?}"))
    }

    #[test]
    fn dependencies_first_each_once() {
        let wanted = [
            w("virtio_mmio", true),
            w("virtio_blk", true),
            w("virtio_console", true),
            w("virtio_rng", true),
            w("nft_reject_inet", true),
            w("nft_reject_ipv4", false),
        ];
        let order = resolve_load_order(DEP, BUILTIN, &wanted, "test").unwrap();
        let names: Vec<String> = order.iter().map(|p| module_name(p)).collect();
        assert_eq!(
            names,
            [
                "virtio_ring",
                "virtio",
                "virtio_mmio",
                "virtio_blk",
                "virtio_rng",
                "libcrc32c",
                "nfnetlink",
                "nf_tables",
                "nft_reject",
                "nft_reject_inet"
            ]
        );
        assert!(pos(&order, "nf_tables") < pos(&order, "nft_reject"));
        assert!(order.iter().any(|p| p.ends_with("virtio-rng.ko")));
    }

    #[test]
    fn missing_required_module_is_an_error() {
        let err =
            resolve_load_order(DEP, BUILTIN, &[w("virtio_net", true)], "6.1.0-test").unwrap_err();
        assert!(
            matches!(err, ImageError::ModuleMissing { ref module, .. } if module == "virtio_net"),
            "{err}"
        );
        assert!(
            resolve_load_order(DEP, BUILTIN, &[w("virtio_net", false)], "t")
                .unwrap()
                .is_empty()
        );
    }

    #[test]
    fn cycle_is_an_error() {
        let dep = "a.ko: b.ko\nb.ko: a.ko\n";
        let err = resolve_load_order(dep, "", &[w("a", true)], "t").unwrap_err();
        assert!(matches!(err, ImageError::ModuleCycle(_)));
    }

    /// A minimal ELF64 relocatable object with a `.modinfo` section.
    fn fake_module(depends: &str) -> Vec<u8> {
        let shstrtab = b"\0.shstrtab\0.modinfo\0".to_vec();
        let modinfo = format!("license=GPL\0depends={depends}\0name=x\0").into_bytes();
        let mut elf = vec![0u8; 64];
        elf[..4].copy_from_slice(b"\x7fELF");
        elf[4] = 2;
        elf[5] = 1;
        let str_off = elf.len();
        elf.extend_from_slice(&shstrtab);
        let info_off = elf.len();
        elf.extend_from_slice(&modinfo);
        while elf.len() & 7 != 0 {
            elf.push(0);
        }
        let shoff = elf.len();
        let mut sh = |name: u32, off: usize, size: usize| {
            let mut h = vec![0u8; 64];
            h[..4].copy_from_slice(&name.to_le_bytes());
            h[0x18..0x20].copy_from_slice(&(off as u64).to_le_bytes());
            h[0x20..0x28].copy_from_slice(&(size as u64).to_le_bytes());
            elf.extend_from_slice(&h);
        };
        sh(0, 0, 0);
        sh(1, str_off, shstrtab.len());
        sh(11, info_off, modinfo.len());
        elf[0x28..0x30].copy_from_slice(&(shoff as u64).to_le_bytes());
        elf[0x3A..0x3C].copy_from_slice(&64u16.to_le_bytes());
        elf[0x3C..0x3E].copy_from_slice(&3u16.to_le_bytes());
        elf[0x3E..0x40].copy_from_slice(&1u16.to_le_bytes());
        elf
    }

    #[test]
    fn reads_modinfo_depends() {
        assert_eq!(
            modinfo_depends(&fake_module("virtio,virtio_ring")).unwrap(),
            ["virtio", "virtio_ring"]
        );
        assert!(modinfo_depends(&fake_module("")).unwrap().is_empty());
        assert!(modinfo_depends(b"\xfd7zXZ\0").is_err());
        let mut truncated = fake_module("a");
        truncated.truncate(100);
        assert!(modinfo_depends(&truncated).is_err());
    }

    #[test]
    fn generated_modules_dep_resolves_like_depmod_output() {
        let modules = vec![
            (
                "kernel/a/nft_reject_inet.ko".to_string(),
                vec!["nf_tables".into(), "nft_reject".into()],
            ),
            (
                "kernel/a/nft_reject.ko".to_string(),
                vec!["nf_tables".into()],
            ),
            (
                "kernel/a/nf_tables.ko".to_string(),
                vec!["nfnetlink".into()],
            ),
            ("kernel/a/nfnetlink.ko".to_string(), vec![]),
        ];
        let dep = generate_modules_dep(&modules).unwrap();
        assert!(dep.contains(
            "kernel/a/nft_reject_inet.ko: kernel/a/nft_reject.ko kernel/a/nf_tables.ko kernel/a/nfnetlink.ko\n"
        ));
        let order = resolve_load_order(&dep, "", &[w("nft_reject_inet", true)], "t").unwrap();
        assert_eq!(
            order,
            [
                "kernel/a/nfnetlink.ko",
                "kernel/a/nf_tables.ko",
                "kernel/a/nft_reject.ko",
                "kernel/a/nft_reject_inet.ko"
            ]
        );
    }

    #[test]
    fn prepare_tree_generates_modules_dep() {
        let dir = tempfile::tempdir().unwrap();
        let moddir = dir.path().join("6.1.0-test");
        fs::create_dir_all(moddir.join("kernel/drivers")).unwrap();
        fs::write(moddir.join("kernel/drivers/virtio.ko"), fake_module("")).unwrap();
        fs::write(
            moddir.join("kernel/drivers/virtio_blk.ko"),
            fake_module("virtio"),
        )
        .unwrap();
        let mut log = BuildLog::create(dir.path()).unwrap();
        log.begin_step("test").unwrap();
        prepare_tree(&moddir, &mut log).unwrap();
        let dep = fs::read_to_string(moddir.join("modules.dep")).unwrap();
        assert_eq!(
            dep,
            "kernel/drivers/virtio.ko:\nkernel/drivers/virtio_blk.ko: kernel/drivers/virtio.ko\n"
        );
    }
}
