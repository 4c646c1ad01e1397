"""Asynchronous trainer checkpoints (``[checkpoint] async_mode``) and retention
(``keep_latest_k``): the same bytes as a synchronous save, an exact resume, exactly k
kept, no collective on the training groups after the first save, and the fault cases
(full disk, a kill while staging, writing or finishing) in ``test_..._faults``."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from flexshard.testing import run_distributed
from flexshard.testing.collectives import record_collectives
from flexshard.trainer import checkpointing
from flexshard.trainer.checkpointing import latest_step
from flexshard.trainer.retention import purge
from flexshard.trainer.train import run

from .trainer_cases import tiny_config

STEPS = 6
MODES = ("disabled", "async", "async_with_pinned_mem")


def _cfg(folder: str, backend: str, mode: str, **checkpoint):
    return tiny_config(
        folder,
        training={"steps": STEPS, "batch_size": 2},
        parallelism={"dp_backend": backend},
        checkpoint={"enable": True, "interval": 2, "async_mode": mode, **checkpoint},
    )


def _losses(records: list[dict]) -> list[float]:
    return [r["loss"] for r in records]


def _same_and_resumed(rank: int, world_size: int, folder: str) -> dict:
    """Per backend and mode: the losses, the checkpoints left (keep_latest_k = 2 for
    the async modes), and the losses of a run resumed from step 4 (the async modes)."""
    out: dict = {}
    for backend in ("flexshard", "fsdp2"):
        for mode in MODES:
            keep = 0 if mode == "disabled" else 2
            cfg = _cfg(f"{folder}/{backend}-{mode}", backend, mode, keep_latest_k=keep)
            whole = _losses(run(cfg))
            root = Path(cfg.job.dump_folder) / cfg.checkpoint.folder
            left = sorted(p.name for p in root.iterdir())
            resumed = None
            if mode != "disabled":
                dist.barrier()
                if rank == 0:  # as if killed while writing step 6: newest is step 4
                    shutil.copytree(root / f"step-{STEPS}", root / "kept")
                    (root / f"step-{STEPS}").rename(root / f"step-{STEPS}.partial")
                    (root / f"step-{STEPS}.partial" / "flexshard.json").unlink(missing_ok=True)
                dist.barrier()
                records = run(cfg)
                resumed = ([r["step"] for r in records], _losses(records))
            out[(backend, mode)] = (whole, left, resumed)
    return out


def _files(step_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in step_dir.iterdir() if p.suffix in (".distcp", ".pt")}


def _metadata(step_dir: Path) -> tuple:
    """.metadata less what differs between any two saves (its random save id and the
    folder it was written to): every key, shape, dtype, chunk, file and byte range."""
    md = FileSystemReader(str(step_dir)).read_metadata()
    return md.state_dict_metadata, md.storage_data, md.planner_data


def test_async_checkpoints_match_sync_resume_exactly_and_keep_k(tmp_path):
    results = run_distributed(_same_and_resumed, 3, str(tmp_path), timeout=600)
    for rank, per_run in enumerate(results):
        for (backend, mode), (whole, left, resumed) in per_run.items():
            assert whole == per_run[(backend, "disabled")][0], (backend, mode, rank)
            if mode == "disabled":
                assert left == ["step-2", "step-4", "step-6"], (backend, left)
                continue
            assert left == ["step-4", "step-6"], (backend, mode, left)  # exactly k = 2
            steps, losses = resumed
            assert steps == [5, 6], (backend, mode, rank)
            assert losses == whole[4:], (backend, mode, rank)  # bit for bit
    for backend in ("flexshard", "fsdp2"):
        sync = tmp_path / f"{backend}-disabled" / "checkpoint" / f"step-{STEPS}"
        for mode in MODES[1:]:
            root = tmp_path / f"{backend}-{mode}" / "checkpoint"
            copy = root / "kept"  # the async step-6 save, before the resume rewrote it
            assert _files(copy) == _files(sync) and _files(sync), (backend, mode)
            assert _metadata(copy) == _metadata(sync), (backend, mode)
            again = root / f"step-{STEPS}"  # the resumed run's own step-6 save
            assert _files(again) == _files(sync), (backend, mode)
            assert not (root / f"step-{STEPS}.partial").exists()  # removed by the new save


def _counted(rank: int, world_size: int, folder: str) -> dict:
    """Collectives per save, from the save call until the save is complete (the
    training thread's and the background's)."""
    out = {}
    real_save = checkpointing.save
    real_plan = DefaultSavePlanner.create_local_plan
    for backend in ("flexshard", "fsdp2"):
        per_save: list[dict] = []
        plans: list[int] = []

        def counted_save(job, step, per_save=per_save):
            # open before the background starts, closed once the save is complete
            with record_collectives() as log:
                real_save(job, step)
                job.checkpointer.wait()
            ours = job.checkpointer._group.group_name
            per_save.append(
                {
                    "ours": log.on(ours),
                    "others": [r.name for r in log.records if set(r.groups) - {ours}],
                    "new": [r.name for r in log.records if not r.groups],
                }
            )

        def plan(self, plans=plans):
            local = real_plan(self)
            plans.append(len(local.items))
            return local

        checkpointing.save = counted_save
        DefaultSavePlanner.create_local_plan = plan
        try:
            run(_cfg(f"{folder}/{backend}", backend, "async", interval=1))
        finally:
            checkpointing.save = real_save
            DefaultSavePlanner.create_local_plan = real_plan
        out[backend] = (per_save, plans)
    return out


#: a save's collectives, all on the checkpointer's own gloo group: DCP's plan exchange
#: (gather + scatter; empty plans once cached) and write results (gather + broadcast),
#: then the chunk checksums and rank 0's completion status
BACKGROUND = [
    "gather_object",
    "scatter_object_list",
    "gather_object",
    "broadcast_object_list",
    "all_gather_object",
    "all_gather_object",
]


def test_no_collective_on_the_training_groups_after_the_first_save(tmp_path):
    results = run_distributed(_counted, 2, str(tmp_path), timeout=600)
    for rank, per_backend in enumerate(results):
        for backend, (per_save, plans) in per_backend.items():
            assert len(per_save) == STEPS
            first, later = per_save[0], per_save[1:]
            # the first save makes the checkpointer's group (flexshard: and gathers the
            # optimizer's param groups over the ranks, on that group)
            union = ["all_gather_object"] if backend == "flexshard" else []
            assert first == {"ours": union + BACKGROUND, "others": [], "new": ["new_group"]}
            for save in later:  # the background's alone: nothing on a training group
                assert save == {"ours": BACKGROUND, "others": [], "new": []}, (backend, save)
            # the plans are cached: after the first save every rank sends an empty plan
            assert plans[0] > 0 and plans[1:] == [0] * (STEPS - 1), (backend, rank, plans)


def _layout(root: Path, complete: list[int], partial: list[int], bare: list[int]) -> None:
    for step in complete:
        (root / f"step-{step}").mkdir(parents=True)
        (root / f"step-{step}" / ".metadata").write_bytes(b"x")
    for step in partial:
        (root / f"step-{step}.partial").mkdir(parents=True)
    for step in bare:  # a DCP folder whose save was killed before .metadata
        (root / f"step-{step}").mkdir(parents=True)


def test_purge_keeps_the_newest_complete_and_never_an_incomplete_newest(tmp_path):
    _layout(tmp_path, complete=[3, 5, 7], partial=[1, 9], bare=[2, 11])
    deleted = purge(tmp_path, 1)
    # step-11 (killed while writing) and step-9.partial are newer than 7: kept; 7 is the
    # newest complete one and stays, whatever is newer and incomplete
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-11", "step-7", "step-9.partial"]
    assert [p.name for p in deleted] == ["step-1.partial", "step-2", "step-3", "step-5"]
    assert latest_step(tmp_path) == 7
    assert purge(tmp_path, 1) == []  # nothing more to delete
    with pytest.raises(ValueError, match="at least 1"):
        purge(tmp_path, 0)
