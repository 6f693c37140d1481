//! What an agent reads of the server: its instructions and each tool's
//! description, kept apart from the code so they can be read (and
//! reviewed) as the text they are.

/// The server's `instructions`: what an agent should know before its first call.
pub const INSTRUCTIONS: &str = "\
Sandpit gives you real Linux virtual machines (sandboxes) that you are free to break: \
create one, run shell commands in it, move files in and out, give a server inside it a \
public URL, and destroy it when you are done.

Typical flow: create_sandbox -> write_file / run_command (as often as needed) -> \
read_file / list_files to collect what your code produced -> destroy_sandbox.

Notes for agents:
- Code runs as an unprivileged user (`user`, uid 1000) in /workspace. There is no sudo, so \
`apt-get` will not work; use `pip install --user --break-system-packages ...` or `npm install ...`.
- run_command waits for the command to finish, so start servers in the background with `&` \
(e.g. `python3 -m http.server 8000 > server.log 2>&1 &`), then call expose_port.
- Sandboxes are destroyed when they time out, whether or not destroy_sandbox is called. \
Calling it anyway returns the unused time (the reserved credit comes back). \
extend_sandbox pushes the expiry out when a job outgrows its timeout.
- snapshot_sandbox saves a sandbox's whole state (files, packages, running processes): take \
one before a risky change and call restore_sandbox to undo it. fork_sandbox makes parallel \
copies of a sandbox to try several approaches at once. create_sandbox with snapshot_id starts \
from a prepared environment instead of installing everything again.
- A sandbox is billed per second while it exists. get_usage shows your remaining credit; \
get_service_info shows the sizes, prices and limits.
- Over HTTP every tool except get_service_info needs an API key, sent on each request as \
`Authorization: Bearer <key>` or `x-api-key: <key>`.";

pub(crate) const D_CREATE: &str = "\
Create a new sandbox: a fresh Linux VM (Debian, python3, node/npm, build tools, git, curl) \
for this account. Returns the sandbox object (id, status, size, resources, expires_at) once \
it accepts commands. It is billed per second until destroyed and is destroyed automatically \
at expires_at (default 15 minutes; the most is timeout_minutes' maximum). Code runs as the unprivileged `user` in \
/workspace; there is no sudo, so apt-get will not work: use `pip install --user \
--break-system-packages ...` or `npm install ...`. Pass snapshot_id (from snapshot_sandbox or \
list_snapshots) to start from a prepared environment instead: the snapshot's files, installed \
packages and running processes, at the snapshot's size; or template (a name the account's \
operator or team built) for an environment built once, its server already running.";

pub(crate) const D_RUN: &str = "\
Run a shell command in a sandbox as the unprivileged user (uid 1000, in /workspace unless \
`cwd` says otherwise) and wait for it to finish. Returns stdout, stderr, exit_code, status \
(completed, timed_out, cancelled, failed), duration_ms and truncated (output past 1 MiB per \
stream is dropped). A non-zero exit_code is a normal result, not a tool error; a command that \
times out is killed and reported as an error with the output it had produced. Because the call \
waits, start servers in the background with `&` (e.g. `python3 -m http.server 8000 > \
server.log 2>&1 &`), then use expose_port. No sudo: apt-get will not work; use `pip install \
--user --break-system-packages ...` or `npm install ...`. When the request carries a progress \
token, stdout/stderr chunks are streamed as progress notifications (message = the chunk, \
_meta.\"sandpit/stream\" = stdout or stderr).";

pub(crate) const D_WRITE: &str = "\
Write a file into a sandbox (parent directories are created; the file belongs to the sandbox \
user). The content travels out of band, never through a shell, so quotes, newlines and binary \
bytes survive exactly: send text with encoding utf8 (default) or bytes as base64. Overwrites \
an existing file. Returns the absolute path and the number of bytes written.";

pub(crate) const D_READ: &str = "\
Read a file back from a sandbox: how you get at what your code produced. Use encoding base64 \
for files that are not UTF-8 text (reading such a file as utf8 is an error that says so).";

pub(crate) const D_LIST: &str = "\
List a directory in a sandbox (default /workspace, recursive by default): each entry's name \
relative to the listed directory, its type (file, dir, symlink, other) and size, so you can \
find what a run produced.";

pub(crate) const D_EXPOSE: &str = "\
Give a server running inside a sandbox a public URL to share. The server only has to listen \
on the port (localhost is enough); start it in the background with `&` first, since \
run_command waits for commands to finish. Asking again for the same port returns the same URL. \
The URL answers 502 (\"not listening yet\") until the server listens, and stops working when \
the sandbox is destroyed or expires. HTTP, streaming responses and WebSockets pass through. \
private=true serves it only to requests with the sandbox's traffic_token (header \
x-sandpit-traffic-token) or the returned signed_url (good for an hour); others get 401.";

pub(crate) const D_GET: &str = "Get a sandbox's status, size, resources and expiry (expires_at).";

pub(crate) const D_LIST_SANDBOXES: &str = "\
List the sandboxes on this account, newest first (live ones only unless include_deleted): \
useful for finding strays to destroy. Pages with limit and starting_after = the previous \
page's next_cursor.";

pub(crate) const D_EXTEND: &str = "\
Push a sandbox's expiry out by additional_minutes (default 15) when a job outgrows its \
timeout. The extra time is reserved from the credit; the total lifetime may not pass 24 h \
from creation.";

pub(crate) const D_DESTROY: &str = "\
Destroy a sandbox and stop billing for it; the unused part of its reserved credit comes back. \
Everything in it is lost. Sandboxes are destroyed at expiry anyway, but destroying one when \
you are done returns the unused time. Destroying an already destroyed sandbox returns it again.";

pub(crate) const D_SNAPSHOT: &str = "\
Save the whole state of a running sandbox as a snapshot: its files, installed packages, memory \
and running processes. The sandbox runs on (it pauses only while its state is captured). \
Snapshot before a risky change (an upgrade, a migration, a big refactor), then call \
restore_sandbox to undo it if it goes wrong. Or snapshot a prepared environment once and start \
new sandboxes from it with create_sandbox's snapshot_id. Returns the snapshot (id `snap_...`, \
status, size_bytes, expires_at); it is kept until expires_at unless delete_snapshot removes it \
first.";

pub(crate) const D_FORK: &str = "\
Copy a running sandbox into `count` new sandboxes (1..10, default 1) that start exactly where \
it is now: same files, packages and running processes, each with its own id. Use it to try \
several approaches in parallel copies, then keep the copy that worked and destroy the others. \
The original runs on unchanged. Each copy is billed like a new sandbox for its \
timeout_minutes, reserved at once: if the credit cannot cover all of them, none is made. \
Returns the snapshot the copies were started from and the new sandboxes.";

pub(crate) const D_RESTORE: &str = "\
Roll a sandbox back to a snapshot, to undo what went wrong since snapshot_sandbox: everything \
done after it (files, installed packages, running processes) is lost. The snapshot must be one \
of this sandbox, or of the sandbox it was created or forked from, and of the same size. The \
sandbox keeps its id, exposed port URLs and expiry. Returns the sandbox.";

pub(crate) const D_PAUSE: &str = "\
Pause a sandbox you will not use for a while but want to keep: its VM stops with its whole state \
(files, memory, running processes) kept on disk, and it is billed at a tenth of its price. Any \
later run_command, file or port call resumes it first (a second or so), or call resume_sandbox. \
It still ends at its expires_at. Returns the sandbox (status paused).";

pub(crate) const D_RESUME: &str = "\
Resume a paused sandbox: its processes go on where they were. Not needed before other calls, \
which resume it themselves. Returns the sandbox (status running).";

pub(crate) const D_LIST_SNAPSHOTS: &str = "\
List this account's snapshots, newest first: id, name, the sandbox each was taken of, size on \
disk and expiry. Pages with limit and starting_after = the previous page's next_cursor.";

pub(crate) const D_LIST_TEMPLATES: &str = "\
List the templates this account may start sandboxes from (its own and those the operator \
published): for each name:tag its newest ready build, with its size and steps. Pass the name \
as create_sandbox's template to get a sandbox with the template's packages, files and \
environment, its server already running. all_builds=true lists every build instead (building, \
failed, older versions), newest first.";

pub(crate) const D_UPDATE_NETWORK: &str = "\
Replace what a sandbox may reach on the network: allow_out and deny_out, IPv4 addresses and \
prefixes, or host names (example.com, *.example.com: HTTP and HTTPS on ports 80 and 443, by \
the name the request itself carries). E.g. allow_out [\"pypi.org\", \"*.pythonhosted.org\"] \
with deny_out [\"0.0.0.0/0\"] reaches those sites only (names still resolve). An allowed \
destination is reached even inside a denied prefix; empty lists give back the service's usual \
network. In effect when this returns: a denied connect is refused at once. Returns the \
sandbox object with its network.";

pub(crate) const D_DELETE_SNAPSHOT: &str = "\
Delete a snapshot and free its disk once you no longer need to restore to it or start from it. \
Sandboxes already started from it are not affected. Snapshots are deleted at their expires_at \
anyway.";

pub(crate) const D_USAGE: &str = "\
Remaining credit (USD) and the usage of the last `days` days (default 30): each sandbox with \
its size, seconds and cost.";

pub(crate) const D_INFO: &str = "\
What this service is: name and version, the sandbox sizes with their resources and prices, \
timeouts and limits, hosts, the acceleration in use (kvm or tcg), what the guest looks like \
and how to authenticate. Needs no API key.";

pub(crate) const D_LIST_VOLUMES: &str = "\
List this account's volumes, by name: id, size_gb, status and the live sandboxes that mount \
each (mounted_by). A volume is storage that outlives sandboxes: a cloned repository, a \
dataset, a cache.";

pub(crate) const D_CREATE_VOLUME: &str = "\
Create an empty volume, storage that outlives sandboxes: a named ext4 file system (size_gb \
GiB, default 10) kept until delete_volume, whatever becomes of the sandboxes, and billed per \
GB-month while it exists (get_usage shows it). Mount it in a sandbox with create_sandbox's \
volumes: its root directory belongs to the sandbox's user, what is written there is kept when \
the sandbox ends, and the next sandbox that mounts it finds it.";

pub(crate) const D_DELETE_VOLUME: &str = "\
Delete a volume and everything on it, for good; its billing ends and its name is free again. \
Refused while a live sandbox mounts it (destroy that sandbox first).";
