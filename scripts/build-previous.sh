#!/usr/bin/env bash
# Builds the previous release's `sandpit` and agent, which the upgrade test
# (crates/cli/tests/upgrade.rs) runs before it hands their data directory
# and running sandboxes to this build's. Built from this repository's own
# history with that commit's scripts/build.sh, in a target directory of its
# own; cached in target/previous/<commit>/ between runs, so a second run
# costs nothing. Prints the directory last; target/previous/current points
# at it.
#
# The previous release is the commit below, main just before the dashboard
# (2026-12-03): its guest root filesystem recipe is this build's, so the
# test shares the cached root filesystem instead of bootstrapping Debian
# again, while its store lacks a migration, its agent lacks a field of the
# protocol's generation 1, its guest image differs (its agent) and its
# runtime predates the host limits and KSM.
set -euo pipefail
cd "$(dirname "$0")/.."
me=build-previous.sh
commit=4b1c8bb3be88eac3efadc455c415d49fd23fd3bd

out="$PWD/target/previous/$commit"
if [ -x "$out/sandpit" ] && [ -x "$out/sandpit-agent" ]; then
  ln -sfn "$commit" target/previous/current
  echo "$out"
  exit 0
fi
if ! git cat-file -e "$commit^{commit}" 2>/dev/null; then
  echo "$me: this clone lacks the previous release's commit $commit: fetch the whole history (git fetch --unshallow)" >&2
  exit 1
fi
work="$PWD/target/previous/build"
rm -rf "$work" "$out" "$out.tmp"
mkdir -p "$work/src"
git archive "$commit" | tar -x -C "$work/src"
echo "$me: building ${commit:0:12} (the previous release) in $work"
# Its own script, toolchain file and lock file; a target directory apart from
# this build's, whose artifacts would otherwise be taken for fresh.
CARGO_TARGET_DIR="$work/target" "$work/src/scripts/build.sh" >&2
mkdir -p "$out.tmp"
cp "$work/target/release/sandpit" "$work/target/x86_64-unknown-linux-gnu/release/sandpit-agent" "$out.tmp/"
mv "$out.tmp" "$out"
rm -rf "$work"
ln -sfn "$commit" target/previous/current
echo "$out"
