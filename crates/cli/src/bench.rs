//! `sandpit bench`: one command that measures what users feel, on this
//! machine, and prints medians. Times are noisy here (2 shared cores, TCG), so
//! every figure is a median of several runs taken in the same invocation.

use crate::sandbox::{manager, new_id, MAX_OUTPUT};
use crate::settings::Settings;
use anyhow::Result;
use clap::Args;
use sandpit_protocol::ExecRequest;
use sandpit_runtime::CreateVm;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

#[derive(Args)]
pub struct BenchArgs {
    /// Cold creates to time
    #[arg(long, default_value_t = 5)]
    creates: usize,
    /// `true` round trips to time
    #[arg(long, default_value_t = 50)]
    execs: usize,
    /// 16 MiB transfers to time in each direction
    #[arg(long, default_value_t = 5)]
    transfers: usize,
    /// Sandbox size to use
    #[arg(long, default_value = "small")]
    size: String,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let n = v.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn true_cmd() -> ExecRequest {
    ExecRequest {
        command: "true".into(),
        cwd: None,
        env: BTreeMap::new(),
        timeout_ms: 60_000,
        max_output_bytes: MAX_OUTPUT,
    }
}

/// Proportional set size of a process, KiB.
fn pss_kib(pid: u32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
    text.lines()
        .find(|l| l.starts_with("Pss:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}

/// CPU time (user+system) of a process, in clock ticks.
fn cpu_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

pub async fn run(settings: &Settings, a: BenchArgs) -> Result<i32> {
    let m = manager(settings)?;
    eprintln!("accelerator: {}; size {}", m.accel(), a.size);
    let new = |id: String| CreateVm {
        id,
        size: a.size.clone(),
        metadata: BTreeMap::new(),
    };

    let mut creates = Vec::new();
    for i in 0..a.creates {
        let id = new_id();
        let t = Instant::now();
        let vm = m.create(new(id.clone())).await?;
        vm.agent.exec_collect(true_cmd()).await?;
        let s = t.elapsed().as_secs_f64();
        eprintln!("cold create {}/{}: {:.2} s", i + 1, a.creates, s);
        creates.push(s);
        m.destroy(&id).await?;
    }

    let id = new_id();
    let vm = m.create(new(id.clone())).await?;
    let result = async {
        for _ in 0..3 {
            vm.agent.exec_collect(true_cmd()).await?;
        }
        let mut execs = Vec::new();
        for _ in 0..a.execs {
            let t = Instant::now();
            vm.agent.exec_collect(true_cmd()).await?;
            execs.push(t.elapsed().as_secs_f64() * 1000.0);
        }
        let payload: Vec<u8> = (0..16 * 1024 * 1024u32)
            .map(|i| (i * 7 + 3) as u8)
            .collect();
        let mb = payload.len() as f64 / 1e6;
        let (mut writes, mut reads) = (Vec::new(), Vec::new());
        for _ in 0..a.transfers {
            let t = Instant::now();
            vm.agent.write_file("bench.bin", &payload, None).await?;
            writes.push(mb / t.elapsed().as_secs_f64());
            let t = Instant::now();
            let (_, back) = vm.agent.read_file("bench.bin", 64 << 20).await?;
            reads.push(mb / t.elapsed().as_secs_f64());
            anyhow::ensure!(back == payload, "read back differs from what was written");
        }
        // Idle: let the guest settle, then sample memory and CPU.
        tokio::time::sleep(Duration::from_secs(5)).await;
        let pid = vm.record.qemu_pid;
        let passt_pss = vm.record.passt_pid.and_then(pss_kib).unwrap_or(0);
        let mut pss = Vec::new();
        for _ in 0..3 {
            pss.push((pss_kib(pid).unwrap_or(0) + passt_pss) as f64 / 1024.0);
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        let window = Duration::from_secs(10);
        let c0 = cpu_ticks(pid).unwrap_or(0);
        tokio::time::sleep(window).await;
        let c1 = cpu_ticks(pid).unwrap_or(0);
        // SAFETY: sysconf has no preconditions.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
        let idle_cpu = (c1 - c0) as f64 / hz / window.as_secs_f64() * 100.0;
        anyhow::Ok((execs, writes, reads, pss, idle_cpu))
    }
    .await;
    m.destroy(&id).await?;
    let (execs, writes, reads, pss, idle_cpu) = result?;

    println!();
    println!("| measurement ({}) | median |", m.accel());
    println!("|---|---|");
    println!(
        "| cold create to first command ({} runs) | {:.2} s |",
        creates.len(),
        median(creates)
    );
    println!(
        "| `true` exec round trip ({} runs) | {:.2} ms |",
        execs.len(),
        median(execs)
    );
    println!(
        "| write 16 MiB ({} runs) | {:.1} MB/s |",
        writes.len(),
        median(writes)
    );
    println!(
        "| read 16 MiB ({} runs) | {:.1} MB/s |",
        reads.len(),
        median(reads)
    );
    println!(
        "| host PSS of an idle sandbox (QEMU + passt) | {:.1} MiB |",
        median(pss)
    );
    println!(
        "| host CPU of an idle sandbox (10 s) | {:.2} % of one core |",
        idle_cpu
    );
    Ok(0)
}
