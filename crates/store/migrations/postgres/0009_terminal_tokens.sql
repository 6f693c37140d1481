-- One-use tokens that open a sandbox's terminal (`GET
-- /v1/sandboxes/{id}/pty?token=`): a browser's WebSocket cannot send an
-- API key in a header, and a key must never travel in a URL. A token names
-- its account and sandbox, lives a minute, and is deleted when used. Kept
-- as a hash, as keys are; in the database, so any replica takes a token
-- another one made.
CREATE TABLE terminal_tokens (
    hash       TEXT COLLATE "C" NOT NULL PRIMARY KEY,
    account_id TEXT COLLATE "C" NOT NULL REFERENCES accounts (id),
    sandbox_id TEXT COLLATE "C" NOT NULL REFERENCES sandboxes (id),
    created_at TEXT COLLATE "C" NOT NULL,
    expires_at TEXT COLLATE "C" NOT NULL
);
CREATE INDEX terminal_tokens_expires ON terminal_tokens (expires_at);
