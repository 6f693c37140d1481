-- Lifecycle events and webhooks (issue 47).
--
-- Every event row now says whose it is, what kind of change it records,
-- who caused it and what else it carries (JSON text). Rows are written in
-- the transaction of the change they record, as before.
ALTER TABLE sandbox_events ADD COLUMN account_id TEXT COLLATE "C";
ALTER TABLE sandbox_events ADD COLUMN kind TEXT COLLATE "C";
ALTER TABLE sandbox_events ADD COLUMN actor TEXT COLLATE "C";
ALTER TABLE sandbox_events ADD COLUMN detail TEXT COLLATE "C";
-- The account's log is read in `seq` order. Identity values are taken
-- when a row is written, not when it commits, so a reader paging by `id`
-- could pass a row that commits later under a smaller one. `seq` is given
-- to committed rows only, by one sequencer at a time (`Store::sequence_events`),
-- so a row that appears later always has a larger one.
ALTER TABLE sandbox_events ADD COLUMN seq BIGINT;
UPDATE sandbox_events e SET account_id = s.account_id FROM sandboxes s WHERE s.id = e.sandbox_id;
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

-- How a sandbox's VM is to start, decided when it is created: `pool`,
-- `snapshot`, `template` or `cold`; its `started` event says it.
ALTER TABLE sandboxes ADD COLUMN start_from TEXT COLLATE "C";

-- An account's webhooks. `events` is `*` or a list `,type,type,`. The
-- secret signs deliveries (HMAC-SHA256), so it is kept as given.
CREATE TABLE webhooks (
    id          TEXT COLLATE "C" NOT NULL PRIMARY KEY,
    account_id  TEXT COLLATE "C" NOT NULL REFERENCES accounts (id),
    url         TEXT COLLATE "C" NOT NULL,
    events      TEXT COLLATE "C" NOT NULL,
    description TEXT COLLATE "C",
    secret      TEXT COLLATE "C" NOT NULL,
    created_at  TEXT COLLATE "C" NOT NULL,
    deleted_at  TEXT COLLATE "C"
);
CREATE INDEX webhooks_account ON webhooks (account_id, created_at);

-- One event to one webhook: written by the trigger below in the event's
-- own transaction (an outbox), so an event is never committed without its
-- deliveries. `status`: pending, delivered, failed. A delivery worker
-- takes a pending one whose time has come by setting `lease_until`.
CREATE TABLE webhook_deliveries (
    webhook_id      TEXT COLLATE "C" NOT NULL REFERENCES webhooks (id),
    event_id        BIGINT NOT NULL,
    sandbox_id      TEXT COLLATE "C" NOT NULL,
    status          TEXT COLLATE "C" NOT NULL,
    attempts        BIGINT NOT NULL DEFAULT 0,
    next_attempt_at TEXT COLLATE "C" NOT NULL,
    lease_until     TEXT COLLATE "C",
    created_at      TEXT COLLATE "C" NOT NULL,
    delivered_at    TEXT COLLATE "C",
    PRIMARY KEY (webhook_id, event_id)
);
CREATE INDEX webhook_deliveries_due ON webhook_deliveries (next_attempt_at)
    WHERE status = 'pending';
CREATE INDEX webhook_deliveries_order ON webhook_deliveries (webhook_id, sandbox_id, event_id)
    WHERE status = 'pending';
CREATE INDEX webhook_deliveries_event ON webhook_deliveries (event_id);

-- Each POST of a delivery, as the receiver answered it.
CREATE TABLE webhook_attempts (
    webhook_id  TEXT COLLATE "C" NOT NULL,
    event_id    BIGINT NOT NULL,
    n           BIGINT NOT NULL,
    at          TEXT COLLATE "C" NOT NULL,
    status_code BIGINT,
    error       TEXT COLLATE "C",
    duration_ms BIGINT NOT NULL,
    PRIMARY KEY (webhook_id, event_id, n)
);

CREATE FUNCTION sandbox_events_to_webhooks() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO webhook_deliveries (webhook_id, event_id, sandbox_id, status, attempts,
                                    next_attempt_at, created_at)
    SELECT w.id, NEW.id, NEW.sandbox_id, 'pending', 0, NEW.at, NEW.at
    FROM webhooks w
    WHERE w.account_id = NEW.account_id AND w.deleted_at IS NULL
      AND (w.events = '*' OR strpos(w.events, ',' || NEW.kind || ',') > 0);
    RETURN NULL;
END
$$;
CREATE TRIGGER sandbox_events_to_webhooks AFTER INSERT ON sandbox_events
    FOR EACH ROW WHEN (NEW.account_id IS NOT NULL AND NEW.kind IS NOT NULL)
    EXECUTE FUNCTION sandbox_events_to_webhooks();
