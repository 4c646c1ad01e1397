"""Data parallelism from the config, the one place it is applied (data parallelism
alone, or last in ``parallelize``'s composition): flexshard buckets (one per block plus
one outer bucket by default, a placement per bucket) or torch FSDP2 for comparison.
Muon's layout is decided here too, where it is applied: attention projections in
whole-head row blocks (``muon_row_blocks``), which the optimizer's DistMuon (and
SOAP / Shampoo's MatrixOptimizer) reads."""

from __future__ import annotations

import datetime
import fnmatch
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

import flexshard as fs
from flexshard.optim import matrix_buckets, muon_buckets
from flexshard.optim.planner import PlacementByName

from ..config import Config, ConfigError, ModelConfig
from .exchange import configured_timeout

if TYPE_CHECKING:  # dims runs this file's check
    from .dims import Meshes

# hc_head: DeepSeek-V4's collapse of the residual streams, beside the final norm
OUTER_PATTERNS = ["tok_embeddings.*", "hc_head.*", "norm.*", "output.*"]
Policy = fs.Placement | Callable[[str, nn.Parameter], fs.Placement]


def check_backend_options(cfg: Config) -> None:
    """Options of the flexshard backend refused under torch FSDP2, and explicit buckets
    refused beside tp, pp or ep (run once, before any rank starts, by
    ``checked_dims``)."""
    par = cfg.parallelism
    if par.dp_backend == "fsdp2":
        if par.placement != "shard0" or par.buckets:
            raise ConfigError(
                'parallelism.placement and parallelism.buckets apply to dp_backend = "flexshard";'
                ' torch FSDP2 always shards dim 0 (use placement = "shard0")'
            )
        if cfg.training.optimizer == "muon":
            raise ConfigError('training.optimizer = "muon" runs on dp_backend = "flexshard" only')
    if par.tp * par.pp * par.ep > 1 and par.buckets:
        raise ConfigError(
            "parallelism.buckets are for data parallelism alone; with tp, pp or ep > 1 use "
            'a named placement (or "muon")'
        )


def muon_row_blocks(model_cfg: ModelConfig) -> dict[str, int]:
    """Muon orthogonalises attention projections per head: rows per block by FQN glob.
    MLA: each of its matrices whole, but ``kv_a_proj_with_mqa``, which fuses two (the
    ``kv_lora_rank`` latent rows, then the rotated key's rows: blocks of
    ``kv_lora_rank`` rows, the second one short; validation keeps the rotated rows
    within one block)."""
    if model_cfg.attention == "mla":
        return {"*.kv_a_proj_with_mqa.weight": model_cfg.kv_lora_rank}
    head_dim = model_cfg.head_size()
    if model_cfg.attention == "deepseek_v4":  # per head; wo_a: per group's block
        v4 = model_cfg.deepseek_v4
        return {
            "*.attn.wq_b.weight": head_dim,
            "*.indexer.wq_b.weight": v4.index_head_dim,
            "*.attn.wo_a.weight": v4.o_lora_rank,
        }
    return {"*.wq.weight": head_dim, "*.wk.weight": head_dim, "*.wv.weight": head_dim}


def muon_head_placement(base: Any, model_cfg: ModelConfig) -> Any:
    """``base`` (a placement or an ``(fqn, param) -> placement`` function) with the
    parameters of :func:`muon_row_blocks` in whole-head row blocks
    (``BlockShard((head_dim, C))``): every head whole on a rank, so per-head steps move
    no byte. Shard(0) or FlatShard over a dp group larger than the heads per piece would
    cut heads: DistMuon would redistribute them, MatrixOptimizer refuses them (the
    single process, and so the loss parity, is per head whatever the layout)."""
    rows = muon_row_blocks(model_cfg)

    def placement(fqn: str, param: nn.Parameter) -> Any:
        for pattern, head_rows in rows.items():
            if param.ndim == 2 and fnmatch.fnmatchcase(fqn, pattern):
                return fs.BlockShard((head_rows, param.shape[-1]))
        return base if isinstance(base, fs.Placement) else base(fqn, param)

    return placement


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
    head_dim = model_cfg.head_size()

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


def _layer_names(module: nn.Module) -> list[str]:
    return [name for name, _ in module.layers.named_children()]  # type: ignore[union-attr]


def _outer_patterns(module: nn.Module) -> list[str]:
    """The root parts a (stage) module really holds: a pipeline stage has only some."""
    parts = [getattr(module, pattern.split(".")[0], None) for pattern in OUTER_PATTERNS]
    return [
        pattern
        for pattern, part in zip(OUTER_PATTERNS, parts)
        if part is not None and any(True for _ in part.parameters())
    ]


def block_placement(cfg: Config) -> Policy:
    """``parallelism.placement`` for every block; under SOAP or Shampoo (per-head
    matrices MatrixOptimizer steps only where stored whole), q/k/v in whole heads. Muon
    keeps the placement as named: DistMuon redistributes the heads it cuts, so
    ``shard0`` is FSDP2's layout with a redistributing DistMuon, with no padding of
    heads fewer than the ranks (the ``muon`` placement is the communication-free one)."""
    placement = named_placement(cfg.parallelism.placement, cfg)
    if cfg.training.optimizer in ("soap", "shampoo"):
        placement = muon_head_placement(placement, cfg.model)
    return placement


def _expert_specs(
    module: nn.Module, expert_fqns: Sequence[str], mesh: DeviceMesh
) -> list[fs.BucketSpec]:
    """Each MoE layer's experts (``E / ep`` of them on this rank) in a ragged bucket of
    its own over the expert mesh, every expert whole on one rank, pinned by one plan
    balanced across the layers (the planner's blocks are the layers' expert modules)."""
    stacks = nn.ModuleList(module.get_submodule(fqn) for fqn in expert_fqns)
    planned = muon_buckets(stacks, mesh.size(-1), detect_head=False)
    specs = []
    for spec in planned:
        fqn = expert_fqns[int(spec.name)]  # the plan names block i "i"
        table = spec.placement.table  # type: ignore[union-attr]
        renamed = {f"{fqn}.{name.split('.', 1)[1]}": p for name, p in table.items()}
        specs.append(
            fs.BucketSpec(f"{fqn}.*", PlacementByName(renamed), name=fqn, mesh=mesh, ragged=True)
        )
    return specs


def bucket_specs(
    cfg: Config,
    module: nn.Module,
    dp_shard: int,
    expert_fqns: Sequence[str] = (),
    experts_mesh: DeviceMesh | None = None,
) -> list[fs.BucketSpec]:
    """The flexshard buckets this config asks for ``module`` (the model or a pipeline
    stage): ``[[parallelism.buckets]]``, or one bucket per block plus one for the root's
    parts (under ``"muon"``: the planner's, matrices whole on owners balanced across the
    module, ragged collectives; EP's ``expert_fqns`` then in buckets of their own over
    ``experts_mesh``)."""
    par = cfg.parallelism
    if par.buckets:
        return _explicit_buckets(cfg)
    if par.placement == "muon":
        if cfg.training.optimizer in ("soap", "shampoo"):  # balanced on their own cost
            return matrix_buckets(module, dp_shard)
        rows = muon_row_blocks(cfg.model)
        if not expert_fqns:
            return muon_buckets(module, dp_shard, row_blocks=rows)
        assert experts_mesh is not None
        excluded = [f"{fqn}.*" for fqn in expert_fqns]
        specs = muon_buckets(module, dp_shard, row_blocks=rows, exclude=excluded)
        experts = _expert_specs(module, expert_fqns, experts_mesh)
        # in forward order: each block's bucket, then the experts inside it
        ordered = []
        for spec in specs:
            ordered.append(spec)
            ordered += [e for e in experts if str(e.name).startswith(f"{spec.name}.")]
        return ordered
    placement = block_placement(cfg)
    specs = [
        fs.BucketSpec(f"layers.{name}.*", placement, name=f"layers.{name}")
        for name in _layer_names(module)
    ]
    if _mtp(module):  # multi-token prediction: one bucket for its depths
        specs.append(fs.BucketSpec("mtp.*", placement, name="mtp"))
    outer = _outer_patterns(module)
    if outer:
        specs.append(fs.BucketSpec(outer, placement, name="outer"))
    return specs


def _mtp(module: nn.Module) -> list[nn.Module]:
    """The multi-token prediction module, if ``module`` has one."""
    mtp = getattr(module, "mtp", None)
    return [mtp] if mtp is not None else []


def apply_dp(
    module: nn.Module, cfg: Config, meshes: Meshes, expert_fqns: Sequence[str] = ()
) -> nn.Module:
    """Data parallelism over ``meshes.dp`` (degree 1 included: a group of one issues no
    collective): one bucket (or FSDP2 group) per block plus one for the root's parts;
    EP's expert weights first, on ``meshes.experts_dp``."""
    policy = mp_policy(cfg.training.mixed_precision)
    reshard = cfg.parallelism.reshard_after_forward
    timeout = configured_timeout(cfg.parallelism.timeout_s)
    present = [fqn for fqn in expert_fqns if _has_submodule(module, fqn)]
    if cfg.parallelism.dp_backend == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for fqn in present:
            fully_shard(module.get_submodule(fqn), mesh=meshes.experts_dp, mp_policy=policy)
        for layer in [*module.layers, *_mtp(module)]:  # type: ignore[union-attr]
            fully_shard(layer, mesh=meshes.dp, mp_policy=policy, reshard_after_forward=reshard)
        return fully_shard(module, mesh=meshes.dp, mp_policy=policy, reshard_after_forward=reshard)
    if present and cfg.parallelism.placement != "muon":
        # buckets on two meshes: fully_shard style, one call per module
        return _flexshard_per_module(
            module, block_placement(cfg), meshes, present, policy, reshard, timeout
        )
    return fs.flex_shard(
        module,
        mesh=meshes.dp,
        buckets=bucket_specs(cfg, module, meshes.dp.size(-1), present, meshes.experts_dp),
        mp_policy=policy,
        reshard_after_forward=reshard,
        timeout=timeout,
    )


def _flexshard_per_module(
    module: nn.Module,
    placement: Policy,
    meshes: Meshes,
    expert_fqns: list[str],
    policy: MixedPrecisionPolicy,
    reshard: bool,
    timeout: datetime.timedelta,
) -> nn.Module:
    """fs.fully_shard on the experts (their own mesh), then each block, then the root:
    flex_shard's buckets share one mesh, EP's experts need another."""
    fqn_of = {id(p): fqn for fqn, p in module.named_parameters()}

    def place(param: nn.Parameter) -> fs.Placement:
        if isinstance(placement, fs.Placement):
            return placement
        return placement(fqn_of[id(param)], param)

    for fqn in expert_fqns:
        fs.fully_shard(
            module.get_submodule(fqn),
            mesh=meshes.experts_dp,
            mp_policy=policy,
            shard_placement_fn=place,
            timeout=timeout,
        )
    # blocks, then the root
    for target in [*module.layers, *_mtp(module), module]:  # type: ignore[union-attr]
        sharded = fs.fully_shard(
            target,
            mesh=meshes.dp,
            mp_policy=policy,
            reshard_after_forward=reshard,
            shard_placement_fn=place,
            timeout=timeout,
        )
    return sharded


def _has_submodule(module: nn.Module, fqn: str) -> bool:
    try:
        module.get_submodule(fqn)
    except AttributeError:
        return False
    return True
