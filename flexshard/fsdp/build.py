"""From BucketSpecs to built buckets, shared by ``flex_shard`` and ``fully_shard``:
which parameters each bucket takes (patterns, tied and TP parameters), their
placements and quantization checked, one plan agreed by every rank, then the
buckets built on the device."""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from ..placements import BlockShard, Placement, Shard
from ..placements.layout import BucketLayout, plan_bucket
from ..quant import QuantFormat
from ..runtime.bucket import Bucket, slot_of
from ..runtime.collectives import BucketComm, MeshGroups
from ..runtime.dtensor.tensor_parallel import check_tp_param, local_of, spec_of
from ..runtime.storage import BucketParam
from ..torch_internals import grad_dtype_override, resolved_param_dtype
from .plan_agreement import check_same_plan
from .replaced import mark_replaced


def parameter_locations(module: nn.Module) -> dict[int, list[str]]:
    """Every FQN under which each not-yet-sharded parameter is reachable (ties share one).
    A parameter an earlier call sharded, still reachable here, is tied across two
    buckets: refused, as FSDP2 refuses it (each bucket would train its own copy)."""
    locations: dict[int, list[str]] = {}
    for fqn, param in module.named_parameters(remove_duplicate=False):
        taken = getattr(param, "_flexshard_sharded_in", None)
        if taken is not None:
            raise ValueError(
                f"parameter '{fqn}' is shared with a parameter already sharded in bucket "
                f"'{taken}'; shard the modules that share it in one call "
                "(fully_shard([a, b]), or their common parent)"
            )
        if slot_of(param) is None:
            locations.setdefault(id(param), []).append(fqn)
    return locations


def _owner(module: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    prefix, _, attr = fqn.rpartition(".")
    return module.get_submodule(prefix), attr


def modules_to_hook(root: nn.Module, fqns: Sequence[str]) -> list[nn.Module]:
    """The called modules that run the bucket's parameters: their deepest common
    parent, or, when that is a container without a forward (ModuleList, ModuleDict),
    each of its children that holds some of them (``layers.*``: every layer)."""
    paths = [fqn.split(".")[:-1] for fqn in fqns]
    common: list[str] = []
    for parts in zip(*paths):
        if any(p != parts[0] for p in parts):
            break
        common.append(parts[0])
    parent = root.get_submodule(".".join(common))
    containers = (nn.ModuleList, nn.ModuleDict)
    if isinstance(parent, containers) and all(len(p) > len(common) for p in paths):
        names = {p[len(common)] for p in paths}
        children = [m for name, m in parent.named_children() if name in names]
        if not any(isinstance(m, containers) for m in children):
            return children
    while common and isinstance(root.get_submodule(".".join(common)), containers):
        common.pop()
    return [root.get_submodule(".".join(common))]


def resolve_placement(
    spec_placement: object, fqn: str, param: nn.Parameter, bucket: str
) -> Placement:
    check_tp_param(param, fqn, bucket)
    placement = (
        spec_placement(fqn, param)
        if callable(spec_placement) and not isinstance(spec_placement, Placement)
        else spec_placement
    )
    if placement is None:
        placement = Shard(0)
    if not isinstance(placement, Placement):
        placement = _from_torch_placement(placement, fqn, bucket)
    return placement


def _from_torch_placement(placement: object, fqn: str, bucket: str) -> Placement:
    """Accept torch's own ``Shard(dim)`` from an FSDP2 ``shard_placement_fn``."""
    from torch.distributed.tensor import Shard as TorchShard

    if isinstance(placement, TorchShard):
        return Shard(placement.dim)
    raise TypeError(
        f"bucket '{bucket}': placement for parameter '{fqn}' must be a flexshard Placement, "
        f"got {placement!r}"
    )


@dataclass
class BucketPlan:
    """One bucket, validated and laid out; nothing built or communicated yet."""

    name: str
    members: list[tuple[nn.Parameter, list[str]]]
    placements: list[Placement]
    layout: BucketLayout
    hook_modules: list[nn.Module]
    mp_policy: MixedPrecisionPolicy
    reshard_after_forward: bool | None
    quant: QuantFormat | None = None
    #: the bucket's own process groups and mesh (None: those of the call)
    groups: MeshGroups | None = None
    #: per member, its ``param_dtype`` (``param_dtype_override_fn`` resolved)
    param_dtypes: list[torch.dtype | None] = field(init=False)

    def __post_init__(self) -> None:
        # resolved while planning, so a refusal is agreed by every rank (FSDP2 calls the
        # function once per parameter when it shards)
        self.param_dtypes = [resolved_param_dtype(self.mp_policy, p) for p, _ in self.members]
        if self.quant is not None and len(set(self.param_dtypes)) > 1:
            raise ValueError(
                f"bucket '{self.name}' (quant={self.quant}): param_dtype_override_fn gives "
                "its parameters several dtypes; a quantized bucket gathers one"
            )


def check_quant(
    name: str,
    members: list[tuple[nn.Parameter, list[str]]],
    placements: list[Placement],
    quant: QuantFormat,
) -> None:
    """A quantized bucket needs whole format blocks inside every tile: then each rank
    quantizes its own tiles exactly as quantizing the full weight would."""
    r, c = quant.block
    if len({param.dtype for param, _ in members}) > 1:
        raise ValueError(f"bucket '{name}' (quant={quant}): parameters must share one dtype")
    for (param, fqns), placement in zip(members, placements):
        where = f"bucket '{name}' (quant={quant}): parameter '{fqns[0]}'"
        if not isinstance(placement, BlockShard) or param.ndim < 2:
            raise ValueError(
                f"{where} must be a 2-D or batched weight placed with BlockShard, got "
                f"{placement} on shape {tuple(param.shape)}"
            )
        rows, cols = placement.block
        if rows % r or cols % c:
            raise ValueError(
                f"{where} has BlockShard tiles {placement.block} that are not multiples of "
                f"the format's block {quant.block}"
            )
        if not param.dtype.is_floating_point:
            raise ValueError(f"{where} is {param.dtype}; only floating weights quantize")


def bucket_layout(
    name: str,
    members: list[tuple[nn.Parameter, list[str]]],
    placements: list[Placement],
    world_size: int,
    first_rank: int,
    mp_policy: MixedPrecisionPolicy,
    pack_as_bytes: bool = False,
    ragged: bool = False,
) -> BucketLayout:
    """The bucket's layout over ``world_size`` ranks, once its parameters' dtypes are
    known to share one storage (one dtype, or bytes without a casting ``param_dtype``)."""
    dtypes: dict[torch.dtype, str] = {}
    for param, fqns in members:
        dtypes.setdefault(param.dtype, fqns[0])
    listed = ", ".join(f"'{fqn}' is {dtype}" for dtype, fqn in dtypes.items())
    if len(dtypes) > 1 and not pack_as_bytes:
        raise ValueError(
            f"bucket '{name}': parameters of different dtypes cannot share a bucket ({listed}); "
            "split them into buckets of one dtype, or pack them as bytes "
            "(BucketSpec(..., pack_as_bytes=True))"
        )
    if len(dtypes) > 1 and mp_policy.param_dtype is not None:
        raise ValueError(
            f"bucket '{name}' packs parameters of several dtypes as bytes ({listed}) and "
            f"gathers each in its own dtype; its mp_policy's param_dtype "
            f"{mp_policy.param_dtype} would cast them all: give the bucket one or the other"
        )
    return plan_bucket(
        [(fqns[0], tuple(local_of(p).shape), pl) for (p, fqns), pl in zip(members, placements)],
        world_size,
        bucket=name,
        first_rank=first_rank,
        ragged=ragged,
    )


def _agree_and_build(
    root: nn.Module,
    plan_fn: Callable[[], list[BucketPlan]],
    groups: MeshGroups,
    timeout: datetime.timedelta,
) -> list[tuple[Bucket, list[nn.Module]]]:
    """Validate locally, agree with the other ranks in one small all-gather (so a
    rank whose input is bad, or differs, makes every rank raise instead of hang),
    then build the buckets."""
    try:
        plans, error = plan_fn(), None
    except (ValueError, TypeError) as err:
        plans, error = [], err
    check_same_plan(groups, [(p.name, p.members, p.placements) for p in plans], error, timeout)
    built = []
    call_groups = groups
    for plan in plans:
        groups = plan.groups or call_groups
        params = [
            BucketParam(
                fqns[0],
                param.requires_grad,
                [_owner(root, f) for f in fqns],
                spec_of(param),
                placement,
                param_dtype,
                grad_dtype_override(param),
            )
            for (param, fqns), placement, param_dtype in zip(
                plan.members, plan.placements, plan.param_dtypes
            )
        ]
        initial = [_on_device(param, groups.device) for param, _ in plan.members]
        comm = BucketComm(plan.name, groups.shard, groups.replicate, timeout)
        bucket = Bucket(
            plan.name,
            plan.layout,
            params,
            initial,
            comm,
            groups.rank,
            plan.mp_policy,
            plan.reshard_after_forward,
            plan.quant,
            groups.mesh,
        )
        for param, _ in plan.members:  # a tie left outside the bucket is refused later
            param._flexshard_sharded_in = plan.name
        built.append((bucket, plan.hook_modules))
    return built


def _on_device(param: nn.Parameter, device: torch.device) -> torch.Tensor:
    param = local_of(param)  # a TP DTensor: its local piece is what flexshard shards
    if param.device.type in ("meta", device.type):
        return param.detach()
    return param.detach().to(device)


def build_buckets(
    root: nn.Module,
    plan: Callable[[], list[BucketPlan]],
    groups: MeshGroups,
    timeout: datetime.timedelta,
    call: str,
) -> list[tuple[Bucket, list[nn.Module]]]:
    """Build the planned buckets, then mark the parameters they replaced, so flexshard's
    optimizers refuse them by name (a build that fails marks nothing)."""
    planned: list[BucketPlan] = []
    built = _agree_and_build(root, lambda: planned.extend(plan()) or planned, groups, timeout)
    for p in planned:
        mark_replaced(p.members, p.name, call)
    return built
