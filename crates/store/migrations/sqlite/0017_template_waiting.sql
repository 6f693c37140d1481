-- A build may wait for its steps: E2B's builder asks for a build first
-- (and learns its id), uploads its files, then starts it with its steps.
-- `waiting` until then (the reaper fails one left waiting); `upload_token`
-- lets the files' upload URL it was given in (without the API key).
-- SQLite cannot change a CHECK: the table is made again, as it was plus
-- these.
CREATE TABLE templates_new (
    id            TEXT   NOT NULL PRIMARY KEY,
    account_id    TEXT   NOT NULL REFERENCES accounts (id),
    name          TEXT   NOT NULL,
    tag           TEXT   NOT NULL,
    size          TEXT   NOT NULL,
    status        TEXT   NOT NULL
                  CHECK (status IN ('waiting', 'building', 'ready', 'failed', 'deleted')),
    spec          TEXT   NOT NULL,
    public        INTEGER NOT NULL DEFAULT 0,
    snapshot_id   TEXT,
    host          TEXT,
    bytes         BIGINT NOT NULL DEFAULT 0,
    steps         INTEGER NOT NULL DEFAULT 0,
    cached_steps  INTEGER NOT NULL DEFAULT 0,
    log           TEXT   NOT NULL DEFAULT '',
    error         TEXT,
    created_at    TEXT   NOT NULL,
    updated_at    TEXT   NOT NULL,
    finished_at   TEXT,
    deleted_at    TEXT,
    upload_token  TEXT
);
INSERT INTO templates_new (id, account_id, name, tag, size, status, spec, public, snapshot_id,
    host, bytes, steps, cached_steps, log, error, created_at, updated_at, finished_at, deleted_at)
  SELECT id, account_id, name, tag, size, status, spec, public, snapshot_id,
    host, bytes, steps, cached_steps, log, error, created_at, updated_at, finished_at, deleted_at
  FROM templates;
DROP TABLE templates;
ALTER TABLE templates_new RENAME TO templates;
CREATE INDEX templates_account_name ON templates (account_id, name, tag, created_at);
CREATE INDEX templates_status ON templates (status, updated_at);
