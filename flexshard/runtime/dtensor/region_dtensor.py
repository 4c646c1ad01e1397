"""RegionDTensor: a DTensor with a RegionShard placement.

torch's sharding rules know only Shard, Replicate and Partial, so this subclass
answers for the others itself: elementwise ops (what optimizers run) apply to the
local tensors, since operands placed alike hold the same elements; p-norms become
Partial (every element lives on exactly one rank), so ``clip_grad_norm_`` gets the
global norm; ``redistribute``/``full_tensor`` gather; DCP sees each rank's regions as
chunks. Every other op raises, naming the parameter and its placement."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor import Replicate as TorchReplicate

from ...torch_internals import (
    DTensorSpec,
    NormPartial,
    TensorMeta,
    compute_local_shape_and_global_offset,
    dtensor_spec,
    ensure_own_dispatch,
    local_tensor,
)
from .chunks import region_tensor
from .region_shard import RegionShard

aten = torch.ops.aten

#: ops that read or write elements one for one, besides those tagged pointwise
_ELEMENTWISE = {
    aten.detach.default,
    aten.alias.default,
    aten.clone.default,
    aten.copy_.default,
    aten.zero_.default,
    aten.fill_.Scalar,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.empty_like.default,
    aten.full_like.default,
    aten._to_copy.default,
    aten.lift_fresh.default,
}
_NOT_ELEMENTWISE_FOREACH = {"_foreach_norm", "_foreach_max"}
_NORMS = {aten.linalg_vector_norm.default, aten._foreach_norm.Scalar}


#: op -> "foreach", "elementwise" or None (neither); optimizers call the same few ops
#: thousands of times per step, so each is classified once
_KINDS: dict[Any, str | None] = {}


def _kind(func: Any) -> str | None:
    if func not in _KINDS:
        name = func.overloadpacket.__name__
        if name.startswith("_foreach_"):
            kind = "foreach" if name not in _NOT_ELEMENTWISE_FOREACH else None
        else:
            elementwise = func in _ELEMENTWISE or torch.Tag.pointwise in func.tags
            kind = "elementwise" if elementwise else None
        _KINDS[func] = kind
    return _KINDS[func]


def _first_region(values: Any) -> RegionDTensor | None:
    """The first RegionDTensor among ``values`` (one level of lists, as ops take)."""
    for value in values:
        if isinstance(value, RegionDTensor):
            return value
        if isinstance(value, (list, tuple)):
            found = _first_region(value)
            if found is not None:
                return found
    return None


def _map(value: Any, fn: Any) -> Any:
    """``fn`` over the leaves of ``value``; cheaper than pytree for op arguments."""
    if isinstance(value, (list, tuple)):
        return type(value)(_map(v, fn) for v in value)
    return fn(value)


def _region_of(spec: DTensorSpec) -> RegionShard | None:
    for placement in spec.placements:  # a loop: every gradient landed asks
        if isinstance(placement, RegionShard):
            return placement
    return None


def _unsupported(func: Any, spec: DTensorSpec, why: str) -> NotImplementedError:
    region = _region_of(spec)
    return NotImplementedError(
        f"{func} on parameter '{region.layout.fqn}' (flexshard placement {region}): {why}; "
        "call .full_tensor() or .redistribute(placements=[Replicate()]) first"
    )


def wrap(local: torch.Tensor, spec: DTensorSpec, requires_grad: bool = False) -> DTensor:
    """``local`` as a DTensor of ``spec``'s mesh and placements, in ``local``'s dtype."""
    meta = spec.tensor_meta
    if meta is not None and meta.dtype != local.dtype:
        spec = DTensorSpec(
            spec.mesh, spec.placements, tensor_meta=TensorMeta(meta.shape, meta.stride, local.dtype)
        )
    if _region_of(spec) is None:
        return DTensor(local, spec, requires_grad=requires_grad)
    ensure_own_dispatch(RegionDTensor, spec)
    return RegionDTensor(local, spec, requires_grad=requires_grad)


class RegionDTensor(DTensor):
    """A DTensor whose placements include a RegionShard (see the module docstring)."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if func in _NORMS:
            return _norm(func, args, kwargs)
        kind = _kind(func)
        if kind == "foreach":
            return _foreach(func, args, kwargs)
        first = _first_region(args)
        if first is None:
            first = _first_region(kwargs.values())
        if kind is None:
            raise _unsupported(func, dtensor_spec(first), "not an elementwise op")
        return _elementwise(func, args, kwargs, dtensor_spec(first))

    # ---------------------------------------------------------------- redistribution
    def redistribute(  # type: ignore[override]
        self, device_mesh=None, placements=None, *, async_op: bool = False, **kwargs: Any
    ) -> DTensor:
        mesh = device_mesh or self.device_mesh
        if mesh != self.device_mesh:
            where = dtensor_spec(self).placements
            raise ValueError(f"{where}: cannot redistribute to another mesh")
        target = tuple(placements) if placements is not None else self.placements
        if target == tuple(self.placements):
            return self
        replicated = _ToReplicate.apply(self)
        return replicated.redistribute(mesh, target, async_op=async_op, **kwargs)

    def full_tensor(self, *, grad_placements=None) -> torch.Tensor:  # type: ignore[override]
        return self.redistribute(placements=[TorchReplicate()] * self.device_mesh.ndim).to_local()

    # ---------------------------------------------------------------- checkpoints
    def _chunks(self) -> Any:
        spec, region = dtensor_spec(self), _region_of(dtensor_spec(self))
        coordinate = spec.mesh.get_coordinate()
        dim = spec.placements.index(region)
        # where this rank's tensor-parallel piece sits in the whole tensor
        others = [TorchReplicate() if d == dim else p for d, p in enumerate(spec.placements)]
        _, offset = compute_local_shape_and_global_offset(spec.shape, spec.mesh, others)
        # a copy replicated over another mesh dim (HSDP, tp) is written by its first holder
        writer = all(
            c == 0 for d, c in enumerate(coordinate) if d != dim and others[d].is_replicate()
        )
        frame = (tuple(spec.shape), offset)
        local = local_tensor(self)
        return region_tensor(region.layout, coordinate[dim], local, writer, None, frame)

    def __create_write_items__(self, fqn: str, obj: Any) -> Any:
        return self._chunks().__create_write_items__(fqn, obj)

    def __create_chunk_list__(self) -> Any:
        return self._chunks().__create_chunk_list__()

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        return self._chunks().__get_tensor_shard__(index)


class _ToReplicate(torch.autograd.Function):
    """RegionShard -> Replicate on that mesh dim (an all-gather); backward takes this
    rank's regions of the replicated gradient (no communication)."""

    @staticmethod
    def forward(ctx: Any, tensor: RegionDTensor) -> DTensor:  # type: ignore[override]
        spec = dtensor_spec(tensor)
        region = _region_of(spec)
        dim = spec.placements.index(region)
        ctx.spec, ctx.dim = spec, dim
        full = region.gather(local_tensor(tensor), spec.mesh.get_group(dim))
        placements = list(spec.placements)
        placements[dim] = TorchReplicate()
        return DTensor(
            full,
            DTensorSpec(spec.mesh, tuple(placements), tensor_meta=spec.tensor_meta),
            requires_grad=False,
        )

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> DTensor:  # type: ignore[override]
        spec, dim = ctx.spec, ctx.dim
        placements = list(spec.placements)
        placements[dim] = TorchReplicate()
        target = DTensorSpec(spec.mesh, tuple(placements), tensor_meta=spec.tensor_meta)
        grad = grad.redistribute(spec.mesh, target.placements)
        region = _region_of(spec)
        rank = spec.mesh.get_coordinate()[dim]
        return wrap(region.take(local_tensor(grad), rank), spec)


# -------------------------------------------------------------------- op handlers
def _local(value: Any, spec: DTensorSpec, func: Any) -> Any:
    """An operand's local tensor, when it is placed like ``spec`` or is a scalar."""
    if isinstance(value, DTensor):
        other = dtensor_spec(value)
        if other is spec or (other.placements == spec.placements and other.shape == spec.shape):
            return local_tensor(value)
        if value.numel() == 1 and all(p.is_replicate() for p in value.placements):
            return local_tensor(value)  # a replicated scalar, e.g. a clipping coefficient
        if value.numel() == 1 and any(isinstance(p, Partial) for p in value.placements):
            return value.full_tensor()
        raise _unsupported(func, spec, f"an operand is placed {tuple(value.placements)}")
    if isinstance(value, torch.Tensor) and value.numel() > 1:
        raise _unsupported(func, spec, "an operand is a plain tensor, not a DTensor")
    return value


def _rewrap(result: Any, spec: DTensorSpec, inputs: dict[int, DTensor]) -> Any:
    if not isinstance(result, torch.Tensor):
        return result
    if id(result) in inputs:  # an in-place op returns its input: hand back the DTensor
        return inputs[id(result)]
    return wrap(result, spec)


def _elementwise(func: Any, args: tuple, kwargs: dict, spec: DTensorSpec) -> Any:
    inputs: dict[int, DTensor] = {}

    def local_of(value: Any) -> Any:
        local = _local(value, spec, func)
        if isinstance(value, DTensor) and local is local_tensor(value):
            inputs[id(local)] = value
        return local

    local_args = _map(args, local_of)
    local_kwargs = {k: _map(v, local_of) for k, v in kwargs.items()}
    out = func(*local_args, **local_kwargs)
    if isinstance(out, (tuple, list)):
        return type(out)(_rewrap(o, spec, inputs) for o in out)
    return _rewrap(out, spec, inputs)


def _foreach(func: Any, args: tuple, kwargs: dict) -> Any:
    """A foreach op: entry i of every tensor list must be placed like entry i of the
    first; entries without a RegionShard are ordinary DTensors and follow the same rule."""
    lists = [a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], DTensor)]
    specs = [dtensor_spec(t) for t in lists[0]]
    inputs: dict[int, DTensor] = {}

    def local_list(arg: Any) -> Any:
        if not (isinstance(arg, (list, tuple)) and arg and isinstance(arg[0], torch.Tensor)):
            return _local(arg, specs[0], func)
        out = []
        for value, spec in zip(arg, specs):
            local = _local(value, spec, func)
            if isinstance(value, DTensor) and local is local_tensor(value):
                inputs[id(local)] = value
            out.append(local)
        return out

    local_args = [local_list(a) for a in args]
    local_kwargs = {k: local_list(v) for k, v in kwargs.items()}
    out = func(*local_args, **local_kwargs)
    if out is None:
        return None
    return [_rewrap(o, spec, inputs) for o, spec in zip(out, specs)]


def _norm_placements(spec: DTensorSpec, ord: float) -> tuple:
    """Each rank's norm is a partial norm over the dims that split the tensor."""
    partial = Partial("max") if math.isinf(ord) else NormPartial(ord)
    return tuple(partial if not p.is_replicate() else TorchReplicate() for p in spec.placements)


def _local_norm(tensor: DTensor, ord: float, dtype: Any) -> DTensor:
    if not isinstance(tensor, RegionDTensor):  # torch's rules hold for its own placements
        return aten.linalg_vector_norm.default(tensor, ord, dtype=dtype)
    if not ord > 0:
        why = f"ord={ord} is not supported"
        raise _unsupported("linalg_vector_norm", dtensor_spec(tensor), why)
    local = local_tensor(tensor)
    if local.numel() == 0:  # a rank holding none of the tensor adds nothing
        norm = torch.zeros((), dtype=dtype or local.dtype, device=local.device)
    else:
        norm = aten.linalg_vector_norm.default(local, ord, dtype=dtype)
    spec = dtensor_spec(tensor)
    meta = TensorMeta(torch.Size([]), (), norm.dtype)
    return DTensor(
        norm,
        DTensorSpec(spec.mesh, _norm_placements(spec, ord), tensor_meta=meta),
        requires_grad=False,
    )


def _norm(func: Any, args: tuple, kwargs: dict) -> Any:
    if func is aten._foreach_norm.Scalar:
        tensors, ord = args[0], (args[1] if len(args) > 1 else kwargs.get("ord", 2))
        dtype = args[2] if len(args) > 2 else kwargs.get("dtype")
        return [_local_norm(t, ord, dtype) for t in tensors]
    tensor = args[0]
    ord = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    keepdim = args[3] if len(args) > 3 else kwargs.get("keepdim", False)
    if dim is not None and sorted(d % tensor.ndim for d in dim) != list(range(tensor.ndim)):
        raise _unsupported(func, dtensor_spec(tensor), f"a norm over dims {dim}, not all of them")
    if keepdim:
        raise _unsupported(func, dtensor_spec(tensor), "keepdim=True")
    return _local_norm(tensor, ord, kwargs.get("dtype"))
