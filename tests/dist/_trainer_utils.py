"""Shared pieces of the `Trainer` SP tests: tiny datasets, a recording collator, `run_trainer` and the worker
that `run_distributed` spawns. The `SFTTrainer` side is `_sft_utils.py`; the refused configurations
`_trainer_errors.py`.

One spawn runs several named configurations in a row (spawning and importing transformers costs far more
than a few steps of a tiny model) and returns, per configuration, the logged metrics plus what only the rank
can see: row ids it collated, local sequence lengths and valid labels per forward, the attention backend.
`compare_logs` is the one tolerance check the tests use.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from typing import Any

import torch

import hf_longctx
from tests._dist import run_distributed
from tests._models import tiny_model

IGNORE = -100
VOCAB = 128
BATCH = 2
LR = {"sgd": 0.1, "adamw_torch": 1e-2}

# ---- data ----------------------------------------------------------------------------------------


def make_rows(kind: str, n: int, seed: int = 3) -> list[dict[str, Any]]:
    """`n` rows `{"input_ids", "labels", "row"}` of random tokens in [1, VOCAB) and varying lengths.

    kind:
        "mixed": lengths 20..40, every third row completion-only (labels on its last 3 tokens).
        "tail2": lengths 24..33, labels on the last 2 tokens only: in any right-padded batch every valid
            shift label lies past the middle, so SP rank 0's shard never holds one.
        "eval": lengths 9..31 cycling through full labels, the last 2 tokens only (rank 1 gets them) and the
            first 3 tokens only (rank 0 gets them): valid-token counts differ per shard and per batch.
    """
    lo, hi = {"mixed": (20, 40), "tail2": (24, 33), "eval": (9, 31)}[kind]
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        length = int(torch.randint(lo, hi + 1, (1,), generator=gen))
        ids = torch.randint(1, VOCAB, (length,), generator=gen).tolist()
        labels = list(ids)
        if (kind == "mixed" and i % 3 == 0) or (kind == "eval" and i % 3 == 1):
            keep = 3 if kind == "mixed" else 2
            labels[: length - keep] = [IGNORE] * (length - keep)
        elif kind == "tail2":
            labels[: length - 2] = [IGNORE] * (length - 2)
        elif kind == "eval" and i % 3 == 2:
            labels[3:] = [IGNORE] * (length - 3)
        rows.append({"input_ids": ids, "labels": labels, "row": i})
    return rows


def dataset(kind: str, n: int):
    import datasets

    return datasets.Dataset.from_list(make_rows(kind, n))


class RecordingCollator:
    """Right-pads `input_ids`/`labels`/`attention_mask`, drops the `row` id column and records it.

    hf_longctx wraps this collator (it shards after collation), so `rows` and `lengths` describe the full,
    unsharded batches this rank collated, in order.
    """

    def __init__(self) -> None:
        self.rows: list[list[int]] = []
        self.lengths: list[int] = []

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        length = max(len(f["input_ids"]) for f in features)
        ids = torch.zeros(len(features), length, dtype=torch.long)
        labels = torch.full_like(ids, IGNORE)
        mask = torch.zeros_like(ids)
        for i, f in enumerate(features):
            n = len(f["input_ids"])
            ids[i, :n] = torch.tensor(f["input_ids"])
            labels[i, :n] = torch.tensor(f["labels"])
            mask[i, :n] = 1
        self.rows.append([int(f["row"]) for f in features])
        self.lengths.append(length)
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}

    def take(self) -> dict[str, list]:
        """Return and clear what was recorded."""
        out = {"rows": self.rows, "lengths": self.lengths}
        self.rows, self.lengths = [], []
        return out


class ForwardRecorder:
    """Forward pre-hook: the sequence length and the valid-label count of every batch the model sees."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.seq_lens: list[int] = []
        self.valid_labels: list[int | None] = []
        model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        self.seq_lens.append(int(ids.shape[1]))
        labels = kwargs.get("labels")
        self.valid_labels.append(None if labels is None else int((labels != IGNORE).sum()))

    def take(self) -> dict[str, list]:
        out = {"seq_lens": self.seq_lens, "valid_labels": self.valid_labels}
        self.seq_lens, self.valid_labels = [], []
        return out


# ---- Trainer runs --------------------------------------------------------------------------------


def parallelism_config(sp: int, options: dict | None = None, flags: dict[str, Any] | None = None):
    fields = {**(options or {}), **(flags or {})}
    return hf_longctx.ParallelismConfig(sp_size=sp, **fields) if sp > 1 or flags else None


def logged_steps(trainer: Any, keys: tuple[str, ...]) -> list[dict[str, float]]:
    """One dict per logged training step: `step` plus whichever of `keys` were logged."""
    return [{"step": h["step"], **{k: h[k] for k in keys if k in h}} for h in trainer.state.log_history if "loss" in h]


def run_trainer(
    out_dir: str,
    *,
    sp: int = 1,
    optim: str = "sgd",
    steps: int = 5,
    epochs: float | None = None,
    ga: int = 1,
    data: tuple[str, int] = ("mixed", 24),
    scheduler: str = "constant",
    eval_data: tuple[tuple[str, int], ...] = (),
    save_steps: int | None = None,
    resume_from: str | None = None,
    label_smoothing: float = 0.0,
    subclass: bool = False,
    loss_func: bool = False,
    predict: tuple[str, int] | None = None,
    raw_logits: bool = False,
    fsdp2: bool = False,
    gradient_checkpointing: bool = False,
    sp_options: dict | None = None,
    flags: dict[str, Any] | None = None,
    model_kind: str = "llama",
    zero: int | None = None,
    sampling: str = "random",
) -> dict[str, Any]:
    """Train the tiny llama with the stock `transformers.Trainer` in this process (one rank).

    SGD runs without clipping (max_grad_norm=0: grad_norm is still logged), AdamW clips at 1.0.
    `epochs` set means an epoch-based run (max_steps unset). `resume_from` is a checkpoint directory.
    `subclass` uses a Trainer subclass whose `prediction_step` post-processes `super()`'s result;
    `loss_func` passes a `compute_loss_func` (the SP run's takes the pre-shifted labels, marked);
    `predict` runs `trainer.predict` on that eval set with per-sample metric outputs (`raw_logits`: the
    whole logits instead). `fsdp2` goes through accelerate's own FSDP2 route (`fully_shard` per decoder
    layer), which accelerate enables only on GPUs; `accelerate_fsdp_on_cpu` lifts that for the test.
    `sp_options`: more `ParallelismConfig` fields (sp_backend, ulysses_degree, ring_variant, ...);
    `flags`: hf_longctx memory flags (`tiled_loss`, ...), applied at SP=1 too. `model_kind`: another tiny model
    (`tests._sequence_models.sequence_model`, e.g. "moe:qwen3_moe"); `zero`: a DeepSpeed ZeRO stage;
    `sampling`: the Trainer's `train_sampling_strategy`. The result's `sp_lines` are the lines hf_longctx logged
    at the first step (what runs).
    """
    from transformers import Trainer, TrainingArguments

    lines = LogLines("hf_longctx.integrations.trainer.first_step")
    model = build_model(model_kind)
    forwards = ForwardRecorder(model)
    collator = RecordingCollator()
    args = TrainingArguments(
        output_dir=out_dir,
        **engine_args(zero),
        report_to=[],
        disable_tqdm=True,
        seed=1,
        per_device_train_batch_size=BATCH,
        per_device_eval_batch_size=BATCH,
        gradient_accumulation_steps=ga,
        max_steps=-1 if epochs is not None else steps,
        num_train_epochs=epochs if epochs is not None else 1.0,
        optim=optim,
        learning_rate=LR[optim],
        max_grad_norm=0.0 if optim == "sgd" else 1.0,
        lr_scheduler_type=scheduler,
        logging_steps=1,
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        remove_unused_columns=False,
        label_smoothing_factor=label_smoothing,
        train_sampling_strategy=sampling,
        gradient_checkpointing=gradient_checkpointing,
        parallelism_config=parallelism_config(sp, sp_options, flags),
        **(FSDP2_ARGS if fsdp2 else {}),
    )
    trainer_cls = subclass_trainer() if subclass else Trainer
    with accelerate_fsdp_on_cpu() if fsdp2 else contextlib.nullcontext():
        trainer = trainer_cls(
            model=model,
            args=args,
            train_dataset=dataset(*data),
            data_collator=collator,
            compute_loss_func=(shifted_loss if sp > 1 else unshifted_loss) if loss_func else None,
            preprocess_logits_for_metrics=None if raw_logits else per_sample_outputs,
        )
    trainer.train(resume_from_checkpoint=resume_from)
    result = {
        "wrapped": type(trainer.model_wrapped).__name__,
        "logs": logged_steps(trainer, ("loss", "grad_norm", "learning_rate", "epoch")),
        "global_step": trainer.state.global_step,
        "epoch": trainer.state.epoch,
        "max_steps": trainer.state.max_steps,
        "attn": model.config._attn_implementation,
        "sp_lines": lines.take(),
        **collator.take(),
        **forwards.take(),
    }
    # Keyed by the eval set's size: an odd size leaves a partial last batch.
    result["eval_loss"] = {n: trainer.evaluate(dataset(kind, n))["eval_loss"] for kind, n in eval_data}
    if predict is not None:
        out = trainer.predict(dataset(*predict))
        result["predict"] = {"loss": out.metrics["test_loss"], "label_ids": out.label_ids.tolist()}
        if raw_logits:
            result["predict"]["predictions"] = out.predictions
        else:
            result["predict"]["first_tokens"] = out.predictions[0].tolist()
            result["predict"]["mean_logit"] = out.predictions[1].tolist()
    result["memory"] = memory_flags_active(model) if model_kind == "llama" else {}
    # detach() gives the model back for single-process use: its own attention, no pre-hook.
    hf_longctx.integrations.trainer.detach(trainer)
    result["attn_after_detach"] = model.config._attn_implementation
    result["hooks_after_detach"] = sum(
        type(getattr(hook, "__self__", None)).__name__ == "SequenceParallelHandle"
        for hook in model._forward_pre_hooks.values()
    )
    result["accelerator_clean"] = not any(
        k in vars(trainer.accelerator) for k in ("prepare", "prepare_data_loader", "gather_for_metrics")
    )
    return result


class LogLines(logging.Handler):
    """Collects the messages of one logger (from its WARNING records up) until `take()`."""

    def __init__(self, name: str) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        self.logger = logging.getLogger(name)
        self.logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def take(self) -> list[str]:
        """The messages so far; detaches the handler."""
        self.logger.removeHandler(self)
        return self.messages


class Wrapper(torch.nn.Module):
    """A user's module around a transformers model (no `.config`): the Trainer trains it as it is."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, **kwargs: Any) -> Any:
        return self.inner(**kwargs)


def build_model(kind: str) -> torch.nn.Module:
    if kind == "llama":
        return tiny_model("llama")
    from tests._sequence_models import sequence_model

    return sequence_model(kind)


def engine_args(zero: int | None) -> dict[str, Any]:
    from tests.dist._trl_jobs import _zero3_args

    return _zero3_args(zero)


FSDP2_ARGS = {
    "fsdp": "full_shard",
    "fsdp_config": {
        "version": 2,
        "reshard_after_forward": True,
        "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
    },
}


@contextlib.contextmanager
def accelerate_fsdp_on_cpu():
    """Let accelerate take its FSDP route on CPU processes (it does so only for GPU-like distributed types):
    an `AcceleratorState` built with an FSDP plugin on MULTI_CPU is switched to FSDP, as on GPUs."""
    from accelerate import state
    from accelerate.utils import DistributedType

    original = state.AcceleratorState.__init__

    def init(self, *args, fsdp_plugin=None, **kwargs):
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type, self.fsdp_plugin = DistributedType.FSDP, fsdp_plugin

    state.AcceleratorState.__init__ = init
    try:
        yield
    finally:
        state.AcceleratorState.__init__ = original


def subclass_trainer() -> type:
    """A Trainer subclass whose `prediction_step` calls super() and post-processes its result."""
    from transformers import Trainer

    class SubTrainer(Trainer):
        # A user's override calling super(): hf_longctx must merge the SP group once, not twice.
        def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
            loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
            return loss * 1.0, logits, labels

    return SubTrainer


def per_sample_outputs(logits, labels):
    """Per-sample metric outputs: argmax of the first 3 positions `[bs, 3]` and the mean logit `[bs]` over the
    positions that predict a label (padding positions carry no label; their logits are not compared)."""
    scored = (labels[:, 1:] != IGNORE).unsqueeze(-1).float()
    mean = (logits[:, :-1].float() * scored).sum(dim=(1, 2)) / (scored.sum(dim=(1, 2)) * logits.shape[-1]).clamp(min=1)
    return logits[:, :3].argmax(-1), mean


def unshifted_loss(outputs, labels, num_items_in_batch=None):
    """A user's loss over unshifted labels (what a run without SP passes), summed / num_items_in_batch."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss(outputs.logits, labels, VOCAB, num_items_in_batch=num_items_in_batch)


@hf_longctx.takes_shifted_labels
def shifted_loss(outputs, labels, num_items_in_batch=None):
    """The same loss for pre-shifted labels (what hf_longctx passes), marked for SP."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss(outputs.logits, None, VOCAB, num_items_in_batch=num_items_in_batch, shift_labels=labels)


def memory_flags_active(model: torch.nn.Module) -> dict[str, bool]:
    """Which memory flags are applied to the tiny llama: the tiled-loss hook on lm_head, a tiled MLP
    forward, checkpointing through the offloading checkpoint function."""
    layer = model.model.layers[0]
    func = getattr(layer, "_gradient_checkpointing_func", None)
    return {
        "tiled_loss": len(model.lm_head._forward_hooks) > 0,
        "tiled_mlp": "forward" in vars(layer.mlp),
        "offload_activations": getattr(getattr(func, "func", None), "__name__", "") == "offloaded_checkpoint",
    }


def trainer_worker(
    rank: int, world_size: int, out_dir: str, configs: dict[str, dict[str, Any]], errors: bool = False
) -> dict[str, Any]:
    """Run every named `run_trainer` configuration in order (each in `out_dir/name`); then, if `errors`,
    the misconfigurations. A config's `resume_from` names an earlier config's checkpoint subdirectory,
    e.g. "resume_full/checkpoint-3".
    """
    results: dict[str, Any] = {}
    for name, config in configs.items():
        config = dict(config)
        if config.get("resume_from"):
            config["resume_from"] = os.path.join(out_dir, config["resume_from"])
        results[name] = run_trainer(os.path.join(out_dir, name), **config)
    if errors:
        from tests.dist._trainer_errors import trainer_config_errors

        results["errors"] = trainer_config_errors(out_dir)
    return results


# ---- parent side ---------------------------------------------------------------------------------

_spawns: dict[Any, Any] = {}


def spawn_once(key: Any, fn: Any, world_size: int, *args: Any, timeout: float) -> list[Any]:
    """`run_distributed` at most once per session per key; a failure is cached and re-raised each time."""
    if key not in _spawns:
        try:
            _spawns[key] = run_distributed(fn, world_size, *args, timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - re-raised below for every dependent test
            _spawns[key] = exc
    result = _spawns[key]
    if isinstance(result, Exception):
        raise result
    return result


def rel_diff(value: float, ref: float) -> float:
    """|value - ref| / |ref| (absolute difference when ref is 0)."""
    return abs(value - ref) / abs(ref) if ref != 0 else abs(value)


def compare_logs(
    logs: list[dict[str, float]], ref: list[dict[str, float]], keys: tuple[str, ...], rtol: float
) -> dict[str, float]:
    """Assert per-step equality within `rtol` of `keys` (every key logged by both); return max rel diff per key."""
    assert [h["step"] for h in logs] == [h["step"] for h in ref], (logs, ref)
    worst: dict[str, float] = {}
    for got, want in zip(logs, ref, strict=True):
        for key in keys:
            assert (key in got) == (key in want), (key, got, want)
            if key not in want:
                continue
            assert math.isfinite(got[key]), (key, got)
            diff = rel_diff(got[key], want[key])
            assert diff <= rtol, f"step {want['step']} {key}: {got[key]!r} vs {want[key]!r} (rel {diff:.2e})"
            worst[key] = max(worst.get(key, 0.0), diff)
    return worst
