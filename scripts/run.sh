#!/usr/bin/env bash
# The main job on a fresh Debian 12 machine, as root: install what is needed,
# build, build the guest image if it is missing, then run the server
# (`sandpit serve`: REST /v1 and MCP at /v1/mcp, SQLite in the data
# directory, VMs on this machine). Extra arguments go to `sandpit serve`,
# e.g. `scripts/run.sh --listen 0.0.0.0:8080`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh
target/release/sandpit image build --agent target/x86_64-unknown-linux-gnu/release/sandpit-agent
exec target/release/sandpit serve "$@"
