//! A minimal QMP (QEMU Machine Protocol) client: greeting, capability
//! negotiation, commands, and asynchronous events (SHUTDOWN carries why the
//! guest went away).
//!
//! QMP is line-delimited JSON; the few commands the runtime needs (`quit`,
//! `query-status`, later `migrate`) do not justify a generated binding.

use crate::{Result, RuntimeError};
use serde_json::{json, Value};
use std::path::Path;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};

/// A connected, negotiated QMP session.
pub struct Qmp {
    reader: BufReader<OwnedReadHalf>,
    writer: OwnedWriteHalf,
    /// Events seen while waiting for command replies.
    pub events: Vec<Value>,
}

impl Qmp {
    /// Connect to a QMP socket and negotiate capabilities.
    pub async fn connect(path: &Path) -> Result<Qmp> {
        let stream = crate::channel::connect_qemu_socket(path)
            .await
            .map_err(RuntimeError::io(format!(
                "connecting to QMP at {}",
                path.display()
            )))?;
        let (r, w) = stream.into_split();
        let mut qmp = Qmp {
            reader: BufReader::new(r),
            writer: w,
            events: Vec::new(),
        };
        let greeting = qmp.read_value().await?;
        if greeting.get("QMP").is_none() {
            return Err(RuntimeError::Launch(format!(
                "unexpected QMP greeting: {greeting}"
            )));
        }
        qmp.execute("qmp_capabilities", json!({})).await?;
        Ok(qmp)
    }

    async fn read_value(&mut self) -> Result<Value> {
        let mut line = String::new();
        let n = self
            .reader
            .read_line(&mut line)
            .await
            .map_err(RuntimeError::io("reading QMP"))?;
        if n == 0 {
            return Err(RuntimeError::Disconnected("QMP socket closed".into()));
        }
        serde_json::from_str(&line)
            .map_err(|e| RuntimeError::Launch(format!("bad QMP message {line:?}: {e}")))
    }

    /// Run one command and return its `return` value.
    pub async fn execute(&mut self, command: &str, arguments: Value) -> Result<Value> {
        let bytes = command_line(command, arguments);
        self.writer
            .write_all(&bytes)
            .await
            .map_err(RuntimeError::io("writing QMP"))?;
        self.reply_to(command).await
    }

    /// Run one command with a descriptor passed along it (`SCM_RIGHTS`),
    /// as `add-fd` takes one: QEMU, unprivileged and confined, then uses a
    /// file the host opened.
    pub async fn execute_with_fd(
        &mut self,
        command: &str,
        arguments: Value,
        fd: std::os::fd::BorrowedFd<'_>,
    ) -> Result<Value> {
        use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
        use std::os::fd::AsRawFd;
        let bytes = command_line(command, arguments);
        let stream: &tokio::net::UnixStream = self.writer.as_ref();
        let fds = [fd.as_raw_fd()];
        let sent = loop {
            stream
                .writable()
                .await
                .map_err(RuntimeError::io("writing QMP"))?;
            let tried = stream.try_io(tokio::io::Interest::WRITABLE, || {
                let iov = [std::io::IoSlice::new(&bytes)];
                let rights = [ControlMessage::ScmRights(&fds)];
                sendmsg::<()>(stream.as_raw_fd(), &iov, &rights, MsgFlags::empty(), None)
                    .map_err(std::io::Error::from)
            });
            match tried {
                Ok(n) => break n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(RuntimeError::io("writing QMP")(e)),
            }
        };
        self.writer
            .write_all(&bytes[sent..])
            .await
            .map_err(RuntimeError::io("writing QMP"))?;
        self.reply_to(command).await
    }

    /// The answer to `command`, just sent (events meanwhile are kept).
    async fn reply_to(&mut self, command: &str) -> Result<Value> {
        loop {
            let v = self.read_value().await?;
            if let Some(ret) = v.get("return") {
                return Ok(ret.clone());
            }
            if let Some(err) = v.get("error") {
                return Err(RuntimeError::Launch(format!("QMP {command} failed: {err}")));
            }
            if v.get("event").is_some() {
                self.events.push(v);
            }
        }
    }

    /// Turn on `x-ignore-shared` (both ends of a template save/restore): RAM
    /// in a shared, named file is not copied, the file is the RAM.
    pub async fn ignore_shared_ram(&mut self) -> Result<()> {
        self.execute(
            "migrate-set-capabilities",
            json!({"capabilities": [{"capability": "x-ignore-shared", "state": true}]}),
        )
        .await
        .map(drop)
    }

    /// Wait until the migration this QEMU runs (outgoing, or incoming on a
    /// destination) has completed; `what` names it in errors. 60 s at most.
    pub async fn wait_migration(&mut self, what: &str) -> Result<()> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            let st = self.execute("query-migrate", json!({})).await?;
            match st.get("status").and_then(|s| s.as_str()).unwrap_or("") {
                "completed" => return Ok(()),
                "failed" | "cancelled" => {
                    return Err(RuntimeError::Launch(format!(
                        "{what} failed: {}",
                        st.get("error-desc").unwrap_or(&st)
                    )))
                }
                _ if std::time::Instant::now() > deadline => {
                    return Err(RuntimeError::Launch(format!("{what} took over 60 s")))
                }
                _ => tokio::time::sleep(std::time::Duration::from_millis(5)).await,
            }
        }
    }

    /// Wait for the next event (or the socket closing, which means QEMU exited).
    pub async fn next_event(&mut self) -> Result<Value> {
        if !self.events.is_empty() {
            return Ok(self.events.remove(0));
        }
        loop {
            let v = self.read_value().await?;
            if v.get("event").is_some() {
                return Ok(v);
            }
        }
    }
}

/// `command` with `arguments`, as a QMP line.
fn command_line(command: &str, arguments: Value) -> Vec<u8> {
    let msg = json!({"execute": command, "arguments": arguments});
    let mut bytes = serde_json::to_vec(&msg).expect("json");
    bytes.push(b'\n');
    bytes
}
