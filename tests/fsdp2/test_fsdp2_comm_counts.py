"""fully_shard issues exactly FSDP2's collectives, counted by the shared logger (every
torch.distributed route) around the same training on the same model: the scenarios of
torch's ``test_fully_shard_communication_count``, ``reshard_after_forward`` as an int
and ``test_gradient_accumulation`` (no-sync micro-batches, then a synced one). The
unused-gradient agreement is flexshard's opt-in (``set_agree_on_unused_params``): with
it, one all-reduce per synced backward more, and nothing else."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import flexshard as fs
from flexshard.testing import TinyTransformer, TransformerConfig, make_batches, run_distributed
from flexshard.testing.collectives import record_collectives

from ..helpers.reference import sharded_training

CFG = TransformerConfig(layers=3)
STEPS = 3


def _build(shard: Callable, mesh, reshard: bool | int | None) -> TinyTransformer:
    torch.manual_seed(0)
    model = TinyTransformer(CFG)
    for layer in model.layers:
        shard(layer, mesh=mesh, reshard_after_forward=reshard)
    shard(model, mesh=mesh, reshard_after_forward=reshard)
    return model


def _train(model: TinyTransformer, rank: int, world: int, micro: int) -> list[float]:
    """``STEPS`` steps of ``micro`` micro-batches, all but the last without gradient sync."""
    batches = make_batches(CFG, STEPS * micro * world, batch=2, seed=3)
    return sharded_training(model, rank, world, batches, STEPS, micro)


def _counts(rank: int, world: int, reshard: bool | int | None, micro: int, agree: bool) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for name, shard in (("fsdp2", torch_fully_shard), ("flexshard", fs.fully_shard)):
        model = _build(shard, mesh, reshard)
        if agree and name == "flexshard":
            model.set_agree_on_unused_params(True)
        with record_collectives() as log:
            losses = _train(model, rank, world, micro)
        out[name] = {"counts": dict(log.counts()), "losses": losses}
    return out


SCENARIOS = {  # name: (world, reshard_after_forward, micro-batches per step)
    "communication_count": (3, None, 1),
    "reshard_true": (2, True, 1),
    "reshard_int_world": (2, 2, 1),  # an int of the group's size is True
    "reshard_int_1": (3, 1, 1),  # 1 is False
    "gradient_accumulation": (3, True, 3),
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_fully_shard_issues_fsdp2s_collectives(scenario: str) -> None:
    world, reshard, micro = SCENARIOS[scenario]
    for rank, out in enumerate(run_distributed(_counts, world, reshard, micro, False)):
        assert out["flexshard"]["losses"] == out["fsdp2"]["losses"], f"rank {rank}"
        assert out["flexshard"]["counts"] == out["fsdp2"]["counts"], f"rank {rank}"
        assert out["fsdp2"]["counts"]["all_gather_single"] > 0  # the log sees them


def test_agreement_is_one_all_reduce_per_synced_backward_more() -> None:
    world, reshard, micro = SCENARIOS["gradient_accumulation"]
    for out in run_distributed(_counts, world, reshard, micro, True):
        ours, theirs = dict(out["flexshard"]["counts"]), dict(out["fsdp2"]["counts"])
        assert ours.pop("all_reduce") == STEPS  # once per synced backward, not per micro
        assert ours == theirs
        assert out["flexshard"]["losses"] == out["fsdp2"]["losses"]


def _one_rank(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for name, shard in (("fsdp2", torch_fully_shard), ("flexshard", fs.fully_shard)):
        model = _build(shard, mesh, None)
        with record_collectives() as log:
            out[name] = {"losses": _train(model, rank, world, 2), "counts": dict(log.counts())}
        if name == "flexshard":
            out["stats"] = model.comm_stats()["total"]
    return out


def test_a_group_of_one_rank_issues_no_collective() -> None:
    """W = 1: FSDP2 copies instead of calling c10d, and so does flexshard (no all-gather,
    reduce-scatter or wait per bucket), with the same losses."""
    (out,) = run_distributed(_one_rank, 1)
    assert out["flexshard"]["counts"] == out["fsdp2"]["counts"] == {}
    assert out["stats"]["collectives"] == 0 and out["stats"]["bytes_sent"] == 0
    assert out["flexshard"]["losses"] == out["fsdp2"]["losses"]


class ChunkedLM(nn.Module):
    """A decoder whose head runs per chunk of the sequence (torchtitan's layout: each
    block is an FSDP module, and the embedding and ``[norm, head]``, or the three
    together when the head's weight is the embedding's)."""

    def __init__(self, dim: int = 17, vocab: int = 29, blocks: int = 3, tie: bool = False):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(blocks))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # the trunk: the head is skipped
        h = self.embed(tokens)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.norm(h)


def _chunked_loss_step(model: ChunkedLM, tokens: torch.Tensor, chunks: int, sync: bool) -> float:
    """torchtitan's ChunkedLossWrapper: the head kept unsharded over the chunks, its
    gradient sync off but for the last chunk, one backward per chunk on detached
    pieces, then one backward through the trunk (chunks + 1 backward calls)."""
    h = model(tokens)
    head = model.head
    head.set_reshard_after_forward(False)
    head.set_reshard_after_backward(False)
    head.set_requires_gradient_sync(False, recurse=False)
    head.unshard()
    total, grads = 0.0, []
    pieces = [c.detach().requires_grad_(True) for c in torch.chunk(h, chunks, dim=1)]
    for i, piece in enumerate(pieces):
        if i == chunks - 1:
            head.set_requires_gradient_sync(sync, recurse=False)
        loss = nn.functional.cross_entropy(
            head(piece).flatten(0, 1), tokens.chunk(chunks, dim=1)[i].flatten()
        )
        total += loss.item()
        loss.backward()
        grads.append(piece.grad)
    head.set_reshard_after_forward(True)
    head.set_reshard_after_backward(True)
    head.set_requires_gradient_sync(True, recurse=False)
    head.reshard()
    h.backward(torch.cat(grads, dim=1))
    return total


def _chunked_counts(rank: int, world: int, micro: int, tie: bool) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for name, shard in (("fsdp2", torch_fully_shard), ("flexshard", fs.fully_shard)):
        torch.manual_seed(0)
        model = ChunkedLM(tie=tie)
        if not tie:
            shard(model.embed, mesh=mesh)
        for block in model.blocks:
            shard(block, mesh=mesh)
        outer = [model.embed, model.norm, model.head] if tie else [model.norm, model.head]
        shard(outer, mesh=mesh, reshard_after_forward=False)
        shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(rank)
        steps = []
        for _ in range(STEPS):
            with record_collectives() as log:
                losses = []
                for m in range(micro):  # accumulation: all but the last micro-batch unsynced
                    model.set_requires_gradient_sync(m == micro - 1)
                    tokens = torch.randint(0, 29, (2, 12), generator=gen)
                    losses.append(_chunked_loss_step(model, tokens, 4, m == micro - 1))
                opt.step()
                opt.zero_grad()
            steps.append({"counts": dict(log.counts()), "losses": losses})
        params = {n: p.full_tensor() for n, p in model.named_parameters()}
        out[name] = {"steps": steps, "params": params}
    return out


@pytest.mark.skipif(
    torch.__version__ < "2.13", reason="torch before 2.13: its FSDP2 hangs in the chunked loss"
)
@pytest.mark.parametrize("world,micro,tie", [(3, 1, False), (2, 2, False), (2, 1, True)])
def test_chunked_loss_issues_no_more_than_fsdp2(world: int, micro: int, tie: bool) -> None:
    """Several backward calls per step (torchtitan's chunked loss, with accumulation):
    no collective of any kind more than FSDP2 issues (a backward call that does not
    reach a bucket leaves its reduction to the one that does), the same reductions,
    and bitwise FSDP2's results."""
    for rank, out in enumerate(run_distributed(_chunked_counts, world, micro, tie)):
        ours, theirs = out["flexshard"], out["fsdp2"]
        for step, (a, b) in enumerate(zip(ours["steps"], theirs["steps"])):
            assert a["losses"] == b["losses"], f"rank {rank} step {step}"
            for kind, count in a["counts"].items():
                assert count <= b["counts"].get(kind, 0), f"rank {rank} step {step}: {kind}"
            assert a["counts"]["reduce_scatter_single"] == b["counts"]["reduce_scatter_single"]
        differ = [n for n, p in theirs["params"].items() if not torch.equal(p, ours["params"][n])]
        assert differ == [], f"rank {rank}"
