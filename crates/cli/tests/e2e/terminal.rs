//! Terminals end to end: a real `sandpit serve`, a real VM, a login shell
//! on a real pseudo-terminal in the guest, reached over the terminal's
//! WebSocket (`GET /v1/sandboxes/{id}/pty`) by tokio-tungstenite as any
//! program would, and by `sandpit sandbox shell`.
//!
//! One sandbox serves every check: its size follows a resize, `^C`
//! interrupts the foreground job, `vim` and `htop` draw and quit, the
//! shell runs as `user` in a command cgroup, two terminals (one opened
//! with a one-use token, as a browser does) work at once, `exit` closes
//! the socket with the shell's code, closing the socket ends the shell, and
//! destroying the sandbox cuts a terminal still open.

use crate::common::serve::*;
use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

/// How long any one expected piece of output may take (a VM under
/// emulation on a busy CI host is slow, never this slow).
const PATIENCE: Duration = Duration::from_secs(60);

/// An open terminal and what it printed so far.
struct Term {
    ws: WebSocketStream<MaybeTlsStream<TcpStream>>,
    seen: String,
    /// The text messages (JSON events) it was sent.
    events: Vec<Value>,
    closed: Option<u16>,
}

impl Term {
    /// Open sandbox `id`'s terminal of `rows` x `cols` with `key`'s header,
    /// or with `?token=` when `key` is `None`.
    async fn open(url: &str, id: &str, key: Option<&str>, token: Option<&str>) -> Term {
        let ws_url = url.replacen("http://", "ws://", 1);
        let mut target = format!("{ws_url}/v1/sandboxes/{id}/pty?rows=24&cols=80");
        if let Some(t) = token {
            target.push_str(&format!("&token={t}"));
        }
        let mut req = target.into_client_request().unwrap();
        if let Some(k) = key {
            req.headers_mut().insert(
                "authorization",
                HeaderValue::from_str(&format!("Bearer {k}")).unwrap(),
            );
        }
        let (ws, resp) = tokio_tungstenite::connect_async(req)
            .await
            .expect("the terminal opens");
        assert_eq!(resp.status().as_u16(), 101);
        Term {
            ws,
            seen: String::new(),
            events: Vec::new(),
            closed: None,
        }
    }

    async fn send(&mut self, keys: &str) {
        self.ws
            .send(Message::Binary(keys.as_bytes().to_vec().into()))
            .await
            .unwrap();
    }

    async fn control(&mut self, v: Value) {
        self.ws
            .send(Message::Text(v.to_string().into()))
            .await
            .unwrap();
    }

    /// Read until the output holds `needle`; returns the output since the
    /// last call's match and drops it from what is kept.
    async fn until(&mut self, needle: &str) -> String {
        let deadline = Instant::now() + PATIENCE;
        loop {
            if let Some(at) = self.seen.find(needle) {
                let upto = at + needle.len();
                let got = self.seen[..upto].to_string();
                self.seen.drain(..upto);
                return got;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, self.ws.next()).await {
                Err(_) => panic!(
                    "no {needle:?} within {PATIENCE:?}; the terminal showed:\n{}",
                    self.seen
                ),
                Ok(None) | Ok(Some(Err(_))) => {
                    panic!(
                        "the socket ended before {needle:?}; it showed:\n{}",
                        self.seen
                    )
                }
                Ok(Some(Ok(m))) => self.take(m),
            }
        }
    }

    fn take(&mut self, m: Message) {
        match m {
            Message::Binary(b) => self.seen.push_str(&String::from_utf8_lossy(&b)),
            Message::Text(t) => self.events.push(serde_json::from_str(&t).unwrap()),
            Message::Close(frame) => self.closed = Some(frame.map_or(1005, |f| f.code.into())),
            _ => {}
        }
    }

    /// Read to the socket's end; the close code.
    async fn read_to_close(&mut self) -> u16 {
        let deadline = Instant::now() + PATIENCE;
        while self.closed.is_none() {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, self.ws.next()).await {
                Err(_) => panic!("the socket stayed open; it showed:\n{}", self.seen),
                Ok(None) | Ok(Some(Err(_))) => return self.closed.unwrap_or(1006),
                Ok(Some(Ok(m))) => self.take(m),
            }
        }
        self.closed.unwrap()
    }
}

/// A plain GET of the terminal's URL (no upgrade): its status and body.
async fn plain_get(url: &str, id: &str, key: &str) -> (u16, Value) {
    let r = reqwest::Client::new()
        .get(format!("{url}/v1/sandboxes/{id}/pty"))
        .bearer_auth(key)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// The status a WebSocket handshake was refused with.
async fn refused(url: &str, id: &str, key: Option<&str>, token: Option<&str>) -> u16 {
    let ws_url = url.replacen("http://", "ws://", 1);
    let mut target = format!("{ws_url}/v1/sandboxes/{id}/pty");
    if let Some(t) = token {
        target.push_str(&format!("?token={t}"));
    }
    let mut req = target.into_client_request().unwrap();
    if let Some(k) = key {
        req.headers_mut().insert(
            "authorization",
            HeaderValue::from_str(&format!("Bearer {k}")).unwrap(),
        );
    }
    match tokio_tungstenite::connect_async(req).await {
        Err(tokio_tungstenite::tungstenite::Error::Http(resp)) => resp.status().as_u16(),
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("the terminal opened"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_terminal_is_a_real_shell_over_a_websocket() {
    let data = tempfile::tempdir().unwrap();
    let server = Server::start(data.path());
    let key = server.admin_key.clone().expect("first-start key");
    let other = server.new_account("stranger", 5.0);
    let rest = Rest::new(&server, &key);
    let (status, sbx) = rest
        .post(
            "/sandboxes",
            json!({"size": "small", "timeout_minutes": 15}),
        )
        .await;
    assert_eq!(status, 201, "{sbx}");
    let id = sbx["id"].as_str().unwrap().to_string();
    let url = server.url.clone();

    // Refusals come before the upgrade, as the API's JSON errors.
    let (status, body) = plain_get(&url, &id, &key).await;
    assert_eq!(status, 400, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("WebSocket"),
        "{body}"
    );
    assert_eq!(refused(&url, &id, None, None).await, 401);
    assert_eq!(refused(&url, &id, Some(&other), None).await, 404);
    assert_eq!(refused(&url, "sbx_nope", Some(&key), None).await, 404);

    let mut a = Term::open(&url, &id, Some(&key), None).await;
    // Its size, and the size after a resize.
    a.send("stty size\r").await;
    a.until("24 80").await;
    a.control(json!({"type": "resize", "rows": 40, "cols": 120}))
        .await;
    a.send("stty size\r").await;
    a.until("40 120").await;
    a.send("echo \"$TERM/$(id -un)/$(cat /proc/self/cgroup)\"\r")
        .await;
    let who = a.until("/user/exec-").await;
    assert!(
        who.contains("xterm-256color/user/0::/user/exec-"),
        "not the user's shell in a command cgroup: {who}"
    );
    // A bad control message is an error event; the terminal stays.
    a.control(json!({"type": "resize", "rows": 0, "cols": 80}))
        .await;
    a.send("echo still-$((20+1))\r").await;
    a.until("still-21").await;
    let bad = a.events.last().expect("an error event").clone();
    assert_eq!(bad["type"], "error", "{bad}");
    assert_eq!(bad["error"]["type"], "invalid_request", "{bad}");

    // ^C interrupts the foreground job (a sleep of five minutes).
    a.send("sleep 300\r").await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let interrupted = Instant::now();
    a.send("\x03").await;
    a.send("echo rc=$?\r").await;
    a.until("rc=130").await;
    assert!(interrupted.elapsed() < PATIENCE);

    // vim writes a file; htop draws and quits on `q`. Each is let finish
    // before more is typed: a full-screen program that exits flushes what
    // was typed ahead, as on any terminal.
    a.send("vim -u NONE -N /workspace/typed.txt\r").await;
    a.until("[New").await;
    a.send("ihello from vim\x1b:wq\r").await;
    a.until("written").await;
    a.until("$ ").await;
    a.send("tr a-z A-Z < /workspace/typed.txt\r").await;
    a.until("HELLO FROM VIM").await;
    a.send("htop\r").await;
    a.until("Load average").await;
    a.send("q").await;
    a.until("$ ").await;
    a.send("echo htop-quit-$((1+1))\r").await;
    a.until("htop-quit-2").await;

    // A second terminal at once, opened with a one-use token as a browser
    // does; the token opens nothing a second time, nor another sandbox.
    let (status, token) = rest
        .post(&format!("/sandboxes/{id}/pty/tokens"), json!({}))
        .await;
    assert_eq!(status, 201, "{token}");
    let t = token["token"].as_str().unwrap().to_string();
    assert!(token["url"].as_str().unwrap().ends_with(&t), "{token}");
    let mut b = Term::open(&url, &id, None, Some(&t)).await;
    assert_eq!(refused(&url, &id, None, Some(&t)).await, 401);
    b.send("echo b-$((40+2)); echo $$ > /tmp/b.pid\r").await;
    b.until("b-42").await;
    a.send("echo a-$((40+3))\r").await;
    a.until("a-43").await;

    // Closing a socket ends its shell.
    let (_, pid) = rest
        .post(
            &format!("/sandboxes/{id}/exec"),
            json!({"command": "cat /tmp/b.pid"}),
        )
        .await;
    let pid = pid["stdout"].as_str().unwrap().trim().to_string();
    assert!(!pid.is_empty());
    b.ws.close(None).await.unwrap();
    let gone = Instant::now();
    loop {
        let (_, r) = rest
            .post(
                &format!("/sandboxes/{id}/exec"),
                json!({"command": format!("kill -0 {pid} 2>/dev/null && echo alive || echo gone")}),
            )
            .await;
        if r["stdout"].as_str().unwrap().trim() == "gone" {
            break;
        }
        assert!(
            gone.elapsed() < PATIENCE,
            "the shell of a closed terminal lives on"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // `exit` ends the session with the shell's code, and a normal close.
    a.send("exit 7\r").await;
    assert_eq!(a.read_to_close().await, 1000);
    let exit = a
        .events
        .iter()
        .find(|e| e["type"] == "exit")
        .expect("an exit event");
    assert_eq!(exit["exit_code"], 7, "{exit}");

    // `sandpit sandbox shell` with its input from a pipe.
    let out = tokio::task::spawn_blocking({
        let (url, key, id, data) = (url.clone(), key.clone(), id.clone(), data.path().to_owned());
        move || {
            use std::io::Write;
            let mut child = sandpit(&data)
                .args(["sandbox", "shell", &id])
                .env("SANDPIT_URL", &url)
                .env("SANDPIT_API_KEY", &key)
                .stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap();
            child
                .stdin
                .take()
                .unwrap()
                .write_all(b"echo cli-$((6*7))\nexit 3\n")
                .unwrap();
            child.wait_with_output().unwrap()
        }
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("cli-42"),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        out.status.code(),
        Some(3),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Destroying the sandbox cuts a terminal that is still open.
    let mut c = Term::open(&url, &id, Some(&key), None).await;
    c.send("echo c-$((2*2))\r").await;
    c.until("c-4").await;
    let (status, _) = rest
        .call(reqwest::Method::DELETE, &format!("/sandboxes/{id}"), None)
        .await;
    assert_eq!(status, 200);
    assert_eq!(c.read_to_close().await, 1011);
    let cut = c
        .events
        .iter()
        .find(|e| e["type"] == "error")
        .expect("an error event");
    assert_eq!(cut["error"]["type"], "conflict", "{cut}");
    assert_eq!(refused(&url, &id, Some(&key), None).await, 409);
}
