//! E2B's API beside MCP, on the same server, pool and size: what an agent
//! written for E2B pays over one written for Sandpit's own MCP tools.
//!
//! The client here is the least an E2B client does, so the figures are the
//! server's: a create (`POST /e2b/sandboxes`) and envd's `Process/Start`
//! stream (Connect over JSON, as the SDKs speak it) on kept connections.
//! The SDKs add their own time on top (Python's HTTP client alone costs
//! more than these figures), which is theirs, not the server's.
//!
//! Three figures, each taken interleaved with its comparison so the host's
//! drift over minutes does not favour either: a create and its first
//! command against MCP's; a `true` round trip against a direct agent exec
//! of the same command (the service, the data plane's routing and the
//! stream's framing); and the first byte of a command's stdout, which an
//! SDK's `on_stdout` sees.

use super::*;
use anyhow::Context;
use futures::StreamExt;

/// envd's port, which the data plane's requests name.
const ENVD_PORT: &str = "49983";

/// A sandbox made through E2B's control plane.
struct E2bSandbox {
    id: String,
    token: String,
}

/// What one `Process/Start` stream gave, ms after its request went.
struct Streamed {
    /// The first stdout frame (`None`: the command wrote nothing).
    first_stdout_ms: Option<f64>,
    /// The end frame.
    end_ms: f64,
}

/// A kept-connection client of one server's E2B API.
struct Client {
    http: reqwest::Client,
    url: String,
    key: String,
    template: String,
}

impl Client {
    async fn create(&self) -> Result<E2bSandbox> {
        let made: serde_json::Value = self
            .http
            .post(format!("{}/e2b/sandboxes", self.url))
            .header("x-api-key", &self.key)
            .json(&serde_json::json!({"templateID": self.template, "timeout": 600}))
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?;
        let field = |name: &str| {
            made[name]
                .as_str()
                .map(str::to_string)
                .with_context(|| format!("E2B's create answered without {name}: {made}"))
        };
        Ok(E2bSandbox {
            id: field("sandboxID")?,
            token: field("envdAccessToken")?,
        })
    }

    async fn kill(&self, sandbox: &E2bSandbox) -> Result<()> {
        self.http
            .delete(format!("{}/e2b/sandboxes/{}", self.url, sandbox.id))
            .header("x-api-key", &self.key)
            .send()
            .await?
            .error_for_status()?;
        Ok(())
    }

    /// Runs `argv` through `Process/Start` and reads its stream to the
    /// end. (The SDKs' `commands.run(cmd)` sends `/bin/bash -l -c cmd`:
    /// a login shell's start in the guest, the same through any API, which
    /// would hide the server's part.)
    async fn run(&self, sandbox: &E2bSandbox, argv: &[&str]) -> Result<Streamed> {
        let cmd = argv.join(" ");
        let message = serde_json::to_vec(&serde_json::json!({
            "process": {"cmd": argv[0], "args": argv[1..], "envs": {}},
            "stdin": false,
        }))?;
        let mut body = Vec::with_capacity(5 + message.len());
        body.push(0);
        body.extend_from_slice(&(message.len() as u32).to_be_bytes());
        body.extend_from_slice(&message);
        let t = Instant::now();
        let answer = self
            .http
            .post(format!("{}/process.Process/Start", self.url))
            .header("e2b-sandbox-id", &sandbox.id)
            .header("e2b-sandbox-port", ENVD_PORT)
            .header("x-access-token", &sandbox.token)
            .header("content-type", "application/connect+json")
            .header("connect-protocol-version", "1")
            .body(body)
            .send()
            .await?
            .error_for_status()?;
        let mut stream = answer.bytes_stream();
        let mut pending = Vec::new();
        let mut first_stdout_ms = None;
        while let Some(piece) = stream.next().await {
            pending.extend_from_slice(&piece?);
            while pending.len() >= 5 {
                let len = u32::from_be_bytes(pending[1..5].try_into().expect("4 bytes")) as usize;
                if pending.len() < 5 + len {
                    break;
                }
                let flags = pending[0];
                let frame: serde_json::Value = serde_json::from_slice(&pending[5..5 + len])?;
                pending.drain(..5 + len);
                if flags & 0x02 != 0 {
                    anyhow::ensure!(
                        frame.get("error").is_none(),
                        "`{cmd}` through E2B's Process/Start failed: {frame}"
                    );
                    continue;
                }
                let event = &frame["event"];
                if first_stdout_ms.is_none() && event["data"]["stdout"].is_string() {
                    first_stdout_ms = Some(t.elapsed().as_secs_f64() * 1000.0);
                }
                if event["end"].is_object() {
                    anyhow::ensure!(
                        event["end"]["exitCode"].as_i64().unwrap_or(0) == 0,
                        "`{cmd}` through E2B exited: {frame}"
                    );
                    return Ok(Streamed {
                        first_stdout_ms,
                        end_ms: t.elapsed().as_secs_f64() * 1000.0,
                    });
                }
            }
        }
        anyhow::bail!("`{cmd}` through E2B: the stream ended without the command's end")
    }
}

impl Bench<'_> {
    /// E2B's figures (see the module's docs).
    pub(super) async fn e2b_figures(&self, report: &mut Report<'_>) -> Result<()> {
        let default_size = self.svc.config().default_size.clone();
        let client = Client {
            http: reqwest::Client::new(),
            url: self.url.clone(),
            key: sandpit_store::e2b_spelling(&self.key).context("the bench's key")?,
            template: match self.a.size == default_size {
                true => "base".into(),
                false => self.a.size.clone(),
            },
        };
        // A create and its first command, E2B's then MCP's, from a full
        // pool each time.
        let (mut e2b_first, mut mcp_first) = (Vec::new(), Vec::new());
        for _ in 0..self.a.mcp_creates.min(20) {
            self.wait_pool(self.pool_target).await?;
            let t = Instant::now();
            let sandbox = client.create().await?;
            client.run(&sandbox, &["true"]).await?;
            e2b_first.push(t.elapsed().as_secs_f64() * 1000.0);
            client.kill(&sandbox).await?;
            self.wait_pool(self.pool_target).await?;
            let t = Instant::now();
            let id = self.sandbox_id(&self.create().await?)?;
            self.run_true(&id).await?;
            mcp_first.push(t.elapsed().as_secs_f64() * 1000.0);
            self.destroy(id).await?;
        }
        let (e2b_med, mcp_med) = (median(e2b_first.clone()), median(mcp_first.clone()));
        target(
            report.targets,
            "E2B create + first command (`Process/Start`), warm pool, against MCP's",
            format!("{e2b_med:.1} ms (MCP {mcp_med:.1} ms)"),
            "≤ 1.3x MCP",
            format!(
                "{:.2}x MCP's create + first `run_command` (medians of {} interleaved pairs; p90 {:.1} ms against {:.1} ms)",
                e2b_med / mcp_med,
                e2b_first.len(),
                percentile(&e2b_first, 0.9),
                percentile(&mcp_first, 0.9)
            ),
            e2b_med <= 1.3 * mcp_med,
        );

        // `true`, and `echo`'s first byte, against the agent alone.
        let sandbox = client.create().await?;
        let agent = self.vms.agent(&sandbox.id).await?;
        for _ in 0..3 {
            client.run(&sandbox, &["true"]).await?;
        }
        let (mut over_direct, mut over_shell, mut first_byte, mut direct_round) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for _ in 0..self.a.execs {
            let e2b = client.run(&sandbox, &["true"]).await?.end_ms;
            let t = Instant::now();
            let out = agent.exec_collect(true_cmd()).await?;
            let direct = t.elapsed().as_secs_f64() * 1000.0;
            over_direct.push(e2b - direct);
            over_shell.push(e2b - shell_ms(&out.result));
            direct_round.push(direct);
            let echoed = client.run(&sandbox, &["echo", "x"]).await?;
            first_byte.push(
                echoed
                    .first_stdout_ms
                    .context("`echo x` through E2B wrote nothing")?,
            );
        }
        client.kill(&sandbox).await?;
        let overhead = median(over_direct.clone());
        target(
            report.targets,
            "E2B `Process/Start` of `true`, round trip: time over a direct agent exec",
            format!("{overhead:.2} ms"),
            "≤ 1.5 ms",
            format!(
                "median of {} paired calls over a {:.2} ms direct exec ({:.2}x it); over the shell's own time: {:.2} ms",
                over_direct.len(),
                median(direct_round.clone()),
                (overhead + median(direct_round.clone())) / median(direct_round.clone()),
                median(over_shell)
            ),
            overhead <= 1.5,
        );
        let first = median(first_byte.clone());
        target(
            report.targets,
            "E2B `Process/Start` of `echo x`: its first stdout byte at the client",
            format!("{first:.2} ms"),
            "≤ 20 ms",
            format!(
                "median of {} (p90 {:.2} ms); {:.2}x a whole direct agent exec of `true`",
                first_byte.len(),
                percentile(&first_byte, 0.9),
                first / median(direct_round)
            ),
            first <= 20.0,
        );
        Ok(())
    }
}
