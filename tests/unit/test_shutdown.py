"""Exit-time shutdown of torch.distributed is bounded: a destroy that blocks (NCCL after a peer died) is
given up after the deadline and the groups are aborted; after a failed collective they are aborted at once."""

from __future__ import annotations

import logging
import threading

import pytest
import torch.distributed as dist

from hf_longctx import _compat
from hf_longctx.distributed import failures
from hf_longctx.integrations.trainer import accelerator

# A shutdown that waited for the blocked destroy instead of giving up after its deadline (0.2 s here) would
# hang the test; the destroy returns after this long instead, and records that it did, so the test fails.
UNBLOCK_S = 60.0


@pytest.fixture
def fake_group(monkeypatch):
    """A 'process group' whose destroy blocks until the test ends; records destroy, its return and abort."""
    release = threading.Event()
    calls: list[str] = []

    def destroy(group=None):
        calls.append("destroy")
        release.wait(UNBLOCK_S)
        calls.append("destroy returned")

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", destroy)
    monkeypatch.setattr(_compat, "abort_process_groups", lambda: calls.append("abort"))
    monkeypatch.setattr(failures, "_FAILED", [], raising=False)
    monkeypatch.setattr(failures, "SHUTDOWN_DEADLINE_S", 0.2, raising=False)
    yield calls
    release.set()


def test_blocking_destroy_is_bounded_then_aborted(fake_group, caplog):
    with caplog.at_level(logging.WARNING, logger=failures.__name__):
        assert failures.shutdown_process_groups() is True
    # Returned while destroy was still blocked (no "destroy returned"), then aborted the groups.
    assert fake_group == ["destroy", "abort"]
    assert "destroy of the process groups did not return within 0.2 s" in caplog.text


def test_after_a_failed_collective_groups_are_aborted_without_destroy(fake_group, monkeypatch, caplog):
    monkeypatch.setattr(failures, "_describe", lambda group: ([0, 1], "900 s"))
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    with pytest.raises(failures.CollectiveError):
        with failures.collective_failure("all_to_all", object()):
            raise RuntimeError("Connection closed by peer")
    with caplog.at_level(logging.WARNING, logger=failures.__name__):
        assert failures.shutdown_process_groups() is True
    assert fake_group == ["abort"]
    assert "all_to_all failed on this rank; aborting" in caplog.text


def test_abort_that_fails_too_still_returns(fake_group, monkeypatch, caplog):
    def abort():
        raise RuntimeError("no abort here")

    monkeypatch.setattr(_compat, "abort_process_groups", abort)
    with caplog.at_level(logging.WARNING, logger=failures.__name__):
        assert failures.shutdown_process_groups() is False
    assert "abort of the process groups failed: no abort here" in caplog.text


def test_exit_hook_returns_within_the_bound(fake_group, monkeypatch):
    """The atexit hook `attach` registers: it used to call destroy_process_group unbounded."""
    hooks = []
    monkeypatch.setattr(accelerator.atexit, "register", hooks.append)
    monkeypatch.setattr(accelerator, "EXIT_DRAIN_S", 0.0)
    accelerator._destroy_default_group_at_exit.__wrapped__()
    (hook,) = hooks
    runner = threading.Thread(target=hook, daemon=True)
    runner.start()
    runner.join(2 * UNBLOCK_S)
    assert not runner.is_alive(), "the exit hook blocked even after destroy returned"
    # Returned while destroy was still blocked: no "destroy returned" before the abort.
    assert fake_group == ["destroy", "abort"]


def test_real_gloo_group_is_destroyed(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        dist.new_group([0])
        assert failures.shutdown_process_groups(deadline_s=30.0) is True
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
