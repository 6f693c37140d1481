-- Templates: named builds of the standard guest image plus steps, saved
-- with their start command running. One row per build (a version): the
-- newest ready build of an account's name:tag is what sandboxes start
-- from. `building` while a build runs (`updated_at` moves with its log;
-- a build whose server died stops moving and is failed by the reaper),
-- then `ready` (its save `snapshot_id` on `host`) or `failed`
-- (`error`); `deleted` once its owner deleted it or a newer build
-- retired it. `public`: an operator published it for every account.
CREATE TABLE templates (
    id            TEXT   NOT NULL PRIMARY KEY,
    account_id    TEXT   NOT NULL REFERENCES accounts (id),
    name          TEXT   NOT NULL,
    tag           TEXT   NOT NULL,
    size          TEXT   NOT NULL,
    status        TEXT   NOT NULL CHECK (status IN ('building', 'ready', 'failed', 'deleted')),
    spec          TEXT   NOT NULL,
    public        BIGINT NOT NULL DEFAULT 0,
    snapshot_id   TEXT,
    host          TEXT,
    bytes         BIGINT NOT NULL DEFAULT 0,
    steps         BIGINT NOT NULL DEFAULT 0,
    cached_steps  BIGINT NOT NULL DEFAULT 0,
    log           TEXT   NOT NULL DEFAULT '',
    error         TEXT,
    created_at    TEXT   NOT NULL,
    updated_at    TEXT   NOT NULL,
    finished_at   TEXT,
    deleted_at    TEXT
);
CREATE INDEX templates_account_name ON templates (account_id, name, tag, created_at);
CREATE INDEX templates_status ON templates (status, updated_at);

-- The saved state after a build step (a layer), by the key that names that
-- step and every one before it: a rebuild starts from the last layer it
-- finds. An account's own; on the host whose disk holds the save.
CREATE TABLE template_layers (
    account_id  TEXT   NOT NULL REFERENCES accounts (id),
    layer_key   TEXT   NOT NULL,
    host        TEXT   NOT NULL,
    save_id     TEXT   NOT NULL,
    size        TEXT   NOT NULL,
    bytes       BIGINT NOT NULL DEFAULT 0,
    created_at  TEXT   NOT NULL,
    used_at     TEXT   NOT NULL,
    PRIMARY KEY (account_id, layer_key, host)
);
CREATE UNIQUE INDEX template_layers_save ON template_layers (save_id);

-- Files a build's COPY steps unpack: a tar, named by its SHA-256, uploaded
-- by the account before the build.
CREATE TABLE template_files (
    account_id  TEXT   NOT NULL REFERENCES accounts (id),
    sha256      TEXT   NOT NULL,
    data        BYTEA   NOT NULL,
    bytes       BIGINT NOT NULL,
    created_at  TEXT   NOT NULL,
    PRIMARY KEY (account_id, sha256)
);

-- The template build a sandbox was started from, and the working directory
-- its commands run in by default (the template's WORKDIR; NULL: /workspace).
ALTER TABLE sandboxes ADD COLUMN template_id TEXT;
ALTER TABLE sandboxes ADD COLUMN workdir TEXT;
