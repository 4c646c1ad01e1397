"""Single-process references: what W data-parallel ranks must compute together."""

from __future__ import annotations

import torch

import flexshard as fs
from flexshard.testing import TinyTransformer, TransformerConfig

CFG = TransformerConfig()


def mixed_placement(fqn: str, param: torch.Tensor) -> fs.Placement:
    """Every placement in one bucket of the test transformer (default config)."""
    if param.ndim < 2:
        return fs.FlatShard()
    if "qkv" in fqn:
        return fs.BlockShard((CFG.dim // CFG.heads, 64))  # one head's rows per tile
    if "up" in fqn or "embed" in fqn:
        return fs.Owned()
    if "down" in fqn:
        return fs.BlockShard((4, 4))
    return fs.Shard(1) if "proj" in fqn else fs.Shard(0)


def train_steps(model, opt, batches, rank: int, world: int, start: int, steps: int) -> list[float]:
    """Steps ``start .. start + steps`` of data-parallel training: this rank's losses."""
    losses = []
    for step in range(start, start + steps):
        tokens, targets = batches[step * world + rank]
        loss = model.loss(tokens, targets)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses


def reference_training(
    model: TinyTransformer,
    batches,
    world_size: int,
    steps: int,
    micro: int = 1,
    lr: float = 1e-2,
    before_step=None,
) -> list[list[float]]:
    """Per step, the loss each rank sees; gradients averaged over ranks (and summed
    over ``micro`` micro-batches) exactly as data parallelism defines them."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    losses = []
    for step in range(steps):
        per_rank = []
        grads = None
        for rank in range(world_size):
            model.zero_grad()
            for m in range(micro):
                tokens, targets = batches[(step * world_size + rank) * micro + m]
                loss = model.loss(tokens, targets)
                loss.backward()
                per_rank.append(loss.item())
            current = [p.grad.clone() for p in model.parameters()]
            grads = current if grads is None else [g + c for g, c in zip(grads, current)]
        for p, g in zip(model.parameters(), grads):
            p.grad = g / world_size
        if before_step is not None:
            before_step(model)
        opt.step()
        losses.append(per_rank)
    return losses


def sharded_training(
    model, rank: int, world_size: int, batches, steps: int, micro: int = 1, lr: float = 1e-2
):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    losses = []
    for step in range(steps):
        for m in range(micro):
            model.set_requires_gradient_sync(m == micro - 1)
            tokens, targets = batches[(step * world_size + rank) * micro + m]
            loss = model.loss(tokens, targets)
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses
