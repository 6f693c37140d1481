-- Bytes carried through each sandbox's preview URLs, for its usage: `in`
-- is what clients sent to the sandbox, `out` what it sent back.
ALTER TABLE sandboxes ADD COLUMN preview_bytes_in  BIGINT NOT NULL DEFAULT 0;
ALTER TABLE sandboxes ADD COLUMN preview_bytes_out BIGINT NOT NULL DEFAULT 0;
