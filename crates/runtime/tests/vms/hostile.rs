//! The guest user is hostile: fork bombs, full disks, all memory, killing
//! everything it can. After each, the agent must still answer and the VM must
//! still run commands. One VM, attacked in sequence.

use sandpit_runtime::VmState;
use sandpit_vmtest::*;
use std::time::Duration;

async fn healthy(s: &Shared) {
    s.vm.agent.ping().await.expect("agent answers ping");
    assert_eq!(sh(&s.vm, "echo alive").await, "alive");
    assert_eq!(s.manager.state(&s.vm.record), VmState::Running);
}

/// Processes of the guest user, counted from the agent's side of the fence.
async fn user_processes(s: &Shared) -> usize {
    let out = sh(&s.vm, "cat /sys/fs/cgroup/user/pids.current").await;
    out.trim().parse().unwrap()
}

#[test]
fn the_agent_survives_what_the_user_does() {
    let s = shared("sbx_hostile", || config(&data_dir()));
    s.rt.block_on(async {
        // Fork bomb in the foreground: the pids limit holds it, the timeout
        // kills all of it (the command's cgroup), the agent answers throughout.
        let out = run(&s.vm, req_timeout("bomb() { bomb | bomb & }; bomb; sleep 600", 10_000)).await;
        assert!(out.result.timed_out, "{:?}", out.result);
        healthy(&s).await;
        assert!(user_processes(&s).await < 5, "the bomb outlived its timeout");

        // A fork bomb left running in the background: the next command still
        // starts (one command cannot take every pid) and can clean up. The
        // shell that starts it ends at once, but its end is seen by an agent
        // sharing two emulated CPUs with the bomb: on a loaded host (CI's
        // lanes beside it) that took over 10 s once, so its bound is wide.
        let out = run(&s.vm, req_timeout("bomb() { bomb | bomb & }; bomb", 60_000)).await;
        assert_eq!(out.result.exit_code, Some(0));
        tokio::time::sleep(Duration::from_secs(3)).await;
        healthy(&s).await;
        // kill -9 -1 alone races with the forks; stopping everything first
        // (stopped processes cannot fork) makes the cleanup converge.
        // On a loaded host a round can miss forks in flight; a user repeats it.
        let mut left = usize::MAX;
        for _ in 0..3 {
            let _ = run(
                &s.vm,
                req_timeout("for i in 1 2 3 4 5 6 7 8; do kill -STOP -1; done; kill -KILL -1", 30_000),
            )
            .await;
            tokio::time::sleep(Duration::from_secs(1)).await;
            left = user_processes(&s).await;
            if left < 5 {
                break;
            }
        }
        assert!(left < 5, "the background bomb survived three rounds of STOP+KILL: {left} processes");

        // Disk filler: the user fills the disk; the agent still works, and says
        // why a write failed.
        let out = run(
            &s.vm,
            req_timeout(
                "fallocate -l $(( $(df --output=avail -B1 /workspace | tail -1) )) /workspace/fill; \
                 dd if=/dev/zero of=/workspace/fill2 bs=1M count=4096 2>&1 | tail -1; df -h /workspace | tail -1",
                120_000,
            ),
        )
        .await;
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("No space left") || text.contains("100%"), "disk not full: {text}");
        healthy(&s).await;
        match s.vm.agent.write_file("more.bin", &vec![7u8; 1 << 20], None).await {
            Err(sandpit_runtime::RuntimeError::Agent(e)) => {
                assert!(e.message.to_lowercase().contains("space"), "{e}")
            }
            other => panic!("a write to a full disk succeeded: {other:?}"),
        }
        sh(&s.vm, "rm -f /workspace/fill /workspace/fill2").await;
        s.vm.agent.write_file("after.txt", b"room again", None).await.unwrap();

        // Memory: the user takes all it can; the OOM killer picks the user's process.
        let out = run(
            &s.vm,
            req_timeout(
                "python3 -c 'a=[]\nwhile True: a.append(bytearray(16*1024*1024))'",
                120_000,
            ),
        )
        .await;
        assert_ne!(out.result.exit_code, Some(0), "{:?}", out.result);
        healthy(&s).await;

        // Kill everything the user can: the file server, which has the
        // user's rights, is not the user's to kill or stop, and serves on.
        s.vm.agent.write_file("before-kill.txt", b"1", None).await.unwrap();
        let _ = run(&s.vm, req_timeout("kill -STOP -1; kill -9 -1", 10_000)).await;
        healthy(&s).await;
        let refused = sh(&s.vm, "kill -STOP $(pgrep -o -x sandpit-files) 2>&1; echo $?").await;
        assert!(
            refused.contains("Operation not permitted") && refused.ends_with('1'),
            "the user stopped the file server: {refused}"
        );
        s.vm.agent.write_file("after-kill.txt", b"2", None).await.unwrap();

        // A setsid'd process hog keeps running in the background; commands still work.
        sh(&s.vm, "setsid sh -c 'while :; do :; done' >/dev/null 2>&1 & setsid sh -c 'while :; do :; done' >/dev/null 2>&1 & echo ok").await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        healthy(&s).await;
        let _ = run(&s.vm, req_timeout("kill -9 -1", 10_000)).await;
        healthy(&s).await;

        // A user who keeps stopping all its own processes catches shells
        // between their setuid and their execve, where the agent waits for
        // them. Every command must still answer, done or timed out by its
        // own timeout; the 45th used to hang for ever, and every one after.
        let _ = run(
            &s.vm,
            req_timeout(
                "setsid python3 -c 'import os, signal\n\
                 while not os.path.exists(\"/workspace/stop-stopping\"): os.kill(-1, signal.SIGSTOP)' \
                 >/dev/null 2>&1 & sleep 1",
                10_000,
            ),
        )
        .await;
        let (mut done, mut timed_out) = (0, 0);
        for i in 0..40 {
            let out = tokio::time::timeout(Duration::from_millis(31_500), run(&s.vm, req_timeout("true", 1_500)))
                .await
                .unwrap_or_else(|_| panic!("command {i} did not answer 30 s past its 1.5 s timeout ({done} done, {timed_out} timed out before it)"));
            if out.result.timed_out {
                timed_out += 1;
            } else {
                assert_eq!(out.result.exit_code, Some(0), "{:?}", out.result);
                done += 1;
            }
        }
        eprintln!("under a SIGSTOP loop: {done} commands done, {timed_out} timed out");
        s.vm.agent.ping().await.expect("agent answers ping under the SIGSTOP loop");
        s.vm.agent.write_file("stop-stopping", b"", None).await.unwrap();
        let _ = run(&s.vm, req_timeout("kill -9 -1", 10_000)).await;
        healthy(&s).await;

        s.manager.destroy(&s.vm.record.id).await.unwrap();
    });
}
