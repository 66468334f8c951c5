"""DistillationTrainer's loss under SP: both models' forwards sharded over the SP group, the divergence per shard.

TRL 1.16's `DistillationTrainer._compute_loss` runs the student's and the teacher's backbone on prompt +
completion and sums, over the completion positions its loss mask keeps, a per-token divergence between the two
next-token distributions (`distillation_divergence.py`), divided by the global count of those tokens. Each term
depends on one position only, so under SP every rank runs both forwards on its shard of the rows (the teacher with
hf_longctx SP attention on the same group, `SequenceParallelState.enable`), scores the positions it holds and
returns `shard sum / (global count / world)` as TRL's code returns `rank sum / (global count / world)`: the engine's
gradient average over all ranks, and the mean of the logged loss over all ranks, are the run without SP's. No row is
gathered and neither model's logits exist for a whole row on any rank. The projection runs through TRL's chunked
kernel on the shard, or through hf_longctx's tiles when the `tiled_loss` flag is on.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from hf_longctx.data.consistency import shard_batch
from hf_longctx.data.sharding import IGNORE_INDEX
from hf_longctx.distributed.comm import all_reduce_sum
from hf_longctx.integrations.trainer.state import SequenceParallelState, _unwrap
from hf_longctx.integrations.trl.distillation_divergence import linear_divergence_sum
from hf_longctx.memory.lm_head import LogitTransform, attach, gathered
from hf_longctx.memory.tiled_loss import _full

# `_compute_loss` inputs of vision-language models (TRL 1.16 `DistillationTrainer._compute_loss`): not sharded here.
MULTIMODAL_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "pixel_attention_mask",
    "spatial_shapes",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


def logit_transform(config: Any, temperature: float = 1.0) -> LogitTransform:
    """The logit scale and soft-cap TRL 1.16's `DistillationTrainer` applies for a model config, with the
    temperature: `logit_scale`, else `output_multiplier`, else `lm_head_multiplier`, else `logits_scaling`
    (multiplied for HyperCLOVA X, divided otherwise); `final_logit_softcapping`."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    scale = getattr(text, "logit_scale", None)
    for name in ("output_multiplier", "lm_head_multiplier"):
        scale = getattr(text, name, None) if scale is None else scale
    scaling = getattr(text, "logits_scaling", None)
    if scale is None and scaling is not None:
        scale = scaling if getattr(text, "model_type", None) == "hyperclovax" else 1 / scaling
    return LogitTransform(
        scale=1.0 if scale is None else float(scale),
        softcap=getattr(text, "final_logit_softcapping", None),
        temperature=float(temperature),
    )


def shard_rows(state: SequenceParallelState, inputs: dict[str, Any], pad_token_id: int) -> dict[str, Any]:
    """This rank's shard of the rows `[prompt | completion]`, with `shift_labels` marking the scored positions.

    TRL scores position t (which predicts token t+1) for every completion token its loss mask keeps
    (`completion_mask`, times `tool_mask` in multi-turn runs). Its rows are left-padded prompts followed by
    right-padded completions; SP attention needs right padding, so each row is rotated to start at its first real
    token, keeping the positions TRL's forward uses (the padded index), as `grpo_logps` does.
    """
    prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1).long()
    loss_mask = inputs["completion_mask"]
    if inputs.get("tool_mask") is not None:
        loss_mask = loss_mask * inputs["tool_mask"]
    bs, sl = input_ids.shape
    keep = completion_ids.shape[1]
    targets = torch.full_like(input_ids, IGNORE_INDEX)
    targets[:, sl - 1 - keep : sl - 1] = completion_ids.masked_fill(loss_mask == 0, IGNORE_INDEX)
    left = (mask.cumsum(1) == 0).sum(1, keepdim=True)
    steps = torch.arange(sl, device=input_ids.device).expand(bs, sl)
    rotate = (steps + left) % sl
    batch = {
        "input_ids": input_ids.gather(1, rotate),
        "attention_mask": mask.gather(1, rotate),
        "position_ids": steps + left,
        "shift_labels": targets.gather(1, rotate),
    }
    return shard_batch(batch, state.groups, pad_token_id=pad_token_id)


def _backbone(model: Any) -> torch.nn.Module:
    """The module whose output is the final hidden state, as TRL 1.16 picks it (`base_model` of the causal LM)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.base_model


def _takes_logits_to_keep(model: Any) -> bool:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "logits_to_keep" in inspect.signature(base.forward).parameters


@contextmanager
def _capture(module: torch.nn.Module, into: dict[str, torch.Tensor]) -> Iterator[None]:
    def hook(_module: torch.nn.Module, _args: tuple, output: Any) -> None:
        into.setdefault("hidden", output[0] if isinstance(output, (tuple, dict)) else output)

    handle = module.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def final_hidden(wrapper: Any, model: Any, shard: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """`(hidden [bs, shard, hidden], logits)` of one sharded forward of the causal LM `model` (PEFT or not).

    The model is called through its engine's `wrapper` (DDP, DeepSpeed, or itself) on the shard: the engine
    prepares its weights and gradients as for any forward, and the model's SP pre-hook sets up attention over the
    group. Its head projects one position (`logits_to_keep=1`, where the forward takes it); the final hidden
    states are taken from its backbone's output.
    """
    into: dict[str, torch.Tensor] = {}
    kwargs = {k: v for k, v in shard.items() if k != "shift_labels"}
    if _takes_logits_to_keep(model):
        kwargs["logits_to_keep"] = 1
    with _capture(_backbone(model), into):
        out = wrapper(**kwargs, use_cache=False)
    return into["hidden"], out.logits


def _divergence(trainer: Any, state: SequenceParallelState, student: Any, teacher: Any, hs, ht) -> tuple:
    """Summed divergence and entropy of the scored rows `hs`, `ht`: hf_longctx's tiles with `tiled_loss`, else
    TRL's chunked kernel (`ChunkedDivergenceFunction`, as TRL runs it without SP)."""
    head_s, head_t = student.get_output_embeddings(), teacher.get_output_embeddings()
    t_s = logit_transform(student.config, trainer.temperature)
    t_t = logit_transform(teacher.config, trainer.temperature)
    w_s, b_s, w_t, b_t = (_full(p) for p in (head_s.weight, head_s.bias, head_t.weight, head_t.bias))
    vocab_s, vocab_t = (int(getattr(w, "ds_shape", w.shape)[0]) for w in (w_s, w_t))  # ZeRO-3: partitioned
    if vocab_s != vocab_t:
        raise ValueError(
            f"DistillationTrainer: the student's vocabulary ({vocab_s}) and the teacher's ({vocab_t}) "
            "differ; the divergence compares full next-token distributions, so use a teacher with the student's "
            "vocabulary (or TRL's GOLDTrainer for cross-tokenizer distillation, without SP)."
        )
    if getattr(state.config, "tiled_loss", False):
        with gathered(w_s, b_s, w_t, b_t):
            return linear_divergence_sum(hs, w_s, b_s, ht.to(hs.device), w_t, b_t, trainer.beta, t_s, t_t)
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    # TRL's kernel gathers ZeRO-3 heads itself (forward and its recomputing backward).
    divergence, entropy = ChunkedDivergenceFunction.apply(
        hs, w_s, b_s, ht.to(hs.device), w_t, b_t, trainer.beta, t_s.temperature,
        t_s.scale, t_s.softcap, t_t.scale, t_t.softcap,
    )  # fmt: skip
    return divergence.sum(), entropy.sum()


def sharded_loss(
    trainer: Any, state: SequenceParallelState, model: Any, inputs: dict[str, Any], num_items_in_batch: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TRL's `_compute_loss` on this rank's shard: `(loss, entropy sum, scored tokens)`, the last two this shard's
    partial sums (`gather_for_metrics` adds them over the SP group).

    Args:
        trainer: the `DistillationTrainer` (its teacher, beta, temperature, tokenizer).
        state: the SP state.
        model: the student as `compute_loss` receives it (wrapped by its engine, or not).
        inputs: one micro-batch of TRL's `_prepare_inputs` (whole rows, the same on every SP rank).
        num_items_in_batch: TRL's global scored-token count / world size, or None.

    Returns:
        The loss is `shard sum / num_items_in_batch`. Without a count it is the token mean over the SP group's
        rows (TRL's mean over the rank's rows): with gradients (training) as this rank's share,
        `sp_size x shard sum / group count`, which the engine's average over all ranks turns into the average over
        DP ranks; without (evaluation) whole on every SP rank, as hf_longctx's evaluation takes it.

    Raises:
        ValueError: vision inputs, no local teacher model, or a teacher with another vocabulary.
    """
    given = [k for k in MULTIMODAL_KEYS if inputs.get(k) is not None]
    if given:
        raise ValueError(
            f"DistillationTrainer under SP shards text-only forwards; got vision inputs {given}: train this model "
            "with sp_size=1."
        )
    student = _unwrap(trainer.accelerator.unwrap_model(model))
    teacher_wrapper = trainer.teacher_model
    if teacher_wrapper is None:
        raise ValueError(
            f"{type(trainer).__name__} under SP runs a local teacher model on the SP group's shards; this trainer has "
            "none (a teacher supplied another way, e.g. a server, is not sharded): pass teacher_model."
        )
    teacher = _unwrap(trainer.accelerator.unwrap_model(teacher_wrapper))
    state.enable(teacher)  # a teacher TRL prepared itself (DeepSpeed) gets SP attention here, once
    shard = shard_rows(state, inputs, trainer._tokenizer.pad_token_id)
    teacher_wrapper.eval()
    with torch.no_grad():
        hidden_t, _ = final_hidden(teacher_wrapper, teacher, shard)
    hidden_s, logits = final_hidden(model, student, shard)
    scored = shard["shift_labels"].reshape(-1) != IGNORE_INDEX
    hs = hidden_s.reshape(-1, hidden_s.shape[-1])[scored]
    ht = hidden_t.reshape(-1, hidden_t.shape[-1])[scored]
    base = student.get_base_model() if hasattr(student, "get_base_model") else student
    divergence, entropy = _divergence(trainer, state, base, teacher, hs, ht)
    # Anchored to the head's output so ZeRO-3 gathers the student's head for backward (`memory.lm_head.attach`).
    divergence = attach(divergence, logits)
    count = scored.sum()
    if num_items_in_batch is not None:
        loss = divergence / torch.as_tensor(num_items_in_batch, device=divergence.device)
    else:
        groups = state.groups
        total = all_reduce_sum(count, groups.sp_group).clamp(min=1).to(divergence.device)
        if torch.is_grad_enabled():
            loss = divergence * groups.sp_world_size / total
        else:
            loss = all_reduce_sum(divergence, groups.sp_group) / total
    return loss, entropy.detach(), count


def make_compute_loss(trainer: Any, state: SequenceParallelState) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The `Patch` factory for `DistillationTrainer.compute_loss`: TRL 1.16's, with `sharded_loss` in place of
    `_compute_loss` and both models called through their engines' wrappers on the shard (TRL redirects its
    backbone-only call through the student's wrapper instead, which under SP would run the SP pre-hook on
    redirected arguments)."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None):
            # As TRL: in training the count of the generated completions' scored tokens, over all ranks, / world
            # (TRL computes it in the data-parallel view: each DP rank's rows once).
            if trainer.model.training and inputs.get("num_items_in_batch") is not None:
                num_items_in_batch = inputs["num_items_in_batch"].clamp(min=1.0) / trainer.accelerator.num_processes
            loss, entropy, count = sharded_loss(trainer, state, model, inputs, num_items_in_batch)
            mode = "train" if trainer.model.training else "eval"
            count = trainer.accelerator.gather_for_metrics(count).sum()
            entropy = trainer.accelerator.gather_for_metrics(entropy).sum()
            trainer._metrics[mode]["entropy"].append((entropy / count).item() if count > 0 else 0.0)
            return (loss, None) if return_outputs else loss

        return compute_loss

    return make
