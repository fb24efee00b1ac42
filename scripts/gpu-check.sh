#!/usr/bin/env bash
# GPU checks of gradsync's CUDA feature (issue 7): kernels against their CPU
# references on random data, a world-1 NCCL all-reduce on a dedicated stream,
# pack bandwidth against a device-to-device copy, and comm/compute overlap.
#
#   scripts/gpu-check.sh build   # where Rust is: release build with --features cuda
#   scripts/gpu-check.sh run     # where the GPU is (no Rust needed): run the built binary
#   scripts/gpu-check.sh         # both, on a machine that has Rust and a GPU
#
# GPU machines lent without a toolchain: build here, carry target/release/gpu-check
# there, and run `scripts/gpu-check.sh run`. Without a GPU the binary prints SKIP.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=target/release/gpu-check
what=${1:-all}
if [ "$what" = build ] || [ "$what" = all ]; then
    cargo build --release --features cuda --bin gpu-check
fi
if [ "$what" = run ] || [ "$what" = all ]; then
    [ -x "$bin" ] || { echo "no $bin: run '$0 build' first" >&2; exit 2; }
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
    "$bin"
fi
