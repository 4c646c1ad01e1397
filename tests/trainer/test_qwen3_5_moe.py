"""Qwen3.5-MoE (``qwen3_5_moe_text``, ``Qwen3_5MoeForCausalLM``) from a folder saved by
transformers' own class: Qwen3.5's 3 Gated DeltaNet layers and 1 gated attention layer
(``test_qwen3_5``'s sizes), each with 5 routed experts of 24 (top 2, renormalised) and a
shared expert of 40 behind its sigmoid gate. The norms, the router and the gate are
drawn wide, so that a wrong norm, a wrong routing or an ungated shared expert moves the
logits.

- the folder is the model: logits within 1e-5 of transformers' (measured 2.1e-7), the
  first loss within 1e-4 of transformers' loss on the same batch;
- the export of the loaded model at W = 2 is the folder's tensors bit for bit and loads
  in transformers with every key; a folder with the experts fused (transformers' own
  save, ``save_original_format=False``) loads as the per-expert one and exports fused
  at W = 3; ``flexshard-train --nproc 2`` with nothing but the folder trains and
  exports (slow); a folder with the vision tower loads its text model;
- W = 3 (Shard(0), Muon, flat with full AC), W = 2 (owned, block, mixed) and dp2 x ep2
  against one process, and a checkpoint of dp2 resumed under dp2 x ep2 (slow);
- under Muon the router and the experts (each expert its own matrix) are Muon matrices,
  the shared expert's gate (one row) steps with AdamW;
- tp, pp and cp at W = 2, cp at W = 3 and cp2 x tp2 against one process (slow);
- GRPO from the folder: generator and trainer log-probs bit for bit in batch-invariant
  mode (the experts one by one, the shared expert's gate on whole vectors);
- what has no Qwen3.5-MoE twin, and zig-zag chunks shorter than the conv's history,
  are ConfigErrors naming the key.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flexshard.checkpoint.hf_safetensors import load_hf_safetensors
from flexshard.testing import run_distributed
from flexshard.trainer.components.optimizers import build_optimizer
from flexshard.trainer.config import ConfigError, config_from_dict
from flexshard.trainer.config.hf_config import text_model_prefix
from flexshard.trainer.launch import main as train_main
from flexshard.trainer.models.hf_adapter import fused_experts, hf_keys
from flexshard.trainer.models.model import Transformer
from flexshard.trainer.train import run, setup

from ..helpers.trainer_cases import launch_dims
from .test_model_families import _tensors, from_folder, matches_transformers
from .test_parallel_layouts import (
    LOSS_RTOL,
    MUON_RTOL,
    compare_with_single_process,
    layout_config,
    trained,
)
from .test_qwen3_5 import (
    QWEN3_5_MODEL,
    QWEN3_5_WIDER_CP,
    SHAPE,
    SHAPE_TYPES,
    VISION,
    _grpo_table,
    _load_and_export,
    _run,
    check_model_parallel,
    tokens,
)

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.qwen3_5_moe")

MOE_SHAPE = {**SHAPE, "moe_intermediate_size": 24, "shared_expert_intermediate_size": 40}
MOE_SHAPE.update(num_experts=5, num_experts_per_tok=2)
del MOE_SHAPE["intermediate_size"]


def hf_model(folder: Path, vision: bool = False, fused: bool = False) -> torch.nn.Module:
    """A random Qwen3.5-MoE (``vision``: with its vision tower) saved in several shards;
    the zero-centred norms drawn around 0, the gated norms around 1, the router and the
    shared expert's gate wide (a near-uniform softmax would hide a routing error).
    ``fused``: saved as transformers holds it (``experts.gate_up_proj``, ``down_proj``)."""
    torch.manual_seed(0)
    if vision:
        config = transformers.Qwen3_5MoeConfig(text_config=MOE_SHAPE, vision_config=VISION)
        model = transformers.Qwen3_5MoeForConditionalGeneration(config).eval()
    else:
        config = transformers.Qwen3_5MoeTextConfig(**MOE_SHAPE)
        model = transformers.Qwen3_5MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "visual" in name:
                continue
            if "norm" in name:
                param.normal_(1.0 if "linear_attn" in name else 0.0, 0.3)
            if name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                param.normal_(0.0, 0.5)
    model.save_pretrained(folder, max_shard_size="20KB", save_original_format=not fused)
    return model


def loaded(folder: Path) -> Transformer:
    m = config_from_dict(from_folder(folder)).model
    model = Transformer(m).eval()
    state = model.state_dict()
    prefix, fused = text_model_prefix(folder), fused_experts(folder)
    load_hf_safetensors(folder, state, hf_keys(list(state), m, m.tie_embeddings, prefix, fused))
    return model


def test_folder_is_the_model_logits_and_loss(tmp_path):
    reference = hf_model(tmp_path)
    m = config_from_dict(from_folder(tmp_path)).model
    assert (m.attention, m.layer_types) == ("gated", SHAPE_TYPES)
    moe = m.moe
    assert (moe.num_experts, moe.top_k, moe.expert_hidden) == (5, 2, 24)
    assert (moe.num_shared_experts, moe.shared_expert_hidden, moe.shared_expert_gate) == (
        1,
        40,
        True,
    )
    model = loaded(tmp_path)
    assert model.layers[0].feed_forward.shared_gate.weight.shape == (1, 64)
    batch = tokens()
    expected = matches_transformers("qwen3_5_moe", model, reference, batch)
    # the gate matters: without it the logits are another model's
    with torch.no_grad():
        for layer in model.layers:
            layer.feed_forward.shared_gate = None
        assert (model(batch) - expected).abs().max().item() > 1e-2


def test_export_reloads_exact(tmp_path):
    reference = hf_model(tmp_path)
    run_distributed(_load_and_export, 2, str(tmp_path), timeout=300)
    exported = tmp_path / "export"
    original, got = _tensors(tmp_path), _tensors(exported)
    assert set(got) == set(original)
    assert [k for k, v in original.items() if not torch.equal(got[k], v)] == []
    config = json.loads((exported / "config.json").read_text())
    assert (config["model_type"], config["num_experts"]) == ("qwen3_5_moe_text", 5)
    assert config["shared_expert_intermediate_size"] == 40
    back, info = transformers.Qwen3_5MoeForCausalLM.from_pretrained(
        exported, output_loading_info=True
    )
    assert all(not v for v in info.values()), info
    with torch.no_grad():
        assert torch.equal(back.eval()(tokens()).logits, reference(tokens()).logits)


def test_fused_expert_folder_loads_and_exports_fused(tmp_path):
    """A folder saved as transformers 5 holds the experts (``save_original_format=
    False``): loaded exactly (the per-expert folder's model, bit for bit), exported at
    W = 3 (5 experts cut unevenly) in its own layout, the folder's tensors bit for bit."""
    reference = hf_model(tmp_path / "fused", fused=True)
    hf_model(tmp_path / "per_expert")
    names = set(_tensors(tmp_path / "fused"))
    assert "model.layers.0.mlp.experts.gate_up_proj" in names
    assert not any(".experts.0." in name for name in names)
    assert fused_experts(tmp_path / "fused") and not fused_experts(tmp_path / "per_expert")
    model = loaded(tmp_path / "fused")
    expected = loaded(tmp_path / "per_expert").state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())
    run_distributed(_load_and_export, 3, str(tmp_path / "fused"), timeout=300)
    exported = tmp_path / "fused" / "export"
    original, got = _tensors(tmp_path / "fused"), _tensors(exported)
    assert set(got) == set(original)
    assert [k for k, v in original.items() if not torch.equal(got[k], v)] == []
    back, info = transformers.Qwen3_5MoeForCausalLM.from_pretrained(
        exported, output_loading_info=True
    )
    assert all(not v for v in info.values()), info
    with torch.no_grad():
        assert torch.equal(back.eval()(tokens()).logits, reference(tokens()).logits)


@pytest.mark.slow
def test_flexshard_train_with_only_the_folder(tmp_path):
    """``flexshard-train --nproc 2`` from the folder alone trains and exports."""
    reference = hf_model(tmp_path / "hf")
    out = tmp_path / "run"
    train_main(
        ["--nproc", "2", "--checkpoint.initial_load_path", str(tmp_path / "hf")]
        + ["--checkpoint.initial_load_in_hf", "true", "--checkpoint.last_save_in_hf", "true"]
        + ["--training.steps", "3", "--training.seq_len", "16", "--job.dump_folder", str(out)]
        + ["--job.progress", "false", "--job.plot", "false", "--job.tensorboard", "false"]
    )
    trained_model, info = transformers.Qwen3_5MoeForCausalLM.from_pretrained(
        out / "hf", output_loading_info=True
    )
    assert all(not v for v in info.values()), info
    with torch.no_grad():
        moved = (trained_model.eval()(tokens()).logits - reference(tokens()).logits).abs()
    assert moved.max().item() > 1e-3  # it trained
    records = (out / "metrics.jsonl").read_text().splitlines()
    losses = [json.loads(line)["loss"] for line in records]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))


def test_vision_folder_loads_its_text_model(tmp_path):
    """A ``Qwen3_5MoeForConditionalGeneration`` folder: the text model's keys read from
    ``model.language_model.*``, its text logits those of the whole model."""
    reference = hf_model(tmp_path, vision=True)
    assert text_model_prefix(tmp_path) == "model.language_model."
    model = loaded(tmp_path)
    with torch.no_grad():
        gap = (model(tokens()) - reference(tokens()).logits).abs().max().item()
    assert gap <= 1e-5, gap


def test_muon_takes_router_and_experts_and_leaves_the_gate_to_adamw(tmp_path):
    hf_model(tmp_path)
    cfg = config_from_dict(from_folder(tmp_path, training={"optimizer": "muon"}))
    model = Transformer(cfg.model)
    optimizer = build_optimizer(model, cfg.training, cfg.model)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for g in optimizer.param_groups if g["use_muon"] for p in g["params"]}
    adamw = {names[id(p)] for g in optimizer.param_groups if not g["use_muon"] for p in g["params"]}
    for layer in (0, 3):
        ffn = f"layers.{layer}.feed_forward"
        assert f"{ffn}.shared_gate.weight" in adamw
        for name in ("router.weight", "experts.w1", "experts.w2", "experts.w3", "shared.w1.weight"):
            assert f"{ffn}.{name}" in muon, name


# a gated-attention MoE of [model] keys: what is not Qwen3.5-MoE's is refused on export
QWEN3_5_MOE = {
    "num_experts": 4,
    "top_k": 2,
    "expert_hidden": 24,
    "num_shared_experts": 1,
    "shared_expert_hidden": 40,
    "shared_expert_gate": True,
    "first_dense_layers": 0,
}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"shared_expert_gate": False}, "model.moe.num_shared_experts = 1, shared_expert_gate"),
        ({"num_shared_experts": 0, "shared_expert_gate": False}, "num_shared_experts = 0"),
        ({"norm_topk_prob": False}, "model.moe.norm_topk_prob = false"),
        ({"first_dense_layers": 1}, r"layers \[0\] are dense"),
        ({"score_func": "sigmoid"}, "model.moe.score_func"),
        ({"balance": "bias"}, 'model.moe.balance = "bias"'),
    ],
)
def test_what_is_not_qwen3_5_moe_is_refused(change, message):
    model = {**QWEN3_5_MODEL, "n_layers": 4, "moe": {**QWEN3_5_MOE, **change}}
    with pytest.raises(ConfigError, match=f"last_save_in_hf: .*{message}"):
        config_from_dict({"model": model, "checkpoint": {"last_save_in_hf": True}})


def test_a_gate_without_a_shared_expert_is_refused():
    moe = {**QWEN3_5_MOE, "num_shared_experts": 0}
    with pytest.raises(ConfigError, match="model.moe.shared_expert_gate = true"):
        config_from_dict({"model": {**QWEN3_5_MODEL, "n_layers": 4, "moe": moe}})


@pytest.mark.parametrize(
    "section, values, message",
    [
        ("parallelism", {"cp": 8}, "parallelism.cp = 8: zig-zag chunks of 1 tokens"),
    ],
)
def test_layouts_not_built_are_refused(section, values, message, tmp_path):
    hf_model(tmp_path)
    with pytest.raises(ConfigError, match=message):
        launch_dims(config_from_dict(from_folder(tmp_path, **{section: values})))


def test_grpo_from_the_folder_bitwise(tmp_path):
    """Every sampled token's log-prob is the trainer's bit for bit (the folder as it
    came: no completion ends, reward 0, no update), at W = 1 and 2."""
    hf_model(tmp_path / "hf")
    for world in (1, 2):
        table = _grpo_table(tmp_path / "hf", tmp_path / f"rl{world}", 2)
        records = run_distributed(_run, world, table, timeout=600)[0]
        assert [r["logprob_max_abs_diff"] for r in records] == [0.0, 0.0], records
        assert all(r["ratio_max_abs_dev"] == 0.0 for r in records)


def test_router_logits_folder_is_refused(tmp_path):
    hf_model(tmp_path)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "output_router_logits": True}))
    with pytest.raises(ConfigError, match="output_router_logits = true"):
        config_from_dict(from_folder(tmp_path))


# ---------------------------------------------------------------------- layouts
QWEN3_5_MOE_MODEL = {**QWEN3_5_MODEL, "moe": QWEN3_5_MOE}
# name: (world size, parallelism, other sections), each against one process
LAYOUTS = {
    "dp3": (3, {"dp_shard": 3}, {}),
    "dp3_muon": (3, {"dp_shard": 3}, {"training": {"optimizer": "muon"}}),
    "dp3_flat_full_ac": (
        3,
        {"dp_shard": 3, "placement": "flat"},
        {"activation_checkpoint": {"mode": "full"}},
    ),
    "dp2xep2": (2, {"dp_shard": 2, "ep": 2}, {}),
    "dp2_owned": (2, {"dp_shard": 2, "placement": "owned"}, {}),
    "dp2_block": (2, {"dp_shard": 2, "placement": "block", "block": [8, 8]}, {}),
    "dp2_mixed": (2, {"dp_shard": 2, "placement": "mixed"}, {}),
}
# the decay path's parameters get the smallest gradients (test_qwen3_5's DECAY_ATOL)
DECAY_ATOL = {"param_atol": 1e-3}


def _config(folder: str, name: str):
    _, parallelism, sections = LAYOUTS[name]
    return layout_config(f"{folder}/{name}", parallelism, None, model=QWEN3_5_MOE_MODEL, **sections)


def _layouts(rank: int, world_size: int, folder: str, names: list[str]) -> dict:
    return {name: trained(setup(_config(folder, name))) for name in names}


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_layouts_match_one_process(world_size, tmp_path):
    names = [name for name, (w, _, _) in LAYOUTS.items() if w == world_size]
    results = run_distributed(_layouts, world_size, str(tmp_path), names, timeout=900)[0]
    for name, result in results.items():
        cfg = _config("-", name)
        tolerances = MUON_RTOL if "muon" in name else DECAY_ATOL
        gaps = compare_with_single_process(name, cfg, result, **tolerances)
        print(f"qwen3_5_moe {name}: {gaps}")


@pytest.mark.slow  # the dense model's twin (test_qwen3_5) runs in the fast suite
def test_tp_pp_cp_match_one_process(tmp_path):
    """tp (the experts replicated over tp, the layers' heads split), pp and cp on 2 ranks."""
    check_model_parallel(tmp_path, QWEN3_5_MOE, **DECAY_ATOL)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(QWEN3_5_WIDER_CP))
def test_cp3_and_cp_with_tp_match_one_process(name, tmp_path):
    check_model_parallel(tmp_path, QWEN3_5_MOE, [name], **DECAY_ATOL)


# one global batch (two data-parallel ranks): 3 steps under dp2, resumed under dp2 x ep2
CONSTANT_LR = {"decay": "none", "steps": 6}
CHAIN = [({"dp_shard": 2}, 3), ({"dp_shard": 2, "ep": 2}, 6)]


def _save_then_resume(rank: int, world_size: int, folder: str) -> tuple[list, list]:
    def losses(name: str, parallelism: dict, steps: int) -> list[float]:
        cfg = layout_config(
            f"{folder}/{name}",
            parallelism,
            None,
            model=QWEN3_5_MOE_MODEL,
            checkpoint={"enable": True, "interval": 3},
            training={**CONSTANT_LR, "steps": steps},
        )
        return [r["loss"] for r in run(cfg)]

    whole = losses("whole", {"dp_shard": 2}, 6)
    chained = [losses("chain", parallelism, steps) for parallelism, steps in CHAIN]
    return whole, chained


@pytest.mark.slow
def test_checkpoint_resumes_under_expert_parallel(tmp_path):
    whole, chained = run_distributed(_save_then_resume, 2, str(tmp_path), timeout=900)[0]
    assert [len(x) for x in chained] == [3, 3]  # the second run resumed at step 3
    assert chained[0] == whole[:3]  # the same layout: bit for bit
    gap = max(abs(a - b) / b for a, b in zip(chained[1], whole[3:]))
    print(f"qwen3_5_moe dp2 -> dp2xep2 resumed: loss gap {gap:.2e}")
    assert gap < LOSS_RTOL, gap
