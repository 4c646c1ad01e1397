"""Pre-quantized Hugging Face folders read into a float model, dequantized as they are
read: the block-scaled FP8 format DeepSeek publishes (``quantization_config.quant_method
= "fp8"``: e4m3 weights, one scale per ``weight_block_size`` tile under
``<module>.weight_scale_inv`` or, as in DeepSeek-V4-Flash, ``<module>.scale``; fp32 scales,
or power-of-two ones with ``scale_fmt = "ue8m0"``) and its FP4 experts (``expert_dtype =
"fp4"``: e2m1 codes packed two a byte, low nibble first, in an int8 tensor of half the
columns, one scale per 1x32 block). Tensors the folder stores unquantized (norms, the
embedding, DeepSeek-V4's compressor projections) carry no scale and are read as they are.

Memory stays bounded: each rank reads, per tensor, only the tiles around the regions it
stores, dequantizes them and copies them in, one region at a time; the folder's other
tensors are read alike, as stored (``read_stored``), since torch's own safetensors reader
does not know every dtype these folders hold (``F8_E8M0`` scales). What does not fit
the format (a quantized weight without its scale, a scale grid of another shape, a
weight of another shape) is a ValueError naming the key."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import safe_open

from ..quant.codec import QuantizedTensor, dequantize
from ..quant.formats import MXFP8, FP8Blockwise
from ..runtime.dtensor.chunks import RegionTensor

# e2m1's sixteen codes: bit 3 the sign, then two exponent bits and one mantissa bit
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FP4_BLOCK = (1, 32)  # the FP4 experts' scale tile
SCALE_SUFFIXES = ("weight_scale_inv", "scale")
_FLOAT_SCALES = ("F32", "BF16", "F16")
_POW2_SCALES = ("F8_E8M0", "U8")  # ue8m0: byte b is 2^(b - 127)


@dataclass(frozen=True)
class BlockScaled:
    """The FP8 format of a folder's ``quantization_config``."""

    block: tuple[int, int]  # weight_block_size: the FP8 weights' scale tile
    expert_dtype: str  # "fp8", or "fp4": routed experts packed as e2m1


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a folder, from its file's header."""

    file: str
    dtype: str  # safetensors' name: "F8_E4M3", "I8", "BF16", ...
    shape: tuple[int, ...]


def block_scaled(config: Mapping[str, Any]) -> BlockScaled | None:
    """The FP8 format a config.json's ``quantization_config`` describes (``expert_dtype``
    there or, as DeepSeek-V4 ships it, at the top level); None without one; a
    ValueError naming the key for what is not this format."""
    quant = config.get("quantization_config")
    if not quant:
        return None
    method = quant.get("quant_method")
    if method != "fp8":
        raise ValueError(
            f"quantization_config.quant_method = {method!r}: only block-scaled 'fp8' "
            "weights are dequantized on load"
        )
    if quant.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"quantization_config.fmt = {quant['fmt']!r}: 'e4m3' is read")
    block = quant.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and min(block) > 0):
        raise ValueError(
            f"quantization_config.weight_block_size = {block!r}: a pair of positive "
            "tile sizes is read (one scale per tile)"
        )
    scale_fmt = quant.get("scale_fmt", "float")
    if scale_fmt not in ("float", "ue8m0"):
        raise ValueError(f"quantization_config.scale_fmt = {scale_fmt!r}: 'float' or 'ue8m0'")
    expert_dtype = quant.get("expert_dtype", config.get("expert_dtype", "fp8"))
    if expert_dtype not in ("fp8", "fp4"):
        raise ValueError(f"expert_dtype = {expert_dtype!r}: 'fp8' or 'fp4' is read")
    return BlockScaled((int(block[0]), int(block[1])), expert_dtype)


def scale_name(name: str, stored: Mapping[str, StoredTensor]) -> str | None:
    """The scale of weight ``name`` (``<module>.weight``) in the folder, if it has one."""
    if not name.endswith(".weight"):
        return None
    stem = name.removesuffix(".weight")
    return next((f"{stem}.{s}" for s in SCALE_SUFFIXES if f"{stem}.{s}" in stored), None)


def is_quantized(name: str, stored: Mapping[str, StoredTensor], target: torch.dtype) -> bool:
    """Whether the folder's ``name`` is stored quantized (e4m3, or int8 codes read into
    a float tensor) or has a scale: what ``read_dequantized`` reads."""
    entry = stored.get(name)
    if entry is None:
        return False
    packed = entry.dtype in ("I8", "U8") and target.is_floating_point
    return entry.dtype.startswith("F8_") or packed or scale_name(name, stored) is not None


def _check(
    name: str, stored: Mapping[str, StoredTensor], shape: torch.Size, fmt: BlockScaled
) -> tuple[str, tuple[int, int], bool]:
    """(scale name, its tile, whether FP4-packed) of the quantized weight ``name``, or a
    ValueError naming what does not fit."""
    entry = stored[name]
    scale = scale_name(name, stored)
    fp4 = entry.dtype in ("I8", "U8")
    if entry.dtype != "F8_E4M3" and not fp4:
        what = f"has a scale ('{scale}') but is stored {entry.dtype}"
        raise ValueError(f"'{name}' {what}: e4m3 or packed FP4 (int8) is dequantized")
    if fp4 and fmt.expert_dtype != "fp4":
        raise ValueError(
            f"'{name}' is stored {entry.dtype} (packed FP4) but the config's expert_dtype "
            f"is {fmt.expert_dtype!r}"
        )
    if scale is None:
        raise ValueError(
            f"'{name}' is stored {entry.dtype} but the folder has no "
            + " or ".join(f"'{name.removesuffix('.weight')}.{s}'" for s in SCALE_SUFFIXES)
        )
    rows, cols = entry.shape[0], entry.shape[-1] * (2 if fp4 else 1)
    if len(entry.shape) != 2 or (rows, cols) != tuple(shape):
        raise ValueError(
            f"'{name}' holds a {tuple(entry.shape)} {entry.dtype} tensor, the model "
            f"expects {tuple(shape)}" + (" (two FP4 codes a byte)" if fp4 else "")
        )
    block = FP4_BLOCK if fp4 else fmt.block
    grid = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    if stored[scale].shape != grid or stored[scale].dtype not in _FLOAT_SCALES + _POW2_SCALES:
        raise ValueError(
            f"'{scale}' is a {stored[scale].shape} {stored[scale].dtype} tensor: "
            f"'{name}' {(rows, cols)} in tiles of {block} needs one scale per tile {grid}"
        )
    return scale, block, fp4


def _fp4_values(packed: torch.Tensor) -> torch.Tensor:
    """Packed e2m1 codes (two a byte, low nibble first) -> float32, twice the columns."""
    codes = packed.view(torch.uint8)
    pairs = torch.stack((codes & 0xF, codes >> 4), dim=-1).flatten(-2)
    return torch.tensor(_E2M1)[pairs.long()]


def _scales(raw: torch.Tensor) -> torch.Tensor:
    """A folder's scales as float32 (ue8m0 bytes as their powers of two)."""
    if raw.dtype == torch.uint8:
        raw = raw.view(torch.float8_e8m0fnu)
    return raw.to(torch.float32)


def _tiles(
    weights: Any,
    scales: Any,
    name: str,
    scale: str,
    box: tuple[tuple[int, ...], tuple[int, ...]],
    block: tuple[int, int],
    fp4: bool,
) -> tuple[torch.Tensor, tuple[int, int]]:
    """The float32 values of the whole tiles around ``box`` of weight ``name`` (read
    from the open files ``weights`` and ``scales``) and the offset of ``box`` in them."""
    (r0, c0), (nr, nc) = box
    br, bc = block
    t0, t1 = r0 // br, -(-(r0 + nr) // br)
    u0, u1 = c0 // bc, -(-(c0 + nc) // bc)
    rows = slice(t0 * br, t1 * br)
    raw_scale = scales.get_slice(scale)[t0:t1, u0:u1]
    if fp4:
        packed = weights.get_slice(name)[rows, u0 * bc // 2 : u1 * bc // 2]
        values = _fp4_values(packed)
        per_col = _scales(raw_scale).repeat_interleave(bc, dim=1)[:, : values.shape[1]]
        values = values * per_col  # one scale per row's 32 columns (br = 1)
    else:
        codes = weights.get_slice(name)[rows, u0 * bc : u1 * bc]
        pow2 = raw_scale.dtype in (torch.uint8, torch.float8_e8m0fnu)
        kind = MXFP8(block=block) if pow2 else FP8Blockwise(block=block)
        grid_scale = raw_scale.view(torch.float8_e8m0fnu) if pow2 else _scales(raw_scale)
        values = dequantize(QuantizedTensor(codes.contiguous(), grid_scale.contiguous(), kind))
    return values, (r0 - t0 * br, c0 - u0 * bc)


def read_dequantized(
    name: str,
    chunks: RegionTensor,
    stored: Mapping[str, StoredTensor],
    fmt: BlockScaled,
) -> None:
    """Fill ``chunks`` (this rank's regions of weight ``name``) from the folder's
    quantized ``name``, dequantized to the chunks' dtype, one region at a time."""
    scale, block, fp4 = _check(name, stored, chunks.shape, fmt)
    with (
        safe_open(stored[name].file, framework="pt") as weights,
        safe_open(stored[scale].file, framework="pt") as scales,
        torch.no_grad(),
    ):
        for (offsets, sizes), view in chunks.pieces:
            box = (offsets, sizes)
            values, (dr, dc) = _tiles(weights, scales, name, scale, box, block, fp4)
            view.copy_(values[dr : dr + sizes[0], dc : dc + sizes[1]])


def read_stored(name: str, chunks: RegionTensor, stored: Mapping[str, StoredTensor]) -> None:
    """Fill ``chunks`` (this rank's regions of ``name``) from the folder's unquantized
    ``name``, cast to the chunks' dtype, one region at a time."""
    entry = stored.get(name)
    if entry is None:
        raise ValueError(f"'{name}' is missing from the folder")
    if entry.shape != tuple(chunks.shape):
        raise ValueError(
            f"'{name}' has shape {entry.shape}, the model expects {tuple(chunks.shape)}"
        )
    with safe_open(entry.file, framework="pt") as f, torch.no_grad():
        for (offsets, sizes), view in chunks.pieces:
            view.copy_(f.get_slice(name)[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))])
