"""Per-bucket facts of one rank's sharded model, read from the runtime's own buckets
(flexshard), or re-planned with ``Shard(0)`` on the same groups (torch FSDP2's layout:
the torch.chunk rule, each parameter padded to the largest rank's slice)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from flexshard.placements import BlockShard, Owned, Placement, Shard
from flexshard.placements.layout import BucketLayout, plan_bucket
from flexshard.runtime.bucket import Bucket
from flexshard.runtime.module import own_buckets

#: the trainer's bucket of the root's own parameters (flex_shard's "outer";
#: fully_shard's buckets are named by module, the root's "root")
ROOT_NAMES = ("outer", "root")


#: rank_numels by (group size, shapes, placements): a model's Shard blocks share one
_RANK_NUMELS: dict[tuple, list[int]] = {}


@dataclass(frozen=True)
class BucketInfo:
    """One bucket (FSDP2: one ``fully_shard`` group) as every rank of its group sees it."""

    name: str
    layout: BucketLayout  # elements; per rank regions, so all W ranks are known
    placements: tuple[Placement, ...]  # per parameter
    storage_itemsize: int  # sharded parameters (and their gradients), fp32 master
    gather_itemsize: int  # on the wire and in the gathered buffer (bf16 under mixed precision)
    reduce_itemsize: int  # gradient reduce-scatter dtype
    replicas: int  # HSDP replicate degree (gradients all-reduced over them)
    reshard_after_forward: bool
    is_root: bool  # the root's bucket stays gathered from forward into backward
    #: per parameter, the whole matrix's shape (a tensor-parallel piece's is larger
    #: than its layout's); empty: the layout's shapes
    full_shapes: tuple[tuple[int, ...], ...] = ()

    def full_shape(self, index: int) -> tuple[int, ...]:
        return self.full_shapes[index] if self.full_shapes else self.layout.params[index].shape

    @property
    def world(self) -> int:
        return self.layout.world_size

    @property
    def numel(self) -> int:
        return self.layout.numel

    @property
    def shard_numel(self) -> int:
        """Elements per rank on the wire: the padded shard; for a ragged bucket the
        ranks' mean extent (its collectives carry the bucket with no padding, (W - 1) / W
        of it per ring link, as NCCL's grouped broadcasts and reduces do)."""
        layout = self.layout
        if layout.ragged:
            return -(-layout.wire_numel // layout.world_size)
        return layout.shard_numel

    @property
    def gathered_bytes(self) -> int:
        """The all-gather output: W padded shards, or the ragged ranks' extents."""
        if self.layout.replicated:
            return 0
        return self.layout.wire_numel * self.gather_itemsize

    @property
    def unsharded_grad_bytes(self) -> int:
        """The reduce-scatter input (W padded shards, or the ragged extents, in the
        reduce dtype)."""
        return self.layout.wire_numel * self.reduce_itemsize

    @property
    def padding(self) -> float:
        """Share of the communicated elements that are padding."""
        total = self.layout.wire_numel
        return 0.0 if self.layout.replicated or not total else 1 - self.numel / total

    def storage_numels(self) -> list[int]:
        """Elements of each rank's storage buffer: the padded shard everywhere, or each
        rank's own extent when ragged."""
        return [self.layout.extent(rank) for rank in range(self.world)]

    def rank_numels(self) -> list[int]:
        """Elements each rank of the group really stores (its share before padding)."""
        # Shard's split depends on shapes alone (Owned's and BlockShard's also on the
        # bucket's place in the plan), so only all-Shard buckets share a cache entry
        shard_only = all(isinstance(p, Shard) for p in self.placements)
        key = (self.world, tuple(p.shape for p in self.layout.params), self.placements)
        if not shard_only:
            key = (id(self.layout), key)
        if key not in _RANK_NUMELS:
            per_rank = [0] * self.world
            for param in self.layout.params:
                for rank, regions in enumerate(param.regions):
                    per_rank[rank] += sum(r.numel for r in regions)
            _RANK_NUMELS[key] = per_rank
        return _RANK_NUMELS[key]


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def _named_buckets(module: nn.Module) -> list[tuple[str, Bucket]]:
    """Every bucket once, in module pre-order (root, then each block and what is inside
    it: the forward order), named as the runtime names them at the first forward:
    fully_shard's buckets by their module's FQN ("root" for the root)."""
    seen: set[int] = set()
    found = []
    for fqn, m in module.named_modules():
        for bucket in own_buckets(m):
            if id(bucket) in seen:
                continue
            seen.add(id(bucket))
            named_by_type = bucket.name in {c.__name__ for c in type(m).__mro__}
            found.append(((fqn or "root") if named_by_type else bucket.name, bucket))
    return found


def flexshard_buckets(modules: list[nn.Module]) -> list[BucketInfo]:
    """The runtime's buckets of this rank's (stage) modules, in forward order."""
    found = []
    for module in modules:
        for name, bucket in _named_buckets(module):
            mesh = bucket.mesh
            replicas = mesh.size(0) if mesh is not None and mesh.ndim == 2 else 1
            is_root = name in ROOT_NAMES
            reshard = bucket.schedule.reshard_after_forward
            found.append(
                BucketInfo(
                    name=name,
                    layout=bucket.layout,
                    placements=tuple(p.placement for p in bucket.params),
                    storage_itemsize=_itemsize(bucket.store.dtypes[0]),
                    gather_itemsize=_itemsize(bucket.store.param_dtype),
                    reduce_itemsize=_itemsize(bucket.store.reduce_dtype),
                    replicas=replicas,
                    # None: FSDP2's default, every module but the root reshards
                    reshard_after_forward=(not is_root) if reshard is None else bool(reshard),
                    is_root=is_root,
                    full_shapes=tuple(
                        tuple(p.tp_spec.shape) if p.tp_spec is not None else laid.shape
                        for p, laid in zip(bucket.params, bucket.layout.params)
                    ),
                )
            )
    return found


def _signature(info: BucketInfo) -> tuple:
    """Buckets with the same shapes and placements have the same layout up to names
    (every block of a transformer): plan one, rename the others."""
    return (info.world, tuple(p.shape for p in info.layout.params), info.placements)


def fsdp2_equivalent(buckets: list[BucketInfo]) -> list[BucketInfo]:
    """The same groups as torch FSDP2 lays them out: ``Shard(0)`` for every parameter."""
    out = []
    planned: dict[tuple, BucketLayout] = {}
    for info in buckets:
        shard0 = tuple(Shard(0) for _ in info.layout.params)
        if info.placements == shard0:
            layout = info.layout  # already FSDP2's layout
        else:
            key = _signature(info)
            if key not in planned:
                entries = [(p.fqn, p.shape, Shard(0)) for p in info.layout.params]
                planned[key] = plan_bucket(entries, info.world, bucket=info.name)
            template = planned[key]
            params = tuple(
                replace(t, fqn=p.fqn) for t, p in zip(template.params, info.layout.params)
            )
            layout = replace(template, params=params)
        # FSDP2 keeps its root gathered from forward into backward only by default
        # (reshard_after_forward=None); the trainer passes its bool to every
        # fully_shard, root included (torch then reshards the root too, as flexshard
        # does), and flexshard_buckets already maps None to "all but the root"
        out.append(replace(info, layout=layout, placements=shard0))
    return out


def whole_on_rank(placement: Placement, shape: tuple[int, ...]) -> bool:
    """Whether this placement keeps each matrix (or row block of whole rows, or expert)
    on one rank, so an optimizer step on it needs no collective."""
    if isinstance(placement, Owned):
        return True
    if isinstance(placement, BlockShard):
        return placement.block[-1] >= shape[-1]
    # an expert stack's dim-0 rows are whole experts
    return isinstance(placement, Shard) and placement.dim == 0 and len(shape) == 3
