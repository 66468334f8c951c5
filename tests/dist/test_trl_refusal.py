"""TRL trainers without an exact SP path fail inside `Trainer(...)` with an error naming them (SP=2, gloo)."""

from __future__ import annotations

import pytest

from hf_longctx.integrations.trl.support import REGISTRY
from tests._dist import run_distributed
from tests.dist import _trl_jobs as J

# The trainers `refusal_worker` builds, while the registry refuses them.
REFUSED_HERE = tuple(name for name in ("CPOTrainer",) if not REGISTRY[name].supported)


@pytest.fixture(scope="module")
def errors(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_distributed(J.refusal_worker, 2, str(tmp_path_factory.mktemp("refusal")), timeout=300)


@pytest.mark.parametrize("name", REFUSED_HERE)
def test_trl_trainer_without_exact_sp_path_is_refused_at_construction(name, errors):
    for rank_errors in errors:
        message = rank_errors[name]
        assert message is not None, f"{name} was constructed under SP=2"
        assert message.startswith(f"{name} is not supported with hf_longctx sequence parallelism"), message
        assert "SFTTrainer" in message
