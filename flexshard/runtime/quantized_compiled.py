"""The quantized all-gather's codec compiled (``torch.compile``, inductor): a rank's whole
payload encoded by one fused graph, and every rank's payload decoded by one fused graph
straight into the full parameters (no float32 temporary, no separate copy).

When: ``flexshard.quant.compiled``'s mode. In ``"auto"`` (the default) on CPU, for buckets
of at least ``AUTO_MIN_NUMEL`` elements, from the second call of each shape on (the first
runs eagerly, so a one-off unshard never pays a compile); ``"on"``: always; ``"off"``: never.
Only buckets whose tiles are whole format blocks compile: inductor 2.13's CPU loop split
rewrites an index ``j // 32`` over a range it does not divide (70 columns) as whole blocks
and never writes the rest, so partial edge tiles stay eager.

Never a different result: the first call of each compiled function is checked against the
eager codec, bit for bit (a decode twice, into destinations prefilled with NaN and then 1.0,
so an element the graph did not write shows; an encode on the storage and on -2 times it);
a mismatch or an error retires it (a warning) and the eager codec serves from then on.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence

import torch

from ..placements.packing import full_view, storage_shape
from ..quant import FP8Blockwise, QuantFormat, packed_nbytes, scale_shape
from ..quant.codec import packed_scale_offset
from ..quant.compiled import (
    AUTO_MIN_NUMEL,
    CompiledFn,
    compile_mode,
    compiled_fn,
    failed,
    first_call,
    intern,
    traced,
)
from ..quant.fused import dequantize_fused, quantize_fused
from ..torch_internals import storage_id
from .quant_run import QuantRun

_FP8 = torch.float8_e4m3fn


def _storage_id(t: torch.Tensor | None) -> tuple[int, int, tuple, tuple] | None:
    """Which storage ``t`` views, and how (stable while the storage is resized)."""
    if t is None:
        return None
    return (storage_id(t), t.storage_offset(), tuple(t.shape), t.stride())


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """The codec's contract: NaN at the same places, every other element bit for bit."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    nan = want.isnan()
    if not torch.equal(got.isnan(), nan):
        return False
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
    return torch.equal(got.view(ints).masked_fill(nan, 0), want.view(ints).masked_fill(nan, 0))


def _encode_body(runs: Sequence[QuantRun], fmt: QuantFormat, nbytes: int) -> Callable:
    tail = nbytes - (runs[-1].start + packed_nbytes(runs[-1].shape, fmt))

    def encode(storage: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        # the payload typed float8_e4m3fn (the caller views it as bytes), the codes written
        # straight into it; the few scale bytes are the caller's to copy in (``_scales_in``)
        traced()
        pieces, scales = [], []
        for run in runs:  # packed one after the other, as QuantizedGather plans them
            x = storage[run.offset : run.offset + run.numel].view(run.shape)
            data, scale = quantize_fused(x, fmt)
            gap = packed_scale_offset(run.numel) - run.numel + scale.numel() * scale.element_size()
            pieces += [data.reshape(-1), storage.new_zeros(gap, dtype=_FP8)]
            scales.append(scale)
        pieces.append(storage.new_zeros(tail, dtype=_FP8))
        return torch.cat(pieces), scales

    return encode


def _whole_param(shape: tuple[int, ...], blocks: list[tuple[int, slice, object]]):
    """``(GR, GC, R, C)`` when ``blocks`` (run index, tile slice, CopyBlock), sorted by
    their first tile, are a 2-D parameter's whole tiles in row-major order (then its full
    tensor is one expression of them, written by one loop); else None."""
    if len(shape) != 2:
        return None
    r, c = blocks[0][2].region.sizes[-2:]
    if shape[0] % r or shape[1] % c:
        return None
    gr, gc, cursor = shape[0] // r, shape[1] // c, 0
    for _, _, block in blocks:
        (row, col), (rows, cols) = block.region.offsets, block.grid
        row, col = row // r, col // c
        if tuple(block.region.sizes) != (r, c) or row * gc + col != cursor:
            return None
        if rows > 1 and (col, cols) != (0, gc) or col + cols > gc:
            return None
        cursor += rows * cols
    return (gr, gc, r, c) if cursor == gr * gc else None


def decode_plan(slices: Sequence[tuple], shapes: Sequence[tuple | None]) -> tuple:
    """Per present parameter: ``("whole", i, pieces, grid)`` (see ``_whole_param``) or
    ``("blocks", i, pieces)``; a piece is (run index, its tiles in the run, CopyBlock)."""
    per_param: dict[int, list] = {}
    for k, (_, run, *_rest) in enumerate(slices):
        for i, block in run.members:
            if shapes[i] is not None:
                first = block.region.offsets[-2:]
                per_param.setdefault(i, []).append((first, (k, run.tiles(block), block)))
    plan = []
    for i, pieces in sorted(per_param.items()):
        ordered = [piece for _, piece in sorted(pieces, key=lambda p: p[0])]
        grid = _whole_param(shapes[i], ordered)
        plan.append(("whole", i, tuple(ordered), grid) if grid else ("blocks", i, tuple(ordered)))
    return tuple(plan)


def _decode_body(plan: tuple, fmt: QuantFormat, dtype: torch.dtype) -> Callable:
    def decode(datas: list, scales: list, fulls: list) -> None:
        traced()
        for kind, i, pieces, *grid in plan:
            if kind == "whole":  # the whole parameter, given as (GR, R, GC, C): one loop
                gr, gc, r, c = grid[0]  # nest writes it, affine indices, nothing read back
                data = torch.cat([datas[k][tiles] for k, tiles, _ in pieces])
                scale = torch.cat([scales[k][tiles] for k, tiles, _ in pieces])
                values = dequantize_fused(data, scale, fmt, dtype).view(gr, gc, r, c)
                fulls[i].copy_(values.permute(0, 2, 1, 3))
                continue
            for k, tiles, block in pieces:
                values = dequantize_fused(datas[k][tiles], scales[k][tiles], fmt, dtype)
                full_view(block, fulls[i]).copy_(values.view(storage_shape(block)))

    return decode


class CompiledCodec:
    """A quantized bucket's compiled encode and decode (``QuantizedGather`` holds one):
    each runs the compiled graph where it may, else the eager codec it is given."""

    def __init__(
        self, fmt: QuantFormat, runs: list[list[QuantRun]], rank: int, nbytes: int, numel: int
    ) -> None:
        self.fmt, self.runs, self.rank, self.nbytes, self.numel = fmt, runs, rank, nbytes, numel
        r, c = fmt.block
        self.whole = all(
            run.tile[-2] % r == 0 and run.tile[-1] % c == 0 for rr in runs for run in rr
        )
        self._slices = tuple(  # per (rank, run): its data, scale bytes and end in the payload
            (rank_, run, run.start, run.start + packed_scale_offset(run.numel), end)
            for rank_, rank_runs in enumerate(runs)
            for run in rank_runs
            for end in [run.start + packed_nbytes(run.shape, fmt)]
        )
        self._own_slices = [s for s in self._slices if s[0] == rank]
        self._geometry = []  # per run: (byte offset, shape, strides) of its data and scales
        for rank_, run, start, scale_start, _ in self._slices:
            grid = scale_shape(run.shape, fmt)
            base = rank_ * nbytes
            self._geometry.append(
                (
                    (base + start, run.shape, _contiguous_strides(run.shape)),
                    (base + scale_start, grid, _contiguous_strides(grid)),
                )
            )
        self._ids: dict[Hashable, int] = {}  # a small tag -> the interned full key
        self._plans: dict[int, tuple] = {}  # decode key -> decode_plan
        self._args: tuple | None = None  # (storage ids, the last decode's inputs)

    def _key(self, tag: Hashable, build: Callable[[], Hashable]) -> int:
        """The id of this bucket's full key for ``tag`` (built, hashed and interned once)."""
        key_id = self._ids.get(tag)
        if key_id is None:
            key_id = self._ids[tag] = intern(build())
        return key_id

    def _wanted(self, key_id: int, device: torch.device) -> bool:
        mode = compile_mode()
        if mode == "off" or not self.whole:
            return False
        if mode == "auto":
            if device.type != "cpu" or self.numel < AUTO_MIN_NUMEL:
                return False
            return not first_call(key_id)
        return True

    # ---------------------------------------------------------------- encode
    def encode(
        self, storage: torch.Tensor, eager: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """This rank's payload, compiled when it may be (else ``eager(storage)``)."""
        own = self.runs[self.rank]
        if not own:
            return eager(storage)
        tag = ("encode", storage.dtype, storage.device, storage.numel())
        plan = tuple((run.offset, run.shape, run.start) for run in own)
        key_id = self._key(tag, lambda: (*tag, self.fmt, plan, self.nbytes))
        if not self._wanted(key_id, storage.device):
            return eager(storage)
        entry = compiled_fn(key_id, lambda: _encode_body(own, self.fmt, self.nbytes))
        if entry is None:
            return eager(storage)
        try:
            if entry.checked:
                return self._scales_in(*entry(storage))
            return self._checked_encode(entry, storage, eager)
        except Exception as err:  # noqa: BLE001 - any compile failure means: run eagerly
            failed(entry, "compiling the quantized encode raised", err)
            return eager(storage)

    def _scales_in(self, payload: torch.Tensor, scales: list[torch.Tensor]) -> torch.Tensor:
        """The compiled encode's payload as bytes, each run's scales copied into place."""
        payload = payload.view(torch.uint8)
        for (_, _, _, start, end), scale in zip(self._own_slices, scales):
            payload[start:end].copy_(scale.reshape(-1).view(torch.uint8))
        return payload

    def _checked_encode(self, entry: CompiledFn, storage: torch.Tensor, eager: Callable):
        want = eager(storage)
        other = storage * -2  # every data byte's sign and every scale change
        ok = torch.equal(self._scales_in(*entry(storage)), want)
        ok = ok and torch.equal(self._scales_in(*entry(other)), eager(other))
        entry.checked = True
        if not ok:
            failed(entry, f"its encode differed from the eager codec ({self.fmt})")
        return want

    # ---------------------------------------------------------------- decode
    def _views(self, gathered: torch.Tensor) -> tuple[list, list]:
        """Each run's fp8 data and scales (float32, or the E8M0 bytes) in ``gathered``, as
        strided views of the whole buffer (a few tensor ops per call, no Python shapes)."""
        flat = gathered.reshape(-1)
        base = flat.storage_offset()  # as_strided offsets count from the storage's start
        as_fp8 = flat.view(_FP8)
        fp32 = isinstance(self.fmt, FP8Blockwise)
        as_f32 = flat.view(torch.float32) if fp32 and base % 4 == 0 else None
        datas, scales = [], []
        for (data_at, data_shape, data_strides), (scale_at, grid, grid_strides) in self._geometry:
            datas.append(as_fp8.as_strided(data_shape, data_strides, base + data_at))
            if not fp32:
                scales.append(flat.as_strided(grid, grid_strides, base + scale_at))
            elif as_f32 is not None and scale_at % 4 == 0:
                scales.append(as_f32.as_strided(grid, grid_strides, (base + scale_at) // 4))
            else:  # a 4-byte view of a misaligned offset: a copy
                raw = flat[scale_at : scale_at + math.prod(grid) * 4].clone()
                scales.append(raw.view(torch.float32).view(grid))
        return datas, scales

    def decode(
        self,
        gathered: torch.Tensor,
        fulls: list[torch.Tensor | None],
        eager: Callable[[torch.Tensor, list[torch.Tensor | None]], None],
    ) -> None:
        """Every rank's payload (``[W, nbytes]``) into ``fulls``, compiled when it may be."""
        full = next(f for f in fulls if f is not None)
        shapes = tuple(None if f is None else tuple(f.shape) for f in fulls)
        tag = ("decode", full.dtype, full.device, shapes)
        key_id = self._key(tag, lambda: (*tag, self.fmt, self.nbytes, self._slices))
        if not self._wanted(key_id, full.device):
            return eager(gathered, fulls)
        plan = self._plans.get(key_id)
        if plan is None:
            plan = self._plans[key_id] = decode_plan(self._slices, shapes)
        entry = compiled_fn(key_id, lambda: _decode_body(plan, self.fmt, full.dtype))
        if entry is None:
            return eager(gathered, fulls)
        try:
            args = self._decode_args(key_id, plan, gathered, fulls)
            if entry.checked:
                entry(*args)
            else:
                self._checked_decode(entry, gathered, fulls, eager, args)
        except Exception as err:  # noqa: BLE001 - any compile failure means: run eagerly
            failed(entry, "compiling the quantized decode raised", err)
            eager(gathered, fulls)
        return None

    def _decode_args(self, key_id: int, plan: tuple, gathered: torch.Tensor, fulls: list):
        """The compiled decode's inputs: views of ``gathered`` and of the full parameters.
        Kept while both sit on the same storages: the runtime frees and reallocates the
        memory of one storage per tensor (``storage.resize_``), which views follow, so a
        step's decodes skip rebuilding ~10 views each (tens of microseconds a call)."""
        ids = (key_id, _storage_id(gathered), *(_storage_id(f) for f in fulls))
        if self._args is not None and self._args[0] == ids:
            return self._args[1]
        datas, scales = self._views(gathered)
        # a whole parameter goes in as (GR, R, GC, C): 4 loops, no div/mod per vector
        # (detached: the full parameter may require grad; the decode is not tracked)
        targets = [None if f is None else f.detach() for f in fulls]
        for kind, i, _, *grid in plan:
            if kind == "whole":
                gr, gc, r, c = grid[0]
                targets[i] = targets[i].view(gr, r, gc, c)
        args = (datas, scales, targets)
        if all(storage_id(scale) == ids[1][0] for scale in scales):  # no copies
            self._args = (ids, args)
        return args

    @torch.no_grad()
    def _checked_decode(self, entry, gathered, fulls, eager, args) -> None:
        want = [None if f is None else torch.empty_like(f) for f in fulls]
        eager(gathered, want)
        ok = True
        for fill in (math.nan, 1.0):  # an element left unwritten shows in one of them
            for f in fulls:
                if f is not None:
                    f.fill_(fill)
            entry(*args)
            ok = ok and all(f is None or same_bits(f, w) for f, w in zip(fulls, want))
        entry.checked = True
        if not ok:
            failed(entry, f"its decode differed from the eager codec ({self.fmt})")
            for f, w in zip(fulls, want):
                if f is not None:
                    f.copy_(w)
