"""``training.optimizer = "muon"`` in the trainer under TP, PP, CP and EP against the
single-process run (the harness of tests/trainer/test_parallel_layouts.py): the losses, the
gradient norms and the final (gathered) parameters of the same steps; Muon checkpoints
saved at step 3 and resumed under pp2 (fast) and tp2 x pp2 (slow) repeat the
uninterrupted losses bit for bit. Fast: tp2 and the pp2 checkpoint; slow: ep2,
interleaved pp2 and the 4-rank layouts.

Tolerance: torch Muon's Newton–Schulz runs in bf16, so the fp32 last-bit differences
of the layouts' partial sums (see test_parallel_layouts) can flip bf16 roundings of an
update: losses and norms stay as close as AdamW's, the final parameters up to ~100x
further (still far below a wrong step: a wrong split, a head given to Muon, a stage's
matrix left out). Measured worst gaps are printed (``-s``); the bounds leave about 10x
room."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch.distributed as dist

from flexshard.runtime.bucket import slot_of
from flexshard.testing import run_distributed
from flexshard.trainer.checkpointing.checkpoints import latest_step
from flexshard.trainer.config import ConfigError
from flexshard.trainer.train import run, setup

from .test_parallel_layouts import (
    MOE,
    compare_with_single_process,
    layout_config,
    single_process,
    trained,
)

STEPS = 6
MUON = {"optimizer": "muon", "steps": STEPS}
# measured worst (6 steps): loss 2.6e-7 (pp2), norm 4.0e-6 (dp2xcp2), final parameters
# 6.9e-4 (dp2xpp2_ep2: each rank's batched Newton-Schulz over its 2 experts rounds
# otherwise than one process's over all 4)
LOSS_RTOL = 3e-6
NORM_RTOL = 5e-5
PARAM_ATOL = 5e-3

# name: (world size, [parallelism], [model.moe] or None)
LAYOUTS: dict[str, tuple[int, dict, dict | None]] = {
    "tp2": (2, {"dp_shard": 1, "tp": 2}, None),
    "pp2": (2, {"dp_shard": 1, "pp": 2}, None),  # the checkpoint case of the fast test
    # slow
    "ep2": (2, {"dp_shard": 2, "ep": 2}, MOE),
    "pp2_interleaved": (  # two stage modules a rank: one optimizer over both
        2,
        {
            "dp_shard": 1,
            "pp": 2,
            "pp_schedule": "interleaved_1f1b",
            "pp_virtual_stages": 2,
            "pp_microbatches": 2,
        },
        None,
    ),
    "dp2xtp2": (4, {"dp_shard": 2, "tp": 2}, None),
    "tp2xpp2": (4, {"dp_shard": 1, "tp": 2, "pp": 2}, None),
    "dp2xcp2": (4, {"dp_shard": 2, "cp": 2}, None),
    "dp2xpp2_ep2": (4, {"dp_shard": 2, "pp": 2, "ep": 2}, MOE),
    # the "muon" placement (per-block buckets, matrices whole on balanced owners) on
    # every layout: dp-owned TP pieces, experts over their own mesh, stages, replicas
    "muon_dp2xtp2": (4, {"dp_shard": 2, "tp": 2, "placement": "muon"}, None),
    "muon_dp4_ep2": (4, {"dp_shard": 4, "ep": 2, "placement": "muon"}, MOE),
    "muon_dp2xpp2": (4, {"dp_shard": 2, "pp": 2, "placement": "muon"}, None),
    "muon_hsdp": (4, {"dp_replicate": 2, "dp_shard": 2, "placement": "muon"}, None),
}


def _config(folder: str, name: str, **extra: dict):
    _, parallelism, moe = LAYOUTS[name]
    return layout_config(
        folder, parallelism, moe, training={**MUON, **extra.pop("training", {})}, **extra
    )


def _split_matrices(job) -> int:
    """Muon's matrices whose data-parallel storage splits them (the plan found them too
    large to own): DistMuon redistributes those, and only those, over dp."""
    split = 0
    for group in job.optimizer.param_groups:
        if not group.get("use_muon", True):
            continue
        for param in group["params"]:
            bucket, index = slot_of(param)
            layout = bucket.layout.params[index]
            holders = [r for r, regions in enumerate(layout.regions) if regions]
            pieces = [r for regions in layout.regions for r in regions]
            whole = len(holders) == 1 or all(r.sizes[-2:] == layout.shape[-2:] for r in pieces)
            split += not whole
    return split


def _train(folder: str, name: str) -> dict:
    job = setup(_config(f"{folder}/{name}", name))
    job.optimizer.comm_stats(reset=True)
    result = trained(job, STEPS)
    if name.startswith("muon_"):
        result["optimizer_comm"] = job.optimizer.comm_stats()
        result["split"] = _split_matrices(job)
    return result


CKPT = {"enable": True, "interval": 3}


def _back_to_step_3(folder: str) -> None:
    """As if the job had died after the step-3 save."""
    ckpt = Path(folder) / "checkpoint"
    assert latest_step(ckpt) == STEPS
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(ckpt / f"step-{STEPS}")
    dist.barrier()


def _interrupted(folder: str, name: str) -> tuple[list[float], list[float]]:
    """The uninterrupted run's losses, and those of the same layout resumed at step 3
    (Muon's momentum buffers and AdamW's moments from the checkpoint)."""
    cfg = _config(f"{folder}/ckpt_{name}", name, checkpoint=CKPT)
    whole = [r["loss"] for r in run(cfg)]
    _back_to_step_3(cfg.job.dump_folder)
    return whole, [r["loss"] for r in run(cfg)]


def _cases(rank: int, world_size: int, folder: str, names: list[str], ckpt: str | None) -> dict:
    out: dict = {name: _train(folder, name) for name in names}
    if ckpt is not None:
        out["checkpoint"] = _interrupted(folder, ckpt)
    return out


def _check(name: str, result: dict) -> dict[str, float]:
    cfg = _config("-", name)
    return compare_with_single_process(name, cfg, result, LOSS_RTOL, NORM_RTOL, PARAM_ATOL)


def _check_checkpoint(name: str, results: list[dict]) -> None:
    """Bit for bit the uninterrupted run on every rank, which matches one process."""
    whole, resumed = results[0]["checkpoint"]
    assert len(whole) == STEPS and resumed == whole[3:], (name, whole, resumed)
    assert all(r["checkpoint"] == (whole, resumed) for r in results), name
    cfg = _config("-", name)
    expected = single_process(cfg, cfg.parallelism.dp_replicate * cfg.parallelism.dp_shard)[0]
    gap = max(abs(a - b) / b for a, b in zip(whole, expected))
    print(f"muon {name} checkpointed run: loss gap {gap:.2e}")
    assert gap < LOSS_RTOL, (name, gap)


def _run_layouts(world_size: int, names: list[str], ckpt: str | None, tmp_path) -> None:
    results = run_distributed(_cases, world_size, str(tmp_path), names, ckpt, timeout=900)
    if ckpt is not None:
        _check_checkpoint(ckpt, results)
    for name in names:
        gaps = _check(name, results[0][name])
        print(f"muon {name}: {gaps}")
        for rank, by_name in enumerate(results):
            if name.startswith("muon_"):
                _check_comm_free(name, rank, by_name[name])
        for rank, by_name in enumerate(results):  # every rank logs the same loss
            assert by_name[name]["losses"] == results[0][name]["losses"], (name, rank)


def _check_comm_free(name: str, rank: int, result: dict) -> None:
    """The "muon" placement's DistMuon step moves nothing over data parallelism when the
    plan owns every matrix: no all-to-all at all, and under TP only the tp group's
    exchange of the pieces (no dp gather)."""
    stats, tp = result["optimizer_comm"], LAYOUTS[name][1].get("tp", 1)
    print(f"muon {name} rank {rank}: split {result['split']}, optimizer {stats}")
    if result["split"]:
        return
    assert stats.get("tp_all_gather", 0) == 0, (name, rank, stats)
    if tp == 1:
        assert stats["all_to_all"] == 0 and stats["bytes_sent"] == 0, (name, rank, stats)


def test_muon_tp2_and_pp2_checkpoint(tmp_path):
    """Fast: tp2 (the TP owner plan in the trainer), a pp2 run saved at step 3 and
    resumed (each stage's Muon momenta and AdamW moments)."""
    _run_layouts(2, ["tp2"], "pp2", tmp_path)


@pytest.mark.slow
def test_muon_ep2_and_interleaved_pp2(tmp_path):
    _run_layouts(2, ["ep2", "pp2_interleaved"], None, tmp_path)


@pytest.mark.slow
def test_muon_layouts_on_4_ranks(tmp_path):
    _run_layouts(4, [n for n, (w, _, _) in LAYOUTS.items() if w == 4], "tp2xpp2", tmp_path)


def test_optimizers_accepted_and_refused_on_composed_layouts():
    for name in ("tp2xpp2", "ep2"):
        assert _config("-", name).training.optimizer == "muon"
    with pytest.raises(ConfigError, match='"soap" is not wired with tp, pp or ep > 1'):
        _config("-", "tp2", training={"optimizer": "soap"})
