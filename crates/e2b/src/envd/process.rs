//! `process.Process`: commands, as the core runs them.
//!
//! `Start` runs `cmd` with its `args` (the SDKs' `commands.run` sends
//! `/bin/bash -l -c <command>`), in `cwd` (by default the user's home, as
//! in E2B, or a template's sandbox's working directory), with the sandbox's environment under the call's `envs`, for at
//! most the call's `Connect-Timeout-Ms` (E2B's `timeout`; Sandpit's
//! commands run 10 minutes at most). The command keeps running when its
//! stream goes (E2B's `background=True` handles, or a client that hung
//! up): it ends when it exits, at its timeout, or by a signal. The stream
//! opens with the `start` event (the guest's pid), carries output as it
//! comes, and ends with `end` (the exit code, or the signal that killed
//! it) or with the error: `deadline_exceeded` for a command killed at its
//! timeout. Idle streams get a `keepalive` every `Keepalive-Ping-Interval`
//! seconds, so proxies do not cut them.
//!
//! `Connect` follows a running command by pid from another client (its
//! output from then on), `List` gives the running ones, `SendInput`,
//! `StreamInput` and `CloseStdin` feed its stdin, and `SendSignal` sends
//! SIGTERM or SIGKILL to its process group: all of it is the guest agent's
//! table of processes, so any server (a replica, one restarted) sees the
//! same.
//!
//! A `Start` with `pty` runs the command on a terminal of that size: its
//! output comes as `pty` data, `SendInput`'s `pty` bytes are keystrokes,
//! and `Update` resizes it.
//!
//! Not built yet, and refused as `unimplemented`: selecting a process by
//! `tag`.

use super::connect::{self, Stream};
use super::ForSandbox;
use crate::error::RpcError;
use crate::E2b;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use base64::Engine;
use sandpit_core::{ExecEvent, ExecParams, ExecStream, Execution, ExecutionStatus};
use sandpit_protocol::ProcessCall;
use serde::Deserialize;
use serde_json::json;
use std::collections::BTreeMap;
use std::time::Duration;

/// The longest a command runs in Sandpit (`ExecParams::timeout_ms`).
const MOST_MS: u64 = 600_000;

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct StartRequest {
    process: ProcessConfig,
    pty: Option<Pty>,
    stdin: Option<bool>,
}

/// envd's `PTY`: a terminal, of this size.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Pty {
    size: Option<PtySize>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct PtySize {
    cols: u32,
    rows: u32,
}

impl Pty {
    fn size(&self) -> Result<sandpit_protocol::TerminalSize, RpcError> {
        let size = self
            .size
            .as_ref()
            .ok_or_else(|| RpcError::invalid("pty.size is missing"))?;
        let fits = |n: u32| u16::try_from(n).ok().filter(|&n| n > 0);
        match (fits(size.rows), fits(size.cols)) {
            (Some(rows), Some(cols)) => Ok(sandpit_protocol::TerminalSize { rows, cols }),
            _ => Err(RpcError::invalid(format!(
                "pty.size: {} rows and {} columns (each from 1 to 65535)",
                size.rows, size.cols
            ))),
        }
    }
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
    let on_terminal = params.pty.is_some();
    match e2b
        .api
        .exec_stream(&sandbox.caller, &sandbox.id, params)
        .await
    {
        Ok(exec) => follow(exec, keepalive(&headers), on_terminal),
        Err(e) => connect::failed(e.into()).await,
    }
}

/// `Connect`: follow a running command by pid, from now on.
pub async fn connect(
    State(e2b): State<E2b>,
    sandbox: ForSandbox,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let pid = match connect::request::<Selected>(&headers, &body).and_then(|r| r.process.pid()) {
        Ok(pid) => pid,
        Err(e) => return connect::failed(e).await,
    };
    // A terminal's output goes out as such: the agent's table says which.
    let on_terminal = match e2b.api.list_processes(&sandbox.caller, &sandbox.id).await {
        Ok(running) => running.iter().any(|p| p.pid == pid && p.pty),
        Err(e) => return connect::failed(e.into()).await,
    };
    match e2b
        .api
        .attach_process(&sandbox.caller, &sandbox.id, pid)
        .await
    {
        Ok(exec) => follow(exec, keepalive(&headers), on_terminal),
        Err(e) => connect::failed(e.into()).await,
    }
}

/// Seconds between keepalives on an idle stream (the client's
/// `Keepalive-Ping-Interval`).
pub(super) fn keepalive(headers: &HeaderMap) -> u64 {
    headers
        .get("keepalive-ping-interval")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(50)
        .max(1)
}

/// A command's events as envd's `ProcessEvent`s, on a stream of their own
/// (a terminal's output as `pty` data, a command's as `stdout`/`stderr`).
fn follow(mut exec: ExecStream, keepalive: u64, on_terminal: bool) -> Response {
    let stdout = if on_terminal { "pty" } else { "stdout" };
    let (response, stream) = Stream::open();
    tokio::spawn(async move {
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
                Some(ExecEvent::Started(ex)) => {
                    json!({"event": {"start": {"pid": ex.pid.unwrap_or_default()}}})
                }
                Some(ExecEvent::Stdout(text)) => {
                    json!({"event": {"data": {stdout: b64(&text)}}})
                }
                Some(ExecEvent::Stderr(text)) => {
                    json!({"event": {"data": {"stderr": b64(&text)}}})
                }
                Some(ExecEvent::Exit(ex)) => match end_event(&ex) {
                    Ok(end) => {
                        if !stream.send(&end).await {
                            return;
                        }
                        break None;
                    }
                    Err(e) => break Some(e),
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
                // The client went; the command goes on (it keeps running).
                return;
            }
        };
        stream.end(error).await;
    });
    response
}

/// envd's `end` event for how a command ended, or the stream's error.
fn end_event(ex: &Execution) -> Result<serde_json::Value, RpcError> {
    let killed = |signal: i32| {
        let name = match signal {
            9 => "killed".to_string(),
            15 => "terminated".to_string(),
            2 => "interrupt".to_string(),
            1 => "hangup".to_string(),
            n => format!("signal {n}"),
        };
        json!({"event": {"end": {"exitCode": -1, "exited": false, "status": format!("signal: {name}")}}})
    };
    match ex.status {
        ExecutionStatus::Completed => Ok(match (ex.signal, ex.exit_code) {
            (Some(signal), _) => killed(signal),
            (None, Some(code)) => json!({"event": {"end": {
                "exitCode": code,
                "exited": true,
                "status": format!("exit status {code}"),
            }}}),
            (None, None) => killed(9),
        }),
        // Killed by a SIGKILL asked for by pid (a command that keeps
        // running is never cancelled by its stream going).
        ExecutionStatus::Cancelled => Ok(killed(9)),
        ExecutionStatus::TimedOut => Err(RpcError::new(
            "deadline_exceeded",
            format!(
                "the command ran past its timeout ({} ms) and was killed",
                ex.duration_ms
            ),
        )),
        ExecutionStatus::Failed | ExecutionStatus::Running => Err(RpcError::new(
            "unavailable",
            "the sandbox failed while the command ran",
        )),
    }
}

/// A request naming one process.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Selected {
    process: Selector,
}

/// envd's `ProcessSelector`: a pid, or a tag.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Selector {
    pid: Option<u32>,
    tag: Option<String>,
}

impl Selector {
    fn pid(&self) -> Result<u32, RpcError> {
        match (self.pid, &self.tag) {
            (Some(pid), _) => Ok(pid),
            (None, Some(_)) => Err(RpcError::unimplemented(
                "selecting a process by tag (name it by its pid)",
            )),
            (None, None) => Err(RpcError::invalid("process.pid is missing")),
        }
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct InputRequest {
    process: Selector,
    input: Input,
}

/// envd's `ProcessInput`: bytes for stdin, or keystrokes for a terminal
/// (both go to what the command reads: its stdin is its terminal).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Input {
    stdin: Option<String>,
    pty: Option<String>,
}

impl Input {
    fn bytes(&self) -> Result<Vec<u8>, RpcError> {
        let (field, text) = match (&self.stdin, &self.pty) {
            (_, Some(pty)) => ("pty", pty.as_str()),
            (stdin, None) => ("stdin", stdin.as_deref().unwrap_or_default()),
        };
        base64::engine::general_purpose::STANDARD
            .decode(text)
            .map_err(|e| RpcError::invalid(format!("input.{field} is not base64: {e}")))
    }
}

/// envd's `UpdateRequest`: a terminal's new size.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct UpdateRequest {
    process: Selector,
    pty: Option<Pty>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct SignalRequest {
    process: Selector,
    signal: Option<serde_json::Value>,
}

/// The signal envd's `Signal` names (as its name or its number).
fn signal_number(value: Option<&serde_json::Value>) -> Result<i32, RpcError> {
    match value {
        Some(serde_json::Value::String(s)) if s == "SIGNAL_SIGKILL" => Ok(9),
        Some(serde_json::Value::String(s)) if s == "SIGNAL_SIGTERM" => Ok(15),
        Some(serde_json::Value::Number(n)) if n.as_i64() == Some(9) => Ok(9),
        Some(serde_json::Value::Number(n)) if n.as_i64() == Some(15) => Ok(15),
        other => Err(RpcError::invalid(format!(
            "signal must be SIGNAL_SIGTERM or SIGNAL_SIGKILL, not {other:?}"
        ))),
    }
}

/// The unary calls: `List`, `SendInput`, `SendSignal`, `CloseStdin`.
pub async fn unary(
    State(e2b): State<E2b>,
    sandbox: ForSandbox,
    axum::extract::Path(method): axum::extract::Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    match answer(&e2b, &sandbox, &method, &headers, &body).await {
        Ok(message) => (StatusCode::OK, axum::Json(message)).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn answer(
    e2b: &E2b,
    sandbox: &ForSandbox,
    method: &str,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<serde_json::Value, RpcError> {
    super::check_user(super::named_user(headers).as_deref())?;
    let call = |pid: u32, call: ProcessCall, input: Vec<u8>| async move {
        e2b.api
            .process_call(&sandbox.caller, &sandbox.id, pid, call, input)
            .await
            .map_err(RpcError::from)
    };
    match method {
        "List" => {
            let processes = e2b.api.list_processes(&sandbox.caller, &sandbox.id).await?;
            Ok(json!({"processes": processes.iter().map(listed).collect::<Vec<_>>()}))
        }
        "SendInput" => {
            let req: InputRequest = connect::request(headers, body)?;
            call(req.process.pid()?, ProcessCall::Input, req.input.bytes()?).await?;
            Ok(json!({}))
        }
        "SendSignal" => {
            let req: SignalRequest = connect::request(headers, body)?;
            let signal = signal_number(req.signal.as_ref())?;
            call(
                req.process.pid()?,
                ProcessCall::Signal { signal },
                Vec::new(),
            )
            .await?;
            Ok(json!({}))
        }
        "CloseStdin" => {
            let req: Selected = connect::request(headers, body)?;
            call(req.process.pid()?, ProcessCall::CloseStdin, Vec::new()).await?;
            Ok(json!({}))
        }
        "Update" => {
            let req: UpdateRequest = connect::request(headers, body)?;
            let pid = req.process.pid()?;
            // Nothing to change but the terminal's size.
            if let Some(pty) = req.pty {
                let size = pty.size()?;
                let resize = ProcessCall::Resize {
                    rows: size.rows,
                    cols: size.cols,
                };
                call(pid, resize, Vec::new()).await?;
            }
            Ok(json!({}))
        }
        other => Err(RpcError::unimplemented(&format!("process.Process/{other}"))),
    }
}

/// envd's `ProcessInfo` for a running command: its command line split back
/// into `cmd` and `args`.
fn listed(p: &sandpit_protocol::ProcessInfo) -> serde_json::Value {
    let mut words = shell_words::split(&p.command).unwrap_or_else(|_| vec![p.command.clone()]);
    let cmd = if words.is_empty() {
        String::new()
    } else {
        words.remove(0)
    };
    json!({
        "pid": p.pid,
        "config": {"cmd": cmd, "args": words, "envs": p.env, "cwd": p.cwd},
    })
}

/// `StreamInput`: a client stream of input for one process (its first
/// message names it), each piece written as it comes, in order.
pub async fn stream_input(
    State(e2b): State<E2b>,
    sandbox: ForSandbox,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Response {
    if let Err(e) = super::check_user(super::named_user(&headers).as_deref()) {
        return connect::failed(e).await;
    }
    let mut frames = connect::Frames::new(body.into_data_stream());
    let mut pid = None;
    let outcome: Result<(), RpcError> = async {
        while let Some(message) = frames.next().await {
            let message: StreamInputMessage = serde_json::from_slice(&message?)
                .map_err(|e| RpcError::invalid(format!("a StreamInput message: {e}")))?;
            if let Some(start) = message.start {
                pid = Some(start.process.pid()?);
                continue;
            }
            if let Some(data) = message.data {
                let Some(pid) = pid else {
                    return Err(RpcError::invalid(
                        "input came before the start naming the process",
                    ));
                };
                e2b.api
                    .process_call(
                        &sandbox.caller,
                        &sandbox.id,
                        pid,
                        ProcessCall::Input,
                        data.input.bytes()?,
                    )
                    .await?;
            }
        }
        Ok(())
    }
    .await;
    let (response, stream) = Stream::open();
    match outcome {
        Ok(()) => {
            let _ = stream.send(&json!({})).await;
            stream.end(None).await;
        }
        Err(e) => stream.end(Some(e)).await,
    }
    response
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct StreamInputMessage {
    start: Option<Selected>,
    data: Option<StreamedData>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct StreamedData {
    input: Input,
}

/// The core's command for a `Start`, or why not.
fn start_params(headers: &HeaderMap, body: &[u8]) -> Result<ExecParams, RpcError> {
    let req: StartRequest = connect::request(headers, body)?;
    super::check_user(super::named_user(headers).as_deref())?;
    let pty = req.pty.as_ref().map(Pty::size).transpose()?;
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
        cwd: req.process.cwd.map(|c| super::guest_path(&c)),
        // No directory asked for: a template's last working directory
        // (E2B's "user and workdir"), else the user's home, as in E2B.
        default_cwd: Some(sandpit_protocol::GUEST_HOME.to_string()),
        env: Some(req.process.envs).filter(|e| !e.is_empty()),
        stream: Some(true),
        keep_running: true,
        // envd's default, for clients older than the field.
        stdin: req.stdin.unwrap_or(true),
        pty,
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_end_says_the_exit_code_or_the_signal_as_envd_does() {
        let ex = |status, exit_code, signal| Execution {
            id: String::new(),
            object: "execution".into(),
            sandbox_id: "sbx".into(),
            status,
            exit_code,
            stdout: String::new(),
            stderr: String::new(),
            truncated: false,
            duration_ms: 5,
            started_at: String::new(),
            finished_at: None,
            pid: Some(7),
            signal,
        };
        let end = |e: &Execution| end_event(e).unwrap()["event"]["end"].clone();
        let e = end(&ex(ExecutionStatus::Completed, Some(3), None));
        assert_eq!(
            (e["exitCode"].as_i64(), e["exited"].as_bool()),
            (Some(3), Some(true))
        );
        assert_eq!(e["status"], "exit status 3");
        let e = end(&ex(ExecutionStatus::Completed, Some(143), Some(15)));
        assert_eq!(
            (e["exitCode"].as_i64(), e["exited"].as_bool()),
            (Some(-1), Some(false))
        );
        assert_eq!(e["status"], "signal: terminated");
        assert_eq!(
            end(&ex(ExecutionStatus::Cancelled, Some(137), Some(9)))["status"],
            "signal: killed"
        );
        let timed_out = end_event(&ex(ExecutionStatus::TimedOut, Some(137), Some(9)));
        assert_eq!(timed_out.unwrap_err().code, "deadline_exceeded");
    }

    #[test]
    fn a_selector_needs_a_pid_and_a_signal_is_term_or_kill() {
        let s: Selected = serde_json::from_str(r#"{"process":{"pid":42}}"#).unwrap();
        assert_eq!(s.process.pid().unwrap(), 42);
        let s: Selected = serde_json::from_str(r#"{"process":{"tag":"web"}}"#).unwrap();
        assert_eq!(s.process.pid().unwrap_err().code, "unimplemented");
        let s: Selected = serde_json::from_str(r#"{}"#).unwrap();
        assert_eq!(s.process.pid().unwrap_err().code, "invalid_argument");
        assert_eq!(signal_number(Some(&json!("SIGNAL_SIGKILL"))).unwrap(), 9);
        assert_eq!(signal_number(Some(&json!(15))).unwrap(), 15);
        assert!(signal_number(Some(&json!("SIGNAL_UNSPECIFIED"))).is_err());
        assert!(signal_number(None).is_err());
        let input: Input = serde_json::from_str(r#"{"stdin":"aGk="}"#).unwrap();
        assert_eq!(input.bytes().unwrap(), b"hi");
        let input: Input = serde_json::from_str(r#"{"pty":"aGk="}"#).unwrap();
        assert_eq!(input.bytes().unwrap(), b"hi");
        let input: Input = serde_json::from_str(r#"{"pty":"not base64!"}"#).unwrap();
        let e = input.bytes().unwrap_err();
        assert_eq!(e.code, "invalid_argument");
        assert!(e.message.contains("input.pty"), "{}", e.message);
    }

    #[test]
    fn a_listed_process_gives_its_command_line_back_as_cmd_and_args() {
        let p = sandpit_protocol::ProcessInfo {
            pid: 9,
            command: "/bin/bash -l -c 'sleep 30'".into(),
            cwd: "/home/user".into(),
            env: BTreeMap::new(),
            keep_running: true,
            stdin: false,
            pty: false,
        };
        let l = listed(&p);
        assert_eq!(l["pid"], 9);
        assert_eq!(l["config"]["cmd"], "/bin/bash");
        assert_eq!(l["config"]["args"], json!(["-l", "-c", "sleep 30"]));
        assert_eq!(l["config"]["cwd"], "/home/user");
    }

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
    fn a_run_becomes_the_same_command_line() {
        let (h, body) = streamed(
            r#"{"process":{"cmd":"/bin/bash","args":["-l","-c","echo 'a b' && uname -a"],"envs":{"X":"y"}},"stdin":false}"#,
        );
        let p = start_params(&h, &body).unwrap();
        assert_eq!(
            p.command,
            r#"/bin/bash -l -c 'echo '\''a b'\'' && uname -a'"#
        );
        assert_eq!(
            p.cwd, None,
            "no directory asked for: `start` picks the home or the template's"
        );
        assert_eq!(p.timeout_ms, Some(60_000));
        assert_eq!(p.env.unwrap()["X"], "y");
    }

    #[test]
    fn a_terminal_has_a_size_and_another_user_is_refused_saying_so() {
        let (h, body) =
            streamed(r#"{"process":{"cmd":"bash"},"pty":{"size":{"cols":80,"rows":24}}}"#);
        let size = start_params(&h, &body).unwrap().pty.unwrap();
        assert_eq!((size.rows, size.cols), (24, 80));
        for bad in [
            r#"{}"#,
            r#"{"size":{"cols":0,"rows":24}}"#,
            r#"{"size":{"cols":80,"rows":70000}}"#,
        ] {
            let (h, body) = streamed(&format!(r#"{{"process":{{"cmd":"bash"}},"pty":{bad}}}"#));
            assert_eq!(
                start_params(&h, &body).unwrap_err().code,
                "invalid_argument",
                "{bad}"
            );
        }
        // stdin is envd's default for clients older than the field.
        let (h, body) = streamed(r#"{"process":{"cmd":"cat"},"stdin":true}"#);
        let p = start_params(&h, &body).unwrap();
        assert!(p.stdin && p.keep_running);
        let (h, body) = streamed(r#"{"process":{"cmd":"cat"}}"#);
        assert!(start_params(&h, &body).unwrap().stdin);
        let (h, body) = streamed(r#"{"process":{"cmd":"cat"},"stdin":false}"#);
        assert!(!start_params(&h, &body).unwrap().stdin);
        let (mut h, body) = streamed(r#"{"process":{"cmd":"id"}}"#);
        h.insert("authorization", "Basic cm9vdDo=".parse().unwrap());
        let e = start_params(&h, &body).unwrap_err();
        assert_eq!(e.code, "permission_denied");
        assert!(e.message.contains("\"root\""), "{}", e.message);
        h.insert("authorization", "Basic dXNlcjo=".parse().unwrap());
        assert!(start_params(&h, &body).is_ok());
    }
}
