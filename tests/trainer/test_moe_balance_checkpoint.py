"""MoE ``balance = "bias"``: the per-expert biases are model state (a persistent buffer
``layers.<i>.feed_forward.balance.bias``), so checkpoints carry them and a resumed run
repeats the uninterrupted one bit for bit: losses, tokens per expert and the final
biases (read from the safetensors export, which holds them). Under pp the metrics'
tokens per expert cover every stage's MoE layers (gathered over the pp group).

Fast: dp2 (flexshard) and the pp gather on its own. Slow: ep2 and pp2 (whose
records must list every stage's MoE layers), flexshard and FSDP2 backends, and dp2 on
FSDP2."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from flexshard.testing import run_distributed
from flexshard.trainer.models.moe import LoadBalance, tokens_per_expert
from flexshard.trainer.train import run

from ..checkpoint.test_checkpoint_layouts import _back_to_step_3
from .test_parallel_layouts import MOE, layout_config

STEPS = 6
CKPT = {"enable": True, "interval": 3, "export_safetensors": True}
# a rate large enough for the bias to change the top-k choice within a few steps (the
# router's softmax scores differ by ~0.03): a run that lost the bias routes otherwise
MOE_BIAS = {**MOE, "balance": "bias", "bias_update_rate": 0.01}
MOE_LAYERS = [f"layers.{i}.feed_forward" for i in (1, 2, 3)]  # 4 layers, the first dense
BIASES = [f"{layer}.balance.bias" for layer in MOE_LAYERS]
GLOBAL_BATCH, SEQ = 4, 16
# name: ([parallelism], batch size per rank); every global batch is 4 sequences
LAYOUTS = {
    "dp2": ({"dp_shard": 2}, 2),
    "ep2": ({"dp_shard": 2, "ep": 2}, 2),
    "pp2": ({"dp_shard": 1, "pp": 2}, 4),  # stage 0: layers 0-1, stage 1: layers 2-3
}


def _config(folder: str, name: str, backend: str):
    parallelism, batch = LAYOUTS[name]
    return layout_config(
        folder,
        {**parallelism, "dp_backend": backend},
        MOE_BIAS,
        checkpoint=CKPT,
        training={"steps": STEPS, "batch_size": batch},
    )


def _interrupted(rank: int, world_size: int, root: str, runs: list[tuple[str, str]]) -> dict:
    """Per (layout, backend): the uninterrupted run's (loss, tokens per expert) per
    step, and those of the same run resumed from its step-3 checkpoint."""
    out = {}
    for name, backend in runs:
        folder = f"{root}/{name}_{backend}"
        cfg = _config(folder, name, backend)
        whole = [(r["loss"], r["tokens_per_expert"]) for r in run(cfg)]
        if rank == 0:  # the uninterrupted run's export, before the resumed run's
            shutil.copy(f"{folder}/model.safetensors", f"{folder}/whole.safetensors")
        _back_to_step_3(folder)
        dist.barrier()
        resumed = [(r["loss"], r["tokens_per_expert"]) for r in run(cfg)]
        out[(name, backend)] = (whole, resumed)
    return out


def _check(results: list[dict], root: Path) -> None:
    for (name, backend), (whole, resumed) in results[0].items():
        folder = root / f"{name}_{backend}"
        what = f"{name} ({backend})"
        for per_rank in results:  # every rank logged the same, every MoE layer
            assert per_rank[(name, backend)] == (whole, resumed), what
        assert resumed == whole[3:], what  # bit for bit: losses and the routing
        for _, loads in whole:
            assert list(loads) == MOE_LAYERS, (what, list(loads))
            assert all(sum(v) == GLOBAL_BATCH * SEQ * MOE["top_k"] for v in loads.values())
        # the bias is in the checkpoint the resumed run started from, and moved
        dcp_to_torch_save(folder / "checkpoint" / "step-3", folder / "step-3.pt")
        saved = torch.load(folder / "step-3.pt")["model"]
        assert all(saved[key].abs().max() > 0 for key in BIASES), what
        # the final biases: exported, equal to the uninterrupted run's, not the step-3 ones
        final, expected = (
            load_file(folder / f) for f in ("model.safetensors", "whole.safetensors")
        )
        for key in BIASES:
            assert torch.equal(final[key], expected[key]), (what, key)
            assert not torch.equal(final[key], saved[key]), (what, key)


def test_bias_balance_resumes_exactly_on_dp2(tmp_path):
    runs = [("dp2", "flexshard")]
    _check(run_distributed(_interrupted, 2, str(tmp_path), runs, timeout=600), tmp_path)


@pytest.mark.slow
def test_bias_balance_resumes_exactly_on_ep2_and_pp2(tmp_path):
    runs = [(name, backend) for name in ("ep2", "pp2") for backend in ("flexshard", "fsdp2")]
    runs.append(("dp2", "fsdp2"))
    _check(run_distributed(_interrupted, 2, str(tmp_path), runs, timeout=900), tmp_path)


def _stage_loads(rank: int, world_size: int) -> dict:
    """Two pipeline ranks: rank 0 holds layers 9 and 11 (interleaved stages), rank 1
    layer 10; each counted its own layers' last step."""
    modules = []
    for layer in (9, 11) if rank == 0 else (10,):
        moe = nn.Module()
        moe.balance = LoadBalance("bias", 3, 0.1, 0.0)
        moe.balance.last_load = [layer, rank, 1]
        stage = nn.Module()
        stage.layers = nn.ModuleDict({str(layer): moe})  # the whole model's FQNs
        modules.append(stage)
    return {
        "local": tokens_per_expert(modules),
        "gathered": tokens_per_expert(modules, dist.group.WORLD),
    }


def test_tokens_per_expert_gathers_every_pipeline_stage():
    first, second = run_distributed(_stage_loads, 2, timeout=120)
    assert first["local"] == {"layers.9": [9, 0, 1], "layers.11": [11, 0, 1]}
    assert second["local"] == {"layers.10": [10, 1, 1]}
    every = {"layers.9": [9, 0, 1], "layers.10": [10, 1, 1], "layers.11": [11, 0, 1]}
    for out in (first, second):  # every rank, every layer, in layer order
        assert out["gathered"] == every and list(out["gathered"]) == list(every)
