"""The public entry points: ``flex_shard`` (buckets by pattern) and ``fully_shard``
(FSDP2's signature, one bucket per call)."""

from __future__ import annotations

import datetime
import fnmatch
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

from .placements import BlockShard, BucketLayout, Placement, Shard, plan_bucket
from .quant import QuantFormat
from .runtime.bucket import Bucket, BucketParam
from .runtime.collectives import DEFAULT_TIMEOUT, BucketComm, check_timeout
from .runtime.consistency import check_same_plan
from .runtime.groups import MeshGroups, resolve_mesh
from .runtime.hooks import StepState, install_bucket_hooks, install_root_hooks
from .runtime.module import FlexShardModule, make_flexshard_class
from .runtime.tp_params import check_tp_param, local_of, spec_of
from .state_dict_hooks import install_state_dict_hooks
from .validation import check_bucket_spec, check_module, check_options

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

    def __post_init__(self) -> None:
        check_bucket_spec(self)

    @property
    def pattern_list(self) -> list[str]:
        return [self.patterns] if isinstance(self.patterns, str) else list(self.patterns)


def _parameter_locations(module: nn.Module) -> dict[int, list[str]]:
    """Every FQN under which each not-yet-sharded parameter is reachable (ties share one)."""
    locations: dict[int, list[str]] = {}
    for fqn, param in module.named_parameters(remove_duplicate=False):
        if getattr(param, "_flexshard_slot", None) is None:
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
    for plan in plans:
        params = [
            BucketParam(
                fqns[0],
                param.requires_grad,
                [_owner(root, f) for f in fqns],
                spec_of(param),
                placement,
            )
            for (param, fqns), placement in zip(plan.members, plan.placements)
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
        built.append((bucket, plan.hook_modules))
    return built


def _on_device(param: nn.Parameter, device: torch.device) -> torch.Tensor:
    param = local_of(param)  # a TP DTensor: its local piece is what flexshard shards
    if param.device.type in ("meta", device.type):
        return param.detach()
    return param.detach().to(device)


def flex_shard(
    module: nn.Module,
    mesh: DeviceMesh | None = None,
    buckets: Sequence[BucketSpec] = (),
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool | None = None,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
) -> FlexShardModule:
    """Shard ``module``'s parameters into ``buckets``; apply once, at the root.

    Every parameter must match exactly one bucket. Tensor-parallel DTensor parameters
    (from ``parallelize_module``, applied first) are sharded by their local tensor:
    the optimizer sees plain local shards, the modules get DTensors on the tp mesh
    back after unshard. Every check runs before any bucket collective; the ranks then
    agree in one small all-gather, so a bad or differing spec on any rank raises on
    every rank instead of hanging the others.
    """
    check_module("flex_shard", module)
    if isinstance(buckets, (str, BucketSpec)) or not all(
        isinstance(b, BucketSpec) for b in buckets
    ):
        raise TypeError(f"flex_shard: buckets must be a list of BucketSpec, got {buckets!r}")
    check_options("flex_shard", mp_policy, reshard_after_forward, allow_none_policy=True)
    check_timeout(timeout)
    groups = resolve_mesh(mesh)
    plan = functools.partial(
        _plan_flex, module, buckets, groups.shard_size, mp_policy, reshard_after_forward
    )
    built = _agree_and_build(module, plan, groups, timeout)
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
    world_size: int,
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
        # successive buckets start LPT ties on successive ranks, spreading Owned params
        policy = spec.mp_policy or mp_policy or MixedPrecisionPolicy()
        layout = _plan(
            names[b], members, placements, world_size, b % world_size, policy, spec.pack_as_bytes
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
            )
        )
    return plans


def _reshard_option(value: object, shard_size: int) -> bool | None:
    """FSDP2's int ``reshard_after_forward`` (reshard to a smaller group) keeps the
    parameters gathered here: the same numerics, no backward all-gather, more memory."""
    if isinstance(value, bool) or value is None:
        return value
    if not isinstance(value, int):
        raise TypeError(
            f"fully_shard: reshard_after_forward must be a bool, an int or None, got {value!r}"
        )
    if 1 <= value <= shard_size and shard_size % value == 0:
        return value == 1
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
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
) -> FlexShardModule:
    """torch FSDP2's ``fully_shard``: one bucket of the parameters of ``module`` (or of
    a list of modules, gathered together by whichever runs first) that no earlier call
    took. ``shard_placement_fn`` may return torch's ``Shard(dim)`` or any flexshard
    placement."""
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
    groups = resolve_mesh(mesh)
    _offload_option(offload_policy, groups.device)
    reshard = _reshard_option(reshard_after_forward, groups.shard_size)
    ignored = {id(p) for p in ignored_params or ()}

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
                if pid not in ignored and pid not in locations:
                    locations[pid] = [prefix + f for f in fqns]
            param_of.update({id(p): p for p in m.parameters()})
        if not locations:
            return []
        name = type(modules[0]).__name__
        members = [(param_of[pid], fqns) for pid, fqns in locations.items()]
        placement = (lambda f, p: shard_placement_fn(p)) if shard_placement_fn else Shard(0)
        placements = [_resolve_placement(placement, fqns[0], p, name) for p, fqns in members]
        layout = _plan(name, members, placements, groups.shard_size, 0, mp_policy)
        return [_Plan(name, members, placements, layout, modules, mp_policy, reshard)]

    built = _agree_and_build(_root_of(modules), plan, groups, timeout)
    for m in modules:
        make_flexshard_class(m)
        install_state_dict_hooks(m)
        m._flexshard_buckets = [b for b, _ in built]
        m._flexshard_state = None
        install_root_hooks(m)
    for bucket, hook_modules in built:
        install_bucket_hooks(bucket, hook_modules)
    return module  # type: ignore[return-value]


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
