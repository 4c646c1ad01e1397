"""The quantized all-gather of a BlockShard bucket: each rank quantizes only its own
tiles, and one uint8 all-gather carries every rank's payload: ``quant.pack``'s
``[fp8 data | pad | scales]`` of each run of its tiles (the one pack/unpack format of
flexshard, so the codec and the wire agree by construction)."""

from __future__ import annotations

import math

import torch

from ..placements import Region
from ..placements.layout import CopyBlock
from ..placements.packing import full_view, storage_shape
from ..quant import (
    QuantFormat,
    QuantizedTensor,
    packed_nbytes,
    quantize,
    scale_shape,
    unpack,
)
from ..quant.codec import dequantized_values, pack_into
from ..torch_internals import register_global_optimizer_step_post_hook
from .gather import ShardedCollective
from .quant_run import QuantRun
from .quantized_compiled import CompiledCodec
from .storage import BucketStorage

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
