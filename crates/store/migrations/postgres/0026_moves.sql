-- Sandboxes outlive their node (issue 48). A draining node takes no new
-- sandbox (placement and the create's lock skip it) while its sandboxes
-- are moved to other nodes; it stays drained across its restarts until
-- an operator puts it back in service.
ALTER TABLE nodes ADD COLUMN draining BIGINT NOT NULL DEFAULT 0;
-- A sandbox being moved: to which node, and until when the member moving
-- it holds the move (a lapsed move is finished or undone by another).
-- Calls that need its VM wait while it is set.
ALTER TABLE sandboxes ADD COLUMN moving_to TEXT;
ALTER TABLE sandboxes ADD COLUMN moving_until TEXT;
CREATE INDEX sandboxes_moving ON sandboxes (moving_until) WHERE moving_until IS NOT NULL;
