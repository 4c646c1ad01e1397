"""The demo's ranks: each builds the same model, shards it into one bucket per layer plus
an outer bucket (embedding, final norm, head), and trains it with AdamW on its own slice
of a synthetic data set; rank 0 prints one line per step, the parent what each bucket
communicated and how far the loss fell. The command line is ``flexshard.demo.cli``."""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import flexshard as fs
from flexshard.trainer.launch import spawn_local

from .model import TinyTransformer, TransformerConfig, make_batches

CFG = TransformerConfig(vocab=61, dim=48, heads=4, hidden=97, layers=4, seq=32)
BATCH = 8  # sequences per rank per step
LR = 3e-3


def mixed_placement(fqn: str, param: nn.Parameter) -> fs.Placement:
    """One bucket, four placements, still one all-gather and one reduce-scatter."""
    if param.ndim < 2:
        return fs.FlatShard()  # norms and biases: tiny, packed flat across ranks
    if fqn.endswith("qkv.weight"):
        return fs.BlockShard((CFG.dim // CFG.heads, CFG.dim))  # whole rows of one head
    if fqn.endswith("up.weight"):
        return fs.Owned()  # whole matrix on one rank
    return fs.Shard(0)


Policy = fs.Placement | Callable[[str, nn.Parameter], fs.Placement]

PLACEMENTS: dict[str, Policy] = {
    "mixed": mixed_placement,
    "shard0": fs.Shard(0),
    "owned": fs.Owned(),
    "block": fs.BlockShard((8, 8)),
    "flat": fs.FlatShard(),
}


def bucket_specs(placement: Policy) -> list[fs.BucketSpec]:
    layers = [
        fs.BucketSpec(f"layers.{i}.*", placement=placement, name=f"layer{i}")
        for i in range(CFG.layers)
    ]
    return [*layers, fs.BucketSpec(["embed.*", "norm.*", "head.*"], placement, name="outer")]


def learnable_batches(steps: int, world_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random tokens whose target is a fixed hidden permutation of the token: the loss
    starts near ln(vocab) and falls as the model learns the permutation."""
    permutation = torch.randperm(CFG.vocab, generator=torch.Generator().manual_seed(1))
    batches = make_batches(CFG, steps * world_size, batch=BATCH, seed=0)
    return [(tokens, permutation[tokens]) for tokens, _ in batches]


def train(rank: int, world_size: int, placement_name: str, steps: int) -> dict[str, object]:
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)  # the same initial weights on every rank
    model = TinyTransformer(CFG)
    total_params = sum(p.numel() for p in model.parameters())
    model = fs.flex_shard(model, mesh=mesh, buckets=bucket_specs(PLACEMENTS[placement_name]))
    local_params = sum(p.to_local().numel() for p in model.parameters())
    # the optimizer sees only this rank's shards, so it is built after sharding
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    batches = learnable_batches(steps, world_size)
    losses = []
    for step in range(steps):
        start = time.perf_counter()
        tokens, targets = batches[step * world_size + rank]
        loss = model.loss(tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        # the loss of the global batch: mean over ranks (not counted in comm_stats)
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss, op=dist.ReduceOp.AVG)
        ms = 1000 * (time.perf_counter() - start)
        losses.append(global_loss.item())
        if rank == 0:
            line = f"step {step + 1:3d}/{steps}  loss {losses[-1]:.4f}  {ms:6.1f} ms/step"
            print(line, flush=True)
    return {
        "losses": losses,
        "stats": model.comm_stats(),
        "total_params": total_params,
        "local_params": local_params,
    }


def print_summary(results: list[dict[str, object]], placement: str, seconds: float) -> None:
    first = results[0]
    stats: dict[str, dict[str, int]] = first["stats"]  # type: ignore[assignment]
    steps = len(first["losses"])  # type: ignore[arg-type]
    print(f"\ncommunication on rank 0 over {steps} steps (placement '{placement}'):")
    header = f"{'bucket':<8} {'collectives':>11} {'all_gather':>10} {'reduce_scatter':>14}"
    print(f"{header} {'all_reduce':>10} {'MB sent':>9} {'MB received':>11}")
    for name, entry in stats.items():
        print(
            f"{name:<8} {entry['collectives']:>11} {entry['all_gather']:>10} "
            f"{entry['reduce_scatter']:>14} {entry['all_reduce']:>10} "
            f"{entry['bytes_sent'] / 1e6:>9.3f} {entry['bytes_received'] / 1e6:>11.3f}"
        )
    stored = ", ".join(f"rank {r}: {res['local_params']:,}" for r, res in enumerate(results))
    print(f"\nparameters: {first['total_params']:,} in the model; stored per rank: {stored}")
    losses: list[float] = first["losses"]  # type: ignore[assignment]
    print(
        f"loss: first {losses[0]:.4f} -> final {losses[-1]:.4f} "
        f"({losses[-1] / losses[0]:.1%} of first); wall {seconds:.1f} s"
    )


def _rank(rank: int, world_size: int, placement: str, steps: int, out: str) -> None:
    """One spawned rank: a gloo group on this machine, the training, its results to a
    file (a file, not a queue: nothing to drain before the parent joins the ranks)."""
    dist.init_process_group("gloo")  # the environment spawn_local gives every rank
    try:
        result = train(rank, world_size, placement, steps)
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()  # rank 0 holds the group's store: leave together
    finally:
        dist.destroy_process_group()


def run_ranks(world_size: int, placement: str, steps: int) -> list[dict[str, object]]:
    """``train`` on ``world_size`` local gloo processes; a rank's failure raises its
    traceback here."""
    with tempfile.TemporaryDirectory() as out:
        spawn_local(_rank, world_size, (world_size, placement, steps, out))
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world_size)]
