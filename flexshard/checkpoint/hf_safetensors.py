"""Sharded models to and from Hugging Face safetensors folders through
``torch.distributed.checkpoint``'s ``HuggingFaceStorageWriter`` / ``HuggingFaceStorageReader``.

Neither direction gathers the model: on save every rank writes the chunks it stores
(``save_distributed``), then the ranks consolidate the output files between them, one
file each in turn and one tensor at a time (torch's
``consolidate_safetensors_files_on_every_rank``); on load every rank reads only the
slices it stores (``safe_open(...).get_slice``).

Keys are renamed on the way (an adapter's ``HFKey`` per state-dict key), and RoPE
projections change row order per head: Meta/torchtitan checkpoints keep each
rotated pair on adjacent rows (interleaved), Hugging Face's ``rotate_half`` wants the
pair's halves ``head_dim / 2`` rows apart. A rank's rows need not be whole heads
(``Shard(0)`` over W = 3, FlatShard, BlockShard), so the permutation is applied where
whole heads are at hand: on save to each consolidated tensor, on load to a per-rank
read of the head-aligned rows around the rank's own rows.

A rank may hold part of the model only: pipeline stages (``shapes`` names the whole
model, so every rank plans the same files) and expert slices (``frames``: a slice's
offset in the whole ``[E, ...]`` stack, as ``frames.py``). An ``HFKey`` with
``experts`` stores such a stack as one tensor per expert (Mixtral's
``experts.{e}.w1.weight``): each expert's chunks are views of the stack's. One with
``rows`` stores it as rows of dim 1 of a larger tensor that several state-dict keys
share (transformers' fused ``experts.gate_up_proj``: the gate projections' rows, then
the up projections'); each key's chunks are placed at its rows."""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor
from torch.futures import Future

from ..runtime.dtensor.chunks import Box, RegionTensor, chunks_of
from ..torch_internals import (
    consolidate_safetensors_files,
    consolidate_safetensors_files_on_every_rank,
    hf_file_name,
    local_tensor,
    single_process_dcp,
)
from .frames import Frames, framed
from .hf_dequantize import (
    BlockScaled,
    StoredTensor,
    is_quantized,
    read_dequantized,
    read_stored,
)
from .safe_load import dcp_load

SHARDED_DIR = "sharded"  # per-rank chunk files, removed once consolidated
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclass(frozen=True)
class HFKey:
    """Where one state-dict entry lives in a Hugging Face checkpoint."""

    name: str
    rope_heads: int = 0  # > 0: a RoPE projection of this many heads (rows permuted per head)
    # > 0: a stack [experts, ...] kept as one tensor per expert, named name.format(e)
    experts: int = 0
    # (first, total): the value is rows first.. of dim 1 of the tensor ``name`` of
    # ``total`` rows there; (0, 0): the tensor is the value's alone
    rows: tuple[int, int] = (0, 0)

    def names(self) -> list[str]:
        if not self.experts:
            return [self.name]
        return [self.name.format(e) for e in range(self.experts)]


# ---------------------------------------------------------------------- RoPE row order
def interleaved_to_half(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """Meta's interleaved RoPE rows (pairs adjacent) -> Hugging Face's (halves apart)."""
    head_dim = rows.shape[0] // heads
    out = rows.reshape(heads, head_dim // 2, 2, *rows.shape[1:]).transpose(1, 2)
    return out.reshape(rows.shape)


def half_to_interleaved(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """Hugging Face's RoPE row order -> Meta's (inverse of ``interleaved_to_half``)."""
    head_dim = rows.shape[0] // heads
    out = rows.reshape(heads, 2, head_dim // 2, *rows.shape[1:]).transpose(1, 2)
    return out.reshape(rows.shape)


# ---------------------------------------------------------------------- the chunks
def _ranks(group: dist.ProcessGroup | None) -> tuple[int, int, bool]:
    if not dist.is_initialized():
        return 0, 1, True
    return dist.get_rank(group), dist.get_world_size(group), False


def _chunks(value: torch.Tensor) -> RegionTensor:
    """This rank's chunks of ``value`` as views of its local data: a DTensor's (any
    placement; a copy replicated over a mesh dim is written by its first holder only)
    or a plain tensor's one box."""
    if not isinstance(value, DTensor) and not isinstance(value, RegionTensor):
        box: Box = (tuple(0 for _ in value.shape), tuple(value.shape))
        pieces = [(box, value.detach())] if value.numel() else []
        return RegionTensor(value.shape, pieces, True, value.dtype, value.device)
    chunks = chunks_of(value)
    if isinstance(value, DTensor) and not hasattr(value, "_chunks"):
        coordinate = value.device_mesh.get_coordinate() or []
        chunks.writer = all(
            c == 0 for c, p in zip(coordinate, value.placements) if p.is_replicate()
        )
    return chunks


def _framed_chunks(fqn: str, value: torch.Tensor, frames: Frames | None) -> RegionTensor:
    """``_chunks``, placed at the value's offset in its whole tensor when framed."""
    chunks = _chunks(value)
    frame = frames.get(fqn) if frames else None
    return chunks if frame is None else framed(chunks, frame, fqn)


def _at_rows(chunks: RegionTensor, first: int, total: int) -> RegionTensor:
    """``chunks`` as the rows ``first..`` of dim 1 of a tensor of ``total`` such rows."""
    pieces = [
        ((offsets[:1] + (offsets[1] + first,) + offsets[2:], sizes), t)
        for (offsets, sizes), t in chunks.pieces
    ]
    shape = torch.Size((chunks.shape[0], total, *chunks.shape[2:]))
    return RegionTensor(shape, pieces, chunks.writer, chunks.dtype, chunks.device)


def _by_name(chunks: RegionTensor, key: HFKey) -> dict[str, RegionTensor]:
    """HF name -> chunks: one entry (placed at its rows of a shared tensor), or one per
    expert of a stack (views of its pieces)."""
    if key.rows[1]:
        return {key.name: _at_rows(chunks, *key.rows)}
    if not key.experts:
        return {key.name: chunks}
    if chunks.shape[0] != key.experts:
        raise ValueError(
            f"'{key.name}': a stack of {chunks.shape[0]} experts, the Hugging Face names "
            f"{key.experts}"
        )
    out = {}
    for e, name in enumerate(key.names()):
        pieces = [
            ((offsets[1:], sizes[1:]), t[e - offsets[0]])
            for (offsets, sizes), t in chunks.pieces
            if offsets[0] <= e < offsets[0] + sizes[0]
        ]
        out[name] = RegionTensor(
            chunks.shape[1:], pieces, chunks.writer, chunks.dtype, chunks.device
        )
    return out


def _shard_files(
    shapes: Mapping[str, Sequence[int]],
    keys: Mapping[str, HFKey],
    dtype: torch.dtype,
    max_shard_bytes: int,
) -> dict[str, int]:
    """HF name -> output file index (1..N): tensors in state-dict order (a stack's
    experts in turn), a new file when the next would pass ``max_shard_bytes`` (the same
    answer on every rank)."""
    mapping, index, used = {}, 1, 0
    size = torch.empty((), dtype=dtype).element_size()
    for fqn, shape in shapes.items():
        key = keys[fqn]
        if key.name in mapping:  # a shared tensor: placed with its first key
            continue
        if key.rows[1]:
            shape = (shape[0], key.rows[1], *shape[2:])
        per_name = math.prod(shape[1:] if key.experts else shape) * size
        for name in key.names():
            if used and used + per_name > max_shard_bytes:
                index, used = index + 1, 0
            mapping[name] = index
            used += per_name
    return mapping


class _ChunkFileWriter(HuggingFaceStorageWriter):
    """``HuggingFaceStorageWriter(save_distributed=True)`` keys each rank's safetensors
    file by FQN, so a rank holding several chunks of one tensor (FlatShard's partial
    rows, BlockShard's tile runs) would keep only the last. Here chunk k of a key goes
    to part file k: every file holds at most one chunk per key."""

    def write_data(self, plan: Any, planner: Any) -> Future:
        if not plan.items:
            fut: Future = Future()
            fut.set_result([])
            return fut
        mapping = plan.storage_data["fqn_to_index_mapping"]
        shard = plan.storage_data["shard_index"]
        last = max(mapping.values())
        files: dict[tuple[int, int], list[Any]] = {}
        seen: dict[str, int] = {}
        for item in plan.items:
            part = seen.get(item.index.fqn, 0)
            seen[item.index.fqn] = part + 1
            files.setdefault((mapping[item.index.fqn], part), []).append(item)
        import queue

        file_queue: queue.Queue = queue.Queue()
        for (index, part), items in files.items():
            name = f"part-{part}-" + hf_file_name(index, last, shard)
            file_queue.put((self.fs.concat_path(self.path, name), name, items))
        return self._write_data(planner, file_queue)


def _export_chunks(value: torch.Tensor, dtype: torch.dtype, seen: set[tuple]) -> RegionTensor:
    """This rank's chunks in the export dtype, on the CPU (the writer's requirement).
    safetensors refuses two names for the same memory (tied weights, one tensor under
    two keys): a view ``seen`` before is written from a copy."""
    chunks = _chunks(value)
    pieces = []
    for box, t in chunks.pieces:
        t = t.detach().to("cpu", dtype)
        view = (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride())
        pieces.append((box, t.clone() if view in seen else t))
        seen.add(view)
    return RegionTensor(chunks.shape, pieces, chunks.writer, dtype, torch.device("cpu"))


def _tensor_spans(path: str) -> dict[str, tuple[int, list[int], str]]:
    """name -> (absolute byte offset, shape, dtype string) of every tensor in a
    safetensors file, from its header."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return {
        name: (8 + length + entry["data_offsets"][0], entry["shape"], entry["dtype"])
        for name, entry in header.items()
        if name != "__metadata__"
    }


def stored_tensors(root: str | os.PathLike) -> dict[str, StoredTensor]:
    """Every tensor of a Hugging Face folder (its index's files, or its one file), from
    the safetensors headers alone."""
    root = os.fspath(root)
    index = os.path.join(root, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = [SINGLE_FILE]
    out = {}
    for name in files:
        path = os.path.join(root, name)
        for key, (_, shape, dtype) in _tensor_spans(path).items():
            out[key] = StoredTensor(path, dtype, tuple(shape))
    return out


def tensor_names(path: str | os.PathLike) -> set[str]:
    """The names of the tensors a Hugging Face folder holds: its index's, or its one
    file's header's."""
    root = os.fspath(path)
    index = os.path.join(root, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            return set(json.load(f)["weight_map"])
    return set(_tensor_spans(os.path.join(root, SINGLE_FILE)))


def check_safetensors_folder(path: str | os.PathLike) -> None:
    """Every ``*.safetensors`` file of a Hugging Face folder is whole: its header parses
    and its tensors' bytes are all there, and every file its index names exists. A
    ValueError naming the file and what is wrong otherwise; reads only the headers."""
    folder = os.fspath(path)
    index = os.path.join(folder, INDEX_FILE)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                named = set(json.load(f)["weight_map"].values())
        except (ValueError, KeyError, AttributeError) as err:
            raise ValueError(f"'{index}': not a safetensors index ({err!r})") from None
        for name in sorted(named):
            if not os.path.isfile(os.path.join(folder, name)):
                raise ValueError(f"'{index}' names '{name}', which the folder does not have")
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            _check_safetensors_file(os.path.join(folder, name))


def _check_safetensors_file(path: str) -> None:
    """A safetensors file: an 8-byte header length, a JSON header, then the bytes its
    entries' ``data_offsets`` span, to the end of the file exactly."""
    size = os.path.getsize(path)
    if size < 8:
        raise ValueError(f"'{path}': not a safetensors file ({size} bytes, no header)")
    with open(path, "rb") as f:
        head = f.read(8)
        if head == b"version ":  # a clone without git-lfs holds the pointer, not the file
            raise ValueError(f"'{path}': a Git LFS pointer, not the weights (git lfs pull)")
        (length,) = struct.unpack("<Q", head)
        if 8 + length > size:
            raise ValueError(
                f"'{path}': truncated or not a safetensors file: its header alone says "
                f"{8 + length} bytes, the file has {size}"
            )
        try:
            header = json.loads(f.read(length))
            end = max(
                (e["data_offsets"][1] for k, e in header.items() if k != "__metadata__"),
                default=0,
            )
        except (ValueError, KeyError, TypeError, AttributeError, IndexError):
            raise ValueError(f"'{path}': not a safetensors file (its header is not one)") from None
    if 8 + length + end != size:
        what = "truncated" if 8 + length + end > size else "longer than its header says"
        raise ValueError(f"'{path}': {what}: header says {8 + length + end} bytes, file has {size}")


def _permute_in_file(path: str, rope: Mapping[str, int], dtype: torch.dtype) -> None:
    """Rewrite the RoPE projections of one consolidated file in Hugging Face row
    order, in place, one tensor at a time (same bytes, rows moved)."""
    spans = _tensor_spans(path)
    with open(path, "r+b") as f:
        for name, (offset, shape, _) in spans.items():
            if name not in rope:
                continue
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            f.seek(offset)
            raw = bytearray(f.read(nbytes))
            rows = torch.frombuffer(raw, dtype=dtype).view(shape)
            f.seek(offset)
            f.write(interleaved_to_half(rows, rope[name]).contiguous().view(torch.uint8).numpy())


def export_safetensors(
    model: nn.Module | Mapping[str, torch.Tensor],
    path: str | os.PathLike,
    keys: Mapping[str, HFKey] | None = None,
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int = 2**31,
    process_group: dist.ProcessGroup | None = None,
    shapes: Mapping[str, Sequence[int]] | None = None,
    frames: Frames | None = None,
) -> dict[str, int]:
    """Write the whole model as the tensors of a Hugging Face folder under ``path``:
    ``model.safetensors`` when they fit in ``max_shard_bytes``, else
    ``model-0000i-of-0000N.safetensors`` files (each at most ``max_shard_bytes``, a
    larger tensor alone) and ``model.safetensors.index.json`` (what ``save_pretrained``
    writes and ``from_pretrained`` reads; no config.json, which is the caller's). Every
    tensor is written whole, in ``dtype``, under its Hugging Face name: ``keys[fqn]``
    (RoPE projections in Hugging Face's row order, expert stacks as one tensor per
    expert), or, without ``keys``, the state-dict key itself (a transformers model's
    names are Hugging Face's). Returns the name -> file index map.

    ``model``: a sharded module (its ``state_dict()``: DTensors of any placement) or
    such a state dict (plain tensors in one process). Nothing is gathered: every rank
    of ``process_group`` calls it and writes the chunks it stores, then the ranks
    consolidate the files between them. ``shapes``: every FQN of the whole model and
    its whole shape, in file order, when ``model`` is this rank's part (pipeline
    stages; the same on every rank; ``keys`` names them all). ``frames``: FQN ->
    (whole shape, offset) of values that are slices of a larger tensor (expert
    parallelism)."""
    state = model.state_dict() if isinstance(model, nn.Module) else model
    if shapes is None:
        shapes = {
            fqn: frames[fqn][0] if frames and fqn in frames else tuple(v.shape)
            for fqn, v in state.items()
        }
    if keys is None:
        keys = {fqn: HFKey(fqn) for fqn in shapes}
    missing = [fqn for fqn in list(state) + list(shapes) if fqn not in keys]
    if missing:
        raise KeyError(f"no Hugging Face name for state-dict key(s) {missing[:5]}")
    outside = [fqn for fqn in state if fqn not in shapes]
    if outside:
        raise KeyError(f"state-dict key(s) {outside[:5]} are not in the whole model's shapes")
    rank, world, no_dist = _ranks(process_group)
    root = os.path.abspath(os.fspath(path))
    sharded = os.path.join(root, SHARDED_DIR)
    mapping = _shard_files(shapes, keys, dtype, max_shard_bytes)
    if rank == 0:
        shutil.rmtree(sharded, ignore_errors=True)
        os.makedirs(sharded)
    if not no_dist:
        dist.barrier(process_group)
    seen: set[tuple] = set()
    export: dict[str, RegionTensor] = {}
    for fqn, value in state.items():
        for name, chunks in _by_name(_framed_chunks(fqn, value, frames), keys[fqn]).items():
            chunks = _export_chunks(chunks, dtype, seen)
            if name in export:  # a tensor several keys share: their pieces together
                pieces = export[name].pieces + chunks.pieces
                chunks = RegionTensor(chunks.shape, pieces, chunks.writer, dtype, chunks.device)
            export[name] = chunks
    writer = _ChunkFileWriter(sharded, fqn_to_index_mapping=mapping, save_distributed=True)
    with single_process_dcp(no_dist):
        dcp.save(export, storage_writer=writer, process_group=process_group, no_dist=no_dist)
    del export
    # each rank builds the output files with index % world == rank, one tensor at a time
    if no_dist:
        consolidate_safetensors_files(sharded, root, mapping)
    else:
        consolidate_safetensors_files_on_every_rank(sharded, root, mapping, 1, process_group)
    rope = {keys[f].name: keys[f].rope_heads for f in shapes if keys[f].rope_heads}
    last = max(mapping.values())
    for index in sorted(set(mapping.values())):
        if index % world == rank:
            _permute_in_file(os.path.join(root, hf_file_name(index, last)), rope, dtype)
    if not no_dist:
        dist.barrier(process_group)
    if rank == 0:
        shutil.rmtree(sharded)
        if last == 1:  # one file: named as save_pretrained names it, no index
            os.replace(os.path.join(root, hf_file_name(1, 1)), os.path.join(root, SINGLE_FILE))
            os.remove(os.path.join(root, INDEX_FILE))
    if not no_dist:  # the files in place before any rank returns
        dist.barrier(process_group)
    return mapping


# ---------------------------------------------------------------------- load
def _rope_target(chunks: RegionTensor, heads: int) -> RegionTensor | None:
    """One box around this rank's chunks, widened to whole heads: the rows the RoPE
    permutation needs (at most one extra head above and below)."""
    if not chunks.pieces:
        return None
    head_dim = chunks.shape[0] // heads
    starts = [o for (o, _), _ in chunks.pieces]
    ends = [[a + b for a, b in zip(o, s)] for (o, s), _ in chunks.pieces]
    lo = [min(s[d] for s in starts) for d in range(len(chunks.shape))]
    hi = [max(e[d] for e in ends) for d in range(len(chunks.shape))]
    lo[0] = lo[0] // head_dim * head_dim
    hi[0] = -(-hi[0] // head_dim) * head_dim
    sizes = tuple(b - a for a, b in zip(lo, hi))
    buffer = torch.empty(sizes, dtype=chunks.dtype, device=chunks.device)
    return RegionTensor(
        chunks.shape, [((tuple(lo), sizes), buffer)], False, chunks.dtype, chunks.device
    )


def _fill_from_rope(chunks: RegionTensor, target: RegionTensor, heads: int) -> None:
    """Copy the loaded head-aligned rows, back in interleaved order, into the chunks."""
    ((lo, sizes), rows) = target.pieces[0]
    head_dim = chunks.shape[0] // heads
    rows = half_to_interleaved(rows, sizes[0] // head_dim)
    for (offsets, box), view in chunks.pieces:
        index = tuple(slice(o - a, o - a + s) for o, a, s in zip(offsets, lo, box))
        view.copy_(rows[index])


def _check_against(
    reader: HuggingFaceStorageReader, wanted: dict[str, torch.Tensor], root: str
) -> None:
    """Every wanted key is in the folder with its shape, or a ValueError naming it."""
    saved = reader.read_metadata().state_dict_metadata
    problems = []
    for name, value in wanted.items():
        md = saved.get(name)
        if not isinstance(md, TensorStorageMetadata):
            problems.append(f"'{name}' is missing")
        elif tuple(md.size) != tuple(value.shape):
            problems.append(
                f"'{name}' has shape {tuple(md.size)}, the model expects {tuple(value.shape)}"
            )
    if problems:
        raise ValueError(f"cannot load Hugging Face checkpoint '{root}': " + "; ".join(problems))


def _check_writes_through(fqn: str, value: torch.Tensor, chunks: RegionTensor) -> None:
    """Loading copies into the chunks in place: they must be views of the parameter's
    own storage, not copies (else the load would change nothing, silently)."""
    local = local_tensor(value) if isinstance(value, DTensor) else value
    base = local.untyped_storage().data_ptr()
    for _, piece in chunks.pieces:
        if piece.untyped_storage().data_ptr() != base:
            raise RuntimeError(f"'{fqn}': this rank's chunks are not views of its storage")


def load_hf_safetensors(
    path: str | os.PathLike,
    state: Mapping[str, torch.Tensor],
    keys: Mapping[str, HFKey],
    process_group: dist.ProcessGroup | None = None,
    frames: Frames | None = None,
    quantization: BlockScaled | None = None,
) -> None:
    """Read a Hugging Face safetensors folder into ``state`` (a sharded
    ``model.state_dict()``, or plain tensors) in place: every rank reads the slices it
    stores (RoPE projections: the whole heads around them). Several state-dict keys
    may read the same HF key (tied embeddings). ``state`` may be this rank's part of
    the model (pipeline stages); ``frames`` places slices in their whole tensors
    (expert parallelism). ``quantization``: the folder's FP8 format
    (``hf_dequantize.block_scaled`` of its config.json), whose quantized weights are
    dequantized into ``state``'s dtype as they are read; without it a quantized weight
    is a ValueError naming it. Every rank calls it."""
    _, _, no_dist = _ranks(process_group)
    root = os.path.abspath(os.fspath(path))
    # one dcp.load per round: a key read twice (tied weights) goes in a second round
    rounds: list[dict[str, tuple[RegionTensor, RegionTensor | None, int]]] = []
    for fqn, value in state.items():
        key = keys[fqn]
        whole = _framed_chunks(fqn, value, frames)
        _check_writes_through(fqn, value, whole)
        for name, chunks in _by_name(whole, key).items():
            target = _rope_target(chunks, key.rope_heads) if key.rope_heads else chunks
            entry = (chunks, target, key.rope_heads)
            for round_ in rounds:
                if name not in round_:
                    round_[name] = entry
                    break
            else:
                rounds.append({name: entry})
    if not no_dist:  # dcp.load is collective: ranks holding other parts agree on rounds
        counts: list[Any] = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(counts, len(rounds), group=process_group)
        rounds += [{} for _ in range(max(counts) - len(rounds))]
    stored = stored_tensors(root)
    quantized = {n for r in rounds for n, e in r.items() if is_quantized(n, stored, e[0].dtype)}
    if quantized and quantization is None:
        name = sorted(quantized)[0]
        raise ValueError(
            f"cannot load Hugging Face checkpoint '{root}': '{name}' is stored "
            f"{stored[name].dtype} (quantized), and its config.json has no "
            "quantization_config"
        )
    if quantization is not None:
        # torch's reader refuses dtypes such folders hold (ue8m0 scales): every tensor
        # is read here, region by region, none of it collective
        for round_ in rounds:
            for name, (chunks, target, heads) in round_.items():
                if target is None:
                    continue
                if name in quantized:
                    read_dequantized(name, target, stored, quantization)
                else:
                    read_stored(name, target, stored)
                if heads:
                    with torch.no_grad():
                        _fill_from_rope(chunks, target, heads)
        return
    reader = HuggingFaceStorageReader(root)
    _check_against(reader, {name: e[0] for r in rounds for name, e in r.items()}, root)
    for round_ in rounds:
        # a rank with nothing of a key still names it, with no chunks to read
        load = {
            name: (
                target
                if target is not None
                else RegionTensor(chunks.shape, [], False, chunks.dtype, chunks.device)
            )
            for name, (chunks, target, _) in round_.items()
        }
        with single_process_dcp(no_dist):
            dcp_load(load, root, process_group, no_dist, HuggingFaceStorageReader(root))
        for chunks, target, heads in round_.values():
            if heads and target is not None:
                with torch.no_grad():
                    _fill_from_rope(chunks, target, heads)
