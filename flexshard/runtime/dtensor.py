"""RegionDTensor: a DTensor with a RegionShard placement.

torch's sharding rules know only Shard, Replicate and Partial, so this subclass
answers for the others itself: elementwise ops (what optimizers run) apply to the
local tensors, since operands placed alike hold the same elements; p-norms become
Partial (every element lives on exactly one rank), so ``clip_grad_norm_`` gets the
global norm; ``redistribute``/``full_tensor`` gather; DCP sees each rank's regions as
chunks. Every other op raises, naming the parameter and its placement.

RegionShard: the DTensor placement of a FlatShard, Owned or BlockShard parameter.

torch's own placements cut a tensor into one box per rank; these cut it into the
regions a flexshard ``ParamLayout`` gives each rank (a flat range, a whole parameter
or nothing, whole 2-D tiles). The placement carries that layout, so it knows every
rank's global offsets, and it moves a tensor between its regions and Replicate.

A rank's regions of a parameter, described to torch.distributed.checkpoint as chunks.

DCP asks a state-dict value three things through its ``_Checkpointable`` protocol (the
one DTensor implements): which chunks this rank writes (``__create_write_items__``),
which chunks it wants on load (``__create_chunk_list__``) and the tensor behind one
chunk (``__get_tensor_shard__``). A ``RegionTensor`` answers them from the bucket
layout, so each rank writes exactly the boxes it stores and nothing is gathered.

Tensor-parallel (DTensor) parameters inside a bucket: flexshard shards a DTensor's
local tensor (its TP piece) over the data-parallel group like any plain tensor, and
these helpers convert between that local tensor and the DTensor world.

A whole tensor cut onto a RegionShard placement, and torch's full state-dict load
taught to do it.

torch's ``distribute_tensor`` and the copy that ``set_model_state_dict`` /
``set_optimizer_state_dict(full_state_dict=True)`` make (``_state_dict_utils.
_distribute_tensors``) know only box-shaped cuts and offer no placement hook: for a
FlatShard/Owned/BlockShard entry they raise on some ranks while the others go on to
the next key's broadcast and wait there until the timeout. ``install`` wraps those two
names inside ``torch.distributed._state_dict_utils`` only (nothing else of torch's
changes): entries placed on a RegionShard are cut into this rank's regions, every
other entry goes to torch's own code unchanged.

The parameters the optimizer sees: DTensors on the bucket's mesh whose local tensors
are views into the bucket storage, placed as FSDP2 places its own.

``Shard(dim)`` and ``Replicate`` become torch's placements (FSDP2's exactly, so torch's
tools treat them alike); FlatShard, Owned and BlockShard become a RegionShard. HSDP
adds ``Replicate`` on the replicate dim; a tensor-parallel parameter keeps its tp
placements on a (dp, tp) mesh, as FSDP2 composes with TP."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor import Placement as TorchPlacement
from torch.distributed.tensor import Replicate as TorchReplicate
from torch.distributed.tensor import Shard as TorchShard
from torch.distributed.tensor import distribute_tensor as torch_distribute_tensor

from ..placements import Placement, Region, Replicate, Shard
from ..placements.layout import ParamLayout
from ..torch_internals import (
    DTensorSpec,
    NormPartial,
    StridedShard,
    TensorMeta,
    all_gather_single,
    compute_local_shape_and_global_offset,
    concatenate_meshes,
    dtensor_spec,
    ensure_own_dispatch,
    local_tensor,
    patch_full_state_dict_distribute,
)


class RegionShard(TorchPlacement):
    """Each rank of one mesh dimension stores the regions ``layout.regions[rank]`` of
    the tensor (or of its tensor-parallel piece), flattened in region order."""

    def __init__(self, kind: str, layout: ParamLayout) -> None:
        super().__init__()
        self.kind = kind  # the flexshard placement's name, for messages
        self.layout = layout

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RegionShard):
            return False
        return other.layout is self.layout or other.layout == self.layout

    def __hash__(self) -> int:
        return hash((self.layout.fqn, self.layout.shape, self.layout.regions))

    def __repr__(self) -> str:
        return f"{self.kind}(param='{self.layout.fqn}')"

    def __str__(self) -> str:
        return repr(self)

    # ``is_shard``/``is_replicate``/``is_partial`` stay False: torch's sharding rules
    # must never mistake these regions for one of its own cuts

    def local_shape(self, rank: int) -> tuple[int, ...]:
        return self.layout.local_shape(rank)

    def take(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s local tensor out of the full tensor (a copy; no collective)."""
        pieces = [region.view_of(full).reshape(-1) for region in self.layout.regions[rank]]
        flat = torch.cat(pieces) if pieces else full.new_empty(0)
        return flat.view(self.local_shape(rank))

    def gather(self, local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        """The full tensor from every rank's local tensor: one all-gather padded to the
        largest rank (gloo cannot gather different sizes)."""
        layout = self.layout
        width = max(layout.local_numel(r) for r in range(len(layout.regions)))
        send = local.new_zeros(width)
        send[: local.numel()].copy_(local.reshape(-1))
        received = local.new_empty(len(layout.regions) * width)
        all_gather_single(received, send, group=group)
        full = local.new_empty(layout.shape)
        for rank, regions in enumerate(layout.regions):
            cursor = rank * width
            for region in regions:
                piece = received[cursor : cursor + region.numel]
                region.view_of(full).copy_(piece.view(region.sizes))
                cursor += region.numel
        return full


Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) in the full tensor


def flat_range_boxes(start: int, stop: int, shape: Sequence[int]) -> list[Box]:
    """The row-major range ``[start, stop)`` of a tensor of ``shape`` as a few boxes,
    in order, each contiguous in row-major order (at most two per dimension)."""
    if start >= stop:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    first, head = divmod(start, inner)
    last, tail = divmod(stop, inner)

    def in_row(row: int, lo: int, hi: int) -> list[Box]:
        return [((row, *o), (1, *s)) for o, s in flat_range_boxes(lo, hi, shape[1:])]

    if first == last:
        return in_row(first, head, tail)
    boxes = []
    if head:
        boxes += in_row(first, head, inner)
        first += 1
    if last > first:
        boxes.append(((first, *[0] * (len(shape) - 1)), (last - first, *shape[1:])))
    if tail:
        boxes += in_row(last, 0, tail)
    return boxes


def region_boxes(region: Region, shape: Sequence[int]) -> list[Box]:
    if region.flat:
        return flat_range_boxes(region.offsets[0], region.offsets[0] + region.sizes[0], shape)
    return [] if region.numel == 0 else [(tuple(region.offsets), tuple(region.sizes))]


def _joined(a: Box, b: Box, shape: Sequence[int]) -> Box | None:
    """``a`` and ``b`` as one box when ``b`` continues ``a`` in row-major order (e.g.
    full-width BlockShard tiles one under the other); else None."""
    (ao, asz), (bo, bsz) = a, b
    for d in range(len(shape)):
        if ao[d] != bo[d] or asz[d] != bsz[d]:
            ends_before = all(s == 1 for s in asz[:d])
            full_after = all(
                o == 0 and s == n for o, s, n in zip(ao[d + 1 :], asz[d + 1 :], shape[d + 1 :])
            )
            if ends_before and full_after and bo[:d] == ao[:d] and bsz[d + 1 :] == asz[d + 1 :]:
                if bo[d] == ao[d] + asz[d] and bo[d + 1 :] == ao[d + 1 :]:
                    return ao, (*asz[:d], asz[d] + bsz[d], *asz[d + 1 :])
            return None
    return None


def local_boxes(param: ParamLayout, rank: int) -> list[Box]:
    """The boxes rank ``rank`` stores, in the order its local tensor holds them;
    neighbours that form one box are joined (fewer chunks for DCP to plan and read)."""
    boxes: list[Box] = []
    for box in (b for r in param.regions[rank] for b in region_boxes(r, param.shape)):
        joined = _joined(boxes[-1], box, param.shape) if boxes else None
        if joined is None:
            boxes.append(box)
        else:
            boxes[-1] = joined
    return boxes


class RegionTensor(torch.Tensor):
    """A full-shape stand-in for the pieces one rank holds of a tensor.

    ``pieces`` are (box, tensor) pairs, each tensor a view of the local data shaped
    like its box. ``writer`` says whether this rank writes them: replicated copies
    (Replicate buckets, HSDP replicas) are written by one rank and read by all.
    """

    pieces: list[tuple[Box, torch.Tensor]]
    writer: bool
    slot: Any  # (bucket, index) of the parameter it describes

    @staticmethod
    def __new__(
        cls,
        shape: Sequence[int],
        pieces: list[tuple[Box, torch.Tensor]],
        writer: bool,
        dtype: torch.dtype,
        device: torch.device,
        slot: Any = None,
    ) -> RegionTensor:
        out = torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=dtype, device=device)
        out.pieces = pieces
        out.writer = writer
        out.slot = slot
        return out

    def __repr__(self) -> str:  # type: ignore[override]
        boxes = [box for box, _ in self.pieces]
        return f"RegionTensor(shape={tuple(self.shape)}, dtype={self.dtype}, boxes={boxes})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        if func is torch.ops.aten.detach.default:  # DCP and state_dict detach values
            return args[0]
        raise NotImplementedError(
            f"a flexshard RegionTensor only describes this rank's chunks for "
            f"torch.distributed.checkpoint; {func} is not supported (use .local() or "
            "fs.full_state_dict for the values)"
        )

    # ---------------------------------------------------------------- DCP protocol
    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        if not self.writer:
            return []
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
                    properties=TensorProperties.create_from_tensor(tensor),
                    size=self.shape,
                ),
            )
            for (offsets, sizes), tensor in self.pieces
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [
            ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
            for (offsets, sizes), _ in self.pieces
        ]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        offsets = tuple(index.offset) if index.offset is not None else None
        for (box_offsets, _), tensor in self.pieces:
            if box_offsets == offsets:
                return tensor
        raise ValueError(f"'{index.fqn}': this rank holds no chunk at offsets {offsets}")

    # ---------------------------------------------------------------- values
    def local(self) -> torch.Tensor:
        """The pieces one after another: the rank's local tensor, flat."""
        if not self.pieces:
            return torch.empty(0, dtype=self.dtype, device=self.device)
        return torch.cat([t.reshape(-1) for _, t in self.pieces])

    def fresh(self) -> RegionTensor:
        """The same chunks over new zeroed buffers: load into it, check, then copy."""
        pieces = [(box, torch.zeros_like(t)) for box, t in self.pieces]
        return RegionTensor(self.shape, pieces, self.writer, self.dtype, self.device, self.slot)


def shifted(boxes: list[Box], offset: Sequence[int]) -> list[Box]:
    """Boxes of a tensor-parallel piece in the coordinates of the whole tensor."""
    return [(tuple(o + d for o, d in zip(offs, offset)), sizes) for offs, sizes in boxes]


def region_tensor(
    param: ParamLayout,
    rank: int,
    local: torch.Tensor,
    writer: bool,
    slot: Any = None,
    frame: tuple[Sequence[int], Sequence[int]] | None = None,
) -> RegionTensor:
    """Describe ``local`` (this rank's data of ``param``, any shape with the local
    numel, e.g. the parameter or an optimizer state like it) as chunks. ``frame``
    (global shape, offset): ``param`` is a tensor-parallel piece of a larger tensor."""
    flat = local.detach().reshape(-1)
    if flat.numel() != param.local_numel(rank):
        raise ValueError(
            f"'{param.fqn}': local tensor has {flat.numel()} elements, rank {rank} stores "
            f"{param.local_numel(rank)}"
        )
    pieces, cursor = [], 0
    boxes = local_boxes(param, rank)
    shape = param.shape
    if frame is not None:
        shape, boxes = frame[0], shifted(boxes, frame[1])
    for offsets, sizes in boxes:
        numel = math.prod(sizes)
        pieces.append(((offsets, sizes), flat[cursor : cursor + numel].view(sizes)))
        cursor += numel
    return RegionTensor(shape, pieces, writer, local.dtype, local.device, slot)


def chunks_of(value: torch.Tensor) -> RegionTensor:
    """A sharded parameter's (or optimizer state's) local data as chunks of the whole
    tensor: a RegionShard DTensor's regions, a torch-placed DTensor's one box."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, RegionTensor):
        return value
    if hasattr(value, "_chunks"):  # a RegionDTensor
        return value._chunks()
    assert isinstance(value, DTensor), type(value)
    shape, offset = compute_local_shape_and_global_offset(
        value.shape, value.device_mesh, value.placements
    )
    local = value.to_local().view(shape)
    pieces = [((tuple(offset), tuple(shape)), local)] if local.numel() else []
    return RegionTensor(value.shape, pieces, True, value.dtype, local.device)


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
    return next((p for p in spec.placements if isinstance(p, RegionShard)), None)


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


@dataclass(frozen=True)
class SpmdDims:
    """A full SPMD mesh ``fully_shard`` was given with ``dp_mesh_dims``: which of its
    dims are data parallel. Its parameters are DTensors on it, Replicate on those
    dims; flexshard shards over them and keeps every other dim's placement."""

    mesh: DeviceMesh
    shard: int | None  # the dp dim parameters are sharded over
    replicate: int | None  # HSDP's replicate dim

    @property
    def dp(self) -> frozenset[int]:
        return frozenset(i for i in (self.shard, self.replicate) if i is not None)


#: by mesh value (DeviceMesh hashes its ranks and dim names): DTensor may hand back an
#: equal mesh object of an earlier model for a parameter's spec
_SPMD: dict[DeviceMesh, SpmdDims] = {}


def register_spmd_mesh(dims: SpmdDims) -> None:
    known = _SPMD.get(dims.mesh)
    if known is not None and (known.shard, known.replicate) != (dims.shard, dims.replicate):
        raise ValueError(
            f"fully_shard: the mesh {dims.mesh} was given with dp dims {known} before and "
            f"{dims} now; one SPMD mesh has one set of data-parallel dims"
        )
    _SPMD[dims.mesh] = dims


def spmd_dims(spec: DTensorSpec | None) -> SpmdDims | None:
    """The dp dims of a parameter's spec on a full SPMD mesh (None: a TP spec)."""
    return None if spec is None else _SPMD.get(spec.mesh)


def spec_of(param: torch.Tensor) -> DTensorSpec | None:
    """A DTensor parameter's spec (mesh, placements, global shape); None: plain."""
    return dtensor_spec(param) if isinstance(param, DTensor) else None


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    """What flexshard shards and gathers: a DTensor's local tensor, else the tensor."""
    return local_tensor(tensor) if isinstance(tensor, DTensor) else tensor


def check_tp_param(param: torch.Tensor, fqn: str, bucket: str) -> None:
    """flexshard takes DTensors whose placements are TP's own: Shard or Replicate."""
    spec = spec_of(param)
    if spec is None:
        return
    if any(not (p.is_shard() or p.is_replicate()) for p in spec.placements):
        raise ValueError(
            f"bucket '{bucket}': parameter '{fqn}' is a DTensor with placements "
            f"{spec.placements}; flexshard takes Shard/Replicate (tensor parallel) DTensors"
        )


def full_parameter(local: torch.Tensor, spec: DTensorSpec | None, requires_grad: bool):
    """The parameter the modules see while unsharded: the gathered tensor, or for a
    tensor-parallel parameter a DTensor on its TP mesh wrapping the gathered local
    tensor (FSDP2 does the same), so that TP's module hooks keep working."""
    if spec is None:
        return nn.Parameter(local, requires_grad=requires_grad)
    meta = spec.tensor_meta
    if meta is not None and meta.dtype != local.dtype:  # mp_policy casts the gathered copy
        meta = TensorMeta(meta.shape, meta.stride, local.dtype)
        spec = DTensorSpec(spec.mesh, spec.placements, tensor_meta=meta)
    return nn.Parameter(DTensor(local, spec, requires_grad=False), requires_grad=requires_grad)


def local_grad(grad: torch.Tensor | None, spec: DTensorSpec | None) -> torch.Tensor | None:
    """A TP parameter's gradient as the local tensor of the parameter's own placements
    (a replicated weight's gradient may come back Partial: redistribute sums it over tp)."""
    if grad is None or spec is None:
        return grad
    if not isinstance(grad, DTensor):
        raise TypeError(f"expected a DTensor gradient for a TP parameter, got {type(grad)}")
    target = tuple(spec.placements)
    spmd = spmd_dims(spec)
    if spmd is not None:  # as FSDP2: dp dims stay as they came (a Partial is reduced by us)
        came = grad.placements
        target = tuple(came[i] if i in spmd.dp else p for i, p in enumerate(target))
    if tuple(grad.placements) != target:
        grad = grad.redistribute(spec.mesh, target)
    return local_tensor(grad)


def tp_sharded(spec: DTensorSpec | None) -> bool:
    """Whether the parameter is split over tp (its local pieces sum, not repeat)."""
    return spec is not None and any(isinstance(p, TorchShard) for p in spec.placements)


def global_tensor(local: torch.Tensor, spec: DTensorSpec) -> torch.Tensor:
    """The whole parameter from every tp rank's local piece (a collective over tp)."""
    dtensor = DTensor.from_local(
        local, spec.mesh, spec.placements, run_check=False, shape=spec.shape, stride=spec.stride
    )
    return dtensor.full_tensor()


def local_piece(full: torch.Tensor, spec: DTensorSpec) -> torch.Tensor:
    """This tp rank's piece of a whole parameter (no collective)."""
    shape, offset = compute_local_shape_and_global_offset(full.shape, spec.mesh, spec.placements)
    index = tuple(slice(o, o + s) for o, s in zip(offset, shape))
    return full[index]


def tp_group(spec: DTensorSpec) -> dist.ProcessGroup:
    spmd = spmd_dims(spec)
    dims = [i for i in range(spec.mesh.ndim) if spmd is None or i not in spmd.dp]
    if len(dims) != 1:
        raise ValueError(f"a TP parameter needs one tp mesh dim, got {len(dims)}")
    return spec.mesh.get_group(dims[0])


def tp_frame(spec: DTensorSpec) -> tuple[tuple[int, ...], tuple[int, ...], bool]:
    """(global shape, offset of this tp rank's piece, whether it writes the piece in a
    checkpoint): a piece replicated over tp is written by its first holder only."""
    shape, offset = compute_local_shape_and_global_offset(spec.shape, spec.mesh, spec.placements)
    coordinate = list(spec.mesh.get_coordinate() or [])
    spmd = spmd_dims(spec)
    for i in spmd.dp if spmd is not None else ():  # dp dims: flexshard's own layout decides
        coordinate[i] = 0
    writes = all(not p.is_replicate() or c == 0 for p, c in zip(spec.placements, coordinate))
    return tuple(spec.shape), tuple(offset), writes


def _region_dim(placements: Sequence[TorchPlacement]) -> int | None:
    return next((d for d, p in enumerate(placements) if isinstance(p, RegionShard)), None)


def _regions_of_piece(
    piece: torch.Tensor, mesh: DeviceMesh, placements: Sequence[TorchPlacement], dim: int
) -> torch.Tensor:
    """This rank's regions of ``piece`` (the whole tensor, or its tensor-parallel piece)."""
    region = placements[dim]
    if tuple(piece.shape) != tuple(region.layout.shape):
        raise ValueError(
            f"a tensor of shape {tuple(piece.shape)} cannot be placed on {region}: "
            f"its shape (or tensor-parallel piece) is {tuple(region.layout.shape)}"
        )
    return region.take(piece, mesh.get_coordinate()[dim])


def _as_replicate(placements: Sequence[TorchPlacement], dim: int) -> list[TorchPlacement]:
    return [TorchReplicate() if d == dim else p for d, p in enumerate(placements)]


def local_regions(
    full: torch.Tensor, mesh: DeviceMesh, placements: Sequence[TorchPlacement]
) -> torch.Tensor:
    """This rank's local tensor of ``full`` placed on ``placements`` (a RegionShard on one
    mesh dim): a copy, no collective."""
    dim = _region_dim(placements)
    piece = local_piece(full, DTensorSpec(mesh, tuple(_as_replicate(placements, dim))))
    return _regions_of_piece(piece, mesh, placements, dim)


def _spec(
    mesh: DeviceMesh, placements: Sequence[TorchPlacement], full: torch.Tensor
) -> DTensorSpec:
    meta = TensorMeta(full.shape, full.stride(), full.dtype)
    return DTensorSpec(mesh, tuple(placements), tensor_meta=meta)


def distribute_tensor(
    tensor: torch.Tensor,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[TorchPlacement] | None = None,
    *,
    src_data_rank: int | None = 0,
) -> DTensor:
    """torch's ``distribute_tensor``, for flexshard's placements too: on a RegionShard
    mesh dim each rank keeps its regions of what torch's Replicate there would give it
    (so ``src_data_rank`` means what it means to torch)."""
    dim = None if placements is None else _region_dim(placements)
    if dim is None:
        return torch_distribute_tensor(tensor, device_mesh, placements, src_data_rank=src_data_rank)
    others = _as_replicate(placements, dim)
    pieces = torch_distribute_tensor(tensor, device_mesh, others, src_data_rank=src_data_rank)
    mesh = pieces.device_mesh  # torch's default mesh where none was given
    local = _regions_of_piece(local_tensor(pieces), mesh, placements, dim)
    return wrap(local, _spec(mesh, placements, tensor), requires_grad=tensor.requires_grad)


def _distribute_region_entries(local_state_dict: dict[str, Any], keys: list[str]) -> None:
    """The entries of ``keys`` that pair a RegionShard DTensor with the broadcast whole
    tensor become that DTensor holding this rank's regions (torch's copy, for regions)."""
    for key in keys:
        entry = local_state_dict.get(key)
        if not (isinstance(entry, tuple) and isinstance(entry[0], DTensor)):
            continue
        current, full = entry
        if _region_dim(current.placements) is None:
            continue
        local = local_regions(full, current.device_mesh, current.placements)
        if current.is_meta:  # a meta-built model: the new tensor is assigned
            local_state_dict[key] = wrap(local.clone(), dtensor_spec(current))
            continue
        with torch.no_grad():
            local_tensor(current).copy_(local)
        local_state_dict[key] = current


def install() -> None:
    """Teach torch's full state-dict load (model and optimizer, with and without
    ``broadcast_from_rank0``) flexshard's placements; idempotent."""
    patch_full_state_dict_distribute(_distribute_region_entries, distribute_tensor)


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def dp_placement(placement: Placement, layout: ParamLayout):
    """The torch placement that says what each rank of the shard group holds."""
    if isinstance(placement, Shard):
        return TorchShard(placement.dim % len(layout.shape))
    if isinstance(placement, Replicate):
        return TorchReplicate()
    install()  # torch's full state-dict load must know RegionShard
    return RegionShard(type(placement).__name__, layout)


def sharded_spec(
    mesh: DeviceMesh,
    placement: Placement,
    layout: ParamLayout,
    dtype: torch.dtype,
    tp_spec: DTensorSpec | None = None,
) -> DTensorSpec:
    """The spec of a sharded parameter: ``mesh`` is the bucket's (shard) or
    (replicate, shard) mesh; ``tp_spec`` the parameter's own when tensor parallel."""
    placements = [dp_placement(placement, layout)]
    if mesh.ndim == 2:
        placements.insert(0, TorchReplicate())
    shape = tuple(layout.shape)
    spmd = spmd_dims(tp_spec)
    if spmd is not None:
        mesh, placements, shape = _on_spmd_mesh(placements, tp_spec, spmd)
    elif tp_spec is not None:
        mesh, placements, shape = _with_tp(mesh, placements, tp_spec)
    meta = TensorMeta(torch.Size(shape), _strides(shape), dtype)
    return DTensorSpec(mesh, tuple(placements), tensor_meta=meta)


def _with_tp(
    mesh: DeviceMesh, placements: list, tp_spec: DTensorSpec
) -> tuple[DeviceMesh, list, tuple[int, ...]]:
    """dp dims first, then tp's: the tp piece is cut first, then split over dp, so a dp
    ``Shard(d)`` over a tp ``Shard(d)`` is torch's ``_StridedShard`` (as in FSDP2)."""
    try:
        joined = concatenate_meshes([mesh, tp_spec.mesh])
    except (RuntimeError, TypeError, ValueError) as err:
        raise ValueError(
            "a tensor-parallel parameter needs its dp and tp meshes cut from one DeviceMesh "
            f"(e.g. mesh['dp'] and mesh['tp']): {err}"
        ) from err
    out = []
    for p in placements:
        if isinstance(p, TorchShard):
            factor = 1
            for tp, size in zip(tp_spec.placements, tp_spec.mesh.shape):
                if isinstance(tp, TorchShard) and tp.dim == p.dim:
                    factor *= size
            p = StridedShard(p.dim, split_factor=factor) if factor > 1 else p
        out.append(p)
    return joined, out + list(tp_spec.placements), tuple(tp_spec.shape)


def _on_spmd_mesh(
    placements: list, spec: DTensorSpec, spmd: SpmdDims
) -> tuple[DeviceMesh, list, tuple[int, ...]]:
    """``fully_shard(dp_mesh_dims=...)``: the parameter stays on its full SPMD mesh with
    every dim in place, the dp shard dim taking the dp placement (``_StridedShard`` over
    a model-parallel ``Shard`` of the same dim on a later mesh dim, FSDP2's rule) and
    HSDP's replicate dim ``Replicate``, as FSDP2 places it."""
    out = list(spec.placements)
    dp = placements[-1]
    if spmd.shard is not None:
        if isinstance(dp, TorchShard):
            factor = 1
            for j in range(spmd.shard + 1, spec.mesh.ndim):
                p = out[j]
                if isinstance(p, (TorchShard, StridedShard)) and p.dim == dp.dim:
                    factor *= spec.mesh.size(j)
            dp = StridedShard(dp.dim, split_factor=factor) if factor > 1 else dp
        out[spmd.shard] = dp
    if spmd.replicate is not None:
        out[spmd.replicate] = TorchReplicate()
    return spec.mesh, out, tuple(spec.shape)
