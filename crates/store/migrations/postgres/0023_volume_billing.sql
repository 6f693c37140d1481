-- Volumes charged to the ledger (issue 46): how far a volume's storage
-- has been charged (NULL: not yet, from its created_at). A sweep charges
-- each volume from here to now (to its deleted_at once deleted) and moves
-- it, in one transaction that moves it only from where it read it, so
-- two replicas never charge one span twice.
ALTER TABLE volumes ADD COLUMN billed_until TEXT COLLATE "C";
