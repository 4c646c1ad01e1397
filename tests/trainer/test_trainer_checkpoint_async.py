"""Asynchronous trainer checkpoints (``[checkpoint] async_mode``) and retention
(``keep_latest_k``): the same bytes as a synchronous save, an exact resume, exactly k
kept, no collective on the training groups after the first save, and the fault cases
(full disk, a kill while staging, writing or finishing) in ``test_..._faults``."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _FileSystemWriter

from flexshard.checkpoint import async_save
from flexshard.checkpoint.async_save import SaveError
from flexshard.checkpoint.chunk_stager import ChunkStager
from flexshard.checkpoint.manifest import read_manifest
from flexshard.testing import run_distributed
from flexshard.testing.collectives import record_collectives
from flexshard.trainer.checkpointing import checkpoints as checkpointing
from flexshard.trainer.checkpointing.checkpoints import latest_step
from flexshard.trainer.checkpointing.retention import purge
from flexshard.trainer.config import Config, ConfigError, config_from_dict
from flexshard.trainer.train import run

from ..helpers.trainer_cases import tiny_config

STEPS = 6
MODES = ("disabled", "async", "async_with_pinned_mem")
#: (backend, placement) -> the async modes run; "owned" buckets save RegionTensor chunks
#: (whole parameters on one rank), which torch's own stagers cannot copy
VARIANTS = {
    ("flexshard", "shard0"): MODES[1:],
    ("fsdp2", "shard0"): MODES[1:],
    ("flexshard", "owned"): ("async_with_pinned_mem",),
}


def _cfg(folder: str, backend: str, mode: str, placement: str = "shard0", **checkpoint):
    return tiny_config(
        folder,
        training={"steps": STEPS, "batch_size": 2},
        parallelism={"dp_backend": backend, "placement": placement},
        checkpoint={"enable": True, "interval": 2, "async_mode": mode, **checkpoint},
    )


def _losses(records: list[dict]) -> list[float]:
    return [r["loss"] for r in records]


def _same_and_resumed(rank: int, world_size: int, folder: str) -> dict:
    """Per variant and mode: the losses, the checkpoints left (keep_latest_k = 2 for
    the async modes), and the losses of a run resumed from step 4 (the async modes)."""
    out: dict = {}
    for (backend, placement), modes in VARIANTS.items():
        for mode in ("disabled", *modes):
            keep = 0 if mode == "disabled" else 2
            where = f"{folder}/{backend}-{placement}-{mode}"
            cfg = _cfg(where, backend, mode, placement, keep_latest_k=keep)
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
            out[(backend, placement, mode)] = (whole, left, resumed)
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
        for (backend, placement, mode), (whole, left, resumed) in per_run.items():
            case = (backend, placement, mode, rank)
            assert whole == per_run[(backend, placement, "disabled")][0], case
            if mode == "disabled":
                assert left == ["step-2", "step-4", "step-6"], (case, left)
                continue
            assert left == ["step-4", "step-6"], (case, left)  # exactly k = 2
            steps, losses = resumed
            assert steps == [5, 6], case
            assert losses == whole[4:], case  # bit for bit
    for (backend, placement), modes in VARIANTS.items():
        sync = tmp_path / f"{backend}-{placement}-disabled" / "checkpoint" / f"step-{STEPS}"
        for mode in modes:
            root = tmp_path / f"{backend}-{placement}-{mode}" / "checkpoint"
            copy = root / "kept"  # the async step-6 save, before the resume rewrote it
            assert _files(copy) == _files(sync) and _files(sync), (backend, placement, mode)
            assert _metadata(copy) == _metadata(sync), (backend, placement, mode)
            again = root / f"step-{STEPS}"  # the resumed run's own step-6 save
            assert _files(again) == _files(sync), (backend, placement, mode)
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


# ---------------------------------------------------------------- faults
FAULT_STEPS = 4  # saves at 2 and 4; the fault hits the step-4 save


def _fault_cfg(folder: str, backend: str, mode: str):
    return tiny_config(
        folder,
        training={"steps": FAULT_STEPS, "batch_size": 2},
        parallelism={"dp_backend": backend},
        checkpoint={"enable": True, "interval": 2, "async_mode": mode},
    )


@contextlib.contextmanager
def _patched(*patches: tuple[object, str, object]):
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def _full_disk(rank: int):
    """A writer that fills the disk on ``rank`` while writing step 4: part of its file
    written, then ENOSPC naming the file."""
    real = _FileSystemWriter.write_data

    def write_data(self, plan, planner):
        if dist.get_rank() == rank and f"step-{FAULT_STEPS}" in str(self.path):
            path = os.path.join(str(self.path), f"__{rank}_0.distcp")
            with open(path, "wb") as f:
                f.write(b"\0" * 100)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return real(self, plan, planner)

    return write_data


def _killed(phase: str):
    """Patches that stop the step-4 save in ``phase`` as a killed process would: the
    error raised there, and nothing cleaned up after it."""
    if phase == "staging":
        real_stage, calls = ChunkStager.stage, []

        def stage(self, state_dict):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("killed while staging")
            return real_stage(self, state_dict)

        return [(ChunkStager, "stage", stage)]
    if phase == "writing":
        real_write = _FileSystemWriter.write_data

        def write_data(self, plan, planner):
            if f"step-{FAULT_STEPS}" in str(self.path):
                with open(os.path.join(str(self.path), f"__{dist.get_rank()}_0.distcp"), "wb") as f:
                    f.write(b"\0" * 100)
                raise RuntimeError("killed while writing")
            return real_write(self, plan, planner)

        fault = [(_FileSystemWriter, "write_data", write_data)]
    elif phase == "checksums":  # DCP's .metadata written, no manifest yet
        real_digest = async_save.digest

        def digest(root, entry):
            if f"step-{FAULT_STEPS}" in root:
                raise RuntimeError("killed while hashing")
            return real_digest(root, entry)

        fault = [(async_save, "digest", digest)]
    else:  # "renaming": the manifest written, the folder not yet renamed
        real_move = async_save._move_into_place

        def move(partial, final):
            if final.endswith(f"step-{FAULT_STEPS}"):
                raise OSError(errno.EIO, "killed before the rename")
            return real_move(partial, final)

        fault = [(async_save, "_move_into_place", move)]
    return [*fault, (async_save, "discard", lambda partial: None)]


def _attempt(cfg, patches) -> str | None:
    with _patched(*patches):
        try:
            run(cfg)
        except (SaveError, RuntimeError) as err:
            return str(err)
    return None


def _after_fault(cfg) -> dict:
    """What the failed save left, and a run resumed from it (no fault now)."""
    root = Path(cfg.job.dump_folder) / cfg.checkpoint.folder
    dist.barrier()
    left = sorted(p.name for p in root.iterdir())
    latest = latest_step(root)
    manifest = None
    if (root / f"step-{FAULT_STEPS}.partial").exists():
        try:
            read_manifest(str(root / f"step-{FAULT_STEPS}.partial"))
            manifest = "complete"
        except ValueError as err:
            manifest = str(err)
    dist.barrier()
    records = run(cfg)
    after = sorted(p.name for p in root.iterdir())
    return {
        "left": left,
        "latest": latest,
        "manifest": manifest,
        "resumed": ([r["step"] for r in records], _losses(records)),
        "after": after,
    }


def _faults(rank: int, world_size: int, folder: str) -> dict:
    out: dict = {"reference": _losses(run(_fault_cfg(f"{folder}/ref", "flexshard", "disabled")))}
    for backend, mode in (("flexshard", "disabled"), ("flexshard", "async"), ("fsdp2", "async")):
        cfg = _fault_cfg(f"{folder}/disk-{backend}-{mode}", backend, mode)
        error = _attempt(cfg, [(_FileSystemWriter, "write_data", _full_disk(world_size - 1))])
        out[("disk", backend, mode)] = {"error": error, **_after_fault(cfg)}
    for phase in ("staging", "writing", "checksums", "renaming"):
        cfg = _fault_cfg(f"{folder}/kill-{phase}", "flexshard", "async")
        error = _attempt(cfg, _killed(phase))
        out[("kill", phase)] = {"error": error, **_after_fault(cfg)}
    return out


def test_full_disk_and_a_kill_in_each_phase_leave_the_previous_checkpoint(tmp_path):
    results = run_distributed(_faults, 2, str(tmp_path), timeout=600)
    for rank, out in enumerate(results):
        reference = out.pop("reference")
        for case, seen in out.items():
            # the next start resumes from step 2, the newest complete checkpoint, and
            # continues exactly as the uninterrupted run; the step-4 save then completes
            assert seen["latest"] == 2, (case, seen)
            assert seen["resumed"] == ([3, 4], reference[2:]), (case, rank)
            assert seen["after"] == ["step-2", "step-4"], (case, seen["after"])
            assert f"step-{FAULT_STEPS}" not in seen["left"], (case, seen["left"])
            if case[0] == "disk":
                path = tmp_path / f"disk-{case[1]}-{case[2]}" / "checkpoint" / "step-4"
                error = seen["error"]
                assert error is not None and "\n" not in error, (case, error)
                assert f"checkpoint step {FAULT_STEPS} failed; '{path}'" in error, error
                assert "No space left on device" in error and "__1_0.distcp" in error, error
                assert seen["left"] == ["step-2"], (case, seen["left"])  # the disk freed
            else:
                assert f"killed {'before' if case[1] == 'renaming' else 'while'}" in seen["error"]
                # a killed save's folder is left as it was, under a name no start reads
                assert seen["left"] == ["step-2", "step-4.partial"], (case, seen["left"])
                if case[1] == "renaming":  # complete but not renamed: never picked up
                    assert seen["manifest"] == "complete"
                else:
                    assert "has no flexshard.json" in seen["manifest"], (case, seen)


def test_config_keys_are_checked_in_one_line():
    cfg = config_from_dict(
        {"checkpoint": {"async_mode": "async_with_pinned_mem", "keep_latest_k": 3}}
    )
    assert (cfg.checkpoint.async_mode, cfg.checkpoint.keep_latest_k) == ("async_with_pinned_mem", 3)
    assert (Config().checkpoint.async_mode, Config().checkpoint.keep_latest_k) == ("disabled", 0)
    with pytest.raises(ConfigError, match=r"^checkpoint.keep_latest_k = -1: must be >= 0 \("):
        config_from_dict({"checkpoint": {"keep_latest_k": -1}})
    with pytest.raises(ConfigError, match=r"^checkpoint.async_mode = 'yes': must be one of"):
        config_from_dict({"checkpoint": {"async_mode": "yes"}})
