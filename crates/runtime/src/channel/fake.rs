//! A scripted guest agent on a unix socket, for tests of what the host does
//! when the guest misbehaves (the real agent never does).

use super::*;
use sandpit_protocol::FrameDecoder;
use tokio::io::AsyncWriteExt;
use tokio::net::{UnixListener, UnixStream};

/// Answer the handshake, then run `then` on the socket and the decoder
/// (which may hold frames already).
pub(crate) async fn agent<F, Fut>(then: F) -> (AgentClient, tempfile::TempDir)
where
    F: FnOnce(UnixStream, FrameDecoder) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    // An agent of the first generation-1 image: nothing added since.
    agent_with(&[], then).await
}

/// [`agent`], listing `features` in its handshake.
pub(crate) async fn agent_with<F, Fut>(
    features: &[&str],
    then: F,
) -> (AgentClient, tempfile::TempDir)
where
    F: FnOnce(UnixStream, FrameDecoder) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let features: Vec<String> = features.iter().map(|f| f.to_string()).collect();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("agent.sock");
    let listener = UnixListener::bind(&path).unwrap();
    tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let mut d = FrameDecoder::new();
        let Message::Hello { nonce, .. } = next(&mut s, &mut d).await.message else {
            panic!("no hello");
        };
        let ack = Message::HelloAck {
            protocol: sandpit_protocol::PROTOCOL_GENERATION,
            nonce,
            agent_version: "test".into(),
            kernel_release: "test".into(),
            hostname: "test".into(),
            features,
        };
        s.write_all(&encode_frame(&ack, b"")).await.unwrap();
        then(s, d).await;
    });
    let client = AgentClient::connect(&path, Duration::from_secs(10))
        .await
        .unwrap();
    (client, dir)
}

/// The next frame from the host.
pub(crate) async fn next(s: &mut UnixStream, d: &mut FrameDecoder) -> Frame {
    use tokio::io::AsyncReadExt;
    let mut buf = vec![0u8; 1 << 16];
    loop {
        if let Some(f) = d.next_frame().unwrap() {
            return f;
        }
        let n = s.read(&mut buf).await.unwrap();
        assert!(n > 0, "the host hung up");
        d.push(&buf[..n]);
    }
}
