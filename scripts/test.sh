#!/usr/bin/env bash
# The whole test suite on a fresh Debian 12 machine, as root: installs the
# system packages, builds the agent and the guest image (cached under
# target/sandpit-images, rebuilt only when its recipe changes) and the
# previous release (cached under target/previous), checks formatting, builds
# the tests with clippy's lints, runs each fuzz target briefly, then runs
# every test, the real-VM ones included. Ends with a table of where the time
# went. docs/testing.md says what a test costs and how to keep CI in budget.
#
# Build caches live outside the clone: a clone without `target/` gets a link
# to $SANDPIT_BUILD_CACHE/target (default /var/cache/sandpit-build; `none`:
# a plain target/ in the clone), so a second run on the same machine, in
# whatever clone, compiles only the crates that changed and reuses the guest
# image, the previous release and the fuzz build. One run at a time per
# cache. A clone that has its own target/ keeps it.
set -euo pipefail
cd "$(dirname "$0")/.."
me=test.sh
start_epoch=$(date +%s)
now() { echo $(($(date +%s) - start_epoch)); }

# --- Where the time goes ---------------------------------------------------
# `step NAME` ends the step running and starts NAME; the table at the end
# gives each step's seconds, each job run beside them (`beside`), and the
# slowest test binaries.
steps=() step_secs=() step_at=
step() {
  local t
  t=$(now)
  if [ -n "$step_at" ]; then step_secs+=($((t - step_at))); fi
  step_at=$t
  steps+=("$*")
  echo "$me: [$t s] $*" >&2
}
times_dir=
table() {
  local t i
  t=$(now)
  [ -n "$step_at" ] && step_secs+=($((t - step_at))) && step_at=
  {
    echo
    echo "$me: where the time went (seconds; jobs run beside overlap the steps)"
    printf '  %-58s %6s\n' step seconds
    for i in "${!step_secs[@]}"; do printf '  %-58s %6s\n' "${steps[$i]}" "${step_secs[$i]}"; done
    if [ -n "$times_dir" ] && compgen -G "$times_dir/*.secs" >/dev/null; then
      for f in "$times_dir"/*.secs; do
        printf '  %-58s %6s\n' "beside: $(basename "$f" .secs)" "$(<"$f")"
      done
    fi
    printf '  %-58s %6s\n' total "$t"
    slowest_tests
  } >&2
}
# The slowest tests and test binaries, from the test logs: the "Running"
# (or "Doc-tests") line before each binary's output, libtest's per-test
# times (`--report-time`), and each binary's "test result" line. A test run
# alone (`aside`) has the time of its binary's run.
slowest_tests() {
  local logs=() rows
  for f in target/tests-*.log target/beside-*.log; do [ -f "$f" ] && logs+=("$f"); done
  [ ${#logs[@]} -gt 0 ] || return 0
  rows=$(awk '
    /^ +Running / {
      bin = $2
      if (match($0, /deps\/[^ )]*-[0-9a-f]+\)/)) {
        bin = substr($0, RSTART + 5, RLENGTH - 6); sub(/-[0-9a-f]+$/, "", bin)
      }
      cur = bin; timed = 0; last = ""; next
    }
    /^ +Doc-tests / { cur = "doc-tests " $2; timed = 0; last = ""; next }
    /^test .* \.\.\. (ok|FAILED)/ && cur != "" {
      last = $2
      if (match($0, /<[0-9.]+s>$/)) {
        timed = 1
        printf "test\t%s %s\t%s\n", cur, $2, substr($0, RSTART + 1, RLENGTH - 3)
      }
      next
    }
    /^test result: / && cur != "" {
      n = 0; if (match($0, /[0-9]+ passed/)) n = substr($0, RSTART, RLENGTH) + 0
      f = 0; if (match($0, /[0-9]+ failed/)) f = substr($0, RSTART, RLENGTH) + 0
      if (match($0, /finished in [0-9.]+s/)) {
        secs = substr($0, RSTART + 12, RLENGTH - 13)
        printf "binary\t%s\t%s\t%d\n", cur, secs, n + f
        if (!timed && n + f == 1 && last != "") printf "test\t%s %s\t%s\n", cur, last, secs
      }
      cur = ""
    }' "${logs[@]}")
  echo "$me: the 15 slowest tests (seconds)"
  awk -F'\t' '$1 == "test" { printf "%s\t%s\n", $3, $2 }' <<<"$rows" | sort -g -r |
    awk -F'\t' 'NR <= 15 { printf "  %-86s %7.1f\n", $2, $1 }'
  echo "$me: the 15 slowest test binaries and modules (seconds: their tests' times added up)"
  awk -F'\t' '$1 == "test" {
      split($2, w, " "); key = w[1]
      if (index(w[2], "::")) key = key " " substr(w[2], 1, index(w[2], "::") - 1) "::"
      sum[key] += $3; count[key]++
    }
    END { for (k in sum) printf "%s\t%s\t%d\n", sum[k], k, count[k] }' <<<"$rows" |
    sort -g -r | awk -F'\t' 'NR <= 15 { printf "  %-70s %3s tests %7.1f\n", $2, $3, $1 }'
}

# Whatever runs in the background stops with this script, however it ends;
# the table is printed however it ends, too.
kill_tree() {
  local child
  for child in $(pgrep -P "$1"); do kill_tree "$child"; done
  kill "$1" 2>/dev/null || true
}
on_exit() {
  local status=$?
  for job in $(jobs -p); do kill_tree "$job"; done
  table || true
  exit "$status"
}
trap on_exit EXIT

# --- Jobs beside the steps -------------------------------------------------
# `beside NAME COMMAND...` runs COMMAND in the background, its output in
# target/beside-NAME.log; `joined NAME [--show]` waits for it, prints that
# output (when it failed, or always with --show) and fails when it failed.
declare -A beside_pid=()
beside() {
  local name=$1
  shift
  (
    set +e
    begun=$(date +%s)
    "$@"
    status=$?
    echo $(($(date +%s) - begun)) >"$times_dir/$name.secs"
    exit "$status"
  ) >"target/beside-$name.log" 2>&1 &
  beside_pid[$name]=$!
}
joined() {
  local status=0
  wait "${beside_pid[$1]}" || status=$?
  unset "beside_pid[$1]"
  [ "$status" != 0 ] || [ "${2:-}" != --show ] || cat "target/beside-$1.log"
  if [ "$status" != 0 ]; then
    cat "target/beside-$1.log" >&2
    echo "$me: $1 failed (exit $status; its output is above)" >&2
    return 1
  fi
}

step "system packages"
scripts/install-deps.sh

# --- Build caches outside the clone ----------------------------------------
cache=${SANDPIT_BUILD_CACHE:-/var/cache/sandpit-build}
if [ ! -e target ] && [ ! -L target ] && [ "$cache" != none ]; then
  mkdir -p "$cache/target"
  # A cache past 60 GB (dependencies that every run changed, say) starts
  # again rather than fill the disk.
  used=$(du -s -B1G "$cache/target" | cut -f1)
  if [ "$used" -gt 60 ]; then
    echo "$me: $cache/target holds ${used} GB: emptying it" >&2
    rm -rf "$cache/target" && mkdir -p "$cache/target"
  fi
  ln -s "$cache/target" target
  echo "$me: build caches in $cache/target (target/ links there)" >&2
fi
mkdir -p target
# Files the cache saw before keep the times of then, so that Cargo rebuilds
# only the crates whose files changed (a clone dates every file now; see
# scripts/source-times.py). Only where target/ is the shared cache: a clone's
# own target/ has seen its own files' times. The dashboard's npm packages
# are fetched first, as the build reads them too.
if [ -L target ] && [ "$(readlink target)" = "$cache/target" ]; then
  scripts/web-assets.sh
  python3 scripts/source-times.py "$cache/target/source-times.json" .
fi
times_dir=$(mktemp -d)
rm -f target/tests-*.log target/beside-*.log

# --- Test binaries ---------------------------------------------------------
# `binaries JSON` lists the test binaries of cargo's JSON messages, a line
# each: executable, package directory, source file, target name
# (tab-separated).
binaries() {
  python3 -c '
import json, os, sys
for line in open(sys.argv[1]):
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        root = os.path.dirname(m["manifest_path"])
        src = os.path.relpath(m["target"]["src_path"], os.getcwd())
        print("\t".join([m["executable"], root, src, m["target"]["name"]]))
' "$1"
}
# `run_binaries LIST ARGS...` runs the binaries listed in the file LIST (as
# `binaries` prints them) one after another, each in its package's
# directory as `cargo test` does, with ARGS and each test's time (libtest's
# --report-time is unstable: RUSTC_BOOTSTRAP is set for the test binaries
# alone, never for cargo, so nothing compiles differently; the scripts that
# build unset it); fails if one failed.
run_binaries() {
  local list=$1 status=0 exe dir src name
  shift
  while IFS=$'\t' read -r exe dir src name <&3; do
    echo "     Running $src ($exe)"
    (cd "$dir" && RUSTC_BOOTSTRAP=1 "$exe" -Z unstable-options --report-time "$@" </dev/null) ||
      status=1
  done 3<"$list"
  return "$status"
}
# Some tests mostly wait (on Debian's mirror, dpkg, a sandbox's expiry) and
# use one thread: they run beside other work, and the lanes below skip them.
# `aside NAME JSON BINARY TEST [BINARY TEST ...]` starts one background job
# running these tests one after another, each from its test binary
# (`--exact`; BINARY is a target name of cargo's JSON messages in the file
# JSON); `collect NAME` waits for it and fails if a test failed or ran
# nothing (a renamed test would).
aside_names=()
declare -A aside_counts=()
aside() {
  local name=$1 json=$2 list=() line
  shift 2
  while [ $# -gt 0 ]; do
    line=$(binaries "$json" | awk -F'\t' -v n="$1" '$4 == n')
    [ -n "$line" ] && [ "$(wc -l <<<"$line")" = 1 ] ||
      { echo "$me: cargo built no test binary $1, or more than one" >&2; exit 1; }
    list+=("$line"$'\t'"$2")
    aside_names+=("$2")
    shift 2
  done
  aside_counts[$name]=${#list[@]}
  beside "$name" bash -c '
    status=0
    for line in "$@"; do
      IFS=$'"'\t'"' read -r exe dir src target test <<<"$line"
      echo "     Running $test ($exe)"
      (cd "$dir" && "$exe" --exact "$test" </dev/null) || status=1
    done
    exit "$status"' aside "${list[@]}"
}
collect() {
  local status=0 passed
  joined "$1" --show || status=1
  passed=$(grep -c "^test result: ok. 1 passed" "target/beside-$1.log" || true)
  if [ "$passed" != "${aside_counts[$1]}" ]; then
    echo "$me: $1: ${aside_counts[$1]} test(s) were to pass, $passed did (target/beside-$1.log, above)" >&2
    status=1
  fi
  return "$status"
}

# The set-up test (crates/setup-test: install-deps.sh in clean Debian roots,
# no VM; minutes of apt and dpkg) builds in seconds, having nothing of the
# workspace, and runs beside the builds.
cargo test --locked -p sandpit-setup-test --no-run --message-format=json >target/setup-test.json
aside set-up-test target/setup-test.json \
  setup install_deps_sets_up_fresh_debian_12_whatever_qemu_it_had

# cargo-deb and cargo-fuzz (cargo install compiles them; nothing to do when
# they are there) install beside the build.
beside tools bash -c 'scripts/package.sh --install-tool && scripts/fuzz.sh --install-tool'
# E2B's SDKs at their pinned versions (PyPI), for the E2B tests.
beside e2b-sdks scripts/e2b-sdks.sh

step "build"
scripts/build.sh
# By the cache's own path, not through this clone's link: what is written
# there (the guest image's records, apt's configuration) names these paths,
# and the next run is in another clone.
built=$(cd target && pwd -P)
export SANDPIT_IMAGES_DIR="$built/sandpit-images"
export SANDPIT_AGENT_BIN="$built/x86_64-unknown-linux-gnu/release/sandpit-agent"
export SANDPIT_FUZZ_TARGET_DIR="$built/fuzz"
# The previous release, which the upgrade test runs first (cached in
# target/previous), and the guest image (which mostly waits on Debian's
# mirror) build beside the test build.
beside previous-release scripts/build-previous.sh
beside guest-image target/release/sandpit image build --images-dir "$SANDPIT_IMAGES_DIR"

step "format"
cargo fmt --all --check
cargo fmt --check --manifest-path fuzz/Cargo.toml
# The fuzz workspace has a lock file of its own, built --locked beside the
# tests: a dependency the workspace gained must be in it too, said now rather
# than after the tests.
cargo metadata --locked --format-version 1 --manifest-path fuzz/Cargo.toml >/dev/null ||
  { echo "$me: fuzz/Cargo.lock lacks a dependency the workspace gained: run 'cargo update --workspace --manifest-path fuzz/Cargo.toml' and commit it" >&2; exit 1; }

step "test build, with clippy's lints"
# The tests' build is also the lint pass: clippy-driver compiles the
# workspace's crates (as `cargo clippy --all-targets` would check them, with
# its lints denied), so the workspace is not compiled once more in check
# mode. Only the cargo commands here get the wrapper: a test that builds
# (the package test runs scripts/package.sh) builds as a user would.
clippy_driver=$(rustup which clippy-driver 2>/dev/null || command -v clippy-driver) ||
  { echo "$me: clippy-driver is missing: rustup component add clippy" >&2; exit 1; }
linted() {
  RUSTC_WORKSPACE_WRAPPER=$clippy_driver \
    CLIPPY_ARGS="-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__" "$@"
}
tests_json=target/test-executables.json
linted cargo test --locked --workspace --all-targets --no-run --message-format=json >"$tests_json"

step "Debian package"
joined tools
# The Debian package, which the package test installs.
scripts/package.sh --no-build >/dev/null

status=0
step "waiting for the guest image and the previous release"
joined guest-image
joined previous-release
joined e2b-sdks
export SANDPIT_E2B_PYTHON="$built/e2b-sdks/python/bin/python"
export SANDPIT_E2B_JS="$built/e2b-sdks/js"

step "tests (and the end of the set-up test)"
# Two lanes: the end-to-end tests (crates/cli/tests/e2e, most of the time)
# beside every other test binary, each lane two tests at a time (VM tests
# boot real guests under emulation on few cores: bound parallelism). They
# skip the tests run aside: the set-up test (still running, maybe), the
# upgrade test (which waits out a sandbox's lifetime) and the package test
# (apt in a clean root), which starts once the set-up test is done: both
# share the host's apt cache.
upgrade_test=upgrade::the_previous_release_s_sandboxes_live_on_under_this_one
package_test=package::the_package_installs_in_a_clean_debian_root_and_its_service_serves_sandboxes
threads=${SANDPIT_TEST_THREADS:-2}
skips=()
for name in "${aside_names[@]}" "$upgrade_test" "$package_test"; do skips+=(--skip "$name"); done
binaries "$tests_json" >target/test-binaries.tsv
awk -F'\t' '$4 == "e2e"' target/test-binaries.tsv >target/test-binaries-e2e.tsv
awk -F'\t' '$4 != "e2e"' target/test-binaries.tsv >target/test-binaries-rest.tsv
[ -s target/test-binaries-e2e.tsv ] || { echo "$me: cargo built no e2e test binary" >&2; exit 1; }
# The e2e binary holds more of the tests' time than all the others: the
# other lane ends with these of its modules (about a quarter of its time, by
# CI's per-module table), which the e2e lane skips.
moved_e2e=(chaos:: lifecycle::)
e2e_skips=()
for name in "${moved_e2e[@]}"; do e2e_skips+=(--skip "$name"); done
beside e2e-tests run_binaries target/test-binaries-e2e.tsv --test-threads="$threads" \
  "${skips[@]}" "${e2e_skips[@]}"
# Documentation tests (cargo compiles them now, with rustdoc), then every
# test binary but the e2e one, then the e2e modules moved here.
other_tests() {
  local failed=0
  linted cargo test --locked --workspace --doc || failed=1
  run_binaries target/test-binaries-rest.tsv --test-threads="$threads" "${skips[@]}" || failed=1
  # A renamed module would run nothing here and be skipped there: say so.
  local e2e_exe listed name
  e2e_exe=$(cut -f1 target/test-binaries-e2e.tsv)
  listed=$("$e2e_exe" --list --format terse)
  for name in "${moved_e2e[@]}"; do
    [[ $listed == *$'\n'"$name"* || $listed == "$name"* ]] ||
      { echo "$me: the e2e binary has no tests under $name (moved_e2e)" >&2; failed=1; }
  done
  run_binaries target/test-binaries-e2e.tsv --test-threads="$threads" "${skips[@]}" \
    "${moved_e2e[@]}" || failed=1
  return "$failed"
}
beside other-tests other_tests
aside upgrade-test "$tests_json" e2e "$upgrade_test"
# The fuzz targets (a workspace of their own, built at a low priority while
# the tests leave a core idle), then a short run of each.
beside fuzz bash -c 'nice -n 19 scripts/fuzz.sh --build-only && scripts/fuzz.sh'
collect set-up-test || status=1
aside package-test "$tests_json" e2e "$package_test"

step "waiting for the tests"
joined other-tests --show || status=1
joined e2e-tests --show || status=1
collect upgrade-test || status=1
collect package-test || status=1
joined fuzz --show || status=1
exit "$status"
