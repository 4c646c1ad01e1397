"""The public entry points: ``flex_shard`` (buckets by pattern) and ``fully_shard``
(FSDP2's signature, one bucket per call).

Argument checks of the public entry points: run before any collective, so a bad
argument raises on the rank that passed it instead of hanging the others.

Detect bucket specs that differ across ranks before they can hang a collective.

From BucketSpecs to built buckets, shared by ``flex_shard`` and ``fully_shard``:
which parameters each bucket takes (patterns, tied and TP parameters), their
placements and quantization checked, one plan agreed by every rank, then the
buckets built on the device.

Parameters that sharding replaced. ``flex_shard`` and ``fully_shard`` set new
parameter objects (DTensors over bucket storage) on the modules, as FSDP2 does; a
parameter collected before sharding is no longer the model's and would silently never
be trained. flexshard marks the replaced objects so its optimizers can refuse them,
naming the parameter, at construction.

``share_comm_ctx``: torch 2.13's FSDP2 lets several roots (pipeline stages' model
chunks) share one set of CUDA streams, so their buffers do not fragment memory across
streams. flexshard always shares them: every bucket of a process on one CUDA device
uses the same all-gather and reduce-scatter streams (``runtime/device.py``), and CPU
runs have none. The call checks its argument as FSDP2's does and has nothing to do."""

from __future__ import annotations

import datetime
import fnmatch
import functools
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
)

from ..placements import BlockShard, Placement, Shard
from ..placements.layout import BucketLayout, plan_bucket
from ..quant import QuantFormat
from ..runtime.bucket import Bucket, slot_of
from ..runtime.collectives import (
    DEFAULT_TIMEOUT,
    BucketComm,
    MeshGroups,
    Pending,
    check_timeout,
    resolve_mesh,
)
from ..runtime.dtensor import SpmdDims, check_tp_param, local_of, spec_of
from ..runtime.hooks import (
    StepState,
    install_bucket_hooks,
    install_forward_casts,
    install_root_hooks,
)
from ..runtime.module import FlexShardModule, make_flexshard_class
from ..runtime.storage import BucketParam
from ..torch_internals import (
    DataParallelMeshDims,
    PlacementMesh,
    all_gather_single,
    grad_dtype_override,
    placement_mesh,
    resolved_param_dtype,
)
from .dp_mesh_dims import check_spmd_param, dp_mesh, result_spmd_dims
from .state_dict import install_state_dict_hooks


def check_bucket_spec(spec: Any) -> None:
    """Field types of a BucketSpec."""
    where = f"BucketSpec({spec.patterns!r})"
    patterns = spec.patterns
    if isinstance(patterns, str):
        patterns = [patterns]
    if not isinstance(patterns, Sequence) or not all(isinstance(p, str) for p in patterns):
        raise TypeError(f"{where}: patterns must be a str or a sequence of str")
    if not patterns:
        raise ValueError(f"{where}: patterns is empty; give at least one FQN glob")
    if spec.name is not None and not isinstance(spec.name, str):
        raise TypeError(f"{where}: name must be a str or None, got {spec.name!r}")
    if not (isinstance(spec.placement, Placement) or callable(spec.placement)):
        raise TypeError(
            f"{where}: placement must be a Placement or a callable (fqn, param) -> "
            f"Placement, got {spec.placement!r}"
        )
    check_options(where, spec.mp_policy, spec.reshard_after_forward, allow_none_policy=True)
    if not isinstance(spec.pack_as_bytes, bool):
        raise TypeError(f"{where}: pack_as_bytes must be a bool, got {spec.pack_as_bytes!r}")
    if spec.quant is not None and not isinstance(spec.quant, QuantFormat):
        raise TypeError(
            f"{where}: quant must be a QuantFormat (FP8Blockwise, MXFP8) or None, "
            f"got {spec.quant!r}"
        )
    if not isinstance(spec.ragged, bool):
        raise TypeError(f"{where}: ragged must be a bool, got {spec.ragged!r}")
    if spec.ragged and (spec.quant is not None or spec.pack_as_bytes):
        raise ValueError(
            f"{where}: ragged=True moves one dtype's elements per rank; a quantized or "
            "byte-packed bucket sends its own wire format: give it ragged=False"
        )


def check_options(
    where: str,
    mp_policy: object,
    reshard_after_forward: object,
    allow_none_policy: bool,
) -> None:
    """Argument types shared by BucketSpec, flex_shard and fully_shard."""
    if not (
        isinstance(mp_policy, MixedPrecisionPolicy) or (mp_policy is None and allow_none_policy)
    ):
        raise TypeError(
            f"{where}: mp_policy must be a torch MixedPrecisionPolicy, got {mp_policy!r}"
        )
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        raise TypeError(
            f"{where}: reshard_after_forward must be a bool or None, got {reshard_after_forward!r}"
        )


def check_module(where: str, module: object) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"{where}: module must be a torch.nn.Module, got {type(module).__name__}")


Plan = tuple[str, Sequence[tuple[nn.Parameter, list[str]]], Sequence[Placement]]


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")


def _bucket_digest(
    name: str, members: Sequence[tuple[nn.Parameter, list[str]]], placements: Sequence[Placement]
) -> int:
    described = [
        (fqns, tuple(p.shape), str(p.dtype), repr(pl)) for (p, fqns), pl in zip(members, placements)
    ]
    return _digest(repr((name, described)))


def _gather(
    values: list[int],
    group: dist.ProcessGroup,
    device: torch.device,
    timeout: datetime.timedelta,
    buckets: list[str],
) -> torch.Tensor:
    """Bounded by ``timeout``: a rank that never reaches set-up makes the others raise."""
    local = torch.tensor(values, dtype=torch.int64, device=device)
    out = torch.empty(dist.get_world_size(group) * len(values), dtype=torch.int64, device=device)
    Pending.launch(
        lambda: all_gather_single(out, local, group=group, async_op=True),
        "set-up agreement all-gather",
        ", ".join(buckets) or "(none planned on this rank)",
        timeout,
        group,
    ).wait()
    return out.view(dist.get_world_size(group), len(values)).cpu()


#: buckets whose own digest travels in the one exchange, so a mismatch can be named
NAMED_BUCKETS = 16
#: bytes of a failing rank's error message that travel with it
MESSAGE_BYTES = 512


def _encode(message: str) -> list[int]:
    raw = message.encode()[:MESSAGE_BYTES].ljust(MESSAGE_BYTES, b"\0")
    return [int.from_bytes(raw[i : i + 7], "little") for i in range(0, MESSAGE_BYTES, 7)]


def _decode(values: list[int]) -> str:
    raw = b"".join(int(v).to_bytes(7, "little") for v in values)
    return raw.rstrip(b"\0").decode(errors="replace")


def check_same_plan(
    groups: MeshGroups,
    plans: Sequence[Plan],
    local_error: Exception | None = None,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
) -> None:
    """One small fixed-size all-gather per group, all of them before anything is
    raised: every rank must plan the same buckets with the same parameters, shapes,
    dtypes and placements, and none may have failed validation. Raises on every rank;
    a rank whose own validation failed raises its own error, the others quote it."""
    check_timeout(timeout)
    digests = [_bucket_digest(*plan) for plan in plans]
    named = (digests + [0] * NAMED_BUCKETS)[:NAMED_BUCKETS]
    message = _encode(str(local_error) if local_error is not None else "")
    mine = [int(local_error is not None), len(digests), _digest(repr(digests)), *named, *message]
    names = [name for name, _, _ in plans]
    summaries = [
        (group, _gather(mine, group, groups.device, timeout, names))
        for group in (groups.shard, groups.replicate)
        if group is not None and dist.get_world_size(group) > 1
    ]
    if local_error is not None:
        raise local_error
    for group, summary in summaries:
        ranks = dist.get_process_group_ranks(group)
        failed = [r for r in range(len(ranks)) if summary[r, 0]]
        if failed:
            first = _decode(summary[failed[0], 3 + NAMED_BUCKETS :].tolist())
            raise ValueError(
                f"flexshard input failed validation on ranks {[ranks[r] for r in failed]}; "
                f"rank {ranks[failed[0]]}: {first}"
            )
        if (summary[:, : 3 + NAMED_BUCKETS] == summary[0, : 3 + NAMED_BUCKETS]).all():
            continue
        counts = summary[:, 1].tolist()
        if len(set(counts)) > 1:
            raise ValueError(
                f"bucket specs differ across ranks: ranks {ranks} plan {counts} buckets; "
                f"this rank's are {names}"
            )
        for b, name in enumerate(names[:NAMED_BUCKETS]):
            column = summary[:, 3 + b]
            if not (column == column[0]).all():
                differ = [ranks[r] for r in range(len(ranks)) if column[r] != column[0]]
                raise ValueError(
                    f"bucket '{name}' is specified differently on ranks {differ} than on rank "
                    f"{ranks[0]} (parameters, shapes, dtypes or placements differ)"
                )
        raise ValueError(f"bucket specs differ across ranks {ranks} (a bucket past the first 16)")


PlacementFn = Callable[[str, nn.Parameter], Placement]


@dataclass(frozen=True)
class BucketSpec:
    """A named group of parameters, chosen by FQN glob patterns, that shares one
    placement policy (a Placement, or ``placement(fqn, param) -> Placement``)."""

    patterns: str | Sequence[str]
    placement: Placement | PlacementFn = Shard(0)
    name: str | None = None
    mp_policy: MixedPrecisionPolicy | None = None
    reshard_after_forward: bool | None = None
    #: let parameters of several dtypes share the bucket: one uint8 storage and one
    #: all-gather of bytes; gradients reduce in the widest dtype (or mp reduce_dtype)
    pack_as_bytes: bool = False
    #: all-gather block-quantized (FP8Blockwise or MXFP8): BlockShard tiles that are
    #: multiples of the format's block, each rank quantizing its own tiles
    quant: QuantFormat | None = None
    #: the bucket's own mesh, 1-D (shard) or 2-D (replicate, shard); None: flex_shard's.
    #: FSDP2 says the same with a shard_placement_fn's ShardPlacementResult
    mesh: DeviceMesh | None = None
    #: each rank stores, sends and receives only its own share: the all-gather and the
    #: gradient reduction move per-rank sizes instead of W shards padded to the largest
    #: (Owned / BlockShard buckets whose ranks hold unequal shares, such as a block's
    #: whole matrices over more ranks than it has matrices; docs/placements.md)
    ragged: bool = False

    def __post_init__(self) -> None:
        check_bucket_spec(self)
        if self.mesh is not None and not isinstance(self.mesh, DeviceMesh):
            raise TypeError(
                f"BucketSpec({self.patterns!r}): mesh must be a DeviceMesh or None, "
                f"got {self.mesh!r}"
            )

    @property
    def pattern_list(self) -> list[str]:
        return [self.patterns] if isinstance(self.patterns, str) else list(self.patterns)


def _parameter_locations(module: nn.Module) -> dict[int, list[str]]:
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


def _hook_modules(root: nn.Module, fqns: Sequence[str]) -> list[nn.Module]:
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


def _resolve_placement(
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
class _Plan:
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


def _check_quant(
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


def _plan(
    name: str,
    members: list[tuple[nn.Parameter, list[str]]],
    placements: list[Placement],
    world_size: int,
    first_rank: int,
    mp_policy: MixedPrecisionPolicy,
    pack_as_bytes: bool = False,
    ragged: bool = False,
) -> BucketLayout:
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
    plan_fn: Callable[[], list[_Plan]],
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


_MARK = "_flexshard_replaced_by"


def mark_replaced(members: list[tuple[nn.Parameter, list[str]]], bucket: str, call: str) -> None:
    """Mark the pre-sharding parameters of one bucket (called once it is built)."""
    for param, fqns in members:
        setattr(param, _MARK, f"'{fqns[0]}' (replaced by {call}, bucket '{bucket}')")


def check_not_replaced(param: torch.Tensor, who: str) -> None:
    """Raise naming ``param`` if sharding replaced it: it is not the model's anymore."""
    where = getattr(param, _MARK, None)
    if where is not None:
        raise ValueError(
            f"{who}: parameter {where} was collected before sharding; the model holds a "
            "new parameter now and this one would never be trained. Build the optimizer "
            "after flex_shard / fully_shard, from model.parameters()"
        )


__all__ = ["BucketSpec", "flex_shard", "fully_shard"]


def flex_shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    buckets: Sequence[BucketSpec] = (),
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool | None = None,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
) -> FlexShardModule:
    """Shard ``module``'s parameters into ``buckets``; apply once, at the root.

    Every parameter must match exactly one bucket. Afterwards the parameters are
    DTensors on the bucket's mesh (their local tensors views into its storage), as
    FSDP2's are. Tensor-parallel DTensor parameters (from ``parallelize_module``,
    applied first) are sharded by their local tensor and placed on the joined (dp, tp)
    mesh; the modules get DTensors on the tp mesh back after unshard. Every check runs
    before any bucket collective; the ranks then agree in one small all-gather, so a
    bad or differing spec on any rank raises on every rank instead of hanging the others.
    """
    check_module("flex_shard", module)
    if isinstance(buckets, (str, BucketSpec)) or not all(
        isinstance(b, BucketSpec) for b in buckets
    ):
        raise TypeError(f"flex_shard: buckets must be a list of BucketSpec, got {buckets!r}")
    check_options("flex_shard", mp_policy, reshard_after_forward, allow_none_policy=True)
    check_timeout(timeout)
    groups = resolve_mesh(mesh)
    plan = functools.partial(_plan_flex, module, buckets, groups, mp_policy, reshard_after_forward)
    built = _build_marked(module, plan, groups, timeout, "flex_shard")
    make_flexshard_class(module)
    install_state_dict_hooks(module)
    module._flexshard_buckets = [b for b, _ in built]
    install_root_hooks(module)
    module._flexshard_state = StepState(module, module._flexshard_buckets)
    for bucket, hook_modules in built:
        install_bucket_hooks(bucket, hook_modules)
    return module  # type: ignore[return-value]


def _plan_flex(
    module: nn.Module,
    buckets: Sequence[BucketSpec],
    call_groups: MeshGroups,
    mp_policy: MixedPrecisionPolicy | None,
    reshard_after_forward: bool | None,
) -> list[_Plan]:
    if any(isinstance(m, FlexShardModule) for m in module.modules()):
        raise ValueError(f"{type(module).__name__} is already sharded by flexshard; wrap it once")
    if not buckets:
        raise ValueError("flex_shard needs at least one BucketSpec")
    locations = _parameter_locations(module)
    param_of = {id(p): p for p in module.parameters()}
    names = [spec.name or f"bucket{i}" for i, spec in enumerate(buckets)]
    if len(set(names)) != len(names):
        raise ValueError(f"bucket names must be unique, got {names}")

    chosen: dict[int, int] = {}  # param id -> bucket index
    for b, spec in enumerate(buckets):
        for pattern in spec.pattern_list:
            hits = [
                pid
                for pid, fqns in locations.items()
                if any(fnmatch.fnmatchcase(f, pattern) for f in fqns)
            ]
            if not hits:
                raise ValueError(f"bucket '{names[b]}': pattern '{pattern}' matches no parameter")
            for pid in hits:
                other = chosen.setdefault(pid, b)
                if other != b:
                    fqns = locations[pid]
                    tied = f" (tied as {fqns})" if len(fqns) > 1 else ""
                    raise ValueError(
                        f"parameter '{fqns[0]}'{tied} matches bucket '{names[other]}' and bucket "
                        f"'{names[b]}'; every parameter must be in exactly one bucket"
                    )
    for pid, fqns in locations.items():
        if pid not in chosen:
            raise ValueError(
                f"parameter '{fqns[0]}' is in no bucket; add a pattern that matches it"
            )

    plans = []
    for b, spec in enumerate(buckets):
        members = [(param_of[pid], locations[pid]) for pid in locations if chosen[pid] == b]
        placements = [
            _resolve_placement(spec.placement, fqns[0], p, names[b]) for p, fqns in members
        ]
        # a bucket on its own mesh (the ranks agree on the plan over flex_shard's mesh)
        groups = resolve_mesh(spec.mesh) if spec.mesh is not None else call_groups
        world_size = groups.shard_size
        # successive buckets start LPT ties on successive ranks, spreading Owned params
        policy = spec.mp_policy or mp_policy or MixedPrecisionPolicy()
        layout = _plan(
            names[b],
            members,
            placements,
            world_size,
            b % world_size,
            policy,
            spec.pack_as_bytes,
            spec.ragged,
        )
        if spec.quant is not None:
            _check_quant(names[b], members, placements, spec.quant)
        plans.append(
            _Plan(
                names[b],
                members,
                placements,
                layout,
                _hook_modules(module, [f for _, fqns in members for f in fqns]),
                policy,
                spec.reshard_after_forward
                if spec.reshard_after_forward is not None
                else reshard_after_forward,
                spec.quant,
                groups if spec.mesh is not None else None,
            )
        )
    return plans


def _reshard_option(value: object, shard_size: int) -> bool | None:
    """FSDP2's int ``reshard_after_forward``: 1 is False, the shard group's size True
    (FSDP2's reading); a size between (reshard to a smaller group) keeps the parameters
    gathered here: the same numerics, no backward all-gather, more memory."""
    if isinstance(value, bool) or value is None:
        return value
    if not isinstance(value, int):
        raise TypeError(
            f"fully_shard: reshard_after_forward must be a bool, an int or None, got {value!r}"
        )
    if 1 <= value <= shard_size and shard_size % value == 0:
        return value != 1 and value == shard_size
    raise ValueError(
        f"fully_shard: reshard_after_forward={value!r} must be a bool, None or a divisor "
        f"of the shard group size {shard_size}"
    )


def _offload_option(policy: object, device: torch.device) -> None:
    """FSDP2's OffloadPolicy (none) and CPUOffloadPolicy: on a CPU mesh the sharded
    state already lives on the CPU; offloading from a GPU is not built yet."""
    if policy is None or type(policy) is OffloadPolicy:
        return
    if not isinstance(policy, CPUOffloadPolicy):
        raise TypeError(f"fully_shard: offload_policy must be an OffloadPolicy, got {policy!r}")
    if device.type != "cpu":
        raise NotImplementedError(
            f"fully_shard: CPUOffloadPolicy on a {device.type} mesh is not supported by "
            "flexshard yet (the sharded state stays on the device)"
        )


def fully_shard(
    module: nn.Module | Sequence[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], object] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
) -> FlexShardModule:
    """torch FSDP2's ``fully_shard``: one bucket of the parameters of ``module`` (or of
    a list of modules, gathered together by whichever runs first) that no earlier call
    took. ``shard_placement_fn`` may return torch's ``Shard(dim)``, any flexshard
    placement, or FSDP2's ``ShardPlacementResult`` (a mesh per parameter: one bucket per
    mesh, as FSDP2's parameter groups; a mesh info from ``dp_mesh_dims`` shards over that
    full SPMD mesh's dp dims). ``dp_mesh_dims``: ``mesh`` is the full SPMD mesh (see
    ``dp_mesh_dims.py``)."""
    if isinstance(module, nn.ModuleDict):  # a container without forward: its modules
        module = list(module.values())
    modules = list(module) if isinstance(module, (list, tuple, nn.ModuleList)) else [module]
    if not modules:
        raise ValueError("fully_shard needs at least one module")
    for m in modules:
        check_module("fully_shard", m)
    check_options("fully_shard", mp_policy, None, allow_none_policy=False)
    if shard_placement_fn is not None and not callable(shard_placement_fn):
        raise TypeError(
            f"fully_shard: shard_placement_fn must be callable or None, got {shard_placement_fn!r}"
        )
    check_timeout(timeout)
    ignored = {id(p) for p in ignored_params or ()}
    spmd = None
    if dp_mesh_dims is not None:  # shard over the dp dims of the full SPMD mesh
        mesh, spmd = dp_mesh(mesh, dp_mesh_dims, reshard_after_forward)
    groups = resolve_mesh(mesh)
    _offload_option(offload_policy, groups.device)
    reshard = _reshard_option(reshard_after_forward, groups.shard_size)

    def plan() -> list[_Plan]:
        locations: dict[int, list[str]] = {}
        param_of: dict[int, nn.Parameter] = {}
        for m in modules:
            if isinstance(m, FlexShardModule):
                raise ValueError(
                    f"{type(m).__name__} is already sharded by flexshard; wrap it once"
                )
            prefix = _common_prefix(modules, m)
            for pid, fqns in _parameter_locations(m).items():
                if pid not in ignored:  # a tie between the modules: every name kept
                    locations.setdefault(pid, []).extend(prefix + f for f in fqns)
            param_of.update({id(p): p for p in m.parameters()})
        if not locations:
            return []
        name = type(modules[0]).__name__
        members = [(param_of[pid], fqns) for pid, fqns in locations.items()]
        plans = []
        for mesh_groups, group_spmd, group, chosen in _split_by_mesh(
            members, shard_placement_fn, groups, spmd, reshard_after_forward
        ):
            # FSDP2 checks each parameter against its own group's mesh info
            for param, fqns in group if group_spmd is not None else ():
                check_spmd_param(param, fqns[0], group_spmd)
            placements = [
                _resolve_placement(c, fqns[0], p, name) for (p, fqns), c in zip(group, chosen)
            ]
            # frozen parameters of other dtypes (fp8 or fp64 weights beside trainable ones,
            # as FSDP2 takes them) travel packed as bytes, each in its own dtype; trainable
            # ones of several dtypes are refused (by _plan), as FSDP2 refuses them
            trained = {p.dtype for p, _ in group if p.requires_grad}
            packed = len({p.dtype for p, _ in group}) > 1 and len(trained) <= 1
            size = mesh_groups.shard_size
            layout = _plan(name, group, placements, size, 0, mp_policy, packed)
            own = mesh_groups if mesh_groups is not groups else None
            group_reshard = reshard if own is None else _reshard_option(reshard_after_forward, size)
            plans.append(
                _Plan(
                    name, group, placements, layout, modules, mp_policy, group_reshard, groups=own
                )
            )
        return plans

    built = _build_marked(_root_of(modules), plan, groups, timeout, "fully_shard")
    for bucket, _ in built:  # FSDP2's collectives exactly (set_agree_on_unused_params)
        bucket.reduction.agree_on_unused = False
    for m in modules:
        make_flexshard_class(m)
        install_state_dict_hooks(m)
        m._flexshard_buckets = [b for b, _ in built]
        m._flexshard_state = None
        install_root_hooks(m)
    for bucket, hook_modules in built:
        install_bucket_hooks(bucket, hook_modules)
    if not built:  # no parameters of its own (a wrapper's root): FSDP2 casts all the same
        for m in modules:
            install_forward_casts(m, mp_policy)
    return module  # type: ignore[return-value]


#: the mesh ``fully_shard`` was called with, as a group's key (FSDP2's own mesh info)
_CALL_MESH = object()

_Member = tuple[nn.Parameter, list[str]]


def _split_by_mesh(
    members: list[_Member],
    shard_placement_fn: Callable[[nn.Parameter], object] | None,
    call_groups: MeshGroups,
    call_spmd: SpmdDims | None,
    reshard_after_forward: object,
) -> list[tuple[MeshGroups, SpmdDims | None, list[_Member], list[object]]]:
    """FSDP2's grouping of one call's parameters: a ``ShardPlacementResult`` puts its
    parameter on its mesh info's mesh, anything else on the call's mesh; one group (one
    bucket) per distinct (shard, replicate) process-group pair, in the order of each
    group's first parameter, with each parameter's placement as returned and the group's
    full SPMD mesh dims (None: a plain data-parallel mesh)."""
    found: dict[
        tuple[object, object],
        tuple[object, MeshGroups, SpmdDims | None, list[_Member], list[object]],
    ] = {}
    for param, fqns in members:
        result = shard_placement_fn(param) if shard_placement_fn is not None else None
        read = placement_mesh(result)
        if read is None:
            info, mesh_groups, spmd, placement = _CALL_MESH, call_groups, call_spmd, result
        else:
            mesh_groups, spmd = _mesh_groups(read, fqns[0], call_spmd, reshard_after_forward)
            info, placement = read.info, read.placement
        key = (mesh_groups.shard, mesh_groups.replicate)
        entry = found.setdefault(key, (info, mesh_groups, spmd, [], []))
        if entry[0] is not info:  # FSDP2's rule: one mesh info object per process group
            seen = "the mesh passed to fully_shard" if entry[0] is _CALL_MESH else entry[0]
            mine = "the mesh passed to fully_shard" if info is _CALL_MESH else info
            raise ValueError(
                "Params sharing the same process group must use the same FSDPMeshInfo "
                f"object, but got different objects: {seen} vs {mine} (parameter '{fqns[0]}')"
            )
        entry[3].append((param, fqns))
        entry[4].append(placement)
    return [(g, spmd, group, chosen) for _, g, spmd, group, chosen in found.values()]


def _mesh_groups(
    read: PlacementMesh, fqn: str, call_spmd: SpmdDims | None, reshard_after_forward: object
) -> tuple[MeshGroups, SpmdDims | None]:
    """The process groups of a ``ShardPlacementResult``'s mesh info, as FSDP2 shards over
    them: FSDPMeshInfo shards over its 1-D mesh, HSDPMeshInfo over dim 1 of its 2-D mesh
    and replicates over dim 0. A mesh info from ``dp_mesh_dims`` (torch's
    ``_get_mesh_info(mesh, dims)``) holds that dp sub-mesh and the full SPMD mesh its
    parameters are DTensors on: returned with the SPMD mesh's dp dims, so they are
    sharded and placed as ``fully_shard(dp_mesh_dims=...)`` does. Anything else raises,
    naming the parameter, before any collective (NotImplementedError is not one the
    ranks agree on: every rank raises it)."""
    where = f"fully_shard: parameter '{fqn}': shard_placement_fn returned a ShardPlacementResult"
    if not read.known:
        raise NotImplementedError(
            f"{where} with a {read.kind}, which flexshard cannot map; it takes FSDPMeshInfo "
            "(a 1-D shard mesh) and HSDPMeshInfo (a 2-D (replicate, shard) mesh)"
        )
    dims = (read.mesh.ndim, read.replicate_dim if read.hsdp else None, read.shard_dim)
    if dims != ((2, 0, 1) if read.hsdp else (1, None, 0)):
        raise NotImplementedError(
            f"{where} with a {read.kind} on a {read.mesh.ndim}-D mesh, shard_mesh_dim="
            f"{read.shard_dim}, replicate_mesh_dim={read.replicate_dim}; flexshard takes "
            "FSDPMeshInfo(1-D mesh, shard_mesh_dim=0) and HSDPMeshInfo(2-D mesh, "
            "shard_mesh_dim=1, replicate_mesh_dim=0), as FSDP2's own mesh infos are"
        )
    if read.spmd:
        spmd = result_spmd_dims(read.spmd_mesh, read.dp_mesh_dims, reshard_after_forward, fqn)
        return resolve_mesh(read.mesh), spmd
    if call_spmd is not None:
        # FSDP2 would take the parameter (a DTensor on the call's SPMD mesh) as tensor
        # parallel over a second copy of that mesh: nothing flexshard can mirror
        raise NotImplementedError(
            f"{where} without dp_mesh_dims in a call with dp_mesh_dims (a full SPMD mesh); "
            "build its mesh info from dp_mesh_dims too (torch's _get_mesh_info(mesh, dims))"
        )
    return resolve_mesh(read.mesh), None


def _build_marked(
    root: nn.Module,
    plan: Callable[[], list[_Plan]],
    groups: MeshGroups,
    timeout: datetime.timedelta,
    call: str,
) -> list[tuple[Bucket, list[nn.Module]]]:
    """Build the planned buckets, then mark the parameters they replaced, so flexshard's
    optimizers refuse them by name (a build that fails marks nothing)."""
    planned: list[_Plan] = []
    built = _agree_and_build(root, lambda: planned.extend(plan()) or planned, groups, timeout)
    for p in planned:
        mark_replaced(p.members, p.name, call)
    return built


def _common_prefix(modules: list[nn.Module], module: nn.Module) -> str:
    """Several modules share one bucket: name their parameters ``<i>.<fqn>``."""
    return "" if len(modules) == 1 else f"{modules.index(module)}."


def _root_of(modules: list[nn.Module]) -> nn.Module:
    """The modules of one ``fully_shard`` call as children ``0``, ``1``, ... of one
    container, so their parameters' FQNs resolve; a single module is its own root."""
    return (
        modules[0]
        if len(modules) == 1
        else nn.ModuleDict({str(i): m for i, m in enumerate(modules)})
    )


def share_comm_ctx(modules: list[nn.Module]) -> None:
    """FSDP2's ``share_comm_ctx``; flexshard's roots share their streams already."""
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise ValueError(f"Expects list of FSDPModules but got {module}")
