"""torchtitan 0.3.0's llama3 debug model through torchtitan's own ``parallelize_llama``
(``apply_fsdp_to_decoder`` passes ``dp_mesh_dims`` under its ``full_dtensor`` backend),
flexshard's ``fully_shard`` swapped in at torchtitan's import site, W = 2 gloo on CPU
(the CPU patches: flexshard/testing/torchtitan_cpu.py). The sharded parameters are DTensors
placed exactly as FSDP2 places them (same mesh, placements, shapes) and three training
steps are bitwise FSDP2's."""

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
