#!/usr/bin/env bash
# One device call that checks the GPU path and runs `bench gpu` on one H200 (~8 minutes).
#
# From a session with the device tool, call `run` with exactly (COMMIT = `git rev-parse HEAD` here,
# since .git does not travel to the device machine):
#
#   command:   bash benchmarks/gpu/device_run.sh --on-device COMMIT
#   timeout_s: 540
#   carry:     []        (nothing to carry: torch, triton and transformers are on the device image
#                          (KINDS.md); pdserve runs from the copied tree with `python3 -m`)
#
# What comes back under $OUT (the files the tool copies home): gpu_bench.json (the result with
# provenance) and run.log (pytest + benchmark output). Copy gpu_bench.json into
# benchmarks/results/ and commit it with the README's table.
#
# Not on the device image, so skipped with a note in the JSON: ray (not needed here) and nixl
# (the NIXL UCX cuda_ipc transfer; the 671 MB transfer is measured through CUDA IPC between two
# processes instead). To measure NIXL too, carry nixl-cu13 wheels as the device README says
# (its shared libraries are ~117 MB unpacked: check the 64 MiB carry limit first).
#
# Run here without --on-device, it prints the command line with this checkout's commit filled in.
set -uo pipefail

if [[ "${1:-}" != "--on-device" ]]; then
    commit=$(git -C "$(dirname "$0")/../.." rev-parse HEAD)
    echo "bash benchmarks/gpu/device_run.sh --on-device ${commit}"
    exit 0
fi
commit="${2:-unknown}"
out="${OUT:-benchmarks/results/local}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
'green contexts', getattr(__import__('torch.cuda.green_contexts', fromlist=['x']), 'SUPPORTED', None))"
    # 1. correctness first (~1 min): interpreter test, native kernel, scaled_mm, graphs, green contexts
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_kernels.py
    # 2. the measurements; each section writes $out/gpu_bench.json as it finishes
    timeout 380 python3 -m benchmarks.gpu.bench_gpu --budget-s 340 --out-dir "$out" --git-commit "$commit"
} 2>&1 | tee "$out/run.log"
