#!/usr/bin/env bash
# Builds the previous release's `sandpit` and agent, which the upgrade test
# (crates/cli/tests/e2e/upgrade.rs) runs before it hands their data directory
# and running sandboxes to this build's. Built from this repository's own
# history; cached in target/previous/<commit>/ between runs, so a second run
# costs nothing. Prints the directory last; target/previous/current points
# at it.
#
# In a target directory of its own: its crates have this build's names and
# relative paths, and cargo would take this build's artifacts for fresh
# builds of them. The dependencies this build compiled that the previous
# release's lock file pins alike (most of them) are copied there, so only
# its own crates and what changed compile again.
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
mkdir -p "$work/src" "$out.tmp"
git archive "$commit" | tar -x -C "$work/src"
echo "$me: building ${commit:0:12} (the previous release) in $work"
# Copies, not links: cargo rewrites some of these files in place.
for profile in release x86_64-unknown-linux-gnu/release; do
  for dir in deps build .fingerprint; do
    [ -d "target/$profile/$dir" ] || continue
    mkdir -p "$work/target/$profile/$dir"
    find "target/$profile/$dir" -mindepth 1 -maxdepth 1 ! -name '*sandpit*' \
      -exec cp -a -t "$work/target/$profile/$dir/" {} +
  done
done
# Its own toolchain file and lock file (cargo runs in its tree), and the
# flags of its scripts/build.sh.
(
  cd "$work/src"
  export CARGO_TARGET_DIR="$work/target"
  RUSTFLAGS="-C target-feature=+crt-static" \
    cargo build --release --locked -p sandpit-agent --target x86_64-unknown-linux-gnu
  cargo build --release --locked -p sandpit
) >&2
cp "$work/target/release/sandpit" "$work/target/x86_64-unknown-linux-gnu/release/sandpit-agent" "$out.tmp/"
mv "$out.tmp" "$out"
rm -rf "$work"
ln -sfn "$commit" target/previous/current
echo "$out"
