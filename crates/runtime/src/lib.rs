//! Sandpit's host runtime: guest images, one QEMU VM per sandbox, and the
//! channel to the agent inside each VM.
//!
//! It knows nothing about accounts, money or HTTP: the control plane asks it
//! for VMs by id and size and gets back a handle that runs commands and moves
//! files. Everything a VM owns lives under one directory, so destroy can prove
//! that nothing is left behind. Saves of running VMs (`saved`) and the disk
//! layers they freeze (`layers`) are shared by VMs and saves: they live
//! beside the VMs, and a layer goes when nothing names it any more.

pub mod accel;
pub mod channel;
pub mod config;
pub mod console;
mod erofs;
mod error;
pub mod expiry;
pub mod give_way;
pub mod guard;
pub mod host;
pub mod image;
pub mod ksm;
pub mod layers;
pub mod net;
pub mod process;
pub mod qmp;
mod ram_image;
pub mod ram_pages;
pub mod saved;
pub mod template;
pub mod terminal;
pub mod tunnel;
pub mod vm;

pub use accel::Accel;
pub use channel::{AgentClient, ExecEvent, ExecHandle, ExecOutput, FileDownload, FileUpload};
pub use config::{AccelChoice, NetworkPolicy, RuntimeConfig, SizeSpec};
/// Can this host compose a save's memory from files, so that the VMs started
/// from one save share its pages (`ram_image`)? Doctor asks.
pub use erofs::probe as probe_file_backed_erofs;
pub use error::{Result, RuntimeError};
pub use give_way::{GiveWay, Held};
pub use saved::{AfterSave, SavedRecord, SavedVm};
pub use template::Template;
pub use terminal::{Pty, PtyControl, PtySize};
pub use tunnel::{PtyExit, TunnelCloser, TunnelStream};
pub use vm::{CreateVm, StartTimes, Vm, VmManager, VmRecord, VmState};
