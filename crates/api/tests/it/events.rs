//! `/v1/events` and `/v1/webhooks` over REST in front of the fake: the
//! routes, their status codes and shapes, paging by cursor, what another
//! account gets (404), the refusals as the error body says them, and the
//! same routes through `RemoteApi`. (The service's own events and
//! deliveries are tested with it, in `crates/core/tests`.)

use crate::{expect_error, Server};
use base64::Engine;
use reqwest::Method;
use sandpit_api::RemoteApi;
use sandpit_core::api::prelude::*;
use sandpit_core::{
    CreateSandbox, CreateWebhook, ErrorType, Event, List, ListDeliveries, ListEvents, Webhook,
    WebhookDelivery, EVENT_TYPES,
};
use sandpit_fake::{Op, KEY_A, KEY_B};
use serde_json::{json, Value};

async fn events(s: &Server, query: &str) -> List<Event> {
    let r = s
        .a(Method::GET, &format!("/events{query}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

fn kinds(list: &List<Event>) -> Vec<&str> {
    list.data.iter().map(|e| e.kind.as_str()).collect()
}

#[tokio::test]
async fn a_sandboxs_life_is_listed_as_events_paged_by_cursor() {
    let s = Server::start().await;
    let sbx = s.create().await;
    for action in ["pause", "resume"] {
        let r = s
            .a(Method::POST, &format!("/sandboxes/{sbx}/{action}"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    let r = s
        .a(Method::DELETE, &format!("/sandboxes/{sbx}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);

    // The body as JSON: a list of event objects, every field there.
    let r = s.a(Method::GET, "/events").send().await.unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["object"], "list");
    assert_eq!(v["has_more"], false);
    let first = &v["data"][0];
    let mut keys: Vec<&str> = first.as_object().unwrap().keys().map(|k| &**k).collect();
    keys.sort();
    assert_eq!(
        keys,
        [
            "actor",
            "at",
            "cursor",
            "detail",
            "id",
            "object",
            "reason",
            "sandbox_id",
            "size",
            "status",
            "type"
        ],
        "{first}"
    );
    assert_eq!(first["object"], "event");
    assert_eq!(first["detail"], json!({}));
    let all: List<Event> = serde_json::from_value(v).unwrap();
    assert_eq!(
        kinds(&all),
        [
            "sandbox.created",
            "sandbox.started",
            "sandbox.paused",
            "sandbox.resumed",
            "sandbox.destroying",
            "sandbox.killed"
        ]
    );
    for e in &all.data {
        assert!(e.id.starts_with("evt_"), "{e:?}");
        assert_eq!(e.sandbox_id, sbx);
        assert_eq!(e.actor, "api key");
        assert!(EVENT_TYPES.contains(&e.kind.as_str()));
    }
    assert_eq!(all.data[0].status, "provisioning");
    assert_eq!(all.data[1].detail["from"], "cold");
    assert_eq!(all.data[1].status, "running");
    assert_eq!(all.data[2].status, "paused");
    assert_eq!(all.data[4].status, "deleting");
    let killed = &all.data[5];
    assert_eq!(
        (killed.status.as_str(), killed.reason.as_deref()),
        ("deleted", Some("destroyed"))
    );
    // next_cursor is the last event's, even on the last page.
    assert_eq!(all.next_cursor.as_ref(), Some(&killed.cursor));

    // Paged: two, then the rest after the cursor, then nothing (and the
    // cursor given back, to poll with).
    let page = events(&s, "?limit=2").await;
    assert_eq!(page.data, all.data[..2]);
    assert!(page.has_more);
    let cursor = page.next_cursor.clone().unwrap();
    assert_eq!(cursor, all.data[1].cursor);
    let rest = events(&s, &format!("?after={cursor}")).await;
    assert_eq!(rest.data, all.data[2..]);
    assert!(!rest.has_more);
    let last = rest.next_cursor.unwrap();
    let none = events(&s, &format!("?after={last}")).await;
    assert!(none.data.is_empty());
    assert_eq!(none.next_cursor, Some(last.clone()));

    // Another sandbox: each one's events apart, by query or by path.
    let other = s.create().await;
    let theirs = events(&s, &format!("?after={last}")).await;
    assert_eq!(kinds(&theirs), ["sandbox.created", "sandbox.started"]);
    let by_query = events(&s, &format!("?sandbox_id={sbx}")).await;
    assert_eq!(by_query.data, all.data);
    let r = s
        .a(Method::GET, &format!("/sandboxes/{other}/events?limit=1"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let by_path: List<Event> = r.json().await.unwrap();
    assert_eq!(by_path.data, theirs.data[..1]);
    assert!(by_path.has_more);
    let r = s
        .a(
            Method::GET,
            &format!(
                "/sandboxes/{other}/events?after={}",
                by_path.next_cursor.unwrap()
            ),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(
        r.json::<List<Event>>().await.unwrap().data,
        theirs.data[1..]
    );

    // Account B has none, and A's sandboxes are not found for it.
    let r = s.b(Method::GET, "/events").send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.json::<List<Event>>().await.unwrap().data.is_empty());
    let r = s
        .b(Method::GET, &format!("/sandboxes/{sbx}/events"))
        .send()
        .await
        .unwrap();
    expect_error(r, 404, ErrorType::NotFound).await;
    let r = s
        .b(Method::GET, &format!("/events?sandbox_id={sbx}"))
        .send()
        .await
        .unwrap();
    expect_error(r, 404, ErrorType::NotFound).await;
}

#[tokio::test]
async fn bad_event_queries_are_refused_saying_why() {
    let s = Server::start().await;
    // Before any event, the cursor to poll with is the log's start.
    let none = events(&s, "").await;
    assert!(none.data.is_empty() && !none.has_more);
    assert_eq!(none.next_cursor.as_deref(), Some("0"));
    let sbx = s.create().await;
    for (path, why) in [
        ("/events?limit=0".to_string(), "limit"),
        ("/events?limit=501".to_string(), "limit"),
        ("/events?limit=many".to_string(), "`limit`"),
        ("/events?after=nowhere".to_string(), "nowhere"),
        ("/events?starting_after=x".to_string(), "`starting_after`"),
        // The sandbox is the path's; the query cannot name another.
        (
            format!("/sandboxes/{sbx}/events?sandbox_id={sbx}"),
            "`sandbox_id`",
        ),
    ] {
        let r = s.a(Method::GET, &path).send().await.unwrap();
        let e = expect_error(r, 400, ErrorType::InvalidRequest).await;
        assert!(e.error.message.contains(why), "{path}: {}", e.error.message);
    }
    // A cursor past the last event lists nothing, and gives it back.
    let later = events(&s, "?after=99").await;
    assert!(later.data.is_empty());
    assert_eq!(later.next_cursor.as_deref(), Some("99"));
    let r = s
        .a(Method::GET, "/sandboxes/sbx_none/events")
        .send()
        .await
        .unwrap();
    expect_error(r, 404, ErrorType::NotFound).await;
    let r = s.http.get(s.v1("/events")).send().await.unwrap();
    expect_error(r, 401, ErrorType::Unauthorized).await;
}

#[tokio::test]
async fn webhooks_are_created_listed_found_and_deleted() {
    let s = Server::start().await;
    let r = s
        .a(Method::POST, "/webhooks")
        .json(&json!({
            "url": "https://hooks.example.com/sandpit",
            "events": ["sandbox.created", "sandbox.killed", "sandbox.created"],
            "description": "ops",
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let made: Webhook = r.json().await.unwrap();
    assert_eq!(made.object, "webhook");
    assert!(made.id.starts_with("wh_"), "{}", made.id);
    assert_eq!(made.url, "https://hooks.example.com/sandpit");
    assert_eq!(made.events, ["sandbox.created", "sandbox.killed"]);
    assert_eq!(made.description.as_deref(), Some("ops"));
    assert_eq!((made.pending, made.delivered, made.failed), (0, 0, 0));
    // The secret: whsec_ and 32 bytes in base64, shown this once.
    let secret = made.secret.clone().unwrap();
    let key = secret.strip_prefix("whsec_").unwrap();
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(key)
        .unwrap();
    assert_eq!(bytes.len(), 32);
    let kept = Webhook {
        secret: None,
        ..made.clone()
    };

    // Listed and found without it (not even as null).
    let r = s.a(Method::GET, "/webhooks").send().await.unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert!(v["data"][0].get("secret").is_none(), "{v}");
    let list: List<Webhook> = serde_json::from_value(v).unwrap();
    assert_eq!(list.object, "list");
    assert_eq!(list.data, std::slice::from_ref(&kept));
    let one = format!("/webhooks/{}", made.id);
    let r = s.a(Method::GET, &one).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Webhook>().await.unwrap(), kept);

    // No events asked for, or "*" among them: all of them.
    for events in [json!([]), json!(["*", "sandbox.paused"])] {
        let r = s
            .a(Method::POST, "/webhooks")
            .json(&json!({"url": "http://hooks.example.com/all", "events": events}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 201);
        assert_eq!(r.json::<Webhook>().await.unwrap().events, ["*"]);
    }
    let r = s
        .a(Method::POST, "/webhooks")
        .json(&json!({"url": "https://hooks.example.com/plain"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    assert_eq!(r.json::<Webhook>().await.unwrap().events, ["*"]);

    // Its deliveries: none (the fake delivers nothing), paged as asked.
    let deliveries = format!("/webhooks/{}/deliveries", made.id);
    let r = s
        .a(Method::GET, &format!("{deliveries}?limit=5"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let page: List<WebhookDelivery> = r.json().await.unwrap();
    assert!(page.data.is_empty() && !page.has_more);
    let r = s
        .a(Method::GET, &format!("{deliveries}?limit=101"))
        .send()
        .await
        .unwrap();
    expect_error(r, 400, ErrorType::InvalidRequest).await;
    let redeliver = format!("{deliveries}/evt_none/redeliver");
    let r = s.a(Method::POST, &redeliver).send().await.unwrap();
    let e = expect_error(r, 404, ErrorType::NotFound).await;
    assert!(e.error.message.contains("evt_none"), "{}", e.error.message);

    // Another account's: not found, whatever is asked of it.
    for (method, path) in [
        (Method::GET, one.clone()),
        (Method::DELETE, one.clone()),
        (Method::GET, deliveries.clone()),
        (Method::POST, redeliver.clone()),
    ] {
        let r = s.b(method.clone(), &path).send().await.unwrap();
        let e = expect_error(r, 404, ErrorType::NotFound).await;
        assert!(
            e.error.message.contains(&made.id),
            "{method} {path}: {}",
            e.error.message
        );
    }
    let r = s.b(Method::GET, "/webhooks").send().await.unwrap();
    assert!(r.json::<List<Webhook>>().await.unwrap().data.is_empty());

    // Deleted: answered as it was, then gone.
    let r = s.a(Method::DELETE, &one).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Webhook>().await.unwrap(), kept);
    for (method, path) in [
        (Method::GET, one.clone()),
        (Method::DELETE, one.clone()),
        (Method::GET, deliveries),
    ] {
        let r = s.a(method, &path).send().await.unwrap();
        expect_error(r, 404, ErrorType::NotFound).await;
    }
    let r = s.a(Method::GET, "/webhooks").send().await.unwrap();
    let left: List<Webhook> = r.json().await.unwrap();
    assert_eq!(left.data.len(), 3);
    assert!(left.data.iter().all(|w| w.id != made.id));
}

#[tokio::test]
async fn bad_webhooks_are_refused_saying_why() {
    let s = Server::start().await;
    for (body, why) in [
        (
            json!({"url": "https://h.example/x", "events": ["sandbox.created", "sandbox.exploded"]}),
            "\"sandbox.exploded\"",
        ),
        (
            json!({"url": "https://h.example/x", "events": ["created"]}),
            "\"created\"",
        ),
        (json!({"url": "ftp://h.example/x"}), "ftp://h.example/x"),
        (json!({"url": "h.example/x"}), "h.example/x"),
        (json!({"url": "https://"}), "names no host"),
        (json!({"url": "https://user:pw@h.example/x"}), "credentials"),
        (
            json!({"url": "https://h.example/x", "description": "d".repeat(501)}),
            "description",
        ),
        (
            json!({"url": "https://h.example", "secret": "mine"}),
            "`secret`",
        ),
        (json!({"events": ["*"]}), "url"),
    ] {
        let r = s
            .a(Method::POST, "/webhooks")
            .json(&body)
            .send()
            .await
            .unwrap();
        let e = expect_error(r, 400, ErrorType::InvalidRequest).await;
        assert!(e.error.message.contains(why), "{body}: {}", e.error.message);
    }
    let r = s.a(Method::GET, "/webhooks").send().await.unwrap();
    assert!(r.json::<List<Webhook>>().await.unwrap().data.is_empty());
}

#[tokio::test]
async fn the_remote_client_speaks_the_event_and_webhook_routes() {
    let s = Server::start().await;
    let api = RemoteApi::new(&format!("{}/v1/", s.url)).unwrap();
    let me = api.authenticate(KEY_A).await.unwrap();
    let (sbx, _) = api
        .create_sandbox(&me, CreateSandbox::default(), None)
        .await
        .unwrap();
    api.pause_sandbox(&me, &sbx.id).await.unwrap();
    let (other, _) = api
        .create_sandbox(&me, CreateSandbox::default(), None)
        .await
        .unwrap();

    // What the fake answers in-process, the client reads back.
    let fake: std::sync::Arc<dyn sandpit_core::SandboxApi> = s.fake.clone();
    let local = fake.authenticate(KEY_A).await.unwrap();
    let all = api.list_events(&me, ListEvents::default()).await.unwrap();
    assert_eq!(
        all,
        fake.list_events(&local, ListEvents::default())
            .await
            .unwrap()
    );
    assert_eq!(all.data.len(), 5);
    let q = ListEvents {
        limit: Some(1),
        after: Some(all.data[0].cursor.clone()),
        sandbox_id: Some(sbx.id.clone()),
    };
    let page = api.list_events(&me, q.clone()).await.unwrap();
    assert_eq!(page.data, all.data[1..2]);
    assert!(page.has_more);
    // One sandbox's are asked for by its path, the query carried through.
    let asked = s.fake.calls().into_iter().rev().find_map(|c| match c.op {
        Op::ListEvents { query } => Some(query),
        _ => None,
    });
    assert_eq!(asked, Some(q));
    let q = ListEvents {
        sandbox_id: Some(other.id.clone()),
        ..ListEvents::default()
    };
    let theirs = api.list_events(&me, q).await.unwrap();
    assert_eq!(theirs.data, all.data[3..]);

    let req = CreateWebhook {
        url: "https://hooks.example.com/in".into(),
        events: vec!["sandbox.paused".into()],
        description: None,
    };
    let made = api.create_webhook(&me, req).await.unwrap();
    assert!(made.secret.as_deref().unwrap().starts_with("whsec_"));
    let kept = Webhook {
        secret: None,
        ..made.clone()
    };
    assert_eq!(
        api.list_webhooks(&me).await.unwrap().data,
        std::slice::from_ref(&kept)
    );
    assert_eq!(api.get_webhook(&me, &made.id).await.unwrap(), kept);
    let q = ListDeliveries {
        limit: Some(3),
        starting_after: None,
    };
    let deliveries = api.list_deliveries(&me, &made.id, q.clone()).await.unwrap();
    assert!(deliveries.data.is_empty());
    let asked = s.fake.calls().into_iter().rev().find_map(|c| match c.op {
        Op::ListDeliveries { webhook_id, query } => Some((webhook_id, query)),
        _ => None,
    });
    assert_eq!(asked, Some((made.id.clone(), q)));
    let e = api.redeliver(&me, &made.id, "evt_x").await.unwrap_err();
    assert_eq!(e.kind, ErrorType::NotFound);

    // Errors come back as the same CoreError.
    let bad = CreateWebhook {
        url: "https://hooks.example.com/in".into(),
        events: vec!["sandbox.nope".into()],
        description: None,
    };
    let e = api.create_webhook(&me, bad).await.unwrap_err();
    assert_eq!(e.kind, ErrorType::InvalidRequest);
    assert!(e.message.contains("sandbox.nope"), "{}", e.message);
    let them = api.authenticate(KEY_B).await.unwrap();
    for e in [
        api.get_webhook(&them, &made.id).await.unwrap_err(),
        api.delete_webhook(&them, &made.id).await.unwrap_err(),
        api.list_deliveries(&them, &made.id, ListDeliveries::default())
            .await
            .unwrap_err(),
    ] {
        assert_eq!(e.kind, ErrorType::NotFound, "{}", e.message);
    }
    let q = ListEvents {
        sandbox_id: Some(sbx.id.clone()),
        ..ListEvents::default()
    };
    let e = api.list_events(&them, q).await.unwrap_err();
    assert_eq!(e.kind, ErrorType::NotFound);

    assert_eq!(api.delete_webhook(&me, &made.id).await.unwrap(), kept);
    let e = api.get_webhook(&me, &made.id).await.unwrap_err();
    assert_eq!(e.kind, ErrorType::NotFound);
}
