-- Placement: how many live sandboxes a node takes at most (0: none, a
-- control-plane replica's own machine or a node draining), and how many
-- ready VMs its warm pool holds per size (JSON, as of its last heartbeat),
-- so a create prefers a node where it starts in milliseconds.
ALTER TABLE nodes ADD COLUMN max_sandboxes BIGINT NOT NULL DEFAULT 0;
ALTER TABLE nodes ADD COLUMN warm TEXT NOT NULL DEFAULT '{}';
