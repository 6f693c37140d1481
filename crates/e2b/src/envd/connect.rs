//! The Connect protocol as E2B's SDKs speak it to envd: JSON only (never
//! binary protobuf), unary calls as plain `application/json` bodies, and
//! server streams as enveloped frames (one flags byte, a 4-byte big-endian
//! length, the JSON) ending with an end-of-stream frame (flags `0x02`)
//! that carries the error, if any. A stream's error always comes in that
//! frame under HTTP 200: the JavaScript client drops the body of any other
//! status. The stream's content type must be exactly
//! `application/connect+json` (the Python client refuses a parameter).

use crate::error::RpcError;
use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::Response;
use serde::de::DeserializeOwned;
use tokio::sync::mpsc;

/// Flags of a frame that ends the stream.
const END_STREAM: u8 = 0x02;
/// Flags of a compressed frame, which no SDK sends.
const COMPRESSED: u8 = 0x01;
/// The stream's content type.
pub const STREAM_TYPE: &str = "application/connect+json";

/// One frame: flags, length, payload.
pub fn frame(flags: u8, payload: &[u8]) -> Bytes {
    let mut out = Vec::with_capacity(5 + payload.len());
    out.push(flags);
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(payload);
    Bytes::from(out)
}

/// The request message of a unary call (a JSON body) or of a server stream
/// (one enveloped frame); an empty body is the empty message.
pub fn request<T: DeserializeOwned>(headers: &HeaderMap, body: &[u8]) -> Result<T, RpcError> {
    let streaming = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|t| t.starts_with("application/connect+"));
    let json: &[u8] = if streaming {
        let Some((&flags, rest)) = body.split_first() else {
            return Err(RpcError::invalid("an empty stream: no request message"));
        };
        if flags & COMPRESSED != 0 {
            return Err(RpcError::invalid("compressed frames are not accepted"));
        }
        let len = rest
            .get(..4)
            .map(|b| u32::from_be_bytes(b.try_into().expect("4 bytes")) as usize)
            .ok_or_else(|| RpcError::invalid("a frame cut short"))?;
        rest.get(4..4 + len)
            .ok_or_else(|| RpcError::invalid("a frame cut short"))?
    } else {
        body
    };
    let json = if json.is_empty() { &b"{}"[..] } else { json };
    serde_json::from_slice(json).map_err(|e| RpcError::invalid(format!("the request: {e}")))
}

/// The largest message a client stream may send (a piece of input).
const MOST_CLIENT_FRAME: usize = 16 << 20;

/// The messages of a client stream, each as it arrives: its frames'
/// payloads, up to its end-of-stream frame or the body's end.
pub struct Frames<S> {
    body: S,
    buf: Vec<u8>,
    done: bool,
}

impl<S, E> Frames<S>
where
    S: futures::Stream<Item = Result<Bytes, E>> + Unpin,
    E: std::fmt::Display,
{
    pub fn new(body: S) -> Self {
        Frames {
            body,
            buf: Vec::new(),
            done: false,
        }
    }

    /// The next message; `None` at the stream's end.
    pub async fn next(&mut self) -> Option<Result<Vec<u8>, RpcError>> {
        use futures::StreamExt;
        loop {
            if self.done {
                return None;
            }
            if self.buf.len() >= 5 {
                let flags = self.buf[0];
                let len = u32::from_be_bytes(self.buf[1..5].try_into().expect("4 bytes")) as usize;
                if flags & COMPRESSED != 0 || len > MOST_CLIENT_FRAME {
                    self.done = true;
                    return Some(Err(RpcError::invalid(format!(
                        "a frame of {len} bytes (flags {flags:#x}): compressed frames and frames \
                         over {MOST_CLIENT_FRAME} bytes are not accepted"
                    ))));
                }
                if self.buf.len() >= 5 + len {
                    let payload = self.buf[5..5 + len].to_vec();
                    self.buf.drain(..5 + len);
                    if flags & END_STREAM != 0 {
                        self.done = true;
                        return None;
                    }
                    return Some(Ok(payload));
                }
            }
            match self.body.next().await {
                Some(Ok(bytes)) => self.buf.extend_from_slice(&bytes),
                Some(Err(e)) => {
                    self.done = true;
                    return Some(Err(RpcError::new(
                        "canceled",
                        format!("the request stream broke off: {e}"),
                    )));
                }
                None => {
                    self.done = true;
                    return (!self.buf.is_empty())
                        .then(|| Err(RpcError::invalid("the request stream ended mid-frame")));
                }
            }
        }
    }
}

/// A server stream being written: messages, then its end.
pub struct Stream {
    tx: mpsc::Sender<Bytes>,
}

impl Stream {
    /// The response that carries the stream, and its writer. Frames are
    /// written as they come (a slow reader holds the writer back).
    pub fn open() -> (Response, Stream) {
        let (tx, rx) = mpsc::channel::<Bytes>(32);
        let body = futures::stream::unfold(rx, |mut rx| async move {
            rx.recv()
                .await
                .map(|frame| (Ok::<_, std::convert::Infallible>(frame), rx))
        });
        let response = Response::builder()
            .status(StatusCode::OK)
            .header(header::CONTENT_TYPE, STREAM_TYPE)
            .body(Body::from_stream(body))
            .expect("a valid response");
        (response, Stream { tx })
    }

    /// Send one message; `false` when the client has gone.
    pub async fn send(&self, message: &serde_json::Value) -> bool {
        let payload = serde_json::to_vec(message).expect("JSON values serialize");
        self.tx.send(frame(0, &payload)).await.is_ok()
    }

    /// Resolves once the client has gone (the response's body was dropped).
    pub async fn closed(&self) {
        self.tx.closed().await
    }

    /// End the stream, with an error or without.
    pub async fn end(self, error: Option<RpcError>) {
        let trailer = match error {
            Some(e) => serde_json::json!({"error": e.json()}),
            None => serde_json::json!({}),
        };
        let payload = serde_json::to_vec(&trailer).expect("JSON values serialize");
        let _ = self.tx.send(frame(END_STREAM, &payload)).await;
    }
}

/// A stream that only says why it failed.
pub async fn failed(error: RpcError) -> Response {
    let (response, stream) = Stream::open();
    stream.end(Some(error)).await;
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_request_is_read_from_its_frame_and_a_unary_one_from_its_body() {
        #[derive(serde::Deserialize)]
        struct M {
            n: u32,
        }
        let mut streamed = HeaderMap::new();
        streamed.insert(
            header::CONTENT_TYPE,
            "application/connect+json".parse().unwrap(),
        );
        let body = frame(0, br#"{"n":7}"#);
        assert_eq!(request::<M>(&streamed, &body).unwrap().n, 7);
        assert!(request::<M>(&streamed, &body[..6]).is_err());
        assert!(request::<M>(&streamed, &frame(COMPRESSED, br#"{"n":7}"#)).is_err());
        let mut unary = HeaderMap::new();
        unary.insert(header::CONTENT_TYPE, "application/json".parse().unwrap());
        assert_eq!(request::<M>(&unary, br#"{"n":3}"#).unwrap().n, 3);
    }

    #[tokio::test]
    async fn a_client_streams_messages_are_taken_as_they_come_whatever_the_pieces() {
        let mut all = Vec::new();
        all.extend_from_slice(&frame(0, b"{\"a\":1}"));
        all.extend_from_slice(&frame(0, b"{}"));
        all.extend_from_slice(&frame(END_STREAM, b"{}"));
        // One byte at a time.
        let pieces: Vec<Result<Bytes, std::convert::Infallible>> = all
            .iter()
            .map(|b| Ok(Bytes::copy_from_slice(&[*b])))
            .collect();
        let mut frames = Frames::new(futures::stream::iter(pieces));
        assert_eq!(frames.next().await.unwrap().unwrap(), b"{\"a\":1}");
        assert_eq!(frames.next().await.unwrap().unwrap(), b"{}");
        assert!(frames.next().await.is_none());
        // Cut mid-frame, or too large: an error, not a hang.
        let cut: Vec<Result<Bytes, std::convert::Infallible>> =
            vec![Ok(frame(0, b"{}").slice(..4))];
        let mut frames = Frames::new(futures::stream::iter(cut));
        assert_eq!(
            frames.next().await.unwrap().unwrap_err().code,
            "invalid_argument"
        );
        let mut huge = vec![0u8];
        huge.extend_from_slice(&u32::MAX.to_be_bytes());
        let mut frames = Frames::new(futures::stream::iter(vec![
            Ok::<_, std::convert::Infallible>(Bytes::from(huge)),
        ]));
        assert!(frames.next().await.unwrap().is_err());
    }
}
