"""The public entry points: ``flex_shard`` (buckets by pattern) and ``fully_shard``
(FSDP2's signature, one bucket per call).

``share_comm_ctx``: torch 2.13's FSDP2 lets several roots (pipeline stages' model
chunks) share one set of CUDA streams, so their buffers do not fragment memory across
streams. flexshard always shares them: every bucket of a process on one CUDA device
uses the same all-gather and reduce-scatter streams (``runtime/device.py``), and CPU
runs have none. The call checks its argument as FSDP2's does and has nothing to do."""

from __future__ import annotations

import datetime
import fnmatch
import functools
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
)

from ..runtime.collectives import DEFAULT_TIMEOUT, MeshGroups, check_timeout, resolve_mesh
from ..runtime.dtensor.tensor_parallel import SpmdDims
from ..runtime.hooks import (
    StepState,
    install_bucket_hooks,
    install_forward_casts,
    install_root_hooks,
)
from ..runtime.module import FlexShardModule, make_flexshard_class
from ..torch_internals import DataParallelMeshDims, PlacementMesh, placement_mesh
from .arguments import BucketSpec, check_module, check_options
from .build import (
    BucketPlan,
    bucket_layout,
    build_buckets,
    check_quant,
    modules_to_hook,
    parameter_locations,
    resolve_placement,
)
from .dp_mesh_dims import check_spmd_param, dp_mesh, result_spmd_dims
from .state_dict import install_state_dict_hooks

__all__ = ["flex_shard", "fully_shard", "share_comm_ctx"]


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
    built = build_buckets(module, plan, groups, timeout, "flex_shard")
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
) -> list[BucketPlan]:
    if any(isinstance(m, FlexShardModule) for m in module.modules()):
        raise ValueError(f"{type(module).__name__} is already sharded by flexshard; wrap it once")
    if not buckets:
        raise ValueError("flex_shard needs at least one BucketSpec")
    locations = parameter_locations(module)
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
            resolve_placement(spec.placement, fqns[0], p, names[b]) for p, fqns in members
        ]
        # a bucket on its own mesh (the ranks agree on the plan over flex_shard's mesh)
        groups = resolve_mesh(spec.mesh) if spec.mesh is not None else call_groups
        world_size = groups.shard_size
        # successive buckets start LPT ties on successive ranks, spreading Owned params
        policy = spec.mp_policy or mp_policy or MixedPrecisionPolicy()
        layout = bucket_layout(
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
            check_quant(names[b], members, placements, spec.quant)
        plans.append(
            BucketPlan(
                names[b],
                members,
                placements,
                layout,
                modules_to_hook(module, [f for _, fqns in members for f in fqns]),
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

    def plan() -> list[BucketPlan]:
        locations: dict[int, list[str]] = {}
        param_of: dict[int, nn.Parameter] = {}
        for m in modules:
            if isinstance(m, FlexShardModule):
                raise ValueError(
                    f"{type(m).__name__} is already sharded by flexshard; wrap it once"
                )
            prefix = _common_prefix(modules, m)
            for pid, fqns in parameter_locations(m).items():
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
                resolve_placement(c, fqns[0], p, name) for (p, fqns), c in zip(group, chosen)
            ]
            # frozen parameters of other dtypes (fp8 or fp64 weights beside trainable ones,
            # as FSDP2 takes them) travel packed as bytes, each in its own dtype; trainable
            # ones of several dtypes are refused (by bucket_layout), as FSDP2 refuses them
            trained = {p.dtype for p, _ in group if p.requires_grad}
            packed = len({p.dtype for p, _ in group}) > 1 and len(trained) <= 1
            size = mesh_groups.shard_size
            layout = bucket_layout(name, group, placements, size, 0, mp_policy, packed)
            own = mesh_groups if mesh_groups is not groups else None
            group_reshard = reshard if own is None else _reshard_option(reshard_after_forward, size)
            plans.append(
                BucketPlan(
                    name, group, placements, layout, modules, mp_policy, group_reshard, groups=own
                )
            )
        return plans

    built = build_buckets(_root_of(modules), plan, groups, timeout, "fully_shard")
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
