"""What every recipe shares about loading pretrained weights: the `model_dtype` option and its check.

The recipes run as scripts (`python recipes/x.py`, `torchrun ... recipes/x.py`), so this folder is first
on `sys.path` and they import it by its bare name.
"""

from __future__ import annotations

from dataclasses import field
from typing import Any

import torch

HELP = (
    "dtype the pretrained weights load in: float32 = mixed precision (fp32 master weights and AdamW states, "
    "`bf16: true` autocasts the compute); bfloat16 = pure bf16, where AdamW updates smaller than 2**-8 of a "
    "weight (most at lr 1e-5) round away (with LoRA only the frozen base is bf16)."
)


def model_dtype_field() -> Any:
    """The `model_dtype` dataclass field of a recipe's arguments (default float32)."""
    return field(default="float32", metadata={"help": HELP})


def weights_dtype(name: str) -> torch.dtype:
    """The load dtype; explicit, because transformers 5 loads a checkpoint's own dtype (bf16) by default."""
    if name not in ("float32", "bfloat16"):
        raise ValueError(f"model_dtype must be float32 or bfloat16, got {name!r}.")
    return getattr(torch, name)
