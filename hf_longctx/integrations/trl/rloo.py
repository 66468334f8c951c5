"""TRL `RLOOTrainer` under hf_longctx SP, on the machinery GRPO uses (`online.py`).

RLOO (TRL 1.16 `rloo_trainer.py`) generates like GRPO and scores each completion against the leave-one-out mean
reward of its prompt's other completions; with `beta > 0` the summed first-order KL to the reference (a reference
model, or the policy with its LoRA adapter disabled) is subtracted from the reward first. Its loss is per
sequence: the clipped ratio of summed completion log-probs times the advantage. Everything it computes from
log-probs reads TRL's `_get_per_token_logps_and_entropies`, which runs sharded and gathers the per-token values
back, and every group statistic reads the data-parallel gathers, so TRL's code runs unchanged.

TRL refuses SP in `RLOOConfig.__post_init__`; `rloo_config` builds one config with that check not seeing SP
(nothing is patched). `install_rloo_sp(trainer, state)` patches one trainer instance, reversibly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hf_longctx.integrations.trainer.state import SequenceParallelState
from hf_longctx.integrations.trl.online import RLOO, check_online_settings, install_online_sp, online_config


def rloo_config(**kwargs: Any) -> Any:
    """`trl.RLOOConfig(**kwargs)` accepting an hf_longctx `parallelism_config` with `sp_size > 1`, its generation
    sizes counted in data-parallel ranks (`online.online_config`).

    Raises:
        ValueError: the config asks for accelerate's upstream backend (`sp_backend="deepspeed"`), or its
            generation sizes do not fit the data-parallel ranks.
    """
    return online_config(RLOO, **kwargs)


def check_rloo_settings(trainer: Any, dp: int) -> None:
    """Refuse, by name, the RLOO options SP cannot keep exact (`online.check_online_settings`).

    Raises:
        ValueError: naming the option to change.
    """
    check_online_settings(trainer, dp, RLOO)


def install_rloo_sp(trainer: Any, state: SequenceParallelState) -> Callable[[], None]:
    """Patch one `RLOOTrainer` instance for SP (idempotent); returns the undo.

    Raises:
        ValueError: an RLOO option SP cannot keep exact (see `check_rloo_settings`).
    """
    return install_online_sp(trainer, state, RLOO)
