#!/usr/bin/env bash
# Builds the Debian package of the server: target/debian/sandpit_*.deb, with
# /usr/bin/sandpit, the guest agent, /etc/sandpit/sandpit.toml and the
# sandpit.service unit (metadata: [package.metadata.deb] in
# crates/cli/Cargo.toml). Prints the package's path last.
#
#   scripts/package.sh             build (scripts/build.sh), then package
#   scripts/package.sh --no-build  package what target/ holds
#   scripts/package.sh --install-tool  only install cargo-deb (pinned) if
#                                      it is missing
set -euo pipefail
cd "$(dirname "$0")/.."
# scripts/test.sh runs test binaries with RUSTC_BOOTSTRAP=1 (for libtest's
# per-test times); a test that builds through this script must not pass it
# on to cargo, where build scripts that probe for nightly features would
# see it and the whole tree would compile again.
unset RUSTC_BOOTSTRAP
me=package.sh
die() {
  echo "$me: $*" >&2
  exit 1
}
cargo_deb_version=3.8.0

install_tool() {
  local have
  have=$(cargo deb --version 2>/dev/null || true)
  if [[ $have != "cargo-deb $cargo_deb_version" ]]; then
    echo "$me: installing cargo-deb $cargo_deb_version${have:+ (found: $have)}"
    cargo install --locked --quiet cargo-deb --version "$cargo_deb_version"
  fi
}
if [ "${1:-}" = --install-tool ]; then
  install_tool
  exit 0
fi
[ "${1:-}" = --no-build ] || scripts/build.sh
for f in target/release/sandpit target/x86_64-unknown-linux-gnu/release/sandpit-agent; do
  [ -x "$f" ] || die "$f is missing: run scripts/build.sh"
done
# cargo-deb reads the binaries' library needs with dpkg-shlibdeps.
if ! command -v dpkg-shlibdeps >/dev/null; then
  [ "$(id -u)" = 0 ] || die "dpkg-shlibdeps is missing: apt-get install dpkg-dev"
  echo "$me: installing dpkg-dev"
  DEBIAN_FRONTEND=noninteractive apt-get -y -q install --no-install-recommends dpkg-dev >/dev/null
fi
install_tool
# cargo-deb takes built files from target/release alone; the agent is a
# static build for another target directory.
mkdir -p packaging/build
cp target/x86_64-unknown-linux-gnu/release/sandpit-agent packaging/build/sandpit-agent
# Not stripped: the guest image is named after the agent's bytes, so the
# packaged agent must be the one scripts/build.sh made (and images built
# from a checkout serve the package too).
deb=$(cargo deb -p sandpit --no-build --no-strip --quiet)
[ -f "$deb" ] || die "cargo deb made no package (it said: $deb)"
echo "$deb"
