-- A sandbox's own egress lists (issue 45), as JSON: `{"allow_out": [...],
-- "deny_out": [...]}` of IPv4 addresses and prefixes, checked by the
-- service before they are stored. NULL: none (the operator's network, or
-- all of it denied when `internet_access` is 0).
ALTER TABLE sandboxes ADD COLUMN network TEXT;
