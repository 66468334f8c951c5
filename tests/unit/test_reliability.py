"""The pure pieces of the reliability features, in one process: input checks, resume layouts, timeouts, and the
repair of DeepSpeed's ZeRO-3 universal-load optimizer state. The distributed behaviour is in
tests/dist/test_faults.py, test_resume_layout.py and test_bad_inputs.py."""

from __future__ import annotations

import datetime
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig

from hf_longctx import _compat
from hf_longctx.data import validation as V
from hf_longctx.data.sharding import shard_batch_for_rank
from hf_longctx.distributed import failures
from hf_longctx.integrations.trainer import resume as R


def _batch(bs: int = 2, sl: int = 6) -> dict[str, torch.Tensor]:
    ids = torch.arange(bs * sl).reshape(bs, sl) + 1
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


# ---- batch layout ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "shape", "message"),
    [
        ("attention_mask", (2, 5), "attention_mask has shape (2, 5) but input_ids has (2, 6)"),
        ("labels", (1, 6), "labels has shape (1, 6) but input_ids has (2, 6)"),
        ("position_ids", (2, 7), "position_ids has shape (2, 7) but input_ids has (2, 6)"),
    ],
)
def test_sequence_tensor_with_another_shape_is_named(key, shape, message):
    batch = _batch()
    batch[key] = torch.ones(shape, dtype=torch.long)
    for rank in range(2):  # pure: every SP rank raises the same error
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            shard_batch_for_rank(batch, rank, 2)


def test_shared_or_flat_position_ids_and_4d_masks_keep_their_own_rules():
    batch = _batch()
    for positions in (torch.arange(6).unsqueeze(0), torch.arange(6)):
        V.check_batch_layout({**batch, "position_ids": positions}, 2, 6)
    # A 4-D mask is refused by the right-padding check, with the packed-documents fix.
    with pytest.raises(ValueError, match="must be 2-D"):
        shard_batch_for_rank({**batch, "attention_mask": torch.ones(2, 1, 6, 6)}, 0, 2)


@pytest.mark.parametrize(("bs", "sl"), [(0, 6), (2, 0)])
def test_empty_batch_is_refused(bs, sl):
    ids = torch.ones(bs, sl, dtype=torch.long)
    with pytest.raises(ValueError, match=rf"The batch is empty \({bs} rows x {sl} tokens\)"):
        shard_batch_for_rank({"input_ids": ids}, 0, 2)


# ---- token ids and positions -------------------------------------------------------------------


def test_shard_summary_ignores_the_padding_added_for_sp():
    ids = torch.tensor([[5, 9, 3, 0]])
    positions = torch.tensor([[0, 1, 2, 3]])
    mask = torch.tensor([[1, 1, 1, 0]])
    assert V.shard_summary(ids, positions, mask).tolist() == [0, 9, 2]
    assert V.shard_summary(ids, positions).tolist() == [0, 9, 3]
    assert V.shard_summary(None, positions, torch.zeros_like(mask)).tolist() == [0, -1, -1]


def test_token_ids_outside_the_embedding_are_named_with_their_rank():
    limits = V.ModelLimits(vocab_rows=128, max_positions=None, model_name="Tiny")
    V.check_token_ids([[0, 127, 5], [0, -1, -1]], limits)  # rank 1 holds no ids
    with pytest.raises(ValueError, match=r"token id 128 \(in SP rank 1's shard\).*Tiny \(128 embedding rows"):
        V.check_token_ids([[3, 100, 5], [1, 128, 9]], limits)
    with pytest.raises(ValueError, match=r"token id -100 \(in SP rank 0's shard\)"):
        V.check_token_ids([[-100, 100, 5], [1, 12, 9]], limits)


def test_positions_reaching_the_limit_are_refused():
    limits = V.ModelLimits(vocab_rows=None, max_positions=16, model_name="Tiny")
    V.check_positions([[0, 1, 15], [0, 1, 3]], limits)
    with pytest.raises(ValueError, match="reaches position 16, but Tiny supports 16 positions"):
        V.check_positions([[0, 1, 15], [0, 1, 16]], limits)


@pytest.mark.parametrize(
    ("rope", "max_positions", "limit"),
    [
        (None, 4096, 4096),
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}, 4096, 16384),
        (
            {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}
            | {"low_freq_factor": 1.0, "high_freq_factor": 4.0},
            131072,
            131072,
        ),
        ({"rope_type": "dynamic", "factor": 2.0}, 4096, None),
    ],
)
def test_position_limit_follows_rope_scaling(rope, max_positions, limit):
    config = LlamaConfig(max_position_embeddings=max_positions, rope_scaling=rope)
    assert V.position_limit(config) == limit


def test_position_limit_takes_the_largest_per_layer_type():
    config = SimpleNamespace(
        max_position_embeddings=1024,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "original_max_position_embeddings": 1024},
            "sliding_attention": {"rope_type": "default"},
        },
    )
    assert V.position_limit(config) == 8192


def test_empty_loader_is_refused_but_an_iterable_one_is_not_checked():
    with pytest.raises(ValueError, match=r"yields no batch: its dataset has 0 rows \(batch size 2"):
        V.check_loader_not_empty(torch.utils.data.DataLoader([], batch_size=2))
    with pytest.raises(ValueError, match="dataset has 3 rows .*drop_last=True"):
        V.check_loader_not_empty(torch.utils.data.DataLoader([1, 2, 3], batch_size=4, drop_last=True))

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter([])

    V.check_loader_not_empty(torch.utils.data.DataLoader(Stream(), batch_size=2))


# ---- resume layouts ----------------------------------------------------------------------------


def _layout(sp: int, world: int, per_device: int, ga: int) -> dict[str, int]:
    args = SimpleNamespace(
        parallelism_config=SimpleNamespace(sp_size=sp),
        world_size=world,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=ga,
    )
    return R.current_layout(args)


def test_changing_sp_alone_keeps_the_global_batch():
    saved = _layout(sp=2, world=2, per_device=2, ga=2)
    assert saved["global_batch_size"] == 4 and saved["dp_size"] == 1
    for sp, world in ((4, 4), (1, 1), (8, 8)):
        R.check_resume_layout(saved, _layout(sp=sp, world=world, per_device=2, ga=2))


@pytest.mark.parametrize(
    ("current", "fix"),
    [
        ((2, 4, 2, 2), "set gradient_accumulation_steps=1 or per_device_train_batch_size=1"),
        ((2, 8, 2, 2), "launch a world size whose DP size (world / sp_size) divides 4"),
        ((2, 4, 4, 1), "set per_device_train_batch_size=2"),
    ],
)
def test_changing_the_global_batch_is_refused_with_the_setting_that_keeps_it(current, fix):
    saved = _layout(sp=2, world=2, per_device=2, ga=2)
    sp, world, per_device, ga = current
    with pytest.raises(ValueError, match="trained with a global batch of 4 sequences") as info:
        R.check_resume_layout(saved, _layout(sp=sp, world=world, per_device=per_device, ga=ga))
    assert fix in str(info.value)
    assert "Changing sp_size alone needs no change" in str(info.value)


def test_layout_callback_checks_the_layout_saved_in_the_checkpoint():
    callback = R.SequenceParallelLayout()
    args = SimpleNamespace(
        parallelism_config=SimpleNamespace(sp_size=2),
        world_size=4,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
    )
    fresh = SimpleNamespace(stateful_callbacks={"SequenceParallelLayout": callback.state()})
    callback.on_train_begin(args, fresh, None)  # a fresh run: nothing saved yet
    assert callback.state()["attributes"]["layout"]["global_batch_size"] == 8
    saved = {"SequenceParallelLayout": {"args": {}, "attributes": {"layout": _layout(2, 2, 2, 2)}}}
    with pytest.raises(ValueError, match="global batch of 4 sequences.*this run has 8"):
        R.SequenceParallelLayout().on_train_begin(args, SimpleNamespace(stateful_callbacks=saved), None)


# ---- timeouts and DeepSpeed's universal load ------------------------------------------------------


def test_timeouts_resolve_to_timedeltas():
    assert failures.resolve_timeout(90) == datetime.timedelta(seconds=90)
    assert failures.resolve_timeout(datetime.timedelta(minutes=2)) == datetime.timedelta(minutes=2)
    assert failures.resolve_timeout(None) is None  # no process group here: torch's default applies
    with pytest.raises(ValueError, match="timeout must be > 0"):
        failures.resolve_timeout(0)


def test_a_failure_without_a_group_is_not_rewritten():
    with pytest.raises(RuntimeError, match="^boom$"):
        with failures.collective_failure("all_to_all", None):
            raise RuntimeError("boom")


def _adamw_steps(alias: bool, untie: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(3))]
    opt = torch.optim.AdamW([{"params": [params[0]]}, {"params": [params[1]]}], lr=0.1)
    for step in range(3):
        for p in params:
            p.grad = torch.full_like(p, float(step + 1))
        opt.step()
        if step == 0 and alias:
            # What DeepSpeed's ZeRO-3 universal loader leaves: one step tensor in every partition's state.
            opt.state[params[1]]["step"] = opt.state[params[0]]["step"]
            if untie:
                assert _compat.untie_optimizer_steps(SimpleNamespace(optimizer=opt)) == 1
    return [p.detach().clone() for p in params]


def test_untied_optimizer_steps_restore_the_adamw_update():
    reference = _adamw_steps(alias=False, untie=False)
    repaired = _adamw_steps(alias=True, untie=True)
    broken = _adamw_steps(alias=True, untie=False)
    assert all(torch.equal(a, b) for a, b in zip(repaired, reference, strict=True))
    assert not torch.equal(broken[1], reference[1])  # the aliased step really changes the update


def test_every_recipe_bounds_a_hang_below_the_default_timeout():
    from pathlib import Path

    import yaml

    recipes = sorted((Path(__file__).resolve().parents[2] / "recipes").glob("*.yaml"))
    assert recipes
    for path in recipes:
        timeout = yaml.safe_load(path.read_text()).get("ddp_timeout")
        # TrainingArguments' default is 1800 s; NCCL's own 600 s. The recipes choose theirs explicitly.
        assert isinstance(timeout, int) and 60 <= timeout < 1800, (path.name, timeout)


# ---- the README's reliability table (scripts/reliability_table.py) ----------------------------------------------


def _table_script():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "reliability_table.py"
    spec = importlib.util.spec_from_file_location("reliability_table", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reliability_outcomes_are_rendered_from_what_the_tests_recorded():
    table = _table_script()
    kill = "test_killed_rank_ends_every_survivor_fast_with_a_peer_failure[sp2-forward]"
    observed = {"exit_codes": [1], "survivors": 1, "peer_failures": ["Connection closed by peer"]}
    props = {
        kill: {"failed": False, "seconds_to_exit": {0: 0.1}, "outcome": {**observed, "rank0_names": "MEASURED-NAME"}},
        "test_frozen_rank_ends_its_peer_after_the_timeout": {"failed": True, "seconds_to_error": 3.0},
        "test_checkpoint_from_sp2_resumes_at_another_sp_size[sp4_world4-ddp]": {"failed": False, "max_rel_diff": 4e-7},
        "test_window_without_labels_gives_zero_loss_and_gradients": {"failed": False},
    }
    outcomes = {fault: outcome for fault, outcome, _, _ in table.rows(props)}
    first = outcomes["SIGKILL rank 1 in the forward of step 3, SP=2 (world 2)"]
    assert "MEASURED-NAME" in first and "`Connection closed by peer`" in first and "exit with code 1" in first
    assert outcomes["SIGSTOP rank 1 in the forward (a hang), SP=2, `ddp_timeout=3`"].startswith("**FAILED**")
    assert outcomes["SIGKILL rank 1 in the backward of step 3, SP=2 (world 2)"] == "not run"
    assert "4.0e-07" in next(v for k, v in outcomes.items() if k.endswith("(DDP)"))
    assert outcomes["a gradient-accumulation window without any label"].startswith("not measured")


def test_reliability_table_rerenders_from_its_json(tmp_path, capsys):
    import json

    table = _table_script()
    case = {"failed": False, "outcome": {"ranks_refused": 4, "error": "ValueError: MEASURED"}}
    saved = tmp_path / "2026-01-01-reliability.json"
    saved.write_text(
        json.dumps({"tests": {"test_resume_that_changes_the_global_batch_is_refused_on_every_rank": case}})
    )
    assert table.main(["--from-json", str(saved)]) == 0
    text = (tmp_path / "2026-01-01-reliability.md").read_text()
    assert "refused on all 4 ranks: `ValueError: MEASURED...`" in text
