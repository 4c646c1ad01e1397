"""The big configs set up at their intended world sizes (256 to 8,192 ranks) under the
fake backend, for several layouts and every placement family, with the layout of every
rank checked: each bucket's parameters split exactly over its ranks, storage balanced
within the placement's bound, pipeline stages holding every block once, expert stacks
on their own group. The fast cases cut the depth (same shapes, fewer blocks); the slow
ones build the whole models."""

from __future__ import annotations

import math

import pytest

from flexshard.placements import BlockShard, FlatShard, Owned, Shard
from flexshard.plan.buckets import BucketInfo
from flexshard.plan.report import build_stages, planning_config
from flexshard.plan.world import stage_ranks
from flexshard.trainer.config import load_config
from flexshard.trainer.models.model import count_params

BLOCK = ["--parallelism.placement", "block", "--parallelism.block", "[128,128]"]


def _bound(info: BucketInfo) -> float:
    """How far above the mean one rank's real storage may be: Shard rounds each
    parameter's rows up (ceil), Owned's LPT is within the largest parameter, BlockShard
    within the largest tile, FlatShard within one element."""
    extra = 0.0
    largest_owned = 0
    for param, placement in zip(info.layout.params, info.placements):
        if isinstance(placement, Shard):
            rows = param.shape[placement.dim]
            extra += math.prod(param.shape) // rows * (-(-rows // info.world))
            extra -= param.numel / info.world
        elif isinstance(placement, Owned):
            largest_owned = max(largest_owned, param.numel)
        elif isinstance(placement, BlockShard):
            largest_owned = max(largest_owned, math.prod(placement.block) * 2)
        elif isinstance(placement, FlatShard):
            extra += 1
    return info.numel / info.world + extra + largest_owned


def check_layouts(buckets: list[BucketInfo]) -> None:
    for info in buckets:
        per_rank = info.rank_numels()
        assert len(per_rank) == info.world, info.name
        assert sum(per_rank) == info.numel, f"{info.name}: elements lost or doubled"
        assert max(per_rank) <= info.shard_numel, info.name
        assert max(per_rank) <= _bound(info) + 1e-6, (info.name, max(per_rank), _bound(info))


def _layer_indices(buckets: list[BucketInfo]) -> list[int]:
    found = set()
    for info in buckets:
        for param in info.layout.params:
            parts = param.fqn.split(".")
            if info.name.startswith("layers.") and parts[0] != "layers":
                parts = info.name.split(".")  # a block bucket names params within the block
            if parts[0] == "layers":
                found.add(int(parts[1]))
    return sorted(found)


def build(config: str, world: int, overrides: list[str], rank: int | None = None):
    cfg = planning_config(load_config(config, overrides))
    return cfg, *build_stages(cfg, world, rank)


FAST = [
    ("configs/llama3_70b.toml", 1024, ["--parallelism.placement", "owned"]),  # all 80 blocks
    ("configs/llama3_70b.toml", 1024, ["--model.n_layers", "8"]),
    (
        "configs/llama3_70b.toml",
        1024,
        ["--model.n_layers", "8", "--parallelism.placement", "owned"],
    ),
    (
        "configs/llama3_70b.toml",
        256,
        [
            "--model.n_layers",
            "4",
            "--parallelism.tp",
            "1",
            "--parallelism.dp_replicate",
            "2",
            "--parallelism.placement",
            "mixed",
        ],
    ),
    (
        "configs/llama3_405b.toml",
        8192,
        ["--model.n_layers", "4", "--parallelism.placement", "flat"],
    ),
    ("configs/deepseek_v3.toml", 2048, ["--model.n_layers", "5"]),
]
SLOW = [
    ("configs/llama3_70b.toml", 1024, []),
    ("configs/llama3_70b.toml", 1024, BLOCK),
    ("configs/llama3_70b.toml", 1024, ["--parallelism.placement", "flat"]),
    (
        "configs/llama3_70b.toml",
        2048,
        ["--parallelism.pp", "4", "--training.batch_size", "4", "--parallelism.placement", "owned"],
    ),
    ("configs/llama3_405b.toml", 8192, []),
    ("configs/llama3_405b.toml", 8192, BLOCK),
    ("configs/deepseek_v3.toml", 2048, BLOCK),
    ("configs/deepseek_v3.toml", 2048, ["--parallelism.placement", "owned"]),
]


def _check_case(config: str, world: int, overrides: list[str]) -> None:
    cfg, dims, stages = build(config, world, overrides)
    assert dims.world_size == world
    assert len(stages) == dims.pp
    for buckets in stages:
        check_layouts(buckets)
    # every block on exactly one pipeline stage
    layers = [i for buckets in stages for i in _layer_indices(buckets)]
    assert sorted(layers) == list(range(cfg.model.n_layers))
    moe = cfg.model.moe
    if dims.ep > 1:
        experts = [b for b in stages[0] if b.name.endswith("experts")]
        assert experts, "no expert buckets"
        for info in experts:
            assert info.world == dims.dp_shard * dims.cp // dims.ep
            assert {p.shape[0] for p in info.layout.params} == {moe.num_experts // dims.ep}
    if dims.tp == 1 and dims.ep == 1 and dims.pp == 1:
        # data parallelism alone: the buckets hold the whole model
        total, _ = count_params(cfg.model)
        assert sum(b.numel for b in stages[0]) == total


@pytest.mark.parametrize("config,world,overrides", FAST)
def test_big_configs_set_up_at_scale(config: str, world: int, overrides: list[str]) -> None:
    _check_case(config, world, overrides)


@pytest.mark.slow
@pytest.mark.parametrize("config,world,overrides", SLOW)
def test_big_configs_full_depth(config: str, world: int, overrides: list[str]) -> None:
    _check_case(config, world, overrides)


def test_pipeline_stage_ranks_hold_their_blocks() -> None:
    cfg, dims, stages = build(
        "configs/llama3_405b.toml", 8192, ["--model.n_layers", "6", "--parallelism.pp", "2"]
    )
    assert stage_ranks(dims) == [0, 4096]
    assert _layer_indices(stages[0]) == [0, 1, 2]
    assert _layer_indices(stages[1]) == [3, 4, 5]
    # the first stage has the embedding, the last the LM head
    fqns = [{p.fqn for b in s for p in b.layout.params} for s in stages]
    assert any("tok_embeddings" in f for f in fqns[0]) and not any("output" in f for f in fqns[0])
    assert any("output" in f for f in fqns[1])


def test_bad_layout_raises_naming_the_degree() -> None:
    with pytest.raises(ValueError, match="dp_shard"):
        build("configs/llama3_70b.toml", 1020, [])  # not a multiple of tp = 8
