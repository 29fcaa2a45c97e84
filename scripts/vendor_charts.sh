#!/usr/bin/env bash
# Re-fetch the dashboard's chart library (uPlot, MIT) from the npm registry into
# service/api/static/vendor/uplot/: the minified browser build, its stylesheet and its LICENSE.
# Pinned: the package tarball must match SHA256 (the registry's own sha512 integrity for this
# version is sha512-KIMVnG68zvu5XXUbC4LQEPnhwOxBuLyW1AHtpm6IKTXImkbLgkMy+jabjLgSLMasNuGGzQm/ep3tOkyTxpiQIw==).
# To upgrade: set VERSION and SHA256 below to the new version and its tarball's sha256 (check
# that tarball against `npm view uplot@<version> dist.integrity` first), run this, and commit the
# script and the files together.
set -euo pipefail

VERSION=1.6.32
SHA256=4b8a8191e425658e3ea8c8c1314b0fc679c861ee3a1af2b20c7b16ba50b5133d

root=$(cd "$(dirname "$0")/.." && pwd)
dest="$root/service/api/static/vendor/uplot"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

(cd "$work" && npm pack "uplot@$VERSION" --silent >/dev/null)
tarball="$work/uplot-$VERSION.tgz"
actual=$(sha256sum "$tarball" | cut -d' ' -f1)
if [ "$actual" != "$SHA256" ]; then
  echo "vendor_charts: uplot-$VERSION.tgz has sha256 $actual, expected $SHA256; not vendored" >&2
  exit 1
fi

tar -xzf "$tarball" -C "$work"
mkdir -p "$dest"
install -m 0644 "$work/package/dist/uPlot.iife.min.js" "$dest/uPlot.iife.min.js"
install -m 0644 "$work/package/dist/uPlot.min.css" "$dest/uPlot.min.css"
install -m 0644 "$work/package/LICENSE" "$dest/LICENSE"
printf 'uplot %s (npm), tarball sha256 %s\n' "$VERSION" "$SHA256" >"$dest/VERSION"
echo "vendor_charts: uplot $VERSION -> ${dest#"$root"/}"
