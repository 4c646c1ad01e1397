"""GRPO in the trainer: start-up refusals, the scores of odd completions, and runs of
the real loop: bit-for-bit generator/trainer log-probabilities (ratio exactly 1) on
every data-parallel placement at W = 2 and 3, under tp = 2, on Qwen3's attention (q/k
norms, tied embeddings) and DeepSeek-V3's MLA at W = 1 and 2, GRPO on DeepSeek's MoE
without batch-invariance, a resumed run equal to
an uninterrupted one, a raising verifier counted instead of crashing the run. The runs
start from a short pre-training on the task's format, so rewards differ within groups
and every update moves the weights; with any swapped op back to its native kernel the
same runs' bits differ."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from flexshard.testing import run_distributed
from flexshard.trainer.checkpointing.checkpoints import latest_step
from flexshard.trainer.components.metrics import summary_table
from flexshard.trainer.config import ConfigError, config_from_dict, load_config
from flexshard.trainer.rl import task
from flexshard.trainer.rl.batch_invariant import OPS
from flexshard.trainer.rl.grpo import check_rl, score
from flexshard.trainer.rl.rollout import Completion
from flexshard.trainer.train import run

from ..helpers.trainer_cases import launch_dims
from .test_deepseek_layouts import DEEPSEEK_MOE
from .test_rl_batch_invariant import FAMILIES, ROUTING

PLACEMENTS = ("shard0", "flat", "owned", "block", "mixed", "muon")


def _table(folder: str, family: str = "llama", **sections: dict) -> dict:
    """A small model, 6 prompts of 3-4 letters x 2 completions per step (6 divides over
    2 and 3 ranks). ffn_hidden = 168: rows of 168 leave silu's vector loop a scalar
    tail whenever a batch has an odd number of row pairs, so silu's swap is exercised.
    ``family``: the attention variant (``FAMILIES``)."""
    model = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 168}
    table: dict = {
        "model": {**model, **FAMILIES[family]},
        "training": {"steps": 2, "seq_len": 16, "lr": 1e-3, "muon_lr": 1e-3, "seed": 1},
        "job": {"dump_folder": folder, "progress": False, "plot": False, "tensorboard": False},
        "rl": {
            "enable": True,
            "task_max_len": 4,
            "prompts_per_step": 6,
            "group_size": 2,
            "max_new_tokens": 5,
            "batch_invariant": True,
        },
    }
    for name, values in sections.items():
        table[name] = {**table.get(name, {}), **values}
    return table


def _run(rank: int, world_size: int, table: dict) -> list[dict]:
    return run(config_from_dict(table))


PRE_STEPS = 60


def _pretrain(folder: str, family: str) -> dict:
    table = _table(
        folder,
        family,
        data={"source": "rl_task"},
        training={"steps": PRE_STEPS, "lr": 3e-3, "batch_size": 16, "warmup_steps": 5},
        checkpoint={"enable": True, "interval": PRE_STEPS},
        rl={"enable": False},
    )
    run_distributed(_run, 1, table, timeout=600)
    return {"initial_load_path": f"{folder}/checkpoint/step-{PRE_STEPS}"}


@pytest.fixture(scope="module")
def starts(tmp_path_factory) -> Callable[[str], dict]:
    """The RL runs' start by family: the model pre-trained on the task's format
    (rewards above 0 and unequal within groups, so the updates move the weights), as
    ``{"initial_load_path": ...}`` for the checkpoint section; each built once."""
    built: dict[str, dict] = {}

    def start(family: str) -> dict:
        if family not in built:
            built[family] = _pretrain(str(tmp_path_factory.mktemp(f"pre_{family}")), family)
        return built[family]

    return start


@pytest.fixture
def start(starts) -> dict:
    return starts("llama")


@pytest.mark.parametrize(
    ("section", "values", "names"),
    [
        ("parallelism", {"pp": 2}, "parallelism.pp"),
        ("parallelism", {"cp": 2}, "parallelism.cp"),
        ("parallelism", {"tp": 2}, "sequence_parallel"),
        ("rl", {"task_max_len": 12}, "training.seq_len"),
        ("rl", {"group_size": 1}, "rl.group_size"),
        ("rl", {"temperature": 0.0}, "rl.temperature"),
        ("model", {"tokenizer": "x.tiktoken"}, "model.tokenizer"),
        ("model", {"mtp_layers": 1}, "model.mtp_layers"),
    ],
)
def test_refused_before_any_rank_starts(section, values, names):
    with pytest.raises(ConfigError, match=names.replace(".", r"\.")):
        cfg = config_from_dict(_table("-", **{section: values}))  # a missing tokenizer: here
        check_rl(cfg, launch_dims(cfg))


def test_prompts_per_step_must_divide_the_data_parallel_ranks(capsys, monkeypatch, tmp_path):
    """Before any rank starts (not in the ranks, after an empty metrics.jsonl is
    written): one line naming the key and the ranks."""
    from flexshard.trainer import launch

    def spawn(*_: object) -> None:
        raise AssertionError("a rank was spawned before the error was found")

    monkeypatch.setattr(launch, "spawn", spawn)
    table = _table(str(tmp_path), rl={"prompts_per_step": 3})
    overrides = [
        f"--{section}.{key}={json.dumps(value)}"
        for section, values in table.items()
        for key, value in values.items()
    ]
    with pytest.raises(SystemExit) as exit_info:
        launch.main(["--nproc", "2", *overrides])
    line = exit_info.value.code
    assert isinstance(line, str) and "\n" not in line, line
    assert "rl.prompts_per_step = 3 is not divisible by the 2 data-parallel ranks" in line
    assert not (tmp_path / "metrics.jsonl").exists()


def test_deepseek_debug_config_names_what_rl_refuses():
    path = Path(__file__).resolve().parents[2] / "configs" / "deepseek_v3_debug.toml"

    def check(overrides: list[str]) -> None:
        cfg = load_config(path, overrides)
        check_rl(cfg, launch_dims(cfg))

    with pytest.raises(ConfigError, match=r"model\.mtp_layers = 1"):
        check(["--rl.enable", "true"])
    # its grouped experts give each row the same bits at any batch size
    # (test_rl_batch_invariant.py's deepseek_v3_moe): batch-invariant mode is allowed
    check(["--rl.enable", "true", "--model.mtp_layers", "0", "--rl.batch_invariant", "true"])
    check(["--rl.enable", "true", "--model.mtp_layers", "0"])


def test_odd_completions_are_counted():
    prompt = task.Prompt("sort cab:", "abc")

    def done(text: str, finished: bool = True) -> Completion:
        ids = torch.tensor(list((text + ("\n" if finished else "")).encode()))
        return Completion(torch.tensor([0]), ids, torch.zeros(len(ids)), finished)

    def decode(ids: torch.Tensor) -> str:
        return bytes(ids.tolist()).decode()

    group = [done("abc"), done(""), done("abcabcabc", finished=False), done("acb")]
    rewards, counts, raised = score([prompt], [group], decode)
    assert rewards.tolist() == [[1.0, 0.0, 0.0, pytest.approx(1 / 3)]]
    assert counts == {"verifier_errors": 0, "empty_completions": 1, "truncated": 1, "solved": 1}
    assert not raised


def _exact(records: list[dict]) -> None:
    for record in records:
        assert record["logprob_max_abs_diff"] == 0.0, record
        assert record["ratio_max_abs_dev"] == 0.0, record
        assert record["ratio_min"] == record["ratio_max"] == 1.0, record
    assert any(r["grad_norm"] > 0 for r in records), records  # the policy did move


def _resume(rank: int, world_size: int, folder: str, start: dict) -> tuple[list[dict], list[dict]]:
    checkpoint = {**start, "enable": True, "interval": 2}
    table = _table(folder, training={"steps": 4}, checkpoint=checkpoint)
    whole = run(config_from_dict(table))
    torch.distributed.barrier()
    if rank == 0:  # as if the job had died after the step-2 save
        shutil.rmtree(Path(folder) / "checkpoint" / "step-4")
    torch.distributed.barrier()
    return whole, run(config_from_dict(table))


def test_bitwise_at_w2_and_resume_exact(tmp_path, start):
    whole, resumed = run_distributed(_resume, 2, str(tmp_path), start, timeout=300)[0]
    _exact(whole)
    assert [r["step"] for r in resumed] == [3, 4]
    keys = ("reward", "loss", "grad_norm", "completion_len_mean", "truncated")
    assert [{k: r[k] for k in keys} for r in resumed] == [
        {k: r[k] for k in keys} for r in whole[2:]
    ]  # same prompts, samples and updates: bit for bit
    assert latest_step(tmp_path / "checkpoint") == 4


@pytest.mark.parametrize("world", [pytest.param(1, marks=pytest.mark.slow), 2])
@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3"])
def test_family_bitwise(tmp_path, starts, family, world):
    """Qwen3's q/k norms, wider heads and tied embeddings; DeepSeek-V3's MLA with its
    latent KV cache and YaRN: the same bits."""
    table = _table(str(tmp_path), family, checkpoint=starts(family))
    for records in run_distributed(_run, world, table, timeout=300):
        _exact(records)


def test_deepseek_moe_without_batch_invariance(tmp_path):
    """MLA with sigmoid-routed experts and bias balancing: GRPO runs on the native
    kernels (batch-invariant mode refuses the MoE) and the update balances the load."""
    moe = {**DEEPSEEK_MOE, "balance": "bias"}
    table = _table(str(tmp_path), "deepseek_v3", model={"moe": moe}, rl={"batch_invariant": False})
    records = run_distributed(_run, 2, table, timeout=300)[0]
    assert [r["step"] for r in records] == [1, 2]
    loads = records[-1]["tokens_per_expert"]
    assert list(loads) == ["layers.1.feed_forward"], loads  # layer 0 dense
    assert len(loads["layers.1.feed_forward"]) == 4 and sum(loads["layers.1.feed_forward"]) > 0
    assert all(0 <= r["logprob_max_abs_diff"] < 1e-3 for r in records), records


def _raising(rank: int, world_size: int, folder: str, start: dict) -> tuple[list[dict], str]:
    def broken(prompt: task.Prompt, completion: str) -> float:
        raise RuntimeError("verifier down")

    task.reward = broken  # in this spawned process only
    table = _table(folder, checkpoint={**start, "enable": True, "interval": 2})
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        records = run(config_from_dict(table))
    return records, printed.getvalue()


def test_raising_verifier_is_counted(tmp_path, start):
    records, printed = run_distributed(_raising, 1, str(tmp_path), start, timeout=300)[0]
    assert all(r["verifier_errors"] > 0 for r in records), records
    finished = [r["verifier_errors"] + r["truncated"] for r in records]
    assert finished == [12, 12]  # every completion: scored 0, counted, run finished
    assert all(r["reward"] == 0.0 for r in records)
    assert latest_step(tmp_path / "checkpoint") == 2
    assert printed.count("rl: the verifier raised on") == 1  # once, then counted


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_bitwise_on_every_placement(tmp_path, start, world, placement):
    optimizer = "muon" if placement == "muon" else "adamw"
    table = _table(
        str(tmp_path),
        checkpoint=start,
        parallelism={"placement": placement},
        training={"optimizer": optimizer},
        activation_checkpoint={"mode": "full" if world == 3 else "none"},
    )
    for records in run_distributed(_run, world, table, timeout=600):
        _exact(records)


@pytest.mark.slow
def test_bitwise_under_tp2_with_kl(tmp_path, start):
    table = _table(
        str(tmp_path),
        checkpoint=start,
        parallelism={"tp": 2, "sequence_parallel": False},
        rl={"kl_coef": 0.05},
    )
    for records in run_distributed(_run, 2, table, timeout=600):
        _exact(records)
        assert records[0]["kl"] == 0.0  # step 1: the policy is the reference
        assert records[1]["kl"] > 0.0


def _without(rank: int, world_size: int, table: dict, op: str | None) -> list[dict]:
    if op is not None:  # this op back to its native kernel, in this spawned process
        del OPS[op]
    return run(config_from_dict(table))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "op", "world"),
    [
        *(("llama", op, w) for op in [None, *sorted(set(OPS) - {ROUTING})] for w in (2, 3)),
        ("deepseek_v3", ROUTING, 2),  # MLA's attention on sdpa's math path
    ],
)
def test_native_kernels_differ(tmp_path, starts, family, op, world):
    """The bitwise runs' setting with the native kernels (op None: the mode off) or
    any one op back to its own: the generator and trainer disagree in the last bits."""
    table = _table(
        str(tmp_path),
        family,
        checkpoint=starts(family),
        rl={"batch_invariant": op is not None},
        training={"steps": 3},
        activation_checkpoint={"mode": "full" if world == 3 else "none"},
    )
    records = run_distributed(_without, world, table, op, timeout=600)[0]
    assert max(r["logprob_max_abs_diff"] for r in records) > 0.0, op


def test_summary_reports_reward_and_solved_over_the_first_and_last_tenth():
    records = [
        {"step": s, "loss": 0.1, "tokens_per_s": 1.0, "mfu": 0.0, "peak_memory_mb": 1.0,
         "grad_norm": 1.0, "reward": s / 20, "solved": 1.0 if s > 18 else 0.0}
        for s in range(1, 21)
    ]  # fmt: skip
    table = summary_table(records, {"run": "rl"})
    assert "reward first -> last   0.075 -> 0.975  (means of 2 steps each)" in table
    assert "solved first -> last   0.000 -> 1.000  (means of 2 steps each)" in table
    plain = [{k: v for k, v in r.items() if k not in ("reward", "solved")} for r in records]
    assert "reward" not in summary_table(plain, {"run": "pre-training"})
