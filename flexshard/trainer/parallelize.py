"""The 5-D composition, torchtitan style: one small ``apply_*`` per concern, applied in
one place. The order matters: TP rewrites the modules' parameters into DTensors, EP
slices the experts, PP then cuts the model into stages (TP and EP travel with the
blocks), CP switches each stage's attention to its sequence shard, ``[compile]``
compiles each block, and data parallelism (flexshard or torch FSDP2) shards what is
left: expert weights on their own ``dp_shard_mod_ep`` mesh, everything else per block
over dp_replicate x (dp_shard * cp).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

import flexshard as fs
from flexshard.runtime.module import subtree_buckets
from flexshard.runtime.tp_params import tp_sharded

from .config import Config
from .context_parallel import apply_cp, split_sequence
from .expert_parallel import apply_ep
from .model import Transformer, init_module, init_weights
from .parallel import Meshes, ParallelDims
from .pipeline import PipelineRunner, build_pipeline, init_stage_params
from .sharding import OUTER_PATTERNS, mp_policy, named_placement
from .tensor_parallel import apply_tp


@dataclass
class Parallelized:
    """This rank's share of the model: one module, or the pipeline's stage modules."""

    modules: list[nn.Module]
    runner: PipelineRunner | None = None
    expert_fqns: list[str] = field(default_factory=list)

    def parameters(self) -> Iterator[nn.Parameter]:
        for module in self.modules:
            yield from module.parameters()


def _layer_names(module: nn.Module) -> list[str]:
    return [name for name, _ in module.layers.named_children()]  # type: ignore[union-attr]


def _outer_patterns(module: nn.Module) -> list[str]:
    """The root parts a (stage) module really holds: a pipeline stage has only some."""
    return [
        pattern
        for pattern in OUTER_PATTERNS
        if any(True for _ in getattr(module, pattern.split(".")[0]).parameters())
    ]


def apply_compile(module: nn.Module, cfg: Config) -> None:
    """torch.compile each transformer block, as torchtitan does, before data parallelism
    shards it: flexshard's (and FSDP2's) hooks run eagerly around the compiled block, so
    each block is one graph of its own computation (``fullgraph``: a break raises)."""
    for layer in module.layers.children():  # type: ignore[union-attr]
        layer.compile(backend=cfg.compile.backend, fullgraph=True)


def apply_dp(module: nn.Module, cfg: Config, meshes: Meshes, expert_fqns: list[str]) -> Any:
    """Data parallelism over ``meshes.dp``: one bucket (or FSDP2 group) per block plus
    one for the root's parts; EP's expert weights first, on ``meshes.experts_dp``."""
    policy = mp_policy(cfg.training.mixed_precision)
    reshard = cfg.parallelism.reshard_after_forward
    present = [fqn for fqn in expert_fqns if _has_submodule(module, fqn)]
    if cfg.parallelism.dp_backend == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for fqn in present:
            fully_shard(module.get_submodule(fqn), mesh=meshes.experts_dp, mp_policy=policy)
        for layer in module.layers:  # type: ignore[union-attr]
            fully_shard(layer, mesh=meshes.dp, mp_policy=policy, reshard_after_forward=reshard)
        return fully_shard(module, mesh=meshes.dp, mp_policy=policy, reshard_after_forward=reshard)
    placement = named_placement(cfg.parallelism.placement, cfg)
    if present:  # buckets on two meshes: fully_shard style, one call per module
        return _flexshard_per_module(module, placement, meshes, present, policy, reshard)
    specs = [
        fs.BucketSpec(f"layers.{name}.*", placement, name=f"layers.{name}")
        for name in _layer_names(module)
    ]
    outer = _outer_patterns(module)
    if outer:
        specs.append(fs.BucketSpec(outer, placement, name="outer"))
    return fs.flex_shard(
        module, meshes.dp, buckets=specs, mp_policy=policy, reshard_after_forward=reshard
    )


def _flexshard_per_module(
    module: nn.Module,
    placement: Any,
    meshes: Meshes,
    expert_fqns: list[str],
    policy: Any,
    reshard: bool,
) -> Any:
    """fs.fully_shard on the experts (their own mesh), then each block, then the root:
    flex_shard's buckets share one mesh, EP's experts need another."""
    fqn_of = {id(p): fqn for fqn, p in module.named_parameters()}

    def place(param: nn.Parameter) -> Any:
        return (
            placement
            if isinstance(placement, fs.Placement)
            else placement(fqn_of[id(param)], param)
        )

    for fqn in expert_fqns:
        fs.fully_shard(
            module.get_submodule(fqn),
            mesh=meshes.experts_dp,
            mp_policy=policy,
            shard_placement_fn=place,
        )
    for layer in module.layers:  # type: ignore[union-attr]
        fs.fully_shard(
            layer,
            mesh=meshes.dp,
            mp_policy=policy,
            reshard_after_forward=reshard,
            shard_placement_fn=place,
        )
    return fs.fully_shard(
        module,
        mesh=meshes.dp,
        mp_policy=policy,
        reshard_after_forward=reshard,
        shard_placement_fn=place,
    )


def _has_submodule(module: nn.Module, fqn: str) -> bool:
    try:
        module.get_submodule(fqn)
    except AttributeError:
        return False
    return True


def parallelize(
    cfg: Config, dims: ParallelDims, meshes: Meshes, device: torch.device
) -> Parallelized:
    """TP -> EP -> PP split -> CP -> DP, every rank ending with the single process's
    seeded weights. flexshard: built on meta and initialised after sharding, module by
    module (no rank ever holds the whole model); FSDP2: built whole on ``device`` first."""
    from .train import loss_fn

    par = cfg.parallelism
    on_meta = par.dp_backend == "flexshard"
    with torch.device("meta" if on_meta else device):
        model = Transformer(cfg.model)
    if not on_meta:
        init_weights(model, cfg.training.seed)
    if meshes.tp is not None:
        # stages exchange whole hidden states, so sequence parallelism stays inside pp = 1
        apply_tp(model, meshes.tp, sequence_parallel=par.sequence_parallel and dims.pp == 1)
    expert_fqns = apply_ep(model, meshes.ep) if meshes.ep is not None else []

    def finish(module: nn.Module) -> nn.Module:
        if meshes.cp is not None:
            apply_cp(module, meshes.cp, par.cp_method)
        if cfg.compile.enable:
            apply_compile(module, cfg)
        return apply_dp(module, cfg, meshes, expert_fqns)

    if meshes.pp is None:
        parallel = Parallelized([finish(model)], None, expert_fqns)
        if on_meta:
            parallel.modules[0].to_empty(device=device)
            torch.manual_seed(cfg.training.seed)
            fs.init_params(parallel.modules[0], init_module)
        return parallel
    param_dtype = mp_policy(cfg.training.mixed_precision).param_dtype
    runner = build_pipeline(
        model,
        meshes.pp,
        n_microbatches=par.pp_microbatches or dims.pp,
        schedule=par.pp_schedule,
        loss_fn=loss_fn,
        shard_fn=finish,
        virtual_stages=par.pp_virtual_stages,
        activation_dtype=param_dtype or torch.float32,
    )
    if on_meta:  # each stage continues the single process's random stream
        for module in runner.modules:
            module.to_empty(device=device)
        init_stage_params(runner.modules, cfg.training.seed, init_module)
    return Parallelized(list(runner.modules), runner, expert_fqns)


def local_batch(
    inputs: torch.Tensor, targets: torch.Tensor, meshes: Meshes
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of its data-parallel batch: its zig-zag chunks under CP."""
    if meshes.cp is None:
        return inputs, targets
    return split_sequence(inputs, meshes.cp), split_sequence(targets, meshes.cp)


# ------------------------------------------------------------------ gradient norm
def _counted_here(dims: ParallelDims, meshes: Meshes, tp_split: bool) -> bool:
    """Whether this rank's copy of a gradient counts: HSDP replicas hold the same
    reduced gradients (count replica 0), and a weight not split over tp is the same on
    every tp rank (count tp rank 0)."""
    world = meshes.world
    if dims.dp_replicate > 1 and world.get_local_rank("dp_replicate") != 0:
        return False
    return tp_split or dims.tp == 1 or world.get_local_rank("tp") == 0


def _flexshard_squares(module: nn.Module, dims: ParallelDims, meshes: Meshes) -> torch.Tensor:
    squares = torch.zeros((), dtype=torch.float32)
    for bucket in subtree_buckets(module):
        if bucket.layout.replicated and bucket.rank != 0:
            continue  # a Replicate bucket: every shard rank holds the same gradient
        for i, param in enumerate(bucket.params):
            grad = bucket.local_grad(i)
            if grad is None or not grad.numel():
                continue
            if _counted_here(dims, meshes, tp_sharded(param.tp_spec)):
                squares += grad.float().pow(2).sum().cpu()
    return squares


def _dtensor_squares(module: nn.Module, dims: ParallelDims, meshes: Meshes) -> torch.Tensor:
    """FSDP2: each gradient a DTensor; a mesh dim it is replicated on counts once."""
    squares = torch.zeros((), dtype=torch.float32)
    for param in module.parameters():
        grad = param.grad
        if grad is None:
            continue
        if isinstance(grad, DTensor):
            mesh, names = grad.device_mesh, grad.device_mesh.mesh_dim_names or ()
            if any(
                isinstance(p, Replicate) and mesh.get_local_rank(i) != 0
                for i, p in enumerate(grad.placements)
            ):
                continue
            if "tp" not in names and dims.tp > 1 and meshes.world.get_local_rank("tp") != 0:
                continue
            grad = grad.to_local()
        squares += grad.float().pow(2).sum().cpu()
    return squares


def clip_grad_norm_(parallel: Parallelized, dims: ParallelDims, meshes: Meshes, max_norm: float):
    """The whole model's gradient 2-norm over every dimension (each element counted
    once: stages over pp, shards over dp_shard * cp and ep, TP pieces over tp), the
    same on every rank; gradients scaled to ``max_norm`` when it is exceeded."""
    squares = torch.zeros((), dtype=torch.float32)
    for module in parallel.modules:
        if isinstance(module, fs.FlexShardModule):
            squares += _flexshard_squares(module, dims, meshes)
        else:
            squares += _dtensor_squares(module, dims, meshes)
    device = next(parallel.parameters()).device
    squares = squares.to(device)
    dist.all_reduce(squares)  # the world: every rank adds what it alone counts
    total = float(squares.sqrt())
    coef = min(max_norm / (total + 1e-6), 1.0)
    if coef < 1.0:
        for param in parallel.parameters():
            if param.grad is not None:
                param.grad.mul_(coef)
    return total


# ------------------------------------------------------------------ full parameters
def full_parameters(parallel: Parallelized, meshes: Meshes) -> dict[str, torch.Tensor]:
    """The whole model's parameters, gathered on every rank (tests, export): flexshard
    or FSDP2 shards, TP pieces, EP's experts and PP's stages put back together."""
    params: dict[str, torch.Tensor] = {}
    for module in parallel.modules:
        if isinstance(module, fs.FlexShardModule):
            params.update(fs.full_state_dict(module))
        else:
            for name, param in module.named_parameters():
                value = param.full_tensor() if isinstance(param, DTensor) else param
                params[name] = value.detach()
    for name, value in list(params.items()):
        if isinstance(value, DTensor):
            params[name] = value.full_tensor()
        if meshes.ep is not None and any(name.startswith(f + ".") for f in parallel.expert_fqns):
            group = meshes.ep.get_group()
            pieces = [torch.empty_like(value) for _ in range(group.size())]
            dist.all_gather(pieces, value.contiguous(), group=group)
            params[name] = torch.cat(pieces)
    if meshes.pp is not None:
        stages: list[Any] = [None] * meshes.pp.size()
        mine = {k: v.cpu() for k, v in params.items()}
        dist.all_gather_object(stages, mine, group=meshes.pp.get_group())
        for stage in stages:
            params.update(stage)
    return {name: params[name] for name in sorted(params)}
