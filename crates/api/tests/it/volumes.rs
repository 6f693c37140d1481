//! `/v1/volumes` over REST in front of the fake: the routes, their status
//! codes and shapes, what RemoteApi reads back, and the refusals as the
//! error body says them. (The service's own volumes, their files and
//! holds, are tested in `crates/core/tests/volumes.rs`.)

use crate::{expect_error, Server};
use reqwest::Method;
use sandpit_core::api::prelude::*;
use sandpit_core::{CreateVolume, ErrorType, List, ResizeVolume, Volume};
use serde_json::{json, Value};

#[tokio::test]
async fn volumes_are_created_listed_found_grown_and_deleted() {
    let s = Server::start().await;
    let r = s
        .a(Method::POST, "/volumes")
        .json(&json!({"name": "data", "size_gb": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let made: Volume = r.json().await.unwrap();
    assert_eq!(made.object, "volume");
    assert_eq!((made.name.as_str(), made.size_gb), ("data", 2));
    assert_eq!(made.status, "ready");

    let r = s.a(Method::GET, "/volumes").send().await.unwrap();
    assert_eq!(r.status(), 200);
    let list: List<Volume> = r.json().await.unwrap();
    assert_eq!(list.object, "list");
    assert_eq!(list.data, std::slice::from_ref(&made));
    for key in ["data", made.id.as_str()] {
        let r = s
            .a(Method::GET, &format!("/volumes/{key}"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.json::<Volume>().await.unwrap(), made);
        // Another account's is not found.
        let r = s
            .b(Method::GET, &format!("/volumes/{key}"))
            .send()
            .await
            .unwrap();
        expect_error(r, 404, ErrorType::NotFound).await;
    }

    let r = s
        .a(Method::PATCH, "/volumes/data")
        .json(&json!({"size_gb": 5}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Volume>().await.unwrap().size_gb, 5);
    let r = s
        .a(Method::PATCH, "/volumes/data")
        .json(&json!({"size_gb": 1}))
        .send()
        .await
        .unwrap();
    let e = expect_error(r, 400, ErrorType::InvalidRequest).await;
    assert!(
        e.error.message.contains("only grows"),
        "{}",
        e.error.message
    );

    let r = s.a(Method::DELETE, "/volumes/data").send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.unwrap()["status"], "deleted");
    let r = s.a(Method::GET, "/volumes/data").send().await.unwrap();
    expect_error(r, 404, ErrorType::NotFound).await;

    // A create retried with its Idempotency-Key: 201, then 200 with the
    // same volume; another body under the key, 409.
    let keyed = |body: Value| {
        s.a(Method::POST, "/volumes")
            .header("Idempotency-Key", "vol-key-1")
            .json(&body)
    };
    let r = keyed(json!({"name": "kept"})).send().await.unwrap();
    assert_eq!(r.status(), 201);
    let first: Volume = r.json().await.unwrap();
    let r = keyed(json!({"name": "kept"})).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Volume>().await.unwrap(), first);
    let r = keyed(json!({"name": "other"})).send().await.unwrap();
    expect_error(r, 409, ErrorType::Conflict).await;
}

#[tokio::test]
async fn bad_volumes_and_mounts_are_refused_saying_why() {
    let s = Server::start().await;
    for (body, why) in [
        (json!({"name": "has space"}), "letters, digits"),
        (json!({"name": "vol_1"}), "reserved"),
        (json!({"name": "big", "size_gb": 101}), "between 1 and 100"),
        (json!({"name": "x", "size": 1}), "unknown field"),
    ] {
        let r = s
            .a(Method::POST, "/volumes")
            .json(&body)
            .send()
            .await
            .unwrap();
        let e = expect_error(r, 400, ErrorType::InvalidRequest).await;
        assert!(e.error.message.contains(why), "{body}: {}", e.error.message);
    }
    let r = s
        .a(Method::POST, "/volumes")
        .json(&json!({"name": "data"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let r = s
        .a(Method::POST, "/volumes")
        .json(&json!({"name": "data"}))
        .send()
        .await
        .unwrap();
    expect_error(r, 409, ErrorType::Conflict).await;

    // A create that mounts one: a bad path says why, an unknown volume
    // is 404, a good one is made.
    for (path, why) in [("/proc/x", "in /proc"), ("/data/", "not normalized")] {
        let r = s
            .a(Method::POST, "/sandboxes")
            .json(&json!({"volumes": [{"volume": "data", "path": path}]}))
            .send()
            .await
            .unwrap();
        let e = expect_error(r, 400, ErrorType::InvalidRequest).await;
        assert!(e.error.message.contains(why), "{path}: {}", e.error.message);
    }
    let r = s
        .a(Method::POST, "/sandboxes")
        .json(&json!({"volumes": [{"volume": "nothing", "path": "/data"}]}))
        .send()
        .await
        .unwrap();
    let e = expect_error(r, 404, ErrorType::NotFound).await;
    assert!(e.error.message.contains("nothing"), "{}", e.error.message);
    let r = s
        .a(Method::POST, "/sandboxes")
        .json(&json!({"volumes": [{"volume": "data", "path": "/data"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
}

#[tokio::test]
async fn the_remote_client_speaks_the_volume_routes() {
    let s = Server::start().await;
    let api = sandpit_api::RemoteApi::new(&format!("{}/v1/", s.url)).unwrap();
    let caller = api.authenticate(sandpit_fake::KEY_A).await.unwrap();
    let req = CreateVolume {
        name: "cache".into(),
        size_gb: None,
    };
    let key = Some("once".to_string());
    let (made, replayed) = api
        .create_volume(&caller, req.clone(), key.clone())
        .await
        .unwrap();
    assert!(!replayed);
    assert_eq!(made.size_gb, 10);
    // The same request under the same key: the same volume, replayed.
    let (again, replayed) = api.create_volume(&caller, req, key).await.unwrap();
    assert!(replayed);
    assert_eq!(again, made);
    assert_eq!(
        api.list_volumes(&caller).await.unwrap().data,
        std::slice::from_ref(&made)
    );
    assert_eq!(api.get_volume(&caller, &made.id).await.unwrap(), made);
    let grown = api
        .resize_volume(&caller, "cache", ResizeVolume { size_gb: 11 })
        .await
        .unwrap();
    assert_eq!(grown.size_gb, 11);
    api.delete_volume(&caller, "cache").await.unwrap();
    let e = api.get_volume(&caller, "cache").await.unwrap_err();
    assert_eq!(e.kind, ErrorType::NotFound);
}
