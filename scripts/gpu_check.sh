#!/usr/bin/env bash
# The GPU check: one command, one GPU, at most 8 minutes. Without a CUDA device it prints a line and exits 0.
#
#   bash scripts/gpu_check.sh                      # GPU_CHECK_EXPECT_SKIP='regex' accepts matching pytest skips
#   bash scripts/gpu_check.sh ladder               # only issue 19's one-H200 ladder (benchmarks/gpu_ladder.py)
#
# 1. the GPU tests (tests/gpu: SP=2 as two processes on the one GPU over gloo, bf16 against fp32); the kernel
#    matrix test (tests/gpu/test_kernels_gpu.py) is step 2 itself, so it is not run twice;
# 2. the kernel matrix (python -m benchmarks.gpu_check): sdpa, eager, flash-attn 2 (the real package: a flash
#    row that resolves to anything else is an ERROR, and without flash-attn its rows are failing SKIPs), flex;
#    bf16 and fp32; SP=1 and 2;
# 3. the memory flags on a Llama-3.1-8B-shaped model with ZeRO-3 offload (benchmarks/gpu_memory.py), cut to
#    one step at 64K and one at 128K to fit the budget; the full length ladder (64K..2M) is its own command,
#    `python -m benchmarks.gpu_memory`, and is bounded by host memory (see its docstring).
# `ladder` runs instead, within 10 minutes: 1.2M, 1.6M and 2M tokens with every memory flag (tiled_layer included)
# and tokens/s at 64K and 256K, at the depth whose offloaded checkpoints fit $GPU_CHECK_HOST_GIB (default 128)
# GiB of host RAM, each peak scaled to 32 layers by the planner; PASS/FAIL per rung (see benchmarks/gpu_ladder.py).
# A SKIP is not a pass: a skipped GPU test (unless it matches $GPU_CHECK_EXPECT_SKIP, e.g. one that needs 2
# GPUs) or a SKIP row of the kernel matrix fails the check. Results (tables, JSON, logs) go to
# benchmarks/results/ and are committed when this is a git checkout (GPU_CHECK_NO_COMMIT=1: not); with $OUT
# set (the device machine) they are copied there too. Nothing is installed: the repo is imported from its folder.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
MODE="${1:-all}"
if [ "$MODE" != all ] && [ "$MODE" != ladder ]; then
    echo "gpu_check: unknown mode '$MODE' (use no argument or 'ladder')" >&2
    exit 2
fi

PY="${PYTHON:-python3}"
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check: no CUDA device; nothing to run"
    exit 0
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
RESULTS=benchmarks/results
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

# Fails on a skipped test (junit XML) that $GPU_CHECK_EXPECT_SKIP does not match.
SKIPS='import re, sys, xml.etree.ElementTree as ET
cases = [c for c in ET.parse(sys.argv[1]).getroot().iter("testcase") if c.find("skipped") is not None]
bad = [c.get("classname") + "::" + c.get("name") for c in cases if not re.search(sys.argv[2], c.get("name"))]
print("\n".join(f"gpu_check: unexpected SKIP {name}" for name in bad) or "gpu_check: no unexpected skips")
sys.exit(1 if bad else 0)'

if [ "$MODE" = ladder ]; then
    step ladder 590 "$PY" -m benchmarks.gpu_ladder --budget-s 560 --host-memory "${GPU_CHECK_HOST_GIB:-128}" \
        --out-prefix "$RESULTS/$STAMP-gpu-ladder"
else
    step tests 150 "$PY" -m pytest -q -rs -p no:cacheprovider -m gpu tests/gpu --ignore=tests/gpu/test_kernels_gpu.py \
        --junitxml="$RESULTS/$STAMP-gpu-tests.xml"
    step test-skips 30 "$PY" -c "$SKIPS" "$RESULTS/$STAMP-gpu-tests.xml" "${GPU_CHECK_EXPECT_SKIP:-^$}"
    step kernels 180 "$PY" -m benchmarks.gpu_check --out "$RESULTS/$STAMP-gpu-check"
    step memory 150 "$PY" -m benchmarks.gpu_memory --lengths 131072 --throughput-steps 1 --timeout 70 \
        --out-prefix "$RESULTS/$STAMP-gpu-memory"
fi

echo "== summary =="
printf '%s\n' "${summary[@]}" | tee "$RESULTS/$STAMP-gpu-summary.txt"
[ -n "${OUT:-}" ] && cp "$RESULTS/$STAMP"-gpu-* "$OUT"/
if [ -z "${GPU_CHECK_NO_COMMIT:-}" ] && git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    git add "$RESULTS/$STAMP"-gpu-* && git commit -q -m "gpu_check: results of $STAMP (exit $status)" -- "$RESULTS" \
        && echo "gpu_check: results committed"
fi
exit "$status"
