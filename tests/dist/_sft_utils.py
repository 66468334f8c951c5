"""The `SFTTrainer` side of the SP tests: a WordLevel tokenizer, token-id datasets, `run_sft` (one rank's
training run) and the worker `run_distributed` spawns; `assert_sft_runs_match` compares two runs."""

from __future__ import annotations

import os
from typing import Any

import torch

from tests.dist._trainer_utils import (
    BATCH,
    LR,
    VOCAB,
    ForwardRecorder,
    build_model,
    compare_logs,
    engine_args,
    logged_steps,
    memory_flags_active,
    parallelism_config,
    rel_diff,
)


def tiny_tokenizer():
    """WordLevel tokenizer over "t0".."t127" (pad t0, unk t1, eos t2): token id i is the word "t{i}"."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t1"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t2", unk_token="t1")


def sft_dataset(kind: str, n: int, seed: int = 5):
    """Token-id rows for SFTTrainer (already processed: TRL skips tokenization).

    kind:
        "plain": `input_ids` only, lengths 8..29.
        "completion": `input_ids` + `completion_mask` (1 on the completion), lengths 16..29; the completion is
            the last 2..4 tokens of most rows (valid labels only near the end: the SP shards' label counts
            differ a lot) and more than half of every fourth row.
    """
    import datasets

    gen = torch.Generator().manual_seed(seed)
    lo, hi = {"plain": (8, 29), "completion": (16, 29)}[kind]
    rows = []
    for i in range(n):
        length = int(torch.randint(lo, hi + 1, (1,), generator=gen))
        row = {"input_ids": torch.randint(3, VOCAB, (length,), generator=gen).tolist()}
        if kind == "completion":
            completion = length // 2 + 2 if i % 4 == 3 else 2 + i % 3
            row["completion_mask"] = [0] * (length - completion) + [1] * completion
        rows.append(row)
    return datasets.Dataset.from_list(rows)


SFT_KEYS = ("loss", "grad_norm", "mean_token_accuracy", "num_tokens", "entropy", "aux_loss")


def run_sft(
    out_dir: str,
    *,
    sp: int = 1,
    packing: bool = False,
    doc_exact: bool = False,
    data: tuple[str, int] = ("plain", 16),
    completion_only: bool | None = None,
    eval_data: dict[str, tuple[str, int]] | None = None,
    steps: int = 4,
    epochs: float | None = None,
    sp_options: dict | None = None,
    flags: dict[str, Any] | None = None,
    model_kind: str = "llama",
    zero: int | None = None,
) -> dict[str, Any]:
    """Train the tiny llama with TRL's `SFTTrainer` (SGD, no clipping) in this process (one rank).

    `doc_exact` switches the model to hf_longctx attention at SP=1 (one rank, no collectives), which keeps
    packed documents apart by construction: the packing reference. (transformers 5.24 sdpa also keeps
    them apart, but only when no attention_mask is passed and no cache exists: `create_causal_mask` detects
    packing from position_ids only then.)
    `eval_data` maps a name to an eval set, each evaluated after training. `sp_options`, `flags`, `model_kind`,
    `zero`: see `run_trainer`.
    """
    from trl import SFTConfig, SFTTrainer

    import hf_longctx

    model = build_model(model_kind)
    if doc_exact:
        hf_longctx.enable_sequence_parallel(model, hf_longctx.SequenceParallelGroups.single())
    forwards = ForwardRecorder(model)
    args = SFTConfig(
        output_dir=out_dir,
        **engine_args(zero),
        report_to=[],
        disable_tqdm=True,
        seed=1,
        bf16=False,
        per_device_train_batch_size=BATCH,
        per_device_eval_batch_size=BATCH,
        max_steps=-1 if epochs is not None else steps,
        num_train_epochs=epochs if epochs is not None else 1.0,
        optim="sgd",
        learning_rate=LR["sgd"],
        max_grad_norm=0.0,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        packing=packing,
        max_length=64,
        completion_only_loss=completion_only,
        parallelism_config=parallelism_config(sp, sp_options, flags),
    )
    eval_sets = {name: sft_dataset(kind, n, seed=11) for name, (kind, n) in (eval_data or {}).items()}
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=sft_dataset(*data),
        eval_dataset=eval_sets or None,
        processing_class=tiny_tokenizer(),
    )
    trainer.train()
    result = {
        "logs": logged_steps(trainer, SFT_KEYS),
        "global_step": trainer.state.global_step,
        "attn": model.config._attn_implementation,
        "memory": memory_flags_active(model) if model_kind == "llama" else {},
        **forwards.take(),
    }
    # One evaluate() per set: TRL logs its own eval metrics without the set's name.
    result["eval"] = {}
    for name in eval_sets:
        metrics = trainer.evaluate(eval_dataset=name)
        result["eval"][name] = {key: metrics[f"eval_{key}"] for key in ("loss", "mean_token_accuracy")}
    return result


def sft_worker(rank: int, world_size: int, out_dir: str, configs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Run every named `run_sft` configuration in order (each in `out_dir/name`)."""
    return {name: run_sft(os.path.join(out_dir, name), **config) for name, config in configs.items()}


def assert_sft_runs_match(on: dict, off: dict, rtol: float) -> dict[str, float]:
    """Two `run_sft` results agree: every logged SFT metric, the token counts and every eval metric;
    returns the worst relative difference per logged metric."""
    worst = compare_logs(on["logs"], off["logs"], SFT_KEYS, rtol)
    assert {"loss", "grad_norm", "mean_token_accuracy", "entropy"} <= set(worst)
    assert [h["num_tokens"] for h in on["logs"]] == [h["num_tokens"] for h in off["logs"]]
    for name, metrics in off["eval"].items():
        for key, value in metrics.items():
            assert rel_diff(on["eval"][name][key], value) <= rtol, (name, key)
    return worst
