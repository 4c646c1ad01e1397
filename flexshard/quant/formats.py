"""Block-quantization formats: frozen, validated descriptions of how a tensor is tiled and scaled.

A format only describes the encoding; :mod:`flexshard.quant.codec` does the work. Tiles cover
the last two dims of a tensor (leading dims are a batch, e.g. experts); ``block = (r, c)`` is
the tile's rows x columns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

__all__ = ["FP8Blockwise", "MXFP8", "QuantFormat", "E4M3_MAX"]

# Largest finite float8_e4m3fn value (0x7E); the format has no inf, so overflow saturates here.
E4M3_MAX = 448.0

_ROUNDINGS = ("floor", "rceil")


def _check_block(block: object) -> tuple[int, int]:
    # bool is an int subclass; (True, 32) is almost surely a bug, so reject it too.
    if (
        not isinstance(block, (tuple, list))
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) for b in block)
    ):
        raise ValueError(f"block must be a pair of positive ints (rows, cols), got {block!r}")
    if block[0] <= 0 or block[1] <= 0:
        raise ValueError(f"block sizes must be positive, got {tuple(block)}")
    return (int(block[0]), int(block[1]))


@dataclass(frozen=True)
class FP8Blockwise:
    """DeepSeek-V3-style weight quantization: one fp32 scale per ``block`` tile.

    Per tile: ``scale = max(amax, 1e-4) / 448`` in fp32, where ``amax`` is the largest *finite*
    ``|x|`` of the tile (NaN/inf are ignored so one bad value does not poison the scale). With
    ``pow2_scale`` the scale is rounded up to a power of two (DeepSeek's "ue8m0" scales): a
    little precision is lost but ``x / scale`` becomes an exact exponent shift.
    """

    #: the runtime collective of a bucket quantized with this format (by name)
    collective: ClassVar[str] = "quantized"
    block: tuple[int, int] = (128, 128)
    pow2_scale: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "block", _check_block(self.block))
        if not isinstance(self.pow2_scale, bool):
            raise ValueError(f"pow2_scale must be a bool, got {self.pow2_scale!r}")

    @property
    def scale_dtype(self) -> torch.dtype:
        return torch.float32


@dataclass(frozen=True)
class MXFP8:
    """OCP Microscaling (MX v1.0) MXFP8: float8_e4m3fn elements, one E8M0 scale per block.

    ``rounding`` picks the shared exponent ``e`` from the block's ``amax``:

    * ``"floor"`` (OCP v1.0 section 6.3): ``e = floor(log2(amax)) - 8`` (8 = emax of e4m3), so
      ``amax / 2^e`` lies in [256, 512) and values above 448 saturate;
    * ``"rceil"``: ``e = ceil(log2(amax / 448))``, the smallest scale with nothing saturating
      (the rule of NVIDIA's cuBLAS/``cvt.rp.ue8m0`` path and torchao's ``RCEIL``).

    Both are clamped to the E8M0 range [-127, 127]. Any block shape is allowed: ``(1, 32)`` is
    the layout MXFP8 GEMMs read; square ``(32, 32)`` tiles serve both W and W^T.
    """

    #: the runtime collective of a bucket quantized with this format (by name)
    collective: ClassVar[str] = "quantized"
    block: tuple[int, int] = (32, 32)
    rounding: Literal["floor", "rceil"] = "floor"

    def __post_init__(self) -> None:
        object.__setattr__(self, "block", _check_block(self.block))
        if self.rounding not in _ROUNDINGS:
            raise ValueError(f"rounding must be one of {_ROUNDINGS}, got {self.rounding!r}")

    @property
    def scale_dtype(self) -> torch.dtype:
        return torch.float8_e8m0fnu


QuantFormat = FP8Blockwise | MXFP8
