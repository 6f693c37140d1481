#!/usr/bin/env bash
# Installs the system packages Sandpit needs on Debian 12, as root:
# QEMU (from bookworm-backports when available: the newer QEMU is what is
# tested, and it matches a qemu-utils that may already come from there),
# image tools, passt, and what the test suite uses (iproute2, python3, curl).
set -euo pipefail
if [ "$(id -u)" != 0 ]; then
  echo "install-deps.sh: run as root (it uses apt-get)" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
if [ -r /etc/os-release ] && grep -q 'VERSION_CODENAME=bookworm' /etc/os-release; then
  if ! grep -rqs 'bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/; then
    echo "deb http://deb.debian.org/debian bookworm-backports main" > /etc/apt/sources.list.d/sandpit-backports.list
  fi
fi
apt-get update -qq
if apt-cache policy qemu-system-x86 | grep -q bpo; then
  apt-get install -y -qq -t bookworm-backports qemu-system-x86 qemu-utils >/dev/null
else
  apt-get install -y -qq qemu-system-x86 qemu-utils >/dev/null
fi
apt-get install -y -qq debootstrap passt e2fsprogs iproute2 python3 curl ca-certificates \
  gcc libc6-dev pkg-config nftables >/dev/null
echo "install-deps.sh: $(qemu-system-x86_64 --version | head -1); $(passt --version 2>/dev/null | head -1 || echo passt)"
