"""DistillationTrainer under SP on CPU: per-rank peak memory of a distillation step against the same SFT step.

    python -m benchmarks.distill_memory                          # S = 128K at SP=2: 64K tokens per rank
    python -m benchmarks.distill_memory --seq-lens 8192 --out /tmp/distill   # a quick look

Both variants train the same random-init student (Llama, 2 layers, hidden 64, 2 / 2 heads of dim 16, vocabulary
32,768) on one row of S tokens (a 64-token prompt, the rest completion) at SP=2 with `tiled_loss` and gradient
checkpointing (TRL's default for both trainers), DDP on gloo, SGD, fp32, one thread per rank, one optimizer step:
"SFT" is TRL's `SFTTrainer` on the row (loss on the completion), "distillation" TRL's `DistillationTrainer` with a
teacher of the same shape (other weights), its generation replaced by the row's completion (so the step is what
training does after generating: both forwards, the divergence, backward). Peak: the largest resident growth of
any rank from just before the models are built to the end of training (`run_peak_bytes`: models, gradients,
activations, buffers). Writes `benchmarks/results/<date>-distill-memory.{json,md}`.
"""

from __future__ import annotations

import gc
import sys
import tempfile
import time
from typing import Any

from benchmarks import _harness, _results

TARGET = 1.3  # issue 43: the distillation step's per-rank peak <= 1.3 x the SFT step's
PROMPT = 64
MODEL = {"arch": "llama", "vocab": 32768, "hidden": 64, "intermediate": 128, "layers": 2, "heads": 2, "kv_heads": 2,
         "head_dim": 16}  # fmt: skip
VARIANTS = ("SFT", "distillation")


def spec(variant: str, seq_len: int) -> dict[str, Any]:
    return {"variant": variant, "seq_len": seq_len, "sp": 2, "engine": "ddp", "dtype": "fp32", "attn": "sdpa",
            "model": {**MODEL, "max_positions": seq_len}, "threads": 1}  # fmt: skip


def _row(seq_len: int, vocab: int) -> list[int]:
    """One row of random ids; the prompt's ids are 3..9, whose words `word_tokenizer` maps back one to one (it
    splits a word that starts with a special token's text, "w0" / "w1" / "w2", e.g. "w123")."""
    import torch

    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 10, (PROMPT,), generator=gen)
    return torch.cat([prompt, torch.randint(3, vocab, (seq_len - PROMPT,), generator=gen)]).tolist()


def _sft(spec: dict[str, Any], model: Any, row: list[int], common: dict[str, Any], callbacks: list) -> Any:
    import datasets
    from trl import SFTConfig, SFTTrainer

    from benchmarks.worker import word_tokenizer

    data = datasets.Dataset.from_list([{"input_ids": row, "completion_mask": [0] * PROMPT + [1] * (len(row) - PROMPT)}])
    args = SFTConfig(max_length=len(row), packing=False, dataset_num_proc=1, **common)
    tokenizer = word_tokenizer(spec["model"]["vocab"])
    return SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer, callbacks=callbacks)


def _distillation(spec: dict[str, Any], model: Any, row: list[int], common: dict[str, Any], callbacks: list) -> Any:
    """TRL's DistillationTrainer whose generation returns the row's completion for every prompt."""
    import datasets
    from trl import DistillationTrainer

    from benchmarks.worker import build_model, word_tokenizer
    from hf_longctx.integrations.trl.distillation import distillation_config

    completion = row[PROMPT:]

    class Given(DistillationTrainer):
        def _generate_single_turn(self, prompt_ids, *args, **kwargs):
            return [list(completion) for _ in prompt_ids]

    teacher = build_model({**spec["model"], "seed": 1}, spec["attn"], spec["dtype"], "cpu")
    data = datasets.Dataset.from_list([{"prompt": " ".join(f"w{i}" for i in row[:PROMPT])}] * 2)
    args = distillation_config(max_completion_length=len(completion), beta=0.5, **common)
    tokenizer = word_tokenizer(spec["model"]["vocab"])
    return Given(model=model, teacher_model=teacher, args=args, train_dataset=data, processing_class=tokenizer,
                 callbacks=callbacks)  # fmt: skip


def run(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """One rank: build the variant's trainer, train one step, return its per-step records and the run's peak."""
    import torch

    import hf_longctx
    from benchmarks._measure import CommCounter, StepMemory, phase, recorder
    from benchmarks.worker import _import_before_measuring, _setup, build_model, flags_active

    torch.set_num_threads(int(spec["threads"]))
    counter = CommCounter(cuda=False)
    counter.install()
    engine_args = _setup(spec, world, cuda=False)
    _import_before_measuring({**spec, "trainer": "sft"})
    import trl

    trl.DistillationTrainer  # noqa: B018 - loaded before measuring, as the other trainers are
    row = _row(spec["seq_len"], spec["model"]["vocab"])
    gc.collect()
    memory = StepMemory(cuda=False)
    start = memory.begin()
    memory.process_peak = start
    common = dict(
        output_dir=tempfile.mkdtemp(prefix="hf_longctx_bench_"), report_to=[], per_device_train_batch_size=1,
        max_steps=1, learning_rate=1e-3, optim="sgd", lr_scheduler_type="constant", max_grad_norm=1.0, bf16=False,
        save_strategy="no", logging_strategy="no", dataloader_num_workers=0, seed=0, disable_tqdm=True,
        gradient_checkpointing=True,
        parallelism_config=hf_longctx.ParallelismConfig(sp_size=spec["sp"], tiled_loss=True), **engine_args,
    )  # fmt: skip
    model = build_model(spec["model"], spec["attn"], spec["dtype"], "cpu")
    phase(f"{spec['variant']}: models built")
    steps = recorder(counter, memory, None, False, None)
    build = _sft if spec["variant"] == "SFT" else _distillation
    trainer = build(spec, model, row, common, [steps])
    t0 = time.perf_counter()
    try:
        trainer.train()
    finally:
        memory.end()
    phase("training done")
    return {"rank": rank, "steps": steps.steps, "run_peak_bytes": memory.process_peak - start,
            "train_s": time.perf_counter() - t0, "flags_active": flags_active(model)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = _harness.options(__doc__, "distill-memory", timeout=3600, repeats=1)
    parser.add_argument("--seq-lens", default="131072", help="tokens per row (SP=2: half per rank)")
    args = parser.parse_args(argv)

    def launch(seq_len: int, variant: str) -> dict[str, Any]:
        job = spec(variant, seq_len)
        return {"target": "benchmarks.distill_memory:run", "nproc": job["sp"], "env": _harness.CPU_ENV, "spec": job}

    def numbers(record: dict[str, Any]) -> dict[str, Any]:
        ranks = record["result"]["ranks"]
        if not all(r["flags_active"].get("tiled_loss") for r in ranks):
            raise SystemExit(f"tiled_loss was not applied: {[r['flags_active'] for r in ranks]}")
        step = max(r["steps"][0]["act_bytes"] for r in ranks)
        return {"peak": _harness.worst(record, "run_peak_bytes"), "step_peak": step,
                "step_s": max(r["steps"][0]["step_s"] for r in ranks)}  # fmt: skip

    columns: list[_results.Column] = [
        _results.col("peak GiB per rank", "peak", ".3f", _results.GiB), _results.col("x SFT", "x_peak", ".3f"),
        ("target", lambda r: _results.target(r["x_peak"], TARGET) if r["variant"] == "distillation" else ""),
        _results.col("step growth GiB", "step_peak", ".3f", _results.GiB),
        _results.col("step s", "step_s", ".0f"), _results.col("x SFT", "x_step_s", ".2f"),
    ]  # fmt: skip
    return _harness.compare(
        args, argv, [int(s) for s in args.seq_lens.split(",")], list(VARIANTS), launch, numbers, columns,
        "Distillation memory per rank: SP=2 + tiled_loss, against the same SFT step, CPU",
        "Model and method: `benchmarks/distill_memory.py`; S tokens per row, S/2 per rank.",
        target=("distillation", "x_peak", TARGET),
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
