//! The file operations on a real file system, as the agent runs them.

use super::*;
use crate::channel::Outbox;
use sandpit_protocol::{FileKind, CHUNK_LEN};
use std::fs;
use std::os::unix::fs::symlink;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::sync::mpsc;

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("sandpit-agent-files-{}-{name}", std::process::id()));
    let _ = fs::remove_dir_all(&d);
    fs::create_dir_all(&d).unwrap();
    d
}

fn read_all(p: &Path) -> Vec<u8> {
    fs::read(p).unwrap()
}

fn s(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

#[test]
fn errno_mapping() {
    let k = |errno| io_error(&io::Error::from_raw_os_error(errno), "/x").kind;
    assert_eq!(k(libc::ENOENT), ErrorKind::NotFound);
    assert_eq!(k(libc::EISDIR), ErrorKind::IsADirectory);
    assert_eq!(k(libc::ENOTDIR), ErrorKind::NotADirectory);
    assert_eq!(k(libc::EACCES), ErrorKind::PermissionDenied);
    assert_eq!(k(libc::EPERM), ErrorKind::PermissionDenied);
    assert_eq!(k(libc::ENOSPC), ErrorKind::Io);
    let e = io_error(&io::Error::from_raw_os_error(libc::ENOSPC), "/x");
    assert_eq!(e.message, "/x: No space left on device");
}

fn upload(
    path: &str,
    chunks: Vec<Vec<u8>>,
    size: u64,
    mode: Option<u32>,
) -> Result<Option<DoneResult>, AgentError> {
    let (tx, rx) = mpsc::sync_channel(chunks.len() + 1);
    for c in chunks {
        tx.send(c).unwrap();
    }
    drop(tx);
    write_file(path, size, mode, rx)
}

#[test]
fn writes_are_binary_exact_and_create_parents() {
    let d = scratch("write");
    let target = d.join("a/b/c.bin");
    let body: Vec<u8> = (0..=255u8).cycle().take(70_000).collect();
    let r = upload(
        &s(&target),
        vec![body[..1000].to_vec(), body[1000..].to_vec()],
        body.len() as u64,
        Some(0o755),
    )
    .unwrap();
    assert_eq!(
        r,
        Some(DoneResult::Written {
            path: s(&target),
            bytes: 70_000
        })
    );
    assert_eq!(read_all(&target), body);
    assert_eq!(
        fs::metadata(&target).unwrap().permissions().mode() & 0o777,
        0o755
    );
    // Overwrite with an empty file, default mode; no temp files left.
    upload(&s(&target), vec![], 0, None).unwrap().unwrap();
    assert!(read_all(&target).is_empty());
    assert_eq!(
        fs::metadata(&target).unwrap().permissions().mode() & 0o777,
        0o644
    );
    assert_eq!(fs::read_dir(d.join("a/b")).unwrap().count(), 1);
    fs::remove_dir_all(d).unwrap();
}

#[test]
fn write_errors() {
    let d = scratch("write-errors");
    let e = upload(&s(&d), vec![], 0, None).unwrap_err();
    assert_eq!(e.kind, ErrorKind::IsADirectory);
    assert_eq!(
        upload("/", vec![], 0, None).unwrap_err().kind,
        ErrorKind::IsADirectory
    );
    fs::write(d.join("file"), "x").unwrap();
    let e = upload(&s(&d.join("file/sub")), vec![], 0, None).unwrap_err();
    assert_eq!(e.kind, ErrorKind::NotADirectory);
    let e = upload(&s(&d.join("file/sub/deeper")), vec![], 0, None).unwrap_err();
    assert_eq!(e.kind, ErrorKind::NotADirectory);
    let e = upload(&s(&d.join("big")), vec![vec![1; 10]], 5, None).unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidRequest);
    // The session ended midway: nothing written, no temp file left.
    assert_eq!(
        upload(&s(&d.join("cut")), vec![vec![1; 3]], 5, None).unwrap(),
        None
    );
    let mut names: Vec<_> = fs::read_dir(&d)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    names.sort();
    assert_eq!(names, vec!["file"]);
    fs::remove_dir_all(d).unwrap();
}

fn decode_all(rx: &mpsc::Receiver<(u64, Vec<u8>)>) -> Vec<sandpit_protocol::Frame> {
    let mut d = sandpit_protocol::FrameDecoder::new();
    while let Ok((_, bytes)) = rx.try_recv() {
        d.push(&bytes);
    }
    std::iter::from_fn(|| d.next_frame().unwrap()).collect()
}

#[test]
fn a_read_with_a_window_waits_for_acks_and_stops_when_cancelled() {
    let d = scratch("window");
    let (tx, rx) = mpsc::sync_channel(64);
    let reply = Reply::new(u64::MAX, Outbox::for_test(tx));
    let body = vec![7u8; 4 * CHUNK_LEN];
    let p = d.join("f");
    fs::write(&p, &body).unwrap();
    let send_window = open_read(40, (CHUNK_LEN + 100) as u32);
    let path = s(&p);
    let reading =
        std::thread::spawn(move || read_file(&reply, 40, &path, 1 << 30, Some(&send_window)));
    let data_sent = |frames: &[sandpit_protocol::Frame]| -> usize {
        frames
            .iter()
            .filter(|f| matches!(f.message, Message::FileData { .. }))
            .map(|f| f.body.len())
            .sum()
    };
    std::thread::sleep(std::time::Duration::from_millis(200));
    let mut frames = decode_all(&rx);
    assert_eq!(data_sent(&frames), CHUNK_LEN + 100, "the window, no more");
    ack_read(40, CHUNK_LEN as u32);
    std::thread::sleep(std::time::Duration::from_millis(200));
    frames.extend(decode_all(&rx));
    assert_eq!(data_sent(&frames), 2 * CHUNK_LEN + 100);
    // The host gave up on it: it stops, with nothing more sent.
    assert!(close_read(40));
    reading.join().unwrap().unwrap();
    assert!(decode_all(&rx).is_empty());
    assert!(!close_read(40));
    fs::remove_dir_all(d).unwrap();
}

#[test]
fn reads_in_chunks_and_refuses_what_it_must() {
    let d = scratch("read");
    let (tx, rx) = mpsc::sync_channel(64);
    let reply = Reply::new(u64::MAX, Outbox::for_test(tx));
    let body: Vec<u8> = (0..CHUNK_LEN + 10).map(|i| (i % 251) as u8).collect();
    let p = d.join("f");
    fs::write(&p, &body).unwrap();
    read_file(&reply, 4, &s(&p), body.len() as u64, None).unwrap();
    let frames = decode_all(&rx);
    assert_eq!(
        frames[0].message,
        Message::FileInfo {
            id: 4,
            path: s(&p),
            size: body.len() as u64
        }
    );
    assert_eq!(frames.len(), 4);
    let data: Vec<u8> = frames[1..3].iter().flat_map(|f| f.body.clone()).collect();
    assert_eq!(data, body);
    assert!(
        matches!(frames[3].message, Message::Done { id: 4, result: DoneResult::Read { bytes, .. } } if bytes == body.len() as u64)
    );

    let e = read_file(&reply, 5, &s(&p), 10, None).unwrap_err();
    assert_eq!(e.kind, ErrorKind::TooLarge);
    assert!(e.message.contains(&body.len().to_string()) && e.message.contains("10"));
    assert_eq!(
        read_file(&reply, 6, &s(&d), 10, None).unwrap_err().kind,
        ErrorKind::IsADirectory
    );
    assert_eq!(
        read_file(&reply, 7, &s(&d.join("nope")), 10, None)
            .unwrap_err()
            .kind,
        ErrorKind::NotFound
    );
    assert!(decode_all(&rx).is_empty());

    // procfs: size 0 in stat, content on read.
    read_file(&reply, 8, "/proc/self/status", 1 << 20, None).unwrap();
    let frames = decode_all(&rx);
    let Message::FileInfo { size, .. } = frames[0].message else {
        panic!()
    };
    assert!(size > 0);
    assert_eq!(
        read_file(&reply, 9, "/proc/self/status", 3, None)
            .unwrap_err()
            .kind,
        ErrorKind::TooLarge
    );
    fs::remove_dir_all(d).unwrap();
}

fn names(r: &DoneResult) -> Vec<(String, FileKind, u64)> {
    let DoneResult::Listing { entries, .. } = r else {
        panic!()
    };
    entries
        .iter()
        .map(|e| (e.name.clone(), e.kind, e.size_bytes))
        .collect()
}

#[test]
fn listings_are_sorted_never_follow_symlinks_and_truncate() {
    let d = scratch("list");
    fs::create_dir_all(d.join("a/b")).unwrap();
    fs::create_dir_all(d.join("a-c")).unwrap();
    fs::write(d.join("a/b/f.txt"), "12345").unwrap();
    fs::write(d.join("z"), "1").unwrap();
    symlink("/", d.join("a/root-link")).unwrap();
    let all = list(&s(&d), true, 100).unwrap();
    assert_eq!(
        names(&all),
        vec![
            ("a".into(), FileKind::Dir, 0),
            ("a-c".into(), FileKind::Dir, 0),
            ("a/b".into(), FileKind::Dir, 0),
            ("a/b/f.txt".into(), FileKind::File, 5),
            ("a/root-link".into(), FileKind::Symlink, 0),
            ("z".into(), FileKind::File, 1),
        ]
    );
    let DoneResult::Listing {
        truncated, path, ..
    } = &all
    else {
        panic!()
    };
    assert!(!truncated);
    assert_eq!(path, &s(&d));

    let top = list(&s(&d), false, 100).unwrap();
    assert_eq!(names(&top).len(), 3);
    let cut = list(&s(&d), true, 3).unwrap();
    assert_eq!(
        names(&cut).iter().map(|n| n.0.clone()).collect::<Vec<_>>(),
        vec!["a", "a-c", "a/b"]
    );
    assert!(matches!(
        cut,
        DoneResult::Listing {
            truncated: true,
            ..
        }
    ));
    let exact = list(&s(&d), true, 6).unwrap();
    assert!(matches!(
        exact,
        DoneResult::Listing {
            truncated: false,
            ..
        }
    ));

    let one = list(&s(&d.join("a/b/f.txt")), true, 10).unwrap();
    assert_eq!(names(&one), vec![("f.txt".into(), FileKind::File, 5)]);
    // A symlink named as the root: followed to a directory, as `ls` does
    // (its entries' symlinks still are not); described when it leads to a
    // file or nowhere.
    symlink(d.join("a/b"), d.join("b-link")).unwrap();
    let link = list(&s(&d.join("b-link")), true, 10).unwrap();
    assert_eq!(names(&link), vec![("f.txt".into(), FileKind::File, 5)]);
    symlink(d.join("a/b/f.txt"), d.join("f-link")).unwrap();
    symlink(d.join("nowhere"), d.join("dangling")).unwrap();
    for name in ["f-link", "dangling"] {
        let link = list(&s(&d.join(name)), true, 10).unwrap();
        assert_eq!(names(&link), vec![(name.into(), FileKind::Symlink, 0)]);
    }
    assert_eq!(
        list(&s(&d.join("missing")), false, 1).unwrap_err().kind,
        ErrorKind::NotFound
    );
    fs::remove_dir_all(d).unwrap();
}

#[test]
fn deletes() {
    let d = scratch("delete");
    fs::create_dir_all(d.join("tree/sub")).unwrap();
    fs::write(d.join("tree/sub/f"), "x").unwrap();
    fs::create_dir_all(d.join("outside")).unwrap();
    fs::write(d.join("outside/keep"), "x").unwrap();
    symlink(d.join("outside"), d.join("tree/link")).unwrap();
    fs::create_dir(d.join("empty")).unwrap();
    fs::write(d.join("file"), "x").unwrap();

    let e = delete(&s(&d.join("tree")), false).unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidRequest);
    assert_eq!(e.message, "directory not empty; pass recursive");
    delete(&s(&d.join("tree")), true).unwrap();
    assert!(!d.join("tree").exists());
    assert!(d.join("outside/keep").exists(), "followed a symlink");
    delete(&s(&d.join("empty")), false).unwrap();
    assert_eq!(
        delete(&s(&d.join("file")), false).unwrap(),
        DoneResult::Deleted {
            path: s(&d.join("file"))
        }
    );
    assert_eq!(
        delete(&s(&d.join("file")), false).unwrap_err().kind,
        ErrorKind::NotFound
    );
    assert_eq!(delete("/", true).unwrap_err().kind, ErrorKind::InvalidPath);
    fs::remove_dir_all(d).unwrap();
}

#[test]
fn paths_are_described_made_and_moved() {
    let d = scratch("paths");
    let entry = |r: DoneResult| match r {
        DoneResult::PathInfo { entry } => entry,
        other => panic!("{other:?}"),
    };
    fs::write(d.join("f"), "12345").unwrap();
    symlink("f", d.join("l")).unwrap();
    let f = entry(
        path_call(PathCall::Stat {
            path: s(&d.join("f")),
        })
        .unwrap(),
    );
    assert_eq!(
        (f.name.as_str(), f.kind, f.size_bytes),
        ("f", FileKind::File, 5)
    );
    assert_eq!(f.path, s(&d.join("f")));
    assert!(f.modified_unix_ms > 1_600_000_000_000, "{f:?}");
    assert!(!f.owner.is_empty() && !f.group.is_empty(), "{f:?}");
    let l = entry(
        path_call(PathCall::Stat {
            path: s(&d.join("l")),
        })
        .unwrap(),
    );
    assert_eq!(
        (l.kind, l.symlink_target.as_deref()),
        (FileKind::Symlink, Some("f"))
    );
    let missing = path_call(PathCall::Stat {
        path: s(&d.join("nope")),
    })
    .unwrap_err();
    assert_eq!(missing.kind, ErrorKind::NotFound);

    let made = entry(
        path_call(PathCall::MakeDir {
            path: s(&d.join("a/b/c")),
        })
        .unwrap(),
    );
    assert_eq!((made.name.as_str(), made.kind), ("c", FileKind::Dir));
    let again = path_call(PathCall::MakeDir {
        path: s(&d.join("a/b")),
    })
    .unwrap_err();
    assert_eq!(again.kind, ErrorKind::AlreadyExists);

    let moved = entry(
        path_call(PathCall::Move {
            from: s(&d.join("f")),
            to: s(&d.join("a/b/g")),
        })
        .unwrap(),
    );
    assert_eq!((moved.path, moved.size_bytes), (s(&d.join("a/b/g")), 5));
    assert!(!d.join("f").exists());
    let gone = path_call(PathCall::Move {
        from: s(&d.join("f")),
        to: s(&d.join("h")),
    })
    .unwrap_err();
    assert_eq!(gone.kind, ErrorKind::NotFound);
    fs::remove_dir_all(d).unwrap();
}
