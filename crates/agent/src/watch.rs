//! Watching a directory for changes ([`Message::WatchDir`]), with inotify.
//!
//! A watch is carried out by a process of the guest user's (see `files`):
//! the kernel decides what the user may watch (it needs read permission on
//! each directory), as it decides every other file call. The agent's thread
//! relays what that process sends, and closes its socket to end it. A recursive watch adds every directory under the watched one, and
//! each directory made or moved in later, so a tree is followed as it grows.
//!
//! The process reads the kernel's events, names them relative to the
//! watched directory, and sends those of one read as one frame, which the
//! agent sends on as one [`Message::WatchEvents`]. A watch ends when the
//! host cancels it, when its session ends (its process is killed), when the
//! watched directory goes, or when the kernel's queue overflowed (events
//! were lost: the watch says so rather than going on with a gap).

use crate::channel::Reply;
use crate::files::{self, io_error, link::write_frame, link::Frame, WatchFrame};
use crate::sys::{self, lock, EventFd};
use sandpit_protocol::{
    AgentError, DoneResult, ErrorKind, Message, RequestId, WatchEvent, WatchEventKind,
};
use std::collections::HashMap;
use std::ffi::OsStr;
use std::io::{self, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Most watches open at once, each a process and an inotify instance of the
/// guest user's (counted against `fs.inotify.max_user_instances`, 128 by
/// default, with the user's own programs' instances).
const MAX_WATCHES: usize = 64;

/// Most directories one recursive watch follows.
const MAX_WATCHED_DIRS: usize = 16_384;

/// Most events sent in one frame.
const EVENTS_PER_FRAME: usize = 1024;

/// How often a quiet watch checks that its session is still current.
const SESSION_CHECK: Duration = Duration::from_secs(1);

/// What a directory watch is told to stop by.
pub struct Stop {
    /// The session that asked for it.
    gen: u64,
    wake: EventFd,
}

/// The open watches, by request id.
static WATCHES: Mutex<Option<HashMap<RequestId, Arc<Stop>>>> = Mutex::new(None);

/// Register watch `id` (on the reader thread, before a cancel for it can
/// arrive); refused past [`MAX_WATCHES`].
pub fn register(id: RequestId, gen: u64) -> Result<Arc<Stop>, AgentError> {
    let wake = EventFd::new().map_err(|e| io_error(&e, "a watch's wake-up"))?;
    let mut watches = lock(&WATCHES);
    let watches = watches.get_or_insert_with(HashMap::new);
    if watches.len() >= MAX_WATCHES {
        return Err(AgentError::new(
            ErrorKind::TooLarge,
            format!("{MAX_WATCHES} directories are watched already: stop one first"),
        ));
    }
    let stop = Arc::new(Stop { gen, wake });
    watches.insert(id, stop.clone());
    Ok(stop)
}

/// Watch `id` is over.
pub fn unregister(id: RequestId) {
    if let Some(w) = lock(&WATCHES).as_mut() {
        w.remove(&id);
    }
}

/// Stop watch `id` (the host cancelled it); whether it was open.
pub fn stop(id: RequestId) -> bool {
    match lock(&WATCHES).as_ref().and_then(|w| w.get(&id)) {
        Some(s) => {
            s.wake.signal();
            true
        }
        None => false,
    }
}

/// Stop the watches of sessions before `gen` (their host is gone).
pub fn stop_sessions_before(gen: u64) {
    if let Some(w) = lock(&WATCHES).as_ref() {
        for s in w.values().filter(|s| s.gen < gen) {
            s.wake.signal();
        }
    }
}

/// Watch `path` until stopped: [`Message::Watching`], then the events, as
/// the watch's process (the guest user's, see `files`) sends them.
pub fn run(
    reply: &Reply,
    id: RequestId,
    path: &str,
    recursive: bool,
    stop: &Stop,
) -> Result<(), AgentError> {
    let mut process = files::start_watch(path, recursive)?;
    loop {
        let mut fds = [sys::pollin(process.fd()), sys::pollin(stop.wake.raw())];
        sys::poll(&mut fds, Some(SESSION_CHECK)).map_err(|e| io_error(&e, "a watch"))?;
        if sys::ready(&fds[1]) {
            reply.done(id, DoneResult::Cancelled);
            return Ok(());
        }
        if !reply.is_current() {
            return Ok(());
        }
        if !sys::ready(&fds[0]) {
            continue;
        }
        let message = match process.next()? {
            WatchFrame::Watching { path } => Message::Watching { id, path },
            WatchFrame::Events(events) => Message::WatchEvents { id, events },
        };
        reply.send(&message, &[]);
    }
}

/// The watch itself, in its process: [`Frame::Watching`] once the watches
/// are in place, then [`Frame::Events`] as the kernel reports them, until
/// the watch must end (its error is the outcome), or the agent closes the
/// request's socket, `peer`. `root` is resolved.
pub fn serve(
    out: &mut impl Write,
    peer: RawFd,
    root: &str,
    recursive: bool,
) -> Result<DoneResult, AgentError> {
    let gone = |e: io::Error| io_error(&e, "the agent's end");
    let root = PathBuf::from(root);
    let meta = std::fs::metadata(&root).map_err(|e| io_error(&e, &root.to_string_lossy()))?;
    if !meta.is_dir() {
        return Err(AgentError::new(
            ErrorKind::NotADirectory,
            format!("{}: not a directory", root.display()),
        ));
    }
    let mut tree = Tree::new(recursive)?;
    let root_wd = tree.add(&root, PathBuf::new(), true)?;
    if recursive {
        tree.add_below(&root, Path::new(""), None)?;
    }
    let watching = Frame::Watching {
        path: root.to_string_lossy().into_owned(),
    };
    write_frame(out, &watching).map_err(gone)?;
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        // The socket asked for nothing: poll reports its hang-up alone.
        let closed = libc::pollfd {
            fd: peer,
            events: 0,
            revents: 0,
        };
        let mut fds = [sys::pollin(tree.fd.as_raw_fd()), closed];
        sys::poll(&mut fds, None).map_err(|e| io_error(&e, "a watch"))?;
        if fds[1].revents & (libc::POLLHUP | libc::POLLERR) != 0 {
            return Err(AgentError::new(ErrorKind::Io, "the agent ended the watch"));
        }
        if !sys::ready(&fds[0]) {
            continue;
        }
        let n = match sys::read_fd(tree.fd.as_raw_fd(), &mut buf) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(io_error(&e, "a watch")),
        };
        let mut events = Vec::new();
        let outcome = tree.take(&root, root_wd, &buf[..n], &mut events);
        for batch in events.chunks(EVENTS_PER_FRAME) {
            write_frame(out, &Frame::Events(batch.to_vec())).map_err(gone)?;
        }
        outcome?;
    }
}

/// The inotify instance of one watch and the directories it follows.
struct Tree {
    fd: OwnedFd,
    recursive: bool,
    /// Each watch descriptor's directory, relative to the watched one.
    dirs: HashMap<i32, PathBuf>,
}

/// What the watch asks the kernel to report of each directory.
const MASK: u32 = libc::IN_CREATE
    | libc::IN_MODIFY
    | libc::IN_DELETE
    | libc::IN_MOVED_FROM
    | libc::IN_MOVED_TO
    | libc::IN_ATTRIB
    | libc::IN_ONLYDIR
    | libc::IN_EXCL_UNLINK;

impl Tree {
    fn new(recursive: bool) -> Result<Self, AgentError> {
        // SAFETY: inotify_init1 returns a new descriptor or -1.
        let fd = sys::cvt(unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) })
            .map_err(|e| match sys::errno(&e) {
                libc::EMFILE => AgentError::new(
                    ErrorKind::TooLarge,
                    "the guest's inotify instances are used up (fs.inotify.max_user_instances)",
                ),
                _ => io_error(&e, "a watch"),
            })?;
        Ok(Tree {
            // SAFETY: fd is new and owned by nobody else.
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
            recursive,
            dirs: HashMap::new(),
        })
    }

    /// Watch directory `abs` (named `rel` in events); returns its watch
    /// descriptor. Symbolic links are followed only for the watched
    /// directory itself, as the user named it.
    fn add(&mut self, abs: &Path, rel: PathBuf, follow: bool) -> Result<i32, AgentError> {
        if self.dirs.len() >= MAX_WATCHED_DIRS {
            return Err(AgentError::new(
                ErrorKind::TooLarge,
                format!("over {MAX_WATCHED_DIRS} directories to watch: watch a smaller tree"),
            ));
        }
        let c = sys::cstring(&abs.to_string_lossy()).map_err(|e| io_error(&e, "a watch"))?;
        let mask = if follow {
            MASK
        } else {
            MASK | libc::IN_DONT_FOLLOW
        };
        // SAFETY: a valid descriptor and NUL-terminated path.
        let wd = unsafe { libc::inotify_add_watch(self.fd.as_raw_fd(), c.as_ptr(), mask) };
        if wd < 0 {
            let e = io::Error::last_os_error();
            return Err(match sys::errno(&e) {
                libc::ENOSPC => AgentError::new(
                    ErrorKind::TooLarge,
                    "the guest's inotify watches are used up (fs.inotify.max_user_watches)",
                ),
                _ => io_error(&e, &abs.to_string_lossy()),
            });
        }
        self.dirs.insert(wd, rel);
        Ok(wd)
    }

    /// Watch every directory under `abs` (named `rel`), depth first. A
    /// directory the user may not read is not followed: the kernel said no,
    /// and the rest of the tree is still watched. With `found`, each entry
    /// met is reported made (`Create`): under a directory made a moment
    /// ago, what was made in it before its watch was set (`mkdir -p a/b &&
    /// touch a/b/f`) has no event of its own.
    fn add_below(
        &mut self,
        abs: &Path,
        rel: &Path,
        mut found: Option<&mut Vec<WatchEvent>>,
    ) -> Result<(), AgentError> {
        let mut todo = vec![(abs.to_path_buf(), rel.to_path_buf())];
        while let Some((dir, name)) = todo.pop() {
            let Ok(entries) = std::fs::read_dir(&dir) else {
                continue;
            };
            for entry in entries.flatten() {
                let (abs, rel) = (entry.path(), name.join(entry.file_name()));
                if let Some(found) = found.as_deref_mut() {
                    found.push(WatchEvent {
                        name: rel.to_string_lossy().into_owned(),
                        kind: WatchEventKind::Create,
                    });
                }
                if !entry.file_type().is_ok_and(|t| t.is_dir()) {
                    continue;
                }
                match self.add(&abs, rel.clone(), false) {
                    Ok(_) => todo.push((abs, rel)),
                    Err(e) if e.kind == ErrorKind::TooLarge => return Err(e),
                    Err(_) => {}
                }
            }
        }
        Ok(())
    }

    /// Stop following `rel` and every directory under it (moved out of the
    /// watched tree).
    fn forget(&mut self, rel: &Path) {
        let gone: Vec<i32> = self
            .dirs
            .iter()
            .filter(|(_, d)| d.starts_with(rel))
            .map(|(&wd, _)| wd)
            .collect();
        for wd in gone {
            self.dirs.remove(&wd);
            // SAFETY: a valid descriptor; a stale wd only fails.
            unsafe { libc::inotify_rm_watch(self.fd.as_raw_fd(), wd) };
        }
    }

    /// A directory moved within the tree: its watches (the kernel keeps
    /// them) get their new names.
    fn renamed(&mut self, from: &Path, to: &Path) {
        for d in self.dirs.values_mut() {
            if let Ok(rest) = d.strip_prefix(from) {
                *d = to.join(rest);
            }
        }
    }

    /// The events in `buf` (one read of the inotify descriptor), appended
    /// to `out`. Errs when the watch must end: the watched directory went,
    /// or the kernel dropped events.
    fn take(
        &mut self,
        root: &Path,
        root_wd: i32,
        buf: &[u8],
        out: &mut Vec<WatchEvent>,
    ) -> Result<(), AgentError> {
        let mut ended = None;
        // Directories moved away in this read, by cookie, until their
        // arrival (a move within the tree) is seen.
        let mut moved_away: HashMap<u32, PathBuf> = HashMap::new();
        for raw in RawEvents(buf) {
            if raw.mask & libc::IN_Q_OVERFLOW != 0 {
                ended = Some(AgentError::new(
                    ErrorKind::TooLarge,
                    "the guest's kernel dropped events: the directory changed faster than \
                     the watch was read",
                ));
                continue;
            }
            if raw.mask & libc::IN_IGNORED != 0 {
                self.dirs.remove(&raw.wd);
                if raw.wd == root_wd {
                    ended = Some(AgentError::new(
                        ErrorKind::NotFound,
                        format!("{}: the watched directory was removed", root.display()),
                    ));
                }
                continue;
            }
            let (Some(dir), false) = (self.dirs.get(&raw.wd), raw.name.is_empty()) else {
                continue;
            };
            let rel = dir.join(OsStr::from_bytes(raw.name));
            let is_dir = raw.mask & libc::IN_ISDIR != 0;
            let kind = if raw.mask & (libc::IN_CREATE | libc::IN_MOVED_TO) != 0 {
                if is_dir && self.recursive {
                    match moved_away.remove(&raw.cookie).filter(|_| raw.cookie != 0) {
                        Some(from) => self.renamed(&from, &rel),
                        None => {
                            // Reported before what is found in it.
                            out.push(WatchEvent {
                                name: rel.to_string_lossy().into_owned(),
                                kind: WatchEventKind::Create,
                            });
                            let abs = root.join(&rel);
                            match self.add(&abs, rel.clone(), false) {
                                Ok(_) => self.add_below(&abs, &rel, Some(out))?,
                                Err(e) if e.kind == ErrorKind::TooLarge => return Err(e),
                                Err(_) => {}
                            }
                            continue;
                        }
                    }
                }
                WatchEventKind::Create
            } else if raw.mask & libc::IN_MODIFY != 0 {
                WatchEventKind::Write
            } else if raw.mask & libc::IN_DELETE != 0 {
                WatchEventKind::Remove
            } else if raw.mask & libc::IN_MOVED_FROM != 0 {
                if is_dir && self.recursive {
                    moved_away.insert(raw.cookie, rel.clone());
                }
                WatchEventKind::Rename
            } else if raw.mask & libc::IN_ATTRIB != 0 {
                WatchEventKind::Chmod
            } else {
                continue;
            };
            out.push(WatchEvent {
                name: rel.to_string_lossy().into_owned(),
                kind,
            });
        }
        for (_, rel) in moved_away {
            self.forget(&rel);
        }
        match ended {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// One event as the kernel wrote it.
struct RawEvent<'a> {
    wd: i32,
    mask: u32,
    cookie: u32,
    /// The entry's name in its directory (empty for the directory itself).
    name: &'a [u8],
}

/// The events in one read of an inotify descriptor.
struct RawEvents<'a>(&'a [u8]);

impl<'a> Iterator for RawEvents<'a> {
    type Item = RawEvent<'a>;

    fn next(&mut self) -> Option<RawEvent<'a>> {
        const HEAD: usize = std::mem::size_of::<libc::inotify_event>();
        if self.0.len() < HEAD {
            return None;
        }
        let word = |at: usize| u32::from_ne_bytes(self.0[at..at + 4].try_into().unwrap());
        let (wd, mask, cookie, len) = (word(0) as i32, word(4), word(8), word(12) as usize);
        let end = (HEAD + len).min(self.0.len());
        let padded = &self.0[HEAD..end];
        let name = &padded[..padded.iter().position(|&b| b == 0).unwrap_or(padded.len())];
        let event = RawEvent {
            wd,
            mask,
            cookie,
            name,
        };
        self.0 = &self.0[end..];
        Some(event)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::channel::Outbox;
    use sandpit_protocol::{Frame, FrameDecoder};
    use std::sync::mpsc;

    /// A watch of a fresh directory on its own thread, and the frames it
    /// sends.
    struct Watched {
        dir: PathBuf,
        frames: mpsc::Receiver<(u64, Vec<u8>)>,
        decoder: FrameDecoder,
        stop: Arc<Stop>,
        thread: Option<std::thread::JoinHandle<Result<(), AgentError>>>,
    }

    fn scratch(id: RequestId) -> PathBuf {
        let d =
            std::env::temp_dir().join(format!("sandpit-agent-watch-{}-{id}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn watch(id: RequestId, recursive: bool) -> Watched {
        let dir = scratch(id);
        std::fs::create_dir(dir.join("old")).unwrap();
        let (tx, frames) = mpsc::sync_channel(1024);
        let reply = Reply::new(crate::channel::generation(), Outbox::for_test(tx));
        let stop = register(id, reply.generation()).unwrap();
        let (path, s) = (dir.to_string_lossy().into_owned(), stop.clone());
        let thread = std::thread::spawn(move || {
            let r = run(&reply, id, &path, recursive, &s);
            unregister(id);
            r
        });
        let mut w = Watched {
            dir,
            frames,
            decoder: FrameDecoder::new(),
            stop,
            thread: Some(thread),
        };
        assert!(matches!(w.next().message, Message::Watching { .. }));
        w
    }

    impl Watched {
        fn next(&mut self) -> Frame {
            loop {
                if let Some(f) = self.decoder.next_frame().unwrap() {
                    return f;
                }
                let (_, bytes) = self
                    .frames
                    .recv_timeout(Duration::from_secs(10))
                    .expect("no frame within 10 s");
                self.decoder.push(&bytes);
            }
        }

        /// Events until `last` is among them.
        fn events_until(&mut self, last: (&str, WatchEventKind)) -> Vec<(String, WatchEventKind)> {
            let mut seen: Vec<(String, WatchEventKind)> = Vec::new();
            while !seen.iter().any(|(n, k)| (n.as_str(), *k) == last) {
                match self.next().message {
                    Message::WatchEvents { events, .. } => {
                        seen.extend(events.into_iter().map(|e| (e.name, e.kind)))
                    }
                    other => panic!("{other:?} after {seen:?}"),
                }
            }
            seen
        }

        fn end(mut self, id: RequestId) -> Message {
            self.stop.wake.signal();
            self.thread.take().unwrap().join().unwrap().unwrap();
            let m = self.next().message;
            assert!(lock(&WATCHES).as_ref().unwrap().get(&id).is_none());
            let _ = std::fs::remove_dir_all(&self.dir);
            m
        }
    }

    use WatchEventKind::*;

    #[test]
    fn a_watch_names_what_changes_in_its_directory() {
        let mut w = watch(901, false);
        let d = w.dir.clone();
        std::fs::write(d.join("a.txt"), "one").unwrap();
        let seen = w.events_until(("a.txt", Write));
        assert_eq!(seen[0], ("a.txt".into(), Create));
        std::fs::rename(d.join("a.txt"), d.join("b.txt")).unwrap();
        let seen = w.events_until(("b.txt", Create));
        assert_eq!(seen[0], ("a.txt".into(), Rename));
        std::fs::set_permissions(d.join("b.txt"), std::fs::Permissions::from_mode(0o600)).unwrap();
        w.events_until(("b.txt", Chmod));
        std::fs::remove_file(d.join("b.txt")).unwrap();
        w.events_until(("b.txt", Remove));
        // Not recursive: a file in a subdirectory is not seen, the next
        // change here is.
        std::fs::write(d.join("old/inner"), "x").unwrap();
        std::fs::write(d.join("c"), "").unwrap();
        let seen = w.events_until(("c", Create));
        assert!(seen.iter().all(|(n, _)| !n.contains("inner")), "{seen:?}");
        assert!(matches!(
            w.end(901),
            Message::Done {
                id: 901,
                result: DoneResult::Cancelled
            }
        ));
    }

    #[test]
    fn a_recursive_watch_follows_the_tree_as_it_grows_and_moves() {
        let mut w = watch(902, true);
        let d = w.dir.clone();
        std::fs::write(d.join("old/inner"), "x").unwrap();
        w.events_until(("old/inner", Write));
        // A directory made now, and one made inside it at once, with a
        // file: whether or not each was made before its directory's watch
        // was set, each is reported made.
        std::fs::create_dir_all(d.join("new/deeper")).unwrap();
        std::fs::write(d.join("new/deeper/early"), "e").unwrap();
        let seen = w.events_until(("new/deeper/early", Create));
        assert!(seen.contains(&("new".into(), Create)), "{seen:?}");
        assert!(seen.contains(&("new/deeper".into(), Create)), "{seen:?}");
        std::fs::write(d.join("new/deeper/f"), "y").unwrap();
        w.events_until(("new/deeper/f", Write));
        // Moved within the tree: followed under its new name.
        std::fs::rename(d.join("new"), d.join("moved")).unwrap();
        w.events_until(("moved", Create));
        std::fs::write(d.join("moved/deeper/g"), "z").unwrap();
        w.events_until(("moved/deeper/g", Write));
        w.end(902);
    }

    #[test]
    fn the_watched_directory_going_ends_the_watch_saying_so() {
        let mut w = watch(903, false);
        let d = w.dir.clone();
        std::fs::remove_dir(d.join("old")).unwrap();
        std::fs::remove_dir(&d).unwrap();
        // The thread ends on its own (its error is the request's answer).
        let e = w.thread.take().unwrap().join().unwrap().unwrap_err();
        assert_eq!(e.kind, ErrorKind::NotFound, "{e:?}");
        assert!(e.message.contains("removed"), "{e:?}");
        assert!(lock(&WATCHES).as_ref().unwrap().get(&903).is_none());
    }

    #[test]
    fn a_file_is_not_watched_as_a_directory() {
        let dir = scratch(904);
        std::fs::write(dir.join("f"), "").unwrap();
        let (tx, _frames) = mpsc::sync_channel(16);
        let reply = Reply::new(crate::channel::generation(), Outbox::for_test(tx));
        let stop = register(904, reply.generation()).unwrap();
        let e = run(&reply, 904, &dir.join("f").to_string_lossy(), false, &stop).unwrap_err();
        unregister(904);
        assert_eq!(e.kind, ErrorKind::NotADirectory);
        std::fs::remove_dir_all(dir).unwrap();
    }

    use std::os::unix::fs::PermissionsExt;
}
