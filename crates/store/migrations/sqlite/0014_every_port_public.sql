-- A sandbox whose every port is reached through its preview URL, without
-- an expose first: E2B's sandboxes (their SDKs' `get_host(port)` names a
-- port nobody exposed). 0 for the sandboxes of REST, MCP and the
-- dashboard, whose ports are exposed one by one.
ALTER TABLE sandboxes ADD COLUMN every_port_public INTEGER NOT NULL DEFAULT 0;
