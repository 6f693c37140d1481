//! End-to-end test of the agent binary outside a VM ("development mode": not
//! PID 1, so no mounts, cgroups or network changes), speaking the real
//! protocol over a socketpair handed over as `SANDPIT_AGENT_FD`.
//!
//! Commands really run as uid 1000, so this needs root; it is skipped
//! otherwise. What needs a VM (cgroups, virtio port, Configure applied) is
//! tested when images are booted.

use sandpit_protocol::{
    encode_frame, DoneResult, ErrorKind, ExecRequest, ExecResult, FileKind, Frame, FrameDecoder,
    Message, PROTOCOL_GENERATION,
};
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::mpsc::{self, Receiver};
use std::thread;
use std::time::{Duration, Instant};

struct Agent {
    child: Child,
    sock: UnixStream,
    frames: Receiver<(Instant, Frame)>,
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Agent {
    fn start() -> Agent {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let fd = theirs.as_raw_fd();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_sandpit-agent"));
        cmd.env("SANDPIT_AGENT_FD", "3");
        // SAFETY: dup2 is async-signal-safe; it clears CLOEXEC on fd 3.
        unsafe {
            cmd.pre_exec(move || {
                if libc::dup2(fd, 3) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().unwrap();
        drop(theirs);
        let mut reader = ours.try_clone().unwrap();
        let (tx, frames) = mpsc::channel();
        thread::spawn(move || {
            let mut d = FrameDecoder::new();
            let mut buf = [0u8; 65536];
            loop {
                match reader.read(&mut buf) {
                    Ok(0) | Err(_) => return,
                    Ok(n) => d.push(&buf[..n]),
                }
                while let Ok(Some(f)) = d.next_frame() {
                    if tx.send((Instant::now(), f)).is_err() {
                        return;
                    }
                }
            }
        });
        Agent {
            child,
            sock: ours,
            frames,
        }
    }

    fn send(&mut self, m: Message, body: &[u8]) {
        self.sock.write_all(&encode_frame(&m, body)).unwrap();
    }

    fn next(&self) -> (Instant, Frame) {
        self.frames
            .recv_timeout(Duration::from_secs(20))
            .expect("no answer from the agent")
    }

    /// Frames for `id` up to and including its final message.
    fn collect(&self, id: u64) -> Vec<(Instant, Frame)> {
        let mut out = Vec::new();
        loop {
            let (t, f) = self.next();
            if f.message.request_id() != Some(id) {
                panic!("unexpected frame while waiting for {id}: {:?}", f.message);
            }
            let last = matches!(
                f.message,
                Message::Done { .. } | Message::Exited { .. } | Message::Error { .. }
            );
            out.push((t, f));
            if last {
                return out;
            }
        }
    }
}

struct ExecOutcome {
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    result: ExecResult,
    frames: Vec<(Instant, Frame)>,
}

fn exec(
    agent: &mut Agent,
    id: u64,
    command: &str,
    cwd: &str,
    timeout_ms: u64,
    max: u64,
) -> ExecOutcome {
    agent.send(
        Message::Exec {
            id,
            request: ExecRequest {
                command: command.into(),
                cwd: Some(cwd.into()),
                env: BTreeMap::from([("GREETING".into(), "hi".into())]),
                timeout_ms,
                max_output_bytes: max,
                ..Default::default()
            },
        },
        b"",
    );
    finish_exec(agent, id)
}

/// The pid a command wrote to `path` (`echo $$ > path`), once it has.
fn written_pid(path: &std::path::Path) -> i32 {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        if let Some(pid) = text.strip_suffix('\n').and_then(|p| p.parse().ok()) {
            return pid;
        }
        assert!(Instant::now() < deadline, "nothing wrote a pid to {path:?}");
        thread::sleep(Duration::from_millis(20));
    }
}

fn finish_exec(agent: &Agent, id: u64) -> ExecOutcome {
    let frames = agent.collect(id);
    // No frame announces the start: the first is output or the exit.
    assert!(
        !frames
            .iter()
            .any(|(_, f)| matches!(f.message, Message::Started { .. })),
        "{frames:?}"
    );
    let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
    let mut result = None;
    for (_, f) in &frames {
        match &f.message {
            Message::Stdout { .. } => stdout.extend(&f.body),
            Message::Stderr { .. } => stderr.extend(&f.body),
            Message::Exited { result: r, .. } => result = Some(r.clone()),
            _ => {}
        }
    }
    ExecOutcome {
        stdout,
        stderr,
        result: result.expect("Exited"),
        frames,
    }
}

fn scratch() -> PathBuf {
    let d = std::env::temp_dir().join(format!("sandpit-agent-e2e-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o777)).unwrap();
    d
}

#[test]
fn serves_the_protocol_end_to_end() {
    // SAFETY: plain syscall.
    assert_eq!(
        unsafe { libc::geteuid() },
        0,
        "this test needs root (it runs commands as uid 1000): run scripts/test.sh as root"
    );
    let dir = scratch();
    let ws = dir.to_string_lossy().into_owned();
    let mut a = Agent::start();

    // Session start.
    a.send(
        Message::Hello {
            protocol: PROTOCOL_GENERATION,
            nonce: 77,
        },
        b"",
    );
    let (_, f) = a.next();
    let Message::HelloAck {
        protocol,
        nonce,
        agent_version,
        kernel_release,
        features,
        ..
    } = f.message
    else {
        panic!("{:?}", f.message)
    };
    assert_eq!((protocol, nonce), (PROTOCOL_GENERATION, 77));
    assert!(!agent_version.is_empty() && !kernel_release.is_empty());
    assert_eq!(features, sandpit_protocol::FEATURES);

    a.send(Message::Ping { id: 1 }, b"");
    assert_eq!(
        a.collect(1)[0].1.message,
        Message::Done {
            id: 1,
            result: DoneResult::Pong
        }
    );

    // Garbage and unknown messages are answered, and serving goes on.
    a.sock
        .write_all(&{
            let h = br#"{"type":"teleport","id":5}"#;
            let mut b = b"SPF1".to_vec();
            b.extend_from_slice(&(h.len() as u32).to_be_bytes());
            b.extend_from_slice(&0u32.to_be_bytes());
            b.extend_from_slice(h);
            b
        })
        .unwrap();
    let (_, f) = a.next();
    assert!(
        matches!(f.message, Message::Error { id: 0, ref error } if error.kind == ErrorKind::Unsupported)
    );

    // A command: user, environment, exit code, separate streams.
    let o = exec(
        &mut a,
        2,
        "id -u; id -G; echo $GREETING $HOME $PWD; echo oops >&2; exit 3",
        &ws,
        10_000,
        1 << 20,
    );
    assert_eq!(
        String::from_utf8_lossy(&o.stdout),
        format!("1000\n1000\nhi /home/user {ws}\n")
    );
    assert_eq!(o.stderr, b"oops\n");
    assert_eq!(o.result.exit_code, Some(3));
    assert_eq!(o.result.stdout_bytes, o.stdout.len() as u64);
    assert!(!o.result.timed_out && !o.result.cancelled);

    // Output streams as it is produced.
    let o = exec(
        &mut a,
        3,
        "echo first; sleep 1; echo second",
        &ws,
        10_000,
        1 << 20,
    );
    let first = o
        .frames
        .iter()
        .find(|(_, f)| matches!(f.message, Message::Stdout { .. }))
        .unwrap()
        .0;
    let exited = o.frames.last().unwrap().0;
    assert!(
        exited - first >= Duration::from_millis(700),
        "output was buffered"
    );

    // Truncation counts everything and forwards only the limit.
    let o = exec(
        &mut a,
        4,
        "head -c 30000000 /dev/zero; echo tail >&2",
        &ws,
        60_000,
        1000,
    );
    assert_eq!(o.stdout.len(), 1000);
    assert_eq!(o.result.stdout_bytes, 30_000_000);
    assert!(o.result.stdout_truncated && !o.result.stderr_truncated);
    assert_eq!(o.stderr, b"tail\n");

    // A background child holding the pipes does not hold the command.
    let t = Instant::now();
    let o = exec(
        &mut a,
        5,
        "sleep 30 & echo $! > bg.pid; echo started",
        &ws,
        60_000,
        1 << 20,
    );
    assert_eq!(o.stdout, b"started\n");
    assert_eq!(o.result.exit_code, Some(0));
    assert!(t.elapsed() < Duration::from_secs(10));

    // Timeout kills the process group.
    let o = exec(
        &mut a,
        6,
        "echo before; sleep 30; echo after",
        &ws,
        500,
        1 << 20,
    );
    assert!(o.result.timed_out);
    assert_eq!(o.result.signal, Some(9));
    assert_eq!(o.stdout, b"before\n");

    // Cancel.
    a.send(
        Message::Exec {
            id: 7,
            request: ExecRequest {
                command: "sleep 30".into(),
                cwd: Some(ws.clone()),
                env: BTreeMap::new(),
                timeout_ms: 60_000,
                max_output_bytes: 100,
                ..Default::default()
            },
        },
        b"",
    );
    thread::sleep(Duration::from_millis(200));
    a.send(Message::Cancel { id: 7 }, b"");
    let o = finish_exec(&a, 7);
    assert!(o.result.cancelled && !o.result.timed_out);
    a.send(Message::Cancel { id: 7 }, b"");
    assert!(
        matches!(&a.collect(7)[0].1.message, Message::Error { error, .. } if error.kind == ErrorKind::NotFound)
    );

    // A missing cwd.
    a.send(
        Message::Exec {
            id: 8,
            request: ExecRequest {
                command: "true".into(),
                cwd: Some(format!("{ws}/missing")),
                env: BTreeMap::new(),
                timeout_ms: 1000,
                max_output_bytes: 100,
                ..Default::default()
            },
        },
        b"",
    );
    assert!(
        matches!(&a.collect(8)[0].1.message, Message::Error { error, .. } if error.kind == ErrorKind::NotFound && error.message.contains("does not exist"))
    );

    // Files, written as the user, binary-exact, in several FileData frames.
    let body: Vec<u8> = (0..300_000u32).map(|i| (i % 253) as u8).collect();
    let path = format!("{ws}/sub/dir/blob.bin");
    a.send(
        Message::WriteFile {
            id: 9,
            path: path.clone(),
            size: body.len() as u64,
            mode: Some(0o600),
        },
        b"",
    );
    for chunk in body.chunks(100_000) {
        a.send(Message::FileData { id: 9 }, chunk);
    }
    assert_eq!(
        a.collect(9)[0].1.message,
        Message::Done {
            id: 9,
            result: DoneResult::Written {
                path: path.clone(),
                bytes: body.len() as u64
            }
        }
    );
    let meta = std::fs::metadata(&path).unwrap();
    use std::os::unix::fs::MetadataExt;
    assert_eq!(
        (meta.uid(), meta.gid(), meta.mode() & 0o777),
        (1000, 1000, 0o600)
    );
    assert_eq!(std::fs::metadata(format!("{ws}/sub")).unwrap().uid(), 1000);

    a.send(
        Message::ReadFile {
            id: 10,
            path: path.clone(),
            max_bytes: 1 << 20,
            window: None,
        },
        b"",
    );
    let frames = a.collect(10);
    let data: Vec<u8> = frames
        .iter()
        .filter(|(_, f)| matches!(f.message, Message::FileData { .. }))
        .flat_map(|(_, f)| f.body.clone())
        .collect();
    assert_eq!(data, body);

    // Permissions are the user's: root's files are off limits.
    std::fs::write(dir.join("secret"), "x").unwrap();
    std::fs::set_permissions(dir.join("secret"), std::fs::Permissions::from_mode(0o600)).unwrap();
    a.send(
        Message::ReadFile {
            id: 11,
            path: format!("{ws}/secret"),
            max_bytes: 10,
            window: None,
        },
        b"",
    );
    assert!(
        matches!(&a.collect(11)[0].1.message, Message::Error { error, .. } if error.kind == ErrorKind::PermissionDenied)
    );

    // Nor are the agent's own /proc files, which the kernel would let any
    // thread of the agent read: only the user's own process is refused
    // alike (read, listed, or through /proc/self, which is the reader's).
    let agent = a.child.id();
    for (id, path, list) in [
        (30, format!("/proc/{agent}/maps"), false),
        (31, format!("/proc/{agent}/environ"), false),
        (32, format!("/proc/{agent}/fd"), true),
    ] {
        let m = if list {
            Message::ListFiles {
                id,
                path: path.clone(),
                recursive: false,
                max_entries: 10,
            }
        } else {
            Message::ReadFile {
                id,
                path: path.clone(),
                max_bytes: 1 << 20,
                window: None,
            }
        };
        a.send(m, b"");
        let answer = a.collect(id).remove(0).1.message;
        assert!(
            matches!(&answer, Message::Error { error, .. } if error.kind == ErrorKind::PermissionDenied),
            "{path}: {answer:?}"
        );
    }
    a.send(
        Message::ReadFile {
            id: 33,
            path: "/proc/self/status".into(),
            max_bytes: 1 << 20,
            window: None,
        },
        b"",
    );
    let status: Vec<u8> = a
        .collect(33)
        .iter()
        .filter(|(_, f)| matches!(f.message, Message::FileData { .. }))
        .flat_map(|(_, f)| f.body.clone())
        .collect();
    let status = String::from_utf8_lossy(&status);
    assert!(status.contains("Name:\tsandpit-files\n"), "{status}");
    assert!(
        status.contains("\nUid:\t60001\t1000\t60001\t1000\n"),
        "{status}"
    );
    assert!(status.contains("\nCapEff:\t0000000000000000\n"), "{status}");

    a.send(
        Message::ListFiles {
            id: 12,
            path: ws.clone(),
            recursive: true,
            max_entries: 100,
        },
        b"",
    );
    let Message::Done {
        result: DoneResult::Listing {
            entries, truncated, ..
        },
        ..
    } = a.collect(12).remove(0).1.message
    else {
        panic!()
    };
    let names: Vec<_> = entries.iter().map(|e| (e.name.as_str(), e.kind)).collect();
    assert_eq!(
        names,
        vec![
            ("bg.pid", FileKind::File),
            ("secret", FileKind::File),
            ("sub", FileKind::Dir),
            ("sub/dir", FileKind::Dir),
            ("sub/dir/blob.bin", FileKind::File),
        ]
    );
    assert!(!truncated);

    a.send(
        Message::DeleteFile {
            id: 13,
            path: format!("{ws}/sub"),
            recursive: false,
        },
        b"",
    );
    assert!(
        matches!(&a.collect(13)[0].1.message, Message::Error { error, .. } if error.kind == ErrorKind::InvalidRequest)
    );
    a.send(
        Message::DeleteFile {
            id: 14,
            path: format!("{ws}/sub"),
            recursive: true,
        },
        b"",
    );
    assert!(matches!(
        &a.collect(14)[0].1.message,
        Message::Done {
            result: DoneResult::Deleted { .. },
            ..
        }
    ));
    assert!(!dir.join("sub").exists());

    // A new Hello starts a new session and kills the old session's commands.
    a.send(
        Message::Exec {
            id: 15,
            request: ExecRequest {
                command: format!("echo $$ > {ws}/pid; exec sleep 30"),
                cwd: None,
                env: BTreeMap::new(),
                timeout_ms: 60_000,
                max_output_bytes: 100,
                ..Default::default()
            },
        },
        b"",
    );
    // cwd None is /workspace, which does not exist outside a VM.
    assert!(
        matches!(&a.collect(15)[0].1.message, Message::Error { error, .. } if error.kind == ErrorKind::NotFound)
    );
    a.send(
        Message::Exec {
            id: 16,
            request: ExecRequest {
                command: format!("echo $$ > {ws}/pid; exec sleep 30"),
                cwd: Some(ws.clone()),
                env: BTreeMap::new(),
                timeout_ms: 60_000,
                max_output_bytes: 100,
                ..Default::default()
            },
        },
        b"",
    );
    let pid = written_pid(&dir.join("pid"));
    a.send(
        Message::Hello {
            protocol: PROTOCOL_GENERATION,
            nonce: 78,
        },
        b"",
    );
    assert!(
        matches!(a.next().1.message, Message::HelloAck { nonce: 78, .. }),
        "old frames leaked"
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    // SAFETY: signal 0 only checks for existence.
    while unsafe { libc::kill(pid, 0) } == 0 && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(50));
    }
    // The agent reaps it (it is the agent's child), so it is gone entirely.
    assert_ne!(
        unsafe { libc::kill(pid, 0) },
        0,
        "old session's command survived"
    );
    a.send(Message::Ping { id: 17 }, b"");
    assert_eq!(
        a.collect(17)[0].1.message,
        Message::Done {
            id: 17,
            result: DoneResult::Pong
        }
    );

    // The background `sleep 30` of id 5 was reparented to the agent (a
    // subreaper here, PID 1 in a VM); kill it and make sure no zombie stays.
    let bg: i32 = std::fs::read_to_string(dir.join("bg.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    // SAFETY: plain syscall on the pid of the background process we started.
    unsafe { libc::kill(bg, libc::SIGKILL) };
    thread::sleep(Duration::from_millis(500));
    let zombies = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read_to_string(e.path().join("stat")).ok())
        .filter(|s| {
            let after = s.rsplit_once(") ").map(|x| x.1).unwrap_or("");
            let mut f = after.split_whitespace();
            let state = f.next();
            let ppid: u32 = f.next().and_then(|p| p.parse().ok()).unwrap_or(0);
            state == Some("Z") && ppid == a.child.id()
        })
        .count();
    assert_eq!(zombies, 0);

    // The host going away (EOF) cancels the session's commands; the agent
    // stays up and idles without spinning.
    a.send(
        Message::Exec {
            id: 18,
            request: ExecRequest {
                command: format!("echo $$ > {ws}/pid2; exec sleep 30"),
                cwd: Some(ws.clone()),
                env: BTreeMap::new(),
                timeout_ms: 60_000,
                max_output_bytes: 100,
                ..Default::default()
            },
        },
        b"",
    );
    let pid = written_pid(&dir.join("pid2"));
    a.sock.shutdown(std::net::Shutdown::Write).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    // SAFETY: signal 0 only checks for existence.
    while unsafe { libc::kill(pid, 0) } == 0 && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(50));
    }
    assert_ne!(
        unsafe { libc::kill(pid, 0) },
        0,
        "command survived the disconnect"
    );
    let cpu = || {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", a.child.id())).unwrap();
        let f: Vec<u64> = stat
            .rsplit_once(") ")
            .unwrap()
            .1
            .split_whitespace()
            .skip(11)
            .take(2)
            .map(|x| x.parse().unwrap())
            .collect();
        f[0] + f[1]
    };
    let before = cpu();
    thread::sleep(Duration::from_secs(2));
    assert!(cpu() - before <= 2, "the agent spins while disconnected");
    // Parked command threads (named "worker", at most 8 kept) wait for the
    // next command; anything else beyond the agent's own five is a leak.
    let names: Vec<String> = std::fs::read_dir(format!("/proc/{}/task", a.child.id()))
        .unwrap()
        .map(|t| std::fs::read_to_string(t.unwrap().path().join("comm")).unwrap())
        .collect();
    let workers = names.iter().filter(|n| n.trim() == "worker").count();
    assert!(
        names.len() - workers <= 5 && workers <= 8,
        "threads left running: {names:?}"
    );
    assert!(a.child.try_wait().unwrap().is_none(), "the agent exited");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn tunnels_reach_loopback_servers_within_their_window() {
    let mut a = Agent::start();
    a.send(
        Message::Hello {
            protocol: PROTOCOL_GENERATION,
            nonce: 5,
        },
        b"",
    );
    assert!(matches!(a.next().1.message, Message::HelloAck { .. }));

    // An echo server: reads until the client half-closes, answers it all.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut got = Vec::new();
        s.read_to_end(&mut got).unwrap();
        s.write_all(&got).unwrap();
    });

    const WINDOW: u32 = 4096;
    a.send(
        Message::TunnelOpen {
            id: 2,
            port,
            window: WINDOW,
        },
        b"",
    );
    let (_, f) = a.next();
    let Message::TunnelOpened { id: 2, window } = f.message else {
        panic!("{:?}", f.message)
    };
    let payload: Vec<u8> = (0..100_000u32).map(|i| (i % 253) as u8).collect();
    for c in payload.chunks(16 * 1024) {
        assert!(c.len() as u32 <= window);
        a.send(Message::TunnelData { id: 2 }, c);
    }
    a.send(Message::TunnelShutdown { id: 2 }, b"");

    let (mut echoed, mut in_flight, mut acked) = (Vec::new(), 0u32, 0usize);
    loop {
        let (_, f) = a.next();
        match f.message {
            Message::TunnelAck { id: 2, bytes } => acked += bytes as usize,
            Message::TunnelData { id: 2 } => {
                in_flight += f.body.len() as u32;
                assert!(in_flight <= WINDOW, "{in_flight} bytes past the window");
                echoed.extend_from_slice(&f.body);
                // Acknowledge what we "consumed".
                a.send(
                    Message::TunnelAck {
                        id: 2,
                        bytes: in_flight,
                    },
                    b"",
                );
                in_flight = 0;
            }
            Message::TunnelShutdown { id: 2 } => break,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(acked, payload.len(), "every byte sent was acknowledged");
    assert_eq!(echoed, payload);
    a.send(Message::TunnelClose { id: 2 }, b"");
    server.join().unwrap();

    // Nothing listens: a typed refusal, not a hang.
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let closed = l.local_addr().unwrap().port();
    drop(l);
    a.send(
        Message::TunnelOpen {
            id: 3,
            port: closed,
            window: WINDOW,
        },
        b"",
    );
    let (_, f) = a.next();
    let Message::Error { id: 3, error } = f.message else {
        panic!("{:?}", f.message)
    };
    assert_eq!(error.kind, ErrorKind::ConnectionRefused);
}
