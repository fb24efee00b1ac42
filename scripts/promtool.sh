#!/usr/bin/env bash
# Prints the path of a promtool binary. Uses one on PATH if present; otherwise
# unpacks Debian's `prometheus` package (which ships promtool) under
# target/promtool, without installing it or starting anything.
set -euo pipefail
cd "$(dirname "$0")/.."
if command -v promtool >/dev/null 2>&1; then
    command -v promtool
    exit 0
fi
dir="$PWD/target/promtool"
if [ ! -x "$dir/usr/bin/promtool" ]; then
    mkdir -p "$dir"
    (
        cd "$dir"
        apt-get download prometheus >/dev/null 2>&1 || { apt-get update -qq >/dev/null && apt-get download prometheus >/dev/null; }
        dpkg -x prometheus_*.deb .
    )
fi
echo "$dir/usr/bin/promtool"
