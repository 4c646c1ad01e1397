"""MatrixOptimizer over optimizers nobody here wrote (pytorch-optimizer's SOAP and
Shampoo) against the same optimizer on one process over the full matrices: Owned,
Shard(0), a mixed bucket, W = 2 and 3 (4 and more placements in the slow test), zero
collectives where storage holds whole matrices (checkpoints: test_matrix_optim_state_dict)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard as TorchShard
from torch.distributed.tensor import distribute_tensor

import flexshard as fs
from flexshard.optim import MatrixOptimizer, matrix_balance, matrix_buckets, preconditioner_flops
from flexshard.testing import run_distributed
from flexshard.testing.collectives import forbid_collectives, record_collectives

from ..helpers.muon_cases import SHAPES, Mats, checked_step, full_grads, mixed_placement, set_grads

pytorch_optimizer = pytest.importorskip("pytorch_optimizer")
heavyball = pytest.importorskip("heavyball")
heavyball.utils.compile_mode = None  # eager: torch.compile on CPU costs minutes

NAMES = tuple(SHAPES)
STEPS = 3
#: two param groups (the second at twice the lr), both halved after each step by
#: torch's StepLR: per-group hyper-parameters and scheduler edits must pass through
GROUPS = (("a", "qkv", "e"), ("b", "c", "t"))
#: precondition_frequency 2: the eigenbases are recomputed inside the test's steps
OPTIMIZERS: dict[str, tuple[Any, dict]] = {
    "soap": (pytorch_optimizer.SOAP, {"lr": 0.01, "precondition_frequency": 2}),
    "shampoo": (pytorch_optimizer.Shampoo, {"lr": 0.01, "preconditioning_compute_steps": 2}),
    "heavyball_soap": (heavyball.SOAP, {"lr": 0.01, "multi_tensor": False}),
}

#: random probes from torch's global generator: bitwise only in one process (see
#: test_psgd_on_the_same_random_stream)
KNOWN = {**OPTIMIZERS, "psgd": (heavyball.PSGDKron, {"lr": 0.01})}


# name -> (buckets, communication-free)
CASES: dict[str, tuple[list[fs.BucketSpec], bool]] = {
    "owned": (
        [
            fs.BucketSpec(["a", "b", "c", "qkv", "t"], placement=fs.Owned(), name="owned"),
            fs.BucketSpec("e", placement=fs.Shard(0), name="experts"),  # whole experts
        ],
        True,
    ),
    "shard0": (
        [
            fs.BucketSpec(["a", "b", "t"], placement=fs.Shard(0), name="s1"),
            fs.BucketSpec(["c", "qkv"], placement=fs.Shard(0), name="s2"),
            fs.BucketSpec("e", placement=fs.Shard(1), name="experts"),  # experts split
        ],
        False,
    ),
    "mixed": ([fs.BucketSpec(list(NAMES), placement=mixed_placement, name="mix")], False),
    "planned": ([], True),  # matrix_buckets for the world size (split ones travel)
    "flat": ([fs.BucketSpec(list(NAMES), placement=fs.FlatShard(), name="flat")], False),
    "replicate": ([fs.BucketSpec(list(NAMES), placement=fs.Replicate(), name="rep")], False),
}
#: overlap=True (one inner step() per bucket, each while the next bucket's gather
#: flies) on a case's buckets: the same parameters and all-to-alls
OVERLAP = {"shard0_overlap": "shard0", "mixed_overlap": "mixed"}


def reference(optimizer: str, steps: int) -> dict[str, torch.Tensor]:
    """The inner optimizer on one process over the full matrices (each expert apart)."""
    cls, kwargs = KNOWN[optimizer]
    model = Mats()
    parts = {
        n: [torch.nn.Parameter(x.clone()) for x in (p.detach().unbind(0) if p.ndim == 3 else [p])]
        for n, p in model.named_parameters()
    }
    groups = [{"params": [p for n in names for p in parts[n]]} for names in GROUPS]
    opt = cls(groups, **kwargs)
    opt.param_groups[1]["lr"] *= 2
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for step in range(steps):
        grads = full_grads(NAMES, step)
        for name, ps in parts.items():
            g = grads[name]
            for p, part in zip(ps, g.unbind(0) if g.ndim == 3 else [g]):
                p.grad = part.clone()
        opt.step()
        schedule.step()
    return {
        n: torch.stack([p.detach() for p in ps]) if SHAPES[n].__len__() == 3 else ps[0].detach()
        for n, ps in parts.items()
    }


def _adapter(model: torch.nn.Module, optimizer: str, overlap: bool = False) -> MatrixOptimizer:
    cls, kwargs = KNOWN[optimizer]
    named = dict(model.named_parameters())
    groups = [{"params": [named[n] for n in names]} for names in GROUPS]
    opt = MatrixOptimizer(groups, cls, overlap=overlap, **kwargs)
    opt.param_groups[1]["lr"] *= 2
    return opt


def _run_case(case: str, optimizer: str, mesh, expected: dict) -> dict:
    overlap = case in OVERLAP
    buckets, comm_free = CASES[OVERLAP.get(case, case)]
    if case == "planned":  # too few matrices to own them all at W > 2: some travel
        buckets = matrix_buckets(Mats(), mesh.size())
        comm_free = not matrix_balance(Mats(), mesh.size()).split
    model = fs.flex_shard(Mats(), mesh=mesh, buckets=buckets)
    opt = _adapter(model, optimizer, overlap)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    with record_collectives() as log:
        for step in range(STEPS):
            set_grads(model, full_grads(NAMES, step))
            checked_step(opt, comm_free)
            schedule.step()
    full = fs.full_state_dict(model)
    return {
        "differ": [n for n in NAMES if not torch.equal(full[n], expected[n])],
        "counts": dict(log.counts()),
        "comm_free": comm_free,
        "buckets": len(buckets),
        **opt.comm_stats(),
    }


class RunningNorm(torch.optim.SGD):
    """SGD that also keeps a norm over all its parameters: state not per matrix."""

    def step(self, closure=None):  # type: ignore[override]
        loss = super().step(closure)
        norm = sum(float(p.grad.square().sum()) for g in self.param_groups for p in g["params"])
        self.state["grad_norm"] = {"value": norm}
        return loss


def _errors(mesh) -> None:
    """Clear errors, raised before anything is silently wrong."""
    model = fs.flex_shard(Mats(), mesh=mesh, buckets=CASES["shard0"][0])
    opt = MatrixOptimizer(model.parameters(), RunningNorm, lr=0.1)
    set_grads(model, full_grads(NAMES, 0))
    with pytest.raises(ValueError, match="state under str 'grad_norm'.*per matrix"):
        opt.step()
    tp = distribute_tensor(torch.randn(4, 6), mesh, [TorchShard(0)])
    with pytest.raises(TypeError, match="DTensor that flexshard did not shard"):
        MatrixOptimizer([torch.nn.Parameter(tp)], pytorch_optimizer.SOAP)
    soap = _adapter(model, "soap")
    set_grads(model, full_grads(NAMES, 0))
    soap.step()
    with pytest.raises(ValueError, match=r"overlap=True.*heavyball.*changes .*inner_group"):
        _adapter(model, "heavyball_soap", overlap=True)
    shampoo = _adapter(model, "shampoo")
    with pytest.raises(
        ValueError, match="state of parameter 'a' in bucket 's1' was made by .*SOAP.*runs .*Shampoo"
    ):
        shampoo.load_state_dict(soap.state_dict())


def _psgd_steps(seed: int) -> dict[str, torch.Tensor]:
    """heavyball's PSGD-Kron through the adapter on plain tensors (one process), as
    ``reference`` steps it, from torch's global generator seeded with ``seed``."""
    model = Mats()
    opt = _adapter(model, "psgd")
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    torch.manual_seed(seed)
    for step in range(STEPS):
        set_grads(model, full_grads(NAMES, step))
        opt.step()
        schedule.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def _psgd_on_owned(mesh) -> None:
    """PSGD on whole matrices at W = 3: no collective, and every parameter stepped
    (it is not compared with one process: see test_psgd_on_the_same_random_stream)."""
    model = fs.flex_shard(Mats(), mesh=mesh, buckets=CASES["owned"][0])
    with forbid_collectives():
        opt = MatrixOptimizer(model.parameters(), heavyball.PSGDKron, lr=0.01)
        for step in range(STEPS):
            set_grads(model, full_grads(NAMES, step))
            opt.step()
    full, start = fs.full_state_dict(model), dict(Mats().state_dict())
    assert all(torch.isfinite(full[n]).all() and not torch.equal(full[n], start[n]) for n in NAMES)


def _all_cases(rank: int, world_size: int, cases: tuple[str, ...], optimizers: tuple[str, ...]):
    mesh = init_device_mesh("cpu", (world_size,))
    if world_size == 3:
        _errors(mesh)
        _psgd_on_owned(mesh)
    out = {}
    for optimizer in optimizers:
        expected = reference(optimizer, STEPS)
        for case in cases:
            if case in OVERLAP and optimizer.startswith("heavyball"):
                continue  # counts its step() calls on itself: refused (see _errors)
            out[(case, optimizer)] = _run_case(case, optimizer, mesh, expected)
    return out


def _check(results: list[dict], cases: tuple[str, ...]) -> None:
    for (case, optimizer), first in results[0].items():
        stats = [r[(case, optimizer)] for r in results]
        assert all(s["differ"] == [] for s in stats), (case, optimizer, stats)
        comm_free, buckets = first["comm_free"], first["buckets"]
        if comm_free:
            assert all(s["all_to_all"] == 0 and s["bytes_sent"] == 0 for s in stats)
            continue
        # the same all-to-alls on every rank, two per bucket and step (a replicated
        # bucket's forward stays on the owner) and nothing else
        assert all(s["counts"] == first["counts"] for s in stats), (case, stats)
        per_step = buckets if case == "replicate" else 2 * buckets
        assert first["counts"] == {"all_to_all_single": STEPS * per_step}, (case, first)
        assert sum(s["bytes_sent"] for s in stats) == sum(s["bytes_received"] for s in stats)
        assert sum(s["bytes_sent"] for s in stats) > 0


@pytest.mark.parametrize("world_size", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_third_party_optimizers_match_one_process(world_size: int) -> None:
    """SOAP and Shampoo through the adapter equal the same optimizer on one process
    over the full matrices, bit for bit: the owner of a matrix runs the very same
    arithmetic on the same full gradient and parameter."""
    cases = ("owned", "shard0", "mixed", "planned", "mixed_overlap")
    results = run_distributed(_all_cases, world_size, cases, tuple(OPTIMIZERS), timeout=240)
    _check(results, cases)


def test_psgd_on_the_same_random_stream() -> None:
    """heavyball's PSGD-Kron draws random probes from torch's global generator, in the
    order it visits matrices in one step() call. In one process the adapter visits
    them in the parameters' order, so with the same seed it equals PSGD over the full
    matrices bit for bit; a rank of a sharded run steps a subset, so its k-th draw
    belongs to another matrix than one process's, and it cannot be compared bitwise."""
    expected = {}
    for seed in (5, 6):
        torch.manual_seed(seed)
        expected[seed] = reference("psgd", STEPS)
    got = _psgd_steps(5)
    assert [n for n in NAMES if not torch.equal(got[n], expected[5][n])] == []
    # and the stream matters: another seed gives other parameters
    assert all(not torch.equal(expected[5][n], expected[6][n]) for n in NAMES)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_placement(world_size: int) -> None:
    cases = (*CASES, *OVERLAP)
    results = run_distributed(_all_cases, world_size, cases, tuple(OPTIMIZERS), timeout=600)
    _check(results, cases)


def test_planner_balances_on_the_optimizers_cost() -> None:
    """A model without blocks: one ``outer`` bucket; parameters whole (experts one tile
    each) where they fit under the storage cap, split (redistributed) where not, and the
    work, split matrices included, no rank above the mean by more than the largest."""
    model = Mats()
    for world_size in (2, 3, 4):
        specs = matrix_buckets(model, world_size)
        assert [s.name for s in specs] == ["outer"]
        balance = matrix_balance(model, world_size)
        assert balance.storage_imbalance <= 1.05
        costs = [preconditioner_flops(s[-2:]) for s in SHAPES.values()]
        total = sum(c * (s[0] if len(s) == 3 else 1) for c, s in zip(costs, SHAPES.values()))
        assert sum(balance.flops) == pytest.approx(total)
        assert max(balance.flops) <= total / world_size + max(costs)
    # a cost that makes one matrix dominate changes the plan: nothing else joins it
    heavy = matrix_balance(model, 3, cost=lambda s: 1e9 if s == (54, 18) else 1.0)
    assert max(heavy.flops) == 1e9


def test_row_blocks_by_name_step_each_block_as_its_own_matrix() -> None:
    """``row_blocks`` as FQN globs (the trainer's ``muon_row_blocks``): a fused
    ``kv_a_proj_with_mqa`` of 12 latent + 4 rotated-key rows steps as two matrices,
    exactly as SOAP on the two blocks apart; the unmatched matrix stays whole."""
    torch.manual_seed(0)
    layers = {"kv_a_proj_with_mqa": torch.nn.Linear(8, 16, bias=False)}
    model = torch.nn.ModuleDict(
        {"attn": torch.nn.ModuleDict(layers), "o": torch.nn.Linear(8, 8, bias=False)}
    )
    fused, other = layers["kv_a_proj_with_mqa"].weight, model["o"].weight
    blocks = [fused[:12].detach().clone(), fused[12:].detach().clone(), other.detach().clone()]
    whole = fused.detach().clone()
    cls, options = OPTIMIZERS["soap"]
    opt = MatrixOptimizer(
        model.named_parameters(), cls, row_blocks={"*.kv_a_proj_with_mqa.weight": 12}, **options
    )
    # the given group is split by option: the fused weight's group steps it per block
    assert [g["row_blocks"] for g in opt.param_groups] == [12, False]
    apart = [torch.nn.Parameter(b) for b in blocks]
    unsplit = torch.nn.Parameter(whole)
    ref, ref_whole = cls(apart, **options), cls([unsplit], **options)
    for _ in range(STEPS):
        grads = {name: torch.randn_like(p) for name, p in model.named_parameters()}
        for name, p in model.named_parameters():
            p.grad = grads[name].clone()
        g = grads["attn.kv_a_proj_with_mqa.weight"]
        for p, gb in zip(apart, (g[:12], g[12:], grads["o.weight"])):
            p.grad = gb.clone()
        unsplit.grad = g.clone()
        for o in (opt, ref, ref_whole):
            o.step()
    assert torch.equal(fused.detach(), torch.cat([apart[0], apart[1]]).detach())
    assert torch.equal(other.detach(), apart[2].detach())
    assert not torch.allclose(fused.detach(), unsplit.detach(), atol=1e-4)  # the split shows
    # one SOAP state per block: its preconditioners are sized by the block's rows
    states = [s for s in opt.inner.state.values() if s]
    assert sorted(tuple(s["GG"][0].shape) for s in states if "GG" in s) == sorted(
        tuple(ref.state[p]["GG"][0].shape) for p in apart
    )


def test_row_blocks_by_name_needs_names() -> None:
    model = torch.nn.Linear(8, 16, bias=False)
    with pytest.raises(ValueError, match="row_blocks by FQN glob needs named parameters"):
        MatrixOptimizer(model.parameters(), OPTIMIZERS["soap"][0], row_blocks={"*": 4})
