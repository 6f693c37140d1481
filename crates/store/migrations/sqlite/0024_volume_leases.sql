-- A volume's files read or written by the host (issue 46): each call holds
-- a lease on the volume until it ends (`until`, a bound that outlives the
-- call: a process lost mid-call lets the lease lapse). No sandbox takes a
-- volume while a lease on it is live, and a lease is granted only while
-- no live sandbox mounts the volume read-write (`writing`: while none
-- mounts it at all). Nor is a leased volume resized or deleted.
CREATE TABLE volume_leases (
    id          TEXT    NOT NULL PRIMARY KEY,
    volume_id   TEXT    NOT NULL REFERENCES volumes (id),
    writing     INTEGER NOT NULL,
    until       TEXT    NOT NULL
);
CREATE INDEX volume_leases_volume ON volume_leases (volume_id, until);
