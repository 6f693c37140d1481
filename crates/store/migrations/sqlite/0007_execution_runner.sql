-- Which member of a cluster recorded an execution (and so finishes it):
-- the sandbox's node, or a control-plane replica that routed the command
-- there. When that member is gone (restarted, or declared lost), its
-- executions still `running` are failed: nobody else will finish them.
-- NULL (executions from before): the sandbox's host.
ALTER TABLE executions ADD COLUMN runner TEXT;
