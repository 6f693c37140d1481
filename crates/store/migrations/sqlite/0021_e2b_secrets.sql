-- E2B's secrets and network rules (issue 45, its E2B side): the same
-- `secrets` table, one namespace per account, values sealed as before. E2B
-- names a secret by a stable id (`sec_…`) as well as by its name, counts
-- the values it was given (`version`, 1 at its create, one more at each
-- new value) and keeps metadata of its owner's (JSON, an object of
-- strings). A secret made through E2B has no hosts (`[]`): it is put in
-- requests by a sandbox's network rules only, never by a placeholder.
ALTER TABLE secrets ADD COLUMN id TEXT;
ALTER TABLE secrets ADD COLUMN version INTEGER NOT NULL DEFAULT 1;
ALTER TABLE secrets ADD COLUMN metadata TEXT NOT NULL DEFAULT '{}';
UPDATE secrets SET id = 'sec_' || lower(hex(randomblob(12))) WHERE id IS NULL;
CREATE UNIQUE INDEX secrets_by_id ON secrets (id);

-- A sandbox's network rules (E2B's `network.rules`), as JSON: per host
-- name, the headers set on its HTTPS requests, as their owner wrote them
-- (`Bearer ${e2b.secrets.NAME}`: templates, never a value; the service
-- resolves them at every start of the VM and each change). NULL: none.
ALTER TABLE sandboxes ADD COLUMN network_rules TEXT;
