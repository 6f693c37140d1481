"""E2B's Python SDK (sync), unchanged, against a Sandpit server.

Run by crates/cli/tests/e2e/e2b.rs with E2B_API_URL, E2B_SANDBOX_URL and
E2B_API_KEY pointing at the server; SANDPIT_REVOKED_KEY is a key that was
revoked. Prints one `ok <check>` line per check; any failure raises.
"""
import os
import threading
import time
import urllib.parse

from e2b import PtySize, Sandbox, Secret
from e2b import (
    AuthenticationException,
    CommandExitException,
    NotFoundException,
    SandboxException,
    SecretException,
    SecretNotFoundException,
)


def ok(what):
    print(f"ok {what}", flush=True)


def served(host, path):
    """What a server in a sandbox answers at `path` through its preview
    `host`, reached as the user's own program reaches it (urllib, which asks
    the system's resolver for the *.localhost name): 502 until it listens."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"http://{host}{path}", timeout=10) as resp:
                return resp.read().decode()
        except urllib.error.HTTPError as e:
            assert e.code == 502 and time.monotonic() < deadline, e
        except urllib.error.URLError as e:
            raise AssertionError(f"http://{host}/ did not resolve or connect: {e}")
        time.sleep(0.5)


# http://ADDRESS:8080/hello.txt on a test host of the harness's.
INTERNET = os.environ["SANDPIT_INTERNET"]

# A sandbox left to its timeout (1 s asks for Sandpit's shortest life, a
# minute), checked at the end: by then it is past it, or the end waits.
short = Sandbox.create(timeout=1)
short_made = time.monotonic()

sbx = Sandbox.create(timeout=120, metadata={"suite": "python-sync", "run": "1"}, envs={"FROM_CREATE": "made at create"})
try:
    assert sbx.sandbox_id, sbx
    ok("create")

    r = sbx.commands.run("uname -a")
    assert r.exit_code == 0 and r.stdout.startswith("Linux"), r
    ok("commands.run")

    # All a command writes comes back, not the first megabyte of it.
    r = sbx.commands.run("head -c 3000000 /dev/zero | tr '\\0' x")
    assert len(r.stdout) == 3_000_000 and set(r.stdout) == {"x"}, len(r.stdout)
    ok("3 MB of output, whole")

    # Output reaches the callbacks as it is written, not at the end.
    seen = []
    r = sbx.commands.run(
        "for i in 1 2 3 4; do echo line $i; sleep 1; done",
        on_stdout=lambda line: seen.append((time.monotonic(), line)),
    )
    assert [l.strip() for _, l in seen] == ["line 1", "line 2", "line 3", "line 4"], seen
    spread = seen[-1][0] - seen[0][0]
    assert spread >= 2.5, f"the callbacks came {spread:.2f} s apart from first to last"
    ok(f"on_stdout as it comes ({spread:.1f} s from first to last)")

    errs = []
    try:
        sbx.commands.run("echo out; echo oops >&2; exit 3", on_stderr=errs.append)
        raise AssertionError("no CommandExitException")
    except CommandExitException as e:
        assert e.exit_code == 3, e
        assert e.stdout.strip() == "out" and e.stderr.strip() == "oops", (e.stdout, e.stderr)
        assert [x.strip() for x in errs] == ["oops"], errs
    ok("CommandExitException")

    r = sbx.commands.run("pwd; echo $FROM_CREATE; echo $MINE", cwd="/tmp", envs={"MINE": "mine"})
    assert r.stdout.split("\n")[:3] == ["/tmp", "made at create", "mine"], r.stdout
    r = sbx.commands.run("pwd; whoami")
    assert r.stdout.split() == ["/home/user", "user"], r.stdout
    ok("cwd, envs, the create's envs, the default user")

    try:
        sbx.commands.run("sleep 30", timeout=2)
        raise AssertionError("no timeout")
    except Exception as e:  # the SDK's TimeoutException
        assert "timeout" in type(e).__name__.lower() or "deadline" in str(e).lower(), repr(e)
    ok("timeout")

    try:
        sbx.commands.run("id", user="root")
        raise AssertionError("root was allowed")
    except SandboxException as e:
        assert "unprivileged" in str(e), e
    ok("another user is refused, saying why")

    # Background commands are the guest's processes, by their real pids:
    # listed, followed by a second client from then on, killed.
    ticker = sbx.commands.run(
        "for i in $(seq 1 60); do echo tick $i; sleep 0.5; done", background=True
    )
    pid = ticker.pid
    assert pid > 1, pid
    r = sbx.commands.run(f"kill -0 {pid} && echo alive")
    assert r.stdout.strip() == "alive", r
    listed = {p.pid: p for p in sbx.commands.list()}
    assert pid in listed and "tick" in " ".join(listed[pid].args), listed
    ticker.disconnect()
    time.sleep(1.5)
    import threading

    other = Sandbox.connect(sbx.sandbox_id)
    later = other.commands.connect(pid)
    seen = []

    # Killed once the second client has seen three ticks (a busy host may
    # take longer than their second and a half).
    def kill_after_three_ticks():
        deadline = time.time() + 60
        while "".join(seen).count("tick") < 3 and time.time() < deadline:
            time.sleep(0.1)
        sbx.commands.kill(pid)

    killer = threading.Thread(target=kill_after_three_ticks)
    killer.start()
    try:
        later.wait(on_stdout=seen.append)
        raise AssertionError("a killed command ended well")
    except CommandExitException as e:
        assert e.exit_code != 0, e
    killer.join()
    ticks = [int(line.split()[1]) for line in "".join(seen).split("\n") if line.startswith("tick")]
    assert len(ticks) >= 3 and ticks[0] > 1, f"the second client saw {ticks}"
    assert ticks == list(range(ticks[0], ticks[0] + len(ticks))), ticks
    assert pid not in [p.pid for p in sbx.commands.list()]
    assert sbx.commands.kill(pid) is False, "an ended command was killed"
    ok(f"background, list, connect from a second client (from tick {ticks[0]}), kill")

    cat = sbx.commands.run("cat; echo done >&2", background=True, stdin=True)
    cat.send_stdin("hello ")
    sbx.commands.send_stdin(cat.pid, b"stdin\n")
    cat.close_stdin()
    r = cat.wait()
    assert (r.stdout, r.stderr.strip()) == ("hello stdin\n", "done"), r
    no_stdin = sbx.commands.run("sleep 20", background=True)
    try:
        no_stdin.send_stdin("x")
        raise AssertionError("input went to a command without stdin")
    except SandboxException as e:
        assert "stdin" in str(e), e
    assert no_stdin.kill() is True
    ok("send_stdin, close_stdin; a command without stdin refuses input")

    # A terminal: bash on a pty, typed into, resized, exited. Its output is
    # gathered by a thread waiting on it while this one types.
    chunks = []
    term = sbx.pty.create(PtySize(rows=24, cols=80))
    ended = []

    def wait_for_the_terminal():
        try:
            ended.append(term.wait(on_pty=chunks.append).exit_code)
        except CommandExitException as e:
            ended.append(e.exit_code)

    waiter = threading.Thread(target=wait_for_the_terminal)
    waiter.start()

    def screen():
        return b"".join(chunks).decode(errors="replace")

    def shows(text, within=60):
        deadline = time.monotonic() + within
        while text not in screen():
            assert time.monotonic() < deadline, (text, screen())
            time.sleep(0.1)

    sbx.pty.send_stdin(term.pid, b"stty size; echo $TERM; tty; echo typed-$((6*7))\n")
    shows("typed-42")
    # A terminal does not go quiet after its first megabyte.
    sbx.pty.send_stdin(term.pid, b"head -c 3000000 /dev/zero | tr '\\0' a; echo; echo after-$((6*7))\n")
    shows("after-42")
    assert screen().count("a") >= 3_000_000, screen().count("a")
    assert "24 80" in screen() and "xterm-256color" in screen() and "/dev/pts/" in screen(), screen()
    sbx.pty.resize(term.pid, PtySize(rows=50, cols=132))
    sbx.pty.send_stdin(term.pid, b"stty size; exit 3\n")
    waiter.join(60)
    assert not waiter.is_alive(), screen()
    assert "50 132" in screen(), screen()
    assert ended == [3], ended
    ok("pty: create, send_stdin, resize, exit")

    # A server in the sandbox, on a port nobody exposed, reached through
    # get_host as the user's own program reaches it: urllib, which asks the
    # system's resolver for the *.localhost name.
    import urllib.error
    import urllib.request

    sbx.files.write("site/index.html", "served from the sandbox\n")
    server = sbx.commands.run("cd site && exec python3 -m http.server 8000", background=True)
    host = sbx.get_host(8000)
    assert host.startswith(f"8000-{sbx.sandbox_id}."), host
    body = served(host, "/index.html")
    assert body == "served from the sandbox\n", body
    assert server.kill() is True
    # 502 once nothing listens (a connection the proxy held to the killed
    # server may first end in a 503).
    deadline = time.monotonic() + 20
    while True:
        try:
            urllib.request.urlopen(f"http://{host}/index.html", timeout=10)
            raise AssertionError("a killed server still answered")
        except urllib.error.HTTPError as e:
            if e.code == 502:
                break
            assert e.code == 503 and time.monotonic() < deadline, e
        time.sleep(0.5)
    ok(f"get_host: a background http.server reached at {host.split('.')[0]}…, then killed")

    info = sbx.files.write("notes/hello.txt", "hello from the SDK\n")
    assert info.path == "/home/user/notes/hello.txt", info
    assert sbx.files.read("notes/hello.txt") == "hello from the SDK\n"
    blob = bytes(range(256)) * 4096
    sbx.files.write("/tmp/blob.bin", blob)
    back = sbx.files.read("/tmp/blob.bin", format="bytes")
    assert bytes(back) == blob, len(back)
    r = sbx.commands.run("sha256sum /tmp/blob.bin | cut -c1-16")
    import hashlib
    assert r.stdout.strip() == hashlib.sha256(blob).hexdigest()[:16], r.stdout
    try:
        sbx.files.read("/no/such/file")
        raise AssertionError("read a missing file")
    except NotFoundException:
        pass
    ok("files.write and files.read (text, 1 MiB of every byte value, a missing file)")

    assert sbx.files.exists("notes/hello.txt") and not sbx.files.exists("notes/nothing")
    fi = sbx.files.get_info("notes/hello.txt")
    assert (fi.name, fi.path, fi.size) == ("hello.txt", "/home/user/notes/hello.txt", 19), fi
    assert getattr(fi.type, "value", fi.type) == "file" and fi.owner == "user", fi
    assert sbx.files.make_dir("deep/er/est") is True
    assert sbx.files.make_dir("deep/er") is False, "making a directory that is there"
    sbx.files.write("deep/er/est/leaf.txt", "leaf")
    top = sbx.files.list("deep")
    assert [(e.name, getattr(e.type, "value", e.type)) for e in top] == [("er", "dir")], top
    all3 = sorted(e.path for e in sbx.files.list("deep", depth=3))
    assert all3 == ["/home/user/deep/er", "/home/user/deep/er/est", "/home/user/deep/er/est/leaf.txt"], all3
    moved = sbx.files.rename("deep/er/est/leaf.txt", "deep/leaf.txt")
    assert moved.path == "/home/user/deep/leaf.txt", moved
    assert sbx.files.read("deep/leaf.txt") == "leaf"
    sbx.files.remove("deep")
    assert not sbx.files.exists("deep")
    # The kernel decides, as the user: root's files stay root's.
    try:
        sbx.files.make_dir("/root/mine")
        raise AssertionError("the user made a directory in /root")
    except SandboxException:
        pass
    ok("files.exists, get_info, make_dir, list with depth, rename, remove")

    # watch_dir (the sync SDK polls): what commands do in a watched tree,
    # named relative to it, in order; a directory made later is followed.
    from e2b import FilesystemEventType as Ev

    sbx.files.make_dir("watched/sub")
    handle = sbx.files.watch_dir("watched", recursive=True)

    def wait_for(wanted, within=30):
        got, deadline = [], time.monotonic() + within
        while True:
            got += [(e.name, e.type) for e in handle.get_new_events()]
            rest = iter(got)
            if all(w in rest for w in wanted):  # in this order
                return got
            assert time.monotonic() < deadline, (wanted, got)
            time.sleep(0.2)

    sbx.commands.run(
        "echo hi > watched/sub/made.txt && mv watched/sub/made.txt watched/moved.txt"
        " && chmod 600 watched/moved.txt && rm watched/moved.txt && mkdir watched/later"
    )
    wait_for([
        ("sub/made.txt", Ev.CREATE), ("sub/made.txt", Ev.WRITE), ("sub/made.txt", Ev.RENAME),
        ("moved.txt", Ev.CREATE), ("moved.txt", Ev.CHMOD), ("moved.txt", Ev.REMOVE),
        ("later", Ev.CREATE),
    ])
    sbx.commands.run("echo deeper > watched/later/inner.txt")
    wait_for([("later/inner.txt", Ev.CREATE), ("later/inner.txt", Ev.WRITE)])
    handle.stop()
    try:
        sbx.files.watch_dir("no/such/dir")
        raise AssertionError("a missing directory was watched")
    except NotFoundException:
        pass
    # The kernel decides, as the user: root's home is not the user's to watch.
    try:
        sbx.files.watch_dir("/root")
        raise AssertionError("the user watched /root")
    except SandboxException as e:
        assert "ermission" in str(e), e
    ok("watch_dir: a command's writes, recursive, a directory made later, stop, refusals")

    # Signed URLs, opened as a browser or curl would: no SDK, no headers.
    import json
    import urllib.error
    import urllib.request

    def fetch(url, body=None, content_type=None):
        req = urllib.request.Request(url, data=body, method="POST" if body is not None else "GET")
        if content_type:
            req.add_header("Content-Type", content_type)
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    sbx.files.write("signed/down.txt", "signed and delivered")
    status, body = fetch(sbx.download_url("signed/down.txt"))
    assert (status, body) == (200, b"signed and delivered"), (status, body)
    status, body = fetch(sbx.download_url("signed/down.txt", use_signature_expiration=600))
    assert (status, body) == (200, b"signed and delivered"), (status, body)
    url = sbx.download_url("signed/down.txt", use_signature_expiration=-10)
    status, body = fetch(url)
    assert status == 401 and json.loads(body)["message"] == "signature is already expired", (status, body)
    # A URL signed for one file opens no other, and not for writing.
    other = sbx.download_url("signed/down.txt").replace("down.txt", "other.txt")
    status, body = fetch(other)
    assert status == 401, (status, body)
    boundary = "sandpit-signed"
    form = (
        f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"blob\"\r\n"
        f"Content-Type: application/octet-stream\r\n\r\nuploaded by URL\r\n--{boundary}--\r\n"
    ).encode()
    multipart = f"multipart/form-data; boundary={boundary}"
    status, body = fetch(sbx.download_url("signed/up.txt"), form, multipart)
    assert status == 401, ("a read signature wrote", status, body)
    status, body = fetch(sbx.upload_url("signed/up.txt", use_signature_expiration=600), form, multipart)
    assert status == 200, (status, body)
    assert json.loads(body) == [{"name": "up.txt", "path": "/home/user/signed/up.txt", "type": "file"}], body
    assert sbx.files.read("signed/up.txt") == "uploaded by URL"
    ok("download_url and upload_url, signed, opened without the SDK (an expired, a moved or a read signature refused)")

    # An iterable is streamed (chunked, no length): held by the server up to
    # its max_body_bytes (8 MiB in this test's server), refused past it.
    chunk = bytes(range(256)) * 4096
    sbx.files.write("streamed.bin", iter([chunk] * 3), use_octet_stream=True)
    assert sbx.files.get_info("streamed.bin").size == 3 * len(chunk)
    try:
        sbx.files.write("too-big.bin", iter([chunk] * 9), use_octet_stream=True)
        raise AssertionError("9 MiB of unknown length were taken")
    except SandboxException as e:
        assert "max_body_bytes" in str(e), e
    assert not sbx.files.exists("too-big.bin")
    ok("a streamed upload of unknown length: 3 MiB written, 9 MiB refused past the server's limit")

    # gzip=True: compressed on the way, written as it was; one that would
    # decompress past the server's limit is refused, and nothing is written.
    packed = b"gzip me, sandbox\n" * 250_000
    sbx.files.write("gz/packed.txt", packed, gzip=True)
    assert sbx.files.read("gz/packed.txt", format="bytes") == packed
    try:
        sbx.files.write("gz/bomb.bin", bytes(64 << 20), gzip=True)
        raise AssertionError("64 MiB of zeros were decompressed")
    except SandboxException as e:
        assert "max_body_bytes" in str(e), e
    assert not sbx.files.exists("gz/bomb.bin")
    ok("gzip uploads: 4 MiB written whole, a 64 MiB bomb refused")

    assert sbx.is_running()
    got = sbx.get_info()
    assert got.sandbox_id == sbx.sandbox_id and got.metadata == {"suite": "python-sync", "run": "1"}, got
    assert got.state.value == "running" if hasattr(got.state, "value") else got.state == "running", got
    ok("is_running, get_info")

    # Metrics: each call reads the guest, and the readings are kept. A
    # busy loop on one of the two vCPUs shows as about half the CPU between
    # two calls; 64 MiB written show on the disk.
    first = sbx.get_metrics()
    assert len(first) >= 1, first
    m = first[-1]
    assert m.cpu_count == 2 and 0 <= m.cpu_used_pct <= 100, m
    assert 0 < m.mem_used < m.mem_total and m.mem_cache > 0, m
    assert 0 < m.disk_used < m.disk_total, m
    spin = sbx.commands.run("timeout 60 sh -c 'while :; do :; done'", background=True)
    time.sleep(2)
    busy = sbx.get_metrics()[-1]
    assert spin.kill(), "the busy loop had ended"
    assert busy.cpu_used_pct >= 20, ("one busy vCPU of two", busy)
    sbx.commands.run("head -c 67108864 /dev/zero > /home/user/64m.bin && sync")
    series = sbx.get_metrics()
    assert len(series) >= 3, series
    assert series[-1].disk_used - m.disk_used >= 60 << 20, (m, series[-1])
    stamps = [s.timestamp for s in series]
    assert stamps == sorted(stamps), stamps
    import datetime as _dt
    later = _dt.datetime.now(_dt.timezone.utc) + _dt.timedelta(hours=1)
    assert sbx.get_metrics(start=later) == [], "readings from the future"
    sbx.commands.run("rm /home/user/64m.bin")
    ok(f"get_metrics: a reading per call, {busy.cpu_used_pct:.0f}% CPU with one vCPU busy, 64 MiB on the disk")

    found = Sandbox.list(query=None).next_items()
    assert any(s.sandbox_id == sbx.sandbox_id for s in found), found
    from e2b import SandboxQuery
    mine = Sandbox.list(query=SandboxQuery(metadata={"suite": "python-sync"})).next_items()
    assert [s.sandbox_id for s in mine] == [sbx.sandbox_id], mine
    none = Sandbox.list(query=SandboxQuery(metadata={"suite": "nobody"})).next_items()
    assert none == [], none
    ok("list, filtered by metadata")

    before = sbx.get_info().end_at
    sbx.set_timeout(600)
    after = sbx.get_info().end_at
    assert after > before, (before, after)
    # Shorter again (Sandpit counts whole minutes from the creation, so the
    # end is within a minute after what was asked; the end is given in
    # whole seconds, so it may read up to a second before it).
    import datetime

    second = datetime.timedelta(seconds=1)
    asked = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=300)
    sbx.set_timeout(300)
    shorter = sbx.get_info().end_at
    assert asked - second < shorter < min(after, asked + 61 * second), (asked, shorter, after)
    ok("set_timeout, longer then shorter")

    again = Sandbox.connect(sbx.sandbox_id)
    assert again.commands.run("echo again").stdout.strip() == "again"
    ok("connect")

    # A snapshot, a sandbox made from it, a fork: each holds what was
    # written before.
    sbx.files.write("kept.txt", "kept in the snapshot")
    snap = sbx.create_snapshot(name="before-fork")
    assert snap.snapshot_id.startswith("snap_") and "before-fork" in snap.names, snap
    listed = [s.snapshot_id for s in sbx.list_snapshots().next_items()]
    assert snap.snapshot_id in listed, listed
    from_snap = Sandbox.create(template=snap.snapshot_id, timeout=60)
    try:
        assert from_snap.sandbox_id != sbx.sandbox_id
        assert from_snap.files.read("kept.txt") == "kept in the snapshot"
    finally:
        from_snap.kill()
    forks = sbx.fork(timeout=60)
    assert len(forks) == 1 and not isinstance(forks[0], Exception), forks
    try:
        assert forks[0].files.read("kept.txt") == "kept in the snapshot"
        assert forks[0].sandbox_id != sbx.sandbox_id
    finally:
        forks[0].kill()
    assert Sandbox.delete_snapshot(snap.snapshot_id) is True
    assert Sandbox.delete_snapshot(snap.snapshot_id) is False
    ok("create_snapshot, list_snapshots, create from a snapshot, fork, delete_snapshot")

    # "The internet": a test host of the harness's, which a sandbox with
    # the operator's network reaches.
    r = sbx.commands.run(f"curl -sS -m 20 {INTERNET}")
    assert r.stdout == "hello from the internet\n", r
    ok("the internet reached")

    # Paused, then connected again: a process and what it held in memory
    # are as they were.
    sbx.commands.run(
        "nohup sleep 1000 >/dev/null 2>&1 & echo $! > /tmp/sleeper; "
        "head -c 1M /dev/urandom > /dev/shm/mem; sha256sum /dev/shm/mem > /tmp/mem.sum"
    )
    assert sbx.pause() is True
    state = Sandbox.get_info(sbx.sandbox_id).state
    assert getattr(state, "value", state) == "paused", state
    assert not sbx.is_running()
    assert Sandbox.pause(sbx.sandbox_id) is False, "a second pause should say it already was"
    from e2b import SandboxQuery, SandboxState
    paused = Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED])).next_items()
    running = Sandbox.list(query=SandboxQuery(state=[SandboxState.RUNNING])).next_items()
    assert sbx.sandbox_id in [s.sandbox_id for s in paused], paused
    assert sbx.sandbox_id not in [s.sandbox_id for s in running], running
    resumed = Sandbox.connect(sbx.sandbox_id)
    r = resumed.commands.run("kill -0 $(cat /tmp/sleeper) && sha256sum -c --quiet /tmp/mem.sum && echo intact")
    assert r.stdout.strip() == "intact", r
    assert resumed.is_running()
    ok("pause, then connect resumes it with its processes and memory")
finally:
    killed = sbx.kill()

assert killed is True, killed
assert not sbx.is_running()
try:
    Sandbox.get_info(sbx.sandbox_id)
    raise AssertionError("a killed sandbox was found")
except NotFoundException:
    pass
assert Sandbox.kill(sbx.sandbox_id) is False
ok("kill; a killed sandbox is not found")



def curl_exit(sandbox, url):
    """curl's exit status in `sandbox`: 0 fetched, 6 no such name, 7
    refused, 28 timed out."""
    r = sandbox.commands.run(f"curl -sS -m 20 -o /dev/null {url}; echo $?")
    return int(r.stdout.strip().splitlines()[-1])


def blocked(sandbox):
    """Nothing leaves, and fails at once: refused, not a timeout; no name
    resolves."""
    assert curl_exit(sandbox, INTERNET) == 7
    assert curl_exit(sandbox, "http://pypi.org/simple/") == 6


# allow_internet_access=False: nothing leaves the sandbox, and saying so at
# once; commands, files and its ports through get_host work as ever, and
# it stays without internet across a pause and a resume.
offline = Sandbox.create(timeout=120, allow_internet_access=False)
try:
    blocked(offline)
    info = Sandbox.get_info(offline.sandbox_id)
    assert info.allow_internet_access is False, info
    offline.files.write("site/index.html", "served without internet\n")
    server = offline.commands.run("cd site && exec python3 -m http.server 8000", background=True)
    host = offline.get_host(8000)
    body = served(host, "/index.html")
    assert body == "served without internet\n", body
    server.kill()
    assert offline.pause() is True
    resumed = Sandbox.connect(offline.sandbox_id)
    blocked(resumed)
    # A fork is a copy of the machine, its network included.
    forks = resumed.fork(timeout=60)
    assert len(forks) == 1 and not isinstance(forks[0], Exception), forks
    try:
        blocked(forks[0])
        assert Sandbox.get_info(forks[0].sandbox_id).allow_internet_access is False
    finally:
        forks[0].kill()
finally:
    offline.kill()
ok("allow_internet_access=False: nothing leaves, at once; get_host works; still so after a pause and in a fork")

# Secrets (E2B's `Secret`): values written once, never read back; listed
# a page at a time, found by name and by id, given new values (versions).
SECRET_VALUE = os.environ["SANDPIT_SECRET_VALUE"]
made = Secret.create("Web-Token", SECRET_VALUE, metadata={"suite": "python-sync"})
assert made.name == "web-token" and made.version == 1, made
assert made.secret_id.startswith("sec_") and made.metadata == {"suite": "python-sync"}, made
for name in ("extra-a", "extra-b"):
    Secret.create(name, "v-" + name)
pager = Secret.list(limit=2)
names, pages = [], 0
while pager.has_next:
    names += [s.name for s in pager.next_items()]
    pages += 1
assert names == ["extra-a", "extra-b", "web-token"] and pages == 2, (names, pages)
assert Secret.get_info("web-token").secret_id == made.secret_id
assert Secret.get_info(made.secret_id).name == "web-token"
updated = Secret.update("web-token", SECRET_VALUE)
assert updated.version == 2 and updated.metadata == {"suite": "python-sync"}, updated
assert updated.secret_id == made.secret_id, updated
assert Secret.destroy("extra-a") is True
try:
    Secret.get_info("extra-a")
    raise AssertionError("a destroyed secret was found")
except SecretNotFoundException:
    pass
assert Secret.destroy("extra-a") is False
assert Secret.exists("extra-b") and not Secret.exists("extra-a")
try:
    Secret.create("not.a.name", "v")
    raise AssertionError("a name with a dot was accepted")
except (SecretException, SandboxException) as e:
    assert "letters, digits" in str(e), e
ok("Secret: create, list paged, get_info by name and id, update (version 2), destroy, then not found; a bad name refused")

# A sandbox's own lists: an allow list with everything else denied reaches
# the allowed host and is refused elsewhere at once (curl's 7, not a
# timeout); update_network replaces them on the running sandbox, and on a
# paused one for when it resumes; a domain rule is refused by name. Its
# network rules set a header holding the secret on its HTTPS requests to
# web.test (the test host's site, whose answer shows the value as `<the
# secret>`): set on the host, the value never in the guest.
internet_ip = urllib.parse.urlparse(INTERNET).hostname
ELSEWHERE = "http://198.51.100.1:8080/"
WEB = (
    f"curl -sS -m 20 --resolve web.test:443:{internet_ip} "
    "-H 'Authorization: Bearer mine' https://web.test/echo"
)


def header_rules(value):
    return {"web.test": [{"transform": {"headers": {"Authorization": value}}}]}


try:
    Sandbox.create(
        timeout=60, network={"rules": header_rules("Bearer ${e2b.secrets.nope}")}
    )
    raise AssertionError("a rule naming no secret was accepted")
except SandboxException as e:
    assert "no secret named" in str(e), e
listed = Sandbox.create(
    timeout=120,
    network={
        "allow_out": [internet_ip],
        "deny_out": ["0.0.0.0/0"],
        "rules": header_rules(f"Bearer {Secret.fill('web-token')}"),
    },
)
try:
    seen = listed.commands.run(WEB).stdout
    assert "Authorization: Bearer <the secret>" in seen and "mine" not in seen, seen
    env = listed.commands.run("env").stdout
    assert SECRET_VALUE not in env and "e2b.secrets" not in env, env
    found = listed.commands.run(
        f"grep -rl {SECRET_VALUE} /etc /tmp /root /home 2>/dev/null; true"
    ).stdout
    assert found.strip() == "", found
    listed.update_network(
        {
            "allow_out": [internet_ip],
            "deny_out": ["0.0.0.0/0"],
            "rules": header_rules("Token ${e2b.secrets.web-token}"),
        }
    )
    seen = listed.commands.run(WEB).stdout
    assert "Authorization: Token <the secret>" in seen, seen
    try:
        listed.update_network({"rules": header_rules("${e2b.secrets.nope}")})
        raise AssertionError("a rule naming no secret was accepted")
    except SandboxException as e:
        assert "no secret named" in str(e), e
    ok("network rules: a header with a secret set on the host for its domain (HTTPS), never in the guest; replaced by update_network; an unknown secret refused")
    assert curl_exit(listed, INTERNET) == 0
    assert curl_exit(listed, ELSEWHERE) == 7
    listed.update_network({"deny_out": [f"{internet_ip}/32"]})
    assert curl_exit(listed, INTERNET) == 7
    listed.update_network({})
    assert curl_exit(listed, INTERNET) == 0
    listed.update_network({"allow_internet_access": False})
    blocked(listed)
    assert listed.pause() is True
    Sandbox.update_network(listed.sandbox_id, {"allow_out": [internet_ip], "deny_out": ["0.0.0.0/0"]})
    resumed = Sandbox.connect(listed.sandbox_id)
    assert curl_exit(resumed, INTERNET) == 0
    assert curl_exit(resumed, ELSEWHERE) == 7
    try:
        resumed.update_network({"allow_out": ["exa mple.com"], "deny_out": ["0.0.0.0/0"]})
        raise AssertionError("a broken host name was accepted")
    except SandboxException as e:
        assert "is not a host name" in str(e), e
    # Refused whole: the lists it had still hold.
    assert curl_exit(resumed, INTERNET) == 0
    # A host name allows that name's HTTP(S) (ports 80 and 443) only: the
    # test host's port 8080 by address is refused.
    resumed.update_network({"allow_out": ["web.test"], "deny_out": ["0.0.0.0/0"]})
    assert curl_exit(resumed, INTERNET) == 7
finally:
    listed.kill()
ok("network allow_out and deny_out: a denied host refused at once, an allowed one reached; update_network on a running and a paused sandbox; a broken host name refused saying why")

# allow_public_traffic=False: every port wants the traffic token, in E2B's
# header; without it, 403 (as E2B answers) and the guest sees nothing.
def status_of(host, headers):
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + 60
    while True:
        req = urllib.request.Request(f"http://{host}/", headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as e:
            if e.code != 502 or time.monotonic() > deadline:
                return e.code, e.read().decode()
        time.sleep(0.5)


guarded = Sandbox.create(timeout=120, network={"allow_public_traffic": False})
try:
    token = guarded.traffic_access_token
    assert token, "a sandbox with private traffic has a traffic access token"
    guarded.files.write("site/index.html", "for token holders\n")
    guarded.commands.run("cd site && exec python3 -m http.server 8000", background=True)
    host = guarded.get_host(8000)
    code, body = status_of(host, {"e2b-traffic-access-token": token})
    assert (code, body) == (200, "for token holders\n"), (code, body)
    code, _ = status_of(host, {})
    assert code == 403, code
    code, _ = status_of(host, {"e2b-traffic-access-token": "tt_" + "0" * 40})
    assert code == 403, code
finally:
    guarded.kill()
ok("network allow_public_traffic=False: 403 without the traffic access token, served with it")

for key in ["e2b_" + "0" * 50, os.environ["SANDPIT_REVOKED_KEY"]]:
    try:
        Sandbox.create(api_key=key)
        raise AssertionError("a bad key was accepted")
    except AuthenticationException:
        pass
ok("a wrong or revoked key is refused")

# An account without credit: the SDK's error carries Sandpit's 402 and says
# why, and nothing was started.
try:
    Sandbox.create(api_key=os.environ["SANDPIT_BROKE_KEY"])
    raise AssertionError("an account without credit created a sandbox")
except SandboxException as e:
    assert getattr(e, "status_code", None) == 402 and "credit" in str(e), (repr(e), getattr(e, "status_code", None))
ok("an account without credit is refused with 402, saying why")

# An account at its limit of live sandboxes: 429, the SDK's
# RateLimitException, saying why, and nothing started. The limit stays
# until the account ends a sandbox, so the answer tells the SDK not to
# retry (by default it would wait out Retry-After three times first).
import json
import urllib.request

from e2b import RateLimitException

limited = os.environ["SANDPIT_LIMITED_KEY"]
only = Sandbox.create(api_key=limited, timeout=60)
try:
    try:
        Sandbox.create(api_key=limited)
        raise AssertionError("an account past its limit created a sandbox")
    except RateLimitException as e:
        assert "limit is 1" in str(e), repr(e)
    raw = urllib.request.Request(
        os.environ["E2B_API_URL"] + "/sandboxes",
        data=json.dumps({"templateID": "base"}).encode(),
        headers={"X-API-KEY": limited, "Content-Type": "application/json"},
    )
    try:
        urllib.request.urlopen(raw, timeout=30)
        raise AssertionError("an account past its limit created a sandbox")
    except urllib.error.HTTPError as e:
        # Nor a Retry-After, which the JavaScript SDK retries on.
        assert e.code == 429 and e.headers.get("Should-Retry") == "false", (e.code, dict(e.headers))
        assert e.headers.get("Retry-After") is None, dict(e.headers)
    assert [s.sandbox_id for s in Sandbox.list(api_key=limited).next_items()] == [only.sandbox_id]
finally:
    only.kill()
ok("an account at its limit of sandboxes gets RateLimitException (429), saying why, and the SDK is told not to retry")

# Past its timeout, nobody having killed it: not found, and its commands
# fail saying so.
time.sleep(max(0.0, short_made + 75 - time.monotonic()))
try:
    Sandbox.get_info(short.sandbox_id)
    raise AssertionError("a sandbox past its timeout was found")
except NotFoundException:
    pass
try:
    short.commands.run("true")
    raise AssertionError("a sandbox past its timeout ran a command")
except SandboxException as e:
    assert "not found" in str(e).lower() or isinstance(e, NotFoundException), repr(e)
assert short.sandbox_id not in [s.sandbox_id for s in Sandbox.list().next_items()]
ok("a sandbox past its timeout is not found")

# Every check is done. Leave without the interpreter's teardown: once, on a
# loaded machine, the async script ended with a failing status and nothing
# on stderr after its last check (its HTTP client is a native extension);
# what the SDK did for the checks is what this script tests.
import sys

sys.stdout.flush()
os._exit(0)
