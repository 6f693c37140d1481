//! `sandpit events`: the account's sandbox events on a server (--url,
//! SANDPIT_API_KEY), a line each (when, what, which sandbox, who, why),
//! or followed as they come (`--follow`: a poll a second from the last
//! cursor, until interrupted). A thin client of `GET /v1/events`: every
//! check is the server's.

use crate::sandbox::{api_error, server, ServerArgs};
use anyhow::Result;
use clap::Args;
use sandpit_api::RemoteApi;
use sandpit_core::api::prelude::*;
use sandpit_core::{Caller, ErrorType, Event, ListEvents};
use std::future::Future;
use std::io::Write;
use std::time::Duration;

#[derive(Args)]
pub struct EventsArgs {
    /// Only this sandbox's events (sbx_...)
    #[arg(long = "sandbox", value_name = "ID")]
    sandbox: Option<String>,
    /// Only those after this cursor (an event's, or the one printed last)
    #[arg(long, value_name = "CURSOR")]
    after: Option<String>,
    /// At most this many, 1..500 (with --follow: per poll) [default: the
    /// server's, 100]
    #[arg(long, value_name = "N")]
    limit: Option<u32>,
    /// Keep printing new events as they come (a poll a second) until
    /// interrupted
    #[arg(long, short)]
    follow: bool,
    #[command(flatten)]
    server: ServerArgs,
    /// Print the page as JSON (with --follow: each event, one a line)
    #[arg(long)]
    json: bool,
}

/// How often `--follow` asks for new events.
const POLL: Duration = Duration::from_secs(1);

pub async fn run(args: EventsArgs) -> Result<i32> {
    let (api, caller) = server(&args.server).await?;
    let interrupted = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    events(
        &api,
        &caller,
        &args,
        &mut std::io::stdout(),
        interrupted,
        POLL,
    )
    .await
}

/// What `sandpit events` does, its lines written to `out`; `--follow`
/// polls every `poll` until `stop` resolves.
async fn events(
    api: &RemoteApi,
    caller: &Caller,
    args: &EventsArgs,
    out: &mut dyn Write,
    stop: impl Future<Output = ()>,
    poll: Duration,
) -> Result<i32> {
    let mut q = ListEvents {
        limit: args.limit,
        after: args.after.clone(),
        sandbox_id: args.sandbox.clone(),
    };
    if !args.follow {
        let page = api.list_events(caller, q).await.map_err(api_error)?;
        if args.json {
            writeln!(out, "{}", serde_json::to_string_pretty(&page)?)?;
            return Ok(0);
        }
        for event in &page.data {
            writeln!(out, "{}", line(event))?;
        }
        if let (true, Some(cursor)) = (page.has_more, &page.next_cursor) {
            eprintln!("(more: sandpit events --after {cursor})");
        }
        return Ok(0);
    }
    tokio::pin!(stop);
    loop {
        let asked = api.list_events(caller, q.clone());
        let page = tokio::select! {
            _ = &mut stop => return Ok(0),
            page = asked => page,
        };
        let more = match page {
            Ok(page) => {
                for event in &page.data {
                    match args.json {
                        true => writeln!(out, "{}", serde_json::to_string(event)?)?,
                        false => writeln!(out, "{}", line(event))?,
                    }
                }
                out.flush()?;
                if page.next_cursor.is_some() {
                    q.after = page.next_cursor;
                }
                page.has_more
            }
            // A server that restarts or sheds load is asked again.
            Err(e)
                if matches!(
                    e.kind,
                    ErrorType::ServiceUnavailable | ErrorType::RateLimited
                ) =>
            {
                eprintln!("({}: {}; asking again)", e.kind, e.message);
                false
            }
            Err(e) => return Err(api_error(e)),
        };
        if !more {
            tokio::select! {
                _ = &mut stop => return Ok(0),
                _ = tokio::time::sleep(poll) => {}
            }
        }
    }
}

/// An event on one line: when, its type, the sandbox, who, why (`-` for
/// no reason).
fn line(e: &Event) -> String {
    format!(
        "{}\t{}\t{}\t{}\t{}",
        e.at,
        e.kind,
        e.sandbox_id,
        e.actor,
        e.reason.as_deref().unwrap_or("-")
    )
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use clap::Parser;
    use sandpit_core::{CreateSandbox, SandboxApi};
    use sandpit_fake::{Fake, KEY_A};
    use std::sync::{Arc, Mutex};

    /// A REST server over the fake, and a client of it as account A.
    pub(crate) async fn served() -> (Arc<Fake>, RemoteApi, Caller) {
        let fake = Fake::new();
        let app = sandpit_api::router(fake.clone(), Default::default());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        let api = RemoteApi::new(&url).unwrap();
        let caller = api.authenticate(KEY_A).await.unwrap();
        (fake, api, caller)
    }

    /// `sandpit events ARGS` as the command line gives them.
    fn parse(args: &[&str]) -> EventsArgs {
        let argv = ["sandpit", "events"].iter().chain(args);
        match crate::Cli::try_parse_from(argv).unwrap().command {
            crate::Command::Events(a) => a,
            _ => unreachable!(),
        }
    }

    async fn printed(api: &RemoteApi, caller: &Caller, args: &[&str]) -> String {
        let mut out = Vec::new();
        let stop = std::future::pending();
        let args = parse(args);
        let code = events(api, caller, &args, &mut out, stop, POLL)
            .await
            .unwrap();
        assert_eq!(code, 0);
        String::from_utf8(out).unwrap()
    }

    async fn create(fake: &Arc<Fake>, caller: &Caller) -> String {
        let api: Arc<dyn SandboxApi> = fake.clone();
        let req = CreateSandbox::default();
        api.create_sandbox(caller, req, None).await.unwrap().0.id
    }

    #[tokio::test]
    async fn events_are_printed_a_line_each_paged_and_as_json() {
        let (fake, api, me) = served().await;
        let one = create(&fake, &me).await;
        api.pause_sandbox(&me, &one).await.unwrap();
        api.destroy_sandbox(&me, &one).await.unwrap();
        let two = create(&fake, &me).await;

        let all = printed(&api, &me, &[]).await;
        let lines: Vec<Vec<&str>> = all.lines().map(|l| l.split('\t').collect()).collect();
        let t0 = sandpit_fake::T0;
        assert_eq!(
            lines,
            [
                [t0, "sandbox.created", &one, "api key", "-"],
                [t0, "sandbox.started", &one, "api key", "-"],
                [t0, "sandbox.paused", &one, "api key", "-"],
                [t0, "sandbox.destroying", &one, "api key", "-"],
                [t0, "sandbox.killed", &one, "api key", "destroyed"],
                [t0, "sandbox.created", &two, "api key", "-"],
                [t0, "sandbox.started", &two, "api key", "-"],
            ]
        );

        // One sandbox's; a page of them; the rest after a cursor.
        let theirs = printed(&api, &me, &["--sandbox", &two]).await;
        assert_eq!(
            theirs.lines().collect::<Vec<_>>(),
            &all.lines().collect::<Vec<_>>()[5..]
        );
        let page = printed(&api, &me, &["--limit", "2", "--json"]).await;
        let page: serde_json::Value = serde_json::from_str(&page).unwrap();
        assert_eq!(page["object"], "list");
        assert_eq!(page["has_more"], true);
        assert_eq!(page["data"].as_array().unwrap().len(), 2);
        let cursor = page["next_cursor"].as_str().unwrap();
        let rest = printed(&api, &me, &["--after", cursor]).await;
        assert_eq!(
            rest.lines().collect::<Vec<_>>(),
            &all.lines().collect::<Vec<_>>()[2..]
        );

        // The server's refusals, as it says them.
        let args = parse(&["--limit", "0"]);
        let stop = std::future::pending();
        let e = events(&api, &me, &args, &mut Vec::new(), stop, POLL)
            .await
            .unwrap_err();
        assert!(e.to_string().starts_with("invalid_request: limit"), "{e}");
        let args = parse(&["--sandbox", "sbx_none"]);
        let stop = std::future::pending();
        let e = events(&api, &me, &args, &mut Vec::new(), stop, POLL)
            .await
            .unwrap_err();
        assert!(e.to_string().starts_with("not_found"), "{e}");
    }

    /// Lines written by one side, read by the other.
    #[derive(Clone, Default)]
    struct Shared(Arc<Mutex<Vec<u8>>>);

    impl Write for Shared {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Shared {
        fn text(&self) -> String {
            String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
        }

        /// Wait until `n` lines were written; then what was.
        async fn lines(&self, n: usize) -> Vec<String> {
            for _ in 0..500 {
                let text = self.text();
                if text.lines().count() >= n {
                    return text.lines().map(str::to_owned).collect();
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            panic!("not {n} lines in 5 s: {:?}", self.text());
        }
    }

    #[tokio::test]
    async fn follow_prints_what_comes_from_the_last_cursor_until_stopped() {
        let (fake, api, me) = served().await;
        let first = create(&fake, &me).await;
        let out = Shared::default();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let args = parse(&["--follow", "--json", "--limit", "1"]);
        let follow = async {
            let mut out = out.clone();
            let stopped = async {
                let _ = stopped.await;
            };
            let poll = Duration::from_millis(20);
            events(&api, &me, &args, &mut out, stopped, poll).await
        };
        let drive = async {
            // The two there already, a page of one each.
            let seen = out.lines(2).await;
            let second = create(&fake, &me).await;
            api.pause_sandbox(&me, &second).await.unwrap();
            let seen_then = out.lines(5).await;
            assert_eq!(seen_then[..2], seen[..]);
            let _ = stop.send(());
            (second, seen_then)
        };
        let (code, (second, seen)) = tokio::join!(follow, drive);
        assert_eq!(code.unwrap(), 0);
        let events: Vec<Event> = seen
            .iter()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let got: Vec<(&str, &str)> = events
            .iter()
            .map(|e| (e.kind.as_str(), e.sandbox_id.as_str()))
            .collect();
        assert_eq!(
            got,
            [
                ("sandbox.created", first.as_str()),
                ("sandbox.started", &first),
                ("sandbox.created", &second),
                ("sandbox.started", &second),
                ("sandbox.paused", &second),
            ]
        );
        // Each once: the cursors are all different.
        let mut cursors: Vec<&str> = events.iter().map(|e| e.cursor.as_str()).collect();
        cursors.dedup();
        assert_eq!(cursors.len(), 5);
        // Nothing more came once stopped.
        tokio::time::sleep(Duration::from_millis(60)).await;
        assert_eq!(out.text().lines().count(), 5);
    }
}
