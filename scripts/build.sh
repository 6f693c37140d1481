#!/usr/bin/env bash
# Builds the static in-guest agent and the sandpit binary (release).
set -euo pipefail
cd "$(dirname "$0")/.."
# The agent runs inside the guest as PID 1: link it statically so it does not
# depend on the guest's libc. --target keeps the flag off build scripts.
RUSTFLAGS="-C target-feature=+crt-static" \
  cargo build --release --locked -p sandpit-agent --target x86_64-unknown-linux-gnu
cargo build --release --locked -p sandpit
echo "build.sh: target/release/sandpit and target/x86_64-unknown-linux-gnu/release/sandpit-agent"
