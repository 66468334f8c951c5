"""Collective counters on a real SP step, and the metrics callback in a Trainer run (world 2, gloo)."""

from __future__ import annotations

import torch

from tests._dist import run_distributed

SEQ, LAYERS, HEADS, KV, HIDDEN = 64, 2, 4, 2, 64


def _worker(rank: int, world_size: int, out: str) -> dict:
    import datasets
    from transformers import Trainer, TrainingArguments

    import hf_longctx
    from hf_longctx.instrument import SPMetricsCallback, record_collectives
    from tests._models import tiny_model

    groups = hf_longctx.SequenceParallelGroups.build(world_size)
    model = tiny_model("llama", num_heads=HEADS, num_kv_heads=KV, hidden=HIDDEN, layers=LAYERS)
    ids = torch.randint(0, 128, (1, SEQ), generator=torch.Generator().manual_seed(0))
    with hf_longctx.enable_sequence_parallel(model, groups):
        shard = hf_longctx.shard_batch({"input_ids": ids, "labels": ids}, groups)
        shift_labels = shard.pop("shift_labels")
        with record_collectives() as stats:
            loss = hf_longctx.sequence_parallel_loss(model(**shard).logits, shift_labels, groups)
            loss.backward()
    result = {"ops": stats.as_dict()}

    rows = [
        {"input_ids": torch.randint(0, 128, (33,), generator=torch.Generator().manual_seed(i)).tolist()}
        for i in range(4)
    ]
    data = datasets.Dataset.from_list([{**r, "labels": r["input_ids"]} for r in rows])
    args = TrainingArguments(
        output_dir=out,
        use_cpu=True,
        report_to=[],
        per_device_train_batch_size=1,
        max_steps=2,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        include_num_input_tokens_seen=True,
        parallelism_config=hf_longctx.ParallelismConfig(sp_size=world_size),
    )
    trainer = Trainer(model=tiny_model("llama"), args=args, train_dataset=data, callbacks=[SPMetricsCallback()])
    logged: list[dict] = []

    class Keep(SPMetricsCallback.__mro__[1]):  # a plain TrainerCallback that keeps the printed logs
        def on_log(self, args, state, control, logs=None, **kwargs):
            logged.append(dict(logs or {}))

    trainer.add_callback(Keep())
    trainer.train()
    result["logs"] = [entry for entry in logged if "loss" in entry]
    return result


def test_all_to_all_bytes_equal_the_ulysses_minimum_and_callback_logs(tmp_path):
    from hf_longctx.instrument import ulysses_min_bytes

    results = run_distributed(_worker, 2, str(tmp_path), timeout=180)
    head_dim = HIDDEN // HEADS
    theory = 2 * LAYERS * ulysses_min_bytes(HEADS, KV, head_dim, SEQ, 2, 4)  # forward + backward, fp32
    for result in results:
        a2a = result["ops"]["all_to_all"]
        assert a2a["calls"] == 2 * 2 * LAYERS  # qkv in, output back; forward and backward
        assert a2a["bytes_sent"] == theory
        assert result["ops"]["all_gather"]["calls"] == 2  # shard check + positions, once per forward
        for entry in result["logs"]:
            assert entry["sp_collective_calls"] > 0 and entry["sp_collective_mbytes"] > 0
            assert entry["peak_memory_mb"] > 0
