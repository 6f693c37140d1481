use super::requests::OUTPUT_BACKLOG_BYTES;
use super::*;
use sandpit_protocol::{ExecResult, WatchEvent, WatchEventKind};
use tokio::io::AsyncWriteExt;

fn exec_request(max_output_bytes: u64) -> ExecRequest {
    ExecRequest {
        command: "yes".into(),
        cwd: None,
        env: Default::default(),
        timeout_ms: 10_000,
        max_output_bytes,
        ..Default::default()
    }
}

#[tokio::test]
async fn a_guest_sending_past_the_output_limit_is_cut_on_the_host() {
    let (client, _dir) = fake::agent(|mut s, mut d| async move {
        let Message::Exec { id, .. } = fake::next(&mut s, &mut d).await.message else {
            panic!("no exec");
        };
        // 8 MiB of stdout and of stderr for a 1 MiB limit.
        for _ in 0..128 {
            for m in [Message::Stdout { id }, Message::Stderr { id }] {
                s.write_all(&encode_frame(&m, &[b'y'; 64 * 1024]))
                    .await
                    .unwrap();
            }
        }
        let result = ExecResult {
            exit_code: Some(0),
            signal: None,
            timed_out: false,
            cancelled: false,
            stdout_bytes: 8 << 20,
            stderr_bytes: 8 << 20,
            stdout_truncated: false,
            stderr_truncated: false,
            duration_ms: 1,
            duration_us: None,
        };
        s.write_all(&encode_frame(&Message::Exited { id, result }, b""))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_secs(30)).await;
    })
    .await;
    let out = client.exec_collect(exec_request(1 << 20)).await.unwrap();
    assert_eq!(out.stdout.len(), 1 << 20);
    assert_eq!(out.stderr.len(), 1 << 20);
    assert!(out.result.stdout_truncated && out.result.stderr_truncated);
}

#[tokio::test]
async fn a_follower_that_falls_behind_loses_output_past_the_backlog_and_is_told() {
    // A command that keeps running streams all it writes; nothing of it is
    // taken here until the guest is done, so the host holds the backlog's
    // worth and drops the rest.
    const SENT: u64 = OUTPUT_BACKLOG_BYTES + (8 << 20);
    let (client, _dir) = fake::agent(|mut s, mut d| async move {
        let Message::Exec { id, .. } = fake::next(&mut s, &mut d).await.message else {
            panic!("no exec");
        };
        for _ in 0..SENT / (64 * 1024) {
            s.write_all(&encode_frame(&Message::Stdout { id }, &[b'y'; 64 * 1024]))
                .await
                .unwrap();
        }
        let result = ExecResult {
            exit_code: Some(0),
            signal: None,
            timed_out: false,
            cancelled: false,
            stdout_bytes: SENT,
            stderr_bytes: 0,
            stdout_truncated: false,
            stderr_truncated: false,
            duration_ms: 1,
            duration_us: None,
        };
        s.write_all(&encode_frame(&Message::Exited { id, result }, b""))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_secs(30)).await;
    })
    .await;
    let mut handle = client.exec(exec_request(u64::MAX)).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !handle.backlog.dropped().0 {
        assert!(std::time::Instant::now() < deadline, "nothing was dropped");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut taken = 0u64;
    let result = loop {
        match handle.next().await.unwrap() {
            GuestExecEvent::Stdout(b) => taken += b.len() as u64,
            GuestExecEvent::Exited(r) => break r,
            other => panic!("{other:?}"),
        }
    };
    // What was queued when the follower started taking, and what came
    // after it made room; never all of it.
    assert!((OUTPUT_BACKLOG_BYTES..SENT).contains(&taken), "{taken}");
    assert!(result.stdout_truncated && !result.stderr_truncated);
    assert!(client
        .inner
        .backlogs
        .lock()
        .unwrap()
        .get(&handle.id)
        .is_some());
    drop(handle);
    assert!(client.inner.backlogs.lock().unwrap().is_empty());
}

#[tokio::test]
async fn a_watch_read_too_slowly_ends_saying_events_were_lost() {
    let (client, _dir) = fake::agent_with(&["watch"], |mut s, mut d| async move {
        let Message::WatchDir { id, .. } = fake::next(&mut s, &mut d).await.message else {
            panic!("no watch");
        };
        let watching = Message::Watching {
            id,
            path: "/home/user/w".into(),
        };
        s.write_all(&encode_frame(&watching, b"")).await.unwrap();
        // A guest that names far more than the host holds for a reader.
        let event = WatchEvent {
            name: "n".repeat(60_000),
            kind: WatchEventKind::Create,
        };
        for _ in 0..OUTPUT_BACKLOG_BYTES / 60_000 + 100 {
            let m = Message::WatchEvents {
                id,
                events: vec![event.clone()],
            };
            s.write_all(&encode_frame(&m, b"")).await.unwrap();
        }
        // Then the host stops the watch.
        loop {
            if let Message::Cancel { id: c } = fake::next(&mut s, &mut d).await.message {
                assert_eq!(c, id);
                break;
            }
        }
        tokio::time::sleep(Duration::from_secs(30)).await;
    })
    .await;
    let mut watch = client.watch_dir("w", true).await.unwrap();
    assert_eq!(watch.path(), "/home/user/w");
    // Nothing is read until the host has had to drop events.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !watch.backlog.dropped().0 {
        assert!(std::time::Instant::now() < deadline, "nothing was lost");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let lost = match watch.next().await {
        Err(RuntimeError::Agent(e)) => e,
        other => panic!("{other:?}"),
    };
    assert_eq!(lost.kind, ErrorKind::TooLarge, "{lost:?}");
    assert!(matches!(watch.next().await, Ok(None)));
    drop(watch);
    assert!(client.inner.backlogs.lock().unwrap().is_empty());
    assert!(client.inner.pending.lock().unwrap().is_empty());
}

#[tokio::test]
async fn a_watch_the_guest_refuses_is_the_guests_error() {
    let (client, _dir) = fake::agent_with(&["watch"], |mut s, mut d| async move {
        let Message::WatchDir { id, .. } = fake::next(&mut s, &mut d).await.message else {
            panic!("no watch");
        };
        let error = AgentError::new(ErrorKind::PermissionDenied, "/root: Permission denied");
        s.write_all(&encode_frame(&Message::Error { id, error }, b""))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_secs(30)).await;
    })
    .await;
    match client.watch_dir("/root", false).await {
        Err(RuntimeError::Agent(e)) => assert_eq!(e.kind, ErrorKind::PermissionDenied),
        Err(e) => panic!("{e:?}"),
        Ok(_) => panic!("watched"),
    }
    assert!(client.inner.pending.lock().unwrap().is_empty());
    assert!(client.inner.backlogs.lock().unwrap().is_empty());
    // An agent that predates watches is not asked.
    let (old, _dir) = fake::agent(|s, d| async move {
        let _kept = (s, d);
        tokio::time::sleep(Duration::from_secs(60)).await;
    })
    .await;
    match old.watch_dir("w", false).await {
        Err(RuntimeError::Agent(e)) => assert_eq!(e.kind, ErrorKind::Unsupported),
        Err(e) => panic!("{e:?}"),
        Ok(_) => panic!("watched"),
    }
}

#[tokio::test]
async fn an_older_agent_is_not_asked_what_it_does_not_list() {
    // It would answer an unknown message with an error no request can
    // claim, and the call would wait out its deadline: refused at once.
    let (client, _dir) = fake::agent(|s, d| async move {
        let _kept = (s, d);
        tokio::time::sleep(Duration::from_secs(60)).await;
    })
    .await;
    let started = std::time::Instant::now();
    match client.stats().await {
        Err(RuntimeError::Agent(e)) => {
            assert_eq!(e.kind, ErrorKind::Unsupported);
            assert!(e.message.contains("predates"), "{}", e.message);
        }
        other => panic!("{other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(5));
    // Nor given a build step as root, which it would run as the user.
    let mut step = exec_request(1024);
    step.as_root = true;
    match client.exec(step) {
        Err(RuntimeError::Agent(e)) => assert_eq!(e.kind, ErrorKind::Unsupported),
        Err(e) => panic!("{e:?}"),
        Ok(_) => panic!("an older agent was asked to run a command as root"),
    }
}

#[tokio::test]
async fn a_guest_that_reads_nothing_gets_a_bounded_queue_and_still_its_cancels() {
    let (client, _dir) = fake::agent(|s, d| async move {
        // Keeps the connection and reads nothing, ever.
        let _kept = (s, d);
        tokio::time::sleep(Duration::from_secs(60)).await;
    })
    .await;
    let chunk = vec![0u8; 40 << 20];
    let writes: Vec<_> = (0..2)
        .map(|_| {
            let (c, data) = (client.clone(), chunk.clone());
            tokio::spawn(async move { c.write_file("big", &data, None).await })
        })
        .collect();
    // The writes wait for the guest with a few MiB queued, not 80.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let queued = client.inner.queued.load(Ordering::SeqCst);
    assert!(
        queued >= STREAM_HIGH_WATER && queued < STREAM_HIGH_WATER + 2 * CHUNK_LEN as u64 + 1024,
        "{queued} bytes queued"
    );
    assert!(writes.iter().all(|w| !w.is_finished()));
    // Whatever else is sent past the limit is refused whole, at once.
    for _ in 0..3 {
        let _ = client.inner.send_all(vec![vec![0u8; 40 << 20]]);
    }
    let e = client
        .inner
        .send_all(vec![vec![0u8; 40 << 20]])
        .unwrap_err();
    assert!(matches!(e, RuntimeError::Busy(_)), "{e}");
    assert!(e.to_string().contains("not reading"), "{e}");
    assert!(client.inner.queued.load(Ordering::SeqCst) <= OUT_QUEUE_LIMIT);
    // Small frames still go: a command can still be cancelled.
    let h = client.exec(exec_request(1024)).unwrap();
    h.cancel();
    drop(h);
    for w in writes {
        w.abort();
    }
}

/// A port can hold the tail of a frame an earlier connection did not
/// read, with something that looks like a frame start in it (file or
/// command output can hold anything). When the ack follows a bad frame
/// in the same read, the handshake still finds it: the agent sends it
/// only once.
#[tokio::test]
async fn handshake_finds_the_ack_behind_a_bad_frame() {
    let mut bad = b"output of an old command ".to_vec();
    bad.extend_from_slice(&sandpit_protocol::FRAME_MAGIC);
    bad.extend_from_slice(&u32::MAX.to_be_bytes());
    bad.extend_from_slice(&0u32.to_be_bytes());
    handshake_after(bad).await;
}

/// An earlier connection's frame cut short (a well-formed header whose body
/// never came) promises more bytes than follow: the ack after it is found,
/// not taken for part of that body.
#[tokio::test]
async fn handshake_finds_the_ack_behind_a_frame_cut_short() {
    let mut cut = encode_frame(&Message::Stdout { id: 9 }, &[b'x'; 4000]);
    cut.truncate(300);
    handshake_after(cut).await;
}

/// A fake agent that answers the `Hello` with `leftover`, then the ack.
async fn handshake_after(leftover: Vec<u8>) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("agent.sock");
    let listener = tokio::net::UnixListener::bind(&path).unwrap();
    tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let mut d = sandpit_protocol::FrameDecoder::new();
        let mut buf = vec![0u8; 1 << 16];
        let nonce = loop {
            let n = tokio::io::AsyncReadExt::read(&mut s, &mut buf)
                .await
                .unwrap();
            d.push(&buf[..n]);
            if let Some(f) = d.next_frame().unwrap() {
                match f.message {
                    Message::Hello { nonce, .. } => break nonce,
                    other => panic!("{other:?}"),
                }
            }
        };
        let mut bytes = leftover;
        bytes.extend_from_slice(&encode_frame(
            &Message::HelloAck {
                protocol: PROTOCOL_GENERATION,
                nonce,
                agent_version: "test".into(),
                kernel_release: "test".into(),
                hostname: "test".into(),
                features: Vec::new(),
            },
            b"",
        ));
        s.write_all(&bytes).await.unwrap();
        // Then nothing more, as a real agent.
        while tokio::io::AsyncReadExt::read(&mut s, &mut buf)
            .await
            .unwrap_or(0)
            > 0
        {}
    });
    let client = AgentClient::connect(&path, Duration::from_secs(3))
        .await
        .expect("the ack behind the leftovers is found");
    assert_eq!(client.info().agent_version, "test");
}

/// A directory whose path is `len` bytes long, under `root`.
fn long_dir(root: &Path, len: usize) -> PathBuf {
    let mut dir = root.to_path_buf();
    while dir.as_os_str().len() < len {
        let left = len - dir.as_os_str().len() - 1;
        dir.push("d".repeat(left.min(100)));
    }
    std::fs::create_dir_all(&dir).unwrap();
    assert_eq!(dir.as_os_str().len(), len);
    dir
}

#[tokio::test]
async fn a_socket_in_a_directory_of_any_length_is_reached() {
    let root = tempfile::tempdir().unwrap();
    // A socket's address holds 107 bytes; these paths are far longer.
    for len in [200, 1000] {
        let dir = long_dir(root.path(), len);
        let path = dir.join("qmp.sock");
        // QEMU binds it relative to its working directory; here, by the
        // same short name the host connects with.
        let (_held, short) = short_socket_name(&path).unwrap();
        assert!(short.as_os_str().len() < 40, "{}", short.display());
        let listener = tokio::net::UnixListener::bind(&short).unwrap();
        assert!(path.exists(), "bound where its whole path says");
        let accepted = tokio::spawn(async move { listener.accept().await.map(drop) });
        let mut s = connect_qemu_socket(&path).await.unwrap();
        s.write_all(b"x").await.unwrap();
        accepted.await.unwrap().unwrap();
        crate::vm::probe_socket(&dir).unwrap();
    }
    // A socket that is not there is told as such, as a connect says it.
    let missing = root.path().join("nowhere").join("agent.sock");
    let e = connect_qemu_socket(&missing).await.unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::NotFound, "{e}");
}
