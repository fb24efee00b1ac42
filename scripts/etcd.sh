#!/usr/bin/env bash
# Prints the path of an etcd server binary, for the tests of the etcd store.
# Uses one on PATH if present; otherwise unpacks Debian's `etcd-server`
# package under target/etcd, without installing it or starting anything.
set -euo pipefail
cd "$(dirname "$0")/.."
if command -v etcd >/dev/null 2>&1; then
    command -v etcd
    exit 0
fi
dir="$PWD/target/etcd"
if [ ! -x "$dir/usr/bin/etcd" ]; then
    mkdir -p "$dir"
    (
        cd "$dir"
        apt-get download etcd-server >/dev/null 2>&1 || { apt-get update -qq >/dev/null && apt-get download etcd-server >/dev/null; }
        dpkg -x etcd-server_*.deb .
    )
fi
echo "$dir/usr/bin/etcd"
