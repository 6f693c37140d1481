-- Sandpit's schema, SQLite dialect.
--
-- Kept portable on purpose (see the crate docs): timestamps are TEXT in
-- fixed-width RFC 3339 UTC (`2026-01-02T03:04:05.678901Z`), so they compare
-- and sort as strings; money is BIGINT micro-dollars (SQLite's INTEGER is
-- 64-bit anyway, PostgreSQL's INTEGER is not); booleans are 0/1 integers.
-- The only SQLite-only spelling is `INTEGER PRIMARY KEY AUTOINCREMENT`
-- (PostgreSQL: `BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY`).

CREATE TABLE accounts (
    id             TEXT    NOT NULL PRIMARY KEY,
    name           TEXT    NOT NULL UNIQUE,
    max_concurrent BIGINT  NOT NULL CHECK (max_concurrent >= 0),
    created_at     TEXT    NOT NULL
);

-- The key itself is never stored: only its SHA-256 (hex) and the visible
-- prefix an operator needs to tell keys apart.
CREATE TABLE api_keys (
    id           TEXT NOT NULL PRIMARY KEY,
    account_id   TEXT NOT NULL REFERENCES accounts (id),
    prefix       TEXT NOT NULL,
    hash         TEXT NOT NULL UNIQUE,
    created_at   TEXT NOT NULL,
    last_used_at TEXT,
    revoked_at   TEXT
);
CREATE INDEX api_keys_account ON api_keys (account_id);
CREATE INDEX api_keys_prefix ON api_keys (prefix);

CREATE TABLE sandboxes (
    id                    TEXT   NOT NULL PRIMARY KEY,
    account_id            TEXT   NOT NULL REFERENCES accounts (id),
    name                  TEXT,
    size                  TEXT   NOT NULL,
    vcpus                 BIGINT NOT NULL,
    memory_mb             BIGINT NOT NULL,
    disk_gb               BIGINT NOT NULL,
    timeout_minutes       BIGINT NOT NULL,
    status                TEXT   NOT NULL CHECK (status IN ('provisioning', 'running', 'deleting', 'deleted', 'failed')),
    price_micros_per_hour BIGINT NOT NULL,
    host                  TEXT   NOT NULL,
    created_at            TEXT   NOT NULL,
    ready_at              TEXT,
    expires_at            TEXT   NOT NULL,
    deleted_at            TEXT,
    deleted_reason        TEXT
);
CREATE INDEX sandboxes_account_created ON sandboxes (account_id, created_at);
CREATE INDEX sandboxes_status_expires ON sandboxes (status, expires_at);

-- Every status change of a sandbox, in order.
CREATE TABLE sandbox_events (
    id         INTEGER PRIMARY KEY AUTOINCREMENT,
    sandbox_id TEXT NOT NULL REFERENCES sandboxes (id),
    status     TEXT NOT NULL,
    reason     TEXT,
    at         TEXT NOT NULL
);
CREATE INDEX sandbox_events_sandbox ON sandbox_events (sandbox_id, id);

CREATE TABLE executions (
    id          TEXT   NOT NULL PRIMARY KEY,
    sandbox_id  TEXT   NOT NULL REFERENCES sandboxes (id),
    account_id  TEXT   NOT NULL REFERENCES accounts (id),
    command     TEXT   NOT NULL,
    status      TEXT   NOT NULL CHECK (status IN ('running', 'completed', 'timed_out', 'cancelled', 'failed')),
    exit_code   BIGINT,
    stdout      TEXT   NOT NULL,
    stderr      TEXT   NOT NULL,
    truncated   BIGINT NOT NULL,
    duration_ms BIGINT NOT NULL,
    started_at  TEXT   NOT NULL,
    finished_at TEXT
);
CREATE INDEX executions_sandbox ON executions (sandbox_id, started_at);

CREATE TABLE ports (
    sandbox_id TEXT   NOT NULL REFERENCES sandboxes (id),
    port       BIGINT NOT NULL CHECK (port BETWEEN 1 AND 65535),
    url        TEXT   NOT NULL,
    created_at TEXT   NOT NULL,
    closed_at  TEXT,
    PRIMARY KEY (sandbox_id, port)
);

-- The only record of money. An account's balance is SUM(amount_micros) of
-- its rows and is stored nowhere else. Signs: credit +, reserve -,
-- release +, charge -.
CREATE TABLE ledger (
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
    account_id    TEXT   NOT NULL REFERENCES accounts (id),
    sandbox_id    TEXT   REFERENCES sandboxes (id),
    kind          TEXT   NOT NULL CHECK (kind IN ('credit', 'reserve', 'release', 'charge')),
    amount_micros BIGINT NOT NULL,
    note          TEXT,
    at            TEXT   NOT NULL,
    CHECK ((kind IN ('credit', 'release') AND amount_micros >= 0)
        OR (kind IN ('reserve', 'charge') AND amount_micros <= 0))
);
CREATE INDEX ledger_account ON ledger (account_id, id);
CREATE INDEX ledger_sandbox ON ledger (sandbox_id);

CREATE TABLE idempotency (
    account_id   TEXT NOT NULL REFERENCES accounts (id),
    key          TEXT NOT NULL,
    request_hash TEXT NOT NULL,
    sandbox_id   TEXT NOT NULL REFERENCES sandboxes (id),
    created_at   TEXT NOT NULL,
    PRIMARY KEY (account_id, key)
);
