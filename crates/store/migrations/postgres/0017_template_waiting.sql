-- A build may wait for its steps: E2B's builder asks for a build first
-- (and learns its id), uploads its files, then starts it with its steps.
-- `waiting` until then (the reaper fails one left waiting); `upload_token`
-- lets the files' upload URL it was given in (without the API key).
ALTER TABLE templates DROP CONSTRAINT templates_status_check;
ALTER TABLE templates ADD CONSTRAINT templates_status_check
    CHECK (status IN ('waiting', 'building', 'ready', 'failed', 'deleted'));
ALTER TABLE templates ADD COLUMN upload_token TEXT;
