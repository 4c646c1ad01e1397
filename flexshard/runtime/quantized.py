"""The quantized all-gather of a BlockShard bucket: each rank quantizes only its own
tiles, and one uint8 all-gather carries every rank's payload: ``quant.pack``'s
``[fp8 data | pad | scales]`` of each run of its tiles (the one pack/unpack format of
flexshard, so the codec and the wire agree by construction).

``QuantRun``: one run of the quantized all-gather's plan; the eager gather below makes
the plan and ``CompiledCodec`` compiles a codec per plan.

``CompiledCodec``: the quantized all-gather's codec compiled (``torch.compile``,
inductor): a rank's whole payload encoded by one fused graph, and every rank's payload
decoded by one fused graph straight into the full parameters (no float32 temporary, no
separate copy).

When: ``flexshard.quant.compiled``'s mode. In ``"auto"`` (the default) on CPU, for buckets
of at least ``AUTO_MIN_NUMEL`` elements, from the second call of each shape on (the first
runs eagerly, so a one-off unshard never pays a compile); ``"on"``: always; ``"off"``: never.
Only buckets whose tiles are whole format blocks compile: inductor 2.13's CPU loop split
rewrites an index ``j // 32`` over a range it does not divide (70 columns) as whole blocks
and never writes the rest, so partial edge tiles stay eager.

Never a different result: the first call of each compiled function is checked against the
eager codec, bit for bit (a decode twice, into destinations prefilled with NaN and then 1.0,
so an element the graph did not write shows; an encode on the storage and on -2 times it);
a mismatch or an error retires it (a warning) and the eager codec serves from then on."""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch

from ..placements import Region
from ..placements.layout import CopyBlock
from ..placements.packing import full_view, storage_shape
from ..quant import (
    FP8Blockwise,
    QuantFormat,
    QuantizedTensor,
    packed_nbytes,
    quantize,
    scale_shape,
    unpack,
)
from ..quant.codec import dequantized_values, pack_into, packed_scale_offset
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
from ..torch_internals import register_global_optimizer_step_post_hook, storage_id
from .gather import ShardedCollective
from .storage import BucketStorage


@dataclass(frozen=True)
class QuantRun:
    """Consecutive copy blocks of one rank with one tile shape: quantized as one batch
    of tiles (bit for bit as block by block: tiles are independent) and sent as one
    ``quant.pack`` buffer at byte ``start`` of the rank's payload."""

    offset: int  # in the rank's storage
    numel: int
    tile: tuple[int, ...]
    start: int
    members: tuple[tuple[int, CopyBlock], ...]  # (parameter index, block), in order

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.numel // math.prod(self.tile), *self.tile)

    def tiles(self, block: CopyBlock) -> slice:
        """Which of the run's tiles are ``block``'s."""
        size = math.prod(self.tile)
        first = (block.offset - self.offset) // size
        return slice(first, first + block.numel // size)


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


ALIGN = 16
#: the most elements the eager decode dequantizes at once: its float32 temporaries stay
#: under 16 MiB (a few tile rows of a block) however large the bucket
DECODE_CHUNK = 1 << 22


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _scale_block(block: CopyBlock, fmt: QuantFormat) -> CopyBlock:
    """The block's place in the parameter's grid of scales (tiles start on whole
    format blocks, so a tile's scales are a box of the scale grid)."""
    r, c = fmt.block
    region = block.region
    *lead, row, col = region.offsets
    *lead_sizes, rows, cols = region.sizes
    scaled = Region((*lead, row // r, col // c), (*lead_sizes, -(-rows // r), -(-cols // c)))
    return CopyBlock(0, scaled, block.grid)


_optimizer_steps = [0]
_step_hook: list[object] = []


def optimizer_steps() -> int:
    """How many ``torch.optim`` steps this process has taken (counted by a global
    post-step hook, registered on first use)."""
    if not _step_hook:
        hook = register_global_optimizer_step_post_hook(_count_step)
        _step_hook.append(hook)
    return _optimizer_steps[0]


def _count_step(*_args: object) -> None:
    _optimizer_steps[0] += 1


class QuantizedGather(ShardedCollective):
    """The collective of a quantized bucket (a ``Collective``): encodes this rank's
    storage into its payload and decodes every rank's payload into full parameters.
    A payload is ``quant.pack`` of each run of tiles, one after the other, zero padded
    to the same size on every rank. It is cached until the storage may have changed
    (``version``, from the bucket), so the backward re-gather sends exactly the bytes
    the forward sent: one quantization per step, no drift. Gradients and state dicts
    stay full precision. The gathered bytes are freed once decoded, unless ``keep_codes``
    (``Bucket.keep_quantized_params``): then they stay while the bucket is unsharded,
    for ``quantized`` to read."""

    fixed_dtype = True  # the fp8 codes are of this dtype's values
    payload_uses_version = True  # the cached encoding is keyed by it

    def __init__(self, store: BucketStorage, fmt: QuantFormat) -> None:
        super().__init__(store)
        layout = store.layout
        self.layout = layout
        self.fmt = fmt
        self.rank = store.rank
        self._runs = [self._plan_runs(r) for r in range(layout.world_size)]
        ends = [
            runs[-1].start + packed_nbytes(runs[-1].shape, fmt) if runs else 0
            for runs in self._runs
        ]
        # the fp8 data of the largest shard and the most scales of any rank, so the
        # payload of a bucket whose tiles divide W carries nothing else
        scale_size = torch.empty(0, dtype=fmt.scale_dtype).element_size()
        scales = max((self._scale_count(runs) for runs in self._runs), default=0)
        least = _align(layout.shard_numel) + scales * scale_size
        self.nbytes = _align(max([least, *ends]))
        self._cached: tuple[object, torch.Tensor] | None = None
        self.encodes = 0  # quantizations done (a test counts one per step)
        self.keep_codes = False
        self.compiled = CompiledCodec(fmt, self._runs, self.rank, self.nbytes, layout.numel)

    # ------------------------------------------------------------ Collective
    def gather_buffer(self) -> torch.Tensor | None:
        world = self.layout.world_size
        return torch.empty(world * self.nbytes, dtype=torch.uint8, device=self.store.buffer.device)

    def full_base(self, index: int, gathered: torch.Tensor | None) -> torch.Tensor | None:
        return None  # the gathered buffer is bytes: each parameter decodes its own

    def payload(self, version: object, gathered: torch.Tensor | None) -> torch.Tensor:
        return self.encode(self.store.buffer, version)

    def copy_out(self, gathered: torch.Tensor | None, owned: list[torch.Tensor | None]) -> bool:
        assert gathered is not None
        self.decode(gathered.view(self.layout.world_size, -1), owned)
        return not self.keep_codes  # kept: ``quantized`` reads the fp8 codes from it

    # ------------------------------------------------------------ codec
    def _plan_runs(self, rank: int) -> list[QuantRun]:
        """The runs of ``rank``'s copy blocks, in storage order, and where each run's
        packed bytes start in the rank's payload."""
        runs: list[list] = []  # [offset, numel, tile, members]
        for i, param in enumerate(self.layout.params):
            for block in param.copy_blocks[rank]:
                if not block.numel:
                    continue
                tile = storage_shape(block)[-2:]  # quantized weights are 2-D or batched
                last = runs[-1] if runs else None
                if last is not None and last[2] == tile and last[0] + last[1] == block.offset:
                    last[1] += block.numel
                    last[3].append((i, block))
                else:
                    runs.append([block.offset, block.numel, tile, [(i, block)]])
        planned, cursor = [], 0
        for offset, numel, tile, members in runs:
            run = QuantRun(offset, numel, tile, cursor, tuple(members))
            cursor += packed_nbytes(run.shape, self.fmt)
            planned.append(run)
        return planned

    def _scale_count(self, runs: list[QuantRun]) -> int:
        return sum(math.prod(scale_shape(run.shape, self.fmt)) for run in runs)

    def _unpack(self, payload: torch.Tensor, run: QuantRun) -> QuantizedTensor:
        """The run's tiles and scales in a rank's payload (views of it)."""
        size = packed_nbytes(run.shape, self.fmt)
        return unpack(payload[run.start : run.start + size], run.shape, self.fmt)

    def encode(self, storage: torch.Tensor, version: object) -> torch.Tensor:
        """This rank's payload: its tiles quantized in place of the full tensor (by the
        compiled codec where it serves, else eagerly: the same bytes)."""
        if self._cached is not None and self._cached[0] == version:
            return self._cached[1]
        payload = self.compiled.encode(storage, self.encode_eager)
        self._cached = (version, payload)
        self.encodes += 1
        return payload

    def encode_eager(self, storage: torch.Tensor) -> torch.Tensor:
        """``encode`` by the eager codec: each run quantized and packed into place."""
        payload = torch.empty(self.nbytes, dtype=torch.uint8, device=storage.device)
        cursor = 0
        for run in self._runs[self.rank]:
            q = quantize(storage[run.offset : run.offset + run.numel].view(run.shape), self.fmt)
            cursor = run.start + packed_nbytes(run.shape, self.fmt)
            pack_into(q, payload[run.start : cursor])
        payload[cursor:].zero_()
        return payload

    def decode(self, gathered: torch.Tensor, fulls: list[torch.Tensor | None]) -> None:
        """Dequantize every rank's payload ([W, nbytes]) into the full parameters (by the
        compiled codec where it serves, else eagerly: the same bits)."""
        if any(full is not None for full in fulls):
            self.compiled.decode(gathered, fulls, self.decode_eager)

    def decode_eager(self, gathered: torch.Tensor, fulls: list[torch.Tensor | None]) -> None:
        """``decode`` by the eager codec: each block dequantized and copied into place,
        casting as it copies, in pieces of at most ``DECODE_CHUNK`` elements: the float32
        values alive at once are bounded, whatever the bucket's size (the whole bucket's
        would be twice its bf16 parameters)."""
        present = [full for full in fulls if full is not None]
        if not present:
            return
        dtype = present[0].dtype
        for rank in range(self.layout.world_size):
            for run in self._runs[rank]:
                q = self._unpack(gathered[rank], run)
                for i, block in run.members:
                    if fulls[i] is not None:
                        self._decode_block(q, run, block, full_view(block, fulls[i]), dtype)

    def _decode_block(
        self,
        q: QuantizedTensor,
        run: QuantRun,
        block: CopyBlock,
        dst: torch.Tensor,
        dtype: torch.dtype,
    ) -> None:
        """One block's tiles of ``q`` into ``dst`` (``full_view``), a few tile rows at a
        time (a block is one tile, or a grid of them stored row after row)."""
        shape = storage_shape(block)
        tiles = run.tiles(block)
        rows = shape[0] if block.grid != (1, 1) else 1
        per_row = (tiles.stop - tiles.start) // rows
        step = max(1, DECODE_CHUNK // (per_row * math.prod(run.tile)))
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            t0, t1 = tiles.start + r0 * per_row, tiles.start + r1 * per_row
            values = dequantized_values(
                QuantizedTensor(q.data[t0:t1], q.scale[t0:t1], self.fmt), dtype
            )
            if rows == 1:
                dst.copy_(values.view(shape))
            else:
                dst[r0:r1].copy_(values.view(r1 - r0, *shape[1:]))

    def quantized_params(
        self, bucket: str, gathered: torch.Tensor | None
    ) -> dict[str, QuantizedTensor]:
        """Every parameter as ``quantized`` reads it from the kept gathered codes."""
        if gathered is None or not gathered.untyped_storage().size():
            raise RuntimeError(
                f"bucket '{bucket}' freed its fp8 codes after decoding them: call "
                "bucket.keep_quantized_params() before it unshards to read them"
            )
        gathered = gathered.view(self.layout.world_size, -1)
        return {p.fqn: self.quantized(gathered, i) for i, p in enumerate(self.layout.params)}

    def quantized(self, gathered: torch.Tensor, index: int) -> QuantizedTensor:
        """Parameter ``index`` as one QuantizedTensor (fp8 data and the scale grid of the
        whole parameter), for FP8 GEMMs that read the quantized weight directly."""
        shape = self.layout.params[index].shape
        device = gathered.device
        data = torch.empty(shape, dtype=torch.float8_e4m3fn, device=device)
        scale = torch.empty(scale_shape(shape, self.fmt), dtype=self.fmt.scale_dtype, device=device)
        for rank in range(self.layout.world_size):
            for run in self._runs[rank]:
                q = self._unpack(gathered[rank], run)
                for i, block in run.members:
                    if i != index:
                        continue
                    tiles = run.tiles(block)
                    block_shape = storage_shape(block)
                    codes = q.data[tiles].reshape(block_shape).view(torch.uint8)
                    full_view(block, data.view(torch.uint8)).copy_(codes)
                    scales = q.scale[tiles].reshape(scale_shape(block_shape, self.fmt))
                    full_view(_scale_block(block, self.fmt), scale).copy_(scales)
        return QuantizedTensor(data, scale, self.fmt)
