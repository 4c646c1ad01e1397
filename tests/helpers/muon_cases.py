"""Shared pieces of the DistMuon tests: a bag of matrices, their gradients and the
single-process references (the collective guard is flexshard.testing.collectives)."""

from __future__ import annotations

import torch
from torch import nn

import flexshard as fs
from flexshard.runtime.bucket import slot_of
from flexshard.runtime.dtensor.region_dtensor import wrap
from flexshard.testing.collectives import forbid_collectives

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


def mixed_placement(fqn: str, _param: torch.Tensor) -> fs.Placement:
    """One mixed bucket over ``SHAPES``: whole matrices, row and column cuts, flat
    ranges and tiles side by side."""
    return {
        "a": fs.Owned(),
        "b": fs.Shard(1),
        "c": fs.FlatShard(),
        "qkv": fs.BlockShard((6, 18)),
        "t": fs.Shard(0),
        "e": fs.Owned(),
    }[fqn]


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
    regions = bucket.layout.params[index].regions[bucket.store.rank]
    pieces = [region.view_of(full).reshape(-1) for region in regions]
    flat = torch.cat(pieces) if pieces else full.new_empty(0)
    # a gradient placed like the parameter: a DTensor over this rank's local elements
    return wrap(flat.view(bucket.local_tensor(index).shape).clone(), bucket.specs[index])


def set_grads(model: nn.Module, grads: dict[str, torch.Tensor]) -> None:
    for name, param in model.named_parameters():
        param.grad = local_part(param, grads[name])


def checked_step(opt: torch.optim.Optimizer, comm_free: bool) -> None:
    """One optimizer step; with every collective forbidden where it must need none."""
    if comm_free:
        with forbid_collectives():
            opt.step()
    else:
        opt.step()


def split_rows(full: torch.Tensor, rows: int) -> list[torch.Tensor]:
    return list(full.split(rows, dim=0))


def reference_params(
    names: tuple[str, ...],
    steps: int,
    row_blocks: tuple[str, ...] | dict[str, int] = (),
    **muon_kwargs,
) -> dict[str, torch.Tensor]:
    """torch.optim.Muon on the full matrices: a row-block parameter as one Muon matrix
    per block of its rows (``row_blocks``: names in blocks of HEAD_ROWS, or name ->
    rows), an expert stack as one Muon matrix per expert."""
    rows = row_blocks if isinstance(row_blocks, dict) else dict.fromkeys(row_blocks, HEAD_ROWS)
    model = Mats(names)
    pieces: dict[str, list[nn.Parameter]] = {}
    for name, param in model.named_parameters():
        data = param.detach()
        if name in rows:
            parts = split_rows(data, rows[name])
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
            if name in rows:
                parts = split_rows(g, rows[name])
            else:
                parts = list(g.unbind(0)) if g.ndim == 3 else [g]
            for p, part in zip(params, parts):
                p.grad = part.clone()
        opt.step()
    out = {}
    for name, params in pieces.items():
        if name in rows:
            out[name] = torch.cat([p.detach() for p in params])
        elif SHAPES[name].__len__() == 3:
            out[name] = torch.stack([p.detach() for p in params])
        else:
            out[name] = params[0].detach()
    return out
