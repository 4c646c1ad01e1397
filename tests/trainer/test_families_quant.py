"""The quantized all-gather (an MXFP8 32x32 BlockShard bucket, as test_tp's) on the
Qwen3 and DeepSeek-V3 debug models, a Qwen3.5, a Qwen3.5-MoE and a DeepSeek-V4 at W = 2:
every matrix of the blocks in the bucket (Qwen3's q/k/v/o and MLP; MLA's five
projections, the router, each expert of the stacks, the shared expert; Gated DeltaNet's
projections, the gated attention's, the shared expert's one-row gate; DeepSeek-V4's
hyper-connection matrices, low-rank q/o projections, compressors' and indexer's
matrices), norms, the embedding, the depthwise conv kernels and DeepSeek-V4's compressor
position biases (``ape``) beside it in Shard(0). Shapes that are not whole tiles (MLA's
kv_a_proj_with_mqa: 32 latent + 8 rotated-key rows; Qwen3's 176-row MLP; Gated
DeltaNet's 88-row in_proj_qkv; DeepSeek-V4's 15-row hyper-connection matrices) take
partial edge tiles, quantized on their own: they work, no padding.

Against one process whose master weights train while the forward uses their
quantize-dequantize (the same tiles), as test_quantized_bucket_under_tp: losses within
1e-5 relative."""

from __future__ import annotations

from dataclasses import replace

import pytest
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import flexshard as fs
from flexshard.quant import dequantize, quantize
from flexshard.testing import run_distributed
from flexshard.trainer.config import ModelConfig, config_from_dict, load_config
from flexshard.trainer.models.model import build_model, init_weights
from tests.helpers import tp_cases as tc

from .test_deepseek_v4 import V4_MODEL
from .test_qwen3_5 import QWEN3_5_MODEL
from .test_qwen3_5_moe import QWEN3_5_MOE_MODEL
from .test_tp import QUANT

STEPS = 3
#: Qwen3.5 and Qwen3.5-MoE of their tests' layouts (no debug configs of their own)
SIZES = {"vocab_size": 256, "dim": 32, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2}
QWEN3_5 = {**QWEN3_5_MODEL, **SIZES}
QWEN3_5_MOE = {**QWEN3_5_MOE_MODEL, **SIZES}
DEEPSEEK_V4 = {**V4_MODEL, "vocab_size": 256}
FAMILIES = {"qwen3_5": QWEN3_5, "qwen3_5_moe": QWEN3_5_MOE, "deepseek_v4": DEEPSEEK_V4}
CONFIGS = ("qwen3_debug", "deepseek_v3_debug", *FAMILIES)
#: a parameter of each bucket whose rows are not whole 32-row tiles
PARTIAL = {
    "qwen3_debug": "layers.0.feed_forward.w1.weight",  # 176 rows
    "deepseek_v3_debug": "layers.0.attention.kv_a_proj_with_mqa.weight",  # 32 + 8 rows
    "qwen3_5": "layers.0.attention.in_proj_qkv.weight",  # 2 * 24 + 40 rows
    "qwen3_5_moe": "layers.0.feed_forward.experts.w1",  # 24 rows an expert
    "deepseek_v4": "layers.0.hc_attn_fn",  # 15 rows: 3 pre, 3 post, 3 x 3 comb
}


def _model_config(name: str) -> ModelConfig:
    """The debug config's model; DeepSeek-V3's without MTP (its loss is the trainer's,
    not ``tc.loss_of``; its matrices are those of a block)."""
    if name in FAMILIES:
        return config_from_dict({"model": FAMILIES[name]}).model
    return replace(load_config(f"configs/{name}.toml").model, mtp_layers=0)


def _quantized(model: nn.Module) -> list[str]:
    """The bucket's parameters: every matrix and expert stack of the blocks (Gated
    DeltaNet's depthwise conv kernels [C, 1, K] are no stack of matrices, DeepSeek-V4's
    position biases no matrix: beside)."""
    return [
        n
        for n, p in model.named_parameters()
        if p.ndim >= 2 and n.startswith("layers.") and not n.endswith(("conv1d.weight", ".ape"))
    ]


def _run(rank: int, world_size: int) -> dict[str, list[float]]:
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
    out = {}
    for name in CONFIGS:
        model = build_model(_model_config(name))
        init_weights(model, tc.SEED)
        quantized = _quantized(model)
        rest = [n for n, _ in model.named_parameters() if n not in quantized]
        specs = [
            fs.BucketSpec(quantized, fs.BlockShard((32, 32)), name="quant", quant=QUANT),
            fs.BucketSpec(rest, fs.Shard(0), name="rest"),
        ]
        model = fs.flex_shard(model, mesh=mesh, buckets=specs)
        out[name] = tc.train(model, mesh, STEPS)[0]
    return out


def _reference(name: str, quant: bool) -> list[float]:
    """One process: the master weights train; the forward uses the QDQ of the bucket's."""
    cfg = _model_config(name)

    def qdq(model: nn.Module) -> None:
        quantized = set(_quantized(model))
        for key, p in model.named_parameters():
            if quant and key in quantized:
                p.copy_(dequantize(quantize(p, QUANT), p.dtype))

    return tc.quantized_reference(cfg, 2, STEPS, qdq)  # tc.train's batches


@pytest.fixture(scope="module")
def results() -> list[dict[str, list[float]]]:
    return run_distributed(_run, 2, timeout=600)


@pytest.mark.parametrize("name", CONFIGS)
def test_quantized_gather_on_the_families(results, name) -> None:
    model = build_model(_model_config(name))
    partial = dict(model.named_parameters())[PARTIAL[name]]
    assert PARTIAL[name] in _quantized(model) and partial.shape[0] % 32, partial.shape
    expected = _reference(name, quant=True)
    # the quantization shows: without it the losses leave the tolerance
    assert _reference(name, quant=False) != pytest.approx(expected, rel=1e-5)
    for by_name in results:
        assert by_name[name] == pytest.approx(expected, rel=1e-5), name
