-- The bytes each sandbox's disk takes on its host (its copy-on-write
-- overlay's allocation), as last measured; kept after the sandbox ends as
-- what it used. An account's live sandboxes are held to a total.
ALTER TABLE sandboxes ADD COLUMN disk_used_bytes BIGINT NOT NULL DEFAULT 0;
