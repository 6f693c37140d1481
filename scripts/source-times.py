#!/usr/bin/env python3
"""Gives the files of a fresh clone the modification times of the last build
that saw the same contents, so that Cargo, which judges a workspace crate's
freshness by its files' times, rebuilds only what changed.

Why: scripts/test.sh builds a clean clone into a cache kept outside it (CI
clones afresh every run). A clone gives every file the time of the clone,
newer than anything in the cache, so every workspace crate (twenty of them,
in release, in the test profile and in the fuzz build) compiled again on
every run, whatever the change: about 20 of CI's minutes.

How, and why it cannot serve a stale build: RECORD (in the cache) holds, for
each file, the SHA-256 of the contents the cache last saw at that path and
the time given to them then. A file whose contents equal the record's gets
the recorded time, which is older than what was built from those contents
(that build came after it was recorded). Any other file is recorded afresh
with the present time, so it is newer than everything in the cache and what
depends on it builds again, even when its contents are ones an older run
saw (the cache may have been built from other contents since). The record
is written before the build: a build that stops half-way leaves outputs older
than the times recorded, so the next run builds them again.

Only for the same clone path: a crate compiled in one clone keeps that
clone's absolute paths (`env!("CARGO_MANIFEST_DIR")` in a build script or a
test, `OUT_DIR` through the `target` link), and Cargo does not see them
change. The record names the clone's path; a clone elsewhere dates every
file now, and so builds everything, as before. (CI clones to one path.)

Directories too: a build script's `rerun-if-changed` on a directory
(`crates/store/migrations`, `crates/web/static`) has Cargo look at the
directory's own time beside its files', and a clone dates directories now
as well, so two crates and everything above them (the sandpit binary's nine
release minutes) built again on every run. A directory whose list of names
the record has seen keeps the recorded time, else gets the present one (a
file added or removed shows there); either way, no earlier than the newest
of what it holds.

Usage: source-times.py RECORD DIR  (every file under DIR but .git, target,
fuzz/target and fuzz/artifacts: the tracked sources and the generated ones a
build reads, such as the dashboard's npm packages).
"""

import hashlib
import json
import os
import sys
import time

SKIPPED = {".git", "target", os.path.join("fuzz", "target"), os.path.join("fuzz", "artifacts")}


def files(root):
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        dirnames[:] = [
            d for d in dirnames if os.path.normpath(os.path.join(rel_dir, d)) not in SKIPPED
        ]
        for name in filenames:
            path = os.path.join(dirpath, name)
            if os.path.isfile(path) and not os.path.islink(path):
                yield os.path.normpath(os.path.relpath(path, root)), path


def directories(root):
    """Every directory under ROOT (ROOT too) but the skipped ones, deepest
    first, each with the names of its entries."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root, topdown=True):
        rel_dir = os.path.normpath(os.path.relpath(dirpath, root))
        dirnames[:] = [
            d for d in dirnames if os.path.normpath(os.path.join(rel_dir, d)) not in SKIPPED
        ]
        found.append((rel_dir, dirpath, sorted(os.listdir(dirpath))))
    return sorted(found, key=lambda d: d[0].count(os.sep) + (d[0] != "."), reverse=True)


def digest(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def main():
    record_path, root = sys.argv[1], os.path.abspath(sys.argv[2])
    try:
        with open(record_path) as f:
            saved = json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        saved = {}
    # Another clone's record (or none) is no record here.
    same_clone = isinstance(saved, dict) and saved.get("root") == root
    record = saved.get("files", {}) if same_clone else {}
    now = time.time_ns()
    kept = changed = 0
    for rel, path in files(root):
        sha = digest(path)
        seen = record.get(rel)
        if seen and seen[0] == sha:
            kept += 1
            at = seen[1]
        else:
            changed += 1
            at = now
            record[rel] = [sha, at]
        os.utime(path, ns=(at, at), follow_symlinks=False)
    dirs = saved.get("dirs", {}) if same_clone else {}
    for rel, path, names in directories(root):
        listing = hashlib.sha256("\n".join(names).encode()).hexdigest()
        seen = dirs.get(rel)
        if seen and seen[0] == listing:
            at = seen[1]
        else:
            at = now
            dirs[rel] = [listing, at]
        newest = max(
            [at]
            + [
                os.lstat(os.path.join(path, name)).st_mtime_ns
                for name in names
                if os.path.normpath(os.path.join(rel, name)) not in SKIPPED
            ]
        )
        os.utime(path, ns=(newest, newest), follow_symlinks=False)
    tmp = record_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"root": root, "files": record, "dirs": dirs}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, record_path)
    print(
        f"source-times.py: {kept} files as the cache last saw them, {changed} new or changed"
        + ("" if same_clone else f" (the cache last saw another clone than {root}: all new)"),
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
