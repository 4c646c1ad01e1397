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
- ``flexshard-train --nproc 3`` with nothing but the folder trains and exports (slow);
- W = 2 (Shard(0), flat under Muon, owned, FSDP2) and W = 3 (Shard(0), the Muon
  placement, flat, block) against one process (slow);
- expert parallel (the learned- and hash-routed layers' clamped experts over the EP
  all-to-all) and pipeline parallel (the hc_mult streams between stages, the token ids
  on every stage) against one process at W = 2 and 4, and a checkpoint carried dp2 ->
  dp2 x ep2 -> pp2 -> dp2 continuing the one-process losses (slow); the stages run in
  one process compute the whole model bit for bit;
- tp2 against one process: each gradient after one backward (with and without
  sequence parallelism); 10 steps at W = 2, and dp2 x tp2 at W = 4 (without sequence
  parallelism, on FSDP2, under Muon) (slow);
- cp: logits and each gradient after one backward at cp2 and cp3 (slow) against one
  process, on sequences whose zig-zag chunks cut the compressors' windows; 10 steps at
  cp2 (and with full AC), cp3, dp2 x cp2, cp2 x tp2 and cp2 x pp2 (slow);
- the Muon rule for the new kinds; what is not built, or what the folder asks that the
  trainer does not compute, is a ConfigError naming the key.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from flexshard.checkpoint.hf_safetensors import load_hf_safetensors
from flexshard.testing import run_distributed
from flexshard.trainer.components.optimizers import build_optimizer
from flexshard.trainer.config import ConfigError, config_from_dict
from flexshard.trainer.config.hf_config import _mismatches, exported_config, model_fields
from flexshard.trainer.launch import main as train_main
from flexshard.trainer.models.deepseek_v4 import (
    ClampedExperts,
    DeepseekV4Transformer,
    clamped_swiglu,
)
from flexshard.trainer.models.hf_adapter import hf_keys
from flexshard.trainer.models.layers import loss_fn
from flexshard.trainer.models.model import init_weights
from flexshard.trainer.parallel.activation_checkpoint import apply_ac
from flexshard.trainer.parallel.context_parallel import apply_cp, split_sequence, zigzag_chunks
from flexshard.trainer.parallel.parallelize import checked_dims
from flexshard.trainer.parallel.pipeline import split_model
from flexshard.trainer.parallel.tensor_parallel import apply_tp
from flexshard.trainer.train import run, setup

from .test_model_families import _tensors, from_folder, matches_transformers
from .test_parallel_layouts import (
    LOSS_RTOL,
    MUON_RTOL,
    compare_with_single_process,
    layout_config,
    single_process,
    trained,
)
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


def hf_model(folder: Path, **shape) -> torch.nn.Module:
    """transformers' model of ``SHAPE`` (with ``shape``'s changes), saved in ``folder``."""
    torch.manual_seed(0)
    config = transformers.DeepseekV4Config(**{**SHAPE, **shape})
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
    expected = matches_transformers("deepseek_v4", model, reference, batch)
    # the indexer's choice matters: every entry attended, the logits are another model's
    with torch.no_grad():
        for layer in model.layers:
            if layer.attn.indexer is not None:
                layer.attn.indexer.topk = 100
        assert (model(batch) - expected).abs().max().item() > 1e-3


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


@pytest.mark.slow
def test_flexshard_train_with_only_the_folder(tmp_path):
    """``flexshard-train --nproc 3`` from the folder alone trains and exports a folder
    transformers loads with every key."""
    reference = hf_model(tmp_path / "hf")
    out = tmp_path / "run"
    train_main(
        ["--nproc", "3", "--checkpoint.initial_load_path", str(tmp_path / "hf")]
        + ["--checkpoint.initial_load_in_hf", "true", "--checkpoint.last_save_in_hf", "true"]
        + ["--training.steps", "3", "--training.seq_len", "16", "--job.dump_folder", str(out)]
        + ["--job.progress", "false", "--job.plot", "false", "--job.tensorboard", "false"]
    )
    trained_model, info = transformers.DeepseekV4ForCausalLM.from_pretrained(
        out / "hf", output_loading_info=True
    )
    assert all(not v for v in info.values()), info
    with torch.no_grad():
        moved = (trained_model.eval()(tokens()).logits - reference(tokens()).logits).abs()
    assert moved.max().item() > 1e-3  # it trained
    records = (out / "metrics.jsonl").read_text().splitlines()
    losses = [json.loads(line)["loss"] for line in records]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))


# ---------------------------------------------------------------------- layouts
# the folder's model as [model] keys on the byte tokenizer's 256 ids; the selection bias
# left at zero (bias_update_rate 0: the one-process reference steps no balance)
V4_MODEL = {
    "attention": "deepseek_v4",
    "dim": 32,
    "n_layers": 4,
    "n_heads": 4,
    "n_kv_heads": 1,
    "head_dim": 16,
    "q_lora_rank": 24,
    "partial_rotary_factor": 0.5,
    "norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "layer_types": LAYER_TYPES,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "deepseek_v4": {
        "hc_mult": 3,
        "hc_sinkhorn_iters": 5,
        "sliding_window": 6,
        "o_groups": 2,
        "o_lora_rank": 12,
        "compress_rate_csa": 4,
        "compress_rate_hca": 8,
        "index_n_heads": 2,
        "index_head_dim": 12,
        "index_topk": 3,
        "swiglu_limit": 0.5,
        "mlp_layer_types": MLP_LAYER_TYPES,
    },
    "moe": {
        "num_experts": 5,
        "top_k": 2,
        "expert_hidden": 16,
        "num_shared_experts": 1,
        "first_dense_layers": 0,
        "balance": "bias",
        "bias_update_rate": 0.0,
        "score_func": "sqrtsoftplus",
        "routed_scaling_factor": 1.5,
    },
}
# name: (world size, parallelism, other sections), each against one process
LAYOUTS = {
    "dp2": (2, {"dp_shard": 2}, {}),
    "dp2_flat_muon": (2, {"dp_shard": 2, "placement": "flat"}, {"training": {"optimizer": "muon"}}),
    "dp2_owned": (2, {"dp_shard": 2, "placement": "owned"}, {}),
    "dp2_fsdp2": (2, {"dp_shard": 2, "dp_backend": "fsdp2", "placement": "shard0"}, {}),
    "dp2_selective_ac": (2, {"dp_shard": 2}, {"activation_checkpoint": {"mode": "selective"}}),
    "dp3": (3, {"dp_shard": 3}, {}),
    "dp3_muon": (3, {"dp_shard": 3}, {"training": {"optimizer": "muon"}}),
    "dp3_flat_full_ac": (
        3,
        {"dp_shard": 3, "placement": "flat"},
        {"activation_checkpoint": {"mode": "full"}},
    ),
    "dp3_block": (3, {"dp_shard": 3, "placement": "block", "block": [8, 8]}, {}),
}
# the hyper-connections' pre and comb logits start with gradients at rounding level
# (1e-9 where the projections' are 1e-3: the streams start as copies of one embedding),
# which AdamW's normalised step turns into steps of up to a tenth of lr whose sign the
# reduction order decides: those parameters drift apart by up to 1.4e-3 in 8 steps
# (measured at W = 2 and 3; 1.9e-3 under Muon at W = 3) while the losses agree to 1e-7
HC_ATOL = {"param_atol": 3e-3}


# tensor parallel: the heads and output groups split, the shared key-and-value head,
# compressors, indexer, experts and hyper-connections replicated
TP_LAYOUTS = {
    "tp2": (2, {"tp": 2, "dp_shard": 1}, {}),
    "dp2xtp2_no_sp": (4, {"tp": 2, "dp_shard": 2, "sequence_parallel": False}, {}),
    "dp2xtp2_fsdp2": (4, {"tp": 2, "dp_shard": 2, "dp_backend": "fsdp2"}, {}),
    "dp2xtp2_muon": (4, {"tp": 2, "dp_shard": 2}, {"training": {"optimizer": "muon"}}),
}


# context parallel on sequences whose zig-zag chunks cut the compressors' windows (as
# CP_SEQUENCES below): alone at W = 2 and 3, with dp, tp and pp at W = 4
CP_LAYOUTS = {
    "cp2": (2, {"dp_shard": 1, "cp": 2}, {"training": {"seq_len": 20}}),
    # the blocks' recompute runs the gathers again, in the same order on every rank
    "cp2_full_ac": (
        2,
        {"dp_shard": 1, "cp": 2},
        {"training": {"seq_len": 20}, "activation_checkpoint": {"mode": "full"}},
    ),
    "cp3": (3, {"dp_shard": 1, "cp": 3}, {"training": {"seq_len": 18}}),
    "dp2xcp2": (4, {"dp_shard": 2, "cp": 2}, {"training": {"seq_len": 20}}),
    "cp2xtp2": (4, {"dp_shard": 1, "cp": 2, "tp": 2}, {"training": {"seq_len": 20}}),
    "cp2xpp2": (4, {"dp_shard": 1, "cp": 2, "pp": 2}, {"training": {"seq_len": 20}}),
}


def _config(folder: str, name: str):
    _, parallelism, sections = {**LAYOUTS, **TP_LAYOUTS, **CP_LAYOUTS}[name]
    return layout_config(f"{folder}/{name}", parallelism, None, model=V4_MODEL, **sections)


def _layouts(rank: int, world_size: int, folder: str, names: list[str]) -> dict:
    return {name: trained(setup(_config(folder, name))) for name in names}


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_layouts_match_one_process(world_size, tmp_path):
    names = [name for name, (w, _, _) in LAYOUTS.items() if w == world_size]
    results = run_distributed(_layouts, world_size, str(tmp_path), names, timeout=900)[0]
    for name, result in results.items():
        cfg = _config("-", name)
        tolerances = {**MUON_RTOL, **HC_ATOL} if "muon" in name else HC_ATOL
        gaps = compare_with_single_process(name, cfg, result, **tolerances)
        print(f"deepseek_v4 {name}: {gaps}")


# ep and pp: 4 experts (ep 2 keeps 2 whole ones per rank), the hash-routed layers first
# and last, so that each of 2 stages holds one hash and one learned-routed layer
EP_MODEL = {**V4_MODEL, "moe": {**V4_MODEL["moe"], "num_experts": 4}}
MODEL_PARALLEL = {
    # ep borrows the 2 data-parallel ranks (dp folded into ep); op-level AC recomputes
    # the EP block with its experts gathered on their own mesh
    "dp2xep2": (2, {"dp_shard": 2, "ep": 2}, {}),
    "dp2xep2_op_ac": (
        2,
        {"dp_shard": 2, "ep": 2},
        {"activation_checkpoint": {"mode": "selective", "selective_ac_option": "op"}},
    ),
    "pp2": (2, {"dp_shard": 1, "pp": 2}, {}),
    "pp2_gpipe_full_ac": (
        2,
        {"dp_shard": 1, "pp": 2, "pp_schedule": "gpipe", "pp_microbatches": 2},
        {"activation_checkpoint": {"mode": "full"}},
    ),
    # W = 4: each expert sharded by flexshard over the 2 ranks that hold it
    "dp4xep2": (4, {"dp_shard": 4, "ep": 2}, {}),
    # W = 4: dp2 x pp2, the experts split over the 2 data-parallel ranks of each stage
    "dp2xpp2xep2": (4, {"dp_shard": 2, "pp": 2, "ep": 2}, {}),
    # W = 4: tp with each of them
    "tp2xpp2": (4, {"tp": 2, "pp": 2, "dp_shard": 1}, {}),
    "tp2xep2": (4, {"tp": 2, "dp_shard": 2, "ep": 2}, {}),
}


def _model_parallel_config(folder: str, name: str):
    _, parallelism, sections = MODEL_PARALLEL[name]
    return layout_config(f"{folder}/{name}", parallelism, None, model=EP_MODEL, **sections)


def _model_parallel(rank: int, world_size: int, folder: str, names: list[str]) -> dict:
    return {name: trained(setup(_model_parallel_config(folder, name))) for name in names}


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_expert_and_pipeline_parallel_match_one_process(world_size, tmp_path):
    names = [name for name, (w, _, _) in MODEL_PARALLEL.items() if w == world_size]
    results = run_distributed(_model_parallel, world_size, str(tmp_path), names, timeout=1200)
    for name in names:
        cfg = _model_parallel_config("-", name)
        gaps = compare_with_single_process(name, cfg, results[0][name], **HC_ATOL)
        print(f"deepseek_v4 {name}: {gaps}")
        for rank, by_name in enumerate(results):  # every rank logs the same loss
            assert by_name[name]["losses"] == results[0][name]["losses"], (name, rank)


# one global batch of 4 sequences through five layouts on 2 ranks, each resuming the
# last one's checkpoint: dp2 -> dp2 x ep2 (the experts re-cut by EP rank) -> pp2 (one
# data-parallel rank of 4 sequences: the same global batch) -> tp2 (the heads re-cut)
# -> dp2 again
RESUME_CHAIN = [
    ({"dp_shard": 2}, 3, 2),
    ({"dp_shard": 2, "ep": 2}, 6, 2),
    ({"dp_shard": 1, "pp": 2}, 9, 4),
    ({"dp_shard": 1, "tp": 2}, 12, 4),
    ({"dp_shard": 2}, 15, 2),
]


def _resume_config(folder: str, parallelism: dict, steps: int, batch: int):
    training = {"decay": "none", "steps": steps, "batch_size": batch}
    checkpoint = {"enable": True, "interval": 3}
    return layout_config(
        folder, parallelism, None, model=EP_MODEL, checkpoint=checkpoint, training=training
    )


def _save_then_resume(rank: int, world_size: int, folder: str) -> list[list[float]]:
    return [
        [r["loss"] for r in run(_resume_config(folder, parallelism, steps, batch))]
        for parallelism, steps, batch in RESUME_CHAIN
    ]


@pytest.mark.slow
def test_checkpoint_resumes_across_model_parallel_layouts(tmp_path):
    losses = run_distributed(_save_then_resume, 2, str(tmp_path), timeout=1200)[0]
    assert [len(x) for x in losses] == [3] * len(
        RESUME_CHAIN
    )  # each run resumed where the last stopped
    expected, _, _ = single_process(_resume_config("-", {"dp_shard": 2}, 15, 2), 2)
    gaps = [abs(a - b) / b for a, b in zip(sum(losses, []), expected)]
    print(f"deepseek_v4 dp2 -> dp2xep2 -> pp2 -> tp2 -> dp2 resumed: loss gap {max(gaps):.2e}")
    assert max(gaps) < LOSS_RTOL, gaps


def test_pipeline_stages_compute_the_whole_model():
    """Two stages run one after the other in this process: the first's output is the
    streams [b, s, hc_mult, dim], the last holds hc_head, and both take the token ids
    (the hash-routed layers, first and last, route by them): the whole model's logits
    bit for bit."""
    cfg = config_from_dict({"model": EP_MODEL}).model
    whole = DeepseekV4Transformer(cfg)
    init_weights(whole, 0)
    batch = tokens(17) % 256
    expected = whole(batch)
    first, last = split_model(whole, 2, [0, 1])
    assert isinstance(first.hc_head, torch.nn.Identity) and not isinstance(
        last.hc_head, torch.nn.Identity
    )
    streams = first(batch, token_ids=batch)
    assert streams.shape == (2, 17, 3, 32) and first.stage_state_dims == (3, 32)
    assert torch.equal(last(streams, token_ids=batch), expected)
    with pytest.raises(ValueError, match="token_ids"):
        last(streams)


def test_clamped_experts_grouped_match_the_loop_over_experts():
    """The routed experts through grouped GEMMs (what EP runs per rank) against a loop
    of clamped SwiGLUs, expert by expert; the clamp bites."""
    gen = torch.Generator().manual_seed(0)
    experts = ClampedExperts(5, 32, 16, 0.02, limit=0.5)
    for w in (experts.w1, experts.w2, experts.w3):
        torch.nn.init.normal_(w, std=0.3, generator=gen)
    flat = torch.randn(23, 32, generator=gen)
    chosen = torch.stack([torch.randperm(5, generator=gen)[:2] for _ in range(23)])
    weights = torch.rand(23, 2, generator=gen)
    expected = torch.zeros_like(flat)
    for e in range(5):
        token, slot = torch.where(chosen == e)
        w = (experts.w1[e], experts.w2[e], experts.w3[e])
        y = clamped_swiglu(flat[token], *w, 0.5) * weights[token, slot, None]
        expected = expected.index_add(0, token, y)
        assert not torch.allclose(
            y, clamped_swiglu(flat[token], *w, 1e9) * weights[token, slot, None]
        )
    with torch.no_grad():
        got = experts(flat, weights, chosen)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)


def _check_layouts(layouts: dict, tmp_path, world_size: int) -> None:
    """The ``layouts`` of ``world_size`` ranks, 10 steps each, against one process."""
    names = [name for name, (w, _, _) in layouts.items() if w == world_size]
    results = run_distributed(_layouts, world_size, str(tmp_path), names, timeout=900)
    for name in names:
        cfg = _config("-", name)
        tolerances = {**MUON_RTOL, **HC_ATOL} if "muon" in name else HC_ATOL
        gaps = compare_with_single_process(name, cfg, results[0][name], **tolerances)
        print(f"deepseek_v4 {name}: {gaps}")
        # every rank's loss is the whole batch's
        assert all(r[name]["losses"] == results[0][name]["losses"] for r in results), name


# the folder test's DRAWN, under the trainer's names
DRAWN_HERE = {"attn_sink": (0.0, 1.0), "ape": (0.0, 1.0), "_base": (0.0, 0.5), "_scale": (1.0, 0.5)}


def _drawn_model() -> DeepseekV4Transformer:
    """The seeded model with its sinks and hyper-connection offsets and scales drawn
    wide: at their initial values (zero, one) the streams' mixing gets gradients at
    rounding level, which would hide a missing or doubled sum over tp."""
    model = DeepseekV4Transformer(config_from_dict({"model": V4_MODEL}).model)
    init_weights(model, 0)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            for end, (mean, std) in DRAWN_HERE.items():
                if name.endswith(end):
                    param.copy_(torch.randn(param.shape, generator=gen) * std + mean)
    return model


# the hyper-connections' gradients are sums that cancel to 1e-3 of their terms (1e-6 to
# 1e-5 where the projections' are 1e-2), so the reduction order moves them by up to 8e-4
# of their size (measured, with or without sequence parallelism); a sum over tp missing
# or taken twice moves them by their whole size
HC_GRAD_RTOL = {"hc": 5e-3, "rest": 1e-5}


def _tp_gradients(rank: int, world_size: int) -> dict[bool, dict]:
    """One backward of the tensor-parallel model, with sequence parallelism and
    without: every parameter's whole gradient."""
    grads = {}
    for sequence_parallel in (True, False):
        model = _drawn_model()
        apply_tp(model, init_device_mesh("cpu", (world_size,)), sequence_parallel)
        batch = tokens(17) % 256
        loss_fn(model(batch[:, :-1]), batch[:, 1:]).backward()
        grads[sequence_parallel] = {
            n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            for n, p in model.named_parameters()
            if p.grad is not None
        }
    return grads


def test_tp_gradients_are_one_process():
    """Each parameter's gradient under tp2, on every rank, against one process: the
    heads' parts gathered, the replicated parts (shared key-and-value head, the
    hyper-connections, the experts) whole on every rank, summed over tp exactly once."""
    model = _drawn_model()
    batch = tokens(17) % 256
    loss_fn(model(batch[:, :-1]), batch[:, 1:]).backward()
    expected = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    for rank, by_layout in enumerate(run_distributed(_tp_gradients, 2, timeout=300)):
        for sequence_parallel, grads in by_layout.items():
            assert set(grads) == set(expected)
            gaps = {
                n: float((g - expected[n]).abs().max() / expected[n].abs().max())
                for n, g in grads.items()
            }
            for part, tolerance in HC_GRAD_RTOL.items():
                mine = {n: gap for n, gap in gaps.items() if ("hc_" in n) == (part == "hc")}
                worst = max(mine, key=mine.__getitem__)
                print(
                    f"deepseek_v4 tp2 rank {rank} (sequence parallel {sequence_parallel}), "
                    f"{part}: worst relative gradient gap {mine[worst]:.1e} ({worst})"
                )
                assert mine[worst] < tolerance, (sequence_parallel, worst, mine[worst])


# context parallel: (cp, seq) with zig-zag chunks of 5 (the sparse branch's windows of
# 4 across chunk boundaries, a chunk completing none, one or two; the heavy branch's of
# 8 across two chunks) and 3 (every window across two or three chunks, the sliding
# window of 6 reaching back over two)
CP_SEQUENCES = [(2, 20), (3, 18)]


def _cp_logits_and_gradients(rank: int, world_size: int, seqs: list[int]) -> list:
    """Per sequence length: this rank's logits, and each parameter's gradient of the
    whole batch's mean loss summed over the cp ranks (what data parallelism over
    dp x cp reduces)."""
    results = []
    for seq in seqs:
        model = _drawn_model()
        mesh = init_device_mesh("cpu", (world_size,))
        apply_cp(model, mesh)
        batch = tokens(seq + 1) % 256
        inputs, targets = (split_sequence(t, mesh) for t in (batch[:, :-1], batch[:, 1:]))
        logits = model(inputs)
        total = targets.numel() * world_size
        F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").div(
            total
        ).backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        for grad in grads.values():
            dist.all_reduce(grad)
        results.append((logits.detach(), grads))
    return results


@pytest.mark.parametrize("cp", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_cp_logits_and_gradients_are_one_process(cp):
    """Under cp every rank's logits are one process's at its zig-zag positions, and
    every parameter's gradient (summed over the ranks) is one process's: the sliding
    window's keys before each chunk, the compressed entries pooled by the rank that
    holds their last token and gathered, the indexer's top-k by global position."""
    seqs = [seq for size, seq in CP_SEQUENCES if size == cp]
    by_rank = run_distributed(_cp_logits_and_gradients, cp, seqs, timeout=300)
    for index, seq in enumerate(seqs):
        model = _drawn_model()
        batch = tokens(seq + 1) % 256
        logits = model(batch[:, :-1])
        loss_fn(logits, batch[:, 1:]).backward()
        expected = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        for rank, results in enumerate(by_rank):
            got_logits, grads = results[index]
            chunks = logits.detach().chunk(2 * cp, dim=1)
            mine = torch.cat([chunks[c] for c in zigzag_chunks(rank, cp)], dim=1)
            logit_gap = float((got_logits - mine).abs().max() / mine.abs().max())
            assert set(grads) == set(expected), seq
            gaps = {
                n: float((g - expected[n]).abs().max() / expected[n].abs().max())
                for n, g in grads.items()
            }
            worst = {
                part: max((n for n in gaps if ("hc_" in n) == (part == "hc")), key=gaps.__getitem__)
                for part in HC_GRAD_RTOL
            }
            print(
                f"deepseek_v4 cp{cp} seq {seq} rank {rank}: logits {logit_gap:.1e}, worst "
                + ", ".join(f"{part} {gaps[n]:.1e} ({n})" for part, n in worst.items())
            )
            assert logit_gap < 1e-6, (seq, rank, logit_gap)
            for part, name in worst.items():
                assert gaps[name] < HC_GRAD_RTOL[part], (seq, rank, name, gaps[name])


@pytest.mark.slow  # each gradient is checked in the fast suite
def test_tp2_matches_one_process(tmp_path):
    _check_layouts(TP_LAYOUTS, tmp_path, 2)


@pytest.mark.slow
def test_dp2_x_tp2_match_one_process(tmp_path):
    _check_layouts(TP_LAYOUTS, tmp_path, 4)


@pytest.mark.parametrize(
    "tp, message",
    [
        (3, "model.n_heads = 4 is not divisible by parallelism.tp = 3"),
        (4, "model.deepseek_v4.o_groups = 2 is not divisible by parallelism.tp = 4"),
    ],
)
def test_tp_needs_whole_heads_and_groups(tp, message):
    cfg = config_from_dict({"model": V4_MODEL, "parallelism": {"tp": tp}})
    with pytest.raises(ConfigError, match=message):
        checked_dims(cfg, tp)


def test_muon_rule_for_the_new_kinds(tmp_path):
    """Muon: the projections (hyper-connections' ``fn`` included), the router, the
    compressors' and the indexer's matrices, each expert; per head for ``wq_b``, per
    group for ``wo_a``. AdamW: the hyper-connections' offsets and scales, the sinks,
    the compressors' position biases (``ape``), norms, embedding and head. The hash
    table and the selection bias are buffers: no optimizer."""
    hf_model(tmp_path)
    cfg = config_from_dict(from_folder(tmp_path, training={"optimizer": "muon"}))
    model = DeepseekV4Transformer(cfg.model)
    optimizer = build_optimizer(model, cfg.training, cfg.model)
    names = {id(p): n for n, p in model.named_parameters()}
    groups = {
        names[id(p)]: g["row_blocks"] if g["use_muon"] else "adamw"
        for g in optimizer.param_groups
        for p in g["params"]
    }
    assert set(groups) == set(names.values())
    muon = {
        "layers.1.attn.wq_a.weight": False,
        "layers.1.attn.wq_b.weight": 16,
        "layers.1.attn.wo_a.weight": 12,
        "layers.1.attn.wo_b.weight": False,
        "layers.1.attn.compressor.wkv.weight": False,
        "layers.1.attn.indexer.wq_b.weight": 12,
        "layers.1.attn.indexer.compressor.wgate.weight": False,
        "layers.1.attn.indexer.weights_proj.weight": False,
        "layers.1.hc_attn_fn": False,
        "layers.0.ffn.gate.weight": False,
        "layers.0.ffn.experts.w1": False,
        "layers.0.ffn.shared_experts.w2.weight": False,
        "hc_head.hc_fn": False,
    }
    for name, rows in muon.items():
        assert groups[name] == rows, name
    adamw = ["layers.1.hc_attn_base", "layers.1.hc_ffn_scale", "layers.1.attn.attn_sink"]
    adamw += ["layers.1.attn.compressor.ape", "layers.1.attn.indexer.compressor.ape"]
    adamw += ["layers.1.attn.q_norm.weight", "hc_head.hc_base", "output.weight"]
    adamw += ["tok_embeddings.weight"]
    assert [name for name in adamw if groups[name] != "adamw"] == []
    buffers = dict(model.named_buffers())
    assert "layers.0.ffn.gate.tid2eid" in buffers and "layers.1.ffn.balance.bias" in buffers


@pytest.mark.parametrize(
    "section, values, message",
    [
        ("compile", {"enable": True}, "compile.enable = True"),
        ("rl", {"enable": True}, "rl.enable = True"),
    ],
)
def test_layouts_not_built_are_refused(section, values, message, tmp_path):
    hf_model(tmp_path)
    with pytest.raises(ConfigError, match=message):
        config_from_dict(from_folder(tmp_path, **{section: values}))


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("scoring_func", "softmax", "scoring_func = 'softmax'"),
        ("quantization_config", {"quant_method": "fp8"}, "quantization_config"),
        ("quantization_config", {"quant_method": "awq"}, "quant_method = 'awq'"),
        ("layer_types", None, "no layer_types"),
        ("n_shared_experts", 2, "n_shared_experts = 2"),
    ],
)
def test_what_the_folder_cannot_run_is_refused(key, value, message, tmp_path):
    hf_model(tmp_path)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), key: value}))
    with pytest.raises(ConfigError, match=message):
        config_from_dict(from_folder(tmp_path))


def test_config_json_of_model_keys_round_trips():
    """A run of [model] keys alone exports a config.json that transformers builds and
    that reads back as the same [model]."""
    cfg = config_from_dict({"model": V4_MODEL}).model
    config = exported_config(cfg, "float32", 16)
    assert config["model_type"] == "deepseek_v4"
    assert model_fields(config)["deepseek_v4"]["mlp_layer_types"] == MLP_LAYER_TYPES
    assert _mismatches(cfg, model_fields(config), loading=False) == {}
    hf = transformers.DeepseekV4Config(**{k: v for k, v in config.items() if k != "model_type"})
    assert hf.rope_parameters["compress"]["rope_type"] == "yarn"
    assert hf.layer_types == LAYER_TYPES and hf.compress_rates["heavily_compressed_attention"] == 8


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpoint_recomputes_the_same_gradients(mode):
    cfg = config_from_dict({"model": V4_MODEL, "activation_checkpoint": {"mode": mode}})
    plain, checkpointed = (DeepseekV4Transformer(cfg.model) for _ in range(2))
    init_weights(plain, 0)
    checkpointed.load_state_dict(plain.state_dict())
    apply_ac(checkpointed, cfg.activation_checkpoint)
    assert all(layer.checkpoint is not None for layer in checkpointed.layers)
    batch = tokens(17) % 256
    for model in (plain, checkpointed):
        loss_fn(model(batch[:, :-1]), batch[:, 1:]).backward()
    pairs = [
        (n, p.grad, q.grad)
        for (n, p), q in zip(plain.named_parameters(), checkpointed.parameters())
    ]
    # the indexer's choice is a top-k: no gradient reaches its weights, either way
    assert {n for n, g, _ in pairs if g is None} == {n for n, _, g in pairs if g is None}
    assert all(".indexer." in n for n, g, _ in pairs if g is None)
    assert [n for n, g, h in pairs if g is not None and not torch.equal(g, h)] == []


@pytest.mark.slow  # each gradient is checked in the fast suite
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_cp_matches_one_process(world_size, tmp_path):
    _check_layouts(CP_LAYOUTS, tmp_path, world_size)
