//! The README's set-up as a new user meets it, tested: `tests/setup.rs` runs
//! the real `scripts/install-deps.sh` in clean Debian 12 roots.
//!
//! A crate of its own, with no dependency on the rest of the workspace, so
//! that `scripts/test.sh` builds this one test in seconds and runs it (minutes
//! of apt and dpkg, mostly waiting on Debian's mirror and the disk) beside
//! the builds. The library itself is empty.
