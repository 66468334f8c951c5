"""SFT with hf_longctx sequence parallelism: one script, one YAML recipe per model/length/SP size.

    accelerate launch --config_file configs/cpu_sp2.yaml recipes/sft.py --config recipes/tiny_llama_4k_sp2.yaml
    torchrun --nproc_per_node 2 recipes/sft.py --config recipes/tiny_llama_4k_sp2.yaml

With `model_name_or_path` unset (or "tiny") it trains the offline default (tiny random Llama, GPT-2 tokenizer,
vendored Shakespeare cut into `max_length`-token windows). `dataset_name` (a Hub name or a local folder) is what it
trains on whenever it is set, on the command line or in the YAML, even where the recipe sets `long_documents`: TRL's
scripts train on the dataset named. `long_documents` trains on documents of `max_length` tokens cut from the
vendored texts concatenated, tokenized with the model's tokenizer as a stream, one per row (`packing: true`): the
million-token recipes, whose `rope_parameters` (YaRN) extend the model's positions to
`max_length`. `rope_parameters` is checked against the model (`hf_longctx.sequence.rope_extension.plan_rope`): a
scaling written for other native positions, or one short of `max_length`, stops the run; `auto` derives YaRN from the
model's own config. The RoPE chosen is printed. `compare_to` names a finished run (e.g. the same recipe with
`sp_size: 1`) whose loss curve is compared and plotted at the end.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import datasets
import transformers
from _parse import parse_recipe
from _weights import model_dtype_field, weights_dtype  # this folder: the recipes run as scripts
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer, TrlParser

import hf_longctx
from hf_longctx.data.defaults import gpt2_tokenizer, tiny_llama, tiny_llama_config, window_dataset
from hf_longctx.data.long_documents import corpus_documents
from hf_longctx.instrument.curves import compare_runs, plot_loss_curves
from hf_longctx.integrations.trainer import sp_state
from hf_longctx.integrations.trainer.callbacks import ThroughputCallback
from hf_longctx.sequence.rope_extension import plan_rope


@dataclass
class LongContextArguments:
    sp_size: int = field(default=1, metadata={"help": "Sequence-parallel degree (1 = no SP)."})
    sp_backend: str = field(
        default="ulysses", metadata={"help": "ulysses, ring, hybrid, auto, or 'deepspeed' (upstream)."}
    )
    ulysses_degree: int | None = field(default=None, metadata={"help": "hybrid/auto: Ulysses degree."})
    ring_variant: str | None = field(default=None, metadata={"help": "ring/hybrid: p2p or allgather."})
    ring_layout: str = field(default="zigzag", metadata={"help": "ring/hybrid: zigzag or contiguous."})
    model_name_or_path: str | None = field(default=None, metadata={"help": "Model to fine-tune; unset = tiny Llama."})
    attn_implementation: str = field(default="sdpa", metadata={"help": "The model's own attention kernel."})
    model_dtype: str = model_dtype_field()
    tiny_layers: int = field(default=4, metadata={"help": "Layers of the default tiny Llama."})
    tiny_heads: int = field(default=8, metadata={"help": "Query heads of the tiny Llama (hidden = 16 x heads)."})
    tiny_kv_heads: int = field(default=4, metadata={"help": "Key/value heads of the tiny Llama."})
    tiny_positions: int = field(default=32768, metadata={"help": "Native positions of the tiny Llama."})
    dataset_name: str | None = field(
        default=None,
        metadata={"help": "HF dataset (text or messages); it wins over long_documents. Unset = shipped Shakespeare."},
    )
    max_windows: int | None = field(
        default=None, metadata={"help": "Cap on training rows of the shipped data (windows or long documents)."}
    )
    eval_windows: int = field(default=0, metadata={"help": "Held-out windows to evaluate on (default data)."})
    compare_to: str | None = field(default=None, metadata={"help": "Output dir of a reference run to compare with."})
    tiled_loss: bool = field(default=False, metadata={"help": "LM head + loss in token tiles (no full logits)."})
    tiled_mlp: str = field(default="false", metadata={"help": "Sequence-tiled MLPs: true, false or a tile count."})
    offload_activations: bool = field(
        default=False, metadata={"help": "Checkpoint every layer, saved inputs in host memory."}
    )
    tiled_layer: str = field(
        default="false", metadata={"help": "Tile whole decoder layers over the sequence: true, false or a tile count."}
    )
    long_documents: bool = field(
        default=False,
        metadata={"help": "Documents of max_length tokens cut from the vendored texts concatenated (packing: true)."},
    )
    document_repeats: int = field(default=1, metadata={"help": "long_documents: list the corpus this many times."})
    rope_parameters: str | None = field(
        default=None,
        metadata={
            "help": "Replace the model's RoPE (transformers' rope_parameters, JSON or a YAML mapping), e.g. YaRN, "
            "checked against the model's native positions and max_length; rope_theta defaults to the model's. "
            "'auto': YaRN derived from the model's config when max_length exceeds its positions."
        },
    )
    max_position_embeddings: int | None = field(
        default=None,
        metadata={"help": "With rope_parameters: the model's positions (default factor x original positions)."},
    )


def _tiles(value: bool | int | str) -> bool | int:
    """`tiled_mlp` from YAML (a bool or an int) or the command line (a string)."""
    if isinstance(value, (bool, int)):
        return value
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    return int(value)


DEFAULT_MODEL_CARD = """# Tiny random-init Llama trained by hf_longctx

Not a fine-tune of a pretrained model: a random-init Llama ({layers} layers, GPT-2 tokenizer and vocabulary)
trained for {steps} steps on public-domain Shakespeare windows of {length} tokens by `recipes/sft.py`
(hf_longctx sequence parallelism, sp_size={sp}). It exists to show that SP training equals training without it;
see `loss_curves.png` when present.
"""


def main() -> None:
    if int(os.environ.get("LOCAL_RANK", "0")) != 0:
        # Every rank prepares the dataset; one set of progress bars is enough.
        datasets.disable_progress_bars()
    # transformers' "Writing model shards" bar (one shard here) redraws over the Trainer's with a cursor-up
    # escape; the Trainer's own progress bar is unaffected.
    transformers.utils.logging.disable_progress_bar()
    lc, args = parse_recipe(TrlParser((LongContextArguments, SFTConfig)))
    flags = {
        "tiled_loss": lc.tiled_loss,
        "tiled_mlp": _tiles(lc.tiled_mlp),
        "offload_activations": lc.offload_activations,
        "tiled_layer": _tiles(lc.tiled_layer),
    }
    if lc.sp_size > 1 or any(flags.values()):
        args.parallelism_config = hf_longctx.ParallelismConfig(
            sp_size=lc.sp_size,
            sp_backend=lc.sp_backend,
            **(_ring_options(lc) if lc.sp_backend in ("ring", "hybrid", "auto") else {}),
            **flags,
        )
    if lc.model_name_or_path in (None, "tiny"):
        lc.model_name_or_path = None
        tokenizer = gpt2_tokenizer()
        shape = dict(
            num_hidden_layers=lc.tiny_layers,
            num_attention_heads=lc.tiny_heads,
            num_key_value_heads=lc.tiny_kv_heads,
            hidden_size=16 * lc.tiny_heads,  # heads of 16 dims (the default: 8 heads, hidden 128)
            max_position_embeddings=lc.tiny_positions,
            attn_implementation=lc.attn_implementation,
        )
        model = tiny_llama(tokenizer, **{**shape, **_rope(lc, args, tiny_llama_config(tokenizer, **shape))})
        train = _train_rows(tokenizer, args, lc)
        evals = (
            window_dataset(tokenizer, args.max_length, split="eval", max_windows=lc.eval_windows)
            if lc.eval_windows
            else None
        )
    else:
        tokenizer = AutoTokenizer.from_pretrained(lc.model_name_or_path)
        config = AutoConfig.from_pretrained(lc.model_name_or_path)
        for key, value in _rope(lc, args, config.get_text_config()).items():
            setattr(config.get_text_config(), key, value)
        model = AutoModelForCausalLM.from_pretrained(
            lc.model_name_or_path,
            config=config,
            attn_implementation=lc.attn_implementation,
            dtype=weights_dtype(lc.model_dtype),
        )
        train = _train_rows(tokenizer, args, lc)
        evals = None
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=train,
        eval_dataset=evals,
        processing_class=tokenizer,
        callbacks=[ThroughputCallback()],
    )
    trainer.train()
    state = sp_state(trainer)
    if state is not None and state.handles and trainer.is_world_process_zero():
        print(f"sequence parallelism: {state.handles[0].backend}")
    if evals is not None:
        trainer.evaluate()
    trainer.save_model()
    trainer.save_state()
    if lc.model_name_or_path is None and trainer.is_world_process_zero():
        # TRL's card would call the random-init model "a fine-tuned version of None".
        card = DEFAULT_MODEL_CARD.format(
            layers=lc.tiny_layers, steps=trainer.state.global_step, length=args.max_length, sp=lc.sp_size
        )
        with open(os.path.join(args.output_dir, "README.md"), "w") as f:
            f.write(card)
    if trainer.is_world_process_zero() and lc.compare_to:
        worst, steps = compare_runs(args.output_dir, lc.compare_to)
        png = plot_loss_curves(
            {f"SP={lc.sp_size}": args.output_dir, "reference (no SP)": lc.compare_to},
            os.path.join(args.output_dir, "loss_curves.png"),
        )
        print(f"loss curve vs {lc.compare_to}: max relative difference {worst:.2e} over {steps} steps (plot: {png})")


def _train_rows(tokenizer, args: SFTConfig, lc: LongContextArguments):
    """The training rows. `dataset_name`, from the command line or the YAML, wins over the recipe's `long_documents`
    (as in TRL's own scripts, the dataset named is the one trained on); without it, the shipped data."""
    if lc.dataset_name is not None:
        if args.process_index == 0:
            unused = " (long_documents: true of the recipe unused)" if lc.long_documents else ""
            print(f"training rows: the train split of dataset_name {lc.dataset_name}{unused}")
        return datasets.load_dataset(lc.dataset_name, split="train")
    if lc.long_documents:
        return _documents(tokenizer, args, lc)
    if lc.model_name_or_path is None:
        return window_dataset(tokenizer, args.max_length, max_windows=lc.max_windows)
    raise ValueError(
        f"No training data for {lc.model_name_or_path}: set dataset_name (a 'text' or 'messages' column) or "
        "long_documents: true (documents cut from the shipped texts)."
    )


def _documents(tokenizer, args: SFTConfig, lc: LongContextArguments):
    """`long_documents`: documents of `max_length` tokens from the vendored texts concatenated, one per row."""
    if not args.packing:
        raise ValueError("long_documents needs packing: true (one document of max_length tokens per row).")
    with args.main_process_first(desc="tokenizing the shipped corpus"):  # one rank writes the cache, the rest read
        rows = corpus_documents(
            tokenizer, args.max_length, repeats=lc.document_repeats, max_documents=lc.max_windows, seed=args.seed
        )
    if args.process_index == 0:
        print(f"training rows: {len(rows)} documents of {args.max_length:,} tokens from the shipped corpus")
    return rows


def _rope(lc: LongContextArguments, args: SFTConfig, config) -> dict:
    """The RoPE fields to set on the model's config ({} keeps its own), checked or derived for `max_length`."""
    rope = lc.rope_parameters
    if isinstance(rope, str) and rope != "auto":
        rope = json.loads(rope)
    # No max_length (no truncation): no row length to check a scaling against.
    plan = plan_rope(config, args.max_length or 0, rope, lc.max_position_embeddings)
    if int(os.environ.get("RANK", "0")) == 0:
        print(plan.describe())
    return plan.overrides()


def _ring_options(lc: LongContextArguments) -> dict:
    return {"ulysses_degree": lc.ulysses_degree, "ring_variant": lc.ring_variant, "ring_layout": lc.ring_layout}


if __name__ == "__main__":
    main()
