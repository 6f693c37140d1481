//! What the agent and a file process say to each other.
//!
//! Each request has a socket of its own. The agent writes one [`Request`]
//! on it as a JSON line, then, for a write, the file's bytes, and shuts its
//! writing side. The process answers with [`Frame`]s: a tag byte, a
//! little-endian u32 length, then the payload (the bytes themselves for
//! [`Frame::Data`], JSON for the others). The first frame is
//! [`Frame::Started`], the last [`Frame::Done`]; a watch sends frames until
//! the agent closes its socket.
//!
//! The agent trusts none of it beyond its shape: the process runs as the
//! guest user, whose other processes may signal it, so a frame that is
//! malformed, too long or late is an error of the request, never of the
//! agent.

use sandpit_protocol::{
    AgentError, DoneResult, ErrorKind, PathCall, WatchEvent, CHUNK_LEN, MAX_LISTING_BYTES,
};
use serde::{Deserialize, Serialize};
use std::io::{self, Read, Write};

/// One file operation, as the agent asks its file process for it. Paths are
/// already resolved (absolute, `..` folded: see `resolve_guest_path`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    Read {
        path: String,
        max_bytes: u64,
    },
    /// Followed on stdin by `size` bytes; fewer (stdin closed early) means
    /// the upload ended: nothing is written.
    Write {
        path: String,
        size: u64,
        mode: Option<u32>,
        /// Sync the file and its directory before answering (it is on a
        /// volume: written means on the volume's device).
        sync: bool,
    },
    List {
        path: String,
        recursive: bool,
        max_entries: u64,
    },
    Delete {
        path: String,
        recursive: bool,
    },
    Path {
        call: PathCall,
    },
    Watch {
        path: String,
        recursive: bool,
    },
}

/// One answer frame of a file process.
#[derive(Debug, Clone, PartialEq)]
pub enum Frame {
    /// The request has a process: its pid, to kill it by when the request
    /// ends first (none on a thread of the agent's).
    Started { pid: Option<u32> },
    /// A read's file and size, before its data.
    Info { path: String, size: u64 },
    /// A read's file, opened by the user's process, comes with this frame
    /// as a descriptor (`SCM_RIGHTS`): the agent reads it; nothing follows.
    Opened { path: String, size: u64 },
    /// A piece of a read's data, at most [`CHUNK_LEN`] bytes.
    Data(Vec<u8>),
    /// A watch has its watches in place.
    Watching { path: String },
    /// A watch's events from one read of the kernel's queue.
    Events(Vec<WatchEvent>),
    /// The request's outcome; nothing follows.
    Done(Result<DoneResult, AgentError>),
}

#[derive(Serialize, Deserialize)]
struct InfoBody {
    path: String,
    size: u64,
}

const TAG_STARTED: u8 = b'S';
const TAG_INFO: u8 = b'I';
const TAG_OPENED: u8 = b'O';
const TAG_DATA: u8 = b'D';
const TAG_WATCHING: u8 = b'W';
const TAG_EVENTS: u8 = b'E';
const TAG_DONE: u8 = b'R';

/// The longest frame the agent takes: a listing at its cap, with room.
pub const MAX_FRAME_LEN: usize = 2 * MAX_LISTING_BYTES + CHUNK_LEN;

/// The request as its process reads it: one JSON line.
pub fn encode_request(request: &Request) -> Vec<u8> {
    let mut line = serde_json::to_vec(request).expect("a request always serializes");
    line.push(b'\n');
    line
}

/// Write `frame` to `out` as one tag, length and payload.
pub fn write_frame(out: &mut impl Write, frame: &Frame) -> io::Result<()> {
    let bytes = encode_frame(frame);
    out.write_all(&bytes)?;
    out.flush()
}

/// `frame` as one tag, length and payload.
pub fn encode_frame(frame: &Frame) -> Vec<u8> {
    let (tag, payload): (u8, std::borrow::Cow<'_, [u8]>) = match frame {
        Frame::Started { pid } => (TAG_STARTED, json(pid).into()),
        Frame::Info { path, size } => (
            TAG_INFO,
            json(&InfoBody {
                path: path.clone(),
                size: *size,
            })
            .into(),
        ),
        Frame::Opened { path, size } => (
            TAG_OPENED,
            json(&InfoBody {
                path: path.clone(),
                size: *size,
            })
            .into(),
        ),
        Frame::Data(bytes) => (TAG_DATA, bytes[..].into()),
        Frame::Watching { path } => (TAG_WATCHING, json(path).into()),
        Frame::Events(events) => (TAG_EVENTS, json(events).into()),
        Frame::Done(outcome) => (TAG_DONE, json(outcome).into()),
    };
    let mut bytes = Vec::with_capacity(5 + payload.len());
    bytes.push(tag);
    bytes.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    bytes.extend_from_slice(&payload);
    bytes
}

/// Read one frame from `input`; `Ok(None)` at a clean end before a frame.
pub fn read_frame(input: &mut impl Read) -> Result<Option<Frame>, AgentError> {
    let broken = |what: String| {
        AgentError::new(
            ErrorKind::Io,
            format!("the file process's answer is broken: {what}"),
        )
    };
    let mut head = [0u8; 5];
    let mut got = 0;
    while got < head.len() {
        match input.read(&mut head[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(broken("it ended within a frame".into())),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(super::io_error(&e, "the file process")),
        }
    }
    let len = u32::from_le_bytes(head[1..].try_into().expect("4 bytes")) as usize;
    if len > MAX_FRAME_LEN {
        return Err(broken(format!("a frame of {len} bytes")));
    }
    let mut payload = vec![0u8; len];
    input.read_exact(&mut payload).map_err(|e| match e.kind() {
        io::ErrorKind::UnexpectedEof => broken("it ended within a frame".into()),
        _ => super::io_error(&e, "the file process"),
    })?;
    let parsed = |what: &str| broken(format!("{what} is not what it should be"));
    Ok(Some(match head[0] {
        TAG_STARTED => Frame::Started {
            pid: serde_json::from_slice(&payload).map_err(|_| parsed("a pid"))?,
        },
        TAG_INFO => {
            let InfoBody { path, size } =
                serde_json::from_slice(&payload).map_err(|_| parsed("a file's size"))?;
            Frame::Info { path, size }
        }
        TAG_OPENED => {
            let InfoBody { path, size } =
                serde_json::from_slice(&payload).map_err(|_| parsed("a file's size"))?;
            Frame::Opened { path, size }
        }
        TAG_DATA => Frame::Data(payload),
        TAG_WATCHING => Frame::Watching {
            path: serde_json::from_slice(&payload).map_err(|_| parsed("a watch's path"))?,
        },
        TAG_EVENTS => {
            Frame::Events(serde_json::from_slice(&payload).map_err(|_| parsed("a watch's events"))?)
        }
        TAG_DONE => {
            Frame::Done(serde_json::from_slice(&payload).map_err(|_| parsed("an outcome"))?)
        }
        tag => return Err(broken(format!("a frame tagged {tag}"))),
    }))
}

fn json<T: Serialize + ?Sized>(value: &T) -> Vec<u8> {
    serde_json::to_vec(value).expect("frames always serialize")
}

#[cfg(test)]
mod tests {
    use super::*;
    use sandpit_protocol::WatchEventKind;

    #[test]
    fn frames_round_trip_and_broken_ones_are_errors() {
        let frames = vec![
            Frame::Started { pid: Some(41) },
            Frame::Started { pid: None },
            Frame::Info {
                path: "/a b".into(),
                size: 3,
            },
            Frame::Data(vec![0, 255, 10]),
            Frame::Opened {
                path: "/o".into(),
                size: 9,
            },
            Frame::Watching { path: "/w".into() },
            Frame::Events(vec![WatchEvent {
                name: "x".into(),
                kind: WatchEventKind::Create,
            }]),
            Frame::Done(Ok(DoneResult::Deleted { path: "/x".into() })),
            Frame::Done(Err(AgentError::new(ErrorKind::NotFound, "/y: gone"))),
        ];
        let mut wire = Vec::new();
        for f in &frames {
            write_frame(&mut wire, f).unwrap();
        }
        let mut input = &wire[..];
        let mut back = Vec::new();
        while let Some(f) = read_frame(&mut input).unwrap() {
            back.push(f);
        }
        assert_eq!(back, frames);

        // Cut within a frame, oversized, unknown, or not JSON: typed errors.
        let cut = &wire[..wire.len() - 2];
        let mut input = cut;
        let err = std::iter::from_fn(|| read_frame(&mut input).transpose())
            .find_map(Result::err)
            .unwrap();
        assert!(err.message.contains("ended within a frame"), "{err}");
        let mut huge = vec![TAG_DATA];
        huge.extend(((MAX_FRAME_LEN + 1) as u32).to_le_bytes());
        assert!(read_frame(&mut &huge[..]).is_err());
        let unknown = [b'?', 0, 0, 0, 0];
        assert!(read_frame(&mut &unknown[..]).is_err());
        let mut bad = vec![TAG_DONE, 2, 0, 0, 0];
        bad.extend(b"{]");
        assert_eq!(read_frame(&mut &bad[..]).unwrap_err().kind, ErrorKind::Io);
    }

    #[test]
    fn requests_are_one_json_line() {
        let r = Request::Write {
            path: "/w/x\ny".into(),
            size: 5,
            mode: Some(0o600),
            sync: true,
        };
        let line = encode_request(&r);
        assert_eq!(line.iter().filter(|&&b| b == b'\n').count(), 1);
        assert_eq!(
            serde_json::from_slice::<Request>(&line[..line.len() - 1]).unwrap(),
            r
        );
    }
}
