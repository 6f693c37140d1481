#!/usr/bin/env bash
# E2B's official SDKs, at the versions the tests pin, for the tests that
# drive Sandpit through them (crates/cli/tests/e2e/e2b.rs):
#   target/e2b-sdks/python: a virtual environment with e2b (PyPI) and every
#     dependency at the versions in crates/e2b/sdk-tests/requirements.txt.
# Needs python3-venv (scripts/install-deps.sh installs it) and PyPI. Does
# nothing when the environment already holds exactly those versions.
# Prints the environment's python.
set -euo pipefail
me=e2b-sdks.sh
root=$(cd "$(dirname "$0")/.." && pwd)
out="$root/target/e2b-sdks"
requirements="$root/crates/e2b/sdk-tests/requirements.txt"
venv="$out/python"
stamp="$venv/.requirements"
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
