"""The quantized all-gather of a BlockShard bucket: each rank quantizes only its own
tiles, and one uint8 all-gather carries ``[fp8 payload | pad | scales]`` of every rank."""

from __future__ import annotations

import math

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from ..placements import BucketLayout, CopyBlock, Region
from ..placements.packing import full_view, storage_shape, storage_view
from ..quant import QuantFormat, QuantizedTensor, dequantize, quantize, scale_shape

ALIGN = 16


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
        hook = register_optimizer_step_post_hook(_count_step)
        _step_hook.append(hook)
    return _optimizer_steps[0]


def _count_step(*_args: object) -> None:
    _optimizer_steps[0] += 1


class QuantizedGather:
    """Encodes this rank's storage into its payload and decodes every rank's payload
    into full parameters. The payload is cached until the storage may have changed
    (``version``, from the bucket), so the backward re-gather sends exactly the bytes
    the forward sent: one quantization per step, no drift."""

    def __init__(self, layout: BucketLayout, fmt: QuantFormat, rank: int) -> None:
        self.layout = layout
        self.fmt = fmt
        self.rank = rank
        # per rank, per parameter, per copy block: first scale in the rank's scale section
        self._scale_offsets: list[list[list[int]]] = []
        counts = []
        for r in range(layout.world_size):
            cursor, per_param = 0, []
            for param in layout.params:
                offsets = []
                for block in param.copy_blocks[r]:
                    offsets.append(cursor)
                    cursor += math.prod(scale_shape(storage_shape(block), fmt))
                per_param.append(offsets)
            self._scale_offsets.append(per_param)
            counts.append(cursor)
        self._runs = [self._plan_runs(r) for r in range(layout.world_size)]
        scale_size = torch.empty(0, dtype=fmt.scale_dtype).element_size()
        self.data_nbytes = _align(layout.shard_numel)
        self.nbytes = _align(self.data_nbytes + max(counts, default=0) * scale_size)
        self._cached: tuple[object, torch.Tensor] | None = None
        self.encodes = 0  # quantizations done (a test counts one per step)

    def _plan_runs(self, rank: int) -> list[tuple[int, int, tuple[int, ...], int, list]]:
        """Per run of consecutive copy blocks of ``rank`` with one tile shape: (storage
        offset, numel, tile shape, first scale, its (parameter index, block)s). A run
        quantizes as one batch of tiles, bit for bit as block by block (tiles are
        independent) and with one set of ops."""
        runs: list[list] = []
        for i, param in enumerate(self.layout.params):
            for k, block in enumerate(param.copy_blocks[rank]):
                if not block.numel:
                    continue
                tile = storage_shape(block)[-2:]  # quantized weights are 2-D or batched
                last = runs[-1] if runs else None
                if last is not None and last[2] == tile and last[0] + last[1] == block.offset:
                    last[1] += block.numel  # its scales follow the run's, in the same order
                    last[4].append((i, block))
                else:
                    first = self._scale_offsets[rank][i][k]
                    runs.append([block.offset, block.numel, tile, first, [(i, block)]])
        return [tuple(run) for run in runs]

    def _sections(self, payload: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        data = payload[: self.layout.shard_numel].view(torch.float8_e4m3fn)
        scales = payload[self.data_nbytes :].view(self.fmt.scale_dtype)
        return data, scales

    def encode(self, storage: torch.Tensor, version: object) -> torch.Tensor:
        """This rank's payload: its tiles quantized in place of the full tensor."""
        if self._cached is not None and self._cached[0] == version:
            return self._cached[1]
        payload = torch.zeros(self.nbytes, dtype=torch.uint8, device=storage.device)
        data, scales = self._sections(payload)
        for offset, numel, tile, first, _ in self._runs[self.rank]:
            q = quantize(storage[offset : offset + numel].view(-1, *tile), self.fmt)
            data[offset : offset + numel].copy_(q.data.view(-1))
            scales[first : first + q.scale.numel()].copy_(q.scale.reshape(-1))
        self._cached = (version, payload)
        self.encodes += 1
        return payload

    def _rank_blocks(self, gathered: torch.Tensor, index: int):
        """Per rank and copy block of parameter ``index``: (block, its QuantizedTensor)."""
        param = self.layout.params[index]
        for rank in range(self.layout.world_size):
            data, scales = self._sections(gathered[rank])
            for k, block in enumerate(param.copy_blocks[rank]):
                tiles = storage_view(block, data)
                shape = scale_shape(tiles.shape, self.fmt)
                offset = self._scale_offsets[rank][index][k]
                scale = scales[offset : offset + math.prod(shape)].view(shape)
                yield block, QuantizedTensor(tiles, scale, self.fmt)

    def decode(self, gathered: torch.Tensor, fulls: list[torch.Tensor | None]) -> None:
        """Dequantize every rank's payload ([W, nbytes]) into the full parameters: one
        dequantize per run of tiles, then one foreach copy of every block into place
        (a quantized bucket has one dtype)."""
        present = [full for full in fulls if full is not None]
        if not present:
            return
        dtype = present[0].dtype
        dsts, srcs = [], []
        for rank in range(self.layout.world_size):
            data, scales = self._sections(gathered[rank])
            for offset, numel, tile, first, members in self._runs[rank]:
                tiles = data[offset : offset + numel].view(-1, *tile)
                shape = scale_shape(tiles.shape, self.fmt)
                scale = scales[first : first + math.prod(shape)].view(shape)
                values = dequantize(QuantizedTensor(tiles, scale, self.fmt), dtype).view(-1)
                for i, block in members:
                    if fulls[i] is not None:
                        start = block.offset - offset
                        piece = values[start : start + block.numel].view(storage_shape(block))
                        dsts.append(full_view(block, fulls[i]))
                        srcs.append(piece)
        if dsts:
            torch._foreach_copy_(dsts, srcs)

    def quantized(self, gathered: torch.Tensor, index: int) -> QuantizedTensor:
        """Parameter ``index`` as one QuantizedTensor (fp8 data and the scale grid of the
        whole parameter), for FP8 GEMMs that read the quantized weight directly."""
        shape = self.layout.params[index].shape
        device = gathered.device
        data = torch.empty(shape, dtype=torch.float8_e4m3fn, device=device)
        scale = torch.empty(scale_shape(shape, self.fmt), dtype=self.fmt.scale_dtype, device=device)
        for block, q in self._rank_blocks(gathered, index):
            full_view(block, data.view(torch.uint8)).copy_(q.data.view(torch.uint8))
            full_view(_scale_block(block, self.fmt), scale).copy_(q.scale)
        return QuantizedTensor(data, scale, self.fmt)
