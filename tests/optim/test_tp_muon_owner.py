"""DistMuon's owner plan for tensor-parallel matrices (flexshard/optim/tp_owners.py) at
tp = 3, which none of the shapes divides (one piece is empty): bit for bit torch Muon
on the whole matrices and the gather-everywhere path, with each matrix orthogonalised
by one rank of the tp group (fewer Newton–Schulz runs per rank, LPT-balanced) and two
packed all-to-alls per step over tp in place of one all-gather per matrix.
(dp x tp, the dp gathers included, is tests/trainer/test_tp.py's dp2 x tp2 DistMuon case.)
Per-head row blocks in column-parallel pieces at dp2 x tp2: local, redistributed over dp
or refused, by where the blocks are cut."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import flexshard as fs
from flexshard.optim import DistMuon, dist_muon
from flexshard.optim.newton_schulz import ns_flops
from flexshard.testing import run_distributed
from flexshard.testing.collectives import record_collectives

TP = 3
STEPS = 2
LR, WD = 0.02, 0.1
# (in, out, style): weights [out, in]; colwise splits rows, rowwise columns, by
# torch.chunk over 3: 10 -> 4/3/3, 16 -> 6/5/5, 2 -> 1/1/0 (an empty piece), 20 -> 7/7/6
SHAPES = {
    "col": (7, 10, "col"),
    "row": (10, 7, "row"),
    "big": (12, 16, "col"),
    "tiny": (5, 2, "col"),
    "wide": (20, 9, "row"),
}


class Mats(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        for name, (fan_in, fan_out, _) in SHAPES.items():
            layer = nn.Linear(fan_in, fan_out, bias=False)
            layer.weight.data = torch.randn(fan_out, fan_in, generator=gen) * 0.1
            self.add_module(name, layer)


def full_grads(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return {f"{n}.weight": torch.randn(o, i, generator=gen) for n, (i, o, _) in SHAPES.items()}


def reference() -> dict[str, torch.Tensor]:
    """torch.optim.Muon on the whole matrices, one process."""
    model = Mats()
    params = dict(model.named_parameters())
    opt = torch.optim.Muon(model.parameters(), lr=LR, weight_decay=WD)
    for step in range(STEPS):
        for name, grad in full_grads(step).items():
            params[name].grad = grad
        opt.step()
    return {k: v.detach() for k, v in params.items()}


def _run() -> dict:
    mesh = init_device_mesh("cpu", (1, TP), mesh_dim_names=("dp_shard", "tp"))
    model = Mats()
    col, row = ColwiseParallel, RowwiseParallel
    styles = {n: col() if s[2] == "col" else row() for n, s in SHAPES.items()}
    parallelize_module(model, mesh["tp"], styles)
    model = fs.flex_shard(model, mesh=mesh["dp_shard"], buckets=[fs.BucketSpec("*", fs.Shard(0))])
    params = dict(model.named_parameters())
    opt = DistMuon(model.parameters(), lr=LR, weight_decay=WD)
    tp_rank = mesh.get_local_rank("tp")
    counts = []
    for step in range(STEPS):
        for name, grad in full_grads(step).items():
            dim = 0 if SHAPES[name.split(".")[0]][2] == "col" else 1
            local = params[name]
            piece = grad.chunk(TP, dim)[tp_rank] if tp_rank < len(grad.chunk(TP, dim)) else None
            shape = local.to_local().shape
            piece = torch.zeros(shape) if piece is None else piece.reshape(shape)
            local.grad = DTensor.from_local(
                piece, local.device_mesh, local.placements, shape=local.shape,
                stride=local.stride(), run_check=False,
            )  # fmt: skip
        with record_collectives() as log:
            opt.step()
        counts.append(dict(log.counts()))
    full = {k: v.clone() for k, v in fs.full_state_dict(model).items()}
    return {"params": {k: v.numpy() for k, v in full.items()}, "counts": counts,
            "stats": opt.comm_stats()}  # fmt: skip


def _case(rank: int, world_size: int) -> dict:
    out = {"owner": _run()}
    real = dist_muon.owner_plannable
    dist_muon.owner_plannable = lambda target: False  # the gather-everywhere path
    try:
        out["everywhere"] = _run()
    finally:
        dist_muon.owner_plannable = real
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_case, TP, timeout=300)


def test_owner_plan_is_bitwise_torch_muon(results) -> None:
    want = reference()
    for rank, result in enumerate(results):
        for path in ("owner", "everywhere"):
            got = result[path]["params"]
            for name, value in want.items():
                assert torch.equal(torch.from_numpy(got[name]), value), (path, rank, name)


def test_owner_plan_orthogonalises_each_matrix_once(results) -> None:
    owner = [r["owner"]["stats"] for r in results]
    everywhere = [r["everywhere"]["stats"] for r in results]
    # one owner per matrix per step in the tp group: the runs add up to the matrices
    assert sum(s["tp_newton_schulz"] for s in owner) == STEPS * len(SHAPES)
    assert all(s["tp_newton_schulz"] < STEPS * len(SHAPES) for s in owner)
    assert all("tp_newton_schulz" not in s for s in everywhere)  # every rank: all five
    # LPT on Newton-Schulz FLOPs (16x12: 6336, 9x20: 3969, 10x7 and 7x10: 1323 each,
    # 2x5: 48): the two big ones alone, the three small ones together on the third
    flops = {n: ns_flops((o, i), 5) for n, (i, o, _) in SHAPES.items()}
    assert flops["big"] > flops["wide"] > flops["col"] + flops["row"] + flops["tiny"]
    assert sorted(s["tp_newton_schulz"] for s in owner) == [STEPS, STEPS, 3 * STEPS]
    # dp = 1: no dp all-gather; the tp all-to-alls' bytes are bf16 pieces
    assert all(s["tp_all_gather"] == 0 for s in owner)
    assert all(s["all_to_all"] == 2 * STEPS for s in owner)
    assert sum(s["bytes_sent"] for s in owner) == sum(s["bytes_received"] for s in owner)


def test_owner_plan_collectives(results) -> None:
    for result in results:
        for counts in result["owner"]["counts"]:  # two packed all-to-alls over tp a step
            assert counts == {"all_to_all_single": 2}, counts
        for counts in result["everywhere"]["counts"]:  # an all-gather per matrix
            assert sum(counts.values()) == len(SHAPES), counts
            assert "all_to_all_single" not in counts, counts


#: a column-parallel (24, 10) weight at dp2 x tp2: 12-row tp pieces, 6 rows per dp rank
HEADS_SHAPE = (24, 10)


def _head_grad(step: int) -> torch.Tensor:
    return torch.randn(HEADS_SHAPE, generator=torch.Generator().manual_seed(200 + step))


def _per_head_reference(rows: int) -> torch.Tensor:
    """torch.optim.Muon on each block of ``rows`` rows of the whole matrix."""
    start = torch.randn(HEADS_SHAPE, generator=torch.Generator().manual_seed(0))
    heads = [nn.Parameter(h.clone()) for h in start.split(rows)]
    opt = torch.optim.Muon(heads, lr=LR, weight_decay=WD)
    for step in range(STEPS):
        for head, grad in zip(heads, _head_grad(step).split(rows)):
            head.grad = grad.clone()
        opt.step()
    return torch.cat([h.detach() for h in heads])


def _heads_in_tp_pieces(rank: int, world_size: int) -> dict:
    """Per-head DistMuon on tp pieces of whole heads: kept local where dp stores whole
    heads (3 rows), redistributed over dp where it cuts them (4 rows); heads that the tp
    pieces cut (5 rows) raise."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    out: dict = {}
    for rows in (3, 4, 5):
        model = nn.Sequential(nn.Linear(HEADS_SHAPE[1], HEADS_SHAPE[0], bias=False))
        model[0].weight.data = torch.randn(HEADS_SHAPE, generator=torch.Generator().manual_seed(0))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel()})
        model = fs.flex_shard(model, mesh=mesh["dp_shard"], buckets=[fs.BucketSpec("*")])
        (param,) = model.parameters()
        group = {"params": [param], "row_blocks": rows}
        if rows == 5:
            with pytest.raises(ValueError, match="split by tensor parallelism.*not whole row"):
                DistMuon([group])
            continue
        opt = DistMuon([group], lr=LR, weight_decay=WD)
        tp_rank, dp_rank = mesh.get_local_rank("tp"), mesh.get_local_rank("dp_shard")
        for step in range(STEPS):  # this rank's dp rows of its tp piece
            local = _head_grad(step).chunk(2, 0)[tp_rank].chunk(2, 0)[dp_rank]
            param.grad = DTensor.from_local(
                local.reshape(param.to_local().shape), param.device_mesh, param.placements,
                shape=param.shape, stride=param.stride(), run_check=False,
            )  # fmt: skip
            opt.step()
        full = fs.full_state_dict(model)["0.weight"]
        kind = opt._targets[id(param)].kind.value
        out[rows] = (kind, torch.equal(full, _per_head_reference(rows)), opt.comm_stats())
    return out


def test_row_blocks_in_tp_pieces() -> None:
    for result in run_distributed(_heads_in_tp_pieces, 4, timeout=300):
        assert result[3] == ("row_blocks", True, {"all_to_all": 0, "bytes_sent": 0,
                                                  "bytes_received": 0})  # fmt: skip
        kind, equal, stats = result[4]
        assert (kind, equal, stats["all_to_all"]) == ("remote", True, 2 * STEPS)
