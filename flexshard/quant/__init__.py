"""Block-quantization codecs (FP8 128x128 blockwise, OCP MXFP8) as pure tensor functions."""

from flexshard.quant.codec import (
    QuantizedTensor,
    dequantize,
    pack,
    packed_nbytes,
    quantize,
    scale_shape,
    unpack,
)
from flexshard.quant.formats import E4M3_MAX, MXFP8, FP8Blockwise, QuantFormat

__all__ = [
    "E4M3_MAX",
    "FP8Blockwise",
    "MXFP8",
    "QuantFormat",
    "QuantizedTensor",
    "dequantize",
    "pack",
    "packed_nbytes",
    "quantize",
    "scale_shape",
    "unpack",
]
