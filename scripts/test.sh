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
# Some tests mostly wait (on Debian's mirror, dpkg, a sandbox's expiry) and
# use one thread: they run beside other work, and the main run skips them.
# `aside BINARY NAME [BINARY NAME ...]` starts one background job running
# these tests one after another, each from its test binary (`--exact`);
# `collect` waits for the jobs started so far and says which failed.
tests_json=target/test-executables.json
cargo test --locked --workspace --no-run --message-format=json >"$tests_json"
aside_pids=() aside_logs=() aside_counts=() aside_names=()
aside() {
  local log="target/tests-aside-$1.log" run=() exe
  while [ $# -gt 0 ]; do
    exe=$(sed -n "s|.*\"executable\":\"\([^\"]*/deps/$1-[0-9a-f]*\)\".*|\1|p" "$tests_json")
    [ -x "$exe" ] || { echo "test.sh: cargo built no tests/$1.rs" >&2; exit 1; }
    run+=("$exe" "$2")
    aside_names+=("$2")
    shift 2
  done
  (
    cd crates/cli
    status=0
    set -- "${run[@]}"
    while [ $# -gt 0 ]; do
      "$1" --exact "$2" || status=1
      shift 2
    done
    exit "$status"
  ) >"$log" 2>&1 &
  aside_pids+=($!) aside_logs+=("$log") aside_counts+=($((${#run[@]} / 2)))
}
collect() {
  local i status passed failed=0
  for i in "${!aside_pids[@]}"; do
    status=0
    wait "${aside_pids[$i]}" || status=$?
    cat "${aside_logs[$i]}"
    # A renamed test would make its filter run nothing.
    passed=$(grep -c "^test result: ok. 1 passed" "${aside_logs[$i]}" || true)
    if [ "$status" != 0 ] || [ "$passed" != "${aside_counts[$i]}" ]; then
      echo "test.sh: tests run beside the others failed (${aside_logs[$i]}, above)" >&2
      failed=1
    fi
  done
  aside_pids=() aside_logs=() aside_counts=()
  return "$failed"
}
# The set-up test (crates/cli/tests/setup.rs: install-deps.sh in clean Debian
# roots, no VM) runs beside the builds below.
aside setup install_deps_sets_up_fresh_debian_12_whatever_qemu_it_had
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
status=0
step "waiting for the set-up test"
# Before the package test, which shares the host's apt cache with it.
collect || status=1
step "tests"
# The package test (apt in a clean root) and then the upgrade test (which
# waits out a sandbox's lifetime) run beside the others.
aside package the_package_installs_in_a_clean_debian_root_and_its_service_serves_sandboxes \
  upgrade the_previous_release_s_sandboxes_live_on_under_this_one
# VM tests boot real guests under emulation on few cores: bound parallelism.
skips=()
for name in "${aside_names[@]}"; do skips+=(--skip "$name"); done
cargo test --locked --workspace --no-fail-fast -- --test-threads="${SANDPIT_TEST_THREADS:-2}" \
  "${skips[@]}" || status=$?
step "waiting for the tests run beside"
collect || status=1
exit "$status"
