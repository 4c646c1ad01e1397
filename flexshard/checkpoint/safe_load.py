"""Loading a checkpoint runs no code from it.

torch's DCP unpickles ``.metadata`` with ``pickle.load`` and its non-tensor entries
with ``torch.load(weights_only=False)``: a file can name any function and have it
called while it loads. Every flexshard load reads through this module instead:

* ``.metadata``: an unpickler that builds only what DCP's metadata holds (its
  dataclasses, torch dtypes, ``torch.Size``, layouts, memory formats, the writer's
  path) and plain data. torch's ``weights_only`` unpickler cannot read it (protocol 2
  opcodes only; DCP writes protocol 4 or 5).
* non-tensor entries (``SafeLoadPlanner``) and the per-rank extras: torch's
  ``weights_only`` unpickler (tensors, plain data, and what ``add_safe_globals``
  allows) with flexshard's own state types added (``DATA_TYPES``).

Anything else is refused with an ``UnsafeCheckpointError`` naming the file and the
global it names, raised when the unpickler meets that name, before it is called.
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.serialization import get_unsafe_globals_in_checkpoint, safe_globals

from ..optim.matrix_proxies import MatrixState
from ..torch_internals import (
    DCPMemoryFormat,
    DCPStorageInfo,
    dcp_metadata_file,
    layout_by_name,
    set_nested,
)


class UnsafeCheckpointError(ValueError):
    """A checkpoint file names a type or function that loading may not build."""


def _name(obj: Any) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


def _refused(where: str, name: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"refusing to load {where}: it names '{name}', which a checkpoint may not hold "
        "(loading it could run code; allowed: tensors, plain data, DCP's metadata)"
    )


#: what a DCP .metadata pickle may name (all of torch 2.11 to 2.15 write): DCP's
#: metadata classes, the enum its memory formats are written as, the layout lookup,
#: torch.Size (chunk offsets and sizes) and the writer's path (StorageMeta.checkpoint_id).
#: Each only builds a value: no file, process or import is touched.
METADATA_TYPES: tuple[Any, ...] = (
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    TensorProperties,
    StorageMeta,
    DCPStorageInfo,
    DCPMemoryFormat,
    layout_by_name,
    torch.Size,
    pathlib.PosixPath,
    pathlib.PurePosixPath,
)
_METADATA_GLOBALS: dict[str, Any] = {
    **{_name(t): t for t in METADATA_TYPES},
    # Python 3.13 moved the path classes; a 3.11/3.12 reader takes their new name too
    "pathlib._local.PosixPath": pathlib.PosixPath,
    "pathlib._local.PurePosixPath": pathlib.PurePosixPath,
    # dtypes pickle as the torch attribute of their name (TensorProperties.dtype)
    **{f"torch.{n}": v for n, v in vars(torch).items() if isinstance(v, torch.dtype)},
}

#: non-tensor values flexshard itself saves besides plain data: a per-matrix
#: optimizer's state (a dataclass of the inner optimizer's state dict)
DATA_TYPES: tuple[type, ...] = (MatrixState,)
#: the names checkpoints on disk may give those types: a pickle keeps the module path its
#: type had when it was saved, so a type's earlier module path stays loadable
SAVED_NAMES: tuple[tuple[type, str], ...] = (
    (MatrixState, "flexshard.optim.matrix_units.MatrixState"),
)


class _MetadataUnpickler(pickle._Unpickler):
    """``pickle``'s unpickler, resolving only ``_METADATA_GLOBALS`` (every global, and
    so every callable it can reach, goes through ``find_class``). The pure-Python one:
    its BUILD can be refused on a class, where the C one would set attributes on an
    allowed class itself, for the whole process."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file: IO[bytes], where: str) -> None:
        super().__init__(file)
        self._where = where

    def find_class(self, module: str, name: str) -> Any:
        found = _METADATA_GLOBALS.get(f"{module}.{name}")
        if found is None:
            raise _refused(self._where, f"{module}.{name}")
        return found

    def load_build(self) -> None:
        target = self.stack[-2]
        if isinstance(target, type):
            raise _refused(self._where, f"attributes of {_name(target)}")
        super().load_build()

    dispatch[pickle.BUILD[0]] = load_build


def read_metadata_file(file: IO[bytes], path: str) -> Metadata:
    """A DCP ``.metadata`` pickle (``path``: named in errors), allowed types only."""
    where = f"'{path}'"
    try:
        metadata = _MetadataUnpickler(file, where).load()
    except UnsafeCheckpointError:
        raise
    except Exception as err:  # truncated or not a pickle: name the file and the reason
        # a pickle cut short fails at the end of the file, in many ways (EOFError with
        # no message at all): the position says it where the message does not
        cut = isinstance(err, EOFError) or file.read(1) == b""
        reason = "truncated: it ends before its pickle does" if cut else str(err)
        raise ValueError(f"'{path}' is not a readable DCP .metadata file ({reason})") from None
    if not isinstance(metadata, Metadata):
        raise ValueError(f"'{path}' holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


class SafeReader(FileSystemReader):
    """torch's FileSystemReader whose ``.metadata`` read builds allowed types only.
    ``metadata_bytes``: the ``.metadata`` file's bytes, read once already for the whole
    load (DCP asks every rank's reader for the metadata: none reads the file again)."""

    def __init__(self, path: str | os.PathLike, metadata_bytes: bytes | None = None) -> None:
        super().__init__(path)
        self._metadata_bytes = metadata_bytes

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = dcp_metadata_file(self, kwargs.get("rank"))
        if self._metadata_bytes is not None:
            metadata = read_metadata_file(io.BytesIO(self._metadata_bytes), os.fspath(path))
        else:
            with self.fs.create_stream(path, "rb") as file:
                metadata = read_metadata_file(file, os.fspath(path))
        if getattr(metadata, "storage_meta", None) is None:  # as torch's reader
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def read_metadata(path: str | os.PathLike) -> Metadata:
    """The DCP metadata of the checkpoint folder ``path``."""
    return SafeReader(os.fspath(path)).read_metadata()


@contextmanager
def _allowed() -> Iterator[None]:
    with safe_globals([*DATA_TYPES, *SAVED_NAMES]):
        yield


def load_data(file: str | IO[bytes], where: str) -> Any:
    """A ``torch.save`` file or stream (a non-tensor entry, a per-rank extra) through
    torch's ``weights_only`` unpickler with ``DATA_TYPES`` allowed; ``where`` names it."""
    with _allowed():
        try:
            return torch.load(file, weights_only=True)
        except pickle.UnpicklingError as err:
            raise _refused(where, _first_unsafe(file, err)) from None


def _first_unsafe(file: str | IO[bytes], err: Exception) -> str:
    """The global the refused file names (torch's message, where it names none)."""
    if not isinstance(file, str):
        file.seek(0)
    with _allowed():
        try:
            names = get_unsafe_globals_in_checkpoint(file)
        except Exception:  # unreadable after all: torch's first line says why
            names = []
    return names[0] if names else str(err).strip().splitlines()[0]


class SafeLoadPlanner(DefaultLoadPlanner):
    """torch's DefaultLoadPlanner whose non-tensor entries load through ``load_data``;
    ``root``: the checkpoint folder, named in errors."""

    def __init__(self, root: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._root = root

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        info = self.metadata.storage_data[read_item.storage_index]
        file = os.path.join(self._root, getattr(info, "relative_path", ""))
        loaded = load_data(value, f"'{file}' (entry '{fqn}')")
        if self.flatten_state_dict:
            set_nested(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def dcp_load(
    state: dict[str, Any],
    root: str,
    process_group: dist.ProcessGroup | None = None,
    no_dist: bool = False,
    reader: StorageReader | None = None,
) -> None:
    """``dcp.load(state)`` from ``root`` (through ``reader``, default a SafeReader) with
    a SafeLoadPlanner. A refused entry raises its UnsafeCheckpointError on every rank
    (DCP gathers each rank's failure into a CheckpointException)."""
    try:
        dcp.load(
            state,
            storage_reader=reader or SafeReader(root),
            planner=SafeLoadPlanner(root),
            process_group=process_group,
            no_dist=no_dist,
        )
    except CheckpointException as err:
        for _, (exc, _) in sorted(err.failures.items(), key=lambda item: item[0]):
            if isinstance(exc, UnsafeCheckpointError):
                raise exc from None
        raise
