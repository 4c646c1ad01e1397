"""Every private name of torch that flexshard uses, in one place, behind a version gate.

This is the only flexshard module that reaches into torch's internals; every other
module imports them from here. Each item says what flexshard uses it for and which
public API would replace it if torch had one. ``tests/project/test_torch_internals.py`` holds one
test per item that fails when torch renames it or changes the behaviour relied on, so a
torch upgrade breaks there first, by name (docs/architecture.md, "torch internals").

The supported releases: torch :data:`TORCH_RANGE` (2.11 to 2.15), every feature on each,
proven by running the whole suite on each (``bash scripts/test.sh --torch X.Y.Z``). Where
the releases differ, the variant is chosen here by what torch has (a feature check), not
by its version string. On a torch outside the range importing this module warns once
(it does not raise: most items usually survive a release, and the test file says which
did not).

The boundary, what goes through here:

- private modules, functions, classes and attributes of torch (a leading underscore
  anywhere in the path: ``torch.distributed.tensor._dtensor_spec``, ``DTensor._spec``,
  ``DeviceMesh._concatenate``, ``ProcessGroup._get_backend``, ...);
- reading torch's closures and stack frames;
- process-global hooks and monkey patches of torch's modules.

What stays where it is, judged a de-facto public API:

- operator names: ``torch._foreach_*`` (the fused multi-tensor kernels torch.optim
  and ``clip_grad_norm_`` are built on, in torch's docs) and ``aten._foreach_norm`` /
  ``aten._to_copy`` (op overloads matched in ``__torch_dispatch__``; their schemas are
  versioned by native_functions.yaml, not by Python names);
- ``torch.Tensor._make_wrapper_subclass``, the documented way to build a wrapper
  tensor subclass (torch's subclass docs, every DTensor-like subclass);
- nn.Module's own state (``_parameters``, ``_forward_hooks``, ``_forward_pre_hooks``,
  ``_apply``) and ``Tensor._version``: stable for many releases, what ``nn.utils``
  parametrizations and torch's own composables read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import operator
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.autograd import Variable
from torch.autograd import profiler as _autograd_profiler
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as _torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate

__all__ = [
    "ALL_GATHER_SINGLE",
    "DOCS",
    "IGNORE_OPS",
    "STATE_KEY",
    "TORCH_RANGE",
    "DCPMemoryFormat",
    "DCPStorageInfo",
    "DTensorSpec",
    "DataParallelMeshDims",
    "FSDPMeshInfo",
    "FakeStore",
    "FOLLOWS_GRAD_DTYPE",
    "FakeTensorMode",
    "GradientReductionHandle",
    "HAS_PARAM_DTYPE_OVERRIDE",
    "HSDPMeshInfo",
    "MemRefType",
    "MemTracker",
    "ModState",
    "NormPartial",
    "PlacementMesh",
    "REDUCE_SCATTER_SINGLE",
    "ShardPlacementResult",
    "StridedShard",
    "TensorMeta",
    "TorchDispatchMode",
    "abort_cuda_backend",
    "all_gather_single",
    "apply_to_tensors",
    "backend_group_options",
    "clear_sharding_prop_cache",
    "compute_local_shape_and_global_offset",
    "concatenate_meshes",
    "consolidate_safetensors_files",
    "consolidate_safetensors_files_on_every_rank",
    "dcp_metadata_file",
    "disable_current_modes",
    "drop_cached_save_plans",
    "dtensor_spec",
    "dynamo_disable",
    "ensure_own_dispatch",
    "fsdp_param_group",
    "full_state_dict_call",
    "fully_shard_state_key",
    "functional_collective_ops",
    "functional_collectives_module",
    "get_num_bytes",
    "gloo_timeout",
    "grad_dtype_override",
    "grad_reduce_dtype",
    "hf_file_name",
    "in_autograd_backward",
    "layout_by_name",
    "local_tensor",
    "patch_full_state_dict_distribute",
    "placement_mesh",
    "post_accumulate_grad_hooks",
    "process_groups",
    "profiler_enabled",
    "queue_backward_callback",
    "reduce_scatter_single",
    "resolved_param_dtype",
    "register_global_optimizer_step_post_hook",
    "saved_metadata",
    "sequence_number",
    "set_local_tensor",
    "set_nested",
    "single_process_dcp",
    "storage_id",
    "tree_flatten",
    "tree_leaves",
    "tree_map",
    "tree_map_only",
    "set_versions",
    "set_grad_mode",
    "versions_of",
    "version_warning",
]

#: the first and the last torch release (major, minor) flexshard supports, both included
TORCH_RANGE: tuple[tuple[int, int], tuple[int, int]] = ((2, 11), (2, 15))
DOCS = "docs/architecture.md (torch internals)"


def version_warning(version: str) -> str | None:
    """The warning for torch ``version`` (None: inside :data:`TORCH_RANGE`)."""
    try:
        major, minor = (int(part) for part in version.split("+")[0].split(".")[:2])
    except ValueError:
        return f"flexshard.torch_internals cannot read torch version {version!r}; see {DOCS}"
    (first, first_minor), (last, last_minor) = TORCH_RANGE
    if TORCH_RANGE[0] <= (major, minor) <= TORCH_RANGE[1]:
        return None
    return (
        f"flexshard supports torch {first}.{first_minor} to {last}.{last_minor}, this is "
        f"torch {version}: the private torch names flexshard uses may have changed; run "
        f"tests/project/test_torch_internals.py and see {DOCS}"
    )


_WARNING = version_warning(torch.__version__)
if _WARNING is not None:  # once: a module body runs once per process
    warnings.warn(_WARNING, RuntimeWarning, stacklevel=2)


# ------------------------------------------------------------------ collectives
# One all-gather and one reduce-scatter of equal-sized pieces into (from) one tensor:
# named all_gather_single / reduce_scatter_single from torch 2.13 on, where the older
# all_gather_into_tensor / reduce_scatter_tensor became deprecated aliases of them; the
# same collective with the same arguments on every release. Public API either way.
# Looked up on torch.distributed at each call, as FSDP2 does, so whatever patches
# torch.distributed's function (torch's own FSDP2 test helpers, a user's profiler) sees
# flexshard's collectives too.
ALL_GATHER_SINGLE = (
    "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
)
REDUCE_SCATTER_SINGLE = (
    "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
)


def all_gather_single(*args: Any, **kwargs: Any) -> Any:
    return getattr(dist, ALL_GATHER_SINGLE)(*args, **kwargs)


def reduce_scatter_single(*args: Any, **kwargs: Any) -> Any:
    return getattr(dist, REDUCE_SCATTER_SINGLE)(*args, **kwargs)


# ------------------------------------------------------------------ FSDP2's API
# fully_shard(dp_mesh_dims=...) names the data-parallel dims of a full SPMD mesh; torch's
# FSDP2 has it from 2.13 on. Before that flexshard's fully_shard still takes it (its own
# implementation, dp_mesh_dims.py), with this class of the same fields and checks.
try:
    from torch.distributed.fsdp import DataParallelMeshDims
except ImportError:

    @dataclass
    class DataParallelMeshDims:  # type: ignore[no-redef]
        """The data-parallel dims of a full SPMD mesh, as torch.distributed.fsdp's
        (torch 2.13 and newer): ``shard`` and ``replicate``, a name or a tuple of names."""

        shard: str | tuple[str, ...] | None = None
        replicate: str | tuple[str, ...] | None = None

        def __post_init__(self) -> None:
            if self.shard is None and self.replicate is None:
                raise ValueError(
                    "At least one of shard or replicate must be set in DataParallelMeshDims"
                )

        @property
        def shard_names(self) -> tuple[str, ...]:
            return _names(self.shard)

        @property
        def replicate_names(self) -> tuple[str, ...]:
            return _names(self.replicate)

    def _names(value: str | tuple[str, ...] | None) -> tuple[str, ...]:
        if value is None:
            return ()
        return (value,) if isinstance(value, str) else tuple(value)


# What FSDPModule.finalize_backward(async_op=True) returns: torch's FSDP2 has the class
# from 2.15 on. Before that flexshard's FlexShardModule.finalize_backward still takes
# async_op, and its handle derives from this class of the same ``wait()``.
try:
    from torch.distributed.fsdp import GradientReductionHandle
except ImportError:

    class GradientReductionHandle:  # type: ignore[no-redef]
        """A handle for asynchronous backward finalization, as torch.distributed.fsdp's
        (torch 2.15 and newer): ``wait()`` lands the gradient reductions."""

        def wait(self) -> None:
            return


# What an FSDP2 ``shard_placement_fn`` may return to put a parameter on a mesh of its
# own, ``ShardPlacementResult(placement, mesh_info)`` (torch 2.13 on; torchtitan's expert
# parallelism), and the mesh-info classes that say which mesh dim shards and which
# replicates (HSDP). None before 2.13, where no shard_placement_fn can return one.
# Public replacement: none (torchtitan imports them from the same private module).
try:
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        FSDPMeshInfo,
        HSDPMeshInfo,
        ShardPlacementResult,
    )
except ImportError:
    FSDPMeshInfo = HSDPMeshInfo = ShardPlacementResult = None  # type: ignore[assignment,misc]


@dataclass(frozen=True)
class PlacementMesh:
    """A ``ShardPlacementResult`` as flexshard reads it: the placement (None: Shard(0))
    and the mesh the parameter is sharded on; ``kind`` names the mesh-info class,
    ``hsdp`` whether it replicates over a second dim, ``spmd`` whether it came from
    ``dp_mesh_dims`` (then ``mesh`` is the dp sub-mesh of ``spmd_mesh``, the full SPMD
    mesh its parameters are DTensors on, and ``dp_mesh_dims`` names the dp dims),
    ``info`` the object itself (FSDP2 groups parameters by it)."""

    placement: Any
    mesh: DeviceMesh
    kind: str
    known: bool  # exactly FSDPMeshInfo or HSDPMeshInfo (a subclass may change them)
    hsdp: bool
    shard_dim: int | None
    replicate_dim: int | None
    spmd: bool
    info: Any
    spmd_mesh: DeviceMesh | None = None
    dp_mesh_dims: Any = None


def placement_mesh(result: object) -> PlacementMesh | None:
    """``result`` of a ``shard_placement_fn`` read as a :class:`PlacementMesh` when it is
    FSDP2's ``ShardPlacementResult``; None for anything else (a plain placement)."""
    if ShardPlacementResult is None or not isinstance(result, ShardPlacementResult):
        return None
    info = result.mesh_info
    return PlacementMesh(
        result.placement,
        info.mesh,
        type(info).__name__,
        type(info) in (FSDPMeshInfo, HSDPMeshInfo),
        type(info) is HSDPMeshInfo,
        getattr(info, "shard_mesh_dim", None),
        getattr(info, "replicate_mesh_dim", None),
        bool(getattr(info, "is_spmd_mesh", False)),
        info,
        getattr(info, "spmd_mesh", None),
        getattr(info, "dp_mesh_dims", None),
    )


# ------------------------------------------------------------------ DTensor
# A DTensor's metadata, built by hand for parameters and gradients flexshard makes
# without a collective (DTensor(local, spec) skips from_local's checks and autograd).
# Public replacement: none (DTensor.from_local builds one, at a cost and with checks).
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta  # noqa: E402

# the pending placement of a norm's partial result (RegionDTensor's norms reduce
# as torch's own do). Public replacement: none.
from torch.distributed.tensor._ops._math_ops import _NormPartial as NormPartial  # noqa: E402

# this rank's piece of a placed tensor (shape and offset) for box placements.
# Public replacement: none (DTensor.__create_chunk_list__ covers a whole DTensor only).
from torch.distributed.tensor._utils import (  # noqa: E402
    compute_local_shape_and_global_offset,
)

# dp Shard(d) over tp Shard(d): the placement FSDP2 itself gives such a parameter.
# Public replacement: none.
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard  # noqa: E402

# every aten op as it dispatches: the planner's op counter and live-bytes timeline, and
# a DTensor subclass's ops where torch skips its own dispatch (ensure_own_dispatch).
# Public replacement: none (``__torch_dispatch__`` modes are documented; their base
# class lives in a private module).
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402


class _SubclassDispatch(TorchDispatchMode):
    """Hands the aten ops on instances of ``cls`` to ``cls.__torch_dispatch__``."""

    def __init__(self, cls: type[DTensor]) -> None:
        super().__init__()
        self.cls = cls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if any(issubclass(t, self.cls) for t in types):
            return self.cls.__torch_dispatch__(func, types, args, kwargs or {})
        return func(*args, **(kwargs or {}))


def _dispatch_through_mode(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
    with torch._C.DisableTorchFunctionSubclass(), _SubclassDispatch(cls):
        return func(*args, **(kwargs or {}))


#: DTensor subclasses checked by ensure_own_dispatch
_OWN_DISPATCH: set[type] = set()


def ensure_own_dispatch(cls: type[DTensor], spec: DTensorSpec) -> None:
    """Make sure ``cls.__torch_dispatch__`` sees the aten ops on instances of ``cls``.

    torch 2.11's C++ DTensor fast path takes any DTensor subclass for a plain DTensor and
    never calls the subclass's own ``__torch_dispatch__`` (pytorch#177716, fixed in 2.12).
    Checked once per class, by behaviour, on a replicated probe of ``spec``'s mesh (no
    collective); where it is skipped, ``cls`` gets a ``__torch_function__`` that runs each
    torch call on its instances under a dispatch mode handing their ops to
    ``cls.__torch_dispatch__``. That covers every op called from Python (optimizers,
    ``clip_grad_norm_``, ``nn.Parameter``); flexshard calls none from C++ on them.
    Public replacement: none (the fast path has no switch)."""
    if cls in _OWN_DISPATCH:
        return

    class Reached(Exception):
        pass

    class Probe(DTensor):
        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
            raise Reached

    local = torch.zeros(1, device=spec.mesh.device_type)
    replicated = DTensorSpec(
        spec.mesh,
        tuple(Replicate() for _ in spec.placements),
        tensor_meta=TensorMeta(local.shape, local.stride(), local.dtype),
    )
    try:
        torch.ops.aten.clone.default(Probe(local, replicated, requires_grad=False))
    except Reached:
        pass
    else:  # the fast path ran the op itself
        cls.__torch_function__ = classmethod(_dispatch_through_mode)  # type: ignore[assignment]
    _OWN_DISPATCH.add(cls)


def local_tensor(tensor: DTensor) -> torch.Tensor:
    """The local shard of ``tensor`` itself (``to_local()`` adds an autograd node and,
    under compile, a copy). Public replacement: ``DTensor.to_local()`` without those."""
    return tensor._local_tensor


def set_local_tensor(tensor: DTensor, local: torch.Tensor) -> None:
    """Point a sharded parameter at a view of its bucket's storage, in place (FSDP2 does
    the same). Public replacement: none."""
    tensor._local_tensor = local  # type: ignore[misc]


def dtensor_spec(tensor: DTensor) -> DTensorSpec:
    """Mesh, placements and global shape in one object. Public replacement:
    ``tensor.device_mesh`` / ``.placements`` / ``.shape`` one by one."""
    return tensor._spec


def clear_sharding_prop_cache() -> None:
    """Forget DTensor's cached sharding decisions (they hold the groups of a torn-down
    mesh); a no-op on a torch without it. Public replacement: none."""
    try:
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    except ImportError:
        return
    _clear_sharding_prop_cache()


# ------------------------------------------------------------------ DeviceMesh
def concatenate_meshes(meshes: Sequence[DeviceMesh]) -> DeviceMesh:
    """One mesh of the dims of ``meshes``, all cut from one root mesh (dp + tp; the
    (replicate, shard) mesh of ``dp_mesh_dims``). Public replacement: slicing the root
    mesh by several names (``root["dp", "tp"]``) when the caller holds the root."""
    return DeviceMesh._concatenate(list(meshes))


# ------------------------------------------------------------------ FSDP2 / composable
# the key under which composable APIs keep their per-module state in module.__dict__
# (torch.distributed.pipelining finds FSDP2's state there). Public replacement: none.
from torch.distributed._composable.contract import STATE_KEY  # noqa: E402

# FSDP2's walk of a forward's args and outputs (dataclasses, namedtuples included), so
# forward casts reach what FSDP2's reach. Public replacement: torch.utils pytree maps,
# which skip dataclasses.
from torch.distributed.utils import _apply_to_tensors as apply_to_tensors  # noqa: E402


def fully_shard_state_key() -> Any:
    """The key ``fully_shard.state(module)`` reads under ``module.__dict__[STATE_KEY]``:
    ``contract`` keeps it in the closure of ``fully_shard.state``. flexshard registers
    its own state there so torch.distributed.pipelining accepts a flexshard module.
    Public replacement: a registration API for composable state."""
    return _torch_fully_shard.state.__closure__[0].cell_contents  # type: ignore[union-attr]


def _reduces_in_param_dtype() -> bool:
    """Whether FSDP2 reduces gradients in the parameters' own dtype when
    ``reduce_dtype`` is unset: from torch 2.15 a parameter group promotes over the
    gradients' accumulation dtypes (``_get_reduce_dtype``), and the reduce-scatter
    copy-in upcasts the ``param_dtype`` gradients; before, it reduced in the dtype the
    gradients come in, ``param_dtype``."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    return hasattr(FSDPParamGroup, "_get_reduce_dtype")


def _reduce_in_param_dtype(policy: MixedPrecisionPolicy, widest: torch.dtype) -> torch.dtype:
    return policy.reduce_dtype or widest


def _reduce_in_compute_dtype(policy: MixedPrecisionPolicy, widest: torch.dtype) -> torch.dtype:
    return policy.reduce_dtype or policy.param_dtype or widest


#: the dtype FSDP2 reduces a parameter group's gradients in, for its mixed-precision
#: ``policy`` and ``widest``, the widest dtype of its trainable parameters. Chosen here
#: once, as this release's FSDP2 decides it (``_reduces_in_param_dtype``). Public
#: replacement: none (MixedPrecisionPolicy documents only a set ``reduce_dtype``).
grad_reduce_dtype: Callable[[MixedPrecisionPolicy, torch.dtype], torch.dtype] = (
    _reduce_in_param_dtype if _reduces_in_param_dtype() else _reduce_in_compute_dtype
)


def _follows_grad_dtype() -> bool:
    """Whether FSDP2 keeps a parameter's unsharded gradients in its gradient dtype
    (``Tensor.grad_dtype``: the original dtype unless set on the parameter; the policy's
    ``reduce_dtype`` when set) rather than the compute dtype: from torch 2.15
    (``FSDPParam.unsharded_grad_dtype``) it accumulates no-sync gradients in it, leaves a
    backward's gradient in autograd's own dtype until it accumulates, and casts the
    reduced shard to the sharded gradient dtype; before, gradients followed
    ``param_dtype``."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    return hasattr(FSDPParam, "unsharded_grad_dtype")


#: this release's FSDP2 follows the parameters' ``grad_dtype`` (``_follows_grad_dtype``).
#: Public replacement: none (MixedPrecisionPolicy documents the behaviour, not a flag).
FOLLOWS_GRAD_DTYPE: bool = _follows_grad_dtype()


def grad_dtype_override(param: torch.Tensor) -> tuple[bool, torch.dtype | None]:
    """``(True, dtype)`` when ``param.grad_dtype`` was set on the parameter (``None``
    included: any dtype), else ``(False, None)``. Public replacement: none
    (``Tensor.grad_dtype`` reads the default too)."""
    if getattr(param, "_has_grad_dtype_override", False):
        return True, param.grad_dtype
    return False, None


#: MixedPrecisionPolicy takes ``param_dtype_override_fn`` (torch 2.15): a public field
HAS_PARAM_DTYPE_OVERRIDE: bool = any(
    f.name == "param_dtype_override_fn" for f in dataclasses.fields(MixedPrecisionPolicy)
)


def resolved_param_dtype(policy: MixedPrecisionPolicy, param: torch.Tensor) -> torch.dtype | None:
    """The ``param_dtype`` FSDP2 gives ``param`` under ``policy``: its
    ``param_dtype_override_fn``'s answer where it has one, checked (and refused with a
    ``ValueError``) by FSDP2's own rule. Public replacement: none (FSDP2 resolves it in
    ``MixedPrecisionPolicy._resolve_for_param``)."""
    if getattr(policy, "param_dtype_override_fn", None) is None:
        return policy.param_dtype
    return policy._resolve_for_param(param).param_dtype  # type: ignore[attr-defined]


# ------------------------------------------------------------------ autograd
# refilling a gathered buffer that autograd saved must not look like an in-place
# change (FSDP2 does the same, with torch.autograd._unsafe_preserve_version_counter,
# whose context manager costs four Python calls a gather): ``set_versions(tensors,
# versions_of(tensors))`` undoes the bumps made in between. Public replacement: none.
set_versions = torch._C._autograd._unsafe_set_version_counter
#: grad mode on or off without ``torch.no_grad``'s Python frames (a bucket switches it
#: around every gather). Public replacement: ``torch.set_grad_enabled``.
set_grad_mode = torch._C._set_grad_enabled


_VERSION = operator.attrgetter("_version")


def versions_of(tensors: tuple[torch.Tensor, ...]) -> tuple[int, ...]:
    """The version counters ``set_versions`` restores (a loop in C: read per gather)."""
    return tuple(map(_VERSION, tensors))


def profiler_enabled() -> bool:
    """Whether a profiler records now: a span is made only then (it costs more than a
    small bucket's copy). Public replacement: none (``torch.profiler`` has no query)."""
    return _autograd_profiler._is_profiler_enabled


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the current backward pass ends (FSDP2's end-of-backward
    hook). Public replacement: none."""
    Variable._execution_engine.queue_callback(callback)


def in_autograd_backward() -> bool:
    """Whether an autograd backward is running on this thread (FSDP2 refuses to change
    the backward finalization mode then, even before its own hooks ran). Public
    replacement: none."""
    return torch._C._current_graph_task_id() != -1


def post_accumulate_grad_hooks(tensor: torch.Tensor) -> dict[int, Callable] | None:
    """The hooks ``register_post_accumulate_grad_hook`` added to ``tensor``, run by hand
    after flexshard accumulates a gradient outside autograd. Public replacement: none."""
    return getattr(tensor, "_post_accumulate_grad_hooks", None)


def dynamo_disable(fn: Callable, reason: str) -> Callable:
    """``fn`` kept out of dynamo, recursively. Imported at call time: torch._dynamo is
    heavy, and fully_shard has loaded it by the time hooks are installed. Public
    replacement: ``torch.compiler.disable`` (which forwards here, without ``reason``)."""
    import torch._dynamo

    return torch._dynamo.disable(fn, recursive=True, reason=reason)


def storage_id(tensor: torch.Tensor) -> int:
    """Which storage ``tensor`` views, stable while the storage is resized (its
    data_ptr is not). Public replacement: none."""
    return tensor.untyped_storage()._cdata


# leave the active dispatch modes (fake, activation checkpoint) for the unshard an
# activation-checkpoint recompute needs. Public replacement: none.
from torch.utils._python_dispatch import _disable_current_modes as disable_current_modes  # noqa: E402

# pytree walks of a module's forward args and outputs (and of a dispatched op's, in the
# planner's op counter). Public replacement: torch.utils.pytree (not in 2.13's public
# namespace yet).
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_map_only  # noqa: E402


def functional_collective_ops() -> Any:
    """The ``torch.ops._c10d_functional`` namespace (DTensor's collectives, saved by the
    activation-checkpoint policy). Public replacement: none."""
    return torch.ops._c10d_functional


# ------------------------------------------------------------------ optimizer
# counts optimizer steps process-wide, so a quantized bucket knows its payload is
# stale after any step. Process-global: it sees every optimizer of the process.
# Public replacement: per-optimizer ``register_step_post_hook`` on every optimizer.
from torch.optim.optimizer import (  # noqa: E402
    register_optimizer_step_post_hook as register_global_optimizer_step_post_hook,
)

#: torch's module and functions that call ``optimizer.state_dict()``
_TORCH_STATE_DICT = "torch.distributed.checkpoint.state_dict"
_GET, _LOAD = "_get_optim_state_dict", "_load_optim_state_dict"


def full_state_dict_call() -> Literal["get", "load"] | None:
    """``"get"`` inside ``get_optimizer_state_dict(full_state_dict=True)``, ``"load"``
    inside ``set_optimizer_state_dict(full_state_dict=True)``, else None: read from the
    stack (torch's function names and its ``info`` local), as torch gives an optimizer
    no other sign. Public replacement: an argument or context torch passes."""
    frame = sys._getframe(1)
    getter = None
    while frame is not None:
        if frame.f_globals.get("__name__") == _TORCH_STATE_DICT:
            if frame.f_code.co_name == _LOAD:  # its only call of state_dict(): the full path
                return "load"
            if frame.f_code.co_name == _GET and getter is None:
                getter = frame
        frame = frame.f_back
    if getter is not None and getattr(getter.f_locals.get("info"), "full_state_dict", False):
        return "get"
    return None


# ------------------------------------------------------------------ state dict / DCP
def patch_full_state_dict_distribute(
    before: Callable[[dict[str, Any], list[str]], None], distribute_tensor: Callable
) -> None:
    """Teach torch's full state-dict load (``_state_dict_utils._distribute_tensors``
    and its ``distribute_tensor``) flexshard's placements: ``before`` handles the
    entries it owns, then torch's code runs. Process-wide, in that module only;
    idempotent. Public replacement: a placement hook in ``distribute_tensor``."""
    from torch.distributed import _state_dict_utils as utils

    if getattr(utils, "_flexshard_regions", False):
        return
    torch_distribute_tensors = utils._distribute_tensors

    def distribute_tensors(local_state_dict, keys, device, pg=None):  # torch's signature
        before(local_state_dict, keys)
        return torch_distribute_tensors(local_state_dict, keys, device, pg)

    utils._distribute_tensors = distribute_tensors
    utils.distribute_tensor = distribute_tensor
    utils._flexshard_regions = True  # type: ignore[attr-defined]


def saved_metadata(returned: Any, read: Callable[[], Any]) -> Any:
    """The metadata of the checkpoint ``dcp.save`` just wrote, with every chunk's
    storage: what it returned where that has it (every rank from torch 2.13 on), else
    ``read()`` of the ``.metadata`` file (on 2.11 only the coordinator's copy has
    ``storage_data``; the file is complete once dcp.save returns on any rank). Public
    replacement: none needed from 2.13 on."""
    return returned if returned.storage_data is not None else read()


@contextlib.contextmanager
def single_process_dcp(no_dist: bool) -> Iterator[None]:
    """Around a ``dcp.save`` / ``dcp.load`` given ``no_dist``: without a process group
    torch 2.11 to 2.15 warn on every call, even one passing ``no_dist=True``, that they
    assume one process. The caller said so: that one warning is dropped, here only."""
    with warnings.catch_warnings():
        if no_dist:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


# DCP's .metadata pickle names private classes and a helper (torch 2.11 to 2.15 write
# the same names): :data:`_LAZY`'s ``DCPStorageInfo``, ``DCPMemoryFormat``, ``set_nested``.
from torch.serialization import _get_layout as layout_by_name  # noqa: E402


def dcp_metadata_file(reader: Any, rank: int | None) -> Any:
    """The ``.metadata`` file (``__<rank>.metadata`` with ``rank``) a FileSystemReader
    reads. Public replacement: none."""
    return reader._get_metadata_path(rank)


def drop_cached_save_plans(key: str) -> None:
    """Free the plans ``DefaultSavePlanner(enable_plan_caching=True)`` keeps per key in
    class-level dicts (they outlive the saver otherwise). Public replacement: none."""
    from torch.distributed.checkpoint.planner import SavePlanner

    for cache in (
        SavePlanner._cached_save_plan,
        SavePlanner._cached_all_plans,
        SavePlanner._cached_global_plan,
        SavePlanner._cached_metadata,
        SavePlanner._cached_final_save_plan,
    ):
        cache.pop(key, None)


# ------------------------------------------------------------------ process groups
def abort_cuda_backend(group: dist.ProcessGroup) -> None:
    """Abort ``group``'s NCCL backend (after a timeout). Public replacement:
    ``dist.abort_process_group`` aborts every backend of the group."""
    group._get_backend(torch.device("cuda")).abort()  # type: ignore[attr-defined]


def default_store() -> dist.Store:
    """The store the default process group was made with (the job's rendezvous).
    Public replacement: none."""
    return dist.distributed_c10d._get_default_store()


def gloo_timeout(group: dist.ProcessGroup) -> Any:
    """A gloo group's own timeout (a ``timedelta``), for messages. Raises
    AttributeError/RuntimeError when the group has no gloo backend. Public replacement:
    none (``dist.distributed_c10d._get_pg_default_device`` et al. say nothing of it)."""
    return group._get_backend(torch.device("cpu")).options._timeout  # type: ignore[attr-defined]


def backend_group_options(backend: str, timeout: Any) -> Any:
    """Options of a new ``backend`` group ("gloo" or "nccl") whose collectives time
    out after ``timeout`` (a ``timedelta``); None for another backend. Public
    replacement: ``timeout=`` of ``new_group`` (per call, not as options)."""
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    elif backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()  # type: ignore[attr-defined]
    else:
        return None
    options._timeout = timeout
    return options


# ------------------------------------------------------------------ planner (flexshard.plan)
# a rank's model and its steps on shapes alone, without storage (the planner at
# thousands of ranks from one CPU). Public replacement: none.
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

if TYPE_CHECKING:  # the names of _LAZY, for type checkers
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed._tools.mem_tracker import _MemRefType as MemRefType
    from torch.distributed._tools.mem_tracker import _ModState as ModState
    from torch.distributed.checkpoint._consolidate_hf_safetensors import (
        consolidate_safetensors_files,
        consolidate_safetensors_files_on_every_rank,
    )
    from torch.distributed.checkpoint._hf_utils import _gen_file_name as hf_file_name
    from torch.distributed.checkpoint._traverse import set_element as set_nested
    from torch.distributed.checkpoint.filesystem import _StorageInfo as DCPStorageInfo
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING as DCPMemoryFormat
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.utils._runtime_estimation import _IGNORE_OPS as IGNORE_OPS
    from torch.utils._runtime_estimation import get_num_bytes

#: items whose torch modules take seconds to import (every ``import flexshard`` would
#: pay), loaded when first read (``__getattr__`` below): name -> (module, torch's name)
_LAZY: dict[str, tuple[str, str]] = {
    # Hugging Face safetensors: merging the per-rank shards into model files, and torch's
    # file-name scheme for them. Lazy: torch.distributed.checkpoint is no part of
    # sharding a model. Public replacement: none (torch's writer's consolidation runs on
    # rank 0 only, with no per-rank variant).
    "consolidate_safetensors_files": (
        "torch.distributed.checkpoint._consolidate_hf_safetensors",
        "consolidate_safetensors_files",
    ),
    "consolidate_safetensors_files_on_every_rank": (
        "torch.distributed.checkpoint._consolidate_hf_safetensors",
        "consolidate_safetensors_files_on_every_rank",
    ),
    "hf_file_name": ("torch.distributed.checkpoint._hf_utils", "_gen_file_name"),
    # DCP's .metadata pickle names these private classes (torch 2.11 to 2.15 write the
    # same names), and DefaultLoadPlanner.load_bytes places a non-tensor value it read in
    # the nested state dict with set_element: a safe reader allows exactly those names
    # and places values as torch does. Public replacement: none (DCP reads the file with
    # pickle.load and the values with torch.load(weights_only=False)).
    "set_nested": ("torch.distributed.checkpoint._traverse", "set_element"),
    "DCPStorageInfo": ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    "DCPMemoryFormat": ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    # W ranks in one process: the store of the ``fake`` process-group backend (every
    # collective a no-op; importing its module registers the backend). Lazy, as torch's
    # test utilities are no part of ``import flexshard``.
    # Public replacement: none (it comes with torch's test utilities).
    "FakeStore": ("torch.testing._internal.distributed.fake_pg", "FakeStore"),
    # the bytes a model's forward saves for backward and backward's temporaries, by
    # module state and reference type (the planner's activations).
    # Public replacement: none (torch.cuda.memory's snapshots need a GPU and storage).
    "MemTracker": ("torch.distributed._tools.mem_tracker", "MemTracker"),
    "MemRefType": ("torch.distributed._tools.mem_tracker", "_MemRefType"),
    "ModState": ("torch.distributed._tools.mem_tracker", "_ModState"),
    # the bytes an op reads or writes, and the ops that move none (views, creations),
    # as torch's RuntimeEstimator counts them (the planner's non-GEMM bytes).
    # Public replacement: none.
    "IGNORE_OPS": ("torch.utils._runtime_estimation", "_IGNORE_OPS"),
    "get_num_bytes": ("torch.utils._runtime_estimation", "get_num_bytes"),
}


def __getattr__(name: str) -> Any:
    """An item of :data:`_LAZY`, imported on first use (PEP 562)."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, torch_name = _LAZY[name]
    value = getattr(importlib.import_module(module), torch_name)
    globals()[name] = value  # read once: later reads find it here
    return value


# ------------------------------------------------------------------ testing
def fsdp_param_group(module: torch.nn.Module) -> Any | None:
    """The parameter group FSDP2's ``fully_shard`` made for ``module`` (its
    ``fsdp_params``: what one all-gather moves), None for a module without one (the
    calibration counts parameters per all-gather). Public replacement: none."""
    state = getattr(module, "_get_fsdp_state", None)
    return state()._fsdp_param_group if state is not None else None


def process_groups() -> list[dist.ProcessGroup]:
    """Every process group of this process. Public replacement: none."""
    return list(c10d._world.pg_map)


def sequence_number(group: dist.ProcessGroup) -> int:
    """How many collectives ``group`` has issued. Public replacement: none."""
    return group._get_sequence_number_for_group()


def functional_collectives_module() -> Any:
    """``torch.distributed._functional_collectives``, what DTensor's redistribution
    calls (the collective log wraps its functions). Public replacement: none."""
    import torch.distributed._functional_collectives as funcol

    return funcol
