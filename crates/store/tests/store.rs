//! The store against real SQLite files in a temporary directory and
//! against a real PostgreSQL server (Debian's, started by the tests from
//! `initdb`, see `sandpit-pgtest`): every test of the store's behaviour runs
//! on both engines, as `NAME::sqlite` and `NAME::postgres`; the tests of
//! SQLite's own files (migrations on disk, WAL, file modes) on SQLite only.

use sandpit_store::{
    format_ts, hash_key, new_id, CreateOutcome, Engine, ExecutionResult, ExecutionRow,
    ExecutionState, ExecutionStatus, ExtendOutcome, NewSandbox, NewSecret, NewSnapshot, NewVolume,
    PortRow, SandboxBroker, SandboxStatus, SnapshotOutcome, SnapshotStatus, Store, StoreError,
    TemplateStatus, VolumeChange, VolumeCreated, VolumeMountRow, VolumeStatus, VolumesHeld,
};
use std::collections::HashSet;
use tempfile::TempDir;
use time::macros::datetime;
use time::{Duration, OffsetDateTime};

const T0: OffsetDateTime = datetime!(2026-03-01 12:00:00 UTC);
/// Price of the test size: $0.09/h.
const PRICE: i64 = 90_000;

/// Runs each named `async fn(Store)` twice: on a fresh SQLite file and on a
/// fresh database of the test PostgreSQL server.
macro_rules! on_both_engines {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn sqlite() {
                let (_dir, store) = super::open().await;
                super::$name(store).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn postgres() {
                let store = super::open_postgres().await;
                super::$name(store).await
            }
        }
    )*};
}

on_both_engines!(
    snapshots_count_against_a_quota_replay_by_key_and_expire,
    a_paused_sandbox_stays_live_and_adds_up_its_paused_time,
    nodes_hold_leases_on_the_database_clock_and_lost_ones_settle_once,
    a_create_takes_a_place_on_a_live_node_with_room_in_its_transaction,
    accounts_have_unique_names,
    of_first_starts_together_exactly_one_makes_the_admin,
    keys_store_a_hash_show_a_prefix_and_can_be_revoked,
    terminal_tokens_open_one_sandbox_once_and_expire,
    web_sessions_name_their_account_until_they_end,
    sign_ups_are_counted_per_address_within_the_hour,
    the_ledger_reserves_refunds_and_settles_once,
    concurrent_creates_never_overdraw,
    concurrent_creates_respect_the_concurrency_limit,
    idempotency_keys_replay_or_conflict,
    lists_are_newest_first_with_cursors,
    expiry_finds_live_sandboxes_past_their_time,
    status_changes_are_recorded_and_ended_sandboxes_stay_ended,
    a_nodes_start_is_recorded_only_on_its_provisioning_sandbox,
    a_second_create_under_a_taken_id_writes_nothing,
    extending_reserves_more_and_checks_the_balance,
    shortening_gives_back_the_reservation_it_will_not_use,
    executions_are_recorded_and_finished_once,
    a_sandboxs_executions_are_paged_newest_first,
    ports_are_opened_once_and_closed,
    usage_lists_recent_sandboxes_with_their_charges,
    preview_traffic_adds_up_in_usage,
    disk_use_is_recorded_summed_over_live_sandboxes_and_limits_creates,
    an_accounts_stored_executions_are_counted_and_trimmed_oldest_first,
    an_ended_sandboxs_executions_go_after_the_retention,
    the_tally_counts_a_hosts_live_sandboxes_and_their_reservations,
    template_builds_layers_and_files_are_an_accounts_own_until_published,
    secrets_are_an_accounts_own_and_sandboxes_keep_their_placeholders,
    volumes_are_an_accounts_own_by_name_within_its_quota,
    a_volume_is_held_read_write_by_one_live_sandbox_at_a_time,
    a_held_volume_is_neither_resized_nor_deleted,
    events_are_logged_in_order_and_fan_out_to_webhooks_in_order,
    a_reader_paging_the_log_while_others_write_sees_every_event_once,
    a_draining_nodes_sandboxes_move_once_and_never_both_move_and_fail,
);

/// A row lock held by a transaction that never ends (its process stopped
/// in the middle) fails the calls that wait on it within seconds, as the
/// database being unavailable, instead of hanging them; and the server is
/// told to end such a session on its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_call_behind_a_stuck_transactions_lock_fails_instead_of_hanging() {
    let store = open_postgres().await;
    let acct = store.create_account("stuck", 5).await.unwrap();
    store.add_credit(&acct.id, 10_000_000, None).await.unwrap();
    let mut stuck = store.pool().begin().await.unwrap();
    sqlx::query("SELECT id FROM accounts WHERE id = $1 FOR UPDATE")
        .bind(&acct.id)
        .fetch_one(&mut *stuck)
        .await
        .unwrap();
    let started = std::time::Instant::now();
    let waited = tokio::time::timeout(
        std::time::Duration::from_secs(60),
        store.create_sandbox(sandbox(&acct.id, T0, 60, 90_000)),
    )
    .await
    .expect("the call waited on the lock without end");
    let err = waited.expect_err("the create went past a held lock");
    assert!(
        matches!(&err, StoreError::Unavailable(m) if m.contains("lock_timeout")),
        "{err}"
    );
    assert!(started.elapsed() < std::time::Duration::from_secs(30));
    let idle: String = sqlx::query_scalar("SHOW idle_in_transaction_session_timeout")
        .fetch_one(&mut *stuck)
        .await
        .unwrap();
    assert_eq!(idle, "1min");
    // Once the holder is gone, the same call goes through.
    stuck.rollback().await.unwrap();
    created(
        store
            .create_sandbox(sandbox(&acct.id, T0, 60, 90_000))
            .await
            .unwrap(),
    );
}

/// Every pooled PostgreSQL session bounds its statements, and one that
/// runs past the bound is cancelled and reported as the database being
/// unavailable for now, naming the bound, not as an opaque failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_statement_past_its_time_is_cancelled_and_says_which_bound() {
    let store = open_postgres().await;
    let mut conn = store.pool().acquire().await.unwrap();
    let limit: String = sqlx::query_scalar("SHOW statement_timeout")
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    assert_eq!(limit, "30s");
    // The same bound, shorter, on this session alone (it is not returned
    // to the pool).
    let mut conn = conn.detach();
    sqlx::query("SET statement_timeout = 200")
        .execute(&mut conn)
        .await
        .unwrap();
    let started = std::time::Instant::now();
    let err: StoreError = sqlx::query("SELECT CAST(pg_sleep(5) AS TEXT)")
        .execute(&mut conn)
        .await
        .unwrap_err()
        .into();
    assert!(started.elapsed() < std::time::Duration::from_secs(4));
    assert!(
        matches!(&err, StoreError::Unavailable(m) if m.contains("statement_timeout")),
        "{err}"
    );
}

/// Servers started together on an empty database each try to make the
/// operator's account: one does, the others find it (each its own pool,
/// as separate processes have), and a store with accounts gets none.
async fn of_first_starts_together_exactly_one_makes_the_admin(store: Store) {
    let attempts: Vec<_> = (0..6)
        .map(|_| {
            let store = store.clone();
            tokio::spawn(async move { store.create_first_admin("admin", 20).await })
        })
        .collect();
    let mut made = Vec::new();
    for attempt in attempts {
        made.push(attempt.await.unwrap().unwrap());
    }
    assert_eq!(made.iter().flatten().count(), 1, "{made:?}");
    let accounts = store.list_accounts().await.unwrap();
    assert_eq!(accounts.len(), 1, "{accounts:?}");
    assert_eq!(accounts[0].name, "admin");
    assert!(store
        .create_first_admin("admin", 20)
        .await
        .unwrap()
        .is_none());
}

/// The same across separate pools (separate sessions, as separate
/// processes have) on one PostgreSQL database, many times over.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn separate_servers_on_one_empty_postgres_make_one_admin() {
    let server = tokio::task::spawn_blocking(sandpit_pgtest::shared)
        .await
        .unwrap();
    for _ in 0..5 {
        let url = server.fresh_database().await;
        let mut stores = Vec::new();
        for _ in 0..3 {
            stores.push(Store::connect(&url).await.unwrap());
        }
        let attempts: Vec<_> = stores
            .iter()
            .map(|s| {
                let s = s.clone();
                tokio::spawn(async move { s.create_first_admin("admin", 20).await })
            })
            .collect();
        let mut made = Vec::new();
        for attempt in attempts {
            made.push(attempt.await.unwrap().unwrap());
        }
        assert_eq!(made.iter().flatten().count(), 1, "{made:?}");
        assert_eq!(stores[0].list_accounts().await.unwrap().len(), 1);
    }
}

async fn sign_ups_are_counted_per_address_within_the_hour(store: Store) {
    let hour = time::Duration::hours(1);
    let at = |minutes: i64| T0 + time::Duration::minutes(minutes);
    let admit = |address: &'static str, minutes: i64| {
        let store = store.clone();
        async move {
            store
                .admit_signup(address, 2, hour, at(minutes))
                .await
                .unwrap()
        }
    };
    assert_eq!(admit("10.0.0.1", 0).await, Ok(()));
    assert_eq!(admit("10.0.0.1", 10).await, Ok(()));
    // The third within the hour waits until the first is an hour old.
    assert_eq!(
        admit("10.0.0.1", 20).await,
        Err(time::Duration::minutes(40))
    );
    assert_eq!(admit("10.0.0.2", 20).await, Ok(()), "another address");
    assert_eq!(admit("10.0.0.1", 61).await, Ok(()), "the first aged out");
    assert!(admit("10.0.0.1", 62).await.is_err());
}

/// A fresh database on the test PostgreSQL server.
async fn open_postgres() -> Store {
    let server = tokio::task::spawn_blocking(sandpit_pgtest::shared)
        .await
        .unwrap();
    let store = Store::connect(&server.fresh_database().await)
        .await
        .unwrap();
    assert_eq!(store.engine(), Engine::Postgres);
    store
}

async fn open() -> (TempDir, Store) {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open_sqlite(dir.path().join("sandpit.db"))
        .await
        .unwrap();
    (dir, store)
}

fn sandbox(account_id: &str, created_at: OffsetDateTime, minutes: u32, reserve: i64) -> NewSandbox {
    NewSandbox {
        id: new_id("sbx"),
        account_id: account_id.to_string(),
        name: None,
        size: "small".into(),
        vcpus: 2,
        memory_mb: 4096,
        disk_gb: 40,
        timeout_minutes: minutes,
        price_micros_per_hour: PRICE,
        host: "local".into(),
        created_at,
        expires_at: created_at + Duration::minutes(minutes.into()),
        reserve_micros: reserve,
        max_concurrent: None,
        disk_limit_bytes: None,
        idempotency: None,
        host_epoch: None,
        snapshot_id: None,
        metadata: [("made-by".to_string(), "the store's tests".to_string())].into(),
        env: [("GREETING".to_string(), "hello".to_string())].into(),
        access_token: Some(format!("token-of-{created_at}")),
        every_port_public: false,
        internet_access: None,
        network: None,
        template_id: None,
        workdir: None,
        start_from: None,
        cause: Default::default(),
    }
}

fn created(o: CreateOutcome) -> sandpit_store::SandboxRow {
    match o {
        CreateOutcome::Created(r) => r,
        other => panic!("expected Created, got {other:?}"),
    }
}

/// Every prefix sum of the account's ledger is ≥ 0: no row ever took the
/// balance below zero.
async fn assert_never_negative(store: &Store, account_id: &str) {
    let mut sum = 0i64;
    for row in store.ledger(account_id).await.unwrap() {
        sum += row.amount_micros;
        assert!(sum >= 0, "ledger row {row:?} took the balance to {sum}");
    }
    assert_eq!(sum, store.balance(account_id).await.unwrap());
}

#[tokio::test]
async fn migrations_apply_to_a_fresh_file_and_again() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("db").join("x.db");
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let store = Store::open_sqlite(&path).await.unwrap();
    assert!(path.exists());
    let acct = store.create_account("a", 20).await.unwrap();
    store.close().await;

    // Again: the migration is recorded, not re-run, and data survives.
    let store = Store::open_sqlite(&path).await.unwrap();
    let applied: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM _sqlx_migrations")
        .fetch_one(store.pool())
        .await
        .unwrap();
    // One row per file in crates/store/migrations/sqlite.
    let files = std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/migrations/sqlite"))
        .unwrap()
        .count() as i64;
    assert_eq!(applied, files);
    assert_eq!(store.account(&acct.id).await.unwrap(), Some(acct));
    let mode: String = sqlx::query_scalar("PRAGMA journal_mode")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(mode, "wal");
    let fk: i64 = sqlx::query_scalar("PRAGMA foreign_keys")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(fk, 1);
    store.close().await;

    // By URL too.
    let url = format!("sqlite://{}", path.display());
    let store = Store::connect(&url).await.unwrap();
    assert_eq!(store.list_accounts().await.unwrap().len(), 1);
    assert!(matches!(
        Store::connect("mysql://localhost/x").await,
        Err(StoreError::Invalid(_))
    ));
    // A PostgreSQL nobody serves: unavailable, and the message names the
    // server without its password.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let err = Store::connect(&format!("postgres://sandpit:hunter2@127.0.0.1:{port}/x"))
        .await
        .unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, StoreError::Unavailable(_)), "{msg}");
    assert!(
        msg.contains(&format!("sandpit:***@127.0.0.1:{port}/x")),
        "{msg}"
    );
    assert!(!msg.contains("hunter2"), "{msg}");
    let mem = Store::connect("sqlite::memory:").await.unwrap();
    mem.create_account("m", 1).await.unwrap();
    assert_eq!(mem.list_accounts().await.unwrap().len(), 1);
}

async fn accounts_have_unique_names(store: Store) {
    let a = store.create_account("alice", 20).await.unwrap();
    assert!(a.id.starts_with("acct_") && a.id.len() == 5 + 24);
    assert!(matches!(
        store.create_account("alice", 3).await,
        Err(StoreError::Conflict(_))
    ));
    assert!(matches!(
        store.create_account(" ", 3).await,
        Err(StoreError::Invalid(_))
    ));
    let b = store.create_account("bob", 3).await.unwrap();
    assert_eq!(store.account_by_name("bob").await.unwrap(), Some(b.clone()));
    assert_eq!(store.account("acct_nope").await.unwrap(), None);
    assert_eq!(store.list_accounts().await.unwrap(), vec![a, b]);
}

async fn web_sessions_name_their_account_until_they_end(store: Store) {
    let acct = store.create_account("web", 5).await.unwrap();
    let hour = time::Duration::hours(1);
    let (token, session) = store.create_web_session(&acct.id, hour).await.unwrap();
    assert!(token.starts_with("sps_") && token.len() == 44, "{token}");
    assert_eq!(session.account_id, acct.id);
    assert_eq!(session.account_name, "web");
    assert!(!session.admin);
    assert_eq!(session.csrf.len(), 40);
    assert_ne!(session.csrf, token[4..]);
    assert_eq!(store.web_session(&token).await.unwrap(), Some(session));
    // Only its hash is kept.
    let clear: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM web_sessions WHERE hash = $1")
        .bind(&token)
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(clear, 0);
    // An operator's session says so.
    assert!(store.set_admin(&acct.id, true).await.unwrap());
    assert!(store.is_admin(&acct.id).await.unwrap());
    assert!(store.web_session(&token).await.unwrap().unwrap().admin);
    assert!(!store.set_admin("acct_nope", true).await.unwrap());
    // Signed out, it is gone; an expired one finds nothing.
    assert!(store.end_web_session(&token).await.unwrap());
    assert_eq!(store.web_session(&token).await.unwrap(), None);
    assert!(!store.end_web_session(&token).await.unwrap());
    let (old, _) = store
        .create_web_session(&acct.id, time::Duration::seconds(-1))
        .await
        .unwrap();
    assert_eq!(store.web_session(&old).await.unwrap(), None);
    assert_eq!(store.web_session("sps_nope").await.unwrap(), None);
    // An invitation for two: two racing takes of its last use, one wins.
    let (code, _) = store.create_invite(2, hour).await.unwrap();
    assert!(code.starts_with("spi_"));
    assert!(store.take_invite(&code).await.unwrap());
    let (a, b) = tokio::join!(store.take_invite(&code), store.take_invite(&code));
    assert_eq!([a.unwrap(), b.unwrap()].iter().filter(|t| **t).count(), 1);
    assert!(!store.take_invite(&code).await.unwrap());
    store.return_invite(&code).await.unwrap();
    assert!(store.take_invite(&code).await.unwrap());
    let (old, _) = store
        .create_invite(5, time::Duration::seconds(-1))
        .await
        .unwrap();
    assert!(!store.take_invite(&old).await.unwrap());
    assert!(!store.take_invite("spi_nope").await.unwrap());
}

async fn terminal_tokens_open_one_sandbox_once_and_expire(store: Store) {
    let acct = store.create_account("tty", 5).await.unwrap();
    store.add_credit(&acct.id, 10_000_000, None).await.unwrap();
    let sbx = created(
        store
            .create_sandbox(sandbox(&acct.id, T0, 60, 90_000))
            .await
            .unwrap(),
    );
    let minute = time::Duration::minutes(1);
    let (token, expires) = store
        .create_terminal_token(&acct.id, &sbx.id, minute)
        .await
        .unwrap();
    assert!(token.starts_with("spt_") && token.len() == 44, "{token}");
    assert!(expires > OffsetDateTime::now_utc() + time::Duration::seconds(50));
    // Only its hash is kept.
    let stored: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM terminal_tokens WHERE hash = $1")
        .bind(hash_key(&token))
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(stored, 1);
    // Two takes racing: exactly one has it.
    let (a, b) = tokio::join!(
        store.take_terminal_token(&token),
        store.take_terminal_token(&token)
    );
    let taken: Vec<_> = [a.unwrap(), b.unwrap()].into_iter().flatten().collect();
    assert_eq!(
        taken,
        vec![sandpit_store::TerminalGrant {
            account_id: acct.id.clone(),
            sandbox_id: sbx.id.clone(),
        }]
    );
    assert_eq!(store.take_terminal_token("spt_nope").await.unwrap(), None);
    // An expired one opens nothing, and the next token made clears it out.
    let (old, _) = store
        .create_terminal_token(&acct.id, &sbx.id, time::Duration::seconds(-1))
        .await
        .unwrap();
    store
        .create_terminal_token(&acct.id, &sbx.id, minute)
        .await
        .unwrap();
    let left: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM terminal_tokens WHERE hash = $1")
        .bind(hash_key(&old))
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(left, 0);
    assert_eq!(store.take_terminal_token(&old).await.unwrap(), None);
}

async fn keys_store_a_hash_show_a_prefix_and_can_be_revoked(store: Store) {
    let acct = store.create_account("alice", 20).await.unwrap();
    let (key, row) = store.create_key(&acct.id).await.unwrap();
    assert!(key.starts_with("sp_"));
    assert_eq!(key.len(), 3 + 40);
    assert_eq!(row.prefix, key[..12]);
    assert_eq!(row.account_id, acct.id);

    // Only the hash is stored; the key appears nowhere in the database.
    let (hash, prefix): (String, String) =
        sqlx::query_as("SELECT hash, prefix FROM api_keys WHERE id = $1")
            .bind(&row.id)
            .fetch_one(store.pool())
            .await
            .unwrap();
    assert_eq!(hash, hash_key(&key));
    assert_eq!(hash.len(), 64);
    assert_eq!(prefix, row.prefix);
    let leaked: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM api_keys WHERE id = $1 OR prefix = $1 OR hash = $1",
    )
    .bind(&key)
    .fetch_one(store.pool())
    .await
    .unwrap();
    assert_eq!(leaked, 0);

    // Authentication, recording the use once a minute at most.
    let (k, a) = store.authenticate(&key).await.unwrap().unwrap();
    assert_eq!(a, acct);
    let first_use = k.last_used_at.expect("first use recorded");
    let (k2, _) = store.authenticate(&key).await.unwrap().unwrap();
    assert_eq!(k2.last_used_at, Some(first_use));
    let two_min_ago = format_ts(OffsetDateTime::now_utc() - Duration::minutes(2));
    sqlx::query("UPDATE api_keys SET last_used_at = $1 WHERE id = $2")
        .bind(&two_min_ago)
        .bind(&row.id)
        .execute(store.pool())
        .await
        .unwrap();
    let (k3, _) = store.authenticate(&key).await.unwrap().unwrap();
    assert!(k3.last_used_at.unwrap() > first_use - Duration::seconds(1));
    assert_ne!(format_ts(k3.last_used_at.unwrap()), two_min_ago);

    assert!(store.authenticate("sp_wrong").await.unwrap().is_none());
    assert!(store.authenticate(&key[..42]).await.unwrap().is_none());
    // Its E2B spelling is the same key.
    let e2b = sandpit_store::e2b_spelling(&key).unwrap();
    assert!(e2b.starts_with("e2b_"));
    let (k4, a4) = store.authenticate(&e2b).await.unwrap().unwrap();
    assert_eq!((k4.id, a4), (row.id.clone(), acct.clone()));
    let mut wrong = e2b.clone().into_bytes();
    let last = wrong.len() - 1;
    wrong[last] = if wrong[last] == b'0' { b'1' } else { b'0' };
    let wrong = String::from_utf8(wrong).unwrap();
    assert!(store.authenticate(&wrong).await.unwrap().is_none());

    // A second key, then revoke the first by its prefix.
    let (key2, row2) = store.create_key(&acct.id).await.unwrap();
    assert!(store.revoke_key(&row.prefix).await.unwrap());
    assert!(store.authenticate(&key).await.unwrap().is_none());
    assert!(store.authenticate(&e2b).await.unwrap().is_none());
    assert!(!store.revoke_key(&row.prefix).await.unwrap());
    assert!(store.authenticate(&key2).await.unwrap().is_some());
    let keys = store.list_keys(Some(&acct.id)).await.unwrap();
    assert_eq!(keys.len(), 2);
    assert!(keys
        .iter()
        .find(|k| k.id == row.id)
        .unwrap()
        .revoked_at
        .is_some());
    assert!(keys
        .iter()
        .find(|k| k.id == row2.id)
        .unwrap()
        .revoked_at
        .is_none());
    // By id as well; unknown is false.
    assert!(store.revoke_key(&row2.id).await.unwrap());
    assert!(store.authenticate(&key2).await.unwrap().is_none());
    assert!(!store.revoke_key("key_unknown").await.unwrap());
    assert_eq!(store.list_keys(None).await.unwrap().len(), 2);
    assert!(matches!(
        store.create_key("acct_nope").await,
        Err(StoreError::NotFound(_))
    ));
}

async fn the_ledger_reserves_refunds_and_settles_once(store: Store) {
    let acct = store.create_account("alice", 20).await.unwrap();
    assert_eq!(store.balance(&acct.id).await.unwrap(), 0);
    store
        .add_credit(&acct.id, 1_000_000, Some("welcome"))
        .await
        .unwrap();
    assert!(matches!(
        store.add_credit(&acct.id, 0, None).await,
        Err(StoreError::Invalid(_))
    ));
    assert!(matches!(
        store.add_credit("acct_nope", 5, None).await,
        Err(StoreError::NotFound(_))
    ));

    // 60 minutes reserved: 90_000.
    let sbx = created(
        store
            .create_sandbox(NewSandbox {
                every_port_public: true,
                internet_access: Some(false),
                network: Some(r#"{"allow_out":["198.51.100.7"]}"#.into()),
                ..sandbox(&acct.id, T0, 60, 90_000)
            })
            .await
            .unwrap(),
    );
    assert_eq!(sbx.status, SandboxStatus::Provisioning);
    assert!(sbx.every_port_public);
    assert_eq!(store.balance(&acct.id).await.unwrap(), 910_000);
    // E2B's metadata, environment and token come back as written.
    let again = store.sandbox(&sbx.id).await.unwrap().unwrap();
    assert_eq!(again.metadata["made-by"], "the store's tests");
    assert_eq!(again.env["GREETING"], "hello");
    assert_eq!(again.access_token, Some(format!("token-of-{T0}")));
    assert!(again.every_port_public);
    assert_eq!(again.internet_access, Some(false));
    assert_eq!(
        again.network.as_deref(),
        Some(r#"{"allow_out":["198.51.100.7"]}"#)
    );
    // Its egress replaced while it lives (not once it ended).
    assert!(store
        .set_sandbox_network(&sbx.id, Some(true), Some(r#"{"deny_out":["10.0.0.0/8"]}"#))
        .await
        .unwrap());
    let changed = store.sandbox(&sbx.id).await.unwrap().unwrap();
    assert_eq!(
        (changed.internet_access, changed.network.as_deref()),
        (Some(true), Some(r#"{"deny_out":["10.0.0.0/8"]}"#))
    );
    assert!(!store
        .set_sandbox_network("sbx_nope", None, None)
        .await
        .unwrap());
    store
        .set_sandbox_network(
            &sbx.id,
            Some(false),
            Some(r#"{"allow_out":["198.51.100.7"]}"#),
        )
        .await
        .unwrap();
    // Its token is among the live ones (for signed file URLs).
    let tokens = store.live_sandbox_tokens().await.unwrap();
    assert!(
        tokens.contains(&(sbx.id.clone(), acct.id.clone(), format!("token-of-{T0}"))),
        "{tokens:?}"
    );
    // Something that happened to it, its status unchanged.
    assert!(store
        .record_event(
            &sbx.id,
            "sandbox.noted",
            Some("stopped: the disk"),
            &Default::default()
        )
        .await
        .unwrap());

    // Destroyed after 10 minutes: charged 15_000, the rest comes back.
    let ended = T0 + Duration::minutes(10);
    let done = store
        .finish_sandbox(
            &sbx.id,
            SandboxStatus::Deleted,
            "destroyed",
            ended,
            15_000,
            &sandpit_store::Cause::default(),
        )
        .await
        .unwrap()
        .unwrap();
    assert_eq!(done.status, SandboxStatus::Deleted);
    assert_eq!(done.deleted_at, Some(ended));
    assert_eq!(done.deleted_reason.as_deref(), Some("destroyed"));
    assert_eq!(store.balance(&acct.id).await.unwrap(), 985_000);
    // An ended sandbox's token opens nothing any more.
    let tokens = store.live_sandbox_tokens().await.unwrap();
    assert!(!tokens.iter().any(|(id, _, _)| *id == sbx.id), "{tokens:?}");
    let kinds: Vec<(String, i64)> = store
        .ledger(&acct.id)
        .await
        .unwrap()
        .into_iter()
        .map(|r| (r.kind, r.amount_micros))
        .collect();
    assert_eq!(
        kinds,
        [
            ("credit".into(), 1_000_000),
            ("reserve".into(), -90_000),
            ("release".into(), 90_000),
            ("charge".into(), -15_000)
        ]
    );

    // Finishing again (a retried delete, the sweeper) changes nothing.
    let rows_before = store.ledger(&acct.id).await.unwrap();
    assert_eq!(
        store
            .finish_sandbox(
                &sbx.id,
                SandboxStatus::Deleted,
                "expired",
                ended + Duration::hours(1),
                90_000,
                &sandpit_store::Cause::default()
            )
            .await
            .unwrap(),
        None
    );
    assert_eq!(store.ledger(&acct.id).await.unwrap(), rows_before);
    assert_eq!(store.sandbox(&sbx.id).await.unwrap().unwrap(), done);
    let events: Vec<String> = store
        .events(&sbx.id)
        .await
        .unwrap()
        .into_iter()
        .map(|e| format!("{} {}", e.status, e.reason.unwrap_or_default()))
        .collect();
    assert_eq!(
        events,
        [
            "provisioning ",
            "provisioning stopped: the disk",
            "deleted destroyed"
        ]
    );
    // An ended sandbox's history is closed.
    assert!(!store
        .record_event(&sbx.id, "sandbox.noted", Some("late"), &Default::default())
        .await
        .unwrap());
    assert!(!store
        .record_event(
            "sbx_nope",
            "sandbox.noted",
            Some("late"),
            &Default::default()
        )
        .await
        .unwrap());

    // A charge above the reservation is capped at it.
    let sbx2 = created(
        store
            .create_sandbox(sandbox(&acct.id, T0, 60, 90_000))
            .await
            .unwrap(),
    );
    store
        .finish_sandbox(
            &sbx2.id,
            SandboxStatus::Failed,
            "failed: boot",
            T0,
            1_000_000,
            &sandpit_store::Cause::default(),
        )
        .await
        .unwrap()
        .unwrap();
    assert_eq!(store.balance(&acct.id).await.unwrap(), 985_000 - 90_000);
    assert_never_negative(&store, &acct.id).await;

    assert!(matches!(
        store
            .finish_sandbox(
                "sbx_nope",
                SandboxStatus::Deleted,
                "destroyed",
                T0,
                0,
                &sandpit_store::Cause::default()
            )
            .await,
        Err(StoreError::NotFound(_))
    ));
    assert!(matches!(
        store
            .finish_sandbox(
                &sbx2.id,
                SandboxStatus::Running,
                "x",
                T0,
                0,
                &sandpit_store::Cause::default()
            )
            .await,
        Err(StoreError::Invalid(_))
    ));
}

async fn concurrent_creates_never_overdraw(store: Store) {
    let acct = store.create_account("alice", 100).await.unwrap();
    let reserve = 90_000;
    // Enough for 7 reservations and a bit, not for 8.
    store
        .add_credit(&acct.id, 7 * reserve + 50_000, None)
        .await
        .unwrap();

    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(20));
    let tasks: Vec<_> = (0..20)
        .map(|_| {
            let store = store.clone();
            let acct = acct.id.clone();
            let barrier = barrier.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                store
                    .create_sandbox(sandbox(&acct, T0, 60, reserve))
                    .await
                    .unwrap()
            })
        })
        .collect();
    let mut made = 0;
    let mut refused = 0;
    for t in tasks {
        match t.await.unwrap() {
            CreateOutcome::Created(_) => made += 1,
            CreateOutcome::InsufficientCredits { balance, needed } => {
                assert!(balance < needed);
                assert!(balance >= 0);
                refused += 1;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!((made, refused), (7, 13));
    assert_eq!(store.balance(&acct.id).await.unwrap(), 50_000);
    assert_never_negative(&store, &acct.id).await;
    let page = store
        .list_sandboxes(&acct.id, 100, None, true)
        .await
        .unwrap();
    assert_eq!(page.data.len(), 7);
}

async fn concurrent_creates_respect_the_concurrency_limit(store: Store) {
    let acct = store.create_account("alice", 5).await.unwrap();
    store.add_credit(&acct.id, 100_000_000, None).await.unwrap();

    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(20));
    let tasks: Vec<_> = (0..20)
        .map(|_| {
            let store = store.clone();
            let acct = acct.id.clone();
            let barrier = barrier.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                store
                    .create_sandbox(sandbox(&acct, T0, 15, 22_500))
                    .await
                    .unwrap()
            })
        })
        .collect();
    let mut live = Vec::new();
    for t in tasks {
        match t.await.unwrap() {
            CreateOutcome::Created(r) => live.push(r),
            CreateOutcome::TooManySandboxes { live, limit } => assert_eq!((live, limit), (5, 5)),
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(live.len(), 5);

    // An ended sandbox frees its slot; `deleting` still holds one.
    store
        .set_status(
            &live[0].id,
            SandboxStatus::Deleting,
            None,
            &sandpit_store::Cause::default(),
        )
        .await
        .unwrap();
    assert!(matches!(
        store
            .create_sandbox(sandbox(&acct.id, T0, 15, 22_500))
            .await
            .unwrap(),
        CreateOutcome::TooManySandboxes { live: 5, limit: 5 }
    ));
    store
        .finish_sandbox(
            &live[0].id,
            SandboxStatus::Deleted,
            "destroyed",
            T0,
            0,
            &sandpit_store::Cause::default(),
        )
        .await
        .unwrap();
    created(
        store
            .create_sandbox(sandbox(&acct.id, T0, 15, 22_500))
            .await
            .unwrap(),
    );

    // An explicit limit overrides the account's.
    let mut n = sandbox(&acct.id, T0, 15, 22_500);
    n.max_concurrent = Some(6);
    created(store.create_sandbox(n).await.unwrap());
    assert_eq!(store.live_sandboxes("local").await.unwrap().len(), 6);
}

async fn idempotency_keys_replay_or_conflict(store: Store) {
    let acct = store.create_account("alice", 20).await.unwrap();
    let other = store.create_account("bob", 20).await.unwrap();
    store.add_credit(&acct.id, 100_000, None).await.unwrap();
    store.add_credit(&other.id, 100_000, None).await.unwrap();

    let mut n = sandbox(&acct.id, T0, 60, 90_000);
    n.idempotency = Some(("k1".into(), "hash-a".into()));
    let first = created(store.create_sandbox(n.clone()).await.unwrap());

    // Same key and body, even with another id and no credit left: the original.
    let mut again = n.clone();
    again.id = new_id("sbx");
    assert_eq!(
        store.create_sandbox(again.clone()).await.unwrap(),
        CreateOutcome::Replay(first.clone())
    );
    // Same key, different body.
    again.idempotency = Some(("k1".into(), "hash-b".into()));
    assert_eq!(
        store.create_sandbox(again).await.unwrap(),
        CreateOutcome::IdempotencyConflict
    );
    // One sandbox, one reservation.
    assert_eq!(store.balance(&acct.id).await.unwrap(), 10_000);
    assert_eq!(
        store
            .list_sandboxes(&acct.id, 10, None, true)
            .await
            .unwrap()
            .data
            .len(),
        1
    );

    // The replay follows the sandbox's state.
    let running = store
        .set_status(
            &first.id,
            SandboxStatus::Running,
            None,
            &sandpit_store::Cause::default(),
        )
        .await
        .unwrap();
    assert_eq!(
        store.create_sandbox(n).await.unwrap(),
        CreateOutcome::Replay(running)
    );

    // Keys are per account.
    let mut b = sandbox(&other.id, T0, 60, 90_000);
    b.idempotency = Some(("k1".into(), "hash-b".into()));
    created(store.create_sandbox(b).await.unwrap());

    // Purged keys are forgotten.
    assert_eq!(
        store
            .purge_idempotency(T0 + Duration::days(1))
            .await
            .unwrap(),
        2
    );
}

async fn lists_are_newest_first_with_cursors(store: Store) {
    let acct = store.create_account("alice", 100).await.unwrap();
    let other = store.create_account("bob", 100).await.unwrap();
    // 9 sandboxes; three pairs share a created_at (ties go by id).
    let mut all = Vec::new();
    for i in 0..9i64 {
        let at = T0 + Duration::seconds(i / 2 * 10);
        all.push(created(
            store
                .create_sandbox(sandbox(&acct.id, at, 15, 0))
                .await
                .unwrap(),
        ));
    }
    let theirs = created(
        store
            .create_sandbox(sandbox(&other.id, T0, 15, 0))
            .await
            .unwrap(),
    );
    let mut expected = all.clone();
    expected.sort_by(|a, b| (b.created_at, &b.id).cmp(&(a.created_at, &a.id)));

    let mut seen = Vec::new();
    let mut cursor: Option<String> = None;
    let mut pages = 0;
    loop {
        let page = store
            .list_sandboxes(&acct.id, 4, cursor.as_deref(), false)
            .await
            .unwrap();
        pages += 1;
        seen.extend(page.data.iter().cloned());
        if !page.has_more {
            break;
        }
        cursor = Some(page.data.last().unwrap().id.clone());
    }
    assert_eq!(pages, 3);
    assert_eq!(seen, expected);

    // Ended sandboxes only with include_deleted; a deleted cursor still works.
    let gone = &expected[1];
    store
        .finish_sandbox(
            &gone.id,
            SandboxStatus::Deleted,
            "destroyed",
            T0 + Duration::hours(1),
            0,
            &sandpit_store::Cause::default(),
        )
        .await
        .unwrap()
        .unwrap();
    let live = store
        .list_sandboxes(&acct.id, 100, None, false)
        .await
        .unwrap();
    assert_eq!(live.data.len(), 8);
    assert!(!live.has_more);
    assert!(live.data.iter().all(|s| s.id != gone.id));
    let with = store
        .list_sandboxes(&acct.id, 100, None, true)
        .await
        .unwrap();
    assert_eq!(with.data.len(), 9);
    let after_gone = store
        .list_sandboxes(&acct.id, 100, Some(&gone.id), false)
        .await
        .unwrap();
    assert_eq!(after_gone.data, expected[2..].to_vec());
    let exact = store.list_sandboxes(&acct.id, 9, None, true).await.unwrap();
    assert!(!exact.has_more);

    // Unknown cursors, and other accounts' ids, are not found.
    assert!(matches!(
        store
            .list_sandboxes(&acct.id, 4, Some("sbx_nope"), false)
            .await,
        Err(StoreError::NotFound(_))
    ));
    assert!(matches!(
        store
            .list_sandboxes(&acct.id, 4, Some(&theirs.id), false)
            .await,
        Err(StoreError::NotFound(_))
    ));
    assert!(matches!(
        store.list_sandboxes(&acct.id, 0, None, false).await,
        Err(StoreError::Invalid(_))
    ));
    assert_eq!(store.sandbox_of(&other.id, &all[0].id).await.unwrap(), None);
    assert_eq!(
        store.sandbox_of(&acct.id, &all[0].id).await.unwrap(),
        Some(all[0].clone())
    );
}

async fn expiry_finds_live_sandboxes_past_their_time(store: Store) {
    let acct = store.create_account("alice", 100).await.unwrap();
    assert_eq!(store.next_expiry("local").await.unwrap(), None);
    let short = created(
        store
            .create_sandbox(sandbox(&acct.id, T0, 5, 0))
            .await
            .unwrap(),
    );
    let mid = created(
        store
            .create_sandbox(sandbox(&acct.id, T0, 10, 0))
            .await
            .unwrap(),
    );
    let long = created(
        store
            .create_sandbox(sandbox(&acct.id, T0, 60, 0))
            .await
            .unwrap(),
    );
    let ended = created(
        store
            .create_sandbox(sandbox(&acct.id, T0, 1, 0))
            .await
            .unwrap(),
    );
    store
        .finish_sandbox(
            &ended.id,
            SandboxStatus::Deleted,
            "destroyed",
            T0,
            0,
            &sandpit_store::Cause::default(),
        )
        .await
        .unwrap();

    assert_eq!(
        store.next_expiry("local").await.unwrap(),
        Some(short.expires_at)
    );
    assert!(store
        .expired_sandboxes("local", T0)
        .await
        .unwrap()
        .is_empty());
    // Exactly at expires_at counts.
    let due = store
        .expired_sandboxes("local", mid.expires_at)
        .await
        .unwrap();
    assert_eq!(
        due.iter().map(|s| s.id.as_str()).collect::<Vec<_>>(),
        [short.id.as_str(), mid.id.as_str()]
    );
    store
        .finish_sandbox(
            &short.id,
            SandboxStatus::Deleted,
            "expired",
            short.expires_at,
            0,
            &sandpit_store::Cause::default(),
        )
        .await
        .unwrap();
    assert_eq!(
        store.next_expiry("local").await.unwrap(),
        Some(mid.expires_at)
    );
    let later = store
        .expired_sandboxes("local", T0 + Duration::days(1))
        .await
        .unwrap();
    let ids: HashSet<_> = later.iter().map(|s| s.id.clone()).collect();
    assert_eq!(ids, HashSet::from([mid.id.clone(), long.id.clone()]));

    // Another host's sandboxes (a database shared by several) are its own.
    let mut theirs = sandbox(&acct.id, T0, 2, 0);
    theirs.host = "other".into();
    let theirs = created(store.create_sandbox(theirs).await.unwrap());
    assert_eq!(
        store.next_expiry("local").await.unwrap(),
        Some(mid.expires_at)
    );
    assert_eq!(
        store.next_expiry("other").await.unwrap(),
        Some(theirs.expires_at)
    );
    let due = store
        .expired_sandboxes("local", T0 + Duration::days(1))
        .await
        .unwrap();
    assert!(due.iter().all(|s| s.host == "local"), "{due:?}");
    let live = store.live_sandboxes("other").await.unwrap();
    assert_eq!(
        live.iter().map(|s| s.id.as_str()).collect::<Vec<_>>(),
        [theirs.id.as_str()]
    );
}

async fn a_nodes_start_is_recorded_only_on_its_provisioning_sandbox(store: Store) {
    let acct = store.create_account("alice", 100).await.unwrap();
    let s = created(
        store
            .create_sandbox(sandbox(&acct.id, T0, 15, 0))
            .await
            .unwrap(),
    );
    // Another node's start changes nothing.
    assert_eq!(
        store
            .record_start(&s.id, "elsewhere", &sandpit_store::Cause::default())
            .await
            .unwrap(),
        None
    );
    assert_eq!(store.sandbox(&s.id).await.unwrap().unwrap(), s);
    let r = store
        .record_start(&s.id, "local", &sandpit_store::Cause::default())
        .await
        .unwrap()
        .expect("recorded");
    assert_eq!(r.status, SandboxStatus::Running);
    assert!(r.ready_at.is_some());
    assert_eq!(store.sandbox(&s.id).await.unwrap().unwrap(), r);
    // Once: a start asked again records nothing more.
    assert_eq!(
        store
            .record_start(&s.id, "local", &sandpit_store::Cause::default())
            .await
            .unwrap(),
        None
    );
    store
        .finish_sandbox(
            &s.id,
            SandboxStatus::Deleted,
            "destroyed",
            T0,
            0,
            &sandpit_store::Cause::default(),
        )
        .await
        .unwrap();
    assert_eq!(
        store
            .record_start(&s.id, "local", &sandpit_store::Cause::default())
            .await
            .unwrap(),
        None
    );
    assert_eq!(
        store
            .record_start("sbx_nope", "local", &sandpit_store::Cause::default())
            .await
            .unwrap(),
        None
    );
    let events: Vec<String> = store
        .events(&s.id)
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.status.as_str().to_string())
        .collect();
    assert_eq!(events, ["provisioning", "running", "deleted"]);
}

async fn a_second_create_under_a_taken_id_writes_nothing(store: Store) {
    let acct = store.create_account("alice", 100).await.unwrap();
    store
        .add_credit(&acct.id, 1_000_000, Some("test"))
        .await
        .unwrap();
    let first = sandbox(&acct.id, T0, 15, 1000);
    let again = NewSandbox {
        idempotency: Some(("key-2".into(), "hash".into())),
        ..first.clone()
    };
    let s = created(store.create_sandbox(first).await.unwrap());
    assert!(
        !s.every_port_public,
        "a port is public only when it is exposed"
    );
    assert_eq!(s.internet_access, None, "not said is not stored as said");
    let balance = store.balance(&acct.id).await.unwrap();
    assert_eq!(
        store.create_sandbox(again).await.unwrap(),
        CreateOutcome::IdTaken
    );
    assert_eq!(
        store.balance(&acct.id).await.unwrap(),
        balance,
        "nothing reserved"
    );
    assert_eq!(store.sandbox(&s.id).await.unwrap().unwrap(), s);
    assert_eq!(store.events(&s.id).await.unwrap().len(), 1);
}

async fn status_changes_are_recorded_and_ended_sandboxes_stay_ended(store: Store) {
    let acct = store.create_account("alice", 100).await.unwrap();
    let s = created(
        store
            .create_sandbox(sandbox(&acct.id, T0, 15, 0))
            .await
            .unwrap(),
    );
    assert_eq!(s.ready_at, None);
    let r = store
        .set_status(
            &s.id,
            SandboxStatus::Running,
            Some("booted"),
            &sandpit_store::Cause::default(),
        )
        .await
        .unwrap();
    assert_eq!(r.status, SandboxStatus::Running);
    let ready = r.ready_at.expect("ready_at set");
    // Same status: no event, no change.
    assert_eq!(
        store
            .set_status(
                &s.id,
                SandboxStatus::Running,
                None,
                &sandpit_store::Cause::default()
            )
            .await
            .unwrap(),
        r
    );
    let d = store
        .set_status(
            &s.id,
            SandboxStatus::Deleting,
            None,
            &sandpit_store::Cause::default(),
        )
        .await
        .unwrap();
    assert_eq!(d.ready_at, Some(ready));
    assert!(matches!(
        store
            .set_status(
                &s.id,
                SandboxStatus::Deleted,
                None,
                &sandpit_store::Cause::default()
            )
            .await,
        Err(StoreError::Invalid(_))
    ));
    store
        .finish_sandbox(
            &s.id,
            SandboxStatus::Deleted,
            "destroyed",
            T0,
            0,
            &sandpit_store::Cause::default(),
        )
        .await
        .unwrap();
    assert!(matches!(
        store
            .set_status(
                &s.id,
                SandboxStatus::Running,
                None,
                &sandpit_store::Cause::default()
            )
            .await,
        Err(StoreError::Conflict(_))
    ));
    assert!(matches!(
        store
            .set_status(
                "sbx_nope",
                SandboxStatus::Running,
                None,
                &sandpit_store::Cause::default()
            )
            .await,
        Err(StoreError::NotFound(_))
    ));
    let events: Vec<(String, Option<String>)> = store
        .events(&s.id)
        .await
        .unwrap()
        .into_iter()
        .map(|e| (e.status.as_str().to_string(), e.reason))
        .collect();
    assert_eq!(
        events,
        [
            ("provisioning".into(), None),
            ("running".into(), Some("booted".into())),
            ("deleting".into(), None),
            ("deleted".into(), Some("destroyed".into())),
        ]
    );
}

async fn extending_reserves_more_and_checks_the_balance(store: Store) {
    let acct = store.create_account("alice", 100).await.unwrap();
    let bob = store.create_account("bob", 100).await.unwrap();
    store.add_credit(&acct.id, 100_000, None).await.unwrap();
    let s = created(
        store
            .create_sandbox(sandbox(&acct.id, T0, 15, 22_500))
            .await
            .unwrap(),
    );
    let new_exp = s.expires_at + Duration::minutes(30);

    let ExtendOutcome::Extended(e) = store
        .extend_sandbox(
            &s.id,
            &acct.id,
            new_exp,
            45,
            45_000,
            &sandpit_store::Cause::default(),
        )
        .await
        .unwrap()
    else {
        panic!("not extended")
    };
    assert_eq!((e.expires_at, e.timeout_minutes), (new_exp, 45));
    assert_eq!(store.balance(&acct.id).await.unwrap(), 32_500);

    assert_eq!(
        store
            .extend_sandbox(
                &s.id,
                &acct.id,
                new_exp + Duration::hours(1),
                105,
                90_000,
                &sandpit_store::Cause::default()
            )
            .await
            .unwrap(),
        ExtendOutcome::InsufficientCredits {
            balance: 32_500,
            needed: 90_000
        }
    );
    assert!(matches!(
        store
            .extend_sandbox(
                &s.id,
                &bob.id,
                new_exp,
                45,
                0,
                &sandpit_store::Cause::default()
            )
            .await,
        Err(StoreError::NotFound(_))
    ));
    assert!(matches!(
        store
            .extend_sandbox(&s.id, &acct.id, T0, 45, 0, &sandpit_store::Cause::default())
            .await,
        Err(StoreError::Invalid(_))
    ));

    // Finishing releases both reservations.
    store
        .finish_sandbox(
            &s.id,
            SandboxStatus::Deleted,
            "destroyed",
            T0 + Duration::minutes(20),
            30_000,
            &sandpit_store::Cause::default(),
        )
        .await
        .unwrap()
        .unwrap();
    assert_eq!(store.balance(&acct.id).await.unwrap(), 70_000);
    assert_never_negative(&store, &acct.id).await;
    assert!(matches!(
        store
            .extend_sandbox(
                &s.id,
                &acct.id,
                new_exp,
                45,
                0,
                &sandpit_store::Cause::default()
            )
            .await
            .unwrap(),
        ExtendOutcome::NotLive(_)
    ));
}

async fn shortening_gives_back_the_reservation_it_will_not_use(store: Store) {
    let acct = store.create_account("alice", 100).await.unwrap();
    let bob = store.create_account("bob", 100).await.unwrap();
    store.add_credit(&acct.id, 100_000, None).await.unwrap();
    // Made a minute ago for an hour (90_000 reserved).
    // (Whole seconds: the store keeps microseconds.)
    let made = OffsetDateTime::now_utc().replace_nanosecond(0).unwrap() - Duration::minutes(1);
    let s = created(
        store
            .create_sandbox(sandbox(&acct.id, made, 60, 90_000))
            .await
            .unwrap(),
    );
    assert_eq!(store.balance(&acct.id).await.unwrap(), 10_000);

    // To 20 minutes: the 40 it will not live go back.
    let sooner = made + Duration::minutes(20);
    let short = store
        .shorten_sandbox(
            &s.id,
            &acct.id,
            sooner,
            20,
            60_000,
            &sandpit_store::Cause::default(),
        )
        .await
        .unwrap()
        .expect("a live sandbox is shortened");
    assert_eq!((short.expires_at, short.timeout_minutes), (sooner, 20));
    assert_eq!(store.balance(&acct.id).await.unwrap(), 70_000);

    // Not shorter, already past, or not the caller's: refused, nothing changed.
    for at in [sooner, sooner + Duration::minutes(5), made] {
        assert!(
            matches!(
                store
                    .shorten_sandbox(&s.id, &acct.id, at, 10, 1, &sandpit_store::Cause::default())
                    .await,
                Err(StoreError::Invalid(_))
            ),
            "{at}"
        );
    }
    assert!(matches!(
        store
            .shorten_sandbox(
                &s.id,
                &bob.id,
                made + Duration::minutes(10),
                10,
                0,
                &sandpit_store::Cause::default()
            )
            .await,
        Err(StoreError::NotFound(_))
    ));
    assert_eq!(store.balance(&acct.id).await.unwrap(), 70_000);

    // Its end settles the rest: 10 minutes charged of the 20 still held.
    store
        .finish_sandbox(
            &s.id,
            SandboxStatus::Deleted,
            "destroyed",
            made + Duration::minutes(10),
            15_000,
            &sandpit_store::Cause::default(),
        )
        .await
        .unwrap()
        .unwrap();
    assert_eq!(store.balance(&acct.id).await.unwrap(), 85_000);
    assert_never_negative(&store, &acct.id).await;
    assert_eq!(
        store
            .shorten_sandbox(
                &s.id,
                &acct.id,
                made + Duration::minutes(5),
                5,
                0,
                &sandpit_store::Cause::default()
            )
            .await
            .unwrap(),
        None
    );
}

async fn a_sandboxs_executions_are_paged_newest_first(store: Store) {
    let acct = store.create_account("alice", 100).await.unwrap();
    let s = created(
        store
            .create_sandbox(sandbox(&acct.id, T0, 15, 0))
            .await
            .unwrap(),
    );
    let other = created(
        store
            .create_sandbox(sandbox(&acct.id, T0, 15, 0))
            .await
            .unwrap(),
    );
    let exec = |sandbox_id: &str, id: &str, secs: i64| ExecutionRow {
        id: id.into(),
        sandbox_id: sandbox_id.into(),
        account_id: acct.id.clone(),
        command: format!("echo {id}"),
        status: ExecutionState::Running,
        exit_code: None,
        stdout: String::new(),
        stderr: String::new(),
        truncated: false,
        duration_ms: 0,
        started_at: T0 + time::Duration::seconds(secs),
        finished_at: None,
    };
    // Two started at the same instant: the id breaks the tie, both ways.
    for (id, secs) in [("exec_a", 1), ("exec_b", 2), ("exec_c", 2), ("exec_d", 3)] {
        store
            .insert_execution(&exec(&s.id, id, secs))
            .await
            .unwrap();
    }
    store
        .insert_execution(&exec(&other.id, "exec_z", 9))
        .await
        .unwrap();
    let ids = |p: &sandpit_store::ExecutionPage| -> Vec<String> {
        p.data.iter().map(|x| x.id.clone()).collect()
    };
    let first = store.list_executions(&s.id, 2, None).await.unwrap();
    assert_eq!(ids(&first), ["exec_d", "exec_c"]);
    assert!(first.has_more);
    let second = store
        .list_executions(&s.id, 2, Some("exec_c"))
        .await
        .unwrap();
    assert_eq!(ids(&second), ["exec_b", "exec_a"]);
    assert!(!second.has_more);
    assert!(matches!(
        store.list_executions(&s.id, 2, Some("exec_z")).await,
        Err(StoreError::NotFound(_))
    ));
    assert_eq!(
        ids(&store.list_executions(&other.id, 10, None).await.unwrap()),
        ["exec_z"]
    );
}

async fn executions_are_recorded_and_finished_once(store: Store) {
    let acct = store.create_account("alice", 100).await.unwrap();
    let s = created(
        store
            .create_sandbox(sandbox(&acct.id, T0, 15, 0))
            .await
            .unwrap(),
    );
    let row = ExecutionRow {
        id: new_id("exec"),
        sandbox_id: s.id.clone(),
        account_id: acct.id.clone(),
        command: "echo hi".into(),
        status: ExecutionState::Running,
        exit_code: None,
        stdout: String::new(),
        stderr: String::new(),
        truncated: false,
        duration_ms: 0,
        started_at: T0,
        finished_at: None,
    };
    store.insert_execution(&row).await.unwrap();
    assert!(matches!(
        store.insert_execution(&row).await,
        Err(StoreError::Conflict(_))
    ));
    assert_eq!(store.execution(&row.id).await.unwrap(), Some(row.clone()));

    let result = ExecutionResult {
        status: ExecutionStatus::Completed,
        exit_code: Some(0),
        stdout: "hi\n".into(),
        stderr: "ünïcode\u{0}".into(),
        truncated: true,
        duration_ms: 12,
        finished_at: T0 + Duration::milliseconds(12),
    };
    // It says what the account's executions take now, as stored.
    let stored = store.finish_execution(&row.id, &result).await.unwrap();
    assert_eq!(
        stored,
        Some(store.execution_bytes(&acct.id).await.unwrap()),
        "finishing reports the account's stored bytes"
    );
    assert!(stored.unwrap() > 0);
    let mut second = result.clone();
    second.status = ExecutionStatus::Cancelled;
    assert_eq!(
        store.finish_execution(&row.id, &second).await.unwrap(),
        None
    );
    let got = store.execution(&row.id).await.unwrap().unwrap();
    assert_eq!(got.status.as_str(), "completed");
    assert_eq!(got.exit_code, Some(0));
    assert_eq!(got.stdout, "hi\n");
    assert_eq!(got.stderr, "ünïcode\u{0}");
    assert!(got.truncated);
    assert_eq!(got.duration_ms, 12);
    assert_eq!(got.finished_at, Some(result.finished_at));
    assert_eq!(got.account_id, acct.id);
    assert!(matches!(
        store.finish_execution("exec_nope", &result).await,
        Err(StoreError::NotFound(_))
    ));

    let mut orphan = row.clone();
    orphan.id = new_id("exec");
    orphan.sandbox_id = "sbx_nope".into();
    assert!(matches!(
        store.insert_execution(&orphan).await,
        Err(StoreError::NotFound(_))
    ));

    let mut running = row.clone();
    running.id = new_id("exec");
    store.insert_execution(&running).await.unwrap();
    assert_eq!(store.fail_running_executions(&s.id, T0).await.unwrap(), 1);
    assert_eq!(
        store
            .execution(&running.id)
            .await
            .unwrap()
            .unwrap()
            .status
            .as_str(),
        "failed"
    );

    // A server's start fails what its killed predecessor left running, of
    // every sandbox, and nothing that had finished.
    let mut cut = row.clone();
    cut.id = new_id("exec");
    store.insert_execution(&cut).await.unwrap();
    let later = T0 + Duration::seconds(5);
    assert_eq!(
        store
            .fail_all_running_executions("local", later)
            .await
            .unwrap(),
        1
    );
    let got = store.execution(&cut.id).await.unwrap().unwrap();
    assert_eq!(
        (got.status.as_str(), got.finished_at),
        ("failed", Some(later))
    );
    assert_eq!(
        store
            .execution(&row.id)
            .await
            .unwrap()
            .unwrap()
            .status
            .as_str(),
        "completed"
    );
    assert_eq!(
        store
            .fail_all_running_executions("local", later)
            .await
            .unwrap(),
        0
    );
}

async fn ports_are_opened_once_and_closed(store: Store) {
    let acct = store.create_account("alice", 100).await.unwrap();
    let s = created(
        store
            .create_sandbox(sandbox(&acct.id, T0, 15, 0))
            .await
            .unwrap(),
    );
    let p = store
        .upsert_port(&s.id, 8080, "https://8080-x.example", false)
        .await
        .unwrap();
    assert_eq!((p.port, p.closed_at), (8080, None));
    // Asking again returns the same row, whatever URL is offered.
    assert_eq!(
        store
            .upsert_port(&s.id, 8080, "https://other", false)
            .await
            .unwrap(),
        p
    );
    // Made private by the next expose, the same port otherwise.
    let private = store
        .upsert_port(&s.id, 8080, "https://other", true)
        .await
        .unwrap();
    assert_eq!(
        private,
        PortRow {
            private: true,
            ..p.clone()
        }
    );
    assert!(store.list_ports(&s.id).await.unwrap()[0].private);
    // A live sandbox's every port made private, and back.
    assert!(!s.private_traffic);
    assert!(store.set_private_traffic(&s.id, true).await.unwrap());
    assert!(store.sandbox(&s.id).await.unwrap().unwrap().private_traffic);
    assert!(!store.set_private_traffic("sbx_nope", true).await.unwrap());
    store
        .upsert_port(&s.id, 3000, "https://3000-x.example", false)
        .await
        .unwrap();
    let ports: Vec<u16> = store
        .list_ports(&s.id)
        .await
        .unwrap()
        .iter()
        .map(|p| p.port)
        .collect();
    assert_eq!(ports, [3000, 8080]);

    assert!(store.close_port(&s.id, 8080).await.unwrap());
    assert!(!store.close_port(&s.id, 8080).await.unwrap());
    assert_eq!(store.list_ports(&s.id).await.unwrap().len(), 1);
    // Reopened with the new URL.
    let again = store
        .upsert_port(&s.id, 8080, "https://8080-y.example", false)
        .await
        .unwrap();
    assert_eq!(
        (again.url.as_str(), again.closed_at),
        ("https://8080-y.example", None)
    );
    assert_eq!(store.close_all_ports(&s.id).await.unwrap(), 2);
    assert!(store.list_ports(&s.id).await.unwrap().is_empty());

    // Ending the sandbox closes what is open.
    store
        .upsert_port(&s.id, 9000, "https://9000", false)
        .await
        .unwrap();
    store
        .finish_sandbox(
            &s.id,
            SandboxStatus::Deleted,
            "destroyed",
            T0,
            0,
            &sandpit_store::Cause::default(),
        )
        .await
        .unwrap();
    assert!(store.list_ports(&s.id).await.unwrap().is_empty());
    assert!(matches!(
        store.upsert_port("sbx_nope", 80, "u", false).await,
        Err(StoreError::NotFound(_))
    ));
}

async fn usage_lists_recent_sandboxes_with_their_charges(store: Store) {
    let acct = store.create_account("alice", 100).await.unwrap();
    store.add_credit(&acct.id, 10_000_000, None).await.unwrap();
    let day = Duration::days(1);
    // Ended long ago: out of the window.
    let old = created(
        store
            .create_sandbox(sandbox(&acct.id, T0 - 40 * day, 60, 90_000))
            .await
            .unwrap(),
    );
    store
        .finish_sandbox(
            &old.id,
            SandboxStatus::Deleted,
            "expired",
            T0 - 40 * day + Duration::hours(1),
            90_000,
            &sandpit_store::Cause::default(),
        )
        .await
        .unwrap();
    // Created before the window, ended inside it.
    let spans = created(
        store
            .create_sandbox(sandbox(&acct.id, T0 - 31 * day, 60, 90_000))
            .await
            .unwrap(),
    );
    store
        .finish_sandbox(
            &spans.id,
            SandboxStatus::Deleted,
            "destroyed",
            T0 - 29 * day,
            45_000,
            &sandpit_store::Cause::default(),
        )
        .await
        .unwrap();
    // Inside, still live.
    let live = created(
        store
            .create_sandbox(sandbox(&acct.id, T0 - day, 60, 90_000))
            .await
            .unwrap(),
    );

    let usage = store.usage(&acct.id, T0 - 30 * day).await.unwrap();
    let got: Vec<(&str, i64)> = usage
        .iter()
        .map(|u| (u.sandbox.id.as_str(), u.charged_micros))
        .collect();
    assert_eq!(got, [(live.id.as_str(), 0), (spans.id.as_str(), 45_000)]);
    assert_eq!(
        store.balance(&acct.id).await.unwrap(),
        10_000_000 - 90_000 - 45_000 - 90_000
    );
}

async fn preview_traffic_adds_up_in_usage(store: Store) {
    let acct = store.create_account("alice", 100).await.unwrap();
    store.add_credit(&acct.id, 10_000_000, None).await.unwrap();
    let s = created(
        store
            .create_sandbox(sandbox(&acct.id, T0, 60, 90_000))
            .await
            .unwrap(),
    );
    store.add_preview_traffic(&s.id, 100, 5_000).await.unwrap();
    store.add_preview_traffic(&s.id, 20, 7).await.unwrap();
    let usage = store.usage(&acct.id, T0 - Duration::days(1)).await.unwrap();
    assert_eq!(usage.len(), 1);
    assert_eq!(
        (usage[0].preview_bytes_in, usage[0].preview_bytes_out),
        (120, 5_007)
    );
}

async fn disk_use_is_recorded_summed_over_live_sandboxes_and_limits_creates(store: Store) {
    let acct = store.create_account("alice", 100).await.unwrap();
    let bob = store.create_account("bob", 100).await.unwrap();
    for a in [&acct.id, &bob.id] {
        store.add_credit(a, 10_000_000, None).await.unwrap();
    }
    let new = |a: &str| sandbox(a, T0, 60, 90_000);
    let s1 = created(store.create_sandbox(new(&acct.id)).await.unwrap());
    let s2 = created(store.create_sandbox(new(&acct.id)).await.unwrap());
    let b1 = created(store.create_sandbox(new(&bob.id)).await.unwrap());
    store
        .set_disk_use(&[
            (s1.id.clone(), 600),
            (s2.id.clone(), 400),
            (b1.id.clone(), 7),
        ])
        .await
        .unwrap();
    assert_eq!(store.account_disk_use(&acct.id).await.unwrap(), 1_000);
    assert_eq!(store.account_disk_use(&bob.id).await.unwrap(), 7);
    assert_eq!(
        store
            .sandbox(&s1.id)
            .await
            .unwrap()
            .unwrap()
            .disk_used_bytes,
        600
    );

    // At the limit: no new sandbox for alice, whatever bob does.
    let limited = |a: &str, limit| NewSandbox {
        disk_limit_bytes: Some(limit),
        ..new(a)
    };
    assert_eq!(
        store
            .create_sandbox(limited(&acct.id, 1_000))
            .await
            .unwrap(),
        CreateOutcome::OverDiskLimit {
            used: 1_000,
            limit: 1_000
        }
    );
    created(store.create_sandbox(limited(&bob.id, 1_000)).await.unwrap());

    // An ended sandbox keeps its last figure but no longer counts, and a
    // late measurement does not change it.
    store
        .finish_sandbox(
            &s1.id,
            SandboxStatus::Deleted,
            "destroyed",
            T0 + Duration::minutes(1),
            0,
            &sandpit_store::Cause::default(),
        )
        .await
        .unwrap();
    store.set_disk_use(&[(s1.id.clone(), 9_999)]).await.unwrap();
    assert_eq!(
        store
            .sandbox(&s1.id)
            .await
            .unwrap()
            .unwrap()
            .disk_used_bytes,
        600
    );
    assert_eq!(store.account_disk_use(&acct.id).await.unwrap(), 400);
    created(
        store
            .create_sandbox(limited(&acct.id, 1_000))
            .await
            .unwrap(),
    );
}

/// Commits never checkpoint the WAL (no request pays for the fsync); the
/// background checkpointer copies it into the database file within seconds.
#[tokio::test]
async fn the_wal_is_checkpointed_in_the_background_not_by_commits() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sandpit.db");
    let store = Store::open_sqlite(&path).await.unwrap();
    let wal = dir.path().join("sandpit.db-wal");
    let autocheckpoint: i64 = sqlx::query_scalar("PRAGMA wal_autocheckpoint")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(autocheckpoint, 0, "commits would checkpoint");
    // Let the first background checkpoint take the migrations.
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    let db_before = std::fs::metadata(&path).unwrap().len();
    for i in 0..400 {
        store.create_account(&format!("acct-{i}"), 1).await.unwrap();
    }
    let wal_len = std::fs::metadata(&wal).unwrap().len();
    assert!(wal_len > 0, "the writes did not go to the WAL");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while std::fs::metadata(&path).unwrap().len() <= db_before {
        assert!(
            std::time::Instant::now() < deadline,
            "the WAL ({wal_len} bytes) was not checkpointed into the database file"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(store.list_accounts().await.unwrap().len(), 400);
}

#[tokio::test]
async fn the_database_files_are_the_owners_alone_and_old_ones_are_tightened() {
    use std::os::unix::fs::PermissionsExt;
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("sandpit.db");
    // What an older version left: a database any local user could read.
    drop(Store::open_sqlite(&db).await.unwrap());
    for suffix in ["", "-wal", "-shm"] {
        let f = dir.path().join(format!("sandpit.db{suffix}"));
        if f.exists() {
            std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).unwrap();
        }
    }
    let store = Store::open_sqlite(&db).await.unwrap();
    store.create_account("a", 10).await.unwrap();
    for suffix in ["", "-wal", "-shm"] {
        let f = dir.path().join(format!("sandpit.db{suffix}"));
        assert_eq!(mode(&f), 0o600, "sandpit.db{suffix}");
    }
    // A new one is 0600 from the start, whatever the umask.
    let fresh = dir.path().join("fresh.db");
    let store = Store::open_sqlite(&fresh).await.unwrap();
    store.create_account("b", 10).await.unwrap();
    assert_eq!(mode(&fresh), 0o600);
}

/// A `running` execution of `s` started at `at`.
async fn running_execution(
    store: &Store,
    s: &sandpit_store::SandboxRow,
    at: OffsetDateTime,
    command: &str,
) -> String {
    let id = new_id("exec");
    store
        .insert_execution(&ExecutionRow {
            id: id.clone(),
            sandbox_id: s.id.clone(),
            account_id: s.account_id.clone(),
            command: command.into(),
            status: ExecutionState::Running,
            exit_code: None,
            stdout: String::new(),
            stderr: String::new(),
            truncated: false,
            duration_ms: 0,
            started_at: at,
            finished_at: None,
        })
        .await
        .unwrap();
    id
}

/// A finished execution of `s` started at `at`, with `out` bytes of stdout.
async fn finished_execution(
    store: &Store,
    s: &sandpit_store::SandboxRow,
    at: OffsetDateTime,
    out: usize,
) -> String {
    let id = running_execution(store, s, at, "yes | head").await;
    let done = ExecutionResult {
        status: ExecutionStatus::Completed,
        exit_code: Some(0),
        stdout: "y".repeat(out),
        stderr: "e".into(),
        truncated: false,
        duration_ms: 5,
        finished_at: at + Duration::seconds(1),
    };
    assert!(store.finish_execution(&id, &done).await.unwrap().is_some());
    id
}

async fn an_accounts_stored_executions_are_counted_and_trimmed_oldest_first(store: Store) {
    let acct = store.create_account("alice", 100).await.unwrap();
    let bob = store.create_account("bob", 100).await.unwrap();
    let s = created(
        store
            .create_sandbox(sandbox(&acct.id, T0, 15, 0))
            .await
            .unwrap(),
    );
    let b = created(
        store
            .create_sandbox(sandbox(&bob.id, T0, 15, 0))
            .await
            .unwrap(),
    );
    let mut ids = Vec::new();
    for i in 0..10 {
        ids.push(finished_execution(&store, &s, T0 + Duration::seconds(i), 10_000).await);
    }
    let bobs = finished_execution(&store, &b, T0, 10_000).await;
    // Each: command 10 + stdout 10,000 + stderr 1 + 256 of row.
    let each = 10 + 10_000 + 1 + 256;
    assert_eq!(store.execution_bytes(&acct.id).await.unwrap(), 10 * each);
    // A running one counts its command now and its output when it ends.
    let running = running_execution(&store, &s, T0, "sleep 1000").await;
    assert_eq!(
        store.execution_bytes(&acct.id).await.unwrap(),
        10 * each + 10 + 256
    );

    // Trimmed to 4 of them: the 6 oldest ended ones go, the running one stays.
    let deleted = store
        .trim_executions(&acct.id, 4 * each + 266)
        .await
        .unwrap();
    assert_eq!(deleted, 6);
    for (i, id) in ids.iter().enumerate() {
        assert_eq!(
            store.execution(id).await.unwrap().is_some(),
            i >= 6,
            "execution {i}"
        );
    }
    assert!(store.execution(&running).await.unwrap().is_some());
    assert_eq!(
        store.execution_bytes(&acct.id).await.unwrap(),
        4 * each + 266
    );
    // Another account's are not touched; under budget, nothing goes.
    assert!(store.execution(&bobs).await.unwrap().is_some());
    assert_eq!(
        store
            .trim_executions(&acct.id, 4 * each + 266)
            .await
            .unwrap(),
        0
    );
    // Only running ones left over a tiny budget: they stay.
    assert_eq!(store.trim_executions(&acct.id, 0).await.unwrap(), 4);
    assert!(store.execution(&running).await.unwrap().is_some());
    assert_eq!(store.execution_bytes(&acct.id).await.unwrap(), 266);
}

async fn an_ended_sandboxs_executions_go_after_the_retention(store: Store) {
    let acct = store.create_account("alice", 100).await.unwrap();
    let ended = created(
        store
            .create_sandbox(sandbox(&acct.id, T0, 15, 0))
            .await
            .unwrap(),
    );
    let live = created(
        store
            .create_sandbox(sandbox(&acct.id, T0, 15, 0))
            .await
            .unwrap(),
    );
    let old = finished_execution(&store, &ended, T0, 100).await;
    let current = finished_execution(&store, &live, T0, 100).await;
    store
        .finish_sandbox(
            &ended.id,
            SandboxStatus::Deleted,
            "destroyed",
            T0 + Duration::minutes(5),
            0,
            &sandpit_store::Cause::default(),
        )
        .await
        .unwrap();
    // Ended at T0+5m: kept when the cut-off is before that, dropped after.
    assert_eq!(
        store
            .drop_ended_executions(T0 + Duration::minutes(4))
            .await
            .unwrap(),
        0
    );
    assert!(store.execution(&old).await.unwrap().is_some());
    assert_eq!(
        store
            .drop_ended_executions(T0 + Duration::minutes(6))
            .await
            .unwrap(),
        1
    );
    assert!(store.execution(&old).await.unwrap().is_none());
    assert!(
        store.execution(&current).await.unwrap().is_some(),
        "a live sandbox's stay"
    );
    assert_eq!(
        store.execution_bytes(&acct.id).await.unwrap(),
        10 + 100 + 1 + 256,
        "the account's count follows"
    );
}

async fn nodes_hold_leases_on_the_database_clock_and_lost_ones_settle_once(store: Store) {
    use sandpit_store::{NewNode, NodeState};
    use std::time::Duration as StdDuration;
    let node = |name: &str| NewNode {
        name: name.into(),
        address: format!("{name}.internal:7443"),
        vcpus: 2,
        memory_mb: 4096,
        max_sandboxes: 10,
    };
    let a = store
        .register_node(&node("a"), StdDuration::from_secs(60))
        .await
        .unwrap();
    assert_eq!((a.epoch, a.state), (1, NodeState::Up));
    assert!(a.is_live());
    let b = store
        .register_node(&node("b"), StdDuration::ZERO)
        .await
        .unwrap();
    assert!(store
        .renew_lease(
            "a",
            a.epoch,
            StdDuration::from_secs(60),
            &Default::default()
        )
        .await
        .unwrap());
    assert!(!store
        .renew_lease(
            "a",
            a.epoch + 1,
            StdDuration::from_secs(60),
            &Default::default()
        )
        .await
        .unwrap());
    let db_now = store.now_ms().await.unwrap();
    let here = OffsetDateTime::now_utc().unix_timestamp() * 1000;
    assert!((db_now - here).abs() < 5_000, "db clock {db_now} vs {here}");

    // Sandboxes on both nodes, of one account.
    let acct = store.create_account("alice", 100).await.unwrap();
    store.add_credit(&acct.id, 1_000_000, None).await.unwrap();
    let now = OffsetDateTime::now_utc() - Duration::minutes(10);
    let mut on_b = Vec::new();
    let mut on_a = None;
    for host in ["b", "b", "a"] {
        let mut n = sandbox(&acct.id, now, 60, 90_000);
        n.host = host.into();
        let row = created(store.create_sandbox(n).await.unwrap());
        store
            .set_status(
                &row.id,
                SandboxStatus::Running,
                None,
                &sandpit_store::Cause::default(),
            )
            .await
            .unwrap();
        if host == "b" {
            on_b.push(row.id);
        } else {
            on_a = Some(row.id);
        }
    }
    // Commands in a's sandbox, one routed there by b (a member that also
    // serves the API), one run by a itself.
    let running_by = |runner: &str| {
        let store = store.clone();
        let (runner, sandbox_id, account_id) =
            (runner.to_string(), on_a.clone().unwrap(), acct.id.clone());
        async move {
            let row = ExecutionRow {
                id: new_id("exec"),
                sandbox_id,
                account_id,
                command: "sleep 300".into(),
                status: ExecutionState::Running,
                exit_code: None,
                stdout: String::new(),
                stderr: String::new(),
                truncated: false,
                duration_ms: 0,
                started_at: OffsetDateTime::now_utc(),
                finished_at: None,
            };
            store
                .insert_execution_by(&row, Some(&runner))
                .await
                .unwrap();
            row.id
        }
    };
    let (by_b, by_a) = (running_by("b").await, running_by("a").await);
    // A snapshot on each node.
    let mut snaps = Vec::new();
    for (host, sandbox) in [("b", on_b[0].clone()), ("a", on_a.clone().unwrap())] {
        let mut new = new_snapshot(&acct.id, &sandbox, None);
        new.host = host.into();
        match store.create_snapshot(new).await.unwrap() {
            SnapshotOutcome::Created(s) => snaps.push(s.id),
            other => panic!("{other:?}"),
        }
    }

    // b's lease ran out; a sweeper whose own lease ran out too (its
    // statements waited out a database outage, when nobody could renew)
    // declares nothing; four sweepers race, and b is declared lost once.
    tokio::time::sleep(StdDuration::from_millis(20)).await;
    assert!(store
        .declare_lost_nodes(StdDuration::ZERO, "b", |_, _| 0)
        .await
        .unwrap()
        .is_empty());
    let sweeps: Vec<_> = (0..4)
        .map(|_| {
            let store = store.clone();
            tokio::spawn(async move {
                store
                    .declare_lost_nodes(StdDuration::ZERO, "a", |s, until| {
                        (until - s.created_at).whole_seconds() * 25
                    })
                    .await
                    .unwrap()
            })
        })
        .collect();
    let mut lost = Vec::new();
    for t in sweeps {
        lost.extend(t.await.unwrap());
    }
    assert_eq!(lost.len(), 1, "{lost:?}");
    assert_eq!(lost[0].node.name, "b");
    assert_eq!(lost[0].node.state, NodeState::Lost);
    let mut ended: Vec<_> = lost[0].sandboxes.iter().map(|s| s.id.clone()).collect();
    ended.sort();
    on_b.sort();
    assert_eq!(ended, on_b);
    for id in &on_b {
        let row = store.sandbox(id).await.unwrap().unwrap();
        assert_eq!(row.status, SandboxStatus::Failed);
        let reason = row.deleted_reason.unwrap();
        assert!(reason.contains("its node b was lost"), "{reason}");
        let kinds: Vec<String> = store
            .ledger(&acct.id)
            .await
            .unwrap()
            .into_iter()
            .filter(|l| l.sandbox_id.as_deref() == Some(id.as_str()))
            .map(|l| l.kind)
            .collect();
        // Reserved once, released once, charged once (about ten minutes).
        assert_eq!(kinds, ["reserve", "release", "charge"], "{id}");
    }
    assert_never_negative(&store, &acct.id).await;
    let on_a = store.live_sandboxes("a").await.unwrap();
    assert_eq!(on_a.len(), 1);
    // What b was running for others failed with it; a's own runs on.
    let status_of = |id: String| {
        let store = store.clone();
        async move { store.execution(&id).await.unwrap().unwrap().status }
    };
    assert_eq!(
        status_of(by_b).await,
        ExecutionState::Ended(ExecutionStatus::Failed)
    );
    assert_eq!(status_of(by_a).await, ExecutionState::Running);
    // b's snapshot went with it; a's stays.
    let status = |id: String| {
        let store = store.clone();
        async move { store.snapshot(&id).await.unwrap().unwrap().status }
    };
    assert_eq!(status(snaps[0].clone()).await, SnapshotStatus::Deleted);
    assert_eq!(status(snaps[1].clone()).await, SnapshotStatus::Creating);

    // Fenced: b's old epoch renews nothing; b starting again is up anew.
    assert!(!store
        .renew_lease(
            "b",
            b.epoch,
            StdDuration::from_secs(60),
            &Default::default()
        )
        .await
        .unwrap());
    let again = store
        .register_node(&node("b"), StdDuration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(again.epoch, b.epoch + 1);
    assert_eq!((again.state, again.lost_at_ms), (NodeState::Up, None));
    assert!(store
        .declare_lost_nodes(StdDuration::ZERO, "a", |_, _| 0)
        .await
        .unwrap()
        .is_empty());
    let names: Vec<_> = store
        .nodes()
        .await
        .unwrap()
        .into_iter()
        .map(|n| (n.name.clone(), n.is_live()))
        .collect();
    assert_eq!(names, [("a".to_string(), true), ("b".to_string(), true)]);
}

async fn a_create_takes_a_place_on_a_live_node_with_room_in_its_transaction(store: Store) {
    use sandpit_store::NewNode;
    use std::collections::BTreeMap;
    use std::time::Duration as StdDuration;
    let node = |name: &str, max_sandboxes: u32| NewNode {
        name: name.into(),
        address: format!("{name}.internal:7443"),
        vcpus: 2,
        memory_mb: 4096,
        max_sandboxes,
    };
    let lease = StdDuration::from_secs(60);
    let a = store.register_node(&node("a", 2), lease).await.unwrap();
    let b = store.register_node(&node("b", 5), lease).await.unwrap();
    // A member without VMs (a replica) is never a place for a sandbox.
    store.register_node(&node("api", 0), lease).await.unwrap();
    let warm = BTreeMap::from([(
        "small".to_string(),
        vec!["sbx_w1".to_string(), "sbx_w2".to_string()],
    )]);
    assert!(store.renew_lease("b", b.epoch, lease, &warm).await.unwrap());
    let acct = store.create_account("alice", 100).await.unwrap();
    store.add_credit(&acct.id, 1_000_000, None).await.unwrap();
    let on = |host: &str, epoch: i64| {
        let mut n = sandbox(&acct.id, OffsetDateTime::now_utc(), 60, 1_000);
        n.host = host.into();
        n.host_epoch = Some(epoch);
        n
    };

    let candidates = store.placement_candidates().await.unwrap();
    let seen: Vec<_> = candidates
        .iter()
        .map(|c| (c.node.name.as_str(), c.live, c.node.max_sandboxes))
        .collect();
    assert_eq!(seen, [("a", 0, 2), ("b", 0, 5)]);
    assert_eq!(candidates[1].node.warm, warm, "the pool as b last told it");

    // Eight creates race for a's two places: exactly two get them, the
    // others are told it is full, and nothing is reserved for them.
    let races: Vec<_> = (0..8)
        .map(|_| {
            let store = store.clone();
            let n = on("a", a.epoch);
            tokio::spawn(async move { store.create_sandbox(n).await.unwrap() })
        })
        .collect();
    let mut outcomes = Vec::new();
    for r in races {
        outcomes.push(r.await.unwrap());
    }
    let placed = outcomes
        .iter()
        .filter(|o| matches!(o, CreateOutcome::Created(_)))
        .count();
    assert_eq!(placed, 2, "{outcomes:?}");
    assert!(outcomes.iter().all(|o| matches!(
        o,
        CreateOutcome::Created(_) | CreateOutcome::HostFull { live: 2, limit: 2 }
    )));
    let live: Vec<_> = store
        .placement_candidates()
        .await
        .unwrap()
        .into_iter()
        .map(|c| (c.node.name, c.live))
        .collect();
    assert_eq!(live, [("a".to_string(), 2), ("b".to_string(), 0)]);
    assert_eq!(
        store.balance(&acct.id).await.unwrap(),
        1_000_000 - 2 * 1_000
    );
    assert_never_negative(&store, &acct.id).await;

    // A node at another epoch, or silent past its lease, takes nothing.
    assert_eq!(
        store.create_sandbox(on("b", b.epoch + 1)).await.unwrap(),
        CreateOutcome::HostUnavailable
    );
    assert!(store
        .renew_lease("b", b.epoch, StdDuration::ZERO, &warm)
        .await
        .unwrap());
    tokio::time::sleep(StdDuration::from_millis(20)).await;
    assert_eq!(
        store.create_sandbox(on("b", b.epoch)).await.unwrap(),
        CreateOutcome::HostUnavailable
    );
    let names: Vec<_> = store
        .placement_candidates()
        .await
        .unwrap()
        .into_iter()
        .map(|c| c.node.name)
        .collect();
    assert_eq!(names, ["a"], "b is silent: no place for a sandbox");
    // Renewed, it takes sandboxes again.
    assert!(store.renew_lease("b", b.epoch, lease, &warm).await.unwrap());
    created(store.create_sandbox(on("b", b.epoch)).await.unwrap());
}

fn new_snapshot(account_id: &str, sandbox_id: &str, key: Option<&str>) -> NewSnapshot {
    NewSnapshot {
        id: new_id("snap"),
        account_id: account_id.into(),
        name: Some("n".into()),
        sandbox_id: sandbox_id.into(),
        size: "small".into(),
        host: "local".into(),
        expires_at: OffsetDateTime::now_utc() + Duration::days(7),
        max_count: 2,
        max_bytes: 1000,
        idempotency: key.map(|k| (k.to_string(), "hash".to_string())),
    }
}

async fn snapshots_count_against_a_quota_replay_by_key_and_expire(store: Store) {
    let acct = store.create_account("snapper", 20).await.unwrap();
    let other = store.create_account("other", 20).await.unwrap();
    store.add_credit(&acct.id, 1_000_000, None).await.unwrap();
    let now = OffsetDateTime::now_utc();
    let sbx = created(
        store
            .create_sandbox(sandbox(&acct.id, now, 60, 0))
            .await
            .unwrap(),
    );
    let SnapshotOutcome::Created(a) = store
        .create_snapshot(new_snapshot(&acct.id, &sbx.id, Some("k1")))
        .await
        .unwrap()
    else {
        panic!("not created")
    };
    assert_eq!(a.status, SnapshotStatus::Creating);
    // The same key: the same snapshot; with another request: a conflict.
    match store
        .create_snapshot(new_snapshot(&acct.id, &sbx.id, Some("k1")))
        .await
        .unwrap()
    {
        SnapshotOutcome::Replay(r) => assert_eq!(r.id, a.id),
        other => panic!("{other:?}"),
    }
    let mut clash = new_snapshot(&acct.id, &sbx.id, Some("k1"));
    clash.idempotency = Some(("k1".into(), "another".into()));
    assert_eq!(
        store.create_snapshot(clash).await.unwrap(),
        SnapshotOutcome::IdempotencyConflict
    );
    let ready = store
        .snapshot_ready(&a.id, 600, &sandpit_store::Cause::default())
        .await
        .unwrap()
        .unwrap();
    assert_eq!((ready.status, ready.bytes), (SnapshotStatus::Ready, 600));
    assert_eq!(
        store
            .snapshot_ready(&a.id, 1, &sandpit_store::Cause::default())
            .await
            .unwrap(),
        None,
        "once"
    );
    // A second fits the count (2); a third does not.
    let SnapshotOutcome::Created(b) = store
        .create_snapshot(new_snapshot(&acct.id, &sbx.id, None))
        .await
        .unwrap()
    else {
        panic!("not created")
    };
    assert!(matches!(
        store
            .create_snapshot(new_snapshot(&acct.id, &sbx.id, None))
            .await
            .unwrap(),
        SnapshotOutcome::OverQuota {
            count: 2,
            bytes: 600,
            ..
        }
    ));
    // Bytes count too: at 1000 of 1000, none more even under the count.
    store
        .snapshot_ready(&b.id, 400, &sandpit_store::Cause::default())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        store.delete_snapshot(&a.id).await.unwrap().unwrap().id,
        a.id
    );
    assert_eq!(store.delete_snapshot(&a.id).await.unwrap(), None, "once");
    let mut big = new_snapshot(&acct.id, &sbx.id, None);
    big.max_bytes = 400;
    assert!(matches!(
        store.create_snapshot(big).await.unwrap(),
        SnapshotOutcome::OverQuota {
            count: 1,
            bytes: 400,
            ..
        }
    ));
    // Ownership: another account's and a deleted one are not found.
    assert!(store.snapshot_of(&other.id, &b.id).await.unwrap().is_none());
    assert!(store.snapshot_of(&acct.id, &a.id).await.unwrap().is_none());
    assert!(
        store.snapshot(&a.id).await.unwrap().is_some(),
        "kept as history"
    );
    let page = store.list_snapshots(&acct.id, 10, None).await.unwrap();
    assert_eq!(page.data.iter().map(|s| &s.id).collect::<Vec<_>>(), [&b.id]);
    assert!(store
        .list_snapshots(&other.id, 10, None)
        .await
        .unwrap()
        .data
        .is_empty());
    assert!(matches!(
        store.list_snapshots(&other.id, 10, Some(&b.id)).await,
        Err(StoreError::NotFound(_))
    ));
    // Expiry finds it on its host only, once it is due.
    assert!(store
        .expired_snapshots("local", now)
        .await
        .unwrap()
        .is_empty());
    let later = now + Duration::days(8);
    let due = store.expired_snapshots("local", later).await.unwrap();
    assert_eq!(due.iter().map(|s| &s.id).collect::<Vec<_>>(), [&b.id]);
    assert!(store
        .expired_snapshots("elsewhere", later)
        .await
        .unwrap()
        .is_empty());
    assert_eq!(
        store.snapshots_on("local").await.unwrap().len(),
        1,
        "the deleted one is not the host's any more"
    );
    assert!(store.next_snapshot_expiry("local").await.unwrap().is_some());
}

async fn a_paused_sandbox_stays_live_and_adds_up_its_paused_time(store: Store) {
    let acct = store.create_account("pauser", 1).await.unwrap();
    store.add_credit(&acct.id, 1_000_000, None).await.unwrap();
    let now = OffsetDateTime::now_utc();
    let sbx = created(
        store
            .create_sandbox(sandbox(&acct.id, now, 60, 1000))
            .await
            .unwrap(),
    );
    // Only a running sandbox pauses.
    assert_eq!(
        store
            .pause_sandbox(&sbx.id, &sandpit_store::Cause::default())
            .await
            .unwrap(),
        None
    );
    store
        .set_status(
            &sbx.id,
            SandboxStatus::Running,
            None,
            &sandpit_store::Cause::default(),
        )
        .await
        .unwrap();
    let paused = store
        .pause_sandbox(&sbx.id, &sandpit_store::Cause::default())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(paused.status, SandboxStatus::Paused);
    assert!(paused.paused_at.is_some());
    assert_eq!(
        store
            .pause_sandbox(&sbx.id, &sandpit_store::Cause::default())
            .await
            .unwrap(),
        None,
        "once"
    );
    assert!(matches!(
        store
            .set_status(
                &sbx.id,
                SandboxStatus::Paused,
                None,
                &sandpit_store::Cause::default()
            )
            .await,
        Err(StoreError::Invalid(_))
    ));
    // Still live: it counts against the limit (1), is listed, expires,
    // and can be extended.
    assert!(matches!(
        store
            .create_sandbox(sandbox(&acct.id, now, 60, 1000))
            .await
            .unwrap(),
        CreateOutcome::TooManySandboxes { live: 1, limit: 1 }
    ));
    assert_eq!(store.live_sandboxes("local").await.unwrap().len(), 1);
    assert_eq!(
        store.sandbox(&sbx.id).await.unwrap().unwrap().status,
        SandboxStatus::Paused
    );
    assert!(matches!(
        store
            .extend_sandbox(
                &sbx.id,
                &acct.id,
                now + Duration::minutes(90),
                90,
                10,
                &sandpit_store::Cause::default()
            )
            .await
            .unwrap(),
        ExtendOutcome::Extended(_)
    ));
    let due = store
        .expired_sandboxes("local", now + Duration::hours(3))
        .await
        .unwrap();
    assert_eq!(due.len(), 1);
    // Its pause time adds up across pauses.
    tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
    let running = store
        .resume_sandbox(&sbx.id, &sandpit_store::Cause::default())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(running.status, SandboxStatus::Running);
    assert_eq!(running.paused_at, None);
    assert!(running.paused_seconds >= 1, "{running:?}");
    assert_eq!(
        store
            .resume_sandbox(&sbx.id, &sandpit_store::Cause::default())
            .await
            .unwrap(),
        None,
        "once"
    );
    store
        .pause_sandbox(&sbx.id, &sandpit_store::Cause::default())
        .await
        .unwrap()
        .unwrap();
    let again = store.sandbox(&sbx.id).await.unwrap().unwrap();
    assert_eq!(
        again.paused_seconds_until(again.paused_at.unwrap() + Duration::seconds(5)),
        running.paused_seconds + 5
    );
    // The history says so (the extension while paused is an event of its
    // own, the sandbox still paused).
    let events: Vec<_> = store
        .events(&sbx.id)
        .await
        .unwrap()
        .into_iter()
        .map(|e| (e.status, e.kind))
        .collect();
    assert_eq!(
        events,
        [
            (SandboxStatus::Provisioning, "sandbox.created".to_string()),
            (SandboxStatus::Running, "sandbox.started".to_string()),
            (SandboxStatus::Paused, "sandbox.paused".to_string()),
            (SandboxStatus::Paused, "sandbox.extended".to_string()),
            (SandboxStatus::Running, "sandbox.resumed".to_string()),
            (SandboxStatus::Paused, "sandbox.paused".to_string()),
        ]
    );
    // It ends like any other, its pause time kept for the bill.
    let ended = store
        .finish_sandbox(
            &sbx.id,
            SandboxStatus::Deleted,
            "destroyed",
            OffsetDateTime::now_utc(),
            5,
            &sandpit_store::Cause::default(),
        )
        .await
        .unwrap()
        .unwrap();
    assert_eq!(ended.status, SandboxStatus::Deleted);
}

/// The metrics' tally: live sandboxes of one host by state and size, with
/// what they hold reserved; ended ones and other hosts' are not in it.
async fn the_tally_counts_a_hosts_live_sandboxes_and_their_reservations(store: Store) {
    let acct = store.create_account("alice", 20).await.unwrap();
    store.add_credit(&acct.id, 1_000_000, None).await.unwrap();
    assert!(store.sandbox_tally("local").await.unwrap().is_empty());
    let a = created(
        store
            .create_sandbox(sandbox(&acct.id, T0, 60, 90_000))
            .await
            .unwrap(),
    );
    let b = created(
        store
            .create_sandbox(sandbox(&acct.id, T0, 60, 90_000))
            .await
            .unwrap(),
    );
    let mut elsewhere = sandbox(&acct.id, T0, 60, 90_000);
    elsewhere.host = "other".into();
    created(store.create_sandbox(elsewhere).await.unwrap());
    store
        .set_status(
            &a.id,
            SandboxStatus::Running,
            None,
            &sandpit_store::Cause::default(),
        )
        .await
        .unwrap();
    let tally = |state: &str, count, reserved_micros| sandpit_store::SandboxTally {
        state: state.into(),
        size: "small".into(),
        count,
        reserved_micros,
    };
    assert_eq!(
        store.sandbox_tally("local").await.unwrap(),
        [
            tally("provisioning", 1, 90_000),
            tally("running", 1, 90_000)
        ]
    );
    // A paused sandbox is counted as paused (its row says `running`).
    store
        .pause_sandbox(&a.id, &sandpit_store::Cause::default())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        store.sandbox_tally("local").await.unwrap(),
        [tally("paused", 1, 90_000), tally("provisioning", 1, 90_000)]
    );
    store
        .finish_sandbox(
            &b.id,
            SandboxStatus::Deleted,
            "destroyed",
            T0,
            1_000,
            &sandpit_store::Cause::default(),
        )
        .await
        .unwrap();
    assert_eq!(
        store.sandbox_tally("local").await.unwrap(),
        [tally("paused", 1, 90_000)]
    );
}

async fn template_builds_layers_and_files_are_an_accounts_own_until_published(store: Store) {
    let acct = store.create_account("builder", 20).await.unwrap();
    let other = store.create_account("other", 20).await.unwrap();
    let building = |s: &[TemplateStatus]| s.to_vec();
    let first = store
        .create_template("tpl_1", &acct.id, ("web", "latest"), "small", "{}", 3)
        .await
        .unwrap();
    assert_eq!(first.status, TemplateStatus::Building);
    // Its log moves (NUL bytes made storable, its end kept when long).
    let long = format!("{}\0end", "x".repeat(sandpit_store::MAX_LOG_BYTES));
    store.template_progress("tpl_1", &long, 2).await.unwrap();
    let t = store.template("tpl_1").await.unwrap().unwrap();
    assert_eq!(t.log.len(), sandpit_store::MAX_LOG_BYTES);
    assert!(
        t.log.ends_with("\u{fffd}end"),
        "{}",
        &t.log[t.log.len() - 10..]
    );
    assert_eq!(t.cached_steps, 2);
    // Ready: the newest ready build is the template; the other account
    // sees nothing until it is published.
    let ready = store
        .finish_template("tpl_1", Ok(("snap_a", "node-a", 4096)), "done")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(ready.status, TemplateStatus::Ready);
    assert_eq!(ready.snapshot_id.as_deref(), Some("snap_a"));
    assert!(store
        .finish_template("tpl_1", Err("late"), "")
        .await
        .unwrap()
        .is_none());
    store
        .create_template("tpl_2", &acct.id, ("web", "latest"), "small", "{}", 3)
        .await
        .unwrap();
    let found = store
        .template_named(
            &acct.id,
            "web",
            "latest",
            &building(&[TemplateStatus::Ready]),
        )
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        found.id, "tpl_1",
        "a build in progress is not the template yet"
    );
    assert!(store
        .template_named(&other.id, "web", "latest", &[TemplateStatus::Ready])
        .await
        .unwrap()
        .is_none());
    assert!(store.templates_of(&other.id).await.unwrap().is_empty());
    assert_eq!(
        store
            .publish_template(&acct.id, "web", "latest", true)
            .await
            .unwrap(),
        2
    );
    let shared = store
        .template_named(&other.id, "web", "latest", &[TemplateStatus::Ready])
        .await
        .unwrap()
        .unwrap();
    assert_eq!(shared.id, "tpl_1");
    assert!(shared.public);
    // What the account holds: one name:tag (a ready build and one going),
    // the ready build's bytes; a build of web:latest again adds no name.
    assert_eq!(
        store.template_usage(&acct.id, ("api", "v1")).await.unwrap(),
        (1, 4096)
    );
    assert_eq!(
        store
            .template_usage(&acct.id, ("web", "latest"))
            .await
            .unwrap(),
        (0, 4096)
    );
    assert_eq!(
        store
            .template_usage(&other.id, ("api", "v1"))
            .await
            .unwrap(),
        (0, 0),
        "a published template is not the other account's to pay for"
    );
    // A build asked for before its steps (E2B's builder): waiting, with
    // its upload secret, until started; then building, the secret spent.
    let waiting = store
        .reserve_template("tpl_3", &acct.id, ("e2b", "v1"), "small", "secret")
        .await
        .unwrap();
    assert_eq!(waiting.status, TemplateStatus::Waiting);
    assert_eq!(waiting.upload_token.as_deref(), Some("secret"));
    let started = store
        .start_template("tpl_3", "{\"steps\":[]}", 4)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (started.status, started.steps, started.upload_token),
        (TemplateStatus::Building, 4, None)
    );
    assert!(
        store
            .start_template("tpl_3", "{}", 1)
            .await
            .unwrap()
            .is_none(),
        "a build starts once"
    );
    store
        .reserve_template("tpl_4", &acct.id, ("e2b", "v2"), "small", "s2")
        .await
        .unwrap();
    // A build whose server died stops moving and is failed; one left
    // waiting for its steps too, once its own (longer) time is past.
    let later = OffsetDateTime::now_utc() + Duration::minutes(5);
    assert_eq!(
        store
            .fail_stalled_templates(later, OffsetDateTime::now_utc() - Duration::hours(1))
            .await
            .unwrap(),
        2,
        "tpl_2 and tpl_3 stalled; tpl_4 may still get its steps"
    );
    let stalled = store.template("tpl_2").await.unwrap().unwrap();
    assert_eq!(stalled.status, TemplateStatus::Failed);
    assert!(stalled.error.unwrap().contains("went away"));
    assert_eq!(store.fail_stalled_templates(later, later).await.unwrap(), 1);
    let abandoned = store.template("tpl_4").await.unwrap().unwrap();
    assert_eq!(abandoned.status, TemplateStatus::Failed);
    assert!(abandoned.error.unwrap().contains("never started"));
    assert_eq!(abandoned.upload_token, None);
    // Retired beyond the newest one: deleted, its save no longer kept.
    let retired = store
        .retire_templates(&acct.id, "web", "latest", 1)
        .await
        .unwrap();
    assert_eq!(
        retired.iter().map(|t| t.id.as_str()).collect::<Vec<_>>(),
        ["tpl_1"]
    );
    // Layers: by key, on a host; a forced step replaces its save.
    let layer = sandpit_store::LayerRow {
        account_id: acct.id.clone(),
        layer_key: "k1".into(),
        host: "node-a".into(),
        save_id: "snap_l1".into(),
        size: "small".into(),
        bytes: 10,
    };
    assert_eq!(store.put_template_layer(&layer).await.unwrap(), None);
    let hosts = ["node-b".to_string(), "node-a".to_string()];
    assert_eq!(
        store
            .template_layer(&acct.id, "k1", &hosts)
            .await
            .unwrap()
            .unwrap()
            .save_id,
        "snap_l1"
    );
    assert!(store
        .template_layer(&other.id, "k1", &hosts)
        .await
        .unwrap()
        .is_none());
    assert!(store
        .template_layer(&acct.id, "k1", &hosts[..1])
        .await
        .unwrap()
        .is_none());
    let again = sandpit_store::LayerRow {
        save_id: "snap_l2".into(),
        ..layer
    };
    assert_eq!(
        store.put_template_layer(&again).await.unwrap().as_deref(),
        Some("snap_l1")
    );
    let mut kept = store.template_saves_on("node-a").await.unwrap();
    kept.sort();
    assert_eq!(kept, ["snap_l2"], "the retired build's save is not kept");
    // A copy of the layer on another host (a node that fetched it): found
    // by its save, listed with the original, kept by its host's sweep, and
    // forgotten alone.
    let copy = sandpit_store::LayerRow {
        host: "node-b".into(),
        save_id: "snap_copy".into(),
        ..again.clone()
    };
    assert_eq!(store.put_template_layer(&copy).await.unwrap(), None);
    assert_eq!(
        store.template_layer_of("snap_copy").await.unwrap(),
        Some(copy.clone())
    );
    assert_eq!(store.template_layer_of("snap_none").await.unwrap(), None);
    let mut copies = store.template_layer_copies(&acct.id, "k1").await.unwrap();
    copies.sort_by(|a, b| a.host.cmp(&b.host));
    assert_eq!(copies, [again.clone(), copy.clone()]);
    assert!(store
        .template_layer_copies(&other.id, "k1")
        .await
        .unwrap()
        .is_empty());
    assert_eq!(
        store.template_saves_on("node-b").await.unwrap(),
        ["snap_copy"]
    );
    store.forget_template_layer("snap_copy").await.unwrap();
    assert!(store.template_saves_on("node-b").await.unwrap().is_empty());
    assert_eq!(
        store.template_layer_copies(&acct.id, "k1").await.unwrap(),
        std::slice::from_ref(&again)
    );
    // Retired and failed builds hold nothing.
    assert_eq!(
        store
            .template_usage(&acct.id, ("other", "latest"))
            .await
            .unwrap()
            .0,
        0,
        "tpl_1 was retired, the rest failed"
    );
    // The cache: a layer unused for long goes, unless a template starts
    // from its save.
    let soon = OffsetDateTime::now_utc() + Duration::minutes(1);
    assert_eq!(store.drop_stale_template_layers(soon).await.unwrap(), 1);
    assert!(store.template_saves_on("node-a").await.unwrap().is_empty());
    // A sandbox names the build it started from, and its commands' directory.
    store.add_credit(&acct.id, 1_000_000, None).await.unwrap();
    let sbx = created(
        store
            .create_sandbox(NewSandbox {
                template_id: Some("tpl_1".into()),
                workdir: Some("/srv/site".into()),
                ..sandbox(&acct.id, OffsetDateTime::now_utc(), 10, 0)
            })
            .await
            .unwrap(),
    );
    let read = store.sandbox(&sbx.id).await.unwrap().unwrap();
    assert_eq!(read.template_id.as_deref(), Some("tpl_1"));
    assert_eq!(read.workdir.as_deref(), Some("/srv/site"));
    // Files: an account's own, stored once, byte for byte.
    let tar: Vec<u8> = (0..=255u8).cycle().take(100_000).collect();
    store
        .put_template_files(&acct.id, "ab", &tar)
        .await
        .unwrap();
    store
        .put_template_files(&acct.id, "ab", &tar)
        .await
        .unwrap();
    assert_eq!(
        store.template_files(&acct.id, "ab").await.unwrap().unwrap(),
        tar
    );
    assert!(store.has_template_files(&acct.id, "ab").await.unwrap());
    assert!(!store.has_template_files(&other.id, "ab").await.unwrap());
    assert!(store
        .template_files(&other.id, "ab")
        .await
        .unwrap()
        .is_none());
}

async fn secrets_are_an_accounts_own_and_sandboxes_keep_their_placeholders(store: Store) {
    let acct = store.create_account("keeper", 20).await.unwrap();
    let other = store.create_account("other", 20).await.unwrap();
    store.add_credit(&acct.id, 1_000_000, None).await.unwrap();
    let secret = |account_id: &str, name: &str, sealed: &[u8]| NewSecret {
        account_id: account_id.to_string(),
        name: name.to_string(),
        hosts: vec!["api.openai.com".into(), "*.example.com".into()],
        header: "Authorization".into(),
        format: "Bearer {value}".into(),
        sealed_value: sealed.to_vec(),
    };
    let first = store
        .put_secret(&secret(&acct.id, "OPENAI_API_KEY", b"sealed-1"))
        .await
        .unwrap();
    assert_eq!(first.hosts, ["api.openai.com", "*.example.com"]);
    assert_eq!(first.created_at, first.updated_at);
    assert_eq!(first.last_used_at, None);
    store
        .put_secret(&secret(&acct.id, "ANTHROPIC_API_KEY", b"sealed-a"))
        .await
        .unwrap();
    store
        .put_secret(&secret(&other.id, "OPENAI_API_KEY", b"theirs"))
        .await
        .unwrap();
    // A use is kept when it is the latest, for that account's secret only.
    let (earlier, later) = (
        time::macros::datetime!(2026-12-07 08:00:00 UTC),
        time::macros::datetime!(2026-12-07 08:05:00 UTC),
    );
    for at in [later, earlier] {
        store
            .note_secret_used(&acct.id, "OPENAI_API_KEY", at)
            .await
            .unwrap();
    }
    let used = |account_id: String| {
        let store = store.clone();
        async move {
            store
                .secret(&account_id, "OPENAI_API_KEY")
                .await
                .unwrap()
                .unwrap()
                .last_used_at
        }
    };
    assert_eq!(used(acct.id.clone()).await, Some(later));
    assert_eq!(used(other.id.clone()).await, None);

    // Put again: replaced, its creation kept.
    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    let replaced = store
        .put_secret(&NewSecret {
            hosts: vec!["api.openai.com".into()],
            format: "{value}".into(),
            header: "x-api-key".into(),
            ..secret(&acct.id, "OPENAI_API_KEY", b"sealed-2")
        })
        .await
        .unwrap();
    assert_eq!(replaced.created_at, first.created_at);
    assert!(replaced.updated_at > first.updated_at);
    assert_eq!(
        (replaced.header.as_str(), replaced.format.as_str()),
        ("x-api-key", "{value}")
    );
    // Its id stays, its version counts the values.
    assert!(first.id.starts_with("sec_"), "{}", first.id);
    assert_eq!(
        (replaced.id.as_str(), first.version),
        (first.id.as_str(), 1)
    );
    assert_eq!(replaced.version, 2);
    assert_eq!(replaced.metadata, "{}");

    // Listed by name, the account's own; read with values by name.
    let names: Vec<String> = store
        .list_secrets(&acct.id)
        .await
        .unwrap()
        .into_iter()
        .map(|s| s.name)
        .collect();
    assert_eq!(names, ["ANTHROPIC_API_KEY", "OPENAI_API_KEY"]);
    let named = store
        .secrets_named(&acct.id, &["OPENAI_API_KEY".into(), "MISSING".into()])
        .await
        .unwrap();
    assert_eq!(named.len(), 1);
    assert_eq!(named[0].0, replaced);
    assert_eq!(named[0].1, b"sealed-2");
    assert!(store.secrets_named(&acct.id, &[]).await.unwrap().is_empty());

    // A sandbox's broker: its CA and placeholders, read back, found by the
    // secrets it uses while it lives.
    let sbx = created(
        store
            .create_sandbox(sandbox(&acct.id, T0, 60, 1000))
            .await
            .unwrap(),
    );
    assert_eq!(store.sandbox_broker(&sbx.id).await.unwrap(), None);
    let broker = SandboxBroker {
        ca_cert: "-----BEGIN CERTIFICATE-----".into(),
        ca_key_sealed: b"sealed-ca".to_vec(),
        secrets: vec![("OPENAI_API_KEY".into(), "sandpit-secret-0123".into())],
        rules: None,
    };
    store.set_sandbox_broker(&sbx.id, &broker).await.unwrap();
    assert_eq!(
        store.sandbox_broker(&sbx.id).await.unwrap(),
        Some(broker.clone())
    );
    assert!(matches!(
        store.set_sandbox_broker("sbx_nothere", &broker).await,
        Err(StoreError::NotFound(_))
    ));
    assert_eq!(
        store
            .live_sandboxes_using_secret(&acct.id, "OPENAI_API_KEY")
            .await
            .unwrap(),
        vec![sbx.id.clone()]
    );
    assert!(store
        .live_sandboxes_using_secret(&other.id, "OPENAI_API_KEY")
        .await
        .unwrap()
        .is_empty());
    assert_eq!(
        store.live_brokered_sandboxes("local").await.unwrap(),
        vec![sbx.id.clone()]
    );
    assert!(store
        .live_brokered_sandboxes("elsewhere")
        .await
        .unwrap()
        .is_empty());

    // Deleted: gone from the account (the other's stays), true once; the
    // sandbox keeps its placeholder.
    let deleted = store
        .delete_secret(&acct.id, "OPENAI_API_KEY")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(deleted.name, "OPENAI_API_KEY");
    assert_eq!(
        store
            .delete_secret(&acct.id, "OPENAI_API_KEY")
            .await
            .unwrap(),
        None
    );
    assert_eq!(store.list_secrets(&acct.id).await.unwrap().len(), 1);
    assert_eq!(store.list_secrets(&other.id).await.unwrap().len(), 1);
    assert_eq!(store.sandbox_broker(&sbx.id).await.unwrap(), Some(broker));

    // E2B's: created once (a second create of the name is refused), found
    // by name and by id, given a new value (its hosts kept, its metadata
    // replaced when given).
    let e2b = NewSecret {
        hosts: vec![],
        ..secret(&acct.id, "my-key", b"sealed-e")
    };
    let made = store
        .create_secret(&e2b, r#"{"team":"a"}"#)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (made.version, made.metadata.as_str()),
        (1, r#"{"team":"a"}"#)
    );
    assert!(made.hosts.is_empty());
    assert_eq!(store.create_secret(&e2b, "{}").await.unwrap(), None);
    assert_eq!(
        store.secret(&acct.id, "my-key").await.unwrap(),
        Some(made.clone())
    );
    assert_eq!(
        store.secret_by_id(&acct.id, &made.id).await.unwrap(),
        Some(made.clone())
    );
    assert_eq!(store.secret_by_id(&other.id, &made.id).await.unwrap(), None);
    let change = |metadata: Option<&str>| sandpit_store::SecretValue {
        sealed_value: b"sealed-e2".to_vec(),
        metadata: metadata.map(str::to_string),
    };
    let two = store
        .update_secret_value(&acct.id, "my-key", &change(None))
        .await
        .unwrap()
        .unwrap();
    assert_eq!((two.version, two.metadata.as_str()), (2, r#"{"team":"a"}"#));
    let three = store
        .update_secret_value(&acct.id, "my-key", &change(Some("{}")))
        .await
        .unwrap()
        .unwrap();
    assert_eq!((three.version, three.metadata.as_str()), (3, "{}"));
    assert_eq!(three.id, made.id);
    assert_eq!(
        store
            .update_secret_value(&acct.id, "nothere", &change(None))
            .await
            .unwrap(),
        None
    );

    // A sandbox's network rules: kept with its broker, replaced while it
    // lives; one with rules may use any of the account's secrets.
    assert!(store
        .set_sandbox_rules(&sbx.id, Some(r#"{"a.com":{}}"#))
        .await
        .unwrap());
    let with_rules = store.sandbox_broker(&sbx.id).await.unwrap().unwrap();
    assert_eq!(with_rules.rules.as_deref(), Some(r#"{"a.com":{}}"#));
    assert_eq!(
        store
            .live_sandboxes_using_secret(&acct.id, "my-key")
            .await
            .unwrap(),
        vec![sbx.id.clone()]
    );

    // An ended sandbox's egress changes no more.
    store
        .finish_sandbox(
            &sbx.id,
            SandboxStatus::Deleted,
            "destroyed",
            T0,
            0,
            &sandpit_store::Cause::default(),
        )
        .await
        .unwrap();
    assert!(store
        .live_brokered_sandboxes("local")
        .await
        .unwrap()
        .is_empty());
}

const GIB: u64 = 1024 * 1024 * 1024;

fn volume(account_id: &str, name: &str, size_bytes: u64) -> NewVolume {
    NewVolume {
        id: new_id("vol"),
        account_id: account_id.to_string(),
        name: name.to_string(),
        size_bytes,
        host: "local".into(),
        max_count: 3,
        max_bytes: 30 * GIB,
        idempotency: None,
    }
}

/// A volume made `ready`, as its node's file would leave it.
async fn ready_volume(store: &Store, account_id: &str, name: &str) -> sandpit_store::VolumeRow {
    let new = volume(account_id, name, GIB);
    match store.create_volume(&new).await.unwrap() {
        VolumeCreated::Created(row) => assert_eq!(row.status, VolumeStatus::Creating),
        other => panic!("expected Created, got {other:?}"),
    }
    store.volume_ready(&new.id, GIB).await.unwrap().unwrap()
}

fn mount(sandbox_id: &str, volume_id: &str, path: &str, read_only: bool) -> VolumeMountRow {
    VolumeMountRow {
        sandbox_id: sandbox_id.to_string(),
        volume_id: volume_id.to_string(),
        path: path.to_string(),
        read_only,
    }
}

async fn volumes_are_an_accounts_own_by_name_within_its_quota(store: Store) {
    let acct = store.create_account("owner", 20).await.unwrap();
    let other = store.create_account("other", 20).await.unwrap();
    let data = ready_volume(&store, &acct.id, "data").await;
    assert_eq!((data.size_bytes, data.status), (GIB, VolumeStatus::Ready));
    // A name is the account's own: taken for it, free for another.
    assert_eq!(
        store
            .create_volume(&volume(&acct.id, "data", GIB))
            .await
            .unwrap(),
        VolumeCreated::NameTaken
    );
    ready_volume(&store, &other.id, "data").await;
    assert_eq!(
        store.volume_named(&acct.id, "data").await.unwrap(),
        Some(data.clone())
    );
    assert_eq!(store.volume(&other.id, &data.id).await.unwrap(), None);
    // Bytes: 1 GiB held, 29 GiB more is past 30.
    assert_eq!(
        store
            .create_volume(&volume(&acct.id, "big", 30 * GIB))
            .await
            .unwrap(),
        VolumeCreated::OverBytes {
            used: GIB,
            limit: 30 * GIB
        }
    );
    // Count: three at most; a volume whose file was never made is
    // forgotten and frees its place and name.
    let failed = volume(&acct.id, "cache", GIB);
    assert!(matches!(
        store.create_volume(&failed).await.unwrap(),
        VolumeCreated::Created(_)
    ));
    store.forget_volume(&failed.id).await.unwrap();
    ready_volume(&store, &acct.id, "cache").await;
    ready_volume(&store, &acct.id, "models").await;
    assert_eq!(
        store
            .create_volume(&volume(&acct.id, "more", GIB))
            .await
            .unwrap(),
        VolumeCreated::TooMany { count: 3, limit: 3 }
    );
    let names: Vec<String> = store
        .list_volumes(&acct.id)
        .await
        .unwrap()
        .into_iter()
        .map(|v| v.name)
        .collect();
    assert_eq!(names, ["cache", "data", "models"]);
    // Deleted: its name is free, its row kept for the usage report.
    let VolumeChange::Changed(gone) = store.delete_volume(&acct.id, &data.id).await.unwrap() else {
        panic!("not deleted");
    };
    assert_eq!(gone.status, VolumeStatus::Deleted);
    assert!(gone.deleted_at.is_some());
    assert_eq!(store.volume_named(&acct.id, "data").await.unwrap(), None);
    // Whoever's, by id: what a node's sweep of its files asks.
    assert_eq!(
        store.volume_by_id(&gone.id).await.unwrap(),
        Some(gone.clone())
    );
    assert_eq!(store.volume_by_id("vol_none").await.unwrap(), None);
    ready_volume(&store, &acct.id, "data").await;
    let billed = store
        .volumes_since(&acct.id, gone.created_at - Duration::minutes(1))
        .await
        .unwrap();
    assert_eq!(billed.len(), 4, "{billed:?}");
    assert!(billed.iter().any(|v| v.id == gone.id));
    assert_eq!(
        store.delete_volume(&other.id, &gone.id).await.unwrap(),
        VolumeChange::Missing
    );
    // A key replays its create (as the volume is now), whatever the
    // quota; another request under it is a conflict; another account's
    // key is its own.
    let keyed = |name: &str, hash: &str| NewVolume {
        max_count: 10,
        idempotency: Some(("key-1".into(), hash.into())),
        ..volume(&other.id, name, GIB)
    };
    let VolumeCreated::Created(first) = store.create_volume(&keyed("k", "h1")).await.unwrap()
    else {
        panic!("not created");
    };
    assert_eq!(
        store.create_volume(&keyed("k", "h1")).await.unwrap(),
        VolumeCreated::Replay(first.clone())
    );
    assert_eq!(
        store.create_volume(&keyed("k2", "h2")).await.unwrap(),
        VolumeCreated::IdempotencyConflict
    );
    let mine = NewVolume {
        idempotency: Some(("key-1".into(), "h1".into())),
        ..volume(&acct.id, "mine", GIB)
    };
    assert!(matches!(
        store.create_volume(&mine).await.unwrap(),
        VolumeCreated::Created(_) | VolumeCreated::TooMany { .. }
    ));
    // A create whose file was never made frees its key.
    store.forget_volume(&first.id).await.unwrap();
    assert!(matches!(
        store.create_volume(&keyed("k", "h1")).await.unwrap(),
        VolumeCreated::Created(_)
    ));
}

async fn a_volume_is_held_read_write_by_one_live_sandbox_at_a_time(store: Store) {
    let acct = store.create_account("racer", 20).await.unwrap();
    store.add_credit(&acct.id, 10_000_000, None).await.unwrap();
    let vol = ready_volume(&store, &acct.id, "shared").await;
    // Many sandboxes ask for it read-write at once: exactly one gets it.
    let mut ids = Vec::new();
    for _ in 0..8 {
        let row = created(
            store
                .create_sandbox(sandbox(&acct.id, T0, 60, 0))
                .await
                .unwrap(),
        );
        ids.push(row.id);
    }
    let tasks: Vec<_> = ids
        .iter()
        .map(|id| {
            let (store, acct, vol, id) =
                (store.clone(), acct.id.clone(), vol.id.clone(), id.clone());
            tokio::spawn(async move {
                let held = store
                    .hold_volumes(&acct, &id, &[mount(&id, &vol, "/data", false)])
                    .await
                    .unwrap();
                (id, held)
            })
        })
        .collect();
    let mut winners = Vec::new();
    for task in tasks {
        let (id, held) = task.await.unwrap();
        match held {
            VolumesHeld::Held => winners.push(id),
            VolumesHeld::HeldReadWrite { volume_id, .. } => assert_eq!(volume_id, vol.id),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(winners.len(), 1, "{winners:?}");
    let writer = winners[0].clone();
    // Read-only mounts beside it, any number; a refusal names the writer.
    let reader = ids.iter().find(|id| **id != writer).unwrap().clone();
    assert_eq!(
        store
            .hold_volumes(&acct.id, &reader, &[mount(&reader, &vol.id, "/ro", true)])
            .await
            .unwrap(),
        VolumesHeld::Held
    );
    let third = ids.iter().rfind(|id| **id != writer).unwrap().clone();
    assert_eq!(
        store
            .hold_volumes(&acct.id, &third, &[mount(&third, &vol.id, "/w", false)])
            .await
            .unwrap(),
        VolumesHeld::HeldReadWrite {
            volume_id: vol.id.clone(),
            sandbox_id: writer.clone()
        }
    );
    assert_eq!(
        store.sandbox_volume_mounts(&reader).await.unwrap(),
        [mount(&reader, &vol.id, "/ro", true)]
    );
    let holders = store.volume_holders(&vol.id).await.unwrap();
    assert_eq!(holders.len(), 2, "{holders:?}");
    // Another account's sandbox cannot name it; nothing is recorded.
    let stranger = store.create_account("stranger", 20).await.unwrap();
    assert_eq!(
        store
            .hold_volumes(&stranger.id, &third, &[mount(&third, &vol.id, "/x", true)])
            .await
            .unwrap(),
        VolumesHeld::Missing {
            volume_id: vol.id.clone()
        }
    );
    // The writer ends: the volume is free for another writer.
    store
        .finish_sandbox(
            &writer,
            SandboxStatus::Deleted,
            "destroyed",
            T0,
            0,
            &sandpit_store::Cause::default(),
        )
        .await
        .unwrap();
    assert_eq!(
        store
            .hold_volumes(&acct.id, &third, &[mount(&third, &vol.id, "/w", false)])
            .await
            .unwrap(),
        VolumesHeld::Held
    );
}

async fn a_held_volume_is_neither_resized_nor_deleted(store: Store) {
    let acct = store.create_account("holder", 20).await.unwrap();
    store.add_credit(&acct.id, 10_000_000, None).await.unwrap();
    let vol = ready_volume(&store, &acct.id, "kept").await;
    let sbx = created(
        store
            .create_sandbox(sandbox(&acct.id, T0, 60, 0))
            .await
            .unwrap(),
    );
    store
        .hold_volumes(&acct.id, &sbx.id, &[mount(&sbx.id, &vol.id, "/data", true)])
        .await
        .unwrap();
    let held = VolumeChange::Held(vec![sbx.id.clone()]);
    assert_eq!(store.delete_volume(&acct.id, &vol.id).await.unwrap(), held);
    assert_eq!(
        store
            .begin_volume_resize(&acct.id, &vol.id, 2 * GIB, 30 * GIB)
            .await
            .unwrap(),
        held
    );
    store
        .finish_sandbox(
            &sbx.id,
            SandboxStatus::Failed,
            "test",
            T0,
            0,
            &sandpit_store::Cause::default(),
        )
        .await
        .unwrap();
    // Free: a resize past the account's bytes is refused, one within
    // them marks it resizing, which no sandbox can take, then ready.
    assert_eq!(
        store
            .begin_volume_resize(&acct.id, &vol.id, 31 * GIB, 30 * GIB)
            .await
            .unwrap(),
        VolumeChange::OverBytes {
            used: GIB,
            limit: 30 * GIB
        }
    );
    let VolumeChange::Changed(resizing) = store
        .begin_volume_resize(&acct.id, &vol.id, 2 * GIB, 30 * GIB)
        .await
        .unwrap()
    else {
        panic!("not resizing");
    };
    assert_eq!(resizing.status, VolumeStatus::Resizing);
    let next = created(
        store
            .create_sandbox(sandbox(&acct.id, T0, 60, 0))
            .await
            .unwrap(),
    );
    assert_eq!(
        store
            .hold_volumes(&acct.id, &next.id, &[mount(&next.id, &vol.id, "/d", true)])
            .await
            .unwrap(),
        VolumesHeld::NotReady {
            volume_id: vol.id.clone(),
            status: VolumeStatus::Resizing
        }
    );
    assert_eq!(
        store.delete_volume(&acct.id, &vol.id).await.unwrap(),
        VolumeChange::Busy(VolumeStatus::Resizing)
    );
    let grown = store.volume_ready(&vol.id, 2 * GIB).await.unwrap().unwrap();
    assert_eq!(
        (grown.size_bytes, grown.status),
        (2 * GIB, VolumeStatus::Ready)
    );
    // A failed resize leaves it ready at its size.
    store
        .begin_volume_resize(&acct.id, &vol.id, 3 * GIB, 30 * GIB)
        .await
        .unwrap();
    store.volume_resize_failed(&vol.id).await.unwrap();
    let kept = store.volume(&acct.id, &vol.id).await.unwrap().unwrap();
    assert_eq!(
        (kept.size_bytes, kept.status),
        (2 * GIB, VolumeStatus::Ready)
    );
    // Stuck: creating or resizing since before a time, and only those.
    let making = volume(&acct.id, "making", GIB);
    store.create_volume(&making).await.unwrap();
    store
        .begin_volume_resize(&acct.id, &vol.id, 3 * GIB, 30 * GIB)
        .await
        .unwrap();
    let later = OffsetDateTime::now_utc() + Duration::minutes(1);
    let stuck: Vec<String> = store
        .stuck_volumes(later)
        .await
        .unwrap()
        .into_iter()
        .map(|v| v.id)
        .collect();
    let mut want = vec![making.id.clone(), vol.id.clone()];
    want.sort();
    assert_eq!(stuck, want);
    let earlier = OffsetDateTime::now_utc() - Duration::minutes(1);
    assert!(store.stuck_volumes(earlier).await.unwrap().is_empty());
    store.forget_volume(&making.id).await.unwrap();
    store.volume_resize_failed(&vol.id).await.unwrap();
    assert!(store.stuck_volumes(later).await.unwrap().is_empty());
    assert!(matches!(
        store.delete_volume(&acct.id, &vol.id).await.unwrap(),
        VolumeChange::Changed(_)
    ));
}

/// Every change of a sandbox's life is an event of its account's log, with
/// its kind, actor and detail, in order; each webhook that wants it gets a
/// delivery row in the same transaction; a worker takes a sandbox's
/// deliveries to one webhook one after another, retries wait their time,
/// a webhook's delete drops what it had pending, and the purge forgets.
async fn events_are_logged_in_order_and_fan_out_to_webhooks_in_order(store: Store) {
    use sandpit_store::{AttemptOutcome, Cause, DeliveryStatus};
    let alice = store.create_account("alice", 100).await.unwrap();
    let bob = store.create_account("bob", 100).await.unwrap();
    store.add_credit(&alice.id, 1_000_000, None).await.unwrap();
    let all = store
        .create_webhook(
            "wh_all",
            &alice.id,
            "http://a.example/",
            &[],
            None,
            "whsec_x",
        )
        .await
        .unwrap();
    assert!(all.events.is_empty());
    let kills = store
        .create_webhook(
            "wh_kills",
            &alice.id,
            "http://b.example/",
            &["sandbox.killed".to_string()],
            Some("ends only"),
            "whsec_y",
        )
        .await
        .unwrap();
    assert_eq!(kills.events, ["sandbox.killed"]);

    let now = OffsetDateTime::now_utc();
    let s = created(
        store
            .create_sandbox(NewSandbox {
                start_from: Some("pool".into()),
                cause: Cause::by("key sp_alice").with("template", "web"),
                ..sandbox(&alice.id, now, 30, 0)
            })
            .await
            .unwrap(),
    );
    let by = |who: &str| Cause::by(who);
    store
        .set_status(&s.id, SandboxStatus::Running, None, &by("node a"))
        .await
        .unwrap();
    store
        .pause_sandbox(&s.id, &by("the idle sweep"))
        .await
        .unwrap()
        .unwrap();
    store
        .resume_sandbox(&s.id, &by("key sp_alice"))
        .await
        .unwrap()
        .unwrap();
    let extended = store
        .extend_sandbox(
            &s.id,
            &alice.id,
            now + Duration::minutes(45),
            45,
            0,
            &by("dashboard"),
        )
        .await
        .unwrap();
    assert!(matches!(extended, ExtendOutcome::Extended(_)));
    store
        .finish_sandbox(
            &s.id,
            SandboxStatus::Deleted,
            "destroyed",
            now,
            0,
            &by("key sp_alice"),
        )
        .await
        .unwrap()
        .unwrap();
    // Nothing is added to an ended sandbox's log.
    assert!(!store
        .record_event(&s.id, "sandbox.noted", Some("late"), &by("x"))
        .await
        .unwrap());

    let log = store.account_events(&alice.id, 0, 100, None).await.unwrap();
    let kinds: Vec<&str> = log.iter().map(|e| e.kind.as_str()).collect();
    assert_eq!(
        kinds,
        [
            "sandbox.created",
            "sandbox.started",
            "sandbox.paused",
            "sandbox.resumed",
            "sandbox.extended",
            "sandbox.killed"
        ]
    );
    let actors: Vec<&str> = log.iter().map(|e| e.actor.as_str()).collect();
    assert_eq!(
        actors,
        [
            "key sp_alice",
            "node a",
            "the idle sweep",
            "key sp_alice",
            "dashboard",
            "key sp_alice"
        ]
    );
    assert_eq!(log[0].detail["template"], "web");
    assert_eq!(log[1].detail["from"], "pool", "{:?}", log[1].detail);
    assert_eq!(log[4].detail["timeout_minutes"], 45);
    assert_eq!(log[5].reason.as_deref(), Some("destroyed"));
    assert_eq!(log[2].status, SandboxStatus::Paused);
    assert!(log
        .iter()
        .all(|e| e.size == "small" && e.sandbox_id == s.id));
    let seqs: Vec<i64> = log.iter().map(|e| e.seq.unwrap()).collect();
    assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{seqs:?}");
    // A cursor lists what came after it; another account sees nothing.
    let rest = store
        .account_events(&alice.id, seqs[2], 100, None)
        .await
        .unwrap();
    assert_eq!(rest.len(), 3);
    assert_eq!(rest[0].kind, "sandbox.resumed");
    assert!(store
        .account_events(&bob.id, 0, 100, None)
        .await
        .unwrap()
        .is_empty());
    assert_eq!(
        store
            .account_events(&alice.id, 0, 100, Some("sbx_other"))
            .await
            .unwrap()
            .len(),
        0
    );

    // Deliveries: six for the webhook of all, one for the other.
    let later = now + Duration::seconds(1);
    let lease = later + Duration::seconds(60);
    let due = store.claim_deliveries(later, lease, 100).await.unwrap();
    let mut taken: Vec<(String, String)> = due
        .iter()
        .map(|d| (d.webhook_id.clone(), d.event.kind.clone()))
        .collect();
    taken.sort();
    assert_eq!(
        taken,
        [
            ("wh_all".to_string(), "sandbox.created".to_string()),
            ("wh_kills".to_string(), "sandbox.killed".to_string())
        ],
        "one at a time per sandbox and webhook"
    );
    assert!(
        store
            .claim_deliveries(later, lease, 100)
            .await
            .unwrap()
            .is_empty(),
        "leased"
    );
    let first = due.iter().find(|d| d.webhook_id == "wh_all").unwrap();
    assert_eq!(first.url, "http://a.example/");
    assert_eq!(first.secret, "whsec_x");
    assert!(store
        .record_attempt(
            "wh_all",
            first.event.id,
            &first.lease_until,
            later,
            Some(200),
            None,
            12,
            &AttemptOutcome::Delivered,
        )
        .await
        .unwrap());
    // The next of the sandbox's events is due now; it fails and waits.
    let due = store.claim_deliveries(later, lease, 100).await.unwrap();
    assert_eq!(due.len(), 1);
    assert_eq!(due[0].event.kind, "sandbox.started");
    let retry_at = later + Duration::seconds(30);
    store
        .record_attempt(
            "wh_all",
            due[0].event.id,
            &due[0].lease_until,
            later,
            Some(503),
            Some("the receiver answered 503"),
            5,
            &AttemptOutcome::RetryAt(retry_at),
        )
        .await
        .unwrap();
    assert!(store
        .claim_deliveries(later, lease, 100)
        .await
        .unwrap()
        .is_empty());
    let due = store
        .claim_deliveries(retry_at, retry_at + Duration::seconds(60), 100)
        .await
        .unwrap();
    assert_eq!(due.len(), 1);
    assert_eq!(due[0].event.kind, "sandbox.started");
    assert_eq!(due[0].attempts, 1);
    // A stale lease records its attempt but changes nothing.
    assert!(!store
        .record_attempt(
            "wh_all",
            due[0].event.id,
            "1999-01-01",
            retry_at,
            None,
            Some("late"),
            1,
            &AttemptOutcome::Delivered,
        )
        .await
        .unwrap());
    let started = store
        .delivery("wh_all", due[0].event.id)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(started.status, DeliveryStatus::Pending);
    assert_eq!(started.kind, "sandbox.started");
    let attempts = store.attempts("wh_all", due[0].event.id).await.unwrap();
    assert_eq!(attempts.len(), 2);
    assert_eq!(attempts[0].status_code, Some(503));
    assert_eq!(attempts[1].error.as_deref(), Some("late"));
    // Given up: the next one goes.
    store
        .record_attempt(
            "wh_all",
            due[0].event.id,
            &due[0].lease_until,
            retry_at,
            None,
            Some("refused"),
            1,
            &AttemptOutcome::GaveUp,
        )
        .await
        .unwrap();
    let due = store
        .claim_deliveries(retry_at, retry_at + Duration::seconds(60), 100)
        .await
        .unwrap();
    assert_eq!(due.len(), 1);
    assert_eq!(due[0].event.kind, "sandbox.paused");
    let listed = store.deliveries("wh_all", 100, None).await.unwrap();
    assert_eq!(listed.len(), 6);
    assert_eq!(listed[0].kind, "sandbox.killed", "newest first");
    let counts = store
        .webhook_of(&alice.id, "wh_all")
        .await
        .unwrap()
        .unwrap()
        .counts;
    assert_eq!(counts, [4, 1, 1]);
    // Redelivered: pending again, due now, its attempts kept.
    let again = store
        .redeliver("wh_all", first.event.id)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(again.status, DeliveryStatus::Pending);
    assert_eq!(again.attempts, 0);
    assert_eq!(
        store
            .attempts("wh_all", first.event.id)
            .await
            .unwrap()
            .len(),
        1
    );

    // Deleted: its pending deliveries go, and it gets no more.
    assert!(store
        .delete_webhook(&bob.id, "wh_all")
        .await
        .unwrap()
        .is_none());
    store
        .delete_webhook(&alice.id, "wh_all")
        .await
        .unwrap()
        .unwrap();
    assert!(store
        .webhook_of(&alice.id, "wh_all")
        .await
        .unwrap()
        .is_none());
    assert_eq!(store.webhooks(&alice.id).await.unwrap().len(), 1);
    let left = store.deliveries("wh_all", 100, None).await.unwrap();
    assert!(
        left.iter().all(|d| d.status != DeliveryStatus::Pending),
        "{left:?}"
    );
    let t = created(
        store
            .create_sandbox(sandbox(&alice.id, now, 30, 0))
            .await
            .unwrap(),
    );
    assert_eq!(
        store.deliveries("wh_all", 100, None).await.unwrap().len(),
        left.len()
    );
    store
        .finish_sandbox(
            &t.id,
            SandboxStatus::Deleted,
            "expired",
            now,
            0,
            &by("the expiry"),
        )
        .await
        .unwrap();
    let log = store
        .account_events(&alice.id, 0, 100, Some(&t.id))
        .await
        .unwrap();
    assert_eq!(log.last().unwrap().kind, "sandbox.expired");
    assert_eq!(
        store.deliveries("wh_kills", 100, None).await.unwrap().len(),
        1
    );

    // The purge forgets events and their deliveries.
    let gone = store
        .purge_events(OffsetDateTime::now_utc() + Duration::days(1))
        .await
        .unwrap();
    assert!(gone >= 8, "{gone}");
    assert!(store
        .account_events(&alice.id, 0, 100, None)
        .await
        .unwrap()
        .is_empty());
    assert!(store
        .deliveries("wh_kills", 100, None)
        .await
        .unwrap()
        .is_empty());
}

/// Writers add events to many sandboxes at once while a reader pages the
/// account's log by cursor: the reader sees each event exactly once, none
/// passed by a cursor that moved beyond it before it committed.
async fn a_reader_paging_the_log_while_others_write_sees_every_event_once(store: Store) {
    use sandpit_store::Cause;
    let acct = store.create_account("alice", 100).await.unwrap();
    store.add_credit(&acct.id, 1_000_000, None).await.unwrap();
    let mut ids = Vec::new();
    for _ in 0..6 {
        let s = created(
            store
                .create_sandbox(sandbox(&acct.id, OffsetDateTime::now_utc(), 30, 0))
                .await
                .unwrap(),
        );
        ids.push(s.id);
    }
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = {
        let (store, account, done) = (store.clone(), acct.id.clone(), done.clone());
        tokio::spawn(async move {
            let (mut seen, mut after) = (Vec::new(), 0);
            loop {
                let finished = done.load(std::sync::atomic::Ordering::SeqCst);
                let page = store
                    .account_events(&account, after, 7, None)
                    .await
                    .unwrap();
                if let Some(last) = page.last() {
                    after = last.seq.unwrap();
                }
                let empty = page.is_empty();
                seen.extend(page.into_iter().map(|e| e.id));
                if finished && empty {
                    return seen;
                }
            }
        })
    };
    let mut writers = tokio::task::JoinSet::new();
    for id in ids.clone() {
        let store = store.clone();
        writers.spawn(async move {
            for n in 0..15 {
                let reason = format!("note {n}");
                assert!(store
                    .record_event(&id, "sandbox.noted", Some(&reason), &Cause::by("test"))
                    .await
                    .unwrap());
            }
        });
    }
    while let Some(w) = writers.join_next().await {
        w.unwrap();
    }
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    let seen = reader.await.unwrap();
    let all: Vec<i64> = store
        .account_events(&acct.id, 0, 500, None)
        .await
        .unwrap()
        .iter()
        .map(|e| e.id)
        .collect();
    assert_eq!(all.len(), 6 + 6 * 15);
    let unique: HashSet<i64> = seen.iter().copied().collect();
    assert_eq!(unique.len(), seen.len(), "an event was read twice");
    assert_eq!(
        unique,
        all.iter().copied().collect::<HashSet<_>>(),
        "an event was passed"
    );
}

async fn a_draining_nodes_sandboxes_move_once_and_never_both_move_and_fail(store: Store) {
    use sandpit_store::{Cause, NewNode};
    use std::time::Duration as StdDuration;
    let node = |name: &str| NewNode {
        name: name.into(),
        address: format!("{name}.internal:7443"),
        vcpus: 2,
        memory_mb: 4096,
        max_sandboxes: 10,
    };
    let lease = StdDuration::from_secs(60);
    let a = store.register_node(&node("a"), lease).await.unwrap();
    let b = store.register_node(&node("b"), lease).await.unwrap();
    store.register_node(&node("c"), lease).await.unwrap();
    let acct = store.create_account("mover", 100).await.unwrap();
    store.add_credit(&acct.id, 1_000_000, None).await.unwrap();
    let mut on_a = Vec::new();
    for _ in 0..3 {
        let mut n = sandbox(&acct.id, OffsetDateTime::now_utc(), 60, 1_000);
        n.host = "a".into();
        n.host_epoch = Some(a.epoch);
        let row = created(store.create_sandbox(n).await.unwrap());
        store
            .set_status(&row.id, SandboxStatus::Running, None, &Cause::default())
            .await
            .unwrap();
        on_a.push(row.id);
    }

    // Draining: a takes no new sandbox (placement skips it, and a create
    // placed on it before it knew is refused in its transaction); the mark
    // outlives a's restart; unknown nodes are said so.
    let drained = store.set_node_draining("a", true).await.unwrap().unwrap();
    assert!(drained.draining);
    assert!(store
        .set_node_draining("nope", true)
        .await
        .unwrap()
        .is_none());
    let names = |c: Vec<sandpit_store::Candidate>| -> Vec<String> {
        c.into_iter().map(|c| c.node.name).collect()
    };
    assert_eq!(
        names(store.placement_candidates().await.unwrap()),
        ["b", "c"]
    );
    let mut n = sandbox(&acct.id, OffsetDateTime::now_utc(), 60, 1_000);
    n.host = "a".into();
    n.host_epoch = Some(a.epoch);
    assert_eq!(
        store.create_sandbox(n).await.unwrap(),
        CreateOutcome::HostUnavailable
    );
    let a = store.register_node(&node("a"), lease).await.unwrap();
    assert!(a.draining, "a restart keeps the drain");
    assert_eq!(store.live_sandboxes("a").await.unwrap().len(), 3);

    // A move is held by one member at a time.
    let until = OffsetDateTime::now_utc() + Duration::minutes(10);
    let first = &on_a[0];
    let held = store
        .begin_move(first, "a", "b", until)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(held.moving_to.as_deref(), Some("b"));
    assert!(held.is_moving(OffsetDateTime::now_utc()));
    assert!(store
        .begin_move(first, "a", "c", until)
        .await
        .unwrap()
        .is_none());
    assert!(
        store
            .begin_move(first, "b", "c", until)
            .await
            .unwrap()
            .is_none(),
        "not on b"
    );
    assert!(store.begin_move(first, "a", "a", until).await.is_err());
    // Finished only to where it was taken, and logged once.
    let cause = Cause::by("drain of node a")
        .with("from", "a")
        .with("to", "b");
    assert!(store
        .finish_move(first, "a", "c", &cause)
        .await
        .unwrap()
        .is_none());
    let moved = store
        .finish_move(first, "a", "b", &cause)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(moved.host, "b");
    assert!(
        moved.is_moving(OffsetDateTime::now_utc()),
        "held until its VM runs there"
    );
    assert!(store
        .finish_move(first, "a", "b", &cause)
        .await
        .unwrap()
        .is_none());
    store.end_move(first, "b").await.unwrap();
    let now = store.sandbox(first).await.unwrap().unwrap();
    assert_eq!(
        (now.host.as_str(), now.moving_to, now.moving_until),
        ("b", None, None)
    );
    let kinds: Vec<_> = store
        .account_events(&acct.id, 0, 100, Some(first))
        .await
        .unwrap()
        .into_iter()
        .filter(|e| e.kind == "sandbox.moved")
        .map(|e| (e.actor, serde_json::Value::Object(e.detail)))
        .collect();
    assert_eq!(kinds.len(), 1, "{kinds:?}");
    assert_eq!(kinds[0].0, "drain of node a");
    assert_eq!(kinds[0].1, serde_json::json!({"from": "a", "to": "b"}));

    // A paused sandbox moves paused.
    let second = &on_a[1];
    store
        .pause_sandbox(second, &Cause::default())
        .await
        .unwrap()
        .unwrap();
    store
        .begin_move(second, "a", "c", until)
        .await
        .unwrap()
        .unwrap();
    let moved = store
        .finish_move(second, "a", "c", &cause)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (moved.host.as_str(), moved.status),
        ("c", SandboxStatus::Paused)
    );
    store.end_move(second, "c").await.unwrap();

    // A move whose member was lost lapses, and one member takes it over.
    let third = &on_a[2];
    let past = OffsetDateTime::now_utc() - Duration::seconds(1);
    store
        .begin_move(third, "a", "b", past)
        .await
        .unwrap()
        .unwrap();
    let lapsed: Vec<_> = store
        .lapsed_moves(OffsetDateTime::now_utc())
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.id)
        .collect();
    assert_eq!(lapsed, std::slice::from_ref(third));
    let takers: Vec<_> = (0..4)
        .map(|_| {
            let (store, id) = (store.clone(), third.clone());
            tokio::spawn(async move { store.take_over_move(&id, until).await.unwrap() })
        })
        .collect();
    let mut took = 0;
    for t in takers {
        took += usize::from(t.await.unwrap().is_some());
    }
    assert_eq!(took, 1, "one member takes a lapsed move over");
    assert!(store
        .lapsed_moves(OffsetDateTime::now_utc())
        .await
        .unwrap()
        .is_empty());

    // The source node lost mid-move: the sandbox fails with it, and the
    // move cannot finish after (never both).
    assert!(store
        .renew_lease("a", a.epoch, StdDuration::ZERO, &Default::default())
        .await
        .unwrap());
    assert!(store
        .renew_lease("c", 1, lease, &Default::default())
        .await
        .unwrap());
    tokio::time::sleep(StdDuration::from_millis(50)).await;
    let lost = store
        .declare_lost_nodes(StdDuration::ZERO, "c", |_, _| 0)
        .await
        .unwrap();
    assert_eq!(lost.len(), 1);
    assert_eq!(
        lost[0]
            .sandboxes
            .iter()
            .map(|r| r.id.clone())
            .collect::<Vec<_>>(),
        std::slice::from_ref(third),
        "the moved ones are b's and c's now"
    );
    assert!(store
        .finish_move(third, "a", "b", &cause)
        .await
        .unwrap()
        .is_none());
    let third_now = store.sandbox(third).await.unwrap().unwrap();
    assert_eq!(
        (third_now.status, third_now.host.as_str()),
        (SandboxStatus::Failed, "a")
    );
    for (id, host) in [(first, "b"), (second, "c")] {
        let row = store.sandbox(id).await.unwrap().unwrap();
        assert!(row.is_live(), "{id}");
        assert_eq!(row.host, host);
    }
    // Back in service.
    let _ = b;
    assert!(
        !store
            .set_node_draining("a", false)
            .await
            .unwrap()
            .unwrap()
            .draining
    );
}
