//! Sandpit's host runtime: guest images, one QEMU VM per sandbox, and the
//! channel to the agent inside each VM.
//!
//! It knows nothing about accounts, money or HTTP: the control plane asks it
//! for VMs by id and size and gets back a handle that runs commands and moves
//! files. Everything a VM owns lives under one directory, so destroy can prove
//! that nothing is left behind.
//!
//! Its folders, by subject:
//! - [`image`]: the guest image (kernel, initramfs, root file system), built
//!   from Debian's packages.
//! - [`vm`]: one QEMU process per sandbox: launch, QMP, the console, the
//!   network helper and the deny list, expiry, the host processes it owns.
//! - [`save`]: saving a running VM and starting VMs from saves: templates,
//!   saved VMs, their RAM and the disk layers they freeze (shared by VMs
//!   and saves, collected when nothing names them).
//! - [`egress`]: a sandbox's egress by host name: name rules, and the first
//!   look at a connection (TLS server name, HTTP `Host`).
//! - [`channel`]: the agent channel, with the port tunnels and terminals
//!   carried over it.
//! - [`host`]: what this host has (memory, CPU, KVM, KSM), read once here.
//! - [`volume_files`]: volumes' files on this host's disk (made, grown,
//!   removed); how a running VM reaches one is [`vm`]'s.

pub mod channel;
pub mod config;
pub mod egress;
mod error;
pub mod host;
pub mod image;
pub mod save;
pub mod vm;
pub mod volume_content;
pub mod volume_files;
pub mod volume_transfer;

pub use channel::terminal::{Pty, PtyControl, PtySize};
pub use channel::tunnel::{PtyExit, TunnelCloser, TunnelStream};
pub use channel::watch::DirWatch;
pub use channel::{AgentClient, ExecHandle, ExecOutput, FileUpload, GuestDownload, GuestExecEvent};
pub use config::{AccelChoice, NetworkPolicy, RuntimeConfig, SizeSpec};
pub use egress::broker::{Broker, BrokerCa, BrokeredSecret, HeaderRule, Sensitive};
pub use error::{Result, RuntimeError};
pub use host::accel::Accel;
/// Can this host compose a save's memory from files, so that the VMs started
/// from one save share its pages (`ram_image`)? Doctor asks.
pub use save::erofs::probe as probe_file_backed_erofs;
pub use save::saved::{AfterSave, SavedRecord, SavedVm};
pub use save::template::Template;
pub use vm::give_way::{GiveWay, Held};
pub use vm::{CreateVm, Egress, StartTimes, Vm, VmManager, VmRecord, VmState};
