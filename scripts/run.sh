#!/usr/bin/env bash
# The main job on a fresh Debian 12 machine, as root: install what is needed,
# build, build the guest image if it is missing, then run.
# Until the server lands this runs the end-to-end demo (create a sandbox,
# run commands in it, move a file, destroy it).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh
target/release/sandpit image build --agent target/x86_64-unknown-linux-gnu/release/sandpit-agent
exec target/release/sandpit demo "$@"
