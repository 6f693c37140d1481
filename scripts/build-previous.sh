#!/usr/bin/env bash
# Builds the previous release's `sandpit` and agent, which the upgrade test
# (crates/cli/tests/upgrade.rs) runs before it hands their data directory
# and running sandboxes to this build's. Built from this repository's own
# history; cached in target/previous/<commit>/ between runs, so a second run
# costs nothing. Prints the directory last; target/previous/current points
# at it.
#
# Its `sandpit` builds in this build's target directory, so the dependencies
# both lock files pin alike (most of them) are compiled once: the previous
# release's own crates sit elsewhere, so they differ from this build's in
# cargo's eyes. That build leaves its binary in target/release/sandpit, so
# this build's is put back at the end (cargo re-links a fresh binary; run
# scripts/build.sh first, or that step builds it). Its agent builds in a
# target directory of its own: this build's agent, which images are made
# from, is never replaced, even for a moment.
#
# The previous release is the commit below, main just before the dashboard
# (2026-12-03): its guest root filesystem recipe is this build's, so the
# test shares the cached root filesystem instead of bootstrapping Debian
# again, while its store lacks a migration, its agent lacks a field of the
# protocol's generation 1, its guest image differs (its agent) and its
# runtime predates the host limits and KSM.
set -euo pipefail
cd "$(dirname "$0")/.."
here=$PWD
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
mkdir -p "$work/src" "$out.tmp"
git archive "$commit" | tar -x -C "$work/src"
echo "$me: building ${commit:0:12} (the previous release) in $work"
# Its own toolchain file and lock file (cargo runs in its tree), and the
# flags of its scripts/build.sh.
(
  cd "$work/src"
  RUSTFLAGS="-C target-feature=+crt-static" CARGO_TARGET_DIR="$work/target" \
    cargo build --release --locked -p sandpit-agent --target x86_64-unknown-linux-gnu
  CARGO_TARGET_DIR="$here/target" cargo build --release --locked -p sandpit
  cp "$here/target/release/sandpit" "$work/target/x86_64-unknown-linux-gnu/release/sandpit-agent" "$out.tmp/"
) >&2
# This build's binary back in target/release.
cargo build --release --locked -p sandpit >&2
mv "$out.tmp" "$out"
rm -rf "$work"
ln -sfn "$commit" target/previous/current
echo "$out"
