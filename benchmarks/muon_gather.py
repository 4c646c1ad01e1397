"""This project's own gather-everything Muon baseline, written for the benchmark (not
a third-party implementation): the scheme of Moonlight's ZeRO-1 recipe, where every
rank all-gathers every full matrix of each bucket and runs Newton–Schulz on all of
them, then keeps its own shard of each update."""

from __future__ import annotations

import torch

from flexshard.optim import DistMuon
from flexshard.placements.packing import unpack
from flexshard.runtime.bucket import slot_of
from flexshard.torch_internals import all_gather_single


class GatherMuon(DistMuon):
    """Same momentum, Newton–Schulz and update rule as DistMuon (so the same result bit
    for bit); only the movement differs: one bf16 all-gather per bucket (the same wire
    dtype as DistMuon's all-to-alls, Newton–Schulz casts to bf16 first anyway)."""

    gathers = 0  # all-gathers issued

    def _muon_step(self) -> None:
        by_bucket: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                self._targets[id(param)].group = group
                update = self._momentum_update(param, group)
                bucket, _ = slot_of(param)
                by_bucket.setdefault(id(bucket), []).append((param, update))
        for members in by_bucket.values():
            bucket, _ = slot_of(members[0][0])
            layout = bucket.layout
            send = torch.zeros(layout.shard_numel, dtype=torch.bfloat16)
            for param, update in members:
                _, index = slot_of(param)
                offset = layout.params[index].offsets[bucket.store.rank]
                send[offset : offset + update.numel()] = update.reshape(-1)
            gathered = torch.empty(layout.world_size, layout.shard_numel, dtype=torch.bfloat16)
            all_gather_single(gathered.view(-1), send, group=bucket.comm.shard_group)
            moved = (layout.world_size - 1) * send.numel() * send.element_size()  # ring
            self.comm.bytes_sent += moved
            self.comm.bytes_received += moved
            self.gathers += 1
            fulls = [torch.empty(p.shape, dtype=torch.bfloat16) for p in layout.params]
            unpack(layout, gathered, fulls)
            for param, _ in members:
                _, index = slot_of(param)
                target = self._targets[id(param)]
                full_update = self._orthogonalize(target, fulls[index])  # on every rank
                regions = layout.params[index].regions[bucket.store.rank]
                if not regions:
                    continue
                mine = torch.cat([r.view_of(full_update).reshape(-1) for r in regions])
                # target.param is this rank's local tensor (param is a DTensor)
                self._apply(target, mine.view(target.param.shape), target.shape)
