"""The manifest that marks a checkpoint complete and holds a checksum of every chunk.

Written last, after every rank's data and DCP's ``.metadata``: a directory without it
is not a finished checkpoint. Each entry covers one stored chunk (the byte range DCP
recorded for it), so a corrupted or truncated file is reported by the key it breaks.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from ..torch_internals import saved_metadata
from .safe_load import read_metadata

MANIFEST = "flexshard.json"
FORMAT = "flexshard-checkpoint/1"


@dataclass(frozen=True)
class Entry:
    key: str  # the state-dict key (with the chunk's offsets), or a whole file
    file: str
    offset: int
    length: int  # -1: the whole file


def storage_key(index: MetadataIndex) -> str:
    """The manifest key of the chunk DCP stored under ``index``."""
    return f"{index.fqn} at offsets {list(index.offset)}" if index.offset else index.fqn


def chunk_entries(metadata: Metadata, root: str) -> list[Entry]:
    """One entry per chunk DCP wrote to ``root`` (``metadata``: what dcp.save returned),
    plus its ``.metadata`` file."""
    entries = [Entry(".metadata", ".metadata", 0, -1)]
    for index, info in saved_metadata(metadata, lambda: read_metadata(root)).storage_data.items():
        entries.append(Entry(storage_key(index), info.relative_path, info.offset, info.length))
    return entries


def _read(root: str, entry: Entry) -> bytes | None:
    """The entry's bytes; None when the file is missing or ends before them."""
    path = os.path.join(root, entry.file)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        f.seek(entry.offset)
        data = f.read() if entry.length < 0 else f.read(entry.length)
    if entry.length >= 0 and len(data) != entry.length:
        return None
    return data


def digest(root: str, entry: Entry) -> str | None:
    data = _read(root, entry)
    return None if data is None else hashlib.sha256(data).hexdigest()


def share(entries: list[Entry], rank: int, world_size: int) -> list[Entry]:
    """The entries rank ``rank`` hashes: whole files spread over the ranks."""
    files = sorted({e.file for e in entries})
    mine = {f for i, f in enumerate(files) if i % world_size == rank}
    return [e for e in entries if e.file in mine]


def write_manifest(root: str, entries: list[Entry], digests: dict[str, str], world: int) -> None:
    body = {
        "format": FORMAT,
        "world_size": world,
        "entries": [{**asdict(e), "sha256": digests[e.key]} for e in entries],
    }
    tmp = os.path.join(root, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(body, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, MANIFEST))


def read_manifest(root: str) -> tuple[list[Entry], dict[str, str], int]:
    """Entries, their checksums, and the world size that saved; raises ValueError for
    a directory that is not a complete flexshard checkpoint."""
    path = os.path.join(root, MANIFEST)
    body = None
    if os.path.isfile(path):
        with open(path, "rb") as f:
            body = f.read()
    return parse_manifest(root, body)


def parse_manifest(root: str, body: bytes | None) -> tuple[list[Entry], dict[str, str], int]:
    """``read_manifest`` of the manifest's bytes ``body`` (None: there is no manifest)."""
    if body is None and not os.path.isdir(root):
        raise ValueError(f"no checkpoint at '{root}': the directory does not exist")
    if body is None:
        raise ValueError(
            f"'{root}' is not a complete flexshard checkpoint: it has no {MANIFEST} (a save "
            "that did not finish, or a directory written by something else)"
        )
    try:
        body_json = json.loads(body)
        entries = [
            Entry(e["key"], e["file"], e["offset"], e["length"]) for e in body_json["entries"]
        ]
        digests = {e["key"]: e["sha256"] for e in body_json["entries"]}
        world = int(body_json["world_size"])
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"'{root}': {MANIFEST} is unreadable ({err})") from None
    if body_json.get("format") != FORMAT:
        raise ValueError(f"'{root}': unknown checkpoint format {body_json.get('format')!r}")
    return entries, digests, world


def check_extents(root: str, entries: list[Entry]) -> list[str]:
    """Chunk entries whose file is missing or ends before them, from the files' sizes
    alone (no byte read); each problem names the key it breaks."""
    problems = []
    for entry in entries:
        path = os.path.join(root, entry.file)
        if not os.path.isfile(path) or os.path.getsize(path) < entry.offset + entry.length:
            problems.append(f"'{entry.key}' is missing or truncated in '{entry.file}'")
    return problems


def check_entries(root: str, entries: list[Entry], digests: dict[str, str]) -> list[str]:
    """Problems found in ``entries``, each naming the key it breaks."""
    return [p for entry in entries for p in check_bytes(entry, _read(root, entry), digests)]


def check_bytes(entry: Entry, data: bytes | None, digests: dict[str, str]) -> list[str]:
    """``check_entries`` of one entry whose bytes (None: missing) were read already."""
    if data is None:
        return [f"'{entry.key}' is missing or truncated in '{entry.file}'"]
    if hashlib.sha256(data).hexdigest() != digests[entry.key]:
        return [f"'{entry.key}' is corrupted: checksum mismatch in '{entry.file}'"]
    return []
