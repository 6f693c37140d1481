//! Saving a running VM whole (disk, memory, devices) and starting VMs from
//! the save: the size templates every new VM is restored from
//! ([`template`]), a sandbox's saves for snapshots, pause and sleep
//! ([`saved`]), the RAM they hold ([`ram_pages`], composed into one file by
//! [`ram_image`] over [`erofs`]) and the frozen disk layers they share with
//! the VMs started from them ([`layers`]), and a save carried to another
//! host ([`transfer`]).

pub(crate) mod erofs;
pub mod layers;
pub(crate) mod ram_image;
pub mod ram_pages;
pub mod saved;
pub mod template;
pub mod transfer;
