//! Streaming exec as server-sent events.
//!
//! Frames: first `event: start` (the execution object, status `running`:
//! its id, for a client whose stream breaks), then `event: stdout` /
//! `event: stderr` with `data: {"data": "<chunk>"}`, then exactly one last
//! frame, `event: exit` (the execution object) or
//! `event: error` (the error body, as on any non-2xx response). While nothing
//! else is sent, a `: ping` comment goes out every `sse_ping_interval`.
//!
//! The [`ExecStream`] lives inside the response body stream. When the client
//! goes away, hyper drops the body, which drops the `ExecStream`, which
//! cancels the command (the trait's contract). hyper sees the closed
//! connection at once (EOF on the socket; a test checks this with pings far
//! apart); the pings are for proxies and load balancers that drop idle
//! connections, and would also reveal a peer that vanished without a FIN.

use crate::error::ErrorBody;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use sandpit_core::{CoreError, ExecEvent, ExecStream};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::convert::Infallible;
use std::time::Duration;

/// The data of a `stdout` or `stderr` event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct OutputChunk {
    /// Output as produced, decoded as UTF-8 (characters are never split across chunks).
    pub data: String,
}

fn frame<T: Serialize>(event: &str, data: &T) -> Event {
    Event::default()
        .event(event)
        .data(serde_json::to_string(data).expect("serializable"))
}

pub(crate) fn respond(stream: ExecStream, request_id: String, ping: Duration) -> Response {
    let events = futures::stream::unfold(Some(stream), move |state| {
        let request_id = request_id.clone();
        async move {
            let mut stream = state?;
            let (event, more) = match stream.next().await {
                Some(ExecEvent::Started(execution)) => (frame("start", &execution), true),
                Some(ExecEvent::Stdout(s)) => (frame("stdout", &OutputChunk { data: s }), true),
                Some(ExecEvent::Stderr(s)) => (frame("stderr", &OutputChunk { data: s }), true),
                Some(ExecEvent::Exit(execution)) => (frame("exit", &execution), false),
                Some(ExecEvent::Error(err)) => {
                    (frame("error", &ErrorBody::new(&err, &request_id)), false)
                }
                None => {
                    let err = CoreError::internal(
                        "the execution's event stream ended without an exit status",
                    );
                    (frame("error", &ErrorBody::new(&err, &request_id)), false)
                }
            };
            Some((Ok::<_, Infallible>(event), more.then_some(stream)))
        }
    });
    let mut resp = Sse::new(events)
        .keep_alive(KeepAlive::new().interval(ping).text("ping"))
        .into_response();
    // Ask reverse proxies not to buffer the stream.
    resp.headers_mut()
        .insert("x-accel-buffering", "no".parse().expect("valid header"));
    resp
}
