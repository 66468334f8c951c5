"""One run of the memory benchmark: `run(rank, world_size, spec)` in each rank of a `benchmarks._harness` job.

`spec["impl"]` is "hf_longctx" (`hf_longctx.ParallelismConfig(sp_size=P, **spec["flags"])`) or "upstream"
(accelerate's `ParallelismConfig(sp_size=P, sp_backend="deepspeed")`: DeepSpeed ALST); `spec["trainer"]` is
"trainer" (the stock `transformers.Trainer`) or "sft" (TRL's `SFTTrainer`); DeepSpeed ZeRO-1 is the engine of
every run (the upstream path needs DeepSpeed). `spec["data"]` is "random" (one row of S random tokens) or
"packed" (one row of S tokens holding documents of `doc_len` tokens: positions restart at 0).

Per optimizer step (after `warmup` steps) it records the wall time, the process CPU time (less sensitive to
other jobs on a shared machine: time spent descheduled is not counted) and the resident-memory high-water mark
(`VmHWM`, reset at each step's start, see `benchmarks.worker.StepMemory`); the process peak covers the whole
run. The first step's loss is kept, and for packed rows rank 0 also computes the per-document reference loss
(each document alone through the same initial weights, no SP).
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

from benchmarks.worker import StepMemory, build_model


class Rows:
    """`n` rows of `seq_len` random tokens in [3, vocab) as a map-style dataset (`same`: n copies of one row,
    so the first step's row is known whatever order the sampler picks)."""

    def __init__(self, n: int, seq_len: int, vocab: int, seed: int, same: bool = False) -> None:
        import torch

        gen = torch.Generator().manual_seed(seed)
        if same:
            self.ids = torch.randint(3, vocab, (1, seq_len), generator=gen).expand(n, seq_len)
        else:
            self.ids = torch.randint(3, vocab, (n, seq_len), generator=gen)

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.ids[i].tolist()}


def make_collate(doc_len: int | None):
    """Full rows with labels and position_ids (restarting every `doc_len` tokens for packed rows)."""
    import torch

    def collate(features: list[dict[str, Any]]) -> dict[str, Any]:
        ids = torch.tensor([f["input_ids"] for f in features])
        pos = torch.arange(ids.shape[1])
        pos = pos % doc_len if doc_len else pos
        return {"input_ids": ids, "labels": ids.clone(), "position_ids": pos.expand_as(ids).clone()}

    return collate


def word_tokenizer(vocab: int):
    """A WordLevel tokenizer whose token i is the word "w{i}" (SFTTrainer needs one; rows are token ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w1"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="w0", unk_token="w1", eos_token="w2")


def document_reference_loss(spec: dict[str, Any], row: list[int]) -> float:
    """Mean next-token loss of a packed row with each document run alone (no SP, initial weights)."""
    import torch

    model = build_model(spec["model"], spec["attn"], spec["dtype"], "cpu")
    ids, doc = torch.tensor(row), spec["doc_len"]
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(row), doc):
            part = ids[start : start + doc].unsqueeze(0)
            logits = model(input_ids=part).logits[0, :-1]
            total += torch.nn.functional.cross_entropy(logits.float(), part[0, 1:], reduction="sum").item()
            count += part.shape[1] - 1
    return total / count


def _recorder(memory: StepMemory):
    from transformers import TrainerCallback

    class Recorder(TrainerCallback):
        def __init__(self) -> None:
            self.steps: list[dict[str, float]] = []
            self._t0 = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            memory.begin()
            self._t0, self._c0 = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            t1, c1 = time.perf_counter(), time.process_time()
            self.steps.append({"step_s": t1 - self._t0, "cpu_s": c1 - self._c0, "peak_bytes": memory.end()})

    return Recorder()


def run(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """This rank's step records, process peak and first loss (rank 0: also the per-document reference)."""
    import torch
    from accelerate import PartialState

    torch.set_num_threads(int(spec.get("threads", 1)))
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")
    if spec["impl"] == "hf_longctx":
        import hf_longctx

        parallelism = hf_longctx.ParallelismConfig(sp_size=spec["sp"], **spec.get("flags", {}))
    else:
        from accelerate.parallelism_config import ParallelismConfig

        parallelism = ParallelismConfig(sp_size=spec["sp"], sp_backend="deepspeed")
        parallelism.sp_handler.sp_attn_implementation = spec["attn"]
    steps = spec["warmup"] + spec["steps"]
    ds_config = {
        "zero_optimization": {"stage": 1},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
    }
    common = dict(
        output_dir=tempfile.mkdtemp(prefix="hf_longctx_membench_"),
        report_to=[],
        per_device_train_batch_size=1,
        max_steps=steps,
        learning_rate=1e-4,
        optim="adamw_torch",
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        deepspeed=ds_config,
        accelerator_config={"use_configured_state": True},
        logging_steps=1,
        save_strategy="no",
        dataloader_num_workers=0,
        seed=0,
        disable_tqdm=True,
        activation_checkpointing=bool(spec.get("checkpointing")),
        parallelism_config=parallelism,
    )
    packed = spec["data"] == "packed"
    rows = Rows((steps + 1) * world, spec["seq_len"], spec["model"]["vocab"], seed=0, same=packed)
    reference = None
    if packed and rank == 0:
        # Every packed row is the same row, so it is the first step's row for both implementations. Computed
        # before training: the upstream path then replaces the process-wide "sdpa" kernel, which would make
        # this plain model sequence-parallel too.
        reference = document_reference_loss(spec, rows[0]["input_ids"])
    model = build_model(spec["model"], spec["attn"], spec["dtype"], "cpu")
    memory = StepMemory(cuda=False)
    recorder = _recorder(memory)
    if spec["trainer"] == "trainer":
        from transformers import Trainer, TrainingArguments

        args = TrainingArguments(remove_unused_columns=False, **common)
        collate = make_collate(spec.get("doc_len") if spec["data"] == "packed" else None)
        trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=collate, callbacks=[recorder])
    else:
        import datasets
        from trl import SFTConfig, SFTTrainer

        args = SFTConfig(max_length=spec["seq_len"], packing=False, dataset_num_proc=1, bf16=False, **common)
        data = datasets.Dataset.from_list([rows[i] for i in range(len(rows))])
        tokenizer = word_tokenizer(spec["model"]["vocab"])
        trainer = SFTTrainer(
            model=model, args=args, train_dataset=data, processing_class=tokenizer, callbacks=[recorder]
        )
    t0 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t0
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {
        "rank": rank,
        "steps": recorder.steps,
        "process_peak_bytes": memory.process_peak,
        "first_loss": losses[0] if losses else None,
        "train_s": train_s,
        "threads": torch.get_num_threads(),
        "document_reference_loss": reference,
    }
