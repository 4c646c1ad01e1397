"""DistMuon on tensor-parallel matrices: a Muon matrix is split over tp (each tp rank
holds a DTensor piece) and each piece over the data-parallel group (flexshard's
regions). Newton–Schulz needs the whole matrix, so the update is gathered in two
steps: the dp shards into this tp rank's piece (one all-gather over the shard group),
then the pieces into the whole matrix (DTensor's all-gather over tp, uneven pieces
padded). Every rank then orthogonalises the same whole matrix, bit for bit what
torch.optim.Muon computes on it, and keeps its own part.

This is the gather-everything strategy (Moonlight's ZeRO-1): it moves the matrix to
every rank and repeats Newton–Schulz on each, where an owner-based plan over tp x dp
would move and compute less. It is the one that is simple and exact for any split.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

from ..runtime.bucket import Bucket
from ..runtime.collectives import Pending
from ..runtime.dcp_chunks import local_boxes
from ..runtime.tp_params import global_tensor, local_piece, tp_sharded


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


def _gather_piece(bucket: Bucket, index: int, shard: torch.Tensor) -> torch.Tensor:
    """This tp rank's whole piece from every dp rank's shard (a collective over dp)."""
    layout = bucket.layout.params[index]
    if bucket.layout.replicated:
        return shard.reshape(layout.shape)
    world = bucket.layout.world_size
    widest = max(layout.local_numel(r) for r in range(world))
    send = torch.zeros(widest, dtype=shard.dtype, device=shard.device)
    send[: shard.numel()] = shard.reshape(-1)
    gathered = torch.empty(world, widest, dtype=shard.dtype, device=shard.device)
    group = bucket.comm.shard_group
    Pending.launch(  # bounded by the bucket's timeout; not counted in the model's comm_stats
        lambda: dist.all_gather_single(gathered.view(-1), send, group=group, async_op=True),
        "DistMuon tensor-parallel all-gather",
        bucket.name,
        bucket.comm.timeout,
        group,
    ).wait()
    piece = torch.empty(layout.shape, dtype=shard.dtype, device=shard.device)
    for rank in range(world):
        cursor = 0
        for box in local_boxes(layout, rank):
            numel = math.prod(box[1])
            piece[_slices(box)] = gathered[rank, cursor : cursor + numel].view(box[1])
            cursor += numel
    return piece


def gather_matrix(bucket: Bucket, index: int, shard: torch.Tensor) -> torch.Tensor:
    """The whole matrix from this rank's shard of it (collectives over dp, then tp)."""
    spec = bucket.params[index].tp_spec
    assert spec is not None
    return global_tensor(_gather_piece(bucket, index, shard), spec)


def own_part(bucket: Bucket, index: int, matrix: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a whole matrix: its tp piece, then its dp regions."""
    spec = bucket.params[index].tp_spec
    assert spec is not None
    piece = local_piece(matrix, spec)
    layout = bucket.layout.params[index]
    boxes = local_boxes(layout, bucket.rank)
    shape = layout.local_shape(bucket.rank)
    if not boxes:
        return matrix.new_empty(shape)
    return torch.cat([piece[_slices(box)].reshape(-1) for box in boxes]).view(shape)
