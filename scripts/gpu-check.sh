#!/usr/bin/env bash
# GPU checks of gradsync's CUDA feature (issue 7): kernels against their CPU
# references on random data, a world-1 NCCL all-reduce on a dedicated stream,
# pack bandwidth against a device-to-device copy, comm/compute overlap, then
# the end-to-end example: a GradSync over NCCL with device payloads (recompute
# segments, re-fired hooks, an unused parameter), exact on every step.
#
#   scripts/gpu-check.sh build   # where Rust is: release build with --features cuda
#   scripts/gpu-check.sh run     # where the GPU is (no Rust needed): run the built binary
#   scripts/gpu-check.sh         # both, on a machine that has Rust and a GPU
#
# GPU machines lent without a toolchain: build here, carry target/release/gpu-check
# and target/release/examples/nccl_sync there, and run `scripts/gpu-check.sh run`.
# Without a GPU the binary prints SKIP.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=target/release/gpu-check
example=target/release/examples/nccl_sync
what=${1:-all}
if [ "$what" = build ] || [ "$what" = all ]; then
    cargo build --release --features cuda --bin gpu-check --example nccl_sync
fi
if [ "$what" = run ] || [ "$what" = all ]; then
    [ -x "$bin" ] || { echo "no $bin: run '$0 build' first" >&2; exit 2; }
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
    "$bin" | tee target/gpu-check.out
    if grep -q '^SKIP' target/gpu-check.out; then
        exit 0
    fi
    [ -x "$example" ] || { echo "no $example: run '$0 build' first" >&2; exit 2; }
    RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=${MASTER_PORT:-29517} \
        "$example" --steps "${STEPS:-50}"
fi
