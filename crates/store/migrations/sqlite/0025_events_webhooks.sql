-- Lifecycle events and webhooks (issue 47): see the PostgreSQL migration
-- of the same number for why each column and table is there.
ALTER TABLE sandbox_events ADD COLUMN account_id TEXT;
ALTER TABLE sandbox_events ADD COLUMN kind TEXT;
ALTER TABLE sandbox_events ADD COLUMN actor TEXT;
ALTER TABLE sandbox_events ADD COLUMN detail TEXT;
ALTER TABLE sandbox_events ADD COLUMN seq INTEGER;
UPDATE sandbox_events SET account_id = (SELECT s.account_id FROM sandboxes s
                                        WHERE s.id = sandbox_events.sandbox_id);
UPDATE sandbox_events SET kind = CASE
    WHEN status = 'provisioning' THEN 'sandbox.created'
    WHEN status = 'running' AND reason IS NULL THEN 'sandbox.started'
    WHEN status = 'running' AND reason = 'resumed' THEN 'sandbox.resumed'
    WHEN status = 'paused' THEN 'sandbox.paused'
    WHEN status = 'deleting' THEN 'sandbox.destroying'
    WHEN status = 'failed' THEN 'sandbox.failed'
    WHEN status = 'deleted' AND reason = 'expired' THEN 'sandbox.expired'
    WHEN status = 'deleted' THEN 'sandbox.killed'
    ELSE 'sandbox.noted' END;
UPDATE sandbox_events SET actor = 'sandpit';
-- Every row there has committed: their ids are their order.
UPDATE sandbox_events SET seq = id;
CREATE UNIQUE INDEX sandbox_events_seq ON sandbox_events (seq);
CREATE INDEX sandbox_events_account ON sandbox_events (account_id, seq);
CREATE INDEX sandbox_events_unsequenced ON sandbox_events (id) WHERE seq IS NULL;
CREATE INDEX sandbox_events_at ON sandbox_events (at);

ALTER TABLE sandboxes ADD COLUMN start_from TEXT;

CREATE TABLE webhooks (
    id          TEXT NOT NULL PRIMARY KEY,
    account_id  TEXT NOT NULL REFERENCES accounts (id),
    url         TEXT NOT NULL,
    events      TEXT NOT NULL,
    description TEXT,
    secret      TEXT NOT NULL,
    created_at  TEXT NOT NULL,
    deleted_at  TEXT
);
CREATE INDEX webhooks_account ON webhooks (account_id, created_at);

CREATE TABLE webhook_deliveries (
    webhook_id      TEXT NOT NULL REFERENCES webhooks (id),
    event_id        INTEGER NOT NULL,
    sandbox_id      TEXT NOT NULL,
    status          TEXT NOT NULL,
    attempts        INTEGER NOT NULL DEFAULT 0,
    next_attempt_at TEXT NOT NULL,
    lease_until     TEXT,
    created_at      TEXT NOT NULL,
    delivered_at    TEXT,
    PRIMARY KEY (webhook_id, event_id)
);
CREATE INDEX webhook_deliveries_due ON webhook_deliveries (next_attempt_at)
    WHERE status = 'pending';
CREATE INDEX webhook_deliveries_order ON webhook_deliveries (webhook_id, sandbox_id, event_id)
    WHERE status = 'pending';
CREATE INDEX webhook_deliveries_event ON webhook_deliveries (event_id);

CREATE TABLE webhook_attempts (
    webhook_id  TEXT NOT NULL,
    event_id    INTEGER NOT NULL,
    n           INTEGER NOT NULL,
    at          TEXT NOT NULL,
    status_code INTEGER,
    error       TEXT,
    duration_ms INTEGER NOT NULL,
    PRIMARY KEY (webhook_id, event_id, n)
);

CREATE TRIGGER sandbox_events_to_webhooks AFTER INSERT ON sandbox_events
    WHEN NEW.account_id IS NOT NULL AND NEW.kind IS NOT NULL
BEGIN
    INSERT INTO webhook_deliveries (webhook_id, event_id, sandbox_id, status, attempts,
                                    next_attempt_at, created_at)
    SELECT w.id, NEW.id, NEW.sandbox_id, 'pending', 0, NEW.at, NEW.at
    FROM webhooks w
    WHERE w.account_id = NEW.account_id AND w.deleted_at IS NULL
      AND (w.events = '*' OR instr(w.events, ',' || NEW.kind || ',') > 0);
END;
