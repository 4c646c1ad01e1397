"""``save`` / ``load``: torch's DCP made atomic and checked before use.

``save_state`` / ``load_state`` wrap ``dcp.save`` / ``dcp.load`` of any state dict.
``save_state`` writes into ``<path>.partial``, adds a manifest of checksums once every
rank has finished, and only then renames the directory to ``<path>``: a save killed
half-way leaves no directory that looks complete. ``load_state`` verifies the
checksums, keys and shapes first and raises on every rank, naming the key. Every
collective waits at most ``timeout`` (``bounded.py``).

``save`` / ``load`` do this for a model and its optimizer, their state from torch's
DCP state-dict API (``state.py``); ``load`` reads into fresh copies and applies them
only once everything checked out, so a bad checkpoint raises with nothing changed.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import datetime
import io
import os
import shutil
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ..runtime.collectives import is_backend_failure
from ..torch_internals import single_process_dcp
from .bounded import Ranks, in_flight, model_timeout
from .frames import Frames, framed_state, unframed
from .load_progress import LoadProgress, TrackedReader
from .logical_model import Model, modules_of
from .manifest import (
    MANIFEST,
    Entry,
    check_bytes,
    check_entries,
    check_extents,
    chunk_entries,
    digest,
    parse_manifest,
    share,
    write_manifest,
)
from .safe_load import SafeReader, dcp_load, load_data
from .state import (
    apply,
    fresh,
    gathers,
    group_params,
    group_problems,
    saved_entries,
    saved_flat,
    state_dict,
    union_groups,
    with_groups,
    without_unsaved_state,
)
from .striped_read import StripedReader
from .verified_read import ChecksumError, VerifyingReader

#: how a load reads the chunks: each rank all it needs (DCP's plan), or each chunk once
Reads = Literal["dcp", "striped"]
READS: tuple[str, ...] = get_args(Reads)

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _extra_file(rank: int) -> str:
    return f"extra_{rank}.pt"


def _finish(root: str, metadata: Metadata, has_extra: list[bool], ranks: Ranks) -> None:
    """Checksum every chunk (each rank a share of the files), then rank 0 writes the
    manifest that marks the directory complete."""
    entries = chunk_entries(metadata, root)
    entries += [_extra_entry(r) for r, has in enumerate(has_extra) if has]
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


def _save(final: str, state: dict[str, Any], extra: Any, ranks: Ranks) -> None:
    partial = final + ".partial"
    if os.path.exists(final) and not os.path.isdir(final):
        raise ValueError(f"cannot save a checkpoint to '{final}': a file is there")
    if ranks.rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # left by a save that was killed
        os.makedirs(partial)
    ranks.barrier("barrier before writing")
    if extra is not None:
        torch.save(extra, os.path.join(partial, _extra_file(ranks.rank)))
    with ranks.step("dcp.save"), single_process_dcp(ranks.no_dist):
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


def save_state(
    path: str | os.PathLike,
    state: dict[str, Any],
    extra: Any = None,
    process_group: dist.ProcessGroup | None = None,
    timeout: datetime.timedelta | None = None,
) -> None:
    """``dcp.save(state)`` into ``path``, atomically and with a manifest; ``extra``
    (this rank's step, RNG or data-loader state: tensors, numbers, strings and
    containers of them) is kept per rank. Every rank calls it. Every collective waits
    at most ``timeout`` (default: the group's own), then raises a CollectiveError
    naming the step; nothing is renamed into place then."""
    final = os.path.abspath(os.fspath(path))
    _save(final, state, extra, Ranks.of(process_group, final, timeout))


def save(
    path: str | os.PathLike,
    model: Model,
    optimizer: torch.optim.Optimizer | None = None,
    extra: Any = None,
    process_group: dist.ProcessGroup | None = None,
    frames: Frames | None = None,
    timeout: datetime.timedelta | None = None,
    *,
    stages: bool = False,
    entries: Mapping[str, Any] | None = None,
) -> None:
    """``save_state`` of ``model``'s (and ``optimizer``'s) state from torch's
    ``get_state_dict``, each rank writing the chunks it stores.

    ``model`` may be several modules of one logical model (pipeline stages, keeping
    their global FQNs), and ranks may hold different parts of it (``stages``: say so
    for a torch FSDP2 model); ``frames`` (FQN -> whole shape, offset) saves a rank's
    tensor as a slice of a larger one (experts); ``entries``: more state saved beside
    (``{"lr_scheduler": ...}``). ``timeout``'s default is the model's flexshard timeout."""
    final = os.path.abspath(os.fspath(path))
    ranks = Ranks.of(process_group, final, _timeout(model, timeout))
    state = state_dict(model, optimizer)
    if optimizer is not None and gathers(model, stages):
        state = with_groups(state, union_groups(group_params(state["optim"]), ranks))
    _save(final, {**framed_state(state, frames), **(entries or {})}, extra, ranks)


def _timeout(model: Model, timeout: datetime.timedelta | None) -> datetime.timedelta | None:
    return timeout if timeout is not None else model_timeout(modules_of(model))


def _walked(value: Any) -> bool:
    """A list DCP walks into: one holding a tensor or a container it walks."""
    if isinstance(value, Mapping):
        return True
    return isinstance(value, list) and any(isinstance(v, torch.Tensor) or _walked(v) for v in value)


def _leaves(value: Any, key: str = "") -> dict[str, Any]:
    """``value``'s entries under the keys DCP gives them: dicts, and lists holding
    tensors or containers, are walked; any other value is one entry."""
    if isinstance(value, Mapping):
        items: Any = value.items()
    elif _walked(value):
        items = enumerate(value)
    else:
        return {key: value}
    out: dict[str, Any] = {}
    for k, v in items:
        out.update(_leaves(v, f"{key}.{k}" if key else str(k)))
    return out


def _mismatches(
    state: dict[str, Any], metadata: Metadata, ranks: Ranks, whole: Collection[str]
) -> list[str]:
    """Keys missing or shaped otherwise here; under the entries ``whole`` names, keys
    saved that no rank loads."""
    problems = []
    leaves = _leaves(state)
    for key, value in leaves.items():
        md = metadata.state_dict_metadata.get(key)
        if md is None:
            problems.append(f"key '{key}' is missing from the checkpoint")
        elif isinstance(value, torch.Tensor) and isinstance(md, TensorStorageMetadata):
            if tuple(md.size) != tuple(value.shape):
                problems.append(
                    f"key '{key}' has shape {tuple(md.size)} in the checkpoint, the model "
                    f"expects {tuple(value.shape)}"
                )

    def checked(key: str) -> bool:
        return key.split(".", 1)[0] in whole

    mine = [k for k in leaves if checked(k)]
    everywhere = {k for part in ranks.all_gather(mine, "key all-gather") for k in part}
    for key in sorted(k for k in metadata.state_dict_metadata if checked(k)):
        if key not in everywhere:
            problems.append(f"key '{key}' in the checkpoint is not in the model (another model?)")
    return problems


def _raise_if_any(problems: list[str], ranks: Ranks, root: str) -> None:
    """Every rank raises the same error (problems found on any rank), or none does."""
    found = sorted({p for part in ranks.all_gather(problems, "check all-gather") for p in part})
    if found:
        more = f" (and {len(found) - 5} more)" if len(found) > 5 else ""
        raise ValueError(f"cannot load checkpoint '{root}': " + "; ".join(found[:5]) + more)


@dataclass(frozen=True)
class Verified:
    """What a load takes from a checkpoint folder once its manifest checked out: DCP's
    metadata and the ``.metadata`` bytes it was decoded from (the load's readers decode
    those again rather than read the file), the chunks' checksums left to the read (None:
    nothing left to check) and this rank's extra's bytes (None: no rank saved one)."""

    metadata: Metadata
    metadata_bytes: bytes
    digests: dict[str, str] | None
    extra: bytes | None
    extra_path: str = ""


def _file_bytes(path: str) -> bytes | None:
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return f.read()


def _extra_entry(rank: int) -> Entry:
    return Entry(f"extra (rank {rank})", _extra_file(rank), 0, -1)


def _verified(root: str, ranks: Ranks, require_manifest: bool, on_read: bool = False) -> Verified:
    """The checkpoint's DCP metadata, once its manifest checked out on every rank.
    Rank 0 alone reads the manifest and ``.metadata`` and sends their bytes to the
    others (a job reads each once); each rank checks them, hashes a share of the other
    files, and reads and checks the extra it loads (its own, else rank 0's). Without
    ``require_manifest`` a folder DCP finished writing (``.metadata``) without a
    manifest (torch's own ``dcp.save``) is taken unchecked. ``on_read``: the chunks'
    checksums are left to the read (``VerifyingReader``), only their extents checked
    here."""
    head = None
    if ranks.rank == 0:
        head = tuple(_file_bytes(os.path.join(root, name)) for name in (MANIFEST, ".metadata"))
    manifest, metadata_bytes = ranks.broadcast(head, "metadata broadcast")
    problems: list[str] = []
    digests = None
    extra, extra_path = None, ""
    if require_manifest or manifest is not None or metadata_bytes is None:
        try:
            entries, digests, _ = parse_manifest(root, manifest)
            saved_extras = {e.file for e in entries if e.key.startswith("extra (rank ")}
            mine = [e for e in share(entries, ranks.rank, ranks.world) if _hashed_in_pass(e)]
            chunks = [e for e in mine if on_read and e.length >= 0]
            whole = [e for e in mine if e not in chunks]
            problems = check_extents(root, chunks) + check_entries(root, whole, digests)
            problems += check_bytes(_metadata_entry(entries), metadata_bytes, digests)
            for rank in (ranks.rank, 0):
                if _extra_file(rank) in saved_extras:
                    extra_path = os.path.join(root, _extra_file(rank))
                    extra = _file_bytes(extra_path)
                    problems += check_bytes(_extra_entry(rank), extra, digests)
                    break
        except ValueError as err:
            problems = [str(err)]
    else:  # unchecked: the extra is whichever file is there
        for rank in (ranks.rank, 0):
            extra_path = os.path.join(root, _extra_file(rank))
            extra = _file_bytes(extra_path)
            if extra is not None:
                break
    _raise_if_any(problems, ranks, root)
    assert metadata_bytes is not None  # a checked manifest names .metadata
    metadata = SafeReader(root, metadata_bytes).read_metadata()
    return Verified(metadata, metadata_bytes, digests if on_read else None, extra, extra_path)


def _hashed_in_pass(entry: Entry) -> bool:
    """Whether the manifest pass hashes ``entry``: ``.metadata`` and the extras are
    checked on the bytes the load reads (an extra no rank loads is not checked)."""
    return entry.file != ".metadata" and not entry.key.startswith("extra (rank ")


def _metadata_entry(entries: list[Entry]) -> Entry:
    found = [e for e in entries if e.file == ".metadata"]
    if not found:
        raise ValueError(".metadata is not in the manifest")
    return found[0]


def _reader(
    root: str, ranks: Ranks, verified: Verified, reads: Reads, progress: LoadProgress | None
) -> TrackedReader:
    """The storage reader of a load."""
    head, digests = verified.metadata_bytes, verified.digests
    if reads == "striped" and ranks.group is not None and ranks.world > 1:
        return StripedReader(root, digests, ranks.group, metadata_bytes=head, progress=progress)
    if digests is not None:
        return VerifyingReader(root, digests, head, progress)
    return TrackedReader(root, head, progress)


@contextlib.contextmanager
def _tracked(ranks: Ranks, root: str) -> Iterator[Ranks]:
    """``ranks`` with a load's progress (several ranks): every collective of the load,
    its checks before and after the read included, notes the point each rank reached,
    and torchrun's SIGTERM is held for the whole load (``load_progress.py``)."""
    if ranks.group is None or ranks.world == 1:
        yield ranks
        return
    progress = LoadProgress(ranks.group, root)
    with progress.holding_agent_stop():
        yield dataclasses.replace(ranks, progress=progress)


def _read(
    root: str,
    state: dict[str, Any],
    ranks: Ranks,
    verified: Verified,
    reads: Reads = "dcp",
) -> Any:
    """``dcp.load`` into ``state`` (with ``verified.digests``: every chunk checked as
    read; ``reads``: how chunks come off storage); this rank's ``extra`` (rank 0's when
    it had none)."""
    if reads not in READS:
        raise ValueError(f"reads = {reads!r}: must be one of {READS}")
    progress = ranks.progress
    reader = _reader(root, ranks, verified, reads, progress)
    step = in_flight("dcp.load", ranks.path, ranks.group, ranks.timeout)
    with step, single_process_dcp(ranks.no_dist):
        try:
            dcp_load(state, root, ranks.group, ranks.no_dist, reader=reader)
        except (Exception, CheckpointException) as err:  # CheckpointException: BaseException
            # DCP's own collectives fail after an exchange that lost a peer, with less to say
            if isinstance(reader, StripedReader) and reader.exchange_failure is not None:
                raise reader.exchange_failure from None
            if progress is not None and is_backend_failure(err):  # a rank lost in DCP's steps
                raise progress.failure(err, progress.step()) from None
            if not isinstance(err, CheckpointException):
                raise
            # the lowest rank's failure, the same on every rank
            for _, (exc, _) in sorted(err.failures.items(), key=lambda item: item[0]):
                if isinstance(exc, ChecksumError):
                    raise ValueError(f"cannot load checkpoint '{root}': {exc}") from None
            raise
    if verified.extra is None:
        return None
    return load_data(io.BytesIO(verified.extra), f"'{verified.extra_path}'")


def load_state(
    path: str | os.PathLike,
    state: dict[str, Any],
    process_group: dist.ProcessGroup | None = None,
    timeout: datetime.timedelta | None = None,
    *,
    require_manifest: bool = True,
) -> Any:
    """``dcp.load(state)`` from a checkpoint ``save_state`` wrote, in place as DCP
    loads; returns this rank's ``extra``. Every rank calls it. Raises ValueError naming
    the key for a missing, truncated, corrupted or mismatched checkpoint before
    reading. ``require_manifest=False`` also takes a checkpoint torch's ``dcp.save``
    wrote (no manifest: unchecked)."""
    root = os.path.abspath(os.fspath(path))
    with _tracked(Ranks.of(process_group, root, timeout), root) as ranks:
        verified = _verified(root, ranks, require_manifest)
        _raise_if_any(_mismatches(state, verified.metadata, ranks, set(state)), ranks, root)
        return _read(root, state, ranks, verified)


def load(
    path: str | os.PathLike,
    model: Model,
    optimizer: torch.optim.Optimizer | None = None,
    process_group: dist.ProcessGroup | None = None,
    frames: Frames | None = None,
    timeout: datetime.timedelta | None = None,
    *,
    require_manifest: bool = True,
    entries: dict[str, Any] | None = None,
    checksums_first: bool = False,
    reads: Reads = "dcp",
) -> Any:
    """Load a checkpoint written by ``save`` (or by torch's ``get_state_dict`` and
    ``dcp.save``, nested or flattened) at any world size and placements into ``model``
    (and ``optimizer``); returns this rank's ``extra`` (rank 0's when this rank had
    none). Every rank calls it. Raises ValueError naming the key for a missing,
    truncated, corrupted or mismatched checkpoint, before anything changes. ``model``,
    ``frames`` and ``timeout`` as for ``save``; ``require_manifest`` as for ``load_state``;
    ``entries``: the state saved beside (``save``'s ``entries``), read into these dicts
    in place, each one required. Each chunk's checksum is checked on the bytes the load
    reads (a damaged chunk raises before anything changes: the read goes into fresh
    copies); ``checksums_first``: every checksum in a pass of its own before reading, as
    ``load_state`` does (the whole checkpoint read once more). ``reads``: "dcp", each
    rank reads every chunk it needs (a chunk several ranks need is read by each);
    "striped", each chunk is read once, by one of the ranks that need it, and sent to
    the others over ``process_group`` (``striped_read.py``)."""
    root = os.path.abspath(os.fspath(path))
    with _tracked(Ranks.of(process_group, root, _timeout(model, timeout)), root) as ranks:
        return _load(root, ranks, model, optimizer, frames, require_manifest, entries,
                     checksums_first, reads)  # fmt: skip


def _load(
    root: str,
    ranks: Ranks,
    model: Model,
    optimizer: torch.optim.Optimizer | None,
    frames: Frames | None,
    require_manifest: bool,
    entries: dict[str, Any] | None,
    checksums_first: bool,
    reads: Reads,
) -> Any:
    """``load``'s checks, read and apply, on ``ranks``."""
    verified = _verified(root, ranks, require_manifest, not checksums_first)
    metadata = verified.metadata
    flat = saved_flat(metadata)
    target = fresh(state_dict(model, optimizer, flat=flat))
    if optimizer is not None and not flat:
        target["optim"] = without_unsaved_state(target["optim"], metadata)
    entries = entries if entries is not None else {}
    loaded = {**framed_state(target, frames), **entries}
    saved, problems = saved_entries(metadata), []
    if optimizer is not None and "optim" not in saved:
        problems.append("the checkpoint holds no optimizer state")
    problems += [f"the checkpoint holds no '{name}' state" for name in entries if name not in saved]
    checked = loaded if not problems else {"model": loaded["model"]}
    _raise_if_any(problems + _mismatches(checked, metadata, ranks, ("model",)), ranks, root)
    mine = None
    if optimizer is not None and not flat:  # before the read puts the saved lists there
        mine = union_groups(group_params(target["optim"]), ranks)
    extra = _read(root, loaded, ranks, verified, reads)
    entries.update({name: loaded[name] for name in entries})  # a plain value is replaced
    state = unframed(loaded, target)
    if mine is not None:
        _raise_if_any(group_problems(mine, group_params(state["optim"])), ranks, root)
    apply(model, optimizer, state)
    return extra
