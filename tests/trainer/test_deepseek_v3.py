"""DeepSeek-V3 in the trainer against transformers' ``DeepseekV3ForCausalLM``: the same
weights give the same fp32 logits (MLA with q_lora_rank set and None, YaRN, sigmoid
routing in groups with a nonzero selection bias, shared experts, dense first blocks);
config.json maps both ways; the trainer's export (trained with MTP on) loads with no
missing or unexpected key and computes the trainer's logits. Multi-token prediction
trains, is checkpointed and resumes exactly; the config errors name their keys."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from flexshard.checkpoint.hf_safetensors import load_hf_safetensors
from flexshard.testing import run_distributed
from flexshard.trainer.checkpointing.checkpoints import latest_step
from flexshard.trainer.config import ConfigError, config_from_dict, load_config
from flexshard.trainer.config.hf_config import folder_fields, hf_config, model_fields
from flexshard.trainer.generate import generate, load_model
from flexshard.trainer.models.hf_adapter import hf_keys
from flexshard.trainer.models.layers import KVCache
from flexshard.trainer.models.model import Transformer, count_params, init_weights
from flexshard.trainer.models.moe import group_limited
from flexshard.trainer.train import run

from ..helpers.trainer_cases import launch_dims, tiny_config

LOGIT_ATOL = 1e-5  # fp32; measured below 4e-6 with weights of std 0.2
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
}
# the trainer's tiny DeepSeek-V3 (MLA, MoE, YaRN), beside tiny_config's sections
DEEPSEEK_MODEL: dict[str, Any] = {
    "attention": "mla",
    "dim": 32,
    "n_layers": 3,
    "n_heads": 4,
    "q_lora_rank": 24,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "v_head_dim": 10,
    "ffn_hidden": 48,
    "norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": {k: v for k, v in YARN.items() if k not in ("rope_type", "rope_theta")}
    | {"type": "yarn"},
    "moe": {
        "num_experts": 8,
        "top_k": 3,
        "n_group": 4,
        "topk_group": 2,
        "num_shared_experts": 1,
        "expert_hidden": 16,
        "first_dense_layers": 1,
        "score_func": "sigmoid",
        "balance": "bias",
        "routed_scaling_factor": 2.5,
    },
}


def _transformers():
    return pytest.importorskip("transformers")


def hf_deepseek(folder: Path, q_lora_rank: int | None, dense: bool = False) -> torch.nn.Module:
    """A random DeepseekV3ForCausalLM (weights of std 0.2, so routing and attention
    are far from uniform; a random selection bias), saved to ``folder``."""
    transformers = _transformers()
    config = transformers.DeepseekV3Config(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,  # MLA: every head has its own keys and values
        q_lora_rank=q_lora_rank,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=10,
        n_routed_experts=8,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=3,
        n_shared_experts=1,
        first_k_dense_replace=3 if dense else 1,
        routed_scaling_factor=2.5,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_parameters=dict(YARN),
    )
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0, 0.1)
        for param in model.parameters():
            if param.ndim >= 2:
                param.normal_(0, 0.2)
    model.save_pretrained(folder)
    return model


def probe_tokens() -> torch.Tensor:
    return torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(1))


def load_trainer_model(folder: Path) -> Transformer:
    """The trainer's model of a Hugging Face folder: [model] from config.json, weights
    through the adapter's keys."""
    cfg = config_from_dict({"model": folder_fields(folder)}).model
    model = Transformer(cfg).eval()
    state = model.state_dict()
    load_hf_safetensors(folder, state, hf_keys(list(state), cfg))
    return model


@pytest.mark.parametrize(
    "q_lora_rank, dense",
    [(24, False), (None, False), (None, True)],
    ids=["q_lora", "q_proj", "dense"],
)
def test_logits_match_transformers(tmp_path, q_lora_rank, dense):
    reference = hf_deepseek(tmp_path, q_lora_rank, dense)
    model = load_trainer_model(tmp_path)
    assert model.cfg.attention == "mla" and model.cfg.rope_scaling.type == "yarn"
    assert model.cfg.moe.num_experts == (0 if dense else 8)
    with torch.no_grad():
        expected = reference(probe_tokens()).logits
        got = model(probe_tokens())
    assert expected.abs().max() > 1.0  # not a near-zero comparison
    assert (got - expected).abs().max().item() <= LOGIT_ATOL


def test_config_json_both_ways(tmp_path):
    """config.json -> [model] -> config.json keeps every field transformers reads (the
    export says no MTP depth: it holds no MTP weights)."""
    hf_deepseek(tmp_path, 24)
    original = json.loads((tmp_path / "config.json").read_text())
    cfg = config_from_dict({"model": model_fields(original)}).model
    written = hf_config(cfg, "float32", original["max_position_embeddings"])
    for key, value in written.items():
        if key in original and key not in ("torch_dtype", "rope_theta", "num_nextn_predict_layers"):
            assert original[key] == value, key
    assert written["rope_parameters"] == YARN
    assert model_fields(written) == model_fields(original)


def test_group_limited_routing_picks_from_the_best_groups():
    scores = torch.tensor([[0.9, 0.0, 0.5, 0.45, 0.6, 0.1, 0.2, 0.2]])
    # groups of 2 scored by their two best: 0.9, 0.95, 0.7, 0.4 -> groups 1 and 0 kept
    kept = group_limited(scores, n_group=4, topk_group=2)
    assert torch.isinf(kept[0, 4:]).all() and torch.equal(kept[0, :4], scores[0, :4])


def _mtp_config(folder: str, **checkpoint: Any):
    return tiny_config(
        folder,
        model={**DEEPSEEK_MODEL, "mtp_layers": 1, "mtp_loss_weight": 0.3},
        training={"steps": 8, "lr": 1e-2, "grad_accum": 2},
        checkpoint={"enable": True, "interval": 4, **checkpoint},
    )


def _mtp_run(rank: int, world_size: int, folder: str) -> tuple[list[dict], list[dict], int]:
    cfg = _mtp_config(folder, last_save_in_hf=True)
    whole = run(cfg)
    ckpt = Path(cfg.job.dump_folder) / cfg.checkpoint.folder
    dist.barrier()
    if rank == 0:  # as if the job had died after the step-4 save
        shutil.rmtree(ckpt / "step-8")
    dist.barrier()
    resumed = run(cfg)
    return whole, resumed, latest_step(ckpt)


def test_mtp_trains_resumes_and_exports(tmp_path):
    """W = 2, grad_accum 2, MTP on: its loss falls; a run resumed from the step-4
    checkpoint (MTP weights in it) repeats steps 5-8 bit for bit; the HF export has
    every DeepseekV3ForCausalLM key and the MTP depth under DeepSeek's names (which
    transformers ignores), and computes the trainer's logits."""
    whole, resumed, saved = run_distributed(_mtp_run, 2, str(tmp_path), timeout=600)[0]
    assert saved == 8
    mtp = [r["mtp_loss"] for r in whole]
    assert mtp[-1] < mtp[0] - 0.3, mtp  # it learns
    assert [r["step"] for r in resumed] == [5, 6, 7, 8]
    for key in ("loss", "mtp_loss"):
        assert [r[key] for r in resumed] == [r[key] for r in whole[4:]], key
    folder = tmp_path / "hf"
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and config["num_nextn_predict_layers"] == 1
    exported = {k: v for f in folder.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    assert "model.layers.3.eh_proj.weight" in exported
    assert not any("mtp" in k for k in exported)
    transformers = _transformers()
    reference, info = transformers.DeepseekV3ForCausalLM.from_pretrained(
        folder, output_loading_info=True
    )
    unexpected = info.pop("unexpected_keys")
    assert unexpected and all(k.startswith("model.layers.3.") for k in unexpected), unexpected
    assert not any(info.values()), info  # no missing or mismatched key
    model = load_trainer_model(folder)
    assert (model.layers[1].feed_forward.balance.bias != 0).any()  # the bias trained
    tokens = probe_tokens() % 256
    with torch.no_grad():
        gap = (reference.eval()(tokens).logits - model(tokens)).abs().max().item()
    assert gap <= LOGIT_ATOL


def test_mtp_is_training_only_and_counted():
    """The MTP depth adds its parameters but no term to an evaluation's logits."""
    base = config_from_dict({"model": DEEPSEEK_MODEL}).model
    with_mtp = config_from_dict({"model": {**DEEPSEEK_MODEL, "mtp_layers": 1}}).model
    plain, mtp = Transformer(base), Transformer(with_mtp)
    init_weights(plain, 0)
    init_weights(mtp, 0)
    extra = sum(p.numel() for p in mtp.mtp.parameters())
    assert (
        sum(p.numel() for p in mtp.parameters())
        == sum(p.numel() for p in plain.parameters()) + extra
    )
    mtp.load_state_dict(plain.state_dict(), strict=False)
    tokens = probe_tokens() % 256
    with torch.no_grad():
        assert torch.equal(mtp(tokens), plain(tokens))
    logits = mtp(tokens)
    logits.sum().backward()  # the MTP term reaches its weights through the logits
    assert mtp.mtp.layers[0].eh_proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize(
    "model, parallelism, needle",
    [
        ({"mtp_layers": 1}, {"tp": 2}, "model.mtp_layers"),
        ({"moe": {"num_experts": 8, "n_group": 3}}, {}, "model.moe.n_group"),
        ({"moe": {"num_experts": 8, "n_group": 4, "topk_group": 1, "top_k": 3}}, {}, "topk_group"),
        ({"attention": "gqa", "rope_scaling": {"type": "yarn"}}, {}, "model.rope_scaling.type"),
        ({"qk_rope_head_dim": 3}, {}, "model.qk_rope_head_dim"),
    ],
)
def test_config_errors_name_the_key(tmp_path, model, parallelism, needle):
    table = {**DEEPSEEK_MODEL, **model}
    if "moe" in model:
        table["moe"] = {**DEEPSEEK_MODEL["moe"], **model["moe"]}
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        # layout errors (MTP under tp) come from the launch's layout check
        launch_dims(tiny_config(str(tmp_path), model=table, parallelism=parallelism))


def test_export_refuses_what_deepseek_v3_cannot_hold(tmp_path):
    moe = {**DEEPSEEK_MODEL["moe"], "balance": "none", "score_func": "softmax"}
    with pytest.raises(ConfigError, match='score_func = "softmax".*balance = "none"'):
        tiny_config(
            str(tmp_path),
            model={**DEEPSEEK_MODEL, "moe": moe},
            checkpoint={"last_save_in_hf": True},
        )


def test_the_671b_config_counts_as_transformers():
    """configs/deepseek_v3.toml without MTP has the parameters of transformers' default
    DeepseekV3Config (DeepSeek-V3's: 671.0B); its MTP depth adds eh_proj, three norms and
    one MoE block (the embedding and the head are shared)."""
    transformers = _transformers()
    cfg = load_config(Path(__file__).parents[2] / "configs" / "deepseek_v3.toml").model
    with torch.device("meta"):
        reference = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config())
        model = Transformer(cfg)
    main = sum(p.numel() for p in reference.parameters())
    assert main == 671_026_404_352
    total, active = count_params(cfg)
    block = sum(p.numel() for p in model.layers[-1].parameters())
    assert total == main + block + 2 * cfg.dim**2 + 3 * cfg.dim
    assert 37e9 < active < 38e9  # the paper's 37B active, plus the MTP depth's
    plain, _ = count_params(dataclasses.replace(cfg, mtp_layers=0))
    assert plain == main


def test_generation_caches_the_latent_and_matches_transformers(tmp_path):
    """flexshard-generate's path on a DeepseekV3 folder: the cached forward (latent and
    rotated key per token) equals the full one, and greedy decoding is transformers'."""
    reference = hf_deepseek(tmp_path, 24)
    model, _ = load_model(tmp_path)
    tokens = probe_tokens()[:1, :13]
    cache = KVCache(model.cfg.n_layers)
    with torch.no_grad():
        full = model(tokens)
        stepped = [model(tokens[:, :5], cache)]
        stepped += [model(tokens[:, i : i + 1], cache) for i in range(5, 13)]
    assert cache.layers[0].tensors[0].shape == (1, 13, 16)  # kv_lora_rank values a token
    assert (torch.cat(stepped, dim=1) - full).abs().max().item() < 1e-5
    prompt = torch.tensor([5, 17, 99, 3])
    ours = generate(model, prompt, max_new_tokens=12)
    theirs = reference.generate(prompt[None], max_new_tokens=12, do_sample=False)[0]
    assert ours.tolist() == theirs.tolist()
