"""A rank's regions of a parameter, described to torch.distributed.checkpoint as chunks.

DCP asks a state-dict value three things through its ``_Checkpointable`` protocol (the
one DTensor implements): which chunks this rank writes (``__create_write_items__``),
which chunks it wants on load (``__create_chunk_list__``) and the tensor behind one
chunk (``__get_tensor_shard__``). A ``RegionTensor`` answers them from the bucket
layout, so each rank writes exactly the boxes it stores and nothing is gathered."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from ...placements import Region
from ...placements.layout import ParamLayout
from ...torch_internals import compute_local_shape_and_global_offset

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
