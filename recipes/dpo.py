r"""DPO (TRL `DPOTrainer`) with hf_longctx sequence parallelism.

    torchrun --nproc_per_node 2 recipes/dpo.py --config recipes/tiny_dpo_cpu.yaml
    accelerate launch --config_file configs/zero3_sp8.yaml --num_processes 4 \
        recipes/dpo.py --config recipes/qwen3_4b_dpo_32k_sp4.yaml

With `model_name_or_path` unset it trains the offline tiny Llama (GPT-2 tokenizer) on toy pairs cut from the
vendored Shakespeare: the prompt is a passage, the chosen completion its true continuation, the rejected one a
passage from elsewhere (of another length). `lora_r > 0` trains a LoRA adapter (the reference is the model
with the adapter disabled, no copy); otherwise a second copy of the initial model is the reference. Each
pair's chosen and rejected rows are sharded over `sp_size` ranks; their log-probabilities are summed over
the SP group before the loss.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import datasets
from _parse import parse_recipe
from _weights import model_dtype_field, weights_dtype  # this folder: the recipes run as scripts
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import DPOConfig, DPOTrainer, TrlParser

import hf_longctx
from hf_longctx.data.defaults import gpt2_tokenizer, load_corpus, tiny_llama
from hf_longctx.integrations.trainer import sp_state


@dataclass
class DPORecipeArguments:
    sp_size: int = field(default=1, metadata={"help": "Sequence-parallel degree (1 = no SP)."})
    sp_backend: str = field(default="ulysses", metadata={"help": "ulysses, ring, hybrid or auto."})
    tiled_loss: bool = field(default=False, metadata={"help": "LM head + log-probs in token tiles (no full logits)."})
    model_name_or_path: str | None = field(default=None, metadata={"help": "Model to tune; unset = tiny Llama."})
    dataset_name: str | None = field(
        default=None, metadata={"help": "HF dataset with prompt / chosen / rejected; unset = Shakespeare pairs."}
    )
    model_dtype: str = model_dtype_field()
    lora_r: int = field(default=0, metadata={"help": "LoRA rank (0 = full fine-tuning with a reference copy)."})
    tiny_layers: int = field(default=2, metadata={"help": "Layers of the default tiny Llama."})
    pairs: int = field(default=16, metadata={"help": "Toy pairs cut from the corpus."})
    prompt_chars: int = field(default=400, metadata={"help": "Characters per toy prompt."})
    completion_chars: int = field(default=200, metadata={"help": "Characters per toy chosen completion."})


def shakespeare_pairs(n: int, prompt_chars: int, completion_chars: int) -> datasets.Dataset:
    """Toy preference pairs: chosen = the passage's true continuation, rejected = 3/4 as long, from far away."""
    text = next(iter(load_corpus().values()))
    step = prompt_chars + completion_chars
    rejected_chars = completion_chars * 3 // 4
    rows = []
    for i in range(n):
        start, other = i * step, (i + n // 2 + 1) * step % max(len(text) - step, 1)
        rows.append(
            {
                "prompt": text[start : start + prompt_chars],
                "chosen": text[start + prompt_chars : start + step],
                "rejected": text[other : other + rejected_chars],
            }
        )
    return datasets.Dataset.from_list(rows)


def main() -> None:
    recipe, args = parse_recipe(TrlParser((DPORecipeArguments, DPOConfig)))
    if recipe.sp_size > 1 or recipe.tiled_loss:
        args.parallelism_config = hf_longctx.ParallelismConfig(
            sp_size=recipe.sp_size, sp_backend=recipe.sp_backend, tiled_loss=recipe.tiled_loss
        )
    if recipe.model_name_or_path is None:
        tokenizer = gpt2_tokenizer()
        model = tiny_llama(tokenizer, num_hidden_layers=recipe.tiny_layers)
        reference = tiny_llama(tokenizer, num_hidden_layers=recipe.tiny_layers) if recipe.lora_r == 0 else None
    else:
        tokenizer = AutoTokenizer.from_pretrained(recipe.model_name_or_path)
        model = AutoModelForCausalLM.from_pretrained(recipe.model_name_or_path, dtype=weights_dtype(recipe.model_dtype))
        reference = None  # TRL loads its own copy (full fine-tuning) or disables the adapter (LoRA)
    if recipe.dataset_name is None:
        train = shakespeare_pairs(recipe.pairs, recipe.prompt_chars, recipe.completion_chars)
    else:
        train = datasets.load_dataset(recipe.dataset_name, split="train")
    peft_config = None
    if recipe.lora_r > 0:
        from peft import LoraConfig

        peft_config = LoraConfig(r=recipe.lora_r, lora_alpha=2 * recipe.lora_r, target_modules="all-linear")
    trainer = DPOTrainer(
        model=model,
        ref_model=reference,
        args=args,
        train_dataset=train,
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    state = sp_state(trainer)
    trainer.train()
    sp = state.groups.sp_world_size if state is not None else 1
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    attention = trainer.accelerator.unwrap_model(trainer.model).config._attn_implementation
    # One write per line: the ranks print at the same time.
    print(f"dpo recipe: {trainer.state.global_step} steps, sp={sp}, attention={attention}, losses={losses}\n", end="")


if __name__ == "__main__":
    main()
