r"""GRPO (TRL `GRPOTrainer`) with hf_longctx sequence parallelism on the offline tiny Llama.

    torchrun --nproc_per_node 2 recipes/grpo.py --config recipes/tiny_grpo_cpu.yaml
    accelerate launch --config_file configs/ddp_sp4.yaml \
        recipes/grpo.py --config recipes/qwen3_4b_grpo_sp4.yaml   # GPU template

Prompts are Shakespeare snippets (or a dataset's `prompt` column); the toy reward counts the letter "e" in a
completion. Generation runs on the plain model on every rank; the log-prob forward and the loss run sharded over
`sp_size` ranks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import datasets
from _parse import parse_recipe
from _weights import model_dtype_field, weights_dtype  # this folder: the recipes run as scripts
from trl import GRPOConfig, GRPOTrainer, TrlParser

import hf_longctx
from hf_longctx.data.defaults import gpt2_tokenizer, load_corpus, tiny_llama
from hf_longctx.integrations.trainer import sp_state
from hf_longctx.integrations.trl.grpo import grpo_config


@dataclass
class GRPORecipeArguments:
    sp_size: int = field(default=1, metadata={"help": "Sequence-parallel degree (1 = no SP)."})
    tiny_layers: int = field(default=2, metadata={"help": "Layers of the default tiny Llama."})
    prompts: int = field(default=16, metadata={"help": "Number of prompts cut from the corpus."})
    prompt_chars: int = field(default=48, metadata={"help": "Characters per prompt."})
    model_name_or_path: str | None = field(default=None, metadata={"help": "Model to tune; unset = tiny Llama."})
    model_dtype: str = model_dtype_field()
    dataset_name: str | None = field(default=None, metadata={"help": "HF dataset with a prompt column."})


def count_e(completions: list[str], **kwargs: object) -> list[float]:
    """Toy reward: how many letters "e" a completion holds."""
    return [float(str(c).count("e")) for c in completions]


def parse_args() -> tuple[GRPORecipeArguments, GRPOConfig]:
    """The recipe's arguments and the GRPOConfig. With sp_size > 1 the config is built again by `grpo_config`
    from the same parsed values: TRL's own refuses SP and sizes the generation batch counting every process as
    a data-parallel rank, while the SP ranks of a group share their prompts."""
    parser = TrlParser((GRPORecipeArguments, GRPOConfig))
    recipe, args = parse_recipe(parser)
    if recipe.sp_size == 1:
        return recipe, args
    # parse_args_and_config made the YAML values the parser's defaults: this namespace is what GRPOConfig was given.
    namespace, _ = parser.parse_known_args()
    names = [f.name for f in dataclasses.fields(GRPOConfig) if f.init and hasattr(namespace, f.name)]
    values = {name: getattr(namespace, name) for name in names}
    values["parallelism_config"] = hf_longctx.ParallelismConfig(sp_size=recipe.sp_size)
    return recipe, grpo_config(**values)


def main() -> None:
    recipe, args = parse_args()
    if recipe.dataset_name is None:
        text = next(iter(load_corpus().values()))
        n = recipe.prompt_chars
        prompts = datasets.Dataset.from_list([{"prompt": text[i * n : (i + 1) * n]} for i in range(recipe.prompts)])
    else:
        prompts = datasets.load_dataset(recipe.dataset_name, split="train")
    if recipe.model_name_or_path is None:
        tokenizer = gpt2_tokenizer()
        model = tiny_llama(tokenizer, num_hidden_layers=recipe.tiny_layers)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(recipe.model_name_or_path)
        model = AutoModelForCausalLM.from_pretrained(recipe.model_name_or_path, dtype=weights_dtype(recipe.model_dtype))
    trainer = GRPOTrainer(
        model=model, reward_funcs=count_e, args=args, train_dataset=prompts, processing_class=tokenizer
    )
    state = sp_state(trainer)
    trainer.train()
    sp = state.groups.sp_world_size if state is not None else 1
    attention = trainer.model.config._attn_implementation
    print(f"grpo recipe: {trainer.state.global_step} steps, sp={sp}, attention={attention}")


if __name__ == "__main__":
    main()
