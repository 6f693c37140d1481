-- Volumes (issue 46): storage an account owns that outlives its sandboxes.
-- A volume is a file on one node's disk (`host`: an ext4 file system in a
-- sparse file, made by that node), so its row says where it is, and a
-- sandbox that mounts it must run there. Its name is the account's own
-- handle for it: unique among the account's volumes not deleted (a deleted
-- one's name is free again, its row kept as history and for billing,
-- which runs from `created_at` to `deleted_at`). `status`: `creating`
-- while its node makes the file, `ready`, `resizing` while its node grows
-- it (no sandbox may take it meanwhile), `deleted`.
CREATE TABLE volumes (
    id          TEXT COLLATE "C" NOT NULL PRIMARY KEY,
    account_id  TEXT COLLATE "C" NOT NULL REFERENCES accounts (id),
    name        TEXT COLLATE "C" NOT NULL,
    size_bytes  BIGINT NOT NULL,
    host        TEXT COLLATE "C" NOT NULL,
    status      TEXT COLLATE "C" NOT NULL
                CHECK (status IN ('creating', 'ready', 'resizing', 'deleted')),
    created_at  TEXT COLLATE "C" NOT NULL,
    deleted_at  TEXT COLLATE "C",
    -- When `status` last changed: a volume `creating` or `resizing` for
    -- long lost the process that was making it (see `stuck_volumes`).
    changed_at  TEXT COLLATE "C" NOT NULL,
    -- A create's `Idempotency-Key` and a hash of what it asked: a retry
    -- with both gets this volume back, another body under it a conflict.
    idempotency_key TEXT COLLATE "C",
    request_hash    TEXT COLLATE "C"
);
CREATE UNIQUE INDEX volumes_live_name ON volumes (account_id, name)
    WHERE status <> 'deleted';
CREATE INDEX volumes_account ON volumes (account_id, created_at);
CREATE UNIQUE INDEX volumes_idempotency ON volumes (account_id, idempotency_key);

-- Which sandbox mounts which volume, where, and whether read-only. A
-- volume is held while a live sandbox has a row here: at most one of them
-- read-write (checked in the transaction that writes the row, under the
-- volume's lock), any number read-only. The rows of an ended sandbox stay
-- as its history; they hold nothing.
CREATE TABLE sandbox_volumes (
    sandbox_id  TEXT COLLATE "C" NOT NULL REFERENCES sandboxes (id),
    volume_id   TEXT COLLATE "C" NOT NULL REFERENCES volumes (id),
    path        TEXT   NOT NULL,
    read_only   BIGINT NOT NULL,
    PRIMARY KEY (sandbox_id, path)
);
CREATE INDEX sandbox_volumes_volume ON sandbox_volumes (volume_id);
