#!/usr/bin/env bash
# Fills .whl/ (git-ignored) with the Python 3.12 x86-64 wheels of the packages a GPU machine with torch alone lacks
# (transformers, accelerate, TRL, DeepSpeed, datasets, PEFT, Liger and what they need; scripts/gpu_wheels.txt pins
# the versions the CPU suite runs with), for a GPU machine without network. scripts/gpu_check.sh installs them into
# /tmp/hf_longctx_site first when .whl/ holds any.
#
#   bash scripts/gpu_wheels.sh        # here, with network (about 40 MB)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl -r scripts/gpu_wheels.txt 2>&1 | grep -v "^WARNING: Location" || true
# DeepSpeed publishes only a source archive: its wheel (no compiled ops) is built here.
ls .whl/deepspeed-*.whl >/dev/null 2>&1 || python3 -m pip wheel -q --no-deps --no-build-isolation -w .whl \
    "$(grep '^deepspeed==' scripts/gpu_wheels.txt)"
du -sh .whl
