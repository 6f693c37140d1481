-- Snapshots: the whole state of a running sandbox at one moment, kept on
-- the host that took it (its files are that host's; `host` says which).
-- `creating` while the host writes it, `ready` once it can be started
-- from, `deleted` when its files are gone or going (deleted by its owner,
-- expired, or a snapshot that failed). The row stays as history.
CREATE TABLE snapshots (
    id              TEXT COLLATE "C" NOT NULL PRIMARY KEY,
    account_id      TEXT COLLATE "C" NOT NULL REFERENCES accounts (id),
    name            TEXT COLLATE "C",
    sandbox_id      TEXT COLLATE "C" NOT NULL REFERENCES sandboxes (id),
    size            TEXT COLLATE "C" NOT NULL,
    host            TEXT COLLATE "C" NOT NULL,
    status          TEXT COLLATE "C" NOT NULL CHECK (status IN ('creating', 'ready', 'deleted')),
    bytes           BIGINT NOT NULL DEFAULT 0,
    created_at      TEXT COLLATE "C" NOT NULL,
    expires_at      TEXT COLLATE "C" NOT NULL,
    deleted_at      TEXT COLLATE "C",
    idempotency_key TEXT COLLATE "C",
    request_hash    TEXT COLLATE "C"
);
CREATE INDEX snapshots_account_created ON snapshots (account_id, created_at);
CREATE INDEX snapshots_status_expires ON snapshots (status, expires_at);
CREATE UNIQUE INDEX snapshots_idempotency ON snapshots (account_id, idempotency_key);

-- The snapshot a sandbox was started from (NULL: from the image), so a
-- restore can tell its ancestors' snapshots.
ALTER TABLE sandboxes ADD COLUMN snapshot_id TEXT COLLATE "C";

-- Pause: a running sandbox whose VM was saved to disk and stopped. It stays
-- `running` here (so every live-status query counts it) with the time it
-- was paused; `paused_seconds` adds up its earlier pauses, which are billed
-- at the paused rate.
ALTER TABLE sandboxes ADD COLUMN paused_at TEXT COLLATE "C";
ALTER TABLE sandboxes ADD COLUMN paused_seconds BIGINT NOT NULL DEFAULT 0;
