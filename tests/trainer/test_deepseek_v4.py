"""DeepSeek-V4 (``deepseek_v4``, ``DeepseekV4ForCausalLM``) from a folder saved by
transformers' own class, under DeepSeek's key names (``attn.wq_a``,
``ffn.experts.N.w1``, ``hc_attn_fn``, a top-level ``head.weight``): 4 layers, one of
each attention kind (sliding window with sinks; compressed sparse, its indexer keeping 3
entries of 4 tokens; heavily compressed, entries of 8 tokens) and a second sparse one,
hash-routed layers first and last, learned routing between, 3 hyper-connection streams,
YaRN on the compressed branches, the SwiGLU clamp low enough to bite. Sinks, the
compressors' position biases, the hyper-connection offsets and scales, the selection
bias and the hash table are drawn (the class's init leaves them zero or one, which
would hide a wrong use of any).

- the folder is the model: logits within 1e-5 of transformers', the first loss within
  1e-4 of transformers' loss on the same batch;
- the export of the model loaded at W = 2 is the folder's tensors bit for bit and loads
  in transformers with every key, its logits identical;
- W = 2 and 3 against one process (slow);
- what is not built is a ConfigError naming the key.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flexshard.checkpoint.hf_safetensors import load_hf_safetensors
from flexshard.testing import run_distributed
from flexshard.trainer.config import config_from_dict
from flexshard.trainer.models.deepseek_v4 import DeepseekV4Transformer
from flexshard.trainer.models.hf_adapter import hf_keys
from flexshard.trainer.models.layers import loss_fn

from .test_model_families import _tensors, from_folder
from .test_qwen3_5 import _load_and_export

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.deepseek_v4")

LAYER_TYPES = [
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
    "compressed_sparse_attention",
]
MLP_LAYER_TYPES = ["hash_moe", "moe", "moe", "hash_moe"]
SHAPE = {
    "vocab_size": 320,
    "hidden_size": 32,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "head_dim": 16,
    "q_lora_rank": 24,
    "num_experts_per_tok": 2,
    "n_routed_experts": 5,
    "layer_types": LAYER_TYPES,
    "mlp_layer_types": MLP_LAYER_TYPES,
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    "hc_mult": 3,
    "hc_sinkhorn_iters": 5,
    "sliding_window": 6,
    "o_groups": 2,
    "o_lora_rank": 12,
    "index_n_heads": 2,
    "index_head_dim": 12,
    "index_topk": 3,
    "partial_rotary_factor": 0.5,
    "max_position_embeddings": 256,
    "rope_parameters": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "num_nextn_predict_layers": 0,
    "swiglu_limit": 0.5,
}
# drawn wide: (mean, std) by the end of the name
DRAWN = {
    "sinks": (0.0, 1.0),
    "position_bias": (0.0, 1.0),
    ".base": (0.0, 0.5),
    "hc_base": (0.0, 0.5),
    ".scale": (1.0, 0.5),
    "hc_scale": (1.0, 0.5),
    "norm.weight": (1.0, 0.3),
    "layernorm.weight": (1.0, 0.3),
}


def hf_model(folder: Path) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.DeepseekV4Config(**SHAPE)
    model = transformers.DeepseekV4ForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            for end, (mean, std) in DRAWN.items():
                if name.endswith(end):
                    param.normal_(mean, std)
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.5)
            if name.endswith("tid2eid"):  # two distinct experts per token
                buffer.copy_(
                    torch.stack([torch.randperm(5, generator=gen)[:2] for _ in range(320)])
                )
    model.save_pretrained(folder, max_shard_size="40KB")
    return model


def tokens(seq: int = 37) -> torch.Tensor:
    return torch.randint(0, 320, (2, seq), generator=torch.Generator().manual_seed(1))


def loaded(folder: Path) -> DeepseekV4Transformer:
    m = config_from_dict(from_folder(folder)).model
    model = DeepseekV4Transformer(m).eval()
    state = model.state_dict()
    load_hf_safetensors(folder, state, hf_keys(list(state), m))
    return model


def test_folder_keys_are_deepseeks_own(tmp_path):
    hf_model(tmp_path)
    names = set(_tensors(tmp_path))
    for key in (
        "head.weight",
        "model.layers.0.attn.wq_a.weight",
        "model.layers.0.attn.attn_sink",
        "model.layers.0.ffn.experts.4.w1.weight",
        "model.layers.0.ffn.gate.tid2eid",
        "model.layers.1.ffn.gate.bias",
        "model.layers.1.attn.indexer.compressor.ape",
        "model.layers.2.attn.compressor.wgate.weight",
        "model.layers.3.hc_ffn_fn",
        "model.hc_head.hc_fn",
    ):
        assert key in names, key


def test_folder_is_the_model_logits_and_loss(tmp_path):
    reference = hf_model(tmp_path)
    m = config_from_dict(from_folder(tmp_path)).model
    assert (m.attention, m.layer_types) == ("deepseek_v4", LAYER_TYPES)
    assert m.deepseek_v4.mlp_layer_types == MLP_LAYER_TYPES
    assert (m.rope_scaling.type, m.rope_scaling.factor) == ("yarn", 4.0)
    assert (m.moe.score_func, m.moe.balance) == ("sqrtsoftplus", "bias")
    model = loaded(tmp_path)
    batch = tokens()
    with torch.no_grad():
        ours = model(batch)
        out = reference(batch, labels=batch)
        loss = loss_fn(ours[:, :-1], batch[:, 1:]).item()
    gap = (ours - out.logits).abs().max().item()
    print(f"deepseek_v4: logits within {gap:.1e}, loss {loss} vs {out.loss.item()}")
    assert gap <= 1e-5, gap
    assert abs(loss - out.loss.item()) <= 1e-4


def test_export_reloads_exact(tmp_path):
    reference = hf_model(tmp_path)
    run_distributed(_load_and_export, 2, str(tmp_path), timeout=300)
    exported = tmp_path / "export"
    original, got = _tensors(tmp_path), _tensors(exported)
    assert set(got) == set(original)
    # the hash tables come back as exact floats (torch's safetensors consolidation
    # writes one dtype); transformers reads them into its int64 buffers
    assert [k for k, v in original.items() if not torch.equal(got[k], v)] == []
    config = json.loads((exported / "config.json").read_text())
    assert (config["model_type"], config["layer_types"]) == ("deepseek_v4", LAYER_TYPES)
    back, info = transformers.DeepseekV4ForCausalLM.from_pretrained(
        exported, output_loading_info=True
    )
    assert all(not v for v in info.values()), info
    with torch.no_grad():
        assert torch.equal(back.eval()(tokens()).logits, reference(tokens()).logits)
