//! The fake's guest: the few commands it knows (see the crate's table), as
//! the events a real command's stream would carry.

use super::*;

pub(crate) enum Output {
    Stdout(String),
    Stderr(String),
}

pub(crate) enum End {
    Exit(i32),
    TimedOut,
    /// Until cancelled, or timed out.
    Hang,
    /// The VM is lost under the command.
    Lost,
    /// The stream ends without an exit.
    Vanish,
}

/// What a command does in the fake's guest (the table in the crate doc).
pub(crate) struct Script {
    pub(crate) output: Vec<Output>,
    pub(crate) end: End,
    pub(crate) timeout: Duration,
}

impl Script {
    pub(crate) fn of(command: &str, timeout_ms: u64) -> Script {
        use Output::*;
        let (output, end) = match command {
            "make" => (
                vec![
                    Stdout("hello ".into()),
                    Stderr("warning\n".into()),
                    Stdout("world\n".into()),
                ],
                End::Exit(0),
            ),
            "hang" => (vec![Stdout("started\n".into())], End::Hang),
            "crash" => (vec![Stdout("partial".into())], End::Lost),
            "vanish" => (vec![Stderr("bye".into())], End::Vanish),
            c => match c.strip_prefix("sleep ").map(|s| s.trim().parse::<u64>()) {
                Some(Ok(secs)) if secs.saturating_mul(1000) >= timeout_ms => {
                    (vec![], End::TimedOut)
                }
                Some(Ok(_)) => (vec![], End::Exit(0)),
                _ => (vec![Stdout(format!("ran {c}\n"))], End::Exit(0)),
            },
        };
        Script {
            output,
            end,
            timeout: Duration::from_millis(timeout_ms),
        }
    }

    /// Send the events, then the end, and record how the command ended.
    pub(crate) async fn run(
        self,
        mut exec: Execution,
        state: Arc<Mutex<State>>,
        cancels: Arc<Cancels>,
        tx: mpsc::Sender<ExecEvent>,
        mut cancel: oneshot::Receiver<()>,
    ) {
        let _ = tx.send(ExecEvent::Started(exec.clone())).await;
        for out in self.output {
            let event = match out {
                Output::Stdout(s) => {
                    exec.stdout.push_str(&s);
                    ExecEvent::Stdout(s)
                }
                Output::Stderr(s) => {
                    exec.stderr.push_str(&s);
                    ExecEvent::Stderr(s)
                }
            };
            let _ = tx.send(event).await;
        }
        let started = tokio::time::Instant::now();
        let mut was_cancelled = false;
        let ended = match self.end {
            End::Exit(code) => Ok((ExecutionStatus::Completed, code)),
            End::TimedOut => Ok((ExecutionStatus::TimedOut, KILLED)),
            End::Hang => {
                tokio::select! {
                    _ = &mut cancel => was_cancelled = true,
                    _ = tx.closed() => was_cancelled = true,
                    _ = tokio::time::sleep(self.timeout) => {}
                }
                match was_cancelled {
                    true => Ok((ExecutionStatus::Cancelled, KILLED)),
                    false => Ok((ExecutionStatus::TimedOut, KILLED)),
                }
            }
            End::Lost => Err(Some(CoreError::new(
                ErrorType::ServiceUnavailable,
                "the host lost the VM",
            ))),
            End::Vanish => Err(None),
        };
        exec.duration_ms = match self.end {
            End::TimedOut => self.timeout.as_millis() as u64,
            _ => 3 + started.elapsed().as_millis() as u64,
        };
        exec.finished_at = Some(T0.into());
        if let Ok((status, code)) = ended {
            exec.status = status;
            exec.exit_code = Some(code);
        }
        if let Some((_, kept)) = state.lock().unwrap().executions.get_mut(&exec.id) {
            *kept = exec.clone();
        }
        if was_cancelled {
            cancels.count.fetch_add(1, Ordering::SeqCst);
            cancels.seen.notify_waiters();
        }
        let last = match ended {
            Ok(_) => ExecEvent::Exit(exec),
            Err(Some(e)) => ExecEvent::Error(e),
            Err(None) => return,
        };
        let _ = tx.send(last).await;
    }
}

// ---- the API ---------------------------------------------------------------
