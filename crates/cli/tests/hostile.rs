//! The guest user is hostile: fork bombs, full disks, all memory, killing
//! everything it can. After each, the agent must still answer and the VM must
//! still run commands. One VM, attacked in sequence.

mod common;

use common::*;
use sandpit_runtime::VmState;
use std::time::Duration;

async fn healthy(s: &Shared) {
    s.vm.agent.ping().await.expect("agent answers ping");
    assert_eq!(sh(&s.vm, "echo alive").await, "alive");
    assert_eq!(s.manager.state(&s.vm.record), VmState::Running);
}

#[test]
fn the_agent_survives_what_the_user_does() {
    let s = shared("sbx_hostile", || config(&data_dir()));
    s.rt.block_on(async {
        // Fork bomb: the pids limit stops it, the timeout kills it, the agent answers.
        let out = run(&s.vm, req_timeout("bomb() { bomb | bomb & }; bomb", 15_000)).await;
        assert!(out.result.timed_out || out.result.exit_code.is_some(), "{:?}", out.result);
        healthy(&s).await;
        // Nothing of the bomb is left.
        let left = sh(&s.vm, "ps -u user -o pid= | wc -l").await;
        assert!(left.parse::<u32>().unwrap() < 5, "{left} user processes left");

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

        // Kill everything the user can.
        let _ = run(&s.vm, req_timeout("kill -9 -1", 10_000)).await;
        healthy(&s).await;

        // A setsid'd process hog keeps running in the background; commands still work.
        sh(&s.vm, "setsid sh -c 'while :; do :; done' >/dev/null 2>&1 & setsid sh -c 'while :; do :; done' >/dev/null 2>&1 & echo ok").await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        healthy(&s).await;
        let _ = run(&s.vm, req_timeout("kill -9 -1", 10_000)).await;
        healthy(&s).await;

        s.manager.destroy(&s.vm.record.id).await.unwrap();
    });
}
