"""torch's own FSDP2 test helpers see flexshard's collectives: ``patch_all_gather`` and
``patch_reduce_scatter`` (torch.testing._internal.common_fsdp) swap torch.distributed's
all-gather / reduce-scatter for the duration of a test, and a mixed-precision test
asserts the dtype each reduce-scatter carries (torch's ``test_compute_dtype`` and
``test_reduce_dtype``). Both libraries train the same three MLPs under each policy with
the helpers in place: the calls and dtypes the helpers record must be the same, and the
losses bitwise. Dims of 17 split unevenly over 2 and 3 ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.testing._internal.common_fsdp import patch_all_gather, patch_reduce_scatter

import flexshard as fs
from flexshard.testing import run_distributed
from flexshard.torch_internals import ALL_GATHER_SINGLE, REDUCE_SCATTER_SINGLE, grad_reduce_dtype

DIM = 17
BF16, FP32 = torch.bfloat16, torch.float32
# (param_dtype, reduce_dtype) of torch's test_compute_dtype and test_reduce_dtype
POLICIES = {"compute_bf16": (BF16, None), "reduce_fp32": (BF16, FP32), "reduce_bf16": (FP32, BF16)}


def _mlps() -> nn.Sequential:
    torch.manual_seed(42)
    return nn.Sequential(
        *[
            nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.ReLU(), nn.Linear(2 * DIM, DIM))
            for _ in range(3)
        ]
    )


def _train(rank: int, shard, policy: MixedPrecisionPolicy, reshard: bool | int) -> dict:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _mlps()
    for mlp in model:
        shard(mlp, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    gathers: list[torch.dtype] = []
    reduces: list[torch.dtype] = []
    all_gather = getattr(dist, ALL_GATHER_SINGLE)
    reduce_scatter = getattr(dist, REDUCE_SCATTER_SINGLE)

    def gather_logged(output: torch.Tensor, *args, **kwargs):
        gathers.append(output.dtype)
        return all_gather(output, *args, **kwargs)

    def reduce_logged(output: torch.Tensor, *args, **kwargs):
        reduces.append(output.dtype)
        return reduce_scatter(output, *args, **kwargs)

    torch.manual_seed(42 + rank + 1)
    inp = torch.randn(4, DIM)
    losses = []
    for step in range(3):
        optim.zero_grad(set_to_none=step % 2 == 0)
        with patch_all_gather(gather_logged), patch_reduce_scatter(reduce_logged):
            loss = model(inp).sum()
            loss.backward()
        optim.step()
        losses.append(loss.detach().float())
    return {"gathers": gathers, "reduces": reduces, "losses": losses}


def _both(rank: int, world: int, policy_name: str, reshard: bool | int) -> dict:
    param_dtype, reduce_dtype = POLICIES[policy_name]
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    return {
        name: _train(rank, shard, policy, reshard)
        for name, shard in (("fsdp2", torch_fully_shard), ("flexshard", fs.fully_shard))
    }


@pytest.mark.parametrize(
    "world,policy,reshard",
    [(2, "compute_bf16", True), (2, "reduce_fp32", True), (3, "reduce_bf16", False)],
)
def test_fsdp2_test_helpers_see_flexshards_collectives(world, policy, reshard) -> None:
    # with no reduce_dtype set, this release's FSDP2 reduces in param_dtype (before 2.15)
    # or in the parameters' own fp32 (from 2.15 on)
    param_dtype, reduce_dtype = POLICIES[policy]
    expected = grad_reduce_dtype(MixedPrecisionPolicy(param_dtype, reduce_dtype), FP32)
    for rank, out in enumerate(run_distributed(_both, world, policy, reshard)):
        ours, theirs = out["flexshard"], out["fsdp2"]
        assert theirs["reduces"] and set(theirs["reduces"]) == {expected}, f"rank {rank}"
        assert ours["reduces"] == theirs["reduces"], f"rank {rank}: reduce-scatter dtypes"
        assert len(ours["gathers"]) == len(theirs["gathers"]) > 0, f"rank {rank}: all-gathers"
        assert all(torch.equal(a, b) for a, b in zip(ours["losses"], theirs["losses"]))
