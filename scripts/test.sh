#!/usr/bin/env bash
# The whole test suite on a fresh Debian 12 machine, as root: installs the
# system packages, builds the agent and the guest image (cached under
# target/sandpit-images, rebuilt only when its recipe changes) and the
# previous release (cached under target/previous), checks
# formatting and lints, runs each fuzz target briefly, then runs every test,
# the real-VM ones included.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh
export SANDPIT_IMAGES_DIR="$PWD/target/sandpit-images"
export SANDPIT_AGENT_BIN="$PWD/target/x86_64-unknown-linux-gnu/release/sandpit-agent"
# The previous release, which the upgrade test runs first (cached in
# target/previous), builds meanwhile: the guest image's build mostly waits
# on the Debian mirror.
previous_log=target/build-previous.log
scripts/build-previous.sh >"$previous_log" 2>&1 &
previous=$!
target/release/sandpit image build
# The Debian package (and cargo-deb, once), which the package test installs.
scripts/package.sh --no-build >/dev/null
cargo fmt --all --check
cargo clippy --locked --workspace --all-targets -- -D warnings
# The fuzz targets (a workspace of their own): formatted, then a short run each.
cargo fmt --check --manifest-path fuzz/Cargo.toml
scripts/fuzz.sh
if ! wait "$previous"; then
  cat "$previous_log" >&2
  echo "test.sh: building the previous release failed (above)" >&2
  exit 1
fi
# VM tests boot real guests under emulation on few cores: bound parallelism.
cargo test --locked --workspace --no-fail-fast -- --test-threads="${SANDPIT_TEST_THREADS:-2}"
