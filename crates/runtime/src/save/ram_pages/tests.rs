use super::*;

const TABLE: &str = "              Block Name    PSize              Offset               Used              Total                HVA  RO
                 ram    4 KiB  0x0000000000000000 0x0000000100000000 0x0000000100000000 0x00007f447ffff000  rw
/rom@etc/acpi/tables    4 KiB  0x0000000100040000 0x0000000000001000 0x0000000000200000 0x00007f4589000000  ro
             pc.bios    4 KiB  0x0000000100000000 0x0000000000020000 0x0000000000020000 0x00007f4589400000  rw
";

#[test]
fn qemus_block_table_is_read() {
    let blocks = parse_ramblocks(TABLE).unwrap();
    assert_eq!(
        blocks,
        vec![
            Block {
                name: "ram".into(),
                length: 0x1_0000_0000,
                hva: 0x7f44_7fff_f000,
                writable: true
            },
            Block {
                name: "/rom@etc/acpi/tables".into(),
                length: 0x1000,
                hva: 0x7f45_8900_0000,
                writable: false
            },
            Block {
                name: "pc.bios".into(),
                length: 0x20000,
                hva: 0x7f45_8940_0000,
                writable: true
            },
        ]
    );
    assert!(parse_ramblocks("Error: no such command").is_err());
    assert!(parse_ramblocks("Block Name\n ram 4 KiB 0x0 zz 0x0 0x0 rw").is_err());
}

/// A private copy-on-write mapping of a file, as QEMU has of the
/// template: the pages written in this process differ from the file.
struct Mapping {
    ptr: *mut u8,
    len: usize,
}

impl Mapping {
    fn of(file: &File, len: usize) -> Mapping {
        use std::os::unix::io::AsRawFd;
        Mapping::map(len, libc::MAP_PRIVATE, file.as_raw_fd())
    }
    fn anonymous(len: usize) -> Mapping {
        Mapping::map(len, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1)
    }
    fn map(len: usize, flags: libc::c_int, fd: libc::c_int) -> Mapping {
        // SAFETY: a fresh mapping of `len` bytes.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                flags,
                fd,
                0,
            )
        };
        assert_ne!(ptr, libc::MAP_FAILED);
        Mapping {
            ptr: ptr as *mut u8,
            len,
        }
    }
    fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: the mapping lives as long as `self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
    fn block(&self, name: &str) -> Block {
        Block {
            name: name.into(),
            length: self.len as u64,
            hva: self.ptr as u64,
            writable: true,
        }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmapping what `of` mapped.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
    }
}

/// A new RAM file in `dir` (named as the layers' are) begun on
/// `parent`, captured from this process's `blocks`.
fn save(dir: &Path, blocks: &[Block], parent: Option<&Chain>) -> (PathBuf, Captured) {
    save_mapped(dir, blocks, parent, None)
}

/// [`save`] of a VM whose block `ram` maps the image of `mapped`.
fn save_mapped(
    dir: &Path,
    blocks: &[Block],
    parent: Option<&Chain>,
    mapped: Option<&Chain>,
) -> (PathBuf, Captured) {
    let path = dir.join(crate::save::layers::new_name(".ram"));
    let out = File::create_new(&path).unwrap();
    begin(&out, parent).unwrap();
    let captured = capture(std::process::id(), blocks, "ram", &out, parent, mapped).unwrap();
    (path, captured)
}

fn on_disk(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).unwrap().blocks() * 512
}

#[test]
fn the_written_pages_are_saved_and_load_into_a_fresh_mapping() {
    let pages = 2000usize;
    let len = pages * PAGE as usize;
    let dir = tempfile::tempdir().unwrap();
    let base = tempfile::tempfile().unwrap();
    let content: Vec<u8> = (0..len)
        .map(|i| (i / PAGE as usize % 251 + 1) as u8)
        .collect();
    base.write_all_at(&content, 0).unwrap();
    let mut vm = Mapping::of(&base, len);
    // Read every page (mapped, still the file's), then write some: a
    // run, scattered pages, a page zeroed and a page rewritten as it was.
    assert_eq!(vm.bytes(), &content[..]);
    let p = PAGE as usize;
    for page in (10..1300).chain([1500, 1502, 1999]) {
        vm.bytes()[page * p + 7] ^= 0x5a;
    }
    vm.bytes()[400 * p..401 * p].fill(0);
    vm.bytes()[1700 * p] = content[1700 * p];
    let mut bios = Mapping::anonymous(8 * p);
    bios.bytes().fill(3);
    bios.bytes()[5 * p..6 * p].fill(0);
    let firmware = bios.block("pc.bios");
    let tables = Block {
        writable: false,
        ..bios.block("tables")
    };
    let blocks = [vm.block("ram"), firmware.clone(), tables];
    let (first, captured) = save(dir.path(), &blocks, None);
    // 1290 + 3 pages flipped, 1 rewritten as it was (still a written
    // page); the zeroed page is among the flipped ones; the firmware's
    // 8 pages, one of them zero.
    assert_eq!(captured.saved_pages(), 1294 + 8);
    assert_eq!(captured.zero_pages, 1 + 1);
    assert_eq!(captured.inherited_pages, 0);
    // The zero pages and the unwritten ones take no room.
    let size = on_disk(&first);
    assert!(size < (1300 + 8 + 4) * PAGE, "{size} bytes on disk");

    let chain = Chain::open(&first).unwrap();
    let mut fresh = Mapping::of(&base, len);
    let mut bios_after = Mapping::anonymous(8 * p);
    bios_after.bytes().fill(9);
    let targets = [fresh.block("ram"), bios_after.block("pc.bios")];
    assert_eq!(
        load(std::process::id(), &targets, &chain, None).unwrap(),
        1294 + 8
    );
    assert!(fresh.bytes() == vm.bytes(), "the loaded RAM differs");
    assert!(
        bios_after.bytes() == bios.bytes(),
        "the loaded firmware differs"
    );

    // A QEMU whose block differs in size is refused.
    let mut small = Mapping::of(&base, len - p);
    assert!(load(std::process::id(), &[small.block("ram")], &chain, None).is_err());
    let _ = small.bytes();
    assert!(load(std::process::id(), &[], &chain, None).is_err());
    // A QEMU whose memory cannot be written fails the load (and the
    // copying thread ends with it).
    let unmapped = Block {
        hva: 0x1000,
        ..fresh.block("ram")
    };
    assert!(load(
        std::process::id(),
        &[unmapped, bios_after.block("pc.bios")],
        &chain,
        None
    )
    .is_err());
    assert!(read_header(&base).is_err());
    assert_eq!(parent_of(&first).unwrap(), None);
    // A QEMU without the block the written pages are found in: refused
    // (not every block copied whole).
    let out = File::create_new(dir.path().join("none.ram")).unwrap();
    assert!(capture(
        std::process::id(),
        std::slice::from_ref(&firmware),
        "ram",
        &out,
        None,
        None
    )
    .is_err());
    // A header naming a path for its parent is refused.
    let forged = File::create_new(dir.path().join("forged.ram")).unwrap();
    write_header(
        &forged,
        &Header {
            version: VERSION,
            parent: Some("../../etc/shadow".into()),
            areas: Vec::new(),
        },
    )
    .unwrap();
    assert!(Chain::open(&dir.path().join("forged.ram")).is_err());
    assert_eq!(parent_of(&dir.path().join("forged.ram")).unwrap(), None);
}

#[test]
fn a_save_over_a_parent_holds_only_what_changed_since() {
    let pages = 3000usize;
    let p = PAGE as usize;
    let len = pages * p;
    let dir = tempfile::tempdir().unwrap();
    let base = tempfile::tempfile().unwrap();
    let content: Vec<u8> = (0..len).map(|i| (i / p % 13 + 1) as u8).collect();
    base.write_all_at(&content, 0).unwrap();
    let mut vm = Mapping::of(&base, len);
    let mut bios = Mapping::anonymous(4 * p);
    bios.bytes().fill(5);
    for page in 0..2000 {
        vm.bytes()[page * p + 1] = 0xee;
    }
    vm.bytes()[1800 * p..1801 * p].fill(0);
    let blocks = [vm.block("ram"), bios.block("pc.bios")];
    let (first, _) = save(dir.path(), &blocks, None);
    let parent = Chain::open(&first).unwrap();

    // Since: 5 pages changed, 2 written for the first time, a page
    // zeroed, the zero page written, one page rewritten as it was.
    for page in [3, 700, 701, 1500, 1999, 2500, 2998] {
        vm.bytes()[page * p + 2] ^= 0x11;
    }
    vm.bytes()[900 * p..901 * p].fill(0);
    vm.bytes()[1800 * p + 9] = 1;
    vm.bytes()[1200 * p + 1] = 0xee;
    let (second, captured) = save(dir.path(), &blocks, Some(&parent));
    assert_eq!(captured.saved_pages(), 2002 + 4);
    assert_eq!(captured.data_pages, 5 + 2 + 1);
    assert_eq!(captured.zero_pages, 1);
    assert_eq!(captured.inherited_pages, 2002 + 4 - 9);
    assert!(on_disk(&second) < 24 * PAGE + on_disk(&first) / 10);
    assert_eq!(parent_of(&second).unwrap(), Some(first.clone()));

    // Loaded through the chain, it is the VM as it is now; and the
    // parent alone still loads as the VM was.
    let chain = Chain::open(&second).unwrap();
    assert_eq!(chain.depth(), 2);
    let mut fresh = Mapping::of(&base, len);
    let mut fresh_bios = Mapping::anonymous(4 * p);
    let targets = [fresh.block("ram"), fresh_bios.block("pc.bios")];
    load(std::process::id(), &targets, &chain, None).unwrap();
    assert!(fresh.bytes() == vm.bytes(), "the chain loads other RAM");
    assert!(fresh_bios.bytes() == bios.bytes());
    let mut old = Mapping::of(&base, len);
    load(
        std::process::id(),
        &[old.block("ram"), fresh_bios.block("pc.bios")],
        &parent,
        None,
    )
    .unwrap();
    assert_eq!(old.bytes()[900 * p + 1], 0xee);
    assert_eq!(old.bytes()[1800 * p + 9], 0);

    // A chain is as long as MAX_CHAIN at most.
    let mut below = chain;
    for n in 2..MAX_CHAIN {
        vm.bytes()[n * p] ^= 1;
        let (next, _) = save(dir.path(), &blocks, Some(&below));
        below = Chain::open(&next).unwrap();
    }
    assert_eq!(below.depth(), MAX_CHAIN);
    let (too_deep, _) = save(dir.path(), &blocks, Some(&below));
    assert!(Chain::open(&too_deep).is_err());
}
#[test]
fn an_image_is_the_saved_ram_whole_and_its_vms_save_against_it() {
    let p = PAGE as usize;
    let pages = 5000;
    let len = pages * p;
    let dir = tempfile::tempdir().unwrap();
    // The template: data in two runs, holes around them, a zero page.
    let template_path = dir.path().join("mem");
    let template = File::create_new(&template_path).unwrap();
    template.set_len(len as u64).unwrap();
    let run: Vec<u8> = (0..300 * p).map(|i| (i / p % 7 + 1) as u8).collect();
    template.write_all_at(&run, 0).unwrap();
    template.write_all_at(&run, 4000 * PAGE).unwrap();
    template.write_all_at(&vec![0; p], 200 * PAGE).unwrap();
    let mut vm = Mapping::of(&template, len);
    let mut bios = Mapping::anonymous(2 * p);
    bios.bytes().fill(4);
    // Written: over the template's data, in its holes, a page zeroed.
    for page in (100..150).chain([400, 4060, pages - 1]) {
        vm.bytes()[page * p + 3] = 0x77;
    }
    vm.bytes()[10 * p..11 * p].fill(0);
    let blocks = [vm.block("ram"), bios.block("pc.bios")];
    let (parent, _) = save(dir.path(), &blocks, None);
    // A second save on the first, so the image reads from both files.
    vm.bytes()[4061 * p + 9] = 0x55;
    vm.bytes()[120 * p + 9] = 0x56;
    let blocks = [vm.block("ram"), bios.block("pc.bios")];
    let (saved, _) = save(dir.path(), &blocks, Some(&Chain::open(&parent).unwrap()));
    let chain = Chain::open(&saved).unwrap();
    assert_eq!(chain.depth(), 2);

    let image = crate::save::ram_image::mount(&template_path, &saved, "ram")
        .unwrap()
        .expect(
            "mounting an EROFS image over plain files needs root and Linux 6.12 or later \
             with EROFS (CONFIG_EROFS_FS)",
        );
    // Mapped as QEMU maps it: reopened read-only by its /proc path.
    use std::os::unix::io::AsRawFd;
    let reopened = File::open(format!("/proc/self/fd/{}", image.as_raw_fd())).unwrap();
    assert!(std::fs::OpenOptions::new()
        .write(true)
        .open(format!("/proc/self/fd/{}", image.as_raw_fd()))
        .is_err());
    let mut child = Mapping::of(&reopened, len);
    assert!(
        child.bytes() == vm.bytes(),
        "the image is not the saved RAM"
    );
    // A mapping's copy-on-write stays its own.
    child.bytes()[5 * p] ^= 0xff;
    let second = Mapping::of(&reopened, len);
    assert_eq!(
        unsafe { std::slice::from_raw_parts(second.ptr, len) }[5 * p],
        vm.bytes()[5 * p]
    );

    // A save of the VM that maps the image: the image's pages count as
    // the VM's (the parent's, unchanged), only the written one is new.
    let mut child_bios = Mapping::anonymous(2 * p);
    assert_eq!(
        load(
            std::process::id(),
            &[child.block("ram"), child_bios.block("pc.bios")],
            &chain,
            Some("ram"),
        )
        .unwrap(),
        2
    );
    assert!(child_bios.bytes() == bios.bytes());
    let child_blocks = [child.block("ram"), child_bios.block("pc.bios")];
    let (next, captured) = save_mapped(dir.path(), &child_blocks, Some(&chain), Some(&chain));
    assert_eq!(captured.data_pages, 1);
    let next_chain = Chain::open(&next).unwrap();
    let mut fresh = Mapping::of(&template, len);
    let fresh_bios = Mapping::anonymous(2 * p);
    load(
        std::process::id(),
        &[fresh.block("ram"), fresh_bios.block("pc.bios")],
        &next_chain,
        None,
    )
    .unwrap();
    assert!(
        fresh.bytes() == child.bytes(),
        "the child's save loads other RAM"
    );
    // A later save on that one, of the same VM: the image's pages it
    // did not write are where the image has them, the parent's.
    let (later, captured) = save_mapped(dir.path(), &child_blocks, Some(&next_chain), Some(&chain));
    assert_eq!(captured.data_pages, 0);
    let mut fresh = Mapping::of(&template, len);
    load(
        std::process::id(),
        &[fresh.block("ram"), fresh_bios.block("pc.bios")],
        &Chain::open(&later).unwrap(),
        None,
    )
    .unwrap();
    assert!(
        fresh.bytes() == child.bytes(),
        "the later save loads other RAM"
    );
    // Without a parent it holds the image's pages itself.
    let (alone, captured) = save_mapped(dir.path(), &child_blocks, None, Some(&chain));
    assert_eq!(captured.inherited_pages, 0);
    let mut again = Mapping::of(&template, len);
    load(
        std::process::id(),
        &[again.block("ram"), fresh_bios.block("pc.bios")],
        &Chain::open(&alone).unwrap(),
        None,
    )
    .unwrap();
    assert!(
        again.bytes() == child.bytes(),
        "a save without parent loads other RAM"
    );
    // An image of a chain of another size is refused.
    let short = dir.path().join("short");
    File::create_new(&short)
        .unwrap()
        .set_len(len as u64 - PAGE)
        .unwrap();
    assert!(crate::save::ram_image::mount(&short, &saved, "ram").is_err());
    drop(second);
}
