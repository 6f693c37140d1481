//! `process.Process`: commands, as the core runs them (`exec_stream`).
//!
//! `Start` runs `cmd` with its `args` (the SDKs' `commands.run` sends
//! `/bin/bash -l -c <command>`), in `cwd` (the user's home by default, as
//! in E2B), with the sandbox's environment under the call's `envs`, for at
//! most the call's `Connect-Timeout-Ms` (E2B's `timeout`; Sandpit's
//! commands run 10 minutes at most). The stream opens with the `start`
//! event, carries output as it comes, and ends with `end` (the exit code)
//! or with the error: `deadline_exceeded` for a command killed at its
//! timeout. Idle streams get a `keepalive` every `Keepalive-Ping-Interval`
//! seconds, so proxies do not cut them.
//!
//! Not built yet, and refused as `unimplemented`: a terminal (`pty`),
//! stdin, commands that outlive their stream (`background` handles that
//! another client connects to), `List`, `SendSignal` and `Connect`. The
//! `pid` in `start` numbers the command for the SDK; it is not the
//! guest's process id yet.

use super::connect::{self, Stream};
use super::ForSandbox;
use crate::error::RpcError;
use crate::E2b;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use base64::Engine;
use sandpit_core::{ExecEvent, ExecParams, ExecutionStatus};
use serde::Deserialize;
use serde_json::json;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

/// The longest a command runs in Sandpit (`ExecParams::timeout_ms`).
const MOST_MS: u64 = 600_000;

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct StartRequest {
    process: ProcessConfig,
    pty: Option<serde_json::Value>,
    stdin: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ProcessConfig {
    cmd: String,
    #[serde(default)]
    args: Vec<String>,
    #[serde(default)]
    envs: BTreeMap<String, String>,
    cwd: Option<String>,
}

/// The numbers `start` gives commands.
static NEXT_PID: AtomicU32 = AtomicU32::new(1000);

pub async fn start(
    State(e2b): State<E2b>,
    sandbox: ForSandbox,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let params = match start_params(&headers, &body) {
        Ok(params) => params,
        Err(e) => return connect::failed(e).await,
    };
    let keepalive = headers
        .get("keepalive-ping-interval")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(50)
        .max(1);
    let mut exec = match e2b
        .api
        .exec_stream(&sandbox.caller, &sandbox.id, params)
        .await
    {
        Ok(exec) => exec,
        Err(e) => return connect::failed(e.into()).await,
    };
    let (response, stream) = Stream::open();
    tokio::spawn(async move {
        let pid = NEXT_PID.fetch_add(1, Ordering::Relaxed);
        let mut tick = tokio::time::interval(Duration::from_secs(keepalive));
        tick.tick().await;
        let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s.as_bytes());
        let error = loop {
            let event = tokio::select! {
                event = exec.next() => event,
                _ = tick.tick() => {
                    if !stream.send(&json!({"event": {"keepalive": {}}})).await {
                        return;
                    }
                    continue;
                }
            };
            let message = match event {
                Some(ExecEvent::Started(_)) => json!({"event": {"start": {"pid": pid}}}),
                Some(ExecEvent::Stdout(text)) => {
                    json!({"event": {"data": {"stdout": b64(&text)}}})
                }
                Some(ExecEvent::Stderr(text)) => {
                    json!({"event": {"data": {"stderr": b64(&text)}}})
                }
                Some(ExecEvent::Exit(ex)) => match ex.status {
                    ExecutionStatus::Completed => {
                        let code = ex.exit_code.unwrap_or(-1);
                        let end = json!({"event": {"end": {
                            "exitCode": code,
                            "exited": ex.exit_code.is_some(),
                            "status": match ex.exit_code {
                                Some(c) => format!("exit status {c}"),
                                None => "killed by a signal".into(),
                            },
                        }}});
                        if !stream.send(&end).await {
                            return;
                        }
                        break None;
                    }
                    ExecutionStatus::TimedOut => {
                        break Some(RpcError::new(
                            "deadline_exceeded",
                            format!(
                                "the command ran past its timeout ({} ms) and was killed",
                                ex.duration_ms
                            ),
                        ))
                    }
                    ExecutionStatus::Cancelled => {
                        break Some(RpcError::new("canceled", "the command was cancelled"))
                    }
                    ExecutionStatus::Failed | ExecutionStatus::Running => {
                        break Some(RpcError::new(
                            "unavailable",
                            "the sandbox failed while the command ran",
                        ))
                    }
                },
                Some(ExecEvent::Error(e)) => break Some(e.into()),
                None => {
                    break Some(RpcError::new(
                        "internal",
                        "the command's events ended early",
                    ))
                }
            };
            if !stream.send(&message).await {
                // The client went: dropping `exec` cancels the command.
                return;
            }
        };
        stream.end(error).await;
    });
    response
}

/// The core's command for a `Start`, or why not.
fn start_params(headers: &HeaderMap, body: &[u8]) -> Result<ExecParams, RpcError> {
    let req: StartRequest = connect::request(headers, body)?;
    super::check_user(super::named_user(headers).as_deref())?;
    if req.pty.as_ref().is_some_and(|p| !p.is_null()) {
        return Err(RpcError::unimplemented("a terminal (pty)"));
    }
    if req.stdin == Some(true) {
        return Err(RpcError::unimplemented("stdin for a command"));
    }
    if req.process.cmd.is_empty() {
        return Err(RpcError::invalid("process.cmd is empty"));
    }
    let mut words = vec![req.process.cmd];
    words.extend(req.process.args);
    let timeout_ms = headers
        .get("connect-timeout-ms")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|&ms| ms > 0)
        .unwrap_or(MOST_MS)
        .clamp(1000, MOST_MS);
    Ok(ExecParams {
        command: shell_words::join(&words),
        timeout_ms: Some(timeout_ms),
        cwd: Some(
            req.process
                .cwd
                .map(|c| super::guest_path(&c))
                .unwrap_or_else(|| sandpit_protocol::GUEST_HOME.to_string()),
        ),
        env: Some(req.process.envs).filter(|e| !e.is_empty()),
        stream: Some(true),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::header;

    fn streamed(json: &str) -> (HeaderMap, Bytes) {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONTENT_TYPE,
            "application/connect+json".parse().unwrap(),
        );
        h.insert("connect-timeout-ms", "60000".parse().unwrap());
        (h, connect::frame(0, json.as_bytes()))
    }

    #[test]
    fn a_run_becomes_the_same_command_line_in_the_users_home() {
        let (h, body) = streamed(
            r#"{"process":{"cmd":"/bin/bash","args":["-l","-c","echo 'a b' && uname -a"],"envs":{"X":"y"}},"stdin":false}"#,
        );
        let p = start_params(&h, &body).unwrap();
        assert_eq!(
            p.command,
            r#"/bin/bash -l -c 'echo '\''a b'\'' && uname -a'"#
        );
        assert_eq!(p.cwd.as_deref(), Some("/home/user"));
        assert_eq!(p.timeout_ms, Some(60_000));
        assert_eq!(p.env.unwrap()["X"], "y");
    }

    #[test]
    fn a_terminal_stdin_or_another_user_is_refused_saying_so() {
        let (h, body) =
            streamed(r#"{"process":{"cmd":"bash"},"pty":{"size":{"cols":80,"rows":24}}}"#);
        assert_eq!(start_params(&h, &body).unwrap_err().code, "unimplemented");
        let (h, body) = streamed(r#"{"process":{"cmd":"cat"},"stdin":true}"#);
        assert_eq!(start_params(&h, &body).unwrap_err().code, "unimplemented");
        let (mut h, body) = streamed(r#"{"process":{"cmd":"id"}}"#);
        h.insert("authorization", "Basic cm9vdDo=".parse().unwrap());
        let e = start_params(&h, &body).unwrap_err();
        assert_eq!(e.code, "permission_denied");
        assert!(e.message.contains("\"root\""), "{}", e.message);
        h.insert("authorization", "Basic dXNlcjo=".parse().unwrap());
        assert!(start_params(&h, &body).is_ok());
    }
}
