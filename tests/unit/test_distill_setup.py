"""DistillationTrainer under SP without processes: hf_longctx's tiled divergence against TRL's chunked kernel (every
beta and temperature, with the logit scale and soft-cap), TRL's logit-transform lookup, the rows each rank shards,
the config builder and the refusals by name."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from hf_longctx.distributed.groups import SequenceParallelGroups
from hf_longctx.integrations.trl import distillation, support
from hf_longctx.integrations.trl.distillation_divergence import linear_divergence_sum
from hf_longctx.integrations.trl.distillation_loss import logit_transform, shard_rows
from hf_longctx.integrations.trl.errors import UnsupportedSetup
from hf_longctx.memory.lm_head import LogitTransform

N, HS, HT, V = 37, 16, 24, 50  # tokens, student and teacher hidden sizes (they may differ), vocabulary
# (student scale, student soft-cap, teacher scale, teacher soft-cap)
TRANSFORMS = ((1.0, None, 1.0, None), (1.5, 5.0, 0.7, None), (1.0, None, 0.5, 3.0))


def _heads(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    student = [torch.randn(N, HS, generator=g), torch.randn(V, HS, generator=g), torch.randn(V, generator=g)]
    teacher = [torch.randn(N, HT, generator=g), torch.randn(V, HT, generator=g), torch.randn(V, generator=g)]
    return [t.requires_grad_() for t in student], teacher


@pytest.mark.parametrize(
    "beta, temperature, transforms",
    [(b, t, TRANSFORMS[i % 3]) for i, (b, t) in enumerate(itertools.product((0.0, 0.3, 0.5, 1.0), (0.7, 1.0, 2.0)))],
)
def test_tiled_divergence_matches_trls_kernel(beta, temperature, transforms):
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    (hs, ws, bs), (ht, wt, bt) = _heads()
    s_scale, s_cap, t_scale, t_cap = transforms
    div, ent = ChunkedDivergenceFunction.apply(
        hs, ws, bs, ht, wt, bt, beta, temperature, s_scale, s_cap, t_scale, t_cap
    )
    div.sum().backward()
    want = [t.grad.clone() for t in (hs, ws, bs)]
    for t in (hs, ws, bs):
        t.grad = None
    got_div, got_ent = linear_divergence_sum(
        hs, ws, bs, ht, wt, bt, beta,
        LogitTransform(s_scale, s_cap, temperature), LogitTransform(t_scale, t_cap, temperature),
        tile=8,  # 5 tiles, the last one partial
    )  # fmt: skip
    (2.0 * got_div).backward()  # the incoming gradient scales the gradients computed in forward
    assert got_div.item() == pytest.approx(div.sum().item(), rel=1e-5)
    assert got_ent.item() == pytest.approx(ent.sum().item(), rel=1e-5)
    assert not got_ent.requires_grad
    for grad, ref in zip((hs.grad, ws.grad, bs.grad), want, strict=True):
        assert (grad - 2.0 * ref).abs().max() <= 1e-4 * ref.abs().max()


def test_tiled_divergence_without_gradients_and_its_refusals():
    (hs, ws, bs), (ht, wt, bt) = _heads()
    with_grad = linear_divergence_sum(hs, ws, bs, ht, wt, bt, 0.5)[0]
    with torch.no_grad():
        value, _ = linear_divergence_sum(hs, ws, bs, ht, wt, bt, 0.5)
    assert not value.requires_grad and value.item() == pytest.approx(with_grad.item(), rel=1e-6)
    with pytest.raises(ValueError, match="one vocabulary"):
        linear_divergence_sum(hs, ws, bs, ht, wt[:-1], bt[:-1], 0.5)
    with pytest.raises(ValueError, match=r"beta must be in \[0, 1\]"):
        linear_divergence_sum(hs, ws, bs, ht, wt, bt, 1.5)


@pytest.mark.parametrize(
    "fields, scale, softcap",
    [
        ({}, 1.0, None),
        ({"logit_scale": 0.25, "final_logit_softcapping": 30.0}, 0.25, 30.0),  # Cohere, Gemma
        ({"output_multiplier": 2.0}, 2.0, None),
        ({"lm_head_multiplier": 3.0}, 3.0, None),  # Falcon-H1
        ({"logits_scaling": 4.0}, 0.25, None),  # Granite divides
        ({"logits_scaling": 4.0, "model_type": "hyperclovax"}, 4.0, None),  # HyperCLOVA X multiplies
        ({"logit_scale": None, "logits_scaling": 2.0}, 0.5, None),  # None: not set
    ],
)
def test_logit_transform_reads_the_config_as_trl_does(fields, scale, softcap):
    config = SimpleNamespace(**fields)
    assert logit_transform(config, 2.0) == LogitTransform(scale=scale, softcap=softcap, temperature=2.0)


def test_rows_are_rotated_to_right_padding_and_score_the_completion():
    prompt_ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]])
    completion_ids = torch.tensor([[11, 12, 13], [14, 15, 0]])
    inputs = {
        "prompt_ids": prompt_ids,
        "prompt_mask": (prompt_ids != 0).long(),
        "completion_ids": completion_ids,
        "completion_mask": torch.tensor([[1, 1, 1], [1, 1, 0]]),
        "tool_mask": torch.tensor([[1, 0, 1], [1, 1, 1]]),  # a tool result (12) is not scored
    }
    state = SimpleNamespace(groups=SequenceParallelGroups.single())
    shard = shard_rows(state, inputs, pad_token_id=0)
    assert shard["input_ids"].tolist() == [[5, 6, 11, 12, 13, 0, 0], [7, 8, 9, 10, 14, 15, 0]]
    assert shard["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 0]]
    # The positions TRL's forward gives each token: its index in the left-padded row.
    assert shard["position_ids"][:, :5].tolist() == [[2, 3, 4, 5, 6], [0, 1, 2, 3, 4]]
    # Position t scores token t + 1: every kept completion token, nothing else.
    ignore = -100
    assert shard["shift_labels"].tolist() == [
        [ignore, 11, ignore, 13, ignore, ignore, ignore],
        [ignore, ignore, ignore, 14, 15, ignore, ignore],
    ]


def test_config_builder_keeps_trls_refusal_from_seeing_sp(tmp_path):
    from trl import DistillationConfig

    import hf_longctx

    fields = {"output_dir": str(tmp_path), "report_to": [], "use_cpu": True, "bf16": False}
    plain = distillation.distillation_config(**fields)
    assert isinstance(plain, DistillationConfig) and plain.parallelism_config is None
    sp = hf_longctx.ParallelismConfig(sp_size=2)
    with pytest.raises(ValueError, match="does not support sequence-dim parallelism"):
        DistillationConfig(**fields, parallelism_config=sp)  # TRL's own refusal
    # Past TRL's check: this one process cannot hold an SP group of 2.
    with pytest.raises(ValueError, match="sp_size=2 does not divide the world size 1"):
        distillation.distillation_config(**fields, parallelism_config=sp)
    assert sp.sp_size == 2  # shown to TRL as 1 only while it checks
    upstream = hf_longctx.ParallelismConfig(sp_size=2, sp_backend="deepspeed")
    with pytest.raises(ValueError, match="needs an hf_longctx backend"):
        distillation.distillation_config(**fields, parallelism_config=upstream)


@pytest.mark.parametrize(
    "trainer, option",
    [
        (SimpleNamespace(args=SimpleNamespace(use_vllm=True, vllm_mode="server"), _is_vlm=False), "use_vllm=True"),
        (SimpleNamespace(args=SimpleNamespace(use_vllm=False), _is_vlm=True), "vision-language processor"),
    ],
)
def test_options_without_an_exact_sp_path_are_refused_by_name(trainer, option):
    with pytest.raises(UnsupportedSetup, match=option):
        distillation.check_distillation_settings(trainer)
    distillation.check_distillation_settings(SimpleNamespace(args=SimpleNamespace(use_vllm=False), _is_vlm=False))


def test_registry_supports_distillation_and_refuses_gkd_with_its_reasons():
    from trl import DistillationTrainer
    from trl.experimental.gkd import GKDTrainer

    assert support.check_trainer_class(DistillationTrainer).setup is not None
    with pytest.raises(NotImplementedError) as err:
        support.check_trainer_class(GKDTrainer)
    message = str(err.value)
    assert message.startswith("GKDTrainer is not supported") and "training_step" in message
    assert "shifts the labels inside each row" in message and "use DistillationTrainer" in message


def test_trls_gather_object_is_patched_inside_a_view_only_and_restored_by_the_last_user():
    from accelerate.utils import operations
    from trl.trainer import distillation_trainer

    from hf_longctx.integrations.trl.grpo_data_parallel import data_parallel_view

    first, second = distillation.use_module_gather_object(), distillation.use_module_gather_object()
    try:
        assert distillation_trainer.gather_object is not operations.gather_object
        assert distillation_trainer.gather_object(["a"]) == ["a"]  # outside a view: accelerate's (one process)
        trainer = SimpleNamespace(accelerator=SimpleNamespace())
        with data_parallel_view(trainer, SequenceParallelGroups.single()):
            assert distillation_trainer.gather_object(["a", "b"]) == ["a", "b"]  # over the DP group
        first()
        first()  # a second release of the same user changes nothing
        assert distillation_trainer.gather_object is not operations.gather_object
    finally:
        second()
    assert distillation_trainer.gather_object is operations.gather_object
