"""The recipes' argument parsing, with one clear line where a GPU recipe starts on a machine without a GPU.

transformers' `TrainingArguments` refuses `bf16: true` without a GPU with "Your setup doesn't support bf16/gpu. You
need to assign use_cpu ...", raised inside the parser: every process of the launch prints that traceback (about
270 lines for 8 processes), and its hint is wrong for a GPU node whose CUDA device is not visible.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from trl import TrlParser

_NO_GPU = "doesn't support bf16/gpu"


def parse_recipe(parser: TrlParser) -> Any:
    """`parser.parse_args_and_config()`; without a visible CUDA device where the recipe needs one, exit 1 with the
    reason (printed by the first process only) instead of transformers' traceback."""
    try:
        return parser.parse_args_and_config()
    except ValueError as err:
        if _NO_GPU not in str(err) or torch.cuda.is_available():
            raise
        if os.environ.get("RANK", "0") == "0":
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            print(
                f"{sys.argv[0]}: this recipe trains in bf16 on GPUs, and this process sees no CUDA device "
                f"(torch {torch.__version__}, {build}). On a GPU machine: check nvidia-smi and CUDA_VISIBLE_DEVICES, "
                "or install a CUDA torch (bash scripts/install.sh trl,deepspeed,gpu). On CPU: run the tiny recipes "
                "(recipes/tiny_*.yaml, README).",
                file=sys.stderr,
            )
        raise SystemExit(1) from None
