//! The byte framing of a command's events on the node API: each event is
//! one frame, `[kind: u8][length: u32, big-endian][payload]`, so output
//! travels as the raw bytes it is.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use sandpit_protocol::{AgentError, ExecResult};
use sandpit_runtime::{ExecEvent, RuntimeError};

const STDOUT: u8 = 1;
const STDERR: u8 = 2;
const EXITED: u8 = 3;
const AGENT_ERROR: u8 = 4;
const OTHER_ERROR: u8 = 5;

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
pub fn encode(event: &Result<ExecEvent, RuntimeError>) -> Bytes {
    match event {
        Ok(ExecEvent::Stdout(b)) => frame(STDOUT, b),
        Ok(ExecEvent::Stderr(b)) => frame(STDERR, b),
        Ok(ExecEvent::Exited(r)) => frame(EXITED, &serde_json::to_vec(r).expect("json")),
        Err(RuntimeError::Agent(a)) => frame(AGENT_ERROR, &serde_json::to_vec(a).expect("json")),
        Err(e) => frame(OTHER_ERROR, e.to_string().as_bytes()),
    }
}

/// Takes one whole frame off the front of `buf`, if it holds one.
pub fn decode(buf: &mut BytesMut) -> Result<Option<Result<ExecEvent, RuntimeError>>, String> {
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
    let payload = buf.split_to(len);
    let bad = |e: serde_json::Error| format!("frame {kind}: {e}");
    Ok(Some(match kind {
        STDOUT => Ok(ExecEvent::Stdout(payload.to_vec())),
        STDERR => Ok(ExecEvent::Stderr(payload.to_vec())),
        EXITED => Ok(ExecEvent::Exited(
            serde_json::from_slice::<ExecResult>(&payload).map_err(bad)?,
        )),
        AGENT_ERROR => Err(RuntimeError::Agent(
            serde_json::from_slice::<AgentError>(&payload).map_err(bad)?,
        )),
        OTHER_ERROR => Err(RuntimeError::Disconnected(
            String::from_utf8_lossy(&payload).into_owned(),
        )),
        other => return Err(format!("unknown frame kind {other}")),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_round_trip_whole_and_in_pieces() {
        let events = vec![
            Ok(ExecEvent::Stdout(vec![0, 1, 2, 255])),
            Ok(ExecEvent::Stderr(b"oops\n".to_vec())),
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
        assert_eq!(got.len(), 3);
        assert!(matches!(&got[0], Ok(ExecEvent::Stdout(b)) if b == &[0, 1, 2, 255]));
        assert!(matches!(&got[2], Err(RuntimeError::Disconnected(m)) if m.contains("gone")));
        let mut huge = BytesMut::new();
        huge.put_u8(STDOUT);
        huge.put_u32(u32::MAX);
        assert!(decode(&mut huge).is_err());
    }
}
