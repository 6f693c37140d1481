-- Whether the sandbox's guest may reach the network beyond itself, as its
-- creator asked: 0 (E2B's `allow_internet_access=False`: nothing but its own
-- loopback), 1 (asked for), NULL (not said: the operator's network, which
-- E2B reports as not set).
ALTER TABLE sandboxes ADD COLUMN internet_access BIGINT;
