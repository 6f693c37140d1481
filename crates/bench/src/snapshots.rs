//! `sandpit bench snapshots`: what snapshots, fork, restore and pause cost
//! on this machine, each as a ratio to a template restore timed in the same
//! run (the machines are noisy: ratios hold where absolute times do not).
//!
//! It drives this host's VMs the way the service does (`LocalVms`, the
//! same calls a sandbox's snapshot, fork, restore, pause and resume make),
//! with a sandbox that has touched `--touch-mb` of memory, and times each
//! operation to the first command that answers after it.

use crate::{median, row, Row, MAX_OUTPUT};
use anyhow::Result;
use clap::Args;
use sandpit_host::local::LocalVms;
use sandpit_host::machines::{Egress, Machines};
use sandpit_protocol::ExecRequest;
use sandpit_server::settings::Settings;
use std::sync::Arc;
use std::time::Instant;

#[derive(Args)]
pub struct SnapshotBenchArgs {
    /// Rounds of each measurement
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Memory the sandbox writes before it is snapshotted, in MiB
    #[arg(long, default_value_t = 300)]
    touch_mb: u32,
    /// Copies a fork makes
    #[arg(long, default_value_t = 3)]
    forks: usize,
    /// Sandbox size to use
    #[arg(long, default_value = "small")]
    size: String,
}

fn cmd(command: &str) -> ExecRequest {
    ExecRequest {
        command: command.into(),
        cwd: None,
        env: Default::default(),
        timeout_ms: 120_000,
        max_output_bytes: MAX_OUTPUT,
        ..Default::default()
    }
}

/// Runs `command` in VM `id`; fails unless it exits 0.
async fn sh(vms: &LocalVms, id: &str, command: &str) -> Result<()> {
    let out = vms.agent(id).await?.exec_collect(cmd(command)).await?;
    anyhow::ensure!(
        out.result.exit_code == Some(0),
        "{command}: exit {:?}: {}",
        out.result.exit_code,
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

fn expiry() -> time::OffsetDateTime {
    time::OffsetDateTime::now_utc() + time::Duration::hours(1)
}

/// Host processes whose command line names `needle`.
fn processes_mentioning(needle: &str) -> usize {
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return 0;
    };
    rd.filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().parse::<u32>().is_ok())
        .filter(|e| {
            std::fs::read(e.path().join("cmdline"))
                .map(|c| String::from_utf8_lossy(&c).contains(needle))
                .unwrap_or(false)
        })
        .count()
}

fn secs(t: Instant) -> f64 {
    t.elapsed().as_secs_f64()
}

pub async fn run(settings: &Settings, a: SnapshotBenchArgs) -> Result<i32> {
    let _owner = sandpit_server::serve::own(settings, sandpit_server::owner::Role::Bench)?;
    let m = settings.vm_manager()?;
    anyhow::ensure!(
        m.snapshots_supported(),
        "snapshots need templates, which this host's configuration turns off"
    );
    eprintln!("accelerator: {}; size {}", m.accel(), a.size);
    m.ensure_template(&a.size).await?;
    let vms = LocalVms::new(m);
    let mut made: Vec<String> = Vec::new();
    let mut saves: Vec<String> = Vec::new();
    let result = measure(&vms, &a, &mut made, &mut saves).await;
    for id in made {
        let _ = vms.destroy(&id).await;
    }
    for s in saves {
        let _ = Machines::delete_snapshot(&*vms, &s).await;
    }
    let rows = result?;
    println!();
    println!(
        "| measurement ({}, size {}, {} rounds) | median | ratio to a template restore |",
        vms.manager().accel(),
        a.size,
        a.rounds
    );
    println!("|---|---|---|");
    for Row(what, value) in rows {
        let (value, ratio) = value.split_once(" | ").unwrap_or((&value, ""));
        println!("| {what} | {value} | {ratio} |");
    }
    Ok(0)
}

async fn measure(
    vms: &Arc<LocalVms>,
    a: &SnapshotBenchArgs,
    made: &mut Vec<String>,
    saves: &mut Vec<String>,
) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    let fresh = |made: &mut Vec<String>| {
        let id = sandpit_host::ids::new_id("sbx_");
        made.push(id.clone());
        id
    };
    let snap_name = |saves: &mut Vec<String>| {
        let s = format!("snap_bench{}", &sandpit_host::ids::new_id("sbx_")[4..]);
        saves.push(s.clone());
        s
    };
    let (mut restore, mut snapshot, mut bytes, mut from_snap, mut rollback) =
        (vec![], vec![], vec![], vec![], vec![]);
    let (mut fork, mut pause, mut resume) = (vec![], vec![], vec![]);
    let (mut second, mut second_bytes) = (vec![], vec![]);
    let mut paused_processes = 0;
    for round in 0..a.rounds {
        eprintln!("round {} of {}", round + 1, a.rounds);
        // The baseline: a template restore to its first command.
        let id = fresh(made);
        let t = Instant::now();
        vms.create(&id, &a.size, expiry(), Egress::open(), vec![])
            .await?;
        sh(vms, &id, "true").await?;
        restore.push(secs(t));

        // A sandbox that touched memory, snapshotted.
        sh(
            vms,
            &id,
            &format!(
                "head -c {}M /dev/urandom > /dev/shm/touched && echo kept > /workspace/f",
                a.touch_mb
            ),
        )
        .await?;
        let snap = snap_name(saves);
        let t = Instant::now();
        let b = vms.snapshot(&id, &snap).await?;
        snapshot.push(secs(t));
        bytes.push(b as f64);
        // Another of the same sandbox, a file later: it stands on the first.
        sh(vms, &id, "echo more > /workspace/g").await?;
        let again = snap_name(saves);
        let t = Instant::now();
        let b = vms.snapshot(&id, &again).await?;
        second.push(secs(t));
        second_bytes.push(b as f64);
        Machines::delete_snapshot(&**vms, &again).await?;

        // A new sandbox from it.
        let copy = fresh(made);
        let t = Instant::now();
        Machines::start(
            &**vms,
            &copy,
            &a.size,
            Some(&snap),
            expiry(),
            Egress::open(),
            vec![],
        )
        .await?;
        sh(vms, &copy, "true").await?;
        from_snap.push(secs(t));

        // The sandbox rolled back to it.
        sh(vms, &id, "rm /workspace/f").await?;
        let t = Instant::now();
        vms.restore(&id, &snap, expiry(), Egress::open(), vec![])
            .await?;
        sh(vms, &id, "test -e /workspace/f").await?;
        rollback.push(secs(t));

        // A fork: a snapshot and copies that all answer.
        let t = Instant::now();
        let fork_snap = snap_name(saves);
        vms.snapshot(&id, &fork_snap).await?;
        let ids: Vec<String> = (0..a.forks).map(|_| fresh(made)).collect();
        let starts = ids.iter().map(|c| {
            let (vms, c, size, snap) = (vms.clone(), c.clone(), a.size.clone(), fork_snap.clone());
            tokio::spawn(async move {
                Machines::start(
                    &*vms,
                    &c,
                    &size,
                    Some(&snap),
                    expiry(),
                    Egress::open(),
                    vec![],
                )
                .await?;
                sh(&vms, &c, "true").await
            })
        });
        for s in starts.collect::<Vec<_>>() {
            s.await??;
        }
        fork.push(secs(t));

        // Pause, then resume to a first command.
        let t = Instant::now();
        vms.pause(&id).await?;
        pause.push(secs(t));
        paused_processes += processes_mentioning(&id);
        let t = Instant::now();
        vms.resume(&id, expiry(), Egress::open(), vec![]).await?;
        sh(vms, &id, "test -e /workspace/f").await?;
        resume.push(secs(t));

        for c in ids.iter().chain([&copy, &id]) {
            vms.destroy(c).await?;
        }
        for s in [snap, fork_snap] {
            Machines::delete_snapshot(&**vms, &s).await?;
        }
    }
    let base = median(restore.clone());
    let timed = |rows: &mut Vec<Row>, what: String, v: Vec<f64>| {
        let m = median(v);
        row(
            rows,
            what,
            format!("{:.0} ms | {:.2}x", m * 1000.0, m / base),
        );
    };
    timed(
        &mut rows,
        "template restore to first command (the baseline)".into(),
        restore,
    );
    timed(
        &mut rows,
        format!("snapshot of a sandbox that wrote {} MiB", a.touch_mb),
        snapshot,
    );
    row(
        &mut rows,
        "  its size on disk",
        format!("{:.0} MiB | ", median(bytes) / (1 << 20) as f64),
    );
    timed(
        &mut rows,
        "a second snapshot of it, a file later".into(),
        second,
    );
    row(
        &mut rows,
        "  its size on disk",
        format!("{:.1} MiB | ", median(second_bytes) / (1 << 20) as f64),
    );
    timed(
        &mut rows,
        "create from the snapshot to first command".into(),
        from_snap,
    );
    timed(
        &mut rows,
        "restore (same sandbox) to first command".into(),
        rollback,
    );
    timed(
        &mut rows,
        format!("fork x{}: snapshot and every copy's first command", a.forks),
        fork,
    );
    timed(&mut rows, "pause".into(), pause);
    timed(&mut rows, "resume to first command".into(), resume);
    row(
        &mut rows,
        "host processes of a paused sandbox (QEMU, passt, watchdog)",
        format!("{paused_processes} | "),
    );
    Ok(rows)
}
