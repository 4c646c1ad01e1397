"""Block-quantization codecs (FP8 128x128 blockwise, OCP MXFP8) as pure tensor functions,
eager (``codec``) and as fused graphs for ``torch.compile`` (``fused``; when: ``compiled``)."""

from flexshard.quant.codec import (
    QuantizedTensor,
    dequantize,
    pack,
    packed_nbytes,
    quantize,
    scale_shape,
    unpack,
)
from flexshard.quant.compiled import compile_mode, set_compile_mode
from flexshard.quant.formats import E4M3_MAX, MXFP8, FP8Blockwise, QuantFormat

__all__ = [
    "E4M3_MAX",
    "FP8Blockwise",
    "MXFP8",
    "QuantFormat",
    "QuantizedTensor",
    "compile_mode",
    "dequantize",
    "pack",
    "packed_nbytes",
    "quantize",
    "scale_shape",
    "set_compile_mode",
    "unpack",
]
