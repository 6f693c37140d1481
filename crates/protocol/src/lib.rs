//! The host↔guest wire format, shared by the in-guest agent and the host runtime.
//!
//! Why a crate of its own: both sides must agree byte for byte, and the guest
//! image outlives any one build of the host, so the format is versioned from day
//! one. The host opens every connection with [`Message::Hello`] naming the
//! [`PROTOCOL_GENERATION`] it speaks; the agent answers [`Message::HelloAck`]
//! with its own. A generation is frozen once released: `tests/schema.rs`
//! compares every message against `tests/generation-1.json`, so a change that
//! would break an older peer fails the build instead of a customer's sandbox.
//!
//! Versioning policy: adding an optional field (`#[serde(default)]`) or a new
//! message is compatible within a generation (an unknown message is answered
//! with [`ErrorKind::Unsupported`]); renaming, removing or changing the meaning
//! of anything starts a new generation.
//!
//! No async runtime here: framing works on byte slices and `std::io`, so the
//! agent and the host can wrap it in whatever I/O they use.

mod frame;
mod message;

pub use frame::{
    encode_frame, Frame, FrameDecoder, FrameError, FRAME_MAGIC, HEADER_PREFIX_LEN, MAX_BODY_LEN,
    MAX_HEADER_LEN, MAX_LISTING_BYTES,
};
pub use message::*;

/// What an agent of this build lists in its [`Message::HelloAck`]: each
/// names messages or fields added within generation 1 after it was first
/// frozen: `stats` is [`Message::Stats`], `clock` is [`Message::Clock`],
/// `pty` is [`ExecRequest::pty`] and [`ProcessCall::Resize`], `watch` is
/// [`Message::WatchDir`], `root_exec` is [`ExecRequest::as_root`],
/// `volumes` is [`Message::MountVolume`] and [`Message::SyncVolume`].
pub const FEATURES: &[&str] = &["stats", "clock", "pty", "watch", "root_exec", "volumes"];

/// The protocol generation this build speaks. Bump it only for incompatible changes.
pub const PROTOCOL_GENERATION: u32 = 1;

/// Name of the virtio-serial port the agent serves on (`/sys/class/virtio-ports/*/name`).
pub const AGENT_PORT_NAME: &str = "sandpit.agent.0";

/// The guest user that runs every command.
pub const GUEST_USER: &str = "user";
/// uid and gid of [`GUEST_USER`].
pub const GUEST_UID: u32 = 1000;
/// Home directory of [`GUEST_USER`].
pub const GUEST_HOME: &str = "/home/user";
/// Default working directory; relative paths are resolved against it.
pub const WORKSPACE: &str = "/workspace";

/// Largest piece of file content or command output carried in one frame.
pub const CHUNK_LEN: usize = 256 * 1024;
