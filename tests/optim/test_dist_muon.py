"""DistMuon against torch.optim.Muon: every placement, W = 2, 3 and 4, HSDP, empty
shards, zero collectives where storage holds whole matrices, row blocks the storage cuts
(redistributed, per block on the owner), the pipeline order, bad storage, rank-local
state dicts and a checkpoint resumed at another world size."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard as TorchShard
from torch.distributed.tensor import distribute_tensor

import flexshard as fs
from flexshard import checkpoint as ckpt
from flexshard.optim import DistMuon, MatrixOptimizer
from flexshard.optim.matrices import Kind
from flexshard.testing import run_distributed
from flexshard.testing.collectives import (
    CollectiveForbidden,
    forbid_collectives,
    record_collectives,
)

from ..helpers.muon_cases import (
    HEAD_ROWS,
    LR,
    SHAPES,
    STEPS,
    Mats,
    full_grads,
    mixed_placement,
    reference_params,
    set_grads,
)

NAMES = tuple(SHAPES)
MATRICES = ("a", "b", "c", "qkv", "t")
#: batched bf16 GEMMs may round differently from one 2-D GEMM per expert: allow one
#: bf16 rounding (2^-8 relative) of each step's update, whose entries are below 1
EXPERT_ATOL = STEPS * LR * 2.0**-8


# name -> (buckets, row_blocks option per parameter, communication-free)
CASES = {
    "owned": (
        [
            fs.BucketSpec(list(MATRICES), placement=fs.Owned(), name="owned"),
            fs.BucketSpec("e", placement=fs.Shard(0), name="experts"),  # whole experts
        ],
        {},
        True,
    ),
    "row_blocks": (
        [
            fs.BucketSpec(["qkv", "c"], placement=fs.BlockShard((6, 18)), name="heads"),
            fs.BucketSpec(["a", "b", "t"], placement=fs.Owned(), name="owned"),
            fs.BucketSpec("e", placement=fs.BlockShard((17, 10)), name="experts"),
        ],
        {"qkv": True, "c": True},  # each stored tile is a head
        True,
    ),
    "row_blocks_by_rows": (  # tiles of two heads, Muon per head of 6 rows
        [
            fs.BucketSpec(["qkv", "c"], placement=fs.BlockShard((12, 18)), name="heads"),
            fs.BucketSpec(["a", "b", "t", "e"], placement=fs.Owned(), name="owned"),
        ],
        {"qkv": 6, "c": 6},
        True,
    ),
    "shard0": (
        [
            fs.BucketSpec(["a", "b"], placement=fs.Shard(0), name="s1"),
            fs.BucketSpec(["c", "qkv", "t"], placement=fs.Shard(0), name="s2"),
            fs.BucketSpec("e", placement=fs.Shard(1), name="experts"),  # experts split
        ],
        {},
        False,
    ),
    "flat": (
        [
            fs.BucketSpec(["a", "b", "c"], placement=fs.FlatShard(), name="f1"),
            fs.BucketSpec(["qkv", "t", "e"], placement=fs.FlatShard(), name="f2"),
        ],
        {},
        False,
    ),
    "tiles": (
        [fs.BucketSpec(list(NAMES), placement=fs.BlockShard((8, 8)), name="tiles")],
        {},
        False,
    ),
    "replicate": (
        [fs.BucketSpec(list(NAMES), placement=fs.Replicate(), name="rep")],
        {},
        False,
    ),
    "mixed": ([fs.BucketSpec(list(NAMES), placement=mixed_placement, name="mix")], {}, False),
    "tiny_alone": (  # a bucket some ranks hold nothing of (3 rows on 4 ranks)
        [
            fs.BucketSpec("t", placement=fs.Shard(0), name="tiny"),
            fs.BucketSpec(["a", "b", "c", "qkv", "e"], placement=fs.Shard(0), name="rest"),
        ],
        {},
        False,
    ),
}


def _optimizer(model: torch.nn.Module, row_blocks: dict) -> DistMuon:
    named = list(model.named_parameters())
    groups = [{"params": [p for n, p in named if n not in row_blocks]}]
    for option in set(row_blocks.values()):
        blocks = [p for n, p in named if row_blocks.get(n) == option]
        groups.append({"params": blocks, "row_blocks": option})
    return DistMuon(groups, lr=LR)


def _run_case(name: str, mesh) -> dict:
    buckets, row_blocks, comm_free = CASES[name]
    model = fs.flex_shard(Mats(), mesh=mesh, buckets=buckets)
    opt = _optimizer(model, row_blocks)
    counts: Counter[str] = Counter()
    for step in range(STEPS):
        set_grads(model, full_grads(NAMES, step))
        if comm_free:
            with forbid_collectives():
                opt.step()
        else:
            with record_collectives() as log:
                opt.step()
            counts.update(log.counts())
    for param in model.parameters():  # state shaped like the local shard
        assert opt.state[param]["momentum_buffer"].shape == param.shape
    full = fs.full_state_dict(model)
    ref = reference_params(NAMES, STEPS, tuple(row_blocks))
    for key in MATRICES:
        assert torch.equal(full[key], ref[key]), f"{name}: {key} differs from torch Muon"
    if opt._targets[id(model.e)].kind is Kind.REMOTE:  # expert by expert, 2-D: exact
        assert torch.equal(full["e"], ref["e"]), f"{name}: e differs from torch Muon"
    else:  # whole experts on a rank: batched Newton–Schulz
        torch.testing.assert_close(full["e"], ref["e"], rtol=0, atol=EXPERT_ATOL)
    return {"counts": dict(counts), **opt.comm_stats()}


def _resume_bitwise(mesh) -> None:
    """A rank-local optimizer state dict saved after two steps, loaded into a new
    DistMuon, gives bit for bit the same third step."""
    model = fs.flex_shard(Mats(), mesh=mesh, buckets=CASES["shard0"][0])
    opt = DistMuon(model.parameters(), lr=LR)
    for step in range(2):
        set_grads(model, full_grads(NAMES, step))
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    before = [p.detach().clone() for p in model.parameters()]
    set_grads(model, full_grads(NAMES, 2))
    opt.step()
    after = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for param, value in zip(model.parameters(), before):
            param.copy_(value)
    fresh = DistMuon(model.parameters(), lr=LR)
    fresh.load_state_dict(saved)
    set_grads(model, full_grads(NAMES, 2))
    fresh.step()
    for param, value in zip(model.parameters(), after):
        assert torch.equal(param, value)


def _guard_catches_redistribution(mesh) -> None:
    """The guard of the communication-free cases does fail a step that communicates."""
    model = fs.flex_shard(Mats(), mesh=mesh, buckets=CASES["shard0"][0])
    opt = DistMuon(model.parameters(), lr=LR)
    set_grads(model, full_grads(NAMES, 0))
    # the exchange is bounded like every flexshard collective: the guard's error comes
    # back as the CollectiveError naming the bucket and the all-to-all
    with pytest.raises(fs.CollectiveError, match="all_to_all_single ran while") as caught:
        with forbid_collectives():
            opt.step()
    assert isinstance(caught.value.backend_error, CollectiveForbidden)
    assert "DistMuon forward all-to-all of bucket" in str(caught.value)


def _bad_inputs(mesh) -> None:
    """Storage that per-block Muon cannot use raises ValueError naming the parameter and
    its bucket, while the optimizer is built: before any collective."""
    tiles = fs.flex_shard(Mats(), mesh=mesh, buckets=[fs.BucketSpec("*", fs.BlockShard((8, 8)))])
    rows = fs.flex_shard(Mats(), mesh=mesh, buckets=[fs.BucketSpec("*", fs.Shard(0), name="rows")])
    qkv_tiles = {"params": [tiles.qkv], "row_blocks": True}
    tp = distribute_tensor(torch.zeros(8, 4), mesh, [TorchShard(0)])  # scatters: outside
    linear = fs.flex_shard(
        torch.nn.Linear(5, 3), mesh=mesh, buckets=[fs.BucketSpec("*", name="lin")]
    )
    with forbid_collectives():
        with pytest.raises(ValueError, match="'qkv' in bucket 'bucket0'.*not whole blocks"):
            DistMuon([qkv_tiles])
        # MatrixOptimizer steps row blocks only where they are stored (14-row chunks)
        qkv_rows = {"params": [rows.qkv], "row_blocks": HEAD_ROWS}
        with pytest.raises(
            ValueError, match="MatrixOptimizer: .*'qkv' in bucket 'rows'.*blocks of 6"
        ):
            MatrixOptimizer([qkv_rows], torch.optim.SGD, lr=LR)
        with pytest.raises(ValueError, match="row_blocks takes 2-D.*'e' in bucket 'rows'"):
            DistMuon([{"params": [rows.e], "row_blocks": True}])
        with pytest.raises(ValueError, match="parameter 'bias' in bucket 'lin' has shape"):
            DistMuon(linear.parameters())
        with pytest.raises(TypeError, match="DTensor"):
            DistMuon([torch.nn.Parameter(tp)])
        for bad in ({"ns_steps": 100}, {"lr": -1.0}, {"momentum": 1.0}):
            with pytest.raises(ValueError, match=next(iter(bad))):
                DistMuon(rows.parameters(), **bad)


#: row blocks the storage cuts (Shard(0) rows and flat ranges, and tiles narrower than
#: the matrix): 17 rows in blocks of 4 (the last of one row), 3 rows in one short
#: block (fewer blocks than ranks), 54 in blocks of 4, 29 in blocks of 24 and 5 (whose
#: lr adjusts differently: 24 > 18 columns); "c" is one whole matrix beside them
SPLIT_BLOCKS = {"a": 4, "t": 4, "qkv": 4, "b": 24}
SPLIT_BUCKETS = [
    fs.BucketSpec(["a", "t"], placement=fs.Shard(0), name="rows"),
    fs.BucketSpec(["qkv", "c"], placement=fs.FlatShard(), name="flat"),
    fs.BucketSpec("b", placement=fs.BlockShard((8, 6)), name="tiles"),
]


def _split_row_blocks(mesh) -> dict:
    """Row-block matrices whose storage cuts blocks go whole to an owner, which steps
    block by block: bit for bit torch Muon per block, for either lr adjustment."""
    names = ("a", "b", "c", "qkv", "t")
    out = {}
    for adjust in (None, "match_rms_adamw"):
        model = fs.flex_shard(Mats(names), mesh=mesh, buckets=SPLIT_BUCKETS)
        named = dict(model.named_parameters())
        groups = [{"params": [named["c"]]}]
        groups += [{"params": [named[n]], "row_blocks": r} for n, r in SPLIT_BLOCKS.items()]
        opt = DistMuon(groups, lr=LR, adjust_lr_fn=adjust)
        for name, rows in SPLIT_BLOCKS.items():
            target = opt._targets[id(named[name])]
            assert (target.kind, target.rows) == (Kind.REMOTE, rows), name
        counts: Counter[str] = Counter()
        for step in range(STEPS):
            set_grads(model, full_grads(names, step))
            with record_collectives() as log:
                opt.step()
            counts.update(log.counts())
        full = fs.full_state_dict(model)
        ref = reference_params(names, STEPS, SPLIT_BLOCKS, adjust_lr_fn=adjust)
        for name in names:
            assert torch.equal(full[name], ref[name]), f"{adjust}: {name} differs from torch Muon"
        out[str(adjust)] = {"counts": dict(counts), **opt.comm_stats()}
    return out


def _pipeline_order(mesh) -> None:
    """Bucket i+1's forward all-to-all is launched (async) before bucket i's
    Newton–Schulz runs, and bucket i's update goes back before bucket i+1's runs."""
    import flexshard.optim.dist_muon as dm

    model = fs.flex_shard(Mats(), mesh=mesh, buckets=CASES["shard0"][0])
    opt = DistMuon(model.parameters(), lr=LR)
    set_grads(model, full_grads(NAMES, 0))
    events: list[str] = []
    plan = opt._exchanges([opt._targets[id(p)] for p in model.parameters()])
    names = {id(u.target.param): ex.name for ex in plan for u in ex.units}
    sends = {"send_inputs": "forward", "send_updates": "back"}
    originals = {name: getattr(dm, name) for name in sends}

    def logged(name):
        def run(exchange, *args):
            events.append(f"{sends[name]} {exchange.name}")
            return originals[name](exchange, *args)

        return run

    def orthogonalize(target, matrix):
        events.append(f"ns {names[id(target.param)]}")
        return DistMuon._orthogonalize(target, matrix)

    for name in sends:
        setattr(dm, name, logged(name))
    opt._orthogonalize = orthogonalize
    try:
        opt.step()
    finally:
        for name in sends:
            setattr(dm, name, originals[name])
    first = {event: i for i, event in reversed(list(enumerate(events)))}
    last = {event: i for i, event in enumerate(events)}
    order = [ex.name for ex in plan]
    for k, bucket in enumerate(order):
        if f"ns {bucket}" not in first:
            continue  # this rank owns nothing of the bucket
        assert first[f"forward {bucket}"] < first[f"ns {bucket}"]
        if k + 1 < len(order):
            assert first[f"forward {order[k + 1]}"] < first[f"ns {bucket}"], events
        assert last[f"ns {bucket}"] < first[f"back {bucket}"], events
        if k + 1 < len(order) and f"ns {order[k + 1]}" in first:
            assert first[f"back {bucket}"] < first[f"ns {order[k + 1]}"], events


def _owners_avoid_busy_ranks(mesh) -> None:
    """Rank 0 orthogonalises the Owned 'qkv' locally, so LPT sends the split 'a' to
    rank 1 (without the local work both ranks tie and rank 0 would take it)."""
    buckets = [
        fs.BucketSpec("qkv", placement=fs.Owned(rank=0), name="owned"),
        fs.BucketSpec("a", placement=fs.Shard(0), name="split"),
    ]
    model = fs.flex_shard(Mats(("qkv", "a")), mesh=mesh, buckets=buckets)
    opt = DistMuon(model.parameters(), lr=LR)
    (exchange,) = opt._exchanges([opt._targets[id(p)] for p in model.parameters()])
    assert [u.owner for u in exchange.units] == [1]


def _owners_by_block_flops(mesh) -> None:
    """A row-block matrix the storage cuts costs its owner its blocks' Newton–Schulz
    FLOPs: 'qkv' in 4-row blocks (42k) is the lightest of the three and joins 'c' (87k)
    on rank 1 beside 'a' (108k); whole (204k) it would be the heaviest, alone on rank 0."""
    model = fs.flex_shard(Mats(("a", "c", "qkv")), mesh=mesh, buckets=[fs.BucketSpec("*")])
    groups = [{"params": [model.a, model.c]}, {"params": [model.qkv], "row_blocks": 4}]
    opt = DistMuon(groups, lr=LR)
    (exchange,) = opt._exchanges([opt._targets[id(p)] for p in model.parameters()])
    assert {u.target.name.split("'")[1]: u.owner for u in exchange.units} == {
        "a": 0,
        "c": 1,
        "qkv": 1,
    }


def _all_cases(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world_size,))
    out = {name: _run_case(name, mesh) for name in CASES}
    if world_size == 2:
        _resume_bitwise(mesh)
        _guard_catches_redistribution(mesh)
        _pipeline_order(mesh)
        _owners_avoid_busy_ranks(mesh)
        _owners_by_block_flops(mesh)
    if world_size == 4:
        _bad_inputs(mesh)
    if world_size in (3, 4):
        out["split_row_blocks"] = _split_row_blocks(mesh)
    if world_size == 4:  # HSDP: 2 replicas x 2 shards, exchanges inside each shard group
        hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        out["hsdp"] = _run_case("shard0", hsdp)
    return out


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_dist_muon_matches_torch_muon(world_size: int) -> None:
    results = run_distributed(_all_cases, world_size, timeout=240)
    for name, (buckets, _, comm_free) in CASES.items():
        stats = [r[name] for r in results]
        if comm_free:
            assert all(s["all_to_all"] == 0 and s["bytes_sent"] == 0 for s in stats)
            continue
        # every rank issues the same all-to-alls, two per bucket and step (the
        # replicated bucket's forward stays local) and nothing else
        counts = stats[0]["counts"]
        assert all(s["counts"] == counts for s in stats), name
        per_step = len(buckets) if name == "replicate" else 2 * len(buckets)
        assert counts == {"all_to_all_single": STEPS * per_step}, (name, counts)
        assert sum(s["bytes_sent"] for s in stats) == sum(s["bytes_received"] for s in stats)
        assert sum(s["bytes_sent"] for s in stats) > 0
    if world_size in (3, 4):  # per block on the owner: one all-to-all each way per bucket
        expected = STEPS * 2 * len(SPLIT_BUCKETS)
        for stats in (s for r in results for s in r["split_row_blocks"].values()):
            assert stats["counts"] == {"all_to_all_single": expected}, stats
            assert stats["all_to_all"] == expected


def _save_after_two_steps(rank: int, world_size: int, root: str) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    model = fs.flex_shard(Mats(), mesh=mesh, buckets=CASES["shard0"][0])
    opt = DistMuon(model.parameters(), lr=LR)
    for step in range(2):
        set_grads(model, full_grads(NAMES, step))
        opt.step()
    ckpt.save(root, model, opt)


def _load_and_step(rank: int, world_size: int, root: str) -> list[str]:
    mesh = init_device_mesh("cpu", (world_size,))
    model = fs.flex_shard(Mats(seed=99), mesh=mesh, buckets=CASES["owned"][0])
    opt = DistMuon(model.parameters(), lr=LR)
    ckpt.load(root, model, opt)
    set_grads(model, full_grads(NAMES, 2))
    with forbid_collectives():
        opt.step()
    full = fs.full_state_dict(model)
    ref = reference_params(NAMES, STEPS)
    torch.testing.assert_close(full["e"], ref["e"], rtol=0, atol=EXPERT_ATOL)
    return [key for key in MATRICES if not torch.equal(full[key], ref[key])]


def test_state_survives_a_change_of_world_size_and_placement(tmp_path) -> None:
    """Momentum saved at W = 2 on Shard(0) storage (flexshard.checkpoint), loaded at
    W = 3 on Owned storage: the third step equals torch Muon's bit for bit."""
    assert STEPS == 3
    root = str(tmp_path / "muon")
    run_distributed(_save_after_two_steps, 2, root, timeout=120)
    assert run_distributed(_load_and_step, 3, root, timeout=120) == [[], [], []]
