//! [`RemoteApi`]: the REST API as a [`SandboxApi`].
//!
//! Why: the MCP adapter (and anything else written against the trait) can
//! then drive a Sandpit server elsewhere (`sandpit mcp --remote URL`) with no
//! code of its own for HTTP. Error bodies come back as the same
//! [`CoreError`] type (and `Retry-After` as `retry_after`), so callers see the
//! same errors as in-process. TLS is rustls (no OpenSSL), trusting both the
//! system's roots and the bundled Mozilla roots.

use crate::bodies::{ExposePortBody, ExtendBody, SignUrlBody};
use crate::error::{kind_for_status, ErrorBody};
use crate::sse::OutputChunk;
use async_trait::async_trait;
use futures::StreamExt;
use reqwest::{header, Method, RequestBuilder, StatusCode, Url};
use sandpit_core::api::prelude::*;
use sandpit_core::error::Result;
use sandpit_core::{
    Account, BuildTemplate, Caller, CoreError, CreateSandbox, CreateSnapshot, CreateVolume,
    Encoding, ErrorType, ExecEvent, ExecParams, ExecStream, Execution, FileContent, FileDeleted,
    FileList, FileWritten, Fork, ForkSandbox, List, ListExecutions, ListSandboxes, ListSnapshots,
    NetworkLists, Port, PutSecret, ResizeVolume, RestoreSandbox, Sandbox, Secret, ServiceInfo,
    SignedUrl, Snapshot, Template, Usage, Volume, WriteFile,
};
use sandpit_core::{CreateWebhook, Event, ListDeliveries, ListEvents, Webhook, WebhookDelivery};
use serde::de::DeserializeOwned;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

/// The environment variable `sandpit mcp --remote` reads the API key from.
pub const API_KEY_ENV: &str = "SANDPIT_API_KEY";

/// A [`SandboxApi`] that forwards every call to a Sandpit server's REST API.
///
/// [`SandboxApi::authenticate`] checks the key with `GET /v1/account` and
/// remembers it for the returned [`Caller`]; later calls as that caller send
/// that key.
pub struct RemoteApi {
    base: Url,
    http: reqwest::Client,
    /// account id -> the key it authenticated with.
    keys: Mutex<HashMap<String, String>>,
}

impl std::fmt::Debug for RemoteApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteApi")
            .field("base", &self.base.as_str())
            .finish_non_exhaustive()
    }
}

impl RemoteApi {
    /// A client of the server at `base_url` (`https://host`, with or without
    /// a trailing `/v1`; a path prefix in front of it is kept).
    pub fn new(base_url: &str) -> Result<Self> {
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .user_agent(concat!("sandpit-remote/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| CoreError::internal(format!("cannot build the HTTP client: {e}")))?;
        Self::with_client(base_url, http)
    }

    /// Like [`RemoteApi::new`] with a client of your own (proxies, timeouts, roots).
    pub fn with_client(base_url: &str, http: reqwest::Client) -> Result<Self> {
        let mut base = Url::parse(base_url.trim())
            .map_err(|e| CoreError::invalid(format!("invalid server URL {base_url:?}: {e}")))?;
        if !matches!(base.scheme(), "http" | "https") || base.cannot_be_a_base() {
            return Err(CoreError::invalid(format!(
                "invalid server URL {base_url:?}: expected http(s)://host[:port][/prefix]"
            )));
        }
        {
            let mut segs = base
                .path_segments_mut()
                .map_err(|_| CoreError::invalid("invalid server URL"))?;
            segs.pop_if_empty();
        }
        if base.path().ends_with("/v1") {
            let mut segs = base.path_segments_mut().expect("checked above");
            segs.pop();
        }
        base.set_query(None);
        base.set_fragment(None);
        Ok(RemoteApi {
            base,
            http,
            keys: Mutex::new(HashMap::new()),
        })
    }

    /// The server's base URL (without `/v1`).
    pub fn base_url(&self) -> &str {
        self.base.as_str()
    }

    fn url(&self, segments: &[&str]) -> Url {
        let mut url = self.base.clone();
        {
            let mut segs = url.path_segments_mut().expect("checked in new");
            segs.pop_if_empty();
            segs.push("v1");
            segs.extend(segments);
        }
        url
    }

    fn key_for(&self, caller: &Caller) -> Result<String> {
        self.keys
            .lock()
            .expect("keys lock")
            .get(&caller.account_id)
            .cloned()
            .ok_or_else(|| {
                CoreError::new(
                    ErrorType::Unauthorized,
                    format!(
                        "no API key for account {:?}: call authenticate first",
                        caller.account_id
                    ),
                )
            })
    }

    fn request(&self, caller: &Caller, method: Method, url: Url) -> Result<RequestBuilder> {
        let key = self.key_for(caller)?;
        Ok(self.http.request(method, url).bearer_auth(key))
    }

    async fn send(&self, req: RequestBuilder) -> Result<reqwest::Response> {
        let resp = req.send().await.map_err(|e| self.transport_error(e))?;
        if resp.status().is_success() {
            Ok(resp)
        } else {
            Err(error_from_response(resp).await)
        }
    }

    async fn call<T: DeserializeOwned>(&self, req: RequestBuilder) -> Result<T> {
        let resp = self.send(req).await?;
        let url = resp.url().clone();
        let bytes = resp.bytes().await.map_err(|e| self.transport_error(e))?;
        serde_json::from_slice(&bytes)
            .map_err(|e| CoreError::internal(format!("unexpected answer from {}: {e}", url.path())))
    }

    fn transport_error(&self, e: reqwest::Error) -> CoreError {
        CoreError::new(
            ErrorType::ServiceUnavailable,
            format!("cannot reach the Sandpit server at {}: {e}", self.base),
        )
    }

    async fn get<T: DeserializeOwned>(&self, caller: &Caller, url: Url) -> Result<T> {
        self.call(self.request(caller, Method::GET, url)?).await
    }

    /// A request that makes something, with its `Idempotency-Key`: what it
    /// made, and whether the server replayed it (200, not 201).
    async fn create<T: DeserializeOwned>(
        &self,
        req: RequestBuilder,
        idempotency_key: Option<String>,
        what: &str,
    ) -> Result<(T, bool)> {
        let req = match idempotency_key {
            Some(k) => req.header("Idempotency-Key", k),
            None => req,
        };
        let resp = self.send(req).await?;
        let replayed = resp.status() == StatusCode::OK;
        let made = resp
            .json()
            .await
            .map_err(|e| CoreError::internal(format!("unexpected answer to {what}: {e}")))?;
        Ok((made, replayed))
    }
}

/// `limit` and `starting_after` as query parameters (none: no query).
fn page_query(url: &mut Url, limit: Option<u32>, starting_after: Option<&str>) {
    {
        let mut pairs = url.query_pairs_mut();
        if let Some(limit) = limit {
            pairs.append_pair("limit", &limit.to_string());
        }
        if let Some(after) = starting_after {
            pairs.append_pair("starting_after", after);
        }
    }
    if url.query() == Some("") {
        url.set_query(None);
    }
}

/// The [`CoreError`] of a non-2xx response: the body's type and message,
/// `Retry-After` as `retry_after`; a body that is not ours is described by
/// its status.
async fn error_from_response(resp: reqwest::Response) -> CoreError {
    let status = resp.status();
    let retry_after = resp
        .headers()
        .get(header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    let text = resp.text().await.unwrap_or_default();
    let mut err = parse_error_body(&text).unwrap_or_else(|| {
        let snippet: String = text.chars().take(300).collect();
        CoreError::new(
            kind_for_status(status.as_u16()),
            format!("HTTP {status} from the Sandpit server: {}", snippet.trim()),
        )
    });
    err.retry_after = retry_after;
    err
}

/// An error body (ours, or one with an error type this version does not know).
fn parse_error_body(text: &str) -> Option<CoreError> {
    if let Ok(body) = serde_json::from_str::<ErrorBody>(text) {
        return Some(CoreError::new(body.error.kind, body.error.message));
    }
    let v: serde_json::Value = serde_json::from_str(text).ok()?;
    let message = v.pointer("/error/message")?.as_str()?.to_owned();
    let kind = v
        .pointer("/error/type")
        .cloned()
        .and_then(|t| serde_json::from_value::<ErrorType>(t).ok())
        .unwrap_or(ErrorType::InternalError);
    Some(CoreError::new(kind, message))
}

#[async_trait]
impl Accounts for RemoteApi {
    async fn authenticate(&self, api_key: &str) -> Result<Caller> {
        let req = self.http.get(self.url(&["account"])).bearer_auth(api_key);
        let account: Account = self.call(req).await?;
        self.keys
            .lock()
            .expect("keys lock")
            .insert(account.id.clone(), api_key.to_owned());
        Ok(Caller::new(account.id, "api key"))
    }

    async fn usage(&self, caller: &Caller, days: Option<u32>) -> Result<Usage> {
        let mut url = self.url(&["usage"]);
        if let Some(d) = days {
            url.query_pairs_mut().append_pair("days", &d.to_string());
        }
        self.get(caller, url).await
    }

    async fn account(&self, caller: &Caller) -> Result<Account> {
        self.get(caller, self.url(&["account"])).await
    }

    async fn service_info(&self) -> Result<ServiceInfo> {
        self.call(self.http.get(self.url(&["service"]))).await
    }
}

#[async_trait]
impl Sandboxes for RemoteApi {
    async fn create_sandbox(
        &self,
        caller: &Caller,
        req: CreateSandbox,
        idempotency_key: Option<String>,
    ) -> Result<(Sandbox, bool)> {
        let r = self
            .request(caller, Method::POST, self.url(&["sandboxes"]))?
            .json(&req);
        self.create(r, idempotency_key, "create").await
    }

    async fn get_sandbox(&self, caller: &Caller, id: &str) -> Result<Sandbox> {
        self.get(caller, self.url(&["sandboxes", id])).await
    }

    async fn list_sandboxes(&self, caller: &Caller, q: ListSandboxes) -> Result<List<Sandbox>> {
        let mut url = self.url(&["sandboxes"]);
        page_query(&mut url, q.limit, q.starting_after.as_deref());
        if let Some(deleted) = q.include_deleted {
            url.query_pairs_mut()
                .append_pair("include_deleted", if deleted { "true" } else { "false" });
        }
        self.get(caller, url).await
    }

    async fn extend_sandbox(
        &self,
        caller: &Caller,
        id: &str,
        additional_minutes: Option<u32>,
    ) -> Result<Sandbox> {
        let r = self
            .request(caller, Method::POST, self.url(&["sandboxes", id, "extend"]))?
            .json(&ExtendBody { additional_minutes });
        self.call(r).await
    }

    async fn destroy_sandbox(&self, caller: &Caller, id: &str) -> Result<Sandbox> {
        let r = self.request(caller, Method::DELETE, self.url(&["sandboxes", id]))?;
        self.call(r).await
    }

    async fn pause_sandbox(&self, caller: &Caller, id: &str) -> Result<Sandbox> {
        let r = self.request(caller, Method::POST, self.url(&["sandboxes", id, "pause"]))?;
        self.call(r).await
    }

    async fn resume_sandbox(&self, caller: &Caller, id: &str) -> Result<Sandbox> {
        let r = self.request(caller, Method::POST, self.url(&["sandboxes", id, "resume"]))?;
        self.call(r).await
    }

    /// `internet_access` is E2B's alone: the REST API's lists say it.
    async fn update_network(
        &self,
        caller: &Caller,
        id: &str,
        lists: NetworkLists,
        internet_access: Option<bool>,
    ) -> Result<Sandbox> {
        if internet_access.is_some() {
            return Err(CoreError::invalid(
                "the REST API changes a sandbox's lists only: say no internet with deny_out [\"0.0.0.0/0\"]",
            ));
        }
        let r = self
            .request(caller, Method::PUT, self.url(&["sandboxes", id, "network"]))?
            .json(&lists);
        self.call(r).await
    }
}

#[async_trait]
impl Snapshots for RemoteApi {
    async fn snapshot_sandbox(
        &self,
        caller: &Caller,
        id: &str,
        req: CreateSnapshot,
        idempotency_key: Option<String>,
    ) -> Result<(Snapshot, bool)> {
        let r = self
            .request(
                caller,
                Method::POST,
                self.url(&["sandboxes", id, "snapshots"]),
            )?
            .json(&req);
        self.create(r, idempotency_key, "snapshot").await
    }

    async fn get_snapshot(&self, caller: &Caller, snapshot_id: &str) -> Result<Snapshot> {
        self.get(caller, self.url(&["snapshots", snapshot_id]))
            .await
    }

    async fn list_snapshots(&self, caller: &Caller, q: ListSnapshots) -> Result<List<Snapshot>> {
        let mut url = self.url(&["snapshots"]);
        page_query(&mut url, q.limit, q.starting_after.as_deref());
        self.get(caller, url).await
    }

    async fn delete_snapshot(&self, caller: &Caller, snapshot_id: &str) -> Result<Snapshot> {
        let r = self.request(
            caller,
            Method::DELETE,
            self.url(&["snapshots", snapshot_id]),
        )?;
        self.call(r).await
    }

    async fn fork_sandbox(&self, caller: &Caller, id: &str, req: ForkSandbox) -> Result<Fork> {
        let r = self
            .request(caller, Method::POST, self.url(&["sandboxes", id, "fork"]))?
            .json(&req);
        self.call(r).await
    }

    async fn restore_sandbox(
        &self,
        caller: &Caller,
        id: &str,
        req: RestoreSandbox,
    ) -> Result<Sandbox> {
        let r = self
            .request(
                caller,
                Method::POST,
                self.url(&["sandboxes", id, "restore"]),
            )?
            .json(&req);
        self.call(r).await
    }
}

#[async_trait]
impl Commands for RemoteApi {
    async fn exec(&self, caller: &Caller, id: &str, mut params: ExecParams) -> Result<Execution> {
        params.stream = None;
        let r = self
            .request(caller, Method::POST, self.url(&["sandboxes", id, "exec"]))?
            .json(&params);
        self.call(r).await
    }

    async fn exec_stream(
        &self,
        caller: &Caller,
        id: &str,
        mut params: ExecParams,
    ) -> Result<ExecStream> {
        params.stream = Some(true);
        let r = self
            .request(caller, Method::POST, self.url(&["sandboxes", id, "exec"]))?
            .header(header::ACCEPT, "text/event-stream")
            .json(&params);
        let resp = self.send(r).await?;
        let is_sse = resp
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        if !is_sse {
            return Err(CoreError::internal(
                "the server answered a streaming exec without an event stream",
            ));
        }
        let (tx, rx) = mpsc::channel(64);
        let (cancel_tx, cancel_rx) = oneshot::channel();
        tokio::spawn(pump_events(resp, tx, cancel_rx));
        Ok(ExecStream {
            events: rx,
            cancel: Some(cancel_tx),
        })
    }

    async fn get_execution(&self, caller: &Caller, exec_id: &str) -> Result<Execution> {
        self.get(caller, self.url(&["executions", exec_id])).await
    }

    async fn list_executions(
        &self,
        caller: &Caller,
        id: &str,
        q: ListExecutions,
    ) -> Result<List<Execution>> {
        let mut url = self.url(&["sandboxes", id, "executions"]);
        page_query(&mut url, q.limit, q.starting_after.as_deref());
        self.get(caller, url).await
    }
}

#[async_trait]
impl Files for RemoteApi {
    async fn write_file(&self, caller: &Caller, id: &str, req: WriteFile) -> Result<FileWritten> {
        let r = self
            .request(caller, Method::PUT, self.url(&["sandboxes", id, "files"]))?
            .json(&req);
        self.call(r).await
    }

    async fn read_file(
        &self,
        caller: &Caller,
        id: &str,
        path: &str,
        encoding: Encoding,
    ) -> Result<FileContent> {
        let mut url = self.url(&["sandboxes", id, "files"]);
        url.query_pairs_mut().append_pair("path", path).append_pair(
            "encoding",
            match encoding {
                Encoding::Utf8 => "utf8",
                Encoding::Base64 => "base64",
            },
        );
        self.get(caller, url).await
    }

    async fn list_files(
        &self,
        caller: &Caller,
        id: &str,
        path: Option<&str>,
        recursive: bool,
    ) -> Result<FileList> {
        let mut url = self.url(&["sandboxes", id, "files"]);
        {
            let mut pairs = url.query_pairs_mut();
            if let Some(p) = path {
                pairs.append_pair("path", p);
            }
            pairs
                .append_pair("list", "true")
                .append_pair("recursive", if recursive { "true" } else { "false" });
        }
        self.get(caller, url).await
    }

    async fn delete_file(
        &self,
        caller: &Caller,
        id: &str,
        path: &str,
        recursive: bool,
    ) -> Result<FileDeleted> {
        let mut url = self.url(&["sandboxes", id, "files"]);
        url.query_pairs_mut()
            .append_pair("path", path)
            .append_pair("recursive", if recursive { "true" } else { "false" });
        self.call(self.request(caller, Method::DELETE, url)?).await
    }
}

#[async_trait]
impl Ports for RemoteApi {
    async fn expose_port(
        &self,
        caller: &Caller,
        id: &str,
        port: u16,
        private: bool,
    ) -> Result<Port> {
        let r = self
            .request(caller, Method::POST, self.url(&["sandboxes", id, "ports"]))?
            .json(&ExposePortBody { port, private });
        self.call(r).await
    }

    async fn sign_preview_url(
        &self,
        caller: &Caller,
        id: &str,
        port: u16,
        expires_in_seconds: Option<u64>,
    ) -> Result<SignedUrl> {
        let url = self.url(&["sandboxes", id, "ports", &port.to_string(), "signed-url"]);
        let r = self
            .request(caller, Method::POST, url)?
            .json(&SignUrlBody { expires_in_seconds });
        self.call(r).await
    }

    async fn list_ports(&self, caller: &Caller, id: &str) -> Result<List<Port>> {
        self.get(caller, self.url(&["sandboxes", id, "ports"]))
            .await
    }

    async fn close_port(&self, caller: &Caller, id: &str, port: u16) -> Result<()> {
        let url = self.url(&["sandboxes", id, "ports", &port.to_string()]);
        self.send(self.request(caller, Method::DELETE, url)?)
            .await?;
        Ok(())
    }
}

/// Terminals over a remote server's WebSocket are the dashboard's and
/// `sandpit sandbox shell`'s: this client answers as a backend without them.
#[async_trait]
impl Terminals for RemoteApi {}

#[async_trait]
impl Templates for RemoteApi {
    async fn build_template(&self, caller: &Caller, req: BuildTemplate) -> Result<Template> {
        let r = self
            .request(caller, Method::POST, self.url(&["templates"]))?
            .json(&req);
        self.call(r).await
    }

    async fn get_template(&self, caller: &Caller, id: &str) -> Result<Template> {
        self.get(caller, self.url(&["templates", id])).await
    }

    async fn list_templates(&self, caller: &Caller) -> Result<List<Template>> {
        self.get(caller, self.url(&["templates"])).await
    }

    async fn delete_template(&self, caller: &Caller, id: &str) -> Result<Template> {
        let r = self.request(caller, Method::DELETE, self.url(&["templates", id]))?;
        self.call(r).await
    }

    async fn upload_template_files(
        &self,
        caller: &Caller,
        sha256: &str,
        tar: Vec<u8>,
    ) -> Result<()> {
        let r = self
            .request(
                caller,
                Method::PUT,
                self.url(&["templates", "files", sha256]),
            )?
            .header(header::CONTENT_TYPE, "application/x-tar")
            .body(tar);
        self.send(r).await?;
        Ok(())
    }
}

#[async_trait]
impl Secrets for RemoteApi {
    async fn put_secret(&self, caller: &Caller, name: &str, req: PutSecret) -> Result<Secret> {
        let r = self
            .request(caller, Method::PUT, self.url(&["secrets", name]))?
            .json(&req);
        self.call(r).await
    }

    async fn list_secrets(&self, caller: &Caller) -> Result<List<Secret>> {
        self.get(caller, self.url(&["secrets"])).await
    }

    async fn delete_secret(&self, caller: &Caller, name: &str) -> Result<Secret> {
        let r = self.request(caller, Method::DELETE, self.url(&["secrets", name]))?;
        self.call(r).await
    }
}

#[async_trait]
impl Volumes for RemoteApi {
    async fn create_volume(
        &self,
        caller: &Caller,
        req: CreateVolume,
        idempotency_key: Option<String>,
    ) -> Result<(Volume, bool)> {
        let r = self
            .request(caller, Method::POST, self.url(&["volumes"]))?
            .json(&req);
        self.create(r, idempotency_key, "create_volume").await
    }

    async fn list_volumes(&self, caller: &Caller) -> Result<List<Volume>> {
        self.get(caller, self.url(&["volumes"])).await
    }

    async fn get_volume(&self, caller: &Caller, volume: &str) -> Result<Volume> {
        self.get(caller, self.url(&["volumes", volume])).await
    }

    async fn resize_volume(
        &self,
        caller: &Caller,
        volume: &str,
        req: ResizeVolume,
    ) -> Result<Volume> {
        let r = self
            .request(caller, Method::PATCH, self.url(&["volumes", volume]))?
            .json(&req);
        self.call(r).await
    }

    async fn delete_volume(&self, caller: &Caller, volume: &str) -> Result<Volume> {
        let r = self.request(caller, Method::DELETE, self.url(&["volumes", volume]))?;
        self.call(r).await
    }

    async fn move_volume(&self, caller: &Caller, volume: &str, node: &str) -> Result<Volume> {
        let r = self
            .request(caller, Method::POST, self.url(&["volumes", volume, "move"]))?
            .json(&sandpit_core::MoveVolume {
                node: node.to_string(),
            });
        self.call(r).await
    }
}

#[async_trait]
impl Events for RemoteApi {
    /// `GET /v1/sandboxes/{id}/events` when one sandbox's are asked for,
    /// else `GET /v1/events`.
    async fn list_events(&self, caller: &Caller, q: ListEvents) -> Result<List<Event>> {
        let mut url = match &q.sandbox_id {
            Some(id) => self.url(&["sandboxes", id, "events"]),
            None => self.url(&["events"]),
        };
        {
            let mut pairs = url.query_pairs_mut();
            if let Some(limit) = q.limit {
                pairs.append_pair("limit", &limit.to_string());
            }
            if let Some(after) = &q.after {
                pairs.append_pair("after", after);
            }
        }
        if url.query() == Some("") {
            url.set_query(None);
        }
        self.get(caller, url).await
    }

    async fn create_webhook(&self, caller: &Caller, req: CreateWebhook) -> Result<Webhook> {
        let r = self
            .request(caller, Method::POST, self.url(&["webhooks"]))?
            .json(&req);
        self.call(r).await
    }

    async fn list_webhooks(&self, caller: &Caller) -> Result<List<Webhook>> {
        self.get(caller, self.url(&["webhooks"])).await
    }

    async fn get_webhook(&self, caller: &Caller, id: &str) -> Result<Webhook> {
        self.get(caller, self.url(&["webhooks", id])).await
    }

    async fn delete_webhook(&self, caller: &Caller, id: &str) -> Result<Webhook> {
        let r = self.request(caller, Method::DELETE, self.url(&["webhooks", id]))?;
        self.call(r).await
    }

    async fn list_deliveries(
        &self,
        caller: &Caller,
        webhook_id: &str,
        q: ListDeliveries,
    ) -> Result<List<WebhookDelivery>> {
        let mut url = self.url(&["webhooks", webhook_id, "deliveries"]);
        page_query(&mut url, q.limit, q.starting_after.as_deref());
        self.get(caller, url).await
    }

    async fn redeliver(
        &self,
        caller: &Caller,
        webhook_id: &str,
        delivery_id: &str,
    ) -> Result<WebhookDelivery> {
        let url = self.url(&[
            "webhooks",
            webhook_id,
            "deliveries",
            delivery_id,
            "redeliver",
        ]);
        self.call(self.request(caller, Method::POST, url)?).await
    }
}

/// Read the event stream into `tx` until the last event, the receiver's
/// drop, or `cancel`; returning drops the response, which closes the
/// connection, which makes the server cancel the command.
async fn pump_events(
    resp: reqwest::Response,
    tx: mpsc::Sender<ExecEvent>,
    mut cancel: oneshot::Receiver<()>,
) {
    let mut body = resp.bytes_stream();
    let mut parser = SseParser::default();
    loop {
        let chunk = tokio::select! {
            _ = &mut cancel => return,
            _ = tx.closed() => return,
            chunk = body.next() => chunk,
        };
        let bytes = match chunk {
            Some(Ok(b)) => b,
            Some(Err(e)) => {
                let _ = tx
                    .send(ExecEvent::Error(CoreError::new(
                        ErrorType::ServiceUnavailable,
                        format!("the event stream broke: {e}"),
                    )))
                    .await;
                return;
            }
            None => {
                let _ = tx
                    .send(ExecEvent::Error(CoreError::new(
                        ErrorType::ServiceUnavailable,
                        "the event stream ended before the exit event",
                    )))
                    .await;
                return;
            }
        };
        for (name, data) in parser.push(&bytes) {
            let Some(event) = decode_event(&name, &data) else {
                continue;
            };
            let last = matches!(event, ExecEvent::Exit(_) | ExecEvent::Error(_));
            if tx.send(event).await.is_err() || last {
                return;
            }
        }
    }
}

fn decode_event(name: &str, data: &str) -> Option<ExecEvent> {
    let bad = |e: serde_json::Error| {
        ExecEvent::Error(CoreError::internal(format!(
            "malformed `{name}` event from the server: {e}"
        )))
    };
    Some(match name {
        "start" => serde_json::from_str::<Execution>(data)
            .map(ExecEvent::Started)
            .unwrap_or_else(bad),
        "stdout" => serde_json::from_str::<OutputChunk>(data)
            .map(|c| ExecEvent::Stdout(c.data))
            .unwrap_or_else(bad),
        "stderr" => serde_json::from_str::<OutputChunk>(data)
            .map(|c| ExecEvent::Stderr(c.data))
            .unwrap_or_else(bad),
        "exit" => serde_json::from_str::<Execution>(data)
            .map(ExecEvent::Exit)
            .unwrap_or_else(bad),
        "error" => ExecEvent::Error(parse_error_body(data).unwrap_or_else(|| {
            CoreError::internal(format!("the server reported an error: {data}"))
        })),
        // Unknown event types are for newer clients.
        _ => return None,
    })
}

/// An incremental `text/event-stream` parser (the subset the server sends:
/// `event`, `data`, comments; `id` and `retry` are ignored).
#[derive(Default)]
pub(crate) struct SseParser {
    buf: Vec<u8>,
    event: String,
    data: Vec<String>,
}

impl SseParser {
    /// Feed bytes; get the complete events as `(event name, data)`.
    pub(crate) fn push(&mut self, bytes: &[u8]) -> Vec<(String, String)> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        while let Some(pos) = self.buf.iter().position(|&b| b == b'\n' || b == b'\r') {
            // A CR LF pair is one line end; wait for the LF if only the CR has arrived.
            let crlf = self.buf[pos] == b'\r';
            if crlf && pos + 1 == self.buf.len() {
                break;
            }
            let end = if crlf && self.buf[pos + 1] == b'\n' {
                pos + 2
            } else {
                pos + 1
            };
            let line: Vec<u8> = self.buf.drain(..end).take(pos).collect();
            let line = String::from_utf8_lossy(&line);
            self.line(&line, &mut out);
        }
        out
    }

    fn line(&mut self, line: &str, out: &mut Vec<(String, String)>) {
        if line.is_empty() {
            if !self.data.is_empty() {
                let name = if self.event.is_empty() {
                    "message".to_owned()
                } else {
                    std::mem::take(&mut self.event)
                };
                out.push((name, self.data.join("\n")));
            }
            self.event.clear();
            self.data.clear();
            return;
        }
        if line.starts_with(':') {
            return;
        }
        let (field, value) = line.split_once(':').unwrap_or((line, ""));
        let value = value.strip_prefix(' ').unwrap_or(value);
        match field {
            "event" => self.event = value.to_owned(),
            "data" => self.data.push(value.to_owned()),
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_parser_handles_split_frames_comments_and_crlf() {
        let mut p = SseParser::default();
        assert!(p.push(b": ping\n\nevent: std").is_empty());
        let ev = p.push(b"out\ndata: {\"data\":\"a\"}\n\n");
        assert_eq!(ev, vec![("stdout".into(), "{\"data\":\"a\"}".into())]);
        let ev = p.push(b"event: exit\r\ndata: 1\r\ndata: 2\r");
        assert!(ev.is_empty());
        let ev = p.push(b"\n\r\n");
        assert_eq!(ev, vec![("exit".into(), "1\n2".into())]);
    }

    #[test]
    fn base_urls_are_normalized() {
        for (given, want) in [
            ("http://h:1", "http://h:1/v1/account"),
            ("http://h:1/", "http://h:1/v1/account"),
            ("http://h:1/v1", "http://h:1/v1/account"),
            ("http://h:1/v1/", "http://h:1/v1/account"),
            ("https://h/sandpit/", "https://h/sandpit/v1/account"),
        ] {
            let api = RemoteApi::new(given).unwrap();
            assert_eq!(api.url(&["account"]).as_str(), want, "{given}");
        }
        let api = RemoteApi::new("http://h").unwrap();
        assert_eq!(
            api.url(&["sandboxes", "a/b c"]).as_str(),
            "http://h/v1/sandboxes/a%2Fb%20c"
        );
        assert!(RemoteApi::new("ftp://h").is_err());
        assert!(RemoteApi::new("not a url").is_err());
    }

    #[test]
    fn foreign_error_bodies() {
        let e = parse_error_body(r#"{"error":{"type":"brand_new","message":"m"}}"#).unwrap();
        assert_eq!(e.kind, ErrorType::InternalError);
        assert_eq!(e.message, "m");
        assert!(parse_error_body("<html>").is_none());
    }
}
