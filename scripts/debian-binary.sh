#!/usr/bin/env bash
# Prints the path of a program from a Debian package, for tests and lints
# that need it: `scripts/debian-binary.sh PACKAGE PROGRAM` (promtool from
# prometheus, etcd from etcd-server). Uses PROGRAM from the PATH if present;
# otherwise unpacks PACKAGE under target/debian/PACKAGE, without installing
# it or starting anything.
set -euo pipefail
cd "$(dirname "$0")/.."
package=${1:?usage: scripts/debian-binary.sh PACKAGE PROGRAM}
program=${2:?usage: scripts/debian-binary.sh PACKAGE PROGRAM}
if command -v "$program" >/dev/null 2>&1; then
    command -v "$program"
    exit 0
fi
dir="$PWD/target/debian/$package"
if [ ! -x "$dir/usr/bin/$program" ]; then
    mkdir -p "$dir"
    (
        cd "$dir"
        apt-get download "$package" >/dev/null 2>&1 || { apt-get update -qq >/dev/null && apt-get download "$package" >/dev/null; }
        dpkg -x "${package}"_*.deb .
    )
fi
echo "$dir/usr/bin/$program"
