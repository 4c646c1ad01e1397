"""DeepSeek-V4 from a folder as DeepSeek publishes it (``deepseek_v4_published``: its own
config.json keys, FP8 weights in 8x8 tiles with ue8m0 scales under ``weight_scale_inv``
and ``scale``, FP4 experts, no ``model.`` prefix, an MTP depth), against transformers'
own load of that same folder (on CPU transformers dequantizes on load, as the trainer
does):

- DeepSeek's config.json keys read as the [model] of the config.json transformers saves,
  and of transformers' own folding of them;
- the folder is the model: every dequantized weight bit for bit transformers', logits
  within 1e-5 and the first loss within 1e-4 of transformers';
- a run from it at W = 3 (rows that cut tiles) exports an unquantized folder, without
  ``mtp.*``, that transformers loads with every key and computes as the published one;
- regions of any box, tiles cut at the edges, read as the whole tensor does; what the
  format does not allow is a ValueError naming the key.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from flexshard.checkpoint.hf_dequantize import BlockScaled, read_dequantized
from flexshard.checkpoint.hf_safetensors import HFKey, load_hf_safetensors, stored_tensors
from flexshard.runtime.dtensor.chunks import RegionTensor
from flexshard.testing import run_distributed
from flexshard.trainer.checkpointing.checkpoints import hf_load_notes
from flexshard.trainer.config import ConfigError, config_from_dict
from flexshard.trainer.config.hf_config import folder_quantization, model_fields
from flexshard.trainer.models.deepseek_v4 import DeepseekV4Transformer
from flexshard.trainer.models.hf_adapter import hf_keys, published_layout

from .deepseek_v4_published import E2M1, published_config, quantize_fp4, write_published
from .test_deepseek_v4 import SHAPE, hf_model, tokens
from .test_model_families import _tensors, from_folder, matches_transformers
from .test_qwen3_5 import _load_and_export

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.deepseek_v4")

# DeepSeek's num_hash_layers can only say "the first N layers"
HASH_FIRST = {"mlp_layer_types": ["hash_moe", "moe", "moe", "moe"]}


def published(tmp_path: Path) -> tuple[torch.nn.Module, Path]:
    """transformers' model (unquantized) and the folder DeepSeek would publish of it."""
    reference = hf_model(tmp_path / "saved", **HASH_FIRST)
    write_published(tmp_path / "saved", tmp_path / "published")
    return reference, tmp_path / "published"


def loaded(folder: Path) -> tuple[DeepseekV4Transformer, dict[str, torch.Tensor]]:
    m = config_from_dict(from_folder(folder)).model
    model = DeepseekV4Transformer(m).eval()
    state = model.state_dict()
    keys = hf_keys(list(state), m, published=published_layout(folder, m))
    load_hf_safetensors(folder, state, keys, quantization=folder_quantization(folder))
    return model, state


def _transformers_fold(own: dict) -> dict:
    """transformers' reading of a config.json: its DeepseekV4Config, saved."""
    folded = transformers.DeepseekV4Config(**{k: v for k, v in own.items() if k != "model_type"})
    return {**folded.to_dict(), "quantization_config": None}


@pytest.mark.parametrize(
    "left_out",
    [(), ("compress_rate_csa", "compress_rate_hca"), ("qk_rope_head_dim",), ("rope_scaling",)],
)
def test_deepseeks_config_keys_read_as_transformers_folds_them(left_out):
    """DeepSeek's own keys (and, where it leaves one out, transformers' default) give
    the [model] of transformers' reading of them."""
    saved = transformers.DeepseekV4Config(**{**SHAPE, **HASH_FIRST}).to_dict()
    own = published_config(saved, (8, 8))
    assert {"compress_ratios", "num_hash_layers", "qk_rope_head_dim"} <= set(own)
    assert not {"layer_types", "mlp_layer_types", "compress_rates"} & set(own)
    if not left_out:  # the folder transformers saves of the same model
        assert model_fields(own) == model_fields(saved)
    for key in left_out:
        del own[key]
    ours = model_fields(own)
    assert ours == model_fields(_transformers_fold(own))
    if left_out:
        assert ours != model_fields(saved)


def test_published_folder_is_transformers_load_of_it(tmp_path):
    original, folder = published(tmp_path)
    model, state = loaded(folder)
    reference, info = transformers.DeepseekV4ForCausalLM.from_pretrained(
        folder, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    theirs = reference.eval().state_dict()
    layer = "model.layers.{}."
    pairs = {  # FP8 under weight_scale_inv (even layers) and scale (odd), FP4 experts
        "layers.0.attn.wq_a.weight": "0.self_attn.q_a_proj.weight",
        "layers.1.attn.wo_a.weight": "1.self_attn.o_a_proj.weight",
        "layers.1.attn.indexer.wq_b.weight": "1.self_attn.compressor.indexer.q_b_proj.weight",
        "layers.2.ffn.shared_experts.w2.weight": "2.mlp.shared_experts.down_proj.weight",
        "layers.3.ffn.experts.w2": "3.mlp.experts.down_proj",
        "layers.1.attn.compressor.wkv.weight": "1.self_attn.compressor.kv_proj.weight",
    }
    pairs = {ours: f"model.layers.{hf}" for ours, hf in pairs.items()}
    pairs["tok_embeddings.weight"] = "model.embed_tokens.weight"
    pairs["hc_head.hc_fn"] = "model.hc_head.hc_fn"
    assert [ours for ours, hf in pairs.items() if not torch.equal(state[ours], theirs[hf])] == []
    gate_up = theirs[layer.format(1) + "mlp.experts.gate_up_proj"]
    assert torch.equal(state["layers.1.ffn.experts.w1"], gate_up[:, :16])
    assert torch.equal(state["layers.1.ffn.experts.w3"], gate_up[:, 16:])
    # the quantization bit: these are not the unquantized weights
    unquantized = original.state_dict()[layer.format(0) + "self_attn.q_a_proj.weight"]
    assert not torch.equal(state["layers.0.attn.wq_a.weight"], unquantized)
    batch = tokens()
    matches_transformers("deepseek_v4 published", model, reference, batch)


def test_run_from_it_exports_an_unquantized_folder_transformers_loads(tmp_path):
    _, folder = published(tmp_path)
    # the lines rank 0 prints at load
    notes = hf_load_notes(folder)
    assert len(notes) == 2 and "FP8 in tiles of (8, 8), experts fp4" in notes[0], notes
    assert notes[1].startswith(f"{folder}: its 3 multi-token-prediction tensors (mtp.*)")
    run_distributed(_load_and_export, 3, str(folder), timeout=600)
    exported = folder / "export"
    names = set(_tensors(exported))
    assert "model.layers.0.attn.wq_a.weight" in names and "head.weight" in names
    assert [n for n in names if "mtp" in n or "scale_inv" in n or n.endswith(".scale")] == []
    config = json.loads((exported / "config.json").read_text())
    assert "quantization_config" not in config and "expert_dtype" not in config
    assert config["num_nextn_predict_layers"] == 0
    back, info = transformers.DeepseekV4ForCausalLM.from_pretrained(
        exported, output_loading_info=True
    )
    assert all(not v for v in info.values()), info
    source = transformers.DeepseekV4ForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(back.eval()(tokens()).logits, source.eval()(tokens()).logits)


# ---------------------------------------------------------------------- the format
def _fp8_folder(tmp_path: Path, shape, block, scale_dtype) -> tuple[Path, torch.Tensor]:
    """One FP8 weight with one scale per tile, and its whole dequantized value."""
    gen = torch.Generator().manual_seed(0)
    codes = (torch.randn(shape, generator=gen) * 100).to(torch.float8_e4m3fn)
    grid = (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))
    scale = torch.exp2(torch.randint(-8, 8, grid, generator=gen).float())
    full = scale.repeat_interleave(block[0], 0)[: shape[0]]
    whole = codes.float() * full.repeat_interleave(block[1], 1)[:, : shape[1]]
    tensors = {"w.weight": codes, "w.scale": scale.to(scale_dtype)}
    save_file(tensors, str(tmp_path / "a.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w.weight": "a.safetensors", "w.scale": "a.safetensors"}})
    )
    return tmp_path, whole


def _regions(shape, boxes) -> RegionTensor:
    pieces = [((o, s), torch.full(s, float("nan"))) for o, s in boxes]
    return RegionTensor(torch.Size(shape), pieces, True, torch.float32, torch.device("cpu"))


# rows of 200 at W = 3 (67, 67, 66) and boxes cutting 128x128 tiles anywhere
BOXES = [((0, 0), (67, 300)), ((67, 0), (67, 300)), ((134, 5), (66, 290)), ((130, 250), (3, 50))]


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float8_e8m0fnu, torch.uint8])
def test_fp8_regions_read_as_the_whole_tensor(scale_dtype, tmp_path):
    stored_dtype = torch.float32 if scale_dtype == torch.float32 else torch.float8_e8m0fnu
    folder, whole = _fp8_folder(tmp_path, (200, 300), (128, 128), stored_dtype)
    if scale_dtype == torch.uint8:  # ue8m0 scales kept as bytes
        path = folder / "a.safetensors"
        tensors = _tensors(folder)
        tensors["w.scale"] = tensors["w.scale"].view(torch.uint8)
        save_file(tensors, str(path))
    chunks = _regions((200, 300), BOXES)
    read_dequantized("w.weight", chunks, stored_tensors(folder), BlockScaled((128, 128), "fp8"))
    for (o, s), view in chunks.pieces:
        assert torch.equal(view, whole[o[0] : o[0] + s[0], o[1] : o[1] + s[1]])


def test_fp4_regions_read_as_the_whole_tensor(tmp_path):
    weight = torch.randn(7, 80, generator=torch.Generator().manual_seed(2))
    packed, scale = quantize_fp4(weight)  # 80 columns: tiles of 32, 32 and 16
    codes = torch.stack((packed.view(torch.uint8) & 15, packed.view(torch.uint8) >> 4), -1)
    values = torch.tensor(E2M1)[codes.flatten(-2).long()]
    whole = values * scale.float().repeat_interleave(32, 1)[:, :80]
    tensors = {"e.weight": packed, "e.weight_scale_inv": scale}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    boxes = [((0, 0), (3, 80)), ((3, 0), (4, 33)), ((3, 33), (4, 40)), ((3, 73), (4, 7))]
    chunks = _regions((7, 80), boxes)
    read_dequantized("e.weight", chunks, stored_tensors(tmp_path), BlockScaled((128, 128), "fp4"))
    for (o, s), view in chunks.pieces:
        assert torch.equal(view, whole[o[0] : o[0] + s[0], o[1] : o[1] + s[1]])
    with pytest.raises(ValueError, match="'e.weight' is stored I8 .* expert_dtype is 'fp8'"):
        read_dequantized("e.weight", chunks, stored_tensors(tmp_path), BlockScaled((8, 8), "fp8"))


@pytest.mark.parametrize(
    "change, message",
    [
        ("no scale", "'w.weight' is stored F8_E4M3 but the folder has no 'w.weight_scale_inv'"),
        ("other grid", r"'w.scale' is a \(1, 1\) F32 tensor: 'w.weight' \(20, 30\) in tiles"),
        ("other shape", r"'w.weight' holds a \(20, 30\) F8_E4M3 tensor, the model expects"),
        ("no quantization_config", "'w.weight' is stored F8_E4M3 .* no quantization_config"),
    ],
)
def test_what_does_not_fit_the_format_is_named(change, message, tmp_path):
    folder, _ = _fp8_folder(tmp_path, (20, 30), (8, 8), torch.float32)
    tensors = _tensors(folder)
    if change == "no scale":
        del tensors["w.scale"]
    if change == "other grid":
        tensors["w.scale"] = torch.ones(1, 1)
    save_file(tensors, str(folder / "a.safetensors"))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": dict.fromkeys(tensors, "a.safetensors")})
    )
    shape = (20, 31) if change == "other shape" else (20, 30)
    state = {"w": torch.zeros(shape)}
    fmt = None if change == "no quantization_config" else BlockScaled((8, 8), "fp8")
    with pytest.raises(ValueError, match=message):
        load_hf_safetensors(folder, state, {"w": HFKey("w.weight")}, quantization=fmt)


def test_quantization_config_other_than_deepseek_v4_fp8_is_refused(tmp_path):
    hf_model(tmp_path, **HASH_FIRST)
    config = json.loads((tmp_path / "config.json").read_text())
    fp8 = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    with pytest.raises(ConfigError, match="quantization_config.fmt = 'e5m2'"):
        model_fields({**config, "quantization_config": {**fp8, "fmt": "e5m2"}})
    with pytest.raises(ConfigError, match="expert_dtype = 'fp6'"):
        model_fields({**config, "quantization_config": fp8, "expert_dtype": "fp6"})
    llama = {"model_type": "llama", "quantization_config": fp8}
    with pytest.raises(ConfigError, match="'deepseek_v4' folders only, not 'llama'"):
        model_fields(llama)
