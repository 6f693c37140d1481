-- A sandbox whose VM is being replaced (a restore, a pause, a resume), until
-- when at most: a call through another replica that finds the VM gone
-- meanwhile is told to retry instead of failing the sandbox. Cleared when
-- the replacement ends; a replica that died in the middle leaves a mark
-- that lapses on its own.
ALTER TABLE sandboxes ADD COLUMN vm_replacing_until TEXT;
