"""RLOO (and GRPO) under SP without processes: the config builder without SP, the refusals by name shared by both
online trainers, and TRL's module-level gathers patched per trainer module."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from hf_longctx.distributed.groups import SequenceParallelGroups
from hf_longctx.integrations.trl import grpo_data_parallel as view
from hf_longctx.integrations.trl import online, rloo


def _trainer(**args):
    fields = dict(
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        generation_batch_size=2,
        steps_per_generation=1,
        num_generations=2,
        num_generations_eval=None,
        per_device_eval_batch_size=1,
        do_eval=False,
        eval_strategy="no",
        use_vllm=False,
        use_transformers_continuous_batching=False,
    )
    return SimpleNamespace(args=SimpleNamespace(**{**fields, **args}), rollout_func=None, _is_vlm=False)


def test_rloo_config_without_sp_is_trls_config(tmp_path):
    from trl import RLOOConfig

    fields = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[], per_device_train_batch_size=2, beta=0.0)
    args = rloo.rloo_config(**fields, gradient_accumulation_steps=3)
    assert isinstance(args, RLOOConfig)
    assert (args.generation_batch_size, args.steps_per_generation) == (6, 3)  # as TRL derives them on 1 process


@pytest.mark.parametrize("kind", [online.GRPO, online.RLOO], ids=["grpo", "rloo"])
@pytest.mark.parametrize(
    "change, option",
    [
        ({"use_vllm": True}, "use_vllm=False"),
        ({"use_transformers_continuous_batching": True}, "use_transformers_continuous_batching=False"),
        ({"rollout_func": lambda prompts, trainer: {}}, "rollout_func=None"),
        ({"_is_vlm": True, "processing_class": SimpleNamespace()}, "processing_class is a processor.*sp_size=1"),
        # A config sized by every process (here: 2 DP ranks counted at dp=1): its builder is named.
        ({"generation_batch_size": 4}, "build the config with {builder}"),
    ],
)
def test_options_without_an_exact_sp_path_are_refused_by_name(kind, change, option):
    trainer = _trainer()
    for key, value in change.items():
        setattr(trainer.args if hasattr(trainer.args, key) else trainer, key, value)
    with pytest.raises(ValueError, match=option.format(builder=re.escape(kind.builder))) as err:
        online.check_online_settings(trainer, 1, kind)
    assert kind.name in str(err.value) or kind.builder in str(err.value)
    online.check_online_settings(_trainer(), 1, kind)  # the same trainer without the option passes


def test_module_gathers_are_patched_per_trainer_module():
    from trl.trainer import grpo_trainer, rloo_trainer

    originals = {m: (m.gather, m.gather_object) for m in (grpo_trainer, rloo_trainer)}
    release = view.use_module_gathers("trl.trainer.rloo_trainer")
    try:
        assert rloo_trainer.gather is not originals[rloo_trainer][0]
        assert (grpo_trainer.gather, grpo_trainer.gather_object) == originals[grpo_trainer]  # GRPO's untouched
        trainer = SimpleNamespace(accelerator=SimpleNamespace())
        with view.data_parallel_view(trainer, SequenceParallelGroups.single()):
            assert rloo_trainer.gather(torch.tensor(3.0)).shape == (1,)  # the DP gather
            assert rloo_trainer.gather_object(["a"]) == ["a"]
    finally:
        release()
    assert (rloo_trainer.gather, rloo_trainer.gather_object) == originals[rloo_trainer]
