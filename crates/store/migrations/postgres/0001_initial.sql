-- Sandpit's schema, PostgreSQL dialect: the same tables as
-- ../sqlite/0001_initial.sql, column for column, so the store's SQL runs on
-- both. Timestamps are TEXT in fixed-width RFC 3339 UTC compared with the
-- "C" collation (byte order is time order whatever the database's locale);
-- ids too, since pages are ordered by them. Money is BIGINT micro-dollars;
-- booleans are 0/1 BIGINT as in SQLite.

CREATE TABLE accounts (
    id             TEXT COLLATE "C"    NOT NULL PRIMARY KEY,
    name           TEXT COLLATE "C"    NOT NULL UNIQUE,
    max_concurrent BIGINT  NOT NULL CHECK (max_concurrent >= 0),
    created_at     TEXT COLLATE "C"    NOT NULL
);

-- The key itself is never stored: only its SHA-256 (hex) and the visible
-- prefix an operator needs to tell keys apart.
CREATE TABLE api_keys (
    id           TEXT COLLATE "C" NOT NULL PRIMARY KEY,
    account_id   TEXT COLLATE "C" NOT NULL REFERENCES accounts (id),
    prefix       TEXT COLLATE "C" NOT NULL,
    hash         TEXT COLLATE "C" NOT NULL UNIQUE,
    created_at   TEXT COLLATE "C" NOT NULL,
    last_used_at TEXT COLLATE "C",
    revoked_at   TEXT COLLATE "C"
);
CREATE INDEX api_keys_account ON api_keys (account_id);
CREATE INDEX api_keys_prefix ON api_keys (prefix);

CREATE TABLE sandboxes (
    id                    TEXT COLLATE "C"   NOT NULL PRIMARY KEY,
    account_id            TEXT COLLATE "C"   NOT NULL REFERENCES accounts (id),
    name                  TEXT COLLATE "C",
    size                  TEXT COLLATE "C"   NOT NULL,
    vcpus                 BIGINT NOT NULL,
    memory_mb             BIGINT NOT NULL,
    disk_gb               BIGINT NOT NULL,
    timeout_minutes       BIGINT NOT NULL,
    status                TEXT COLLATE "C"   NOT NULL CHECK (status IN ('provisioning', 'running', 'deleting', 'deleted', 'failed')),
    price_micros_per_hour BIGINT NOT NULL,
    host                  TEXT COLLATE "C"   NOT NULL,
    created_at            TEXT COLLATE "C"   NOT NULL,
    ready_at              TEXT COLLATE "C",
    expires_at            TEXT COLLATE "C"   NOT NULL,
    deleted_at            TEXT COLLATE "C",
    deleted_reason        TEXT COLLATE "C"
);
CREATE INDEX sandboxes_account_created ON sandboxes (account_id, created_at);
CREATE INDEX sandboxes_status_expires ON sandboxes (status, expires_at);

-- Every status change of a sandbox, in order.
CREATE TABLE sandbox_events (
    id         BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    sandbox_id TEXT COLLATE "C" NOT NULL REFERENCES sandboxes (id),
    status     TEXT COLLATE "C" NOT NULL,
    reason     TEXT COLLATE "C",
    at         TEXT COLLATE "C" NOT NULL
);
CREATE INDEX sandbox_events_sandbox ON sandbox_events (sandbox_id, id);

-- A command and its outputs are UTF-8 in BYTEA: PostgreSQL's TEXT cannot
-- hold NUL, which a command's output may contain (SQLite's TEXT can).
CREATE TABLE executions (
    id          TEXT COLLATE "C"   NOT NULL PRIMARY KEY,
    sandbox_id  TEXT COLLATE "C"   NOT NULL REFERENCES sandboxes (id),
    account_id  TEXT COLLATE "C"   NOT NULL REFERENCES accounts (id),
    command     BYTEA    NOT NULL,
    status      TEXT COLLATE "C"   NOT NULL CHECK (status IN ('running', 'completed', 'timed_out', 'cancelled', 'failed')),
    exit_code   BIGINT,
    stdout      BYTEA    NOT NULL,
    stderr      BYTEA    NOT NULL,
    truncated   BIGINT NOT NULL,
    duration_ms BIGINT NOT NULL,
    started_at  TEXT COLLATE "C"   NOT NULL,
    finished_at TEXT COLLATE "C"
);
CREATE INDEX executions_sandbox ON executions (sandbox_id, started_at);

CREATE TABLE ports (
    sandbox_id TEXT COLLATE "C"   NOT NULL REFERENCES sandboxes (id),
    port       BIGINT NOT NULL CHECK (port BETWEEN 1 AND 65535),
    url        TEXT COLLATE "C"   NOT NULL,
    created_at TEXT COLLATE "C"   NOT NULL,
    closed_at  TEXT COLLATE "C",
    PRIMARY KEY (sandbox_id, port)
);

-- The only record of money. An account's balance is SUM(amount_micros) of
-- its rows and is stored nowhere else. Signs: credit +, reserve -,
-- release +, charge -.
CREATE TABLE ledger (
    id            BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    account_id    TEXT COLLATE "C"   NOT NULL REFERENCES accounts (id),
    sandbox_id    TEXT COLLATE "C"   REFERENCES sandboxes (id),
    kind          TEXT COLLATE "C"   NOT NULL CHECK (kind IN ('credit', 'reserve', 'release', 'charge')),
    amount_micros BIGINT NOT NULL,
    note          TEXT COLLATE "C",
    at            TEXT COLLATE "C"   NOT NULL,
    CHECK ((kind IN ('credit', 'release') AND amount_micros >= 0)
        OR (kind IN ('reserve', 'charge') AND amount_micros <= 0))
);
CREATE INDEX ledger_account ON ledger (account_id, id);
CREATE INDEX ledger_sandbox ON ledger (sandbox_id);

CREATE TABLE idempotency (
    account_id   TEXT COLLATE "C" NOT NULL REFERENCES accounts (id),
    key          TEXT COLLATE "C" NOT NULL,
    request_hash TEXT COLLATE "C" NOT NULL,
    sandbox_id   TEXT COLLATE "C" NOT NULL REFERENCES sandboxes (id),
    created_at   TEXT COLLATE "C" NOT NULL,
    PRIMARY KEY (account_id, key)
);
