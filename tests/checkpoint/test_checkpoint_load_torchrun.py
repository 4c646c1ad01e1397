"""A rank that dies mid-load under real torchrun: the elastic agent serves the job's
store (not rank 0) and answers the death by sending the other workers SIGTERM, so the
surviving rank must name the dead rank before the agent ends it, whether the rank died
in the read or in the checks before it. One torchrun of 2 workers per case (rank 0,
whose death does not take the store with it here, and rank 1);
``tests/helpers/torchrun_load_death.py`` is the job."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flexshard as fs
from flexshard.checkpoint.load_progress import LoadProgress
from flexshard.testing import TinyTransformer, TransformerConfig

ROOT = Path(__file__).resolve().parents[2]
JOB = str(ROOT / "tests" / "helpers" / "torchrun_load_death.py")
TIMEOUT_S = 180  # the machine is shared; the job itself takes seconds
# the agent's SIGKILL follows its SIGTERM by 30 s: the survivor must have spoken well before
NAMED_WITHIN_S = 20


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("torchrun_load") / "ckpt"
    torch.manual_seed(0)
    model = TinyTransformer(TransformerConfig())
    fs.checkpoint.save(root, model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    return root


#: where the victim dies: the step the survivor is left waiting in
STEPS = {
    "read": "DCP's read (all-gather)",
    # the victim dies checking the manifest rank 0 sent: the survivor waits in the
    # gather of every rank's findings
    "check": "the load's check (check all-gather)",
}


# rank 0 is the case a store on rank 0 would not cover; rank 1 as well (slow)
@pytest.mark.parametrize(
    ("phase", "victim"),
    [("read", 0), ("check", 0)]
    + [pytest.param(p, 1, marks=pytest.mark.slow) for p in ("read", "check")],
)
def test_the_survivor_names_the_rank_that_died_mid_load(tmp_path, saved, phase, victim):
    results = tmp_path / "results"
    results.mkdir()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", JOB, str(saved), str(results)]  # fmt: skip
    env = {**os.environ, "VICTIM": str(victim), "PHASE": phase, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode != 0, output[-3000:]  # the victim's exit fails the job
    assert "exitcode  : 3" in output, output[-3000:]
    survivor = 1 - victim
    assert not (results / f"rank{victim}.json").exists()
    report = results / f"rank{survivor}.json"
    assert report.exists(), f"the agent ended rank {survivor} before it spoke:\n{output[-3000:]}"
    got = json.loads(report.read_text())
    assert got["type"] == "CollectiveError", got
    named = re.escape(f"in {STEPS[phase]}: rank(s) [{victim}] never")
    assert re.search(named, got["error"]), got
    assert "torchrun's agent is stopping the workers" in got["error"], got
    assert got["seconds"] < NAMED_WITHIN_S, got


def _progress() -> LoadProgress:
    """A LoadProgress with no group: ``holding_agent_stop`` reads none."""
    progress = LoadProgress.__new__(LoadProgress)
    progress.agent_stopped = False
    return progress


def test_a_load_that_completes_delivers_the_held_stop(monkeypatch):
    delivered: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: delivered.append(signum))
    try:
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
        progress = _progress()
        with progress.holding_agent_stop():
            signal.raise_signal(signal.SIGTERM)
            assert progress.agent_stopped and delivered == []  # held while loading
        assert delivered == [signal.SIGTERM]  # then the previous handler has it
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # rank 0 hosts the store
        progress = _progress()
        with progress.holding_agent_stop():
            signal.raise_signal(signal.SIGTERM)
        assert not progress.agent_stopped and delivered == [signal.SIGTERM] * 2
    finally:
        signal.signal(signal.SIGTERM, previous)
