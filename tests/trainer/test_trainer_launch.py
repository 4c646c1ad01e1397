"""The trainer end to end from the command line: the console script's own spawning
(MoE + Muon at W = 4), torchrun (W = 3, BlockShard), and config errors."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from flexshard.trainer.config import ConfigError
from flexshard.trainer.launch import exit_on_config_error, main

ROOT = Path(__file__).resolve().parents[2]
QUIET = ["--job.tensorboard", "false"]


def _train(*args: str, torchrun: int = 0, timeout: float = 240) -> subprocess.CompletedProcess:
    if torchrun:
        # --standalone: a free local rendezvous port, not a fixed one other jobs may hold
        launcher = ["-m", "torch.distributed.run", "--standalone"]
        launcher += ["--nproc-per-node", str(torchrun)]
        command = [sys.executable, *launcher, "-m", "flexshard.trainer", *args]
    else:  # what the `flexshard-train` console script runs
        command = [sys.executable, "-m", "flexshard.trainer.launch", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def _records(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_console_script_spawns_ranks_and_moe_with_muon_learns(tmp_path):
    out = tmp_path / "moe"
    done = _train(
        "--nproc", "4", "--config", "configs/moe_debug.toml",
        "--training.steps", "12", "--training.optimizer", "muon",
        "--parallelism.placement", "muon", "--job.dump_folder", str(out), *QUIET,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    records = _records(out)
    assert [r["step"] for r in records] == list(range(1, 13))
    for key in ("loss", "tokens_per_s", "grad_norm", "lr", "mfu", "peak_memory_mb"):
        assert all(r[key] > 0 for r in records), key
    # one bucket per block plus the root's parts
    layers = {k for k in records[-1]["comm_bytes"] if k.startswith("layers.")}
    assert layers and set(records[-1]["comm_bytes"]) == {
        *layers,
        "outer",
        "grad_agreement",
        "total",
    }
    assert records[-1]["loss"] < 0.9 * records[0]["loss"]  # MoE + Muon/AdamW learns
    # what the user watches: tqdm's bar (\r redraws, read back as \n) with its rate and
    # the loss, reaching 12/12; the summary table; the PNG
    bar = done.stderr.splitlines()
    assert any(line.startswith("100%") and "12/12" in line and "loss" in line for line in bar)
    assert "step/s" in done.stderr
    assert "loss first -> last" in done.stdout and "layers.0" in done.stdout
    if importlib.util.find_spec("matplotlib"):  # the train extra
        assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "loss plot skipped: matplotlib is not installed" in done.stdout


def test_torchrun_runs_the_module(tmp_path):
    out = tmp_path / "debug"
    done = _train(
        "--config", "configs/debug.toml", "--training.steps", "3",
        "--parallelism.placement", "block", "--parallelism.block", "[16, 32]",
        "--job.dump_folder", str(out), "--job.plot", "false", *QUIET,
        torchrun=3,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    records = _records(out)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert "dp_shard=3" in done.stdout and "flexshard (block)" in done.stdout


def test_cli_config_errors_are_one_clear_line():
    """Bad input stops the command before any process is spawned, with one line."""
    for args, message in [
        (["--training.stepz", "3"], "config error: unknown config key 'training.stepz'"),
        (["--nproc", "3", "--parallelism.dp_shard", "2"], "multiply to 2"),
        (["--nproc", "6", "--parallelism.cp", "3"], "2 * parallelism.cp = 6"),
        (["--nproc", "0"], "--nproc 0: must be at least 1"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main(["--config", str(ROOT / "configs/debug.toml"), *args])
        assert message in str(exit_info.value.code), exit_info.value.code


def test_a_config_error_reaches_torchruns_summary_from_any_rank(tmp_path, monkeypatch):
    """A rank that fails without printing leaves its line where torchrun's failure
    summary reads it (torch's own reader), so the line shows whichever rank fails first."""
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    with pytest.raises(SystemExit) as exit_info:
        exit_on_config_error(ConfigError("data.paths: 'x/train.txt' matches no file"), False)
    assert exit_info.value.code == 1
    failure = ProcessFailure(local_rank=1, pid=1, exitcode=1, error_file=str(error_file))
    summary = ChildFailedError("flexshard.trainer", {1: failure}).format_msg()
    line = "flexshard-train: config error: data.paths: 'x/train.txt' matches no file"
    assert f"traceback : {line}" in summary
