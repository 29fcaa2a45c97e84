#!/usr/bin/env bash
# Make sure Debian's Chromium and its ChromeDriver are installed (/usr/bin/chromium,
# /usr/bin/chromedriver): the dashboard's browser tests (tests/e2e) drive them. Idempotent: a
# quick no-op when both are present. Test tools' own browser downloads are never used.
set -euo pipefail

CHROMIUM=/usr/bin/chromium
CHROMEDRIVER=/usr/bin/chromedriver

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

if [ -x "$CHROMIUM" ] && [ -x "$CHROMEDRIVER" ]; then
  exit 0
fi

echo "install_browser: installing Debian's chromium and chromium-driver"
as_root apt-get update -qq
as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
  chromium chromium-driver >/dev/null

for binary in "$CHROMIUM" "$CHROMEDRIVER"; do
  if [ ! -x "$binary" ]; then
    echo "install_browser: $binary is still missing after apt-get install" >&2
    exit 1
  fi
done
"$CHROMIUM" --version
"$CHROMEDRIVER" --version
