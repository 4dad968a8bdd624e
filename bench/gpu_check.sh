#!/usr/bin/env bash
# Device check for GPU KV caches, on a machine with one NVIDIA GPU (the H200 device
# machine): the VRAM unit tests, host staging's block copies timed and checked
# (bench/staging_copy.py), then bench/gpu_check.py (two daemons, two engine
# processes whose KV caches are cuMem allocations passed to the daemons as file
# descriptors, pushes verified on the GPU, 1 GiB through the daemons against bare
# NIXL between the engine processes on the same memory, and the UCX transports the
# daemons used). Run from the repository root after bench/gpu_wheels.sh:
#
#     bash bench/gpu_check.sh                 # extra arguments go to bench/gpu_check.py
#     bash bench/gpu_check.sh --memory ipc    # the legacy CUDA IPC path instead
#
# Expected, on one GPU: the unit tests pass (the cuMem test prints whether the
# export is GPUDirect RDMA capable), staging copies print GB/s per direction, every
# correctness check reads "ok", the table's "daemons" rows reach >= 0.9x the
# "bare NIXL" rows at 64 KiB and 1 MiB blocks, and the transports list names
# cuda_ipc (not tcp) for the daemons' VRAM pushes.
#
# With the device tool: run(command="bash bench/gpu_check.sh", carry=[".whl"], timeout_s=480).
# Logs (daemons, outputs) go to $OUT when set, else /tmp/gpu_check_logs.
# Exit: 0 passed, 1 a check failed, 2 no GPU or missing stack, 124 over its time limit.
# Stays under 8 minutes: each step has its own limit, gpu_check.py a time budget.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
fail() { echo "gpu_check: FAILED: $*" >&2; exit 2; }

# Fail fast, before installing anything, where there is no GPU.
command -v nvidia-smi >/dev/null || fail "no nvidia-smi: this machine has no NVIDIA GPU"
nvidia-smi -L 2>/dev/null | grep -q GPU || fail "nvidia-smi lists no GPU"
timeout 60 "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' \
    || fail "$PY's torch does not see the GPU (CPU build, or driver mismatch)"

if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || fail "installing the wheels in .whl/ failed"
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
logs=${OUT:-/tmp/gpu_check_logs}
mkdir -p "$logs"
nvidia-smi -L

echo "== tests/test_vram.py on the GPU"
timeout -k 5 90 "$PY" -m pytest -q -p no:cacheprovider tests/test_vram.py bench/gpu_vram_test.py \
    >"$logs/test_vram.txt" 2>&1
unit=$?
tail -n 15 "$logs/test_vram.txt"
[ "$unit" -eq 0 ] && echo "unit tests: passed" || echo "unit tests: FAILED (exit $unit)"

echo "== host staging's block copies, GPU cache <-> pinned /dev/shm mirror (GB/s per direction)"
timeout -k 5 90 "$PY" -m bench.staging_copy --device cuda --no-record 2>&1 \
    | tee "$logs/staging_copy.txt"
staging=${PIPESTATUS[0]}
[ "$staging" -eq 0 ] && echo "staging copies: passed" || echo "staging copies: FAILED (exit $staging)"

echo "== end to end through two daemons (KV memory passed as cuMem descriptors unless --memory ipc)"
timeout -k 5 290 "$PY" -m bench.gpu_check --logs "$logs" "$@" 2>&1 | tee "$logs/gpu_check.txt"
e2e=${PIPESTATUS[0]}
if [ "$e2e" -ne 0 ]; then exit "$e2e"; fi
[ "$unit" -eq 0 ] && [ "$staging" -eq 0 ] || exit 1
