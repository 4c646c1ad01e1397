"""The trainer under TP, PP, CP, EP and HSDP layouts against the single-process run:
the loss of the first 10 steps, the gradient norms and the final (gathered) parameters,
same data and same initial weights; a checkpoint resumed under another layout; bad
layouts rejected at start-up.

Tolerances (fp32): the ranks' partial sums (sequence shards, tp pieces, microbatches,
data-parallel means) round differently from one process's single batch. Measured worst
gaps are printed (``-s``); the bounds below leave about 10x room.
"""

from __future__ import annotations

import pytest
import torch

from flexshard.testing import run_distributed
from flexshard.trainer.components.optimizers import build_optimizer
from flexshard.trainer.config import Config, ConfigError, config_from_dict, load_config
from flexshard.trainer.data.dataset import ByteTokenizer, DPSampler, load_tokens
from flexshard.trainer.models.model import build_model, init_weights
from flexshard.trainer.parallel.dims import ParallelDims
from flexshard.trainer.parallel.parallelize import checked_dims
from flexshard.trainer.train import Job, loss_fn, run, setup, train_step

from ..helpers.trainer_cases import launch_dims, set_lr, whole_parameters

STEPS = 10
# measured worst (4 and 2 ranks): loss 1.6e-7 (dp2xcp2), norm 3.6e-7 (dp2xtp2), final
# parameters 7.9e-6 (tp2xpp2: AdamW's step divides by sqrt(v), magnifying the ulps of
# small gradients; the weights move by ~3e-3 a step)
LOSS_RTOL = 2e-6
NORM_RTOL = 5e-6
PARAM_ATOL = 1e-4
MOE = {"num_experts": 4, "top_k": 2, "expert_hidden": 24, "first_dense_layers": 1}

MOE_MODEL = {"model": {"moe": MOE}}
# Qwen3: heads of 12 (not dim / heads = 8), q/k norms, the output tied to the embedding
QWEN3 = {"head_dim": 12, "qk_norm": True, "tie_embeddings": True}
QWEN3_MODEL = {"model": QWEN3}
# Qwen3-MoE: layer 0 dense, the chosen experts' weights as the softmax gives them
QWEN3_MOE_MODEL = {
    "model": {
        **QWEN3,
        "tie_embeddings": False,
        "moe": {
            **MOE,
            "first_dense_layers": 0,
            "num_shared_experts": 0,
            "mlp_only_layers": [0],
            "norm_topk_prob": False,
        },
    }
}
MUON = {"training": {"optimizer": "muon"}}

# name: (world size, [parallelism], other sections ([model], [training]) or None)
LAYOUTS: dict[str, tuple[int, dict, dict | None]] = {
    "dp2xtp2": (4, {"dp_shard": 2, "tp": 2}, None),
    "tp2xpp2": (4, {"dp_shard": 1, "tp": 2, "pp": 2}, None),
    "dp2xcp2": (4, {"dp_shard": 2, "cp": 2}, None),
    "dp2xep2": (2, {"dp_shard": 2, "ep": 2}, MOE_MODEL),
    "hsdp2x2": (4, {"dp_replicate": 2, "dp_shard": 2}, None),
    "dp2xpp2_gpipe": (4, {"dp_shard": 2, "pp": 2, "pp_schedule": "gpipe"}, None),
    "dp2xtp2_fsdp2": (4, {"dp_shard": 2, "tp": 2, "dp_backend": "fsdp2"}, None),
    # slow: 8 ranks
    "dp2xtp2xpp2": (8, {"dp_shard": 2, "tp": 2, "pp": 2}, None),
    "cp2xtp2xep2": (8, {"dp_shard": 2, "cp": 2, "tp": 2, "ep": 2}, MOE_MODEL),
    "cp2xtp2xep2_fsdp2": (
        8,
        {"dp_shard": 2, "cp": 2, "tp": 2, "ep": 2, "dp_backend": "fsdp2"},
        MOE_MODEL,
    ),
    "pp2_interleaved_x_dp2xcp2": (
        8,
        {
            "dp_shard": 2,
            "cp": 2,
            "pp": 2,
            "pp_schedule": "interleaved_1f1b",
            "pp_virtual_stages": 2,
            "pp_microbatches": 2,
        },
        None,
    ),
    # slow: the 5-D layout of configs/5d_demo.toml, 16 ranks
    "5d_pp2xdp2xcp2xtp2_ep2": (
        16,
        {"dp_shard": 2, "cp": 2, "tp": 2, "pp": 2, "ep": 2, "pp_microbatches": 2},
        MOE_MODEL,
    ),
    # Qwen3 and Qwen3-MoE on 2 ranks (tied embeddings under both dp backends and tp)
    "qwen3_dp2_owned": (2, {"dp_shard": 2, "placement": "owned"}, QWEN3_MODEL),
    "qwen3_dp2_block": (2, {"dp_shard": 2, "placement": "block", "block": [8, 8]}, QWEN3_MODEL),
    "qwen3_dp2_fsdp2": (2, {"dp_shard": 2, "dp_backend": "fsdp2"}, QWEN3_MODEL),
    "qwen3_dp2_muon": (2, {"dp_shard": 2, "placement": "muon"}, {**QWEN3_MODEL, **MUON}),
    "qwen3_tp2": (2, {"dp_shard": 1, "tp": 2}, QWEN3_MODEL),
    "qwen3_pp2": (2, {"dp_shard": 1, "pp": 2}, {"model": {**QWEN3, "tie_embeddings": False}}),
    "qwen3_cp2": (2, {"dp_shard": 1, "cp": 2}, QWEN3_MODEL),
    "qwen3_moe_ep2": (2, {"dp_shard": 2, "ep": 2}, QWEN3_MOE_MODEL),
    "qwen3_moe_tp2": (2, {"dp_shard": 1, "tp": 2}, QWEN3_MOE_MODEL),
    # W = 3: rows of 12-wide heads and 24-wide experts cut mid-way
    "qwen3_moe_dp3": (3, {"dp_shard": 3}, QWEN3_MOE_MODEL),
    "qwen3_dp3_flat": (3, {"dp_shard": 3, "placement": "flat"}, QWEN3_MODEL),
}


def layout_config(folder: str, parallelism: dict, moe: dict | None, **extra: dict) -> Config:
    """dim 32 (4 heads, 2 kv heads), 4 layers (2 or 4 pipeline stages), seq 16."""
    model = {"dim": 32, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 34}
    if moe is not None:
        model["moe"] = moe
    table: dict = {
        "model": model,
        "parallelism": parallelism,
        "training": {
            "steps": STEPS,
            "seq_len": 16,
            "batch_size": 2,
            "lr": 3e-3,
            "muon_lr": 3e-3,
            "seed": 3,
        },
        "job": {"dump_folder": folder, "progress": False, "plot": False, "tensorboard": False},
    }
    for name, values in extra.items():
        table[name] = {**table.get(name, {}), **values}
    return config_from_dict(table)


def single_process(cfg: Config, dp_size: int) -> tuple[list, list, dict]:
    """Losses, gradient norms and final parameters of one process on the global batch."""
    t = cfg.training
    model = build_model(cfg.model)
    init_weights(model, t.seed)
    tokens = load_tokens(cfg.data, ByteTokenizer())
    sampler = DPSampler(tokens, t.seq_len, dp_size * t.batch_size, 1, 0, 1, t.seed)
    optimizer = build_optimizer(model, t, cfg.model)
    losses, norms = [], []
    for step in range(t.steps):
        set_lr(optimizer, step, t)
        inputs, targets = sampler.batch(step)
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_norm or float("inf"))
        norms.append(float(norm))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, norms, {k: v.detach().clone() for k, v in model.named_parameters()}


def trained(job: Job, steps: int = STEPS) -> dict:
    """``steps`` of the trainer's own step on ``job``: losses, norms and the gathered
    parameters."""
    losses, norms = [], []
    for step in range(steps):
        loss, norm, _ = train_step(job, step)
        losses.append(loss)
        norms.append(norm)
    params = whole_parameters(job)
    return {"losses": losses, "norms": norms, "params": {k: v.numpy() for k, v in params.items()}}


def train_layout(folder: str, name: str) -> dict:
    """The trainer's own setup and step on this layout; the gathered parameters."""
    _, parallelism, sections = LAYOUTS[name]
    return trained(setup(layout_config(f"{folder}/{name}", parallelism, None, **(sections or {}))))


def _cases(rank: int, world_size: int, folder: str, names: list[str]) -> dict:
    return {name: train_layout(folder, name) for name in names}


# Muon's Newton-Schulz per rank's blocks rounds otherwise than one process's: measured
# (qwen3_dp2_muon, 10 steps) loss 2.3e-6, norm 2.4e-5, parameters 1.9e-4
MUON_RTOL = {"loss_rtol": 2e-5, "norm_rtol": 2e-4, "param_atol": 2e-3}


def _check(name: str, result: dict) -> dict[str, float]:
    _, parallelism, sections = LAYOUTS[name]
    cfg = layout_config("-", parallelism, None, **(sections or {}))
    muon = cfg.training.optimizer == "muon"
    return compare_with_single_process(name, cfg, result, **(MUON_RTOL if muon else {}))


def compare_with_single_process(
    name: str,
    cfg: Config,
    result: dict,
    loss_rtol: float = LOSS_RTOL,
    norm_rtol: float = NORM_RTOL,
    param_atol: float = PARAM_ATOL,
) -> dict[str, float]:
    """``result`` (a layout's losses, norms, parameters) against one process under
    ``cfg``: gaps within the tolerances, and the run learns."""
    dp = cfg.parallelism.dp_replicate * cfg.parallelism.dp_shard
    losses, norms, params = single_process(cfg, dp)
    loss_gap = max(abs(a - b) / b for a, b in zip(result["losses"], losses))
    norm_gap = max(abs(a - b) / b for a, b in zip(result["norms"], norms))
    assert set(result["params"]) == set(params), name
    param_gap = max(
        float((torch.from_numpy(result["params"][k]) - v).abs().max()) for k, v in params.items()
    )
    gaps = {"loss": loss_gap, "norm": norm_gap, "param": param_gap}
    assert loss_gap < loss_rtol and norm_gap < norm_rtol and param_gap < param_atol, (name, gaps)
    # it learns: the later half's mean below the first loss (one step may spike: torch
    # 2.11's trunc_normal_ draws other initial weights from the same seed than 2.13's)
    later = result["losses"][len(result["losses"]) // 2 :]
    assert sum(later) / len(later) < result["losses"][0], (name, result["losses"])
    return gaps


def _run_layouts(world_size: int, names: list[str], tmp_path) -> None:
    results = run_distributed(_cases, world_size, str(tmp_path), names, timeout=900)
    for name in names:
        gaps = _check(name, results[0][name])
        print(f"{name}: {gaps}")
        for rank, by_name in enumerate(results):  # every rank logs the same loss
            assert by_name[name]["losses"] == results[0][name]["losses"], (name, rank)


def test_layouts_on_4_ranks(tmp_path):
    names = [n for n, (w, _, _) in LAYOUTS.items() if w == 4]
    _run_layouts(4, names, tmp_path)


def test_expert_parallel_on_2_ranks(tmp_path):
    _run_layouts(2, ["dp2xep2"], tmp_path)


def test_qwen3_families_on_2_ranks(tmp_path):
    _run_layouts(2, [n for n, (w, _, _) in LAYOUTS.items() if w == 2 and "qwen3" in n], tmp_path)


def test_qwen3_families_on_3_ranks(tmp_path):
    _run_layouts(3, [n for n, (w, _, _) in LAYOUTS.items() if w == 3], tmp_path)


@pytest.mark.slow
def test_layouts_on_8_ranks(tmp_path):
    names = [n for n, (w, _, _) in LAYOUTS.items() if w == 8]
    _run_layouts(8, names, tmp_path)


@pytest.mark.slow
def test_5d_layout_on_16_ranks(tmp_path):
    _run_layouts(16, ["5d_pp2xdp2xcp2xtp2_ep2"], tmp_path)


# ------------------------------------------------------------------ resume elsewhere
CONSTANT_LR = {"decay": "none"}  # runs of different lengths share the lr schedule
# three layouts of one global batch (two data-parallel ranks), each resuming the last
CHAIN = [
    ({"dp_shard": 2, "cp": 2}, 3),  # a 1-D dp_shard_cp mesh of 4
    ({"dp_replicate": 2, "dp_shard": 1, "cp": 2}, 6),  # HSDP: 2 replicas x the cp pair
    ({"dp_shard": 2, "tp": 2}, STEPS),  # TP DTensors, sharded by flexshard over dp 2
]


def _save_then_resume(rank: int, world_size: int, folder: str) -> list[list[float]]:
    ckpt = {"enable": True, "interval": 3}
    losses = []
    for parallelism, steps in CHAIN:
        training = {**CONSTANT_LR, "steps": steps}
        records = run(layout_config(folder, parallelism, None, checkpoint=ckpt, training=training))
        losses.append([r["loss"] for r in records])
    return losses


def test_checkpoint_resumes_under_other_layouts(tmp_path):
    losses = run_distributed(_save_then_resume, 4, str(tmp_path), timeout=600)[0]
    assert [len(x) for x in losses] == [3, 3, 4]  # each run resumed where the last stopped
    reference = layout_config("-", {"dp_shard": 2}, None, training=CONSTANT_LR)
    expected, _, _ = single_process(reference, 2)
    gaps = [abs(a - b) / b for a, b in zip(sum(losses, []), expected)]
    print(f"dp2xcp2 -> hsdp2xcp2 -> dp2xtp2 resumed: loss gap {max(gaps):.2e}")
    assert max(gaps) < LOSS_RTOL, gaps


# ------------------------------------------------------------------ bad layouts
@pytest.mark.parametrize(
    ("override", "message"),
    [
        (["--parallelism.tp", "3"], "parallelism.tp = 3 must divide model.n_heads"),
        (["--parallelism.pp", "3"], "do not divide model.n_layers = 4"),
        (["--parallelism.cp", "3"], "seq_len = 16 is not divisible by 2 \\* parallelism.cp"),
        (["--parallelism.ep", "2"], "parallelism.ep = 2 needs a mixture-of-experts"),
        (
            ["--parallelism.ep", "3", "--model.moe.num_experts", "4"],
            "num_experts = 4 is not divisible by parallelism.ep = 3",
        ),
        (
            [
                "--parallelism.ep",
                "2",
                "--parallelism.dp_shard",
                "1",
                "--model.moe.num_experts",
                "4",
            ],
            "must divide dp_shard \\* cp = 1",
        ),
        (
            ["--parallelism.pp", "2", "--parallelism.pp_virtual_stages", "2"],
            "pp_virtual_stages = 2 needs",
        ),
        (["--parallelism.pp", "2", "--training.grad_accum", "2"], "grad_accum must be 1"),
        (
            ["--model.moe.num_experts", "4", "--checkpoint.last_save_in_hf", "true"],
            "last_save_in_hf: this MoE has no Hugging Face twin",
        ),
        (
            ["--parallelism.pp", "4", "--parallelism.pp_microbatches", "2"],
            "1f1b needs at least pp = 4",
        ),
        (["--parallelism.pp", "2", "--parallelism.pp_microbatches", "3"], "batch_size = 2"),
        (
            ["--parallelism.tp", "4", "--model.n_kv_heads", "4", "--training.seq_len", "18"],
            "divisible by parallelism.tp",
        ),
    ],
)
def test_bad_layouts_are_config_errors(override, message, tmp_path):
    base = tmp_path / "base.toml"
    base.write_text(
        "[model]\ndim = 32\nn_layers = 4\nn_heads = 4\nn_kv_heads = 2\n"
        "[training]\nseq_len = 16\nbatch_size = 2\n"
    )
    with pytest.raises(ConfigError, match=message):
        launch_dims(load_config(base, override))


def test_world_size_must_be_the_product_of_the_degrees():
    cfg = layout_config("-", {"dp_shard": 2, "tp": 2, "pp": 2}, None)
    with pytest.raises(ConfigError, match="multiply to 8 .* world size is 4"):
        ParallelDims.from_config(cfg, 4)
    cfg = layout_config("-", {"cp": 2, "ep": 4}, {**MOE, "num_experts": 8})
    with pytest.raises(ConfigError, match="parallelism.ep = 4 must divide dp_shard \\* cp = 2"):
        checked_dims(cfg, 2)  # dp_shard inferred as 1
    assert ParallelDims.from_config(cfg, 4).dp_shard == 2
