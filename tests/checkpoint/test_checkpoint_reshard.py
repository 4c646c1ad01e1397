"""Plain dcp.save / dcp.load of a flexshard model: every rank writes only its regions,
and a checkpoint saved at one world size and set of placements loads bit for bit at
any other, and into (and from) an unsharded model in one process.

One spawn of 4 ranks covers world sizes 1-4 through sub-groups. Each world size W1
saves ONE checkpoint holding each placement's model under the key prefix
"<source>|<target>", once per target it is loaded into; DCP plans every key on its
own, so one dcp.load at W2 checks all (source, target) pairs of (W1, W2) at once.
The default test loads each source into every target placement, the world size
rotating, so every placement pair meets every world-size pair; the slow test loads
every source into every target."""

from __future__ import annotations

import itertools
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

import flexshard as fs
from flexshard.runtime.dtensor.chunks import chunks_of
from flexshard.testing import run_distributed


class Net(nn.Module):
    """Few parameters (DCP's cost is per key) with every awkward shape: 17 rows, a
    row count no W divides, 1-D, and a 3-D batch of matrices."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(17, 18)
        self.qkv = nn.Linear(18, 54, bias=False)
        self.proj = nn.Linear(18, 18)
        self.down = nn.Linear(29, 18, bias=False)
        self.norm = nn.LayerNorm(18, bias=False)
        self.experts = nn.Parameter(torch.randn(3, 7, 5))


def _shard1(fqn: str, param: torch.Tensor) -> fs.Placement:
    return fs.Shard(1) if param.ndim >= 2 else fs.Shard(0)


def _mixed(fqn: str, param: torch.Tensor) -> fs.Placement:
    if param.ndim != 2:
        return fs.FlatShard()
    if "qkv" in fqn:
        return fs.BlockShard((6, 64))  # one head's rows per tile
    if "embed" in fqn:
        return fs.Owned()
    if "down" in fqn:
        return fs.BlockShard((4, 4))  # several tiles per rank: flat local tensor
    return fs.Shard(1) if "proj" in fqn else fs.Shard(0)


PLACEMENTS = {
    "shard0": fs.Shard(0),
    "shard1": _shard1,
    "flat": fs.FlatShard(),
    "owned": fs.Owned(),
    "block": fs.BlockShard((8, 8)),  # several tiles per rank: flat local tensor
    "replicate": fs.Replicate(),
    "mixed": _mixed,
}
WORLDS = (1, 2, 3, 4)
CONFIGS = [(w, p) for w in WORLDS for p in PLACEMENTS]
HSDP = (4, "hsdp")  # 2 replicas x 2 shards, mixed placements
PLAIN = (0, "plain")  # an unsharded model in one process
SOURCES = [*CONFIGS, HSDP, PLAIN]
TARGETS = [*CONFIGS, HSDP]
Config = tuple[int, str]


def _buckets(placement) -> list[fs.BucketSpec]:
    return [
        fs.BucketSpec(["embed.*", "qkv.*", "experts"], placement=placement, name="a"),
        fs.BucketSpec(["proj.*", "down.*", "norm.*"], placement=placement, name="b"),
    ]


def _label(config: Config) -> str:
    return f"w{config[0]}-{config[1]}"


def _seed(config: Config) -> int:
    return 7 if config == PLAIN else 1000 + 10 * config[0] + [*PLACEMENTS, "hsdp"].index(config[1])


def _expected(config: Config, cache: dict[Config, dict]) -> dict[str, torch.Tensor]:
    if config not in cache:
        torch.manual_seed(_seed(config))
        cache[config] = Net().state_dict()
    return cache[config]


def _build(config: Config, groups: dict, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    if config == HSDP:
        mesh = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("replicate", "shard"))
        return fs.flex_shard(Net(), mesh=mesh, buckets=_buckets(_mixed))
    world, placement = config
    return fs.flex_shard(Net(), mesh=groups[world], buckets=_buckets(PLACEMENTS[placement]))


def pairs(full: bool) -> set[tuple[Config, Config]]:
    """(source, target) configurations to load: all, or a covering set."""
    if full:
        return {(s, t) for s in SOURCES for t in TARGETS if s != t}
    out = {(s, t) for s in (HSDP, PLAIN) for t in TARGETS}
    for (w1, p1), wi, pi in (
        (c, WORLDS.index(c[0]), list(PLACEMENTS).index(c[1])) for c in CONFIGS
    ):
        for j, p2 in enumerate(PLACEMENTS):
            # a bijection W1 -> W2 for each placement pair; W2 != W1 when p2 == p1
            shift = (j - pi) % 4 if j != pi else 1
            out.add(((w1, p1), (WORLDS[(wi + shift) % 4], p2)))
        out.add(((w1, p1), HSDP))
    return {(s, t) for s, t in out if s != t}


def _written_once(metadata) -> list[str]:
    """Keys whose saved chunks do not add up to exactly one copy of the tensor."""
    return [
        key
        for key, md in metadata.state_dict_metadata.items()
        if sum(math.prod(c.sizes) for c in md.chunks) != math.prod(md.size)
    ]


def _prefixed(state: dict, source: Config, target: Config | str) -> dict:
    prefix = f"{source[1]}|{target if isinstance(target, str) else _label(target)}"
    return {f"{prefix}.{k}": v for k, v in state.items()}


def _fresh(state: dict) -> dict:
    return {k: v.clone() for k, v in state.items()}  # DTensors over fresh local data


def _pieces_match(state: dict, expected: dict[str, torch.Tensor]) -> bool:
    """Every piece equals the expected full tensor there, bit for bit."""
    for key, value in state.items():
        if not isinstance(value, DTensor):
            return False  # every parameter of these models is sharded
        for (offsets, sizes), piece in chunks_of(value).pieces:
            index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
            if not torch.equal(piece, expected[key][index]):
                return False
    return True


def _save_all(rank: int, root: str, groups: dict, plan: set, report: dict) -> None:
    for world in (*WORLDS, 0):
        sources = [s for s in SOURCES if s[0] == world]
        if rank >= max(world, 1):
            continue
        state = {}
        for source in sources:
            wanted = [t for s, t in plan if s == source] + ["inplace", "unsharded"]
            if world == 0:
                torch.manual_seed(_seed(PLAIN))
                model_state = Net().state_dict()
            else:
                model_state = _build(source, groups, _seed(source)).state_dict()
                # replicated copies (torch's Replicate placement: Replicate buckets,
                # HSDP) are deduplicated by DCP's planner: ``double_writes`` checks it
            for target in wanted:
                state.update(_prefixed(model_state, source, target))
        if world == 0:
            dcp.save(state, checkpoint_id=f"{root}/w0", no_dist=True)
            continue
        metadata = dcp.save(state, checkpoint_id=f"{root}/w{world}", process_group=groups[world])
        if rank == 0:
            report["double_writes"] += _written_once(metadata)


def _matrix(rank: int, world_size: int, root: str, full: bool) -> dict:
    groups = {w: dist.new_group(list(range(w))) for w in WORLDS}
    cache: dict[Config, dict] = {}
    report: dict = {"double_writes": [], "bad": [], "pairs": 0}
    plan = pairs(full)
    _save_all(rank, root, groups, plan, report)
    dist.barrier()

    for world in WORLDS:
        if rank >= world:
            continue
        targets = {t: _build(t, groups, 0) for t in TARGETS if t[0] == world}
        for w1 in (*WORLDS, 0):
            loads = [(s, t) for s, t in sorted(plan) if s[0] == w1 and t in targets]
            fresh = {(s, t): _fresh(targets[t].state_dict()) for s, t in loads}
            flat = {}
            for (s, t), state in fresh.items():
                flat.update(_prefixed(state, s, t))
            dcp.load(flat, checkpoint_id=f"{root}/w{w1}", process_group=groups[world])
            for (s, t), state in fresh.items():
                report["pairs"] += 1
                if not _pieces_match(state, _expected(s, cache)):
                    report["bad"].append((_label(s), _label(t)))
        # in place, through module.load_state_dict, one source each
        for i, (target, model) in enumerate(targets.items()):
            source = SOURCES[(7 * i + world) % len(SOURCES)]
            state = model.state_dict()
            group = groups[world]
            dcp.load(
                _prefixed(state, source, "inplace"),
                checkpoint_id=f"{root}/w{source[0]}",
                process_group=group,
            )
            model.load_state_dict(state)
            if not _pieces_match(model.state_dict(), _expected(source, cache)):
                report["bad"].append(("in place", _label(source), _label(target)))

    if rank == 0:  # every checkpoint into an unsharded model in one process
        for w1 in (*WORLDS, 0):
            models = {s: Net() for s in SOURCES if s[0] == w1}
            flat = {}
            for s, model in models.items():
                flat.update(_prefixed(model.state_dict(), s, "unsharded"))
            dcp.load(flat, checkpoint_id=f"{root}/w{w1}", no_dist=True)
            for s, model in models.items():
                want = _expected(s, cache)
                if any(not torch.equal(v, want[k]) for k, v in model.state_dict().items()):
                    report["bad"].append((_label(s), "unsharded"))
    dist.barrier()
    return report


def _check(reports: list[dict], full: bool) -> None:
    assert reports[0]["double_writes"] == []
    for report in reports:
        assert report["bad"] == []
    assert reports[0]["pairs"] == len(pairs(full))  # rank 0 takes part in every load


def test_every_placement_pair_at_every_world_size_pair(tmp_path):
    _check(run_distributed(_matrix, 4, os.fspath(tmp_path), False, timeout=280), full=False)


@pytest.mark.slow
def test_every_source_into_every_target(tmp_path):
    _check(run_distributed(_matrix, 4, os.fspath(tmp_path), True, timeout=900), full=True)


def test_covering_set_meets_every_pair():
    """The default test's pairs: each source into every target placement, and each
    placement pair at every world-size pair."""
    met = pairs(full=False)
    for source in SOURCES:
        assert {t[1] for s, t in met if s == source} >= set(PLACEMENTS) - {source[1]}
    for p1, p2 in itertools.product(PLACEMENTS, repeat=2):
        worlds = {(s[0], t[0]) for s, t in met if (s[1], t[1]) == (p1, p2)}
        assert {w2 for _, w2 in worlds} == set(WORLDS)
        assert {w1 for w1, _ in worlds} == set(WORLDS)
    assert {(s[0], t[0]) for s, t in met} >= set(itertools.product((0, *WORLDS), WORLDS))
