"""Qwen3.5 (``qwen3_5_text``, ``Qwen3_5ForCausalLM``) from a folder saved by transformers'
own class: 3 Gated DeltaNet layers and 1 gated full-attention layer, odd sizes (key
heads of 12, value heads of 10, a 3-tap conv, 88 conv channels), every norm drawn at
random so that a zero-centred norm read as a plain one, or a norm read in the wrong
row order, moves the logits.

- the chunked gated delta rule is transformers' torch path bit for bit (sequences over
  one chunk, grouped value heads) and its recurrent form within fp32 rounding;
- the folder is the model: logits within 1e-5 of transformers' (over two chunks), the
  first loss within 1e-4 of transformers' loss on the same batch;
- the export of the loaded model at W = 2 is the folder's tensors bit for bit and loads
  in transformers with every key;
- ``flexshard-train --nproc 2`` with nothing but the folder trains (AdamW and Muon) and
  exports; under Muon the conv kernels, ``A_log`` and ``dt_bias`` step with AdamW;
- a folder with the vision tower loads its text model (logits as the whole model's);
- generation with the cache (each Gated DeltaNet layer's conv window and recurrent
  state): logits within 1e-6 of the full forward, transformers' greedy tokens;
- GRPO from the folder (after a short pre-training on the task, exported to a folder)
  at W = 1 and 2: generator and trainer log-probs bit for bit in batch-invariant mode;
- context parallel's arithmetic: the rule on pieces from an unknown start, their
  transfers scanned, is the whole sequence's rule (outputs, state, gradients);
- tp, pp and cp at W = 2 against one process (under cp each rank's rule runs on seq / cp
  tokens), cp at W = 3 and cp2 x tp2 (slow), the quantized gather
  (``test_families_quant``), a checkpoint of dp2 x pp2 resumed under dp2 x tp2 (slow);
- zig-zag chunks shorter than the conv's history (cp) are a ConfigError naming the keys.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import pytest
import torch

from flexshard.checkpoint.hf_safetensors import load_hf_safetensors
from flexshard.testing import run_distributed
from flexshard.trainer.checkpointing import checkpoints as checkpointing
from flexshard.trainer.checkpointing.checkpoints import export
from flexshard.trainer.components.optimizers import build_optimizer
from flexshard.trainer.config import ConfigError, config_from_dict
from flexshard.trainer.config.hf_config import text_model_prefix
from flexshard.trainer.launch import main as train_main
from flexshard.trainer.models import linear_attention
from flexshard.trainer.models.hf_adapter import hf_keys
from flexshard.trainer.models.layers import KVCache
from flexshard.trainer.models.linear_attention import (
    GatedDeltaNet,
    chunk_gated_delta_rule,
    outputs_from,
    piece_transfers,
    recurrent_gated_delta_rule,
    start_states,
    token_by_token,
)
from flexshard.trainer.models.model import Transformer
from flexshard.trainer.train import run, setup

from ..helpers.trainer_cases import launch_dims
from .test_model_families import _tensors, from_folder, matches_transformers
from .test_parallel_layouts import (
    LOSS_RTOL,
    MUON_RTOL,
    compare_with_single_process,
    layout_config,
    single_process,
    trained,
)

transformers = pytest.importorskip("transformers")
qwen3_5 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")

SHAPE = {
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 34,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_conv_kernel_dim": 3,
    "linear_key_head_dim": 12,
    "linear_value_head_dim": 10,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}


VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 40, "num_heads": 2}
VISION.update(out_hidden_size=64, patch_size=4, num_position_embeddings=16)


def hf_model(folder: Path, vision: bool = False) -> torch.nn.Module:
    """A random Qwen3.5 (``vision``: with its vision tower) saved in several shards; the
    zero-centred norms drawn around 0, the gated norms around 1."""
    torch.manual_seed(0)
    if vision:
        config = transformers.Qwen3_5Config(text_config=SHAPE, vision_config=VISION)
        model = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    else:
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**SHAPE)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and "visual" not in name:
                param.normal_(1.0 if "linear_attn" in name else 0.0, 0.3)
    model.save_pretrained(folder, max_shard_size="20KB")
    return model


def tokens(seq: int = 70) -> torch.Tensor:
    return torch.randint(0, 300, (2, seq), generator=torch.Generator().manual_seed(1))


def loaded(folder: Path) -> Transformer:
    m = config_from_dict(from_folder(folder)).model
    model = Transformer(m).eval()
    state = model.state_dict()
    load_hf_safetensors(folder, state, hf_keys(list(state), m, m.tie_embeddings))
    return model


@pytest.mark.parametrize("seq, k_heads", [(70, 2), (17, 4)])
def test_chunked_delta_rule_is_transformers(seq, k_heads):
    gen = torch.Generator().manual_seed(2)
    q, k = (torch.randn(2, seq, k_heads, 12, generator=gen) for _ in range(2))
    v = torch.randn(2, seq, 4, 10, generator=gen)
    g = -torch.rand(2, seq, 4, generator=gen)
    beta = torch.rand(2, seq, 4, generator=gen)
    ours, state = chunk_gated_delta_rule(q, k, v, g, beta)
    theirs, final = qwen3_5.torch_chunk_gated_delta_rule(
        q, k, v, g, beta, use_qk_l2norm_in_kernel=True, output_final_state=True
    )
    assert torch.equal(ours, theirs) and torch.equal(state, final)
    step, _ = qwen3_5.torch_recurrent_gated_delta_rule(
        q, k, v, g, beta, use_qk_l2norm_in_kernel=True
    )
    assert (ours - step).abs().max().item() < 1e-5
    # from a state (the start of a context-parallel chunk)
    start = torch.randn(2, 4, 12, 10, generator=gen)
    ours, state = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=start)
    theirs, final = qwen3_5.torch_chunk_gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        initial_state=start,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    assert torch.equal(ours, theirs) and torch.equal(state, final)


def test_pieces_compose_to_the_whole_sequence_with_gradients():
    """Context parallelism's arithmetic on one process: the rule on each piece from an
    unknown start (the pieces of unequal lengths, one under and one over a chunk of 64,
    one of 1 token), the pieces' transfers scanned for their start states, is the whole
    sequence's rule within fp32 rounding: outputs, final state and every input's
    gradient."""
    gen = torch.Generator().manual_seed(4)
    seq, bounds = 150, [0, 9, 80, 81, 117, 150]
    inputs = [
        torch.randn(2, seq, 2, 12, generator=gen),
        torch.randn(2, seq, 2, 12, generator=gen),
        torch.randn(2, seq, 4, 10, generator=gen),
        -torch.rand(2, seq, 4, generator=gen),
        torch.rand(2, seq, 4, generator=gen),
    ]
    weight = torch.randn(2, seq, 4, 10, generator=gen)
    whole_in = [t.clone().requires_grad_() for t in inputs]
    whole, final = chunk_gated_delta_rule(*whole_in)
    ((whole * weight).sum() + final.sum()).backward()
    piece_in = [t.clone().requires_grad_() for t in inputs]
    parts = [piece_transfers(*(t[:, a:b] for t in piece_in)) for a, b in zip(bounds, bounds[1:])]
    starts = start_states(torch.stack([transfer for _, _, transfer in parts], dim=1))
    pieces = torch.cat(
        [outputs_from(out, reads, starts[:, i]) for i, (out, reads, _) in enumerate(parts)], 1
    )
    k_dim = 12
    last = parts[-1][2]
    end = last[..., :k_dim] @ starts[:, -1] + last[..., k_dim:]
    ((pieces * weight).sum() + end.sum()).backward()
    assert (pieces - whole).abs().max().item() < 2e-6
    assert (end - final).abs().max().item() < 2e-6
    for name, a, b in zip("q k v g beta".split(), whole_in, piece_in):
        scale = a.grad.abs().max().item()
        assert (a.grad - b.grad).abs().max().item() < 2e-6 * max(scale, 1.0), name


def test_recurrent_delta_rule_carries_the_state():
    """From a state, token by token: transformers' recurrent form within fp32 rounding
    (it divides the queries by sqrt(k_dim), here they are multiplied by its inverse),
    and the chunked prompt then the recurrence is the recurrence throughout."""
    gen = torch.Generator().manual_seed(3)
    q, k = (torch.randn(2, 9, 2, 12, generator=gen) for _ in range(2))
    v = torch.randn(2, 9, 4, 10, generator=gen)
    g, beta = -torch.rand(2, 9, 4, generator=gen), torch.rand(2, 9, 4, generator=gen)
    start = torch.randn(2, 4, 12, 10, generator=gen)
    ours, state = recurrent_gated_delta_rule(q, k, v, g, beta, start)
    theirs, final = qwen3_5.torch_recurrent_gated_delta_rule(
        q, k, v, g, beta, start, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    assert (ours - theirs).abs().max().item() < 1e-6
    assert (state - final).abs().max().item() < 1e-6
    _, prompt_state = chunk_gated_delta_rule(q[:, :5], k[:, :5], v[:, :5], g[:, :5], beta[:, :5])
    rest, _ = recurrent_gated_delta_rule(
        q[:, 5:], k[:, 5:], v[:, 5:], g[:, 5:], beta[:, 5:], prompt_state
    )
    whole, _ = recurrent_gated_delta_rule(q, k, v, g, beta)
    assert (rest - whole[:, 5:]).abs().max().item() < 1e-6


def test_folder_is_the_model_logits_and_loss(tmp_path):
    reference = hf_model(tmp_path)
    m = config_from_dict(from_folder(tmp_path)).model
    assert m.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert (m.attention, m.partial_rotary_factor, m.rotary_dim()) == ("gated", 0.25, 4)
    assert (m.linear_attention.conv_kernel, m.linear_attention.num_value_heads) == (3, 4)
    model = loaded(tmp_path)
    batch = tokens()
    matches_transformers("qwen3_5", model, reference, batch)


def _load_and_export(rank: int, world_size: int, folder: str) -> None:
    source = Path(folder)
    cfg = config_from_dict(from_folder(source, job={"dump_folder": f"{source}/run"}))
    job = setup(cfg)
    checkpointing.initial_load(job)
    export(job, source / "export", max_shard_bytes=30_000)


def test_export_reloads_exact(tmp_path):
    reference = hf_model(tmp_path)
    run_distributed(_load_and_export, 2, str(tmp_path), timeout=300)
    exported = tmp_path / "export"
    original, got = _tensors(tmp_path), _tensors(exported)
    assert set(got) == set(original)
    assert [k for k, v in original.items() if not torch.equal(got[k], v)] == []
    config = json.loads((exported / "config.json").read_text())
    assert (config["model_type"], config["layer_types"]) == ("qwen3_5_text", SHAPE_TYPES)
    back, info = transformers.Qwen3_5ForCausalLM.from_pretrained(exported, output_loading_info=True)
    assert all(not v for v in info.values()), info
    with torch.no_grad():
        assert torch.equal(back.eval()(tokens()).logits, reference(tokens()).logits)


SHAPE_TYPES = ["linear_attention"] * 3 + ["full_attention"]


def test_muon_steps_conv_kernels_and_decays_with_adamw(tmp_path):
    hf_model(tmp_path)
    cfg = config_from_dict(from_folder(tmp_path, training={"optimizer": "muon"}))
    model = Transformer(cfg.model)
    optimizer = build_optimizer(model, cfg.training, cfg.model)
    names = {id(p): n for n, p in model.named_parameters()}
    adamw = {names[id(p)] for g in optimizer.param_groups if not g["use_muon"] for p in g["params"]}
    muon = {names[id(p)] for g in optimizer.param_groups if g["use_muon"] for p in g["params"]}
    for name in ("conv1d.weight", "A_log", "dt_bias", "attention.norm.weight"):
        assert f"layers.0.attention.{name.removeprefix('attention.')}" in adamw, name
    assert "layers.0.attention.in_proj_qkv.weight" in muon
    assert "layers.0.attention.in_proj_a.weight" in muon
    assert "layers.3.attention.q_proj.weight" in muon


@pytest.mark.parametrize(
    "optimizer, vision", [("adamw", False), pytest.param("muon", True, marks=pytest.mark.slow)]
)
def test_flexshard_train_with_only_the_folder(optimizer, vision, tmp_path, capfd):
    """Trains and exports the text model (a vision folder's too, saying so in one line)."""
    reference = hf_model(tmp_path / "hf", vision)
    out = tmp_path / "run"
    train_main(
        ["--nproc", "2", "--checkpoint.initial_load_path", str(tmp_path / "hf")]
        + ["--checkpoint.initial_load_in_hf", "true", "--checkpoint.last_save_in_hf", "true"]
        + ["--training.steps", "3", "--training.seq_len", "16", "--job.dump_folder", str(out)]
        + ["--training.optimizer", optimizer]
        + ["--job.progress", "false", "--job.plot", "false", "--job.tensorboard", "false"]
    )
    trained, info = transformers.Qwen3_5ForCausalLM.from_pretrained(
        out / "hf", output_loading_info=True
    )
    assert all(not v for v in info.values()), info
    with torch.no_grad():
        moved = (trained.eval()(tokens()).logits - reference(tokens()).logits).abs()
    assert moved.max().item() > 1e-3  # it trained
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    said = "its text model (model.language_model.*) loaded" in capfd.readouterr().out
    assert said == vision


@pytest.mark.parametrize(
    "parallelism, message",
    [
        ({"cp": 8}, "parallelism.cp = 8: zig-zag chunks of 1 tokens, fewer than"),
    ],
)
def test_layouts_not_built_are_refused(parallelism, message, tmp_path):
    hf_model(tmp_path)
    cfg = config_from_dict(from_folder(tmp_path, parallelism=parallelism))
    with pytest.raises(ConfigError, match=message):
        launch_dims(cfg)


def test_tp_needs_whole_gated_deltanet_heads():
    heads = {**QWEN3_5_MODEL["linear_attention"], "num_key_heads": 1}
    cfg = layout_config("-", {"tp": 2}, None, model={**QWEN3_5_MODEL, "linear_attention": heads})
    with pytest.raises(ConfigError, match="linear_attention.num_key_heads = 1 is not divisible"):
        launch_dims(cfg)


class _TwoRanks:
    """What a Gated DeltaNet layer reads of its ContextParallel before any exchange."""

    size, rank = 2, 0


def test_what_context_parallel_cannot_run_is_refused():
    """Under cp: the per-row recurrence (one process's), and zig-zag chunks shorter than
    the conv's history (the config refuses them first; the layer, if built by hand)."""
    model = {**QWEN3_5_MODEL, "dim": 32, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2}
    cfg = config_from_dict({"model": model}).model
    layer = GatedDeltaNet(cfg, 0.02)
    layer.context_parallel = _TwoRanks()
    empty = torch.zeros(1, 0, 2)
    with token_by_token(), pytest.raises(ValueError, match="parallelism.cp = 1"):
        layer(torch.randn(1, 4, 32), empty, empty)
    with pytest.raises(ValueError, match="chunks of 1 tokens, fewer than the Gated DeltaNet"):
        layer(torch.randn(1, 2, 32), empty, empty)


def test_vision_folder_loads_its_text_model(tmp_path):
    """A ``Qwen3_5ForConditionalGeneration`` folder: its text model's keys read from
    ``model.language_model.*``, its text logits those of the whole model's."""
    reference = hf_model(tmp_path, vision=True)
    m = config_from_dict(from_folder(tmp_path)).model
    assert (m.attention, m.layer_types) == ("gated", SHAPE_TYPES)
    assert text_model_prefix(tmp_path) == "model.language_model."
    model = Transformer(m).eval()
    state = model.state_dict()
    keys = hf_keys(list(state), m, m.tie_embeddings, text_model_prefix(tmp_path))
    load_hf_safetensors(tmp_path, state, keys)
    with torch.no_grad():
        gap = (model(tokens()) - reference(tokens()).logits).abs().max().item()
    assert gap <= 1e-5, gap


def test_cached_decode_is_the_full_forward_and_transformers_greedy(tmp_path):
    """Greedy decoding through the cache (prompt chunked, then one token per forward
    through the recurrence): each step's logits those of the full forward over the
    sequence so far, the tokens and logits transformers' ``generate`` gives."""
    reference = hf_model(tmp_path)
    model = loaded(tmp_path)
    prompt = tokens(9)
    with torch.no_grad():
        cache = KVCache(len(model.layers))
        steps = [model(prompt, cache)[:, -1]]
        for _ in range(11):
            steps.append(model(steps[-1].argmax(-1)[:, None], cache)[:, -1])
        decoded = torch.stack(steps, 1)
        sequence = torch.cat([prompt, decoded.argmax(-1)], 1)
        full = model(sequence[:, :-1])[:, 8:]
        theirs = reference.generate(
            prompt,
            max_new_tokens=12,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    assert cache.length == 20 and cache.layers[0].states[1].shape == (2, 4, 12, 10)
    gap = (decoded - full).abs().max().item()
    assert gap < 1e-6, gap  # measured 1.8e-7: the recurrence against the chunked form
    assert torch.equal(theirs.sequences, sequence)
    hf_gap = (decoded - torch.stack(theirs.logits, 1)).abs().max().item()
    assert hf_gap < 1e-5, hf_gap


RL = {"task_max_len": 4, "prompts_per_step": 6, "group_size": 2, "max_new_tokens": 5}


def _run(rank: int, world_size: int, table: dict) -> list[dict]:
    return run(config_from_dict(table))


def _grpo_table(folder: Path, dump: Path, steps: int) -> dict:
    return from_folder(
        folder,
        model={"tokenizer": "bytes"},
        rl={**RL, "enable": True, "batch_invariant": True},
        training={"steps": steps, "seq_len": 16, "lr": 1e-3, "seed": 1},
        job={"dump_folder": str(dump)},
    )


def test_grpo_from_the_folder_bitwise(tmp_path):
    """The folder as it came: no completion ends (reward 0, no update), but every
    sampled token's log-prob is the trainer's bit for bit."""
    hf_model(tmp_path / "hf")
    records = run_distributed(_run, 1, _grpo_table(tmp_path / "hf", tmp_path / "rl", 2))[0]
    assert [r["logprob_max_abs_diff"] for r in records] == [0.0, 0.0], records
    assert all(r["ratio_max_abs_dev"] == 0.0 for r in records)


@pytest.mark.slow
def test_grpo_after_pretraining_bitwise_at_w1_and_w2(tmp_path):
    """40 steps on the task's format, exported as a folder; GRPO from that folder
    (rewards unequal within groups: the updates move the weights) at W = 1 and 2."""
    hf_model(tmp_path / "hf")
    pre = from_folder(
        tmp_path / "hf",
        data={"source": "rl_task"},
        model={"tokenizer": "bytes"},
        rl={"task_max_len": 4},
        training={"steps": 40, "seq_len": 16, "lr": 3e-3, "batch_size": 16, "warmup_steps": 5},
        checkpoint={"last_save_in_hf": True},
        job={"dump_folder": str(tmp_path / "pre")},
    )
    run_distributed(_run, 1, pre, timeout=600)
    for world in (1, 2):
        table = _grpo_table(tmp_path / "pre" / "hf", tmp_path / f"rl{world}", 3)
        records = run_distributed(_run, world, table, timeout=600)[0]
        print(world, [{k: r[k] for k in ("reward", "loss", "grad_norm")} for r in records])
        assert [r["logprob_max_abs_diff"] for r in records] == [0.0] * 3, records
        assert all(r["ratio_max_abs_dev"] == 0.0 for r in records)
        assert all(math.isfinite(r["loss"]) and math.isfinite(r["reward"]) for r in records)
        assert max(r["grad_norm"] for r in records) > 0.0  # some group's rewards differed


# ---------------------------------------------------------------------- layouts
# Qwen3.5 from [model] keys (drawn by the trainer's own init: zero-centred norms at 0,
# A_log as transformers draws it), 3 Gated DeltaNet layers and 1 gated attention layer
QWEN3_5_MODEL = {
    "attention": "gated",
    "qk_norm": True,
    "head_dim": 16,
    "partial_rotary_factor": 0.25,
    "layer_types": SHAPE_TYPES,
    "linear_attention": {
        "conv_kernel": 3,
        "key_head_dim": 12,
        "value_head_dim": 10,
        "num_key_heads": 2,
        "num_value_heads": 4,
    },
}
# name: (parallelism, other sections), each at W = 3 against one process
QWEN3_5_LAYOUTS = {
    "flat_full_ac": (
        {"dp_shard": 3, "placement": "flat"},
        {"activation_checkpoint": {"mode": "full"}},
    ),
    "muon": ({"dp_shard": 3}, {"training": {"optimizer": "muon"}}),
}


# the decay path's parameters (A_log, dt_bias, in_proj_a) get the smallest gradients, so
# AdamW's normalised step turns the ranks' reduction order into the largest parameter
# gap: measured after 10 steps 2.2e-4 (A_log; loss 8.5e-8, norm 2.2e-7)
DECAY_ATOL = {"param_atol": 1e-3}


def _qwen3_5_config(folder: str, name: str):
    parallelism, sections = QWEN3_5_LAYOUTS[name]
    return layout_config(f"{folder}/{name}", parallelism, None, model=QWEN3_5_MODEL, **sections)


def _qwen3_5_layouts(rank: int, world_size: int, folder: str) -> dict:
    return {name: trained(setup(_qwen3_5_config(folder, name))) for name in QWEN3_5_LAYOUTS}


@pytest.mark.slow
def test_data_parallel_layouts_at_w3_match_one_process(tmp_path):
    results = run_distributed(_qwen3_5_layouts, 3, str(tmp_path), timeout=600)[0]
    for name, result in results.items():
        cfg = _qwen3_5_config("-", name)
        tolerances = MUON_RTOL if name == "muon" else DECAY_ATOL
        gaps = compare_with_single_process(name, cfg, result, **tolerances)
        print(f"qwen3_5 {name}: {gaps}")


# tp, pp and cp at W = 2 against one process (fast: 2 ranks, all in one spawn)
QWEN3_5_MODEL_PARALLEL = {
    "tp2": {"dp_shard": 1, "tp": 2},
    "pp2": {"dp_shard": 1, "pp": 2},
    "cp2": {"dp_shard": 1, "cp": 2},
}
# cp on 3 ranks and cp with tp (slow), on a sequence of 24 (zig-zag chunks of 4 and 6)
QWEN3_5_WIDER_CP = {
    "cp3": {"dp_shard": 1, "cp": 3},
    "cp2xtp2": {"dp_shard": 1, "cp": 2, "tp": 2},
}
WIDER_CP_SEQ = 24


def model_parallel_config(folder: str, name: str, moe: dict | None = None):
    """``QWEN3_5_MODEL`` (with ``moe``: Qwen3.5-MoE) on the layout ``name``."""
    model = {**QWEN3_5_MODEL, "moe": moe} if moe else QWEN3_5_MODEL
    if name in QWEN3_5_WIDER_CP:
        training = {"seq_len": WIDER_CP_SEQ}
        return layout_config(
            f"{folder}/{name}", QWEN3_5_WIDER_CP[name], None, model=model, training=training
        )
    return layout_config(f"{folder}/{name}", QWEN3_5_MODEL_PARALLEL[name], None, model=model)


@contextmanager
def delta_rule_tokens() -> Iterator[list[int]]:
    """Counts (in its one item) the tokens the chunked gated delta rule runs on: rows
    times length of every call."""
    count = [0]
    rule = linear_attention._chunked_rule

    def counting(q: torch.Tensor, *args: object) -> tuple[torch.Tensor, torch.Tensor]:
        count[0] += q.shape[0] * q.shape[2]
        return rule(q, *args)

    with mock.patch.object(linear_attention, "_chunked_rule", counting):
        yield count


def _model_parallel(
    rank: int, world_size: int, folder: str, moe: dict | None, names: list[str]
) -> dict:
    results = {}
    for name in names:
        with delta_rule_tokens() as tokens:
            results[name] = trained(setup(model_parallel_config(folder, name, moe)))
        results[name]["delta_rule_tokens"] = tokens[0]
    return results


def check_model_parallel(
    tmp_path, moe: dict | None = None, names: list[str] | None = None, **tolerances: float
) -> None:
    """tp (heads split: DeltaNet's and the gated attention's), pp (the 3 + 1 layer
    kinds cut into 2 stages) and cp (zig-zag chunks; each rank's Gated DeltaNet layers
    run the rule on its own chunks, the chunks' states passed between ranks) on 2 ranks
    (``names``: those layouts, on the ranks they take), each against one process."""
    names = names or list(QWEN3_5_MODEL_PARALLEL)
    p = model_parallel_config("-", names[0], moe).parallelism
    world = p.dp_shard * p.tp * p.pp * p.cp
    results = run_distributed(_model_parallel, world, str(tmp_path), moe, names, timeout=900)
    for name in names:
        cfg = model_parallel_config("-", name, moe)
        gaps = compare_with_single_process(name, cfg, results[0][name], **tolerances)
        print(f"{'qwen3_5_moe' if moe else 'qwen3_5'} {name}: {gaps}")
        for rank in range(1, world):
            assert results[rank][name]["losses"] == results[0][name]["losses"], name
        t, p = cfg.training, cfg.parallelism
        if p.pp == 1:  # every rank runs every layer: the rule on seq / cp tokens
            linear = cfg.model.layer_types.count("linear_attention")
            per_rank = len(results[0][name]["losses"]) * linear * t.batch_size * t.seq_len // p.cp
            counted = [results[rank][name]["delta_rule_tokens"] for rank in range(world)]
            assert counted == [per_rank] * world, (name, counted, per_rank)


def test_tp_pp_cp_match_one_process(tmp_path):
    check_model_parallel(tmp_path, **DECAY_ATOL)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(QWEN3_5_WIDER_CP))
def test_cp3_and_cp_with_tp_match_one_process(name, tmp_path):
    check_model_parallel(tmp_path, names=[name], **DECAY_ATOL)


# one global batch (two data-parallel ranks) on 4 ranks: 3 steps under dp2 x pp2,
# resumed under dp2 x tp2 (the checkpoint's Gated DeltaNet parameters re-cut by head)
CONSTANT_LR = {"decay": "none"}
CHAIN = [({"dp_shard": 2, "pp": 2}, 3), ({"dp_shard": 2, "tp": 2}, 6)]


def _save_then_resume(rank: int, world_size: int, folder: str) -> list[list[float]]:
    losses = []
    for parallelism, steps in CHAIN:
        cfg = layout_config(
            folder,
            parallelism,
            None,
            model=QWEN3_5_MODEL,
            checkpoint={"enable": True, "interval": 3},
            training={**CONSTANT_LR, "steps": steps},
        )
        losses.append([r["loss"] for r in run(cfg)])
    return losses


@pytest.mark.slow
def test_checkpoint_resumes_from_pp_under_tp(tmp_path):
    losses = run_distributed(_save_then_resume, 4, str(tmp_path), timeout=900)[0]
    assert [len(x) for x in losses] == [3, 3]  # the second run resumed at step 3
    reference = layout_config(
        "-", {"dp_shard": 2}, None, model=QWEN3_5_MODEL, training={**CONSTANT_LR, "steps": 6}
    )
    expected, _, _ = single_process(reference, 2)
    gaps = [abs(a - b) / b for a, b in zip(sum(losses, []), expected)]
    print(f"qwen3_5 dp2xpp2 -> dp2xtp2 resumed: loss gap {max(gaps):.2e}")
    assert max(gaps) < LOSS_RTOL, gaps
