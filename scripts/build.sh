#!/usr/bin/env bash
# Builds the static in-guest agent and the sandpit binary (release).
set -euo pipefail
cd "$(dirname "$0")/.."
# scripts/test.sh runs test binaries with RUSTC_BOOTSTRAP=1 (for libtest's
# per-test times); a test that builds through this script must not pass it
# on to cargo, where build scripts that probe for nightly features would
# see it and the whole tree would compile again.
unset RUSTC_BOOTSTRAP
# Rust comes from rustup, which reads rust-toolchain.toml and installs the
# toolchain pinned there on the first build (scripts/install-deps.sh installs
# only system packages, and may run where there is no Rust).
channel=$(sed -n 's/^channel *= *"\(.*\)"/\1/p' rust-toolchain.toml)
if ! command -v cargo >/dev/null; then
  if [ -x "$HOME/.cargo/bin/cargo" ]; then
    echo "build.sh: cargo is in ~/.cargo/bin, which is not on PATH: run \`. \"\$HOME/.cargo/env\"\`" >&2
  else
    echo "build.sh: Rust is missing: install rustup (https://rustup.rs); it then installs Rust $channel, pinned in rust-toolchain.toml, on the first build" >&2
  fi
  exit 1
fi
if ! command -v rustup >/dev/null; then
  rustc_version=$(rustc --version 2>/dev/null || echo "rustc ?")
  if [[ $rustc_version != "rustc $channel"[!.0-9]* ]]; then
    echo "build.sh: warning: this cargo is not rustup's, so the Rust $channel pinned in rust-toolchain.toml is not used ($rustc_version); if the build fails, install rustup (https://rustup.rs)" >&2
  fi
fi
# The agent runs inside the guest as PID 1: link it statically so it does not
# depend on the guest's libc. --target keeps the flag off build scripts.
# The dashboard's browser code, which the sandpit binary embeds.
scripts/web-assets.sh
RUSTFLAGS="-C target-feature=+crt-static" \
  cargo build --release --locked -p sandpit-agent --target x86_64-unknown-linux-gnu
cargo build --release --locked -p sandpit
echo "build.sh: target/release/sandpit and target/x86_64-unknown-linux-gnu/release/sandpit-agent"
