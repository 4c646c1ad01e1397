"""Tensor-parallel matrices for DistMuon and MatrixOptimizer: a matrix is split over tp
(each tp rank holds a DTensor piece) and each piece over the data-parallel group
(flexshard's regions). ``gather_piece`` collects a tp rank's piece from its dp shards
(one all-gather over the shard group), ``dp_part`` cuts a rank's shard back out of a
piece. ``gather_matrix`` goes on to the whole matrix on every rank (DTensor's
all-gather over tp, uneven pieces padded) and ``own_part`` keeps this rank's part of a
whole matrix: the gather-everything strategy (Moonlight's ZeRO-1) that MatrixOptimizer
uses. DistMuon instead gives each matrix one Newton–Schulz owner per tp group
(``tp_owners``), bit for bit the same result with ~1/tp of the work per rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.distributed.tensor import Shard

from ..runtime.bucket import Bucket
from ..runtime.collectives import Pending
from ..runtime.dtensor.chunks import local_boxes
from ..runtime.dtensor.tensor_parallel import global_tensor, local_piece, tp_sharded
from ..torch_internals import all_gather_single


def is_tp_matrix(bucket: Bucket, index: int) -> bool:
    """Whether parameter ``index`` of ``bucket`` is split over tp (not just replicated)."""
    return tp_sharded(bucket.params[index].tp_spec)


def whole_row_blocks(bucket: Bucket, index: int, rows: int) -> bool:
    """Whether every tp piece is whole blocks of ``rows`` full-width rows (a
    column-parallel projection cut at head boundaries): then per-block Muon on the
    piece is per-block Muon on the whole matrix, with no tp exchange. Decided from
    the global shape alone, so every tp rank takes the same path."""
    spec = bucket.params[index].tp_spec
    assert spec is not None
    if len(spec.shape) != 2 or spec.mesh.ndim != 1 or spec.placements[0] != Shard(0):
        return False
    per_piece = -(-spec.shape[0] // spec.mesh.size())  # torch.chunk's rows per piece
    return per_piece % rows == 0


def _slices(box: tuple[tuple[int, ...], tuple[int, ...]]) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(*box))


def gather_piece(bucket: Bucket, index: int, shard: torch.Tensor) -> torch.Tensor:
    """This tp rank's whole piece from every dp rank's shard (a collective over dp, in
    ``shard``'s dtype; none for a replicated bucket, whose shard is the piece)."""
    return gather_pieces([(bucket, index, shard)])[0]


def gather_groups(items: Sequence[tuple[Bucket, int]]) -> list[list[int]]:
    """Which ``items`` share one all-gather in :func:`gather_pieces`: by shard group,
    in first-seen order; replicated buckets need none (left out)."""
    by_group: dict[str, list[int]] = {}
    for k, (bucket, _) in enumerate(items):
        if not bucket.layout.replicated:
            by_group.setdefault(bucket.comm.shard_group.group_name, []).append(k)
    return list(by_group.values())


def gather_widths(bucket: Bucket, index: int) -> int:
    """Elements each dp rank contributes for parameter ``index`` (its widest shard)."""
    layout = bucket.layout.params[index]
    return max(layout.local_numel(r) for r in range(bucket.layout.world_size))


def gather_pieces(items: Sequence[tuple[Bucket, int, torch.Tensor]]) -> list[torch.Tensor]:
    """Each item's tp piece from every dp rank's shard of it: one all-gather per shard
    group for all its items (every rank of a group passes the same parameters in the
    same order, shards of one dtype), none for replicated buckets or a group of one."""
    out = [  # a replicated bucket's shard is the piece; the others are filled below
        shard.reshape(b.layout.params[i].shape) if b.layout.replicated else shard
        for b, i, shard in items
    ]
    for members in gather_groups([(b, i) for b, i, _ in items]):
        first, _, shard0 = items[members[0]]
        world = first.layout.world_size
        widths = [gather_widths(items[k][0], items[k][1]) for k in members]
        send = torch.zeros(sum(widths), dtype=shard0.dtype, device=shard0.device)
        starts = [sum(widths[:n]) for n in range(len(widths))]
        for k, start in zip(members, starts):
            shard = items[k][2].reshape(-1)
            send[start : start + shard.numel()] = shard
        gathered = send.view(1, -1)  # a dp group of one: the shard is the piece
        if world > 1:
            gathered = torch.empty(world, send.numel(), dtype=send.dtype, device=send.device)
            _all_gather(gathered, send, first)
        for k, start in zip(members, starts):
            bucket, index, _ = items[k]
            out[k] = _assemble(bucket, index, gathered, start)
    return out


def _assemble(bucket: Bucket, index: int, gathered: torch.Tensor, start: int) -> torch.Tensor:
    """The piece from every rank's row of ``gathered`` (its shard from column ``start``)."""
    layout = bucket.layout.params[index]
    piece = torch.empty(layout.shape, dtype=gathered.dtype, device=gathered.device)
    for rank in range(bucket.layout.world_size):
        cursor = start
        for box in local_boxes(layout, rank):
            numel = math.prod(box[1])
            piece[_slices(box)] = gathered[rank, cursor : cursor + numel].view(box[1])
            cursor += numel
    return piece


def _all_gather(gathered: torch.Tensor, send: torch.Tensor, bucket: Bucket) -> None:
    group = bucket.comm.shard_group
    Pending.launch(  # bounded by the bucket's timeout; not counted in the model's comm_stats
        lambda: all_gather_single(gathered.view(-1), send, group=group, async_op=True),
        "tensor-parallel piece all-gather",
        bucket.name,
        bucket.comm.timeout,
        group,
    ).wait()


def gather_matrix(bucket: Bucket, index: int, shard: torch.Tensor) -> torch.Tensor:
    """The whole matrix from this rank's shard of it (collectives over dp, then tp)."""
    spec = bucket.params[index].tp_spec
    assert spec is not None
    return global_tensor(gather_piece(bucket, index, shard), spec)


def own_part(bucket: Bucket, index: int, matrix: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a whole matrix: its tp piece, then its dp regions."""
    spec = bucket.params[index].tp_spec
    assert spec is not None
    return dp_part(bucket, index, local_piece(matrix, spec))


def dp_part(bucket: Bucket, index: int, piece: torch.Tensor) -> torch.Tensor:
    """This rank's shard of its tp ``piece``: its dp regions, in storage order."""
    layout = bucket.layout.params[index]
    boxes = local_boxes(layout, bucket.store.rank)
    shape = layout.local_shape(bucket.store.rank)
    if not boxes:
        return piece.new_empty(shape)
    return torch.cat([piece[_slices(box)].reshape(-1) for box in boxes]).view(shape)
