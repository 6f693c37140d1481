//! `sandpit sandbox shell ID`: an interactive terminal in a server's
//! sandbox, over the terminal's WebSocket (`GET /v1/sandboxes/{id}/pty`,
//! see `sandpit_api`'s `terminal`), with the key from `SANDPIT_API_KEY`.
//!
//! On a terminal, this one is put in raw mode for the session (every key,
//! `^C` included, goes to the sandbox's shell; restored however the session
//! ends) and its size follows the window (SIGWINCH). With input from a pipe
//! or file, its bytes are typed in as they are and its end is typed as `^D`,
//! so `echo 'make test' | sandpit sandbox shell ID` runs and ends. The exit
//! code is the shell's (128 + the signal when one killed it).

use anyhow::{anyhow, bail, Context, Result};
use futures::{SinkExt, StreamExt};
use sandpit_api::TerminalEvent;
use std::io::{IsTerminal, Write};
use std::os::fd::AsFd;
use tokio::io::AsyncReadExt;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::tungstenite::Message;

/// The size of the terminal on stdout (or stdin), if either is one.
fn window_size() -> Option<(u16, u16)> {
    for fd in [libc::STDOUT_FILENO, libc::STDIN_FILENO] {
        // SAFETY: TIOCGWINSZ writes a winsize into valid memory.
        let mut ws: libc::winsize = unsafe { std::mem::zeroed() };
        if unsafe { libc::ioctl(fd, libc::TIOCGWINSZ, &mut ws) } == 0 && ws.ws_row > 0 {
            return Some((ws.ws_row, ws.ws_col));
        }
    }
    None
}

/// This terminal in raw mode until dropped.
struct RawMode {
    saved: nix::sys::termios::Termios,
}

impl RawMode {
    fn enter() -> Result<RawMode> {
        use nix::sys::termios::{cfmakeraw, tcgetattr, tcsetattr, SetArg};
        let stdin = std::io::stdin();
        let saved = tcgetattr(stdin.as_fd()).context("reading the terminal's settings")?;
        let mut raw = saved.clone();
        cfmakeraw(&mut raw);
        tcsetattr(stdin.as_fd(), SetArg::TCSANOW, &raw).context("setting raw mode")?;
        Ok(RawMode { saved })
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        use nix::sys::termios::{tcsetattr, SetArg};
        let _ = tcsetattr(std::io::stdin().as_fd(), SetArg::TCSANOW, &self.saved);
    }
}

/// The WebSocket URL of sandbox `id`'s terminal on the server at `base`.
fn terminal_url(base: &str, id: &str, size: (u16, u16)) -> Result<String> {
    let base = base.trim_end_matches('/');
    let ws = if let Some(rest) = base.strip_prefix("https://") {
        format!("wss://{rest}")
    } else if let Some(rest) = base.strip_prefix("http://") {
        format!("ws://{rest}")
    } else {
        bail!("the server's URL must start with http:// or https://, not {base:?}");
    };
    Ok(format!(
        "{ws}/v1/sandboxes/{id}/pty?rows={}&cols={}",
        size.0, size.1
    ))
}

/// Run the session; the shell's exit code.
pub async fn shell(url: &str, id: &str) -> Result<i32> {
    let key = std::env::var(sandpit_api::API_KEY_ENV).map_err(|_| {
        anyhow!(
            "this command talks to a Sandpit server ({url}): put an API key of it in {}",
            sandpit_api::API_KEY_ENV
        )
    })?;
    let interactive = std::io::stdin().is_terminal();
    let size = window_size().unwrap_or((24, 80));
    let mut request = terminal_url(url, id, size)?
        .into_client_request()
        .context("the terminal's URL")?;
    request.headers_mut().insert(
        "authorization",
        HeaderValue::from_str(&format!("Bearer {key}")).context("the API key")?,
    );
    let (socket, _) = match tokio_tungstenite::connect_async(request).await {
        Ok(s) => s,
        Err(tokio_tungstenite::tungstenite::Error::Http(resp)) => {
            let body = resp.body().as_deref().unwrap_or_default();
            let message = serde_json::from_slice::<sandpit_api::ErrorBody>(body)
                .map(|b| format!("{}: {}", b.error.kind.as_str(), b.error.message))
                .unwrap_or_else(|_| String::from_utf8_lossy(body).into_owned());
            bail!("{message}");
        }
        Err(e) => return Err(anyhow!("cannot reach the terminal at {url}: {e}")),
    };
    let (mut sink, mut stream) = socket.split();
    let _raw = if interactive {
        Some(RawMode::enter()?)
    } else {
        None
    };

    // Keystrokes and window sizes go out from a task of their own.
    let typing = tokio::spawn(async move {
        let mut stdin = tokio::io::stdin();
        let mut winch =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::window_change()).ok();
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let message = tokio::select! {
                n = stdin.read(&mut buf) => match n {
                    Ok(0) | Err(_) => {
                        // A pipe's end is typed as ^D, then nothing more.
                        let _ = sink.send(Message::Binary(vec![4u8].into())).await;
                        std::future::pending::<()>().await;
                        unreachable!()
                    }
                    Ok(n) => Message::Binary(buf[..n].to_vec().into()),
                },
                Some(()) = async { match winch.as_mut() { Some(w) => w.recv().await, None => None } } => {
                    let Some((rows, cols)) = window_size() else { continue };
                    let resize = sandpit_api::TerminalControl::Resize { rows, cols };
                    Message::Text(serde_json::to_string(&resize).expect("json").into())
                }
            };
            if sink.send(message).await.is_err() {
                return;
            }
        }
    });

    let mut stdout = std::io::stdout();
    let mut code = None;
    let mut trouble = None;
    while let Some(message) = stream.next().await {
        match message {
            Ok(Message::Binary(bytes)) => {
                stdout.write_all(&bytes)?;
                stdout.flush()?;
            }
            Ok(Message::Text(text)) => match serde_json::from_str::<TerminalEvent>(&text) {
                Ok(TerminalEvent::Exit { exit_code, signal }) => {
                    code = Some(exit_code.unwrap_or_else(|| 128 + signal.unwrap_or(0)));
                }
                Ok(TerminalEvent::Error { error }) => {
                    trouble = Some(format!("{}: {}", error.kind.as_str(), error.message));
                }
                Err(_) => {}
            },
            Ok(Message::Close(_)) | Err(_) => break,
            Ok(_) => {}
        }
    }
    typing.abort();
    drop(_raw);
    match (code, trouble) {
        (Some(code), _) => Ok(code),
        (None, Some(t)) => bail!("{t}"),
        (None, None) => bail!("the terminal's connection ended before its shell did"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_terminal_url_follows_the_servers_scheme() {
        assert_eq!(
            terminal_url("http://127.0.0.1:8080/", "sbx_1", (24, 80)).unwrap(),
            "ws://127.0.0.1:8080/v1/sandboxes/sbx_1/pty?rows=24&cols=80"
        );
        assert_eq!(
            terminal_url("https://sandpit.example", "sbx_1", (50, 132)).unwrap(),
            "wss://sandpit.example/v1/sandboxes/sbx_1/pty?rows=50&cols=132"
        );
        assert!(terminal_url("ftp://x", "sbx_1", (1, 1)).is_err());
    }
}
