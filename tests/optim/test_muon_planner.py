"""muon_buckets / matrix_buckets: one ragged bucket per block plus ``outer``, owners
pinned across the whole model under a storage cap, split where owning costs more.
Layout arithmetic on meta models (no processes), then DistMuon on the plan against
torch.optim.Muon at W = 3 and 4."""

from __future__ import annotations

import fnmatch

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import flexshard as fs
from flexshard.optim import DistMuon, matrix_balance, matrix_buckets, muon_balance, muon_buckets
from flexshard.optim.planner import STORAGE_SLACK
from flexshard.placements.layout import plan_bucket
from flexshard.testing import run_distributed
from flexshard.testing.collectives import forbid_collectives

from ..helpers.muon_cases import local_part


class LlamaBlock(nn.Module):
    def __init__(self, dim: int, kv: int, ffn: int) -> None:
        super().__init__()
        for name, (rows, cols) in {
            "wq": (dim, dim),
            "wk": (kv, dim),
            "wv": (kv, dim),
            "wo": (dim, dim),
            "w1": (ffn, dim),
            "w3": (ffn, dim),
            "w2": (dim, ffn),
        }.items():
            setattr(self, name, nn.Linear(cols, rows, bias=False))
        self.attn_norm = nn.RMSNorm(dim)
        self.ffn_norm = nn.RMSNorm(dim)


class Llama(nn.Module):
    def __init__(self, layers: int, dim: int, kv: int, ffn: int, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(LlamaBlock(dim, kv, ffn) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)


def _llama_8b() -> nn.Module:
    with torch.device("meta"):
        return Llama(32, 4096, 1024, 14336, 128256)


def _layouts(model: nn.Module, specs: list[fs.BucketSpec], world_size: int) -> dict:
    """Each bucket's ragged layout, from the specs alone (as flex_shard plans them)."""
    params = dict(model.named_parameters())
    taken: dict[str, str] = {}
    out = {}
    for spec in specs:
        names = [n for n in params if any(fnmatch.fnmatchcase(n, p) for p in spec.pattern_list)]
        for n in names:
            assert n not in taken, f"{n} in {taken[n]} and {spec.name}"
            taken[n] = spec.name
        entries = [(n, tuple(params[n].shape), spec.placement(n, params[n])) for n in names]
        out[spec.name] = plan_bucket(entries, world_size, spec.name, ragged=spec.ragged)
    assert set(taken) == set(params)  # every parameter in exactly one bucket
    return out


@pytest.mark.parametrize("world_size", [64, 256, 1024])
def test_llama_8b_per_block_buckets_level_storage(world_size: int) -> None:
    model = _llama_8b()
    specs = muon_buckets(model, world_size)
    assert [s.name for s in specs] == [*(f"layers.{i}" for i in range(32)), "outer"]
    assert all(s.ragged for s in specs)
    assert specs[0].pattern_list == ["layers.0.*"]
    layouts = _layouts(model, specs, world_size)
    storage = [sum(layout.extent(r) for layout in layouts.values()) for r in range(world_size)]
    mean = sum(storage) / world_size
    assert max(storage) / mean <= STORAGE_SLACK
    balance = muon_balance(model, world_size)
    assert balance.storage == tuple(storage)
    assert balance.storage_imbalance <= STORAGE_SLACK
    # a gathered block is the block: ragged, no padding beyond Shard(0)'s own
    block = layouts["layers.0"]
    assert block.wire_numel <= sum(p.numel for p in block.params) + world_size * 2 * 4096
    # split matrices are stored in flat ranges (even however few their rows); the rest
    # whole on one rank
    placements = {p.fqn: s.placement(p.fqn, None) for s in specs for p in layouts[s.name].params}
    split = {n for n, p in placements.items() if isinstance(p, fs.FlatShard)}
    assert split == set(balance.split)
    owned = [n for n, p in placements.items() if isinstance(p, fs.Owned)]
    assert len(split) + len(owned) == 32 * 7
    # the big ones split first: some FFN matrices at 64 ranks, every matrix at more ranks
    # than matrices (FSDP2's storage, with a redistributing DistMuon)
    ffn = {f"layers.{i}.{m}.weight" for i in range(32) for m in ("w1", "w2", "w3")}
    if world_size == 64:
        assert split and split <= ffn
    else:
        assert len(split) == 32 * 7
    if world_size == 64:  # owned matrices: Newton–Schulz near level too
        assert balance.imbalance < 1.3


def test_row_blocks_owned_whole_at_moderate_scale() -> None:
    specs = muon_buckets(_llama_8b(), 64, row_blocks={"*.wq.weight": 128})
    wq = specs[3].placement("layers.3.wq.weight", None)
    assert isinstance(wq, fs.Owned) and wq.rank is not None
    balance = muon_balance(_llama_8b(), 64, row_blocks={"*.wq.weight": 128})
    assert balance.storage_imbalance <= STORAGE_SLACK


class Odd(nn.Module):
    """17-row matrices that divide no W, an expert stack, biases and a frozen buffer-like
    parameter, under a ModuleList; an embedding outside."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(17, 6)
        self.blocks = nn.ModuleList(nn.ModuleDict() for _ in range(3))
        for i, block in enumerate(self.blocks):
            block["up"] = nn.Linear(6, 17)
            block["down"] = nn.Linear(17, 6)
            if i == 1:
                block.register_parameter("experts", nn.Parameter(torch.zeros(5, 17, 6)))
        self.frozen = nn.Parameter(torch.zeros(17, 3), requires_grad=False)
        self.out = nn.Linear(6, 17)


@pytest.mark.parametrize("world_size", [3, 7])
def test_odd_world_sizes_and_shapes(world_size: int) -> None:
    model = Odd()
    specs = muon_buckets(model, world_size)
    assert [s.name for s in specs] == ["blocks.0", "blocks.1", "blocks.2", "outer"]
    layouts = _layouts(model, specs, world_size)
    balance = muon_balance(model, world_size)
    storage = [sum(lay.extent(r) for lay in layouts.values()) for r in range(world_size)]
    assert balance.storage == tuple(storage)
    experts = specs[1].placement("blocks.1.experts", None)
    # one tile per expert, each pinned by the plan, or whole experts in Shard(0) rows
    if "blocks.1.experts" in balance.split:
        assert experts == fs.Shard(0)
    else:
        assert experts.block == (17, 6) and len(experts.owners) == 5
    for spec in specs[:3]:
        for p in layouts[spec.name].params:
            placement = spec.placement(p.fqn, None)
            if p.fqn in balance.split:
                assert placement == fs.FlatShard()
            elif p.fqn.endswith(("up.weight", "down.weight")):
                assert isinstance(placement, fs.Owned) and placement.rank is not None
            elif p.fqn.endswith("bias"):
                assert placement == fs.Shard(0)
    assert specs[-1].placement("frozen", None) == fs.Shard(0)
    # matrix_buckets: the same code path, every trainable parameter a matrix
    mspecs = matrix_buckets(model, world_size)
    assert [s.name for s in mspecs] == [s.name for s in specs]
    mbalance = matrix_balance(model, world_size)
    assert mbalance.storage_imbalance <= STORAGE_SLACK
    _layouts(model, mspecs, world_size)


# ---------------------------------------------------------------- DistMuon on the plan

ROWS = 4  # qkv's row blocks: 17 rows in blocks of 4, 4, 4, 4, 1
LR = 0.02
STEPS = 3


class Block(nn.Module):
    def __init__(self, big: bool) -> None:
        super().__init__()
        self.qkv = nn.Parameter(torch.randn(17, 10))
        self.a = nn.Parameter(torch.randn(10, 17))
        self.b = nn.Parameter(torch.randn(17, 10))
        self.norm = nn.Parameter(torch.ones(10))
        if big:  # larger than any rank's share: split
            self.big = nn.Parameter(torch.randn(80, 17))


class Net(nn.Module):
    def __init__(self, big: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Parameter(torch.randn(9, 10))
        self.layers = nn.ModuleList(Block(big and i == 0) for i in range(4))


def _is_muon(name: str) -> bool:
    return name.split(".")[-1] in ("qkv", "a", "b", "big")


def _grads(model: nn.Module, step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return {n: torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}


def _reference(big: bool) -> dict[str, torch.Tensor]:
    """torch.optim.Muon on the full matrices, qkv one matrix per block of ROWS rows."""
    model = Net(big)
    parts = {
        n: [nn.Parameter(x.clone()) for x in (p.detach().split(ROWS) if "qkv" in n else [p])]
        for n, p in model.named_parameters()
        if _is_muon(n)
    }
    opt = torch.optim.Muon([p for ps in parts.values() for p in ps], lr=LR)
    for step in range(STEPS):
        grads = _grads(model, step)
        for n, ps in parts.items():
            for p, g in zip(ps, grads[n].split(ROWS) if "qkv" in n else [grads[n]]):
                p.grad = g.clone()
        opt.step()
    return {n: torch.cat([p.detach() for p in ps]) for n, ps in parts.items()}


def _planned_step(rank: int, world_size: int) -> dict:
    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for big in (False, True):
        model = Net(big)
        row_blocks = {"*.qkv": ROWS}
        plan = {
            "row_blocks": row_blocks,
            "adamw_patterns": ["embed", "*.norm"],
            "detect_head": False,
        }
        split = muon_balance(model, world_size, **plan).split
        specs = muon_buckets(model, world_size, **plan)
        fs.flex_shard(model, mesh=mesh, buckets=specs)
        named = [(n, p) for n, p in model.named_parameters() if _is_muon(n)]
        opt = DistMuon(
            [
                {"params": [p for n, p in named if "qkv" not in n]},
                {"params": [p for n, p in named if "qkv" in n], "row_blocks": ROWS},
            ],
            lr=LR,
        )
        for step in range(STEPS):
            for n, p in model.named_parameters():
                p.grad = local_part(p, _grads(Net(big), step)[n])
            if not split:
                with forbid_collectives():
                    opt.step()
            else:
                opt.step()
        full = fs.full_state_dict(model)
        ref = _reference(big)
        out[big] = {
            "differ": [n for n in ref if not torch.equal(full[n], ref[n])],
            "split": split,
            "buckets": [s.name for s in specs],
            **opt.comm_stats(),
        }
    return out


@pytest.mark.parametrize("world_size", [3, 4])
def test_dist_muon_on_the_plan_is_torch_muon(world_size: int) -> None:
    results = run_distributed(_planned_step, world_size, timeout=240)
    for r in results:
        level, split = r[False], r[True]
        assert level["differ"] == [] and split["differ"] == []
        assert level["buckets"] == ["layers.0", "layers.1", "layers.2", "layers.3", "outer"]
        # whole matrices everywhere: the step moves no byte
        assert level["split"] == () and level["all_to_all"] == level["bytes_sent"] == 0
        # the one matrix too large to own travels: two all-to-alls per step, its bucket's
        assert split["split"] == ("layers.0.big",)
        assert split["all_to_all"] == 2 * STEPS
    sent = sum(r[True]["bytes_sent"] for r in results)
    # bf16 both ways: every rank's rows but the owner's go to it and come back
    assert 0 < sent <= 2 * STEPS * 80 * 17 * 2
