//! One way to the VMs: the service reaches every sandbox's VM through
//! [`Machines`], whether it runs on this host ([`crate::local::LocalVms`],
//! the embedded default) or on another node of a cluster (the node API over
//! mutual TLS, `sandpit-node`, which serves a node's `LocalVms` through this
//! same trait and implements it for the calling side).
//!
//! The trait speaks the runtime's words (ids, sizes, [`RuntimeError`]): it
//! knows no account, no money, no row. What a failure means for the API (a
//! VM found dead fails its sandbox, a node out of reach says retry) is
//! decided once, in the service, for both kinds of machine.

use async_trait::async_trait;
use sandpit_protocol::{
    ExecRequest, FileEntry, GuestStats, PathCall, PathEntry, ProcessCall, ProcessInfo, WatchEvent,
};
pub use sandpit_runtime::vm::volumes::VmVolume;
pub use sandpit_runtime::volume_content::{EntryKind, Ownership, VolumeCall, VolumeEntry};
pub use sandpit_runtime::Egress;
use sandpit_runtime::{GuestExecEvent, RuntimeError, VmState};
pub use sandpit_runtime::{PtyExit, PtySize};
use std::sync::Arc;
use time::OffsetDateTime;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;

/// What a call to a VM gives back.
pub type VmResult<T> = std::result::Result<T, RuntimeError>;

/// What a successful [`Machines::start`] leaves to its caller. (The node
/// API carries it as JSON, its times in RFC 3339 with every digit, so the
/// caller's copy of the row equals the stored one.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "started", rename_all = "snake_case")]
pub enum Started {
    /// The VM runs; recording that the sandbox does is the caller's job.
    Booted,
    /// The VM runs and the machine recorded it itself (a cluster node does,
    /// so that the outcome survives a caller lost mid-create): the sandbox
    /// is `running` since `ready_at` and expires at `expires_at` (later
    /// than asked if it was extended while it started).
    Recorded {
        #[serde(with = "time::serde::rfc3339")]
        ready_at: OffsetDateTime,
        #[serde(with = "time::serde::rfc3339")]
        expires_at: OffsetDateTime,
        /// Whether the VM was restored from a snapshot template (else
        /// booted cold), for the caller's metrics: only the machine knows.
        /// Absent from older nodes.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        restored: Option<bool>,
    },
}

/// The VMs of one node.
#[async_trait]
pub trait Machines: Send + Sync {
    /// Takes a ready VM of `size` from the warm pool; its id becomes the new
    /// sandbox's. `None` when the pool has none.
    async fn take_warm(&self, size: &str) -> VmResult<Option<String>>;

    /// Puts back a VM taken with [`Machines::take_warm`] whose sandbox was
    /// not created; nothing ever ran in it.
    async fn return_warm(&self, id: &str, size: &str) -> VmResult<()>;

    /// Makes ready what a start of `size` needs, before the new sandbox's
    /// row (and so its lifetime) exists: the size's snapshot template, built
    /// now if it has none (a cold boot and a few seconds, once per size,
    /// image and QEMU; minutes on a loaded host), so a one-minute sandbox
    /// does not spend its minute on it. Whether it made something now (a
    /// create's lifetime then starts after it); nothing to do is `false`. A
    /// failure is the caller's to log: the start then tries as it always did.
    async fn prepare(&self, _size: &str) -> VmResult<bool> {
        Ok(false)
    }

    /// Starts the VM of a new sandbox `id` (the pool VM taken for it, the
    /// ready pool VM of that id, or one restored or booted now; from
    /// `snapshot` when given, a snapshot this node holds) whose watchdog
    /// ends it at `expires_at` and whose guest reaches what `egress` lets
    /// it (a pool VM gets it before it is handed over), with `volumes`
    /// (files of this node) mounted when it is handed over.
    /// Starting a VM that already runs is not an error: a create retried
    /// after its first caller was lost finds the VM it started.
    async fn start(
        &self,
        id: &str,
        size: &str,
        snapshot: Option<&str>,
        expires_at: OffsetDateTime,
        egress: Egress,
        volumes: Vec<VmVolume>,
    ) -> VmResult<Started>;

    /// Saves the whole state of VM `id` as snapshot `snapshot` (the VM
    /// runs on); returns what the snapshot alone takes on disk. Its
    /// volumes are synced and unmounted for the save (a snapshot holds no
    /// volume, its memory no mount of one) and mounted again after; one
    /// that a guest process holds (a file open, a working directory) is
    /// refused.
    async fn snapshot(&self, id: &str, snapshot: &str) -> VmResult<u64>;

    /// Deletes a snapshot's files (one already gone is fine).
    async fn delete_snapshot(&self, snapshot: &str) -> VmResult<()>;

    /// What this node holds that a snapshot sent to it need not carry (see
    /// [`Machines::send_snapshot`]).
    async fn held_parts(&self) -> VmResult<Vec<String>> {
        Err(cannot_carry())
    }

    /// Snapshot `snapshot` with everything it stands on (its layers, the
    /// snapshot template its memory is a difference to) that `held` (the
    /// receiver's [`Machines::held_parts`]) does not name, as one stream
    /// for another node's [`Machines::receive_snapshot`] (see
    /// `sandpit_runtime::save::transfer`). Its `size` is the stream's.
    async fn send_snapshot(
        &self,
        _snapshot: &str,
        _held: Vec<String>,
    ) -> VmResult<Box<dyn Download>> {
        Err(cannot_carry())
    }

    /// Receives as snapshot `snapshot` the `size` bytes another node's
    /// [`Machines::send_snapshot`] gave; dropped before it finished, nothing
    /// of it stays. Finishing gives what the snapshot takes here.
    async fn receive_snapshot(&self, _snapshot: &str, _size: u64) -> VmResult<Box<dyn Upload>> {
        Err(cannot_carry())
    }

    /// Replaces VM `id` by one started from `snapshot`, under the same id,
    /// with its watchdog at `expires_at`, `egress` and `volumes` mounted
    /// (the sandbox's, not the snapshot's: every start of a VM is told
    /// them; a snapshot holds no volume's content). The old VM's volumes
    /// are synced before it goes.
    async fn restore(
        &self,
        id: &str,
        snapshot: &str,
        expires_at: OffsetDateTime,
        egress: Egress,
        volumes: Vec<VmVolume>,
    ) -> VmResult<()>;

    /// Saves VM `id` whole to this node's disk and stops it: no CPU, no
    /// memory until [`Machines::resume`]; its volumes synced first, and
    /// mounted still in its saved memory. (Destroying it removes the saved
    /// state too.)
    async fn pause(&self, id: &str) -> VmResult<()>;

    /// Starts paused VM `id` again where it was, its watchdog at
    /// `expires_at`, with `egress` and its `volumes` (those it was paused
    /// with, attached again before its guest runs). One that runs already
    /// is fine.
    async fn resume(
        &self,
        id: &str,
        expires_at: OffsetDateTime,
        egress: Egress,
        volumes: Vec<VmVolume>,
    ) -> VmResult<()>;

    /// Gives running VM `id` another egress, for its new connections (the
    /// host's guard at once, then the guest's own filter); the next start
    /// of it is told the same by its caller.
    async fn set_egress(&self, id: &str, egress: Egress) -> VmResult<()>;

    /// When running VM `id`'s egress last put each of its secrets into a
    /// request (by name, RFC 3339), since its egress proxy started; empty
    /// for a VM without one, or where that is not known.
    async fn secrets_used(
        &self,
        _id: &str,
    ) -> VmResult<std::collections::BTreeMap<String, String>> {
        Ok(Default::default())
    }

    /// Makes volume `id` on this node's disk: `bytes`, an empty ext4 file
    /// system the guest's user owns (see `sandpit_runtime::volume_files`).
    /// One that exists already is refused.
    async fn create_volume(&self, _id: &str, _bytes: u64) -> VmResult<()> {
        Err(keeps_no_volumes())
    }

    /// Grows volume `id` to `bytes` (never smaller), which no VM holds.
    async fn resize_volume(&self, _id: &str, _bytes: u64) -> VmResult<()> {
        Err(keeps_no_volumes())
    }

    /// Removes volume `id`'s file (one already gone is fine).
    async fn delete_volume(&self, _id: &str) -> VmResult<()> {
        Err(keeps_no_volumes())
    }

    /// Runs `call` on volume `id`'s files, here on the host, from its
    /// file (see `sandpit_runtime::volume_content`). No VM may hold it
    /// read-write meanwhile (none at all, for a call that changes it):
    /// the caller's to see to.
    async fn volume_call(&self, _id: &str, _call: VolumeCall) -> VmResult<Vec<VolumeEntry>> {
        Err(keeps_no_volumes())
    }

    /// Writes a file of `size` bytes, sent as they come, to `path` of
    /// volume `id`; [`Upload::finish`] puts it in place (its directories
    /// made, owned as `owner` says; an existing file replaced only with
    /// `overwrite`). Dropped before, nothing is written. Same rule as
    /// [`Machines::volume_call`], by the time it finishes.
    async fn volume_upload(
        &self,
        _id: &str,
        _path: &str,
        _size: u64,
        _owner: Ownership,
        _overwrite: bool,
    ) -> VmResult<Box<dyn Upload>> {
        Err(keeps_no_volumes())
    }

    /// Reads file `path` of volume `id` (copied whole before the first
    /// piece is sent, so the volume is free again while it streams).
    async fn volume_download(&self, _id: &str, _path: &str) -> VmResult<Box<dyn Download>> {
        Err(keeps_no_volumes())
    }

    /// Sends volume `id`'s file whole (its holes left out) to be received
    /// by [`Machines::receive_volume`] on another node: `sandpit volume
    /// move`. No VM may hold it, nor may anything change it meanwhile (the
    /// caller's lease).
    async fn send_volume(&self, _id: &str) -> VmResult<Box<dyn Download>> {
        Err(keeps_no_volumes())
    }

    /// Receives volume `id`'s file, a stream of `size` bytes another
    /// node's [`Machines::send_volume`] made; [`Upload::finish`] puts it
    /// in place. Dropped before, nothing is left.
    async fn receive_volume(&self, _id: &str, _size: u64) -> VmResult<Box<dyn Upload>> {
        Err(keeps_no_volumes())
    }

    /// Kills the VM and removes its files (one already gone is fine), its
    /// volumes synced first (the guest's cache, then the host's): what
    /// the guest wrote to them is in their files when this returns.
    /// Returns what its disk held just before, when it could be measured.
    async fn destroy(&self, id: &str) -> VmResult<Option<u64>>;

    /// Moves the VM's watchdog to `at` (see `sandpit_runtime::vm::expiry`).
    async fn set_expiry(&self, id: &str, at: OffsetDateTime) -> VmResult<()>;

    /// Whether the VM runs, or why not (`None`: no such VM there).
    async fn state(&self, id: &str) -> VmResult<Option<VmState>>;

    /// Whether VM `id`, here, was restored from a snapshot template (else
    /// booted cold); `None` where that is not known here.
    fn restored(&self, _id: &str) -> Option<bool> {
        None
    }

    /// Starts a command in the guest.
    async fn exec(&self, id: &str, request: ExecRequest) -> VmResult<Box<dyn Command>>;

    /// Follows the running command `pid` in the guest from now on (its pid,
    /// its output, at most `max_output_bytes` a stream, and its end), for
    /// at most `longest`. Dropping it stops following; the command goes on.
    async fn attach(
        &self,
        id: &str,
        pid: u32,
        max_output_bytes: u64,
        longest: std::time::Duration,
    ) -> VmResult<Box<dyn Command>>;

    /// The commands running in the guest now.
    async fn processes(&self, id: &str) -> VmResult<Vec<ProcessInfo>>;

    /// The guest's CPU, memory and disk now, as its kernel counts them.
    async fn stats(&self, id: &str) -> VmResult<GuestStats>;

    /// Feeds (`input`), closes or signals the running command `pid`.
    async fn process_call(
        &self,
        id: &str,
        pid: u32,
        call: ProcessCall,
        input: Vec<u8>,
    ) -> VmResult<()>;

    /// Writes a file of `size` bytes, sent in pieces.
    async fn upload(&self, id: &str, path: &str, size: u64) -> VmResult<Box<dyn Upload>>;

    /// Reads a file of at most `max_bytes`, in pieces.
    async fn download(&self, id: &str, path: &str, max_bytes: u64) -> VmResult<Box<dyn Download>>;

    /// Writes a whole file at once; returns its resolved path and size.
    async fn write_file(&self, id: &str, path: &str, bytes: Vec<u8>) -> VmResult<(String, u64)> {
        let mut upload = self.upload(id, path, bytes.len() as u64).await?;
        upload.send(&bytes).await?;
        upload.finish().await
    }

    /// Reads a whole file of at most `max_bytes`; returns its resolved
    /// path and content.
    async fn read_file(&self, id: &str, path: &str, max_bytes: u64) -> VmResult<(String, Vec<u8>)> {
        let mut download = self.download(id, path, max_bytes).await?;
        let mut bytes = Vec::with_capacity(download.size().min(max_bytes) as usize);
        while let Some(piece) = download.next_chunk().await? {
            bytes.extend_from_slice(&piece);
        }
        Ok((download.path().to_string(), bytes))
    }

    /// Lists a directory (`recursive`: its whole tree, up to `max_entries`).
    async fn list_files(
        &self,
        id: &str,
        path: &str,
        recursive: bool,
        max_entries: u64,
    ) -> VmResult<Listing>;

    /// Deletes a file or (`recursive`) a tree; returns the resolved path.
    async fn delete_file(&self, id: &str, path: &str, recursive: bool) -> VmResult<String>;

    /// A call on a path or two, as the guest user; what it leaves there.
    async fn path_call(&self, id: &str, call: PathCall) -> VmResult<PathEntry>;

    /// Watches directory `path` in the guest (with `recursive`, the tree
    /// under it) as the guest user; returns once the watch is set.
    async fn watch_dir(&self, id: &str, path: &str, recursive: bool) -> VmResult<Box<dyn Watch>>;

    /// Opens a TCP connection to `port` in the guest.
    async fn open_tunnel(&self, id: &str, port: u16) -> VmResult<Tunnel>;

    /// Starts an interactive login shell as the guest user on a new
    /// terminal of `size`.
    async fn open_pty(&self, id: &str, size: PtySize) -> VmResult<Terminal>;
}

/// A directory listing: its resolved path, entries, and whether it was cut
/// at the entry limit.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Listing {
    pub path: String,
    pub entries: Vec<FileEntry>,
    pub truncated: bool,
}

/// What a machine that cannot carry snapshots to another answers.
fn cannot_carry() -> RuntimeError {
    RuntimeError::Launch("these machines cannot carry snapshots to another node".into())
}

/// What machines that keep no volumes answer.
fn keeps_no_volumes() -> RuntimeError {
    RuntimeError::Launch("these machines keep no volumes".into())
}

/// A command running in a guest (or followed there).
#[async_trait]
pub trait Command: Send {
    /// The next event; `Exited` (or an error) is the last. A command that
    /// keeps running, or was attached to, gives its pid first (`Started`).
    async fn next(&mut self) -> VmResult<GuestExecEvent>;
    /// Kills the command; its end follows, cancelled.
    fn cancel(&self);
}

/// A directory watched in a guest ([`Machines::watch_dir`]); dropped, the
/// guest stops watching.
#[async_trait]
pub trait Watch: Send {
    /// The watched directory, as the guest resolved it.
    fn path(&self) -> &str;
    /// The next events (waits while nothing changes); `None` once the
    /// watch was stopped. An error ends it.
    async fn next(&mut self) -> VmResult<Option<Vec<WatchEvent>>>;
}

/// A file being written; dropped before [`Upload::finish`], the guest
/// discards what it had.
#[async_trait]
pub trait Upload: Send {
    async fn send(&mut self, data: &[u8]) -> VmResult<()>;
    /// Returns the resolved path and the bytes written.
    async fn finish(self: Box<Self>) -> VmResult<(String, u64)>;
}

/// A file being read.
#[async_trait]
pub trait Download: Send {
    /// Its resolved path.
    fn path(&self) -> &str;
    /// Its size, as the guest found it when the read started.
    fn size(&self) -> u64;
    /// The next piece; `None` after the last.
    async fn next_chunk(&mut self) -> VmResult<Option<Vec<u8>>>;
}

/// A byte stream both ways.
pub trait Duplex: AsyncRead + AsyncWrite + Send + Unpin {}

impl<T: AsyncRead + AsyncWrite + Send + Unpin> Duplex for T {}

/// Cuts a tunnel from elsewhere (its port was closed, its sandbox ended):
/// its reads and writes fail, the guest drops the connection.
pub type Closer = Arc<dyn Fn() + Send + Sync>;

/// A TCP connection to a port in a guest.
pub struct Tunnel {
    pub stream: Box<dyn Duplex>,
    pub closer: Closer,
}

/// What a terminal's user sends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PtyInput {
    /// Keystrokes (or pasted text), as bytes.
    Data(Vec<u8>),
    Resize(PtySize),
}

/// What a terminal sends back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PtyOutput {
    /// What its programs wrote, as bytes.
    Data(Vec<u8>),
    /// The shell exited by itself; the last item.
    Exit(PtyExit),
}

/// A terminal in a guest. `output` ends after [`PtyOutput::Exit`], or
/// without it when the terminal is gone (hung up, VM gone, link lost).
/// Dropping `input`, or calling `closer`, hangs the terminal up: its
/// shell's session gets SIGHUP.
pub struct Terminal {
    pub input: mpsc::Sender<PtyInput>,
    pub output: mpsc::Receiver<PtyOutput>,
    pub closer: Closer,
}

/// Items queued each way per terminal: a reader that stops reading stops
/// the guest's output through the stream's credit, not through memory.
pub const TERMINAL_QUEUE: usize = 16;

impl Terminal {
    /// A terminal over a guest's stream of it (this host's VMs): one task
    /// types the input and passes on resizes, one reads the output and,
    /// at its end, how the shell ended.
    pub fn over(pty: sandpit_runtime::Pty) -> Terminal {
        let sandpit_runtime::Pty { stream, control } = pty;
        let hang_up = stream.closer();
        let (mut reader, mut writer) = tokio::io::split(stream);
        let (input, mut typed) = mpsc::channel::<PtyInput>(TERMINAL_QUEUE);
        let (shown, output) = mpsc::channel::<PtyOutput>(TERMINAL_QUEUE);
        let resizer = control.clone();
        let closer = hang_up.clone();
        tokio::spawn(async move {
            while let Some(item) = typed.recv().await {
                let sent = match item {
                    PtyInput::Data(bytes) => writer.write_all(&bytes).await.is_ok(),
                    PtyInput::Resize(size) => resizer.resize(size).is_ok(),
                };
                if !sent {
                    break;
                }
            }
            // The user is gone (or the terminal is): hang it up.
            hang_up.close();
        });
        tokio::spawn(async move {
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                match reader.read(&mut buf).await {
                    Ok(0) => {
                        if let Some(exit) = control.exit() {
                            let _ = shown.send(PtyOutput::Exit(exit)).await;
                        }
                        return;
                    }
                    Ok(n) => {
                        if shown
                            .send(PtyOutput::Data(buf[..n].to_vec()))
                            .await
                            .is_err()
                        {
                            return;
                        }
                    }
                    Err(_) => return,
                }
            }
        });
        Terminal {
            input,
            output,
            closer: Arc::new(move || closer.close()),
        }
    }
}

/// How a member of a cluster reaches the other nodes' VMs.
pub trait NodeLink: Send + Sync {
    /// The VMs of the node at `address`, which the database shows at
    /// `epoch` (a node answers only calls for the epoch it holds).
    fn machines(&self, address: &str, epoch: i64) -> Arc<dyn Machines>;
}
