"""flexshard/testing/call_profile.py: Python calls counted per profiled step only, and
split by where the called function lives."""

from __future__ import annotations

import pytest

from flexshard.testing.call_profile import OTHER, CallProfile, area_of


def _leaf() -> int:
    return 1


def _step(n: int) -> int:
    return sum(_leaf() for _ in range(n))


def test_calls_are_per_profiled_step_and_leave_the_rest_out():
    profile = CallProfile()
    for _ in range(4):
        with profile.step():
            _step(10)
        _step(1000)  # between steps: not counted
    summary = profile.summary(top=3)
    assert profile.steps == 4
    names = dict(summary["top"])
    leaf = next(name for name in names if name.endswith("(_leaf)"))
    assert names[leaf] == 10  # per step, not 4010 / 4
    assert leaf.startswith("tests/project/test_call_profile.py:")  # relative to the repo
    assert summary["calls"] == sum(summary["by_area"].values())


def test_areas_by_file():
    site = "/venv/lib/python3.11/site-packages/"
    assert area_of("/repo/flexshard/runtime/hooks.py") == "flexshard runtime"
    assert area_of("/repo/flexshard/testing/client_loops.py") == "harness"
    assert area_of("/repo/flexshard/api/fully_shard.py") == "flexshard"
    assert area_of(site + "torch/distributed/fsdp/_fully_shard/_fsdp_param.py") == "torch fsdp"
    assert area_of(site + "torch/distributed/tensor/_dispatch.py") == "torch dtensor"
    assert area_of(site + "torchtitan/trainer.py") == "torchtitan"
    assert area_of(site + "torch/nn/modules/module.py") == "torch nn.Module"
    assert area_of("~") == OTHER


def test_summary_needs_a_step():
    with pytest.raises(ValueError, match="no step was profiled"):
        CallProfile().summary()
