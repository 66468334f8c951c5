"""`ParallelismConfig` validation, `from_env`, group construction errors and a side-effect-free import."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from accelerate.parallelism_config import ParallelismConfig as AccelerateParallelismConfig
from accelerate.utils import DeepSpeedSequenceParallelConfig

import hf_longctx
from hf_longctx import ParallelismConfig, SequenceParallelGroups
from hf_longctx.distributed.groups import validate_sp_size
from tests._dist import REPO_ROOT

ENV_VARS = (
    "PARALLELISM_CONFIG_DP_REPLICATE_SIZE",
    "PARALLELISM_CONFIG_DP_SHARD_SIZE",
    "PARALLELISM_CONFIG_TP_SIZE",
    "PARALLELISM_CONFIG_CP_SIZE",
    "PARALLELISM_CONFIG_CP_BACKEND",
    "PARALLELISM_CONFIG_SP_SIZE",
    "PARALLELISM_CONFIG_SP_BACKEND",
)


@pytest.fixture(autouse=True)
def _clean_parallelism_env(monkeypatch):
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)


def test_defaults():
    config = ParallelismConfig()
    assert config.sp_size == 1
    assert config.sp_backend == "ulysses"
    assert config.sp_handler is None
    assert not config.sp_upstream
    assert isinstance(config, AccelerateParallelismConfig)
    assert (config.dp_replicate_size, config.dp_shard_size, config.tp_size, config.cp_size) == (1, 1, 1, 1)


def test_ulysses_sp_size_kept_without_deepspeed_handler():
    config = ParallelismConfig(sp_size=4)
    assert config.sp_size == 4
    assert config.sp_backend == "ulysses"
    assert config.sp_handler is None
    assert config.sp_enabled
    assert config.non_data_parallel_size == 4


@pytest.mark.parametrize("bad", [0, -1, "2", True, 2.0, None])
def test_bad_sp_size_raises_naming_sp_size(bad):
    with pytest.raises(ValueError, match="sp_size"):
        ParallelismConfig(sp_size=bad)


def test_unknown_backend_lists_valid_ones():
    with pytest.raises(ValueError, match=r"sp_backend.*\['ulysses', 'ring', 'hybrid', 'auto', 'deepspeed'\]"):
        ParallelismConfig(sp_size=2, sp_backend="ring_of_fire")


def test_deepspeed_backend_keeps_accelerate_handler():
    config = ParallelismConfig(sp_size=2, sp_backend="deepspeed")
    assert config.sp_backend == "deepspeed"
    assert config.sp_upstream
    assert isinstance(config.sp_handler, DeepSpeedSequenceParallelConfig)
    assert ParallelismConfig(sp_size=1, sp_backend="deepspeed").sp_handler is None


def test_tensor_parallel_with_ulysses_raises():
    with pytest.raises(ValueError, match="tp_size"):
        ParallelismConfig(tp_size=2, sp_size=2)
    assert ParallelismConfig(tp_size=2, sp_size=1).tp_size == 2


def test_accelerate_checks_still_run():
    with pytest.raises(ValueError, match="mutually exclusive"):
        ParallelismConfig(cp_size=2, sp_size=2)


def test_from_env_reads_sp_variables(monkeypatch):
    assert (ParallelismConfig.from_env().sp_size, ParallelismConfig.from_env().sp_backend) == (1, "ulysses")
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_SIZE", "4")
    config = ParallelismConfig.from_env()
    assert (config.sp_size, config.sp_backend, config.sp_handler) == (4, "ulysses", None)
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_BACKEND", "deepspeed")
    config = ParallelismConfig.from_env()
    assert (config.sp_size, config.sp_backend) == (4, "deepspeed")
    assert isinstance(config.sp_handler, DeepSpeedSequenceParallelConfig)


def test_constructor_ignores_sp_environment(monkeypatch):
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_SIZE", "4")
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_BACKEND", "deepspeed")
    config = ParallelismConfig()
    assert (config.sp_size, config.sp_backend) == (1, "ulysses")


def test_groups_build_without_process_group_raises():
    with pytest.raises(ValueError, match="init_process_group"):
        SequenceParallelGroups.build(2)


def test_single_groups():
    groups = SequenceParallelGroups.single()
    assert (groups.sp_rank, groups.sp_world_size, groups.dp_rank, groups.dp_world_size) == (0, 1, 0, 1)
    assert groups.sp_group is None and groups.dp_group is None
    assert not groups.sp_enabled


def test_validate_sp_size():
    with pytest.raises(ValueError, match=r"\[1, 2, 4\]"):
        validate_sp_size(3, 4)
    for bad in (0, -2, True, "2"):
        with pytest.raises(ValueError, match="sp_size"):
            validate_sp_size(bad, 4)
    validate_sp_size(2, 4)
    validate_sp_size(8, 8)


def test_public_names():
    assert sorted(hf_longctx.__all__) == [
        "IGNORE_INDEX",
        "ParallelismConfig",
        "SequenceParallelGroups",
        "SequenceParallelHandle",
        "enable_sequence_parallel",
        "sequence_parallel_loss",
        "shard_batch",
        "takes_shifted_labels",
    ]
    assert hf_longctx.IGNORE_INDEX == -100


_IMPORT_PROBE = textwrap.dedent(
    """
    import json, logging, os, sys
    import torch.distributed as dist
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    def snapshot():
        return {
            "attention": sorted(ALL_ATTENTION_FUNCTIONS.keys()),
            "attention_global": sorted(AttentionInterface._global_mapping),
            "mask": sorted(ALL_MASK_ATTENTION_FUNCTIONS.keys()),
            "mask_global": sorted(AttentionMaskInterface._global_mapping),
            "environ": dict(os.environ),
            "dist_initialized": dist.is_initialized(),
            "root_handlers": len(logging.getLogger().handlers),
        }

    before = snapshot()
    print("--- import hf_longctx ---", file=sys.stderr, flush=True)
    import hf_longctx
    after = snapshot()
    print(json.dumps({"before": before, "after": after}))
    """
)


def test_import_changes_nothing():
    proc = subprocess.run(
        [sys.executable, "-c", _IMPORT_PROBE],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.split("--- import hf_longctx ---\n", 1)[1] == "", "importing hf_longctx wrote to stderr"
    result = json.loads(proc.stdout)
    for key, before in result["before"].items():
        assert result["after"][key] == before, key


def test_deepspeed_backend_keeps_accelerate_behaviour(monkeypatch):
    from accelerate.parallelism_config import ParallelismConfig as Upstream

    import hf_longctx.integrations.trainer

    config = ParallelismConfig(sp_size=2, sp_backend="deepspeed")
    # accelerate builds no mesh for DeepSpeed SP (DeepSpeed makes its own groups) ...
    assert config.build_device_mesh("cpu") is None
    # ... and validation is accelerate's own: hf_longctx attaches nothing to the accelerator.
    calls = []
    monkeypatch.setattr(Upstream, "_validate_accelerator", lambda self, acc: calls.append("upstream"))
    monkeypatch.setattr(hf_longctx.integrations.trainer, "attach", lambda *a: calls.append("attach"))
    config._validate_accelerator(object())
    assert calls == ["upstream"]
