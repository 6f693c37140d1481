"""E2B's Python SDK (sync), unchanged, through a cluster's control-plane
replica that runs no VMs: every call reaches the sandbox's node over the
node API.

Run by crates/cli/tests/e2e/cluster.rs with E2B_API_URL, E2B_SANDBOX_URL
and E2B_API_KEY pointing at the replica. Prints one `ok <check>` line per
check; any failure raises.
"""
import threading
import time

from e2b import CommandExitException, NotFoundException, Sandbox
from e2b import FilesystemEventType as Ev


def ok(what):
    print(f"ok {what}", flush=True)


sbx = Sandbox.create(timeout=120, metadata={"suite": "replica"})
try:
    r = sbx.commands.run("hostname")
    assert r.stdout.strip() == sbx.sandbox_id.replace("_", "-"), r
    ok("create, commands.run")

    seen = []
    sbx.commands.run(
        "for i in 1 2 3; do echo line $i; sleep 1; done",
        on_stdout=lambda line: seen.append(time.monotonic()),
    )
    assert len(seen) == 3 and seen[-1] - seen[0] >= 1.5, seen
    try:
        sbx.commands.run("exit 4")
        raise AssertionError("no CommandExitException")
    except CommandExitException as e:
        assert e.exit_code == 4, e
    ok("output as it comes, CommandExitException")

    ticker = sbx.commands.run("for i in $(seq 1 40); do echo tick $i; sleep 0.5; done", background=True)
    second = Sandbox.connect(sbx.sandbox_id)
    got = []
    follower = second.commands.connect(ticker.pid)
    ended = []

    def follow():
        try:
            follower.wait(on_stdout=got.append)
        except CommandExitException as e:
            ended.append(e.exit_code)

    waiter = threading.Thread(target=follow, daemon=True)
    waiter.start()
    deadline = time.monotonic() + 30
    while len(got) < 2:
        assert time.monotonic() < deadline, got
        time.sleep(0.1)
    assert ticker.kill() is True
    waiter.join(30)
    assert ended and ended[0] != 0, ended
    ok("background, connect from a second client, kill")

    sbx.files.write("r/hello.txt", "through the replica\n")
    assert sbx.files.read("r/hello.txt") == "through the replica\n"
    handle = sbx.files.watch_dir("r", recursive=True)
    sbx.commands.run("mkdir r/d && echo x > r/d/f && rm r/hello.txt")
    events, deadline = [], time.monotonic() + 30
    while ("hello.txt", Ev.REMOVE) not in events:
        assert time.monotonic() < deadline, events
        events += [(e.name, e.type) for e in handle.get_new_events()]
        time.sleep(0.2)
    assert ("d", Ev.CREATE) in events, events
    handle.stop()
    ok("files.write, files.read, watch_dir")

    assert sbx.kill() is True
    try:
        Sandbox.get_info(sbx.sandbox_id)
        raise AssertionError("a killed sandbox was found")
    except NotFoundException:
        pass
    ok("kill")
finally:
    try:
        sbx.kill()
    except Exception:
        pass
