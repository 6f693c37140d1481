//! Guest path resolution (`sandpit_protocol::resolve_guest_path`) on
//! arbitrary text.
//!
//! Every file and `cwd` parameter goes through it: in the service first
//! (`check_path`, to refuse a bad path before a sandbox is reached), then in
//! the agent, which opens what it returns. It promises: relative paths are
//! resolved against /workspace, absolute ones kept; `.` and `..` are folded
//! lexically; empty paths and NUL bytes are refused. Checked, for any text:
//! no panic; refused exactly when empty or holding a NUL; the result is
//! absolute, normal (no empty, `.` or `..` component, no trailing `/` but
//! for `/` itself), free of NUL, and resolves to itself; its components are
//! the input's, in order; a relative path resolves as `/workspace/` + it
//! does, and one without `..` stays under /workspace; and the service's
//! `check_path` agrees with it.

#![no_main]

use libfuzzer_sys::fuzz_target;
use sandpit_protocol::{resolve_guest_path, ErrorKind, WORKSPACE};

fuzz_target!(|data: &[u8]| {
    // The path is a JSON string in every request: always UTF-8.
    let Ok(path) = std::str::from_utf8(data) else {
        return;
    };
    let resolved = resolve_guest_path(path);
    assert_eq!(
        sandpit_core::service::check_path(path).is_ok(),
        resolved.is_ok(),
        "the service and the agent judge a path alike"
    );
    let r = match resolved {
        Ok(r) => r,
        Err(e) => {
            assert_eq!(e.kind, ErrorKind::InvalidPath);
            assert!(
                path.is_empty() || path.contains('\0'),
                "{path:?} refused: {e}"
            );
            return;
        }
    };
    assert!(!path.is_empty() && !path.contains('\0'));

    assert!(r.starts_with('/'), "{r:?}");
    assert!(!r.contains('\0'));
    if r != "/" {
        assert!(!r.ends_with('/'), "{r:?}");
        for part in r[1..].split('/') {
            assert!(!matches!(part, "" | "." | ".."), "{path:?} -> {r:?}");
        }
    }
    assert_eq!(
        resolve_guest_path(&r).unwrap(),
        r,
        "resolving is idempotent"
    );

    // The result's components are the input's (workspace included), in order.
    let joined = if path.starts_with('/') {
        path.to_string()
    } else {
        format!("{WORKSPACE}/{path}")
    };
    let mut input = joined.split('/');
    for part in r.split('/').filter(|p| !p.is_empty()) {
        assert!(
            input.any(|p| p == part),
            "{part:?} of {r:?} is not from {path:?}"
        );
    }

    if !path.starts_with('/') {
        assert_eq!(
            resolve_guest_path(&format!("{WORKSPACE}/{path}")).unwrap(),
            r
        );
        if !path.split('/').any(|p| p == "..") {
            assert!(
                r == WORKSPACE || r.starts_with(&format!("{WORKSPACE}/")),
                "{path:?} left the workspace: {r:?}"
            );
        }
    }
});
