#!/usr/bin/env bash
# The GPU check: one command, one GPU, at most 8 minutes. Without a CUDA device it prints a line and exits 0.
#
#   bash scripts/gpu_check.sh
#
# 1. the GPU tests (tests/gpu: SP=2 as two processes on the one GPU over gloo, packed documents with a
#    cross-document leak control, bf16 against fp32);
# 2. the kernel matrix (python -m benchmarks.gpu_check): sdpa, eager, flash-attn 2 (dense and varlen; the
#    API stand-in of tests/_flash_standin.py when flash-attn is not installed), flex; bf16 and fp32; SP=1 and 2;
# 3. the memory flags on a Llama-3.1-8B-shaped model with ZeRO-3 offload (benchmarks/gpu_memory.py), cut to
#    one step at 64K and one at 128K to fit the budget; the full length ladder (64K..2M) is its own command,
#    `python -m benchmarks.gpu_memory`, and is bounded by host memory (see its docstring).
# Results (tables, JSON, logs) go to benchmarks/results/ (or $OUT when set, as on the device machine).
# Nothing is installed: the repo is imported from its folder; a missing optional package (flash-attn,
# liger-kernel, trl) turns its cells into SKIP rows, never into a failure of the script itself.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PY="${PYTHON:-python3}"
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check: no CUDA device; nothing to run"
    exit 0
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
RESULTS="${OUT:-benchmarks/results}"
mkdir -p "$RESULTS"
STAMP="$(date +%F)"
"$PY" -c 'import torch; print("gpu_check:", torch.cuda.get_device_name(), "torch", torch.__version__)'

status=0
summary=()
step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $RESULTS/<date>-gpu-NAME.log
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit} s) =="
    local start=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee "$RESULTS/$STAMP-gpu-$name.log"
    local rc=${PIPESTATUS[0]}
    summary+=("$(printf '%-14s exit %-3s %4d s' "$name" "$rc" $((SECONDS - start)))")
    [ "$rc" -eq 0 ] || status=1
}

step tests 150 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/gpu
step kernels 180 "$PY" -m benchmarks.gpu_check --out "$RESULTS/$STAMP-gpu-check"
step memory 150 "$PY" -m benchmarks.gpu_memory --lengths 131072 --throughput-steps 1 --timeout 70 \
    --out-prefix "$RESULTS/$STAMP-gpu-memory"

echo "== summary =="
printf '%s\n' "${summary[@]}"
exit "$status"
