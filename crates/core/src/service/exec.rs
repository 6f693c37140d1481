//! Commands in a sandbox, as the service runs and records them.
//!
//! Separate because a command is the one call that lives on after it
//! returns: it runs in a task of its own (a client that hangs up cancels
//! it, it is not cut half-way), streams its output as it comes, and leaves
//! a stored execution behind. Owns starting a command wherever its VM runs,
//! the output held to `max_output_bytes` on the host too, the execution's
//! record, and the stored executions' budget per account and their
//! retention.

use crate::api::Commands;
use crate::api::{Caller, ExecEvent, ExecStream};
use crate::error::{CoreError, Result};
use crate::model::*;
use crate::service::checks::{page_limit, unknown_cursor, validate_exec};
use crate::service::errors::runtime_error;
use crate::service::Service;
use crate::utf8::Utf8Chunker;
use sandpit_host::ids::{new_id, rfc3339};
use sandpit_host::machines::Command;
use sandpit_protocol::ExecRequest;
use sandpit_runtime::{GuestExecEvent, RuntimeError, VmState};
use sandpit_store::ExecutionStatus as Ended;
use sandpit_store::{ExecutionResult, ExecutionRow, ExecutionState, SandboxRow};
use time::OffsetDateTime;
use tokio::sync::{mpsc, oneshot};

impl Service {
    /// Starts `req` in `row`'s sandbox, wherever its VM runs; with the
    /// command's pid when it keeps running (its first event gives it).
    async fn start_command(
        &self,
        row: &SandboxRow,
        mut req: ExecRequest,
        default_cwd: Option<String>,
    ) -> Result<(Box<dyn Command>, Option<u32>)> {
        // The sandbox's own environment (given at its create), under the
        // command's.
        if !row.env.is_empty() {
            let mut env = row.env.clone();
            env.append(&mut req.env);
            req.env = env;
        }
        // Its template's working directory, unless the command says; else
        // the caller's default, if it has one.
        if req.cwd.as_deref().is_none_or(str::is_empty) {
            req.cwd = row.workdir.clone().or(default_cwd);
        }
        let keep_running = req.keep_running;
        let machines = self.machines_for(row).await?;
        let mut command = match machines.exec(&row.id, req).await {
            Ok(command) => command,
            Err(e) => return Err(self.agent_failure(row, e).await),
        };
        if !keep_running {
            return Ok((command, None));
        }
        match command.next().await {
            Ok(GuestExecEvent::Started(pid)) => Ok((command, Some(pid))),
            Ok(other) => Err(CoreError::internal(format!(
                "the sandbox's agent did not give the command's pid first ({other:?}): \
                 is its guest image older than this server?"
            ))),
            Err(e) => Err(self.agent_failure(row, e).await),
        }
    }

    /// Start a command and feed its events to `tx`; returns the final execution.
    async fn run_exec(
        &self,
        row: &SandboxRow,
        command: String,
        (mut handle, pid): (Box<dyn Command>, Option<u32>),
        tx: Option<mpsc::Sender<ExecEvent>>,
        mut cancel: oneshot::Receiver<()>,
    ) -> Result<Execution> {
        let exec_id = new_id("exec_");
        let started = OffsetDateTime::now_utc();
        let clock = std::time::Instant::now();
        let mut record = ExecutionRow {
            id: exec_id.clone(),
            sandbox_id: row.id.clone(),
            account_id: row.account_id.clone(),
            command,
            status: ExecutionState::Running,
            exit_code: None,
            stdout: String::new(),
            stderr: String::new(),
            truncated: false,
            duration_ms: 0,
            started_at: started,
            finished_at: None,
        };
        // The command started first and its record is written while it
        // runs: the store's write is then off a short command's round trip.
        // A record that cannot be written stops the command (it is killed
        // with its process group) and the call fails.
        if let Err(e) = self
            .store
            .insert_execution_by(&record, Some(&self.config.host_name))
            .await
        {
            handle.cancel();
            return Err(e.into());
        }
        if let Some(tx) = &tx {
            let mut started = to_execution(&record);
            started.pid = pid;
            let _ = tx.send(ExecEvent::Started(started)).await;
        }
        let (mut out, mut err) = (Utf8Chunker::new(), Utf8Chunker::new());
        let (mut stdout, mut stderr) = (String::new(), String::new());
        // The record keeps `max_output_bytes` of each stream. A collected
        // command streams no more than that either (its agent drops the
        // rest, and the host holds a guest whose agent does not to it as
        // well, so a guest root cannot fill the host's memory or the
        // database); one that keeps running streams all of it to `tx`.
        let limit = self.config.max_output_bytes as usize;
        let stream_all = pid.is_some();
        let mut cut_here = false;
        let mut cancelled_by_client = false;
        let outcome = loop {
            let ev = tokio::select! {
                ev = handle.next() => ev,
                _ = &mut cancel, if !cancelled_by_client => {
                    cancelled_by_client = true;
                    handle.cancel();
                    continue;
                }
            };
            match ev {
                Ok(GuestExecEvent::Started(_)) => {}
                Ok(GuestExecEvent::Stdout(b)) => {
                    let piece = out.push(&b);
                    // Copied only when the stream gets more than is kept.
                    let all = stream_all.then(|| piece.clone());
                    let kept = within(&stdout, piece, limit, &mut cut_here);
                    stdout.push_str(&kept);
                    let streamed = all.unwrap_or(kept);
                    if let (Some(tx), false) = (&tx, streamed.is_empty()) {
                        let _ = tx.send(ExecEvent::Stdout(streamed)).await;
                    }
                }
                Ok(GuestExecEvent::Stderr(b)) => {
                    let piece = err.push(&b);
                    // Copied only when the stream gets more than is kept.
                    let all = stream_all.then(|| piece.clone());
                    let kept = within(&stderr, piece, limit, &mut cut_here);
                    stderr.push_str(&kept);
                    let streamed = all.unwrap_or(kept);
                    if let (Some(tx), false) = (&tx, streamed.is_empty()) {
                        let _ = tx.send(ExecEvent::Stderr(streamed)).await;
                    }
                }
                Ok(GuestExecEvent::Exited(r)) => break Ok(r),
                Err(e) => break Err(e),
            }
        };
        let rest = within(&stdout, out.finish(), limit, &mut cut_here);
        stdout.push_str(&rest);
        let rest = within(&stderr, err.finish(), limit, &mut cut_here);
        stderr.push_str(&rest);
        let finished = OffsetDateTime::now_utc();
        let signal = outcome.as_ref().ok().and_then(|r| r.signal);
        let result = match outcome {
            Ok(r) => {
                let st = if r.timed_out {
                    Ended::TimedOut
                } else if r.cancelled || cancelled_by_client {
                    Ended::Cancelled
                } else {
                    Ended::Completed
                };
                ExecutionResult {
                    status: st,
                    exit_code: r.exit_code.or(r.signal.map(|s| 128 + s)),
                    stdout,
                    stderr,
                    truncated: r.stdout_truncated || r.stderr_truncated || cut_here,
                    duration_ms: r.duration_ms,
                    finished_at: finished,
                }
            }
            Err(e) => {
                crate::metrics::record_exec(Ended::Failed, clock.elapsed());
                let _ = self
                    .store
                    .finish_execution(
                        &exec_id,
                        &ExecutionResult {
                            status: Ended::Failed,
                            exit_code: None,
                            stdout,
                            stderr,
                            truncated: cut_here,
                            duration_ms: (finished - started).whole_milliseconds() as u64,
                            finished_at: finished,
                        },
                    )
                    .await;
                if let RuntimeError::Agent(_) = e {
                    return Err(runtime_error(e));
                }
                // The VM may have died under the command.
                let died = match self.machines_for(row).await {
                    Ok(machines) => machines.state(&row.id).await.ok().flatten(),
                    Err(_) => None,
                };
                if let Some(VmState::Exited { cause }) = died {
                    return Err(self
                        .agent_failure(row, RuntimeError::VmExited { cause })
                        .await);
                }
                return Err(self.agent_failure(row, e).await);
            }
        };
        crate::metrics::record_exec(result.status, clock.elapsed());
        let stored = self.store.finish_execution(&exec_id, &result).await?;
        if stored.is_some_and(|bytes| bytes > self.config.execution_storage_bytes) {
            self.trim_executions(&row.account_id).await;
        }
        if stored.is_some() {
            // Exactly what was written, so no need to read it back.
            record.status = ExecutionState::Ended(result.status);
            record.exit_code = result.exit_code;
            record.stdout = result.stdout;
            record.stderr = result.stderr;
            record.truncated = result.truncated;
            record.duration_ms = result.duration_ms;
            record.finished_at = Some(result.finished_at);
            let mut ended = to_execution(&record);
            ended.pid = pid;
            ended.signal = signal;
            return Ok(ended);
        }
        // Finished by someone else meanwhile (the sandbox ended): as stored.
        let row = self
            .store
            .execution(&exec_id)
            .await?
            .ok_or_else(|| CoreError::internal("the execution vanished"))?;
        Ok(to_execution(&row))
    }

    /// Hold an account's stored executions to its budget (its oldest ended
    /// ones go first).
    async fn trim_executions(&self, account_id: &str) {
        let budget = self.config.execution_storage_bytes;
        match self.store.trim_executions(account_id, budget).await {
            Ok(0) => {}
            Ok(n) => tracing::debug!(%account_id, "deleted {n} old executions over the budget"),
            Err(e) => tracing::warn!(%account_id, "trimming executions: {e}"),
        }
    }

    /// Delete the executions of sandboxes that ended more than
    /// `execution_retention_days` ago. Returns how many went.
    pub async fn drop_old_executions(&self) -> Result<u64> {
        let keep = time::Duration::days(i64::from(self.config.execution_retention_days));
        let n = self
            .store
            .drop_ended_executions(OffsetDateTime::now_utc() - keep)
            .await?;
        if n > 0 {
            tracing::info!("deleted {n} executions of sandboxes ended over {keep} ago");
        }
        Ok(n)
    }
}

/// How a followed command ended, as an execution (it has no record of
/// its own: that is the starting call's).
fn ended(mut attached: Execution, r: &sandpit_protocol::ExecResult) -> Execution {
    attached.status = if r.timed_out {
        crate::model::ExecutionStatus::TimedOut
    } else if r.cancelled {
        crate::model::ExecutionStatus::Cancelled
    } else {
        crate::model::ExecutionStatus::Completed
    };
    attached.exit_code = r.exit_code.or(r.signal.map(|s| 128 + s));
    attached.signal = r.signal;
    attached.duration_ms = r.duration_ms;
    attached.finished_at = Some(rfc3339(OffsetDateTime::now_utc()));
    attached
}

fn to_execution(r: &ExecutionRow) -> Execution {
    Execution {
        id: r.id.clone(),
        object: "execution".into(),
        sandbox_id: r.sandbox_id.clone(),
        status: r.status.into(),
        exit_code: r.exit_code,
        stdout: r.stdout.clone(),
        stderr: r.stderr.clone(),
        truncated: r.truncated,
        duration_ms: r.duration_ms,
        started_at: rfc3339(r.started_at),
        finished_at: r.finished_at.map(rfc3339),
        pid: None,
        signal: None,
    }
}

/// What of `more` fits after `kept` within `limit` bytes (cut at a character
/// boundary); `cut` is set when anything was left out.
fn within(kept: &str, mut more: String, limit: usize, cut: &mut bool) -> String {
    let room = limit.saturating_sub(kept.len());
    if more.len() > room {
        let mut end = room;
        while !more.is_char_boundary(end) {
            end -= 1;
        }
        more.truncate(end);
        *cut = true;
    }
    more
}

#[async_trait::async_trait]
impl Commands for Service {
    /// The API's `exec`.
    async fn exec(&self, caller: &Caller, id: &str, params: ExecParams) -> Result<Execution> {
        let req = validate_exec(&self.config, &params)?;
        let (row, _busy) = self.running(caller, id).await?;
        // The command runs in a task of its own; if this call is dropped (the
        // client hung up), the cancel sender goes with it, the task kills the
        // command and records the execution as cancelled.
        let (cancel_tx, cancel) = oneshot::channel::<()>();
        let me = self
            .arc_self()
            .ok_or_else(|| CoreError::internal("the service is shutting down"))?;
        let task = tokio::spawn(async move {
            let command = req.command.clone();
            let handle = me.start_command(&row, req, params.default_cwd).await?;
            me.run_exec(&row, command, handle, None, cancel).await
        });
        let result = task
            .await
            .map_err(|e| CoreError::internal(format!("the exec task failed: {e}")))?;
        drop(cancel_tx);
        result
    }

    /// The API's `exec_stream`.
    async fn exec_stream(
        &self,
        caller: &Caller,
        id: &str,
        params: ExecParams,
    ) -> Result<ExecStream> {
        let req = validate_exec(&self.config, &params)?;
        let (row, busy) = self.running(caller, id).await?;
        // Started before the stream: a VM out of reach fails the call.
        let command = req.command.clone();
        let keep_running = req.keep_running;
        let handle = self.start_command(&row, req, params.default_cwd).await?;
        let (tx, rx) = mpsc::channel(64);
        let (cancel_tx, cancel_rx) = oneshot::channel();
        // A command that keeps running is not cancelled with its stream:
        // the task holds the cancel, and follows it to its end to record it.
        let (cancel_tx, held) = if keep_running {
            (None, Some(cancel_tx))
        } else {
            (Some(cancel_tx), None)
        };
        let me = self.arc_self();
        tokio::spawn(async move {
            // In use until the command ends, however long it streams.
            let _busy = busy;
            let _held = held;
            let Some(me) = me else { return };
            let last = match me
                .run_exec(&row, command, handle, Some(tx.clone()), cancel_rx)
                .await
            {
                Ok(exec) => ExecEvent::Exit(exec),
                Err(e) => ExecEvent::Error(e),
            };
            let _ = tx.send(last).await;
        });
        Ok(ExecStream {
            events: rx,
            cancel: cancel_tx,
        })
    }

    /// The API's `attach_process`.
    async fn attach_process(&self, caller: &Caller, id: &str, pid: u32) -> Result<ExecStream> {
        let (row, busy) = self.running(caller, id).await?;
        let machines = self.machines_for(&row).await?;
        let longest = std::time::Duration::from_millis(self.config.exec_max_timeout_ms);
        // A follower gets all the command writes from now on (see
        // `validate_exec`); nothing of it is kept here.
        let mut handle = match machines.attach(&row.id, pid, u64::MAX, longest).await {
            Ok(h) => h,
            Err(e) => return Err(self.agent_failure(&row, e).await),
        };
        match handle.next().await {
            Ok(GuestExecEvent::Started(_)) => {}
            Ok(other) => {
                return Err(CoreError::internal(format!(
                    "the sandbox's agent did not start with the command's pid ({other:?})"
                )))
            }
            Err(e) => return Err(self.agent_failure(&row, e).await),
        }
        let (tx, rx) = mpsc::channel(64);
        let (cancel_tx, mut cancel) = oneshot::channel::<()>();
        let attached = Execution {
            id: String::new(),
            object: "execution".into(),
            sandbox_id: row.id.clone(),
            status: crate::model::ExecutionStatus::Running,
            exit_code: None,
            stdout: String::new(),
            stderr: String::new(),
            truncated: false,
            duration_ms: 0,
            started_at: rfc3339(OffsetDateTime::now_utc()),
            finished_at: None,
            pid: Some(pid),
            signal: None,
        };
        tokio::spawn(async move {
            let _busy = busy;
            let _ = tx.send(ExecEvent::Started(attached.clone())).await;
            let (mut out, mut err) = (Utf8Chunker::new(), Utf8Chunker::new());
            loop {
                // The follower went: dropping the handle stops following.
                let ev = tokio::select! {
                    ev = handle.next() => ev,
                    _ = &mut cancel => return,
                };
                let event = match ev {
                    Ok(GuestExecEvent::Started(_)) => continue,
                    Ok(GuestExecEvent::Stdout(b)) => ExecEvent::Stdout(out.push(&b)),
                    Ok(GuestExecEvent::Stderr(b)) => ExecEvent::Stderr(err.push(&b)),
                    Ok(GuestExecEvent::Exited(r)) => {
                        for (rest, stderr) in [(out.finish(), false), (err.finish(), true)] {
                            if !rest.is_empty() {
                                let ev = if stderr {
                                    ExecEvent::Stderr(rest)
                                } else {
                                    ExecEvent::Stdout(rest)
                                };
                                let _ = tx.send(ev).await;
                            }
                        }
                        let _ = tx.send(ExecEvent::Exit(ended(attached, &r))).await;
                        return;
                    }
                    Err(e) => {
                        let _ = tx.send(ExecEvent::Error(runtime_error(e))).await;
                        return;
                    }
                };
                let empty =
                    matches!(&event, ExecEvent::Stdout(s) | ExecEvent::Stderr(s) if s.is_empty());
                if !empty && tx.send(event).await.is_err() {
                    return;
                }
            }
        });
        Ok(ExecStream {
            events: rx,
            cancel: Some(cancel_tx),
        })
    }

    /// The API's `list_processes`.
    async fn list_processes(
        &self,
        caller: &Caller,
        id: &str,
    ) -> Result<Vec<sandpit_protocol::ProcessInfo>> {
        let (row, _busy) = self.running(caller, id).await?;
        let machines = self.machines_for(&row).await?;
        match machines.processes(&row.id).await {
            Ok(list) => Ok(list),
            Err(e) => Err(self.agent_failure(&row, e).await),
        }
    }

    /// The API's `process_call`.
    async fn process_call(
        &self,
        caller: &Caller,
        id: &str,
        pid: u32,
        call: sandpit_protocol::ProcessCall,
        input: Vec<u8>,
    ) -> Result<()> {
        if input.len() as u64 > crate::model::MAX_INPUT_BYTES {
            return Err(CoreError::invalid(format!(
                "{} bytes of input at once; at most {} bytes",
                input.len(),
                crate::model::MAX_INPUT_BYTES
            )));
        }
        let (row, _busy) = self.running(caller, id).await?;
        let machines = self.machines_for(&row).await?;
        match machines.process_call(&row.id, pid, call, input).await {
            Ok(()) => Ok(()),
            Err(e) => Err(self.agent_failure(&row, e).await),
        }
    }

    /// The API's `list_executions`.
    async fn list_executions(
        &self,
        caller: &Caller,
        id: &str,
        q: ListExecutions,
    ) -> Result<List<Execution>> {
        let limit = page_limit(q.limit)?;
        let sandbox = self.owned(caller, id).await?;
        let page = self
            .store
            .list_executions(&sandbox.id, limit, q.starting_after.as_deref())
            .await
            .map_err(|e| match e {
                sandpit_store::StoreError::NotFound(_) => {
                    unknown_cursor("execution", q.starting_after.as_deref().unwrap_or_default())
                }
                e => e.into(),
            })?;
        let data = page.data.iter().map(to_execution).collect();
        Ok(List::page(data, page.has_more, |x| x.id.clone()))
    }

    /// The API's `get_execution`.
    async fn get_execution(&self, caller: &Caller, exec_id: &str) -> Result<Execution> {
        match self.store.execution(exec_id).await? {
            Some(r) if r.account_id == caller.account_id => Ok(to_execution(&r)),
            _ => Err(CoreError::not_found("execution", exec_id)),
        }
    }
}

#[cfg(test)]
mod output_cap_tests {
    use super::within;

    #[test]
    fn output_is_kept_up_to_the_limit_at_a_character_boundary() {
        let mut cut = false;
        assert_eq!(within("", "abc".into(), 10, &mut cut), "abc");
        assert!(!cut);
        assert_eq!(within("abcdefgh", "ijk".into(), 10, &mut cut), "ij");
        assert!(cut);
        let mut cut = false;
        // "é" is two bytes: one byte of room keeps none of it.
        assert_eq!(within("123456789", "é".into(), 10, &mut cut), "");
        assert!(cut);
        let mut cut = false;
        assert_eq!(within("0123456789", String::new(), 10, &mut cut), "");
        assert!(!cut);
    }
}
