"""torchtitan 0.3.0's llama3 debug model through torchtitan's own ``parallelize_llama``
(``apply_fsdp_to_decoder`` passes ``dp_mesh_dims`` under its ``full_dtensor`` backend),
flexshard's ``fully_shard`` swapped in at torchtitan's import site, W = 2 gloo on CPU
(the CPU patches: flexshard/testing/torchtitan_cpu.py). The sharded parameters are DTensors
placed exactly as FSDP2 places them (same mesh, placements, shapes) and three training
steps are bitwise FSDP2's: through a re-implemented step, and through torchtitan's own
``Trainer`` (flexshard/testing/torchtitan_trainer.py), which also issues no more
collectives of any kind per step with flexshard."""

from __future__ import annotations

import pytest
import torch

from flexshard.testing import run_distributed

pytest.importorskip("torchtitan")
pytest.importorskip("triton")  # torchtitan imports it

STEPS = 3


def _train(rank: int, world_size: int, library: str) -> dict:
    from flexshard.testing.torchtitan_cpu import batches, build, train_step

    run = build(world_size, library, bf16=False)
    params = dict(run.model.named_parameters())
    layout = {
        n: (
            p.device_mesh.mesh_dim_names,
            p.device_mesh.mesh.tolist(),
            tuple(p.placements),
            tuple(p.shape),
            tuple(p.to_local().shape),
        )
        for n, p in params.items()
    }
    opt = torch.optim.AdamW(run.model.parameters(), lr=1e-3)
    losses = [train_step(run, opt, x, y).to_local() for x, y in batches(rank, STEPS)]
    full = {n: p.detach().full_tensor() for n, p in params.items()}
    return {"layout": layout, "losses": losses, "params": full}


def _both(rank: int, world_size: int) -> dict:
    return {lib: _train(rank, world_size, lib) for lib in ("fsdp2", "flexshard")}


@pytest.mark.slow
def test_torchtitan_llama3_debug_dp_mesh_dims_is_fsdp2() -> None:
    for result in run_distributed(_both, 2, timeout=900):
        torch_run, flex = result["fsdp2"], result["flexshard"]
        assert flex["layout"] == torch_run["layout"]
        assert any(
            p[2] != (torch.distributed.tensor.Replicate(),) for p in flex["layout"].values()
        )  # sharded, not left whole
        assert all(torch.equal(a, b) for a, b in zip(torch_run["losses"], flex["losses"]))
        theirs = flex["params"]
        differ = [n for n, p in torch_run["params"].items() if not torch.equal(p, theirs[n])]
        assert differ == []


# torchtitan's own Trainer (flexshard/testing/torchtitan_trainer.py): its train() loop,
# ChunkedLossWrapper (9 backward calls a step), AdamW, LR schedule and clipping
def _own_trainer(rank: int, world_size: int, library: str, setup_kw: dict) -> dict:
    from flexshard.testing.torchtitan_trainer import (
        Setup,
        build_trainer,
        full_weights,
        measure_steps,
    )

    setup = Setup(steps=STEPS, **setup_kw)
    harness = build_trainer(setup, library, world_size)
    try:
        records = measure_steps(harness, STEPS, count=True)
        weights = full_weights(harness)
    finally:
        harness.close()
    return {
        "losses": [r.loss for r in records],
        "collectives": [r.by_kind() for r in records],
        "weights": weights,
    }


def _own_trainer_both(rank: int, world_size: int, setup_kw: dict) -> dict:
    """Both libraries; the weights compared here (the MoE models' are GBs to send back)."""
    out = {lib: _own_trainer(rank, world_size, lib, setup_kw) for lib in ("fsdp2", "flexshard")}
    theirs, ours = out["fsdp2"].pop("weights"), out["flexshard"].pop("weights")
    assert theirs.keys() == ours.keys()
    out["differ"] = [n for n, p in theirs.items() if not torch.equal(p, ours[n])]
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "setup_kw"),
    [
        (2, {"model": "llama3"}),
        (2, {"model": "qwen3"}),
        (2, {"model": "deepseek_v3"}),
        (2, {"model": "deepseek_v3", "expert_parallel": 2}),
        (2, {"model": "qwen3_moe", "expert_parallel": 2}),
        (3, {"model": "llama3", "bf16": True, "accumulation": 2}),
    ],
    ids=[
        "llama3",
        "qwen3",
        "deepseek_v3",
        "deepseek_v3-ep2",
        "qwen3_moe-ep2",
        "llama3-bf16-accum2-w3",
    ],
)
def test_torchtitan_own_trainer_is_fsdp2(world: int, setup_kw: dict) -> None:
    """fp32 at W = 2, the debug model of each family (qwen3: its embedding tied to its head
    after sharding; deepseek_v3 and qwen3's MoE debug model with their experts over both
    ranks, EP = 2, the experts' parameters on a mesh of their own), and llama3 in bf16
    with two microbatches a step at W = 3 (the chunked head's reductions sum three ranks
    in bf16, where what each reduce-scatter carries shows): torchtitan's Trainer with
    flexshard trains bitwise as with FSDP2, issuing no more collectives of any kind in
    any step."""
    for result in run_distributed(_own_trainer_both, world, setup_kw, timeout=900):
        torch_run, flex = result["fsdp2"], result["flexshard"]
        assert None not in torch_run["losses"]
        assert flex["losses"] == torch_run["losses"]
        assert result["differ"] == []
        more = [
            (step, kind, ours, torch_run["collectives"][step][kind])
            for step, counts in enumerate(flex["collectives"])
            for kind, ours in counts.items()
            if ours > torch_run["collectives"][step].get(kind, 0)
        ]
        assert more == [], f"(step, kind, flexshard, FSDP2): {more}"
