"""GPU check of the memory flags: a Llama-3.1-8B-shaped random-init bf16 model on ONE GPU, with all three
flags and DeepSpeed ZeRO-3 offload (parameters and optimizer in host memory), through the stock Trainer.

    python -m benchmarks.gpu_memory                      # ladder 64K..2M (stops at the first failure) + tokens/s at 64K
    python -m benchmarks.gpu_memory --lengths 65536,131072 --throughput-steps 3
    python -m benchmarks.gpu_memory --shape tiny         # the same code path on a tiny model (CPU smoke run)

Without CUDA (and without `--shape tiny`) it prints one "no CUDA device" line and exits 0, so
`scripts/gpu_check.sh` can always call it. Each length runs in its own `torchrun --nproc_per_node 1` job (an
out-of-memory error ends that job only) with a timeout; the ladder stops at the first length that fails.
Reported per length: ok/failed, seconds for one optimizer step, peak GPU memory (`max_memory_allocated`) and
peak host memory (resident high-water mark); at `--throughput-length` the median tokens/s over
`--throughput-steps` steps after one warm-up step. Results: a table on stdout and
`benchmarks/results/<date>-gpu-memory.json`.

The mark: ALST (Arctic Long Sequence Training, arXiv:2506.13996) reports 1.2M tokens for Llama-3.1-8B on one
H200 with tiled loss, tiled MLP, activation-checkpoint offload and ZeRO-3 offload. Host memory bounds this run:
the offloaded checkpoints take layers x S x hidden x 2 bytes (32 x 4096 x 2 = 256 KiB per token, 256 GiB at
1M tokens) next to the offloaded bf16 weights and fp32 master weights / optimizer state. The default optimizer
is therefore SGD (no state: 8B x 4 bytes of master weights instead of 8B x 12 with Adam); `--optim adamw_torch`
needs about 100 GB more host memory.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
K = 1024
SHAPES = {
    # Llama-3.1-8B: 32 layers, hidden 4096, 32 query / 8 key-value heads of 128, MLP 14336, vocabulary 128256.
    "llama-8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rope_theta=500000.0,
    ),
    "tiny": dict(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    ),
}
FLAGS = {"tiled_loss": True, "tiled_mlp": True, "offload_activations": True}
NO_CUDA = "no CUDA device: skipping the GPU memory benchmark (benchmarks/gpu_memory.py)"


def _host_peak_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One Trainer run at `args.seq_len` (inside torchrun): `steps` optimizer steps, their times and peaks."""
    import torch
    from accelerate import PartialState
    from transformers import AutoModelForCausalLM, LlamaConfig, Trainer, TrainerCallback, TrainingArguments

    import hf_longctx
    from hf_longctx.memory.offload import offloaded_checkpoint

    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        PartialState(backend="gloo")
    offload = {"device": "cpu", "pin_memory": cuda}
    ds_config = {
        "zero_optimization": {
            "stage": 3,
            "offload_param": offload,
            "offload_optimizer": offload,
            "stage3_param_persistence_threshold": 0,
        },
        "zero_force_ds_cpu_optimizer": False,  # a torch optimizer on the offloaded states (no compiled CPU Adam)
        "bf16": {"enabled": "auto"},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
    }
    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t0)

    training = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="hf_longctx_gpu_memory_"),
        report_to=[],
        per_device_train_batch_size=1,
        max_steps=args.steps,
        optim=args.optim,
        learning_rate=1e-5,
        lr_scheduler_type="constant",
        bf16=cuda,
        deepspeed=ds_config,
        accelerator_config={"use_configured_state": not cuda},
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        remove_unused_columns=False,
        parallelism_config=hf_longctx.ParallelismConfig(sp_size=1, **FLAGS),
    )
    attn = args.attn or ("flash_attention_2" if cuda and _has_flash_attn() else "sdpa")
    config = LlamaConfig(**SHAPES[args.shape], max_position_embeddings=max(args.seq_len, 8192), use_cache=False)
    config.tie_word_embeddings = False
    torch.manual_seed(0)
    # Built after TrainingArguments: with ZeRO-3 configured, from_config partitions (and offloads) the weights as
    # they are created, so no process ever holds the whole model.
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation=attn, dtype=torch.bfloat16 if cuda else torch.float32
    )
    vocab = config.vocab_size
    rows = torch.randint(0, vocab, (args.steps, args.seq_len), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": r, "labels": r} for r in rows]

    def collate(features):
        ids = torch.stack([f["input_ids"] for f in features])
        return {"input_ids": ids, "labels": ids.clone()}

    trainer = Trainer(model=model, args=training, train_dataset=data, data_collator=collate, callbacks=[Timer()])
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    layer = model.model.layers[0]
    flags_active = {
        "tiled_loss": len(model.lm_head._forward_hooks) > 0,
        "tiled_mlp": "forward" in vars(layer.mlp),
        "offload_activations": getattr(getattr(layer, "_gradient_checkpointing_func", None), "func", None)
        is offloaded_checkpoint,
    }
    if not all(flags_active.values()):
        raise RuntimeError(f"memory flags not applied: {flags_active}")
    return {
        "seq_len": args.seq_len,
        "steps": times,
        "losses": losses,
        "gpu_peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "host_peak_bytes": _host_peak_bytes(),
        "attn": attn,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
    }


def _has_flash_attn() -> bool:
    import importlib.util

    return importlib.util.find_spec("flash_attn") is not None


def child_job(rank: int, world: int, **options: Any) -> dict[str, Any]:
    """`child` in a `benchmarks._harness` job (one rank)."""
    return child(argparse.Namespace(**options))


def launch(args: argparse.Namespace, seq_len: int, steps: int, out_dir: Path) -> dict[str, Any]:
    from benchmarks import _harness

    options = {"seq_len": seq_len, "steps": steps, "shape": args.shape, "optim": args.optim, "attn": args.attn}
    env = {"PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")}
    record = _harness.job("benchmarks.gpu_memory:child_job", 1, args.timeout, out_dir, f"s{seq_len}_n{steps}", env=env,
                          **options)  # fmt: skip
    record = {"seq_len": seq_len, "steps_requested": steps, **record}
    if record["status"] == "ok":
        record.update(record.pop("result")["ranks"][0])
    return record


def _gib(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**30:.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-8b")
    parser.add_argument("--lengths", default=",".join(str(n * K) for n in (64, 128, 256, 512, 768, 1024, 1536, 2048)))
    parser.add_argument("--throughput-length", type=int, default=64 * K)
    parser.add_argument("--throughput-steps", type=int, default=3)
    parser.add_argument("--optim", default="sgd")
    parser.add_argument("--attn", default=None, help="default: flash_attention_2 when installed, else sdpa")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per job")
    parser.add_argument("--out-prefix", default=None)
    args = parser.parse_args(argv)

    import torch

    if args.shape != "tiny" and not torch.cuda.is_available():
        print(NO_CUDA)
        return 0
    out_dir = Path(tempfile.mkdtemp(prefix="hf_longctx_gpu_memory_"))
    records = []
    throughput = launch(args, args.throughput_length, 1 + args.throughput_steps, out_dir)
    records.append(dict(throughput, kind="throughput"))
    for seq_len in (int(x) for x in args.lengths.split(",")):
        record = launch(args, seq_len, 1, out_dir)
        records.append(dict(record, kind="ladder"))
        print(f"S={seq_len}: {record['status']} ({record['wall_s']:.0f} s)", flush=True)
        if record["status"] != "ok":
            break
    longest = max([r["seq_len"] for r in records if r["kind"] == "ladder" and r["status"] == "ok"], default=None)
    tokens_per_s = None
    if throughput["status"] == "ok" and len(throughput["steps"]) > 1:
        tokens_per_s = args.throughput_length / statistics.median(throughput["steps"][1:])
    print(f"\n{args.shape} shape, one GPU, flags {sorted(FLAGS)}, ZeRO-3 offload, optim {args.optim}")
    print(f"{'S':>9} {'status':>8} {'step s':>8} {'GPU peak GiB':>13} {'host peak GiB':>14}")
    for r in records:
        step = f"{r['steps'][-1]:.1f}" if r.get("steps") else "-"
        print(
            f"{r['seq_len']:>9} {r['status']:>8} {step:>8} {_gib(r.get('gpu_peak_bytes')):>13} "
            f"{_gib(r.get('host_peak_bytes')):>14}  {r['kind']}"
        )
    print(f"longest sequence for one optimizer step: {longest} tokens (ALST on one H200: 1.2M)")
    print(f"tokens/s at {args.throughput_length}: {tokens_per_s and round(tokens_per_s, 1)}")
    prefix = args.out_prefix or str(ROOT / "benchmarks" / "results" / f"{datetime.date.today().isoformat()}-gpu-memory")
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    summary = {"longest": longest, "tokens_per_s": tokens_per_s, "args": vars(args), "records": records}
    Path(f"{prefix}.json").write_text(json.dumps(summary, indent=1))
    print("wrote", f"{prefix}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
