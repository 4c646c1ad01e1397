"""The trainer as torchrun runs it (``-m flexshard.trainer``), with one fault injected
for the fault tests: the worker of global rank ``FAULT_RANK`` SIGKILLs itself
(``FAULT=kill``), stops answering (``FAULT=hang``) or SIGSTOPs itself (``FAULT=stop``,
as a debugger or a frozen host would) when it is about to run training step index
``FAULT_STEP``. Once per job: the first faulty worker writes
``FAULT_MARKER``, so the restarted attempt runs clean (torchrun's restart counts are
per node, and ranks may move between nodes at a new rendezvous round)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import flexshard.trainer.train as train
from flexshard.trainer.launch import main

_train_step = train.train_step


def _faulty_step(job: train.Job, step: int) -> tuple[float, float, float]:
    marker = Path(os.environ["FAULT_MARKER"])
    due = step == int(os.environ["FAULT_STEP"]) and job.rank == int(os.environ["FAULT_RANK"])
    if due and not marker.exists():
        marker.write_text(f"{os.environ['FAULT']} at step index {step}, pid {os.getpid()}\n")
        if os.environ["FAULT"] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if os.environ["FAULT"] == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        while True:  # hang: the other ranks' collectives time out, torchrun stops us
            time.sleep(1)
    return _train_step(job, step)


if __name__ == "__main__":
    train.train_step = _faulty_step  # run() looks it up at call time
    main(sys.argv[1:])
