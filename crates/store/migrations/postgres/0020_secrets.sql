-- Secrets that never enter the VM (issue 45): an account's credentials, by
-- name (the guest's environment variable), sealed by the service
-- (XChaCha20-Poly1305 under the operator's `[secrets] key_file`; the store
-- never sees a value), with the hosts they may be sent to (JSON, a list of
-- host name rules) and how they are put in a request (`header`, `format`
-- with `{value}`). `last_used_at` is not kept yet (NULL).
CREATE TABLE secrets (
    account_id    TEXT COLLATE "C" NOT NULL REFERENCES accounts (id),
    name          TEXT COLLATE "C" NOT NULL,
    hosts         TEXT   NOT NULL,
    header        TEXT   NOT NULL,
    format        TEXT   NOT NULL,
    sealed_value  BYTEA  NOT NULL,
    created_at    TEXT   NOT NULL,
    updated_at    TEXT   NOT NULL,
    last_used_at  TEXT,
    PRIMARY KEY (account_id, name)
);

-- The secrets a sandbox was created with (or its fork's origin had): the
-- placeholder its guest has instead of each value. A secret its account
-- deleted since keeps its row here; the placeholder then goes out as it is.
CREATE TABLE sandbox_secrets (
    sandbox_id   TEXT COLLATE "C" NOT NULL REFERENCES sandboxes (id),
    name         TEXT   NOT NULL,
    placeholder  TEXT   NOT NULL,
    PRIMARY KEY (sandbox_id, name)
);

-- A sandbox with secrets has its own CA, which its guest trusts and its
-- egress proxy signs the secrets' hosts' certificates with: the
-- certificate (PEM) and its key, sealed as the values are.
ALTER TABLE sandboxes ADD COLUMN broker_ca_cert TEXT;
ALTER TABLE sandboxes ADD COLUMN broker_ca_key BYTEA;
