//! A sandbox's terminal over a WebSocket: `GET /v1/sandboxes/{id}/pty`
//! (upgraded), and `POST /v1/sandboxes/{id}/pty/tokens` for the one-use
//! token a browser opens it with.
//!
//! The framing (also in the OpenAPI document and `docs/design.md`, "Terminals"):
//!
//! - client → server, **binary**: keystrokes, as bytes;
//! - client → server, **text**: JSON, `{"type":"resize","rows":R,"cols":C}`
//!   or `{"type":"input","data":"…"}` (keystrokes as a string);
//! - server → client, **binary**: the terminal's output, as bytes;
//! - server → client, **text**: JSON, `{"type":"exit","exit_code":N,
//!   "signal":null}` when the shell exits (then a normal close), or
//!   `{"type":"error","error":{"type":…,"message":…}}` for a control
//!   message it could not take (the terminal stays) or a terminal that was
//!   cut (its sandbox ended; then the close follows).
//!
//! The size starts as `?rows=&cols=` (24 × 80 if absent). Authentication is
//! the API key's header, or `?token=` from the tokens route (the only
//! credential accepted in this URL: it opens one terminal of one sandbox,
//! once, within a minute). Every failure before the upgrade is the API's
//! usual JSON error with its status. Closing the socket hangs the shell up.
//!
//! The two directions run apart: a client that pastes a lot into a program
//! that prints a lot is never stuck behind its own output.

use crate::error::ApiError;
use crate::extract::{parse_query, Authed};
use crate::state::AppState;
use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade};
use axum::extract::{FromRequestParts, Path, State};
use axum::http::request::Parts;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::{SinkExt, StreamExt};
use sandpit_core::api::{PtyInput, PtyOutput, PtySize, TerminalSession};
use sandpit_core::CoreError;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::time::Duration;
use tokio::sync::mpsc;

/// Largest message a client may send (a paste): 1 MiB.
const MAX_MESSAGE: usize = 1 << 20;
/// How often the server pings an idle socket, so proxies and load
/// balancers between keep it open.
const PING_EVERY: Duration = Duration::from_secs(20);

/// `GET /v1/sandboxes/{id}/pty` query.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TerminalQuery {
    /// Rows of the terminal at first (default 24).
    #[serde(default)]
    pub rows: Option<u16>,
    /// Columns of the terminal at first (default 80).
    #[serde(default)]
    pub cols: Option<u16>,
    /// A token from `POST /v1/sandboxes/{id}/pty/tokens`, instead of the
    /// key's header.
    #[serde(default)]
    pub token: Option<String>,
}

/// A control message from the client (a text message).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum TerminalControl {
    /// The terminal's new size.
    Resize { rows: u16, cols: u16 },
    /// Keystrokes, as text.
    Input { data: String },
}

/// A message from the server about the terminal (a text message).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum TerminalEvent {
    /// The shell exited: its code, or the signal that killed it.
    Exit {
        exit_code: Option<i32>,
        signal: Option<i32>,
    },
    /// Something went wrong (see the framing above).
    Error { error: crate::error::ErrorObject },
}

pub(crate) async fn mint_token(
    State(st): State<AppState>,
    Authed(c): Authed,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let token = st.api.terminal_token(&c, &id).await?;
    Ok((StatusCode::CREATED, Json(token)).into_response())
}

pub(crate) async fn open(
    State(st): State<AppState>,
    Path(id): Path<String>,
    upgrade: Result<WebSocketUpgrade, axum::extract::ws::rejection::WebSocketUpgradeRejection>,
    mut parts: Parts,
) -> Result<Response, ApiError> {
    let q: TerminalQuery = parse_query(parts.uri.query().unwrap_or(""))?;
    let caller = match &q.token {
        Some(token) => st.api.redeem_terminal_token(token, &id).await?,
        None => {
            let Authed(c) = Authed::from_request_parts(&mut parts, &st).await?;
            c
        }
    };
    let upgrade = upgrade.map_err(|e| {
        ApiError::invalid(format!(
            "this is a WebSocket endpoint: connect with an `Upgrade: websocket` request ({e})"
        ))
    })?;
    let size = PtySize {
        rows: q.rows.unwrap_or(24),
        cols: q.cols.unwrap_or(80),
    };
    // Opened before the upgrade: a refusal is an HTTP answer the client can
    // read, not a socket that closes.
    let session = st.api.open_terminal(&caller, &id, size).await?;
    Ok(upgrade
        .max_message_size(MAX_MESSAGE)
        .max_frame_size(MAX_MESSAGE)
        .on_upgrade(move |socket| serve(socket, session)))
}

/// Carry the terminal over the socket until either ends.
async fn serve(socket: WebSocket, session: TerminalSession) {
    let mut session = session;
    let (sink, stream) = socket.split();
    // What the reading side has to tell the client (a bad control message).
    let (notes_tx, notes) = mpsc::channel::<TerminalEvent>(4);
    let reading = read_client(stream, session.input.clone(), notes_tx);
    let writing = write_client(sink, &mut session.output, notes);
    tokio::select! {
        _ = reading => {}
        _ = writing => {}
    }
}

/// The client's messages to the terminal, until it closes.
async fn read_client(
    mut stream: futures::stream::SplitStream<WebSocket>,
    input: mpsc::Sender<PtyInput>,
    notes: mpsc::Sender<TerminalEvent>,
) {
    while let Some(Ok(message)) = stream.next().await {
        let item = match message {
            Message::Binary(bytes) => PtyInput::Data(bytes.to_vec()),
            Message::Text(text) => match control(text.as_str()) {
                Ok(item) => item,
                Err(e) => {
                    let _ = notes.send(error_event(e)).await;
                    continue;
                }
            },
            Message::Close(_) => return,
            Message::Ping(_) | Message::Pong(_) => continue,
        };
        if input.send(item).await.is_err() {
            return;
        }
    }
}

/// A text message from the client as terminal input.
fn control(text: &str) -> Result<PtyInput, CoreError> {
    let c: TerminalControl = serde_json::from_str(text).map_err(|e| {
        CoreError::invalid(format!(
            "a text message is a JSON control message, {{\"type\":\"resize\",\"rows\":R,\"cols\":C}} \
             or {{\"type\":\"input\",\"data\":\"...\"}}: {e}"
        ))
    })?;
    Ok(match c {
        TerminalControl::Resize { rows, cols } => {
            let size = PtySize { rows, cols };
            sandpit_core::service::check_terminal_size(size)?;
            PtyInput::Resize(size)
        }
        TerminalControl::Input { data } => PtyInput::Data(data.into_bytes()),
    })
}

fn error_event(e: CoreError) -> TerminalEvent {
    TerminalEvent::Error {
        error: crate::error::ErrorObject {
            kind: e.kind,
            message: e.message,
        },
    }
}

/// The terminal's output and the server's notes to the client, with pings
/// while it is quiet, until the terminal ends or the client is gone.
async fn write_client(
    mut sink: futures::stream::SplitSink<WebSocket, Message>,
    output: &mut mpsc::Receiver<PtyOutput>,
    mut notes: mpsc::Receiver<TerminalEvent>,
) {
    let mut ping = tokio::time::interval(PING_EVERY);
    ping.tick().await;
    loop {
        let message = tokio::select! {
            item = output.recv() => match item {
                Some(PtyOutput::Data(bytes)) => Message::Binary(bytes.into()),
                Some(PtyOutput::Exit(exit)) => {
                    let _ = sink.send(text(&TerminalEvent::Exit {
                        exit_code: exit.exit_code,
                        signal: exit.signal,
                    })).await;
                    let _ = sink.send(close(1000, "the shell exited")).await;
                    return;
                }
                None => {
                    let cut = CoreError::conflict(
                        "the terminal was hung up: its sandbox stopped running or its VM is gone",
                    );
                    let _ = sink.send(text(&error_event(cut))).await;
                    let _ = sink.send(close(1011, "the terminal was hung up")).await;
                    return;
                }
            },
            Some(note) = notes.recv() => text(&note),
            _ = ping.tick() => Message::Ping(Default::default()),
        };
        if sink.send(message).await.is_err() {
            return;
        }
    }
}

fn text(event: &TerminalEvent) -> Message {
    Message::Text(serde_json::to_string(event).expect("json").into())
}

fn close(code: u16, reason: &'static str) -> Message {
    Message::Close(Some(CloseFrame {
        code,
        reason: reason.into(),
    }))
}
