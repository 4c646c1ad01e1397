"""The trainer's resume under Muon with Owned matrices (``placement = "muon"``: each
matrix whole on one rank, DistMuon's state with it) reads each stored chunk once with
``[checkpoint] reads = "striped"`` and loads DCP's values bit for bit: from a checkpoint
saved in that layout (2 replicas x 2 shards), and across a layout change (saved on
Shard(0) at 2 x 2, resumed on Owned at 1 x 4). One spawn of 4 ranks."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

from flexshard.checkpoint import striped_read
from flexshard.checkpoint.state import state_dict
from flexshard.testing import run_distributed
from flexshard.trainer import train
from flexshard.trainer.checkpointing import checkpoints as checkpointing

from ..helpers.trainer_cases import tiny_config

MUON = {"optimizer": "muon", "steps": 1}
#: (saved placement and mesh, resumed placement and mesh)
CASES = {
    "owned 2x2 -> owned 2x2": (("muon", 2, 2), ("muon", 2, 2)),
    "shard0 2x2 -> owned 1x4": (("shard0", 2, 2), ("muon", 1, 4)),
}


def _config(folder: str, placement: str, replicate: int, shard: int, steps: int) -> Any:
    return tiny_config(
        folder,
        training={**MUON, "steps": steps},
        parallelism={"dp_replicate": replicate, "dp_shard": shard, "placement": placement},
        checkpoint={"enable": True, "interval": 1},
    )


def _leaves(value: Any) -> list[Any]:
    """Every value a state holds, in order: this rank's local tensors, plain data."""
    if isinstance(value, DTensor):
        return [value.to_local().clone()]
    if isinstance(value, torch.Tensor):
        return [value.clone()]
    if isinstance(value, Mapping):
        return [leaf for k in sorted(value, key=str) for leaf in [k, *_leaves(value[k])]]
    if isinstance(value, list | tuple):
        return [leaf for v in value for leaf in _leaves(v)]
    if dataclasses.is_dataclass(value):
        return _leaves(dataclasses.asdict(value))
    return [value]


def _equal(a: list[Any], b: list[Any]) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor):
            if x.dtype != y.dtype or not torch.equal(x, y):
                return False
        elif x != y:
            return False
    return True


class _Stripes:
    """Bytes the striped reader took from chunk files in this process."""

    bytes = 0

    @classmethod
    def install(cls) -> None:
        read = striped_read.StripedReader._read

        def counted(reader: Any, index: Any, files: Any) -> bytes:
            data = read(reader, index, files)
            cls.bytes += len(data)
            return data

        striped_read.StripedReader._read = counted


def _resumes(rank: int, world: int, folder: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    _Stripes.install()
    out: dict[str, Any] = {}
    for case, (saved, resumed) in CASES.items():
        case_folder = f"{folder}/{case.split()[0]}"
        train.run(_config(case_folder, *saved, steps=1))
        loads: dict[str, Any] = {}
        for reads in ("dcp", "striped"):
            job = train.setup(_config(case_folder, *resumed, steps=2))
            fresh = [p.to_local().clone() for p in job.model.parameters()]
            job.cfg.checkpoint.reads = reads
            stripes = _Stripes.bytes
            step = checkpointing.maybe_resume(job)
            values = _leaves(state_dict(checkpointing._model(job), job.optimizer))
            moved = [p.to_local() for p in job.model.parameters()]
            loads[reads] = {
                "step": step,
                "values": values,
                "stripe": _Stripes.bytes - stripes,
                "moved": any(not torch.equal(a, b) for a, b in zip(fresh, moved, strict=True)),
            }
        out[case] = loads
    return out


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    folder = tmp_path_factory.mktemp("striped_resume")
    return folder, run_distributed(_resumes, 4, os.fspath(folder), timeout=600)


@pytest.mark.parametrize("case", list(CASES))
def test_striped_resume_is_dcps_bit_for_bit(resumed, case):
    _, results = resumed
    for rank, result in enumerate(results):
        dcp, striped = result[case]["dcp"], result[case]["striped"]
        assert dcp["step"] == striped["step"] == 1, (rank, dcp["step"], striped["step"])
        assert dcp["moved"] and striped["moved"], rank  # the load changed the weights
        assert len(dcp["values"]) > 0 and _equal(dcp["values"], striped["values"]), rank


@pytest.mark.parametrize("case", list(CASES))
def test_striped_resume_reads_each_chunk_once(resumed, case):
    folder, results = resumed
    root = folder / case.split()[0] / "checkpoint" / "step-1"
    chunks = sum(f.stat().st_size for f in root.glob("*.distcp"))
    stripes = [result[case]["striped"]["stripe"] for result in results]
    assert sum(stripes) == chunks, (stripes, chunks)
    assert max(stripes) < 0.6 * chunks, stripes  # shared out, not all on one rank
