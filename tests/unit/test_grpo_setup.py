"""GRPO under SP without processes: generation sizes per data-parallel rank, the refusals by name, and the
data-parallel view (the accelerator stand-in, TRL's module-level gathers patched only inside a view)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hf_longctx.distributed.groups import SequenceParallelGroups
from hf_longctx.integrations.trl import grpo
from hf_longctx.integrations.trl import grpo_data_parallel as view


def _args(**overrides):
    fields = dict(
        per_device_train_batch_size=2,
        gradient_accumulation_steps=3,
        num_generations=2,
        num_generations_eval=None,
        per_device_eval_batch_size=1,
        do_eval=False,
        eval_strategy="no",
        use_vllm=False,
    )
    return SimpleNamespace(**{**fields, **overrides})


@pytest.mark.parametrize(
    "dp, gbs, steps, expected",
    [
        (1, None, None, (6, 3)),  # TRL's default: one generation per optimizer step
        (2, None, None, (12, 3)),
        (2, None, 1, (4, 1)),
        (1, 8, None, (8, 4)),
        (2, 8, None, (8, 2)),
    ],
)
def test_sizes_count_data_parallel_ranks(dp, gbs, steps, expected):
    assert grpo.data_parallel_sizes(_args(), dp, gbs, steps) == expected


def test_sizes_refuse_a_batch_that_does_not_split_over_the_dp_ranks():
    with pytest.raises(
        ValueError, match=r"generation_batch_size \(6\) must be divisible by the global batch size \(4\)"
    ):
        grpo.data_parallel_sizes(_args(), 2, 6, None)
    with pytest.raises(ValueError, match="can not be both configured"):
        grpo.data_parallel_sizes(_args(), 1, 4, 2)


def test_a_config_sized_by_every_process_is_refused_naming_grpo_config():
    # What GRPOConfig derives on 2 processes at SP=2 (one DP rank): every process counted as a DP rank.
    args = _args(generation_batch_size=2 * 2 * 3, steps_per_generation=3)
    with pytest.raises(ValueError, match=r"does not count the 1 data-parallel rank.*grpo\.grpo_config"):
        grpo.check_generation_sizes(args, dp=1)
    grpo.check_generation_sizes(_args(generation_batch_size=6, steps_per_generation=3), dp=1)


def test_partial_prompt_groups_are_refused():
    with pytest.raises(ValueError, match=r"generation_batch_size \(3\) must be divisible by num_generations \(2\)"):
        grpo.check_generation_sizes(
            _args(per_device_train_batch_size=1, generation_batch_size=3, steps_per_generation=3), 1
        )
    evaluating = _args(generation_batch_size=6, steps_per_generation=3, do_eval=True, eval_strategy="steps")
    with pytest.raises(ValueError, match=r"global eval batch size \(1 \* 1 data-parallel"):
        grpo.check_generation_sizes(evaluating, 1)
    evaluating.generation_batch_size = 12
    grpo.check_generation_sizes(evaluating, 2)  # 1 x 2 DP ranks hold whole groups of 2


@pytest.mark.parametrize(
    "trainer, option",
    [
        (SimpleNamespace(args=_args(use_vllm=True), rollout_func=None), "use_vllm=False"),
        (SimpleNamespace(args=_args(), rollout_func=lambda prompts, trainer: {}), "rollout_func=None"),
    ],
)
def test_options_without_an_exact_sp_path_are_refused_by_name(trainer, option):
    trainer.args.generation_batch_size, trainer.args.steps_per_generation = 6, 3
    with pytest.raises(ValueError, match=option):
        grpo.check_grpo_settings(trainer, dp=1)


def test_the_accelerator_view_counts_dp_ranks_and_forwards_the_rest():
    groups = SequenceParallelGroups.single()
    done = SimpleNamespace(end_of_dataloader=False, remainder=0)
    accelerator = SimpleNamespace(num_processes=4, process_index=3, device=torch.device("cpu"), gradient_state=done)
    seen = view.DataParallelAccelerator(accelerator, groups)
    assert (seen.num_processes, seen.process_index, seen.device) == (1, 0, torch.device("cpu"))
    seen.flag = True  # set on the accelerator itself
    assert accelerator.flag is True
    gathered = seen.gather({"a": torch.tensor(2.0), "b": [torch.ones(2, 3)]})
    assert gathered["a"].shape == (1,) and gathered["b"][0].shape == (2, 3)
    assert torch.equal(seen.reduce(torch.tensor([2, 4]), reduction="sum"), torch.tensor([2, 4]))
    assert torch.equal(seen.reduce(torch.tensor([2.0, 4.0]), reduction="mean"), torch.tensor([2.0, 4.0]))
    # Values inside the view are whole on every SP rank: gathered once per DP rank, never summed over SP.
    assert torch.equal(seen.gather_for_metrics(torch.tensor([3.0])), torch.tensor([3.0]))
    assert view.dp_gather_object([{"p": 1}, {"p": 2}], groups) == [{"p": 1}, {"p": 2}]


def test_the_view_is_entered_once_and_always_left():
    groups = SequenceParallelGroups.single()
    accelerator = SimpleNamespace(num_processes=2, process_index=1)
    trainer = SimpleNamespace(accelerator=accelerator)
    with pytest.raises(RuntimeError):
        with view.data_parallel_view(trainer, groups):
            outer = trainer.accelerator
            with view.data_parallel_view(trainer, groups):
                assert trainer.accelerator is outer  # nested: the same view
            assert trainer.accelerator.num_processes == 1
            raise RuntimeError
    assert trainer.accelerator is accelerator


def test_module_gathers_act_only_inside_a_view_and_are_restored_by_the_last_user():
    from trl.trainer import grpo_trainer

    originals = grpo_trainer.gather, grpo_trainer.gather_object
    first, second = view.use_module_gathers(), view.use_module_gathers()
    try:
        assert grpo_trainer.gather is not originals[0]
        x = torch.tensor([1.0, 2.0])
        assert grpo_trainer.gather(x) is x  # outside a view: accelerate's own (no process group: unchanged)
        trainer = SimpleNamespace(accelerator=SimpleNamespace())
        with view.data_parallel_view(trainer, SequenceParallelGroups.single()):
            inside = grpo_trainer.gather(torch.tensor(3.0))
        assert inside.shape == (1,)  # the DP gather: a 0-d value becomes one entry per DP rank
        first()
        first()  # a second release of the same user changes nothing
        assert grpo_trainer.gather is not originals[0]
    finally:
        second()
    assert (grpo_trainer.gather, grpo_trainer.gather_object) == originals
