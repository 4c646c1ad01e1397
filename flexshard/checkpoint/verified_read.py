"""Checksums checked on the bytes the load reads, not in a pass of their own.

A separate checksum pass reads every byte of the checkpoint once before DCP reads the
chunks each rank needs again. ``VerifyingReader`` reads each chunk DCP asks for as one
byte range (the manifest's entry for that chunk is the same range), hashes it, and only
then decodes it the way DCP does (``weights_only``: no code from the checkpoint). A
chunk that does not match its manifest checksum raises a ``ChecksumError`` naming the
key before any of its bytes are used; chunks this load does not read are not checked.
"""

from __future__ import annotations

import hashlib
import io
import os
from typing import IO, Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner

from .load_progress import LoadProgress, TrackedReader
from .manifest import storage_key


class ChecksumError(ValueError):
    """A chunk read for this load does not match its manifest checksum."""


def _narrowed(tensor: torch.Tensor, offsets: Any, lengths: Any) -> torch.Tensor:
    for dim, (offset, length) in enumerate(zip(offsets, lengths)):
        if length < tensor.size(dim):
            tensor = tensor.narrow(dim, offset, length)
    return tensor


def check_chunk(digests: dict[str, str], index: MetadataIndex, data: bytes, info: Any) -> None:
    """Raise a ChecksumError naming the key unless ``data`` (the chunk ``index`` as
    read, stored as ``info``) matches its manifest checksum in ``digests``."""
    key = storage_key(index)
    expected = digests.get(key)
    file = info.relative_path
    if expected is None:
        raise ChecksumError(f"'{key}' in '{file}' has no entry in the manifest")
    if len(data) != info.length:
        raise ChecksumError(f"'{key}' is missing or truncated in '{file}'")
    if hashlib.sha256(data).hexdigest() != expected:
        raise ChecksumError(f"'{key}' is corrupted: checksum mismatch in '{file}'")


def read_chunk(stream: IO[bytes], index: MetadataIndex, info: Any) -> bytes:
    """The stored bytes of chunk ``index`` (``info``: its place in the open file; open
    it unbuffered, ``open_unbuffered``, so that no byte past the chunk is read)."""
    if getattr(info, "transform_descriptors", None):
        raise ChecksumError(
            f"'{storage_key(index)}' in '{info.relative_path}' is stored with transforms "
            "(compression), which this reader does not decode"
        )
    stream.seek(info.offset)
    parts, left = [], info.length
    while left:  # one read() returns at most ~2 GB on Linux
        part = stream.read(left)
        if not part:  # the file ends early: the caller's length check names the key
            break
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def open_unbuffered(path: str) -> IO[bytes]:
    """``path`` for ``read_chunk``: a buffered file reads ahead of a chunk's end."""
    return open(path, "rb", buffering=0)  # noqa: SIM115 - the caller closes it


def decode_chunk(item: Any, data: bytes, planner: LoadPlanner) -> None:
    """Copy what ``item`` reads of a stored chunk's bytes into its target, as DCP's
    reader does (``weights_only``: no code from the checkpoint)."""
    if item.type == LoadItemType.BYTE_IO:
        planner.load_bytes(item, io.BytesIO(data))
        return
    tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    tensor = _narrowed(tensor, item.storage_offsets, item.lengths)
    target = planner.resolve_tensor(item).detach()
    if target.size() != tensor.size():
        raise ValueError(
            f"'{storage_key(item.storage_index)}': the stored chunk gives "
            f"{tuple(tensor.size())}, the load expects {tuple(target.size())}"
        )
    target.copy_(tensor)
    planner.commit_tensor(item, target)


class VerifyingReader(TrackedReader):
    """A TrackedReader whose every chunk is hashed as read and checked against
    ``digests`` (manifest key -> sha256) before it is decoded."""

    def __init__(
        self,
        root: str,
        digests: dict[str, str],
        metadata_bytes: bytes | None = None,
        progress: LoadProgress | None = None,
    ) -> None:
        super().__init__(root, metadata_bytes, progress)
        self._root = root
        self._digests = digests

    def read_chunks(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(
                item
            )
        for relative_path, items in per_file.items():
            with open_unbuffered(os.path.join(self._root, relative_path)) as stream:
                for item in sorted(items, key=lambda i: self.storage_data[i.storage_index].offset):
                    info = self.storage_data[item.storage_index]
                    data = read_chunk(stream, item.storage_index, info)
                    check_chunk(self._digests, item.storage_index, data, info)
                    decode_chunk(item, data, planner)
