"""A parameter that got no gradient on any rank keeps ``.grad`` None, as in FSDP2 (so
AdamW's moments and weight decay leave it alone), while one used on some ranks only
still gets its reduced gradient everywhere; runtime/hooks.py.

Every placement (Shard through fully_shard, FlatShard, Owned, BlockShard, Replicate, a
mixed bucket; W = 3 and 1; HSDP 2x2) against one process: head ``b`` used on every
rank, on none, on rank 0 only, and a backward without ``zero_grad`` before one that
leaves ``b`` unused (its old gradient stays). Checked after every backward: which
gradients are None, their values, the post-accumulate-grad hook calls, the agreement's
all-reduces and which of them this rank waited for (a rank that had every gradient
leaves them running until the next agreement); after every AdamW step, the
parameters. fully_shard by default issues no agreement (FSDP2's collectives) and each
rank decides alone, with the same gradients here; ``set_agree_on_unused_params(True)``
brings the agreement back. Also DistMuon with ``b`` unused and gradient accumulation
without sync."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import flexshard as fs
from flexshard.optim import muon_and_adamw, muon_buckets
from flexshard.runtime.collectives import Pending
from flexshard.testing import run_distributed


class Heads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 17)
        self.a = nn.Linear(17, 16)
        self.b = nn.Linear(17, 16)

    def forward(self, x: torch.Tensor, who: str, rank: int) -> torch.Tensor:
        """``who`` uses head b: "all", "none" (b never runs) or "rank0" (b runs on every
        rank, as a sharded module must, and rank 0 alone uses its output)."""
        h = torch.tanh(self.body(x))
        loss = self.a(h).pow(2).mean()
        b = self.b(h).pow(2).mean() if who != "none" else None
        return loss + b if who == "all" or (who == "rank0" and rank == 0) else loss


# (who uses head b, zero_grad after the step, optimizer step) per backward
STEPS = [("all", True, True), ("none", True, True), ("rank0", True, True)]
STEPS += [("all", False, False), ("none", True, True)]
B_GRADS = 3  # backwards that give b a gradient: its hooks' calls on every rank

PLACEMENTS = {
    "flat": fs.FlatShard(),
    "owned": fs.Owned(),
    "block": fs.BlockShard((8, 8)),
    "replicate": fs.Replicate(),
}


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))


def _build(name: str, mesh) -> nn.Module:
    torch.manual_seed(0)
    model = Heads()
    if name.startswith("fully_shard"):  # b grouped with body, whose backward runs everywhere
        # (alone, b's backward re-gather would run on some ranks only, and hang)
        fs.fully_shard([model.body, model.b], mesh=mesh)
        fs.fully_shard(model.a, mesh=mesh)
        fs.fully_shard(model, mesh=mesh)
        # fully_shard's default issues FSDP2's collectives only: each rank decides alone
        model.set_agree_on_unused_params(name == "fully_shard_agreeing")
        return model
    if name == "mixed":
        placement = {"a.weight": fs.Owned(), "b.weight": fs.BlockShard((8, 8))}
        spec = fs.BucketSpec("*", placement=lambda fqn, p: placement.get(fqn, fs.FlatShard()))
        return fs.flex_shard(model, mesh=mesh, buckets=[spec])
    placement = PLACEMENTS[name]  # b's bucket is gathered by body's forward everywhere
    buckets = [fs.BucketSpec(["body.*", "b.*"], placement=placement), fs.BucketSpec("a.*")]
    return fs.flex_shard(model, mesh=mesh, buckets=buckets)


def _agreement_waits() -> list[int]:
    """A list that grows by one whenever this process waits for an agreement all-reduce
    (``Pending.wait`` wrapped once per rank process)."""
    if not hasattr(Pending, "agreement_waits"):
        wait, waits = Pending.wait, []

        def counted(pending: Pending) -> None:
            if pending.collective == "unused-parameter agreement all-reduce":
                waits.append(1)
            wait(pending)

        Pending.wait, Pending.agreement_waits = counted, waits
    return Pending.agreement_waits


def _train(rank: int, world: int, name: str, mesh) -> list[str]:
    """Sharded and single-process runs side by side; what differed, per backward."""
    model = _build(name, mesh)
    groups = sum(size > 1 for size in mesh.shape)  # HSDP: shard group, then replicas
    if name == "fully_shard":  # no agreement: no all-reduce, and nobody waits for one
        groups = 0
    waits = _agreement_waits()
    left_running = 0  # agreements of the previous backward this rank did not wait for
    torch.manual_seed(0)
    reference = Heads()
    calls = {n: 0 for n, _ in model.named_parameters()}
    for n, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _p, n=n: calls.__setitem__(n, calls[n] + 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    problems = []
    for step, (who, zero, stepped) in enumerate(STEPS):
        waits.clear()
        model(_batch(step, rank), who, rank).backward()
        lacked = who == "none" or (who == "rank0" and rank != 0)
        expected = left_running + (groups if lacked else 0)
        if len(waits) != expected:
            problems.append(f"step {step} ({who}): {len(waits)} agreement waits, not {expected}")
        left_running = 0 if lacked else groups
        for r in range(world):
            (reference(_batch(step, r), who, r) / world).backward()
        for (n, p), q in zip(model.named_parameters(), reference.parameters()):
            if (p.grad is None) != (q.grad is None):
                problems.append(f"step {step} ({who}): {n}.grad is {p.grad}, expected {q.grad}")
            elif q.grad is not None and not torch.allclose(p.grad.full_tensor(), q.grad, atol=1e-6):
                problems.append(f"step {step} ({who}): {n}.grad differs")
        if stepped:
            b_before = model.b.weight.full_tensor().clone()
            opt.step()
            ref_opt.step()
            no_grad = reference.b.weight.grad is None
            if no_grad and not torch.equal(model.b.weight.full_tensor(), b_before):
                problems.append(f"step {step}: b.weight moved without a gradient")
        if zero:
            opt.zero_grad()
            ref_opt.zero_grad()
    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        if not torch.allclose(p.full_tensor(), q, atol=1e-5):
            problems.append(f"{n} differs after training")
    expected_calls = {n: B_GRADS if n.startswith("b.") else len(STEPS) for n in calls}
    if calls != expected_calls:
        problems.append(f"post-accumulate-grad hook calls {calls}, expected {expected_calls}")
    agreement = model.comm_stats()["grad_agreement"]["all_reduce"]
    if agreement != groups * len(STEPS):
        problems.append(f"{agreement} agreement all-reduces, expected {groups * len(STEPS)}")
    return problems


def _every_placement(rank: int, world: int) -> dict[str, list[str]]:
    mesh = init_device_mesh("cpu", (world,))
    names = ["fully_shard", "fully_shard_agreeing", "mixed", *PLACEMENTS]
    return {name: _train(rank, world, name, mesh) for name in names}


@pytest.mark.parametrize("world", [3, 1])
def test_unused_everywhere_keeps_none_on_every_placement(world: int) -> None:
    for per_rank in run_distributed(_every_placement, world):
        assert per_rank == {name: [] for name in per_rank}


def _replica_accumulation(rank: int, world: int, mesh, reduce_unused: bool) -> list[str]:
    """HSDP with ``set_requires_all_reduce(False)`` on the first microbatch of each
    step: b used on rank 0 only there (one replica) still gets its gradient everywhere
    after the synced microbatch; b unused in both keeps None on every rank (zeros with
    ``set_reduce_scatter_unused_params(True)``)."""
    model = _build("block", mesh)
    model.set_reduce_scatter_unused_params(reduce_unused)
    torch.manual_seed(0)
    reference = Heads()
    problems = []
    for step, whos in enumerate((("rank0", "none"), ("none", "none"), ("all", "rank0"))):
        for micro, who in enumerate(whos):
            model.set_requires_all_reduce(micro == len(whos) - 1)
            model(_batch(10 * step + micro, rank), who, rank).backward()
            for r in range(world):
                (reference(_batch(10 * step + micro, r), who, r) / world).backward()
        for (n, p), q in zip(model.named_parameters(), reference.parameters()):
            expected = q.grad
            if expected is None and reduce_unused:
                expected = torch.zeros_like(q)
            if (p.grad is None) != (expected is None):
                problems.append(f"step {step} {whos}: {n}.grad is {p.grad}, expected {expected}")
            elif expected is not None and not torch.allclose(
                p.grad.full_tensor(), expected, atol=1e-6
            ):
                problems.append(f"step {step} {whos}: {n}.grad differs")
            p.grad = q.grad = None
    return problems


def _hsdp(rank: int, world: int) -> dict[str, list[str]]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    names = ("fully_shard", "fully_shard_agreeing", "block")
    out = {name: _train(rank, world, name, mesh) for name in names}
    out["replica_accumulation"] = _replica_accumulation(rank, world, mesh, False)
    out["replica_accumulation_zeros"] = _replica_accumulation(rank, world, mesh, True)
    return out


def test_unused_everywhere_hsdp() -> None:
    for per_rank in run_distributed(_hsdp, 4):
        assert per_rank == {name: [] for name in per_rank}


def _muon_and_accumulation(rank: int, world: int) -> dict[str, object]:
    """DistMuon steps ``a`` and leaves ``b`` (no gradient on any rank) untouched on every
    rank, with no collective out of step; a no-sync microbatch that used ``b`` on rank 0
    only still gives it a gradient at the synced one."""
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = Heads()
    fs.flex_shard(model, mesh=mesh, buckets=muon_buckets(model, world))
    opt = muon_and_adamw(model, lr=0.02, adamw_lr=1e-2)
    before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    model(_batch(0, rank), "none", rank).backward()
    none_grads = [n for n, p in model.named_parameters() if p.grad is None]
    opt.step()
    opt.zero_grad()
    moved = [n for n, p in model.named_parameters() if not torch.equal(p.full_tensor(), before[n])]
    model.set_requires_gradient_sync(False)
    model(_batch(1, rank), "rank0", rank).backward()
    model.set_requires_gradient_sync(True)
    model(_batch(2, rank), "none", rank).backward()
    torch.manual_seed(0)
    reference = Heads()
    reference.load_state_dict({n: p.full_tensor() for n, p in model.named_parameters()})
    for r in range(world):
        reference(_batch(1, r), "rank0", r).div(world).backward()
        reference(_batch(2, r), "none", r).div(world).backward()
    grads_match = all(
        torch.allclose(p.grad.full_tensor(), q.grad, atol=1e-6)
        for p, q in zip(model.parameters(), reference.parameters())
    )
    return {"none": none_grads, "moved": moved, "accumulated": grads_match}


def test_distmuon_and_no_sync_accumulation() -> None:
    for out in run_distributed(_muon_and_accumulation, 3):
        assert out["none"] == ["b.weight", "b.bias"]
        assert out["moved"] == ["body.weight", "body.bias", "a.weight", "a.bias"]
        assert out["accumulated"] is True
