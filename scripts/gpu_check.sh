#!/usr/bin/env bash
# The GPU check: one command on one GPU, within 8 minutes. Without a CUDA device it prints a line and exits 0.
#
#   bash scripts/gpu_check.sh              # the GPU tests, the block-kernel table, the kernel matrix, one memory run
#   bash scripts/gpu_check.sh ladder       # instead: the one-GPU ladder and throughput (benchmarks/gpu_ladder.py)
#
# First, when .whl/ holds wheels (scripts/gpu_wheels.sh fills it on a machine with network, for one without), they
# are installed into /tmp/hf_longctx_site and put on PYTHONPATH: a GPU box with torch alone gets the project's pins.
# 1. tests (scripts/gpu_tests.py): every test in tests/gpu in its own process (a CUDA fault poisons only its own),
#    8 at a time, the memory tests (16 GiB and more each) one at a time; a skip fails unless its id matches
#    $GPU_CHECK_EXPECT_SKIP;
# 2. kernels (python -m benchmarks.gpu_kernels): which block kernel runs each mask, ring and tile errors vs float64;
# 3. matrix (python -m benchmarks.gpu_check): sdpa, eager, flex, flash-attn 2 through Ulysses, ring, hybrid; bf16 and
#    fp32; one job per kernel and backend, all at once. Without flash-attn its rows are SKIPs that fail unless
#    $GPU_CHECK_EXPECT_SKIP_KERNELS names flash_attention_2;
# 4. memory (python -m benchmarks.gpu_memory): the memory flags on a Llama-3.1-8B-shaped model, one step at 128K.
# `ladder` runs 1.2M, 1.6M and 2M tokens with every memory flag and tokens/s and MFU at 64K and 256K, within its own
# 10 minutes ($GPU_LADDER_ARGS adds options, e.g. "--rungs 1200000 --throughput-lengths 65536").
# Every step has a time limit and writes its log as it goes: to benchmarks/results/<date>-gpu-<step>.log and, with
# $OUT set (the device machine), to $OUT too, so a step killed by its limit still shows how far it got. Results are
# committed when this is a git checkout (GPU_CHECK_NO_COMMIT=1: not).
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
START=$SECONDS
if compgen -G ".whl/*.whl" >/dev/null; then
    timeout -k 5 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/hf_longctx_site \
        .whl/*.whl 2>&1 | tail -3
    export PYTHONPATH="/tmp/hf_longctx_site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
RESULTS=benchmarks/results
mkdir -p "$RESULTS" ${OUT:+"$OUT"}
STAMP="$(date +%F)"
"$PY" -c 'import torch, transformers; print("gpu_check:", torch.cuda.get_device_name(), "torch", torch.__version__,
"transformers", transformers.__version__)'

status=0
summary=()
step() {  # step NAME SECONDS COMMAND...: a time limit, the log to $RESULTS (and $OUT) as it goes
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit} s, $((SECONDS - START)) s in) =="
    local start=$SECONDS log="$RESULTS/$STAMP-gpu-$name.log"
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$log" ${OUT:+"$OUT/gpu-$name.log"}
    local rc=${PIPESTATUS[0]}
    summary+=("$(printf '%-8s exit %-3s %4d s' "$name" "$rc" $((SECONDS - start)))")
    [ "$rc" -eq 0 ] || status=1
}

if [ "$MODE" = ladder ]; then
    # shellcheck disable=SC2086
    step ladder 590 "$PY" -m benchmarks.gpu_ladder --budget-s 560 --host-memory "${GPU_CHECK_HOST_GIB:-128}" \
        --out-prefix "$RESULTS/$STAMP-gpu-ladder" --log-dir "${OUT:-$RESULTS}/$STAMP-gpu-ladder-logs" \
        ${GPU_LADDER_ARGS:-}
else
    step tests 240 "$PY" scripts/gpu_tests.py --out "${OUT:-$RESULTS/$STAMP-gpu-tests}" \
        --expect-skip "${GPU_CHECK_EXPECT_SKIP:-^$}"
    step kernels 90 "$PY" -m benchmarks.gpu_kernels --out "$RESULTS/$STAMP-gpu-kernels"
    step matrix 100 "$PY" -m benchmarks.gpu_check --out "$RESULTS/$STAMP-gpu-check" \
        --expect-skip "${GPU_CHECK_EXPECT_SKIP_KERNELS:-}"
    step memory 100 "$PY" -m benchmarks.gpu_memory --lengths 131072 --throughput-steps 1 --timeout 90 \
        --out-prefix "$RESULTS/$STAMP-gpu-memory"
fi

echo "== summary ($((SECONDS - START)) s) =="
printf '%s\n' "${summary[@]}" | tee "$RESULTS/$STAMP-gpu-summary.txt"
[ -n "${OUT:-}" ] && cp -r "$RESULTS/$STAMP"-gpu-* "$OUT"/ 2>/dev/null
if [ -z "${GPU_CHECK_NO_COMMIT:-}" ] && git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    git add "$RESULTS/$STAMP"-gpu-* && git commit -q -m "gpu_check: results of $STAMP (exit $status)" -- "$RESULTS" \
        && echo "gpu_check: results committed"
fi
exit "$status"
