//! The frame decoder (`sandpit_protocol::FrameDecoder`) on arbitrary bytes.
//!
//! Both ends of the agent channel feed whatever the port gives them into
//! it (a guest is untrusted; a port can hold the half-written leftovers of
//! an old connection), so it must never panic, never wedge and never hold
//! more than the frame limits allow. The input is pushed in pieces whose
//! sizes the first byte picks, the way reads cut a stream anywhere, and
//! frames are pulled after each piece the way both readers do (an error is
//! logged and the loop goes on).
//!
//! Checked: no panic; every frame returned is within the limits; it
//! re-encodes to bytes that decode to the same frame; the decoder ends each
//! pull with an answer (the loop terminates: each error consumes bytes);
//! and the same stream pushed whole gives the same frames and errors,
//! since a frame must not depend on how reads cut the stream.

#![no_main]

use libfuzzer_sys::fuzz_target;
use sandpit_protocol::{encode_frame, Frame, FrameDecoder, MAX_BODY_LEN, MAX_HEADER_LEN};

/// What a reader saw, in order: a frame or an error (by its message).
type Event = Result<Frame, String>;

/// Pull everything the decoder can give now, as the agent's and the host's
/// read loops do.
fn drain(d: &mut FrameDecoder, events: &mut Vec<Event>, budget: &mut usize) {
    loop {
        // Each call either returns a frame, an error (both consume bytes)
        // or None; a pull that neither consumes nor stops would spin.
        assert!(
            *budget > 0,
            "the decoder keeps answering without consuming input"
        );
        *budget -= 1;
        match d.next_frame() {
            Ok(Some(f)) => events.push(Ok(f)),
            Ok(None) => break,
            Err(e) => events.push(Err(e.to_string())),
        }
    }
}

fn run(stream: &[u8], piece: usize) -> (Vec<Event>, u64) {
    let mut d = FrameDecoder::new();
    let mut events = Vec::new();
    // One more pull than there are bytes, per push.
    let mut budget = stream.len() + 1 + stream.len().div_ceil(piece.max(1));
    for chunk in stream.chunks(piece.max(1)) {
        d.push(chunk);
        drain(&mut d, &mut events, &mut budget);
    }
    if stream.is_empty() {
        drain(&mut d, &mut events, &mut budget);
    }
    (events, d.skipped())
}

fuzz_target!(|data: &[u8]| {
    let Some((&first, stream)) = data.split_first() else {
        return;
    };
    let piece = first as usize % 32 + 1;
    let (events, skipped) = run(stream, piece);
    assert!(skipped <= stream.len() as u64);

    for f in events.iter().flatten() {
        assert!(f.body.len() <= MAX_BODY_LEN);
        // What was read can be written back, and reads the same.
        let bytes = encode_frame(&f.message, &f.body);
        let mut d = FrameDecoder::new();
        d.push(&bytes);
        let again = d
            .next_frame()
            .expect("a re-encoded frame decodes")
            .expect("whole");
        assert_eq!(&again, f);
        assert!(d.next_frame().unwrap().is_none());
        assert_eq!(d.skipped(), 0);
        let header_len = u32::from_be_bytes(bytes[4..8].try_into().unwrap()) as usize;
        assert!(header_len <= MAX_HEADER_LEN);
        // Every message answers its id (or has none) without panicking.
        let _ = f.message.request_id();
    }

    // How reads cut the stream changes nothing.
    let (whole, whole_skipped) = run(stream, stream.len());
    assert_eq!(whole, events);
    assert_eq!(whole_skipped, skipped);
});
