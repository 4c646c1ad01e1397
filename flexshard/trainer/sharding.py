"""Data parallelism from the config: flexshard buckets (one per block plus one outer
bucket by default, a placement per bucket) or torch FSDP2 for comparison."""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

import flexshard as fs

from .config import Config, ConfigError, ModelConfig

OUTER_PATTERNS = ["tok_embeddings.*", "norm.*", "output.*"]
Policy = fs.Placement | Callable[[str, nn.Parameter], fs.Placement]


def mp_policy(precision: str) -> MixedPrecisionPolicy:
    if precision == "bf16":  # compute in bf16, reduce gradients in fp32 (torchtitan's default)
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def _block_or_shard(block: tuple[int, int]) -> Policy:
    def placement(fqn: str, param: nn.Parameter) -> fs.Placement:
        return fs.BlockShard(block) if param.ndim >= 2 else fs.Shard(0)

    return placement


def _mixed(model_cfg: ModelConfig) -> Policy:
    """One bucket, several placements, still one collective each way: norms packed flat,
    attention projections in whole-head row blocks, SwiGLU input matrices whole on one
    rank, the rest FSDP2-style rows."""
    head_dim = model_cfg.dim // model_cfg.n_heads

    def placement(fqn: str, param: nn.Parameter) -> fs.Placement:
        if param.ndim < 2:
            return fs.FlatShard()
        if fqn.endswith(("wq.weight", "wk.weight", "wv.weight")):
            return fs.BlockShard((head_dim, param.shape[-1]))
        if fqn.endswith(("feed_forward.w1.weight", "feed_forward.w3.weight")):
            return fs.Owned()
        return fs.Shard(0)

    return placement


def named_placement(name: str, cfg: Config, block: list[int] | None = None) -> Policy:
    tile = tuple(block or cfg.parallelism.block)
    table: dict[str, Callable[[], Policy]] = {
        "shard0": lambda: fs.Shard(0),
        "flat": fs.FlatShard,
        "owned": fs.Owned,
        "block": lambda: _block_or_shard(tile),  # type: ignore[arg-type]
        "mixed": lambda: _mixed(cfg.model),
    }
    if name not in table:
        raise ConfigError(f"placement '{name}': must be one of {', '.join(sorted(table))}")
    return table[name]()


def _explicit_buckets(cfg: Config) -> list[fs.BucketSpec]:
    """``[[parallelism.buckets]]`` tables (checked by config.validate) as BucketSpecs."""
    specs = []
    for i, entry in enumerate(cfg.parallelism.buckets):
        patterns = entry["patterns"]
        placement = named_placement(entry.get("placement", "shard0"), cfg, entry.get("block"))
        specs.append(fs.BucketSpec(patterns, placement, name=entry.get("name", f"bucket{i}")))
    return specs


def bucket_specs(cfg: Config, model: nn.Module, dp_shard: int) -> list[fs.BucketSpec]:
    """The flexshard buckets this config asks for."""
    par = cfg.parallelism
    if par.buckets:
        return _explicit_buckets(cfg)
    if par.placement == "muon":
        try:
            from flexshard.optim import muon_buckets  # planned by the DistMuon issue
        except ImportError:
            raise ConfigError(
                'parallelism.placement = "muon" needs flexshard.optim.muon_buckets, which is '
                "not in this installation"
            ) from None
        from .optimizers import matrix_optimizer_buckets, muon_row_blocks

        if cfg.training.optimizer in ("soap", "shampoo"):  # balanced on their own cost
            return matrix_optimizer_buckets(model, dp_shard)
        return list(muon_buckets(model, dp_shard, row_blocks=muon_row_blocks(cfg.model)))
    placement = named_placement(par.placement, cfg)
    layers = [
        fs.BucketSpec(f"layers.{i}.*", placement, name=f"layers.{i}")
        for i in range(cfg.model.n_layers)
    ]
    return [*layers, fs.BucketSpec(OUTER_PATTERNS, placement, name="outer")]


def apply_flexshard(model: nn.Module, cfg: Config, dp_mesh: DeviceMesh) -> Any:
    dp_shard = dp_mesh.size(-1)
    return fs.flex_shard(
        model,
        dp_mesh,
        buckets=bucket_specs(cfg, model, dp_shard),
        mp_policy=mp_policy(cfg.training.mixed_precision),
        reshard_after_forward=cfg.parallelism.reshard_after_forward,
        timeout=datetime.timedelta(seconds=cfg.parallelism.timeout_s),
    )


def apply_fsdp2(model: nn.Module, cfg: Config, dp_mesh: DeviceMesh) -> Any:
    """torch's fully_shard per block, then the root (the layout flexshard's defaults copy)."""
    from torch.distributed.fsdp import fully_shard

    policy = mp_policy(cfg.training.mixed_precision)
    reshard = cfg.parallelism.reshard_after_forward
    for layer in model.layers:  # type: ignore[union-attr]
        fully_shard(layer, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard)
    return fully_shard(model, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard)
