//! `sandpit bench volumes`: sequential write and read inside a guest on a
//! volume against the same on the sandbox's own disk, in the same VM and
//! the same run, alternating, so the ratio holds where absolute speeds (2
//! shared cores, TCG) do not. The target: a volume at least 0.8x
//! its sandbox's own disk, both ways.
//!
//! The guest's `dd` does the work as the sandbox's user: a write is timed
//! to its `fsync` (`conv=fsync`: on the host's file, not in the guest's
//! cache), a read with `O_DIRECT` (`iflag=direct`: from the device, not
//! the guest's cache). The VM is started the way a sandbox's is
//! (`LocalVms`, from the size's template), with a volume made as the
//! service makes one (`VolumeFiles`).

use crate::{median, row, Row, MAX_OUTPUT};
use anyhow::{Context, Result};
use clap::Args;
use sandpit_host::local::LocalVms;
use sandpit_host::machines::{Egress, VmVolume};
use sandpit_protocol::ExecRequest;
use sandpit_server::settings::Settings;

#[derive(Args)]
pub struct VolumeBenchArgs {
    /// Rounds of each measurement
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// What each write and read moves, in MiB
    #[arg(long, default_value_t = 256)]
    mb: u32,
    /// Sandbox size to use
    #[arg(long, default_value = "small")]
    size: String,
}

/// Where the guest mounts the bench's volume.
const MOUNT: &str = "/bench-volume";
/// Where the guest's own disk is written (its user's directory).
const OWN_DISK: &str = "/workspace";

pub async fn run(settings: &Settings, a: VolumeBenchArgs) -> Result<i32> {
    let _owner = sandpit_server::serve::own(settings, sandpit_server::owner::Role::Bench)?;
    let m = settings.vm_manager()?;
    eprintln!("accelerator: {}; size {}", m.accel(), a.size);
    if m.snapshots_supported() {
        m.ensure_template(&a.size).await?;
    }
    let vms = LocalVms::new(m);
    let volume = format!("vol_bench{}", &sandpit_host::ids::new_id("sbx_")[4..]);
    let id = sandpit_host::ids::new_id("sbx_");
    let result = measure(&vms, &a, &id, &volume).await;
    let _ = vms.destroy(&id).await;
    let _ = vms.volume_files().delete(&volume).await;
    let rows = result?;
    println!();
    println!(
        "| measurement ({}, size {}, {} MiB, {} rounds) | volume | own disk | volume / own disk |",
        vms.manager().accel(),
        a.size,
        a.mb,
        a.rounds
    );
    println!("|---|---|---|---|");
    for Row(what, value) in rows {
        println!("| {what} | {value} |");
    }
    Ok(0)
}

async fn measure(vms: &LocalVms, a: &VolumeBenchArgs, id: &str, volume: &str) -> Result<Vec<Row>> {
    // Room for a write and the file system's own.
    let bytes = (u64::from(a.mb) * 2 + 512) << 20;
    vms.volume_files().create(volume, bytes).await?;
    let expires = time::OffsetDateTime::now_utc() + time::Duration::hours(1);
    let mounted = VmVolume {
        volume: volume.to_string(),
        path: MOUNT.to_string(),
        read_only: false,
    };
    vms.create(id, &a.size, expires, Egress::open(), vec![mounted])
        .await?;
    let (mut write_vol, mut write_own, mut read_vol, mut read_own) =
        (vec![], vec![], vec![], vec![]);
    for round in 0..a.rounds {
        eprintln!("round {} of {}", round + 1, a.rounds);
        // Alternating, so neither side always goes first.
        let order = match round % 2 {
            0 => [MOUNT, OWN_DISK],
            _ => [OWN_DISK, MOUNT],
        };
        for dir in order {
            let file = format!("{dir}/bench-{round}");
            let write = dd(
                vms,
                id,
                &format!("dd if=/dev/zero of={file} bs=1M count={} conv=fsync", a.mb),
                a.mb,
            )
            .await?;
            let read = dd(
                vms,
                id,
                &format!("dd if={file} of=/dev/null bs=1M iflag=direct"),
                a.mb,
            )
            .await?;
            dd_done(vms, id, &file).await?;
            match dir {
                MOUNT => {
                    write_vol.push(write);
                    read_vol.push(read);
                }
                _ => {
                    write_own.push(write);
                    read_own.push(read);
                }
            }
        }
    }
    let mut rows = Vec::new();
    for (what, vol, own) in [
        ("sequential write to fsync (MB/s)", write_vol, write_own),
        ("sequential read, O_DIRECT (MB/s)", read_vol, read_own),
    ] {
        let (vol, own) = (median(vol), median(own));
        row(
            &mut rows,
            what,
            format!("{vol:.1} | {own:.1} | {:.2}x", vol / own),
        );
    }
    Ok(rows)
}

/// Runs `dd` command `command` in VM `id`, moving `mb` MiB: its speed in
/// MB/s, from its own time (the copy alone, not the command's start).
async fn dd(vms: &LocalVms, id: &str, command: &str, mb: u32) -> Result<f64> {
    let out = run_in(vms, id, command).await?;
    // "268435456 bytes (268 MB, 256 MiB) copied, 2.34 s, 115 MB/s"
    let summary = out
        .lines()
        .rev()
        .find(|l| l.contains(" copied, "))
        .with_context(|| format!("{command}: no summary in {out:?}"))?;
    let secs: f64 = summary
        .split(", ")
        .find_map(|part| part.strip_suffix(" s"))
        .and_then(|s| s.trim().parse().ok())
        .with_context(|| format!("{command}: no time in {summary:?}"))?;
    Ok(f64::from(mb) * 1.048_576 / secs)
}

/// Removes `file` in VM `id` (and lets its blocks go).
async fn dd_done(vms: &LocalVms, id: &str, file: &str) -> Result<()> {
    run_in(vms, id, &format!("rm -f {file} && sync"))
        .await
        .map(drop)
}

/// Runs `command` in VM `id` as its user; its stderr (dd's summary), or
/// why it failed.
async fn run_in(vms: &LocalVms, id: &str, command: &str) -> Result<String> {
    let request = ExecRequest {
        command: command.into(),
        timeout_ms: 600_000,
        max_output_bytes: MAX_OUTPUT,
        ..Default::default()
    };
    let out = vms.agent(id).await?.exec_collect(request).await?;
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    anyhow::ensure!(
        out.result.exit_code == Some(0),
        "{command}: exit {:?}: {stderr}",
        out.result.exit_code
    );
    Ok(stderr)
}
