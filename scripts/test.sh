#!/usr/bin/env bash
# The whole test suite on a fresh Debian 12 machine, as root: installs the
# system packages, builds the agent and the guest image (cached under
# target/sandpit-images, rebuilt only when its recipe changes) and the
# previous release (cached under target/previous), checks
# formatting and lints, runs each fuzz target briefly, then runs every test,
# the real-VM ones included.
set -euo pipefail
cd "$(dirname "$0")/.."
# Each step's start, with the seconds since this script began: where CI's
# time goes.
step() { echo "test.sh: [$SECONDS s] $*" >&2; }
# Whatever runs in the background stops with this script, however it ends.
kill_tree() {
  local child
  for child in $(pgrep -P "$1"); do kill_tree "$child"; done
  kill "$1" 2>/dev/null || true
}
trap 'for job in $(jobs -p); do kill_tree "$job"; done' EXIT
step "system packages"
scripts/install-deps.sh
step "build"
scripts/build.sh
export SANDPIT_IMAGES_DIR="$PWD/target/sandpit-images"
export SANDPIT_AGENT_BIN="$PWD/target/x86_64-unknown-linux-gnu/release/sandpit-agent"
# The previous release, which the upgrade test runs first (cached in
# target/previous), builds meanwhile (the guest image's build mostly waits
# on the Debian mirror).
previous_log=target/build-previous.log
scripts/build-previous.sh >"$previous_log" 2>&1 &
previous=$!
step "test build"
# The set-up test (crates/cli/tests/setup.rs: install-deps.sh in clean Debian
# roots, no VM) mostly waits on Debian's mirror and dpkg, so it runs beside
# the builds below rather than in line with the VM tests, which it would
# only slow down; the test run below skips it and reports its result.
setup_test=install_deps_sets_up_fresh_debian_12_whatever_qemu_it_had
setup_exe=$(cargo test --locked --workspace --no-run --message-format=json |
  sed -n 's|.*"executable":"\([^"]*/deps/setup-[0-9a-f]*\)".*|\1|p')
[ -x "$setup_exe" ] || { echo "test.sh: cargo built no tests/setup.rs" >&2; exit 1; }
setup_log=target/setup-test.log
(cd crates/cli && exec "$setup_exe" --exact "$setup_test") >"$setup_log" 2>&1 &
setup=$!
step "guest image (the previous release builds meanwhile)"
target/release/sandpit image build
step "Debian package"
# The Debian package (and cargo-deb, once), which the package test installs.
scripts/package.sh --no-build >/dev/null
step "format and lints"
cargo fmt --all --check
cargo clippy --locked --workspace --all-targets -- -D warnings
step "fuzz"
# The fuzz targets (a workspace of their own): formatted, then a short run each.
cargo fmt --check --manifest-path fuzz/Cargo.toml
scripts/fuzz.sh
step "waiting for the previous release's build"
if ! wait "$previous"; then
  cat "$previous_log" >&2
  echo "test.sh: building the previous release failed (above)" >&2
  exit 1
fi
step "waiting for the set-up test"
setup_status=0
wait "$setup" || setup_status=$?
cat "$setup_log"
if [ "$setup_status" = 0 ] && ! grep -q "^test result: ok. 1 passed" "$setup_log"; then
  setup_status=1 # renamed, so the filter ran nothing
fi
step "tests"
# VM tests boot real guests under emulation on few cores: bound parallelism.
status=0
cargo test --locked --workspace --no-fail-fast -- --test-threads="${SANDPIT_TEST_THREADS:-2}" \
  --skip "$setup_test" || status=$?
if [ "$setup_status" != 0 ]; then
  echo "test.sh: the set-up test (tests/setup.rs, its output is above the test run) failed" >&2
  exit "$setup_status"
fi
exit "$status"
