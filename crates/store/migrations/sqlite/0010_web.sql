-- The dashboard. An operator account sees every account and can add
-- credit (`sandpit account create --admin`, or `sandpit account admin`);
-- the account a first start creates is one.
ALTER TABLE accounts ADD COLUMN admin BIGINT NOT NULL DEFAULT 0;
UPDATE accounts SET admin = 1 WHERE name = 'admin';

-- Who is signed in: a session per sign-in with an API key, named by a
-- random token in an HttpOnly cookie (kept here as its hash, as keys are),
-- with the token its forms must carry (CSRF). It ends at its expiry or at
-- sign-out. In the database, so every replica knows it.
CREATE TABLE web_sessions (
    hash       TEXT NOT NULL PRIMARY KEY,
    account_id TEXT NOT NULL REFERENCES accounts (id),
    csrf       TEXT NOT NULL,
    created_at TEXT NOT NULL,
    expires_at TEXT NOT NULL
);
CREATE INDEX web_sessions_expires ON web_sessions (expires_at);

-- Invitations to sign up when sign-up is invite-only: a code made by
-- `sandpit invite create`, kept as its hash, good for `uses_left` more
-- accounts until it expires.
CREATE TABLE invites (
    hash       TEXT NOT NULL PRIMARY KEY,
    uses_left  BIGINT NOT NULL CHECK (uses_left >= 0),
    created_at TEXT NOT NULL,
    expires_at TEXT NOT NULL
);
