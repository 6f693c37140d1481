"""E2B's Python SDK, driven by `sandpit bench` one step at a time.

The bench writes a step per line on stdin and reads one JSON line back per
step, so that each SDK call is timed beside the MCP call it is compared
with (interleaved: the host's speed drifts over minutes). E2B_API_URL,
E2B_SANDBOX_URL and E2B_API_KEY point at the bench's server; the first
argument is the template. Times are milliseconds on this process's
monotonic clock, around the SDK's own calls.
"""
import json
import sys
import time

from e2b import Sandbox

template = sys.argv[1]
kept = None


def ms_since(t):
    return (time.perf_counter() - t) * 1000.0


def answer(**fields):
    print(json.dumps(fields), flush=True)


for line in sys.stdin:
    step = line.strip()
    if step == "first":
        # Sandbox.create() and its first commands.run("true").
        t = time.perf_counter()
        sbx = Sandbox.create(template=template, timeout=600)
        sbx.commands.run("true")
        ms = ms_since(t)
        sbx.kill()
        answer(ms=ms)
    elif step == "open":
        kept = Sandbox.create(template=template, timeout=1200)
        answer(id=kept.sandbox_id)
    elif step == "run":
        t = time.perf_counter()
        kept.commands.run("true")
        answer(ms=ms_since(t))
    elif step == "first_byte":
        # From the call to the first on_stdout: what the guest's write
        # waited for, at most (the command's start is in it too).
        first = []
        t = time.perf_counter()
        kept.commands.run("echo x", on_stdout=lambda _: first or first.append(ms_since(t)))
        answer(ms=first[0] if first else None, whole=ms_since(t))
    elif step == "close":
        if kept is not None:
            kept.kill()
        answer(closed=True)
        break
    else:
        answer(error=f"unknown step {step!r}")
