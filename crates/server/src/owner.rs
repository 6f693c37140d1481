//! One owner at a time for a data directory's VMs.
//!
//! A process that runs the core service over this machine's VMs (`serve`,
//! `mcp`, the detached `reap`, `bench`) reconciles at start: VMs that no
//! live sandbox of *its* store owns are removed. A second such process on
//! the same data directory (a server and `sandpit mcp`, a bench beside a
//! server, two nodes by mistake) would therefore destroy the first one's
//! sandboxes. `sandpit sandbox` makes VMs in the same directory without a
//! store, which a running server would remove too.
//!
//! So each of them holds an exclusive `flock` on `DATA_DIR/owner.lock` for
//! as long as it runs (the kernel drops it when the process dies, however
//! it dies, so a crash never leaves a stale lock) and writes its pid and role
//! there for the next one to read. A second owner gets a clear error naming
//! the first.
//!
//! The one hand-over is with the reaper: `sandpit mcp` leaves a detached
//! `sandpit reap` behind when its client goes, to expire what is left. The
//! reaper waits for the lock the exiting `mcp` still holds; a later `serve`
//! or `mcp` on the directory stops the reaper (SIGTERM) and takes over,
//! since it expires sandboxes too.

use anyhow::{bail, Context, Result};
use std::fs::File;
use std::io::{Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The file whose lock says who owns a data directory.
const LOCK_FILE: &str = "owner.lock";

/// How long a new owner waits for a reaper it asked to stop, and a reaper
/// for the `mcp` that started it to exit.
const HAND_OVER: Duration = Duration::from_secs(30);

/// How long a new owner waits for a lock whose writer is gone (see
/// [`acquire`]): a child between `fork` and `exec` holds it that long at
/// most, even on a host short of CPU.
const IN_TRANSIT: Duration = Duration::from_secs(10);

/// What an owner is doing, as written in the lock file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Serve,
    Node,
    Mcp,
    Reap,
    Bench,
    /// A `sandpit sandbox` command.
    Cli,
}

impl Role {
    fn name(self) -> &'static str {
        match self {
            Role::Serve => "sandpit serve",
            Role::Node => "sandpit node",
            Role::Mcp => "sandpit mcp",
            Role::Reap => "sandpit reap",
            Role::Bench => "sandpit bench",
            Role::Cli => "sandpit sandbox",
        }
    }
}

/// The held lock; dropping it (or the process ending) lets the next owner in.
#[derive(Debug)]
pub struct Ownership {
    _file: File,
}

/// What [`acquire`] found.
#[derive(Debug)]
pub enum Acquired {
    Owner(Ownership),
    /// (reap only) someone else owns the directory, and expires its
    /// sandboxes: the reaper has nothing to do.
    NotNeeded,
}

/// Takes the data directory's ownership for `role` (see the module docs).
pub fn acquire(data_dir: &Path, role: Role) -> Result<Acquired> {
    let path = data_dir.join(LOCK_FILE);
    let mut file = open(&path)?;
    if try_lock(&file)? {
        return claim(file, role).map(Acquired::Owner);
    }
    let holder = read_holder(&mut file);
    match (role, holder.as_ref().map(|h| h.1.as_str())) {
        // The `mcp` that started this reaper is on its way out (or a server
        // has taken over, in which case waiting ends with NotNeeded).
        (Role::Reap, Some(r)) if r != Role::Reap.name() => {
            if wait_for_lock(&file, HAND_OVER)? {
                return claim(file, role).map(Acquired::Owner);
            }
            Ok(Acquired::NotNeeded)
        }
        (Role::Reap, _) => Ok(Acquired::NotNeeded),
        (Role::Serve | Role::Node | Role::Mcp, Some(r)) if r == Role::Reap.name() => {
            let (pid, _) = holder.expect("matched Some");
            // SAFETY: kill with a pid read from the lock file; the lock is
            // still held, so that process is alive and is the reaper.
            unsafe {
                libc::kill(pid, libc::SIGTERM);
            }
            if wait_for_lock(&file, HAND_OVER)? {
                return claim(file, role).map(Acquired::Owner);
            }
            bail!(
                "the data directory {} is held by its reaper (pid {pid}), which did not stop \
                 within {HAND_OVER:?}",
                data_dir.display()
            )
        }
        // The owner that wrote the file is gone, yet the lock is held: by a
        // child it forked and that has not yet reached `exec` (which closes
        // the descriptor), as when a server is SIGKILLed while starting a
        // process and restarted at once. That ends within moments.
        _ if holder.as_ref().is_none_or(|(pid, _)| !is_sandpit(*pid))
            && wait_for_lock(&file, IN_TRANSIT)? =>
        {
            claim(file, role).map(Acquired::Owner)
        }
        _ => {
            let who = match holder {
                Some((pid, r)) => format!("{r} (pid {pid})"),
                None => "another sandpit process".into(),
            };
            bail!(
                "the data directory {} is in use by {who}: one process at a time runs a data \
                 directory's VMs (a second would remove the first one's sandboxes). Use that \
                 process (its API, or `sandpit mcp --remote`), stop it, or give this one \
                 another --data-dir",
                data_dir.display()
            )
        }
    }
}

fn open(path: &PathBuf) -> Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))
}

fn try_lock(file: &File) -> Result<bool> {
    // SAFETY: flock on a descriptor this function's caller owns.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc == 0 {
        return Ok(true);
    }
    let err = std::io::Error::last_os_error();
    if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
        Ok(false)
    } else {
        Err(err).context("locking the data directory")
    }
}

fn wait_for_lock(file: &File, patience: Duration) -> Result<bool> {
    let deadline = Instant::now() + patience;
    loop {
        if try_lock(file)? {
            return Ok(true);
        }
        if Instant::now() >= deadline {
            return Ok(false);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn claim(mut file: File, role: Role) -> Result<Ownership> {
    file.set_len(0)?;
    file.rewind()?;
    writeln!(file, "{} {}", std::process::id(), role.name())?;
    file.flush()?;
    Ok(Ownership { _file: file })
}

/// Who holds `data_dir` now, as its lock file says: read without taking
/// the lock (an owner starting may be waiting for it), so `None` also when
/// the process that wrote it is gone.
pub fn holder(data_dir: &Path) -> Option<(i32, String)> {
    let mut file = File::open(data_dir.join(LOCK_FILE)).ok()?;
    let (pid, role) = read_holder(&mut file)?;
    is_sandpit(pid).then_some((pid, role))
}

/// Whether `pid` is a live `sandpit` process.
fn is_sandpit(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|comm| comm.trim() == "sandpit")
}

/// The pid and role the current holder wrote.
fn read_holder(file: &mut File) -> Option<(i32, String)> {
    let mut s = String::new();
    file.rewind().ok()?;
    file.read_to_string(&mut s).ok()?;
    let (pid, role) = s.trim().split_once(' ')?;
    Some((pid.parse().ok()?, role.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::CommandExt;

    /// A server SIGKILLed while it forks a child leaves that child holding
    /// the lock until its `exec`: the next owner waits for it instead of
    /// naming the dead server as the one in the way.
    #[test]
    fn a_lock_held_only_by_a_dead_owners_child_is_waited_for() {
        let dir = tempfile::tempdir().unwrap();
        let mut file = open(&dir.path().join(LOCK_FILE)).unwrap();
        assert!(try_lock(&file).unwrap());
        // A pid no process has (above the kernel's maximum).
        writeln!(file, "2147483647 sandpit serve").unwrap();
        let fd = file.as_raw_fd();
        let mut child = std::process::Command::new("sleep");
        child.arg("1");
        // SAFETY: fcntl is async-signal-safe; without CLOEXEC, `sleep`
        // keeps the descriptor, and so the lock, as a child in transit would.
        unsafe {
            child.pre_exec(move || {
                if libc::fcntl(fd, libc::F_SETFD, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = child.spawn().unwrap();
        drop(file);
        let t = Instant::now();
        let acquired = acquire(dir.path(), Role::Serve).unwrap();
        assert!(matches!(acquired, Acquired::Owner(_)), "{acquired:?}");
        assert!(
            t.elapsed() >= Duration::from_millis(500),
            "{:?}",
            t.elapsed()
        );
        child.wait().unwrap();
        let (pid, role) =
            read_holder(&mut File::open(dir.path().join(LOCK_FILE)).unwrap()).unwrap();
        assert_eq!(
            (pid, role.as_str()),
            (std::process::id() as i32, "sandpit serve")
        );
    }
}
