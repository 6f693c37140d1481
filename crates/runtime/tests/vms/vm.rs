//! Real-VM tests of the guest: kernel, user, exec semantics, output limits,
//! timeouts, background processes, files. One VM is booted for this file and
//! shared; each test leaves it healthy for the next.

use sandpit_protocol::ErrorKind;
use sandpit_runtime::{GuestExecEvent, RuntimeError};
use sandpit_vmtest::*;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

static VM: OnceLock<Shared> = OnceLock::new();

fn vm() -> &'static Shared {
    VM.get_or_init(|| shared("sbx_vmtests", || config(&data_dir())))
}

fn block<F: std::future::Future>(f: F) -> F::Output {
    vm().rt.block_on(f)
}

#[test]
fn boots_the_guest_kernel_and_debian() {
    let s = vm();
    block(async {
        let release = sh(&s.vm, "uname -r").await;
        assert_eq!(release, s.manager.image().kernel_release);
        assert_eq!(s.vm.agent.info().kernel_release, release);
        let debian = sh(&s.vm, "cat /etc/debian_version").await;
        assert!(debian.starts_with("12"), "not Debian 12: {debian}");
        for tool in [
            "bash", "python3", "node", "npm", "git", "curl", "jq", "gcc", "make", "unzip", "less",
            "pip3",
        ] {
            sh(&s.vm, &format!("command -v {tool}")).await;
        }
        sh(&s.vm, "python3 -m venv --help >/dev/null").await;
    });
}

/// A boot past its bound says what the host saw of the guest, not only
/// its console (empty: the kernel boots quietly): CI once had a cold boot
/// that never came up and left no clue.
#[test]
fn a_boot_past_its_bound_says_where_the_guest_was() {
    let s = vm();
    let mut hurried = s.manager.config().clone();
    hurried.boot_timeout = Duration::from_secs(1);
    let m = manager_with(hurried);
    block(async {
        match m.create_cold(new_vm("sbx_hurried")).await {
            Err(RuntimeError::BootTimeout { secs, console_tail }) => {
                assert_eq!(secs, 1);
                assert!(console_tail.contains(" s of CPU"), "{console_tail}");
                // Where each vCPU was (early in a boot, below the kernel's
                // own high addresses), twice.
                let at = console_tail
                    .split_once("vCPUs at ")
                    .map(|(_, rest)| rest.split(';').next().unwrap_or_default())
                    .unwrap_or_default();
                let words: Vec<&str> = at
                    .split([' ', ','])
                    .filter(|w| !w.is_empty() && *w != "then")
                    .collect();
                assert!(
                    words.len() >= 2
                        && words
                            .iter()
                            .all(|w| w.len() == 16 && u64::from_str_radix(w, 16).is_ok()),
                    "{console_tail}"
                );
            }
            other => panic!("a boot with a 1 s bound: {:?}", other.map(|vm| vm.record)),
        }
        assert!(!m.paths("sbx_hurried").dir.exists());
    });
}

#[test]
fn commands_run_as_the_unprivileged_user_without_sudo() {
    let s = vm();
    block(async {
        assert_eq!(sh(&s.vm, "id -u").await, "1000");
        assert_eq!(sh(&s.vm, "id -un").await, "user");
        assert_eq!(sh(&s.vm, "echo $HOME").await, "/home/user");
        assert_eq!(sh(&s.vm, "pwd").await, "/workspace");
        assert_eq!(sh(&s.vm, "stat -c %U /workspace").await, "user");
        let out = run(&s.vm, req("command -v sudo || ls /usr/bin/sudo")).await;
        assert_ne!(
            out.result.exit_code,
            Some(0),
            "sudo exists: {:?}",
            String::from_utf8_lossy(&out.stdout)
        );
        let out = run(&s.vm, req("cat /etc/shadow")).await;
        assert_ne!(
            out.result.exit_code,
            Some(0),
            "the user can read /etc/shadow"
        );
        // Nothing of the agent's own standing: the OOM killer may pick the
        // user's processes (the agent, the guest's init, it never picks),
        // and they run at the normal priority, not the agent's raised one.
        assert_eq!(sh(&s.vm, "cat /proc/self/oom_score_adj").await, "0");
        assert_eq!(sh(&s.vm, "ps -o ni= -p $$").await, "0");
        // debugfs, mounted at boot to set the fault-around size, is gone.
        assert_eq!(
            sh(&s.vm, "awk '$3 == \"debugfs\"' /proc/mounts | wc -l").await,
            "0"
        );
    });
}

/// A template's build step runs as root (the host alone asks: no API
/// does), with root's home and `PATH`; the next command is the user's again.
#[test]
fn a_build_step_runs_as_root_and_leaves_the_user_unprivileged() {
    let s = vm();
    block(async {
        let mut step =
            req("id -u; echo $HOME; command -v apt-get; touch /etc/built-by-root; echo $PWD");
        step.as_root = true;
        step.cwd = Some("/".into());
        let out = s.vm.agent.exec_collect(step).await.expect("a root step");
        assert_eq!(
            out.result.exit_code,
            Some(0),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "0\n/root\n/usr/bin/apt-get\n/\n"
        );
        assert_eq!(
            sh(&s.vm, "id -u; stat -c %U /etc/built-by-root").await,
            "1000\nroot"
        );
        let refused =
            s.vm.agent
                .exec_collect(req("rm /etc/built-by-root"))
                .await
                .unwrap();
        assert_ne!(
            refused.result.exit_code,
            Some(0),
            "the user removed root's file"
        );
        let mut step = req("rm /etc/built-by-root");
        step.as_root = true;
        step.cwd = Some("/".into());
        assert_eq!(
            s.vm.agent
                .exec_collect(step)
                .await
                .unwrap()
                .result
                .exit_code,
            Some(0)
        );
    });
}

#[test]
fn commands_run_in_bash_linked_statically_under_its_usual_name() {
    let s = vm();
    block(async {
        // What scripts see is /bin/bash, the same version as the image's.
        assert_eq!(sh(&s.vm, "echo \"$0 $BASH\"").await, "/bin/bash /bin/bash");
        assert_eq!(
            sh(&s.vm, "echo $BASH_VERSION").await,
            sh(&s.vm, "/bin/bash -c 'echo $BASH_VERSION'").await
        );
        // The binary is Debian's bash-static, which starts faster (`; true`
        // keeps bash from exec'ing the last command in its own place).
        assert_eq!(
            sh(&s.vm, "readlink /proc/$$/exe; true").await,
            "/usr/bin/bash-static"
        );
        // Until it execs, the shell's child shares the agent's memory; its
        // switch to the user marks that memory non-dumpable, which keeps
        // the user's processes from attaching to it, as long as the kernel
        // keeps set-uid processes undumpable.
        assert_eq!(sh(&s.vm, "cat /proc/sys/fs/suid_dumpable").await, "0");
        // A command gets signals in their default state (the agent blocks
        // and ignores some) and exactly the environment the agent gives.
        assert_eq!(
            sh(&s.vm, "exec grep -E '^Sig(Blk|Ign)' /proc/self/status").await,
            "SigBlk:\t0000000000000000\nSigIgn:\t0000000000000000"
        );
        assert_eq!(
            sh(
                &s.vm,
                "env -0 | tr '\\0' '\\n' | cut -d= -f1 | sort | tr '\\n' ' '"
            )
            .await,
            "HOME LANG LOGNAME PATH PWD SHELL SHLVL TERM USER _"
        );
    });
}

#[test]
fn exit_codes_stderr_env_and_cwd() {
    let s = vm();
    block(async {
        let out = run(&s.vm, req("echo out; echo err >&2; exit 7")).await;
        assert_eq!(out.result.exit_code, Some(7));
        assert_eq!(out.stdout, b"out\n");
        assert_eq!(out.stderr, b"err\n");
        assert!(!out.result.timed_out);

        let mut r = req("echo $FOO && echo $BAR-$FOO");
        r.env.insert("FOO".into(), "it's \"quoted\" $x".into());
        r.env.insert("BAR".into(), "bar".into());
        let out = run(&s.vm, r).await;
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "it's \"quoted\" $x\nbar-it's \"quoted\" $x\n"
        );

        let mut r = req("pwd");
        r.cwd = Some("/tmp".into());
        assert_eq!(run(&s.vm, r).await.stdout, b"/tmp\n");
        sh(&s.vm, "mkdir -p sub/dir").await;
        let mut r = req("pwd");
        r.cwd = Some("sub/dir".into());
        assert_eq!(run(&s.vm, r).await.stdout, b"/workspace/sub/dir\n");

        // A working directory that cannot be used fails the call with the
        // reason, and runs nothing.
        for (cwd, kind, message) in [
            (
                "/does/not/exist",
                ErrorKind::NotFound,
                "cwd /does/not/exist does not exist",
            ),
            (
                "/etc/passwd",
                ErrorKind::NotADirectory,
                "cwd /etc/passwd is not a directory",
            ),
            (
                "/root",
                ErrorKind::PermissionDenied,
                "cannot run the command in /root: Permission denied (os error 13)",
            ),
        ] {
            let mut r = req("touch /workspace/ran");
            r.cwd = Some(cwd.into());
            match s.vm.agent.exec_collect(r).await {
                Err(RuntimeError::Agent(e)) => {
                    assert_eq!((e.kind, e.message.as_str()), (kind, message), "cwd {cwd}")
                }
                other => panic!("cwd {cwd}: expected {kind:?}, got {other:?}"),
            }
        }
        let out = run(&s.vm, req("test -e /workspace/ran; echo $?")).await;
        assert_eq!(out.stdout, b"1\n");

        let out = run(&s.vm, req("kill -TERM $$")).await;
        assert_eq!(out.result.exit_code, None);
        assert_eq!(out.result.signal, Some(15));
    });
}

#[test]
fn output_is_streamed_as_it_is_produced() {
    let s = vm();
    block(async {
        let mut h =
            s.vm.agent
                .exec(req("echo first; sleep 3; echo second"))
                .unwrap();
        let start = Instant::now();
        let mut first_at = None;
        let mut all = Vec::new();
        loop {
            match h.next().await.unwrap() {
                GuestExecEvent::Stdout(b) => {
                    if first_at.is_none() {
                        first_at = Some(start.elapsed());
                    }
                    all.extend(b);
                }
                GuestExecEvent::Exited(r) => {
                    assert_eq!(r.exit_code, Some(0));
                    break;
                }
                _ => {}
            }
        }
        let total = start.elapsed();
        assert_eq!(all, b"first\nsecond\n");
        // "first" must arrive before the command's 3 s sleep is over.
        assert!(
            first_at.unwrap() + Duration::from_secs(2) < total,
            "output was not streamed"
        );
    });
}

#[test]
fn a_flood_of_output_is_truncated_and_the_vm_still_answers() {
    let s = vm();
    block(async {
        // 256 times the limit: as much a flood as a gigabyte for what is
        // kept and counted, at a quarter of the emulated CPU (a gigabyte
        // took over 5 minutes on a loaded 2-core host).
        let out = run(
            &s.vm,
            req_timeout("head -c 268435456 /dev/zero; echo done >&2", 600_000),
        )
        .await;
        assert_eq!(out.result.exit_code, Some(0), "{:?}", out.result);
        assert!(out.result.stdout_truncated);
        assert!(!out.result.stderr_truncated);
        assert_eq!(out.stdout.len(), 1 << 20, "kept exactly the 1 MiB limit");
        assert_eq!(out.result.stdout_bytes, 268_435_456);
        assert_eq!(out.stderr, b"done\n");
        s.vm.agent.ping().await.unwrap();
        assert_eq!(sh(&s.vm, "echo alive").await, "alive");
    });
}

#[test]
fn a_timeout_kills_the_command_and_its_children() {
    let s = vm();
    block(async {
        let out = run(
            &s.vm,
            req_timeout(
                "sleep 1000 & setsid sleep 1001 & echo started; sleep 1002",
                2_000,
            ),
        )
        .await;
        assert!(out.result.timed_out, "{:?}", out.result);
        assert_eq!(out.stdout, b"started\n", "output before the kill is kept");
        // The next commands run normally (the killed command's cgroup is
        // not handed on), and find nothing of it.
        for _ in 0..2 {
            let left = run(&s.vm, req("pgrep -u user -f 'sleep 100[012]' || echo none")).await;
            assert_eq!(
                (left.result.exit_code, left.stdout.as_slice()),
                (Some(0), b"none\n".as_slice()),
                "{:?}: {}",
                left.result,
                String::from_utf8_lossy(&left.stdout)
            );
        }
    });
}

#[test]
fn a_timeout_holds_while_the_command_floods_its_output() {
    let s = vm();
    block(async {
        let mut r = req_timeout("yes", 2_000);
        r.max_output_bytes = 1 << 20;
        let out = tokio::time::timeout(Duration::from_secs(60), s.vm.agent.exec_collect(r))
            .await
            .expect("a 2 s timeout held while `yes` kept writing")
            .expect("exec");
        assert!(out.result.timed_out, "{:?}", out.result);
        assert!(out.result.stdout_truncated && out.stdout.len() == 1 << 20);
        assert!(out.result.stdout_bytes > 1 << 20, "{:?}", out.result);
        assert_eq!(sh(&s.vm, "echo next").await, "next");
    });
}

#[test]
fn a_background_server_survives_its_command() {
    let s = vm();
    block(async {
        let t = Instant::now();
        let out = run(
            &s.vm,
            req_timeout("mkdir -p /tmp/www && echo hello-bg > /tmp/www/index.txt && cd /tmp/www && python3 -m http.server 8123 &", 30_000),
        )
        .await;
        assert_eq!(out.result.exit_code, Some(0));
        assert!(!out.result.timed_out);
        assert!(
            t.elapsed() < Duration::from_secs(25),
            "the command waited for its background child"
        );
        let body = sh(
            &s.vm,
            "for i in $(seq 100); do curl -sf http://127.0.0.1:8123/index.txt && exit 0; sleep 0.3; done; exit 1",
        )
        .await;
        assert_eq!(body, "hello-bg");
        // It keeps serving (and logging to the closed command's stderr) later on.
        assert_eq!(
            sh(&s.vm, "curl -sf http://127.0.0.1:8123/index.txt").await,
            "hello-bg"
        );
        sh(&s.vm, "pkill -f 'http.server 8123'").await;
    });
}

/// The next event of `h`, within 30 s.
async fn next_event(h: &mut sandpit_runtime::ExecHandle) -> GuestExecEvent {
    tokio::time::timeout(Duration::from_secs(30), h.next())
        .await
        .expect("an event within 30 s")
        .expect("an event")
}

#[test]
fn a_command_that_keeps_running_is_followed_fed_listed_and_signalled_by_pid() {
    let s = vm();
    block(async {
        let agent = &s.vm.agent;
        // It gives its pid first, and goes on when its request stops
        // following it.
        let mut ticker = agent
            .exec(sandpit_protocol::ExecRequest {
                keep_running: true,
                ..req_timeout(
                    "for i in $(seq 1 600); do echo $i; sleep 0.1; done",
                    120_000,
                )
            })
            .unwrap();
        let GuestExecEvent::Started(pid) = next_event(&mut ticker).await else {
            panic!("no pid first");
        };
        assert!(matches!(
            next_event(&mut ticker).await,
            GuestExecEvent::Stdout(_)
        ));
        drop(ticker);
        tokio::time::sleep(Duration::from_millis(800)).await;
        assert_eq!(
            sh(&s.vm, &format!("kill -0 {pid} && echo alive")).await,
            "alive"
        );
        let listed = agent.processes().await.unwrap();
        let me = listed.iter().find(|p| p.pid == pid).expect("listed");
        assert!(
            me.keep_running && !me.stdin && me.command.contains("seq 1 600"),
            "{me:?}"
        );

        // Another request follows it from now on: its pid, later numbers
        // in order, then the end a SIGTERM to its group gives.
        let mut later = agent.attach(pid, 1 << 20, Duration::from_secs(60)).unwrap();
        assert_eq!(next_event(&mut later).await, GuestExecEvent::Started(pid));
        let mut seen = Vec::new();
        while seen.len() < 5 {
            if let GuestExecEvent::Stdout(b) = next_event(&mut later).await {
                seen.extend(b);
            }
        }
        let numbers: Vec<u32> = String::from_utf8(seen)
            .unwrap()
            .lines()
            .filter_map(|l| l.parse().ok())
            .collect();
        assert!(numbers[0] > 2, "the follower saw the start: {numbers:?}");
        assert!(numbers.windows(2).all(|w| w[1] == w[0] + 1), "{numbers:?}");
        agent
            .process_call(
                pid,
                sandpit_protocol::ProcessCall::Signal { signal: 15 },
                &[],
            )
            .await
            .unwrap();
        let end = loop {
            if let GuestExecEvent::Exited(r) = next_event(&mut later).await {
                break r;
            }
        };
        assert_eq!((end.signal, end.cancelled), (Some(15), false), "{end:?}");
        assert!(!agent
            .processes()
            .await
            .unwrap()
            .iter()
            .any(|p| p.pid == pid));
        match agent
            .process_call(pid, sandpit_protocol::ProcessCall::CloseStdin, &[])
            .await
        {
            Err(RuntimeError::Agent(e)) => assert_eq!(e.kind, ErrorKind::NotFound),
            other => panic!("an ended command was found: {other:?}"),
        }

        // Its stdin is a pipe: input (more than a frame of it) reaches it
        // in order, and closing it is its end of file.
        let mut cat = agent
            .exec(sandpit_protocol::ExecRequest {
                keep_running: true,
                stdin: true,
                ..req_timeout("sha256sum; echo closed >&2", 60_000)
            })
            .unwrap();
        let GuestExecEvent::Started(cat_pid) = next_event(&mut cat).await else {
            panic!("no pid first");
        };
        let input: Vec<u8> = (0..600_000u32).map(|i| (i % 251) as u8).collect();
        agent
            .process_call(cat_pid, sandpit_protocol::ProcessCall::Input, &input)
            .await
            .unwrap();
        agent
            .process_call(cat_pid, sandpit_protocol::ProcessCall::CloseStdin, &[])
            .await
            .unwrap();
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let end = loop {
            match next_event(&mut cat).await {
                GuestExecEvent::Stdout(b) => out.extend(b),
                GuestExecEvent::Stderr(b) => err.extend(b),
                GuestExecEvent::Exited(r) => break r,
                GuestExecEvent::Started(_) => panic!("a second start"),
            }
        };
        assert_eq!(end.exit_code, Some(0));
        assert_eq!(
            String::from_utf8_lossy(&out)
                .split_whitespace()
                .next()
                .unwrap(),
            sha256_hex(&input)
        );
        assert_eq!(err, b"closed\n");

        // A command given no stdin refuses input, saying so; a SIGKILL by
        // pid goes through its own kill (its cgroup too).
        let mut sleeper = agent
            .exec(sandpit_protocol::ExecRequest {
                keep_running: true,
                ..req_timeout("sleep 60", 60_000)
            })
            .unwrap();
        let GuestExecEvent::Started(sleeper_pid) = next_event(&mut sleeper).await else {
            panic!("no pid first");
        };
        match agent
            .process_call(sleeper_pid, sandpit_protocol::ProcessCall::Input, b"x")
            .await
        {
            Err(RuntimeError::Agent(e)) => {
                assert_eq!(e.kind, ErrorKind::InvalidRequest);
                assert!(e.message.contains("stdin"), "{e}");
            }
            other => panic!("input went to a command without stdin: {other:?}"),
        }
        agent
            .process_call(
                sleeper_pid,
                sandpit_protocol::ProcessCall::Signal { signal: 9 },
                &[],
            )
            .await
            .unwrap();
        let end = loop {
            if let GuestExecEvent::Exited(r) = next_event(&mut sleeper).await {
                break r;
            }
        };
        assert!(end.cancelled && end.signal == Some(9), "{end:?}");
        assert_eq!(sh(&s.vm, "echo still answering").await, "still answering");
    });
}

#[test]
fn several_commands_run_at_once() {
    let s = vm();
    block(async {
        sh(&s.vm, "rm -f /tmp/go").await;
        // The waiter can only finish if the second command runs while it waits.
        let waiter = s.vm.agent.exec_collect(req_timeout(
            "while [ ! -f /tmp/go ]; do sleep 0.1; done; echo waited",
            60_000,
        ));
        let starter = async {
            tokio::time::sleep(Duration::from_millis(500)).await;
            s.vm.agent
                .exec_collect(req("touch /tmp/go; echo started"))
                .await
        };
        let (w, st) = tokio::join!(waiter, starter);
        assert_eq!(w.unwrap().stdout, b"waited\n");
        assert_eq!(st.unwrap().stdout, b"started\n");
    });
}

#[test]
fn files_with_every_byte_value_round_trip() {
    let s = vm();
    block(async {
        let bytes: Vec<u8> = (0..=255u8).cycle().take(256 * 41).collect();
        let (path, n) =
            s.vm.agent
                .write_file("bin/all-bytes.bin", &bytes, None)
                .await
                .unwrap();
        assert_eq!(path, "/workspace/bin/all-bytes.bin");
        assert_eq!(n, bytes.len() as u64);
        let (_, back) =
            s.vm.agent
                .read_file("/workspace/bin/all-bytes.bin", 1 << 20)
                .await
                .unwrap();
        assert_eq!(back, bytes);
        assert_eq!(
            sh(&s.vm, "stat -c %U:%G bin bin/all-bytes.bin").await,
            "user:user\nuser:user"
        );
        assert_eq!(
            sh(&s.vm, "sha256sum bin/all-bytes.bin | cut -d' ' -f1").await,
            sha256_hex(&bytes)
        );
        // Quotes and newlines survive: content never passes through a shell.
        let tricky = b"'$(rm -rf /)' \"\n`x`\r\n\\0\x00end";
        s.vm.agent
            .write_file("tricky.txt", tricky, None)
            .await
            .unwrap();
        assert_eq!(
            s.vm.agent.read_file("tricky.txt", 100).await.unwrap().1,
            tricky
        );
        // Empty file.
        s.vm.agent.write_file("empty", b"", None).await.unwrap();
        assert_eq!(s.vm.agent.read_file("empty", 100).await.unwrap().1, b"");
    });
}

fn sha256_hex(b: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(b))
}

#[test]
fn a_20_mb_file_round_trips() {
    let s = vm();
    block(async {
        let bytes: Vec<u8> = (0..20_000_000u32)
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect();
        s.vm.agent
            .write_file("big.bin", &bytes, None)
            .await
            .unwrap();
        assert_eq!(sh(&s.vm, "stat -c %s big.bin").await, "20000000");
        assert_eq!(
            sh(&s.vm, "sha256sum big.bin | cut -d' ' -f1").await,
            sha256_hex(&bytes)
        );
        let (_, back) = s.vm.agent.read_file("big.bin", 32 << 20).await.unwrap();
        assert!(back == bytes, "20 MB read back differs");
        match s.vm.agent.read_file("big.bin", 1 << 20).await {
            Err(RuntimeError::Agent(e)) => assert_eq!(e.kind, ErrorKind::TooLarge),
            other => panic!(
                "expected too large, got {:?}",
                other.map(|(p, b)| (p, b.len()))
            ),
        }
        sh(&s.vm, "rm big.bin").await;
    });
}

#[test]
fn deleting_a_file_frees_the_hosts_disk() {
    const MIB: u64 = 1024 * 1024;
    let s = vm();
    let on_host = || {
        s.manager
            .disk_use(&s.vm.record.id)
            .expect("the VM's disk use")
    };
    let before = on_host();
    block(sh(
        &s.vm,
        "dd if=/dev/zero of=half-gig bs=1M count=500 conv=fsync status=none",
    ));
    let grown = on_host();
    assert!(
        grown >= before + 450 * MIB,
        "writing 500 MiB grew the host's overlay from {} to {} MiB",
        before / MIB,
        grown / MIB
    );
    block(sh(&s.vm, "rm half-gig && sync"));
    // ext4 passes the freed blocks down at its journal commit, and QEMU
    // punches them out of the overlay file.
    let took = wait_until(
        "the host's overlay to shrink after the guest deleted 500 MiB",
        Duration::from_secs(60),
        || on_host() < before + 50 * MIB,
    );
    eprintln!(
        "overlay: {} MiB, {} MiB with the file, {} MiB {took:?} after its deletion",
        before / MIB,
        grown / MIB,
        on_host() / MIB
    );
}

#[test]
fn file_errors_are_typed() {
    let s = vm();
    block(async {
        let kind = |r: Result<(String, Vec<u8>), RuntimeError>| match r {
            Err(RuntimeError::Agent(e)) => e.kind,
            other => panic!("expected an agent error, got {:?}", other.map(|(p, _)| p)),
        };
        assert_eq!(
            kind(s.vm.agent.read_file("nope.txt", 10).await),
            ErrorKind::NotFound
        );
        assert_eq!(
            kind(s.vm.agent.read_file("/workspace", 10).await),
            ErrorKind::IsADirectory
        );
        assert_eq!(
            kind(s.vm.agent.read_file("/etc/shadow", 10).await),
            ErrorKind::PermissionDenied
        );
        match s.vm.agent.write_file("/etc/evil", b"x", None).await {
            Err(RuntimeError::Agent(e)) => assert_eq!(e.kind, ErrorKind::PermissionDenied),
            other => panic!("{other:?}"),
        }
        match s.vm.agent.write_file("/workspace", b"x", None).await {
            Err(RuntimeError::Agent(e)) => assert_eq!(e.kind, ErrorKind::IsADirectory),
            other => panic!("{other:?}"),
        }
    });
}

#[test]
fn listing_a_tree_and_deleting() {
    let s = vm();
    block(async {
        sh(&s.vm, "rm -rf tree && mkdir -p tree/a/b && printf 12345 > tree/a/b/five && printf x > tree/one && ln -s one tree/link").await;
        let (path, entries, truncated) = s.vm.agent.list_files("tree", true, 1000).await.unwrap();
        assert_eq!(path, "/workspace/tree");
        assert!(!truncated);
        let mut got: Vec<(String, String, u64)> = entries
            .iter()
            .map(|e| (e.name.clone(), format!("{:?}", e.kind), e.size_bytes))
            .collect();
        got.sort();
        let want = vec![
            ("a".to_string(), "Dir".to_string(), 0),
            ("a/b".to_string(), "Dir".to_string(), 0),
            ("a/b/five".to_string(), "File".to_string(), 5),
            ("link".to_string(), "Symlink".to_string(), 3),
            ("one".to_string(), "File".to_string(), 1),
        ];
        assert_eq!(got.len(), want.len(), "{got:?}");
        for (g, w) in got.iter().zip(&want) {
            assert_eq!((&g.0, &g.1), (&w.0, &w.1));
            if w.1 == "File" {
                assert_eq!(g.2, w.2);
            }
        }
        let (_, top, _) = s.vm.agent.list_files("tree", false, 1000).await.unwrap();
        assert_eq!(top.len(), 3, "{top:?}");
        let (_, capped, truncated) = s.vm.agent.list_files("tree", true, 2).await.unwrap();
        assert_eq!(capped.len(), 2);
        assert!(truncated);

        s.vm.agent.delete_file("tree/one", false).await.unwrap();
        assert!(matches!(
            s.vm.agent.delete_file("tree/a", false).await,
            Err(RuntimeError::Agent(_))
        ));
        s.vm.agent.delete_file("tree", true).await.unwrap();
        assert_eq!(sh(&s.vm, "test -e tree && echo yes || echo no").await, "no");
    });
}

/// A volume's file as the host makes one: `mib` MiB, ext4, its root
/// directory the guest user's.
fn volume_file(dir: &std::path::Path, mib: u64) -> std::path::PathBuf {
    let file = dir.join("volume.img");
    std::fs::File::create(&file)
        .unwrap()
        .set_len(mib << 20)
        .unwrap();
    let made = std::process::Command::new("mkfs.ext4")
        .args(["-q", "-F", "-m", "0", "-E", "root_owner=1000:1000"])
        .arg(&file)
        .output()
        .expect("mkfs.ext4 is missing: install Debian's e2fsprogs");
    assert!(made.status.success(), "{made:?}");
    file
}

/// A file of the volume as the host reads it, without mounting it
/// (`debugfs`, read-only).
fn file_in_volume(volume: &std::path::Path, path: &str) -> Vec<u8> {
    let out = std::process::Command::new("debugfs")
        .args(["-R", &format!("cat {path}")])
        .arg(volume)
        .output()
        .expect("debugfs is missing: install Debian's e2fsprogs");
    assert!(out.status.success(), "{out:?}");
    out.stdout
}

#[test]
fn a_volume_given_to_a_running_vm_is_mounted_written_and_kept_and_read_only_stays_so() {
    use sandpit_runtime::vm::volumes::slot_serial;
    let s = vm();
    let dir = data_dir();
    let volume = volume_file(&dir, 64);
    block(async {
        let id = &s.vm.record.id;
        // Read-write in slot 0: the user owns it and writes; synced and
        // unmounted, what it wrote is in the volume's file.
        s.manager
            .attach_volume(id, 0, &volume, false)
            .await
            .expect("an attach");
        let device =
            s.vm.agent
                .mount_volume(&slot_serial(0), "/mnt/data", false)
                .await
                .expect("a mount");
        assert!(device.starts_with("/dev/vd"), "{device}");
        let seen = sh(
            &s.vm,
            "stat -c %U /mnt/data; head -c 5000000 /dev/urandom > /mnt/data/blob; \
             sha256sum < /mnt/data/blob | cut -d' ' -f1; df -m --output=size /mnt/data | tail -1",
        )
        .await;
        let mut lines = seen.lines();
        assert_eq!(lines.next(), Some("user"), "{seen}");
        let written = lines.next().unwrap().to_string();
        let size_mb: u64 = lines.next().unwrap().trim().parse().unwrap();
        assert!((50..=64).contains(&size_mb), "{seen}");
        s.vm.agent
            .sync_volume("/mnt/data", true)
            .await
            .expect("a sync");
        let kept = file_in_volume(&volume, "/blob");
        assert_eq!(sha256_hex(&kept), written, "the volume's file");

        // Read-only in slot 1: the data is there, the user cannot write,
        // and root, remounting it read-write, writes only to the VM's
        // overlay: the volume's file does not change.
        let before = sha256_hex(&std::fs::read(&volume).unwrap());
        s.manager
            .attach_volume(id, 1, &volume, true)
            .await
            .expect("a read-only attach");
        s.vm.agent
            .mount_volume(&slot_serial(1), "/mnt/ro", true)
            .await
            .expect("a read-only mount");
        assert_eq!(
            sh(&s.vm, "sha256sum < /mnt/ro/blob | cut -d' ' -f1").await,
            written
        );
        let refused = run(&s.vm, req("touch /mnt/ro/new")).await;
        assert_ne!(refused.result.exit_code, Some(0));
        assert!(
            String::from_utf8_lossy(&refused.stderr).contains("Read-only file system"),
            "{refused:?}"
        );
        let mut forced = req("mount -o remount,rw /mnt/ro && echo forced > /mnt/ro/new && sync");
        forced.as_root = true;
        let _ = run(&s.vm, forced).await;
        assert_eq!(
            sha256_hex(&std::fs::read(&volume).unwrap()),
            before,
            "a read-only volume's file changed"
        );
        let mut off = req("umount /mnt/ro");
        off.as_root = true;
        let _ = run(&s.vm, off).await;
    });
}

/// What a file call, or the user's own `head`/`ls`, made of one path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    /// Read or listed (or too large to read whole: there was content).
    Read,
    Denied,
    Missing,
    Failed,
}

fn agent_outcome<T>(r: &Result<T, RuntimeError>) -> Outcome {
    match r {
        Ok(_) => Outcome::Read,
        Err(RuntimeError::Agent(e)) => match e.kind {
            ErrorKind::TooLarge => Outcome::Read,
            ErrorKind::PermissionDenied => Outcome::Denied,
            ErrorKind::NotFound => Outcome::Missing,
            _ => Outcome::Failed,
        },
        Err(e) => panic!("the agent did not answer: {e}"),
    }
}

/// Every file call has the user's rights, decided by the kernel, even on
/// the agent's own `/proc` files, which the kernel lets any thread of the
/// agent read whatever its credentials: each entry of `/proc/1` (the
/// agent; two levels), `/proc/1/task/1`, `/proc/self` and
/// `/proc/thread-self` (which name whoever reads them) is read, or listed,
/// through the agent and by the user's own `head` or `ls`, and the two
/// must answer alike. A symlink the user made to the agent's memory map is
/// no way round.
#[test]
fn file_calls_answer_as_the_user_would_on_every_proc_entry_of_the_agent() {
    let s = vm();
    block(async {
        // The entries, found as root (the user may not list /proc/1/fd),
        // with the file server's own (a file call has started it).
        s.vm.agent.write_file("walk.txt", b"", None).await.unwrap();
        let mut find = req("{ find /proc/1 -mindepth 1 -maxdepth 2 -path '/proc/1/task/*' -prune -o -printf '%y %p\\n'; \
             find /proc/1/task/1 /proc/self/ /proc/thread-self/ /proc/$(pgrep -o -x sandpit-files)/ \
               -mindepth 1 -maxdepth 1 -printf '%y %p\\n'; } \
             | grep -v -e ' /proc/self/fd/' -e ' /proc/self/fdinfo/' -e ' /proc/self/task/' -e ' /proc/thread-self/fd/'");
        // (The file server's entries are compared as any other process's.)
        find.as_root = true;
        find.cwd = Some("/".into());
        let found = s.vm.agent.exec_collect(find).await.expect("find as root");
        let listing = String::from_utf8_lossy(&found.stdout).into_owned();
        let mut entries: Vec<(bool, String)> = listing
            .lines()
            .filter_map(|l| l.split_once(' '))
            .map(|(kind, path)| (kind == "d", path.trim_end_matches('/').to_string()))
            .collect();
        sh(
            &s.vm,
            "ln -sfn /proc/1/maps /workspace/agent-maps; ln -sfn /proc/1/fd /workspace/agent-fds",
        )
        .await;
        entries.push((false, "/workspace/agent-maps".into()));
        entries.push((true, "/workspace/agent-fds".into()));
        assert!(entries.len() > 200, "too few entries found: {listing}");

        // The user's answers, in one command.
        let script = entries
            .iter()
            .map(|(dir, p)| format!("{} {p}", if *dir { 'd' } else { 'f' }))
            .collect::<Vec<_>>()
            .join("\n");
        let user = sh(
            &s.vm,
            &format!(
                "while read -r kind p; do \
                   if [ \"$kind\" = d ]; then err=$(ls -- \"$p\" 2>&1 >/dev/null); \
                   else err=$(head -c 65536 -- \"$p\" 2>&1 >/dev/null); fi; \
                   code=$?; \
                   case \"$err\" in *'Permission denied'*|*'not permitted'*) o=denied;; \
                     *'No such file'*) o=missing;; *) [ $code = 0 ] && o=read || o=failed;; esac; \
                   printf '%s %s\\n' \"$o\" \"$p\"; \
                 done <<'EOF'\n{script}\nEOF"
            ),
        )
        .await;
        let users: std::collections::HashMap<String, Outcome> = user
            .lines()
            .filter_map(|l| l.split_once(' '))
            .map(|(o, p)| {
                let o = match o {
                    "read" => Outcome::Read,
                    "denied" => Outcome::Denied,
                    "missing" => Outcome::Missing,
                    _ => Outcome::Failed,
                };
                (p.to_string(), o)
            })
            .collect();
        assert_eq!(users.len(), entries.len(), "{user}");

        // The agent's, the same paths through its file calls.
        let mut differ = Vec::new();
        let mut counts = std::collections::BTreeMap::new();
        for (dir, p) in &entries {
            let agent = if *dir {
                agent_outcome(&s.vm.agent.list_files(p, false, 10_000).await)
            } else {
                agent_outcome(&s.vm.agent.read_file(p, 1 << 20).await)
            };
            let theirs = users[p];
            *counts.entry(format!("{theirs:?}")).or_insert(0) += 1;
            // The agent's descriptors come and go with its requests (this
            // walk's among them): one there for the user's look and gone for
            // the agent's is refused to one and missing to the other, the
            // kernel's answers alike.
            let passing = ["/fd/", "/fdinfo/", "/map_files/"]
                .iter()
                .any(|d| p.contains(d));
            let nothing = |o: Outcome| matches!(o, Outcome::Denied | Outcome::Missing);
            if agent != theirs && !(passing && nothing(agent) && nothing(theirs)) {
                differ.push(format!("{p}: the agent {agent:?}, the user {theirs:?}"));
            }
        }
        assert!(
            differ.is_empty(),
            "{} of {} paths answered otherwise than for the user:\n{}",
            differ.len(),
            entries.len(),
            differ.join("\n")
        );
        // The walk met both kinds, and the ones the issue named.
        assert!(
            counts.get("Denied").copied().unwrap_or(0) > 20,
            "{counts:?}"
        );
        assert!(counts.get("Read").copied().unwrap_or(0) > 50, "{counts:?}");
        for denied in [
            "/proc/1/maps",
            "/proc/1/exe",
            "/proc/1/fd",
            "/proc/1/map_files",
            "/workspace/agent-maps",
        ] {
            assert_eq!(users.get(denied), Some(&Outcome::Denied), "{denied}");
        }
        sh(
            &s.vm,
            "rm /workspace/agent-maps /workspace/agent-fds /workspace/walk.txt",
        )
        .await;
    });
}
