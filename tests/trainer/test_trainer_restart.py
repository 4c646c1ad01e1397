"""Restarts under real torchrun: a worker SIGKILLed (or hung) mid-run, torchrun's
``--max-restarts 1`` starts the group again, the new process group forms (torch >= 2.5
shares the agent's store across attempts: pytorch/pytorch#135712), the job resumes
from the newest complete checkpoint and every loss after it equals the uninterrupted
run's bit for bit. On one node (``--standalone``) and on two "nodes" of one machine
(two torchruns, c10d rendezvous). And what a worker SIGSTOPped mid-run leaves the
other to say first."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from torch.distributed.elastic.utils.distributed import get_free_port

from flexshard.trainer.components.metrics import read_metrics

from ..runtime.test_faults import first_error_line

ROOT = Path(__file__).resolve().parents[2]
FAULT_SCRIPT = str(ROOT / "tests" / "helpers" / "torchrun_fault.py")
STEPS, INTERVAL, FAULT_STEP = 12, 5, 7  # the fault during step 8: resume from step-5
TIMEOUT_S = 180


def _job_args(out: Path, *extra: str) -> list[str]:
    return [
        "--config", "configs/debug.toml", "--training.steps", str(STEPS),
        "--checkpoint.enable", "true", "--checkpoint.interval", str(INTERVAL),
        "--job.dump_folder", str(out), "--job.tensorboard", "false",
        "--job.plot", "false", "--job.progress", "false", *extra,
    ]  # fmt: skip


def _launch(launcher: list[str], job: list[str], env: dict[str, str]) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", *launcher, FAULT_SCRIPT, *job]
    # its own session: the finally below can end torchrun and its workers together
    return subprocess.Popen(
        command,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _run_all(procs: list[subprocess.Popen]) -> list[tuple[int, str]]:
    """Every launcher's (exit code, output); any still running at the end is killed."""
    try:
        results = []
        for proc in procs:
            output, _ = proc.communicate(timeout=TIMEOUT_S)
            results.append((proc.returncode, output))
        return results
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _fault_env(tmp: Path, fault: str, rank: int = 1) -> dict[str, str]:
    marker = tmp / f"{fault}.marker"
    return {
        "FAULT": fault,
        "FAULT_RANK": str(rank),
        "FAULT_STEP": str(FAULT_STEP),
        "FAULT_MARKER": str(marker),
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """The uninterrupted run's records (torchrun, 2 ranks, no fault)."""
    tmp = tmp_path_factory.mktemp("reference")
    env = _fault_env(tmp, "kill", rank=-1)  # a rank that does not exist: no fault
    launcher = ["--standalone", "--nproc-per-node", "2"]
    [(code, output)] = _run_all([_launch(launcher, _job_args(tmp / "out"), env)])
    assert code == 0, output[-3000:]
    return read_metrics(tmp / "out" / "metrics.jsonl")


def _check_resumed(out: Path, outputs: str, marker: Path, reference: list[dict]) -> None:
    assert marker.exists(), "the fault was never injected"
    assert f"resumed from {out / 'checkpoint' / 'step-5'} at step 5" in outputs
    assert "connectFullMesh failed" not in outputs
    lines = (out / "metrics.jsonl").read_text().splitlines()
    logged = [json.loads(line)["step"] for line in lines]
    # the first attempt logged up to step 7, the second from step 6 on: 6 and 7 twice
    assert logged == [*range(1, FAULT_STEP + 1), *range(INTERVAL + 1, STEPS + 1)]
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for got, want in zip(records, reference, strict=True):
        assert (got["loss"], got["grad_norm"]) == (want["loss"], want["grad_norm"]), got["step"]


def test_standalone_restart_after_sigkill_is_bit_for_bit(tmp_path, reference):
    env = _fault_env(tmp_path, "kill")
    launcher = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1"]
    [(code, output)] = _run_all([_launch(launcher, _job_args(tmp_path / "out"), env)])
    assert code == 0, output[-4000:]
    _check_resumed(tmp_path / "out", output, Path(env["FAULT_MARKER"]), reference)


def test_two_nodes_restart_after_sigkill_is_bit_for_bit(tmp_path, reference):
    """Two torchruns, one worker each, meeting at a c10d rendezvous on localhost; the
    second node's worker is killed, both agents restart their workers."""
    env = _fault_env(tmp_path, "kill")
    launcher = [
        "--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{get_free_port()}",
        "--rdzv-id", "restart-test",
    ]  # fmt: skip
    job = _job_args(tmp_path / "out")
    results = _run_all([_launch(launcher, job, env), _launch(launcher, job, env)])
    outputs = "\n".join(output for _, output in results)
    assert [code for code, _ in results] == [0, 0], outputs[-4000:]
    _check_resumed(tmp_path / "out", outputs, Path(env["FAULT_MARKER"]), reference)


@pytest.mark.slow
def test_standalone_restart_after_a_hang_is_bit_for_bit(tmp_path, reference):
    """A worker that stops answering: the other rank's collective times out after
    ``parallelism.timeout_s``, its failure makes torchrun stop both and restart."""
    env = _fault_env(tmp_path, "hang")
    launcher = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1"]
    job = _job_args(tmp_path / "out", "--parallelism.timeout_s", "10")
    [(code, output)] = _run_all([_launch(launcher, job, env)])
    assert code == 0, output[-4000:]
    _check_resumed(tmp_path / "out", output, Path(env["FAULT_MARKER"]), reference)


def _until_workers_stopped(proc: subprocess.Popen, marker: Path) -> str:
    """torchrun's output up to its stopping the workers after the first failure; then
    torchrun and the stopped worker (``marker`` names it) are killed: torchrun would
    wait 30 s for that worker to take SIGTERM, and its workers have their own session."""
    timer = threading.Timer(TIMEOUT_S, os.killpg, (proc.pid, signal.SIGKILL))
    timer.start()
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "closing signal" in line and first_error_line("".join(lines), "[rank0]: "):
                break
    finally:
        timer.cancel()
        stopped = re.search(r"pid (\d+)", marker.read_text()) if marker.exists() else None
        if stopped is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(stopped.group(1)), signal.SIGKILL)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return "".join(lines)


def test_a_sigstopped_worker_makes_the_other_name_the_collective_first(tmp_path):
    """Rank 1 SIGSTOPped before step 8: rank 0's first error line names the all-gather,
    its bucket, the group's ranks and the timeout, whether flexshard's bounded wait or
    gloo's own timeout (the group's, the same ``timeout_s``) noticed first."""
    env = _fault_env(tmp_path, "stop")
    launcher = ["--standalone", "--nproc-per-node", "2"]
    job = _job_args(tmp_path / "out", "--parallelism.timeout_s", "4")
    output = _until_workers_stopped(_launch(launcher, job, env), Path(env["FAULT_MARKER"]))
    assert Path(env["FAULT_MARKER"]).exists(), output[-3000:]
    first = first_error_line(output, "[rank0]: ")
    assert first is not None, output[-3000:]
    name, message = first
    assert name.endswith("CollectiveError"), output[-3000:]
    assert re.match(
        r"flexshard: all-gather of bucket 'outer' (did not complete within the timeout "
        r"\(4 s\)|failed [\d.]+ s after launch \(timeout 4 s\)) on rank 0 "
        r"\(group ranks \[0, 1\]\)",
        message,
    ), message
