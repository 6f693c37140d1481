-- The machines that run sandboxes' VMs, when several share one database.
-- A node holds a lease on the database's clock (milliseconds since the Unix
-- epoch, as the database reads it, so no machine's clock decides); `epoch`
-- grows at each start and fences a node that lost its lease: its renewal
-- names the epoch it holds, and a node declared `lost` (its sandboxes failed
-- and settled in the same transaction) must start again to be `up`.
CREATE TABLE nodes (
    name           TEXT COLLATE "C" NOT NULL PRIMARY KEY,
    address        TEXT COLLATE "C" NOT NULL,
    epoch          BIGINT NOT NULL,
    state          TEXT COLLATE "C" NOT NULL CHECK (state IN ('up', 'lost')),
    vcpus          BIGINT NOT NULL,
    memory_mb      BIGINT NOT NULL,
    started_at_ms  BIGINT NOT NULL,
    heartbeat_ms   BIGINT NOT NULL,
    lease_until_ms BIGINT NOT NULL,
    lost_at_ms     BIGINT
);
CREATE INDEX sandboxes_host_status ON sandboxes (host, status);
