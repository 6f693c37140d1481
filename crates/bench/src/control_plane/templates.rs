//! Templates on the same server: a sandbox from a template to its first
//! command against a sandbox restored from the size's standard snapshot
//! template (both through MCP's `create_sandbox` and `run_command`, the
//! pool paused so neither is a warm VM, interleaved: the host's speed
//! drifts), and a rebuild with only its last step changed against what the
//! step must cost anyway: a snapshot of the same VM plus the step's own
//! time in a sandbox of the template.

use super::*;
use anyhow::Context;
use sandpit_core::{BuildTemplate, Caller};

/// The bench's template: a page, then a step that does a few seconds of
/// work, which the rebuild changes; with a server for the page as its
/// start command when `serve`.
fn spec(last_step: &str, serve: bool) -> serde_json::Value {
    let mut spec = serde_json::json!({
        "steps": [
            {"type": "run", "command": "mkdir -p /srv/www && echo bench > /srv/www/index.html"},
            {"type": "run", "command": last_step},
        ],
    });
    if serve {
        spec["start"] = serde_json::json!({
            "command": "python3 -m http.server 8000 --directory /srv/www",
            "ready": "curl -fs http://127.0.0.1:8000/ >/dev/null",
        });
    }
    spec
}

/// The last step, tagged `n` so each rebuild changes it: a few seconds of
/// hashing (as a package's install is, under emulation).
fn work(n: usize) -> String {
    format!("head -c 150000000 /dev/zero | sha256sum > /tmp/work-{n}")
}

impl Bench<'_> {
    async fn caller(&self) -> Result<Caller> {
        let account = self
            .svc
            .store()
            .account_by_name("bench")
            .await?
            .context("the bench's account")?;
        Ok(Caller::new(account.id, "bench"))
    }

    /// Builds `spec` as template `name`; the seconds it took.
    async fn build(&self, caller: &Caller, name: &str, spec: serde_json::Value) -> Result<f64> {
        let t = Instant::now();
        let started = self
            .svc
            .build_template(
                caller,
                BuildTemplate {
                    name: name.into(),
                    size: Some(self.a.size.clone()),
                    spec: Some(spec),
                    ..BuildTemplate::default()
                },
            )
            .await?;
        loop {
            let b = self.svc.get_template(caller, &started.id).await?;
            match b.status.as_str() {
                "building" => tokio::time::sleep(Duration::from_millis(20)).await,
                "ready" => return Ok(t.elapsed().as_secs_f64()),
                _ => anyhow::bail!(
                    "the bench's template failed: {}\n{}",
                    b.error.unwrap_or_default(),
                    b.log.unwrap_or_default()
                ),
            }
        }
    }

    /// A create and its first command, ms.
    async fn create_and_first(&self, args: serde_json::Value) -> Result<f64> {
        let t = Instant::now();
        let v = self.call("create_sandbox", args).await?;
        let id = self.sandbox_id(&v)?;
        self.run_true(&id).await?;
        let ms = t.elapsed().as_secs_f64() * 1000.0;
        self.destroy(id).await?;
        Ok(ms)
    }

    pub(super) async fn template_figures(&self, report: &mut Report<'_>) -> Result<()> {
        let caller = self.caller().await?;
        let first_build = self.build(&caller, "bench", spec(&work(0), true)).await?;
        self.svc.set_pool_paused(true).await;
        let (mut from_template, mut standard) = (Vec::new(), Vec::new());
        for _ in 0..self.a.mcp_creates.clamp(3, 10) {
            standard.push(
                self.create_and_first(serde_json::json!({"size": self.a.size}))
                    .await?,
            );
            from_template.push(
                self.create_and_first(serde_json::json!({"template": "bench"}))
                    .await?,
            );
        }
        self.svc.set_pool_paused(false).await;
        let (tpl_med, _) = median_max(&from_template);
        let (std_med, _) = median_max(&standard);
        row(
            report.rows,
            format!(
                "MCP create + first command from a template / a standard restore ({} each, pool paused)",
                standard.len()
            ),
            format!("{tpl_med:.0} ms / {std_med:.0} ms"),
        );
        target(
            report.targets,
            "a sandbox from a template to its first command",
            format!("{tpl_med:.0} ms ({std_med:.0} ms standard)"),
            "≤ 1.5x a standard template restore",
            format!("{:.2}x", tpl_med / std_med),
            tpl_med <= 1.5 * std_med,
        );
        // A rebuild with the last step changed, against a snapshot of a
        // sandbox of the template plus the step run there; and the same
        // with a server to start and wait for after it.
        let (mut rebuilds, mut floors, mut served) = (Vec::new(), Vec::new(), Vec::new());
        self.build(&caller, "bench-plain", spec(&work(0), false))
            .await?;
        for n in 1..=3 {
            rebuilds.push(
                self.build(&caller, "bench-plain", spec(&work(n), false))
                    .await?,
            );
            served.push(self.build(&caller, "bench", spec(&work(n), true)).await?);
            let v = self
                .call("create_sandbox", serde_json::json!({"template": "bench"}))
                .await?;
            let id = self.sandbox_id(&v)?;
            let t = Instant::now();
            let ran = self
                .call(
                    "run_command",
                    serde_json::json!({"sandbox_id": id, "command": work(100 + n)}),
                )
                .await?;
            let step = t.elapsed().as_secs_f64();
            anyhow::ensure!(ran["exit_code"] == 0, "the step's work failed: {ran}");
            let t = Instant::now();
            let snap = self
                .call("snapshot_sandbox", serde_json::json!({"sandbox_id": id}))
                .await?;
            let save = t.elapsed().as_secs_f64();
            if let Some(snap) = snap["id"].as_str() {
                self.call("delete_snapshot", serde_json::json!({"snapshot_id": snap}))
                    .await?;
            }
            self.destroy(id).await?;
            floors.push(step + save);
        }
        // Where the last rebuild's time went, as its log says.
        let last = self.svc.get_template(&caller, "bench-plain").await?;
        let timings: Vec<String> = last
            .log
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains(" done in ") || l.contains("ready in"))
            .map(str::to_string)
            .collect();
        row(
            report.rows,
            "the last rebuild's log (no start command)",
            timings.join("; "),
        );
        let (rebuild_med, _) = median_max(&rebuilds);
        let (floor_med, _) = median_max(&floors);
        let (served_med, _) = median_max(&served);
        row(
            report.rows,
            "template build with a server to start: first (2 steps) / rebuild with the last step \
             changed (3)"
                .to_string(),
            format!("{first_build:.1} s / {served_med:.1} s"),
        );
        target(
            report.targets,
            "a rebuild with only its last step changed (no start command)",
            format!("{rebuild_med:.1} s ({floor_med:.1} s: the step and a snapshot)"),
            "≤ 2x a snapshot of the same VM plus the step's own time",
            format!("{:.2}x", rebuild_med / floor_med),
            rebuild_med <= 2.0 * floor_med,
        );
        Ok(())
    }
}
