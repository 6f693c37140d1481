//! The operations an agent can ask for, as one trait. The core service
//! implements it over local VMs; a REST client implements it for a remote
//! server. The REST and MCP adapters take an `Arc<dyn SandboxApi>` and
//! translate, nothing more.

use crate::error::Result;
use crate::model::*;
use async_trait::async_trait;
use tokio::sync::mpsc;

/// Who is asking: an authenticated account.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub account_id: String,
}

/// One event of a streaming execution.
#[derive(Debug, Clone, PartialEq)]
pub enum ExecEvent {
    /// Output, decoded as UTF-8 without splitting characters across chunks.
    Stdout(String),
    Stderr(String),
    /// The last event: the execution object (also stored).
    Exit(Execution),
    /// The platform failed mid-way; the last event.
    Error(crate::error::CoreError),
}

/// A running command's events. Dropping it before `Exit` cancels the command
/// (it is then recorded as `cancelled`).
pub struct ExecStream {
    pub events: mpsc::Receiver<ExecEvent>,
    /// Dropped or fired: cancel.
    pub cancel: Option<tokio::sync::oneshot::Sender<()>>,
}

impl ExecStream {
    pub async fn next(&mut self) -> Option<ExecEvent> {
        self.events.recv().await
    }
}

impl Drop for ExecStream {
    fn drop(&mut self) {
        if let Some(c) = self.cancel.take() {
            let _ = c.send(());
        }
    }
}

/// Everything an account can do with its sandboxes.
#[async_trait]
pub trait SandboxApi: Send + Sync {
    /// Resolve an API key to its account (`unauthorized` if unknown or revoked).
    async fn authenticate(&self, api_key: &str) -> Result<Caller>;

    async fn create_sandbox(
        &self,
        caller: &Caller,
        req: CreateSandbox,
        idempotency_key: Option<String>,
    ) -> Result<(Sandbox, bool)>;
    async fn get_sandbox(&self, caller: &Caller, id: &str) -> Result<Sandbox>;
    async fn list_sandboxes(&self, caller: &Caller, q: ListSandboxes) -> Result<List<Sandbox>>;
    async fn extend_sandbox(
        &self,
        caller: &Caller,
        id: &str,
        additional_minutes: Option<u32>,
    ) -> Result<Sandbox>;
    async fn destroy_sandbox(&self, caller: &Caller, id: &str) -> Result<Sandbox>;

    /// Run a command to completion.
    async fn exec(&self, caller: &Caller, id: &str, params: ExecParams) -> Result<Execution>;
    /// Run a command, streaming its output.
    async fn exec_stream(
        &self,
        caller: &Caller,
        id: &str,
        params: ExecParams,
    ) -> Result<ExecStream>;
    async fn get_execution(&self, caller: &Caller, exec_id: &str) -> Result<Execution>;

    async fn write_file(&self, caller: &Caller, id: &str, req: WriteFile) -> Result<FileWritten>;
    async fn read_file(
        &self,
        caller: &Caller,
        id: &str,
        path: &str,
        encoding: Encoding,
    ) -> Result<FileContent>;
    async fn list_files(
        &self,
        caller: &Caller,
        id: &str,
        path: Option<&str>,
        recursive: bool,
    ) -> Result<FileList>;
    async fn delete_file(
        &self,
        caller: &Caller,
        id: &str,
        path: &str,
        recursive: bool,
    ) -> Result<FileDeleted>;

    async fn expose_port(&self, caller: &Caller, id: &str, port: u16) -> Result<Port>;
    async fn list_ports(&self, caller: &Caller, id: &str) -> Result<List<Port>>;
    async fn close_port(&self, caller: &Caller, id: &str, port: u16) -> Result<()>;

    async fn usage(&self, caller: &Caller, days: Option<u32>) -> Result<Usage>;
    async fn account(&self, caller: &Caller) -> Result<Account>;
    /// No key needed.
    async fn service_info(&self) -> Result<ServiceInfo>;
}
