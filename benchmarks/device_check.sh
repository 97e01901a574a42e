#!/usr/bin/env bash
# The checks to run where a GPU is lent, in one call (issue 47, item 4), from the repository root:
#
#     bash benchmarks/device_check.sh
#
# 1. the tests marked `cuda` (tests/test_cuda.py: batch norm bitwise torch's, checkpointing, no host
#    sync with a fused optimizer, bfloat16 fused AdamW, CUDA graphs, DDP on one NCCL rank);
# 2. benchmarks/sync_free_skip_gpu.py (on_nonfinite="skip" and scaler= with no host sync);
# 3. the headline benchmarks on CUDA, short: python -m benchmarks --device cuda --only launch --only step
#    --only rules --only alloc --repeats 5 (the ratios pu / plain PyTorch).
#
# Each part runs under `timeout` (the whole script stays under 8 minutes on one GPU); a failing part does
# not stop the others, and the script exits non-zero at the end if any failed, after a summary. Without a
# CUDA device it says so and exits 0. It installs nothing: it uses $PYTHON (default: python) as it is,
# with this checkout's src/ first on PYTHONPATH so that the tree being checked is the one imported.
set -euo pipefail

cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

if ! "$PY" -c "import torch, paramupdates"; then
    echo "device_check: $PY cannot import torch and paramupdates (install the test environment first)"
    exit 1
fi
if ! "$PY" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
    echo "device_check: no CUDA device (torch.cuda.is_available() is False); nothing to run"
    exit 0
fi

if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi -L || true
fi
"$PY" -c "import torch, paramupdates; print(f'device_check: {torch.cuda.get_device_name()}, torch {torch.__version__} (CUDA {torch.version.cuda}), paramupdates from {paramupdates.__file__}')" || true
echo "device_check: commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git status --porcelain 2>/dev/null | grep -q . && echo '+' || true)"

declare -a SUMMARY=()
FAILED=0

part() {  # part NAME SECONDS COMMAND...: run one part under a timeout, record how it ended
    local name="$1" limit="$2"
    shift 2
    echo
    echo "=== device_check: $name (timeout ${limit} s): $*"
    local start=$SECONDS rc=0
    timeout --kill-after=10 "$limit" "$@" || rc=$?
    local took=$((SECONDS - start))
    if [ "$rc" -eq 0 ]; then
        SUMMARY+=("PASS     $name (${took} s)")
    elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        SUMMARY+=("TIMEOUT  $name (after ${limit} s)")
        FAILED=1
    else
        SUMMARY+=("FAIL     $name (exit status $rc, ${took} s)")
        FAILED=1
    fi
}

part "tests marked cuda" 240 "$PY" -m pytest -m cuda -q -rs -p no:cacheprovider
part "sync-free skip (benchmarks/sync_free_skip_gpu.py)" 60 "$PY" benchmarks/sync_free_skip_gpu.py
part "headline benchmarks on CUDA" 150 "$PY" -m benchmarks --device cuda --only launch --only step \
    --only rules --only alloc --repeats 5

echo
echo "=== device_check: summary"
for line in "${SUMMARY[@]}"; do
    echo "  $line"
done
if [ "$FAILED" -ne 0 ]; then
    echo "device_check: some parts failed"
    exit 1
fi
echo "device_check: all parts passed"
