"""E2B's Python SDK (async), unchanged, against a Sandpit server.

Run by crates/cli/tests/e2e/e2b.rs like python_sync.py. Prints one
`ok <check>` line per check; any failure raises.
"""
import asyncio
import time

from e2b import AsyncSandbox, AsyncVolume, CommandExitException, NotFoundException


def ok(what):
    print(f"ok {what}", flush=True)


async def main():
    sbx = await AsyncSandbox.create(timeout=120, metadata={"suite": "python-async"}, envs={"FROM_CREATE": "async"})
    try:
        ok("create")
        seen = []
        r = await sbx.commands.run(
            "for i in 1 2 3 4; do echo line $i; sleep 1; done; echo $FROM_CREATE",
            on_stdout=lambda line: seen.append((time.monotonic(), line)),
        )
        assert r.stdout.split() == ["line", "1", "line", "2", "line", "3", "line", "4", "async"], r.stdout
        spread = seen[3][0] - seen[0][0]
        assert spread >= 2.5, f"the callbacks came {spread:.2f} s apart"
        ok(f"commands.run, output as it comes ({spread:.1f} s), the create's envs")

        # watch_dir (async: a stream): a file the SDK writes, seen as it
        # is made; the stream ends when stopped.
        from e2b import FilesystemEventType

        await sbx.files.make_dir("awatched")
        seen_events = []
        handle = await sbx.files.watch_dir("awatched", on_event=seen_events.append)
        await sbx.files.write("awatched/note.txt", "watched")
        for _ in range(300):
            if ("note.txt", FilesystemEventType.CREATE) in [(e.name, e.type) for e in seen_events]:
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError([(e.name, e.type) for e in seen_events])
        await handle.stop()
        ok("watch_dir as a stream")

        # Two commands at once on one sandbox.
        a, b = await asyncio.gather(
            sbx.commands.run("sleep 1; echo a"), sbx.commands.run("sleep 1; echo b")
        )
        assert (a.stdout.strip(), b.stdout.strip()) == ("a", "b"), (a, b)
        ok("two commands at once")

        try:
            await sbx.commands.run("exit 7")
            raise AssertionError("no CommandExitException")
        except CommandExitException as e:
            assert e.exit_code == 7, e
        ok("CommandExitException")

        # A background command streams to its callback while the script
        # goes on; stdin and a kill by pid end it.
        lines = []
        bg = await sbx.commands.run(
            "while read -r l; do echo got $l; done",
            background=True,
            stdin=True,
            on_stdout=lines.append,
        )
        listed = [p.pid for p in await sbx.commands.list()]
        assert bg.pid in listed, listed
        await sbx.commands.send_stdin(bg.pid, "one\n")
        await sbx.commands.send_stdin(bg.pid, "two\n")
        for _ in range(100):
            if "".join(lines).count("got") == 2:
                break
            await asyncio.sleep(0.1)
        assert "".join(lines) == "got one\ngot two\n", lines
        assert await sbx.commands.kill(bg.pid) is True
        try:
            await bg.wait()
            raise AssertionError("a killed command ended well")
        except CommandExitException:
            pass
        ok("background with callbacks, send_stdin, list, kill")

        await sbx.files.write("async.txt", "written async")
        assert await sbx.files.read("async.txt") == "written async"
        ok("files")

        info = await sbx.get_info()
        assert info.metadata == {"suite": "python-async"}, info
        assert await sbx.is_running()
        ok("get_info, is_running")
    finally:
        assert await sbx.kill() is True
    try:
        await AsyncSandbox.get_info(sbx.sandbox_id)
        raise AssertionError("a killed sandbox was found")
    except NotFoundException:
        pass
    ok("kill")

    await volumes()


async def volumes():
    """E2B's volumes: made, filled and read without a sandbox (the volume
    content API, by the volume's own token), then mounted in a sandbox
    that sees and changes the files, then destroyed."""
    vol = await AsyncVolume.create("py-async-data")
    assert vol.name == "py-async-data" and vol.volume_id.startswith("vol_"), vol
    assert any(v.volume_id == vol.volume_id for v in await AsyncVolume.list())
    again = await AsyncVolume.connect(vol.volume_id)
    assert again.volume_id == vol.volume_id
    ok("Volume.create, list, connect")

    blob = bytes(range(256)) * 4096  # 1 MiB, every byte value
    entry = await vol.write_file("/models/weights.bin", blob)
    assert entry.size == len(blob) and entry.type.value == "file", entry
    await vol.write_file("/notes.txt", "first")
    try:
        await vol.write_file("/notes.txt", "second")
        raise AssertionError("an existing file was overwritten unasked")
    except Exception as e:
        assert "exists" in str(e), e
    await vol.write_file("/notes.txt", "second", force=True)
    assert await vol.read_file("/notes.txt") == "second"
    assert await vol.read_file("/models/weights.bin", format="bytes") == blob
    ok("write_file, read_file (bytes and text), force to overwrite")

    made = await vol.make_dir("/a/b/c", force=True)
    assert made.type.value == "directory", made
    listed = await vol.list("/", depth=3)
    paths = sorted(e.path for e in listed)
    for want in ["/a", "/a/b", "/a/b/c", "/models", "/models/weights.bin", "/notes.txt"]:
        assert want in paths, paths
    assert await vol.exists("/a/b/c") and not await vol.exists("/nothing")
    info = await vol.get_info("/notes.txt")
    assert info.size == 6 and info.uid == 1000, info
    changed = await vol.update_metadata("/notes.txt", mode=0o600)
    assert changed.mode & 0o777 == 0o600, changed
    await vol.remove("/a")
    assert not await vol.exists("/a/b")
    ok("make_dir, list with depth, exists, get_info, update_metadata, remove")

    sbx = await AsyncSandbox.create(timeout=120, volume_mounts={"/data": vol})
    try:
        seen = await sbx.commands.run("sha256sum /data/models/weights.bin && cat /data/notes.txt && id -u")
        import hashlib
        assert hashlib.sha256(blob).hexdigest() in seen.stdout, seen.stdout
        assert "second" in seen.stdout, seen.stdout
        await sbx.commands.run("echo from-the-sandbox > /data/made-inside.txt")
        # Mounted read-write by a sandbox: the content API waits its turn.
        try:
            await vol.read_file("/notes.txt")
            raise AssertionError("a volume held read-write was read from its file")
        except Exception as e:
            assert "mounted read-write" in str(e), e
    finally:
        assert await sbx.kill() is True
    assert (await vol.read_file("/made-inside.txt")).strip() == "from-the-sandbox"
    ok("volume_mounts: the sandbox sees the files; what it wrote is read after it ends")

    assert await AsyncVolume.destroy(vol.volume_id) is True
    assert await AsyncVolume.destroy(vol.volume_id) is False
    try:
        await vol.read_file("/notes.txt")
        raise AssertionError("a destroyed volume's file was read")
    except Exception:
        pass
    ok("Volume.destroy")


asyncio.run(main())

# Every check is done: leave without the interpreter's teardown (see the
# end of python_sync.py).
import os
import sys

sys.stdout.flush()
os._exit(0)
