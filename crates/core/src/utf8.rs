//! Turning a byte stream into UTF-8 text chunk by chunk without splitting a
//! character across chunks (a split would become two replacement characters).

/// Incremental UTF-8 decoder: bytes that may start a character are held back
/// until the rest arrives; invalid bytes become U+FFFD.
#[derive(Debug, Default)]
pub struct Utf8Chunker {
    pending: Vec<u8>,
}

impl Utf8Chunker {
    pub fn new() -> Self {
        Self::default()
    }

    /// Decode as much of `bytes` (after what is pending) as forms whole characters.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let keep = incomplete_tail(&self.pending);
        let cut = self.pending.len() - keep;
        let text = String::from_utf8_lossy(&self.pending[..cut]).into_owned();
        self.pending.drain(..cut);
        text
    }

    /// Whatever is left at the end of the stream.
    pub fn finish(&mut self) -> String {
        let text = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        text
    }
}

/// Length of a trailing, possibly incomplete UTF-8 sequence (0..=3).
fn incomplete_tail(b: &[u8]) -> usize {
    for back in 1..=3.min(b.len()) {
        let byte = b[b.len() - back];
        if byte & 0b1100_0000 == 0b1000_0000 {
            continue; // continuation byte: look further back
        }
        let need = if byte & 0b1110_0000 == 0b1100_0000 {
            2
        } else if byte & 0b1111_0000 == 0b1110_0000 {
            3
        } else if byte & 0b1111_1000 == 0b1111_0000 {
            4
        } else {
            return 0;
        };
        return if back < need { back } else { 0 };
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn never_splits_a_character() {
        let text = "héllo wörld — 日本語 🎉 done";
        let bytes = text.as_bytes();
        for split in 0..bytes.len() {
            let mut c = Utf8Chunker::new();
            let mut out = c.push(&bytes[..split]);
            out += &c.push(&bytes[split..]);
            out += &c.finish();
            assert_eq!(out, text, "split at {split}");
        }
    }

    #[test]
    fn invalid_bytes_become_replacement_characters() {
        let mut c = Utf8Chunker::new();
        let mut out = c.push(b"a\xffb");
        out += &c.finish();
        assert_eq!(out, "a\u{fffd}b");
    }
}
