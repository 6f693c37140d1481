//! The control plane's figures, against one server this process runs on
//! this machine and drives over the loopback as an agent would: creates
//! from a full warm pool, an empty one and in bursts; a command's round
//! trip over MCP split by layer; the pool's refill at rest and beside a
//! busy sandbox; many idle sandboxes (their memory, their sleep); preview
//! URLs against the same server reached from inside the guest.

use super::*;
use crate::preview::{preview, PREVIEW_CONCURRENCY};
use rmcp::model::CallToolRequestParams;
use rmcp::service::RunningService;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::{RoleClient, ServiceExt};
use std::sync::Arc;

mod e2b;
mod templates;

/// What the runtime's own figures gave, for the ratios the control
/// plane's rows are judged by.
pub(crate) struct Baseline {
    /// A direct agent exec of `true`, ms.
    pub(crate) exec_ms: f64,
    /// A cold boot to first command, s.
    pub(crate) cold_s: f64,
    /// A template restore to first command, s.
    pub(crate) restore_s: f64,
}

/// The rows and targets the phases add to.
pub(crate) struct Report<'r> {
    pub(crate) rows: &'r mut Vec<Row>,
    pub(crate) targets: &'r mut Vec<Target>,
}

/// The server in this process (store in a scratch file, VMs in the data
/// directory, a warm pool as configured), driven over loopback by rmcp's
/// client, as an agent would: each measurement is one phase below, run in
/// this order because later ones use what earlier ones left (the live
/// sandbox, the warm create's median).
pub(crate) async fn control_plane(
    settings: &Settings,
    a: &BenchArgs,
    report: Report<'_>,
    base: Baseline,
) -> Result<()> {
    let bench = Bench::start(settings, a).await?;
    let result = bench.run(report, &base).await;
    bench.stop().await;
    result
}

/// One in-process server and the client that drives it.
struct Bench<'a> {
    settings: &'a Settings,
    a: &'a BenchArgs,
    svc: Arc<sandpit_core::Service>,
    vms: Arc<sandpit_host::local::LocalVms>,
    key: String,
    /// `http://127.0.0.1:{port}`.
    url: String,
    client: RunningService<RoleClient, ()>,
    server: tokio::task::JoinHandle<anyhow::Result<()>>,
    /// The warm pool's size for `a.size` (at least one).
    pool_target: usize,
    /// Holds the store's file for as long as the service has it open.
    _scratch: tempfile::TempDir,
}

impl<'a> Bench<'a> {
    async fn start(settings: &'a Settings, a: &'a BenchArgs) -> Result<Bench<'a>> {
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
        let e2b = sandpit_e2b::E2b {
            api: api.clone(),
            domain: service.preview_domain.clone(),
            public_url: url.clone(),
            default_size: api.service_info().await?.default_size,
            max_body_bytes: sandpit_api::RestConfig::default().max_body_bytes,
            watchers: Default::default(),
        };
        let app = sandpit_api::router(api.clone(), sandpit_api::RestConfig::default())
            .nest_service(
                "/v1/mcp",
                sandpit_mcp::http_service(api, sandpit_mcp::HttpConfig::default()),
            )
            .nest_service("/e2b", sandpit_e2b::control_plane(e2b.clone()));
        let front = Arc::new(sandpit_server::front::Front {
            api: app,
            e2b_data: sandpit_e2b::data_plane(e2b),
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
        Ok(Bench {
            settings,
            a,
            svc,
            vms,
            key,
            url,
            client,
            server,
            pool_target,
            _scratch: scratch,
        })
    }

    async fn stop(self) {
        let _ = self.client.cancel().await;
        self.svc.shutdown().await;
        self.server.abort();
        // `_scratch` (the store's file) goes last.
    }

    /// Every phase, in order; the live sandbox is destroyed at the end.
    async fn run(&self, mut report: Report<'_>, base: &Baseline) -> Result<()> {
        self.wait_pool(self.pool_target).await?;
        let warm_med = self.warm_creates(&mut report, base).await?;
        let live = self.sandbox_id(&self.create().await?)?;
        self.wait_pool(self.pool_target).await?;
        self.round_trip(&live, &mut report, base).await?;
        self.e2b_figures(&live, &mut report).await?;
        self.template_figures(&mut report).await?;
        self.refill(&live, &mut report).await?;
        self.empty_pool(&mut report, base).await?;
        self.bursts(&mut report, base).await?;
        self.idle_crowd(&mut report, base, warm_med).await?;
        self.preview_figures(&live, &mut report).await?;
        self.destroy(live).await?;
        Ok(())
    }

    /// One MCP tool call; a tool error is an error.
    async fn call(&self, name: &'static str, v: serde_json::Value) -> Result<serde_json::Value> {
        let params = CallToolRequestParams::new(name)
            .with_arguments(v.as_object().cloned().unwrap_or_default());
        let r = self.client.call_tool(params).await?;
        anyhow::ensure!(r.is_error != Some(true), "{name} failed: {r:?}");
        Ok(r.structured_content.clone().unwrap_or_default())
    }

    async fn create(&self) -> Result<serde_json::Value> {
        self.call("create_sandbox", serde_json::json!({"size": self.a.size}))
            .await
    }

    /// The idle crowd outlives its own filling (15 minutes, the default
    /// lifetime, is too short for 500 on a host that makes them wait).
    async fn create_idle(&self) -> Result<serde_json::Value> {
        self.call(
            "create_sandbox",
            serde_json::json!({"size": self.a.size, "timeout_minutes": IDLE_LIFETIME_MINUTES}),
        )
        .await
    }

    async fn destroy(&self, id: String) -> Result<serde_json::Value> {
        self.call("destroy_sandbox", serde_json::json!({"sandbox_id": id}))
            .await
    }

    async fn run_true(&self, id: &str) -> Result<serde_json::Value> {
        self.call(
            "run_command",
            serde_json::json!({"sandbox_id": id, "command": "true"}),
        )
        .await
    }

    /// `run_true`'s round trip, ms.
    async fn time_true(&self, id: &str) -> Result<f64> {
        let t = Instant::now();
        self.run_true(id).await?;
        Ok(t.elapsed().as_secs_f64() * 1000.0)
    }

    /// Until the warm pool holds `n` (at most 300 s): how long it took, s.
    async fn wait_pool(&self, n: usize) -> Result<f64> {
        let t = Instant::now();
        while self.svc.warm_count(&self.a.size) < n {
            anyhow::ensure!(
                t.elapsed() < Duration::from_secs(300),
                "the pool did not fill"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(t.elapsed().as_secs_f64())
    }

    fn sandbox_id(&self, v: &serde_json::Value) -> Result<String> {
        v.get("id")
            .or_else(|| v.get("sandbox_id"))
            .and_then(|i| i.as_str())
            .map(str::to_string)
            .ok_or_else(|| anyhow::anyhow!("create_sandbox returned no id: {v}"))
    }

    /// Creates with a full warm pool, each followed by its first command:
    /// the create's median, ms.
    async fn warm_creates(&self, report: &mut Report<'_>, base: &Baseline) -> Result<f64> {
        let mut warm = Vec::new();
        let mut first_cmd = Vec::new();
        for _ in 0..self.a.mcp_creates {
            self.wait_pool(self.pool_target).await?;
            let t = Instant::now();
            let v = self.create().await?;
            warm.push(t.elapsed().as_secs_f64() * 1000.0);
            let id = self.sandbox_id(&v)?;
            self.run_true(&id).await?;
            first_cmd.push(t.elapsed().as_secs_f64() * 1000.0);
            self.destroy(id).await?;
        }
        let (warm_med, warm_max) = median_max(&warm);
        let warm_p99 = percentile(&warm, 0.99);
        row(
            report.rows,
            format!(
                "MCP `create_sandbox`, warm pool ({} calls): median / p99 / max",
                warm.len()
            ),
            format!(
                "{warm_med:.1} ms / {warm_p99:.1} ms / {warm_max:.1} ms ({:.1}x p99/median; {:.0}x faster than a cold boot)",
                warm_p99 / warm_med,
                base.cold_s * 1000.0 / warm_med
            ),
        );
        row(
            report.rows,
            "MCP `create_sandbox` + first `run_command`, warm pool",
            format!("{:.1} ms", median(first_cmd)),
        );
        Ok(warm_med)
    }

    /// MCP command round trip, at rest, split by layer.
    async fn round_trip(&self, id: &str, report: &mut Report<'_>, base: &Baseline) -> Result<()> {
        // Warmed up as the direct execs are: the first command in a sandbox
        // is measured by `warm_creates`.
        for _ in 0..3 {
            self.run_true(id).await?;
        }
        // MCP, the service alone (store records, no HTTP or MCP) and the
        // agent alone, interleaved call by call on one sandbox: the host's
        // speed drifts over minutes, so each layer's cost is the median of
        // paired differences. The same `tools/call` is also sent as one
        // plain JSON-RPC POST (a kept connection, no SDK), which tells the
        // server's part of HTTP and MCP from what rmcp's client adds on its
        // side.
        let caller = self.svc.authenticate(&self.key).await?;
        let agent = self.vms.agent(id).await?;
        let plain = reqwest::Client::new();
        let mcp_url = format!("{}/v1/mcp", self.url);
        let plain_call = serde_json::json!({
            "jsonrpc": "2.0",
            "id": 1,
            "method": "tools/call",
            "params": {"name": "run_command", "arguments": {"sandbox_id": id, "command": "true"}},
        });
        let mut laps = Laps::default();
        for _ in 0..self.a.execs {
            let t = Instant::now();
            let v = self.run_true(id).await?;
            let mcp = t.elapsed().as_secs_f64() * 1000.0;
            let t = Instant::now();
            let answer: serde_json::Value = plain
                .post(&mcp_url)
                .bearer_auth(&self.key)
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
            let e = self.svc.exec(&caller, id, params).await?;
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
            report.rows,
            format!(
                "MCP `run_command(\"true\")` round trip ({} calls)",
                laps.0.len()
            ),
            format!(
                "{run_ms:.2} ms ({:.2}x a direct agent exec; the shell itself, timed by the agent: {:.0} ms; the service API without HTTP: {:.2} ms, shell {:.0} ms)",
                run_ms / base.exec_ms,
                median(laps.column(LAP_MCP_SHELL)),
                median(laps.column(LAP_SERVICE)),
                median(laps.column(LAP_SERVICE_SHELL))
            ),
        );
        row(
            report.rows,
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
            report.targets,
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
        Ok(())
    }

    /// Creates the whole warm pool away, once it is full: their ids.
    async fn take_pool(&self) -> Result<Vec<String>> {
        self.wait_pool(self.pool_target).await?;
        let mut taken = Vec::new();
        for _ in 0..self.pool_target {
            taken.push(self.sandbox_id(&self.create().await?)?);
        }
        Ok(taken)
    }

    /// The pool's refill at rest, then beside a live sandbox running
    /// commands back to back.
    async fn refill(&self, live: &str, report: &mut Report<'_>) -> Result<()> {
        let pool_target = self.pool_target;
        let taken = self.take_pool().await?;
        let refill_s = self.wait_pool(pool_target).await? / pool_target as f64;
        for t in taken {
            self.destroy(t).await?;
        }
        row(
            report.rows,
            format!("pool refill at rest, per VM ({pool_target} VMs)"),
            format!("{:.0} ms", refill_s * 1000.0),
        );
        // Again, with a live sandbox running commands back to back
        // meanwhile: its commands against the same at rest; the refill
        // gives way to them. The host's speed drifts within minutes, so each
        // refill round comes right after a block of the same commands at
        // rest, and the ratio is taken over the rounds.
        let (mut at_rest, mut during, mut refill_secs) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..REFILL_ROUNDS {
            self.wait_pool(pool_target).await?;
            for _ in 0..REST_CALLS_PER_ROUND {
                at_rest.push(self.time_true(live).await?);
            }
            let taken = self.take_pool().await?;
            let refill_start = Instant::now();
            while self.svc.warm_count(&self.a.size) < pool_target {
                during.push(self.time_true(live).await?);
                anyhow::ensure!(
                    refill_start.elapsed() < Duration::from_secs(300),
                    "the pool did not refill"
                );
            }
            refill_secs.push(refill_start.elapsed().as_secs_f64() / pool_target as f64);
            for t in taken {
                self.destroy(t).await?;
            }
        }
        if !during.is_empty() {
            row(
                report.rows,
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
        Ok(())
    }

    /// Creates with the pool paused: each restores (or boots) on demand.
    async fn empty_pool(&self, report: &mut Report<'_>, base: &Baseline) -> Result<()> {
        self.svc.set_pool_paused(true).await;
        let mut empty = Vec::new();
        for _ in 0..self.a.mcp_creates.min(20) {
            let t = Instant::now();
            let v = self.create().await?;
            empty.push(t.elapsed().as_secs_f64() * 1000.0);
            self.destroy(self.sandbox_id(&v)?).await?;
        }
        let (empty_med, empty_max) = median_max(&empty);
        row(
            report.rows,
            format!(
                "MCP `create_sandbox`, empty pool ({} calls): median / max",
                empty.len()
            ),
            format!(
                "{empty_med:.0} ms / {empty_max:.0} ms ({:.1}x max/median; runtime restore alone {:.0} ms)",
                empty_max / empty_med,
                base.restore_s * 1000.0
            ),
        );
        self.svc.set_pool_paused(false).await;
        Ok(())
    }

    /// `a.burst` agents at once, each creating a sandbox and running its
    /// first command. Their sandboxes are left alive.
    async fn burst(&self, label: &'static str) -> Burst {
        let t = Instant::now();
        let agents: Vec<_> = (0..self.a.burst)
            .map(|_| async move {
                let v = self.create().await?;
                let created = t.elapsed().as_secs_f64() * 1000.0;
                let id = self.sandbox_id(&v)?;
                self.run_true(&id).await?;
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

    /// Bursts: first against the pool as configured, which then learns the
    /// burst's size; then again once it has refilled to it.
    async fn bursts(&self, report: &mut Report<'_>, base: &Baseline) -> Result<()> {
        let (pool_target, cold_s) = (self.pool_target, base.cold_s);
        self.wait_pool(pool_target).await?;
        let first = self.burst("first").await;
        for id in first.ids.clone() {
            self.destroy(id).await?;
        }
        let learned = self.svc.pool_target(&self.a.size);
        self.wait_pool(learned).await?;
        let again = self.burst("second").await;
        for id in again.ids.clone() {
            self.destroy(id).await?;
        }
        for (b, when) in [
            (&first, format!("the pool at its configured {pool_target}")),
            (
                &again,
                format!("the pool grown to {learned} after the first"),
            ),
        ] {
            row(
                report.rows,
                format!(
                    "{} agents at once, each `create_sandbox` then `run_command(\"true\")` ({when})",
                    self.a.burst
                ),
                b.describe(cold_s),
            );
        }
        let judged = again.last_s / cold_s;
        target(
            report.targets,
            format!(
                "a burst of {} creates, each followed by its first command (the pool having learned the burst)",
                self.a.burst
            ),
            again.describe(cold_s),
            "≤ 3 s and ≤ 0.7x a cold boot, no error",
            format!("{judged:.2}x a cold boot ({:.2} s)", cold_s),
            again.last_s <= 3.0 && judged <= 0.7 && again.errors == 0,
        );
        Ok(())
    }

    /// Density: many idle sandboxes, their cost (asleep with
    /// `--idle-pause`), a warm create among them, and with `--fill` how many
    /// fit.
    async fn idle_crowd(
        &self,
        report: &mut Report<'_>,
        base: &Baseline,
        warm_med: f64,
    ) -> Result<()> {
        let crowd = self.fill_crowd(report).await?;
        let mut idle_ids = crowd.ids;
        let n = idle_ids.len();
        tokio::time::sleep(Duration::from_secs(5)).await;
        if let Some(secs) = self.a.idle_pause {
            self.asleep(&idle_ids, secs, crowd.saved_before, report, base)
                .await?;
        }
        let records: Vec<_> = idle_ids
            .iter()
            .filter_map(|id| self.svc.vm_record(id))
            .collect();
        let IdleCost {
            pss,
            cpu,
            ksmd,
            ksm,
        } = idle_cost(&records, n, Duration::from_secs(10)).await;
        row(
            report.rows,
            format!(
                "{} idle sandboxes, created one after another in {:.0} s",
                n, crowd.fill_secs
            ),
            format!(
                "{} restores fell back to a cold boot, {} of {} VMs running",
                crowd.cold_fallbacks,
                records.len(),
                n
            ),
        );
        row(
            report.rows,
            format!("{} idle sandboxes: host PSS per sandbox ({ksm})", n),
            format!("{pss:.1} MiB"),
        );
        row(
            report.rows,
            format!(
                "{} idle sandboxes: host CPU per sandbox, KSM's daemon included (10 s)",
                n
            ),
            format!("{cpu:.2} % of one core (KSM's daemon alone: {ksmd:.1} % of one core)"),
        );
        // A full host first gets room back for the pool and these creates.
        if crowd.refused {
            for id in idle_ids.split_off(idle_ids.len().saturating_sub(20)) {
                self.destroy(id).await?;
            }
        }
        let mut crowded = Vec::new();
        for _ in 0..self.a.mcp_creates.min(10) {
            self.wait_pool(self.pool_target).await?;
            let t = Instant::now();
            let v = self.create().await?;
            crowded.push(t.elapsed().as_secs_f64() * 1000.0);
            self.destroy(self.sandbox_id(&v)?).await?;
        }
        let crowded_med = median(crowded.clone());
        row(
            report.rows,
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
        let how = if self.a.idle_pause.is_some() {
            " (asleep: `--idle-pause`)"
        } else {
            " (running)"
        };
        target(
            report.targets,
            format!("{n} idle sandboxes{how}: host memory (PSS) per sandbox"),
            format!("{pss:.1} MiB"),
            "≤ 25 MiB",
            format!("{:.2}x the target", pss / 25.0),
            pss <= 25.0,
        );
        target(
            report.targets,
            format!("{n} idle sandboxes{how}: host CPU per sandbox"),
            format!("{cpu:.2} % of one core"),
            "≤ 0.2 %",
            format!("{:.2}x the target", cpu / 0.2),
            cpu <= 0.2,
        );
        target(
            report.targets,
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
            report.targets,
            format!("restores that failed on the way to {n} idle sandboxes"),
            format!("{}", crowd.cold_fallbacks),
            "0",
            format!("{} of {n} fell back to a cold boot", crowd.cold_fallbacks),
            crowd.cold_fallbacks == 0,
        );
        if self.a.fill && !crowd.refused {
            self.fill_host(n, report).await?;
        }
        for id in idle_ids {
            self.destroy(id).await?;
        }
        Ok(())
    }

    /// Creates the idle crowd, one after another. A host that refuses
    /// before `a.idle` (admission) is measured with what it took, and the
    /// refusal is reported.
    async fn fill_crowd(&self, report: &mut Report<'_>) -> Result<Crowd> {
        let started = Instant::now();
        let mut ids = Vec::new();
        let mut refused = None;
        let mut admission = Admission::default();
        let saved_before = self.saved_bytes();
        // A restore that failed fell back to a cold boot: its VM has no
        // template (read at once: a sandbox asleep later has no VM).
        let mut cold_fallbacks = 0;
        let create_idle = || self.create_idle();
        for _ in 0..self.a.idle {
            match create_admitted(&create_idle, &self.svc, ids.len(), &mut admission).await {
                Ok(v) => {
                    let id = self.sandbox_id(&v)?;
                    let record = self.svc.vm_record(&id);
                    if record.is_none_or(|r| r.template.is_none()) {
                        cold_fallbacks += 1;
                    }
                    ids.push(id);
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
                report.rows,
                "idle sandboxes: the host's first refusal (admission), retried as `Retry-After` says",
                format!(
                    "at {at} alive; {} refusals retried, {:.0} s waited in all",
                    admission.retries,
                    admission.waited.as_secs_f64()
                ),
            );
        }
        if let Some(e) = &refused {
            let capacity = self.svc.service_info().await?.capacity;
            row(
                report.rows,
                format!(
                    "the host refused idle sandbox {} of {}",
                    ids.len() + 1,
                    self.a.idle
                ),
                format!(
                    "{e:#}; VMs alive {} (the pool's included); capacity then: {}",
                    self.svc.vms_on_host().len(),
                    serde_json::to_string(&capacity)?
                ),
            );
        }
        Ok(Crowd {
            ids,
            refused: refused.is_some(),
            cold_fallbacks,
            fill_secs,
            saved_before,
        })
    }

    /// What sleeping sandboxes' saves take: their device state in `saves`,
    /// the memory and disk they changed as frozen layers in `layers`.
    fn saved_bytes(&self) -> u64 {
        ["saves", "layers"]
            .iter()
            .map(|d| allocated_bytes(&self.settings.runtime.data_dir.join(d)))
            .sum()
    }

    /// `--idle-pause`: the crowd asleep, what their saves take, and the
    /// first command in a sandbox asleep.
    async fn asleep(
        &self,
        ids: &[String],
        idle_pause_secs: u64,
        saved_before: u64,
        report: &mut Report<'_>,
        base: &Baseline,
    ) -> Result<()> {
        let n = ids.len();
        let (asleep, took) =
            slept(&self.svc, ids, Duration::from_secs(idle_pause_secs + 120)).await?;
        let disk = self.saved_bytes().saturating_sub(saved_before);
        row(
            report.rows,
            format!("{n} idle sandboxes asleep (`--idle-pause`)"),
            format!(
                "{asleep} of {n} paused {:.0} s after the last was created; their saves take {:.2} MiB of disk each",
                took.as_secs_f64(),
                disk as f64 / 1024.0 / 1024.0 / n.max(1) as f64
            ),
        );
        let mut woken = Vec::new();
        for id in ids.iter().take(10) {
            woken.push(self.time_true(id).await?);
        }
        let (woken_med, woken_max) = median_max(&woken);
        row(
            report.rows,
            format!(
                "MCP `run_command(\"true\")` in a sandbox asleep ({} calls: the resume, then the command)",
                woken.len()
            ),
            format!(
                "{woken_med:.0} ms median, {woken_max:.0} ms max ({:.2}x a template restore)",
                woken_med / 1000.0 / base.restore_s
            ),
        );
        Ok(())
    }

    /// `--fill`: on from `alive` sandboxes until the host says no: how many
    /// fit, and what ran out.
    async fn fill_host(&self, alive: usize, report: &mut Report<'_>) -> Result<()> {
        let mut more = Vec::new();
        let mut admission = Admission::default();
        let create_idle = || self.create_idle();
        let refusal = loop {
            match create_admitted(&create_idle, &self.svc, alive + more.len(), &mut admission).await
            {
                Ok(v) => more.push(self.sandbox_id(&v)?),
                Err(e) => break e,
            }
        };
        let capacity = self.svc.service_info().await?.capacity;
        let limit = capacity
            .as_ref()
            .and_then(|c| c.limited_by)
            .map_or("none (the create failed otherwise)".to_string(), |l| {
                format!("{l:?}").to_lowercase()
            });
        row(
            report.rows,
            format!(
                "sandboxes alive when the host refused one more (`--fill`; each refusal retried for {} s)",
                ADMISSION_PATIENCE.as_secs()
            ),
            format!(
                "{} (first refused at {}; limit: {limit}; the refusal: {refusal:#}; capacity then: {})",
                alive + more.len(),
                admission.first_refused_at.map_or("-".to_string(), |at| at.to_string()),
                serde_json::to_string(&capacity)?
            ),
        );
        for id in more {
            self.destroy(id).await?;
        }
        Ok(())
    }

    /// Preview URL vs. the same server reached from inside the guest.
    async fn preview_figures(&self, live: &str, report: &mut Report<'_>) -> Result<()> {
        let http = reqwest::Client::new();
        let p = preview(
            &http,
            &self.url,
            &self.key,
            live,
            (self.a.execs * 2).max(40),
        )
        .await?;
        // The in-guest client is emulated too (TCG here), so on this
        // machine it can be slower than the native client going through the
        // proxy.
        row(
            report.rows,
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
            report.rows,
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
        Ok(())
    }
}

/// The idle crowd as [`Bench::fill_crowd`] left it.
struct Crowd {
    ids: Vec<String>,
    /// The host refused one before `a.idle`.
    refused: bool,
    /// Restores that fell back to a cold boot.
    cold_fallbacks: usize,
    fill_secs: f64,
    /// [`Bench::saved_bytes`] before the crowd.
    saved_before: u64,
}
