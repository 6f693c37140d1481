//! The runtime's own tests with real VMs (the guest image the test script
//! built, real QEMU): the guest as the runtime drives it (`vm`), snapshot
//! templates (`snapshot`), saved VMs (`saved_vms`), and a guest that does
//! its worst (`hostile`). One binary, a module a subject; set-up is
//! `sandpit-vmtest`'s, which the end-to-end tests share.
//!
//! Run one module with `cargo test -p sandpit-runtime --test vms MODULE::`.

mod hostile;
mod saved_vms;
mod snapshot;
mod vm;
