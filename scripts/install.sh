#!/usr/bin/env bash
# Install hf_longctx in editable mode, for developers, CI and the README.
#
# Usage: bash scripts/install.sh [EXTRAS]      (default EXTRAS: dev; e.g. "dev,trl", "gpu", or "" for none)
#
# torch first, and it says which build it got:
# - a torch already installed is kept;
# - with a GPU (nvidia-smi found) pip's default index resolves torch with the package (the CUDA build);
# - without one on Linux, where PyPI's torch is the CUDA build (several GB), the CPU build of
#   torch==TORCH_CPU_VERSION from the PyTorch CPU wheel index (TORCH_CPU_INDEX; the index
#   https://pytorch.org/get-started/locally/ gives for pip, Linux, CPU); if that index does not answer (a machine
#   that reaches only PyPI or a mirror), torch==TORCH_CPU_VERSION from pip's default index, and it says whether
#   that was a CPU build;
# - without one elsewhere (macOS, Windows) PyPI's torch is the CPU build: torch==TORCH_CPU_VERSION from it.
set -euo pipefail

EXTRAS="${1-dev}"   # an empty argument: no extras
PYTHON="${PYTHON:-python}"
TORCH_CPU_VERSION="${TORCH_CPU_VERSION:-2.13.0}"
TORCH_CPU_INDEX="${TORCH_CPU_INDEX-https://download.pytorch.org/whl/cpu}"   # empty: never try it

cd "$(dirname "${BASH_SOURCE[0]}")/.."

say() { echo "install.sh: $*"; }

installed_torch() {  # "<version> <cuda version or cpu>", or nothing
    "$PYTHON" -c 'import torch; print(torch.__version__, torch.version.cuda or "cpu")' 2>/dev/null || true
}

describe() {  # what "<version> <cuda or cpu>" is
    local version="${1%% *}" cuda="${1##* }"
    if [[ "$cuda" == cpu ]]; then echo "torch $version, a CPU build"; else echo "torch $version, a CUDA $cuda build"; fi
}

have="$(installed_torch)"
if [[ -n "$have" ]]; then
    say "keeping the installed $(describe "$have")"
elif command -v nvidia-smi >/dev/null 2>&1; then
    say "nvidia-smi found: torch comes with the package from pip's default index"
elif [[ "$(uname -s)" == Linux ]]; then
    cpu_index=(--index-url "$TORCH_CPU_INDEX")
    if [[ -n "$TORCH_CPU_INDEX" ]] && "$PYTHON" -m pip install --timeout 20 --retries 1 "${cpu_index[@]}" \
        "torch==${TORCH_CPU_VERSION}"; then
        say "no GPU: installed $(describe "$(installed_torch)")" \
            "(pip install ${cpu_index[*]} torch==${TORCH_CPU_VERSION})"
    else
        say "no GPU, and the PyTorch CPU index (TORCH_CPU_INDEX=${TORCH_CPU_INDEX}) gave no torch:" \
            "falling back to pip's default index"
        "$PYTHON" -m pip install "torch==${TORCH_CPU_VERSION}"
        got="$(installed_torch)"
        say "installed $(describe "$got") (pip install torch==${TORCH_CPU_VERSION})"
        [[ "${got##* }" == cpu ]] || say "warning: a CUDA build without a GPU (several GB; it runs on the CPU)"
    fi
else
    "$PYTHON" -m pip install "torch==${TORCH_CPU_VERSION}"
    say "no GPU on $(uname -s): installed $(describe "$(installed_torch)") (pip install torch==${TORCH_CPU_VERSION})"
fi

if [[ -n "$EXTRAS" ]]; then
    "$PYTHON" -m pip install -e ".[${EXTRAS}]"
else
    "$PYTHON" -m pip install -e .
fi
say "hf_longctx installed (editable, extras: ${EXTRAS:-none}) with $(describe "$(installed_torch)")"
