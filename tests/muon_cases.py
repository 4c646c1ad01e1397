"""Shared pieces of the DistMuon tests: a bag of matrices, their gradients, the
single-process references and a guard that fails on any collective."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch import nn

from flexshard.runtime.bucket import slot_of

LR = 0.02
STEPS = 3
SHAPES = {
    "a": (17, 29),  # 17 rows: never divides W
    "b": (29, 18),  # tall: Newton–Schulz works on the transpose
    "c": (18, 18),
    "qkv": (54, 18),  # fused attention, 3 x 3 heads of 6 rows
    "t": (3, 20),  # fewer rows than W = 4: some ranks hold nothing
    "e": (3, 17, 10),  # an expert stack [E, R, C]
}
HEAD_ROWS = 6

COLLECTIVES = (
    "all_to_all_single", "all_to_all", "all_gather", "all_gather_into_tensor",
    "all_gather_single", "all_reduce", "broadcast", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "reduce_scatter_single", "scatter", "gather", "send", "recv",
    "isend", "irecv", "barrier", "batch_isend_irecv", "all_gather_object",
    "broadcast_object_list",
)  # fmt: skip


class Mats(nn.Module):
    """Only parameters: the DistMuon tests set gradients directly."""

    def __init__(self, names: tuple[str, ...] = tuple(SHAPES), seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        for name in names:
            self.register_parameter(name, nn.Parameter(torch.randn(SHAPES[name], generator=gen)))


def full_grads(names: tuple[str, ...], step: int) -> dict[str, torch.Tensor]:
    """The same gradients on every rank (so data-parallel averaging is exact)."""
    gen = torch.Generator().manual_seed(1000 + step)
    return {name: torch.randn(SHAPES[name], generator=gen) for name in names}


def local_part(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's elements of ``full``, laid out as flexshard stores ``param``."""
    slot = slot_of(param)
    if slot is None:
        return full.clone()
    bucket, index = slot
    regions = bucket.layout.params[index].regions[bucket.rank]
    pieces = [region.view_of(full).reshape(-1) for region in regions]
    flat = torch.cat(pieces) if pieces else full.new_empty(0)
    return flat.view(param.shape).clone()


def set_grads(model: nn.Module, grads: dict[str, torch.Tensor]) -> None:
    for name, param in model.named_parameters():
        param.grad = local_part(param, grads[name])


def split_rows(full: torch.Tensor, rows: int) -> list[torch.Tensor]:
    return list(full.split(rows, dim=0))


def reference_params(
    names: tuple[str, ...], steps: int, row_blocks: tuple[str, ...] = (), **muon_kwargs
) -> dict[str, torch.Tensor]:
    """torch.optim.Muon on the full matrices: a row-block parameter as one Muon matrix
    per block of HEAD_ROWS rows, an expert stack as one Muon matrix per expert."""
    model = Mats(names)
    pieces: dict[str, list[nn.Parameter]] = {}
    for name, param in model.named_parameters():
        data = param.detach()
        if name in row_blocks:
            parts = split_rows(data, HEAD_ROWS)
        elif data.ndim == 3:
            parts = list(data.unbind(0))
        else:
            parts = [data]
        pieces[name] = [nn.Parameter(p.clone()) for p in parts]
    opt = torch.optim.Muon([p for ps in pieces.values() for p in ps], lr=LR, **muon_kwargs)
    for step in range(steps):
        grads = full_grads(names, step)
        for name, params in pieces.items():
            g = grads[name]
            if name in row_blocks:
                parts = split_rows(g, HEAD_ROWS)
            else:
                parts = list(g.unbind(0)) if g.ndim == 3 else [g]
            for p, part in zip(params, parts):
                p.grad = part.clone()
        opt.step()
    out = {}
    for name, params in pieces.items():
        if name in row_blocks:
            out[name] = torch.cat([p.detach() for p in params])
        elif SHAPES[name].__len__() == 3:
            out[name] = torch.stack([p.detach() for p in params])
        else:
            out[name] = params[0].detach()
    return out


def _sequence_numbers() -> dict[object, int]:
    """Per process group, how many collectives it has issued (the backend's own count,
    which functional collectives and direct ProcessGroup calls advance too)."""
    if not dist.is_initialized():
        return {}
    return {pg: pg._get_sequence_number_for_group() for pg in list(c10d._world.pg_map)}


@contextlib.contextmanager
def no_collectives() -> Iterator[None]:
    """Every torch.distributed collective raises while inside, and on the way out no
    process group may have issued one by any other route."""

    def forbidden(name: str):
        def fail(*args, **kwargs):
            raise AssertionError(f"collective torch.distributed.{name} ran inside step()")

        return fail

    before = _sequence_numbers()
    saved = []
    for module in (dist, c10d):
        for name in COLLECTIVES:
            if hasattr(module, name):
                saved.append((module, name, getattr(module, name)))
                setattr(module, name, forbidden(name))
    try:
        yield
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)
    after = _sequence_numbers()
    moved = [pg for pg, n in before.items() if after.get(pg) != n]
    assert not moved, f"{len(moved)} process group(s) issued collectives inside the block"


@contextlib.contextmanager
def count_collectives(counts: dict[str, int]) -> Iterator[None]:
    """Count the torch.distributed collectives that run inside (and let them run)."""
    saved = []
    for name in COLLECTIVES:
        if hasattr(dist, name):
            original = getattr(dist, name)

            def counted(*args, _name=name, _fn=original, **kwargs):
                counts[_name] = counts.get(_name, 0) + 1
                return _fn(*args, **kwargs)

            saved.append((name, original))
            setattr(dist, name, counted)
    try:
        yield
    finally:
        for name, fn in saved:
            setattr(dist, name, fn)
