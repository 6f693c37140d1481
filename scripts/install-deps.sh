#!/usr/bin/env bash
# Installs the system packages Sandpit needs, as root, on Debian 12: QEMU
# (from bookworm-backports: QEMU 10 is what is tested, and snapshot templates
# need >= 8.2, which bookworm's own 7.2 is not), image tools, passt,
# libnss-myhostname (so `*.localhost` preview URLs resolve for every program),
# Node.js where the machine has none, and what the tests use. Other releases
# get their own QEMU. Rust is not installed here (see scripts/build.sh).
#
# It must be right whatever the machine already has (nothing, bookworm's QEMU
# 7.2, backports' QEMU, or half of each) and a second run changes nothing.
#
# No pipe into a reader that stops early (grep's quiet mode, head): under
# pipefail the reader exits at its first match, the writer dies of SIGPIPE,
# and the pipeline fails at random; that once sent this script down the wrong
# branch. Output is captured in variables and matched with bash patterns
# instead.
set -euo pipefail
me=install-deps.sh
die() {
  echo "$me: $*" >&2
  exit 1
}
warn() { echo "$me: warning: $*" >&2; }
[ "$(id -u)" = 0 ] || die "run as root (it uses apt-get)"
export DEBIAN_FRONTEND=noninteractive

# apt-get, quiet when it works, with all of its output when it does not (the
# reason for "held broken packages" is on stdout).
apt_get() {
  local out
  if ! out=$(apt-get -y -q "$@" 2>&1); then
    printf '%s\n' "$out" >&2
    die "apt-get $* failed (its output is above)"
  fi
}

codename=
if [ -r /etc/os-release ]; then
  # shellcheck source=/dev/null
  codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
fi

# --- QEMU ----------------------------------------------------------------
qemu_pkgs=(qemu-system-x86 qemu-utils)
qemu_target=()
apt_get update
if [ "$codename" = bookworm ]; then
  # Ask apt, not the sources files, whether backports is there: it may be
  # configured in any file and form (one-line or deb822), or present and
  # disabled.
  madison=$(apt-cache madison qemu-system-x86)
  if [[ $madison != *" bookworm-backports/"* ]]; then
    echo "deb http://deb.debian.org/debian bookworm-backports main" \
      >/etc/apt/sources.list.d/sandpit-backports.list
    apt_get update
    madison=$(apt-cache madison qemu-system-x86)
    [[ $madison == *" bookworm-backports/"* ]] ||
      die "apt offers no qemu-system-x86 from bookworm-backports, even with" \
        "/etc/apt/sources.list.d/sandpit-backports.list (run apt-get update to see why)"
  fi
  qemu_target=(-t bookworm-backports)
  # Every installed package built from QEMU's source (qemu-block-extra,
  # qemu-system-gui, ...) moves to backports with the rest: a 7.2 one left
  # behind pins its siblings to 7.2 ("held broken packages"). Listing them
  # marks them manually installed, so the ones that were automatic are marked
  # so again afterwards.
  installed=$(dpkg-query -W -f='${db:Status-Abbrev}|${source:Package}|${Package}\n' 'qemu-*' 2>/dev/null || true)
  while IFS='|' read -r status source package; do
    # Second letter of the status: anything but n (not installed) and c
    # (only configuration files left) is installed at least in part.
    if [[ $source == qemu && $status == ?[iUFHWt]* && " ${qemu_pkgs[*]} " != *" $package "* ]]; then
      qemu_pkgs+=("$package")
    fi
  done <<<"$installed"
fi
auto=$(apt-mark showauto "${qemu_pkgs[@]}")
echo "$me: installing ${qemu_pkgs[*]}${qemu_target[*]:+ from ${qemu_target[1]}}"
# Recommends are a desktop's (GTK and SPICE front ends, UEFI firmware, network
# block drivers); Sandpit runs headless microvm guests with a direct kernel boot.
apt_get install --no-install-recommends "${qemu_target[@]}" "${qemu_pkgs[@]}"
if [ -n "$auto" ]; then
  # shellcheck disable=SC2086 # one package name per word
  apt-mark auto $auto >/dev/null
fi

# --- Everything else -----------------------------------------------------
# g++: libFuzzer, which the fuzz targets (scripts/fuzz.sh) link, is C++.
# python3-venv: the E2B tests install E2B's Python SDK in an environment of
# its own (scripts/e2b-sdks.sh).
# postgresql: the tests start their own server from its initdb (as the
# postgres user the package creates); a cluster's shared state lives on one.
# chromium, chromium-driver: the browser tests drive a headless Chromium
# through its chromedriver (the same source package, so the same version);
# fonts-dejavu-core: a font for pages' text, named rather than left to
# whichever of fontconfig's alternatives apt picks.
# systemd-container, dpkg-dev: the package test builds the .deb (cargo-deb
# reads library needs with dpkg-shlibdeps) and boots a clean Debian root
# with systemd in systemd-nspawn to install it.
pkgs=(debootstrap passt e2fsprogs iproute2 python3 python3-venv curl ca-certificates
  gcc g++ libc6-dev pkg-config nftables libnss-myhostname postgresql
  chromium chromium-driver fonts-dejavu-core
  systemd-container dpkg-dev)
# Node.js only where there is none: a machine that has it from elsewhere
# (NodeSource, nvm, a tarball) keeps it, and Debian's npm next to another
# Node.js would pull Debian's nodejs in beside it, or conflict with it.
if ! command -v node >/dev/null; then
  pkgs+=(nodejs)
  command -v npm >/dev/null || pkgs+=(npm)
elif ! command -v npm >/dev/null; then
  node=$(command -v node)
  if dpkg-query -S "$(readlink -f "$node")" >/dev/null 2>&1; then
    pkgs+=(npm)
  else
    warn "$node (not from a Debian package) has no npm; install npm the way that Node.js was installed"
  fi
fi
echo "$me: installing ${pkgs[*]}"
apt_get install --no-install-recommends "${pkgs[@]}"

# --- Preview host names --------------------------------------------------
# libnss-myhostname's postinst adds `myhostname` to the hosts line only when
# it installs the package for the first time; a machine that had the package
# and lost the entry gets it the same way the postinst would add it (after
# `files`).
nss=/etc/nsswitch.conf
if [ -e "$nss" ] && ! grep -q -E '^hosts:[^#]*\s(myhostname)(\s|#|$)' "$nss"; then
  echo "$me: adding myhostname to the hosts line of $nss"
  sed -E -i "$nss" \
    -e '/^hosts:\s[^#]*$/ s/(\s)(files(\s+\[[^]]+\])?)(\s|$)/\1\2 myhostname /' \
    -e '/^hosts:\s.*#/ s/(\s)(files(\s+\[[^]]+\])?)(\s|#)/\1\2 myhostname \3/' \
    -e 's/ $//'
fi
# Preview URLs are http://PORT-ID.localhost:8080; browsers and curl resolve
# *.localhost themselves, Python, Node, Go and the rest ask the system.
probe=8000-sbx_check.localhost
addr=$(getent hosts "$probe" || true)
if [[ ! $addr =~ ^(127\.0\.0\.1|::1)[[:space:]] ]]; then
  die "$probe does not resolve to the loopback (getent hosts: '${addr:-nothing}')," \
    "so preview URLs will not open from programs on this machine: the hosts line" \
    "of $nss needs 'myhostname' (package libnss-myhostname) before 'dns'"
fi

# --- What is installed ---------------------------------------------------
qemu=$(command -v qemu-system-x86_64) || die "qemu-system-x86_64 is not on PATH after installing QEMU"
qemu_version=$("$qemu" --version)
qemu_version=${qemu_version%%$'\n'*}
img_version=$(qemu-img --version)
img_version=${img_version%%$'\n'*}
[[ $qemu_version =~ version\ ([0-9]+)\.([0-9]+)(\.[0-9]+)? ]] ||
  die "cannot read the version of $qemu: '$qemu_version'"
number=${BASH_REMATCH[0]#version }
major=${BASH_REMATCH[1]}
minor=${BASH_REMATCH[2]}
if ((major < 8 || (major == 8 && minor < 2))); then
  if [ "$codename" = bookworm ]; then
    die "$qemu is '$qemu_version' after installing QEMU from bookworm-backports (is another QEMU earlier on PATH?)"
  fi
  warn "$qemu is QEMU $number: snapshot templates need 8.2 or newer, so every VM boots cold"
fi
if [[ $img_version != *"version $number"[!.0-9]* && $img_version != *"version $number" ]]; then
  warn "qemu-img ($img_version) is not the same version as $qemu ($qemu_version)"
fi
passt_version=$(passt --version 2>/dev/null || echo passt)
passt_version=${passt_version%%$'\n'*}
node_version=$(node --version 2>/dev/null || echo none)
npm_version=$(npm --version 2>/dev/null || echo none)
# The packages' versions, not `chromium --version`: Debian's launcher script
# runs desktop checks first and may print shell errors on a container.
chromium_version=$(dpkg-query -W -f='${Version}' chromium)
driver_version=$(dpkg-query -W -f='${Version}' chromium-driver)
[ "$chromium_version" = "$driver_version" ] ||
  die "chromium ($chromium_version) and chromium-driver ($driver_version) differ:" \
    "chromedriver drives only its own Chromium version (apt-get install chromium chromium-driver)"
echo "$me: $qemu_version ($qemu); $img_version; $passt_version; node $node_version, npm $npm_version; chromium and chromium-driver $chromium_version; $probe -> ${addr%%[[:space:]]*}"
