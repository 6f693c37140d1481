//! The file process's side: read one [`Request`], carry it out, answer
//! with [`Frame`]s (see `link`).
//!
//! In a VM this runs in a process of its own, the agent's binary started as
//! the guest user with [`PROCESS_ARG`]; where the agent is not root (in
//! development, and in unit tests) on a thread of the agent, as whoever the
//! agent is.

use super::link::{self, Frame, Request};
use super::ops;
use sandpit_protocol::{AgentError, ErrorKind};
use std::fs::File;
use std::io::{self, BufRead, BufReader, BufWriter, Write};
use std::os::fd::FromRawFd;

/// The argument that makes the agent's binary a file process.
pub const PROCESS_ARG: &str = "--file-process";

/// The longest request line taken (paths are at most 4 KiB each).
const MAX_REQUEST_LINE: u64 = 64 * 1024;

/// The file process's `main`: stdin and stdout are the agent's pipes.
pub fn main() -> ! {
    // Its name in `ps` (exec'd through a descriptor, it would be the
    // descriptor's number).
    // SAFETY: prctl with a NUL-terminated name of at most 16 bytes.
    unsafe { libc::prctl(libc::PR_SET_NAME, c"sandpit-files".as_ptr()) };
    // SAFETY: descriptors 0 and 1 are the pipes the agent gave this
    // process, owned by nothing else here.
    let (input, output) = unsafe { (File::from_raw_fd(0), File::from_raw_fd(1)) };
    let mut input = BufReader::with_capacity(sandpit_protocol::CHUNK_LEN, input);
    let mut output = BufWriter::with_capacity(sandpit_protocol::CHUNK_LEN + 64, output);
    let code = match serve(&mut input, &mut output) {
        Ok(()) => 0,
        Err(_) => 1, // the agent's end is gone: nobody to tell
    };
    std::process::exit(code)
}

/// Read one request from `input` and answer it on `output`.
pub fn serve(input: &mut impl BufRead, output: &mut impl Write) -> io::Result<()> {
    let mut line = Vec::new();
    io::Read::take(&mut *input, MAX_REQUEST_LINE).read_until(b'\n', &mut line)?;
    let request: Request = match serde_json::from_slice(line.trim_ascii_end()) {
        Ok(r) => r,
        Err(e) => {
            let refused = AgentError::new(
                ErrorKind::InvalidRequest,
                format!("the file process cannot read its request: {e}"),
            );
            return link::write_frame(output, &Frame::Done(Err(refused)));
        }
    };
    let outcome = match request {
        Request::Read { path, max_bytes } => ops::read_file(output, &path, max_bytes),
        Request::Write {
            path,
            size,
            mode,
            sync,
        } => match ops::write_file(&path, size, mode, sync, input) {
            // The upload was cut: its temporary file is gone, nobody waits.
            Ok(None) => return Ok(()),
            Ok(Some(done)) => Ok(done),
            Err(e) => Err(e),
        },
        Request::List {
            path,
            recursive,
            max_entries,
        } => ops::list(&path, recursive, max_entries),
        Request::Delete { path, recursive } => ops::delete(&path, recursive),
        Request::Path { call } => ops::path_call(call),
        Request::Watch { path, recursive } => crate::watch::serve(output, &path, recursive),
    };
    link::write_frame(output, &Frame::Done(outcome))
}
