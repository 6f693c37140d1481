//! The account's events: what happened to its sandboxes (created,
//! started, paused, ended…), who did it and why, newest first, on their
//! own page and, for one sandbox, on its page. What an event is and how it
//! is kept is `sandpit_core::service::events`'.
//!
//! The API reads the log forward only (oldest first, after a cursor), and
//! a person wants the latest: a page is a window of at most [`PER_PAGE`]
//! events, found by reading the log from its oldest kept event in pages of
//! 500, at most [`WALK_PAGES`] of them, and keeping the last window. A
//! window is named in the address by the cursor of the event just after it
//! (`?before=`) or just before it (`?after=`), so "Older" and "Newer" are
//! links, and a sandbox's events (`?sandbox=`) page the same way.

use crate::session::Signed;
use crate::view::{ago, page, url_encode, Failure, Section};
use crate::Web;
use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use maud::{html, Markup};
use sandpit_core::{Caller, CoreError, ErrorType, Event, List, ListEvents};
use serde::Deserialize;
use std::collections::VecDeque;

/// Events on a page.
pub(crate) const PER_PAGE: usize = 100;
/// A sandbox's page shows its latest this many.
pub(crate) const ON_A_SANDBOX: usize = 20;
/// How many pages of the log (500 events each) a window is looked for in.
const WALK_PAGES: usize = 20;
/// The API's largest page.
const API_PAGE: u32 = 500;

/// Which window of the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum At {
    /// The latest events.
    Latest,
    /// The events just before the one with this cursor.
    Before(String),
    /// The events after this cursor; `None`: from the oldest kept.
    After(Option<String>),
}

/// A window of the log, and what lies around it.
#[derive(Debug, Clone, Default)]
pub(crate) struct Window {
    /// Oldest first.
    pub events: Vec<Event>,
    /// Older events exist: `?before=` the first one's cursor shows them.
    pub older: bool,
    /// Newer events exist: `?after=` the last one's cursor shows them.
    pub newer: bool,
    /// The log was longer than a walk reads: the window is the last that
    /// walk read, not the latest.
    pub cut_short: bool,
}

/// The window `at` of the account's events (of one sandbox's with
/// `sandbox`), at most `n` events.
pub(crate) async fn window(
    web: &Web,
    caller: &Caller,
    sandbox: Option<&str>,
    at: &At,
    n: usize,
) -> Result<Window, CoreError> {
    let read = |after: Option<String>, limit: u32| {
        web.api.list_events(
            caller,
            ListEvents {
                limit: Some(limit),
                after,
                sandbox_id: sandbox.map(str::to_string),
            },
        )
    };
    walk(read, at, n).await
}

/// [`window`] over `read` (the events after a cursor, at most so many).
async fn walk<F, R>(read: F, at: &At, n: usize) -> Result<Window, CoreError>
where
    F: Fn(Option<String>, u32) -> R,
    R: std::future::Future<Output = Result<List<Event>, CoreError>>,
{
    if let At::After(after) = at {
        let list = read(after.clone(), n as u32).await?;
        return Ok(Window {
            older: after.is_some(),
            newer: list.has_more,
            cut_short: false,
            events: list.data,
        });
    }
    let mut kept: VecDeque<Event> = VecDeque::with_capacity(n + 1);
    let mut dropped = false;
    let mut after: Option<String> = None;
    let mut found = false;
    let mut ended = false;
    'walk: for _ in 0..WALK_PAGES {
        let list = read(after.clone(), API_PAGE).await?;
        let empty = list.data.is_empty();
        for e in list.data {
            if let At::Before(cursor) = at {
                if e.cursor == *cursor {
                    found = true;
                    break 'walk;
                }
            }
            after = Some(e.cursor.clone());
            kept.push_back(e);
            if kept.len() > n {
                kept.pop_front();
                dropped = true;
            }
        }
        if !list.has_more || empty {
            ended = true;
            break;
        }
    }
    if let At::Before(cursor) = at {
        if !found {
            return Err(CoreError::new(
                ErrorType::NotFound,
                format!("No event at {cursor:?} in this log: it may be older than what is kept."),
            ));
        }
    }
    Ok(Window {
        events: kept.into(),
        older: dropped,
        newer: found || !ended,
        cut_short: matches!(at, At::Latest) && !ended,
    })
}

#[derive(Deserialize, Default)]
pub(crate) struct EventsQuery {
    /// The window before this event's cursor.
    #[serde(default)]
    before: Option<String>,
    /// The window after this cursor (empty: from the oldest).
    #[serde(default)]
    after: Option<String>,
    /// Only this sandbox's.
    #[serde(default)]
    sandbox: Option<String>,
}

impl EventsQuery {
    fn at(&self) -> At {
        match (&self.before, &self.after) {
            (Some(b), _) if !b.is_empty() => At::Before(b.clone()),
            (_, Some(a)) => At::After(Some(a.clone()).filter(|a| !a.is_empty())),
            _ => At::Latest,
        }
    }
}

/// `/events` (`?before=`, `?after=`, `?sandbox=`).
pub(crate) async fn list(
    State(web): State<Web>,
    signed: Signed,
    Query(q): Query<EventsQuery>,
) -> Result<Response, Failure> {
    let sandbox = q.sandbox.as_deref().filter(|s| !s.is_empty());
    let at = q.at();
    let w = window(&web, &signed.caller, sandbox, &at, PER_PAGE).await?;
    let link = |key: &str, cursor: &str| {
        let mut href = format!("/events?{key}={}", url_encode(cursor));
        if let Some(s) = sandbox {
            href.push_str(&format!("&sandbox={}", url_encode(s)));
        }
        href
    };
    let latest = match sandbox {
        Some(s) => format!("/events?sandbox={}", url_encode(s)),
        None => "/events".to_string(),
    };
    let older = w
        .events
        .first()
        .filter(|_| w.older)
        .map(|e| link("before", &e.cursor));
    let newer = w
        .events
        .last()
        .filter(|_| w.newer)
        .map(|e| link("after", &e.cursor));
    let title = match sandbox {
        Some(s) => format!("Events of {s}"),
        None => "Events".to_string(),
    };
    let body = html! {
        @if let Some(s) = sandbox {
            p class="crumbs" { a href="/events" { "Events" } " / " a href={ "/sandboxes/" (s) } { (s) } }
        }
        h1 { (title) }
        p class="muted" {
            "What happened to "
            @if sandbox.is_some() { "this sandbox" } @else { "your sandboxes" }
            ", who did it and why, newest first. The same events are POSTed to your "
            a href="/webhooks" { "webhooks" } " and listed by " code { "GET /v1/events" } "."
        }
        @if at == At::Latest {
            @if w.cut_short {
                p class="notice" role="status" {
                    "The log is longer than one page reads: these are not yet the latest. "
                    "Follow Newer events."
                }
            }
        }
        (pager(older.as_deref(), newer.as_deref(), (at != At::Latest).then_some(latest.as_str())))
        @if w.events.is_empty() {
            p class="muted" { "No events yet." }
        } @else {
            (table(&w.events, sandbox.is_none()))
        }
        @if w.events.len() > 10 {
            (pager(older.as_deref(), newer.as_deref(), (at != At::Latest).then_some(latest.as_str())))
        }
    };
    Ok(page(&title, Some(&signed.session), Section::Events, body).into_response())
}

/// The links to the windows around this one.
fn pager(older: Option<&str>, newer: Option<&str>, latest: Option<&str>) -> Markup {
    html! {
        @if older.is_some() || newer.is_some() || latest.is_some() {
            nav class="pager" aria-label="Pages of events" {
                @if let Some(href) = newer { a href=(href) { "Newer events" } }
                @if let Some(href) = latest { a href=(href) { "Latest events" } }
                @if let Some(href) = older { a href=(href) { "Older events" } }
            }
        }
    }
}

/// Events as a table, newest first; `with_sandbox`: with the sandbox and
/// its size (not on the sandbox's own page).
pub(crate) fn table(events: &[Event], with_sandbox: bool) -> Markup {
    html! {
        div class="scroll" { table class="events" {
            thead { tr {
                th scope="col" { "When" } th scope="col" { "Event" }
                @if with_sandbox { th scope="col" { "Sandbox" } th scope="col" { "Size" } }
                th scope="col" { "Status" } th scope="col" { "By" } th scope="col" { "Why" }
            } }
            tbody {
                @for e in events.iter().rev() {
                    tr id={ "event-" (e.id) } {
                        td class="when" { (ago(&e.at)) }
                        td class="kind" { code { (e.kind) } }
                        @if with_sandbox {
                            td class="sandbox" { a href={ "/sandboxes/" (e.sandbox_id) } { (e.sandbox_id) } }
                            td class="size" data-label="size" { (e.size) }
                        }
                        td class="status" { span class={ "badge " (e.status) } { (e.status) } }
                        td class="by" data-label="by" { (e.actor) }
                        td class="why" {
                            @if let Some(r) = &e.reason { span class="line" { (r) } }
                            @for (key, value) in &e.detail {
                                span class="line muted small" { (key) ": " (detail_value(value)) }
                            }
                        }
                    }
                }
            }
        } }
    }
}

/// A detail's value as it reads: a string without quotes, a list of them
/// apart by commas, anything else as JSON.
fn detail_value(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Array(items) => items
            .iter()
            .map(detail_value)
            .collect::<Vec<_>>()
            .join(", "),
        other => other.to_string(),
    }
}

/// A sandbox's page's section: its latest events, or why they cannot be
/// read (the page stands without them).
pub(crate) async fn sandbox_section(web: &Web, caller: &Caller, id: &str) -> Markup {
    let w = window(web, caller, Some(id), &At::Latest, ON_A_SANDBOX).await;
    html! {
        section id="events" aria-labelledby="events-h" {
            h2 id="events-h" { "Events" }
            @match &w {
                Err(e) => p class="error" role="alert" { (e.message) },
                Ok(w) if w.events.is_empty() => p class="muted" { "No events yet." },
                Ok(w) => {
                    (table(&w.events, false))
                    @if w.older || w.newer {
                        p { a href={ "/events?sandbox=" (url_encode(id)) } { "All of its events" } }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(n: u32, kind: &str, detail: serde_json::Value) -> Event {
        Event {
            object: "event".into(),
            id: format!("evt_{n}"),
            cursor: n.to_string(),
            kind: kind.into(),
            sandbox_id: "sbx_a".into(),
            size: "small".into(),
            status: "running".into(),
            actor: "dashboard".into(),
            reason: None,
            detail: detail.as_object().cloned().unwrap_or_default(),
            at: "2026-01-02T03:04:05Z".into(),
        }
    }

    #[test]
    fn a_table_lists_events_newest_first_with_their_details() {
        let events = [
            event(1, "sandbox.created", serde_json::json!({})),
            event(
                2,
                "sandbox.started",
                serde_json::json!({"from": "pool", "forks": ["sbx_b", "sbx_c"]}),
            ),
        ];
        let html = table(&events, true).into_string();
        let started = html.find("sandbox.started").unwrap();
        let created = html.find("sandbox.created").unwrap();
        assert!(started < created, "not newest first: {html}");
        assert!(html.contains("from: pool"), "{html}");
        assert!(html.contains("forks: sbx_b, sbx_c"), "{html}");
        assert!(html.contains("href=\"/sandboxes/sbx_a\""), "{html}");
        assert!(html.contains(">small</td>"), "{html}");
        // On the sandbox's own page, no sandbox or size column.
        let html = table(&events, false).into_string();
        assert!(!html.contains("href=\"/sandboxes/sbx_a\""), "{html}");
        assert!(!html.contains("<th scope=\"col\">Size</th>"), "{html}");
    }

    /// A log of `len` events (cursors 1..=len) read as the API reads it.
    async fn read_log(
        len: u32,
        after: Option<String>,
        limit: u32,
    ) -> Result<List<Event>, CoreError> {
        let from = after.map_or(0, |a| a.parse::<u32>().unwrap());
        let to = (from + limit).min(len);
        let data: Vec<Event> = (from + 1..=to)
            .map(|i| event(i, "sandbox.noted", serde_json::json!({})))
            .collect();
        Ok(List::new(data, to < len, Some(to.to_string())))
    }

    fn cursors(w: &Window) -> (u32, u32, usize) {
        let c = |e: &Event| e.cursor.parse::<u32>().unwrap();
        (c(&w.events[0]), c(w.events.last().unwrap()), w.events.len())
    }

    #[tokio::test]
    async fn windows_page_back_and_forth_through_a_long_log() {
        let log = |len| move |after, limit| read_log(len, after, limit);
        // The latest 100 of 1234, with older ones before them.
        let w = walk(log(1234), &At::Latest, 100).await.unwrap();
        assert_eq!(cursors(&w), (1135, 1234, 100));
        assert!(w.older && !w.newer && !w.cut_short);
        // Older: the 100 before the first shown.
        let w = walk(log(1234), &At::Before("1135".into()), 100)
            .await
            .unwrap();
        assert_eq!(cursors(&w), (1035, 1134, 100));
        assert!(w.older && w.newer);
        // The first ones: nothing older.
        let w = walk(log(1234), &At::Before("60".into()), 100)
            .await
            .unwrap();
        assert_eq!(cursors(&w), (1, 59, 59));
        assert!(!w.older && w.newer);
        // Newer: the ones after the last shown.
        let w = walk(log(1234), &At::After(Some("59".into())), 100)
            .await
            .unwrap();
        assert_eq!(cursors(&w), (60, 159, 100));
        assert!(w.older && w.newer);
        let w = walk(log(1234), &At::After(Some("1200".into())), 100)
            .await
            .unwrap();
        assert_eq!(cursors(&w), (1201, 1234, 34));
        assert!(w.older && !w.newer);
        // A short log: all of it, nothing around it.
        let w = walk(log(7), &At::Latest, 100).await.unwrap();
        assert_eq!(cursors(&w), (1, 7, 7));
        assert!(!w.older && !w.newer);
        let w = walk(log(0), &At::Latest, 100).await.unwrap();
        assert!(w.events.is_empty() && !w.older && !w.newer);
        // A cursor not in the log is not found.
        let e = walk(log(7), &At::Before("70".into()), 100)
            .await
            .unwrap_err();
        assert_eq!(e.kind, ErrorType::NotFound);
        // Longer than a walk reads: the last that was read, said so.
        let w = walk(log(20_000), &At::Latest, 100).await.unwrap();
        assert_eq!(cursors(&w), (9901, 10_000, 100));
        assert!(w.cut_short && w.newer && w.older);
    }

    #[test]
    fn the_query_names_its_window() {
        let q = |before: Option<&str>, after: Option<&str>| EventsQuery {
            before: before.map(str::to_string),
            after: after.map(str::to_string),
            sandbox: None,
        };
        assert_eq!(q(None, None).at(), At::Latest);
        assert_eq!(q(Some("7"), None).at(), At::Before("7".into()));
        assert_eq!(q(None, Some("7")).at(), At::After(Some("7".into())));
        assert_eq!(q(None, Some("")).at(), At::After(None));
        assert_eq!(q(Some(""), None).at(), At::Latest);
    }
}
