"""Sequence parallelism under pipeline parallelism: with tp2 x pp2 the stages send each
other the ``[b, s / tp, d]`` sequence shards (the local tensors of Shard(1) DTensors)
instead of whole hidden states. The trainer's losses, gradient norms and parameters
match one process (the layout tests' tolerances) and the same layout without sequence
parallelism (fp32 rounding), while the bytes sent between stages, forward and
backward, are 1 / tp of it; a sequence tp does not divide is a ConfigError."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from flexshard.testing import run_distributed
from flexshard.trainer.config import ConfigError, load_config
from flexshard.trainer.models.model import Transformer
from flexshard.trainer.parallel.pipeline import build_pipeline
from flexshard.trainer.parallel.tensor_parallel import apply_tp
from flexshard.trainer.train import loss_fn, setup, train_step

from ..helpers.trainer_cases import launch_dims, whole_parameters
from .test_parallel_layouts import (
    LOSS_RTOL,
    NORM_RTOL,
    PARAM_ATOL,
    layout_config,
    single_process,
)

STEPS = 4
SEQ = 18  # 9 tokens per tp rank: a shard length that is not a power of two
TP2_PP2 = {"dp_shard": 1, "tp": 2, "pp": 2}
# SP against no SP: the same fp32 model, only the tp reductions differ (reduce-scatter
# of sequence shards instead of one all-reduce) and round in another order
SP_LOSS_RTOL = 1e-6
SP_PARAM_ATOL = 5e-5


def _config(folder: str, sequence_parallel: bool):
    training = {"steps": STEPS, "seq_len": SEQ}
    layout = {**TP2_PP2, "sequence_parallel": sequence_parallel}
    return layout_config(folder, layout, None, training=training)


def _train(folder: str, sequence_parallel: bool) -> dict:
    job = setup(_config(folder, sequence_parallel))
    losses, norms = [], []
    for step in range(STEPS):
        loss, norm, _ = train_step(job, step)
        losses.append(loss)
        norms.append(norm)
    runner = job.parallel.runner
    assert runner is not None
    params = whole_parameters(job)
    return {
        "losses": losses,
        "norms": norms,
        "params": {k: v.numpy() for k, v in params.items()},
        "sent": runner.sent_bytes(),
        "stages": runner.stage_ids,
        "model_shards": [m.sequence_shards for m in runner.modules],
    }


def _both(rank: int, world_size: int, folder: str) -> dict[bool, dict]:
    return {sp: _train(f"{folder}/sp_{sp}", sp) for sp in (True, False)}


def _param_gap(got: dict, want: dict) -> float:
    assert set(got) == set(want)
    return max(float(abs(torch.as_tensor(got[k]) - torch.as_tensor(want[k])).max()) for k in want)


@pytest.mark.slow
def test_sequence_parallel_pipeline_matches_one_process_and_sends_1_over_tp(tmp_path):
    results = run_distributed(_both, 4, str(tmp_path), timeout=900)
    sp, whole = results[0][True], results[0][False]
    for rank, by_sp in enumerate(results):  # every rank logs the same loss
        for flag in (True, False):
            assert by_sp[flag]["losses"] == results[0][flag]["losses"], (flag, rank)

    cfg = _config("-", True)
    losses, norms, params = single_process(cfg, 1)
    loss_gap = max(abs(a - b) / b for a, b in zip(sp["losses"], losses))
    norm_gap = max(abs(a - b) / b for a, b in zip(sp["norms"], norms))
    param_gap = _param_gap(sp["params"], params)
    sp_gap = max(abs(a - b) / b for a, b in zip(sp["losses"], whole["losses"]))
    sp_param_gap = _param_gap(sp["params"], whole["params"])
    print(
        f"tp2xpp2 SP vs one process: loss {loss_gap:.2e} norm {norm_gap:.2e} param "
        f"{param_gap:.2e}; SP vs no SP: loss {sp_gap:.2e} param {sp_param_gap:.2e}"
    )
    assert loss_gap < LOSS_RTOL and norm_gap < NORM_RTOL and param_gap < PARAM_ATOL
    assert sp_gap < SP_LOSS_RTOL and sp_param_gap < SP_PARAM_ATOL
    assert sp["losses"][-1] < sp["losses"][0]  # it learns

    # bytes between stages: every microbatch's hidden states forward (stage 0) and
    # their gradients backward (stage 1), [b, s / tp, d] fp32 under SP
    t, dim = cfg.training, cfg.model.dim
    expected = STEPS * t.batch_size * (SEQ // 2) * dim * 4
    for rank, by_sp in enumerate(results):
        got, full = by_sp[True], by_sp[False]
        way = "forward" if got["stages"] == [0] else "backward"
        idle = "backward" if way == "forward" else "forward"
        assert got["sent"][way] == expected, (rank, got["sent"])
        assert full["sent"][way] == 2 * expected, (rank, full["sent"])
        assert got["sent"][idle] == full["sent"][idle] == 0, rank
        assert got["model_shards"] == [2] and full["model_shards"] == [1], rank


def _mismatch(rank: int, world_size: int) -> str:
    """A pipeline told another sequence split than the model's blocks emit."""
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("pp", "tp"))
    cfg = _config("-", True).model
    model = Transformer(cfg)
    apply_tp(model, mesh["tp"], sequence_parallel=True)
    assert model.sequence_shards == 2
    with pytest.raises(ValueError, match="sequence_shards = 1, but the model's blocks emit"):
        build_pipeline(model, mesh["pp"], 1, "gpipe", loss_fn, sequence_shards=1)
    runner = build_pipeline(model, mesh["pp"], 1, "gpipe", loss_fn)
    assert runner.sequence_shards == 2
    tokens = torch.zeros(2, 15, dtype=torch.long)
    with pytest.raises(ValueError, match="sequence of 15 tokens is not divisible"):
        runner.step(tokens, tokens)
    return "ok"


def test_pipeline_sequence_shards_must_match_the_model():
    assert run_distributed(_mismatch, 2) == ["ok", "ok"]


def test_sequence_not_divisible_by_tp_under_pp_is_a_config_error(tmp_path):
    base = tmp_path / "base.toml"
    base.write_text(
        "[model]\ndim = 32\nn_layers = 4\nn_heads = 4\nn_kv_heads = 4\n"
        "[training]\nseq_len = 18\nbatch_size = 2\n"
    )
    layout = ["--parallelism.tp", "4", "--parallelism.pp", "2"]
    with pytest.raises(ConfigError, match="seq_len / cp = 18 is not divisible by parallelism.tp"):
        launch_dims(load_config(base, layout))
    # without sequence parallelism the stages send whole sequences: nothing to divide
    cfg = load_config(base, [*layout, "--parallelism.sequence_parallel", "false"])
    assert cfg.parallelism.pp == 2 and not cfg.parallelism.sequence_parallel
