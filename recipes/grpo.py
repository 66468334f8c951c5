"""GRPO (TRL `GRPOTrainer`) with hf_longctx sequence parallelism on the offline tiny Llama.

    torchrun --nproc_per_node 2 recipes/grpo.py --config recipes/tiny_grpo_cpu.yaml

Prompts are short Shakespeare snippets; the toy reward counts the letter "e" in a completion. Generation
runs on the plain model on every rank; the log-prob forward and the loss run sharded over `sp_size` ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import datasets
from trl import GRPOConfig, GRPOTrainer, TrlParser

import hf_longctx
from hf_longctx.data.defaults import gpt2_tokenizer, load_corpus, tiny_llama
from hf_longctx.integrations.trainer import sp_state


@dataclass
class GRPORecipeArguments:
    sp_size: int = field(default=1, metadata={"help": "Sequence-parallel degree (1 = no SP)."})
    tiny_layers: int = field(default=2, metadata={"help": "Layers of the default tiny Llama."})
    prompts: int = field(default=16, metadata={"help": "Number of prompts cut from the corpus."})
    prompt_chars: int = field(default=48, metadata={"help": "Characters per prompt."})


def count_e(completions: list[str], **kwargs: object) -> list[float]:
    """Toy reward: how many letters "e" a completion holds."""
    return [float(str(c).count("e")) for c in completions]


def main() -> None:
    recipe, args = TrlParser((GRPORecipeArguments, GRPOConfig)).parse_args_and_config()
    if recipe.sp_size > 1:
        # Parsed without SP, so TRL's GRPOConfig check passed; `grpo_config` is the way to build one directly.
        args.parallelism_config = hf_longctx.ParallelismConfig(sp_size=recipe.sp_size)
    text = next(iter(load_corpus().values()))
    n = recipe.prompt_chars
    prompts = [{"prompt": text[i * n : (i + 1) * n]} for i in range(recipe.prompts)]
    tokenizer = gpt2_tokenizer()
    trainer = GRPOTrainer(
        model=tiny_llama(tokenizer, num_hidden_layers=recipe.tiny_layers),
        reward_funcs=count_e,
        args=args,
        train_dataset=datasets.Dataset.from_list(prompts),
        processing_class=tokenizer,
    )
    state = sp_state(trainer)
    trainer.train()
    sp = state.groups.sp_world_size if state is not None else 1
    attention = trainer.model.config._attn_implementation
    print(f"grpo recipe: {trainer.state.global_step} steps, sp={sp}, attention={attention}")


if __name__ == "__main__":
    main()
