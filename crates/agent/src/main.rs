//! `sandpit-agent`: PID 1 of every Sandpit VM, and the host's only way in.
//!
//! The initramfs `switch_root`s straight into this binary: there is no
//! systemd, so the agent both keeps the system running (mounts, cgroups,
//! reaping orphans, see `init` and `reaper`) and serves the host's requests
//! over one virtio-serial port (`channel`, `server`): run commands (`exec`,
//! `output`), move files (`files`), configure the guest (`config`, `net`,
//! `outbound`).
//!
//! It is a static binary with no async runtime: threads block in syscalls and
//! an idle sandbox costs no CPU (no timers, no polling loops). As PID 1 it must
//! never exit: a dying init panics the kernel, so handlers' panics are caught
//! and errors are logged and survived.
//!
//! Outside a VM (not PID 1) the init duties are skipped and, for tests, the
//! channel can be an inherited descriptor named by `SANDPIT_AGENT_FD`.

mod cgroup;
mod channel;
mod clock;
mod config;
mod exec;
mod files;
mod init;
mod log;
mod net;
mod outbound;
mod output;
mod processes;
mod pty;
mod reaper;
mod server;
mod spawn;
mod stats;
mod sys;
mod tunnel;
mod volumes;
mod watch;
mod window;
mod workers;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

/// True when running as the VM's init.
pub fn is_pid1() -> bool {
    std::process::id() == 1
}

fn main() {
    // The agent's binary started for a file request, as the guest user.
    if std::env::args_os()
        .nth(1)
        .is_some_and(|a| a == files::PROCESS_ARG)
    {
        files::process_main();
    }
    // SAFETY: plain syscall.
    if unsafe { libc::geteuid() } == 0 {
        // Each file request in a process of the guest user's (see `files`).
        files::run_in_user_processes();
    }
    // Before any thread exists, so that every thread inherits it: SIGCHLD is
    // only ever taken by the reaper's sigwait, SIGIO by the reader's.
    if let Err(e) = sys::block_signals(&[libc::SIGCHLD, libc::SIGIO]) {
        error!("cannot block SIGCHLD/SIGIO: {e}");
    }
    // SAFETY: plain syscalls.
    unsafe {
        libc::umask(0o022);
        if is_pid1() {
            // Whatever the initramfs left open must not leak into commands.
            libc::syscall(
                libc::SYS_close_range,
                3 as libc::c_uint,
                libc::c_uint::MAX,
                libc::CLOSE_RANGE_CLOEXEC,
            );
            // Nice values are per thread and inherited: set before threads
            // start, so the user's CPU hogs cannot starve any of ours.
            libc::setpriority(libc::PRIO_PROCESS, 0, -10);
        } else {
            // Development: adopt our commands' orphans like PID 1 would.
            libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
        }
    }
    std::panic::set_hook(Box::new(|info| error!("panic: {info}")));
    if is_pid1() {
        init::early();
    }
    while let Err(e) = reaper::start() {
        error!("cannot start the reaper: {e}");
        thread::sleep(Duration::from_secs(1));
    }

    let port = Arc::new(channel::open_port());
    let outbox = loop {
        match channel::start_writer(port.clone()) {
            Ok(o) => break o,
            Err(e) => {
                error!("cannot start the writer: {e}");
                thread::sleep(Duration::from_secs(1));
            }
        }
    };
    if is_pid1() {
        init::grow_root_fs();
    }
    let mut server = server::Server::new(outbox);
    loop {
        // read_frames only returns by a panic that escaped the handlers.
        let _ = catch_unwind(AssertUnwindSafe(|| {
            channel::read_frames(&port, &mut server)
        }));
        error!("the reader failed; restarting it");
        thread::sleep(Duration::from_secs(1));
    }
}
