//! E2B's API beside MCP, on the same server, pool and size: what an agent
//! written for E2B pays over one written for Sandpit's own MCP tools.
//!
//! Through E2B's Python SDK itself (run by `e2b_driver.py`, a step per
//! line, so each SDK call is timed beside the MCP call it is compared
//! with, interleaved: the host's speed drifts over minutes): a create and
//! its first command against MCP's (a target), a command's round trip
//! against MCP's `run_command`, and the first byte of a command's output
//! at the SDK's `on_stdout` (a target).
//!
//! And the path alone, through the least an E2B client does (envd's
//! `Process/Start` stream, Connect over JSON, on a kept connection, from
//! Rust like MCP's rmcp client): the SDKs' own command, `/bin/bash -l -c
//! true`, against MCP's `run_command("true")` (the round trip's target:
//! the SDK path's overhead over MCP's, client weight aside), a `true`
//! against a direct agent exec, and the first stdout frame.

use super::*;
use anyhow::Context;
use futures::StreamExt;
use std::path::Path;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout};

/// The SDK's side of the figures (see the module's docs).
const DRIVER: &str = include_str!("e2b_driver.py");

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

/// E2B's Python SDK in a child process, one step at a time.
struct Driver {
    child: Child,
    stdin: ChildStdin,
    answers: Lines<BufReader<ChildStdout>>,
    /// Holds the driver's script for as long as it runs.
    _script: tempfile::NamedTempFile,
}

impl Driver {
    fn start(python: &Path, client: &Client) -> Result<Driver> {
        let mut script = tempfile::Builder::new().suffix(".py").tempfile()?;
        std::io::Write::write_all(&mut script, DRIVER.as_bytes())?;
        let mut child = tokio::process::Command::new(python)
            .arg(script.path())
            .arg(&client.template)
            .env("E2B_API_URL", format!("{}/e2b", client.url))
            .env("E2B_SANDBOX_URL", &client.url)
            .env("E2B_API_KEY", &client.key)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("running E2B's SDK with {}", python.display()))?;
        let stdin = child.stdin.take().context("the driver's stdin")?;
        let stdout = child.stdout.take().context("the driver's stdout")?;
        Ok(Driver {
            child,
            stdin,
            answers: BufReader::new(stdout).lines(),
            _script: script,
        })
    }

    async fn step(&mut self, step: &str) -> Result<serde_json::Value> {
        self.stdin.write_all(format!("{step}\n").as_bytes()).await?;
        self.stdin.flush().await?;
        let line = self
            .answers
            .next_line()
            .await?
            .with_context(|| format!("E2B's SDK stopped at `{step}` (its error is above)"))?;
        let answer: serde_json::Value = serde_json::from_str(&line)?;
        anyhow::ensure!(
            answer.get("error").is_none(),
            "E2B's SDK at `{step}`: {answer}"
        );
        Ok(answer)
    }

    /// A step's `ms`.
    async fn ms(&mut self, step: &str) -> Result<f64> {
        let answer = self.step(step).await?;
        answer["ms"]
            .as_f64()
            .with_context(|| format!("E2B's SDK at `{step}` gave no time: {answer}"))
    }

    async fn close(mut self) -> Result<()> {
        self.step("close").await?;
        self.child.wait().await?;
        Ok(())
    }
}

impl Bench<'_> {
    /// E2B's figures (see the module's docs), beside MCP's live sandbox
    /// `live`.
    pub(super) async fn e2b_figures(&self, live: &str, report: &mut Report<'_>) -> Result<()> {
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
        match &self.a.e2b_python {
            Some(python) => self.through_the_sdk(python, &client, live, report).await?,
            None => row(
                report.rows,
                "E2B's figures through its Python SDK",
                "not measured: give --e2b-python (or SANDPIT_E2B_PYTHON) the python of an \
                 environment with E2B's SDK (scripts/e2b-sdks.sh makes one and prints its path)",
            ),
        }
        self.the_servers_part(&client, live, report).await
    }

    /// The three targets, through E2B's Python SDK.
    async fn through_the_sdk(
        &self,
        python: &Path,
        client: &Client,
        live: &str,
        report: &mut Report<'_>,
    ) -> Result<()> {
        let mut sdk = Driver::start(python, client)?;
        // The SDK's first calls pay for its imports and connections.
        self.wait_pool(self.pool_target).await?;
        sdk.ms("first").await?;
        let (mut e2b_first, mut mcp_first) = (Vec::new(), Vec::new());
        for _ in 0..self.a.mcp_creates.min(20) {
            self.wait_pool(self.pool_target).await?;
            e2b_first.push(sdk.ms("first").await?);
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
            "E2B's Python SDK: `Sandbox.create()` + first `commands.run(\"true\")`, warm pool, against MCP's pair",
            format!("{e2b_med:.1} ms (MCP {mcp_med:.1} ms)"),
            "≤ 1.3x MCP",
            format!(
                "{:.2}x MCP's `create_sandbox` + first `run_command` (medians of {} interleaved pairs; p90 {:.1} ms against {:.1} ms)",
                e2b_med / mcp_med,
                e2b_first.len(),
                percentile(&e2b_first, 0.9),
                percentile(&mcp_first, 0.9)
            ),
            e2b_med <= 1.3 * mcp_med,
        );

        sdk.step("open").await?;
        for _ in 0..3 {
            sdk.ms("run").await?;
            self.run_true(live).await?;
        }
        let (mut over_mcp, mut sdk_run, mut mcp_run, mut first_byte) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for _ in 0..self.a.execs {
            let e2b = sdk.ms("run").await?;
            let mcp = self.time_true(live).await?;
            over_mcp.push(e2b - mcp);
            sdk_run.push(e2b);
            mcp_run.push(mcp);
            first_byte.push(sdk.ms("first_byte").await?);
        }
        sdk.close().await?;
        // The round trip's target is judged on the path (the server and
        // the guest), below, where both sides are clients of the same
        // weight; through the SDK, Python's HTTP client and message
        // handling are in it too, against rmcp's.
        row(
            report.rows,
            format!(
                "E2B's Python SDK: `commands.run(\"true\")` round trip, over MCP's `run_command` through rmcp's client ({} paired calls)",
                over_mcp.len()
            ),
            format!(
                "{:.2} ms ({:.2} ms against {:.2} ms, {:.2}x)",
                median(over_mcp),
                median(sdk_run.clone()),
                median(mcp_run.clone()),
                median(sdk_run) / median(mcp_run)
            ),
        );
        let first = median(first_byte.clone());
        target(
            report.targets,
            "E2B's Python SDK: `commands.run(\"echo x\")`, from the call to the first `on_stdout`",
            format!("{first:.2} ms"),
            "≤ 20 ms after the guest wrote it",
            format!(
                "median of {} (p90 {:.2} ms); an upper bound: the command's start is in it",
                first_byte.len(),
                percentile(&first_byte, 0.9)
            ),
            first <= 20.0,
        );
        Ok(())
    }

    /// The server's part: `Process/Start` on a kept connection against a
    /// direct agent exec of the same command; and the SDKs' own command
    /// (`/bin/bash -l -c true`) against MCP's `run_command` on `live`,
    /// which leaves the SDK's client out of the round trip's target.
    async fn the_servers_part(
        &self,
        client: &Client,
        live: &str,
        report: &mut Report<'_>,
    ) -> Result<()> {
        let sandbox = client.create().await?;
        let agent = self.vms.agent(&sandbox.id).await?;
        for _ in 0..3 {
            client.run(&sandbox, &["true"]).await?;
        }
        let (mut over_direct, mut over_shell, mut first_byte, mut direct_round) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut login_over_mcp = Vec::new();
        for _ in 0..self.a.execs {
            let login = client
                .run(&sandbox, &["/bin/bash", "-l", "-c", "true"])
                .await?
                .end_ms;
            login_over_mcp.push(login - self.time_true(live).await?);
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
        let direct = median(direct_round);
        row(
            report.rows,
            format!(
                "E2B `Process/Start` of `true` without an SDK (a kept connection; {} calls): time over a direct agent exec",
                over_direct.len()
            ),
            format!(
                "{:.2} ms over a {direct:.2} ms direct exec; over the shell's own time {:.2} ms",
                median(over_direct),
                median(over_shell)
            ),
        );
        let overhead = median(login_over_mcp.clone());
        target(
            report.targets,
            "E2B's path: a `commands.run(\"true\")` round trip (the SDKs' `/bin/bash -l -c true` through `Process/Start`, a kept connection) over MCP's `run_command(\"true\")`",
            format!("{overhead:.2} ms"),
            "≤ 1.5 ms",
            format!(
                "median of {} paired calls; the login shell's start included",
                login_over_mcp.len()
            ),
            overhead <= 1.5,
        );
        row(
            report.rows,
            "E2B `Process/Start` of `echo x` without an SDK: its first stdout frame",
            format!(
                "{:.2} ms (p90 {:.2} ms)",
                median(first_byte.clone()),
                percentile(&first_byte, 0.9)
            ),
        );
        Ok(())
    }
}
