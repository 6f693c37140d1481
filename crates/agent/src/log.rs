//! Logging to the kernel ring buffer.
//!
//! PID 1 has no syslog and its stdout is the (slow, emulated) serial console,
//! which we keep quiet. `/dev/kmsg` is always there, costs one write per line,
//! ends up in `dmesg` and in the host's console log when the kernel panics.
//! Outside a VM (development), lines go to stderr instead.

use std::fmt;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::sync::OnceLock;

static KMSG: OnceLock<File> = OnceLock::new();

/// Longest message kept; the kernel cuts records at about 1 KiB anyway.
const MAX_LINE: usize = 900;

/// Start writing to /dev/kmsg (call once /dev is mounted).
pub fn use_kmsg() {
    if let Ok(f) = OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open("/dev/kmsg")
    {
        let _ = KMSG.set(f);
    }
}

/// Format one record: `<level>sandpit-agent: message`, on one line.
pub fn format_line(level: u8, args: fmt::Arguments<'_>) -> String {
    let mut msg = args.to_string().replace('\n', " | ");
    if msg.len() > MAX_LINE {
        let mut cut = MAX_LINE;
        while !msg.is_char_boundary(cut) {
            cut -= 1;
        }
        msg.truncate(cut);
        msg.push_str("...");
    }
    format!("<{level}>sandpit-agent: {msg}\n")
}

/// Write one log record; never fails, never panics.
pub fn write(level: u8, args: fmt::Arguments<'_>) {
    let line = format_line(level, args);
    match KMSG.get() {
        Some(mut f) => {
            let _ = f.write_all(line.as_bytes());
        }
        None => {
            // Drop the `<N>` prefix, which only means something to the kernel.
            let text = line.split_once('>').map_or(line.as_str(), |(_, t)| t);
            let _ = std::io::stderr().write_all(text.as_bytes());
        }
    }
}

/// Log an informational line.
#[macro_export]
macro_rules! info {
    ($($t:tt)*) => { $crate::log::write(6, format_args!($($t)*)) };
}

/// Log an error line.
#[macro_export]
macro_rules! error {
    ($($t:tt)*) => { $crate::log::write(3, format_args!($($t)*)) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_single_and_bounded() {
        let l = format_line(6, format_args!("a\nb"));
        assert_eq!(l, "<6>sandpit-agent: a | b\n");
        let long = "é".repeat(1000);
        let l = format_line(3, format_args!("{long}"));
        assert!(l.len() < 1000);
        assert!(l.starts_with("<3>sandpit-agent: "));
        assert!(l.ends_with("...\n"));
    }
}
