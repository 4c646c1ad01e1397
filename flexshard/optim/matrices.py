"""Which matrices a DistMuon parameter holds on this rank, and whether computing on
them needs communication. Decided from the bucket layout of *every* rank, so all
ranks of a shard group agree on which parameters are redistributed."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from ..placements import ParamLayout, Region
from ..runtime.bucket import Bucket, slot_of

Shape = tuple[int, ...]


class Kind(enum.Enum):
    WHOLE = "whole"  # the local tensor is the whole 2-D matrix (plain tensor, Owned owner)
    EXPERTS = "experts"  # the local tensor is whole experts of a [E, R, C] stack
    ROW_BLOCKS = "row_blocks"  # full-width row blocks, each its own matrix
    NOTHING = "nothing"  # a whole-matrix placement that put nothing on this rank
    REMOTE = "remote"  # the matrix is split across ranks: redistribute to an owner


@dataclass(frozen=True)
class Block:
    """A row block in the local tensor: ``numel`` elements from ``offset``, shaped ``shape``."""

    offset: int
    shape: Shape


@dataclass
class Target:
    """One parameter of a DistMuon group, resolved against its storage."""

    param: torch.Tensor
    name: str  # for error messages: the parameter and, if sharded, its bucket
    group: dict
    kind: Kind
    shape: Shape  # the full parameter's shape
    bucket: Bucket | None = None
    index: int = -1
    blocks: tuple[Block, ...] = ()


def _is_full_width(region: Region, shape: Shape) -> bool:
    return not region.flat and region.offsets[-1] == 0 and region.sizes[-1] == shape[-1]


def _whole_experts(region: Region, shape: Shape) -> bool:
    return not region.flat and region.sizes[-2:] == shape[-2:]


def _check_ndim(name: str, shape: Shape) -> None:
    if len(shape) not in (2, 3):
        raise ValueError(
            f"DistMuon: {name} has shape {tuple(shape)}; Muon takes 2-D matrices and 3-D "
            "expert stacks [E, R, C] only (give embeddings' 1-D params, norms and biases "
            "to AdamW, e.g. with flexshard.optim.muon_and_adamw)"
        )


def resolve(param: torch.Tensor, name: str, group: dict) -> Target:
    """Classify ``param`` for DistMuon; raise ValueError naming it when Muon cannot
    take it. No collective: every rank sees every rank's layout."""
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"DistMuon: {name} is a {type(param).__name__}, not a tensor")
    slot = slot_of(param)
    if slot is None:  # a plain tensor is a whole matrix (or a whole stack) on this rank
        shape = tuple(param.shape)
        _check_ndim(name, shape)
        kind = Kind.WHOLE if len(shape) == 2 else Kind.EXPERTS
        return Target(param, name, group, kind, shape)
    bucket, index = slot
    layout: ParamLayout = bucket.layout.params[index]
    name = f"parameter '{layout.fqn}' in bucket '{bucket.name}'"
    shape = layout.shape
    _check_ndim(name, shape)
    target = Target(param, name, group, Kind.REMOTE, shape, bucket, index)
    all_regions = [r for regions in layout.regions for r in regions]
    mine = layout.regions[bucket.rank]
    if bucket.layout.replicated:
        return target  # one owner computes, the others receive its update
    if group["row_blocks"]:
        if len(shape) != 2:
            raise ValueError(f"DistMuon: row_blocks takes 2-D matrices; {name} is {shape}")
        for region in all_regions:
            if not _is_full_width(region, shape):
                raise ValueError(
                    f"DistMuon: {name} stores a block of {region.sizes} at {region.offsets} "
                    f"that does not span whole rows of its shape {shape}; per-block Muon "
                    f"needs BlockShard((rows, {shape[-1]})) so each block is whole rows"
                )
        blocks, offset = [], 0
        for region in mine:
            blocks.append(Block(offset, region.sizes))
            offset += region.numel
        target.kind, target.blocks = Kind.ROW_BLOCKS, tuple(blocks)
        return target
    if len(shape) == 2 and all(not regions or regions == (Region((0, 0), shape),)
                               for regions in layout.regions):
        target.kind = Kind.WHOLE if mine else Kind.NOTHING
        return target
    if len(shape) == 3 and all(_whole_experts(r, shape) for r in all_regions):
        target.kind = Kind.EXPERTS if mine else Kind.NOTHING
        return target
    return target
