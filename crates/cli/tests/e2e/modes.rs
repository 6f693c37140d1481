//! What another local user (or a VM's QEMU, which runs as a uid of its own)
//! can read of the control plane's state: nothing of the database, and no
//! listing of the data directory. A real `sandpit serve` under umask 022.

use crate::common::serve::*;
use crate::common::*;
use std::os::unix::fs::PermissionsExt;

fn mode(p: &std::path::Path) -> u32 {
    std::fs::metadata(p)
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
        .permissions()
        .mode()
        & 0o7777
}

#[test]
fn the_database_and_the_data_directory_are_the_owners_alone() {
    // SAFETY: umask has no preconditions; the server inherits it.
    unsafe { libc::umask(0o022) };
    let parent = data_dir();
    let data = parent.join("fresh");
    std::fs::create_dir(&data).unwrap();
    // A data directory an older version left world-readable.
    std::fs::set_permissions(&data, std::fs::Permissions::from_mode(0o755)).unwrap();
    let server = Server::start_with(&data, "[pool]\nsizes = {}\n");
    // A write, so the WAL and its index exist.
    server.new_account("modes", 1.0);
    for f in ["sandpit.db", "sandpit.db-wal", "sandpit.db-shm"] {
        assert_eq!(mode(&data.join(f)), 0o600, "{f}");
    }
    let dir = mode(&data);
    assert_eq!(
        dir & 0o066,
        0,
        "the data directory is {dir:o}: others can list or write it"
    );
    drop(server);
}
