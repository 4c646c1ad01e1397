"""Trainer checkpoints under pipeline and expert parallelism: one logical model (stages
under their global FQNs, expert slices at their offsets in the whole [E, ...] stacks),
so a resumed run repeats the uninterrupted losses bit for bit on the same layout and
within the layout tests' tolerance on another (pp2 -> pp1, ep2 -> ep1, ep2 -> ep4).
Slow: interleaved stages (two stage modules a rank), the FSDP2 backend, and 8-rank
layouts with TP (dp2 x tp2 x pp2, cp2 x tp2 x ep2). The new families across layouts:
DeepSeek-V3 (MLA, the "bias" balance, MTP) dp2 -> dp3 flat and -> dp2 x ep2, without
MTP dp2 -> tp2; a tied Qwen3 dp2 -> tp2 and -> dp3 Owned."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch.distributed as dist
from safetensors.torch import load_file

from flexshard.testing import run_distributed
from flexshard.trainer.checkpointing.checkpoints import latest_step
from flexshard.trainer.train import run

from ..trainer.test_deepseek_layouts import DEEPSEEK_MOE, MLA_MODEL
from ..trainer.test_parallel_layouts import (
    LOSS_RTOL,
    MOE,
    PARAM_ATOL,
    QWEN3,
    layout_config,
    single_process,
)

STEPS = 6
CKPT = {"enable": True, "interval": 3, "export_safetensors": True}
# name: ([parallelism], [model.moe] or None, batch size); each global batch is 4 sequences
PP2 = ({"dp_shard": 2, "pp": 2}, None, 2)
PP1_DP4 = ({"dp_shard": 4}, None, 1)
PP2_INTERLEAVED = (
    {"dp_shard": 1, "pp": 2, "pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 2},
    None,
    4,
)
EP2 = ({"dp_shard": 2, "ep": 2}, MOE, 2)
EP1 = ({"dp_shard": 2}, MOE, 2)
EP4 = ({"dp_shard": 4, "ep": 4}, MOE, 1)
# slow, 8 ranks: stages with TP pieces; expert slices with TP and CP
DP2_TP2_PP2 = ({"dp_shard": 2, "tp": 2, "pp": 2}, None, 2)
CP2_TP2_EP2 = ({"dp_shard": 2, "cp": 2, "tp": 2, "ep": 2}, MOE, 2)
# the new families, a 4th entry: [model] beside the default; each global batch is 6
# sequences (W = 2 and 3). DeepSeek-V3 with MTP (refused with tp: a variant without)
# and the "bias" balance, whose biases the checkpoint carries
DSV3 = {**MLA_MODEL, "mtp_layers": 1, "mtp_loss_weight": 0.3}
DSV3_MOE = {**DEEPSEEK_MOE, "balance": "bias", "bias_update_rate": 0.01}
DSV3_DP2 = ({"dp_shard": 2}, DSV3_MOE, 3, DSV3)
DSV3_DP3_FLAT = ({"dp_shard": 3, "placement": "flat"}, DSV3_MOE, 2, DSV3)
DSV3_DP2_EP2 = ({"dp_shard": 2, "ep": 2}, DSV3_MOE, 3, DSV3)
DSV3_NO_MTP_DP2 = ({"dp_shard": 2}, DSV3_MOE, 3, MLA_MODEL)
DSV3_NO_MTP_TP2 = ({"dp_shard": 1, "tp": 2}, DSV3_MOE, 6, MLA_MODEL)
QWEN3_DP2 = ({"dp_shard": 2}, None, 3, QWEN3)
QWEN3_TP2 = ({"dp_shard": 1, "tp": 2}, None, 6, QWEN3)
QWEN3_DP3_OWNED = ({"dp_shard": 3, "placement": "owned"}, None, 2, QWEN3)


def _losses(folder: str, layout: tuple, backend: str = "flexshard") -> list[float]:
    parallelism, moe, batch, *model = layout
    cfg = layout_config(
        folder,
        {**parallelism, "dp_backend": backend},
        moe,
        checkpoint=CKPT,
        training={"steps": STEPS, "batch_size": batch},
        model=model[0] if model else {},
    )
    return [r["loss"] for r in run(cfg)]


def _back_to_step_3(folder: str) -> None:
    """As if the job had died after the step-3 save."""
    ckpt = Path(folder) / "checkpoint"
    assert latest_step(ckpt) == STEPS
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(ckpt / f"step-{STEPS}")
    dist.barrier()


def _interrupted(folder: str, layout: tuple, backend: str = "flexshard") -> tuple[list, list]:
    """The uninterrupted run's losses, and those of the same layout resumed at step 3."""
    whole = _losses(folder, layout, backend)
    _back_to_step_3(folder)
    return whole, _losses(folder, layout, backend)


def _on_2_ranks(rank: int, world_size: int, root: str) -> dict:
    out = {"ep2": _interrupted(f"{root}/ep", EP2)}
    _back_to_step_3(f"{root}/ep")
    out["ep2->ep1"] = _losses(f"{root}/ep", EP1)
    _back_to_step_3(f"{root}/ep")  # for the 4-rank part
    return out


def _on_4_ranks(rank: int, world_size: int, root: str) -> dict:
    out = {"pp2": _interrupted(f"{root}/pp", PP2)}
    if rank == 0:  # the pp2 export, before the pp1 run writes its own
        shutil.copy(f"{root}/pp/model.safetensors", f"{root}/pp2.safetensors")
    _back_to_step_3(f"{root}/pp")
    out["pp2->pp1"] = _losses(f"{root}/pp", PP1_DP4)
    out["ep2->ep4"] = _losses(f"{root}/ep", EP4)
    return out


def _first_loss(folder: str, layout: tuple, initial: str) -> float:
    """Step 1's loss (before any update) of a fresh FSDP2 run from ``initial``'s weights."""
    parallelism, moe, batch = layout
    checkpoint = {"initial_load_path": initial}
    training = {"steps": 1, "batch_size": batch}
    parallelism = {**parallelism, "dp_backend": "fsdp2"}
    cfg = layout_config(folder, parallelism, moe, checkpoint=checkpoint, training=training)
    return run(cfg)[0]["loss"]


def _more_on_2_ranks(rank: int, world_size: int, root: str) -> dict:
    out = {
        "pp2_interleaved": _interrupted(f"{root}/ppi", PP2_INTERLEAVED),
        "ep2_fsdp2": _interrupted(f"{root}/ep_fsdp2", EP2, "fsdp2"),
    }
    # the step-6 weights (whole expert stacks) as the initial weights of ep2 and ep1
    initial = f"{root}/ep_fsdp2/checkpoint/step-{STEPS}"
    first = [
        _first_loss(f"{root}/init_{n}", lay, initial) for n, lay in (("ep2", EP2), ("ep1", EP1))
    ]
    return {"exact": out, "initial": first}


def _families_on_2_ranks(rank: int, world_size: int, root: str) -> dict:
    """Each family saved under dp2 and resumed on the same 2 ranks under another layout
    (then back to step 3, for the 3-rank part)."""
    out = {}
    for folder, saved, other in (
        ("dsv3", DSV3_DP2, {"dp2->dp2xep2": DSV3_DP2_EP2}),
        ("dsv3_no_mtp", DSV3_NO_MTP_DP2, {"dp2->tp2": DSV3_NO_MTP_TP2}),
        ("qwen3", QWEN3_DP2, {"dp2->tp2": QWEN3_TP2}),
    ):
        whole = _losses(f"{root}/{folder}", saved)
        _back_to_step_3(f"{root}/{folder}")
        out[folder] = {"whole": whole}
        for name, layout in other.items():
            out[folder][name] = _losses(f"{root}/{folder}", layout)
            _back_to_step_3(f"{root}/{folder}")
    return out


def _families_on_3_ranks(rank: int, world_size: int, root: str) -> dict:
    return {
        "dsv3": {"dp2->dp3_flat": _losses(f"{root}/dsv3", DSV3_DP3_FLAT)},
        "qwen3": {"dp2->dp3_owned": _losses(f"{root}/qwen3", QWEN3_DP3_OWNED)},
    }


def test_new_families_resume_across_layouts(tmp_path):
    two = run_distributed(_families_on_2_ranks, 2, str(tmp_path), timeout=900)
    three = run_distributed(_families_on_3_ranks, 3, str(tmp_path), timeout=900)
    gaps = {}
    for folder, runs in two[0].items():
        whole = runs.pop("whole")
        resumed = {**runs, **(three[0].get(folder, {}))}
        for name, losses in resumed.items():
            gaps[f"{folder} {name}"] = _gap(losses, whole)
    print(f"families resumed across layouts: loss gaps {gaps}")
    assert len(gaps) == 5 and max(gaps.values()) < LOSS_RTOL, gaps


def _more_on_4_ranks(rank: int, world_size: int, root: str) -> dict:
    return {"pp2_fsdp2": _interrupted(f"{root}/pp_fsdp2", PP2, "fsdp2")}


def _on_8_ranks(rank: int, world_size: int, root: str) -> dict:
    return {
        "dp2xtp2xpp2": _interrupted(f"{root}/dtp", DP2_TP2_PP2),
        "cp2xtp2xep2": _interrupted(f"{root}/cte", CP2_TP2_EP2),
    }


def _check_exact(results: list[dict]) -> None:
    """Same layout: bit for bit, on every rank."""
    for name, (whole, resumed) in results[0].items():
        assert resumed == whole[3:], name
        assert all(r[name] == (whole, resumed) for r in results), name


def _gap(resumed: list[float], whole: list[float]) -> float:
    assert len(resumed) == STEPS - 3
    return max(abs(a - b) / b for a, b in zip(resumed, whole[3:]))


def test_pp_and_ep_checkpoints_resume_exactly_and_across_degrees(tmp_path):
    two = run_distributed(_on_2_ranks, 2, str(tmp_path), timeout=600)
    four = run_distributed(_on_4_ranks, 4, str(tmp_path), timeout=600)
    _check_exact([{"ep2": r["ep2"]} for r in two])
    _check_exact([{"pp2": r["pp2"]} for r in four])
    ep_whole = two[0]["ep2"][0]
    gaps = {
        "ep2->ep1": _gap(two[0]["ep2->ep1"], ep_whole),
        "ep2->ep4": _gap(four[0]["ep2->ep4"], ep_whole),
        "pp2->pp1": _gap(four[0]["pp2->pp1"], four[0]["pp2"][0]),
    }
    print(f"resumed across degrees: loss gaps {gaps}")
    assert max(gaps.values()) < LOSS_RTOL, gaps
    # the exports gather stages (pp2) and expert slices (ep4): the single process's model
    for file, (parallelism, moe, batch) in (
        ("pp2.safetensors", PP2),
        ("ep/model.safetensors", EP2),
    ):
        cfg = layout_config("-", parallelism, moe, training={"steps": STEPS, "batch_size": batch})
        expected = single_process(cfg, 2)[2]
        exported = load_file(str(tmp_path / file))
        assert {k: v.shape for k, v in exported.items()} == {
            k: v.shape for k, v in expected.items()
        }, file
        gap = max(float((exported[k] - v).abs().max()) for k, v in expected.items())
        assert gap < PARAM_ATOL, (file, gap)


@pytest.mark.slow
def test_interleaved_pp_and_fsdp2_checkpoints_resume_exactly(tmp_path):
    two = run_distributed(_more_on_2_ranks, 2, str(tmp_path), timeout=600)
    _check_exact([r["exact"] for r in two])
    ep2, ep1 = two[0]["initial"]  # step 1 on the loaded weights, under ep2 and ep1
    fresh = two[0]["exact"]["ep2_fsdp2"][0][0]
    assert abs(ep2 - ep1) / ep1 < LOSS_RTOL and abs(ep2 - fresh) > 1e-3, (ep2, ep1, fresh)
    _check_exact(run_distributed(_more_on_4_ranks, 4, str(tmp_path), timeout=600))


@pytest.mark.slow
def test_checkpoints_resume_exactly_on_8_rank_layouts(tmp_path):
    _check_exact(run_distributed(_on_8_ranks, 8, str(tmp_path), timeout=900))
