#!/usr/bin/env bash
# Install hf_longctx in editable mode, for developers, CI and the README.
#
# Usage: bash scripts/install.sh [EXTRAS]      (default EXTRAS: dev; e.g. "dev,trl" or "gpu")
#
# Without a GPU (no nvidia-smi) torch is pinned to the CPU build first: a plain `torch` requirement
# would otherwise pull the multi-GB CUDA wheels.
set -euo pipefail

EXTRAS="${1:-dev}"
PYTHON="${PYTHON:-python}"
TORCH_CPU_VERSION="${TORCH_CPU_VERSION:-2.13.0}"

cd "$(dirname "${BASH_SOURCE[0]}")/.."

if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "install.sh: no nvidia-smi found; installing the CPU build of torch==${TORCH_CPU_VERSION}"
    "$PYTHON" -m pip install "torch==${TORCH_CPU_VERSION}"
fi

if [[ -n "$EXTRAS" ]]; then
    "$PYTHON" -m pip install -e ".[${EXTRAS}]"
else
    "$PYTHON" -m pip install -e .
fi
