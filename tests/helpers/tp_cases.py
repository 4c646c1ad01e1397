"""Shared pieces of the tensor-parallel tests: a tiny trainer model, the single-process
reference and a dp x tp run of the same steps."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import flexshard as fs
from flexshard.trainer.config import ModelConfig, MoEConfig
from flexshard.trainer.models.model import Transformer, build_model, init_weights
from flexshard.trainer.parallel.tensor_parallel import apply_tp

SEED = 7
VOCAB = 61  # tp = 2 does not divide it: the embedding's vocabulary rows split 31 / 30
SEQ = 16
PER_RANK = 2  # sequences per data-parallel rank
LR = 1e-2
OUTER = ["tok_embeddings.*", "norm.*", "output.*"]


def model_config(
    moe: bool = False, dim: int = 32, ffn_hidden: int = 34, n_kv_heads: int = 2
) -> ModelConfig:
    """dim 32, 4 heads / 2 kv heads; ffn 34 rows split 17 / 17 over tp = 2, which
    dp = 2 then splits 9 / 8."""
    experts = MoEConfig(num_experts=4, top_k=2, first_dense_layers=1) if moe else MoEConfig()
    return ModelConfig(
        vocab_size=VOCAB,
        dim=dim,
        n_layers=2,
        n_heads=4,
        n_kv_heads=n_kv_heads,
        ffn_hidden=ffn_hidden,
        moe=experts,
    )


def batches(dp: int, steps: int, vocab: int = VOCAB) -> list[torch.Tensor]:
    """One global batch per step: ``dp * PER_RANK`` sequences of SEQ + 1 tokens."""
    gen = torch.Generator().manual_seed(SEED)
    return [torch.randint(0, vocab, (dp * PER_RANK, SEQ + 1), generator=gen) for _ in range(steps)]


def loss_of(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].reshape(-1))


def reference(cfg: ModelConfig, dp: int, steps: int) -> tuple[list[float], list[float], dict]:
    """Losses, gradient norms and final parameters of one process on the global batch."""
    model = Transformer(cfg)
    init_weights(model, SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    losses, norms = [], []
    for batch in batches(dp, steps):
        loss = loss_of(model, batch)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def quantized_reference(
    cfg: ModelConfig, dp: int, steps: int, qdq: Callable[[nn.Module], None]
) -> list[float]:
    """One process's losses where the master weights train and each forward runs on
    ``qdq``'s quantize-dequantize of them (applied in place to a copy, no grad): the
    gradient of the dequantized weights updates the master, as a quantized all-gather
    of fp32 master shards trains."""
    master = build_model(cfg)
    init_weights(master, SEED)
    opt = torch.optim.AdamW(master.parameters(), lr=LR, weight_decay=0.1)
    losses = []
    for batch in batches(dp, steps):
        model = build_model(cfg)
        model.load_state_dict(master.state_dict())
        with torch.no_grad():
            qdq(model)
        loss = loss_of(model, batch)
        loss.backward()
        for p, q in zip(master.parameters(), model.parameters()):
            p.grad = q.grad
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def tp_mesh(dp: int, tp: int) -> DeviceMesh:
    return init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp_shard", "tp"))


def build(
    cfg: ModelConfig,
    mesh: DeviceMesh,
    placement: object,
    mp_policy: object = None,
    sequence_parallel: bool = True,
) -> nn.Module:
    """The trainer's composition order: TP first, then flexshard over the dp dim."""
    model = Transformer(cfg)
    init_weights(model, SEED)
    apply_tp(model, mesh["tp"], sequence_parallel=sequence_parallel)
    specs = [
        fs.BucketSpec(f"layers.{i}.*", placement, name=f"layers.{i}") for i in range(cfg.n_layers)
    ]
    specs.append(fs.BucketSpec(OUTER, placement, name="outer"))
    return fs.flex_shard(model, mesh=mesh["dp_shard"], buckets=specs, mp_policy=mp_policy)


def train(
    model: nn.Module, mesh: DeviceMesh, steps: int, opt: torch.optim.Optimizer | None = None
) -> tuple[list[float], list[float]]:
    """Each dp rank trains on its slice of the global batch; every rank returns the
    global batch's loss (mean over dp) and the whole model's gradient norm."""
    dp_rank, dp = mesh.get_local_rank("dp_shard"), mesh.size(0)
    opt = opt or torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    losses, norms = [], []
    for batch in batches(dp, steps):
        loss = loss_of(model, batch[dp_rank * PER_RANK : (dp_rank + 1) * PER_RANK])
        loss.backward()
        norms.append(float(fs.clip_grad_norm_(model, float("inf"))))
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total, group=mesh.get_group("dp_shard"))
        losses.append(total.item() / dp)
    return losses, norms


def trainer_muon(mesh: DeviceMesh | None, steps: int) -> list[float]:
    """The trainer's Muon recipe (``placement = "muon"`` buckets: per-head BlockShard
    q/k/v, Owned matrices; DistMuon + AdamW with per-head row blocks) under dp x tp,
    or in one process when ``mesh`` is None; returns the global batch's losses."""
    from flexshard.trainer.components.optimizers import build_optimizer
    from flexshard.trainer.config import config_from_dict
    from flexshard.trainer.parallel.sharding import bucket_specs

    cfg = config_from_dict(
        {
            "model": {"vocab_size": 256, "dim": 32, "n_heads": 4, "n_kv_heads": 2},
            "training": {"optimizer": "muon", "lr": 0.01, "muon_lr": 0.01},
            "parallelism": {"placement": "muon"},
        }
    )
    model = Transformer(cfg.model)
    init_weights(model, SEED)
    dp, dp_rank = 1, 0
    if mesh is not None:
        dp, dp_rank = mesh.size(0), mesh.get_local_rank("dp_shard")
        apply_tp(model, mesh["tp"])
        model = fs.flex_shard(model, mesh=mesh["dp_shard"], buckets=bucket_specs(cfg, model, dp))
    opt = build_optimizer(model, cfg.training, cfg.model)
    losses = []
    for batch in batches(2, steps, vocab=256):  # the trainer's byte vocabulary
        part = batch if mesh is None else batch[dp_rank * PER_RANK : (dp_rank + 1) * PER_RANK]
        loss = loss_of(model, part)
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if mesh is not None:
            dist.all_reduce(total, group=mesh.get_group("dp_shard"))
        losses.append(total.item() / dp)
    return losses


def block_or_shard(fqn: str, param: nn.Parameter) -> fs.Placement:
    return fs.BlockShard((8, 16)) if param.ndim >= 2 else fs.Shard(0)


def owned_or_flat(fqn: str, param: nn.Parameter) -> fs.Placement:
    return fs.Owned() if param.ndim >= 2 else fs.FlatShard()
