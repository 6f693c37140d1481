//! The protocol's messages (`sandpit_protocol::Message`, both directions)
//! read from arbitrary bytes, as a frame's JSON header is read.
//!
//! The agent reads what the host sends and the host reads what a guest (which
//! its user controls) sends, both with `serde_json` into the one `Message`
//! type. Checked: reading never panics; a message that reads writes back
//! (`encode_frame` expects it to, it says "messages always serialise"), and
//! what it writes reads as the same message and writes the same bytes again
//! (the JSON form is stable), also through a whole frame with the rest of the
//! input as its body; and the helpers on a message (`request_id`, the error's
//! text) take any message.

#![no_main]

use libfuzzer_sys::fuzz_target;
use sandpit_protocol::{encode_frame, FrameDecoder, Message, MAX_BODY_LEN, MAX_HEADER_LEN};

fuzz_target!(|data: &[u8]| {
    // A header and a body, cut where the input has its first NUL (never in
    // JSON text); without one, all of it is the header.
    let (header, body) = match data.iter().position(|&b| b == 0) {
        Some(at) => (&data[..at], &data[at + 1..]),
        None => (data, &[][..]),
    };
    let Ok(message) = serde_json::from_slice::<Message>(header) else {
        return;
    };

    let json = serde_json::to_vec(&message).expect("a message that reads writes back");
    let again: Message = serde_json::from_slice(&json).expect("what a message writes reads");
    assert_eq!(again, message);
    assert_eq!(
        serde_json::to_vec(&again).unwrap(),
        json,
        "the JSON form is stable"
    );

    let _ = message.request_id();
    if let Message::Error { error, .. } = &message {
        let _ = error.to_string();
    }

    if json.len() <= MAX_HEADER_LEN && body.len() <= MAX_BODY_LEN {
        let mut d = FrameDecoder::new();
        d.push(&encode_frame(&message, body));
        let frame = d
            .next_frame()
            .expect("a frame of a read message")
            .expect("whole");
        assert_eq!(frame.message, message);
        assert_eq!(frame.body, body);
    }
});
