"""``save`` / ``load``: plain DCP checkpoints made atomic and checked before use.

``save`` writes into ``<path>.partial``, adds a manifest of checksums once every rank
has finished, and only then renames the directory to ``<path>``: a save killed
half-way leaves no directory that looks complete. ``load`` verifies the checksums,
keys and shapes, reads into fresh buffers, and only then copies into the model and
optimizer, so a bad checkpoint raises (naming the key) with nothing changed.
"""

from __future__ import annotations

import ctypes
import datetime
import os
import shutil
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ..runtime.dcp_chunks import RegionTensor
from ..state_dict_hooks import slot_shape, slot_tensor
from .bounded import Ranks as _Ranks
from .bounded import model_timeout
from .frames import Frames, frame_of, framed, framed_state
from .manifest import (
    Entry,
    check_entries,
    chunk_entries,
    digest,
    read_manifest,
    share,
    write_manifest,
)
from .optimizer_state import (
    Model,
    modules_of,
    optimizer_state_dict,
    param_names,
    prepare_optimizer_state,
)

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _extra_file(rank: int) -> str:
    return f"extra_{rank}.pt"


def _finish(root: str, metadata: Metadata, has_extra: list[bool], ranks: _Ranks) -> None:
    """Checksum every chunk (each rank a share of the files), then rank 0 writes the
    manifest that marks the directory complete."""
    entries = chunk_entries(metadata)
    entries += [
        Entry(f"extra (rank {r})", _extra_file(r), 0, -1) for r, has in enumerate(has_extra) if has
    ]
    mine = {e.key: digest(root, e) for e in share(entries, ranks.rank, ranks.world)}
    parts = ranks.all_gather(mine, "checksum all-gather")
    digests = {k: v for part in parts for k, v in part.items()}
    if ranks.rank == 0:
        write_manifest(root, entries, digests, ranks.world)


def _exchange(a: str, b: str) -> bool:
    """Swap two directories in one atomic step (Linux renameat2 RENAME_EXCHANGE);
    False where the system or file system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.renameat2(_AT_FDCWD, a.encode(), _AT_FDCWD, b.encode(), _RENAME_EXCHANGE) == 0
    except (AttributeError, OSError):
        return False


def _move_into_place(partial: str, final: str) -> None:
    """Rename the finished checkpoint to ``final``. An older one there is swapped out
    atomically where the system allows, so some complete checkpoint is at ``final``
    at every instant; elsewhere it is moved aside first."""
    if not os.path.exists(final):
        os.replace(partial, final)
        return
    if not _exchange(partial, final):
        old = final + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(partial, final)
        partial = old
    shutil.rmtree(partial, ignore_errors=True)  # now the older checkpoint


def _state_dict(model: Model) -> dict[str, Any]:
    """The state dicts of the modules of one logical model, merged (keys are global)."""
    merged: dict[str, Any] = {}
    for module in modules_of(model):
        for key, value in module.state_dict().items():
            if key in merged:
                raise ValueError(f"state dict key '{key}' is in two of the modules given")
            merged[key] = value
    return merged


def _union_groups(groups: list[list[str]], ranks: _Ranks) -> list[list[str]]:
    """Each param group's FQNs over every rank: ranks holding different parts of the
    model (pipeline stages) save and check the logical model's groups."""
    every = ranks.all_gather(groups, "param-group all-gather")
    if len({len(g) for g in every}) != 1:
        raise ValueError(
            f"the ranks' optimizers have different numbers of param groups "
            f"{[len(g) for g in every]}; a checkpoint needs the same groups on every rank"
        )
    return [list(dict.fromkeys(f for part in every for f in part[i])) for i in range(len(groups))]


def save(
    path: str | os.PathLike,
    model: Model,
    optimizer: torch.optim.Optimizer | None = None,
    extra: Any = None,
    process_group: dist.ProcessGroup | None = None,
    frames: Frames | None = None,
    timeout: datetime.timedelta | None = None,
) -> None:
    """Save ``model`` (and ``optimizer``) with ``dcp.save``, each rank writing the
    regions it stores; ``extra`` (this rank's step, RNG or data-loader state: tensors,
    numbers, strings and containers of them) is kept per rank. Every rank calls it.

    ``model`` may be several modules of one logical model (pipeline stages, keeping
    their global FQNs), and ranks may hold different parts of it; ``frames`` (FQN ->
    whole shape, offset) saves a rank's tensor as a slice of a larger one (experts).

    Every collective waits at most ``timeout`` (default: the model's flexshard
    timeout; the group's own for a model without buckets), then raises a
    CollectiveError naming the step; nothing is renamed into place then."""
    final = os.path.abspath(os.fspath(path))
    ranks = _Ranks.of(process_group, final, _timeout(model, timeout))
    partial = final + ".partial"
    if os.path.exists(final) and not os.path.isdir(final):
        raise ValueError(f"cannot save a checkpoint to '{final}': a file is there")
    state: dict[str, Any] = {"model": _state_dict(model)}
    if optimizer is not None:
        optim = optimizer_state_dict(model, optimizer)
        union = _union_groups([g["params"] for g in optim["param_groups"]], ranks)
        groups = [{**g, "params": fqns} for g, fqns in zip(optim["param_groups"], union)]
        state["optim"] = {**optim, "param_groups": groups}
    state = framed_state(state, frames)
    if ranks.rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # left by a save that was killed
        os.makedirs(partial)
    ranks.barrier("barrier before writing")
    if extra is not None:
        torch.save(extra, os.path.join(partial, _extra_file(ranks.rank)))
    with ranks.step("dcp.save"):
        metadata = dcp.save(
            state,
            storage_writer=FileSystemWriter(partial, sync_files=True),
            process_group=ranks.group,
            no_dist=ranks.no_dist,
        )
    _finish(partial, metadata, ranks.all_gather(extra is not None, "extra all-gather"), ranks)
    ranks.barrier("barrier before the rename")
    if ranks.rank == 0:
        _move_into_place(partial, final)
    ranks.barrier("barrier after the rename")


def _timeout(model: Model, timeout: datetime.timedelta | None) -> datetime.timedelta | None:
    return timeout if timeout is not None else model_timeout(modules_of(model))


def _model_target(model: Model) -> dict[str, Any]:
    """Fresh buffers shaped like the model's state dict: dcp.load fills these, not the model."""
    target = {}
    for key, value in _state_dict(model).items():
        if isinstance(value, torch.Tensor):  # DTensors too: a clone has fresh local data
            target[key] = value.detach().clone()
        else:
            target[key] = value
    return target


def _optim_target(
    model: Model, metadata: Metadata, held: set[str], frames: Frames | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Fresh buffers for every optimizer entry of the parameters this rank's optimizer
    holds (``held``), keyed as DCP flattened them; state like a sharded parameter gets
    its chunks. Returns them, and the same for DCP (framed entries at their offsets)."""
    _, slots = param_names(model)
    target: dict[str, Any] = {}
    for_dcp: dict[str, Any] = {}
    for key, path in (metadata.planner_data or {}).items():
        if not path or path[0] != "optim":
            continue
        md = metadata.state_dict_metadata.get(key)
        if not isinstance(md, TensorStorageMetadata):
            target[key] = ""  # a plain value (lr, betas, params): DCP replaces it
            continue
        fqn = path[2] if len(path) == 4 and path[1] == "state" else None
        if fqn is not None and fqn not in held:
            continue  # another rank's part of the model (a pipeline stage)
        slot = slots.get(fqn) if fqn is not None else None
        frame = frame_of(frames, fqn)
        size = tuple(md.size)
        if slot is not None and size and size == tuple(frame[0] if frame else slot_shape(*slot)):
            bucket, i = slot
            local = bucket.local_tensor(i)
            buffer = torch.zeros(local.shape, dtype=md.properties.dtype, device=local.device)
            target[key] = slot_tensor(bucket, i, buffer)
        elif frame is not None and size and size == tuple(frame[0]):
            local = next(p for n, p in _named_parameters(model) if n == fqn)
            target[key] = torch.zeros(local.shape, dtype=md.properties.dtype)
        else:
            target[key] = torch.zeros(size, dtype=md.properties.dtype)
        if frame is not None and size:
            for_dcp[key] = framed(target[key], frame, key)
    return target, {**target, **for_dcp}


def _named_parameters(model: Model) -> Any:
    for module in modules_of(model):
        yield from module.named_parameters()


def _nest(flat: dict[str, Any], metadata: Metadata) -> dict[str, Any]:
    """The flattened optimizer entries back as {"state": ..., "param_groups": [...]}."""
    out: dict[str, Any] = {"state": {}, "param_groups": []}
    for key, value in flat.items():
        path = metadata.planner_data[key][1:]
        if path[0] == "state":
            out["state"].setdefault(path[1], {})[path[2]] = value
        else:
            groups = out["param_groups"]
            while len(groups) <= path[1]:
                groups.append({})
            groups[path[1]][path[2]] = value
    return out


def _mismatches(
    target: dict[str, Any], metadata: Metadata, prefix: str, everywhere: set[str]
) -> list[str]:
    """Keys missing or shaped otherwise here; keys saved that no rank (``everywhere``:
    every rank's keys) loads."""
    problems = []
    saved = {k for k in metadata.state_dict_metadata if k.startswith(prefix)}
    for key, value in target.items():
        md = metadata.state_dict_metadata.get(key)
        if md is None:
            problems.append(f"key '{key}' is missing from the checkpoint")
        elif isinstance(value, torch.Tensor) and isinstance(md, TensorStorageMetadata):
            if tuple(md.size) != tuple(value.shape):
                problems.append(
                    f"key '{key}' has shape {tuple(md.size)} in the checkpoint, the model "
                    f"expects {tuple(value.shape)}"
                )
    for key in sorted(saved - everywhere):
        problems.append(f"key '{key}' in the checkpoint is not in the model (another model?)")
    return problems


def _raise_if_any(problems: list[str], ranks: _Ranks, root: str) -> None:
    """Every rank raises the same error (problems found on any rank), or none does."""
    found = sorted({p for part in ranks.all_gather(problems, "check all-gather") for p in part})
    if found:
        more = f" (and {len(found) - 5} more)" if len(found) > 5 else ""
        raise ValueError(f"cannot load checkpoint '{root}': " + "; ".join(found[:5]) + more)


def _group_problems(
    optimizer: torch.optim.Optimizer, model: Model, nested: dict[str, Any], ranks: _Ranks
) -> list[str]:
    """The saved param groups against every rank's groups together (the logical model)."""
    names, _ = param_names(model)
    mine = [[names.get(id(p), "") for p in g["params"]] for g in optimizer.param_groups]
    union = _union_groups(mine, ranks)
    saved = [g.get("params", []) for g in nested["param_groups"]]
    if sorted(map(sorted, union)) != sorted(map(sorted, saved)):
        return [
            "optimizer state does not match the optimizer: param groups of "
            f"{[len(g) for g in union]} parameters over all ranks, the checkpoint has "
            f"{[len(g) for g in saved]} (or other parameter names)"
        ]
    return []


def _held_groups(nested: dict[str, Any], held: set[str]) -> dict[str, Any]:
    """The saved optimizer state cut to the parameters this rank's optimizer holds."""
    groups = [
        {**g, "params": [f for f in g.get("params", []) if f in held]}
        for g in nested["param_groups"]
    ]
    state = {f: v for f, v in nested["state"].items() if f in held}
    return {"state": state, "param_groups": groups}


def _load_state_dict(model: Model, state: dict[str, Any]) -> None:
    for module in modules_of(model):
        keys = module.state_dict().keys()
        module.load_state_dict({k: state[k] for k in keys})


def load(
    path: str | os.PathLike,
    model: Model,
    optimizer: torch.optim.Optimizer | None = None,
    process_group: dist.ProcessGroup | None = None,
    frames: Frames | None = None,
    timeout: datetime.timedelta | None = None,
) -> Any:
    """Load a checkpoint written by ``save`` at any world size and placements into
    ``model`` (and ``optimizer``); returns this rank's ``extra`` (rank 0's when this
    rank had none). Every rank calls it. Raises ValueError naming the key for a
    missing, truncated, corrupted or mismatched checkpoint, before anything changes.
    ``model``, ``frames`` and ``timeout`` as for ``save``: any layout loads any other's
    checkpoint."""
    root = os.path.abspath(os.fspath(path))
    ranks = _Ranks.of(process_group, root, _timeout(model, timeout))
    problems: list[str] = []
    try:
        entries, digests, _ = read_manifest(root)
        problems = check_entries(root, share(entries, ranks.rank, ranks.world), digests)
    except ValueError as err:
        problems = [str(err)]
    _raise_if_any(problems, ranks, root)

    reader = FileSystemReader(root)
    metadata = reader.read_metadata()
    target = {f"model.{k}": v for k, v in _model_target(model).items()}
    for_dcp = {
        k: framed(v, frame, k) if (frame := frame_of(frames, k[len("model.") :])) else v
        for k, v in target.items()
    }
    everywhere = {k for part in ranks.all_gather(list(target), "key all-gather") for k in part}
    problems = _mismatches(for_dcp, metadata, "model.", everywhere)
    optim: dict[str, Any] = {}
    if optimizer is not None:
        names, _ = param_names(model)
        held = {names[id(p)] for g in optimizer.param_groups for p in g["params"] if id(p) in names}
        optim, optim_dcp = _optim_target(model, metadata, held, frames)
        for_dcp.update(optim_dcp)
        if not optim:
            problems.append("the checkpoint holds no optimizer state")
    _raise_if_any(problems, ranks, root)

    # DCP puts plain values (lr, params) into this dict, and framed entries fill the
    # buffers of ``target`` / ``optim`` they are views of
    with ranks.step("dcp.load"):
        dcp.load(for_dcp, storage_reader=reader, process_group=ranks.group, no_dist=ranks.no_dist)
    optim = {k: v if isinstance(for_dcp[k], RegionTensor) else for_dcp[k] for k, v in optim.items()}
    prepared = None
    if optimizer is not None:
        nested = _nest(optim, metadata)
        problems = _group_problems(optimizer, model, nested, ranks)
        _raise_if_any(problems, ranks, root)
        prepared = prepare_optimizer_state(model, optimizer, _held_groups(nested, held))
    _load_state_dict(model, {k[len("model.") :]: v for k, v in target.items()})
    if optimizer is not None:
        optimizer.load_state_dict(prepared)
    for rank in (ranks.rank, 0):
        extra = os.path.join(root, _extra_file(rank))
        if os.path.isfile(extra):
            return torch.load(extra)
    return None
