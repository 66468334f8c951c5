"""SP cannot be silently off: the first-step checks and the one line that says what runs.

`verify_first_step` is the main entry, called once per attached accelerator from the `training_step` patch
(`patches.py`), before the first forward: every rank checks that the model it trains carries hf_longctx's SP
attention, that its SP group has the configured size and that its batch is its 1/P share of each sequence. One
all-gather over the job turns any rank's failure into the same `ValueError` on every rank (no rank enters an
attention collective alone), then rank 0 logs one line: ranks and nodes, DP x SP, engine, backend, attention
kernel, tokens per rank and memory flags, and a warning when an all-to-all spans hosts (each rank's host rides in
the same all-gather). `check_config_applied` refuses, when the Trainer is built, arguments that ask for SP while
the Trainer's accelerator carries none.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist

from hf_longctx.attention.backends import SPBackend
from hf_longctx.attention.registry import SequenceParallelHandle
from hf_longctx.data.consistency import SIGNATURE_KEY
from hf_longctx.data.layout import pad_multiple
from hf_longctx.distributed.comm import all_gather_stacked
from hf_longctx.distributed.groups import all_to_all_across_hosts, host_id
from hf_longctx.integrations.trainer.state import SequenceParallelState, sp_state
from hf_longctx.memory.flags import MemoryHandle

logger = logging.getLogger(__name__)

OK, NO_SP_ATTENTION, GROUP_SIZE, NOT_SHARDED, WRONG_SHARE = range(5)
_WHY = {
    NO_SP_ATTENTION: "the model this Trainer trains ({model}) carries no hf_longctx SP attention, so every rank would "
    "attend over its own shard only. Only models passed through the Trainer's accelerator (`accelerator.prepare`) "
    "are switched, and only a transformers model (with a `.config`) can be: give the Trainer the transformers model "
    "itself, not a wrapper around it",
    GROUP_SIZE: "the SP group has {seen} ranks where sp_size={sp_size} was configured; build the groups with "
    "SequenceParallelGroups.build(sp_size) on every rank",
    NOT_SHARDED: "the training batch was not sharded by hf_longctx (its DataLoader was not prepared by the "
    "Trainer's accelerator); build the train DataLoader in `get_train_dataloader` through `accelerator.prepare`",
    WRONG_SHARE: "a rank holds {local} of the {full} tokens of each row, not its 1/{sp_size} share ({want}); the "
    "batch was sharded for another SP size or layout",
}


def check_config_applied(trainer: Any) -> None:
    """Refuse a Trainer whose arguments ask for hf_longctx SP while its accelerator carries none.

    accelerate keeps one shared state per process: with `accelerator_config={"use_configured_state": True}`
    and an `Accelerator` created before, the Trainer's accelerator keeps that earlier configuration and never
    sees `parallelism_config`, so the job would train without SP (measured: plain DDP, no error).

    Raises:
        ValueError: `args.parallelism_config` asks for SP (`sp_size > 1`, an hf_longctx backend) but the
            accelerator took no (or another) SP configuration.
    """
    asked = getattr(trainer.args, "parallelism_config", None)
    if getattr(asked, "sp_size", 1) <= 1 or getattr(asked, "sp_upstream", True):
        return
    state = sp_state(trainer)
    taken = state.config.sp_size if state is not None else 1
    if taken != asked.sp_size:
        raise ValueError(
            f"parallelism_config asks for sequence parallelism (sp_size={asked.sp_size}) but the Trainer's "
            f"accelerator runs sp_size={taken}: accelerate kept the configuration of an Accelerator created "
            "earlier in this process (accelerator_config={'use_configured_state': True}). Create that first "
            "Accelerator with the same parallelism_config, or drop use_configured_state."
        )


def verify_first_step(trainer: Any, state: SequenceParallelState, model: torch.nn.Module, inputs: dict) -> None:
    """Check on every rank that SP runs as configured, before the first forward; rank 0 logs what runs.

    Args:
        trainer: the Trainer (its accelerator is attached to `state`).
        state: what `attach` installed.
        model: the model `training_step` received (wrapped by DDP / DeepSpeed / FSDP, or not).
        inputs: the first training batch of this rank.

    Raises:
        ValueError: on every rank when any rank fails a check, naming the ranks, what failed and the fix.
    """
    groups, sp_size = state.groups, state.config.sp_size
    trained = trainer.accelerator.unwrap_model(model)
    handle = _handle_of(state, trained)
    seen = dist.get_world_size(groups.sp_group) if groups.sp_group is not None else 1
    local = full = want = rows = 0
    if handle is None:
        code = NO_SP_ATTENTION
    elif seen != sp_size or groups.sp_world_size != sp_size:
        code = GROUP_SIZE
    elif state.replicated_outputs:
        code = OK  # a TRL trainer's SP path: whole rows here, sharded inside the model call (and checked there)
    else:
        code, local, full, want, rows = _share(inputs, sp_size, handle.backend.layout)
    mine = torch.tensor([code, seen, local, full, want, host_id()], dtype=torch.int64)
    everyone = all_gather_stacked(mine, dist.group.WORLD).tolist()
    failed = [rank for rank, row in enumerate(everyone) if row[0] != OK]
    if failed:
        code, seen, local, full, want, _ = everyone[failed[0]]
        why = _WHY[code].format(
            model=type(trained).__name__, seen=seen, sp_size=sp_size, local=local, full=full, want=want
        )
        raise ValueError(f"Sequence parallelism (sp_size={sp_size}) does not run on ranks {failed}: {why}.")
    if dist.get_rank() == 0:
        # WARNING: the level Python and transformers show by default; this line is how a user sees SP is on.
        logger.warning("hf_longctx: %s", describe(trainer, state, handle, local, full, rows))
        hosts = [row[5] for row in everyone]
        spanning = all_to_all_across_hosts(hosts, sp_size, handle.backend.ulysses_degree)
        if spanning:
            logger.warning("hf_longctx: %s", _across_hosts(spanning, hosts, handle.backend, groups.ranks_per_node))


def _across_hosts(spanning: list[list[int]], hosts: list[int], backend: SPBackend, ranks_per_node: int | None) -> str:
    """Why an all-to-all across hosts is slow and the backend that keeps it inside one (the ring crosses them)."""
    per_host = min(Counter(hosts).values())
    if backend.name == "ulysses":
        part = "the Ulysses SP group"
    else:
        part = f"the {backend.name} backend's Ulysses group (ulysses_degree={backend.ulysses_degree})"
    first = spanning[0]
    unknown = "" if ranks_per_node else " (auto needs LOCAL_WORLD_SIZE, which torchrun sets, to see the nodes)"
    return (
        f"the all-to-all of {part} spans hosts: ranks {first[0]}-{first[-1]} on "
        f"{len({hosts[r] for r in first})} hosts ({len(spanning)} such group{'s' if len(spanning) > 1 else ''}), so "
        "every attention layer's all-to-all crosses the network between nodes, much slower than inside one. Keep "
        'it inside a host: sp_backend="auto" (Ulysses inside a node, ring across nodes), or sp_backend="hybrid" '
        f"with a ulysses_degree that divides {per_host} (ranks per host){unknown}."
    )


def _handle_of(state: SequenceParallelState, model: torch.nn.Module) -> SequenceParallelHandle | None:
    """The active SP handle on `model` or on one of its submodules (a PEFT model's base model), or None."""
    modules = {id(m) for m in model.modules()} if isinstance(model, torch.nn.Module) else {id(model)}
    for handle in state.handles:
        if isinstance(handle, SequenceParallelHandle) and handle.active and id(handle.model) in modules:
            return handle
    return None


def _share(inputs: dict, sp_size: int, layout: str) -> tuple[int, int, int, int, int]:
    """(code, local row length, full row length, expected local length, rows) of this rank's batch."""
    signature = inputs.get(SIGNATURE_KEY)
    tokens = next((inputs[k] for k in ("input_ids", "inputs_embeds") if isinstance(inputs.get(k), torch.Tensor)), None)
    if signature is None or tokens is None:
        return NOT_SHARDED, 0, 0, 0, 0
    full, rows, local = int(signature[2]), int(tokens.shape[0]), int(tokens.shape[1])  # [bs, sl_l(, hs)]
    multiple = pad_multiple(layout, sp_size)
    want = math.ceil(full / multiple) * multiple // sp_size
    return (OK if local == want else WRONG_SHARE), local, full, want, rows


def describe(
    trainer: Any, state: SequenceParallelState, handle: SequenceParallelHandle, local: int, full: int, rows: int
) -> str:
    """The one line: ranks and nodes, DP x SP, engine, backend, kernel, tokens per rank, memory flags."""
    groups, backend = state.groups, handle.backend
    world = groups.dp_world_size * groups.sp_world_size
    per_node = groups.ranks_per_node
    nodes = ""
    if per_node and world % per_node == 0:
        nodes = f" ({world // per_node} node{'s' if world > per_node else ''} x {per_node})"
    layout = f"Ulysses {backend.ulysses_degree} x ring {backend.ring_size}, {backend.layout} layout"
    if state.replicated_outputs:
        tokens = "rows sharded inside the trainer's SP path"
    else:
        tokens = f"{local} of {full} tokens per rank (first batch: {rows} rows)"
    flags = [name for h in state.handles if isinstance(h, MemoryHandle) for name in h.parts]
    return (
        f"sequence parallelism on {world} ranks{nodes}: DP {groups.dp_world_size} x SP {groups.sp_world_size}, "
        f"engine {_engine(trainer.accelerator)}, backend {backend.name} ({layout}), attention kernel "
        f"{handle.kernel_name}, {tokens}, memory flags: {', '.join(flags) or 'none'}"
    )


def _engine(accelerator: Any) -> str:
    """The data-parallel engine as a user names it, found by its plugin as the Trainer does (`is_fsdp_enabled`):
    accelerate's `distributed_type` reverts to its process-level value whenever `AcceleratorState()` is built."""
    state = accelerator.state
    deepspeed = getattr(state, "deepspeed_plugin", None)
    if deepspeed is not None:
        return f"DeepSpeed ZeRO-{deepspeed.zero_stage}"
    fsdp = getattr(state, "fsdp_plugin", None)
    if fsdp is not None:
        return "FSDP2" if getattr(fsdp, "fsdp_version", 1) == 2 else "FSDP"
    return "DDP"
