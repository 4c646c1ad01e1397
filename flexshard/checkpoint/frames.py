"""Logical frames: a rank's tensor that is itself a slice of a larger logical tensor
(expert parallelism keeps ``E / ep`` experts of an ``[E, ...]`` stack) is saved at its
offset in the whole tensor, so a checkpoint is one logical model whatever the degree.

``frames`` maps an FQN to (whole shape, offset of this rank's tensor in it). A framed
value is a RegionTensor whose pieces are views of the original's local data: ``dcp.load``
into it fills the original.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..runtime.dtensor.chunks import RegionTensor, chunks_of, shifted

Frame = tuple[Sequence[int], Sequence[int]]
Frames = Mapping[str, Frame]


def framed(value: torch.Tensor, frame: Frame, key: str) -> RegionTensor:
    """``value`` (a sharded parameter or optimizer state like it, or a plain tensor)
    as chunks of the whole tensor ``frame`` describes."""
    shape, offset = tuple(frame[0]), tuple(frame[1])
    if len(shape) != value.dim() or any(o + s > w for o, s, w in zip(offset, value.shape, shape)):
        raise ValueError(
            f"'{key}': a tensor of shape {tuple(value.shape)} does not fit at offset "
            f"{offset} in the whole {shape}"
        )
    if isinstance(value, (RegionTensor, DTensor)):
        chunks = chunks_of(value)
    else:  # a plain tensor: one piece, written by this rank
        full = ((0,) * value.dim(), tuple(value.shape))
        chunks = RegionTensor(value.shape, [(full, value)], True, value.dtype, value.device)
    boxes = shifted([box for box, _ in chunks.pieces], offset)
    pieces = [(box, t) for box, (_, t) in zip(boxes, chunks.pieces)]
    return RegionTensor(shape, pieces, chunks.writer, value.dtype, value.device, chunks.slot)


def frame_of(frames: Frames | None, fqn: str | None) -> Frame | None:
    return None if frames is None or fqn is None else frames.get(fqn)


def framed_state(state: dict[str, Any], frames: Frames | None) -> dict[str, Any]:
    """A ``{"model": ..., "optim": ...}`` state to save (``optim`` keyed by FQN, as
    ``optimizer_state_dict`` or torch's ``get_state_dict`` give it, nested or
    flattened), the entries of framed FQNs placed at their offsets in the whole."""
    if not frames:
        return state
    model = {k: framed(v, frames[k], k) if k in frames else v for k, v in state["model"].items()}
    out = {**state, "model": model}
    if "optim" not in state:
        return out
    optim = state["optim"]

    def one(fqn: str, name: str, value: Any) -> Any:
        frame = frame_of(frames, fqn)
        if frame is None or not _like_param(value, model.get(fqn)):
            return value
        return framed(value, frame, f"state.{fqn}.{name}")

    if "state" not in optim:  # torch's flattened form: "state.<fqn>.<name>" keys
        out["optim"] = {
            k: one(*k[len("state.") :].rsplit(".", 1), v) if k.startswith("state.") else v
            for k, v in optim.items()
        }
        return out
    entries = {
        fqn: {name: one(fqn, name, v) for name, v in values.items()}
        for fqn, values in optim["state"].items()
    }
    out["optim"] = {**optim, "state": entries}
    return out


def _like_param(value: Any, param: Any) -> bool:
    """An optimizer state shaped like its parameter (exp_avg), not a scalar (step)."""
    return (
        isinstance(value, torch.Tensor)
        and value.dim() > 0
        and isinstance(param, torch.Tensor)
        and value.dim() == param.dim()
    )


def unframed(loaded: Any, original: Any) -> Any:
    """After ``dcp.load`` into ``framed_state(original)``: ``original``'s tensors (the
    framed entries are views of them, so they hold the loaded values) and the plain
    values DCP put into ``loaded`` (lr, betas)."""
    if isinstance(original, dict):
        return {k: unframed(loaded[k], v) for k, v in original.items()}
    if isinstance(original, list):
        return [unframed(a, b) for a, b in zip(loaded, original)]
    return original if isinstance(original, torch.Tensor) else loaded
