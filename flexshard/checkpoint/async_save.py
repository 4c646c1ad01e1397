"""Asynchronous checkpoints: ``dcp.async_save`` into ``<path>.partial``, then the
manifest and the rename, while training goes on.

The caller's (training) thread only copies the state to host memory (``ChunkStager``)
and returns. A background thread then writes it with torch's ``dcp.async_save``, hashes
the chunks, and rank 0 writes the manifest and renames ``<path>.partial`` to ``<path>``,
exactly as the synchronous ``save`` does: a save killed while staging, writing or
finishing leaves no ``<path>`` and no manifest-less folder that loads.

Every collective of a save runs on the checkpointer's own gloo group, made once at the
first save; the training process groups see none. DCP's save plans are cached after the
first save (``DefaultSavePlanner(enable_plan_caching=True)``), so later saves exchange
only empty plans and the write results; the optimizer's param groups (a collective in
``save``) are gathered once too. One save runs at a time: ``save`` first waits for the
previous one, and ``wait`` reports its failure as a ``SaveError`` on every rank.
"""

from __future__ import annotations

import copy
import datetime
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata

from ..torch_internals import drop_cached_save_plans
from .bounded import Ranks
from .chunk_stager import ChunkStager, can_pin
from .frames import Frames, framed_state
from .io import _extra_file, _move_into_place
from .logical_model import Model
from .manifest import Entry, chunk_entries, digest, share, write_manifest
from .state import gathers, group_params, state_dict, union_groups, with_groups

AsyncMode = Literal["async", "async_with_pinned_mem"]
#: the background threads' nice value (0 is the training thread's): writing and hashing
#: a checkpoint should not take CPU time a training step is waiting for
BACKGROUND_NICE = 10


class SaveError(RuntimeError):
    """A checkpoint that could not be saved; one line naming the checkpoint and path."""


class _AfterSave(SaveError):
    """The checkpoint is complete; what ran after it (retention) failed."""


@dataclass
class SaveRecord:
    """What one save cost: the caller's blocking time and the whole save's."""

    label: str
    path: str
    started: float  # time.perf_counter() when save() was called
    blocking_s: float  # until save() returned (waiting for the previous save included)
    wall_s: float | None = None  # until the checkpoint was complete (None: running)
    staged_bytes: int = 0


@dataclass
class _Save:
    final: str
    partial: str
    label: str
    extra: Any  # this rank's ``extra``, a copy
    manifest: bool
    after: Callable[[], object] | None  # rank 0, once the checkpoint is complete
    record: SaveRecord


def one_line(err: BaseException) -> str:
    """A failure as one line: DCP's per-rank exception (an OSError names its file)."""
    if isinstance(err, CheckpointException):
        rank, (cause, _) = next(iter(sorted(err.failures.items(), key=lambda kv: kv[0])))
        return f"rank {rank}: {type(cause).__name__}: {cause}"
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}"


def lower_priority() -> None:
    """Let the training thread have the CPU first: this (background) thread's nice
    value raised, as Linux allows per thread; a no-op elsewhere."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
    except (AttributeError, OSError):
        pass


class _Planner(DefaultSavePlanner):
    """DCP's planner with cached plans, lowering the priority of DCP's writer thread
    (it calls ``set_up_planner`` first thing)."""

    def __init__(self, cache_key: str) -> None:
        super().__init__(enable_plan_caching=True)
        self._cached_plans_key = cache_key  # not shared with other savers' plans

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        storage_meta: Any = None,
        is_coordinator: bool = False,
    ) -> None:
        lower_priority()
        super().set_up_planner(state_dict, storage_meta, is_coordinator)


def discard(partial: str) -> None:
    """A failed save's folder, removed: it frees the disk it took (a killed process
    leaves it, and the next save of that step removes it)."""
    shutil.rmtree(partial, ignore_errors=True)


class AsyncCheckpointer:
    """Saves one checkpoint at a time in the background; every rank of the world makes
    one and calls ``save`` / ``wait`` / ``close`` in the same order."""

    def __init__(self, mode: AsyncMode = "async", timeout: datetime.timedelta | None = None):
        if mode not in ("async", "async_with_pinned_mem"):
            raise ValueError(f"async mode {mode!r}: must be 'async' or 'async_with_pinned_mem'")
        reuse = mode == "async_with_pinned_mem"
        self.mode = mode
        # without CUDA host memory cannot be pinned: the buffers are still kept and
        # reused, in ordinary memory (the part of the mode a CPU machine can have)
        self.pinned = reuse and can_pin()
        self.stager = ChunkStager(reuse=reuse, pin=self.pinned)
        self.timeout = timeout
        self.records: list[SaveRecord] = []
        self._group: dist.ProcessGroup | None = None
        self._union: tuple[list[list[str]], list[list[str]]] | None = None
        self._pending: Future | None = None
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="flexshard-checkpoint")
        self._plans = f"flexshard-async-{uuid.uuid4().hex}"  # DCP's plan-cache key

    @property
    def note(self) -> str:
        """How the staging memory is held, for the log."""
        if self.mode == "async":
            return "async checkpoints: staged into fresh host memory at every save"
        if self.pinned:
            return "async checkpoints: staged into pinned host buffers kept between saves"
        return (
            "async checkpoints: async_with_pinned_mem without CUDA cannot pin host memory; "
            "staging buffers are kept between saves in ordinary (pageable) memory"
        )

    # ---------------------------------------------------------------- the caller's side
    def state(
        self,
        model: Model,
        optimizer: torch.optim.Optimizer | None,
        frames: Frames | None,
        *,
        stages: bool = False,
    ) -> dict[str, Any]:
        """What ``flexshard.checkpoint.save`` writes for ``model`` (and ``optimizer``),
        with the param groups over all ranks gathered at the first call only (a run's
        groups do not change; a rank whose groups did raises)."""
        state = state_dict(model, optimizer)
        if optimizer is not None and gathers(model, stages):
            mine = group_params(state["optim"])
            if self._union is None:
                self.wait()  # the group is idle before the training thread uses it
                self._union = (mine, union_groups(mine, self._ranks("")))
            elif self._union[0] != mine:
                raise ValueError("the optimizer's param groups changed between checkpoints")
            state = with_groups(state, self._union[1])
        return framed_state(state, frames)

    def save(
        self,
        path: str | os.PathLike,
        state: dict[str, Any],
        *,
        label: str = "checkpoint",
        extra: Any = None,
        manifest: bool = True,
        after: Callable[[], object] | None = None,
    ) -> SaveRecord:
        """Wait for the previous save, stage ``state`` and start writing it to ``path``
        (through ``<path>.partial``); returns once the copy is made. ``extra`` is kept
        per rank as ``extra_<rank>.pt`` (as ``save`` does); ``manifest``: checksum the
        chunks into flexshard.json (what ``load`` checks); ``after`` runs on rank 0 once
        the checkpoint is complete (retention)."""
        started = time.perf_counter()
        self.wait()
        final = os.path.abspath(os.fspath(path))
        partial = final + ".partial"
        ranks = self._ranks(final)
        if ranks.rank == 0:
            # left by a save that was killed. No rank writes here before DCP's plan
            # exchange, which needs rank 0 past this point; another rank's DCP may
            # already have made the (empty) folder, hence exist_ok
            shutil.rmtree(partial, ignore_errors=True)
            os.makedirs(partial, exist_ok=True)
        extra = copy.deepcopy(extra)  # small (step, scheduler): training may change it
        upload = dcp.async_save(
            state,
            storage_writer=FileSystemWriter(partial, sync_files=True),
            planner=_Planner(self._plans),
            process_group=ranks.group,
            async_stager=self.stager,
            no_dist=ranks.no_dist,
        )
        record = SaveRecord(label, final, started, 0.0, staged_bytes=self.stager.staged_bytes)
        job = _Save(final, partial, label, extra, manifest, after, record)
        self._pending = self._worker.submit(self._finish, upload, job, ranks)
        record.blocking_s = time.perf_counter() - started
        self.records.append(record)
        return record

    def busy(self) -> bool:
        """Whether a save is still being written."""
        return self._pending is not None and not self._pending.done()

    def wait(self) -> str | None:
        """Block until the running save is complete; its path (None: none was running).
        A failed save raises ``SaveError`` here, on every rank."""
        pending, self._pending = self._pending, None
        return None if pending is None else pending.result()

    def close(self) -> None:
        """Wait for the last save, then free the staging buffers and the cached plans."""
        try:
            self.wait()
        finally:
            self._worker.shutdown(wait=True)
            self.stager.close()
            drop_cached_save_plans(self._plans)

    def _ranks(self, path: str) -> Ranks:
        if not dist.is_initialized():
            return Ranks(None, 0, 1, path)
        if self._group is None:  # every rank of the world, at its first save
            ranks = list(range(dist.get_world_size()))
            kwargs = {"timeout": self.timeout} if self.timeout is not None else {}
            group = dist.new_group(ranks, backend="gloo", use_local_synchronization=True, **kwargs)
            assert group is not None
            self._group = group
        group = self._group
        return Ranks(group, dist.get_rank(group), dist.get_world_size(group), path, self.timeout)

    # ---------------------------------------------------------------- the background
    def _finish(self, upload: Future, job: _Save, ranks: Ranks) -> str:
        """Wait for DCP's write, then checksum, manifest, rename (rank 0), ``after``;
        every rank ends with the same outcome."""
        lower_priority()
        try:
            with ranks.step("dcp.async_save"):
                metadata = upload.result()
            problem = None
            try:
                mine = self._digests(job, metadata, ranks)
            except OSError as err:
                problem, mine = f"rank {ranks.rank}: {one_line(err)}", {}
            parts = ranks.all_gather((problem, job.extra is not None, mine), "checksum all-gather")
            problems = [p[0] for p in parts if p[0]]
            if problems:
                raise SaveError(problems[0])
            status = None
            if ranks.rank == 0:
                status = self._complete(job, metadata, parts, ranks.world)
            status = ranks.all_gather(status, "completion all-gather")[0]
            if isinstance(status, tuple):
                done = f"flexshard: {job.label} is complete at '{job.final}'"
                raise _AfterSave(f"{done}, {status[0]}")
            if status is not None:
                raise SaveError(status)
        except _AfterSave:
            raise
        except (Exception, CheckpointException) as err:
            if ranks.rank == 0:
                discard(job.partial)
            cause = str(err) if isinstance(err, SaveError) else one_line(err)
            raise SaveError(
                f"flexshard: {job.label} failed; '{job.final}' was not written and the "
                f"previous checkpoints are untouched: {cause}"
            ) from (err if isinstance(err, Exception) else None)
        job.record.wall_s = time.perf_counter() - job.record.started
        return job.final

    def _digests(self, job: _Save, metadata: Metadata, ranks: Ranks) -> dict[str, str | None]:
        """This rank's extra file written, and its share of the chunks hashed (plus its
        own extra file, so one all-gather carries everything)."""
        if job.extra is not None:
            # saved under its own name, as ``save`` does (torch.save names the archive
            # after the file, so the bytes are the same)
            path = os.path.join(job.partial, _extra_file(ranks.rank))
            torch.save(job.extra, path)
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        if not job.manifest:
            return {}
        entries = share(chunk_entries(metadata, job.partial), ranks.rank, ranks.world)
        if job.extra is not None:
            entries.append(Entry(f"extra (rank {ranks.rank})", _extra_file(ranks.rank), 0, -1))
        return {e.key: digest(job.partial, e) for e in entries}

    def _complete(
        self, job: _Save, metadata: Metadata, parts: list, world: int
    ) -> str | tuple[str] | None:
        """Rank 0: the manifest, the rename, ``after``; a one-line problem (in a tuple
        when the checkpoint is complete and only ``after`` failed) or None."""
        try:
            if job.manifest:
                entries = chunk_entries(metadata, job.partial)
                entries += [
                    Entry(f"extra (rank {r})", _extra_file(r), 0, -1)
                    for r, (_, has, _) in enumerate(parts)
                    if has
                ]
                digests = {k: v for _, _, part in parts for k, v in part.items()}
                write_manifest(job.partial, entries, digests, world)
            _move_into_place(job.partial, job.final)
        except OSError as err:
            return f"rank 0: {one_line(err)}"
        if job.after is not None:
            try:
                job.after()
            except OSError as err:
                return (f"but removing older checkpoints failed: {one_line(err)}",)
        return None
