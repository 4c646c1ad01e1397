"""A tiny DeepSeek-V4 folder in the layout DeepSeek publishes (DeepSeek-V4-Flash on the
Hub), written here from a folder transformers' ``DeepseekV4ForCausalLM`` saved: DeepSeek's
own config.json keys (``compress_ratios``, ``compress_rate_hca``, ``num_hash_layers``,
``qk_rope_head_dim``, a top-level ``rope_scaling``, ``expert_dtype``), no ``model.``
prefix (``embed.weight``, ``hc_head_fn``), the attention and shared-expert projections
in e4m3 with one power-of-two (ue8m0) scale per block, the routed experts packed FP4
(two e2m1 codes a byte, low nibble first, one ue8m0 scale per 1x32 block), the
compressors' and indexer's projections unquantized in bf16 as DeepSeek ships them, the
other tensors in bf16 (embedding, head, norms) or fp32, and one multi-token-prediction
depth (``mtp.0.*``). The quantization is written here from the format's definition; the
library only ever reads it."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

# e2m1's sixteen codes (bit 3 the sign)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FP8_NAMES = re.compile(
    r"\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123])\.weight$"
)
EXPERT_NAMES = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")
BF16_NAMES = re.compile(
    r"(^embed\.weight|^head\.weight|norm\.weight|\.compressor\.(wkv|wgate)\.weight|weights_proj\.weight)$"
)


def _pow2_scale(amax: torch.Tensor, top: float) -> torch.Tensor:
    """ue8m0: the smallest power of two with ``amax / scale <= top``."""
    return torch.exp2(torch.ceil(torch.log2(amax.clamp_min(1e-30) / top)))


def quantize_fp8(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes and a ue8m0 scale per ``block`` tile (partial edge tiles allowed)."""
    rows, cols = weight.shape
    r, c = block
    grid = (math.ceil(rows / r), math.ceil(cols / c))
    scale = torch.empty(grid)
    for i in range(grid[0]):
        for j in range(grid[1]):
            tile = weight[i * r : (i + 1) * r, j * c : (j + 1) * c]
            scale[i, j] = _pow2_scale(tile.abs().max(), 448.0)
    full = scale.repeat_interleave(r, 0)[:rows].repeat_interleave(c, 1)[:, :cols]
    return (weight / full).to(torch.float8_e4m3fn), scale.to(torch.float8_e8m0fnu)


def quantize_fp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed e2m1 (int8, half the columns) and a ue8m0 scale per 1x32 block."""
    rows, cols = weight.shape
    blocks = math.ceil(cols / 32)
    padded = torch.nn.functional.pad(weight, (0, blocks * 32 - cols)).view(rows, blocks, 32)
    scale = _pow2_scale(padded.abs().amax(-1), 6.0)
    values = (padded / scale[..., None]).reshape(rows, -1)[:, :cols]
    table = torch.tensor(E2M1)
    codes = (values[..., None] - table).abs().argmin(-1).to(torch.uint8)  # nearest code
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.view(torch.int8), scale.to(torch.float8_e8m0fnu)


def _name(saved: str) -> str:
    """transformers' saved name -> DeepSeek's published one."""
    name = saved.removeprefix("model.")
    name = {"embed_tokens.weight": "embed.weight"}.get(name, name)
    return re.sub(r"^hc_head\.hc_", "hc_head_", name)


_YARN = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow")


def published_config(saved: dict, block: tuple[int, int]) -> dict:
    """DeepSeek's own config.json for the model of transformers' ``saved`` one."""
    ratio = {
        "sliding_attention": 0,
        "compressed_sparse_attention": 4,
        "heavily_compressed_attention": 128,
    }
    config = {k: v for k, v in saved.items() if k not in ("layer_types", "mlp_layer_types")}
    for key in ("compress_rates", "rope_parameters", "partial_rotary_factor", "dtype"):
        config.pop(key, None)
    hash_layers = saved["mlp_layer_types"].index("moe")
    assert saved["mlp_layer_types"][:hash_layers] == ["hash_moe"] * hash_layers
    compress = saved["rope_parameters"]["compress"]
    return {
        **config,
        # one entry more than layers: DeepSeek lists its MTP depth's too
        "compress_ratios": [ratio[k] for k in saved["layer_types"]] + [0],
        "compress_rate_csa": saved["compress_rates"]["compressed_sparse_attention"],
        "compress_rate_hca": saved["compress_rates"]["heavily_compressed_attention"],
        "num_hash_layers": hash_layers,
        "qk_rope_head_dim": int(saved["head_dim"] * saved["partial_rotary_factor"]),
        "rope_scaling": {
            k: compress[k]
            for k in (
                "type",
                "factor",
                "original_max_position_embeddings",
                "beta_fast",
                "beta_slow",
            )
            if k in compress
        }
        | {"type": compress["rope_type"]},
        "num_nextn_predict_layers": 1,
        "torch_dtype": "bfloat16",
        "expert_dtype": "fp4",
        "quantization_config": {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "scale_fmt": "ue8m0",
            "weight_block_size": list(block),
        },
    }


def write_published(saved: Path, out: Path, block: tuple[int, int] = (8, 8)) -> dict:
    """The folder ``saved`` (``save_pretrained`` of a ``DeepseekV4ForCausalLM``) as DeepSeek
    publishes it, in ``out``; returns its tensors. Scales are named ``weight_scale_inv``
    in even layers, ``scale`` (DeepSeek-V4-Flash's name) elsewhere."""
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(saved.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for key in f.keys():
                tensors[_name(key)] = f.get_tensor(key)
    out_tensors: dict[str, torch.Tensor] = {}
    for name, value in tensors.items():
        layer = re.match(r"^layers\.(\d+)\.", name)
        stem = name.removesuffix(".weight")
        scale_name = (
            f"{stem}.weight_scale_inv" if layer and int(layer[1]) % 2 == 0 else f"{stem}.scale"
        )
        if EXPERT_NAMES.search(name):
            out_tensors[name], out_tensors[scale_name] = quantize_fp4(value)
        elif FP8_NAMES.search(name):
            out_tensors[name], out_tensors[scale_name] = quantize_fp8(value, block)
        elif BF16_NAMES.search(name):
            out_tensors[name] = value.to(torch.bfloat16)
        else:
            out_tensors[name] = value
    # one MTP depth: an extra block's attention projection and its own norms
    gen = torch.Generator().manual_seed(7)
    dim = tensors["embed.weight"].shape[1]
    mtp = torch.randn(2 * dim, dim, generator=gen)
    out_tensors["mtp.0.e_proj.weight"], out_tensors["mtp.0.e_proj.scale"] = quantize_fp8(mtp, block)
    out_tensors["mtp.0.enorm.weight"] = torch.ones(dim, dtype=torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    # two files and their index, as a sharded Hub folder
    names = sorted(out_tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        file = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: out_tensors[n].contiguous() for n in part}, str(out / file))
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    config = published_config(json.loads((saved / "config.json").read_text()), block)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out_tensors
