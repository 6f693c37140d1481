-- What each execution takes in the store (its command and outputs, plus a
-- fixed overhead for the rest of the row), and each account's total, so a
-- tenant's stored commands and outputs are held to a budget.
ALTER TABLE executions ADD COLUMN stored_bytes BIGINT NOT NULL DEFAULT 0;
UPDATE executions SET stored_bytes = octet_length(command)
    + octet_length(stdout) + octet_length(stderr) + 256;
ALTER TABLE accounts ADD COLUMN execution_bytes BIGINT NOT NULL DEFAULT 0;
UPDATE accounts SET execution_bytes = (
    SELECT COALESCE(SUM(stored_bytes), 0) FROM executions
    WHERE executions.account_id = accounts.id);
CREATE INDEX executions_account ON executions (account_id, started_at);
