-- What E2B's API keeps on a sandbox: its metadata (key/value labels that
-- lists filter by), the environment every command in it gets, and the
-- token its data plane (envd's API) is reached with. JSON objects as text;
-- NULL when empty. The token is kept, not only its hash: it is shown again
-- on connect and get_info, and signed file URLs are checked against it.
ALTER TABLE sandboxes ADD COLUMN metadata TEXT;
ALTER TABLE sandboxes ADD COLUMN env TEXT;
ALTER TABLE sandboxes ADD COLUMN access_token TEXT;
