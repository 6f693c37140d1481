//! What travels on the node API besides JSON: the byte framing of a
//! command's events and of a download's pieces, and the runtime's errors in
//! a form that crosses the network with their kind intact.
//!
//! Each event is one frame, `[kind: u8][length: u32, big-endian][payload]`,
//! so output travels as the raw bytes it is. A download is a `META` frame
//! (its path and size), then its pieces as `STDOUT` frames, or an error
//! frame if it breaks off.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use sandpit_host::machines::{PtyInput, PtyOutput};
use sandpit_protocol::{AgentError, ExecResult, WatchEvent};
use sandpit_runtime::vm::volumes::VmVolume;
use sandpit_runtime::{Egress, GuestExecEvent, RuntimeError, VmState};
use serde::{Deserialize, Serialize};
use time::OffsetDateTime;

const STDOUT: u8 = 1;
const STDERR: u8 = 2;
const EXITED: u8 = 3;
const AGENT_ERROR: u8 = 4;
const OTHER_ERROR: u8 = 5;
const META: u8 = 6;
const PTY_DATA: u8 = 7;
const PTY_RESIZE: u8 = 8;
const PTY_EXIT: u8 = 9;
const STARTED: u8 = 10;
const WATCHING: u8 = 11;
const WATCH_EVENTS: u8 = 12;
const WATCH_ENDED: u8 = 13;

/// Largest payload a frame may announce (output comes in agent-sized
/// pieces; a peer announcing more is broken or hostile).
pub const MAX_FRAME: usize = 8 << 20;

fn frame(kind: u8, payload: &[u8]) -> Bytes {
    let mut b = BytesMut::with_capacity(5 + payload.len());
    b.put_u8(kind);
    b.put_u32(payload.len() as u32);
    b.put_slice(payload);
    b.freeze()
}

/// The frame of one event, or of the error that ended the command.
pub fn encode(event: &Result<GuestExecEvent, RuntimeError>) -> Bytes {
    match event {
        Ok(GuestExecEvent::Started(pid)) => frame(STARTED, &pid.to_be_bytes()),
        Ok(GuestExecEvent::Stdout(b)) => frame(STDOUT, b),
        Ok(GuestExecEvent::Stderr(b)) => frame(STDERR, b),
        Ok(GuestExecEvent::Exited(r)) => frame(EXITED, &serde_json::to_vec(r).expect("json")),
        Err(e) => error_frame(e),
    }
}

/// The frame of an error that ended a stream.
fn error_frame(e: &RuntimeError) -> Bytes {
    match e {
        RuntimeError::Agent(a) => frame(AGENT_ERROR, &serde_json::to_vec(a).expect("json")),
        e => frame(
            OTHER_ERROR,
            &serde_json::to_vec(&WireError::from(e)).expect("json"),
        ),
    }
}

/// The error an `AGENT_ERROR` or `OTHER_ERROR` frame carries.
fn decode_error(kind: u8, payload: &[u8]) -> Result<RuntimeError, String> {
    let bad = |e: serde_json::Error| format!("frame {kind}: {e}");
    if kind == AGENT_ERROR {
        return Ok(RuntimeError::Agent(
            serde_json::from_slice::<AgentError>(payload).map_err(bad)?,
        ));
    }
    Ok(serde_json::from_slice::<WireError>(payload)
        .map_err(bad)?
        .into())
}

/// The first frame of a download: its resolved path and size.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DownloadMeta {
    pub path: String,
    pub size: u64,
}

/// The frame that opens a download.
pub fn encode_meta(meta: &DownloadMeta) -> Bytes {
    frame(META, &serde_json::to_vec(meta).expect("json"))
}

/// One frame of a download: its head, a piece or an error.
pub enum DownloadFrame {
    Meta(DownloadMeta),
    Event(Result<GuestExecEvent, RuntimeError>),
}

/// Takes one whole download frame off the front of `buf`, if it holds one.
pub fn decode_download(buf: &mut BytesMut) -> Result<Option<DownloadFrame>, String> {
    if buf.first() == Some(&META) && buf.len() >= 5 {
        let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
        if len > MAX_FRAME {
            return Err(format!("a frame of {len} bytes"));
        }
        if buf.len() < 5 + len {
            return Ok(None);
        }
        buf.advance(5);
        let payload = buf.split_to(len);
        return serde_json::from_slice(&payload)
            .map(|m| Some(DownloadFrame::Meta(m)))
            .map_err(|e| format!("a download's head: {e}"));
    }
    Ok(decode(buf)?.map(DownloadFrame::Event))
}

/// A runtime error as it crosses the network: its kind survives, so the
/// calling member maps it to the API's error exactly as for its own VMs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum WireError {
    Agent { error: AgentError },
    NotFound { id: String },
    VmExited { cause: String },
    Disconnected { message: String },
    AgentTimeout { what: String, secs: u64 },
    BootTimeout { secs: u64, console_tail: String },
    Busy { message: String },
    HostFull { message: String },
    Other { message: String },
}

impl From<&RuntimeError> for WireError {
    fn from(e: &RuntimeError) -> Self {
        match e {
            RuntimeError::Agent(error) => WireError::Agent {
                error: error.clone(),
            },
            RuntimeError::NotFound(id) => WireError::NotFound { id: id.clone() },
            RuntimeError::VmExited { cause } => WireError::VmExited {
                cause: cause.clone(),
            },
            RuntimeError::Disconnected(message) => WireError::Disconnected {
                message: message.clone(),
            },
            RuntimeError::AgentTimeout { what, secs } => WireError::AgentTimeout {
                what: what.clone(),
                secs: *secs,
            },
            RuntimeError::BootTimeout { secs, console_tail } => WireError::BootTimeout {
                secs: *secs,
                console_tail: console_tail.clone(),
            },
            RuntimeError::Busy(message) => WireError::Busy {
                message: message.clone(),
            },
            RuntimeError::HostFull(message) => WireError::HostFull {
                message: message.clone(),
            },
            other => WireError::Other {
                message: other.to_string(),
            },
        }
    }
}

impl From<WireError> for RuntimeError {
    fn from(e: WireError) -> Self {
        match e {
            WireError::Agent { error } => RuntimeError::Agent(error),
            WireError::NotFound { id } => RuntimeError::NotFound(id),
            WireError::VmExited { cause } => RuntimeError::VmExited { cause },
            WireError::Disconnected { message } => RuntimeError::Disconnected(message),
            WireError::AgentTimeout { what, secs } => RuntimeError::AgentTimeout { what, secs },
            WireError::BootTimeout { secs, console_tail } => {
                RuntimeError::BootTimeout { secs, console_tail }
            }
            WireError::Busy { message } => RuntimeError::Busy(message),
            WireError::HostFull { message } => RuntimeError::HostFull(message),
            WireError::Other { message } => RuntimeError::Launch(message),
        }
    }
}

/// The body of a node's answer when the runtime failed (HTTP 422).
#[derive(Debug, Serialize, Deserialize)]
pub struct Failure {
    pub runtime: WireError,
}

/// `start`'s arguments.
#[derive(Debug, Serialize, Deserialize)]
pub struct StartArgs {
    pub size: String,
    /// The snapshot (on this node) to start from; none: the image.
    #[serde(default)]
    pub snapshot: Option<String>,
    /// Unix milliseconds.
    pub expires_at_ms: i64,
    /// What the guest may reach (absent: what the operator allows).
    #[serde(default)]
    pub egress: Egress,
    /// The volumes mounted when it is handed over (absent: none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<VmVolume>,
}

/// `snapshot`'s and `restore`'s arguments.
#[derive(Debug, Serialize, Deserialize)]
pub struct SnapshotArgs {
    pub snapshot: String,
    /// `restore`: the VM's expiry, Unix milliseconds.
    #[serde(default)]
    pub expires_at_ms: i64,
    /// `restore`: what the guest may reach.
    #[serde(default)]
    pub egress: Egress,
    /// The volumes mounted when it is handed over (absent: none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<VmVolume>,
}

/// What `snapshot` took.
#[derive(Debug, Serialize, Deserialize)]
pub struct SnapshotTaken {
    pub bytes: u64,
}

/// A time as Unix milliseconds, as the wire carries it.
pub fn ms(t: OffsetDateTime) -> i64 {
    (t.unix_timestamp_nanos() / 1_000_000) as i64
}

/// A time from Unix milliseconds.
pub fn time_of(ms: i64) -> OffsetDateTime {
    OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000)
        .unwrap_or(OffsetDateTime::UNIX_EPOCH)
}

/// `watch`'s arguments.
#[derive(Debug, Serialize, Deserialize)]
pub struct WatchArgs {
    pub path: String,
    pub recursive: bool,
}

/// `expiry`'s arguments.
#[derive(Debug, Serialize, Deserialize)]
pub struct ExpiryArgs {
    /// Unix milliseconds.
    pub at_ms: i64,
}

/// A volume's `create` and `resize` arguments.
#[derive(Debug, Serialize, Deserialize)]
pub struct VolumeArgs {
    /// Its size.
    pub bytes: u64,
}

/// A volume file's upload head (the bytes follow).
#[derive(Debug, Serialize, Deserialize)]
pub struct VolumeUploadArgs {
    pub path: String,
    pub size: u64,
    #[serde(default)]
    pub owner: sandpit_runtime::volume_content::Ownership,
    #[serde(default)]
    pub overwrite: bool,
}

/// `resume`'s arguments.
#[derive(Debug, Serialize, Deserialize)]
pub struct ResumeArgs {
    /// The VM's expiry, Unix milliseconds.
    pub at_ms: i64,
    /// What the guest may reach (absent: what the operator allows).
    #[serde(default)]
    pub egress: Egress,
    /// The volumes mounted when it is handed over (absent: none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<VmVolume>,
}

/// The arguments of the file calls (each reads the fields it needs).
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct FileArgs {
    pub path: String,
    #[serde(default)]
    pub size: u64,
    #[serde(default)]
    pub max_bytes: u64,
    #[serde(default)]
    pub recursive: bool,
    #[serde(default)]
    pub max_entries: u64,
}

/// The argument of `egress`: what the running VM may reach from now on.
#[derive(Debug, Serialize, Deserialize)]
pub struct EgressArgs {
    pub egress: Egress,
}

/// What a node holds that a snapshot sent to it need not carry (the
/// answer of `snapshots/held`, and the argument of `snapshots/{id}/send`).
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct Held {
    pub parts: Vec<String>,
}

/// The arguments of `attach`: the command's pid, the output a stream may
/// carry, and how long it may be followed.
#[derive(Debug, Serialize, Deserialize)]
pub struct AttachArgs {
    pub pid: u32,
    pub max_output_bytes: u64,
    pub longest_ms: u64,
}

/// The arguments of `process`: what to do to command `pid`, and the input
/// for its stdin.
#[derive(Debug, Serialize, Deserialize)]
pub struct ProcessArgs {
    pub pid: u32,
    pub call: sandpit_protocol::ProcessCall,
    #[serde(default, with = "base64_bytes")]
    pub input: Vec<u8>,
}

/// Bytes as base64 in JSON (a stdin's input), not an array of numbers.
mod base64_bytes {
    use base64::Engine;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&base64::engine::general_purpose::STANDARD.encode(bytes))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let text = String::deserialize(d)?;
        base64::engine::general_purpose::STANDARD
            .decode(text)
            .map_err(serde::de::Error::custom)
    }
}

/// What `take_warm` found.
#[derive(Debug, Serialize, Deserialize)]
pub struct Warm {
    pub id: Option<String>,
}

/// What `destroy` measured.
#[derive(Debug, Serialize, Deserialize)]
pub struct Destroyed {
    pub disk_used_bytes: Option<u64>,
}

/// What `state` found.
#[derive(Debug, Serialize, Deserialize)]
pub struct State {
    pub vm: Option<VmState>,
}

/// A file written, or deleted.
#[derive(Debug, Serialize, Deserialize)]
pub struct Written {
    pub path: String,
    #[serde(default)]
    pub bytes: u64,
}

/// Takes one whole frame off the front of `buf`, if it holds one.
pub fn decode(buf: &mut BytesMut) -> Result<Option<Result<GuestExecEvent, RuntimeError>>, String> {
    let Some((kind, payload)) = take_frame(buf)? else {
        return Ok(None);
    };
    let bad = |e: serde_json::Error| format!("frame {kind}: {e}");
    Ok(Some(match kind {
        STARTED => Ok(GuestExecEvent::Started(u32::from_be_bytes(
            payload[..]
                .try_into()
                .map_err(|_| format!("a pid of {} bytes", payload.len()))?,
        ))),
        STDOUT => Ok(GuestExecEvent::Stdout(payload.to_vec())),
        STDERR => Ok(GuestExecEvent::Stderr(payload.to_vec())),
        EXITED => Ok(GuestExecEvent::Exited(
            serde_json::from_slice::<ExecResult>(&payload).map_err(bad)?,
        )),
        AGENT_ERROR | OTHER_ERROR => Err(decode_error(kind, &payload)?),
        other => return Err(format!("unknown frame kind {other}")),
    }))
}

/// One frame of a directory watch: its start (the resolved path), events,
/// or its end.
#[derive(Debug, Clone, PartialEq)]
pub enum WatchFrame {
    Watching(String),
    Events(Vec<WatchEvent>),
    Ended,
}

/// The frame of a watch's start, events or end, or of the error that ended
/// it.
pub fn encode_watch(frame_of: &Result<WatchFrame, RuntimeError>) -> Bytes {
    match frame_of {
        Ok(WatchFrame::Watching(path)) => frame(WATCHING, path.as_bytes()),
        Ok(WatchFrame::Events(events)) => {
            frame(WATCH_EVENTS, &serde_json::to_vec(events).expect("json"))
        }
        Ok(WatchFrame::Ended) => frame(WATCH_ENDED, b""),
        Err(e) => error_frame(e),
    }
}

/// Takes one whole watch frame off the front of `buf`, if it holds one.
pub fn decode_watch(
    buf: &mut BytesMut,
) -> Result<Option<Result<WatchFrame, RuntimeError>>, String> {
    let Some((kind, payload)) = take_frame(buf)? else {
        return Ok(None);
    };
    let bad = |e: serde_json::Error| format!("frame {kind}: {e}");
    Ok(Some(match kind {
        WATCHING => Ok(WatchFrame::Watching(
            String::from_utf8(payload.to_vec()).map_err(|e| format!("a watched path: {e}"))?,
        )),
        WATCH_EVENTS => Ok(WatchFrame::Events(
            serde_json::from_slice(&payload).map_err(bad)?,
        )),
        WATCH_ENDED => Ok(WatchFrame::Ended),
        AGENT_ERROR | OTHER_ERROR => Err(decode_error(kind, &payload)?),
        other => return Err(format!("unknown frame kind {other}")),
    }))
}

/// Takes one whole frame, its kind and payload, off the front of `buf`.
fn take_frame(buf: &mut BytesMut) -> Result<Option<(u8, BytesMut)>, String> {
    if buf.len() < 5 {
        return Ok(None);
    }
    let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
    if len > MAX_FRAME {
        return Err(format!("a frame of {len} bytes"));
    }
    if buf.len() < 5 + len {
        return Ok(None);
    }
    let kind = buf.get_u8();
    buf.advance(4);
    Ok(Some((kind, buf.split_to(len))))
}

/// The frame of a terminal's input.
pub fn encode_pty_input(input: &PtyInput) -> Bytes {
    match input {
        PtyInput::Data(bytes) => frame(PTY_DATA, bytes),
        PtyInput::Resize(size) => frame(PTY_RESIZE, &serde_json::to_vec(size).expect("json")),
    }
}

/// Takes one terminal input off the front of `buf`, if it holds one.
pub fn decode_pty_input(buf: &mut BytesMut) -> Result<Option<PtyInput>, String> {
    let Some((kind, payload)) = take_frame(buf)? else {
        return Ok(None);
    };
    Ok(Some(match kind {
        PTY_DATA => PtyInput::Data(payload.to_vec()),
        PTY_RESIZE => PtyInput::Resize(
            serde_json::from_slice(&payload).map_err(|e| format!("a terminal size: {e}"))?,
        ),
        other => return Err(format!("unknown terminal input frame {other}")),
    }))
}

/// The frame of a terminal's output.
pub fn encode_pty_output(output: &PtyOutput) -> Bytes {
    match output {
        PtyOutput::Data(bytes) => frame(PTY_DATA, bytes),
        PtyOutput::Exit(exit) => frame(PTY_EXIT, &serde_json::to_vec(exit).expect("json")),
    }
}

/// Takes one terminal output off the front of `buf`, if it holds one.
pub fn decode_pty_output(buf: &mut BytesMut) -> Result<Option<PtyOutput>, String> {
    let Some((kind, payload)) = take_frame(buf)? else {
        return Ok(None);
    };
    Ok(Some(match kind {
        PTY_DATA => PtyOutput::Data(payload.to_vec()),
        PTY_EXIT => PtyOutput::Exit(
            serde_json::from_slice(&payload).map_err(|e| format!("a terminal's end: {e}"))?,
        ),
        other => return Err(format!("unknown terminal output frame {other}")),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use sandpit_host::machines::{PtyExit, PtySize};

    #[test]
    fn watch_frames_round_trip_in_pieces() {
        use sandpit_protocol::{ErrorKind, WatchEventKind};
        let frames = [
            Ok(WatchFrame::Watching("/home/user/é".into())),
            Ok(WatchFrame::Events(vec![WatchEvent {
                name: "a/b".into(),
                kind: WatchEventKind::Rename,
            }])),
            Ok(WatchFrame::Ended),
            Err(RuntimeError::Agent(AgentError::new(
                ErrorKind::NotFound,
                "gone",
            ))),
            Err(RuntimeError::VmExited {
                cause: "killed".into(),
            }),
        ];
        let mut wire = BytesMut::new();
        for f in &frames {
            wire.extend_from_slice(&encode_watch(f));
        }
        let (mut buf, mut got) = (BytesMut::new(), Vec::new());
        for byte in wire {
            buf.extend_from_slice(&[byte]);
            while let Some(f) = decode_watch(&mut buf).unwrap() {
                got.push(f);
            }
        }
        assert_eq!(got.len(), frames.len());
        for (g, f) in got.iter().zip(&frames) {
            match (g, f) {
                (Ok(a), Ok(b)) => assert_eq!(a, b),
                (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string()),
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn terminal_frames_round_trip_in_pieces() {
        let inputs = [
            PtyInput::Data(b"ls\r".to_vec()),
            PtyInput::Resize(PtySize {
                rows: 40,
                cols: 120,
            }),
        ];
        let outputs = [
            PtyOutput::Data(vec![27, b'[', b'm', 0, 255]),
            PtyOutput::Exit(PtyExit {
                exit_code: Some(130),
                signal: None,
            }),
        ];
        let mut wire = BytesMut::new();
        for i in &inputs {
            wire.extend_from_slice(&encode_pty_input(i));
        }
        let (mut buf, mut got) = (BytesMut::new(), Vec::new());
        for byte in wire {
            buf.extend_from_slice(&[byte]);
            while let Some(i) = decode_pty_input(&mut buf).unwrap() {
                got.push(i);
            }
        }
        assert_eq!(got, inputs);
        let mut buf = BytesMut::new();
        for o in &outputs {
            buf.extend_from_slice(&encode_pty_output(o));
        }
        let mut got = Vec::new();
        while let Some(o) = decode_pty_output(&mut buf).unwrap() {
            got.push(o);
        }
        assert_eq!(got, outputs);
        let mut bad = BytesMut::from(&encode_pty_output(&outputs[0])[..]);
        assert!(decode_pty_input(&mut BytesMut::from(&[3u8, 0, 0, 0, 0][..])).is_err());
        assert!(decode_pty_output(&mut bad).is_ok());
    }

    #[test]
    fn events_round_trip_whole_and_in_pieces() {
        let events = vec![
            Ok(GuestExecEvent::Started(70_001)),
            Ok(GuestExecEvent::Stdout(vec![0, 1, 2, 255])),
            Ok(GuestExecEvent::Stderr(b"oops\n".to_vec())),
            Err(RuntimeError::Disconnected("gone".into())),
        ];
        let mut all = BytesMut::new();
        for e in &events {
            all.extend_from_slice(&encode(e));
        }
        // Fed a byte at a time, nothing comes out early or twice.
        let mut buf = BytesMut::new();
        let mut got = Vec::new();
        for b in all.iter() {
            buf.put_u8(*b);
            while let Some(e) = decode(&mut buf).unwrap() {
                got.push(e);
            }
        }
        assert_eq!(got.len(), 4);
        assert!(matches!(&got[0], Ok(GuestExecEvent::Started(70_001))));
        assert!(matches!(&got[1], Ok(GuestExecEvent::Stdout(b)) if b == &[0, 1, 2, 255]));
        assert!(matches!(&got[3], Err(RuntimeError::Disconnected(m)) if m.contains("gone")));
        // A VM that died stays a VM that died on the other side.
        let mut buf = BytesMut::from(
            &encode(&Err(RuntimeError::VmExited {
                cause: "oom".into(),
            }))[..],
        );
        assert!(
            matches!(decode(&mut buf), Ok(Some(Err(RuntimeError::VmExited { cause }))) if cause == "oom")
        );
        let mut huge = BytesMut::new();
        huge.put_u8(STDOUT);
        huge.put_u32(u32::MAX);
        assert!(decode(&mut huge).is_err());
    }
}
