-- Sign-ups through the dashboard, by the address they came from, for the
-- per-address limit (`[signup] per_address_per_hour`). In the database, so
-- replicas behind one balancer share one count; rows older than the hour
-- the limit counts are deleted as new ones come.
CREATE TABLE signups (
    address TEXT NOT NULL,
    at      TEXT NOT NULL
);
CREATE INDEX signups_address_at ON signups (address, at);
