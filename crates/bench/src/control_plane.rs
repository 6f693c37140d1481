//! The control plane's figures, against one server this process runs on
//! this machine and drives over the loopback as an agent would: creates
//! from a full warm pool, an empty one and in bursts; a command's round
//! trip over MCP split by layer; the pool's refill at rest and beside a
//! busy sandbox; many idle sandboxes (their memory, their sleep); preview
//! URLs against the same server reached from inside the guest.

use super::*;

/// The server in this process (store in a scratch file, VMs in the data
/// directory, a warm pool as configured), driven over loopback by rmcp's
/// client, as an agent would.
pub(crate) async fn control_plane(
    settings: &Settings,
    a: &BenchArgs,
    rows: &mut Vec<Row>,
    targets: &mut Vec<Target>,
    exec_ms: f64,
    cold_s: f64,
    restore_s: f64,
) -> Result<()> {
    use rmcp::model::CallToolRequestParams;
    use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
    use rmcp::transport::StreamableHttpClientTransport;
    use rmcp::ServiceExt;
    use std::sync::Arc;

    let pool_target = settings
        .pool
        .sizes
        .get(&a.size)
        .copied()
        .unwrap_or(0)
        .max(1);
    let mut pool = settings.pool.clone();
    pool.sizes = BTreeMap::from([(a.size.clone(), pool_target)]);
    // Room for the idle crowd and the burst.
    let mut service = settings.service.clone();
    if let Some(secs) = a.idle_pause {
        service.idle_pause_secs = secs;
    }
    // (`--fill` goes on until the host, not the account, says no.)
    service.default_max_concurrent_sandboxes = if a.fill {
        100_000
    } else {
        (a.idle + a.burst + 10) as u32
    };
    let scratch = tempfile::tempdir()?;
    let store = sandpit_store::Store::open_sqlite(scratch.path().join("bench.db")).await?;
    let vms = sandpit_host::local::LocalVms::with_budget(
        settings.vm_manager()?,
        pool,
        settings.capacity.clone(),
    );
    // Preview URLs of this in-process server: `localhost:{its port}`.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    let url = format!("http://127.0.0.1:{port}");
    service.preview_scheme = "http".into();
    service.preview_domain = format!("localhost:{port}");
    let svc = sandpit_core::Service::new(service.clone(), store, vms.clone());
    svc.start().await?;
    sandpit_core::admin::create_account(svc.store(), &service, "bench", 100_000.0).await?;
    let (key, _) = sandpit_core::admin::create_key(svc.store(), "bench").await?;
    let api: Arc<dyn SandboxApi> = svc.clone();
    let app = sandpit_api::router(api.clone(), sandpit_api::RestConfig::default()).nest_service(
        "/v1/mcp",
        sandpit_mcp::http_service(api, sandpit_mcp::HttpConfig::default()),
    );
    let front = Arc::new(sandpit_server::front::Front {
        api: app,
        proxy: sandpit_server::proxy::Proxy::new(svc.clone(), &svc.config().preview_scheme),
        preview_domain: service.preview_domain.clone(),
        preview_scheme: service.preview_scheme.clone(),
    });
    let server = tokio::spawn(sandpit_server::listener::serve(
        vec![listener],
        None,
        front,
        sandpit_server::listener::ConnectionLimits::default(),
        std::future::pending(),
    ));
    let client = ()
        .serve(StreamableHttpClientTransport::from_config(
            StreamableHttpClientTransportConfig::with_uri(format!("{url}/v1/mcp"))
                .auth_header(key.clone()),
        ))
        .await?;
    let args = |v: serde_json::Value| v.as_object().cloned().unwrap_or_default();
    let size = a.size.clone();
    let call = |name: &'static str, v: serde_json::Value| {
        let client = &client;
        let params = CallToolRequestParams::new(name).with_arguments(args(v));
        async move {
            let r = client.call_tool(params).await?;
            anyhow::ensure!(r.is_error != Some(true), "{name} failed: {r:?}");
            let v = r.structured_content.clone().unwrap_or_default();
            anyhow::Ok(v)
        }
    };
    let create = || call("create_sandbox", serde_json::json!({"size": size}));
    // The idle crowd outlives its own filling (15 minutes, the default
    // lifetime, is too short for 500 on a host that makes them wait).
    let create_idle = || {
        call(
            "create_sandbox",
            serde_json::json!({"size": size, "timeout_minutes": IDLE_LIFETIME_MINUTES}),
        )
    };
    let destroy = |id: String| call("destroy_sandbox", serde_json::json!({"sandbox_id": id}));
    let wait_pool = |n: usize| {
        let svc = svc.clone();
        let size = a.size.clone();
        async move {
            let t = Instant::now();
            while svc.warm_count(&size) < n {
                anyhow::ensure!(
                    t.elapsed() < Duration::from_secs(300),
                    "the pool did not fill"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            anyhow::Ok(t.elapsed().as_secs_f64())
        }
    };
    let sandbox_id = |v: &serde_json::Value| -> Result<String> {
        v.get("id")
            .or_else(|| v.get("sandbox_id"))
            .and_then(|i| i.as_str())
            .map(str::to_string)
            .ok_or_else(|| anyhow::anyhow!("create_sandbox returned no id: {v}"))
    };

    // Warm pool: each create finds a full pool.
    wait_pool(pool_target).await?;
    let mut warm = Vec::new();
    let mut first_cmd = Vec::new();
    for _ in 0..a.mcp_creates {
        wait_pool(pool_target).await?;
        let t = Instant::now();
        let v = create().await?;
        warm.push(t.elapsed().as_secs_f64() * 1000.0);
        let id = sandbox_id(&v)?;
        call(
            "run_command",
            serde_json::json!({"sandbox_id": id, "command": "true"}),
        )
        .await?;
        first_cmd.push(t.elapsed().as_secs_f64() * 1000.0);
        destroy(id).await?;
    }
    let (warm_med, warm_max) = median_max(&warm);
    let warm_p99 = percentile(&warm, 0.99);
    row(
        rows,
        format!(
            "MCP `create_sandbox`, warm pool ({} calls): median / p99 / max",
            warm.len()
        ),
        format!(
            "{warm_med:.1} ms / {warm_p99:.1} ms / {warm_max:.1} ms ({:.1}x p99/median; {:.0}x faster than a cold boot)",
            warm_p99 / warm_med,
            cold_s * 1000.0 / warm_med
        ),
    );
    row(
        rows,
        "MCP `create_sandbox` + first `run_command`, warm pool",
        format!("{:.1} ms", median(first_cmd)),
    );

    // MCP command round trip, at rest: the pool refilled after the create.
    let id = sandbox_id(&create().await?)?;
    wait_pool(pool_target).await?;
    // Warmed up as the direct execs are: the first command in a sandbox is
    // measured above.
    for _ in 0..3 {
        call(
            "run_command",
            serde_json::json!({"sandbox_id": id, "command": "true"}),
        )
        .await?;
    }
    // MCP, the service alone (store records, no HTTP or MCP) and the agent
    // alone, interleaved call by call on one sandbox: the host's speed drifts
    // over minutes, so each layer's cost is the median of paired differences.
    // The same `tools/call` is also sent as one plain JSON-RPC POST (a kept
    // connection, no SDK), which tells the server's part of HTTP and MCP
    // from what rmcp's client adds on its side.
    let caller = svc.authenticate(&key).await?;
    let agent = vms.agent(&id).await?;
    let plain = reqwest::Client::new();
    let mcp_url = format!("{url}/v1/mcp");
    let plain_call = serde_json::json!({
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {"name": "run_command", "arguments": {"sandbox_id": id, "command": "true"}},
    });
    let mut laps = Laps::default();
    for _ in 0..a.execs {
        let t = Instant::now();
        let v = call(
            "run_command",
            serde_json::json!({"sandbox_id": id, "command": "true"}),
        )
        .await?;
        let mcp = t.elapsed().as_secs_f64() * 1000.0;
        let t = Instant::now();
        let answer: serde_json::Value = plain
            .post(&mcp_url)
            .bearer_auth(&key)
            .header("accept", "application/json, text/event-stream")
            .json(&plain_call)
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?;
        let raw = t.elapsed().as_secs_f64() * 1000.0;
        anyhow::ensure!(
            answer["result"]["isError"] != true
                && answer["result"]["structuredContent"].is_object(),
            "run_command over a plain POST failed: {answer}"
        );
        let t = Instant::now();
        let params: sandpit_core::model::ExecParams =
            serde_json::from_value(serde_json::json!({"command": "true"}))?;
        let e = svc.exec(&caller, &id, params).await?;
        let service = t.elapsed().as_secs_f64() * 1000.0;
        let t = Instant::now();
        let out = agent.exec_collect(true_cmd()).await?;
        let direct = t.elapsed().as_secs_f64() * 1000.0;
        let mut lap = [0.0; 7];
        lap[LAP_MCP] = mcp;
        lap[LAP_MCP_SHELL] = v["duration_ms"].as_f64().unwrap_or(f64::NAN);
        lap[LAP_SERVICE] = service;
        lap[LAP_SERVICE_SHELL] = e.duration_ms as f64;
        lap[LAP_DIRECT] = direct;
        lap[LAP_SHELL] = shell_ms(&out.result);
        lap[LAP_PLAIN_POST] = raw;
        laps.push(lap);
    }
    let run_ms = median(laps.column(LAP_MCP));
    row(
        rows,
        format!(
            "MCP `run_command(\"true\")` round trip ({} calls)",
            laps.0.len()
        ),
        format!(
            "{run_ms:.2} ms ({:.2}x a direct agent exec; the shell itself, timed by the agent: {:.0} ms; the service API without HTTP: {:.2} ms, shell {:.0} ms)",
            run_ms / exec_ms,
            median(laps.column(LAP_MCP_SHELL)),
            median(laps.column(LAP_SERVICE)),
            median(laps.column(LAP_SERVICE_SHELL))
        ),
    );
    row(
        rows,
        format!(
            "where `run_command` spends its time (interleaved, {} calls of each, median of paired differences)",
            laps.0.len()
        ),
        format!(
            "shell {:.2} ms; agent and channel +{:.2} ms; service and store +{:.2} ms; HTTP and MCP +{:.2} ms (the server's part, seen by a plain JSON-RPC POST: +{:.2} ms; rmcp's client: +{:.2} ms)",
            median(laps.column(LAP_SHELL)),
            laps.overhead(LAP_DIRECT, LAP_SHELL),
            laps.overhead(LAP_SERVICE, LAP_DIRECT),
            laps.overhead(LAP_MCP, LAP_SERVICE),
            laps.overhead(LAP_PLAIN_POST, LAP_SERVICE),
            laps.overhead(LAP_MCP, LAP_PLAIN_POST)
        ),
    );
    let overhead = laps.overhead(LAP_MCP, LAP_SHELL);
    let shell = median(laps.column(LAP_SHELL));
    target(
        targets,
        "`run_command` through MCP over HTTP: time over the shell's own",
        format!("{overhead:.2} ms"),
        "≤ 2 ms",
        format!(
            "{overhead:.2} ms over a {shell:.2} ms shell ({:.2}x it; median of {} paired calls); without rmcp's client (a plain JSON-RPC POST): {:.2} ms",
            (overhead + shell) / shell,
            laps.0.len(),
            laps.overhead(LAP_PLAIN_POST, LAP_SHELL)
        ),
        overhead <= 2.0,
    );

    // Refill at rest: take the whole pool and time it coming back.
    let live = id.clone();
    let take_pool = || async {
        wait_pool(pool_target).await?;
        let mut taken = Vec::new();
        for _ in 0..pool_target {
            taken.push(sandbox_id(&create().await?)?);
        }
        anyhow::Ok(taken)
    };
    let taken = take_pool().await?;
    let refill_s = wait_pool(pool_target).await? / pool_target as f64;
    for t in taken {
        destroy(t).await?;
    }
    row(
        rows,
        format!("pool refill at rest, per VM ({pool_target} VMs)"),
        format!("{:.0} ms", refill_s * 1000.0),
    );
    // Again, with a live sandbox running commands back to back meanwhile:
    // its commands against the same at rest; the refill gives way to them.
    // The host's speed drifts within minutes, so each refill round comes
    // right after a block of the same commands at rest, and the ratio is
    // taken over the rounds.
    let run_true = || async {
        let t = Instant::now();
        call(
            "run_command",
            serde_json::json!({"sandbox_id": live, "command": "true"}),
        )
        .await?;
        anyhow::Ok(t.elapsed().as_secs_f64() * 1000.0)
    };
    let (mut at_rest, mut during, mut refill_secs) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..REFILL_ROUNDS {
        wait_pool(pool_target).await?;
        for _ in 0..REST_CALLS_PER_ROUND {
            at_rest.push(run_true().await?);
        }
        let taken = take_pool().await?;
        let refill_start = Instant::now();
        while svc.warm_count(&a.size) < pool_target {
            during.push(run_true().await?);
            anyhow::ensure!(
                refill_start.elapsed() < Duration::from_secs(300),
                "the pool did not refill"
            );
        }
        refill_secs.push(refill_start.elapsed().as_secs_f64() / pool_target as f64);
        for t in taken {
            destroy(t).await?;
        }
    }
    if !during.is_empty() {
        row(
            rows,
            format!(
                "live sandbox's `run_command` during a refill ({REFILL_ROUNDS} refills, {} calls back to back; {} at rest just before each)",
                during.len(),
                at_rest.len()
            ),
            format!(
                "{:.2} ms ({:.2}x at rest, {:.2} ms; p90 {:.2} ms; the refill took {:.1} s per VM meanwhile)",
                median(during.clone()),
                median(during.clone()) / median(at_rest.clone()),
                median(at_rest.clone()),
                percentile(&during, 0.9),
                median(refill_secs)
            ),
        );
    }

    // Empty pool: creates restore (or boot) on demand.
    svc.set_pool_paused(true).await;
    let mut empty = Vec::new();
    for _ in 0..a.mcp_creates.min(20) {
        let t = Instant::now();
        let v = create().await?;
        empty.push(t.elapsed().as_secs_f64() * 1000.0);
        destroy(sandbox_id(&v)?).await?;
    }
    let (empty_med, empty_max) = median_max(&empty);
    row(
        rows,
        format!("MCP `create_sandbox`, empty pool ({} calls): median / max", empty.len()),
        format!(
            "{empty_med:.0} ms / {empty_max:.0} ms ({:.1}x max/median; runtime restore alone {:.0} ms)",
            empty_max / empty_med,
            restore_s * 1000.0
        ),
    );

    // Bursts: `a.burst` agents at once, each creating a sandbox and running
    // its first command. First against the pool as configured, which then
    // learns the burst's size; then again once it has refilled to it.
    svc.set_pool_paused(false).await;
    wait_pool(pool_target).await?;
    let burst = |label: &'static str| {
        let (create, call) = (&create, &call);
        async move {
            let t = Instant::now();
            let agents: Vec<_> = (0..a.burst)
                .map(|_| async move {
                    let v = create().await?;
                    let created = t.elapsed().as_secs_f64() * 1000.0;
                    let id = sandbox_id(&v)?;
                    call(
                        "run_command",
                        serde_json::json!({"sandbox_id": id, "command": "true"}),
                    )
                    .await?;
                    anyhow::Ok((id, created, t.elapsed().as_secs_f64()))
                })
                .collect();
            let mut b = Burst::default();
            for r in futures::future::join_all(agents).await {
                match r {
                    Ok((id, created, done)) => {
                        b.creates_ms.push(created);
                        b.last_s = b.last_s.max(done);
                        b.ids.push(id);
                    }
                    Err(e) => {
                        eprintln!("{label} burst: {e:#}");
                        b.errors += 1;
                    }
                }
            }
            b
        }
    };
    let first = burst("first").await;
    for id in first.ids.clone() {
        destroy(id).await?;
    }
    let learned = svc.pool_target(&a.size);
    wait_pool(learned).await?;
    let again = burst("second").await;
    for id in again.ids.clone() {
        destroy(id).await?;
    }
    for (b, when) in [
        (&first, format!("the pool at its configured {pool_target}")),
        (
            &again,
            format!("the pool grown to {learned} after the first"),
        ),
    ] {
        row(
            rows,
            format!(
                "{} agents at once, each `create_sandbox` then `run_command(\"true\")` ({when})",
                a.burst
            ),
            b.describe(cold_s),
        );
    }
    let judged = again.last_s / cold_s;
    target(
        targets,
        format!(
            "a burst of {} creates, each followed by its first command (the pool having learned the burst)",
            a.burst
        ),
        again.describe(cold_s),
        "≤ 3 s and ≤ 0.7x a cold boot, no error",
        format!("{judged:.2}x a cold boot ({:.2} s)", cold_s),
        again.last_s <= 3.0 && judged <= 0.7 && again.errors == 0,
    );

    // Density: many idle sandboxes, their cost, and a warm create among them.
    let started = Instant::now();
    let mut idle_ids = Vec::new();
    // A host that refuses before `a.idle` (admission) is measured with
    // what it took, and the refusal is reported.
    let mut refused = None;
    let mut admission = Admission::default();
    // What sleeping sandboxes' saves take: their device state in `saves`,
    // the memory and disk they changed as frozen layers in `layers`.
    let save_dirs = ["saves", "layers"].map(|d| settings.runtime.data_dir.join(d));
    let saved_bytes = || save_dirs.iter().map(|d| allocated_bytes(d)).sum::<u64>();
    let saved_before = saved_bytes();
    // A restore that failed fell back to a cold boot: its VM has no
    // template (read at once: a sandbox asleep later has no VM).
    let mut cold_fallbacks = 0;
    for _ in 0..a.idle {
        match create_admitted(&create_idle, &svc, idle_ids.len(), &mut admission).await {
            Ok(v) => {
                let id = sandbox_id(&v)?;
                let record = svc.vm_record(&id);
                if record.is_none_or(|r| r.template.is_none()) {
                    cold_fallbacks += 1;
                }
                idle_ids.push(id);
            }
            Err(e) => {
                refused = Some(e);
                break;
            }
        }
    }
    let fill_secs = started.elapsed().as_secs_f64();
    if let Some(at) = admission.first_refused_at {
        row(
            rows,
            "idle sandboxes: the host's first refusal (admission), retried as `Retry-After` says",
            format!(
                "at {at} alive; {} refusals retried, {:.0} s waited in all",
                admission.retries,
                admission.waited.as_secs_f64()
            ),
        );
    }
    if let Some(e) = &refused {
        let capacity = svc.service_info().await?.capacity;
        row(
            rows,
            format!(
                "the host refused idle sandbox {} of {}",
                idle_ids.len() + 1,
                a.idle
            ),
            format!(
                "{e:#}; VMs alive {} (the pool's included); capacity then: {}",
                svc.vms_on_host().len(),
                serde_json::to_string(&capacity)?
            ),
        );
    }
    let n = idle_ids.len();
    tokio::time::sleep(Duration::from_secs(5)).await;
    let asleep = match a.idle_pause {
        Some(secs) => Some(slept(&svc, &idle_ids, Duration::from_secs(secs + 120)).await?),
        None => None,
    };
    let records: Vec<_> = idle_ids.iter().filter_map(|id| svc.vm_record(id)).collect();
    let IdleCost {
        pss,
        cpu,
        ksmd,
        ksm,
    } = idle_cost(&records, n, Duration::from_secs(10)).await;
    if let Some((asleep, took)) = asleep {
        let disk = saved_bytes().saturating_sub(saved_before);
        row(
            rows,
            format!("{n} idle sandboxes asleep (`--idle-pause`)"),
            format!(
                "{asleep} of {n} paused {:.0} s after the last was created; their saves take {:.2} MiB of disk each",
                took.as_secs_f64(),
                disk as f64 / 1024.0 / 1024.0 / n.max(1) as f64
            ),
        );
        let mut woken = Vec::new();
        for id in idle_ids.iter().take(10) {
            let t = Instant::now();
            call(
                "run_command",
                serde_json::json!({"sandbox_id": id, "command": "true"}),
            )
            .await?;
            woken.push(t.elapsed().as_secs_f64() * 1000.0);
        }
        let (woken_med, woken_max) = median_max(&woken);
        row(
            rows,
            format!(
                "MCP `run_command(\"true\")` in a sandbox asleep ({} calls: the resume, then the command)",
                woken.len()
            ),
            format!(
                "{woken_med:.0} ms median, {woken_max:.0} ms max ({:.2}x a template restore)",
                woken_med / 1000.0 / restore_s
            ),
        );
    }
    row(
        rows,
        format!(
            "{} idle sandboxes, created one after another in {fill_secs:.0} s",
            n
        ),
        format!(
            "{} restores fell back to a cold boot, {} of {} VMs running",
            cold_fallbacks,
            records.len(),
            n
        ),
    );
    row(
        rows,
        format!("{} idle sandboxes: host PSS per sandbox ({ksm})", n),
        format!("{pss:.1} MiB"),
    );
    row(
        rows,
        format!(
            "{} idle sandboxes: host CPU per sandbox, KSM's daemon included (10 s)",
            n
        ),
        format!("{cpu:.2} % of one core (KSM's daemon alone: {ksmd:.1} % of one core)"),
    );
    // A full host first gets room back for the pool and these creates.
    if refused.is_some() {
        for id in idle_ids.split_off(idle_ids.len().saturating_sub(20)) {
            destroy(id).await?;
        }
    }
    let mut crowded = Vec::new();
    for _ in 0..a.mcp_creates.min(10) {
        wait_pool(pool_target).await?;
        let t = Instant::now();
        let v = create().await?;
        crowded.push(t.elapsed().as_secs_f64() * 1000.0);
        destroy(sandbox_id(&v)?).await?;
    }
    let crowded_med = median(crowded.clone());
    row(
        rows,
        format!(
            "MCP `create_sandbox`, warm pool, {} idle sandboxes alive ({} calls)",
            n,
            crowded.len()
        ),
        format!(
            "{crowded_med:.1} ms ({:.2}x an idle host)",
            crowded_med / warm_med
        ),
    );
    let how = if a.idle_pause.is_some() {
        " (asleep: `--idle-pause`)"
    } else {
        " (running)"
    };
    target(
        targets,
        format!("{n} idle sandboxes{how}: host memory (PSS) per sandbox"),
        format!("{pss:.1} MiB"),
        "≤ 25 MiB",
        format!("{:.2}x the target", pss / 25.0),
        pss <= 25.0,
    );
    target(
        targets,
        format!("{n} idle sandboxes{how}: host CPU per sandbox"),
        format!("{cpu:.2} % of one core"),
        "≤ 0.2 %",
        format!("{:.2}x the target", cpu / 0.2),
        cpu <= 0.2,
    );
    target(
        targets,
        format!("warm-pool `create_sandbox` with {n} idle sandboxes alive"),
        format!("{crowded_med:.1} ms"),
        "≤ 2x an idle host",
        format!(
            "{:.2}x an idle host ({warm_med:.1} ms)",
            crowded_med / warm_med
        ),
        crowded_med / warm_med <= 2.0,
    );
    target(
        targets,
        format!("restores that failed on the way to {n} idle sandboxes"),
        format!("{cold_fallbacks}"),
        "0",
        format!("{cold_fallbacks} of {n} fell back to a cold boot"),
        cold_fallbacks == 0,
    );
    if a.fill && refused.is_none() {
        // On until the host says no: how many fit, and what ran out.
        let mut more = Vec::new();
        let mut admission = Admission::default();
        let refusal = loop {
            match create_admitted(&create_idle, &svc, n + more.len(), &mut admission).await {
                Ok(v) => more.push(sandbox_id(&v)?),
                Err(e) => break e,
            }
        };
        let capacity = svc.service_info().await?.capacity;
        let limit = capacity
            .as_ref()
            .and_then(|c| c.limited_by)
            .map_or("none (the create failed otherwise)".to_string(), |l| {
                format!("{l:?}").to_lowercase()
            });
        row(
            rows,
            format!(
                "sandboxes alive when the host refused one more (`--fill`; each refusal retried for {} s)",
                ADMISSION_PATIENCE.as_secs()
            ),
            format!(
                "{} (first refused at {}; limit: {limit}; the refusal: {refusal:#}; capacity then: {})",
                n + more.len(),
                admission.first_refused_at.map_or("-".to_string(), |at| at.to_string()),
                serde_json::to_string(&capacity)?
            ),
        );
        for id in more {
            destroy(id).await?;
        }
    }
    for id in idle_ids {
        destroy(id).await?;
    }

    // Preview URL vs. the same server reached from inside the guest.
    let http = reqwest::Client::new();
    let p = preview(&http, &url, &key, &live, (a.execs * 2).max(40)).await?;
    // The in-guest client is emulated too (TCG here), so on this machine
    // it can be slower than the native client going through the proxy.
    row(
        rows,
        format!("preview URL: GET 1 KiB, sequential ({} runs)", p.n),
        format!(
            "{:.2} ms (client in the guest: {:.2} ms; added {:+.2} ms; ratio {:.2})",
            p.url_ms,
            p.guest_ms,
            p.url_ms - p.guest_ms,
            p.url_ms / p.guest_ms
        ),
    );
    row(
        rows,
        format!(
            "preview URL: requests/s, {PREVIEW_CONCURRENCY} concurrent ({} requests)",
            p.n / PREVIEW_CONCURRENCY * PREVIEW_CONCURRENCY
        ),
        format!(
            "{:.0}/s (client in the guest: {:.0}/s; ratio {:.2})",
            p.url_rps,
            p.guest_rps,
            p.url_rps / p.guest_rps
        ),
    );
    destroy(live).await?;
    let _ = client.cancel().await;
    svc.shutdown().await;
    server.abort();
    Ok(())
}

/// A client loop run inside the guest against the same server: N
/// sequential requests (median latency), then N spread over `C` threads
/// (requests per second). Prints JSON.
const GUEST_CLIENT: &str = r#"
import http.client, json, statistics, sys, threading, time
N, C = int(sys.argv[1]), int(sys.argv[2])
def one():
    t = time.perf_counter()
    c = http.client.HTTPConnection("127.0.0.1", 8000)
    c.request("GET", "/bench.txt"); r = c.getresponse(); r.read(); c.close()
    assert r.status == 200
    return time.perf_counter() - t
one()
lat = [one() for _ in range(N)]
def worker():
    for _ in range(N // C): one()
ts = [threading.Thread(target=worker) for _ in range(C)]
t = time.perf_counter()
for x in ts: x.start()
for x in ts: x.join()
print(json.dumps({"median_ms": statistics.median(lat) * 1000, "rps": (N // C * C) / (time.perf_counter() - t)}))
"#;

/// Concurrent clients in the requests-per-second figures.
const PREVIEW_CONCURRENCY: usize = 8;

/// Through the preview URL vs. from inside the guest, same server (Python's
/// `http.server`, a 1 KiB file): (median ms, requests/s) for each.
struct PreviewFigures {
    n: usize,
    url_ms: f64,
    url_rps: f64,
    guest_ms: f64,
    guest_rps: f64,
}

async fn preview(
    http: &reqwest::Client,
    url: &str,
    key: &str,
    id: &str,
    n: usize,
) -> Result<PreviewFigures> {
    let exec = |command: String| {
        let req = http
            .post(format!("{url}/v1/sandboxes/{id}/exec"))
            .bearer_auth(key)
            .json(&serde_json::json!({"command": command, "timeout_ms": 600_000}));
        async move {
            let v: serde_json::Value = req.send().await?.json().await?;
            anyhow::ensure!(v["exit_code"] == 0, "in the guest: {v}");
            anyhow::Ok(v["stdout"].as_str().unwrap_or_default().to_string())
        }
    };
    exec(format!(
        "mkdir -p /workspace/bench && cd /workspace/bench && head -c 1024 /dev/zero | tr '\\0' x > bench.txt \
         && cat > client.py <<'EOF'\n{GUEST_CLIENT}\nEOF\n\
         (nohup python3 -m http.server 8000 > /tmp/bench-http.log 2>&1 &)"
    ))
    .await?;
    let p: serde_json::Value = http
        .post(format!("{url}/v1/sandboxes/{id}/ports"))
        .bearer_auth(key)
        .json(&serde_json::json!({"port": 8000}))
        .send()
        .await?
        .json()
        .await?;
    let preview = format!("{}/bench.txt", p["url"].as_str().unwrap_or_default());
    // The preview host resolves to this server, as `*.localhost` does in a browser.
    let host = preview
        .trim_start_matches("http://")
        .split(':')
        .next()
        .unwrap_or_default()
        .to_string();
    let addr: std::net::SocketAddr = url.trim_start_matches("http://").parse()?;
    let client = reqwest::Client::builder().resolve(&host, addr).build()?;
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let r = client.get(&preview).send().await?;
        if r.status() == 200 {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the preview URL never answered: {}",
            r.status()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let mut lat = Vec::new();
    for _ in 0..n {
        let t = Instant::now();
        let r = client.get(&preview).send().await?;
        anyhow::ensure!(r.status() == 200, "preview GET: {}", r.status());
        r.bytes().await?;
        lat.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    let per = n / PREVIEW_CONCURRENCY;
    let t = Instant::now();
    let tasks: Vec<_> = (0..PREVIEW_CONCURRENCY)
        .map(|_| {
            let (client, preview) = (client.clone(), preview.clone());
            tokio::spawn(async move {
                for _ in 0..per {
                    let r = client.get(&preview).send().await?;
                    anyhow::ensure!(r.status() == 200, "preview GET: {}", r.status());
                    r.bytes().await?;
                }
                anyhow::Ok(())
            })
        })
        .collect();
    for task in tasks {
        task.await??;
    }
    let url_rps = (per * PREVIEW_CONCURRENCY) as f64 / t.elapsed().as_secs_f64();
    let out = exec(format!(
        "python3 /workspace/bench/client.py {n} {PREVIEW_CONCURRENCY}"
    ))
    .await?;
    let g: serde_json::Value = serde_json::from_str(out.trim())?;
    Ok(PreviewFigures {
        n,
        url_ms: median(lat),
        url_rps,
        guest_ms: g["median_ms"].as_f64().unwrap_or(f64::NAN),
        guest_rps: g["rps"].as_f64().unwrap_or(f64::NAN),
    })
}
