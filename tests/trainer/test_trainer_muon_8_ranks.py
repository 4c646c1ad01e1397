"""``training.optimizer = "muon"`` with sequence parallelism on dp2 x tp2 x pp2 (W = 8)
against one process: the losses, the gradient norms and the final (gathered)
parameters of the same steps, within tests/trainer/test_trainer_muon_layouts.py's tolerances
(torch Muon's Newton–Schulz runs in bf16). Every rank logs the same losses; the stages
exchange sequence shards (``sequence_shards == tp``). Slow: 8 ranks on this machine's
2 cores; the model is the layout tests' tiny one and the steps few."""

from __future__ import annotations

import time

import pytest
import torch

from flexshard.testing import run_distributed
from flexshard.trainer.train import setup

from .test_parallel_layouts import layout_config, single_process, trained
from .test_trainer_muon_layouts import LOSS_RTOL, NORM_RTOL, PARAM_ATOL

W = 8
STEPS = 4
LAYOUT = {"dp_shard": 2, "tp": 2, "pp": 2, "sequence_parallel": True}


def _config(folder: str):
    return layout_config(folder, LAYOUT, None, training={"optimizer": "muon", "steps": STEPS})


def _train(rank: int, world_size: int, folder: str) -> dict:
    started = time.monotonic()
    job = setup(_config(folder))
    runner = job.parallel.runner
    assert runner is not None
    return {
        **trained(job, STEPS),
        "sequence_shards": runner.sequence_shards,
        "optimizer": type(job.optimizer).__name__,
        "seconds": time.monotonic() - started,
    }


@pytest.mark.slow
def test_muon_with_sequence_parallelism_on_dp2_tp2_pp2(tmp_path):
    results = run_distributed(_train, W, str(tmp_path), timeout=1500)
    cfg = _config("-")
    losses, norms, params = single_process(cfg, cfg.parallelism.dp_shard)
    got = results[0]
    assert all(r["sequence_shards"] == 2 for r in results)  # SP: stages send s / tp
    for rank, result in enumerate(results):  # every rank logs the same loss
        assert result["losses"] == got["losses"], rank
    loss_gap = max(abs(a - b) / b for a, b in zip(got["losses"], losses))
    norm_gap = max(abs(a - b) / b for a, b in zip(got["norms"], norms))
    assert set(got["params"]) == set(params)
    param_gap = max(
        float((torch.from_numpy(got["params"][k]) - v).abs().max()) for k, v in params.items()
    )
    gaps = {"loss": loss_gap, "norm": norm_gap, "param": param_gap}
    seconds = max(r["seconds"] for r in results)
    print(f"{got['optimizer']} dp2xtp2xpp2 (SP), {STEPS} steps: {gaps}; {seconds:.1f} s a rank")
    assert loss_gap < LOSS_RTOL and norm_gap < NORM_RTOL and param_gap < PARAM_ATOL, gaps
    assert got["losses"][-1] < got["losses"][0]  # it learns
