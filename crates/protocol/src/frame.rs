//! Framing: how messages are cut out of a byte stream.
//!
//! A frame is `MAGIC (4) | header_len (u32 BE) | body_len (u32 BE) | header | body`.
//! The header is one [`crate::Message`] as JSON (small, debuggable); the body is
//! raw bytes (file content, command output), so binary data is never escaped.
//!
//! The magic lets a reader resynchronise: a virtio-serial port keeps bytes that a
//! previous host connection left half-written, so a new reader skips to the
//! first magic and then to the [`crate::Message::HelloAck`] answering its own nonce.

use crate::Message;

/// First four bytes of every frame.
pub const FRAME_MAGIC: [u8; 4] = *b"SPF1";
/// Bytes before the header: magic, header length, body length.
pub const HEADER_PREFIX_LEN: usize = 12;
/// Largest header accepted.
pub const MAX_HEADER_LEN: usize = 1024 * 1024;
/// Largest body accepted.
pub const MAX_BODY_LEN: usize = 4 * 1024 * 1024;
/// The most a directory listing's entries may take, encoded: a listing of
/// many long names stops here (marked truncated) and its answer still fits
/// in one header, whatever the guest's files are.
pub const MAX_LISTING_BYTES: usize = MAX_HEADER_LEN / 2;

/// One decoded frame.
#[derive(Debug, Clone, PartialEq)]
pub struct Frame {
    pub message: Message,
    pub body: Vec<u8>,
}

impl Frame {
    pub fn new(message: Message) -> Self {
        Frame {
            message,
            body: Vec::new(),
        }
    }
    pub fn with_body(message: Message, body: Vec<u8>) -> Self {
        Frame { message, body }
    }
    pub fn encode(&self) -> Vec<u8> {
        encode_frame(&self.message, &self.body)
    }
}

/// Why a frame could not be decoded.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// the header is longer than the limit
    #[error("frame header of {0} bytes exceeds the limit")]
    HeaderTooLarge(usize),
    /// the body is longer than the limit
    #[error("frame body of {0} bytes exceeds the limit")]
    BodyTooLarge(usize),
    /// the header is not a message this generation knows
    #[error("malformed frame header: {0}")]
    BadHeader(#[from] serde_json::Error),
}

/// Encode one message and its body as a frame.
pub fn encode_frame(message: &Message, body: &[u8]) -> Vec<u8> {
    let header = serde_json::to_vec(message).expect("messages always serialise");
    let mut out = Vec::with_capacity(HEADER_PREFIX_LEN + header.len() + body.len());
    out.extend_from_slice(&FRAME_MAGIC);
    out.extend_from_slice(&(header.len() as u32).to_be_bytes());
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(&header);
    out.extend_from_slice(body);
    out
}

/// Incremental decoder: push bytes as they arrive, pull frames out.
///
/// Bytes before a magic are skipped (and counted in [`FrameDecoder::skipped`]);
/// a frame whose lengths exceed the limits is an error and the decoder skips
/// past its magic, so one corrupt frame cannot wedge the stream.
#[derive(Debug, Default)]
pub struct FrameDecoder {
    buf: Vec<u8>,
    skipped: u64,
}

impl FrameDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Add bytes read from the stream.
    pub fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// Drop everything buffered (the peer reconnected).
    pub fn reset(&mut self) {
        self.buf.clear();
    }

    /// Bytes skipped so far while looking for a frame start.
    pub fn skipped(&self) -> u64 {
        self.skipped
    }

    /// Next complete frame, `Ok(None)` if more bytes are needed.
    pub fn next_frame(&mut self) -> Result<Option<Frame>, FrameError> {
        // Resynchronise on the magic.
        match find(&self.buf, &FRAME_MAGIC) {
            Some(0) => {}
            Some(at) => {
                self.skipped += at as u64;
                self.buf.drain(..at);
            }
            None => {
                // Keep a possible partial magic at the end.
                let keep = FRAME_MAGIC.len() - 1;
                if self.buf.len() > keep {
                    let cut = self.buf.len() - keep;
                    self.skipped += cut as u64;
                    self.buf.drain(..cut);
                }
                return Ok(None);
            }
        }
        if self.buf.len() < HEADER_PREFIX_LEN {
            return Ok(None);
        }
        let header_len = u32::from_be_bytes(self.buf[4..8].try_into().unwrap()) as usize;
        let body_len = u32::from_be_bytes(self.buf[8..12].try_into().unwrap()) as usize;
        if header_len > MAX_HEADER_LEN {
            self.buf.drain(..1);
            return Err(FrameError::HeaderTooLarge(header_len));
        }
        if body_len > MAX_BODY_LEN {
            self.buf.drain(..1);
            return Err(FrameError::BodyTooLarge(body_len));
        }
        let total = HEADER_PREFIX_LEN + header_len + body_len;
        if self.buf.len() < total {
            return Ok(None);
        }
        let header = &self.buf[HEADER_PREFIX_LEN..HEADER_PREFIX_LEN + header_len];
        let parsed = serde_json::from_slice::<Message>(header);
        let body = self.buf[HEADER_PREFIX_LEN + header_len..total].to_vec();
        self.buf.drain(..total);
        Ok(Some(Frame {
            message: parsed?,
            body,
        }))
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Message;

    #[test]
    fn round_trips_binary_bodies_split_anywhere() {
        let body: Vec<u8> = (0..=255u8).collect();
        let bytes = encode_frame(&Message::Stdout { id: 7 }, &body);
        for split in 0..bytes.len() {
            let mut d = FrameDecoder::new();
            d.push(&bytes[..split]);
            let first = d.next_frame().unwrap();
            d.push(&bytes[split..]);
            let frame = match first {
                Some(f) => f,
                None => d.next_frame().unwrap().unwrap(),
            };
            assert_eq!(frame.message, Message::Stdout { id: 7 });
            assert_eq!(frame.body, body);
        }
    }

    #[test]
    fn skips_garbage_before_a_frame() {
        let mut d = FrameDecoder::new();
        d.push(b"leftover bytes of an old connection SP");
        d.push(&encode_frame(&Message::Ping { id: 1 }, b""));
        let f = d.next_frame().unwrap().unwrap();
        assert_eq!(f.message, Message::Ping { id: 1 });
        assert!(d.skipped() > 0);
    }

    #[test]
    fn oversized_lengths_are_errors_not_allocations() {
        let mut bytes = FRAME_MAGIC.to_vec();
        bytes.extend_from_slice(&u32::MAX.to_be_bytes());
        bytes.extend_from_slice(&0u32.to_be_bytes());
        let mut d = FrameDecoder::new();
        d.push(&bytes);
        assert!(matches!(d.next_frame(), Err(FrameError::HeaderTooLarge(_))));
        // and the stream recovers on the next good frame
        d.push(&encode_frame(&Message::Ping { id: 2 }, b""));
        loop {
            match d.next_frame() {
                Ok(Some(f)) => {
                    assert_eq!(f.message, Message::Ping { id: 2 });
                    break;
                }
                Ok(None) => panic!("frame lost"),
                Err(_) => continue,
            }
        }
    }
}
