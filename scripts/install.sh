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
#
# The gpu extra (flash-attn, liger-kernel): flash-attn's setup.py imports torch, so pip's isolated build environment
# (torch-less) fails with "No module named 'torch'" (Dao-AILab/flash-attention#1920). As its README says, it is
# installed after torch, against it, with `pip install flash-attn --no-build-isolation` (its setup.py fetches the
# prebuilt wheel of the release that matches torch, CUDA, Python and the C++ ABI when there is one, else compiles:
# MAX_JOBS bounds the parallel compile jobs); FLASH_ATTN_WHEEL (a wheel's path or URL) installs that wheel instead.
# Then the package's own install finds flash-attn already there. It needs a CUDA build of torch.
set -euo pipefail

EXTRAS="${1-dev}"   # an empty argument: no extras
PYTHON="${PYTHON:-python}"
TORCH_CPU_VERSION="${TORCH_CPU_VERSION:-2.13.0}"
TORCH_CPU_INDEX="${TORCH_CPU_INDEX-https://download.pytorch.org/whl/cpu}"   # empty: never try it
FLASH_ATTN_WHEEL="${FLASH_ATTN_WHEEL-}"   # a flash-attn wheel (path or URL) to install instead of building

cd "$(dirname "${BASH_SOURCE[0]}")/.."

say() { echo "install.sh: $*"; }

installed_torch() {  # "<version> <cuda version or cpu>", or nothing
    "$PYTHON" -c 'import torch; print(torch.__version__, torch.version.cuda or "cpu")' 2>/dev/null || true
}

describe() {  # what "<version> <cuda or cpu>" is
    local version="${1%% *}" cuda="${1##* }"
    if [[ "$cuda" == cpu ]]; then echo "torch $version, a CPU build"; else echo "torch $version, a CUDA $cuda build"; fi
}

cuda_torch_needed() {  # the gpu extra without torch or a GPU: stop before installing a CPU torch
    say "error: the gpu extra needs a CUDA build of torch (flash-attn compiles against it); found $1." \
        "Drop gpu from the extras on a machine without a GPU, or install a CUDA build of torch first." >&2
    exit 1
}

installed_flash_attn() {  # its version, or nothing
    "$PYTHON" -c 'import flash_attn; print(flash_attn.__version__)' 2>/dev/null || true
}

install_flash_attn() {  # after torch, against it (see the header)
    local torch have
    torch="$(installed_torch)"
    [[ "${torch##* }" != cpu ]] || cuda_torch_needed "$(describe "$torch")"
    have="$(installed_flash_attn)"
    if [[ -n "$have" ]]; then
        say "keeping the installed flash-attn $have"
    elif [[ -n "$FLASH_ATTN_WHEEL" ]]; then
        "$PYTHON" -m pip install "$FLASH_ATTN_WHEEL"
        say "installed flash-attn $(installed_flash_attn) from FLASH_ATTN_WHEEL=${FLASH_ATTN_WHEEL}"
    else
        "$PYTHON" -m pip install packaging ninja psutil setuptools wheel   # what its setup.py imports besides torch
        "$PYTHON" -m pip install flash-attn --no-build-isolation
        say "installed flash-attn $(installed_flash_attn) against $(describe "$torch")" \
            "(pip install flash-attn --no-build-isolation: its release's prebuilt wheel where one matches, else built)"
    fi
}

GPU_EXTRA=0
[[ ",$EXTRAS," != *,gpu,* ]] || GPU_EXTRA=1
have="$(installed_torch)"
if [[ -z "$have" && "$GPU_EXTRA" == 1 ]] && ! command -v nvidia-smi >/dev/null 2>&1; then
    cuda_torch_needed "no torch and no GPU (nvidia-smi)"
fi
if [[ -n "$have" ]]; then
    say "keeping the installed $(describe "$have")"
elif [[ "$GPU_EXTRA" == 1 ]]; then   # with a GPU (checked above)
    "$PYTHON" -m pip install "torch>=2.6"   # before flash-attn, which builds against it
    say "nvidia-smi found: installed $(describe "$(installed_torch)") from pip's default index (pip install torch>=2.6)"
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

if [[ "$GPU_EXTRA" == 1 ]]; then install_flash_attn; fi

if [[ -n "$EXTRAS" ]]; then
    "$PYTHON" -m pip install -e ".[${EXTRAS}]"
else
    "$PYTHON" -m pip install -e .
fi
say "hf_longctx installed (editable, extras: ${EXTRAS:-none}) with $(describe "$(installed_torch)")"
