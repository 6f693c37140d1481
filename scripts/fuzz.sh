#!/usr/bin/env bash
# The fuzz targets in fuzz/ (cargo-fuzz, libFuzzer), on the pinned stable
# toolchain (no sanitizer, so no nightly).
#
#   scripts/fuzz.sh                   every target for SANDPIT_FUZZ_SECONDS
#                                     (default 20) each: what CI runs
#   scripts/fuzz.sh TARGET [SECONDS]  one target, longer (default 600 s)
#   scripts/fuzz.sh --install-tool    only install cargo-fuzz (pinned) and
#                                     a C++ compiler if missing
#   scripts/fuzz.sh --build-only      only build what the no-argument run
#                                     runs (scripts/test.sh builds it at a
#                                     low priority beside the tests)
#
# The short runs use an unoptimised build (`--dev`, see fuzz/Cargo.toml),
# quick to build cold; a long run an optimised one
# (`--release`, with debug assertions), slower to build but many times
# faster to run. SANDPIT_FUZZ_BUILD=dev or release chooses otherwise.
#
# Fails if any target crashes, hangs (SANDPIT_FUZZ_TIMEOUT, default 10 s for
# one input) or runs out of memory (1 GiB), printing the input. libFuzzer
# starts from the committed seeds in fuzz/corpus/TARGET and keeps what it
# finds in the build directory's corpus/TARGET (never in fuzz/corpus, so a
# run leaves the tree clean); crashes are saved in fuzz/artifacts/TARGET.
# To fold what a long run found into the committed seeds:
#   cd fuzz && cargo fuzz run -s none TARGET corpus/TARGET NEW_DIR -- -merge=1
#
# Installs cargo-fuzz (pinned) when it is missing. libFuzzer is C++: a C++
# compiler comes from scripts/install-deps.sh (g++), or from apt-get here
# when run as root. Builds go to SANDPIT_FUZZ_TARGET_DIR, else
# $CARGO_TARGET_DIR/fuzz, else fuzz/target.
#
# No pipe into a reader that stops early (grep's quiet mode, head): see
# scripts/install-deps.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
me=fuzz.sh
die() {
  echo "$me: $*" >&2
  exit 1
}

cargo_fuzz_version=0.13.2
targets=(frame_decoder protocol_messages preview_host guest_path rest_bodies)

install_only= build_only=
case ${1:-} in
--install-tool) install_only=1 && set -- ;;
--build-only) build_only=1 && set -- ;;
esac
if [ $# -eq 0 ]; then
  run=("${targets[@]}")
  seconds=${SANDPIT_FUZZ_SECONDS:-20}
  build=${SANDPIT_FUZZ_BUILD:-dev}
elif [ $# -le 2 ]; then
  [[ " ${targets[*]} " == *" $1 "* ]] || die "no target '$1'; the targets are: ${targets[*]}"
  run=("$1")
  seconds=${2:-600}
  build=${SANDPIT_FUZZ_BUILD:-release}
else
  die "usage: $me [TARGET [SECONDS]]"
fi
[[ $seconds =~ ^[1-9][0-9]*$ ]] || die "seconds must be a positive whole number, not '$seconds'"
timeout=${SANDPIT_FUZZ_TIMEOUT:-10}

# --- Tools ---------------------------------------------------------------
if ! command -v c++ >/dev/null && ! command -v g++ >/dev/null && ! command -v clang++ >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "$me: installing g++ (libFuzzer is C++)"
    DEBIAN_FRONTEND=noninteractive apt-get -y -q install --no-install-recommends g++ >/dev/null
  else
    die "no C++ compiler (libFuzzer is C++): install g++ (scripts/install-deps.sh does)"
  fi
fi
have=$(cargo fuzz --version 2>/dev/null || true)
if [[ $have != "cargo-fuzz $cargo_fuzz_version" ]]; then
  echo "$me: installing cargo-fuzz $cargo_fuzz_version${have:+ (found: $have)}"
  cargo install --locked --quiet cargo-fuzz --version "$cargo_fuzz_version"
fi
[ -z "$install_only" ] || exit 0

# --- Build ---------------------------------------------------------------
target_dir=${SANDPIT_FUZZ_TARGET_DIR:-${CARGO_TARGET_DIR:+$CARGO_TARGET_DIR/fuzz}}
target_dir=${target_dir:-$PWD/fuzz/target}
case $build in
dev) flags=(-s none --dev) ;;
release) flags=(-s none --release --debug-assertions) ;;
*) die "SANDPIT_FUZZ_BUILD must be dev or release, not '$build'" ;;
esac
flags+=(--target-dir "$target_dir")
cd fuzz
# cargo fuzz has no --locked: fail here if fuzz/Cargo.lock is not up to date.
cargo fetch --locked --quiet
start=$SECONDS
cargo fuzz build "${flags[@]}"
echo "$me: built ($build) in $((SECONDS - start)) s"
[ -z "$build_only" ] || exit 0

# --- Run -----------------------------------------------------------------
failed=()
for t in "${run[@]}"; do
  found="$target_dir/corpus/$t"
  log="$target_dir/fuzz-$t.log"
  mkdir -p "$found"
  echo "$me: $t for $seconds s"
  status=0
  cargo fuzz run "${flags[@]}" "$t" "$found" "corpus/$t" -- \
    -max_total_time="$seconds" -timeout="$timeout" -rss_limit_mb=1024 \
    -print_final_stats=1 >"$log" 2>&1 || status=$?
  out=$(<"$log")
  runs=unknown
  if [[ $out =~ Done\ ([0-9]+)\ runs\ in\ ([0-9]+)\ second ]]; then
    runs="${BASH_REMATCH[1]} runs in ${BASH_REMATCH[2]} s ($((BASH_REMATCH[1] / (BASH_REMATCH[2] > 0 ? BASH_REMATCH[2] : 1))) per second)"
  fi
  if [ "$status" = 0 ]; then
    echo "$me: $t: ok, $runs"
    continue
  fi
  failed+=("$t")
  echo "$me: $t FAILED (exit $status); the end of its log ($log):" >&2
  tail -n 60 "$log" >&2
  echo "$me: $t: what panicked:" >&2
  grep -A 2 'panicked at' "$log" >&2 || echo "(no panic: a hang, a crash or memory)" >&2
  # The input, in the log too (CI keeps no files).
  if [[ $out =~ Test\ unit\ written\ to\ ([^[:space:]]+) ]]; then
    input=${BASH_REMATCH[1]}
    [[ $input == /* ]] || input="$PWD/$input"
    echo "$me: $t: the input ($input), base64:" >&2
    base64 "$input" >&2 || true
    echo "$me: reproduce with: cd fuzz && cargo fuzz run ${flags[*]} $t $input" >&2
  fi
done

if [ ${#failed[@]} -gt 0 ]; then
  die "failed: ${failed[*]}"
fi
echo "$me: all ${#run[@]} target(s) passed"
