"""Copy parameters into and out of the flat per-rank layout (pure tensor ops)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from .base import Region
from .layout import BucketLayout, CopyBlock, ParamLayout


def storage_shape(block: CopyBlock) -> tuple[int, ...]:
    """The block's region's shape, or ``(rows, cols, R, C)`` for a grid of tiles
    stored tile after tile."""
    if block.grid == (1, 1):
        return block.region.sizes
    return (*block.grid, *block.region.sizes[-2:])


def storage_view(block: CopyBlock, storage: torch.Tensor) -> torch.Tensor:
    """The block's slice of a rank's flat storage, shaped by ``storage_shape``."""
    return storage[block.offset : block.offset + block.numel].view(storage_shape(block))


def full_view(block: CopyBlock, full: torch.Tensor) -> torch.Tensor:
    """The same elements of the full tensor, shaped like ``storage_view``."""
    region = block.region
    if block.grid == (1, 1):
        return region.view_of(full)
    rows, cols = block.grid
    tile_rows, tile_cols = region.sizes[-2:]
    span = Region(region.offsets, (*region.sizes[:-2], rows * tile_rows, cols * tile_cols))
    box = span.view_of(full).view(rows * tile_rows, cols * tile_cols)  # batch dims are 1
    tiles = box.unflatten(0, (rows, tile_rows)).unflatten(-1, (cols, tile_cols))
    return tiles.permute(0, 2, 1, 3)


def _flat_span(region: Region, shape: tuple[int, ...]) -> tuple[int, int] | None:
    """``(first element, numel)`` when the region is one contiguous range of the
    row-major flattened parameter (a flat range, or a box whole in every dim after its
    first partial one); otherwise None."""
    if region.flat:
        return region.offsets[0], region.sizes[0]
    start, stride, partial = 0, 1, False
    for offset, size, extent in zip(
        reversed(region.offsets), reversed(region.sizes), reversed(shape)
    ):
        if partial and size != 1:
            return None
        start += offset * stride
        partial = partial or size != extent
        stride *= extent
    return start, region.numel


# a copy of one parameter: ("run", first rank, ranks, storage offset, numel, first
# element): ``ranks`` consecutive ranks each holding ``numel`` consecutive elements at
# the same storage offset, one [ranks, numel] strided copy; or ("block", rank, block)
_Copy = tuple


def _copy_plan(param: ParamLayout) -> tuple[_Copy, ...]:
    """Fewest strided copies that move ``param`` between the full tensor and the
    gathered [W, S] buffer: Shard/FlatShard rank chunks merge into one copy. Kept on
    the layout (as its ``copy_blocks``): hashing a frozen layout costs more than this."""
    cached = param.__dict__.get("_copy_plan")
    if cached is None:
        cached = param.__dict__["_copy_plan"] = _plan_copies(param)
    return cached


def _plan_copies(param: ParamLayout) -> tuple[_Copy, ...]:
    plan: list[_Copy] = []
    run: list = []  # [first rank, ranks, offset, numel, first element]

    def close() -> None:
        if run:
            plan.append(("run", *run))
            run.clear()

    for rank, blocks in enumerate(param.copy_blocks):
        spans = [(b, _flat_span(b.region, param.shape)) for b in blocks if b.numel]
        if len(spans) == 1 and spans[0][0].grid == (1, 1) and spans[0][1] is not None:
            block, (start, numel) = spans[0]
            if (
                run
                and (block.offset, numel) == (run[2], run[3])
                and (start == run[4] + run[1] * numel)
            ):
                run[1] += 1
                continue
            close()
            run.extend([rank, 1, block.offset, numel, start])
            continue
        close()
        plan.extend(("block", rank, block) for block, _ in spans)
    close()
    return tuple(plan)


def _pairs(
    param: ParamLayout, full: torch.Tensor, flat2d: torch.Tensor, ranks: range
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(storage view, full view) pairs of ``param`` for the rows ``ranks`` of
    ``flat2d`` ([W, S] or one rank's [1, S]); ``full`` is contiguous."""
    flat = full.view(-1)
    for copy in _copy_plan(param):
        if copy[0] == "block":
            _, rank, block = copy
            if rank in ranks:
                row = flat2d[rank - ranks.start]
                yield storage_view(block, row), full_view(block, full)
            continue
        _, first, count, offset, numel, start = copy
        lo, hi = max(first, ranks.start), min(first + count, ranks.stop)
        if lo >= hi:
            continue
        begin = start + (lo - first) * numel
        rows = flat2d[lo - ranks.start : hi - ranks.start, offset : offset + numel]
        yield rows, flat[begin : begin + (hi - lo) * numel].view(hi - lo, numel)


def copy_views(
    layout: BucketLayout,
    fulls: Sequence[torch.Tensor | None],
    flat2d: torch.Tensor,
    ranks: range,
    into_storage: bool,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    """(destinations, sources) of one foreach copy of every piece of every parameter, in
    whichever direction, and the (strided full, contiguous stand-in) pairs to copy back
    afterwards. The views stay valid while the tensors' storages are resized in place,
    so a caller that keeps the same tensors can keep them too."""
    dsts, srcs, strided = [], [], []
    for param, full in zip(layout.params, fulls):
        if full is None:
            continue
        # a flat region of a strided tensor is no view of it: use a contiguous copy
        target = full
        if not full.is_contiguous() and into_storage:
            target = full.contiguous()
        elif not full.is_contiguous():  # filled, then copied into ``full`` at the end
            target = torch.empty(full.shape, dtype=full.dtype, device=full.device)
            strided.append((full, target))
        for storage_piece, full_piece in _pairs(param, target, flat2d, ranks):
            dst, src = (storage_piece, full_piece) if into_storage else (full_piece, storage_piece)
            dsts.append(dst)
            srcs.append(src)
    return dsts, srcs, strided


def _copy(
    layout: BucketLayout,
    fulls: Sequence[torch.Tensor | None],
    flat2d: torch.Tensor,
    ranks: range,
    into_storage: bool,
) -> None:
    dsts, srcs, strided = copy_views(layout, fulls, flat2d, ranks, into_storage)
    if dsts:
        torch._foreach_copy_(dsts, srcs)
    for full, target in strided:
        full.copy_(target)


def pack_rank(
    layout: BucketLayout, rank: int, fulls: Sequence[torch.Tensor | None], out: torch.Tensor
) -> None:
    """Write ``rank``'s regions of the full tensors into its flat storage ``out``
    (``None`` entries are left as they are: zeros after ``pack_all``)."""
    _copy(layout, fulls, out.view(1, -1), range(rank, rank + 1), into_storage=True)


def _chunk_cat_fits(fulls: Sequence[torch.Tensor | None], dtype: torch.dtype) -> bool:
    """Every tensor present, contiguous, of one dtype (torch 2.15's ``_chunk_cat`` takes
    no mix) that ``dtype`` holds exactly: then ``torch._chunk_cat`` writes the same bits
    as the per-piece copies."""
    if not fulls or fulls[0] is None:
        return False
    source = fulls[0].dtype
    if source != dtype and source not in _WIDENS_EXACTLY.get(dtype, ()):
        return False
    return all(
        [full is not None and full.dtype == source and full.is_contiguous() for full in fulls]
    )


#: narrower float dtypes each wider one holds exactly (a cast is a plain widening)
_WIDENS_EXACTLY = {
    torch.float32: (torch.bfloat16, torch.float16),
    torch.float64: (torch.float32, torch.bfloat16, torch.float16),
}


def pack_all(layout: BucketLayout, fulls: Sequence[torch.Tensor | None], out: torch.Tensor) -> None:
    """Write every rank's storage into the rows of ``out`` ([W, S]); padding is zeroed."""
    if layout.chunked_rows and _chunk_cat_fits(fulls, out.dtype):
        torch._chunk_cat(fulls, 0, layout.world_size, out=out)  # one op, as FSDP2 packs
        return
    if not layout.dense or any(full is None for full in fulls):
        out.zero_()
    _copy(layout, fulls, out, range(layout.world_size), into_storage=True)


def unpack(
    layout: BucketLayout,
    gathered: torch.Tensor,
    fulls: Sequence[torch.Tensor | None],
) -> None:
    """Fill the full tensors from the gathered storage of all ranks ([W, S]).

    ``None`` entries are tensors that already alias ``gathered`` (no copy needed).
    """
    _copy(layout, fulls, gathered, range(layout.world_size), into_storage=False)


def gathered_alias(layout: BucketLayout, index: int, gathered: torch.Tensor) -> torch.Tensor | None:
    """The full parameter as a view of the flat gathered buffer (W padded shards, or a
    ragged bucket's extents back to back), when its pieces sit there contiguously and
    in order (FlatShard, Owned, W = 1); otherwise None."""
    param = layout.params[index]
    pieces = []  # (position in the gathered buffer, first flat element of the param, numel)
    for rank, start in enumerate(layout.rank_starts):
        position = start + param.offsets[rank]
        for region in param.regions[rank]:
            if region.flat:
                pieces.append((position, region.offsets[0], region.numel))
            elif region.numel == param.numel:
                pieces.append((position, 0, region.numel))
            elif region.numel:
                return None  # a box smaller than the parameter is strided in it
            position += region.numel
    pieces = [p for p in pieces if p[2]]
    if not pieces:
        return None
    start = pieces[0][0]
    covered = 0
    for position, first, numel in pieces:
        if first != covered or position != start + covered:
            return None
        covered += numel
    if covered != param.numel:
        return None
    return gathered.reshape(-1)[start : start + param.numel].view(param.shape)
