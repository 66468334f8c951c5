r"""Reward model (TRL `RewardTrainer`, sequence classification) with hf_longctx sequence parallelism.

    torchrun --nproc_per_node 2 recipes/reward.py --config recipes/tiny_reward_cpu.yaml
    accelerate launch --config_file configs/zero3_sp8.yaml --num_processes 4 \
        recipes/reward.py --config recipes/qwen3_4b_reward_32k_sp4.yaml

With `model_name_or_path` unset it trains a score head on the offline tiny Llama (GPT-2 tokenizer) over the
toy Shakespeare pairs of `recipes/dpo.py` (chosen: a passage's true continuation; rejected: a passage from
elsewhere). Each chosen and rejected row is sharded over `sp_size` ranks; the score is read at the row's
last real token, on whichever rank holds it, with one small collective.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import datasets
import torch
from _parse import parse_recipe
from _weights import model_dtype_field, weights_dtype  # this folder: the recipes run as scripts
from dpo import shakespeare_pairs  # the toy pairs of the DPO recipe
from transformers import AutoModelForSequenceClassification, AutoTokenizer, LlamaForSequenceClassification
from trl import RewardConfig, RewardTrainer, TrlParser

import hf_longctx
from hf_longctx.data.defaults import gpt2_tokenizer, tiny_llama_config
from hf_longctx.integrations.trainer import sp_state


@dataclass
class RewardRecipeArguments:
    sp_size: int = field(default=1, metadata={"help": "Sequence-parallel degree (1 = no SP)."})
    sp_backend: str = field(default="ulysses", metadata={"help": "ulysses, ring, hybrid or auto."})
    model_name_or_path: str | None = field(default=None, metadata={"help": "Model to tune; unset = tiny Llama."})
    model_dtype: str = model_dtype_field()
    dataset_name: str | None = field(
        default=None, metadata={"help": "HF dataset with chosen / rejected; unset = Shakespeare pairs."}
    )
    tiny_layers: int = field(default=2, metadata={"help": "Layers of the default tiny Llama."})
    pairs: int = field(default=16, metadata={"help": "Toy pairs cut from the corpus."})
    prompt_chars: int = field(default=400, metadata={"help": "Characters per toy prompt."})
    completion_chars: int = field(default=200, metadata={"help": "Characters per toy chosen completion."})


def main() -> None:
    recipe, args = parse_recipe(TrlParser((RewardRecipeArguments, RewardConfig)))
    if recipe.sp_size > 1:
        args.parallelism_config = hf_longctx.ParallelismConfig(sp_size=recipe.sp_size, sp_backend=recipe.sp_backend)
    if recipe.model_name_or_path is None:
        tokenizer = gpt2_tokenizer()
        config = tiny_llama_config(tokenizer, num_hidden_layers=recipe.tiny_layers, num_labels=1)
        torch.manual_seed(0)
        model = LlamaForSequenceClassification(config)
    else:
        tokenizer = AutoTokenizer.from_pretrained(recipe.model_name_or_path)
        model = AutoModelForSequenceClassification.from_pretrained(
            recipe.model_name_or_path, num_labels=1, dtype=weights_dtype(recipe.model_dtype)
        )
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    if recipe.dataset_name is None:
        train = shakespeare_pairs(recipe.pairs, recipe.prompt_chars, recipe.completion_chars)
    else:
        train = datasets.load_dataset(recipe.dataset_name, split="train")
    trainer = RewardTrainer(model=model, args=args, train_dataset=train, processing_class=tokenizer)
    state = sp_state(trainer)
    trainer.train()
    sp = state.groups.sp_world_size if state is not None else 1
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    # One write per line: the ranks print at the same time.
    print(f"reward recipe: {trainer.state.global_step} steps, sp={sp}, losses={losses}\n", end="")


if __name__ == "__main__":
    main()
