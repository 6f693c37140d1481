//! `filesystem.Filesystem`'s directory watches, over the core's
//! `watch_dir` (an inotify watch in the guest, as the guest user).
//!
//! The SDKs watch two ways. JavaScript and async Python call `WatchDir`, a
//! server stream: a `start` event once the watch is set, then each change
//! as it comes, `keepalive`s while nothing does; the client going stops
//! the watch. Sync Python polls: `CreateWatcher` sets a watch whose events
//! wait here, `GetWatcherEvents` takes what came since, `RemoveWatcher`
//! stops it. What waits is bounded ([`MOST_WAITING`] events; past that the
//! watcher ends saying events were lost, rather than keep a gap nobody
//! sees), and a watcher nobody polled for [`UNPOLLED_LIFETIME`] is
//! stopped, as a client that forgot it would otherwise keep its sandbox
//! busy until it ends.

use super::connect::{self, Stream};
use super::{check_user, guest_path, named_user, ForSandbox};
use crate::error::RpcError;
use crate::E2b;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use sandpit_core::DirWatchStream;
use sandpit_protocol::{WatchEvent, WatchEventKind};
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

static NEXT_WATCHER: AtomicU64 = AtomicU64::new(1);

/// Most events waiting for a sync client's poll, per watcher.
pub const MOST_WAITING: usize = 10_000;

/// How long a polled watcher lives without a poll.
pub const UNPOLLED_LIFETIME: Duration = Duration::from_secs(600);

/// How often a watcher checks it is still polled.
const POLL_CHECK: Duration = Duration::from_secs(10);

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
struct Request {
    path: String,
    recursive: bool,
    include_entry: bool,
    allow_network_mounts: bool,
    watcher_id: String,
}

/// The sync SDK's watchers, by id.
#[derive(Clone, Default)]
pub struct Watchers(Arc<Mutex<HashMap<String, Watcher>>>);

struct Watcher {
    sandbox_id: String,
    account_id: String,
    /// Events not yet taken, as envd's `FilesystemEvent`s.
    waiting: Vec<Value>,
    /// Why the watch ended, once it did: given after the last events.
    ended: Option<RpcError>,
    polled: Instant,
    task: tokio::task::AbortHandle,
}

impl Watchers {
    /// Watcher `id`, if it is the caller's, for `sandbox`.
    fn with<T>(
        &self,
        id: &str,
        sandbox: &ForSandbox,
        f: impl FnOnce(&mut Watcher) -> T,
    ) -> Result<T, RpcError> {
        let mut all = self.0.lock().unwrap();
        match all.get_mut(id) {
            Some(w) if w.sandbox_id == sandbox.id && w.account_id == sandbox.caller.account_id => {
                Ok(f(w))
            }
            _ => Err(RpcError::new(
                "not_found",
                format!("watcher with id {id} not found"),
            )),
        }
    }

    fn remove(&self, id: &str) -> Option<Watcher> {
        self.0.lock().unwrap().remove(id)
    }
}

/// The request's options, checked: what is not built is refused by name.
fn checked(headers: &HeaderMap, body: &[u8]) -> Result<Request, RpcError> {
    check_user(named_user(headers).as_deref())?;
    let req: Request = connect::request(headers, body)?;
    if req.include_entry {
        return Err(RpcError::unimplemented(
            "include_entry (each event's entry info) in a watch",
        ));
    }
    if req.allow_network_mounts {
        return Err(RpcError::new(
            "invalid_argument",
            "a sandbox has no network mounts to watch",
        ));
    }
    Ok(req)
}

/// A watch set in the sandbox, or why not.
async fn watch(e2b: &E2b, sandbox: &ForSandbox, req: &Request) -> Result<DirWatchStream, RpcError> {
    e2b.api
        .watch_dir(
            &sandbox.caller,
            &sandbox.id,
            &guest_path(&req.path),
            req.recursive,
        )
        .await
        .map_err(RpcError::from)
}

/// `POST /filesystem.Filesystem/WatchDir`: a server stream.
pub async fn watch_dir(
    State(e2b): State<E2b>,
    sandbox: ForSandbox,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let req = match checked(&headers, &body) {
        Ok(r) => r,
        Err(e) => return connect::failed(e).await,
    };
    let mut watched = match watch(&e2b, &sandbox, &req).await {
        Ok(w) => w,
        Err(e) => return connect::failed(e).await,
    };
    let keepalive = super::process::keepalive(&headers);
    let (response, stream) = Stream::open();
    tokio::spawn(async move {
        if !stream.send(&json!({"start": {}})).await {
            return;
        }
        let mut tick = tokio::time::interval(Duration::from_secs(keepalive));
        tick.tick().await;
        let error = loop {
            let next = tokio::select! {
                next = watched.events.recv() => next,
                _ = tick.tick() => {
                    if !stream.send(&json!({"keepalive": {}})).await {
                        return;
                    }
                    continue;
                }
                // The client went: dropping the watch stops it.
                _ = stream.closed() => return,
            };
            match next {
                Some(Ok(events)) => {
                    for e in &events {
                        if !stream.send(&json!({"filesystem": event(e)})).await {
                            return;
                        }
                    }
                }
                Some(Err(e)) => break Some(RpcError::from(e)),
                None => break None,
            }
        };
        stream.end(error).await;
    });
    response
}

/// `CreateWatcher`, `GetWatcherEvents` and `RemoveWatcher`: unary.
pub async fn polled(
    e2b: &E2b,
    sandbox: &ForSandbox,
    method: &str,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<Value, RpcError> {
    let req = checked(headers, body)?;
    match method {
        "CreateWatcher" => {
            let watched = watch(e2b, sandbox, &req).await?;
            // Only its own sandbox's token, of its own account, reaches it.
            let id = format!("watcher-{}", NEXT_WATCHER.fetch_add(1, Ordering::Relaxed));
            let task = tokio::spawn(gather(e2b.watchers.clone(), id.clone(), watched));
            e2b.watchers.0.lock().unwrap().insert(
                id.clone(),
                Watcher {
                    sandbox_id: sandbox.id.clone(),
                    account_id: sandbox.caller.account_id.clone(),
                    waiting: Vec::new(),
                    ended: None,
                    polled: Instant::now(),
                    task: task.abort_handle(),
                },
            );
            Ok(json!({"watcherId": id}))
        }
        "GetWatcherEvents" => {
            let (events, ended) = e2b.watchers.with(&req.watcher_id, sandbox, |w| {
                w.polled = Instant::now();
                let events = std::mem::take(&mut w.waiting);
                // The end is told once the events before it are taken.
                let ended = if events.is_empty() {
                    w.ended.take()
                } else {
                    None
                };
                (events, ended)
            })?;
            if let Some(e) = ended {
                e2b.watchers.remove(&req.watcher_id);
                return Err(e);
            }
            Ok(json!({"events": events}))
        }
        "RemoveWatcher" => {
            e2b.watchers.with(&req.watcher_id, sandbox, |_| ())?;
            if let Some(w) = e2b.watchers.remove(&req.watcher_id) {
                w.task.abort();
            }
            Ok(json!({}))
        }
        other => Err(RpcError::unimplemented(&format!(
            "filesystem.Filesystem/{other}"
        ))),
    }
}

/// Keep watcher `id`'s events until it is removed, ends, overflows or is
/// left unpolled. Dropping `watched` (returning) stops the guest's watch.
async fn gather(watchers: Watchers, id: String, mut watched: DirWatchStream) {
    let mut check = tokio::time::interval(POLL_CHECK);
    loop {
        let next = tokio::select! {
            next = watched.events.recv() => next,
            _ = check.tick() => {
                let mut all = watchers.0.lock().unwrap();
                if all.get(&id).is_some_and(|w| w.polled.elapsed() > UNPOLLED_LIFETIME) {
                    all.remove(&id);
                    tracing::debug!(watcher = %id, "stopped a watcher nobody polled");
                    return;
                }
                continue;
            }
        };
        let mut all = watchers.0.lock().unwrap();
        let Some(w) = all.get_mut(&id) else {
            return;
        };
        match next {
            Some(Ok(events)) => {
                w.waiting.extend(events.iter().map(event));
                if w.waiting.len() > MOST_WAITING {
                    w.waiting.truncate(MOST_WAITING);
                    w.ended = Some(RpcError::new(
                        "resource_exhausted",
                        format!(
                            "over {MOST_WAITING} events waited to be taken: the watch stopped \
                             (events were lost); poll more often, or watch less"
                        ),
                    ));
                    return;
                }
            }
            Some(Err(e)) => {
                w.ended = Some(e.into());
                return;
            }
            None => {
                w.ended = Some(RpcError::new("canceled", "the watch was stopped"));
                return;
            }
        }
    }
}

/// envd's `FilesystemEvent`.
fn event(e: &WatchEvent) -> Value {
    let kind = match e.kind {
        WatchEventKind::Create => "EVENT_TYPE_CREATE",
        WatchEventKind::Write => "EVENT_TYPE_WRITE",
        WatchEventKind::Remove => "EVENT_TYPE_REMOVE",
        WatchEventKind::Rename => "EVENT_TYPE_RENAME",
        WatchEventKind::Chmod => "EVENT_TYPE_CHMOD",
    };
    json!({"name": e.name, "type": kind})
}
