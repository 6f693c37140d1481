#!/usr/bin/env bash
# Fetches the dashboard's third-party browser code (xterm.js and its fit
# add-on) from the npm registry, exactly the versions pinned in
# crates/web/assets/package-lock.json, into crates/web/assets/node_modules,
# from where the build embeds them in the sandpit binary: the server needs
# no CDN and no internet at run time. No install scripts run. A second run
# with the same lockfile changes nothing (so the build does not redo the
# crate that embeds them).
set -euo pipefail
cd "$(dirname "$0")/../crates/web/assets"
command -v npm >/dev/null || {
  echo "web-assets.sh: npm is missing: run scripts/install-deps.sh (it installs Node.js and npm)" >&2
  exit 1
}
want=$(sha256sum package-lock.json)
stamp=node_modules/.sandpit-lock.sha256
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
npm ci --ignore-scripts --no-audit --no-fund --loglevel=error
echo "$want" >"$stamp"
echo "web-assets.sh: crates/web/assets/node_modules as package-lock.json pins it"
