"""RegionShard: the DTensor placement of a FlatShard, Owned or BlockShard parameter.

torch's own placements cut a tensor into one box per rank; these cut it into the
regions a flexshard ``ParamLayout`` gives each rank (a flat range, a whole parameter
or nothing, whole 2-D tiles). The placement carries that layout, so it knows every
rank's global offsets, and it moves a tensor between its regions and Replicate."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import Placement as TorchPlacement

from ...placements.layout import ParamLayout
from ...torch_internals import all_gather_single


class RegionShard(TorchPlacement):
    """Each rank of one mesh dimension stores the regions ``layout.regions[rank]`` of
    the tensor (or of its tensor-parallel piece), flattened in region order."""

    def __init__(self, kind: str, layout: ParamLayout) -> None:
        super().__init__()
        self.kind = kind  # the flexshard placement's name, for messages
        self.layout = layout

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RegionShard):
            return False
        return other.layout is self.layout or other.layout == self.layout

    def __hash__(self) -> int:
        return hash((self.layout.fqn, self.layout.shape, self.layout.regions))

    def __repr__(self) -> str:
        return f"{self.kind}(param='{self.layout.fqn}')"

    def __str__(self) -> str:
        return repr(self)

    # ``is_shard``/``is_replicate``/``is_partial`` stay False: torch's sharding rules
    # must never mistake these regions for one of its own cuts

    def local_shape(self, rank: int) -> tuple[int, ...]:
        return self.layout.local_shape(rank)

    def take(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s local tensor out of the full tensor (a copy; no collective)."""
        pieces = [region.view_of(full).reshape(-1) for region in self.layout.regions[rank]]
        flat = torch.cat(pieces) if pieces else full.new_empty(0)
        return flat.view(self.local_shape(rank))

    def gather(self, local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        """The full tensor from every rank's local tensor: one all-gather padded to the
        largest rank (gloo cannot gather different sizes)."""
        layout = self.layout
        width = max(layout.local_numel(r) for r in range(len(layout.regions)))
        send = local.new_zeros(width)
        send[: local.numel()].copy_(local.reshape(-1))
        received = local.new_empty(len(layout.regions) * width)
        all_gather_single(received, send, group=group)
        full = local.new_empty(layout.shape)
        for rank, regions in enumerate(layout.regions):
            cursor = rank * width
            for region in regions:
                piece = received[cursor : cursor + region.numel]
                region.view_of(full).copy_(piece.view(region.sizes))
                cursor += region.numel
        return full
