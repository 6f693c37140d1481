-- Private previews (issue 45): a port exposed as private is served only to
-- a request that carries the sandbox's traffic token (a header, a signed
-- URL, or the cookie a signed URL leaves); `private_traffic` makes every
-- port of the sandbox so (E2B's `allowPublicTraffic=false`).
ALTER TABLE ports ADD COLUMN private BIGINT NOT NULL DEFAULT 0;
ALTER TABLE sandboxes ADD COLUMN private_traffic BIGINT NOT NULL DEFAULT 0;
