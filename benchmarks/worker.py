"""The one training worker of every benchmark: `run(rank, world_size, spec)` in each rank of a `_harness` job.

`spec` (JSON) says what to train and how; every benchmark differs only in its specs:

- `impl`: "hf_longctx" (`hf_longctx.ParallelismConfig(sp_size=sp, **sp_options)`: backends and memory flags),
  "upstream" (accelerate's `ParallelismConfig(sp_size=sp, sp_backend="deepspeed")` with
  `sp_handler.sp_attn_implementation` set to the model's kernel: DeepSpeed ALST Ulysses) or "none" (no SP);
- `engine`: "zero1" (DeepSpeed ZeRO-1, the default: the upstream path needs DeepSpeed), "zero3_offload" (ZeRO-3,
  parameters and optimizer in host memory) or "ddp" (accelerate's own; one rank: no process group at all, as
  the planner's `--world 1` means). DeepSpeed runs on CPU go through `PartialState(backend="gloo")` +
  `use_configured_state` (without it accelerate sees one process per rank on CPU and duplicates data);
- `trainer`: "trainer" (the stock `transformers.Trainer`), "sft" (TRL's `SFTTrainer`) or "dpo" (TRL's
  `DPOTrainer` on pairs cut from the rows: prompt + chosen = `seq_len` tokens, rejected half as long as chosen);
- `data`: "random" (rows of `seq_len` random tokens), "packed" (one row repeated, documents of `doc_len` tokens:
  positions restart; `reference_loss` adds rank 0's per-document loss through the initial weights) or
  "shakespeare" (the shipped default data and tiny Llama: `model` is then ignored);
- `model`: `{"arch", "vocab", "hidden", "intermediate", "layers", "heads", "kv_heads", "head_dim"}` (+ `extra`
  config fields), random init; `dtype` "fp32" or "bf16", `attn`, `device` "cpu" or "cuda", `threads`;
- `steps` (optimizer steps, `warmup` of them unmeasured by the readers), `lr`, `optim`, `gradient_checkpointing`,
  `log` (log the loss every step: a collective per step, off by default), `op_profile` (one extra profiled step),
  `census` (live objects, tensors and tensor bytes in every step's record: `_measure.object_census`),
  `transformers_router_loss` (hf_longctx does not take the MoE router loss over: transformers keeps every layer's
  router logits; a baseline for `benchmarks.router_memory`).

Measurements (`benchmarks._measure`): per step records, the process peak and `run_peak_bytes`, the resident
growth from just before the model is built to the end of `trainer.train()` (model, gradients, optimizer state,
activations and every runtime buffer: what `hf-longctx plan` predicts).
"""

from __future__ import annotations

import contextlib
import gc
import os
import tempfile
import time
from typing import Any

from benchmarks._measure import CommCounter, StepMemory, phase, recorder

ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),  # `extra={"sliding_window": W}`: every layer windowed
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),  # `extra`: experts, router loss (router_memory)
}


def build_model(model_spec: dict[str, Any], attn: str, dtype: str, device: str | None):
    """A random-init causal LM of the spec's shape (`device=None`: let DeepSpeed ZeRO-3 place it)."""
    import torch
    import transformers

    config_cls, model_cls = (getattr(transformers, name) for name in ARCHS[model_spec["arch"]])
    m = model_spec
    config = config_cls(
        vocab_size=m["vocab"], hidden_size=m["hidden"], intermediate_size=m["intermediate"],
        num_hidden_layers=m["layers"], num_attention_heads=m["heads"], num_key_value_heads=m["kv_heads"],
        head_dim=m["head_dim"], max_position_embeddings=max(m.get("max_positions", 0), 4096), attention_dropout=0.0,
        tie_word_embeddings=False, use_cache=False, **m.get("extra", {}),
    )  # fmt: skip
    torch.manual_seed(model_spec.get("seed", 0))
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    # GPU: built in place, never a full fp32 copy in host memory per rank; device None (ZeRO-3 configured):
    # from_config partitions (and offloads) the weights as they are made.
    with contextlib.nullcontext() if device is None else torch.device(device):
        return model_cls._from_config(config, attn_implementation=attn, dtype=torch_dtype)


def random_rows(n: int, seq_len: int, vocab: int, seed: int, same: bool = False) -> list[dict[str, list[int]]]:
    """`n` rows of `seq_len` random token ids in [3, vocab) (`same`: n copies of one row, so the first step's
    row is known whatever order the sampler picks); ids 0-2 stay free for the SFT tokenizer's specials."""
    import torch

    ids = torch.randint(3, vocab, (1 if same else n, seq_len), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": row.tolist()} for row in ids.expand(n, seq_len)]


def make_collate(doc_len: int | None):
    """Full rows with labels and position_ids (restarting every `doc_len` tokens for packed rows; the upstream
    DataLoader adapter requires position_ids)."""
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


def _setup(spec: dict[str, Any], world: int, cuda: bool) -> dict[str, Any]:
    """Process group and engine: the TrainingArguments fields of `spec["engine"]`."""
    import torch.distributed as dist
    from accelerate import PartialState

    engine = spec.get("engine", "zero1")
    if engine == "ddp":
        if world == 1:  # a single process: no process group, so no DDP wrapper and no gradient buckets
            for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
                os.environ.pop(key, None)
        elif not dist.is_initialized():
            dist.init_process_group("nccl" if cuda else "gloo")
        return {"use_cpu": not cuda}
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="nccl" if cuda else "gloo")
    zero: dict[str, Any] = {"stage": 1}
    if engine == "zero3_offload":
        offload = {"device": "cpu", "pin_memory": cuda}
        zero = {"stage": 3, "offload_param": offload, "offload_optimizer": offload}
        zero["stage3_param_persistence_threshold"] = 0
    ds = {"zero_optimization": zero, "bf16": {"enabled": "auto"}, "gradient_clipping": "auto"}
    ds.update(train_micro_batch_size_per_gpu="auto", gradient_accumulation_steps="auto", train_batch_size="auto")
    if engine == "zero3_offload":
        ds["zero_force_ds_cpu_optimizer"] = False  # a torch optimizer on the offloaded states (no compiled CPU Adam)
    return {"deepspeed": ds, "accelerator_config": {"use_configured_state": True}}


def _parallelism(spec: dict[str, Any], world: int) -> Any:
    impl, sp = spec["impl"], spec.get("sp", 1)
    if impl == "hf_longctx":
        import hf_longctx

        options = spec.get("sp_options", {})
        return hf_longctx.ParallelismConfig(sp_size=sp, **options) if sp > 1 or options else None
    if impl == "upstream":
        from accelerate.parallelism_config import ParallelismConfig

        if sp != world:
            raise ValueError(f"the upstream benchmark runs SP over the whole world: sp={sp}, world={world}")
        config = ParallelismConfig(sp_size=sp, sp_backend="deepspeed")
        config.sp_handler.sp_attn_implementation = spec["attn"]
        return config
    if impl != "none":
        raise ValueError(f"unknown impl {impl!r}")
    return None


def flags_active(model: Any) -> dict[str, bool]:
    """Whether each memory flag changed the model as it should (a flag that did nothing must not pass)."""
    from hf_longctx.memory.offload import offloaded_checkpoint
    from hf_longctx.memory.tiled_layer import _TiledLayer

    layer = model.model.layers[0]
    func = getattr(getattr(layer, "_gradient_checkpointing_func", None), "func", None)
    return {"tiled_loss": len(model.lm_head._forward_hooks) > 0, "tiled_mlp": "forward" in vars(layer.mlp),
            "offload_activations": func is offloaded_checkpoint,
            "tiled_layer": isinstance(vars(layer).get("forward"), _TiledLayer)}  # fmt: skip


def _trainer(spec: dict[str, Any], model: Any, data: Any, common: dict[str, Any], callbacks: list) -> Any:
    if spec.get("trainer", "trainer") == "trainer":
        from transformers import Trainer, TrainingArguments

        collate = make_collate(spec.get("doc_len") if spec.get("data") == "packed" else None)
        args = TrainingArguments(remove_unused_columns=False, **common)
        return Trainer(model=model, args=args, train_dataset=data, data_collator=collate, callbacks=callbacks)
    import datasets

    tokenizer = word_tokenizer(spec["model"]["vocab"])
    if spec["trainer"] == "dpo":
        return _dpo_trainer(spec, model, data, common, callbacks, tokenizer)
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(max_length=spec["seq_len"], packing=False, dataset_num_proc=1, **common)
    rows = datasets.Dataset.from_list(list(data))
    return SFTTrainer(model=model, args=args, train_dataset=rows, processing_class=tokenizer, callbacks=callbacks)


def _dpo_trainer(spec: dict[str, Any], model: Any, data: Any, common: dict[str, Any], callbacks: list, tokenizer: Any):
    """TRL's DPOTrainer (sigmoid loss, a reference model of the same weights) on pairs cut from the random rows:
    prompt and chosen are a row's two halves (`seq_len` tokens together), rejected the first half of chosen."""
    import datasets
    from trl import DPOConfig, DPOTrainer

    def words(ids: list[int]) -> str:
        return " ".join(f"w{i}" for i in ids)

    half = spec["seq_len"] // 2
    rows = [d["input_ids"] for d in data]
    pairs = datasets.Dataset.from_list([
        {"prompt": words(r[:half]), "chosen": " " + words(r[half:]), "rejected": " " + words(r[half:][: half // 2])}
        for r in rows])  # fmt: skip
    args = DPOConfig(max_length=None, dataset_num_proc=1, beta=0.1, **common)
    # The reference is built here (TRL would copy the policy by its path, which a random-init model has not).
    reference = build_model(spec["model"], spec["attn"], spec["dtype"], spec.get("device", "cpu"))
    return DPOTrainer(model=model, ref_model=reference, args=args, train_dataset=pairs, processing_class=tokenizer,
                      callbacks=callbacks)  # fmt: skip


def _import_before_measuring(spec: dict[str, Any]) -> None:
    """Import what the run will use, so `run_peak_bytes` counts tensors and buffers, not code (~0.2 GiB)."""
    import transformers

    import hf_longctx.instrument  # noqa: F401

    transformers.Trainer, transformers.TrainingArguments  # noqa: B018 - the lazy modules load on access
    if spec.get("data") != "shakespeare":
        getattr(transformers, ARCHS[spec["model"]["arch"]][1])
    if spec.get("trainer") in ("sft", "dpo"):
        import datasets  # noqa: F401
        import trl

        trl.SFTTrainer, trl.DPOTrainer  # noqa: B018


def run(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """This rank's per-step records, peaks and losses (see the module docstring)."""
    import torch

    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    phase(f"worker started: S={spec.get('seq_len')}, {spec.get('model', {}).get('layers')} layers, {spec['impl']}")
    cuda = spec.get("device", "cpu") == "cuda"
    counter = CommCounter(cuda=cuda)
    counter.install()  # before accelerate / DeepSpeed / hf_longctx bind any collective
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
    engine_args = _setup(spec, world, cuda)
    parallelism = _parallelism(spec, world)
    if spec.get("transformers_router_loss"):  # a benchmark baseline: hf_longctx leaves the MoE router loss alone
        from hf_longctx.sequence import router_loss

        router_loss.RouterLoss.attach = classmethod(lambda cls, model: None)
    steps = spec["steps"] + (1 if spec.get("op_profile") and not cuda else 0)  # + the profiled step
    profile_step = spec["steps"] if steps > spec["steps"] else None
    if spec.get("data") == "shakespeare":
        from hf_longctx.data.defaults import gpt2_tokenizer, tiny_llama, window_dataset

        tok = gpt2_tokenizer()
        data = window_dataset(tok, spec["seq_len"], max_windows=spec.get("windows", 100))
    else:
        packed = spec.get("data") == "packed"
        data = random_rows((steps + 1) * world, spec["seq_len"], spec["model"]["vocab"], spec.get("seed", 0), packed)
    # Computed before training: the upstream path then replaces the process-wide kernel for every model.
    reference = None
    if spec.get("reference_loss") and rank == 0:
        reference = document_reference_loss(spec, data[0]["input_ids"])
    _import_before_measuring(spec)
    gc.collect()
    memory = StepMemory(cuda)
    start = memory.begin()
    memory.process_peak = start  # the run's peak counts from here: the model, its state and every step
    common = dict(
        output_dir=tempfile.mkdtemp(prefix="hf_longctx_bench_"), report_to=[], per_device_train_batch_size=1,
        max_steps=steps, learning_rate=spec.get("lr", 1e-4), optim=spec.get("optim", "adamw_torch"),
        lr_scheduler_type="constant", max_grad_norm=1.0, bf16=spec.get("dtype") == "bf16",
        activation_checkpointing=spec.get("gradient_checkpointing", False), save_strategy="no",
        logging_strategy="steps" if spec.get("log") else "no", logging_steps=1, dataloader_num_workers=0,
        dataloader_drop_last=True, seed=spec.get("seed", 0), disable_tqdm=True, parallelism_config=parallelism,
        **engine_args,
    )  # fmt: skip
    if spec.get("data") == "shakespeare":
        model = tiny_llama(tok, num_hidden_layers=2)
    else:
        zero3 = spec.get("engine") == "zero3_offload"
        model = build_model(spec["model"], spec["attn"], spec["dtype"], None if zero3 else ("cuda" if cuda else "cpu"))
    phase("model built")
    local_lens: list[int] = []
    model.register_forward_pre_hook(
        lambda m, a, kw: local_lens.append(int(kw["input_ids"].shape[1])) if not local_lens else None, with_kwargs=True
    )
    from hf_longctx.instrument import record_collectives

    with record_collectives() if spec["impl"] == "hf_longctx" else contextlib.nullcontext() as hf_stats:
        steps_cb = recorder(counter, memory, hf_stats, cuda, profile_step, census=bool(spec.get("census")))
        trainer = _trainer(spec, model, data, common, [steps_cb])
        phase("trainer built")
        t0 = time.perf_counter()
        try:
            trainer.train()
        finally:
            memory.end()
    phase("training done")
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    with open("/proc/self/status") as f:
        host_peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    options = spec.get("sp_options", {})
    flags = [k for k in ("tiled_loss", "tiled_mlp", "offload_activations", "tiled_layer") if options.get(k)]
    return {
        "rank": rank, "steps": steps_cb.steps, "op_profile": steps_cb.op_profile,
        "process_peak_bytes": memory.process_peak, "run_peak_bytes": memory.process_peak - start,
        "host_peak_bytes": host_peak if cuda else memory.process_peak, "memory_method": memory.method,
        "local_seq_len": local_lens[0] if local_lens else None, "train_s": time.perf_counter() - t0,
        "losses": losses, "first_loss": losses[0] if losses else None, "document_reference_loss": reference,
        "flags_active": {k: v for k, v in flags_active(model).items() if k in flags} if flags else {},
        "wrapper": type(trainer.model_wrapped).__name__, "attn": spec.get("attn"), "threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
    }  # fmt: skip


def shipped_shape(name: str, arch: str) -> dict[str, Any]:
    """The worker model spec of a config shipped with hf_longctx (`hf-longctx plan --model NAME` reads the same)."""
    from hf_longctx.planner.model_shape import load_model_shape

    shape = load_model_shape(name)
    keys = ("vocab", "hidden", "intermediate", "layers", "heads", "kv_heads", "head_dim")
    return {"arch": arch, **{k: getattr(shape, k) for k in keys}}
