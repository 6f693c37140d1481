//! `sandpit webhook`: an account's webhooks on a server (--url,
//! SANDPIT_API_KEY): register a URL for its events (the signing secret
//! printed this once), list, show and delete them, a webhook's deliveries
//! with their attempts, and send one again. A thin client of
//! `/v1/webhooks`: every check is the server's.

use crate::sandbox::{api_error, server, ServerArgs};
use anyhow::Result;
use clap::Subcommand;
use sandpit_api::RemoteApi;
use sandpit_core::api::prelude::*;
use sandpit_core::{Caller, CreateWebhook, ListDeliveries, Webhook, WebhookDelivery};
use std::io::Write;

#[derive(Subcommand)]
pub enum WebhookCommand {
    /// Have the account's events POSTed to URL (http or https), signed as
    /// Standard Webhooks says; prints its id and its secret, which the
    /// server shows this once
    Create {
        /// Where its events go (not --url, the server's)
        #[arg(value_name = "URL")]
        hook_url: String,
        /// An event type it gets (again for more): sandbox.created,
        /// sandbox.started, sandbox.paused, sandbox.resumed,
        /// sandbox.snapshotted, sandbox.forked, sandbox.restored,
        /// sandbox.extended, sandbox.shortened, sandbox.moved, sandbox.noted,
        /// sandbox.destroying, sandbox.killed, sandbox.expired,
        /// sandbox.failed, or * for all [default: all]
        #[arg(long = "event", value_name = "TYPE")]
        events: Vec<String>,
        /// What it is for, in words of your own
        #[arg(long)]
        description: Option<String>,
        #[command(flatten)]
        server: ServerArgs,
        /// Print the webhook (its secret included) as JSON
        #[arg(long)]
        json: bool,
    },
    /// List the account's webhooks: id, URL, event types, deliveries
    /// pending, delivered and failed, description
    #[command(visible_alias = "ls")]
    List {
        #[command(flatten)]
        server: ServerArgs,
        #[arg(long)]
        json: bool,
    },
    /// Show a webhook (wh_...)
    Get {
        id: String,
        #[command(flatten)]
        server: ServerArgs,
        #[arg(long)]
        json: bool,
    },
    /// Delete webhooks (wh_...): nothing more is sent to them, and their
    /// pending deliveries are dropped
    #[command(visible_alias = "rm")]
    Delete {
        #[arg(required = true)]
        ids: Vec<String>,
        #[command(flatten)]
        server: ServerArgs,
    },
    /// A webhook's deliveries, newest first: each one's event, status and
    /// attempts (when, the answer's status, how long, what went wrong)
    Deliveries {
        id: String,
        /// At most this many, 1..100 [default: 20]
        #[arg(long, value_name = "N")]
        limit: Option<u32>,
        /// Only those older than this delivery (the next page)
        #[arg(long, value_name = "DELIVERY_ID")]
        starting_after: Option<String>,
        #[command(flatten)]
        server: ServerArgs,
        #[arg(long)]
        json: bool,
    },
    /// Send a webhook's delivery (its event's id, evt_...) again, now,
    /// and print it with the new attempt
    Redeliver {
        id: String,
        delivery_id: String,
        #[command(flatten)]
        server: ServerArgs,
        #[arg(long)]
        json: bool,
    },
}

impl WebhookCommand {
    fn server(&self) -> &ServerArgs {
        match self {
            WebhookCommand::Create { server, .. }
            | WebhookCommand::List { server, .. }
            | WebhookCommand::Get { server, .. }
            | WebhookCommand::Delete { server, .. }
            | WebhookCommand::Deliveries { server, .. }
            | WebhookCommand::Redeliver { server, .. } => server,
        }
    }
}

pub async fn run(cmd: WebhookCommand) -> Result<i32> {
    let (api, caller) = server(cmd.server()).await?;
    webhook(&api, &caller, cmd, &mut std::io::stdout()).await
}

/// What `sandpit webhook` does, its lines written to `out`.
async fn webhook(
    api: &RemoteApi,
    caller: &Caller,
    cmd: WebhookCommand,
    out: &mut dyn Write,
) -> Result<i32> {
    match cmd {
        WebhookCommand::Create {
            hook_url,
            events,
            description,
            json,
            ..
        } => {
            let req = CreateWebhook {
                url: hook_url,
                events,
                description,
            };
            let made = api.create_webhook(caller, req).await.map_err(api_error)?;
            if json {
                writeln!(out, "{}", serde_json::to_string_pretty(&made)?)?;
            } else {
                writeln!(out, "{}", line(&made))?;
                writeln!(out, "secret\t{}", made.secret.as_deref().unwrap_or("-"))?;
            }
            eprintln!(
                "The secret is shown this once: keep it now. It signs every delivery \
                 (webhook-signature); the server never shows it again."
            );
        }
        WebhookCommand::List { json, .. } => {
            let list = api.list_webhooks(caller).await.map_err(api_error)?;
            match json {
                true => writeln!(out, "{}", serde_json::to_string_pretty(&list)?)?,
                false => {
                    for w in &list.data {
                        writeln!(out, "{}", line(w))?;
                    }
                }
            }
        }
        WebhookCommand::Get { id, json, .. } => {
            let w = api.get_webhook(caller, &id).await.map_err(api_error)?;
            match json {
                true => writeln!(out, "{}", serde_json::to_string_pretty(&w)?)?,
                false => writeln!(out, "{}", line(&w))?,
            }
        }
        WebhookCommand::Delete { ids, .. } => {
            for id in ids {
                api.delete_webhook(caller, &id).await.map_err(api_error)?;
                writeln!(out, "{id}")?;
            }
        }
        WebhookCommand::Deliveries {
            id,
            limit,
            starting_after,
            json,
            ..
        } => {
            let q = ListDeliveries {
                limit,
                starting_after,
            };
            let page = api
                .list_deliveries(caller, &id, q)
                .await
                .map_err(api_error)?;
            if json {
                writeln!(out, "{}", serde_json::to_string_pretty(&page)?)?;
            } else {
                for d in &page.data {
                    write!(out, "{}", delivery(d))?;
                }
                if let (true, Some(cursor)) = (page.has_more, &page.next_cursor) {
                    eprintln!("(more: sandpit webhook deliveries {id} --starting-after {cursor})");
                }
            }
        }
        WebhookCommand::Redeliver {
            id,
            delivery_id,
            json,
            ..
        } => {
            let d = api
                .redeliver(caller, &id, &delivery_id)
                .await
                .map_err(api_error)?;
            match json {
                true => writeln!(out, "{}", serde_json::to_string_pretty(&d)?)?,
                false => write!(out, "{}", delivery(&d))?,
            }
        }
    }
    Ok(0)
}

/// A webhook on one line: id, URL, event types, its deliveries by state,
/// description (`-` for none).
fn line(w: &Webhook) -> String {
    format!(
        "{}\t{}\t{}\t{} pending, {} delivered, {} failed\t{}",
        w.id,
        w.url,
        w.events.join(","),
        w.pending,
        w.delivered,
        w.failed,
        w.description.as_deref().unwrap_or("-")
    )
}

/// A delivery: a line of its own (event, type, sandbox, status, when
/// made, and when next tried or when delivered), then its attempts
/// indented, one a line (when, the answer's status or `-`, how long, the
/// error or `ok`).
fn delivery(d: &WebhookDelivery) -> String {
    let mut s = format!(
        "{}\t{}\t{}\t{}\t{}",
        d.id, d.event_type, d.sandbox_id, d.status, d.created_at
    );
    if let Some(next) = &d.next_attempt_at {
        s.push_str(&format!("\tnext attempt {next}"));
    }
    if let Some(at) = &d.delivered_at {
        s.push_str(&format!("\tdelivered {at}"));
    }
    s.push('\n');
    for a in &d.attempts {
        let status = a.status_code.map_or("-".to_string(), |c| c.to_string());
        s.push_str(&format!(
            "  {}\t{status}\t{} ms\t{}\n",
            a.at,
            a.duration_ms,
            a.error.as_deref().unwrap_or("ok")
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::tests::served;
    use clap::Parser;
    use sandpit_core::DeliveryAttempt;
    use serde_json::Value;

    fn parse(args: &[&str]) -> WebhookCommand {
        let argv = ["sandpit", "webhook"].iter().chain(args);
        match crate::Cli::try_parse_from(argv).unwrap().command {
            crate::Command::Webhook { command } => command,
            _ => unreachable!(),
        }
    }

    async fn printed(api: &RemoteApi, caller: &Caller, args: &[&str]) -> Result<String> {
        let mut out = Vec::new();
        assert_eq!(webhook(api, caller, parse(args), &mut out).await?, 0);
        Ok(String::from_utf8(out).unwrap())
    }

    #[tokio::test]
    async fn webhooks_are_created_listed_shown_and_deleted() {
        let (_fake, api, me) = served().await;
        let url = "https://hooks.example.com/in";
        let made = printed(
            &api,
            &me,
            &[
                "create",
                url,
                "--event",
                "sandbox.created",
                "--event",
                "sandbox.expired",
                "--description",
                "ops pager",
            ],
        )
        .await
        .unwrap();
        // Its line, then its secret.
        let lines: Vec<&str> = made.lines().collect();
        assert_eq!(lines.len(), 2, "{made}");
        let id = lines[0].split('\t').next().unwrap().to_owned();
        assert!(id.starts_with("wh_"), "{made}");
        assert_eq!(
            lines[0],
            format!(
                "{id}\t{url}\tsandbox.created,sandbox.expired\t\
                 0 pending, 0 delivered, 0 failed\tops pager"
            )
        );
        assert!(lines[1].starts_with("secret\twhsec_"), "{made}");

        // All events, as JSON: the secret in it.
        let all = printed(
            &api,
            &me,
            &["create", "http://hooks.example.com/all", "--json"],
        )
        .await
        .unwrap();
        let all: Webhook = serde_json::from_str(&all).unwrap();
        assert_eq!(all.events, ["*"]);
        assert!(all.secret.unwrap().starts_with("whsec_"));

        // Listed and shown, never with the secret.
        let list = printed(&api, &me, &["list"]).await.unwrap();
        assert_eq!(list.lines().next(), Some(lines[0]));
        assert_eq!(list.lines().count(), 2);
        assert!(!list.contains("whsec_"), "{list}");
        let shown = printed(&api, &me, &["get", &id]).await.unwrap();
        assert_eq!(shown, format!("{}\n", lines[0]));
        let shown: Value =
            serde_json::from_str(&printed(&api, &me, &["get", &id, "--json"]).await.unwrap())
                .unwrap();
        assert_eq!(shown["id"], id.as_str());
        assert!(shown.get("secret").is_none(), "{shown}");
        let listed: Value =
            serde_json::from_str(&printed(&api, &me, &["ls", "--json"]).await.unwrap()).unwrap();
        assert_eq!(listed["data"].as_array().unwrap().len(), 2);

        // No deliveries yet (the fake sends nothing), and none to send again.
        let deliveries = printed(&api, &me, &["deliveries", &id, "--limit", "5"])
            .await
            .unwrap();
        assert_eq!(deliveries, "");
        let page = printed(&api, &me, &["deliveries", &id, "--json"])
            .await
            .unwrap();
        let page: Value = serde_json::from_str(&page).unwrap();
        assert_eq!(page["data"], serde_json::json!([]));
        let e = printed(&api, &me, &["redeliver", &id, "evt_none"])
            .await
            .unwrap_err();
        assert!(e.to_string().starts_with("not_found"), "{e}");

        // The server's refusals, as it says them.
        let e = printed(&api, &me, &["create", url, "--event", "sandbox.exploded"])
            .await
            .unwrap_err();
        let e = e.to_string();
        assert!(
            e.starts_with("invalid_request") && e.contains("sandbox.exploded"),
            "{e}"
        );
        let e = printed(&api, &me, &["create", "ftp://hooks.example.com"])
            .await
            .unwrap_err();
        assert!(e.to_string().starts_with("invalid_request"), "{e}");

        // Deleted: its id printed, then it is gone.
        let deleted = printed(&api, &me, &["delete", &id]).await.unwrap();
        assert_eq!(deleted, format!("{id}\n"));
        let e = printed(&api, &me, &["get", &id]).await.unwrap_err();
        assert!(e.to_string().starts_with("not_found"), "{e}");
        let e = printed(&api, &me, &["rm", &id]).await.unwrap_err();
        assert!(e.to_string().starts_with("not_found"), "{e}");
        assert_eq!(
            printed(&api, &me, &["list"]).await.unwrap().lines().count(),
            1
        );
    }

    #[test]
    fn the_commands_arguments_are_each_their_own() {
        // Clap's own checks (in a debug build), and two arguments of one
        // name (a positional `url` beside the flattened --url) told apart.
        <crate::Cli as clap::CommandFactory>::command().debug_assert();
        let cmd = parse(&["create", "https://h.example/x", "--url", "http://s:1"]);
        match cmd {
            WebhookCommand::Create {
                hook_url, server, ..
            } => assert_eq!(
                (hook_url.as_str(), server.url.as_str()),
                ("https://h.example/x", "http://s:1")
            ),
            _ => unreachable!(),
        }
    }

    #[test]
    fn a_delivery_is_a_line_then_its_attempts() {
        let mut d = WebhookDelivery {
            object: "webhook_delivery".into(),
            id: "evt_1".into(),
            webhook_id: "wh_1".into(),
            event_type: "sandbox.killed".into(),
            sandbox_id: "sbx_1".into(),
            status: "pending".into(),
            next_attempt_at: Some("2026-12-07T08:01:00Z".into()),
            attempts: vec![
                DeliveryAttempt {
                    at: "2026-12-07T08:00:00Z".into(),
                    status_code: None,
                    error: Some("connection refused".into()),
                    duration_ms: 3,
                },
                DeliveryAttempt {
                    at: "2026-12-07T08:00:30Z".into(),
                    status_code: Some(500),
                    error: Some("HTTP 500".into()),
                    duration_ms: 41,
                },
            ],
            created_at: "2026-12-07T08:00:00Z".into(),
            delivered_at: None,
        };
        assert_eq!(
            delivery(&d),
            "evt_1\tsandbox.killed\tsbx_1\tpending\t2026-12-07T08:00:00Z\t\
             next attempt 2026-12-07T08:01:00Z\n\
             \x20 2026-12-07T08:00:00Z\t-\t3 ms\tconnection refused\n\
             \x20 2026-12-07T08:00:30Z\t500\t41 ms\tHTTP 500\n"
        );
        d.status = "delivered".into();
        d.next_attempt_at = None;
        d.delivered_at = Some("2026-12-07T08:02:00Z".into());
        d.attempts = vec![DeliveryAttempt {
            at: "2026-12-07T08:02:00Z".into(),
            status_code: Some(204),
            error: None,
            duration_ms: 12,
        }];
        assert_eq!(
            delivery(&d),
            "evt_1\tsandbox.killed\tsbx_1\tdelivered\t2026-12-07T08:00:00Z\t\
             delivered 2026-12-07T08:02:00Z\n\
             \x20 2026-12-07T08:02:00Z\t204\t12 ms\tok\n"
        );
    }
}
