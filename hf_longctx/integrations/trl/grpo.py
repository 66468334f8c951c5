"""TRL `GRPOTrainer` under hf_longctx SP: generation on the plain model, log-probs and loss sharded, and
every batch size, rank and gather seen as by the run without SP on the data-parallel ranks.

TRL refuses SP in `GRPOConfig.__post_init__`; `grpo_config` builds one config with that check not seeing SP
(nothing is patched). `install_grpo_sp(trainer, state)` patches one trainer instance, reversibly. The machinery
is shared with `RLOOTrainer` (`online.py`, which says what each part does).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hf_longctx.integrations.trainer.state import SequenceParallelState
from hf_longctx.integrations.trl.online import (
    GRPO,
    check_online_settings,
    data_parallel_sizes,
    install_online_sp,
    online_config,
)
from hf_longctx.integrations.trl.online import check_generation_sizes as _check_generation_sizes

__all__ = ["check_generation_sizes", "check_grpo_settings", "data_parallel_sizes", "grpo_config", "install_grpo_sp"]


def grpo_config(**kwargs: Any) -> Any:
    """`trl.GRPOConfig(**kwargs)` accepting an hf_longctx `parallelism_config` with `sp_size > 1`, its generation
    sizes counted in data-parallel ranks (`online.online_config`).

    Raises:
        ValueError: the config asks for accelerate's upstream backend (`sp_backend="deepspeed"`), or its
            generation sizes do not fit the data-parallel ranks.
    """
    return online_config(GRPO, **kwargs)


def check_generation_sizes(args: Any, dp: int) -> None:
    """`online.check_generation_sizes` naming `grpo_config`.

    Raises:
        ValueError: the sizes do not describe a run on `dp` data-parallel ranks.
    """
    _check_generation_sizes(args, dp, GRPO.builder)


def check_grpo_settings(trainer: Any, dp: int) -> None:
    """Refuse, by name, the GRPO options SP cannot keep exact (`online.check_online_settings`).

    Raises:
        ValueError: naming the option to change.
    """
    check_online_settings(trainer, dp, GRPO)


def install_grpo_sp(trainer: Any, state: SequenceParallelState) -> Callable[[], None]:
    """Patch one `GRPOTrainer` instance for SP (idempotent); returns the undo.

    Raises:
        ValueError: a GRPO option SP cannot keep exact (see `check_grpo_settings`).
    """
    return install_online_sp(trainer, state, GRPO)
